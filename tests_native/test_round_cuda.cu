// One whole DDTree round on the GPU, eager and captured in a CUDA graph: trees from the
// drafter's logits (top-k + build), the bit-packed tree attention mask with prefixes,
// greedy verification from the target's logits, and KV compaction. The graph is captured
// once and replayed on new inputs copied into the same buffers; every output of every
// replay must equal an eager run on the same inputs, and the eager acceptance must equal
// the CPU walk on the host argmax of the target logits (an independent check). Requests
// with a bad logits row (NaN) sit beside good ones. Exits 77 where there is no GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "kdtree.h"
#include "cuda_harness.h"



static int failures = 0;
#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                 \
            fprintf(stderr, "\n");                                        \
            if (++failures > 20) exit(1);                                 \
        }                                                                 \
    } while (0)

static uint64_t rng = 0x1234567887654321ull;
static uint64_t next_u64() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static float unit() { return (float)((next_u64() >> 40) * (1.0 / 16777216.0)); }

static uint16_t to_bf16(float x) {  // round to nearest even (no NaN inputs here but one)
    uint32_t u;
    memcpy(&u, &x, 4);
    if (x != x) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

struct Sizes {
    int64_t B = 6, L = 5, V = 40, N = 24, K = 6;
    int64_t H = 2, S = 64, D = 16, layers = 2, columns = 0, words = 0;
};

struct Device {
    uint16_t* draft;   // [B, L, V] bf16
    uint16_t* target;  // [B, N+1, V] bf16
    int32_t* roots;
    int64_t* prefix;
    kdt_trees trees;
    int32_t* tree_status;
    void* workspace;
    size_t workspace_bytes;
    uint32_t* mask;
    int64_t* positions;
    int32_t* mask_status;
    int32_t *accepted, *accept_length, *bonus, *chosen, *verify_status;
    uint16_t* kv[4];  // K0, K1, V0, V1 [B, H, S, D] half/bf16 bits
    void** k_table;
    void** v_table;
    int32_t* compact_status;
};

static void fill_inputs(const Sizes& z, std::vector<uint16_t>& draft, std::vector<uint16_t>& target, int trial) {
    draft.resize((size_t)(z.B * z.L * z.V));
    target.resize((size_t)(z.B * (z.N + 1) * z.V));
    for (size_t i = 0; i < draft.size(); i++) draft[i] = to_bf16(3.0f * unit());
    // peaked drafter: a hot token per row, so trees have long spines
    for (int64_t r = 0; r < z.B * z.L; r++) draft[(size_t)r * z.V + next_u64() % z.V] = to_bf16(12.0f);
    // target: favour a few tokens so walks often go deep
    for (size_t i = 0; i < target.size(); i++) target[i] = to_bf16(2.0f * unit());
    for (int64_t r = 0; r < z.B * (z.N + 1); r++) target[(size_t)r * z.V + next_u64() % 8] = to_bf16(9.0f);
    if (trial % 2 == 1) draft[(size_t)(2 * z.L + 1) * z.V + 3] = 0x7FC0;  // NaN in request 2
}

static void round_on(const Sizes& z, Device& d, cudaStream_t s) {
    kdt_logits draft = {d.draft, KDT_DTYPE_BFLOAT16, 0, z.B, z.L, z.V, z.L * z.V, z.V};
    KDT_OK_OR_DIE(kdt_trees_build_from_logits_cuda(&draft, z.K, d.roots, NULL, NULL, NULL, -1, &d.trees, d.tree_status,
                                                   d.workspace, d.workspace_bytes, s));
    const size_t mask_bytes = (size_t)(z.B * (z.N + 1) * z.words) * 4;
    KDT_OK_OR_DIE(kdt_tree_attention_mask_cuda(&d.trees, d.prefix, KDT_MASK_BITS, z.columns, d.mask, mask_bytes,
                                               NULL, d.positions, d.mask_status, s));
    kdt_logits target = {d.target, KDT_DTYPE_BFLOAT16, 0, z.B, z.N + 1, z.V, (z.N + 1) * z.V, z.V};
    KDT_OK_OR_DIE(kdt_verify_greedy_from_logits_cuda(&d.trees, &target, NULL, 0, NULL, NULL, z.L + 1, d.accepted,
                                                     d.accept_length, d.bonus, d.chosen, d.verify_status, s));
    kdt_kv_cache cache = {d.k_table, d.v_table, z.layers, KDT_DTYPE_BFLOAT16, 0, z.B, z.H, z.S, z.D,
                          z.H * z.S * z.D, z.S * z.D, z.D};
    KDT_OK_OR_DIE(kdt_compact_kv_cuda(&cache, d.prefix, d.accepted, d.accept_length, z.L + 1, d.compact_status, s));
}

template <typename T>
static std::vector<T> download(const T* p, size_t n) {
    std::vector<T> h(n);
    CUDA_OK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

// Every output of a round, as bytes, in a fixed order.
static std::vector<uint8_t> snapshot(const Sizes& z, const Device& d) {
    std::vector<uint8_t> all;
    auto add = [&](const void* p, size_t bytes) {
        std::vector<uint8_t> h(bytes);
        CUDA_OK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
        all.insert(all.end(), h.begin(), h.end());
    };
    const size_t rows = (size_t)(z.B * (z.N + 1));
    add(d.trees.num_nodes, (size_t)z.B * 4);
    add(d.trees.tokens, rows * 4);
    add(d.trees.parents, rows * 4);
    add(d.trees.logw, rows * 8);
    add(d.trees.visibility_bits, rows * (size_t)((z.N + 32) / 32) * 4);
    add(d.tree_status, (size_t)z.B * 4);
    add(d.mask, rows * (size_t)z.words * 4);
    add(d.positions, rows * 8);
    add(d.mask_status, (size_t)z.B * 4);
    add(d.accepted, (size_t)(z.B * (z.L + 1)) * 4);
    add(d.accept_length, (size_t)z.B * 4);
    add(d.bonus, (size_t)z.B * 4);
    add(d.chosen, rows * 4);
    add(d.verify_status, (size_t)z.B * 4);
    for (int i = 0; i < 4; i++) add(d.kv[i], (size_t)(z.B * z.H * z.S * z.D) * 2);
    add(d.compact_status, (size_t)z.B * 4);
    return all;
}

// The CPU walk on the host argmax of the target logits, against the GPU's acceptance.
static void check_against_cpu(const Sizes& z, const Device& d, const std::vector<uint16_t>& target) {
    const int64_t rows = z.N + 1;
    std::vector<int32_t> num_nodes = download(d.trees.num_nodes, (size_t)z.B);
    std::vector<int32_t> tokens = download(d.trees.tokens, (size_t)(z.B * rows));
    std::vector<int32_t> fc = download(d.trees.first_child, (size_t)(z.B * rows));
    std::vector<int32_t> ns = download(d.trees.next_sibling, (size_t)(z.B * rows));
    std::vector<int32_t> tstatus = download(d.tree_status, (size_t)z.B);
    std::vector<int32_t> argmax((size_t)(z.B * rows));
    for (int64_t r = 0; r < z.B * rows; r++) {
        int32_t best = 0;
        for (int64_t v = 1; v < z.V; v++) {
            if (from_bf16(target[(size_t)(r * z.V + v)]) > from_bf16(target[(size_t)(r * z.V + best)])) best = (int32_t)v;
        }
        argmax[(size_t)r] = best;
    }
    kdt_trees t = {};
    t.batch = z.B;
    t.budget = z.N;
    t.num_nodes = num_nodes.data();
    t.tokens = tokens.data();
    t.first_child = fc.data();
    t.next_sibling = ns.data();
    std::vector<int32_t> acc((size_t)(z.B * (z.L + 1))), len((size_t)z.B), bonus((size_t)z.B);
    KDT_OK_OR_DIE(kdt_verify_greedy_cpu(&t, argmax.data(), NULL, 0, NULL, NULL, z.L + 1, acc.data(), len.data(), bonus.data()));
    CHECK(download(d.accepted, acc.size()) == acc, "accepted nodes differ from the CPU walk");
    CHECK(download(d.accept_length, len.size()) == len, "accept lengths differ from the CPU walk");
    CHECK(download(d.bonus, bonus.size()) == bonus, "bonus tokens differ from the CPU walk");
    int deep = 0;
    for (int32_t x : len) deep += x >= 2;
    printf("  accept lengths:");
    for (int32_t x : len) printf(" %d", x);
    printf("  (tree status:");
    for (int32_t x : tstatus) printf(" %d", x);
    printf(")\n");
    (void)deep;
}

int main(int argc, char** argv) {
    int32_t devices = 0;
    if (kdt_cuda_device_count(&devices) != KDT_OK) {
        printf("SKIP: %s\n", kdt_last_error());
        return 77;
    }
    set_forced_paths(argc, argv);
    Sizes z;
    z.columns = 100 + z.N + 1;
    z.words = (z.columns + 31) / 32;
    Device d = {};
    const int64_t rows = z.N + 1;
    CUDA_OK(cudaMalloc(&d.draft, (size_t)(z.B * z.L * z.V) * 2));
    CUDA_OK(cudaMalloc(&d.target, (size_t)(z.B * rows * z.V) * 2));
    CUDA_OK(cudaMalloc(&d.roots, (size_t)z.B * 4));
    CUDA_OK(cudaMalloc(&d.prefix, (size_t)z.B * 8));
    d.trees.batch = z.B;
    d.trees.budget = z.N;
    const size_t r4 = (size_t)(z.B * rows) * 4, r8 = (size_t)(z.B * rows) * 8;
    CUDA_OK(cudaMalloc(&d.trees.num_nodes, (size_t)z.B * 4));
    CUDA_OK(cudaMalloc(&d.trees.tokens, r4));
    CUDA_OK(cudaMalloc(&d.trees.depths, r4));
    CUDA_OK(cudaMalloc(&d.trees.parents, r4));
    CUDA_OK(cudaMalloc(&d.trees.logw, r8));
    CUDA_OK(cudaMalloc(&d.trees.positions, r8));
    CUDA_OK(cudaMalloc(&d.trees.visibility, (size_t)(z.B * rows * rows)));
    CUDA_OK(cudaMalloc(&d.trees.visibility_bits, r4 * (size_t)((rows + 31) / 32)));
    CUDA_OK(cudaMalloc(&d.trees.first_child, r4));
    CUDA_OK(cudaMalloc(&d.trees.next_sibling, r4));
    CUDA_OK(cudaMalloc(&d.tree_status, (size_t)z.B * 4));
    KDT_OK_OR_DIE(kdt_trees_build_from_logits_cuda_workspace_bytes(z.B, z.N, z.L, z.V, z.K, &d.workspace_bytes));
    CUDA_OK(cudaMalloc(&d.workspace, d.workspace_bytes));
    CUDA_OK(cudaMalloc(&d.mask, r4 * (size_t)z.words));
    CUDA_OK(cudaMalloc(&d.positions, r8));
    CUDA_OK(cudaMalloc(&d.mask_status, (size_t)z.B * 4));
    CUDA_OK(cudaMalloc(&d.accepted, (size_t)(z.B * (z.L + 1)) * 4));
    CUDA_OK(cudaMalloc(&d.accept_length, (size_t)z.B * 4));
    CUDA_OK(cudaMalloc(&d.bonus, (size_t)z.B * 4));
    CUDA_OK(cudaMalloc(&d.chosen, r4));
    CUDA_OK(cudaMalloc(&d.verify_status, (size_t)z.B * 4));
    CUDA_OK(cudaMalloc(&d.compact_status, (size_t)z.B * 4));
    const size_t kv_elems = (size_t)(z.B * z.H * z.S * z.D);
    std::vector<uint16_t> kv_init[4];
    for (int i = 0; i < 4; i++) {
        CUDA_OK(cudaMalloc(&d.kv[i], kv_elems * 2));
        kv_init[i].resize(kv_elems);
        for (auto& x : kv_init[i]) x = to_bf16(unit() - 0.5f);
    }
    void* k_ptrs[2] = {d.kv[0], d.kv[1]};
    void* v_ptrs[2] = {d.kv[2], d.kv[3]};
    CUDA_OK(cudaMalloc(&d.k_table, sizeof k_ptrs));
    CUDA_OK(cudaMalloc(&d.v_table, sizeof v_ptrs));
    CUDA_OK(cudaMemcpy(d.k_table, k_ptrs, sizeof k_ptrs, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.v_table, v_ptrs, sizeof v_ptrs, cudaMemcpyHostToDevice));
    std::vector<int32_t> roots((size_t)z.B);
    std::vector<int64_t> prefix((size_t)z.B);
    for (int64_t b = 0; b < z.B; b++) {
        roots[(size_t)b] = (int32_t)b;
        prefix[(size_t)b] = (int64_t)(next_u64() % 30) + 10 * b;
    }
    CUDA_OK(cudaMemcpy(d.roots, roots.data(), roots.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.prefix, prefix.data(), prefix.size() * 8, cudaMemcpyHostToDevice));

    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    auto reset_kv = [&]() {
        for (int i = 0; i < 4; i++) CUDA_OK(cudaMemcpy(d.kv[i], kv_init[i].data(), kv_elems * 2, cudaMemcpyHostToDevice));
    };
    std::vector<uint16_t> draft, target;
    fill_inputs(z, draft, target, 0);
    CUDA_OK(cudaMemcpy(d.draft, draft.data(), draft.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.target, target.data(), target.size() * 2, cudaMemcpyHostToDevice));
    reset_kv();

    // Capture (the first launch of each kernel happens inside the capture, too).
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    round_on(z, d, s);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    for (int trial = 0; trial < 4; trial++) {
        fill_inputs(z, draft, target, trial);
        CUDA_OK(cudaMemcpy(d.draft, draft.data(), draft.size() * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d.target, target.data(), target.size() * 2, cudaMemcpyHostToDevice));
        reset_kv();
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        const std::vector<uint8_t> replayed = snapshot(z, d);
        reset_kv();
        round_on(z, d, s);
        CUDA_OK(cudaStreamSynchronize(s));
        const std::vector<uint8_t> eager = snapshot(z, d);
        CHECK(replayed == eager, "trial %d: the graph replay differs from the eager round", trial);
        std::vector<int32_t> tstatus = download(d.tree_status, (size_t)z.B);
        for (int64_t b = 0; b < z.B; b++) {
            const int32_t want = (trial % 2 == 1 && b == 2) ? KDT_ERR_VALUE : KDT_OK;
            CHECK(tstatus[(size_t)b] == want, "trial %d, request %lld: tree status %d, want %d", trial, (long long)b,
                  tstatus[(size_t)b], want);
        }
        check_against_cpu(z, d, target);
        std::vector<int32_t> vs = download(d.verify_status, (size_t)z.B), cs = download(d.compact_status, (size_t)z.B),
                             ms = download(d.mask_status, (size_t)z.B);
        for (int64_t b = 0; b < z.B; b++) {
            CHECK(vs[(size_t)b] == KDT_OK && cs[(size_t)b] == KDT_OK && ms[(size_t)b] == KDT_OK,
                  "trial %d, request %lld: statuses verify %d, compact %d, mask %d", trial, (long long)b,
                  vs[(size_t)b], cs[(size_t)b], ms[(size_t)b]);
        }
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(s));
    printf("%s: whole round eager vs CUDA graph replay, 4 trials\n", failures ? "FAIL" : "PASS");
    return failures ? 1 : 0;
}
