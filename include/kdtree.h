/*
 * kdtree.h - the public C ABI of libkdtree, the native core for DDTree speculative decoding.
 *
 * DDTree (Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
 * Trees", arXiv 2604.12989) builds a draft tree from a drafter's per-position
 * distributions with a best-first heap over cumulative log-probabilities, lets the target
 * score every node under an ancestor-only tree attention mask, then walks the tree along
 * the target's own choices. The exact rule every builder follows is in the project's
 * spec, docs/spec/ddtree-tree-build.md; section names below ("spec: ...") refer to it.
 *
 * Conventions (every function):
 *   - Every function returns a kdt_status; KDT_OK is 0. On failure kdt_last_error()
 *     (thread-local) holds a message naming what is wrong and where.
 *   - Outputs are caller-allocated; sizes come from the *_bytes queries. On failure no
 *     output buffer has been written ("fully written or untouched").
 *   - Counts, strides and indices are 64-bit. Read-only inputs are const.
 *   - The library never prints, aborts or exits.
 *
 * This header compiles as C99 and as C++.
 */
#ifndef KDTREE_H
#define KDTREE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version ---------------------------------------------------------------------- */
#define KDT_VERSION_MAJOR 0
#define KDT_VERSION_MINOR 2
#define KDT_VERSION_PATCH 0
/* Bumped whenever a struct layout, enum value or function signature changes. The Python
 * loader refuses a library whose kdt_abi_version() differs from the one it was written
 * against. */
#define KDT_ABI_VERSION 2

#if defined(_WIN32)
#  if defined(KDT_BUILDING_LIBRARY)
#    define KDT_API __declspec(dllexport)
#  else
#    define KDT_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) || defined(__clang__)
#  define KDT_API __attribute__((visibility("default")))
#else
#  define KDT_API
#endif

/* ---- Status ----------------------------------------------------------------------- */
/* Fixed, append-only values. */
typedef enum kdt_status {
    KDT_OK = 0,
    KDT_ERR_INVALID_ARGUMENT = 1, /* a scalar argument is out of its documented range    */
    KDT_ERR_NULL_POINTER = 2,     /* a required pointer is NULL                           */
    KDT_ERR_SHAPE = 3,            /* sizes disagree (e.g. output capacity vs. input)      */
    KDT_ERR_VALUE = 4,            /* bad data: NaN, +inf, unsorted row, duplicate id ...  */
    KDT_ERR_OUT_OF_RANGE = 5,     /* an index or token id outside its valid range         */
    KDT_ERR_OVERFLOW = 6,         /* a size computation overflows 64 bits                 */
    KDT_ERR_OUT_OF_MEMORY = 7,    /* an allocation failed                                 */
    KDT_ERR_IO = 8,               /* a file could not be opened, read or written          */
    KDT_ERR_FORMAT = 9,           /* a KDTR file is malformed (which field: last error)   */
    KDT_ERR_UNSUPPORTED = 10,     /* unknown version or dtype, feature not built          */
    KDT_ERR_NOT_FOUND = 11,       /* a named array is not in a KDTR file                  */
    KDT_ERR_BUFFER_TOO_SMALL = 12,/* a workspace is smaller than its size query says      */
    KDT_ERR_NO_DEVICE = 13,       /* no CUDA device or driver                             */
    KDT_ERR_CUDA = 14,            /* a CUDA runtime call (or a kernel launch) failed      */
    KDT_ERR_INTERNAL = 15         /* a bug in kdtree; please report it                    */
} kdt_status;

/* Static, never-NULL text for a status ("KDT_ERR_VALUE: invalid value"); unknown values
 * give "unknown status". */
KDT_API const char* kdt_status_string(int32_t status);

/* Thread-local detail of the last failure on this thread ("" if none). The pointer stays
 * valid until the next kdtree call on the same thread. */
KDT_API const char* kdt_last_error(void);

/* "MAJOR.MINOR.PATCH" of the loaded library (static text). */
KDT_API const char* kdt_version(void);

/* KDT_ABI_VERSION of the loaded library. */
KDT_API int32_t kdt_abi_version(void);

/* ---- Draft trees (spec: "Outputs", "Fixed-size (padded) output") ------------------ */

/*
 * Caller-allocated outputs of the tree builder for `batch` requests with budget N.
 * Every per-node array has N + 1 rows per request: row 0 is the root, rows 1..n the
 * emitted draft nodes in pop order (n = num_nodes[b] <= N), rows n+1..N padding.
 * Each array is C-contiguous, request-major. Any pointer except num_nodes may be NULL:
 * that output is then not computed. The builder rewrites every row of every non-NULL
 * array on every call, padding included.
 *
 *  field            dtype     shape                root row           padding rows
 *  num_nodes        int32     [B]                  -                  -
 *  tokens           int32     [B, N+1]             root token or pad  pad token
 *  depths           int32     [B, N+1]             0                  0
 *  parents          int32     [B, N+1]             -1                 -1
 *  logw             float64   [B, N+1]             0.0                -inf
 *  positions        int64     [B, N+1]             root position      root position
 *  visibility       uint8     [B, N+1, N+1]        [1, 0, ...]        1 on its diagonal
 *  visibility_bits  uint32    [B, N+1, W]          bit 0              its diagonal bit
 *  first_child      int32     [B, N+1]             first child or -1  -1
 *  next_sibling     int32     [B, N+1]             -1                 -1
 *
 * logw: the node's cumulative log-probability (natural log) in float64, computed in the
 * spec's operation order. positions = root position + depth (padding: depth 0).
 * visibility[b][i][j] is 1 exactly when j == i or j is an ancestor of i (the
 * ancestor-only tree attention mask); visibility_bits packs each row little-endian into
 * W = ceil((N+1)/32) uint32 words, bit (j % 32) of word j / 32 = column j, unused high
 * bits 0. first_child / next_sibling list each node's children in increasing node number
 * (= decreasing score); -1 means none.
 */
typedef struct kdt_trees {
    int64_t batch;             /* B: number of requests the arrays hold                  */
    int64_t budget;            /* N: draft nodes per request, root excluded (>= 0)       */
    int32_t* num_nodes;        /* [B] draft nodes emitted (root excluded); required      */
    int32_t* tokens;           /* [B, N+1] or NULL                                       */
    int32_t* depths;           /* [B, N+1] or NULL                                       */
    int32_t* parents;          /* [B, N+1] or NULL                                       */
    double* logw;              /* [B, N+1] or NULL                                       */
    int64_t* positions;        /* [B, N+1] or NULL                                       */
    uint8_t* visibility;       /* [B, N+1, N+1] or NULL (0/1 bytes)                      */
    uint32_t* visibility_bits; /* [B, N+1, ceil((N+1)/32)] or NULL                      */
    int32_t* first_child;      /* [B, N+1] or NULL                                       */
    int32_t* next_sibling;     /* [B, N+1] or NULL                                       */
} kdt_trees;

/* Identifies one array of kdt_trees for kdt_trees_field_bytes. Fixed values. */
typedef enum kdt_trees_field {
    KDT_FIELD_NUM_NODES = 0,
    KDT_FIELD_TOKENS = 1,
    KDT_FIELD_DEPTHS = 2,
    KDT_FIELD_PARENTS = 3,
    KDT_FIELD_LOGW = 4,
    KDT_FIELD_POSITIONS = 5,
    KDT_FIELD_VISIBILITY = 6,
    KDT_FIELD_VISIBILITY_BITS = 7,
    KDT_FIELD_FIRST_CHILD = 8,
    KDT_FIELD_NEXT_SIBLING = 9
} kdt_trees_field;

/* Exact byte size of one kdt_trees array for `batch` requests and budget `budget`.
 * Returns KDT_ERR_INVALID_ARGUMENT (negative size, unknown field), KDT_ERR_NULL_POINTER,
 * KDT_ERR_OVERFLOW. */
KDT_API kdt_status kdt_trees_field_bytes(int64_t batch, int64_t budget, int32_t field,
                                         size_t* bytes);

/* Number of uint32 words per visibility_bits row: ceil((budget + 1) / 32). Returns
 * KDT_ERR_INVALID_ARGUMENT for a negative budget. */
KDT_API kdt_status kdt_visibility_words(int64_t budget, int64_t* words);

/*
 * Input of the tree builder: the drafter's top-K for the next L positions of B requests.
 *
 *   logprobs   float32 [B, L, K]  row (b, d) is the distribution of the token at depth
 *                                 d + 1 below the root, sorted non-increasing; natural-log
 *                                 probabilities (-inf allowed: never emitted).
 *   token_ids  int32   [B, L, K]  token id of each entry; >= 0, < vocab_size when
 *                                 vocab_size > 0; no duplicate id within a row's used part.
 *   root_tokens    int32 [B] or NULL: written to row 0 of `tokens` (NULL: pad_token).
 *   root_positions int64 [B] or NULL: position of the root (NULL: 0).
 *
 * Only the "used part" [L, K'] with K' = min(K, N) is read and validated.
 *
 * Per-request limits (both optional; a serving batch mixes requests that want different
 * trees):
 *   request_budgets int32 [B] or NULL: request b's tree has at most request_budgets[b]
 *                   draft nodes, 0 <= request_budgets[b] <= N (the call's budget, which
 *                   stays the row count of every output: rows past the request's own
 *                   nodes are padding). NULL: N for every request.
 *   request_depths  int32 [B] or NULL: request b's depth limit, 0 <= request_depths[b] <=
 *                   L; rows at depths past it are neither read nor validated. NULL: L.
 * Request b's outputs are then bit-identical to building it alone with budget
 * request_budgets[b] and depth request_depths[b] (its used part is [L_b, min(K, N_b)]),
 * apart from the padding rows up to N. A limit outside its range is KDT_ERR_OUT_OF_RANGE
 * for that request ("request b: budget ... outside [0, N]").
 */
