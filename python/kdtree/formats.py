"""kdtree's trees in the speculative-decoding layouts serving engines consume.

Each adapter takes a :class:`kdtree.TreeBatch` (numpy, torch or CuPy arrays, host or GPU;
the results are arrays of the same library on the same device, made without a host copy)
and returns the engine's tensors, field by field as the engine defines them. None carries
an engine's node caps: every tree of the batch keeps its N + 1 rows (root first, draft
nodes in kdtree's order, then padding rows, which no child list links to, so a walk never
reaches them and their outputs are never used).

- :func:`sglang_verify_inputs`: SGLang's EAGLE tree verify inputs (``EagleVerifyInput``:
  ``draft_token``, ``positions``, ``retrive_index``, ``retrive_next_token``,
  ``retrive_next_sibling``, ``custom_mask`` in each ``TreeMaskMode``), as
  ``build_tree_kernel_efficient`` (``sgl-kernel/csrc/speculative/eagle_utils.cu``) lays
  them out; :func:`sglang_accept_outputs` turns a kdtree :class:`~kdtree.Acceptance` into
  the ``accept_index``, ``accept_token_num`` and ``predicts`` of its ``verify_tree_greedy``.
- :func:`tensorrt_llm_spec_inputs`: TensorRT-LLM's ``spec_decoding_packed_mask``,
  ``spec_decoding_position_offsets``, ``spec_decoding_generation_lengths`` and the EAGLE
  paths (one row per node as its PyTorch flow keeps them, or one per leaf as its C++
  runtime does).
- :func:`rank_paths`: one tree as the list of rank paths from the root, sorted breadth
  first: vLLM's ``speculative_token_tree`` and TensorRT-LLM's ``eagle_choices`` form.
  (vLLM's tree attention backend took one static tree for every request and was removed
  on 2026-05-08, vllm-project/vllm#42121; DDTree's trees differ per request.)

Conventions shared with kdtree: node 0 is the root (the last committed token, not yet in
the KV cache); a node's children are listed in increasing node number, which is
decreasing score and increasing drafter rank, the sibling order these engines walk.
"""

from __future__ import annotations

import numpy as np

from .core import checks
from .core.types import Acceptance, TreeBatch

__all__ = ["flashinfer_ragged_mask", "rank_paths", "sglang_accept_outputs", "sglang_verify_inputs",
           "tensorrt_llm_spec_inputs"]


# ---- array-library shim: numpy / CuPy (numpy's API) or torch -----------------------------------


class _Torch:
    def __init__(self, like):
        import torch

        self.t, self.device = torch, like.device

    def cast(self, a, dtype):
        return a.to(getattr(self.t, dtype))

    def arange(self, n, dtype="int64"):
        return self.t.arange(n, dtype=getattr(self.t, dtype), device=self.device)

    def full(self, shape, value, dtype):
        return self.t.full(shape, value, dtype=getattr(self.t, dtype), device=self.device)

    def asarray(self, a, dtype):
        return self.t.as_tensor(np.asarray(a) if not isinstance(a, self.t.Tensor) else a,
                                dtype=getattr(self.t, dtype), device=self.device)

    def take(self, a, idx, axis):
        return self.t.gather(a, axis, idx)

    def expand(self, a, shape):
        return a.expand(*shape)

    def where(self, c, a, b):
        return self.t.where(c, a, b)

    def concat(self, xs):
        return self.t.cat(list(xs))

    def cumsum(self, a):
        return self.t.cumsum(a, 0)


