"""Pure Python/NumPy reference implementation of the DDTree rule: the parity oracle.

Written straight from the spec (``ddtree-tree-build.md``) with :mod:`heapq` and Python
floats (IEEE float64), favouring obviousness over speed. It imports without the native
library. Every native builder must match it bit for bit.

Functions mirror the public API of :mod:`kdtree` (same arguments, same result types) and
raise :class:`ValueError` where the native library returns an error status.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

import numpy as np

from .types import Acceptance, TreeBatch

__all__ = ["build_tree", "build_trees", "verify_greedy", "topk_logprobs"]


# A log-prob may exceed 0 by float32 rounding of a probability near 1, up to 32 float32
# epsilons (3.8e-6); more is a probability or a raw logit (the library's rule, kdtree.h).
LOGPROB_SLACK = 32.0 * float(np.finfo(np.float32).eps)


def _validate(lp: np.ndarray, ids: np.ndarray, width: int, vocab_size: int | None, b: int) -> None:
    """Spec "Degenerate and invalid inputs", on the used part ``[L, width]``. Rows are
    checked in depth order; within a row, log-probs (NaN, +inf, order, > LOGPROB_SLACK)
    before ids (range, duplicates); the first bad entry is reported (the library's order
    too)."""
    for d in range(lp.shape[0]):
        row = lp[d, :width].astype(np.float64)
        bad = np.isnan(row) | np.isposinf(row)
        bad[1:] |= row[1:] > row[:-1]
        if bad.any():
            r = int(np.argmax(bad))
            v = row[r]
            what = "NaN" if math.isnan(v) else "+inf" if v == math.inf else "unsorted"
            raise ValueError(f"request {b}, depth {d + 1}, rank {r}: {what} log-probability")
        if row.size and row[0] > LOGPROB_SLACK:
            raise ValueError(f"request {b}, depth {d + 1}, rank 0: log-probability {row[0]:.9g} > 0 "
                             "(a probability or a raw logit, not a log-probability?)")
        seen: set[int] = set()
        for r, t in enumerate(ids[d, :width].tolist()):
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"request {b}, depth {d + 1}, rank {r}: token id {t} out of range")
            if t in seen:
                raise ValueError(f"request {b}, depth {d + 1}, rank {r}: duplicate token id {t} in row")
            seen.add(t)


def build_tree(lp: np.ndarray, ids: np.ndarray, budget: int) -> dict:
    """One tree by the spec's best-first expansion, unpadded.

    Args:
        lp: float32 ``[L, K]`` log-probs, rows sorted non-increasing.
        ids: int ``[L, K]`` token ids.
        budget: N >= 0.

    Returns:
        dict with lists ``tokens``, ``depths`` (1-based), ``parents`` (node indices, root 0),
        ``logw`` (Python floats), ``ranks`` (rank paths), one entry per emitted node in pop
        order (the root is not included).
    """
    depth, width = lp.shape
    k_eff = min(width, budget)
    nodes: dict[str, list] = {"tokens": [], "depths": [], "parents": [], "logw": [], "ranks": []}
    if budget <= 0 or depth == 0 or k_eff == 0:
        return nodes
    heap: list[tuple[float, tuple[int, ...], int, int]] = []
    first = float(lp[0, 0])
    if first != -math.inf:
        heap.append((-first, (0,), 0, 1))  # (-logw, ranks, parent, depth)
    while heap and len(nodes["tokens"]) < budget:
        neg_logw, ranks, parent, d = heapq.heappop(heap)
        logw = -neg_logw
        rank = ranks[-1]
        nodes["tokens"].append(int(ids[d - 1, rank]))
        nodes["depths"].append(d)
        nodes["parents"].append(parent)
        nodes["logw"].append(logw)
        nodes["ranks"].append(ranks)
        me = len(nodes["tokens"])
        if rank + 1 < k_eff:
            w = (logw - float(lp[d - 1, rank])) + float(lp[d - 1, rank + 1])
            if w != -math.inf:
                heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, d))
        if d < depth:
            w = logw + float(lp[d, 0])
            if w != -math.inf:
                heapq.heappush(heap, (-w, ranks + (0,), me, d + 1))
    return nodes


def build_trees(
    logprobs,
    token_ids,
    budget: int,
    *,
    root_tokens=None,
    root_positions=None,
    vocab_size: int | None = None,
    pad_token: int = -1,
    request_budgets=None,
    request_depths=None,
) -> TreeBatch:
    """Reference for :func:`kdtree.build_trees` (same arguments and result): request b is
    built alone from its first ``request_depths[b]`` rows with budget ``request_budgets[b]``."""
    lp = np.asarray(logprobs)
    ids = np.asarray(token_ids)
    if lp.ndim == 2:
        lp, ids = lp[None], ids[None]
    if lp.ndim != 3 or lp.shape != ids.shape:
        raise ValueError(f"logprobs {lp.shape} and token_ids {ids.shape} must both be [B, L, K]")
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"budget must be an int, got {budget!r}")
    budget = int(budget)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if lp.dtype.kind != "f" and lp.dtype.name != "bfloat16":
        raise TypeError(f"logprobs must be a floating array, got dtype {lp.dtype}")
    with np.errstate(over="ignore"):  # reported just below
        lp32 = lp.astype(np.float32)
    if (np.isfinite(lp) & ~np.isfinite(lp32)).any():
        raise ValueError("logprobs has finite values outside float32 range")
    lp = lp32
    batch, depth, width = lp.shape
    n_rows = budget + 1
    words = (n_rows + 31) // 32
    roots = np.full(batch, pad_token, np.int64) if root_tokens is None else np.asarray(root_tokens)
    pos0 = np.zeros(batch, np.int64) if root_positions is None else np.asarray(root_positions)
    budgets = [budget] * batch if request_budgets is None else [int(x) for x in np.asarray(request_budgets)]
    depths = [depth] * batch if request_depths is None else [int(x) for x in np.asarray(request_depths)]
    if len(budgets) != batch or len(depths) != batch:
        raise ValueError(f"request_budgets and request_depths must have {batch} entries")
    for b in range(batch):
        if not 0 <= budgets[b] <= budget:
            raise ValueError(f"request {b}: budget {budgets[b]} outside [0, {budget}]")
        if not 0 <= depths[b] <= depth:
            raise ValueError(f"request {b}: depth {depths[b]} outside [0, {depth}]")
        p0 = int(pos0[b])
        if p0 < 0 or p0 > 2**63 - 1 - depths[b]:
            raise ValueError(f"request {b}: root position {p0} outside [0, INT64_MAX - depth]")
        if root_tokens is not None:
            r0 = int(roots[b])
            if r0 < 0 or r0 > 2**31 - 1 or (vocab_size and r0 >= vocab_size):
                raise ValueError(f"request {b}: root token {r0} out of range")
        _validate(lp[b, : depths[b]], ids[b, : depths[b]], min(width, budgets[b]), vocab_size, b)

    out = TreeBatch(
        num_nodes=np.zeros(batch, np.int32),
        tokens=np.full((batch, n_rows), pad_token, np.int32),
        depths=np.zeros((batch, n_rows), np.int32),
        parents=np.full((batch, n_rows), -1, np.int32),
        logw=np.full((batch, n_rows), -np.inf, np.float64),
        positions=np.repeat(pos0.astype(np.int64)[:, None], n_rows, axis=1),
        visibility=np.zeros((batch, n_rows, n_rows), bool),
        visibility_bits=np.zeros((batch, n_rows, words), np.uint32),
        first_child=np.full((batch, n_rows), -1, np.int32),
        next_sibling=np.full((batch, n_rows), -1, np.int32),
        budget=int(budget),
        depth=int(depth),
    )
    for b in range(batch):
        tree = build_tree(lp[b, : depths[b]], ids[b, : depths[b]], budgets[b])
        n = len(tree["tokens"])
        out.num_nodes[b] = n
        out.tokens[b, 0] = roots[b]
        out.logw[b, 0] = 0.0
        for i in range(1, n + 1):
            out.tokens[b, i] = tree["tokens"][i - 1]
            out.depths[b, i] = tree["depths"][i - 1]
            out.parents[b, i] = tree["parents"][i - 1]
            out.logw[b, i] = tree["logw"][i - 1]
            out.positions[b, i] = pos0[b] + tree["depths"][i - 1]
        # Visibility: each row is itself plus its ancestors (a node's row is its parent's
        # row plus its own column); padding rows are self-only.
        vis = out.visibility[b]
        vis[np.arange(n_rows), np.arange(n_rows)] = True
        for i in range(1, n + 1):
            vis[i] |= vis[out.parents[b, i]]
        packed = np.packbits(vis, axis=1, bitorder="little")
        packed = np.pad(packed, ((0, 0), (0, words * 4 - packed.shape[1])))
        out.visibility_bits[b] = packed.view("<u4")
        # Children in increasing node number.
        last: dict[int, int] = {}
        for i in range(1, n + 1):
            p = int(out.parents[b, i])
            if p in last:
                out.next_sibling[b, last[p]] = i
            else:
                out.first_child[b, p] = i
            last[p] = i
    return out


def verify_greedy(
    trees: TreeBatch,
    target_tokens,
    *,
    stop_tokens: Iterable[int] = (),
    max_commit=None,
    stop_sequences=None,
    stop_history=None,
) -> Acceptance:
    """Reference for :func:`kdtree.verify_greedy` (spec: "Verification").

    Walks from the root while the target's token at the current node is the token of one
    of its children; a stop token, or an accepted token that makes the committed stream
    (``stop_history[b]``, then the accepted tokens) end with one of ``stop_sequences``,
    ends the walk with no bonus; ``max_commit`` caps the committed tokens (accepted +
    bonus). Without ``stop_history`` the stream starts with the root token (the last
    committed token the root stands for).
    """
    target = np.asarray(target_tokens)
    batch = trees.batch
    stops = {int(t) for t in stop_tokens}
    sequences = [tuple(int(t) for t in seq) for seq in (stop_sequences or [])]
    if stop_history is None and sequences:
        stop_history = np.asarray(trees.tokens)[:, :1]
    history = None if stop_history is None else np.asarray(stop_history).reshape(batch, -1)
    caps: Sequence[int | None]
    if max_commit is None:
        caps = [None] * batch
    else:
        caps = [int(c) for c in np.broadcast_to(np.asarray(max_commit), (batch,))]
        if any(c < 0 for c in caps):
            raise ValueError(f"max_commit must be >= 0, got {caps}")
    width = min(int(trees.depth), int(trees.budget)) + 1  # the longest path a tree can hold, + root
    accepted = np.full((batch, width), -1, np.int32)
    length = np.zeros(batch, np.int32)
    bonus = np.full(batch, -1, np.int32)
    for b in range(batch):
        n = int(trees.num_nodes[b])
        children: dict[int, list[int]] = {}
        for i in range(1, n + 1):
            children.setdefault(int(trees.parents[b, i]), []).append(i)
        path = [0]
        stopped = False
        cur = 0
        while True:
            want = int(target[b, cur])
            if want < 0:
                raise ValueError(f"request {b}, node {cur}: target token {want} is negative")
            nxt = next((c for c in children.get(cur, []) if int(trees.tokens[b, c]) == want), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
            stream = ([] if history is None else [int(t) for t in history[b]]) + \
                [int(trees.tokens[b, i]) for i in path[1:]]
            if want in stops or any(len(q) <= len(stream) and tuple(stream[-len(q):]) == q for q in sequences):
                stopped = True
                break
        tokens = [int(trees.tokens[b, i]) for i in path[1:]]
        commit = tokens + ([] if stopped else [int(target[b, cur])])
        cap = caps[b]
        if cap is not None and len(commit) > cap:
            # Keep the first `cap` committed tokens: cap - 1 accepted nodes then a bonus.
            if cap == 0:
                path, bonus_tok = [0], -1
            else:
                path = path[:cap]
                bonus_tok = int(target[b, path[-1]])
        else:
            bonus_tok = -1 if stopped else int(target[b, cur])
        accepted[b, : len(path)] = path
        length[b] = len(path) - 1
        bonus[b] = bonus_tok
    return Acceptance(accepted_nodes=accepted, accept_length=length, bonus_token=bonus)


def topk_logprobs(logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference for :func:`kdtree.topk_logprobs`: in float64 (numpy's pairwise sum), stable
    order by (-logit, id), log-probs ``float32((logit - m) - log(sum(exp(row - m))))`` with m
    the row's max (never ``logit - (m + log sum)``, which loses ``log sum`` for large m)."""
    x = np.asarray(logits)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise TypeError(f"logits must be a floating array, got dtype {x.dtype}")
    x = x.astype(np.float32)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {x.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= x.shape[-1]:
        raise ValueError(f"k={k!r} must be an int in [0, {x.shape[-1]}]")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    if (np.isneginf(x).all(axis=-1)).any():
        raise ValueError("a row has every logit -inf")
    x64 = x.astype(np.float64)
    m = x64.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(x64 - m).sum(axis=-1, keepdims=True))
    order = np.argsort(-x64, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(x64, order, axis=-1)
    with np.errstate(over="ignore"):  # -FLT_MAX - FLT_MAX: -inf in float32
        return ((top - m) - log_sum).astype(np.float32), order.astype(np.int32)
