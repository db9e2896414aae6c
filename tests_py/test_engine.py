"""Tests of kdtree.engine: DDTree rounds reproduce greedy AR decoding exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kdtree
from kdtree import engine, ngram, reference
from kdtree.apps import text as display


def _native_ok() -> bool:
    try:
        from kdtree import _native as _lib

        _lib.load()
        return True
    except Exception:  # noqa: BLE001
        return False


NATIVE = _native_ok()
OPS = [pytest.param(kdtree, id="native", marks=pytest.mark.skipif(
    not NATIVE, reason="libkdtree not built or not loadable")),
    pytest.param(reference, id="reference")]


@pytest.fixture(scope="module")
def models():
    counts = ngram.NgramCounts.estimate(ngram.load_corpus(300_000).data, 10)
    return ngram.NgramTarget(counts, 10), ngram.NgramDrafter(counts, 3)


PROMPTS = [b"import sys\n\ndef main(argv):\n    ", b"    def __repr__(self):\n        return ",
           b"x"]


@pytest.mark.parametrize("budget", [1, 2, 4, 16, 64, 256, 1024])
@pytest.mark.parametrize("depth", [1, 3, 15])
def test_ddtree_equals_greedy_ar(models, budget, depth):
    target, drafter = models
    ops = kdtree if NATIVE else reference
    for prompt in PROMPTS:
        ar = engine.autoregressive_generate(target, prompt, 40)
        sp = engine.speculative_generate(target, drafter, prompt, 40, budget=budget,
                                         depth=depth, ops=ops)
        assert sp.tokens == ar.tokens, (prompt, budget, depth)
        assert ar.target_calls == 40
        assert ar.times["target"] > 0 and ar.times["verify"] == 0.0
        assert sp.target_calls == sp.rounds == sp.drafter_calls
        assert sum(sp.committed) == 40
        assert all(1 <= c <= depth + 1 for c in sp.committed)
        assert [c - 1 for c in sp.committed] == sp.accepted  # no stop: bonus every round
        assert sp.mean_acceptance_length == pytest.approx(40 / sp.rounds)


@pytest.mark.parametrize("ops", OPS)
def test_fewer_target_calls_than_ar(models, ops):
    target, drafter = models
    prompt = PROMPTS[0]
    ar = engine.autoregressive_generate(target, prompt, 120)
    sp = engine.speculative_generate(target, drafter, prompt, 120, budget=64, depth=15, ops=ops)
    assert sp.tokens == ar.tokens
    assert sp.target_calls < ar.target_calls / 2


@pytest.mark.parametrize("n", [0, 1, 2, 7, 33, 100])
def test_max_new_tokens_exact(models, n):
    target, drafter = models
    sp = engine.speculative_generate(target, drafter, PROMPTS[1], n, budget=64, depth=15)
    ar = engine.autoregressive_generate(target, PROMPTS[1], n)
    assert len(sp.tokens) == len(ar.tokens) == n
    assert sp.tokens == ar.tokens
    assert sp.stop_reason == "max_new_tokens"


def test_stop_token(models):
    target, drafter = models
    ar_full = engine.autoregressive_generate(target, PROMPTS[0], 80)
    stop = ar_full.tokens[10]
    cut = ar_full.tokens.index(stop) + 1
    for budget in (1, 16, 256):
        sp = engine.speculative_generate(target, drafter, PROMPTS[0], 80, budget=budget,
                                         depth=15, stop_tokens=[stop])
        ar = engine.autoregressive_generate(target, PROMPTS[0], 80, stop_tokens=[stop])
        assert sp.tokens == ar.tokens == ar_full.tokens[:cut]
        assert sp.stop_reason == ar.stop_reason == "stop_token"
        assert sp.tokens[-1] == stop


class ScriptTarget:
    """Chooses the token of a fixed script at every position (ignores the context beyond
    its position): a target a perfect drafter can predict."""

    vocab_size = 11

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0

    def prefill(self, prompt):
        self.n = len(prompt)

    def next_token(self):
        self.calls += 1
        return self.script[self.n]

    def score_tree(self, trees):
        self.calls += 1
        # position of node i is root position + depth; its chosen token is the script's
        # token at the next position (the root is the last committed token)
        pos = trees.positions[0]
        out = np.array([self.script[int(p) + 1] for p in pos], np.int32)
        return out[None]

    def commit(self, tokens, trees=None, acceptance=None):
        self.n += len(tokens)

    def drafter_features(self):
        return None


class PerfectDrafter:
    vocab_size = 11

    def __init__(self, script):
        self.script = script

    def draft(self, context, depth, features=None):
        logits = np.zeros((depth, 11), np.float32)
        for d in range(depth):
            logits[d, self.script[len(context) + d]] = 5.0
        return logits


@pytest.mark.parametrize("depth", [1, 3, 15])
def test_perfect_drafter_commits_depth_plus_one(depth):
    script = [(7 * i + 3) % 11 for i in range(200)]
    prompt = script[:5]
    target, drafter = ScriptTarget(script), PerfectDrafter(script)
    sp = engine.speculative_generate(target, drafter, prompt, 100, budget=16, depth=depth,
                                     ops=reference)
    assert sp.tokens == script[5:105]
    assert sp.target_calls == math.ceil(100 / (depth + 1))
    assert sp.committed[:-1] == [depth + 1] * (sp.rounds - 1)


def test_bad_arguments(models):
    target, drafter = models
    with pytest.raises(ValueError, match="prompt"):
        engine.speculative_generate(target, drafter, b"", 5, budget=4, depth=3)
    with pytest.raises(ValueError, match="budget"):
        engine.speculative_generate(target, drafter, b"ab", 5, budget=-1, depth=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.autoregressive_generate(target, b"ab", -1)


def test_render_tree_marks_accepted_path(models):
    target, drafter = models
    sp = engine.speculative_generate(target, drafter, PROMPTS[1], 60, budget=64, depth=15)
    snap = sp.snapshot
    assert snap is not None
    acc = snap.acceptance
    k = int(acc.accept_length[0])
    path = [int(i) for i in acc.accepted_nodes[0, 1:1 + k]]
    text = display.render_tree(snap.trees, 0, acc, max_nodes=1000)
    lines = text.splitlines()
    starred = [ln for ln in lines if ln.lstrip().startswith("*")]
    assert len(starred) == k + 1  # root + accepted nodes
    for i in path:
        tok = display.escape_token(int(snap.trees.tokens[0, i]))
        assert any(ln.endswith(f"#{i}") and tok in ln for ln in starred)
    # indentation grows by two spaces per depth along the accepted path
    depths = [(len(ln) - len(ln.lstrip())) // 2 for ln in starred]
    assert depths == list(range(k + 1))
    assert f"accepted path: {k} draft node(s)" in text
    # A small drawing keeps the best 5 nodes and the whole accepted path wherever it ranks.
    small = display.render_tree(snap.trees, 0, acc, max_nodes=5)
    n = int(snap.trees.num_nodes[0])
    extra = sum(1 for i in path if i > 5)
    also = f" and the {extra} accepted beyond them" if extra else ""
    assert f"... {n - 5 - extra} more of {n} nodes not shown (drawing the best 5{also})" in small
    assert len([ln for ln in small.splitlines() if "logw=" in ln]) == 5 + extra
    small_starred = [ln for ln in small.splitlines() if ln.lstrip().startswith("*")]
    assert len(small_starred) == k + 1


def test_escape_and_printable():
    assert display.escape_token(ord("a")) == "'a'"
    assert display.escape_token(10) == "'\\n'"
    assert display.escape_token(0) == "'\\x00'"
    assert display.escape_token(200) == "'\\xc8'"
    assert display.printable(b"a\tb\nc\x00\xff") == "a\tb\nc\\x00\\xff"


def test_printable_marks_long_runs():
    data = b"ab" + b" " * 240 + b"\n" * 3 + b"x\x00" + b"\x00" * 7 + b"=" * 7
    assert display.byte_runs(data, 8) == [(2, 240, 32), (246, 8, 0)]
    assert display.byte_runs(b"", 8) == [] and display.byte_runs(b"a" * 9, 9) == [(0, 9, 97)]
    assert display.printable(data, min_run=8) == \
        "ab\u27e8' ' x 240\u27e9\n\n\nx\u27e8'\\x00' x 8\u27e9" + "=" * 7
    assert display.printable(b"\n" * 20 + b"z", min_run=16, marks=("<<", ">>")) == \
        "<<'\\n' x 20>>z"
    assert display.printable(data) == display.printable(data, min_run=None)  # unchanged default
    with pytest.raises(ValueError, match="min_run"):
        display.byte_runs(data, 1)


def test_stage_names_follow_the_library():
    # "target" is the target's one call per round, "verify" the walk (kdtree.verify_greedy)
    assert engine.STAGES == ("draft", "topk", "build", "target", "verify", "commit")


def test_tree_layout_draws_the_accepted_path_beyond_the_best_nodes(models):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (nox -s test installs it)")
    from kdtree.apps.plots import tree_layout

    target, drafter = models
    sp = engine.speculative_generate(target, drafter, PROMPTS[1], 60, budget=64, depth=15)
    acc, trees = sp.snapshot.acceptance, sp.snapshot.trees
    k = int(acc.accept_length[0])
    path = {int(i) for i in acc.accepted_nodes[0, : k + 1]}
    pos = tree_layout(trees, 0, 3, extra=path)
    assert set(pos) == set(range(min(4, int(trees.num_nodes[0]) + 1))) | path
    for i in pos:  # connected: every drawn node's parent is drawn, one depth to the left
        if i:
            assert int(trees.parents[0, i]) in pos
            assert pos[i][0] == pos[int(trees.parents[0, i])][0] + 1


def test_both_decoders_take_the_same_prompts(models):
    target, drafter = models
    for bad in ([1, 2.0, 3], [True, 2], [1, "2"]):
        with pytest.raises(TypeError, match="prompt element"):
            engine.autoregressive_generate(target, bad, 3)
        with pytest.raises(TypeError, match="prompt element"):
            engine.speculative_generate(target, drafter, bad, 3, budget=4, depth=2)
    ok = [np.int64(104), 101]  # numpy integers are integers
    a = engine.autoregressive_generate(target, ok, 5)
    b = engine.speculative_generate(target, drafter, ok, 5, budget=4, depth=2)
    assert a.tokens == b.tokens
