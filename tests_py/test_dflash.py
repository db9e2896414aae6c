"""DFlash drafters in the published format (kdtree.engine.dflash).

The reference here is independent of the module: the published computation written out
in numpy float64 from its description (context features, per-layer queries from the block
and keys/values from [context; block] with per-head RMS norms and rotary positions, no
mask, the target's embedding and LM head). The module must equal it to float64 rounding,
the cached decoder (DFlashKV) must equal the module, and the batched engine with a DFlash
drafter must give exactly the target's greedy output. (Parity with the published module
itself: tools/check_dflash_parity.py, which needs its source.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")

from kdtree.engine import dflash  # noqa: E402
from kdtree.engine.batched import Engine  # noqa: E402

VOCAB, HIDDEN, TARGET_LAYERS = 96, 48, 6


def tiny_target(seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                                   num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # logits of tens, as a trained model's
    return model


def drafter_config(block=8, ids=(1, 3), layers=2, mask=5, **extra):
    d = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             block_size=block, num_target_layers=TARGET_LAYERS,
             dflash_config={"mask_token_id": mask} | ({"target_layer_ids": list(ids)} if ids is not None else {}))
    d.update(extra)
    return d


def random_drafter(target, seed=1, **kw):
    cfg = dflash.dflash_config(drafter_config(**kw))
    torch.manual_seed(seed)
    m = dflash.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return m.to(next(target.parameters()).dtype).eval()


# ---- the independent float64 reference ----------------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[d // 2:], x[: d // 2]])
    return x * cos + rot * sin


def reference_logits(model, feats, root, start, depth):
    """float64 logits [depth, V] of one request: feats [T, F] at positions 0 .. T-1, the root
    at position start."""
    cfg = model.config
    P = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    emb = model._target_io[0].weight.detach().double().numpy()
    head = model._target_io[1].weight.detach().double().numpy()
    eps = cfg.rms_norm_eps
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = feats.shape[0]
    ctx = _rms(feats @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    h = np.stack([emb[root]] + [emb[cfg.dflash_config["mask_token_id"]]] * depth)
    pos_ctx, pos_blk = np.arange(t), start + np.arange(depth + 1)
    for i in range(cfg.num_hidden_layers):
        L = f"layers.{i}."
        x = _rms(h, P[L + "input_layernorm.weight"], eps)
        rows = np.concatenate([ctx, x])
        rpos = np.concatenate([pos_ctx, pos_blk])
        q = (x @ P[L + "self_attn.q_proj.weight"].T).reshape(len(x), nh, d)
        k = (rows @ P[L + "self_attn.k_proj.weight"].T).reshape(len(rows), nkv, d)
        v = (rows @ P[L + "self_attn.v_proj.weight"].T).reshape(len(rows), nkv, d)
        out = np.zeros((len(x), nh, d))
        for hh in range(nh):
            g = hh // (nh // nkv)
            qs = np.stack([_rope(_rms(q[r, hh], P[L + "self_attn.q_norm.weight"], eps), pos_blk[r], theta)
                           for r in range(len(x))])
            ks = np.stack([_rope(_rms(k[r, g], P[L + "self_attn.k_norm.weight"], eps), rpos[r], theta)
                           for r in range(len(rows))])
            s = qs @ ks.T / np.sqrt(d)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        h = h + out.reshape(len(x), -1) @ P[L + "self_attn.o_proj.weight"].T
        y = _rms(h, P[L + "post_attention_layernorm.weight"], eps)
        gate = y @ P[L + "mlp.gate_proj.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (y @ P[L + "mlp.up_proj.weight"].T)) @ P[L + "mlp.down_proj.weight"].T
    return _rms(h[1:], P["norm.weight"], eps) @ head.T


def features(target, tokens, ids):
    with torch.no_grad():
        hs = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in ids], dim=-1)[0]


@pytest.mark.parametrize(("block", "ids", "layers"), [(8, (1, 3), 2), (16, (0, 4, 5), 1), (16, None, 3)])
def test_module_equals_the_reference(block, ids, layers):
    target = tiny_target()
    m = random_drafter(target, block=block, ids=ids, layers=layers)
    used = m.target_layer_ids
    assert used == tuple(ids if ids is not None else dflash.default_target_layer_ids(TARGET_LAYERS, layers))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, 23).tolist()
    f = features(target, tokens[:-1], used)
    want = reference_logits(m, f.numpy(), tokens[-1], 22, block - 1)
    with torch.no_grad():
        got = m(f[None], torch.ones((1, 22), dtype=torch.bool), torch.tensor([tokens[-1]]), torch.tensor([22]))[0]
    # float64 but for the rotary tables, which transformers' Qwen3RotaryEmbedding computes in
    # float32 (as the published module does): agreement to ~1e-7 of the logits' scale
    assert np.abs(got.numpy() - want).max() < 1e-6 * max(1.0, np.abs(want).max())
    # float32, as users run it: within float32 rounding of the float64 reference
    t32 = tiny_target(dtype=torch.float32)
    m32 = random_drafter(t32, block=block, ids=ids, layers=layers)
    want32 = reference_logits(m32, features(t32, tokens[:-1], used).double().numpy(), tokens[-1], 22, block - 1)
    with torch.no_grad():
        got32 = m32(features(t32, tokens[:-1], used)[None], torch.ones((1, 22), dtype=torch.bool),
                    torch.tensor([tokens[-1]]), torch.tensor([22]))[0]
    assert np.abs(got32.double().numpy() - want32).max() <= 1e-4


def test_default_target_layer_ids():
    # the published rule, by hand: 36 target layers, 5 drafter layers: 1 + i * 32 / 4
    assert dflash.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash.default_target_layer_ids(28, 1) == [14]
    assert dflash.default_target_layer_ids(6, 3) == [1, 2, 3]  # 1 + i * 2 / 2


def test_cached_decoder_equals_the_module():
    """DFlashKV over two rounds for two requests of different lengths, in any slots."""
    target = tiny_target()
    m = random_drafter(target, block=8, ids=(0, 2, 5))
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in (19, 31)]
    kv = dflash.DFlashKV(m, 4, 64)
    slots = torch.tensor([3, 1])
    for r, seq in enumerate(seqs):  # prefill each request into its slot
        f = features(target, seq[:-1], m.target_layer_ids)
        kv.append(f[None], torch.arange(len(seq) - 1)[None], slot=slots[r:r + 1])
    for extra in (0, 4):
        if extra:  # a round commits 4 tokens for each request
            for r in range(2):
                seqs[r] += rng.integers(0, VOCAB, 4).tolist()
                f = features(target, seqs[r][:-1], m.target_layer_ids)
                n = len(seqs[r]) - 1
                kv.append(f[None, n - 4:n], torch.arange(n - 4, n)[None], slot=slots[r:r + 1])
        for r, seq in enumerate(seqs):
            n = len(seq) - 1
            f = features(target, seq[:-1], m.target_layer_ids)
            with torch.no_grad():
                want = m(f[None], torch.ones((1, n), dtype=torch.bool), torch.tensor([seq[-1]]), torch.tensor([n]))
            # forward reads slots 0 .. b-1: put the request's rows in slot 0 for the check
            for layer in range(len(kv.keys)):
                kv.keys[layer][0].copy_(kv.keys[layer][int(slots[r])])
                kv.values[layer][0].copy_(kv.values[layer][int(slots[r])])
            got = kv.forward(torch.tensor([seq[-1]]), torch.tensor([n]))
            assert torch.allclose(got, want, rtol=0, atol=1e-10), (extra, r, float((got - want).abs().max()))


def test_blocks_over_one_context_equal_each_block_alone():
    """forward_blocks (A blocks a sequence over one context, the training form) equals
    forward of each block alone, at starts 0 (no context), inside and at the end."""
    target = tiny_target()
    m = random_drafter(target, block=8, ids=(0, 2, 5))
    rng = np.random.default_rng(3)
    seqs = torch.as_tensor(rng.integers(0, VOCAB, (2, 30)))
    feats = torch.stack([features(target, seq.tolist(), m.target_layer_ids) for seq in seqs])
    starts = torch.tensor([[0, 7, 29, 7], [12, 3, 22, 29]])
    roots = torch.gather(seqs, 1, starts)
    with torch.no_grad():
        got = m.forward_blocks(feats, starts, roots, depth=5)
        assert got.shape == (2, 4, 5, VOCAB)
        for b in range(2):
            for a in range(4):
                p = starts[b, a]
                want = m(feats[b:b + 1], (torch.arange(30) < p)[None], roots[b, a:a + 1], p[None], 5)
                assert torch.allclose(got[b, a], want[0], rtol=0, atol=1e-10), (b, a)
    with pytest.raises(ValueError, match="starts and roots"):
        m.forward_blocks(feats, starts[:, :2], roots)
    with pytest.raises(ValueError, match="depth"):
        m.forward_blocks(feats, starts, roots, depth=8)


def test_bad_config_types_and_missing_target_weights(tmp_path):
    """Config fields of the wrong type are one ValueError naming the field; a target
    checkpoint missing a weight is refused (transformers would initialise it at random)."""
    from safetensors.torch import load_file, save_file

    from kdtree.engine.hf import load_causal_lm

    base = drafter_config(block=6, ids=(1, 2))
    for field, value in (("num_target_layers", [6]), ("num_target_layers", "abc"), ("layer_types", 5)):
        with pytest.raises(ValueError, match=field):
            dflash.dflash_config(base | {field: value})
    with pytest.raises(ValueError, match="not valid JSON"):
        (tmp_path / "bin.json").write_bytes(b"\xff\xfe{")
        dflash.dflash_config(tmp_path / "bin.json")
    family_model("qwen3").save_pretrained(tmp_path / "target")
    load_causal_lm(tmp_path / "target")  # complete: loads
    w = load_file(tmp_path / "target" / "model.safetensors")
    del w["model.norm.weight"]
    save_file(w, tmp_path / "target" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model.norm.weight'\]"):
        load_causal_lm(tmp_path / "target")
    # a NaN logit (a broken model) is an error, greedy or sampled, not an arbitrary token
    from kdtree.engine.hf import HFTarget, NonFiniteLogitsError

    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0]])
    for temperature in (0.0, 1.0):
        with pytest.raises(NonFiniteLogitsError, match="NaN in row 1 of 2"):
            HFTarget(family_model("qwen3"), temperature=temperature).choose(logits, [3, 4])
    assert HFTarget(family_model("qwen3")).choose(logits[:1], [3]).tolist() == [2]


def test_save_load_round_trip_and_errors(tmp_path):
    target = tiny_target()
    m = random_drafter(target)
    dflash.save_dflash(m, tmp_path / "d")
    assert dflash.is_dflash_folder(tmp_path / "d") and not dflash.is_dflash_folder(tmp_path)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["block_size"] == 8 and saved["dflash_config"]["target_layer_ids"] == [1, 3]
    back = dflash.load_dflash(tmp_path / "d", target)
    for (k, a), (k2, b) in zip(m.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    assert not any(k.startswith(("embed", "lm_head")) for k in back.state_dict())
    assert back._target_io[0] is target.get_input_embeddings()
    # a drafter that does not fit the target: refused before any weight is read
    other = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16)).double()
    with pytest.raises(ValueError, match="hidden_size 48 != the target's 32"):
        dflash.load_dflash(tmp_path / "d", other)
    # bad configs name the field
    for change, match in (({"block_size": 1}, "block_size"), ({"dflash_config": {}}, "mask_token_id"),
                          ({"num_attention_heads": 3}, "does not divide"), ({"num_hidden_layers": 100000}, "256"),
                          ({"intermediate_size": 0}, "intermediate_size"), ({"rms_norm_eps": 1}, "not a valid Qwen3"),
                          ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 1]}}, "distinct"),
                          ({"dflash_config": {"mask_token_id": VOCAB}}, "mask_token_id"),
                          ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [9]}}, "beyond"),
                          ({"dflash_config": None}, "dflash_config")):
        with pytest.raises(ValueError, match=match):
            dflash.dflash_config(drafter_config() | change)
    with pytest.raises(ValueError, match="not valid JSON"):
        dflash.dflash_config("{not json")
    # a drafter trained for a target of another depth
    cfg = dflash.dflash_config(drafter_config() | {"num_target_layers": 36})
    with pytest.raises(ValueError, match="num_target_layers 36"):
        dflash.check_pair(cfg, target)
    # weights that do not match the config
    from safetensors.torch import load_file, save_file

    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    ints = {k: (v * 0).to(torch.int64) if k == "norm.weight" else v for k, v in w.items()}
    save_file(ints, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="non-float dtype"):
        dflash.load_dflash(tmp_path / "d", target)
    w["fc.weight"] = w["fc.weight"][:, :10].contiguous()
    save_file(w, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        dflash.load_dflash(tmp_path / "d", target)
    del w["fc.weight"]
    save_file(w, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        dflash.load_dflash(tmp_path / "d", target)
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        dflash.load_dflash(tmp_path / "d", target)


@pytest.mark.parametrize("mode", ["ddtree", "chain"])
def test_batched_engine_with_a_dflash_drafter_equals_greedy(mode, tmp_path):
    """The batched engine with a (random) DFlash drafter loaded from the published format:
    every output is the target's own greedy decoding (float32)."""
    target = tiny_target(dtype=torch.float32)
    dflash.save_dflash(random_drafter(target, block=8, ids=(1, 4)), tmp_path / "d")
    drafter = dflash.load_dflash(tmp_path / "d", target)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 9, 30, 12)]
    want = []
    for p in prompts:
        with torch.no_grad():
            x = torch.tensor([p])  # (an explicit mask: without it, generate hides prompt tokens equal to the pad id)
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    eng = Engine(target, drafter, max_batch=2, budget=16, mode=mode, max_length=128)
    got = [o.tokens for o in eng.generate(prompts, 12)]
    assert got == want
    assert eng.stats.rounds < sum(len(w) for w in want)  # the drafter's tokens were used at least once


