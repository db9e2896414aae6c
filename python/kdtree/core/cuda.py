"""GPU front end of libkdtree: the kdtree functions on CUDA arrays (torch, CuPy, ...).

The public functions in :mod:`kdtree.core.api` dispatch here when their array inputs are CUDA
arrays (:func:`kdtree._device.is_device_array`). Every kernel runs on the caller's current
stream (or ``stream=``) and on the device of the inputs; outputs are allocated with the
inputs' library. Nothing here synchronises except error checking: with
``errors="raise"`` (the default) the per-request / per-row statuses are copied to the host
after the launch and the first failure raises :class:`KdtreeError`; with
``errors="status"`` nothing is copied and the statuses are returned for the caller to
inspect later (the whole round then stays on the device, capturable in a CUDA graph).
"""

from __future__ import annotations

import ctypes

import numpy as np

from .. import _native as _lib
from .._native import KdtreeError
from . import checks
from . import device as dev
from .types import RAGGED_FIELDS, TREE_FIELDS, Acceptance, RaggedTrees, TopK, TreeBatch, TreeMask

_DTYPE_CODES = {"float32": 12, "float16": 10, "bfloat16": 11}  # kdt_dtype
# KV caches compaction moves: the float types, and one-byte ones (fp8 e4m3 / e5m2, int8,
# uint8) as kdt_dtype uint8 (moved as bytes).
_KV_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
_KV_CODES = {**_DTYPE_CODES, "float8_e4m3fn": 6, "float8_e5m2": 6, "int8": 6, "uint8": 6}
MASK_KINDS = {"bool": 0, "bits": 1, "additive": None, "flashinfer": 5}
_ADDITIVE = {"float32": 2, "float16": 3, "bfloat16": 4}
_STATUS_OK = 0





def _raise_on_status(status, what: str, unit: str = "request") -> None:
    """Copies a device status array to the host and raises on the first failure."""
    if dev.capturing(status):
        raise checks.invalid(f"{what}: errors='raise' reads the per-{unit} statuses to the host, which cannot "
                             "happen inside CUDA graph capture; pass errors='status' and read request_status later")
    host = dev.to_host(status).reshape(-1)
    bad = np.flatnonzero(host != _STATUS_OK)
    if bad.size:
        i = int(bad[0])
        code = int(host[i])
        name = _lib.STATUS_NAMES.get(code, f"status {code}")
        more = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
        raise KdtreeError(code, f"{unit} {i}: {name}{more}; pass errors='status' to get the per-{unit} "
                          "statuses instead", what)


def _view(obj, name: str, dtype: str | tuple[str, ...], ndim: int | None = None, stream: int | None = None,
          contiguous: bool = True) -> dev.DeviceArray:
    v = dev.view(obj, name, stream)
    allowed = (dtype,) if isinstance(dtype, str) else dtype
    if v.dtype not in allowed:
        raise checks.type_error(f"{name} must have dtype {' or '.join(allowed)}, got {v.dtype}")
    if ndim is not None and len(v.shape) != ndim:
        raise checks.shape_error(f"{name} must have {ndim} dimensions, got shape {v.shape}")
    if contiguous and not v.c_contiguous:
        raise checks.shape_error(f"{name} must be C-contiguous (shape {v.shape}, strides {v.strides})")
    return v


def _same_device(views: list[dev.DeviceArray]) -> None:
    devices = {v.device for v in views}
    if len(devices) > 1:
        raise checks.invalid(f"inputs are on different CUDA devices: {sorted(devices)}")


def _workspace(like, nbytes: int):
    """A 256-byte aligned device buffer of at least nbytes (torch/CuPy allocators align
    to 256 or more; checked)."""
    buf = dev.empty(like, (max(int(nbytes), 1) + 256,), "uint8")
    v = dev.view(buf, "workspace")
    pad = (-v.ptr) % 256
    return buf, v.ptr + pad, int(nbytes)


def _logits_struct(v: dev.DeviceArray, name: str, two_d: str = "request") -> _lib.KdtLogits:
    """kdt_logits of a [B, L, V] device view; a 2-D [L, V] view is one request
    (two_d="request", as the CPU functions read it) or L independent rows (two_d="rows",
    top-k), a 1-D [V] view one row. The vocab axis must have stride 1."""
    if v.dtype not in _DTYPE_CODES:
        raise checks.type_error(f"{name} must be float32, float16 or bfloat16, got {v.dtype}")
    shape, strides = v.shape, v.strides
    if len(shape) == 1:
        shape, strides = (1, 1) + shape, (0, 0) + strides
    elif len(shape) == 2 and two_d == "request":
        shape, strides = (1, shape[0], shape[1]), (0, strides[0], strides[1])
    elif len(shape) == 2:
        shape, strides = (shape[0], 1, shape[1]), (strides[0], 0, strides[1])
    elif len(shape) != 3:
        raise checks.shape_error(f"{name} must be [B, L, V], [R, V] or [V], got shape {v.shape}")
    if shape[2] > 1 and strides[2] != 1:
        raise checks.invalid(f"{name}: the vocab axis must be contiguous (stride 1), got strides {v.strides}")
    if min(strides) < 0:
        raise checks.invalid(f"{name}: negative strides are not supported ({v.strides})")
    return _lib.KdtLogits(v.ptr, _DTYPE_CODES[v.dtype], 0, shape[0], shape[1], shape[2], strides[0], strides[1])


def _trees_struct(t: TreeBatch, stream: int) -> tuple[_lib.KdtTrees, list]:
    views = []
    ptrs = []
    rows = t.budget + 1
    words = (rows + 31) // 32
    for name, (dtype, ndim) in TREE_FIELDS.items():
        a = getattr(t, name)
        if a is None:
            if name == "num_nodes":
                raise checks.invalid("trees.num_nodes is required")
            ptrs.append(None)
            continue
        v = _view(a, f"trees.{name}", ("bool", "uint8") if dtype == "bool" else dtype, ndim, stream)
        want = {1: (t.batch,), 2: (t.batch, rows),
                3: (t.batch, rows, rows if name == "visibility" else words)}[ndim]
        if v.shape != want:
            raise checks.shape_error(f"trees.{name} must have shape {want}, got {v.shape}")
        views.append(v)
        ptrs.append(v.ptr)
    _same_device(views)
    return _lib.KdtTrees(t.batch, t.budget, *ptrs), views


def empty_trees(like, batch: int, budget: int, depth: int) -> TreeBatch:
    """Uninitialised GPU outputs for a tree build, allocated like `like`."""
    rows = budget + 1
    words = (rows + 31) // 32
    return TreeBatch(
        num_nodes=dev.empty(like, (batch,), "int32"),
        tokens=dev.empty(like, (batch, rows), "int32"),
        depths=dev.empty(like, (batch, rows), "int32"),
        parents=dev.empty(like, (batch, rows), "int32"),
        logw=dev.empty(like, (batch, rows), "float64"),
        positions=dev.empty(like, (batch, rows), "int64"),
        visibility=dev.empty(like, (batch, rows, rows), "bool"),
        visibility_bits=dev.empty(like, (batch, rows, words), "uint32"),
        first_child=dev.empty(like, (batch, rows), "int32"),
        next_sibling=dev.empty(like, (batch, rows), "int32"),
        budget=int(budget),
        depth=int(depth),
    )


