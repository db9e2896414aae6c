// The drafter rows of the GPU tree benchmark (tools/bench_trees_cuda.cu): a peaked
// drafter, rank 0 at -0.08 (p ~ 0.92) and the other
// K - 1 log-probs uniform in [-14, -8], sorted; ids distinct within a row.
#pragma once

#include <algorithm>
#include <stdint.h>
#include <vector>

static uint64_t peaked_rng = 88172645463325252ull;

static inline double peaked_unit() {
    peaked_rng ^= peaked_rng << 13;
    peaked_rng ^= peaked_rng >> 7;
    peaked_rng ^= peaked_rng << 17;
    return (double)(peaked_rng >> 11) / 9007199254740992.0;
}

// Fills `rows` rows of K entries (lp and ids are resized to rows * K).
static inline void fill_peaked_draft(std::vector<float>& lp, std::vector<int32_t>& ids, size_t rows, int64_t K) {
    lp.resize(rows * (size_t)K);
    ids.resize(lp.size());
    for (size_t row = 0; row < rows; row++) {
        float* r = &lp[row * K];
        r[0] = -0.08f;
        for (int64_t k = 1; k < K; k++) r[k] = -8.0f - 6.0f * (float)peaked_unit();
        std::sort(r + 1, r + K, [](float a, float b) { return a > b; });
        for (int64_t k = 0; k < K; k++) ids[row * K + k] = (int32_t)(k * 37 + row % 11);
    }
}
