"""A Hugging Face ``transformers`` causal LM as the DDTree target (the engine's
:class:`kdtree.engine.Target`), with tree-attention verification and KV-cache compaction.

Imports torch and transformers on first use; the rest of :mod:`kdtree` never does.

Supported: decoder-only models whose ``forward`` takes ``position_ids`` and a 4-D additive
``attention_mask`` and keeps its KV cache in a :class:`transformers.DynamicCache` whose
``layers[i].keys`` / ``.values`` are ``[batch, kv_heads, seq, head_dim]`` (Llama, Qwen2,
Qwen3 and their relatives). Tested against transformers 5.24.0 (pinned in ``noxfile.py``);
other 5.x releases with ``DynamicCache.layers`` should work. Models are loaded from a local
folder only (``local_files_only=True``: no network).

How one round maps onto the model (Ringel & Romano, arXiv 2604.12989, section 3; the
project spec ``ddtree-tree-build.md``, "Verification"):

- The cache holds every committed token but the last one; the last (the root of the next
  draft tree) enters the cache as row 0 of the next tree forward, as DFlash and DDTree do.
- :meth:`HFTarget.score_tree`: one forward over the root and the draft nodes, position ids
  ``trees.positions`` (root position + depth) and a 4-D additive mask: every cached token
  visible, inside the tree each node sees itself and its ancestors
  (``trees.visibility``); padding rows are not forwarded. The model's choice at each node is
  the argmax of its logits (greedy, ties to the lower id) or one draw from
  ``softmax(logits / temperature)`` restricted to the top-p nucleus, keyed by the seed and
  the drawn token's position (the autoregressive step at that position makes the same
  draw, so sampled text is identical with and without speculation); the walk
  (``verify_greedy``) then keeps the target's output distribution exactly.
- :meth:`HFTarget.commit`: the accepted nodes' K and V rows move to the rows right after
  the prefix (:func:`kdtree.compact_kv`: one launch on the GPU, row copies on the host) and
  the cache is cropped to them; the bonus token stays out of the cache (next root).
- :meth:`HFTarget.drafter_features`: hidden states of chosen layers at every cached
  position, for a drafter that conditions on them (DFlash-style, :mod:`kdtree.drafter`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# The transformers release the project tests against (noxfile.py installs it).
TESTED_TRANSFORMERS = "5.24.0"
# Smallest sampling temperature (as the GPU sampler's): logits / T must stay finite.
MIN_TEMPERATURE = 1e-6


def check_tree_structure(trees: Any, past: int) -> None:
    """Request 0 of ``trees`` is a tree the target can score: parents precede children,
    depths follow the parent links, positions are ``past + depth`` and each node row of
    the visibility is its ancestors and itself, each padding row only itself. Raises
    ValueError naming the first bad row (a TreeBatch from kdtree.build_trees passes)."""
    n = int(trees.num_nodes[0])
    rows = int(trees.budget) + 1
    if not 0 <= n < rows:
        raise ValueError(f"trees.num_nodes[0] = {n} is outside [0, budget {rows - 1}]")
    parents = np.asarray(trees.parents[0], dtype=np.int64)
    depths = np.asarray(trees.depths[0], dtype=np.int64)
    positions = np.asarray(trees.positions[0], dtype=np.int64)
    vis = np.asarray(trees.visibility[0], dtype=bool)
    if vis.shape != (rows, rows):
        raise ValueError(f"trees.visibility[0] has shape {vis.shape}, expected ({rows}, {rows})")
    want = np.zeros((rows, rows), dtype=bool)
    want[0, 0] = True
    for i in range(1, n + 1):
        p = int(parents[i])
        if not 0 <= p < i or depths[i] != depths[p] + 1:
            raise ValueError(f"tree row {i}: parent {p} / depth {int(depths[i])} is not a valid tree link")
        want[i] = want[p]
        want[i, i] = True
    for i in range(n + 1, rows):
        want[i, i] = True
    if (positions[: n + 1] != past + depths[: n + 1]).any():
        bad = int(np.nonzero(positions[: n + 1] != past + depths[: n + 1])[0][0])
        raise ValueError(f"tree row {bad}: position {int(positions[bad])}, expected {past} + depth "
                         f"{int(depths[bad])}")
    if not np.array_equal(vis, want):
        bad = int(np.nonzero((vis != want).any(axis=1))[0][0])
        raise ValueError(f"tree row {bad}: the visibility row is not that node's ancestors and itself")


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("kdtree.hf needs PyTorch (pip install torch); the rest of kdtree does not") from exc
    return torch


class NonFiniteLogitsError(ValueError):
    """The target's logits hold a NaN: a broken model (weights or inputs), reported instead
    of decoding an arbitrary token."""


def load_causal_lm(path: str | Path, *, device: str = "cpu", dtype: Any = None, tp: bool = False,
                   vocab_sharded_head: bool = False):
    """Load a causal LM from a local folder (config + safetensors), in eval mode.

    Args:
        path: folder written by ``save_pretrained`` (no hub access is attempted).
        device: torch device string, e.g. ``"cpu"`` or ``"cuda"``.
        dtype: torch dtype or its name (``"float64"``, ``"bfloat16"``); default: the
            checkpoint's.
        tp: shard the model over the ranks of the initialised ``torch.distributed`` world
            with transformers' own tensor-parallel plan (``tp_plan="auto"``: attention heads
            and MLP columns split, the LM head whole on every rank), launched with
            ``torchrun``: gloo on CPUs, NCCL on GPUs (each rank on ``cuda:LOCAL_RANK``;
            ``device`` is then ignored). Every rank must run the same calls: the engine's
            round is deterministic, so every rank commits the same tokens.
        vocab_sharded_head: with ``tp``, split the LM head by vocabulary and leave each
            rank its slice of the logits (never gathered): the model gets
            ``kdtree_vocab_slice = (offset, size)``, which :class:`HFTarget` (greedy) and a
            DFlash drafter over this target read to merge their choices and top-k through
            :mod:`kdtree.distributed` (a few numbers a row instead of the vocabulary). Not
            for a model whose LM head is tied to its embedding.

    Raises:
        FileNotFoundError: ``path`` is not a folder with a ``config.json``.
        ValueError: weights the model needs are missing from the checkpoint or have
            another shape (transformers would initialise them at random); with ``tp``: no
            initialised process group, a model transformers has no tensor-parallel plan
            for, or attention / key-value heads that the world size does not divide.
        ImportError: torch or transformers is missing (with ``tp``: accelerate, which
            transformers' tensor-parallel loading needs).
    """
    torch = _torch()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar on stderr

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a folder written by save_pretrained)")
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
        dtype = getattr(torch, dtype)
    extra = {}
    if vocab_sharded_head and not tp:
        raise ValueError("vocab_sharded_head=True needs tp=True")
    if tp:
        extra["tp_plan"] = _tp_plan(folder, vocab_sharded_head)
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=dtype,
                                                       output_loading_info=True, **extra)
    # transformers initialises missing weights randomly and only reports it: refuse instead
    # (a tied LM head is not a missing weight: transformers leaves it out of the report)
    problems = [f"{what} {sorted(info.get(key) or [])[:5]}" for key, what in
                (("missing_keys", "weights missing from the checkpoint:"),
                 ("mismatched_keys", "weights of another shape:")) if info.get(key)]
    if problems:
        raise ValueError(f"{folder}: " + "; ".join(problems) + " (they would be initialised at random)")
    if tp:
        import torch.distributed as dist

        # every rank loads the same model the same way, or every rank raises (a rank that
        # differs would otherwise pair its next collective with another one of the others')
        mine = {"vocab_sharded_head": bool(vocab_sharded_head), "model": type(model).__name__,
                "dtype": str(next(model.parameters()).dtype), "vocab_size": int(model.config.vocab_size)}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for r, theirs in enumerate(every):
            for key, value in theirs.items():
                if value != every[0][key]:
                    raise ValueError(f"every rank must load the same model the same way: rank {r} has {key} = "
                                     f"{value!r}, rank 0 {every[0][key]!r}")
        if dist.get_world_size() == 1:
            # transformers applies no plan to a world of one rank and leaves the model on
            # the CPU: put it where a rank of a larger world would be
            model.to(_rank_device(torch, dist))
        if vocab_sharded_head:
            model.kdtree_vocab_slice = _vocab_slice(model)
        return model.eval()  # transformers placed each rank's shard on its device
    return model.to(device).eval()


def _rank_device(torch: Any, dist: Any):
    """This rank's device under tensor parallelism: the current CUDA device where the
    world's backend is NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _vocab_slice(model: Any) -> tuple[int, int]:
    """(offset, size) of this rank's rows of the vocabulary-sharded LM head: the ranks'
    sizes gathered, offsets in rank order."""
    import torch.distributed as dist

    w = model.get_output_embeddings().weight
    size = int((w.to_local() if hasattr(w, "to_local") else w).shape[0])
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, size)
    offset = sum(sizes[: dist.get_rank()])
    if sum(sizes) != int(model.config.vocab_size):
        raise ValueError(f"the LM head's slices {sizes} do not make the vocabulary of {model.config.vocab_size}")
    # on the head module too: a drafter that holds the target's head (DFlash) reads it there,
    # whether it was built before or after the sharding
    model.get_output_embeddings().kdtree_vocab_slice = (offset, size)
    return offset, size


