"""``python -m kdtree demo``: DDTree speculative decoding end to end on CPU.

By default (``--model transformer``) the demo is ``python -m kdtree generate`` with the
transformer pair shipped in ``fixtures/models/stdlib-qwen3`` (:mod:`kdtree.generate`): a
small Qwen3 target and a DFlash drafter (published format), sampling at temperature 0.7
with top-p 0.95 and seed 0 (``--temperature 0``: greedy), checked token for token against
autoregressive decoding with the same settings (a draw is keyed by the seed and the
position, so both make the same draws). Sampling because this small target's greedy
continuations loop (28% of the default prompt's continuation repeats an earlier 8-token
window; 1% at temperature 0.7). ``--model ngram`` runs the byte n-gram pair described below
(greedy).

With ``--model ngram`` the target is an order-16 byte n-gram model with stupid backoff and the drafter an order-4
one unrolled along its own greedy chain (:mod:`kdtree.ngram`), both estimated from this
Python's standard library sources (cached under :func:`kdtree.ngram.cache_dir`). The
prompt is a slice of a standard-library file (default ``heapq.py`` from byte 14500, which
is left out of the corpus so the target does not recite it); ``--prompt-file`` takes any
file (a standard-library file given this way is left out of the corpus too).

The demo decodes ``--max-new-tokens`` bytes twice through the same target: plain greedy
autoregressive decoding (one target call per byte) and DDTree rounds
(:func:`kdtree.engine.speculative_generate`, one target call per round), checks the two
outputs are identical (exit status 1 if not), and prints target calls, the mean
acceptance length, the time per stage and one round's draft tree.

Source: Ringel & Romano, arXiv 2604.12989; tree rule and verification semantics:
``ddtree-tree-build.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..engine import ngram
from ..engine import rounds as engine
from . import text
from .cli import float_in as _float_in
from .cli import int_in as _int_in
from .cli import plural as _plural
from .cli import timed_pair, wall_text
from .generate import PROMPT_CHARS, TREE_NODES, temperature_arg

DESCRIPTION = __doc__.split("\n\n")[0].replace("``", "") + (
    " Decodes a continuation twice, autoregressive and DDTree, with the shipped transformer pair "
    "(default; sampled, temperature 0.7, top-p 0.95, seed 0) or a byte n-gram pair (--model ngram, greedy), and "
    "checks the outputs are identical. Flags marked (ngram) apply to --model ngram only.")
# The transformer demo's sampling (a 10 M-parameter target loops when greedy)
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_PROMPT = "heapq.py"
DEFAULT_OFFSET = 14500
DEFAULT_PROMPT_BYTES = 300
# The demo's cap on --budget. Each draft tree carries an attention mask of (N+1)^2 bytes
# (kdtree.TreeBatch.visibility) and the target scores all N+1 nodes per round, so N=100000
# would need ~10 GB per tree; the library itself takes larger budgets.
MAX_BUDGET = 4096
# runs of one byte at least this long are drawn as a marker in the continuation; shorter
# than this stays as it is (8 or 12 spaces of indentation are ordinary code)
MIN_RUN = 16
# above this share of the continuation in such runs, the demo says the ratio is optimistic
RUN_SHARE_NOTE = 0.25


def _budget(text: str) -> int:
    v = _int_in(1)(text)
    if v > MAX_BUDGET:
        size_text = _size((v + 1) ** 2)
        raise argparse.ArgumentTypeError(
            f"must be <= {MAX_BUDGET} in the demo, got {v}: each draft tree holds an attention "
            f"mask of (N+1)^2 bytes ({size_text} at N={v}) and the target scores all N+1 "
            f"nodes every round (the library itself accepts larger budgets)")
    return v


# Flags of the n-gram pair only (their defaults; --model transformer rejects other values).
NGRAM_ONLY = {"order": ngram.DEFAULT_ORDER, "draft_order": ngram.DEFAULT_DRAFT_ORDER, "backend": "auto",
              "stop_byte": [], "no_cache": False, "corpus_bytes": ngram.DEFAULT_CORPUS_BYTES,
              "prompt_bytes": DEFAULT_PROMPT_BYTES}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("transformer", "ngram"), default="transformer",
                   help="transformer: the shipped Qwen3 target and DFlash drafter (kdtree generate); "
                        "ngram: byte n-gram target and drafter estimated from the standard library")
    p.add_argument("--models", type=Path, default=None,
                   help="transformer: the folder of the pair (default: the checkout's fixtures/models/stdlib-qwen3, "
                        "or that path under the current folder)")
    p.add_argument("--plot", type=Path, default=None,
                   help="(transformer) write the acceptance histogram and one round's tree to this PNG/SVG")
    p.add_argument("--budget", type=_budget, default=64,
                   help=f"draft nodes per tree N (root excluded), 1..{MAX_BUDGET} (each tree's "
                        f"attention mask takes (N+1)^2 bytes)")
    p.add_argument("--depth", type=_int_in(1, 255), default=15,
                   help="draft positions per drafter call L (tree depth limit), 1..255 (at most 15 with "
                        "the transformer pair, whose drafter proposes 15 positions)")
    p.add_argument("--max-new-tokens", type=_int_in(1), default=None,
                   help="tokens to generate, an exact cap (default: 96 tokens with the transformer pair, "
                        "256 bytes with --model ngram)")
    p.add_argument("--prompt-file", type=Path, default=None,
                   help=f"file to take the prompt from (default: the standard library's "
                        f"{DEFAULT_PROMPT} with --model ngram, a slice of kdtree's engine/rounds.py "
                        f"with the transformer pair)")
    p.add_argument("--prompt-offset", type=_int_in(0), default=None,
                   help=f"first prompt byte (character with the transformer pair) in the file (default: "
                        f"{DEFAULT_OFFSET} in heapq.py with --model ngram, 2000 in engine/rounds.py with the "
                        f"transformer pair, else 0; with --model ngram clamped so the prompt fits, with the "
                        f"transformer pair an error past the end)")
    p.add_argument("--prompt-bytes", type=_int_in(1), default=DEFAULT_PROMPT_BYTES,
                   help="(ngram) prompt length in bytes")
    p.add_argument("--prompt-chars", type=_int_in(1), default=None,
                   help=f"(transformer) prompt length in characters (default: {PROMPT_CHARS})")
    p.add_argument("--stop-byte", type=_int_in(0, 255), action="append", default=[],
                   metavar="BYTE", help="(ngram) byte value that ends generation (repeatable; "
                                        "e.g. 10 for newline)")
    p.add_argument("--order", type=_int_in(2, ngram.MAX_ORDER), default=ngram.DEFAULT_ORDER,
                   help="(ngram) target n-gram order (context = order - 1 bytes)")
    p.add_argument("--draft-order", type=_int_in(1, ngram.MAX_ORDER),
                   default=ngram.DEFAULT_DRAFT_ORDER, help="(ngram) drafter n-gram order (<= --order)")
    p.add_argument("--temperature", type=temperature_arg, default=None,
                   help=f"(transformer) sampling temperature, 0 for greedy (default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                   help=f"(transformer) nucleus for sampling (default: {DEFAULT_TOP_P}; 1 with --temperature 0)")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=None,
                   help="(transformer) sampling seed (default: 0)")
    p.add_argument("--tree-nodes", type=_int_in(0), default=TREE_NODES,
                   help="most draft-tree nodes drawn (the best by score)")
    p.add_argument("--backend", choices=("auto", "native", "reference"), default="auto",
                   help="(ngram) tree ops: native libkdtree, the pure-Python reference, or auto "
                        "(native when it loads, else the reference)")
    p.add_argument("--no-cache", action="store_true",
                   help="(ngram) estimate the n-gram counts without reading or writing the cache")
    p.add_argument("--repeats", type=_int_in(1, 100), default=3,
                   help="timed runs of each method, after an untimed warm-up (fewer once they have taken a "
                        "minute; the wall-time line says how many ran)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    # test-only: a small corpus makes a cold start take well under a second
    p.add_argument("--corpus-bytes", type=_int_in(1), default=ngram.DEFAULT_CORPUS_BYTES,
                   help=argparse.SUPPRESS)


def _ops(backend: str):
    """(module with topk_logprobs/build_trees/verify_greedy, description)."""
    from .cli import UsageError

    if backend in ("auto", "native"):
        try:
            import kdtree

            return kdtree, f"native libkdtree {kdtree.library_version()} ({kdtree.library_path()}), in C on the CPU"
        except Exception as exc:  # noqa: BLE001 - any load failure: report or fall back
            if backend == "native":
                raise UsageError(f"cannot load libkdtree: {exc}") from None
            note = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            from ..core import reference

            return reference, f"pure-Python reference (libkdtree did not load: {note})"
    from ..core import reference

    return reference, "pure-Python reference"


def _read_prompt(args) -> tuple[bytes, Path, int]:
    from .cli import read_regular_file

    path = args.prompt_file if args.prompt_file is not None else ngram.stdlib_dir() / DEFAULT_PROMPT
    data = read_regular_file(path)
    offset = args.prompt_offset
    if offset is None:
        offset = DEFAULT_OFFSET if args.prompt_file is None else 0
    offset = max(0, min(offset, len(data) - args.prompt_bytes))
    return data[offset: offset + args.prompt_bytes], path, offset


def _short(path: Path) -> str:
    try:
        return path.relative_to(ngram.stdlib_dir()).as_posix() + " (standard library)"
    except ValueError:
        return str(path)


def _size(nbytes: int) -> str:
    """Bytes as "3 MiB" / "24.2 MiB" / "812 KiB" / "95 bytes" (up to EiB)."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            v = nbytes / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) or v >= 100 else f"{v:.1f} {unit}"
    return _plural(nbytes, "byte")


