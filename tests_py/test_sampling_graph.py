"""Per-request sampled verification on the GPU (kdt_verify_sample_batch_cuda through
kdtree.verify_sample_from_logits): the same draws and walks as the host path (checked
against a float64 reference in tests_py/test_sampling.py), bit-identity with the scalar
call when nothing is cut, out= rewritten whole, and the call captured in a CUDA graph with
device seeds and offsets that the graph itself advances: 1,000 replays draw from the
target's cut distribution (a chi-square test with fixed seeds and a 1e-4 critical value,
so the outcome is deterministic and a correct kernel passes), and a replay equals the
eager call with the same settings.

Needs torch with CUDA and a libkdtree built with CUDA; skipped elsewhere with the reason.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kdtree
from kdtree.core import sampling
from test_sampling import boosted_logits as _boosted_logits

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests use torch tensors)")

pytestmark = pytest.mark.gpu

KDT_ERR_VALUE = 4
FIELDS = ("accepted_nodes", "accept_length", "bonus_token", "request_status")


@pytest.fixture(scope="module")
def cuda(cuda_device):
    if not torch.cuda.is_available():
        pytest.skip("torch.cuda.is_available() is false (torch without CUDA, or no GPU)")
    return cuda_device


def host(x):
    return x.detach().cpu().numpy()


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square with df degrees of freedom at p = 1e-4 (z: the
    normal quantile), by the Wilson-Hilferty approximation (good to ~1% for df >= 1)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def trees_pair(rng, batch, vocab, cuda, budget=10, depth=4, width=3):
    """The same trees built on the host and on the GPU (bit-identical builders)."""
    lp = np.sort(np.log(rng.dirichlet(np.ones(vocab), size=(batch, depth))), axis=-1)[..., ::-1]
    lp = np.ascontiguousarray(lp[..., :width]).astype(np.float32)
    ids = np.argsort(-rng.random((batch, depth, vocab)), axis=-1)[..., :width].astype(np.int32)
    roots = np.zeros(batch, np.int32)
    cpu = kdtree.build_trees(lp, ids, budget, root_tokens=roots)
    gpu = kdtree.build_trees(torch.from_numpy(lp).to(cuda), torch.from_numpy(ids).to(cuda), budget,
                             root_tokens=roots)
    return cpu, gpu


def boosted_logits(rng, trees, vocab, scale=2.0, boost=4.0):
    return _boosted_logits(rng, trees, vocab, scale=scale, boost=boost)


def settings(rng, batch):
    """Per-request settings covering greedy, no cut, top-k, top-p and both."""
    temps = np.array([[0.0, 0.7, 1.0, 1.6][b % 4] for b in range(batch)], np.float32)
    top_p = np.array([[1.0, 0.9, 1.0, 0.5, 0.97][b % 5] for b in range(batch)], np.float32)
    top_k = np.array([[0, 0, 5, 1, 40, 2][b % 6] for b in range(batch)], np.int32)
    seeds = rng.integers(0, 2**63, batch, dtype=np.int64)
    offsets = rng.integers(0, 2**40, batch, dtype=np.int64)
    return temps, top_p, top_k, seeds, offsets


def on(cuda, *arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)).to(cuda) for a in arrays]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("vocab", [19, 1025, 151_936])
def test_gpu_draws_equal_the_host_draws(cuda, dtype, vocab):
    rng = np.random.default_rng(vocab)
    batch = 12 if vocab < 100_000 else 5
    cpu, gpu = trees_pair(rng, batch, min(vocab, 500), cuda)
    x = boosted_logits(rng, cpu, vocab)
    gx = torch.from_numpy(x).to(cuda).to(getattr(torch, dtype))
    x = host(gx.float())  # the values the kernel reads
    temps, top_p, top_k, seeds, offsets = settings(rng, batch)
    want = kdtree.verify_sample_from_logits(cpu, x, temps, seed=seeds.view(np.uint64), offset=offsets.view(np.uint64),
                                            top_p=top_p, top_k=top_k, stop_tokens=[3], max_commit=[6] * batch)
    dt, dp, dk, ds, do = on(cuda, temps, top_p, top_k, seeds, offsets)
    got = kdtree.verify_sample_from_logits(gpu, gx, dt, seed=ds, offset=do, top_p=dp, top_k=dk,
                                           stop_tokens=torch.tensor([3], dtype=torch.int32, device=cuda),
                                           max_commit=torch.full((batch,), 6, dtype=torch.int64, device=cuda))
    for name in FIELDS:
        assert host(getattr(got, name)).tolist() == getattr(want, name).tolist(), name
    # The draws at the visited nodes, one by one, from the host definition.
    targets = host(got.target_tokens)
    for b in range(batch):
        for i in np.flatnonzero(targets[b] >= 0):
            one = sampling.batch_draws(x[b, i][None], temps[b], top_p[b], int(top_k[b]), int(seeds[b].view(np.uint64)),
                                       int(offsets[b].view(np.uint64)), b, [i])
            assert int(one[0]) == int(targets[b, i]), (b, i)
    # Host values (staged by the call) give the same result as device values.
    staged = kdtree.verify_sample_from_logits(gpu, gx, temps, seed=seeds.view(np.uint64),
                                              offset=offsets.view(np.uint64), top_p=top_p, top_k=top_k,
                                              stop_tokens=[3], max_commit=[6] * batch)
    for name in (*FIELDS, "target_tokens"):
        assert host(getattr(staged, name)).tolist() == host(getattr(got, name)).tolist(), name


def test_no_cut_is_bit_identical_to_the_scalar_call(cuda):
    rng = np.random.default_rng(4)
    batch, vocab = 16, 4099
    cpu, gpu = trees_pair(rng, batch, 300, cuda)
    gx = torch.from_numpy(boosted_logits(rng, cpu, vocab)).to(cuda).to(torch.bfloat16)
    for t in (0.3, 1.0, 2.2):
        old = kdtree.verify_sample_from_logits(gpu, gx, t, seed=2**40 + 3, offset=2**33 + 5)
        dt, ds, do, dp, dk = on(cuda, np.full(batch, t, np.float32), np.full(batch, 2**40 + 3, np.int64),
                                np.full(batch, 2**33 + 5, np.int64), np.ones(batch, np.float32),
                                np.where(np.arange(batch) % 2, 0, vocab).astype(np.int32))
        new = kdtree.verify_sample_from_logits(gpu, gx, dt, seed=ds, offset=do, top_p=dp, top_k=dk)
        for name in (*FIELDS, "target_tokens"):
            assert host(getattr(new, name)).tolist() == host(getattr(old, name)).tolist(), (t, name)


def test_temperature_zero_is_the_greedy_call(cuda):
    rng = np.random.default_rng(6)
    batch, vocab = 9, 777
    cpu, gpu = trees_pair(rng, batch, 200, cuda)
    gx = torch.from_numpy(boosted_logits(rng, cpu, vocab)).to(cuda)
    greedy = kdtree.verify_greedy_from_logits(gpu, gx)
    for kw in ({}, {"top_p": 0.3, "top_k": 2}):
        got = kdtree.verify_sample_from_logits(gpu, gx, 0.0, seed=1, offset=2, **kw)
        for name in (*FIELDS, "target_tokens"):
            assert host(getattr(got, name)).tolist() == host(getattr(greedy, name)).tolist(), name


def test_bad_device_settings_fail_their_request_alone(cuda):
    rng = np.random.default_rng(2)
    batch, vocab = 9, 64
    cpu, gpu = trees_pair(rng, batch, vocab, cuda)
    x = boosted_logits(rng, cpu, vocab)
    temps = np.array([1.0, np.nan, -1.0, 1e-7, np.inf, 1.0, 1.0, 1.0, 0.0], np.float32)
    top_p = np.array([0.9, 0.9, 0.9, 0.9, 0.9, 0.0, 1.5, np.nan, 0.9], np.float32)
    top_k = np.array([0, 0, 0, 0, 0, 0, 0, 0, -1], np.int32)
    want = kdtree.verify_sample_from_logits(cpu, x, temps, seed=3, offset=4, top_p=top_p, top_k=top_k,
                                            errors="status")
    dt, dp, dk, ds, do = on(cuda, temps, top_p, top_k, np.full(batch, 3, np.int64), np.full(batch, 4, np.int64))
    got = kdtree.verify_sample_from_logits(gpu, torch.from_numpy(x).to(cuda), dt, seed=ds, offset=do, top_p=dp,
                                           top_k=dk, errors="status")
    assert host(got.request_status).tolist() == [0] + [KDT_ERR_VALUE] * 8
    for name in FIELDS:
        assert host(getattr(got, name)).tolist() == getattr(want, name).tolist(), name
    assert (host(got.target_tokens)[1:] == -1).all()
    with pytest.raises(kdtree.KdtreeError, match="request 1"):
        kdtree.verify_sample_from_logits(gpu, torch.from_numpy(x).to(cuda), dt, seed=ds, offset=do, top_p=dp,
                                         top_k=dk)


def test_out_is_rewritten_whole(cuda):
    rng = np.random.default_rng(8)
    batch, vocab = 6, 300
    cpu, gpu = trees_pair(rng, batch, vocab, cuda)
    gx = torch.from_numpy(boosted_logits(rng, cpu, vocab)).to(cuda)
    dt, dp, ds, do = on(cuda, np.full(batch, 0.9, np.float32), np.full(batch, 0.8, np.float32),
                        np.arange(batch, dtype=np.int64), np.arange(batch, dtype=np.int64))
    want = kdtree.verify_sample_from_logits(gpu, gx, dt, seed=ds, offset=do, top_p=dp)
    out = kdtree.verify_sample_from_logits(gpu, gx, dt, seed=ds + 1, offset=do, top_p=dp)
    calls = (
        (lambda o: kdtree.verify_sample_from_logits(gpu, gx, dt, seed=ds, offset=do, top_p=dp, out=o), want),
        (lambda o: kdtree.verify_greedy_from_logits(gpu, gx, out=o), kdtree.verify_greedy_from_logits(gpu, gx)),
    )
    for call, expect in calls:
        for name in (*FIELDS, "target_tokens"):
            getattr(out, name).fill_(12345)
        assert call(out) is out
        for name in (*FIELDS, "target_tokens"):
            assert host(getattr(out, name)).tolist() == host(getattr(expect, name)).tolist(), name
    targets = torch.zeros((batch, gpu.budget + 1), dtype=torch.int32, device=cuda)
    for name in FIELDS:
        getattr(out, name).fill_(12345)
    assert kdtree.verify_greedy(gpu, targets, out=out) is out
    plain = kdtree.verify_greedy(gpu, targets)
    for name in FIELDS:
        assert host(getattr(out, name)).tolist() == host(getattr(plain, name)).tolist(), name
    bad = kdtree.Acceptance(out.accepted_nodes[:, :1].contiguous(), out.accept_length, out.bonus_token,
                            out.request_status, out.target_tokens)
    with pytest.raises(kdtree.KdtreeError, match="out.accepted_nodes"):
        kdtree.verify_greedy_from_logits(gpu, gx, out=bad)
    wrong = kdtree.Acceptance(out.accepted_nodes, out.accept_length.long(), out.bonus_token, out.request_status)
    with pytest.raises(kdtree.KdtreeError, match="out.accept_length"):
        kdtree.verify_greedy(gpu, targets, out=wrong)
    shared = kdtree.Acceptance(out.accepted_nodes, out.accept_length, out.accept_length, out.request_status)
    with pytest.raises(kdtree.KdtreeError, match="share memory"):
        kdtree.verify_greedy(gpu, targets, out=shared)


def star_trees(batch, cuda):
    """Root-only trees (N = 0) on the GPU: the bonus token is the root's draw."""
    lp = torch.zeros((batch, 1, 1), dtype=torch.float32, device=cuda)
    ids = torch.zeros((batch, 1, 1), dtype=torch.int32, device=cuda)
    return kdtree.build_trees(lp, ids, 0)