def _tp_plan(folder: Path, vocab_sharded_head: bool = False) -> str | dict:
    """"auto" (or, with vocab_sharded_head, transformers' plan with the LM head split by
    vocabulary and not gathered) after the checks transformers leaves to a failure deep in
    its loading."""
    import importlib.util

    import torch.distributed as dist
    from transformers import AutoConfig

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("tp=True needs an initialised torch.distributed process group (launch with torchrun, "
                         "then torch.distributed.init_process_group)")
    if importlib.util.find_spec("accelerate") is None:
        raise ImportError("tp=True needs accelerate (transformers' tensor-parallel loading uses it): "
                          "pip install accelerate")
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(f"{folder}: transformers has no tensor-parallel plan for {type(config).__name__}")
    world = dist.get_world_size()
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = int(getattr(config, key, 0) or 0)
        if heads % world:
            raise ValueError(f"{folder}: {key} = {heads} is not a multiple of the world size {world}")
    if not vocab_sharded_head:
        return "auto"
    try:
        return tp_plan_of(config, vocab_sharded_head=True)
    except ValueError as exc:
        raise ValueError(f"{folder}: {exc}") from None


def tp_plan_of(config: Any, *, vocab_sharded_head: bool = False) -> dict[str, str]:
    """transformers' tensor-parallel plan for a causal LM of ``config`` (module-name
    patterns, ``*`` for a layer number, to parallel styles): the base model's plan under its
    prefix and the LM head's; with ``vocab_sharded_head`` the head is ``"colwise"`` (each
    rank keeps its slice of the logits).

    Raises:
        ValueError: no plan for the model, a head tied to the embedding with
            ``vocab_sharded_head``, or a plan that does not name ``lm_head``.
    """
    from transformers import AutoModelForCausalLM

    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(f"transformers has no tensor-parallel plan for {type(config).__name__}")
    if vocab_sharded_head and getattr(config, "tie_word_embeddings", False):
        raise ValueError("vocab_sharded_head needs an LM head of its own (tie_word_embeddings is set)")
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    prefix = getattr(cls, "base_model_prefix", "model")
    plan = {f"{prefix}.{k}": v for k, v in config.base_model_tp_plan.items()}
    plan.update(getattr(cls, "_tp_plan", None) or {})
    if "lm_head" not in plan:
        raise ValueError(f"transformers' plan for {cls.__name__} does not name lm_head")
    if vocab_sharded_head:
        plan["lm_head"] = "colwise"
    return plan


