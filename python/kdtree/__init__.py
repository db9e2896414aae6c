"""kdtree: the native core for DDTree speculative decoding.

Draft-tree construction, verification and top-k log-probs run in libkdtree (C, loaded
through ctypes on first use); :mod:`kdtree.reference` is the pure-Python parity oracle and
:mod:`kdtree.kdtr` reads and writes the KDTR array container. Both import without the
native library.

Source: Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", arXiv 2604.12989; the exact rule is the project's spec, ``ddtree-tree-build.md``.
"""

from ._native import KdtreeError, KdtreeMemoryError, KdtreeTypeError, LibraryNotFoundError
from .core.api import (
    build_trees,
    build_trees_from_logits,
    compact_kv,
    empty_trees,
    ragged_trees,
    stop_sequences,
    topk_logprobs,
    topk_merge,
    topk_shard,
    tree_attention,
    tree_attention_mask,
    tree_attention_mla,
    verify_greedy,
    verify_greedy_from_logits,
    verify_sample_from_logits,
)
from .core.types import Acceptance, RaggedTrees, StopSequences, TopK, TopKShard, TreeBatch, TreeMask

__version__ = "0.2.0"


def library_version() -> str:
    """Version string of the loaded libkdtree (loads it; LibraryNotFoundError if it cannot)."""
    from . import _native

    return _native.load().kdt_version().decode()


def library_path() -> str:
    """File the loaded libkdtree came from (loads it; LibraryNotFoundError if it cannot)."""
    from . import _native

    return str(_native.load()._kdtree_path)


def status_name(status) -> str:
    """The kdt_status name of a status code, as the status arrays of ``errors="status"``
    (``TreeBatch.request_status``, ``Acceptance.request_status``, ``TopK.row_status``...)
    and ``KdtreeError.status`` hold them: ``status_name(0) == "KDT_OK"``,
    ``status_name(4) == "KDT_ERR_VALUE"``; ``"status N"`` for a code this version does not
    define. Takes a Python or numpy integer, or a 0-d integer array or torch tensor (an
    element of a status array). Does not load the library.

    Raises:
        TypeError: not an integer (a float, a bool, an array of more than one element).
    """
    import operator

    import numpy as np

    from ._native import STATUS_NAMES

    if isinstance(status, np.ndarray) and status.ndim == 0:
        status = status[()]
    if (hasattr(status, "dim") and hasattr(status, "item") and status.dim() == 0
            and str(status.dtype) in ("torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.uint8")):
        status = int(status.item())  # a 0-d integer torch tensor (an element of a status array)
    if isinstance(status, (bool, np.bool_)) or not isinstance(status, (int, np.integer)):
        raise TypeError(f"status must be an integer status code, got {type(status).__name__} {status!r}")
    code = operator.index(status)
    return STATUS_NAMES.get(code, f"status {code}")


def status_code(name: str) -> int:
    """The code of a kdt_status name (``"KDT_ERR_VALUE"`` -> 4), e.g. to compare a status
    array against. Does not load the library.

    Raises:
        KeyError: a name kdtree does not define (the message lists the names).
    """
    from ._native import STATUS

    try:
        return STATUS[name]
    except (KeyError, TypeError):
        raise KeyError(f"{name!r} is not a kdt_status name; the names are {sorted(STATUS, key=STATUS.get)}") from None


def cuda_devices() -> int:
    """CUDA devices libkdtree can use: 0 where it was built without CUDA or finds no GPU
    or driver (loads the library)."""
    import ctypes

    from . import _native

    count = ctypes.c_int32(0)
    try:
        _native.load().kdt_cuda_device_count(ctypes.byref(count))
    except KdtreeError:
        return 0
    return int(count.value)


__all__ = [
    "Acceptance",
    "KdtreeError",
    "KdtreeMemoryError",
    "KdtreeTypeError",
    "LibraryNotFoundError",
    "RaggedTrees",
    "StopSequences",
    "TopK",
    "TopKShard",
    "TreeBatch",
    "TreeMask",
    "build_trees",
    "build_trees_from_logits",
    "compact_kv",
    "empty_trees",
    "cuda_devices",
    "library_path",
    "library_version",
    "status_code",
    "stop_sequences",
    "status_name",
    "ragged_trees",
    "topk_logprobs",
    "topk_merge",
    "topk_shard",
    "tree_attention",
    "tree_attention_mla",
    "tree_attention_mask",
    "verify_greedy",
    "verify_greedy_from_logits",
    "verify_sample_from_logits",
    "__version__",
]
