#!/usr/bin/env python3
"""Train the demo pair shipped in fixtures/models/: a byte-level BPE tokenizer, a small
Qwen3 target and a DFlash drafter in the published format, on Python sources no one here
wrote: the standard library and the permissively licensed packages installed on the
machine (MIT, BSD, Apache, PSF, ISC; each listed with its licence in the model card).
Whole files are held out (every 20th by sorted path); kdtree's own sources never enter.

    python tools/train_models.py --out fixtures/models/stdlib-qwen3 --device cuda
    python tools/train_models.py --out /tmp/smoke --smoke          # a minute on a CPU
    python tools/train_models.py --out DIR --device cuda --stage drafter --stage eval

Stages (``--stage``, repeatable; default all, in this order; each reads what the earlier
ones wrote under ``--out``, so they can run in separate processes, e.g. separate
device calls):
1. ``corpus``: the file list, split and licences (``corpus.json``); the text is not kept;
2. ``tokenizer``: byte-level BPE with ``<|endoftext|>`` (id 0, between files) and
   ``<|mask|>`` (id 1, the drafter's mask token);
3. ``target``: Qwen3ForCausalLM from scratch on ``--seq``-token windows (AdamW, cosine),
   evaluated on held-out windows every ``--eval-every`` steps; the best evaluation's
   weights are kept and saved (bfloat16) — training stops at ``--target-steps`` or when
   ``--target-minutes`` run out (the schedule is sized from the first steps' speed);
4. ``drafter``: a DFlash drafter (:mod:`kdtree.engine.dflash`, hidden size and embedding /
   LM head of the frozen target) on sequences of real held-in text of ``--context`` tokens
   followed by the target's own greedy continuation (the share ``--self-rows`` of each
   batch; the rest fresh windows of real text), the share ``--self-anchors`` of their
   anchors in the continuation and the rest anywhere; the labels of a block are the target's teacher-forced argmax
   at each of its positions (what greedy verification accepts); kept at its best held-out evaluation; saved in the published format;
5. ``eval``: held-out perplexity, the drafter's per-position top-1 agreement, acceptance
   length of kdtree's batched engine at N = 16 / 64 / 256 on held-out prompts of
   ``--context`` tokens (greedy, outputs checked equal to the target's own), the repeated
   8-token-window share of the continuations, samples; ``training.json`` and the model
   card ``README.md``;
6. ``repeats``: the repeated-window share of the target's sampled continuations of the
   same held-out prompts (``--sample-temperature``, ``--sample-top-p``; kdtree's
   :class:`kdtree.hf.HFTarget` autoregressive sampling, seed i for prompt i: what
   ``kdtree generate --seed i`` would print), alongside the greedy share of ``eval``.
   Light enough for a CPU.

Every stage records its command, sizes and machine (``stage_commands``, ``stage_sizes``,
``stage_envs``); the top-level ``command``, ``sizes`` and machine fields are those of the
latest run that trained something (the card's header).
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as metadata
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

EOS, MASK = "<|endoftext|>", "<|mask|>"
STAGES = ("corpus", "tokenizer", "target", "drafter", "eval", "repeats")
TRAINING = ("corpus", "tokenizer", "target", "drafter")  # stages whose run describes the pair's training
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC|Zlib|Unlicense|0BSD|HPND)\b", re.I)
COPYLEFT = re.compile(r"\b(GPL|LGPL|AGPL|MPL|EPL|CDDL|copyleft)\b", re.I)
MAX_FILE_CHARS = 400_000  # larger .py files are mostly generated tables


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and few steps, to check the script")
    p.add_argument("--stage", action="append", choices=STAGES, help="stages to run (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--corpus-mb", type=float, default=300.0, help="most characters of text (millions)")
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=640, help="target training window (tokens)")
    p.add_argument("--target-steps", type=int, default=20000)
    p.add_argument("--target-minutes", type=float, default=8.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--drafter-layers", type=int, default=2)
    p.add_argument("--block", type=int, default=16, help="drafter block size (bonus + drafted positions)")
    p.add_argument("--context", type=int, default=512, help="real-text tokens before each drafter continuation")
    p.add_argument("--loss-decay-gamma", type=float, default=7.0,
                   help="drafter loss weight exp(-(k-1)/gamma) at block position k (DFlash: 7 for blocks of 16, "
                        "5 for 10, 4 for 8); 0: equal weights")
    p.add_argument("--self-rows", type=float, default=0.5,
                   help="share of each drafter batch's sequences that end in the target's own greedy continuation "
                        "(the rest: fresh windows of real text)")
    p.add_argument("--self-anchors", type=float, default=0.5,
                   help="share of the anchors of those sequences placed in the continuation (the rest anywhere)")
    p.add_argument("--drafter-steps", type=int, default=20000)
    p.add_argument("--drafter-minutes", type=float, default=8.0)
    p.add_argument("--drafter-lr", type=float, default=1e-3, help="the drafter's peak learning rate (AdamW)")
    p.add_argument("--drafter-init", type=Path, default=None,
                   help="drafter stage: start from this DFlash drafter folder (same shape) instead of random weights, "
                        "e.g. the pair's own drafter/ to continue training it")
    p.add_argument("--sample-temperature", type=float, default=0.7, help="repeats stage: sampling temperature")
    p.add_argument("--sample-top-p", type=float, default=0.95, help="repeats stage: sampling nucleus")
    p.add_argument("--compare", type=Path, help="an older pair's folder: the eval stage compares the two targets "
                   "on held-out standard-library text, per character")
    args = p.parse_args(argv)
    for name, lo, hi in (("vocab", 260, 1 << 20), ("hidden", 64, 1 << 14), ("layers", 3, 256), ("seq", 32, 1 << 16),
                         ("target_steps", 1, 1 << 30), ("eval_every", 1, 1 << 30), ("drafter_layers", 1, 64),
                         ("block", 2, 1024), ("context", 16, 1 << 16), ("drafter_steps", 1, 1 << 30)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            p.error(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {v}")
    for name in ("corpus_mb", "target_minutes", "drafter_minutes", "drafter_lr"):
        if not 0 < getattr(args, name) < float("inf"):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if not 1e-6 <= args.sample_temperature <= 100 or not 0 < args.sample_top_p <= 1:
        p.error(f"--sample-temperature must be in [1e-6, 100] and --sample-top-p in (0, 1], got "
                f"{args.sample_temperature} and {args.sample_top_p}")
    for name in ("self_rows", "self_anchors"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if not 0 <= args.loss_decay_gamma < float("inf"):
        p.error(f"--loss-decay-gamma must be >= 0 (0: equal weights), got {args.loss_decay_gamma}")
    if args.smoke and any(getattr(args, k) != p.get_default(k) for k in ("vocab", "hidden", "layers", "seq", "block",
                                                                      "context", "target_minutes", "drafter_minutes")):
        p.error("--smoke fixes the sizes and times: leave --vocab, --hidden, --layers, --seq, --block, --context "
                "and the minutes out")
    # each stage reads what the earlier ones wrote: those files exist or an earlier stage runs
    stages = args.stage or list(STAGES)
    needs = {"tokenizer": ("corpus", "corpus.json"), "target": ("tokenizer", "tokenizer.json"),
             "drafter": ("target", "target/config.json"), "eval": ("drafter", "drafter/config.json"),
             "repeats": ("target", "target/config.json")}
    for st in stages:
        if st in needs:
            before, path = needs[st]
            if before not in stages and not (args.out / path).is_file():
                p.error(f"--stage {st} reads {args.out / path}, which is not there: run --stage {before} first "
                        f"(or point --out at a pair that has it)")
    if args.drafter_init is not None and not (args.drafter_init / "config.json").is_file():
        p.error(f"--drafter-init {args.drafter_init}: no config.json there (a DFlash drafter folder)")
    if (args.drafter_init is not None and "target" in stages
            and (args.out / "drafter").resolve() in [args.drafter_init.resolve(), *args.drafter_init.resolve().parents]):
        p.error(f"--drafter-init {args.drafter_init}: a new target (--stage target) replaces this folder's drafter; "
                f"continue from a copy, or train the drafter anew")
    if args.compare is not None and "eval" in stages:
        tok = [q for q in (args.compare / "tokenizer.json", args.compare / "target" / "tokenizer.json") if q.is_file()]
        if not tok or not (args.compare / "target" / "config.json").is_file():
            p.error(f"--compare {args.compare}: needs target/config.json and tokenizer.json (an older pair's folder)")
    return args


def sizes(args):
    if args.smoke:
        return dict(vocab=384, hidden=64, layers=3, heads=2, kv_heads=1, head_dim=32, inter=128, seq=96, batch=8,
                    target_steps=40, target_minutes=2.0, eval_every=10, lr=3e-3, eval_windows=8, context=48, gen=24,
                    n_seqs=48, held_seqs=8, d_layers=1, block=6, d_batch=8, anchors=4, drafter_steps=30,
                    drafter_minutes=2.0, d_lr=args.drafter_lr, gen_batch=16, corpus_chars=3e6, accept_prompts=2,
                    accept_new=24, budgets=(4, 16), loss_decay_gamma=args.loss_decay_gamma,
                    self_rows=args.self_rows, self_anchors=args.self_anchors)
    heads = max(1, args.hidden // 64)
    return dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=heads,
                kv_heads=heads // 2 if heads % 2 == 0 else heads,
                head_dim=64, inter=3 * args.hidden, seq=args.seq, batch=64, target_steps=args.target_steps,
                target_minutes=args.target_minutes, eval_every=args.eval_every, lr=2e-3, eval_windows=256,
                context=args.context, gen=128, n_seqs=16384, held_seqs=256, d_layers=args.drafter_layers,
                block=args.block, d_batch=16, anchors=128, drafter_steps=args.drafter_steps,
                drafter_minutes=args.drafter_minutes, d_lr=args.drafter_lr, gen_batch=512,
                corpus_chars=args.corpus_mb * 1e6,
                accept_prompts=64, accept_new=128, budgets=(16, 64, 256), loss_decay_gamma=args.loss_decay_gamma,
                self_rows=args.self_rows, self_anchors=args.self_anchors)


# ---- corpus ------------------------------------------------------------------------------

def licence_of(dist) -> str:
    m = dist.metadata
    expr = m.get("License-Expression") or ""
    text = (m.get("License") or "").strip().splitlines()[0][:80] if m.get("License") else ""
    classifiers = [c.split("::")[-1].strip() for c in (m.get_all("Classifier") or []) if c.startswith("License ::")]
    return expr or ("; ".join(classifiers) if classifiers else text)


def collect_corpus(max_chars: float) -> dict:
    """Files (sorted by source then path), each with its source and licence; every 20th held
    out. Packages whose licence is not clearly permissive are skipped (listed)."""
    from kdtree.engine.ngram import stdlib_dir, stdlib_sources

    kdtree_dir = (ROOT / "python" / "kdtree").resolve()
    sources = [("python-stdlib", "PSF-2.0", [str(f) for f in stdlib_sources()], platform.python_version())]
    skipped = []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower()):
        name = dist.metadata.get("Name") or "?"
        lic = licence_of(dist)
        files = [f for f in (dist.files or []) if f.suffix == ".py"]
        if not files or name.lower() == "kdtree":
            continue
        if not PERMISSIVE.search(lic) or COPYLEFT.search(lic):
            skipped.append({"package": name, "licence": lic or "(none given)"})
            continue
        paths = []
        for f in files:
            parts = {p.lower() for p in f.parts}
            if parts & {"test", "tests", "testing", "_vendor", "vendor"}:
                continue
            full = Path(dist.locate_file(f)).resolve()
            if full.is_file() and kdtree_dir not in full.parents:
                paths.append(str(full))
        if paths:
            sources.append((name, lic, sorted(paths), dist.version))
    files, total = [], 0
    version_of = {name: version for name, _, _, version in sources}
    for name, lic, paths, _ in sources:
        for p in paths:
            try:
                n = Path(p).stat().st_size
            except OSError:
                continue
            if n > MAX_FILE_CHARS or n == 0:
                continue
            if total + n > max_chars:
                break
            files.append({"path": p, "source": name, "licence": lic})
            total += n
        if total + MAX_FILE_CHARS > max_chars and any(f["source"] == name for f in files[-1:]):
            break  # the cap is reached: no later source adds its small files
    for i, f in enumerate(files):
        f["held_out"] = i % 20 == 7
    packages = {}
    for f in files:
        e = packages.setdefault(f["source"], {"licence": f["licence"], "version": version_of[f["source"]], "files": 0})
        e["files"] += 1
    return {"files": files, "packages": packages, "skipped": skipped, "stdlib": str(stdlib_dir())}


def read_texts(corpus: dict) -> tuple[list[str], list[str]]:
    train, held = [], []
    for f in corpus["files"]:
        try:
            t = Path(f["path"]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        (held if f["held_out"] else train).append(t)
    return train, held


# ---- tokenizer and data ------------------------------------------------------------------

def train_tokenizer(texts, vocab, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, MASK], show_progress=False,
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


# ---- training ----------------------------------------------------------------------------

def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_loop(torch, model, max_steps, minutes, peak_lr, weight_decay, loss_fn, evaluate, eval_every, name, log,
               on_best=None):
    """AdamW (betas 0.9/0.95), warmup then cosine to 10%, gradient clipping at 1, bfloat16
    autocast on CUDA. The schedule's length is ``max_steps``, or fewer when steps 10-40's
    speed and one evaluation's time (at step 40) say ``minutes`` would run out. ``evaluate()`` (held-out loss) runs every
    ``eval_every`` steps and at the end; the best evaluation's weights are restored.
    ``on_best(step, held_loss, seconds, schedule_steps)``, if given, runs at each new best (to save a
    checkpoint that survives the process being stopped).
    Returns (steps run, best held-out loss, its step, seconds)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    use_amp = next(model.parameters()).device.type == "cuda"
    total, losses, t0 = max_steps, [], time.time()
    best, best_step, best_state = float("inf"), -1, None
    step = 0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, peak_lr, max(1, total // 30))
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step == 10:
            t10 = time.time()
        if step == 40:
            per = (time.time() - t10) / 30
        if step % eval_every == 0 or step == total or step == 40:
            model.eval()
            te = time.time()
            with torch.no_grad():
                held = evaluate()
            te = time.time() - te
            if step == 40:  # size the schedule to the time budget: steps timed after the first
                # steps' warm-up, and an evaluation every eval_every steps
                total = max(40, min(max_steps, int((minutes * 60 - (time.time() - t0)) / (per + te / eval_every))
                                    + 40))
                log(f"{name}: {per * 1e3:.0f} ms a step, {te:.1f} s an evaluation: {total} steps")
            if held < best:
                best, best_step = held, step
                best_state = copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})
            log(f"{name} step {step:6d}  loss {np.mean(losses[-50:]):.3f}  held-out {held:.3f}"
                f"{'  (best)' if best_step == step else ''}  ({time.time() - t0:.0f} s)")
            if best_step == step and on_best is not None:  # after the log line, which the record then holds
                on_best(step, held, time.time() - t0, total)
    model.load_state_dict(best_state)
    model.eval()
    return step, best, best_step, time.time() - t0


