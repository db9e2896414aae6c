// kdt_tree_attention_mask_cuda against a host reference written here from the parents
// array (row i sees the prefix when it is a real node, tree column p + j when j is i or an
// ancestor of i, a padding row only itself): every kind (bool, bits, additive float32 /
// float16 / bfloat16, FlashInfer's bit-packed ragged segments with their indptr, packed bit
// by bit little-endian here), trees from kdt_trees_build_cpu (whose visibility output
// cross-checks the reference) and hand-made parent arrays (random, chains, stars, garbage
// in padding rows), budgets 0 .. 4096, prefixes 0 .. 100,000, odd column counts, failed
// requests next to good ones, FlashInfer capacity overflow, buffers prefilled with garbage
// or left dirty by a larger earlier call, bytes past the output left alone, the positions
// output, a CUDA graph capture, and the host-side argument checks.
// KDT_CUDA_QUICK=1 shrinks it (for compute-sanitizer). Exits 77 (skipped) without a GPU.
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "kdtree.h"
#define KDT_TEST_SEED 0x243F6A8885A308D3ull
#define KDT_TEST_EXPECT
#include "cuda_harness.h"

static const char* kKindNames[] = {"bool", "bits", "f32", "f16", "bf16", "flashinfer"};

// ---- The reference -------------------------------------------------------------------

// B requests of budget N: num_nodes [B], parents [B, N+1], prefix lengths [B].
struct Case {
    int64_t B = 0, N = 0, C = 0;  // C: columns of the dense kinds
    std::vector<int32_t> num_nodes, parents;
    std::vector<int64_t> prefix;
    std::string what;
};

// The documented per-request status (KDT_ERR_BUFFER_TOO_SMALL is decided for the batch).
static int32_t ref_status(const Case& cs, int64_t b, bool flash) {
    const int64_t T = cs.N + 1, p = cs.prefix[b];
    const int32_t n = cs.num_nodes[b];
    if (p < 0 || (!flash && p + T > cs.C)) return KDT_ERR_OUT_OF_RANGE;
    if (n < 0 || n > cs.N) return KDT_ERR_VALUE;
    for (int64_t i = 1; i <= n; i++) {
        const int32_t a = cs.parents[b * T + i];
        if (a < 0 || a >= i) return KDT_ERR_VALUE;
    }
    return KDT_OK;
}

// Row i of a valid request b: its visible tree columns (ancestors-or-self for a real node,
// itself for a padding row) and its depth.
static void ref_tree_row(const Case& cs, int64_t b, int64_t i, std::vector<uint8_t>& tree, int64_t* depth) {
    const int64_t T = cs.N + 1;
    tree.assign(T, 0);
    *depth = 0;
    if (i > cs.num_nodes[b]) {
        tree[i] = 1;
        return;
    }
    for (int64_t a = i; a >= 0; a = a == 0 ? -1 : cs.parents[b * T + a]) {
        tree[a] = 1;
        if (a > 0) ++*depth;
    }
}

static size_t elem_size(int32_t kind) {
    return kind == KDT_MASK_ADDITIVE_F32 || kind == KDT_MASK_BITS ? 4 : kind == KDT_MASK_BOOL ? 1 : 2;
}
static int64_t row_elems(int32_t kind, int64_t C) { return kind == KDT_MASK_BITS ? (C + 31) / 32 : C; }

