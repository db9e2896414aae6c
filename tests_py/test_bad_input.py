"""Bad inputs give clear errors that say where (spec: "Degenerate and invalid inputs";
include/kdtree.h), of a precise type:

* ``kdtree.KdtreeError`` (a ValueError subclass with ``.status_name``) when the C library
  rejects the data ("request 1, depth 3, rank 2: NaN log-probability");
* ``TypeError`` / ``ValueError`` from the Python front end's own checks (dtypes, shapes).

Non-contiguous inputs must give the same result as their contiguous copies, and a failed
call leaves a passed ``out=`` buffer untouched.
"""

from __future__ import annotations

import contextlib
import re

import ml_dtypes
import numpy as np
import pytest

import kdtree
from kdtree import KdtreeError

pytestmark = pytest.mark.usefixtures("lib")

B, L, K = 3, 4, 5
ROW = np.array([-0.1, -0.5, -1.0, -2.0, -3.5], np.float32)


def good():
    """A valid [B, L, K] draft: every row ROW, ids 10..14 (row-unique)."""
    lp = np.tile(ROW, (B, L, 1))
    ids = np.tile(np.arange(10, 10 + K, dtype=np.int32), (B, L, 1))
    return lp, ids


# Every check raises kdtree's own error type, carrying a status (kdtree.core.api): a
# ValueError is a KdtreeError, a TypeError a KdtreeTypeError, a MemoryError a KdtreeMemoryError.
KDTREE_KIND = {ValueError: kdtree.KdtreeError, TypeError: kdtree.KdtreeTypeError,
               MemoryError: kdtree.KdtreeMemoryError}


@contextlib.contextmanager
def raises(kind, *fragments, status=None):
    """Like pytest.raises, but the exception must be exactly kdtree's type for `kind` (see
    KDTREE_KIND), its message must hold every fragment, and its status_name must match
    `status` when given."""
    kind = KDTREE_KIND.get(kind, kind)
    with pytest.raises(kind) as info:
        yield info
    err = info.value
    assert type(err) is kind, f"expected {kind.__name__}, got {type(err).__name__}: {err}"
    if kind in KDTREE_KIND.values():
        assert err.status_name.startswith("KDT_"), err.status_name
    for frag in fragments:
        assert frag in str(err), f"{frag!r} not in {str(err)!r}"
    if status is not None:
        assert err.status_name == status, err.status_name


# ---- Log-prob values (C validation, names request / depth / rank) -----------------------


@pytest.mark.parametrize(
    "value, rank, what",
    [(np.nan, 2, "NaN"), (np.inf, 0, "+inf"), (np.inf, 3, "+inf"), (np.nan, 0, "NaN")],
)
def test_nan_and_pos_inf(value, rank, what):
    lp, ids = good()
    lp[1, 2, rank] = value  # request 1, depth 3 (rows are depth 1..L)
    with raises(KdtreeError, f"request 1, depth 3, rank {rank}", what, status="KDT_ERR_VALUE"):
        kdtree.build_trees(lp, ids, 8)


def test_error_is_value_error_subclass_with_status():
    lp, ids = good()
    lp[2, 0, 1] = np.nan
    with pytest.raises(ValueError) as info:
        kdtree.build_trees(lp, ids, 8)
    err = info.value
    assert isinstance(err, KdtreeError) and err.status_name == "KDT_ERR_VALUE" and err.status == 4
    assert "request 2, depth 1, rank 1" in str(err)


def test_unsorted_row():
    lp, ids = good()
    lp[1, 2, 2] = -0.2  # bigger than rank 1 (-0.5)
    with raises(KdtreeError, "request 1, depth 3, rank 2", "sorted", status="KDT_ERR_VALUE"):
        kdtree.build_trees(lp, ids, 8)


def test_first_bad_entry_is_reported():
    """Several problems: the first request, then depth, then rank, is named."""
    lp, ids = good()
    lp[2, 0, 0] = np.nan
    lp[1, 3, 4] = np.nan
    lp[1, 3, 2] = np.inf
    with raises(KdtreeError, "request 1, depth 4, rank 2", "+inf"):
        kdtree.build_trees(lp, ids, 8)


