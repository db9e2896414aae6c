"""Loads libkdtree.so through ctypes and declares every C symbol once.

Search order: the ``KDTREE_LIBRARY`` environment variable (a file path), then the library
inside this package's folder (where ``pip install`` puts it), then the CMake build folder
of this checkout (``<repo>/build``). The ABI
version is checked before any other symbol is declared. Every function returning a
``kdt_status`` gets one ``errcheck`` that raises :class:`KdtreeError` with the library's
``kdt_last_error()`` text.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

ABI_VERSION = 2  # KDT_ABI_VERSION in include/kdtree.h

_NAMES = {"linux": "libkdtree.so", "darwin": "libkdtree.dylib", "win32": "kdtree.dll"}
LIBRARY_NAME = _NAMES.get(sys.platform, "libkdtree.so")

# kdt_status values (include/kdtree.h); tests/test_bindings.py compares them with the .so.
STATUS_NAMES = {
    0: "KDT_OK",
    1: "KDT_ERR_INVALID_ARGUMENT",
    2: "KDT_ERR_NULL_POINTER",
    3: "KDT_ERR_SHAPE",
    4: "KDT_ERR_VALUE",
    5: "KDT_ERR_OUT_OF_RANGE",
    6: "KDT_ERR_OVERFLOW",
    7: "KDT_ERR_OUT_OF_MEMORY",
    8: "KDT_ERR_IO",
    9: "KDT_ERR_FORMAT",
    10: "KDT_ERR_UNSUPPORTED",
    11: "KDT_ERR_NOT_FOUND",
    12: "KDT_ERR_BUFFER_TOO_SMALL",
    13: "KDT_ERR_NO_DEVICE",
    14: "KDT_ERR_CUDA",
    15: "KDT_ERR_INTERNAL",
}


STATUS = {name: value for value, name in STATUS_NAMES.items()}  # "KDT_ERR_SHAPE" -> 3

# kdt_dtype, kdt_mask_kind and kdt_trees_field values (include/kdtree.h); the bindings
# tests compare them with the header's enums.
DTYPE_CODES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7,
               "uint32": 8, "uint64": 9, "float16": 10, "bfloat16": 11, "float32": 12, "float64": 13}
MASK_CODES = {"bool": 0, "bits": 1, "additive_f32": 2, "additive_f16": 3, "additive_bf16": 4,
              "flashinfer": 5}
FIELD_CODES = {"num_nodes": 0, "tokens": 1, "depths": 2, "parents": 3, "logw": 4, "positions": 5,
               "visibility": 6, "visibility_bits": 7, "first_child": 8, "next_sibling": 9}


class KdtreeError(ValueError):
    """Every check of kdtree raises this (a ``ValueError``), whether it ran in Python, in
    C or on the GPU. ``status`` is the kdt_status value (include/kdtree.h), ``status_name``
    its enum name, ``function`` the C entry point that failed ("" for a check made in
    Python), and the message names what and where ("request 3, depth 2, rank 5: NaN
    log-probability"); for C calls it is the library's ``kdt_last_error()`` text."""

    def __init__(self, status: int, message: str, function: str = ""):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, f"status {self.status}")
        self.function = function
        self.detail = message
        where = f"{function}: " if function else ""
        super().__init__(f"{where}{self.status_name}: {message}")

    def __reduce__(self):
        return (type(self), (self.status, self.detail, self.function))


class KdtreeTypeError(KdtreeError, TypeError):
    """An argument of the wrong type or dtype (status KDT_ERR_INVALID_ARGUMENT); also a
    ``TypeError``."""

    def __init__(self, message: str, function: str = "", status: int = 1):
        super().__init__(status, message, function)

    def __reduce__(self):
        return (type(self), (self.detail, self.function, self.status))


class KdtreeMemoryError(KdtreeError, MemoryError):
    """Outputs that would not fit in the memory this process may use, refused before
    anything is allocated (status KDT_ERR_OUT_OF_MEMORY); also a ``MemoryError``."""

    def __init__(self, message: str, function: str = ""):
        super().__init__(7, message, function)

    def __reduce__(self):
        return (type(self), (self.detail, self.function))


