"""Ragged (packed) tree rows: kdtree.ragged_trees / kdt_trees_ragged_cpu / _cuda.

Checked against numpy concatenations of each request's real rows, the ancestor sets
walked from the parents, and hand-worked offsets; errors name the request.
"""

from __future__ import annotations

import numpy as np
import pytest

import kdtree
from kdtree import _native as _lib

pytestmark = pytest.mark.usefixtures("lib")


def random_trees(seed=0, batch=7, depth=6, width=4, budget=20, **kw):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(width * 2), size=(batch, depth))[..., :width]
    lp = np.ascontiguousarray(np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32))
    ids = np.argsort(rng.random((batch, depth, 500)), axis=-1)[..., :width].astype(np.int32)
    return kdtree.build_trees(lp, ids, budget, root_tokens=np.arange(batch) + 1,
                              root_positions=np.arange(batch, dtype=np.int64) * 100, **kw)


def expected(t):
    """The packed arrays by numpy concatenation of each request's first num_nodes + 1 rows."""
    n = t.num_nodes.astype(np.int64) + 1
    take = lambda a: np.concatenate([a[b, : n[b]] for b in range(t.batch)])  # noqa: E731
    return dict(
        cu_rows=np.concatenate([[0], np.cumsum(n)]).astype(np.int32),
        row_request=np.repeat(np.arange(t.batch), n).astype(np.int32),
        row_node=np.concatenate([np.arange(k) for k in n]).astype(np.int32),
        tokens=take(t.tokens), depths=take(t.depths), parents=take(t.parents), positions=take(t.positions),
        visibility_bits=take(t.visibility_bits))


def test_packed_rows_equal_the_real_rows():
    t = random_trees(request_budgets=[20, 0, 5, 20, 13, 1, 8])
    r = kdtree.ragged_trees(t)
    want = expected(t)
    total = int(want["cu_rows"][-1])
    assert r.capacity == t.batch * 21
    np.testing.assert_array_equal(r.cu_rows, want["cu_rows"])
    for name in ("row_request", "row_node", "tokens", "depths", "parents", "positions", "visibility_bits"):
        np.testing.assert_array_equal(getattr(r, name)[:total], want[name], err_msg=name)
    # Filler rows.
    for name in ("row_request", "row_node", "tokens", "parents"):
        assert (getattr(r, name)[total:] == -1).all(), name
    for name in ("depths", "positions", "visibility_bits"):
        assert (getattr(r, name)[total:] == 0).all(), name
    assert r.request_status.tolist() == [0] * t.batch


def test_packed_mask_is_the_ancestor_relation():
    t = random_trees(seed=3, budget=40, width=5)
    r = kdtree.ragged_trees(t)
    for row in range(int(r.cu_rows[-1])):
        b, i = int(r.row_request[row]), int(r.row_node[row])
        base = int(r.cu_rows[b])
        seen, j = set(), i
        while j >= 0:  # walk the packed parents up to the root
            seen.add(j)
            j = int(r.parents[base + j])
        bits = np.unpackbits(r.visibility_bits[row].view(np.uint8), bitorder="little")
        assert set(np.flatnonzero(bits).tolist()) == seen
        assert r.depths[row] == len(seen) - 1


def test_hand_worked_offsets():
    lp = np.log(np.array([[[0.6, 0.4]], [[0.9, 0.1]], [[0.5, 0.5]]], np.float32))
    ids = np.array([[[3, 4]], [[5, 6]], [[7, 8]]], np.int32)
    t = kdtree.build_trees(lp, ids, 2, request_budgets=[2, 1, 0])
    r = kdtree.ragged_trees(t)
    assert r.cu_rows.tolist() == [0, 3, 5, 6]
    assert r.tokens[:6].tolist() == [-1, 3, 4, -1, 5, -1]
    assert r.row_request.tolist() == [0, 0, 0, 1, 1, 2, -1, -1, -1]
    assert r.parents[:6].tolist() == [-1, 0, 0, -1, 0, -1]
    assert r.visibility_bits[:6, 0].tolist() == [0b1, 0b11, 0b101, 0b1, 0b11, 0b1]


