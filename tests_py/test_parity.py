"""Parity of the C library with the pure-Python reference (kdtree.reference), the oracle
written straight from the spec (ddtree-tree-build.md).

* build_trees: >= 10,000 random trees per run, zero mismatches in any field (logw compared
  bitwise). Budgets 1..1024 (log-uniform, plus a few 512..1024), depths 1..32, widths
  1..N and K > N, chains, heavy exact ties (bfloat16 logits, rows from a tiny value set,
  quantised values), -inf tails and whole -inf rows, peaked / flat rows, mixed batches,
  random root tokens / positions, pad tokens and input dtypes.
* verify_greedy: thousands of trees with targets biased to walk deep, stop tokens, caps.
* topk_logprobs: V in {1, 7, 1025, 8193}, k in {0, 1, V//2, V}, four input dtypes, ties.

Every case is generated from np.random.default_rng([SEED, case]) so a failure message's
(seed, case) pair reproduces it: ``make_case(np.random.default_rng([seed, case]), ...)``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import kdtree
from kdtree import reference as ref

pytestmark = pytest.mark.usefixtures("lib")

BF16 = np.dtype(ml_dtypes.bfloat16)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

FIELDS = (
    "num_nodes",
    "tokens",
    "depths",
    "parents",
    "logw",
    "positions",
    "visibility",
    "visibility_bits",
    "first_child",
    "next_sibling",
)

# ---- Input generators -------------------------------------------------------------------

KINDS = ("normal", "peaked", "flat", "exact_flat", "bf16", "tiny", "quantized", "neg_zero", "wide", "offset")
TIE_KINDS = ("bf16", "tiny", "quantized", "exact_flat", "neg_zero")


def _sorted_desc(x: np.ndarray) -> np.ndarray:
    """Rows of x sorted non-increasing (works on -inf, keeps -0.0 next to 0.0)."""
    return -np.sort(-x, axis=-1)


def _log_softmax_topk(logits: np.ndarray, k: int) -> np.ndarray:
    """float32 [L, k]: top-k of each row minus the row's logsumexp (float64), sorted."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    return _sorted_desc((x - lse).astype(np.float32))[:, :k]


