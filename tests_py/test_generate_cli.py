"""``python -m kdtree generate`` and the default ``demo`` (the shipped transformer pair in
fixtures/models/stdlib-qwen3), run as subprocesses on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (nox -s test installs it)")

ROOT = Path(__file__).resolve().parents[1]
PYTHON_DIR = ROOT / "python"
MODELS = ROOT / "fixtures" / "models" / "stdlib-qwen3"


def run_cli(args, tmp_path, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kdtree", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=tmp_path)


def field(out: str, name: str) -> str:
    line = next(ln for ln in out.splitlines() if ln.startswith(name))
    return line.split(":", 1)[1].strip()


def test_shipped_pair_is_complete_and_small():
    files = [p for p in MODELS.rglob("*") if p.is_file()]
    names = {p.relative_to(MODELS).as_posix() for p in files}
    for need in ("README.md", "training.json", "tokenizer.json", "target/config.json", "target/model.safetensors",
                 "drafter/config.json", "drafter/model.safetensors"):
        assert need in names
    assert sum(p.stat().st_size for p in files) < 30 * 2**20


def test_demo_default_is_the_transformer_pair_and_lossless(tmp_path):
    png = tmp_path / "round.png"
    r = run_cli(["demo", "--max-new-tokens", "40", "--budget", "32", "--plot", str(png), "--prompt-chars", "300"],
                tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("kdtree demo: DDTree speculative decoding")
    assert "engine/rounds.py, characters 2000..2300:" in out  # --prompt-chars reaches generate
    assert "saves target forwards, not seconds" in field(out, "wall time")  # the CPU note
    assert "---- prompt (300 characters) " in out
    assert "Qwen3ForCausalLM" in out and "DFlash drafter (published format)" in out
    assert field(out, "  models").startswith(str(MODELS))  # where the pair came from
    # sampled by default, checked token for token against AR sampling with the same seed
    assert "sampling, temperature 0.7, top-p 0.95, seed 0" in field(out, "  target")
    assert "identical to autoregressive sampling with the same seed (0; " in out and ": YES" in out
    assert field(out, "repeated text").endswith("(prompt included)")
    ar, dd = field(out, "target forwards").split(";")[0].replace("AR ", "").split(", DDTree ")
    assert int(ar) == 40 and 1 <= int(dd.split()[0]) < 40  # the drafter saves forwards
    hist = field(out, "histogram").split("   ")[0]
    rounds = {int(k): int(v) for k, v in (kv.split(": ") for kv in hist.split(", "))}
    assert sum(k * v for k, v in rounds.items()) == 40 and sum(rounds.values()) == int(dd.split()[0])
    assert "draft tree of round" in out and "* root" in out
    for stage in ("draft", "topk", "build", "target", "verify", "commit"):
        assert f"\n  {stage} " in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Traceback" not in r.stderr and "Loading weights" not in r.stderr


def test_demo_greedy_and_sampled_equal_their_autoregressive_runs(tmp_path):
    r = run_cli(["demo", "--temperature", "0", "--max-new-tokens", "24", "--budget", "16", "--repeats", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "greedy (argmax, ties to the lower id)" in r.stdout
    assert "identical to greedy autoregressive decoding: YES" in r.stdout
    r = run_cli(["generate", "--temperature", "1.3", "--seed", "5", "--max-new-tokens", "24", "--budget", "16",
                 "--repeats", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "identical to autoregressive sampling with the same seed (5; " in r.stdout
    assert "seed and position): YES" in r.stdout


def test_generate_prompt_text_and_sampling_is_reproducible(tmp_path):
    args = ["generate", "--prompt", "def fib(n):\n    ", "--max-new-tokens", "16", "--budget", "8",
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--no-ar"]
    r1 = run_cli(args, tmp_path)
    r2 = run_cli(args, tmp_path)
    assert r1.returncode == 0, r1.stderr
    assert "sampling, temperature 0.9, top-p 0.95, seed 7" in r1.stdout
    cont = r1.stdout.split("---- continuation")[1].split("\n-----")[0]
    assert cont == r2.stdout.split("---- continuation")[1].split("\n-----")[0]
    assert "(16 tokens, stop: max_new_tokens)" in cont
    assert "---- prompt (16 characters) " in r1.stdout  # a short prompt is shown whole


@pytest.mark.parametrize("args,message", [
    (["generate", "--depth", "16"], "exceeds this drafter's 15 positions"),
    (["generate", "--models", "nowhere"], "--models nowhere: no such folder"),
    (["generate", "--models", "/dev/null"], "--models /dev/null: not a folder"),
    (["generate", "--models", "."], "no tokenizer.json"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--temperature", "-1"], "--temperature: must be in [0.0, 100.0]"),
    (["generate", "--top-p", "0"], "--top-p: must be in (0.0, 1.0]"),
    (["demo", "--order", "8"], "--order only applies to --model ngram"),
    (["demo", "--order", "8", "--no-cache"], "--order, --no-cache only apply to --model ngram"),
    (["demo", "--model", "ngram", "--plot", "x.png"], "--plot only applies to --model transformer"),
    (["demo", "--model", "ngram", "--prompt-chars", "50"], "--prompt-chars only applies to --model transformer"),
    (["generate", "--device", "bogus"], "--device 'bogus'"),
    (["generate", "--device", "meta"], "only cpu and cuda devices"),
    (["generate", "--plot", "picture.xyz"], "must end in one of .png"),
    (["generate", "--plot", "no/such/folder/p.png"], "does not exist"),
    (["generate", "--temperature", "1e-9"], "must be 0 (greedy) or >= 1e-6"),
    (["generate", "--seed", "-1"], "--seed: must be in 0.."),
    (["generate", "--prompt-file", "/dev/zero"], "not a regular file"),
    (["generate", "--prompt-file", ".", "--no-ar"], "Is a directory"),
    (["generate", "--prompt-offset", "10000000"], "beyond the end"),
    (["generate", "--max-new-tokens", "5000"], "exceed the target's 4096 positions"),
    (["generate", "--top-p", "0.9"], "--top-p 0.9 applies to sampling only"),
    (["generate", "--prompt", "x", "--prompt-chars", "20"], "use them with --prompt-file"),
    (["generate", "--device", "cpu:7"], "takes no index"),
    (["generate", "--plot", "/proc/x.png"], "not writable"),
])
def test_usage_errors(tmp_path, args, message):
    r = run_cli(args, tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout
    assert message in r.stderr and "Traceback" not in r.stderr


def test_a_prompt_too_long_for_the_target_is_refused_before_tokenizing(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("x" * 2_000_000)
    r = run_cli(["generate", "--prompt-file", str(big), "--prompt-chars", "3000000", "--no-ar"], tmp_path)
    assert r.returncode == 2 and "cannot fit the target's 4096 positions" in r.stderr, r.stderr


def test_repeated_share():
    sys.path.insert(0, str(PYTHON_DIR))
    from kdtree.apps.generate import repeated_share

    assert repeated_share([], [1, 2]) == 0.0
    assert repeated_share([1, 2, 3, 4], [9, 9, 9], window=2) == 0.0
    # after the prompt 1 2, the new tokens 1 2 1 2 1 2 close the windows (2,1) (new), then
    # (1,2) (2,1) (1,2) (2,1) (1,2), all seen before: 5 of 6
    assert repeated_share([1, 2, 1, 2, 1, 2], [1, 2], window=2) == 5 / 6
    assert repeated_share([5, 6, 5, 6], [], window=2) == 0.25  # only the last token closes a seen (5,6)


def test_broken_model_folders_are_usage_errors(tmp_path):
    import shutil

    only_tokenizer = tmp_path / "only"
    only_tokenizer.mkdir()
    shutil.copy(MODELS / "tokenizer.json", only_tokenizer / "tokenizer.json")
    r = run_cli(["generate", "--models", str(only_tokenizer)], tmp_path)
    assert r.returncode == 2 and "cannot load the models in" in r.stderr and "Traceback" not in r.stderr
    mismatch = tmp_path / "mismatch"
    shutil.copytree(MODELS, mismatch)
    cfg = mismatch / "drafter" / "config.json"
    assert '"vocab_size": 8192' in cfg.read_text()
    cfg.write_text(cfg.read_text().replace('"vocab_size": 8192', '"vocab_size": 5000'))
    r = run_cli(["generate", "--models", str(mismatch)], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot load the models" in r.stderr or "does not fit the target" in r.stderr
    window = tmp_path / "window"
    shutil.copytree(MODELS, window)
    cfg = window / "target" / "config.json"
    cfg.write_text(cfg.read_text().replace('"use_sliding_window": false', '"use_sliding_window": true'))
    r = run_cli(["generate", "--models", str(window), "--no-ar"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "sliding-window" in r.stderr, r.stderr


def test_batched_prompts_file(tmp_path):
    """--batch-size / --prompts-file: the batched engine decodes every prompt (plain and JSON
    lines), prints each output, and checks greedy outputs against its own AR run."""
    f = tmp_path / "prompts.txt"
    f.write_text('def parse(text):\\n    """Parse\n\n{"prompt": "import os\\nimport sys\\n", "max_new_tokens": 5}\n'
                 "class Engine:\n")
    r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(f), "--max-new-tokens", "9", "--budget", "16",
                 "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("---- request ") == 3
    assert "5 new, max_new_tokens" in r.stdout and "9 new, max_new_tokens" in r.stdout
    assert "identical  : 3 of 3 outputs equal greedy autoregressive decoding" in r.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(bad)], tmp_path)
    assert r.returncode != 0 and 'line 2: a JSON line needs a "prompt" string' in r.stderr


