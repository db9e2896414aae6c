// CUDA kernels of kdtree's torch operators (kdtree.torch_ops), in C++: this library defines
// the operators' schemas (TORCH_LIBRARY_FRAGMENT) and their CUDA kernels
// (TORCH_LIBRARY_IMPL); kdtree.torch_ops registers the CPU kernels (the Python functions)
// and the fake kernels on them. Without this library kdtree.torch_ops defines the same
// operators in Python (torch.library.custom_op). A call then costs torch's C++
// dispatch and the library's host-side checks instead of Python: the same libkdtree calls
// as kdtree.topk_logprobs, build_trees, verify_greedy_from_logits and compact_kv on the
// same tensors, so the results are the same bits.
//
// Only the *_status operators (errors="status") have C++ CUDA kernels: they return the
// statuses and read nothing back, so a round of them can be captured in a CUDA graph; a
// bad argument is a ValueError (TypeError for a dtype) naming it. The raising operators
// read the statuses back (a synchronisation) and raise naming the first failed request or
// row; on CUDA their kernels are the Python functions (kdtree.torch_ops). (A C++ raise after
// the call's kernels, with the outputs and the device guard alive, crashed the process on
// an H100 and an H200 on 2026-12-05, 9d4c2df, while the same raise before any kernel did
// not; not diagnosed further.)
//
// Needs only torch's CPU headers (c10::Stream::native_handle gives the cudaStream_t), so it
// builds where torch has no CUDA; libkdtree built without CUDA answers KDT_ERR_UNSUPPORTED.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kdtree.h"

namespace {

using at::Tensor;

[[noreturn]] void fail(const std::string& what, const std::string& msg) {
    TORCH_CHECK_VALUE(false, "kdtree.torch_ops.", what, ": ", msg);
}

[[noreturn]] void fail_type(const std::string& what, const std::string& msg) {
    TORCH_CHECK_TYPE(false, "kdtree.torch_ops.", what, ": ", msg);
}

// A libkdtree call's status: KDT_OK, or its last error raised.
void check(kdt_status st, const char* what) {
    if (st != KDT_OK) fail(what, std::string(kdt_status_string(st)) + ": " + kdt_last_error());
}

void* stream_of(const Tensor& t) {
    const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    return impl->getStream(t.device()).native_handle();
}

std::string shape_str(const Tensor& t) {
    std::ostringstream s;
    s << t.sizes();
    return s.str();
}

// `t` on the CUDA device of `like` (the call's first tensor, itself checked by
// require_primary): the dispatcher picks these kernels when any argument is a CUDA tensor.
void require_cuda(const Tensor& t, const Tensor& like, const char* what, const char* name) {
    if (!t.is_cuda() || t.device() != like.device()) {
        std::ostringstream s;
        s << name << " is on " << t.device() << ", the call's other tensors on " << like.device();
        fail(what, s.str());
    }
}

void require_primary(const Tensor& t, const char* what, const char* name) {
    if (!t.is_cuda()) {
        std::ostringstream s;
        s << name << " is on " << t.device() << " while another argument is a CUDA tensor; pass them all on one "
          << "device";
        fail(what, s.str());
    }
}

void require_dtype(const Tensor& t, at::ScalarType dtype, const char* what, const char* name) {
    if (t.scalar_type() != dtype) {
        std::ostringstream s;
        s << name << " must have dtype " << dtype << ", got " << t.scalar_type();
        fail_type(what, s.str());
    }
}

void require_contiguous(const Tensor& t, const char* what, const char* name) {
    if (!t.is_contiguous()) fail(what, std::string(name) + " must be C-contiguous (shape " + shape_str(t) + ")");
}

Tensor device_empty(const Tensor& like, at::IntArrayRef shape, at::ScalarType dtype) {
    return at::empty(shape, like.options().dtype(dtype));
}

Tensor workspace(const Tensor& like, size_t bytes) {
    return device_empty(like, {static_cast<int64_t>(std::max<size_t>(bytes, 1))}, at::kByte);
}

int32_t logits_code(const Tensor& t, const char* what, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return KDT_DTYPE_FLOAT32;
        case at::kHalf: return KDT_DTYPE_FLOAT16;
        case at::kBFloat16: return KDT_DTYPE_BFLOAT16;
        default: fail_type(what, std::string(name) + " must be float32, float16 or bfloat16");
    }
}

