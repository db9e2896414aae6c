"""The batched DDTree engine: request slots on the device, one CUDA graph a round,
continuous batching.

A round, for the requests in slots ``0 .. b-1`` (``b`` the batch bucket: the smallest
power of two holding every active slot), with no host synchronisation inside:

1. draft     the drafter's logits ``[b, L, V]`` from its cached context keys/values
             (``drafter.kv_cache``: :class:`kdtree.engine.dflash.DFlashKV` or
             :class:`kdtree.engine.drafter.BlockDrafterKV`);
2. build     :func:`kdtree.topk_logprobs`, each request's entries deeper than its
             remaining tokens allow set to -inf (its tree spends the budget where it
             can be accepted), then :func:`kdtree.build_trees` (the best-first builder);
3. mask      :func:`kdtree.tree_attention_mask` (additive, over the first
             ``max_length + N + 1`` cache rows: the most a budget-N round can reach) and
             the node positions;
4. target    one forward of the target's transformers model over the ``N + 1`` tree
             rows of every request (:mod:`kdtree.engine.attention` writes each
             request's K/V rows at its own length);
5. verify    :func:`kdtree.verify_greedy_from_logits` or
             :func:`kdtree.verify_sample_from_logits` (per-request temperature, top-p,
             top-k, seeds and offsets on the device; the graph advances the offsets),
             with each request's remaining tokens as its commit cap;
6. compact   :func:`kdtree.compact_kv` moves the accepted rows after each prefix; the
             accepted rows' target features extend the drafter's context cache; the
             committed tokens, lengths, roots and remaining counts are updated on the
             device and the committed tokens copied to a small pinned host buffer.

On CUDA the round is captured once per batch bucket into a CUDA graph and replayed; the
host reads a round's committed tokens while the next round runs (one round late), so a
request that finishes on the device (its remaining count reaches 0, or it commits a stop
token) runs one more round as padding that commits nothing. Inactive slots run as
padding: their commit cap is 0. On the CPU the same round runs eagerly (the tests' path).

Modes: ``"ddtree"`` (top-``min(budget, V)`` per depth, the DDTree tree), ``"chain"`` (the
drafter's top-1 chain of depth L, DFlash's draft: width 1, budget L) and ``"ar"``
(autoregressive: a root-only tree, no drafter; one token a forward, the baseline).

Requests: :meth:`Engine.submit` queues one; :meth:`Engine.step` admits queued requests
into free slots (prefill, at most one chunk of ``prefill_chunk`` tokens a step, so a long
prompt never stalls decoding for more than one chunk) and runs one round;
:meth:`Engine.generate` runs everything to the end.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import attention

MODES = ("ddtree", "chain", "ar")
# prefill forwards of at most this many rows (requests x chunk, padded) replay CUDA graphs
PREFILL_GRAPH_ROWS = 16384
# the largest budget a round takes (N + 1 rows a request in every target forward)
MAX_BUDGET = 4096
# budget="auto": the budgets it chooses among
AUTO_BUDGETS = (16, 32, 64, 128, 256)
# budget="auto": every this many rounds one builds its tree at the largest budget (and runs
# its first n nodes), which measures the drafter's expected-token curve at every budget
AUTO_PROBE_EVERY = 8
# budget="auto": the weight of each probe's curve in the running average
AUTO_CURVE_WEIGHT = 0.25
# GPU top-k limit (kdt_topk_logprobs_cuda): the width of a DDTree tree is min(budget, V, 1024).
MAX_WIDTH = 1024
# stage names of a round, in order (the benchmark times each alone in a graph)
ROUND_STAGES = ("draft", "build", "mask", "target", "verify", "commit")


def _torch():
    import torch

    return torch


def _cache_bytes(model: Any, slots: int, rows: int, elem: int) -> int:
    """Bytes of the target's static K/V cache: keys and values of every layer (this
    rank's heads under tensor parallelism)."""
    cfg = model.config
    kv_heads, head_dim = attention.local_kv_heads(model)
    return 2 * int(cfg.num_hidden_layers) * slots * kv_heads * rows * head_dim * elem


def _free_bytes(torch: Any, device: Any) -> int | None:
    """Free memory on ``device`` (CUDA: the driver's free bytes plus what torch's caching
    allocator holds unused, e.g. a dropped engine's cache; CPU: available physical memory),
    or None where it cannot be read."""
    try:
        if device.type == "cuda":
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


