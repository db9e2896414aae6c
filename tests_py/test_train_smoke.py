"""tools/train_models.py --smoke: the training script still runs end to end (corpus,
tokenizer, target, the DFlash drafter, the evaluation and the card) on CPU in under a
minute, and what it writes loads and decodes losslessly through kdtree generate."""

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
    # the kept weights are the best held-out evaluation's
    assert 0 < record["target_best_step"] <= record["target_steps_run"]
    # kdtree's engine on held-out prompts: every output equals the target's greedy decoding
    assert all(v["identical"] == v["of"] for v in record["acceptance"].values())
    corpus = json.loads((out / "corpus.json").read_text())
    assert all(e["version"] for e in corpus["packages"].values())  # each source with its version
    assert any(f["held_out"] for f in corpus["files"]) and not any("kdtree" in f["path"].split("/site-packages/")[-1]
                                                                     .split("/")[0] for f in corpus["files"])
    card = (out / "README.md").read_text()
    assert "Held-out perplexity" in card and "top-1 agreement" in card and "| source | version | licence (as the package declares it) | files |" in card
    # the drafter is in the published DFlash format and the folder decodes through kdtree generate
    dcfg = json.loads((out / "drafter" / "config.json").read_text())
    assert dcfg["block_size"] == 6 and dcfg["dflash_config"]["mask_token_id"] == 1
    g = subprocess.run([sys.executable, "-m", "kdtree", "generate", "--models", str(out), "--prompt", "import os\n",
                        "--max-new-tokens", "12", "--budget", "8", "--no-progress"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert g.returncode == 0, g.stderr
    assert "DFlash drafter (published format)" in g.stdout
    assert "identical to greedy autoregressive decoding: YES" in g.stdout
    # the repeats stage alone (a later run) records its own machine and keeps the training's
    # header fields; the drafter stage left checkpoints while it ran (its final save, here)
    sr = record["sampled_repeats"]
    assert sr["temperature"] == 0.7 and sr["top_p"] == 0.95 and 0.0 <= sr["mean"] <= sr["max"] <= 1.0
    assert set(record["stage_envs"]) == {"corpus", "tokenizer", "target", "drafter", "eval", "repeats"}
    assert record["drafter_schedule_steps"] == record["drafter_steps_run"]
    r2 = subprocess.run([sys.executable, str(ROOT / "tools" / "train_models.py"), "--out", str(out), "--smoke",
                         "--stage", "repeats", "--sample-temperature", "1.5"], capture_output=True, text=True, env=env,
                        timeout=300)
    assert r2.returncode == 0, r2.stderr[-2000:]
    again = json.loads((out / "training.json").read_text())
    assert again["sampled_repeats"]["temperature"] == 1.5
    assert again["command"] == record["command"] and "--stage repeats" in again["stage_commands"]["repeats"]
    assert "Sampled at temperature 1.5 with top-p 0.95" in (out / "README.md").read_text()
    # training continues from the pair's own drafter: its steps are counted, other data drawn
    r3 = subprocess.run([sys.executable, str(ROOT / "tools" / "train_models.py"), "--out", str(out), "--smoke",
                         "--stage", "drafter", "--stage", "eval", "--drafter-init", str(out / "drafter"), "--seed", "1"],
                        capture_output=True, text=True, env=env, timeout=600)
    assert r3.returncode == 0, r3.stderr[-2000:]
    cont = json.loads((out / "training.json").read_text())
    assert cont["drafter_init"] == {"from": str(out / "drafter"), "steps": record["drafter_steps_run"]}
    assert f"after {record['drafter_steps_run']} earlier steps" in (out / "README.md").read_text()
