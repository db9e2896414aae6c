"""Tests of the KDTR container (docs/kdtr-format.md): the pure-Python reader and writer in
kdtree.kdtr, and, through ctypes, agreement with the C reader and writer in libkdtree."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdtree import kdtr
from kdtree.kdtr import KdtrFormatError, KdtrUnsupportedError

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "kdtr_sample.kdtr"
BF16 = np.dtype(ml_dtypes.bfloat16)

# Reference: numpy dtype of each file code (spec section 4, kdt_dtype in include/kdtree.h).
CODE_DTYPES = {
    1: np.dtype(np.bool_),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint8),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: BF16,
    12: np.dtype(np.float32),
    13: np.dtype(np.float64),
}
ALL_DTYPES = list(CODE_DTYPES.values())


def raw_bytes(a: np.ndarray) -> bytes:
    """The C-order little-endian bytes of an array (NaN-safe comparison)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def sample_of(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Deterministic array of a dtype and shape, with every bit pattern allowed (bool: 0/1)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(0, 256, size=n, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        w = np.asarray(w)
        g = got[name]
        assert g.dtype == w.dtype.newbyteorder("<") or g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        assert raw_bytes(g) == raw_bytes(w.astype(g.dtype)), name


# ---- The worked example of spec section 8 and a file with a known layout --------------------

EXAMPLE = {"a": np.array([1, 2], np.int32), "s": np.array(1.5)}


def example_bytes() -> bytes:
    b = bytearray(264)
    struct.pack_into("<8sHHIQQQ", b, 0, b"KDTR\r\n\x1a\n", 1, 0, 64, 264, 2, 88)
    struct.pack_into("<QQIII4x", b, 64, 192, 8, 1, 4, 1)
    b[96] = ord("a")
    struct.pack_into("<q", b, 104, 2)
    struct.pack_into("<QQIII4x", b, 112, 256, 8, 1, 13, 0)
    b[144] = ord("s")
    struct.pack_into("<ii", b, 192, 1, 2)
    struct.pack_into("<d", b, 256, 1.5)
    return bytes(b)


# record 0 "a" at 64, record 1 "s" at 112, record 2 "m" uint8 [2, 3] at 152 (shape at 192);
# table ends at 208; data at 256, 320, 384; 390 bytes (as in tests_native/test_kdtr.c).
SMALL = {**EXAMPLE, "m": np.arange(1, 7, dtype=np.uint8).reshape(2, 3)}
REC0, REC1, REC2, SMALL_SIZE = 64, 112, 152, 390


def small_bytes() -> bytes:
    data = kdtr.dumps(SMALL)
    assert len(data) == SMALL_SIZE
    return data


def test_worked_example_bytes():
    assert kdtr.dumps(EXAMPLE) == example_bytes()
    assert_same(kdtr.loads(example_bytes()), EXAMPLE)


# ---- Round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (19, 3), (0, 4), (3, 0, 5), (2, 1, 1, 3)])
def test_round_trip_every_dtype(tmp_path, dtype, shape):
    arrays = {"x": sample_of(dtype, shape, seed=len(shape)), "y": sample_of(dtype, (5,))}
    path = tmp_path / "a.kdtr"
    kdtr.save(path, arrays)
    got = kdtr.load(path)
    assert_same(got, arrays)
    assert got["x"].dtype == dtype
    assert kdtr.loads(path.read_bytes()).keys() == arrays.keys()


def test_bf16_stays_bf16_and_bool_stays_bool(tmp_path):
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001, 0x7FC0], np.uint16)
    arrays = {"bf": bits.view(BF16), "b": np.array([True, False, True])}
    kdtr.save(tmp_path / "a.kdtr", arrays)
    got = kdtr.load(tmp_path / "a.kdtr")
    assert got["bf"].dtype == BF16
    assert got["bf"].view(np.uint16).tolist() == bits.tolist()
    assert got["b"].dtype == np.bool_
    assert got["b"].tolist() == [True, False, True]


def test_zero_d_and_zero_size():
    arrays = {
        "scalar": np.array(1.5),
        "py_int": 7,
        "empty": np.zeros((0, 4), np.float32),
        "empty_huge": np.zeros((0, 2**62), np.uint8),
    }
    got = kdtr.loads(kdtr.dumps(arrays))
    assert got["scalar"].shape == () and got["scalar"] == 1.5
    assert got["py_int"].shape == () and got["py_int"] == 7 and got["py_int"].dtype == np.int64
    assert got["empty"].shape == (0, 4) and got["empty"].dtype == np.float32
    assert got["empty_huge"].shape == (0, 2**62)


