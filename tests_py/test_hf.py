"""The transformers target (kdtree.hf) with the DDTree engine, on CPU in float64.

Small randomly initialised Qwen3 models (no checkpoint needed) make every check exact up to
float64 rounding, so an argmax cannot flip by rounding:
- the tree forward's logits at every node equal a plain causal forward of the node's
  root-to-node path (tree attention mask and positions are right);
- after a round's compaction the KV cache (and the drafter features) equal those of a
  fresh prefill of the committed tokens;
- DDTree greedy output equals greedy autoregressive output token for token (20 prompts x
  budgets 1, 4, 16, 64, 256), with fewer target forwards when the drafter is good;
- sampling is lossless: with temperature 1 (and 1.5 with top-p 0.9) the first two generated
  tokens follow the target's exact joint distribution (chi-square over 2,000 seeds), as
  autoregressive sampling's do, and the same statistic rejects a wrong distribution;
- sampled draws are keyed by (seed, position): DDTree's sampled text equals autoregressive
  sampling's with the same seed token for token, and the keyed uniforms equal a plain
  Python Philox4x32-10 of the documented counter and key.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")

import kdtree  # noqa: E402
from kdtree.engine import autoregressive_generate, speculative_generate  # noqa: E402
from kdtree.engine.hf import NonFiniteLogitsError, keyed_uniforms  # noqa: E402
from kdtree.hf import HFTarget, top_p_filter  # noqa: E402


def tiny_qwen3(vocab: int = 97, layers: int = 2, seed: int = 0):
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    # Sharper distributions than the default init, so greedy paths are not all ties-free noise.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(25.0)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


def path_tokens(trees, i: int) -> list[int]:
    out = []
    while i > 0:
        out.append(int(trees.tokens[0, i]))
        i = int(trees.parents[0, i])
    return out[::-1]


def causal_logits(model, seq: list[int]):
    with torch.no_grad():
        return model(torch.tensor([seq], device=model.device)).logits[0, -1].cpu()


class NoisyOracleDrafter:
    """A test drafter: the target's own greedy continuation (recomputed without a cache),
    kept at each depth with probability ``keep`` and replaced by a random token otherwise,
    returned as peaked logits plus noise. Deterministic for a seed."""

    def __init__(self, model, keep: float, seed: int):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.keep = keep
        self.rng = np.random.default_rng(seed)

    def draft(self, context, depth, features=None):
        seq = list(context)
        logits = self.rng.standard_normal((depth, self.vocab_size))
        for d in range(depth):
            tok = int(causal_logits(self.model, seq).argmax())
            if self.rng.random() >= self.keep:
                tok = int(self.rng.integers(self.vocab_size))
            logits[d, tok] += 6.0
            seq.append(tok)
        return logits


class RandomDrafter:
    """Random logits (seeded): a drafter with no knowledge of the target."""

    def __init__(self, vocab: int, seed: int):
        self.vocab_size = vocab
        self.rng = np.random.default_rng(seed)

    def draft(self, context, depth, features=None):
        return self.rng.standard_normal((depth, self.vocab_size)) * 2.0


# ---- tree attention and positions ------------------------------------------------------

@pytest.mark.parametrize("budget", [1, 7, 40])
def test_tree_forward_matches_each_path_forward(model, budget):
    rng = np.random.default_rng(budget)
    for trial in range(3):
        prompt = rng.integers(0, 97, int(rng.integers(1, 20))).tolist()
        target = HFTarget(model)
        target.prefill(prompt)
        depth = int(rng.integers(1, 6))
        lp, ids = kdtree.topk_logprobs(rng.standard_normal((depth, 97)) * 2.0, min(budget, 97))
        trees = kdtree.build_trees(lp, ids, budget, root_tokens=[prompt[-1]], root_positions=[len(prompt) - 1],
                                   vocab_size=97)
        logits = target.tree_logits(trees)
        n = int(trees.num_nodes[0])
        assert logits.shape == (n + 1, 97)  # padding rows are not forwarded
        for i in range(n + 1):
            ref = causal_logits(model, prompt + path_tokens(trees, i))
            assert torch.allclose(logits[i], ref, rtol=0, atol=1e-12), f"trial {trial}, node {i}"


def test_tree_root_must_be_the_last_committed_token(model):
    target = HFTarget(model)
    target.prefill([5, 6, 7])
    lp, ids = kdtree.topk_logprobs(np.zeros((2, 97)), 2)
    wrong_token = kdtree.build_trees(lp, ids, 3, root_tokens=[8], root_positions=[2])
    with pytest.raises(ValueError, match="root"):
        target.tree_logits(wrong_token)
    wrong_position = kdtree.build_trees(lp, ids, 3, root_tokens=[7], root_positions=[3])
    with pytest.raises(ValueError, match="position"):
        target.tree_logits(wrong_position)


# ---- KV-cache compaction -----------------------------------------------------------------

def test_compaction_equals_decoding_the_accepted_tokens(model):
    rng = np.random.default_rng(7)
    for trial in range(12):
        prompt = rng.integers(0, 97, int(rng.integers(1, 15))).tolist()
        target = HFTarget(model, feature_layers=(0, 2))
        target.prefill(prompt)
        depth = int(rng.integers(1, 7))
        budget = int(rng.integers(1, 30))
        lp, ids = kdtree.topk_logprobs(rng.standard_normal((depth, 97)), min(budget, 97))
        trees = kdtree.build_trees(lp, ids, budget, root_tokens=[prompt[-1]], root_positions=[len(prompt) - 1])
        target.tree_logits(trees)
        # Accept a random root-to-node path (any node: the walk could end there).
        n = int(trees.num_nodes[0])
        end = int(rng.integers(0, n + 1))
        nodes = []
        i = end
        while i > 0:
            nodes.append(i)
            i = int(trees.parents[0, i])
        nodes = [0] + nodes[::-1]
        bonus = int(rng.integers(97))
        accepted = np.full((1, depth + 1), -1, dtype=np.int32)
        accepted[0, : len(nodes)] = nodes
        acc = kdtree.Acceptance(accepted, np.array([len(nodes) - 1], np.int32), np.array([bonus], np.int32))
        committed = [int(trees.tokens[0, j]) for j in nodes[1:]] + [bonus]
        target.commit(committed, trees, acc)
        assert target.committed_tokens == prompt + committed
        direct = HFTarget(model, feature_layers=(0, 2))
        direct.prefill(prompt + committed)
        assert target.cache_length == direct.cache_length == len(prompt) + len(committed) - 1
        for a, b in zip(target.cache.layers, direct.cache.layers, strict=True):
            assert torch.allclose(a.keys, b.keys, rtol=0, atol=1e-12), f"trial {trial}"
            assert torch.allclose(a.values, b.values, rtol=0, atol=1e-12), f"trial {trial}"
        assert torch.allclose(target.drafter_features(), direct.drafter_features(), rtol=0, atol=1e-12)


def test_commit_needs_the_acceptance_after_a_tree(model):
    target = HFTarget(model)
    target.prefill([1, 2, 3])
    lp, ids = kdtree.topk_logprobs(np.zeros((2, 97)), 2)
    trees = kdtree.build_trees(lp, ids, 3, root_tokens=[3], root_positions=[2])
    target.score_tree(trees)
    with pytest.raises(ValueError, match="acceptance"):
        target.commit([4], trees, None)


# ---- greedy decoding is lossless -----------------------------------------------------------

def test_greedy_ddtree_equals_greedy_ar(model):
    rng = np.random.default_rng(2026)
    prompts = [rng.integers(0, 97, int(rng.integers(1, 12))).tolist() for _ in range(20)]
    saved = 0
    for p_i, prompt in enumerate(prompts):
        ar = autoregressive_generate(HFTarget(model), prompt, 20)
        for budget in (1, 4, 16, 64, 256):
            drafter = NoisyOracleDrafter(model, keep=0.8, seed=p_i * 10 + budget)
            res = speculative_generate(HFTarget(model), drafter, prompt, 20, budget=budget, depth=6)
            assert res.tokens == ar.tokens, f"prompt {p_i}, budget {budget}"
            saved += ar.target_calls - res.target_calls
            assert res.target_calls <= ar.target_calls
    assert saved > 20 * 5 * 5  # a good drafter saves forwards (a mean of > 5 per run here)


def test_stop_token_and_max_new_tokens_inside_the_accepted_path(model):
    prompt = [3, 14, 15]
    ar = autoregressive_generate(HFTarget(model), prompt, 12)
    stop = ar.tokens[4]
    first = ar.tokens.index(stop)
    drafter = NoisyOracleDrafter(model, keep=1.0, seed=1)
    res = speculative_generate(HFTarget(model), drafter, prompt, 12, budget=16, depth=8, stop_tokens=[stop])
    assert res.tokens == ar.tokens[: first + 1] and res.stop_reason == "stop_token"
    res = speculative_generate(HFTarget(model), NoisyOracleDrafter(model, 1.0, 2), prompt, 5, budget=16, depth=8)
    assert res.tokens == ar.tokens[:5]


# ---- sampling is lossless -------------------------------------------------------------------

def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square(df) for the normal quantile z (3.09: p = 0.001), by the
    Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def joint_first_two(model, prompt, temperature, top_p):
    """Exact P(t1, t2) of the first two tokens of tempered top-p sampling."""
    def dist(seq):
        p = torch.softmax(causal_logits(model, seq) / temperature, dim=-1)[None]
        return (top_p_filter(p, top_p) if top_p < 1.0 else p)[0].numpy()

    p1 = dist(prompt)
    return np.stack([p1[a] * dist(prompt + [a]) for a in range(len(p1))])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.5, 0.9)])
def test_sampling_is_lossless_chi_square(temperature, top_p):
    vocab = 5
    model = tiny_qwen3(vocab=vocab, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.12)  # flatter: every pair likely enough to count
    prompt = [1, 3, 0, 2]
    expected = joint_first_two(model, prompt, temperature, top_p)
    runs, ar_runs = 2000, 1000
    counts = np.zeros((vocab, vocab))
    ar_counts = np.zeros((vocab, vocab))
    accepted = 0
    for seed in range(runs):
        drafter = RandomDrafter(vocab, seed)  # any drafter: the walk keeps the target's distribution
        target = HFTarget(model, temperature=temperature, top_p=top_p, seed=seed)
        res = speculative_generate(target, drafter, prompt, 2, budget=6, depth=2)
        counts[res.tokens[0], res.tokens[1]] += 1
        accepted += res.accepted[0]
    for seed in range(ar_runs):
        ar = autoregressive_generate(HFTarget(model, temperature=temperature, top_p=top_p, seed=10_000 + seed),
                                     prompt, 2)
        ar_counts[ar.tokens[0], ar.tokens[1]] += 1
    assert accepted > runs // 4  # first rounds often accept a draft token (paths of length 2 checked)
    cells = expected.reshape(-1) > 0
    want = expected.reshape(-1)[cells]
    limit = chi_square_critical(int(cells.sum()) - 1)
    stat = float((((counts.reshape(-1)[cells] - want * runs) ** 2) / (want * runs)).sum())
    ar_stat = float((((ar_counts.reshape(-1)[cells] - want * ar_runs) ** 2) / (want * ar_runs)).sum())
    assert counts.reshape(-1)[~cells].sum() == 0  # nothing outside the nucleus
    assert stat < limit, f"DDTree samples: chi-square {stat:.1f} >= {limit:.1f}"
    assert ar_stat < limit, f"AR samples: chi-square {ar_stat:.1f} >= {limit:.1f}"
    # The statistic has power: the same samples against a hotter distribution fail.
    wrong = joint_first_two(model, prompt, temperature * 2.0, 1.0).reshape(-1)[cells] * runs
    assert float((((counts.reshape(-1)[cells] - wrong) ** 2) / wrong).sum()) > limit


def test_sampled_ddtree_equals_sampled_ar_with_the_same_seed():
    model = tiny_qwen3(seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.2)  # flatter than the fixture: seeds give different texts
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 97, int(rng.integers(1, 10))).tolist() for _ in range(6)]
    accepted, texts = 0, set()
    for temperature, top_p in ((0.3, 1.0), (1.0, 0.9), (1.5, 1.0)):
        for p_i, prompt in enumerate(prompts):
            for seed in (0, 2**40 + 3):
                ar = autoregressive_generate(HFTarget(model, temperature=temperature, top_p=top_p, seed=seed),
                                             prompt, 16)
                texts.add((temperature, p_i, tuple(ar.tokens)))
                for budget, drafter in ((4, RandomDrafter(97, p_i)), (64, NoisyOracleDrafter(model, 0.9, p_i))):
                    target = HFTarget(model, temperature=temperature, top_p=top_p, seed=seed)
                    res = speculative_generate(target, drafter, prompt, 16, budget=budget, depth=5)
                    assert res.tokens == ar.tokens, f"T {temperature}, prompt {p_i}, seed {seed}, budget {budget}"
                    accepted += sum(res.accepted)
    assert accepted > 150  # multi-token rounds happen (at low temperature the greedy oracle is often right)
    assert len(texts) > 3 * 6  # the seed matters: two seeds give two texts (almost always)


def _philox_py(counter, key):
    """Philox4x32-10 in plain Python ints (Salmon et al., SC 2011)."""
    c, (k0, k1) = list(counter), key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def test_keyed_uniforms_are_the_documented_philox_words():
    for seed, pos in ((0, 0), (1, 5), (2**40 + 7, 2**33 + 9), (2**63 - 1, 123456)):
        w = _philox_py([pos & 0xFFFFFFFF, pos >> 32, 0, 0], (seed & 0xFFFFFFFF, seed >> 32))
        want = ((w[0] >> 5) * 2**26 + (w[1] >> 6) + 0.5) / 2**53
        assert keyed_uniforms(seed, [pos])[0] == want
    u = keyed_uniforms(3, np.arange(20000))
    assert ((u > 0) & (u < 1)).all() and abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).mean() - 0.1) < 0.01
    assert not np.array_equal(u[:100], keyed_uniforms(4, np.arange(100)))
    for bad_pos in ([-1], [2**63], [1.5]):
        with pytest.raises(ValueError, match=r"ints in \[0, 2\*\*63\)"):
            keyed_uniforms(0, bad_pos)
    for bad_seed in (-1, 2**64, 1.0, True):
        with pytest.raises(ValueError, match="seed must be"):
            keyed_uniforms(bad_seed, [0])
    assert keyed_uniforms(2**64 - 1, [2**63 - 1]).shape == (1,)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choose_refuses_rows_without_a_defined_distribution(model, temperature):
    target = HFTarget(model, temperature=temperature, seed=0)
    ok = torch.tensor([0.0, 1.0, -math.inf], dtype=torch.float64)
    for row, what in ((torch.tensor([0.0, math.nan, 1.0]), "NaN"), (torch.tensor([0.0, math.inf, 1.0]), r"\+inf"),
                      (torch.full((3,), -math.inf), "no finite")):
        with pytest.raises(NonFiniteLogitsError, match=what):
            target.choose(torch.stack([ok, row.to(torch.float64)]), [1, 2])
    p0 = 1 / (1 + math.e)  # softmax of (0, 1, -inf): token 0's probability
    want = [1, 1] if temperature == 0 else [0 if u < p0 else 1 for u in keyed_uniforms(0, [1, 2])]
    assert target.choose(torch.stack([ok, ok]), [1, 2]).tolist() == want
    if temperature:
        with pytest.raises(ValueError, match="one per row"):
            target.choose(torch.stack([ok, ok]), [1])
    with pytest.raises(ValueError, match=r"logits must be a floating-point \[n, V\].*shape \(3,\)"):
        target.choose(ok, [1])
    with pytest.raises(ValueError, match=r"V >= 1.*shape \(0, 0\)"):
        target.choose(torch.zeros(0, 0, dtype=torch.float64), [])
    with pytest.raises(TypeError, match="torch tensor"):
        target.choose(ok.numpy()[None], [1])
    with pytest.raises(ValueError, match="one per row"):  # greedy or not
        target.choose(torch.stack([ok, ok]), [1, 2, 3])


def test_a_draw_is_the_inverse_cdf_at_its_keyed_uniform(model):
    target = HFTarget(model, temperature=1.0, seed=11)
    u = keyed_uniforms(11, [5, 6, 7, 8])
    # probabilities 0.2, 0, 0.5, 0.3 (token 1 never drawn): the draw is the first id whose
    # cumulative probability exceeds u
    logits = torch.log(torch.tensor([[0.2, 0.0, 0.5, 0.3]] * 4, dtype=torch.float64))
    want = [0 if x < 0.2 else 2 if x < 0.7 else 3 for x in u]
    assert target.choose(logits, [5, 6, 7, 8]).tolist() == want
    assert target.choose(logits, [5, 6, 7, 8]).tolist() == want  # keyed: the same again
    # one likely token: always drawn; a lone token of nonzero probability at the end too
    assert target.choose(torch.tensor([[0.0, -math.inf, -math.inf]] * 4, dtype=torch.float64),
                         [1, 2, 3, 4]).tolist() == [0] * 4
    assert target.choose(torch.tensor([[-math.inf, -math.inf, 3.0]] * 4, dtype=torch.float64),
                         [1, 2, 3, 4]).tolist() == [2] * 4


def test_a_tiny_temperature_on_huge_logits_still_draws(model):
    # 1e308 / 1e-6 overflows float64: such a row is tempered from its maximum (token 0 holds
    # all the mass); a normal row in the same call keeps its own draw
    target = HFTarget(model, temperature=1e-6, seed=5)
    huge = torch.tensor([1e308, -1e308, 1e307], dtype=torch.float64)
    normal = torch.tensor([0.0, 1.0, -math.inf], dtype=torch.float64)
    assert target.choose(torch.stack([huge, normal]), [1, 2]).tolist() == [0, 1]
    assert HFTarget(model, temperature=1e-6, seed=5).choose(normal[None], [2]).tolist() == [1]


def test_top_p_filter_keeps_the_smallest_nucleus():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    out = top_p_filter(p, 0.75)
    assert torch.allclose(out[0], torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))
    # ties: lower ids first, the smallest set reaching 0.75 is 3 tokens
    assert torch.allclose(out[1], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))
    assert torch.allclose(top_p_filter(p, 0.1)[0], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))


def test_top_p_filter_from_candidates_equals_the_full_sort():
    gen = torch.Generator().manual_seed(5)
    rows = [torch.softmax(torch.randn(300, generator=gen, dtype=torch.float64) * scale, -1) for scale in (0.5, 3, 12)]
    flat = torch.full((300,), 1 / 300, dtype=torch.float64)  # all tied: the nucleus spans the candidates
    tied = torch.softmax(torch.randn(300, generator=gen, dtype=torch.float64) * 3, -1)
    tied[[7, 200, 250]] = tied.max()  # ties at the top, across ids far apart
    probs = torch.stack(rows + [flat, tied / tied.sum()])
    for top_p in (0.1, 0.5, 0.9, 0.95, 1.0):
        for candidates in (1, 8, 64):
            got = top_p_filter(probs, top_p, candidates=candidates)
            assert torch.equal(got, top_p_filter(probs, top_p, candidates=0)), (top_p, candidates)
    # by hand: a tie across the candidates' edge goes to the lower id (full sort fallback)
    p = torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=torch.float64)
    assert torch.allclose(top_p_filter(p, 0.5, candidates=2), torch.tensor([[2 / 3, 1 / 3, 0, 0]], dtype=torch.float64))


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="temperature"):
        HFTarget(model, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        HFTarget(model, top_p=0.0)
    with pytest.raises(ValueError, match="feature layer"):
        HFTarget(model, feature_layers=(3,))
    target = HFTarget(model)
    with pytest.raises(ValueError, match="outside"):
        target.prefill([97])
    with pytest.raises(ValueError, match="at least one"):
        target.prefill([])
    with pytest.raises(RuntimeError, match="prefill"):
        HFTarget(model).next_token()


# ---- misuse is refused, and a refused call changes nothing -------------------------------------

def _one_tree(model, prompt, budget=9, depth=4, seed=0):
    target = HFTarget(model)
    target.prefill(prompt)
    rng = np.random.default_rng(seed)
    lp, ids = kdtree.topk_logprobs(rng.standard_normal((depth, 97)) * 2.0, min(budget, 97))
    trees = kdtree.build_trees(lp, ids, budget, root_tokens=[prompt[-1]], root_positions=[len(prompt) - 1])
    return target, trees


def test_stop_token_inside_the_path_keeps_the_cache_exact(model):
    prompt = [11, 23, 40]
    ar = autoregressive_generate(HFTarget(model), prompt, 12)
    for stop in set(ar.tokens[:8]):
        target = HFTarget(model)
        res = speculative_generate(target, NoisyOracleDrafter(model, 1.0, 3), prompt, 12, budget=8, depth=8,
                                   stop_tokens=[stop])
        first = ar.tokens.index(stop)
        assert res.tokens == ar.tokens[: first + 1]
        assert target.cache_length == len(prompt) + len(res.tokens) - 1  # the stop token is the next root
        # decoding on from here equals decoding the committed tokens from scratch
        direct = HFTarget(model)
        direct.prefill(prompt + res.tokens)
        assert target.next_token() == direct.next_token()


def test_refused_commit_changes_nothing(model):
    prompt = [5, 9, 14, 2]
    target, trees = _one_tree(model, prompt)
    chosen = target.score_tree(trees)
    acc = kdtree.verify_greedy(trees, chosen, max_commit=50)
    good = acc.committed(trees, 0)
    with pytest.raises(ValueError, match="not what the walk commits"):
        target.commit(good + [1], trees, acc)
    bad = kdtree.Acceptance(np.array([[0, 7, 8, -1, -1]], np.int32), np.array([2], np.int32),
                            np.array([3], np.int32))
    with pytest.raises(ValueError, match="not a child|start at the root|outside"):
        target.commit([int(trees.tokens[0, 7]), int(trees.tokens[0, 8]), 3], trees, bad)
    other, _ = _one_tree(model, prompt, seed=1)
    with pytest.raises(ValueError, match="other trees"):
        target.commit(good, kdtree.build_trees(*kdtree.topk_logprobs(np.zeros((2, 97)), 2), 3,
                                               root_tokens=[2], root_positions=[3]), acc)
    target.commit(good, trees, acc)  # the right commit still works
    direct = HFTarget(model)
    direct.prefill(prompt + good)
    for a, b in zip(target.cache.layers, direct.cache.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, rtol=0, atol=1e-12)


def test_call_order_is_enforced(model):
    target, trees = _one_tree(model, [1, 2, 3])
    target.score_tree(trees)
    with pytest.raises(RuntimeError, match="not committed"):
        target.score_tree(trees)
    with pytest.raises(RuntimeError, match="not committed"):
        target.next_token()
    fresh = HFTarget(model)
    fresh.prefill([1, 2, 3])
    with pytest.raises(RuntimeError, match="without a forward"):
        fresh.commit([4])
    tok = fresh.next_token()
    with pytest.raises(ValueError, match="exactly one token"):
        fresh.commit([tok, tok])
    with pytest.raises(ValueError, match="at least one"):
        fresh.commit([])
    fresh.commit([tok])
    with pytest.raises(ValueError, match="not an integer"):
        fresh.prefill([1.7, 2])
    with pytest.raises(ValueError, match="not an integer"):
        fresh.prefill([True, 2])


def test_bad_trees_are_refused(model):
    target, trees = _one_tree(model, [4, 8, 15, 16])
    shifted = dataclasses.replace(trees, positions=trees.positions + np.where(np.arange(trees.positions.shape[1]) > 0,
                                                                              50, 0)[None])
    with pytest.raises(ValueError, match="position"):
        target.tree_logits(shifted)
    for bad_n in (-1, int(trees.budget) + 1):
        with pytest.raises(ValueError, match="num_nodes"):
            target.tree_logits(dataclasses.replace(trees, num_nodes=np.array([bad_n], dtype=np.int32)))
    seeing = dataclasses.replace(trees, visibility=np.ones_like(trees.visibility))
    with pytest.raises(ValueError, match="visibility"):
        target.tree_logits(seeing)
    target.tree_logits(trees)  # the refusals left no pending forward


def test_positions_beyond_the_model_and_sliding_windows_are_refused():
    cfg = transformers.Qwen3Config(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=16)
    small = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        HFTarget(small).prefill(list(range(20)))
    cfg_sw = transformers.Qwen3Config(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      use_sliding_window=True, sliding_window=4,
                                      layer_types=["sliding_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="sliding-window"):
        HFTarget(transformers.Qwen3ForCausalLM(cfg_sw))
    with pytest.raises(ValueError, match="temperature"):
        HFTarget(small, temperature=1e-310)
    with pytest.raises(ValueError, match="seed"):
        HFTarget(small, seed=2**64)


# ---- the CUDA path (runs on the device machine; skipped without a GPU) --------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_compaction_is_kdtree_compact_kv(cuda_device, dtype, monkeypatch):
    """On the GPU, commit moves the accepted rows with kdt_compact_kv_cuda: the cache after
    the commit equals an index-select of the cache the tree forward left, bit for bit."""
    from kdtree.core import api

    calls = []
    real = api.compact_kv

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "compact_kv", counting)
    gpu_model = tiny_qwen3(seed=3).to("cuda", getattr(torch, dtype))
    rng = np.random.default_rng(11)
    for trial in range(8):
        prompt = rng.integers(0, 97, int(rng.integers(2, 15))).tolist()
        target = HFTarget(gpu_model)
        target.prefill(prompt)
        budget = int(rng.integers(2, 40))
        lp, ids = kdtree.topk_logprobs(rng.standard_normal((5, 97)), min(budget, 97))
        trees = kdtree.build_trees(lp, ids, budget, root_tokens=[prompt[-1]], root_positions=[len(prompt) - 1])
        target.tree_logits(trees)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in target.cache.layers]
        nodes = [0]
        while True:  # descend along random children to a random depth
            kids = [j for j in range(1, int(trees.num_nodes[0]) + 1) if int(trees.parents[0, j]) == nodes[-1]]
            if not kids or rng.random() < 0.25:
                break
            nodes.append(int(rng.choice(kids)))
        accepted = np.full((1, 6), -1, dtype=np.int32)
        accepted[0, : len(nodes)] = nodes
        acc = kdtree.Acceptance(accepted, np.array([len(nodes) - 1], np.int32), np.array([5], np.int32))
        committed = [int(trees.tokens[0, j]) for j in nodes[1:]] + [5]
        past = len(prompt) - 1
        target.commit(committed, trees, acc)
        rows = torch.as_tensor(list(range(past)) + [past + j for j in nodes], device="cuda")
        assert target.cache_length == past + len(nodes)
        for (k0, v0), layer in zip(before, target.cache.layers, strict=True):
            assert torch.equal(layer.keys, k0[:, :, rows]), f"trial {trial}"
            assert torch.equal(layer.values, v0[:, :, rows]), f"trial {trial}"
    assert len(calls) == 8  # the GPU compaction ran, not the index-select fallback


def test_cuda_greedy_ddtree_equals_greedy_ar(cuda_device):
    """Lossless on the GPU in float32 (the sharpened tiny model has no near-ties)."""
    gpu_model = tiny_qwen3().to("cuda", torch.float32)
    rng = np.random.default_rng(5)
    for p_i in range(5):
        prompt = rng.integers(0, 97, int(rng.integers(1, 12))).tolist()
        ar = autoregressive_generate(HFTarget(gpu_model), prompt, 16)
        for budget in (1, 16, 64):
            drafter = NoisyOracleDrafter(gpu_model, keep=0.8, seed=p_i * 10 + budget)
            res = speculative_generate(HFTarget(gpu_model), drafter, prompt, 16, budget=budget, depth=6)
            assert res.tokens == ar.tokens, f"prompt {p_i}, budget {budget}"


def test_mistral_style_sliding_window_and_bad_seeds_are_refused():
    cfg = transformers.MistralConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=6)
    with pytest.raises(ValueError, match="sliding-window"):
        HFTarget(transformers.MistralForCausalLM(cfg))
    small = tiny_qwen3(vocab=20, layers=1)
    for seed in (1.5, "3", True):
        with pytest.raises(ValueError, match="seed"):
            HFTarget(small, seed=seed)


def test_decoding_up_to_the_position_limit_matches_ar():
    """Near max_position_embeddings the trees get shallower: DDTree still produces AR's
    tokens up to the last position AR reaches."""
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=40, tie_word_embeddings=True)
    torch.manual_seed(1)
    small = transformers.Qwen3ForCausalLM(cfg).to(torch.float64).eval()
    prompt = list(range(3, 30))
    new = 40 - len(prompt)  # the last new token is chosen at position 39
    ar = autoregressive_generate(HFTarget(small), prompt, new)
    for depth in (4, 12):
        drafter = NoisyOracleDrafter(small, keep=1.0, seed=depth)
        res = speculative_generate(HFTarget(small), drafter, prompt, new, budget=16, depth=depth)
        assert res.tokens == ar.tokens, f"depth {depth}"


def test_a_budget_beyond_every_possible_node_costs_nothing_extra(model):
    """budget 10**6 with depth 1 and 97 tokens: at most 97 nodes, so the tree (and its
    visibility matrix) are built for 97, and the output is AR's."""
    prompt = [4, 5, 6]
    ar = autoregressive_generate(HFTarget(model), prompt, 6)
    res = speculative_generate(HFTarget(model), RandomDrafter(97, 0), prompt, 6, budget=10**6, depth=1)
    assert res.tokens == ar.tokens


