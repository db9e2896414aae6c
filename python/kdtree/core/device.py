"""GPU arrays without importing a GPU library: DLPack and ``__cuda_array_interface__``.

kdtree's GPU functions take device arrays from any library that exports them (torch,
CuPy, JAX, Numba ...). This module reads an array's device pointer, shape, strides and
dtype through DLPack (``__dlpack__`` / ``__dlpack_device__``; preferred, it also carries
bfloat16) or, failing that, ``__cuda_array_interface__`` (version 2 or 3). CUDA torch
tensors are read through their own accessors (``data_ptr``, ``stride``), the same facts
at a fraction of the host cost of a DLPack capsule. It allocates
outputs and workspaces with the library the caller's arrays come from (torch or CuPy,
found in ``sys.modules`` -- never imported here), and finds the caller's current stream
the same way, so kernels run where the caller's own work runs.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np

from . import checks

# DLPack (dlpack.h, v0.8 legacy capsule "dltensor").
_KDLCUDA, _KDLCUDA_MANAGED = 2, 13
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_BOOL = 0, 1, 2, 4, 6


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# dtype names used across kdtree's GPU functions, with their (DLPack code, bits) and
# __cuda_array_interface__ typestr.
_DTYPES = {
    "bool": ((_DL_BOOL, 8), "|b1"),
    "uint8": ((_DL_UINT, 8), "|u1"),
    "int8": ((_DL_INT, 8), "|i1"),
    "int32": ((_DL_INT, 32), "<i4"),
    "int64": ((_DL_INT, 64), "<i8"),
    "uint32": ((_DL_UINT, 32), "<u4"),
    "uint64": ((_DL_UINT, 64), "<u8"),
    "float16": ((_DL_FLOAT, 16), "<f2"),
    "bfloat16": ((_DL_BFLOAT, 16), None),
    "float32": ((_DL_FLOAT, 32), "<f4"),
    "float64": ((_DL_FLOAT, 64), "<f8"),
}
_BY_DLPACK = {code: name for name, (code, _) in _DTYPES.items()}
_BY_TYPESTR = {ts: name for name, (_, ts) in _DTYPES.items() if ts}
_BY_TYPESTR["<u1"] = _BY_TYPESTR["|u1"]
_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4, "int64": 8, "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2,
             "float32": 4, "float64": 8}


@dataclass
class DeviceArray:
    """A view of one GPU array: ``ptr`` (int), ``shape``, ``strides`` (in elements),
    ``dtype`` (a name from ``_DTYPES``), ``device`` (CUDA ordinal) and ``obj`` (the
    caller's object, kept referenced while the view is used)."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int
    obj: object
    _keep: object = None  # the DLPack capsule, alive while the pointer is used
    readonly: bool = False  # __cuda_array_interface__'s read-only flag

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def c_contiguous(self) -> bool:
        if 0 in self.shape:  # no element: any strides describe it
            return True
        expect = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if extent != 1 and stride != expect:
                return False
            expect *= extent
        return True


def _library(obj) -> str:
    """'torch', 'cupy' or '' from the module of the object's type (no import)."""
    module = type(obj).__module__.split(".")[0]
    return module if module in ("torch", "cupy") else ""


def is_device_array(obj) -> bool:
    """Whether `obj` is a CUDA array kdtree can read (DLPack CUDA device or a
    ``__cuda_array_interface__``); numpy arrays and lists are not."""
    if isinstance(obj, (np.ndarray, list, tuple, int, float)) or obj is None:
        return False
    if hasattr(obj, "__dlpack_device__"):
        try:
            kind, _ = obj.__dlpack_device__()
        except Exception:  # noqa: BLE001 - a producer that cannot say is not a GPU array
            return False
        if int(kind) in (_KDLCUDA, _KDLCUDA_MANAGED):
            return True
    return hasattr(obj, "__cuda_array_interface__")


def view(obj, name: str, stream: int | None = None) -> DeviceArray:
    """The DeviceArray of `obj`. Raises TypeError naming `name` when it is not a CUDA
    array or its dtype is not one kdtree uses."""
    if _library(obj) == "torch" and getattr(obj, "is_cuda", False):
        return _from_torch(obj, name)
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        kind, dev = obj.__dlpack_device__()
        if int(kind) in (_KDLCUDA, _KDLCUDA_MANAGED):
            return _from_dlpack(obj, name, int(dev), stream)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, name)
    raise checks.type_error(f"{name} must be a CUDA array (DLPack or __cuda_array_interface__), got {type(obj).__name__}")


