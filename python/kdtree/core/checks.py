"""Argument checks shared by the host and CUDA paths of the core API: integer scalars,
host arrays converted for C (C-contiguous, the C dtype, range-checked), per-request
arrays, stop tokens and commit caps. Every failure names the argument and where."""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from .._native import STATUS, KdtreeError, KdtreeMemoryError, KdtreeTypeError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


MAX_BUDGET = 2**31 - 3  # node indices are int32 (include/kdtree.h)


def int_scalar(value, name: str, lo: int, hi: int) -> int:
    """An integer argument (Python or numpy int, not bool or float) within [lo, hi]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise type_error(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise range_error(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def ptr(a: np.ndarray | None) -> int | None:
    """The address of `a`'s data, read from a base-class view: an ndarray subclass that
    overrides ``__array_interface__`` or ``ctypes`` cannot hand C another address."""
    return None if a is None else np.ndarray.view(a, np.ndarray).__array_interface__["data"][0]


def host_array(x, name: str) -> np.ndarray:
    """np.asarray(x), with a clear TypeError where the producer cannot export its data to
    numpy (e.g. a bfloat16 torch CPU tensor)."""
    try:
        return np.asarray(x)
    except ValueError as exc:  # ragged nested lists
        raise shape_error(f"{name} is not a rectangular array ({exc})") from None
    except (TypeError, RuntimeError) as exc:
        dtype = getattr(x, "dtype", None)
        if getattr(x, "is_meta", False):
            hint = "a meta tensor holds no data: pass one with values"
        elif getattr(x, "requires_grad", False):
            hint = "detach it first (tensor.detach())"
        else:
            hint = "convert it first (e.g. tensor.float())"
        raise type_error(f"{name}: a host {type(x).__name__} of dtype {dtype} cannot be read as a numpy array "
                        f"({exc}); {hint}, or pass a GPU array") from None


def float_array(x, name: str) -> np.ndarray:
    """C-contiguous float32 copy/view of a real floating array (float16, bfloat16, float32,
    float64); other kinds are rejected."""
    a = host_array(x, name)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise type_error(f"{name} must be a floating array, got dtype {a.dtype}")
    with np.errstate(over="ignore"):  # overflow is reported just below
        out = np.ascontiguousarray(a, dtype=np.float32).reshape(a.shape)
    if a.dtype.itemsize > 4:
        overflow = np.isfinite(a) & ~np.isfinite(out)
        if overflow.any():
            where = tuple(int(i) for i in np.argwhere(overflow)[0])
            raise value_error(f"{name}{list(where)} = {a[where]!r} is finite but outside float32 range")
    return out


def int_array(x, name: str, dtype=np.int32) -> np.ndarray:
    """C-contiguous int32/int64 array of an integer input, range-checked (never wrapped)."""
    a = host_array(x, name)
    if a.size == 0 and isinstance(x, (list, tuple)):
        a = a.astype(dtype)  # [] is float64 to numpy: an empty list is an empty integer array
    if a.dtype.kind not in "iu":
        raise type_error(f"{name} must be an integer array, got dtype {a.dtype}")
    if dtype == np.int32 and a.size and a.dtype.itemsize >= 4 and a.dtype != np.int32:
        lo, hi = int(a.min()), int(a.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            raise range_error(f"{name} has values outside int32 ({lo}..{hi})")
    if dtype == np.int64 and a.dtype == np.uint64 and a.size and int(a.max()) > 2**63 - 1:
        raise range_error(f"{name} has values outside int64")
    return np.ascontiguousarray(a, dtype=dtype)


def per_request(values, name: str, batch: int, dtype=np.int32, batch_from: str = "") -> np.ndarray:
    """[B] integers (a scalar when B = 1), or ValueError naming the expected shape (and
    where B came from, when batch_from says it)."""
    a = int_array(values, name, dtype)
    if a.ndim > 1 or a.size != batch:
        origin = f" (one per request; B = {batch} from {batch_from})" if batch_from else ""
        raise shape_error(f"{name} must have shape ({batch},){origin}, got {np.shape(values)}")
    return a.reshape(-1)


def prefix_lengths(prefix_lengths, batch: int) -> np.ndarray:
    """prefix_lengths as int64 [B] (an int is used for every request)."""
    a = host_array(prefix_lengths, "prefix_lengths")
    if a.size == 0 and batch == 0:
        return np.zeros(0, np.int64)
    if a.ndim == 0:
        a = np.full(batch, a)
    if a.shape != (batch,):
        raise shape_error(f"prefix_lengths must be an int or have shape ({batch},), got shape {a.shape}")
    return int_array(a, "prefix_lengths", np.int64)


def dtype_name(dtype):
    """A dtype given as a name, a numpy / ml_dtypes dtype or scalar type, or a torch dtype,
    as its name ("float16"); anything else is returned as given, for the caller to reject.
    (Names are cached by dtype: numpy's own naming costs microseconds a call.)"""
    if isinstance(dtype, str):
        return dtype
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable object, named below)
        pass
    text = str(dtype)
    if text.startswith("torch."):
        name = text[len("torch."):]
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            return dtype
    try:
        _DTYPE_NAMES[dtype] = name
    except TypeError:
        pass
    return name


