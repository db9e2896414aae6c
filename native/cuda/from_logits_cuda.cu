// Draft trees straight from the drafter's logits: top-k log-probs into the workspace, then
// the tree builder on them, two launches on the caller's stream with no host round trip.
#include "common.cuh"

namespace {

inline size_t align256(size_t x) { return (x + 255u) / 256u * 256u; }

// Workspace layout: top-k log-probs float32 [B, L, K'], ids int32 [B, L, K'], row status
// int32 [B, L], the top-k call's workspace, the tree builder's workspace (each 256-byte
// aligned). K' = min(width, budget).
struct FromLogitsLayout {
    size_t logprobs, ids, row_status, topk, trees, total;
};

kdt_status layout_for(int64_t batch, int64_t budget, int64_t depth, int64_t vocab, int64_t width,
                      FromLogitsLayout* l) {
    if (batch < 0 || budget < 0 || depth < 0 || vocab < 0 || width < 0) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT,
                        "batch (%lld), budget (%lld), depth (%lld), vocab (%lld) and width (%lld) must be >= 0",
                        (long long)batch, (long long)budget, (long long)depth, (long long)vocab, (long long)width);
    }
    if (width > vocab || width > 1024) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "width %lld must be <= min(vocab %lld, 1024)", (long long)width,
                        (long long)vocab);
    }
    const int64_t kp = width < budget ? width : budget;
    size_t rows, cells, topk_bytes, tree_bytes;
    if (!kdt_mul_size((size_t)batch, (size_t)depth, &rows) || !kdt_mul_size(rows, (size_t)kp, &cells) ||
        cells > SIZE_MAX / 8) {
        return kdt_fail(KDT_ERR_OVERFLOW, "workspace for batch %lld, depth %lld overflows", (long long)batch,
                        (long long)depth);
    }
    kdt_status st = kdt_topk_logprobs_cuda_workspace_bytes((int64_t)rows, vocab, kp, &topk_bytes);
    if (st != KDT_OK) return st;
    st = kdt_trees_build_cuda_workspace_bytes(batch, budget, depth, kp, &tree_bytes);
    if (st != KDT_OK) return st;
    l->logprobs = 0;
    l->ids = align256(cells * sizeof(float));
    l->row_status = l->ids + align256(cells * sizeof(int32_t));
    l->topk = l->row_status + align256(rows * sizeof(int32_t));
    l->trees = l->topk + align256(topk_bytes);
    if (tree_bytes > SIZE_MAX - 256 - l->trees) return kdt_fail(KDT_ERR_OVERFLOW, "workspace size overflows");
    l->total = l->trees + align256(tree_bytes);
    return KDT_OK;
}

}  // namespace

extern "C" kdt_status kdt_trees_build_from_logits_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth,
                                                                      int64_t vocab, int64_t width, size_t* bytes) {
    if (bytes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "bytes is NULL");
    FromLogitsLayout l;
    const kdt_status st = layout_for(batch, budget, depth, vocab, width, &l);
    if (st != KDT_OK) return st;
    *bytes = l.total;
    return kdt_ok();
}