def shard_causal_lm(model: Any, *, vocab_sharded_head: bool = False) -> Any:
    """Shards an already built causal LM (e.g. random weights of a published shape, for a
    benchmark) over the initialised ``torch.distributed`` world with transformers' own
    tensor-parallel plan (:func:`tp_plan_of`), as ``load_causal_lm(..., tp=True)`` loads
    one: every rank must hold the same full weights before the call; each keeps its shard
    (DTensors on a one-dimensional device mesh of the model's device type). With
    ``vocab_sharded_head`` the model gets ``kdtree_vocab_slice`` as from
    :func:`load_causal_lm`. Returns the model.

    Raises:
        ValueError: no initialised process group; heads the world size does not divide;
            as :func:`tp_plan_of`.
    """
    import re

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_causal_lm needs an initialised torch.distributed process group")
    if any(getattr(p, "device_mesh", None) is not None for p in model.parameters()):
        raise ValueError("the model is sharded already (shard_causal_lm or load_causal_lm(tp=True)): shard a whole "
                         "model once")
    world = dist.get_world_size()
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = int(getattr(model.config, key, 0) or 0)
        if heads % world:
            raise ValueError(f"{key} = {heads} is not a multiple of the world size {world}")
    plan = tp_plan_of(model.config, vocab_sharded_head=vocab_sharded_head)
    patterns = [(re.compile("^" + re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in plan.items()]
    expanded = {}  # a module's name: its forward hooks; its parameters' names: their shards
    for name, module in model.named_modules():
        for rx, style in patterns:
            if rx.match(name):
                expanded[name] = style
                for pname, _ in module.named_parameters(recurse=False):
                    expanded[f"{name}.{pname}"] = style
    mesh = init_device_mesh(next(model.parameters()).device.type, (world,))
    apply_tensor_parallelism(model, mesh, expanded)
    if vocab_sharded_head:
        model.kdtree_vocab_slice = _vocab_slice(model)
    return model


class HFTarget:
    """A transformers causal LM holding one sequence, for :mod:`kdtree.engine`.

    Args:
        model: a loaded causal LM (:func:`load_causal_lm`), any device and float dtype.
        temperature: 0 for greedy decoding (argmax, ties to the lower token id); > 0
            samples each choice from ``softmax(logits / temperature)``.
        top_p: nucleus size for sampling, in (0, 1]: the smallest set of most likely tokens
            whose probability reaches ``top_p`` (at least one token) is renormalised.
        seed: sampling seed, in [0, 2**63). A draw is keyed by the seed and the position of
            the token it chooses (:func:`keyed_uniforms`), not by the order of calls: the
            same seed gives the same text with and without speculation (a tree row and the
            autoregressive step for one position use the same draw), run after run.
        feature_layers: indices into the model's hidden states (0 = embeddings, i = output
            of layer i) returned by :meth:`drafter_features`, concatenated; empty: none.
        sampler: how a draw is made at temperature > 0: ``"inverse_cdf"`` (default: the
            first token id whose cumulative probability, float64 in id order, exceeds the
            keyed uniform; takes top_p) or ``"gumbel"``: the argmax of ``logit / T`` minus
            Philox4x32-10 Gumbel noise keyed by (seed, the chosen token's position, token
            id), in float32, as :func:`kdtree.verify_sample_from_logits` draws (request 0,
            node = position, offset 0); each token's noise depends on its id alone, so a
            vocabulary-sharded LM head gives the same draws (top_p must be 1).

    Raises:
        ValueError: temperature < 0, top_p outside (0, 1], a feature layer out of range,
            an unknown sampler, top_p < 1 with the Gumbel sampler, sampling from a
            vocabulary-sharded head with the inverse-CDF sampler.
    """

    def __init__(self, model: Any, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 feature_layers: Sequence[int] = (), sampler: str = "inverse_cdf"):
        if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        cfg = model.config
        from .attention import check_full_attention

        check_full_attention(cfg)
        n_layers = int(model.config.num_hidden_layers)
        layers = tuple(int(i) for i in feature_layers)
        for i in layers:
            if not 0 <= i <= n_layers:
                raise ValueError(f"feature layer {i} outside [0, {n_layers}] (hidden states of a "
                                 f"{n_layers}-layer model)")
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        # (offset, size) of a vocabulary-sharded LM head (load_causal_lm(vocab_sharded_head=
        # True)): the logits are this rank's slice, merged by kdtree.distributed.
        self.vocab_slice = getattr(model, "kdtree_vocab_slice", None)
        if sampler not in ("inverse_cdf", "gumbel"):
            raise ValueError(f"sampler must be 'inverse_cdf' or 'gumbel', got {sampler!r}")
        if sampler == "gumbel" and top_p < 1.0:
            raise ValueError(f"the Gumbel sampler takes no top_p cut (got top_p {top_p}); use sampler='inverse_cdf'")
        if self.vocab_slice is not None and temperature != 0.0 and sampler != "gumbel":
            raise ValueError("sampling from a vocabulary-sharded LM head needs sampler='gumbel' (the inverse-CDF "
                             "draw reads the whole distribution)")
        self.sampler = sampler
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.feature_layers = layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)  # 0: unknown
        self.seed = int(seed)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache = None
        self._committed: list[int] = []
        self._features = None       # [cached positions, F] or None
        self._pending = None        # what the last forward left for commit()
        self._broken = None         # why the state is undefined (a commit failed midway), or None
        self.forwards = 0           # model calls so far (prefill included)

    # ---- the engine's Target protocol ------------------------------------------------

    def prefill(self, prompt: Sequence[int]) -> None:
        """Start a sequence: every prompt token but the last enters the cache (the last is
        the first tree's root). Raises ValueError on an empty prompt or a token outside
        ``[0, vocab)``."""
        tokens = self._check_tokens(prompt, "prompt")
        if not tokens:
            raise ValueError("the prompt must hold at least one token")
        self._cache = None
        self._features = None
        self._pending = None
        self._broken = None
        self._committed = list(tokens)
        if len(tokens) > 1:
            _, hidden = self._forward(tokens[:-1], list(range(len(tokens) - 1)), None)
            self._append_features(hidden)

    def next_token(self) -> int:
        """One autoregressive step: the root (last committed token) enters the cache and
        the model's choice after it is returned (argmax or a draw, as configured)."""
        self._require_sequence()
        self._require_no_pending()
        pos = len(self._committed) - 1
        logits, hidden = self._forward([self._committed[-1]], [pos], None)
        self._pending = ("ar", hidden)
        return int(self.choose(logits, [pos + 1])[0])

    def tree_logits(self, trees: Any) -> Any:
        """The tree forward alone: logits ``[n+1, V]`` (torch, the model's dtype) of the
        root and the ``n = num_nodes`` draft nodes of request 0 of ``trees`` (a
        :class:`kdtree.TreeBatch` with one request whose root is the last committed token
        and whose root position is the cache length). Padding rows are not forwarded.

        Raises:
            ValueError: more than one request, a root that is not the last committed token
                or not at the cache's length, a node token outside ``[0, vocab)``.
        """
        torch = _torch()
        self._require_sequence()
        self._require_no_pending()
        if trees.batch != 1:
            raise ValueError(f"HFTarget holds one sequence; trees has {trees.batch} requests")
        past = len(self._committed) - 1
        n = int(trees.num_nodes[0])
        rows = n + 1  # the root and the nodes; padding rows would only cost compute
        tokens = np.asarray(trees.tokens[0], dtype=np.int64).copy()
        if int(tokens[0]) != self._committed[-1] or int(trees.positions[0, 0]) != past:
            raise ValueError(f"the tree's root (token {int(tokens[0])}, position {int(trees.positions[0, 0])}) "
                             f"is not the last committed token ({self._committed[-1]}, position {past})")
        if n > 0 and not ((tokens[1:n + 1] >= 0) & (tokens[1:n + 1] < self.vocab_size)).all():
            raise ValueError(f"a draft token is outside [0, {self.vocab_size})")
        check_tree_structure(trees, past)
        vis_np = np.asarray(trees.visibility[0], dtype=bool)[:rows, :rows]
        tokens = tokens[:rows]
        positions = np.asarray(trees.positions[0], dtype=np.int64)[:rows]
        vis = torch.as_tensor(vis_np, device=self.device)
        allowed = torch.zeros((rows, past + rows), dtype=torch.bool, device=self.device)
        allowed[:, :past] = True
        allowed[:, past:] = vis
        low = torch.finfo(self.dtype).min
        mask = torch.zeros((1, 1, rows, past + rows), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, low)
        logits, hidden = self._forward(tokens.tolist(), positions.tolist(), mask)
        self._pending = ("tree", hidden, past, rows, trees)
        return logits

    def score_tree(self, trees: Any) -> np.ndarray:
        """One forward over every node of ``trees`` (see :meth:`tree_logits`); returns the
        model's choice at every row, int32 ``[1, N+1]`` (padding rows: 0; the walk never
        reads them)."""
        logits = self.tree_logits(trees)
        out = np.zeros((1, int(trees.budget) + 1), dtype=np.int32)
        rows = logits.shape[0]
        out[0, :rows] = self.choose(logits, np.asarray(trees.positions[0], dtype=np.int64)[:rows] + 1)
        return out

    def commit(self, tokens: Sequence[int], trees: Any = None, acceptance: Any = None) -> None:
        """Append ``tokens`` to the sequence, after a forward.

        After :meth:`next_token`: exactly one token (the root's row is already in place).
        After :meth:`score_tree`: ``trees`` (the same object) and ``acceptance`` (request 0
        of its walk), and ``tokens`` must be what the walk commits
        (``acceptance.committed(trees)``: the accepted path's tokens, then the bonus token
        when there is one). The rows of the root and of the committed path nodes but the last
        committed token move right after the prefix and the cache is cropped to them (the
        last committed token is the next root: the bonus, or an accepted stop token); on the
        GPU with float16/bfloat16/float32 caches :func:`kdtree.compact_kv` moves them in one
        launch, elsewhere an index-select does.

        Raises:
            RuntimeError: no forward to commit. ValueError: tokens outside ``[0, vocab)``,
            other tokens than the walk commits, a path that is not a chain of parent links
            from the root, other ``trees`` than the ones scored. Nothing changes on error.
        """
        committed = self._check_tokens(tokens, "tokens")
        self._require_sequence()
        pending = self._pending
        if pending is None:
            raise RuntimeError("commit without a forward: call next_token or score_tree first")
        if not committed:
            raise ValueError("commit needs at least one token")
        if pending[0] == "ar":
            if len(committed) != 1:
                raise ValueError(f"after next_token, commit exactly one token (got {len(committed)})")
            self._pending = None
            self._append_features(pending[1])
            self._committed.extend(committed)
            return
        _, hidden, past, rows, scored = pending
        if acceptance is None:
            raise ValueError("commit after score_tree needs the acceptance of the walk")
        if trees is not scored:
            raise ValueError("commit got other trees than the ones score_tree scored")
        path = self._check_path(trees, acceptance, committed)
        keep = len(committed)  # rows kept from the tree block: the root and path[1 .. keep - 1]
        try:
            self._compact(past, path, acceptance)
            drop = self.cache_length - (past + keep)
            if drop > 0:
                self._cache.crop(-drop)  # a negative argument removes rows in every release
            if hidden is not None:
                self._append_features(hidden[_torch().as_tensor(path[:keep], device=hidden.device)])
        except Exception as exc:  # the cache may be half moved: refuse everything until prefill
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        self._pending = None
        self._committed.extend(committed)

    def _check_path(self, trees: Any, acceptance: Any, committed: list[int]) -> np.ndarray:
        m = int(np.asarray(acceptance.accept_length).reshape(-1)[0])
        nodes = np.asarray(acceptance.accepted_nodes)
        n = int(trees.num_nodes[0])
        if nodes.ndim != 2 or not 0 <= m < nodes.shape[1]:
            raise ValueError(f"acceptance: accept_length {m} does not fit accepted_nodes of shape {nodes.shape}")
        path = nodes[0, : m + 1].astype(np.int64)
        parents = np.asarray(trees.parents[0])
        if path[0] != 0 or (path[1:] < 1).any() or (path[1:] > n).any():
            raise ValueError(f"acceptance: the path {path.tolist()} must start at the root and use nodes 1..{n}")
        for j in range(1, m + 1):
            if int(parents[path[j]]) != int(path[j - 1]):
                raise ValueError(f"acceptance: node {int(path[j])} is not a child of node {int(path[j - 1])}")
        want = acceptance.committed(trees, 0)
        if committed != want:
            raise ValueError(f"tokens {committed} are not what the walk commits ({want})")
        return path

    def _compact(self, past: int, path: np.ndarray, acceptance: Any) -> None:
        """Rows past + path[j] -> past + j in every layer (j = 0 .. m)."""
        torch = _torch()
        layers = self._cache.layers
        keys = [layer.keys for layer in layers]
        values = [layer.values for layer in layers]
        if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16, torch.float32):
            from .._native import KdtreeError
            from ..core import api
            from ..core.types import Acceptance

            dev = self.device
            acc = Acceptance(torch.as_tensor(np.asarray(acceptance.accepted_nodes)[:1], dtype=torch.int32, device=dev),
                             torch.as_tensor(np.asarray(acceptance.accept_length).reshape(-1)[:1], dtype=torch.int32,
                                             device=dev),
                             torch.as_tensor(np.asarray(acceptance.bonus_token).reshape(-1)[:1], dtype=torch.int32,
                                             device=dev))
            try:
                api.compact_kv(keys, values, torch.tensor([past], dtype=torch.int64, device=dev), acc)
                return
            except (KdtreeError, OSError):  # a library built without CUDA: the index-select below
                pass
        idx = torch.as_tensor(past + path, device=self.device)
        for t in keys + values:
            t[:, :, past: past + len(path)] = t[:, :, idx]  # the gather copies before the write

    def drafter_features(self) -> Any:
        """Hidden states of ``feature_layers`` at every cached position (all committed
        tokens but the last), concatenated: torch ``[len - 1, F]``, or None without
        feature layers or cached positions."""
        return self._features

    # ---- helpers ---------------------------------------------------------------------

    @property
    def committed_tokens(self) -> list[int]:
        """The sequence so far (prompt included)."""
        return list(self._committed)

    @property
    def cache_length(self) -> int:
        """Rows in the KV cache (0 before the first forward)."""
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    @property
    def cache(self) -> Any:
        """The model's KV cache (a ``DynamicCache``), for inspection."""
        return self._cache

    def choose(self, logits: Any, positions: Any) -> np.ndarray:
        """The model's choice for each row of ``logits`` [n, V]: argmax (ties to the lower
        id) at temperature 0, else one draw per row from the tempered top-p distribution
        by inversion: the first token id whose cumulative probability (float64, in id
        order) exceeds the uniform :func:`keyed_uniforms` gives for (``seed``,
        ``positions[i]``), so row i's draw depends on its logits and on the position of the
        token it chooses (ints [n]: the row's position + 1) alone.
        Returns int32 [n]. Raises NonFiniteLogitsError (a ValueError) for a row holding a
        NaN or +inf logit or no finite one (a broken model: argmax would pick an arbitrary
        token and the sampled distribution is undefined), and ValueError when ``logits`` is
        not 2-D or ``positions`` does not hold one position per row."""
        torch = _torch()
        if not torch.is_tensor(logits):
            raise TypeError(f"logits must be a torch tensor [n, V], got {type(logits).__name__}")
        if logits.ndim != 2 or logits.shape[1] < 1 or not logits.is_floating_point():
            raise ValueError(f"logits must be a floating-point [n, V] tensor with V >= 1 (one row a choice), got "
                             f"{logits.dtype} of shape {tuple(logits.shape)}")
        if np.shape(positions) != (logits.shape[0],):
            raise ValueError(f"positions: one per row of logits ({logits.shape[0]}), got shape {np.shape(positions)}")
        if self.vocab_slice is not None:
            return self._choose_sharded(logits, positions)
        if self.temperature != 0.0 and self.sampler == "gumbel":
            from ..core import sampling

            draws = sampling.gumbel_draws(logits.detach().float().cpu().numpy(), self.temperature, self.seed, 0, 0,
                                          np.asarray(positions, dtype=np.int64))
            bad = np.flatnonzero(draws < 0)
            if bad.size:
                raise NonFiniteLogitsError(f"the target's logits in row {int(bad[0])} of {logits.shape[0]} hold a NaN "
                                           "or +inf, or no finite value (its weights or inputs are broken)")
            return draws
        nan_rows = torch.isnan(logits).any(dim=-1).nonzero()
        if len(nan_rows):
            raise NonFiniteLogitsError(f"the target's logits hold a NaN in row {int(nan_rows[0, 0])} of {logits.shape[0]} "
                             f"(its weights or inputs are broken)")
        bad = (torch.isposinf(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)).nonzero()
        if len(bad):
            raise NonFiniteLogitsError(f"the target's logits in row {int(bad[0, 0])} of {logits.shape[0]} hold +inf or "
                                       f"no finite value (its weights or inputs are broken)")
        if self.temperature == 0.0:
            return logits.argmax(dim=-1).to(torch.int32).cpu().numpy()
        x = logits.to(torch.float64)
        z = x / self.temperature
        # a tiny temperature can take huge logits past float64's range (+inf, then NaN in
        # the softmax): such rows are tempered from their maximum instead (the same
        # distribution; other rows keep their exact arithmetic)
        over = (torch.isinf(z) & torch.isfinite(x)).any(dim=-1, keepdim=True)
        if bool(over.any()):
            z = torch.where(over, (x - x.max(dim=-1, keepdim=True).values) / self.temperature, z)
        probs = torch.softmax(z, dim=-1)
        if self.top_p < 1.0:
            probs = top_p_filter(probs, self.top_p)
        u = torch.as_tensor(keyed_uniforms(self.seed, positions), device=probs.device)
        cdf = torch.cumsum(probs, dim=-1)
        # the first id whose cumulative probability exceeds u * total: a token of probability
        # 0 never is (its cdf equals its left neighbour's); rounding at the top end falls
        # back to the last token of nonzero probability
        draws = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        draws = torch.minimum(draws, last)
        return draws.to(torch.int32).cpu().numpy()

    def _choose_sharded(self, logits: Any, positions: Any) -> np.ndarray:
        """The argmax, or the Gumbel draw, over every rank's slice
        (kdtree.distributed.target_tokens_sharded: ties to the lower global id); a row that
        gives no token fails on every rank."""
        from ..distributed import target_tokens_sharded

        offset, size = self.vocab_slice
        if logits.shape[1] != size:
            raise ValueError(f"logits have {logits.shape[1]} columns, this rank's vocabulary slice {size}")
        sampled = self.temperature != 0.0
        tokens = target_tokens_sharded(logits.detach().float().cpu()[None], offset, self.vocab_size,
                                       temperature=self.temperature if sampled else None, seed=self.seed, offset=0,
                                       nodes=np.asarray(positions, dtype=np.int64)[None])[0].numpy()
        bad = np.flatnonzero(tokens < 0)
        if bad.size:
            raise NonFiniteLogitsError(f"the target's logits hold a NaN in row {int(bad[0])} of {logits.shape[0]} "
                                       "(on some rank's vocabulary slice)")
        return tokens.astype(np.int32)

    def _forward(self, tokens: list[int], positions: list[int], mask: Any):
        torch = _torch()
        if self.max_positions and positions and max(positions) >= self.max_positions:
            raise ValueError(f"position {max(positions)} is beyond the model's max_position_embeddings "
                             f"({self.max_positions})")
        ids = torch.as_tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.as_tensor([positions], dtype=torch.long, device=self.device)
        if self._cache is None:
            from transformers import DynamicCache

            self._cache = DynamicCache(config=self.model.config)
        kwargs = {self._cache_kw: self._cache, "use_cache": True, "position_ids": pos,
                  "output_hidden_states": bool(self.feature_layers)}
        if mask is not None:
            kwargs["attention_mask"] = mask
        with torch.no_grad():
            out = self.model(input_ids=ids, **kwargs)
        self.forwards += 1
        hidden = None
        if self.feature_layers:
            hidden = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)
        return out.logits[0], hidden

    def _append_features(self, hidden: Any) -> None:
        if hidden is None:
            return
        torch = _torch()
        self._features = hidden if self._features is None else torch.cat([self._features, hidden], dim=0)

    def _check_tokens(self, tokens: Sequence[int], name: str) -> list[int]:
        out = []
        for i, t in enumerate(tokens):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{name}: element {i} ({t!r}) is not an integer token id")
            out.append(int(t))
        bad = [t for t in out if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name}: token {bad[0]} outside [0, {self.vocab_size})")
        return out

    def _require_no_pending(self) -> None:
        if self._pending is not None:
            raise RuntimeError("the previous forward is not committed yet: call commit(...) first")

    def _require_sequence(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"the sequence is in an undefined state after a failed commit ({self._broken}); "
                               f"call prefill(prompt) to start again")
        if not self._committed:
            raise RuntimeError("call prefill(prompt) first")

    def positions_left(self) -> int | None:
        """How many positions after the last committed token the model can still take
        (``max_position_embeddings`` less the sequence length), or None when the config
        gives no limit. The engine caps each round's tree depth with it."""
        if not self.max_positions:
            return None
        return max(0, self.max_positions - len(self._committed))


