"""kdtree over torch.distributed: a vocabulary-sharded LM head's logits, never gathered.

Under tensor parallelism each rank holds the logits for a slice of the vocabulary.
:func:`topk_logprobs_sharded` gives every rank the drafter's top-k log-probs of the whole
rows while gathering only each rank's :func:`kdtree.topk_shard` summary (k logits, k ids,
max and sum of exponentials a row); :func:`target_tokens_sharded` gives every rank the
target's token at every tree node (the greedy argmax or the sampled draw of the unsharded
verification) while gathering four numbers a row.

Both take CPU tensors (gloo) or CUDA tensors (NCCL). The GPU forms make no host round
trip: no per-call check that the ranks agree (the batched engine checks that once, when it
is built), bad rows reported as statuses, one ``all_gather_into_tensor`` each, so a round
that calls them can be captured in a CUDA graph. :func:`shard_summary` is the GPU form's
per-rank step (testable without a process group).
"""

from __future__ import annotations

import numpy as np

from .core.api import topk_merge, topk_shard
from .core.types import TopK


def topk_logprobs_sharded(local_logits, k: int, vocab_offset: int, vocab: int, group=None) -> TopK:
    """The top-k log-probs of rows whose vocabulary is split over the ranks of `group`.

    Args:
        local_logits: this rank's ``[..., V_rank]`` logits (a CPU torch tensor, any floating
            dtype; the same leading shape on every rank), vocabulary entries
            ``vocab_offset .. vocab_offset + V_rank - 1``. The ranks' slices are disjoint
            and cover ``vocab`` entries.
        k: entries kept, at most every rank's ``V_rank``.
        vocab_offset: this rank's first global token id.
        vocab: the whole vocabulary's size.
        group: the process group (default: the world).

    Every rank gets the same result: :class:`kdtree.TopK` of torch tensors ``(logprobs
    float32 [..., k], ids int32 [..., k])``, equal to :func:`kdtree.topk_logprobs` on the
    gathered rows (see :func:`kdtree.topk_merge` for the log-probs' last bit). Two
    all-gathers: 15 integers a rank (status, offset, slice size, k, leading shape, vocab,
    the logits' width) that every rank checks (ranks are numbered within `group`), then the summary's :func:`summary_width` int32 words a row (the bits
    of :func:`shard_summary`'s layout: ``(2 k + 3) x 4`` bytes a row a rank for float32
    logits, ``(ceil(k / 2) + k + 3) x 4`` for float16 and bfloat16 ones, whose top-k values
    travel in their own 16 bits; the ranks' dtypes must agree).

    CUDA tensors (NCCL): the same ids and order, log-probs within one float32 ulp of the
    CPU form's; each rank's summary is :func:`shard_summary`, one all-gather moves them
    (:func:`summary_width` x 4 bytes a row a rank) and ``kdt_topk_merge_cuda`` merges them on every
    rank. No host synchronisation and no rank check: the ranks must pass the same k and
    leading shape, logits of one dtype and slices that tile ``[0, vocab)`` (a mismatch is
    undefined: NCCL may hang). The result's ``row_status`` is KDT_ERR_VALUE for a row with a NaN or +inf logit
    in any slice, or only -inf in all of them (its log-probs NaN, so a tree built from it
    fails its request).

    Raises:
        KdtreeTypeError / KdtreeError, on every rank alike (CPU): a rank's own arguments are
        wrong (not a CPU or CUDA tensor, not floating, no axis or more than 8 leading axes,
        an empty slice, k outside [1, 1024], vocab_offset or vocab not an int in range) or
        its :func:`kdtree.topk_shard` failed (that rank raises its own error, the others
        name it), k, the leading shape or the width of the logits'
        dtype (32 or 16 bits, float16 against bfloat16) differ between ranks, or the
        slices do not tile ``[0, vocab)``; then as :func:`kdtree.topk_merge`. CUDA: k outside
        ``[1, min(V_rank, 1024)]`` (raised before any collective).
    """
    import torch
    import torch.distributed as dist

    from . import _native as _lib

    if isinstance(local_logits, torch.Tensor) and local_logits.is_cuda:
        return _topk_logprobs_sharded_cuda(local_logits, k, vocab_offset, vocab, group)
    # Every rank joins both all-gathers whatever is wrong with its own arguments, so that a
    # failure on one rank becomes the same error on every rank instead of a wait for the
    # group's timeout: the checks and the rank's summary are made first, a failure is sent
    # as a status, and the failing rank raises its own error after the first all-gather.
    failure, shard, lead, half = None, None, (), 0
    try:
        from .core import checks

        if not isinstance(local_logits, torch.Tensor) or local_logits.device.type != "cpu":
            raise _lib.KdtreeTypeError(_lib.STATUS["KDT_ERR_INVALID_ARGUMENT"],
                                       "topk_logprobs_sharded takes a CPU or CUDA torch tensor, got "
                                       f"{type(local_logits).__name__} on "
                                       f"{getattr(local_logits, 'device', 'the host')}")
        if not local_logits.dtype.is_floating_point or local_logits.dim() < 1:
            raise checks.type_error(f"local_logits must be a floating tensor [..., V_rank], got {local_logits.dtype} "
                                    f"{tuple(local_logits.shape)}")
        lead = tuple(local_logits.shape[:-1])
        if len(lead) > _MAX_LEAD:
            raise checks.shape_error(f"local_logits has {len(lead)} leading axes; at most {_MAX_LEAD}")
        if local_logits.shape[-1] == 0:
            raise checks.shape_error(f"local_logits {tuple(local_logits.shape)} holds an empty vocabulary slice "
                                     "(V_rank = 0): every rank needs k entries at least")
        k = checks.int_scalar(k, "k", 1, 1024)
        vocab_offset = checks.int_scalar(vocab_offset, "vocab_offset", 0, 2**31 - 1)
        vocab = checks.int_scalar(vocab, "vocab", 1, 2**31)
        value_dtype = _value_dtype(local_logits.dtype)  # the summary's value width: the ranks must agree
        half = {torch.float16: 1, torch.bfloat16: 2}.get(value_dtype, 0)
        x = local_logits.detach()
        shard = topk_shard(x.float().numpy() if x.dtype != torch.float32 else x.numpy(), k, vocab_offset)
    except (_lib.KdtreeError, TypeError, ValueError) as exc:
        failure = exc
    world = dist.get_world_size(group)
    if failure is None:
        meta = [0, vocab_offset, int(local_logits.shape[-1]), k, len(lead)] + list(lead) + \
            [-1] * (_MAX_LEAD - len(lead)) + [vocab, half]
    else:
        meta = [getattr(failure, "status", 0) or _lib.STATUS["KDT_ERR_INVALID_ARGUMENT"]] + [0] * (6 + _MAX_LEAD)
    metas = [torch.empty(len(meta), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(metas, torch.tensor(meta, dtype=torch.int64), group=group)
    if failure is not None:
        raise failure
    problem = _check_ranks([m.tolist() for m in metas], vocab, dist.get_rank(group))
    if problem is not None:
        raise _lib.KdtreeError(_lib.STATUS["KDT_ERR_VALUE" if "failed" in problem else "KDT_ERR_SHAPE"], problem)
    # shard_summary's int32 layout: the logits (in 16 bits for 16-bit logits: they came from
    # there, so exactly), int32 ids, float32 max, float64 rest
    values = torch.from_numpy(np.ascontiguousarray(shard.logits, np.float32)).to(value_dtype).reshape(-1, k)
    words = _pack_values(values).numpy().reshape(lead + (_value_words(k, value_dtype),))
    packed = np.concatenate([words, np.ascontiguousarray(shard.ids, np.int32),
                             np.ascontiguousarray(shard.max[..., None], np.float32).view(np.int32),
                             np.ascontiguousarray(shard.sum_rest[..., None], np.float64).view(np.int32)], axis=-1)
    mine = torch.from_numpy(np.ascontiguousarray(packed))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    fields = unpack_summary(torch.stack(gathered), k, value_dtype)  # [T, ..., width] -> four fields
    merged = topk_merge(*(f.numpy() for f in fields), vocab)
    status = torch.zeros(lead if lead else (1,), dtype=torch.int32)
    return TopK(torch.from_numpy(merged.logprobs), torch.from_numpy(merged.ids), status)


def target_tokens_sharded(local_logits, vocab_offset: int, vocab: int, *, temperature=None, seed: int = 0,
                          offset: int = 0, nodes=None, group=None):
    """The target's token at every tree node from vocabulary-sharded target logits, equal to
    the unsharded verification's choice, on every rank.

    Args:
        local_logits: this rank's ``[B, N+1, V_rank]`` target logits of the verify forward
            (a CPU torch tensor, any floating dtype, the same shape on every rank but the
            last axis), vocabulary entries ``vocab_offset .. vocab_offset + V_rank - 1``;
            the ranks' slices are disjoint and cover ``vocab`` entries.
        temperature: None or 0: greedy, the argmax (ties: lower global id), as
            :func:`kdtree.verify_greedy_from_logits`; else a float32 >= 1e-6: the Gumbel-max
            draw of :func:`kdtree.verify_sample_from_logits` (``seed``, ``offset``: its
            keys; request b is row b, node i row i, or ``nodes[b, i]`` when given: ints
            ``[B, N+1]`` in [0, 2^32)), whose noise depends on the global token id alone, so
            each rank's best of its slice merges to the same draw. Per request: a
            ``[B]`` sequence or array of temperatures (0: that request is greedy), with
            ``seed`` and ``offset`` ints or ``[B]`` ints in [0, 2^64), as
            :func:`kdtree.verify_sample_from_logits` takes them (without top_p / top_k:
            their cuts are not built for sharded rows).

    Returns:
        torch int32 ``[B, N+1]``, the same on every rank: the token, or -1 for a row with
        no choice (a NaN logit; sampled: also +inf, or only -inf). Pass it to
        :func:`kdtree.verify_greedy` with the same ``stop_tokens`` / ``max_commit``: the
        acceptance equals the unsharded ``verify_*_from_logits`` call's (a -1 at a visited
        node is that call's error). One all-gather of 15 integers a rank (checked on
        every rank as :func:`topk_logprobs_sharded` does), then one of four float64 a row
        (``B (N+1) 32`` bytes a rank, against ``2 V`` bytes a row of bf16 logits).

    CUDA tensors (NCCL): greedy (temperature None or 0): each rank's best of its slice
    (``torch.max``: the first maximum, the lower id; a NaN marks the row), one all-gather
    of three float64 a row; otherwise ``kdt_choices_shard_cuda`` on each slice (the draw
    of ``kdt_verify_sample_batch_cuda`` for the global token ids, bit for bit; temperature,
    seed and offset scalars or ``[B]`` arrays, device arrays included, so that a CUDA graph
    can advance the offsets), one all-gather of four float64 a row; then the merge on the
    device. No host synchronisation and no rank check (as :func:`topk_logprobs_sharded`'s
    GPU form); a bad temperature makes its request's rows -1.

    Raises:
        TypeError: not a CPU or CUDA tensor. KdtreeError on every rank alike: shapes that differ,
        slices that do not tile ``[0, vocab)``, a temperature (any request's) that is
        not 0 and below 1e-6 or not finite, a seed or offset out of range, per-request
        values of another length than B.
    """
    import torch
    import torch.distributed as dist

    from . import _native as _lib
    from .core import checks, sampling

    if isinstance(local_logits, torch.Tensor) and local_logits.is_cuda:
        if temperature is None or (np.ndim(temperature) == 0 and not isinstance(temperature, torch.Tensor)
                                   and float(temperature) == 0.0):
            return _target_tokens_sharded_cuda(local_logits, vocab_offset, None, group)
        return _sampled_tokens_sharded_cuda(local_logits, vocab_offset, temperature, seed, offset, nodes, group)
    if not isinstance(local_logits, torch.Tensor) or local_logits.device.type != "cpu":
        raise TypeError("target_tokens_sharded takes a CPU or CUDA torch tensor, got "
                        f"{type(local_logits).__name__} on {getattr(local_logits, 'device', 'the host')}")
    failure = None
    try:  # a rank's own bad argument is sent as a status (every rank raises), not raised alone
        if not local_logits.dtype.is_floating_point:
            raise checks.type_error(f"local_logits must be a floating tensor, got {local_logits.dtype}")
        vocab_offset = checks.int_scalar(vocab_offset, "vocab_offset", 0, 2**31 - 1)
        vocab = checks.int_scalar(vocab, "vocab", 1, 2**31)
    except (_lib.KdtreeError, TypeError, ValueError) as exc:
        failure = exc
        vocab_offset, vocab = 0, 1
    x = local_logits.detach().float().numpy() if local_logits.dtype.is_floating_point else np.zeros((0,), np.float32)
    if failure is None and (x.ndim != 3 or x.shape[-1] < 1):
        failure = checks.shape_error(f"local_logits must be [B, N+1, V_rank >= 1], got {tuple(x.shape)}")
    batch = int(x.shape[0]) if x.ndim == 3 else 0
    temps, seeds, offsets = np.zeros(batch, np.float32), np.zeros(batch, np.uint64), np.zeros(batch, np.uint64)
    if failure is None:
        try:
            temps, seeds, offsets = _per_request(temperature, seed, offset, batch)
        except _lib.KdtreeError as exc:
            failure = exc
    sampled = temps != 0
    lead = tuple(x.shape[:-1]) if failure is None else ()
    world = dist.get_world_size(group)
    keys = None
    if failure is None:
        try:
            keys = _node_keys(nodes, x.shape[0], x.shape[1])
        except _lib.KdtreeError as exc:
            failure = exc
    settings = _settings_digest(temps, seeds, offsets, keys) if failure is None else 0
    meta = torch.tensor([getattr(failure, "status", 1) if failure is not None else 0, int(vocab_offset),
                         int(x.shape[-1]) if x.ndim else 0, 0, len(lead)] + list(lead) + [-1] * (_MAX_LEAD - len(lead))
                        + [int(vocab), settings], dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    problem = _check_ranks([m.tolist() for m in metas], vocab, dist.get_rank(group), "target_tokens_sharded")
    if failure is not None:
        raise failure
    if problem is not None:
        raise _lib.KdtreeError(_lib.STATUS["KDT_ERR_VALUE" if "failed" in problem else "KDT_ERR_SHAPE"], problem)
    batch, rows, width = x.shape
    packed = np.zeros((batch, rows, 4), np.float64)  # best score, its global id, no choice, any finite
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for b in range(batch):
            for i in range(rows):
                row = x[b, i]
                if sampled[b]:
                    bad = bool(np.isnan(row).any() or np.isposinf(row).any())
                    score = row / temps[b] - sampling._gumbel_log_t(width, int(seeds[b]), int(offsets[b]), b,
                                                                    int(keys[b, i]), start=int(vocab_offset))
                else:
                    bad = bool(np.isnan(row).any())
                    score = row
                j = int(np.argmax(score))  # first maximum: the lower id
                packed[b, i] = (score[j], vocab_offset + j, bad, bool((row > -np.inf).any()))
    mine = torch.from_numpy(packed)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    parts = torch.stack(gathered).numpy()  # [T, B, N+1, 4]
    score, ids = parts[..., 0], parts[..., 1]
    best = score.max(axis=0)
    # The lowest id among the ranks at the best score (ties across slices: lower global id).
    at_best = np.where(score == best[None], ids, np.inf).min(axis=0)
    none = parts[..., 2].any(axis=0) | (sampled[:, None] & ~parts[..., 3].any(axis=0))
    tokens = np.where(none, -1, at_best).astype(np.int32)
    return torch.from_numpy(tokens)


_MAX_LEAD = 8  # leading axes of the logits the rank check carries

# CUDA summaries take the rest from kdt_topk_shard_stats_cuda (one kernel, two reads of the
# logits) instead of torch's float64 passes (a float64 copy of the logits, then exp, scatter
# and sum): 121 against 577 us for a summary at B = 64, L = 16, K = 64 of a 20,480-entry
# bf16 slice (H100, 2026-12-05). False takes torch's passes (tests compare the two).
_FUSED_STATS = True


def shard_summary(local_logits, k: int, vocab_offset: int):
    """One rank's summary of its vocabulary slice on the GPU, packed for the all-gather.

    Args:
        local_logits: CUDA torch tensor ``[..., V_rank]`` (float32, float16 or bfloat16;
            a CPU tensor gives the same values, for tests).
        k: 1 .. min(V_rank, 1024).
        vocab_offset: the slice's first global token id.

    Returns:
        int32 ``[rows, summary_width(k, dtype)]`` (rows = the leading axes' product; 4 bytes
        a word), :func:`kdtree.topk_shard`'s four fields (the first three bit for bit, the
        rest within float64 rounding: on the GPU kdt_topk_shard_stats_cuda sums it in
        another order than the CPU): the slice's k largest logits best first (ties: lower
        id; the selection of :func:`kdtree.topk_logprobs`) in ``ceil(k / 2)`` words for float16 and bfloat16 logits (their own 16-bit values,
        two a word, the first in the low half, a zero half after an odd k; exact, since they
        are the inputs) or k words for float32 (the float32 bits), their global ids (k
        int32), the slice's max (float32 bits) and the rest of its sum of exponentials
        (``exp(logit - max)`` over every entry but the first at the max, float64 bits in two
        int32, low word first). :func:`unpack_summary` reads them back given the same k and
        dtype. A row with a NaN or +inf logit gets a NaN rest (which
        :func:`kdtree.topk_merge` rejects); a row of only -inf has max -inf and
        rest 0, as the CPU summary.

    Raises:
        KdtreeTypeError: not a torch tensor of one of those dtypes. KdtreeError: k out of
            range, or vocab_offset outside ``[0, 2^31 - V_rank]``; as
            :func:`kdtree.topk_logprobs`.
    """
    import torch

    from .core import checks
    from .core.api import topk_logprobs

    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() < 1:
        raise checks.type_error(f"local_logits must be a torch tensor [..., V_rank], got "
                                f"{type(local_logits).__name__} {tuple(getattr(local_logits, 'shape', ()))}")
    if local_logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise checks.type_error(f"local_logits must be float32, float16 or bfloat16, got {local_logits.dtype}")
    vr = int(local_logits.shape[-1])
    k = checks.int_scalar(k, "k", 1, min(vr, 1024))
    vocab_offset = checks.int_scalar(vocab_offset, "vocab_offset (the slice's ids must fit int32)", 0, 2**31 - vr)
    flat = local_logits.detach().reshape(-1, vr)
    # (on the CPU the top-k reads a numpy view, which has no bfloat16: float32 holds its values)
    src = flat.float() if not flat.is_cuda and flat.dtype == torch.bfloat16 else flat
    top = topk_logprobs(src, k, errors="status")  # (numpy arrays for a CPU tensor)
    idx = torch.as_tensor(top.ids, device=flat.device).long()
    kept = flat.gather(1, idx)  # the values the summary keeps, in the logits' dtype
    mx = kept[:, 0].float()
    if flat.is_cuda and _FUSED_STATS:
        from .core.cuda import topk_shard_stats

        rest = topk_shard_stats(flat)[1]
    else:
        terms = torch.exp(flat.double() - mx.double()[:, None])
        terms.scatter_(1, idx[:, :1], 0.0)  # the first entry at the max: its term 1 is not part of the rest
        # from the logits themselves (a failed top-k's fallback ids say nothing of the row)
        only_neg_inf = (flat == float("-inf")).all(1)
        bad = (torch.isnan(flat) | (flat == float("inf"))).any(1)
        rest = torch.where(only_neg_inf, torch.zeros_like(mx, dtype=torch.float64), terms.sum(1))
        rest = torch.where(bad, torch.full_like(rest, float("nan")), rest)
    return torch.cat([_pack_values(kept), (idx + int(vocab_offset)).to(torch.int32),
                      mx.contiguous()[:, None].view(torch.int32), rest.contiguous()[:, None].view(torch.int32)], 1)


def _value_dtype(dtype):
    """The dtype a summary keeps the top-k values in: float16 and bfloat16 logits' own,
    float32 for any other."""
    import torch

    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _value_words(k: int, dtype) -> int:
    return (k + 1) // 2 if _value_dtype(dtype).itemsize == 2 else k


def _pack_values(vals):
    """[rows, k] float32 / float16 / bfloat16 values as int32 words [rows, _value_words]:
    float32 bits, or two 16-bit values a word (little-endian: the first in the low half; a
    zero half after an odd k)."""
    import torch

    if vals.dtype.itemsize == 2 and vals.shape[1] % 2:
        vals = torch.nn.functional.pad(vals, (0, 1))  # a zero half
    return vals.contiguous().view(torch.int32)


def summary_width(k: int, dtype) -> int:
    """int32 words a row of :func:`shard_summary`'s packed summary of top-k size k from
    logits of torch dtype `dtype`: ``ceil(k / 2) + k + 3`` for float16 and bfloat16 (the k
    values in their own 16 bits), ``2 k + 3`` otherwise (float32 values). At k = 64: 99 words
    (396 bytes) against 131 (524 bytes).

    Raises:
        KdtreeTypeError: k not an int, dtype not a torch dtype. KdtreeError: k outside
            [1, 1024].
    """
    import torch

    from .core import checks

    k = checks.int_scalar(k, "k", 1, 1024)
    if not isinstance(dtype, torch.dtype):
        raise checks.type_error(f"dtype must be a torch dtype (the logits'), got {dtype!r}")
    return _value_words(k, dtype) + k + 3


def unpack_summary(packed, k: int, dtype=None):
    """The four fields of packed summaries (:func:`shard_summary`'s int32 ``[..., width]``,
    any leading axes, e.g. ``[T, rows]`` after the all-gather): ``(logits float32 [..., k],
    ids int32 [..., k], max float32 [...], rest float64 [...])``, the arguments of
    :func:`kdtree.topk_merge`, as contiguous tensors on ``packed``'s device.

    Args:
        packed: int32 torch tensor ``[..., summary_width(k, dtype)]``.
        k: the top-k size the summaries were made with.
        dtype: the torch dtype of the logits they were made from (None: float32); float16
            and bfloat16 summaries hold their values in 16 bits.

    Raises:
        KdtreeTypeError: ``packed`` is not an int32 torch tensor with at least one axis; k
            not an int; dtype not a torch dtype. KdtreeError: k outside [1, 1024], a last
            axis other than ``summary_width(k, dtype)``.
    """
    import torch

    from .core import checks

    if not isinstance(packed, torch.Tensor) or packed.dim() < 1:
        raise checks.type_error(f"packed must be a torch tensor [..., width], got {type(packed).__name__} "
                                f"{tuple(getattr(packed, 'shape', ()))}")
    k = checks.int_scalar(k, "k", 1, 1024)
    if dtype is None:
        dtype = torch.float32
    if not isinstance(dtype, torch.dtype):
        raise checks.type_error(f"dtype must be a torch dtype (the logits'), got {dtype!r}")
    if packed.dtype != torch.int32:
        raise checks.type_error(f"packed summaries must be torch.int32, got {packed.dtype}")
    words = _value_words(k, dtype)
    width = words + k + 3
    if packed.shape[-1] != width:
        raise checks.shape_error(f"packed summaries of k = {k} from {dtype} logits must be [..., {width}] "
                                 f"(summary_width), got {tuple(packed.shape)}")
    value_dtype = _value_dtype(dtype)
    logits = packed[..., :words].contiguous().view(value_dtype)[..., :k].float().contiguous()
    ids = packed[..., words:words + k].contiguous()
    mx = packed[..., words + k:words + k + 1].contiguous().view(torch.float32)[..., 0]
    # a copy of its own: a contiguous slice keeps its odd word offset, which a float64 view refuses
    rest = packed[..., words + k + 1:].clone(memory_format=torch.contiguous_format).view(torch.float64)[..., 0]
    return logits, ids, mx, rest


def _all_gather(packed, world: int, group):
    """[world, *packed.shape]: every rank's ``packed``, by one all_gather_into_tensor into
    the concatenated layout (the one every backend takes), viewed per rank."""
    import torch
    import torch.distributed as dist

    out = torch.empty((world * packed.shape[0],) + tuple(packed.shape[1:]), dtype=packed.dtype, device=packed.device)
    dist.all_gather_into_tensor(out, packed.contiguous(), group=group)
    return out.view((world,) + tuple(packed.shape))


def _topk_logprobs_sharded_cuda(x, k, vocab_offset, vocab, group):
    import torch.distributed as dist

    from .core.api import topk_merge

    lead = tuple(x.shape[:-1])
    packed = shard_summary(x, k, vocab_offset)
    world = dist.get_world_size(group)
    gathered = _all_gather(packed, world, group)
    merged = topk_merge(*unpack_summary(gathered, k, x.dtype), vocab, errors="status")
    return TopK(merged.logprobs.reshape(lead + (k,)), merged.ids.reshape(lead + (k,)),
                merged.row_status.reshape(lead if lead else (1,)))


def _sampled_tokens_sharded_cuda(x, vocab_offset, temperature, seed, offset, nodes, group):
    import torch
    import torch.distributed as dist

    from .core import checks
    from .core import cuda as gpu

    if x.dim() != 3 or x.shape[-1] < 1:
        raise checks.shape_error(f"local_logits must be [B, N+1, V_rank >= 1], got {tuple(x.shape)}")
    batch = int(x.shape[0])

    def per_request(value, dtype):
        if isinstance(value, torch.Tensor):
            value = value.to(device=x.device, dtype=dtype) if value.dtype != dtype else value.to(x.device)
            return value.reshape(-1).expand(batch).contiguous() if value.numel() == 1 else value.contiguous()
        if np.ndim(value) == 0:
            return torch.full((batch,), value if dtype != torch.int64 else int(np.uint64(value).astype(np.int64)),
                              dtype=dtype, device=x.device)
        host = np.asarray(value)
        host = host.astype(np.uint64).view(np.int64) if dtype == torch.int64 else host.astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(host)).to(x.device)

    temps = per_request(temperature, torch.float32)
    settings = {"temperature": temps, "seed": per_request(seed, torch.int64),
                "offset": per_request(offset, torch.int64)}
    if nodes is not None and not isinstance(nodes, torch.Tensor):
        nodes = torch.from_numpy(np.ascontiguousarray(nodes, np.int32)).to(x.device)
    packed = gpu.choices_shard(x.detach(), vocab_offset, settings, nodes=nodes)
    gathered = _all_gather(packed, dist.get_world_size(group), group)
    score, ids, bad, some = gathered[..., 0], gathered[..., 1], gathered[..., 2], gathered[..., 3]
    top = score.amax(0)
    lowest = torch.where(score == top[None], ids, torch.full_like(ids, float("inf"))).amin(0)
    sampled = (temps != 0)[:, None]
    none = (bad.amax(0) > 0) | (sampled & (some.amax(0) == 0))
    return torch.where(none, torch.full_like(lowest, -1), lowest).to(torch.int32)


def _target_tokens_sharded_cuda(x, vocab_offset, temperature, group):
    import torch
    import torch.distributed as dist

    if x.dim() != 3 or x.shape[-1] < 1:
        from .core import checks

        raise checks.shape_error(f"local_logits must be [B, N+1, V_rank >= 1], got {tuple(x.shape)}")
    xf = x.detach().float()
    best, at = xf.max(-1)  # the first maximum: the lower id (NaN propagates; flagged below)
    packed = torch.stack([best.double(), (at + int(vocab_offset)).double(), torch.isnan(xf).any(-1).double()], -1)
    world = dist.get_world_size(group)
    gathered = _all_gather(packed, world, group)
    score, ids, nan = gathered[..., 0], gathered[..., 1], gathered[..., 2]
    top = score.amax(0)
    lowest = torch.where(score == top[None], ids, torch.full_like(ids, float("inf"))).amin(0)
    none = nan.amax(0) > 0
    return torch.where(none, torch.full_like(lowest, -1), lowest).to(torch.int32)


def _per_request(temperature, seed, offset, batch: int):
    """(float32 temperatures, uint64 seeds, uint64 offsets), each ``[batch]``, from
    scalars or per-request sequences; KdtreeError naming the request of a bad value."""
    from .core import checks

    def spread(value, name, default):
        if value is None:
            value = default
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        if np.ndim(value) == 0:
            return [value] * batch
        vals = list(np.asarray(value).reshape(-1)) if not isinstance(value, (list, tuple)) else list(value)
        if np.ndim(value) != 1 or len(vals) != batch:
            raise checks.shape_error(f"{name} must be a scalar or [B = {batch}] values, got shape {np.shape(value)}")
        return vals

    temps = np.zeros(batch, np.float32)
    for b, t in enumerate(spread(temperature, "temperature", 0.0)):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)):
            raise checks.type_error(f"temperature of request {b} must be a real number, got {t!r}")
        t32 = np.float32(t)
        if t32 != 0 and (not np.isfinite(t32) or not t32 >= np.float32(1e-6)):
            raise checks.value_error(f"temperature of request {b} must be 0, or finite and >= 1e-6, got {t!r}")
        temps[b] = t32
    seeds = np.array([checks.int_scalar(v, f"seed of request {b}", 0, 2**64 - 1)
                      for b, v in enumerate(spread(seed, "seed", 0))], np.uint64).reshape(batch)
    offsets = np.array([checks.int_scalar(v, f"offset of request {b}", 0, 2**64 - 1)
                        for b, v in enumerate(spread(offset, "offset", 0))], np.uint64).reshape(batch)
    return temps, seeds, offsets