def test_non_contiguous_and_big_endian_inputs():
    base = np.arange(7 * 19, dtype=np.float64).reshape(7, 19)
    arrays = {
        "sliced": base[1::2, ::3],
        "transposed": base.T,
        "fortran": np.asfortranarray(base),
        "negative_stride": base[::-1],
        "big_endian": np.arange(5, dtype=">i4"),
        "bf16_sliced": base.astype(BF16)[:, 1::2],
    }
    got = kdtr.loads(kdtr.dumps(arrays))
    for name, a in arrays.items():
        np.testing.assert_array_equal(got[name], a)
        assert got[name].flags.c_contiguous
    assert got["big_endian"].dtype == np.dtype("<i4")


def test_insertion_order_and_writable():
    names = ["z", "a", "m\u00e9", "b/c"]
    got = kdtr.loads(kdtr.dumps({n: np.arange(3) for n in names}))
    assert list(got) == names
    got["z"][0] = 42  # loaded arrays are ordinary writable arrays
    assert got["z"][0] == 42


def test_file_layout_is_aligned():
    data = kdtr.dumps({"a": np.arange(3, dtype=np.int8), "b": np.arange(5, dtype=np.float32)})
    count = struct.unpack_from("<Q", data, 24)[0]
    pos = 64
    for _ in range(count):
        off, nbytes, name_len, _code, ndim = struct.unpack_from("<QQIII", data, pos)
        assert off % 64 == 0
        pos += 32 + (name_len + 7) // 8 * 8 + 8 * ndim


@pytest.mark.parametrize(
    "value",
    [
        np.array([object()], dtype=object),
        np.array([1 + 2j]),
        np.array(["text"]),
        np.array([b"bytes"]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("a", np.int32)]),
        np.zeros(2, dtype=np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else None,
    ],
    ids=["object", "complex", "str", "bytes", "datetime", "structured", "longdouble"],
)
def test_unsupported_dtypes_raise(value):
    if value is None:
        pytest.skip("longdouble is float64 on this platform")
    with pytest.raises(ValueError, match="array 'bad'"):
        kdtr.dumps({"ok": np.arange(2), "bad": value})


@pytest.mark.parametrize(
    "name, text",
    [
        ("", "empty"),
        ("a\x00b", "NUL"),
        (3, "not a str"),
        ("\ud800", "UTF-8"),
        ("n" * 65536, "longer"),
    ],
)
def test_bad_names_raise(name, text):
    with pytest.raises(ValueError, match=text):
        kdtr.dumps({name: np.arange(2)})


def test_too_many_dims_raise():
    with pytest.raises(ValueError, match="array 'deep': 33 dimensions"):
        kdtr.dumps({"deep": np.zeros((1,) * 33)})
    got = kdtr.loads(kdtr.dumps({"ok": np.zeros((1,) * 32)}))
    assert got["ok"].shape == (1,) * 32


def test_longest_name():
    name = "n" * 65535
    assert list(kdtr.loads(kdtr.dumps({name: np.arange(1)}))) == [name]


def test_save_is_atomic(tmp_path):
    path = tmp_path / "keep.kdtr"
    kdtr.save(path, {"x": np.arange(3)})
    with pytest.raises(ValueError):
        kdtr.save(path, {"x": np.arange(3), "bad": np.array([1j])})
    assert list(kdtr.load(path)) == ["x"]  # old file untouched
    with pytest.raises(ValueError):
        kdtr.save(tmp_path / "new.kdtr", {"bad": np.array(["s"])})
    assert not (tmp_path / "new.kdtr").exists()
    kdtr.save(path, {"y": np.arange(2)})  # replacing works
    assert list(kdtr.load(path)) == ["y"]
    assert [p.name for p in tmp_path.iterdir()] == ["keep.kdtr"]  # no temporary files
    with pytest.raises(OSError):
        kdtr.save(tmp_path / "no" / "such" / "x.kdtr", {"x": np.arange(1)})


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        kdtr.load(tmp_path / "missing.kdtr")


# ---- Rejection: truncation and each corrupted field -------------------------------------------


