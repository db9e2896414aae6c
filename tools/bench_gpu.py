"""GPU benchmark (device machine): kdtree's CUDA kernels vs the published path, side by side.

Medians over CUDA events; inputs rotate over several buffers so no kernel reads data the
previous iteration left in L2. Baselines run in the same process on the same inputs:

1. top-k log-probs, B=64, L=16, V=151,936, bf16, K=64: kdtree vs ``torch.topk`` +
   ``torch.logsumexp`` on ``.float()`` logits (the published path), with the achieved
   read bandwidth next to the device copy bandwidth measured here (``copy_`` of an equally
   large buffer; bytes read + written over time).
2. the vocabulary-sharded top-k's merge (T = 8 shards of V = 163,840) against the top-k
   of the gathered logits, and the bytes each moves.
3. tree build, B=64, L=16, N in {64, 256, 1024}, peaked and flat drafters: kdtree GPU
   (from the top-k) vs kdtree's CPU builder (one call, whole batch) vs the published path
   (the top-k copied to the host, then the Python heap per request, kdtree.reference).
4. per-request budgets: B=64 requests with budgets drawn from 1..256 in one call, against
   the batch at its mean budget and padded to the largest (GPU and CPU).
5. the whole round's overhead for B=64, N=64 (top-k + build from drafter logits, masks,
   greedy verify from target logits, KV compaction) under one CUDA graph vs the published
   path (torch top-k/logsumexp, host heap per request, masks on the host then copied,
   torch argmax over every node, the walk on the host, torch gather for compaction).
6. tree attention (the verify forward's attention, one layer, 32 / 8 heads of 128, bf16,
   B x prefix x rows from 1 x 4k x 9 to 16 x 16k x 257): kdtree vs SDPA with the tree
   mask, transformers' sdpa path, SDPA on the prefix alone, and the floor
   (tools/bench_tree_attention.py, which also runs alone).

Run: ``nox -s bench-gpu`` (or ``PYTHONPATH=python python tools/bench_gpu.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import kdtree
from kdtree import reference

B, L, V, K = 64, 16, 151_936, 64
H200_PEAK_GBS = 4800.0  # HBM3e peak from the data sheet; the measured copy rate is printed too


# GPU cycles of the wait queued before each timed launch (~25 us): the GPU reaches the start
# event only after the host has queued the launch, so the host's launch latency of a graph
# (several us) is not counted. Timings of tools/bench_gpu.py before 2026-12-05 (715944a)
# counted it, which for a kernel of a few us was most of the number.
_QUEUE_CYCLES = 50_000


def cuda_median_us(fn, inputs, repeats: int) -> float:
    """Median microseconds of fn(x) over `repeats` launches, x rotating over `inputs`:
    device time between two events, the launch queued behind a short GPU wait."""
    for x in inputs[:2]:
        fn(x)
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        x = inputs[r % len(inputs)]
        torch.cuda._sleep(_QUEUE_CYCLES)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def graphs_of(fn, inputs) -> list:
    """One CUDA graph per input holding fn(input) (kdtree's calls with errors='status'):
    the timings then hold the kernels only, not the Python binding's host work."""
    fn(inputs[0])
    torch.cuda.synchronize()
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                fn(x)
            graphs.append(g)
    torch.cuda.synchronize()
    return graphs


def wall_median_us(fn, inputs, repeats: int) -> float:
    fn(inputs[0])
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        x = inputs[r % len(inputs)]
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - t0) / 1000.0)
    return statistics.median(times)


def drafter_logits(gen: torch.Generator, shape: str, batch: int, length: int, vocab: int) -> torch.Tensor:
    x = torch.randn((batch, length, vocab), generator=gen, device="cuda", dtype=torch.float32)
    if shape == "peaked":  # top-1 probability around 0.9, as a trained drafter's
        x *= 1.5
        hot = torch.randint(0, vocab, (batch, length, 1), generator=gen, device="cuda")
        x.scatter_(-1, hot, 14.0)
    return x.to(torch.bfloat16)


def torch_topk(x: torch.Tensor, k: int):
    xf = x.float()
    vals, ids = torch.topk(xf, k, dim=-1)
    return vals - torch.logsumexp(xf, dim=-1, keepdim=True), ids