// The expected bytes of one dense row.
static void ref_dense_row(int32_t kind, int64_t C, int64_t p, bool ok, bool real, const std::vector<uint8_t>& tree,
                          std::vector<uint8_t>& out) {
    const int64_t T = (int64_t)tree.size();
    std::vector<uint8_t> vis(C, 0);
    if (ok) {
        if (real)
            for (int64_t c = 0; c < p; c++) vis[c] = 1;
        for (int64_t t = 0; t < T; t++) vis[p + t] = tree[t];
    }
    out.assign((size_t)row_elems(kind, C) * elem_size(kind), 0);
    for (int64_t c = 0; c < C; c++) {
        switch (kind) {
            case KDT_MASK_BOOL: out[c] = vis[c]; break;
            case KDT_MASK_BITS:
                if (vis[c]) out[(c / 32) * 4 + (c % 32) / 8] |= (uint8_t)(1u << (c % 8));
                break;
            case KDT_MASK_ADDITIVE_F32: {
                const uint32_t v = vis[c] ? 0u : 0xFF7FFFFFu;  // -FLT_MAX
                memcpy(&out[c * 4], &v, 4);
                break;
            }
            default: {
                const uint16_t v = vis[c] ? 0 : kind == KDT_MASK_ADDITIVE_F16 ? 0xFBFF : 0xFF7F;  // -65504, bf16 lowest
                memcpy(&out[c * 2], &v, 2);
                break;
            }
        }
    }
}

static int64_t ref_segment_bytes(int64_t p, int64_t T) { return (T * ((p < 0 ? 0 : p) + T) + 7) / 8; }

// Request b's FlashInfer segment: the [T, p + T] bool mask, row major, packed bit by bit.
static std::vector<uint8_t> ref_segment(const Case& cs, int64_t b, bool ok) {
    const int64_t T = cs.N + 1, p = cs.prefix[b] < 0 ? 0 : cs.prefix[b], Lr = p + T;
    std::vector<uint8_t> seg((size_t)ref_segment_bytes(p, T), 0);
    if (!ok) return seg;
    std::vector<uint8_t> tree;
    for (int64_t i = 0; i < T; i++) {
        int64_t depth;
        ref_tree_row(cs, b, i, tree, &depth);
        for (int64_t c = 0; c < Lr; c++) {
            const bool v = c < p ? i <= cs.num_nodes[b] : tree[c - p] != 0;
            const int64_t f = i * Lr + c;
            if (v) seg[f / 8] |= (uint8_t)(1u << (f % 8));
        }
    }
    return seg;
}

// ---- Device buffers (grown on demand, never cleared between calls) -------------------

struct Dev {
    int32_t *num = nullptr, *par = nullptr, *status = nullptr, *indptr = nullptr;
    int64_t *pre = nullptr, *pos = nullptr;
    uint8_t* mask = nullptr;
    size_t cap_req = 0, cap_rows = 0, cap_mask = 0;
};
static Dev dev;

static void ensure(int64_t B, int64_t rows, size_t mask_bytes) {
    if ((size_t)B > dev.cap_req) {
        if (dev.num) {
            CUDA_OK(cudaFree(dev.num));
            CUDA_OK(cudaFree(dev.status));
            CUDA_OK(cudaFree(dev.indptr));
            CUDA_OK(cudaFree(dev.pre));
        }
        dev.cap_req = (size_t)B * 2;
        CUDA_OK(cudaMalloc(&dev.num, dev.cap_req * 4));
        CUDA_OK(cudaMalloc(&dev.status, dev.cap_req * 4));
        CUDA_OK(cudaMalloc(&dev.indptr, (dev.cap_req + 1) * 4));
        CUDA_OK(cudaMalloc(&dev.pre, dev.cap_req * 8));
    }
    if ((size_t)rows > dev.cap_rows) {
        if (dev.par) {
            CUDA_OK(cudaFree(dev.par));
            CUDA_OK(cudaFree(dev.pos));
        }
        dev.cap_rows = (size_t)rows * 2;
        CUDA_OK(cudaMalloc(&dev.par, dev.cap_rows * 4));
        CUDA_OK(cudaMalloc(&dev.pos, dev.cap_rows * 8));
    }
    if (mask_bytes > dev.cap_mask) {
        if (dev.mask) CUDA_OK(cudaFree(dev.mask));
        dev.cap_mask = mask_bytes + mask_bytes / 2;
        CUDA_OK(cudaMalloc(&dev.mask, dev.cap_mask));
        CUDA_OK(cudaMemset(dev.mask, 0xA5, dev.cap_mask));
    }
}

