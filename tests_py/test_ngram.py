"""Tests of kdtree.ngram: counts and scores against an independent brute-force count."""

from __future__ import annotations

import numpy as np
import pytest

from kdtree import ngram


# ---- brute-force reference: plain Python counting over every position -----------------
def brute_scores(data: bytes, context: bytes, order: int, alpha: float, prune_from: int,
                 min_count: int) -> np.ndarray:
    m = min(order - 1, len(context))
    out = np.zeros(256)
    done = [False] * 256
    mult = 1.0
    for c in range(m, -1, -1):
        h = context[len(context) - c:] if c else b""
        total = 0
        pair = [0] * 256
        for i in range(c, len(data)):
            if data[i - c:i] == h:
                total += 1
                pair[data[i]] += 1
        for w in range(256):
            kept = pair[w] >= (min_count if c >= prune_from else 1)
            if kept and not done[w]:
                out[w] = mult * (pair[w] / total)
                done[w] = True
        mult *= alpha
    return out


TINY = (b"abracadabra abracadabra\nthe cat sat on the mat.\nthe cat ate the rat\n"
        b"\x00\x01\x00\x01zz abra\tcadabra the end\n")


@pytest.mark.parametrize("order,prune_from,min_count", [(1, 99, 1), (3, 99, 1), (5, 2, 2),
                                                        (7, 3, 3)])
def test_scores_match_brute_force(order, prune_from, min_count):
    counts = ngram.NgramCounts.estimate(TINY, order, prune_from=prune_from, min_count=min_count)
    contexts = [b"", b"a", b"abr", b"the c", b"xyzzy", b"he cat s", b"\x00\x01",
                b"t the ", b"qqqq a", TINY[:40]]
    width = max(order - 1, 1)
    wins = np.concatenate([ngram.context_windows(c, width)[0] for c in contexts])
    lens = np.concatenate([ngram.context_windows(c, width)[1] for c in contexts])
    got = counts.scores(wins, lens, order, alpha=0.4)
    for i, ctx in enumerate(contexts):
        want = brute_scores(TINY, ctx, order, 0.4, prune_from, min_count)
        np.testing.assert_allclose(got[i], want, rtol=1e-13, atol=0, err_msg=repr(ctx))


def test_greedy_ties_go_to_lower_byte():
    s = np.zeros((2, 256))
    s[0, [7, 3, 200]] = 0.5
    assert ngram.greedy(s).tolist() == [3, 0]


def test_estimate_rejects_bad_order():
    with pytest.raises(ValueError, match="order"):
        ngram.NgramCounts.estimate(TINY, 0)
    with pytest.raises(ValueError, match="order"):
        ngram.NgramCounts.estimate(TINY, ngram.MAX_ORDER + 1)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KDTREE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ngram.cache_dir() == tmp_path / "xdg" / "kdtree"
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "k"))
    assert ngram.cache_dir() == tmp_path / "k"


def test_corpus_is_sorted_capped_and_holds_out(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "b.py").write_bytes(b"B" * 10)
    (root / "a.py").write_bytes(b"A" * 10)
    (root / "pkg" / "c.py").write_bytes(b"C" * 10)
    (root / "test" / "t.py").write_bytes(b"T" * 10)
    (root / "notes.txt").write_bytes(b"N" * 10)
    corpus = ngram.load_corpus(10_000, root=root)
    assert corpus.data == b"A" * 10 + b"\n" + b"B" * 10 + b"\n" + b"C" * 10 + b"\n"
    assert ngram.load_corpus(15, root=root).data == b"A" * 10 + b"\nBBBB"
    held = ngram.load_corpus(10_000, root=root, hold_out=root / "b.py")
    assert b"B" not in held.data and held.held_out == (root / "b.py").resolve()
    with pytest.raises(ValueError):
        ngram.load_corpus(0, root=root)


def test_cache_round_trip(monkeypatch, tmp_path):
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path))
    corpus = ngram.load_corpus(50_000)
    c1, cached1 = ngram.NgramCounts.load_or_estimate(corpus, 6)
    c2, cached2 = ngram.NgramCounts.load_or_estimate(corpus, 6)
    assert (cached1, cached2) == (False, True)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    wins, lens = ngram.context_windows(b"    def __init__(self", 5)
    np.testing.assert_array_equal(c1.scores(wins, lens), c2.scores(wins, lens))
    for a, b in zip(c1.levels, c2.levels, strict=True):  # lossless
        for f in ("keys", "totals", "offsets", "next_byte", "count"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and np.array_equal(x, y), f
    # a damaged cache file is re-estimated, not an error
    next(tmp_path.glob("*.npz")).write_bytes(b"garbage")
    c3, cached3 = ngram.NgramCounts.load_or_estimate(corpus, 6)
    assert not cached3
    np.testing.assert_array_equal(c1.scores(wins, lens), c3.scores(wins, lens))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "old_version"])