def test_problems_beyond_the_used_width_are_ignored():
    """Only ranks < min(K, N) are read: NaN, +inf, unsorted or duplicate entries past the
    budget are not errors, and the result equals the trimmed input's."""
    lp, ids = good()
    lp[:, :, 3] = np.nan
    lp[:, :, 4] = np.inf
    ids[:, :, 3:] = -1
    got = kdtree.build_trees(lp, ids, 3)
    want = kdtree.build_trees(lp[:, :, :3].copy(), ids[:, :, :3].copy(), 3)
    for name in ("num_nodes", "tokens", "parents", "logw", "first_child", "next_sibling"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


# ---- Token ids ------------------------------------------------------------------------------


# vocab_size None: no bound; 50: small enough for the builder's vocabulary bitmap;
# 2**27: above the bitmap's limit (hash set). The answers must not depend on the method.
VOCABS = [None, 50, 2**27]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("first, second", [(0, 2), (0, 4), (3, 4), (1, 2)])
def test_duplicate_ids_in_a_row(vocab, first, second):
    lp, ids = good()
    ids[1, 2, second] = ids[1, 2, first]
    with raises(KdtreeError, f"request 1, depth 3, rank {second}", "duplicate", status="KDT_ERR_VALUE"):
        kdtree.build_trees(lp, ids, 8, vocab_size=vocab)


@pytest.mark.parametrize("vocab", VOCABS)
def test_duplicate_ids_in_the_same_bitmap_word(vocab):
    """ids 0..63 share one 64-bit word: neighbours are not duplicates, a repeat is."""
    lp = -np.arange(64, dtype=np.float32)[None, None] / 8
    ids = np.arange(64, dtype=np.int32)[None, None].copy()
    kdtree.build_trees(lp, ids, 64, vocab_size=None if vocab is None else max(vocab, 64))
    ids[0, 0, 63] = 62
    with raises(KdtreeError, "request 0, depth 1, rank 63", "duplicate"):
        kdtree.build_trees(lp, ids, 64, vocab_size=None if vocab is None else max(vocab, 64))


@pytest.mark.parametrize("vocab", VOCABS)
def test_same_id_in_different_rows_requests_and_calls_is_fine(vocab):
    """Every row, every request and every call reuses ids 10..14: none is a duplicate (a
    duplicate-id set that is not cleared between rows would say otherwise)."""
    lp, ids = good()
    for _ in range(3):
        assert kdtree.build_trees(lp, ids, 8, vocab_size=vocab).num_nodes.tolist() == [8, 8, 8]


@pytest.mark.parametrize("vocab", VOCABS)
def test_duplicate_after_failed_call_state(vocab):
    """A call that fails on a duplicate leaves no state behind: the next valid call passes
    and the next call with a duplicate in another place names that place."""
    lp, ids = good()
    bad = ids.copy()
    bad[0, 0, 3] = bad[0, 0, 1]
    with raises(KdtreeError, "request 0, depth 1, rank 3"):
        kdtree.build_trees(lp, bad, 8, vocab_size=vocab)
    assert kdtree.build_trees(lp, ids, 8, vocab_size=vocab).num_nodes.tolist() == [8, 8, 8]
    bad = ids.copy()
    bad[2, 3, 4] = bad[2, 3, 2]
    with raises(KdtreeError, "request 2, depth 4, rank 4"):
        kdtree.build_trees(lp, bad, 8, vocab_size=vocab)


@pytest.mark.parametrize("bad", [50, 51, 2**31 - 1])
def test_ids_at_or_above_vocab(bad):
    lp, ids = good()
    ids[1, 2, 2] = bad
    with raises(KdtreeError, "request 1, depth 3, rank 2", str(bad), status="KDT_ERR_OUT_OF_RANGE"):
        kdtree.build_trees(lp, ids, 8, vocab_size=50)
    kdtree.build_trees(lp, ids, 8)  # no vocabulary: no upper bound


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("bad", [-1, -(2**31)])
def test_negative_ids(bad, vocab):
    lp, ids = good()
    ids[1, 2, 2] = bad
    with raises(KdtreeError, "request 1, depth 3, rank 2", str(bad), status="KDT_ERR_OUT_OF_RANGE"):
        kdtree.build_trees(lp, ids, 8, vocab_size=vocab)


@pytest.mark.parametrize("vocab", VOCABS[1:])
def test_out_of_range_id_before_a_later_duplicate(vocab):
    """The first offending rank is named whichever problem it has."""
    lp, ids = good()
    ids[0, 1, 1] = vocab + 1
    ids[0, 1, 3] = ids[0, 1, 0]
    with raises(KdtreeError, "request 0, depth 2, rank 1", status="KDT_ERR_OUT_OF_RANGE"):
        kdtree.build_trees(lp, ids, 8, vocab_size=vocab)
    ids[0, 1, 1] = ids[0, 1, 0]
    ids[0, 1, 3] = -1
    with raises(KdtreeError, "request 0, depth 2, rank 1", "duplicate", status="KDT_ERR_VALUE"):
        kdtree.build_trees(lp, ids, 8, vocab_size=vocab)


def test_ids_outside_int32_are_not_wrapped():
    lp, ids = good()
    wide = ids.astype(np.int64)
    wide[0, 0, 0] = 2**32 + 10  # would wrap to 10 (a duplicate) if cast blindly
    with raises(ValueError, "token_ids", "int32"):
        kdtree.build_trees(lp, wide, 8)


def test_root_token_and_position_checks():
    lp, ids = good()
    with raises(KdtreeError, "request 1", "root token", status="KDT_ERR_OUT_OF_RANGE"):
        kdtree.build_trees(lp, ids, 8, root_tokens=[1, -2, 3])
    with raises(KdtreeError, "request 2", "root token 60", status="KDT_ERR_OUT_OF_RANGE"):
        kdtree.build_trees(lp, ids, 8, root_tokens=[1, 2, 60], vocab_size=60)
    with raises(KdtreeError, "request 2", "root position", status="KDT_ERR_OUT_OF_RANGE"):
        kdtree.build_trees(lp, ids, 8, root_positions=[0, 5, -3])


# ---- Budget and scalar arguments ----------------------------------------------------------


@pytest.mark.parametrize("budget", [-1, -1000])
def test_negative_budget(budget):
    lp, ids = good()
    with raises(ValueError, "budget", str(budget)):
        kdtree.build_trees(lp, ids, budget)


def test_budget_too_large_for_memory_says_so_before_allocating():
    # 10^7 nodes: the dense mask alone is 3 x 10^14 bytes (~273 TiB), beyond any host; numpy
    # would otherwise fail with its own message (or the process be killed on first touch).
    lp, ids = good()
    with raises(MemoryError, "budget 10000000", "dense visibility mask", "TiB"):
        kdtree.build_trees(lp, ids, 10**7)
    with raises(MemoryError, "budget 10000000"):
        kdtree.empty_trees(B, 10**7, L)


def test_budget_over_the_process_memory_limit_says_so(tmp_path):
    # Under RLIMIT_AS = 4 GiB (as a container or ulimit would set), trees needing ~6 GiB are
    # refused with the limit named, not left to numpy or the kernel's OOM killer.
    import os
    import subprocess
    import sys

    # The room is the limit less the address space already in use: 4 GiB above it here; then
    # 3 GiB reserved (untouched, as loaded libraries and maps are) under a limit 256 MiB
    # above the use, where a 1 GiB mask is refused by the guard, not by numpy.
    code = (
        "import resource, numpy as np, kdtree\n"
        "def used():\n"
        "    return int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "lp = np.log(np.full((1, 2, 2), 0.5, np.float32)); ids = np.array([[[1, 2], [3, 4]]], np.int32)\n"
        "small = kdtree.build_trees(lp, ids, 3)  # the library and its threads loaded before the limit\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used() + (4 << 30), resource.RLIM_INFINITY))\n"
        "try:\n"
        "    kdtree.build_trees(lp, ids, 80000)\n"
        "except MemoryError as e:\n"
        "    print(e)\n"
        "try:  # 512 MiB packed, but a 4 GiB bool mask while it is packed\n"
        "    kdtree.tree_attention_mask(small, [1 << 30], kind='flashinfer')\n"
        "except kdtree.KdtreeError as e:\n"
        "    print('flashinfer guard:', e)\n"
        "except MemoryError as e:\n"
        "    print('flashinfer numpy:', e)\n"
        "reserved = np.empty(3 << 30, np.uint8)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used() + (256 << 20), resource.RLIM_INFINITY))\n"
        "trees = kdtree.build_trees(lp, ids, 3)\n"
        "try:\n"
        "    kdtree.tree_attention_mask(trees, [(1 << 30) // 4])\n"
        "except kdtree.KdtreeError as e:\n"
        "    print('guard:', e)\n"
        "except MemoryError as e:\n"
        "    print('numpy:', e)\n"
    )
    from pathlib import Path

    package_root = str(Path(kdtree.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # (the room is what is left under the limit when the guard runs: 4 GiB less what the
    # process mapped since, and no more than the machine has available)
    room = re.search(r"budget 80000.* of the ([0-9.]+) GiB of memory this process can get now", r.stdout)
    assert room is not None and 2.0 <= float(room.group(1)) <= 4.0, r.stdout
    assert "guard:" in r.stdout and "the bool masks [1, 4, 268435460]" in r.stdout, r.stdout
    assert "flashinfer guard:" in r.stdout and "one request's unpacked bool mask" in r.stdout, r.stdout


@pytest.mark.parametrize("budget", [2.0, "4", None, True, np.float64(3), np.bool_(True)])
def test_non_int_budget(budget):
    lp, ids = good()
    with raises(TypeError, "budget"):
        kdtree.build_trees(lp, ids, budget)


def test_numpy_int_budget_is_fine():
    lp, ids = good()
    assert kdtree.build_trees(lp, ids, np.int64(3)).budget == 3


@pytest.mark.parametrize("vocab", [0, -5])
def test_bad_vocab_size(vocab):
    lp, ids = good()
    with raises(ValueError, "vocab_size"):
        kdtree.build_trees(lp, ids, 8, vocab_size=vocab)


def test_pad_token_outside_int32():
    lp, ids = good()
    with raises(ValueError, "pad_token"):
        kdtree.build_trees(lp, ids, 8, pad_token=2**31)


# ---- Shapes -------------------------------------------------------------------------------


def test_logprobs_ids_shape_mismatch():
    lp, ids = good()
    with raises(ValueError, "logprobs (3, 4, 5)", "token_ids (3, 4, 4)"):
        kdtree.build_trees(lp, ids[:, :, :4], 8)
    with raises(ValueError, "same shape"):
        kdtree.build_trees(lp, ids[0], 8)
    with raises(ValueError, "logprobs must be [B, L, K] or [L, K]", "got shape (5,)"):
        kdtree.build_trees(lp[0, 0], ids[0, 0], 8)  # 1-D
    with raises(ValueError, "logprobs must be [B, L, K] or [L, K]", "got shape (1, 3, 4, 5)"):
        kdtree.build_trees(lp[None], ids[None], 8)  # 4-D
    with raises(ValueError, "token_ids must be [B, L, K] or [L, K]", "got shape (5,)"):
        kdtree.build_trees(lp[0], ids[0, 0], 8)


def test_root_arrays_length():
    lp, ids = good()
    with raises(ValueError, "root_tokens", "(3,)"):
        kdtree.build_trees(lp, ids, 8, root_tokens=[1, 2])
    with raises(ValueError, "root_positions", "(3,)"):
        kdtree.build_trees(lp, ids, 8, root_positions=[1, 2, 3, 4])
    # the right number of values in the wrong shape is not flattened silently
    with raises(ValueError, "root_tokens must have shape (3,)", "got (1, 3)"):
        kdtree.build_trees(lp, ids, 8, root_tokens=[[1, 2, 3]])
    with raises(ValueError, "root_positions must have shape (3,)", "got (3, 1)"):
        kdtree.build_trees(lp, ids, 8, root_positions=[[1], [2], [3]])
    # log-probs laid out [L, B, K] by mistake: the message says where B came from
    lp_t, ids_t = np.swapaxes(lp, 0, 1), np.swapaxes(ids, 0, 1)
    with raises(ValueError, f"root_tokens must have shape ({lp.shape[1]},)",
                f"B = {lp.shape[1]} from logprobs of shape {lp_t.shape}, [B, L, K]", "got (3,)"):
        kdtree.build_trees(lp_t, ids_t, 8, root_tokens=[1, 2, 3])


# ---- Dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.bool_, object, np.int32, np.uint8])
def test_bad_logprob_dtypes(dtype):
    lp, ids = good()
    with raises(TypeError, "logprobs", "floating"):
        kdtree.build_trees(lp.astype(dtype), ids, 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, object, np.complex64])
def test_bad_id_dtypes(dtype):
    lp, ids = good()
    with raises(TypeError, "token_ids", "integer"):
        kdtree.build_trees(lp, ids.astype(dtype), 8)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_other_float_dtypes_are_accepted(dtype):
    lp, ids = good()
    got = kdtree.build_trees(lp.astype(dtype), ids, 8)
    want = kdtree.build_trees(lp.astype(dtype).astype(np.float32), ids, 8)
    assert got.logw.tobytes() == want.logw.tobytes()


def test_host_arrays_numpy_cannot_read_get_a_clear_error():
    torch = pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
    x = torch.zeros((2, 50), dtype=torch.bfloat16)  # numpy has no bfloat16: torch refuses to export it
    with raises(TypeError, "logits", "torch.bfloat16", "tensor.float()"):
        kdtree.topk_logprobs(x, 4)
    with raises(TypeError, "logits", "torch.bfloat16"):
        kdtree.build_trees_from_logits(x, 4, 4)
    y = torch.zeros((2, 50), requires_grad=True)  # the hint is then to detach, not to convert
    with raises(TypeError, "logits", "requires grad", "tensor.detach()"):
        kdtree.topk_logprobs(y, 4)
    m = torch.zeros((2, 50), device="meta")  # no data at all: neither hint applies
    with raises(TypeError, "logits", "meta tensor holds no data"):
        kdtree.topk_logprobs(m, 4)
    # The verify functions' target logits get the same message (they called np.asarray).
    trees = kdtree.build_trees(np.log(np.full((1, 2, 3), 1 / 3, np.float32)), np.arange(6).reshape(1, 2, 3), 4)
    target = torch.zeros((1, 5, 50), dtype=torch.bfloat16)
    with raises(TypeError, "target_logits", "torch.bfloat16", "tensor.float()"):
        kdtree.verify_greedy_from_logits(trees, target)
    with raises(TypeError, "target_logits", "torch.bfloat16", "tensor.float()"):
        kdtree.verify_sample_from_logits(trees, target, 1.0, seed=1, offset=0)


def test_float_root_tokens_rejected():
    lp, ids = good()
    with raises(TypeError, "root_tokens"):
        kdtree.build_trees(lp, ids, 8, root_tokens=[1.0, 2.0, 3.0])
    with raises(TypeError, "root_positions"):
        kdtree.build_trees(lp, ids, 8, root_positions=np.zeros(3))


# ---- Non-contiguous inputs: same result as the contiguous copy ------------------------------

FIELDS = ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility",
          "visibility_bits", "first_child", "next_sibling")


def _assert_same_trees(a, b):
    for name in FIELDS:
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name


def _varied_draft(seed=0, batch=4, depth=6, width=7, vocab=40):
    rng = np.random.default_rng(seed)
    lp = -np.sort(rng.exponential(size=(batch, depth, width)), axis=-1).astype(np.float32)
    ids = np.argsort(rng.random((batch, depth, vocab)), axis=-1)[..., :width].astype(np.int32)
    return lp, ids


def test_strided_slices():
    lp, ids = _varied_draft(width=14)
    big_lp = np.repeat(lp, 2, axis=0)  # [8, L, K], requests 0,0,1,1,...
    big_ids = np.repeat(ids, 2, axis=0)
    s_lp, s_ids = big_lp[::2, :, ::2], big_ids[::2, :, ::2]  # steps in two axes
    assert not s_lp.flags.c_contiguous
    want = kdtree.build_trees(np.ascontiguousarray(s_lp), np.ascontiguousarray(s_ids), 20)
    _assert_same_trees(kdtree.build_trees(s_lp, s_ids, 20), want)


def test_fortran_order_and_transposed():
    lp, ids = _varied_draft()
    want = kdtree.build_trees(lp, ids, 25)
    _assert_same_trees(kdtree.build_trees(np.asfortranarray(lp), np.asfortranarray(ids), 25), want)
    lp_t = np.ascontiguousarray(lp.transpose(2, 1, 0)).transpose(2, 1, 0)  # a transposed view
    ids_t = np.ascontiguousarray(ids.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not lp_t.flags.c_contiguous and not ids_t.flags.c_contiguous
    _assert_same_trees(kdtree.build_trees(lp_t, ids_t, 25), want)


def test_reversed_batch_and_strided_roots():
    lp, ids = _varied_draft()
    roots = np.arange(100, 108)[::2]  # strided
    pos = np.arange(0, 80, 10, dtype=np.int64)[::-2]  # negative stride
    want = kdtree.build_trees(np.ascontiguousarray(lp[::-1]), np.ascontiguousarray(ids[::-1]), 9,
                              root_tokens=roots.copy(), root_positions=pos.copy())
    got = kdtree.build_trees(lp[::-1], ids[::-1], 9, root_tokens=roots, root_positions=pos)
    _assert_same_trees(got, want)


def test_non_contiguous_target_tokens():
    lp, ids = _varied_draft()
    t = kdtree.build_trees(lp, ids, 12)
    # At each node, the token of its first child (walks go deep); 5 where there is none.
    fc = t.first_child
    target = np.where(fc >= 0, np.take_along_axis(t.tokens, np.maximum(fc, 0), axis=1), 5)
    target = target.astype(np.int32)
    wide = np.zeros((4, 26), np.int32)
    wide[:, ::2] = target
    b = kdtree.verify_greedy(t, target)
    assert (b.accept_length > 1).any()
    for variant in (wide[:, ::2], np.asfortranarray(target), target.astype(np.int64)):
        a = kdtree.verify_greedy(t, variant)
        for name in ("accepted_nodes", "accept_length", "bonus_token"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


# ---- verify_greedy --------------------------------------------------------------------------


def _tree():
    lp, ids = _varied_draft(batch=3)
    return kdtree.build_trees(lp, ids, 10)


def test_target_tokens_shape():
    t = _tree()
    with raises(ValueError, "target_tokens", "(3, 11)"):
        kdtree.verify_greedy(t, np.zeros((3, 10), np.int32))
    with raises(ValueError, "target_tokens"):
        kdtree.verify_greedy(t, np.zeros(11, np.int32))  # 1-D only allowed for B = 1
    with raises(TypeError, "target_tokens"):
        kdtree.verify_greedy(t, np.zeros((3, 11)))


@pytest.mark.parametrize(("cap", "message"), [(-1, "max_commit must be >= 0, got -1"),
                                              ([0, -2, 1], "max_commit must be >= 0, got -2 for request 1")])
def test_negative_max_commit(cap, message):
    t = _tree()
    with raises(ValueError, message):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32), max_commit=cap)


def test_committed_request_out_of_range():
    t = _tree()
    acc = kdtree.verify_greedy(t, np.zeros((3, 11), np.int32))
    for b in (3, -1):
        with raises(IndexError, f"request {b} is out of range", "3 requests"):
            acc.committed(t, b)


@pytest.mark.parametrize("cap", [[1, 2], [1], [1, 2, 3, 4], [[1], [2], [3]]])
def test_max_commit_wrong_shape(cap):
    """Only an int or one cap per request: a length-1 list is not broadcast to 3 requests,
    and the message names the argument and the shape it needs (not numpy's broadcast text)."""
    t = _tree()
    with raises(ValueError, "max_commit", "one int per request (shape (3,))", f"got shape {np.shape(cap)}"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32), max_commit=cap)


