"""kdtree.tree_attention (kdt_tree_attention_cuda) against a float64 reference.

The reference takes the same 16-bit inputs widened to float64 and, for each real tree row,
the keys it sees: every prefix token and the tree rows of its ancestors and itself (read
from the builder's visibility). The kernel rounds the softmax weights to the input dtype
before the product with V and its output to the dtype, so its error bound is stated per
dtype: |out - ref| <= 2 eps max|v| with eps = 2^-8 (bfloat16) or 2^-11 (float16), and the
log-sum-exp (float32 throughout) within 1e-3 absolute. Paged caches must give the same
bits as the contiguous cache they hold.

The host-side checks (workspace sizes, refused arguments) run everywhere; the kernel tests
need torch with CUDA and a CUDA build and are skipped elsewhere with the reason.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kdtree
from kdtree import _native as _lib

EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def _workspace_bytes(lib, batch, budget, q_heads, kv_heads, head_dim, max_prefix):
    n = ctypes.c_size_t(12345)
    st = lib.kdt_tree_attention_cuda_workspace_bytes(batch, budget, q_heads, kv_heads, head_dim, max_prefix,
                                                     ctypes.byref(n))
    return st, n.value


def _cuda_build(lib) -> bool:
    n = ctypes.c_size_t()
    try:
        lib.kdt_tree_attention_cuda_workspace_bytes(1, 1, 1, 1, 64, 0, ctypes.byref(n))
    except kdtree.KdtreeError as e:
        if e.status_name == "KDT_ERR_UNSUPPORTED":
            return False
        raise
    return True


def test_workspace_plan_and_refused_sizes(lib):
    raw = _lib.load()
    if not _cuda_build(raw):
        pytest.skip("libkdtree was built without CUDA (the workspace query is part of the CUDA build)")
    # Enough CTAs without splitting the keys (64 requests x 8 KV heads): no workspace.
    assert _workspace_bytes(raw, 64, 64, 32, 8, 128, 8192) == (0, 0)
    # No requests: nothing to split, whatever the context.
    assert _workspace_bytes(raw, 0, 0, 1, 1, 64, 1000) == (0, 0)
    assert _workspace_bytes(raw, 0, 64, 32, 8, 128, 1 << 20) == (0, 0)
    # Short contexts are never split.
    assert _workspace_bytes(raw, 1, 8, 32, 8, 128, 256) == (0, 0)
    # One request with a long prefix is split: partial outputs (float32, D + 1 values a
    # query head and row) for every split, plus alignment slack.
    st, n = _workspace_bytes(raw, 1, 64, 32, 8, 128, 32768)
    assert st == 0 and n > 2 * 65 * 32 * 129 * 4
    for args, what in (((1, 8, 32, 8, 96, 0), "head_dim 96"), ((1, 8, 30, 8, 128, 0), "multiple of kv_heads"),
                       ((-1, 8, 32, 8, 128, 0), "batch -1"), ((1, -1, 32, 8, 128, 0), "budget -1"),
                       ((1, 8, 32, 8, 128, -5), "max_prefix -5"),
                       ((1, 8, 32, 8, 128, 2**31 - 2**19 + 1), "max_prefix 2146959361")):
        with pytest.raises(kdtree.KdtreeError, match=what):
            _workspace_bytes(raw, *args)


def test_host_arrays_are_refused(lib):
    t = kdtree.build_trees(np.full((1, 2, 2), -0.5, np.float32), np.array([[[1, 2], [3, 4]]], np.int32), 3)
    q = np.zeros((1, 4, 2, 64), np.float16)
    k = np.zeros((1, 1, 16, 64), np.float16)
    with pytest.raises(kdtree.KdtreeError, match="runs on the GPU"):
        kdtree.tree_attention(q, k, k, t, [4])


# ---- the kernel (GPU) ---------------------------------------------------------------------

torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests use torch tensors)")


@pytest.fixture(scope="module")
def cuda(cuda_device):
    return cuda_device


@pytest.fixture(params=["auto", "wgmma-barrier", "mma.sync"])
def kernel(request, cuda):
    """The GQA kernel a test runs: the automatic choice (on sm_90 with the library's sm_90a
    code the warp-specialized wgmma kernel), the wgmma kernel whose warpgroups meet at a
    CTA-wide barrier every tile, and the mma.sync kernel of other GPUs, the last two forced
    through native/kdt_testing.h (on other GPUs all three are the mma.sync kernel)."""
    raw = _lib.load()
    raw.kdt_testing_set_attention_mma_sync(1 if request.param == "mma.sync" else 0)
    raw.kdt_testing_set_attention_sm90(1 if request.param == "wgmma-barrier" else 0)
    yield request.param
    raw.kdt_testing_set_attention_mma_sync(0)
    raw.kdt_testing_set_attention_sm90(0)


def host(x):
    return x.detach().cpu().numpy()


def random_trees(rng, batch, budget, cuda, depth=8, width=8):
    lp = np.sort(rng.standard_normal((batch, depth, width)).astype(np.float32), axis=-1)[..., ::-1] - 1.0
    lp = np.ascontiguousarray(np.minimum(lp, 0))
    ids = np.argsort(rng.random((batch, depth, 1000)), axis=-1)[..., :width].astype(np.int32)
    return kdtree.build_trees(torch.from_numpy(lp).to(cuda), torch.from_numpy(ids).to(cuda), budget)


def reference(q, k, v, num_nodes, prefix, vis, scale):
    """float64 [B, R, Hq, D] outputs and [B, R, Hq] lse; k, v as [B, Hkv, S, D]; padding
    rows zeros / -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, rows, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = np.zeros((batch, rows, hq, v.shape[-1]))
    lse = np.full((batch, rows, hq), -np.inf)
    for b in range(batch):
        p, n = int(prefix[b]), int(num_nodes[b])
        for i in range(n + 1):
            idx = np.concatenate([np.arange(p), p + np.flatnonzero(vis[b, i, : n + 1])])
            kk, vv = k[b][:, idx], v[b][:, idx]  # [Hkv, K, D]
            qq = q[b, i].reshape(hkv, group, dim)
            s = scale * np.einsum("hkd,hgd->hgk", kk, qq)
            m = s.max(-1, keepdims=True)
            w = np.exp(s - m)
            tot = w.sum(-1, keepdims=True)
            out[b, i] = np.einsum("hgk,hkd->hgd", w / tot, vv).reshape(hq, v.shape[-1])
            lse[b, i] = (m + np.log(tot)).reshape(hq)
    return out, lse