// kdt_logits of a [B, L, V] tensor; [R, V] is R rows (rows = true) or one request of R
// rows; [V] one row. The vocab axis must have stride 1.
kdt_logits logits_struct(const Tensor& t, const char* what, const char* name, bool rows) {
    kdt_logits s{};
    s.dtype = logits_code(t, what, name);
    s.data = t.data_ptr();
    const int64_t d = t.dim();
    if (d == 1) {
        s.batch = 1, s.length = 1, s.vocab = t.size(0);
    } else if (d == 2 && rows) {
        s.batch = t.size(0), s.length = 1, s.vocab = t.size(1), s.batch_stride = t.stride(0);
    } else if (d == 2) {
        s.batch = 1, s.length = t.size(0), s.vocab = t.size(1), s.row_stride = t.stride(0);
    } else if (d == 3) {
        s.batch = t.size(0), s.length = t.size(1), s.vocab = t.size(2);
        s.batch_stride = t.stride(0), s.row_stride = t.stride(1);
    } else {
        fail(what, std::string(name) + " must be [B, L, V], [R, V] or [V], got shape " + shape_str(t));
    }
    if (s.vocab > 1 && t.stride(d - 1) != 1) {
        fail(what, std::string(name) + ": the vocab axis must be contiguous (stride 1)");
    }
    if (s.batch_stride < 0 || s.row_stride < 0) fail(what, std::string(name) + ": negative strides");
    return s;
}

// ---- topk_logprobs ---------------------------------------------------------------------

// The statuses are returned, never read back (no synchronisation).
std::tuple<Tensor, Tensor, Tensor> topk_logprobs_status(const Tensor& logits_in, int64_t k) {
    const char* what = "topk_logprobs_status";
    if (logits_in.dim() < 1) fail(what, "logits must have at least one dimension [..., V]");
    const int64_t vocab = logits_in.size(-1);
    if (k < 0 || k > std::min<int64_t>(vocab, 1024)) {
        fail(what, "k must be in [0, min(V=" + std::to_string(vocab) + ", 1024)] on the GPU, got " +
                       std::to_string(k));
    }
    require_primary(logits_in, what, "logits");
    c10::DeviceGuard guard(logits_in.device());
    std::vector<int64_t> lead(logits_in.sizes().begin(), logits_in.sizes().end() - 1);
    // more than two leading axes: rows of one [R, V] view (a copy where the strides do not merge)
    if (logits_in.dim() > 3 && vocab == 0) fail(what, "logits has an empty vocabulary axis");
    const Tensor logits = logits_in.dim() > 3 ? logits_in.reshape({-1, vocab}) : logits_in;
    kdt_logits s = logits_struct(logits, what, "logits", true);
    const int64_t rows = s.batch * s.length;
    std::vector<int64_t> out_shape = lead;
    out_shape.push_back(k);
    Tensor lp = device_empty(logits, out_shape, at::kFloat);
    Tensor ids = device_empty(logits, out_shape, at::kInt);
    Tensor status = device_empty(logits, lead.empty() ? std::vector<int64_t>{1} : lead, at::kInt);
    size_t need = 0;
    check(kdt_topk_logprobs_cuda_workspace_bytes(rows, vocab, k, &need), what);
    Tensor ws = workspace(logits, need);
    check(kdt_topk_logprobs_cuda(&s, k, lp.data_ptr<float>(), ids.data_ptr<int32_t>(), status.data_ptr<int32_t>(),
                                 ws.data_ptr(), need, stream_of(logits)),
          what);
    return {lp, ids, status};
}

// ---- the trees' fields -------------------------------------------------------------------

constexpr int kFields = 10;
constexpr int64_t kMaxBudget = (int64_t{1} << 31) - 3;  // node indices are int32 (kdtree.checks.MAX_BUDGET)
const std::array<const char*, kFields> kFieldNames = {"num_nodes", "tokens",          "depths",     "parents",
                                                      "logw",      "positions",       "visibility", "visibility_bits",
                                                      "first_child", "next_sibling"};
