"""``python -m kdtree generate``: DDTree speculative decoding of a transformer target with a
DFlash drafter or a kdtree block drafter (kdtree.hf, kdtree.engine.dflash, kdtree.drafter),
on CPU or GPU.

The default pair is the one shipped in ``fixtures/models/stdlib-qwen3`` (a 10.6 M-parameter
Qwen3 target and a DFlash drafter in the published format, trained on the Python sources of
the standard library and of permissively licensed packages; its ``README.md`` is the model
card). It also runs plain autoregressive decoding of the same target and checks that the
two outputs are identical: for greedy decoding (``--temperature 0``,
the default) and for sampling (``--temperature > 0``, optionally ``--top-p``) alike, since
a draw is keyed by ``--seed`` and the position of the token it chooses, so the tree's row
and the autoregressive step for one position make the same draw (:class:`kdtree.hf.HFTarget`).
Where they differ, both runs are redone in the next wider float (float32 -> float64,
16-bit -> float32) and the first differing choice is weighed (its logit gap, or its draw's
distance from the boundary of the cumulative distribution, against how far the narrow float
moves the logits there): equal there and within reach, the difference was rounding (a
near-tie or a draw at a boundary, computed in a different order by the tree forward) and
the exit status stays 0; otherwise, or in a float64 run, the status is 1.
Printed: the continuation, target forwards (AR vs DDTree), the mean acceptance length and
its histogram, time per stage, and one round's draft tree;
``--plot`` also writes them as a picture (matplotlib).

Source: Ringel & Romano, arXiv 2604.12989; verification semantics: ``ddtree-tree-build.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..engine import rounds as engine
from . import text
from .cli import float_in as _float_in
from .cli import int_in as _int_in
from .cli import one_line, timed_pair, tree_ops_text, wall_text
from .cli import plural as _plural

DESCRIPTION = __doc__.split("\n\n")[0].replace("``", "").replace("\n", " ")
SHIPPED_PAIR = Path("fixtures") / "models" / "stdlib-qwen3"
# How to install the transformer engine's packages. kdtree is not on PyPI (another project
# holds the name there), so the hint never says "pip install kdtree[...]".
MODELS_HINT = ('pip install torch "transformers==5.24.0" "tokenizers==0.23.3" "safetensors==0.8.0" '
               '"accelerate==1.16.0" (add --extra-index-url https://download.pytorch.org/whl/cpu for the small CPU '
               'build of torch); in a kdtree checkout, pip install ".[models]" or `nox -s demo`')


def _default_models() -> Path:
    """The shipped pair: in the checkout this package runs from, else (an installed package)
    under the current folder, as when running from a checkout's root."""
    here = Path(__file__).resolve().parents[3] / SHIPPED_PAIR
    return here if here.is_dir() else SHIPPED_PAIR


DEFAULT_MODELS = _default_models()
EOS = "<|endoftext|>"
MAX_BUDGET = 4096


def temperature_arg(text: str) -> float:
    v = _float_in(0.0, 100.0)(text)
    if 0.0 < v < 1e-6:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or >= 1e-6, got {v}")
    return v


def _budget_arg(text: str) -> int | str:
    return "auto" if text == "auto" else _int_in(1, MAX_BUDGET)(text)


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")


