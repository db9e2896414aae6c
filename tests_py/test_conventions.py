"""One convention for results, statuses and errors across the core API (host paths), and
the Python layer's resistance to inputs that once corrupted memory or allocated without
bound. Expected values come from the pure-Python reference (kdtree.reference), from
separate per-request calls, or are worked out by hand here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import kdtree
from kdtree import _native, reference
from kdtree.core import memory

pytestmark = pytest.mark.usefixtures("lib")

ROOT = Path(__file__).resolve().parents[1]
STATUS = _native.STATUS
FIELDS = ("num_nodes", "tokens", "depths", "parents", "logw", "positions", "visibility", "visibility_bits",
          "first_child", "next_sibling")


def random_draft(batch: int, depth: int, width: int, seed: int):
    """Sorted top-K log-probs with distinct ids per row (the builder's input contract)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(width * 2), size=(batch, depth))[..., :width]
    lp = np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32)
    ids = np.stack([[rng.permutation(1000)[:width] for _ in range(depth)] for _ in range(batch)]).astype(np.int32)
    return np.ascontiguousarray(lp), ids


def assert_trees_equal(got, want, b_got: int, b_want: int = 0):
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(got, name)[b_got], getattr(want, name)[b_want], err_msg=name)


# ---- the mirrored tables ------------------------------------------------------------------


def header_enum(prefix: str) -> dict[str, int]:
    text = (ROOT / "include" / "kdtree.h").read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"\b({prefix}[A-Z0-9_]+) = (\d+)", text)}


def test_dtype_mask_and_field_codes_match_the_header():
    dtypes = header_enum("KDT_DTYPE_")
    assert {f"KDT_DTYPE_{k.upper()}": v for k, v in _native.DTYPE_CODES.items()} == dtypes
    masks = header_enum("KDT_MASK_")
    assert {f"KDT_MASK_{k.upper()}": v for k, v in _native.MASK_CODES.items()} == masks
    fields = header_enum("KDT_FIELD_")
    assert {f"KDT_FIELD_{k.upper()}": v for k, v in _native.FIELD_CODES.items()} == fields
    assert list(_native.FIELD_CODES) == list(kdtree.core.types.TREE_FIELDS)  # kdt_trees order


# ---- one shape of result, whatever errors= is ----------------------------------------------


@pytest.mark.parametrize("errors", ["raise", "status"])
def test_every_function_returns_the_same_shape_of_result(errors):
    lp, ids = random_draft(3, 4, 5, seed=1)
    logits = np.random.default_rng(2).standard_normal((3, 4, 50)).astype(np.float32)
    top = kdtree.topk_logprobs(logits, 5, errors=errors)
    assert isinstance(top, kdtree.TopK) and len(top) == 2
    assert top.row_status.shape == (3, 4) and top.row_status.dtype == np.int32 and not top.row_status.any()
    t = kdtree.build_trees(lp, ids, 9, errors=errors)
    assert t.request_status.tolist() == [0, 0, 0]
    masks = kdtree.tree_attention_mask(t, [3, 0, 7], errors=errors)
    assert isinstance(masks, kdtree.TreeMask) and len(masks) == 3 and masks.request_status.tolist() == [0, 0, 0]
    assert masks.mask is masks[0] and masks.positions is masks[2]
    acc = kdtree.verify_greedy(t, np.zeros((3, 10), np.int32), errors=errors)
    assert acc.request_status.tolist() == [0, 0, 0]
    k = np.zeros((3, 1, 30, 2), np.float32)
    assert kdtree.compact_kv([k], None, [3, 0, 7], acc, errors=errors).tolist() == [0, 0, 0]


def test_errors_must_be_raise_or_status():
    with pytest.raises(kdtree.KdtreeError, match='errors must be "raise" or "status"') as info:
        kdtree.topk_logprobs(np.zeros((1, 4), np.float32), 2, errors="ignore")
    assert info.value.status == STATUS["KDT_ERR_INVALID_ARGUMENT"]


