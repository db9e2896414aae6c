"""tools/train_models.py --smoke: the training script still runs end to end (corpus,
tokenizer, target, the DFlash drafter, the evaluation and the card) on CPU in under a
minute, and what it writes loads and decodes losslessly through kdtree generate."""

from __future__ import annotations

import importlib.util
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
    first = {"command": record["stage_commands"]["drafter"], "steps": record["drafter_steps_run"]}
    assert cont["drafter_init"] == {"from": str(out / "drafter"), "steps": record["drafter_steps_run"], "runs": [first]}
    card = (out / "README.md").read_text()
    assert f"after {record['drafter_steps_run']} earlier steps" in card
    # the card lists both drafter runs, the earlier first
    assert f"{first['command']}    # drafter, run 1 of 2 ({first['steps']} steps)" in card
    assert card.index("run 1 of 2") < card.index("run 2 of 2")


def _train_models():
    spec = importlib.util.spec_from_file_location("train_models", ROOT / "tools" / "train_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_new_target_or_drafter_forgets_what_belonged_to_the_old_one(tmp_path):
    tm = _train_models()

    def pair():
        out = tmp_path / "pair"
        (out / "drafter").mkdir(parents=True, exist_ok=True)
        (out / "drafter" / "config.json").write_text("{}")
        (out / "README.md").write_text("card")
        rec = {"held_out_perplexity": 5.0, "acceptance": {"64": {}}, "drafter_agreement": [0.5], "sizes": {},
               "compare": {"files": 20},
               "drafter_steps_run": 10, "drafter_init": {"steps": 3}, "target_steps_run": 7,
               "stage_commands": {"target": "t", "drafter": "d", "eval": "e", "repeats": "r"}}
        return out, rec

    out, rec = pair()
    gone = tm.forget_downstream(out, rec, "drafter")
    assert set(gone) == {"held_out_perplexity", "acceptance", "drafter_agreement", "README.md"}
    assert (out / "drafter" / "config.json").is_file() and not (out / "README.md").exists()
    assert rec["drafter_steps_run"] == 10 and rec["stage_commands"] == {"target": "t", "drafter": "d"}
    assert rec["compare"] == {"files": 20}  # measured on the target, which a new drafter keeps
    out, rec = pair()
    tm.forget_downstream(out, rec, "target")
    assert not (out / "drafter").exists() and not (out / "README.md").exists()
    assert rec == {"sizes": {}, "target_steps_run": 7, "stage_commands": {"target": "t"}}
    # continuing the folder's own drafter across a new target is refused before anything runs
    (out / "drafter").mkdir()
    (out / "drafter" / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit):
        tm.parse_args(["--out", str(out), "--stage", "target", "--stage", "drafter",
                       "--drafter-init", str(out / "drafter")])
    # training.json is replaced whole
    tm.write_record(out / "training.json", {"a": 1})
    assert json.loads((out / "training.json").read_text()) == {"a": 1} and not (out / "training.json.tmp").exists()