_DTYPE_NAMES: dict = {}


def stop_token_list(stop_tokens) -> list:
    """stop_tokens as a list: None (no stop tokens) or any iterable of token ids. A single
    int, a string or a 0-d array is a TypeError that names the argument (not Python's
    "'int' object is not iterable")."""
    if stop_tokens is None:
        return []
    if (isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable)
            or (isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim == 0)):
        raise type_error(f"stop_tokens must be a sequence of token ids (for example [eos_id]) or None, "
                        f"got {type(stop_tokens).__name__}")
    return list(stop_tokens)


MAX_STOP_LENGTH = 16  # KDT_MAX_STOP_LENGTH


def stop_sequences(sequences, history, batch: int):
    """Multi-token stops as (tokens int32, offsets int64, history int32 [B, H] or None), or
    None when there are none. `sequences`: an iterable of token sequences (each 1 ..
    MAX_STOP_LENGTH ids >= 0); `history`: [B, H] ints (each request's last committed
    tokens, right-aligned, -1 where fewer) or None."""
    from .types import StopSequences

    if isinstance(sequences, StopSequences):  # prepared (kdtree.stop_sequences): already checked
        sequences = sequences.sequences
    if sequences is None:
        seqs = []
    else:
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            raise type_error(f"stop_sequences must be a sequence of token sequences (for example [[13, 14]]), "
                             f"got {type(sequences).__name__}")
        seqs = []
        for i, seq in enumerate(sequences):
            if (isinstance(seq, (str, bytes, set, frozenset, dict)) or not isinstance(seq, Iterable)
                    or (isinstance(seq, np.ndarray) and seq.ndim == 0)):
                raise type_error(f"stop_sequences[{i}] must be an ordered sequence of token ids (a list, tuple or "
                                 f"1-D array), got {type(seq).__name__}")
            items = list(seq)
            if any(isinstance(t, (bool, np.bool_)) for t in items) or getattr(seq, "dtype", None) == np.bool_:
                raise type_error(f"stop_sequences[{i}] holds a bool, not a token id")
            a = int_array(items, f"stop_sequences[{i}]") if items else np.zeros(0, np.int32)
            if a.ndim != 1:
                raise type_error(f"stop_sequences[{i}] must be a flat sequence of token ids, got an array of shape "
                                 f"{a.shape} (pass each sequence as its own entry)")
            if not 1 <= a.size <= MAX_STOP_LENGTH:
                raise invalid(f"stop_sequences[{i}] has {a.size} tokens; a stop sequence has 1 to {MAX_STOP_LENGTH}")
            if (a < 0).any():
                raise invalid(f"stop_sequences[{i}] holds a negative token id {int(a.min())}")
            seqs.append(a)
    if history is not None and not seqs:
        raise invalid("stop_history is given without stop_sequences")
    if not seqs:
        return None
    tokens = np.ascontiguousarray(np.concatenate(seqs), np.int32)
    offsets = np.concatenate([[0], np.cumsum([a.size for a in seqs])]).astype(np.int64)
    hist = None
    if history is not None:
        if np.ndim(history) == 0:
            raise shape_error(f"stop_history must have shape ({batch}, H) (each request's last committed tokens), "
                              f"got a scalar {history!r}")
        hist = np.ascontiguousarray(int_array(history, "stop_history"))
        if hist.ndim == 1 and batch == 1:
            hist = hist[None]
        if hist.ndim != 2 or hist.shape[0] != batch:
            raise shape_error(f"stop_history must have shape ({batch}, H) (each request's last committed tokens), "
                              f"got {np.shape(history)}")
    return tokens, offsets, hist


def commit_caps(max_commit, batch: int) -> np.ndarray:
    """max_commit as int64 [B]: an int (the same cap for every request) or one int per
    request. Any other shape is a ValueError naming max_commit (a length-1 list is not
    broadcast to B > 1 requests); negative caps are rejected by check_caps."""
    shape = np.shape(max_commit)
    if shape not in ((), (batch,)):
        raise shape_error(f"max_commit must be None, an int, or one int per request (shape ({batch},)), "
                         f"got shape {shape}")
    caps = int_array(np.broadcast_to(np.asarray(max_commit), (batch,)), "max_commit", np.int64)
    check_caps(max_commit, caps)
    return caps