def test_max_commit_wrong_dtype():
    t = _tree()
    with raises(TypeError, "max_commit"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32), max_commit=1.5)


def test_max_commit_int_and_per_request_agree():
    """An int caps every request as the same value repeated per request does."""
    t = _tree()
    target = np.zeros((3, 11), np.int32)
    a = kdtree.verify_greedy(t, target, max_commit=1)
    b = kdtree.verify_greedy(t, target, max_commit=np.array([1, 1, 1]))
    assert np.array_equal(a.accept_length, b.accept_length) and np.array_equal(a.bonus_token, b.bonus_token)


@pytest.mark.parametrize("stops", [5, "ab", np.array(5)])
def test_stop_tokens_not_a_sequence(stops):
    t = _tree()
    with raises(TypeError, "stop_tokens must be a sequence of token ids"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32), stop_tokens=stops)


def test_stop_tokens_none_means_none():
    lp, ids = _varied_draft(batch=3)
    t = kdtree.build_trees(lp, ids, 10)
    target = np.zeros((3, 11), np.int32)
    first = t.first_child[:, 0]  # the root's first child, accepted by the walk
    target[:, 0] = t.tokens[np.arange(3), first]
    a = kdtree.verify_greedy(t, target, stop_tokens=None)
    b = kdtree.verify_greedy(t, target, stop_tokens=())
    assert a.accept_length.tolist() == [1, 1, 1]
    assert np.array_equal(a.accepted_nodes, b.accepted_nodes) and np.array_equal(a.bonus_token, b.bonus_token)
    stopped = kdtree.verify_greedy(t, target, stop_tokens=[int(t.tokens[0, first[0]])])
    assert stopped.bonus_token[0] == -1  # the same token as a stop token ends request 0's walk


