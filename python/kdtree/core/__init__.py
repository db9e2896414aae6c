"""The core API: draft trees, masks, verification, top-k and KV compaction over numpy
(host) or CUDA arrays, one validation pass in front of the host (libkdtree's C entry
points) and CUDA (its kernels) backends; plus the pure-Python reference and KDTR I/O.

Layering: :mod:`kdtree.apps` -> :mod:`kdtree.engine` -> :mod:`kdtree.core` -> the native
loader (``kdtree._native``). Nothing here imports the engine or the apps.
"""

from .._native import KdtreeError, KdtreeMemoryError, KdtreeTypeError, LibraryNotFoundError
from .api import (
    build_trees,
    build_trees_from_logits,
    compact_kv,
    empty_trees,
    topk_logprobs,
    tree_attention,
    tree_attention_mask,
    tree_attention_mla,
    verify_greedy,
    verify_greedy_from_logits,
    verify_sample_from_logits,
)
from .types import Acceptance, TopK, TreeBatch, TreeMask

__all__ = [
    "Acceptance",
    "KdtreeError",
    "KdtreeMemoryError",
    "KdtreeTypeError",
    "LibraryNotFoundError",
    "TopK",
    "TreeBatch",
    "TreeMask",
    "build_trees",
    "build_trees_from_logits",
    "compact_kv",
    "empty_trees",
    "topk_logprobs",
    "tree_attention",
    "tree_attention_mla",
    "tree_attention_mask",
    "verify_greedy",
    "verify_greedy_from_logits",
    "verify_sample_from_logits",
]
