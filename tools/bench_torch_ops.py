"""Host cost of kdtree's torch custom operators (kdtree.torch_ops) next to the functions
they wrap, on one small round (so that the library's own work is small and the dispatch
shows): per call, the median over many calls of the wall time of

  api      the kdtree function on the arrays the operator hands it (numpy on the CPU,
           the tensors themselves on CUDA);
  op       torch.ops.kdtree.<name> eagerly (torch's dispatcher, then the same function);
  compiled the operator inside a torch.compile(fullgraph=True) function that does only
           that call (what a compiled round pays a call);

and the difference op - api: what registering the call as an operator adds; and
``status op``, the operator's ``*_status`` form (errors="status": no status read-back).
On CUDA the operators and functions that raise read their statuses back (a
synchronisation each call), a column ``api status`` times the function with
``errors="status"``, and the ``status`` columns are host times while the host stays ahead
of the GPU (the work queues behind; past the launch queue's depth a call waits for the
GPU, so they are at least the GPU time a call); the header says whether the operators'
CUDA kernels are the C++ ones (libkdtree_torch) or the Python ones. On CUDA the round's four ``*_status``
operators are then captured in one CUDA graph and the host time of a replay is printed
(what a round captured whole pays on the host). ``--profile`` then
prints where one call's host time goes (cProfile over the function form, the 12 largest
cumulative entries).

    python tools/bench_torch_ops.py [--device cpu|cuda] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def timed(fn, reps: int) -> float:
    """Median microseconds a call over `reps` calls (after 20 warm-up calls), in 5 blocks."""
    for _ in range(20):
        fn()
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        blocks.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(blocks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile the function form of each call")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    import kdtree
    from kdtree import torch_ops
    from kdtree.core import api
    from kdtree.core.types import Acceptance

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    B, L, N, V, K = args.batch, args.depth, args.budget, args.vocab, min(args.budget, args.vocab)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((B, L, V), generator=g).to(dev)
    lp, ids = torch.ops.kdtree.topk_logprobs(logits, K)
    roots = torch.arange(B, dtype=torch.int32).to(dev)
    pos = torch.full((B,), 5, dtype=torch.int64).to(dev)
    fields = torch.ops.kdtree.build_trees(lp, ids, N, roots, pos, 0)
    target = torch.randn((B, N + 1, V), generator=g).to(dev)
    caps = torch.full((B,), L + 1, dtype=torch.int64).to(dev)
    acc = torch.ops.kdtree.verify_greedy_from_logits(list(fields), N, L, target, [], caps)
    keys = [torch.zeros((B, 2, 5 + N + 1, 8)).to(dev) for _ in range(2)]
    values = [torch.zeros_like(k) for k in keys]

    def host(x):
        return x if cuda else torch_ops._host(x)

    trees = torch_ops.tree_batch(list(fields), N, L)
    acc_obj = Acceptance(*(host(a) for a in acc))
    key_arrays = keys if cuda else [k.numpy() for k in keys]
    value_arrays = values if cuda else [v.numpy() for v in values]
    calls = {
        "topk_logprobs": (lambda: api.topk_logprobs(host(logits), K),
                          lambda: torch.ops.kdtree.topk_logprobs(logits, K)),
        "build_trees": (lambda: api.build_trees(host(lp), host(ids), N, root_tokens=host(roots),
                                                root_positions=host(pos), pad_token=0),
                        lambda: torch.ops.kdtree.build_trees(lp, ids, N, roots, pos, 0)),
        "verify_greedy_from_logits": (lambda: api.verify_greedy_from_logits(trees, host(target),
                                                                            max_commit=host(caps)),
                                      lambda: torch.ops.kdtree.verify_greedy_from_logits(list(fields), N, L, target,
                                                                                         [], caps)),
        "compact_kv": (lambda: api.compact_kv(key_arrays, value_arrays, host(pos), acc_obj),
                       lambda: torch.ops.kdtree.compact_kv(keys, values, pos, *acc)),
    }
    status_calls = {
        "topk_logprobs": lambda: api.topk_logprobs(host(logits), K, errors="status"),
        "build_trees": lambda: api.build_trees(host(lp), host(ids), N, root_tokens=host(roots),
                                               root_positions=host(pos), pad_token=0, errors="status"),
        "verify_greedy_from_logits": lambda: api.verify_greedy_from_logits(trees, host(target),
                                                                           max_commit=host(caps), errors="status"),
        "compact_kv": lambda: api.compact_kv(key_arrays, value_arrays, host(pos), acc_obj, errors="status"),
    }
    status_ops = {
        "topk_logprobs": lambda: torch.ops.kdtree.topk_logprobs_status(logits, K),
        "build_trees": lambda: torch.ops.kdtree.build_trees_status(lp, ids, N, roots, pos, 0),
        "verify_greedy_from_logits": lambda: torch.ops.kdtree.verify_greedy_from_logits_status(
            list(fields), N, L, target, [], caps),
        "compact_kv": lambda: torch.ops.kdtree.compact_kv_status(keys, values, pos, *acc),
    }
    rows = []
    for name, (direct, op) in calls.items():
        row = {"op": name, "api_us": timed(direct, args.reps), "op_us": timed(op, args.reps),
               "status_op_us": timed(status_ops[name], args.reps)}
        if cuda:
            row["status_us"] = timed(status_calls[name], args.reps)
        if args.profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                (status_calls[name] if cuda else direct)()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(12)
            print(f"---- {name}: cProfile of 200 calls{' (errors=status)' if cuda else ''}\n{text.getvalue()}")
        if not args.no_compile:
            compiled = torch.compile(op, fullgraph=True)
            compiled()
            row["compiled_us"] = timed(compiled, args.reps)
        rows.append(row)
    graph_us = None
    if cuda:
        torch.cuda.synchronize()
        # the round's four *_status operators captured in one CUDA graph: the host's cost a
        # round is then one replay call (its launch; the GPU work queues behind)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in status_ops.values():
                f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in status_ops.values():
                f()
        launches = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            launches.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        graph_us = statistics.median(launches)
    total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "op"}
    kernels = "C++ (libkdtree_torch)" if cuda and torch_ops.NATIVE else "Python"
    print(f"kdtree torch ops, host cost a call ({dev}, B={B}, L={L}, N={N}, V={V}, kdtree {kdtree.__version__}, "
          f"torch {torch.__version__}, {kernels} operator kernels), median of 5 x {args.reps} calls, us")
    head = ["op", "api", "op", "op - api"] + ([] if args.no_compile else ["compiled", "compiled - api"]) + \
        (["api status"] if cuda else []) + ["status op"]
    print(" | ".join(f"{h:>26}" if i == 0 else f"{h:>14}" for i, h in enumerate(head)))
    for r in rows + [dict(op="the round's four calls", **total)]:
        cells = [r["api_us"], r["op_us"], r["op_us"] - r["api_us"]]
        if not args.no_compile:
            cells += [r["compiled_us"], r["compiled_us"] - r["api_us"]]
        if cuda:
            cells += [r["status_us"]]
        cells += [r["status_op_us"]]
        print(f"{r['op']:>26} | " + " | ".join(f"{c:14.1f}" for c in cells))
    if graph_us is not None:
        print(f"the round's four *_status operators captured in one CUDA graph: {graph_us:.1f} us of host time a "
              f"replay (median of {args.reps}, each launched on an idle GPU)")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(dev), "rows": rows, "total": total,
                                         "graph_replay_us": graph_us}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