def test_negative_target_at_visited_node():
    t = _tree()
    target = np.zeros((3, 11), np.int32)
    target[1, 0] = -4  # request 1's root is always visited
    with raises(KdtreeError, "request 1, node 0", "negative", status="KDT_ERR_VALUE"):
        kdtree.verify_greedy(t, target)


def test_negative_target_in_padding_is_ignored():
    lp = np.array([[-0.5, -1.0], [-0.5, -1.0]], np.float32)  # 6 reachable nodes
    ids = np.array([[1, 2], [3, 4]], np.int32)
    t = kdtree.build_trees(lp, ids, 10)
    assert t.num_nodes.tolist() == [6]
    target = np.full((1, 11), -9, np.int32)  # padding rows 7..10 hold negatives
    target[0, :7] = 99  # real nodes: a token no child has
    acc = kdtree.verify_greedy(t, target)
    assert acc.accept_length.tolist() == [0] and acc.bonus_token.tolist() == [99]


def test_corrupted_tree_links():
    t = _tree()
    t.first_child[2, 0] = 500  # out of range
    with raises(KdtreeError, "request 2, node 0", "first_child", status="KDT_ERR_VALUE"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32))
    t = _tree()
    t.next_sibling[1, 3] = 2  # points backwards: a possible cycle
    with raises(KdtreeError, "request 1, node 3", "next_sibling", status="KDT_ERR_VALUE"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32))
    t = _tree()
    t.num_nodes[0] = 11
    with raises(KdtreeError, "request 0", "num_nodes", status="KDT_ERR_VALUE"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32))