def _marks(stream) -> tuple[str, str]:
    """Run-marker brackets: the angle brackets where ``stream`` can encode them."""
    try:
        "\u27e8\u27e9".encode(getattr(stream, "encoding", None) or "ascii")
        return "\u27e8", "\u27e9"
    except (UnicodeEncodeError, LookupError):
        return "<<", ">>"


def run_share(tokens) -> tuple[int, float]:
    """(bytes of ``tokens`` in runs of one byte >= MIN_RUN long, their share of all bytes)."""
    n = sum(length for _, length, _ in text.byte_runs(bytes(tokens), MIN_RUN))
    return n, (n / len(tokens) if len(tokens) else 0.0)


def _corpus_lines(corpus: ngram.Corpus) -> list[str]:
    """The header's description of the corpus: the rule, then what it gave."""
    root = ngram.stdlib_dir()
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    cut = len(corpus.data) >= corpus.max_bytes
    cap = corpus.max_bytes
    cap_text = next((f"{cap >> sh} {u}" for u, sh in (("MiB", 20), ("KiB", 10))
                     if cap >= 1 << sh and cap % (1 << sh) == 0), f"{cap:,} bytes")
    rule = (f"first {cap_text} of" if cut else "all") + (
        f" Python {py}'s standard-library .py files, sorted by path (no test suites, "
        f"encodings, pydoc_data") + (", nor the prompt file)" if corpus.skipped else ")")

    def rel(f: Path) -> str:
        try:
            return f.relative_to(root).as_posix()
        except ValueError:
            return str(f)

    files = (f"{_plural(len(corpus.files), 'file')} under {root}: {rel(corpus.files[0])} .. "
             f"{rel(corpus.files[-1])}{' (cut at the cap)' if cut else ''}")
    return [rule, f"{files}; {len(corpus.data):,} bytes, sha256 {corpus.sha256[:12]}"]


