"""Benchmark: the C draft-tree builder vs the pure-Python reference, measured side by side.

Prints, for budgets 16, 64, 256, 1024 (L = 15, K = N, vocabulary 32,000) and two drafter
shapes (peaked: a top-1 probability around 0.9 like a trained drafter's; flat: top-1 around
a few percent), the median time per tree of:

- ``reference``: ``kdtree.reference.build_trees`` on one request;
- ``C call``: one ``kdt_trees_build_cpu`` call for one request, through ctypes with the
  arguments prepared beforehand (the builder plus ~1 us of ctypes call overhead), inputs
  rotating over 64 requests, one output buffer reused (as an engine reuses its own);
- ``C api``: ``kdtree.build_trees(..., out=...)`` (adds the Python argument checks);
- ``C batch``: one call building 64 requests (into one [64, N+1, ...] output), divided by 64;

and the ratios reference / C call, and (64 single calls writing the same rows of the same
batch output) / (one batch call): above 1 means batching is cheaper. Every output
array (including both visibility forms) is produced in all variants.

Run: ``nox -s bench`` (or ``PYTHONPATH=python python tools/bench_trees.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import time

import numpy as np

import kdtree
from kdtree import _native as _lib
from kdtree import reference
from kdtree.core import host
from kdtree.core.types import TREE_FIELDS

BUDGETS = (16, 64, 256, 1024)
DEPTH = 15
VOCAB = 32000
BATCH = 64


def drafter_logits(rng: np.random.Generator, shape: str, batch: int) -> np.ndarray:
    """[batch, DEPTH, VOCAB] float32 logits shaped like a drafter's output."""
    x = rng.standard_normal((batch, DEPTH, VOCAB), dtype=np.float32)
    if shape == "peaked":
        x *= 1.5
        hot = rng.integers(0, VOCAB, size=(batch, DEPTH))
        np.put_along_axis(x, hot[..., None], 14.0, axis=-1)
    return x


def median_ns(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per variant")
    parser.add_argument("--reference-requests", type=int, default=8,
                        help="requests timed with the (slow) reference per row")
    args = parser.parse_args()

    lib = _lib.load()
    fn = lib.kdt_trees_build_cpu
    rng = np.random.default_rng(2026)
    print(f"machine: {platform.machine()} {platform.processor() or ''} "
          f"python {platform.python_version()}, libkdtree {kdtree.library_version()}")
    print(f"L={DEPTH}, K=N, V={VOCAB}; medians; times in microseconds per tree\n")
    header = (f"{'drafter':8} {'N':>5} {'reference':>10} {'C call':>8} {'C api':>8} "
              f"{'C batch':>8} {'ref/Ccall':>9} {'64 calls/batch':>14}")
    print(header)
    print("-" * len(header))
    for shape in ("peaked", "flat"):
        logits = drafter_logits(rng, shape, BATCH)
        for budget in BUDGETS:
            lp, ids = kdtree.topk_logprobs(logits, budget)
            # Reference (one request at a time).
            ref_ns = statistics.median(
                median_ns(lambda b=b, lp=lp, ids=ids, n=budget: reference.build_trees(lp[b], ids[b], n), 1)
                for b in range(args.reference_requests)
            )
            # C: arguments prepared once, then raw calls.
            # One output buffer reused by every call, as an engine reuses its tree buffer;
            # the inputs rotate over 64 requests.
            out = kdtree.empty_trees(1, budget, DEPTH)
            singles = []
            for b in range(BATCH):
                draft = _lib.KdtDraft(1, DEPTH, budget, lp[b].ctypes.data, ids[b].ctypes.data,
                                      None, None, VOCAB, -1)
                singles.append((ctypes.byref(draft), ctypes.byref(host.trees_struct(out)), draft, out))

            def run_singles(singles=singles, fn=fn):
                for d, t, _, _ in singles:
                    fn(d, t, None, 0)

            call_ns = median_ns(run_singles, args.repeats) / BATCH

            def run_api(lp=lp, ids=ids, budget=budget, out=out):
                for b in range(BATCH):
                    kdtree.build_trees(lp[b], ids[b], budget, vocab_size=VOCAB, out=out)

            api_ns = median_ns(run_api, max(3, args.repeats // 3)) / BATCH
            # Batching: one call for 64 requests vs 64 single calls writing the same
            # request rows of the same output buffer (equal work, equal memory).
            out_b = kdtree.empty_trees(BATCH, budget, DEPTH)
            draft_b = _lib.KdtDraft(BATCH, DEPTH, budget, lp.ctypes.data, ids.ctypes.data,
                                    None, None, VOCAB, -1)
            tb = host.trees_struct(out_b)
            batch_args = (ctypes.byref(draft_b), ctypes.byref(tb), None, 0)
            batch_ns = median_ns(lambda a=batch_args, fn=fn: fn(*a), args.repeats)
            views = []
            for b in range(BATCH):
                view = kdtree.TreeBatch(**{f: getattr(out_b, f)[b:b + 1] for f in TREE_FIELDS},
                                     budget=budget, depth=DEPTH)
                draft = _lib.KdtDraft(1, DEPTH, budget, lp[b].ctypes.data, ids[b].ctypes.data,
                                      None, None, VOCAB, -1)
                views.append((ctypes.byref(draft), ctypes.byref(host.trees_struct(view)), draft, view))

            def run_into_batch(views=views, fn=fn):
                for d, t, _, _ in views:
                    fn(d, t, None, 0)

            split_ns = median_ns(run_into_batch, args.repeats)
            # Same trees either way.
            ref_tree = reference.build_trees(lp[0], ids[0], budget)
            for f in TREE_FIELDS:
                assert np.array_equal(getattr(ref_tree, f)[0], getattr(out_b, f)[0]), f
            print(f"{shape:8} {budget:5d} {ref_ns / 1e3:10.1f} {call_ns / 1e3:8.2f} "
                  f"{api_ns / 1e3:8.2f} {batch_ns / BATCH / 1e3:8.2f} "
                  f"{ref_ns / call_ns:8.0f}x {split_ns / batch_ns:13.2f}x")


if __name__ == "__main__":
    main()