# ---- errors="status" on the host: per request, as the GPU kernels ----------------------------


def test_build_status_mode_gives_the_bad_request_a_root_only_tree():
    lp, ids = random_draft(3, 4, 5, seed=3)
    lp[1, 2, 3] = np.nan
    with pytest.raises(kdtree.KdtreeError, match="request 1, depth 3, rank 3") as info:
        kdtree.build_trees(lp, ids, 12, root_tokens=[5, 6, 7], root_positions=[10, 20, 30])
    assert info.value.status == STATUS["KDT_ERR_VALUE"]
    t = kdtree.build_trees(lp, ids, 12, root_tokens=[5, 6, 7], root_positions=[10, 20, 30], errors="status")
    assert t.request_status.tolist() == [0, STATUS["KDT_ERR_VALUE"], 0]
    for b in (0, 2):
        want = reference.build_trees(lp[b:b + 1], ids[b:b + 1], 12, root_tokens=[5 + b],
                                     root_positions=[10 + 10 * b])
        assert_trees_equal(t, want, b)
    # the failed request: root only (its root token and position), every other row padding
    assert t.num_nodes[1] == 0
    assert t.tokens[1].tolist() == [6] + [-1] * 12
    assert t.parents[1].tolist() == [-1] * 13 and t.depths[1].tolist() == [0] * 13
    assert t.positions[1].tolist() == [20] * 13
    assert t.logw[1, 0] == 0.0 and np.isneginf(t.logw[1, 1:]).all()
    np.testing.assert_array_equal(t.visibility[1], np.eye(13, dtype=bool))
    assert (t.first_child[1] == -1).all() and (t.next_sibling[1] == -1).all()


def test_build_status_mode_replaces_an_out_of_range_root():
    lp, ids = random_draft(2, 3, 4, seed=4)
    t = kdtree.build_trees(lp, ids, 5, root_tokens=[3, 5000], root_positions=[4, -2], vocab_size=1000,
                           pad_token=-9, errors="status")
    assert t.request_status.tolist() == [0, STATUS["KDT_ERR_OUT_OF_RANGE"]]
    assert t.tokens[1, 0] == -9 and t.positions[1, 0] == 0 and t.num_nodes[1] == 0


def test_verify_status_mode_isolates_the_failed_request():
    lp, ids = random_draft(2, 4, 3, seed=5)
    t = kdtree.build_trees(lp, ids, 8)
    target = np.where(t.first_child >= 0, np.take_along_axis(t.tokens, np.maximum(t.first_child, 0), 1), 9)
    target = target.astype(np.int32)
    target[0, 0] = -4  # the root is always visited: a negative target token there fails request 0
    with pytest.raises(kdtree.KdtreeError, match="request 0, node 0") as info:
        kdtree.verify_greedy(t, target)
    assert info.value.status == STATUS["KDT_ERR_VALUE"]
    acc = kdtree.verify_greedy(t, target, errors="status")
    assert acc.request_status.tolist() == [STATUS["KDT_ERR_VALUE"], 0]
    assert (acc.accepted_nodes[0] == -1).all() and acc.accept_length[0] == 0 and acc.bonus_token[0] == -1
    fixed = target.copy()
    fixed[0, 0] = 0
    want = reference.verify_greedy(t, fixed)
    assert acc.accept_length[1] == want.accept_length[1] and acc.bonus_token[1] == want.bonus_token[1]
    np.testing.assert_array_equal(acc.accepted_nodes[1], want.accepted_nodes[1][: acc.accepted_nodes.shape[1]])