def test_capacity():
    t = random_trees(seed=1)
    total = int(t.num_nodes.sum()) + t.batch
    exact = kdtree.ragged_trees(t, capacity=total)
    np.testing.assert_array_equal(exact.tokens, expected(t)["tokens"])
    too_many = rf"the trees' {total} real rows exceed the capacity {total - 1} \(out->capacity; Python: capacity=\)"
    with pytest.raises(_lib.KdtreeError, match=too_many) as e:
        kdtree.ragged_trees(t, capacity=total - 1)
    assert e.value.status == _lib.STATUS["KDT_ERR_BUFFER_TOO_SMALL"]
    with pytest.raises(_lib.KdtreeError, match="capacity"):
        kdtree.ragged_trees(t, capacity=-1)


def test_bad_num_nodes_names_the_request():
    t = random_trees(seed=2)
    t.num_nodes[4] = 21
    with pytest.raises(_lib.KdtreeError, match=r"request 4: num_nodes 21 outside \[0, 20\]"):
        kdtree.ragged_trees(t)


def test_bytes_against_the_padded_dense_mask():
    # B = 64, N = 64, prefix 32k: the packed mask (prefix implicit) against the dense
    # additive bf16 mask [B, N+1, p+N+1], with every tree full (the most real rows).
    batch, budget, prefix = 64, 64, 32768
    words = (budget + 1 + 31) // 32
    packed = batch * (budget + 1) * words * 4 + (batch + 1) * 4
    dense = batch * (budget + 1) * (prefix + budget + 1) * 2
    assert packed / dense < 0.05
    t = random_trees(seed=4, batch=batch, depth=16, width=8, budget=budget)
    r = kdtree.ragged_trees(t)
    assert r.visibility_bits.nbytes + r.cu_rows.nbytes == packed


@pytest.mark.gpu
def test_gpu_matches_cpu(cuda_device):
    torch = pytest.importorskip("torch")
    for seed, budgets in ((0, None), (5, [20, 0, 3, 1, 20, 7, 9])):
        cpu_trees = random_trees(seed=seed, request_budgets=budgets)
        gpu_trees = kdtree.TreeBatch(**{f: (torch.from_numpy(np.ascontiguousarray(getattr(cpu_trees, f))).to(
            cuda_device) if f != "visibility" else torch.from_numpy(cpu_trees.visibility).to(cuda_device))
            for f in kdtree.core.types.TREE_FIELDS}, budget=cpu_trees.budget, depth=cpu_trees.depth)
        cpu = kdtree.ragged_trees(cpu_trees)
        gpu = kdtree.ragged_trees(gpu_trees)
        for name in ("cu_rows", "row_request", "row_node", "tokens", "depths", "parents", "positions",
                     "visibility_bits"):
            np.testing.assert_array_equal(getattr(gpu, name).cpu().numpy(), getattr(cpu, name), err_msg=name)
        # Too small a capacity: every request's status, cu_rows all zeros.
        small = kdtree.ragged_trees(gpu_trees, capacity=3, errors="status")
        assert (small.request_status.cpu().numpy() == _lib.STATUS["KDT_ERR_BUFFER_TOO_SMALL"]).all()
        assert (small.cu_rows.cpu().numpy() == 0).all()
        # A bad num_nodes: that request packed as its root alone, KDT_ERR_VALUE.
        bad = gpu_trees.num_nodes.clone()
        gpu_trees.num_nodes[2] = 999
        r = kdtree.ragged_trees(gpu_trees, errors="status")
        status = r.request_status.cpu().numpy()
        assert status[2] == _lib.STATUS["KDT_ERR_VALUE"] and (np.delete(status, 2) == 0).all()
        cu = r.cu_rows.cpu().numpy()
        assert cu[3] - cu[2] == 1
        gpu_trees.num_nodes.copy_(bad)


def test_errors_status_on_the_host_matches_the_gpu_contract():
    t = random_trees(seed=6)
    t.num_nodes[1] = 99
    r = kdtree.ragged_trees(t, errors="status")
    assert r.request_status.tolist()[1] == _lib.STATUS["KDT_ERR_VALUE"]
    assert (np.delete(r.request_status, 1) == 0).all()
    assert r.cu_rows[2] - r.cu_rows[1] == 1 and r.tokens[r.cu_rows[1]] == t.tokens[1, 0]
    small = kdtree.ragged_trees(random_trees(seed=6), capacity=3, errors="status")
    assert (small.request_status == _lib.STATUS["KDT_ERR_BUFFER_TOO_SMALL"]).all()
    assert (small.cu_rows == 0).all() and (small.row_request == -1).all()