def test_corrupted_cache_is_rebuilt_with_one_warning(monkeypatch, tmp_path, damage):
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path))
    corpus = ngram.load_corpus(20_000)
    c1, _ = ngram.NgramCounts.load_or_estimate(corpus, 5)
    path = ngram.NgramCounts.cache_path(5, corpus.sha256)
    good = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "flip":
        bad = bytearray(good)
        bad[len(bad) // 3] ^= 0xFF
        path.write_bytes(bytes(bad))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a file of another format version under this name
        monkeypatch.setattr(ngram, "CACHE_FORMAT_VERSION", ngram.CACHE_FORMAT_VERSION + 1)
        ngram.NgramCounts.estimate(corpus.data, 5, corpus.sha256)._save(path)
        monkeypatch.undo()
        monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path))
    warnings = []
    c2, cached = ngram.NgramCounts.load_or_estimate(corpus, 5, on_warning=warnings.append)
    assert not cached
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert str(path) in warnings[0] and "estimating the counts again" in warnings[0]
    wins, lens = ngram.context_windows(b"    def __init__(self", 4)
    np.testing.assert_array_equal(c1.scores(wins, lens), c2.scores(wins, lens))
    # rebuilt: the next load reads the cache without a warning
    c3, cached3 = ngram.NgramCounts.load_or_estimate(corpus, 5, on_warning=warnings.append)
    assert cached3 and len(warnings) == 1


def test_cache_is_small_and_stale_formats_are_listed(monkeypatch, tmp_path):
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path))
    corpus = ngram.load_corpus(50_000)
    counts, _ = ngram.NgramCounts.load_or_estimate(corpus, 8)
    path = ngram.NgramCounts.cache_path(8, corpus.sha256)
    raw = sum(lv.keys.size * 8 + lv.totals.size * 4 + lv.offsets.size * 8 + lv.count.size * 5
              for lv in counts.levels)  # the format-2 layout
    assert path.stat().st_size < raw / 2
    old = tmp_path / "ngram-v2-py311-o16-p4m2-0123.npz"
    old.write_bytes(b"x")
    assert ngram.stale_cache_files() == [old]


@pytest.fixture(scope="module")
def models():
    counts = ngram.NgramCounts.estimate(ngram.load_corpus(150_000).data, 8)
    return ngram.NgramTarget(counts, 8), ngram.NgramDrafter(counts, 3)


def test_target_tree_scores_equal_per_node_autoregressive(models):
    from kdtree import reference

    target, drafter = models
    prompt = b"import os\n\ndef f(x):\n    return "
    logits = drafter.draft(prompt, 4)
    lp, ids = reference.topk_logprobs(logits, 5)
    trees = reference.build_trees(lp, ids, 19, root_tokens=[prompt[-1]],
                                  root_positions=[len(prompt) - 1], vocab_size=256)
    target.prefill(prompt)
    chosen = target.score_tree(trees)
    assert chosen.shape == (1, 20)
    n = int(trees.num_nodes[0])
    assert n == 19
    for i in range(n + 1):
        path, j = [], i
        while j > 0:
            path.append(int(trees.tokens[0, j]))
            j = int(trees.parents[0, j])
        target.prefill(prompt + bytes(reversed(path)))
        assert target.next_token() == chosen[0, i], i


def test_drafter_unrolls_its_own_greedy_chain(models):
    _, drafter = models
    ctx = b"for i in range("
    logits = drafter.draft(ctx, 6)
    assert logits.shape == (6, 256) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    chain = bytearray(ctx)
    for d in range(6):
        w, n = ngram.context_windows(chain, drafter.order - 1)
        s = drafter.counts.scores(w, n, drafter.order)[0]
        assert int(np.argmax(logits[d])) == int(np.argmax(s))
        chain.append(int(np.argmax(s)))
    assert drafter.draft(ctx, 0).shape == (0, 256)
