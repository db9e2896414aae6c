"""The memory guard: host outputs that would take more than ``SHARE`` of the memory this
process can still get are refused before numpy allocates them, with the sizes in the
message (a huge budget then fails at once, instead of the process being killed, or the
machine swapping, when the pages are touched)."""

from __future__ import annotations

import os

from . import checks

SHARE = 0.75  # of the memory available now (see available_bytes)
# Outputs below this size are not checked: reading /proc and the cgroup files costs more
# than such an allocation, and no machine this runs on has so little memory left.
UNCHECKED_BYTES = 64 * 2**20


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def available_bytes() -> int | None:
    """The memory this process can still get, in bytes: the smallest of the kernel's
    ``MemAvailable`` (/proc/meminfo), the room left under its cgroup's limit (v2
    ``memory.max`` - ``memory.current``, or v1 ``memory.limit_in_bytes`` -
    ``memory.usage_in_bytes``) and the room under ``RLIMIT_AS`` (the limit less the
    address space in use, /proc/self/statm); physical memory where none of these can
    be read; None if nothing is known."""
    limits = []
    meminfo = _read("/proc/meminfo")
    if meminfo:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit and limit.strip().isdigit():
            used = int(usage.strip()) if usage and usage.strip().isdigit() else 0
            limits.append(max(int(limit.strip()) - used, 0))
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:  # the room left under it: less the address space in use
            statm = _read("/proc/self/statm")
            used = int(statm.split()[0]) * os.sysconf("SC_PAGE_SIZE") if statm else 0
            limits.append(max(int(soft) - used, 0))
    except (ImportError, ValueError, OSError):
        pass
    if not limits:
        try:
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            pass
    return min(limits) if limits else None


def bytes_text(n: float) -> str:
    """n bytes as '1.5 GiB' (KiB .. EiB)."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024:
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


def outputs_fit(nbytes: int, what: str, hint: str = "") -> None:
    """Raises KdtreeMemoryError (a MemoryError, status KDT_ERR_OUT_OF_MEMORY) when `nbytes`
    of outputs (`what`, for the message) exceed SHARE of :func:`available_bytes`. Sizes
    under UNCHECKED_BYTES pass without reading the system's figures."""
    if nbytes < UNCHECKED_BYTES:
        return
    available = available_bytes()
    if available is not None and nbytes > SHARE * available:
        raise checks.memory_error(
            f"{what} need {bytes_text(nbytes)}, more than {SHARE:.0%} of the {bytes_text(available)} of memory "
            f"this process can get now{hint}")


def tree_outputs_fit(batch: int, budget: int, words: int) -> None:
    """:func:`outputs_fit` for the arrays of `batch` trees of `budget` nodes."""
    rows = budget + 1
    dense = batch * rows * rows  # visibility, bool [B, N+1, N+1]
    total = dense + batch * rows * (4 * words + 36) + 4 * batch  # + bits and the per-node arrays
    outputs_fit(total, f"budget {budget}: the trees of {batch} request(s) (the dense visibility mask "
                       f"[B, N+1, N+1] alone {bytes_text(dense)})",
                "; use a smaller budget or batch (the C API builds without the dense mask when its pointer is NULL)")
