"""tools/train_models.py --smoke: the training script still runs end to end (tokenizer,
target, greedy continuations, drafter, card) on CPU in under a minute, and what it writes
loads and decodes losslessly through kdtree generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (nox -s test installs it)")

ROOT = Path(__file__).resolve().parents[1]


def test_train_models_smoke_run(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "pair"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "train_models.py"), "--out", str(out), "--smoke"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads((out / "training.json").read_text())
    assert record["sizes"]["vocab"] == 384 and len(record["drafter_agreement"]) == 5
    assert all(0.0 <= a <= 1.0 for a in record["drafter_agreement"])
    assert record["held_out_perplexity"] > 1.0
    card = (out / "README.md").read_text()
    assert "held-out perplexity" in card and "top-1 agreement" in card
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["kdtree_trained_window"] == 40  # the smoke drafter's 16 + 24 tokens
    g = subprocess.run([sys.executable, "-m", "kdtree", "generate", "--models", str(out), "--prompt", "import os\n",
                        "--max-new-tokens", "12", "--budget", "8"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert g.returncode == 0, g.stderr
    assert "identical to greedy autoregressive decoding: YES" in g.stdout
