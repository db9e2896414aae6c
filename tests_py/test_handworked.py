"""Hand-worked cases of the DDTree rule (ddtree-tree-build.md) with expected values
computed by hand from the spec, never by the code under test: a star, a chain, siblings that
beat the spine, sibling positions, the exact float64 operation order of a sibling score,
rank-path tie-breaks, -inf entries, and the verification walk (the root's target token
gates the first draft node, stop tokens, the commit cap).

Each case runs on the C library and on kdtree.reference: both must give the hand values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kdtree
from kdtree import reference


@pytest.fixture(params=["native", "reference"])
def impl(request):
    """The module under test: the C library (skipped when not built) or the reference."""
    if request.param == "native":
        request.getfixturevalue("lib")
        return kdtree
    return reference


def f32(x: float) -> float:
    """x rounded to float32, as a Python float (the spec converts lp float32 -> float64)."""
    return float(np.float32(x))


def bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def assert_logw(got: np.ndarray, want: list[float]) -> None:
    """Bitwise equality of float64 scores (-0.0, -inf and the last bit included)."""
    assert [bits(v) for v in got] == [bits(v) for v in want], (got.tolist(), want)


# ---- Trees ------------------------------------------------------------------------------


def test_star(impl):
    """L = 1: the budget's best entries of row 0 become the root's children in rank order."""
    p = [0.4, 0.3, 0.15, 0.1, 0.05]
    lp = np.log(np.array(p, np.float64)).astype(np.float32)[None]  # [L=1, K=5]
    ids = np.array([[10, 20, 30, 40, 50]], np.int32)
    a = [f32(math.log(x)) for x in p]

    t = impl.build_trees(lp, ids, 3, root_positions=[7], root_tokens=[99])
    assert t.num_nodes.tolist() == [3]
    assert t.tokens[0].tolist() == [99, 10, 20, 30]
    assert t.depths[0].tolist() == [0, 1, 1, 1]
    assert t.parents[0].tolist() == [-1, 0, 0, 0]
    assert t.positions[0].tolist() == [7, 8, 8, 8]  # siblings share a position
    # (0) = a0; (1) = (a0 - a0) + a1 = a1; (2) = (a1 - a1) + a2 = a2 (all exact)
    assert_logw(t.logw[0], [0.0, a[0], a[1], a[2]])
    assert t.first_child[0].tolist() == [1, -1, -1, -1]
    assert t.next_sibling[0].tolist() == [-1, 2, 3, -1]
    assert t.visibility[0].astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    assert t.visibility_bits[0, :, 0].tolist() == [0b0001, 0b0011, 0b0101, 0b1001]

    t = impl.build_trees(lp, ids, 8)  # more budget than entries: 5 nodes, 3 padding rows
    assert t.num_nodes.tolist() == [5]
    assert t.tokens[0].tolist() == [-1, 10, 20, 30, 40, 50, -1, -1, -1]
    assert t.parents[0].tolist() == [-1, 0, 0, 0, 0, 0, -1, -1, -1]
    assert t.depths[0].tolist() == [0, 1, 1, 1, 1, 1, 0, 0, 0]
    assert_logw(t.logw[0], [0.0] + a + [-math.inf] * 3)
    assert t.next_sibling[0].tolist() == [-1, 2, 3, 4, 5, -1, -1, -1, -1]
    assert t.first_child[0].tolist() == [1] + [-1] * 8
    assert t.positions[0].tolist() == [0, 1, 1, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 9])
def test_chain(impl, budget):
    """K = 1: one node per depth, num_nodes = min(N, L); token id 0 is an ordinary token."""
    lp = np.array([[-0.5], [-0.25], [-1.0], [-0.125]], np.float32)
    ids = np.array([[7], [8], [9], [0]], np.int32)
    n = min(budget, 4)
    t = impl.build_trees(lp, ids, budget, pad_token=-5, root_positions=[10])
    pad = budget - n
    assert t.num_nodes.tolist() == [n]
    assert t.tokens[0].tolist() == [-5, 7, 8, 9, 0][: n + 1] + [-5] * pad
    assert t.depths[0].tolist() == [0, 1, 2, 3, 4][: n + 1] + [0] * pad
    assert t.parents[0].tolist() == [-1, 0, 1, 2, 3][: n + 1] + [-1] * pad
    assert_logw(t.logw[0], [0.0, -0.5, -0.75, -1.75, -1.875][: n + 1] + [-math.inf] * pad)
    assert t.positions[0].tolist() == [10, 11, 12, 13, 14][: n + 1] + [10] * pad
    assert t.first_child[0].tolist() == [1, 2, 3, 4, -1][:n] + [-1] * (pad + 1)
    assert (t.next_sibling[0] == -1).all()
    # Visibility of a chain: lower-triangular on the real rows, identity on padding.
    want = np.eye(budget + 1, dtype=bool)
    want[: n + 1, : n + 1] = np.tril(np.ones((n + 1, n + 1), bool))
    assert np.array_equal(t.visibility[0], want)


P1, P2 = [0.5, 0.4, 0.1], [0.5, 0.3, 0.2]
A = [f32(math.log(x)) for x in P1]  # row 0 (depth 1) as float64
B = [f32(math.log(x)) for x in P2]  # row 1 (depth 2)


def _spine_case(impl, budget, **kw):
    lp = np.log(np.array([P1, P2])).astype(np.float32)
    ids = np.array([[11, 12, 13], [21, 22, 23]], np.int32)
    return impl.build_trees(lp, ids, budget, **kw)


def test_siblings_beat_the_spine(impl):
    """p1 = [.5, .4, .1], p2 = [.5, .3, .2]: with budget 2 the second node is the depth-1
    sibling (.4 > .5 * .5 = .25), not the spine's child."""
    t = _spine_case(impl, 2, root_positions=[100])
    assert t.num_nodes.tolist() == [2]
    assert t.tokens[0].tolist() == [-1, 11, 12]
    assert t.depths[0].tolist() == [0, 1, 1]
    assert t.parents[0].tolist() == [-1, 0, 0]
    assert t.positions[0].tolist() == [100, 101, 101]  # equal positions, not consecutive
    assert_logw(t.logw[0], [0.0, A[0], (A[0] - A[0]) + A[1]])


