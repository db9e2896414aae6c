"""The batched engine (kdtree.engine.batched.Engine) on a tensor-parallel target over
torch.distributed (gloo, two CPU processes).

A tiny Qwen3 target is loaded with ``load_causal_lm(..., tp=True)`` (transformers' own
tensor-parallel plan: attention heads and MLP columns split over the ranks, so each rank's
K/V cache holds its own heads) with a DFlash drafter over it. Every rank's outputs must
equal the single-process engine's, token for token, in every mode: autoregressive, chain,
greedy DDTree, sampled DDTree (greedy and sampled requests in one batch) and budget="auto";
with the LM head whole on every rank, and split by vocabulary (the drafter's top-k and the
target's choices merged across the ranks, never gathered). Ranks that build different
engines fail alike, before any round.
"""

from __future__ import annotations

import json
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed (transformers' tensor-parallel loading needs "
                                         "it; nox -s test installs it)")

NEW = 14
VOCAB = 96

# (name, Engine keyword arguments, sampling settings: None, or per prompt (temperature, seed))
CASES = [
    ("ar", dict(mode="ar"), None),
    ("chain", dict(mode="chain"), None),
    ("ddtree", dict(budget=12), None),
    ("sampled", dict(budget=12, sampling=True), [(0.0, 0), (0.8, 1), (1.3, 2), (0.6, 3), (0.0, 0), (0.9, 5)]),
    ("auto", dict(budget="auto", auto_budgets=(4, 12)), None),
    ("budget 0", dict(budget=0), None),  # root-only trees (the sharded top-k still takes k = 1)
]

_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from kdtree.engine.batched import Engine, SamplingParams
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    folder, out, head = sys.argv[1], sys.argv[2], sys.argv[3] == "head"
    cases = json.loads(open(folder + "/cases.json").read())
    prompts = json.loads(open(folder + "/prompts.json").read())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = load_causal_lm(folder + "/target", dtype="float64", tp=True, vocab_sharded_head=head)
    drafter = load_dflash(folder + "/drafter", target)
    result = {"slice": getattr(target, "kdtree_vocab_slice", None)}
    for name, kw, sampling in cases:
        params = None if sampling is None else [SamplingParams(temperature=t, seed=s) for t, s in sampling]
        eng = Engine(target, drafter, max_batch=4, max_length=96, prefill_chunk=8, **kw)
        outs = eng.generate(prompts, %(new)d, params)
        result[name] = [o.tokens for o in outs]
        result[name + " rounds"] = eng.stats.rounds
        result["tp"] = eng.tp
        result["cache heads"] = int(eng.kv.keys[0].shape[1])
    # The same target built whole on every rank and sharded in memory (shard_causal_lm), its
    # DFlash drafter loaded before the sharding (it reads the slice from the shared head).
    from kdtree.engine.hf import shard_causal_lm
    whole = load_causal_lm(folder + "/target", dtype="float64")
    early = load_dflash(folder + "/drafter", whole)
    shard_causal_lm(whole, vocab_sharded_head=head)
    try:
        shard_causal_lm(whole)
        result["twice"] = "accepted"
    except ValueError as exc:
        result["twice"] = str(exc)
    eng = Engine(whole, early, max_batch=4, max_length=96, prefill_chunk=8, budget=12)
    result["sharded in memory"] = [o.tokens for o in eng.generate(prompts, %(new)d)]
    result["sharded in memory slice"] = getattr(whole, "kdtree_vocab_slice", None)
    try:  # rank 1 fails its own checks: rank 0 raises too, naming it, instead of waiting
        Engine(target, drafter, max_batch=4, max_length=96, budget=12 if rank == 0 else -1)
        result["local failure"] = "accepted"
    except ValueError as exc:
        result["local failure"] = str(exc)
    try:  # rank 1 asks for another budget: every rank refuses, with the same words
        Engine(target, drafter, max_batch=4, max_length=96, budget=12 + rank)
        result["mismatch"] = "accepted"
    except ValueError as exc:
        result["mismatch"] = str(exc)
    try:  # the drafter's top-k at each depth cannot exceed a rank's slice of the vocabulary
        Engine(target, drafter, max_batch=4, max_length=96, budget=64)
        result["wide"] = "accepted"
    except ValueError as exc:
        result["wide"] = str(exc)
    # rank 1 fails after the settings agree (its caches cannot be allocated): both raise
    from kdtree.engine import attention
    attach = attention.attach
    if rank == 1:
        def no_room(*args, **kwargs):
            raise RuntimeError("out of memory (simulated)")
        attention.attach = no_room
    try:
        Engine(target, drafter, max_batch=2, max_length=96, budget=4)
        result["late failure"] = "accepted"
    except RuntimeError as exc:
        result["late failure"] = str(exc)
    attention.attach = attach
    eng = Engine(target, drafter, max_batch=2, max_length=96, budget=4, sampling=True)
    try:
        eng.submit([1, 2, 3], 4, SamplingParams(temperature=0.7, top_p=0.9))
        result["top_p"] = "accepted"
    except ValueError as exc:
        result["top_p"] = str(exc)
    json.dump(result, open(out, "w"))
