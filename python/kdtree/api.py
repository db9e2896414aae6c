"""NumPy front end of libkdtree: draft-tree construction, verification, top-k log-probs.

Arrays cross into C only after ``np.ascontiguousarray(..., dtype=...)``; the converted
arrays stay referenced for the whole call. Errors from the library raise
:class:`kdtree.KdtreeError` (a ``ValueError``) carrying the library's message.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import numpy as np

from . import _lib
from ._types import Acceptance, TreeBatch

__all__ = ["build_trees", "verify_greedy", "topk_logprobs", "empty_trees"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_MAX_BUDGET = 2**31 - 3  # node indices are int32 (include/kdtree.h)


def _int_scalar(value, name: str, lo: int, hi: int) -> int:
    """An integer argument (Python or numpy int, not bool or float) within [lo, hi]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.__array_interface__["data"][0]


def _float_array(x, name: str) -> np.ndarray:
    """C-contiguous float32 copy/view of a real floating array (float16, bfloat16, float32,
    float64); other kinds are rejected."""
    a = np.asarray(x)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be a floating array, got dtype {a.dtype}")
    with np.errstate(over="ignore"):  # overflow is reported just below
        out = np.ascontiguousarray(a, dtype=np.float32).reshape(a.shape)
    if a.dtype.itemsize > 4:
        overflow = np.isfinite(a) & ~np.isfinite(out)
        if overflow.any():
            where = tuple(int(i) for i in np.argwhere(overflow)[0])
            raise ValueError(f"{name}{list(where)} = {a[where]!r} is finite but outside float32 range")
    return out


