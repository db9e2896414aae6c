"""KV compaction of one-byte caches (fp8 e4m3 / e5m2, int8, uint8: moved as bytes) and of
SGLang's token-pool form (a pool of slots [slots, H, D] and req_to_token, which is the
paged layout with page size 1).

The reference is a numpy gather written here: after compaction, request b's rows p + j
(j = 0 .. accept_length) hold what rows p + accepted_nodes[b][j] held before, byte for
byte, and every other row is unchanged. On the GPU the kernels must give the CPU's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

import kdtree

torch = pytest.importorskip("torch", reason="torch is not installed (fp8 tensors are torch's)")

pytestmark = pytest.mark.usefixtures("lib")

PATHS = [([0, 2, 3, 7], 3), ([0, 1, 2], 2), ([0, 5], 1), ([0], 0), ([0, 1, 4, 5, 9, 12], 5)]


def acceptance(like=None):
    batch, width = len(PATHS), max(len(p) for p, _ in PATHS)
    nodes = np.full((batch, width), -1, np.int32)
    for b, (p, _) in enumerate(PATHS):
        nodes[b, : len(p)] = p
    arrays = (nodes, np.array([m for _, m in PATHS], np.int32), np.zeros(batch, np.int32))
    if like is not None:
        arrays = tuple(torch.from_numpy(a).to(like) for a in arrays)
    return kdtree.Acceptance(*arrays)


def expected_bhsd(before: np.ndarray, prefix) -> np.ndarray:
    """[B, H, S, D] bytes after compaction, by a gather of the rows before it."""
    want = before.copy()
    for b, (path, m) in enumerate(PATHS):
        p = int(prefix[b])
        want[b, :, p: p + m + 1] = before[b][:, [p + a for a in path[: m + 1]]]
    return want


def random_bytes(rng, shape, dtype):
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[raw == 0x7F] = 0  # fp8 e4m3fn NaN bit patterns are moved like any other, but keep them rare
    return torch.from_numpy(raw).view(dtype)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8", "uint8"])
def test_host_one_byte_cache_is_moved_as_bytes(dtype):
    rng = np.random.default_rng(1)
    shape = (len(PATHS), 3, 24, 32)
    layers = [random_bytes(rng, shape, getattr(torch, dtype)) for _ in range(4)]
    before = [t.view(torch.uint8).numpy().copy() for t in layers]
    prefix = rng.integers(0, 10, len(PATHS))
    status = kdtree.compact_kv(layers[:2], layers[2:], prefix, acceptance(), layout="bhsd")
    assert status.tolist() == [0] * len(PATHS)
    for t, old in zip(layers, before, strict=True):
        np.testing.assert_array_equal(t.view(torch.uint8).numpy(), expected_bhsd(old, prefix))


def test_host_sglang_token_pool():
    # SGLang keeps per layer a pool [slots, H, D] and req_to_token [requests, context]
    # (int32 slot of each token); as a paged cache that is [slots, 1, H, D] with page size 1.
    rng = np.random.default_rng(2)
    batch, context, slots, heads, dim = len(PATHS), 32, 200, 2, 16
    req_to_token = rng.permutation(slots)[: batch * context].reshape(batch, context).astype(np.int32)
    pools = [random_bytes(rng, (slots, heads, dim), torch.float8_e4m3fn) for _ in range(2)]
    prefix = rng.integers(0, 12, batch)
    logical = [p.view(torch.uint8).numpy()[req_to_token].transpose(0, 2, 1, 3).copy() for p in pools]  # [B, H, S, D]
    want = [expected_bhsd(x, prefix) for x in logical]
    owned = np.zeros(slots, bool)
    owned[req_to_token.reshape(-1)] = True
    untouched = [p.view(torch.uint8).numpy()[~owned].copy() for p in pools]
    status = kdtree.compact_kv([pools[0][:, None]], [pools[1][:, None]], prefix, acceptance(), layout="pshd",
                               block_table=req_to_token)
    assert status.tolist() == [0] * batch
    for p, w, u in zip(pools, want, untouched, strict=True):
        got = p.view(torch.uint8).numpy()
        np.testing.assert_array_equal(got[req_to_token].transpose(0, 2, 1, 3), w)
        np.testing.assert_array_equal(got[~owned], u)


def test_host_other_dtypes_are_refused():
    cache = [np.zeros((len(PATHS), 2, 24, 8), np.int32) for _ in range(2)]
    with pytest.raises(TypeError, match="one byte"):
        kdtree.compact_kv(cache[:1], cache[1:], np.zeros(len(PATHS), int), acceptance())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "uint8"])
@pytest.mark.parametrize("layout", ["bhsd", "pshd"])
def test_gpu_one_byte_cache_gives_the_cpu_bytes(cuda_device, dtype, layout):
    rng = np.random.default_rng(3)
    tdt = getattr(torch, dtype)
    prefix = rng.integers(0, 10, len(PATHS))
    if layout == "bhsd":
        cpu = [random_bytes(rng, (len(PATHS), 3, 24, 64), tdt) for _ in range(4)]
        table = None
    else:
        cpu = [random_bytes(rng, (300, 1, 3, 64), tdt) for _ in range(4)]
        table = rng.permutation(300)[: len(PATHS) * 24].reshape(len(PATHS), 24).astype(np.int32)
    gpu = [t.to(cuda_device) for t in cpu]
    kdtree.compact_kv(cpu[:2], cpu[2:], prefix, acceptance(), layout=layout, block_table=table)
    status = kdtree.compact_kv(gpu[:2], gpu[2:], torch.from_numpy(prefix).to(cuda_device), acceptance(cuda_device),
                               layout=layout,
                               block_table=None if table is None else torch.from_numpy(table).to(cuda_device))
    assert status.cpu().tolist() == [0] * len(PATHS)
    for c, g in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(g.cpu().view(torch.uint8).numpy(), c.view(torch.uint8).numpy())