def test_topk_status_mode_marks_the_bad_row():
    x = np.random.default_rng(6).standard_normal((2, 3, 40)).astype(np.float32)
    x[1, 2, 17] = np.inf
    with pytest.raises(kdtree.KdtreeError, match=r"request 1, position 2"):
        kdtree.topk_logprobs(x, 4)
    top = kdtree.topk_logprobs(x, 4, errors="status")
    want = np.zeros((2, 3), np.int32)
    want[1, 2] = STATUS["KDT_ERR_VALUE"]
    np.testing.assert_array_equal(top.row_status, want)
    assert np.isnan(top.logprobs[1, 2]).all() and top.ids[1, 2].tolist() == [0, 1, 2, 3]
    ref_lp, ref_ids = reference.topk_logprobs(x[0], 4)
    np.testing.assert_array_equal(top.ids[0], ref_ids)
    np.testing.assert_allclose(top.logprobs[0], ref_lp, rtol=0, atol=1e-6)


def test_mask_status_mode_hides_the_bad_request():
    lp, ids = random_draft(2, 3, 2, seed=7)
    t = kdtree.build_trees(lp, ids, 4)
    with pytest.raises(kdtree.KdtreeError, match="request 0: prefix_lengths\\[0\\] = -3") as info:
        kdtree.tree_attention_mask(t, [-3, 2])
    assert info.value.status == STATUS["KDT_ERR_OUT_OF_RANGE"]
    masks = kdtree.tree_attention_mask(t, [-3, 2], errors="status")
    assert masks.request_status.tolist() == [STATUS["KDT_ERR_OUT_OF_RANGE"], 0]
    assert not masks.mask[0].any() and (masks.positions[0] == 0).all()
    alone = kdtree.tree_attention_mask(t, [2, 2], columns=masks.mask.shape[2])
    np.testing.assert_array_equal(masks.mask[1], alone.mask[1])
    np.testing.assert_array_equal(masks.positions[1], alone.positions[1])


def test_compact_status_mode_leaves_the_bad_request_untouched():
    cache = np.arange(2 * 1 * 8 * 2, dtype=np.float32).reshape(2, 1, 8, 2)
    before = cache.copy()
    acc = kdtree.Acceptance(np.array([[1, 2, -1], [0, 2, 3]], np.int32), np.array([1, 2], np.int32),
                            np.zeros(2, np.int32))
    status = kdtree.compact_kv([cache], None, [1, 1], acc, errors="status")
    assert status.tolist() == [STATUS["KDT_ERR_VALUE"], 0]
    np.testing.assert_array_equal(cache[0], before[0])
    want = before[1].copy()
    want[:, 2], want[:, 3] = before[1][:, 3], before[1][:, 4]  # rows p + 2 -> p + 1, p + 3 -> p + 2
    np.testing.assert_array_equal(cache[1], want)


# ---- every check raises KdtreeError with a status ------------------------------------------


def test_python_checks_carry_a_status():
    lp, ids = random_draft(1, 2, 3, seed=8)
    with pytest.raises(kdtree.KdtreeError) as info:
        kdtree.build_trees(lp, ids[:, :1], 4)
    assert info.value.status == STATUS["KDT_ERR_SHAPE"] and info.value.function == ""
    with pytest.raises(TypeError) as info:
        kdtree.build_trees(lp.astype(np.int32), ids, 4)
    assert isinstance(info.value, kdtree.KdtreeTypeError) and isinstance(info.value, kdtree.KdtreeError)
    assert info.value.status == STATUS["KDT_ERR_INVALID_ARGUMENT"]
    with pytest.raises(kdtree.KdtreeError) as info:
        kdtree.build_trees(lp, ids, -1)
    assert info.value.status == STATUS["KDT_ERR_OUT_OF_RANGE"]


# ---- hardening ----------------------------------------------------------------------------


def test_out_arrays_whose_buffer_moved_are_written_where_they_are_now():
    lp, ids = random_draft(2, 3, 4, seed=9)
    want = reference.build_trees(lp, ids, 6)
    out = kdtree.build_trees(lp, ids, 6)
    moved = 0
    for name in FIELDS:
        a = getattr(out, name)
        shape, old = a.shape, a.ctypes.data
        a.resize((a.size * 64,), refcheck=False)  # realloc: the buffer moves
        a.resize(shape, refcheck=False)
        a[...] = 0
        moved += a.ctypes.data != old
    assert moved, "no buffer moved: the test proves nothing on this allocator"
    kdtree.build_trees(lp, ids, 6, out=out)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(out, name), getattr(want, name), err_msg=name)


