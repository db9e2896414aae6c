"""Tests of ``python -m kdtree demo`` (subprocess, small corpus, cache in tmp_path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
FAST = ["--corpus-bytes", "150000", "--order", "8", "--no-progress"]


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
    assert "acceptance length" in out and "draft tree of round" in out
    for stage in ("draft", "topk", "build", "verify", "walk", "commit"):
        assert f"\n  {stage} " in out
    assert "counts estimated" in out
    assert list((tmp_path / "cache").glob("*.npz")), "counts were not cached"
    # the second run reads the cache
    r2 = run_cli(["demo", *FAST, "--max-new-tokens", "8", "--backend", "reference"], tmp_path)
    assert r2.returncode == 0, r2.stderr
    assert "counts loaded from cache" in r2.stdout
    assert "pure-Python reference" in r2.stdout


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


@pytest.mark.parametrize("args,needle", [
    (["demo", "--budget", "0"], "--budget: must be >= 1, got 0"),
    (["demo", "--budget", "abc"], "--budget: expected an integer"),
    (["demo", "--depth", "-1"], "--depth"),
    (["demo", "--max-new-tokens", "-3"], "--max-new-tokens"),
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


def test_draft_order_above_order_rejected(tmp_path):
    r = run_cli(["demo", *FAST, "--draft-order", "9"], tmp_path)
    assert r.returncode == 2
    assert "--draft-order (9) must be <= --order (8)" in r.stderr


def test_main_in_process_help(capsys):
    sys.path.insert(0, str(PYTHON_DIR))
    from kdtree import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--budget", "--depth", "--max-new-tokens", "--prompt-file", "--prompt-bytes",
                 "--no-progress"):
        assert flag in out
    assert "--corpus-bytes" not in out  # test-only flag stays hidden