PROMPT_CHARS = 400  # --prompt-chars default
TREE_NODES = 40  # --tree-nodes default (kdtree demo's too)
PROMPT_SHOWN = 300  # prompt characters printed above the continuation


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: a slice of kdtree's own engine/rounds.py, text the "
                                      "models never saw)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--prompt-offset", type=_int_in(0), default=None,
                   help="first character of the prompt within --prompt-file (default 0; 2000 for the default prompt)")
    p.add_argument("--prompt-chars", type=_int_in(1), default=PROMPT_CHARS,
                   help="characters of the file used as the prompt (the shipped drafter was trained on "
                        "640-token sequences: 512 of text and 128 of the target's continuation)")
    p.add_argument("--models", type=Path, default=None,
                   help=f"folder with tokenizer.json, target/ and drafter/ (tools/train_models.py; default: "
                        f"{SHIPPED_PAIR} of the checkout, or under the current folder)")
    p.add_argument("--target", type=Path, default=None,
                   help="a Hugging Face model folder (Llama, Qwen2, Qwen3, Qwen3-MoE; config.json, safetensors and "
                        "tokenizer.json) to use instead of --models; needs --drafter")
    p.add_argument("--drafter", type=Path, default=None,
                   help="the drafter folder for --target: a DFlash drafter in its published format (config.json "
                        "with dflash_config, model.safetensors) or a kdtree block drafter (drafter_config.json)")
    p.add_argument("--budget", type=_budget_arg, default=64,
                   help="draft nodes per tree N; with --batch-size also 'auto' (the budget that maximises expected "
                        "tokens/s for the batch at hand, from round times measured at start-up)")
    p.add_argument("--depth", type=_int_in(1), default=None,
                   help="draft positions per round L (default and maximum: the drafter's block size - 1)")
    p.add_argument("--max-new-tokens", type=_int_in(1), default=96, help="tokens to generate (exact cap)")
    p.add_argument("--temperature", type=temperature_arg, default=0.0,
                   help="0: greedy; >= 1e-6: sample from softmax(logits / T)")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus for sampling")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0, help="sampling seed")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                   help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--no-ar", action="store_true", help="skip the autoregressive run (no identity check)")
    p.add_argument("--no-eos-stop", action="store_true", help=f"do not stop at {EOS}")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="also stop after the tokens TEXT encodes to (1 to 16 tokens; repeat for several), kept in "
                        "the output; matched as that token sequence, so the same text emitted as other tokens "
                        "does not stop: a word inside running text usually carries its leading space "
                        "(--stop ' given', not --stop 'given'); the header shows each stop's tokens")
    p.add_argument("--plot", type=Path, default=None,
                   help="write the acceptance-length histogram and one round's tree to this PNG/SVG file")
    p.add_argument("--tree-nodes", type=_int_in(0), default=TREE_NODES,
                   help="most draft-tree nodes drawn (the best by score)")
    p.add_argument("--repeats", type=_int_in(1, 100), default=3,
                   help="timed runs of each method, after an untimed warm-up (fewer once they have taken a "
                        "minute; the wall-time line says how many ran)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--batch-size", type=_int_in(1, 4096), default=None,
                   help="decode with the batched engine (request slots, continuous batching, CUDA graphs on a "
                        "GPU), this many requests at a time (1 with --prompts-file alone)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="batched engine: one prompt a line (the escapes \\n and \\\\ are decoded), or JSON "
                        "lines (every line of a .jsonl file, else lines starting with '{') with \"prompt\" and "
                        "optional max_new_tokens, temperature, top_p, top_k, seed")
    p.add_argument("--top-k", type=_int_in(0), default=0, help="batched engine: top-k for sampling (0: all)")
    p.add_argument("--tp", action="store_true",
                   help="shard the target over the ranks of a torchrun launch with transformers' tensor-parallel "
                        "plan (gloo on --device cpu, NCCL on cuda: each rank on cuda:LOCAL_RANK), with either "
                        "engine; every rank decodes the same tokens, rank 0 prints (e.g. torchrun "
                        "--nproc-per-node 2 -m kdtree generate --tp)")


def _default_prompt(args) -> tuple[str, str]:
    from .cli import UsageError, read_regular_file

    if args.prompt is not None:
        if not args.prompt:
            raise UsageError("--prompt is empty")
        if args.prompt_offset is not None or args.prompt_chars != PROMPT_CHARS:
            raise UsageError("--prompt-offset and --prompt-chars select a piece of a file: use them with "
                             "--prompt-file (or the default prompt), not with --prompt")
        return args.prompt, "--prompt"
    path = args.prompt_file if args.prompt_file is not None else Path(engine.__file__)
    text = read_regular_file(path).decode("utf-8", errors="replace")
    offset = args.prompt_offset if args.prompt_offset is not None else (0 if args.prompt_file else 2000)
    if offset >= len(text):
        raise UsageError(f"--prompt-offset {offset} is beyond the end of {path} ({len(text)} characters)")
    piece = text[offset: offset + args.prompt_chars]
    return piece, f"{path}, characters {offset}..{offset + len(piece)}"