def test_stop_tokens_outside_int32():
    t = _tree()
    with raises(ValueError, "stop_tokens"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32), stop_tokens=[2**40])


def test_verify_rejects_non_contiguous_tree_arrays():
    t = _tree()
    t.tokens = np.asfortranarray(t.tokens)
    with raises(ValueError, "trees.tokens"):
        kdtree.verify_greedy(t, np.zeros((3, 11), np.int32))


def test_verify_rejects_non_trees():
    with raises(TypeError, "TreeBatch"):
        kdtree.verify_greedy({"tokens": 1}, np.zeros((1, 1), np.int32))


# ---- out= -----------------------------------------------------------------------------------


def _filled_out(batch, budget, depth, byte=0x5A):
    out = kdtree.empty_trees(batch, budget, depth)
    for name in FIELDS:
        getattr(out, name).view(np.uint8)[...] = byte
    return out


def _snapshot(out):
    return {name: getattr(out, name).tobytes() for name in FIELDS}


@pytest.mark.parametrize("field, bad", [
    ("tokens", lambda a: np.zeros(a.shape, np.int64)),
    ("logw", lambda a: np.zeros(a.shape, np.float32)),
    ("visibility", lambda a: np.zeros(a.shape, np.uint8)),
    ("tokens", lambda a: a[:, :-1].copy()),
    ("visibility_bits", lambda a: np.zeros(a.shape[:2] + (a.shape[2] + 1,), np.uint32)),
    ("num_nodes", lambda a: np.zeros(a.shape[0] + 1, np.int32)),
    ("parents", lambda a: np.asfortranarray(a)),
    ("depths", lambda a: np.zeros((a.shape[0], 2 * a.shape[1]), np.int32)[:, ::2]),
    ("positions", lambda a: [list(r) for r in a]),
])
def test_out_wrong_shape_dtype_or_layout(field, bad):
    lp, ids = good()
    out = _filled_out(B, 8, L)
    setattr(out, field, bad(getattr(out, field)))
    with raises(ValueError, f"out.{field}"):
        kdtree.build_trees(lp, ids, 8, out=out)