def bench_topk(gen, repeats: int) -> dict:
    inputs = [drafter_logits(gen, "peaked", B, L, V) for _ in range(3)]
    nbytes = inputs[0].numel() * inputs[0].element_size()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = cuda_median_us(lambda _: dst.copy_(src), [None], repeats)
    copy_gbs = 2 * nbytes / copy_us / 1e3
    ours_graphs = graphs_of(lambda x: kdtree.topk_logprobs(x, K, errors="status"), inputs)
    ours = cuda_median_us(lambda g: g.replay(), ours_graphs, repeats)
    ours_eager = cuda_median_us(lambda x: kdtree.topk_logprobs(x, K, errors="status"), inputs, repeats)
    theirs = cuda_median_us(lambda x: torch_topk(x, K), inputs, repeats)
    # agreement on one input
    lp, ids = kdtree.topk_logprobs(inputs[0], K, errors="status")
    tlp, tids = torch_topk(inputs[0], K)
    same_ids = float((ids.long() == tids).float().mean())
    max_err = float((lp - tlp).abs().max())
    read_gbs = nbytes / ours / 1e3
    return dict(nbytes=nbytes, copy_us=copy_us, copy_gbs=copy_gbs, ours=ours, ours_eager=ours_eager, theirs=theirs,
                read_gbs=read_gbs, same_ids=same_ids, max_err=max_err)


