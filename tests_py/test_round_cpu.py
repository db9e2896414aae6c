"""The rest of the round on the host: masks with prefixes (every layout), trees from
logits, verification from logits (greedy and sampled) and KV compaction, checked against
hand-worked values, numpy computations written here, and published Philox test vectors.
These host paths are also the oracles of the GPU tests (tests_py/test_gpu.py).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import kdtree
from kdtree.core.sampling import gumbel_draws, philox4x32_10

pytestmark = pytest.mark.usefixtures("lib")


def chain_and_sibling_tree():
    """L = 2, K = 2, N = 3 with hand-known shape: node 1 = rank 0 at depth 1 (token 10),
    node 2 = its child rank 0 (token 20), node 3 = the root's rank-1 child (token 11).
    Scores: log 0.6, log 0.6 + log 0.9, log 0.4 (vs log 0.6 + log 0.1 for the other child)."""
    lp = np.log(np.array([[[0.6, 0.4], [0.9, 0.1]]], np.float64)).astype(np.float32)
    ids = np.array([[[10, 11], [20, 21]]], np.int32)
    t = kdtree.build_trees(lp, ids, 3, root_tokens=[7], pad_token=-1)
    assert t.num_nodes.tolist() == [3]
    assert t.tokens[0].tolist() == [7, 10, 20, 11]
    assert t.parents[0].tolist() == [-1, 0, 1, 0]
    return t


# ---- Philox ---------------------------------------------------------------------------------


def test_philox_matches_published_known_answers():
    """Random123's kat_vectors for philox4x32-10 (counter, key) -> output."""
    m = 0xFFFFFFFF
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((m, m, m, m), (m, m), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, want in cases:
        assert tuple(int(x) for x in philox4x32_10(counter, key)) == want


# ---- Masks ----------------------------------------------------------------------------------


def test_bool_mask_with_prefix_is_the_hand_matrix():
    t = chain_and_sibling_tree()
    mask, indptr, positions = kdtree.tree_attention_mask(t, [2], columns=8)
    assert indptr is None
    want = np.array([
        # prefix  root n1 n2 n3  (unused)
        [1, 1, 1, 0, 0, 0, 0, 0],   # root
        [1, 1, 1, 1, 0, 0, 0, 0],   # node 1 sees root
        [1, 1, 1, 1, 1, 0, 0, 0],   # node 2 sees node 1 and root
        [1, 1, 1, 0, 0, 1, 0, 0],   # node 3 sees root only
    ], bool)
    assert mask.dtype == np.bool_ and mask.shape == (1, 4, 8)
    np.testing.assert_array_equal(mask[0], want)
    assert positions.tolist() == [[2, 3, 4, 3]]


def test_padding_rows_see_only_themselves():
    lp = np.log(np.array([[[1.0]]], np.float64)).astype(np.float32)  # one candidate, N = 3
    t = kdtree.build_trees(lp, np.array([[[5]]], np.int32), 3)
    assert t.num_nodes.tolist() == [1]
    mask, _, positions = kdtree.tree_attention_mask(t, [3])
    assert mask.shape == (1, 4, 7)
    np.testing.assert_array_equal(mask[0, 2], [0, 0, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(mask[0, 3], [0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(mask[0, 1], [1, 1, 1, 1, 1, 0, 0])
    assert positions.tolist() == [[3, 4, 3, 3]]


def test_bits_additive_and_flashinfer_encode_the_bool_mask():
    rng = np.random.default_rng(5)
    lp = np.sort(rng.standard_normal((3, 4, 3)).astype(np.float32), axis=-1)[..., ::-1] - 2
    ids = np.argsort(rng.random((3, 4, 50)), axis=-1)[..., :3].astype(np.int32)
    t = kdtree.build_trees(np.ascontiguousarray(lp), ids, 9)
    prefix = [0, 5, 33]
    dense, _, _ = kdtree.tree_attention_mask(t, prefix, columns=45)
    bits, _, _ = kdtree.tree_attention_mask(t, prefix, kind="bits", columns=45)
    assert bits.dtype == np.uint32 and bits.shape == (3, 10, 2)
    for b in range(3):
        for i in range(10):
            for j in range(45):
                assert bool((int(bits[b, i, j // 32]) >> (j % 32)) & 1) == bool(dense[b, i, j])
            assert int(bits[b, i, 1]) >> 13 == 0  # columns 45..63 are zero
    for dtype, lowest in (("float32", -3.4028234663852886e38), ("float16", -65504.0)):
        add, _, _ = kdtree.tree_attention_mask(t, prefix, kind="additive", dtype=dtype, columns=45)
        assert add.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(add == 0, dense)
        assert set(np.unique(add[~dense]).astype(np.float64).tolist()) == {lowest}
    packed, indptr, _ = kdtree.tree_attention_mask(t, prefix, kind="flashinfer")
    assert indptr.dtype == np.int32
    assert indptr.tolist() == [0, math.ceil(10 * 10 / 8), math.ceil(10 * 10 / 8) + math.ceil(10 * 15 / 8),
                               math.ceil(10 * 10 / 8) + math.ceil(10 * 15 / 8) + math.ceil(10 * 43 / 8)]
    for b, p in enumerate(prefix):
        seg = packed[indptr[b] : indptr[b + 1]]
        flat = dense[b, :, : p + 10].reshape(-1)
        for idx, bit in enumerate(flat):  # bit idx of the segment, little-endian in its byte
            assert ((int(seg[idx // 8]) >> (idx % 8)) & 1) == int(bit)


def test_additive_mask_dtype_objects():
    """The dtype as a numpy / ml_dtypes dtype (and a torch dtype, where torch is installed)
    gives the same mask as its name; a dtype that is none of the three is named."""
    t = chain_and_sibling_tree()
    given = [("float16", np.float16), ("float16", np.dtype("float16")), ("bfloat16", ml_dtypes.bfloat16),
             ("float32", np.float32)]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        given += [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
    for name, dtype in given:
        want, _, _ = kdtree.tree_attention_mask(t, [2], kind="additive", dtype=name, columns=12)
        got, _, _ = kdtree.tree_attention_mask(t, [2], kind="additive", dtype=dtype, columns=12)
        assert got.dtype == want.dtype == np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match="dtype must be 'float32', 'float16' or 'bfloat16'.*int8"):
        kdtree.tree_attention_mask(t, [2], kind="additive", dtype=np.int8, columns=12)


def test_mask_rejects_bad_arguments():
    t = chain_and_sibling_tree()
    with pytest.raises(ValueError, match="exceeds columns"):
        kdtree.tree_attention_mask(t, [5], columns=8)
    with pytest.raises(ValueError, match=r"prefix_lengths\[0\] = -1 is negative"):
        kdtree.tree_attention_mask(t, [-1])
    with pytest.raises(ValueError, match="kind must be"):
        kdtree.tree_attention_mask(t, [0], kind="dense")
    with pytest.raises(ValueError, match="columns is not used"):
        kdtree.tree_attention_mask(t, [0], kind="flashinfer", columns=10)
    with pytest.raises(ValueError, match="stream= applies to GPU arrays only"):
        kdtree.tree_attention_mask(t, [0], stream=1)
    with pytest.raises(ValueError, match="got None"):  # (not numpy's float64 for None)
        kdtree.tree_attention_mask(t, [0], kind="additive", dtype=None)
    assert kdtree.tree_attention_mask(t, [0], kind="bool", dtype=None)[0].shape == (1, 4, 4)  # unused there
    with pytest.raises(ValueError, match="columns must be in"):  # a mask beyond any address space
        kdtree.tree_attention_mask(t, [0], columns=2**61)


# ---- Trees and verification from logits -----------------------------------------------------


def test_trees_from_logits_equal_topk_then_build():
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((2, 5, 300)) * 3).astype(np.float32)
    got = kdtree.build_trees_from_logits(logits, 8, 20, root_tokens=[1, 2], root_positions=[10, 0])
    lp, ids = kdtree.topk_logprobs(logits, 8)
    want = kdtree.build_trees(lp, ids, 20, root_tokens=[1, 2], root_positions=[10, 0], vocab_size=300)
    for name in ("num_nodes", "tokens", "parents", "logw", "positions", "visibility"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    with pytest.raises(ValueError, match="width 301 exceeds"):
        kdtree.build_trees_from_logits(logits, 301, 20)


def test_greedy_from_logits_takes_the_first_maximum():
    t = chain_and_sibling_tree()
    logits = np.zeros((1, 4, 30), np.float32)
    logits[0, 0, [10, 11]] = 5.0      # tie at the root: token 10 (lower id) wins -> node 1
    logits[0, 1, 20] = 3.0            # node 1 -> node 2
    logits[0, 2, [4, 9]] = 2.0        # node 2: tie, bonus 4
    acc = kdtree.verify_greedy_from_logits(t, logits)
    assert acc.accepted_nodes[0].tolist() == [0, 1, 2]
    assert acc.accept_length.tolist() == [2] and acc.bonus_token.tolist() == [4]
    # the argmax at the rows the walk read (root, node 1, node 2), -1 at node 3, as on the GPU
    assert acc.target_tokens.dtype == np.int32 and acc.target_tokens.tolist() == [[10, 20, 4, -1]]
    # a walk that ends on an accepted stop reads no row there; a cap of 1 reads the root only
    stopped = kdtree.verify_greedy_from_logits(t, logits, stop_tokens=[20])
    assert stopped.bonus_token.tolist() == [-1] and stopped.target_tokens.tolist() == [[10, 20, -1, -1]]
    capped = kdtree.verify_greedy_from_logits(t, logits, max_commit=1)
    assert capped.accept_length.tolist() == [0] and capped.target_tokens.tolist() == [[10, -1, -1, -1]]
    assert kdtree.verify_greedy_from_logits(t, logits, max_commit=0).target_tokens.tolist() == [[-1] * 4]
    out = kdtree.verify_greedy_from_logits(t, logits)
    out.target_tokens = np.zeros((1, 4), np.int32)
    assert kdtree.verify_greedy_from_logits(t, logits, max_commit=1, out=out) is out
    assert out.target_tokens.tolist() == [[10, -1, -1, -1]] and out.accept_length.tolist() == [0]
    logits[0, 3, 0] = np.nan  # a row the walk does not visit: no error (as on the GPU)
    again = kdtree.verify_greedy_from_logits(t, logits)
    assert again.accepted_nodes[0].tolist() == [0, 1, 2] and again.bonus_token.tolist() == [4]
    logits[0, 1, 5] = np.nan  # a visited row: the walk reports it
    with pytest.raises(ValueError, match="node 1"):
        kdtree.verify_greedy_from_logits(t, logits)


def test_trees_copy_and_pickle_after_a_native_call():
    """A TreeBatch used by a native call (which caches its C view on it) still copies and
    pickles: the copies carry the arrays and give the same walk."""
    import copy
    import pickle

    t = chain_and_sibling_tree()
    target = np.array([[10, 20, 4, 0]], np.int32)
    want = kdtree.verify_greedy(t, target)
    for other in (copy.deepcopy(t), pickle.loads(pickle.dumps(t)), copy.copy(t)):
        assert other.tokens.tolist() == t.tokens.tolist() and other.budget == t.budget
        got = kdtree.verify_greedy(other, target)
        assert got.accepted_nodes.tolist() == want.accepted_nodes.tolist() == [[0, 1, 2]]


def test_cpu_compact_kv_checks_every_request_before_moving_anything():
    k = np.arange(24, dtype=np.float32).reshape(1, 1, 12, 2)
    before = k.copy()
    acc = kdtree.Acceptance(np.array([[0, 2]], np.int32), np.array([1], np.int32), np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="prefix_lengths must be >= 0|outside the cache"):
        kdtree.compact_kv([k], None, [-3], acc)
    np.testing.assert_array_equal(k, before)
    two = np.arange(48, dtype=np.float32).reshape(2, 1, 12, 2)
    before = two.copy()
    acc2 = kdtree.Acceptance(np.array([[0, 2, 3], [0, 3, 1]], np.int32), np.array([2, 2], np.int32),
                             np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="request 1"):
        kdtree.compact_kv([two], None, [0, 0], acc2)
    np.testing.assert_array_equal(two, before)  # request 0 was not moved either
    with pytest.raises(ValueError, match="outside the cache"):
        kdtree.compact_kv([k], None, [8], kdtree.Acceptance(np.array([[0, 2, 5]], np.int32),
                                                           np.array([2], np.int32), np.zeros(1, np.int32)))


def test_status_mode_unpacks_the_same_on_the_cpu():
    t = chain_and_sibling_tree()
    masks = kdtree.tree_attention_mask(t, [2], errors="status")
    mask, indptr, positions = masks
    status = masks.request_status
    assert status.tolist() == [0]
    top = kdtree.topk_logprobs(np.zeros((2, 5), np.float32), 3, errors="status")
    lp, ids = top
    row_status = top.row_status
    assert row_status.tolist() == [0, 0]
    t.num_nodes[0] = 99
    with pytest.raises(ValueError, match="num_nodes 99"):
        kdtree.tree_attention_mask(t, [2])


def test_sampled_verification_is_reproducible_and_follows_the_draws():
    t = chain_and_sibling_tree()
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((1, 4, 25)).astype(np.float32)
    a = kdtree.verify_sample_from_logits(t, logits, 0.7, seed=123, offset=9)
    b = kdtree.verify_sample_from_logits(t, logits, 0.7, seed=123, offset=9)
    assert a.accepted_nodes.tolist() == b.accepted_nodes.tolist() and a.bonus_token.tolist() == b.bonus_token.tolist()
    draws = gumbel_draws(logits[0], 0.7, 123, 9, 0, np.arange(4))
    want = kdtree.verify_greedy(t, draws[None])
    assert a.accepted_nodes.tolist() == want.accepted_nodes.tolist()
    assert a.bonus_token.tolist() == want.bonus_token.tolist()
    # Temperature 0 is greedy decoding: the argmax walk.
    greedy = kdtree.verify_sample_from_logits(t, logits, 0.0, seed=123, offset=9)
    want = kdtree.verify_greedy_from_logits(t, logits)
    assert greedy.accepted_nodes.tolist() == want.accepted_nodes.tolist()
    assert greedy.bonus_token.tolist() == want.bonus_token.tolist()
    for bad in (-1.0, 1e-39, 1e39, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            kdtree.verify_sample_from_logits(t, logits, bad, seed=1, offset=0)
    with pytest.raises(TypeError, match="temperature"):
        kdtree.verify_sample_from_logits(t, logits, "1.0", seed=1, offset=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gumbel_draws_follow_the_softmax(temperature):
    """Chi-square goodness of fit of 6,000 draws (different offsets) against
    softmax(logits / T) for V = 8; critical value of chi2(7) at p = 1e-6 is 38.9."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -np.inf, 1.5], np.float32)
    draws = np.array([gumbel_draws(logits[None], temperature, 77, off, 0, np.array([0]))[0]
                      for off in range(6000)])
    assert not (draws == 6).any(), "a -inf logit was drawn"
    p = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
    p /= p.sum()
    counts = np.bincount(draws, minlength=8)
    keep = p > 0
    expected = p[keep] * len(draws)
    chi2 = float((((counts[keep] - expected) ** 2) / expected).sum())
    assert chi2 < 38.9, (chi2, counts.tolist(), (p * len(draws)).round(1).tolist())


# ---- KV compaction --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_compact_kv_on_the_host_is_the_gather(layout):
    rng = np.random.default_rng(1)
    B, H, S, D = 2, 3, 20, 4
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    ks = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    vs = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    before = [x.copy() for x in ks + vs]
    acc = kdtree.Acceptance(np.array([[0, 2, 3, 7], [0, 1, -1, -1]], np.int32), np.array([3, 1], np.int32),
                            np.array([5, 6], np.int32))
    prefix = [4, 9]
    kdtree.compact_kv(ks, vs, prefix, acc, layout=layout)
    for orig, now in zip(before, ks + vs, strict=True):
        for b, path in enumerate(([0, 2, 3, 7], [0, 1])):
            for j, node in enumerate(path):
                src = orig[b, :, prefix[b] + node] if layout == "bhsd" else orig[b, prefix[b] + node]
                dst = now[b, :, prefix[b] + j] if layout == "bhsd" else now[b, prefix[b] + j]
                np.testing.assert_array_equal(dst, src)
        # rows before the prefix end are untouched
        for b in range(B):
            sl = (b, slice(None), slice(0, prefix[b])) if layout == "bhsd" else (b, slice(0, prefix[b]))
            np.testing.assert_array_equal(now[sl], orig[sl])