struct Opts {
    bool dirty = false;        // keep the mask buffer as the last call left it
    bool positions = true;     // ask for positions
    bool graph = false;        // capture the call in a CUDA graph and launch that
    int64_t mask_delta = 0;    // FlashInfer: mask_bytes = needed + mask_delta
    int64_t mask_offset = 0;   // FlashInfer: the mask starts this many bytes into the buffer
};

static cudaStream_t stream;

// One call of one kind on one case, compared with the reference.
static void run_case(const Case& cs, int32_t kind, const Opts& o) {
    const bool flash = kind == KDT_MASK_FLASHINFER;
    const int64_t B = cs.B, T = cs.N + 1;
    std::vector<int32_t> want_status(B);
    for (int64_t b = 0; b < B; b++) want_status[b] = ref_status(cs, b, flash);
    size_t row_bytes = 0, need = 0;
    std::vector<int32_t> want_indptr(B + 1, 0);
    if (flash) {
        for (int64_t b = 0; b < B; b++) want_indptr[b + 1] = want_indptr[b] + (int32_t)ref_segment_bytes(cs.prefix[b], T);
        need = (size_t)want_indptr[B];
    } else {
        row_bytes = (size_t)row_elems(kind, cs.C) * elem_size(kind);
        need = row_bytes * (size_t)(B * T);
    }
    const size_t mask_bytes = (size_t)((int64_t)need + (flash ? o.mask_delta : 0));
    const bool overflow = flash && mask_bytes < need;
    if (overflow) {
        for (auto& s : want_status) s = KDT_ERR_BUFFER_TOO_SMALL;
        for (auto& x : want_indptr) x = 0;
    }
    const size_t slack = 64;
    ensure(B, B * T, need + (size_t)o.mask_offset + slack);
    if (!o.dirty) CUDA_OK(cudaMemset(dev.mask, 0xA5, need + (size_t)o.mask_offset + slack));
    CUDA_OK(cudaMemset(dev.pos, 0x5A, (size_t)(B * T) * 8));
    CUDA_OK(cudaMemset(dev.status, 0x7F, (size_t)B * 4));
    CUDA_OK(cudaMemset(dev.indptr, 0x3C, (size_t)(B + 1) * 4));
    CUDA_OK(cudaMemcpy(dev.num, cs.num_nodes.data(), (size_t)B * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev.par, cs.parents.data(), (size_t)(B * T) * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev.pre, cs.prefix.data(), (size_t)B * 8, cudaMemcpyHostToDevice));
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = B;
    t.budget = cs.N;
    t.num_nodes = dev.num;
    t.parents = dev.par;
    uint8_t* mask = dev.mask + o.mask_offset;
    int64_t* pos = o.positions ? dev.pos : nullptr;
    if (o.graph) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        const kdt_status st = kdt_tree_attention_mask_cuda(&t, dev.pre, kind, flash ? 0 : cs.C, mask, mask_bytes,
                                                           flash ? dev.indptr : nullptr, pos, dev.status, stream);
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        KDT_OK_OR_DIE(st);
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaGraphLaunch(exec, stream));  // twice: the same result
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaGraphExecDestroy(exec));
        CUDA_OK(cudaGraphDestroy(graph));
    } else {
        KDT_OK_OR_DIE(kdt_tree_attention_mask_cuda(&t, dev.pre, kind, flash ? 0 : cs.C, mask, mask_bytes,
                                                   flash ? dev.indptr : nullptr, pos, dev.status, stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));

    std::vector<int32_t> status(B), indptr(B + 1);
    std::vector<int64_t> positions(B * T);
    std::vector<uint8_t> got(need + (size_t)o.mask_offset + slack);
    CUDA_OK(cudaMemcpy(status.data(), dev.status, (size_t)B * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(indptr.data(), dev.indptr, (size_t)(B + 1) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(positions.data(), dev.pos, (size_t)(B * T) * 8, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got.data(), dev.mask, got.size(), cudaMemcpyDeviceToHost));
    const uint8_t* out = got.data() + o.mask_offset;
    const char* kn = kKindNames[kind];

    int reported = 0;
    std::vector<uint8_t> tree, row;
    for (int64_t b = 0; b < B; b++) {
        EXPECT(status[b] == want_status[b], "%s %s: request %lld status %d, expected %d", cs.what.c_str(), kn,
               (long long)b, status[b], want_status[b]);
        const bool ok = want_status[b] == KDT_OK;
        const int64_t p = cs.prefix[b];
        for (int64_t i = 0; i < T; i++) {
            int64_t depth = 0;
            if (ok) ref_tree_row(cs, b, i, tree, &depth);
            else tree.assign(T, 0);
            if (o.positions) {
                const int64_t want = ok ? p + depth : (p < 0 ? 0 : p);
                EXPECT(positions[b * T + i] == want, "%s %s: request %lld row %lld position %lld, expected %lld",
                       cs.what.c_str(), kn, (long long)b, (long long)i, (long long)positions[b * T + i],
                       (long long)want);
            }
            if (flash) continue;
            ref_dense_row(kind, cs.C, p, ok, i <= cs.num_nodes[b], tree, row);
            const uint8_t* g = out + (size_t)(b * T + i) * row_bytes;
            if (memcmp(g, row.data(), row_bytes) != 0 && reported++ < 3) {
                size_t at = 0;
                while (g[at] == row[at]) at++;
                EXPECT(false, "%s %s: request %lld (p %lld, n %d) row %lld differs at byte %zu: %02x, expected %02x",
                       cs.what.c_str(), kn, (long long)b, (long long)p, cs.num_nodes[b], (long long)i, at, g[at],
                       row[at]);
            }
        }
    }
    if (flash) {
        for (int64_t b = 0; b <= B; b++) {
            EXPECT(indptr[b] == want_indptr[b], "%s %s: indptr[%lld] = %d, expected %d", cs.what.c_str(), kn,
                   (long long)b, indptr[b], want_indptr[b]);
        }
        if (overflow) {  // the mask is untouched
            for (size_t j = 0; j < got.size() && !o.dirty; j++) {
                if (got[j] != 0xA5) {
                    EXPECT(false, "%s %s: overflow, but mask byte %zu was written", cs.what.c_str(), kn, j);
                    break;
                }
            }
        } else {
            for (int64_t b = 0; b < B; b++) {
                const std::vector<uint8_t> seg = ref_segment(cs, b, want_status[b] == KDT_OK);
                const uint8_t* g = out + want_indptr[b];
                if (memcmp(g, seg.data(), seg.size()) != 0 && reported++ < 3) {
                    size_t at = 0;
                    while (g[at] == seg[at]) at++;
                    EXPECT(false, "%s %s: request %lld (p %lld, n %d) segment byte %zu of %zu: %02x, expected %02x",
                           cs.what.c_str(), kn, (long long)b, (long long)cs.prefix[b], cs.num_nodes[b], at, seg.size(),
                           g[at], seg[at]);
                }
            }
        }
    }
    if (!o.dirty) {  // nothing written before or after the output
        for (int64_t j = 0; j < o.mask_offset; j++) EXPECT(got[j] == 0xA5, "%s %s: byte %lld before the mask written",
                                                           cs.what.c_str(), kn, (long long)j);
        for (size_t j = (size_t)o.mask_offset + need; j < got.size(); j++) {
            if (got[j] != 0xA5) {
                EXPECT(false, "%s %s: byte %zu past the output (%zu bytes) was written", cs.what.c_str(), kn,
                       j - (size_t)o.mask_offset, need);
                break;
            }
        }
    }
}

// ---- Cases ------------------------------------------------------------------------------

// Hand-made tree for request b: shape 0 random recursive, 1 chain, 2 star, 3 bushy (parent
// among the last few nodes). Padding rows' parents are -1 or garbage (never read).
static void hand_tree(Case& cs, int64_t b, int shape) {
    const int64_t T = cs.N + 1;
    const int32_t n = (int32_t)(unit() < 0.3 ? cs.N : uniform(0, cs.N));
    cs.num_nodes[b] = n;
    int32_t* par = &cs.parents[b * T];
    par[0] = -1;
    for (int64_t i = 1; i <= n; i++) {
        switch (shape) {
            case 0: par[i] = (int32_t)uniform(0, i - 1); break;
            case 1: par[i] = (int32_t)(i - 1); break;
            case 2: par[i] = 0; break;
            default: par[i] = (int32_t)uniform(i > 4 ? i - 4 : 0, i - 1); break;
        }
    }
    for (int64_t i = n + 1; i < T; i++) par[i] = unit() < 0.3 ? (int32_t)next_u64() : -1;
}

// Trees from kdt_trees_build_cpu on random drafts; its visibility output must agree with
// the reference's tree columns.
static void builder_trees(Case& cs) {
    const int64_t B = cs.B, N = cs.N, T = N + 1;
    const int64_t L = uniform(1, 12), K = uniform(1, 6), vocab = K + 5;
    std::vector<float> lp((size_t)(B * L * K));
    std::vector<int32_t> ids((size_t)(B * L * K));
    for (int64_t row = 0; row < B * L; row++) {
        float x = -(float)(unit() * 0.5);
        std::vector<int32_t> perm(vocab);
        for (int64_t v = 0; v < vocab; v++) perm[v] = (int32_t)v;
        for (int64_t r = 0; r < K; r++) {
            const int64_t j = uniform(r, vocab - 1);
            const int32_t tmp = perm[r];
            perm[r] = perm[j];
            perm[j] = tmp;
            lp[row * K + r] = x;
            ids[row * K + r] = perm[r];
            x -= (float)(unit() * 3.0);
        }
    }
    const bool vis = T <= 300;
    std::vector<uint8_t> visibility(vis ? (size_t)(B * T * T) : 0);
    kdt_draft d = {B, L, K, lp.data(), ids.data(), nullptr, nullptr, vocab, -1};
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = B;
    t.budget = N;
    t.num_nodes = cs.num_nodes.data();
    t.parents = cs.parents.data();
    t.visibility = vis ? visibility.data() : nullptr;
    KDT_OK_OR_DIE(kdt_trees_build_cpu(&d, &t, nullptr, 0));
    if (!vis) return;
    std::vector<uint8_t> tree;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t i = 0; i < T; i++) {
            int64_t depth;
            ref_tree_row(cs, b, i, tree, &depth);
            EXPECT(memcmp(tree.data(), &visibility[(b * T + i) * T], T) == 0,
                   "reference and builder visibility differ: request %lld row %lld", (long long)b, (long long)i);
        }
    }
}