class FakeAddress(np.ndarray):
    """An ndarray whose __array_interface__ lies about its data address."""

    @property
    def __array_interface__(self):
        d = dict(np.asarray(self).__array_interface__)
        d["data"] = (8, False)
        return d


def test_an_ndarray_subclass_cannot_hand_c_a_fake_address():
    lp, ids = random_draft(1, 3, 3, seed=10)
    out = kdtree.empty_trees(1, 5, 3)
    out.tokens = out.tokens.view(FakeAddress)
    kdtree.build_trees(lp, ids, 5, out=out)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference.build_trees(lp, ids, 5).tokens)


def test_aliased_out_fields_are_refused():
    lp, ids = random_draft(1, 3, 3, seed=11)
    out = kdtree.empty_trees(1, 5, 3)
    out.first_child = out.next_sibling
    with pytest.raises(kdtree.KdtreeError, match="out.first_child and out.next_sibling share memory"):
        kdtree.build_trees(lp, ids, 5, out=out)
    out = kdtree.empty_trees(1, 5, 3)
    out.depths = out.tokens[:, :].view(np.int32)
    with pytest.raises(kdtree.KdtreeError, match="share memory"):
        kdtree.build_trees(lp, ids, 5, out=out)


def test_the_accepted_path_is_sized_by_what_a_tree_can_hold():
    depth = 2**31 - 2
    lp = np.zeros((2, depth, 0), np.float32)  # a zero-size draft of a huge depth
    t = kdtree.build_trees(lp, np.zeros((2, depth, 0), np.int32), 4)
    acc = kdtree.verify_greedy(t, np.zeros((2, 5), np.int32))
    assert acc.accepted_nodes.shape == (2, 5)  # min(depth, budget) + 1
    assert acc.accept_length.tolist() == [0, 0] and acc.accepted_nodes[:, 0].tolist() == [0, 0]
    lp, ids = random_draft(1, 3, 4, seed=12)
    t = kdtree.build_trees(lp, ids, 50)
    assert kdtree.verify_greedy(t, np.zeros((1, 51), np.int32)).accepted_nodes.shape == (1, 4)


def test_hand_built_trees_get_kdtree_messages():
    lp, ids = random_draft(1, 2, 2, seed=13)
    t = kdtree.build_trees(lp, ids, 3)
    t.depth = -1
    with pytest.raises(kdtree.KdtreeError, match=r"trees.depth must be in \[0, "):
        kdtree.verify_greedy(t, np.zeros((1, 4), np.int32))
    t = kdtree.build_trees(lp, ids, 3)
    t.tokens = t.tokens.tolist()
    with pytest.raises(kdtree.KdtreeError, match="trees.tokens must be a C-contiguous int32 array"):
        kdtree.verify_greedy(t, np.zeros((1, 4), np.int32))


def test_memory_guard_uses_the_memory_available(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**30)
    with pytest.raises(MemoryError) as info:
        kdtree.empty_trees(2, 40_000, 4)  # 2 x 40,001^2 bytes of dense mask: 3.0 GiB
    assert isinstance(info.value, kdtree.KdtreeMemoryError)
    assert info.value.status == STATUS["KDT_ERR_OUT_OF_MEMORY"]
    assert "budget 40000" in str(info.value) and "1.0 GiB" in str(info.value) and "GiB" in str(info.value)
    kdtree.empty_trees(2, 1000, 4)  # 2 MB: fine


def test_available_bytes_reads_memavailable():
    text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    if not found:
        pytest.skip("no MemAvailable in /proc/meminfo on this system")
    got = memory.available_bytes()
    assert got is not None and got <= int(found.group(1)) * 1024 * 1.05


