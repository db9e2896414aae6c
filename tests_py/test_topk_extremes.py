"""Top-k log-probs of logits up to float32's largest, against a float64 reference written here
(``math.fsum`` of ``exp(x - max)``, log-probs ``(x - max) - log sum``) and values by hand:
the Python reference (:func:`kdtree.reference.topk_logprobs`), the CPU library and, where a
GPU is present, the CUDA kernels (the row kernel for k <= 128, the chunk kernels above).

``logit - (max + log sum)`` loses ``log sum`` once the logits are large: six equal logits of
6.17e16 gave 0.0 instead of -log 6, ties at 1e12 were ~1e-4 off."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kdtree
from kdtree import reference

F32_MAX = float(np.finfo(np.float32).max)


def ref_logprobs(row) -> tuple[np.ndarray, np.ndarray]:
    """float64 reference: (value descending, id ascending) order and (x - m) - log sum exp(x - m)."""
    xs = [float(v) for v in np.asarray(row, np.float32)]
    m = max(xs)
    log_sum = math.log(math.fsum(math.exp(x - m) for x in xs))
    order = sorted(range(len(xs)), key=lambda i: (-xs[i], i))
    with np.errstate(over="ignore"):  # -FLT_MAX - FLT_MAX rounds to -inf in float32
        lp = np.array([(xs[i] - m) - log_sum for i in order], np.float64).astype(np.float32)
    return lp, np.array(order, np.int32)


def f32(*values) -> np.ndarray:
    return np.array(values, np.float32)


BIG, T, SP = 6.17e16, 1e12, 65536.0  # SP: float32's spacing at 1e12
INF = math.inf
ROWS = {
    "six equal 6.17e16": f32(BIG, BIG, BIG, BIG, BIG, BIG, -INF, -INF),
    "1e12 ties": f32(T, T, T, T - SP, T - 2 * SP, -T, 0.0, -INF),
    "float32 max": f32(F32_MAX, F32_MAX, -F32_MAX, 0.0, -INF, F32_MAX / 2, -F32_MAX, 1.0),
    "all -float32 max": f32(-F32_MAX, -F32_MAX, -F32_MAX, -F32_MAX, -INF, -INF, -INF, -INF),
    "all -3.4e38": f32(-3.4e38, -3.4e38, -3.4e38, -3.4e38, -3.4e38, -3.4e38, -3.4e38, -3.4e38),
    "mixed signs": f32(3.4e38, -3.4e38, 1e38, -1e38, 3.4e38, 0.0, 1e-38, -3.4e38),
    "1e6": f32(1e6, 1e6 + 1, 1e6 - 2, 1e6 + 0.5, -1e6, 1e6, 1e6 - 0.0625, 1e6 + 3),
}
# By hand: the log-probs of the leading ranks.
BY_HAND = {
    "six equal 6.17e16": [-math.log(6)] * 6,
    "1e12 ties": [-math.log(3)] * 3,
    "float32 max": [-math.log(2)] * 2 + [-F32_MAX / 2, -F32_MAX],
    "all -float32 max": [-math.log(4)] * 4,
    "all -3.4e38": [-math.log(8)] * 8,
}


def random_rows(vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Rows of offset + spread * normal (rounded to float32) at large offsets: the logits
    differ by a few units (or by float32's spacing where that is coarser)."""
    rng = np.random.default_rng(seed)
    out = {}
    for offset in (30.0, 1e4, 1e6, -1e6, 3e7, 1e9, -1e9, 1e12, 3e38):
        spacing = float(np.spacing(np.float32(abs(offset))))
        spread = max(3.0, 2 * spacing)
        x = (offset + spread * rng.standard_normal(vocab)).astype(np.float32)
        x[rng.integers(0, vocab, 5)] = np.float32(offset + 4 * spread)  # ties at the top
        out[f"offset {offset:g}"] = x
    return out


def ulp_close(got: np.ndarray, want: np.ndarray, ulps: int) -> np.ndarray:
    """Where got is within `ulps` float32 ulps of want (equal where want is infinite)."""
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(want64)
    # float32's ulp at |want| (a normal value): 2^(e - 24) for |want| = f 2^e, f in [0.5, 1)
    ulp = np.ldexp(1.0, np.frexp(np.where(finite, want64, 1.0))[1] - 24)
    with np.errstate(invalid="ignore"):  # inf - inf where both are infinite
        near = np.abs(got64 - want64) <= ulps * ulp
    return np.where(finite, near, got64 == want64)