typedef struct kdt_draft {
    int64_t batch;                 /* B >= 0                                              */
    int64_t depth;                 /* L >= 0 (the depth limit, block size - 1)            */
    int64_t width;                 /* K >= 0 (top-k entries per position)                 */
    const float* logprobs;         /* [B, L, K]; may be NULL only when B*L*K == 0         */
    const int32_t* token_ids;      /* [B, L, K]; may be NULL only when B*L*K == 0         */
    const int32_t* root_tokens;    /* [B] or NULL                                         */
    const int64_t* root_positions; /* [B] or NULL                                         */
    int64_t vocab_size;            /* > 0: ids must be < vocab_size; 0: upper bound unchecked */
    int32_t pad_token;             /* token written to padding rows (and a NULL root); -1 usual */
    const int32_t* request_budgets; /* [B] or NULL: each request's budget, <= N            */
    const int32_t* request_depths;  /* [B] or NULL: each request's depth limit, <= L       */
} kdt_draft;

/* Bytes of workspace kdt_trees_build_cpu needs for one call with this budget, depth, width
 * and vocab_size (the kdt_draft field; 0 when unchecked); independent of the batch size.
 * Returns KDT_ERR_INVALID_ARGUMENT (negative), KDT_ERR_NULL_POINTER, KDT_ERR_OVERFLOW. */
KDT_API kdt_status kdt_trees_build_workspace_bytes(int64_t budget, int64_t depth, int64_t width,
                                                   int64_t vocab_size, size_t* bytes);

/*
 * Builds B draft trees on the CPU (spec: "Best-first expansion"), bit-identical to the
 * spec for any budget, depth and width, ties included: float64 scores in the spec's
 * operation order, heap keys (-logw, rank path).
 *
 * draft:     the inputs (see kdt_draft). out->batch must equal draft->batch; out->budget
 *            is the budget N (>= 0; N = 0 gives root-only trees).
 * workspace: NULL (the library allocates and frees what it needs), or a buffer of at least
 *            kdt_trees_build_workspace_bytes(N, L, K, vocab_size) bytes (any alignment;
 *            its contents need not be initialised).
 *
 * Every input of every request is validated before any output is written. Returns
 *   KDT_ERR_NULL_POINTER      draft, out, out->num_nodes, or a needed input array NULL
 *   KDT_ERR_INVALID_ARGUMENT  negative batch, depth, width, budget or vocab_size
 *   KDT_ERR_SHAPE             out->batch != draft->batch
 *   KDT_ERR_VALUE             NaN or +inf log-prob, a row not sorted non-increasing, a
 *                             log-prob > 32 FLT_EPSILON (3.8e-6: float32 rounding of a
 *                             probability near 1 may leave a true log-prob of 0 slightly
 *                             above; more is a probability or a raw logit passed as a
 *                             log-prob), a duplicate token id in a row ("request b, depth
 *                             d, rank r: ..."). Only the used part (ranks < K' = min(K, N))
 *                             is checked; -inf entries (padding, masked tokens) are valid.
 *                             Rows are not checked to sum to at most 1 (exp(lp) summed):
 *                             scores that are not normalised still build the spec's tree.
 *   KDT_ERR_OUT_OF_RANGE      a negative token id, or one >= vocab_size; a request budget
 *                             outside [0, N] or depth limit outside [0, L]
 *   KDT_ERR_BUFFER_TOO_SMALL  workspace_bytes below the query's answer
 *   KDT_ERR_OVERFLOW, KDT_ERR_OUT_OF_MEMORY
 * Departure from the published code (spec: "Degenerate and invalid inputs"): a -inf
 * candidate is never emitted or expanded. A negative budget is an error, not a root-only
 * tree (a padded output cannot have N + 1 <= 0 rows).
 */
KDT_API kdt_status kdt_trees_build_cpu(const kdt_draft* draft, kdt_trees* out, void* workspace,
                                       size_t workspace_bytes);

/* ---- Ragged (packed) tree rows ------------------------------------------------------ */

/*
 * The real rows of a batch of trees packed back to back, for kernels that take variable-
 * length query rows (cu_seqlens) and compute no padding row: request b's R_b =
 * num_nodes[b] + 1 rows (root first, then its nodes in node order) are packed rows
 * cu_rows[b] .. cu_rows[b + 1] - 1. Every array except cu_rows holds `capacity` rows
 * (B * (N + 1) always suffices; the real rows, T = cu_rows[B], must fit); rows T ..
 * capacity - 1 are written as filler: -1 in row_request, row_node, tokens and parents, 0
 * in depths, positions and visibility_bits. Any array except cu_rows may be NULL (not
 * written; its source field of kdt_trees is then not read).
 *
 *  field            dtype     shape               value of packed row cu_rows[b] + i
 *  cu_rows          int32     [B + 1]             cu_rows[0] = 0, cu_rows[b+1] = cu_rows[b] + R_b
 *  row_request      int32     [capacity]          b
 *  row_node         int32     [capacity]          i (the node index in the padded layout)
 *  tokens           int32     [capacity]          tokens[b][i]
 *  depths           int32     [capacity]          depths[b][i]
 *  parents          int32     [capacity]          parents[b][i] (request-local; -1 for the root)
 *  positions        int64     [capacity]          positions[b][i]
 *  visibility_bits  uint32    [capacity, W]       visibility_bits[b][i], W = ceil((N+1)/32)
 *
 * The tree attention mask in this layout is visibility_bits with the prefix implicit: a
 * real row sees its request's whole KV prefix and, among the tree rows, bit j of its row
 * (packed row cu_rows[b] + j). For B = 64, N = 64 that is at most 64 x 65 x 3 x 4 bytes
 * (50 KB), whatever the prefix length, against B x (N+1) x (p+N+1) for a dense mask.
 */
typedef struct kdt_trees_ragged {
    int64_t capacity;          /* rows each per-row array holds (>= the real rows)       */
    int32_t* cu_rows;          /* [B + 1], required                                      */
    int32_t* row_request;      /* [capacity] or NULL                                     */
    int32_t* row_node;         /* [capacity] or NULL                                     */
    int32_t* tokens;           /* [capacity] or NULL                                     */
    int32_t* depths;           /* [capacity] or NULL                                     */
    int32_t* parents;          /* [capacity] or NULL                                     */
    int64_t* positions;        /* [capacity] or NULL                                     */
    uint32_t* visibility_bits; /* [capacity, ceil((N+1)/32)] or NULL                     */
} kdt_trees_ragged;

/*
 * Packs the real rows of `trees` (host arrays) into `out` (host arrays). Reads batch,
 * budget, num_nodes and the fields whose packed array is requested.
 * Returns KDT_ERR_NULL_POINTER (trees, out, out->cu_rows, num_nodes, or the source field
 * of a requested array), KDT_ERR_INVALID_ARGUMENT (negative batch, budget or capacity),
 * KDT_ERR_VALUE (num_nodes outside [0, N]: "request b: num_nodes ..."),
 * KDT_ERR_BUFFER_TOO_SMALL (the real rows exceed capacity), KDT_ERR_OVERFLOW (the real rows
 * exceed INT32_MAX, or a byte size size_t). Nothing is written on error.
 */
KDT_API kdt_status kdt_trees_ragged_cpu(const kdt_trees* trees, kdt_trees_ragged* out);

/* ---- Verification (spec: "Verification") ----------------------------------------- */

/*
 * Stop sequences for the verification walks (optional; NULL for none): the walk ends
 * after an accepted draft token that completes one of them, with no bonus token, as an
 * accepted stop token does. A sequence matches the committed stream: the request's
 * history (the tokens committed before this round, oldest first; the last one is the
 * token the tree's root stands for), then the draft tokens accepted so far. A bonus token
 * that completes a sequence is committed (as a bonus stop token is); the caller ends the
 * request there.
 *
 *   tokens          int32 [offsets[count]]: the sequences back to back, each token >= 0
 *   offsets         int64 [count + 1]: sequence i is tokens[offsets[i] .. offsets[i + 1]);
 *                   offsets[0] = 0, lengths 1 .. KDT_MAX_STOP_LENGTH
 *   history         int32 [B, history_length] or NULL: each request's last committed
 *                   tokens, right-aligned (its last column is the most recent); -1 where a
 *                   request has fewer. KDT_MAX_STOP_LENGTH - 1 columns always suffice.
 * The CPU walk reads host arrays; the CUDA walks read device arrays (the struct itself is
 * read on the host during the call).
 */
#define KDT_MAX_STOP_LENGTH 16
typedef struct kdt_stop_sequences {
    const int32_t* tokens;  /* [offsets[count]]                                         */
    const int64_t* offsets; /* [count + 1]                                              */
    int64_t count;          /* sequences, >= 0                                          */
    const int32_t* history; /* [B, history_length] or NULL                              */
    int64_t history_length; /* >= 0                                                     */
} kdt_stop_sequences;