def family_model(family: str, vocab: int = VOCAB, seed: int = 0):
    """A small random causal LM of a family, float32."""
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=TARGET_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                          **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=16, **common), transformers.Qwen3ForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(head_dim=12, **common), transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_families_saved_and_reloaded_in_both_engines(family, tmp_path):
    """A target of each family saved with save_pretrained and loaded by kdtree, with a DFlash
    drafter in the published format: the batched engine and the single-sequence engine both
    give the target's own greedy decoding (float32)."""
    from kdtree.engine import autoregressive_generate, speculative_generate
    from kdtree.engine.drafter import BlockDrafterRunner
    from kdtree.engine.hf import HFTarget, load_causal_lm

    family_model(family).save_pretrained(tmp_path / "target")
    target = load_causal_lm(tmp_path / "target", dtype="float32")
    dflash.save_dflash(random_drafter(target, block=6, ids=(0, 3)), tmp_path / "drafter")
    drafter = dflash.load_dflash(tmp_path / "drafter", target)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 19, 11)]
    want = [autoregressive_generate(HFTarget(load_causal_lm(tmp_path / "target", dtype="float32")), p, 10).tokens
            for p in prompts]
    eng = Engine(target, drafter, max_batch=2, budget=8, max_length=96)
    assert [o.tokens for o in eng.generate(prompts, 10)] == want, family
    runner = BlockDrafterRunner(drafter)
    for p, w in zip(prompts, want, strict=True):
        res = speculative_generate(HFTarget(target, feature_layers=drafter.feature_layers), runner, p, 10,
                                   budget=8, depth=drafter.max_depth)
        assert res.tokens == w, family