@pytest.mark.parametrize("name", list(ROWS))
def test_reference_module(name):
    row = ROWS[name]
    lp, ids = reference.topk_logprobs(row, row.size)
    want_lp, want_ids = ref_logprobs(row)
    np.testing.assert_array_equal(ids, want_ids)
    assert ulp_close(lp, want_lp, 1).all(), (lp, want_lp)
    for i, v in enumerate(BY_HAND.get(name, [])):
        assert ulp_close(lp[i : i + 1], np.array([v], np.float32), 1).all(), (i, lp[i], v)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("name", list(ROWS))
def test_cpu(name):
    row = ROWS[name]
    lp, ids = kdtree.topk_logprobs(row, row.size)
    want_lp, want_ids = ref_logprobs(row)
    np.testing.assert_array_equal(ids, want_ids)
    assert ulp_close(lp, want_lp, 1).all(), (lp, want_lp)
    for i, v in enumerate(BY_HAND.get(name, [])):
        assert ulp_close(lp[i : i + 1], np.array([v], np.float32), 1).all(), (i, lp[i], v)


@pytest.mark.usefixtures("lib")
@pytest.mark.parametrize("vocab", [7, 1025])
def test_cpu_random_rows_at_large_offsets(vocab):
    rows = random_rows(vocab, seed=vocab)
    x = np.stack(list(rows.values()))
    k = min(vocab, 64)
    lp, ids = kdtree.topk_logprobs(x, k)
    for r, name in enumerate(rows):
        want_lp, want_ids = ref_logprobs(x[r])
        np.testing.assert_array_equal(ids[r], want_ids[:k], err_msg=name)
        assert ulp_close(lp[r], want_lp[:k], 1).all(), (name, lp[r][:4], want_lp[:4])


def test_cuda(cuda_device):
    """The GPU's bound (tests_native/test_topk_cuda.cu): 2e-6 * |lp| + 2e-6, ids exact."""
    import torch

    rows = dict(ROWS)
    for vocab in (1025, 8193):
        rows.update({f"{n}, V={vocab}": r for n, r in random_rows(vocab, seed=vocab).items()})
    for name, row in rows.items():
        v = row.size
        # k <= 128: the row kernel; k > 128: the chunk kernels.
        for k in sorted({min(v, 64), min(v, 129)}):
            lp, ids = kdtree.topk_logprobs(torch.from_numpy(row[None]).to(cuda_device), k)
            lp, ids = lp.cpu().numpy()[0], ids.cpu().numpy()[0]
            want_lp, want_ids = ref_logprobs(row)
            np.testing.assert_array_equal(ids, want_ids[:k], err_msg=f"{name}, k={k}")
            want = want_lp[:k].astype(np.float64)
            got = lp.astype(np.float64)
            ok = np.where(np.isinf(want), got == want, np.abs(got - want) <= 2e-6 * np.abs(want) + 2e-6)
            assert ok.all(), (name, k, got[~ok][:4], want[~ok][:4])


@pytest.mark.usefixtures("lib")
def test_trees_take_extreme_logprobs_and_reject_probabilities():
    """The top-k's log-probs of extreme rows build trees (the CPU builder and the reference
    agree); their probabilities np.exp(lp), or the raw logits, are rejected by both, naming
    request, depth and rank."""
    x = np.stack([ROWS["six equal 6.17e16"], ROWS["float32 max"], ROWS["1e6"]])[None]  # [1, 3, 8]
    lp, ids = kdtree.topk_logprobs(x, 4)
    got = kdtree.build_trees(lp, ids, 9)
    want = reference.build_trees(lp, ids, 9)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logw, want.logw)
    assert got.num_nodes[0] == 9
    for bad in (np.exp(lp), -np.sort(-x, axis=-1)[..., :4]):
        with pytest.raises(ValueError, match=r"request 0, depth 1, rank 0: log-probability .* > 0"):
            reference.build_trees(bad, ids, 9)
        with pytest.raises(kdtree.KdtreeError, match=r"request 0, depth 1, rank 0: log-probability .* > 0"):
            kdtree.build_trees(bad, ids, 9)