def cut_distribution(row, t, top_p, top_k):
    """float64 probabilities of the cut, tempered distribution of one row."""
    keep = sampling.cut(row, np.float32(t), np.float32(top_p), int(top_k))
    s = (row / np.float32(t)).astype(np.float64)
    p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    return p / p.sum()


def test_graph_replays_advance_the_offsets_and_draw_the_cut_distribution(cuda):
    batch, vocab, replays = 4, 16, 1000
    rng = np.random.default_rng(1234)
    row = (1.2 * rng.standard_normal(vocab)).astype(np.float32)
    logits = torch.from_numpy(np.tile(row, (batch, 1, 1))).to(cuda)  # [B, 1, V]
    trees = star_trees(batch, cuda)
    temps = np.array([0.8, 1.0, 1.5, 0.7], np.float32)
    top_p = np.array([1.0, 0.9, 0.8, 1.0], np.float32)
    top_k = np.array([0, 0, 6, 5], np.int32)
    dt, dp, dk = on(cuda, temps, top_p, top_k)
    seeds = torch.tensor([11, 22, 33, 44], dtype=torch.int64, device=cuda)
    offsets = torch.zeros(batch, dtype=torch.int64, device=cuda)
    stops = torch.tensor([vocab + 5], dtype=torch.int32, device=cuda)
    caps = torch.full((batch,), 4, dtype=torch.int64, device=cuda)
    kw = dict(seed=seeds, offset=offsets, top_p=dp, top_k=dk, stop_tokens=stops, max_commit=caps, errors="status")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (caches, allocator)
        out = kdtree.verify_sample_from_logits(trees, logits, dt, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kdtree.verify_sample_from_logits(trees, logits, dt, out=out, **kw)
        offsets.add_(1)
    draws = torch.empty((replays, batch), dtype=torch.int32, device=cuda)
    offsets.zero_()
    for r in range(replays):
        graph.replay()
        draws[r].copy_(out.bonus_token)
    assert host(offsets).tolist() == [replays] * batch
    assert (host(out.request_status) == 0).all()
    d = host(draws)
    for b in range(batch):
        p = cut_distribution(row, temps[b], top_p[b], top_k[b])
        counts = np.bincount(d[:, b], minlength=vocab)
        assert counts[p == 0].sum() == 0, f"request {b} drew a token its cut removed"
        expect = replays * p
        order = np.argsort(expect)  # pool the cells expecting fewer than 5 draws
        cells_o, cells_e, acc_o, acc_e = [], [], 0.0, 0.0
        for v in order:
            if p[v] == 0:
                continue
            acc_o += counts[v]
            acc_e += expect[v]
            if acc_e >= 5:
                cells_o.append(acc_o)
                cells_e.append(acc_e)
                acc_o = acc_e = 0.0
        if acc_e > 0 and cells_e:
            cells_o[-1] += acc_o
            cells_e[-1] += acc_e
        stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e, strict=True))
        df = max(len(cells_e) - 1, 1)
        assert stat < chi2_critical(df), f"request {b}: chi-square {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"
        # Consecutive replays are independent: repeats happen at the rate sum(p^2).
        repeats = int((d[1:, b] == d[:-1, b]).sum())
        q = float((p**2).sum())
        sigma = math.sqrt((replays - 1) * q * (1 - q))
        assert abs(repeats - (replays - 1) * q) < 5 * sigma + 1, (b, repeats, q)
    # A replay equals the eager call with the same seeds and offsets.
    at = offsets.clone()
    graph.replay()
    replayed = {name: host(getattr(out, name)).copy() for name in (*FIELDS, "target_tokens")}
    eager = kdtree.verify_sample_from_logits(trees, logits, dt, seed=seeds, offset=at, top_p=dp, top_k=dk,
                                             stop_tokens=stops, max_commit=caps)
    for name, value in replayed.items():
        assert host(getattr(eager, name)).tolist() == value.tolist(), name


def test_greedy_calls_capture_with_device_stop_tokens_and_caps(cuda):
    rng = np.random.default_rng(3)
    batch, vocab = 5, 100
    cpu, gpu = trees_pair(rng, batch, vocab, cuda)
    gx = torch.from_numpy(boosted_logits(rng, cpu, vocab)).to(cuda)
    stops = torch.tensor([7, 9], dtype=torch.int32, device=cuda)
    caps = torch.tensor([0, 1, 2, 3, 50], dtype=torch.int64, device=cuda)
    kw = dict(stop_tokens=stops, max_commit=caps, errors="status")
    out = kdtree.verify_greedy_from_logits(gpu, gx, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kdtree.verify_greedy_from_logits(gpu, gx, out=out, **kw)
    for name in (*FIELDS, "target_tokens"):
        getattr(out, name).fill_(-7)
    graph.replay()
    want = kdtree.verify_greedy_from_logits(cpu, host(gx), stop_tokens=[7, 9], max_commit=host(caps))
    for name in FIELDS:
        assert host(getattr(out, name)).tolist() == getattr(want, name).tolist(), name
