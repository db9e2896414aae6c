"""The engine on a tensor-parallel target over torch.distributed (gloo, CPU processes).

A tiny Qwen3 target is loaded with ``load_causal_lm(..., tp=True)`` (transformers' own
tensor-parallel plan) in two processes: its attention and MLP weights are split across the
ranks, and every rank's greedy and sampled DDTree decoding (and autoregressive decoding)
must equal the single-process run's tokens, token for token. The CLI's ``--tp`` refuses to
run outside torchrun and names the model's heads that the world size does not divide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed (transformers' tensor-parallel loading needs "
                                         "it; nox -s test installs it)")

ROOT = Path(__file__).resolve().parents[1]

_WORKER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from kdtree.engine import autoregressive_generate, speculative_generate
    from kdtree.engine.hf import HFTarget, load_causal_lm

    folder, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    tp = dist.get_world_size() > 1
    model = load_causal_lm(folder, dtype="float64", tp=tp, vocab_sharded_head=tp and mode == "head")

    class RandomDrafter:
        def __init__(self, vocab, seed):
            self.vocab_size = vocab
            self.rng = np.random.default_rng(seed)

        def draft(self, context, depth, features=None):
            return self.rng.standard_normal((depth, self.vocab_size)) * 2.0

    class SlicedDrafter(RandomDrafter):  # RandomDrafter's logits, this rank's vocabulary slice only

        def __init__(self, vocab, seed, vocab_slice):
            super().__init__(vocab, seed)
            self.vocab_slice = vocab_slice

        def draft(self, context, depth, features=None):
            full = super().draft(context, depth, features)
            lo, size = self.vocab_slice
            return full[:, lo:lo + size]

    prompt = [3, 14, 15, 92, 65, 35]
    w = model.model.layers[0].self_attn.q_proj.weight
    local = tuple((w.to_local() if hasattr(w, "to_local") else w).shape)
    result = {"rank": dist.get_rank(), "local_q": local}
    result["ar"] = [int(t) for t in autoregressive_generate(HFTarget(model), prompt, 24).tokens]
    greedy = speculative_generate(HFTarget(model), RandomDrafter(97, 1), prompt, 24, budget=16, depth=4)
    result["greedy"] = [int(t) for t in greedy.tokens]
    result["forwards"] = int(greedy.target_calls)
    if mode == "head":
        vs = getattr(model, "kdtree_vocab_slice", None) or (0, 97)
        result["slice"] = list(vs)
        sliced = speculative_generate(HFTarget(model), SlicedDrafter(97, 1, vs) if tp else RandomDrafter(97, 1),
                                      prompt, 24, budget=16, depth=4)
        result["sliced"] = [int(t) for t in sliced.tokens]
        try:
            HFTarget(model, temperature=0.8)
            result["sampling"] = "accepted"
        except ValueError as exc:
            result["sampling"] = str(exc)
        gumbel = dict(temperature=0.8, seed=3, sampler="gumbel")
        result["gumbel_ar"] = [int(t) for t in autoregressive_generate(HFTarget(model, **gumbel), prompt, 24).tokens]
        result["gumbel"] = [int(t) for t in speculative_generate(
            HFTarget(model, **gumbel), SlicedDrafter(97, 2, vs) if tp else RandomDrafter(97, 2), prompt, 24,
            budget=16, depth=4).tokens]
    else:
        sampled = speculative_generate(HFTarget(model, temperature=0.8, seed=3), RandomDrafter(97, 2), prompt, 24,
                                       budget=16, depth=4)
        result["sampled"] = [int(t) for t in sampled.tokens]
    with open(out, "w") as f:
        json.dump(result, f)
""")


def run_world(spawn_ranks, tmp_path, folder, world, mode="plan"):
    outs = [tmp_path / f"{mode}w{world}r{r}.json" for r in range(world)]
    spawn_ranks(_WORKER, world, lambda r: [folder, outs[r], mode], timeout=300)
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp") / "target"
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25.0)  # sharper distributions than the default init
    model.save_pretrained(str(folder))
    return folder


