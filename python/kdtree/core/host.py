"""The host backend of the core API: libkdtree's C entry points over numpy arrays.

Arrays cross into C only after ``np.ascontiguousarray(..., dtype=...)`` (:mod:`.checks`)
and stay referenced for the whole call. The public functions, their documentation and
the checks shared with the CUDA backend are in :mod:`.api`.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np

from .. import _native as _lib
from .._native import STATUS, KdtreeError
from . import checks, memory, sampling
from .types import (
    ADDITIVE_LOWEST,
    RAGGED_FIELDS,
    TREE_FIELDS,
    Acceptance,
    RaggedTrees,
    TopK,
    TopKShard,
    TreeBatch,
    TreeMask,
)


def empty_trees(batch: int, budget: int, depth: int) -> TreeBatch:
    """Allocates (uninitialised) output arrays for :func:`build_trees` ``out=``.

    Raises:
        ValueError: a negative or too large batch, budget or depth.
        MemoryError: the arrays (about B x (N+1)^2 bytes, the dense mask) exceed this
            machine's memory; the message names the budget and the bytes.
    """
    batch = checks.int_scalar(batch, "batch", 0, 2**62)
    budget = checks.int_scalar(budget, "budget", 0, checks.MAX_BUDGET)
    depth = checks.int_scalar(depth, "depth", 0, 2**31 - 2)
    lib = _lib.load()
    words = ctypes.c_int64()
    lib.kdt_visibility_words(budget, ctypes.byref(words))
    memory.tree_outputs_fit(batch, budget, words.value)
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


def check_tree_fields(trees, names) -> None:
    """KdtreeError naming the first of `names` that is not a C-contiguous numpy array of
    its TREE_FIELDS dtype and shape for the TreeBatch's batch and budget."""
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a TreeBatch, got {type(trees).__name__}")
    budget = checks.int_scalar(trees.budget, "trees.budget", 0, checks.MAX_BUDGET)
    if not isinstance(trees.num_nodes, np.ndarray) or trees.num_nodes.ndim != 1:
        n = trees.num_nodes
        got = (f"{type(n).__module__.split('.')[0]}.{type(n).__name__} on {getattr(n, 'device', 'the host')} "
               "(host trees hold numpy arrays: kdtree.torch_ops.tree_batch makes them from CPU tensors)"
               if not isinstance(n, np.ndarray) else f"shape {n.shape}")
        raise checks.shape_error(f"trees.num_nodes must be a C-contiguous int32 array of shape (B,), got {got}")
    batch, rows = trees.num_nodes.shape[0], budget + 1
    for name in names:
        dtype, ndim = TREE_FIELDS[name]
        want = {1: (batch,), 2: (batch, rows), 3: (batch, rows, rows if name == "visibility" else (rows + 31) // 32)}[ndim]
        a = getattr(trees, name)
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != want or not a.flags.c_contiguous:
            got = (f"{a.dtype} of shape {a.shape}{'' if a.flags.c_contiguous else ', not C-contiguous'}"
                   if isinstance(a, np.ndarray) else type(a).__name__)
            raise checks.shape_error(f"trees.{name} must be a C-contiguous {dtype} array of shape {want}, got {got}")


def _check_out(out: TreeBatch, batch: int, budget: int) -> None:
    if not isinstance(out, TreeBatch):
        raise checks.type_error(f"out must be a TreeBatch (from kdtree.empty_trees or an earlier call), got "
                                f"{type(out).__name__}")
    rows = budget + 1
    words = (rows + 31) // 32
    ranges = []
    for name, (dtype, ndim) in TREE_FIELDS.items():
        a = getattr(out, name)
        want = {1: (batch,), 2: (batch, rows), 3: (batch, rows, rows if name == "visibility" else words)}[ndim]
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != want:
            got = (f"{a.dtype} of shape {a.shape}{'' if a.flags.c_contiguous else ', not C-contiguous'}"
                   if isinstance(a, np.ndarray) else type(a).__name__)
            raise checks.shape_error(f"out.{name} must be {np.dtype(dtype)} of shape {want} (out= must come from a "
                                     f"call with the same batch and budget, or kdtree.empty_trees), got {got}")
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise checks.invalid(f"out.{name} must be C-contiguous and writeable")
        lo = checks.ptr(a)
        ranges.append((lo, lo + a.nbytes, name))
    ranges.sort()
    for (_, hi, first), (lo, _, second) in zip(ranges, ranges[1:], strict=False):
        if lo < hi:
            raise checks.invalid(f"out.{first} and out.{second} share memory; every output needs its own array")


def trees_struct(t: TreeBatch, budget: int | None = None) -> _lib.KdtTrees:
    """The C view of `t`; `budget` (default t.budget) must be the one its arrays were
    checked against: C sizes every array from it. Cached on `t` while the same array
    objects are in place with the same data addresses and sizes (an array whose buffer
    moved, as ``ndarray.resize`` does, gets a new view)."""
    budget = t.budget if budget is None else budget
    arrays = tuple(getattr(t, f) for f in TREE_FIELDS)
    ptrs = [checks.ptr(a) for a in arrays]
    ranges = [(p, p + a.nbytes) for p, a in zip(ptrs, arrays, strict=True)]
    cached = t._native
    if (cached is not None and cached[1] == budget and cached[3] == ranges
            and all(a is b for a, b in zip(cached[0], arrays, strict=True))):
        return cached[2]
    struct = _lib.KdtTrees(t.batch, budget, *ptrs)
    t._native = (arrays, budget, struct, ranges)
    return struct


def request_struct(t: TreeBatch, b: int) -> _lib.KdtTrees:
    """The C view of request b of `t` alone (a batch of one), after trees_struct(t)."""
    arrays = [getattr(t, f) for f in TREE_FIELDS]
    ptrs = [checks.ptr(a) + b * a.strides[0] for a in arrays]
    return _lib.KdtTrees(1, t.budget, *ptrs)


def _overlaps_output(a: np.ndarray, t: TreeBatch) -> bool:
    """Whether input `a` shares bytes with any output array of `t` (after trees_struct)."""
    lo = checks.ptr(a)
    hi = lo + a.nbytes
    return any(lo < out_hi and out_lo < hi for out_lo, out_hi in t._native[3])


def _target_logits(trees: TreeBatch, target_logits, name: str) -> np.ndarray:
    """Host target logits as float [B, N+1, V] ([N+1, V] for B = 1), shape-checked."""
    x = checks.host_array(target_logits, name)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise checks.type_error(f"{name} must be a floating array, got dtype {x.dtype}")
    if x.ndim == 2:
        x = x[None]
    want = (trees.batch, trees.budget + 1)
    if x.ndim != 3 or x.shape[:2] != want or x.shape[2] < 1:
        raise checks.shape_error(f"{name} must have shape [{want[0]}, {want[1]}, V >= 1] (or [{want[1]}, V] for one "
                         f"request), got {np.shape(target_logits)}")
    return x


def _argmax_rows(x: np.ndarray) -> np.ndarray:
    """Argmax per row (ties: lower id); a row holding NaN gets -1, which the walk reports
    (KDT_ERR_VALUE) only if it visits that node, as the GPU does."""
    out = np.argmax(x, axis=-1).astype(np.int32)  # first maximum: ties go to the lower id
    out[np.isnan(x).any(axis=-1)] = -1
    return out


def _visited_tokens(acc: Acceptance, tokens: np.ndarray) -> np.ndarray:
    """int32 [B, N+1]: the chosen token at every node the walk read a row of (the root and
    the accepted nodes, the last one only when a bonus token follows it: a walk that ends
    on an accepted stop reads no row there), -1 elsewhere: the GPU walk's target_tokens."""
    out = np.full(tokens.shape, -1, np.int32)
    nodes = acc.accepted_nodes
    read = acc.accept_length.astype(np.int64) + (acc.bonus_token >= 0)  # path entries whose rows were read
    keep = (np.arange(nodes.shape[1])[None, :] < read[:, None]) & (nodes >= 0)
    rows, cols = np.nonzero(keep)[0], nodes[keep]
    out[rows, cols] = tokens[rows, cols]
    return out


def _walk_from_rows(trees: TreeBatch, x: np.ndarray, tokens: np.ndarray, sampled: bool, **walk) -> Acceptance:
    """verify_greedy along per-node tokens chosen from the host target logits x [B, N+1, V]
    (-1 where a row gives no token). The walk reports such a node as a negative target
    token; the error is renamed after the row's logits ("target_logits[1, 0] holds a NaN
    logit"), which is what the caller passed."""
    try:
        acc = verify_greedy(trees, tokens, **walk)
        acc.target_tokens = _visited_tokens(acc, tokens)
        return acc
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


def build_trees(logprobs, token_ids, budget, *, root_tokens, root_positions, vocab_size, pad_token, out, errors,
                request_budgets=None, request_depths=None):
    lp = checks.float_array(logprobs, "logprobs")
    ids = checks.int_array(token_ids, "token_ids")
    for name, a, given in (("logprobs", lp, logprobs), ("token_ids", ids, token_ids)):
        if a.ndim not in (2, 3):
            raise checks.shape_error(f"{name} must be [B, L, K] or [L, K] (2 or 3 dimensions), got shape {np.shape(given)}")
    if ids.shape != lp.shape:
        raise checks.shape_error(
            f"logprobs {np.shape(logprobs)} and token_ids {np.shape(token_ids)} must have the "
            "same shape, [B, L, K] or [L, K]"
        )
    if lp.ndim == 2:
        lp, ids = lp[None], ids[None]
    budget = checks.int_scalar(budget, "budget", 0, checks.MAX_BUDGET)
    batch, depth, width = lp.shape
    origin = f"logprobs of shape {np.shape(logprobs)}, [B, L, K]"
    roots = None if root_tokens is None else checks.per_request(root_tokens, "root_tokens", batch, batch_from=origin)
    pos = None if root_positions is None else checks.per_request(root_positions, "root_positions", batch, np.int64,
                                                           batch_from=origin)
    limits = tuple(None if a is None else request_limit(a, name, batch, origin, errors)
                   for a, name in ((request_budgets, "request_budgets"), (request_depths, "request_depths")))
    vocab = 0 if vocab_size is None else checks.int_scalar(vocab_size, "vocab_size", 1, 2**63 - 1)
    pad = checks.int_scalar(pad_token, "pad_token", checks.INT32_MIN, checks.INT32_MAX)
    lib = _lib.load()
    if out is None:
        out = empty_trees(batch, budget, depth)
    else:
        _check_out(out, batch, budget)
    struct = trees_struct(out, budget)
    # The C builder writes outputs while it reads inputs: never let them overlap.
    lp, ids, roots, pos, *limits = (
        None if a is None or not a.nbytes else (a.copy() if _overlaps_output(a, out) else a)
        for a in (lp, ids, roots, pos, *limits)
    )
    draft = _lib.KdtDraft(batch, depth, width, checks.ptr(lp), checks.ptr(ids), checks.ptr(roots),
                          checks.ptr(pos), vocab, pad, *map(checks.ptr, limits))
    status = checks.ok_status((batch,))
    try:
        lib.kdt_trees_build_cpu(ctypes.byref(draft), ctypes.byref(struct), None, 0)
    except _lib.KdtreeError as exc:
        if errors == "raise" or checks.failed_request(exc) is None:
            raise
        out.budget = budget
        _build_each(lib, lp, ids, roots, pos, limits, vocab, pad, out, status, (batch, depth, width))
    out.budget, out.depth = budget, depth  # only once the arrays hold this tree
    out.request_status = status
    return out


def _base_address(t) -> int:
    """The address of a cache layer's first element (a torch tensor's or an array's)."""
    if hasattr(t, "data_ptr") and callable(t.data_ptr):
        return int(t.data_ptr())
    return int(np.asarray(t).__array_interface__["data"][0])


def request_limit(values, name: str, batch: int, origin: str, errors: str) -> np.ndarray:
    """request_budgets / request_depths as int32 [B]. A value outside int32 is its
    request's error like any out-of-range limit: raised naming the request, or (errors=
    "status") passed as -1, which the builder reports as that request's
    KDT_ERR_OUT_OF_RANGE."""
    wide = checks.per_request(values, name, batch, np.int64, batch_from=origin)
    outside = np.flatnonzero((wide < checks.INT32_MIN) | (wide > checks.INT32_MAX))
    if outside.size:
        b = int(outside[0])
        what = "budget" if name == "request_budgets" else "depth"
        if errors == "raise":
            raise checks.range_error(f"request {b}: {what} {int(wide[b])} outside int32 ({name})")
        wide = wide.copy()
        wide[outside] = -1
    return wide.astype(np.int32)


def _build_each(lib, lp, ids, roots, pos, limits, vocab: int, pad: int, out: TreeBatch, status: np.ndarray,
                shape: tuple[int, int, int]) -> None:
    """errors="status" after a failed batch: each request alone, as the GPU builder does:
    a failed request gets its status and a root-only tree (its root token, or the pad
    token when that is out of range; its root position, or 0 when out of range). `shape`:
    the draft's (B, L, K) (lp and ids are None when it has no entries)."""
    batch, depth, width = shape
    item = lambda a, b: None if a is None else checks.ptr(a) + b * a.strides[0]  # noqa: E731
    for b in range(batch):
        one = request_struct(out, b)
        draft = _lib.KdtDraft(1, depth, width, item(lp, b), item(ids, b), item(roots, b), item(pos, b), vocab, pad,
                              *(item(a, b) for a in limits))
        try:
            lib.kdt_trees_build_cpu(ctypes.byref(draft), ctypes.byref(one), None, 0)
            continue
        except _lib.KdtreeError as exc:
            status[b] = exc.status
        root_tok = np.array([pad if roots is None else roots[b]], np.int32)
        if root_tok[0] < 0 or (vocab and root_tok[0] >= vocab):
            root_tok[0] = pad
        root_pos = np.array([0 if pos is None else pos[b]], np.int64)
        own_depth = depth if limits[1] is None else min(max(int(limits[1][b]), 0), depth)  # clamped, as on the GPU
        if root_pos[0] < 0 or root_pos[0] > 2**63 - 1 - own_depth:
            root_pos[0] = 0
        # No candidates and no root token (row 0 gets the pad token, unchecked), then the root;
        # the request's own depth, against which its root position was just checked.
        bare = _lib.KdtDraft(1, own_depth, 0, None, None, None, checks.ptr(root_pos), 0, pad)
        lib.kdt_trees_build_cpu(ctypes.byref(bare), ctypes.byref(one), None, 0)
        out.tokens[b, 0] = root_tok[0]


def stops_struct(seq, b: int | None = None) -> _lib.KdtStopSequences | None:
    """The C view of checks.stop_sequences' result (None: no sequences); b: request b's
    history row alone (a batch of one)."""
    if seq is None:
        return None
    tokens, offsets, hist = seq
    h_ptr, h_len = None, 0
    if hist is not None and hist.shape[1] > 0:
        h_ptr = checks.ptr(hist) + (0 if b is None else b * hist.strides[0])
        h_len = hist.shape[1]
    return _lib.KdtStopSequences(checks.ptr(tokens), checks.ptr(offsets), offsets.size - 1, h_ptr, h_len)


def verify_greedy(trees, target_tokens, *, stop_tokens, max_commit, errors, stop_sequences=None, stop_history=None):
    check_tree_fields(trees, TREE_FIELDS)  # the C view takes every field's address
    batch, rows = trees.batch, trees.budget + 1
    target = checks.int_array(target_tokens, "target_tokens")
    if target.ndim == 1 and batch == 1:
        target = target[None]
    if target.shape != (batch, rows):
        raise checks.shape_error(f"target_tokens must have shape ({batch}, {rows}), got {np.shape(target_tokens)}")
    stop_list = checks.stop_token_list(stop_tokens)
    stops = checks.int_array(stop_list if stop_list else np.zeros(0, np.int32), "stop_tokens").reshape(-1)
    caps = None if max_commit is None else checks.commit_caps(max_commit, batch)
    seq = checks.stop_sequences(stop_sequences, stop_history, batch)
    width = checks.path_capacity(trees)
    memory.outputs_fit(batch * width * 4, f"the accepted paths of {batch} request(s) ([B, {width}] int32)")
    accepted = np.empty((batch, width), np.int32)
    length = np.empty(batch, np.int32)
    bonus = np.empty(batch, np.int32)
    status = checks.ok_status((batch,))
    lib = _lib.load()
    struct = trees_struct(trees)
    stop_ptr = checks.ptr(stops) if stops.size else None
    try:
        whole = stops_struct(seq)
        lib.kdt_verify_greedy_cpu(ctypes.byref(struct), checks.ptr(target), stop_ptr, stops.size,
                                  None if whole is None else ctypes.byref(whole), checks.ptr(caps), width,
                                  checks.ptr(accepted), checks.ptr(length), checks.ptr(bonus))
    except _lib.KdtreeError as exc:
        if errors == "raise" or checks.failed_request(exc) is None:
            raise
        # errors="status": each request alone, as the GPU walk does; a failed request
        # gets accepted_nodes [-1, ...], accept_length 0 and bonus_token -1.
        for b in range(batch):
            at = lambda a, b=b: checks.ptr(a) + b * a.strides[0]  # noqa: E731
            try:
                one_seq = stops_struct(seq, b)
                lib.kdt_verify_greedy_cpu(ctypes.byref(request_struct(trees, b)), at(target), stop_ptr, stops.size,
                                          None if one_seq is None else ctypes.byref(one_seq),
                                          None if caps is None else at(caps), width, at(accepted), at(length),
                                          at(bonus))
            except _lib.KdtreeError as one:
                status[b] = one.status
                accepted[b], length[b], bonus[b] = -1, 0, -1
    return Acceptance(accepted_nodes=accepted, accept_length=length, bonus_token=bonus, request_status=status)


def topk_logprobs(logits, k, *, errors):
    x = checks.float_array(logits, "logits")
    if x.ndim < 1:
        raise checks.shape_error("logits must have at least one dimension [..., V], got a scalar")
    vocab = x.shape[-1]
    k = checks.int_scalar(k, "k", 0, vocab)
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    out_lp = np.empty(x.shape[:-1] + (k,), np.float32)
    out_ids = np.empty(x.shape[:-1] + (k,), np.int32)
    status = checks.ok_status(x.shape[:-1] if x.ndim > 1 else (1,))
    if rows > 0:
        lib = _lib.load()
        try:
            lib.kdt_topk_logprobs_cpu(checks.ptr(x), rows, vocab, vocab, k, checks.ptr(out_lp), checks.ptr(out_ids))
        except _lib.KdtreeError as exc:
            if errors == "raise" or re.search(r"\brow \d+", exc.detail) is None:
                raise _lib.name_logits_row(exc, x.shape[:-1]) from None
            # errors="status": row by row, as the GPU does; a failed row's log-probs are
            # NaN and its ids 0 .. k-1 (a tree built from it fails with KDT_ERR_VALUE).
            flat_x, flat_lp, flat_ids, flat_st = (a.reshape(rows, -1) for a in (x, out_lp, out_ids, status))
            for r in range(rows):
                try:
                    lib.kdt_topk_logprobs_cpu(checks.ptr(flat_x[r]), 1, vocab, vocab, k, checks.ptr(flat_lp[r]),
                                              checks.ptr(flat_ids[r]))
                except _lib.KdtreeError as one:
                    flat_st[r] = one.status
                    flat_lp[r], flat_ids[r] = np.nan, np.arange(k, dtype=np.int32)
    return TopK(out_lp, out_ids, status)


def topk_shard(logits, k, vocab_offset):
    x = checks.float_array(logits, "logits")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise checks.shape_error(f"logits must be [..., V_shard] with V_shard >= 1, got shape {x.shape}")
    shard_vocab = x.shape[-1]
    k = checks.int_scalar(k, "k", 0, shard_vocab)
    vocab_offset = checks.int_scalar(vocab_offset, "vocab_offset", 0, 2**31 - shard_vocab)
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    out = (np.empty(lead + (k,), np.float32), np.empty(lead + (k,), np.int32), np.empty(lead, np.float32),
           np.empty(lead, np.float64))
    if rows > 0:
        try:
            _lib.load().kdt_topk_shard_cpu(checks.ptr(x), rows, shard_vocab, shard_vocab, vocab_offset, k,
                                           *(checks.ptr(a) for a in out))
        except _lib.KdtreeError as exc:
            raise _lib.name_logits_row(exc, lead) from None
    return TopKShard(*out)


def topk_merge(shard_logits, shard_ids, shard_max, shard_sum_rest, vocab):
    lg = checks.float_array(shard_logits, "shard_logits")
    if lg.ndim < 2:
        raise checks.shape_error(f"shard_logits must be [T, ..., k], got shape {lg.shape}")
    shards, lead, k = lg.shape[0], lg.shape[1:-1], lg.shape[-1]
    ids = checks.int_array(shard_ids, "shard_ids", np.int32)
    mx = checks.float_array(shard_max, "shard_max")
    se = checks.host_array(shard_sum_rest, "shard_sum_rest")
    if se.dtype.kind != "f":
        raise checks.type_error(f"shard_sum_rest must be a floating array, got dtype {se.dtype}")
    se = np.ascontiguousarray(se, dtype=np.float64)
    for name, a, want in (("shard_ids", ids, lg.shape), ("shard_max", mx, lg.shape[:-1]),
                          ("shard_sum_rest", se, lg.shape[:-1])):
        if a.shape != want:
            raise checks.shape_error(f"{name} has shape {a.shape}, expected {want} (shard_logits is {lg.shape})")
    vocab = checks.int_scalar(vocab, "vocab", max(1, k), 2**31)
    checks.int_scalar(shards, "shards (the leading axis of shard_logits)", 1, 1024)
    rows = int(np.prod(lead, dtype=np.int64))
    out_lp, out_ids = np.empty(lead + (k,), np.float32), np.empty(lead + (k,), np.int32)
    if rows > 0:
        _lib.load().kdt_topk_merge_cpu(checks.ptr(lg), checks.ptr(ids), checks.ptr(mx), checks.ptr(se), shards, rows,
                                       k, vocab, checks.ptr(out_lp), checks.ptr(out_ids))
    return TopK(out_lp, out_ids, checks.ok_status(lead if lead else (1,)))


def build_trees_from_logits(logits, width, budget, *, root_tokens, root_positions, pad_token, out, errors,
                            request_budgets=None, request_depths=None):
    x = checks.host_array(logits, "logits")
    if x.ndim not in (2, 3):
        raise checks.shape_error(f"logits must be [B, L, V] or [L, V], got shape {np.shape(logits)}")
    vocab = x.shape[-1]
    if width > vocab:
        raise checks.range_error(f"width {width} exceeds the vocabulary size {vocab}")
    # On the caller's shape, so that errors name its rows; with errors="status" a bad row's NaN
    # log-probs fail its request in the builder (KDT_ERR_VALUE, a root-only tree), as on the GPU.
    # With per-request limits, rows past a request's own used part must not fail it: the
    # builder judges (a bad row's NaN log-probs fail only a request that reads them). With
    # nothing to read (k' = 0) no row is looked at, as on the GPU.
    kp = min(width, budget)
    limited = request_budgets is not None or request_depths is not None
    if kp == 0:
        lead = x.shape[:-1]
        lp, ids = np.zeros(lead + (0,), np.float32), np.zeros(lead + (0,), np.int32)
        rows_bad = np.zeros(lead, bool)
    else:
        top = topk_logprobs(x, kp, errors="status" if limited else errors)
        lp, ids, rows_bad = top.logprobs, top.ids, top.row_status != 0
    if x.ndim == 2:
        lp, ids, rows_bad = lp[None], ids[None], rows_bad[None]
    try:
        return build_trees(lp, ids, budget, root_tokens=root_tokens, root_positions=root_positions,
                           vocab_size=vocab if vocab > 0 else None, pad_token=pad_token, out=out,
                           errors=errors, request_budgets=request_budgets, request_depths=request_depths)
    except _lib.KdtreeError as exc:
        found = re.match(r"request (\d+), depth (\d+), rank \d+: NaN log-probability", exc.detail)
        if found is None or not rows_bad[int(found.group(1)), int(found.group(2)) - 1]:
            raise
        b, d = int(found.group(1)), int(found.group(2))
        raise _lib.KdtreeError(exc.status, f"request {b}, depth {d}: logits[{b}, {d - 1}] holds a NaN or +inf "
                               "logit, or only -inf logits (no log-probs)", exc.function) from None


def tree_attention_mask(trees, prefix_lengths, *, kind, dtype, columns, errors):
    check_tree_fields(trees, ("num_nodes", "depths", "parents", "visibility"))
    batch, rows = trees.batch, trees.budget + 1
    prefix = checks.prefix_lengths(prefix_lengths, batch)
    if kind not in ("bool", "bits", "additive", "flashinfer"):
        raise checks.invalid(f"kind must be 'bool', 'bits', 'additive' or 'flashinfer', got {kind!r}")
    if kind == "additive" and (not isinstance(dtype, str) or dtype not in ADDITIVE_LOWEST):
        raise checks.invalid(f"dtype must be 'float32', 'float16' or 'bfloat16' (a name, or a numpy or torch "
                             f"dtype), got {dtype!r}")
    if kind == "flashinfer" and columns is not None:
        raise checks.invalid("columns is not used with kind='flashinfer'")
    if columns is None:
        ncols = max(int(prefix.max()), 0) + rows if batch else rows
    else:
        ncols = columns
        if ncols < rows:
            raise checks.shape_error(f"columns {ncols} is less than the {rows} tree rows")
    num_nodes = np.asarray(trees.num_nodes)
    parents = np.asarray(trees.parents)
    # The per-request verdicts of the GPU call's request_status (kdt_tree_attention_mask_cuda).
    status = checks.ok_status((batch,))
    for b in range(batch):
        n, p = int(num_nodes[b]), int(prefix[b])
        error = None
        if p < 0:
            error = checks.range_error(f"request {b}: prefix_lengths[{b}] = {p} is negative")
        elif kind != "flashinfer" and p + rows > ncols:
            error = checks.range_error(f"request {b}: prefix {p} + {rows} tree rows exceeds columns {ncols}")
        elif not 0 <= n <= trees.budget:
            error = checks.value_error(f"request {b}: num_nodes {n} outside [0, {trees.budget}]")
        else:
            par = parents[b, 1 : n + 1]
            bad = (par < 0) | (par >= np.arange(1, n + 1))
            if bad.any():
                i = int(np.argmax(bad)) + 1
                error = checks.value_error(f"request {b}, node {i}: parent {int(parents[b, i])} is not in [0, {i})")
        if error is not None:
            if errors == "raise":
                raise error
            status[b] = error.status
    ok = status == 0
    vis = np.asarray(trees.visibility, dtype=bool)
    depths = np.asarray(trees.depths, dtype=np.int64)
    real = np.arange(rows)[None, :] <= np.asarray(trees.num_nodes)[:, None]  # [B, N+1]
    positions = np.maximum(prefix, 0)[:, None] + np.where(real & ok[:, None], depths, 0)

    def request_mask(b: int, width: int) -> np.ndarray:
        m = np.zeros((rows, width), bool)  # a failed request: every entry hidden
        if ok[b]:
            p = int(prefix[b])
            m[:, :p] = real[b][:, None]
            m[:, p : p + rows] = vis[b]
        return m

    if kind == "flashinfer":
        sizes = [(rows * (max(int(p), 0) + rows) + 7) // 8 for p in prefix]
        if sum(sizes) > checks.INT32_MAX:
            raise KdtreeError(STATUS["KDT_ERR_BUFFER_TOO_SMALL"], f"the packed masks need {sum(sizes)} bytes, more "
                              "than int32 offsets allow")
        # at the peak: the packed masks and one request's unpacked bool mask (8 bits a bit)
        largest = max((rows * (max(int(p), 0) + rows) for p in prefix), default=0)
        memory.outputs_fit(sum(sizes) + largest, f"the packed masks of {batch} request(s) (and one request's "
                           "unpacked bool mask while it is packed)")
        indptr = np.zeros(batch + 1, np.int64)
        indptr[1:] = np.cumsum(sizes)
        mask = np.zeros(int(indptr[-1]), np.uint8)
        for b in range(batch):
            width = max(int(prefix[b]), 0) + rows
            mask[indptr[b] : indptr[b + 1]] = np.packbits(request_mask(b, width).reshape(-1), bitorder="little")
        return TreeMask(mask, indptr.astype(np.int32), positions, status)
    # Bytes an entry takes at the peak: the per-request masks and their stack (bool), the
    # word-padded copy (bits), the float32 mask and its cast (additive).
    per_entry = {"bool": 2, "bits": 2.2, "additive": 2 + 4 + (4 if dtype == "float32" else 2)}[kind]
    memory.outputs_fit(int(batch * rows * ncols * per_entry), f"the {kind} masks [{batch}, {rows}, {ncols}]")
    dense = np.stack([request_mask(b, ncols) for b in range(batch)]) if batch else np.zeros((0, rows, ncols), bool)
    if kind == "bool":
        return TreeMask(dense, None, positions, status)
    if kind == "bits":
        words = (ncols + 31) // 32
        padded = np.zeros((batch, rows, words * 32), bool)
        padded[:, :, :ncols] = dense
        bits = np.packbits(padded.reshape(batch, rows, words, 32), axis=-1, bitorder="little")
        return TreeMask(np.ascontiguousarray(bits).view("<u4").reshape(batch, rows, words), None, positions, status)
    np_dtype = dtype
    if dtype == "bfloat16":
        import ml_dtypes  # a dependency of the package; numpy has no bfloat16

        np_dtype = ml_dtypes.bfloat16
    lowest = ADDITIVE_LOWEST[dtype]
    return TreeMask(np.where(dense, np.float32(0), np.float32(lowest)).astype(np_dtype), None, positions, status)


def verify_greedy_from_logits(trees, target_logits, *, stop_tokens, max_commit, errors, stop_sequences=None,
                              stop_history=None):
    x = _target_logits(trees, target_logits, "target_logits")
    return _walk_from_rows(trees, x, _argmax_rows(x), False, stop_tokens=stop_tokens, max_commit=max_commit,
                           stop_sequences=stop_sequences, stop_history=stop_history,
                           errors=errors)


def verify_sample_from_logits(trees, target_logits, temperature, *, seed, offset, stop_tokens, max_commit, errors, stop_sequences=None,
                              stop_history=None):
    x = _target_logits(trees, target_logits, "target_logits")
    batch, rows = trees.batch, trees.budget + 1
    draws = np.zeros((batch, rows), np.int32)
    for b in range(batch):
        n = min(max(int(trees.num_nodes[b]), 0), trees.budget) + 1
        draws[b, :n] = sampling.gumbel_draws(x[b, :n], temperature, seed, offset, b, np.arange(n))
    return _walk_from_rows(trees, x, draws, True, stop_tokens=stop_tokens, max_commit=max_commit,
                           stop_sequences=stop_sequences, stop_history=stop_history,
                           errors=errors)


def verify_sample_batch(trees, target_logits, settings, *, stop_tokens, max_commit, errors, stop_sequences=None,
                              stop_history=None):
    """Sampled verification with per-request settings (``settings``: temperature float32,
    top_p float32, top_k int64, seed and offset uint64, each [B]), the host twin of
    ``kdt_verify_sample_batch_cuda``: a request whose settings are invalid fails alone
    (KDT_ERR_VALUE) after its links and its cap are checked, as on the GPU."""
    x = _target_logits(trees, target_logits, "target_logits")
    batch, rows = trees.batch, trees.budget + 1
    draws = np.zeros((batch, rows), np.int32)
    why = {}
    for b in range(batch):
        t, p, k = settings["temperature"][b], settings["top_p"][b], settings["top_k"][b]
        reason = sampling.bad_setting(t, p, k)
        if reason is not None:
            why[b] = reason
            continue  # draws 0: the walk still checks its links and its cap
        n = min(max(int(trees.num_nodes[b]), 0), trees.budget) + 1
        draws[b, :n] = sampling.batch_draws(x[b, :n], t, p, k, int(settings["seed"][b]), int(settings["offset"][b]),
                                            b, np.arange(n))
    walk = dict(stop_tokens=stop_tokens, max_commit=max_commit,
                           stop_sequences=stop_sequences, stop_history=stop_history)
    acc = _walk_from_rows(trees, x, draws, True, errors="status", **walk)
    status = acc.request_status
    # The links (KDT_ERR_VALUE) and the cap (KDT_ERR_INVALID_ARGUMENT) come first; a walk
    # error (KDT_ERR_SHAPE) after the settings.
    unset = [b for b in why if status[b] in (0, STATUS["KDT_ERR_SHAPE"])]
    for b in unset:
        status[b] = STATUS["KDT_ERR_VALUE"]
        acc.accepted_nodes[b], acc.accept_length[b], acc.bonus_token[b] = -1, 0, -1
        acc.target_tokens[b] = -1
    failed = np.flatnonzero(status != 0)
    if errors == "raise" and failed.size:
        b = int(failed[0])
        if b in unset:
            raise checks.value_error(f"request {b}: {why[b]}")
        _walk_from_rows(trees, x, draws, True, errors="raise", **walk)  # raises for request b
    return acc


def compact_kv(k_layers, v_layers, prefix_lengths, acceptance, *, layout, errors, block_table=None):
    paged = layout in ("pshd", "phsd")
    if layout not in ("bhsd", "bshd", "pshd", "phsd"):
        raise checks.invalid(f"layout must be 'bhsd', 'bshd', 'pshd' or 'phsd', got {layout!r}")
    if paged != (block_table is not None):
        raise checks.invalid(f"layout {layout!r} {'needs' if paged else 'takes no'} block_table")
    if not k_layers:
        raise checks.invalid("k_layers is empty")
    v_layers = None if v_layers is None else list(v_layers)
    if v_layers is not None and len(v_layers) != len(k_layers):
        raise checks.invalid(f"{len(k_layers)} K layers but {len(v_layers)} V layers")
    layers = k_layers + ([] if v_layers is None else v_layers)
    for i, t in enumerate(layers):  # before any row moves: the cache is written whole or not at all
        which = f"k_layers[{i}]" if i < len(k_layers) else f"v_layers[{i - len(k_layers)}]"
        if isinstance(t, np.ndarray) and not t.flags.writeable:
            raise checks.invalid(f"{which} is read-only; the compaction writes the cache in place")
        if getattr(t, "requires_grad", False):
            raise checks.invalid(f"{which} requires grad; pass the cache tensors detached (tensor.detach())")
    shape = tuple(np.shape(layers[0]))
    if len(shape) != 4 or any(tuple(np.shape(t)) != shape for t in layers):
        raise checks.shape_error(f"every K and V layer must have the same 4-D shape, got "
                         f"{sorted({tuple(np.shape(t)) for t in layers})}")
    if len({id(t) for t in layers}) != len(layers) or len({_base_address(t) for t in layers}) != len(layers):
        raise checks.invalid("k_layers and v_layers must be distinct tensors (a tensor shared by two layers, or by K "
                             "and V, would be moved twice)")
    for i, t in enumerate(layers):
        steps = t.stride() if hasattr(t, "stride") and callable(t.stride) else np.asarray(t).strides
        if any(n > 1 and st == 0 for n, st in zip(shape, steps, strict=True)):
            which = f"k_layers[{i}]" if i < len(k_layers) else f"v_layers[{i - len(k_layers)}]"
            raise checks.invalid(f"{which} overlaps itself (zero strides {tuple(steps)}, e.g. an expanded tensor): "
                                 "one row's move would write every row sharing it")
    accepted = checks.int_array(acceptance.accepted_nodes, "accepted_nodes")
    length = checks.int_array(acceptance.accept_length, "accept_length").reshape(-1)
    if paged:
        if checks.dtype_name(getattr(block_table, "dtype", None)) != "int32":
            raise checks.type_error(f"block_table must be an int32 array (as on the GPU), got "
                                    f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
        table = checks.int_array(block_table, "block_table")
        if table.ndim != 2 or table.shape[1] < 1:
            raise checks.shape_error(f"block_table must be [B, pages a request >= 1], got {table.shape}")
        pages, page_size = shape[0], shape[1] if layout == "pshd" else shape[2]
        if not 1 <= page_size <= 256:
            raise checks.invalid(f"page size {page_size} (the cache's {'second' if layout == 'pshd' else 'third'} "
                                 "axis) is outside [1, 256]")
        batch, seq = table.shape[0], table.shape[1] * page_size
    else:
        batch = shape[0]
        seq = shape[2] if layout == "bhsd" else shape[1]
    if accepted.ndim != 2 or accepted.shape[0] != batch or length.shape != (batch,):
        raise checks.shape_error(f"acceptance must hold {batch} requests (the {'block_table' if paged else 'cache'}'s; "
                                 f"accepted_nodes [B, P], accept_length [B]), got {accepted.shape} and {length.shape}")
    dtypes = {checks.dtype_name(getattr(t, "dtype", None)) for t in layers}
    kv_dtypes = {"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"}
    if len(dtypes) != 1 or not dtypes <= kv_dtypes:
        raise checks.type_error(f"KV layers must all have one dtype of float16, bfloat16, float32, or one byte "
                                f"(float8_e4m3fn, float8_e5m2, int8, uint8: moved as bytes), as on the GPU; got "
                                f"{sorted(map(str, dtypes))}")
    prefix = checks.prefix_lengths(prefix_lengths, batch)
    # Every request is checked before any row moves; a failed request's rows are not
    # touched (its status says why), as on the GPU (kdt_compact_kv_cuda).
    status = checks.ok_status((batch,))
    for b in range(batch):
        m, p = int(length[b]), int(prefix[b])
        error = None
        path = accepted[b, : max(m, 0) + 1]
        if not 0 <= m < accepted.shape[1]:
            error = checks.value_error(f"request {b}: accept_length {m} outside [0, {accepted.shape[1] - 1}]")
        elif path[0] != 0 or (np.diff(path) <= 0).any():
            error = checks.value_error(f"request {b}: accepted path {path.tolist()} must start at 0 and increase")
        elif p < 0 or p + int(path[-1]) >= seq:
            error = checks.range_error(f"request {b}: prefix {p} + node {int(path[-1])} is outside the cache's "
                                       f"{seq} rows")
        elif paged:
            tokens = p + np.concatenate([path[1:], np.arange(1, m + 1)])
            ids = table[b, tokens // page_size]
            bad = np.flatnonzero((ids < 0) | (ids >= pages))
            if bad.size:
                error = checks.range_error(f"request {b}: block_table[{b}, {int(tokens[bad[0]] // page_size)}] = "
                                           f"{int(ids[bad[0]])} (token {int(tokens[bad[0]])}) is outside the pool's "
                                           f"{pages} pages")
        if error is not None:
            if errors == "raise":
                raise error
            status[b] = error.status
    for b in np.flatnonzero(status == 0):
        m = int(length[b])
        path = accepted[b, : m + 1]
        p = int(prefix[b])
        for j in range(1, m + 1):  # increasing j: a destination is never a later source
            src, dst = p + int(path[j]), p + j
            if src == dst:
                continue
            if paged:
                (ps, ss), (pd, sd) = divmod(src, page_size), divmod(dst, page_size)
                ps, pd = int(table[b, ps]), int(table[b, pd])
            for t in layers:
                if layout == "bhsd":
                    t[b, :, dst, :] = t[b, :, src, :]
                elif layout == "bshd":
                    t[b, dst, :, :] = t[b, src, :, :]
                elif layout == "pshd":
                    t[pd, sd, :, :] = t[ps, ss, :, :]
                else:
                    t[pd, :, sd, :] = t[ps, :, ss, :]
    return status


def ragged_trees(trees: TreeBatch, *, capacity: int | None, errors: str = "raise") -> RaggedTrees:
    check_tree_fields(trees, TREE_FIELDS)
    batch, rows = trees.batch, trees.budget + 1
    words = (rows + 31) // 32
    cap = batch * rows if capacity is None else checks.int_scalar(capacity, "capacity", 0, checks.INT32_MAX)
    memory.outputs_fit(cap * (6 * 4 + 8 + 4 * words), f"the ragged rows ({cap} rows)")
    out = RaggedTrees(np.empty(batch + 1, np.int32), *(np.empty(cap, np.dtype(d)) for d in list(
        RAGGED_FIELDS.values())[:-1]), np.empty((cap, words), np.uint32), budget=trees.budget)
    status = checks.ok_status((batch,))
    source = trees
    if errors == "status":
        # As on the GPU: a request whose num_nodes is out of range is packed as its root
        # alone (KDT_ERR_VALUE); real rows past the capacity fail every request
        # (KDT_ERR_BUFFER_TOO_SMALL) with cu_rows all zeros (and filler elsewhere).
        n = trees.num_nodes
        bad = (n < 0) | (n > trees.budget)
        status[bad] = STATUS["KDT_ERR_VALUE"]
        if bad.any():
            source = TreeBatch(**{f: getattr(trees, f) for f in TREE_FIELDS if f != "num_nodes"},
                               num_nodes=np.where(bad, 0, n).astype(np.int32), budget=trees.budget, depth=trees.depth)
        if int(source.num_nodes.astype(np.int64).sum()) + batch > cap:
            status[:] = STATUS["KDT_ERR_BUFFER_TOO_SMALL"]
            out.cu_rows[:] = 0
            for name, fill in (("row_request", -1), ("row_node", -1), ("tokens", -1), ("parents", -1),
                               ("depths", 0), ("positions", 0), ("visibility_bits", 0)):
                getattr(out, name)[...] = fill
            out.request_status = status
            return out
    struct = _lib.KdtTreesRagged(cap, checks.ptr(out.cu_rows), *(checks.ptr(getattr(out, f)) for f in RAGGED_FIELDS))
    _lib.load().kdt_trees_ragged_cpu(ctypes.byref(trees_struct(source)), ctypes.byref(struct))
    out.request_status = status
    return out
