#!/usr/bin/env python3
"""Train the demo pair shipped in fixtures/models/: a byte-level BPE tokenizer, a
small Qwen3-style target and a DFlash-style block drafter, all on the Python standard
library's source files found on the machine (kdtree.ngram.stdlib_sources: tests and
generated data excluded; every 20th file, by sorted path, is held out).

    python tools/train_models.py --out fixtures/models/stdlib-qwen3 --device cuda
    python tools/train_models.py --out /tmp/smoke --smoke          # minutes on a CPU

Steps (all seeded; the model card records every number printed here):
1. tokenizer: byte-level BPE (the ``tokenizers`` library), ``<|endoftext|>`` = id 0
   between files;
2. target: Qwen3ForCausalLM trained from scratch (next-token cross-entropy, AdamW, cosine
   schedule), saved in bfloat16; held-out perplexity measured on the saved weights;
3. drafter data: the saved target's own greedy continuations of prompts cut from the
   training files (float32, no sampling), so the drafter learns what the target says;
4. drafter: kdtree.drafter.BlockDrafter on those continuations: for random anchors in the
   generated part, context features = the target's hidden states at the chosen layers
   before the anchor, block = [token at the anchor, mask x (block_size - 1)], labels = the
   next block_size - 1 tokens; its embedding starts from the target's;
5. evaluation: the drafter's per-position top-1 agreement with the target's greedy
   continuation on held-out prompts; model card ``README.md`` and ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

EOS = "<|endoftext|>"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and few steps, to check the script")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--target-steps", type=int, default=3000)
    p.add_argument("--drafter-steps", type=int, default=3000)
    return p.parse_args(argv)


def sizes(args):
    if args.smoke:
        return dict(vocab=384, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, inter=128, seq=64, batch=8,
                    target_steps=30, lr=3e-3, prompt=16, gen=24, n_prompts=32, held_prompts=8, d_hidden=64,
                    d_layers=1, d_heads=2, d_head_dim=32, d_inter=128, block=6, feature_layers=(1, 2),
                    drafter_steps=30, d_batch=8, anchors=4, d_lr=1e-3, gen_batch=16)
    return dict(vocab=args.vocab, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, inter=768, seq=512,
                batch=32, target_steps=args.target_steps, lr=3e-3, prompt=64, gen=192, n_prompts=4096,
                held_prompts=256, d_hidden=256, d_layers=2, d_heads=4, d_head_dim=64, d_inter=768, block=16,
                feature_layers=(1, 2, 3, 4), drafter_steps=args.drafter_steps, d_batch=32, anchors=8, d_lr=1e-3,
                gen_batch=512)


def split_files():
    from kdtree.ngram import stdlib_dir, stdlib_sources

    files = stdlib_sources()
    texts, held = [], []
    for i, f in enumerate(files):
        try:
            t = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        (held if i % 20 == 7 else texts).append(t)
    return texts, held, len(files), str(stdlib_dir())


def train_tokenizer(texts, vocab, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok


def encode(tok, texts) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int64)


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_loop(torch, model, steps, peak_lr, weight_decay, loss_fn, name, log):
    """AdamW (betas 0.9/0.95), warmup then cosine to 10% (lr_at), gradient clipping at 1;
    bfloat16 autocast on CUDA. loss_fn(step) returns the step's loss. Returns (mean of the
    last 100 losses, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    use_amp = next(model.parameters()).device.type == "cuda"
    losses = []
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, max(1, steps // 30))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"{name} step {step:5d}  loss {np.mean(losses[-50:]):.3f}  ({time.time() - t0:.0f} s)")
    return float(np.mean(losses[-100:])), time.time() - t0


def train_target(torch, cfg_kw, ids, s, device, log):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**cfg_kw)
    model = Qwen3ForCausalLM(cfg).to(device)
    data = torch.as_tensor(ids, device=device)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def loss_fn(step):
        starts = torch.randint(0, len(ids) - s["seq"] - 1, (s["batch"],), generator=gen)
        x = torch.stack([data[i:i + s["seq"] + 1] for i in starts.tolist()])
        return model(input_ids=x, labels=x).loss  # labels are shifted inside

    loss, seconds = train_loop(torch, model, s["target_steps"], s["lr"], 0.1, loss_fn, "target", log)
    return model, loss, seconds


