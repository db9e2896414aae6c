"""KV compaction on paged caches (``compact_kv`` with ``block_table``; layouts ``"pshd"``
``[pages, page_size, H, D]`` and ``"phsd"`` ``[pages, H, page_size, D]``).

The reference is independent of the paged code: each request's logical rows are gathered
through its block table into a contiguous ``[B, H, S, D]`` cache, the contiguous
compaction (tested against hand cases elsewhere) runs on that, and the paged result,
gathered the same way, must be equal element for element; pages that no request owns
must be untouched. On the GPU the paged kernel must give the CPU's bits.
"""

from __future__ import annotations

import numpy as np
import pytest

import kdtree
from kdtree import _native as _lib

OUT_OF_RANGE = _lib.STATUS["KDT_ERR_OUT_OF_RANGE"]
PATHS = [([0, 2, 3, 7], 3), ([0, 1, 2], 2), ([0, 5], 1), ([0], 0), ([0, 1, 4, 5, 9, 12], 5)]


def make_case(rng, layout, page_size, dtype=np.float32, heads=2, dim=16, layers=3):
    batch = len(PATHS)
    longest = max(max(p) for p, _ in PATHS)
    per_req = -(-(longest + 9) // page_size) + 1  # pages a request: room for prefixes up to 9 tokens and more
    pages = batch * per_req + 5  # 5 pages no request owns
    table = rng.permutation(pages)[: batch * per_req].reshape(batch, per_req).astype(np.int32)
    shape = (pages, page_size, heads, dim) if layout == "pshd" else (pages, heads, page_size, dim)
    pools = [rng.standard_normal(shape).astype(dtype) for _ in range(2 * layers)]
    width = max(len(p) for p, _ in PATHS)
    nodes = np.full((batch, width), -1, np.int32)
    for b, (p, _) in enumerate(PATHS):
        nodes[b, : len(p)] = p
    acc = kdtree.Acceptance(nodes, np.array([m for _, m in PATHS], np.int32), np.zeros(batch, np.int32))
    seq = per_req * page_size
    prefix = rng.integers(0, seq - longest, batch)
    return pools, table, acc, prefix


def gather(pool, table, layout):
    """[B, H, S, D] logical rows of each request (S = pages a request x page size)."""
    pages = pool[table]  # [B, n, ps, H, D] or [B, n, H, ps, D]
    if layout == "phsd":
        pages = pages.transpose(0, 1, 3, 2, 4)
    b, n, ps, h, d = pages.shape
    return np.ascontiguousarray(pages.reshape(b, n * ps, h, d).transpose(0, 2, 1, 3))


@pytest.mark.parametrize("layout", ["pshd", "phsd"])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_host_paged_equals_contiguous_on_the_gathered_rows(layout, page_size):
    rng = np.random.default_rng(page_size)
    pools, table, acc, prefix = make_case(rng, layout, page_size)
    want = [gather(p, table, layout) for p in pools]
    kdtree.compact_kv(want[:3], want[3:], prefix, acc, layout="bhsd")
    before = [p.copy() for p in pools]
    status = kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout=layout, block_table=table)
    assert status.tolist() == [0] * len(PATHS)
    unowned = np.setdiff1d(np.arange(pools[0].shape[0]), table)
    for pool, old, w in zip(pools, before, want, strict=True):
        np.testing.assert_array_equal(gather(pool, table, layout), w)
        np.testing.assert_array_equal(pool[unowned], old[unowned])


def test_host_page_out_of_the_pool_fails_only_that_request():
    rng = np.random.default_rng(1)
    pools, table, acc, prefix = make_case(rng, "pshd", 4)
    b = 4  # path [0, 1, 4, 5, 9, 12]: tokens p + 12 and p + 5 are read or written
    table[b, (int(prefix[b]) + 12) // 4] = pools[0].shape[0]  # one past the pool
    before = [p.copy() for p in pools]
    status = kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout="pshd", block_table=table, errors="status")
    assert status[b] == OUT_OF_RANGE
    assert (np.delete(status, b) == 0).all()
    pages_b = table[b][table[b] < pools[0].shape[0]]
    for pool, old in zip(pools, before, strict=True):
        np.testing.assert_array_equal(pool[pages_b], old[pages_b])  # the failed request is untouched
    with pytest.raises(kdtree.KdtreeError, match="outside the pool"):
        kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout="pshd", block_table=table)