def test_every_truncation_is_rejected():
    data = small_bytes()
    for n in range(len(data)):
        with pytest.raises(KdtrFormatError):
            kdtr.loads(data[:n])
    with pytest.raises(KdtrFormatError, match="file_size at byte offset 16"):
        kdtr.loads(data + b"\x00")


def u16(off, v):
    return lambda b: struct.pack_into("<H", b, off, v)


def u32(off, v):
    return lambda b: struct.pack_into("<I", b, off, v)


def u64(off, v):
    return lambda b: struct.pack_into("<Q", b, off, v)


def byte(off, v):
    def f(b):
        b[off] = v

    return f


def both(*fs):
    def f(b):
        for g in fs:
            g(b)

    return f


FORMAT, UNSUPPORTED, OK = "format", "unsupported", "ok"

# (id, mutation of small_bytes(), expected outcome, text of the message). Mirrors
# test_corruptions in tests_native/test_kdtr.c.
CORRUPTIONS = [
    ("bad_magic", byte(0, ord("X")), FORMAT, "magic at byte offset 0"),
    ("bad_magic_tail", byte(7, 0), FORMAT, "magic"),
    ("major_2", u16(8, 2), UNSUPPORTED, "major version at byte offset 8"),
    ("major_257", u16(8, 257), UNSUPPORTED, "major version"),
    ("newer_minor", u16(10, 7), OK, None),
    ("reserved_header", byte(40, 0xFF), OK, None),
    ("header_size_small", u32(12, 60), FORMAT, "header_size at byte offset 12"),
    ("header_size_huge", u32(12, 0xFFFFFFFF), FORMAT, "header_size"),
    ("file_size_plus_1", u64(16, SMALL_SIZE + 1), FORMAT, "file_size at byte offset 16"),
    ("file_size_huge", u64(16, 2**64 - 1), FORMAT, "file_size"),
    ("count_huge", u64(24, 2**64 - 1), FORMAT, "array_count at byte offset 24"),
    ("count_2_61", u64(24, 2**61), FORMAT, "array_count"),
    ("count_4", u64(24, 4), FORMAT, "array_count"),
    ("count_2", u64(24, 2), FORMAT, "table_size at byte offset 32"),
    ("table_size_huge", u64(32, 2**64 - 8), FORMAT, "table_size at byte offset 32"),
    ("table_size_odd", u64(32, 140), FORMAT, "table_size"),
    ("table_size_short", u64(32, 136), FORMAT, "array 2: record at byte offset 152"),
    ("name_len_huge", u32(REC1 + 16, 0xFFFFFFFF), FORMAT, "array 1: name_len at byte offset 128"),
    ("name_len_past_table", u32(REC1 + 16, 65535), FORMAT, "array 1: record at byte offset 112"),
    ("name_len_0", u32(REC1 + 16, 0), FORMAT, "name_len"),
    ("ndim_33", u32(REC2 + 24, 33), FORMAT, "array 2: ndim at byte offset 176"),
    ("ndim_huge", u32(REC2 + 24, 0xFFFFFFFF), FORMAT, "ndim"),
    ("ndim_past_table", u32(REC2 + 24, 3), FORMAT, "array 2: record at byte offset 152"),
    ("name_nul", byte(REC0 + 32, 0), FORMAT, "array 0: name at byte offset 96: contains a NUL"),
    (
        "name_bad_utf8",
        byte(REC0 + 32, 0xFF),
        FORMAT,
        "name at byte offset 96: not well-formed UTF-8",
    ),
    ("name_cut_utf8", byte(REC0 + 32, 0xC3), FORMAT, "UTF-8"),
    (
        "dtype_14",
        u32(REC1 + 20, 14),
        UNSUPPORTED,
        "array 1 ('s'): dtype at byte offset 132: unknown dtype code 14",
    ),
    ("dtype_0", u32(REC1 + 20, 0), UNSUPPORTED, "dtype"),
    (
        "shape_overflow",
        u64(REC2 + 40, 2**62),
        FORMAT,
        "array 2 ('m'): shape[1] at byte offset 200: shape product overflows",
    ),
    (
        "shape_negative",
        u64(REC2 + 40, 2**64 - 1),
        FORMAT,
        "array 2 ('m'): shape[0] at byte offset 192: negative extent -1",
    ),
    ("shape_zero_nbytes_6", u64(REC2 + 40, 0), FORMAT, "array 2 ('m'): nbytes at byte offset 160"),
    ("nbytes_7", u64(REC2 + 8, 7), FORMAT, "nbytes"),
    (
        "zero_extent_huge_other",
        both(u64(REC2 + 40, 0), u64(REC2 + 48, 2**62), u64(REC2 + 8, 0)),
        OK,
        None,
    ),
    (
        "zero_extent_last",
        both(u64(REC2 + 40, 2**62), u64(REC2 + 48, 0), u64(REC2 + 8, 0)),
        OK,
        None,
    ),
    ("offset_past_end", u64(REC2, 448), FORMAT, "array 2 ('m'): data_offset at byte offset 152"),
    ("offset_wraps", u64(REC2, 2**64 - 64), FORMAT, "past the end of the file"),
    ("nbytes_huge", u64(REC2 + 8, 2**64 - 1), FORMAT, "nbytes"),
    (
        "offset_misaligned",
        u64(REC0, 260),
        FORMAT,
        "array 0 ('a'): data_offset at byte offset 64: 260 is not a multiple of 64",
    ),
    (
        "offset_overlap",
        u64(REC1, 256),
        FORMAT,
        "array 1 ('s'): data_offset at byte offset 112: 256 overlaps",
    ),
    ("offset_in_table", u64(REC0, 192), FORMAT, "inside the header or record table"),
    ("offset_0", u64(REC0, 0), FORMAT, "data_offset"),
    (
        "duplicate_name",
        byte(REC2 + 32, ord("a")),
        FORMAT,
        "array 2 ('a'): name at byte offset 184: duplicates the name of array 0",
    ),
    ("name_padding", byte(REC0 + 33, 0xEE), OK, None),
]


