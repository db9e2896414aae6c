#!/usr/bin/env python3
"""The transformer engine end to end (issue 4): autoregressive decoding vs a DFlash-style
chain (budget = L, top-1 per depth) vs DDTree trees at several budgets, with the shipped
pair (fixtures/models/stdlib-qwen3) on held-out prompts: slices of kdtree's own Python
sources, text the models never saw. Greedy decoding; every run's output is checked
identical to autoregressive decoding.

    PYTHONPATH=python python tools/bench_engine.py --device cuda --dtype bfloat16 --plot engine.png

Prints one markdown table: tokens/s, target forwards per generated token, mean acceptance
length (tokens per round), and each stage's share of the round time (draft, top-k + build +
verify = the tree's overhead, the target's forward, commit = KV compaction).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))


def prompts(tok, n: int, chars: int) -> list[list[int]]:
    files = sorted((ROOT / "python" / "kdtree").glob("*.py"))
    out = []
    for f in files:
        text = f.read_text()
        for start in range(1000, len(text) - chars, max(chars * 3, 4000)):
            out.append(tok.encode(text[start:start + chars]).ids)
            if len(out) == n:
                return out
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=ROOT / "fixtures" / "models" / "stdlib-qwen3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=450)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from kdtree import engine
    from kdtree.drafter import BlockDrafterRunner
    from kdtree.generate import load_pair, repeated_share
    from kdtree.hf import HFTarget

    tok, target_model, drafter_model = load_pair(args.models, args.device, args.dtype)
    depth = drafter_model.config.max_depth
    layers = drafter_model.config.target_layers
    eos = tok.token_to_id("<|endoftext|>")
    ps = prompts(tok, args.prompts, args.prompt_chars)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    configs = [("AR", None, None)] + [(f"chain (N = L = {depth}, top-1)", depth, 1)] + [
        (f"DDTree N = {b}", b, None) for b in args.budgets]
    rows = []
    ar_tokens: list[list[int]] = []
    for name, budget, width in configs:
        tokens = forwards = rounds = 0
        wall = 0.0
        stages = dict.fromkeys(engine.STAGES, 0.0)
        same = True
        rep = 0.0
        for i, prompt in enumerate(ps):
            target = HFTarget(target_model, feature_layers=layers)
            sync()
            t0 = time.perf_counter()
            if budget is None:
                res = engine.autoregressive_generate(target, prompt, args.max_new_tokens, stop_tokens=[eos])
            else:
                res = engine.speculative_generate(target, BlockDrafterRunner(drafter_model), prompt,
                                                  args.max_new_tokens, budget=budget, depth=depth, width=width,
                                                  stop_tokens=[eos], snapshot=None)
            sync()
            wall += time.perf_counter() - t0
            if budget is None:
                ar_tokens.append(res.tokens)
            else:
                same &= res.tokens == ar_tokens[i]
                rounds += res.rounds
                for s in engine.STAGES:
                    stages[s] += res.times[s]
            tokens += len(res.tokens)
            forwards += res.target_calls
            rep += repeated_share(res.tokens, prompt)
        total = sum(stages.values()) or 1.0
        rows.append(dict(name=name, tps=tokens / wall, fpt=forwards / tokens, tau=tokens / rounds if rounds else 1.0,
                         same=same, draft=stages["draft"] / total,
                         tree=(stages["topk"] + stages["build"] + stages["verify"]) / total,
                         target=stages["target"] / total, commit=stages["commit"] / total,
                         rep=rep / len(ps), budget=budget))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"## engine: {len(ps)} held-out prompts of ~{args.prompt_chars} characters, {args.max_new_tokens} new "
          f"tokens each, greedy; {dev}, {next(target_model.parameters()).dtype}, torch {torch.__version__}")
    print(f"repeated text in the continuations (8-token windows seen before): {100 * rows[0]['rep']:.0f}%")
    print("| decoding | tokens/s | target forwards per token | tokens per round | identical to AR | "
          "draft | tree (top-k + build + verify) | target | commit |")
    print("|---|---|---|---|---|---|---|---|---|")
    ar = rows[0]
    for r in rows:
        if r["budget"] is None:
            print(f"| {r['name']} | {r['tps']:.0f} | 1.00 | 1.00 | - | - | - | - | - |")
            continue
        print(f"| {r['name']} | {r['tps']:.0f} ({r['tps'] / ar['tps']:.2f}x) | {r['fpt']:.3f} "
              f"({1 / r['fpt']:.2f}x fewer) | {r['tau']:.2f} | {'yes' if r['same'] else 'NO'} | "
              f"{100 * r['draft']:.1f}% | {100 * r['tree']:.1f}% | {100 * r['target']:.1f}% | "
              f"{100 * r['commit']:.1f}% |")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tree = [r for r in rows if r["budget"] is not None and "chain" not in r["name"]]
        chain = next(r for r in rows if "chain" in r["name"])
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        xs = [r["budget"] for r in tree]
        a.plot(xs, [r["tps"] for r in tree], "o-", label="DDTree")
        a.axhline(ar["tps"], color="gray", ls="--", label="AR")
        a.axhline(chain["tps"], color="#dd8452", ls=":", label="chain (N = L)")
        a.set_xscale("log", base=2)
        a.set_xlabel("budget N")
        a.set_ylabel("tokens / s")
        a.legend()
        b.plot(xs, [1 / r["fpt"] for r in tree], "o-", label="DDTree")
        b.axhline(1 / chain["fpt"], color="#dd8452", ls=":", label="chain (N = L)")
        b.set_xscale("log", base=2)
        b.set_xlabel("budget N")
        b.set_ylabel("generated tokens per target forward")
        b.legend()
        fig.suptitle(f"kdtree engine, stdlib-qwen3 pair, {dev}")
        fig.tight_layout()
        fig.savefig(str(args.plot))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
