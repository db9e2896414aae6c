"""``kdtree generate --batch-size B --prompts-file F``: many prompts decoded together by the
batched engine (:mod:`kdtree.engine.batched`: request slots, continuous batching, one CUDA
graph a round on a GPU).

The prompts file holds one prompt a line (``\\n`` and ``\\\\`` escapes are decoded), or, for
a ``.jsonl`` file or lines starting with ``{``, JSON objects with ``"prompt"`` and
optionally ``"max_new_tokens"``, ``"temperature"``, ``"top_p"``, ``"top_k"``, ``"seed"``
and ``"stop"`` (a list of texts that end that request, each encoded as ``--stop`` is, on
top of ``--stop``); the flags (``--temperature``, ``--top-p``, ``--top-k``, ``--seed``,
``--max-new-tokens``) are the defaults of the lines that do not set them. A greedy line
(temperature 0) with its own top-p or top-k is refused; the flags' top-p and top-k apply to
the sampling lines only. Printed: each request's continuation, then the aggregate tokens/s, the mean
acceptance length and the target forwards; with greedy decoding the same prompts are
also decoded autoregressively by the same engine (``--no-ar`` skips it) and the identical
outputs counted.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

from .cli import UsageError, read_regular_file

MAX_PROMPTS = 1_000_000
_ESCAPE = re.compile(r"\\([\\n])")  # \n and \\ in plain prompt lines, decoded in one pass


def _setting(entry: dict, name: str, default, kind: str, where: str):
    """A JSON line's setting, or the command line's: integers for "int" (not bool, not
    2.5), finite numbers for "float" (not bool, not strings)."""
    if name not in entry:
        return default
    v = entry[name]
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise UsageError(f"{where}: {name} must be an integer, got {v!r}")
    elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UsageError(f"{where}: {name} must be a finite number, got {v!r}")
    return v


def read_prompts(path: Path) -> list[dict]:
    """The requests of a prompts file (module docstring): dicts with "prompt" and the
    optional settings. Raises UsageError naming the line of a bad entry."""
    raw = read_regular_file(path).decode("utf-8", errors="replace")
    jsonl = path.suffix.lower() == ".jsonl"
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl or line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}, line {n}: not a JSON object ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise UsageError(f'{path}, line {n}: a JSON line needs a "prompt" string')
            unknown = sorted(set(obj) - {"prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop"})
            if unknown:
                raise UsageError(f"{path}, line {n}: unknown fields {unknown}")
            stop = obj.get("stop", [])
            if not isinstance(stop, list) or not all(isinstance(t, str) and t for t in stop):
                raise UsageError(f'{path}, line {n}: "stop" must be a list of non-empty texts, got {stop!r}')
            out.append({**obj, "_line": n})
        else:
            out.append({"prompt": _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else "\\", line), "_line": n})
        if len(out) > MAX_PROMPTS:
            raise UsageError(f"{path}: more than {MAX_PROMPTS:,} prompts")
    if not out:
        raise UsageError(f"{path}: no prompts (one a line, or JSON lines with a \"prompt\")")
    return out


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def run(args: argparse.Namespace, *, header: str = "kdtree generate") -> int:
    """The batched run (module docstring). Exit status 1 when a float32/float64 greedy
    output differs from autoregressive decoding."""
    import torch

    from ..engine.batched import Engine, SamplingParams
    from .generate import EOS, _check_device, load_models

    _check_device(args.device)
    if getattr(args, "tp", False):
        from .generate import start_tp

        start_tp(args)
    # options of the single-sequence run that the batched run has no use for: refused, not ignored
    from .generate import TREE_NODES

    unused = [name for name, on in (("--plot", args.plot is not None), ("--depth", args.depth is not None),
                                    ("--repeats", args.repeats != 3), ("--tree-nodes", args.tree_nodes != TREE_NODES),
                                    ("--prompt", args.prompts_file is not None and args.prompt is not None),
                                    ("--prompt-file", args.prompts_file is not None and args.prompt_file is not None),
                                    ("--prompt-offset", args.prompts_file is not None and args.prompt_offset is not None))
              if on]
    if unused:
        raise UsageError(f"{', '.join(unused)}: not used by the batched run (--batch-size / --prompts-file)"
                         + ("; the prompts come from --prompts-file" if args.prompts_file is not None
                            and (args.prompt is not None or args.prompt_file is not None) else ""))
    if args.prompts_file is not None:
        entries = read_prompts(args.prompts_file)
    else:
        from .generate import _default_prompt

        entries = [{"prompt": _default_prompt(args)[0], "_line": 1}]
    # (a JSON line may set its own temperature: then the flags are that request's defaults)
    if args.temperature == 0 and not any("temperature" in e for e in entries):
        if args.top_k:
            raise UsageError("--top-k applies to sampling: add --temperature T > 0 (greedy decoding ignores it)")
        if args.top_p < 1.0:
            raise UsageError(f"--top-p {args.top_p} applies to sampling only: add --temperature T > 0 (greedy "
                             f"decoding takes the argmax)")
    # the flags are checked as flags (not as the first line that inherits them)
    try:
        SamplingParams(temperature=1.0, top_p=float(args.top_p), top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        raise UsageError(f"--top-p / --top-k / --seed: {exc}") from None
    if args.seed + len(entries) - 1 >= 2**63 and any("seed" not in e for e in entries):
        raise UsageError(f"--seed {args.seed}: prompt i takes seed --seed + i, past 2**63 - 1 for {len(entries)} "
                         f"prompts")
    tok, target, drafter = load_models(args)
    eos = tok.token_to_id(EOS)
    stops = [] if args.no_eos_stop or eos is None else [eos]
    from .generate import stop_label, stop_sequences_of

    stop_seqs = stop_sequences_of(tok, getattr(args, "stop", None))
    max_pos = int(getattr(target.config, "max_position_embeddings", 0) or 0)
    prompts, params, caps = [], [], []
    for i, e in enumerate(entries):
        where = f"prompt {i} (line {e['_line']})"
        cap = _setting(e, "max_new_tokens", args.max_new_tokens, "int", where)
        if cap < 0:
            raise UsageError(f"{where}: max_new_tokens must be >= 0, got {cap}")
        try:
            own_stops = stop_sequences_of(tok, e.get("stop"))
        except UsageError as exc:
            raise UsageError(f"{where}: {str(exc).replace('--stop', 'stop')}") from None
        try:
            params.append(SamplingParams(temperature=float(_setting(e, "temperature", args.temperature, "float", where)),
                                         top_p=float(_setting(e, "top_p", args.top_p, "float", where)),
                                         top_k=_setting(e, "top_k", args.top_k, "int", where),
                                         seed=_setting(e, "seed", args.seed + i, "int", where),
                                         stop_sequences=own_stops))
        except ValueError as exc:
            raise UsageError(f"{where}: {exc}") from None
        # a greedy request's own cuts are a mistake; the flags' cuts are the defaults of the
        # file's sampling requests and do not apply to its greedy ones
        own = [f"{k} {e[k]}" for k, cut in (("top_p", params[-1].top_p < 1.0), ("top_k", bool(params[-1].top_k)))
               if k in e and cut]
        if params[-1].temperature == 0 and own:
            raise UsageError(f"{where}: {', '.join(own)} set for a greedy request (temperature 0): "
                             f"{'it applies' if len(own) == 1 else 'they apply'} to sampling only")
        if max_pos and len(e["prompt"]) > 64 * max_pos:  # no need to tokenize a text that cannot fit
            raise UsageError(f"{where}: {len(e['prompt']):,} characters cannot fit the target's {max_pos} positions")
        ids = tok.encode(e["prompt"]).ids
        if not ids:
            raise UsageError(f"{where}: encodes to no tokens")
        if max_pos and len(ids) >= max_pos:
            raise UsageError(f"{where}: {len(ids)} tokens; the target takes {max_pos} positions (prompt and new "
                             f"tokens together)")
        prompts.append(ids)
        caps.append(cap)
    if all(p.temperature == 0 for p in params) and (args.top_k or args.top_p < 1.0):  # every line greedy
        raise UsageError(f"{'--top-k' if args.top_k else f'--top-p {args.top_p}'} applies to sampling, and every "
                         f"request of the file is greedy (temperature 0)")
    sampling = any(not p.greedy for p in params)
    longest = max(len(p) + c for p, c in zip(prompts, caps, strict=True))
    max_length = max(2, min(max_pos, longest + 1) if max_pos else longest + 1)
    budget = args.budget
    out = sys.stdout
    batch = args.batch_size or 1
    print(f"{header}: batched DDTree decoding, {len(prompts)} prompts, batch {batch}, budget N={budget}, "
          f"{args.device} {next(target.parameters()).dtype}", file=out)
    from .generate import drafter_kind, pair_source

    print(f"  models   : {pair_source(args)}; target {type(target).__name__}, "
          f"{sum(p.numel() for p in target.parameters()) / 1e6:.2f} M parameters; {drafter_kind(drafter)}, "
          f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M parameters", file=out)
    print("  " + ("sampling (per-request settings)" if sampling else "greedy") + "; stop at "
          + (", ".join(([EOS] if stops else []) + [stop_label(tok, t, q) for t, q in
                                                    zip(getattr(args, "stop", None) or (), stop_seqs, strict=True)])
             or "nothing")
          + (f"; tensor-parallel over {_world()} ranks" if getattr(args, "tp", False) else ""), file=out)
    print("  acceptance length = tokens committed per request per round (accepted draft tokens + the bonus "
          "token); target forwards = rounds, each one forward over every active request's tree; times "
          "include the prefill", file=out)

    def decode(mode: str, label: str):
        try:
            eng = Engine(target, drafter, max_batch=batch, budget=budget if mode == "ddtree" else 0, mode=mode,
                         max_length=max_length, stop_tokens=stops, sampling=sampling, stop_sequences=stop_seqs)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        eng.capture_all(prefill=True)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(caps), unit="tok", desc=label, leave=False, file=sys.stderr)
        t0 = time.perf_counter()
        ids = [eng.submit(p, c, s, on_tokens=bar.update if bar else None)
               for p, c, s in zip(prompts, caps, params, strict=True)]
        while eng.busy:
            eng.step()
        if args.device != "cpu":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        return [eng.output(i) for i in ids], wall, eng.stats, eng.budget_counts

    outs, wall, stats, used = decode("ddtree", "DDTree")
    for i, o in enumerate(outs):
        extra = f", error: {o.error}" if o.error else ""
        if entries[i].get("stop"):
            extra += ", own stops " + ", ".join(repr(t) for t in entries[i]["stop"])
        head = entries[i]["prompt"][:40].replace("\n", "\\n")
        print(f"\n---- request {i} (line {entries[i]['_line']}: {head!r}): {len(o.prompt)} prompt tokens, "
              f"{len(o.tokens)} new, {o.finish_reason}, acceptance length {o.mean_acceptance_length:.2f}{extra} ----",
              file=out)
        print(tok.decode(o.tokens), file=out)
    tokens = sum(len(o.tokens) for o in outs)
    print("\n" + "-" * 66, file=out)
    print(f"DDTree     : {tokens} tokens in {wall:.3f} s = {tokens / wall:,.0f} tokens/s; acceptance length "
          f"{stats.acceptance_length:.2f}; {stats.rounds} target forwards (rounds) = "
          f"{stats.rounds / max(tokens, 1):.3f} a token; prefill {stats.prefill_gpu:.3f} s", file=out)
    if budget == "auto":
        print("budgets    : rounds at each budget " + ", ".join(f"N={n}: {c}" for n, c in sorted(used.items())),
              file=out)
    status = 0
    if sampling and not args.no_ar:
        print("AR         : not run (some requests sample: their outputs are samples, not comparable token by "
              "token; greedy requests are checked in greedy runs)", file=out)
    if not args.no_ar and not sampling:
        ar, ar_wall, ar_stats, _ = decode("ar", "AR")
        ar_tokens = sum(len(o.tokens) for o in ar)
        same = sum(a.tokens == o.tokens for a, o in zip(ar, outs, strict=True))
        low = next(target.parameters()).dtype in (torch.float16, torch.bfloat16)
        print(f"AR         : {ar_tokens} tokens in {ar_wall:.3f} s = {ar_tokens / ar_wall:,.0f} tokens/s; "
              f"{ar_stats.rounds} target forwards", file=out)
        if tokens and ar_tokens:
            print(f"speed-up   : {(tokens / wall) / (ar_tokens / ar_wall):.2f}x AR's tokens/s", file=out)
        print(f"identical  : {same} of {len(outs)} outputs equal greedy autoregressive decoding"
              + (" (16-bit floats: the tree forward and the one-token forward round differently, so a near-tie "
                 "can flip; float32 is checked exactly)" if low and same < len(outs) else ""), file=out)
        if same < len(outs) and not low:
            status = 1
    return status