def test_cli_target_and_drafter_folders(tmp_path):
    """kdtree generate --target DIR --drafter DIR: a Hugging Face folder (with the shipped
    tokenizer) and a published-format DFlash drafter, both engines; a mismatched pair is
    refused from the configs, naming the field."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    family_model("qwen3", vocab=8192).save_pretrained(tmp_path / "target")
    shutil.copy(root / "fixtures" / "models" / "stdlib-qwen3" / "tokenizer.json", tmp_path / "target")
    target = family_model("qwen3", vocab=8192)
    cfg = dflash.dflash_config(drafter_config(block=6, ids=(1, 2)) | {"vocab_size": 8192})
    dflash.save_dflash(dflash.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()),
                       tmp_path / "drafter")
    env = {**__import__("os").environ, "PYTHONPATH": str(root / "python")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kdtree", "generate", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)

    base = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompt", "def f(x):",
            "--max-new-tokens", "8", "--budget", "8", "--no-progress"]
    r = cli(*base, "--repeats", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DFlash drafter (published format)" in r.stdout and "identical to greedy autoregressive" in r.stdout
    f = tmp_path / "prompts.txt"
    f.write_text("def f(x):\nclass A:\n")
    r = cli(*base[:4], "--batch-size", "2", "--prompts-file", str(f), "--max-new-tokens", "8", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "identical  : 2 of 2 outputs equal greedy autoregressive decoding" in r.stdout
    # mismatches: refused before loading, naming what differs
    bad = json.loads((tmp_path / "drafter" / "config.json").read_text())
    bad["hidden_size"] = 64
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(bad))
    r = cli(*base)
    assert r.returncode == 2 and "hidden_size 64 != the target's 48" in r.stderr, r.stderr[-500:]
    r = cli("--target", str(tmp_path / "target"), "--prompt", "x")
    assert r.returncode == 2 and "--target and --drafter go together" in r.stderr


def test_cli_refuses_models_twice_and_reports_bad_runs(tmp_path):
    """--models with --target/--drafter is refused; a run that fails on its data (a drafter
    with NaN weights) ends with one line and status 1, not a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**__import__("os").environ, "PYTHONPATH": str(root / "python")}
    target = family_model("qwen3", vocab=8192)
    target.save_pretrained(tmp_path / "target")
    import shutil

    shutil.copy(root / "fixtures" / "models" / "stdlib-qwen3" / "tokenizer.json", tmp_path / "target")
    cfg = dflash.dflash_config(drafter_config(block=6, ids=(1, 2)) | {"vocab_size": 8192})
    d = dflash.DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    with torch.no_grad():
        d.fc.weight.fill_(float("nan"))
    dflash.save_dflash(d, tmp_path / "drafter")
    base = [sys.executable, "-m", "kdtree", "generate", "--target", str(tmp_path / "target"), "--drafter",
            str(tmp_path / "drafter"), "--prompt", "x = 1", "--max-new-tokens", "4", "--no-progress"]
    r = subprocess.run(base + ["--models", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "name the models twice" in r.stderr
    r = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "NaN" in r.stderr, r.stderr[-800:]