def test_spine_child_third(impl):
    """Budget 3: after (0) and (1) the candidates are (0,0) = .25, (1,0) = .4 * .5 = .2 and
    (2) = .1; (0,0) wins: depth 2, parent node 1, logw = lp1[0] + lp2[0] in float64."""
    t = _spine_case(impl, 3, root_positions=[100])
    assert t.num_nodes.tolist() == [3]
    assert t.tokens[0].tolist() == [-1, 11, 12, 21]
    assert t.depths[0].tolist() == [0, 1, 1, 2]
    assert t.parents[0].tolist() == [-1, 0, 0, 1]
    assert t.positions[0].tolist() == [100, 101, 101, 102]
    assert_logw(t.logw[0], [0.0, A[0], A[1], A[0] + B[0]])


def test_spine_budget_six(impl):
    """Budget 6 pops (0)=.5, (1)=.4, (0,0)=.25, (1,0)=.2, (0,1)=.15, (1,1)=.12; the scores
    follow the spec's operations: first child = parent + row[0], sibling = (w - row[r]) + row[r+1]."""
    t = _spine_case(impl, 6)
    w1 = A[0]
    w2 = (w1 - A[0]) + A[1]
    w3 = w1 + B[0]
    w4 = w2 + B[0]
    w5 = (w3 - B[0]) + B[1]
    w6 = (w4 - B[0]) + B[1]
    assert t.tokens[0].tolist() == [-1, 11, 12, 21, 21, 22, 22]
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 2, 1, 2]
    assert t.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert_logw(t.logw[0], [0.0, w1, w2, w3, w4, w5, w6])
    assert t.first_child[0].tolist() == [1, 3, 4, -1, -1, -1, -1]
    assert t.next_sibling[0].tolist() == [-1, 2, -1, 5, 6, -1, -1]
    vis = t.visibility[0].astype(int)
    assert vis[5].tolist() == [1, 1, 0, 0, 0, 1, 0]  # (0,1): root, node 1, itself
    assert vis[6].tolist() == [1, 0, 1, 0, 0, 0, 1]  # (1,1): root, node 2, itself