def keyed_uniforms(seed: int, positions: Any) -> np.ndarray:
    """One uniform in (0, 1] per position, float64 ``[n]``, that depends on ``seed`` (an
    int in [0, 2**64)) and the position alone: the first two words w0, w1 of
    Philox4x32-10(counter = (position mod 2**32, position >> 32, 0, 0), key = (seed mod
    2**32, seed >> 32)) (the generator of the library's sampled verification) give
    u = ((w0 >> 5) * 2**26 + (w1 >> 6) + 0.5) * 2**-53 (1.0 exactly only when both words
    are all ones: the sum rounds up to 2**53). positions: ints in [0, 2**63).
    Raises ValueError for a seed or position outside those ranges."""
    from ..core.sampling import philox4x32_10

    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    pos = np.asarray(positions)
    if pos.ndim != 1 or (pos.size and (pos.dtype.kind not in "iu" or int(pos.min()) < 0
                                       or int(pos.max()) >= 2**63)):
        raise ValueError(f"positions must be a 1-D array of ints in [0, 2**63), got {positions!r}")
    pos = pos.astype(np.uint64)
    zero = np.zeros_like(pos)
    w = philox4x32_10((pos & np.uint64(0xFFFFFFFF), pos >> np.uint64(32), zero, zero),
                      (int(seed) & 0xFFFFFFFF, int(seed) >> 32))
    hi = (w[0] >> np.uint32(5)).astype(np.float64)
    lo = (w[1] >> np.uint32(6)).astype(np.float64)
    return (hi * 2.0**26 + lo + 0.5) * 2.0**-53