@pytest.mark.parametrize("dtype", [np.float64, np.int16, np.int32, np.uint64, np.bool_])
def test_cpu_compaction_accepts_the_gpu_dtypes_only(dtype):
    # float16 / bfloat16 / float32 and one-byte types (fp8, int8, uint8: moved as bytes).
    cache = np.zeros((1, 1, 4, 2), dtype)
    acc = kdtree.Acceptance(np.array([[0, 1]], np.int32), np.array([1], np.int32), np.zeros(1, np.int32))
    with pytest.raises(TypeError, match="float16, bfloat16, float32, or one byte"):
        kdtree.compact_kv([cache], None, [0], acc)


def test_root_positions_can_be_checked_against_prefix_lengths():
    lp, ids = random_draft(2, 3, 2, seed=14)
    t = kdtree.build_trees(lp, ids, 4, root_positions=[4, 40])
    kdtree.tree_attention_mask(t, [4, 40], check_positions=True)  # consistent: no error
    masks = kdtree.tree_attention_mask(t, [4, 41])  # unchecked: the caller's prefix wins
    assert masks.positions[1, 0] == 41
    with pytest.raises(kdtree.KdtreeError, match=r"request 1: the tree's root position 40 .* prefix length 41") as e:
        kdtree.tree_attention_mask(t, [4, 41], check_positions=True)
    assert e.value.status == STATUS["KDT_ERR_VALUE"]


def test_library_path_and_cuda_devices():
    import os

    path = kdtree.library_path()
    assert os.path.isfile(path) and os.path.basename(path) == _native.LIBRARY_NAME
    assert kdtree.cuda_devices() >= 0  # 0 here without a GPU; the count where there is one


def small_round():
    lp = np.log(np.array([[[.6, .3], [.5, .4]]] * 2))
    ids = np.array([[[1, 2], [3, 4]]] * 2)
    t = kdtree.build_trees(lp, ids, 4)
    acc = kdtree.verify_greedy(t, np.array([[2, 4, 4, 4, 4]] * 2, np.int32))  # path [0, 3] in both
    return lp, ids, t, acc


def test_compaction_reads_a_generator_of_v_layers_once():
    _, _, _, acc = small_round()
    k = np.arange(32, dtype=np.float32).reshape(2, 1, 8, 2)
    v = k.copy()
    kdtree.compact_kv([k], (x for x in [v]), [0, 0], acc)
    np.testing.assert_array_equal(v, k)  # V moved exactly as K: row 3 -> row 1
    assert k[0, 0, 1].tolist() == [6.0, 7.0]


def test_compaction_refuses_a_read_only_layer_before_moving_any_row():
    _, _, _, acc = small_round()
    k1 = np.arange(32, dtype=np.float32).reshape(2, 1, 8, 2)
    k2 = k1.copy()
    k2.setflags(write=False)
    before = k1.copy()
    with pytest.raises(kdtree.KdtreeError, match=r"k_layers\[1\] is read-only"):
        kdtree.compact_kv([k1, k2], None, [0, 0], acc, errors="status")
    np.testing.assert_array_equal(k1, before)


def test_ragged_lists_are_kdtree_errors():
    _, _, t, _ = small_round()
    with pytest.raises(kdtree.KdtreeError, match="not a rectangular array") as e:
        kdtree.build_trees([[[0.0], [0.0, -1.0]]], [[[1], [1, 2]]], 2)
    assert e.value.status == STATUS["KDT_ERR_SHAPE"]
    with pytest.raises(kdtree.KdtreeError, match="not a rectangular array"):
        kdtree.topk_logprobs([[0.0], [1.0, 2.0]], 1)
    with pytest.raises(kdtree.KdtreeError, match="not a rectangular array"):
        kdtree.tree_attention_mask(t, [[0], [1, 2]])
    with pytest.raises(kdtree.KdtreeError, match="not a rectangular array"):
        kdtree.verify_greedy(t, [[0] * 5, [0] * 4])


