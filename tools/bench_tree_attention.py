#!/usr/bin/env python3
"""The verify forward's attention on a GPU, side by side in one run.

For each shape (B requests, prefix P cached tokens each, R = N + 1 tree rows, 32 query and
8 KV heads of 128 unless stated, bfloat16): kdtree.tree_attention; SDPA with the dense
boolean tree mask (GQA through enable_gqa); kdtree's mma.sync kernel, the path of GPUs
without wgmma (forced through a test-only switch; on an H200 the automatic choice is the
wgmma kernel); transformers' sdpa path (K/V repeated to the
query heads, an additive mask); SDPA on the prefix alone with no mask (what a kernel
without the tree does, flash backend where it applies); with --flex, FlexAttention
(torch.compile'd, a block mask from the visibility); and the floor: the larger of the
K/V bytes at 3.85 TB/s and the attention FLOPs (4 x query heads x rows x keys x head_dim)
at 790 TFLOP/s (a 1 GiB device copy and an 8192^3 bf16 matmul measured on an H200; this
run's own rates are printed beside them). Medians of CUDA-event timings over
CUDA-graph replays; each replay runs every method over several distinct caches ("layers",
at least ~150 MB of K/V in all) so that the 50 MB L2 cannot serve a call from the previous
one, and the time per call is the replay's over the layers.

    KDTREE_LIBRARY=build-gpu/libkdtree.so PYTHONPATH=python python tools/bench_tree_attention.py [--out r.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

FLOOR_BPS, FLOOR_FLOPS = 3.85e12, 790e12
SHAPES = [  # (B, prefix, rows)
    (1, 4096, 9), (1, 4096, 65), (1, 32768, 65), (8, 4096, 65), (64, 2048, 9), (64, 2048, 65), (64, 8192, 17),
    (16, 16384, 257),
]


def timed(torch, fn, reps=20):
    """Median ms of fn replayed from a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def rates(torch):
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB (a uint8 copy runs slower)
    y = torch.empty_like(x)
    ms = timed(torch, lambda: y.copy_(x))
    bw = 2 * 4 * x.numel() / (ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    ms = timed(torch, lambda: torch.matmul(a, a, out=c))
    return bw, 2 * 8192 ** 3 / (ms * 1e-3)


def bench_trees(torch, rng, batch, budget):
    """GPU draft trees of `budget` nodes from random drafter log-probs (depth up to 16,
    width up to 8)."""
    import kdtree

    width = min(budget, 8) or 1
    depth = max(1, min(16, budget))
    lp = np.sort(rng.standard_normal((batch, depth, width)).astype(np.float32), axis=-1)[..., ::-1] - 1
    lp = np.ascontiguousarray(np.minimum(lp, -0.01))
    ids = np.argsort(rng.random((batch, depth, 1000)), axis=-1)[..., :width].astype(np.int32)
    return kdtree.build_trees(torch.from_numpy(lp).cuda(), torch.from_numpy(ids).cuda(), budget)


def flex_baseline(torch, q, ks, vs, vis, prefix):
    """FlexAttention (torch.compile'd) with a block mask from the tree's visibility: a
    function running it over every layer, or the exception that stopped it compiling."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, rows = vis.shape[0], vis.shape[1]
    keys = ks[0].shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        j = (kv_idx - prefix).clamp(0, rows - 1)
        return (kv_idx < prefix) | vis[b, q_idx, j]

    block_mask = create_block_mask(mask_mod, B=batch, H=None, Q_LEN=rows, KV_LEN=keys, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    qt = q.transpose(1, 2)

    def flex():
        for kl, vl in zip(ks, vs, strict=True):
            compiled(qt, kl, vl, block_mask=block_mask, enable_gqa=True)

    return flex


def measure(torch, rng, batch, prefix, rows, hq, hkv, dim, bw, flops, baselines, flex=False):
    """One shape: kdtree's time, the baselines' and the floor (us)."""
    import torch.nn.functional as F

    import kdtree
    from kdtree import _native as _lib

    budget = rows - 1
    trees = bench_trees(torch, rng, batch, budget)
    keys = prefix + rows
    nbytes = 2 * batch * hkv * keys * dim * 2
    layers = max(1, min(32, -(-150_000_000 // nbytes)))
    q = torch.randn(batch, rows, hq, dim, device="cuda", dtype=torch.bfloat16)
    ks = [torch.randn(batch, hkv, keys, dim, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    vs = [torch.randn_like(ks[0]) for _ in range(layers)]
    k, v = ks[0], vs[0]
    pre = torch.full((batch,), prefix, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)
    fl = 4 * batch * hq * rows * keys * dim
    floor = max(nbytes / bw, fl / flops) * 1e6
    kdtree.tree_attention(q, k, v, trees, pre, max_prefix=prefix, out=out)  # checked once, eagerly
    n = ctypes.c_size_t()
    _lib.load().kdt_tree_attention_cuda_workspace_bytes(batch, budget, hq, hkv, dim, prefix, ctypes.byref(n))
    ws = torch.empty(max(n.value, 1), dtype=torch.uint8, device="cuda")
    status = None

    def ours():
        nonlocal status
        for kl, vl in zip(ks, vs, strict=True):
            status = kdtree.tree_attention(q, kl, vl, trees, pre, max_prefix=prefix, out=out, workspace=ws,
                                           errors="status")[2]

    t_ours = timed(torch, ours) * 1e3 / layers
    row = {"B": batch, "prefix": prefix, "rows": rows, "layers": layers, "floor_us": floor, "kdtree_us": t_ours,
           "kdtree_tflops": fl / t_ours / 1e6, "kdtree_TBps": nbytes / t_ours / 1e6}
    # The mma.sync kernel (the path of GPUs without wgmma), forced through the test-only
    # switch of native/kdt_testing.h, beside the automatic choice.
    raw = _lib.load()
    if hasattr(raw, "kdt_testing_set_attention_mma_sync"):
        raw.kdt_testing_set_attention_mma_sync(1)
        try:
            row["mma_sync_us"] = timed(torch, ours) * 1e3 / layers
        finally:
            raw.kdt_testing_set_attention_mma_sync(0)
    # The wgmma kernel whose warpgroups meet at a CTA-wide barrier every tile (sm_90 only;
    # the automatic choice there is the warp-specialized one).
    if hasattr(raw, "kdt_testing_set_attention_sm90") and torch.cuda.get_device_capability() == (9, 0):
        raw.kdt_testing_set_attention_sm90(1)
        try:
            row["wgmma_barrier_us"] = timed(torch, ours) * 1e3 / layers
        finally:
            raw.kdt_testing_set_attention_sm90(0)
    if baselines:
        vis = trees.visibility.bool()  # [B, R, R]
        mask = torch.ones(batch, rows, keys, dtype=torch.bool, device="cuda")
        mask[:, :, prefix:] = vis
        qt = q.transpose(1, 2)
        m4 = mask[:, None]

        def sdpa():
            for kl, vl in zip(ks, vs, strict=True):
                F.scaled_dot_product_attention(qt, kl, vl, attn_mask=m4, enable_gqa=True)

        add = torch.zeros(batch, 1, rows, keys, dtype=torch.bfloat16, device="cuda")
        add.masked_fill_(~m4, torch.finfo(torch.bfloat16).min)

        def hf_path():
            for kl, vl in zip(ks, vs, strict=True):
                kk = kl[:, :, None].expand(batch, hkv, hq // hkv, keys, dim).reshape(batch, hq, keys, dim)
                vv = vl[:, :, None].expand(batch, hkv, hq // hkv, keys, dim).reshape(batch, hq, keys, dim)
                F.scaled_dot_product_attention(qt, kk, vv, attn_mask=add)

        def prefix_only():
            for kl, vl in zip(ks, vs, strict=True):
                F.scaled_dot_product_attention(qt, kl[:, :, :prefix], vl[:, :, :prefix], enable_gqa=True)

        methods = [("sdpa_us", sdpa), ("transformers_us", hf_path), ("prefix_only_us", prefix_only)]
        if flex:
            try:
                methods.append(("flex_us", flex_baseline(torch, q, ks, vs, vis, prefix)))
            except Exception as e:  # (the block mask is built once, outside the timing)
                row["flex_us"] = None
                print(f"  flex_us failed: {type(e).__name__}: {str(e)[:120]}")
        for name, fn in methods:
            try:
                row[name] = timed(torch, fn) * 1e3 / layers
            except Exception as e:  # a baseline that does not run here is reported, not fatal
                row[name] = None
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:120]}")
    return row


MLA_SHAPES = [(64, 8192, 17, 128), (1, 32768, 17, 128), (16, 4096, 65, 16)]  # (B, prefix, rows, heads)


def measure_mla(torch, rng, batch, prefix, rows, heads, bw, flops, baselines):
    """One MLA shape (latent 512 + rotary 64, one KV head, bf16): kdtree.tree_attention_mla
    against SDPA with the mask (GQA over the one latent head) and the floor."""
    import torch.nn.functional as F

    import kdtree

    budget = rows - 1
    trees = bench_trees(torch, rng, batch, budget)
    keys = prefix + rows
    nbytes = batch * keys * 576 * 2
    layers = max(1, min(32, -(-150_000_000 // nbytes)))
    q = torch.randn(batch, rows, heads, 576, device="cuda", dtype=torch.bfloat16) * 0.3
    cs = [torch.randn(batch, keys, 576, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    pre = torch.full((batch,), prefix, dtype=torch.int64, device="cuda")
    out = torch.empty(batch, rows, heads, 512, device="cuda", dtype=torch.bfloat16)
    fl = 2 * batch * rows * heads * keys * (576 + 512)
    floor = max(nbytes / bw, fl / flops) * 1e6
    scale = 1 / 192 ** 0.5
    kdtree.tree_attention_mla(q, cs[0], trees, pre, softmax_scale=scale, max_prefix=prefix, out=out)
    n = ctypes.c_size_t()
    from kdtree import _native as _lib
    _lib.load().kdt_tree_attention_mla_cuda_workspace_bytes(batch, budget, heads, prefix, ctypes.byref(n))
    ws = torch.empty(max(n.value, 1), dtype=torch.uint8, device="cuda")

    def ours():
        for c in cs:
            kdtree.tree_attention_mla(q, c, trees, pre, softmax_scale=scale, max_prefix=prefix, out=out, workspace=ws,
                                      errors="status")

    t = timed(torch, ours) * 1e3 / layers
    row = {"B": batch, "prefix": prefix, "rows": rows, "heads": heads, "floor_us": floor, "kdtree_us": t,
           "kdtree_tflops": fl / t / 1e6}
    if baselines:
        vis = trees.visibility.bool()
        mask = torch.ones(batch, rows, keys, dtype=torch.bool, device="cuda")
        mask[:, :, prefix:] = vis
        qt, m4 = q.transpose(1, 2), mask[:, None]

        def sdpa():
            for c in cs:
                k = c[:, None]
                F.scaled_dot_product_attention(qt, k, k[..., :512], attn_mask=m4, scale=scale, enable_gqa=True)

        try:
            row["sdpa_us"] = timed(torch, sdpa) * 1e3 / layers
        except Exception as e:  # a baseline that does not run here is reported, not fatal
            row["sdpa_us"] = None
            print(f"  MLA sdpa failed: {type(e).__name__}: {str(e)[:120]}")
    return row


def run_mla(torch, baselines=True) -> list[dict]:
    """Every MLA shape: prints the markdown table and returns the numbers."""
    rng = np.random.default_rng(1)
    print("| B | prefix | rows | heads | floor us | kdtree us (x floor) | TFLOP/s | SDPA+mask us | kdtree vs SDPA |")
    print("|" + "---|" * 9)
    res = []
    for batch, prefix, rows, heads in MLA_SHAPES:
        r = measure_mla(torch, rng, batch, prefix, rows, heads, FLOOR_BPS, FLOOR_FLOPS, baselines)
        res.append(r)
        sd, t = r.get("sdpa_us"), r["kdtree_us"]
        sd_s, vs = ("-", "-") if sd is None else (f"{sd:,.1f}", f"{sd / t:.1f}x")
        print(f"| {batch} | {prefix:,} | {rows} | {heads} | {r['floor_us']:,.1f} | {t:,.1f} "
              f"({t / r['floor_us']:.1f}x) | {r['kdtree_tflops']:.0f} | {sd_s} | {vs} |", flush=True)
    return res


def run(torch, hq=32, hkv=8, dim=128, baselines=True, flex=False) -> dict:
    """Every shape of SHAPES: prints the markdown table and returns the numbers."""
    mbw, mflops = rates(torch)
    bw, flops = FLOOR_BPS, FLOOR_FLOPS
    print(f"device: {torch.cuda.get_device_name()}; this run: copy {mbw / 1e12:.2f} TB/s, bf16 matmul "
          f"{mflops / 1e12:.0f} TFLOP/s; the floor uses {bw / 1e12:.2f} TB/s and {flops / 1e12:.0f} TFLOP/s")
    results = []
    rng = np.random.default_rng(0)
    print("| B | prefix | rows | floor us | kdtree us (x floor) | kdtree TFLOP/s, TB/s | mma.sync kernel us | "
          "wgmma, CTA barriers us | "
          "SDPA+mask us | transformers path us | prefix-only SDPA us | FlexAttention us | kdtree vs SDPA |")
    print("|" + "---|" * 13)

    def f(x):
        return "-" if x is None else f"{x:,.1f}"

    for batch, prefix, rows in SHAPES:
        row = measure(torch, rng, batch, prefix, rows, hq, hkv, dim, bw, flops, baselines, flex)
        t_ours, floor = row["kdtree_us"], row["floor_us"]
        results.append(row)
        vs = f"{row['sdpa_us'] / t_ours:.1f}x" if row.get("sdpa_us") else "-"
        print(f"| {batch} | {prefix:,} | {rows} | {floor:.1f} | {t_ours:,.1f} ({t_ours / floor:.1f}x) | "
              f"{row['kdtree_tflops']:.0f}, {row['kdtree_TBps']:.2f} | {f(row.get('mma_sync_us'))} | "
              f"{f(row.get('wgmma_barrier_us'))} | "
              f"{f(row.get('sdpa_us'))} | "
              f"{f(row.get('transformers_us'))} | {f(row.get('prefix_only_us'))} | {f(row.get('flex_us'))} | {vs} |",
              flush=True)
    return {"device": torch.cuda.get_device_name(), "copy_Bps": mbw, "bf16_flops": mflops, "floor_Bps": bw,
            "floor_flops": flops, "heads": [hq, hkv], "head_dim": dim, "shapes": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mla", action=argparse.BooleanOptionalAction, default=True, help="also the MLA shapes")
    ap.add_argument("--flex", action="store_true",
                    help="also FlexAttention with a block mask (torch.compile per shape: minutes; a shape that "
                         "does not compile is reported as failed)")
    args = ap.parse_args()
    import torch

    res = run(torch, *args.heads, args.head_dim, args.baselines, args.flex)
    if args.mla:
        print("\nMLA (absorbed; latent 512 + rotary 64, one KV head; bf16):")
        res["mla"] = run_mla(torch, args.baselines)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