def test_out_read_only():
    lp, ids = good()
    out = _filled_out(B, 8, L)
    out.logw.flags.writeable = False
    with raises(ValueError, "out.logw", "writeable"):
        kdtree.build_trees(lp, ids, 8, out=out)


def test_out_for_another_budget_or_batch():
    lp, ids = good()
    with raises(ValueError, "out."):
        kdtree.build_trees(lp, ids, 7, out=_filled_out(B, 8, L))
    with raises(ValueError, "out."):
        kdtree.build_trees(lp, ids, 8, out=_filled_out(B + 1, 8, L))


@pytest.mark.parametrize("where", ["nan", "dup", "vocab", "root_pos"])
def test_out_untouched_on_error_in_a_later_request(where):
    """Request 2's input is bad: the C builder validates every request before writing, so
    every byte of the sentinel-filled out= buffer is unchanged (requests 0 and 1 too)."""
    lp, ids = good()
    kw = {}
    if where == "nan":
        lp[2, 3, 1] = np.nan
    elif where == "dup":
        ids[2, 1, 4] = ids[2, 1, 0]
    elif where == "vocab":
        ids[2, 0, 0] = 99
        kw["vocab_size"] = 50
    else:
        kw["root_positions"] = [1, 2, -1]
    out = _filled_out(B, 8, L)
    before = _snapshot(out)
    with pytest.raises(KdtreeError, match="request 2"):
        kdtree.build_trees(lp, ids, 8, out=out, **kw)
    assert _snapshot(out) == before