""") % {"new": NEW}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3 target (4 query heads, 2 KV heads, an LM head of its own) and a DFlash
    drafter over it, saved; prompts of 1 .. 30 tokens."""
    from kdtree.engine import dflash

    folder = tmp_path_factory.mktemp("engine_tp")
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20.0)  # logits of tens, as a trained model's
    target.save_pretrained(str(folder / "target"))
    dcfg = dflash.dflash_config(dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=256, block_size=6, num_target_layers=4,
                                     dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 3]}))
    torch.manual_seed(1)
    drafter = dflash.DFlashDrafter(dcfg, target.get_input_embeddings(), target.get_output_embeddings())
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    dflash.save_dflash(drafter.to(torch.float64), folder / "drafter")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 2, 9, 17, 30, 5)]
    (folder / "prompts.json").write_text(json.dumps(prompts))
    (folder / "cases.json").write_text(json.dumps(CASES))
    return folder


@pytest.fixture(scope="module")
def single(models):
    """The single-process engine's outputs (no process group: the same Engine, unsharded)."""
    from kdtree.engine.batched import Engine, SamplingParams
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    target = load_causal_lm(models / "target", dtype="float64")
    drafter = load_dflash(models / "drafter", target)
    prompts = json.loads((models / "prompts.json").read_text())
    result = {}
    for name, kw, sampling in CASES:
        params = None if sampling is None else [SamplingParams(temperature=t, seed=s) for t, s in sampling]
        eng = Engine(target, drafter, max_batch=4, max_length=96, prefill_chunk=8, **kw)
        result[name] = [o.tokens for o in eng.generate(prompts, NEW, params)]
        result[name + " rounds"] = eng.stats.rounds
        assert eng.tp == 1
    return result


def run_world(spawn_ranks, models, tmp_path, head: bool):
    outs = [tmp_path / f"{'head' if head else 'plan'}{r}.json" for r in range(2)]
    spawn_ranks(_WORKER, 2, lambda r: [models, outs[r], "head" if head else "plan"], timeout=600)
    return [json.loads(o.read_text()) for o in outs]


def check_ranks(ranks, single):
    for r in ranks:
        assert r["tp"] == 2 and r["cache heads"] == 1  # each rank caches its one of the two KV heads
        for name, *_ in CASES:
            assert r[name] == single[name], name
            assert r[name + " rounds"] == single[name + " rounds"], name
    # the cases decode something worth comparing: the modes differ in rounds, sampling in tokens
    assert single["ddtree"] == single["ar"] and single["chain"] == single["ar"]
    assert single["sampled"][0] == single["ar"][0] and single["sampled"][1] != single["ar"][1]
    assert single["ddtree rounds"] < single["ar rounds"]
    for r in ranks:
        assert r["sharded in memory"] == single["ddtree"]
        assert r["sharded in memory slice"] == r["slice"]
        assert "the model is sharded already" in r["twice"]
    assert ranks[1]["local failure"].startswith("budget must be an integer in [0, 4096]")
    assert ranks[0]["local failure"].startswith("rank 1: ValueError: budget must be an integer")
    mismatch = {r["mismatch"] for r in ranks}
    assert len(mismatch) == 1
    assert "every rank must build the same engine" in (m := mismatch.pop()) and "rank 1 has budgets = [13]" in m
    assert ranks[1]["late failure"] == "out of memory (simulated)"
    assert ranks[0]["late failure"].startswith("rank 1 failed to build its engine (RuntimeError: out of memory")
    assert single["budget 0"] == single["ar"]