/*
 * Greedy (or sampled: the walk is the same) verification walk for B trees.
 *
 * trees:          built trees; reads batch, budget, num_nodes, tokens, first_child and
 *                 next_sibling (all required), which are checked for consistency (links
 *                 in range, no cycles) before anything is written.
 * target_tokens:  int32 [B, N+1]: the token the target chose at every node (argmax of its
 *                 logits, or one sample); entries of padding rows are ignored; entries at
 *                 visited nodes must be >= 0.
 * stop_tokens:    int32 [num_stop_tokens] or NULL (num_stop_tokens = 0): an accepted draft
 *                 token in this set ends the walk there and no bonus token is emitted.
 * stop_sequences: NULL, or multi-token stops (kdt_stop_sequences, host arrays here).
 * max_commit:     int64 [B] or NULL (no cap): the most tokens (accepted + bonus) request b
 *                 may commit this round, >= 0. The accepted path is truncated so that
 *                 accepted + bonus <= max_commit[b]; with a cap c >= 1 that cuts the path,
 *                 the path keeps c - 1 draft nodes and the bonus is the target's token at
 *                 its last node (the same c tokens the uncut path would commit first).
 * path_capacity:  columns of accepted_nodes, >= 1; must be at least the accepted path's
 *                 length + 1 (L + 1 always suffices for trees of depth limit L).
 *
 * Outputs:
 *   accepted_nodes int32 [B, path_capacity]: node indices of the accepted path, root (0)
 *                  first, then -1.
 *   accept_length  int32 [B]: accepted draft nodes (root excluded).
 *   bonus_token    int32 [B]: the target's token at the last accepted node, or -1 when
 *                  none is committed (a stop token was accepted, or the cap is 0).
 * Committed tokens this round: tokens of accepted_nodes[1..accept_length], then the bonus
 * token when >= 0.
 *
 * Returns KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (negative sizes, caps or
 * path_capacity < 1; stop_sequences with a negative count or history_length, offsets not
 * starting at 0, a sequence length outside [1, KDT_MAX_STOP_LENGTH], a negative stop
 * token), KDT_ERR_VALUE (inconsistent tree links, a negative target token at a visited
 * node), KDT_ERR_SHAPE (an accepted path longer than path_capacity - 1).
 */
KDT_API kdt_status kdt_verify_greedy_cpu(const kdt_trees* trees, const int32_t* target_tokens,
                                         const int32_t* stop_tokens, int64_t num_stop_tokens,
                                         const kdt_stop_sequences* stop_sequences, const int64_t* max_commit, int64_t path_capacity,
                                         int32_t* accepted_nodes, int32_t* accept_length,
                                         int32_t* bonus_token);

/* ---- Top-k log-probs from logits --------------------------------------------------- */

/*
 * For each of `rows` rows of float32 logits (row r starts at logits + r * row_stride
 * elements, vocab entries each), the k largest entries as log-probs:
 * logprob = logit - logsumexp(row over all vocab entries), computed in float64 as (logit -
 * max) - log1p(rest), rest the compensated sum of exp(x - max) over every entry but the
 * first at the max (log1p keeps log-probs near 0 precise), and rounded once to float32;
 * sorted descending, ties ordered by lower token id.
 *
 * out_logprobs float32 [rows, k], out_ids int32 [rows, k].
 * Requires 0 <= k <= vocab, vocab <= INT32_MAX, row_stride >= vocab.
 * Returns KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT, KDT_ERR_OVERFLOW (the arrays'
 * byte extents overflow the address space), KDT_ERR_VALUE ("row r, column c:
 * NaN logit" / "+inf logit" / "row r: every logit is -inf"). A -inf logit gives a -inf
 * log-prob. Source: spec "Input" (lp = top_k(logits) - logsumexp(logits)).
 */
KDT_API kdt_status kdt_topk_logprobs_cpu(const float* logits, int64_t rows, int64_t vocab,
                                         int64_t row_stride, int64_t k, float* out_logprobs,
                                         int32_t* out_ids);

/* ---- Vocabulary-sharded top-k (tensor parallelism) --------------------------------- */

/*
 * When the drafter's LM head is split over T devices by vocabulary, each shard computes a
 * short summary of its part of every row and the T summaries merge into the top-k of
 * kdt_topk_logprobs_cpu on the whole row, without gathering the logits: per row a shard
 * sends k logits, k ids, its max and the rest of its sum of exponentials (4 + 4 + 4 + 8
 * bytes, against 2 or 4 bytes a vocabulary entry for the logits).
 *
 * kdt_topk_shard_cpu: shard holding vocabulary entries [vocab_offset, vocab_offset +
 * shard_vocab); `rows` rows of float32 logits (row r at logits + r * row_stride).
 *   out_logits    float32 [rows, k]: the shard's k largest logits, as they are, best first
 *                                    (ties: lower id)
 *   out_ids       int32   [rows, k]: their global ids (vocab_offset + column)
 *   out_max       float32 [rows]:    the shard's largest logit (-inf when all are -inf)
 *   out_sum_rest  float64 [rows]:    sum of exp(logit - out_max) over the shard's row but
 *                                    its first entry at the max (whose term is 1),
 *                                    Neumaier-compensated; 0 when all are -inf. (The
 *                                    log-sum-exp is max + log1p(rest): precise for rows
 *                                    whose top log-prob is near 0.)
 * Requires 1 <= shard_vocab, 0 <= k <= shard_vocab (every shard gives k entries),
 * vocab_offset + shard_vocab <= 2^31, row_stride >= shard_vocab. A row may be all -inf in
 * one shard. Returns KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT, KDT_ERR_OVERFLOW (the
 * arrays' byte extents overflow the address space), KDT_ERR_VALUE ("row r, column c: NaN
 * logit" / "+inf logit", columns of the shard).
 */
KDT_API kdt_status kdt_topk_shard_cpu(const float* logits, int64_t rows, int64_t shard_vocab,
                                      int64_t row_stride, int64_t vocab_offset, int64_t k,
                                      float* out_logits, int32_t* out_ids, float* out_max,
                                      double* out_sum_rest);

/* Most shards kdt_topk_merge_cpu takes. */
#define KDT_TOPK_MAX_SHARDS 1024

/*
 * kdt_topk_merge_cpu: T = `shards` shards' kdt_topk_shard_cpu outputs, stacked shard-major:
 * shard_logits float32 [T, rows, k], shard_ids int32 [T, rows, k], shard_max float32
 * [T, rows], shard_sum_rest float64 [T, rows]; the shards hold disjoint vocabulary ranges
 * within [0, vocab) that together make the vocabulary.
 *   out_logprobs float32 [rows, k], out_ids int32 [rows, k]: the row's top-k log-probs.
 * The ids and their order (ties: lower id) are those of kdt_topk_logprobs_cpu on the
 * gathered row. The log-sum-exp is combined exactly, not from the k kept entries: max m =
 * the shards' largest max; rest = the first shard at m's rest plus every other shard's
 * (1 + rest_t) exp(max_t - m), in float64 (compensated, shard order); logprob = (logit -
 * m) - log1p(rest), rounded once to float32. rest differs from one pass over the gathered
 * row only by float64 rounding (relative ~1e-16), so a log-prob is within one float32 ulp
 * of kdt_topk_logprobs_cpu's (equal on every tested row).
 * Every input is checked before anything is written. Returns KDT_ERR_NULL_POINTER,
 * KDT_ERR_INVALID_ARGUMENT (shards outside [1, KDT_TOPK_MAX_SHARDS], k > vocab),
 * KDT_ERR_OVERFLOW, KDT_ERR_VALUE ("shard t, row r, entry c: ..." for an unsorted list, an
 * id outside [0, vocab), a NaN / +inf logit; "shard t, row r: max ... and rest ..." for
 * statistics no shard gives (the list's first logit not the max, a rest outside [0,
 * vocab]); "shard t, row r: id i is listed by two shards"; "row r: every logit is -inf").
 * A shard given a wrong vocabulary offset whose ids do not collide in the top k is not
 * detected here (kdtree.distributed checks the ranks' ranges).
 */
KDT_API kdt_status kdt_topk_merge_cpu(const float* shard_logits, const int32_t* shard_ids,
                                      const float* shard_max, const double* shard_sum_rest,
                                      int64_t shards, int64_t rows, int64_t k, int64_t vocab,
                                      float* out_logprobs, int32_t* out_ids);

/* ---- Element types ------------------------------------------------------------- */

/* Element types: the KDTR format's dtype codes (docs/kdtr-format.md), also used to name
 * the dtype of GPU inputs. Fixed values. */
typedef enum kdt_dtype {
    KDT_DTYPE_BOOL = 1,
    KDT_DTYPE_INT8 = 2,
    KDT_DTYPE_INT16 = 3,
    KDT_DTYPE_INT32 = 4,
    KDT_DTYPE_INT64 = 5,
    KDT_DTYPE_UINT8 = 6,
    KDT_DTYPE_UINT16 = 7,
    KDT_DTYPE_UINT32 = 8,
    KDT_DTYPE_UINT64 = 9,
    KDT_DTYPE_FLOAT16 = 10,
    KDT_DTYPE_BFLOAT16 = 11,
    KDT_DTYPE_FLOAT32 = 12,
    KDT_DTYPE_FLOAT64 = 13
} kdt_dtype;