def corrupted(mutate) -> bytes:
    b = bytearray(small_bytes())
    mutate(b)
    return bytes(b)


@pytest.mark.parametrize("case", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_python_reader_rejects_corruption(case):
    _id, mutate, outcome, text = case
    data = corrupted(mutate)
    if outcome == OK:
        kdtr.loads(data)
        return
    exc = KdtrUnsupportedError if outcome == UNSUPPORTED else KdtrFormatError
    with pytest.raises(exc) as info:
        kdtr.loads(data)
    assert text in str(info.value)
    if outcome == FORMAT:
        assert not isinstance(info.value, KdtrUnsupportedError)


def test_newer_minor_with_a_longer_header_is_read():
    """A 1.x file may grow the header (header_size > 64); readers skip what they don't know."""
    old = small_bytes()
    b = bytearray(old[:64]) + bytearray(b"\xee" * 64) + bytearray(old[64:])
    struct.pack_into("<HI", b, 10, 3, 128)  # minor 3, header_size 128
    struct.pack_into("<Q", b, 16, len(b))
    for rec in (REC0, REC1, REC2):
        off = struct.unpack_from("<Q", b, rec + 64)[0]
        struct.pack_into("<Q", b, rec + 64, off + 64)
    assert_same(kdtr.loads(bytes(b)), SMALL)
    lib = _lib_or_none()
    if lib is not None:
        assert_same(c_loads(lib, bytes(b)), SMALL)


# ---- Sparse and crafted files: only what the records point at is read ------------------------

GIB = 1 << 30


def _header(file_size: int, count: int, table_size: int) -> bytes:
    return struct.pack("<8sHHIQQQ24x", b"KDTR\r\n\x1a\n", 1, 0, 64, file_size, count, table_size)


def _sparse(path: Path, size: int, *pieces: tuple[int, bytes]) -> Path:
    """A sparse file of ``size`` bytes holding each (offset, bytes) piece, zeros elsewhere."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in pieces:
            f.seek(off)
            f.write(data)
    return path


def _one_array_at_the_end() -> bytes:
    """Header and record of int32 'a' [2] at byte offset 1 GiB - 64 of a 1 GiB file."""
    rec = struct.pack("<QQIII4x", GIB - 64, 8, 1, 4, 1) + b"a" + b"\x00" * 7 + struct.pack("<q", 2)
    return _header(GIB, 1, len(rec)) + rec


SPARSE_CASES = [
    # (id, pieces of a 1 GiB file, expected arrays or the expected error text)
    ("no-arrays-then-a-hole", [(0, _header(GIB, 0, 0))], {}),
    (
        "one-array-at-the-end",
        [(0, _one_array_at_the_end()), (GIB - 64, struct.pack("<2i", 7, -2))],
        {"a": [7, -2]},
    ),
    (
        "huge-table-bad-first-record",
        [(0, _header(GIB, 8192, 512 << 20))],
        "array 0: name_len at byte offset 80: 0 is outside 1..65535",
    ),
]

_PEAK_PROBE = """
import resource, sys
from kdtree import kdtr
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    result = {k: v.tolist() for k, v in kdtr.load(sys.argv[1]).items()}
except kdtr.KdtrFormatError as exc:
    result = str(exc)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
print(repr(result))
"""


@pytest.mark.parametrize("case", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_sparse_file_is_not_read_whole(tmp_path, case):
    """A 1 GiB file whose records cover a few bytes: kdtr.load's peak memory (ru_maxrss of a
    fresh interpreter, KiB on Linux) grows by far less than the declared size."""
    _id, pieces, want = case
    path = _sparse(tmp_path / "sparse.kdtr", GIB, *pieces)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE, str(path)], env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    grew_kib, result = run.stdout.splitlines()
    assert int(grew_kib) < 64 * 1024
    assert result == repr(want)
    lib = _lib_or_none()
    if lib is not None:
        handle = ctypes.c_void_p()
        status = lib.kdt_kdtr_open(str(path).encode(), ctypes.byref(handle))
        try:
            if isinstance(want, str):
                assert status == KDT_ERR_FORMAT and want in _error(lib)
            else:
                assert status == KDT_OK, _error(lib)
                assert {k: v.tolist() for k, v in c_read(lib, handle).items()} == want
        finally:
            lib.kdt_kdtr_close(handle)


def test_table_longer_than_the_first_read_piece(tmp_path):
    """A valid record table of about 300 KiB (read in growing pieces) loads in both readers."""
    arrays = {f"{i:05d}" + "n" * 140: np.arange(i % 5, dtype=np.int16) for i in range(1800)}
    data = kdtr.dumps(arrays)
    assert struct.unpack_from("<Q", data, 32)[0] > 4 * (1 << 16)
    (tmp_path / "t.kdtr").write_bytes(data)
    assert_same(kdtr.load(tmp_path / "t.kdtr"), arrays)
    assert_same(kdtr.loads(data), arrays)
    lib = _lib_or_none()
    if lib is not None:
        assert_same(c_loads(lib, data), arrays)


def test_zero_extent_does_not_hide_overflow():
    # [2^62, 0, 4]: the non-zero extents overflow even though the array is empty.
    arrays = {"m": np.zeros((1, 0, 1), np.uint8)}
    b = bytearray(kdtr.dumps(arrays))
    struct.pack_into("<qqq", b, 64 + 32 + 8, 2**62, 0, 4)
    with pytest.raises(
        KdtrFormatError, match=r"shape\[2\] at byte offset 120: shape product overflows"
    ):
        kdtr.loads(bytes(b))
    lib = _lib_or_none()
    if lib is not None:
        status, message = c_status(lib, bytes(b))
        assert status == KDT_ERR_FORMAT and "shape[2] at byte offset 120" in message, message


# ---- The fixture ------------------------------------------------------------------------------


def test_fixture_matches_the_generator():
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE} not generated (run tools/make_kdtr_sample.py)")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_kdtr_sample
    finally:
        sys.path.pop(0)
    want = make_kdtr_sample.sample_arrays()
    assert_same(kdtr.load(FIXTURE), want)
    assert FIXTURE.read_bytes() == kdtr.dumps(want)


# ---- Hypothesis round trip --------------------------------------------------------------------

names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=12,
)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)


@st.composite
def array_sets(draw):
    keys = draw(st.lists(names, min_size=0, max_size=5, unique=True))
    out = {}
    for k in keys:
        dtype = draw(st.sampled_from(ALL_DTYPES))
        shape = draw(shapes)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
        if dtype == np.bool_:
            raw = raw % 2
        out[k] = raw.view(dtype).reshape(shape)
    return out


@settings(max_examples=150, deadline=None)
@given(array_sets())
def test_hypothesis_round_trip(arrays):
    data = kdtr.dumps(arrays)
    assert len(data) == struct.unpack_from("<Q", data, 16)[0]
    got = kdtr.loads(data)
    assert_same(got, arrays)
    for k in arrays:
        assert got[k].dtype == arrays[k].dtype
    lib = _lib_or_none()
    if lib is not None:
        assert c_dumps(lib, arrays) == data
        assert_same(c_loads(lib, data), arrays)


# ---- Cross-implementation checks through ctypes -----------------------------------------------


class KdtArray(ctypes.Structure):
    """Mirror of kdt_kdtr_array (include/kdtree.h)."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
    ]


