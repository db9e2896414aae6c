"""kdtree: the native core for DDTree speculative decoding.

Draft-tree construction, verification and top-k log-probs run in libkdtree (C, loaded
through ctypes on first use); :mod:`kdtree.reference` is the pure-Python parity oracle and
:mod:`kdtree.kdtr` reads and writes the KDTR array container. Both import without the
native library.

Source: Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", arXiv 2604.12989; the exact rule is the project's spec, ``ddtree-tree-build.md``.
"""

from ._lib import KdtreeError, LibraryNotFoundError
from ._types import Acceptance, TreeBatch
from .api import (
    build_trees,
    build_trees_from_logits,
    compact_kv,
    empty_trees,
    topk_logprobs,
    tree_attention_mask,
    verify_greedy,
    verify_greedy_from_logits,
    verify_sample_from_logits,
)

__version__ = "0.2.0"


def library_version() -> str:
    """Version string of the loaded libkdtree (loads it)."""
    from . import _lib

    return _lib.load().kdt_version().decode()


__all__ = [
    "Acceptance",
    "KdtreeError",
    "LibraryNotFoundError",
    "TreeBatch",
    "build_trees",
    "build_trees_from_logits",
    "compact_kv",
    "empty_trees",
    "library_version",
    "topk_logprobs",
    "tree_attention_mask",
    "verify_greedy",
    "verify_greedy_from_logits",
    "verify_sample_from_logits",
    "__version__",
]
