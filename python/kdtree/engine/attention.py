"""Tree attention for transformers' own model code, over a per-request static KV cache.

The batched engine (:mod:`kdtree.engine.batched`) runs Llama, Qwen2 and Qwen3 models
through their transformers classes, with ``config._attn_implementation = "kdtree"``: the
attention function registered here (transformers' ``AttentionInterface``) receives each
layer's new keys and values after the rotary embedding, writes them into the engine's
static cache at each request's own rows, and attends over the whole cache with the mask
the engine passes as ``attention_mask`` (kdtree's tree attention mask for a tree round, a
causal mask for prefill and one-token steps). transformers' ``StaticCache`` writes one
``cache_position`` vector for the whole batch; ragged requests need each request's rows
written at its own length, which is why the function writes K/V itself and the model is
called with no transformers cache.

A tree round (the verify forward over the draft trees) goes to kdtree's tree-attention
kernel (:func:`kdtree.tree_attention`: each row reads its request's prefix and its
ancestors' rows, no mask) when the engine asks for it (float16 / bfloat16 on CUDA, head_dim
64, 128 or 256); prefill, one-token steps and the other cases run PyTorch's
``scaled_dot_product_attention`` over the cache's first rows under the additive mask the
engine passes (it hides the rows that are not the request's prefix or the node's
ancestors).

Shapes: the cache of one layer is ``[slots, kv_heads, capacity, head_dim]`` (Hugging
Face's layout, the one :func:`kdtree.compact_kv` takes as ``"bhsd"``); a forward over
``q`` rows of ``b`` requests writes row ``rows[r, i]`` of request ``r``'s slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

ATTENTION_NAME = "kdtree"
_REGISTERED = False


def _torch():
    import torch

    return torch


@dataclass
class StepState:
    """What the attention function reads for the forward in progress (set by the engine
    before each forward or graph capture; the tensors are static for a captured graph).

    Attributes:
        rows   int64 ``[b, q]``: the cache row each input row's K/V goes to.
        slots  ``None`` (input request r is slot r, ``b`` slots from 0) or int64 ``[b]``:
               the slot of each input request (prefill of requests in any slots).
        trees  a tree round through kdtree's kernel (:func:`kdtree.tree_attention`): the
               round's GPU :class:`~kdtree.TreeBatch` (its rows at ``prefix + i``); None:
               SDPA under ``attention_mask``.
        prefix int64 ``[b]``: the requests' cached tokens before the tree (with ``trees``).
        max_prefix  the bound on ``prefix`` the kernel plans its key split with.
        status the kernel's int32 ``[b]`` request statuses of the last layer (written by
               the attention function in a kernel round; every layer checks the same).
    """

    rows: Any = None
    slots: Any = None
    trees: Any = None
    prefix: Any = None
    max_prefix: int = 0
    status: Any = None


@dataclass
class StaticKV:
    """Per-layer K and V buffers ``[slots, kv_heads, capacity, head_dim]`` on the model's
    device and dtype, and the :class:`StepState` the attention function reads."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    step: StepState = field(default_factory=StepState)

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def num_slots(self) -> int:
        return int(self.keys[0].shape[0])