/* ---- CUDA (GPU) ------------------------------------------------------------------- *
 * Built when the library was compiled with nvcc (CMake KDTREE_CUDA=AUTO|ON); otherwise
 * every function here returns KDT_ERR_UNSUPPORTED. GPU entry points take device pointers
 * (inside host structs), the stream last (a cudaStream_t passed as void*, NULL = the
 * default stream), never synchronise, never allocate, and may be captured in a CUDA
 * graph. Argument checks that need no device data are done on the host and returned as a
 * status; problems in device data are reported per request in a device status array. */

/* Number of CUDA devices. KDT_ERR_NO_DEVICE (count 0) when there is no GPU or no driver;
 * KDT_ERR_UNSUPPORTED in a build without CUDA. */
KDT_API kdt_status kdt_cuda_device_count(int32_t* count);

/* Bytes of device workspace kdt_trees_build_cuda needs for this batch, budget, depth and
 * width. Returns KDT_ERR_INVALID_ARGUMENT (negative), KDT_ERR_NULL_POINTER,
 * KDT_ERR_OVERFLOW. */
KDT_API kdt_status kdt_trees_build_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t depth,
                                                        int64_t width, size_t* bytes);

/*
 * Builds B draft trees on the GPU: the same outputs as kdt_trees_build_cpu, bit-identical
 * to it (the same expansion code, native/tree_expand.h, compiled for the device without
 * FMA contraction). All pointers inside `draft` and `out` are device pointers; the structs
 * themselves are read on the host during the call.
 *
 * request_status: device int32 [B], written for every request: KDT_OK, or the status the
 *   CPU builder returns for that request alone (KDT_ERR_VALUE: NaN, +inf, unsorted row,
 *   duplicate id; KDT_ERR_OUT_OF_RANGE: token id, root token, root position, a request
 *   budget or depth limit out of range). A failed request gets a root-only tree
 *   (num_nodes 0, every other row padding); the others are built normally. (The CPU
 *   builder instead writes nothing when any request fails.) draft->request_budgets and
 *   draft->request_depths, when given, are device arrays.
 * workspace: device buffer of kdt_trees_build_cuda_workspace_bytes(B, N, L, K) bytes,
 *   256-byte aligned; its contents need not be initialised.
 * stream: cudaStream_t as void* (NULL: the legacy default stream).
 *
 * Returns (from host-side checks only) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT
 * (also: a device array not aligned to its element size), KDT_ERR_SHAPE,
 * KDT_ERR_BUFFER_TOO_SMALL, KDT_ERR_OVERFLOW, KDT_ERR_CUDA (the launch failed),
 * KDT_ERR_UNSUPPORTED (no CUDA in this build).
 * One thread block per request. The tree is found by an exact parallel expansion (a
 * descending score threshold, a sort by the heap's key, a check that the order is the
 * heap's); when the check fails or shared memory is too small, one thread runs the heap
 * (shared memory, else device memory). Every path gives the CPU builder's bits.
 * Speed: docs/performance.md.
 */
KDT_API kdt_status kdt_trees_build_cuda(const kdt_draft* draft, kdt_trees* out, int32_t* request_status,
                                        void* workspace, size_t workspace_bytes, void* stream);

/* A strided 3-D tensor of logits in device memory: element (b, l, v) of the logical shape
 * [batch, length, vocab] is at data + b * batch_stride + l * row_stride + v (in elements;
 * the vocab axis is contiguous). Any non-negative strides are accepted, so a slice such as
 * logits[:, 1:17, :] of a larger tensor is passed without a copy. */
typedef struct kdt_logits {
    const void* data;     /* device pointer aligned to the element size; NULL only when empty */
    int32_t dtype;        /* KDT_DTYPE_FLOAT32, KDT_DTYPE_FLOAT16 or KDT_DTYPE_BFLOAT16        */
    int32_t reserved;     /* must be 0                                                        */
    int64_t batch;        /* B >= 0                                                           */
    int64_t length;       /* rows per request, >= 0                                           */
    int64_t vocab;        /* V: 1 .. INT32_MAX (any value when batch * length == 0)           */
    int64_t batch_stride; /* elements from (b, l, v) to (b + 1, l, v), >= 0                   */
    int64_t row_stride;   /* elements from (b, l, v) to (b, l + 1, v), >= 0                   */
} kdt_logits;

/* Bytes of device workspace kdt_topk_logprobs_cuda needs for `rows` rows (batch * length)
 * of `vocab` logits and top `k`. Returns KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT
 * (negative, k > vocab, k > 1024), KDT_ERR_OVERFLOW. */
KDT_API kdt_status kdt_topk_logprobs_cuda_workspace_bytes(int64_t rows, int64_t vocab, int64_t k,
                                                          size_t* bytes);

/*
 * Top-k log-probs on the GPU, reading the logits once (see below): for every row (b, l),
 * logprob = logit - logsumexp(row), the logsumexp over all vocab entries in float32
 * (max, then the sum of 2^((x - max) * log2 e) with the hardware exp2, partial sums rescaled
 * to the row's max with expf); the k largest sorted descending, ties ordered by lower token
 * id (spec "Input": lp = top_k(logits) - logsumexp(logits)). Output pointers must be
 * 4-byte aligned. k <= 128 runs one kernel (one block per row) that does not touch the
 * workspace; it reads each row once, then again at most 128 of its 16-byte pieces (2 KB,
 * those that can hold the k largest) to select them exactly. Larger k runs two kernels
 * that use the workspace. Log-probs agree with a float64 reference within
 * 2e-6 * |lp| + 2e-6 (tests_native/test_topk_cuda.cu derives the bound).
 *
 * logits:        device tensor [B, L, V] (kdt_logits), float32, float16 or bfloat16.
 * k:             1 .. min(V, 1024) (0 allowed: nothing is written but row_status).
 * out_logprobs:  device float32 [B, L, k], C-contiguous.
 * out_ids:       device int32 [B, L, k]: token ids, always in [0, V).
 * row_status:    device int32 [B, L]: KDT_OK, or KDT_ERR_VALUE when the row holds a NaN or
 *                a +inf logit or every logit is -inf. Such a row's log-probs are all NaN
 *                and its ids 0 .. k-1 (so a tree built from it fails with KDT_ERR_VALUE).
 *                A -inf logit in a valid row gives a -inf log-prob. KDT_ERR_INTERNAL marks
 *                a row where an internal check failed (a bug in kdtree; please report
 *                it): the entries it affected hold a NaN log-prob (and id 0, or the ids
 *                0 .. k-1 when the whole row is), so a tree built from it fails too.
 * workspace:     device, kdt_topk_logprobs_cuda_workspace_bytes(B * L, V, k) bytes,
 *                256-byte aligned, contents need not be initialised.
 *
 * Returns (host-side checks) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (dtype,
 * reserved, sizes, strides, alignment), KDT_ERR_BUFFER_TOO_SMALL, KDT_ERR_OVERFLOW,
 * KDT_ERR_CUDA (launch failed), KDT_ERR_UNSUPPORTED (no CUDA in this build).
 */
KDT_API kdt_status kdt_topk_logprobs_cuda(const kdt_logits* logits, int64_t k, float* out_logprobs,
                                          int32_t* out_ids, int32_t* row_status, void* workspace,
                                          size_t workspace_bytes, void* stream);

/* Bytes of device workspace kdt_trees_build_from_logits_cuda needs for this batch, budget
 * N, depth L (= logits length), vocab and width K. Same errors as the other queries. */
KDT_API kdt_status kdt_trees_build_from_logits_cuda_workspace_bytes(int64_t batch, int64_t budget,
                                                                   int64_t depth, int64_t vocab,
                                                                   int64_t width, size_t* bytes);

/*
 * The drafter's logits to draft trees in one call, on the device: kdt_topk_logprobs_cuda
 * with k = min(width, N) into the workspace, then kdt_trees_build_cuda on the result
 * (draft depth L = logits->length, vocab_size = V). The trees are bit-identical to
 * kdt_trees_build_cpu run on the same top-k output.
 *
 * logits:          device [B, L, V]: row l of request b is the drafter's distribution at
 *                  depth l + 1 below the root.
 * width:           K, 0 .. min(V, 1024): top-k entries per position.
 * root_tokens:     device int32 [B] or NULL; root_positions: device int64 [B] or NULL.
 * request_budgets, request_depths: device int32 [B] or NULL: each request's own budget
 *                  and depth limit (kdt_draft); rows past a request's depth limit are
 *                  not validated (a NaN there does not fail it).
 * out, request_status: as kdt_trees_build_cuda. A logits row with NaN, +inf or only -inf
 *                  gives its request KDT_ERR_VALUE (a root-only tree) when N >= 1.
 * workspace:       kdt_trees_build_from_logits_cuda_workspace_bytes(B, N, L, V, K) bytes,
 *                  256-byte aligned.
 * Returns the host-side statuses of the two calls it makes; the tree side is checked before
 * anything is launched. B = 0 is a no-op (workspace may be NULL).
 * The top-k's ids are distinct in every row, so the tree build here skips the check for
 * repeated ids that kdt_trees_build_cuda makes (the trees are the same).
 */
KDT_API kdt_status kdt_trees_build_from_logits_cuda(const kdt_logits* logits, int64_t width,
                                                    const int32_t* root_tokens,
                                                    const int64_t* root_positions,
                                                    const int32_t* request_budgets,
                                                    const int32_t* request_depths, int32_t pad_token,
                                                    kdt_trees* out, int32_t* request_status,
                                                    void* workspace, size_t workspace_bytes,
                                                    void* stream);