def _run_transformer(args: argparse.Namespace) -> int:
    from . import generate
    from .cli import UsageError

    changed = [f"--{k.replace('_', '-')}" for k, v in NGRAM_ONLY.items() if getattr(args, k) != v]
    if changed:
        raise UsageError(f"{', '.join(changed)} only appl{'y' if len(changed) > 1 else 'ies'} to --model ngram")
    gp = argparse.ArgumentParser()
    generate.add_arguments(gp)
    gargs = gp.parse_args([])
    gargs.budget = args.budget
    if args.models is not None:
        gargs.models = args.models
    gargs.depth = args.depth
    gargs.max_new_tokens = 96 if args.max_new_tokens is None else args.max_new_tokens
    gargs.prompt_file = args.prompt_file
    gargs.prompt_offset = args.prompt_offset
    if args.prompt_chars is not None:
        gargs.prompt_chars = args.prompt_chars
    gargs.temperature = DEFAULT_TEMPERATURE if args.temperature is None else args.temperature
    gargs.top_p = (args.top_p if args.top_p is not None else DEFAULT_TOP_P if gargs.temperature > 0 else 1.0)
    gargs.seed = 0 if args.seed is None else args.seed
    gargs.plot = args.plot
    gargs.tree_nodes = args.tree_nodes
    gargs.repeats = args.repeats
    gargs.no_progress = args.no_progress
    return generate.run(gargs, header="kdtree demo")


