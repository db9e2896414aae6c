"""Result types shared by the native bindings and the pure-Python reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The arrays of a TreeBatch: name -> (dtype, dimensions), in kdt_trees order
# (include/kdtree.h; kdt_trees_field values 0 .. 9).
TREE_FIELDS = {
    "num_nodes": ("int32", 1),
    "tokens": ("int32", 2),
    "depths": ("int32", 2),
    "parents": ("int32", 2),
    "logw": ("float64", 2),
    "positions": ("int64", 2),
    "visibility": ("bool", 3),
    "visibility_bits": ("uint32", 3),
    "first_child": ("int32", 2),
    "next_sibling": ("int32", 2),
}

# The hidden value of the additive masks per dtype: the dtype's lowest finite value
# (KDT_MASK_ADDITIVE_F32 / _F16 / _BF16 in include/kdtree.h); visible entries are 0.
ADDITIVE_LOWEST = {"float32": -3.4028234663852886e38, "float16": -65504.0,
                   "bfloat16": -3.3895313892515355e38}  # bfloat16's lowest finite (0xFF7F)


@dataclass
class TreeBatch:
    """Draft trees for ``B`` requests with budget ``N`` (spec: "Outputs", "Fixed-size
    (padded) output"). Every per-node array has ``N + 1`` rows per request: row 0 is the
    root, rows ``1..num_nodes[b]`` the draft nodes in pop order (decreasing score), the
    rest padding.

    Fields (numpy arrays, C-contiguous):
        num_nodes        int32   [B]            draft nodes per request (root excluded)
        tokens           int32   [B, N+1]       root token (or pad) / node token / pad
        depths           int32   [B, N+1]       0 for root and padding
        parents          int32   [B, N+1]       -1 for root and padding
        logw             float64 [B, N+1]       cumulative log-prob; root 0.0, padding -inf
        positions        int64   [B, N+1]       root position + depth
        visibility       bool    [B, N+1, N+1]  ancestor-only tree attention mask
        visibility_bits  uint32  [B, N+1, W]    the mask bit-packed, W = ceil((N+1)/32),
                                                bit j % 32 of word j // 32 = column j
        first_child      int32   [B, N+1]       first child node or -1
        next_sibling     int32   [B, N+1]       next sibling node or -1
        budget           int                    N
        depth            int                    L, the depth limit the trees were built with
        request_status   int32   [B] or None    GPU builds only: KDT_OK (0) or the request's
                                                error status (see include/kdtree.h)

    Arrays are numpy arrays for CPU builds and arrays of the caller's GPU library (torch,
    CuPy) for GPU builds.
    """

    num_nodes: np.ndarray
    tokens: np.ndarray
    depths: np.ndarray
    parents: np.ndarray
    logw: np.ndarray
    positions: np.ndarray
    visibility: np.ndarray
    visibility_bits: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray
    budget: int
    depth: int
    request_status: object = field(default=None, repr=False, compare=False)
    # (arrays, budget, C struct, byte ranges) of the last native call: reused while the
    # same array objects are in place (see kdtree.core.host.trees_struct).
    _native: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        # copies and pickles carry the arrays, not the cached C view (its pointers name
        # this object's buffers; a copy makes its own on first use)
        state = dict(self.__dict__)
        state["_native"] = None
        return state

    @property
    def batch(self) -> int:
        """Number of requests ``B``."""
        return int(self.num_nodes.shape[0])

    def __repr__(self) -> str:
        return (f"TreeBatch(batch={self.batch}, budget={self.budget}, depth={self.depth}, "
                f"num_nodes={self.num_nodes.tolist() if self.batch <= 8 else '...'})")


@dataclass
class Acceptance:
    """Result of the verification walk for ``B`` requests (spec: "Verification").

    Fields:
        accepted_nodes  int32 [B, L+1]  node indices of the accepted path, root (0) first,
                                        then -1 padding
        accept_length   int32 [B]       accepted draft nodes (root excluded)
        bonus_token     int32 [B]       the target's token at the last accepted node, or -1
                                        when none is committed (stop token accepted, cap 0)
        request_status  int32 [B] / None  GPU calls only: KDT_OK (0) or the request's status
        target_tokens   int32 [B, N+1]    the from-logits calls (CPU and GPU): the target's
                        / None            token (argmax or draw) at each node the walk read a
                                          row of (the root and the accepted nodes, the last
                                          one only when a bonus token follows it), -1
                                          elsewhere; None from verify_greedy (given tokens)

    Committed tokens for request b: ``trees.tokens[b, accepted_nodes[b, 1:1+accept_length[b]]]``
    followed by ``bonus_token[b]`` when it is >= 0.
    """

    accepted_nodes: np.ndarray
    accept_length: np.ndarray
    bonus_token: np.ndarray
    request_status: object = field(default=None, repr=False, compare=False)
    target_tokens: object = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        b = int(self.accept_length.shape[0])
        if b > 8:
            return f"Acceptance(batch={b})"
        return (f"Acceptance(accept_length={self.accept_length.tolist()}, "
                f"bonus_token={self.bonus_token.tolist()})")

    def committed(self, trees: TreeBatch, b: int = 0) -> list[int]:
        """The tokens request ``b`` commits this round (accepted draft tokens, then bonus).
        GPU arrays are copied to the host (this synchronises). IndexError when b is not a
        request of the batch (0 <= b < B)."""
        batch = int(self.accept_length.shape[0])
        if not 0 <= b < batch:
            raise IndexError(f"request {b} is out of range: this batch has {batch} requests (0 .. {batch - 1})")

        def host(a):
            if isinstance(a, np.ndarray):
                return a[b]
            from .device import to_host

            return to_host(a[b])

        n = int(host(self.accept_length))
        nodes = np.asarray(host(self.accepted_nodes))[1 : 1 + n]
        out = [int(t) for t in np.asarray(host(trees.tokens))[nodes]]
        bonus = int(host(self.bonus_token))
        if bonus >= 0:
            out.append(bonus)
        return out


class TopK(tuple):
    """Result of :func:`kdtree.topk_logprobs`: unpacks as ``(logprobs, ids)``.

    Fields:
        logprobs    float32 [..., k]  log-probs, sorted descending (ties: lower id first)
        ids         int32   [..., k]  their token ids
        row_status  int32   [...]     KDT_OK (0) or the row's status (KDT_ERR_VALUE for a
                                      row with a NaN or +inf logit, or only -inf logits);
                    ([1] for 1-D logits)  always set; a failed row's outputs are undefined

    Arrays are numpy arrays for host logits and the caller's GPU library's arrays for GPU
    logits (where ``row_status`` is valid once the stream has run the call).
    """

    def __new__(cls, logprobs, ids, row_status):
        self = super().__new__(cls, (logprobs, ids))
        self.row_status = row_status
        return self

    def __getnewargs__(self):
        return (self[0], self[1], self.row_status)

    @property
    def logprobs(self):
        return self[0]

    @property
    def ids(self):
        return self[1]


class TreeMask(tuple):
    """Result of :func:`kdtree.tree_attention_mask`: unpacks as
    ``(mask, mask_indptr, positions)``.

    Fields:
        mask            the mask in the layout asked for (see the function)
        mask_indptr     int32 [B + 1] byte offsets for ``kind="flashinfer"``, else None
        positions       int64 [B, N+1]  ``prefix_lengths[b] + depth`` (padding rows: the prefix)
        request_status  int32 [B]  KDT_OK (0) or the request's status; always set
    """

    def __new__(cls, mask, mask_indptr, positions, request_status):
        self = super().__new__(cls, (mask, mask_indptr, positions))
        self.request_status = request_status
        return self

    def __getnewargs__(self):
        return (self[0], self[1], self[2], self.request_status)

    @property
    def mask(self):
        return self[0]

    @property
    def mask_indptr(self):
        return self[1]

    @property
    def positions(self):
        return self[2]


class TopKShard(tuple):
    """Result of :func:`kdtree.topk_shard`, one vocabulary shard's summary of each row:
    unpacks as ``(logits, ids, max, sum_rest)``.

    Fields:
        logits  float32 [..., k]  the shard's k largest logits as they are, best first
                                  (ties: lower id)
        ids     int32   [..., k]  their global token ids (vocab_offset + column)
        max     float32 [...]     the shard's largest logit (-inf when all are -inf)
        sum_rest  float64 [...]     sum of exp(logit - max) over the shard but its first
                                  entry at the max (0 when all are -inf)
    """

    def __new__(cls, logits, ids, max, sum_rest):  # noqa: A002 (the field's name)
        return super().__new__(cls, (logits, ids, max, sum_rest))

    def __getnewargs__(self):
        return tuple(self)

    @property
    def logits(self):
        return self[0]

    @property
    def ids(self):
        return self[1]

    @property
    def max(self):
        return self[2]

    @property
    def sum_rest(self):
        return self[3]


# The arrays of a RaggedTrees (kdt_trees_ragged order after cu_rows): name -> dtype.
RAGGED_FIELDS = {
    "row_request": "int32",
    "row_node": "int32",
    "tokens": "int32",
    "depths": "int32",
    "parents": "int32",
    "positions": "int64",
    "visibility_bits": "uint32",
}


@dataclass
class RaggedTrees:
    """The real rows of a :class:`TreeBatch` packed back to back (``kdt_trees_ragged``,
    include/kdtree.h), for kernels taking variable-length query rows: request b's
    ``num_nodes[b] + 1`` rows (root first) are rows ``cu_rows[b] .. cu_rows[b + 1] - 1``;
    no padding row is stored.

    Fields (host arrays for host trees, device arrays of the trees' library for GPU trees):
        cu_rows          int32  [B + 1]         row offsets, cu_rows[0] = 0
        row_request      int32  [capacity]      request of each row
        row_node         int32  [capacity]      node index of each row in the padded layout
        tokens           int32  [capacity]
        depths           int32  [capacity]
        parents          int32  [capacity]      request-local node index; -1 for the root
        positions        int64  [capacity]
        visibility_bits  uint32 [capacity, W]   the row's tree visibility, W = ceil((N+1)/32)
        budget           int                    N of the trees
        request_status   int32  [B] or None     GPU only: KDT_OK or KDT_ERR_VALUE (bad
                                                num_nodes: packed as its root alone) or
                                                KDT_ERR_BUFFER_TOO_SMALL
    Rows from ``cu_rows[B]`` to ``capacity`` are filler (-1 ids, 0 depths, positions, bits).
    The tree attention mask is ``visibility_bits`` with the prefix implicit: a real row
    sees its request's whole KV prefix and the tree rows whose bits are set.
    """

    cu_rows: np.ndarray
    row_request: np.ndarray
    row_node: np.ndarray
    tokens: np.ndarray
    depths: np.ndarray
    parents: np.ndarray
    positions: np.ndarray
    visibility_bits: np.ndarray
    budget: int
    request_status: np.ndarray | None = None

    @property
    def capacity(self) -> int:
        return int(self.row_request.shape[0])


@dataclass(frozen=True)
class StopSequences:
    """Multi-token stop sequences checked once, for many verify calls
    (:func:`kdtree.stop_sequences`). ``sequences``: the token sequences (tuples of ids);
    ``tokens`` int32 ``[total]`` and ``offsets`` int64 ``[count + 1]``: the packed form of
    ``kdt_stop_sequences``, numpy arrays or, when prepared for a GPU, device arrays there,
    which the GPU verify calls use in place (no copy: a CUDA graph can hold the call).
    ``longest``: the longest sequence's length."""

    sequences: tuple
    tokens: object
    offsets: object

    @property
    def longest(self) -> int:
        return max((len(q) for q in self.sequences), default=0)

