"""Inputs crafted against the implementation (white-box): token ids that collide in the
duplicate-id hash set, huge budgets with tiny drafts, outputs aliasing inputs, stale
TreeBatch metadata. Each must give the reference's answer, quickly and without
over-allocating."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kdtree
from kdtree import _native as _lib
from kdtree import reference as ref
from kdtree.core.types import TREE_FIELDS

pytestmark = pytest.mark.usefixtures("lib")


def _mix(ids: np.ndarray) -> np.ndarray:
    """The library's id mixer (splitmix64's finaliser), to aim ids at one hash slot."""
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def colliding_ids(width: int) -> np.ndarray:
    """`width` distinct ids whose hash slots (table of >= 4*width slots) are all equal."""
    slots = 1
    while slots < 4 * width:
        slots *= 2
    shift = np.uint64(64 - (slots.bit_length() - 1))
    cand = np.arange(1, 1 << 22, dtype=np.int64)
    top = _mix(cand) >> shift
    target = np.bincount(top.astype(np.int64)).argmax()
    picked = cand[top == target][:width]
    assert picked.size == width
    return picked.astype(np.int32)


def _draft(row_ids: np.ndarray, depth: int = 3):
    width = row_ids.size
    lp = np.tile(np.linspace(-0.1, -9.0, width, dtype=np.float32), (depth, 1))
    ids = np.tile(row_ids, (depth, 1))
    return lp, ids


def test_colliding_ids_build_the_reference_tree():
    row = colliding_ids(512)
    lp, ids = _draft(row)
    got, want = kdtree.build_trees(lp, ids, 700), ref.build_trees(lp, ids, 700)
    for f in TREE_FIELDS:
        assert np.array_equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.parametrize("bad", ["duplicate", "negative"])
def test_colliding_ids_report_the_first_bad_rank(bad):
    row = colliding_ids(512)
    row[300] = row[17] if bad == "duplicate" else -5  # the first bad rank
    row[400] = row[3]  # a later duplicate
    lp, ids = _draft(row)
    with pytest.raises(kdtree.KdtreeError) as native:
        kdtree.build_trees(lp, ids, 600)  # K' = 512: every rank is checked
    with pytest.raises(ValueError) as reference:
        ref.build_trees(lp, ids, 600)
    for err in (native, reference):
        assert "request 0, depth 1, rank 300" in str(err.value)


def test_huge_budget_with_a_tiny_draft_sizes_scratch_by_the_draft():
    lib = _lib.load()
    size = ctypes.c_size_t()
    lib.kdt_trees_build_workspace_bytes(1 << 30, 1, 1, 0, ctypes.byref(size))
    assert size.value < 4096  # one node can exist: not gigabytes
    lib.kdt_trees_build_workspace_bytes(1 << 30, 2, 3, 0, ctypes.byref(size))
    assert size.value < 4096  # 3 + 9 nodes at most
    # And the build itself (only num_nodes requested, no N^2 outputs).
    lp = np.array([[[-0.5, -1.0, -2.0]], [[-0.1, -0.2, -0.3]]], np.float32).reshape(1, 2, 3)
    ids = np.array([[[1, 2, 3], [4, 5, 6]]], np.int32)
    num = np.zeros(1, np.int32)
    draft = _lib.KdtDraft(1, 2, 3, lp.ctypes.data, ids.ctypes.data, None, None, 0, -1)
    trees = _lib.KdtTrees(1, 1 << 30, num.ctypes.data, *([None] * 9))
    lib.kdt_trees_build_cpu(ctypes.byref(draft), ctypes.byref(trees), None, 0)
    assert num[0] == 12


def test_out_aliasing_an_input_gives_the_reference_tree():
    lp = np.full((1, 1, 5), -1.0, np.float32)
    lp[..., 0] = -0.5
    out = kdtree.empty_trees(1, 4, 1)
    ids_view = out.tokens.reshape(1, 1, 5)  # the output's own memory as the ids input
    ids_view[...] = [10, 11, 12, 13, 14]
    want = ref.build_trees(lp, ids_view.copy(), 4)
    got = kdtree.build_trees(lp, ids_view, 4, out=out)
    assert np.array_equal(got.tokens, want.tokens)


def test_stale_out_budget_cannot_overflow():
    lp = np.full((1, 3, 4), -1.0, np.float32)
    ids = np.arange(12, dtype=np.int32).reshape(1, 3, 4)
    out = kdtree.empty_trees(1, 4, 3)
    out.budget = 2000  # metadata that disagrees with the arrays
    got = kdtree.build_trees(lp, ids, 4, out=out)
    want = ref.build_trees(lp, ids, 4)
    assert got.budget == 4
    assert np.array_equal(got.tokens, want.tokens)