def _optional(obj, name, dtype, shape, like, stream):
    """A device view of an optional small input (a host array is copied to the device)."""
    if obj is None:
        return None, None
    if not dev.is_device_array(obj):
        dev.require_not_capturing(like, f"{name} is a host array and would be copied to the device")
        host = np.asarray(obj)
        if host.size != int(np.prod(shape)):  # (numpy's reshape error would not name the array)
            raise checks.shape_error(f"{name} must have shape {tuple(shape)}, got {host.shape}")
        obj = dev.from_host(like, np.ascontiguousarray(host.reshape(shape), dtype=dtype))
    v = _view(obj, name, dtype, len(shape), stream)
    if v.shape != tuple(shape):
        raise checks.shape_error(f"{name} must have shape {tuple(shape)}, got {v.shape}")
    return obj, v


def _status_out(old, like, batch: int, name: str = "request_status"):
    """The int32 [batch] status array of a reused output when it has that shape on the
    device, else a new one."""
    if old is not None and dev.is_device_array(old):
        v = dev.view(old, name)
        if v.dtype == "int32" and v.shape == (batch,) and v.c_contiguous:
            return old
    return dev.empty(like, (batch,), "int32")


def _prepare_out(out, like, batch, budget, depth):
    if out is None:
        return empty_trees(like, batch, budget, depth)
    if not isinstance(out, TreeBatch):
        raise checks.type_error(f"out must be a TreeBatch, got {type(out).__name__}")
    if out.batch != batch:
        raise checks.invalid(f"out holds {out.batch} requests, the input {batch}")
    out.budget, out.depth = budget, depth  # checked against the arrays in _trees_struct
    return out


def build_trees(logprobs, token_ids, budget, *, root_tokens, root_positions, vocab_size, pad_token, out,
                errors, stream, request_budgets=None, request_depths=None) -> TreeBatch:
    checks.check_errors(errors)
    s = dev.current_stream(logprobs, stream)
    lp = _view(logprobs, "logprobs", "float32", None, s)
    ids = _view(token_ids, "token_ids", "int32", None, s)
    if len(lp.shape) == 2:
        batch, depth, width = 1, lp.shape[0], lp.shape[1]
    elif len(lp.shape) == 3:
        batch, depth, width = lp.shape
    else:
        raise checks.shape_error(f"logprobs must be [B, L, K] or [L, K], got shape {lp.shape}")
    if ids.shape != lp.shape:
        raise checks.shape_error(f"token_ids {ids.shape} must have the shape of logprobs {lp.shape}")
    lib = _lib.load()
    with dev.on_device(logprobs):
        roots, rv = _optional(root_tokens, "root_tokens", "int32", (batch,), logprobs, s)
        pos, pv = _optional(root_positions, "root_positions", "int64", (batch,), logprobs, s)
        request_budgets, request_depths = (  # host limits: int32, one outside it the request's error
            a if a is None or dev.is_device_array(a) else _host_limit(a, name, batch, errors)
            for a, name in ((request_budgets, "request_budgets"), (request_depths, "request_depths")))
        budgets, bv = _optional(request_budgets, "request_budgets", "int32", (batch,), logprobs, s)
        depths, dv = _optional(request_depths, "request_depths", "int32", (batch,), logprobs, s)
        out = _prepare_out(out, logprobs, batch, budget, depth)
        struct, views = _trees_struct(out, s)
        _same_device([lp, ids, *views] + [v for v in (rv, pv, bv, dv) if v is not None])
        status = _status_out(out.request_status, logprobs, batch)
        sv = dev.view(status, "request_status")
        need = ctypes.c_size_t()
        lib.kdt_trees_build_cuda_workspace_bytes(batch, budget, depth, width, ctypes.byref(need))
        ws, ws_ptr, ws_bytes = _workspace(logprobs, need.value)
        draft = _lib.KdtDraft(batch, depth, width, lp.ptr, ids.ptr, rv.ptr if rv else None,
                              pv.ptr if pv else None, vocab_size, pad_token, bv.ptr if bv else None,
                              dv.ptr if dv else None)
        lib.kdt_trees_build_cuda(ctypes.byref(draft), ctypes.byref(struct), sv.ptr, ws_ptr, ws_bytes, s)
        del ws, roots, pos, budgets, depths  # the allocator keeps the memory until the stream is done with it
    out.request_status = status
    if errors == "raise":
        _raise_on_status(status, "build_trees")
    return out


def _host_limit(values, name: str, batch: int, errors: str) -> np.ndarray:
    from .host import request_limit

    return request_limit(values, name, batch, "", errors)


def _out_array(obj, name: str, dtype: str, shape: tuple, like, stream):
    """A caller's output array checked for dtype, shape, contiguity and device."""
    v = _view(obj, name, dtype, len(shape), stream)
    if v.shape != tuple(shape):
        raise checks.shape_error(f"{name} must have shape {tuple(shape)}, got {v.shape}")
    if v.readonly:
        raise checks.invalid(f"{name} is read-only")
    _same_device([v, dev.view(like, "input")])
    return v


def topk_logprobs(logits, k: int, *, errors: str, stream, out=None):
    checks.check_errors(errors)
    s = dev.current_stream(logits, stream)
    v = dev.view(logits, "logits", s)
    if len(v.shape) < 1:
        raise checks.shape_error("logits must have at least one dimension [..., V]")
    lead = v.shape[:-1]
    vocab = v.shape[-1]
    if not 0 <= k <= min(vocab, 1024):
        raise checks.range_error(f"k must be in [0, min(V={vocab}, 1024)] on the GPU, got {k}")
    struct = _logits_rows_struct(v)
    rows = int(struct.batch * struct.length)
    lib = _lib.load()
    with dev.on_device(logits):
        if out is None:
            out_lp = dev.empty(logits, lead + (k,), "float32")
            out_ids = dev.empty(logits, lead + (k,), "int32")
            status = dev.empty(logits, lead if lead else (1,), "int32")
        else:
            if not isinstance(out, TopK):
                raise checks.type_error(f"out must be a TopK, got {type(out).__name__}")
            out_lp, out_ids, status = out.logprobs, out.ids, out.row_status
            _out_array(out_lp, "out.logprobs", "float32", lead + (k,), logits, s)
            _out_array(out_ids, "out.ids", "int32", lead + (k,), logits, s)
            _out_array(status, "out.row_status", "int32", lead if lead else (1,), logits, s)
        need = ctypes.c_size_t()
        lib.kdt_topk_logprobs_cuda_workspace_bytes(rows, vocab, k, ctypes.byref(need))
        ws, ws_ptr, ws_bytes = _workspace(logits, need.value)
        lib.kdt_topk_logprobs_cuda(ctypes.byref(struct), k, dev.view(out_lp, "out").ptr,
                                   dev.view(out_ids, "out").ptr, dev.view(status, "status").ptr,
                                   ws_ptr, ws_bytes, s)
        del ws
    if errors == "raise":
        try:
            _raise_on_status(status, "topk_logprobs", "row")
        except KdtreeError as exc:
            raise _lib.name_logits_row(exc, tuple(lead)) from None
    return TopK(out_lp, out_ids, status)


