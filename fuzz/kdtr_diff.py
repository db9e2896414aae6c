"""Differential check of the two KDTR readers on a set of files (fuzz corpus, crash files).

Every file goes through the C reader (``kdt_kdtr_open`` and ``kdt_kdtr_open_memory`` of the
library given, through ctypes) and the Python reader (``kdtree.kdtr.load`` and ``loads``).
They must agree on accept / reject (and on the kind: format error or unsupported), and on
an accepted file on every array's name, dtype, shape and bytes, in file order.

    python fuzz/kdtr_diff.py LIBRARY PATH...     (a PATH may be a folder: every file in it)

Prints one line per disagreement and a summary; exits 1 if any file disagrees.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from kdtree import kdtr  # noqa: E402  (after the path insert)

KDT_OK, KDT_ERR_FORMAT, KDT_ERR_UNSUPPORTED = 0, 9, 10
OK, FORMAT, UNSUPPORTED = "accepted", "format error", "unsupported"


class KdtArray(ctypes.Structure):
    """kdt_kdtr_array (include/kdtree.h)."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
    ]


def load_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    vp, p_vp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
    # kdt_status kdt_kdtr_open(const char* path, kdt_kdtr_file** out)
    lib.kdt_kdtr_open.argtypes, lib.kdt_kdtr_open.restype = [ctypes.c_char_p, p_vp], ctypes.c_int
    # kdt_status kdt_kdtr_open_memory(const void* data, size_t size, kdt_kdtr_file** out)
    lib.kdt_kdtr_open_memory.argtypes = [ctypes.c_char_p, ctypes.c_size_t, p_vp]
    lib.kdt_kdtr_open_memory.restype = ctypes.c_int
    # void kdt_kdtr_close(kdt_kdtr_file* file)
    lib.kdt_kdtr_close.argtypes, lib.kdt_kdtr_close.restype = [vp], None
    # kdt_status kdt_kdtr_count(const kdt_kdtr_file* file, int64_t* count)
    lib.kdt_kdtr_count.argtypes = [vp, ctypes.POINTER(ctypes.c_int64)]
    lib.kdt_kdtr_count.restype = ctypes.c_int
    # kdt_status kdt_kdtr_get(const kdt_kdtr_file* file, int64_t index, kdt_kdtr_array* out)
    lib.kdt_kdtr_get.argtypes = [vp, ctypes.c_int64, ctypes.POINTER(KdtArray)]
    lib.kdt_kdtr_get.restype = ctypes.c_int
    # const char* kdt_last_error(void)
    lib.kdt_last_error.argtypes, lib.kdt_last_error.restype = [], ctypes.c_char_p
    return lib


def c_read(lib, path: Path, data: bytes, from_memory: bool):
    """(outcome, [(name, dtype name, shape, bytes)] or the error text)."""
    handle = ctypes.c_void_p()
    if from_memory:
        status = lib.kdt_kdtr_open_memory(data, len(data), ctypes.byref(handle))
    else:
        status = lib.kdt_kdtr_open(bytes(path), ctypes.byref(handle))
    if status != KDT_OK:
        message = lib.kdt_last_error().decode("utf-8", "replace")
        kind = {KDT_ERR_FORMAT: FORMAT, KDT_ERR_UNSUPPORTED: UNSUPPORTED}.get(status, f"status {status}")
        return kind, message
    try:
        count = ctypes.c_int64()
        assert lib.kdt_kdtr_count(handle, ctypes.byref(count)) == KDT_OK
        arrays = []
        for i in range(count.value):
            a = KdtArray()
            assert lib.kdt_kdtr_get(handle, i, ctypes.byref(a)) == KDT_OK
            shape = tuple(a.shape[d] for d in range(a.ndim))
            raw = ctypes.string_at(a.data, a.nbytes) if a.nbytes else b""
            arrays.append((a.name.decode("utf-8"), kdtr.DTYPE_CODES[a.dtype][0], shape, raw))
        return OK, arrays
    finally:
        lib.kdt_kdtr_close(handle)


def py_read(path: Path, data: bytes, from_memory: bool):
    try:
        result = kdtr.loads(data) if from_memory else kdtr.load(path)
    except kdtr.KdtrUnsupportedError as exc:
        return UNSUPPORTED, str(exc)
    except kdtr.KdtrFormatError as exc:
        return FORMAT, str(exc)
    arrays = [(name, a.dtype.name, a.shape, a.tobytes()) for name, a in result.items()]
    return OK, arrays


def compare(lib, path: Path) -> list[str]:
    """The disagreements for one file (empty when the readers agree)."""
    data = path.read_bytes()
    problems = []
    results = {
        "C open_memory": c_read(lib, path, data, True),
        "C open": c_read(lib, path, data, False),
        "Python loads": py_read(path, data, True),
        "Python load": py_read(path, data, False),
    }
    (ref_name, (ref_kind, ref_value)), *others = results.items()
    for name, (kind, value) in others:
        if kind != ref_kind:
            problems.append(f"{path}: {ref_name}: {ref_kind} ({str(ref_value)[:120]}) but {name}: "
                            f"{kind} ({str(value)[:120]})")
        elif kind == OK and value != ref_value:
            want = [(n, d, s, len(b)) for n, d, s, b in ref_value]
            got = [(n, d, s, len(b)) for n, d, s, b in value]
            problems.append(f"{path}: {ref_name} and {name} read different arrays: {want[:4]} vs {got[:4]}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    lib = load_library(argv[0])
    files = []
    for p in map(Path, argv[1:]):
        files += sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p]
    problems, accepted = [], 0
    for f in files:
        found = compare(lib, f)
        problems += found
        if not found and c_read(lib, f, f.read_bytes(), True)[0] == OK:
            accepted += 1
    for line in problems:
        print(line)
    print(f"kdtr differential: {len(files)} files ({accepted} accepted by both readers), "
          f"{len(problems)} disagreements")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