@dataclass
class SamplingParams:
    """Per-request sampling: ``temperature`` 0 is greedy (argmax, ties to the lower id);
    > 0 samples from ``softmax(logits / temperature)`` restricted to the ``top_k`` most
    likely tokens (0: all) and then to the ``top_p`` nucleus (the cuts of
    :func:`kdtree.verify_sample_from_logits`); ``seed`` keys the request's counter-based
    draws with the round number and its slot (the same seed gives the same draws in the
    same slot; the slot enters the draw as kdtree's request index).

    ``stop_token_ids`` and ``stop_sequences`` end this request on top of the engine's
    ``stop_tokens`` and ``stop_sequences`` (the same meaning: the token, or the sequence's
    last token, is kept in the output; ``finish_reason`` "stop_token" or "stop_sequence";
    a sequence holds 1 to 16 ids and may begin in the prompt). They are applied on the
    host when a round's tokens are read: the round's committed tokens are cut right after
    the first that ends the request, so the output is the one decoding with these stops
    gives. (The engine's own stops are applied inside the verify walk, which also spares
    the work past them.) Ids past the engine's vocabulary are refused by
    :meth:`Engine.submit`."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    stop_sequences: Sequence[Sequence[int]] = ()

    def __post_init__(self) -> None:
        # the engine keeps these in float32 / int32 device arrays: values that do not fit
        # are refused here, not when a round runs
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t == 0 or 1e-6 <= t <= FLOAT32_MAX):
            raise ValueError(f"temperature must be 0 (greedy) or a number in [1e-6, {FLOAT32_MAX:.4g}] (float32), "
                             f"got {t!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                or not FLOAT32_TINY <= self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] and at least {FLOAT32_TINY:.4g} (float32), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0: no top-k), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        self.stop_token_ids = _stop_ids(self.stop_token_ids)
        self.stop_sequences = _stop_seqs(self.stop_sequences)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _stop_ids(ids) -> tuple[int, ...]:
    """Per-request stop token ids as a tuple of ints in [0, 2^31) (ValueError otherwise)."""
    items = None if isinstance(ids, (str, bytes)) else ids
    try:
        items = list(items)
    except TypeError:
        items = None
    if items is None or any(isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
                            or not 0 <= int(t) < 2**31 for t in items):
        raise ValueError(f"stop_token_ids must be token ids (integers in [0, 2**31)), got {ids!r}")
    return tuple(int(t) for t in items)


def _stop_seqs(seqs) -> tuple[tuple[int, ...], ...]:
    """Per-request stop sequences as tuples of ids, checked as :func:`kdtree.stop_sequences`
    checks them (ValueError naming the sequence)."""
    from .. import _native
    from ..core import api

    items = None if isinstance(seqs, (str, bytes)) else seqs
    try:
        items = list(items)
    except TypeError:
        items = None
    if items is None:
        raise ValueError(f"stop_sequences must be a sequence of token sequences (for example [[13, 14]]), got "
                         f"{type(seqs).__name__}")
    if not items:
        return ()
    try:
        return tuple(tuple(q) for q in api.stop_sequences(items).sequences)
    except (_native.KdtreeError, TypeError) as exc:
        raise ValueError(f"stop_sequences: {exc}") from None


@dataclass
class RequestOutput:
    """One request's result.

    Attributes:
        request_id     the id :meth:`Engine.submit` returned
        prompt         the prompt's token ids
        tokens         the generated tokens (prompt excluded)
        finish_reason  None while running; "stop_token", "stop_sequence" (the engine's
                       or the request's own stops), "max_new_tokens", "length" (the
                       engine's max_length reached), "aborted" (:meth:`Engine.abort`) or
                       "error" (see ``error``)
        error          why the request failed (a kdtree status from its round), or None
        rounds         rounds that committed tokens for it (target forwards after prefill)
        committed      per such round, the tokens committed (accepted draft tokens + bonus)
    """

    request_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    rounds: int = 0
    committed: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per round (accepted draft tokens + bonus), 0.0 with no rounds."""
        return float(np.mean(self.committed)) if self.committed else 0.0


@dataclass
class _Request:
    out: RequestOutput
    max_new_tokens: int
    cap: int  # tokens it may commit: min(max_new_tokens, max_length - len(prompt))
    sampling: SamplingParams
    slot: int = -1
    prefilled: int = 0  # prompt tokens (all but the last) already in the cache
    on_tokens: Callable[[int], None] | None = None


@dataclass
class EngineStats:
    """Counters over the engine's life (reset by :meth:`Engine.reset_stats`)."""

    rounds: int = 0              # round launches (graph replays or eager rounds)
    slot_rounds: int = 0         # active request-rounds
    tokens: int = 0              # tokens committed
    target_rows: int = 0         # target rows forwarded by rounds (b x (N + 1) each)
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    wall: float = 0.0            # seconds inside step()
    prefill_wall: float = 0.0    # seconds of it issuing prefill chunks (on the CPU: running them)
    prefill_gpu: float = 0.0     # seconds the prefill forwards ran on the GPU (CUDA events;
                                 # complete once the engine is idle)
    host_wait: float = 0.0       # seconds step() spent waiting for the GPU

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per active request-round."""
        return self.tokens / self.slot_rounds if self.slot_rounds else 0.0


class _State:
    """The static device tensors of the engine (every captured graph reads these)."""

    def __init__(self, torch, device, slots: int, path: int, stops: Sequence[int], budget: int):
        i64 = dict(dtype=torch.int64, device=device)
        self.lengths = torch.zeros(slots, **i64)       # cached tokens (committed - 1)
        self.roots = torch.zeros(slots, dtype=torch.int32, device=device)  # last committed token
        self.remaining = torch.zeros(slots, **i64)     # tokens the slot may still commit
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int32, device=device)
        self.seed = torch.zeros(slots, **i64)
        self.offset = torch.zeros(slots, **i64)
        self.stops = torch.tensor(sorted({int(t) for t in stops}), dtype=torch.int32, device=device)
        self.out_tokens = torch.full((slots, path), -1, dtype=torch.int32, device=device)
        self.out_counts = torch.zeros(slots, dtype=torch.int32, device=device)
        self.out_status = torch.zeros(slots, dtype=torch.int32, device=device)
        self.curve = torch.zeros(max(budget, 1), dtype=torch.float64, device=device)


def _sharded(model: Any) -> bool:
    """Whether ``model`` is sharded over a process group (no error for what is not a model)."""
    try:
        return tensor_parallel_size(model) > 1
    except (AttributeError, TypeError):
        return False


def tensor_parallel_size(model: Any) -> int:
    """The ranks ``model`` is sharded over by a tensor-parallel plan (its parameters are
    DTensors on a device mesh, as transformers' ``tp_plan`` leaves them), or 1."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return 1


def _kernel_unfit(torch, cfg, device, dtype) -> str:
    """Why kdtree's tree-attention kernel cannot run this target's verify forward ("" when
    it can)."""
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if device.type != "cuda":
        return "the kernel runs on CUDA devices"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the kernel takes float16 or bfloat16, the target is {dtype}"
    if head_dim not in (64, 128, 256):
        return f"the kernel takes head_dim 64, 128 or 256, the target has {head_dim}"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} KV heads"
    from .. import cuda_devices

    if cuda_devices() < 1:
        return "this libkdtree was built without CUDA or sees no GPU"
    return ""


class Engine:
    """Batched DDTree decoding of a transformers target with a block drafter.

    Args:
        target: a loaded transformers causal LM of the Llama, Qwen2 or Qwen3 families
            (:func:`kdtree.engine.hf.load_causal_lm`), on its device and dtype.
        drafter: a DFlash drafter (:func:`kdtree.engine.dflash.load_dflash`, the published
            format) or a :class:`kdtree.engine.drafter.BlockDrafter`, on the same device
            (None for ``mode="ar"``), trained on ``target``'s hidden states at
            ``drafter.feature_layers``.
        max_batch: request slots B (rounds run buckets of 1, 2, 4 .. B slots).
        budget: N, draft nodes per tree (mode "ddtree"; "chain" uses L, "ar" 0), at most
            ``MAX_BUDGET``; or "auto": each round's budget among ``auto_budgets`` (the one
            that maximises expected tokens per second, :meth:`_choose_budget`).
        mode: "ddtree", "chain" or "ar" (module docstring).
        max_length: the most positions a request may take (prompt + generated tokens);
            a request reaching it finishes with "length". The KV caches hold
            ``max_length + N + 1`` rows per slot.
        stop_tokens: token ids that end a request (kept in its output), for every request.
        stop_sequences: token sequences (1 to 16 ids each) that end a request right after
            its committed stream (prompt included) completes one (kept in its output;
            ``finish_reason`` "stop_sequence"), for every request: the verify walk stops at
            a draft token that completes one, and a bonus token that does ends the request.
        prefill_chunk: prompt tokens forwarded per prefill chunk.
        use_graphs: capture each bucket's round in a CUDA graph (default: on CUDA).
        tree_attention: the verify forward's attention: "kdtree" (kdtree's kernel,
            :func:`kdtree.tree_attention`: float16 / bfloat16 on CUDA, head_dim 64, 128 or
            256, a libkdtree built with CUDA), "sdpa" (PyTorch's SDPA under kdtree's
            additive tree mask) or "auto" (the kernel where it applies, else SDPA); the
            choice is ``self.tree_attention``. Root-only rounds (mode "ar", one row a
            request) always run SDPA.
        sampling: whether rounds verify by sampling (per-request temperature; a request
            with temperature 0 is still greedy). False: greedy verification only (requests
            with temperature > 0 are refused).
        auto_budgets: the budgets ``budget="auto"`` chooses among (each needs two
            captured graphs per bucket: with and without the probe).

    Raises:
        ValueError: bad sizes, an unknown mode, a drafter whose vocabulary, feature size
            or layers do not match the target, max_length beyond the target's positions,
            stop tokens outside the vocabulary, models of another dtype on CUDA, a K/V
            cache larger than the device's free memory (checked before allocating).
        TypeError: a target that is not a transformers model, a drafter that is not a
            BlockDrafter.
    """

    def __init__(self, target: Any, drafter: Any = None, *, max_batch: int = 1, budget: int | str = 64,
                 mode: str = "ddtree", max_length: int = 2048, stop_tokens: Sequence[int] = (),
                 prefill_chunk: int = 512, use_graphs: bool | None = None, sampling: bool = False,
                 auto_budgets: Sequence[int] = AUTO_BUDGETS, tree_attention: str = "auto",
                 stop_sequences: Sequence[Sequence[int]] = ()):
        self._agreed = False  # tensor parallelism: whether this rank took part in the settings' gather
        try:
            self._construct(target, drafter, max_batch=max_batch, budget=budget, mode=mode, max_length=max_length,
                            stop_tokens=stop_tokens, prefill_chunk=prefill_chunk, use_graphs=use_graphs,
                            sampling=sampling, auto_budgets=auto_budgets, tree_attention=tree_attention,
                            stop_sequences=stop_sequences)
        except (ValueError, TypeError) as exc:
            # A rank that fails its own checks still joins the gather the other ranks wait in,
            # so that they raise too (naming this rank) instead of waiting for the timeout.
            if not self._agreed and _sharded(target):
                import torch.distributed as dist

                dist.all_gather_object([None] * dist.get_world_size(), (f"{type(exc).__name__}: {exc}", None, None))
            raise

    def _construct(self, target: Any, drafter: Any, *, max_batch, budget, mode, max_length, stop_tokens,
                   prefill_chunk, use_graphs, sampling, auto_budgets, tree_attention, stop_sequences) -> None:
        torch = _torch()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not hasattr(target, "config") or not hasattr(target, "parameters"):
            raise TypeError(f"target must be a transformers causal LM (kdtree.engine.hf.load_causal_lm), got "
                            f"{type(target).__name__}")
        if drafter is not None and not callable(getattr(drafter, "kv_cache", None)):
            raise TypeError(f"drafter must be a DFlash drafter (kdtree.engine.dflash.load_dflash) or a BlockDrafter "
                            f"(kdtree.engine.drafter.load_drafter), got {type(drafter).__name__}")
        self.auto = budget == "auto"
        if self.auto:
            if mode != "ddtree":
                raise ValueError(f"budget='auto' chooses among DDTree budgets; mode {mode!r} has a fixed tree")
            if not auto_budgets or any(isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer))
                                       or not 1 <= n <= MAX_BUDGET for n in auto_budgets):
                raise ValueError(f"auto_budgets must be integers in [1, {MAX_BUDGET}], got {list(auto_budgets)!r}")
            budgets = sorted({int(n) for n in auto_budgets})
            budget = budgets[-1]
        for name, v, lo, hi in (("max_batch", max_batch, 1, 1 << 16), ("budget", budget, 0, MAX_BUDGET),
                                ("max_length", max_length, 2, 1 << 31), ("prefill_chunk", prefill_chunk, 1, 1 << 31)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                also = " or 'auto'" if name == "budget" else ""
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}]{also}, got {v!r}")
        cfg = target.config
        self.vocab_size = int(cfg.vocab_size)
        try:
            stop_list = list(stop_tokens) if not isinstance(stop_tokens, (str, bytes)) else None
        except TypeError:
            stop_list = None
        if stop_list is None or any(isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
                                    or not 0 <= int(t) < self.vocab_size for t in stop_list):
            raise ValueError(f"stop_tokens must be token ids in [0, {self.vocab_size}), got {stop_tokens!r}")
        stop_sequences = self._check_stop_sequences(stop_sequences)  # once: an iterator is read here alone
        max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        if max_pos and max_length > max_pos:
            raise ValueError(f"max_length {max_length} is beyond the target's max_position_embeddings ({max_pos})")
        if mode == "ar":
            drafter = None
        elif drafter is None:
            raise ValueError(f"mode {mode!r} needs a drafter (mode='ar' runs without one)")
        else:
            if int(drafter.vocab_size) != self.vocab_size:
                raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {self.vocab_size}")
            n_layers = int(cfg.num_hidden_layers)
            layers = list(drafter.feature_layers)
            if any(not 0 <= i <= n_layers for i in layers):
                raise ValueError(f"the drafter's feature layers (hidden states {layers}) are outside the target's "
                                 f"hidden states 0 .. {n_layers}")
            if len(layers) * int(cfg.hidden_size) != int(drafter.feature_size):
                raise ValueError(f"drafter feature_size {drafter.feature_size} != {len(layers)} layers x "
                                 f"target hidden size {cfg.hidden_size}")
        self.target = target.eval()
        self.drafter = drafter
        self.mode = mode
        param = next(target.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.depth = 0 if drafter is None else int(drafter.max_depth)
        if mode == "ddtree":
            self.budget = int(budget)
            self.width = max(1, min(self.budget, self.vocab_size, MAX_WIDTH))
            if self.auto and self.budget > self.width:
                raise ValueError(f"budget='auto' builds trees of up to {self.budget} nodes and takes their first n, "
                                 f"which needs top-{self.budget} (at most {self.width} here)")
        elif mode == "chain":
            self.budget, self.width = self.depth, 1
        else:
            self.budget, self.width = 0, 1
        self.max_batch = int(max_batch)
        self.max_length = int(max_length)
        self.capacity = self.max_length + self.budget + 1
        self.prefill_chunk = int(prefill_chunk)
        self.path = min(self.depth, self.budget) + 1  # accepted_nodes columns (the largest budget's)
        self.budgets = tuple(budgets) if self.auto else (self.budget,)
        self.sampling = bool(sampling)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"on CUDA the models must be float32, float16 or bfloat16 (kdtree's masks and KV "
                             f"compaction), got {self.dtype}")
        self.use_graphs = self.on_cuda if use_graphs is None else bool(use_graphs)
        if self.use_graphs and not self.on_cuda:
            raise ValueError("use_graphs needs the models on a CUDA device")
        if drafter is not None:  # checked before anything is allocated
            dparam = next(drafter.parameters())
            if dparam.device != self.device:
                raise ValueError(f"the drafter is on {dparam.device}, the target on {self.device}")
            if dparam.dtype != self.dtype:
                raise ValueError(f"the drafter is {dparam.dtype}, the target {self.dtype}: load both in one dtype")
        if tree_attention not in ("auto", "kdtree", "sdpa"):
            raise ValueError(f"tree_attention must be 'auto', 'kdtree' or 'sdpa', got {tree_attention!r}")
        why_not = _kernel_unfit(torch, cfg, self.device, self.dtype)
        if tree_attention == "kdtree" and why_not:
            raise ValueError(f"tree_attention='kdtree': {why_not}")
        self.tree_attention = "sdpa" if tree_attention == "sdpa" or why_not else "kdtree"
        # tensor parallelism: the ranks the target is sharded over, and the vocabulary
        # slices of a vocabulary-sharded LM head (the target's, and a DFlash drafter's over it)
        self.tp = tensor_parallel_size(target)
        self.vocab_slice = getattr(target, "kdtree_vocab_slice", None)
        self.draft_slice = None if drafter is None else getattr(drafter, "kdtree_vocab_slice", None)
        need = _cache_bytes(target, self.max_batch, self.capacity, param.element_size())
        # An earlier engine on this model left its cache bound to the model's attention
        # modules: unbound here, a dropped engine's cache is freed before this one's is
        # counted and allocated (an engine still in use binds its own again when it runs).
        attention.unbind(target)
        gc.collect()
        free = _free_bytes(torch, self.device)
        memory = None
        if free is not None and need > free:
            memory = (f"the target's K/V cache needs {need / 2**30:.2f} GiB (max_batch {self.max_batch} x "
                      f"{self.capacity} rows = max_length + N + 1), more than the {free / 2**30:.2f} GiB free "
                      f"on {self.device}: lower max_length or max_batch")
        if self.tp > 1:  # every rank raises the same error, or none does
            self._agree_across_ranks(memory, sorted({int(t) for t in stop_list}), stop_sequences)
        elif memory is not None:
            raise ValueError(memory)
        if self.tp > 1:  # a rank that fails from here on tells the others, which would wait in a round
            failure = None
            try:
                self._allocate(torch, target, drafter, cfg, stop_list, stop_sequences)
            except Exception as exc:  # noqa: BLE001 (raised below, on this rank as it is)
                failure = exc
            self._agree_built(failure)
        else:
            self._allocate(torch, target, drafter, cfg, stop_list, stop_sequences)

    def _allocate(self, torch, target, drafter, cfg, stop_list, stop_sequences) -> None:
        """The engine's device state (K/V caches, the drafter's, slot state, buffers), once
        the settings are checked."""
        self.kv = attention.attach(target, self.max_batch, self.capacity)
        self.feature_layers = () if drafter is None else tuple(drafter.feature_layers)
        if drafter is not None:
            self.drafter_kv = drafter.kv_cache(self.max_batch, self.capacity)
        else:
            self.drafter_kv = None
        self.state = _State(torch, self.device, self.max_batch, self.path, stop_list, self.budget)
        self.stop_tokens = frozenset(int(t) for t in stop_list)
        self._setup_stop_sequences(torch, stop_sequences)
        self._cols = torch.arange(self.capacity, device=self.device)
        self._tree_rows = torch.arange(self.budget + 1, device=self.device)
        self._path_cols = torch.arange(self.path, device=self.device)
        self._depth_rows = torch.arange(self.depth, device=self.device)
        self._buffers: dict[int, dict] = {}
        self._side_stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}
        self._prefill_events: deque = deque()  # (start, end) CUDA events of prefill chunks not yet counted
        # a prefill graph keeps its forward's hidden states (every layer's, for the drafter):
        # at most about 1 GiB of them a graph
        per_row = int(cfg.hidden_size) * (int(cfg.num_hidden_layers) + 1) * self.dtype.itemsize
        self._prefill_graph_rows = min(PREFILL_GRAPH_ROWS, (1 << 30) // max(per_row, 1))
        self._graphs: dict[tuple[int, int, bool], Any] = {}  # (bucket, budget, probe)
        self.costs: dict[tuple[int, int], float] = {}  # budget='auto': GPU ms of each (bucket, budget) round
        self._curve = None        # budget='auto': expected accepted draft tokens a request at each budget
                                  # (running average over the probe rounds read)
        self._auto_rounds = 0     # budget='auto': rounds launched (every AUTO_PROBE_EVERY-th probes)
        self._calibration = [0.0, 0.0]  # accepted draft tokens, and their prediction, over the rounds read
        self.budget_counts: dict[int, int] = {}  # rounds run at each budget
        self.round_counts: dict[tuple[int, int], int] = {}  # rounds run at each (bucket, budget)
        self._slots: list[_Request | None] = [None] * self.max_batch
        self._dirty: set[int] = set()  # slots a failed request held: cleared before they are reused
        self._queue: deque[_Request] = deque()
        self._prefilling: deque[_Request] = deque()
        self._pending: deque[tuple] = deque()  # rounds launched, outputs not read yet
        self._next_id = 0
        self._outputs: dict[int, RequestOutput] = {}
        self.stats = EngineStats()
        if self.on_cuda:
            self._pinned = [self._pinned_set(torch) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
            self._flip = 0

    def _agree_built(self, failure: BaseException | None) -> None:
        """Under tensor parallelism, after the allocations: every rank learns whether every
        rank built its engine; a rank that failed raises its own error, the others a
        RuntimeError naming it (so that none goes on to wait in a round's collective)."""
        import torch.distributed as dist

        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        bad = [(r, e) for r, e in enumerate(every) if e is not None]
        if bad:
            raise RuntimeError(f"rank {bad[0][0]} failed to build its engine ({bad[0][1]}): every rank stops")

    def _check_stop_sequences(self, stop_sequences) -> tuple:
        """The stop sequences as tuples of ids, checked (ValueError naming the sequence)."""
        seqs = () if stop_sequences is None else _stop_seqs(stop_sequences)
        self._check_in_vocab(seqs, "stop_sequences")
        return seqs

    def _check_in_vocab(self, seqs, what: str) -> None:
        for i, q in enumerate(seqs):
            if any(t >= self.vocab_size for t in q):
                raise ValueError(f"{what}[{i}] holds a token outside [0, {self.vocab_size})")

    def _setup_stop_sequences(self, torch, stop_sequences) -> None:
        """The stop sequences on the engine's device (prepared once: the verify calls use
        them in place, inside the round's graph) and each slot's history of its last
        committed tokens (int32 ``[slots, H]``, H the longest sequence, -1 before the
        stream's start), which the commit stage moves on."""
        from ..core import api

        seqs = tuple(stop_sequences)  # checked by _check_stop_sequences
        self.stop_sequences = seqs
        self._stop_prepared = None
        self._stop_rows: list = []
        if not seqs:
            self.state.history = None
            return
        self._stop_prepared = api.stop_sequences(seqs, like=self.state.lengths if self.on_cuda else None)
        width = max(len(q) for q in seqs)
        self.state.history = torch.full((self.max_batch, width), -1, dtype=torch.int32, device=self.device)
        self._stop_rows = [torch.tensor(q, dtype=torch.int32, device=self.device) for q in seqs]
        self._history_cols = torch.arange(width, device=self.device)

    def _agree_across_ranks(self, problem: str | None, stops: list[int], stop_seqs: tuple) -> None:
        """Under tensor parallelism every rank runs each round's forward, top-k and verify
        together: the ranks must build the same engine. Gathers each rank's settings,
        vocabulary slices and local problem (e.g. too little memory) and raises the same
        ValueError on every rank for the first that differs, so that no rank goes on to
        wait in a collective that another never joins."""
        import torch.distributed as dist

        mine = {"mode": self.mode, "budgets": list(self.budgets), "max_batch": self.max_batch,
                "max_length": self.max_length, "prefill_chunk": self.prefill_chunk, "sampling": self.sampling,
                "stop_tokens": stops, "stop_sequences": sorted(list(q) for q in stop_seqs),  # (a set: any order)
                "use_graphs": self.use_graphs, "tree_attention": self.tree_attention,
                "depth": self.depth, "vocab_size": self.vocab_size, "dtype": str(self.dtype),
                "sharded LM head": self.vocab_slice is not None,
                "sharded drafter logits": self.draft_slice is not None}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (problem, mine, self.draft_slice))
        self._agreed = True
        for r, (p, _, _) in enumerate(every):
            if p is not None:
                raise ValueError(f"rank {r}: {p}")
        first = every[0][1]
        for r, (_, theirs, _) in enumerate(every):
            for key in first:
                if theirs[key] != first[key]:
                    raise ValueError(f"every rank must build the same engine (the ranks run each round together): "
                                     f"rank {r} has {key} = {theirs[key]!r}, rank 0 {first[key]!r}")
        if self.draft_slice is not None and self.mode != "ar":
            smallest = min(int(s[1]) for _, _, s in every)
            k = min(self.width, max(self.budgets)) if self.mode == "ddtree" else 1
            if k > smallest:
                raise ValueError(f"the trees take the drafter's top-{k} at each depth, more than the smallest "
                                 f"rank's vocabulary slice ({smallest} entries): lower the budget or the ranks")

    # ---- requests ------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None, *,
               on_tokens: Callable[[int], None] | None = None) -> int:
        """Queues a request; returns its id. ``prompt``: >= 1 token ids (the last one is
        the first tree's root). ``max_new_tokens`` >= 0.

        Raises:
            ValueError: an empty prompt, a token outside the vocabulary, a prompt of
                ``max_length`` tokens or more, negative ``max_new_tokens``, sampling on
                an engine built with ``sampling=False``, settings (checked again here:
                the request keeps its own copy) out of range.
            TypeError: ``sampling`` not a SamplingParams, ``on_tokens`` not callable.

        ``on_tokens(count)`` is called when a round's tokens for the request are read,
        after the whole round is read and every request it ended is finished; an
        exception it raises comes out of :meth:`step` once every callback of the round
        ran (the engine stays consistent).
        """
        tokens, sampling = self._checked_request(prompt, max_new_tokens, sampling)
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be a callable taking the count of tokens a round commits, or None, got "
                            f"{type(on_tokens).__name__}")
        rid = self._next_id
        self._next_id += 1
        out = RequestOutput(rid, tokens)
        cap = min(int(max_new_tokens), self.max_length - len(tokens))
        req = _Request(out, int(max_new_tokens), cap, sampling, on_tokens=on_tokens)
        self._outputs[rid] = out
        if cap == 0:
            out.finish_reason = "max_new_tokens" if max_new_tokens == 0 else "length"
        else:
            self._queue.append(req)
        return rid

    def _checked_request(self, prompt, max_new_tokens, sampling) -> tuple[list[int], SamplingParams]:
        """(token ids, sampling settings) of a request :meth:`submit` would take; raises as it."""
        tokens = []
        for i, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"prompt element {i} ({t!r}) is not an integer token id")
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"prompt element {i}: token {int(t)} outside [0, {self.vocab_size})")
            tokens.append(int(t))
        if not tokens:
            raise ValueError("the prompt must hold at least one token (the first tree's root)")
        if len(tokens) >= self.max_length:
            raise ValueError(f"the prompt has {len(tokens)} tokens; the engine's max_length is {self.max_length}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__} {sampling!r}")
        # the request's own copy, checked again: settings changed on the caller's object
        # after it was built (or after this call) are checked here or have no effect
        sampling = dataclasses.replace(sampling)
        if not sampling.greedy and not self.sampling:
            raise ValueError("this engine verifies greedily; build it with sampling=True for temperature > 0")
        for t in sampling.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"sampling.stop_token_ids: token {t} outside [0, {self.vocab_size})")
        self._check_in_vocab(sampling.stop_sequences, "sampling.stop_sequences")
        if self.vocab_slice is not None and not sampling.greedy and (sampling.top_p < 1 or sampling.top_k > 0):
            raise ValueError("top_p and top_k are not supported over a vocabulary-sharded LM head (their cuts need "
                             "the whole row); sample with temperature alone")
        return tokens, sampling

    def output(self, request_id: int) -> RequestOutput:
        """The request's output so far (``finish_reason`` set once it ended). KeyError
        for an id :meth:`submit` did not return, or one :meth:`release` gave back."""
        if isinstance(request_id, (bool, np.bool_)) or not isinstance(request_id, (int, np.integer)):
            raise TypeError(f"request_id must be an int that submit() returned, got {type(request_id).__name__}")
        out = self._outputs.get(int(request_id))
        if out is None:
            raise KeyError(f"no request {request_id!r} in this engine (ids 0 .. {self._next_id - 1}, less those "
                           "released)")
        return out

    def abort(self, request_id: int) -> bool:
        """Ends a request now, wherever it is (queued, prefilling or decoding): its output
        keeps the tokens committed so far, ``finish_reason`` "aborted"; its slot takes the
        next queued request once no launched round still holds it. Returns False (and
        changes nothing) for a request that had already finished. Under tensor parallelism
        every rank must abort the same request between the same steps.

        Raises:
            KeyError: an id :meth:`submit` did not return, or one already released.
        """
        out = self.output(request_id)
        if out.finished:
            return False
        req = next((r for r in self._queue if r.out is out), None)
        if req is not None:
            self._queue.remove(req)
            out.finish_reason = "aborted"
            return True
        req = next((r for r in self._prefilling if r.out is out), None)
        if req is not None:
            self._prefilling.remove(req)
        else:
            req = next(r for r in self._slots if r is not None and r.out is out)
        self._finish(req, "aborted")
        return True

    def release(self, request_id: int) -> RequestOutput:
        """A finished request's output, which the engine then forgets (a long-running
        engine keeps every output until released; :meth:`generate` releases the ones it
        returns).

        Raises:
            KeyError: an unknown or already released id. ValueError: the request has not
                finished (:meth:`abort` it, or step until it ends).
        """
        out = self.output(request_id)
        if not out.finished:
            raise ValueError(f"request {request_id} has not finished: abort it or step the engine until it ends")
        del self._outputs[int(request_id)]
        return out

    @property
    def busy(self) -> bool:
        """Whether any request is queued, prefilling or decoding (or outputs are unread)."""
        return bool(self._queue or self._prefilling or self._pending or any(s is not None for s in self._slots))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Decodes every prompt to the end (continuous batching over the slots); returns
        the outputs in the prompts' order (released: the engine keeps none of them).
        ``sampling``: one for all or one per prompt.
        ``progress(n)`` is called with the tokens committed after each round. With CUDA
        graphs on an idle engine it first captures every bucket's round graph
        (:meth:`capture_all`; already captured ones are kept)."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
        for i, (p, s) in enumerate(zip(prompts, sampling, strict=True)):  # all or nothing: checked before any is queued
            try:
                self._checked_request(p, max_new_tokens, s)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        if self.use_graphs and not self.busy:
            self.capture_all()  # the round graphs, captured while no request holds a slot
        ids = [self.submit(p, max_new_tokens, s, on_tokens=progress) for p, s in zip(prompts, sampling, strict=True)]
        while self.busy:
            self.step()
        return [self.release(i) for i in ids]

    # ---- the step --------------------------------------------------------------------

    def step(self) -> None:
        """Admits queued requests into free slots, forwards one prefill chunk of every
        request being prefilled, launches one round for the active slots, and reads the
        previous round's committed tokens (on CUDA; on the CPU the round's own), calling
        each request's ``on_tokens(count)``. Returns None; call it while :attr:`busy`."""
        t0 = time.perf_counter()
        self._admit()
        active = [i for i, r in enumerate(self._slots) if r is not None and r.prefilled >= len(r.out.prompt) - 1]
        launched = False
        if active:
            need = max(active) + 1
            b = next(x for x in self.buckets() if x >= need)
            self._launch(b, self._choose_budget(b, len(active)), active)
            launched = True
        # on CUDA the newest round's outputs are read one step later, while the next round runs
        keep = 1 if launched and self.on_cuda else 0
        while len(self._pending) > keep:
            self._read(self._pending.popleft())
        self.stats.wall += time.perf_counter() - t0
        self._count_prefill_gpu(wait=not self.busy)

    def _admit(self) -> None:
        for i in range(self.max_batch):
            if not self._queue:
                break
            if self._slots[i] is None and not self._slot_busy_on_device(i):
                if i in self._dirty:
                    self._clear_slot(i)
                req = self._queue.popleft()
                req.slot = i
                self._slots[i] = req
                self._prefilling.append(req)
        if self._prefilling:
            batch = list(self._prefilling)
            self._prefill_chunk(batch)
            for req in batch:
                if req.prefilled >= len(req.out.prompt) - 1:
                    self._prefilling.remove(req)
                    self._activate(req)

    def _clear_slot(self, slot: int) -> None:
        """Zeros a slot's cache rows, the target's and the drafter's, and the padding rows'
        row (slot 0's last): a request that failed (a NaN or inf in its activations) may
        have left non-finite values there, which attention over masked cache rows (SDPA:
        weight 0 times NaN) would pass to the slot's next requests."""
        for cache in (self.kv, self.drafter_kv):
            for t in ([] if cache is None else list(cache.keys) + list(cache.values)):
                t[slot].zero_()
        for t in list(self.kv.keys) + list(self.kv.values):
            t[0, :, -1].zero_()
        self._dirty.discard(slot)

    def _slot_busy_on_device(self, slot: int) -> bool:
        """A slot freed by the host may still have a launched round whose outputs are
        unread; it is reused only once those are read."""
        return any(slot in launched for *_, launched in self._pending)

    def _prefill_chunk(self, reqs: list[_Request]) -> None:
        """One forward over the next chunk (up to ``prefill_chunk`` tokens) of every
        request being prefilled: the prompt tokens but the last enter the target's cache
        and the drafter's context cache at their slots. Shorter chunks are padded; the
        padding rows write the last cache row, which no round reads."""
        torch = _torch()
        st = self.state
        chunks = []
        for req in reqs:
            prompt = req.out.prompt
            stop = min(len(prompt) - 1, req.prefilled + self.prefill_chunk)
            chunks.append((req, req.prefilled, stop))
        width = max(stop - start for _, start, stop in chunks)
        t0 = time.perf_counter()
        if width > 0:
            if self.on_cuda:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            k, c = len(chunks), width
            graph = None
            if self.use_graphs:  # pad to a captured shape: a bucket of requests x a power-of-two chunk
                k = next(x for x in self.buckets() if x >= len(chunks))
                c = min(max(16, 1 << (width - 1).bit_length()), max(self.prefill_chunk, width))
                graph = (k, c) if k * c <= self._prefill_graph_rows else None
            # padding (rows and whole requests) writes the last cache row of slot 0, which no round reads
            # pinned, so that the copies below queue behind the round in flight instead of
            # waiting for it (torch's pinned-memory cache keeps a buffer until its copy ran)
            pin = self.on_cuda
            ids = torch.zeros((k, c), dtype=torch.long, pin_memory=pin)
            rows = torch.full((k, c), self.capacity - 1, dtype=torch.long, pin_memory=pin)
            slots = torch.zeros(k, dtype=torch.long, pin_memory=pin)
            for i, (req, start, stop) in enumerate(chunks):
                ids[i, : stop - start] = torch.tensor(req.out.prompt[start:stop])
                rows[i, : stop - start] = torch.arange(start, stop)
                slots[i] = req.slot
            if graph is None:
                self._prefill_forward(*(t.to(self.device, non_blocking=True) for t in (ids, rows, slots)))
            else:
                self._prefill_graph(graph, ids, rows, slots)
            self.stats.prefill_tokens += sum(stop - start for _, start, stop in chunks)
            self.stats.prefill_chunks += 1
            if self.on_cuda:
                events[1].record()
                self._prefill_events.append(events)
        for req, _, stop in chunks:
            req.prefilled = stop
            st.lengths[req.slot] = stop  # rounds of other slots write this slot's rows from here on only
        self.stats.prefill_wall += time.perf_counter() - t0
        if not self.on_cuda:
            self.stats.prefill_gpu = self.stats.prefill_wall

    def _count_prefill_gpu(self, wait: bool) -> None:
        """Adds the GPU time of finished prefill chunks to the stats (all of them with
        ``wait``)."""
        ev = self._prefill_events
        while ev and (wait or ev[0][1].query()):
            start, end = ev.popleft()
            end.synchronize()
            self.stats.prefill_gpu += start.elapsed_time(end) / 1e3

    def _prefill_forward(self, ids, rows, slots) -> None:
        """The prefill forward (capturable): target K/V and the drafter's context rows."""
        positions = rows.clamp(max=self.max_length - 1)
        feats = self._forward(ids, positions, rows, self._causal_mask(rows), slot=slots, last_logits_only=True)[1]
        if self.drafter_kv is not None:
            self.drafter_kv.append(feats, rows, slot=slots)

    def _prefill_graph(self, key: tuple[int, int], ids, rows, slots) -> None:
        """Replays the prefill graph of shape ``key`` on these inputs, capturing it on first
        use. The prefill writes the same rows however often it runs, so the capture's
        warm-up runs are this call's prefill."""
        torch = _torch()
        entry = self._prefill_graphs.get(key)
        if entry is not None:
            graph, static = entry
            for dst, src in zip(static, (ids, rows, slots), strict=True):
                dst.copy_(src, non_blocking=True)
            graph.replay()
            return
        static = tuple(t.to(self.device) for t in (ids, rows, slots))
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._prefill_forward(*static)
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._prefill_forward(*static)
        self._prefill_graphs[key] = (graph, static)

    def _activate(self, req: _Request) -> None:
        st, s, sp = self.state, req.slot, req.sampling
        st.lengths[s] = len(req.out.prompt) - 1
        st.roots[s] = req.out.prompt[-1]
        st.temperature[s] = sp.temperature
        st.top_p[s] = sp.top_p
        st.top_k[s] = sp.top_k
        st.seed[s] = sp.seed
        st.offset[s] = 0
        st.remaining[s] = req.cap
        if st.history is not None:  # the prompt's last tokens: a stop sequence may begin in the prompt
            width = st.history.shape[1]
            tail = ([-1] * width + list(req.out.prompt))[-width:]
            st.history[s] = self._torch_tensor(tail)

    def _torch_tensor(self, values):
        torch = _torch()
        return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=False)

    # ---- one round -------------------------------------------------------------------

    def _causal_mask(self, rows):
        """Additive ``[b, 1, q, capacity]``: input row i sees cache rows <= rows[:, i]."""
        torch = _torch()
        visible = self._cols[None, None, :] <= rows[:, :, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min)[:, None]

    def _forward(self, ids, positions, rows, mask, slot=None, last_logits_only=False):
        """The target over ``ids`` ``[b, q]``: logits ``[b, q, V]`` (``[b, 1, V]`` with
        ``last_logits_only``) and the drafter's features ``[b, q, F]`` (None without a
        drafter). ``slot``: None for slots 0 .. b-1, else int64 ``[b]`` slot ids."""
        torch = _torch()
        self.kv.step.rows = rows
        self.kv.step.slots = slot
        kw = {"logits_to_keep": 1} if last_logits_only else {}
        # (engaged also rebinds the model to this engine's cache: another engine may share it)
        with torch.no_grad(), attention.engaged(self.target, self.kv):
            out = self.target(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False,
                              output_hidden_states=bool(self.feature_layers), **kw)
        feats = None
        if self.feature_layers:
            feats = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        return out.logits, feats

    def _round_buffers(self, b: int, n: int) -> dict:
        """The static outputs of the kdtree calls of bucket ``b`` at budget ``n`` (reused
        every round)."""
        buf = self._buffers.get((b, n))
        if buf is None:
            torch = _torch()
            from ..core import cuda as gpu
            from ..core.types import Acceptance, TreeMask

            dev, rows = self.device, n + 1
            path = min(self.depth, n) + 1
            if self.on_cuda:
                like = self.state.lengths
                buf = {"trees": gpu.empty_trees(like, b, n, self.depth)}
                buf["trees"].request_status = torch.zeros(b, dtype=torch.int32, device=dev)
                buf["mask"] = TreeMask(torch.empty((b, rows, self.max_length + rows), dtype=self.dtype, device=dev), None,
                                       torch.empty((b, rows), dtype=torch.int64, device=dev),
                                       torch.empty(b, dtype=torch.int32, device=dev))
                buf["acc"] = Acceptance(torch.empty((b, path), dtype=torch.int32, device=dev),
                                        torch.empty(b, dtype=torch.int32, device=dev),
                                        torch.empty(b, dtype=torch.int32, device=dev),
                                        request_status=torch.empty(b, dtype=torch.int32, device=dev),
                                        target_tokens=torch.empty((b, rows), dtype=torch.int32, device=dev))
                buf["compact_status"] = torch.empty(b, dtype=torch.int32, device=dev)
            else:
                buf = {}
            self._buffers[(b, n)] = buf
        return buf

    def _round(self, b: int, n: int, probe: bool = False) -> None:
        """One round for slots 0 .. b-1 at budget n (module docstring); capturable.
        ``probe`` (budget='auto'): the tree is built at the largest budget, its
        expected-token curve written, and its first n nodes run."""
        st = self.state
        lengths, roots = st.lengths[:b], st.roots[:b]
        buf = self._round_buffers(b, n)
        trees = self._stage_draft_build(b, n, lengths, roots, buf, probe)
        mask = self._stage_mask(trees, lengths, buf)
        logits, feats = self._stage_target(b, n, trees, mask, lengths)
        acc = self._stage_verify(b, trees, logits, buf)
        attn = self.kv.step.status
        if attn is not None:  # the tree-attention kernel failed a request: it fails the round's verify too
            self.kv.step.status = None
            acc.request_status.copy_(_torch().where(attn != 0, attn, acc.request_status))
        self._stage_commit(b, trees, acc, feats, buf)

    def _stage_draft_build(self, b, n, lengths, roots, buf, probe=False):
        torch = _torch()

        if self.drafter_kv is None:  # a root-only tree (AR)
            lp = torch.zeros((b, 0, 0), dtype=torch.float32, device=self.device)
            ids = torch.zeros((b, 0, 0), dtype=torch.int32, device=self.device)
            return self._ops_build(lp, ids, roots, lengths, buf)
        logits = self.drafter_kv.forward(roots, lengths, self.depth)
        return self._build(b, n, logits, lengths, roots, buf, probe)

    def _build(self, b, n, logits, lengths, roots, buf, probe=False):
        """The round's draft trees from the drafter's ``logits`` ``[b, L, V]``: top-k, each
        request's entries deeper than its remaining tokens allow set to -inf (never
        emitted: a request that may commit ``r`` more tokens accepts at most ``r - 1``
        draft tokens, so its tree spends the budget on depths ``1 .. r - 1``), then the
        best-first builder."""
        torch = _torch()
        from ..core import api

        want = self.vocab_size if self.draft_slice is None else int(self.draft_slice[1])
        if logits.shape[-1] != want:
            raise RuntimeError(f"the drafter's logits have {logits.shape[-1]} entries a row, expected {want} (the "
                               + ("whole vocabulary" if self.draft_slice is None else "rank's vocabulary slice")
                               + "): a drafter whose LM head is split by vocabulary that the engine does not know")
        nb = self.budget if probe else n
        full = buf if nb == n else self._round_buffers(b, nb)
        width = max(1, min(nb, self.vocab_size, MAX_WIDTH)) if self.mode == "ddtree" else self.width
        k = max(1, min(width, nb))  # (budget 0: a root-only tree; the sharded top-k takes k >= 1)
        deep = self._depth_rows[None, :, None] >= (self.state.remaining[:b] - 1)[:, None, None]
        if self.on_cuda:
            topk = full.get("topk")
            if topk is None or topk.logprobs.shape[-1] != k:
                from ..core.types import TopK

                shape = (b, self.depth, k)
                topk = full["topk"] = TopK(torch.empty(shape, dtype=torch.float32, device=self.device),
                                           torch.empty(shape, dtype=torch.int32, device=self.device),
                                           torch.empty(shape[:2], dtype=torch.int32, device=self.device))
            if self.draft_slice is None:
                lp, ids = api.topk_logprobs(logits, k, out=topk, errors="status")
            else:  # this rank's slice of the drafter's logits: the ranks' top-k merged (NCCL)
                from ..distributed import topk_logprobs_sharded

                merged = topk_logprobs_sharded(logits, k, self.draft_slice[0], self.vocab_size)
                topk.logprobs.copy_(merged.logprobs)
                topk.ids.copy_(merged.ids)
                lp, ids = topk.logprobs, topk.ids
            lp.masked_fill_(deep, float("-inf"))
            trees = api.build_trees(lp, ids, nb, root_tokens=roots, root_positions=lengths,
                                    vocab_size=self.vocab_size, pad_token=0, out=full["trees"], errors="status")
        else:
            if self.draft_slice is None:  # (a row of NaN drafter logits: a root-only tree, as on the GPU)
                lp, ids = api.topk_logprobs(logits.float().numpy(), k, errors="status")
            else:  # this rank's slice of the drafter's logits: the ranks' top-k merged
                from ..distributed import topk_logprobs_sharded

                top = topk_logprobs_sharded(logits.float(), k, self.draft_slice[0], self.vocab_size)
                lp, ids = top.logprobs.numpy(), top.ids.numpy()
            lp[np.broadcast_to(deep.numpy(), lp.shape)] = -np.inf
            trees = _trees_to_torch(api.build_trees(lp, ids, nb, root_tokens=roots.numpy(),
                                                    root_positions=lengths.numpy(),
                                                    vocab_size=self.vocab_size, pad_token=0, errors="status"))
        if probe:
            # the drafter's expected accepted draft tokens at every budget m: the sum of the first
            # m nodes' path probabilities (nodes come in decreasing score), over the active slots
            active = (self.state.remaining[:b] > 0).to(torch.float64)
            self.state.curve.copy_((trees.logw[:, 1:].exp().cumsum(1) * active[:, None]).sum(0))
            if nb != n:
                trees = truncate_trees(trees, n, buf.get("trees"))
        return trees

    def _ops_build(self, lp, ids, roots, lengths, buf):
        from ..core import api

        if self.on_cuda:
            return api.build_trees(lp, ids, 0, root_tokens=roots, root_positions=lengths, pad_token=0,
                                   out=buf["trees"], errors="status")
        trees = api.build_trees(lp.numpy(), ids.numpy(), 0, root_tokens=roots.numpy(),
                                root_positions=lengths.numpy(), pad_token=0)
        return _trees_to_torch(trees)

    def _stage_mask(self, trees, lengths, buf):
        torch = _torch()
        from ..core import api

        # a budget-N round writes rows below length + N + 1 <= max_length + N + 1: the
        # attention reads those rows only (fewer than the capacity at a smaller auto budget)
        cols = self.max_length + trees.budget + 1
        if self.on_cuda:
            dtype = str(self.dtype).removeprefix("torch.")
            return api.tree_attention_mask(trees, lengths, kind="additive", dtype=dtype, columns=cols,
                                           out=buf["mask"], errors="status")
        m = api.tree_attention_mask(_trees_to_numpy(trees), lengths.numpy(), kind="additive", dtype="float32",
                                    columns=cols)
        from ..core.types import TreeMask

        return TreeMask(torch.from_numpy(np.asarray(m.mask, np.float32)).to(self.dtype), None,
                        torch.from_numpy(m.positions), torch.from_numpy(m.request_status))

    def _stage_target(self, b, n, trees, mask, lengths):
        rows = lengths[:, None] + self._tree_rows[None, : n + 1]
        step = self.kv.step
        step.status = None
        if self.tree_attention == "kdtree" and n > 0:  # (a root-only round is a decode step: SDPA's own)
            step.trees, step.prefix, step.max_prefix = trees, lengths, self.max_length
        try:
            return self._forward(trees.tokens, mask.positions, rows, mask.mask[:, None])
        finally:
            step.trees = step.prefix = None

    def _stage_verify(self, b, trees, logits, buf):
        torch = _torch()
        from ..core import api
        from ..core.types import Acceptance

        st = self.state
        want = self.vocab_size if self.vocab_slice is None else int(self.vocab_slice[1])
        if logits.shape[-1] != want:
            raise RuntimeError(f"the target's logits have {logits.shape[-1]} entries a row, expected {want}: a "
                               "target sharded after the engine was built?")
        caps = st.remaining[:b]
        stops = st.stops if st.stops.numel() else ()
        seq = {}
        if self._stop_prepared is not None:  # on CUDA both used in place (no copy inside the graph)
            hist = st.history[:b]
            seq = {"stop_sequences": self._stop_prepared, "stop_history": hist if self.on_cuda else hist.numpy()}
        if self.on_cuda:
            if self.vocab_slice is not None:  # this rank's slice of the target's logits: the choices merged (NCCL)
                from ..distributed import target_tokens_sharded

                if self.sampling:  # per-request settings on the device (the graph advances the offsets)
                    tokens = target_tokens_sharded(logits, self.vocab_slice[0], self.vocab_size,
                                                   temperature=st.temperature[:b], seed=st.seed[:b],
                                                   offset=st.offset[:b])
                    st.offset[:b] += 1
                else:
                    tokens = target_tokens_sharded(logits, self.vocab_slice[0], self.vocab_size)
                return api.verify_greedy(trees, tokens, stop_tokens=stops, max_commit=caps, out=buf["acc"],
                                         errors="status", **seq)
            if self.sampling:
                acc = api.verify_sample_from_logits(
                    trees, logits, st.temperature[:b], seed=st.seed[:b], offset=st.offset[:b], top_p=st.top_p[:b],
                    top_k=st.top_k[:b], stop_tokens=stops, max_commit=caps, out=buf["acc"], errors="status", **seq)
                st.offset[:b] += 1
                return acc
            return api.verify_greedy_from_logits(trees, logits, stop_tokens=stops, max_commit=caps,
                                                 out=buf["acc"], errors="status", **seq)
        tn = _trees_to_numpy(trees)
        stop_list = sorted(self.stop_tokens)
        if self.vocab_slice is not None:  # this rank's slice of the target's logits: the choices merged
            from ..distributed import target_tokens_sharded

            temps = st.temperature[:b].numpy() if self.sampling else None
            tokens = target_tokens_sharded(logits, self.vocab_slice[0], self.vocab_size, temperature=temps,
                                           seed=st.seed[:b].numpy().astype(np.uint64),
                                           offset=st.offset[:b].numpy().astype(np.uint64))
            acc = api.verify_greedy(tn, tokens.numpy(), stop_tokens=stop_list, max_commit=caps.numpy(),
                                    errors="status", **seq)
            if self.sampling:
                st.offset[:b] += 1
        elif self.sampling:
            x = logits.float().numpy()
            acc = api.verify_sample_from_logits(
                tn, x, st.temperature[:b].numpy(), seed=st.seed[:b].numpy().astype(np.uint64),
                offset=st.offset[:b].numpy().astype(np.uint64), top_p=st.top_p[:b].numpy(),
                top_k=st.top_k[:b].numpy(), stop_tokens=stop_list, max_commit=caps.numpy(), errors="status", **seq)
            st.offset[:b] += 1
        else:  # (a request whose rows hold a NaN fails alone, as on the GPU)
            acc = api.verify_greedy_from_logits(tn, logits.float().numpy(), stop_tokens=stop_list,
                                                max_commit=caps.numpy(), errors="status", **seq)
        return Acceptance(*(torch.from_numpy(np.asarray(a)) for a in (acc.accepted_nodes, acc.accept_length,
                                                                       acc.bonus_token)),
                          request_status=torch.from_numpy(np.asarray(acc.request_status)))

    def _stage_commit(self, b, trees, acc, feats, buf):
        torch = _torch()
        from ..core import api

        st = self.state
        lengths = st.lengths[:b]
        keys = [k[:b] for k in self.kv.keys]
        values = [v[:b] for v in self.kv.values]
        if self.on_cuda:
            api.compact_kv(keys, values, lengths, acc, out=buf["compact_status"], errors="status")
        elif self.dtype in (torch.float16, torch.bfloat16, torch.float32):
            from ..core.types import Acceptance

            api.compact_kv(keys, values, lengths.numpy(),  # (a failed request's path: untouched)
                           Acceptance(acc.accepted_nodes.numpy(), acc.accept_length.numpy(), acc.bonus_token.numpy()),
                           errors="status")
        else:  # float64 (host tests): the same moves as index copies
            for r in range(b):
                if int(acc.request_status[r]) != 0:
                    continue
                m, p = int(acc.accept_length[r]), int(lengths[r])
                src = p + acc.accepted_nodes[r, : m + 1].long()
                for t in keys + values:
                    t[r, :, p: p + m + 1] = t[r, :, src]
        m = acc.accept_length.long()
        bonus = acc.bonus_token
        safe = acc.accepted_nodes.long().clamp(min=0)  # path nodes, root first (padding -> the root)
        tok_path = trees.tokens.gather(1, safe)
        path = safe.shape[1]
        j = self._path_cols[None, :path]
        shifted = torch.cat([tok_path[:, 1:], tok_path[:, :1]], dim=1)
        committed = torch.where(j < m[:, None], shifted,
                                torch.where(j == m[:, None], bonus[:, None].to(shifted.dtype),
                                            torch.full_like(shifted, -1)))
        count = m + (bonus >= 0).long()
        ok = acc.request_status == 0
        count = torch.where(ok, count, torch.zeros_like(count))
        if feats is not None:  # on CUDA a parallel branch (of the graph) beside the updates below
            rows = lengths[:, None] + j  # before the lengths move on below (the branch runs beside them)
            side = self._side_stream
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side) if side is not None else _nullcontext():
                f = feats.gather(1, safe[:, :, None].expand(b, path, feats.shape[-1]))
                self.drafter_kv.append(f, rows)
        last = committed.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0]
        has = count > 0
        st.roots[:b] = torch.where(has, last.to(torch.int32), st.roots[:b])
        st.lengths[:b] += count
        stopped = has & torch.isin(last, st.stops) if st.stops.numel() else torch.zeros_like(has)
        if st.history is not None:  # the history moves on by the committed tokens; a completed sequence ends
            width = st.history.shape[1]
            joined = torch.cat([st.history[:b], committed.to(torch.int32)], dim=1)
            st.history[:b] = joined.gather(1, count[:, None] + self._history_cols[None, :])
            for row in self._stop_rows:
                stopped = stopped | (has & (st.history[:b, width - row.shape[0]:] == row[None, :]).all(1))
        # a failed request (bad logits) ends: its remaining count goes to 0
        st.remaining[:b] = torch.where(stopped | ~ok, torch.zeros_like(count), st.remaining[:b] - count)
        st.out_tokens[:b, :path] = committed.to(torch.int32)
        st.out_counts[:b] = count.to(torch.int32)
        st.out_status[:b] = acc.request_status.to(torch.int32)
        if feats is not None and self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)

    # ---- launching and reading -------------------------------------------------------

    def _pinned_set(self, torch):
        return [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._outputs_of_round()]

    def _launch(self, b: int, n: int, active: list[int]) -> None:
        probe = self.auto and self._auto_rounds % AUTO_PROBE_EVERY == 0
        self._auto_rounds += self.auto
        if self.use_graphs:
            graph = self._graphs.get((b, n, probe))
            if graph is None:
                graph = self._capture(b, n, probe)
            graph.replay()
        else:
            self._round(b, n, probe)
        self.stats.rounds += 1
        self.stats.target_rows += b * (n + 1)
        self.budget_counts[n] = self.budget_counts.get(n, 0) + 1
        self.round_counts[(b, n)] = self.round_counts.get((b, n), 0) + 1
        if self.on_cuda:
            k = self._flip
            self._flip ^= 1
            host = self._pinned[k]  # the round that used it was read in an earlier step
            for h, d in zip(host, self._outputs_of_round(), strict=True):
                h.copy_(d, non_blocking=True)
            self._events[k].record()
            self._pending.append((host, self._events[k], n, probe, set(active)))
        else:
            host = [t.clone() for t in self._outputs_of_round()]
            self._pending.append((host, None, n, probe, set(active)))

    def _outputs_of_round(self) -> tuple:
        st = self.state  # the expected-token curve only for budget='auto', which reads it
        return (st.out_tokens, st.out_counts, st.out_status, st.remaining) + ((st.curve,) if self.auto else ())

    def _read(self, pending: tuple) -> None:
        host, event, n, probe, launched = pending
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            self.stats.host_wait += time.perf_counter() - t0
        tokens, counts, status, remaining, *curve = host
        # plain Python values once, not numpy scalars per slot (this loop is the host's
        # share of a round at large batches)
        top = max(launched) + 1 if launched else 0
        counts, status, remaining = (t[:top].tolist() for t in (counts, status, remaining))
        if self.auto:
            live = [s for s in launched if self._slots[s] is not None and status[s] == 0]
            if self._curve is not None and live:
                self._calibration[0] += sum(max(counts[s] - 1, 0) for s in live)
                self._calibration[1] += len(live) * float(self._curve[n - 1])
            if probe and live:
                per = curve[0].numpy() / len(live)
                w = AUTO_CURVE_WEIGHT
                self._curve = per.copy() if self._curve is None else (1 - w) * self._curve + w * per
        rows = tokens[:top].tolist()
        stops, stats = self.stop_tokens, self.stats
        calls = []  # (callback, count): called once the whole round is read
        for s in sorted(launched):
            req = self._slots[s]
            if req is None:
                continue
            c = counts[s]
            out = req.out
            if status[s] != 0:
                from .._native import STATUS_NAMES

                out.error = (f"the round failed with {STATUS_NAMES.get(status[s], status[s])} "
                             f"(slot {s}, after {len(out.tokens)} tokens)")
                self._finish(req, "error")
                continue
            stats.slot_rounds += 1
            if c == 0:
                continue
            new = rows[s][:c]
            own = _request_stop(req.sampling, out.prompt, out.tokens, new)  # (cut, reason) or None
            if own is not None:
                c = own[0]
                new = new[:c]
            out.tokens.extend(new)
            out.rounds += 1
            out.committed.append(c)
            stats.tokens += c
            if req.on_tokens is not None:
                calls.append((req.on_tokens, c))
            if new[-1] in stops:
                self._finish(req, "stop_token")
            elif own is not None:
                self._finish(req, own[1])
            elif self.stop_sequences and _ends_with_one(out.prompt, out.tokens, self.stop_sequences):
                self._finish(req, "stop_sequence")
            elif remaining[s] <= 0:
                self._finish(req, "max_new_tokens" if len(out.tokens) >= req.max_new_tokens else "length")
        # The callbacks run after every slot of the round is read and every request that
        # ended is finished, so that one that raises (or aborts a request) leaves the
        # engine consistent; the first exception is raised after all of them ran.
        failure = None
        for callback, count in calls:
            try:
                callback(count)
            except BaseException as exc:  # noqa: BLE001 (re-raised below)
                failure = failure or exc
        if failure is not None:
            raise failure

    def _finish(self, req: _Request, reason: str) -> None:
        if req.out.finish_reason is None:
            req.out.finish_reason = reason
        if reason == "error" and req.slot >= 0:
            self._dirty.add(req.slot)  # cleared before the slot's next request
        if req.slot >= 0 and self._slots[req.slot] is req:
            self._slots[req.slot] = None
            self.state.remaining[req.slot] = 0

    def _capture(self, b: int, n: int, probe: bool = False):
        """Captures bucket ``b``'s round at budget ``n`` (after two warm-up rounds on a
        side stream, which commit nothing: every slot is checked inactive first)."""
        self._check_idle_for_capture(b)
        return self._capture_unchecked(b, n, probe)

    def _capture_unchecked(self, b: int, n: int, probe: bool = False):
        torch = _torch()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._round(b, n, probe)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._round(b, n, probe)
        self._graphs[(b, n, probe)] = graph
        return graph

    def _check_idle_for_capture(self, b: int) -> None:
        """Capturing runs the round for real (warm-up): only before any request holds a
        slot. :meth:`capture_all` captures every bucket up front."""
        if any(r is not None for r in self._slots) or self._pending:
            raise RuntimeError("CUDA graphs are captured while no request holds a slot: call capture_all() "
                               "before submitting requests (generate() does on an idle engine)")

    def buckets(self) -> list[int]:
        """The batch buckets: 1, 2, 4, ... up to max_batch (which is always one)."""
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return out + [self.max_batch]

    def capture_all(self, buckets: Sequence[int] | None = None, *, prefill: bool = False) -> None:
        """Captures each bucket's round (default every bucket; CUDA graphs, a no-op
        without them). Runs the warm-up rounds on idle slots, so it must come before the
        first request. ``prefill``: also every prefill graph shape (requests bucket x
        power-of-two chunk up to ``prefill_chunk``) that fits the prefill graphs' size
        limit, with padding inputs (which write only the unused last cache row), instead
        of capturing each on its first use."""
        if not self.use_graphs:
            return
        torch = _torch()
        if prefill:
            self._check_idle_for_capture(0)
            for k in self.buckets():
                c = 16
                while True:
                    width = min(c, self.prefill_chunk)
                    if k * width <= self._prefill_graph_rows and (k, width) not in self._prefill_graphs:
                        self._prefill_graph((k, width), torch.zeros((k, width), dtype=torch.long),
                                            torch.full((k, width), self.capacity - 1, dtype=torch.long),
                                            torch.zeros(k, dtype=torch.long))
                    if width >= self.prefill_chunk:
                        break
                    c *= 2
        for b in self.buckets() if buckets is None else buckets:
            if b not in self.buckets():
                raise ValueError(f"bucket {b} is not one of {self.buckets()}")
            for n in self.budgets:
                for probe in (False, True) if self.auto else (False,):
                    if (b, n, probe) not in self._graphs:
                        self._capture(b, n, probe)
                if self.auto and (b, n) not in self.costs:  # the cost model: each round's GPU time
                    graph = self._graphs[(b, n, False)]
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    graph.replay()
                    times = []
                    for _ in range(3):  # the median of three batches of ten replays
                        start.record()
                        for _ in range(10):
                            graph.replay()
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end) / 10)
                    self.costs[(b, n)] = float(np.median(times))
        if self.auto and self.tp > 1:  # rank 0's costs on every rank: every rank picks the same budgets
            import torch.distributed as dist

            shared = [self.costs]
            dist.broadcast_object_list(shared, src=0)
            self.costs = shared[0]
        self.state.offset.zero_()
        torch.cuda.synchronize(self.device)

    def _choose_budget(self, b: int, active: int) -> int:
        """The budget of the next round: fixed, or with budget='auto' the one that
        maximises expected tokens per second for this batch: active requests x (1 + c x
        the expected accepted draft tokens a request at that budget) / the round's
        measured GPU time. The expected tokens are the drafter's path probabilities of a
        tree's first n nodes, summed, averaged over the probe rounds (every
        ``AUTO_PROBE_EVERY``-th round builds at the largest budget); c is the ratio of
        accepted to expected draft tokens over the rounds read (kept in [0.05, 2])."""
        if not self.auto:
            return self.budget
        if self._curve is None:  # no probe read yet
            return self.budgets[len(self.budgets) // 2]
        acc, pred = self._calibration
        c = min(2.0, max(0.05, acc / pred)) if pred > 0 else 1.0
        best, best_rate = self.budgets[0], -1.0
        for n in self.budgets:
            cost = self.costs.get((b, n))
            if cost is None:  # CPU or no graphs: the round's time grows with its rows
                cost = 1.0 + b * (n + 1) / 4096
            rate = active * (1.0 + c * float(self._curve[n - 1])) / cost
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def profile_round(self, b: int, *, context: int | None = None, iters: int = 10,
                      repeats: int = 5) -> dict[str, float]:
        """GPU milliseconds of bucket ``b``'s round and of each of its stages, each
        captured alone in a CUDA graph and replayed (a benchmark aid; CUDA graphs only,
        idle engine only). Every slot of the bucket is made active with ``context``
        cached positions (zeros in the caches; default: up to 256, what the cache leaves
        room for) and restored to idle afterwards; each
        timed batch of ``iters`` replays starts from the same state. Returns
        ``{"draft", "build", "mask", "target", "verify", "commit", "round"}`` (draft 0 in
        mode "ar"), the median over ``repeats`` batches of the mean per replay."""
        torch = _torch()
        if not self.use_graphs:
            raise RuntimeError("profile_round needs CUDA graphs")
        self._check_idle_for_capture(b)
        room = self.capacity - 2 * iters * (self.path + 1) - self.budget - 1
        context = min(256, room) if context is None else int(context)
        if context < 0 or context > room:
            raise ValueError(f"context {context} leaves too few cache rows for {iters} rounds (capacity "
                             f"{self.capacity}); build the engine with a larger max_length")

        st = self.state
        lengths, roots = st.lengths[:b], st.roots[:b]
        n = self.budget
        buf = self._round_buffers(b, n)
        cur = torch.cuda.current_stream(self.device)

        def reset():
            st.lengths[:b] = context
            st.roots[:b] = 1
            st.remaining[:b] = 1 << 40

        def capture(fn):
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                fn()
                fn()
            cur.wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return g

        reset()
        if (b, n, False) not in self._graphs:
            self._capture_unchecked(b, n)
        with torch.no_grad():
            dl = self.drafter_kv.forward(roots, lengths, self.depth) if self.drafter_kv is not None else None
            trees = self._stage_draft_build(b, n, lengths, roots, buf)
            mask = self._stage_mask(trees, lengths, buf)
            logits, feats = self._stage_target(b, n, trees, mask, lengths)
            acc = self._stage_verify(b, trees, logits, buf)
        graphs = {"round": self._graphs[(b, n, False)]}
        if dl is not None:
            graphs["draft"] = capture(lambda: self.drafter_kv.forward(roots, lengths, self.depth))
            graphs["build"] = capture(lambda: self._build(b, n, dl, lengths, roots, buf))
        else:
            graphs["build"] = capture(lambda: self._stage_draft_build(b, n, lengths, roots, buf))
        graphs["mask"] = capture(lambda: self._stage_mask(trees, lengths, buf))
        graphs["target"] = capture(lambda: self._stage_target(b, n, trees, mask, lengths))
        graphs["verify"] = capture(lambda: self._stage_verify(b, trees, logits, buf))
        graphs["commit"] = capture(lambda: self._stage_commit(b, trees, acc, feats, buf))
        out = {"draft": 0.0}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name, g in graphs.items():
            times = []
            for _ in range(repeats):
                reset()
                start.record()
                for _ in range(iters):
                    g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / iters)
            out[name] = float(np.median(times))
        st.lengths[:b] = 0
        st.remaining[:b] = 0
        st.roots[:b] = 0
        torch.cuda.synchronize(self.device)
        return {k: out[k] for k in (*ROUND_STAGES, "round")}

    def reset_stats(self) -> None:
        self._count_prefill_gpu(wait=True)
        self.stats = EngineStats()


