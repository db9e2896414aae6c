"""NumPy front end of libkdtree: draft-tree construction, verification, top-k log-probs.

Arrays cross into C only after ``np.ascontiguousarray(..., dtype=...)``; the converted
arrays stay referenced for the whole call. Errors from the library raise
:class:`kdtree.KdtreeError` (a ``ValueError``) carrying the library's message.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable

import numpy as np

from . import _device, _lib
from ._types import Acceptance, TreeBatch

__all__ = [
    "build_trees",
    "build_trees_from_logits",
    "compact_kv",
    "empty_trees",
    "topk_logprobs",
    "tree_attention_mask",
    "verify_greedy",
    "verify_greedy_from_logits",
    "verify_sample_from_logits",
]


def _gpu():
    from . import _gpu

    return _gpu


def _prefix_lengths(prefix_lengths, batch: int) -> np.ndarray:
    """prefix_lengths as int64 [B] (an int is used for every request)."""
    a = np.asarray(prefix_lengths)
    if a.size == 0 and batch == 0:
        return np.zeros(0, np.int64)
    if a.ndim == 0:
        a = np.full(batch, a)
    if a.shape != (batch,):
        raise ValueError(f"prefix_lengths must be an int or have shape ({batch},), got shape {a.shape}")
    return _int_array(a, "prefix_lengths", np.int64)


def _ok_status(batch_shape) -> np.ndarray:
    """The status array a CPU call returns under errors="status": every entry KDT_OK (a
    CPU call raises instead of reporting), so results unpack the same on CPU and GPU."""
    return np.zeros(batch_shape, np.int32)


def _cpu_only(stream, errors: str, name: str) -> None:
    if stream is not None:
        raise ValueError(f"{name}: stream= applies to GPU arrays only; the inputs are host arrays")
    if errors not in ("raise", "status"):
        raise ValueError(f'errors must be "raise" or "status", got {errors!r}')

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


def _host_array(x, name: str) -> np.ndarray:
    """np.asarray(x), with a clear TypeError where the producer cannot export its data to
    numpy (e.g. a bfloat16 torch CPU tensor)."""
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError) as exc:
        dtype = getattr(x, "dtype", None)
        if getattr(x, "is_meta", False):
            hint = "a meta tensor holds no data: pass one with values"
        elif getattr(x, "requires_grad", False):
            hint = "detach it first (tensor.detach())"
        else:
            hint = "convert it first (e.g. tensor.float())"
        raise TypeError(f"{name}: a host {type(x).__name__} of dtype {dtype} cannot be read as a numpy array "
                        f"({exc}); {hint}, or pass a GPU array") from None


def _float_array(x, name: str) -> np.ndarray:
    """C-contiguous float32 copy/view of a real floating array (float16, bfloat16, float32,
    float64); other kinds are rejected."""
    a = _host_array(x, name)
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


def _memory_limit_bytes() -> int | None:
    """The memory this process may use at most: the smallest of physical memory, the cgroup
    limit (v2 memory.max or v1 memory.limit_in_bytes) and RLIMIT_AS; None if none is known."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(int(soft))
    except (ImportError, ValueError, OSError):
        pass
    return min(limits) if limits else None


