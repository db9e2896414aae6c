"""Vocabulary-sharded top-k: kdtree.topk_shard on each slice, kdtree.topk_merge of the
slices' summaries, against kdtree.topk_logprobs on the gathered rows (ids and order
exactly; log-probs bit for bit on these inputs, the contract being one float32 ulp) and
against a float64 numpy log-softmax; then the same through torch.distributed (gloo, one
process per rank) with kdtree.distributed.topk_logprobs_sharded.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kdtree
from kdtree import _native as _lib


def split_points(rng, vocab, shards, k):
    """Uneven cut points, every shard holding at least k entries."""
    while True:
        cuts = np.sort(rng.choice(np.arange(1, vocab), shards - 1, replace=False))
        edges = np.concatenate([[0], cuts, [vocab]])
        if np.all(np.diff(edges) >= k):
            return edges


def sharded(logits, edges, k):
    parts = [kdtree.topk_shard(logits[..., a:b], k, int(a)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    stack = [np.stack([p[i] for p in parts]) for i in range(4)]
    return kdtree.topk_merge(*stack, logits.shape[-1])


def reference_logprobs(logits):
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (x - m) - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("shards", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [1, 16, 64])
def test_merge_equals_the_gathered_top_k(shards, k):
    rng = np.random.default_rng(shards * 100 + k)
    vocab = 4099
    logits = (rng.standard_normal((3, 5, vocab)) * 4).astype(np.float32)
    # Ties across shard boundaries and inside a shard, and -inf entries.
    logits[0, 0, :200] = 7.25
    logits[1, 2, ::3] = -np.inf
    logits[2, 4] = np.round(logits[2, 4])  # many exact ties
    edges = split_points(rng, vocab, shards, k)
    got = sharded(logits, edges, k)
    want = kdtree.topk_logprobs(logits, k)
    assert np.array_equal(got.ids, want.ids)
    assert np.array_equal(got.logprobs, want.logprobs)
    ref = reference_logprobs(logits)
    taken = np.take_along_axis(ref, want.ids.astype(np.int64), -1)
    assert np.abs(got.logprobs - taken).max() <= 1e-6 * np.abs(taken).max() + 1e-7


def test_merge_takes_a_list_of_shards():
    """topk_merge(shards, vocab=V): the TopKShard list stacked here (numpy and torch), the
    same result as the stacked fields; a list with fields, or no vocab, is refused."""
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((3, 5, 400)) * 3).astype(np.float32)
    parts = [kdtree.topk_shard(logits[..., a:b], 6, a) for a, b in ((0, 150), (150, 260), (260, 400))]
    stacked = kdtree.topk_merge(*[np.stack([p[f] for p in parts]) for f in range(4)], 400)
    listed = kdtree.topk_merge(parts, vocab=400)
    np.testing.assert_array_equal(listed.ids, stacked.ids)
    np.testing.assert_array_equal(listed.logprobs, stacked.logprobs)
    np.testing.assert_array_equal(listed.ids, kdtree.topk_logprobs(logits, 6).ids)
    torch = pytest.importorskip("torch")
    as_torch = [kdtree.TopKShard(*(torch.from_numpy(np.ascontiguousarray(f)) for f in p)) for p in parts]
    np.testing.assert_array_equal(np.asarray(kdtree.topk_merge(as_torch, vocab=400).ids), stacked.ids)
    with pytest.raises(kdtree.KdtreeTypeError, match="pass vocab= alone"):
        kdtree.topk_merge(parts, parts[0].ids, vocab=400)
    with pytest.raises(kdtree.KdtreeTypeError, match="a sequence of TopKShard, vocab=V"):
        kdtree.topk_merge(parts)


def test_log_probs_near_zero_keep_their_precision():
    # A confident row: the top log-prob is about -exp(-37.25) = -6.6e-17, far below the
    # float64 resolution of a sum near 1; log1p of the rest keeps it (not 0, not -2.2e-16).
    x = np.array([[0.0, -37.25, -37.25], [0.0, -30.0, -31.0]], np.float32)
    got = sharded(x, np.array([0, 2, 3]), 1)
    want = kdtree.topk_logprobs(x, 1)
    assert np.array_equal(got.logprobs, want.logprobs)
    exact = -np.log1p(np.exp(-37.25) * 2), -np.log1p(np.exp(-30.0) + np.exp(-31.0))
    assert np.allclose(want.logprobs[:, 0], exact, rtol=1e-6, atol=0)
    # Random confident rows over four shards: every log-prob within one float32 ulp.
    rng = np.random.default_rng(9)
    rows = (rng.standard_normal((256, 4000)) * 2).astype(np.float32)
    rows[np.arange(256), rng.integers(0, 4000, 256)] = 30.0
    edges = split_points(rng, 4000, 4, 8)
    got, want = sharded(rows, edges, 8), kdtree.topk_logprobs(rows, 8)
    assert np.array_equal(got.ids, want.ids)
    assert np.all(np.abs(got.logprobs - want.logprobs) <= np.spacing(np.abs(want.logprobs)))


def test_a_shard_with_only_minus_inf_and_k_beyond_the_finite_entries():
    vocab, k = 40, 12
    logits = np.full((2, vocab), -np.inf, np.float32)
    logits[0, 35:] = [1.0, 2.0, 2.0, -1.0, 0.5]  # all finite entries in the last shard
    logits[1, :] = np.linspace(-3, 3, vocab, dtype=np.float32)
    edges = np.array([0, 12, 24, 40])
    got = sharded(logits, edges, k)
    want = kdtree.topk_logprobs(logits, k)
    assert np.array_equal(got.ids, want.ids) and np.array_equal(got.logprobs, want.logprobs)
    # Row 0: five finite log-probs, then -inf entries ordered by id.
    assert np.isneginf(got.logprobs[0, 5:]).all()
    assert got.ids[0, 5:].tolist() == list(range(7))
    shard = kdtree.topk_shard(logits[:, :12], 3, 0)
    assert np.isneginf(shard.max[0]) and shard.sum_rest[0] == 0.0


def test_shard_and_merge_refuse_bad_input():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 3, 50)).astype(np.float32)
    parts = [kdtree.topk_shard(logits[..., :25], 4, 0), kdtree.topk_shard(logits[..., 25:], 4, 25)]
    lg, ids, mx, se = (np.stack([p[i] for p in parts]) for i in range(4))
    assert parts[1].ids.min() >= 25

    bad = logits.copy()
    bad[1, 2, 7] = np.nan
    with pytest.raises(kdtree.KdtreeError, match=r"request 1, position 2 .*column 7: NaN logit"):
        kdtree.topk_shard(bad, 4, 0)
    with pytest.raises(kdtree.KdtreeError, match="k must be in"):
        kdtree.topk_shard(logits[..., :3], 4, 0)

    swapped = lg.copy()
    swapped[1, 0, 1, [1, 2]] = swapped[1, 0, 1, [2, 1]]
    with pytest.raises(kdtree.KdtreeError, match=r"shard 1, row 1, entry 2: .*sorted best first"):
        kdtree.topk_merge(swapped, ids, mx, se, 50)
    out_of_range = ids.copy()
    out_of_range[0, 1, 0, 3] = 50
    with pytest.raises(kdtree.KdtreeError, match=r"shard 0, row 3, entry 3: id 50 is outside \[0, 50\)"):
        kdtree.topk_merge(lg, out_of_range, mx, se, 50)
    big_rest = se.copy()
    big_rest[1, 0, 0] = 1e308  # (terms of at most 1 each: at most vocab of them)
    with pytest.raises(kdtree.KdtreeError, match=r"shard 1, row 0: .*not a shard's"):
        kdtree.topk_merge(lg, ids, mx, big_rest, 50)
    high_max = mx.copy()
    high_max[0, 1, 2] += 1.0  # above the list's best logit
    with pytest.raises(kdtree.KdtreeError, match=r"shard 0, row 5: max .*must be the max"):
        kdtree.topk_merge(lg, ids, high_max, se, 50)
    twice = [np.stack([f[0], f[0]]) for f in (lg, ids, mx, se)]
    with pytest.raises(kdtree.KdtreeError, match=r"shard 1, row 0: id \d+ is listed by two shards"):
        kdtree.topk_merge(*twice, 50)
    with pytest.raises(kdtree.KdtreeError, match="shards"):
        kdtree.topk_merge(lg[:0], ids[:0], mx[:0], se[:0], 50)
    with pytest.raises(kdtree.KdtreeError, match="shape"):
        kdtree.topk_merge(lg, ids[:, :1], mx, se, 50)
    all_inf = np.full_like(mx, -np.inf)
    with pytest.raises(kdtree.KdtreeError, match="not a shard's"):
        kdtree.topk_merge(lg, ids, all_inf, se + 1.0, 50)
    with pytest.raises(kdtree.KdtreeError, match="every logit is -inf"):
        kdtree.topk_merge(np.full_like(lg, -np.inf), np.sort(ids, -1), all_inf, np.zeros_like(se), 50)
    out = kdtree.topk_merge(lg, ids, mx, se, 50)
    assert np.array_equal(out.ids, kdtree.topk_logprobs(logits, 4).ids)


def test_merge_leaves_nothing_written_on_error():
    lib = _lib.load()
    lg = np.array([[[3.0, 1.0]], [[2.0, 5.0]]], np.float32)  # shard 1's list is unsorted
    ids = np.array([[[0, 1]], [[2, 3]]], np.int32)
    mx = np.array([[3.0], [5.0]], np.float32)
    se = np.array([[1.2], [1.1]], np.float64)
    out_lp = np.full((1, 2), 9.0, np.float32)
    out_ids = np.full((1, 2), 9, np.int32)
    with pytest.raises(kdtree.KdtreeError):
        lib.kdt_topk_merge_cpu(lg.ctypes.data, ids.ctypes.data, mx.ctypes.data, se.ctypes.data, 2, 1, 2, 4,
                               out_lp.ctypes.data, out_ids.ctypes.data)
    assert (out_lp == 9.0).all() and (out_ids == 9).all()


_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from kdtree import KdtreeError
    from kdtree.distributed import topk_logprobs_sharded

    rank, world, edges, mode, out = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rng = np.random.default_rng(7)
    logits = torch.from_numpy((rng.standard_normal((4, 6, edges[-1])) * 3).astype(np.float32)).bfloat16()
    lo, hi = edges[rank], edges[rank + 1]
    local = logits[..., lo:hi].clone()
    if mode == "nan" and rank == 1:
        local[2, 3, 5] = float("nan")
    offset = lo + 1 if mode == "offset" and rank == 2 else lo
    if mode == "dtype" and rank == 1:
        local = local.half()
    k = 32
    if rank == 1 and mode == "scalar":  # a 0-d tensor: no vocabulary axis
        local = torch.tensor(1.0)
    if rank == 1 and mode == "k-none":
        k = None
    if rank == 1 and mode == "lead":  # nine leading axes, the others two
        local = local.reshape((1,) * 7 + tuple(local.shape))
    if rank == 1 and mode == "ints":
        local = local.to(torch.int32)
    if mode == "k0":
        k = 0
    try:
        got = topk_logprobs_sharded(local, k, offset, edges[-1])
        np.savez(out, logprobs=got.logprobs.numpy(), ids=got.ids.numpy(), logits=logits.float().numpy())
    except KdtreeError as exc:
        open(out + ".err", "w").write(str(exc))
""")