class _Numpy:
    def __init__(self, like):
        module = type(like).__module__.split(".")[0]
        if module == "cupy":
            import cupy

            self.xp = cupy
        else:
            self.xp = np

    def cast(self, a, dtype):
        return a.astype(dtype)

    def arange(self, n, dtype="int64"):
        return self.xp.arange(n, dtype=dtype)

    def full(self, shape, value, dtype):
        return self.xp.full(shape, value, dtype=dtype)

    def asarray(self, a, dtype):
        return self.xp.asarray(a, dtype=dtype)

    def take(self, a, idx, axis):
        return self.xp.take_along_axis(a, idx, axis)

    def expand(self, a, shape):
        return self.xp.broadcast_to(a, shape)

    def where(self, c, a, b):
        return self.xp.where(c, a, b)

    def concat(self, xs):
        return self.xp.concatenate(list(xs))

    def cumsum(self, a):
        return self.xp.cumsum(a, 0)


def _ops(like):
    return _Torch(like) if type(like).__module__.split(".")[0] == "torch" else _Numpy(like)


def _check_trees(trees, fields) -> None:
    if not isinstance(trees, TreeBatch):
        raise checks.type_error(f"trees must be a kdtree.TreeBatch, got {type(trees).__name__}")
    for name in fields:
        if getattr(trees, name) is None:
            raise checks.invalid(f"trees.{name} is required")
    n = trees.num_nodes
    if isinstance(n, np.ndarray) and n.size:  # (device arrays are not read back for this check)
        bad = np.flatnonzero((n < 0) | (n > trees.budget))
        if bad.size:
            raise checks.value_error(f"request {int(bad[0])}: num_nodes {int(n[bad[0]])} outside [0, {trees.budget}]")


def _real(trees, ops):
    """[B, N+1] bool: row i of request b is a real row (i <= num_nodes[b])."""
    rows = trees.budget + 1
    return ops.arange(rows)[None, :] <= ops.cast(trees.num_nodes, "int64")[:, None]


# ---- SGLang -------------------------------------------------------------------------------------