def bench_build(gen, repeats: int, shape: str, budget: int) -> dict:
    logits = [drafter_logits(gen, shape, B, L, 32_000) for _ in range(3)]
    tops = [kdtree.topk_logprobs(x, min(budget, 32_000), errors="status")[:2] for x in logits]
    out = kdtree.build_trees(tops[0][0], tops[0][1], budget, errors="status")
    graphs = graphs_of(lambda t: kdtree.build_trees(t[0], t[1], budget, out=out, errors="status"), tops)
    gpu = cuda_median_us(lambda g: g.replay(), graphs, repeats)
    host_tops = [(t[0].cpu().numpy(), t[1].cpu().numpy()) for t in tops]
    cpu_out = kdtree.empty_trees(B, budget, L)
    t0 = time.perf_counter_ns()
    reps = max(3, repeats // 10)
    for r in range(reps):
        lp, ids = host_tops[r % 3]
        kdtree.build_trees(lp, ids, budget, out=cpu_out)
    cpu = (time.perf_counter_ns() - t0) / 1000.0 / reps
    # published path: device -> host copy of the top-k, then the Python heap per request
    n_ref = 4
    t0 = time.perf_counter_ns()
    lp, ids = tops[0][0].cpu().numpy(), tops[0][1].cpu().numpy()
    for b in range(n_ref):
        reference.build_trees(lp[b : b + 1], ids[b : b + 1], budget)
    published = (time.perf_counter_ns() - t0) / 1000.0 * B / n_ref
    # exactness on this input
    gpu_t = kdtree.build_trees(tops[0][0], tops[0][1], budget)
    cpu_t = kdtree.build_trees(host_tops[0][0], host_tops[0][1], budget)
    exact = all(np.array_equal(getattr(gpu_t, f).cpu().numpy(), getattr(cpu_t, f))
                for f in ("tokens", "parents", "visibility_bits"))
    return dict(gpu=gpu, cpu=cpu, published=published, exact=exact)


def bench_limits(gen, repeats: int, max_budget: int = 256) -> dict:
    """Per-request budgets: B requests with budgets drawn from 1..max_budget in one call
    (N = max_budget), against the same batch at its mean budget (one N for all) and padded
    to the largest (N = max_budget for all, what a caller without per-request budgets
    builds); GPU in CUDA graphs, CPU one call each; bit-identity to per-request builds."""
    logits = [drafter_logits(gen, "peaked", B, L, 32_000) for _ in range(3)]
    tops = [kdtree.topk_logprobs(x, K, errors="status")[:2] for x in logits]
    rng = np.random.default_rng(2026)
    budgets = rng.integers(1, max_budget + 1, B).astype(np.int32)
    mean = int(round(float(budgets.mean())))
    dev_budgets = torch.from_numpy(budgets).cuda()
    cases = {
        f"mixed, budgets 1..{max_budget} (mean {budgets.mean():.1f})": (max_budget, dev_budgets),
        f"one budget, the mean ({mean})": (mean, None),
        f"one budget, the largest ({max_budget})": (max_budget, None),
    }
    gpu, cpu = {}, {}
    host_tops = [(t[0].cpu().numpy(), t[1].cpu().numpy()) for t in tops]
    for name, (n, per) in cases.items():
        out = kdtree.build_trees(tops[0][0], tops[0][1], n, request_budgets=per, errors="status")
        graphs = graphs_of(lambda t, n=n, per=per, out=out: kdtree.build_trees(
            t[0], t[1], n, request_budgets=per, out=out, errors="status"), tops)
        gpu[name] = cuda_median_us(lambda g: g.replay(), graphs, repeats)
        host_out = kdtree.empty_trees(B, n, L)
        reps = max(3, repeats // 10)
        t0 = time.perf_counter_ns()
        for r in range(reps):
            lp, ids = host_tops[r % 3]
            kdtree.build_trees(lp, ids, n, request_budgets=None if per is None else budgets, out=host_out)
        cpu[name] = (time.perf_counter_ns() - t0) / 1000.0 / reps
    mixed = kdtree.build_trees(tops[0][0], tops[0][1], max_budget, request_budgets=dev_budgets)
    exact = True
    for b in range(0, B, 7):
        one = kdtree.build_trees(host_tops[0][0][b: b + 1], host_tops[0][1][b: b + 1], int(budgets[b]))
        rows = int(budgets[b]) + 1
        exact &= bool(np.array_equal(mixed.tokens[b, :rows].cpu().numpy(), one.tokens[0])
                      and np.array_equal(mixed.parents[b, :rows].cpu().numpy(), one.parents[0]))
    return dict(gpu=gpu, cpu=cpu, exact=exact)


# kdt_testing_set_topk_merge's kernels (native/kdt_testing.h)
MERGE_VARIANTS = {"ranking kernel, one block of 256 threads a row": 1, "merge paths, 1 warp a row": 2,
                  "merge paths, 2 warps a row": 3, "merge paths, 4 warps a row": 4, "merge paths, 8 warps a row": 5}


def bench_merge(gen, repeats: int, shards: int = 8, vocab: int = 163_840) -> dict:
    """The vocabulary-sharded top-k's merge (kdt_topk_merge_cuda) for B x L rows, K, T
    shards: the shards' summaries made on the host (kdtree.topk_shard), the merge timed on
    the GPU in a CUDA graph, next to the top-k of the gathered bf16 logits on one GPU."""
    rng = np.random.default_rng(2026)
    logits = rng.standard_normal((B, L, vocab), dtype=np.float32) * 3
    edges = np.linspace(0, vocab, shards + 1).astype(int)
    parts = [kdtree.topk_shard(logits[..., a:b], K, int(a)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    stack = [torch.from_numpy(np.ascontiguousarray(np.stack([p[i] for p in parts]))).cuda() for i in range(4)]
    graphs = graphs_of(lambda x: kdtree.topk_merge(*x, vocab, errors="status"), [stack])
    merge = cuda_median_us(lambda g: g.replay(), graphs, repeats)  # the automatic choice
    auto_out = kdtree.topk_merge(*stack, vocab)
    # each kernel forced through the test-only switch (native/kdt_testing.h)
    from kdtree import _native

    raw = _native.load()
    variants = {}
    same_bits = True
    try:
        for name, variant in MERGE_VARIANTS.items():
            raw.kdt_testing_set_topk_merge(variant)
            forced = graphs_of(lambda x: kdtree.topk_merge(*x, vocab, errors="status"), [stack])
            variants[name] = cuda_median_us(lambda g: g.replay(), forced, repeats)
            out = kdtree.topk_merge(*stack, vocab)
            same_bits &= bool(torch.equal(auto_out.ids, out.ids) and torch.equal(
                auto_out.logprobs.view(torch.int32), out.logprobs.view(torch.int32)))
    finally:
        raw.kdt_testing_set_topk_merge(0)
    got = auto_out
    full = torch.from_numpy(logits).cuda().to(torch.bfloat16)
    gathered = cuda_median_us(lambda g: g.replay(), graphs_of(lambda x: kdtree.topk_logprobs(x, K, errors="status"),
                                                              [full]), repeats)
    want = kdtree.topk_merge(*[t.cpu().numpy() for t in stack], vocab)
    same = bool(np.array_equal(got.ids.cpu().numpy(), want.ids))
    # what one rank makes of its bf16 slice and the all-gather moves (every rank's)
    from kdtree import distributed as kdist
    from kdtree.distributed import shard_summary

    first = full[..., edges[0]:edges[1]].contiguous()  # a rank holds its slice whole
    summary_fused = cuda_median_us(lambda g: g.replay(), graphs_of(lambda x: shard_summary(x, K, 0), [first]),
                                   repeats)  # the rest from kdt_topk_shard_stats_cuda (the default)
    fused_rest = shard_summary(first, K, 0)[:, -2:].contiguous().view(torch.float64)
    kdist._FUSED_STATS = False  # torch's float64 passes
    try:
        summary = cuda_median_us(lambda g: g.replay(), graphs_of(lambda x: shard_summary(x, K, 0), [first]), repeats)
        torch_rest = shard_summary(first, K, 0)[:, -2:].contiguous().view(torch.float64)
    finally:
        kdist._FUSED_STATS = True
    from kdtree.core.cuda import topk_shard_stats  # the summary's two kernels alone

    stats_only = cuda_median_us(lambda g: g.replay(), graphs_of(topk_shard_stats, [first]), repeats)
    topk_only = cuda_median_us(lambda g: g.replay(), graphs_of(lambda x: kdtree.topk_logprobs(x, K, errors="status"),
                                                               [first]), repeats)
    rest_err = float(((fused_rest - torch_rest).abs() / torch_rest.abs().clamp_min(1e-300)).max())
    shard_bytes = sum(shard_summary(full[..., a:b], K, int(a)).numel() * 4
                      for a, b in zip(edges[:-1], edges[1:], strict=True))
    return dict(merge=merge, variants=variants, same_bits=same_bits, gathered=gathered, same=same,
                shard_bytes=shard_bytes, summary=summary, summary_fused=summary_fused, stats_only=stats_only,
                topk_only=topk_only,
                rest_err=rest_err,
                full_bytes=B * L * vocab * 2, shards=shards, vocab=vocab)


def published_round(draft, target, prefix_host, k_cache, v_cache, budget):
    """The published path: torch top-k, host heap per request, host masks copied up,
    torch argmax at every node, host walk, torch gather for the compaction."""
    lp, ids = torch_topk(draft, min(K, budget))
    lp, ids = lp.cpu().numpy(), ids.cpu().numpy().astype(np.int32)
    trees = reference.build_trees(lp, ids, budget)
    mask = np.zeros((B, budget + 1, int(prefix_host.max()) + budget + 1), np.float32)
    for b in range(B):
        p = int(prefix_host[b])
        mask[b, :, p : p + budget + 1] = np.where(trees.visibility[b], 0.0, -np.inf)
    torch.from_numpy(mask).to("cuda", dtype=torch.bfloat16)
    choice = target.argmax(dim=-1).cpu().numpy().astype(np.int32)
    acc = reference.verify_greedy(trees, choice)
    for b in range(B):
        p = int(prefix_host[b])
        n = int(acc.accept_length[b])
        src = torch.as_tensor(acc.accepted_nodes[b, : n + 1] + p, device="cuda")
        dst = torch.arange(p, p + n + 1, device="cuda")
        for cache in (k_cache, v_cache):
            cache[b, :, dst] = cache[b, :, src]
    torch.cuda.synchronize()


def bench_round(gen, repeats: int, budget: int = 64) -> dict:
    heads, seq, dim = 8, 512, 128
    drafts = [drafter_logits(gen, "peaked", B, L, V) for _ in range(2)]
    targets = [drafter_logits(gen, "peaked", B, budget + 1, V) for _ in range(2)]
    draft, target = drafts[0].clone(), targets[0].clone()
    prefix = torch.randint(100, 300, (B,), generator=gen, device="cuda")
    k_cache = torch.randn((B, heads, seq, dim), generator=gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn((B, heads, seq, dim), generator=gen, device="cuda").to(torch.bfloat16)
    trees = kdtree.build_trees_from_logits(draft, K, budget)

    def round_():
        kdtree.build_trees_from_logits(draft, K, budget, out=trees, errors="status")
        kdtree.tree_attention_mask(trees, prefix, kind="additive", dtype="bfloat16", columns=300 + budget + 1,
                                   errors="status")
        acc = kdtree.verify_greedy_from_logits(trees, target, errors="status")
        kdtree.compact_kv([k_cache], [v_cache], prefix, acc, errors="status")

    round_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        round_()
    torch.cuda.synchronize()
    pairs = list(zip(drafts, targets, strict=True))

    def replay(pair):
        draft.copy_(pair[0])
        target.copy_(pair[1])
        graph.replay()

    # Each stage alone, in its own graph on the same buffers (medians over CUDA events).
    acc = kdtree.verify_greedy_from_logits(trees, target, errors="status")
    stages = {
        "top-k + build (from logits)": lambda _: kdtree.build_trees_from_logits(draft, K, budget, out=trees,
                                                                                errors="status"),
        "mask, additive bf16, C = 365": lambda _: kdtree.tree_attention_mask(
            trees, prefix, kind="additive", dtype="bfloat16", columns=300 + budget + 1, errors="status"),
        "mask, bit-packed uint32": lambda _: kdtree.tree_attention_mask(trees, prefix, kind="bits",
                                                                        columns=300 + budget + 1, errors="status"),
        "verify greedy from logits": lambda _: kdtree.verify_greedy_from_logits(trees, target, errors="status"),
        "verify sampled from logits (T = 1)": lambda _: kdtree.verify_sample_from_logits(
            trees, target, 1.0, seed=1, offset=2, errors="status"),
        "KV compaction (1 layer)": lambda _: kdtree.compact_kv([k_cache], [v_cache], prefix, acc, errors="status"),
    }
    stage_us = {}
    for name, fn in stages.items():
        g = graphs_of(fn, [None])
        stage_us[name] = cuda_median_us(lambda gr: gr.replay(), g, repeats)
    copies = cuda_median_us(lambda pair: (draft.copy_(pair[0]), target.copy_(pair[1])), pairs, repeats)
    ours = cuda_median_us(replay, pairs, repeats) - copies
    eager = wall_median_us(lambda _: round_(), [None], max(5, repeats // 4))
    prefix_host = prefix.cpu().numpy()
    published = wall_median_us(lambda _: published_round(draft, target, prefix_host, k_cache, v_cache, budget),
                               [None], 3)
    return dict(graph=ours, eager=eager, published=published, stages=stage_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["topk", "merge", "build", "limits", "round", "attention"])
    parser.add_argument("--flex", action="store_true",
                        help="the tree attention section also times FlexAttention with a block mask "
                             "(torch.compile per shape: minutes; a shape that does not compile is reported)")
    parser.add_argument("--dump-topk", metavar="PREFIX",
                        help="write the GPU top-k of one peaked bf16 drafter batch (the round's shapes) to "
                             "PREFIX.lp (float32 [B, L, K]) and PREFIX.ids (int32), raw, for "
                             "profiling the tree build on the round's inputs, and exit")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench-gpu needs a CUDA device and torch with CUDA")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(2026)
    if args.dump_topk:
        lp, ids = kdtree.topk_logprobs(drafter_logits(gen, "peaked", B, L, V), K)
        lp.cpu().numpy().astype("<f4").tofile(args.dump_topk + ".lp")
        ids.cpu().numpy().astype("<i4").tofile(args.dump_topk + ".ids")
        return
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"libkdtree {kdtree.library_version()}\n")
    if "topk" not in args.skip:
        r = bench_topk(gen, args.repeats)
        print(f"## top-k log-probs: B={B}, L={L}, V={V}, bf16, K={K} ({r['nbytes'] / 1e9:.3f} GB read once)")
        print(f"device copy: {r['copy_us']:.1f} us for 2 x {r['nbytes'] / 1e9:.3f} GB -> {r['copy_gbs']:.0f} GB/s")
        print("| variant | us | GB/s read | % of copy rate | torch / kdtree |")
        print("|---|---|---|---|---|")
        print(f"| kdtree (CUDA graph) | {r['ours']:.1f} | {r['read_gbs']:.0f} | "
              f"{100 * r['read_gbs'] / r['copy_gbs']:.0f}% | {r['theirs'] / r['ours']:.2f}x |")
        eager_gbs = r["nbytes"] / r["ours_eager"] / 1e3
        print(f"| kdtree (eager Python call) | {r['ours_eager']:.1f} | {eager_gbs:.0f} | "
              f"{100 * eager_gbs / r['copy_gbs']:.0f}% | {r['theirs'] / r['ours_eager']:.2f}x |")
        theirs_gbs = r["nbytes"] / r["theirs"] / 1e3
        print(f"| torch topk + logsumexp on .float() | {r['theirs']:.1f} | {theirs_gbs:.0f} | "
              f"{100 * theirs_gbs / r['copy_gbs']:.0f}% | 1.00x |")
        print(f"floor at the measured copy rate: {r['nbytes'] / (r['copy_gbs'] * 1e3):.1f} us; "
              f"ids equal to torch's: {100 * r['same_ids']:.2f}%, max |log-prob diff| {r['max_err']:.2e}\n")
    if "merge" not in args.skip:
        r = bench_merge(gen, args.repeats)
        print(f"## sharded top-k merge: B={B}, L={L}, K={K}, T={r['shards']} shards of V={r['vocab']} "
              "(goal: < 10 us; gathered bytes < 1% of the logits')")
        print("| variant | us | bytes moved between GPUs |")
        print("|---|---|---|")
        print(f"| kdtree merge of the shards' summaries, the automatic choice (CUDA graph) | {r['merge']:.1f} | "
              f"{r['shard_bytes'] / 1e6:.2f} MB ({100 * r['shard_bytes'] / r['full_bytes']:.2f}%) |")
        for name, us in r["variants"].items():
            print(f"| the same, {name} | {us:.1f} | same |")
        print(f"| one rank's shard_summary of its bf16 slice, rest from kdt_topk_shard_stats_cuda (CUDA graph) | "
              f"{r['summary_fused']:.1f} | - |")
        print(f"| of which the slice's top-k alone; kdt_topk_shard_stats_cuda alone | {r['topk_only']:.1f}; "
              f"{r['stats_only']:.1f} | - |")
        print(f"| the same summary, torch float64 rest | {r['summary']:.1f} | - |")
        print(f"| top-k of the gathered bf16 logits on one GPU | {r['gathered']:.1f} | "
              f"{r['full_bytes'] / 1e6:.1f} MB (100%) |")
        print(f"ids equal to the CPU merge's: {r['same']}; every kernel's outputs bit-equal to the automatic "
              f"choice's: {r['same_bits']}; fused statistics: max relative rest difference {r['rest_err']:.1e} "
              f"from torch's\n")
    if "build" not in args.skip:
        print(f"## tree build: B={B}, L={L}, K=N, V=32,000 (drafter logits -> top-k on the GPU first)")
        print("| drafter | N | kdtree GPU us (graph) | kdtree CPU us (batch) | published us (host heap) | "
              "CPU / GPU | published / GPU | bit-identical |")
        print("|---|---|---|---|---|---|---|---|")
        for shape in ("peaked", "flat"):
            for budget in (64, 256, 1024):
                r = bench_build(gen, args.repeats, shape, budget)
                print(f"| {shape} | {budget} | {r['gpu']:.1f} | {r['cpu']:.0f} | {r['published']:.0f} | "
                      f"{r['cpu'] / r['gpu']:.0f}x | {r['published'] / r['gpu']:.0f}x | {r['exact']} |")
        print()
    if "limits" not in args.skip:
        r = bench_limits(gen, args.repeats)
        print(f"## per-request budgets: B={B}, L={L}, K={K}, peaked drafter (goal: mixed <= 1.1x the mean budget's)")
        print("| batch | GPU us (graph) | GPU / mean's | CPU us | CPU / mean's |")
        print("|---|---|---|---|---|")
        mean_name = next(n for n in r["gpu"] if n.startswith("one budget, the mean"))
        for name in r["gpu"]:
            print(f"| {name} | {r['gpu'][name]:.1f} | {r['gpu'][name] / r['gpu'][mean_name]:.2f}x | "
                  f"{r['cpu'][name]:.0f} | {r['cpu'][name] / r['cpu'][mean_name]:.2f}x |")
        print(f"mixed batch equal to per-request builds (every 7th request): {r['exact']}\n")
    if "round" not in args.skip:
        r = bench_round(gen, args.repeats)
        print(f"## whole round overhead: B={B}, N=64, L={L}, V={V} bf16 (drafter and target logits), "
              "KV cache 8 heads x 128 bf16, one layer")
        print("| variant | us | published / variant |")
        print("|---|---|---|")
        print(f"| kdtree, one CUDA graph | {r['graph']:.1f} | {r['published'] / r['graph']:.0f}x |")
        print(f"| kdtree, eager (Python calls) | {r['eager']:.1f} | {r['published'] / r['eager']:.0f}x |")
        print(f"| published path | {r['published']:.0f} | 1x |")
        print("\nstages alone (each in its own CUDA graph):")
        print("| stage | us |")
        print("|---|---|")
        for name, us in r["stages"].items():
            print(f"| {name} | {us:.1f} |")
    if "attention" not in args.skip:
        import bench_tree_attention

        print("\n## tree attention (the verify forward's attention, one layer; tools/bench_tree_attention.py)")
        bench_tree_attention.run(torch, flex=args.flex)
        print("\nMLA (absorbed; latent 512 + rotary 64, one KV head; bf16):")
        bench_tree_attention.run_mla(torch)


if __name__ == "__main__":
    main()
