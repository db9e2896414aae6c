"""Per-request budgets and depth limits (kdt_draft's request_budgets, request_depths).

Each request of a mixed batch must be bit-identical to that request built alone with its
own budget and depth, padded to the call's N + 1 rows; checked against single-request
builds, the float64 reference, and hand-worked trees. Only a request's own used part is
validated. The GPU builder is checked against the CPU one on the same mixed batches
(every kernel path the test switches reach).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdtree
from kdtree import _native as _lib
from kdtree import reference

pytestmark = pytest.mark.usefixtures("lib")

FIELDS = ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility", "visibility_bits",
          "first_child", "next_sibling")


def random_draft(rng, batch, depth, width, vocab=5000):
    p = rng.dirichlet(np.ones(width * 2), size=(batch, depth))[..., :width]
    lp = np.ascontiguousarray(np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32))
    ids = np.argsort(rng.random((batch, depth, vocab)), axis=-1)[..., :width].astype(np.int32)
    return lp, np.ascontiguousarray(ids)


def assert_request_is_alone(got, b, lp, ids, own_budget, own_depth, budget, **options):
    """Row block b of `got` equals request b built alone (budget own_budget, depth
    own_depth), its rows padded up to `budget` + 1 as a padding row is."""
    one = {k: (None if v is None else np.asarray(v)[b: b + 1]) for k, v in options.items()}
    want = kdtree.build_trees(lp[b: b + 1, :own_depth], ids[b: b + 1, :own_depth], own_budget, **one)
    rows = own_budget + 1
    n = int(want.num_nodes[0])
    assert got.num_nodes[b] == n
    for name in ("tokens", "depths", "parents", "positions", "first_child", "next_sibling"):
        np.testing.assert_array_equal(getattr(got, name)[b, :rows], getattr(want, name)[0], err_msg=name)
    np.testing.assert_array_equal(got.logw[b, :rows].view(np.int64), want.logw[0].view(np.int64))
    np.testing.assert_array_equal(got.visibility[b, :rows, :rows], want.visibility[0])
    assert not got.visibility[b, :rows, rows:].any()
    # Rows past the request's own budget are padding rows of the call.
    pad_rows = slice(rows, budget + 1)
    assert (got.tokens[b, pad_rows] == options.get("pad_token", -1)).all()
    assert (got.depths[b, pad_rows] == 0).all() and (got.parents[b, pad_rows] == -1).all()
    assert np.isneginf(got.logw[b, pad_rows]).all()
    assert (got.first_child[b, pad_rows] == -1).all() and (got.next_sibling[b, pad_rows] == -1).all()
    eye = np.eye(budget + 1, dtype=bool)[pad_rows]
    np.testing.assert_array_equal(got.visibility[b, pad_rows], eye)


def test_mixed_batch_equals_each_request_alone():
    rng = np.random.default_rng(7)
    batch, depth, width, budget = 12, 9, 6, 40
    lp, ids = random_draft(rng, batch, depth, width)
    budgets = np.array([0, 1, 2, 5, 40, 17, 39, 8, 40, 3, 25, 6], np.int32)
    depths = np.array([9, 0, 1, 9, 9, 4, 3, 2, 7, 9, 5, 1], np.int32)
    options = dict(root_tokens=np.arange(batch) + 3, root_positions=np.arange(batch, dtype=np.int64) * 11)
    got = kdtree.build_trees(lp, ids, budget, request_budgets=budgets, request_depths=depths, **options)
    ref = reference.build_trees(lp, ids, budget, request_budgets=budgets, request_depths=depths, **options)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    for b in range(batch):
        assert_request_is_alone(got, b, lp, ids, int(budgets[b]), int(depths[b]), budget, **options)
    # The budget binds where the tree could be larger, and the depth limit holds.
    assert got.num_nodes.tolist()[:5] == [0, 0, 2, 5, 40]
    for b in range(batch):
        assert got.depths[b].max() <= depths[b]
    assert got.request_status.tolist() == [0] * batch


def test_limits_equal_to_the_call_change_nothing():
    rng = np.random.default_rng(3)
    lp, ids = random_draft(rng, 4, 6, 5)
    plain = kdtree.build_trees(lp, ids, 20)
    same = kdtree.build_trees(lp, ids, 20, request_budgets=[20] * 4, request_depths=[6] * 4)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(same, name), getattr(plain, name), err_msg=name)


def test_hand_worked_budgets():
    # Depth 1: probabilities 0.5, 0.3, 0.2; depth 2: 0.7, 0.3, 1e-9 (for every parent).
    lp = np.log(np.array([[[0.5, 0.3, 0.2], [0.7, 0.3, 1e-9]]], np.float32)).repeat(3, axis=0)
    ids = np.array([[[10, 11, 12], [20, 21, 22]]], np.int32).repeat(3, axis=0)
    t = kdtree.build_trees(lp, ids, 4, request_budgets=[2, 4, 3], request_depths=[2, 1, 2])
    # Request 0 (budget 2): 10 (0.5), then 10->20 (0.35) before 11 (0.3).
    # Request 1 (depth 1): the three first-level tokens, then nothing.
    # Request 2 (budget 3): 10, 10->20, 11.
    assert t.num_nodes.tolist() == [2, 3, 3]
    assert t.tokens.tolist() == [[-1, 10, 20, -1, -1], [-1, 10, 11, 12, -1], [-1, 10, 20, 11, -1]]
    assert t.parents.tolist() == [[-1, 0, 1, -1, -1], [-1, 0, 0, 0, -1], [-1, 0, 1, 0, -1]]
    assert t.depths.tolist() == [[0, 1, 2, 0, 0], [0, 1, 1, 1, 0], [0, 1, 2, 1, 0]]
    np.testing.assert_allclose(np.exp(t.logw[2, 1:4]), [0.5, 0.35, 0.3], rtol=1e-6)
    assert t.first_child[2].tolist() == [1, 2, -1, -1, -1] and t.next_sibling[2].tolist() == [-1, 3, -1, -1, -1]


def test_only_the_requests_own_part_is_validated():
    rng = np.random.default_rng(5)
    lp, ids = random_draft(rng, 3, 5, 6)
    bad_lp, bad_ids = lp.copy(), ids.copy()
    bad_lp[0, 3, 0] = np.nan       # request 0: depth 4, past its depth limit 3
    bad_ids[1, 0, 4] = bad_ids[1, 0, 0]  # request 1: rank 4, past its K' = min(6, 4)
    bad_lp[2, 1, 5] = 1.0          # request 2: rank 5, past K' = min(6, 2)... and unsorted
    budgets, depths = [30, 4, 2], [3, 5, 5]
    got = kdtree.build_trees(bad_lp, bad_ids, 30, request_budgets=budgets, request_depths=depths)
    want = kdtree.build_trees(lp, ids, 30, request_budgets=budgets, request_depths=depths)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    # The same entries inside the used part are errors naming request, depth and rank.
    with pytest.raises(_lib.KdtreeError, match=r"request 0, depth 4, rank 0: NaN"):
        kdtree.build_trees(bad_lp, bad_ids, 30, request_budgets=budgets, request_depths=[4, 5, 5])
    with pytest.raises(_lib.KdtreeError, match=r"request 1, depth 1, rank 4: duplicate token id"):
        kdtree.build_trees(bad_lp, bad_ids, 30, request_budgets=[30, 5, 2], request_depths=depths)


@pytest.mark.parametrize("budgets, depths, message", [
    ([3, 11, 2], None, r"request 1: budget 11 outside \[0, 10\] \(request_budgets\)"),
    ([3, -1, 2], None, r"request 1: budget -1 outside \[0, 10\]"),
    (None, [2, 2, 5], r"request 2: depth 5 outside \[0, 4\] \(request_depths\)"),
    (None, [0, -3, 1], r"request 1: depth -3 outside \[0, 4\]"),
])
def test_limits_out_of_range(budgets, depths, message):
    rng = np.random.default_rng(1)
    lp, ids = random_draft(rng, 3, 4, 3)
    with pytest.raises(_lib.KdtreeError, match=message) as info:
        kdtree.build_trees(lp, ids, 10, request_budgets=budgets, request_depths=depths)
    assert info.value.status == _lib.STATUS["KDT_ERR_OUT_OF_RANGE"]
    # errors="status": that request is root-only with its status, the others are built.
    t = kdtree.build_trees(lp, ids, 10, request_budgets=budgets, request_depths=depths, errors="status",
                           root_tokens=[7, 8, 9])
    bad = next(b for b in range(3) if t.request_status[b] != 0)
    assert t.request_status[bad] == _lib.STATUS["KDT_ERR_OUT_OF_RANGE"]
    assert t.num_nodes[bad] == 0 and t.tokens[bad, 0] == [7, 8, 9][bad]
    for b in range(3):
        if b != bad:
            assert_request_is_alone(t, b, lp, ids, 10 if budgets is None else budgets[b],
                                    4 if depths is None else depths[b], 10, root_tokens=[7, 8, 9])


def test_limits_shape_and_type_errors():
    rng = np.random.default_rng(1)
    lp, ids = random_draft(rng, 3, 4, 3)
    with pytest.raises(ValueError, match=r"request_budgets must have shape \(3,\)"):
        kdtree.build_trees(lp, ids, 10, request_budgets=[1, 2])
    with pytest.raises(TypeError, match="request_depths"):
        kdtree.build_trees(lp, ids, 10, request_depths=[1.5, 2, 3])
    with pytest.raises((ValueError, OverflowError), match="request_budgets"):
        kdtree.build_trees(lp, ids, 10, request_budgets=[2**40, 1, 1])


VALUES = st.one_of(
    st.sampled_from([0.0, -0.5, -1.0, -2.0, -math.inf]),
    st.integers(-600, 0).map(lambda k: k / 64.0),
    st.floats(-30.0, 0.0, width=32, allow_subnormal=False),
)


@st.composite
def limited_drafts(draw):
    batch = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 4))
    width = draw(st.integers(0, 4))
    budget = draw(st.integers(0, 24))
    lp = np.zeros((batch, depth, width), np.float32)
    ids = np.zeros((batch, depth, width), np.int32)
    for b in range(batch):
        for d in range(depth):
            lp[b, d] = sorted(draw(st.lists(VALUES, min_size=width, max_size=width)), reverse=True)
            ids[b, d] = draw(st.lists(st.integers(0, 30), min_size=width, max_size=width, unique=True))
    budgets = draw(st.lists(st.integers(0, budget), min_size=batch, max_size=batch))
    depths = draw(st.lists(st.integers(0, depth), min_size=batch, max_size=batch))
    return lp, ids, budget, np.array(budgets, np.int32), np.array(depths, np.int32)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limited_drafts())
def test_property_each_request_as_if_alone(case):
    lp, ids, budget, budgets, depths = case
    got = kdtree.build_trees(lp, ids, budget, request_budgets=budgets, request_depths=depths)
    ref = reference.build_trees(lp, ids, budget, request_budgets=budgets, request_depths=depths)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)
    for b in range(lp.shape[0]):
        assert_request_is_alone(got, b, lp, ids, int(budgets[b]), int(depths[b]), budget)


# ---- GPU: the same batches, against the CPU builder -------------------------------------------


def _gpu_cases():
    rng = np.random.default_rng(11)
    for batch, depth, width, budget in ((6, 4, 3, 12), (16, 16, 8, 64), (8, 12, 32, 300), (64, 16, 16, 256)):
        lp, ids = random_draft(rng, batch, depth, width)
        budgets = rng.integers(0, budget + 1, batch).astype(np.int32)
        budgets[0], budgets[-1] = budget, 0
        depths = rng.integers(0, depth + 1, batch).astype(np.int32)
        depths[0] = depth
        yield lp, ids, budget, budgets, depths


# KDT_TESTING_TREES_* of native/kdt_testing.h: each forces one path of the CUDA builder.
PATHS = {"auto": 0, "heap": 0x01, "bisect": 0x02, "thread-chains": 0x04, "global-heap": 0x20}


@pytest.mark.gpu
@pytest.mark.parametrize("paths", list(PATHS))
def test_gpu_matches_cpu_with_limits(cuda_device, paths):
    torch = pytest.importorskip("torch")
    lib = _lib.load()
    lib.kdt_testing_set_tree_paths(PATHS[paths])
    try:
        for lp, ids, budget, budgets, depths in _gpu_cases():
            cpu = kdtree.build_trees(lp, ids, budget, request_budgets=budgets, request_depths=depths)
            gpu = kdtree.build_trees(torch.from_numpy(lp).to(cuda_device), torch.from_numpy(ids).to(cuda_device),
                                     budget, request_budgets=torch.from_numpy(budgets).to(cuda_device),
                                     request_depths=depths)
            for name in FIELDS:
                g = getattr(gpu, name).cpu().numpy()
                c = getattr(cpu, name)
                if name == "logw":
                    g, c = g.view(np.int64), c.view(np.int64)
                np.testing.assert_array_equal(g, c, err_msg=f"{name} (B {lp.shape[0]}, N {budget})")
            # An out-of-range limit: that request's status, root-only; the others built.
            bad = budgets.copy()
            bad[1] = budget + 1
            gpu = kdtree.build_trees(torch.from_numpy(lp).to(cuda_device), torch.from_numpy(ids).to(cuda_device),
                                     budget, request_budgets=bad, request_depths=depths, errors="status")
            status = gpu.request_status.cpu().numpy()
            assert status[1] == _lib.STATUS["KDT_ERR_OUT_OF_RANGE"] and (np.delete(status, 1) == 0).all()
            assert int(gpu.num_nodes[1]) == 0
    finally:
        lib.kdt_testing_set_tree_paths(0)


def test_from_logits_with_limits():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((5, 6, 300)).astype(np.float32) * 3
    budgets, depths = np.array([30, 0, 4, 17, 30], np.int32), np.array([6, 6, 2, 0, 3], np.int32)
    got = kdtree.build_trees_from_logits(logits, 8, 30, request_budgets=budgets, request_depths=depths)
    lp, ids = kdtree.topk_logprobs(logits, 8)
    want = kdtree.build_trees(lp, ids, 30, vocab_size=300, request_budgets=budgets, request_depths=depths)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    # A NaN row past request 2's depth limit (2) does not fail it; inside the limit it does.
    logits[2, 4, 7] = np.nan
    again = kdtree.build_trees_from_logits(logits, 8, 30, request_budgets=budgets, request_depths=depths)
    np.testing.assert_array_equal(again.tokens, got.tokens)
    logits[2, 1, 7] = np.nan
    with pytest.raises(_lib.KdtreeError, match="request 2, depth 2"):
        kdtree.build_trees_from_logits(logits, 8, 30, request_budgets=budgets, request_depths=depths)


@pytest.mark.gpu
def test_gpu_from_logits_with_limits(cuda_device):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    logits = torch.from_numpy(rng.standard_normal((16, 12, 5000)).astype(np.float32) * 3).to(cuda_device)
    budgets = rng.integers(0, 129, 16).astype(np.int32)
    depths = rng.integers(0, 13, 16).astype(np.int32)
    logits[3, 11, 5] = float("nan")
    depths[3] = 10  # the NaN row is past request 3's limit
    gpu = kdtree.build_trees_from_logits(logits, 64, 128, request_budgets=torch.from_numpy(budgets).to(cuda_device),
                                         request_depths=depths)
    lp, ids = kdtree.topk_logprobs(logits, 64, errors="status")[:2]
    cpu = kdtree.build_trees(lp.cpu().numpy(), ids.cpu().numpy(), 128, vocab_size=5000, request_budgets=budgets,
                             request_depths=depths)
    for name in FIELDS:
        g, c = getattr(gpu, name).cpu().numpy(), getattr(cpu, name)
        if name == "logw":
            g, c = g.view(np.int64), c.view(np.int64)
        np.testing.assert_array_equal(g, c, err_msg=name)


def test_status_fallback_uses_the_requests_own_depth():
    # A root position valid for the request's own depth limit (1), not for the call's (4):
    # the failed request's root-only tree keeps it, and nothing raises with errors="status".
    lp = np.log(np.full((1, 4, 1), 0.5, np.float32))
    ids = np.ones((1, 4, 1), np.int32)
    t = kdtree.build_trees(lp, ids, 2, root_positions=[2**63 - 2], request_depths=[1])
    assert t.num_nodes.tolist() == [1]
    t = kdtree.build_trees(lp, ids, 2, root_tokens=[-1], root_positions=[2**63 - 2], request_depths=[1],
                           errors="status")
    assert t.request_status.tolist() == [_lib.STATUS["KDT_ERR_OUT_OF_RANGE"]]
    assert t.num_nodes.tolist() == [0] and t.positions[0, 0] == 2**63 - 2


def test_a_limit_outside_int32_is_its_requests_error():
    rng = np.random.default_rng(2)
    lp, ids = random_draft(rng, 2, 3, 3)
    with pytest.raises(_lib.KdtreeError, match=r"request 1: budget 2147483648 outside int32 \(request_budgets\)"):
        kdtree.build_trees(lp, ids, 4, request_budgets=[3, 2**31])
    t = kdtree.build_trees(lp, ids, 4, request_budgets=[3, 2**31], errors="status")
    assert t.request_status.tolist() == [0, _lib.STATUS["KDT_ERR_OUT_OF_RANGE"]]
    assert t.num_nodes[1] == 0 and t.num_nodes[0] == 3
    empty = kdtree.build_trees(lp[:0], ids[:0], 4, request_budgets=[], request_depths=[], root_tokens=[])
    assert empty.num_nodes.shape == (0,)


def test_from_logits_reads_only_what_the_limits_use():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    x[0, 0, 0] = np.nan
    # Request 0 has budget 0: it reads nothing, with or without depth limits.
    a = kdtree.build_trees_from_logits(x, 4, 4, request_budgets=[0, 4])
    b = kdtree.build_trees_from_logits(x, 4, 4, request_budgets=[0, 4], request_depths=[3, 3])
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.num_nodes.tolist()[0] == 0
    # Reading the bad row names it.
    with pytest.raises(_lib.KdtreeError, match=r"request 0, depth 1: logits\[0, 0\] holds a NaN or \+inf"):
        kdtree.build_trees_from_logits(x, 4, 4, request_budgets=[4, 4])
    # k' = 0: no row is read (as on the GPU), whatever it holds.
    none = kdtree.build_trees_from_logits(x, 0, 4)
    assert none.num_nodes.tolist() == [0, 0]