def sglang_verify_inputs(trees: TreeBatch, seq_lens, *, mask: str = "full", pad_token: int = 0) -> dict:
    """SGLang's EAGLE tree verify inputs for kdtree's trees (``draft_token_num`` T = N + 1).

    Args:
        trees: the :class:`~kdtree.TreeBatch` (its ``tokens``, ``depths``, ``first_child``,
            ``next_sibling`` and ``visibility_bits`` are read).
        seq_lens: ``[B]`` ints >= 0: each request's KV length before this round (SGLang's
            ``seq_lens``; the root token is not in the cache yet and sits at that position).
            Read on the host (a device array is copied: that synchronises).
        mask: SGLang's ``TreeMaskMode``: ``"full"`` (FULL_MASK: bool, per request a
            row-major ``[T, seq_len + T]`` block, prefix columns first, blocks back to back:
            ``[sum(seq_lens) * T + B * T * T]``), ``"qlen"`` (QLEN_ONLY: bool
            ``[B * T * T]``, the tree columns only) or ``"bitpacked"``
            (QLEN_ONLY_BITPACKING: one word a row, ``[B * T]``, bit j = tree column j;
            uint8 for T <= 8, uint16 <= 16, uint32 <= 32; SGLang's kernels take no more).
        pad_token: the ``draft_token`` of padding rows (rows past a request's num_nodes:
            smaller budgets, fewer candidates): SGLang embeds every row, so a valid token id
            (default 0) instead of the trees' pad token (-1 by default); no walk reaches
            those rows and their outputs are never read.

    Returns:
        dict with ``draft_token`` int64 ``[B * T]`` (request-major; row 0 of each request is
        the root; padding rows ``pad_token``), ``positions`` int64 ``[B * T]`` (seq_len + depth), ``retrive_index``
        int64 ``[B, T]`` (the global row b * T + i), ``retrive_next_token`` and
        ``retrive_next_sibling`` int64 ``[B, T]`` (request-local first child and next
        sibling, -1 for none), ``custom_mask`` as above and ``draft_token_num`` T. A real
        row's mask row is its tree visibility (itself and its ancestors, the root
        included) and, in FULL_MASK, every prefix column; a padding row sees only itself.

    Raises:
        KdtreeError: an unknown mask mode, ``seq_lens`` of the wrong shape or negative,
            ``"bitpacked"`` with T > 32, a pad_token outside [0, 2^31).
    """
    _check_trees(trees, ("tokens", "depths", "first_child", "next_sibling", "visibility_bits"))
    pad_token = checks.int_scalar(pad_token, "pad_token (a token id SGLang can embed)", 0, 2**31 - 1)
    ops = _ops(trees.tokens)
    batch, rows = trees.batch, trees.budget + 1
    # seq_lens is read on the host (checked; the FULL_MASK blocks are sized by it): a device
    # array is copied, which synchronises its stream.
    lens_host = checks.per_request(_host(seq_lens) if hasattr(seq_lens, "shape") and not isinstance(
        seq_lens, np.ndarray) else seq_lens, "seq_lens", batch, np.int64)
    if (lens_host < 0).any():
        raise checks.range_error(f"seq_lens must be >= 0, got {lens_host.tolist()}")
    lens = ops.asarray(lens_host, "int64")
    out = {
        "draft_token": ops.where(_real(trees, ops), ops.cast(trees.tokens, "int64"),
                                 ops.full((batch, rows), pad_token, "int64")).reshape(-1),
        "positions": (lens[:, None] + ops.cast(trees.depths, "int64")).reshape(-1),
        "retrive_index": ops.arange(batch * rows).reshape(batch, rows),
        "retrive_next_token": ops.cast(trees.first_child, "int64"),
        "retrive_next_sibling": ops.cast(trees.next_sibling, "int64"),
        "draft_token_num": rows,
    }
    bits = trees.visibility_bits  # [B, T, W] uint32, bit j % 32 of word j // 32 = column j
    if mask == "bitpacked":
        if rows > 32:
            raise checks.invalid(f"SGLang's bit-packed tree mask holds at most 32 tree rows, the trees have {rows} "
                                 "(N + 1); use mask='full' or 'qlen'")
        word = "uint8" if rows <= 8 else "uint16" if rows <= 16 else "uint32"
        out["custom_mask"] = ops.cast(ops.cast(bits[:, :, 0], "int64"), word).reshape(-1)
        return out
    if mask not in ("full", "qlen"):
        raise checks.invalid(f"mask must be 'full', 'qlen' or 'bitpacked' (SGLang's TreeMaskMode), got {mask!r}")
    col = ops.arange(rows)
    picked = ops.take(ops.cast(bits, "int64"), ops.expand((col // 32)[None, None, :], (batch, rows, rows)), 2)
    tree = ((picked >> (col % 32)[None, None, :]) & 1) == 1  # [B, T, T] bool
    if mask == "qlen":
        out["custom_mask"] = tree.reshape(-1)
        return out
    from .core import memory

    memory.outputs_fit(int(lens_host.sum()) * rows + batch * rows * rows, "the FULL_MASK custom mask (bool)")
    real = _real(trees, ops)  # [B, T]
    blocks = []
    for b in range(batch):
        p = int(lens_host[b])
        prefix = real[b][:, None] & ops.full((rows, p), True, "bool")  # a real row sees the whole prefix
        blocks.append(_join(ops, prefix, tree[b], p))
    out["custom_mask"] = ops.concat(blocks) if blocks else ops.full((0,), False, "bool")
    return out


def _host(a) -> np.ndarray:
    return np.asarray(a.cpu() if hasattr(a, "cpu") else a.get() if hasattr(a, "get") else a)


def _join(ops, prefix, tree_rows, p):
    """One request's FULL_MASK block, flattened: [T, p] prefix columns, then the tree's."""
    if p == 0:
        return tree_rows.reshape(-1)
    if isinstance(ops, _Torch):
        return ops.t.cat([prefix, tree_rows], 1).reshape(-1)
    return ops.xp.concatenate([prefix, tree_rows], 1).reshape(-1)


def sglang_accept_outputs(trees: TreeBatch, acceptance: Acceptance, target_tokens=None) -> dict:
    """What SGLang's ``verify_tree_greedy`` returns, from kdtree's walk of the same trees.

    Args:
        trees: the trees (for T = N + 1).
        acceptance: kdtree's :class:`~kdtree.Acceptance` for them.
        target_tokens: ``[B, T]`` the target's token at every node (greedy: the argmax;
            ``acceptance.target_tokens`` of the from-logits calls), or None: then
            ``predicts`` holds only the bonus token at the last accepted node.

    Returns:
        dict with ``accept_index`` int32 ``[B, P]`` (P = the acceptance's path columns: the
        global rows b * T + node of the accepted path, root first, -1 after),
        ``accept_token_num`` int32 ``[B]`` (accepted draft nodes, root excluded) and
        ``predicts`` int32 ``[B * T]`` (at each accepted row the target's token there: the
        next accepted token, and the bonus token at the last; 0 elsewhere).
    """
    _check_trees(trees, ())
    ops = _ops(acceptance.accepted_nodes)
    batch, rows = trees.batch, trees.budget + 1
    nodes = ops.cast(acceptance.accepted_nodes, "int64")
    base = (ops.arange(batch) * rows)[:, None]
    index = ops.where(nodes >= 0, nodes + base, ops.full(tuple(nodes.shape), -1, "int64"))
    predicts = ops.full((batch * rows,), 0, "int64")
    length = ops.cast(acceptance.accept_length, "int64")
    last = ops.take(index, length[:, None], 1)[:, 0]
    bonus = ops.cast(acceptance.bonus_token, "int64")
    if target_tokens is not None:
        tt = ops.cast(target_tokens, "int64").reshape(-1)
        valid = index >= 0
        flat = ops.where(valid, index, ops.full(tuple(index.shape), 0, "int64")).reshape(-1)
        values = ops.where(valid.reshape(-1), ops.take(tt, flat, 0), ops.full(tuple(flat.shape), 0, "int64"))
        predicts[flat[valid.reshape(-1)]] = values[valid.reshape(-1)]
    has_bonus = bonus >= 0
    predicts[last[has_bonus]] = bonus[has_bonus]
    return {"accept_index": ops.cast(index, "int32"), "accept_token_num": ops.cast(length, "int32"),
            "predicts": ops.cast(predicts, "int32")}


# ---- FlashInfer ---------------------------------------------------------------------------------


def flashinfer_ragged_mask(trees: TreeBatch, prefix_lengths) -> dict:
    """FlashInfer's packed custom mask over the real rows only (no padding row is a query).

    Request b's queries are its ``num_nodes[b] + 1`` real tree rows (root first), its keys
    its ``p = prefix_lengths[b]`` cached tokens then those rows; its bool mask
    ``[R_b, p + R_b]`` (a row sees the whole prefix and itself and its ancestors) is
    flattened row-major and packed 8 per byte little-endian, as FlashInfer's
    ``segment_packbits(..., bitorder="little")`` does, each request's segment starting at a
    byte.

    Returns:
        dict of numpy arrays: ``qo_indptr`` int32 ``[B + 1]`` (row offsets, the
        ``cu_rows`` of :func:`kdtree.ragged_trees`), ``mask_indptr`` int32 ``[B + 1]`` (byte
        offsets of the segments) and ``custom_mask`` uint8. ``kdt_tree_attention_mask_cuda``'s
        ``KDT_MASK_FLASHINFER`` is the padded form (every request N + 1 rows).

    Raises:
        KdtreeError: prefix lengths of the wrong shape or negative, a corrupted num_nodes,
        a mask past int32 bytes or this machine's memory.
    """
    from .core import memory

    _check_trees(trees, ("visibility_bits",))
    batch = trees.batch
    prefix = checks.per_request(_host(prefix_lengths) if hasattr(prefix_lengths, "shape") and not isinstance(
        prefix_lengths, np.ndarray) else prefix_lengths, "prefix_lengths", batch, np.int64)
    if (prefix < 0).any():
        raise checks.range_error(f"prefix_lengths must be >= 0, got {prefix.tolist()}")
    n = _host(trees.num_nodes).astype(np.int64)
    if ((n < 0) | (n > trees.budget)).any():
        b = int(np.flatnonzero((n < 0) | (n > trees.budget))[0])
        raise checks.value_error(f"request {b}: num_nodes {int(n[b])} outside [0, {trees.budget}]")
    real = n + 1
    seg = (real * (prefix + real) + 7) // 8
    total = int(seg.sum())
    if total > 2**31 - 1:
        raise checks.range_error(f"the mask needs {total} bytes, past int32 offsets")
    memory.outputs_fit(total, "the FlashInfer custom mask")
    bits = _host(trees.visibility_bits)
    out = np.zeros(total, np.uint8)
    at = 0
    for b in range(batch):
        r, p = int(real[b]), int(prefix[b])
        tree = np.unpackbits(np.ascontiguousarray(bits[b, :r]).view(np.uint8), axis=1, bitorder="little")[:, :r]
        block = np.concatenate([np.ones((r, p), np.uint8), tree], axis=1).reshape(-1)
        packed = np.packbits(block, bitorder="little")
        out[at: at + packed.size] = packed
        at += int(seg[b])
    offsets = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    return {"qo_indptr": np.concatenate([[0], np.cumsum(real)]).astype(np.int32), "mask_indptr": offsets,
            "custom_mask": out}


# ---- TensorRT-LLM ------------------------------------------------------------------------------


def tensorrt_llm_spec_inputs(trees: TreeBatch, *, paths: str = "node") -> dict:
    """TensorRT-LLM's speculative-decoding inputs for kdtree's trees (D = N draft tokens).

    Returns:
        dict with
        ``spec_decoding_packed_mask`` int32 ``[B, N+1, ceil((N+1)/32)]``: row i's tree
        visibility (itself, its ancestors, the root), column c at bit c % 32 of word c // 32
        (kdtree's ``visibility_bits``, the same bits, viewed as int32);
        ``spec_decoding_position_offsets`` int32 ``[B, N+1]``: each row's depth (root 0;
        TensorRT-LLM adds the past sequence length);
        ``spec_decoding_generation_lengths`` int32 ``[B]``: num_nodes + 1, the request's
        query rows (its real rows come first);
        ``paths`` int32 ``[B, N+1, L+1]`` (L = trees.depth): with ``paths="node"`` row i is
        the path root -> i (node indices, 0 first, -1 after; padding rows all -1), as the
        PyTorch flow's ``eagle_paths``; with ``paths="leaf"`` one row per leaf in node order
        (a root-only tree: the path [0]), then rows of -1, as the C++ runtime's ``paths``.
    """
    _check_trees(trees, ("depths", "parents", "visibility_bits"))
    if paths not in ("node", "leaf"):
        raise checks.invalid(f"paths must be 'node' or 'leaf', got {paths!r}")
    ops = _ops(trees.depths)
    batch, rows, depth = trees.batch, trees.budget + 1, trees.depth
    real = _real(trees, ops)
    bits = trees.visibility_bits
    mask = bits.view(ops.t.int32) if isinstance(ops, _Torch) else bits.view("int32")
    node_paths = _node_paths(trees, ops, real, depth)
    out = {
        "spec_decoding_packed_mask": mask,
        "spec_decoding_position_offsets": ops.cast(trees.depths, "int32"),
        "spec_decoding_generation_lengths": ops.cast(ops.cast(trees.num_nodes, "int64") + 1, "int32"),
    }
    if paths == "node":
        out["paths"] = ops.cast(node_paths, "int32")
        return out
    # Leaves: real rows with no child, in node order, moved to the front (a stable order).
    parents = ops.cast(trees.parents, "int64")
    is_parent = ops.full((batch, rows + 1), 0, "int64")
    idx = ops.where(real & (parents >= 0), parents, ops.full(tuple(parents.shape), rows, "int64"))
    if isinstance(ops, _Torch):
        is_parent.scatter_(1, idx, ops.full(tuple(idx.shape), 1, "int64"))
    else:
        ops.xp.put_along_axis(is_parent, idx, 1, 1)
    leaf = real & (is_parent[:, :rows] == 0)
    rank = ops.cumsum(ops.cast(leaf, "int64").T).T - 1  # leaf's slot among the leaves
    slot = ops.where(leaf, rank, ops.full(tuple(rank.shape), rows, "int64"))  # non-leaves to a spare row
    leaf_paths = ops.full((batch, rows + 1, depth + 1), -1, "int64")
    gather = slot[:, :, None] + ops.full((batch, rows, depth + 1), 0, "int64")
    if isinstance(ops, _Torch):
        leaf_paths.scatter_(1, gather, node_paths)
    else:
        for b in range(batch):  # host arrays: a loop over requests, vectorised within one
            leaf_paths[b, slot[b]] = node_paths[b]
    out["paths"] = ops.cast(leaf_paths[:, :rows], "int32")
    return out


def _node_paths(trees, ops, real, depth):
    """[B, T, L+1] int64: row i = path root -> i (0 first, -1 after); padding rows -1."""
    batch, rows = trees.batch, trees.budget + 1
    parents = ops.cast(trees.parents, "int64")
    depths = ops.cast(trees.depths, "int64")
    out = ops.full((batch, rows, depth + 1), -1, "int64")
    cur = ops.arange(rows)[None, :] + ops.full((batch, rows), 0, "int64")
    level = depths.clone() if isinstance(ops, _Torch) else depths.copy()
    for _ in range(depth + 1):  # walk every node up one step a time, writing it at its depth
        live = real & (cur >= 0) & (level >= 0)
        col = ops.where(live, level, ops.full(tuple(level.shape), depth, "int64"))
        val = ops.where(live, cur, ops.take(out, col[:, :, None], 2)[:, :, 0])
        if isinstance(ops, _Torch):
            out.scatter_(2, col[:, :, None], val[:, :, None])
        else:
            ops.xp.put_along_axis(out, col[:, :, None], val[:, :, None], 2)
        safe = ops.where(cur >= 0, cur, ops.full(tuple(cur.shape), 0, "int64"))
        up = ops.take(parents, safe, 1)
        cur = ops.where(cur >= 0, up, cur)
        level = level - 1
    return out


# ---- vLLM / TensorRT-LLM static trees -------------------------------------------------------


def rank_paths(trees: TreeBatch, b: int = 0) -> tuple[list[tuple[int, ...]], list[int]]:
    """Request b's tree as rank paths from the root, sorted breadth first (by length, then
    lexicographically): the ``speculative_token_tree`` of vLLM and the ``eagle_choices``
    of TensorRT-LLM. Entry k is the (k+1)-th node in that order: the ranks, among their
    siblings (= the drafter's ranks at each depth), along the path from the root.

    Returns:
        (paths, nodes): ``paths[k]`` the rank path, ``nodes[k]`` the kdtree node index it
        is (the order differs from kdtree's pop order). Reads the trees on the host.
    """
    _check_trees(trees, ("parents",))
    batch = trees.batch
    b = checks.int_scalar(b, "b", 0, max(batch - 1, 0))
    if batch == 0:
        raise checks.invalid("the batch is empty")
    parents = _host(trees.parents)[b]
    n = int(_host(trees.num_nodes)[b])
    if not 0 <= n <= trees.budget:
        raise checks.value_error(f"request {b}: num_nodes {n} outside [0, {trees.budget}]")
    seen_children: dict[int, int] = {}
    path: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(1, n + 1):
        p = int(parents[i])
        rank = seen_children.get(p, 0)
        seen_children[p] = rank + 1
        path[i] = path[p] + (rank,)
    order = sorted(range(1, n + 1), key=lambda i: (len(path[i]), path[i]))
    return [path[i] for i in order], order