def name_logits_row(exc: KdtreeError, batch_shape: tuple) -> KdtreeError:
    """The top-k kernels number the rows of the logits flattened to [rows, V]; for
    [B, L, V] logits the message names request and position too ("request 1, position 3
    (logits[1, 3], row 7)"), for more leading axes the index ("logits[1, 0, 2], row 5").
    Same type, status and function; `exc` itself when there is nothing to rename."""
    text = str(exc)
    found = re.search(r"\brow (\d+)", text)
    if found is None or len(batch_shape) < 2:
        return exc
    row = int(found.group(1))
    idx, rest = [], row
    for extent in reversed(batch_shape):
        idx.append(rest % extent)
        rest //= extent
    idx.reverse()
    where = f"logits[{', '.join(map(str, idx))}], row {row}"
    where = f"request {idx[0]}, position {idx[1]} ({where})" if len(batch_shape) == 2 else where
    message = text.split(f"{exc.status_name}: ", 1)[-1]
    if message == text and exc.function and text.startswith(f"{exc.function}: "):
        message = text[len(exc.function) + 2:]
    return KdtreeError(exc.status, message.replace(found.group(0), where, 1), exc.function)


class LibraryNotFoundError(ImportError):
    """libkdtree could not be loaded; the message lists every path tried."""


# ---- ctypes mirrors of the ABI structs (include/kdtree.h) ------------------------------

c_int32_p = ctypes.POINTER(ctypes.c_int32)
c_int64_p = ctypes.POINTER(ctypes.c_int64)