def make_rows(rng: np.random.Generator, kind: str, depth: int, width: int) -> np.ndarray:
    """float32 [depth, width] log-prob rows of one request, each sorted non-increasing."""
    if depth == 0 or width == 0:
        return np.zeros((depth, width), np.float32)
    vocab = width + int(rng.integers(0, 2 * width + 8))
    if kind == "normal":
        lp = _log_softmax_topk(rng.standard_normal((depth, vocab)) * rng.uniform(0.5, 4), width)
    elif kind == "peaked":
        lp = _log_softmax_topk(rng.standard_normal((depth, vocab)) * rng.uniform(8, 30), width)
    elif kind == "flat":
        lp = _log_softmax_topk(rng.standard_normal((depth, vocab)) * 1e-3, width)
    elif kind == "exact_flat":  # every entry equal: -log(vocab) in float32
        lp = np.full((depth, width), -math.log(vocab), np.float32)
    elif kind == "bf16":  # logits rounded to bfloat16 before top-k: many exact ties
        logits = (rng.standard_normal((depth, vocab)) * 2).astype(BF16).astype(np.float32)
        top = _sorted_desc(logits)[:, :width]
        x = logits.astype(np.float64)
        lse = (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
        lp = top - lse.astype(np.float32)
    elif kind == "tiny":  # a tiny value set: cumulative scores tie exactly across depths
        values = np.array([0.0, -1.0, -2.0], np.float32)
        lp = _sorted_desc(rng.choice(values, size=(depth, width), p=[0.4, 0.4, 0.2]))
    elif kind == "quantized":  # multiples of 1/4: exact sums, many cross-depth ties
        lp = _sorted_desc((-rng.integers(0, 12, size=(depth, width)) / 4.0).astype(np.float32))
    elif kind == "neg_zero":  # -0.0 and 0.0 (equal scores, bitwise-distinct logw)
        v = rng.choice(np.array([0.0, -0.0, -0.5, -1.0], np.float32), size=(depth, width))
        lp = _sorted_desc(v)
        lp[lp == 0] = rng.choice(np.array([0.0, -0.0], np.float32), size=int((lp == 0).sum()))
    elif kind == "wide":  # magnitudes 1e-12..80: float64 sums round, so the spec's
        # operation order (subtract, then add) changes the last bits of sibling scores
        tiny = np.exp(rng.uniform(math.log(1e-12), math.log(1e-5), size=(depth, width)))
        big = rng.uniform(0.5, 80.0, size=(depth, width))
        mag = np.where(rng.random((depth, width)) < 0.5, tiny, big)
        lp = _sorted_desc((-mag).astype(np.float32))
    elif kind == "offset":  # a large depth-1 score then tiny steps: sibling scores round
        tiny = np.exp(rng.uniform(math.log(1e-10), math.log(1e-4), size=(depth, width)))
        tiny[0] += rng.uniform(20.0, 60.0, size=width)
        lp = _sorted_desc((-tiny).astype(np.float32))
    else:  # pragma: no cover
        raise AssertionError(kind)
    lp = np.ascontiguousarray(lp, dtype=np.float32)
    # -inf tails (a zero-probability token), sometimes a whole row at some depth.
    if rng.random() < 0.25:
        for d in range(depth):
            if rng.random() < 0.3:
                lp[d, int(rng.integers(0, width + 1)) :] = -np.inf
    return lp


def make_ids(rng: np.random.Generator, depth: int, width: int, vocab: int) -> np.ndarray:
    """int32 [depth, width], unique within each row, values in [0, vocab)."""
    if depth == 0 or width == 0:
        return np.zeros((depth, width), np.int32)
    return np.argsort(rng.random((depth, vocab)), axis=1)[:, :width].astype(np.int32)


def draw_budget(rng: np.random.Generator) -> int:
    """Log-uniform in 1..1024 (most budgets small); 1.5% of draws in 512..1024."""
    if rng.random() < 0.015:
        return int(rng.integers(512, 1025))
    return int(min(1024, math.floor(math.exp(rng.uniform(0, math.log(1025))))))


def draw_width(rng: np.random.Generator, budget: int) -> int:
    u = rng.random()
    if u < 0.12:
        return 1  # chains
    if u < 0.30:
        return budget + int(rng.integers(1, 9))  # K > N
    if u < 0.60:
        return int(rng.integers(1, min(budget, 8) + 1))
    return int(rng.integers(1, min(budget, 128) + 1))


def make_case(rng: np.random.Generator, kinds=KINDS, budget=None, batch=None, neg_inf=0.0) -> dict:
    """Keyword arguments of build_trees for one random batch (B requests of mixed content)."""
    n = draw_budget(rng) if budget is None else budget
    if batch is None:
        batch = 1 if rng.random() < 0.55 else int(rng.integers(2, 9))
    depth = int(rng.integers(1, 33)) if rng.random() < 0.5 else int(rng.integers(1, 9))
    width = draw_width(rng, max(n, 1))
    vocab = width + int(rng.integers(0, 3 * width + 10))
    lp = np.empty((batch, depth, width), np.float32)
    ids = np.empty((batch, depth, width), np.int32)
    for b in range(batch):
        lp[b] = make_rows(rng, str(rng.choice(kinds)), depth, width)
        ids[b] = make_ids(rng, depth, width, vocab)
        for d in range(depth):  # extra -inf pressure for the -inf test
            if neg_inf and rng.random() < neg_inf:
                lp[b, d, int(rng.integers(0, width + 1)) :] = -np.inf
    kw: dict = {"logprobs": lp, "token_ids": ids, "budget": n}
    # The unused part (ranks >= N) is never read: fill it with garbage sometimes.
    if width > n and rng.random() < 0.4:
        tail = lp[:, :, n:]
        tail[...] = rng.choice(np.array([np.nan, np.inf, 5.0, -1.0], np.float32), size=tail.shape)
        ids[:, :, n:] = rng.choice(np.array([-7, 0, 1, vocab + 3]), size=tail.shape)
    if rng.random() < 0.5:
        kw["root_tokens"] = rng.integers(0, vocab, size=batch)
    if rng.random() < 0.5:
        hi = 2**62 if rng.random() < 0.2 else 4096
        kw["root_positions"] = rng.integers(0, hi, size=batch, dtype=np.int64)
    if rng.random() < 0.5:
        kw["pad_token"] = int(rng.choice([-1, 0, 7, INT32_MIN, INT32_MAX, vocab]))
    if rng.random() < 0.4:
        # Only valid when every used id and root token is below it.
        kw["vocab_size"] = vocab + int(rng.integers(0, 3))
    return kw


# ---- Comparison -------------------------------------------------------------------------


def first_mismatch(got, want):
    """None, or (field, index, got value, want value) of the first differing entry."""
    for attr in ("budget", "depth"):
        if int(getattr(got, attr)) != int(getattr(want, attr)):
            return attr, (), getattr(got, attr), getattr(want, attr)
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        if a.shape != b.shape or a.dtype != b.dtype:
            return field, "shape/dtype", (a.dtype, a.shape), (b.dtype, b.shape)
        if field == "logw":  # bitwise: -0.0 vs 0.0, -inf, last-bit differences
            a, b = a.view(np.int64), b.view(np.int64)
        elif field == "visibility":
            a, b = a.view(np.uint8), b.view(np.uint8)
        if not np.array_equal(a, b):
            idx = tuple(int(i) for i in np.argwhere(a != b)[0])
            va, vb = getattr(got, field)[idx], getattr(want, field)[idx]
            return field, idx, va, vb
    return None


def describe(kw: dict) -> str:
    lp = kw["logprobs"]
    extra = {k: v for k, v in kw.items() if k not in ("logprobs", "token_ids", "budget")}
    return f"shape [B, L, K] = {list(lp.shape)}, budget {kw['budget']}, options {sorted(extra)}"


class Tally:
    """Counts trees and records the first mismatch with what reproduces it."""

    def __init__(self, name: str, seed: int):
        self.name, self.seed = name, seed
        self.trees = 0
        self.mismatches = 0
        self.first: str | None = None

    def check(self, case: int, kw: dict, got, want) -> None:
        self.trees += int(kw["logprobs"].shape[0])
        bad = first_mismatch(got, want)
        if bad is not None:
            self.mismatches += 1
            if self.first is None:
                field, idx, va, vb = bad
                self.first = (
                    f"seed {self.seed}, case {case} ({describe(kw)}): field {field}, index {idx}: "
                    f"C {va!r} vs reference {vb!r}"
                )

    def report(self, minimum: int = 1) -> None:
        line = f"{self.name}: {self.trees} trees compared, {self.mismatches} mismatching batches"
        print(line)
        assert self.mismatches == 0, f"{line}; first: {self.first}"
        assert self.trees >= minimum, f"{line}; expected at least {minimum}"


def run_parity(name: str, seed: int, cases: int, minimum: int, **gen) -> Tally:
    tally = Tally(name, seed)
    for case in range(cases):
        kw = make_case(np.random.default_rng([seed, case]), **gen)
        want = ref.build_trees(**kw)
        got = kdtree.build_trees(**kw)
        tally.check(case, kw, got, want)
    tally.report(minimum)
    return tally


# ---- build_trees ------------------------------------------------------------------------


def test_build_parity_random():
    """The main run: >= 10,000 random trees of every kind, zero mismatches."""
    tally = Tally("build_trees parity (random mix)", 1001)
    case = 0
    while tally.trees < 10_000:
        kw = make_case(np.random.default_rng([tally.seed, case]))
        tally.check(case, kw, kdtree.build_trees(**kw), ref.build_trees(**kw))
        case += 1
    tally.report(10_000)


def test_build_parity_heavy_ties():
    """Only tie-heavy rows (bf16 logits, {0, -1, -2}, quarter steps, all-equal, -0.0): the
    rank-path tie-break decides most pops."""
    run_parity("build_trees parity (ties)", 1002, 900, 1500, kinds=TIE_KINDS)


def test_build_parity_neg_inf():
    """Many -inf tails and whole -inf rows: such candidates are never emitted or expanded."""
    run_parity("build_trees parity (-inf)", 1003, 600, 1000, neg_inf=0.35)


def test_build_parity_large_budgets():
    """Budgets 512..1024 (the reference is slow there: a few dozen trees)."""
    tally = Tally("build_trees parity (large budgets)", 1004)
    for case in range(24):
        rng = np.random.default_rng([tally.seed, case])
        kw = make_case(rng, budget=int(rng.integers(512, 1025)), batch=int(rng.integers(1, 3)))
        tally.check(case, kw, kdtree.build_trees(**kw), ref.build_trees(**kw))
    tally.report(24)


def test_build_parity_extreme_budget_and_depth():
    """The issue's outer corners: budget 4096 and depth 64 (a handful of trees: the
    reference needs tens of milliseconds each and the masks are 16.8 MB)."""
    tally = Tally("build_trees parity (N 4096, L 64)", 1008)
    shapes = ((4096, 64, 64), (4096, 4, 4096), (2000, 64, 200), (4096, 64, 4096))
    for case, (budget, depth, width) in enumerate(shapes):
        rng = np.random.default_rng([tally.seed, case])
        kind = ("bf16", "peaked", "tiny", "flat")[case]
        lp = None
        if kind == "tiny":  # no -inf tails here: the tree must reach the budget
            values = np.array([0.0, -1.0, -2.0], np.float32)
            lp = np.sort(rng.choice(values, size=(depth, width)), axis=1)[:, ::-1].copy()[None]
            ids = make_ids(rng, depth, width, width + 9)[None]
        else:
            scale = {"peaked": 4.0, "flat": 0.3, "bf16": 1.0}[kind]
            x = (rng.standard_normal((1, depth, width + 50)) * scale).astype(np.float32)
            if kind == "bf16":
                x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
            lp, ids = ref.topk_logprobs(x, width)
        kw = {"logprobs": lp, "token_ids": ids, "budget": budget}
        got, want = kdtree.build_trees(**kw), ref.build_trees(**kw)
        assert int(want.num_nodes[0]) > min(budget, 1000) // 2, "corner case built a tiny tree"
        tally.check(case, kw, got, want)
    tally.report(len(shapes))


def test_build_parity_chains_and_stars():
    """K = 1 (chains) and L = 1 (stars) with every budget 1..70."""
    tally = Tally("build_trees parity (chains, stars)", 1005)
    case = 0
    for n in range(1, 71):
        chain_depth = int(np.random.default_rng([1005, n]).integers(1, 33))
        for depth, width in ((chain_depth, 1), (1, n + 2), (1, max(1, n // 2))):
            rng = np.random.default_rng([tally.seed, case])
            lp = make_rows(rng, str(rng.choice(KINDS)), depth, width)[None]
            ids = make_ids(rng, depth, width, width + 5)[None]
            kw = {"logprobs": lp, "token_ids": ids, "budget": n}
            tally.check(case, kw, kdtree.build_trees(**kw), ref.build_trees(**kw))
            case += 1
    tally.report(200)


def test_build_parity_degenerate_sizes():
    """N = 0, L = 0, K = 0, B = 0 and their mixes: root-only trees, identical padding."""
    tally = Tally("build_trees parity (degenerate)", 1006)
    case = 0
    for batch in (0, 1, 3):
        for depth in (0, 1, 4):
            for width in (0, 1, 5):
                for n in (0, 1, 3, 40):
                    rng = np.random.default_rng([tally.seed, case])
                    lp = np.zeros((batch, depth, width), np.float32)
                    ids = np.zeros((batch, depth, width), np.int32)
                    for b in range(batch):
                        lp[b] = make_rows(rng, "normal", depth, width)
                        ids[b] = make_ids(rng, depth, width, width + 3)
                    kw = {"logprobs": lp, "token_ids": ids, "budget": n,
                          "root_tokens": np.arange(batch), "pad_token": -3}
                    got, want = kdtree.build_trees(**kw), ref.build_trees(**kw)
                    tally.check(case, kw, got, want)
                    case += 1
    print(f"(degenerate: {case} calls)")
    tally.report(100)


def test_build_parity_input_dtypes():
    """float16 / bfloat16 / float64 log-probs and int8..uint64 ids: both sides convert the
    same way (float32 scores, int32 ids)."""
    tally = Tally("build_trees parity (dtypes)", 1007)
    lp_types = (np.float16, BF16, np.float64, np.float32)
    id_types = (np.int64, np.uint16, np.int16, np.uint64, np.int32)
    for case in range(200):
        rng = np.random.default_rng([tally.seed, case])
        kw = make_case(rng, budget=int(rng.integers(1, 60)))
        lp = kw["logprobs"]
        # keep garbage tails (NaN, +inf, 5.0) out of this test: the sort below moves them in
        finite = (np.isfinite(lp) & (lp <= 0)) | np.isneginf(lp)
        kw["logprobs"] = np.where(finite, lp, -np.inf).astype(lp_types[case % 4])
        kw["logprobs"] = _sorted_desc(kw["logprobs"].astype(np.float32)).astype(lp_types[case % 4])
        ids = kw["token_ids"]
        if (ids >= 0).all() and ids.max(initial=0) < 30000:
            kw["token_ids"] = ids.astype(id_types[case % 5])
        tally.check(case, kw, kdtree.build_trees(**kw), ref.build_trees(**kw))
    tally.report(200)


def sibling_order_sensitive_nodes(trees, lp: np.ndarray) -> int:
    """Nodes whose spec score (logw - lp[r-1]) + lp[r] differs from the re-associated
    logw + (lp[r] - lp[r-1]): evidence that the run can tell the two orders apart."""
    count = 0
    for b in range(trees.batch):
        n = int(trees.num_nodes[b])
        prev: dict[int, int] = {}  # parent -> last child seen
        rank: dict[int, int] = {}
        for i in range(1, n + 1):
            p, d = int(trees.parents[b, i]), int(trees.depths[b, i])
            if p in prev:
                j, r = prev[p], rank[prev[p]] + 1
                row = lp[b, d - 1].astype(np.float64)
                spec = (float(trees.logw[b, j]) - row[r - 1]) + row[r]
                alt = float(trees.logw[b, j]) + (row[r] - row[r - 1])
                count += spec != alt
                rank[i] = r
            else:
                rank[i] = 0
            prev[p] = i
    return count


def test_build_parity_operation_order():
    """Rows whose float64 sibling scores depend on the association order (large depth-1
    scores, tiny later steps): the C scores must follow the spec's subtract-then-add."""
    tally = Tally("build_trees parity (operation order)", 1008)
    sensitive = 0
    for case in range(150):
        rng = np.random.default_rng([tally.seed, case])
        n = int(rng.integers(8, 160))
        batch, depth, width = int(rng.integers(1, 4)), int(rng.integers(2, 12)), int(rng.integers(2, 12))
        kind = ("offset", "wide")[case % 2]
        lp = np.stack([make_rows(rng, kind, depth, width) for _ in range(batch)])
        ids = np.stack([make_ids(rng, depth, width, 3 * width) for _ in range(batch)])
        kw = {"logprobs": lp, "token_ids": ids, "budget": n}
        got = kdtree.build_trees(**kw)
        tally.check(case, kw, got, ref.build_trees(**kw))
        sensitive += sibling_order_sensitive_nodes(got, lp)
    print(f"operation-order sensitive sibling scores: {sensitive}")
    tally.report(150)
    assert sensitive >= 100, f"the generated rows exercise the operation order too rarely ({sensitive})"


# ---- verify_greedy ----------------------------------------------------------------------


def make_targets(rng: np.random.Generator, trees, vocab: int, follow: float = 0.8) -> np.ndarray:
    """int32 [B, N+1]: at each real node, the token of a random child with probability
    `follow` (walks go deep), else a random token; padding rows hold garbage (ignored)."""
    batch, rows = trees.tokens.shape
    target = rng.integers(-5, vocab + 5, size=(batch, rows)).astype(np.int32)  # padding garbage
    for b in range(batch):
        n = int(trees.num_nodes[b])
        children: dict[int, list[int]] = {}
        for i in range(1, n + 1):
            children.setdefault(int(trees.parents[b, i]), []).append(i)
        for i in range(n + 1):
            kids = children.get(i, [])
            if kids and rng.random() < follow:
                target[b, i] = trees.tokens[b, kids[int(rng.integers(0, len(kids)))]]
            else:
                target[b, i] = int(rng.integers(0, vocab))
    return target


def committed(acc, trees, b: int) -> list[int]:
    return acc.committed(trees, b)


def test_verify_parity():
    """kdtree.verify_greedy == reference.verify_greedy on thousands of trees, and the cap
    keeps exactly the first max_commit tokens of the uncapped commit."""
    seed = 2001
    trees_seen = mismatches = 0
    first = None
    case = 0
    while trees_seen < 4000:
        rng = np.random.default_rng([seed, case])
        kw = make_case(rng, budget=int(rng.integers(1, 80)), kinds=("normal", "peaked", "tiny", "bf16"))
        trees = kdtree.build_trees(**kw)
        vocab = int(max(kw["token_ids"].max(initial=0), 0)) + 3
        target = make_targets(rng, trees, vocab)
        batch = trees.batch
        u = rng.random()
        if u < 0.4:
            stops: list[int] = []
        else:  # tokens present in the tree (so they get accepted) plus random ones
            real = trees.tokens[:, 1:][trees.depths[:, 1:] > 0]
            count = min(len(real), int(rng.integers(1, 4)))
            pick = rng.choice(real, size=count, replace=False) if real.size else []
            extra = rng.integers(0, vocab, size=int(rng.integers(0, 3)))
            stops = [int(t) for t in pick] + [int(t) for t in extra]
        v = rng.random()
        if v < 0.3:
            cap = None
        elif v < 0.5:
            cap = int(rng.choice([0, 1, 2, 3, 10**9]))
        else:
            cap = rng.choice(np.array([0, 1, 2, 3, 4, 5, 8, 40, 2**40]), size=batch)
        got = kdtree.verify_greedy(trees, target, stop_tokens=stops, max_commit=cap)
        want = ref.verify_greedy(trees, target, stop_tokens=stops, max_commit=cap)
        uncut = ref.verify_greedy(trees, target, stop_tokens=stops)
        trees_seen += batch
        for name in ("accepted_nodes", "accept_length", "bonus_token"):
            a, w = getattr(got, name), getattr(want, name)
            if a.shape != w.shape or a.dtype != w.dtype or not np.array_equal(a, w):
                mismatches += 1
                if first is None:
                    first = f"seed {seed}, case {case}: {name}: C {a.tolist()} vs reference {w.tolist()}"
                break
        caps = [None] * batch if cap is None else list(np.broadcast_to(np.asarray(cap), (batch,)))
        for b in range(batch):
            full = committed(uncut, trees, b)
            mine = committed(got, trees, b)
            expect = full if caps[b] is None else full[: int(caps[b])]
            if mine != expect:
                mismatches += 1
                if first is None:
                    first = (f"seed {seed}, case {case}, request {b}: committed {mine} but the "
                             f"uncapped commit {full} cut to {caps[b]} is {expect}")
        case += 1
    print(f"verify_greedy parity: {trees_seen} trees in {case} calls, {mismatches} mismatches")
    assert mismatches == 0, first
    assert trees_seen >= 4000


def test_verify_parity_deep_walks():
    """Targets that always follow the first child: the walk reaches the deepest path."""
    seed = 2002
    for case in range(300):
        rng = np.random.default_rng([seed, case])
        kw = make_case(rng, budget=int(rng.integers(1, 64)), kinds=("peaked",))
        trees = kdtree.build_trees(**kw)
        target = make_targets(rng, trees, int(kw["token_ids"].max(initial=0)) + 2, follow=1.0)
        for cap in (None, 0, 1, 2, 5):
            got = kdtree.verify_greedy(trees, target, max_commit=cap)
            want = ref.verify_greedy(trees, target, max_commit=cap)
            for name in ("accepted_nodes", "accept_length", "bonus_token"):
                assert np.array_equal(getattr(got, name), getattr(want, name)), (
                    f"seed {seed}, case {case}, cap {cap}: {name} C {getattr(got, name).tolist()} "
                    f"vs reference {getattr(want, name).tolist()}"
                )


# ---- topk_logprobs ----------------------------------------------------------------------


def make_logits(rng: np.random.Generator, shape, vocab: int, style: str) -> np.ndarray:
    if style == "normal":
        x = rng.standard_normal(shape + (vocab,)) * 2.0
    elif style == "ties":  # small integers: many exact ties, ordered by lower id
        x = rng.integers(-3, 3, size=shape + (vocab,)).astype(np.float64)
    elif style == "neg_inf":  # -inf entries (never a whole row)
        x = rng.standard_normal(shape + (vocab,)) * 2.0
        x[rng.random(x.shape) < 0.3] = -np.inf
        x[..., int(rng.integers(0, vocab))] = 0.5
    else:  # "const"
        x = np.full(shape + (vocab,), 1.25)
    return x


TOPK_DTYPES = (np.float16, BF16, np.float32, np.float64)


@pytest.mark.parametrize("vocab", [1, 7, 1025, 8193])
@pytest.mark.parametrize("dtype", TOPK_DTYPES, ids=lambda d: np.dtype(d).name)
def test_topk_parity(vocab, dtype):
    seed = 3000 + vocab
    rng = np.random.default_rng([seed, np.dtype(dtype).num])
    compared = 0
    for style in ("normal", "ties", "neg_inf", "const"):
        for shape in ((3,), (2, 2), ()):
            logits = make_logits(rng, shape, vocab, style).astype(dtype)
            for k in sorted({0, 1, vocab // 2, vocab}):
                got_lp, got_ids = kdtree.topk_logprobs(logits, k)
                want_lp, want_ids = ref.topk_logprobs(logits, k)
                where = f"seed {seed}, style {style}, shape {shape}, V {vocab}, k {k}, {np.dtype(dtype).name}"
                assert got_lp.shape == want_lp.shape == shape + (k,), where
                assert got_ids.shape == shape + (k,), where
                assert got_lp.dtype == np.float32 and got_ids.dtype == np.int32, where
                np.testing.assert_array_equal(got_ids, want_ids, err_msg=where)
                np.testing.assert_array_equal(np.isneginf(got_lp), np.isneginf(want_lp), err_msg=where)
                fin = np.isfinite(want_lp)
                assert np.isfinite(got_lp[fin]).all(), where
                if fin.any():
                    diff = np.abs(got_lp[fin].astype(np.float64) - want_lp[fin].astype(np.float64))
                    assert diff.max() <= 1e-6, f"{where}: max |diff| {diff.max()}"
                compared += 1
    print(f"topk parity V={vocab} {np.dtype(dtype).name}: {compared} calls")


def test_topk_parity_sliced_rows():
    """A strided view of logits gives what its contiguous copy gives (and the reference)."""
    rng = np.random.default_rng(3100)
    base = rng.standard_normal((6, 2 * 1025)).astype(np.float32)
    view = base[::2, ::2]
    for k in (0, 1, 512, 1025):
        a = kdtree.topk_logprobs(view, k)
        b = kdtree.topk_logprobs(np.ascontiguousarray(view), k)
        c = ref.topk_logprobs(view, k)
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], c[1])
        assert np.abs(a[0] - c[0]).max(initial=0) <= 1e-6


# ---- The C entry point directly: caller workspace and NULL outputs ----------------------


def _raw_build(lib, kw: dict, workspace: np.ndarray | None, offset: int = 0, keep=FIELDS):
    """kdt_trees_build_cpu through ctypes with a caller workspace (at `offset` bytes into
    `workspace`, so possibly unaligned) and only the fields in `keep` (others NULL)."""
    import ctypes

    from kdtree import _native as _lib

    lp = np.ascontiguousarray(kw["logprobs"], np.float32)
    ids = np.ascontiguousarray(kw["token_ids"], np.int32)
    batch, depth, width = lp.shape
    budget = kw["budget"]
    out = kdtree.empty_trees(batch, budget, depth)
    vocab = int(kw.get("vocab_size") or 0)
    draft = _lib.KdtDraft(batch, depth, width, lp.ctypes.data, ids.ctypes.data, None, None, vocab, -1)
    ptrs = [getattr(out, f).ctypes.data if f in keep or f == "num_nodes" else None for f in FIELDS]
    trees = _lib.KdtTrees(batch, budget, *ptrs)
    if workspace is None:
        lib.kdt_trees_build_cpu(ctypes.byref(draft), ctypes.byref(trees), None, 0)
    else:
        lib.kdt_trees_build_cpu(ctypes.byref(draft), ctypes.byref(trees),
                                workspace.ctypes.data + offset, workspace.nbytes - offset)
    return out


def test_caller_workspace_and_null_outputs(lib):
    """A caller workspace of exactly the queried size (garbage-filled, at every alignment)
    and NULL optional outputs give the same fields as the library's own allocation; one byte
    less is KDT_ERR_BUFFER_TOO_SMALL."""
    import ctypes

    seed = 1009
    for case in range(120):
        rng = np.random.default_rng([seed, case])
        kw = make_case(rng, budget=int(rng.integers(0, 200)))
        for option in ("root_tokens", "root_positions", "pad_token"):  # not passed by _raw_build
            kw.pop(option, None)
        lp = kw["logprobs"]
        if not np.isfinite(np.where(np.isneginf(lp), 0, lp)[:, :, : kw["budget"]]).all():
            continue  # garbage in the used part would be an error: not this test's subject
        want = ref.build_trees(**kw)
        need = ctypes.c_size_t()
        lib.kdt_trees_build_workspace_bytes(kw["budget"], lp.shape[1], lp.shape[2],
                                            int(kw.get("vocab_size") or 0), ctypes.byref(need))
        offset = case % 8
        ws = np.full(need.value + offset, 0xA5, np.uint8)
        got = _raw_build(lib, kw, ws, offset)
        bad = first_mismatch(got, want)
        assert bad is None, f"seed {seed}, case {case} ({describe(kw)}), workspace offset {offset}: {bad}"
        keep = tuple(f for f in FIELDS if rng.random() < 0.5)
        part = _raw_build(lib, kw, None, keep=keep)
        for f in ("num_nodes",) + keep:
            a, b = getattr(part, f), getattr(want, f)
            if f == "logw":
                a, b = a.view(np.int64), b.view(np.int64)
            assert np.array_equal(a.view(np.uint8) if f == "visibility" else a,
                                  b.view(np.uint8) if f == "visibility" else b), (
                f"seed {seed}, case {case}: field {f} with only {keep} requested")
        if need.value > 0:
            small = np.zeros(need.value - 1, np.uint8)
            with pytest.raises(kdtree.KdtreeError) as info:
                _raw_build(lib, kw, small)
            assert info.value.status_name == "KDT_ERR_BUFFER_TOO_SMALL"


# ---- Errors: one injected fault, same location from both ----------------------------------

LOCATION = __import__("re").compile(r"request \d+, depth \d+, rank \d+")


def test_single_fault_error_parity():
    """One bad entry (NaN, +inf, unsorted, duplicate id, id >= vocab, negative id) in the used
    part of a random batch: C and reference both reject it and name the same request, depth
    and rank. (With several faults the two may name different ones: the reference checks
    every value of a request before any id, the C builder goes row by row.)"""
    seed = 1010
    checked = 0
    for case in range(400):
        rng = np.random.default_rng([seed, case])
        kw = make_case(rng, budget=int(rng.integers(2, 60)))
        lp, ids = kw["logprobs"], kw["token_ids"]
        batch, depth, width = lp.shape
        used = min(width, kw["budget"])
        if used < 2:
            continue
        kw.pop("root_tokens", None)
        b, d, r = int(rng.integers(batch)), int(rng.integers(depth)), int(rng.integers(1, used))
        fault = ("nan", "inf", "unsorted", "dup", "vocab", "negative")[case % 6]
        if fault == "nan":
            lp[b, d, r] = np.nan
        elif fault == "inf":
            lp[b, d, r] = np.inf
        elif fault == "unsorted":
            if not np.isfinite(lp[b, d, r - 1]):
                continue
            lp[b, d, r] = lp[b, d, r - 1] + 1.0
        elif fault == "dup":
            ids[b, d, r] = ids[b, d, int(rng.integers(0, r))]
        elif fault == "vocab":
            kw["vocab_size"] = int(ids[:, :, :used].max()) + 1
            ids[b, d, r] = kw["vocab_size"] + int(rng.integers(0, 5))
        else:
            ids[b, d, r] = -int(rng.integers(1, 2**31))
        where = f"seed {seed}, case {case} ({describe(kw)}), fault {fault} at {(b, d + 1, r)}"
        with pytest.raises(ValueError) as c_err:
            kdtree.build_trees(**kw)
        with pytest.raises(ValueError) as ref_err:
            ref.build_trees(**kw)
        assert type(c_err.value) is kdtree.KdtreeError, where
        got, want = LOCATION.search(str(c_err.value)), LOCATION.search(str(ref_err.value))
        assert got and want and got.group() == want.group() == f"request {b}, depth {d + 1}, rank {r}", (
            f"{where}: C says {c_err.value}; reference says {ref_err.value}")
        checked += 1
    print(f"single-fault error parity: {checked} cases")
    assert checked >= 300


@pytest.mark.parametrize("root_position", [2**63 - 1, 2**63 - 2])
def test_regression_reference_root_position_overflow(root_position):
    """Regression (was a bug in python/kdtree/core/reference.py, build_trees): a root position above INT64_MAX - L
    makes positions = root_position + depth overflow int64. The C builder rejects it
    (KDT_ERR_OUT_OF_RANGE "request 0: root position ... outside [0, INT64_MAX - depth]");
    the reference silently wraps (RuntimeWarning) and returns a negative position:

        reference.build_trees([[-1.0], [-1.0]], [[3], [4]], 3, root_positions=[2**63 - 1])
        # positions [[9223372036854775807, -9223372036854775808, -9223372036854775807, ...]]

    Expected: both reject it with a ValueError naming request 0 and the root position."""
    lp = np.array([[-1.0], [-1.0]], np.float32)  # L = 2: the chain reaches depth 2
    ids = np.array([[3], [4]], np.int32)
    with pytest.raises(kdtree.KdtreeError, match="request 0: root position"):
        kdtree.build_trees(lp, ids, 3, root_positions=[root_position])
    with pytest.raises(ValueError, match="request 0"):
        with np.errstate(over="ignore"):
            ref.build_trees(lp, ids, 3, root_positions=[root_position])