def _logits_rows_struct(v: dev.DeviceArray) -> _lib.KdtLogits:
    """kdt_logits of a ``[..., V]`` view as independent rows: up to two leading axes as
    they are, more merged into one when their strides allow it (KdtreeError otherwise)."""
    if len(v.shape) > 3:
        lead, vocab = v.shape[:-1], v.shape[-1]
        merged = _merge_leading(v)
        if merged is None:
            raise checks.shape_error(f"logits: leading axes of shape {lead} with strides {v.strides[:-1]} cannot be "
                                     "merged into rows; pass a [B, L, V] view")
        rows = int(np.prod(lead, dtype=np.int64))
        v = dev.DeviceArray(v.ptr, (rows, vocab), (merged, v.strides[-1]), v.dtype, v.device, v.obj, v._keep)
    return _logits_struct(v, "logits", two_d="rows")


def _merge_leading(v: dev.DeviceArray) -> int | None:
    """The row stride when v's leading axes form one evenly strided axis, else None."""
    lead, strides = v.shape[:-1], v.strides[:-1]
    row = strides[-1]
    expect = row
    for extent, stride in zip(reversed(lead), reversed(strides), strict=True):
        if extent != 1 and stride != expect:
            return None
        expect = expect * extent if extent != 1 else expect
    return row


def build_trees_from_logits(logits, width, budget, *, root_tokens, root_positions, pad_token, out, errors,
                            stream, request_budgets=None, request_depths=None) -> TreeBatch:
    checks.check_errors(errors)
    s = dev.current_stream(logits, stream)
    v = dev.view(logits, "logits", s)
    struct = _logits_struct(v, "logits")
    batch, depth, vocab = struct.batch, struct.length, struct.vocab
    lib = _lib.load()
    with dev.on_device(logits):
        roots, rv = _optional(root_tokens, "root_tokens", "int32", (batch,), logits, s)
        pos, pv = _optional(root_positions, "root_positions", "int64", (batch,), logits, s)
        limits = [a if a is None or dev.is_device_array(a) else _host_limit(a, name, batch, errors)
                  for a, name in ((request_budgets, "request_budgets"), (request_depths, "request_depths"))]
        (budgets, bv), (depths, dv) = (_optional(a, name, "int32", (batch,), logits, s)
                                       for a, name in zip(limits, ("request_budgets", "request_depths"), strict=True))
        out = _prepare_out(out, logits, batch, budget, depth)
        tstruct, views = _trees_struct(out, s)
        _same_device([v, *views] + [x for x in (bv, dv) if x is not None])
        status = _status_out(out.request_status, logits, batch)
        need = ctypes.c_size_t()
        lib.kdt_trees_build_from_logits_cuda_workspace_bytes(batch, budget, depth, vocab, width, ctypes.byref(need))
        ws, ws_ptr, ws_bytes = _workspace(logits, need.value)
        lib.kdt_trees_build_from_logits_cuda(
            ctypes.byref(struct), width, rv.ptr if rv else None, pv.ptr if pv else None, bv.ptr if bv else None,
            dv.ptr if dv else None, pad_token, ctypes.byref(tstruct), dev.view(status, "status").ptr, ws_ptr,
            ws_bytes, s)
        del ws, roots, pos, budgets, depths
    out.request_status = status
    if errors == "raise":
        _raise_on_status(status, "build_trees_from_logits")
    return out


