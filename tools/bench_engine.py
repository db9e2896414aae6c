#!/usr/bin/env python3
"""The transformer engine end to end: autoregressive decoding vs a DFlash-style
chain (budget = L, top-1 per depth) vs DDTree trees at several budgets, with the shipped
pair (fixtures/models/stdlib-qwen3) on held-out prompts: slices of kdtree's own Python
sources, text the models never saw. Greedy decoding; every run's output is compared with
autoregressive decoding's (identical in float32 and float64; in 16-bit floats the tree
forward and the one-token forward round differently, so a near-tie can flip an argmax and
the count of identical prompts is reported instead). Exit status 1 when a float32/float64
output differs.

    PYTHONPATH=python python tools/bench_engine.py --device cuda --dtype bfloat16 --plot engine.png

Prints one markdown table: tokens/s (median of --repeats interleaved repeats), target forwards per generated token, mean acceptance
length (tokens per round), and each stage's share of the round time (draft, top-k + build +
verify = the tree's overhead, the target's forward, commit = KV compaction).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from kdtree.apps.cli import int_in  # noqa: E402


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


def report(header: str, dev: str, rows: list[dict], plot: Path | None) -> None:
    """Print the markdown table of ``rows`` (AR first, then the chain, then the budgets) and,
    with ``plot``, draw tokens/s and tokens per forward against the budget."""
    print(header)
    print(f"repeated text in the continuations (8-token windows seen before): {100 * rows[0]['rep']:.0f}%")
    print("| decoding | tokens/s | target forwards per token | tokens per round | prompts identical to AR | "
          "ms per round | draft | tree (top-k + build + verify) | target | commit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ar = rows[0]
    for r in rows:
        if r["budget"] is None:
            print(f"| {r['name']} | {r['tps']:.0f} | 1.00 | 1.00 | - | - | - | - | - | - |")
            continue
        print(f"| {r['name']} | {r['tps']:.0f} ({r['tps'] / ar['tps']:.2f}x) | {r['fpt']:.3f} "
              f"({1 / r['fpt']:.2f}x fewer) | {r['tau']:.2f} | {r['same']}/{r['prompts']} | {r['ms_round']:.2f} | "
              f"{100 * r['draft']:.1f}% | {100 * r['tree']:.1f}% | {100 * r['target']:.1f}% | "
              f"{100 * r['commit']:.1f}% |")
    if plot is not None:
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
        fig.savefig(str(plot))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=ROOT / "fixtures" / "models" / "stdlib-qwen3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--prompts", type=int_in(1, 64), default=8)
    p.add_argument("--prompt-chars", type=int_in(16, 4000), default=450)
    p.add_argument("--max-new-tokens", type=int_in(1, 2048), default=96)
    p.add_argument("--budgets", type=int_in(1, 4096), nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--repeats", type=int_in(1, 100), default=3, help="timed repeats per configuration (median)")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--from-json", type=Path, default=None,
                   help="print and plot the rows of an earlier --json run instead of measuring")
    args = p.parse_args(argv)
    if args.from_json is not None:
        try:
            saved = json.loads(args.from_json.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            p.error(f"--from-json {args.from_json}: {exc}")
        report(saved["header"], saved["device"], saved["rows"], args.plot)
        return 0

    import torch

    from kdtree import engine
    from kdtree.apps.generate import load_pair, repeated_share
    from kdtree.drafter import BlockDrafterRunner
    from kdtree.hf import HFTarget

    tok, target_model, drafter_model = load_pair(args.models, args.device, args.dtype)
    depth = drafter_model.config.max_depth
    layers = drafter_model.config.target_layers
    eos = tok.token_to_id("<|endoftext|>")
    ps = prompts(tok, args.prompts, args.prompt_chars)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    # Warm-up (not timed): the first forwards pay for kernel selection, allocator growth and
    # lazy initialisation, which would otherwise be charged to whichever row runs first.
    for budget in (None, max(args.budgets)):
        target = HFTarget(target_model, feature_layers=layers)
        if budget is None:
            engine.autoregressive_generate(target, ps[0], 16, stop_tokens=[eos])
        else:
            engine.speculative_generate(target, BlockDrafterRunner(drafter_model), ps[0], 16, budget=budget,
                                        depth=depth, stop_tokens=[eos], snapshot=None)
    sync()

    configs = [("AR", None, None)] + [(f"chain (N = L = {depth}, top-1)", depth, 1)] + [
        (f"DDTree N = {b}", b, None) for b in args.budgets]
    def run(budget, width, prompt):
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
        return res, time.perf_counter() - t0

    # Every configuration runs every prompt once per repeat; repeats interleave the
    # configurations, so drifting clocks or load hit all of them alike, and the tokens/s
    # column uses each configuration's median repeat.
    walls: dict[int, list[float]] = {c: [] for c in range(len(configs))}
    results: dict[int, list] = {}
    for r in range(args.repeats):
        for c, (_, budget, width) in enumerate(configs):
            runs = [run(budget, width, prompt) for prompt in ps]
            walls[c].append(sum(w for _, w in runs))
            if r == 0:
                results[c] = [res for res, _ in runs]
    rows = []
    ar_tokens = [res.tokens for res in results[0]]
    for c, (name, budget, _) in enumerate(configs):
        res_list = results[c]
        tokens = sum(len(res.tokens) for res in res_list)
        forwards = sum(res.target_calls for res in res_list)
        rounds = sum(res.rounds for res in res_list)
        stages = {s: sum(res.times[s] for res in res_list) for s in engine.STAGES}
        same = sum(res.tokens == ar_tokens[i] for i, res in enumerate(res_list))
        rep = sum(repeated_share(res.tokens, p) for res, p in zip(res_list, ps, strict=True))
        total = sum(stages.values()) or 1.0
        wall = statistics.median(walls[c])
        rows.append(dict(name=name, tps=tokens / wall, fpt=forwards / tokens, tau=tokens / rounds if rounds else 1.0,
                         same=same, prompts=len(ps), draft=stages["draft"] / total,
                         tree=(stages["topk"] + stages["build"] + stages["verify"]) / total,
                         target=stages["target"] / total, commit=stages["commit"] / total,
                         ms_round=1e3 * total / rounds if rounds else 0.0,
                         rep=rep / len(ps), budget=budget))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    header = (f"## engine: {len(ps)} held-out prompts of ~{args.prompt_chars} characters, {args.max_new_tokens} new "
              f"tokens each, greedy; {dev}, {next(target_model.parameters()).dtype}, torch {torch.__version__}")
    if args.json is not None:
        args.json.write_text(json.dumps(dict(header=header, device=dev, rows=rows), indent=1))
    report(header, dev, rows, args.plot)
    # 16-bit runs may differ at near-ties (reported); float32 and float64 runs must not.
    exact = not any(f"torch.{t}" in header for t in ("bfloat16", "float16"))
    return 1 if exact and any(r["same"] != r["prompts"] for r in rows[1:]) else 0


if __name__ == "__main__":
    sys.exit(main())
