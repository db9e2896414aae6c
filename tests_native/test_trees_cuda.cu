// The CUDA tree builder against the CPU builder (itself checked against the Python
// reference by test_trees and the parity tests): random batches of every kind (peaked,
// flat, exact ties, -inf tails and rows, chains, stars, K > N, budgets 1..1024, depths
// 1..32), every field compared byte for byte, output buffers reused without clearing so a
// larger earlier tree must leave no trace, and invalid requests mixed in (their status
// must be the CPU's, their tree root-only, their neighbours unaffected).
//
// Usage: test_trees_cuda [--paths NAME[,NAME...] | --forced] [--trees N] [--max-depth L]
//   no option: the automatic dispatch, N trees (100,000; 300 with KDT_CUDA_QUICK=1; or
//     KDT_CUDA_TREES) of depths up to 32;
//   --paths: the paths named forced through native/kdt_testing.h (kdt_testing_tree_path_bit
//     lists the names; "deep" alone means no forced path and depths up to 96, past the
//     descent's limit of 64, so the bisection runs without being forced);
//   --forced: every forced path in turn (and "deep"), 2,000 trees each (100 quick).
// Exits 77 (skipped) where there is no GPU.
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "kdtree.h"
#include "../native/kdt_testing.h"
#define KDT_TEST_SEED 0x9E3779B97F4A7C15ull
#include "cuda_harness.h"

static int failures = 0;




static float normal() {
    double u = unit() + 1e-12, v = unit();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}
// Rounds a float to bfloat16 precision (ties away), to create exact ties.
static float to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x8000u) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

// One request's [L, K] rows: sorted log-probs of a given kind and unique ids.
static void make_request(float* lp, int32_t* ids, int64_t L, int64_t K, int64_t vocab, int kind) {
    std::vector<float> row(vocab);
    std::vector<int32_t> perm(vocab);
    for (int64_t d = 0; d < L; d++) {
        for (int64_t v = 0; v < vocab; v++) perm[v] = (int32_t)v;
        for (int64_t v = vocab - 1; v > 0; v--) {  // shuffle: ids in random order
            int64_t j = uniform(0, v);
            int32_t t = perm[v];
            perm[v] = perm[j];
            perm[j] = t;
        }
        for (int64_t r = 0; r < K; r++) {
            float x;
            switch (kind) {
                case 0: x = r == 0 ? -0.05f * (float)unit() : -8.0f - 3.0f * (float)unit(); break;  // peaked
                case 1: x = -(float)log((double)vocab) + 0.01f * normal(); break;                   // flat
                case 2: x = -(float)uniform(0, 2); break;                                          // ties
                case 3: x = to_bf16(-fabsf(2.0f * normal())); break;                                // bf16 ties
                default: x = -fabsf(normal()) * 3.0f; break;
            }
            row[r] = x;
        }
        std::vector<float> sorted(row.begin(), row.begin() + K);
        for (int64_t i = 1; i < K; i++) {  // insertion sort, descending
            float x = sorted[i];
            int64_t j = i - 1;
            while (j >= 0 && sorted[j] < x) {
                sorted[j + 1] = sorted[j];
                j--;
            }
            sorted[j + 1] = x;
        }
        if (unit() < 0.2) {  // a -inf tail, sometimes a whole row
            int64_t from = uniform(0, K);
            for (int64_t r = from; r < K; r++) sorted[r] = -INFINITY;
        }
        for (int64_t r = 0; r < K; r++) {
            lp[d * K + r] = sorted[r];
            ids[d * K + r] = perm[r];
        }
    }
}

struct Field {
    int32_t id;
    size_t elem;
};
static const Field kFields[] = {{KDT_FIELD_TOKENS, 4},   {KDT_FIELD_DEPTHS, 4},          {KDT_FIELD_PARENTS, 4},
                                {KDT_FIELD_LOGW, 8},     {KDT_FIELD_POSITIONS, 8},       {KDT_FIELD_VISIBILITY, 1},
                                {KDT_FIELD_VISIBILITY_BITS, 4}, {KDT_FIELD_FIRST_CHILD, 4}, {KDT_FIELD_NEXT_SIBLING, 4}};
static const char* kNames[] = {"tokens", "depths", "parents", "logw", "positions", "visibility",
                               "visibility_bits", "first_child", "next_sibling"};