def windows(data, starts, seq):
    import torch

    return torch.stack([data[i:i + seq + 1] for i in starts])


def write_record(path: Path, rec: dict) -> None:
    """training.json, replaced whole (a run stopped mid-write leaves the old record)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    os.replace(tmp, path)


EVAL_FIELDS = ("held_out_perplexity", "perplexity_tokens", "drafter_agreement", "agreement_anchors", "acceptance",
               "repeated_share_mean", "repeated_share_max", "samples", "sampled_repeats")
# measured on the target alone, by an eval stage given --compare: a new drafter keeps it
TARGET_EVAL_FIELDS = ("compare",)
DRAFTER_FIELDS = ("drafter_steps_run", "drafter_best_step", "drafter_best_held_loss", "drafter_seconds",
                  "drafter_schedule_steps", "drafter_params", "drafter_target_layer_ids", "drafter_init")


def forget_downstream(out: Path, rec: dict, stage: str) -> list[str]:
    """Before ``stage`` (target or drafter) trains anew, remove what was measured on (and,
    for a new target, trained against) the weights it replaces: the evaluation's fields, the
    model card and, for a new target, the comparison with an older target, the drafter
    folder and its fields, so that a run
    stopped midway never leaves a new model beside an old one's numbers or partner.
    Returns what was removed (for the log)."""
    gone = [k for k in EVAL_FIELDS if rec.pop(k, None) is not None]
    stages = ["eval", "repeats"]
    if stage == "target":
        gone += [k for k in TARGET_EVAL_FIELDS + DRAFTER_FIELDS if rec.pop(k, None) is not None]
        stages.append("drafter")
        if (out / "drafter").is_dir():
            shutil.rmtree(out / "drafter")
            gone.append("drafter/")
    for key in ("stage_seconds", "stage_commands", "stage_sizes", "stage_envs"):
        for st in stages:
            (rec.get(key) or {}).pop(st, None)
    if (out / "README.md").is_file():
        (out / "README.md").unlink()
        gone.append("README.md")
    return gone


def stage_target(torch, args, s, out, log, rec):
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    gone = forget_downstream(out, rec, "target")
    if gone:
        log(f"target: a new target; removed what belonged to the old one: {', '.join(gone)}")
        write_record(out / "training.json", rec)  # at once: a run stopped from here on leaves a true record
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    corpus = json.loads((out / "corpus.json").read_text())
    train_texts, held_texts = read_texts(corpus)
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    vocab = tok.get_vocab_size()
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      head_dim=s["head_dim"], max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, rope_theta=10000.0)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg).to(args.device)
    data = torch.as_tensor(train_ids, device=args.device)
    held = torch.as_tensor(held_ids, device=args.device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    rng = np.random.default_rng(5)
    held_starts = rng.integers(0, len(held_ids) - s["seq"] - 1, s["eval_windows"]).tolist()

    def loss_fn(step):
        starts = torch.randint(0, len(train_ids) - s["seq"] - 1, (s["batch"],), generator=gen).tolist()
        x = windows(data, starts, s["seq"])
        return model(input_ids=x, labels=x).loss

    def evaluate():
        tot = 0.0
        for b0 in range(0, len(held_starts), s["batch"]):
            x = windows(held, held_starts[b0:b0 + s["batch"]], s["seq"])
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
                tot += float(model(input_ids=x, labels=x).loss) * x.shape[0]
        return tot / len(held_starts)

    steps, best, best_step, secs = train_loop(torch, model, s["target_steps"], s["target_minutes"], s["lr"], 0.1,
                                              loss_fn, evaluate, s["eval_every"], "target", log)
    model.config.kdtree_trained_window = s["seq"]
    model.to(torch.bfloat16).save_pretrained(str(out / "target"))
    tok.save(str(out / "target" / "tokenizer.json"))  # a Hugging Face folder carries its tokenizer
    rec.update(train_tokens=int(len(train_ids)), held_tokens=int(len(held_ids)), target_steps_run=steps,
               target_best_step=best_step, target_best_held_loss=best, target_seconds=secs,
               target_params=sum(p.numel() for p in model.parameters()))
    log(f"target: {rec['target_params'] / 1e6:.2f} M parameters, best held-out loss {best:.3f} at step {best_step} "
        f"of {steps} ({secs:.0f} s)")


def greedy_continuations(torch, model, prompts, gen, batch):
    """Each prompt (equal lengths, int64 [n, P]) continued greedily by ``model`` for ``gen``
    tokens (argmax, ties to the lower id): int64 [n, P + gen]."""
    out = []
    with torch.no_grad():
        for b0 in range(0, prompts.shape[0], batch):
            x = prompts[b0:b0 + batch]
            res = model.generate(x, max_new_tokens=gen, min_new_tokens=gen, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
            out.append(res[:, : x.shape[1] + gen])
    return torch.cat(out)


def drafter_sequences(torch, target, ids, n, s, seed):
    """n sequences of ``context`` real tokens (cut at random from ids) followed by the
    target's greedy continuation of ``gen`` tokens."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - s["context"], n)
    dev = next(target.parameters()).device
    prompts = torch.as_tensor(np.stack([ids[a:a + s["context"]] for a in starts]), device=dev)
    return greedy_continuations(torch, target, prompts, s["gen"], s["gen_batch"])