const std::array<at::ScalarType, kFields> kFieldTypes = {at::kInt,  at::kInt,  at::kInt,  at::kInt,
                                                         at::kDouble, at::kLong, at::kBool, at::kUInt32,
                                                         at::kInt,  at::kInt};

std::array<std::vector<int64_t>, kFields> field_shapes(int64_t batch, int64_t budget) {
    const int64_t rows = budget + 1, words = (rows + 31) / 32;
    std::array<std::vector<int64_t>, kFields> s;
    for (int f = 0; f < kFields; f++) s[f] = {batch, rows};
    s[0] = {batch};
    s[6] = {batch, rows, rows};
    s[7] = {batch, rows, words};
    return s;
}

kdt_trees trees_struct(at::TensorList fields, int64_t budget, const char* what) {
    if (fields.size() != kFields) {
        fail(what, "fields must be the ten tree fields (kdtree.torch_ops.TREE_FIELDS order), got " +
                       std::to_string(fields.size()) + " tensors");
    }
    if (budget < 0 || budget > kMaxBudget) fail(what, "budget " + std::to_string(budget) + " outside [0, 2^31 - 3]");
    const Tensor& first = fields[0];
    if (first.dim() != 1) fail(what, "trees.num_nodes must be [B], got shape " + shape_str(first));
    const int64_t batch = first.size(0);
    const auto shapes = field_shapes(batch, budget);
    for (int f = 0; f < kFields; f++) {
        const std::string name = std::string("trees.") + kFieldNames[f];
        require_cuda(fields[f], first, what, name.c_str());
        const bool bytes = f == 6 && fields[f].scalar_type() == at::kByte;  // visibility: bool or uint8
        if (!bytes) require_dtype(fields[f], kFieldTypes[f], what, name.c_str());
        if (fields[f].sizes() != at::IntArrayRef(shapes[f])) {
            fail(what, name + " must have shape " + c10::str(at::IntArrayRef(shapes[f])) + " for budget " +
                           std::to_string(budget) + ", got " + shape_str(fields[f]));
        }
        require_contiguous(fields[f], what, name.c_str());
    }
    kdt_trees t{};
    t.batch = batch;
    t.budget = budget;
    t.num_nodes = fields[0].data_ptr<int32_t>();
    t.tokens = fields[1].data_ptr<int32_t>();
    t.depths = fields[2].data_ptr<int32_t>();
    t.parents = fields[3].data_ptr<int32_t>();
    t.logw = fields[4].data_ptr<double>();
    t.positions = fields[5].data_ptr<int64_t>();
    t.visibility = static_cast<uint8_t*>(fields[6].data_ptr());
    t.visibility_bits = static_cast<uint32_t*>(fields[7].data_ptr());
    t.first_child = fields[8].data_ptr<int32_t>();
    t.next_sibling = fields[9].data_ptr<int32_t>();
    return t;
}

// An optional small device input: int tensor of `n` entries (or 0-d, repeated) as `dtype`.
std::optional<Tensor> small_input(const std::optional<Tensor>& t, const Tensor& like, at::ScalarType dtype,
                                  int64_t n, const char* what, const char* name) {
    if (!t.has_value()) return std::nullopt;
    const Tensor& x = *t;
    require_cuda(x, like, what, name);
    // integer dtypes whose every value the target holds (no wrap: an int64 budget of 2^32
    // must not become 0); others raise
    const at::ScalarType st = x.scalar_type();
    const bool narrow = st == at::kByte || st == at::kChar || st == at::kShort || st == at::kInt;
    const bool fits = dtype == at::kInt ? narrow : (narrow || st == at::kLong || st == at::kUInt16 || st == at::kUInt32);
    if (!fits) {
        fail_type(what, std::string(name) + " must be an integer tensor of dtype " + c10::toString(dtype) +
                            " or a narrower one, got " + c10::toString(st));
    }
    if (!(x.dim() == 0 || (x.dim() == 1 && x.size(0) == n))) {
        fail(what, std::string(name) + " must have shape [" + std::to_string(n) + "] (or be 0-d), got " +
                       shape_str(x));
    }
    Tensor y = x.scalar_type() == dtype ? x : x.to(dtype);
    if (y.dim() == 0) y = y.expand({n});
    return y.contiguous();
}