def perplexity(torch, model, ids, seq, device):
    data = torch.as_tensor(ids, device=device)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - seq - 1, seq):
            x = data[i:i + seq + 1][None]
            logits = model(input_ids=x[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum"))
            count += seq
    return math.exp(total / max(1, count)), count


def greedy_continuations(torch, model, ids, n, prompt, gen, batch, device, seed):
    """n prompts of `prompt` tokens cut at random from ids, each continued greedily by the
    target for `gen` tokens (argmax, ties to the lower id): int64 [n, prompt + gen]."""
    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - prompt, n)
    out = []
    with torch.no_grad():
        for b0 in range(0, n, batch):
            x = torch.as_tensor(np.stack([ids[s:s + prompt] for s in starts[b0:b0 + batch]]), device=device)
            res = model(input_ids=x, use_cache=True)
            cache = res.past_key_values
            seqs = [x]
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            for step in range(gen):
                seqs.append(nxt)
                if step + 1 == gen:
                    break
                pos = torch.full_like(nxt, prompt + step)
                res = model(input_ids=nxt, position_ids=pos, use_cache=True, **{cache_kw: cache})
                cache = res.past_key_values
                nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(torch.cat(seqs, dim=1).cpu())
    return torch.cat(out).numpy()


def target_features(torch, model, seqs, layers):
    out = model(input_ids=seqs, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)


def drafter_batch(torch, target, seqs, s, gen, device):
    """Random anchors in the generated part of each sequence: features, valid mask, bonus,
    start, labels."""
    b, t_all = seqs.shape
    depth = s["block"] - 1
    with torch.no_grad():
        feats = target_features(torch, target, seqs, s["feature_layers"]).float()
    lo, hi = s["prompt"] - 1, t_all - depth - 1
    p = torch.randint(lo, hi + 1, (b, s["anchors"]), generator=gen).to(device)
    item = torch.arange(b, device=device)[:, None].expand(b, s["anchors"]).reshape(-1)
    p = p.reshape(-1)
    valid = torch.arange(t_all, device=device)[None, :] < p[:, None]
    bonus = seqs[item, p]
    labels = seqs[item[:, None], p[:, None] + torch.arange(1, depth + 1, device=device)[None, :]]
    return feats[item], valid, bonus, p, labels


def train_drafter(torch, target, seqs, s, device, log):
    from kdtree.drafter import BlockDrafter, BlockDrafterConfig

    cfg = BlockDrafterConfig(vocab_size=target.config.vocab_size,
                             feature_size=len(s["feature_layers"]) * target.config.hidden_size,
                             target_layers=s["feature_layers"], hidden_size=s["d_hidden"], num_layers=s["d_layers"],
                             num_heads=s["d_heads"], head_dim=s["d_head_dim"], intermediate_size=s["d_inter"],
                             block_size=s["block"])
    drafter = BlockDrafter(cfg).to(device)
    with torch.no_grad():
        if drafter.embed.weight.shape == target.model.embed_tokens.weight.shape:
            drafter.embed.weight.copy_(target.model.embed_tokens.weight.float())
    data = torch.as_tensor(seqs, device=device)
    gen = torch.Generator(device="cpu").manual_seed(2)

    def loss_fn(step):
        rows = torch.randint(0, data.shape[0], (s["d_batch"],), generator=gen).to(device)
        feats, valid, bonus, start, labels = drafter_batch(torch, target, data[rows], s, gen, device)
        logits = drafter(feats, valid, bonus, start)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    loss, seconds = train_loop(torch, drafter, s["drafter_steps"], s["d_lr"], 0.0, loss_fn, "drafter", log)
    return drafter, loss, seconds


def drafter_agreement(torch, target, drafter, seqs, s, device):
    """Per drafted position, the fraction of anchors where the drafter's top-1 equals the
    target's greedy token."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    hits = np.zeros(s["block"] - 1)
    count = 0
    data = torch.as_tensor(seqs, device=device)
    with torch.no_grad():
        for b0 in range(0, data.shape[0], s["d_batch"]):
            feats, valid, bonus, start, labels = drafter_batch(torch, target, data[b0:b0 + s["d_batch"]], s, gen,
                                                               device)
            top = drafter(feats, valid, bonus, start).argmax(-1)
            hits += (top == labels).float().sum(0).cpu().numpy()
            count += labels.shape[0]
    return (hits / count).tolist(), count


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from kdtree.drafter import load_drafter, save_drafter

    torch.manual_seed(args.seed)
    s = sizes(args)
    out = args.out
    (out / "target").mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    t_start = time.time()
    texts, held, n_files, stdlib = split_files()
    log(f"corpus: {len(texts)} training files, {len(held)} held out, {sum(map(len, texts)) / 1e6:.1f} M chars "
        f"({stdlib}, Python {platform.python_version()})")
    tok = train_tokenizer(texts, s["vocab"], out / "tokenizer.json")
    train_ids, held_ids = encode(tok, texts), encode(tok, held)
    vocab = tok.get_vocab_size()
    log(f"tokenizer: byte-level BPE, vocab {vocab}; {len(train_ids)} training tokens, {len(held_ids)} held out")

    target_kw = dict(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["inter"],
                     num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                     head_dim=s["head_dim"], max_position_embeddings=4096, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0, rope_theta=10000.0)
    target, target_loss, target_time = train_target(torch, target_kw, train_ids, s, args.device, log)
    # The longest context the pair was trained on (the drafter's sequences are the shorter):
    # kdtree generate notes when a prompt plus new tokens go beyond it.
    target.config.kdtree_trained_window = min(s["seq"], s["prompt"] + s["gen"])
    target.to(torch.bfloat16).save_pretrained(str(out / "target"))
    # Everything below uses the saved (bfloat16) weights, in float32.
    from kdtree.hf import load_causal_lm

    target = load_causal_lm(out / "target", device=args.device, dtype="float32")
    n_params = sum(p.numel() for p in target.parameters())
    ppl, ppl_tokens = perplexity(torch, target, held_ids, s["seq"], args.device)
    log(f"target: {n_params / 1e6:.2f} M parameters, final training loss {target_loss:.3f}, held-out perplexity "
        f"{ppl:.2f} over {ppl_tokens} tokens ({target_time:.0f} s)")

    seqs = greedy_continuations(torch, target, train_ids, s["n_prompts"], s["prompt"], s["gen"], s["gen_batch"],
                                args.device, seed=10)
    held_seqs = greedy_continuations(torch, target, held_ids, s["held_prompts"], s["prompt"], s["gen"],
                                     s["gen_batch"], args.device, seed=11)
    log(f"drafter data: {len(seqs)} training and {len(held_seqs)} held-out greedy continuations of "
        f"{s['gen']} tokens after {s['prompt']}-token prompts")
    drafter, drafter_loss, drafter_time = train_drafter(torch, target, seqs, s, args.device, log)
    drafter.eval()
    save_drafter(drafter, out / "drafter")
    drafter = load_drafter(out / "drafter", device=args.device)
    d_params = sum(p.numel() for p in drafter.parameters())
    agree, anchors = drafter_agreement(torch, target, drafter, held_seqs, s, args.device)
    log(f"drafter: {d_params / 1e6:.2f} M parameters, final training loss {drafter_loss:.3f} ({drafter_time:.0f} s)")
    log("drafter top-1 agreement with the target's greedy token, held-out, by position: "
        + " ".join(f"{a:.2f}" for a in agree))

    record = dict(command=" ".join(sys.argv), device=args.device,
                  device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
                  python=platform.python_version(), torch=torch.__version__,
                  transformers=__import__("transformers").__version__, stdlib=stdlib, files=n_files,
                  train_files=len(texts), held_files=len(held), train_tokens=int(len(train_ids)),
                  held_tokens=int(len(held_ids)), sizes={k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                  target_params=n_params, target_final_loss=target_loss, held_out_perplexity=ppl,
                  drafter_params=d_params, drafter_final_loss=drafter_loss, drafter_agreement=agree,
                  agreement_anchors=anchors, seconds=time.time() - t_start, log=lines)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_card(out, record)
    log(f"done in {time.time() - t_start:.0f} s: {out}")
    return 0


def write_card(out: Path, r: dict) -> None:
    s = r["sizes"]
    agree = " | ".join(f"{a:.2f}" for a in r["drafter_agreement"])
    heads = " | ".join(str(i + 1) for i in range(len(r["drafter_agreement"])))
    text = f"""# stdlib-qwen3: the demo target and drafter

Trained by `tools/train_models.py` ({r['command']}) on {r['device_name']} ({r['device']}),
Python {r['python']}, torch {r['torch']}, transformers {r['transformers']}; {r['seconds']:.0f} s in all.

## Corpus
The Python {r['python']} standard library's `.py` files on that machine ({r['stdlib']}),
tests and generated data excluded: {r['files']} files, every 20th (by sorted path) held out:
{r['train_files']} training files ({r['train_tokens']} tokens), {r['held_files']} held out
({r['held_tokens']} tokens). Files are separated by `<|endoftext|>` (token 0).

## Tokenizer (`tokenizer.json`)
Byte-level BPE (the `tokenizers` library), vocabulary {s['vocab']} including `<|endoftext|>`.

## Target (`target/`, bfloat16 safetensors)
Qwen3ForCausalLM: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} query / {s['kv_heads']} KV heads of
{s['head_dim']}, MLP {s['inter']}, tied embeddings; {r['target_params'] / 1e6:.2f} M parameters. Trained from
scratch: {s['target_steps']} AdamW steps of {s['batch']} x {s['seq']} tokens, peak learning rate {s['lr']},
cosine schedule. Final training loss {r['target_final_loss']:.3f}; **held-out perplexity
{r['held_out_perplexity']:.2f}** (saved weights, float32, {s['seq']}-token windows).