extern "C" kdt_status kdt_trees_build_from_logits_cuda(const kdt_logits* logits, int64_t width,
                                                       const int32_t* root_tokens, const int64_t* root_positions,
                                                       const int32_t* request_budgets, const int32_t* request_depths,
                                                       int32_t pad_token, kdt_trees* out, int32_t* request_status,
                                                       void* workspace, size_t workspace_bytes, void* stream) {
    kdt_status st = kdt::check_logits(logits, "logits", -1, -1);
    if (st != KDT_OK) return st;
    if (out == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out is NULL");
    const int64_t B = logits->batch, L = logits->length, N = out->budget;
    if (out->batch != B) {
        return kdt_fail(KDT_ERR_SHAPE, "out->batch (%lld) != logits->batch (%lld)", (long long)out->batch,
                        (long long)B);
    }
    if (N < 0 || N > (int64_t)INT32_MAX - 2) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "budget %lld is outside [0, %d]", (long long)N, INT32_MAX - 2);
    }
    if (B > INT32_MAX) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "batch %lld exceeds %d", (long long)B, INT32_MAX);
    if (L > INT32_MAX - 1) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "depth %lld exceeds %d", (long long)L, INT32_MAX - 1);
    if (B == 0) return kdt_ok();  // nothing to build (the workspace query says 0 bytes)
    // The tree builder's own host checks, before the top-k launch (nothing is enqueued
    // when an argument is wrong).
    if (out->num_nodes == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "out->num_nodes is NULL");
    if (request_status == NULL) return kdt_fail(KDT_ERR_NULL_POINTER, "request_status is NULL");
    if (out->visibility != NULL) {
        size_t vb;
        const kdt_status vst = kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY, &vb);
        if (vst != KDT_OK) return vst;
    }
    {
        const struct {
            const void* ptr;
            size_t align;
            const char* name;
        } aligned[] = {{root_tokens, 4, "root_tokens"}, {root_positions, 8, "root_positions"},
                       {out->num_nodes, 4, "out->num_nodes"}, {out->tokens, 4, "out->tokens"},
                       {out->depths, 4, "out->depths"}, {out->parents, 4, "out->parents"},
                       {out->logw, 8, "out->logw"}, {out->positions, 8, "out->positions"},
                       {out->visibility_bits, 4, "out->visibility_bits"}, {out->first_child, 4, "out->first_child"},
                       {out->next_sibling, 4, "out->next_sibling"}, {request_status, 4, "request_status"}};
        for (const auto& a : aligned) {
            const kdt_status ast = kdt::check_aligned(a.ptr, a.align, a.name);
            if (ast != KDT_OK) return ast;
        }
    }
    // An empty logits tensor may leave vocab at 0; the builder then has nothing to check.
    const int64_t vocab = logits->vocab;
    if (width < 0 || (B * L > 0 && (width > vocab || width > 1024))) {
        return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "width %lld must be in [0, min(vocab %lld, 1024)]",
                        (long long)width, (long long)vocab);
    }
    const int64_t kp = width < N ? width : N;
    FromLogitsLayout l;
    st = layout_for(B, N, L, B * L > 0 ? vocab : width, width, &l);
    if (st != KDT_OK) return st;
    if (workspace == NULL || workspace_bytes < l.total) {
        return kdt_fail(workspace == NULL ? KDT_ERR_NULL_POINTER : KDT_ERR_BUFFER_TOO_SMALL,
                        "workspace has %zu bytes, %zu needed", workspace == NULL ? (size_t)0 : workspace_bytes,
                        l.total);
    }
    if (((uintptr_t)workspace & 255u) != 0) return kdt_fail(KDT_ERR_INVALID_ARGUMENT, "workspace must be 256-byte aligned");
    char* ws = static_cast<char*>(workspace);
    float* lp = reinterpret_cast<float*>(ws + l.logprobs);
    int32_t* ids = reinterpret_cast<int32_t*>(ws + l.ids);
    int32_t* row_status = reinterpret_cast<int32_t*>(ws + l.row_status);
    if (kp > 0 && B * L > 0) {
        size_t topk_bytes = l.trees - l.topk;
        st = kdt_topk_logprobs_cuda(logits, kp, lp, ids, row_status, ws + l.topk, topk_bytes, stream);
        if (st != KDT_OK) return st;
    }
    kdt_draft d;
    d.batch = B;
    d.depth = L;
    d.width = kp;
    d.logprobs = lp;
    d.token_ids = ids;
    d.root_tokens = root_tokens;
    d.root_positions = root_positions;
    d.vocab_size = B * L > 0 ? vocab : 0;
    d.pad_token = pad_token;
    d.request_budgets = request_budgets;
    d.request_depths = request_depths;
    // The top-k's ids are distinct in every row (a flagged row's are 0 .. k'-1), so the
    // builder need not look for repeats. KDT_TESTING_TREES_CHECK_IDS keeps the check (for
    // an A/B; the trees are the same either way).
    const bool check_ids = (kdt::testing_tree_paths() & KDT_TESTING_TREES_CHECK_IDS) != 0;
    return kdt::build_trees_cuda(&d, out, request_status, ws + l.trees, l.total - l.trees, stream, !check_ids);
}
