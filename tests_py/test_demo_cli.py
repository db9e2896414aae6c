"""Tests of ``python -m kdtree demo`` (subprocess, small corpus, cache in tmp_path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
FAST = ["--model", "ngram", "--corpus-bytes", "150000", "--order", "8", "--no-progress"]


def run_cli(args, tmp_path, timeout=120):
    env = dict(os.environ)
    env["KDTREE_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(PYTHON_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kdtree", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=tmp_path)


def test_demo_runs_and_matches_ar(tmp_path):
    r = run_cli(["demo", *FAST, "--max-new-tokens", "48", "--budget", "16", "--depth", "7"],
                tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "identical to greedy autoregressive decoding: YES" in out
    assert "target calls       : AR 48, DDTree " in out
    # the native library ran the tree ops (a failed load falls back to the reference, and says so)
    assert "tree ops : native libkdtree " in out and "in C on the CPU" in out
    # the extra rows the target computed, and how the wall times were taken
    assert "target rows        : AR 48, DDTree " in out
    assert "median of 3 runs each, after a warm-up" in out or "not the 3 asked" in out
    assert "acceptance length" in out and "draft tree of round" in out
    # stage names follow the library: "target" is the target's call, "verify" the walk
    for stage in ("draft", "topk", "build", "target", "verify", "commit"):
        assert f"\n  {stage} " in out
    assert "\n  walk " not in out
    assert "verify = the walk along its choices, kdtree.verify_greedy" in out
    assert "(AR: target forward " in out
    # the header says which corpus and which cache file
    assert "first 150,000 bytes of Python" in out and "sorted by path" in out
    assert "files under " in out and "__future__.py .. " in out
    assert "bytes 14500..14800 (not in the corpus" in out
    assert "counts   : estimated and cached in " in out
    cache = list((tmp_path / "cache").glob("*.npz"))
    assert len(cache) == 1, "counts were not cached"
    assert str(cache[0]) in out
    assert "---- prompt (300 bytes) " in out
    assert "---- continuation (48 bytes, " in out
    # the second run reads the cache
    r2 = run_cli(["demo", *FAST, "--max-new-tokens", "1", "--backend", "reference"], tmp_path)
    assert r2.returncode == 0, r2.stderr
    assert "counts   : loaded from cache" in r2.stdout
    assert "pure-Python reference" in r2.stdout
    assert "---- continuation (1 byte, " in r2.stdout
    # a truncated cache file is rebuilt with a one-line warning, no traceback
    data = cache[0].read_bytes()
    cache[0].write_bytes(data[: len(data) // 2])
    r3 = run_cli(["demo", *FAST, "--max-new-tokens", "1", "--temperature", "0"], tmp_path)  # greedy: accepted
    assert r3.returncode == 0, r3.stderr
    assert "Traceback" not in r3.stderr
    warnings = [ln for ln in r3.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "unreadable" in warnings[0] and str(cache[0]) in warnings[0]
    assert "counts   : estimated and cached" in r3.stdout
    assert cache[0].read_bytes() != data[: len(data) // 2]


def test_demo_prompt_file_and_stop_byte(tmp_path):
    prompt = tmp_path / "p.py"
    prompt.write_bytes(b"def f(x):\n    return x + 1\n\n\nclass A:\n    def __init__(self):\n")
    r = run_cli(["demo", *FAST, "--prompt-file", str(prompt), "--max-new-tokens", "200",
                 "--stop-byte", "32", "--budget", "1024"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "stop: stop_token" in r.stdout
    assert "stop bytes=[32]" in r.stdout
    assert "identical to greedy autoregressive decoding: YES" in r.stdout
    assert str(prompt) in r.stdout
    assert f"---- prompt ({len(prompt.read_bytes())} bytes) " in r.stdout


def test_demo_long_prompt_header(tmp_path):
    prompt = tmp_path / "p.py"
    prompt.write_bytes(b"def f(x):\n    return x + 1\n" * 40)
    r = run_cli(["demo", *FAST, "--prompt-file", str(prompt), "--prompt-bytes", "1000",
                 "--max-new-tokens", "4"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "---- prompt (last 300 of 1,000 bytes shown) " in r.stdout


def test_demo_marks_runs_of_repeated_bytes(tmp_path):
    # the order-8 target loops on spaces after this prompt: the run must show, with a note
    prompt = tmp_path / "p.py"
    prompt.write_bytes(b"x = 1\n")
    r = run_cli(["demo", *FAST, "--prompt-file", str(prompt), "--max-new-tokens", "120"],
                tmp_path)
    assert r.returncode == 0, r.stderr
    assert "' ' x 120" in r.stdout
    assert "the target repeats itself here" in r.stdout and "ratio is optimistic" in r.stdout


def test_demo_prompt_inside_corpus_is_held_out(tmp_path):
    sys.path.insert(0, str(PYTHON_DIR))
    from kdtree import ngram

    inside = ngram.load_corpus(150_000).files[1]
    r = run_cli(["demo", *FAST, "--prompt-file", str(inside), "--max-new-tokens", "1"],
                tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(held out of the corpus)" in r.stdout
    assert "nor the prompt file" in r.stdout
    assert "this corpus differs from the default one" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["demo", "--budget", "0"], "--budget: must be >= 1, got 0"),
    (["demo", "--model", "ngram", "--temperature", "0.5", "--seed", "1"],
     "--temperature, --seed only apply to --model transformer (the n-gram demo is greedy)"),
    (["demo", "--temperature", "0", "--top-p", "0.9"], "--top-p 0.9 applies to sampling only"),
    (["demo", "--budget", "abc"], "--budget: expected an integer"),
    (["demo", "--depth", "-1"], "--depth"),
    (["demo", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["demo", "--budget", "100000"], "--budget: must be <= 4096 in the demo, got 100000"),
    (["demo", "--budget", "4097"], "attention mask of (N+1)^2 bytes (16.0 MiB at N=4097)"),
    (["generate", "--no-such-flag"], "python -m kdtree generate: error: unrecognized arguments: --no-such-flag"),
    (["--no-such-flag", "demo"], "python -m kdtree: error: unrecognized arguments: --no-such-flag"),
    (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["nosuchcommand"], "invalid choice"),
    ([], "required"),
])
def test_bad_flags_rejected(tmp_path, args, needle):
    r = run_cli(args, tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_unreadable_prompt_file(tmp_path):
    r = run_cli(["demo", *FAST, "--prompt-file", str(tmp_path / "missing.py")], tmp_path)
    assert r.returncode == 2
    assert "cannot read prompt file" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty.py"
    empty.write_bytes(b"")
    r = run_cli(["demo", *FAST, "--prompt-file", str(empty)], tmp_path)
    assert r.returncode == 2 and "is empty" in r.stderr
    # Special files are refused at once: /dev/zero never ends, a FIFO would block.
    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    for special in ("/dev/zero", str(fifo)):
        r = run_cli(["demo", *FAST, "--prompt-file", special], tmp_path, timeout=60)
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr


def test_draft_order_above_order_rejected(tmp_path):
    r = run_cli(["demo", *FAST, "--draft-order", "9"], tmp_path)
    assert r.returncode == 2
    assert "--draft-order (9) must be <= --order (8)" in r.stderr


def test_main_in_process_help(capsys):
    sys.path.insert(0, str(PYTHON_DIR))
    from kdtree.apps import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--budget", "--depth", "--max-new-tokens", "--prompt-file", "--prompt-bytes",
                 "--no-progress"):
        assert flag in out
    assert "--corpus-bytes" not in out  # test-only flag stays hidden
    flat = " ".join(out.split())
    assert "(default: None)" not in flat and "(default: [])" not in flat
    assert "(default: False)" not in flat
    assert "heapq.py) (default" not in flat and "prompt fits) (default" not in flat
    assert ("(default: the standard library's heapq.py with --model ngram, a slice of kdtree's engine/rounds.py "
            "with the transformer pair)") in flat
    assert "(default: 64)" in flat
    assert "--model {transformer,ngram}" in flat and "(default: transformer)" in flat


def test_version_flag(capsys):
    sys.path.insert(0, str(PYTHON_DIR))
    import kdtree
    from kdtree.apps import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kdtree {kdtree.__version__}"


def test_run_markers_fall_back_to_ascii():
    import io

    sys.path.insert(0, str(PYTHON_DIR))
    from kdtree.apps import demo

    assert demo._marks(io.TextIOWrapper(io.BytesIO(), encoding="ascii")) == ("<<", ">>")
    assert demo._marks(io.TextIOWrapper(io.BytesIO(), encoding="utf-8")) == ("\u27e8", "\u27e9")
    assert demo.run_share(b"a" * 20 + b"bc") == (20, 20 / 22)
    assert demo.run_share(b"") == (0, 0.0)


def test_the_console_script_names_itself(tmp_path):
    """Run as the `kdtree` console script (pyproject's kdtree.__main__:main), usage errors
    say `kdtree`, not `python -m kdtree`."""
    script = tmp_path / "kdtree"
    script.write_text("import sys\nfrom kdtree.__main__ import main\nsys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), "--no-such-flag", "demo"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "kdtree: error: unrecognized arguments: --no-such-flag" in r.stderr
    assert "python -m kdtree" not in r.stderr