def test_out_untouched_on_python_side_error():
    lp, ids = good()
    out = _filled_out(B, 8, L)
    before = _snapshot(out)
    with raises(ValueError, "root_tokens"):
        kdtree.build_trees(lp, ids, 8, out=out, root_tokens=[1])
    with raises(TypeError, "logprobs"):
        kdtree.build_trees(lp.astype(complex), ids, 8, out=out)
    assert _snapshot(out) == before


def test_regression_failed_build_keeps_out_metadata():
    """Regression (was a bug in the host build_trees / topk_logprobs, python/kdtree/core, build_trees): with out=, ``out.budget, out.depth`` are
    assigned before the C call, so a call that then fails leaves ``out.depth`` describing the
    rejected input while the arrays still hold the earlier tree. verify_greedy sizes its path
    from ``trees.depth`` and then fails on the (valid) earlier tree:

        out = build_trees(full((1, 4, 1), -0.5), [[[7], [8], [9], [10]]], 4)   # chain, depth 4
        build_trees(full((1, 1, 1), nan), zeros((1, 1, 1)), 4, out=out)        # KdtreeError
        out.depth                                                             # 1, not 4
        verify_greedy(out, [[7, 8, 9, 10, 0]])  # KDT_ERR_SHAPE: path longer than capacity

    A failed call should leave ``out`` (arrays and metadata) untouched."""
    lp = np.full((1, 4, 1), -0.5, np.float32)
    ids = np.array([[[7], [8], [9], [10]]], np.int32)
    out = kdtree.build_trees(lp, ids, 4)
    with pytest.raises(KdtreeError):
        kdtree.build_trees(np.full((1, 1, 1), np.nan, np.float32), np.zeros((1, 1, 1), np.int32), 4, out=out)
    assert out.depth == 4, f"out.depth changed to {out.depth} by a failed call"
    acc = kdtree.verify_greedy(out, np.array([[7, 8, 9, 10, 0]], np.int32))
    assert acc.accept_length.tolist() == [4]


# ---- topk_logprobs --------------------------------------------------------------------------


@pytest.mark.parametrize("k", [6, 100])
def test_topk_k_above_vocab(k):
    with raises(ValueError, "k must be in [0, 5]"):
        kdtree.topk_logprobs(np.zeros((2, 5), np.float32), k)


def test_topk_negative_or_non_int_k():
    with raises(ValueError, "k"):
        kdtree.topk_logprobs(np.zeros((2, 5), np.float32), -1)
    with raises(TypeError, "k"):
        kdtree.topk_logprobs(np.zeros((2, 5), np.float32), 2.0)


@pytest.mark.parametrize("value, what", [(np.nan, "NaN"), (np.inf, "+inf")])
def test_topk_nan_and_pos_inf(value, what):
    x = np.zeros((3, 7), np.float32)
    x[2, 4] = value
    with raises(KdtreeError, "row 2, column 4", what, status="KDT_ERR_VALUE"):
        kdtree.topk_logprobs(x, 3)
    x3 = np.zeros((2, 2, 7), np.float32)  # [B, L, V]: the row as request and position
    x3[1, 0, 6] = value
    with raises(KdtreeError, "request 1, position 0 (logits[1, 0], row 2), column 6", what):
        kdtree.topk_logprobs(x3, 1)
    x4 = np.zeros((2, 3, 2, 7), np.float32)  # other ranks: the index of the row
    x4[1, 2, 0, 3] = value
    with raises(KdtreeError, "logits[1, 2, 0], row 10, column 3", what):
        kdtree.topk_logprobs(x4, 1)


def test_build_trees_from_logits_names_the_callers_row():
    x = np.zeros((4, 9), np.float32)  # [L, V]: the row is logits[3], not a [1, L, V] index
    x[3, 2] = np.nan
    with raises(KdtreeError, "row 3, column 2", "NaN") as info:
        kdtree.build_trees_from_logits(x, 2, 4)
    assert "request" not in str(info.value)


def test_topk_all_neg_inf_row():
    x = np.zeros((3, 7), np.float32)
    x[1] = -np.inf
    with raises(KdtreeError, "row 1", "-inf", status="KDT_ERR_VALUE"):
        kdtree.topk_logprobs(x, 2)
    x[1, 3] = -1e30  # one finite logit is enough
    lp, ids = kdtree.topk_logprobs(x, 2)
    assert ids[1].tolist() == [3, 0] and lp[1, 0] == 0.0 and lp[1, 1] == -np.inf


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64, object])
def test_topk_bad_dtype(dtype):
    with raises(TypeError, "logits"):
        kdtree.topk_logprobs(np.zeros((2, 5)).astype(dtype), 1)