# Float32 values whose float64 sibling score depends on the association order:
# ((a0 + b0) - b0) + b1 != (a0 + b0) + (b1 - b0).
ORDER_A0 = np.float32(-17.862282)
ORDER_B0 = np.float32(-1.860602e-14)
ORDER_B1 = np.float32(-8.443481e-13)


def test_sibling_score_operation_order(impl):
    """Node (0,1)'s score is (logw(0,0) - lp[1][0]) + lp[1][1] (subtract, then add), which
    here differs in the last bit from logw(0,0) + (lp[1][1] - lp[1][0])."""
    a0, b0, b1 = float(ORDER_A0), float(ORDER_B0), float(ORDER_B1)
    w_00 = a0 + b0
    spec = (w_00 - b0) + b1
    other = w_00 + (b1 - b0)
    assert bits(spec) != bits(other), "the constants no longer separate the two orders"
    lp = np.array([[ORDER_A0, -np.inf], [ORDER_B0, ORDER_B1]], np.float32)
    ids = np.array([[1, 2], [3, 4]], np.int32)
    t = impl.build_trees(lp, ids, 3)
    assert t.num_nodes.tolist() == [3]  # (1) is -inf: never emitted
    assert t.tokens[0].tolist() == [-1, 1, 3, 4]
    assert t.parents[0].tolist() == [-1, 0, 1, 1]
    assert_logw(t.logw[0], [0.0, a0, w_00, spec])


# The exact-tie tree: row0 = [-1, -2.5], row1 = [-1, -1.5], row2 = [-0.5, -4] (all dyadic,
# so every score is exact). Hand-run of the heap, key (-logw, rank path):
#   pop (0) -1                     push (1) -2.5, (0,0) -2
#   pop (0,0) -2                   push (0,1) -2.5, (0,0,0) -2.5
#   three-way tie at -2.5: (0,0,0) < (0,1) < (1) (lexicographic, prefix first)
#   pop (0,0,0) -2.5               push (0,0,1) = (-2.5 + 0.5) - 4 = -6
#   pop (0,1) -2.5                 push (0,1,0) = -3
#   pop (1) -2.5                   push (1,0) = -3.5
#   pop (0,1,0) -3                 push (0,1,1) = -6.5
#   pop (1,0) -3.5                 push (1,1) = (-3.5 + 1) - 1.5 = -4, (1,0,0) = -4
#   tie at -4: (1,0,0) < (1,1)
#   pop (1,0,0) -4                 push (1,0,1) = (-4 + 0.5) - 4 = -7.5
#   pop (1,1) -4                   push (1,1,0) = -4.5
#   then (1,1,0) -4.5 [push (1,1,1) = -8], (0,0,1) -6, (0,1,1) -6.5, (1,0,1) -7.5, (1,1,1) -8
# 14 reachable nodes in all (2 + 4 + 8).
TIE_LP = np.array([[-1.0, -2.5], [-1.0, -1.5], [-0.5, -4.0]], np.float32)
TIE_IDS = np.array([[100, 101], [200, 201], [300, 301]], np.int32)
TIE_TOKENS = [100, 200, 300, 201, 101, 300, 200, 300, 201, 300, 301, 301, 301, 301]
TIE_PARENTS = [0, 1, 2, 1, 0, 4, 5, 7, 5, 9, 2, 4, 7, 9]
TIE_DEPTHS = [1, 2, 3, 2, 1, 3, 2, 3, 2, 3, 3, 3, 3, 3]
TIE_LOGW = [-1.0, -2.0, -2.5, -2.5, -2.5, -3.0, -3.5, -4.0, -4.0, -4.5, -6.0, -6.5, -7.5, -8.0]
#                 node: 0  1  2  3   4   5  6   7  8   9  10  11  12  13  14
TIE_FIRST_CHILD = [1, 2, 3, -1, 6, 7, -1, 8, -1, 10, -1, -1, -1, -1, -1]
TIE_NEXT_SIBLING = [-1, 5, 4, 11, -1, -1, 12, 9, 13, -1, 14, -1, -1, -1, -1]