def test_engine_on_a_tensor_parallel_target_decodes_the_single_process_tokens(spawn_ranks, models, single, tmp_path):
    ranks = run_world(spawn_ranks, models, tmp_path, head=False)
    check_ranks(ranks, single)
    assert all(r["slice"] is None for r in ranks)
    assert all(r["wide"] == "accepted" and r["top_p"] == "accepted" for r in ranks)


def test_engine_on_a_vocabulary_sharded_lm_head(spawn_ranks, models, single, tmp_path):
    ranks = run_world(spawn_ranks, models, tmp_path, head=True)
    assert [r["slice"] for r in ranks] == [[0, 48], [48, 48]]
    check_ranks(ranks, single)
    for r in ranks:
        assert "top-64 at each depth, more than the smallest rank's vocabulary slice (48 entries)" in r["wide"]
        assert "top_p and top_k are not supported over a vocabulary-sharded LM head" in r["top_p"]


_CLI = textwrap.dedent("""
    import sys
    from kdtree.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def test_cli_batched_engine_under_torchrun(spawn_ranks, tmp_path):
    """``generate --tp --batch-size`` in a two-rank world prints what one process prints
    (the requests' texts, every output equal to autoregressive decoding), from rank 0 only."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from kdtree.engine import dflash

    root = Path(__file__).resolve().parents[1]
    shipped = root / "fixtures" / "models" / "stdlib-qwen3"
    cfg = transformers.Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20.0)
    target.save_pretrained(str(tmp_path / "target"))
    shutil.copy(shipped / "tokenizer.json", tmp_path / "target" / "tokenizer.json")
    dcfg = dflash.dflash_config(dict(vocab_size=8192, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=512, block_size=5, num_target_layers=2,
                                     dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 1]}))
    drafter = dflash.DFlashDrafter(dcfg, target.get_input_embeddings(), target.get_output_embeddings())
    dflash.save_dflash(drafter, tmp_path / "drafter")
    (tmp_path / "prompts.txt").write_text("def main():\n\nimport os, sys\n\nclass Engine:\n")
    args = ["generate", "--target", tmp_path / "target", "--drafter", tmp_path / "drafter", "--prompts-file",
            tmp_path / "prompts.txt", "--batch-size", "2", "--budget", "8", "--max-new-tokens", "10", "--device",
            "cpu", "--dtype", "float32", "--no-progress", "--no-eos-stop"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "python"), env.get("PYTHONPATH", "")])
    one = subprocess.run([sys.executable, "-m", "kdtree", *map(str, args)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    two = spawn_ranks(_CLI, 2, lambda r: [*args, "--tp"], timeout=300)

    def requests(text):  # the request sections: each request's header line and its decoded text
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("---- request 0"))
        end = next(i for i, line in enumerate(lines) if line.startswith("-" * 66))
        return [line for line in lines[start:end] if line.strip()]

    want = requests(one.stdout)
    assert len([line for line in want if line.startswith("---- request")]) == 3
    assert "identical  : 3 of 3 outputs equal greedy autoregressive decoding" in one.stdout
    assert requests(two[0]) == want
    assert "identical  : 3 of 3 outputs equal greedy autoregressive decoding" in two[0]
    assert "---- request" not in two[1]  # rank 1 prints nothing of its own


_GPU_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from kdtree.engine.batched import Engine, SamplingParams
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    folder, out = sys.argv[1], sys.argv[2]
    prompts = json.loads(open(folder + "/prompts.json").read())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    result = {}
    for name, tp in (("plain", False), ("sharded head", True)):
        if tp:
            target = load_causal_lm(folder + "/target", dtype="float32", tp=True, vocab_sharded_head=True)
        else:
            target = load_causal_lm(folder + "/target", device="cuda", dtype="float32")
        drafter = load_dflash(folder + "/drafter", target)
        eng = Engine(target, drafter, max_batch=4, max_length=96, budget=12)
        result[name] = [o.tokens for o in eng.generate(prompts, %(new)d)]
        result[name + " slice"] = getattr(target, "kdtree_vocab_slice", None)
        eng = Engine(target, drafter, max_batch=4, max_length=96, budget=12, sampling=True)
        params = [SamplingParams(temperature=0.0 if i %% 3 == 0 else 0.9, seed=i) for i in range(len(prompts))]
        result[name + " sampled"] = [o.tokens for o in eng.generate(prompts, %(new)d, params)]
    json.dump(result, open(out, "w"))
""") % {"new": NEW}


@pytest.mark.gpu
def test_gpu_engine_with_a_vocabulary_sharded_head_in_a_one_rank_nccl_world(cuda_device, spawn_ranks, models,
                                                                             tmp_path):
    """The CUDA-graph round with the sharded top-k and target choices (NCCL collectives in
    the graph) on one GPU: a world of one rank, whose slice is the whole vocabulary, decodes
    what the plain engine decodes, greedy and sampled."""
    out = tmp_path / "gpu.json"
    spawn_ranks(_GPU_WORKER, 1, lambda r: [models, out], timeout=600)
    r = json.loads(out.read_text())
    assert r["sharded head slice"] == [0, VOCAB]
    assert r["sharded head"] == r["plain"]
    # sampled (greedy and sampled requests in one batch): the sharded draw is the unsharded one
    assert r["sharded head sampled"] == r["plain sampled"] and r["plain sampled"] != r["plain"]


_NCCL_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from kdtree.engine.batched import Engine, SamplingParams
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    folder, out, head = sys.argv[1], sys.argv[2], sys.argv[3] == "head"
    cases = json.loads(open(folder + "/cases.json").read())
    prompts = json.loads(open(folder + "/prompts.json").read())
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    target = load_causal_lm(folder + "/target", dtype="float32", tp=True, vocab_sharded_head=head)
    drafter = load_dflash(folder + "/drafter", target)
    result = {}
    for name, kw, sampling in cases:
        params = None if sampling is None else [SamplingParams(temperature=t, seed=s) for t, s in sampling]
        eng = Engine(target, drafter, max_batch=4, max_length=96, prefill_chunk=8, **kw)
        result[name] = [o.tokens for o in eng.generate(prompts, %(new)d, params)]
    json.dump(result, open(out, "w"))
""") % {"new": NEW}