def _int_array(x, name: str, dtype=np.int32) -> np.ndarray:
    """C-contiguous int32/int64 array of an integer input, range-checked (never wrapped)."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if dtype == np.int32 and a.size and a.dtype.itemsize >= 4 and a.dtype != np.int32:
        lo, hi = int(a.min()), int(a.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"{name} has values outside int32 ({lo}..{hi})")
    if dtype == np.int64 and a.dtype == np.uint64 and a.size and int(a.max()) > 2**63 - 1:
        raise ValueError(f"{name} has values outside int64")
    return np.ascontiguousarray(a, dtype=dtype)


def empty_trees(batch: int, budget: int, depth: int) -> TreeBatch:
    """Allocates (uninitialised) output arrays for :func:`build_trees` ``out=``."""
    batch = _int_scalar(batch, "batch", 0, 2**62)
    budget = _int_scalar(budget, "budget", 0, _MAX_BUDGET)
    depth = _int_scalar(depth, "depth", 0, 2**31 - 2)
    lib = _lib.load()
    words = ctypes.c_int64()
    lib.kdt_visibility_words(budget, ctypes.byref(words))
    rows = budget + 1
    return TreeBatch(
        num_nodes=np.empty(batch, np.int32),
        tokens=np.empty((batch, rows), np.int32),
        depths=np.empty((batch, rows), np.int32),
        parents=np.empty((batch, rows), np.int32),
        logw=np.empty((batch, rows), np.float64),
        positions=np.empty((batch, rows), np.int64),
        visibility=np.empty((batch, rows, rows), np.bool_),
        visibility_bits=np.empty((batch, rows, words.value), np.uint32),
        first_child=np.empty((batch, rows), np.int32),
        next_sibling=np.empty((batch, rows), np.int32),
        budget=int(budget),
        depth=int(depth),
    )


_TREE_FIELDS = {
    "num_nodes": (np.int32, 1),
    "tokens": (np.int32, 2),
    "depths": (np.int32, 2),
    "parents": (np.int32, 2),
    "logw": (np.float64, 2),
    "positions": (np.int64, 2),
    "visibility": (np.bool_, 3),
    "visibility_bits": (np.uint32, 3),
    "first_child": (np.int32, 2),
    "next_sibling": (np.int32, 2),
}


def _check_out(out: TreeBatch, batch: int, budget: int) -> None:
    rows = budget + 1
    words = (rows + 31) // 32
    for name, (dtype, ndim) in _TREE_FIELDS.items():
        a = getattr(out, name)
        want = {1: (batch,), 2: (batch, rows), 3: (batch, rows, rows if name == "visibility" else words)}[ndim]
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != want:
            got = (a.dtype, a.shape) if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"out.{name} must be {np.dtype(dtype)} {want}, got {got}")
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"out.{name} must be C-contiguous and writeable")


def _trees_struct(t: TreeBatch, budget: int | None = None) -> _lib.KdtTrees:
    """The C view of `t`; `budget` (default t.budget) must be the one its arrays were
    checked against: C sizes every array from it. Cached on `t` while the same array
    objects are in place (the cache holds them, so their addresses stay valid)."""
    budget = t.budget if budget is None else budget
    arrays = tuple(getattr(t, f) for f in _TREE_FIELDS)
    cached = t._native
    if cached is not None and cached[1] == budget and all(a is b for a, b in zip(cached[0], arrays, strict=True)):
        return cached[2]
    ptrs = [_ptr(a) for a in arrays]
    struct = _lib.KdtTrees(t.batch, budget, *ptrs)
    ranges = [(p, p + a.nbytes) for p, a in zip(ptrs, arrays, strict=True)]
    t._native = (arrays, budget, struct, ranges)
    return struct


def _overlaps_output(a: np.ndarray, t: TreeBatch) -> bool:
    """Whether input `a` shares bytes with any output array of `t` (after _trees_struct)."""
    lo = _ptr(a)
    hi = lo + a.nbytes
    return any(lo < out_hi and out_lo < hi for out_lo, out_hi in t._native[3])


def build_trees(
    logprobs,
    token_ids,
    budget: int,
    *,
    root_tokens=None,
    root_positions=None,
    vocab_size: int | None = None,
    pad_token: int = -1,
    out: TreeBatch | None = None,
) -> TreeBatch:
    """Builds DDTree draft trees on the CPU (spec ``ddtree-tree-build.md``; Ringel & Romano,
    arXiv 2604.12989), bit-identical to :func:`kdtree.reference.build_trees`.

    Args:
        logprobs: ``[B, L, K]`` (or ``[L, K]`` for one request) natural-log probabilities of
            the drafter's top-K per position, rows sorted non-increasing; any floating dtype,
            converted to float32 (the spec's input type). ``-inf`` entries are never emitted.
        token_ids: integer array of the same shape: the token id of each entry.
        budget: N >= 0, the most draft nodes per tree (root excluded).
        root_tokens: ``[B]`` ints written to row 0 of ``tokens`` (default: ``pad_token``).
        root_positions: ``[B]`` ints >= 0, position of each root (default 0).
        vocab_size: when given, every token id must be < vocab_size.
        pad_token: token written to padding rows.
        out: a :class:`TreeBatch` from :func:`empty_trees` (or an earlier call) to reuse;
            every row is rewritten.

    Returns:
        :class:`TreeBatch` with ``N + 1`` rows per request (a 2-D input gives B = 1).

    Raises:
        TypeError: non-floating log-probs or non-integer ids.
        ValueError / KdtreeError: shape mismatch, negative budget, NaN or +inf log-probs,
            unsorted rows, duplicate ids in a row, ids out of range (the message names
            request, depth and rank).
    """
    lp = _float_array(logprobs, "logprobs")
    ids = _int_array(token_ids, "token_ids")
    if lp.ndim == 2 and ids.ndim == 2:
        lp, ids = lp[None], ids[None]
    if lp.ndim != 3 or ids.shape != lp.shape:
        raise ValueError(
            f"logprobs {np.shape(logprobs)} and token_ids {np.shape(token_ids)} must have the "
            "same shape, [B, L, K] or [L, K]"
        )
    budget = _int_scalar(budget, "budget", 0, _MAX_BUDGET)
    batch, depth, width = lp.shape
    roots = None
    if root_tokens is not None:
        roots = _int_array(root_tokens, "root_tokens").reshape(-1)
        if roots.shape != (batch,):
            raise ValueError(f"root_tokens must have shape ({batch},), got {np.shape(root_tokens)}")
    pos = None
    if root_positions is not None:
        pos = _int_array(root_positions, "root_positions", np.int64).reshape(-1)
        if pos.shape != (batch,):
            raise ValueError(f"root_positions must have shape ({batch},), got {np.shape(root_positions)}")
    vocab = 0 if vocab_size is None else _int_scalar(vocab_size, "vocab_size", 1, 2**63 - 1)
    pad = _int_scalar(pad_token, "pad_token", _INT32_MIN, _INT32_MAX)
    lib = _lib.load()
    if out is None:
        out = empty_trees(batch, budget, depth)
    else:
        _check_out(out, batch, budget)
    struct = _trees_struct(out, budget)
    # The C builder writes outputs while it reads inputs: never let them overlap.
    lp, ids, roots, pos = (
        None if a is None or not a.nbytes else (a.copy() if _overlaps_output(a, out) else a)
        for a in (lp, ids, roots, pos)
    )
    draft = _lib.KdtDraft(batch, depth, width, _ptr(lp), _ptr(ids), _ptr(roots), _ptr(pos), vocab, pad)
    lib.kdt_trees_build_cpu(ctypes.byref(draft), ctypes.byref(struct), None, 0)
    out.budget, out.depth = budget, depth  # only once the arrays hold this tree
    return out


def verify_greedy(
    trees: TreeBatch,
    target_tokens,
    *,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
) -> Acceptance:
    """The verification walk (spec: "Verification"): from the root, move to the child whose
    token equals the target's token at the current node, while one exists.

    Args:
        trees: a :class:`TreeBatch` from :func:`build_trees`.
        target_tokens: integer ``[B, N+1]`` (or ``[N+1]`` when B = 1): the target's chosen
            token at every node (argmax of its logits, or a sample); padding rows ignored.
        stop_tokens: token ids; an accepted stop token ends the walk with no bonus token.
        max_commit: None, an int, or ``[B]`` ints >= 0: the most tokens (accepted + bonus)
            each request may commit this round (remaining ``max_new_tokens``).

    Returns:
        :class:`Acceptance`: ``accepted_nodes`` int32 ``[B, L+1]`` (root first, -1 padding),
        ``accept_length`` int32 ``[B]``, ``bonus_token`` int32 ``[B]`` (-1: none).

    Raises:
        ValueError / KdtreeError: shape mismatch, negative caps or target tokens at visited
        nodes, inconsistent tree links.
    """
    if not isinstance(trees, TreeBatch):
        raise TypeError(f"trees must be a TreeBatch, got {type(trees).__name__}")
    batch, rows = trees.batch, trees.budget + 1
    for name in ("num_nodes", "tokens", "first_child", "next_sibling"):
        a = getattr(trees, name)
        want = (batch,) if name == "num_nodes" else (batch, rows)
        if not isinstance(a, np.ndarray) or a.dtype != np.int32 or a.shape != want or not a.flags.c_contiguous:
            raise ValueError(f"trees.{name} must be a C-contiguous int32 array of shape {want}")
    target = _int_array(target_tokens, "target_tokens")
    if target.ndim == 1 and batch == 1:
        target = target[None]
    if target.shape != (batch, rows):
        raise ValueError(f"target_tokens must have shape ({batch}, {rows}), got {np.shape(target_tokens)}")
    stop_list = list(stop_tokens)
    stops = _int_array(stop_list if stop_list else np.zeros(0, np.int32), "stop_tokens").reshape(-1)
    caps = None
    if max_commit is not None:
        caps = _int_array(np.broadcast_to(np.asarray(max_commit), (batch,)), "max_commit", np.int64)
        if (caps < 0).any():
            raise ValueError(f"max_commit must be >= 0, got {caps.tolist()}")
    width = trees.depth + 1
    accepted = np.empty((batch, width), np.int32)
    length = np.empty(batch, np.int32)
    bonus = np.empty(batch, np.int32)
    lib = _lib.load()
    lib.kdt_verify_greedy_cpu(
        ctypes.byref(_trees_struct(trees)), _ptr(target), _ptr(stops) if stops.size else None,
        stops.size, _ptr(caps), width, _ptr(accepted), _ptr(length), _ptr(bonus),
    )
    return Acceptance(accepted_nodes=accepted, accept_length=length, bonus_token=bonus)


def topk_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k log-probs of each row of logits, on the CPU.

    ``logprob = logit - logsumexp(row)`` over the whole row, computed in float64 and rounded
    once to float32, sorted descending with ties ordered by lower token id.

    Args:
        logits: ``[..., V]`` float16, bfloat16, float32 or float64 (converted to float32).
        k: 0 <= k <= V.

    Returns:
        ``(logprobs float32 [..., k], ids int32 [..., k])``.

    Raises:
        TypeError: non-floating logits. ValueError / KdtreeError: k out of range, a NaN or
        +inf logit, or a row whose logits are all -inf (the message names row and column).
    """
    if np.ndim(logits) < 1:
        raise ValueError("logits must have at least one dimension [..., V], got a scalar")
    x = _float_array(logits, "logits")
    vocab = x.shape[-1]
    k = _int_scalar(k, "k", 0, vocab)
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    out_lp = np.empty(x.shape[:-1] + (k,), np.float32)
    out_ids = np.empty(x.shape[:-1] + (k,), np.int32)
    if rows == 0:
        return out_lp, out_ids
    _lib.load().kdt_topk_logprobs_cpu(_ptr(x), rows, vocab, vocab, k, _ptr(out_lp), _ptr(out_ids))
    return out_lp, out_ids