KDT_OK, KDT_ERR_FORMAT, KDT_ERR_UNSUPPORTED = 0, 9, 10
_LIB_CACHE: list = []


def _lib_path() -> Path:
    env = os.environ.get("KDTREE_LIBRARY")
    return Path(env) if env else ROOT / "build" / "libkdtree.so"


def _lib_or_none():
    if _LIB_CACHE:
        return _LIB_CACHE[0]
    lib = None
    path = _lib_path()
    if path.exists():
        try:
            lib = ctypes.CDLL(str(path))
            lib.kdt_kdtr_open  # noqa: B018 - the KDTR symbols must exist
        except (OSError, AttributeError):
            lib = None
    if lib is not None:
        vp, p_vp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        # kdt_status kdt_kdtr_open(const char* path, kdt_kdtr_file** out)
        lib.kdt_kdtr_open.argtypes, lib.kdt_kdtr_open.restype = (
            [ctypes.c_char_p, p_vp],
            ctypes.c_int,
        )
        # kdt_status kdt_kdtr_open_memory(const void* data, size_t size, kdt_kdtr_file** out)
        lib.kdt_kdtr_open_memory.argtypes = [vp, ctypes.c_size_t, p_vp]
        lib.kdt_kdtr_open_memory.restype = ctypes.c_int
        # void kdt_kdtr_close(kdt_kdtr_file* file)
        lib.kdt_kdtr_close.argtypes, lib.kdt_kdtr_close.restype = [vp], None
        # kdt_status kdt_kdtr_count(const kdt_kdtr_file* file, int64_t* count)
        lib.kdt_kdtr_count.argtypes = [vp, ctypes.POINTER(ctypes.c_int64)]
        lib.kdt_kdtr_count.restype = ctypes.c_int
        # kdt_status kdt_kdtr_get(const kdt_kdtr_file* file, int64_t index, kdt_kdtr_array* out)
        lib.kdt_kdtr_get.argtypes = [vp, ctypes.c_int64, ctypes.POINTER(KdtArray)]
        lib.kdt_kdtr_get.restype = ctypes.c_int
        # kdt_status kdt_kdtr_save(const char* path, const kdt_kdtr_array* arrays, int64_t count)
        lib.kdt_kdtr_save.argtypes = [ctypes.c_char_p, ctypes.POINTER(KdtArray), ctypes.c_int64]
        lib.kdt_kdtr_save.restype = ctypes.c_int
        # const char* kdt_last_error(void)
        lib.kdt_last_error.argtypes, lib.kdt_last_error.restype = [], ctypes.c_char_p
    _LIB_CACHE.append(lib)
    return lib