/*
 * kdt_topk_merge_cpu on the GPU: the same arguments as device arrays, one thread block per
 * row, stream-ordered, no allocation, capturable in a CUDA graph. The ids and their order
 * are the CPU merge's; the log-sum-exp is combined by the same float64 operations in the
 * same order, with CUDA's exp and log1p (within 1-2 ulp of the C library's), so a log-prob
 * is within one float32 ulp of the CPU merge's.
 * k:            0 .. min(vocab, 1024).
 * row_status:   device int32 [rows]: KDT_OK, or KDT_ERR_VALUE for a row the CPU merge
 *               rejects (an unsorted list, an id outside [0, vocab), a NaN or +inf logit,
 *               statistics no shard gives, an id listed by two shards within the first k,
 *               every logit -inf); such a row's log-probs are NaN and its ids 0 .. k-1.
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (shards outside [1,
 * KDT_TOPK_MAX_SHARDS], k past min(vocab, 1024), rows past INT32_MAX, a misaligned array),
 * KDT_ERR_OVERFLOW, KDT_ERR_CUDA, KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_topk_merge_cuda(const float* shard_logits, const int32_t* shard_ids,
                                       const float* shard_max, const double* shard_sum_rest,
                                       int64_t shards, int64_t rows, int64_t k, int64_t vocab,
                                       float* out_logprobs, int32_t* out_ids, int32_t* row_status,
                                       void* stream);

/*
 * A vocabulary shard's row statistics on the GPU: kdt_topk_shard_cpu's out_max and
 * out_sum_rest for every row (b, l) of `logits` (the shard's columns; float32, float16 or
 * bfloat16; 2-D inputs as rows), in one kernel reading each row twice, so that a shard's
 * summary needs no float64 copy of its logits. With kdt_topk_logprobs_cuda's ids (the
 * shard's top k) and the logits at them it makes the shard's whole summary.
 *   out_max   device float32 [B * L]: the row's largest logit (-inf when all are -inf);
 *             NaN for a row holding a NaN or a +inf.
 *   out_rest  device float64 [B * L]: sum of exp(logit - max) over the row but its first
 *             entry at the max (-0 and +0 equal), in float64, each of 256 threads summing
 *             its columns in order and the threads' sums added in a fixed tree (so within
 *             float64 rounding of the CPU's compensated sum, not bit-equal); 0 when all
 *             are -inf; NaN for a row holding a NaN or a +inf (which kdt_topk_merge_* reject).
 * Stream-ordered, no allocation, no workspace, capturable in a CUDA graph. Returns
 * (host-side) the checks of kdt_logits (KDT_ERR_INVALID_ARGUMENT, KDT_ERR_NULL_POINTER),
 * KDT_ERR_NULL_POINTER (an output), KDT_ERR_INVALID_ARGUMENT (a misaligned output),
 * KDT_ERR_OVERFLOW, KDT_ERR_CUDA, KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_topk_shard_stats_cuda(const kdt_logits* logits, float* out_max, double* out_rest,
                                             void* stream);

/* Layouts of kdt_tree_attention_mask_cuda's output. Fixed values. */
typedef enum kdt_mask_kind {
    KDT_MASK_BOOL = 0,          /* uint8 [B, N+1, C]: 1 visible, 0 hidden                    */
    KDT_MASK_BITS = 1,          /* uint32 [B, N+1, ceil(C/32)]: bit j%32 of word j/32 = column j */
    KDT_MASK_ADDITIVE_F32 = 2,  /* float32 [B, N+1, C]: 0 visible, -FLT_MAX hidden            */
    KDT_MASK_ADDITIVE_F16 = 3,  /* float16 [B, N+1, C]: 0 visible, -65504 hidden              */
    KDT_MASK_ADDITIVE_BF16 = 4, /* bfloat16 [B, N+1, C]: 0 visible, -3.3895e38 hidden         */
    KDT_MASK_FLASHINFER = 5     /* uint8, ragged: FlashInfer/SGLang packed custom mask (below) */
} kdt_mask_kind;

/*
 * Tree attention masks for the target's verify forward, over the request's KV prefix and
 * the tree: query rows are the N + 1 tree rows (root first), key columns are the prefix
 * (p = prefix_lengths[b] cached tokens) followed by the N + 1 tree rows. Row i sees
 * prefix column c < p for every real node i <= num_nodes[b], and tree column p + j when j
 * is i or an ancestor of i (the builder's visibility). A padding row (i > num_nodes[b])
 * sees only itself (column p + i), never the prefix, so no row is fully masked.
 *
 * trees:          device arrays; reads batch, budget N, num_nodes and parents (required;
 *                 entries 1 .. N of each request are read, those past num_nodes unused).
 * prefix_lengths: device int64 [B], >= 0.
 * kind:           kdt_mask_kind.
 * columns:        C for the dense kinds (row length; p + N + 1 <= C for every request,
 *                 columns from p + N + 1 on are hidden); must be 0 for KDT_MASK_FLASHINFER.
 * mask:           device output. Dense kinds: exactly B * (N+1) * row bytes are written.
 *                 KDT_MASK_FLASHINFER: request b's [N+1, p+N+1] bool mask, flattened row
 *                 major and packed 8 per byte little-endian (numpy packbits(bitorder=
 *                 "little")), starts at byte mask_indptr[b]; segments are consecutive.
 * mask_bytes:     capacity of `mask` in bytes.
 * mask_indptr:    device int32 [B + 1] (KDT_MASK_FLASHINFER only, else NULL): byte offsets
 *                 of the segments, mask_indptr[0] = 0 (FlashInfer's mask_indptr).
 * positions:      device int64 [B, N+1] or NULL: p + depth of each row (padding rows: p).
 * request_status: device int32 [B]: KDT_OK; KDT_ERR_OUT_OF_RANGE (negative prefix, or
 *                 p + N + 1 > C); KDT_ERR_VALUE (num_nodes outside [0, N] or a parent not
 *                 in [0, i)); KDT_ERR_BUFFER_TOO_SMALL (KDT_MASK_FLASHINFER: the segments
 *                 exceed mask_bytes or INT32_MAX bytes; then every request gets it and
 *                 `mask` is not written). A failed request's rows are all hidden (dense) and
 *                 its positions are its prefix length (0 when negative).
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (unknown kind,
 * mask_indptr given for a dense kind, N > 262,143, B > INT32_MAX, a misaligned array),
 * KDT_ERR_SHAPE (columns < N + 1), KDT_ERR_BUFFER_TOO_SMALL (dense kinds),
 * KDT_ERR_OVERFLOW, KDT_ERR_CUDA, KDT_ERR_UNSUPPORTED. On a FlashInfer capacity overflow
 * mask_indptr is all zeros (positions are still written).
 */
KDT_API kdt_status kdt_tree_attention_mask_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
                                                int32_t kind, int64_t columns, void* mask,
                                                size_t mask_bytes, int32_t* mask_indptr,
                                                int64_t* positions, int32_t* request_status,
                                                void* stream);

/*
 * kdt_verify_greedy_cpu on the GPU: the same walk and outputs, one thread block per
 * request, all arrays in device memory (trees, target_tokens [B, N+1], stop_tokens, the
 * arrays of stop_sequences, max_commit, accepted_nodes [B, path_capacity], accept_length
 * [B], bonus_token [B]). request_status: device int32 [B]: KDT_OK or the CPU's status for
 * that request alone (KDT_ERR_VALUE: inconsistent links, negative target token at a
 * visited node; KDT_ERR_INVALID_ARGUMENT: negative max_commit, or malformed
 * stop_sequences arrays, read on the device: every request gets it; KDT_ERR_SHAPE: path
 * longer than path_capacity - 1). A failed request's outputs are accepted_nodes [-1, ...],
 * accept_length 0, bonus_token -1.
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (also B > INT32_MAX),
 * KDT_ERR_SHAPE (the *_from_logits calls: logits batch != B or length != N + 1),
 * KDT_ERR_OVERFLOW, KDT_ERR_CUDA, KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_verify_greedy_cuda(const kdt_trees* trees, const int32_t* target_tokens,
                                          const int32_t* stop_tokens, int64_t num_stop_tokens,
                                          const kdt_stop_sequences* stop_sequences, const int64_t* max_commit, int64_t path_capacity,
                                          int32_t* accepted_nodes, int32_t* accept_length,
                                          int32_t* bonus_token, int32_t* request_status, void* stream);

/*
 * Greedy verification from the target's logits: the target's token at a node is the
 * argmax of its logits row (ties: lower id; NaN rows are an error), then the walk of
 * kdt_verify_greedy_cpu. Only the rows the walk visits are read (at most L + 1 per
 * request), so the result equals the CPU walk on the full argmax.
 *
 * target_logits:  device [B, N+1, V] (kdt_logits; batch B, length N + 1): row i is the
 *                 target's prediction after tree node i (its verify-forward output).
 * target_tokens:  device int32 [B, N+1] or NULL: written with the chosen token at every
 *                 visited node and -1 at the others.
 * Other arguments and outputs as kdt_verify_greedy_cuda; request_status also reports
 * KDT_ERR_VALUE for a NaN logit in a visited row (the request then fails as above).
 * Launch shape (both *_from_logits calls): one block per request, or, on sm_90 and later
 * when the device has at least 2B SMs, a thread-block cluster of 2, 4 or 8 blocks per
 * request (at most one block a SM) that splits each visited row; the outputs are the same
 * either way.
 */