def _check_device(device: str) -> None:
    import torch

    from .cli import UsageError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: this torch sees no CUDA device (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise UsageError(f"--device {device}: only cpu and cuda devices are supported")
    elif dev.index not in (None, 0):
        raise UsageError(f"--device {device}: the CPU device takes no index (use cpu)")


def _check_plot_path(path: Path) -> None:
    from .cli import UsageError

    ext = path.suffix.lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        raise UsageError(f"--plot {path}: the file name must end in one of .{', .'.join(PLOT_FORMATS)}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--plot {path}: folder {parent} does not exist")
    import tempfile

    try:  # the picture is written at the end of the run: find out now whether it can be
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise UsageError(f"--plot {path}: folder {parent} is not writable ({exc.strerror})") from None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (in a kdtree checkout, pip install "
                         "\".[models]\" and `nox -s demo` install it)") from None


def pair_source(args: argparse.Namespace) -> str:
    """Where the models come from, for the run's header."""
    if getattr(args, "target", None) is not None:
        return f"target {args.target}, drafter {args.drafter}"
    return str(args.models or DEFAULT_MODELS)


def load_models(args: argparse.Namespace):
    """(tokenizer, target, drafter) from ``--target``/``--drafter`` or ``--models``."""
    from .cli import UsageError

    if (args.target is None) != (args.drafter is None):
        raise UsageError("--target and --drafter go together (or use --models for a folder holding both)")
    tp = bool(getattr(args, "tp", False))
    if args.target is not None:
        if args.models is not None:
            raise UsageError("--models and --target/--drafter name the models twice: give one or the other")
        return load_target_and_drafter(args.target, args.drafter, args.device, args.dtype, tp=tp)
    return load_pair(args.models or DEFAULT_MODELS, args.device, args.dtype, tp=tp)


def start_tp(args: argparse.Namespace) -> None:
    """--tp: join the torchrun launch's process group (gloo on the CPU, NCCL on CUDA, each
    rank on cuda:LOCAL_RANK) and keep rank 0's output only."""
    import os
    import sys

    import torch
    import torch.distributed as dist

    from .cli import UsageError

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError("--tp runs under torchrun (e.g. torchrun --nproc-per-node 2 -m kdtree generate --tp): "
                         "RANK and WORLD_SIZE are not set")
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise UsageError(f"--tp: LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
        args.plot = None  # rank 0 draws it
        args.no_progress = True  # and shows the progress bars


def load_target_and_drafter(target_dir: Path, drafter_dir: Path, device: str, dtype: str | None, *,
                            tp: bool = False):
    """(tokenizer, target model, drafter model) from a Hugging Face target folder (with its
    tokenizer.json) and a drafter folder (published DFlash format, or kdtree's block
    drafter). The pair is checked on the configs (vocabulary, hidden size, target layers)
    before any weight is loaded. Raises UsageError naming the folder and the mismatch."""
    from .cli import UsageError

    for flag, d in (("--target", target_dir), ("--drafter", drafter_dir)):
        if not d.is_dir():
            raise UsageError(f"{flag} {d}: {'not a folder' if d.exists() else 'no such folder'}")
    if not (target_dir / "tokenizer.json").is_file():
        raise UsageError(f"--target {target_dir}: no tokenizer.json (a Hugging Face model folder holds one)")
    try:
        import torch  # noqa: F401
        from tokenizers import Tokenizer
        from transformers import AutoConfig
    except ImportError as exc:
        raise UsageError(f"the transformer engine needs torch, transformers and tokenizers ({exc}): "
                         f"{MODELS_HINT}") from None
    from ..engine import dflash
    from ..engine.drafter import CONFIG_NAME, BlockDrafterConfig, load_drafter
    from ..engine.hf import load_causal_lm

    try:
        tcfg = AutoConfig.from_pretrained(str(target_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a broken config: one line naming the folder
        raise UsageError(f"--target {target_dir}: cannot read its config: {exc}") from None
    tc = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    is_dflash = dflash.is_dflash_folder(drafter_dir)
    try:
        if is_dflash:
            dflash.check_pair(dflash.dflash_config(drafter_dir / dflash.CONFIG_NAME), tcfg, f"--drafter {drafter_dir}")
        elif (drafter_dir / CONFIG_NAME).is_file():
            dcfg = BlockDrafterConfig.from_json((drafter_dir / CONFIG_NAME).read_text())
            problems = []
            if dcfg.vocab_size != int(tc.vocab_size):
                problems.append(f"vocabulary {dcfg.vocab_size} != the target's {tc.vocab_size}")
            if any(not 0 <= i <= int(tc.num_hidden_layers) for i in dcfg.target_layers):
                problems.append(f"target_layers {list(dcfg.target_layers)} outside the target's hidden states "
                                f"0 .. {tc.num_hidden_layers}")
            elif dcfg.feature_size != len(dcfg.target_layers) * int(tc.hidden_size):
                problems.append(f"feature_size {dcfg.feature_size} != {len(dcfg.target_layers)} layers x "
                                f"{tc.hidden_size}")
            if problems:
                raise ValueError(f"--drafter {drafter_dir} does not fit the target: " + "; ".join(problems))
        elif (drafter_dir / dflash.CONFIG_NAME).is_file():  # a config.json that is not a DFlash one: say why
            dflash.dflash_config(drafter_dir / dflash.CONFIG_NAME)
        else:
            raise ValueError(f"--drafter {drafter_dir}: neither a DFlash drafter (config.json with dflash_config) "
                             f"nor a kdtree block drafter ({CONFIG_NAME})")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    def loaded(flag, folder, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any broken file: one line naming the folder
            first = one_line(exc)
            raise UsageError(f"cannot load {flag} {folder}: {type(exc).__name__}: {first}") from None

    tok = loaded("--target", target_dir, lambda: Tokenizer.from_file(str(target_dir / "tokenizer.json")))
    target = loaded("--target", target_dir, lambda: load_causal_lm(target_dir, device=device, dtype=dtype, tp=tp))
    drafter = loaded("--drafter", drafter_dir, lambda: dflash.load_dflash(drafter_dir, target) if is_dflash
                     else load_drafter(drafter_dir, device=device, dtype=dtype))
    if tok.get_vocab_size(with_added_tokens=True) > int(tc.vocab_size):
        raise UsageError(f"--target {target_dir}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} "
                         f"tokens, more than the model's vocabulary of {tc.vocab_size}")
    return tok, target, drafter


def drafter_kind(model) -> str:
    from ..engine import dflash

    return "DFlash drafter (published format)" if dflash.is_dflash(model) else "kdtree block drafter (DFlash-style)"


def load_pair(models: Path, device: str, dtype: str | None, *, tp: bool = False):
    """(tokenizer, target model, drafter model) from a folder written by
    tools/train_models.py. Raises UsageError for a missing folder or library."""
    from .cli import UsageError

    try:
        is_dir, exists = models.is_dir(), models.exists()
        has_tokenizer = is_dir and (models / "tokenizer.json").is_file()
    except OSError as exc:  # e.g. a folder this user cannot read
        raise UsageError(f"--models {models}: {exc.strerror or exc}") from None
    if not is_dir and models == DEFAULT_MODELS:
        raise UsageError(f"the shipped pair {models} is not here: it comes with a kdtree checkout (run from the "
                         "checkout's root), or pass --models FOLDER (a folder written by tools/train_models.py)")
    if not is_dir:
        raise UsageError(f"--models {models}: {'not a folder' if exists else 'no such folder'} "
                         f"(expected a folder written by tools/train_models.py; the shipped pair is "
                         f"fixtures/models/stdlib-qwen3 in a kdtree checkout)")
    if not has_tokenizer:
        raise UsageError(f"{models}: no tokenizer.json (expected a folder written by tools/train_models.py)")
    try:
        import torch  # noqa: F401
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise UsageError(f"the transformer pair needs torch, transformers and tokenizers ({exc}): "
                         f"{MODELS_HINT}") from None
    from ..engine import dflash
    from ..engine.drafter import load_drafter
    from ..engine.hf import load_causal_lm

    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    try:
        tok = Tokenizer.from_file(str(models / "tokenizer.json"))
        target = load_causal_lm(models / "target", device=device, dtype=dtype, tp=tp)
        if (models / "drafter" / dflash.CONFIG_NAME).is_file():  # the published DFlash format (errors say why)
            drafter = dflash.load_dflash(models / "drafter", target, device=device, dtype=dtype)
        else:
            drafter = load_drafter(models / "drafter", device=device, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - any broken file: one line naming the folder
        first = one_line(exc)
        raise UsageError(f"cannot load the models in {models}: {type(exc).__name__}: {first}") from None
    cfg = target.config
    problems = []
    if tok.get_vocab_size(with_added_tokens=True) > int(cfg.vocab_size):
        problems.append(f"the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, more than the "
                        f"target's vocabulary of {cfg.vocab_size}")
    if int(cfg.vocab_size) != drafter.vocab_size:
        problems.append(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {cfg.vocab_size}")
    layers = list(drafter.feature_layers)
    if any(not 0 <= i <= int(cfg.num_hidden_layers) for i in layers):
        problems.append(f"the drafter's feature layers (hidden states {layers}) are outside the target's "
                        f"0..{cfg.num_hidden_layers}")
    elif drafter.feature_size != len(layers) * int(cfg.hidden_size):
        problems.append(f"drafter feature_size {drafter.feature_size} != {len(layers)} layers x "
                        f"{cfg.hidden_size}")
    if problems:
        raise UsageError(f"{models}: the tokenizer or the drafter does not fit the target: " + "; ".join(problems))
    return tok, target, drafter


REPEAT_WINDOW = 8
REPEAT_NOTE = 0.25


def repeated_share(tokens: list[int], before: list[int], window: int = REPEAT_WINDOW) -> float:
    """Share of ``tokens`` that end a ``window``-token run already seen earlier (in
    ``before`` + the tokens so far): how much of a continuation is a loop."""
    seq = list(before) + list(tokens)
    seen: set[tuple[int, ...]] = set()
    start = len(before)
    hits = 0
    for i in range(window, len(seq) + 1):
        w = tuple(seq[i - window:i])
        if i - 1 >= start and w in seen:
            hits += 1
        seen.add(w)
    return hits / len(tokens) if tokens else 0.0


def _token_str(tok) -> Any:
    def show(t: int) -> str:
        return repr(tok.decode([int(t)])) if t >= 0 else "<none>"
    return show


# How far the two decoders' choices may drift apart by rounding alone, in units of how far
# the narrow float's logits are from the wider float's at the differing token (each
# decoder's route rounds about that much, in its own order).
ROUNDING_FACTOR = 4.0


def first_token_margin(target_model, wide_model, context, a, d, args):
    """How close the choice between tokens ``a`` (autoregressive) and ``d`` (DDTree) after
    ``context`` was, against how much the narrow float moves the logits there.

    Returns ``(margin, reach, unit)``, from one forward over ``context`` in each float
    (logit errors ``e = narrow - wide``):

    - greedy: ``margin`` is the wider float's logit gap between ``a`` and ``d``; ``reach``
      is ``ROUNDING_FACTOR * (|e[a]| + |e[d]|)`` (how far rounding moves that gap);
    - sampled: the draw takes the first token whose cumulative probability (wider float,
      tempered and top-p filtered as the target draws, normalised) exceeds the keyed
      uniform ``u``. ``d > a``: the other route must have put the boundary after token
      ``d - 1`` at or below ``u``, so ``margin = cdf[d - 1] - u``; ``d < a``: it must have
      put the boundary after ``d`` above ``u``, ``margin = u - cdf[d]``. ``reach`` is
      ``ROUNDING_FACTOR * sum_i p_i |e_i| / T``: a logit error e_i moves p_i by about
      p_i e_i / T, so a cumulative probability moves by about the probability-weighted
      error over T."""
    import torch

    from ..engine.hf import keyed_uniforms, top_p_filter

    ids = torch.as_tensor([context], dtype=torch.long, device=next(target_model.parameters()).device)
    with torch.no_grad():
        narrow = target_model(input_ids=ids).logits[0, -1].to(torch.float64)
        wide = wide_model(input_ids=ids).logits[0, -1].to(torch.float64)
    err = (narrow - wide).abs()
    if not args.temperature:
        return abs(float(wide[a] - wide[d])), ROUNDING_FACTOR * float(err[a] + err[d]), "logit gap"
    probs = torch.softmax((wide - wide.max()) / args.temperature, dim=-1)
    if args.top_p < 1.0:
        probs = top_p_filter(probs[None], args.top_p)[0]
    probs = probs / probs.sum()
    cdf = torch.cumsum(probs, dim=-1)
    u = float(keyed_uniforms(args.seed, [len(context)])[0])
    margin = float(cdf[d - 1]) - u if d > a else u - float(cdf[d])
    reach = ROUNDING_FACTOR * float((probs * err).sum()) / args.temperature
    return abs(margin), reach, "uniform's distance from the CDF boundary"


def mismatch_report(args, target_model, drafter_model, layers, prompt, stops, depth, ar_tokens, dd_tokens,
                    what, out) -> int:
    """DDTree's text differs from autoregressive decoding's. In float32 or 16-bit floats that
    can be rounding alone: the tree forward and the one-token forward compute the same
    logits in different orders, and a draw whose uniform lies that close to a boundary of the
    cumulative distribution (or an argmax that close to a tie) can flip. Two checks, both
    needed for "rounding" (exit status 0): both runs redone in the next wider float
    (float32 -> float64, 16-bit -> float32) must agree, and at the first differing token the
    choice must have been within rounding reach (:func:`first_token_margin`: the logit gap,
    or the draw's distance from the CDF boundary, at most ``ROUNDING_FACTOR`` times what the
    narrow float's logit errors there move it). Otherwise, or already in float64, it is a real
    difference (status 1)."""
    import copy

    import torch

    from ..engine.drafter import BlockDrafterRunner
    from ..engine.hf import HFTarget

    def first_difference(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    first = first_difference(ar_tokens, dd_tokens)
    dtype = next(target_model.parameters()).dtype
    wider = {torch.float32: torch.float64, torch.float16: torch.float32, torch.bfloat16: torch.float32}.get(dtype)
    name = str(dtype).removeprefix("torch.")
    print(f"identical to {what}: NO in {name}, first difference at new token {first}", file=out)
    if wider is None:
        return 1
    # copied together: a DFlash drafter holds the target's embedding and LM head by reference
    t2, d2 = copy.deepcopy((target_model, drafter_model))
    t2, d2 = t2.to(wider), d2.to(wider)

    def tgt():
        return HFTarget(t2, temperature=args.temperature, top_p=args.top_p, seed=args.seed, feature_layers=layers)

    seqs = getattr(args, "stop_sequences", ())
    a = engine.autoregressive_generate(tgt(), prompt, args.max_new_tokens, stop_tokens=stops, stop_sequences=seqs)
    d = engine.speculative_generate(tgt(), BlockDrafterRunner(d2), prompt, args.max_new_tokens, budget=args.budget,
                                    depth=depth, stop_tokens=stops, stop_sequences=seqs)
    wname = str(wider).removeprefix("torch.")
    if a.tokens != d.tokens:
        print(f"  rerun in {wname}  : identical: NO, first difference at new token "
              f"{first_difference(a.tokens, d.tokens)} (not rounding)", file=out)
        return 1
    print(f"  rerun in {wname}  : identical: YES", file=out)
    if first >= min(len(ar_tokens), len(dd_tokens)):  # one text ends inside the other: no token pair to weigh
        print(f"  margin            : not measured (one text is a prefix of the other); the {name} difference is "
              f"taken for rounding", file=out)
        return 0
    margin, bound, unit = first_token_margin(target_model, t2, list(prompt) + list(ar_tokens[:first]),
                                             int(ar_tokens[first]), int(dd_tokens[first]), args)
    within = margin <= bound
    scale = (f"the probability-weighted |{name} - {wname}| logit error there / T" if args.temperature else
             f"the |{name} - {wname}| logit errors of the two tokens")
    print(f"  margin at token {first}: {unit} {margin:.3g}, rounding reach {bound:.3g} ({ROUNDING_FACTOR:g}x "
          f"{scale}): {'within' if within else 'BEYOND'}", file=out)
    if within:
        print(f"  the {name} difference is taken for rounding (the tree forward and the one-token forward round "
              f"the same logits differently, which flips a "
              f"{'draw near a boundary of the cumulative distribution' if args.temperature else 'near-tie'})",
              file=out)
        return 0
    print(f"  not rounding: the choice at token {first} was not close enough for {name} rounding to flip it, and "
          f"the {wname} runs agree (an error of the {name} path alone)", file=out)
    return 1


def stop_sequences_of(tok, texts) -> list[list[int]]:
    """--stop: each text's token ids (1 to KDT_MAX_STOP_LENGTH = 16 of them)."""
    from .cli import UsageError

    out = []
    for stop in texts or ():
        ids = tok.encode(stop, add_special_tokens=False).ids
        if not 1 <= len(ids) <= 16:
            raise UsageError(f"--stop {stop!r} encodes to {len(ids)} tokens; a stop sequence takes 1 to 16")
        out.append(list(ids))
    return out


def stop_label(tok, text: str, ids) -> str:
    """A --stop for the header: the text and the pieces its tokens decode to (the match is
    on those tokens, so a missing leading space shows here)."""
    return f"{text!r} (tokens {' '.join(repr(tok.decode([int(i)])) for i in ids)})"


def run(args: argparse.Namespace, *, header: str = "kdtree generate") -> int:
    if getattr(args, "batch_size", None) is not None or getattr(args, "prompts_file", None) is not None:
        from . import batched

        return batched.run(args, header=header)
    if args.budget == "auto" or args.top_k:
        from .cli import UsageError

        raise UsageError(f"{'--budget auto' if args.budget == 'auto' else '--top-k'} is a setting of the batched "
                         f"engine: add --batch-size B")
    from ..engine.drafter import BlockDrafterRunner
    from ..engine.hf import HFTarget
    from .cli import UsageError

    prompt_text, prompt_desc = _default_prompt(args)
    if args.plot is not None:
        _check_plot_path(args.plot)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError(f"the transformer pair needs torch, transformers and tokenizers: {MODELS_HINT}") from None
    _check_device(args.device)
    if getattr(args, "tp", False):
        start_tp(args)
    if args.temperature == 0.0 and args.top_p < 1.0:
        raise UsageError(f"--top-p {args.top_p} applies to sampling only: add --temperature T > 0 "
                         f"(greedy decoding takes the argmax)")
    t0 = time.perf_counter()
    tok, target_model, drafter_model = load_models(args)
    t_load = time.perf_counter() - t0
    max_depth = drafter_model.max_depth
    depth = max_depth if args.depth is None else args.depth
    if depth > max_depth:
        raise UsageError(f"--depth {depth} exceeds this drafter's {max_depth} positions per call")
    max_pos = int(getattr(target_model.config, "max_position_embeddings", 0) or 0)
    if max_pos:
        # Refuse a prompt that cannot fit before tokenizing it (tokenizing a huge text
        # costs far more memory than the text): no token covers more characters than its
        # byte-level string is long.
        longest = max(len(tok.id_to_token(i) or "") for i in range(tok.get_vocab_size(with_added_tokens=True)))
        if len(prompt_text) > max(1, longest) * max_pos:
            raise UsageError(f"the prompt ({len(prompt_text)} characters) cannot fit the target's {max_pos} "
                             f"positions (a token covers at most {longest} characters); shorten it")
    prompt = tok.encode(prompt_text).ids
    if not prompt:
        raise UsageError("the prompt encodes to no tokens")
    if max_pos and len(prompt) + args.max_new_tokens + depth > max_pos:
        raise UsageError(f"prompt ({len(prompt)} tokens) + --max-new-tokens ({args.max_new_tokens}) + depth ({depth}) "
                         f"exceed the target's {max_pos} positions")
    eos = tok.token_to_id(EOS)
    stops = [] if args.no_eos_stop or eos is None else [eos]
    args.stop_sequences = stop_sequences_of(tok, args.stop)
    seqs = args.stop_sequences
    layers = drafter_model.feature_layers
    out = sys.stdout
    greedy = args.temperature == 0.0
    n_params = sum(p.numel() for p in target_model.parameters())
    d_params = sum(p.numel() for p in drafter_model.parameters())
    print(f"{header}: DDTree speculative decoding (Ringel & Romano, arXiv 2604.12989)", file=out)
    print(f"  models   : {pair_source(args)} (loaded in {t_load:.2f} s, {args.device}, "
          f"{next(target_model.parameters()).dtype})", file=out)
    card = None if getattr(args, "target", None) is not None else (args.models or DEFAULT_MODELS) / "README.md"
    if card is not None and card.is_file():
        print(f"  card     : {card} (how the pair was trained, its corpus and measurements)", file=out)
    print(f"  target   : {type(target_model).__name__}, {n_params / 1e6:.2f} M parameters, "
          + ("greedy (argmax, ties to the lower id)" if greedy else
             f"sampling, temperature {args.temperature}, top-p {args.top_p}, seed {args.seed}"), file=out)
    ids = getattr(drafter_model, "target_layer_ids", None)  # DFlash: 0-based layers; hidden_states index = id + 1
    reads = (f"target layers {list(ids)} (hidden_states {list(layers)})" if ids is not None
             else f"target hidden states {list(layers)}")
    print(f"  drafter  : {drafter_kind(drafter_model)}, {d_params / 1e6:.2f} M parameters, {reads}, "
          f"L={depth} positions per call (block size {drafter_model.max_depth + 1}: the root and {drafter_model.max_depth} drafted)", file=out)
    print(f"  prompt   : {prompt_desc}: {len(prompt)} tokens", file=out)
    print(f"  tree ops : {tree_ops_text(args.device)}", file=out)
    stop_text = ", ".join(([EOS] if stops else []) + [stop_label(tok, t, q) for t, q in
                                                       zip(args.stop or (), seqs, strict=True)])
    tp_text = ""
    if getattr(args, "tp", False):
        import torch.distributed as dist

        tp_text = f", tensor-parallel over {dist.get_world_size()} ranks"
    print(f"  settings : budget N={args.budget}, depth L={depth}, max_new_tokens={args.max_new_tokens}, "
          f"stop at {stop_text or 'nothing'}{tp_text}", file=out)
    trained = int(getattr(target_model.config, "kdtree_trained_window", 0) or 0)
    if trained and len(prompt) + args.max_new_tokens > trained:
        print(f"  note     : prompt + new tokens ({len(prompt) + args.max_new_tokens}) exceed the {trained}-token "
              f"windows the pair was trained on; expect weaker drafts", file=out)

    def new_target():
        return HFTarget(target_model, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                        feature_layers=layers)

    try:
        new_target()  # a model the engine cannot drive (sliding windows, ...) fails here, in one line
    except ValueError as exc:
        raise UsageError(f"{args.target or (args.models or DEFAULT_MODELS) / 'target'}: {exc}") from None

    runner = BlockDrafterRunner(drafter_model)
    # Untimed warm-up: one new token by each method first, so that one-off costs (lazy
    # initialisation, allocator growth) land on neither timed run.
    if not args.no_ar:
        engine.autoregressive_generate(new_target(), prompt, 1)
    engine.speculative_generate(new_target(), runner, prompt, 1, budget=args.budget, depth=depth, snapshot=None)
    runs = {}
    if not args.no_ar:
        runs["greedy AR" if greedy else "sampled AR"] = lambda **kw: engine.autoregressive_generate(
            new_target(), prompt, args.max_new_tokens, stop_tokens=stops, stop_sequences=seqs, **kw)
    runs["DDTree"] = lambda **kw: engine.speculative_generate(
        new_target(), runner, prompt, args.max_new_tokens, budget=args.budget, depth=depth, stop_tokens=stops,
        stop_sequences=seqs, **kw)
    results, walls, timing_note = timed_pair(runs, args.repeats, args.max_new_tokens, args.no_progress, "tok")
    sp = results["DDTree"]
    ar_name = next((n for n in runs if n != "DDTree"), None)
    ar = results.get(ar_name)

    shown = prompt_text[-PROMPT_SHOWN:]
    what = (_plural(len(prompt_text), "character") if len(shown) == len(prompt_text)
            else f"last {len(shown)} of {len(prompt_text):,} characters shown")
    print(f"\n---- prompt ({what}) {'-' * 30}", file=out)
    print(shown, file=out)
    print(f"---- continuation ({_plural(len(sp.tokens), 'token')}, stop: {sp.stop_reason}) {'-' * 24}", file=out)
    print(tok.decode(sp.tokens), file=out)
    print("-" * 66, file=out)
    rep = repeated_share(sp.tokens, prompt)
    status = 0
    if ar is not None:
        same = ar.tokens == sp.tokens
        what = ("greedy autoregressive decoding" if greedy else
                f"autoregressive sampling with the same seed ({args.seed}; draws are keyed by seed and position)")
        if same:
            print(f"identical to {what}: YES", file=out)
            status = 0
        else:
            status = mismatch_report(args, target_model, drafter_model, layers, prompt, stops, depth, ar.tokens,
                                     sp.tokens, what, out)
        ratio = ar.target_calls / max(1, sp.target_calls)
        print(f"target forwards    : AR {ar.target_calls}, DDTree {sp.target_calls} ({ratio:.2f}x fewer); "
              f"drafter calls {sp.drafter_calls}", file=out)
        cpu_note = ""
        if str(args.device).split(":")[0] == "cpu":
            # A tree forward of N + 1 rows costs a small model on a CPU nearly N + 1 one-token
            # forwards (README, "What to expect"): fewer forwards, not fewer seconds.
            cpu_note = (" (on a CPU DDTree saves target forwards, not seconds: a tree forward of N + 1 rows "
                        "costs nearly N + 1 one-token forwards, and every round also runs the drafter; on a "
                        "GPU the rows are nearly free)")
        print(f"target rows        : AR {ar.target_rows}, DDTree {sp.target_rows} ({sp.target_calls} tree "
              f"forwards of N + 1 = {args.budget + 1} rows at most; the rows the target computes, prompt "
              f"excluded)", file=out)
        print(f"wall time          : AR {wall_text(walls[ar_name])}, DDTree {wall_text(walls['DDTree'])} "
              f"({timing_note}){cpu_note}", file=out)
    else:
        print(f"target forwards    : DDTree {sp.target_calls} for {_plural(len(sp.tokens), 'token')} "
              f"({sp.target_rows} rows); drafter calls {sp.drafter_calls}; wall {wall_text(walls['DDTree'])} "
              f"({timing_note})", file=out)
    print(f"acceptance length  : {sp.mean_acceptance_length:.2f} tokens per round (accepted draft tokens + "
          f"bonus) over {_plural(sp.rounds, 'round')}", file=out)
    loops = (" (this small target loops; acceptance on repeated text is easy, so the ratio is optimistic)"
             if rep > REPEAT_NOTE else "")
    print(f"repeated text      : {100 * rep:.0f}% of the new tokens end an {REPEAT_WINDOW}-token window seen "
          f"earlier (prompt included){loops}", file=out)
    hist = Counter(sp.committed)
    print("histogram          : " + ", ".join(f"{k}: {hist[k]}" for k in sorted(hist))
          + "   (tokens committed per round: rounds)", file=out)
    total = sum(sp.times.values()) or 1.0
    print("\n".join(text.stage_lines(sp)), file=out)
    tree_share = sum(sp.times[s] for s in ("topk", "build", "verify")) / total
    print(f"  (tree overhead: top-k + build + verify = {100 * tree_share:.1f}% of the round)", file=out)
    snap = sp.snapshot
    if snap is not None:
        print(f"\n---- draft tree of round {snap.index} of {sp.rounds} (commits "
              f"{tok.decode(snap.committed)!r}; * = accepted path) ----", file=out)
        print(text.render_tree(snap.trees, 0, snap.acceptance, max_nodes=args.tree_nodes,
                                 token_str=_token_str(tok)), file=out)
    if args.plot is not None:
        from .plots import plot_round

        try:
            plot_round(sp, args.plot, token_str=lambda t: tok.decode([int(t)]), max_nodes=args.tree_nodes)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--plot {args.plot}: {exc}") from None
        print(f"picture            : {args.plot}", file=out)
    return status