def _request_stop(sampling, prompt, before, new) -> tuple[int, str] | None:
    """Where a request's own stops end it within a round's committed tokens ``new`` (after
    ``before``, the request's earlier tokens): (tokens of ``new`` kept, "stop_token" or
    "stop_sequence") at the first token that is one of ``sampling.stop_token_ids`` or
    completes one of ``sampling.stop_sequences`` in prompt + before + new; None if none
    does."""
    ids, seqs = sampling.stop_token_ids, sampling.stop_sequences
    if not ids and not seqs:
        return None
    # the last 15 tokens before the round: enough for a 16-token sequence ending in it
    stream = (list(prompt[-15:]) + list(before))[-15:] if len(before) < 15 else list(before[-15:])
    for j, t in enumerate(new):
        stream.append(t)
        if t in ids:
            return j + 1, "stop_token"
        for q in seqs:
            if len(stream) >= len(q) and tuple(stream[-len(q):]) == q:
                return j + 1, "stop_sequence"
    return None


def _ends_with_one(prompt, tokens, sequences) -> bool:
    """Whether the stream prompt + tokens ends with one of the token sequences."""
    for q in sequences:
        m = len(q)
        tail = (list(prompt[-m:]) + list(tokens))[-m:] if len(tokens) < m else tokens[-m:]
        if len(tail) == m and tuple(tail) == tuple(q):
            return True
    return False