static void** slot(kdt_trees* t, int32_t id) {
    switch (id) {
        case KDT_FIELD_TOKENS: return (void**)&t->tokens;
        case KDT_FIELD_DEPTHS: return (void**)&t->depths;
        case KDT_FIELD_PARENTS: return (void**)&t->parents;
        case KDT_FIELD_LOGW: return (void**)&t->logw;
        case KDT_FIELD_POSITIONS: return (void**)&t->positions;
        case KDT_FIELD_VISIBILITY: return (void**)&t->visibility;
        case KDT_FIELD_VISIBILITY_BITS: return (void**)&t->visibility_bits;
        case KDT_FIELD_FIRST_CHILD: return (void**)&t->first_child;
        default: return (void**)&t->next_sibling;
    }
}

// Random launches until target_trees trees have been compared, with `paths` forced
// (KDT_TESTING_TREES_* bits) and depths 1..kMaxL. Counts into `failures`.
static void run_random(const char* label, uint32_t paths, int64_t target_trees, int64_t kMaxL) {
    KDT_OK_OR_DIE(kdt_testing_set_tree_paths(paths));
    const int64_t kMaxB = 64, kMaxN = 1024;
    const int failures_before = failures;
    // Device buffers sized for the largest launch and reused (never cleared) throughout.
    size_t max_field[9];
    kdt_trees dev;
    memset(&dev, 0, sizeof dev);
    for (int f = 0; f < 9; f++) {
        KDT_OK_OR_DIE(kdt_trees_field_bytes(kMaxB, kMaxN, kFields[f].id, &max_field[f]));
        CUDA_OK(cudaMalloc(slot(&dev, kFields[f].id), max_field[f]));
        CUDA_OK(cudaMemset(*slot(&dev, kFields[f].id), 0x5a, max_field[f]));
    }
    int32_t *d_num, *d_status, *d_roots, *d_ids;
    int64_t* d_pos;
    float* d_lp;
    CUDA_OK(cudaMalloc(&d_num, kMaxB * 4));
    CUDA_OK(cudaMalloc(&d_status, kMaxB * 4));
    CUDA_OK(cudaMalloc(&d_roots, kMaxB * 4));
    CUDA_OK(cudaMalloc(&d_pos, kMaxB * 8));
    CUDA_OK(cudaMalloc(&d_lp, (size_t)kMaxB * kMaxL * 1100 * 4));
    CUDA_OK(cudaMalloc(&d_ids, (size_t)kMaxB * kMaxL * 1100 * 4));
    void* d_ws = NULL;
    size_t ws_cap = 0;
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));

    int64_t trees = 0, launches = 0, invalid = 0, mismatched_trees = 0;
    while (trees < target_trees) {
        // One launch: a budget, a shape, B requests of mixed kinds.
        const int64_t N = (int64_t)exp(unit() * log((double)kMaxN)) + (unit() < 0.1 ? 0 : 0);
        const int64_t L = uniform(1, kMaxL);
        int64_t K = unit() < 0.1 ? 1 : uniform(1, N + (N < 64 ? 8 : N / 8));
        if (K > 1100) K = 1100;
        if (unit() < 0.05) {
            K = N + 3 > 1100 ? 1100 : N + 3;  // K > N
        }
        const int64_t B = uniform(1, kMaxB);
        const int64_t vocab = K + uniform(0, 50);
        const int64_t vocab_arg = unit() < 0.5 ? vocab : 0;
        std::vector<float> lp((size_t)B * L * K);
        std::vector<int32_t> ids((size_t)B * L * K), roots(B), status(B);
        std::vector<int64_t> pos(B);
        std::vector<int> bad(B, 0);
        for (int64_t b = 0; b < B; b++) {
            make_request(&lp[(size_t)b * L * K], &ids[(size_t)b * L * K], L, K, vocab, (int)uniform(0, 4));
            roots[b] = (int32_t)uniform(0, vocab - 1);
            pos[b] = uniform(0, 100000);
            if (unit() < 0.03) {  // an invalid request: NaN, unsorted, duplicate or bad root
                int64_t d = uniform(0, L - 1), r = uniform(0, (K < N ? K : N) - 1);
                size_t at = (size_t)b * L * K + (size_t)d * K + (size_t)r;
                switch (uniform(0, 3)) {
                    case 0: lp[at] = NAN; break;
                    case 1: lp[at] = 1.0f; break;
                    case 2: ids[at] = ids[(size_t)b * L * K + (size_t)d * K]; if (r == 0) pos[b] = -1; break;
                    default: roots[b] = -5; break;
                }
                bad[b] = 1;
                invalid++;
            }
        }
        const int32_t pad = unit() < 0.5 ? -1 : 7;
        CUDA_OK(cudaMemcpy(d_lp, lp.data(), lp.size() * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_roots, roots.data(), B * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_pos, pos.data(), B * 8, cudaMemcpyHostToDevice));
        kdt_draft dd = {B, L, K, d_lp, d_ids, d_roots, d_pos, vocab_arg, pad};
        kdt_trees dt = dev;
        dt.batch = B;
        dt.budget = N;
        dt.num_nodes = d_num;
        size_t ws = 0;
        KDT_OK_OR_DIE(kdt_trees_build_cuda_workspace_bytes(B, N, L, K, &ws));
        if (ws > ws_cap) {
            if (d_ws) CUDA_OK(cudaFree(d_ws));
            CUDA_OK(cudaMalloc(&d_ws, ws));
            ws_cap = ws;
        }
        KDT_OK_OR_DIE(kdt_trees_build_cuda(&dd, &dt, d_status, d_ws, ws_cap, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaMemcpy(status.data(), d_status, B * 4, cudaMemcpyDeviceToHost));
        std::vector<int32_t> gpu_num(B);
        CUDA_OK(cudaMemcpy(gpu_num.data(), d_num, B * 4, cudaMemcpyDeviceToHost));

        // The CPU builder, one request at a time (a failed request: root-only expected).
        for (int64_t b = 0; b < B; b++) {
            size_t off = (size_t)b * L * K;
            kdt_draft hd = {1, L, K, &lp[off], &ids[off], &roots[b], &pos[b], vocab_arg, pad};
            std::vector<std::vector<unsigned char>> want(9);
            int32_t num = -1;
            kdt_trees ht;
            memset(&ht, 0, sizeof ht);
            ht.batch = 1;
            ht.budget = N;
            ht.num_nodes = &num;
            for (int f = 0; f < 9; f++) {
                size_t bytes;
                KDT_OK_OR_DIE(kdt_trees_field_bytes(1, N, kFields[f].id, &bytes));
                want[f].assign(bytes, 0xEE);
                *slot(&ht, kFields[f].id) = want[f].data();
            }
            kdt_status st = kdt_trees_build_cpu(&hd, &ht, NULL, 0);
            if (st != KDT_OK) {
                // Expected: the same status on the GPU, and a root-only tree.
                if (status[b] != (int32_t)st) {
                    fprintf(stderr, "launch %lld request %lld: GPU status %d, CPU %d (%s)\n", (long long)launches,
                            (long long)b, status[b], (int)st, kdt_last_error());
                    failures++;
                }
                kdt_draft root_only = hd;
                root_only.width = 0;
                if (roots[b] < 0 || (vocab_arg > 0 && roots[b] >= vocab_arg)) root_only.root_tokens = NULL;
                int64_t zero = 0;
                if (pos[b] < 0) root_only.root_positions = &zero;
                KDT_OK_OR_DIE(kdt_trees_build_cpu(&root_only, &ht, NULL, 0));
            } else if (status[b] != KDT_OK || bad[b]) {
                if (status[b] != KDT_OK) {
                    fprintf(stderr, "launch %lld request %lld: GPU status %d for a valid request\n",
                            (long long)launches, (long long)b, status[b]);
                    failures++;
                }
            }
            int same = gpu_num[b] == num;
            for (int f = 0; f < 9 && same; f++) {
                std::vector<unsigned char> got(want[f].size());
                size_t per = want[f].size();
                CUDA_OK(cudaMemcpy(got.data(), (char*)*slot(&dt, kFields[f].id) + (size_t)b * per, per,
                                   cudaMemcpyDeviceToHost));
                if (memcmp(got.data(), want[f].data(), per) != 0) {
                    if (mismatched_trees < 5) {
                        fprintf(stderr, "launch %lld (N=%lld L=%lld K=%lld B=%lld) request %lld: field %s differs\n",
                                (long long)launches, (long long)N, (long long)L, (long long)K, (long long)B,
                                (long long)b, kNames[f]);
                    }
                    same = 0;
                }
            }
            if (!same) {
                mismatched_trees++;
                failures++;
            }
            trees++;
        }
        launches++;
    }
    printf("cuda trees [%s]: %lld trees in %lld launches (%lld invalid requests), %lld mismatches against the "
           "CPU builder, %d failed\n",
           label, (long long)trees, (long long)launches, (long long)invalid, (long long)mismatched_trees,
           failures - failures_before);
    fflush(stdout);
    for (int f = 0; f < 9; f++) CUDA_OK(cudaFree(*slot(&dev, kFields[f].id)));
    CUDA_OK(cudaFree(d_num));
    CUDA_OK(cudaFree(d_status));
    CUDA_OK(cudaFree(d_roots));
    CUDA_OK(cudaFree(d_pos));
    CUDA_OK(cudaFree(d_lp));
    CUDA_OK(cudaFree(d_ids));
    if (d_ws) CUDA_OK(cudaFree(d_ws));
    CUDA_OK(cudaStreamDestroy(stream));
    KDT_OK_OR_DIE(kdt_testing_set_tree_paths(0));
}