// A case of B requests, budget N, prefixes up to pmax; `faults`: some requests invalid.
static Case make_case(int64_t B, int64_t N, int64_t pmax, bool builder, bool faults, const char* what) {
    Case cs;
    cs.B = B;
    cs.N = N;
    const int64_t T = N + 1;
    cs.num_nodes.assign(B, 0);
    cs.parents.assign(B * T, -1);
    cs.prefix.assign(B, 0);
    if (builder) builder_trees(cs);
    else
        for (int64_t b = 0; b < B; b++) hand_tree(cs, b, (int)uniform(0, 3));
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const double u = unit();
        cs.prefix[b] = u < 0.15 ? 0 : u < 0.4 ? uniform(0, 40 < pmax ? 40 : pmax) : uniform(0, pmax);
        if (cs.prefix[b] > longest) longest = cs.prefix[b];
    }
    cs.C = longest + T + (unit() < 0.3 ? 0 : uniform(0, 70));
    if (faults && B > 1) {
        for (int64_t b = 0; b < B; b++) {
            if (unit() > 0.15) continue;
            const int32_t n = cs.num_nodes[b];
            int64_t fault = uniform(0, 3);
            if (fault == 0 && n < 1) fault = 1;  // a root-only tree has no parent to spoil
            switch (fault) {
                case 0: {
                    const int64_t i = uniform(1, n);
                    const int64_t choice = uniform(0, 3);
                    cs.parents[b * T + i] =
                        (int32_t)(choice == 0 ? i : choice == 1 ? -1 : choice == 2 ? i + uniform(1, 5) : -100);
                    break;
                }
                case 1: {
                    const int64_t choice = uniform(0, 2);
                    cs.num_nodes[b] = choice == 0 ? (int32_t)(N + 1) : choice == 1 ? -1 : INT32_MAX;
                    break;
                }
                case 2: cs.prefix[b] = unit() < 0.5 ? -1 : -uniform(2, 100000); break;
                default: cs.prefix[b] = cs.C - T + uniform(1, 50); break;  // too long for the dense kinds
            }
        }
    }
    cs.what = what;
    cs.what += " B=" + std::to_string(B) + " N=" + std::to_string(N) + " C=" + std::to_string(cs.C);
    return cs;
}

