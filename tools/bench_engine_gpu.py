#!/usr/bin/env python3
"""The batched engine on a GPU, side by side in one run (``nox -s bench-engine``).

For the shipped pair (fixtures/models/stdlib-qwen3, bfloat16) at each batch size B:
AR (the same engine, graph-captured, one token a forward), the chain (the drafter's top-1
chain, N = L) and DDTree at each budget N: tokens/s over B prompts of held-out text
(slices of kdtree's own sources), target forwards per token, acceptance length (tokens a
request-round), GPU time of the round and of each stage captured alone in a CUDA graph,
and the host time per round not hidden behind GPU work (wall per round less GPU per
round). Baselines a user would pick instead: the single-sequence engine
(kdtree.engine.speculative_generate with HFTarget) and transformers' own ``generate`` with
its static cache (greedy; eager and, with --compile, torch.compile'd).

With --qwen3-8b: the same round timings for a Qwen3-8B-shaped target (random weights, the
published sizes) and a DFlash-sized drafter at B in --big-batches, and the tokens/s they
would give at the shipped pair's acceptance: the shipped pair decodes the same requests at
the same B (budget='auto' choosing from the 8B round times) and each of its rounds is
charged the 8B round time of its budget. A projection, not a measurement of a trained 8B
pair.

    PYTHONPATH=python python tools/bench_engine_gpu.py --out results.json --plot engine.png

Prints markdown tables; --out writes every number as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

PAIR = ROOT / "fixtures" / "models" / "stdlib-qwen3"


def held_out_prompts(n: int, tokens: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(PAIR / "tokenizer.json"))
    texts = [f.read_text() for f in sorted((ROOT / "python" / "kdtree").rglob("*.py")) if f.stat().st_size > 6000]
    out, i = [], 0
    while len(out) < n:
        t = texts[i % len(texts)]
        start = 400 + (i // len(texts)) * 1500
        ids = tok.encode(t[start:start + 8 * tokens]).ids[:tokens]
        if len(ids) == tokens:
            out.append(ids)
        i += 1
    return out


def configs(budgets: list[int], auto: bool = True) -> list[tuple[str, str, int | str]]:
    out = [("AR", "ar", 0), ("chain", "chain", 0)] + [(f"DDTree N={n}", "ddtree", n) for n in budgets]
    return out + ([("DDTree auto", "ddtree", "auto")] if auto else [])


def run_engine(target, drafter, mode, budget, batch, prompts, new, max_length, repeats, budgets, costs=None,
               tree_attention="auto"):
    """tokens/s (median of repeats), acceptance, forwards/token, wall and GPU per round, over
    len(prompts) requests through `batch` slots (continuous batching)."""
    import torch

    from kdtree.engine.batched import Engine

    eng = Engine(target, drafter, max_batch=batch, budget=budget, mode=mode, max_length=max_length,
                 auto_budgets=budgets, tree_attention=tree_attention)
    t0 = time.perf_counter()
    eng.capture_all(prefill=True)  # the prefill graphs too: no capture inside the timed runs
    capture_s = time.perf_counter() - t0
    if costs is not None:  # a projection: the choices another target's round times would make
        eng.costs = dict(costs)
    eng.generate(prompts[:batch], 8)  # warm-up: prefill path and allocator
    runs = []
    for _ in range(repeats):
        eng.reset_stats()
        eng.round_counts.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, new)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        toks = sum(len(o.tokens) for o in outs)
        runs.append((toks / wall, wall, dict(vars(eng.stats)), [o.tokens for o in outs], dict(eng.round_counts)))
    runs.sort(key=lambda r: r[0])
    tps, wall, stats, tokens, counts = runs[len(runs) // 2]
    prof = eng.profile_round(batch) if budget != "auto" else {}
    decode_rounds = stats["rounds"]
    decode_wall = wall - stats["prefill_gpu"]  # less the prefill forwards' GPU time
    return {
        "tokens_per_s": tps, "tokens_per_s_all": [r[0] for r in runs], "wall_s": wall,
        "decode_tokens_per_s": stats["tokens"] / decode_wall, "prefill_s": stats["prefill_gpu"],
        "prefill_host_s": stats["prefill_wall"], "prefill_chunks": stats["prefill_chunks"],
        "acceptance": stats["tokens"] / max(stats["slot_rounds"], 1),
        "forwards_per_token": stats["rounds"] / max(stats["tokens"], 1) * batch,
        "rounds": decode_rounds, "wall_per_round_ms": 1e3 * decode_wall / max(decode_rounds, 1),
        "stages_ms": prof, "capture_s": capture_s, "outputs": tokens, "tokens": stats["tokens"],
        "round_counts": {f"{b},{n}": c for (b, n), c in counts.items()},
        "auto_costs": {f"{b},{n}": c for (b, n), c in eng.costs.items()},
    }


def old_engine(target, drafter, prompt, new, budget):
    from kdtree.engine import speculative_generate
    from kdtree.engine.drafter import BlockDrafterRunner
    from kdtree.engine.hf import HFTarget

    t = HFTarget(target, feature_layers=drafter.feature_layers)
    r = BlockDrafterRunner(drafter)
    speculative_generate(t, r, prompt, 8, budget=budget, depth=drafter.max_depth)
    t0 = time.perf_counter()
    res = speculative_generate(t, r, prompt, new, budget=budget, depth=drafter.max_depth)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": len(res.tokens) / wall, "acceptance": res.mean_acceptance_length}


def hf_generate(model, prompts, new, batch, compile_):
    """transformers' generate, greedy, static cache, left-padded batch of equal prompts."""
    import torch

    ids = torch.tensor(prompts[:batch], device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
              pad_token_id=0)
    if compile_:
        from transformers import CompileConfig

        kw["compile_config"] = CompileConfig(fullgraph=False)
    else:
        kw["disable_compile"] = True
    with torch.no_grad():
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": batch * (out.shape[1] - ids.shape[1]) / wall}