def top_p_filter(probs: Any, top_p: float, candidates: int = 256) -> Any:
    """Nucleus filtering of each row of ``probs`` [n, V]: keep the smallest set of most
    likely tokens whose total reaches ``top_p`` (ties in probability by lower id; at least
    one token), renormalise. Returns a new tensor (Holtzman et al., 2020).

    Rows whose nucleus lies inside their ``candidates`` most likely tokens, strictly above
    every token outside them, are cut from those alone (a top-k, not a sort of the whole
    vocabulary); other rows (and ``candidates`` 0) sort the whole row. Both give the same
    set."""
    torch = _torch()
    n, vocab = probs.shape
    keep = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device)
    full = torch.ones(n, dtype=torch.bool, device=probs.device)
    if 0 < candidates < vocab:
        vals, idx = torch.topk(probs, candidates, dim=-1)  # tie order unspecified: re-sort below
        idx, perm = torch.sort(idx, dim=-1)
        vals, order = torch.sort(torch.gather(vals, -1, perm), dim=-1, descending=True, stable=True)
        ids = torch.gather(idx, -1, order)  # by probability, ties by lower id
        k_sorted = (torch.cumsum(vals, dim=-1) - vals) < top_p  # mass strictly above each token
        k_sorted[:, 0] = True
        n_keep = k_sorted.sum(dim=-1)
        smallest = torch.gather(vals, -1, (n_keep - 1)[:, None])[:, 0]
        # exact when the cut falls inside the candidates and no token outside them ties
        # with the kept ones (every outside token is <= the last candidate)
        ok = (n_keep < candidates) & (vals[:, -1] < smallest)
        keep[ok] = torch.zeros_like(keep[ok]).scatter(-1, ids[ok], k_sorted[ok])
        full = ~ok
    if bool(full.any()):
        sorted_p, order = torch.sort(probs[full], dim=-1, descending=True, stable=True)
        k_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
        k_sorted[:, 0] = True
        keep[full] = torch.zeros_like(k_sorted).scatter(-1, order, k_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)
