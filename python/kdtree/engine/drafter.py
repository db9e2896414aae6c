"""A small DFlash-style block drafter (torch), and drafter adapters for the engine.

The block drafter follows the design DDTree builds on (DFlash, Chen, Liang & Liu,
arXiv 2602.06036, "KV injection"): hidden states of chosen target layers at every context
position are concatenated, projected to the drafter's width and normalised (the *context
feature*); every drafter layer attends, with its own key and value projections, to the
context feature (the injected keys/values) and to the draft block. The block is
``[bonus token, mask, ..., mask]`` (the bonus is the last committed token, the tree's
root) and is attended bidirectionally; one forward returns logits for the ``block_size -
1`` positions after the bonus. Positions use rotary embeddings: context token ``i`` at
position ``i``, the bonus at ``T`` (the number of context tokens), mask ``j`` at ``T + j``.

:class:`BlockDrafterRunner` and :class:`CallableDrafter` implement the engine's
:class:`kdtree.engine.Drafter` protocol. Imports torch on first use of the model classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "drafter.safetensors"


@dataclass
class BlockDrafterConfig:
    """Sizes of a :class:`BlockDrafter` (saved as ``drafter_config.json``).

    Attributes:
        vocab_size         the target's vocabulary (shared token ids)
        feature_size       width of the target features = len(target_layers) x target width
        target_layers      indices into the target's hidden states (0 = embeddings, i =
                           output of layer i) that make the features, in order
        hidden_size, num_layers, num_heads, head_dim, intermediate_size   the drafter's
                           transformer (SwiGLU MLP, RMSNorm, no biases)
        block_size         bonus token + drafted positions (the tree's depth limit is
                           block_size - 1)
        rope_theta, rms_norm_eps
    """

    vocab_size: int
    feature_size: int
    target_layers: tuple[int, ...] = field(default_factory=tuple)
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.target_layers, (list, tuple)) or not all(is_int(i) and i >= 0
                                                                       for i in self.target_layers):
            raise ValueError(f"target_layers must be integers >= 0, got {self.target_layers!r}")
        self.target_layers = tuple(self.target_layers)
        for name, cap in (("vocab_size", 2**31 - 1), ("feature_size", 2**20), ("hidden_size", 2**16),
                          ("num_layers", 256), ("num_heads", 1024), ("head_dim", 2**12), ("intermediate_size", 2**20),
                          ("block_size", 1024)):
            v = getattr(self, name)
            if not is_int(v) or not 1 <= v <= cap:
                raise ValueError(f"{name} must be an integer in [1, {cap}], got {v!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (a bonus token and one draft), got {self.block_size}")
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {self.head_dim}")

    @property
    def max_depth(self) -> int:
        """Draft positions per forward (block_size - 1)."""
        return self.block_size - 1

    def to_json(self) -> str:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BlockDrafterConfig:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"a drafter config must be a JSON object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown drafter config fields: {unknown}")
        return cls(**d)


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("kdtree.drafter's BlockDrafter needs PyTorch (pip install torch)") from exc
    return torch


def _rope_tables(positions, d: int, theta: float, dtype):
    """(cos, sin) of the rotary angles at ``positions`` (any shape P), ``P + [d]``, computed in
    float64 and rounded to ``dtype``."""
    torch = _torch()
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[..., None] * inv
    return torch.cat([ang.cos(), ang.cos()], dim=-1).to(dtype), torch.cat([ang.sin(), ang.sin()], dim=-1).to(dtype)


def _rotate(x, cos, sin):
    """The rotate-half rotary embedding (Llama/Qwen) of ``x`` with broadcastable tables."""
    half = x.shape[-1] // 2
    return x * cos + _torch().cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _rope(x, positions, theta: float):
    """Rotary embedding of ``x`` [B, H, S, D] at integer ``positions`` [B, S]."""
    cos, sin = _rope_tables(positions[:, None, :], x.shape[-1], theta, x.dtype)
    return _rotate(x, cos, sin)


def _build_modules():
    """The nn.Module classes, defined on first use so that importing this module does not
    import torch."""
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional

    class DrafterLayer(nn.Module):
        def __init__(self, cfg: BlockDrafterConfig):
            super().__init__()
            h, nh, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
            self.cfg = cfg
            self.attn_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
            self.q = nn.Linear(h, nh * hd, bias=False)
            self.k = nn.Linear(h, nh * hd, bias=False)
            self.v = nn.Linear(h, nh * hd, bias=False)
            self.o = nn.Linear(nh * hd, h, bias=False)
            self.mlp_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
            self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
            self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
            self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

        def _heads(self, x):
            b, s, _ = x.shape
            return x.view(b, s, self.cfg.num_heads, self.cfg.head_dim).transpose(1, 2)

        def forward(self, h, ctx, pos_blk, pos_ctx, mask):
            theta = self.cfg.rope_theta
            x = self.attn_norm(h)
            q = _rope(self._heads(self.q(x)), pos_blk, theta)
            k = torch.cat([_rope(self._heads(self.k(ctx)), pos_ctx, theta),
                           _rope(self._heads(self.k(x)), pos_blk, theta)], dim=2)
            v = torch.cat([self._heads(self.v(ctx)), self._heads(self.v(x))], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            b, _, s, _ = a.shape
            h = h + self.o(a.transpose(1, 2).reshape(b, s, -1))
            y = self.mlp_norm(h)
            return h + self.down(F.silu(self.gate(y)) * self.up(y))

    class BlockDrafterModule(nn.Module):
        def __init__(self, cfg: BlockDrafterConfig):
            super().__init__()
            self.config = cfg
            h = cfg.hidden_size
            self.embed = nn.Embedding(cfg.vocab_size, h)
            self.mask_embedding = nn.Parameter(torch.randn(h) * 0.02)
            self.fuse = nn.Linear(cfg.feature_size, h, bias=False)
            self.fuse_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
            self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
            self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)

        # what the engines read (the same names on kdtree.engine.dflash's DFlashDrafter)
        @property
        def max_depth(self) -> int:
            return self.config.max_depth

        @property
        def feature_layers(self) -> tuple[int, ...]:
            """Indices into transformers' ``hidden_states`` (0 = embeddings) of the features."""
            return tuple(self.config.target_layers)

        @property
        def feature_size(self) -> int:
            return int(self.config.feature_size)

        @property
        def vocab_size(self) -> int:
            return int(self.config.vocab_size)

        def kv_cache(self, slots: int, capacity: int):
            """The batched engine's cached decoder of this drafter."""
            return BlockDrafterKV(self, slots, capacity)

        def forward(self, features, context_valid, bonus, start, depth: int | None = None):
            """Logits [B, depth, V] for the positions after the bonus.

            features       [B, T, feature_size] target features of the context (T >= 0)
            context_valid  [B, T] bool: which context positions each block may see
            bonus          [B] long: the bonus (root) token
            start          [B] long: the bonus's position (context positions are 0..T-1)
            depth          drafted positions, 1 .. block_size - 1 (default: all)
            """
            cfg = self.config
            depth = cfg.max_depth if depth is None else int(depth)
            if not 1 <= depth <= cfg.max_depth:
                raise ValueError(f"depth must be in [1, {cfg.max_depth}], got {depth}")
            b, t = features.shape[0], features.shape[1]
            s = depth + 1
            dev = features.device
            ctx = self.fuse_norm(self.fuse(features))
            h = torch.cat([self.embed(bonus)[:, None, :], self.mask_embedding.expand(b, depth, -1).to(ctx.dtype)],
                          dim=1)
            pos_blk = start[:, None] + torch.arange(s, device=dev)[None, :]
            pos_ctx = torch.arange(t, device=dev)[None, :].expand(b, t)
            allowed = torch.cat([context_valid[:, None, None, :].expand(b, 1, s, t),
                                 torch.ones((b, 1, s, s), dtype=torch.bool, device=dev)], dim=-1)
            mask = torch.zeros(allowed.shape, dtype=ctx.dtype, device=dev)
            mask.masked_fill_(~allowed, torch.finfo(ctx.dtype).min)
            for layer in self.layers:
                h = layer(h, ctx, pos_blk, pos_ctx, mask)
            return F.linear(self.norm(h[:, 1:]), self.embed.weight)  # tied output head

    return BlockDrafterModule