@pytest.fixture
def lib():
    lib = _lib_or_none()
    if lib is None:
        pytest.skip(
            f"libkdtree is not built ({_lib_path()} missing; set KDTREE_LIBRARY or build it)"
        )
    return lib


def _error(lib) -> str:
    return lib.kdt_last_error().decode("utf-8", "replace")


def c_read(lib, handle) -> dict[str, np.ndarray]:
    count = ctypes.c_int64()
    assert lib.kdt_kdtr_count(handle, ctypes.byref(count)) == KDT_OK
    out = {}
    for i in range(count.value):
        a = KdtArray()
        assert lib.kdt_kdtr_get(handle, i, ctypes.byref(a)) == KDT_OK, _error(lib)
        shape = tuple(a.shape[d] for d in range(a.ndim))
        assert a.data % 64 == 0
        raw = ctypes.string_at(a.data, a.nbytes) if a.nbytes else b""
        dtype = CODE_DTYPES[a.dtype]
        out[a.name.decode("utf-8")] = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)
    return out


def c_loads(lib, data: bytes) -> dict[str, np.ndarray]:
    handle = ctypes.c_void_p()
    status = lib.kdt_kdtr_open_memory(data, len(data), ctypes.byref(handle))
    assert status == KDT_OK, _error(lib)
    try:
        return c_read(lib, handle)
    finally:
        lib.kdt_kdtr_close(handle)


