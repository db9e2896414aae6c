"""KDTR: kdtree's binary container of named arrays, in pure Python (numpy + ml_dtypes).

The format is specified in ``docs/kdtr-format.md`` (version 1.0); the C library implements
the same reader and writer (``kdt_kdtr_open`` / ``kdt_kdtr_save`` in ``include/kdtree.h``).
Both writers produce identical bytes for the same arrays, and both readers accept and
reject the same files. This module does not need the shared library.

Supported dtypes (file code in parentheses): bool (1), int8/16/32/64 (2-5),
uint8/16/32/64 (6-9), float16 (10), ``ml_dtypes.bfloat16`` (11), float32 (12),
float64 (13). Arrays of any shape with at most 32 dimensions, 0-d and zero-size included.

Errors:
    ValueError            a writer input that cannot be stored (bad name, dtype, ndim)
    KdtrFormatError       a malformed file (a ValueError; the message names the field
                          and its byte offset)
    KdtrUnsupportedError  an unknown major version or dtype code (a KdtrFormatError)
    OSError               the file cannot be read or written
"""

from __future__ import annotations

import io
import os
import stat
import struct
from collections.abc import Mapping

import numpy as np

from .files import write_atomically

try:  # bfloat16 needs ml_dtypes; everything else works without it.
    import ml_dtypes as _ml_dtypes

    _BFLOAT16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency of the package
    _BFLOAT16 = None

__all__ = [
    "KdtrFormatError",
    "KdtrUnsupportedError",
    "MAJOR",
    "MINOR",
    "MAX_NDIM",
    "MAX_NAME_BYTES",
    "DTYPE_CODES",
    "dumps",
    "loads",
    "save",
    "load",
]

MAGIC = b"KDTR\r\n\x1a\n"
MAJOR = 1
MINOR = 0
HEADER_SIZE = 64
RECORD_FIXED = 32
MIN_RECORD = 40
ALIGN = 64
MAX_NDIM = 32
MAX_NAME_BYTES = 65535
_I64_MAX = 2**63 - 1

# Header: magic, major, minor, header_size, file_size, array_count, table_size, reserved.
_HEADER = struct.Struct("<8sHHIQQQ24x")
# Record fixed part: data_offset, nbytes, name_len, dtype, ndim, reserved.
_RECORD = struct.Struct("<QQIII4x")

#: dtype code -> (name, itemsize) as in ``kdt_dtype`` (include/kdtree.h).
DTYPE_CODES: dict[int, tuple[str, int]] = {
    1: ("bool", 1),
    2: ("int8", 1),
    3: ("int16", 2),
    4: ("int32", 4),
    5: ("int64", 8),
    6: ("uint8", 1),
    7: ("uint16", 2),
    8: ("uint32", 4),
    9: ("uint64", 8),
    10: ("float16", 2),
    11: ("bfloat16", 2),
    12: ("float32", 4),
    13: ("float64", 8),
}

_KIND_CODES = {
    ("b", 1): 1,
    ("i", 1): 2,
    ("i", 2): 3,
    ("i", 4): 4,
    ("i", 8): 5,
    ("u", 1): 6,
    ("u", 2): 7,
    ("u", 4): 8,
    ("u", 8): 9,
    ("f", 2): 10,
    ("f", 4): 12,
    ("f", 8): 13,
}


class KdtrFormatError(ValueError):
    """A KDTR file is malformed; the message names the array, field and byte offset."""


class KdtrUnsupportedError(KdtrFormatError):
    """A KDTR file uses an unknown major version or dtype code."""


def _numpy_dtype(code: int) -> np.dtype:
    if code == 11:
        if _BFLOAT16 is None:
            raise KdtrUnsupportedError("bfloat16 arrays need the ml_dtypes package")
        return _BFLOAT16
    return np.dtype(DTYPE_CODES[code][0]).newbyteorder("<")


def _dtype_code(name: str, dtype: np.dtype) -> tuple[int, np.dtype]:
    """The KDTR code of a numpy dtype and the little-endian dtype to write it as."""
    if _BFLOAT16 is not None and dtype == _BFLOAT16:
        return 11, _BFLOAT16
    code = _KIND_CODES.get((dtype.kind, dtype.itemsize))
    if code is None or dtype.fields is not None or dtype.subdtype is not None:
        raise ValueError(
            f"array {name!r}: dtype {dtype} cannot be stored in KDTR (supported: bool, "
            "int8..int64, uint8..uint64, float16, bfloat16, float32, float64)"
        )
    return code, dtype.newbyteorder("<")