_MODULE_CLASS = None


def BlockDrafter(config: BlockDrafterConfig):  # noqa: N802 - reads as a class
    """A new randomly initialised block drafter (a torch ``nn.Module``; see the module
    docstring and ``BlockDrafterModule.forward`` for shapes)."""
    global _MODULE_CLASS
    if _MODULE_CLASS is None:
        _MODULE_CLASS = _build_modules()
    return _MODULE_CLASS(config)


def save_drafter(model: Any, folder: str | Path) -> None:
    """Write ``drafter_config.json`` and ``drafter.safetensors`` (float32) into ``folder``."""
    from safetensors.torch import save

    from ..core.files import write_atomically

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").float().contiguous() for k, v in model.state_dict().items()}
    # weights first, then the config that names them; each file whole or not at all
    write_atomically(folder / WEIGHTS_NAME, lambda f: f.write(save(state)))
    write_atomically(folder / CONFIG_NAME, lambda f: f.write((model.config.to_json() + "\n").encode()))


def load_drafter(folder: str | Path, *, device: str = "cpu", dtype: Any = None):
    """Load a drafter saved by :func:`save_drafter`, in eval mode.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a bad config, or weights that do
        not match it (names and shapes are checked strictly).
    """
    torch = _torch()
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} not found (a folder written by save_drafter)")
    cfg = BlockDrafterConfig.from_json((folder / CONFIG_NAME).read_text())
    # Names and shapes are compared first, on a model without storage (the meta device)
    # and the file's header, so a config that does not match its weights costs no memory.
    from safetensors import safe_open

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in BlockDrafter(cfg).state_dict().items()}
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    missing, unexpected = sorted(set(shapes) - set(stored)), sorted(set(stored) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{folder / WEIGHTS_NAME}: missing {missing}, unexpected {unexpected}")
    wrong = [f"{k}: stored {stored[k]}, config {shapes[k]}" for k in sorted(shapes) if stored[k] != shapes[k]]
    if wrong:
        raise ValueError(f"{folder / WEIGHTS_NAME} does not match {folder / CONFIG_NAME}: " + "; ".join(wrong[:3]))
    model = BlockDrafter(cfg)
    model.load_state_dict(load_file(str(folder / WEIGHTS_NAME)), strict=True)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return model.to(device=device, dtype=dtype).eval()


class BlockDrafterRunner:
    """A block drafter (a :class:`BlockDrafter` or a published-format DFlash drafter,
    :func:`kdtree.engine.dflash.load_dflash`) as the single-sequence engine's drafter:
    ``draft(context, depth, features)`` with ``features`` from
    :meth:`kdtree.hf.HFTarget.drafter_features` (the target must be built with
    ``feature_layers=model.feature_layers``).

    Raises (from :meth:`draft`): ValueError for a depth above ``block_size - 1``, a
    features tensor whose shape does not match the context, or missing features.
    """

    def __init__(self, model: Any):
        self.model = model.eval()
        self.vocab_size = int(model.vocab_size)
        self.max_depth = int(model.max_depth)
        self.feature_size = int(model.feature_size)
        self.calls = 0

    @property
    def vocab_slice(self):
        """A DFlash drafter over a target whose LM head is split by vocabulary returns this
        rank's slice of the logits, (offset, size); the engine merges the top-k
        (kdtree.distributed). None: the whole vocabulary."""
        return getattr(self.model, "kdtree_vocab_slice", None)

    def draft(self, context: Sequence[int], depth: int, features: Any = None) -> np.ndarray:
        torch = _torch()
        if depth == 0:
            width = self.vocab_size if self.vocab_slice is None else self.vocab_slice[1]
            return np.zeros((0, width), dtype=np.float32)
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"this drafter drafts 1 .. {self.max_depth} positions, got depth {depth}")
        t = len(context) - 1
        param = next(self.model.parameters())
        if t > 0 and features is None:
            raise ValueError("the block drafter needs the target's features (HFTarget(feature_layers=...))")
        if features is None:
            features = torch.zeros((0, self.feature_size), dtype=param.dtype, device=param.device)
        if tuple(features.shape) != (t, self.feature_size):
            raise ValueError(f"features have shape {tuple(features.shape)}, expected ({t}, {self.feature_size}) "
                             f"for a context of {t + 1} tokens")
        feats = features.to(device=param.device, dtype=param.dtype)[None]
        valid = torch.ones((1, t), dtype=torch.bool, device=param.device)
        bonus = torch.tensor([int(context[-1])], device=param.device)
        start = torch.tensor([t], device=param.device)
        with torch.no_grad():
            logits = self.model(feats, valid, bonus, start, depth)[0]
        self.calls += 1
        return logits.float().cpu().numpy()


