"""The DDTree speculative-decoding round loop, written once against small model interfaces.

One round (Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", arXiv 2604.12989; tree rule and verification: the project spec
``ddtree-tree-build.md``):

1. draft   ``Drafter.draft(context, L)`` -> logits float [L, V] for depths 1..L below the
           root (the root is the last committed token), in one call;
2. top-k   ``topk_logprobs(logits, K)`` with ``K = min(budget, V)``;
3. build   ``build_trees(lp, ids, budget, root_tokens=[last token],
           root_positions=[its position])``;
4. target  ``Target.score_tree(trees)``: one target call scores every node with the
           context its ancestors give (tree attention) and returns its chosen token per
           node, int [B, N+1]: the argmax for greedy decoding, or one independent draw
           from the target's (tempered, top-p) distribution for sampling (the target
           object decides, e.g. :class:`kdtree.hf.HFTarget`'s ``temperature``);
5. verify  ``verify_greedy(trees, chosen, stop_tokens, max_commit=remaining)``: the walk
           from the root along the target's choices (the library's verification);
6. commit  ``Target.commit(tokens, trees, acceptance)``: the accepted draft tokens and the
           bonus token join the context (a transformer target compacts its KV cache here,
           keeping the accepted nodes' entries).

The committed text equals what greedy autoregressive decoding of the target produces
(the verification rule keeps the target's output exactly; with sampled choices, the
committed tokens follow the target's sampling distribution exactly), with one target call
per round instead of one per token. :func:`autoregressive_generate` is that baseline, through the
same :class:`Target`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

# timed stages of a DDTree round, in order (module docstring); "verify" is the library's
# verification (the walk, verify_greedy), "target" the target's one call scoring every node
STAGES = ("draft", "topk", "build", "target", "verify", "commit")


@runtime_checkable
class Target(Protocol):
    """The model being decoded (e.g. :class:`kdtree.ngram.NgramTarget`; later a Hugging
    Face transformer with a KV cache).

    The target holds one sequence: the committed tokens. Its last committed token is the
    root of the next draft tree; a transformer keeps that token out of its KV cache until
    the next forward (the root row of the tree), as DFlash/DDTree do.
    """

    vocab_size: int

    def prefill(self, prompt: Sequence[int]) -> None:
        """Start a sequence with ``prompt`` (>= 1 token) committed."""

    def next_token(self) -> int:
        """One autoregressive forward: the chosen next token after the committed tokens
        (greedy: argmax, ties to the lower id). The caller then calls :meth:`commit`."""

    def score_tree(self, trees: Any) -> np.ndarray:
        """One forward over every node of ``trees`` (a :class:`kdtree.TreeBatch` whose root
        is the last committed token): node ``i`` sees the committed tokens and the tokens
        of its ancestors and itself (``trees.visibility``, positions ``trees.positions``).
        Returns int32 [B, N+1], the chosen token at every node (padding rows ignored)."""

    def commit(self, tokens: Sequence[int], trees: Any = None, acceptance: Any = None) -> None:
        """Append ``tokens`` to the committed sequence. After a tree round ``trees`` and
        ``acceptance`` say which nodes were accepted (KV-cache compaction goes here)."""

    def drafter_features(self) -> Any:
        """What the drafter conditions on besides the tokens (hidden states of the last
        forward for DFlash), or None."""

    # Optional: ``positions_left() -> int | None``, the positions the model can still take
    # after the last committed token; speculative_generate then caps each round's depth
    # with it (HFTarget has it: max_position_embeddings less the sequence length).


@runtime_checkable
class Drafter(Protocol):
    """A drafter that returns, in one call, a distribution for each of the next ``L``
    positions (a block-diffusion drafter such as DFlash; :class:`kdtree.ngram.NgramDrafter`)."""

    vocab_size: int

    def draft(self, context: Sequence[int], depth: int, features: Any = None) -> np.ndarray:
        """Logits float [depth, V] for depths 1..depth below the root (= ``context[-1]``)."""


@dataclass
class RoundSnapshot:
    """One round kept for display: the tree, the target's tokens and the walk's result."""

    index: int
    trees: Any
    target_tokens: np.ndarray
    acceptance: Any
    committed: list[int]


@dataclass
class GenerationResult:
    """Output and statistics of one generation.

    Attributes:
        tokens           the new tokens (prompt excluded)
        target_calls     forwards of the target (AR: one per token; DDTree: one per round)
        target_rows      rows the target scored after the prefill (AR: one a forward;
                         DDTree: the N + 1 rows of each round's tree, padding included)
        drafter_calls    drafter calls (0 for AR)
        accepted         per round, accepted draft tokens (root excluded)
        committed        per round, committed tokens (accepted draft tokens + bonus)
        stop_reason      "max_new_tokens", "stop_token" or "stop_sequence"
        times            seconds per stage (``STAGES``; AR uses "target" and "commit")
        wall             seconds for the whole call
        snapshot         the round selected for display, or None
    """

    tokens: list[int]
    target_calls: int = 0
    target_rows: int = 0
    drafter_calls: int = 0
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    stop_reason: str = "max_new_tokens"
    times: dict[str, float] = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    wall: float = 0.0
    snapshot: RoundSnapshot | None = None

    @property
    def rounds(self) -> int:
        return len(self.committed)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean committed tokens per round = (accepted draft tokens + bonus) / rounds, i.e.
        new tokens per target call (DDTree's "acceptance length" tau). 0.0 with no rounds."""
        return float(np.mean(self.committed)) if self.committed else 0.0

    @property
    def mean_accepted_draft_tokens(self) -> float:
        """Mean accepted draft tokens per round (bonus excluded)."""
        return float(np.mean(self.accepted)) if self.accepted else 0.0


def _default_ops() -> ModuleType:
    import kdtree

    return kdtree


def _check_common(prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The prompt as a list of Python ints (both decoders take the same prompts)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if len(prompt) == 0:
        raise ValueError("the prompt must hold at least one token (the first tree's root)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    out = []
    for i, t in enumerate(prompt):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"prompt element {i} ({t!r}) is not an integer token id (pass a list of ints, "
                            f"e.g. tensor.tolist())")
        out.append(int(t))
    return out


def _stop_sequences(stop_sequences) -> list[tuple[int, ...]]:
    """The stop sequences as tuples of token ids (checked as the verify functions check them)."""
    from ..core import checks

    seq = checks.stop_sequences(stop_sequences, None, 1)
    if seq is None:
        return []
    tokens, offsets, _ = seq
    return [tuple(int(t) for t in tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _ends_with_one(stream: Sequence[int], sequences: list[tuple[int, ...]]) -> bool:
    return any(len(q) <= len(stream) and tuple(stream[-len(q):]) == q for q in sequences)


def autoregressive_generate(target: Target, prompt: Sequence[int], max_new_tokens: int, *,
                            stop_tokens: Sequence[int] = (),
                            on_tokens: Callable[[int], None] | None = None,
                            stop_sequences=()) -> GenerationResult:
    """Plain autoregressive decoding: one target call per new token.

    Stops after ``max_new_tokens`` tokens, right after a stop token (which is kept), or
    right after a token that makes the committed stream (prompt and new tokens) end with
    one of ``stop_sequences`` (token sequences of 1 to 16 ids; kept; ``stop_reason``
    "stop_sequence").

    Raises:
        ValueError: empty prompt or negative ``max_new_tokens``, a malformed stop sequence.
        TypeError: a prompt element or ``max_new_tokens`` that is not an integer.
    """
    prompt = _check_common(prompt, max_new_tokens)
    stops = {int(t) for t in stop_tokens}
    sequences = _stop_sequences(stop_sequences)
    stream = list(prompt)
    res = GenerationResult(tokens=[])
    t_start = time.perf_counter()
    target.prefill(prompt)
    while len(res.tokens) < max_new_tokens:
        t0 = time.perf_counter()
        tok = int(target.next_token())
        t1 = time.perf_counter()
        target.commit([tok])
        t2 = time.perf_counter()
        res.times["target"] += t1 - t0
        res.times["commit"] += t2 - t1
        res.target_calls += 1
        res.target_rows += 1
        res.tokens.append(tok)
        stream.append(tok)
        if on_tokens is not None:
            on_tokens(1)
        if tok in stops:
            res.stop_reason = "stop_token"
            break
        if sequences and _ends_with_one(stream, sequences):
            res.stop_reason = "stop_sequence"
            break
    res.wall = time.perf_counter() - t_start
    return res


def _useful_budget(budget: int, depth: int, width: int) -> int:
    """min(budget, width + width^2 + ... + width^depth): a tree of depth ``depth`` with
    ``width`` children per node cannot hold more nodes, so a larger budget only adds padding
    rows (the tree itself is the same)."""
    total, level = 0, 1
    for _ in range(depth):
        level *= width
        total += level
        if total >= budget or level == 0:
            break
    return min(budget, total)


def _sharded_topk(logits: np.ndarray, k: int, vocab_slice, vocab: int):
    """The top-k log-probs of drafter logits split by vocabulary over the ranks
    (kdtree.distributed.topk_logprobs_sharded), as numpy arrays."""
    import torch

    from ..distributed import topk_logprobs_sharded

    top = topk_logprobs_sharded(torch.from_numpy(np.ascontiguousarray(logits, np.float32)), k, vocab_slice[0], vocab)
    return top.logprobs.numpy(), top.ids.numpy()


def speculative_generate(target: Target, drafter: Drafter, prompt: Sequence[int],
                         max_new_tokens: int, *, budget: int, depth: int,
                         stop_tokens: Sequence[int] = (), ops: Any = None,
                         snapshot: str | int | None = "best",
                         on_tokens: Callable[[int], None] | None = None,
                         width: int | None = None, stop_sequences=()) -> GenerationResult:
    """DDTree speculative decoding of ``target`` with ``drafter`` (see the module docstring).

    Args:
        target, drafter: the models (:class:`Target`, :class:`Drafter`), same vocabulary.
        prompt: committed tokens to start from (>= 1; the last one is the first root).
        max_new_tokens: exact cap on new tokens (passed as ``max_commit`` each round).
        budget: N >= 0, draft nodes per tree (root excluded).
        depth: L >= 0, draft positions per drafter call (tree depth limit).
        stop_tokens: generation ends right after one is committed (it is kept).
        stop_sequences: token sequences (1 to 16 ids each): generation ends right after the
            committed stream (prompt and new tokens) ends with one (kept), as in
            :func:`autoregressive_generate`; the walk itself stops at an accepted token
            that completes one (``kdtree.verify_greedy``'s ``stop_sequences``, with the
            last committed tokens as its history).
        ops: the module providing ``topk_logprobs``, ``build_trees`` and ``verify_greedy``
            (default :mod:`kdtree`, the native library; :mod:`kdtree.reference` also works).
        snapshot: which round to keep in ``result.snapshot``: "best" (the first round
            committing the most distinct tokens, then the longest accepted path: a run of
            one repeated token makes a dull picture), a round index, or None.
        on_tokens: called with the number of tokens committed after each round (progress).
        width: top-K entries per depth given to the tree builder (default: the budget,
            DDTree's choice; 1 gives the drafter's top-1 chain, DFlash's single draft).

    Returns:
        :class:`GenerationResult`.

    Raises:
        ValueError: empty prompt, negative sizes, vocabulary mismatch, or a drafter output
            of the wrong shape; errors of the ``ops`` functions propagate. TypeError: a
            prompt element or ``max_new_tokens`` that is not an integer.
    """
    prompt = _check_common(prompt, max_new_tokens)
    if budget < 0 or depth < 0:
        raise ValueError(f"budget and depth must be >= 0, got budget={budget}, depth={depth}")
    vocab = int(target.vocab_size)
    if int(drafter.vocab_size) != vocab:
        raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {vocab}")
    ops = _default_ops() if ops is None else ops
    if width is not None and width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    k = min(budget if width is None else width, vocab)
    stops = {int(t) for t in stop_tokens}
    stop_list = sorted(stops)
    sequences = _stop_sequences(stop_sequences)
    history_len = max((len(q) for q in sequences), default=1) - 1
    vocab_slice = getattr(drafter, "vocab_slice", None)
    res = GenerationResult(tokens=[])
    tm = res.times
    context = [int(t) for t in prompt]
    best = (-1, -1)
    t_start = time.perf_counter()
    target.prefill(context)
    positions_left = getattr(target, "positions_left", None)
    while len(res.tokens) < max_new_tokens:
        remaining = max_new_tokens - len(res.tokens)
        t0 = time.perf_counter()
        logits = np.asarray(drafter.draft(context, depth, target.drafter_features()))
        res.drafter_calls += 1
        width_v = vocab if vocab_slice is None else vocab_slice[1]
        if logits.shape != (depth, width_v):
            raise ValueError(f"drafter returned logits of shape {logits.shape}, "
                             f"expected ({depth}, {width_v})")
        # Near the target's position limit the tree gets shallower (down to the root
        # alone, one token a round), as autoregressive decoding would still run there.
        left = positions_left() if callable(positions_left) else None
        round_depth = depth if left is None else min(depth, left)
        if round_depth < depth:
            logits = logits[:round_depth]
        round_budget = _useful_budget(budget, round_depth, k)
        t1 = time.perf_counter()
        if vocab_slice is None:
            lp, ids = ops.topk_logprobs(logits, k)
        else:  # this rank's slice of the vocabulary: the shards' summaries merged
            lp, ids = _sharded_topk(logits, k, vocab_slice, vocab)
        t2 = time.perf_counter()
        trees = ops.build_trees(lp, ids, round_budget, root_tokens=[context[-1]],
                                root_positions=[len(context) - 1], vocab_size=vocab)
        t3 = time.perf_counter()
        chosen = np.asarray(target.score_tree(trees))
        res.target_calls += 1
        res.target_rows += int(trees.budget) + 1
        t4 = time.perf_counter()
        if sequences:
            hist = [-1] * max(0, history_len - len(context)) + context[max(0, len(context) - history_len):]
            acc = ops.verify_greedy(trees, chosen, stop_tokens=stop_list, max_commit=remaining,
                                    stop_sequences=sequences, stop_history=np.array([hist], np.int64))
        else:
            acc = ops.verify_greedy(trees, chosen, stop_tokens=stop_list, max_commit=remaining)
        t5 = time.perf_counter()
        committed = acc.committed(trees, 0)
        target.commit(committed, trees, acc)
        t6 = time.perf_counter()
        for name, a, b in zip(STAGES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6), strict=True):
            tm[name] += b - a
        n_acc = int(acc.accept_length[0])
        idx = len(res.committed)
        score = (len(set(committed)), n_acc)
        if (snapshot == "best" and score > best) or (snapshot == idx):
            best = max(best, score)
            res.snapshot = RoundSnapshot(idx, trees, chosen, acc, list(committed))
        res.accepted.append(n_acc)
        res.committed.append(len(committed))
        res.tokens.extend(committed)
        context.extend(committed)
        if on_tokens is not None:
            on_tokens(len(committed))
        if not committed:  # cannot happen while remaining >= 1; guards against a bad ops
            raise RuntimeError("a round committed no token")
        if committed[-1] in stops:
            res.stop_reason = "stop_token"
            break
        if sequences and _ends_with_one(context, sequences):
            res.stop_reason = "stop_sequence"
            break
    res.wall = time.perf_counter() - t_start
    return res