// ---- build_trees ---------------------------------------------------------------------------

using ElevenTensors =
    std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

ElevenTensors build_impl(const Tensor& logprobs, const Tensor& token_ids, int64_t budget,
                         const std::optional<Tensor>& root_tokens, const std::optional<Tensor>& root_positions,
                         int64_t pad_token, const std::optional<Tensor>& request_budgets,
                         const std::optional<Tensor>& request_depths) {
    const char* what = "build_trees_status";
    require_primary(logprobs, what, "logprobs");
    c10::DeviceGuard guard(logprobs.device());
    require_dtype(logprobs, at::kFloat, what, "logprobs");
    require_dtype(token_ids, at::kInt, what, "token_ids");
    require_cuda(token_ids, logprobs, what, "token_ids");
    if (logprobs.dim() != 3 && logprobs.dim() != 2) {
        fail(what, "logprobs must be [B, L, K] (or [L, K], one request), got shape " + shape_str(logprobs));
    }
    if (token_ids.sizes() != logprobs.sizes()) {
        fail(what, "token_ids has shape " + shape_str(token_ids) + ", logprobs " + shape_str(logprobs));
    }
    require_contiguous(logprobs, what, "logprobs");
    require_contiguous(token_ids, what, "token_ids");
    if (budget < 0 || budget > kMaxBudget) {
        fail(what, "budget must be in [0, 2^31 - 3], got " + std::to_string(budget));
    }
    if (pad_token < INT32_MIN || pad_token > INT32_MAX) fail(what, "pad_token must fit int32");
    const bool one = logprobs.dim() == 2;
    const int64_t batch = one ? 1 : logprobs.size(0);
    const int64_t depth = logprobs.size(one ? 0 : 1), width = logprobs.size(one ? 1 : 2);
    const auto roots = small_input(root_tokens, logprobs, at::kInt, batch, what, "root_tokens");
    const auto positions = small_input(root_positions, logprobs, at::kLong, batch, what, "root_positions");
    const auto budgets = small_input(request_budgets, logprobs, at::kInt, batch, what, "request_budgets");
    const auto depths = small_input(request_depths, logprobs, at::kInt, batch, what, "request_depths");
    const auto shapes = field_shapes(batch, budget);
    std::array<Tensor, kFields> f;
    for (int i = 0; i < kFields; i++) f[i] = device_empty(logprobs, shapes[i], kFieldTypes[i]);
    kdt_trees t{};
    t.batch = batch;
    t.budget = budget;
    t.num_nodes = f[0].data_ptr<int32_t>();
    t.tokens = f[1].data_ptr<int32_t>();
    t.depths = f[2].data_ptr<int32_t>();
    t.parents = f[3].data_ptr<int32_t>();
    t.logw = f[4].data_ptr<double>();
    t.positions = f[5].data_ptr<int64_t>();
    t.visibility = static_cast<uint8_t*>(f[6].data_ptr());
    t.visibility_bits = static_cast<uint32_t*>(f[7].data_ptr());
    t.first_child = f[8].data_ptr<int32_t>();
    t.next_sibling = f[9].data_ptr<int32_t>();
    kdt_draft d{};
    d.batch = batch;
    d.depth = depth;
    d.width = width;
    d.logprobs = logprobs.data_ptr<float>();
    d.token_ids = token_ids.data_ptr<int32_t>();
    d.root_tokens = roots ? roots->data_ptr<int32_t>() : nullptr;
    d.root_positions = positions ? positions->data_ptr<int64_t>() : nullptr;
    d.vocab_size = 0;
    d.pad_token = static_cast<int32_t>(pad_token);
    d.request_budgets = budgets ? budgets->data_ptr<int32_t>() : nullptr;
    d.request_depths = depths ? depths->data_ptr<int32_t>() : nullptr;
    Tensor status = device_empty(logprobs, {batch}, at::kInt);
    size_t need = 0;
    check(kdt_trees_build_cuda_workspace_bytes(batch, budget, depth, width, &need), what);
    Tensor ws = workspace(logprobs, need);
    check(kdt_trees_build_cuda(&d, &t, status.data_ptr<int32_t>(), ws.data_ptr(), need, stream_of(logprobs)), what);
    return {f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], status};
}

