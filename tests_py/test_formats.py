"""kdtree.formats: SGLang's and TensorRT-LLM's speculative inputs, rank paths.

Each engine's consumer is re-enacted here from its own definition (SGLang's
verify_tree_greedy walk over retrive_* with global and local indices; TensorRT-LLM's
packed-mask bits and paths) and must give what kdtree's own walk and visibility give; the
masks are checked against ancestor sets walked from the parents. numpy and torch (CPU)
inputs must give the same results.
"""

from __future__ import annotations

import numpy as np
import pytest

import kdtree
from kdtree import formats

pytestmark = pytest.mark.usefixtures("lib")


def random_trees(seed=0, batch=6, depth=5, width=4, budget=20, budgets=None):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(width * 2), size=(batch, depth))[..., :width]
    lp = np.ascontiguousarray(np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32))
    ids = np.argsort(rng.random((batch, depth, 50)), axis=-1)[..., :width].astype(np.int32)
    return kdtree.build_trees(lp, ids, budget, root_tokens=np.arange(batch) + 100, request_budgets=budgets)


def ancestors(parents, i):
    seen = set()
    while i >= 0:
        seen.add(i)
        i = int(parents[i])
    return seen


def sglang_greedy(candidates, target_predict, retrive_index, next_token, next_sibling, steps):
    """SGLang's verify_tree_greedy, re-enacted: from the root follow next_token, scan the
    siblings for the target's choice at the last accepted (global) row."""
    batch, t = candidates.shape
    accept_index = np.full((batch, steps + 1), -1, np.int64)
    accept_num = np.zeros(batch, np.int64)
    predicts = np.zeros(batch * t, np.int64)
    for b in range(batch):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        cur = 0
        for j in range(1, steps + 1):
            child = int(next_token[b, cur])
            while child != -1:
                if candidates[b, child] == target_predict.reshape(-1)[last]:
                    break
                child = int(next_sibling[b, child])
            if child == -1:
                break
            predicts[last] = candidates[b, child]
            last = int(retrive_index[b, child])
            accept_index[b, j] = last
            accept_num[b] += 1
            cur = child
        predicts[last] = target_predict.reshape(-1)[last]
    return accept_index, accept_num, predicts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sglang_inputs_drive_sglangs_walk_to_kdtrees_result(seed):
    trees = random_trees(seed, budgets=[20, 0, 7, 20, 3, 12])
    rng = np.random.default_rng(seed + 10)
    # Target choices that follow the tree for a while: the node's first child's token
    # most of the time, else a token no child has.
    target = np.where(trees.first_child >= 0,
                      np.take_along_axis(trees.tokens, np.maximum(trees.first_child, 0), 1), 999).astype(np.int32)
    flip = rng.random(target.shape) < 0.3
    target[flip] = 999
    seq_lens = rng.integers(0, 40, trees.batch)
    x = formats.sglang_verify_inputs(trees, seq_lens)
    t = x["draft_token_num"]
    assert t == 21
    cand = x["draft_token"].reshape(trees.batch, t)
    # real rows the trees' tokens, padding rows (budgets 0, 7, 3, 12 leave some) token 0, not -1
    real = np.arange(t)[None, :] <= trees.num_nodes[:, None]
    assert (~real).sum() > 20 and (trees.tokens[~real] == -1).all()
    np.testing.assert_array_equal(cand, np.where(real, trees.tokens, 0))
    padded = formats.sglang_verify_inputs(trees, seq_lens, mask="qlen", pad_token=151643)["draft_token"]
    np.testing.assert_array_equal(padded.reshape(trees.batch, t), np.where(real, trees.tokens, 151643))
    for bad in (-1, 2**31, 1.5):
        with pytest.raises((kdtree.KdtreeError, TypeError), match="pad_token"):
            formats.sglang_verify_inputs(trees, seq_lens, pad_token=bad)
    np.testing.assert_array_equal(x["retrive_index"], np.arange(trees.batch * t).reshape(trees.batch, t))
    np.testing.assert_array_equal(x["positions"], (seq_lens[:, None] + trees.depths).reshape(-1))
    for name in ("draft_token", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        assert x[name].dtype == np.int64, name
    steps = trees.depth
    acc_i, acc_n, predicts = sglang_greedy(cand, target, x["retrive_index"], x["retrive_next_token"],
                                           x["retrive_next_sibling"], steps)
    acc = kdtree.verify_greedy(trees, target)
    np.testing.assert_array_equal(acc_n, acc.accept_length)
    ours = formats.sglang_accept_outputs(trees, acc, target)
    np.testing.assert_array_equal(ours["accept_index"][:, : steps + 1], acc_i)
    np.testing.assert_array_equal(ours["accept_token_num"], acc_n)
    np.testing.assert_array_equal(ours["predicts"], predicts)
    assert ours["accept_index"].dtype == np.int32 and ours["predicts"].dtype == np.int32


def test_sglang_masks_are_prefix_plus_ancestors():
    trees = random_trees(3, budget=12, budgets=[12, 4, 0, 9, 12, 1])
    seq_lens = np.array([5, 0, 3, 17, 1, 2])
    t = 13
    full = formats.sglang_verify_inputs(trees, seq_lens, mask="full")["custom_mask"]
    qlen = formats.sglang_verify_inputs(trees, seq_lens, mask="qlen")["custom_mask"]
    assert full.dtype == np.bool_ and full.shape == (int(seq_lens.sum()) * t + trees.batch * t * t,)
    assert qlen.shape == (trees.batch * t * t,)
    offset = 0
    for b in range(trees.batch):
        p, n = int(seq_lens[b]), int(trees.num_nodes[b])
        block = full[offset: offset + t * (p + t)].reshape(t, p + t)
        offset += t * (p + t)
        for i in range(t):
            want = ancestors(trees.parents[b], i) if i <= n else {i}
            assert set(np.flatnonzero(block[i, p:]).tolist()) == want
            assert set(np.flatnonzero(qlen[(b * t + i) * t: (b * t + i + 1) * t]).tolist()) == want
            np.testing.assert_array_equal(block[i, :p], np.full(p, i <= n))  # real rows see the prefix
    assert offset == full.shape[0]


@pytest.mark.parametrize("budget, word", [(7, np.uint8), (15, np.uint16), (31, np.uint32)])
def test_sglang_bitpacked_mask(budget, word):
    trees = random_trees(4, budget=budget)
    m = formats.sglang_verify_inputs(trees, np.zeros(trees.batch, int), mask="bitpacked")["custom_mask"]
    assert m.dtype == word and m.shape == (trees.batch * (budget + 1),)
    for b in range(trees.batch):
        for i in range(budget + 1):
            want = ancestors(trees.parents[b], i) if i <= trees.num_nodes[b] else {i}
            got = {j for j in range(budget + 1) if (int(m[b * (budget + 1) + i]) >> j) & 1}
            assert got == want
    with pytest.raises(kdtree.KdtreeError, match="at most 32 tree rows"):
        formats.sglang_verify_inputs(random_trees(4, budget=32), np.zeros(6, int), mask="bitpacked")
    with pytest.raises(kdtree.KdtreeError, match="TreeMaskMode"):
        formats.sglang_verify_inputs(trees, np.zeros(6, int), mask="dense")
    with pytest.raises(kdtree.KdtreeError, match=r"seq_lens must have shape \(6,\)"):
        formats.sglang_verify_inputs(trees, [1, 2])
    with pytest.raises(kdtree.KdtreeError, match="seq_lens must be >= 0"):
        formats.sglang_verify_inputs(trees, [1, 2, 3, -4, 5, 6])


def test_tensorrt_llm_inputs():
    trees = random_trees(5, budget=40, width=5, budgets=[40, 0, 33, 5, 40, 17])
    x = formats.tensorrt_llm_spec_inputs(trees)
    mask = x["spec_decoding_packed_mask"]
    assert mask.dtype == np.int32 and mask.shape == (trees.batch, 41, 2)
    words = mask.view(np.uint32).astype(np.uint64)
    for b in range(trees.batch):
        n = int(trees.num_nodes[b])
        for i in range(41):
            got = {c for c in range(41) if (int(words[b, i, c // 32]) >> (c % 32)) & 1}
            assert got == (ancestors(trees.parents[b], i) if i <= n else {i})
    np.testing.assert_array_equal(x["spec_decoding_position_offsets"], trees.depths)
    assert x["spec_decoding_position_offsets"].dtype == np.int32
    np.testing.assert_array_equal(x["spec_decoding_generation_lengths"], trees.num_nodes + 1)
    paths = x["paths"]
    assert paths.dtype == np.int32 and paths.shape == (trees.batch, 41, trees.depth + 1)
    for b in range(trees.batch):
        n = int(trees.num_nodes[b])
        for i in range(41):
            row = paths[b, i]
            if i > n:
                assert (row == -1).all()
                continue
            path = row[row >= 0].tolist()
            assert (row[len(path):] == -1).all() and path[0] == 0 and path[-1] == i
            assert all(trees.parents[b, path[k + 1]] == path[k] for k in range(len(path) - 1))
    leaves = formats.tensorrt_llm_spec_inputs(trees, paths="leaf")["paths"]
    for b in range(trees.batch):
        n = int(trees.num_nodes[b])
        has_child = set(trees.parents[b, 1: n + 1].tolist())
        want = [i for i in range(n + 1) if i not in has_child]
        got = []
        for row in leaves[b]:
            path = row[row >= 0].tolist()
            if path:
                got.append(path[-1])
                np.testing.assert_array_equal(row, paths[b, path[-1]])
        assert got == want
        assert (leaves[b, len(want):] == -1).all()


def test_rank_paths_hand_worked():
    lp = np.log(np.array([[[0.5, 0.3, 0.2], [0.7, 0.3, 1e-9]]], np.float32))
    ids = np.array([[[10, 11, 12], [20, 21, 22]]], np.int32)
    trees = kdtree.build_trees(lp, ids, 4)
    # Pop order: 10 (0.5), 10->20 (0.35), 11 (0.3), 11->20 (0.21, before 12 at 0.2).
    assert trees.tokens[0].tolist() == [-1, 10, 20, 11, 20]
    paths, nodes = formats.rank_paths(trees, 0)
    assert paths == [(0,), (1,), (0, 0), (1, 0)]
    assert nodes == [1, 3, 2, 4]


def test_torch_inputs_give_the_numpy_results():
    torch = pytest.importorskip("torch")
    trees = random_trees(6, budget=15, budgets=[15, 2, 0, 15, 9, 4])
    as_torch = kdtree.TreeBatch(**{f: torch.from_numpy(np.ascontiguousarray(getattr(trees, f)))
                                   for f in kdtree.core.types.TREE_FIELDS}, budget=trees.budget, depth=trees.depth)
    seq_lens = np.array([3, 0, 9, 1, 4, 2])
    for mask in ("full", "qlen", "bitpacked"):
        a = formats.sglang_verify_inputs(trees, seq_lens, mask=mask)
        b = formats.sglang_verify_inputs(as_torch, torch.from_numpy(seq_lens), mask=mask)
        for k in a:
            if k == "draft_token_num":
                assert a[k] == b[k]
            else:
                np.testing.assert_array_equal(b[k].numpy(), a[k], err_msg=f"{mask} {k}")
    for paths in ("node", "leaf"):
        a = formats.tensorrt_llm_spec_inputs(trees, paths=paths)
        b = formats.tensorrt_llm_spec_inputs(as_torch, paths=paths)
        for k in a:
            np.testing.assert_array_equal(b[k].numpy(), a[k], err_msg=f"{paths} {k}")
    target = np.where(trees.first_child >= 0, np.take_along_axis(trees.tokens, np.maximum(trees.first_child, 0), 1),
                      7).astype(np.int32)
    acc = kdtree.verify_greedy(trees, target)
    acc_t = kdtree.Acceptance(*(torch.from_numpy(getattr(acc, f)) for f in ("accepted_nodes", "accept_length",
                                                                            "bonus_token")))
    a = formats.sglang_accept_outputs(trees, acc, target)
    b = formats.sglang_accept_outputs(trees, acc_t, torch.from_numpy(target))
    for k in a:
        np.testing.assert_array_equal(b[k].numpy(), a[k], err_msg=k)
    assert formats.rank_paths(as_torch, 3) == formats.rank_paths(trees, 3)


def test_seq_lens_and_num_nodes_are_checked():
    torch = pytest.importorskip("torch")
    trees = random_trees(7, budget=8)
    for bad, match in ((torch.tensor([4, -3, 0, 0, 0, 0]), "seq_lens must be >= 0"),
                       (torch.tensor([1.5] * 6), "integer"),
                       (torch.ones(6, 2, dtype=torch.int64), r"seq_lens must have shape \(6,\)")):
        with pytest.raises((kdtree.KdtreeError, TypeError), match=match):
            formats.sglang_verify_inputs(trees, bad, mask="qlen")
    ok = formats.sglang_verify_inputs(trees, torch.arange(6), mask="full")  # numpy trees, torch seq_lens
    np.testing.assert_array_equal(ok["positions"], (np.arange(6)[:, None] + trees.depths).reshape(-1))
    trees.num_nodes[2] = 50
    for call in (lambda: formats.tensorrt_llm_spec_inputs(trees), lambda: formats.rank_paths(trees, 2),
                 lambda: formats.sglang_verify_inputs(trees, np.zeros(6, int))):
        with pytest.raises(kdtree.KdtreeError, match=r"request 2: num_nodes 50 outside \[0, 8\]"):
            call()


def test_flashinfer_ragged_mask():
    trees = random_trees(8, budget=10, budgets=[10, 0, 4, 10, 7, 1])
    prefix = np.array([3, 0, 9, 1, 0, 5])
    m = formats.flashinfer_ragged_mask(trees, prefix)
    real = trees.num_nodes + 1
    np.testing.assert_array_equal(m["qo_indptr"], np.concatenate([[0], np.cumsum(real)]))
    for b in range(trees.batch):
        r, p = int(real[b]), int(prefix[b])
        lo, hi = int(m["mask_indptr"][b]), int(m["mask_indptr"][b + 1])
        assert hi - lo == (r * (p + r) + 7) // 8
        flat = np.unpackbits(m["custom_mask"][lo:hi], bitorder="little")[: r * (p + r)].reshape(r, p + r)
        assert flat[:, :p].all()
        for i in range(r):
            assert set(np.flatnonzero(flat[i, p:]).tolist()) == ancestors(trees.parents[b], i)
    assert m["custom_mask"].size == int(m["mask_indptr"][-1])
    with pytest.raises(kdtree.KdtreeError, match="prefix_lengths must be >= 0"):
        formats.flashinfer_ragged_mask(trees, [0, 0, -1, 0, 0, 0])