def run_ranks(spawn_ranks, tmp_path, mode, world=3, edges=(0, 1000, 1900, 3001)):
    outs = [str(tmp_path / f"{mode}{r}") for r in range(world)]
    spawn_ranks(_WORKER, world, lambda r: [r, world, json.dumps(list(edges)), mode, outs[r]], timeout=120)
    return outs


def test_torch_distributed_gloo_ranks_get_the_gathered_top_k(spawn_ranks, tmp_path):
    results = [np.load(o + ".npz") for o in run_ranks(spawn_ranks, tmp_path, "ok")]
    want = kdtree.topk_logprobs(results[0]["logits"], 32)
    for r in results:
        assert np.array_equal(r["ids"], want.ids)
        assert np.array_equal(r["logprobs"], want.logprobs)


def test_one_rank_failing_fails_every_rank_at_once(spawn_ranks, tmp_path):
    errors = [Path(o + ".err").read_text() for o in run_ranks(spawn_ranks, tmp_path, "nan")]
    assert "request 2, position 3" in errors[1] and "column 5: NaN logit" in errors[1]
    for e in (errors[0], errors[2]):
        assert "rank(s) [1] failed in topk_shard" in e


def test_ranks_whose_slices_do_not_tile_the_vocabulary_fail_alike(spawn_ranks, tmp_path):
    errors = [Path(o + ".err").read_text() for o in run_ranks(spawn_ranks, tmp_path, "offset")]
    assert len(set(errors)) == 1
    assert "do not tile [0, 3001): rank 2 starts at 1901, leaving a gap after 1900" in errors[0]