ElevenTensors build_trees_status(const Tensor& logprobs, const Tensor& token_ids, int64_t budget,
                                 const std::optional<Tensor>& root_tokens,
                                 const std::optional<Tensor>& root_positions, int64_t pad_token,
                                 const std::optional<Tensor>& request_budgets,
                                 const std::optional<Tensor>& request_depths) {
    return build_impl(logprobs, token_ids, budget, root_tokens, root_positions, pad_token, request_budgets,
                      request_depths);
}

// ---- verify_greedy_from_logits ---------------------------------------------------------------

// Small device arrays made from host values once and kept for the life of the process (a
// serving loop passes the same stop tokens and the same caches every round; a CUDA graph
// that captured a call reads its array at every replay, so none is ever freed), keyed by
// the device, the dtype and the values.
struct DeviceValues {
    std::mutex mu;
    std::unordered_map<std::string, Tensor> cache;

    Tensor get(const Tensor& like, const std::vector<int64_t>& values, at::ScalarType dtype) {
        std::string key(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t));
        key += static_cast<char>(like.device().index());
        key += static_cast<char>(dtype);
        std::lock_guard<std::mutex> lock(mu);
        auto it = cache.find(key);
        if (it != cache.end()) return it->second;
        Tensor h = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
        std::copy(values.begin(), values.end(), h.data_ptr<int64_t>());
        Tensor d = h.to(dtype).to(like.device());
        cache.emplace(std::move(key), d);
        return d;
    }
};

// A device copy of the stop tokens (int32).
Tensor stop_tokens_on(const Tensor& like, at::IntArrayRef stops, const char* what) {
    static DeviceValues* tables = new DeviceValues;  // never destroyed: no frees after CUDA shuts down
    for (int64_t x : stops) {
        if (x < INT32_MIN || x > INT32_MAX) fail(what, "stop token " + std::to_string(x) + " outside int32");
    }
    return tables->get(like, std::vector<int64_t>(stops.begin(), stops.end()), at::kInt);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> verify_impl(at::TensorList fields, int64_t budget, int64_t depth,
                                                       const Tensor& target_logits, at::IntArrayRef stop_tokens,
                                                       const std::optional<Tensor>& max_commit) {
    const char* what = "verify_greedy_from_logits_status";
    if (fields.empty()) fail(what, "fields is empty");
    require_primary(fields[0], what, "trees.num_nodes");
    c10::DeviceGuard guard(fields[0].device());
    kdt_trees t = trees_struct(fields, budget, what);
    if (depth < 0 || depth > INT32_MAX - 1) fail(what, "depth " + std::to_string(depth) + " out of range");
    require_cuda(target_logits, fields[0], what, "target_logits");
    kdt_logits lg = logits_struct(target_logits, what, "target_logits", false);
    const int64_t batch = t.batch, width = std::min(depth, budget) + 1;
    Tensor stops;
    if (!stop_tokens.empty()) stops = stop_tokens_on(fields[0], stop_tokens, what);
    const auto caps = small_input(max_commit, fields[0], at::kLong, batch, what, "max_commit");
    Tensor accepted = device_empty(fields[0], {batch, width}, at::kInt);
    Tensor length = device_empty(fields[0], {batch}, at::kInt);
    Tensor bonus = device_empty(fields[0], {batch}, at::kInt);
    Tensor status = device_empty(fields[0], {batch}, at::kInt);
    check(kdt_verify_greedy_from_logits_cuda(&t, &lg, stops.defined() ? stops.data_ptr<int32_t>() : nullptr,
                                             static_cast<int64_t>(stop_tokens.size()), nullptr,
                                             caps ? caps->data_ptr<int64_t>() : nullptr, width,
                                             accepted.data_ptr<int32_t>(), length.data_ptr<int32_t>(),
                                             bonus.data_ptr<int32_t>(), nullptr, status.data_ptr<int32_t>(),
                                             stream_of(fields[0])),
          what);
    return {accepted, length, bonus, status};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> verify_greedy_from_logits_status(
    at::TensorList fields, int64_t budget, int64_t depth, const Tensor& target_logits, at::IntArrayRef stop_tokens,
    const std::optional<Tensor>& max_commit) {
    return verify_impl(fields, budget, depth, target_logits, stop_tokens, max_commit);
}

// ---- compact_kv ---------------------------------------------------------------------------

int32_t kv_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return KDT_DTYPE_FLOAT32;
        case at::kHalf: return KDT_DTYPE_FLOAT16;
        case at::kBFloat16: return KDT_DTYPE_BFLOAT16;
        case at::kByte:
        case at::kChar:
        case at::kFloat8_e4m3fn:
        case at::kFloat8_e5m2: return KDT_DTYPE_UINT8;  // one-byte caches move as bytes
        default: return -1;
    }
}