def test_host_paged_arguments_are_checked():
    rng = np.random.default_rng(2)
    pools, table, acc, prefix = make_case(rng, "pshd", 4)
    with pytest.raises(kdtree.KdtreeError, match="needs block_table"):
        kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout="pshd")
    with pytest.raises(kdtree.KdtreeError, match="takes no block_table"):
        kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout="bhsd", block_table=table)
    with pytest.raises(kdtree.KdtreeError, match="block_table must be an int32 array"):
        kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout="pshd", block_table=table.astype(np.int64))
    with pytest.raises(kdtree.KdtreeError, match="the block_table's"):
        kdtree.compact_kv(pools[:3], pools[3:], prefix, acc, layout="pshd", block_table=table[:3])
    with pytest.raises(kdtree.KdtreeError, match="acceptance must be an Acceptance"):
        kdtree.compact_kv(pools[:3], pools[3:], prefix, (acc.accepted_nodes, acc.accept_length), layout="pshd",
                          block_table=table)
    big = [np.zeros((4, 300, 2, 16), np.float32) for _ in range(2)]
    with pytest.raises(kdtree.KdtreeError, match="outside \\[1, 256\\]"):
        kdtree.compact_kv(big[:1], big[1:], prefix, acc, layout="pshd", block_table=table)


torch = pytest.importorskip("torch", reason="torch is not installed (the GPU test uses torch tensors)")


@pytest.fixture(scope="module")
def cuda(cuda_device):
    return cuda_device


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout,page_size", [("pshd", 1), ("pshd", 16), ("phsd", 3), ("phsd", 16)])
def test_gpu_paged_gives_the_cpu_bits(cuda, dtype, layout, page_size):
    rng = np.random.default_rng(7 + page_size)
    pools, table, acc, prefix = make_case(rng, layout, page_size, dim=64)
    tdt = getattr(torch, dtype)
    gpu = [torch.from_numpy(p).to(cuda).to(tdt) for p in pools]
    cpu = [g.float().cpu().numpy() for g in gpu]  # the same values, widened exactly
    kdtree.compact_kv(cpu[:3], cpu[3:], prefix, acc, layout=layout, block_table=table)
    gacc = kdtree.Acceptance(torch.from_numpy(acc.accepted_nodes).to(cuda),
                             torch.from_numpy(acc.accept_length).to(cuda), torch.from_numpy(acc.bonus_token).to(cuda))
    # The table is a slice of a wider one (rows 3 entries apart more than it holds), as an
    # engine's preallocated block table is.
    wide = torch.full((table.shape[0], table.shape[1] + 3), -1, dtype=torch.int32, device=cuda)
    wide[:, : table.shape[1]] = torch.from_numpy(table).to(cuda)
    status = kdtree.compact_kv(gpu[:3], gpu[3:], torch.from_numpy(prefix).to(cuda), gacc, layout=layout,
                               block_table=wide[:, : table.shape[1]])
    assert status.cpu().tolist() == [0] * len(PATHS)
    for c, g in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(g.float().cpu().numpy(), c)


def test_gpu_page_out_of_the_pool_fails_only_that_request(cuda):
    rng = np.random.default_rng(3)
    pools, table, acc, prefix = make_case(rng, "phsd", 4, dim=64)
    b = 0  # path [0, 2, 3, 7]
    table[b, (int(prefix[b]) + 7) // 4] = -1
    gpu = [torch.from_numpy(p).to(cuda) for p in pools]
    before = [g.clone() for g in gpu]
    gacc = kdtree.Acceptance(torch.from_numpy(acc.accepted_nodes).to(cuda),
                             torch.from_numpy(acc.accept_length).to(cuda), torch.from_numpy(acc.bonus_token).to(cuda))
    status = kdtree.compact_kv(gpu[:3], gpu[3:], torch.from_numpy(prefix).to(cuda), gacc, layout="phsd",
                               block_table=torch.from_numpy(table).to(cuda), errors="status").cpu().numpy()
    assert status[b] == OUT_OF_RANGE and (np.delete(status, b) == 0).all()
    own = torch.from_numpy(table[b][table[b] >= 0].astype(np.int64)).to(cuda)
    for g, old in zip(gpu, before, strict=True):
        assert torch.equal(g[own], old[own])