def _bytes_text(n: float) -> str:
    """n bytes as '1.5 GiB' (KiB .. EiB)."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024:
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


def _tree_outputs_fit(batch: int, budget: int, words: int) -> None:
    """Raises MemoryError, naming the budget and the bytes, when the outputs of `batch`
    trees of `budget` nodes exceed the memory this process may use (physical memory, its
    cgroup's limit, RLIMIT_AS): checked before numpy allocates, so a huge budget fails at
    once instead of the process being killed when the pages are touched."""
    rows = budget + 1
    dense = batch * rows * rows  # visibility, bool [B, N+1, N+1]
    total = dense + batch * rows * (4 * words + 36) + 4 * batch  # + bits and the per-node arrays
    limit = _memory_limit_bytes()
    if limit is not None and total > limit:
        raise MemoryError(
            f"budget {budget}: the trees of {batch} request(s) need {_bytes_text(total)} (the dense "
            f"visibility mask [B, N+1, N+1] alone {_bytes_text(dense)}), more than the "
            f"{_bytes_text(limit)} of memory this process may use; use a smaller budget or batch (the C "
            f"API builds without the dense mask when its pointer is NULL)")


def empty_trees(batch: int, budget: int, depth: int) -> TreeBatch:
    """Allocates (uninitialised) output arrays for :func:`build_trees` ``out=``.

    Raises:
        ValueError: a negative or too large batch, budget or depth.
        MemoryError: the arrays (about B x (N+1)^2 bytes, the dense mask) exceed this
            machine's memory; the message names the budget and the bytes.
    """
    batch = _int_scalar(batch, "batch", 0, 2**62)
    budget = _int_scalar(budget, "budget", 0, _MAX_BUDGET)
    depth = _int_scalar(depth, "depth", 0, 2**31 - 2)
    lib = _lib.load()
    words = ctypes.c_int64()
    lib.kdt_visibility_words(budget, ctypes.byref(words))
    _tree_outputs_fit(batch, budget, words.value)
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
            got = f"{a.dtype} of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"out.{name} must be {np.dtype(dtype)} of shape {want} (out= must come from a call "
                             f"with the same batch and budget, or kdtree.empty_trees), got {got}")
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
    errors: str = "raise",
    stream=None,
) -> TreeBatch:
    """Builds DDTree draft trees on the CPU, or on the GPU when the inputs are CUDA arrays (spec ``ddtree-tree-build.md``; Ringel & Romano,
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
        errors: GPU only. ``"raise"`` (default): copy the per-request statuses to the host
            and raise on the first failure (synchronises). ``"status"``: do not synchronise;
            ``out.request_status`` holds KDT_OK (0) or each request's status, and a failed
            request has a root-only tree (``kdt_trees_build_cuda``).
        stream: GPU only: the CUDA stream (int handle, torch or CuPy stream); default the
            current stream of the inputs' library.

    GPU inputs (torch / CuPy / any DLPack or ``__cuda_array_interface__`` CUDA array):
    ``logprobs`` float32 and ``token_ids`` int32 on one device; root arrays may be host or
    device arrays; outputs are allocated with the inputs' library on their device. The
    trees are bit-identical to the CPU builder's.

    Returns:
        :class:`TreeBatch` with ``N + 1`` rows per request (a 2-D input gives B = 1).

    Raises:
        TypeError: non-floating log-probs or non-integer ids.
        ValueError / KdtreeError: shape mismatch, negative budget, NaN or +inf log-probs,
            unsorted rows, a log-prob > 0 beyond float32 rounding (3.8e-6: a probability or
            a raw logit), duplicate ids in a row, ids out of range (the message names
            request, depth and rank).
        MemoryError: CPU: the outputs (about B x (N+1)^2 bytes, the dense mask) exceed this
            machine's memory (see :func:`empty_trees`).
    """
    if _device.is_device_array(logprobs) or _device.is_device_array(token_ids):
        budget = _int_scalar(budget, "budget", 0, _MAX_BUDGET)
        vocab = 0 if vocab_size is None else _int_scalar(vocab_size, "vocab_size", 1, 2**63 - 1)
        pad = _int_scalar(pad_token, "pad_token", _INT32_MIN, _INT32_MAX)
        return _gpu().build_trees(logprobs, token_ids, budget, root_tokens=root_tokens,
                                  root_positions=root_positions, vocab_size=vocab, pad_token=pad, out=out,
                                  errors=errors, stream=stream)
    _cpu_only(stream, errors, "build_trees")
    lp = _float_array(logprobs, "logprobs")
    ids = _int_array(token_ids, "token_ids")
    for name, a, given in (("logprobs", lp, logprobs), ("token_ids", ids, token_ids)):
        if a.ndim not in (2, 3):
            raise ValueError(f"{name} must be [B, L, K] or [L, K] (2 or 3 dimensions), got shape {np.shape(given)}")
    if ids.shape != lp.shape:
        raise ValueError(
            f"logprobs {np.shape(logprobs)} and token_ids {np.shape(token_ids)} must have the "
            "same shape, [B, L, K] or [L, K]"
        )
    if lp.ndim == 2:
        lp, ids = lp[None], ids[None]
    budget = _int_scalar(budget, "budget", 0, _MAX_BUDGET)
    batch, depth, width = lp.shape
    origin = f"logprobs of shape {np.shape(logprobs)}, [B, L, K]"
    roots = None if root_tokens is None else _per_request(root_tokens, "root_tokens", batch, batch_from=origin)
    pos = None if root_positions is None else _per_request(root_positions, "root_positions", batch, np.int64,
                                                           batch_from=origin)
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
    out.request_status = _ok_status((batch,)) if errors == "status" else None
    return out


def verify_greedy(
    trees: TreeBatch,
    target_tokens,
    *,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    errors: str = "raise",
    stream=None,
) -> Acceptance:
    """The verification walk (spec: "Verification"): from the root, move to the child whose
    token equals the target's token at the current node, while one exists.

    Args:
        trees: a :class:`TreeBatch` from :func:`build_trees`.
        target_tokens: integer ``[B, N+1]`` (or ``[N+1]`` when B = 1): the target's chosen
            token at every node (argmax of its logits, or a sample); padding rows ignored.
        stop_tokens: a sequence of token ids (None: none); an accepted stop token ends the
            walk with no bonus token. A single int is a TypeError (write ``[eos_id]``).
        max_commit: None, an int, or ``[B]`` ints >= 0: the most tokens (accepted + bonus)
            each request may commit this round (remaining ``max_new_tokens``). Any other
            shape (a length-1 list for B > 1 included) is a ValueError.
        errors, stream: GPU only (trees on the GPU), as in :func:`build_trees`; with
            ``errors="status"`` the result's ``request_status`` holds per-request statuses.

    Returns:
        :class:`Acceptance`: ``accepted_nodes`` int32 ``[B, L+1]`` (root first, -1 padding),
        ``accept_length`` int32 ``[B]``, ``bonus_token`` int32 ``[B]`` (-1: none).

    Raises:
        ValueError / KdtreeError: shape mismatch, negative caps or target tokens at visited
        nodes, inconsistent tree links.
    """
    if not isinstance(trees, TreeBatch):
        raise TypeError(f"trees must be a TreeBatch, got {type(trees).__name__}")
    if _device.is_device_array(trees.num_nodes):
        return _gpu().verify_greedy(trees, target_tokens, stop_tokens=stop_tokens, max_commit=max_commit,
                                    errors=errors, stream=stream)
    _cpu_only(stream, errors, "verify_greedy")
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
    stop_list = _stop_token_list(stop_tokens)
    stops = _int_array(stop_list if stop_list else np.zeros(0, np.int32), "stop_tokens").reshape(-1)
    caps = None if max_commit is None else _commit_caps(max_commit, batch)
    width = trees.depth + 1
    accepted = np.empty((batch, width), np.int32)
    length = np.empty(batch, np.int32)
    bonus = np.empty(batch, np.int32)
    lib = _lib.load()
    lib.kdt_verify_greedy_cpu(
        ctypes.byref(_trees_struct(trees)), _ptr(target), _ptr(stops) if stops.size else None,
        stops.size, _ptr(caps), width, _ptr(accepted), _ptr(length), _ptr(bonus),
    )
    return Acceptance(accepted_nodes=accepted, accept_length=length, bonus_token=bonus,
                      request_status=_ok_status((batch,)) if errors == "status" else None)


def topk_logprobs(logits, k: int, *, errors: str = "raise", stream=None):
    """Top-k log-probs of each row of logits, on the CPU (or the GPU for CUDA arrays).

    ``logprob = logit - logsumexp(row)`` over the whole row, computed as ``(logit - max) -
    log(sum(exp(row - max)))`` in float64 (exact up to float32's largest logits) and rounded
    once to float32, sorted descending with ties ordered by lower token id.

    Args:
        logits: ``[..., V]`` float16, bfloat16, float32 or float64 (converted to float32).
        k: 0 <= k <= V.

    GPU (CUDA array logits, float32 / float16 / bfloat16, vocab axis contiguous, k <= 1024):
    ``kdt_topk_logprobs_cuda``, the logsumexp in float32 (results agree with the CPU's to
    float32 rounding; ids and order are exact). ``errors="status"`` returns a third array,
    the per-row status (0 or KDT_ERR_VALUE), without synchronising.

    Returns:
        ``(logprobs float32 [..., k], ids int32 [..., k])``.

    Raises:
        TypeError: non-floating logits. ValueError / KdtreeError: k out of range, a NaN or
        +inf logit, or a row whose logits are all -inf (the message names the row, as
        request and position for ``[B, L, V]`` logits, and the column).
    """
    if _device.is_device_array(logits):
        k = _int_scalar(k, "k", 0, 2**31 - 1)
        return _gpu().topk_logprobs(logits, k, errors=errors, stream=stream)
    _cpu_only(stream, errors, "topk_logprobs")
    if np.ndim(logits) < 1:
        raise ValueError("logits must have at least one dimension [..., V], got a scalar")
    x = _float_array(logits, "logits")
    vocab = x.shape[-1]
    k = _int_scalar(k, "k", 0, vocab)
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    out_lp = np.empty(x.shape[:-1] + (k,), np.float32)
    out_ids = np.empty(x.shape[:-1] + (k,), np.int32)
    if rows > 0:
        try:
            _lib.load().kdt_topk_logprobs_cpu(_ptr(x), rows, vocab, vocab, k, _ptr(out_lp), _ptr(out_ids))
        except _lib.KdtreeError as exc:
            raise _lib.name_logits_row(exc, x.shape[:-1]) from None
    if errors == "status":
        return out_lp, out_ids, _ok_status(x.shape[:-1] if x.ndim > 1 else (1,))
    return out_lp, out_ids


def build_trees_from_logits(
    logits,
    width: int,
    budget: int,
    *,
    root_tokens=None,
    root_positions=None,
    pad_token: int = -1,
    out: TreeBatch | None = None,
    errors: str = "raise",
    stream=None,
) -> TreeBatch:
    """Draft trees straight from the drafter's logits: top-k log-probs, then the builder.

    Args:
        logits: ``[B, L, V]`` (or ``[L, V]``): row ``l`` of request ``b`` is the drafter's
            distribution at depth ``l + 1`` below the root.
        width: K, the top-k entries kept per position (only ``min(K, budget)`` are computed).
        budget, root_tokens, root_positions, pad_token, out: as :func:`build_trees`.
        errors, stream: GPU only, as :func:`build_trees`.

    On the GPU (CUDA array logits; float32, float16 or bfloat16) this is one call,
    ``kdt_trees_build_from_logits_cuda``, with no host round trip; top-k is computed in
    float32 there and in float64 on the CPU, so the two can differ in the last bits of the
    log-probs (each path's tree is exact for its own top-k). A row with NaN, +inf or only
    -inf logits makes its request fail (KDT_ERR_VALUE).

    Returns:
        :class:`TreeBatch` (vocab_size = V is enforced on the ids).
    """
    width = _int_scalar(width, "width", 0, 2**31 - 1)
    budget = _int_scalar(budget, "budget", 0, _MAX_BUDGET)
    pad = _int_scalar(pad_token, "pad_token", _INT32_MIN, _INT32_MAX)
    if _device.is_device_array(logits):
        return _gpu().build_trees_from_logits(logits, width, budget, root_tokens=root_tokens,
                                              root_positions=root_positions, pad_token=pad, out=out,
                                              errors=errors, stream=stream)
    _cpu_only(stream, errors, "build_trees_from_logits")
    x = _host_array(logits, "logits")
    if x.ndim not in (2, 3):
        raise ValueError(f"logits must be [B, L, V] or [L, V], got shape {np.shape(logits)}")
    vocab = x.shape[-1]
    if width > vocab:
        raise ValueError(f"width {width} exceeds the vocabulary size {vocab}")
    lp, ids = topk_logprobs(x, min(width, budget))  # on the caller's shape: errors name its rows
    if x.ndim == 2:
        lp, ids = lp[None], ids[None]
    return build_trees(lp, ids, budget, root_tokens=root_tokens, root_positions=root_positions,
                       vocab_size=vocab if vocab > 0 else None, pad_token=pad, out=out)


_ADDITIVE_LOWEST = {"float32": np.finfo(np.float32).min, "float16": np.finfo(np.float16).min,
                    "bfloat16": -3.3895313892515355e38}  # bfloat16's lowest finite (0xFF7F)


def tree_attention_mask(
    trees: TreeBatch,
    prefix_lengths,
    *,
    kind: str = "bool",
    dtype: str = "float32",
    columns: int | None = None,
    errors: str = "raise",
    stream=None,
):
    """Tree attention masks over the KV prefix and the tree, in the layouts engines use.

    Query rows are the ``N + 1`` tree rows (root first); key columns are request b's
    ``p = prefix_lengths[b]`` cached tokens, then the ``N + 1`` tree rows. Row ``i`` sees
    every prefix column and tree column ``p + j`` for ``j == i`` or an ancestor of ``i``;
    a padding row (``i > num_nodes[b]``) sees only itself (include/kdtree.h,
    ``kdt_tree_attention_mask_cuda``).

    Args:
        trees: a :class:`TreeBatch` (CPU or GPU).
        prefix_lengths: ``[B]`` ints >= 0.
        kind: ``"bool"`` (bool ``[B, N+1, C]``), ``"bits"`` (uint32 ``[B, N+1, ceil(C/32)]``,
            bit ``j % 32`` of word ``j // 32``), ``"additive"`` (``dtype`` ``[B, N+1, C]``:
            0 visible, the dtype's lowest finite value hidden) or ``"flashinfer"`` (uint8,
            each request's ``[N+1, p+N+1]`` mask flattened and packed 8 per byte,
            little-endian, as FlashInfer's ``segment_packbits``; with ``mask_indptr``).
        dtype: additive masks: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (on the CPU via
            ml_dtypes), or the same as a numpy / ml_dtypes / torch dtype; ignored by the other kinds.
        columns: C for the dense kinds (default ``max(p) + N + 1``); must be None for
            ``"flashinfer"``.
        errors, stream: GPU only, as :func:`build_trees`.

    Returns:
        ``(mask, mask_indptr, positions)``: ``mask_indptr`` int32 ``[B + 1]`` (byte offsets)
        for ``"flashinfer"``, else None; ``positions`` int64 ``[B, N+1]`` = ``p + depth``
        (padding rows: ``p``). With ``errors="status"`` (GPU) a fourth item, the
        per-request status.

    Raises:
        ValueError: unknown kind or dtype, negative prefix, ``p + N + 1 > columns``.
    """
    if not isinstance(trees, TreeBatch):
        raise TypeError(f"trees must be a TreeBatch, got {type(trees).__name__}")
    if columns is not None:
        columns = _int_scalar(columns, "columns", 0, 2**62)
    dtype = _dtype_name(dtype)
    if _device.is_device_array(trees.num_nodes):
        return _gpu().tree_attention_mask(trees, prefix_lengths, kind=kind, dtype=dtype, columns=columns,
                                          errors=errors, stream=stream)
    _cpu_only(stream, errors, "tree_attention_mask")
    batch, rows = trees.batch, trees.budget + 1
    prefix = _prefix_lengths(prefix_lengths, batch)
    if (prefix < 0).any():
        raise ValueError(f"prefix_lengths must be >= 0, got {prefix.tolist()}")
    num_nodes = np.asarray(trees.num_nodes)
    parents = np.asarray(trees.parents)
    for b in range(batch):  # the same verdicts as the GPU call's request_status
        n = int(num_nodes[b])
        if not 0 <= n <= trees.budget:
            raise ValueError(f"request {b}: num_nodes {n} outside [0, {trees.budget}]")
        par = parents[b, 1 : n + 1]
        if ((par < 0) | (par >= np.arange(1, n + 1))).any():
            i = int(np.argmax((par < 0) | (par >= np.arange(1, n + 1)))) + 1
            raise ValueError(f"request {b}, node {i}: parent {int(parents[b, i])} is not in [0, {i})")
    status = (_ok_status((batch,)),) if errors == "status" else ()
    vis = np.asarray(trees.visibility, dtype=bool)
    depths = np.asarray(trees.depths, dtype=np.int64)
    real = np.arange(rows)[None, :] <= np.asarray(trees.num_nodes)[:, None]  # [B, N+1]
    positions = prefix[:, None] + np.where(real, depths, 0)

    def request_mask(b: int, ncols: int) -> np.ndarray:
        p = int(prefix[b])
        m = np.zeros((rows, ncols), bool)
        m[:, :p] = real[b][:, None]
        m[:, p : p + rows] = vis[b]
        return m

    if kind == "flashinfer":
        if columns is not None:
            raise ValueError("columns is not used with kind='flashinfer'")
        sizes = [(rows * (int(p) + rows) + 7) // 8 for p in prefix]
        if sum(sizes) > _INT32_MAX:
            raise ValueError(f"the packed masks need {sum(sizes)} bytes, more than int32 offsets allow")
        indptr = np.zeros(batch + 1, np.int64)
        indptr[1:] = np.cumsum(sizes)
        mask = np.zeros(int(indptr[-1]), np.uint8)
        for b in range(batch):
            mask[indptr[b] : indptr[b + 1]] = np.packbits(request_mask(b, int(prefix[b]) + rows).reshape(-1),
                                                          bitorder="little")
        return (mask, indptr.astype(np.int32), positions, *status)
    ncols = int(prefix.max()) + rows if columns is None and batch else (rows if columns is None else columns)
    if batch and int(prefix.max()) + rows > ncols:
        b = int(np.argmax(prefix + rows > ncols))
        raise ValueError(f"request {b}: prefix {int(prefix[b])} + {rows} tree rows exceeds columns {ncols}")
    dense = np.stack([request_mask(b, ncols) for b in range(batch)]) if batch else np.zeros((0, rows, ncols), bool)
    if kind == "bool":
        return (dense, None, positions, *status)
    if kind == "bits":
        words = (ncols + 31) // 32
        padded = np.zeros((batch, rows, words * 32), bool)
        padded[:, :, :ncols] = dense
        bits = np.packbits(padded.reshape(batch, rows, words, 32), axis=-1, bitorder="little")
        return (np.ascontiguousarray(bits).view("<u4").reshape(batch, rows, words), None, positions, *status)
    if kind == "additive":
        if dtype not in _ADDITIVE_LOWEST:
            raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16' (a name, or a numpy or torch "
                             f"dtype), got {dtype!r}")
        np_dtype = dtype
        if dtype == "bfloat16":
            import ml_dtypes  # a dependency of the package (noxfile); numpy has no bfloat16

            np_dtype = ml_dtypes.bfloat16
        lowest = _ADDITIVE_LOWEST[dtype]
        return (np.where(dense, np.float32(0), np.float32(lowest)).astype(np_dtype), None, positions, *status)
    raise ValueError(f"kind must be 'bool', 'bits', 'additive' or 'flashinfer', got {kind!r}")


def _target_logits(trees: TreeBatch, target_logits, name: str) -> np.ndarray:
    """Host target logits as float [B, N+1, V] ([N+1, V] for B = 1), shape-checked."""
    x = _host_array(target_logits, name)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}")
    if x.ndim == 2:
        x = x[None]
    want = (trees.batch, trees.budget + 1)
    if x.ndim != 3 or x.shape[:2] != want or x.shape[2] < 1:
        raise ValueError(f"{name} must have shape [{want[0]}, {want[1]}, V >= 1] (or [{want[1]}, V] for one "
                         f"request), got {np.shape(target_logits)}")
    return x


def _per_request(values, name: str, batch: int, dtype=np.int32, batch_from: str = "") -> np.ndarray:
    """[B] integers (a scalar when B = 1), or ValueError naming the expected shape (and
    where B came from, when batch_from says it)."""
    a = _int_array(values, name, dtype)
    if a.ndim > 1 or a.size != batch:
        origin = f" (one per request; B = {batch} from {batch_from})" if batch_from else ""
        raise ValueError(f"{name} must have shape ({batch},){origin}, got {np.shape(values)}")
    return a.reshape(-1)


def _dtype_name(dtype):
    """A dtype given as a name, a numpy / ml_dtypes dtype or scalar type, or a torch dtype,
    as its name ("float16"); anything else is returned as given, for the caller to reject."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return dtype


def _stop_token_list(stop_tokens) -> list:
    """stop_tokens as a list: None (no stop tokens) or any iterable of token ids. A single
    int, a string or a 0-d array is a TypeError that names the argument (not Python's
    "'int' object is not iterable")."""
    if stop_tokens is None:
        return []
    if (isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable)
            or (isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim == 0)):
        raise TypeError(f"stop_tokens must be a sequence of token ids (for example [eos_id]) or None, "
                        f"got {type(stop_tokens).__name__}")
    return list(stop_tokens)


def _commit_caps(max_commit, batch: int) -> np.ndarray:
    """max_commit as int64 [B]: an int (the same cap for every request) or one int per
    request. Any other shape is a ValueError naming max_commit (a length-1 list is not
    broadcast to B > 1 requests); negative caps are rejected by _check_caps."""
    shape = np.shape(max_commit)
    if shape not in ((), (batch,)):
        raise ValueError(f"max_commit must be None, an int, or one int per request (shape ({batch},)), "
                         f"got shape {shape}")
    caps = _int_array(np.broadcast_to(np.asarray(max_commit), (batch,)), "max_commit", np.int64)
    _check_caps(max_commit, caps)
    return caps


def _check_caps(given, caps: np.ndarray) -> None:
    """ValueError naming the first negative commit cap (and its request, for an array)."""
    if (caps < 0).any():
        b = int(np.flatnonzero(caps < 0)[0])
        where = "" if np.ndim(given) == 0 else f" for request {b}"
        raise ValueError(f"max_commit must be >= 0, got {int(caps[b])}{where}")


def _argmax_rows(x: np.ndarray) -> np.ndarray:
    """Argmax per row (ties: lower id); a row holding NaN gets -1, which the walk reports
    (KDT_ERR_VALUE) only if it visits that node, as the GPU does."""
    out = np.argmax(x, axis=-1).astype(np.int32)  # first maximum: ties go to the lower id
    out[np.isnan(x).any(axis=-1)] = -1
    return out


def _walk_from_rows(trees: TreeBatch, x: np.ndarray, tokens: np.ndarray, sampled: bool, **walk) -> Acceptance:
    """verify_greedy along per-node tokens chosen from the host target logits x [B, N+1, V]
    (-1 where a row gives no token). The walk reports such a node as a negative target
    token; the error is renamed after the row's logits ("target_logits[1, 0] holds a NaN
    logit"), which is what the caller passed."""
    try:
        return verify_greedy(trees, tokens, **walk)
    except _lib.KdtreeError as exc:
        found = re.search(r"request (\d+), node (\d+): target token -1 is negative", str(exc))
        if found is None:
            raise
        b, i = int(found.group(1)), int(found.group(2))
        row = x[b, i]
        if np.isnan(row).any():
            why = "a NaN logit"
        elif sampled and np.isposinf(row).any():
            why = "a +inf logit (nothing else can be drawn)"
        elif sampled and np.isneginf(row).all():
            why = "only -inf logits (nothing can be drawn)"
        else:
            raise
        raise _lib.KdtreeError(exc.status, f"request {b}, node {i}: target_logits[{b}, {i}] holds {why}",
                               exc.function) from None


def verify_greedy_from_logits(
    trees: TreeBatch,
    target_logits,
    *,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    errors: str = "raise",
    stream=None,
) -> Acceptance:
    """Greedy verification from the target's logits: argmax per node (ties: lower id), then
    the walk of :func:`verify_greedy`.

    Args:
        trees: a :class:`TreeBatch`.
        target_logits: ``[B, N+1, V]`` (``[N+1, V]`` for B = 1): row ``i`` is the target's
            output at tree node ``i`` of its verify forward. GPU: float32 / float16 /
            bfloat16, only the rows the walk visits are read.
        stop_tokens, max_commit: as :func:`verify_greedy`.
        errors, stream: GPU only, as :func:`build_trees`.

    Returns:
        :class:`Acceptance`; on the GPU ``target_tokens`` holds the argmax at visited nodes.

    Raises:
        ValueError / KdtreeError: shapes, a NaN logit in a row the walk visits ("request 1,
        node 0: target_logits[1, 0] holds a NaN logit"), bad caps or links. Infinite logits
        are ordinary values for the argmax: a visited row of only -inf gives token 0 (the
        lowest id among equal values), one with +inf its first +inf, on the CPU and the GPU.
    """
    if _device.is_device_array(target_logits):
        return _gpu().verify_from_logits(trees, target_logits, temperature=None, seed=0, offset=0,
                                         stop_tokens=stop_tokens, max_commit=max_commit, errors=errors,
                                         stream=stream)
    _cpu_only(stream, errors, "verify_greedy_from_logits")
    x = _target_logits(trees, target_logits, "target_logits")
    return _walk_from_rows(trees, x, _argmax_rows(x), False, stop_tokens=stop_tokens, max_commit=max_commit,
                           errors=errors)


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
    seed = _int_scalar(seed, "seed", 0, 2**64 - 1)
    offset = _int_scalar(offset, "offset", 0, 2**64 - 1)
    request = _int_scalar(request, "request", 0, 2**32 - 1)
    t32 = np.float32(temperature)
    if not np.isfinite(t32) or not t32 >= np.float32(1e-6):
        raise ValueError(f"temperature must be finite and >= 1e-6, got {temperature!r}")
    rows = np.asarray(logits_rows, dtype=np.float32)
    nodes = np.asarray(nodes)
    if rows.ndim != 2 or rows.shape[1] < 1 or nodes.shape != (rows.shape[0],):
        raise ValueError(f"logits_rows must be [n, V >= 1] and nodes [n], got {rows.shape} and {nodes.shape}")
    if nodes.size and (nodes.dtype.kind not in "iu" or nodes.min() < 0 or nodes.max() > 2**32 - 1):
        raise ValueError("nodes must be integers in [0, 2^32)")
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


def verify_sample_from_logits(
    trees: TreeBatch,
    target_logits,
    temperature: float,
    *,
    seed: int,
    offset: int,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    errors: str = "raise",
    stream=None,
) -> Acceptance:
    """Sampled verification, lossless for any temperature: one draw per visited node from
    ``softmax(logits / temperature)``, then the walk of :func:`verify_greedy` along the draws.

    The draw is the Gumbel-max trick over a Philox4x32-10 counter-based generator keyed by
    ``(seed, offset, request, node, token)``: the same arguments give the same tokens on
    every launch shape (definition: include/kdtree.h, ``kdt_verify_sample_from_logits_cuda``).
    The CPU path (host arrays) computes the same draws in numpy (it may differ from the GPU
    only where two scores tie within float32 ``log`` rounding).

    Args:
        trees, target_logits, stop_tokens, max_commit, errors, stream: as
            :func:`verify_greedy_from_logits`.
        temperature: finite, > 0.
        seed, offset: 64-bit unsigned ints; advance ``offset`` every round.

    Returns:
        :class:`Acceptance` (GPU: ``target_tokens`` holds the draws at visited nodes).

    Raises:
        ValueError / KdtreeError: as :func:`verify_greedy_from_logits`; a visited row with a
        NaN or a +inf logit, or only -inf logits, has no draw ("target_logits[1, 0] holds
        only -inf logits").
    """
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                             np.floating)):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__} {temperature!r}")
    with np.errstate(over="ignore"):  # an overflow is rejected just below
        t32 = np.float32(temperature)  # the kernels compute in float32
    if not np.isfinite(t32) or not t32 >= np.float32(1e-6):
        raise ValueError(f"temperature must be finite and >= 1e-6 in float32 (use verify_greedy_from_logits for "
                         f"T -> 0), got {temperature!r}")
    temperature = float(t32)
    seed = _int_scalar(seed, "seed", 0, 2**64 - 1)
    offset = _int_scalar(offset, "offset", 0, 2**64 - 1)
    if _device.is_device_array(target_logits):
        return _gpu().verify_from_logits(trees, target_logits, temperature=temperature, seed=seed, offset=offset,
                                         stop_tokens=stop_tokens, max_commit=max_commit, errors=errors,
                                         stream=stream)
    _cpu_only(stream, errors, "verify_sample_from_logits")
    x = _target_logits(trees, target_logits, "target_logits")
    batch, rows = trees.batch, trees.budget + 1
    draws = np.zeros((batch, rows), np.int32)
    for b in range(batch):
        n = min(max(int(trees.num_nodes[b]), 0), trees.budget) + 1
        draws[b, :n] = gumbel_draws(x[b, :n], temperature, seed, offset, b, np.arange(n))
    return _walk_from_rows(trees, x, draws, True, stop_tokens=stop_tokens, max_commit=max_commit,
                           errors=errors)


def compact_kv(
    k_layers,
    v_layers,
    prefix_lengths,
    acceptance: Acceptance,
    *,
    layout: str = "bhsd",
    errors: str = "raise",
    stream=None,
):
    """KV-cache compaction after verification, in place: the accepted path's rows move to
    the rows right after each request's prefix (row ``p + accepted_nodes[b][j]`` -> row
    ``p + j``, ``j = 0 .. accept_length[b]``); the caller then keeps ``p + accept_length + 1``
    rows.

    Args:
        k_layers, v_layers: sequences of per-layer tensors (``v_layers`` may be None) of
            shape ``[B, H, S, D]`` (``layout="bhsd"``, Hugging Face) or ``[B, S, H, D]``
            (``"bshd"``), all with the same shape, strides and dtype (float16, bfloat16,
            float32 on the GPU; any numpy / torch CPU dtype on the host), head_dim
            contiguous. The verify forward must have written tree row ``i`` at ``p + i``.
        prefix_lengths: ``[B]`` ints >= 0.
        acceptance: the :class:`Acceptance` of the verify call.
        errors, stream: GPU only, as :func:`build_trees` (``"status"`` returns the status).

    GPU tensors: one launch for all layers (``kdt_compact_kv_cuda``); host tensors (numpy
    or CPU torch): a row copy per accepted node.

    Raises TypeError when ``k_layers`` or ``v_layers`` is a single tensor, not a sequence.
    """
    for name, layers in (("k_layers", k_layers), ("v_layers", v_layers)):
        if hasattr(layers, "ndim") and hasattr(layers, "shape"):  # one array, not a sequence of them
            raise TypeError(f"{name} must be a sequence of per-layer tensors (one [B, H, S, D] or [B, S, H, D] "
                            f"tensor per layer), got a single {layers.ndim}-D {type(layers).__name__} of shape "
                            f"{tuple(layers.shape)}; pass [tensor] for one layer")
    k_layers = list(k_layers)
    if k_layers and _device.is_device_array(k_layers[0]):
        return _gpu().compact_kv(k_layers, v_layers, prefix_lengths, acceptance, layout=layout, errors=errors,
                                 stream=stream)
    _cpu_only(stream, errors, "compact_kv")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not k_layers:
        raise ValueError("k_layers is empty")
    if v_layers is not None and len(list(v_layers)) != len(k_layers):
        raise ValueError(f"{len(k_layers)} K layers but {len(list(v_layers))} V layers")
    layers = k_layers + ([] if v_layers is None else list(v_layers))
    shape = tuple(np.shape(layers[0]))
    if len(shape) != 4 or any(tuple(np.shape(t)) != shape for t in layers):
        raise ValueError(f"every K and V layer must have the same 4-D shape, got "
                         f"{sorted({tuple(np.shape(t)) for t in layers})}")
    if len({id(t) for t in layers}) != len(layers):
        raise ValueError("k_layers and v_layers must be distinct tensors")
    accepted = _int_array(acceptance.accepted_nodes, "accepted_nodes")
    length = _int_array(acceptance.accept_length, "accept_length").reshape(-1)
    batch = shape[0]
    seq = shape[2] if layout == "bhsd" else shape[1]
    if accepted.ndim != 2 or accepted.shape[0] != batch or length.shape != (batch,):
        raise ValueError(f"acceptance must hold {batch} requests (accepted_nodes [B, P], accept_length [B]), got "
                         f"{accepted.shape} and {length.shape}")
    prefix = _prefix_lengths(prefix_lengths, batch)
    # Every request is checked before any row moves (the cache is untouched on error).
    for b in range(batch):
        m = int(length[b])
        if not 0 <= m < accepted.shape[1]:
            raise ValueError(f"request {b}: accept_length {m} outside [0, {accepted.shape[1] - 1}]")
        path = accepted[b, : m + 1]
        if path[0] != 0 or (np.diff(path) <= 0).any():
            raise ValueError(f"request {b}: accepted path {path.tolist()} must start at 0 and increase")
        p = int(prefix[b])
        if p < 0 or p + int(path[-1]) >= seq:
            raise ValueError(f"request {b}: prefix {p} + node {int(path[-1])} is outside the cache's {seq} rows")
    for b in range(batch):
        m = int(length[b])
        path = accepted[b, : m + 1]
        p = int(prefix[b])
        for j in range(1, m + 1):  # increasing j: a destination is never a later source
            src, dst = p + int(path[j]), p + j
            if src == dst:
                continue
            for t in layers:
                if layout == "bhsd":
                    t[b, :, dst, :] = t[b, :, src, :]
                else:
                    t[b, dst, :, :] = t[b, src, :, :]
    return _ok_status((batch,)) if errors == "status" else None