def drafter_batch(torch, target, drafter, seqs, s, gen, n_self_rows=None):
    """Anchors in the real text (anywhere a block fits after at least 8 tokens) and in the
    target's own continuation (from ``context`` on): the first ``n_self_rows`` rows (all by
    default) are sequences ending in the continuation and place the share ``self_anchors``
    of their anchors there; the other rows are real text, anchored anywhere. Returns
    features ``[b, T, F]``, starts and roots ``[b, A]``, labels ``[b, A, depth]`` (the
    inputs of the drafter's ``forward_blocks``). The label of the token j after an anchor
    is the target's argmax at the token before it (teacher-forced, from the same forward
    as the features): what verification accepts, rather than the text itself."""
    b, t_all = seqs.shape
    depth = s["block"] - 1
    dev = seqs.device
    with torch.no_grad():
        res = target(input_ids=seqs, output_hidden_states=True)
        feats = torch.cat([res.hidden_states[i] for i in drafter.feature_layers], dim=-1)
        choice = res.logits.argmax(-1)  # [b, t_all]: the target's next token after each position
    n_self_rows = b if n_self_rows is None else n_self_rows
    a = s["anchors"]
    n_self = int(round(a * s.get("self_anchors", 0.5)))
    anywhere = torch.randint(8, t_all - depth, (b, a), generator=gen)
    cont = torch.randint(min(s["context"], t_all - depth - 1), t_all - depth, (b, a), generator=gen)
    in_cont = (torch.arange(a)[None, :] < n_self) & (torch.arange(b)[:, None] < n_self_rows)
    p = torch.where(in_cont, cont, anywhere).to(dev)  # [b, A]
    labels = torch.gather(choice, 1, (p[:, :, None] + torch.arange(depth, device=dev)).reshape(b, -1))
    return feats, p, torch.gather(seqs, 1, p), labels.reshape(b, -1, depth)