static void run_all_kinds(const Case& cs, bool graph_some) {
    for (int32_t kind = 0; kind <= KDT_MASK_FLASHINFER; kind++) {
        Opts o;
        o.positions = unit() < 0.8;
        o.graph = graph_some && unit() < 0.3;
        if (kind == KDT_MASK_FLASHINFER) {
            o.mask_offset = uniform(0, 3);  // segments start at any byte
            o.mask_delta = uniform(0, 5);
        } else {
            o.mask_offset = (int64_t)elem_size(kind) * uniform(0, 3);  // rows start at any element
        }
        run_case(cs, kind, o);
    }
}

// ---- Host-side checks and special cases -------------------------------------------------

static void host_errors() {
    Case cs = make_case(2, 4, 3, false, false, "host");
    const int64_t T = 5;
    ensure(2, 2 * T, 4096);
    CUDA_OK(cudaMemcpy(dev.num, cs.num_nodes.data(), 8, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev.par, cs.parents.data(), 2 * T * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev.pre, cs.prefix.data(), 16, cudaMemcpyHostToDevice));
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = 2;
    t.budget = 4;
    t.num_nodes = dev.num;
    t.parents = dev.par;
    const int64_t C = cs.C;
    const size_t bool_bytes = (size_t)(2 * T * C);
    uint8_t* m = dev.mask;
    void* s = stream;
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(nullptr, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 6, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, -1, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, T - 1, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_SHAPE);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, -1, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 5, 7, m, 4096, dev.indptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 5, 0, m, 4096, nullptr, nullptr, dev.status, s),
                  KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, C, m, bool_bytes, dev.indptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, C, nullptr, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, C, m, bool_bytes - 1, nullptr, nullptr, dev.status, s),
                  KDT_ERR_BUFFER_TOO_SMALL);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 2, C, m, 4 * bool_bytes - 1, nullptr, nullptr, dev.status, s),
                  KDT_ERR_BUFFER_TOO_SMALL);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, INT64_MAX / 4, m, SIZE_MAX, nullptr, nullptr, dev.status, s),
                  KDT_ERR_OVERFLOW);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 2, C, m + 2, 4 * bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, nullptr, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_NULL_POINTER);
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, nullptr, s),
                  KDT_ERR_NULL_POINTER);
    kdt_trees bad = t;
    bad.parents = nullptr;
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&bad, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_NULL_POINTER);
    bad = t;
    bad.num_nodes = nullptr;
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&bad, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_NULL_POINTER);
    bad = t;
    bad.budget = -1;
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&bad, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    bad = t;
    bad.batch = -1;
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&bad, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s),
                  KDT_ERR_INVALID_ARGUMENT);
    // An empty batch: nothing to write for the dense kinds, mask_indptr = [0] for FlashInfer.
    bad = t;
    bad.batch = 0;
    bad.num_nodes = nullptr;
    bad.parents = nullptr;
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&bad, nullptr, 0, C, nullptr, 0, nullptr, nullptr, nullptr, s), KDT_OK);
    CUDA_OK(cudaMemset(dev.indptr, 0x3C, 4));
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&bad, nullptr, 5, 0, nullptr, 0, dev.indptr, nullptr, nullptr, s), KDT_OK);
    int32_t first = -1;
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(&first, dev.indptr, 4, cudaMemcpyDeviceToHost));
    EXPECT(first == 0, "empty FlashInfer batch: indptr[0] = %d", first);
    // Exactly enough room: fine.
    EXPECT_STATUS(kdt_tree_attention_mask_cuda(&t, dev.pre, 0, C, m, bool_bytes, nullptr, nullptr, dev.status, s), KDT_OK);
    CUDA_OK(cudaStreamSynchronize(stream));
}