@pytest.mark.parametrize("budget", [9, 16])
def test_exact_ties_follow_rank_paths(impl, budget):
    """Budget 9 stops right after the second tie; budget 16 holds all 14 nodes + 2 pads."""
    t = impl.build_trees(TIE_LP, TIE_IDS, budget, root_tokens=[5], root_positions=[40])
    n = min(budget, 14)
    pad = budget - n
    assert t.num_nodes.tolist() == [n]
    assert t.tokens[0].tolist() == [5] + TIE_TOKENS[:n] + [-1] * pad
    assert t.parents[0].tolist() == [-1] + TIE_PARENTS[:n] + [-1] * pad
    assert t.depths[0].tolist() == [0] + TIE_DEPTHS[:n] + [0] * pad
    assert_logw(t.logw[0], [0.0] + TIE_LOGW[:n] + [-math.inf] * pad)
    assert t.positions[0].tolist() == [40] + [40 + d for d in TIE_DEPTHS[:n]] + [40] * pad
    cut = lambda links: [x if x <= n else -1 for x in links[: n + 1]]  # noqa: E731
    assert t.first_child[0].tolist() == cut(TIE_FIRST_CHILD) + [-1] * pad
    assert t.next_sibling[0].tolist() == cut(TIE_NEXT_SIBLING) + [-1] * pad
    vis = t.visibility[0]
    assert np.flatnonzero(vis[8]).tolist() == [0, 5, 7, 8]
    assert np.flatnonzero(vis[6]).tolist() == [0, 1, 4, 6]
    assert t.visibility_bits[0, 8, 0] == (1 << 0) | (1 << 5) | (1 << 7) | (1 << 8)
    for row in range(n + 1, budget + 1):
        assert np.flatnonzero(vis[row]).tolist() == [row]
        assert t.visibility_bits[0, row].tolist() == [1 << row]


def test_tie_between_depths_equal_rows(impl):
    """row0 = row1 = [-1, -1]: (0) before (1) at -1; at -2, (0,0) < (0,1) < (1,0) < (1,1)
    (an insertion-order heap would pop (1,0) before (0,1))."""
    lp = np.array([[-1.0, -1.0], [-1.0, -1.0]], np.float32)
    ids = np.array([[10, 11], [20, 21]], np.int32)
    t = impl.build_trees(lp, ids, 6)
    assert t.tokens[0].tolist() == [-1, 10, 11, 20, 21, 20, 21]
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert_logw(t.logw[0], [0.0, -1.0, -1.0, -2.0, -2.0, -2.0, -2.0])


def test_neg_inf_never_emitted(impl):
    """A -inf entry is never emitted nor expanded: row1 all -inf stops the tree at depth 1;
    a -inf rank-1 entry leaves a single child."""
    lp = np.array([[-0.25, -np.inf], [-np.inf, -np.inf], [-1.0, -2.0]], np.float32)
    ids = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
    t = impl.build_trees(lp, ids, 5)
    assert t.num_nodes.tolist() == [1]
    assert t.tokens[0].tolist() == [-1, 1, -1, -1, -1, -1]
    assert_logw(t.logw[0], [0.0, -0.25] + [-math.inf] * 4)
    lp0 = np.array([[-np.inf, -np.inf]], np.float32)
    t = impl.build_trees(lp0, ids[:1], 3)
    assert t.num_nodes.tolist() == [0]


