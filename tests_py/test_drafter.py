"""The DFlash-style block drafter (kdtree.drafter), on CPU.

- Context masking: a block that may see only the first p context positions gives the same
  logits as one given only those p positions' features (the injected keys and values of
  the rest are invisible), and the block's positions depend on the bonus's position.
- The block is bidirectional: a mask position's logits change when a later block token's
  embedding changes (the mask embedding), unlike a causal block.
- save_drafter / load_drafter round-trip the weights exactly; bad folders raise.
- The architecture learns: 300 Adam steps on a task that needs the injected context (copy
  the last three context tokens, reversed) reach > 95% top-1.
- With a Hugging Face target (features from chosen layers), DDTree greedy decoding with a
  random-weight block drafter still equals autoregressive decoding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
pytest.importorskip("safetensors", reason="safetensors is not installed (nox -s test installs it)")

from kdtree.drafter import (  # noqa: E402
    BlockDrafter,
    BlockDrafterConfig,
    BlockDrafterRunner,
    CallableDrafter,
    load_drafter,
    save_drafter,
)


def small_config(**kw) -> BlockDrafterConfig:
    base = dict(vocab_size=50, feature_size=24, target_layers=(1, 2), hidden_size=32, num_layers=2, num_heads=4,
                head_dim=8, intermediate_size=64, block_size=6)
    base.update(kw)
    return BlockDrafterConfig(**base)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return BlockDrafter(small_config(**kw)).to(torch.float64).eval()


def test_context_mask_equals_truncated_context():
    model = make()
    torch.manual_seed(1)
    feats = torch.randn(1, 9, 24, dtype=torch.float64)
    for p in (0, 1, 5, 9):
        valid = torch.zeros(1, 9, dtype=torch.bool)
        valid[0, :p] = True
        masked = model(feats, valid, torch.tensor([7]), torch.tensor([p]))
        short = model(feats[:, :p], torch.ones(1, p, dtype=torch.bool), torch.tensor([7]), torch.tensor([p]))
        assert torch.allclose(masked, short, rtol=0, atol=1e-12), p
    # the rotary positions matter: the same inputs at another start position differ
    valid = torch.ones(1, 9, dtype=torch.bool)
    a = model(feats, valid, torch.tensor([7]), torch.tensor([9]))
    b = model(feats, valid, torch.tensor([7]), torch.tensor([20]))
    assert not torch.allclose(a, b)


def test_block_attention_is_bidirectional():
    model = make()
    feats = torch.randn(1, 4, 24, dtype=torch.float64)
    valid = torch.ones(1, 4, dtype=torch.bool)
    args = (feats, valid, torch.tensor([3]), torch.tensor([4]))
    before = model(*args, depth=5)
    with torch.no_grad():
        model.mask_embedding.add_(0.5)
    after = model(*args, depth=5)
    # position 1 sees positions 2..5 (masks) as well: its logits change with the mask embedding
    assert not torch.allclose(before[0, 0], after[0, 0])
    # a shorter block is a different input (fewer mask tokens to attend to)
    assert model(*args, depth=2).shape == (1, 2, 50)


def test_save_load_round_trip(tmp_path):
    model = make(seed=3).float()
    save_drafter(model, tmp_path)
    cfg = json.loads((tmp_path / "drafter_config.json").read_text())
    assert cfg["target_layers"] == [1, 2] and cfg["block_size"] == 6
    loaded = load_drafter(tmp_path)
    for (ka, va), (kb, vb) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "missing")
    (tmp_path / "drafter_config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(ValueError, match="drafter.safetensors"):
        load_drafter(tmp_path)
    assert not list(tmp_path.glob("*.tmp-*"))  # the atomic writes left no temporary file
    # A config far larger than its weights is refused from the file header, before any
    # model of that size exists (2**21 x 1024 floats would be 8 GB).
    (tmp_path / "drafter_config.json").write_text(json.dumps({**cfg, "vocab_size": 2**21, "hidden_size": 1024}))
    with pytest.raises(ValueError, match="does not match"):
        load_drafter(tmp_path)
    (tmp_path / "drafter_config.json").write_text(json.dumps({**cfg, "surprise": 1}))
    with pytest.raises(ValueError, match="unknown"):
        load_drafter(tmp_path)


def test_config_checks():
    with pytest.raises(ValueError, match="block_size"):
        small_config(block_size=1)
    with pytest.raises(ValueError, match="block_size"):
        small_config(block_size=10**9)
    with pytest.raises(ValueError, match="block_size"):
        small_config(block_size="16")
    with pytest.raises(ValueError, match="feature_size"):
        small_config(feature_size=24.5)
    with pytest.raises(ValueError, match="target_layers"):
        small_config(target_layers=(1, -2))
    with pytest.raises(ValueError, match="JSON object"):
        BlockDrafterConfig.from_json("[1, 2]")
    with pytest.raises(ValueError, match="head_dim"):
        small_config(head_dim=7)
    with pytest.raises(ValueError, match="vocab_size"):
        small_config(vocab_size=0)


def test_the_drafter_learns_a_copy_task():
    # The block must output the last three context tokens in reverse order, which only the
    # injected context features carry (the bonus token is random noise here).
    torch.manual_seed(0)
    cfg = small_config(vocab_size=16, feature_size=16, block_size=4, num_layers=2)
    model = BlockDrafter(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    eye = torch.eye(16)

    def batch(n):
        ctx = torch.randint(0, 16, (n, 10))
        bonus = torch.randint(0, 16, (n,))
        return eye[ctx], bonus, ctx[:, [9, 8, 7]]

    start = torch.full((64,), 10)
    for _ in range(300):
        feats, bonus, target = batch(64)
        logits = model(feats, torch.ones(64, 10, dtype=torch.bool), bonus, start)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    feats, bonus, target = batch(512)
    with torch.no_grad():
        logits = model(feats, torch.ones(512, 10, dtype=torch.bool), bonus, torch.full((512,), 10))
    acc = float((logits.argmax(-1) == target).float().mean())
    assert acc > 0.95, acc


def test_runner_checks_and_callable_drafter():
    runner = BlockDrafterRunner(make())
    with pytest.raises(ValueError, match="depth"):
        runner.draft([1, 2, 3], 6, torch.zeros(2, 24, dtype=torch.float64))
    with pytest.raises(ValueError, match="features"):
        runner.draft([1, 2, 3], 2, torch.zeros(3, 24, dtype=torch.float64))
    with pytest.raises(ValueError, match="features"):
        runner.draft([1, 2, 3], 2, None)
    out = runner.draft([4], 3, None)  # a one-token context needs no features
    assert out.shape == (3, 50) and out.dtype == np.float32
    assert runner.draft([4], 0, None).shape == (0, 50)
    fixed = CallableDrafter(lambda ctx, depth, feats: np.zeros((depth, 50)), 50)
    assert fixed.draft([1], 4).shape == (4, 50)
    with pytest.raises(ValueError, match="shape"):
        CallableDrafter(lambda ctx, depth, feats: np.zeros((depth, 49)), 50).draft([1], 2)

    def huge(ctx, depth, feats):
        x = np.zeros((depth, 50))
        x[1, 7] = 1e300  # finite, but not in float32
        return x

    with pytest.raises(ValueError, match="depth 1, token 7 is beyond float32"):
        CallableDrafter(huge, 50).draft([1], 2)
    inf_in = CallableDrafter(lambda ctx, depth, feats: np.full((depth, 50), -np.inf), 50).draft([1], 2)
    assert np.isneginf(inf_in).all()  # infinities given stay what they were (the tree rules handle them)


def test_engine_with_hf_target_and_block_drafter_is_lossless():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from kdtree.engine import autoregressive_generate, speculative_generate
    from kdtree.hf import HFTarget

    cfg = transformers.Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(5)
    target_model = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        target_model.model.embed_tokens.weight.mul_(25.0)
    drafter = BlockDrafterRunner(make(seed=6, feature_size=64, target_layers=(1, 2)))
    rng = np.random.default_rng(0)
    for trial in range(4):
        prompt = rng.integers(0, 50, int(rng.integers(1, 9))).tolist()
        ar = autoregressive_generate(HFTarget(target_model), prompt, 15)
        res = speculative_generate(HFTarget(target_model, feature_layers=(1, 2)), drafter, prompt, 15,
                                   budget=12, depth=5)
        assert res.tokens == ar.tokens, trial
    assert drafter.calls > 0
