"""The counter-based draws of sampled verification on the host: Philox4x32-10 and the
Gumbel-max draw of ``kdt_verify_sample_from_logits_cuda``, in numpy."""

from __future__ import annotations

import numpy as np

from . import checks

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))


_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(counter: tuple, key: tuple) -> list[np.ndarray]:
    """Philox4x32-10 (Salmon et al., SC 2011) on numpy uint32 arrays: four words per
    counter. The GPU sampling kernel uses the same function (native/cuda/common.cuh)."""
    mask = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & mask for x in counter]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(10):
        p0 = _PHILOX_M[0] * c[0]
        p1 = _PHILOX_M[1] * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & mask
        hi1, lo1 = p1 >> np.uint64(32), p1 & mask
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF
        k1 = (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
    return [x.astype(np.uint32) for x in c]


def gumbel_draws(logits_rows: np.ndarray, temperature: float, seed: int, offset: int, request: int,
                 nodes: np.ndarray) -> np.ndarray:
    """The documented draw of ``kdt_verify_sample_from_logits_cuda`` on the host, for rows
    ``logits_rows[j]`` at tree nodes ``nodes[j]`` of one request: the argmax of
    ``logit / T - log(-log(u))`` in float32 (ties: lower id); -1 for a row with a NaN or
    +inf logit or only -inf logits. ``temperature`` must be a float32 >= 1e-6 (as checked
    by :func:`verify_sample_from_logits`)."""
    seed = checks.int_scalar(seed, "seed", 0, 2**64 - 1)
    offset = checks.int_scalar(offset, "offset", 0, 2**64 - 1)
    request = checks.int_scalar(request, "request", 0, 2**32 - 1)
    t32 = np.float32(temperature)
    if not np.isfinite(t32) or not t32 >= np.float32(1e-6):
        raise checks.value_error(f"temperature must be finite and >= 1e-6, got {temperature!r}")
    rows = np.asarray(logits_rows, dtype=np.float32)
    nodes = np.asarray(nodes)
    if rows.ndim != 2 or rows.shape[1] < 1 or nodes.shape != (rows.shape[0],):
        raise checks.shape_error(f"logits_rows must be [n, V >= 1] and nodes [n], got {rows.shape} and {nodes.shape}")
    if nodes.size and (nodes.dtype.kind not in "iu" or nodes.min() < 0 or nodes.max() > 2**32 - 1):
        raise checks.invalid("nodes must be integers in [0, 2^32)")
    vocab = rows.shape[-1]
    v = np.arange(vocab, dtype=np.uint64)
    out = np.empty(rows.shape[0], np.int32)
    key = (seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    for j, node in enumerate(nodes):
        words = philox4x32_10((v >> np.uint64(2), np.full(vocab, node, np.uint64),
                               np.full(vocab, request, np.uint64), np.full(vocab, offset & 0xFFFFFFFF, np.uint64)), key)
        x = np.choose((v & np.uint64(3)).astype(np.int64), words)
        k = (x >> np.uint32(8)).astype(np.int64)  # u = (2k + 1) * 2^-25, in (0, 1)
        # -log(u) from exact float32 arguments (u itself rounds to 1.0 at the top in float32)
        low = k < 2**23
        t = np.empty(vocab, np.float32)
        t[low] = -np.log(((2 * k[low] + 1).astype(np.float32)) * np.float32(2.0**-25))
        t[~low] = -np.log1p(-((2**25 - 2 * k[~low] - 1).astype(np.float32)) * np.float32(2.0**-25))
        with np.errstate(divide="ignore", invalid="ignore"):
            score = rows[j] / t32 - np.log(t)
        if np.isnan(rows[j]).any() or np.isposinf(rows[j]).any() or np.isneginf(rows[j]).all():
            out[j] = -1  # no draw: the walk reports KDT_ERR_VALUE if it visits this node
            continue
        out[j] = int(np.argmax(score))
    return out