def test_negative_zero_scores(impl):
    """lp = -0.0 is kept bitwise: the first node's logw is lp[0][0] itself (-0.0), not
    0.0 + lp[0][0] (= +0.0); its child is -0.0 + -0.0 = -0.0."""
    lp = np.array([[-0.0], [-0.0]], np.float32)
    ids = np.array([[1], [2]], np.int32)
    t = impl.build_trees(lp, ids, 2)
    assert_logw(t.logw[0], [0.0, -0.0, -0.0])


def test_budget_zero_and_depth_zero(impl):
    lp = np.array([[-1.0, -2.0]], np.float32)
    ids = np.array([[1, 2]], np.int32)
    t = impl.build_trees(lp, ids, 0, root_tokens=[3], root_positions=[9])
    assert t.num_nodes.tolist() == [0]
    assert t.tokens.tolist() == [[3]] and t.positions.tolist() == [[9]]
    assert t.visibility.tolist() == [[[True]]] and t.visibility_bits.tolist() == [[[1]]]
    t = impl.build_trees(np.zeros((1, 0, 2), np.float32), np.zeros((1, 0, 2), np.int32), 2)
    assert t.num_nodes.tolist() == [0]
    assert t.parents.tolist() == [[-1, -1, -1]] and t.depths.tolist() == [[0, 0, 0]]
    assert np.array_equal(t.visibility[0], np.eye(3, dtype=bool))


# ---- Verification -----------------------------------------------------------------------
# The budget-4 spine tree: node 1 = (0) token 11, node 2 = (1) token 12,
# node 3 = (0,0) token 21 (parent 1), node 4 = (1,0) token 21 (parent 2).


def _walk_tree(impl):
    t = _spine_case(impl, 4)
    assert t.tokens[0].tolist() == [-1, 11, 12, 21, 21]
    assert t.parents[0].tolist() == [-1, 0, 0, 1, 2]
    return t


def test_verify_root_token_gates_first_node(impl):
    """The target's token AT THE ROOT decides the first draft node: if it differs from every
    depth-1 token nothing is accepted and the bonus is target_tokens[root], even when the
    target "agrees" with node 1 at node 1's own row."""
    t = _walk_tree(impl)
    target = np.array([[55, 11, 21, 21, 21]], np.int32)  # node 1's row holds its own token
    acc = impl.verify_greedy(t, target)
    assert acc.accept_length.tolist() == [0]
    assert acc.bonus_token.tolist() == [55]
    assert acc.accepted_nodes.tolist() == [[0, -1, -1]]
    assert acc.committed(t) == [55]


def test_verify_walks_to_the_leaf(impl):
    """root -> 12 (node 2) -> 21 (node 4) -> bonus 77: the target token at node i picks
    node i's child."""
    t = _walk_tree(impl)
    target = np.array([[12, 99, 21, 98, 77]], np.int32)
    acc = impl.verify_greedy(t, target)
    assert acc.accepted_nodes.tolist() == [[0, 2, 4]]
    assert acc.accept_length.tolist() == [2]
    assert acc.bonus_token.tolist() == [77]
    assert acc.committed(t) == [12, 21, 77]


def test_verify_stop_tokens(impl):
    """An accepted stop token ends the walk with no bonus; a stop token that is only the
    bonus (not accepted) changes nothing; a stop token elsewhere in the tree is ignored."""
    t = _walk_tree(impl)
    target = np.array([[12, 99, 21, 98, 77]], np.int32)
    acc = impl.verify_greedy(t, target, stop_tokens=[12])
    assert acc.accepted_nodes.tolist() == [[0, 2, -1]]
    assert (acc.accept_length.tolist(), acc.bonus_token.tolist()) == ([1], [-1])
    assert acc.committed(t) == [12]
    acc = impl.verify_greedy(t, target, stop_tokens=[21])  # accepted at depth 2
    assert acc.accepted_nodes.tolist() == [[0, 2, 4]]
    assert (acc.accept_length.tolist(), acc.bonus_token.tolist()) == ([2], [-1])
    acc = impl.verify_greedy(t, target, stop_tokens=[77, 11])  # bonus / off-path tokens
    assert (acc.accept_length.tolist(), acc.bonus_token.tolist()) == ([2], [77])
    assert acc.committed(t) == [12, 21, 77]