def check_caps(given, caps: np.ndarray) -> None:
    """ValueError naming the first negative commit cap (and its request, for an array)."""
    if (caps < 0).any():
        b = int(np.flatnonzero(caps < 0)[0])
        where = "" if np.ndim(given) == 0 else f" for request {b}"
        raise range_error(f"max_commit must be >= 0, got {int(caps[b])}{where}")


def real_scalar(value, name: str) -> float:
    """A real-number argument (Python or numpy int or float, not bool), as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise type_error(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def per_request_setting(value, name: str, batch: int, kind: str) -> np.ndarray:
    """A host sampling setting as a [B] array: a scalar (every request) or one value a
    request. kind "float": float32 (out-of-range values are the requests' errors, not
    the call's); "int": int64 within int32; "u64": uint64 in [0, 2^64)."""
    if np.ndim(value) == 0:
        if kind == "float":
            with np.errstate(over="ignore"):
                return np.full(batch, np.float32(real_scalar(value, name)), np.float32)
        hi = INT32_MAX if kind == "int" else 2**64 - 1
        lo = INT32_MIN if kind == "int" else 0
        return np.full(batch, int_scalar(value, name, lo, hi), np.int64 if kind == "int" else np.uint64)
    a = host_array(value, name)
    if a.shape != (batch,):
        raise shape_error(f"{name} must be a scalar or have shape ({batch},) (one value a request), got {a.shape}")
    if kind == "float":
        if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
            raise type_error(f"{name} must be a real array, got dtype {a.dtype}")
        with np.errstate(over="ignore"):
            return a.astype(np.float32)
    if a.dtype.kind not in "iu":
        raise type_error(f"{name} must be an integer array, got dtype {a.dtype}")
    if kind == "int":
        return int_array(a, name).astype(np.int64)
    if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
        raise range_error(f"{name} must be in [0, 2^64), got {int(a.min())}")
    return a.astype(np.uint64)


def cpu_only(stream, errors: str, name: str) -> None:
    if stream is not None:
        raise invalid(f"{name}: stream= applies to GPU arrays only; the inputs are host arrays")
    check_errors(errors)


def ok_status(batch_shape) -> np.ndarray:
    """A status array of KDT_OK (0) entries: what a host call that succeeded reports."""
    return np.zeros(batch_shape, np.int32)


def check_errors(errors: str) -> None:
    if errors not in ("raise", "status"):
        raise invalid(f'errors must be "raise" or "status", got {errors!r}')


def failed_request(exc: KdtreeError) -> int | None:
    """The request a C error names ("request 3, ..."), or None for an error of the call."""
    found = re.match(r"request (\d+)\b", exc.detail)
    return None if found is None else int(found.group(1))


# ---- errors: every check raises KdtreeError with a kdt_status ------------------------

def invalid(message: str) -> KdtreeError:
    """KDT_ERR_INVALID_ARGUMENT: an argument that is not one of the accepted values."""
    return KdtreeError(STATUS["KDT_ERR_INVALID_ARGUMENT"], message)


def shape_error(message: str) -> KdtreeError:
    """KDT_ERR_SHAPE: an array of the wrong shape, or shapes that disagree."""
    return KdtreeError(STATUS["KDT_ERR_SHAPE"], message)


def range_error(message: str) -> KdtreeError:
    """KDT_ERR_OUT_OF_RANGE: a count, index or size outside what is allowed."""
    return KdtreeError(STATUS["KDT_ERR_OUT_OF_RANGE"], message)


def value_error(message: str) -> KdtreeError:
    """KDT_ERR_VALUE: data that are not valid input (NaN, +inf, positive log-probs...)."""
    return KdtreeError(STATUS["KDT_ERR_VALUE"], message)


def type_error(message: str) -> KdtreeTypeError:
    """KDT_ERR_INVALID_ARGUMENT as a KdtreeTypeError (also a TypeError): a wrong type or dtype."""
    return KdtreeTypeError(message)


def memory_error(message: str) -> KdtreeMemoryError:
    """KDT_ERR_OUT_OF_MEMORY as a KdtreeMemoryError (also a MemoryError)."""
    return KdtreeMemoryError(message)


def path_capacity(trees) -> int:
    """Columns of ``Acceptance.accepted_nodes`` for `trees`: the root plus the longest path
    a tree can hold, min(depth, budget) + 1. Checks the TreeBatch's budget and depth."""
    budget = int_scalar(trees.budget, "trees.budget", 0, MAX_BUDGET)
    depth = int_scalar(trees.depth, "trees.depth", 0, 2**31 - 2)
    return min(depth, budget) + 1
