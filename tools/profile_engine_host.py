#!/usr/bin/env python3
"""Where the batched engine's host time goes: cProfile over ``Engine.generate`` of the
shipped pair on a GPU (bfloat16, CUDA graphs captured up front), the functions with the
most own time. A round's host work that exceeds its GPU time shows up as "host ms not
hidden" in tools/bench_engine_gpu.py; this names it.

    PYTHONPATH=python python tools/profile_engine_host.py --batch 64 --budget 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tools"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--budget", default="32", help="N, or auto")
    ap.add_argument("--mode", default="ddtree", choices=("ddtree", "chain", "ar"))
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    import torch

    from bench_engine_gpu import PAIR, held_out_prompts
    from kdtree.engine.batched import Engine
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    if not torch.cuda.is_available():
        print("profile_engine_host: torch sees no CUDA device", file=sys.stderr)
        return 2
    target = load_causal_lm(PAIR / "target", device="cuda", dtype="bfloat16")
    drafter = load_dflash(PAIR / "drafter", target)
    budget = args.budget if args.budget == "auto" else int(args.budget)
    eng = Engine(target, drafter, max_batch=args.batch, budget=budget, mode=args.mode, max_length=512)
    eng.capture_all(prefill=True)
    prompts = held_out_prompts(args.batch * args.requests_per_slot, 128)
    eng.generate(prompts[: args.batch], 8)
    eng.reset_stats()
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    eng.generate(prompts, args.new_tokens)
    prof.disable()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = eng.stats
    print(f"B={args.batch} {args.mode} N={args.budget}: {st.tokens / wall:.0f} tok/s (under the profiler), "
          f"{st.rounds} rounds, {1e3 * wall / max(st.rounds, 1):.3f} ms a round, host waited "
          f"{1e3 * st.host_wait / max(st.rounds, 1):.3f} ms a round for the GPU")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