## Drafter (`drafter/`, float32 safetensors, `kdtree.drafter.BlockDrafter`)
DFlash-style block drafter: features = the target's hidden states at layers
{list(s['feature_layers'])} (0 = embeddings), injected as keys/values in each of its {s['d_layers']} layers
(hidden {s['d_hidden']}, {s['d_heads']} heads of {s['d_head_dim']}, MLP {s['d_inter']}); block size {s['block']}
(bonus + {s['block'] - 1} drafted positions); {r['drafter_params'] / 1e6:.2f} M parameters. Trained on the
target's own greedy continuations ({s['n_prompts']} prompts of {s['prompt']} tokens cut from training files,
{s['gen']} generated tokens each): {s['drafter_steps']} AdamW steps of {s['d_batch']} sequences x {s['anchors']}
random anchors in the generated part; final training loss {r['drafter_final_loss']:.3f}.

Context lengths: the target saw {s['seq']}-token windows, the drafter {s['prompt'] + s['gen']}-token sequences;
`target/config.json` records the shorter as `kdtree_trained_window`.

Per-position top-1 agreement with the target's greedy token ({r['agreement_anchors']} anchors in
continuations of held-out prompts):

| position | {heads} |
|---|{'---|' * len(r['drafter_agreement'])}
| top-1 agreement | {agree} |
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