// The test entry point itself: unknown settings refused, the path names mapped.
static void test_entry_point() {
    if (kdt_testing_set_tree_paths(0x100u) != KDT_ERR_INVALID_ARGUMENT) {
        fprintf(stderr, "kdt_testing_set_tree_paths(0x100) accepted an unknown bit\n");
        failures++;
    }
    if (kdt_testing_tree_path_bit("heap") != KDT_TESTING_TREES_HEAP || kdt_testing_tree_path_bit("dfs") != 0) {
        fprintf(stderr, "kdt_testing_tree_path_bit maps names wrongly\n");
        failures++;
    }
    if (kdt_testing_set_verify_cluster(3) != KDT_ERR_INVALID_ARGUMENT) {
        fprintf(stderr, "kdt_testing_set_verify_cluster(3) accepted a size that is not 0, 1, 2, 4 or 8\n");
        failures++;
    }
}

int main(int argc, char** argv) {
    int32_t devices = 0;
    if (kdt_cuda_device_count(&devices) != KDT_OK) {
        printf("SKIP: %s\n", kdt_last_error());
        return 77;
    }
    const bool quick = getenv("KDT_CUDA_QUICK") != NULL && atoi(getenv("KDT_CUDA_QUICK")) != 0;
    int64_t trees = getenv("KDT_CUDA_TREES") ? atoll(getenv("KDT_CUDA_TREES")) : -1;
    int64_t max_depth = 32;
    const char* paths_arg = NULL;
    bool forced = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--paths") == 0 && i + 1 < argc) {
            paths_arg = argv[++i];
        } else if (strcmp(argv[i], "--forced") == 0) {
            forced = true;
        } else if (strcmp(argv[i], "--trees") == 0 && i + 1 < argc) {
            trees = atoll(argv[++i]);
        } else if (strcmp(argv[i], "--max-depth") == 0 && i + 1 < argc) {
            max_depth = atoll(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--paths NAME[,NAME...] | --forced] [--trees N] [--max-depth L]\n", argv[0]);
            return 2;
        }
    }
    test_entry_point();
    if (forced) {
        // Every alternative the automatic dispatch takes only for some inputs.
        static const struct {
            const char* label;
            uint32_t paths;
            int64_t max_depth;
        } kForced[] = {
            {"heap", KDT_TESTING_TREES_HEAP, 32},
            {"global-heap", KDT_TESTING_TREES_GLOBAL_HEAP, 32},
            {"bisect", KDT_TESTING_TREES_BISECT, 32},
            {"thread-chains", KDT_TESTING_TREES_THREAD_CHAINS, 32},
            {"no-walk", KDT_TESTING_TREES_NO_WALK, 32},
            {"no-counting", KDT_TESTING_TREES_NO_COUNTING, 32},
            {"thread-chains,no-walk,no-counting",
             KDT_TESTING_TREES_THREAD_CHAINS | KDT_TESTING_TREES_NO_WALK | KDT_TESTING_TREES_NO_COUNTING, 32},
            {"inline-masks", KDT_TESTING_TREES_INLINE_MASKS, 32},
            {"deep", 0, 96},
        };
        const int64_t each = trees > 0 ? trees : quick ? 100 : 2000;
        for (const auto& f : kForced) run_random(f.label, f.paths, each, f.max_depth);
    } else if (paths_arg != NULL) {
        uint32_t paths = 0;
        char buf[256];
        snprintf(buf, sizeof buf, "%s", paths_arg);
        for (char* name = strtok(buf, ","); name != NULL; name = strtok(NULL, ",")) {
            if (strcmp(name, "deep") == 0) {
                max_depth = 96;
                continue;
            }
            const uint32_t bit = kdt_testing_tree_path_bit(name);
            if (bit == 0) {
                fprintf(stderr, "unknown tree path %s\n", name);
                return 2;
            }
            paths |= bit;
        }
        run_random(paths_arg, paths, trees > 0 ? trees : quick ? 300 : 20000, max_depth);
    } else {
        run_random("automatic", 0, trees > 0 ? trees : quick ? 300 : 100000, max_depth);
    }
    printf("%d failed\n", failures);
    return failures == 0 ? 0 : 1;
}
