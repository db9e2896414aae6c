"""Hypothesis property tests of the C tree builder (kdtree.build_trees) against the spec
(ddtree-tree-build.md), each property checked independently of the builder's own logic:

* the tree is prefix-closed (parents are earlier nodes, depth = parent depth + 1);
* visibility is the ancestor relation (walked through parents), visibility_bits its
  little-endian packing into uint32 words;
* positions = root position + depth; scores never increase with node number;
* num_nodes = min(N, reachable finite nodes), counted by brute-force enumeration of the
  rank paths; each node's token and score follow from its rank path (spec order);
* first_child / next_sibling list exactly each node's children in increasing order, and no
  two children of one node share a token; padding rows are as the spec says;
* a reused ``out=`` buffer keeps no trace of an earlier tree or of garbage.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdtree

pytestmark = pytest.mark.usefixtures("lib")

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 40

# Log-prob values: <= 0 (log-probabilities), with exact ties (a small set and multiples of
# 1/64), -0.0, -inf, and general float32 values.
VALUES = st.one_of(
    st.sampled_from([0.0, -0.0, -0.5, -1.0, -2.0, -math.inf]),
    st.integers(-1500, 0).map(lambda k: k / 64.0),
    st.floats(-60.0, 0.0, width=32, allow_subnormal=False),
)


@st.composite
def drafts(draw, max_batch=3, max_depth=5, max_width=5, max_budget=40):
    """(lp float32 [B, L, K] rows sorted non-increasing, ids int32 [B, L, K] unique per row,
    budget, build_trees keyword options)."""
    batch = draw(st.integers(1, max_batch))
    depth = draw(st.integers(0, max_depth))
    width = draw(st.integers(0, max_width))
    budget = draw(st.integers(0, max_budget))
    lp = np.zeros((batch, depth, width), np.float32)
    ids = np.zeros((batch, depth, width), np.int32)
    for b in range(batch):
        for d in range(depth):
            row = draw(st.lists(VALUES, min_size=width, max_size=width))
            lp[b, d] = sorted(row, reverse=True)
            ids[b, d] = draw(st.lists(st.integers(0, VOCAB - 1), min_size=width, max_size=width, unique=True))
    options = {}
    if draw(st.booleans()):
        roots = st.lists(st.integers(0, VOCAB - 1), min_size=batch, max_size=batch)
        options["root_tokens"] = np.array(draw(roots))
    if draw(st.booleans()):
        positions = st.lists(st.integers(0, 2**40), min_size=batch, max_size=batch)
        options["root_positions"] = np.array(draw(positions), np.int64)
    options["pad_token"] = draw(st.sampled_from([-1, 0, 5, -(2**31), 2**31 - 1]))
    return lp, ids, budget, options


# ---- Independent oracles ----------------------------------------------------------------


def reachable_count(lp: np.ndarray, budget: int) -> int:
    """Rank paths (r1..rd), d <= L, ri < min(K, N), whose entries are all finite, counted
    by brute-force enumeration."""
    depth, width = lp.shape
    k_eff = min(width, budget)
    if sum(k_eff**d for d in range(1, depth + 1)) > 20000:
        # Too many to list: a path is finite iff each of its entries is, so count per depth
        # the product of finite entries per row (rows sorted, -inf only at the tail).
        finite = [int(np.isfinite(lp[j, :k_eff]).sum()) for j in range(depth)]
        return sum(math.prod(finite[:d]) for d in range(1, depth + 1))
    count = 0
    for d in range(1, depth + 1):
        for path in itertools.product(range(k_eff), repeat=d):
            if all(np.isfinite(lp[j, r]) for j, r in enumerate(path)):
                count += 1
    return count


def ancestors(parents: np.ndarray, i: int) -> set[int]:
    out = set()
    while parents[i] >= 0:
        i = int(parents[i])
        out.add(i)
    return out


def check_request(t, b: int, lp: np.ndarray, ids: np.ndarray, budget: int, options: dict) -> None:
    """Every property of one request's tree (lp, ids: [L, K] of that request)."""
    depth, width = lp.shape
    rows = budget + 1
    words = (rows + 31) // 32
    n = int(t.num_nodes[b])
    pad = options["pad_token"]
    root_tok = int(options["root_tokens"][b]) if "root_tokens" in options else pad
    root_pos = int(options["root_positions"][b]) if "root_positions" in options else 0
    tokens, depths, parents = t.tokens[b], t.depths[b], t.parents[b]
    logw, positions = t.logw[b], t.positions[b]
    fc, ns = t.first_child[b], t.next_sibling[b]

    # Size: min(N, number of reachable finite nodes).
    assert n == min(budget, reachable_count(lp, budget))

    # Root row.
    assert (tokens[0], depths[0], parents[0], positions[0]) == (root_tok, 0, -1, root_pos)
    assert logw[0:1].view(np.int64)[0] == np.float64(0.0).view(np.int64)

    # Prefix-closed: parents are earlier nodes, depth = parent depth + 1, within L.
    for i in range(1, n + 1):
        p = int(parents[i])
        assert 0 <= p < i, (i, p)
        assert depths[i] == depths[p] + 1 and 1 <= depths[i] <= depth
        if p == 0:
            assert depths[i] == 1

    # Positions, scores non-increasing with node number.
    assert np.array_equal(positions, root_pos + depths.astype(np.int64))
    real = logw[1 : n + 1]
    assert np.all(real[1:] <= real[:-1]), real

    # Children lists: exactly the nodes with that parent, increasing; ranks follow.
    rank = np.full(rows, -1)
    for i in range(n + 1):
        listed, c, steps = [], int(fc[i]), 0
        while c != -1:
            listed.append(c)
            c = int(ns[c])
            steps += 1
            assert steps <= n, "child list cycles"
        expect = [j for j in range(1, n + 1) if parents[j] == i]
        assert listed == expect, (i, listed, expect)
        child_tokens = [int(tokens[j]) for j in listed]
        assert len(set(child_tokens)) == len(child_tokens), child_tokens
        for r, j in enumerate(listed):
            rank[j] = r
    assert ns[0] == -1

    # Token = ids[depth-1][rank]; score follows the spec's float64 order from the rank path.
    lp64 = lp.astype(np.float64)
    for i in range(1, n + 1):
        d, r, p = int(depths[i]), int(rank[i]), int(parents[i])
        assert r < min(width, budget)
        assert tokens[i] == ids[d - 1, r]
        if r == 0:
            want = lp64[0, 0] if d == 1 else float(logw[p]) + lp64[d - 1, 0]
        else:
            prev = int([j for j in range(1, i) if parents[j] == p][r - 1])
            want = (float(logw[prev]) - lp64[d - 1, r - 1]) + lp64[d - 1, r]
        got = logw[i : i + 1].view(np.int64)[0]
        assert got == np.float64(want).view(np.int64), (i, logw[i], want)
        assert np.isfinite(logw[i])

    # Best-first: when the budget ran out, no pending candidate (the next sibling of an
    # emitted node, or the first child) beats the last emitted score.
    if n == budget and n > 0:
        last = float(logw[n])
        for i in range(1, n + 1):
            d, r, p = int(depths[i]), int(rank[i]), int(parents[i])
            sibs = [j for j in range(1, n + 1) if parents[j] == p]
            if sibs[-1] == i and r + 1 < min(width, budget):
                w = (float(logw[i]) - lp64[d - 1, r]) + lp64[d - 1, r + 1]
                assert not (w > last), (i, w, last)
            if d < depth and fc[i] == -1:
                assert not (float(logw[i]) + lp64[d, 0] > last)

    # Visibility: the ancestor relation, walked through parents; 0/1 bytes only.
    vis = t.visibility[b].view(np.uint8)
    want_vis = np.zeros((rows, rows), np.uint8)
    for i in range(rows):
        want_vis[i, i] = 1
        if i <= n:
            for a in ancestors(parents, i):
                want_vis[i, a] = 1
    assert np.array_equal(vis, want_vis)

    # visibility_bits: np.packbits(little) padded into little-endian uint32 words.
    packed = np.packbits(want_vis.astype(bool), axis=1, bitorder="little")
    packed = np.pad(packed, ((0, 0), (0, 4 * words - packed.shape[1])))
    assert np.array_equal(t.visibility_bits[b], packed.view("<u4").astype(np.uint32))

    # Padding rows.
    for i in range(n + 1, rows):
        assert (tokens[i], depths[i], parents[i], positions[i]) == (pad, 0, -1, root_pos), i
        assert logw[i] == -np.inf
        assert fc[i] == -1 and ns[i] == -1


