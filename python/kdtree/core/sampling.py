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


def _gumbel_log_t(vocab: int, seed: int, offset: int, request: int, node: int, start: int = 0) -> np.ndarray:
    """log(-log(u)) in float32 for the tokens start .. start + vocab - 1 of one row (the
    noise is its negation; a token's value depends on its id alone, not on the range)."""
    v = np.arange(start, start + vocab, dtype=np.uint64)
    key = (seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    words = philox4x32_10((v >> np.uint64(2), np.full(vocab, node, np.uint64),
                           np.full(vocab, request, np.uint64), np.full(vocab, offset & 0xFFFFFFFF, np.uint64)), key)
    x = np.choose((v & np.uint64(3)).astype(np.int64), words)
    k = (x >> np.uint32(8)).astype(np.int64)  # u = (2k + 1) * 2^-25, in (0, 1)
    # -log(u) from exact float32 arguments (u itself rounds to 1.0 at the top in float32)
    low = k < 2**23
    t = np.empty(vocab, np.float32)
    t[low] = -np.log(((2 * k[low] + 1).astype(np.float32)) * np.float32(2.0**-25))
    t[~low] = -np.log1p(-((2**25 - 2 * k[~low] - 1).astype(np.float32)) * np.float32(2.0**-25))
    return np.log(t)


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
    out = np.empty(rows.shape[0], np.int32)
    for j, node in enumerate(nodes):
        if np.isnan(rows[j]).any() or np.isposinf(rows[j]).any() or np.isneginf(rows[j]).all():
            out[j] = -1  # no draw: the walk reports KDT_ERR_VALUE if it visits this node
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            score = rows[j] / t32 - _gumbel_log_t(vocab, seed, offset, request, int(node))
        out[j] = int(np.argmax(score))
    return out


# ---- Per-request settings: kdt_verify_sample_batch_cuda ---------------------------------

# E(d), the float64 exponential of the top-p weights (include/kdtree.h,
# native/cuda/sample_select.cuh): the same IEEE float64 operations in the same order, so
# the same bits as the kernel's (numpy's element-wise operations are never fused).
_INV_FACTORIAL = [float.fromhex(h) for h in (
    "0x1.0000000000000p+0", "0x1.0000000000000p+0", "0x1.0000000000000p-1", "0x1.5555555555555p-3",
    "0x1.5555555555555p-5", "0x1.1111111111111p-7", "0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-13",
    "0x1.a01a01a01a01ap-16", "0x1.71de3a556c734p-19", "0x1.27e4fb7789f5cp-22", "0x1.ae64567f544e4p-26",
    "0x1.1eed8eff8d898p-29", "0x1.6124613a86d09p-33")]
_INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")


def sample_exp(d: np.ndarray) -> np.ndarray:
    """E(d) for float64 d in [-64, 0]: k = floor(d * (1 / ln 2) + 0.5), r = (d - k ln2_hi) -
    k ln2_lo, the degree-13 Taylor polynomial of exp(r) by Horner, times 2^k."""
    d = np.asarray(d, np.float64)
    k = np.floor(d * _INV_LN2 + 0.5)
    r = (d - k * _LN2_HI) - k * _LN2_LO
    q = np.full(d.shape, _INV_FACTORIAL[13])
    for n in range(12, -1, -1):
        q = q * r + _INV_FACTORIAL[n]
    return q * np.ldexp(1.0, k.astype(np.int64))


def weight_shift(vocab: int) -> int:
    """S = 63 - ceil(log2(V)): V weights of at most 2^S sum to at most 2^63."""
    return 63 - (int(vocab) - 1).bit_length() if vocab > 1 else 63


def top_p_weights(scores: np.ndarray, top: np.float32) -> np.ndarray:
    """uint64 weights floor(E(s - m) * 2^S) of float32 scores s (0 for s - m < -64 and -inf)."""
    d = scores.astype(np.float64) - np.float64(top)
    ok = d >= -64.0
    w = np.zeros(scores.shape, np.uint64)
    w[ok] = np.floor(sample_exp(d[ok]) * 2.0 ** weight_shift(scores.shape[-1])).astype(np.uint64)
    return w


def token_keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys (order_key(value) << 32) | ~id of a float32 row: a larger key is a larger
    value, or an equal value (-0 equals +0) and a lower id."""
    x = np.where(values == 0, np.float32(0), values).astype(np.float32)
    u = x.view(np.uint32)
    order = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint64)
    ids = np.arange(values.shape[-1], dtype=np.uint64)
    return (order << np.uint64(32)) | (~ids & np.uint64(0xFFFFFFFF))


def cut(row: np.ndarray, temperature: np.float32, top_p: np.float32, top_k: int) -> np.ndarray:
    """The tokens the top-k and top-p cuts keep (bool [V]) for one float32 row that can be
    sampled (no NaN or +inf, not only -inf), at temperature T > 0 (include/kdtree.h,
    kdt_verify_sample_batch_cuda)."""
    vocab = row.shape[-1]
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        keys = token_keys(row)
        keep &= keys >= np.partition(keys, vocab - top_k)[vocab - top_k]  # the top_k-th largest key
    if top_p < 1:
        scores = row / np.float32(temperature)
        keys = token_keys(scores)
        weights = top_p_weights(scores, scores.max())
        cand = np.flatnonzero(keep)
        order = cand[np.argsort(keys[cand])[::-1]]  # keys are distinct: decreasing score, then lower id
        cum = np.cumsum(weights[order], dtype=np.uint64)  # exact: the total is at most 2^63
        reached = cum.astype(np.float64) >= np.float64(top_p) * np.float64(cum[-1])
        keep &= keys >= keys[order[int(np.argmax(reached))]]
    return keep


def bad_setting(temperature, top_p, top_k) -> str | None:
    """Why one request's settings are invalid (its KDT_ERR_VALUE), or None."""
    t, p = np.float32(temperature), np.float32(top_p)
    if not (t == 0 or (np.isfinite(t) and t >= np.float32(1e-6))):
        return f"temperature {float(t)!r} must be 0 (greedy) or finite and >= 1e-6"
    if not 0 < p <= 1:
        return f"top_p {float(p)!r} must be in (0, 1]"
    if top_k < 0:
        return f"top_k {int(top_k)} must be >= 0 (0: no top-k cut)"
    return None


def batch_draws(logits_rows: np.ndarray, temperature, top_p, top_k: int, seed: int, offset: int, request: int,
                nodes: np.ndarray) -> np.ndarray:
    """The tokens of ``kdt_verify_sample_batch_cuda`` on the host, for rows ``logits_rows[j]``
    at tree nodes ``nodes[j]`` of one request whose settings are valid (:func:`bad_setting`):
    temperature 0 gives the argmax (ties lower id; -1 for a row with a NaN), else the
    Gumbel-max draw of :func:`gumbel_draws` over the tokens the cuts keep (-1 for a row with
    a NaN or +inf logit or only -inf logits)."""
    rows = np.asarray(logits_rows, dtype=np.float32)
    t32 = np.float32(temperature)
    out = np.empty(rows.shape[0], np.int32)
    for j, node in enumerate(np.asarray(nodes)):
        row = rows[j]
        if t32 == 0:
            out[j] = -1 if np.isnan(row).any() else int(np.argmax(row))
            continue
        if np.isnan(row).any() or np.isposinf(row).any() or np.isneginf(row).all():
            out[j] = -1
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            score = row / t32 - _gumbel_log_t(row.shape[-1], int(seed), int(offset), int(request), int(node))
        score[~cut(row, t32, np.float32(top_p), int(top_k))] = -np.inf
        out[j] = int(np.argmax(score))
    return out