def test_regression_topk_zero_dim_logits_rejected():
    """Regression (was a bug in the host build_trees / topk_logprobs, python/kdtree/core, topk_logprobs): the ``x.ndim < 1`` check was dead code,
    because ``np.ascontiguousarray`` (in _float_array) returns at least a 1-D array. A scalar
    is silently treated as one row of vocabulary 1:

        kdtree.topk_logprobs(np.float32(1.0), 1)   # -> (array([0.]), array([0])), no error

    The docstring asks for ``[..., V]``; the reference raises ValueError for 0-d logits."""
    with raises(ValueError, "dimension"):
        kdtree.topk_logprobs(np.float32(1.0), 1)


def test_error_messages_are_per_thread():
    """kdt_last_error is thread-local and ctypes releases the GIL during calls: threads
    failing at different places at the same time each get their own message, and valid
    builds running alongside are unaffected."""
    import threading

    lp_ok, ids_ok = _varied_draft(batch=4, depth=8, width=8)
    want = kdtree.build_trees(lp_ok, ids_ok, 200)
    problems: list[str] = []

    def worker(k: int) -> None:
        lp, ids = good()
        lp[k % B, k % L, 1 + k % (K - 1)] = np.nan
        where = f"request {k % B}, depth {k % L + 1}, rank {1 + k % (K - 1)}"
        for _ in range(150):
            try:
                kdtree.build_trees(lp, ids, 8)
                problems.append(f"thread {k}: no error")
            except KdtreeError as err:
                if where not in str(err):
                    problems.append(f"thread {k}: {err} (expected {where})")
            got = kdtree.build_trees(lp_ok, ids_ok, 200)
            if got.logw.tobytes() != want.logw.tobytes() or got.tokens.tobytes() != want.tokens.tobytes():
                problems.append(f"thread {k}: a concurrent valid build differs")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not problems, problems[:5]


# ---- Target logits of the walk (host verify from logits) --------------------------------


def _two_request_trees():
    """Two requests, tree tokens 10..14 (no token 0): the walk from an all -inf root row
    (argmax token 0) accepts nothing."""
    lp, ids = good()
    return kdtree.build_trees(lp[:2], ids[:2], 6)


def test_nan_target_logit_is_named_where_the_walk_meets_it():
    trees = _two_request_trees()
    x = np.zeros((2, 7, 20), np.float32)
    x[1, 0, 3] = np.nan
    where = "request 1, node 0: target_logits[1, 0] holds a NaN logit"
    with raises(KdtreeError, where, status="KDT_ERR_VALUE"):
        kdtree.verify_greedy_from_logits(trees, x)
    with raises(KdtreeError, "target_logits[1, 0] holds a NaN logit", status="KDT_ERR_VALUE"):
        kdtree.verify_sample_from_logits(trees, x, 1.0, seed=1, offset=0)


def test_rows_without_a_draw_are_named_for_sampling():
    trees = _two_request_trees()
    x = np.zeros((2, 7, 20), np.float32)
    x[0, 0, :] = -np.inf
    with raises(KdtreeError, "request 0, node 0: target_logits[0, 0] holds only -inf logits"):
        kdtree.verify_sample_from_logits(trees, x, 1.0, seed=1, offset=0)
    x[0, 0, :] = 0.0
    x[0, 0, 5] = np.inf
    with raises(KdtreeError, "target_logits[0, 0] holds a +inf logit"):
        kdtree.verify_sample_from_logits(trees, x, 1.0, seed=1, offset=0)


def test_infinite_target_logits_are_ordinary_values_for_the_argmax():
    trees = _two_request_trees()
    x = np.zeros((2, 7, 20), np.float32)
    x[0, 0, :] = -np.inf  # request 0: every value equal, token 0 (lowest id), not a child
    x[1, 0, 7] = np.inf   # request 1: +inf at 7 and 12, the lower id (7, no child) wins
    x[1, 0, 12] = np.inf
    acc = kdtree.verify_greedy_from_logits(trees, x)
    assert acc.accept_length.tolist() == [0, 0]
    assert acc.bonus_token.tolist() == [0, 7]


def test_compact_kv_single_array_for_the_layers():
    trees = kdtree.build_trees(np.log(np.full((1, 2, 3), 1 / 3, np.float32)), np.arange(6).reshape(1, 2, 3), 4)
    acc = kdtree.verify_greedy(trees, np.zeros((1, 5), np.int32))
    k = np.zeros((1, 2, 20, 4), np.float32)
    with raises(TypeError, "k_layers", "sequence of per-layer", "4-D ndarray", "(1, 2, 20, 4)", "[tensor]"):
        kdtree.compact_kv(k, [k.copy()], [3], acc)
    with raises(TypeError, "v_layers", "sequence of per-layer"):
        kdtree.compact_kv([k], k.copy(), [3], acc)


def test_out_of_another_shape_names_the_shapes():
    lp, ids = good()
    out = kdtree.build_trees(lp, ids, 4)
    with raises(ValueError, "out.tokens", "int32 of shape (3, 9)", "int32 of shape (3, 5)", "empty_trees"):
        kdtree.build_trees(lp, ids, 8, out=out)