def truncate_trees(trees, n: int, out=None):
    """The first ``n`` draft nodes of torch ``trees`` (budget >= n) as a budget-``n``
    TreeBatch: a DDTree tree's nodes come in pop order, so this is the tree a build at
    budget ``n`` gives (with top-k of at least ``n``). Links to later nodes become -1.
    Writes ``out`` (a budget-``n`` TreeBatch of the same batch) when given; capturable."""
    torch = _torch()
    from ..core.types import TreeBatch

    r = n + 1
    words = (r + 31) // 32
    fields = {
        "num_nodes": trees.num_nodes.clamp(max=n),
        "tokens": trees.tokens[:, :r], "depths": trees.depths[:, :r], "parents": trees.parents[:, :r],
        "logw": trees.logw[:, :r], "positions": trees.positions[:, :r],
        "visibility": trees.visibility[:, :r, :r], "visibility_bits": trees.visibility_bits[:, :r, :words],
        "first_child": torch.where(trees.first_child[:, :r] > n, -1, trees.first_child[:, :r]),
        "next_sibling": torch.where(trees.next_sibling[:, :r] > n, -1, trees.next_sibling[:, :r]),
    }
    if out is None:
        out = TreeBatch(**{k: v.contiguous().clone() for k, v in fields.items()}, budget=n, depth=trees.depth)
        out.request_status = trees.request_status.clone()
        return out
    for k, v in fields.items():
        getattr(out, k).copy_(v)
    out.budget, out.depth = n, trees.depth
    if out.request_status is None:
        out.request_status = trees.request_status.clone()
    else:
        out.request_status.copy_(trees.request_status)
    return out


def _trees_to_torch(trees):
    """A host TreeBatch's arrays as CPU torch tensors (the CPU round's representation)."""
    torch = _torch()
    from ..core.types import TREE_FIELDS, TreeBatch

    fields = {name: torch.from_numpy(np.ascontiguousarray(getattr(trees, name))) for name in TREE_FIELDS}
    out = TreeBatch(**fields, budget=trees.budget, depth=trees.depth)
    out.request_status = torch.from_numpy(np.asarray(trees.request_status))
    return out


def _trees_to_numpy(trees):
    from ..core.types import TREE_FIELDS, TreeBatch

    return TreeBatch(**{name: getattr(trees, name).numpy() for name in TREE_FIELDS}, budget=trees.budget,
                     depth=trees.depth)