def test_ranks_that_load_the_model_differently_fail_alike(spawn_ranks, tiny_target):
    """One rank splitting the LM head by vocabulary and the other not: the same error on
    both ranks (not two unrelated errors from collectives paired across calls)."""
    texts = spawn_ranks(textwrap.dedent(f"""
        import torch.distributed as dist
        from kdtree.engine.hf import load_causal_lm
        dist.init_process_group("gloo")
        try:
            load_causal_lm({str(tiny_target)!r}, dtype="float64", tp=True, vocab_sharded_head=dist.get_rank() == 1)
        except ValueError as exc:
            print("ERR", exc, flush=True)
    """), 2, timeout=300)
    for text in texts:
        assert "ERR every rank must load the same model the same way: rank 1 has vocab_sharded_head = True, rank 0 " \
               "False" in text, text[-2000:]


def test_tensor_parallel_ranks_decode_the_single_process_tokens(spawn_ranks, tiny_target, tmp_path):
    single = run_world(spawn_ranks, tmp_path, tiny_target, 1)[0]
    ranks = run_world(spawn_ranks, tmp_path, tiny_target, 2)
    assert single["local_q"] == [32, 32]
    for r in ranks:
        assert r["local_q"] == [16, 32]  # the query heads are split over the two ranks
        for key in ("ar", "greedy", "sampled"):
            assert r[key] == single[key], key
        assert r["forwards"] == single["forwards"]
    assert single["greedy"] == single["ar"]  # DDTree is lossless on the single process too
    assert len(single["greedy"]) == 24 and single["forwards"] < 24


def test_vocabulary_sharded_lm_head_merges_instead_of_gathering(spawn_ranks, tiny_target, tmp_path):
    single = run_world(spawn_ranks, tmp_path, tiny_target, 1, "head")[0]
    ranks = run_world(spawn_ranks, tmp_path, tiny_target, 2, "head")
    assert [r["slice"] for r in ranks] == [[0, 49], [49, 48]]  # 97 rows of the LM head split 49 / 48
    for r in ranks:
        assert r["ar"] == single["ar"] and r["greedy"] == single["greedy"]
        assert r["forwards"] == single["forwards"]
        assert r["sliced"] == single["ar"]  # a drafter that sees only its slice: the top-k merged
        assert "needs sampler='gumbel'" in r["sampling"]
        # Sampled: the Gumbel draws of each slice merge to the single process's draws.
        assert r["gumbel"] == single["gumbel"] and r["gumbel_ar"] == single["gumbel_ar"]
    assert single["sampling"] == "accepted"
    assert single["gumbel"] == single["gumbel_ar"]  # lossless: DDTree samples what AR samples
    assert single["gumbel"] != single["ar"]  # (and sampling is not greedy here)


def test_tp_errors(spawn_ranks, tiny_target, tmp_path):
    # Without an initialised process group.
    from kdtree.engine.hf import load_causal_lm

    with pytest.raises(ValueError, match="initialised torch.distributed process group"):
        load_causal_lm(tiny_target, tp=True)
    # The CLI outside torchrun.
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("RANK", "WORLD_SIZE"):
        env.pop(key, None)
    r = subprocess.run([sys.executable, "-m", "kdtree", "generate", "--tp", "--max-new-tokens", "4", "--no-ar",
                        "--repeats", "1"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode != 0 and "--tp runs under torchrun" in r.stderr
    # Heads the world size does not divide: the shipped pair has 5 (a world of 2).
    shipped = ROOT / "fixtures" / "models" / "stdlib-qwen3"
    texts = spawn_ranks(textwrap.dedent(f"""
        import torch.distributed as dist
        from kdtree.engine.hf import load_causal_lm
        dist.init_process_group("gloo")
        try:
            load_causal_lm({str(shipped / "target")!r}, tp=True)
        except ValueError as exc:
            print("ERR", exc)
    """), 2, timeout=300)
    for text in texts:
        assert "num_attention_heads = 5 is not a multiple of the world size 2" in text, text[-2000:]