def test_ranks_whose_logits_differ_in_width_fail_alike(spawn_ranks, tmp_path):
    """The summaries' width follows the logits' dtype, so a rank with float16 logits among
    bfloat16 ones is refused on every rank before the summaries are gathered."""
    errors = [Path(o + ".err").read_text() for o in run_ranks(spawn_ranks, tmp_path, "dtype")]
    assert len(set(errors)) == 1
    assert "rank 1 passes float16 logits, rank 0 bfloat16" in errors[0]


@pytest.mark.parametrize("mode, said", [("scalar", "floating tensor [..., V_rank], got torch.float32 ()"),
                                        ("k-none", "k must be an int"), ("lead", "9 leading axes; at most 8"),
                                        ("ints", "floating tensor"), ("k0", "k must be in [1, 1024], got 0")])
def test_a_rank_with_bad_arguments_fails_every_rank_at_once(spawn_ranks, tmp_path, mode, said):
    """A rank whose own arguments are wrong (no vocabulary axis, k not an int, too many
    leading axes, integer logits; k = 0 on every rank) raises its own error, and the other
    ranks name it, instead of waiting in the all-gather it never joins."""
    errors = [Path(o + ".err").read_text() for o in run_ranks(spawn_ranks, tmp_path, mode)]
    if mode == "k0":
        assert all(said in e for e in errors), errors
        return
    assert said in errors[1], errors[1]
    for e in (errors[0], errors[2]):
        assert "rank(s) [1] failed in topk_shard" in e, e


_DEVICE_FORM_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    import kdtree
    from kdtree import distributed

    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rng = np.random.default_rng(21)
    edges = [0, 333, 700]
    logits = (rng.standard_normal((2, 5, 700)) * 3).astype(np.float32)
    logits[0, 0, 100:200] = 6.0  # ties inside and across the slices
    results = {}
    for name in ("float32", "float16", "bfloat16"):
        full = torch.from_numpy(logits).to(getattr(torch, name))
        local = full[..., edges[rank]:edges[rank + 1]].contiguous()
        for k in (1, 7):
            got = distributed._topk_logprobs_sharded_cuda(local, k, edges[rank], 700, None)
            want = kdtree.topk_logprobs(full.float().numpy(), k)
            results[f"{name} {k}"] = [bool(np.array_equal(np.asarray(got.ids), want.ids)),
                                      bool(np.array_equal(np.asarray(got.logprobs), want.logprobs)),
                                      bool((np.asarray(got.row_status) == 0).all())]
    json.dump(results, open(out, "w"))
""")


def test_the_gpu_form_on_cpu_tensors_in_a_gloo_world(spawn_ranks, tmp_path):
    """The NCCL path of topk_logprobs_sharded (shard_summary, one all_gather_into_tensor,
    the merge with statuses) run on CPU tensors over gloo: every rank gets the gathered
    rows' top-k exactly, from float32 and from 16-bit summaries, odd and even k."""
    outs = [str(tmp_path / f"form{r}.json") for r in range(2)]
    spawn_ranks(_DEVICE_FORM_WORKER, 2, lambda r: [r, 2, outs[r]], timeout=120)
    for o in outs:
        results = json.loads(Path(o).read_text())
        assert len(results) == 6 and all(all(v) for v in results.values()), results


def test_summary_width_takes_torch_dtypes_only():
    torch = pytest.importorskip("torch")
    from kdtree.distributed import summary_width

    assert [summary_width(5, d) for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)] == \
        [13, 13, 11, 11]
    for bad in (np.float16, "float16", None):
        with pytest.raises(kdtree.KdtreeTypeError, match="torch dtype"):
            summary_width(64, bad)
    with pytest.raises(kdtree.KdtreeError, match="k must be in"):
        summary_width(0, torch.float32)


# ---- the merge on the GPU (kdt_topk_merge_cuda) --------------------------------------------------