// A device table of the layers' base pointers.
Tensor pointer_table(const Tensor& like, const std::vector<int64_t>& ptrs) {
    static DeviceValues* tables = new DeviceValues;  // never destroyed: no frees after CUDA shuts down
    return tables->get(like, ptrs, at::kLong);
}

Tensor compact_impl(at::TensorList k_layers, at::TensorList v_layers, const Tensor& prefix_lengths,
                    const Tensor& accepted_nodes, const Tensor& accept_length) {
    const char* what = "compact_kv_status";
    if (k_layers.empty()) fail(what, "k_layers is empty");
    if (v_layers.size() != k_layers.size()) {
        fail(what, std::to_string(k_layers.size()) + " K layers but " + std::to_string(v_layers.size()) + " V layers");
    }
    const Tensor& first = k_layers[0];
    require_primary(first, what, "k_layers[0]");
    c10::DeviceGuard guard(first.device());
    const int32_t code = kv_code(first.scalar_type());
    if (code < 0) {
        fail_type(what, std::string("the cache dtype must be float16, bfloat16, float32 or a one-byte type, got ") +
                            c10::toString(first.scalar_type()));
    }
    if (first.dim() != 4) fail(what, "the caches must be [B, H, S, D], got shape " + shape_str(first));
    std::vector<int64_t> kp, vp;
    for (size_t i = 0; i < 2 * k_layers.size(); i++) {
        const bool is_k = i < k_layers.size();
        const Tensor& x = is_k ? k_layers[i] : v_layers[i - k_layers.size()];
        const std::string name =
            std::string(is_k ? "k_layers[" : "v_layers[") + std::to_string(is_k ? i : i - k_layers.size()) + "]";
        require_cuda(x, first, what, name.c_str());
        if (x.scalar_type() != first.scalar_type() || x.sizes() != first.sizes() || x.strides() != first.strides()) {
            fail(what, "every K and V layer must share shape, strides and dtype; " + name + " has " + shape_str(x) +
                           " " + c10::toString(x.scalar_type()) + ", k_layers[0] " + shape_str(first) + " " +
                           c10::toString(first.scalar_type()));
        }
        if (x.requires_grad()) fail(what, name + " requires grad; compaction writes the caches in place");
        (i < k_layers.size() ? kp : vp).push_back(reinterpret_cast<int64_t>(x.data_ptr()));
    }
    std::vector<int64_t> all(kp);
    all.insert(all.end(), vp.begin(), vp.end());
    std::sort(all.begin(), all.end());
    if (std::adjacent_find(all.begin(), all.end()) != all.end()) {
        fail(what, "k_layers and v_layers must be distinct tensors (a tensor shared by two layers, or by K and V, "
                   "would be moved twice)");
    }
    const int64_t batch = first.size(0), heads = first.size(1), seq = first.size(2), dim = first.size(3);
    if (dim > 1 && first.stride(3) != 1) fail(what, "the head_dim axis must be contiguous");
    if ((batch > 1 && first.stride(0) == 0) || (heads > 1 && first.stride(1) == 0) ||
        (seq > 1 && first.stride(2) == 0)) {
        fail(what, "the cache tensors must not overlap themselves (zero strides)");
    }
    require_cuda(accepted_nodes, first, what, "accepted_nodes");
    require_cuda(accept_length, first, what, "accept_length");
    require_dtype(accepted_nodes, at::kInt, what, "accepted_nodes");
    require_dtype(accept_length, at::kInt, what, "accept_length");
    require_contiguous(accepted_nodes, what, "accepted_nodes");
    require_contiguous(accept_length, what, "accept_length");
    if (accepted_nodes.dim() != 2 || accept_length.dim() != 1 || accepted_nodes.size(0) != batch ||
        accept_length.size(0) != batch) {
        fail(what, "accepted_nodes " + shape_str(accepted_nodes) + " and accept_length " + shape_str(accept_length) +
                       " must hold the cache's " + std::to_string(batch) + " requests");
    }
    const auto prefix = small_input(prefix_lengths, first, at::kLong, batch, what, "prefix_lengths");
    const Tensor ktab = pointer_table(first, kp), vtab = pointer_table(first, vp);
    kdt_kv_cache c{};
    c.k_layers = static_cast<void* const*>(ktab.data_ptr());
    c.v_layers = static_cast<void* const*>(vtab.data_ptr());
    c.num_layers = static_cast<int64_t>(k_layers.size());
    c.dtype = code;
    c.batch = batch;
    c.heads = heads;
    c.seq_capacity = seq;
    c.head_dim = dim;
    c.batch_stride = first.stride(0);
    c.head_stride = first.stride(1);
    c.seq_stride = first.stride(2);
    Tensor status = device_empty(first, {batch}, at::kInt);
    check(kdt_compact_kv_cuda(&c, prefix->data_ptr<int64_t>(), accepted_nodes.data_ptr<int32_t>(),
                              accept_length.data_ptr<int32_t>(), accepted_nodes.size(1), status.data_ptr<int32_t>(),
                              stream_of(first)),
          what);
    return status;
}