def _node_keys(nodes, batch: int, rows: int) -> np.ndarray:
    """The Philox node key of every row: ``nodes`` (ints [B, N+1] in [0, 2^32)) or the row
    index; KdtreeError naming the problem."""
    from .core import checks

    if nodes is None:
        return np.broadcast_to(np.arange(rows, dtype=np.int64), (batch, rows))
    if hasattr(nodes, "detach"):
        nodes = nodes.detach().cpu().numpy()
    keys = checks.int_array(nodes, "nodes")
    if keys.shape != (batch, rows):
        raise checks.shape_error(f"nodes must have shape ({batch}, {rows}), got {keys.shape}")
    if keys.size and (keys.min() < 0 or keys.max() >= 2**32):
        raise checks.range_error(f"nodes must be in [0, 2^32), got values in [{keys.min()}, {keys.max()}]")
    return keys.astype(np.int64)


def _settings_digest(temps, seeds, offsets, keys) -> int:
    """A 62-bit digest of the sampling settings and node keys, which every rank must share."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for a in (np.asarray(temps, np.float32), np.asarray(seeds, np.uint64), np.asarray(offsets, np.uint64),
              np.ascontiguousarray(keys, np.int64)):
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def _check_ranks(metas: list[list[int]], vocab: int, me: int, step: str = "topk_shard") -> str | None:
    """What is wrong with the ranks' (status, offset, size, k, ndim, lead... (8), vocab,
    settings digest or, for topk_shard, the logits' width code) rows, the same text on every rank, or None. `step`: what a failed rank
    was doing (topk_shard names k)."""
    failed = [r for r, m in enumerate(metas) if m[0] != 0]
    if failed:
        others = [r for r in failed if r != me]
        return f"rank(s) {others or failed} failed in {step} (status {metas[failed[0]][0]}); see that rank's error"
    first = metas[0]
    lead_end = 5 + _MAX_LEAD
    for r, m in enumerate(metas):
        if m[lead_end] != first[lead_end]:
            return f"rank {r} passes vocab = {m[lead_end]}, rank 0 {first[lead_end]}: every rank needs the same"
    vocab = first[lead_end]
    for r, m in enumerate(metas):
        if m[3] != first[3] or m[4:lead_end] != first[4:lead_end]:
            if step != "topk_shard":
                return (f"rank {r} has leading shape {m[5:5 + m[4]]}, rank 0 {first[5:5 + first[4]]}: every rank "
                        "needs the same")
            return (f"rank {r} has k {m[3]} and leading shape {m[5:5 + m[4]]}, rank 0 k {first[3]} and "
                    f"{first[5:5 + first[4]]}: every rank needs the same")
    for r, m in enumerate(metas):
        if m[lead_end + 1] != first[lead_end + 1] and step == "topk_shard":
            kinds = {0: "float32 (or another 32- or 64-bit dtype)", 1: "float16", 2: "bfloat16"}
            return (f"rank {r} passes {kinds[m[lead_end + 1]]} logits, rank 0 {kinds[first[lead_end + 1]]}: the "
                    "summaries' widths differ, every rank needs the same dtype")
        if m[lead_end + 1] != first[lead_end + 1]:
            return (f"rank {r} passes other sampling settings than rank 0 (temperature, seed, offset or nodes): "
                    "every rank needs the same")
    spans = sorted((m[1], m[1] + m[2], r) for r, m in enumerate(metas))
    end = 0
    for lo, hi, r in spans:
        if lo != end:
            return (f"the ranks' vocabulary slices do not tile [0, {vocab}): rank {r} starts at {lo}, "
                    f"{'overlapping' if lo < end else 'leaving a gap after'} {end}")
        end = hi
    if end != vocab:
        return f"the ranks' vocabulary slices end at {end}, not at vocab = {vocab}"
    return None