def test_a_commit_that_fails_midway_leaves_a_refusing_target(model, monkeypatch):
    target, trees = _one_tree(model, [4, 8, 15, 16])
    chosen = target.score_tree(trees)
    acc = kdtree.verify_greedy(trees, chosen)
    committed = acc.committed(trees, 0)

    def boom(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(target, "_compact", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        target.commit(committed, trees, acc)
    with pytest.raises(RuntimeError, match="undefined state"):
        target.next_token()
    monkeypatch.undo()
    target.prefill([4, 8, 15, 16])  # starts again
    assert target.next_token() == autoregressive_generate(HFTarget(model), [4, 8, 15, 16], 1).tokens[0]


def test_gumbel_sampler_is_lossless_and_documented(model):
    from kdtree.core import sampling

    prompt = [5, 17, 3, 44]
    ar = autoregressive_generate(HFTarget(model, temperature=8.0, seed=4, sampler="gumbel"), prompt, 16)
    res = speculative_generate(HFTarget(model, temperature=8.0, seed=4, sampler="gumbel"), RandomDrafter(97, 3),
                               prompt, 16, budget=12, depth=4)
    assert res.tokens == ar.tokens
    greedy = autoregressive_generate(HFTarget(model), prompt, 16)
    assert ar.tokens != greedy.tokens
    # The first draw is the documented one: the Philox-Gumbel draw keyed by (seed, position).
    first = sampling.gumbel_draws(causal_logits(model, prompt)[None].numpy(), 8.0, 4, 0, 0, np.array([len(prompt)]))
    assert ar.tokens[0] == int(first[0])
    with pytest.raises(ValueError, match="no top_p cut"):
        HFTarget(model, temperature=0.9, top_p=0.5, sampler="gumbel")
    with pytest.raises(ValueError, match="sampler must be"):
        HFTarget(model, sampler="bogus")


def test_stop_sequences_end_ar_and_ddtree_alike(model):
    prompt = [5, 17, 3, 44]
    # Sampled (the Gumbel draw, keyed by position): a varied continuation, the same for AR
    # and DDTree.
    kw = dict(temperature=8.0, seed=9, sampler="gumbel")
    free = autoregressive_generate(HFTarget(model, **kw), prompt, 20).tokens
    # A pair from inside the continuation whose first occurrence ends at position j.
    pairs = [tuple(free[i - 1: i + 1]) for i in range(1, len(free))]
    j = next(j for j in range(3, len(free)) if pairs[j - 1] not in pairs[: j - 1]
             and pairs[j - 1] != (prompt[-1], free[0]))
    for seqs, want in (([list(pairs[j - 1])], free[: j + 1]),             # inside the round(s)
                       ([[prompt[-2], prompt[-1], free[0]]], free[:1]),  # spanning the prompt
                       ([[999, 998]], free)):                             # never
        ar = autoregressive_generate(HFTarget(model, **kw), prompt, 20, stop_sequences=seqs)
        assert ar.tokens == want
        for drafter in (RandomDrafter(97, 5), NoisyOracleDrafter(model, 0.9, 1)):
            dd = speculative_generate(HFTarget(model, **kw), drafter, prompt, 20, budget=12, depth=5,
                                      stop_sequences=seqs)
            assert dd.tokens == want
            assert dd.stop_reason == ("max_new_tokens" if want == free else "stop_sequence")