def _check_name(name: object) -> bytes:
    if not isinstance(name, str):
        raise ValueError(f"array name {name!r} is not a str")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"array {name!r}: name is not valid UTF-8 ({exc.reason})") from None
    if not raw:
        raise ValueError("an array name is empty")
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"array {name[:48]!r}...: name is longer than {MAX_NAME_BYTES} bytes")
    if b"\x00" in raw:
        raise ValueError(f"array {name!r}: name contains a NUL character")
    return raw


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _plan(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[tuple[int, np.ndarray]]]:
    """Validates the arrays and returns (header + record table, [(data_offset, bytes view)])."""
    records = []
    for name, value in arrays.items():
        raw = _check_name(name)
        arr = np.asarray(value)
        code, le = _dtype_code(name, arr.dtype)
        if arr.ndim > MAX_NDIM:
            raise ValueError(f"array {name!r}: {arr.ndim} dimensions, at most {MAX_NDIM}")
        # np.ascontiguousarray would turn a 0-d array into 1-d; asarray(order="C") does not.
        arr = np.asarray(arr, dtype=le, order="C")
        flat = arr.reshape(-1).view(np.uint8)
        if code == 1:  # bool bytes are exactly 0 or 1 (spec section 4)
            flat = (flat != 0).view(np.uint8)
        records.append((raw, code, arr.shape, flat))
    if len({r[0] for r in records}) != len(records):
        raise ValueError("two array names are equal")  # unreachable for a Mapping[str, ...]

    table_size = sum(RECORD_FIXED + _align(len(r[0]), 8) + 8 * len(r[2]) for r in records)
    table_end = HEADER_SIZE + table_size
    end = table_end
    parts = []
    placed = []
    for raw, code, shape, flat in records:
        off = _align(end, ALIGN)
        nbytes = int(flat.nbytes)
        parts.append(_RECORD.pack(off, nbytes, len(raw), code, len(shape)))
        parts.append(raw + b"\x00" * (_align(len(raw), 8) - len(raw)))
        parts.append(struct.pack(f"<{len(shape)}q", *shape))
        placed.append((off, flat))
        end = off + nbytes
    header = _HEADER.pack(MAGIC, MAJOR, MINOR, HEADER_SIZE, end, len(records), table_size)
    head = header + b"".join(parts)
    assert len(head) == table_end
    return head, placed


def _write(out, arrays: Mapping[str, np.ndarray]) -> None:
    head, placed = _plan(arrays)
    out.write(head)
    pos = len(head)
    for off, flat in placed:
        out.write(b"\x00" * (off - pos))
        out.write(flat.data)
        pos = off + flat.nbytes


def dumps(arrays: Mapping[str, np.ndarray]) -> bytes:
    """The KDTR bytes (docs/kdtr-format.md) of ``arrays``, in the mapping's order.

    arrays: name (str, non-empty UTF-8 without NUL, at most 65535 bytes) -> array-like of a
    supported dtype (see the module docstring) with at most 32 dimensions; non-contiguous
    and big-endian inputs are converted. Raises ValueError naming the array otherwise.
    """
    out = io.BytesIO()
    _write(out, arrays)
    return out.getvalue()