def run_case(cuda, rng, *, dtype, batch, budget, q_heads, kv_heads, dim, prefixes, layout="bhsd", spare=5):
    tdt = getattr(torch, dtype)
    trees = random_trees(rng, batch, budget, cuda)
    rows = budget + 1
    seq = max(prefixes) + rows + spare
    q = torch.randn(batch, rows, q_heads, dim, device=cuda).to(tdt)
    k = torch.randn(batch, kv_heads, seq, dim, device=cuda).to(tdt)
    v = torch.randn(batch, kv_heads, seq, dim, device=cuda).to(tdt)
    prefix = torch.tensor(prefixes, dtype=torch.int64, device=cuda)
    kc, vc = (k, v) if layout == "bhsd" else (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
    out, lse, status = kdtree.tree_attention(q, kc, vc, trees, prefix, layout=layout, max_prefix=max(prefixes),
                                             return_lse=True)
    torch.cuda.synchronize()
    vis = host(trees.visibility).astype(bool)
    ref, ref_lse = reference(host(q.float()), host(k.float()), host(v.float()), host(trees.num_nodes), prefixes, vis,
                             1.0 / dim ** 0.5)
    got = host(out.float())
    bound = 2 * EPS[dtype] * float(host(v.float().abs().max()))
    err = np.abs(got - ref).max()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"
    g_lse = host(lse)
    assert np.array_equal(np.isinf(g_lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(g_lse[fin] - ref_lse[fin]).max() <= 1e-3
    assert host(status).tolist() == [0] * batch
    return trees, q, k, v, prefix, out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_matches_float64_reference(kernel, cuda, dtype, dim, q_heads, kv_heads):
    rng = np.random.default_rng(dim + 7 * q_heads)
    run_case(cuda, rng, dtype=dtype, batch=3, budget=16, q_heads=q_heads, kv_heads=kv_heads, dim=dim,
             prefixes=[0, 37, 300])


@pytest.mark.parametrize("budget", [0, 8, 64, 256])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_rows_and_layouts(kernel, cuda, budget, layout):
    rng = np.random.default_rng(budget)
    run_case(cuda, rng, dtype="bfloat16", batch=2, budget=budget, q_heads=8, kv_heads=2, dim=128,
             prefixes=[5, 130], layout=layout)


@pytest.mark.parametrize("dim", [64, 128])
def test_warp_tilings_agree_bit_for_bit(cuda, dim):
    # The mma.sync kernel with one or two m16 tiles of query vectors a warp (forced through
    # native/kdt_testing.h) on the same inputs: every row sees the same products in the same
    # order, so the outputs are the same bits (its automatic layout, checked against float64
    # first, takes two here: 65 rows x 4 query heads a KV head).
    raw = _lib.load()
    raw.kdt_testing_set_attention_mma_sync(1)
    try:
        trees, q, k, v, prefix, auto = run_case(cuda, np.random.default_rng(5), dtype="bfloat16", batch=3,
                                                budget=64, q_heads=8, kv_heads=2, dim=dim, prefixes=[0, 300, 700])
    finally:
        raw.kdt_testing_set_attention_mma_sync(0)
    outs = []
    for tiles in (1, 2):
        assert raw.kdt_testing_set_attention_warp_tiles(tiles) == 0
        try:
            outs.append(host(kdtree.tree_attention(q, k, v, trees, prefix, max_prefix=700)[0].float()))
        finally:
            raw.kdt_testing_set_attention_warp_tiles(0)
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[1], host(auto.float()))
    assert raw.kdt_testing_set_attention_warp_tiles(3) != 0


@pytest.mark.parametrize("dim", [64, 128])
def test_wgmma_kernels_agree_bit_for_bit(cuda, dim):
    # The warp-specialized wgmma kernel and the one with a CTA-wide barrier every tile issue
    # the same products in the same order for every row: the same bits, with one and with
    # two live consumer warpgroups (4 and 65 rows x 4 query heads a KV head), a tile past
    # the real rows (65 x 4 = 260 vectors: three tiles of 128) and a split prefix. (The
    # paged cache's test runs both kernels too.)
    raw = _lib.load()
    rng = np.random.default_rng(11 + dim)
    for budget, prefixes in ((3, [0, 77]), (64, [0, 300, 4100])):
        trees, q, k, v, prefix, auto = run_case(cuda, rng, dtype="bfloat16", batch=len(prefixes), budget=budget,
                                                q_heads=8, kv_heads=2, dim=dim, prefixes=prefixes)
        outs = []
        for variant in (0, 1):
            assert raw.kdt_testing_set_attention_sm90(variant) == 0
            try:
                out, lse, _ = kdtree.tree_attention(q, k, v, trees, prefix, max_prefix=max(prefixes),
                                                    return_lse=True)
                outs.append((host(out.float()), host(lse)))
            finally:
                raw.kdt_testing_set_attention_sm90(0)
        assert np.array_equal(outs[0][0], outs[1][0])
        assert np.array_equal(outs[0][1], outs[1][1])
        assert np.array_equal(outs[0][0], host(auto.float()))
    assert raw.kdt_testing_set_attention_sm90(2) != 0


def test_long_ragged_prefixes_split_and_merge(kernel, cuda):
    # One request's worth of CTAs: the keys are split (workspace > 0), ragged prefixes leave
    # some splits empty for the shorter requests, and prefix 0 has only tree keys.
    rng = np.random.default_rng(11)
    run_case(cuda, rng, dtype="bfloat16", batch=3, budget=16, q_heads=8, kv_heads=1, dim=128,
             prefixes=[0, 1000, 32768])


def test_paged_cache_gives_the_contiguous_bits(kernel, cuda):
    rng = np.random.default_rng(5)
    trees, q, k, v, prefix, want = run_case(cuda, rng, dtype="bfloat16", batch=3, budget=32, q_heads=8, kv_heads=2,
                                            dim=128, prefixes=[3, 700, 2000], spare=100)
    batch, hkv, seq, dim = k.shape
    for page_size, layout in ((1, "pshd"), (16, "pshd"), (256, "phsd"), (7, "phsd")):
        pages = -(-seq // page_size)
        pool = batch * pages + 3
        perm = torch.from_numpy(rng.permutation(pool)[: batch * pages].astype(np.int32)).to(cuda)
        table = perm.reshape(batch, pages)
        pad = pages * page_size - seq
        kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(batch, hkv, pages, page_size, dim)
        vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).reshape(batch, hkv, pages, page_size, dim)
        kpool = torch.zeros(pool, page_size, hkv, dim, dtype=k.dtype, device=cuda)
        vpool = torch.zeros_like(kpool)
        kpool[table.reshape(-1).long()] = kp.permute(0, 2, 3, 1, 4).reshape(-1, page_size, hkv, dim)
        vpool[table.reshape(-1).long()] = vp.permute(0, 2, 3, 1, 4).reshape(-1, page_size, hkv, dim)
        if layout == "phsd":
            kpool, vpool = kpool.transpose(1, 2).contiguous(), vpool.transpose(1, 2).contiguous()
        got, _, _ = kdtree.tree_attention(q, kpool, vpool, trees, prefix, layout=layout, block_table=table,
                                          max_prefix=2000)
        assert torch.equal(got, want), (page_size, layout)


def test_failed_requests_and_padding_rows_are_zeros(kernel, cuda):
    rng = np.random.default_rng(3)
    trees = random_trees(rng, 3, 16, cuda)
    q = torch.randn(3, 17, 4, 64, device=cuda, dtype=torch.bfloat16)
    k = torch.randn(3, 4, 200, 64, device=cuda, dtype=torch.bfloat16)
    prefix = torch.tensor([10, 150, 5], device=cuda)  # 150 > max_prefix
    out = torch.full_like(q, 7.0)
    with pytest.raises(kdtree.KdtreeError, match="request 1: KDT_ERR_OUT_OF_RANGE"):
        kdtree.tree_attention(q, k, k, trees, prefix, max_prefix=100)
    got, lse, status = kdtree.tree_attention(q, k, k, trees, prefix, max_prefix=100, errors="status", out=out,
                                             return_lse=True)
    assert host(status).tolist() == [0, _lib.STATUS["KDT_ERR_OUT_OF_RANGE"], 0]
    assert torch.all(got[1] == 0) and torch.all(torch.isneginf(lse[1]))
    n = host(trees.num_nodes)
    for b in (0, 2):
        assert torch.all(got[b, n[b] + 1:] == 0) and torch.all(torch.isneginf(lse[b, n[b] + 1:]))
        assert torch.all(torch.isfinite(lse[b, : n[b] + 1]))


def test_refused_arguments(cuda):
    rng = np.random.default_rng(4)
    trees = random_trees(rng, 2, 8, cuda)
    q = torch.randn(2, 9, 4, 64, device=cuda, dtype=torch.bfloat16)
    k = torch.randn(2, 4, 64, 64, device=cuda, dtype=torch.bfloat16)
    pre = torch.tensor([3, 4], device=cuda)
    with pytest.raises(kdtree.KdtreeError, match="share a dtype"):
        kdtree.tree_attention(q, k.half(), k.half(), trees, pre)
    with pytest.raises(kdtree.KdtreeError, match="multiple of the cache's KV heads"):
        kdtree.tree_attention(q, k[:, :3], k[:, :3], trees, pre)
    with pytest.raises(kdtree.KdtreeError, match="pass block_table"):
        kdtree.tree_attention(q, k, k, trees, pre, layout="pshd")
    with pytest.raises(kdtree.KdtreeError, match=r"\[B, N \+ 1"):
        kdtree.tree_attention(q[:, :5], k, k, trees, pre)
    with pytest.raises(kdtree.KdtreeError, match="head_dim 48"):
        kdtree.tree_attention(q[..., :48].contiguous(), k[..., :48].contiguous(), k[..., :48].contiguous(), trees,
                              pre)


# ---- MLA: one latent KV head of 576 values (512 latent + 64 rotary), output 512 ----------

MLA_SCALE = 1.0 / 192 ** 0.5  # DeepSeek-V3's 1 / sqrt(qk_nope + qk_rope head dims)


def run_mla(cuda, rng, *, dtype, batch, budget, heads, prefixes, spare=5):
    tdt = getattr(torch, dtype)
    trees = random_trees(rng, batch, budget, cuda)
    rows = budget + 1
    seq = max(prefixes) + rows + spare
    q = (torch.randn(batch, rows, heads, 576, device=cuda) * 0.5).to(tdt)
    c = torch.randn(batch, seq, 576, device=cuda).to(tdt)
    prefix = torch.tensor(prefixes, dtype=torch.int64, device=cuda)
    out, lse, status = kdtree.tree_attention_mla(q, c, trees, prefix, softmax_scale=MLA_SCALE,
                                                 max_prefix=max(prefixes), return_lse=True)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (batch, rows, heads, 512)
    vis = host(trees.visibility).astype(bool)
    cf = host(c.float())[:, None]  # [B, 1, S, 576]: one KV head
    ref, ref_lse = reference(host(q.float()), cf, cf[..., :512], host(trees.num_nodes), prefixes, vis, MLA_SCALE)
    bound = 2 * EPS[dtype] * float(np.abs(cf[..., :512]).max())
    err = np.abs(host(out.float()) - ref).max()
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"
    g_lse = host(lse)
    assert np.array_equal(np.isinf(g_lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(g_lse[fin] - ref_lse[fin]).max() <= 1e-3
    assert host(status).tolist() == [0] * batch
    return trees, q, c, prefix, out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("heads,budget", [(16, 16), (128, 4), (20, 40)])
def test_mla_matches_float64_reference(cuda, dtype, heads, budget):
    run_mla(cuda, np.random.default_rng(heads + budget), dtype=dtype, batch=3, budget=budget, heads=heads,
            prefixes=[0, 37, 300])


def test_mla_long_prefix_split_and_merge(cuda):
    # Few CTAs (17 rows x 16 heads = 272 query vectors, 5 tiles of 64): the keys are split.
    raw = _lib.load()
    n = ctypes.c_size_t()
    assert raw.kdt_tree_attention_mla_cuda_workspace_bytes(2, 16, 16, 9000, ctypes.byref(n)) == 0 and n.value > 0
    run_mla(cuda, np.random.default_rng(3), dtype="bfloat16", batch=2, budget=16, heads=16, prefixes=[9000, 20])


def test_mla_paged_gives_the_contiguous_bits(cuda):
    rng = np.random.default_rng(4)
    trees, q, c, prefix, want = run_mla(cuda, rng, dtype="bfloat16", batch=2, budget=8, heads=32,
                                        prefixes=[500, 61], spare=40)
    batch, seq, _ = c.shape
    for page_size in (1, 64):
        pages = -(-seq // page_size)
        pool = batch * pages + 2
        table = torch.from_numpy(rng.permutation(pool)[: batch * pages].astype(np.int32).reshape(batch, pages))
        table = table.to(cuda)
        cp = torch.nn.functional.pad(c, (0, 0, 0, pages * page_size - seq)).reshape(batch * pages, page_size, 576)
        cpool = torch.zeros(pool, page_size, 576, dtype=c.dtype, device=cuda)
        cpool[table.reshape(-1).long()] = cp
        got, _, _ = kdtree.tree_attention_mla(q, cpool, trees, prefix, softmax_scale=MLA_SCALE, block_table=table,
                                              max_prefix=500)
        assert torch.equal(got, want), page_size


def test_mla_refused_arguments(cuda):
    rng = np.random.default_rng(6)
    trees = random_trees(rng, 1, 4, cuda)
    q = torch.zeros(1, 5, 16, 576, device=cuda, dtype=torch.bfloat16)
    c = torch.zeros(1, 50, 576, device=cuda, dtype=torch.bfloat16)
    pre = torch.zeros(1, dtype=torch.int64, device=cuda)
    with pytest.raises(kdtree.KdtreeError, match="softmax_scale is required"):
        kdtree.tree_attention_mla(q, c, trees, pre, softmax_scale=None)
    with pytest.raises(kdtree.KdtreeError, match="576 values"):
        kdtree.tree_attention_mla(q[..., :512], c[..., :512], trees, pre, softmax_scale=0.1)
    with pytest.raises(kdtree.KdtreeError, match="latent_cache must be"):
        kdtree.tree_attention_mla(q, c[:, :, None], trees, pre, softmax_scale=0.1)