@pytest.mark.gpu
@pytest.mark.parametrize("head", ["whole", "sharded"])
def test_gpus_nccl_engine_decodes_the_single_gpu_tokens(cuda_device, spawn_ranks, models, tmp_path, head):
    """Two GPUs, NCCL, CUDA-graph rounds (float32): every rank decodes what one GPU decodes,
    in every mode, greedy and sampled, with the LM head whole and split."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")
    from kdtree.engine.batched import Engine, SamplingParams
    from kdtree.engine.dflash import load_dflash
    from kdtree.engine.hf import load_causal_lm

    target = load_causal_lm(models / "target", device=str(cuda_device), dtype="float32")
    drafter = load_dflash(models / "drafter", target)
    prompts = json.loads((models / "prompts.json").read_text())
    outs = [tmp_path / f"nccl{r}.json" for r in range(2)]
    spawn_ranks(_NCCL_WORKER, 2, lambda r: [models, outs[r], head], timeout=600)
    ranks = [json.loads(o.read_text()) for o in outs]
    for name, kw, sampling in CASES:
        if name not in ranks[0]:
            continue
        params = None if sampling is None else [SamplingParams(temperature=t, seed=s) for t, s in sampling]
        eng = Engine(target, drafter, max_batch=4, max_length=96, prefill_chunk=8, **kw)
        want = [o.tokens for o in eng.generate(prompts, NEW, params)]
        for r in ranks:
            assert r[name] == want, (head, name)