KDT_API kdt_status kdt_verify_greedy_from_logits_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                                      const int32_t* stop_tokens, int64_t num_stop_tokens,
                                                      const kdt_stop_sequences* stop_sequences,
                                                      const int64_t* max_commit, int64_t path_capacity,
                                                      int32_t* accepted_nodes, int32_t* accept_length,
                                                      int32_t* bonus_token, int32_t* target_tokens,
                                                      int32_t* request_status, void* stream);

/*
 * Sampled verification (lossless for any temperature): at each visited node one token is
 * drawn from softmax(logits / temperature) of that node's row, then the walk of
 * kdt_verify_greedy_cpu follows the drawn tokens (a child is accepted when its token is
 * the draw; the bonus token is the draw at the last accepted node). Because the draft tree
 * does not depend on the draws, every committed token is an exact sample of the target.
 *
 * The draw is the Gumbel-max trick with a counter-based generator, reproducible for the
 * same (seed, offset) whatever the launch shape: for request b, node i and token v,
 * x = word v % 4 of Philox4x32-10(counter = (v / 4, i, b, offset & 0xFFFFFFFF),
 * key = (seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32))) (32-bit words, first word
 * first), mapped to (0, 1) as u = (2k + 1) * 2^-25 with k = x >> 8; in float32,
 * t = -log(u) is evaluated from exact arguments (-logf((2k + 1) * 2^-25) for k < 2^23,
 * else -log1pf(-(2^25 - 2k - 1) * 2^-25)), and the token is argmax_v of
 * logit_v / temperature - logf(t) (correctly rounded division and addition), ties by
 * lower id. A -inf logit is never drawn.
 * temperature: finite, >= 1e-6 (smaller values can overflow logit / temperature; use the
 * greedy call for T -> 0). offset: advance it every round (e.g. the round number). The
 * (seed, offset) pairs that differ only in bits 32-63 with equal XOR collide by
 * construction: keep seed < 2^32 or keep it fixed.
 * Other arguments as kdt_verify_greedy_from_logits_cuda (target_tokens: the draws).
 */
KDT_API kdt_status kdt_verify_sample_from_logits_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                                      float temperature, uint64_t seed, uint64_t offset,
                                                      const int32_t* stop_tokens, int64_t num_stop_tokens,
                                                      const kdt_stop_sequences* stop_sequences,
                                                      const int64_t* max_commit, int64_t path_capacity,
                                                      int32_t* accepted_nodes, int32_t* accept_length,
                                                      int32_t* bonus_token, int32_t* target_tokens,
                                                      int32_t* request_status, void* stream);

/* Per-request sampling settings of kdt_verify_sample_batch_cuda, all in device memory and
 * read by the kernel when it runs (so a CUDA graph that captured the call picks up new
 * values, e.g. an offset the graph itself advances). Each array holds one entry per
 * request. An entry out of its range fails that request alone (KDT_ERR_VALUE in
 * request_status), never the launch. */
typedef struct kdt_sampling {
    const float* temperature; /* device float32 [B]: 0 = greedy (argmax, ties lower id),
                                 otherwise finite and >= 1e-6                             */
    const float* top_p;       /* device float32 [B] in (0, 1], or NULL (1: no nucleus cut)  */
    const int32_t* top_k;     /* device int32 [B] >= 0 (0: no top-k cut), or NULL (0)       */
    const uint64_t* seed;     /* device uint64 [B]: Philox key (as the scalar seed)         */
    const uint64_t* offset;   /* device uint64 [B]: advance every round (e.g. in the graph) */
} kdt_sampling;

/*
 * Sampled verification with per-request settings read on the device: temperature, top-p,
 * top-k, seed and offset of request b are sampling->*[b]. The walk, stop tokens, caps and
 * outputs are those of kdt_verify_sample_from_logits_cuda.
 *
 * The target's token at a visited node i of request b (row x = logits of that node,
 * V tokens):
 *   temperature 0: argmax_v x_v, ties lower id, as kdt_verify_greedy_from_logits_cuda
 *     (a NaN in the row fails the request; top_p and top_k are checked, not used).
 *   temperature T > 0: s_v = x_v / T (float32, correctly rounded). A row holding a NaN or
 *     +inf logit, or only -inf logits, fails the request (KDT_ERR_VALUE), as in
 *     kdt_verify_sample_from_logits_cuda. The candidate set C starts as all V tokens;
 *     1. top-k, when 0 < top_k < V: C = the top_k tokens ordered by logit x descending,
 *        ties lower id (-0 equals +0).
 *     2. top-p, when top_p < 1: order C by s descending, ties lower id (the order of
 *        softmax(s) probabilities); keep its shortest prefix whose mass reaches top_p:
 *        with m = max_v s_v, D = ceil(log2(V)) and S = 63 - D, each token of C weighs
 *          w_v = floor(E((double)s_v - (double)m) * 2^S) as an integer (0 for s_v = -inf
 *                or (double)s_v - (double)m < -64),
 *        where E is the float64 exponential of native/cuda/sample_select.cuh (a fixed
 *        sequence of IEEE float64 operations without fused multiply-add: range reduction
 *        by ln 2, a degree-13 Taylor polynomial, scaling by 2^k; within 1e-15 of exp), so
 *        the GPU and the host compute the same integers. The mass Z = sum of w over C is
 *        exact (uint64, at most V * 2^S <= 2^63); the prefix ends at the first token whose
 *        cumulative weight W satisfies (double)W >= (double)top_p * (double)Z, each side a
 *        correctly rounded float64 conversion or product. Tokens less likely than 2^-S times
 *        the most likely token weigh 0 and so are never in a cut nucleus (2^-45 for
 *        V = 151,936).
 *     3. The draw: the Gumbel-max of kdt_verify_sample_from_logits_cuda, with this
 *        request's seed and offset, over the tokens of C only. With top_k = 0 (or >= V)
 *        and top_p = 1 the draws are bit-identical to kdt_verify_sample_from_logits_cuda
 *        with the same temperature, seed and offset.
 * Per-request checks (KDT_ERR_VALUE in request_status, after the tree's links and the cap,
 * before any row is read): temperature NaN, negative, infinite or in (0, 1e-6); top_p
 * NaN or outside (0, 1]; top_k < 0. A failed request gets accepted_nodes [-1, ...],
 * accept_length 0, bonus_token -1 and target_tokens -1.
 *
 * Cost: a request at temperature 0, or with neither cut, reads each visited row once (the
 * other verify calls' speed). A row with a cut is found by radix selection over 64-bit
 * keys (the 32-bit order of the value, then the id): a pass for the row's maximum (top-p),
 * one pass a byte of key per cut until one token is left (usually 3 or 4 per cut; up to 8
 * when tokens tie), and the draw pass; the passes read the row from L2 after the first.
 *
 * sampling:  the struct is read on the host during the call; its arrays are device
 *            arrays (temperature, seed and offset required; top_p, top_k may be NULL).
 * Returns (host-side) the statuses of kdt_verify_sample_from_logits_cuda, and
 * KDT_ERR_NULL_POINTER for a NULL sampling, temperature, seed or offset when B > 0.
 */
KDT_API kdt_status kdt_verify_sample_batch_cuda(const kdt_trees* trees, const kdt_logits* target_logits,
                                                const kdt_sampling* sampling, const int32_t* stop_tokens,
                                                int64_t num_stop_tokens, const kdt_stop_sequences* stop_sequences,
                                                const int64_t* max_commit,
                                                int64_t path_capacity, int32_t* accepted_nodes,
                                                int32_t* accept_length, int32_t* bonus_token,
                                                int32_t* target_tokens, int32_t* request_status, void* stream);

/*
 * kdt_choices_shard_cuda: the target's choice at every row of ONE RANK'S VOCABULARY SLICE,
 * for verification from vocabulary-sharded target logits without gathering them. The rank
 * holds the logits of tokens [vocab_offset, vocab_offset + V_rank): `logits` is [B, R,
 * V_rank] (kdt_logits, vocab = V_rank; R = N + 1 tree rows). For row (b, i), with request
 * b's settings from `sampling` (device arrays [B]: temperature, seed, offset; top_p and
 * top_k must be NULL, their cuts need the whole row):
 *   temperature 0: the slice's largest logit, ties to the lower id (-0 ties with +0);
 *   otherwise: the largest score logit / T - log(-log(u)), u drawn exactly as
 *     kdt_verify_sample_batch_cuda draws it for request b, node nodes[b * R + i] (or i when
 *     nodes is NULL) and the GLOBAL token id vocab_offset + column, so each token's score
 *     is bit for bit the unsharded call's.
 * out: device float64 [B, R, 4], per row: the best value (-inf when no score is above
 *   -inf), its global id (-1 then), 1.0 when the row holds a NaN logit (sampling: also
 *   +inf) or the request's temperature is neither 0 nor finite and >= 1e-6, else 0.0, and
 *   1.0 when any score is above -inf, else 0.0.
 * Merging the ranks' rows gives the unsharded choice: the largest value, the lowest id
 * among the ranks at it; no choice (-1) when any rank flags the row or (sampling) none has
 * a score above -inf. One block per row, stream-ordered, no allocation, capturable.
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (logits, top_p / top_k
 * given, vocab_offset + V_rank outside [0, 2^31], B x R > INT32_MAX, a misaligned array),
 * KDT_ERR_OVERFLOW, KDT_ERR_CUDA, KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_choices_shard_cuda(const kdt_logits* logits, int64_t vocab_offset,
                                          const kdt_sampling* sampling, const int32_t* nodes, double* out,
                                          void* stream);

/* A paged-free KV cache: per layer one K and one V tensor of logical shape
 * [batch, heads, seq_capacity, head_dim] with explicit element strides (head_dim is
 * contiguous), so both [B, H, S, D] (Hugging Face) and [B, S, H, D] layouts are described. */
