"""Atomic file replacement shared by the KDTR writer and the demo's count cache."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Calls ``write(f)`` on a new temporary file in ``path``'s folder, fsyncs it and renames
    it over ``path``. On any failure the temporary file is removed and ``path`` is left as
    it was. The file gets mode 0666 minus the umask, like an ordinary ``open``. Raises
    OSError (and whatever ``write`` raises)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    for _ in range(100):
        tmp = os.path.join(folder, f"{base}.tmp-{os.getpid()}-{os.urandom(6).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 random names taken
        raise OSError(f"{path}: cannot create a temporary file")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