def test_hand_built_trees_get_kdtree_messages_in_masks_and_verify():
    import dataclasses

    _, _, t, _ = small_round()
    for field, value in (("visibility", t.visibility[:, :2, :2].copy()), ("depths", t.depths[:, :2].copy()),
                         ("num_nodes", t.num_nodes + 0.5), ("parents", None)):
        with pytest.raises(kdtree.KdtreeError, match=f"trees.{field} must be"):
            kdtree.tree_attention_mask(dataclasses.replace(t, **{field: value}), [0, 0])
    with pytest.raises(kdtree.KdtreeError, match="trees.budget must be an int"):
        kdtree.tree_attention_mask(dataclasses.replace(t, budget=4.0), [0, 0])
    with pytest.raises(kdtree.KdtreeError, match="trees.visibility must be"):
        kdtree.verify_greedy(dataclasses.replace(t, visibility=None), np.zeros((2, 5), np.int32))
    with pytest.raises(kdtree.KdtreeError, match="dtype must be"):
        kdtree.tree_attention_mask(t, [0, 0], kind="additive", dtype=[1])
    lp, ids, _, _ = small_round()
    with pytest.raises(kdtree.KdtreeTypeError, match="out must be a TreeBatch"):
        kdtree.build_trees(lp, ids, 4, out=dict())


def test_no_module_defines_a_top_level_name_twice():
    """A second ``def`` of a module-level name silently replaces the first for every caller,
    including those in code paths CI cannot run (the CUDA wrappers): each module-level
    function and class of the package is defined once."""
    import ast
    twice = []
    for path in sorted((ROOT / "python" / "kdtree").rglob("*.py")):
        seen = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name in seen and node.name != "_":
                    twice.append(f"{path.relative_to(ROOT)}: {node.name} at lines {seen[node.name]} and {node.lineno}")
                seen.setdefault(node.name, node.lineno)
    assert twice == []


def test_status_build_of_an_empty_draft_reports_the_failed_request():
    """K = 0 (or L = 0) drafts hold no entries; a request failing on its root or its limits
    still gets its status and a root-only tree, the others their (root-only) trees."""
    lp, ids = np.zeros((2, 3, 0), np.float32), np.zeros((2, 3, 0), np.int32)
    trees = kdtree.build_trees(lp, ids, 4, root_tokens=np.array([-1, 5], np.int32), errors="status")
    assert trees.request_status.tolist() == [STATUS["KDT_ERR_OUT_OF_RANGE"], 0]
    assert trees.num_nodes.tolist() == [0, 0] and trees.tokens[:, 0].tolist() == [-1, 5]
    trees = kdtree.build_trees(np.zeros((2, 0, 3), np.float32), np.zeros((2, 0, 3), np.int32), 4,
                               request_budgets=[0, 99], errors="status")
    assert trees.request_status.tolist() == [0, STATUS["KDT_ERR_OUT_OF_RANGE"]]


def test_compaction_refuses_a_layer_that_overlaps_itself_or_another():
    acc = kdtree.Acceptance(np.array([[0, 2], [0, -1]], np.int32), np.array([1, 0], np.int32),
                            np.array([3, 3], np.int32))
    cache = np.zeros((2, 2, 30, 8), np.float32)
    shared = np.broadcast_to(np.zeros((1, 2, 30, 8), np.float32), (2, 2, 30, 8))
    with pytest.raises(kdtree.KdtreeError, match="read-only|overlaps itself"):
        kdtree.compact_kv([shared], [cache], np.array([0, 1]), acc)
    with pytest.raises(kdtree.KdtreeError, match="distinct"):  # two views of one array
        kdtree.compact_kv([cache], [cache[:]], np.array([0, 1]), acc)
    torch = pytest.importorskip("torch")
    expanded = torch.zeros(1, 2, 30, 8).expand(2, 2, 30, 8)  # writable, zero batch stride
    with pytest.raises(kdtree.KdtreeError, match=r"k_layers\[0\] overlaps itself"):
        kdtree.compact_kv([expanded], [torch.zeros(2, 2, 30, 8)], np.array([0, 1]), acc)