typedef struct kdt_kv_cache {
    void* const* k_layers; /* device array [num_layers] of device pointers to K tensors     */
    void* const* v_layers; /* device array [num_layers] of device pointers to V tensors, or NULL (K only) */
    int64_t num_layers;    /* >= 0                                                           */
    int32_t dtype;         /* KDT_DTYPE_FLOAT16, _BFLOAT16, _FLOAT32, or _UINT8 / _INT8 for a
                              one-byte cache (fp8 e4m3 / e5m2: moved as bytes)               */
    int32_t reserved;      /* must be 0                                                      */
    int64_t batch;         /* B >= 0                                                         */
    int64_t heads;         /* >= 0                                                           */
    int64_t seq_capacity;  /* S: rows per (request, head)                                    */
    int64_t head_dim;      /* D >= 0                                                         */
    int64_t batch_stride;  /* elements between requests                                      */
    int64_t head_stride;   /* elements between heads                                         */
    int64_t seq_stride;    /* elements between sequence rows (>= head_dim)                   */
} kdt_kv_cache;

/*
 * KV-cache compaction after verification, in place, all layers in one launch: the verify
 * forward wrote tree row i of request b at sequence row p + i (p = prefix_lengths[b]);
 * the accepted path's rows move to the contiguous rows right after the prefix:
 * row p + accepted_nodes[b][j] -> row p + j for j = 0 .. accept_length[b] (root first).
 * The caller then treats the first p + accept_length[b] + 1 rows as the cache. Requests
 * whose path is already contiguous (accepted_nodes[b][j] == j) are not touched. The
 * tensors must not overlap (no tensor shared by two layers or by K and V, no zero strides):
 * each (layer, K or V, head) is moved by its own threads.
 *
 * accepted_nodes: device int32 [B, path_capacity], accept_length: device int32 [B] (the
 * outputs of the verify calls). prefix_lengths: device int64 [B].
 * request_status: device int32 [B]: KDT_OK, or KDT_ERR_VALUE (path not starting at 0, not
 * strictly increasing, accept_length outside [0, path_capacity - 1]) or
 * KDT_ERR_OUT_OF_RANGE (negative prefix, a row beyond seq_capacity); such a request's
 * cache is not touched.
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (dtype, reserved,
 * negative sizes or strides, alignment), KDT_ERR_OVERFLOW, KDT_ERR_CUDA,
 * KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_compact_kv_cuda(const kdt_kv_cache* cache, const int64_t* prefix_lengths,
                                       const int32_t* accepted_nodes, const int32_t* accept_length,
                                       int64_t path_capacity, int32_t* request_status, void* stream);

/* A paged KV cache: per layer one K and one V page pool; token t of request b, head h
 * starts at element
 *   block_table[b * block_table_stride + t / page_size] * page_stride + h * head_stride
 *   + (t % page_size) * token_stride
 * (head_dim contiguous), e.g. vLLM's / SGLang's [pages, page_size, H, D]:
 * (page_size*H*D, D, H*D); FlashInfer's HND [pages, H, page_size, D]:
 * (H*page_size*D, page_size*D, D). */
typedef struct kdt_paged_kv_cache {
    void* const* k_layers;      /* device array [num_layers] of device pointers to K pools     */
    void* const* v_layers;      /* device array [num_layers] of device pointers to V pools, or NULL */
    int64_t num_layers;         /* >= 0                                                        */
    int32_t dtype;              /* as kdt_kv_cache (fp8 caches as KDT_DTYPE_UINT8 or _INT8)    */
    int32_t reserved;           /* must be 0                                                   */
    int64_t batch;              /* B >= 0                                                      */
    int64_t heads;              /* >= 0                                                        */
    int64_t head_dim;           /* D >= 0                                                      */
    int64_t pages;              /* pages in each pool                                          */
    int64_t page_size;          /* tokens a page, 1 .. 256                                     */
    int64_t page_stride;        /* elements between pages                                      */
    int64_t head_stride;        /* elements between heads                                      */
    int64_t token_stride;       /* elements between the tokens (slots) of a page (>= head_dim) */
    const int32_t* block_table; /* device int32 [B, block_table_stride]: page ids              */
    int64_t block_table_stride; /* entries a request (>= 1)                                    */
} kdt_paged_kv_cache;

/*
 * kdt_compact_kv_cuda on a paged cache: the accepted path's rows move from token p +
 * accepted_nodes[b][j] to token p + j (j = 0 .. accept_length[b]; j = 0, the root, is
 * already in place), through the request's block table, all layers in one launch. The pages that hold tokens p + 1 .. p +
 * accepted_nodes[b][accept_length[b]] must be the request's own (a page shared with
 * another request in that range, or listed twice, is moved twice; not checked).
 *
 * request_status: as kdt_compact_kv_cuda, and KDT_ERR_OUT_OF_RANGE also for a token past
 * block_table_stride * page_size or a page id (of a token read or written) outside
 * [0, pages); such a request's cache is not touched.
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (dtype, reserved,
 * sizes, strides, page size, alignment), KDT_ERR_OVERFLOW, KDT_ERR_CUDA,
 * KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_compact_kv_paged_cuda(const kdt_paged_kv_cache* cache, const int64_t* prefix_lengths,
                                             const int32_t* accepted_nodes, const int32_t* accept_length,
                                             int64_t path_capacity, int32_t* request_status, void* stream);

/*
 * kdt_trees_ragged_cpu on the GPU: `trees` and `out` hold device arrays (the structs are
 * read on the host), stream-ordered, no allocation, capturable in a CUDA graph.
 * request_status: device int32 [B]: KDT_OK; KDT_ERR_VALUE (num_nodes outside [0, N]: the
 * request is packed as its root row alone); KDT_ERR_BUFFER_TOO_SMALL for every request when
 * the real rows exceed capacity (then cu_rows is all zeros and nothing else is written).
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (negative sizes, B or
 * capacity past INT32_MAX, a misaligned array), KDT_ERR_OVERFLOW, KDT_ERR_CUDA,
 * KDT_ERR_NO_DEVICE, KDT_ERR_UNSUPPORTED.
 */
KDT_API kdt_status kdt_trees_ragged_cuda(const kdt_trees* trees, kdt_trees_ragged* out, int32_t* request_status,
                                         void* stream);

/* ---- Tree attention (the verify forward's attention) -------------------------------- */

/* Rows of queries or outputs for kdt_tree_attention_cuda: logical shape [B, R, H, D]
 * (request, tree row, head, head_dim) with element strides; head_dim is contiguous. Every
 * stride must be a multiple of 8 elements and `data` 16-byte aligned (16-byte vectors). */
typedef struct kdt_attention_rows {
    void* data;           /* device; read for queries, written for outputs                 */
    int64_t batch_stride; /* elements between requests                                     */
    int64_t row_stride;   /* elements between tree rows                                    */
    int64_t head_stride;  /* elements between heads                                        */
} kdt_attention_rows;

/* The K and V caches kdt_tree_attention_cuda reads: the same layout for both, head_dim
 * contiguous, element strides multiples of 8, pointers 16-byte aligned.
 *
 * Contiguous (block_table NULL): token t of request b, KV head h starts at element
 *   b * outer_stride + h * head_stride + t * token_stride,
 * e.g. [B, H, S, D]: (H*S*D, S*D, D); [B, S, H, D]: (S*H*D, D, H*D); capacity = S.
 * Paged (block_table given): token t lives in page block_table[b * block_table_stride +
 * t / page_size], slot t % page_size, starting at element
 *   page * outer_stride + h * head_stride + slot * token_stride,
 * e.g. vLLM's [pages, page_size, H, D]: (page_size*H*D, D, H*D); FlashInfer's HND
 * [pages, H, page_size, D]: (H*page_size*D, page_size*D, D); capacity = pages in the pool. */
typedef struct kdt_attention_cache {
    const void* k;              /* device K                                                  */
    const void* v;              /* device V                                                  */
    int64_t kv_heads;           /* KV heads (>= 1); q_heads is a multiple of it (GQA)        */
    int64_t outer_stride;       /* elements between requests (contiguous) or pages (paged)   */
    int64_t head_stride;        /* elements between KV heads                                 */
    int64_t token_stride;       /* elements between tokens (slots of a page)                 */
    int64_t capacity;           /* contiguous: token rows a request; paged: pages in the pool */
    const int32_t* block_table; /* NULL (contiguous) or device int32 [B, block_table_stride] */
    int64_t block_table_stride; /* paged: entries a request (>= 1); contiguous: 0            */
    int64_t page_size;          /* paged: tokens a page, 1 .. 256; contiguous: 0             */
} kdt_attention_cache;

/* Workspace bytes of kdt_tree_attention_cuda for these sizes (0 when the keys are not
 * split: enough CTAs without splitting, or short contexts). The split plan depends only on
 * these arguments. Returns KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (as below),
 * KDT_ERR_UNSUPPORTED (no CUDA). */