def test_batched_refuses_options_it_does_not_use(tmp_path):
    """Single-sequence options given to the batched run are errors that name them, not
    silently dropped."""
    f = tmp_path / "prompts.txt"
    f.write_text("def parse(text):\n")
    base = ["generate", "--batch-size", "2", "--prompts-file", str(f)]
    for extra, said in ((["--plot", str(tmp_path / "x.png")], "--plot: not used by the batched run"),
                        (["--depth", "40"], "--depth: not used"),
                        (["--prompt", "hi"], "the prompts come from --prompts-file"),
                        (["--repeats", "5", "--tree-nodes", "3"], "--repeats, --tree-nodes: not used"),
                        (["--top-k", "5"], "--top-k applies to sampling"),
                        (["--top-p", "0.5"], "--top-p 0.5 applies to sampling only"),
                        (["--prompt-offset", "3"], "--prompt-offset: not used")):
        r = run_cli(base + extra, tmp_path)
        assert r.returncode == 2 and said in r.stderr, (extra, r.stderr[-300:])
    # a JSON line's own nucleus for a greedy request: refused, naming the line
    g = tmp_path / "greedy.jsonl"
    g.write_text('{"prompt": "def f(", "temperature": 0, "top_p": 0.5}\n')
    r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(g)], tmp_path)
    assert r.returncode == 2 and "prompt 0 (line 1): top_p 0.5 set for a greedy request" in r.stderr, r.stderr[-300:]
    # the flags are checked as flags, not blamed on the first line that inherits them
    mix = tmp_path / "mix.jsonl"
    mix.write_text('{"prompt": "def f(", "temperature": 0}\n{"prompt": "import os", "temperature": 0.8}\n')
    for extra, said in ((["--top-p", "1e-40"], "--top-p / --top-k / --seed: top_p must be"),
                        (["--top-k", "2147483648"], "--top-p / --top-k / --seed: top_k must be"),
                        (["--seed", str(2**63 - 1)], "prompt i takes seed --seed + i, past 2**63 - 1 for 2 prompts")):
        r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(mix), *extra], tmp_path)
        assert r.returncode == 2 and said in r.stderr and "line 1" not in r.stderr, (extra, r.stderr[-300:])
    # every line greedy by its own temperature: the flags' cuts are refused as when no line sets one
    allg = tmp_path / "allgreedy.jsonl"
    allg.write_text('{"prompt": "def f(", "temperature": 0}\n{"prompt": "import os", "temperature": 0}\n')
    r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(allg), "--top-k", "5"], tmp_path)
    assert r.returncode == 2 and "--top-k applies to sampling, and every request of the file is greedy" in r.stderr, (
        r.stderr[-300:])