def test_verify_commit_cap(impl):
    """Uncut commit [12, 21, 77]. Cap 0: nothing; cap 1: only the bonus = target at root
    (12); cap 2: path [0, 2] + bonus = target at node 2 (21); cap >= 3: everything."""
    t = _walk_tree(impl)
    target = np.array([[12, 99, 21, 98, 77]], np.int32)
    expect = {
        0: ([[0, -1, -1]], 0, -1, []),
        1: ([[0, -1, -1]], 0, 12, [12]),
        2: ([[0, 2, -1]], 1, 21, [12, 21]),
        3: ([[0, 2, 4]], 2, 77, [12, 21, 77]),
        50: ([[0, 2, 4]], 2, 77, [12, 21, 77]),
    }
    for cap, (nodes, length, bonus, tokens) in expect.items():
        acc = impl.verify_greedy(t, target, max_commit=cap)
        assert acc.accepted_nodes.tolist() == nodes, cap
        assert acc.accept_length.tolist() == [length], cap
        assert acc.bonus_token.tolist() == [bonus], cap
        assert acc.committed(t) == tokens, cap


def test_verify_cap_with_stop_token(impl):
    """A stop token accepted exactly at the cap: commit [12, 21] either way (cap 2 keeps the
    path [0, 2] plus bonus 21, or the accepted stop); cap 1 gives bonus 12 only."""
    t = _walk_tree(impl)
    target = np.array([[12, 99, 21, 98, 77]], np.int32)
    acc = impl.verify_greedy(t, target, stop_tokens=[21], max_commit=2)
    assert acc.committed(t) == [12, 21]
    acc = impl.verify_greedy(t, target, stop_tokens=[21], max_commit=1)
    assert acc.accepted_nodes.tolist() == [[0, -1, -1]]
    assert (acc.accept_length.tolist(), acc.bonus_token.tolist()) == ([0], [12])


def test_verify_batch_with_per_request_caps(impl):
    """Two requests in one call, each with its own cap and walk."""
    lp = np.log(np.array([[P1, P2], [P1, P2]])).astype(np.float32)
    ids = np.array([[[11, 12, 13], [21, 22, 23]], [[31, 32, 33], [41, 42, 43]]], np.int32)
    t = impl.build_trees(lp, ids, 4)
    # request 0: root -> 11 (node 1) -> 21 (node 3) -> bonus 5; request 1: root -> 32 -> 41.
    target = np.array([[11, 21, 0, 5, 0], [32, 0, 41, 0, 6]], np.int32)
    acc = impl.verify_greedy(t, target, max_commit=[2, 10])
    assert acc.accepted_nodes.tolist() == [[0, 1, -1], [0, 2, 4]]
    assert acc.accept_length.tolist() == [1, 2]
    assert acc.bonus_token.tolist() == [21, 6]
    assert acc.committed(t, 0) == [11, 21] and acc.committed(t, 1) == [32, 41, 6]


def test_verify_tie_tree_deepest_path(impl):
    """On the exact-tie tree: root -> 101 (node 5) -> 200 (node 7) -> 300 (node 8) -> bonus."""
    t = impl.build_trees(TIE_LP, TIE_IDS, 12)
    target = np.zeros((1, 13), np.int32)
    target[0, 0], target[0, 5], target[0, 7], target[0, 8] = 101, 200, 300, 4
    acc = impl.verify_greedy(t, target)
    assert acc.accepted_nodes.tolist() == [[0, 5, 7, 8]]
    assert acc.accept_length.tolist() == [3]
    assert acc.bonus_token.tolist() == [4]
    assert acc.committed(t) == [101, 200, 300, 4]