class KdtTrees(ctypes.Structure):
    """struct kdt_trees."""

    _fields_ = [
        ("batch", ctypes.c_int64),
        ("budget", ctypes.c_int64),
        ("num_nodes", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("depths", ctypes.c_void_p),
        ("parents", ctypes.c_void_p),
        ("logw", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("visibility", ctypes.c_void_p),
        ("visibility_bits", ctypes.c_void_p),
        ("first_child", ctypes.c_void_p),
        ("next_sibling", ctypes.c_void_p),
    ]


class KdtTreesRagged(ctypes.Structure):
    """struct kdt_trees_ragged."""

    _fields_ = [
        ("capacity", ctypes.c_int64),
        ("cu_rows", ctypes.c_void_p),
        ("row_request", ctypes.c_void_p),
        ("row_node", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("depths", ctypes.c_void_p),
        ("parents", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("visibility_bits", ctypes.c_void_p),
    ]


class KdtStopSequences(ctypes.Structure):
    """struct kdt_stop_sequences."""

    _fields_ = [
        ("tokens", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("count", ctypes.c_int64),
        ("history", ctypes.c_void_p),
        ("history_length", ctypes.c_int64),
    ]


class KdtDraft(ctypes.Structure):
    """struct kdt_draft."""

    _fields_ = [
        ("batch", ctypes.c_int64),
        ("depth", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("logprobs", ctypes.c_void_p),
        ("token_ids", ctypes.c_void_p),
        ("root_tokens", ctypes.c_void_p),
        ("root_positions", ctypes.c_void_p),
        ("vocab_size", ctypes.c_int64),
        ("pad_token", ctypes.c_int32),
        ("request_budgets", ctypes.c_void_p),
        ("request_depths", ctypes.c_void_p),
    ]


class KdtLogits(ctypes.Structure):
    """struct kdt_logits."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("batch", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("batch_stride", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
    ]


class KdtSampling(ctypes.Structure):
    """struct kdt_sampling."""

    _fields_ = [
        ("temperature", ctypes.c_void_p),
        ("top_p", ctypes.c_void_p),
        ("top_k", ctypes.c_void_p),
        ("seed", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
    ]


class KdtKvCache(ctypes.Structure):
    """struct kdt_kv_cache."""

    _fields_ = [
        ("k_layers", ctypes.c_void_p),
        ("v_layers", ctypes.c_void_p),
        ("num_layers", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("batch", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("seq_capacity", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("batch_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("seq_stride", ctypes.c_int64),
    ]


class KdtPagedKvCache(ctypes.Structure):
    """struct kdt_paged_kv_cache."""

    _fields_ = [
        ("k_layers", ctypes.c_void_p),
        ("v_layers", ctypes.c_void_p),
        ("num_layers", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("batch", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("pages", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("page_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("block_table", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int64),
    ]


class KdtAttentionRows(ctypes.Structure):
    """struct kdt_attention_rows."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("batch_stride", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


class KdtAttentionCache(ctypes.Structure):
    """struct kdt_attention_cache."""

    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("kv_heads", ctypes.c_int64),
        ("outer_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
        ("block_table", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
    ]


class KdtKdtrArray(ctypes.Structure):
    """struct kdt_kdtr_array."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", c_int64_p),
        ("data", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
    ]


_vp = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_sz = ctypes.c_size_t
_f32 = ctypes.c_float
_u64 = ctypes.c_uint64
_logits_p = ctypes.POINTER(KdtLogits)
_trees_p = ctypes.POINTER(KdtTrees)
_stops_p = ctypes.POINTER(KdtStopSequences)

# name -> (restype, argtypes); "status" marks a kdt_status return checked by errcheck.
# Each line mirrors the C prototype in include/kdtree.h.
SIGNATURES: dict[str, tuple[object, list]] = {
    # const char* kdt_status_string(int32_t status)
    "kdt_status_string": (ctypes.c_char_p, [_i32]),
    # const char* kdt_last_error(void)
    "kdt_last_error": (ctypes.c_char_p, []),
    # const char* kdt_version(void)
    "kdt_version": (ctypes.c_char_p, []),
    # int32_t kdt_abi_version(void)
    "kdt_abi_version": (_i32, []),
    # kdt_status kdt_trees_field_bytes(int64_t batch, int64_t budget, int32_t field, size_t* bytes)
    "kdt_trees_field_bytes": ("status", [_i64, _i64, _i32, ctypes.POINTER(_sz)]),
    # kdt_status kdt_visibility_words(int64_t budget, int64_t* words)
    "kdt_visibility_words": ("status", [_i64, c_int64_p]),
    # kdt_status kdt_trees_build_workspace_bytes(int64_t budget, int64_t depth, int64_t width,
    #                                            int64_t vocab_size, size_t* bytes)
    "kdt_trees_build_workspace_bytes": ("status", [_i64, _i64, _i64, _i64, ctypes.POINTER(_sz)]),
    # kdt_status kdt_trees_build_cpu(const kdt_draft* draft, kdt_trees* out, void* workspace,
    #                                size_t workspace_bytes)
    "kdt_trees_build_cpu": (
        "status",
        [ctypes.POINTER(KdtDraft), ctypes.POINTER(KdtTrees), _vp, _sz],
    ),
    # kdt_status kdt_verify_greedy_cpu(const kdt_trees* trees, const int32_t* target_tokens,
    #     const int32_t* stop_tokens, int64_t num_stop_tokens,
    #     const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
    #     int64_t path_capacity, int32_t* accepted_nodes, int32_t* accept_length,
    #     int32_t* bonus_token)
    "kdt_verify_greedy_cpu": (
        "status",
        [ctypes.POINTER(KdtTrees), _vp, _vp, _i64, ctypes.POINTER(KdtStopSequences), _vp, _i64, _vp, _vp, _vp],
    ),
    # kdt_status kdt_trees_ragged_cpu(const kdt_trees* trees, kdt_trees_ragged* out)
    "kdt_trees_ragged_cpu": ("status", [ctypes.POINTER(KdtTrees), ctypes.POINTER(KdtTreesRagged)]),
    # kdt_status kdt_topk_logprobs_cpu(const float* logits, int64_t rows, int64_t vocab,
    #     int64_t row_stride, int64_t k, float* out_logprobs, int32_t* out_ids)
    "kdt_topk_logprobs_cpu": ("status", [_vp, _i64, _i64, _i64, _i64, _vp, _vp]),
    # kdt_status kdt_topk_shard_cpu(const float* logits, int64_t rows, int64_t shard_vocab,
    #     int64_t row_stride, int64_t vocab_offset, int64_t k, float* out_logits,
    #     int32_t* out_ids, float* out_max, double* out_sum_rest)
    "kdt_topk_shard_cpu": ("status", [_vp, _i64, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _vp]),
    # kdt_status kdt_topk_merge_cpu(const float* shard_logits, const int32_t* shard_ids,
    #     const float* shard_max, const double* shard_sum_rest, int64_t shards, int64_t rows,
    #     int64_t k, int64_t vocab, float* out_logprobs, int32_t* out_ids)
    "kdt_topk_merge_cpu": ("status", [_vp, _vp, _vp, _vp, _i64, _i64, _i64, _i64, _vp, _vp]),
    # kdt_status kdt_cuda_device_count(int32_t* count)
    "kdt_cuda_device_count": ("status", [ctypes.POINTER(_i32)]),
    # kdt_status kdt_trees_build_cuda_workspace_bytes(int64_t batch, int64_t budget,
    #                                                 int64_t depth, int64_t width, size_t* bytes)
    "kdt_trees_build_cuda_workspace_bytes": ("status", [_i64, _i64, _i64, _i64, ctypes.POINTER(_sz)]),
    # kdt_status kdt_trees_build_cuda(const kdt_draft* draft, kdt_trees* out,
    #     int32_t* request_status, void* workspace, size_t workspace_bytes, void* stream)
    "kdt_trees_build_cuda": (
        "status",
        [ctypes.POINTER(KdtDraft), ctypes.POINTER(KdtTrees), _vp, _vp, _sz, _vp],
    ),
    # kdt_status kdt_topk_logprobs_cuda_workspace_bytes(int64_t rows, int64_t vocab, int64_t k,
    #                                                   size_t* bytes)
    "kdt_topk_logprobs_cuda_workspace_bytes": ("status", [_i64, _i64, _i64, ctypes.POINTER(_sz)]),
    # kdt_status kdt_topk_logprobs_cuda(const kdt_logits* logits, int64_t k, float* out_logprobs,
    #     int32_t* out_ids, int32_t* row_status, void* workspace, size_t workspace_bytes,
    #     void* stream)
    "kdt_topk_logprobs_cuda": ("status", [_logits_p, _i64, _vp, _vp, _vp, _vp, _sz, _vp]),
    # kdt_status kdt_trees_build_from_logits_cuda_workspace_bytes(int64_t batch, int64_t budget,
    #     int64_t depth, int64_t vocab, int64_t width, size_t* bytes)
    "kdt_trees_build_from_logits_cuda_workspace_bytes": (
        "status", [_i64, _i64, _i64, _i64, _i64, ctypes.POINTER(_sz)]),
    # kdt_status kdt_trees_build_from_logits_cuda(const kdt_logits* logits, int64_t width,
    #     const int32_t* root_tokens, const int64_t* root_positions,
    #     const int32_t* request_budgets, const int32_t* request_depths, int32_t pad_token,
    #     kdt_trees* out, int32_t* request_status, void* workspace, size_t workspace_bytes,
    #     void* stream)
    "kdt_trees_build_from_logits_cuda": (
        "status", [_logits_p, _i64, _vp, _vp, _vp, _vp, _i32, _trees_p, _vp, _vp, _sz, _vp]),
    # kdt_status kdt_tree_attention_mask_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
    #     int32_t kind, int64_t columns, void* mask, size_t mask_bytes, int32_t* mask_indptr,
    #     int64_t* positions, int32_t* request_status, void* stream)
    "kdt_tree_attention_mask_cuda": ("status", [_trees_p, _vp, _i32, _i64, _vp, _sz, _vp, _vp, _vp, _vp]),
    # kdt_status kdt_topk_merge_cuda(const float* shard_logits, const int32_t* shard_ids,
    #     const float* shard_max, const double* shard_sum_rest, int64_t shards, int64_t rows,
    #     int64_t k, int64_t vocab, float* out_logprobs, int32_t* out_ids, int32_t* row_status,
    #     void* stream)
    "kdt_topk_merge_cuda": ("status", [_vp, _vp, _vp, _vp, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _vp]),
    # kdt_status kdt_topk_shard_stats_cuda(const kdt_logits* logits, float* out_max, double* out_rest,
    #                                      void* stream)
    "kdt_topk_shard_stats_cuda": ("status", [_logits_p, _vp, _vp, _vp]),
    # kdt_status kdt_trees_ragged_cuda(const kdt_trees* trees, kdt_trees_ragged* out,
    #     int32_t* request_status, void* stream)
    "kdt_trees_ragged_cuda": ("status", [_trees_p, ctypes.POINTER(KdtTreesRagged), _vp, _vp]),
    # kdt_status kdt_verify_greedy_cuda(const kdt_trees* trees, const int32_t* target_tokens,
    #     const int32_t* stop_tokens, int64_t num_stop_tokens,
    #     const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
    #     int64_t path_capacity, int32_t* accepted_nodes, int32_t* accept_length,
    #     int32_t* bonus_token, int32_t* request_status, void* stream)
    "kdt_verify_greedy_cuda": ("status", [_trees_p, _vp, _vp, _i64, _stops_p, _vp, _i64, _vp, _vp, _vp, _vp, _vp]),
    # kdt_status kdt_verify_greedy_from_logits_cuda(const kdt_trees* trees,
    #     const kdt_logits* target_logits, const int32_t* stop_tokens, int64_t num_stop_tokens,
    #     const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
    #     int64_t path_capacity, int32_t* accepted_nodes, int32_t* accept_length,
    #     int32_t* bonus_token, int32_t* target_tokens, int32_t* request_status, void* stream)
    "kdt_verify_greedy_from_logits_cuda": (
        "status", [_trees_p, _logits_p, _vp, _i64, _stops_p, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp]),
    # kdt_status kdt_verify_sample_from_logits_cuda(const kdt_trees* trees,
    #     const kdt_logits* target_logits, float temperature, uint64_t seed, uint64_t offset,
    #     const int32_t* stop_tokens, int64_t num_stop_tokens,
    #     const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
    #     int64_t path_capacity, int32_t* accepted_nodes, int32_t* accept_length,
    #     int32_t* bonus_token, int32_t* target_tokens, int32_t* request_status, void* stream)
    "kdt_verify_sample_from_logits_cuda": (
        "status", [_trees_p, _logits_p, _f32, _u64, _u64, _vp, _i64, _stops_p, _vp, _i64, _vp, _vp, _vp, _vp, _vp,
                   _vp]),
    # kdt_status kdt_verify_sample_batch_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
    #     const kdt_sampling* sampling, const int32_t* stop_tokens, int64_t num_stop_tokens,
    #     const kdt_stop_sequences* stop_sequences, const int64_t* max_commit,
    #     int64_t path_capacity, int32_t* accepted_nodes, int32_t* accept_length,
    #     int32_t* bonus_token, int32_t* target_tokens, int32_t* request_status, void* stream)
    "kdt_verify_sample_batch_cuda": (
        "status", [_trees_p, _logits_p, ctypes.POINTER(KdtSampling), _vp, _i64, _stops_p, _vp, _i64, _vp, _vp, _vp,
                   _vp, _vp, _vp]),
    # kdt_status kdt_choices_shard_cuda(const kdt_logits* logits, int64_t vocab_offset,
    #     const kdt_sampling* sampling, const int32_t* nodes, double* out, void* stream)
    "kdt_choices_shard_cuda": ("status", [_logits_p, _i64, ctypes.POINTER(KdtSampling), _vp, _vp, _vp]),
    # kdt_status kdt_compact_kv_cuda(const kdt_kv_cache* cache, const int64_t* prefix_lengths,
    #     const int32_t* accepted_nodes, const int32_t* accept_length, int64_t path_capacity,
    #     int32_t* request_status, void* stream)
    "kdt_compact_kv_cuda": ("status", [ctypes.POINTER(KdtKvCache), _vp, _vp, _vp, _i64, _vp, _vp]),
    # kdt_status kdt_compact_kv_paged_cuda(const kdt_paged_kv_cache* cache, const int64_t* prefix_lengths,
    #     const int32_t* accepted_nodes, const int32_t* accept_length, int64_t path_capacity,
    #     int32_t* request_status, void* stream)
    "kdt_compact_kv_paged_cuda": ("status", [ctypes.POINTER(KdtPagedKvCache), _vp, _vp, _vp, _i64, _vp, _vp]),
    # kdt_status kdt_tree_attention_cuda_workspace_bytes(int64_t batch, int64_t budget,
    #     int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_prefix, size_t* bytes)
    "kdt_tree_attention_cuda_workspace_bytes": ("status", [_i64, _i64, _i64, _i64, _i64, _i64, ctypes.POINTER(_sz)]),
    # kdt_status kdt_tree_attention_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
    #     int64_t max_prefix, const kdt_attention_rows* q, const kdt_attention_cache* cache,
    #     int32_t dtype, int64_t q_heads, int64_t head_dim, float softmax_scale,
    #     kdt_attention_rows* out, float* lse, int32_t* request_status, void* workspace,
    #     size_t workspace_bytes, void* stream)
    "kdt_tree_attention_cuda": (
        "status", [_trees_p, _vp, _i64, ctypes.POINTER(KdtAttentionRows), ctypes.POINTER(KdtAttentionCache), _i32,
                   _i64, _i64, _f32, ctypes.POINTER(KdtAttentionRows), _vp, _vp, _vp, _sz, _vp]),
    # kdt_status kdt_tree_attention_mla_cuda_workspace_bytes(int64_t batch, int64_t budget,
    #     int64_t q_heads, int64_t max_prefix, size_t* bytes)
    "kdt_tree_attention_mla_cuda_workspace_bytes": ("status", [_i64, _i64, _i64, _i64, ctypes.POINTER(_sz)]),
    # kdt_status kdt_tree_attention_mla_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
    #     int64_t max_prefix, const kdt_attention_rows* q, const kdt_attention_cache* cache,
    #     int32_t dtype, int64_t q_heads, float softmax_scale, kdt_attention_rows* out, float* lse,
    #     int32_t* request_status, void* workspace, size_t workspace_bytes, void* stream)
    "kdt_tree_attention_mla_cuda": (
        "status", [_trees_p, _vp, _i64, ctypes.POINTER(KdtAttentionRows), ctypes.POINTER(KdtAttentionCache), _i32,
                   _i64, _f32, ctypes.POINTER(KdtAttentionRows), _vp, _vp, _vp, _sz, _vp]),
    # kdt_status kdt_dtype_size(int32_t dtype, size_t* bytes)
    "kdt_dtype_size": ("status", [_i32, ctypes.POINTER(_sz)]),
    # kdt_status kdt_kdtr_open(const char* path, kdt_kdtr_file** out)
    "kdt_kdtr_open": ("status", [ctypes.c_char_p, ctypes.POINTER(_vp)]),
    # kdt_status kdt_kdtr_open_memory(const void* data, size_t size, kdt_kdtr_file** out)
    "kdt_kdtr_open_memory": ("status", [_vp, _sz, ctypes.POINTER(_vp)]),
    # void kdt_kdtr_close(kdt_kdtr_file* file)
    "kdt_kdtr_close": (None, [_vp]),
    # kdt_status kdt_kdtr_count(const kdt_kdtr_file* file, int64_t* count)
    "kdt_kdtr_count": ("status", [_vp, c_int64_p]),
    # kdt_status kdt_kdtr_get(const kdt_kdtr_file* file, int64_t index, kdt_kdtr_array* out)
    "kdt_kdtr_get": ("status", [_vp, _i64, ctypes.POINTER(KdtKdtrArray)]),
    # kdt_status kdt_kdtr_find(const kdt_kdtr_file* file, const char* name, kdt_kdtr_array* out)
    "kdt_kdtr_find": ("status", [_vp, ctypes.c_char_p, ctypes.POINTER(KdtKdtrArray)]),
    # kdt_status kdt_kdtr_save(const char* path, const kdt_kdtr_array* arrays, int64_t count)
    "kdt_kdtr_save": ("status", [ctypes.c_char_p, ctypes.POINTER(KdtKdtrArray), _i64]),
}


def candidate_paths() -> list[Path]:
    """Where the loader looks, in order: ``KDTREE_LIBRARY`` (a file path), the library
    installed inside the package (``pip install .``), then the CMake build folder of the
    checkout the package is used from (``<repo>/build``, with ``PYTHONPATH=python``)."""
    paths: list[Path] = []
    env = os.environ.get("KDTREE_LIBRARY")
    if env:
        paths.append(Path(env))
    package = Path(__file__).resolve().parents[1]  # the kdtree folder (python/kdtree in a checkout)
    paths.append(package / LIBRARY_NAME)  # an installed wheel's library
    paths.append(package.parents[1] / "build" / LIBRARY_NAME)  # this checkout's CMake build
    return paths


def _make_errcheck(lib: ctypes.CDLL):
    def errcheck(result, func, args):
        if result != 0:
            message = lib.kdt_last_error().decode("utf-8", "replace")
            raise KdtreeError(result, message, func.__name__)
        return result

    return errcheck


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if not hasattr(lib, "kdt_abi_version"):
        raise LibraryNotFoundError(f"{lib._name} is not libkdtree (no kdt_abi_version)")
    lib.kdt_abi_version.restype = ctypes.c_int32
    lib.kdt_abi_version.argtypes = []
    found = lib.kdt_abi_version()
    if found != ABI_VERSION:
        raise LibraryNotFoundError(
            f"libkdtree ABI version {found} does not match the Python package's {ABI_VERSION}; "
            "rebuild the library (nox -s build) or point KDTREE_LIBRARY at a matching one"
        )
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise LibraryNotFoundError(
            f"{lib._name} lacks symbols {missing}; it is older than this package: rebuild it"
        )
    errcheck = None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        if restype == "status":
            fn.restype = ctypes.c_int32
            if errcheck is None:
                lib.kdt_last_error.restype = ctypes.c_char_p
                lib.kdt_last_error.argtypes = []
                errcheck = _make_errcheck(lib)
            fn.errcheck = errcheck
        else:
            fn.restype = restype
    return lib


_LIB: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The loaded, fully declared library (loaded once). Raises LibraryNotFoundError
    listing every path tried, or on an ABI mismatch."""
    global _LIB
    if _LIB is not None:
        return _LIB
    tried = []
    explicit = bool(os.environ.get("KDTREE_LIBRARY"))
    for n, path in enumerate(candidate_paths()):
        try:
            if not path.is_file():
                raise OSError("not found" if not path.exists() else "not a file")
            _LIB = _declare(ctypes.CDLL(str(path)))
        except (OSError, LibraryNotFoundError) as exc:
            tried.append(f"{path} ({exc})")
            if explicit and n == 0:  # an explicit override must work: no silent fallback
                raise LibraryNotFoundError(
                    f"KDTREE_LIBRARY={path} cannot be used: {exc}") from exc
            continue
        _LIB._kdtree_path = str(path)  # type: ignore[attr-defined]
        return _LIB
    raise LibraryNotFoundError(
        "could not load libkdtree; build it with `nox -s build` (or cmake -S . -B build && "
        "cmake --build build) or set KDTREE_LIBRARY. Tried:\n  " + "\n  ".join(tried)
    )
