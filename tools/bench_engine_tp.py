#!/usr/bin/env python3
"""The batched engine on a tensor-parallel target, launched with torchrun: one run per
world size T gives that TP column of the table (run it at T = 1, 2, 4).

    torchrun --nproc-per-node T tools/bench_engine_tp.py --shape qwen3-8b --json tp{T}.json

A target of a published shape with random weights (``--shape``), built whole on every rank
and sharded by transformers' own plan (:func:`kdtree.engine.hf.shard_causal_lm`), and a
DFlash-sized drafter over it (a DFlash drafter reads the target's embedding and LM head:
with ``--head sharded`` its logits are each rank's vocabulary slice too, so both of
kdtree's merges run). For each batch size B and mode (AR, the chain, DDTree at each
budget N):

- the round's time: on CUDA the GPU milliseconds of the graph-captured round and of each
  stage captured alone (``Engine.profile_round``); on the CPU the wall time of an eager
  round (a plumbing check, not a speed);
- the goal ratio: the round over the sum of its stages (the TP forward plus kdtree's
  kernels and the drafter), which the round should stay within 1.1x of;
- tokens/s PROJECTED at the shipped pair's acceptance length for that B and mode (the
  shipped pair decodes held-out prompts unsharded on each rank's device): B x acceptance /
  round time; a projection, not a trained pair of this shape;
- the bytes kdtree's own collectives move a round (per rank, the GPU forms: the drafter's
  top-k summaries ``B L summary_width(k, dtype) 4`` with a sharded head (``2k + 3`` words
  a row for float32 logits, ``ceil(k / 2) + k + 3`` for bfloat16), the target's choices ``B (N + 1)
  3 8`` greedy or ``B (N + 1) 4 8`` sampled; the CPU forms add 15 integers of rank checks
  and gather four float64 a row for the choices), next to
  the logits a whole head gathers (``B (N + 1) V 2`` for the target in bfloat16; the
  drafter's ``B L V 2`` on top where its head is the target's).

Rank 0 prints the table; ``--json`` writes every number. NCCL on CUDA (each rank on
cuda:LOCAL_RANK; leave NVLink multicast off, NCCL_NVLS_ENABLE=0), gloo on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tools"))

# published sizes (config.json of Qwen/Qwen3-8B and Qwen/Qwen3-32B); "tiny" checks the plumbing
SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, drafter_layers=5),
    "qwen3-32b": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, drafter_layers=5),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, drafter_layers=1),
}
BLOCK = 16  # the drafter's block: the root and 15 drafted positions (DFlash-b16)


def random_pair(shape: str, device, dtype, vocab_sharded_head: bool):
    """(target, drafter): random weights of `shape` (identical on every rank: one seed),
    the target sharded over the world, the drafter a DFlash drafter over it."""
    import torch
    import transformers

    from bench_engine_gpu import randomise
    from kdtree.engine import dflash
    from kdtree.engine.hf import shard_causal_lm

    s = dict(SHAPES[shape])
    dl = s.pop("drafter_layers")
    cfg = transformers.Qwen3Config(**s, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)
    with torch.device("meta"):
        target = transformers.Qwen3ForCausalLM(cfg)
    target = target.to_empty(device=device).to(dtype).eval()
    randomise(target, device)
    shard_causal_lm(target, vocab_sharded_head=vocab_sharded_head)
    dcfg = dflash.dflash_config(dict(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=dl, num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], max_position_embeddings=40960,
        rope_theta=1e6, block_size=BLOCK, num_target_layers=s["num_hidden_layers"],
        dflash_config={"mask_token_id": 5}))
    with torch.device("meta"):
        drafter = dflash.DFlashDrafter(dcfg, target.get_input_embeddings(), target.get_output_embeddings())
    drafter = drafter.to_empty(device=device).to(dtype).eval()
    randomise(drafter, device, skip=("embed", "lm_head"))
    return target, drafter


def shipped_acceptance(device, dtype, batches, budgets, new_tokens, prompt_tokens) -> dict:
    """Tokens a request-round of the shipped pair (unsharded) at each (B, mode): the
    acceptance the projection charges."""
    from bench_engine_gpu import PAIR, configs, held_out_prompts
    from kdtree.engine.batched import Engine
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    target = load_causal_lm(PAIR / "target", device=str(device), dtype=dtype)
    drafter = load_dflash(PAIR / "drafter", target)
    out = {}
    for b in batches:
        prompts = held_out_prompts(2 * b, prompt_tokens)
        for name, mode, n in configs(budgets, auto=False):
            eng = Engine(target, drafter, max_batch=b, budget=n, mode=mode,
                         max_length=prompt_tokens + new_tokens + 1)
            eng.generate(prompts, new_tokens)
            out[(b, name)] = eng.stats.tokens / max(eng.stats.slot_rounds, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--head", choices=["whole", "sharded", "both"], default="both")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=1024, help="cached positions a request holds in the timed rounds")
    ap.add_argument("--new-tokens", type=int, default=64, help="the shipped pair's run that measures acceptance")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from bench_engine_gpu import configs
    from kdtree.distributed import summary_width
    from kdtree.engine.batched import Engine

    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"bench_engine_tp: {args.shape}, TP = {world}, {device.type} "
        f"({torch.cuda.get_device_name(device) if cuda else 'CPU'}), {dtype}, torch {torch.__version__}", flush=True)
    width_cap = min(SHAPES[args.shape]["vocab_size"] // world, 1024)
    if max(args.budgets) > width_cap:  # the DDTree width (top-k per depth) must fit every rank's slice
        say(f"--budgets: at most {width_cap} here (the top-k per depth of a budget-N tree is min(N, 1024) and must "
            f"fit each rank's vocabulary slice of {SHAPES[args.shape]['vocab_size'] // world})")
        dist.destroy_process_group()
        return 2
    accept = shipped_acceptance(device, "bfloat16" if cuda else "float32", args.batches, args.budgets,
                                args.new_tokens, args.prompt_tokens)
    heads = ["whole", "sharded"] if args.head == "both" else [args.head]
    vocab = SHAPES[args.shape]["vocab_size"]
    rows, results = [], []
    for head in heads:
        t0 = time.perf_counter()
        target, drafter = random_pair(args.shape, device, dtype, head == "sharded")
        say(f"  {head} head: built and sharded in {time.perf_counter() - t0:.1f} s", flush=True)
        for b in args.batches:
            for name, mode, n in configs(args.budgets, auto=False):
                eng = Engine(target, drafter, max_batch=b, budget=n, mode=mode,
                             max_length=args.context + 64 + 2 * BLOCK)
                nb, depth = eng.budget, eng.depth
                if cuda:
                    eng.capture_all([b])
                    st = eng.profile_round(b, context=args.context, iters=3, repeats=3)
                else:
                    prompts = [[1 + (7 * i + j) % 50 for j in range(8)] for i in range(b)]
                    eng.generate(prompts, 4)
                    eng.reset_stats()
                    eng.generate(prompts, 12)
                    st = {"round": 1e3 * eng.stats.wall / max(eng.stats.rounds, 1)}
                stages = sum(v for k, v in st.items() if k != "round")
                tau = accept[(b, name)]
                k = min(eng.width, nb) if mode != "ar" else 0
                sharded = head == "sharded"
                kd_bytes = ((b * depth * summary_width(k, dtype) * 4 if sharded and mode != "ar" else 0)
                            + (b * (nb + 1) * 3 * 8 if sharded else 0))
                gather_bytes = b * (nb + 1) * vocab * 2 + (b * depth * vocab * 2 if mode != "ar" else 0)
                r = {"head": head, "B": b, "mode": name, "stages_ms": st, "acceptance_shipped": tau,
                     "projected_tokens_per_s": b * tau / (st["round"] / 1e3),
                     "round_over_stages": st["round"] / stages if stages else None,
                     "kdtree_collective_bytes_per_rank": kd_bytes, "logits_gather_bytes": gather_bytes}
                results.append(r)
                stage_text = " / ".join(f"{st[s]:.2f}" for s in ("draft", "build", "mask", "target", "verify",
                                                                  "commit") if s in st) or "- (CPU: not staged)"
                rows.append([head, b, name, f"{st['round']:.2f}", stage_text,
                             f"{r['round_over_stages']:.2f}" if stages else "-", f"{tau:.2f}",
                             f"{r['projected_tokens_per_s']:,.0f}", f"{kd_bytes:,}" if sharded else "-",
                             f"{gather_bytes:,}"])
                del eng
                if cuda:
                    torch.cuda.empty_cache()
        del target, drafter
    head_row = ["head", "B", "mode", "round ms", "draft / build / mask / target / verify / commit ms",
                "round / stages", "shipped acc. length", "projected tokens/s", "kdtree collective B/rank",
                "logits gather B (whole head)"]
    say(f"\n## TP = {world}, {args.shape} (random weights), context {args.context}\n")
    say("| " + " | ".join(head_row) + " |")
    say("|" + "---|" * len(head_row))
    for row in rows:
        say("| " + " | ".join(str(c) for c in row) + " |")
    if args.json is not None and rank == 0:
        args.json.write_text(json.dumps({"shape": args.shape, "tp": world, "device": str(device),
                                         "context": args.context, "rows": results}, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