class CallableDrafter:
    """Any function ``fn(context, depth, features) -> logits [depth, V]`` as a drafter."""

    def __init__(self, fn: Callable[[Sequence[int], int, Any], Any], vocab_size: int):
        self.fn = fn
        self.vocab_size = int(vocab_size)

    def draft(self, context: Sequence[int], depth: int, features: Any = None) -> np.ndarray:
        raw = np.asarray(self.fn(context, depth, features))
        if raw.shape != (depth, self.vocab_size):
            raise ValueError(f"drafter function returned shape {raw.shape}, expected ({depth}, {self.vocab_size})")
        with np.errstate(over="ignore"):
            out = raw.astype(np.float32)
        grown = np.isinf(out) & np.isfinite(raw)
        if grown.any():
            d, v = (int(i) for i in np.argwhere(grown)[0])
            raise ValueError(f"drafter logit {raw[d, v]!r} at depth {d}, token {v} is beyond float32's range "
                             f"(logits are used as float32)")
        return out


def write_rows(keys: Any, values: Any, k: Any, v: Any, rows: Any, slot: Any, heads: Any) -> None:
    """Writes one layer's keys and values ``k``, ``v`` ``[b, h, r, d]`` into the cache
    ``keys``/``values`` ``[slots, h, rows, d]`` at int64 ``rows`` ``[b, r]`` of slots
    ``0 .. b-1`` (``slot`` None) or of int64 ``slot`` ``[b]``; ``heads`` is
    ``arange(h)[None, :, None]`` on the cache's device (made once by the caller)."""
    b, h, r, d = k.shape
    if slot is None:
        idx = rows[:, None, :, None].expand(b, h, r, d)
        keys[:b].scatter_(2, idx, k)
        values[:b].scatter_(2, idx, v)
    else:
        where = (slot[:, None, None], heads, rows[:, None, :])
        keys.index_put_(where, k)
        values.index_put_(where, v)