def test_batched_budget_auto(tmp_path):
    """--budget auto with the batched engine: decodes, reports the budgets it chose, and the
    outputs equal the engine's AR run; without --batch-size it is a usage error."""
    f = tmp_path / "prompts.txt"
    f.write_text("def parse(text):\nclass Engine:\n")
    r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(f), "--max-new-tokens", "6", "--budget", "auto",
                 "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "budgets    : rounds at each budget N=" in r.stdout
    assert "identical  : 2 of 2 outputs equal greedy autoregressive decoding" in r.stdout
    r = run_cli(["generate", "--budget", "auto"], tmp_path)
    assert r.returncode == 2 and "add --batch-size" in r.stderr


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_difference_is_rounding_only_if_the_wider_float_run_agrees(monkeypatch, temperature):
    """generate's check when DDTree's text differs from AR's (in-process): rounding (status
    0) needs the next wider float's runs to agree and the first differing choice to be
    within rounding reach; a wider run that differs, a margin beyond reach, or a float64
    run means a real difference (status 1)."""
    import argparse
    import copy
    import io

    import torch

    sys.path.insert(0, str(PYTHON_DIR))
    from kdtree.apps import generate
    from kdtree.engine import rounds
    from kdtree.engine.hf import HFTarget

    tok, target, drafter = generate.load_pair(MODELS, "cpu", "float32")
    prompt = tok.encode("def parse(text):\n    ").ids
    args = argparse.Namespace(temperature=temperature, top_p=1.0, seed=3, max_new_tokens=6, budget=8)
    layers = list(drafter.feature_layers)

    ar = rounds.autoregressive_generate(HFTarget(target, temperature=temperature, seed=3, feature_layers=layers),
                                        prompt, 6)
    # a float32 "difference" at token 2 that the float64 rerun does not reproduce
    fake = ar.tokens[:2] + [(ar.tokens[2] + 1) % target.config.vocab_size] + ar.tokens[3:]
    # the float64 runs agree, but the fake token was never near the model's choice: an error
    # of the float32 path alone
    out = io.StringIO()
    assert generate.mismatch_report(args, target, drafter, layers, prompt, [], 5, ar.tokens, fake, "AR", out) == 1
    text = out.getvalue()
    assert "NO in float32, first difference at new token 2" in text and "rerun in float64  : identical: YES" in text
    assert "margin at token 2" in text and "BEYOND" in text and "not rounding" in text, text
    # the margin measured against the same forward in float32 and float64 at that token
    ctx = prompt + ar.tokens[:2]
    margin, bound, _ = generate.first_token_margin(target, copy.deepcopy(target).double(), ctx, ar.tokens[2],
                                                   fake[2], args)
    ids = torch.tensor([ctx])
    with torch.no_grad():
        l32 = target(input_ids=ids).logits[0, -1].double()
        l64 = copy.deepcopy(target).double()(input_ids=ids).logits[0, -1]
    a, d = ar.tokens[2], fake[2]
    err = (l32 - l64).abs().numpy()
    if not temperature:
        assert bound == pytest.approx(generate.ROUNDING_FACTOR * (err[a] + err[d]))
        assert margin == pytest.approx(abs(float(l64[a] - l64[d])))
    else:  # T = 1, no top-p: p = softmax(l64); the draw's uniform against the boundary between a and d
        import numpy as np

        from kdtree.engine.hf import keyed_uniforms

        x = l64.numpy()
        p = np.exp(x - x.max())
        p /= p.sum()
        cdf = np.cumsum(p)

        u = keyed_uniforms(3, [len(ctx)])[0]
        assert margin == pytest.approx(abs(cdf[d - 1] - u if d > a else u - cdf[d]))
        assert bound == pytest.approx(generate.ROUNDING_FACTOR * float((p * err).sum()))
    assert 0 < bound < 1e-3 < margin
    # a choice within rounding reach (here: a reach made wide) is taken for rounding
    monkeypatch.setattr(generate, "ROUNDING_FACTOR", 1e12)
    out = io.StringIO()
    assert generate.mismatch_report(args, target, drafter, layers, prompt, [], 5, ar.tokens, fake, "AR", out) == 0
    assert "within" in out.getvalue() and "taken for rounding" in out.getvalue()
    monkeypatch.undo()
    # already float64: nothing wider, a real difference
    out = io.StringIO()
    t64, d64 = target.to(torch.float64), drafter.to(torch.float64)
    assert generate.mismatch_report(args, t64, d64, layers, prompt, [], 5, ar.tokens, fake, "AR", out) == 1
    assert "rerun" not in out.getvalue()
    t32, d32 = t64.to(torch.float32), d64.to(torch.float32)
    # the wider run differs too: not rounding
    real = rounds.speculative_generate

    def broken(*a, **kw):
        res = real(*a, **kw)
        res.tokens[1] = (res.tokens[1] + 1) % target.config.vocab_size
        return res

    monkeypatch.setattr(rounds, "speculative_generate", broken)
    out = io.StringIO()
    assert generate.mismatch_report(args, t32, d32, layers, prompt, [], 5, ar.tokens, fake, "AR", out) == 1
    assert "identical: NO, first difference at new token 1 (not rounding)" in out.getvalue()


