"""The public functions of kdtree: draft-tree construction, masks, verification, top-k
log-probs and KV compaction, for host (numpy) or GPU (torch, CuPy, DLPack) arrays.

Each function checks its arguments once (:mod:`.checks`), then dispatches on where the
data live: host arrays go to :mod:`.host` (libkdtree's C entry points), CUDA arrays to
:mod:`.cuda` (its kernels). Both backends return the same result type.

Errors and statuses, the same for every function and both backends:

- Every check raises :class:`kdtree.KdtreeError` (a ``ValueError``) with a kdt_status in
  ``.status``, whether it ran in Python, C or CUDA; wrong types and dtypes raise
  :class:`kdtree.KdtreeTypeError` (also a ``TypeError``), outputs too large for the memory
  available raise :class:`kdtree.KdtreeMemoryError` (also a ``MemoryError``).
- Every result carries per-request statuses (``request_status``; ``row_status`` for top-k),
  whatever ``errors=`` is. With ``errors="raise"`` (the default) a failed request raises
  (on the GPU this copies the statuses to the host, so it synchronises). With
  ``errors="status"`` a request whose data are bad (NaN log-probs, a bad path...) does
  not raise: its status is recorded and its outputs are written as the GPU kernels write
  them (include/kdtree.h), the other requests are computed normally, and nothing
  synchronises. Arguments that are wrong for the whole call (shapes, dtypes, budgets)
  raise either way.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from . import checks, host
from . import device as _device
from .host import empty_trees
from .types import Acceptance, RaggedTrees, StopSequences, TopK, TopKShard, TreeBatch, TreeMask

__all__ = [
    "build_trees",
    "build_trees_from_logits",
    "compact_kv",
    "empty_trees",
    "ragged_trees",
    "topk_logprobs",
    "tree_attention_mask",
    "verify_greedy",
    "verify_greedy_from_logits",
    "verify_sample_from_logits",
]


def _gpu():
    from . import cuda as _gpu

    return _gpu


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
    request_budgets=None,
    request_depths=None,
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
        request_budgets: ``[B]`` ints in ``[0, budget]`` or None: request b's tree has at
            most ``request_budgets[b]`` draft nodes (its rows past them are padding; every
            request keeps ``budget + 1`` rows). None: ``budget`` for every request.
        request_depths: ``[B]`` ints in ``[0, L]`` or None: request b's depth limit; rows
            at depths past it are neither read nor validated. None: L for every request.
            With either, request b's tree is bit-identical to building it alone with its
            own budget and depth. A limit out of range is that request's error
            (KDT_ERR_OUT_OF_RANGE).
        out: a :class:`TreeBatch` from :func:`empty_trees` (or an earlier call) to reuse;
            every row is rewritten.
        errors: ``"raise"`` (default): raise KdtreeError for the first failed request (GPU:
            copies the statuses to the host, so it synchronises). ``"status"``: never raise
            for a request's data; ``request_status`` holds KDT_OK (0) or each request's
            status, a failed request gets a root-only tree (its root token, or the pad
            token when that is out of range; its root position, or 0), the others are
            built normally, and nothing synchronises (``kdt_trees_build_cuda``; on the
            host the batch is rebuilt request by request after a failure).
        stream: GPU only: the CUDA stream (int handle, torch or CuPy stream); default the
            current stream of the inputs' library.

    GPU inputs (torch / CuPy / any DLPack or ``__cuda_array_interface__`` CUDA array):
    ``logprobs`` float32 and ``token_ids`` int32 on one device; root arrays may be host or
    device arrays; outputs are allocated with the inputs' library on their device. The
    trees are bit-identical to the CPU builder's.

    Returns:
        :class:`TreeBatch` with ``N + 1`` rows per request (a 2-D input gives B = 1) and
        ``request_status`` int32 ``[B]``.

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
        budget = checks.int_scalar(budget, "budget", 0, checks.MAX_BUDGET)
        vocab = 0 if vocab_size is None else checks.int_scalar(vocab_size, "vocab_size", 1, 2**63 - 1)
        pad = checks.int_scalar(pad_token, "pad_token", checks.INT32_MIN, checks.INT32_MAX)
        return _gpu().build_trees(logprobs, token_ids, budget, root_tokens=root_tokens,
                                  root_positions=root_positions, vocab_size=vocab, pad_token=pad, out=out,
                                  errors=errors, stream=stream, request_budgets=request_budgets,
                                  request_depths=request_depths)
    checks.cpu_only(stream, errors, "build_trees")
    return host.build_trees(logprobs, token_ids, budget, root_tokens=root_tokens, root_positions=root_positions,
                            vocab_size=vocab_size, pad_token=pad_token, out=out, errors=errors,
                            request_budgets=request_budgets, request_depths=request_depths)


def stop_sequences(sequences, like=None) -> StopSequences:
    """Multi-token stop sequences checked and packed once, for many verify calls.

    Args:
        sequences: token sequences, each 1 to 16 ids >= 0 (``[[13, 14], [7, 8, 9]]``).
        like: None (host arrays), or a CUDA array (torch / CuPy): the packed tokens and
            offsets are copied to its device once, and the GPU verify calls then use them
            in place, with a device ``stop_history`` (int32 ``[B, H]``) used in place too;
            nothing is copied at the call, so it can be captured in a CUDA graph.

    Returns:
        :class:`kdtree.StopSequences`, accepted wherever ``stop_sequences=`` is (host calls
        read its sequences).

    No sequence at all (``[]``) gives an empty :class:`StopSequences`, which the verify
    calls take as none, as they take ``stop_sequences=[]`` (a ``stop_history`` is then
    unused).

    Raises:
        KdtreeError: an empty sequence, one of more than 16 tokens, a negative id.
        KdtreeTypeError: not a sequence of token sequences.
    """
    seq = checks.stop_sequences(sequences, None, 1)
    if seq is None:  # no sequence: the verify calls take it as none (a history is then unused)
        if like is not None and not _device.is_device_array(like):
            raise checks.type_error(f"like must be a CUDA array (torch or CuPy) or None, got {type(like).__name__}")
        return StopSequences((), np.zeros(0, np.int32), np.zeros(1, np.int64))
    tokens, offsets, _ = seq
    packed = tuple(tuple(int(t) for t in tokens[offsets[i]:offsets[i + 1]]) for i in range(offsets.size - 1))
    if like is not None:
        if not _device.is_device_array(like):
            raise checks.type_error(f"like must be a CUDA array (torch or CuPy) or None, got {type(like).__name__}")
        with _device.on_device(like):
            tokens, offsets = _device.from_host(like, tokens), _device.from_host(like, offsets)
    return StopSequences(packed, tokens, offsets)


def verify_greedy(
    trees: TreeBatch,
    target_tokens,
    *,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    errors: str = "raise",
    stream=None,
    out: Acceptance | None = None,
    stop_sequences=None,
    stop_history=None,
) -> Acceptance:
    """The verification walk (spec: "Verification"): from the root, move to the child whose
    token equals the target's token at the current node, while one exists.

    Args:
        trees: a :class:`TreeBatch` from :func:`build_trees`.
        target_tokens: integer ``[B, N+1]`` (or ``[N+1]`` when B = 1): the target's chosen
            token at every node (argmax of its logits, or a sample); padding rows ignored.
        stop_tokens: a sequence of token ids (None: none); an accepted stop token ends the
            walk with no bonus token. A single int is a TypeError (write ``[eos_id]``).
            GPU: also a device int32 ``[S]`` array (used in place: no copy).
        stop_sequences: None, or multi-token stops: a sequence of token sequences (each 1
            to 16 ids >= 0, e.g. ``[[13, 14], [7, 8, 9]]``); the walk ends, with no bonus
            token, after an accepted draft token that completes one of them in the
            committed stream (``stop_history``, then the tokens accepted this round). A
            bonus token that completes one is committed; end the request there.
            (``kdt_stop_sequences``.) GPU: copied to the device at each call, unless
            prepared there once with :func:`kdtree.stop_sequences` (``like=``).
        stop_history: None, or ints ``[B, H]``: each request's last committed tokens,
            right-aligned (the last column is the token the root stands for), -1 where a
            request has fewer; H = 15 always suffices. Only with ``stop_sequences``. None
            with stop sequences: the root tokens (``trees.tokens[:, 0]``) alone, so a
            sequence that spans the root and this round's tokens completes; pass the
            longer history for sequences that reach further back.
            GPU: with prepared device sequences, a device int32 ``[B, H]`` array is used
            in place.
        max_commit: None, an int, or ``[B]`` ints >= 0: the most tokens (accepted + bonus)
            each request may commit this round (remaining ``max_new_tokens``). Any other
            shape (a length-1 list for B > 1 included) is a ValueError. GPU: also a device
            int64 ``[B]`` array (used in place; a negative cap fails its request,
            KDT_ERR_INVALID_ARGUMENT).
        errors: as :func:`build_trees`; with ``"status"`` a failed request's outputs are
            accepted_nodes ``[-1, ...]``, accept_length 0 and bonus_token -1.
        stream: GPU only, as :func:`build_trees`.
        out: an :class:`Acceptance` of an earlier call with the same trees' batch and path
            width, whose arrays are reused: ``accepted_nodes``, ``accept_length``,
            ``bonus_token`` and ``request_status`` are rewritten whole (GPU: int32 device
            arrays on the trees' device, C-contiguous; host: numpy int32 arrays) and
            ``out`` itself is returned. GPU calls with ``out=``, device ``stop_tokens`` and
            ``max_commit`` (or none) and ``errors="status"`` allocate nothing, copy
            nothing from the host and never synchronise: they can be captured in a CUDA
            graph (``torch.cuda.graph``).

    Returns:
        :class:`Acceptance`: ``accepted_nodes`` int32 ``[B, P]`` with ``P = min(L, N) + 1``
        columns, the longest path a tree can hold plus the root (root first, -1 padding),
        ``accept_length`` int32 ``[B]``, ``bonus_token`` int32 ``[B]`` (-1: none),
        ``request_status`` int32 ``[B]``.

    Raises:
        ValueError / KdtreeError: shape mismatch, negative caps or target tokens at visited
        nodes, inconsistent tree links.
    """
    stop_sequences, stop_history = _stop_args(trees, stop_sequences, stop_history)
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a TreeBatch, got {type(trees).__name__}")
    if _device.is_device_array(trees.num_nodes):
        return _gpu().verify_greedy(trees, target_tokens, stop_tokens=stop_tokens, max_commit=max_commit,
                                    errors=errors, stream=stream, out=out, stop_sequences=stop_sequences,
                                    stop_history=stop_history)
    checks.cpu_only(stream, errors, "verify_greedy")
    acc = host.verify_greedy(trees, target_tokens, stop_tokens=stop_tokens, max_commit=max_commit, errors=errors,
                             stop_sequences=stop_sequences, stop_history=stop_history)
    return _host_out(out, acc, trees)


def _stop_args(trees, stop_sequences, stop_history):
    """(stop_sequences, stop_history) for a walk: no sequence at all (None, an empty list,
    an empty :class:`StopSequences`) is None with no history (a history then has nothing
    to match); with sequences and no history, the root tokens as a one-column history:
    the root stands for the last committed token, so that a sequence ending at a draft
    token right after it completes without a history from the caller."""
    if stop_sequences is None or not isinstance(trees, TreeBatch):
        return stop_sequences, stop_history
    seqs = getattr(stop_sequences, "sequences", stop_sequences)
    try:
        if len(seqs) == 0:
            return None, None
    except TypeError:
        return stop_sequences, stop_history  # (refused by the walk's own checks)
    if stop_history is not None:
        return stop_sequences, stop_history
    col = trees.tokens[:, :1]
    if isinstance(col, np.ndarray):
        return stop_sequences, np.ascontiguousarray(col, np.int32)
    if hasattr(col, "contiguous"):  # torch
        return stop_sequences, col.contiguous()
    if type(col).__module__.split(".")[0] == "cupy":
        import cupy

        return stop_sequences, cupy.ascontiguousarray(col)
    return stop_sequences, col


def _host_out(out, acc: Acceptance, trees: TreeBatch) -> Acceptance:
    """A host call's result, copied into ``out`` when one is given (``target_tokens`` too
    when the call computed them: copied into ``out.target_tokens``, or set there when it is
    None)."""
    if out is None:
        return acc
    if not isinstance(out, Acceptance):
        raise checks.type_error(f"out must be an Acceptance (from an earlier verify call), got {type(out).__name__}")
    names = ("accepted_nodes", "accept_length", "bonus_token", "request_status")
    fresh = acc.target_tokens is not None and out.target_tokens is None
    if acc.target_tokens is not None and out.target_tokens is not None:
        names += ("target_tokens",)
    _copy_host_out(acc, out, names, "verify")
    if fresh:
        out.target_tokens = acc.target_tokens
    return out


def _copy_host_out(result, out, names: tuple[str, ...], what: str):
    """Host results copied into the caller's ``out`` arrays (numpy), all checked first so
    that ``out`` is written whole or not at all; returns ``out``."""
    pairs = []
    for name in names:
        src, dst = np.asarray(getattr(result, name)), getattr(out, name)
        if not isinstance(dst, np.ndarray):
            raise checks.type_error(f"{what}: out.{name} must be a numpy array for host inputs, got "
                                    f"{type(dst).__name__}")
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise checks.shape_error(f"{what}: out.{name} must be {src.dtype} {src.shape}, got {dst.dtype} {dst.shape}")
        if not dst.flags.writeable:
            raise checks.invalid(f"{what}: out.{name} is read-only")
        pairs.append((dst, src))
    for dst, src in pairs:
        np.copyto(dst, src)
    return out


def topk_logprobs(logits, k: int, *, errors: str = "raise", stream=None, out=None):
    """Top-k log-probs of each row of logits, on the CPU (or the GPU for CUDA arrays).

    ``logprob = logit - logsumexp(row)`` over the whole row, computed as ``(logit - max) -
    log1p(rest)``, ``rest`` the sum of ``exp(row - max)`` over all entries but one at the max,
    in float64 (exact up to float32's largest logits, precise near 0) and rounded once to
    float32, sorted descending with ties ordered by lower token id.

    Args:
        logits: ``[..., V]`` float16, bfloat16, float32 or float64 (converted to float32).
        k: 0 <= k <= V.

    GPU (CUDA array logits, float32 / float16 / bfloat16, vocab axis contiguous, k <= 1024):
    ``kdt_topk_logprobs_cuda``, the logsumexp in float32 (results agree with the CPU's to
    float32 rounding; ids and order are exact).

    ``errors``: as :func:`build_trees`, per row: with ``"status"`` a bad row's status is
    KDT_ERR_VALUE in ``row_status``, its log-probs are NaN and its ids 0 .. k-1 (so a tree
    built from it fails), and the other rows are computed normally.

    ``out``: a :class:`TopK` of preallocated arrays (float32 ``[..., k]``, int32
    ``[..., k]``, int32 row statuses) on the logits' device (numpy for host logits),
    rewritten whole and returned; with device arrays and ``errors="status"`` the call
    allocates nothing and can be captured in a CUDA graph.

    Returns:
        :class:`TopK`, which unpacks as ``(logprobs float32 [..., k], ids int32 [..., k])``,
        with ``row_status`` int32 ``[...]`` (``[1]`` for 1-D logits).

    Raises:
        TypeError: non-floating logits. ValueError / KdtreeError: k out of range, a NaN or
        +inf logit, or a row whose logits are all -inf (the message names the row, as
        request and position for ``[B, L, V]`` logits, and the column).
    """
    if _device.is_device_array(logits):
        k = checks.int_scalar(k, "k", 0, 2**31 - 1)
        return _gpu().topk_logprobs(logits, k, errors=errors, stream=stream, out=out)
    checks.cpu_only(stream, errors, "topk_logprobs")
    result = host.topk_logprobs(logits, k, errors=errors)
    if out is None:
        return result
    if not isinstance(out, TopK):
        raise checks.type_error(f"out must be a TopK, got {type(out).__name__}")
    return _copy_host_out(result, out, ("logprobs", "ids", "row_status"), "topk_logprobs")


def topk_shard(logits, k: int, vocab_offset: int) -> TopKShard:
    """One vocabulary shard's summary of each row, for :func:`topk_merge` (tensor
    parallelism: the drafter's LM head split by vocabulary over T devices).

    Args:
        logits: ``[..., V_shard]`` float16, bfloat16, float32 or float64 host array: the
            logits of vocabulary entries ``vocab_offset .. vocab_offset + V_shard - 1``.
        k: 0 <= k <= V_shard: every shard gives k entries (so each shard holds at least k).
        vocab_offset: the shard's first global token id (>= 0; offset + V_shard <= 2^31).

    Returns:
        :class:`TopKShard` ``(logits float32 [..., k], ids int32 [..., k], max float32 [...],
        sum_rest float64 [...])``: the shard's k largest logits as they are (best first, ties
        by lower id) with global ids, its max logit and its sum of ``exp(logit - max)`` over
        every entry but the first at the max (whose term is 1; Neumaier-compensated float64,
        so that ``log1p`` of the merged rest keeps log-probs near 0 precise; max -inf and
        rest 0 for a row that is all -inf here). ``kdt_topk_shard_cpu``.

    Raises:
        KdtreeError: NaN or +inf logits (naming the row and the shard's column), k or the
        offset out of range.
    """
    return host.topk_shard(logits, k, vocab_offset)


def topk_merge(shard_logits, shard_ids=None, shard_max=None, shard_sum_rest=None, vocab: int | None = None, *,
               errors: str = "raise", stream=None) -> TopK:
    """The global top-k log-probs from T shards' :func:`topk_shard` outputs, stacked on a
    leading axis (``[T, ..., k]``, ``[T, ...]``); the shards hold disjoint vocabulary ranges
    covering ``vocab`` entries. Or ``topk_merge(shards, vocab=V)`` with ``shards`` a
    sequence of T :class:`TopKShard` (the four fields stacked here; numpy, torch or CuPy).

    The ids and their order (ties: lower id) are exactly those of :func:`topk_logprobs` on
    the gathered rows. The log-sum-exp is combined exactly from the shards' statistics
    (``m`` the largest max; ``rest`` the first shard at ``m``'s rest plus every other
    shard's ``(1 + rest_t) exp(max_t - m)``, float64; ``logprob = (logit - m) -
    log1p(rest)``), so a log-prob is within one float32 ulp of the gathered row's (equal on
    every tested row). ``kdt_topk_merge_cpu``; the shards' bytes per row are ``k * 8 + 12``
    (against ``2 V`` for bfloat16 logits).

    GPU (every input a CUDA array: ``shard_logits`` / ``shard_max`` float32, ``shard_ids``
    int32, ``shard_sum_rest`` float64, C-contiguous): ``kdt_topk_merge_cuda``, one launch,
    the same ids and order, log-probs within one float32 ulp of the CPU merge's; a bad row
    gets ``KDT_ERR_VALUE`` in ``row_status`` (NaN log-probs, ids 0 .. k-1), raised with
    ``errors="raise"`` (which synchronises), recorded only with ``"status"``. k <= 1024.

    Returns:
        :class:`TopK` ``(logprobs float32 [..., k], ids int32 [..., k])`` and the row
        statuses (host: 0; a host call raises instead).

    Raises:
        KdtreeError: T outside [1, 1024], shapes that disagree, an unsorted shard list, an
        id outside ``[0, vocab)`` or listed by two shards, statistics no shard gives, a row
        whose logits are all -inf (messages name the shard, the row of the flattened
        leading axes, and the entry). Not detected here (the merge sees only each shard's
        top k and statistics; :mod:`kdtree.distributed` checks the ranks' ranges): a shard
        with a wrong offset whose ids do not collide in the top k, and a missing shard (the
        result is then the top k of the ids the shards cover, normalised over them alone).
        KdtreeTypeError: a sequence of TopKShard with other fields also given, or fields
        missing, or vocab missing.
    """
    if isinstance(shard_logits, (list, tuple)) and not isinstance(shard_logits, TopKShard) and shard_logits \
            and all(isinstance(p, TopKShard) for p in shard_logits):
        if shard_ids is not None or shard_max is not None or shard_sum_rest is not None:
            raise checks.type_error("topk_merge: with a sequence of TopKShard, pass vocab= alone (the shards hold "
                                    "the other fields)")
        shard_logits, shard_ids, shard_max, shard_sum_rest = (_stack([p[f] for p in shard_logits]) for f in range(4))
    if shard_ids is None or shard_max is None or shard_sum_rest is None or vocab is None:
        raise checks.type_error("topk_merge takes (shard_logits, shard_ids, shard_max, shard_sum_rest, vocab), or "
                                "(a sequence of TopKShard, vocab=V)")
    if _device.is_device_array(shard_logits):
        return _gpu().topk_merge(shard_logits, shard_ids, shard_max, shard_sum_rest, vocab, errors=errors,
                                 stream=stream)
    checks.cpu_only(stream, errors, "topk_merge")
    return host.topk_merge(shard_logits, shard_ids, shard_max, shard_sum_rest, vocab)


def _stack(arrays):
    """The arrays stacked on a new leading axis by their own library (numpy, torch, CuPy)."""
    mod = type(arrays[0]).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return torch.stack(arrays)
    if mod == "cupy":
        import cupy

        return cupy.stack(arrays)
    return np.stack([np.asarray(a) for a in arrays])


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
    request_budgets=None,
    request_depths=None,
) -> TreeBatch:
    """Draft trees straight from the drafter's logits: top-k log-probs, then the builder.

    Args:
        logits: ``[B, L, V]`` (or ``[L, V]``): row ``l`` of request ``b`` is the drafter's
            distribution at depth ``l + 1`` below the root.
        width: K, the top-k entries kept per position (only ``min(K, budget)`` are computed).
        budget, root_tokens, root_positions, pad_token, out: as :func:`build_trees`.
        errors, stream, request_budgets, request_depths: as :func:`build_trees` (a NaN
            row past a request's depth limit does not fail it).

    On the GPU (CUDA array logits; float32, float16 or bfloat16) this is one call,
    ``kdt_trees_build_from_logits_cuda``, with no host round trip; top-k is computed in
    float32 there and in float64 on the CPU, so the two can differ in the last bits of the
    log-probs (each path's tree is exact for its own top-k). A row with NaN, +inf or only
    -inf logits makes its request fail (KDT_ERR_VALUE).

    Returns:
        :class:`TreeBatch` (vocab_size = V is enforced on the ids).
    """
    width = checks.int_scalar(width, "width", 0, 2**31 - 1)
    budget = checks.int_scalar(budget, "budget", 0, checks.MAX_BUDGET)
    pad = checks.int_scalar(pad_token, "pad_token", checks.INT32_MIN, checks.INT32_MAX)
    if _device.is_device_array(logits):
        return _gpu().build_trees_from_logits(logits, width, budget, root_tokens=root_tokens,
                                              root_positions=root_positions, pad_token=pad, out=out,
                                              errors=errors, stream=stream, request_budgets=request_budgets,
                                              request_depths=request_depths)
    checks.cpu_only(stream, errors, "build_trees_from_logits")
    return host.build_trees_from_logits(logits, width, budget, root_tokens=root_tokens, root_positions=root_positions,
                                        pad_token=pad_token, out=out, errors=errors, request_budgets=request_budgets,
                                        request_depths=request_depths)


def tree_attention_mask(
    trees: TreeBatch,
    prefix_lengths,
    *,
    kind: str = "bool",
    dtype: str = "float32",
    columns: int | None = None,
    check_positions: bool = False,
    errors: str = "raise",
    stream=None,
    out=None,
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
        columns: C for the dense kinds (default ``max(p) + N + 1``, read from
            ``prefix_lengths``: on the GPU that copies them to the host, so inside a CUDA
            graph capture ``columns`` is required and its absence is a KdtreeError); must
            be None for ``"flashinfer"``.
        out: a :class:`TreeMask` of preallocated ``mask``, ``positions`` and
            ``request_status`` arrays of this call's shapes and dtypes (dense kinds only),
            rewritten whole and returned; on the GPU with ``columns`` and
            ``errors="status"`` the call then allocates and synchronises nothing.
        errors: as :func:`build_trees`. Per request: KDT_ERR_OUT_OF_RANGE (negative prefix,
            ``p + N + 1 > columns``), KDT_ERR_VALUE (num_nodes outside [0, N], a parent not
            in [0, i)); with ``"status"`` a failed request's rows are all hidden and its
            positions are its prefix length (0 when negative).
        stream: GPU only, as :func:`build_trees`.

    Returns:
        :class:`TreeMask`, which unpacks as ``(mask, mask_indptr, positions)``:
        ``mask_indptr`` int32 ``[B + 1]`` (byte offsets) for ``"flashinfer"``, else None;
        ``positions`` int64 ``[B, N+1]`` = ``p + depth`` (padding rows: ``p``); and
        ``request_status`` int32 ``[B]``.

        check_positions: also check that each tree was built for this prefix: the root
            sits right after the ``p`` cached tokens, so ``trees.positions[b, 0]`` (the
            ``root_positions`` the trees were built with) must equal ``prefix_lengths[b]``;
            a mismatch raises KDT_ERR_VALUE naming the request and both values, whatever
            ``errors`` is (on the GPU this copies both to the host: it synchronises).

    Raises:
        KdtreeError: unknown kind or dtype, ``columns < N + 1``, a failed request (with
        ``errors="raise"``), root positions that disagree with ``prefix_lengths``
        (``check_positions``).
    """
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a TreeBatch, got {type(trees).__name__}")
    if columns is not None:  # (a [B, N+1, C] float32 mask of more than 2^62 bytes is no mask)
        columns = checks.int_scalar(columns, "columns", 0, 2**62 // (4 * (int(trees.budget) + 1))
                                    if isinstance(trees, TreeBatch) and isinstance(trees.budget, int)
                                    and trees.budget >= 0 else 2**62)
    if dtype is None and kind == "additive":
        raise checks.invalid("dtype must be 'float32', 'float16' or 'bfloat16' (a name, or a numpy or torch dtype), "
                             "got None")
    dtype = checks.dtype_name(dtype)
    if check_positions:
        _check_root_positions(trees, prefix_lengths)
    if _device.is_device_array(trees.num_nodes):
        return _gpu().tree_attention_mask(trees, prefix_lengths, kind=kind, dtype=dtype, columns=columns,
                                          errors=errors, stream=stream, out=out)
    checks.cpu_only(stream, errors, "tree_attention_mask")
    result = host.tree_attention_mask(trees, prefix_lengths, kind=kind, dtype=dtype, columns=columns, errors=errors)
    if out is None:
        return result
    if not isinstance(out, TreeMask) or kind == "flashinfer":
        raise checks.type_error(f"out must be a TreeMask of a dense kind, got {type(out).__name__} for kind {kind!r}")
    return _copy_host_out(result, out, ("mask", "positions", "request_status"), "tree_attention_mask")


def _check_root_positions(trees: TreeBatch, prefix_lengths) -> None:
    """KDT_ERR_VALUE for the first request whose root position is not its prefix length."""
    host_of = _device.to_host if _device.is_device_array(trees.positions) else np.asarray
    roots = np.asarray(host_of(trees.positions))[:, 0] if trees.batch else np.zeros(0, np.int64)
    given = _device.to_host(prefix_lengths) if _device.is_device_array(prefix_lengths) else prefix_lengths
    prefix = checks.prefix_lengths(given, trees.batch)
    bad = np.flatnonzero(roots != prefix)
    if bad.size:
        b = int(bad[0])
        raise checks.value_error(f"request {b}: the tree's root position {int(roots[b])} (root_positions) is not "
                                 f"its prefix length {int(prefix[b])} (prefix_lengths): the root must sit right "
                                 f"after the cached tokens")


def verify_greedy_from_logits(
    trees: TreeBatch,
    target_logits,
    *,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    errors: str = "raise",
    stream=None,
    out: Acceptance | None = None,
    stop_sequences=None,
    stop_history=None,
) -> Acceptance:
    """Greedy verification from the target's logits: argmax per node (ties: lower id), then
    the walk of :func:`verify_greedy`.

    Args:
        trees: a :class:`TreeBatch`.
        target_logits: ``[B, N+1, V]`` (``[N+1, V]`` for B = 1): row ``i`` is the target's
            output at tree node ``i`` of its verify forward. GPU: float32 / float16 /
            bfloat16, only the rows the walk visits are read.
        stop_tokens, max_commit, stop_sequences, stop_history: as :func:`verify_greedy`.
        errors, stream: as :func:`verify_greedy`.
        out: as :func:`verify_greedy`; ``out.target_tokens`` (int32 ``[B, N+1]``; GPU: or
            None, not computed) is rewritten whole too (host: set when it is None).

    Returns:
        :class:`Acceptance`; ``target_tokens`` holds the argmax at the nodes the walk read
        (the root and the accepted nodes, the last only when a bonus token follows it), -1
        elsewhere, on the CPU and the GPU alike.

    Raises:
        ValueError / KdtreeError: shapes, a NaN logit in a row the walk visits ("request 1,
        node 0: target_logits[1, 0] holds a NaN logit"), bad caps or links. Infinite logits
        are ordinary values for the argmax: a visited row of only -inf gives token 0 (the
        lowest id among equal values), one with +inf its first +inf, on the CPU and the GPU.
    """
    stop_sequences, stop_history = _stop_args(trees, stop_sequences, stop_history)
    if _device.is_device_array(target_logits):
        return _gpu().verify_from_logits(trees, target_logits, temperature=None, seed=0, offset=0,
                                         stop_tokens=stop_tokens, max_commit=max_commit, errors=errors,
                                         stream=stream, out=out, stop_sequences=stop_sequences,
                                         stop_history=stop_history)
    checks.cpu_only(stream, errors, "verify_greedy_from_logits")
    acc = host.verify_greedy_from_logits(trees, target_logits, stop_tokens=stop_tokens, max_commit=max_commit,
                                         errors=errors, stop_sequences=stop_sequences, stop_history=stop_history)
    return _host_out(out, acc, trees)


def verify_sample_from_logits(
    trees: TreeBatch,
    target_logits,
    temperature,
    *,
    seed,
    offset,
    top_p=None,
    top_k=None,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    errors: str = "raise",
    stream=None,
    out: Acceptance | None = None,
    stop_sequences=None,
    stop_history=None,
) -> Acceptance:
    """Sampled verification, lossless for any temperature: one draw per visited node from
    ``softmax(logits / temperature)`` (cut by ``top_k`` / ``top_p`` when given), then the
    walk of :func:`verify_greedy` along the draws.

    The draw is the Gumbel-max trick over a Philox4x32-10 counter-based generator keyed by
    ``(seed, offset, request, node, token)``: the same arguments give the same tokens on
    every launch shape (definition: include/kdtree.h, ``kdt_verify_sample_from_logits_cuda``;
    the cuts: ``kdt_verify_sample_batch_cuda``). The CPU path (host arrays) computes the same
    draws in numpy (it may differ from the GPU only where two scores tie within float32
    ``log`` rounding; the cuts are the same on both).

    Args:
        trees, target_logits, stop_tokens, max_commit, errors, stream, stop_sequences,
            stop_history: as :func:`verify_greedy_from_logits`.
        temperature: a real number (every request) or ``[B]`` values: 0 is greedy (the
            argmax, ties lower id) for that request, else finite and >= 1e-6.
        seed, offset: 64-bit unsigned ints, or ``[B]`` of them; advance ``offset`` every
            round.
        top_p: None (1: no cut), a real in (0, 1], or ``[B]`` of them: keep the most likely
            tokens whose probability mass (after the top-k cut) first reaches top_p.
        top_k: None (0: no cut), an int >= 0, or ``[B]`` of them: keep the top_k tokens of
            largest logit (ties lower id); 0 keeps all.
        out: as :func:`verify_greedy_from_logits`.

    Per-request arrays may be host arrays (numpy, lists) or, on the GPU, device arrays:
    ``temperature`` and ``top_p`` float32, ``top_k`` int32, ``seed`` and ``offset`` int64
    or uint64 (int64 read as its two's-complement uint64 bits), all ``[B]``. A scalar out
    of range raises; a per-request value out of range fails that request alone
    (KDT_ERR_VALUE; with ``errors="status"`` its outputs are those of a failed request).

    GPU: scalar temperature (not 0), seed and offset without top_p / top_k call
    ``kdt_verify_sample_from_logits_cuda``; anything else calls
    ``kdt_verify_sample_batch_cuda``, which reads every setting from device memory when
    the kernel runs, after host values (scalars included) were copied to the device during
    this call. Inside a CUDA graph every per-request setting must therefore be a device
    array (a host value would be copied once, at capture, and replayed unchanged), and
    so must ``stop_tokens`` and ``max_commit`` (or none); with ``out=`` and
    ``errors="status"`` the call then allocates, copies and synchronises nothing. Advance
    the offsets in the graph (``offsets += 1``) to draw new tokens every replay.

    Returns:
        :class:`Acceptance` (``target_tokens`` holds the draws at the nodes the walk read,
        -1 elsewhere, as :func:`verify_greedy_from_logits`).

    Raises:
        ValueError / KdtreeError: as :func:`verify_greedy_from_logits`; a visited row with a
        NaN or a +inf logit, or only -inf logits, has no draw ("target_logits[1, 0] holds
        only -inf logits"); a request's bad setting ("request 2: top_p 1.5 must be in
        (0, 1]").
    """
    stop_sequences, stop_history = _stop_args(trees, stop_sequences, stop_history)
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a TreeBatch, got {type(trees).__name__}")
    given = {"temperature": temperature, "seed": seed, "offset": offset, "top_p": top_p, "top_k": top_k}
    on_gpu = _device.is_device_array(target_logits)
    device = {name for name, value in given.items() if _device.is_device_array(value)}
    if device and not on_gpu:
        raise checks.invalid(f"{', '.join(sorted(device))}: GPU arrays, but target_logits is a host array")
    scalars = not device and all(np.ndim(v) == 0 for v in given.values() if v is not None)
    if scalars:
        t32 = _check_scalar_settings(temperature, top_p, top_k)
        seed = checks.int_scalar(seed, "seed", 0, 2**64 - 1)
        offset = checks.int_scalar(offset, "offset", 0, 2**64 - 1)
        if top_p is None and top_k is None and t32 != 0:
            if on_gpu:
                return _gpu().verify_from_logits(trees, target_logits, temperature=float(t32), seed=seed,
                                                 offset=offset, stop_tokens=stop_tokens, max_commit=max_commit,
                                                 errors=errors, stream=stream, out=out, stop_sequences=stop_sequences,
                                                 stop_history=stop_history)
            checks.cpu_only(stream, errors, "verify_sample_from_logits")
            acc = host.verify_sample_from_logits(trees, target_logits, float(t32), seed=seed, offset=offset,
                                                 stop_tokens=stop_tokens, max_commit=max_commit, errors=errors,
                                                 stop_sequences=stop_sequences, stop_history=stop_history)
            return _host_out(out, acc, trees)
    batch = trees.batch
    kinds = {"temperature": "float", "seed": "u64", "offset": "u64", "top_p": "float", "top_k": "int"}
    settings = {name: value if name in device or value is None else
                checks.per_request_setting(value, name, batch, kinds[name]) for name, value in given.items()}
    if on_gpu:
        return _gpu().verify_sample_batch(trees, target_logits, settings, stop_tokens=stop_tokens,
                                          max_commit=max_commit, errors=errors, stream=stream, out=out,
                                          stop_sequences=stop_sequences, stop_history=stop_history)
    checks.cpu_only(stream, errors, "verify_sample_from_logits")
    if settings["top_p"] is None:
        settings["top_p"] = np.ones(batch, np.float32)
    if settings["top_k"] is None:
        settings["top_k"] = np.zeros(batch, np.int64)
    acc = host.verify_sample_batch(trees, target_logits, settings, stop_tokens=stop_tokens, max_commit=max_commit,
                                   errors=errors, stop_sequences=stop_sequences, stop_history=stop_history)
    return _host_out(out, acc, trees)


def _check_scalar_settings(temperature, top_p, top_k) -> np.float32:
    """Scalar settings (they apply to every request, so a bad one fails the call); returns
    the temperature in float32, the kernels' type."""
    with np.errstate(over="ignore"):  # an overflow is rejected just below
        t32 = np.float32(checks.real_scalar(temperature, "temperature"))
    if not (t32 == 0 or (np.isfinite(t32) and t32 >= np.float32(1e-6))):
        raise checks.value_error(f"temperature must be 0 (greedy) or finite and >= 1e-6 in float32, got "
                                 f"{temperature!r}")
    if top_p is not None and not 0 < np.float32(checks.real_scalar(top_p, "top_p")) <= 1:
        raise checks.value_error(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None:
        checks.int_scalar(top_k, "top_k", 0, checks.INT32_MAX)
    return t32


def tree_attention(
    q,
    k_cache,
    v_cache,
    trees: TreeBatch,
    prefix_lengths,
    *,
    layout: str | None = None,
    block_table=None,
    max_prefix: int | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    errors: str = "raise",
    stream=None,
    out=None,
    lse=None,
    workspace=None,
):
    """The verify forward's attention on the GPU (``kdt_tree_attention_cuda``): each request's
    ``N + 1`` tree rows attend to its ``p = prefix_lengths[b]`` cached tokens and, inside
    the tree, to themselves and their ancestors (``trees.visibility_bits``), in one launch
    (plus a merge when long contexts are split).

    The verify forward must already have written the tree rows' keys and values to the
    cache as tokens ``p .. p + N`` (row ``i`` at token ``p + i``), as the engine does.

    Args:
        q: CUDA float16 / bfloat16 ``[B, N+1, q_heads, head_dim]`` (head_dim 64, 128 or
            256, contiguous; other strides multiples of 8 elements).
        k_cache, v_cache: the same dtype, shape and strides. ``layout``: ``"bhsd"``
            ``[B, kv_heads, S, D]`` (default without ``block_table``; Hugging Face's),
            ``"bshd"`` ``[B, S, kv_heads, D]``; paged: ``"pshd"`` ``[pages, page_size,
            kv_heads, D]`` (default with ``block_table``; vLLM's and SGLang's) or ``"phsd"``
            ``[pages, kv_heads, page_size, D]`` (FlashInfer's HND). ``q_heads`` must be a
            multiple of ``kv_heads`` (GQA).
        trees: a GPU :class:`TreeBatch` (``num_nodes`` and ``visibility_bits`` are read).
        prefix_lengths: ``[B]`` ints in ``[0, max_prefix]`` (a host array is copied).
        block_table: paged caches: CUDA int32 ``[B, pages a request]``: request b's token
            ``t`` is in page ``block_table[b, t // page_size]``, slot ``t % page_size``
            (page_size 1 to 256).
        max_prefix: a bound on every prefix length (default: what the cache can hold,
            ``S - (N+1)`` or ``pages * page_size - (N+1)``); it fixes how the keys are split
            over CTAs and the workspace, so pass the real bound for short contexts in a big
            cache.
        softmax_scale: default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 ``[B, N+1, q_heads]`` log-sum-exp (natural
            log) of the scaled scores.
        errors: as :func:`build_trees`. Per request: KDT_ERR_VALUE (num_nodes outside
            [0, N]), KDT_ERR_OUT_OF_RANGE (prefix outside [0, max_prefix], keys past the
            cache, a page id outside the pool); a failed request's output rows are zeros.
        stream: as :func:`build_trees`.
        out, lse: preallocated outputs of the shapes above (written whole).
        workspace: a preallocated CUDA uint8 buffer of at least
            ``kdt_tree_attention_cuda_workspace_bytes`` bytes (allocated per call otherwise,
            when the keys are split).

    Returns:
        ``(out, lse, request_status)``: ``out`` like ``q`` (padding rows ``i > num_nodes[b]``
        zeros), ``lse`` (None unless asked for; ``-inf`` where ``out`` is zeros) and int32
        ``[B]`` statuses.

    Raises:
        KdtreeError: host arrays (this function runs on the GPU only), dtypes, shapes,
        layouts, strides, a failed request (with ``errors="raise"``).
    """
    if not _device.is_device_array(q):
        raise checks.invalid("tree_attention runs on the GPU: q, k_cache and v_cache must be CUDA arrays "
                             f"(got {type(q).__name__})")
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a TreeBatch (build_trees' output), got {type(trees).__name__}")
    return _gpu().tree_attention(q, k_cache, v_cache, trees, prefix_lengths, layout=layout, block_table=block_table,
                                 max_prefix=max_prefix, softmax_scale=softmax_scale, return_lse=return_lse,
                                 errors=errors, stream=stream, out=out, lse=lse, workspace=workspace)


def tree_attention_mla(
    q,
    latent_cache,
    trees: TreeBatch,
    prefix_lengths,
    *,
    softmax_scale: float,
    block_table=None,
    max_prefix: int | None = None,
    return_lse: bool = False,
    errors: str = "raise",
    stream=None,
    out=None,
    lse=None,
    workspace=None,
):
    """:func:`tree_attention` for MLA (multi-head latent attention in its absorbed form,
    DeepSeek-V3 / Kimi-K2; ``kdt_tree_attention_mla_cuda``): one latent KV head of 576
    values a token (the 512 latent values, then the 64 rotary key values), shared by every
    query head; scores over all 576 values, output the weighted sum of the visible tokens'
    first 512 values. The tree rule, padding rows, statuses and splitting are
    :func:`tree_attention`'s.

    Args:
        q: CUDA float16 / bfloat16 ``[B, N+1, q_heads, 576]``: each head's absorbed query
            (the no-rotary part multiplied into the latent space, then the rotary part).
        latent_cache: the same dtype: ``[B, S, 576]`` (contiguous) or, with
            ``block_table``, ``[pages, page_size, 576]`` (vLLM's and FlashMLA's paged
            layout, page_size 1 to 256). The verify forward must have written the tree
            rows' latents as tokens ``p .. p + N``.
        softmax_scale: required: the model's scale (for DeepSeek-V3 ``1 /
            sqrt(192)`` times its YaRN ``mscale^2``), not ``1 / sqrt(576)``.
        trees, prefix_lengths, block_table, max_prefix, return_lse, errors, stream,
            workspace: as :func:`tree_attention` (the workspace query is
            ``kdt_tree_attention_mla_cuda_workspace_bytes``).
        out, lse: preallocated ``[B, N+1, q_heads, 512]`` (the dtype of q) and float32
            ``[B, N+1, q_heads]``.

    Returns:
        ``(out, lse, request_status)`` as :func:`tree_attention`, ``out`` of 512 values a
        head.

    Raises:
        KdtreeError: host arrays, dtypes, shapes (576 values a head and token), strides,
        a failed request (with ``errors="raise"``).
    """
    if not _device.is_device_array(q):
        raise checks.invalid("tree_attention_mla runs on the GPU: q and latent_cache must be CUDA arrays "
                             f"(got {type(q).__name__})")
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a TreeBatch (build_trees' output), got {type(trees).__name__}")
    if not _device.is_device_array(latent_cache) or len(getattr(latent_cache, "shape", ())) != 3:
        raise checks.shape_error("latent_cache must be a CUDA array [B, S, 576] or, paged, [pages, page_size, 576]; "
                                 f"got {type(latent_cache).__name__} of shape {getattr(latent_cache, 'shape', None)}")
    if softmax_scale is None:
        raise checks.invalid("tree_attention_mla: softmax_scale is required (the model's scale, e.g. 1 / sqrt(192) "
                             "x mscale^2 for DeepSeek-V3; not 1 / sqrt(576))")
    cache4 = latent_cache[:, :, None]  # one latent KV head
    layout = "pshd" if block_table is not None else "bshd"
    return _gpu().tree_attention(q, cache4, cache4, trees, prefix_lengths, layout=layout, block_table=block_table,
                                 max_prefix=max_prefix, softmax_scale=softmax_scale, return_lse=return_lse,
                                 errors=errors, stream=stream, out=out, lse=lse, workspace=workspace, mla=True)


def compact_kv(
    k_layers,
    v_layers,
    prefix_lengths,
    acceptance: Acceptance,
    *,
    layout: str = "bhsd",
    block_table=None,
    errors: str = "raise",
    stream=None,
    out=None,
):
    """KV-cache compaction after verification, in place: the accepted path's rows move to
    the rows right after each request's prefix (row ``p + accepted_nodes[b][j]`` -> row
    ``p + j``, ``j = 0 .. accept_length[b]``); the caller then keeps ``p + accept_length + 1``
    rows.

    Args:
        k_layers, v_layers: sequences of per-layer tensors (``v_layers`` may be None) of
            shape ``[B, H, S, D]`` (``layout="bhsd"``, Hugging Face) or ``[B, S, H, D]``
            (``"bshd"``), or page pools ``[pages, page_size, H, D]`` (``"pshd"``: vLLM,
            SGLang) or ``[pages, H, page_size, D]`` (``"phsd"``: FlashInfer's HND) read
            through ``block_table``; all with the same shape, strides and dtype (float16, bfloat16,
            float32, or one byte: float8_e4m3fn, float8_e5m2, int8, uint8, moved as bytes; on the
            host and on the GPU), head_dim contiguous. SGLang's token pool (per layer
            ``[slots, H, D]`` with ``req_to_token`` as the table) is ``"pshd"`` with page size
            1: ``pool[:, None]``. The verify forward must have written tree row ``i`` at ``p + i``.
        block_table: paged layouts only: int32 ``[B, pages a request]``, token ``t`` of
            request ``b`` in page ``block_table[b, t // page_size]``, slot
            ``t % page_size`` (page size 1 to 256). The pages that hold tokens ``p + 1``
            to ``p + accepted_nodes[b][accept_length[b]]`` must be the request's own (a
            page shared in that range is moved twice; not checked). A page id outside
            the pool, for a token read or written, fails the request
            (KDT_ERR_OUT_OF_RANGE).
        prefix_lengths: ``[B]`` ints >= 0.
        acceptance: the :class:`Acceptance` of the verify call.
        errors: as :func:`build_trees`. Per request: KDT_ERR_VALUE (path not starting at 0,
            not strictly increasing, accept_length outside the path's columns),
            KDT_ERR_OUT_OF_RANGE (negative prefix, a row beyond the cache); a failed
            request's cache rows are not touched.
        stream: GPU only, as :func:`build_trees`.
        out: GPU only: a preallocated int32 ``[B]`` device array for the statuses (the
            call then allocates nothing; the layers' pointer table is built on the first
            call with a set of tensors, so make that call before capturing a CUDA graph).

    Returns:
        ``request_status`` int32 ``[B]`` (KDT_OK or each request's status).

    GPU tensors: one launch for all layers (``kdt_compact_kv_cuda``, paged
    ``kdt_compact_kv_paged_cuda``); host tensors (numpy or CPU torch): a row copy per
    accepted node.

    Raises TypeError when ``k_layers`` or ``v_layers`` is a single tensor, not a sequence.
    """
    if not (hasattr(acceptance, "accepted_nodes") and hasattr(acceptance, "accept_length")):
        raise checks.type_error(f"acceptance must be an Acceptance (a verify call's result, or "
                                f"kdtree.Acceptance(accepted_nodes, accept_length, bonus_token)), got "
                                f"{type(acceptance).__name__}")
    for name, layers in (("k_layers", k_layers), ("v_layers", v_layers)):
        if hasattr(layers, "ndim") and hasattr(layers, "shape"):  # one array, not a sequence of them
            raise checks.type_error(f"{name} must be a sequence of per-layer tensors (one [B, H, S, D] or [B, S, H, D] "
                            f"tensor per layer), got a single {layers.ndim}-D {type(layers).__name__} of shape "
                            f"{tuple(layers.shape)}; pass [tensor] for one layer")
    k_layers = list(k_layers)
    v_layers = None if v_layers is None else list(v_layers)  # read once: a generator is consumed
    if k_layers and _device.is_device_array(k_layers[0]):
        return _gpu().compact_kv(k_layers, v_layers, prefix_lengths, acceptance, layout=layout, errors=errors,
                                 stream=stream, out=out, block_table=block_table)
    checks.cpu_only(stream, errors, "compact_kv")
    if out is not None:
        raise checks.invalid("compact_kv: out= is for GPU tensors (host compaction returns a new status array)")
    return host.compact_kv(k_layers, v_layers, prefix_lengths, acceptance, layout=layout, errors=errors,
                           block_table=block_table)


def ragged_trees(trees: TreeBatch, *, capacity: int | None = None, errors: str = "raise",
                 stream=None) -> RaggedTrees:
    """The real rows of ``trees`` packed back to back, with ``cu_rows`` offsets
    (``kdt_trees_ragged_cpu`` / ``kdt_trees_ragged_cuda``), for attention kernels that take
    variable-length query rows and should compute no padding row.

    Args:
        trees: a :class:`TreeBatch` (host or GPU arrays, from :func:`build_trees`).
        capacity: rows each packed array holds; default ``B * (N + 1)``, the most the real
            rows can take (so the call never depends on the trees' sizes: capturable in a
            CUDA graph). A smaller one must still hold every real row.
        errors: ``"raise"``, or ``"status"``: per-request statuses instead of an error, the
            same on the host and the GPU (a request whose ``num_nodes`` is out of range is
            packed as its root alone, KDT_ERR_VALUE; real rows past the capacity give every
            request KDT_ERR_BUFFER_TOO_SMALL and ``cu_rows`` all zeros); on the GPU nothing
            synchronises.
        stream: GPU only: the CUDA stream (default: the current one of the arrays' library).

    Returns:
        :class:`RaggedTrees`: request b's ``num_nodes[b] + 1`` rows are rows
        ``cu_rows[b] .. cu_rows[b + 1] - 1`` of ``row_request``, ``row_node``, ``tokens``,
        ``depths``, ``parents`` (request-local), ``positions`` and ``visibility_bits``
        (``[capacity, ceil((N+1)/32)]``: the tree attention mask with the prefix implicit);
        rows past ``cu_rows[B]`` are filler (-1 ids, zeros).

    Raises:
        KdtreeError: ``num_nodes`` outside ``[0, N]`` (KDT_ERR_VALUE, naming the request),
            real rows past ``capacity`` (KDT_ERR_BUFFER_TOO_SMALL), a capacity outside
            ``[0, 2^31 - 1]``.
    """
    if _device.is_device_array(trees.num_nodes):
        return _gpu().ragged_trees(trees, capacity=capacity, errors=errors, stream=stream)
    checks.cpu_only(stream, errors, "ragged_trees")
    return host.ragged_trees(trees, capacity=capacity, errors=errors)