KDT_API kdt_status kdt_tree_attention_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t q_heads,
                                                           int64_t kv_heads, int64_t head_dim,
                                                           int64_t max_prefix, size_t* bytes);

/*
 * Tree attention of the verify forward, for B requests at once: request b's R = N + 1 tree
 * rows (root first) attend to its p = prefix_lengths[b] cached tokens and to the tree's
 * own rows, which the verify forward has written to the cache as tokens p .. p + N (row i
 * at token p + i, before this call). A real row i <= num_nodes[b] sees every prefix token
 * and tree token p + j for j == i or j an ancestor of i (bit j of visibility_bits[b][i]);
 * tokens past p + num_nodes[b] are never read.
 *
 *   out[b, i, h, :] = softmax_j(scale * q[b, i, h, :] . k[j, :]) v[j, :] over visible j,
 *   lse[b, i, h]    = log sum_j exp(scale * q . k[j])   (natural log)
 *
 * with k, v the request's KV head h / (q_heads / kv_heads). float16 or bfloat16 in and out,
 * float32 products, softmax and accumulation (wgmma on compute capability 9.0 for head dims
 * 64 and 128 where the library has sm_90a code, mma.sync m16n8k16 elsewhere; the two sum in
 * different orders, so their outputs may differ in the last bits, both within the bound
 * of docs/api.md); the weights are rounded to the input dtype before the product with V,
 * as FlashAttention does.
 *
 * trees:          device arrays: batch B, budget N, num_nodes and visibility_bits
 *                 (required; the builder's [B, N+1, ceil((N+1)/32)] words).
 * prefix_lengths: device int64 [B], each in [0, max_prefix].
 * max_prefix:     host bound on every prefix length, in [0, 2^31 - 2^19]; with B, N
 *                 and the head counts it fixes how the keys are split (and the workspace).
 * q:              [B, N+1, q_heads, head_dim] of `dtype`.
 * cache:          K and V (kdt_attention_cache), of `dtype`.
 * dtype:          KDT_DTYPE_FLOAT16 or KDT_DTYPE_BFLOAT16.
 * head_dim:       64, 128 or 256.
 * softmax_scale:  > 0, finite (usually 1 / sqrt(head_dim)).
 * out:            [B, N+1, q_heads, head_dim] of `dtype`, every element written: padding
 *                 rows (i > num_nodes[b]) and failed requests are zeros.
 * lse:            device float32 [B, N+1, q_heads] or NULL; -inf where out is zeros.
 * request_status: device int32 [B]: KDT_OK; KDT_ERR_VALUE (num_nodes outside [0, N]);
 *                 KDT_ERR_OUT_OF_RANGE (prefix outside [0, max_prefix]; contiguous: p +
 *                 num_nodes + 1 > capacity; paged: a page index past block_table_stride or
 *                 a page id outside [0, capacity)).
 * workspace:      device, kdt_tree_attention_cuda_workspace_bytes (may be NULL when 0).
 * Returns (host-side) KDT_ERR_NULL_POINTER, KDT_ERR_INVALID_ARGUMENT (dtype, sizes,
 * head counts, strides, page size, alignment, scale), KDT_ERR_BUFFER_TOO_SMALL
 * (workspace), KDT_ERR_OVERFLOW, KDT_ERR_CUDA, KDT_ERR_UNSUPPORTED. No allocation, no
 * synchronisation; capturable in a CUDA graph.
 */
KDT_API kdt_status kdt_tree_attention_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
                                           int64_t max_prefix, const kdt_attention_rows* q,
                                           const kdt_attention_cache* cache, int32_t dtype, int64_t q_heads,
                                           int64_t head_dim, float softmax_scale, kdt_attention_rows* out,
                                           float* lse, int32_t* request_status, void* workspace,
                                           size_t workspace_bytes, void* stream);

/* Workspace bytes of kdt_tree_attention_mla_cuda (0 when the keys are not split). Errors
 * as kdt_tree_attention_cuda_workspace_bytes. */
KDT_API kdt_status kdt_tree_attention_mla_cuda_workspace_bytes(int64_t batch, int64_t budget, int64_t q_heads,
                                                               int64_t max_prefix, size_t* bytes);

/*
 * Tree attention for MLA (multi-head latent attention, absorbed form; DeepSeek-V3,
 * Kimi-K2): one latent KV head of 576 values a token (the 512-value latent, then the 64
 * rotary key values) and q_heads query heads, each an absorbed query of 576 values. The
 * tree rule, prefix, padding rows, statuses, splitting and workspace are those of
 * kdt_tree_attention_cuda; scores use all 576 values, and the output of a row and head is
 * the softmax-weighted sum of the visible tokens' first 512 values:
 *
 *   out[b, i, h, :] = sum_j softmax_j(scale * q[b, i, h, :] . c[j, :]) c[j, 0:512]
 *
 * q:      [B, N+1, q_heads, 576] of `dtype`.
 * cache:  the latent cache: kv_heads 1; k the 576-value rows (contiguous, e.g. [B, S, 576]:
 *         outer_stride S*576, token_stride 576, head_stride 0; or paged, e.g. vLLM's
 *         [pages, page_size, 576]); v NULL or equal to k (V is read from k).
 * q_heads: 1 .. 4096 (16 to 128 in the published models).
 * out:    [B, N+1, q_heads, 512] of `dtype`; lse as kdt_tree_attention_cuda.
 * Returns (host-side) as kdt_tree_attention_cuda, and KDT_ERR_INVALID_ARGUMENT for
 * kv_heads != 1.
 */
KDT_API kdt_status kdt_tree_attention_mla_cuda(const kdt_trees* trees, const int64_t* prefix_lengths,
                                               int64_t max_prefix, const kdt_attention_rows* q,
                                               const kdt_attention_cache* cache, int32_t dtype, int64_t q_heads,
                                               float softmax_scale, kdt_attention_rows* out, float* lse,
                                               int32_t* request_status, void* workspace, size_t workspace_bytes,
                                               void* stream);

/* ---- KDTR: the container of named arrays (docs/kdtr-format.md) --------------------- */

/* Bytes per element of a dtype. KDT_ERR_UNSUPPORTED for an unknown code. */
KDT_API kdt_status kdt_dtype_size(int32_t dtype, size_t* bytes);

/* One array of a KDTR file. Pointers are owned by the file object (reader) or the caller
 * (writer) and stay valid until kdt_kdtr_close. */
typedef struct kdt_kdtr_array {
    const char* name;     /* UTF-8, NUL-terminated, unique within a file             */
    int32_t dtype;        /* kdt_dtype                                               */
    int32_t ndim;         /* 0 .. KDT_KDTR_MAX_NDIM                                  */
    const int64_t* shape; /* [ndim] (NULL allowed when ndim == 0); every extent >= 0 */
    const void* data;     /* product(shape) * dtype size bytes, C order, little-endian */
    uint64_t nbytes;      /* product(shape) * dtype size                             */
} kdt_kdtr_array;

#define KDT_KDTR_MAX_NDIM 32

/* An opened, fully validated KDTR file held in memory. */
typedef struct kdt_kdtr_file kdt_kdtr_file;

/* Validates the whole file at `path` (every length, count, offset, shape product, version
 * and dtype is checked before anything is allocated for it) and reads only its header,
 * record table and arrays' data, not bytes no record points at. Returns KDT_ERR_IO,
 * KDT_ERR_FORMAT (kdt_last_error names the field and byte offset), KDT_ERR_UNSUPPORTED
 * (unknown major version or dtype), KDT_ERR_OUT_OF_MEMORY, KDT_ERR_NULL_POINTER. On
 * failure *out is set to NULL. */
KDT_API kdt_status kdt_kdtr_open(const char* path, kdt_kdtr_file** out);

/* As kdt_kdtr_open, from `size` bytes at `data` (the arrays' data is copied; the caller
 * keeps ownership). */
KDT_API kdt_status kdt_kdtr_open_memory(const void* data, size_t size, kdt_kdtr_file** out);

/* Frees a file object (NULL is allowed). */
KDT_API void kdt_kdtr_close(kdt_kdtr_file* file);

/* Number of arrays in the file. */
KDT_API kdt_status kdt_kdtr_count(const kdt_kdtr_file* file, int64_t* count);

/* The index-th array (0-based, file order). KDT_ERR_OUT_OF_RANGE for a bad index. */
KDT_API kdt_status kdt_kdtr_get(const kdt_kdtr_file* file, int64_t index, kdt_kdtr_array* out);

/* The array called `name`. KDT_ERR_NOT_FOUND when absent. */
KDT_API kdt_status kdt_kdtr_find(const kdt_kdtr_file* file, const char* name,
                                 kdt_kdtr_array* out);

/* Writes `count` arrays to `path` (replacing it) as a KDTR file. Validates every array
 * (name non-empty and unique, dtype known, ndim range, shape >= 0, nbytes consistent, no
 * overflow) before creating the file. Returns KDT_ERR_NULL_POINTER,
 * KDT_ERR_INVALID_ARGUMENT, KDT_ERR_UNSUPPORTED, KDT_ERR_OVERFLOW, KDT_ERR_IO. */
KDT_API kdt_status kdt_kdtr_save(const char* path, const kdt_kdtr_array* arrays, int64_t count);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KDTREE_H */
