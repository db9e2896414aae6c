"""DFlash drafters in their published checkpoint format (z-lab's ``*-DFlash*`` folders).

A DFlash drafter (Chen, Liang & Liu, arXiv 2602.06036) is a few Qwen3-style layers that
draft a block of ``block_size`` tokens at once. What it computes, as the published module
does (``DFlashDraftModel`` in z-lab's code and in the DDTree release):

- **Context features.** The target's hidden states after the layers ``target_layer_ids``
  (0-based layer numbers: hidden state ``i + 1`` of transformers' ``hidden_states``, whose
  entry 0 is the embeddings) are concatenated per position, projected by ``fc`` (no bias)
  and normalised by ``hidden_norm``.
- **The block.** ``[root, mask, ..., mask]``: the last committed token and
  ``block_size - 1`` copies of ``mask_token_id``, embedded by the *target's* embedding;
  the root at position ``T`` (the number of context tokens), mask ``j`` at ``T + j``.
- **Each layer.** Queries from the normalised block (``input_layernorm``), keys and values
  from ``[context features; normalised block]`` with the layer's own projections, Qwen3's
  per-head ``q_norm``/``k_norm`` (not on values), rotary positions (context token ``i``
  at ``i``), no mask: the block sees the whole context and itself. Then the residual, the
  ``post_attention_layernorm`` and the SwiGLU MLP, as in Qwen3.
- **Logits.** ``norm`` of the block's last ``block_size - 1`` rows through the *target's*
  LM head: the distributions at depths ``1 .. block_size - 1`` below the root.

The context keys and values depend only on the context features, so a decoder caches them
(:class:`DFlashKV` for the batched engine): each committed position's features are
projected once.

Folder format (as published): ``config.json`` (a Qwen3 config with ``block_size``,
``num_target_layers`` and ``dflash_config: {target_layer_ids, mask_token_id}``) and
``model.safetensors`` (or sharded with ``model.safetensors.index.json``) holding
``layers.*``, ``fc``, ``hidden_norm`` and ``norm``; the embedding and LM head are the
target's. Imports torch and transformers on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("kdtree.engine.dflash needs PyTorch (pip install torch)") from exc
    return torch


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a DFlash config without ``target_layer_ids`` uses (the published
    rule): the middle layer for a one-layer drafter, else ``num_draft_layers`` layers
    spread evenly from layer 1 to layer ``num_target_layers - 3``, rounded."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def dflash_config(data: dict | str | Path) -> Any:
    """A transformers ``Qwen3Config`` for a DFlash drafter, from a ``config.json`` dict,
    its text, or its path; checked and completed: ``target_layer_ids`` filled in by
    :func:`default_target_layer_ids` when absent.

    Raises:
        ValueError: not a JSON object; ``block_size`` not an integer >= 2;
        ``num_target_layers``, ``target_layer_ids`` or ``mask_token_id`` missing or out of
        range; sliding-window layers (the drafter attends to the whole context).
    """
    from transformers import Qwen3Config

    try:
        if isinstance(data, Path) or (isinstance(data, str) and not data.lstrip().startswith("{")):
            where = str(data)
            data = json.loads(Path(data).read_text())
        else:
            where = "the DFlash config"
            if isinstance(data, str):
                data = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON text ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a DFlash config must be a JSON object, got {type(data).__name__}")
    data = dict(data)
    sub = data.get("dflash_config")
    if not isinstance(sub, dict):
        raise ValueError(f"{where}: 'dflash_config' (with 'mask_token_id' and 'target_layer_ids') is missing; "
                         f"is this a DFlash drafter folder?")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    block = data.get("block_size")
    if not is_int(block) or not 2 <= block <= 1024:
        raise ValueError(f"{where}: block_size must be an integer in [2, 1024], got {block!r}")
    for name, cap in (("num_hidden_layers", 256), ("hidden_size", 1 << 16), ("intermediate_size", 1 << 20),
                      ("num_attention_heads", 1024), ("num_key_value_heads", 1024), ("vocab_size", 2**31 - 1)):
        v = data.get(name)
        if v is None and name == "num_key_value_heads":
            continue  # transformers: as many as the query heads
        if not is_int(v) or not 1 <= v <= cap:
            raise ValueError(f"{where}: {name} must be an integer in [1, {cap}], got {v!r}")
    layers = data["num_hidden_layers"]
    heads, kv = data["num_attention_heads"], data.get("num_key_value_heads") or data["num_attention_heads"]
    if heads % kv:
        raise ValueError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    head_dim = data.get("head_dim")
    if head_dim is not None and (not is_int(head_dim) or head_dim < 2 or head_dim % 2):
        raise ValueError(f"{where}: head_dim must be an even integer >= 2 (rotary embeddings), got {head_dim!r}")
    n_target = data.get("num_target_layers")
    if n_target is not None and (not is_int(n_target) or n_target < 1):
        raise ValueError(f"{where}: num_target_layers must be an integer >= 1, got {n_target!r}")
    ids = sub.get("target_layer_ids")
    if ids is None:
        if not is_int(n_target) or n_target < 4:
            raise ValueError(f"{where}: without dflash_config.target_layer_ids, num_target_layers must be an "
                             f"integer >= 4, got {n_target!r}")
        ids = default_target_layer_ids(n_target, layers)
    if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids) or len(set(ids)) < len(ids):
        raise ValueError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of distinct integers "
                         f">= 0, got {ids!r}")
    if is_int(n_target) and max(ids) >= n_target:
        raise ValueError(f"{where}: target_layer_ids {ids} name layers beyond num_target_layers {n_target}")
    vocab = data.get("vocab_size")
    mask = sub.get("mask_token_id")
    if not is_int(mask) or not 0 <= mask < (vocab if is_int(vocab) else 2**31):
        raise ValueError(f"{where}: dflash_config.mask_token_id must be a token id in [0, vocab_size={vocab}), "
                         f"got {mask!r}")
    layer_types = data.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise ValueError(f"{where}: layer_types must be a list of strings, got {layer_types!r}")
    if data.get("use_sliding_window") or "sliding_attention" in (layer_types or ()):
        raise ValueError(f"{where}: sliding-window drafter layers are not supported")
    data["dflash_config"] = {**sub, "target_layer_ids": list(ids), "mask_token_id": mask}
    data.pop("auto_map", None)
    try:
        return Qwen3Config(**{k: v for k, v in data.items() if k not in ("model_type", "transformers_version")})
    except Exception as exc:  # noqa: BLE001 - transformers' own validation (its errors are not ValueErrors)
        reason = " ".join(str(exc).split())  # transformers' messages span lines
        raise ValueError(f"{where}: not a valid Qwen3 config for a DFlash drafter: {reason}") from exc


def _build_classes():
    torch = _torch()
    nn = torch.nn
    F = torch.nn.functional
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    class DFlashAttention(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
            self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
            bias = bool(getattr(cfg, "attention_bias", False))
            d = self.head_dim
            self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=bias)
            self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
            self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=bias)
            self.o_proj = nn.Linear(self.heads * d, cfg.hidden_size, bias=bias)
            self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
            self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

        def split(self, x, heads):
            b, s, _ = x.shape
            return x.view(b, s, heads, self.head_dim)

        def query(self, x, cos, sin):
            """Rotated, normalised queries ``[b, heads, s, d]`` of normalised rows ``x``."""
            return rotate(self.q_norm(self.split(self.q_proj(x), self.heads)).transpose(1, 2), cos, sin)

        def key_value(self, x, cos, sin):
            """Rotated, normalised keys and values ``[b, kv_heads, s, d]`` of rows ``x``."""
            k = rotate(self.k_norm(self.split(self.k_proj(x), self.kv_heads)).transpose(1, 2), cos, sin)
            return k, self.split(self.v_proj(x), self.kv_heads).transpose(1, 2)

        def attend(self, q, k, v, mask):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                               enable_gqa=self.heads != self.kv_heads)
            b, _, s, _ = a.shape
            return self.o_proj(a.transpose(1, 2).reshape(b, s, -1))

    class DFlashLayer(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.self_attn = DFlashAttention(cfg)
            self.mlp = Qwen3MLP(cfg)
            self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

        def finish(self, h, attn):
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h))

    class DFlashDrafter(nn.Module):
        """A DFlash drafter over a target's embedding and LM head (module docstring).

        Its parameters carry the published names (``layers.*``, ``fc``, ``hidden_norm``,
        ``norm``); ``embed_tokens`` and ``lm_head`` are the target's modules, held by
        reference (not parameters of the drafter, not saved with it).
        """

        def __init__(self, config, embed_tokens, lm_head):
            super().__init__()
            self.config = config
            ids = list(config.dflash_config["target_layer_ids"])
            self.target_layer_ids = tuple(int(i) for i in ids)
            self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
            self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.fc = nn.Linear(len(ids) * config.hidden_size, config.hidden_size, bias=False)
            self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.rotary_emb = Qwen3RotaryEmbedding(config)
            self._target_io = (embed_tokens, lm_head)  # a tuple: not registered as submodules

        # what the engines read (the same names on kdtree's BlockDrafter)
        @property
        def max_depth(self) -> int:
            """Draft positions per forward (block_size - 1)."""
            return int(self.config.block_size) - 1

        @property
        def feature_layers(self) -> tuple[int, ...]:
            """Indices into transformers' ``hidden_states`` (0 = embeddings) of the features."""
            return tuple(i + 1 for i in self.target_layer_ids)

        @property
        def feature_size(self) -> int:
            return len(self.target_layer_ids) * int(self.config.hidden_size)

        @property
        def vocab_size(self) -> int:
            return int(self._target_io[0].weight.shape[0])

        @property
        def mask_token_id(self) -> int:
            return int(self.config.dflash_config["mask_token_id"])

        @property
        def kdtree_vocab_slice(self):
            """(offset, size) of the vocabulary slice this rank's logits hold when the
            target's LM head is split by vocabulary (read from the head: set by
            ``load_causal_lm(tp=True, vocab_sharded_head=True)`` / ``shard_causal_lm``,
            before or after this drafter was built), else None."""
            return getattr(self._target_io[1], "kdtree_vocab_slice", None)

        def kv_cache(self, slots: int, capacity: int):
            """The batched engine's cached decoder of this drafter (:class:`DFlashKV`)."""
            return DFlashKV(self, slots, capacity)

        def rotary(self, positions, dtype):
            """(cos, sin) ``[b, 1, s, head_dim]`` at int ``positions`` ``[b, s]``."""
            cos, sin = self.rotary_emb(self.fc.weight.to(dtype), positions)
            return cos[:, None], sin[:, None]

        def context(self, features):
            """The context features ``[b, t, hidden]`` of target features ``[b, t, feature_size]``."""
            return self.hidden_norm(self.fc(features))

        def block(self, roots, depth: int):
            """The embedded block ``[b, depth + 1, hidden]``: the roots, then masks."""
            embed = self._target_io[0]
            b = roots.shape[0]
            ids = torch.full((b, depth + 1), self.mask_token_id, dtype=torch.long, device=roots.device)
            ids[:, 0] = roots.long()
            return embed(ids)

        def logits(self, h):
            """Target-head logits of the block rows after the root, ``[b, depth, V]``."""
            return self._target_io[1](self.norm(h[:, 1:]))

        def _checked_depth(self, features, depth):
            depth = self.max_depth if depth is None else int(depth)
            if not 1 <= depth <= self.max_depth:
                raise ValueError(f"depth must be in [1, {self.max_depth}], got {depth}")
            if features.shape[-1] != self.feature_size:
                raise ValueError(f"features have width {features.shape[-1]}, this drafter takes "
                                 f"{self.feature_size} ({len(self.target_layer_ids)} target layers)")
            return depth

        def _layers(self, h, ctx, rot_blk, rot_ctx, allowed):
            """The drafter layers over block rows ``h`` with context features ``ctx`` (their
            rotary tables ``(cos, sin)``); ``allowed`` [b, 1, rows, T + rows] bool: which
            keys each row sees."""
            mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device)
            mask.masked_fill_(~allowed, torch.finfo(h.dtype).min)
            for layer in self.layers:
                att = layer.self_attn
                x = layer.input_layernorm(h)
                kc, vc = att.key_value(ctx, *rot_ctx)
                kb, vb = att.key_value(x, *rot_blk)
                out = att.attend(att.query(x, *rot_blk), torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)
                h = layer.finish(h, out)
            return h

        def forward(self, features, context_valid, bonus, start, depth: int | None = None):
            """Logits ``[B, depth, V]`` for the positions after the bonus (the root).

            features       [B, T, feature_size] the target's hidden states after
                           ``target_layer_ids`` at context positions 0 .. T-1, concatenated
            context_valid  [B, T] bool: which context positions each block may see
            bonus          [B] int: the root token; start [B] int: its position
            depth          drafted positions, 1 .. block_size - 1 (default all)

            Raises:
                ValueError: depth out of range, or features of the wrong width.
            """
            depth = self._checked_depth(features, depth)
            b, t = features.shape[:2]
            s = depth + 1
            dev = features.device
            h = self.block(bonus, depth)
            ctx = self.context(features.to(h.dtype))
            pos_blk = start.long()[:, None] + torch.arange(s, device=dev)[None, :]
            pos_ctx = torch.arange(t, device=dev)[None, :].expand(b, t)
            cb, sb = self.rotary(pos_blk, h.dtype)
            cc, sc = self.rotary(pos_ctx, h.dtype)
            allowed = torch.cat([context_valid[:, None, None, :].expand(b, 1, s, t),
                                 torch.ones((b, 1, s, s), dtype=torch.bool, device=dev)], dim=-1)
            h = self._layers(h, ctx, (cb, sb), (cc, sc), allowed)
            return self.logits(h)

        def forward_blocks(self, features, starts, roots, depth: int | None = None):
            """Logits ``[B, A, depth, V]`` of A blocks per sequence over one shared context
            (the training form of :meth:`forward`: the context keys and values are computed
            once per sequence, not once per block).

            features  [B, T, feature_size] as in :meth:`forward`
            starts    [B, A] int in [0, T]: block a's root position; it sees the context
                      positions before it and its own rows
            roots     [B, A] int: the root tokens
            depth     drafted positions, 1 .. block_size - 1 (default all)

            Equal to :meth:`forward` of each block alone with ``context_valid`` = the
            positions before its start. Raises ValueError as :meth:`forward` does, and for
            ``starts`` and ``roots`` of another shape than ``[B, A]``.
            """
            depth = self._checked_depth(features, depth)
            b, t = features.shape[:2]
            if starts.dim() != 2 or starts.shape[0] != b or roots.shape != starts.shape:
                raise ValueError(f"starts and roots must both be [B={b}, A], got {tuple(starts.shape)} and "
                                 f"{tuple(roots.shape)}")
            a, s, dev = starts.shape[1], depth + 1, features.device
            h = self.block(roots.reshape(-1), depth).reshape(b, a * s, -1)
            ctx = self.context(features.to(h.dtype))
            steps = torch.arange(s, device=dev)
            pos_blk = (starts.long()[:, :, None] + steps).reshape(b, a * s)
            cb, sb = self.rotary(pos_blk, h.dtype)
            cc, sc = self.rotary(torch.arange(t, device=dev)[None, :].expand(b, t), h.dtype)
            row_start = starts.long().repeat_interleave(s, dim=1)  # [b, a * s]
            ctx_ok = torch.arange(t, device=dev)[None, None, :] < row_start[:, :, None]
            blk = torch.arange(a, device=dev).repeat_interleave(s)
            allowed = torch.cat([ctx_ok, (blk[:, None] == blk[None, :]).expand(b, -1, -1)], dim=-1)[:, None]
            h = self._layers(h, ctx, (cb, sb), (cc, sc), allowed)
            return self._target_io[1](self.norm(h.reshape(b, a, s, -1)[:, :, 1:]))

    return DFlashDrafter, rotate


