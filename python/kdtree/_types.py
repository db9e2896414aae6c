"""Result types shared by the native bindings and the pure-Python reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
    # same array objects are in place (see kdtree.api._trees_struct).
    _native: tuple | None = field(default=None, init=False, repr=False, compare=False)

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
        target_tokens   int32 [B, N+1]    GPU from-logits calls only: the target's token at
                        / None            each visited node (argmax or draw), -1 elsewhere

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
            from ._device import to_host

            return to_host(a[b])

        n = int(host(self.accept_length))
        nodes = np.asarray(host(self.accepted_nodes))[1 : 1 + n]
        out = [int(t) for t in np.asarray(host(trees.tokens))[nodes]]
        bonus = int(host(self.bonus_token))
        if bonus >= 0:
            out.append(bonus)
        return out