def _to_device(torch, device, arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


_MERGE_VARIANTS = {"ranking": 1, "paths, 1 warp": 2, "paths, 2 warps": 3, "paths, 4 warps": 4, "paths, 8 warps": 5}


@pytest.fixture(params=list(_MERGE_VARIANTS))
def merge_kernel(request, cuda_device):
    """The kdt_topk_merge_cuda kernel a test runs, forced through native/kdt_testing.h: the
    ranking kernel (one block of 256 threads a row) or the merge-path kernel with 1, 2, 4 or
    8 warps a row (where its shared memory fits; the automatic choice)."""
    raw = _lib.load()
    assert raw.kdt_testing_set_topk_merge(_MERGE_VARIANTS[request.param]) == 0
    yield request.param
    raw.kdt_testing_set_topk_merge(0)


# A twin of one (logit, id) in two shards' lists: merged at ranks 3 and 4 of a top-4 (only
# the first kept: accepted), or at ranks 2 and 3 (both kept: the duplicate error).
_TWIN_AT_K = (np.array([[[5, 4, 3, 2]], [[2, 1, 0.5, 0.25]]], np.float32),
              np.array([[[0, 1, 2, 9]], [[9, 20, 21, 22]]], np.int32))
_TWIN_IN_K = (np.array([[[5, 4, 2, 1.75]], [[2, 1, 0.5, 0.25]]], np.float32),
              np.array([[[0, 1, 9, 3]], [[9, 20, 21, 22]]], np.int32))


def _twin_fields(case):
    lg, ids = case
    return lg, ids, lg[:, :, 0].copy(), np.array([[1.0], [2.0]])


def test_a_twin_just_past_the_first_k_is_merged_once():
    """The CPU merge meets the second copy of a twin only inside the first k: at ranks 3 and
    4 of a top-4 the row merges (the log-probs against a float64 log-sum-exp of the two
    shards), at ranks 2 and 3 it is the duplicate error."""
    lg, ids, mx, rest = _twin_fields(_TWIN_AT_K)
    out = kdtree.topk_merge(lg, ids, mx, rest, 30)
    assert out.ids.tolist() == [[0, 1, 2, 9]]
    lse = 5.0 + np.log1p(1.0 + np.exp(2.0 - 5.0) * (1.0 + 2.0))
    np.testing.assert_allclose(out.logprobs[0], np.array([5, 4, 3, 2]) - lse, rtol=0, atol=1e-6)
    with pytest.raises(kdtree.KdtreeError, match="id 9 is listed by two shards"):
        kdtree.topk_merge(*_twin_fields(_TWIN_IN_K), 30)


@pytest.mark.gpu
def test_gpu_merge_twins_as_the_cpu(cuda_device, merge_kernel):
    torch = pytest.importorskip("torch")
    cpu = kdtree.topk_merge(*_twin_fields(_TWIN_AT_K), 30)
    gpu = kdtree.topk_merge(*_to_device(torch, cuda_device, _twin_fields(_TWIN_AT_K)), 30, errors="status")
    assert gpu.ids.cpu().tolist() == cpu.ids.tolist() and int(gpu.row_status.sum()) == 0
    ulps = np.abs(gpu.logprobs.cpu().numpy().view(np.int32).astype(np.int64) - cpu.logprobs.view(np.int32))
    assert (ulps <= 1).all()
    bad = kdtree.topk_merge(*_to_device(torch, cuda_device, _twin_fields(_TWIN_IN_K)), 30, errors="status")
    assert bad.row_status.cpu().tolist() == [_lib.STATUS["KDT_ERR_VALUE"]]
    assert np.isnan(bad.logprobs.cpu().numpy()).all() and bad.ids.cpu().tolist() == [[0, 1, 2, 3]]


@pytest.mark.gpu
def test_gpu_merge_kernels_give_the_same_bits(cuda_device):
    """The ranking kernel and the merge-path kernel at 1, 2, 4 and 8 warps a row: the same
    log-probs bit for bit, the same ids and statuses, over many rows, shard counts and k
    (ties, -inf stretches and bad rows included)."""
    torch = pytest.importorskip("torch")
    raw = _lib.load()
    rng = np.random.default_rng(12)
    try:
        for shards, k in [(1, 5), (2, 64), (3, 33), (8, 64), (8, 96), (13, 17), (32, 4), (40, 2)]:
            vocab = max(3001, shards * k * 2)
            logits = np.round(rng.standard_normal((3, 50, vocab)) * 3, 1).astype(np.float32)
            logits[0, :5, ::2] = -np.inf
            edges = split_points(rng, vocab, shards, k)
            parts = [kdtree.topk_shard(logits[..., a:b], k, int(a)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
            stack = [np.stack([p[i] for p in parts]) for i in range(4)]
            stack[3][0, 0, 7] = -1.0  # a bad row: row 7
            bad = np.zeros(150, bool)
            bad[7] = True
            dev = _to_device(torch, cuda_device, stack)
            outs = []
            for variant in _MERGE_VARIANTS.values():
                assert raw.kdt_testing_set_topk_merge(variant) == 0
                top = kdtree.topk_merge(*dev, vocab, errors="status")
                outs.append([t.cpu().numpy() for t in (top.logprobs, top.ids, top.row_status)])
            lp1, id1, st1 = outs[0]
            for lp2, id2, st2 in outs[1:]:
                np.testing.assert_array_equal(lp1.view(np.int32), lp2.view(np.int32))
                np.testing.assert_array_equal(id1, id2)
                np.testing.assert_array_equal(st1, st2)
            assert ((st1.reshape(-1) != 0) == bad).all()
    finally:
        raw.kdt_testing_set_topk_merge(0)


@pytest.mark.gpu
@pytest.mark.parametrize("shards, k", [(1, 8), (2, 64), (8, 64), (5, 1), (3, 300)])
def test_gpu_merge_equals_the_cpu_merge(cuda_device, merge_kernel, shards, k):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(shards * 31 + k)
    vocab = 4099
    logits = (rng.standard_normal((4, 16, vocab)) * 4).astype(np.float32)
    logits[0, 0, :200] = 7.25  # ties across shard boundaries
    logits[1, 2, ::3] = -np.inf
    logits[2, 4] = np.round(logits[2, 4])
    edges = split_points(rng, vocab, shards, k)
    parts = [kdtree.topk_shard(logits[..., a:b], k, int(a)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    stack = [np.stack([p[i] for p in parts]) for i in range(4)]
    cpu = kdtree.topk_merge(*stack, vocab)
    gpu = kdtree.topk_merge(*_to_device(torch, cuda_device, stack), vocab)
    np.testing.assert_array_equal(gpu.ids.cpu().numpy(), cpu.ids)
    got, want = gpu.logprobs.cpu().numpy(), cpu.logprobs
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert (ulps <= 1).all(), f"log-probs differ by up to {ulps.max()} ulp"
    assert (gpu.row_status.cpu().numpy() == 0).all()


@pytest.mark.gpu
def test_gpu_merge_flags_the_rows_the_cpu_rejects(cuda_device, merge_kernel):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 3, 50)).astype(np.float32)
    parts = [kdtree.topk_shard(logits[..., :25], 4, 0), kdtree.topk_shard(logits[..., 25:], 4, 25)]
    lg, ids, mx, se = (np.stack([p[i] for p in parts]) for i in range(4))
    lg[1, 0, 1, [1, 2]] = lg[1, 0, 1, [2, 1]]      # row 1: unsorted
    ids[0, 1, 0, 3] = 50                          # row 3: id out of range
    se[1, 1, 2] = 1e308                           # row 5: a rest no shard gives
    out = kdtree.topk_merge(*_to_device(torch, cuda_device, (lg, ids, mx, se)), 50, errors="status")
    status = out.row_status.cpu().numpy().reshape(-1)
    value = _lib.STATUS["KDT_ERR_VALUE"]
    assert status.tolist() == [0, value, 0, value, 0, value]
    bad_rows = out.logprobs.cpu().numpy().reshape(6, 4)[[1, 3, 5]]
    assert np.isnan(bad_rows).all()
    assert (out.ids.cpu().numpy().reshape(6, 4)[[1, 3, 5]] == np.arange(4)).all()
    good = kdtree.topk_logprobs(logits, 4).ids.reshape(6, 4)
    np.testing.assert_array_equal(out.ids.cpu().numpy().reshape(6, 4)[[0, 2, 4]], good[[0, 2, 4]])
    with pytest.raises(kdtree.KdtreeError, match="row 1"):
        kdtree.topk_merge(*_to_device(torch, cuda_device, (lg, ids, mx, se)), 50)
    # The same shard twice: a duplicate within the first k.
    twice = [np.stack([f[0], f[0]]) for f in (lg, ids, mx, se)]
    out = kdtree.topk_merge(*_to_device(torch, cuda_device, twice), 50, errors="status")
    assert (out.row_status.cpu().numpy() == _lib.STATUS["KDT_ERR_VALUE"]).all()


def test_shard_summary_packs_topk_shard_bit_for_bit_on_cpu_tensors():
    """The packed summary of float32 logits (int32, 2 k + 3 a row) holds topk_shard's fields bit for bit
    (the float64 rest within rounding of another summation order); unpack_summary reads
    them back and refuses another layout."""
    torch = pytest.importorskip("torch")
    from kdtree.distributed import shard_summary, unpack_summary

    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((2, 3, 500)) * 3).astype(np.float32)
    logits[0, 1, 40:60] = 50.0  # ties: the lower ids first
    logits[1, 2] = -np.inf  # only -inf: max -inf, rest 0
    logits[1, 0, 9] = np.nan  # a bad row: rest NaN
    packed = shard_summary(torch.from_numpy(logits), 16, 1000)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (6, 35)
    lp, ids, mx, rest = (t.numpy() for t in unpack_summary(packed.reshape(2, 3, 35), 16))
    good = np.ones((2, 3), bool)
    good[1, 0] = False
    want = kdtree.topk_shard(logits[good][None], 16, 1000)
    np.testing.assert_array_equal(lp[good], want.logits[0])
    np.testing.assert_array_equal(ids[good], want.ids[0])
    np.testing.assert_array_equal(mx[good], want.max[0])
    np.testing.assert_allclose(rest[good], want.sum_rest[0], rtol=1e-13, atol=0)
    assert ids[0, 1, :16].tolist() == list(range(1040, 1056))
    assert np.isnan(rest[1, 0]) and rest[1, 2] == 0.0 and mx[1, 2] == -np.inf
    with pytest.raises(ValueError, match=r"\[\.\.\., 33\]"):
        unpack_summary(packed, 15)
    with pytest.raises(ValueError, match=r"bfloat16 logits must be \[\.\.\., 27\]"):
        unpack_summary(packed, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_shard_summary_keeps_16_bit_logits_in_16_bits(dtype, k):
    """float16 / bfloat16 logits: the k values two a word, the first in the low half, a zero
    half after an odd k (checked against the values' bits computed by hand), ceil(k / 2) +
    k + 3 words a row; they unpack to topk_shard's float32 fields of the same values."""
    torch = pytest.importorskip("torch")
    from kdtree.distributed import shard_summary, summary_width, unpack_summary

    rng = np.random.default_rng(k)
    x = torch.from_numpy((rng.standard_normal((5, 40)) * 3).astype(np.float32)).to(getattr(torch, dtype))
    packed = shard_summary(x, k, 77)
    width = (k + 1) // 2 + k + 3
    assert summary_width(k, x.dtype) == width and summary_width(k, torch.float32) == 2 * k + 3
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (5, width)
    ref = kdtree.topk_shard(x.float().numpy(), k, 77)
    # the 16-bit patterns of the top-k values, by hand: float16 through numpy, bfloat16 as
    # the high half of the float32 bits (exact: the values are bfloat16 numbers)
    if dtype == "float16":
        halves = ref.logits.astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        halves = ref.logits.view(np.uint32) >> 16
        assert (ref.logits.view(np.uint32) & 0xFFFF == 0).all()
    halves = np.concatenate([halves, np.zeros((5, k % 2), np.uint32)], 1)
    words = (halves[:, 0::2] | (halves[:, 1::2] << 16)).view(np.int32)
    np.testing.assert_array_equal(packed[:, :(k + 1) // 2].numpy(), words)
    np.testing.assert_array_equal(packed[:, (k + 1) // 2:(k + 1) // 2 + k].numpy(), ref.ids)
    lp, ids, mx, rest = (t.numpy() for t in unpack_summary(packed, k, x.dtype))
    assert lp.dtype == np.float32 and lp.shape == (5, k)
    np.testing.assert_array_equal(lp, ref.logits)
    np.testing.assert_array_equal(ids, ref.ids)
    np.testing.assert_array_equal(mx, ref.max)
    np.testing.assert_allclose(rest, ref.sum_rest, rtol=1e-13, atol=0)
    with pytest.raises(kdtree.KdtreeTypeError, match="torch dtype"):
        unpack_summary(packed, k, "bfloat16")


def test_shard_summary_edges_on_cpu_tensors():
    """One row, a 1-D slice and no rows unpack (a single row's rest sits at an odd word
    offset of a contiguous slice: a world of one rank gathers exactly that); a NaN or +inf
    is reported even where the slice's first logit is -inf; bfloat16 gives float32's
    fields; bad arguments are errors that name them."""
    torch = pytest.importorskip("torch")
    from kdtree.distributed import shard_summary, unpack_summary

    x = torch.tensor([[0.5, -1.0, 2.0, 0.25, 1.5]])
    want = kdtree.topk_shard(x.numpy(), 3, 10)
    for packed in (shard_summary(x, 3, 10), shard_summary(x[0], 3, 10)[None], shard_summary(x, 3, 10)[None]):
        lp, ids, mx, rest = unpack_summary(packed, 3)
        np.testing.assert_array_equal(lp.reshape(1, 3).numpy(), want.logits)
        assert ids.reshape(-1).tolist() == [12, 14, 10] and float(mx.reshape(-1)[0]) == 2.0
        np.testing.assert_allclose(rest.reshape(1).numpy(), want.sum_rest, rtol=1e-13)
    assert [tuple(t.shape) for t in unpack_summary(shard_summary(torch.zeros(0, 4, 6), 2, 0), 2)] == \
        [(0, 2), (0, 2), (0,), (0,)]
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[-inf, -inf, -inf, nan], [-inf, -inf, -inf, inf], [-inf, nan, 1.0, 2.0], [-inf] * 4])
    _, _, mx, rest = unpack_summary(shard_summary(rows, 2, 0), 2)
    assert np.isnan(rest[:3].numpy()).all() and float(rest[3]) == 0.0 and float(mx[3]) == -inf
    b16 = (torch.randn(4, 50) * 3).to(torch.bfloat16)
    got = [t.numpy() for t in unpack_summary(shard_summary(b16, 8, 5), 8, torch.bfloat16)]
    ref = kdtree.topk_shard(b16.float().numpy(), 8, 5)
    np.testing.assert_array_equal(got[0], ref.logits)
    np.testing.assert_array_equal(got[1], ref.ids)
    with pytest.raises(kdtree.KdtreeError, match="vocab_offset"):
        shard_summary(torch.randn(3, 4), 4, 2**31 - 3)
    with pytest.raises(kdtree.KdtreeError, match="vocab_offset"):
        shard_summary(torch.randn(3, 4), 4, -1)
    with pytest.raises(kdtree.KdtreeTypeError, match="float32, float16 or bfloat16"):
        shard_summary(torch.randn(3, 4, dtype=torch.float64), 1, 0)
    with pytest.raises(kdtree.KdtreeTypeError, match="torch tensor"):
        shard_summary(np.zeros((2, 3), np.float32), 1, 0)
    with pytest.raises(kdtree.KdtreeTypeError, match="k must be an int"):
        unpack_summary(torch.zeros(5, dtype=torch.int32), 1.0)


# ---- the GPU form of kdtree.distributed (shard_summary, NCCL) ----------------------------------


@pytest.fixture(params=["torch", "fused"])
def summary_stats(request, monkeypatch):
    """Where a CUDA shard summary's rest comes from: torch's float64 passes or
    kdt_topk_shard_stats_cuda (the default)."""
    import kdtree.distributed

    monkeypatch.setattr(kdtree.distributed, "_FUSED_STATS", request.param == "fused")
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_shard_stats_equal_topk_shard(cuda_device, dtype):
    """kdt_topk_shard_stats_cuda: each row's max exactly and rest within float64 rounding of
    topk_shard's, over rows shorter and longer than a block, strided 3-D input, ties at the
    max (the first one's term left out, -0 equal to +0), -inf stretches, a row of only -inf
    (max -inf, rest 0) and rows with a NaN or a +inf (NaN, NaN)."""
    torch = pytest.importorskip("torch")
    from kdtree.core.cuda import topk_shard_stats

    rng = np.random.default_rng(3)
    for vocab in (1, 7, 256, 1000, 20480):
        x = (rng.standard_normal((3, 5, vocab + 3)) * 4).astype(np.float32)[..., 2:vocab + 2]
        x[0, 0] = np.round(x[0, 0])  # ties at the max
        x[0, 1, ::2] = -np.inf
        x[0, 2] = -np.inf
        x[1, 0, -1] = np.nan
        x[1, 1, 0] = np.inf
        if vocab >= 2:
            x[2, 0, :2] = [-0.0, 0.0]
            x[2, 0, 2:] = np.minimum(x[2, 0, 2:], -1.0)
        dev_x = torch.from_numpy(np.ascontiguousarray(x)).to(cuda_device).to(getattr(torch, dtype))
        full = torch.zeros((3, 5, vocab + 5), dtype=dev_x.dtype, device=cuda_device)
        full[..., 1:vocab + 1] = dev_x
        view = full[..., 1:vocab + 1]  # strided rows, not 16-byte aligned
        host = view.float().cpu().numpy()
        mx, rest = (t.cpu().numpy() for t in topk_shard_stats(view))
        assert mx.shape == (3, 5) and rest.shape == (3, 5) and rest.dtype == np.float64
        bad = np.isnan(host).any(-1) | np.isposinf(host).any(-1)
        assert np.isnan(mx[bad]).all() and np.isnan(rest[bad]).all()
        want = kdtree.topk_shard(np.where(bad[..., None], 0.0, host).astype(np.float32), 1, 0)
        np.testing.assert_array_equal(mx[~bad], want.max[~bad])
        np.testing.assert_allclose(rest[~bad], want.sum_rest[~bad], rtol=1e-13, atol=0)
        assert mx[0, 2] == -np.inf and rest[0, 2] == 0.0
        if vocab >= 2:
            want_rest = np.exp(host[2, 0, 1:].astype(np.float64)).sum()  # the -0 at column 0 is the max
            np.testing.assert_allclose(rest[2, 0], want_rest, rtol=1e-13)
    one = torch.tensor([1.0, 3.0, 3.0, -np.inf], device=cuda_device)
    mx, rest = topk_shard_stats(one)
    assert float(mx) == 3.0 and abs(float(rest) - (1.0 + np.exp(-2.0))) < 1e-15
    empty = topk_shard_stats(torch.zeros((0, 4), device=cuda_device))
    assert tuple(empty[0].shape) == (0,) and tuple(empty[1].shape) == (0,)
    with pytest.raises(kdtree.KdtreeTypeError, match="float32, float16 or bfloat16"):
        topk_shard_stats(torch.zeros((2, 4), dtype=torch.float64, device=cuda_device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shards, k", [(1, 8), (3, 64), (8, 16)])
def test_gpu_shard_summary_equals_topk_shard(cuda_device, summary_stats, dtype, shards, k):
    """Each slice's GPU summary is topk_shard's four fields (logits, ids, max exactly; the
    rest within float64 rounding), and merging the summaries on the GPU gives the gathered
    row's top-k (ids exactly, log-probs within one float32 ulp of the CPU merge)."""
    torch = pytest.importorskip("torch")
    from kdtree.distributed import shard_summary, summary_width, unpack_summary

    rng = np.random.default_rng(shards * 7 + k)
    vocab = 3001
    logits = (rng.standard_normal((3, 6, vocab)) * 4).astype(np.float32)
    logits[0, 0, :300] = 7.25  # ties inside and across the slices
    logits[1, 2, ::3] = -np.inf
    logits[2, 1, 1000:2100] = -np.inf  # a slice of only -inf, for some cuts
    logits[2, 4] = np.round(logits[2, 4])
    dev_logits = torch.from_numpy(logits).to(cuda_device).to(getattr(torch, dtype))
    host = dev_logits.float().cpu().numpy()  # the values the GPU sees (bfloat16: rounded)
    edges = split_points(rng, vocab, shards, k)
    packed = []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        summary = shard_summary(dev_logits[..., a:b], k, int(a))
        width = summary_width(k, dev_logits.dtype)
        assert width == (2 * k + 3 if dtype == "float32" else (k + 1) // 2 + k + 3)
        assert summary.dtype == torch.int32 and tuple(summary.shape) == (18, width)
        got = [t.cpu().numpy() for t in unpack_summary(summary.reshape(3, 6, width), k, dev_logits.dtype)]
        want = kdtree.topk_shard(host[..., a:b], k, int(a))
        np.testing.assert_array_equal(got[0], want.logits)
        np.testing.assert_array_equal(got[1], want.ids)
        np.testing.assert_array_equal(got[2], want.max)
        np.testing.assert_allclose(got[3], want.sum_rest, rtol=1e-13, atol=0)
        packed.append(summary.reshape(3, 6, width))
    merged = kdtree.topk_merge(*unpack_summary(torch.stack(packed), k, dev_logits.dtype), vocab)
    want = kdtree.topk_logprobs(host, k)
    np.testing.assert_array_equal(merged.ids.cpu().numpy(), want.ids)
    got_lp = merged.logprobs.cpu().numpy()
    ulps = np.abs(got_lp.view(np.int32).astype(np.int64) - want.logprobs.view(np.int32).astype(np.int64))
    assert (ulps <= 1).all(), f"log-probs differ by up to {ulps.max()} ulp"


@pytest.mark.gpu
def test_gpu_shard_summary_marks_bad_rows(cuda_device, summary_stats):
    torch = pytest.importorskip("torch")
    from kdtree.distributed import shard_summary, unpack_summary

    logits = np.zeros((4, 40), np.float32)
    logits[1, 7] = np.nan
    logits[2, 30] = np.inf
    logits[3] = -np.inf  # only -inf: a valid slice (max -inf, rest 0)
    _, ids, mx, rest = (t.cpu().numpy() for t in unpack_summary(
        shard_summary(torch.from_numpy(logits).to(cuda_device), 4, 100), 4))
    assert rest[0] == 39.0 and np.isnan(rest[1]) and np.isnan(rest[2]) and rest[3] == 0.0
    assert mx[3] == -np.inf and (ids[3] == 100 + np.arange(4)).all()


_NCCL_WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from kdtree.distributed import target_tokens_sharded, topk_logprobs_sharded

    out = sys.argv[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((4, 9, 1000)) * 3).astype(np.float32)
    logits[0, 0, [10, 500]] = 20.0  # a tie: the lower id
    x = torch.from_numpy(logits).cuda()
    top = topk_logprobs_sharded(x, 16, 0, 1000)
    tokens = target_tokens_sharded(x, 0, 1000)
    temps = torch.tensor([0.7, 0.0, 1.3, 0.5], device="cuda")
    sampled = target_tokens_sharded(x, 0, 1000, temperature=temps, seed=[5, 6, 7, 8], offset=3)
    np.savez(out, logits=logits, lp=top.logprobs.cpu().numpy(), ids=top.ids.cpu().numpy(),
             status=top.row_status.cpu().numpy(), tokens=tokens.cpu().numpy(), sampled=sampled.cpu().numpy())
""")


@pytest.mark.gpu
def test_gpu_sharded_top_k_and_choices_in_a_one_rank_nccl_world(cuda_device, spawn_ranks, tmp_path):
    """The collective path of the GPU form on one GPU (a world of one rank, NCCL): the whole
    vocabulary is the rank's slice, so the results are the plain top-k, argmax and draws
    (the host's documented draw; equal but where two scores tie within float32)."""
    pytest.importorskip("torch")
    out = tmp_path / "nccl.npz"
    spawn_ranks(_NCCL_WORKER, 1, lambda r: [out], timeout=300)
    r = np.load(out)
    want = kdtree.topk_logprobs(r["logits"], 16)
    np.testing.assert_array_equal(r["ids"], want.ids)
    ulps = np.abs(r["lp"].view(np.int32).astype(np.int64) - want.logprobs.view(np.int32).astype(np.int64))
    assert (ulps <= 1).all() and (r["status"] == 0).all()
    np.testing.assert_array_equal(r["tokens"], np.argmax(r["logits"], -1))
    assert r["tokens"][0, 0] == 10
    from kdtree.core import sampling

    for b, (t, seed) in enumerate(zip([0.7, 0.0, 1.3, 0.5], [5, 6, 7, 8], strict=True)):
        want = np.argmax(r["logits"][b], -1) if t == 0 else sampling.gumbel_draws(r["logits"][b], t, seed, 3, b,
                                                                                    np.arange(9))
        np.testing.assert_array_equal(r["sampled"][b], want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_choices_of_slices_merge_to_the_whole_rows(cuda_device, dtype):
    """kdt_choices_shard_cuda on slices at odd offsets (the Philox groups of four tokens
    straddle the cuts), merged by the documented rule, equals the call on the whole rows,
    which equals the argmax (greedy requests) and the host's documented draw (sampled
    ones); NaN and +inf flag a row, a row of only -inf has no sampled choice."""
    torch = pytest.importorskip("torch")
    from kdtree.core import cuda as gpu
    from kdtree.core import sampling

    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((4, 13, 1001)) * 3).astype(np.float32)
    logits[1, 0, [5, 400, 700]] = 30.0  # a greedy tie across the cuts: the lowest id
    logits[2, 3] = -np.inf              # sampled: no choice
    logits[3, 4, 600] = np.nan          # flagged
    logits[0, 5, 12] = np.inf           # sampled: flagged
    x = torch.from_numpy(logits).to(cuda_device).to(getattr(torch, dtype))
    host = x.float().cpu().numpy()
    temps = np.array([0.7, 0.0, 1.3, 0.5], np.float32)
    settings = {"temperature": temps, "seed": np.array([5, 6, 7, 2**64 - 1], np.uint64),
                "offset": np.array([9, 10, 11, 12], np.uint64)}
    whole = gpu.choices_shard(x, 0, settings).cpu().numpy()
    edges = [0, 333, 334, 1001]
    parts = np.stack([gpu.choices_shard(x[..., a:b].contiguous(), a, settings).cpu().numpy()
                      for a, b in zip(edges[:-1], edges[1:], strict=True)])

    def tokens(packed, sampled):  # the merge rule of kdt_choices_shard_cuda's documentation
        score, ids, bad, some = (packed[..., j] for j in range(4))
        top = score.max(0)
        lowest = np.where(score == top[None], ids, np.inf).min(0)
        none = (bad.max(0) > 0) | (sampled[:, None] & (some.max(0) == 0))
        return np.where(none, -1, lowest).astype(np.int64)

    sampled = temps != 0
    merged, alone = tokens(parts, sampled), tokens(whole[None], sampled)
    np.testing.assert_array_equal(merged, alone)
    for b in range(4):
        if temps[b] == 0:
            want = np.argmax(host[b], -1)
            want[np.isnan(host[b]).any(-1)] = -1
        else:
            want = sampling.gumbel_draws(host[b], float(temps[b]), int(settings["seed"][b]),
                                         int(settings["offset"][b]), b, np.arange(13))
        np.testing.assert_array_equal(alone[b], want, err_msg=f"request {b}")
    assert alone[1, 0] == 5 and alone[2, 3] == -1 and alone[3, 4] == -1 and alone[0, 5] == -1