def qwen3_8b(device="cuda", drafter=True):
    """A Qwen3-8B-shaped target (config of Qwen/Qwen3-8B) and a DFlash-b16-sized drafter
    (5 layers at the target's width, features from 5 target layers; None when not
    `drafter`), random weights."""
    import torch
    import transformers

    from kdtree.engine.drafter import BlockDrafter, BlockDrafterConfig

    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)
    with torch.device("meta"):
        target = transformers.Qwen3ForCausalLM(cfg)
    target = target.to_empty(device=device).to(torch.bfloat16).eval()
    dcfg = BlockDrafterConfig(vocab_size=151936, feature_size=5 * 4096, target_layers=(1, 9, 17, 25, 33),
                              hidden_size=4096, num_layers=5, num_heads=32, head_dim=128, intermediate_size=12288,
                              block_size=16, rope_theta=1e6)
    if drafter:
        with torch.device("meta"):
            drafter = BlockDrafter(dcfg)
        drafter = drafter.to_empty(device=device).to(torch.bfloat16).eval()
    else:
        drafter = None
    g = torch.Generator(device=device).manual_seed(0)
    for m in (target, drafter) if drafter is not None else (target,):
        randomise(m, device, generator=g)
    return target, drafter


def randomise(model, device, skip=(), generator=None) -> None:
    """Random weights for a model made on the meta device: N(0, 0.02) matrices, ones for
    vectors and norms, the rotary tables (theta 1e6) recomputed; parameters whose names hold
    a `skip` part are left alone. `generator` (default: one seeded 0) makes every rank of a
    tensor-parallel run draw the same weights."""
    import torch

    g = torch.Generator(device=device).manual_seed(0) if generator is None else generator
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in skip):
                continue
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
        for name, buf in model.named_buffers():
            if "inv_freq" in name:
                dim = buf.shape[0] * 2
                buf.copy_(1.0 / (1e6 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)))


@contextlib.contextmanager
def transformers_sdpa_path():
    """SDPA calls with a mask and enable_gqa run as transformers' sdpa path does them: K/V
    repeated to the query heads (repeat_kv), then SDPA under the additive mask."""
    import torch
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def repeated(query, key, value, attn_mask=None, enable_gqa=False, **kw):
        if enable_gqa and attn_mask is not None:
            b, hkv, s, d = key.shape
            g = query.shape[1] // hkv
            key = key[:, :, None].expand(b, hkv, g, s, d).reshape(b, hkv * g, s, d)
            value = value[:, :, None].expand(b, hkv, g, s, d).reshape(b, hkv * g, s, d)
            enable_gqa = False
        return orig(query, key, value, attn_mask=attn_mask, enable_gqa=enable_gqa, **kw)

    torch.nn.functional.scaled_dot_product_attention = repeated
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig


def verify_forward(batch: int, context: int, budget: int, repeats: int) -> list[dict]:
    """GPU ms of the Qwen3-8B-shaped target's verify forward (batch requests, `context`
    cached tokens each, budget + 1 tree rows) captured in a CUDA graph by the engine: with
    kdtree.tree_attention, SDPA (GQA, additive mask) and transformers' sdpa path. The
    drafter is a small one (its size does not enter the target stage)."""
    import torch

    from kdtree.engine.batched import Engine
    from kdtree.engine.drafter import BlockDrafter, BlockDrafterConfig

    big, _ = qwen3_8b(drafter=False)
    small = BlockDrafter(BlockDrafterConfig(vocab_size=151936, feature_size=5 * 4096, target_layers=(1, 9, 17, 25, 33),
                                            num_layers=1, block_size=16)).to("cuda", torch.bfloat16).eval()
    torch.cuda.empty_cache()  # the float32 copies made while building the model
    iters = 2
    out = []
    for label, attn, patch in (("kdtree.tree_attention", "kdtree", False), ("SDPA, GQA, additive mask", "sdpa", False),
                               ("transformers' sdpa path (repeat_kv + mask)", "sdpa", True)):
        eng = Engine(big, small, max_batch=batch, budget=budget, mode="ddtree", max_length=context + 2 * iters * 17 + 8,
                     tree_attention=attn)
        with transformers_sdpa_path() if patch else contextlib.nullcontext():
            eng.capture_all([batch])
            st = eng.profile_round(batch, context=context, iters=iters, repeats=repeats)
        out.append({"attention": label, "target_ms": st["target"], "round_ms": st["round"]})
        print(f"  verify forward B={batch} context={context} N={budget} {label}: target {st['target']:.2f} ms, "
              f"round {st['round']:.2f} ms", flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return out


def table(rows: list[list], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main() -> int:
    import torch

    from kdtree.apps.generate import load_pair
    from kdtree.engine.hf import load_causal_lm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests-per-slot", type=int, default=4,
                    help="requests per slot (B x this many prompts, so that finished slots are refilled)")
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", action="store_true", help="also transformers' generate under torch.compile")
    ap.add_argument("--qwen3-8b", action="store_true", help="the Qwen3-8B-shaped round timings and projection")
    ap.add_argument("--big-batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--big-attention", nargs="+", choices=["auto", "kdtree", "sdpa"], default=["auto"],
                    help="the Qwen3-8B-shaped target's verify attention (Engine(tree_attention=...)); several: "
                         "each timed, the first keyed plainly in --out")
    ap.add_argument("--shipped-json", type=Path,
                    help="take the shipped pair's results (acceptance lengths) from this --out file of an earlier "
                         "run instead of measuring them (with --qwen3-8b)")
    ap.add_argument("--tree-attention", choices=["auto", "kdtree", "sdpa"], default="auto",
                    help="the verify forward's attention (Engine(tree_attention=...)) of the shipped pair's runs")
    ap.add_argument("--verify-forward", type=int, nargs=3, metavar=("B", "CONTEXT", "N"),
                    help="only the Qwen3-8B-shaped verify forward (target stage) at B requests of CONTEXT cached "
                         "tokens and budget N: kdtree.tree_attention vs SDPA vs transformers' sdpa path")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_engine_gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}")
    if args.verify_forward:
        b, ctx, n = args.verify_forward
        res = verify_forward(b, ctx, n, args.repeats)
        base = res[2]["target_ms"]
        print(f"\n## Qwen3-8B-shaped verify forward (random weights), B = {b}, context {ctx}, {n + 1} rows a request\n")
        print(table([[r["attention"], f"{r['target_ms']:.2f}", f"{base / r['target_ms']:.2f}x"] for r in res],
                    ["attention", "target forward GPU ms (CUDA graph)", "speed-up vs transformers' path"]))
        if args.out:
            args.out.write_text(json.dumps({"device": dev, "verify_forward": res}, indent=1))
        return 0
    _, target, drafter = load_pair(PAIR, "cuda", "bfloat16")
    prompts = held_out_prompts(max(args.batches) * args.requests_per_slot, args.prompt_tokens)
    max_length = max(512, args.prompt_tokens + args.new_tokens + 16)
    results = {"device": dev, "shipped": {}, "baselines": {}, "qwen3_8b": {}}
    rows = []
    if args.shipped_json:
        results["shipped"] = json.loads(args.shipped_json.read_text())["shipped"]
        args.batches = sorted({int(k.rsplit("B=", 1)[1]) for k in results["shipped"]})
    for b in args.batches if not args.shipped_json else ():
        ar_tps = None
        reqs = prompts[: b * args.requests_per_slot]
        for name, mode, n in configs(args.budgets):
            r = run_engine(target, drafter, mode, n, b, reqs, args.new_tokens, max_length, args.repeats,
                           args.budgets, tree_attention=args.tree_attention)
            if mode == "ar":
                ar_tps, ar_out, ar_dec = r["tokens_per_s"], r["outputs"], r["decode_tokens_per_s"]
            same = sum(o == a for o, a in zip(r.pop("outputs"), ar_out, strict=True))
            r["identical_to_ar"] = same
            results["shipped"][f"{name} B={b}"] = r
            st = r["stages_ms"]
            if st:
                host = max(0.0, r["wall_per_round_ms"] - st["round"])
                gpu = [f"{st['round']:.3f}", f"{sum(st[k] for k in st if k != 'round'):.3f}",
                       " / ".join(f"{st[k]:.3f}" for k in ("draft", "build", "mask", "target", "verify", "commit")),
                       f"{r['wall_per_round_ms']:.3f}", f"{host:.3f}"]
            else:
                used = {}
                for key, c in r["round_counts"].items():
                    used[key.split(",")[1]] = used.get(key.split(",")[1], 0) + c
                gpu = ["", "", "budgets used (rounds): " + ", ".join(f"{k}: {v}" for k, v in sorted(
                    used.items(), key=lambda kv: int(kv[0]))), f"{r['wall_per_round_ms']:.3f}", ""]
            rows.append([b, name, f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / ar_tps:.2f}",
                         f"{r['decode_tokens_per_s']:.0f} ({r['decode_tokens_per_s'] / ar_dec:.2f})",
                         f"{r['acceptance']:.2f}", f"{r['forwards_per_token']:.3f}", *gpu, f"{same}/{len(reqs)}"])
            print(f"  B={b} {name}: {r['tokens_per_s']:.0f} tok/s, tau {r['acceptance']:.2f}"
                  + (f", round {st['round']:.3f} ms" if st else ""), flush=True)
    if rows:
        print("\n## The shipped pair (bfloat16), batched engine, one CUDA graph a round\n")
        print(table(rows, ["B", "mode", "tokens/s", "x AR", "decode tokens/s (x AR)", "accept. length", "fwd/token",
                       "round GPU ms", "sum of stages ms", "draft / build / mask / target / verify / commit ms",
                       "wall/round ms", "host ms not hidden", "same as AR"]))
    if args.baselines:
        base = []
        r = old_engine(load_causal_lm(PAIR / "target", device="cuda", dtype="bfloat16"), drafter, prompts[0],
                       args.new_tokens, 64)
        results["baselines"]["single-sequence engine N=64 B=1"] = r
        base.append(["single-sequence engine (host heap, eager), DDTree N=64", 1, f"{r['tokens_per_s']:.0f}"])
        hf = load_causal_lm(PAIR / "target", device="cuda", dtype="bfloat16")
        for b in args.batches:
            for comp in (False, True) if args.compile else (False,):
                try:
                    r = hf_generate(hf, prompts, args.new_tokens, b, comp)
                except Exception as exc:  # noqa: BLE001 - a baseline that does not run is reported
                    r = {"tokens_per_s": float("nan"), "error": f"{type(exc).__name__}: {exc}"[:200]}
                label = "transformers generate, static cache" + (", torch.compile" if comp else "")
                results["baselines"][f"{label} B={b}"] = r
                base.append([label, b, f"{r['tokens_per_s']:.0f}" + (f" ({r['error']})" if "error" in r else "")])
        print("\n## Baselines (greedy, same prompts)\n")
        print(table(base, ["baseline", "B", "tokens/s"]))
    if args.qwen3_8b:
        from kdtree.engine.batched import Engine

        big, bdraft = qwen3_8b()
        rows = []
        for b in args.big_batches:
            # every mode's projection is made the same way: the shipped pair decodes the same
            # b x requests-per-slot requests through b slots (budget='auto' choosing from the 8B
            # round times), and the projected time is its rounds at the 8B round time of their
            # budget (at bucket b: tail rounds with fewer slots are charged as full ones)
            reqs = prompts[: b * args.requests_per_slot]
            rounds_ms = {}
            for att in args.big_attention:
                for name, mode, n in configs(args.budgets, auto=False):
                    eng = Engine(big, bdraft, max_batch=b, budget=n, mode=mode, max_length=1024, tree_attention=att)
                    eng.capture_all([b])
                    st = eng.profile_round(b, iters=3, repeats=3)
                    del eng
                    torch.cuda.empty_cache()
                    rounds_ms[att, name] = st
                    print(f"  8B B={b} {name}, attention {att}: round {st['round']:.2f} ms", flush=True)
            shipped = {}  # the shipped pair's runs at fixed budgets: the same for every attention
            for att in args.big_attention:
                costs = {n: rounds_ms[att, f"DDTree N={n}"]["round"] for n in args.budgets}
                scaled = {(bb, n): costs[n] for n in args.budgets for bb in (1, 2, 4, 8, 16, 32, 64, 128) if bb <= b}
                for name, mode, n in configs(args.budgets):
                    if n == "auto":
                        r = run_engine(target, drafter, mode, n, b, reqs, args.new_tokens, max_length, 1,
                                       args.budgets, costs=scaled)
                        r.pop("outputs")
                        t = sum(c * costs[int(k.split(",")[1])] for k, c in r["round_counts"].items()) / 1e3
                        st, used = {}, "budgets used (rounds): " + ", ".join(
                            f"{k.split(',')[1]}: {c}" for k, c in sorted(r["round_counts"].items(),
                                                                         key=lambda kv: int(kv[0].split(',')[1])))
                    else:
                        if name not in shipped:
                            shipped[name] = run_engine(target, drafter, mode, n, b, reqs, args.new_tokens,
                                                       max_length, 1, args.budgets)
                            shipped[name].pop("outputs")
                        r = shipped[name]
                        st = rounds_ms[att, name]
                        t = r["rounds"] * st["round"] / 1e3
                        used = " / ".join(f"{st[k]:.2f}" for k in ("draft", "build", "mask", "target", "verify",
                                                                    "commit"))
                    proj = r["tokens"] / t
                    key = f"{name} B={b}" + ("" if att == args.big_attention[0] else f" attention={att}")
                    results["qwen3_8b"][key] = {"stages_ms": st, "tau_used": r["acceptance"], "attention": att,
                                                "rounds": r["rounds"], "tokens": r["tokens"],
                                                "round_counts": r["round_counts"], "projected_tokens_per_s": proj}
                    rows.append([b, name, att, f"{st['round']:.2f}" if st else "", used, f"{r['acceptance']:.2f}",
                                 f"{proj:.0f}"])
        print("\n## Qwen3-8B-shaped target, random weights: round GPU time; tokens/s PROJECTED at the shipped pair's "
              "acceptance\n")
        print(table(rows, ["B", "mode", "verify attention", "round ms",
                           "draft / build / mask / target / verify / commit ms", "shipped accept. length",
                           "projected tokens/s"]))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_mode: dict[str, list[tuple[int, float]]] = {}
    for key, r in results["shipped"].items():
        name, b = key.rsplit(" B=", 1)
        by_mode.setdefault(name, []).append((int(b), r["tokens_per_s"]))
    for name, pts in by_mode.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests decoded together)")
    ax.set_ylabel("tokens/s (aggregate)")
    ax.set_title(f"kdtree batched engine, shipped pair, bf16 ({results['device']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