def tree_attention_mask(trees: TreeBatch, prefix_lengths, *, kind: str, dtype: str, columns, errors, stream,
                        out=None):
    checks.check_errors(errors)
    like = trees.num_nodes
    s = dev.current_stream(like, stream)
    batch, rows = trees.batch, trees.budget + 1
    lib = _lib.load()
    with dev.on_device(like):
        tstruct, views = _trees_struct(trees, s)
        prefix, pv = _optional(prefix_lengths, "prefix_lengths", "int64", (batch,), like, s)
        if pv is None:
            raise checks.invalid("prefix_lengths is required (zeros for no prefix)")
        _same_device([*views, pv])
        if out is not None and kind == "flashinfer":
            raise checks.invalid("out= is not supported with kind='flashinfer' (its size depends on prefix_lengths)")
        if kind == "flashinfer":
            if columns is not None:
                raise checks.invalid("columns is not used with kind='flashinfer'")
            if dev.capturing(like):
                raise checks.invalid("tree_attention_mask(kind='flashinfer') reads prefix_lengths to the host to size "
                                     "its ragged output, which cannot happen inside CUDA graph capture; use a dense "
                                     "kind with columns= there")
            host_prefix = dev.to_host(prefix).astype(np.int64)  # sizes the ragged output
            if (host_prefix < 0).any():
                raise checks.range_error(f"prefix_lengths must be >= 0, got {host_prefix.tolist()}")
            nbytes = int(sum((rows * (int(p) + rows) + 7) // 8 for p in host_prefix))
            mask = dev.empty(like, (nbytes,), "uint8")
            indptr = dev.empty(like, (batch + 1,), "int32")
            code, ncols = MASK_KINDS["flashinfer"], 0
        else:
            if columns is None:
                if dev.capturing(like):
                    raise checks.invalid("tree_attention_mask without columns= reads prefix_lengths to the host to "
                                         "size the mask, which cannot happen inside CUDA graph capture; pass columns= "
                                         "(the key columns of the KV cache, e.g. its capacity)")
                host_prefix = dev.to_host(prefix)
                columns = int(host_prefix.max()) + rows if batch else rows
            ncols = int(columns)
            if kind == "bool":
                code, shape, odt = 0, (batch, rows, ncols), "uint8"
            elif kind == "bits":
                code, shape, odt = 1, (batch, rows, (ncols + 31) // 32), "uint32"
            elif kind == "additive":
                if dtype not in _ADDITIVE:
                    raise checks.invalid(f"dtype must be 'float32', 'float16' or 'bfloat16' (a name, or a numpy or "
                                     f"torch dtype) for additive masks, got {dtype!r}")
                code, shape, odt = _ADDITIVE[dtype], (batch, rows, ncols), dtype
            else:
                raise checks.invalid(f"kind must be 'bool', 'bits', 'additive' or 'flashinfer', got {kind!r}")
            indptr = None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dev._ITEMSIZE[odt]
            if out is None:
                mask = dev.empty(like, shape, odt)
            else:
                if not isinstance(out, TreeMask):
                    raise checks.type_error(f"out must be a TreeMask, got {type(out).__name__}")
                mask = out.mask
                _out_array(mask, "out.mask", ("bool", "uint8") if kind == "bool" else odt, shape, like, s)
        if out is None:
            positions = dev.empty(like, (batch, rows), "int64")
            status = dev.empty(like, (batch,), "int32")
        else:
            positions, status = out.positions, out.request_status
            _out_array(positions, "out.positions", "int64", (batch, rows), like, s)
            _out_array(status, "out.request_status", "int32", (batch,), like, s)
        lib.kdt_tree_attention_mask_cuda(
            ctypes.byref(tstruct), pv.ptr, code, ncols, dev.view(mask, "mask").ptr if nbytes else None, nbytes,
            dev.view(indptr, "indptr").ptr if indptr is not None else None, dev.view(positions, "positions").ptr,
            dev.view(status, "status").ptr, s)
        del prefix
    if kind == "bool" and dev._library(mask) == "torch" and str(mask.dtype) != "torch.bool":
        mask = mask.view(dtype=__import__("sys").modules["torch"].bool)
    if errors == "raise":
        _raise_on_status(status, "tree_attention_mask")
    return TreeMask(mask, indptr, positions, status)


def _stop_tokens(stop_tokens, like, s):
    """(object to keep, view or None, count): a device int32 [S] array is used in place, a
    host sequence is copied to the device."""
    if dev.is_device_array(stop_tokens):
        sv = _view(stop_tokens, "stop_tokens", "int32", 1, s)
        return stop_tokens, (sv if sv.shape[0] else None), sv.shape[0]
    stop_list = [int(x) for x in checks.stop_token_list(stop_tokens)]
    if not stop_list:
        return None, None, 0
    checks.int_array(stop_list, "stop_tokens")  # range-checked, never wrapped
    stops = dev.from_host(like, np.asarray(stop_list, np.int32))
    return stops, dev.view(stops, "stop_tokens"), len(stop_list)


def _acceptance(out, like, batch: int, width: int, rows: int, targets: bool, s):
    """The output arrays (accepted, length, bonus, status, targets or None): new ones, or
    out's after checking them (int32, C-contiguous, the shapes of this call, distinct)."""
    if out is None:
        return (dev.empty(like, (batch, width), "int32"), dev.empty(like, (batch,), "int32"),
                dev.empty(like, (batch,), "int32"), dev.empty(like, (batch,), "int32"),
                dev.empty(like, (batch, rows), "int32") if targets else None)
    if not isinstance(out, Acceptance):
        raise checks.type_error(f"out must be an Acceptance (from an earlier verify call), got {type(out).__name__}")
    fields = [("accepted_nodes", (batch, width)), ("accept_length", (batch,)), ("bonus_token", (batch,)),
              ("request_status", (batch,))]
    if targets and out.target_tokens is not None:
        fields.append(("target_tokens", (batch, rows)))
    views = []
    for name, shape in fields:
        a = getattr(out, name)
        if not dev.is_device_array(a):
            raise checks.type_error(f"out.{name} must be a CUDA array (the outputs of an earlier GPU call), got "
                                    f"{type(a).__name__}")
        v = _out_array(a, f"out.{name}", "int32", shape, like, s)
        views.append((v.ptr, v.ptr + 4 * v.size, name))
    views.sort(key=lambda t: t[0])
    for (_, hi, first), (lo, _, second) in zip(views, views[1:], strict=False):
        if lo < hi:
            raise checks.invalid(f"out.{first} and out.{second} share memory; every output needs its own array")
    return (out.accepted_nodes, out.accept_length, out.bonus_token, out.request_status,
            out.target_tokens if targets else None)


def _stop_sequences(stop_sequences, stop_history, like, batch: int, s):
    """(struct or None, device arrays to keep alive) for kdt_stop_sequences: host lists are
    checked (checks.stop_sequences) and copied to the device."""
    from .types import StopSequences

    if isinstance(stop_sequences, StopSequences) and dev.is_device_array(stop_sequences.tokens):
        # prepared on the device (kdtree.stop_sequences(..., like=)): used in place, and a
        # device history too, so that nothing is copied (capturable)
        if stop_history is None or dev.is_device_array(stop_history):
            return _device_stop_sequences(stop_sequences, stop_history, like, batch, s)
    if stop_sequences is not None:
        dev.require_not_capturing(like, "stop_sequences are host values and would be copied to the device "
                                        "(prepare them once with kdtree.stop_sequences(sequences, like=...) and "
                                        "pass a device stop_history)")
    device_history = stop_history is not None and dev.is_device_array(stop_history)
    seq = checks.stop_sequences(stop_sequences, None if device_history else stop_history, batch)
    if seq is None:
        if device_history:
            raise checks.invalid("stop_history is given without stop_sequences")
        return None, ()
    tokens, offsets, hist = seq
    if device_history:  # host sequences with a device history: the sequences copied, the history in place
        packed = StopSequences((), dev.from_host(like, tokens), dev.from_host(like, offsets))
        return _device_stop_sequences(packed, stop_history, like, batch, s)
    arrays = [dev.from_host(like, tokens), dev.from_host(like, offsets)]
    h_ptr, h_len = None, 0
    if hist is not None and hist.shape[1] > 0:
        arrays.append(dev.from_host(like, hist))
        h_ptr, h_len = dev.view(arrays[2], "stop_history").ptr, hist.shape[1]
    struct = _lib.KdtStopSequences(dev.view(arrays[0], "stop_sequences").ptr, dev.view(arrays[1], "offsets").ptr,
                                   offsets.size - 1, h_ptr, h_len)
    return struct, arrays


def _device_stop_sequences(prepared, stop_history, like, batch: int, s):
    """(struct, arrays) for stop sequences prepared on the device and a device int32
    ``[B, H]`` history (or None), without a copy."""
    tv = _view(prepared.tokens, "stop_sequences.tokens", "int32", 1, s)
    ov = _view(prepared.offsets, "stop_sequences.offsets", "int64", 1, s)
    views = [tv, ov]
    h_ptr, h_len = None, 0
    if stop_history is not None:
        hv = _view(stop_history, "stop_history", "int32", 2, s)
        if hv.shape[0] != batch:
            raise checks.shape_error(f"stop_history must have shape ({batch}, H) (each request's last committed "
                                     f"tokens), got {hv.shape}")
        views.append(hv)
        if hv.shape[1] > 0:
            h_ptr, h_len = hv.ptr, hv.shape[1]
    _same_device([dev.view(like, "trees", s)] + views)
    struct = _lib.KdtStopSequences(tv.ptr, ov.ptr, ov.shape[0] - 1, h_ptr, h_len)
    return struct, (prepared.tokens, prepared.offsets, stop_history)


def _verify_common(trees, stop_tokens, max_commit, s, out, targets, stop_sequences=None, stop_history=None):
    like = trees.num_nodes
    batch = trees.batch
    tstruct, views = _trees_struct(trees, s)
    stops, sv, nstop = _stop_tokens(stop_tokens, like, s)
    seq_struct, seq_arrays = _stop_sequences(stop_sequences, stop_history, like, batch, s)
    caps, cv = (None, None)
    if max_commit is not None:
        if dev.is_device_array(max_commit):
            caps, cv = _optional(max_commit, "max_commit", "int64", (batch,), like, s)
        else:
            host = checks.commit_caps(max_commit, batch)
            caps, cv = _optional(host, "max_commit", "int64", (batch,), like, s)
    _same_device(views + [v for v in (sv, cv) if v is not None])
    width = checks.path_capacity(trees)
    outs = _acceptance(out, like, batch, width, trees.budget + 1, targets, s)
    keep = (stops, caps, seq_struct, seq_arrays)
    ptrs = (sv.ptr if sv else None, nstop, None if seq_struct is None else ctypes.byref(seq_struct),
            cv.ptr if cv else None, width,
            dev.view(outs[0], "a").ptr, dev.view(outs[1], "l").ptr, dev.view(outs[2], "b").ptr)
    return tstruct, views, ptrs, outs, keep


def _result(out, outs) -> Acceptance:
    if out is not None:
        return out
    return Acceptance(*outs[:3], request_status=outs[3], target_tokens=outs[4])


def verify_greedy(trees: TreeBatch, target_tokens, *, stop_tokens, max_commit, errors, stream, out=None,
                  stop_sequences=None, stop_history=None) -> Acceptance:
    checks.check_errors(errors)
    like = trees.num_nodes
    s = dev.current_stream(like, stream)
    lib = _lib.load()
    with dev.on_device(like):
        tstruct, views, ptrs, outs, keep = _verify_common(trees, stop_tokens, max_commit, s, out, False,
                                                          stop_sequences, stop_history)
        target, tv = _optional(target_tokens, "target_tokens", "int32", (trees.batch, trees.budget + 1), like, s)
        _same_device([*views, tv])
        lib.kdt_verify_greedy_cuda(ctypes.byref(tstruct), tv.ptr, *ptrs, dev.view(outs[3], "s").ptr, s)
        del keep, target
    if errors == "raise":
        _raise_on_status(outs[3], "verify_greedy")
    return _result(out, outs)


def verify_from_logits(trees: TreeBatch, target_logits, *, temperature, seed, offset, stop_tokens, max_commit,
                       errors, stream, out=None, stop_sequences=None, stop_history=None) -> Acceptance:
    checks.check_errors(errors)
    like = trees.num_nodes
    s = dev.current_stream(like, stream)
    v = dev.view(target_logits, "target_logits", s)
    struct = _logits_struct(v, "target_logits")
    lib = _lib.load()
    with dev.on_device(like):
        tstruct, views, ptrs, outs, keep = _verify_common(trees, stop_tokens, max_commit, s, out, True,
                                                          stop_sequences, stop_history)
        _same_device([*views, v])
        tail = (dev.view(outs[4], "t").ptr if outs[4] is not None else None, dev.view(outs[3], "s").ptr, s)
        if temperature is None:
            lib.kdt_verify_greedy_from_logits_cuda(ctypes.byref(tstruct), ctypes.byref(struct), *ptrs, *tail)
            what = "verify_greedy_from_logits"
        else:
            lib.kdt_verify_sample_from_logits_cuda(ctypes.byref(tstruct), ctypes.byref(struct), temperature, seed,
                                                   offset, *ptrs, *tail)
            what = "verify_sample_from_logits"
        del keep
    if errors == "raise":
        _raise_on_status(outs[3], what)
    return _result(out, outs)


# The device dtypes of the per-request settings of kdt_verify_sample_batch_cuda (seeds and
# offsets: int64 arrays are read as their uint64 bits) and the host arrays' conversions.
_SETTING_DTYPES = {"temperature": ("float32",), "top_p": ("float32",), "top_k": ("int32",),
                   "seed": ("uint64", "int64"), "offset": ("uint64", "int64")}


def _stage_settings(settings: dict, like, batch: int, s):
    """(staged (array, view) pairs to keep alive, name -> device pointer or None) of
    per-request settings: device arrays used in place, host arrays converted to their
    device dtype (``_SETTING_DTYPES``) and copied to ``like``'s device; each must be [B]."""
    staged, ptr_of = [], {}
    for name, value in settings.items():
        if value is None:
            ptr_of[name] = None
            continue
        if not dev.is_device_array(value):
            if name == "top_k":
                value = checks.int_array(value, "top_k")
            elif name in ("seed", "offset"):
                value = np.ascontiguousarray(value, np.uint64).view(np.int64)
            else:
                value = np.ascontiguousarray(value, np.float32)
            value = dev.from_host(like, np.ascontiguousarray(value))
        sv = _view(value, name, _SETTING_DTYPES[name], 1, s)
        if sv.shape != (batch,):
            raise checks.shape_error(f"{name} must have shape ({batch},) (one value a request), got {sv.shape}")
        staged.append((value, sv))
        ptr_of[name] = sv.ptr
    return staged, ptr_of


def verify_sample_batch(trees: TreeBatch, target_logits, settings: dict, *, stop_tokens, max_commit, errors, stream,
                        out=None, stop_sequences=None, stop_history=None) -> Acceptance:
    """kdt_verify_sample_batch_cuda; settings: name -> device array, host [B] array (copied
    to the device here), or None (top_p, top_k: no cut)."""
    checks.check_errors(errors)
    like = trees.num_nodes
    s = dev.current_stream(like, stream)
    v = dev.view(target_logits, "target_logits", s)
    struct = _logits_struct(v, "target_logits")
    batch = trees.batch
    lib = _lib.load()
    with dev.on_device(like):
        tstruct, views, ptrs, outs, keep = _verify_common(trees, stop_tokens, max_commit, s, out, True,
                                                          stop_sequences, stop_history)
        staged, ptr_of = _stage_settings(settings, like, batch, s)
        _same_device([*views, v] + [sv for _, sv in staged])
        sampling = _lib.KdtSampling(ptr_of["temperature"], ptr_of["top_p"], ptr_of["top_k"], ptr_of["seed"],
                                    ptr_of["offset"])
        tail = (dev.view(outs[4], "t").ptr if outs[4] is not None else None, dev.view(outs[3], "s").ptr, s)
        lib.kdt_verify_sample_batch_cuda(ctypes.byref(tstruct), ctypes.byref(struct), ctypes.byref(sampling), *ptrs,
                                         *tail)
        del keep, staged  # the allocator keeps the memory until the stream is done with it
    if errors == "raise":
        _raise_on_status(outs[3], "verify_sample_from_logits")
    return _result(out, outs)


def choices_shard(logits, vocab_offset: int, settings: dict, *, nodes=None, stream=None):
    """kdt_choices_shard_cuda: float64 ``[B, R, 4]`` (best value, its global id, bad flag,
    any-score flag) of each row of a rank's vocabulary slice ``logits`` ``[B, R, V_rank]``.
    settings: "temperature", "seed", "offset" -> device arrays ``[B]`` (float32, uint64 or
    int64 bits) or host arrays (copied to the device here). nodes: None or device int32
    ``[B, R]``. Raises KdtreeError for the library's host-side checks."""
    like = logits
    s = dev.current_stream(like, stream)
    v = dev.view(logits, "logits", s)
    if len(v.shape) != 3:
        raise checks.shape_error(f"logits must be [B, R, V_rank], got shape {v.shape}")
    struct = _logits_struct(v, "logits")
    batch, rows = v.shape[0], v.shape[1]
    vocab_offset = checks.int_scalar(vocab_offset, "vocab_offset", 0, 2**31 - 1)
    lib = _lib.load()
    with dev.on_device(like):
        staged, ptr_of = _stage_settings({name: settings[name] for name in ("temperature", "seed", "offset")},
                                         like, batch, s)
        nv = None
        if nodes is not None:
            nv = _view(nodes, "nodes", "int32", 2, s)
            if nv.shape != (batch, rows):
                raise checks.shape_error(f"nodes must have shape ({batch}, {rows}), got {nv.shape}")
        _same_device([v] + [sv for _, sv in staged] + ([nv] if nv is not None else []))
        out = dev.empty(like, (batch, rows, 4), "float64")
        sampling = _lib.KdtSampling(ptr_of["temperature"], None, None, ptr_of["seed"], ptr_of["offset"])
        lib.kdt_choices_shard_cuda(ctypes.byref(struct), vocab_offset, ctypes.byref(sampling),
                                   nv.ptr if nv is not None else None, dev.view(out, "out").ptr, s)
        del staged
    return out


# Device tables of KV layers' base pointers, made once per set of layers and kept for the
# life of the process: a CUDA graph that captured a compaction reads its table at every
# replay, so none is freed (a few bytes a layer each).
_POINTER_TABLES: dict[tuple, object] = {}


def _pointer_table(like, views: list[dev.DeviceArray]):
    """A device array of the layers' base pointers (cached per set of tensors)."""
    key = (tuple(v.ptr for v in views), views[0].device)
    table = _POINTER_TABLES.get(key)
    if table is None:
        if dev.capturing(like):
            raise checks.invalid("compact_kv builds a device table of the layers' pointers on first use, which "
                                 "cannot happen inside CUDA graph capture; call compact_kv once on these tensors "
                                 "(a warm-up) before capturing")
        table = dev.from_host(like, np.asarray([v.ptr for v in views], np.uint64).view(np.int64))
        _POINTER_TABLES[key] = table
    return table


def compact_kv(k_layers, v_layers, prefix_lengths, acceptance: Acceptance, *, layout: str, errors, stream,
               out=None, block_table=None):
    checks.check_errors(errors)
    k_layers = list(k_layers)
    v_layers = None if v_layers is None else list(v_layers)
    if not k_layers:
        raise checks.invalid("k_layers is empty")
    if v_layers is not None and len(v_layers) != len(k_layers):
        raise checks.invalid(f"{len(k_layers)} K layers but {len(v_layers)} V layers")
    like = k_layers[0]
    s = dev.current_stream(like, stream)
    kv = [_view(t, f"k_layers[{i}]", _KV_DTYPES, 4, s, contiguous=False) for i, t in enumerate(k_layers)]
    vv = [] if v_layers is None else [
        _view(t, f"v_layers[{i}]", _KV_DTYPES, 4, s, contiguous=False) for i, t in enumerate(v_layers)]
    first = kv[0]
    if any(t.readonly for t in kv + vv):
        raise checks.invalid("the KV cache tensors are read-only (__cuda_array_interface__); compaction writes them")
    ptrs = [t.ptr for t in kv + vv]
    if len(set(ptrs)) != len(ptrs):
        raise checks.invalid("k_layers and v_layers must be distinct tensors (a tensor shared by two layers, or "
                         "by K and V, would be moved twice)")
    for i, t in enumerate(kv + vv):
        if t.shape != first.shape or t.strides != first.strides or t.dtype != first.dtype:
            raise checks.shape_error(f"every K and V layer must share shape, strides and dtype; layer tensor {i} has "
                             f"{t.shape} {t.strides} {t.dtype}, the first {first.shape} {first.strides} {first.dtype}")
    paged = layout in ("pshd", "phsd")
    if paged != (block_table is not None) and layout in ("bhsd", "bshd", "pshd", "phsd"):
        raise checks.invalid(f"layout {layout!r} {'needs' if paged else 'takes no'} block_table")
    if layout == "bhsd":
        (batch, heads, seq, dim), (bs, hs, ss, ds) = first.shape, first.strides
    elif layout == "bshd":
        (batch, seq, heads, dim), (bs, ss, hs, ds) = first.shape, first.strides
    elif layout == "pshd":
        (batch, seq, heads, dim), (bs, ss, hs, ds) = first.shape, first.strides  # (pages, page_size, ...)
    elif layout == "phsd":
        (batch, heads, seq, dim), (bs, hs, ss, ds) = first.shape, first.strides  # (pages, ..., page_size, ...)
    else:
        raise checks.invalid(f"layout must be 'bhsd', 'bshd', 'pshd' or 'phsd', got {layout!r}")
    if dim > 1 and ds != 1:
        raise checks.invalid(f"the head_dim axis must be contiguous, got strides {first.strides}")
    if (batch > 1 and bs == 0) or (heads > 1 and hs == 0) or (seq > 1 and ss == 0):
        raise checks.invalid(f"the cache tensors must not overlap themselves (zero strides {first.strides})")
    if paged:
        pages, page_size = batch, seq
        if not 1 <= page_size <= 256:
            raise checks.invalid(f"page size {page_size} is outside [1, 256]")
    lib = _lib.load()
    with dev.on_device(like):
        ktab = _pointer_table(like, kv)
        vtab = _pointer_table(like, vv) if vv else None
        bt = None
        if paged:
            bt = _view(block_table, "block_table", "int32", 2, s, contiguous=False)
            if bt.shape[1] < 1 or (bt.shape[1] > 1 and bt.strides[1] != 1):
                raise checks.invalid(f"block_table must be [B, pages a request >= 1] with unit column stride, got "
                                     f"{bt.shape} strides {bt.strides}")
            batch = bt.shape[0]
        prefix, pv = _optional(prefix_lengths, "prefix_lengths", "int64", (batch,), like, s)
        acc = _view(acceptance.accepted_nodes, "accepted_nodes", "int32", 2, s)
        alen = _view(acceptance.accept_length, "accept_length", "int32", 1, s)
        if acc.shape[0] != batch or alen.shape[0] != batch:
            raise checks.shape_error(f"acceptance holds {acc.shape[0]} requests, the "
                                     f"{'block_table' if paged else 'cache'} {batch}")
        _same_device([*kv, *vv, pv, acc, alen] + ([bt] if bt is not None else []))
        vptr = dev.view(vtab, "v").ptr if vtab is not None else None
        if paged:
            bt_stride = bt.strides[0] if batch > 1 else bt.shape[1]
            if bt_stride < bt.shape[1]:
                raise checks.invalid(f"block_table: row stride {bt_stride} < {bt.shape[1]} pages a request")
            pcache = _lib.KdtPagedKvCache(dev.view(ktab, "k").ptr, vptr, len(kv), _KV_CODES[first.dtype], 0, batch,
                                          heads, dim, pages, page_size, bs, hs, ss, bt.ptr, bt_stride)
        else:
            cache = _lib.KdtKvCache(dev.view(ktab, "k").ptr, vptr, len(kv), _KV_CODES[first.dtype], 0, batch, heads,
                                    seq, dim, bs, hs, ss)
        if out is None:
            status = dev.empty(like, (batch,), "int32")
        else:
            status = out
            _out_array(status, "out", "int32", (batch,), like, s)
        if paged:
            lib.kdt_compact_kv_paged_cuda(ctypes.byref(pcache), pv.ptr, acc.ptr, alen.ptr, acc.shape[1],
                                          dev.view(status, "s").ptr, s)
        else:
            lib.kdt_compact_kv_cuda(ctypes.byref(cache), pv.ptr, acc.ptr, alen.ptr, acc.shape[1],
                                    dev.view(status, "s").ptr, s)
        del prefix
    if errors == "raise":
        _raise_on_status(status, "compact_kv")
    return status


_ATTN_LAYOUTS = {"bhsd": False, "bshd": False, "pshd": True, "phsd": True}


def _attention_rows_struct(v: dev.DeviceArray, name: str) -> _lib.KdtAttentionRows:
    """kdt_attention_rows of a [B, R, H, D] view (head_dim contiguous; the stride of an axis
    of extent 1 is never stepped along and is passed as 0)."""
    b, r, h, d = v.shape
    if d > 1 and v.strides[3] != 1:
        raise checks.invalid(f"{name}: head_dim must be contiguous, got strides {v.strides}")
    st = [s if n > 1 else 0 for s, n in zip(v.strides[:3], (b, r, h), strict=True)]
    if any(s < 0 or s % 8 for s in st):
        raise checks.invalid(f"{name}: strides {v.strides} must be non-negative multiples of 8 elements")
    return _lib.KdtAttentionRows(v.ptr, *st)


MLA_DK, MLA_DV = 576, 512  # kdt_tree_attention_mla_cuda: latent + rotary values a token, latent values


def tree_attention(q, k_cache, v_cache, trees: TreeBatch, prefix_lengths, *, layout, block_table, max_prefix,
                   softmax_scale, return_lse, errors, stream, out, lse, workspace, mla=False):
    checks.check_errors(errors)
    if layout is None:
        layout = "pshd" if block_table is not None else "bhsd"
    if layout not in _ATTN_LAYOUTS:
        raise checks.invalid(f"layout must be one of {sorted(_ATTN_LAYOUTS)}, got {layout!r}")
    paged = _ATTN_LAYOUTS[layout]
    if paged != (block_table is not None):
        raise checks.invalid(f"layout {layout!r} is {'paged' if paged else 'contiguous'}: "
                             f"{'pass block_table' if paged else 'block_table must be None'} "
                             "('bhsd'/'bshd' contiguous, 'pshd'/'phsd' paged)")
    s = dev.current_stream(q, stream)
    qv = _view(q, "q", ("float16", "bfloat16"), 4, s, contiguous=False)
    kv = _view(k_cache, "k_cache", ("float16", "bfloat16"), 4, s, contiguous=False)
    vv = _view(v_cache, "v_cache", ("float16", "bfloat16"), 4, s, contiguous=False)
    if kv.dtype != qv.dtype or vv.dtype != qv.dtype:
        raise checks.type_error(f"q, k_cache and v_cache must share a dtype, got {qv.dtype}, {kv.dtype}, {vv.dtype}")
    if kv.shape != vv.shape or kv.strides != vv.strides:
        raise checks.shape_error(f"k_cache and v_cache must share shape and strides, got {kv.shape} {kv.strides} "
                                 f"and {vv.shape} {vv.strides}")
    batch, rows, q_heads, dim = qv.shape
    if batch != trees.batch or rows != trees.budget + 1:
        raise checks.shape_error(f"q must be [B, N + 1, q_heads, head_dim] = [{trees.batch}, {trees.budget + 1}, ...] "
                                 f"for these trees, got {qv.shape}")
    if layout == "bhsd":
        (cb, heads, seq, cd), (os_, hs, ts, ds) = kv.shape, kv.strides
    elif layout == "bshd":
        (cb, seq, heads, cd), (os_, ts, hs, ds) = kv.shape, kv.strides
    elif layout == "pshd":
        (cb, seq, heads, cd), (os_, ts, hs, ds) = kv.shape, kv.strides
    else:
        (cb, heads, seq, cd), (os_, hs, ts, ds) = kv.shape, kv.strides
    if cd != dim:
        raise checks.shape_error(f"k_cache head_dim {cd} != q head_dim {dim}")
    if mla and dim != MLA_DK:
        raise checks.shape_error(f"MLA: q and the latent cache must have {MLA_DK} values a head and token (512 latent + "
                                 f"64 rotary), got {dim}")
    out_dim = MLA_DV if mla else dim
    if cd > 1 and ds != 1:
        raise checks.invalid(f"k_cache: head_dim must be contiguous, got strides {kv.strides}")
    if not paged and cb != batch:
        raise checks.shape_error(f"k_cache holds {cb} requests, q {batch}")
    if heads < 1 or q_heads % heads:
        raise checks.shape_error(f"q_heads ({q_heads}) must be a multiple of the cache's KV heads ({heads})")
    if paged:
        bt = _view(block_table, "block_table", "int32", 2, s, contiguous=False)
        if bt.shape[0] != batch or (bt.shape[1] > 1 and bt.strides[1] != 1):
            raise checks.shape_error(f"block_table must be int32 [B = {batch}, pages] with contiguous rows, got shape "
                                     f"{bt.shape} strides {bt.strides}")
        bt_stride = bt.strides[0] if batch > 1 else bt.shape[1]
        if bt_stride < bt.shape[1]:
            raise checks.invalid(f"block_table: row stride {bt_stride} < {bt.shape[1]} pages a request")
        page_size, capacity, bt_ptr = seq, cb, bt.ptr
        keys_max = bt.shape[1] * seq
    else:
        bt, bt_stride, page_size, capacity, bt_ptr = None, 0, 0, seq, None
        keys_max = seq
    if max_prefix is None:
        max_prefix = max(keys_max - rows, 0)
    max_prefix = checks.int_scalar(max_prefix, "max_prefix", 0, (1 << 31) - (1 << 19))
    if softmax_scale is None:
        softmax_scale = 1.0 / float(dim) ** 0.5
    lib = _lib.load()
    with dev.on_device(q):
        tstruct, tviews = _trees_struct(trees, s)
        if trees.visibility_bits is None:
            raise checks.invalid("trees.visibility_bits is required")
        prefix, pv = _optional(prefix_lengths, "prefix_lengths", "int64", (batch,), q, s)
        _same_device([qv, kv, vv, pv, *tviews] + ([bt] if bt is not None else []))
        nbytes = ctypes.c_size_t()
        if mla:
            lib.kdt_tree_attention_mla_cuda_workspace_bytes(batch, trees.budget, q_heads, max_prefix,
                                                            ctypes.byref(nbytes))
        else:
            lib.kdt_tree_attention_cuda_workspace_bytes(batch, trees.budget, q_heads, heads, dim, max_prefix,
                                                        ctypes.byref(nbytes))
        if out is None:
            out = dev.empty(q, (batch, rows, q_heads, out_dim), qv.dtype)
        ov = _view(out, "out", qv.dtype, 4, s, contiguous=False)
        if ov.shape != (batch, rows, q_heads, out_dim):
            raise checks.shape_error(f"out must have shape {(batch, rows, q_heads, out_dim)}, got {ov.shape}")
        if return_lse or lse is not None:
            if lse is None:
                lse = dev.empty(q, (batch, rows, q_heads), "float32")
            lv = _out_array(lse, "lse", "float32", (batch, rows, q_heads), q, s)
            lse_ptr = lv.ptr
        else:
            lse_ptr = None
        status = dev.empty(q, (batch,), "int32")
        ws = None
        ws_ptr, ws_bytes = None, 0
        if nbytes.value:
            if workspace is not None:
                wv = _view(workspace, "workspace", "uint8", 1, s)
                if wv.shape[0] < nbytes.value:
                    raise checks.invalid(f"workspace holds {wv.shape[0]} bytes, {nbytes.value} needed")
                ws_ptr, ws_bytes = wv.ptr, wv.shape[0]
            else:
                ws, ws_ptr, ws_bytes = _workspace(q, nbytes.value)
        cache = _lib.KdtAttentionCache(kv.ptr, vv.ptr, heads, os_ if (paged or cb > 1) else 0,
                                       hs if heads > 1 else 0, ts if seq > 1 else 0, capacity, bt_ptr, bt_stride,
                                       page_size)
        qs, os2 = _attention_rows_struct(qv, "q"), _attention_rows_struct(ov, "out")
        if mla:
            lib.kdt_tree_attention_mla_cuda(ctypes.byref(tstruct), pv.ptr, max_prefix, ctypes.byref(qs),
                                            ctypes.byref(cache), _DTYPE_CODES[qv.dtype], q_heads,
                                            float(softmax_scale), ctypes.byref(os2), lse_ptr,
                                            dev.view(status, "s").ptr, ws_ptr, ws_bytes, s)
        else:
            lib.kdt_tree_attention_cuda(ctypes.byref(tstruct), pv.ptr, max_prefix, ctypes.byref(qs),
                                        ctypes.byref(cache), _DTYPE_CODES[qv.dtype], q_heads, dim,
                                        float(softmax_scale), ctypes.byref(os2), lse_ptr, dev.view(status, "s").ptr,
                                        ws_ptr, ws_bytes, s)
        del prefix, ws
    if errors == "raise":
        _raise_on_status(status, "tree_attention")
    return out, (lse if (return_lse or lse is not None) else None), status


def ragged_trees(trees: TreeBatch, *, capacity, errors, stream) -> RaggedTrees:
    checks.check_errors(errors)
    like = trees.num_nodes
    s = dev.current_stream(like, stream)
    batch, rows = trees.batch, trees.budget + 1
    words = (rows + 31) // 32
    cap = batch * rows if capacity is None else checks.int_scalar(capacity, "capacity", 0, checks.INT32_MAX)
    lib = _lib.load()
    with dev.on_device(like):
        tstruct, views = _trees_struct(trees, s)
        out = RaggedTrees(dev.empty(like, (batch + 1,), "int32"),
                          *(dev.empty(like, (cap,), d) for d in list(RAGGED_FIELDS.values())[:-1]),
                          dev.empty(like, (cap, words), "uint32"), budget=trees.budget)
        status = dev.empty(like, (max(batch, 1),), "int32")[:batch]
        ptrs = [dev.view(getattr(out, f), f).ptr for f in RAGGED_FIELDS]
        struct = _lib.KdtTreesRagged(cap, dev.view(out.cu_rows, "cu_rows").ptr, *ptrs)
        lib.kdt_trees_ragged_cuda(ctypes.byref(tstruct), ctypes.byref(struct), dev.view(status, "status").ptr, s)
    out.request_status = status
    if errors == "raise":
        _raise_on_status(status, "ragged_trees")
    return out


def topk_merge(shard_logits, shard_ids, shard_max, shard_sum_rest, vocab: int, *, errors, stream) -> TopK:
    checks.check_errors(errors)
    s = dev.current_stream(shard_logits, stream)
    lg = _view(shard_logits, "shard_logits", "float32", None, s)
    if len(lg.shape) < 2:
        raise checks.shape_error(f"shard_logits must be [T, ..., k], got shape {lg.shape}")
    shards, lead, k = lg.shape[0], lg.shape[1:-1], lg.shape[-1]
    ids = _view(shard_ids, "shard_ids", "int32", None, s)
    mx = _view(shard_max, "shard_max", "float32", None, s)
    se = _view(shard_sum_rest, "shard_sum_rest", "float64", None, s)
    for name, v, want in (("shard_ids", ids, lg.shape), ("shard_max", mx, lg.shape[:-1]),
                          ("shard_sum_rest", se, lg.shape[:-1])):
        if v.shape != want:
            raise checks.shape_error(f"{name} has shape {v.shape}, expected {want} (shard_logits is {lg.shape})")
    _same_device([lg, ids, mx, se])
    vocab = checks.int_scalar(vocab, "vocab", max(1, k), 2**31)
    checks.int_scalar(shards, "shards (the leading axis of shard_logits)", 1, 1024)
    if k > 1024:
        raise checks.range_error(f"k must be at most 1024 on the GPU, got {k}")
    rows = int(np.prod(lead, dtype=np.int64))
    with dev.on_device(shard_logits):
        out_lp = dev.empty(shard_logits, lead + (k,), "float32")
        out_ids = dev.empty(shard_logits, lead + (k,), "int32")
        status = dev.empty(shard_logits, lead if lead else (1,), "int32")
        if rows > 0:
            _lib.load().kdt_topk_merge_cuda(lg.ptr, ids.ptr, mx.ptr, se.ptr, shards, rows, k, vocab,
                                            dev.view(out_lp, "out").ptr if k else None,
                                            dev.view(out_ids, "out").ptr if k else None,
                                            dev.view(status, "status").ptr, s)
    if errors == "raise" and rows > 0:
        _raise_on_status(status, "topk_merge", unit="row")
    return TopK(out_lp, out_ids, status)


def topk_shard_stats(logits, *, stream=None):
    """A vocabulary shard's row statistics on the GPU (``kdt_topk_shard_stats_cuda``):
    ``(max float32 [...], rest float64 [...])`` over the last axis of ``logits`` (a CUDA
    array ``[..., V]``, float32 / float16 / bfloat16, the last axis contiguous), as
    :func:`kdtree.topk_shard`'s ``max`` and ``sum_rest`` (rest within float64 rounding);
    a row holding a NaN or a +inf gets NaN in both, a row of only -inf max -inf and rest 0.
    Stream-ordered, no synchronisation.

    Raises:
        KdtreeTypeError: another dtype. KdtreeError: no axis, a non-contiguous last axis,
            leading axes whose strides do not merge into rows.
    """
    s = dev.current_stream(logits, stream)
    v = dev.view(logits, "logits", s)
    if len(v.shape) < 1:
        raise checks.shape_error("logits must have at least one dimension [..., V]")
    lead = v.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    struct = _logits_rows_struct(v)
    with dev.on_device(logits):
        mx = dev.empty(logits, lead, "float32")
        rest = dev.empty(logits, lead, "float64")
        if rows > 0:
            _lib.load().kdt_topk_shard_stats_cuda(ctypes.byref(struct), dev.view(mx, "out").ptr,
                                                  dev.view(rest, "out").ptr, s)
    return mx, rest
