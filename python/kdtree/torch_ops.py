"""kdtree's round as torch custom operators (``torch.library``), so that ``torch.compile``
traces a round that calls kdtree without a graph break, and fake tensors propagate shapes.

Importing this module registers, under the ``kdtree`` namespace:

==========================================  ===============================================
``torch.ops.kdtree.topk_logprobs``          :func:`kdtree.topk_logprobs`
``torch.ops.kdtree.build_trees``            :func:`kdtree.build_trees` (the tree fields)
``torch.ops.kdtree.verify_greedy_from_logits``  :func:`kdtree.verify_greedy_from_logits`
``torch.ops.kdtree.compact_kv``             :func:`kdtree.compact_kv` (mutates the caches)
``torch.ops.kdtree.ragged_trees``           :func:`kdtree.ragged_trees` (the packed rows)
``torch.ops.kdtree.verify_sample_from_logits``  :func:`kdtree.verify_sample_from_logits`
``torch.ops.kdtree.tree_attention_mask``    :func:`kdtree.tree_attention_mask` (dense kinds)
``torch.ops.kdtree.tree_attention``         :func:`kdtree.tree_attention` (CUDA only)
==========================================  ===============================================

and ``topk_logprobs_status``, ``build_trees_status``,
``verify_greedy_from_logits_status``, ``compact_kv_status``,
``verify_sample_from_logits_status``, ``tree_attention_mask_status`` and
``tree_attention_status`` (which also returns the log-sum-exp): the same calls with
``errors="status"``, the per-row (top-k: the logits' leading shape) or per-request int32
statuses (0 = KDT_OK) appended to the outputs (``compact_kv_status`` returns them), and no
exception for a failed row or request (its outputs are the function's documented
fallbacks). They read nothing back to the host, so a round of them can be captured in a
CUDA graph (``torch.compile(mode="reduce-overhead")``, ``torch.cuda.graph``).

Each takes and returns torch tensors on the CPU or on a CUDA device and runs the same
library call as the function it names (so results are identical); a TreeBatch travels as
its ten arrays in ``kdtree.torch_ops.TREE_FIELDS`` order (:func:`tree_fields`,
:func:`tree_batch`), with the budget and depth as ints. Errors raise as in those functions
(``errors="raise"``): a ValueError (:class:`kdtree.KdtreeError` from the Python kernels)
naming the argument, or the first failed request or row. Tensor arguments take tensors
only (``max_commit`` a tensor, not an int or a list). Tested on the CPU eagerly, with
``torch.library.opcheck``, and compiled with ``fullgraph=True``.

**C++ kernels for CUDA tensors.** Where libkdtree's folder
holds ``libkdtree_torch.so`` (CMake ``-DKDTREE_TORCH_OPS=ON``; ``nox -s test`` builds it)
built for the torch that is imported, the four ``*_status`` operators' CUDA kernels are its
C++ ones (``NATIVE`` is then its path; ``KDTREE_TORCH_OPS=0`` keeps the Python ones, and a
library that fails to load keeps them with a warning): the
library defines the eight operators' schemas (the same as the Python definitions) and the
CPU kernels, the raising operators' CUDA kernels and the fake kernels below are registered
on them. A ``*_status`` call then runs no Python between ``torch.ops`` and libkdtree:
16-34 us of host work a call on an H100 machine's host against 85-200 for the Python
kernels (``tools/bench_torch_ops.py``, 2026-12-05), and a round of them captured in a CUDA
graph costs one replay (4 us of host time there). The raising operators synchronise to read
the statuses back anyway; their CUDA kernels stay the Python functions. ``ragged_trees``
and CPU tensors always take the Python kernels.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .core import api
from .core.types import TREE_FIELDS, Acceptance, TreeBatch

_DTYPES = {"int32": torch.int32, "int64": torch.int64, "float64": torch.float64, "bool": torch.bool,
           "uint32": torch.uint32}


def tree_fields(trees: TreeBatch) -> tuple[Tensor, ...]:
    """A TreeBatch's arrays (TREE_FIELDS order) as torch tensors."""
    return tuple(_tensor(getattr(trees, name)) for name in TREE_FIELDS)