@SETTINGS
@given(drafts())
def test_tree_properties(draft):
    lp, ids, budget, options = draft
    t = kdtree.build_trees(lp, ids, budget, **options)
    assert t.num_nodes.shape == (lp.shape[0],)
    assert t.tokens.shape == (lp.shape[0], budget + 1)
    assert t.budget == budget and t.depth == lp.shape[1]
    for b in range(lp.shape[0]):
        check_request(t, b, lp[b], ids[b], budget, options)


@SETTINGS
@given(drafts(max_batch=1, max_depth=3, max_width=8, max_budget=12))
def test_tree_properties_wide_rows(draft):
    """Wider rows than budget (K > N) and budgets below the reachable count."""
    lp, ids, budget, options = draft
    t = kdtree.build_trees(lp, ids, budget, **options)
    check_request(t, 0, lp[0], ids[0], budget, options)


def _garbage(t) -> None:
    """Fill every array of a TreeBatch with 0x5A bytes."""
    for name in ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility",
                 "visibility_bits", "first_child", "next_sibling"):
        getattr(t, name).view(np.uint8)[...] = 0x5A


def _same_bytes(a, b) -> None:
    for name in ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility",
                 "visibility_bits", "first_child", "next_sibling"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert x.tobytes() == y.tobytes(), f"{name} differs from a fresh build"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=drafts(max_batch=2, max_depth=6, max_width=6, max_budget=40), data=st.data())
