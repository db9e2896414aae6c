// Times kdt_trees_build_cuda (device events, medians over rotated inputs) next to the CPU
// builder on the same inputs: B = 64, L = 16, budgets 64, 256, 1024, a peaked drafter.
// Three GPU times per budget: "call" is one kdt_trees_build_cuda call between two events
// on an idle stream (the host's launch work included); "graph" is the same build captured
// in a CUDA graph and replayed alone between two events; "stream" is 32 calls queued back
// to back, divided by 32 (what a serving loop that keeps the stream busy pays per call).
// Built as `kdtree_bench_cuda` when CUDA is enabled; run on a GPU machine.
// Usage: kdtree_bench_cuda [--paths NAME[,NAME...]]: the builder's paths forced through the
// test entry point (native/kdt_testing.h; kdt_testing_tree_path_bit lists the names), e.g.
// --paths heap for the one-thread heap at every budget.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "kdtree.h"
#include "../native/kdt_testing.h"
#include "peaked_draft.h"

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) { fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); return 1; } \
    } while (0)
#define KK(call)                                                                                  \
    do {                                                                                          \
        if ((call) != KDT_OK) { fprintf(stderr, "%s: %s\n", #call, kdt_last_error()); return 1; } \
    } while (0)


int main(int argc, char** argv) {
    int32_t n_dev = 0;
    if (kdt_cuda_device_count(&n_dev) != KDT_OK) { printf("SKIP: %s\n", kdt_last_error()); return 0; }
    uint32_t paths = 0;
    if (argc == 3 && strcmp(argv[1], "--paths") == 0) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", argv[2]);
        for (char* name = strtok(buf, ","); name != NULL; name = strtok(NULL, ",")) {
            const uint32_t bit = kdt_testing_tree_path_bit(name);
            if (bit == 0) { fprintf(stderr, "unknown tree path %s\n", name); return 2; }
            paths |= bit;
        }
        printf("forced tree paths: %s\n", argv[2]);
    } else if (argc != 1) {
        fprintf(stderr, "usage: %s [--paths NAME[,NAME...]]\n", argv[0]);
        return 2;
    }
    KK(kdt_testing_set_tree_paths(paths));
    const int64_t B = 64, L = 16, sets = 8, reps = 30;
    printf("%6s %10s %10s %10s %16s %14s\n", "N", "call us", "graph us", "stream us", "CPU us (1 core)",
           "CPU/GPU call");
    for (int64_t N : {64, 256, 1024}) {
        const int64_t K = N;
        std::vector<float> lp;
        std::vector<int32_t> ids;
        fill_peaked_draft(lp, ids, (size_t)(sets * B * L), K);
        float* d_lp; int32_t* d_ids; int32_t* d_status; int32_t* d_num;
        CK(cudaMalloc(&d_lp, lp.size() * 4));
        CK(cudaMalloc(&d_ids, ids.size() * 4));
        CK(cudaMemcpy(d_lp, lp.data(), lp.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&d_status, B * 4));
        CK(cudaMalloc(&d_num, B * 4));
        kdt_trees t; memset(&t, 0, sizeof t);
        t.batch = B; t.budget = N; t.num_nodes = d_num;
        size_t bytes;
        KK(kdt_trees_field_bytes(B, N, KDT_FIELD_TOKENS, &bytes)); CK(cudaMalloc((void**)&t.tokens, bytes));
        CK(cudaMalloc((void**)&t.depths, bytes)); CK(cudaMalloc((void**)&t.parents, bytes));
        CK(cudaMalloc((void**)&t.first_child, bytes)); CK(cudaMalloc((void**)&t.next_sibling, bytes));
        KK(kdt_trees_field_bytes(B, N, KDT_FIELD_LOGW, &bytes)); CK(cudaMalloc((void**)&t.logw, bytes));
        CK(cudaMalloc((void**)&t.positions, bytes));
        KK(kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY, &bytes)); CK(cudaMalloc((void**)&t.visibility, bytes));
        KK(kdt_trees_field_bytes(B, N, KDT_FIELD_VISIBILITY_BITS, &bytes)); CK(cudaMalloc((void**)&t.visibility_bits, bytes));
        size_t ws; void* d_ws;
        KK(kdt_trees_build_cuda_workspace_bytes(B, N, L, K, &ws)); CK(cudaMalloc(&d_ws, ws));
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        std::vector<float> ms;
        for (int64_t i = 0; i < reps + 3; i++) {
            int64_t set = i % sets;
            kdt_draft d = {B, L, K, d_lp + set * B * L * K, d_ids + set * B * L * K, NULL, NULL, 0, -1};
            CK(cudaEventRecord(e0));
            KK(kdt_trees_build_cuda(&d, &t, d_status, d_ws, ws, NULL));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float m; CK(cudaEventElapsedTime(&m, e0, e1));
            if (i >= 3) ms.push_back(m);
        }
        std::sort(ms.begin(), ms.end());
        // The same builds queued back to back.
        std::vector<float> queued;
        for (int rep = 0; rep < 9; rep++) {
            CK(cudaEventRecord(e0));
            for (int64_t i = 0; i < 32; i++) {
                int64_t set = (rep * 32 + i) % sets;
                kdt_draft d = {B, L, K, d_lp + set * B * L * K, d_ids + set * B * L * K, NULL, NULL, 0, -1};
                KK(kdt_trees_build_cuda(&d, &t, d_status, d_ws, ws, NULL));
            }
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float m; CK(cudaEventElapsedTime(&m, e0, e1));
            if (rep > 0) queued.push_back(m / 32.0f);
        }
        std::sort(queued.begin(), queued.end());
        // One build per input set captured in a CUDA graph, each replayed alone.
        cudaStream_t cs; CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
        std::vector<cudaGraphExec_t> execs;
        for (int64_t set = 0; set < sets; set++) {
            kdt_draft d = {B, L, K, d_lp + set * B * L * K, d_ids + set * B * L * K, NULL, NULL, 0, -1};
            cudaGraph_t g; cudaGraphExec_t x;
            CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
            KK(kdt_trees_build_cuda(&d, &t, d_status, d_ws, ws, cs));
            CK(cudaStreamEndCapture(cs, &g));
            CK(cudaGraphInstantiate(&x, g, 0));
            CK(cudaGraphDestroy(g));
            execs.push_back(x);
        }
        std::vector<float> graphed;
        for (int64_t i = 0; i < reps + 3; i++) {
            CK(cudaEventRecord(e0, cs));
            CK(cudaGraphLaunch(execs[i % sets], cs));
            CK(cudaEventRecord(e1, cs));
            CK(cudaEventSynchronize(e1));
            float m; CK(cudaEventElapsedTime(&m, e0, e1));
            if (i >= 3) graphed.push_back(m);
        }
        std::sort(graphed.begin(), graphed.end());
        for (cudaGraphExec_t x : execs) CK(cudaGraphExecDestroy(x));
        CK(cudaStreamDestroy(cs));
        // CPU builder on the same inputs (host buffers, one batch call).
        std::vector<int32_t> h_num(B), h_tok((size_t)B * (N + 1)), h_dep(h_tok.size()), h_par(h_tok.size()),
            h_fc(h_tok.size()), h_ns(h_tok.size());
        std::vector<double> h_logw(h_tok.size());
        std::vector<int64_t> h_pos(h_tok.size());
        std::vector<uint8_t> h_vis((size_t)B * (N + 1) * (N + 1));
        std::vector<uint32_t> h_bits((size_t)B * (N + 1) * ((N + 32) / 32));
        kdt_trees h = {B, N, h_num.data(), h_tok.data(), h_dep.data(), h_par.data(), h_logw.data(), h_pos.data(),
                       h_vis.data(), h_bits.data(), h_fc.data(), h_ns.data()};
        std::vector<double> cpu;
        for (int64_t i = 0; i < 5; i++) {
            kdt_draft d = {B, L, K, &lp[(i % sets) * B * L * K], &ids[(i % sets) * B * L * K], NULL, NULL, 0, -1};
            auto a = std::chrono::steady_clock::now();
            KK(kdt_trees_build_cpu(&d, &h, NULL, 0));
            cpu.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
        }
        std::sort(cpu.begin(), cpu.end());
        double gpu_us = ms[ms.size() / 2] * 1000.0;
        printf("%6lld %10.1f %10.1f %10.1f %16.1f %13.1fx\n", (long long)N, gpu_us,
               graphed[graphed.size() / 2] * 1000.0, queued[queued.size() / 2] * 1000.0, cpu[2], cpu[2] / gpu_us);
        cudaFree(d_lp); cudaFree(d_ids); cudaFree(d_ws); cudaFree(d_status); cudaFree(d_num);
        cudaFree(t.tokens); cudaFree(t.depths); cudaFree(t.parents); cudaFree(t.first_child); cudaFree(t.next_sibling);
        cudaFree(t.logw); cudaFree(t.positions); cudaFree(t.visibility); cudaFree(t.visibility_bits);
    }
    return 0;
}