def feature_layer_ids(n_layers: int) -> list[int]:
    """Up to four target layers spread from the second to the second-to-last (0-based)."""
    k = max(1, min(4, n_layers - 2))
    return sorted({int(round(x)) for x in np.linspace(1, max(1, n_layers - 2), k)})


def load_target(out: Path, device: str):
    from kdtree.engine.hf import load_causal_lm

    target = load_causal_lm(out / "target", device=device, dtype="float32")
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def stage_drafter(torch, args, s, out, log, rec):
    from tokenizers import Tokenizer

    from kdtree.engine import dflash

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    corpus = json.loads((out / "corpus.json").read_text())
    train_texts, held_texts = read_texts(corpus)
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    target = load_target(out, args.device)
    tc = target.config
    cfg = dflash.dflash_config(dict(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=s["d_layers"], num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim, max_position_embeddings=4096,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=10000.0, block_size=s["block"],
        num_target_layers=tc.num_hidden_layers,
        dflash_config={"mask_token_id": tok.token_to_id(MASK),
                       "target_layer_ids": feature_layer_ids(tc.num_hidden_layers)}))
    torch.manual_seed(args.seed + 1)
    drafter = dflash.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).to(args.device)
    before = {}
    if args.drafter_init is not None:
        # continue from an earlier drafter of the same shape (e.g. this pair's own, over
        # several device calls); with --seed k > 0 the continuation sees other data
        init = dflash.load_dflash(args.drafter_init, target, dtype="float32")
        mine, theirs = drafter.state_dict(), init.state_dict()
        bad = sorted(k for k in set(mine) | set(theirs) if k not in mine or k not in theirs
                     or mine[k].shape != theirs[k].shape)
        if bad:
            raise SystemExit(f"--drafter-init {args.drafter_init}: not this drafter's shape (--drafter-layers, "
                             f"--block, the target): {bad[:4]}")
        drafter.load_state_dict(theirs)
        same = Path(args.drafter_init).resolve() == (out / "drafter").resolve()
        earlier = rec.get("drafter_init") or {}
        before = {"from": str(args.drafter_init),
                  "steps": (rec.get("drafter_steps_run", 0) + (earlier.get("steps") or 0) if same else None),
                  # the earlier runs of this folder's drafter, oldest first: how to redo the chain
                  "runs": (earlier.get("runs", []) + [{"command": rec.get("stage_commands", {}).get("drafter"),
                                                       "steps": rec.get("drafter_steps_run")}]) if same else []}
        log(f"drafter: continuing from {args.drafter_init}"
            + (f" ({before['steps']} steps so far)" if before["steps"] is not None else ""))
    gone = forget_downstream(out, rec, "drafter")
    if gone:
        log(f"drafter: a new drafter; removed the old one's evaluation: {', '.join(gone)}")
        write_record(out / "training.json", rec)
    t0 = time.time()
    seqs = drafter_sequences(torch, target, train_ids, s["n_seqs"], s, seed=10 + 1000 * args.seed)
    held = drafter_sequences(torch, target, held_ids, s["held_seqs"], s, seed=11)
    log(f"drafter data: {len(seqs)} training and {len(held)} held-out sequences of {s['context']} real tokens + "
        f"{s['gen']} of the target's greedy continuation ({time.time() - t0:.0f} s)")
    gen = torch.Generator(device="cpu").manual_seed(2 + args.seed)
    hgen_seed = 3

    # position k of a block weighs exp(-(k - 1) / gamma) (DFlash's decay: a draft token
    # counts only if every earlier one is accepted); gamma 0: equal weights
    depth = s["block"] - 1
    k = torch.arange(depth, dtype=torch.float32, device=args.device)
    weight = torch.exp(-k / args.loss_decay_gamma) if args.loss_decay_gamma > 0 else torch.ones_like(k)
    weight = weight / weight.sum()

    def loss_of(batch):
        feats, starts, roots, labels = batch
        logits = drafter.forward_blocks(feats, starts, roots)
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               reduction="none").reshape(-1, depth)
        return (ce.mean(0) * weight).sum()

    train_data = torch.as_tensor(train_ids, device=seqs.device)

    def loss_fn(step):
        # the share self_rows of the batch: sequences ending in the target's continuation;
        # the rest: fresh windows of real text (labels are the target's argmax either way,
        # so real text never runs out)
        n_self = int(round(s["d_batch"] * s.get("self_rows", 0.5)))
        rows = torch.randint(0, seqs.shape[0], (n_self,), generator=gen).to(seqs.device)
        starts = torch.randint(0, len(train_ids) - seqs.shape[1], (s["d_batch"] - n_self,), generator=gen)
        starts = starts.to(seqs.device)
        fresh = train_data[starts[:, None] + torch.arange(seqs.shape[1], device=seqs.device)[None, :]]
        return loss_of(drafter_batch(torch, target, drafter, torch.cat([seqs[rows], fresh]), s, gen, n_self))

    def evaluate():
        g = torch.Generator(device="cpu").manual_seed(hgen_seed)
        tot, n = 0.0, 0
        for b0 in range(0, held.shape[0], s["d_batch"]):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
                tot += float(loss_of(drafter_batch(torch, target, drafter, held[b0:b0 + s["d_batch"]], s, g)))
            n += 1
        return tot / n

    def record(steps, best, best_step, secs, schedule):
        if before:
            rec["drafter_init"] = before
        else:
            rec.pop("drafter_init", None)
        rec.update(drafter_steps_run=steps, drafter_best_step=best_step, drafter_best_held_loss=best,
                   drafter_seconds=secs, drafter_schedule_steps=schedule,
                   drafter_params=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
                   drafter_target_layer_ids=list(drafter.target_layer_ids))

    def checkpoint(step, held, secs, schedule):
        # the best weights so far, in the published format, and a record that says so: a run
        # stopped from outside (a time limit) still leaves a drafter the eval stage can read
        dflash.save_dflash(copy.deepcopy(drafter).to(torch.bfloat16), out / "drafter")
        record(step, held, step, secs, schedule)
        rec.setdefault("stage_commands", {})["drafter"] = rec["command"]  # the drafter stage set these
        rec.setdefault("stage_sizes", {})["drafter"] = rec["sizes"]
        write_record(out / "training.json", rec)

    steps, best, best_step, secs = train_loop(torch, drafter, s["drafter_steps"], s["drafter_minutes"], s["d_lr"], 0.0,
                                              loss_fn, evaluate, s["eval_every"], "drafter", log, on_best=checkpoint)
    dflash.save_dflash(drafter.to(torch.bfloat16), out / "drafter")
    record(steps, best, best_step, secs, steps)
    log(f"drafter: {rec['drafter_params'] / 1e6:.2f} M parameters (DFlash, published format), best held-out loss "
        f"{best:.3f} at step {best_step} of {steps} ({secs:.0f} s)")