def _check_fields(fields) -> None:
    """The ten tree fields, num_nodes a [B] tensor (KdtreeError otherwise)."""
    from .core import checks

    if len(fields) != len(TREE_FIELDS):
        raise checks.invalid(f"fields must be the {len(TREE_FIELDS)} tree fields in kdtree.torch_ops.TREE_FIELDS "
                             f"order, got {len(fields)} tensors")
    if fields[0].dim() != 1:
        raise checks.shape_error(f"fields[0] (num_nodes) must be [B], got shape {tuple(fields[0].shape)}")


def tree_batch(fields, budget: int, depth: int) -> TreeBatch:
    """A TreeBatch over tree fields (TREE_FIELDS order): numpy views for CPU tensors (what
    kdtree's host path takes), the tensors themselves on a GPU."""
    _check_fields(fields)
    fields = [f.detach() if f.is_cuda else f.detach().numpy() for f in fields]
    return TreeBatch(**dict(zip(TREE_FIELDS, fields, strict=True)), budget=int(budget), depth=int(depth))


def _tensor(a) -> Tensor:
    if isinstance(a, Tensor):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":  # ml_dtypes' (no torch.from_numpy): the same bits
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _host(x: Tensor):
    """A CPU tensor as the numpy array kdtree's host path reads (bfloat16 and float16 as
    float32, exactly)."""
    x = x.detach()
    return (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).numpy()


def _arg(x: Tensor | None):
    return None if x is None else (x.detach() if x.is_cuda else _host(x))


_TO_INT64 = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32)


def _caps(max_commit: Tensor | None, batch: int):
    """max_commit as the functions take it: a CUDA tensor as int64 [B] (a 0-d one repeated;
    integer dtypes int64 holds exactly), a CPU one as its numpy values."""
    if max_commit is None or not max_commit.is_cuda:
        return _arg(max_commit)
    from .core import checks

    if max_commit.dtype not in _TO_INT64:
        raise checks.type_error(f"max_commit must be an integer tensor that int64 holds, got {max_commit.dtype}")
    if max_commit.dim() == 0:
        max_commit = max_commit.expand(batch)
    return max_commit.to(torch.int64).contiguous()


def _load_native() -> str | None:
    """Loads libkdtree_torch (the C++ CUDA kernels) from the loaded libkdtree's folder when it
    was built for this torch, loads, and ``KDTREE_TORCH_OPS`` is not ``0``, ``off``, ``false``
    or ``no``; returns its path, or None (the Python kernels stay)."""
    if os.environ.get("KDTREE_TORCH_OPS", _NATIVE_DEFAULT).strip().lower() in _OFF:
        return None
    from . import _native

    folder = Path(_native.load()._kdtree_path).resolve().parent
    path = folder / "libkdtree_torch.so"
    if not path.is_file():
        return None
    stamp = folder / "libkdtree_torch.torch-version"
    built_for = stamp.read_text().strip() if stamp.is_file() else "an unknown torch"
    if built_for != torch.__version__:
        warnings.warn(f"{path} was built for torch {built_for}, this is torch {torch.__version__}: the torch "
                      "operators keep their Python kernels (rebuild with -DKDTREE_TORCH_OPS=ON)", stacklevel=2)
        return None
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        warnings.warn(f"{path} could not be loaded ({exc}): the torch operators keep their Python kernels "
                      "(KDTREE_TORCH_OPS=0 skips it)", stacklevel=2)
        return None
    return str(path)


# Whether the C++ CUDA kernels load without KDTREE_TORCH_OPS set (KDTREE_TORCH_OPS=0 keeps
# the Python kernels): yes since their GPU tests passed on an H100 (2026-12-05, 756e857).
_NATIVE_DEFAULT = "1"
_OFF = ("0", "off", "false", "no")  # KDTREE_TORCH_OPS values that keep the Python kernels
NATIVE: str | None = _load_native()
"""The path of the loaded libkdtree_torch (the C++ CUDA kernels), or None."""