_CLASSES = None


def _classes():
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _build_classes()
    return _CLASSES


def DFlashDrafter(config, embed_tokens, lm_head):  # noqa: N802 - reads as a class
    """A new randomly initialised DFlash drafter for ``config`` (:func:`dflash_config`)
    over a target's ``embed_tokens`` and ``lm_head`` modules."""
    return _classes()[0](config, embed_tokens, lm_head)


def is_dflash(model: Any) -> bool:
    """Whether ``model`` is a :class:`DFlashDrafter`."""
    return _CLASSES is not None and isinstance(model, _CLASSES[0])


def is_dflash_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a DFlash drafter (a ``config.json`` with ``dflash_config``)."""
    p = Path(folder) / CONFIG_NAME
    if not p.is_file():
        return False
    try:
        return isinstance(json.loads(p.read_text()).get("dflash_config"), dict)
    except (ValueError, AttributeError):
        return False


def _target_io(target: Any):
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    if emb is None or head is None:
        raise ValueError("the target has no input embedding or LM head (a transformers *ForCausalLM model is needed)")
    return emb, head


def check_pair(config: Any, target: Any, where: str = "the DFlash drafter") -> None:
    """Refuses a drafter config that does not fit a target (a transformers causal LM or its
    config; nothing is allocated): hidden size, vocabulary, target layers, mask token.

    Raises:
        ValueError: naming the mismatch.
    """
    tc = getattr(target, "config", target)
    tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    if int(config.hidden_size) != int(tc.hidden_size):
        raise ValueError(f"{where}: hidden_size {config.hidden_size} != the target's {tc.hidden_size} (a DFlash "
                         f"drafter embeds with the target's embedding)")
    vocab = int(tc.vocab_size)
    if int(config.vocab_size) != vocab:
        raise ValueError(f"{where}: vocab_size {config.vocab_size} != the target's {vocab}")
    ids = config.dflash_config["target_layer_ids"]
    n = int(tc.num_hidden_layers)
    if max(ids) >= n:
        raise ValueError(f"{where}: target_layer_ids {ids} name layers beyond the target's {n}")
    declared = getattr(config, "num_target_layers", None)
    if declared is not None and int(declared) != n:
        raise ValueError(f"{where}: trained for a target of num_target_layers {declared}; this target has {n} layers")
    if int(config.dflash_config["mask_token_id"]) >= vocab:
        raise ValueError(f"{where}: mask_token_id {config.dflash_config['mask_token_id']} outside the target's "
                         f"vocabulary ({vocab})")


def _weight_files(folder: Path) -> list[Path]:
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    if (folder / INDEX_NAME).is_file():
        try:
            index = json.loads((folder / INDEX_NAME).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{folder / INDEX_NAME}: not valid JSON ({exc})") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"{folder / INDEX_NAME}: 'weight_map' must map weight names to shard files")
        names = sorted(set(wm.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if not names or missing:
            raise FileNotFoundError(f"{folder / INDEX_NAME}: shard files missing: {missing or 'none listed'}")
        return [folder / n for n in names]
    raise FileNotFoundError(f"{folder}: neither {WEIGHTS_NAME} nor {INDEX_NAME} (a DFlash drafter folder)")


def load_dflash(folder: str | Path, target: Any, *, device: Any = None, dtype: Any = None):
    """Loads a published-format DFlash drafter over ``target`` (a loaded transformers
    causal LM: its embedding and LM head are the drafter's), in eval mode, on the target's
    device and dtype unless given.

    Raises:
        FileNotFoundError: config or weights missing. ValueError: a bad config, a drafter
        that does not fit the target (:func:`check_pair`), or weights whose names or shapes
        do not match the config (checked on the files' headers before any weight is read).
        TypeError: ``target`` is not a loaded causal LM.
    """
    if not (callable(getattr(target, "get_input_embeddings", None))
            and callable(getattr(target, "get_output_embeddings", None))):
        raise TypeError(f"load_dflash needs the loaded target model (a transformers causal LM: its embedding and "
                        f"LM head are the drafter's), got {type(target).__name__}")
    torch = _torch()
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_NAME} not found (a DFlash drafter folder)")
    cfg = dflash_config(folder / CONFIG_NAME)
    check_pair(cfg, target, str(folder))
    files = _weight_files(folder)
    emb, head = _target_io(target)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg, emb, head).state_dict().items()}
    stored, where_stored, dtypes = {}, {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if k in where_stored:
                    raise ValueError(f"{folder}: weight {k} is in both {where_stored[k]} and {f.name}")
                sl = h.get_slice(k)
                stored[k], where_stored[k], dtypes[k] = tuple(sl.get_shape()), f.name, sl.get_dtype()
    if (folder / INDEX_NAME).is_file() and not (folder / WEIGHTS_NAME).is_file():
        wm = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        off = sorted(k for k in where_stored if wm.get(k, where_stored[k]) != where_stored[k])
        if off:
            raise ValueError(f"{folder / INDEX_NAME}: weight_map places {off[:3]} in other shards than hold them")
    bad = sorted(k for k, d in dtypes.items() if d not in ("F16", "BF16", "F32", "F64"))
    if bad:
        raise ValueError(f"{folder}: weights of a non-float dtype: {[(k, dtypes[k]) for k in bad[:3]]}")
    # published files may carry the rotary table; nothing else beyond the module's names
    extra = sorted(k for k in set(stored) - set(shapes) if not k.endswith("rotary_emb.inv_freq"))
    missing = sorted(set(shapes) - set(stored))
    if missing or extra:
        raise ValueError(f"{folder}: weights missing {missing[:5]}, unexpected {extra[:5]}")
    wrong = [f"{k}: stored {stored[k]}, config {shapes[k]}" for k in sorted(shapes) if stored[k] != shapes[k]]
    if wrong:
        raise ValueError(f"{folder}: weights do not match {CONFIG_NAME}: " + "; ".join(wrong[:3]))
    param = next(target.parameters())
    device = param.device if device is None else device
    if isinstance(dtype, str):
        if dtype not in ("float32", "float64", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float32', 'float64', 'float16' or 'bfloat16', got {dtype!r}")
        dtype = getattr(torch, dtype)
    dtype = param.dtype if dtype is None else dtype
    model = DFlashDrafter(cfg, emb, head)
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            state.update({k: h.get_tensor(k) for k in h.keys() if k in shapes})
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def save_dflash(model: Any, folder: str | Path) -> None:
    """Writes ``model`` (a :class:`DFlashDrafter`) in the published format: ``config.json``
    and ``model.safetensors`` (its own weights in their dtype; not the target's embedding
    or head)."""
    from safetensors.torch import save

    from ..core.files import write_atomically

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    d = model.config.to_dict()
    d["architectures"] = ["DFlashDraftModel"]
    text = json.dumps(d, indent=2, sort_keys=True, default=str) + "\n"
    write_atomically(folder / WEIGHTS_NAME, lambda f: f.write(save(state)))
    write_atomically(folder / CONFIG_NAME, lambda f: f.write(text.encode()))


class DFlashKV:
    """A :class:`DFlashDrafter` with its context keys and values cached per request slot,
    for the batched engine (the interface of :class:`kdtree.engine.drafter.BlockDrafterKV`):
    :meth:`append` projects committed positions' target features once, :meth:`forward`
    drafts from the cached rows. Computes what ``DFlashDrafter.forward`` computes (tested
    equal). Per layer K and V are ``[slots, kv_heads, capacity + block_size, head_dim]``:
    context position ``i`` at row ``i``, the block in the last ``block_size`` rows. No host
    synchronisation: capturable in a CUDA graph.
    """

    def __init__(self, model: Any, slots: int, capacity: int):
        torch = _torch()
        self.model = model.eval()
        cfg = model.config
        att = model.layers[0].self_attn
        param = next(model.parameters())
        self.capacity = int(capacity)
        self.block_size = int(cfg.block_size)
        self.kv_heads, self.head_dim = att.kv_heads, att.head_dim
        shape = (int(slots), att.kv_heads, self.capacity + self.block_size, att.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.layers]
        self.values = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.layers]
        self._cols = torch.arange(self.capacity + self.block_size, device=param.device)
        cos, sin = model.rotary(self._cols[None], param.dtype)
        self._cos, self._sin = cos[0, 0], sin[0, 0]  # [capacity + block_size, head_dim]

    def _rotary(self, positions):
        return self._cos[positions][:, None], self._sin[positions][:, None]

    def append(self, features: Any, rows: Any, slot: Any = None) -> None:
        """Caches the context keys and values of target ``features`` ``[b, r, feature_size]``
        at context rows ``rows`` int64 ``[b, r]`` (< capacity). ``slot``: None for slots
        ``0 .. b-1``, or int64 ``[b]``."""
        from .drafter import write_rows

        torch = _torch()
        m = self.model
        with torch.no_grad():
            ctx = m.context(features.to(self.keys[0].dtype))
            cos, sin = self._rotary(rows)
            heads = torch.arange(self.kv_heads, device=rows.device)[None, :, None]
            for i, layer in enumerate(m.layers):
                k, v = layer.self_attn.key_value(ctx, cos, sin)
                write_rows(self.keys[i], self.values[i], k, v, rows, slot, heads)

    def forward(self, roots: Any, lengths: Any, depth: int | None = None) -> Any:
        """Drafter logits ``[b, depth, V]`` after each request's root (``roots`` int
        ``[b]``), with ``lengths`` int64 ``[b]`` context positions cached (the root's
        position)."""
        torch = _torch()
        m = self.model
        depth = m.max_depth if depth is None else int(depth)
        if not 1 <= depth <= m.max_depth:
            raise ValueError(f"depth must be in [1, {m.max_depth}], got {depth}")
        b, s = int(roots.shape[0]), depth + 1
        dev = roots.device
        with torch.no_grad():
            h = m.block(roots, depth).to(self.keys[0].dtype)
            pos = lengths[:, None] + torch.arange(s, device=dev)[None, :]
            cos, sin = self._rotary(pos)
            cols = self._cols
            visible = (cols[None, :] < lengths[:, None]) | ((cols[None, :] >= self.capacity)
                                                          & (cols[None, :] < self.capacity + s))
            mask = torch.zeros((b, 1, 1, cols.shape[0]), dtype=h.dtype, device=dev)
            mask.masked_fill_(~visible[:, None, None, :], torch.finfo(h.dtype).min)
            tail = self.capacity + torch.arange(s, device=dev)
            idx = tail[None, None, :, None].expand(b, self.kv_heads, s, self.head_dim)
            for i, layer in enumerate(m.layers):
                att = layer.self_attn
                kc, vc = self.keys[i][:b], self.values[i][:b]
                x = layer.input_layernorm(h)
                kb, vb = att.key_value(x, cos, sin)
                kc.scatter_(2, idx, kb)
                vc.scatter_(2, idx, vb)
                h = layer.finish(h, att.attend(att.query(x, cos, sin), kc, vc, mask))
            return m.logits(h)