// A FlashInfer batch whose segments exceed INT32_MAX bytes (a prefix of 10^11), with a
// mask_bytes that claims room for it: every request fails, nothing is written.
static void flashinfer_int32_overflow() {
    Case cs = make_case(3, 7, 20, false, false, "int32 overflow");
    cs.prefix[1] = 100000000000LL;
    const int64_t T = 8;
    ensure(3, 3 * T, 4096);
    CUDA_OK(cudaMemset(dev.mask, 0xA5, 4096));
    CUDA_OK(cudaMemset(dev.indptr, 0x3C, 16));
    CUDA_OK(cudaMemcpy(dev.num, cs.num_nodes.data(), 12, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev.par, cs.parents.data(), 3 * T * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dev.pre, cs.prefix.data(), 24, cudaMemcpyHostToDevice));
    kdt_trees t;
    memset(&t, 0, sizeof t);
    t.batch = 3;
    t.budget = 7;
    t.num_nodes = dev.num;
    t.parents = dev.par;
    KDT_OK_OR_DIE(kdt_tree_attention_mask_cuda(&t, dev.pre, KDT_MASK_FLASHINFER, 0, dev.mask, SIZE_MAX / 2, dev.indptr,
                                               dev.pos, dev.status, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    int32_t status[3], indptr[4];
    std::vector<uint8_t> got(4096);
    std::vector<int64_t> pos(3 * T);
    CUDA_OK(cudaMemcpy(status, dev.status, 12, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(indptr, dev.indptr, 16, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(got.data(), dev.mask, 4096, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(pos.data(), dev.pos, 3 * T * 8, cudaMemcpyDeviceToHost));
    for (int b = 0; b < 3; b++) {
        EXPECT(status[b] == KDT_ERR_BUFFER_TOO_SMALL, "int32 overflow: request %d status %d", b, status[b]);
        for (int64_t i = 0; i < T; i++) {
            EXPECT(pos[b * T + i] == cs.prefix[b], "int32 overflow: request %d row %lld position %lld", b,
                   (long long)i, (long long)pos[b * T + i]);
        }
    }
    for (int b = 0; b < 4; b++) EXPECT(indptr[b] == 0, "int32 overflow: indptr[%d] = %d", b, indptr[b]);
    for (size_t j = 0; j < got.size(); j++) {
        if (got[j] != 0xA5) {
            EXPECT(false, "int32 overflow: mask byte %zu written", j);
            break;
        }
    }
}

int main(int argc, char** argv) {
    int32_t devices = 0;
    if (kdt_cuda_device_count(&devices) != KDT_OK) {
        printf("SKIP: %s\n", kdt_last_error());
        return 77;
    }
    set_forced_paths(argc, argv);
    const bool quick = getenv("KDT_CUDA_QUICK") != nullptr && atoi(getenv("KDT_CUDA_QUICK")) != 0;
    CUDA_OK(cudaStreamCreate(&stream));
    host_errors();
    flashinfer_int32_overflow();

    // Random cases: every kind on the same trees.
    static const int64_t kBudgets[] = {0, 1, 2, 3, 7, 15, 19, 31, 32, 33, 63, 64, 65, 100, 127, 200, 255, 257};
    const int iterations = quick ? 10 : 70;
    for (int it = 0; it < iterations; it++) {
        const int64_t N = kBudgets[uniform(0, (int64_t)(sizeof kBudgets / sizeof kBudgets[0]) - 1)];
        const int64_t T = N + 1;
        int64_t pmax = unit() < 0.2 ? 40 : unit() < 0.7 ? 600 : 3000;
        int64_t B = uniform(1, N <= 64 ? 64 : 12);
        while (B > 1 && B * T * (pmax + T) > 1500000) B /= 2;  // host reference time
        const Case cs = make_case(B, N, pmax, unit() < 0.4, true, "random");
        run_all_kinds(cs, it % 5 == 0);
    }

    // FlashInfer: one byte short of the segments (every request fails, nothing written),
    // then exactly enough.
    {
        const Case cs = make_case(5, 19, 300, false, true, "capacity");
        Opts o;
        o.mask_delta = -1;
        o.mask_offset = 1;
        run_case(cs, KDT_MASK_FLASHINFER, o);
        o.mask_delta = 0;
        run_case(cs, KDT_MASK_FLASHINFER, o);
        o.mask_delta = -1;
        o.graph = true;
        run_case(cs, KDT_MASK_FLASHINFER, o);
    }

    // A buffer left dirty by a larger tree: the smaller call must equal a fresh one.
    {
        const Case big = make_case(6, 150, 500, true, false, "reuse (large)");
        const Case small = make_case(4, 20, 100, false, true, "reuse (small)");
        for (int32_t kind = 0; kind <= KDT_MASK_FLASHINFER; kind++) {
            Opts o;
            run_case(big, kind, o);
            o.dirty = true;
            run_case(small, kind, o);
        }
    }

    // Long prefixes and large budgets.
    if (!quick) {
        const Case long_prefix = make_case(2, 64, 100000, true, true, "long prefix");
        Case far = long_prefix;
        far.prefix[0] = 100000;
        far.C = 100000 + 65 + 13;
        run_all_kinds(far, false);
        const Case wide = make_case(2, 4096, 300, false, true, "budget 4096");
        for (int32_t kind : {KDT_MASK_BOOL, KDT_MASK_BITS, KDT_MASK_ADDITIVE_BF16, KDT_MASK_FLASHINFER}) {
            Opts o;
            o.mask_offset = kind == KDT_MASK_FLASHINFER ? 3 : 0;
            run_case(wide, kind, o);
        }
        const Case mid = make_case(3, 1025, 2000, true, true, "budget 1025");
        run_all_kinds(mid, true);
        // More requests than a grid's y extent (65,535): blocks loop over requests.
        const Case many = make_case(70000, 1, 5, false, true, "batch 70000");
        run_case(many, KDT_MASK_BITS, Opts());
        run_case(many, KDT_MASK_FLASHINFER, Opts());
    } else {
        const Case mid = make_case(2, 1025, 200, false, true, "budget 1025");
        run_case(mid, KDT_MASK_BITS, Opts());
        run_case(mid, KDT_MASK_FLASHINFER, Opts());
    }

    CUDA_OK(cudaStreamDestroy(stream));
    printf("cuda masks: %lld checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