Tensor compact_kv_status(at::TensorList k_layers, at::TensorList v_layers, const Tensor& prefix_lengths,
                         const Tensor& accepted_nodes, const Tensor& accept_length, const Tensor& /*bonus_token*/) {
    return compact_impl(k_layers, v_layers, prefix_lengths, accepted_nodes, accept_length);
}

}  // namespace

// The schemas (the same as kdtree.torch_ops's Python definitions without this library), so
// that a call runs no Python between torch.ops and the kernel on CUDA tensors; the CPU and
// fake kernels are registered on them from Python.
TORCH_LIBRARY_FRAGMENT(kdtree, m) {
    m.def("topk_logprobs(Tensor logits, SymInt k) -> (Tensor, Tensor)");
    m.def("build_trees(Tensor logprobs, Tensor token_ids, SymInt budget, Tensor? root_tokens=None, "
          "Tensor? root_positions=None, SymInt pad_token=-1, Tensor? request_budgets=None, "
          "Tensor? request_depths=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
          "Tensor)");
    m.def("verify_greedy_from_logits(Tensor[] fields, SymInt budget, SymInt depth, Tensor target_logits, "
          "SymInt[] stop_tokens, Tensor? max_commit) -> (Tensor, Tensor, Tensor)");
    m.def("compact_kv(Tensor(a0!)[] k_layers, Tensor(a1!)[] v_layers, Tensor prefix_lengths, Tensor accepted_nodes, "
          "Tensor accept_length, Tensor bonus_token) -> ()");
    m.def("topk_logprobs_status(Tensor logits, SymInt k) -> (Tensor, Tensor, Tensor)");
    m.def("build_trees_status(Tensor logprobs, Tensor token_ids, SymInt budget, Tensor? root_tokens=None, "
          "Tensor? root_positions=None, SymInt pad_token=-1, Tensor? request_budgets=None, "
          "Tensor? request_depths=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
          "Tensor, Tensor)");
    m.def("verify_greedy_from_logits_status(Tensor[] fields, SymInt budget, SymInt depth, Tensor target_logits, "
          "SymInt[] stop_tokens, Tensor? max_commit) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("compact_kv_status(Tensor(a0!)[] k_layers, Tensor(a1!)[] v_layers, Tensor prefix_lengths, "
          "Tensor accepted_nodes, Tensor accept_length, Tensor bonus_token) -> Tensor");
}

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
    m.impl("topk_logprobs_status", &topk_logprobs_status);
    m.impl("build_trees_status", &build_trees_status);
    m.impl("verify_greedy_from_logits_status", &verify_greedy_from_logits_status);
    m.impl("compact_kv_status", &compact_kv_status);
}
