"""Command line: ``python -m kdtree <command> [options]``.

Commands register themselves through :data:`COMMANDS`: each entry is a module exposing
``add_arguments(parser)`` and ``run(args) -> int``. Adding ``generate`` or ``bench`` later
means writing such a module and listing it here.

Exit status: 0 success, 1 a failed check (e.g. the demo's output differs from greedy AR
decoding), 2 a usage or input error (bad flags, unreadable prompt file), reported as one
``kdtree <command>: error: ...`` line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kdtree.apps.demo", "DDTree speculative decoding of the shipped transformer pair (or, with "
                            "--model ngram, a byte n-gram model) on CPU, checked token for token against "
                            "autoregressive decoding (sampled with the same seed, or greedy)"),
    "generate": ("kdtree.apps.generate", "DDTree decoding with a transformer target and block drafter "
                                    "(greedy or sampled, CPU or GPU)"),
}


class UsageError(Exception):
    """An input problem the user can fix; printed as one line, exit status 2."""


def int_in(lo: int, hi: int | None = None):
    """argparse type: an integer >= lo (and <= hi), with a message naming the range."""
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


def float_in(lo: float, hi: float, lo_open: bool = False):
    """argparse type: a number in [lo, hi] (or (lo, hi] with lo_open)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not ((v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return v
    return parse


# Timed runs repeat up to --repeats times, but stop once they have taken this long: the
# line says how many ran, so one slow run on a loaded machine is not mistaken for three.
REPEAT_SECONDS = 60.0


def progress_bar(total: int, desc: str, disable: bool, unit: str):
    """A tqdm bar on stderr (None when tqdm is missing or the bar is disabled)."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                disable=True if disable else None, dynamic_ncols=True)


def run_with_bar(fn, total: int, desc: str, disable: bool, unit: str = "tok", **kw):
    """fn(on_tokens=..., **kw) with a progress bar of `total` tokens."""
    bar = progress_bar(total, desc, disable, unit)
    try:
        return fn(on_tokens=bar.update if bar is not None else None, **kw)
    finally:
        if bar is not None:
            bar.close()


def timed_pair(runs: dict, repeats: int, total: int, disable_bars: bool, unit: str) -> tuple[dict, dict, str]:
    """Runs each ``name -> fn(on_tokens=...)`` of `runs` in turn, `repeats` times (fewer
    once REPEAT_SECONDS have passed). Returns (first result by name, wall times by name,
    a note on how many runs the times are over)."""
    first: dict = {}
    walls: dict = {name: [] for name in runs}
    spent = 0.0
    done = 0
    for i in range(repeats):
        for name, fn in runs.items():
            label = name if repeats == 1 else f"{name} ({i + 1}/{repeats})"
            res = run_with_bar(fn, total, label, disable_bars, unit)
            first.setdefault(name, res)
            walls[name].append(res.wall)
            spent += res.wall
        done += 1
        if spent > REPEAT_SECONDS and done < repeats:
            break
    if done == repeats:
        note = "one run each" if repeats == 1 else f"median of {done} runs each, after a warm-up"
    else:
        how = "one run each" if done == 1 else f"median of {done} runs each"
        note = (f"{how}, not the {repeats} asked: the runs took {spent:.0f} s, past the "
                f"{REPEAT_SECONDS:.0f} s spent timing at most")
    return first, walls, note


def one_line(exc: BaseException, limit: int = 600) -> str:
    """An exception's message on one line (multi-line messages joined), at most ``limit``
    characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def wall_text(walls: list[float]) -> str:
    """'1.23 s' for one run, '1.23 s (min 1.20, max 1.31)' for the median of several."""
    walls = sorted(walls)
    median = walls[len(walls) // 2] if len(walls) % 2 else 0.5 * (walls[len(walls) // 2 - 1] + walls[len(walls) // 2])
    return f"{median:.2f} s" if len(walls) == 1 else f"{median:.2f} s (min {walls[0]:.2f}, max {walls[-1]:.2f})"


def tree_ops_text(device: str = "cpu") -> str:
    """Which backend runs the tree operations: the native library (and where it was
    loaded from) on the CPU, and whether KV compaction runs on the GPU."""
    import kdtree

    try:
        lib = kdtree.library_version()
        path = kdtree.library_path()
    except ImportError as exc:
        return f"libkdtree not loadable ({exc})"
    text = f"libkdtree {lib} ({path}): top-k, tree build and verify in C on the CPU"
    if str(device).split(":")[0] == "cuda":
        cuda = kdtree.cuda_devices()
        text += ("; KV compaction by its CUDA kernel" if cuda > 0
                 else "; KV compaction in torch (the library was built without CUDA or sees no GPU)")
    return text


MAX_PROMPT_FILE_BYTES = 64 * 2**20


def read_regular_file(path) -> bytes:
    """A prompt file's bytes: regular files only (a FIFO would block, /dev/zero never ends),
    at most MAX_PROMPT_FILE_BYTES, not empty. Raises UsageError otherwise."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                raise UsageError(f"prompt file {path} is {kind}")
            data = f.read(MAX_PROMPT_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise UsageError(f"prompt file {path} is larger than {MAX_PROMPT_FILE_BYTES // 2**20} MiB")
    if not data:
        raise UsageError(f"prompt file {path} is empty")
    return data


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its
    default or there is none worth showing (None, False, an empty list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "default" in text or d is None or d is False or (isinstance(d, list) and not d):
            return text
        return super()._get_help_string(action)


def plural(n: int, word: str) -> str:
    """'1 round', '2 rounds', '1,024 tokens'."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kdtree" if Path(sys.argv[0]).name == "kdtree" else "python -m kdtree",  # the console script or -m
        description="kdtree: native core for DDTree speculative decoding "
                    "(Ringel & Romano, arXiv 2604.12989).")
    from .. import __version__  # (the package's; the native library's is kdtree.library_version())

    parser.add_argument("--version", action="version", version=f"kdtree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=getattr(mod, "DESCRIPTION", help_text),
                           formatter_class=_DefaultsFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # exits 2 with a usage message on bad flags
    if extra:
        # Reported by the subcommand's parser, whose usage lists the options it does take
        # (argparse would print the top-level usage, which names none of them), unless the
        # first one came before the subcommand's name.
        tokens = list(sys.argv[1:] if argv is None else argv)
        first = tokens.index(extra[0]) if extra[0] in tokens else len(tokens)
        before_command = args.command not in tokens[:first]
        (parser if before_command else args._parser).error(f"unrecognized arguments: {shlex.join(extra)}")
    from .._native import KdtreeError
    from ..engine.hf import NonFiniteLogitsError

    try:
        return int(args._run(args) or 0)
    except UsageError as exc:
        args._parser.exit(2, f"{args._parser.prog}: error: {exc}\n")
    except (KdtreeError, NonFiniteLogitsError) as exc:  # a run that fails on its data (NaN logits of a broken model)
        print(f"{args._parser.prog}: failed: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
