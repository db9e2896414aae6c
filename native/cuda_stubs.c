/* The CUDA entry points of a build without CUDA: each says so (and ignores its arguments). */
#include "internal.h"
#include "kdt_testing.h"

#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif

static kdt_status no_cuda(const char* what) {
    return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: this libkdtree was built without CUDA (KDTREE_CUDA=OFF or no nvcc)",
                    what);
}

kdt_status kdt_cuda_device_count(int32_t* count) {
    if (count != NULL) *count = 0;
    return no_cuda("kdt_cuda_device_count");
}

kdt_status kdt_trees_build_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth, int64_t width,
                                                size_t* bytes) {
    return no_cuda("kdt_trees_build_cuda_workspace_bytes");
}

kdt_status kdt_trees_build_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status, void* workspace,
                                size_t workspace_bytes, void* stream) {
    return no_cuda("kdt_trees_build_cuda");
}

kdt_status kdt_topk_logprobs_cuda_workspace_bytes(int64_t rows, int64_t vocab, int64_t k, size_t* bytes) {
    return no_cuda("kdt_topk_logprobs_cuda_workspace_bytes");
}

kdt_status kdt_topk_logprobs_cuda(const kdt_logits* logits, int64_t k, float* out_logprobs, int32_t* out_ids,
                                  int32_t* row_status, void* workspace, size_t workspace_bytes, void* stream) {
    return no_cuda("kdt_topk_logprobs_cuda");
}

kdt_status kdt_trees_build_from_logits_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth,
                                                           int64_t vocab, int64_t width, size_t* bytes) {
    return no_cuda("kdt_trees_build_from_logits_cuda_workspace_bytes");
}

kdt_status kdt_trees_build_from_logits_cuda(const kdt_logits* logits, int64_t width, const int32_t* root_tokens,
                                           const int64_t* root_positions, const int32_t* request_budgets,
                                           const int32_t* request_depths, int32_t pad_token, kdt_trees* out,
                                           int32_t* request_status, void* workspace, size_t workspace_bytes,
                                           void* stream) {
    return no_cuda("kdt_trees_build_from_logits_cuda");
}

kdt_status kdt_tree_attention_mask_cuda(const kdt_trees* trees, const int64_t* prefix_lengths, int32_t kind,
                                        int64_t columns, void* mask, size_t mask_bytes, int32_t* mask_indptr,
                                        int64_t* positions, int32_t* request_status, void* stream) {
    return no_cuda("kdt_tree_attention_mask_cuda");
}

kdt_status kdt_verify_greedy_cuda(const kdt_trees* trees, const int32_t* target_tokens, const int32_t* stop_tokens,
                                  int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences, const int64_t* max_commit, int64_t path_capacity,
                                  int32_t* accepted_nodes, int32_t* accept_length, int32_t* bonus_token,
                                  int32_t* request_status, void* stream) {
    return no_cuda("kdt_verify_greedy_cuda");
}

kdt_status kdt_verify_greedy_from_logits_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                              const int32_t* stop_tokens, int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences,
                                              const int64_t* max_commit, int64_t path_capacity,
                                              int32_t* accepted_nodes, int32_t* accept_length, int32_t* bonus_token,
                                              int32_t* target_tokens, int32_t* request_status, void* stream) {
    return no_cuda("kdt_verify_greedy_from_logits_cuda");
}

kdt_status kdt_verify_sample_from_logits_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                              float temperature, uint64_t seed, uint64_t offset,
                                              const int32_t* stop_tokens, int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences,
                                              const int64_t* max_commit, int64_t path_capacity,
                                              int32_t* accepted_nodes, int32_t* accept_length, int32_t* bonus_token,
                                              int32_t* target_tokens, int32_t* request_status, void* stream) {
    return no_cuda("kdt_verify_sample_from_logits_cuda");
}

kdt_status kdt_verify_sample_batch_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                        const kdt_sampling* sampling, const int32_t* stop_tokens,
                                        int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences, const int64_t* max_commit, int64_t path_capacity,
                                        int32_t* accepted_nodes, int32_t* accept_length, int32_t* bonus_token,
                                        int32_t* target_tokens, int32_t* request_status, void* stream) {
    return no_cuda("kdt_verify_sample_batch_cuda");
}

kdt_status kdt_choices_shard_cuda(const kdt_logits* logits, int64_t vocab_offset, const kdt_sampling* sampling,
                                  const int32_t* nodes, double* out, void* stream) {
    return no_cuda("kdt_choices_shard_cuda");
}