def c_status(lib, data: bytes) -> tuple[int, str]:
    handle = ctypes.c_void_p()
    status = lib.kdt_kdtr_open_memory(data, len(data), ctypes.byref(handle))
    lib.kdt_kdtr_close(handle)
    return status, _error(lib)


def c_save(lib, path: Path, arrays: dict[str, np.ndarray]) -> None:
    codes = {dt: code for code, dt in CODE_DTYPES.items()}
    keep = []  # converted arrays and shapes stay referenced for the whole call
    recs = (KdtArray * max(1, len(arrays)))()
    for i, (name, a) in enumerate(arrays.items()):
        a = np.ascontiguousarray(a) if a.ndim else np.array(a, order="C")
        shape = (ctypes.c_int64 * max(1, a.ndim))(*a.shape)
        keep += [a, shape]
        recs[i] = KdtArray(
            name.encode("utf-8"), codes[a.dtype], a.ndim, shape, a.ctypes.data, a.nbytes
        )
    status = lib.kdt_kdtr_save(os.fsencode(path), recs, len(arrays))
    assert status == KDT_OK, _error(lib)


def c_dumps(lib, arrays) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.kdtr"
        c_save(lib, path, arrays)
        return path.read_bytes()


def mixed_arrays() -> dict[str, np.ndarray]:
    out = {
        f"{dt}_{i}": sample_of(dt, shape, seed=i)
        for i, (dt, shape) in enumerate(
            (dt, shape) for dt in ALL_DTYPES for shape in [(), (7,), (0, 3), (19, 2)]
        )
    }
    out["\u03b2/logw"] = np.linspace(-1, 1, 5)
    return out


def test_python_written_read_by_c(lib, tmp_path):
    arrays = mixed_arrays()
    path = tmp_path / "py.kdtr"
    kdtr.save(path, arrays)
    handle = ctypes.c_void_p()
    assert lib.kdt_kdtr_open(os.fsencode(path), ctypes.byref(handle)) == KDT_OK, _error(lib)
    try:
        assert_same(c_read(lib, handle), arrays)
    finally:
        lib.kdt_kdtr_close(handle)


def test_c_written_read_by_python(lib, tmp_path):
    arrays = mixed_arrays()
    path = tmp_path / "c.kdtr"
    c_save(lib, path, arrays)
    got = kdtr.load(path)
    assert_same(got, arrays)
    assert all(got[k].dtype == a.dtype for k, a in arrays.items())  # bf16 stays bf16
    assert sum(a.dtype == BF16 for a in got.values()) == 4
    assert path.read_bytes() == kdtr.dumps(arrays)  # the two writers agree byte for byte


def test_c_and_python_agree_on_the_example_and_fixture(lib):
    assert c_dumps(lib, EXAMPLE) == example_bytes()
    if FIXTURE.exists():
        assert_same(c_loads(lib, FIXTURE.read_bytes()), kdtr.load(FIXTURE))


@pytest.mark.parametrize("case", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_c_reader_agrees_on_corruption(lib, case):
    _id, mutate, outcome, text = case
    status, message = c_status(lib, corrupted(mutate))
    want = {OK: KDT_OK, FORMAT: KDT_ERR_FORMAT, UNSUPPORTED: KDT_ERR_UNSUPPORTED}[outcome]
    assert status == want, message
    if text is not None:
        assert text in message


def test_c_reader_agrees_on_truncation(lib):
    data = small_bytes()
    for n in range(len(data)):
        assert c_status(lib, data[:n])[0] == KDT_ERR_FORMAT


def test_random_flips_agree(lib):
    """Both readers accept exactly the same corrupted files and load the same arrays."""
    rng = np.random.default_rng(7)
    base = small_bytes()
    for _ in range(3000):
        b = bytearray(base)
        for pos in rng.integers(0, 208, size=rng.integers(1, 4)):
            b[pos] ^= 1 << int(rng.integers(0, 8))
        data = bytes(b)
        status, message = c_status(lib, data)
        try:
            got = kdtr.loads(data)
        except KdtrUnsupportedError:
            assert status == KDT_ERR_UNSUPPORTED, message
            continue
        except KdtrFormatError:
            assert status == KDT_ERR_FORMAT, message
            continue
        assert status == KDT_OK, message
        assert_same(c_loads(lib, data), got)