def test_reused_out_keeps_no_trace(first, data):
    """Build a tree into a garbage-filled buffer, then a different (smaller, shallower, or
    empty) tree into the same buffer: both equal fresh builds byte for byte."""
    lp1, ids1, budget, opt1 = first
    batch = lp1.shape[0]
    depth2 = data.draw(st.integers(0, 3), label="depth2")
    width2 = data.draw(st.integers(0, 3), label="width2")
    lp2 = np.zeros((batch, depth2, width2), np.float32)
    ids2 = np.zeros((batch, depth2, width2), np.int32)
    for b in range(batch):
        for d in range(depth2):
            lp2[b, d] = sorted(data.draw(st.lists(VALUES, min_size=width2, max_size=width2)), reverse=True)
            row_ids = st.lists(st.integers(0, VOCAB - 1), min_size=width2, max_size=width2, unique=True)
            ids2[b, d] = data.draw(row_ids)
    opt2 = {"pad_token": data.draw(st.sampled_from([-1, 3]))}

    out = kdtree.empty_trees(batch, budget, lp1.shape[1])
    _garbage(out)
    got1 = kdtree.build_trees(lp1, ids1, budget, out=out, **opt1)
    assert got1 is out
    _same_bytes(out, kdtree.build_trees(lp1, ids1, budget, **opt1))
    kdtree.build_trees(lp2, ids2, budget, out=out, **opt2)
    fresh = kdtree.build_trees(lp2, ids2, budget, **opt2)
    _same_bytes(out, fresh)
    assert out.depth == depth2 and out.budget == budget
    for b in range(batch):
        check_request(out, b, lp2[b], ids2[b], budget, opt2)


def test_reused_out_after_full_tree():
    """A budget-filling deep tree, then a root-only tree (first row -inf) in the same buffer."""
    rng = np.random.default_rng(7)
    budget, depth, width = 50, 8, 6
    lp = -np.sort(rng.random((2, depth, width)), axis=-1).astype(np.float32)  # non-increasing
    ids = np.argsort(rng.random((2, depth, 30)), axis=-1)[..., :width].astype(np.int32)
    out = kdtree.empty_trees(2, budget, depth)
    _garbage(out)
    kdtree.build_trees(lp, ids, budget, out=out, root_positions=[100, 200], root_tokens=[1, 2])
    assert (out.num_nodes == budget).all()
    lp_empty = lp.copy()
    lp_empty[:, 0, :] = -np.inf
    kdtree.build_trees(lp_empty, ids, budget, out=out)
    assert (out.num_nodes == 0).all()
    _same_bytes(out, kdtree.build_trees(lp_empty, ids, budget))
    for b in range(2):
        check_request(out, b, lp_empty[b], ids[b], budget, {"pad_token": -1})
