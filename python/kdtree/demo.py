"""``python -m kdtree demo``: DDTree speculative decoding end to end on CPU.

The target is an order-16 byte n-gram model with stupid backoff and the drafter an order-4
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

from . import engine, ngram

DESCRIPTION = __doc__.split("\n\n")[0] + (
    " Decodes a slice of a standard-library file with a byte n-gram target twice, greedy "
    "autoregressive and DDTree, and checks the outputs are identical.")
DEFAULT_PROMPT = "heapq.py"
DEFAULT_OFFSET = 14500
DEFAULT_PROMPT_BYTES = 300


def _int_in(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {rng}, got {v}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=_int_in(1), default=64,
                   help="draft nodes per tree N (root excluded), >= 1")
    p.add_argument("--depth", type=_int_in(1, 255), default=15,
                   help="draft positions per drafter call L (tree depth limit)")
    p.add_argument("--max-new-tokens", type=_int_in(0), default=256,
                   help="bytes to generate (an exact cap)")
    p.add_argument("--prompt-file", type=Path, default=None,
                   help=f"file to take the prompt from (default: the standard library's "
                        f"{DEFAULT_PROMPT})")
    p.add_argument("--prompt-offset", type=_int_in(0), default=None,
                   help=f"first prompt byte in the file (default {DEFAULT_OFFSET} for the "
                        f"default file, else 0; clamped so the prompt fits)")
    p.add_argument("--prompt-bytes", type=_int_in(1), default=DEFAULT_PROMPT_BYTES,
                   help="prompt length in bytes")
    p.add_argument("--stop-byte", type=_int_in(0, 255), action="append", default=[],
                   metavar="BYTE", help="byte value that ends generation (repeatable; "
                                        "e.g. 10 for newline)")
    p.add_argument("--order", type=_int_in(2, ngram.MAX_ORDER), default=ngram.DEFAULT_ORDER,
                   help="target n-gram order (context = order - 1 bytes)")
    p.add_argument("--draft-order", type=_int_in(1, ngram.MAX_ORDER),
                   default=ngram.DEFAULT_DRAFT_ORDER, help="drafter n-gram order (<= --order)")
    p.add_argument("--tree-nodes", type=_int_in(0), default=40,
                   help="most tree nodes drawn (the best by score)")
    p.add_argument("--backend", choices=("auto", "native", "reference"), default="auto",
                   help="tree ops: libkdtree (native), the pure-Python reference, or native "
                        "when it loads (auto)")
    p.add_argument("--no-cache", action="store_true",
                   help="estimate the n-gram counts without reading or writing the cache")
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

            from . import _lib

            _lib.load()
            return kdtree, f"native libkdtree {kdtree.library_version()}"
        except Exception as exc:  # noqa: BLE001 - any load failure: report or fall back
            if backend == "native":
                raise UsageError(f"cannot load libkdtree: {exc}") from None
            note = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            from . import reference

            return reference, f"pure-Python reference (libkdtree did not load: {note})"
    from . import reference

    return reference, "pure-Python reference"


def _read_prompt(args) -> tuple[bytes, Path, int]:
    from .cli import UsageError

    path = args.prompt_file if args.prompt_file is not None else ngram.stdlib_dir() / DEFAULT_PROMPT
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise UsageError(f"prompt file {path} is a directory") from None
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    if not data:
        raise UsageError(f"prompt file {path} is empty")
    offset = args.prompt_offset
    if offset is None:
        offset = DEFAULT_OFFSET if args.prompt_file is None else 0
    offset = max(0, min(offset, len(data) - args.prompt_bytes))
    return data[offset: offset + args.prompt_bytes], path, offset


def _progress(total: int, desc: str, disable: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc=desc, unit="B", file=sys.stderr, leave=False,
                disable=True if disable else None, dynamic_ncols=True)


def _run_with_bar(fn, total: int, desc: str, disable: bool, **kw):
    bar = _progress(total, desc, disable)
    try:
        return fn(on_tokens=bar.update if bar is not None else None, **kw)
    finally:
        if bar is not None:
            bar.close()


def _short(path: Path) -> str:
    try:
        return path.relative_to(ngram.stdlib_dir()).as_posix() + " (standard library)"
    except ValueError:
        return str(path)


def run(args: argparse.Namespace) -> int:
    from .cli import UsageError

    if args.draft_order > args.order:
        raise UsageError(f"--draft-order ({args.draft_order}) must be <= --order ({args.order})")
    ops, backend_desc = _ops(args.backend)
    prompt, path, offset = _read_prompt(args)
    out = sys.stdout

    t0 = time.perf_counter()
    corpus = ngram.load_corpus(args.corpus_bytes, hold_out=path)
    counts, cached = ngram.NgramCounts.load_or_estimate(corpus, args.order,
                                                        use_cache=not args.no_cache)
    t_model = time.perf_counter() - t0
    target = ngram.NgramTarget(counts, args.order)
    drafter = ngram.NgramDrafter(counts, args.draft_order)

    held = "held out" if corpus.held_out is not None and any(
        f.resolve() == corpus.held_out for f in ngram.stdlib_sources()) else "not in corpus"
    print("kdtree demo: DDTree speculative decoding (Ringel & Romano, arXiv 2604.12989)", file=out)
    print(f"  tree ops : {backend_desc}", file=out)
    print(f"  target   : order-{args.order} byte n-gram, stupid backoff (alpha {ngram.DEFAULT_ALPHA}), "
          f"greedy (argmax, ties to lower byte)", file=out)
    print(f"  drafter  : order-{args.draft_order} byte n-gram unrolled along its own greedy chain, "
          f"L={args.depth} positions per call", file=out)
    print(f"  corpus   : {len(corpus.data):,} bytes of Python {sys.version_info[0]}.{sys.version_info[1]} "
          f"stdlib sources ({len(corpus.files)} files, sha256 {corpus.sha256[:12]}); counts "
          f"{'loaded from cache' if cached else 'estimated'} in {t_model:.2f} s", file=out)
    print(f"  prompt   : {_short(path)}, bytes {offset}..{offset + len(prompt)} ({held})", file=out)
    print(f"  settings : budget N={args.budget}, depth L={args.depth}, top-K={min(args.budget, 256)}, "
          f"max_new_tokens={args.max_new_tokens}, stop bytes={sorted(set(args.stop_byte)) or 'none'}",
          file=out)

    ar = _run_with_bar(lambda **kw: engine.autoregressive_generate(
        target, prompt, args.max_new_tokens, stop_tokens=args.stop_byte, **kw),
        args.max_new_tokens, "greedy AR", args.no_progress)
    sp = _run_with_bar(lambda **kw: engine.speculative_generate(
        target, drafter, prompt, args.max_new_tokens, budget=args.budget, depth=args.depth,
        stop_tokens=args.stop_byte, ops=ops, **kw),
        args.max_new_tokens, "DDTree", args.no_progress)

    print("\n---- prompt (last 300 bytes shown) " + "-" * 30, file=out)
    print(engine.printable(prompt[-300:]), file=out)
    print(f"---- continuation ({len(sp.tokens)} bytes, stop: {sp.stop_reason}) " + "-" * 24, file=out)
    print(engine.printable(sp.tokens), file=out)
    print("-" * 66, file=out)

    same = sp.tokens == ar.tokens
    if same:
        print("identical to greedy autoregressive decoding: YES", file=out)
    else:
        first = next((i for i, (a, b) in enumerate(zip(ar.tokens, sp.tokens, strict=False)) if a != b),
                     min(len(ar.tokens), len(sp.tokens)))
        print(f"identical to greedy autoregressive decoding: NO (first difference at new byte "
              f"{first}; AR {len(ar.tokens)} bytes, DDTree {len(sp.tokens)} bytes)", file=out)
    ratio = ar.target_calls / sp.target_calls if sp.target_calls else float("nan")
    print(f"target calls       : AR {ar.target_calls}, DDTree {sp.target_calls} "
          f"({ratio:.2f}x fewer); drafter calls {sp.drafter_calls}", file=out)
    print(f"acceptance length  : {sp.mean_acceptance_length:.3f} committed bytes per round = "
          f"(accepted draft bytes + bonus byte) / rounds = {len(sp.tokens)} / {sp.rounds}", file=out)
    if sp.accepted:
        print(f"accepted draft     : mean {sp.mean_accepted_draft_tokens:.3f}, max {max(sp.accepted)} "
              f"of L={args.depth} per round", file=out)
    print(f"wall time          : AR {ar.wall:.3f} s, DDTree {sp.wall:.3f} s (the n-gram target "
          f"is cheap, so on CPU the saving is in target calls, not seconds)", file=out)
    print("time per stage (DDTree)   total ms   per round ms   share", file=out)
    total = sum(sp.times.values()) or 1.0
    for name in engine.STAGES:
        v = sp.times[name]
        per = 1e3 * v / sp.rounds if sp.rounds else 0.0
        print(f"  {name:<8}               {1e3 * v:9.2f}   {per:12.3f}   {100 * v / total:4.1f}%",
              file=out)
    print(f"  (AR: target forward {1e3 * ar.times['verify']:.2f} ms, commit "
          f"{1e3 * ar.times['commit']:.2f} ms)", file=out)

    snap = sp.snapshot
    if snap is not None:
        print(f"\n---- draft tree of round {snap.index} of {sp.rounds} (commits "
              f"{engine.printable(snap.committed)!r}; * = accepted path) ----", file=out)
        print(engine.render_tree(snap.trees, 0, snap.acceptance, max_nodes=args.tree_nodes),
              file=out)
    return 0 if same else 1