_TORCH_DTYPES = {"torch.bool": "bool", "torch.uint8": "uint8", "torch.int8": "int8", "torch.float8_e4m3fn": "float8_e4m3fn",
                 "torch.float8_e5m2": "float8_e5m2", "torch.int32": "int32", "torch.int64": "int64",
                 "torch.uint32": "uint32", "torch.uint64": "uint64", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                 "torch.float32": "float32", "torch.float64": "float64"}


def _from_torch(t, name: str) -> DeviceArray:
    """A CUDA torch tensor read through its own accessors (the same facts DLPack would
    carry, at a fraction of the host cost). Like any torch op on the current stream, the
    kernels see the tensor as the current stream does."""
    dtype = _TORCH_DTYPES.get(str(t.dtype))
    if dtype is None:
        raise checks.type_error(f"{name} has an unsupported dtype {t.dtype}")
    return DeviceArray(int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), dtype, int(t.device.index or 0), t)


def _from_dlpack(obj, name: str, device: int, stream: int | None) -> DeviceArray:
    # The producer makes the data ready on `stream` (DLPack: 1 = the legacy default stream,
    # -1 = no synchronisation, for kdtree's own buffers, which are used on the stream that
    # made them; a legacy-stream sync would also break CUDA graph capture).
    s = -1 if stream is None else (1 if stream == 0 else int(stream))
    try:
        capsule = obj.__dlpack__(stream=s)
    except TypeError:
        capsule = obj.__dlpack__()
    ptr = _PyCapsule_GetPointer(capsule, b"dltensor")
    t = _DLTensor.from_address(ptr)  # DLManagedTensor starts with its DLTensor
    if t.device.device_type not in (_KDLCUDA, _KDLCUDA_MANAGED) or t.device.device_id != device:
        raise checks.type_error(f"{name}: the DLPack tensor is on device ({t.device.device_type}, {t.device.device_id}), "
                        f"not the CUDA device {device} its producer reported")
    if not 0 <= t.ndim <= 32 or (t.ndim and not t.shape):
        raise checks.type_error(f"{name}: malformed DLPack tensor (ndim {t.ndim})")
    key = (t.dtype.code, t.dtype.bits)
    if t.dtype.lanes != 1 or key not in _BY_DLPACK:
        raise checks.type_error(f"{name} has an unsupported DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits})")
    dtype = _BY_DLPACK[key]
    ndim = t.ndim
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) for i in range(ndim))
    else:
        strides = _contiguous_strides(shape)
    data = (t.data or 0) + int(t.byte_offset)
    # The capsule is not consumed: its destructor releases the producer's tensor when the
    # view is dropped.
    return DeviceArray(data, shape, strides, dtype, device, obj, capsule)