# The operators libkdtree_torch defines (schemas in C++, so that a *_status call on CUDA
# tensors runs no Python between torch.ops and the kernel); their CPU kernels, the raising
# operators' CUDA kernels and the fake kernels are the Python functions below.
_NATIVE_OPS = ("topk_logprobs", "build_trees", "verify_greedy_from_logits", "compact_kv", "topk_logprobs_status",
               "build_trees_status", "verify_greedy_from_logits_status", "compact_kv_status")


class _NativeOp:
    """An operator defined by libkdtree_torch: `fn` becomes its CPU kernel (and its CUDA
    kernel for a raising operator: libkdtree_torch gives only the *_status operators C++
    CUDA kernels); register_fake registers its fake kernel; calling it calls the operator."""

    def __init__(self, name: str, fn):
        self._name = f"kdtree::{name}"
        torch.library.impl(self._name, "CPU")(fn)
        if not name.endswith("_status"):
            torch.library.impl(self._name, "CUDA")(fn)
        self.__doc__, self.__wrapped__ = fn.__doc__, fn
        self._op = getattr(torch.ops.kdtree, name)

    def register_fake(self, fake):
        torch.library.register_fake(self._name)(fake)
        return fake

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)


def _op(name: str, mutates_args=()):
    """torch.library.custom_op for `name`, or, when libkdtree_torch defines it, its CPU
    kernel (the same Python function) on the C++ definition."""
    def register(fn):
        if NATIVE is not None and name in _NATIVE_OPS:
            return _NativeOp(name, fn)
        return torch.library.custom_op(f"kdtree::{name}", mutates_args=mutates_args)(fn)
    return register


@_op("topk_logprobs", ())
def topk_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(logprobs float32 [..., k], ids int32 [..., k]) of :func:`kdtree.topk_logprobs`."""
    lp, ids = api.topk_logprobs(_arg(logits), k)
    return _tensor(lp), _tensor(ids)


@topk_logprobs.register_fake
def _(logits, k):
    shape = tuple(logits.shape[:-1]) + (k,)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


@_op("build_trees", ())
def build_trees(logprobs: Tensor, token_ids: Tensor, budget: int, root_tokens: Tensor | None = None,
                root_positions: Tensor | None = None, pad_token: int = -1, request_budgets: Tensor | None = None,
                request_depths: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The ten tree fields (``kdtree.torch_ops.TREE_FIELDS`` order) of
    :func:`kdtree.build_trees` on ``[B, L, K]`` log-probs and ids (per-request budgets and
    depth limits: int32 ``[B]`` tensors or None)."""
    trees = api.build_trees(_arg(logprobs), _arg(token_ids), budget, root_tokens=_arg(root_tokens),
                            root_positions=_arg(root_positions), pad_token=pad_token,
                            request_budgets=_arg(request_budgets), request_depths=_arg(request_depths))
    return tuple(_tensor(getattr(trees, name)) for name in TREE_FIELDS)


@build_trees.register_fake
def _(logprobs, token_ids, budget, root_tokens=None, root_positions=None, pad_token=-1, request_budgets=None,
      request_depths=None):
    return _build_fake(logprobs, budget)


def _build_fake(logprobs, budget):
    batch, rows = (logprobs.shape[0] if logprobs.dim() == 3 else 1), budget + 1  # [L, K]: one request
    words = (rows + 31) // 32
    shapes = {1: (batch,), 2: (batch, rows), 3: (batch, rows, rows)}
    out = []
    for name, (dtype, ndim) in TREE_FIELDS.items():
        shape = (batch, rows, words) if name == "visibility_bits" else shapes[ndim]
        out.append(logprobs.new_empty(shape, dtype=_DTYPES[dtype]))
    return tuple(out)


