"""kdtree over torch.distributed: the top-k log-probs of a vocabulary-sharded LM head.

Under tensor parallelism each rank holds the drafter's logits for a slice of the
vocabulary. :func:`topk_logprobs_sharded` gives every rank the top-k log-probs of the whole
rows while gathering only each rank's :func:`kdtree.topk_shard` summary (k logits, k ids,
max and sum of exponentials a row) instead of the logits.
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
    gathered rows (see :func:`kdtree.topk_merge` for the log-probs' last bit). One
    all-gather of ``(2 k + 2)`` float64 values a row from each rank (ids and float32
    logits are exact in float64).

    Raises:
        TypeError: a tensor that is not on the CPU. KdtreeError: as :func:`kdtree.topk_shard`
        and :func:`kdtree.topk_merge`. The leading shape and k must be the same on every
        rank: the all-gather takes equal sizes (a mismatch is the backend's error).
    """
    import torch
    import torch.distributed as dist

    if not isinstance(local_logits, torch.Tensor) or local_logits.device.type != "cpu":
        raise TypeError("topk_logprobs_sharded takes a CPU torch tensor (the GPU form is not built yet), got "
                        f"{type(local_logits).__name__} on {getattr(local_logits, 'device', 'the host')}")
    x = local_logits.detach()
    if x.dtype != torch.float32:
        x = x.float()
    shard = topk_shard(x.numpy(), k, vocab_offset)
    lead = shard.max.shape
    packed = np.concatenate([shard.logits.astype(np.float64), shard.ids.astype(np.float64),
                             shard.max[..., None].astype(np.float64), shard.sumexp[..., None]], axis=-1)
    mine = torch.from_numpy(np.ascontiguousarray(packed))
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    stacked = torch.stack(gathered).numpy()  # [T, ..., 2k + 2]
    merged = topk_merge(stacked[..., :k].astype(np.float32), stacked[..., k:2 * k].astype(np.int32),
                        stacked[..., 2 * k].astype(np.float32), stacked[..., 2 * k + 1], vocab)
    status = torch.zeros(lead if lead else (1,), dtype=torch.int32)
    return TopK(torch.from_numpy(merged.logprobs), torch.from_numpy(merged.ids), status)