def _from_cai(obj, name: str) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    typestr = cai["typestr"]
    if typestr not in _BY_TYPESTR:
        raise checks.type_error(f"{name} has an unsupported dtype {typestr!r}")
    dtype = _BY_TYPESTR[typestr]
    shape = tuple(int(x) for x in cai["shape"])
    itemsize = _ITEMSIZE[dtype]
    if cai.get("strides") is None:
        strides = _contiguous_strides(shape)
    else:
        if len(cai["strides"]) != len(shape) or any(s % itemsize for s in cai["strides"]):
            raise checks.type_error(f"{name} has strides that are not whole elements: {cai['strides']}")
        strides = tuple(int(s) // itemsize for s in cai["strides"])
    if cai.get("mask") is not None:
        raise checks.type_error(f"{name}: masked arrays are not supported")
    ptr = int(cai["data"][0] or 0)
    if not 0 <= ptr < 2**64:
        raise checks.type_error(f"{name}: bad device pointer {ptr}")
    device = _cai_device(obj)
    return DeviceArray(ptr, shape, strides, dtype, device, obj, readonly=bool(cai["data"][1]))


def _cai_device(obj) -> int:
    dev = getattr(obj, "device", None)
    for attr in ("index", "id"):
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    return 0


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for extent in reversed(shape):
        strides.append(acc)
        acc *= max(extent, 1)
    return tuple(reversed(strides))


# ---- streams, devices, allocation through the caller's library ---------------------------


def current_stream(like, stream=None) -> int:
    """The CUDA stream handle to launch on: `stream` when given (an int handle, a
    ``torch.cuda.Stream`` or a ``cupy.cuda.Stream``), else the current stream of the
    library `like` comes from (torch or CuPy), else 0 (the legacy default stream)."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
            return int(stream)
        raise checks.type_error(f"stream must be an int handle, a torch or a CuPy stream, got {type(stream).__name__}")
    lib = _library(like)
    if lib == "torch":
        return int(sys.modules["torch"].cuda.current_stream(like.device).cuda_stream)
    if lib == "cupy":
        return int(sys.modules["cupy"].cuda.get_current_stream().ptr)
    return 0


class on_device:
    """Context manager: makes `like`'s CUDA device current for the launches inside (torch
    or CuPy device guards; a no-op for other producers, which run on the current device)."""

    def __init__(self, like):
        lib = _library(like)
        if lib == "torch":
            self._ctx = sys.modules["torch"].cuda.device(like.device)
        elif lib == "cupy":
            self._ctx = like.device
        else:
            self._ctx = None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            return self._ctx.__exit__(*exc)
        return False


def empty(like, shape, dtype: str):
    """An uninitialised C-contiguous array on `like`'s device, made by `like`'s library."""
    shape = tuple(int(x) for x in shape)
    lib = _library(like)
    if lib == "torch":
        torch = sys.modules["torch"]
        tdtype = getattr(torch, "bool" if dtype == "bool" else dtype)
        return torch.empty(shape, dtype=tdtype, device=like.device)
    if lib == "cupy":
        cupy = sys.modules["cupy"]
        return cupy.empty(shape, dtype="uint16" if dtype == "bfloat16" else dtype)
    raise checks.type_error(
        f"kdtree allocates GPU outputs with torch or CuPy; {type(like).__name__} arrays need "
        "their outputs passed in (out=)"
    )


def capturing(like) -> bool:
    """Whether the current torch stream of `like`'s device is capturing a CUDA graph (a
    host copy or a pageable upload would fail or be baked into the graph there)."""
    if _library(like) != "torch" or not getattr(like, "is_cuda", False):
        return False
    return bool(sys.modules["torch"].cuda.is_current_stream_capturing())


def require_not_capturing(like, what: str) -> None:
    """KdtreeError naming `what` when a CUDA graph is being captured on `like`'s stream."""
    if capturing(like):
        raise checks.invalid(f"{what} inside CUDA graph capture; pass it as a device array (or the static value "
                             "the call would read) before capturing")


def to_host(obj) -> np.ndarray:
    """A numpy copy of a GPU array (synchronises with its stream). KdtreeError inside a
    CUDA graph capture, where the copy cannot run."""
    require_not_capturing(obj, "a device array would be copied to the host")
    lib = _library(obj)
    if lib == "torch":
        return obj.detach().cpu().numpy()
    if lib == "cupy":
        return obj.get()
    if hasattr(obj, "copy_to_host"):  # numba
        return obj.copy_to_host()
    raise checks.type_error(f"cannot copy a {type(obj).__name__} to the host")


def from_host(like, array: np.ndarray):
    """A GPU copy of a small host array, on `like`'s device and library. KdtreeError inside
    a CUDA graph capture (a captured upload would replay the capture-time values)."""
    require_not_capturing(like, "a host array would be copied to the device")
    lib = _library(like)
    if lib == "torch":
        torch = sys.modules["torch"]
        return torch.from_numpy(np.array(array, copy=True, order="C")).to(like.device, non_blocking=False)
    if lib == "cupy":
        return sys.modules["cupy"].asarray(array)
    raise checks.type_error(f"kdtree copies small inputs to the GPU with torch or CuPy, got {type(like).__name__}")