def run(args: argparse.Namespace) -> int:
    from .cli import UsageError

    if args.model == "transformer":
        return _run_transformer(args)
    if args.plot is not None:
        raise UsageError("--plot only applies to --model transformer")
    if args.models is not None:
        raise UsageError("--models only applies to --model transformer")
    # --temperature 0 asks for what the n-gram demo does (greedy): accepted
    sampling = [f"--{k.replace('_', '-')}" for k in ("temperature", "top_p", "seed")
                if getattr(args, k) is not None and not (k == "temperature" and args.temperature == 0)]
    if sampling:
        raise UsageError(f"{', '.join(sampling)} only appl{'y' if len(sampling) > 1 else 'ies'} to --model transformer "
                         f"(the n-gram demo is greedy)")
    if args.prompt_chars is not None:
        raise UsageError("--prompt-chars only applies to --model transformer (--prompt-bytes sets the "
                         "n-gram prompt's length)")
    if args.max_new_tokens is None:
        args.max_new_tokens = 256
    if args.draft_order > args.order:
        raise UsageError(f"--draft-order ({args.draft_order}) must be <= --order ({args.order})")
    ops, backend_desc = _ops(args.backend)
    prompt, path, offset = _read_prompt(args)
    out = sys.stdout
    prog = getattr(getattr(args, "_parser", None), "prog", "kdtree demo")

    def warn(msg: str) -> None:
        print(f"{prog}: warning: {msg}", file=sys.stderr)

    t0 = time.perf_counter()
    corpus = ngram.load_corpus(args.corpus_bytes, hold_out=path)
    cache_file = ngram.NgramCounts.cache_path(args.order, corpus.sha256)
    counts, cached = ngram.NgramCounts.load_or_estimate(corpus, args.order,
                                                        use_cache=not args.no_cache,
                                                        on_warning=warn)
    t_model = time.perf_counter() - t0
    target = ngram.NgramTarget(counts, args.order)
    drafter = ngram.NgramDrafter(counts, args.draft_order)

    in_stdlib = any(f.resolve() == path.resolve() for f in ngram.stdlib_sources())
    if corpus.skipped:
        held = "held out of the corpus"
    elif in_stdlib:
        held = "not in the corpus: it sorts after the byte cap"
    else:
        held = "not in the corpus"
    if args.no_cache:
        count_line = f"estimated in {t_model:.2f} s (--no-cache: no cache file read or written)"
    else:
        where = f"{cache_file} ({_size(cache_file.stat().st_size)})" if cache_file.is_file() \
            else f"{cache_file} (not written)"
        how = "loaded from cache" if cached else "estimated and cached"
        count_line = f"{how} in {t_model:.2f} s: {where}"
    corpus_lines = _corpus_lines(corpus)

    print("kdtree demo: DDTree speculative decoding (Ringel & Romano, arXiv 2604.12989)", file=out)
    print(f"  tree ops : {backend_desc}", file=out)
    print(f"  target   : order-{args.order} byte n-gram, stupid backoff (alpha {ngram.DEFAULT_ALPHA}), "
          f"greedy (argmax, ties to lower byte)", file=out)
    print(f"  drafter  : order-{args.draft_order} byte n-gram unrolled along its own greedy chain, "
          f"L={args.depth} positions per call", file=out)
    print(f"  corpus   : {corpus_lines[0]}", file=out)
    print(f"             {corpus_lines[1]}", file=out)
    print(f"  counts   : {count_line}", file=out)
    print(f"  prompt   : {_short(path)}, bytes {offset}..{offset + len(prompt)} ({held})", file=out)
    if corpus.skipped:
        print("  note     : the prompt file is one of the corpus files, so it is left out: this "
              "corpus differs from the default one and has its own counts"
              + ("" if args.no_cache else " and cache file"
                 + ("" if cached else " (written now)")), file=out)
    stale = [] if args.no_cache else ngram.stale_cache_files()
    if stale:
        total = sum(f.stat().st_size for f in stale if f.is_file())
        one = len(stale) == 1
        print(f"  note     : {_plural(len(stale), 'cache file')} of an older format "
              f"({_size(total)}) in {ngram.cache_dir()} {'is' if one else 'are'} no longer "
              f"read; deleting {'it' if one else 'them'} is safe", file=out)
    print(f"  settings : budget N={args.budget}, depth L={args.depth}, top-K={min(args.budget, 256)}, "
          f"max_new_tokens={args.max_new_tokens}, stop bytes={sorted(set(args.stop_byte)) or 'none'}",
          file=out)

    # Untimed warm-up: one new byte by each method first, so that one-off costs (the
    # library's first calls, page-in of the count tables) land on neither timed run.
    engine.autoregressive_generate(target, prompt, 1)
    engine.speculative_generate(target, drafter, prompt, 1, budget=args.budget, depth=args.depth, ops=ops,
                                snapshot=None)
    results, walls, timing_note = timed_pair({
        "greedy AR": lambda **kw: engine.autoregressive_generate(
            target, prompt, args.max_new_tokens, stop_tokens=args.stop_byte, **kw),
        "DDTree": lambda **kw: engine.speculative_generate(
            target, drafter, prompt, args.max_new_tokens, budget=args.budget, depth=args.depth,
            stop_tokens=args.stop_byte, ops=ops, **kw),
    }, args.repeats, args.max_new_tokens, args.no_progress, "B")
    ar, sp = results["greedy AR"], results["DDTree"]

    marks = _marks(out)
    shown = prompt[-DEFAULT_PROMPT_BYTES:]
    what = (_plural(len(prompt), "byte") if len(shown) == len(prompt)
            else f"last {len(shown)} of {len(prompt):,} bytes shown")
    print(f"\n---- prompt ({what}) " + "-" * 30, file=out)
    print(text.printable(shown), file=out)
    run_bytes, share = run_share(sp.tokens)
    legend = (f"; {marks[0]}'c' x n{marks[1]} = byte c repeated n times" if run_bytes else "")
    print(f"---- continuation ({_plural(len(sp.tokens), 'byte')}, stop: {sp.stop_reason}"
          f"{legend}) " + "-" * 24, file=out)
    print(text.printable(sp.tokens, min_run=MIN_RUN, marks=marks), file=out)
    print("-" * 66, file=out)

    same = sp.tokens == ar.tokens
    if same:
        print("identical to greedy autoregressive decoding: YES", file=out)
    else:
        first = next((i for i, (a, b) in enumerate(zip(ar.tokens, sp.tokens, strict=False)) if a != b),
                     min(len(ar.tokens), len(sp.tokens)))
        print(f"identical to greedy autoregressive decoding: NO (first difference at new byte "
              f"{first}; AR {len(ar.tokens)} bytes, DDTree {len(sp.tokens)} bytes)", file=out)
    ratio = ar.target_calls / sp.target_calls
    print(f"target calls       : AR {ar.target_calls}, DDTree {sp.target_calls} "
          f"({ratio:.2f}x fewer); drafter calls {sp.drafter_calls}", file=out)
    if share > RUN_SHARE_NOTE:
        print(f"note               : {run_bytes} of {len(sp.tokens)} new bytes ({100 * share:.0f}%) "
              f"are runs of one repeated byte (>= {MIN_RUN}); the target repeats itself here; "
              f"acceptance on repeated bytes is easy, so the ratio is optimistic", file=out)
    print(f"acceptance length  : {sp.mean_acceptance_length:.3f} committed bytes per round = "
          f"(accepted draft bytes + bonus byte) / rounds = {len(sp.tokens)} / {sp.rounds}", file=out)
    if sp.accepted:
        print(f"accepted draft     : mean {sp.mean_accepted_draft_tokens:.3f}, max {max(sp.accepted)} "
              f"of L={args.depth} per round", file=out)
    print(f"target rows        : AR {ar.target_rows}, DDTree {sp.target_rows} (the rows the target scores, "
          f"prompt excluded: each round scores its whole tree)", file=out)
    print(f"wall time          : AR {wall_text(walls['greedy AR'])}, DDTree {wall_text(walls['DDTree'])} "
          f"({timing_note}; the n-gram target is cheap, so on CPU the saving is in target calls, not seconds)",
          file=out)
    print("\n".join(text.stage_lines(sp)), file=out)
    print("  (target = the target's one call scoring every tree node; verify = the walk along "
          "its choices, kdtree.verify_greedy; commit = append to the target's context)", file=out)
    print(f"  (AR: target forward {1e3 * ar.times['target']:.2f} ms, commit "
          f"{1e3 * ar.times['commit']:.2f} ms)", file=out)

    snap = sp.snapshot
    if snap is not None:
        print(f"\n---- draft tree of round {snap.index} of {sp.rounds} (commits "
              f"{text.printable(snap.committed)!r}; * = accepted path) ----", file=out)
        print(text.render_tree(snap.trees, 0, snap.acceptance, max_nodes=args.tree_nodes),
              file=out)
    return 0 if same else 1