def save(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes ``arrays`` to ``path`` as a KDTR file (docs/kdtr-format.md), replacing it.

    Every array is validated first (as in :func:`dumps`; ValueError naming the array).
    The data goes to a temporary file in the same folder, which is fsynced and renamed
    over ``path``, so a failed save never leaves a partial file there. Raises OSError.
    """
    _plan(arrays)  # validate before creating anything
    write_atomically(path, lambda out: _write(out, arrays))


def _fail(msg: str) -> KdtrFormatError:
    return KdtrFormatError(msg)


def _parse(read, size: int) -> list[tuple[str, int, tuple[int, ...], int, int]]:
    """Validates a whole file (spec section 6); returns [(name, code, shape, offset, nbytes)].

    ``read(offset, n)`` returns the ``n`` bytes at byte ``offset`` of the file (``size``
    bytes long). Only the header and the record table are read, the table in pieces that
    grow as its records are checked (at least 64 KiB, then doubling), so a table_size that
    the records do not back costs little more than the records.
    """
    if size < HEADER_SIZE:
        raise _fail(
            f"header at byte offset 0: the file is {size} bytes, shorter than the "
            f"{HEADER_SIZE}-byte KDTR header"
        )
    magic, major, minor, header_size, file_size, count, table_size = _HEADER.unpack_from(
        read(0, HEADER_SIZE), 0
    )
    if magic != MAGIC:
        raise _fail(
            "magic at byte offset 0: not a KDTR file (expected 4B 44 54 52 0D 0A 1A 0A, "
            f"found {magic.hex(' ').upper()})"
        )
    if major != MAJOR:
        raise KdtrUnsupportedError(
            f"major version at byte offset 8: version {major}.{minor} is not supported "
            f"(this reader knows major version {MAJOR})"
        )
    if header_size < HEADER_SIZE or header_size % 8 != 0 or header_size > size:
        raise _fail(
            f"header_size at byte offset 12: {header_size} must be a multiple of 8, at least "
            f"{HEADER_SIZE} and at most the file size ({size} bytes)"
        )
    if file_size != size:
        raise _fail(
            f"file_size at byte offset 16: the header records {file_size} bytes but the file "
            f"has {size} (truncated or extended)"
        )
    if table_size % 8 != 0 or table_size > size - header_size:
        raise _fail(
            f"table_size at byte offset 32: {table_size} must be a multiple of 8 and fit "
            f"between the header ({header_size} bytes) and the end of the file ({size} bytes)"
        )
    if count > table_size // MIN_RECORD:
        raise _fail(
            f"array_count at byte offset 24: {count} arrays cannot fit in a record table of "
            f"{table_size} bytes (each record is at least {MIN_RECORD} bytes)"
        )
    table_end = header_size + table_size
    table = bytearray()  # bytes header_size .. header_size + len(table) of the file

    def record(pos: int, n: int) -> bytes:
        """The n table bytes at byte offset pos (inside the table), reading more if needed."""
        want = pos + n - header_size
        if want > len(table):
            grow = min(table_size, max(want, 2 * len(table), 1 << 16))
            table.extend(read(header_size + len(table), grow - len(table)))
        return bytes(table[pos - header_size : pos - header_size + n])

    pos = header_size
    prev_end = table_end
    out = []
    for i in range(count):
        if table_end - pos < RECORD_FIXED:
            raise _fail(
                f"array {i}: record at byte offset {pos}: its {RECORD_FIXED} fixed bytes run "
                f"past the end of the record table (byte offset {table_end})"
            )
        data_offset, nbytes, name_len, code, ndim = _RECORD.unpack_from(record(pos, RECORD_FIXED))
        if name_len == 0 or name_len > MAX_NAME_BYTES:
            raise _fail(
                f"array {i}: name_len at byte offset {pos + 16}: {name_len} is outside "
                f"1..{MAX_NAME_BYTES}"
            )
        if ndim > MAX_NDIM:
            raise _fail(
                f"array {i}: ndim at byte offset {pos + 24}: {ndim} exceeds the maximum of "
                f"{MAX_NDIM}"
            )
        name_pad = _align(name_len, 8)
        rec_size = RECORD_FIXED + name_pad + 8 * ndim
        if rec_size > table_end - pos:
            raise _fail(
                f"array {i}: record at byte offset {pos}: its {rec_size} bytes (name_len "
                f"{name_len}, ndim {ndim}) run past the end of the record table (byte offset "
                f"{table_end})"
            )
        rec = record(pos, rec_size)
        raw = rec[32 : 32 + name_len]
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _fail(
                f"array {i}: name at byte offset {pos + 32}: not well-formed UTF-8 at byte "
                f"offset {pos + 32 + exc.start}"
            ) from None
        if "\x00" in name:
            raise _fail(
                f"array {i}: name at byte offset {pos + 32}: contains a NUL byte at byte "
                f"offset {pos + 32 + raw.index(0)}"
            )
        label = f"array {i} ('{name[:48]}{'...' if len(name) > 48 else ''}')"
        if code not in DTYPE_CODES:
            raise KdtrUnsupportedError(
                f"{label}: dtype at byte offset {pos + 20}: unknown dtype code {code}"
            )
        shape_at = pos + 32 + name_pad
        shape = struct.unpack_from(f"<{ndim}q", rec, 32 + name_pad)
        expected = DTYPE_CODES[code][1]
        zero = False
        for d, extent in enumerate(shape):
            at = shape_at + 8 * d
            if extent < 0:
                raise _fail(f"{label}: shape[{d}] at byte offset {at}: negative extent {extent}")
            if extent == 0:
                zero = True
            elif expected * extent > _I64_MAX:
                raise _fail(
                    f"{label}: shape[{d}] at byte offset {at}: shape product overflows (extent "
                    f"{extent} times {expected} exceeds 2^63 - 1 bytes)"
                )
            else:
                expected *= extent
        if zero:
            expected = 0
        if nbytes != expected:
            raise _fail(
                f"{label}: nbytes at byte offset {pos + 8}: {nbytes}, but dtype and shape give "
                f"{expected} bytes"
            )
        if data_offset % ALIGN != 0:
            raise _fail(
                f"{label}: data_offset at byte offset {pos}: {data_offset} is not a multiple "
                f"of {ALIGN}"
            )
        if data_offset < table_end:
            raise _fail(
                f"{label}: data_offset at byte offset {pos}: {data_offset} lies inside the "
                f"header or record table (which end at byte offset {table_end})"
            )
        if data_offset < prev_end:
            raise _fail(
                f"{label}: data_offset at byte offset {pos}: {data_offset} overlaps or precedes "
                f"the data of array {i - 1} (which ends at byte offset {prev_end})"
            )
        if data_offset > file_size or nbytes > file_size - data_offset:
            raise _fail(
                f"{label}: data_offset at byte offset {pos}: {nbytes} bytes at byte offset "
                f"{data_offset} run past the end of the file ({file_size} bytes)"
            )
        out.append((name, code, shape, data_offset, nbytes, pos + 32))
        prev_end = data_offset + nbytes
        pos += rec_size
    if pos != table_end:
        raise _fail(
            f"table_size at byte offset 32: the {count} records end at byte offset {pos}, but "
            f"the record table ends at byte offset {table_end}"
        )
    # Duplicates last, as in the C reader, which reports the same pair: the first array
    # whose name appeared before, and that earlier array.
    seen: dict[str, int] = {}
    for i, (name, _code, _shape, _off, _nbytes, name_at) in enumerate(out):
        if name in seen:
            raise _fail(
                f"array {i} ('{name[:48]}'): name at byte offset {name_at}: duplicates the name "
                f"of array {seen[name]}"
            )
        seen[name] = i
    return [r[:5] for r in out]


def _arrays(read, size: int, view: bytearray | None = None) -> dict[str, np.ndarray]:
    """The arrays of a validated file: views of ``view`` (the whole file) when given, else
    each array's bytes read with ``read(offset, n)`` into its own buffer."""
    result: dict[str, np.ndarray] = {}
    for name, code, shape, off, nbytes in _parse(read, size):
        dtype = _numpy_dtype(code)
        if nbytes == 0:
            result[name] = np.zeros(shape, dtype=dtype)
        else:
            count = nbytes // dtype.itemsize
            buf = view if view is not None else bytearray(read(off, nbytes))
            start = off if view is not None else 0
            result[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(shape)
    return result


def loads(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """Parses KDTR bytes (docs/kdtr-format.md) into ``{name: array}`` in file order.

    The whole input is validated (spec section 6) before any array is built. Arrays are
    writable little-endian numpy arrays (bool, intN, uintN, float16, ml_dtypes.bfloat16,
    float32, float64) with the stored shapes; non-empty ones are views of one private copy
    of ``data``. Raises KdtrFormatError (field and byte offset in the message) or
    KdtrUnsupportedError (unknown major version or dtype code).
    """
    buf = bytearray(data)
    mv = memoryview(buf)
    return _arrays(lambda off, n: mv[off : off + n], len(buf), buf)


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads the KDTR file at ``path`` (docs/kdtr-format.md) into ``{name: array}``.

    The header is checked against the file's size (``os.fstat``), the record table is read
    and validated as by :func:`loads`, and then only each array's bytes are read, into a
    buffer of its own: bytes the records do not point at (between arrays, after the last
    one) are never read, so a sparse or crafted file costs what its arrays hold. Raises
    OSError, KdtrFormatError or KdtrUnsupportedError.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{os.fspath(path)}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def read(offset: int, n: int) -> bytearray:
            buf = bytearray(n)
            f.seek(offset)
            got = f.readinto(buf)
            if got != n:
                raise OSError(
                    f"{os.fspath(path)}: read {got} of {n} bytes at byte offset {offset}"
                )
            return buf

        return _arrays(read, size)
