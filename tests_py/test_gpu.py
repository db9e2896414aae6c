"""The Python GPU path (DLPack / __cuda_array_interface__ arrays) against the host path.

Runs where torch with CUDA (and/or CuPy) is installed and libkdtree was built with CUDA;
skipped elsewhere with the reason. Every GPU result is compared with the CPU functions
(themselves checked against the reference and hand-worked values): trees bit for bit,
top-k ids exactly and log-probs to float32 rounding, masks, verification and compaction
exactly; one whole round is captured in a CUDA graph and replayed on new inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import kdtree
from kdtree import _native as _lib

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests use torch tensors)")


@pytest.fixture(scope="module")
def cuda(cuda_device):
    return cuda_device


def host(x):
    return x.detach().cpu().numpy()


def random_logits(rng, shape, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


TREE_FIELDS = ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility",
               "visibility_bits", "first_child", "next_sibling")


def assert_same_trees(gpu, cpu):
    for name in TREE_FIELDS:
        g = host(getattr(gpu, name))
        c = getattr(cpu, name)
        if name == "logw":
            np.testing.assert_array_equal(g.view(np.int64), c.view(np.int64), err_msg=name)
        else:
            np.testing.assert_array_equal(g, c, err_msg=name)


def test_build_trees_matches_cpu_bit_for_bit(cuda):
    rng = np.random.default_rng(0)
    for budget, depth, width in ((1, 1, 1), (7, 3, 4), (64, 16, 8), (300, 12, 32)):
        lp = np.sort(rng.standard_normal((5, depth, width)).astype(np.float32) * 2, axis=-1)[..., ::-1] - 1
        lp = np.ascontiguousarray(np.minimum(lp, 0))  # log-probs are <= 0 (the builders refuse more)
        lp = np.ascontiguousarray(lp)
        ids = np.argsort(rng.random((5, depth, 5000)), axis=-1)[..., :width].astype(np.int32)
        cpu = kdtree.build_trees(lp, ids, budget, root_tokens=np.arange(5), root_positions=np.arange(5) * 3)
        gpu = kdtree.build_trees(torch.from_numpy(lp).to(cuda), torch.from_numpy(ids).to(cuda), budget,
                                 root_tokens=np.arange(5), root_positions=np.arange(5) * 3)
        assert_same_trees(gpu, cpu)
        assert host(gpu.request_status).tolist() == [0] * 5


def test_build_trees_reports_bad_requests(cuda):
    lp = torch.tensor([[[-0.1, -1.0]], [[float("nan"), -1.0]]], device=cuda)
    ids = torch.tensor([[[1, 2]], [[1, 2]]], dtype=torch.int32, device=cuda)
    with pytest.raises(kdtree.KdtreeError, match="request 1: KDT_ERR_VALUE"):
        kdtree.build_trees(lp, ids, 4)
    t = kdtree.build_trees(lp, ids, 4, errors="status")
    assert host(t.request_status).tolist() == [0, 4]
    assert host(t.num_nodes).tolist() == [2, 0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("vocab", [1, 7, 1025, 8193, 151936])
def test_topk_matches_cpu(cuda, dtype, vocab):
    rng = np.random.default_rng(vocab)
    x = torch.from_numpy(random_logits(rng, (2, 3, vocab))).to(cuda).to(getattr(torch, dtype))
    x[0, 1, : vocab // 2] = x[0, 1, 0]  # ties: lower ids first
    k = min(vocab, 64)
    lp, ids = kdtree.topk_logprobs(x, k)
    want_lp, want_ids = kdtree.topk_logprobs(host(x.float()), k)
    np.testing.assert_array_equal(host(ids), want_ids)
    np.testing.assert_allclose(host(lp), want_lp, rtol=2e-6, atol=2e-5)


def test_topk_row_status_and_strided_input(cuda):
    rng = np.random.default_rng(2)
    big = torch.from_numpy(random_logits(rng, (3, 6, 1000))).to(cuda)
    view = big[:, 1:5, :777]  # non-contiguous slice
    lp, ids = kdtree.topk_logprobs(view, 10)
    want_lp, want_ids = kdtree.topk_logprobs(host(view), 10)
    np.testing.assert_array_equal(host(ids), want_ids)
    np.testing.assert_allclose(host(lp), want_lp, rtol=2e-6, atol=2e-5)
    bad = view.clone()
    bad[1, 2, 5] = float("nan")
    bad[2, 0, :] = float("-inf")
    with pytest.raises(kdtree.KdtreeError, match=r"request 1, position 2 \(logits\[1, 2\], row 6\)"):
        kdtree.topk_logprobs(bad, 10)
    top = kdtree.topk_logprobs(bad, 10, errors="status")
    lp, ids = top
    status = top.row_status
    s = host(status)
    assert s[1, 2] == 4 and s[2, 0] == 4 and (s != 0).sum() == 2
    assert np.isnan(host(lp)[1, 2]).all() and host(ids)[1, 2].tolist() == list(range(10))


def test_trees_from_logits_match_gpu_topk_then_cpu_build(cuda):
    rng = np.random.default_rng(4)
    x = torch.from_numpy(random_logits(rng, (4, 8, 3000))).to(cuda).to(torch.bfloat16)
    t = kdtree.build_trees_from_logits(x, 16, 40, root_tokens=np.arange(4))
    lp, ids = kdtree.topk_logprobs(x, 16)
    cpu = kdtree.build_trees(host(lp), host(ids), 40, root_tokens=np.arange(4), vocab_size=3000)
    assert_same_trees(t, cpu)


@pytest.mark.parametrize("kind", ["bool", "bits", "additive", "flashinfer"])
def test_masks_match_cpu(cuda, kind):
    rng = np.random.default_rng(6)
    x = random_logits(rng, (3, 6, 500))
    cpu_trees = kdtree.build_trees_from_logits(x, 6, 30)
    gpu_trees = kdtree.build_trees_from_logits(torch.from_numpy(x).to(cuda), 6, 30)
    prefix = np.array([0, 17, 100])
    for dtype in (["float32", "float16"] if kind == "additive" else ["float32"]):
        want = kdtree.tree_attention_mask(cpu_trees, prefix, kind=kind, dtype=dtype)
        got = kdtree.tree_attention_mask(gpu_trees, torch.from_numpy(prefix).to(cuda), kind=kind, dtype=dtype)
        np.testing.assert_array_equal(host(got[0]), want[0])
        if kind == "flashinfer":
            np.testing.assert_array_equal(host(got[1]), want[1])
        np.testing.assert_array_equal(host(got[2]), want[2])


def test_verify_from_logits_matches_cpu(cuda):
    rng = np.random.default_rng(8)
    B, N, V = 6, 24, 200
    draft = random_logits(rng, (B, 5, V))
    trees = kdtree.build_trees_from_logits(draft, 4, N, root_tokens=np.arange(B))
    gtrees = kdtree.build_trees_from_logits(torch.from_numpy(draft).to(cuda), 4, N, root_tokens=np.arange(B))
    target = random_logits(rng, (B, N + 1, V))
    # plant the tree's own tokens as argmax at some nodes so walks go deep
    for b in range(B):
        for i in range(N + 1):
            child = trees.first_child[b, i]
            if child > 0 and rng.random() < 0.8:
                target[b, i, trees.tokens[b, child]] = 50.0
    gt = torch.from_numpy(target).to(cuda)
    for stops, cap in (((), None), ((int(trees.tokens[0, 1]),), [3, 0, 1, 2, 5, 9])):
        want = kdtree.verify_greedy_from_logits(trees, target, stop_tokens=stops, max_commit=cap)
        got = kdtree.verify_greedy_from_logits(gtrees, gt, stop_tokens=stops, max_commit=cap)
        np.testing.assert_array_equal(host(got.accepted_nodes), want.accepted_nodes)
        np.testing.assert_array_equal(host(got.accept_length), want.accept_length)
        np.testing.assert_array_equal(host(got.bonus_token), want.bonus_token)
    for temperature in (0.6, 1.0, 1.7):
        want = kdtree.verify_sample_from_logits(trees, target, temperature, seed=2**40 + 3, offset=2**33 + 5)
        got = kdtree.verify_sample_from_logits(gtrees, gt, temperature, seed=2**40 + 3, offset=2**33 + 5)
        np.testing.assert_array_equal(host(got.accepted_nodes), want.accepted_nodes)
        np.testing.assert_array_equal(host(got.bonus_token), want.bonus_token)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_compact_kv_matches_cpu(cuda, dtype, layout):
    rng = np.random.default_rng(9)
    B, H, S, D = 3, 2, 40, 64
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    layers = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(getattr(torch, dtype))
              for _ in range(4)]
    acc = kdtree.Acceptance(np.array([[0, 2, 3, 7], [0, 1, 2, -1], [0, 5, -1, -1]], np.int32),
                            np.array([3, 2, 1], np.int32), np.array([1, 1, 1], np.int32))
    prefix = np.array([4, 9, 0])
    cpu = [x.float().clone() for x in layers]
    kdtree.compact_kv(cpu[:2], cpu[2:], prefix, acc, layout=layout)
    gpu = [x.to(cuda) for x in layers]
    gacc = kdtree.Acceptance(torch.from_numpy(acc.accepted_nodes).to(cuda),
                             torch.from_numpy(acc.accept_length).to(cuda), torch.from_numpy(acc.bonus_token).to(cuda))
    kdtree.compact_kv(gpu[:2], gpu[2:], torch.from_numpy(prefix).to(cuda), gacc, layout=layout)
    for c, g in zip(cpu, gpu, strict=True):
        np.testing.assert_array_equal(host(g.float()), host(c))


def test_whole_round_in_a_cuda_graph(cuda):
    """top-k + build (from logits), masks, greedy verify from logits and compaction,
    captured once with errors='status' and replayed on new inputs copied into the same
    buffers: every output equals an eager run on those inputs."""
    rng = np.random.default_rng(12)
    B, L, V, N, K = 4, 6, 1000, 32, 8
    H, S, D = 2, 80, 32
    draft = torch.from_numpy(random_logits(rng, (B, L, V))).to(cuda).to(torch.bfloat16)
    target = torch.from_numpy(random_logits(rng, (B, N + 1, V))).to(cuda).to(torch.bfloat16)
    prefix = torch.tensor([3, 10, 0, 7], device=cuda)
    roots = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=cuda)
    k_cache = torch.from_numpy(rng.standard_normal((B, H, S, D)).astype(np.float32)).to(cuda).half()
    v_cache = torch.from_numpy(rng.standard_normal((B, H, S, D)).astype(np.float32)).to(cuda).half()
    trees = kdtree.build_trees_from_logits(draft, K, N, root_tokens=roots)  # allocates outputs
    state = {}

    def round_():
        kdtree.build_trees_from_logits(draft, K, N, root_tokens=roots, out=trees, errors="status")
        state["mask"] = kdtree.tree_attention_mask(trees, prefix, kind="additive", dtype="bfloat16",
                                                   columns=N + 1 + 16, errors="status")
        acc = kdtree.verify_greedy_from_logits(trees, target, errors="status")
        state["acc"] = acc
        state["compact"] = kdtree.compact_kv([k_cache], [v_cache], prefix, acc, errors="status")

    def snapshot(st):
        acc = st["acc"]
        return [host(x.float() if x.dtype == torch.bfloat16 else x) for x in (
            trees.tokens, trees.parents, trees.visibility, st["mask"][0], acc.accepted_nodes,
            acc.accept_length, acc.bonus_token, k_cache, v_cache)]

    round_()  # warm-up: allocator pools, pointer tables, kernel attributes
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            round_()
    torch.cuda.synchronize()
    captured = dict(state)  # the graph's own output tensors
    for trial in range(3):
        new_draft = torch.from_numpy(random_logits(rng, (B, L, V))).to(cuda).to(torch.bfloat16)
        new_target = torch.from_numpy(random_logits(rng, (B, N + 1, V))).to(cuda).to(torch.bfloat16)
        cache0 = (k_cache.clone(), v_cache.clone())
        draft.copy_(new_draft)
        target.copy_(new_target)
        graph.replay()
        torch.cuda.synchronize()
        replayed = snapshot(captured)
        k_cache.copy_(cache0[0])
        v_cache.copy_(cache0[1])
        round_()  # eager, same inputs
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(replayed, snapshot(state), strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}, output {i}")
        assert host(state["acc"].request_status).tolist() == [0] * B


def test_cupy_arrays_work_too(cuda):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    rng = np.random.default_rng(13)
    x = random_logits(rng, (2, 3, 2000))
    lp, ids = kdtree.topk_logprobs(cupy.asarray(x), 16)
    want_lp, want_ids = kdtree.topk_logprobs(x, 16)
    np.testing.assert_array_equal(ids.get(), want_ids)
    np.testing.assert_allclose(lp.get(), want_lp, rtol=2e-6, atol=2e-5)
    t = kdtree.build_trees_from_logits(cupy.asarray(x), 8, 20)
    lp8, ids8 = kdtree.topk_logprobs(cupy.asarray(x), 8)
    want = kdtree.build_trees(lp8.get(), ids8.get(), 20, vocab_size=2000)
    np.testing.assert_array_equal(t.tokens.get(), want.tokens)
    np.testing.assert_array_equal(t.logw.get(), want.logw)
    assert _lib.STATUS_NAMES[0] == "KDT_OK"