# ---- evaluation --------------------------------------------------------------------------

def perplexity(torch, model, ids, seq):
    dev = next(model.parameters()).device
    data = torch.as_tensor(ids, device=dev)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - seq - 1, seq):
            x = data[i:i + seq + 1][None]
            logits = model(input_ids=x[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum"))
            count += seq
    return math.exp(total / max(1, count)), count


def per_char(torch, model, tok, texts, seq):
    """Held-out loss of ``model`` with its tokenizer ``tok`` in nats a character (the mean
    token loss times tokens per character), so that models with different tokenizers
    compare; and the token count."""
    ids = encode(tok, texts)
    ppl, _ = perplexity(torch, model, ids, seq)
    chars = sum(len(t) + 1 for t in texts)
    return math.log(ppl) * len(ids) / chars, len(ids)


def compare_older(torch, args, out, tok, new_target, log, rec):
    """The older pair's target (``--compare``, a folder with target/ and tokenizer.json) and
    the new one on the same held-out standard-library files, in nats a character, and as a
    perplexity in the older tokenizer's tokens."""
    from tokenizers import Tokenizer

    from kdtree.engine.hf import load_causal_lm

    corpus = json.loads((out / "corpus.json").read_text())
    files = [f for f in corpus["files"] if f["held_out"] and f["source"] == "python-stdlib"]
    _, texts = read_texts({"files": files})
    old_tok_path = next(p for p in (args.compare / "tokenizer.json", args.compare / "target" / "tokenizer.json")
                        if p.is_file())
    old_tok = Tokenizer.from_file(str(old_tok_path))
    old_target = load_causal_lm(args.compare / "target", device=args.device, dtype="float32")
    new_npc, _ = per_char(torch, new_target, tok, texts, 512)
    old_npc, old_n = per_char(torch, old_target, old_tok, texts, 512)
    chars_per_old_token = sum(len(t) + 1 for t in texts) / old_n
    res = {"files": len(texts), "chars": sum(len(t) for t in texts), "new_nats_per_char": new_npc,
           "older_nats_per_char": old_npc,
           "new_perplexity_in_older_tokens": math.exp(new_npc * chars_per_old_token),
           "older_perplexity": math.exp(old_npc * chars_per_old_token), "older": str(args.compare)}
    rec["compare"] = res
    log(f"held-out standard-library files ({len(texts)}): {new_npc:.3f} nats a character against the older "
        f"target's {old_npc:.3f}; perplexity in the older tokenizer's tokens {res['new_perplexity_in_older_tokens']:.1f}"
        f" against {res['older_perplexity']:.1f}")


def stage_eval(torch, args, s, out, log, rec):
    from tokenizers import Tokenizer

    from kdtree.apps.generate import repeated_share
    from kdtree.engine import dflash
    from kdtree.engine.batched import Engine

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    corpus = json.loads((out / "corpus.json").read_text())
    _, held_texts = read_texts(corpus)
    held_ids = encode(tok, held_texts)
    target = load_target(out, args.device)
    drafter = dflash.load_dflash(out / "drafter", target, dtype="float32")
    ppl, n_tok = perplexity(torch, target, held_ids, min(s["seq"], 512))
    log(f"held-out perplexity {ppl:.2f} over {n_tok} tokens (saved weights, float32)")
    if args.compare:
        compare_older(torch, args, out, tok, target, log, rec)
    held = drafter_sequences(torch, target, held_ids, s["held_seqs"], s, seed=11)
    g = torch.Generator(device="cpu").manual_seed(3)
    hits, count = np.zeros(s["block"] - 1), 0
    with torch.no_grad():
        for b0 in range(0, held.shape[0], s["d_batch"]):
            feats, starts, roots, labels = drafter_batch(torch, target, drafter, held[b0:b0 + s["d_batch"]], s, g)
            top = drafter.forward_blocks(feats, starts, roots).argmax(-1)
            hits += (top == labels).float().sum((0, 1)).cpu().numpy()
            count += labels.shape[0] * labels.shape[1]
    agree = (hits / count).tolist()
    log("drafter top-1 agreement by position: " + " ".join(f"{a:.2f}" for a in agree))
    # acceptance length of kdtree's batched engine, greedy, on held-out prompts of `context` tokens
    prompts = held_prompts(held_ids, s)
    ar = Engine(target, None, mode="ar", budget=0, max_batch=8, max_length=s["context"] + s["accept_new"] + 8)
    want = [o.tokens for o in ar.generate(prompts, s["accept_new"])]
    accept = {}
    for n in s["budgets"]:
        eng = Engine(target, drafter, max_batch=8, budget=n, max_length=s["context"] + s["accept_new"] + 8)
        outs = eng.generate(prompts, s["accept_new"])
        same = sum(o.tokens == w for o, w in zip(outs, want, strict=True))
        accept[n] = {"acceptance_length": eng.stats.acceptance_length, "identical": same, "of": len(prompts)}
        log(f"N={n}: acceptance length {eng.stats.acceptance_length:.2f} tokens a round; {same}/{len(prompts)} "
            f"outputs identical to the target's greedy decoding")
    shares = [repeated_share(w, p) for w, p in zip(want, prompts, strict=True)]
    samples = [{"prompt_tail": tok.decode(p[-40:]), "continuation": tok.decode(w[:60])}
               for p, w in zip(prompts[:3], want[:3], strict=True)]
    rec.update(held_out_perplexity=ppl, perplexity_tokens=n_tok, drafter_agreement=agree, agreement_anchors=count,
               acceptance={str(k): v for k, v in accept.items()}, repeated_share_mean=float(np.mean(shares)),
               repeated_share_max=float(np.max(shares)), samples=samples)
    log(f"repeated 8-token windows in the greedy continuations: mean {np.mean(shares):.1%}, max {np.max(shares):.1%}")


def held_prompts(held_ids, s):
    """The held-out prompts of the eval and repeats stages: ``accept_prompts`` windows of
    ``context`` tokens (the same for both)."""
    rng = np.random.default_rng(12)
    starts = rng.integers(0, len(held_ids) - s["context"], s["accept_prompts"])
    return [held_ids[a:a + s["context"]].tolist() for a in starts]


def stage_repeats(torch, args, s, out, log, rec):
    from tokenizers import Tokenizer

    from kdtree.apps.generate import repeated_share
    from kdtree.engine import autoregressive_generate
    from kdtree.hf import HFTarget

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    corpus = json.loads((out / "corpus.json").read_text())
    _, held_texts = read_texts(corpus)
    prompts = held_prompts(encode(tok, held_texts), s)
    target = load_target(out, args.device)
    shares, samples = [], []
    for i, prompt in enumerate(prompts):
        res = autoregressive_generate(HFTarget(target, temperature=args.sample_temperature, top_p=args.sample_top_p,
                                               seed=i), prompt, s["accept_new"])
        shares.append(repeated_share(res.tokens, prompt))
        if i < 3:
            samples.append({"prompt_tail": tok.decode(prompt[-40:]), "continuation": tok.decode(res.tokens[:60])})
    rec.update(sampled_repeats={"temperature": args.sample_temperature, "top_p": args.sample_top_p,
                                "mean": float(np.mean(shares)), "max": float(np.max(shares)),
                                "prompts": len(prompts), "new_tokens": s["accept_new"], "samples": samples})
    log(f"repeated 8-token windows in the sampled continuations (temperature {args.sample_temperature}, top-p "
        f"{args.sample_top_p}, seed i for prompt i): mean {np.mean(shares):.1%}, max {np.max(shares):.1%}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    stages = args.stage or list(STAGES)
    s = sizes(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rec_path = out / "training.json"
    rec = json.loads(rec_path.read_text()) if rec_path.is_file() else {}
    lines = rec.setdefault("log", [])

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    torch.manual_seed(args.seed)
    env = dict(command=" ".join(sys.argv), python=platform.python_version(), torch=torch.__version__,
               transformers=__import__("transformers").__version__,
               device_name=(torch.cuda.get_device_name() if args.device.startswith("cuda")
                            else platform.processor() or platform.machine() or "a CPU"),
               sizes={k: list(v) if isinstance(v, tuple) else v for k, v in s.items()})
    if any(st in TRAINING for st in stages) or "sizes" not in rec:
        rec.update(env)
    t0 = time.time()
    for stage in STAGES:
        if stage not in stages:
            continue
        ts = time.time()
        if stage == "corpus":
            corpus = collect_corpus(s["corpus_chars"])
            (out / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")
            n_held = sum(f["held_out"] for f in corpus["files"])
            log(f"corpus: {len(corpus['files'])} files from {len(corpus['packages'])} sources ({n_held} held out); "
                f"{len(corpus['skipped'])} packages skipped for their licence")
        elif stage == "tokenizer":
            corpus = json.loads((out / "corpus.json").read_text())
            train_texts, _ = read_texts(corpus)
            tok = train_tokenizer(train_texts, s["vocab"], out / "tokenizer.json")
            log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()} ({sum(map(len, train_texts)) / 1e6:.1f} M "
                f"training characters)")
        elif stage == "target":
            stage_target(torch, args, s, out, log, rec)
        elif stage == "drafter":
            stage_drafter(torch, args, s, out, log, rec)
        elif stage == "eval":
            stage_eval(torch, args, s, out, log, rec)
        else:
            stage_repeats(torch, args, s, out, log, rec)
        rec.setdefault("stage_seconds", {})[stage] = time.time() - ts
        rec.setdefault("stage_commands", {})[stage] = env["command"]
        rec.setdefault("stage_sizes", {})[stage] = env["sizes"]
        rec.setdefault("stage_envs", {})[stage] = {k: env[k] for k in ("python", "torch", "transformers",
                                                                      "device_name")}
        write_record(rec_path, rec)
    if (out / "corpus.json").is_file() and "held_out_perplexity" in rec:
        write_card(out, rec, json.loads((out / "corpus.json").read_text()))
    log(f"done in {time.time() - t0:.0f} s: {out}")
    write_record(rec_path, rec)
    return 0


def write_card(out: Path, r: dict, corpus: dict) -> None:
    s = r["sizes"]
    agree = " | ".join(f"{a:.2f}" for a in r["drafter_agreement"])
    heads = " | ".join(str(i + 1) for i in range(len(r["drafter_agreement"])))
    acc = "\n".join(f"| {n} | {v['acceptance_length']:.2f} | {v['identical']}/{v['of']} |"
                    for n, v in r["acceptance"].items())
    pk = "\n".join(f"| {name} | {e.get('version', 'not recorded')} | {e['licence']} | {e['files']} |"
                   for name, e in sorted(corpus["packages"].items()))
    samples = "\n\n".join(f"Prompt (its last 40 tokens):\n\n```\n{x['prompt_tail']}\n```\n\nContinuation:\n\n"
                           f"```\n{x['continuation']}\n```" for x in r["samples"])
    n_files = len(corpus["files"])
    n_held = sum(f["held_out"] for f in corpus["files"])
    runs: dict[str, list[str]] = {}
    for stage, cmd in r.get("stage_commands", {}).items():
        runs.setdefault(cmd, []).append(stage)
    envs = r.get("stage_envs", {})

    def where(stages):  # the machine, where a stage ran elsewhere than the training
        other = {envs[st]["device_name"] for st in stages if st in envs} - {r["device_name"]}
        return f" (on {', '.join(sorted(other))})" if other else ""

    chain = (r.get("drafter_init") or {}).get("runs") or []
    earlier = "".join(f"    {x['command']}    # drafter, run {i + 1} of {len(chain) + 1} ({x['steps']} steps)\n"
                      for i, x in enumerate(chain) if x.get("command"))
    if earlier and "drafter" in runs.get(r.get("stage_commands", {}).get("drafter"), []):
        runs[r["stage_commands"]["drafter"]] = [
            st if st != "drafter" else f"drafter, run {len(chain) + 1} of {len(chain) + 1} ({r['drafter_steps_run']} "
            f"steps)" for st in runs[r["stage_commands"]["drafter"]]]
        earlier = ("    # each drafter run continues from the drafter the one before it saved, copied into its "
                   "--out folder\n" + earlier)
    commands = ("\n".join(f"    {cmd}    # {', '.join(st)}{where(st)}" for cmd, st in runs.items())
                or f"    {r['command']}")
    if earlier:  # the earlier drafter runs go before the last one
        lines = commands.split("\n")
        k = next((i for i, ln in enumerate(lines) if "drafter, run" in ln), len(lines))
        commands = ("\n".join(lines[:k]) + ("\n" if k else "") + earlier + "\n".join(lines[k:])).rstrip("\n")
    sr = r.get("sampled_repeats")
    sampled = "" if not sr else (
        f" Sampled at temperature {sr['temperature']:g} with top-p {sr['top_p']:g} (kdtree's `HFTarget`, seed i for "
        f"prompt i; the `repeats` stage): mean {sr['mean']:.1%}, max {sr['max']:.1%}.")
    sampled_samples = "" if not sr else "\n\n## Samples (the same prompts, sampled as above)\n\n" + "\n\n".join(
        f"Prompt (its last 40 tokens):\n\n```\n{x['prompt_tail']}\n```\n\nContinuation:\n\n"
        f"```\n{x['continuation']}\n```" for x in sr["samples"])
    c = r.get("compare")
    compare = "" if not c else (
        f"On the {c['files']} held-out standard-library files this target scores {c['new_nats_per_char']:.3f} "
        f"nats a character against {c['older_nats_per_char']:.3f} for the older pair's target ({c['older']}): "
        f"in the older tokenizer's tokens, perplexity {c['new_perplexity_in_older_tokens']:.1f} against "
        f"{c['older_perplexity']:.1f}.")
    gamma = s.get("loss_decay_gamma")
    sched = r.get("drafter_schedule_steps", r["drafter_steps_run"])
    stopped = ("" if sched <= r["drafter_steps_run"] else
               f" (stopped from outside before the end of its {sched}-step schedule; the saved checkpoint, step "
               f"{r['drafter_steps_run']}, is the best evaluation up to the stop)")
    init = r.get("drafter_init")
    cont = "" if not init else (
        f", continued from {init['from']}" + (f" after {init['steps']} earlier steps" if init.get("steps") else ""))
    rows, anchors = s.get("self_rows", 0.5), s.get("self_anchors", 0.5)
    mix = ("every sequence of each batch), " if rows >= 1 else
           f"{rows:.0%} of each batch; the rest fresh windows of real text), ") + (
           "every anchor in the continuation" if anchors >= 1 else
           f"{anchors:.0%} of their anchors in the continuation and the rest anywhere")
    weighting = ("equal weights at every position" if not gamma else
                 f"block position k weighted exp(-(k-1)/{gamma:g})")
    text = f"""# The demo pair: a Qwen3 target and a DFlash drafter

Trained by `tools/train_models.py` on {r['device_name']}, Python {r['python']}, torch {r['torch']},
transformers {r['transformers']}, in stages:

{commands}

## Corpus
Python sources no one in this project wrote: the standard library and the permissively
licensed packages installed on that machine; {n_files} files, every 20th (by source and
path) held out whole ({n_held} files); {r.get('train_tokens', 0):,} training tokens,
{r.get('held_tokens', 0):,} held out. Test suites and vendored code are excluded; files are
separated by `<|endoftext|>` (token 0). Sources and licences (versions as that machine's
installed packages declare them: the corpus is their source text, whatever the training
itself imported):

| source | version | licence (as the package declares it) | files |
|---|---|---|---|
{pk}

Skipped for their licence (not clearly permissive): {', '.join(x['package'] for x in corpus['skipped']) or 'none'}.

## Tokenizer (`tokenizer.json`, also in `target/`)
Byte-level BPE, vocabulary {s['vocab']} with `<|endoftext|>` (0) and `<|mask|>` (1, the drafter's mask).

## Target (`target/`, bfloat16, a Hugging Face Qwen3ForCausalLM folder)
{s['layers']} layers, hidden {s['hidden']}, {s['heads']} query / {s['kv_heads']} KV heads of {s['head_dim']},
MLP {s['inter']}, tied embeddings; {r['target_params'] / 1e6:.2f} M parameters. {r['target_steps_run']} AdamW steps
of {s['batch']} x {s['seq']} tokens; the weights of the best held-out evaluation (step
{r['target_best_step']}, mean token cross-entropy {r['target_best_held_loss']:.3f} nats on a sample of held-out
{s['seq']}-token windows, in bfloat16 autocast) are kept. **Held-out perplexity
{r['held_out_perplexity']:.2f}** (exp of the mean cross-entropy over every held-out token, in 512-token windows,
the saved weights in float32).{' ' + compare if compare else ''}

## Drafter (`drafter/`, bfloat16, the published DFlash format)
{s['d_layers']} DFlash layers over the target's embedding and LM head, target layers
{r['drafter_target_layer_ids']} (0-based layer indices: transformers' `hidden_states`
{[i + 1 for i in r['drafter_target_layer_ids']]}), block size {s['block']} (the root and
{s['block'] - 1} drafted positions, L = {s['block'] - 1}), mask token `<|mask|>`;
{r['drafter_params'] / 1e6:.2f} M parameters of its own. Trained against the frozen target on
sequences of {s['context']} real tokens followed by {s['gen']} tokens of the target's greedy
continuation ({mix}, each block
labelled with the target's teacher-forced argmax ({weighting}): {r['drafter_steps_run']} steps of
{s['d_batch']} sequences x {s['anchors']} blocks{cont}{stopped}; best
held-out loss {r['drafter_best_held_loss']:.3f} (step {r['drafter_best_step']}; the cross-entropy in nats
against the target's argmax, averaged over the block's positions with those weights).

Per-position top-1 agreement with the target's argmax ({r['agreement_anchors']} held-out anchors):

| position | {heads} |
|---|{'---|' * len(r['drafter_agreement'])}
| top-1 agreement | {agree} |

Acceptance length of kdtree's batched engine (greedy, held-out prompts of {s['context']} tokens,
{s['accept_new']} new tokens):

| budget N | tokens a round | outputs identical to the target's greedy decoding |
|---|---|---|
{acc}

Repeated 8-token windows in the target's greedy continuations of those prompts: mean
{r['repeated_share_mean']:.1%}, max {r['repeated_share_max']:.1%}.{sampled}

## Samples (held-out prompts, the target's greedy continuation)

{samples}{sampled_samples}
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