def kdtree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (``AttentionInterface``) for the engine's cache.

    ``query`` ``[b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, q, d]`` (after the
    rotary embedding), ``attention_mask`` additive ``[b, 1, q, C]`` in the query's dtype,
    ``C <= capacity``: the attention reads the first ``C`` cache rows (every row written
    must be below ``C``). Returns ``([b, q, heads, d], None)`` as transformers' functions
    do.

    Raises:
        RuntimeError: a model module not attached to an engine cache (``_kdtree_kv``).
    """
    torch = _torch()
    cache: StaticKV | None = getattr(module, "_kdtree_kv", None)
    if cache is None:
        raise RuntimeError("attention implementation 'kdtree' needs the model attached to a kdtree engine cache "
                           "(kdtree.engine.batched.Engine does this)")
    layer = module.layer_idx
    step = cache.step
    b, kv_heads, q, d = key.shape
    if kv_heads != cache.keys[layer].shape[1] or d != cache.keys[layer].shape[3]:
        raise RuntimeError(f"layer {layer} computed keys of {kv_heads} heads x {d} dims, but the engine's cache holds "
                           f"{cache.keys[layer].shape[1]} x {cache.keys[layer].shape[3]} (a model sharded or changed "
                           "after the engine was built)")
    if step.slots is None:
        kc, vc = cache.keys[layer][:b], cache.values[layer][:b]
        idx = step.rows[:, None, :, None].expand(b, kv_heads, q, d)
        kc.scatter_(2, idx, key.to(kc.dtype))
        vc.scatter_(2, idx, value.to(vc.dtype))
    else:  # requests in any slots: write through the full buffers, attend over gathered copies
        slots = step.slots
        where = (slots[:, None, None], torch.arange(kv_heads, device=key.device)[None, :, None], step.rows[:, None, :])
        cache.keys[layer].index_put_(where, key.to(cache.keys[layer].dtype))
        cache.values[layer].index_put_(where, value.to(cache.values[layer].dtype))
        kc, vc = cache.keys[layer].index_select(0, slots), cache.values[layer].index_select(0, slots)
    if step.trees is not None and step.slots is None:
        from ..core import api

        out, _, step.status = api.tree_attention(query.transpose(1, 2), kc, vc, step.trees, step.prefix,
                                                 layout="bhsd", max_prefix=step.max_prefix, softmax_scale=scaling,
                                                 errors="status")
        return out, None
    cols = attention_mask.shape[-1]  # a mask over fewer columns than the capacity: the first cols rows
    if cols < kc.shape[2]:
        kc, vc = kc[:, :, :cols], vc[:, :, :cols]
    out = torch.nn.functional.scaled_dot_product_attention(query, kc, vc, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=query.shape[1] != kv_heads)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Registers :func:`kdtree_attention` under ``"kdtree"`` in transformers'
    ``AttentionInterface`` (and no mask function: the engine passes its own 4-D masks).
    Idempotent; returns the name."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, kdtree_attention)
        try:  # a mask interface entry keeps transformers from building masks of its own
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        except ImportError:  # pragma: no cover - releases without a mask interface
            pass
        _REGISTERED = True
    return ATTENTION_NAME


def check_full_attention(cfg: Any) -> None:
    """ValueError for a config with sliding-window layers: their cache drops rows, and the
    tree rows and compaction assume a cache that keeps every row. Qwen2/Qwen3 configs carry
    a window size with ``use_sliding_window=False``; Mistral-style configs have no switch: a
    window size alone turns the window on."""
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    window_on = getattr(cfg, "use_sliding_window", getattr(cfg, "sliding_window", None) is not None)
    if window_on or any("sliding" in str(t) for t in layer_types):
        raise ValueError("sliding-window attention is not supported: its cache drops rows, and the tree rows "
                         "and compaction assume a cache that keeps every row (use a full-attention model)")


def bind(model: Any, cache: StaticKV) -> int:
    """Points every attention module of ``model`` at ``cache`` (when another engine's cache
    is bound, e.g. two engines share one model); returns the modules bound. Cheap when
    ``cache`` is bound already."""
    if getattr(model, "_kdtree_bound", None) is cache:
        return getattr(model, "_kdtree_bound_count", 0)
    found = 0
    for mod in model.modules():
        if hasattr(mod, "layer_idx") and hasattr(mod, "q_proj") and hasattr(mod, "k_proj"):
            mod._kdtree_kv = cache
            found += 1
    model._kdtree_bound = cache
    model._kdtree_bound_count = found
    return found


def unbind(model: Any) -> None:
    """Drops ``model``'s references to an engine cache (bound by :func:`attach` /
    :func:`bind`), so that a dropped engine's cache can be freed; an engine still in use
    binds its cache again when it runs."""
    for mod in model.modules():
        if getattr(mod, "_kdtree_kv", None) is not None:
            mod._kdtree_kv = None
    model._kdtree_bound = None
    model._kdtree_bound_count = 0


def attach(model: Any, slots: int, capacity: int) -> StaticKV:
    """Allocates the static cache for ``model`` (``slots`` requests of ``capacity`` rows)
    and points every attention module at it; forwards inside :func:`engaged` then use the
    ``"kdtree"`` attention. Returns the cache.

    Raises:
        ValueError: a model without ``layer_idx`` on its attention modules, or with
            sliding-window layers (their cache drops rows the tree rows need).
    """
    torch = _torch()
    cfg = model.config
    check_full_attention(cfg)
    register()
    param = next(model.parameters())
    n_layers = int(cfg.num_hidden_layers)
    kv_heads, head_dim = local_kv_heads(model)
    shape = (int(slots), kv_heads, int(capacity), head_dim)
    cache = StaticKV(keys=[torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(n_layers)],
                     values=[torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(n_layers)])
    found = bind(model, cache)
    if found != n_layers:
        raise ValueError(f"found {found} attention modules with layer_idx in a {n_layers}-layer model; the kdtree "
                         "attention supports the Llama, Qwen2 and Qwen3 families")
    return cache


def local_kv_heads(model: Any) -> tuple[int, int]:
    """(key-value heads, head_dim) of this process's share of ``model``: the config's
    heads, or under tensor parallelism (a model loaded with
    :func:`kdtree.engine.hf.load_causal_lm` ``tp=True``) the heads of this rank's slice of
    the key projection.

    Raises:
        ValueError: a key projection whose rows are not a whole number of heads.
    """
    cfg = model.config
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    for mod in model.modules():
        if hasattr(mod, "layer_idx") and hasattr(mod, "k_proj"):
            w = mod.k_proj.weight
            rows = int((w.to_local() if hasattr(w, "to_local") else w).shape[0])
            if rows % head_dim or not 1 <= rows // head_dim <= kv_heads:
                raise ValueError(f"the key projection has {rows} rows here, not a whole number of heads of "
                                 f"{head_dim} dims (at most {kv_heads})")
            return rows // head_dim, head_dim
    return kv_heads, head_dim


@contextmanager
def engaged(model: Any, cache: StaticKV) -> Iterator[None]:
    """Within the block, ``model`` runs the ``"kdtree"`` attention over ``cache``; its own
    attention implementation comes back afterwards, so the model stays usable outside the
    engine (a CUDA graph captured inside the block keeps the kdtree attention)."""
    bind(model, cache)
    cfg = model.config
    before = cfg._attn_implementation
    if before == ATTENTION_NAME:
        yield
        return
    cfg._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = before