@_op("verify_greedy_from_logits", ())
def verify_greedy_from_logits(fields: list[Tensor], budget: int, depth: int, target_logits: Tensor,
                              stop_tokens: list[int], max_commit: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(accepted_nodes int32 [B, min(depth, budget) + 1], accept_length int32 [B],
    bonus_token int32 [B]) of :func:`kdtree.verify_greedy_from_logits` on the trees given by
    their fields, budget N and depth (the L they were built with: the drafter's positions,
    ``logprobs.shape[1]`` of :func:`build_trees`). ``max_commit``: None or an integer
    tensor ``[B]`` (or 0-d)."""
    trees = tree_batch(fields, budget, depth)
    acc = api.verify_greedy_from_logits(trees, _arg(target_logits), stop_tokens=stop_tokens,
                                        max_commit=_caps(max_commit, trees.batch))
    return _tensor(acc.accepted_nodes), _tensor(acc.accept_length), _tensor(acc.bonus_token)


@verify_greedy_from_logits.register_fake
def _(fields, budget, depth, target_logits, stop_tokens, max_commit):
    _check_fields(fields)
    batch = fields[0].shape[0]
    new = target_logits.new_empty
    return (new((batch, min(depth, budget) + 1), dtype=torch.int32), new((batch,), dtype=torch.int32),
            new((batch,), dtype=torch.int32))


@_op("compact_kv", ("k_layers", "v_layers"))
def compact_kv(k_layers: list[Tensor], v_layers: list[Tensor], prefix_lengths: Tensor, accepted_nodes: Tensor,
               accept_length: Tensor, bonus_token: Tensor) -> None:
    """:func:`kdtree.compact_kv` on ``[B, H, S, D]`` caches, in place (CPU tensors through
    numpy views of the same memory); keys and values both (a keys-only cache is the
    function's ``v_layers=None``, not this operator's)."""
    acc = Acceptance(_arg(accepted_nodes), _arg(accept_length), _arg(bonus_token))
    if all(t.is_cuda for t in k_layers):
        api.compact_kv(list(k_layers), list(v_layers), prefix_lengths, acc)
        return
    # the tensors themselves: the function reads every cache dtype it takes (bfloat16 and
    # one-byte ones, which have no numpy view) and makes its checks on them (distinct
    # layers, no gradient)
    api.compact_kv(list(k_layers), list(v_layers), _arg(prefix_lengths), acc)


@compact_kv.register_fake
def _(k_layers, v_layers, prefix_lengths, accepted_nodes, accept_length, bonus_token):
    return None


@_op("topk_logprobs_status", ())
def topk_logprobs_status(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs, ids, row_status int32 [...]) of :func:`kdtree.topk_logprobs` with
    ``errors="status"``."""
    top = api.topk_logprobs(_arg(logits), k, errors="status")
    return _tensor(top.logprobs), _tensor(top.ids), _tensor(top.row_status)


@topk_logprobs_status.register_fake
def _(logits, k):
    shape = tuple(logits.shape[:-1]) + (k,)
    lead = tuple(logits.shape[:-1]) or (1,)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32),
            logits.new_empty(lead, dtype=torch.int32))


@_op("build_trees_status", ())
def build_trees_status(logprobs: Tensor, token_ids: Tensor, budget: int, root_tokens: Tensor | None = None,
                       root_positions: Tensor | None = None, pad_token: int = -1,
                       request_budgets: Tensor | None = None, request_depths: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                  Tensor]:
    """:func:`build_trees`'s ten fields and the int32 ``[B]`` request statuses
    (``errors="status"``: a failed request gets a root-only tree)."""
    trees = api.build_trees(_arg(logprobs), _arg(token_ids), budget, root_tokens=_arg(root_tokens),
                            root_positions=_arg(root_positions), pad_token=pad_token,
                            request_budgets=_arg(request_budgets), request_depths=_arg(request_depths),
                            errors="status")
    return (*(_tensor(getattr(trees, name)) for name in TREE_FIELDS), _tensor(trees.request_status))


@build_trees_status.register_fake
def _(logprobs, token_ids, budget, root_tokens=None, root_positions=None, pad_token=-1, request_budgets=None,
      request_depths=None):
    fields = _build_fake(logprobs, budget)
    return (*fields, logprobs.new_empty(fields[0].shape, dtype=torch.int32))


