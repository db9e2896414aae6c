// Phase timing of the shared-memory tree-build kernel (versions 2 and 3): this file
// compiles native/cuda/trees_cuda.cu with KDT_TREES_PROFILE, so the kernel records
// clock64() at its phase boundaries (load + validation, expansion, outputs + masks), and
// prints the median over blocks in microseconds, next to the whole launch (CUDA events).
// Same inputs as tools/bench_trees_cuda.cu (B = 64, L = 16, K = N, peaked), or, with
// KDT_PROF_INPUT=PREFIX, the log-probs and ids in PREFIX.lp (float32 [64, 16, 64]) and
// PREFIX.ids (int32, same shape), raw little-endian, e.g. the GPU top-k of bench_gpu's bf16
// drafter logits (written by tools/bench_gpu.py --dump-topk PREFIX); then N = 64 only.
// Device only.
#define KDT_TREES_PROFILE 1
#include "../native/cuda/trees_cuda.cu"

#include <algorithm>
#include <stdio.h>
#include <string.h>
#include <string>
#include <vector>

#include "peaked_draft.h"

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) { fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); return 1; } \
    } while (0)


int main() {
    int dev_count = 0;
    if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) { printf("SKIP: no GPU\n"); return 0; }
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const double cyc_per_us = clock_khz / 1000.0;
    const int64_t B = 64, L = 16;
    // KDT_PROF_KNOB (profiling build only), bits: 1 skips the duplicate-id hash, 2 the loads;
    // 4 first threshold at N/2 at every budget; 8 no counting sort; 16 no counting select.
    const int knob = getenv("KDT_PROF_KNOB") ? atoi(getenv("KDT_PROF_KNOB")) : 0;
    CK(cudaMemcpyToSymbol(kdt_prof_knob, &knob, sizeof knob));
    printf("SM clock %.0f MHz; median over %lld blocks, microseconds; knob %d\n", cyc_per_us, (long long)B, knob);
    printf("%6s %8s %10s %10s %10s %10s %8s %8s %8s %10s\n", "N", "launch", "load+val", "expand", "outputs", "block",
           "(root", "group0", "rest)", "block max");
    const char* input = getenv("KDT_PROF_INPUT");
    for (int64_t N : {64, 128, 256, 1024}) {
        const int64_t K = N;
        std::vector<float> lp;
        std::vector<int32_t> ids;
        if (input != NULL) {
            if (N != 64) break;
            lp.resize((size_t)(B * L * K));
            ids.resize(lp.size());
            const std::string prefix(input);
            FILE* f = fopen((prefix + ".lp").c_str(), "rb");
            FILE* g = fopen((prefix + ".ids").c_str(), "rb");
            const bool ok = f && g && fread(lp.data(), 4, lp.size(), f) == lp.size() &&
                            fread(ids.data(), 4, ids.size(), g) == ids.size();
            if (f) fclose(f);
            if (g) fclose(g);
            if (!ok) {
                fprintf(stderr, "KDT_PROF_INPUT: cannot read %zu float32 values from %s.lp and int32 ids from %s.ids\n",
                        lp.size(), input, input);
                return 1;
            }
        } else {
            fill_peaked_draft(lp, ids, (size_t)(B * L), K);
        }
        float* d_lp; int32_t* d_ids; int32_t* d_status; int32_t* d_num;
        CK(cudaMalloc(&d_lp, lp.size() * 4));
        CK(cudaMalloc(&d_ids, ids.size() * 4));
        CK(cudaMemcpy(d_lp, lp.data(), lp.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d_status, B * 4));
        CK(cudaMalloc(&d_num, B * 4));
        kdt_trees t; memset(&t, 0, sizeof t);
        t.batch = B; t.budget = N; t.num_nodes = d_num;
        const size_t rows = (size_t)(B * (N + 1));
        CK(cudaMalloc((void**)&t.tokens, rows * 4)); CK(cudaMalloc((void**)&t.depths, rows * 4));
        CK(cudaMalloc((void**)&t.parents, rows * 4)); CK(cudaMalloc((void**)&t.first_child, rows * 4));
        CK(cudaMalloc((void**)&t.next_sibling, rows * 4)); CK(cudaMalloc((void**)&t.logw, rows * 8));
        CK(cudaMalloc((void**)&t.positions, rows * 8)); CK(cudaMalloc((void**)&t.visibility, rows * (N + 1)));
        CK(cudaMalloc((void**)&t.visibility_bits, rows * ((N + 32) / 32) * 4));
        size_t ws; void* d_ws;
        if (kdt_trees_build_cuda_workspace_bytes(B, N, L, K, &ws) != KDT_OK) return 1;
        CK(cudaMalloc(&d_ws, ws));
        kdt_draft d = {B, L, K, d_lp, d_ids, NULL, NULL, 0, -1};
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        std::vector<float> launch;
        std::vector<double> ph[7];
        for (int rep = 0; rep < 12; rep++) {
            CK(cudaEventRecord(e0));
            if (kdt_trees_build_cuda(&d, &t, d_status, d_ws, ws, NULL) != KDT_OK) { fprintf(stderr, "%s\n", kdt_last_error()); return 1; }
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
            if (rep < 2) continue;
            launch.push_back(ms * 1000.0f);
            long long prof[64][8];
            CK(cudaMemcpyFromSymbol(prof, kdt_prof, sizeof prof));
            for (int64_t blk = 0; blk < B; blk++) {
                ph[0].push_back((prof[blk][1] - prof[blk][0]) / cyc_per_us);
                ph[1].push_back((prof[blk][2] - prof[blk][1]) / cyc_per_us);
                ph[2].push_back((prof[blk][3] - prof[blk][2]) / cyc_per_us);
                ph[3].push_back((prof[blk][3] - prof[blk][0]) / cyc_per_us);
                ph[4].push_back((prof[blk][4] - prof[blk][0]) / cyc_per_us);
                ph[5].push_back((prof[blk][5] - prof[blk][4]) / cyc_per_us);
                ph[6].push_back((prof[blk][1] - prof[blk][5]) / cyc_per_us);
            }
        }
        if (N >= 16 || getenv("KDTREE_CUDA_TREES_PARALLEL")) {
            long long v[64][4];
            CK(cudaMemcpyFromSymbol(v, kdt_prof_v3, sizeof v));
            printf("   block 0: version %d, %lld passes, enumeration %.1f us, sort + check %.1f us, |P_T| = %lld\n",
                   v[0][0] >= 1000 ? 4 : 3, v[0][0] % 1000, v[0][1] / cyc_per_us, v[0][2] / cyc_per_us, v[0][3]);
            long long m4[64][8];
            CK(cudaMemcpyFromSymbol(m4, kdt_prof_v4, sizeof m4));
            printf("   block 0 version 4 phases (us from its start: first threshold, then per pass the rounds and the "
                   "next threshold):");
            for (int i = 1; i < 7 && m4[0][i] > m4[0][0]; i++) printf(" %.1f", (m4[0][i] - m4[0][0]) / cyc_per_us);
            printf("; rounds %lld\n", m4[0][7]);
            long long ms[64][4];
            CK(cudaMemcpyFromSymbol(ms, kdt_prof_sort, sizeof ms));
            long long tie[64][4];
            CK(cudaMemcpyFromSymbol(tie, kdt_prof_tie, sizeof tie));
            printf("   block 0 counting sort (us): count %.1f, path keys %.1f, tie scan %.1f; %lld tied\n",
                   (tie[0][0] - ms[0][0]) / cyc_per_us, tie[0][1] > tie[0][0] ? (tie[0][1] - tie[0][0]) / cyc_per_us : 0.0,
                   (ms[0][1] - (tie[0][1] > tie[0][0] ? tie[0][1] : tie[0][0])) / cyc_per_us, tie[0][3]);
            printf("   block 0 sort (us): init %.1f, k <= 64 %.1f, k > 64 %.1f, positions + check %.1f\n",
                   (ms[0][0] - m4[0][0]) / cyc_per_us - (v[0][1]) / cyc_per_us, (ms[0][1] - ms[0][0]) / cyc_per_us,
                   (ms[0][2] - ms[0][1]) / cyc_per_us, (ms[0][3] - ms[0][2]) / cyc_per_us);
        }
        {
            // The slowest block of the last launch (the launch ends with it): its phases and
            // version-3/4 counters.
            long long prof[64][8], v[64][4], m4[64][8];
            CK(cudaMemcpyFromSymbol(prof, kdt_prof, sizeof prof));
            CK(cudaMemcpyFromSymbol(v, kdt_prof_v3, sizeof v));
            CK(cudaMemcpyFromSymbol(m4, kdt_prof_v4, sizeof m4));
            int64_t slow = 0;
            for (int64_t blk = 1; blk < B; blk++) {
                if (prof[blk][3] - prof[blk][0] > prof[slow][3] - prof[slow][0]) slow = blk;
            }
            printf("   slowest block %lld: %.1f us (load+val %.1f, expand %.1f, outputs %.1f); %lld passes, "
                   "|P_T| = %lld, enumeration %.1f us, sort + check %.1f us; v4 marks:",
                   (long long)slow, (prof[slow][3] - prof[slow][0]) / cyc_per_us,
                   (prof[slow][1] - prof[slow][0]) / cyc_per_us, (prof[slow][2] - prof[slow][1]) / cyc_per_us,
                   (prof[slow][3] - prof[slow][2]) / cyc_per_us, v[slow][0] % 1000, v[slow][3],
                   v[slow][1] / cyc_per_us, v[slow][2] / cyc_per_us);
            for (int i = 1; i < 7 && m4[slow][i] > m4[slow][0]; i++) printf(" %.1f", (m4[slow][i] - m4[slow][0]) / cyc_per_us);
            printf("; rounds %lld\n", m4[slow][7]);
            long long rm[64][8];
            CK(cudaMemcpyFromSymbol(rm, kdt_prof_round, sizeof rm));
            printf("   slowest block's first pass (us from the first threshold): root chain and walk %.1f; "
                   "rounds",
                   (rm[slow][0] - m4[slow][1]) / cyc_per_us);
            for (int i = 1; i < 8 && rm[slow][i] > rm[slow][i - 1]; i++) {
                printf(" %.1f", (rm[slow][i] - m4[slow][1]) / cyc_per_us);
            }
            int rs[64][8][3];
            CK(cudaMemcpyFromSymbol(rs, kdt_prof_rstat, sizeof rs));
            printf("; (owners, chains resumed, most by one warp):");
            for (int i = 1; i < 8 && rm[slow][i] > rm[slow][i - 1]; i++) {
                printf(" (%d, %d, %d)", rs[slow][i][0], rs[slow][i][1], rs[slow][i][2]);
            }
            printf("\n");
            std::vector<int> order((size_t)B);
            for (int i = 0; i < (int)B; i++) order[(size_t)i] = i;
            std::sort(order.begin(), order.end(), [&](int a, int c) {
                return prof[a][3] - prof[a][0] > prof[c][3] - prof[c][0];
            });
            printf("   slowest 8 (block: us, passes, |P_T|, sort + check us):");
            for (int i = 0; i < 8 && i < (int)B; i++) {
                const int k = order[(size_t)i];
                printf(" %d: %.1f, %lld, %lld, %.1f;", k, (prof[k][3] - prof[k][0]) / cyc_per_us, v[k][0] % 1000, v[k][3],
                       v[k][2] / cyc_per_us);
            }
            printf("\n");
        }
        std::sort(launch.begin(), launch.end());
        double med[7];
        for (int i = 0; i < 7; i++) { std::sort(ph[i].begin(), ph[i].end()); med[i] = ph[i][ph[i].size() / 2]; }
        printf("%6lld %8.1f %10.1f %10.1f %10.1f %10.1f %8.1f %8.1f %8.1f %10.1f\n", (long long)N,
               launch[launch.size() / 2], med[0], med[1], med[2], med[3], med[4], med[5], med[6], ph[3].back());
        cudaFree(d_lp); cudaFree(d_ids); cudaFree(d_ws); cudaFree(d_status); cudaFree(d_num);
        cudaFree(t.tokens); cudaFree(t.depths); cudaFree(t.parents); cudaFree(t.first_child); cudaFree(t.next_sibling);
        cudaFree(t.logw); cudaFree(t.positions); cudaFree(t.visibility); cudaFree(t.visibility_bits);
    }
    return 0;
}
