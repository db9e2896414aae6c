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
  (``trees.visibility``), padding rows only themselves. The model's choice at each node is
  the argmax of its logits (greedy, ties to the lower id) or one independent draw from
  ``softmax(logits / temperature)`` restricted to the top-p nucleus; the walk
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


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("kdtree.hf needs PyTorch (pip install torch); the rest of kdtree does not") from exc
    return torch


def load_causal_lm(path: str | Path, *, device: str = "cpu", dtype: Any = None):
    """Load a causal LM from a local folder (config + safetensors), in eval mode.

    Args:
        path: folder written by ``save_pretrained`` (no hub access is attempted).
        device: torch device string, e.g. ``"cpu"`` or ``"cuda"``.
        dtype: torch dtype or its name (``"float64"``, ``"bfloat16"``); default: the
            checkpoint's.

    Raises:
        FileNotFoundError: ``path`` is not a folder with a ``config.json``.
        ImportError: torch or transformers is missing.
    """
    torch = _torch()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar on stderr

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a folder written by save_pretrained)")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=dtype)
    return model.to(device).eval()


class HFTarget:
    """A transformers causal LM holding one sequence, for :mod:`kdtree.engine`.

    Args:
        model: a loaded causal LM (:func:`load_causal_lm`), any device and float dtype.
        temperature: 0 for greedy decoding (argmax, ties to the lower token id); > 0
            samples each choice from ``softmax(logits / temperature)``.
        top_p: nucleus size for sampling, in (0, 1]: the smallest set of most likely tokens
            whose probability reaches ``top_p`` (at least one token) is renormalised.
        seed: seed of the torch generator used for sampling (reproducible runs).
        feature_layers: indices into the model's hidden states (0 = embeddings, i = output
            of layer i) returned by :meth:`drafter_features`, concatenated; empty: none.

    Raises:
        ValueError: temperature < 0, top_p outside (0, 1], a feature layer out of range.
    """

    def __init__(self, model: Any, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 feature_layers: Sequence[int] = ()):
        torch = _torch()
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        n_layers = int(model.config.num_hidden_layers)
        layers = tuple(int(i) for i in feature_layers)
        for i in layers:
            if not 0 <= i <= n_layers:
                raise ValueError(f"feature layer {i} outside [0, {n_layers}] (hidden states of a "
                                 f"{n_layers}-layer model)")
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.feature_layers = layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._generator = torch.Generator(device=self.device).manual_seed(int(seed))
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache = None
        self._committed: list[int] = []
        self._features = None       # [cached positions, F] or None
        self._pending = None        # what the last forward left for commit()
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
        self._committed = list(tokens)
        if len(tokens) > 1:
            _, hidden = self._forward(tokens[:-1], list(range(len(tokens) - 1)), None)
            self._append_features(hidden)

    def next_token(self) -> int:
        """One autoregressive step: the root (last committed token) enters the cache and
        the model's choice after it is returned (argmax or a draw, as configured)."""
        self._require_sequence()
        pos = len(self._committed) - 1
        logits, hidden = self._forward([self._committed[-1]], [pos], None)
        self._pending = ("ar", hidden)
        return int(self.choose(logits)[0])

    def tree_logits(self, trees: Any) -> Any:
        """The tree forward alone: logits ``[N+1, V]`` (torch, the model's dtype) of every
        row of request 0 of ``trees`` (a :class:`kdtree.TreeBatch` with one request whose
        root is the last committed token and whose root position is the cache length).

        Raises:
            ValueError: more than one request, a root that is not the last committed token
                or not at the cache's length, a node token outside ``[0, vocab)``.
        """
        torch = _torch()
        self._require_sequence()
        if trees.batch != 1:
            raise ValueError(f"HFTarget holds one sequence; trees has {trees.batch} requests")
        past = len(self._committed) - 1
        n = int(trees.num_nodes[0])
        rows = int(trees.budget) + 1
        tokens = np.asarray(trees.tokens[0], dtype=np.int64).copy()
        if int(tokens[0]) != self._committed[-1] or int(trees.positions[0, 0]) != past:
            raise ValueError(f"the tree's root (token {int(tokens[0])}, position {int(trees.positions[0, 0])}) "
                             f"is not the last committed token ({self._committed[-1]}, position {past})")
        if n > 0 and not ((tokens[1:n + 1] >= 0) & (tokens[1:n + 1] < self.vocab_size)).all():
            raise ValueError(f"a draft token is outside [0, {self.vocab_size})")
        tokens[n + 1:] = 0  # padding rows: any token, they see only themselves
        positions = np.asarray(trees.positions[0], dtype=np.int64).copy()
        positions[n + 1:] = past
        vis = torch.as_tensor(np.asarray(trees.visibility[0], dtype=bool), device=self.device)
        allowed = torch.zeros((rows, past + rows), dtype=torch.bool, device=self.device)
        allowed[: n + 1, :past] = True
        allowed[:, past:] = vis
        low = torch.finfo(self.dtype).min
        mask = torch.zeros((1, 1, rows, past + rows), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, low)
        logits, hidden = self._forward(tokens.tolist(), positions.tolist(), mask)
        self._pending = ("tree", hidden, past, rows)
        return logits

    def score_tree(self, trees: Any) -> np.ndarray:
        """One forward over every node of ``trees`` (see :meth:`tree_logits`); returns the
        model's choice at every row, int32 ``[1, N+1]`` (padding rows: whatever the model
        chose there; the walk never reads them)."""
        logits = self.tree_logits(trees)
        return self.choose(logits)[None, :]

    def commit(self, tokens: Sequence[int], trees: Any = None, acceptance: Any = None) -> None:
        """Append ``tokens`` to the sequence. After :meth:`score_tree`, ``trees`` and
        ``acceptance`` (request 0) say which rows to keep: the accepted path's K/V rows are
        compacted right after the prefix and the cache is cropped to them; after
        :meth:`next_token`, the root's row is already in place.

        Raises:
            ValueError: tokens outside ``[0, vocab)``; ``acceptance`` missing after a tree
                forward, or a path that does not start at the root.
        """
        from . import api

        committed = self._check_tokens(tokens, "tokens")
        self._require_sequence()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == "tree":
            if acceptance is None:
                raise ValueError("commit after score_tree needs the acceptance of the walk")
            _, hidden, past, rows = pending
            m = int(acceptance.accept_length[0])
            path = np.asarray(acceptance.accepted_nodes[0][: m + 1], dtype=np.int64)
            if path.size == 0 or path[0] != 0:
                raise ValueError("the accepted path must start at the root (node 0)")
            layers = self._cache.layers
            api.compact_kv([layer.keys for layer in layers], [layer.values for layer in layers],
                           [past], acceptance)
            drop = self.cache_length - (past + m + 1)
            if drop > 0:
                self._cache.crop(-drop)  # a negative argument removes rows in every release
            if hidden is not None:
                self._append_features(hidden[_torch().as_tensor(path, device=hidden.device)])
        elif pending is not None and pending[0] == "ar":
            self._append_features(pending[1])
        elif committed:
            raise ValueError("commit without a forward: call next_token or score_tree first")
        self._committed.extend(committed)

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

    def choose(self, logits: Any) -> np.ndarray:
        """The model's choice for each row of ``logits`` [n, V]: argmax (ties to the lower
        id) at temperature 0, else one draw per row from the tempered top-p distribution.
        Returns int32 [n]."""
        torch = _torch()
        if self.temperature == 0.0:
            return logits.argmax(dim=-1).to(torch.int32).cpu().numpy()
        probs = torch.softmax(logits.to(torch.float64) / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = top_p_filter(probs, self.top_p)
        draws = torch.multinomial(probs, 1, generator=self._generator)[:, 0]
        return draws.to(torch.int32).cpu().numpy()

    def _forward(self, tokens: list[int], positions: list[int], mask: Any):
        torch = _torch()
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
        out = [int(t) for t in tokens]
        bad = [t for t in out if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name}: token {bad[0]} outside [0, {self.vocab_size})")
        return out

    def _require_sequence(self) -> None:
        if not self._committed:
            raise RuntimeError("call prefill(prompt) first")


def top_p_filter(probs: Any, top_p: float) -> Any:
    """Nucleus filtering of each row of ``probs`` [n, V]: keep the smallest set of most
    likely tokens whose total reaches ``top_p`` (ties in probability by lower id; at least
    one token), renormalise. Returns a new tensor (Holtzman et al., 2020)."""
    torch = _torch()
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
    keep_sorted = before < top_p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)