class BlockDrafterKV:
    """A :class:`BlockDrafter` with its context keys and values cached on the device, for
    the batched engine: each committed position's target features are projected once
    (:meth:`append`), and a draft (:meth:`forward`) attends to the cached rows instead of
    recomputing them from every context feature each round. Computes what
    ``BlockDrafterModule.forward`` computes (tested equal in float32).

    Per drafter layer, K and V are ``[slots, heads, capacity + block_size, head_dim]``:
    rows ``0 .. capacity - 1`` hold the context (row ``i`` = context position ``i``, keys
    rotated at ``i``), the last ``block_size`` rows the block of the draft in progress.
    Nothing here synchronises with the host, so :meth:`forward` and :meth:`append` can be
    captured in a CUDA graph (with static input tensors).

    Args:
        model: a :class:`BlockDrafter` (any device and float dtype).
        slots: requests held.
        capacity: context positions per request.
    """

    def __init__(self, model: Any, slots: int, capacity: int):
        torch = _torch()
        self.model = model.eval()
        self.config: BlockDrafterConfig = model.config
        cfg = self.config
        param = next(model.parameters())
        self.capacity = int(capacity)
        shape = (int(slots), cfg.num_heads, self.capacity + cfg.block_size, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.layers]
        self.values = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.layers]
        self._cols = torch.arange(self.capacity + cfg.block_size, device=param.device)
        # rotary tables for every position the cache and the block can take (as _rope's)
        self._cos, self._sin = _rope_tables(torch.arange(self.capacity + cfg.block_size, device=param.device),
                                            cfg.head_dim, cfg.rope_theta, param.dtype)

    def _rotary(self, positions):
        """(cos, sin) ``[b, 1, S, D]`` of int64 ``positions`` ``[b, S]``."""
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def append(self, features: Any, rows: Any, slot: int | None = None) -> None:
        """Caches the context keys and values of ``features`` ``[b, r, feature_size]``
        (the target's hidden states at the chosen layers, concatenated) at context rows
        ``rows`` int64 ``[b, r]`` (the positions, < capacity; rows past a request's
        length are later overwritten and never read). ``slot``: None for requests
        ``0 .. b-1``, or int64 ``[b]``: each request's slot."""
        torch = _torch()
        m = self.model
        with torch.no_grad():
            ctx = m.fuse_norm(m.fuse(features.to(self.keys[0].dtype)))
            cos, sin = self._rotary(rows)
            heads = torch.arange(self.config.num_heads, device=rows.device)[None, :, None]
            for i, layer in enumerate(m.layers):
                k = _rotate(layer._heads(layer.k(ctx)), cos, sin)
                write_rows(self.keys[i], self.values[i], k, layer._heads(layer.v(ctx)), rows, slot, heads)

    def forward(self, roots: Any, lengths: Any, depth: int | None = None) -> Any:
        """Drafter logits ``[b, depth, V]`` for the positions after each request's root.

        roots    int ``[b]``: the root (last committed) token of requests ``0 .. b-1``
        lengths  int64 ``[b]``: context positions cached (the root's position)
        depth    drafted positions, 1 .. block_size - 1 (default all)
        """
        torch = _torch()
        F = torch.nn.functional
        m, cfg = self.model, self.config
        depth = cfg.max_depth if depth is None else int(depth)
        if not 1 <= depth <= cfg.max_depth:
            raise ValueError(f"depth must be in [1, {cfg.max_depth}], got {depth}")
        b, s = int(roots.shape[0]), depth + 1
        dev = roots.device
        with torch.no_grad():
            dtype = self.keys[0].dtype
            h = torch.cat([m.embed(roots.long())[:, None, :], m.mask_embedding.to(dtype).expand(b, depth, -1)], dim=1)
            pos = lengths[:, None] + torch.arange(s, device=dev)[None, :]
            cos, sin = self._rotary(pos)
            tail = self.capacity + torch.arange(s, device=dev)
            cols = self._cols
            visible = (cols[None, :] < lengths[:, None]) | ((cols[None, :] >= self.capacity)
                                                          & (cols[None, :] < self.capacity + s))
            mask = torch.zeros((b, 1, 1, cols.shape[0]), dtype=dtype, device=dev)
            mask.masked_fill_(~visible[:, None, None, :], torch.finfo(dtype).min)
            idx = tail[None, None, :, None].expand(b, cfg.num_heads, s, cfg.head_dim)
            for i, layer in enumerate(m.layers):
                kc, vc = self.keys[i][:b], self.values[i][:b]
                x = layer.attn_norm(h)
                q = _rotate(layer._heads(layer.q(x)), cos, sin)
                kc.scatter_(2, idx, _rotate(layer._heads(layer.k(x)), cos, sin))
                vc.scatter_(2, idx, layer._heads(layer.v(x)))
                a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
                h = h + layer.o(a.transpose(1, 2).reshape(b, s, -1))
                y = layer.mlp_norm(h)
                h = h + layer.down(F.silu(layer.gate(y)) * layer.up(y))
            return F.linear(m.norm(h[:, 1:]), m.embed.weight)
