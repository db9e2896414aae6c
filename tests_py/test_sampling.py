"""Per-request sampled verification on the host (kdtree.verify_sample_from_logits with
[B] settings, top_p, top_k, temperature 0): the cuts and draws of kdtree.core.sampling
against an independent float64 reference of the definition in include/kdtree.h
(kdt_verify_sample_batch_cuda), written here: textbook softmax probabilities in float64
and Gumbel noise in float64 from a Philox4x32-10 written here. The two can disagree only
where the reference is ambiguous (a nucleus mass within 1e-9 of top_p, two scores within
1e-4), which the tests skip and count. The GPU twin is tests_py/test_sampling_graph.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kdtree
from kdtree.core import sampling

pytestmark = pytest.mark.usefixtures("lib")

KDT_ERR_VALUE = 4


# ---- The float64 reference ------------------------------------------------------------------


def ref_philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on numpy uint64 arrays holding 32-bit words (Salmon et al., SC 2011)."""
    m = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, np.uint64) & m for x in (c0, c1, c2, c3)]
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & m, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & m]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def ref_gumbel(vocab, seed, offset, request, node):
    """float64 Gumbel noise -log(-log(u)) of the documented counter, key and u."""
    v = np.arange(vocab, dtype=np.uint64)
    words = ref_philox(v >> np.uint64(2), np.full(vocab, node), np.full(vocab, request),
                       np.full(vocab, offset & 0xFFFFFFFF), seed & 0xFFFFFFFF,
                       ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    x = np.choose((v % np.uint64(4)).astype(np.int64), words)
    u = ((x >> np.uint64(8)).astype(np.float64) + 0.5) * 2.0**-24
    return -np.log(-np.log(u))


def ref_keep(row, temperature, top_p, top_k):
    """(kept token ids, margin): top-k by logit (ties lower id), then the shortest prefix of
    the kept tokens by float64 softmax probability (ties lower id) whose mass reaches top_p.
    margin: how far the masses either side of the cut are from top_p (ambiguous if tiny)."""
    vocab = row.shape[0]
    x = row.astype(np.float64)
    ids = list(range(vocab))
    if 0 < top_k < vocab:
        ids = sorted(ids, key=lambda v: (-x[v], v))[:top_k]
    margin = math.inf
    if top_p < 1:
        s = (row / np.float32(temperature)).astype(np.float64)  # the scores are float32 by definition
        ids = sorted(ids, key=lambda v: (-s[v], v))
        p = np.exp(s[ids] - s[ids].max())
        cum = np.cumsum(p / p.sum())
        j = int(np.argmax(cum >= float(np.float32(top_p)) - 1e-12))
        margin = abs(cum[j] - top_p) if j == 0 else min(abs(cum[j] - top_p), abs(cum[j - 1] - top_p))
        if p[j] / p.sum() < 1e-12:
            margin = 0.0  # the cut sits in tokens too unlikely to be told apart
        ids = ids[: j + 1]
    return sorted(ids), margin


def ref_draw(row, temperature, top_p, top_k, seed, offset, request, node):
    """(token, gap, margin) of the definition in float64; gap: best minus second score."""
    t = np.float32(temperature)
    if t == 0:
        return int(np.argmax(row)), math.inf, math.inf
    keep, margin = ref_keep(row, t, top_p, top_k)
    score = (row / t).astype(np.float64) + ref_gumbel(row.shape[0], seed, offset, request, node)
    masked = np.full(row.shape[0], -np.inf)
    masked[keep] = score[keep]
    order = np.argsort(-masked, kind="stable")
    gap = masked[order[0]] - masked[order[1]] if len(keep) > 1 else math.inf
    return int(order[0]), gap, margin


# ---- Helpers --------------------------------------------------------------------------------


def random_trees(rng, batch, vocab, budget=12, depth=4, width=3):
    lp = np.sort(np.log(rng.dirichlet(np.ones(vocab), size=(batch, depth))), axis=-1)[..., ::-1]
    ids = np.argsort(-rng.random((batch, depth, vocab)), axis=-1)[..., :width].astype(np.int32)
    return kdtree.build_trees(np.ascontiguousarray(lp[..., :width]).astype(np.float32), ids, budget,
                              root_tokens=np.zeros(batch, np.int32))


def boosted_logits(rng, trees, vocab, scale=2.0, boost=3.0):
    """[B, N+1, V] logits with one child token of every node made likely (walks go deep)."""
    batch, rows = trees.batch, trees.budget + 1
    x = (scale * rng.standard_normal((batch, rows, vocab))).astype(np.float32)
    for b in range(batch):
        for i in range(rows):
            c = int(trees.first_child[b, i])
            if c > 0:
                x[b, i, int(trees.tokens[b, c])] += np.float32(boost)
    return x


def walk_of(trees, draws, **kw):
    return kdtree.verify_greedy(trees, draws, **kw)


# ---- The exponential and the weights -------------------------------------------------------


def test_sample_exp_is_exp_within_float64_rounding():
    d = np.concatenate([-np.linspace(0, 64, 100_001), -np.ldexp(1.0, -np.arange(60)), [0.0, -64.0]])
    got = sampling.sample_exp(d)
    want = np.exp(d)
    assert np.all(np.abs(got - want) <= 4e-16 * want), float(np.max(np.abs(got - want) / want))
    assert sampling.sample_exp(np.array([0.0]))[0] == 1.0


def test_weight_shift_keeps_the_total_below_2_63():
    for vocab, want in ((1, 63), (2, 62), (3, 61), (4, 61), (5, 60), (151_936, 45), (2**31 - 1, 32)):
        assert sampling.weight_shift(vocab) == want, vocab
        assert vocab * 2 ** sampling.weight_shift(vocab) <= 2**63


def test_weights_are_the_documented_integers():
    s = np.array([3.0, 3.0, 2.5, -np.inf, -70.0, 0.0], np.float32)
    w = sampling.top_p_weights(s, np.float32(3.0))
    shift = sampling.weight_shift(6)
    assert w.dtype == np.uint64
    assert int(w[0]) == int(w[1]) == 2**shift
    assert int(w[2]) == math.floor(math.exp(-0.5) * 2**shift) or abs(int(w[2]) - math.exp(-0.5) * 2**shift) < 2
    assert int(w[3]) == 0 and int(w[4]) == 0
    assert int(w[5]) == math.floor(math.exp(-3.0) * 2**shift) or abs(int(w[5]) - math.exp(-3.0) * 2**shift) < 2


# ---- Cuts and draws against the reference -------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 19, 1025])
def test_cuts_and_draws_match_the_float64_reference(vocab):
    rng = np.random.default_rng(vocab)
    checked = skipped = 0
    for trial in range(60):
        scale = [0.5, 2.0, 6.0][trial % 3]
        row = (scale * rng.standard_normal(vocab)).astype(np.float32)
        if trial % 5 == 0:
            row = np.round(row)  # many exact ties
        if trial % 7 == 0 and vocab > 2:
            row[rng.integers(vocab)] = -np.inf
        t = np.float32([0.3, 1.0, 1.7][trial % 3])
        top_k = int(rng.choice([0, 1, 2, 5, vocab - 1, vocab, vocab + 3]))
        top_p = float(np.float32(rng.choice([1.0, 0.05, 0.3, 0.9, 0.999])))
        keep, margin = ref_keep(row, t, top_p, max(top_k, 0))
        if margin > 1e-9:
            assert np.flatnonzero(sampling.cut(row, t, np.float32(top_p), top_k)).tolist() == keep, (trial, top_k, top_p)
        seed, offset = int(rng.integers(2**63)), int(rng.integers(2**40))
        for node in (0, 3):
            want, gap, margin = ref_draw(row, t, top_p, top_k, seed, offset, 2, node)
            got = int(sampling.batch_draws(row[None], t, top_p, top_k, seed, offset, 2, [node])[0])
            if gap < 1e-4 or margin <= 1e-9:
                skipped += 1
                continue
            checked += 1
            assert got == want, (trial, node, top_k, top_p, got, want)
    assert skipped * 5 <= checked + 10, (checked, skipped)


def test_ties_keep_the_lower_ids():
    row = np.array([1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0], np.float32)
    t = np.float32(1.0)
    assert np.flatnonzero(sampling.cut(row, t, np.float32(1.0), 2)).tolist() == [1, 2]
    assert np.flatnonzero(sampling.cut(row, t, np.float32(1.0), 4)).tolist() == [1, 2, 3, 4]
    assert np.flatnonzero(sampling.cut(row, t, np.float32(1.0), 6)).tolist() == [0, 1, 2, 3, 4, 5]  # -0 == +0
    # Three equal tokens of probability 0.278 each: 0.25 keeps one, 0.5 two, 0.7 three.
    for top_p, want in ((0.25, [1]), (0.5, [1, 2]), (0.7, [1, 2, 4])):
        assert np.flatnonzero(sampling.cut(row, t, np.float32(top_p), 0)).tolist() == want, top_p


def test_no_cut_is_bit_identical_to_the_scalar_call():
    rng = np.random.default_rng(5)
    for vocab in (1, 19, 1025):
        rows = (3 * rng.standard_normal((6, vocab))).astype(np.float32)
        for t in (0.4, 1.0, 2.5):
            want = sampling.gumbel_draws(rows, t, 77, 2**33 + 1, 3, np.arange(6))
            for top_p, top_k in ((1.0, 0), (1.0, vocab), (1.0, vocab + 9)):
                got = sampling.batch_draws(rows, t, top_p, top_k, 77, 2**33 + 1, 3, np.arange(6))
                assert got.tolist() == want.tolist()
    trees = random_trees(rng, 5, 40)
    x = boosted_logits(rng, trees, 40)
    old = kdtree.verify_sample_from_logits(trees, x, 0.8, seed=11, offset=4)
    new = kdtree.verify_sample_from_logits(trees, x, [0.8] * 5, seed=[11] * 5, offset=np.full(5, 4, np.uint64),
                                           top_p=1.0, top_k=0)
    for name in ("accepted_nodes", "accept_length", "bonus_token", "request_status"):
        assert getattr(old, name).tolist() == getattr(new, name).tolist(), name


# ---- The public call: batches mixing settings -----------------------------------------------


def test_batch_mixes_greedy_and_sampled_requests():
    rng = np.random.default_rng(11)
    vocab, batch = 50, 8
    trees = random_trees(rng, batch, vocab)
    x = boosted_logits(rng, trees, vocab)
    temps = np.array([0, 0.7, 0, 1.3, 0.7, 0, 2.0, 0.5], np.float32)
    top_p = np.array([1, 0.9, 0.5, 1, 0.6, 1, 0.95, 0.8], np.float32)
    top_k = np.array([0, 0, 3, 10, 0, 1, 0, 4], np.int32)
    seeds = rng.integers(0, 2**63, batch, dtype=np.uint64)
    offsets = rng.integers(0, 2**40, batch, dtype=np.uint64)
    acc = kdtree.verify_sample_from_logits(trees, x, temps, seed=seeds, offset=offsets, top_p=top_p, top_k=top_k,
                                           stop_tokens=[5], max_commit=[9, 9, 3, 9, 9, 9, 1, 9])
    greedy = kdtree.verify_greedy_from_logits(trees, x, stop_tokens=[5], max_commit=[9, 9, 3, 9, 9, 9, 1, 9])
    assert acc.request_status.tolist() == [0] * batch
    for b in range(batch):
        if temps[b] == 0:
            assert acc.accepted_nodes[b].tolist() == greedy.accepted_nodes[b].tolist()
            assert acc.bonus_token[b] == greedy.bonus_token[b]
            continue
        draws = np.zeros((1, trees.budget + 1), np.int32)
        for i in range(int(trees.num_nodes[b]) + 1):
            tok, gap, margin = ref_draw(x[b, i], temps[b], float(top_p[b]), int(top_k[b]), int(seeds[b]),
                                        int(offsets[b]), b, i)
            assert gap > 1e-4 and margin > 1e-9, "the fixed seeds avoid ambiguous draws"
            draws[0, i] = tok
        one = kdtree.TreeBatch(*(getattr(trees, f)[b:b + 1] for f in (
            "num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility", "visibility_bits",
            "first_child", "next_sibling")), budget=trees.budget, depth=trees.depth)
        cap = [9, 9, 3, 9, 9, 9, 1, 9][b]
        want = walk_of(one, draws, stop_tokens=[5], max_commit=[cap])
        assert acc.accepted_nodes[b].tolist() == want.accepted_nodes[0].tolist(), b
        assert acc.bonus_token[b] == want.bonus_token[0], b


def test_bad_per_request_settings_fail_their_request_alone():
    rng = np.random.default_rng(2)
    vocab, batch = 30, 9
    trees = random_trees(rng, batch, vocab)
    x = boosted_logits(rng, trees, vocab)
    temps = np.array([1.0, np.nan, -1.0, 1e-7, np.inf, 1.0, 1.0, 1.0, 0.0], np.float32)
    top_p = np.array([0.9, 0.9, 0.9, 0.9, 0.9, 0.0, 1.5, np.nan, 0.9], np.float32)
    top_k = np.array([0, 0, 0, 0, 0, 0, 0, 0, -1], np.int32)
    acc = kdtree.verify_sample_from_logits(trees, x, temps, seed=3, offset=4, top_p=top_p, top_k=top_k,
                                           errors="status")
    assert acc.request_status.tolist() == [0] + [KDT_ERR_VALUE] * 8
    assert (acc.accepted_nodes[1:] == -1).all() and (acc.accept_length[1:] == 0).all()
    assert (acc.bonus_token[1:] == -1).all()
    alone = kdtree.verify_sample_from_logits(trees, x, np.where(np.arange(batch) == 0, 1.0, 0.5).astype(np.float32),
                                             seed=3, offset=4, top_p=0.9)
    assert acc.accepted_nodes[0].tolist() == alone.accepted_nodes[0].tolist()
    assert acc.bonus_token[0] == alone.bonus_token[0]
    with pytest.raises(kdtree.KdtreeError, match=r"request 1: temperature nan") as info:
        kdtree.verify_sample_from_logits(trees, x, temps, seed=3, offset=4, top_p=top_p, top_k=top_k)
    assert info.value.status == KDT_ERR_VALUE
    with pytest.raises(kdtree.KdtreeError, match=r"request 8: top_k -1"):
        kdtree.verify_sample_from_logits(trees, x, np.ones(batch), seed=3, offset=4, top_k=top_k)
    # A scalar applies to every request: a bad one fails the call.
    for kw in ({"top_p": 0.0}, {"top_p": 1.01}, {"top_k": -2}):
        with pytest.raises(kdtree.KdtreeError):
            kdtree.verify_sample_from_logits(trees, x, 1.0, seed=3, offset=4, **kw)
    with pytest.raises(kdtree.KdtreeError, match="shape"):
        kdtree.verify_sample_from_logits(trees, x, np.ones(batch + 1), seed=3, offset=4)
    with pytest.raises(kdtree.KdtreeError, match="seed"):
        kdtree.verify_sample_from_logits(trees, x, np.ones(batch), seed=np.full(batch, -1), offset=4)


def test_out_is_rewritten_whole_on_the_host():
    rng = np.random.default_rng(8)
    trees = random_trees(rng, 4, 20)
    x = boosted_logits(rng, trees, 20)
    want = kdtree.verify_sample_from_logits(trees, x, 0.9, seed=1, offset=2, top_k=5)
    out = kdtree.verify_sample_from_logits(trees, x, 0.9, seed=9, offset=9, top_k=5)
    for name in ("accepted_nodes", "accept_length", "bonus_token", "request_status"):
        getattr(out, name)[...] = 12345
    got = kdtree.verify_sample_from_logits(trees, x, 0.9, seed=1, offset=2, top_k=5, out=out)
    assert got is out
    for name in ("accepted_nodes", "accept_length", "bonus_token", "request_status"):
        assert getattr(out, name).tolist() == getattr(want, name).tolist(), name
    for call in (lambda o: kdtree.verify_greedy_from_logits(trees, x, out=o),
                 lambda o: kdtree.verify_greedy(trees, np.zeros((4, trees.budget + 1), np.int32), out=o)):
        out.accept_length[...] = 777
        assert call(out) is out and (out.accept_length != 777).all()
    bad = kdtree.Acceptance(out.accepted_nodes[:, :1].copy(), out.accept_length, out.bonus_token, out.request_status)
    with pytest.raises(kdtree.KdtreeError, match="out.accepted_nodes"):
        kdtree.verify_greedy_from_logits(trees, x, out=bad)


def test_device_settings_need_device_logits():
    class FakeDevice:
        def __dlpack_device__(self):
            return (2, 0)

    rng = np.random.default_rng(1)
    trees = random_trees(rng, 2, 10)
    x = boosted_logits(rng, trees, 10)
    with pytest.raises(kdtree.KdtreeError, match="seed: GPU arrays"):
        kdtree.verify_sample_from_logits(trees, x, 1.0, seed=FakeDevice(), offset=0)