kdt_status kdt_compact_kv_cuda(const kdt_kv_cache* cache, const int64_t* prefix_lengths, const int32_t* accepted_nodes,
                               const int32_t* accept_length, int64_t path_capacity, int32_t* request_status,
                               void* stream) {
    return no_cuda("kdt_compact_kv_cuda");
}

kdt_status kdt_compact_kv_paged_cuda(const kdt_paged_kv_cache* cache, const int64_t* prefix_lengths,
                                     const int32_t* accepted_nodes, const int32_t* accept_length,
                                     int64_t path_capacity, int32_t* request_status, void* stream) {
    return no_cuda("kdt_compact_kv_paged_cuda");
}

kdt_status kdt_testing_set_tree_paths(uint32_t paths) { return no_cuda("kdt_testing_set_tree_paths"); }

kdt_status kdt_testing_set_topk_chunked(int32_t on) { return no_cuda("kdt_testing_set_topk_chunked"); }

kdt_status kdt_testing_set_verify_cluster(int32_t blocks) { return no_cuda("kdt_testing_set_verify_cluster"); }
kdt_status kdt_testing_set_attention_warp_tiles(int32_t tiles) {
    (void)tiles;
    return no_cuda("kdt_testing_set_attention_warp_tiles");
}
kdt_status kdt_testing_set_attention_mma_sync(int32_t on) {
    (void)on;
    return no_cuda("kdt_testing_set_attention_mma_sync");
}
kdt_status kdt_testing_set_attention_sm90(int32_t variant) {
    (void)variant;
    return no_cuda("kdt_testing_set_attention_sm90");
}
kdt_status kdt_testing_set_topk_merge(int32_t variant) {
    (void)variant;
    return no_cuda("kdt_testing_set_topk_merge");
}

kdt_status kdt_tree_attention_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t q_heads, int64_t kv_heads,
                                                   int64_t head_dim, int64_t max_prefix, size_t* bytes) {
    return no_cuda("kdt_tree_attention_cuda_workspace_bytes");
}

kdt_status kdt_tree_attention_cuda(const kdt_trees* trees, const int64_t* prefix_lengths, int64_t max_prefix,
                                   const kdt_attention_rows* q, const kdt_attention_cache* cache, int32_t dtype,
                                   int64_t q_heads, int64_t head_dim, float softmax_scale, kdt_attention_rows* out,
                                   float* lse, int32_t* request_status, void* workspace, size_t workspace_bytes,
                                   void* stream) {
    return no_cuda("kdt_tree_attention_cuda");
}

kdt_status kdt_tree_attention_mla_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t q_heads,
                                                       int64_t max_prefix, size_t* bytes) {
    (void)batch;
    (void)budget;
    (void)q_heads;
    (void)max_prefix;
    (void)bytes;
    return no_cuda("kdt_tree_attention_mla_cuda_workspace_bytes");
}

kdt_status kdt_tree_attention_mla_cuda(const kdt_trees* trees, const int64_t* prefix_lengths, int64_t max_prefix,
                                       const kdt_attention_rows* q, const kdt_attention_cache* cache, int32_t dtype,
                                       int64_t q_heads, float softmax_scale, kdt_attention_rows* out, float* lse,
                                       int32_t* request_status, void* workspace, size_t workspace_bytes,
                                       void* stream) {
    return no_cuda("kdt_tree_attention_mla_cuda");
}

kdt_status kdt_trees_ragged_cuda(const kdt_trees* trees, kdt_trees_ragged* out, int32_t* request_status,
                                 void* stream) {
    return no_cuda("kdt_trees_ragged_cuda");
}

kdt_status kdt_topk_merge_cuda(const float* shard_logits, const int32_t* shard_ids, const float* shard_max,
                               const double* shard_sum_rest, int64_t shards, int64_t rows, int64_t k, int64_t vocab,
                               float* out_logprobs, int32_t* out_ids, int32_t* row_status, void* stream) {
    return no_cuda("kdt_topk_merge_cuda");
}

kdt_status kdt_topk_shard_stats_cuda(const kdt_logits* logits, float* out_max, double* out_rest, void* stream) {
    (void)logits;
    (void)out_max;
    (void)out_rest;
    (void)stream;
    return no_cuda("kdt_topk_shard_stats_cuda");
}
