// The two masks of a tree (visibility: bytes, visibility_bits: words; row i holds node i
// and its ancestors, a padding row only its diagonal), written from the parents: one warp
// per row (both kernels, and mask_kernel for large trees after build_kernel_smem), or for
// small trees staged in shared memory and written coalesced by the whole block.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "plan.cuh"

namespace kdt {
namespace trees {

// Writes row i's visibility (bytes) and visibility_bits (words), one warp per row: the
// lanes clear the row, then lane 0 sets the row's own column and its ancestors' (node
// rows) or just the diagonal (padding rows, i > n). Used by both kernels.
__device__ void warp_write_mask_row(int64_t i, int64_t n, int64_t rows, const int32_t* node_par, uint8_t* vrow,
                                    uint32_t* brow) {
    const int lane = threadIdx.x & 31;
    const int64_t words = (rows + 31) / 32;
    if (vrow) {
        // Cleared in 16-byte stores between an unaligned head and tail (byte stores were
        // ~2x the bandwidth floor of a large tree's mask on an H200).
        const int64_t head = min(rows, (int64_t)((16 - ((uintptr_t)vrow & 15)) & 15));
        const int64_t body = (rows - head) / 16;
        if (lane < head) vrow[lane] = 0;
        uint4* v4 = reinterpret_cast<uint4*>(vrow + head);
        for (int64_t k = lane; k < body; k += 32) v4[k] = make_uint4(0u, 0u, 0u, 0u);
        for (int64_t j = head + body * 16 + lane; j < rows; j += 32) vrow[j] = 0;
    }
    if (brow) for (int64_t j = lane; j < words; j += 32) brow[j] = 0u;
    __syncwarp();
    if (lane == 0) {
        for (int64_t a = i; a >= 0; a = i <= n ? node_par[a] : -1) {
            if (vrow) vrow[a] = 1;
            if (brow) brow[a / 32] |= 1u << (a % 32);
        }
    }
    __syncwarp();
}

// Every row of a request's masks, one warp per row: rows = N + 1, words = its mask words,
// base = the request's first row. Block-wide; n nodes, node_par [n + 1].
__device__ inline void block_write_mask_rows(const BuildParams& p, size_t base, size_t rows, size_t words, int64_t n,
                                             const int32_t* node_par) {
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (size_t i = warp; i < rows; i += warps) {
        uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
        uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
        warp_write_mask_row((int64_t)i, n, (int64_t)rows, node_par, vrow, brow);
    }
}

// Request b's masks for trees of up to kStagedMaskMaxRows rows: row i's bits are built in
// shared memory by thread i (its own bit and its ancestors'; a padding row only its own),
// then both masks are written by the whole block, coalesced. Block-wide.
__device__ void block_write_masks_staged(const BuildParams& p, int64_t b, int64_t n, const int32_t* node_par) {
    const size_t rows = (size_t)p.out.budget + 1;
    const size_t words = (rows + 31) / 32;
    const size_t base = (size_t)b * rows;
    __shared__ uint32_t s_bits[kStagedMaskMaxRows * kStagedMaskMaxWords];
    for (size_t k = threadIdx.x; k < rows * words; k += blockDim.x) s_bits[k] = 0u;
    __syncthreads();
    for (size_t i = threadIdx.x; i < rows; i += blockDim.x) {
        uint32_t* row = s_bits + i * words;
        for (int64_t a = (int64_t)i; a >= 0; a = (int64_t)i <= n ? node_par[a] : -1) row[a >> 5] |= 1u << (a & 31);
    }
    __syncthreads();
    if (p.out.visibility_bits) {
        uint32_t* dst = p.out.visibility_bits + base * words;
        for (size_t k = threadIdx.x; k < rows * words; k += blockDim.x) dst[k] = s_bits[k];
    }
    if (p.out.visibility) {
        // Four bytes a store between an unaligned head and tail. Each thread keeps the
        // (row, column) of its word's first byte and steps it by a fixed amount: a
        // division per word, and four bit extractions, were most of this phase's
        // instructions (H200 ncu, N = 64).
        uint8_t* dst = p.out.visibility + base * rows;
        const uint32_t urows = (uint32_t)rows, total = urows * urows;
        const uint32_t head = min(total, (uint32_t)((4u - ((uintptr_t)dst & 3u)) & 3u));
        const uint32_t nw = (total - head) / 4u;
        auto bit = [&](uint32_t i, uint32_t j) { return (s_bits[i * words + (j >> 5)] >> (j & 31)) & 1u; };
        if (threadIdx.x < head) dst[threadIdx.x] = (uint8_t)bit(threadIdx.x / urows, threadIdx.x % urows);
        uint32_t* dw = reinterpret_cast<uint32_t*>(dst + head);
        if (urows >= 4u) {
            // The word's four bytes are columns j .. j + 3 of row i, the last 4 - rem of
            // them (rem = rows - j < 4) columns 0 .. of row i + 1: four mask bits taken
            // at once (a funnel shift across the row's words; bits past a row's end
            // are 0), spread one to a byte by a multiply.
            const uint32_t last = (uint32_t)(rows * words) - 1u;  // s_bits' last word in use
            const uint32_t di = p.mask_di, dj = p.mask_dj;  // the step: 4 x blockDim.x bytes
            const uint32_t k0 = head + 4u * threadIdx.x;      // < 2^32 / rows
            uint32_t i = __umulhi(k0, p.mask_magic), j = k0 - i * urows;
            for (uint32_t w = threadIdx.x; w < nw; w += blockDim.x) {
                const uint32_t at = i * (uint32_t)words + (j >> 5);
                const uint32_t lo = s_bits[at], hi = s_bits[min(at + 1u, last)];
                const uint32_t rem = urows - j;  // columns left in row i, >= 1
                uint32_t nib = __funnelshift_r(lo, hi, j) & 0xFu;
                if (rem < 4u) {
                    const uint32_t next = s_bits[min((i + 1u) * (uint32_t)words, last)];
                    nib = (nib & ((1u << rem) - 1u)) | ((next << rem) & 0xFu);
                }
                dw[w] = (nib * 0x00204081u) & 0x01010101u;
                j += dj;
                i += di;
                if (j >= urows) {
                    j -= urows;
                    i++;
                }
            }
        } else {
            for (uint32_t w = threadIdx.x; w < nw; w += blockDim.x) {
                const uint32_t k = head + 4u * w;
                uint32_t i = k / urows, j = k - i * urows, v = 0u;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    v |= bit(i, j) << (8 * q);
                    if (++j == urows) {
                        j = 0;
                        i++;
                    }
                }
                dw[w] = v;
            }
        }
        for (uint32_t k = head + 4u * nw + threadIdx.x; k < total; k += blockDim.x) {
            dst[k] = (uint8_t)bit(k / urows, k % urows);
        }
    }
}

// The masks of large trees, after build_kernel_smem: one warp per row over a grid of
// (row blocks, requests), so every SM writes (one block per request reaches ~0.6 TB/s on
// a 1 MB bool mask). Reads num_nodes and the parents build_kernel_smem left in the
// workspace.
constexpr int kMaskRowsPerBlock = kThreads / 32;
__global__ void __launch_bounds__(kThreads) mask_kernel(BuildParams p) {
    const int64_t b = blockIdx.y;
    const size_t rows = (size_t)p.out.budget + 1;
    const size_t words = (rows + 31) / 32;
    const size_t i = (size_t)blockIdx.x * kMaskRowsPerBlock + threadIdx.x / 32;
    if (i >= rows) return;  // whole warps leave together
    const int32_t* g_par = workspace_parents(p, b);
    const int64_t n = p.out.num_nodes[b];
    const size_t base = (size_t)b * rows;
    uint8_t* vrow = p.out.visibility ? p.out.visibility + (base + i) * rows : nullptr;
    uint32_t* brow = p.out.visibility_bits ? p.out.visibility_bits + (base + i) * words : nullptr;
    warp_write_mask_row((int64_t)i, n, (int64_t)rows, g_par, vrow, brow);
}

}  // namespace trees
}  // namespace kdt