def test_a_prompts_file_line_has_its_own_stop_texts(tmp_path):
    """A JSON line's "stop" texts end that request only (after the tokens ': PreTrainedModel'
    encodes to, where the default prompt's greedy continuation has them), the same line
    without them runs to its cap, both equal their autoregressive runs; a bad "stop" is an
    error naming the line."""
    import argparse
    import json

    from kdtree.apps.generate import PROMPT_CHARS, _default_prompt

    prompt = _default_prompt(argparse.Namespace(prompt=None, prompt_file=None, prompt_offset=None,
                                                prompt_chars=PROMPT_CHARS))[0]
    f = tmp_path / "stops.jsonl"
    f.write_text(json.dumps({"prompt": prompt, "stop": ["zzz qqq", ": PreTrainedModel"]}) + "\n"
                 + json.dumps({"prompt": prompt}) + "\n")
    r = run_cli(["generate", "--temperature", "0", "--batch-size", "2", "--prompts-file", str(f), "--max-new-tokens",
                 "32", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    heads = [ln for ln in r.stdout.splitlines() if ln.startswith("---- request ")]
    assert len(heads) == 2 and ", stop_sequence," in heads[0] and "32 new, max_new_tokens" in heads[1], heads
    assert "own stops 'zzz qqq', ': PreTrainedModel'" in heads[0] and "own stops" not in heads[1]
    first = r.stdout.split(heads[0])[1].split(heads[1])[0]
    assert first.rstrip("\n").endswith(": PreTrainedModel"), first[-200:]
    assert "identical  : 2 of 2 outputs equal greedy autoregressive decoding" in r.stdout
    for stop, said in (('"abc"', '"stop" must be a list of non-empty texts'),
                       ('[""]', '"stop" must be a list of non-empty texts'),
                       ('["' + "x y " * 20 + '"]', "prompt 1 (line 2): stop 'x y x y")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "def f("}\n{"prompt": "import os", "stop": ' + stop + "}\n")
        r = run_cli(["generate", "--batch-size", "2", "--prompts-file", str(bad)], tmp_path)
        assert r.returncode == 2 and said in r.stderr, (stop, r.stderr[-300:])


def test_stop_texts_end_the_continuation_after_their_tokens(tmp_path):
    """--stop TEXT: the continuation (greedy, 32 tokens otherwise) ends right after the
    tokens ': PreTrainedModel' encodes to, with the same text from AR; a text of no tokens
    is refused; the batched run stops there too."""
    from tokenizers import Tokenizer

    full = run_cli(["generate", "--temperature", "0", "--max-new-tokens", "32", "--repeats", "1", "--no-progress"],
                   tmp_path)
    assert full.returncode == 0, full.stderr
    r = run_cli(["generate", "--temperature", "0", "--max-new-tokens", "32", "--repeats", "1", "--no-progress",
                 "--stop", ": PreTrainedModel", "--stop", "zzz qqq"], tmp_path)
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_file(str(MODELS / "tokenizer.json"))
    # the header shows each stop's tokens as the pieces they decode to (2 and 5 of them here)
    pieces = {t: [tok.decode([i]) for i in tok.encode(t, add_special_tokens=False).ids]
              for t in (": PreTrainedModel", "zzz qqq")}
    assert [len(p) for p in pieces.values()] == [2, 5] and "".join(pieces["zzz qqq"]) == "zzz qqq"
    shown = ", ".join(f"{t!r} (tokens {' '.join(repr(x) for x in p)})" for t, p in pieces.items())
    assert f"stop at <|endoftext|>, {shown}" in field(r.stdout, "  settings")

    def continuation(out):
        lines = out.splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.startswith("---- continuation"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("-" * 66))
        return lines[start], "\n".join(lines[start + 1:end])

    head, text = continuation(r.stdout)
    _, whole = continuation(full.stdout)
    assert "stop: stop_sequence" in head
    assert text.endswith(": PreTrainedModel") and whole.startswith(text) and len(whole) > len(text)
    stop_ids = tok.encode(": PreTrainedModel", add_special_tokens=False).ids
    assert tok.encode(text).ids[-len(stop_ids):] == stop_ids
    assert "identical to greedy autoregressive decoding: YES" in r.stdout
    bad = run_cli(["generate", "--max-new-tokens", "4", "--repeats", "1", "--stop", ""], tmp_path)
    assert bad.returncode == 2 and "--stop '' encodes to 0 tokens; a stop sequence takes 1 to 16" in bad.stderr
    batched = run_cli(["generate", "--temperature", "0", "--batch-size", "1", "--max-new-tokens", "32",
                       "--no-progress", "--stop", ": PreTrainedModel"], tmp_path)
    assert batched.returncode == 0, batched.stderr
    assert f"{len(tok.encode(text).ids)} new, stop_sequence," in batched.stdout
    assert "identical  : 1 of 1 outputs equal greedy autoregressive decoding" in batched.stdout