@_op("verify_greedy_from_logits_status", ())
def verify_greedy_from_logits_status(fields: list[Tensor], budget: int, depth: int, target_logits: Tensor,
                                     stop_tokens: list[int], max_commit: Tensor | None
                                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`verify_greedy_from_logits`'s three outputs and the int32 ``[B]`` request
    statuses (``errors="status"``)."""
    trees = tree_batch(fields, budget, depth)
    acc = api.verify_greedy_from_logits(trees, _arg(target_logits), stop_tokens=stop_tokens,
                                        max_commit=_caps(max_commit, trees.batch), errors="status")
    return (_tensor(acc.accepted_nodes), _tensor(acc.accept_length), _tensor(acc.bonus_token),
            _tensor(acc.request_status))


@verify_greedy_from_logits_status.register_fake
def _(fields, budget, depth, target_logits, stop_tokens, max_commit):
    _check_fields(fields)
    batch = fields[0].shape[0]
    new = target_logits.new_empty
    return (new((batch, min(depth, budget) + 1), dtype=torch.int32), new((batch,), dtype=torch.int32),
            new((batch,), dtype=torch.int32), new((batch,), dtype=torch.int32))


@_op("compact_kv_status", ("k_layers", "v_layers"))
def compact_kv_status(k_layers: list[Tensor], v_layers: list[Tensor], prefix_lengths: Tensor,
                      accepted_nodes: Tensor, accept_length: Tensor, bonus_token: Tensor) -> Tensor:
    """:func:`compact_kv` with ``errors="status"``: the int32 ``[B]`` request statuses (a
    failed request's cache is not touched)."""
    acc = Acceptance(_arg(accepted_nodes), _arg(accept_length), _arg(bonus_token))
    if all(t.is_cuda for t in k_layers):
        return _tensor(api.compact_kv(list(k_layers), list(v_layers), prefix_lengths, acc, errors="status"))
    return _tensor(api.compact_kv(list(k_layers), list(v_layers), _arg(prefix_lengths), acc, errors="status"))


@compact_kv_status.register_fake
def _(k_layers, v_layers, prefix_lengths, accepted_nodes, accept_length, bonus_token):
    return accepted_nodes.new_empty((accepted_nodes.shape[0],), dtype=torch.int32)


def _settings(x: Tensor | None):
    """A per-request sampling setting as the function takes it: a CUDA tensor as it is
    (float32 / int64 / int32 ``[B]``, checked there), a CPU one as its numpy values."""
    if x is None or x.is_cuda:
        return None if x is None else x.detach()
    return x.item() if x.dim() == 0 else x.detach().numpy()


def _verify_sample(fields, budget, depth, target_logits, temperature, seed, offset, top_p, top_k, stop_tokens,
                   max_commit, errors):
    trees = tree_batch(fields, budget, depth)
    return api.verify_sample_from_logits(
        trees, _arg(target_logits), _settings(temperature), seed=_settings(seed), offset=_settings(offset),
        top_p=_settings(top_p), top_k=_settings(top_k), stop_tokens=stop_tokens,
        max_commit=_caps(max_commit, trees.batch), errors=errors)


@_op("verify_sample_from_logits", ())
def verify_sample_from_logits(fields: list[Tensor], budget: int, depth: int, target_logits: Tensor,
                              temperature: Tensor, seed: Tensor, offset: Tensor, top_p: Tensor | None,
                              top_k: Tensor | None, stop_tokens: list[int], max_commit: Tensor | None
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """(accepted_nodes, accept_length, bonus_token) of :func:`kdtree.verify_sample_from_logits`:
    the per-request settings as tensors, ``temperature`` (float32; 0: greedy for that
    request), ``seed`` and ``offset`` (int64; advance the offset every round), ``top_p``
    (float32) and ``top_k`` (int32) or None: ``[B]`` on CUDA (read by the kernel, so a
    captured round replays with the values they hold then), ``[B]`` or 0-d on the CPU."""
    acc = _verify_sample(fields, budget, depth, target_logits, temperature, seed, offset, top_p, top_k, stop_tokens,
                         max_commit, "raise")
    return _tensor(acc.accepted_nodes), _tensor(acc.accept_length), _tensor(acc.bonus_token)


@verify_sample_from_logits.register_fake
def _(fields, budget, depth, target_logits, temperature, seed, offset, top_p, top_k, stop_tokens, max_commit):
    _check_fields(fields)
    batch, new = fields[0].shape[0], target_logits.new_empty
    return (new((batch, min(depth, budget) + 1), dtype=torch.int32), new((batch,), dtype=torch.int32),
            new((batch,), dtype=torch.int32))


@_op("verify_sample_from_logits_status", ())
def verify_sample_from_logits_status(fields: list[Tensor], budget: int, depth: int, target_logits: Tensor,
                                     temperature: Tensor, seed: Tensor, offset: Tensor, top_p: Tensor | None,
                                     top_k: Tensor | None, stop_tokens: list[int], max_commit: Tensor | None
                                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`verify_sample_from_logits` (the operator) with ``errors="status"``: its three
    outputs and the int32 ``[B]`` request statuses."""
    acc = _verify_sample(fields, budget, depth, target_logits, temperature, seed, offset, top_p, top_k, stop_tokens,
                         max_commit, "status")
    return (_tensor(acc.accepted_nodes), _tensor(acc.accept_length), _tensor(acc.bonus_token),
            _tensor(acc.request_status))


@verify_sample_from_logits_status.register_fake
def _(fields, budget, depth, target_logits, temperature, seed, offset, top_p, top_k, stop_tokens, max_commit):
    _check_fields(fields)
    batch, new = fields[0].shape[0], target_logits.new_empty
    return (new((batch, min(depth, budget) + 1), dtype=torch.int32), new((batch,), dtype=torch.int32),
            new((batch,), dtype=torch.int32), new((batch,), dtype=torch.int32))


_MASK_KINDS = ("bool", "bits", "additive")


def _mask(fields, budget, depth, prefix_lengths, kind, columns, dtype, errors):
    from .core import checks

    if kind not in _MASK_KINDS:
        raise checks.invalid(f"kind must be one of {_MASK_KINDS} for the operator (FlashInfer's packed layout has "
                             f"a data-dependent size: call kdtree.tree_attention_mask), got {kind!r}")
    return api.tree_attention_mask(tree_batch(fields, budget, depth), _arg(prefix_lengths), kind=kind,
                                   dtype=dtype if dtype is not None else "float32", columns=columns, errors=errors)


def _mask_fake(fields, budget, prefix_lengths, kind, columns, dtype):
    _check_fields(fields)
    batch, rows, new = fields[0].shape[0], budget + 1, fields[0].new_empty
    if kind == "bits":
        mask = new((batch, rows, (columns + 31) // 32), dtype=torch.uint32)
    else:
        mask = new((batch, rows, columns), dtype=torch.bool if kind == "bool" else (dtype or torch.float32))
    return mask, new((batch, rows), dtype=torch.int64)


@_op("tree_attention_mask", ())
def tree_attention_mask(fields: list[Tensor], budget: int, depth: int, prefix_lengths: Tensor, kind: str,
                        columns: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(mask, positions int64 ``[B, N+1]``) of :func:`kdtree.tree_attention_mask` with
    ``kind`` ``"bool"`` (bool ``[B, N+1, C]``), ``"bits"`` (uint32 ``[B, N+1, ceil(C/32)]``)
    or ``"additive"`` (``dtype``: float32, float16 or bfloat16, ``[B, N+1, C]``) and C =
    ``columns`` (required: the output's shape must not depend on the values of
    ``prefix_lengths``; at least ``max(p) + N + 1``)."""
    m = _mask(fields, budget, depth, prefix_lengths, kind, columns, dtype, "raise")
    return _tensor(m.mask), _tensor(m.positions)


@tree_attention_mask.register_fake
def _(fields, budget, depth, prefix_lengths, kind, columns, dtype=None):
    return _mask_fake(fields, budget, prefix_lengths, kind, columns, dtype)


@_op("tree_attention_mask_status", ())
def tree_attention_mask_status(fields: list[Tensor], budget: int, depth: int, prefix_lengths: Tensor, kind: str,
                               columns: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tree_attention_mask` (the operator) with ``errors="status"``: mask, positions
    and the int32 ``[B]`` request statuses (a failed request's rows all hidden)."""
    m = _mask(fields, budget, depth, prefix_lengths, kind, columns, dtype, "status")
    return _tensor(m.mask), _tensor(m.positions), _tensor(m.request_status)


@tree_attention_mask_status.register_fake
def _(fields, budget, depth, prefix_lengths, kind, columns, dtype=None):
    mask, positions = _mask_fake(fields, budget, prefix_lengths, kind, columns, dtype)
    return mask, positions, fields[0].new_empty((fields[0].shape[0],), dtype=torch.int32)


def _attention(q, k_cache, v_cache, fields, budget, depth, prefix_lengths, layout, block_table, max_prefix,
               softmax_scale, errors):
    from .core import checks

    if not q.is_cuda:
        raise checks.invalid("tree_attention runs on the GPU: q, k_cache and v_cache must be CUDA tensors "
                             f"(got {q.device})")
    return api.tree_attention(q, k_cache, v_cache, tree_batch(fields, budget, depth), prefix_lengths, layout=layout,
                              block_table=block_table, max_prefix=max_prefix, softmax_scale=softmax_scale,
                              return_lse=errors == "status", errors=errors)


@torch.library.custom_op("kdtree::tree_attention", mutates_args=())
def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, fields: list[Tensor], budget: int, depth: int,
                   prefix_lengths: Tensor, layout: str | None = None, block_table: Tensor | None = None,
                   max_prefix: int | None = None, softmax_scale: float | None = None) -> Tensor:
    """The verify forward's attention, :func:`kdtree.tree_attention` (CUDA tensors only): the
    output like ``q`` ``[B, N+1, q_heads, head_dim]``; the trees given by their fields,
    budget and depth."""
    out, _, _ = _attention(q, k_cache, v_cache, fields, budget, depth, prefix_lengths, layout, block_table,
                           max_prefix, softmax_scale, "raise")
    return out


@tree_attention.register_fake
def _(q, k_cache, v_cache, fields, budget, depth, prefix_lengths, layout=None, block_table=None, max_prefix=None,
      softmax_scale=None):
    _check_fields(fields)
    return torch.empty_like(q)


@torch.library.custom_op("kdtree::tree_attention_status", mutates_args=())
def tree_attention_status(q: Tensor, k_cache: Tensor, v_cache: Tensor, fields: list[Tensor], budget: int,
                          depth: int, prefix_lengths: Tensor, layout: str | None = None,
                          block_table: Tensor | None = None, max_prefix: int | None = None,
                          softmax_scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tree_attention` (the operator) with ``errors="status"``: the output, the float32
    ``[B, N+1, q_heads]`` log-sum-exp and the int32 ``[B]`` request statuses (a failed
    request's rows zeros)."""
    out, lse, status = _attention(q, k_cache, v_cache, fields, budget, depth, prefix_lengths, layout, block_table,
                                  max_prefix, softmax_scale, "status")
    return out, lse, status


@tree_attention_status.register_fake
def _(q, k_cache, v_cache, fields, budget, depth, prefix_lengths, layout=None, block_table=None, max_prefix=None,
      softmax_scale=None):
    _check_fields(fields)
    batch, rows, heads = q.shape[0], q.shape[1], q.shape[2]
    return (torch.empty_like(q), q.new_empty((batch, rows, heads), dtype=torch.float32),
            q.new_empty((batch,), dtype=torch.int32))


@_op("ragged_trees", ())
def ragged_trees(fields: list[Tensor], budget: int, depth: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(cu_rows, row_request, row_node, tokens, depths, parents, positions, visibility_bits)
    of :func:`kdtree.ragged_trees` with the default capacity ``B * (N + 1)``."""
    r = api.ragged_trees(tree_batch(fields, budget, depth))
    names = ("cu_rows", "row_request", "row_node", "tokens", "depths", "parents", "positions", "visibility_bits")
    return tuple(_tensor(getattr(r, name)) for name in names)


@ragged_trees.register_fake
def _(fields, budget, depth):
    _check_fields(fields)
    batch, rows = fields[0].shape[0], budget + 1
    cap, new = batch * rows, fields[0].new_empty
    return (new((batch + 1,), dtype=torch.int32), *(new((cap,), dtype=torch.int32) for _ in range(5)),
            new((cap,), dtype=torch.int64), new((cap, (rows + 31) // 32), dtype=torch.uint32))
