"""kdtree.torch_ops: the round's calls as torch custom operators. Each op's result equals
the function it wraps on the same inputs; torch.library.opcheck checks the schemas and the
fake (shape) implementations; and a round (top-k, build, greedy verify, KV compaction)
compiled with fullgraph=True, which fails on any graph break, gives the eager round's
values. CPU tensors, then CUDA tensors (where a GPU is present) through the C++ CUDA
kernels of libkdtree_torch when it is built (CI builds it and checks that it loads), else
the Python ones.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kdtree

torch = pytest.importorskip("torch")
if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    pytest.skip("torch.library.custom_op needs torch >= 2.4", allow_module_level=True)
ops = pytest.importorskip("kdtree.torch_ops")


def round_inputs(seed=0, batch=3, depth=4, vocab=50, width=4, budget=9):
    g = torch.Generator().manual_seed(seed)
    drafter = torch.randn(batch, depth, vocab, generator=g) * 3
    roots = torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32)
    positions = torch.tensor([5, 0, 11], dtype=torch.int64)[:batch]
    # The target agrees with the drafter's best child at every node, so the walk accepts
    # nodes and the compaction moves rows.
    lp, ids = kdtree.topk_logprobs(drafter.numpy(), width)
    trees = kdtree.build_trees(lp, ids, budget, root_tokens=roots.numpy(), root_positions=positions.numpy())
    target = torch.randn(batch, budget + 1, vocab, generator=g)
    for b in range(batch):
        for i in range(budget + 1):
            child = trees.first_child[b, i]
            if child >= 0:
                target[b, i, trees.tokens[b, child]] = 10.0
    return drafter, roots, positions, target, width, budget


def test_ops_equal_the_functions_they_wrap():
    drafter, roots, positions, target, width, budget = round_inputs()
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    want = kdtree.topk_logprobs(drafter.numpy(), width)
    assert np.array_equal(lp.numpy(), want.logprobs) and np.array_equal(ids.numpy(), want.ids)

    fields = torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1)
    trees = kdtree.build_trees(want.logprobs, want.ids, budget, root_tokens=roots.numpy(),
                               root_positions=positions.numpy())
    for name, got in zip(kdtree.core.types.TREE_FIELDS, fields, strict=True):
        assert np.array_equal(got.numpy(), getattr(trees, name)), name

    nodes, length, bonus = torch.ops.kdtree.verify_greedy_from_logits(list(fields), budget, trees.depth, target,
                                                                      [7], None)
    acc = kdtree.verify_greedy_from_logits(trees, target.numpy(), stop_tokens=[7])
    assert np.array_equal(nodes.numpy(), acc.accepted_nodes)
    assert np.array_equal(length.numpy(), acc.accept_length)
    assert np.array_equal(bonus.numpy(), acc.bonus_token)


@pytest.mark.parametrize("budget", [9, 2])  # (2: a budget below the depth, 4)
def test_opcheck_schemas_and_fake_shapes(budget):
    drafter, roots, positions, target, width, _ = round_inputs(1, budget=budget)
    torch.library.opcheck(torch.ops.kdtree.topk_logprobs.default, (drafter, width))
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    torch.library.opcheck(torch.ops.kdtree.build_trees.default, (lp, ids, budget, roots, positions, -1))
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions))
    torch.library.opcheck(torch.ops.kdtree.verify_greedy_from_logits.default,
                          (fields, budget, drafter.shape[1], target, [], torch.tensor([1, 5, 0])))


def one_round(drafter, roots, positions, target, k_cache, v_cache, width: int, budget: int):
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    fields = torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1)
    nodes, length, bonus = torch.ops.kdtree.verify_greedy_from_logits(list(fields), budget, drafter.shape[1], target,
                                                                      [], None)
    torch.ops.kdtree.compact_kv([k_cache], [v_cache], positions, nodes, length, bonus)
    return fields[1], nodes, length, bonus


def test_a_compiled_round_has_no_graph_break_and_matches_eager():
    drafter, roots, positions, target, width, budget = round_inputs(2)
    seq = 40
    k0 = torch.randn(3, 2, seq, 8)
    v0 = torch.randn(3, 2, seq, 8)
    k1, v1 = k0.clone(), v0.clone()
    want = one_round(drafter, roots, positions, target, k0, v0, width, budget)
    assert int(want[2].sum()) > 0  # nodes were accepted, so the compaction moved rows
    compiled = torch.compile(one_round, fullgraph=True, backend="aot_eager")
    got = compiled(drafter, roots, positions, target, k1, v1, width, budget)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)


def test_compact_kv_op_moves_the_rows_the_function_moves():
    drafter, roots, positions, target, width, budget = round_inputs(3)
    k = torch.randn(3, 2, 40, 8)
    v = torch.randn(3, 2, 40, 8)
    lp, ids = kdtree.topk_logprobs(drafter.numpy(), width)
    trees = kdtree.build_trees(lp, ids, budget, root_tokens=roots.numpy(), root_positions=positions.numpy())
    acc = kdtree.verify_greedy_from_logits(trees, target.numpy())
    assert int(acc.accept_length.sum()) > 0  # (rows do move)
    kn, vn = k.numpy().copy(), v.numpy().copy()
    kdtree.compact_kv([kn], [vn], positions.numpy(), acc)
    torch.ops.kdtree.compact_kv([k], [v], positions, torch.from_numpy(acc.accepted_nodes),
                                torch.from_numpy(acc.accept_length), torch.from_numpy(acc.bonus_token))
    assert np.array_equal(k.numpy(), kn) and np.array_equal(v.numpy(), vn)
    # bfloat16 and one-byte caches (no numpy view): the same moves as on float32, bit for bit
    acc_t = (torch.from_numpy(acc.accepted_nodes), torch.from_numpy(acc.accept_length),
             torch.from_numpy(acc.bonus_token))
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        src = torch.randn(3, 2, 40, 8)
        kq, vq = src.to(dtype), (src * 2).to(dtype)
        same = torch.float16 if dtype == torch.bfloat16 else torch.uint8  # a view of the same bytes numpy has
        want_k, want_v = kq.view(same).numpy().copy(), vq.view(same).numpy().copy()
        kdtree.compact_kv([want_k], [want_v], positions.numpy(), acc)  # the same moves on those views
        torch.ops.kdtree.compact_kv([kq], [vq], positions, *acc_t)
        got_k, got_v = kq.view(same).numpy(), vq.view(same).numpy()
        assert got_k.tobytes() == want_k.tobytes() and got_v.tobytes() == want_v.tobytes(), dtype
    # the function's own checks hold through the operator: one tensor as keys and values
    with pytest.raises(kdtree.KdtreeError, match="distinct"):
        torch.ops.kdtree.compact_kv([k], [k], positions, *acc_t)


def test_request_limits_and_ragged_ops():
    drafter, roots, positions, target, width, budget = round_inputs(3)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    budgets, depths = torch.tensor([9, 0, 4], dtype=torch.int32), torch.tensor([4, 4, 2], dtype=torch.int32)
    fields = torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1, budgets, depths)
    trees = kdtree.build_trees(lp.numpy(), ids.numpy(), budget, root_tokens=roots.numpy(),
                               root_positions=positions.numpy(), request_budgets=budgets.numpy(),
                               request_depths=depths.numpy())
    for name, got in zip(kdtree.core.types.TREE_FIELDS, fields, strict=True):
        assert np.array_equal(got.numpy(), getattr(trees, name)), name
    assert trees.num_nodes.tolist()[1] == 0 and trees.depths[2].max() <= 2
    torch.library.opcheck(torch.ops.kdtree.build_trees.default, (lp, ids, budget, roots, positions, -1, budgets,
                                                                  depths))
    packed = torch.ops.kdtree.ragged_trees(list(fields), budget, drafter.shape[1])
    want = kdtree.ragged_trees(trees)
    names = ("cu_rows", "row_request", "row_node", "tokens", "depths", "parents", "positions", "visibility_bits")
    for name, got in zip(names, packed, strict=True):
        assert np.array_equal(got.numpy(), getattr(want, name)), name
    torch.library.opcheck(torch.ops.kdtree.ragged_trees.default, (list(fields), budget, drafter.shape[1]))


def test_malformed_tree_fields_are_named():
    drafter, roots, positions, target, width, budget = round_inputs(9)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1))
    for bad in (fields[:9], []):
        with pytest.raises(kdtree.KdtreeError, match="the 10 tree fields"):
            torch.ops.kdtree.verify_greedy_from_logits(bad, budget, 4, target, [], None)
        with pytest.raises(kdtree.KdtreeError, match="the 10 tree fields"):
            torch.ops.kdtree.ragged_trees(bad, budget, 4)
    with pytest.raises(kdtree.KdtreeError, match=r"num_nodes\) must be \[B\]"):
        torch.ops.kdtree.verify_greedy_from_logits([fields[0][0]] + fields[1:], budget, 4, target, [], None)


def _sampling_settings(batch, device="cpu"):
    return dict(temperature=torch.tensor([0.8, 0.0, 1.3][:batch], device=device),
                seed=torch.tensor([5, 6, 7][:batch], device=device),
                offset=torch.tensor([0, 1, 2][:batch], device=device),
                top_p=torch.tensor([0.9, 1.0, 0.5][:batch], device=device),
                top_k=torch.tensor([0, 3, 5][:batch], dtype=torch.int32, device=device))


def test_sampled_verify_and_mask_ops_equal_the_functions():
    """The sampled verify (per-request temperature, seed, offset, top-p, top-k as tensors)
    and the dense tree attention masks as operators: the functions' values, opcheck's
    schema and fake checks, and a compiled round of them without a graph break."""
    drafter, roots, positions, target, width, budget = round_inputs(10)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1))
    trees = ops.tree_batch(fields, budget, drafter.shape[1])
    st = _sampling_settings(3)
    got = torch.ops.kdtree.verify_sample_from_logits(fields, budget, 4, target, st["temperature"], st["seed"],
                                                     st["offset"], st["top_p"], st["top_k"], [7], None)
    want = kdtree.verify_sample_from_logits(trees, target.numpy(), st["temperature"].float().numpy(),
                                            seed=st["seed"].numpy(), offset=st["offset"].numpy(),
                                            top_p=st["top_p"].numpy(), top_k=st["top_k"].numpy(), stop_tokens=[7])
    for a, b in zip(got, (want.accepted_nodes, want.accept_length, want.bonus_token), strict=True):
        assert np.array_equal(a.numpy(), b)
    *same, status = torch.ops.kdtree.verify_sample_from_logits_status(fields, budget, 4, target, st["temperature"],
                                                                      st["seed"], st["offset"], None, None, [], None)
    plain = kdtree.verify_sample_from_logits(trees, target.numpy(), st["temperature"].numpy(), seed=st["seed"].numpy(),
                                             offset=st["offset"].numpy())
    assert np.array_equal(same[0].numpy(), plain.accepted_nodes) and status.tolist() == [0, 0, 0]
    prefix = torch.tensor([5, 0, 11])
    columns = 11 + budget + 1 + 3
    for kind, dtype in (("bool", None), ("bits", None), ("additive", torch.float32), ("additive", torch.bfloat16)):
        mask, pos = torch.ops.kdtree.tree_attention_mask(fields, budget, 4, prefix, kind, columns, dtype)
        ref = kdtree.tree_attention_mask(trees, prefix.numpy(), kind=kind, dtype=dtype or "float32", columns=columns)
        want_mask = ops._tensor(ref.mask)
        assert mask.dtype == want_mask.dtype and torch.equal(mask, want_mask), kind
        assert np.array_equal(pos.numpy(), ref.positions)
        torch.library.opcheck(torch.ops.kdtree.tree_attention_mask.default,
                              (fields, budget, 4, prefix, kind, columns, dtype))
    with pytest.raises(kdtree.KdtreeError, match="flashinfer"):
        torch.ops.kdtree.tree_attention_mask(fields, budget, 4, prefix, "flashinfer", columns)
    with pytest.raises(kdtree.KdtreeError):  # the columns cannot hold requests 0 and 2's prefixes and trees
        torch.ops.kdtree.tree_attention_mask(fields, budget, 4, prefix, "bool", 12)
    mask, pos, status = torch.ops.kdtree.tree_attention_mask_status(fields, budget, 4, prefix, "bool", 12)
    # requests 0 and 2 (5 + 10 and 11 + 10 columns) do not fit 12: hidden whole, status KDT_ERR_OUT_OF_RANGE
    assert status.tolist() == [5, 0, 5] and not bool(mask[0].any()) and not bool(mask[2].any())
    assert bool(mask[1].any())
    torch.library.opcheck(torch.ops.kdtree.verify_sample_from_logits_status.default,
                          (fields, budget, 4, target, st["temperature"], st["seed"], st["offset"], st["top_p"],
                           st["top_k"], [7], torch.tensor([2, 9, 1])))

    def sampled_round(drafter, target, prefix, temperature, seed, offset):
        lp, ids, _ = torch.ops.kdtree.topk_logprobs_status(drafter, width)
        *fields, _ = torch.ops.kdtree.build_trees_status(lp, ids, budget, roots, positions, -1)
        mask, pos, _ = torch.ops.kdtree.tree_attention_mask_status(fields, budget, 4, prefix, "bits", columns)
        out = torch.ops.kdtree.verify_sample_from_logits_status(fields, budget, 4, target, temperature, seed, offset,
                                                                None, None, [], None)
        return (mask, pos, *out)

    args = (drafter, target, prefix, st["temperature"], st["seed"], st["offset"])
    eager = sampled_round(*args)
    compiled = torch.compile(sampled_round, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)


def test_ops_take_trees_built_from_logits_that_track_gradients_and_0d_settings():
    """Drafter logits that require grad (an engine without no_grad) give trees the verify
    operators read as the detached values; on the CPU the sampled verify's settings may be
    0-d tensors (one value for every request), equal to the same values as [B] tensors."""
    drafter, roots, positions, target, width, budget = round_inputs(12)
    w = drafter.clone().requires_grad_()
    lp, ids = torch.ops.kdtree.topk_logprobs(w * 1.0, width)
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1))
    plain = [f.detach() for f in fields]
    got = torch.ops.kdtree.verify_greedy_from_logits(fields, budget, 4, target, [], None)
    want = torch.ops.kdtree.verify_greedy_from_logits(plain, budget, 4, target, [], None)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    one = (torch.tensor(0.7), torch.tensor(11), torch.tensor(3), torch.tensor(0.9), torch.tensor(5, dtype=torch.int32))
    per = [torch.full((3,), float(x), dtype=x.dtype) for x in one]
    a = torch.ops.kdtree.verify_sample_from_logits(fields, budget, 4, target, *one, [], None)
    b = torch.ops.kdtree.verify_sample_from_logits(plain, budget, 4, target, *per, [], None)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    direct = kdtree.verify_sample_from_logits(ops.tree_batch(plain, budget, 4), target.numpy(), 0.7, seed=11,
                                              offset=3, top_p=0.9, top_k=5)
    assert np.array_equal(a[0].numpy(), direct.accepted_nodes)


def test_tree_attention_op_shapes_and_its_cpu_error():
    """The verify forward's attention as an operator: its fake kernel's shapes (meta
    tensors: what torch.compile propagates) and, on CPU tensors, kdtree's error."""
    meta = dict(device="meta")
    q = torch.empty(2, 5, 8, 64, dtype=torch.bfloat16, **meta)
    kv = torch.empty(2, 2, 40, 64, dtype=torch.bfloat16, **meta)
    fields = [torch.empty(2, dtype=torch.int32, **meta)] + [torch.empty(2, 5, **meta)] * 9
    prefix = torch.empty(2, dtype=torch.int64, **meta)
    assert torch.ops.kdtree.tree_attention(q, kv, kv, fields, 4, 3, prefix).shape == (2, 5, 8, 64)
    out, lse, status = torch.ops.kdtree.tree_attention_status(q, kv, kv, fields, 4, 3, prefix)
    assert (out.shape, out.dtype, lse.shape, lse.dtype, status.shape) == ((2, 5, 8, 64), torch.bfloat16, (2, 5, 8),
                                                                          torch.float32, (2,))
    drafter, roots, positions, target, width, budget = round_inputs(12)
    fields = list(torch.ops.kdtree.build_trees(*torch.ops.kdtree.topk_logprobs(drafter, width), budget))
    with pytest.raises(kdtree.KdtreeError, match="runs on the GPU"):
        torch.ops.kdtree.tree_attention(torch.zeros(3, 10, 4, 64), torch.zeros(3, 2, 40, 64), torch.zeros(3, 2, 40, 64),
                                        fields, budget, 4, positions)


def test_build_op_on_one_request_without_a_batch_axis():
    drafter, roots, positions, target, width, budget = round_inputs(4)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter[0], width)  # [L, K]
    fields = torch.ops.kdtree.build_trees(lp, ids, budget)
    assert fields[0].shape == (1,) and fields[1].shape == (1, budget + 1)
    torch.library.opcheck(torch.ops.kdtree.build_trees.default, (lp, ids, budget))


FOUR = ("topk_logprobs", "build_trees", "verify_greedy_from_logits", "compact_kv")
EIGHT = FOUR + tuple(f"{name}_status" for name in FOUR)


def status_round(drafter, roots, positions, target, k_cache, v_cache, width: int, budget: int):
    """One round through the *_status operators (no read-back: capturable)."""
    lp, ids, top_status = torch.ops.kdtree.topk_logprobs_status(drafter, width)
    *fields, build_status = torch.ops.kdtree.build_trees_status(lp, ids, budget, roots, positions, -1)
    nodes, length, bonus, verify_status = torch.ops.kdtree.verify_greedy_from_logits_status(
        fields, budget, drafter.shape[1], target, [], None)
    compact_status = torch.ops.kdtree.compact_kv_status([k_cache], [v_cache], positions, nodes, length, bonus)
    return fields[1], nodes, length, bonus, top_status, build_status, verify_status, compact_status


def test_status_ops_return_the_functions_statuses_instead_of_raising():
    drafter, roots, positions, target, width, budget = round_inputs(7)
    bad = drafter.clone()
    bad[1, 2, 4] = float("nan")
    lp, ids, st = torch.ops.kdtree.topk_logprobs_status(bad, width)
    want = kdtree.topk_logprobs(bad.numpy(), width, errors="status")
    assert st.shape == (3, 4) and st.tolist() == want.row_status.tolist() and int(st[1, 2]) == 4  # KDT_ERR_VALUE
    assert np.array_equal(lp.numpy(), want.logprobs, equal_nan=True) and np.array_equal(ids.numpy(), want.ids)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    bad_lp = lp.clone()
    bad_lp[2, 0, 0] = float("nan")
    *fields, st = torch.ops.kdtree.build_trees_status(bad_lp, ids, budget, roots, positions, -1)
    trees = kdtree.build_trees(bad_lp.numpy(), ids.numpy(), budget, root_tokens=roots.numpy(),
                               root_positions=positions.numpy(), errors="status")
    assert st.tolist() == trees.request_status.tolist() == [0, 0, 4]
    for name, got in zip(kdtree.core.types.TREE_FIELDS, fields, strict=True):
        assert np.array_equal(got.numpy(), getattr(trees, name)), name
    nodes, length, bonus, st = torch.ops.kdtree.verify_greedy_from_logits_status(fields, budget, drafter.shape[1],
                                                                                 target, [], None)
    acc = kdtree.verify_greedy_from_logits(trees, target.numpy(), errors="status")
    assert st.tolist() == acc.request_status.tolist()
    assert np.array_equal(nodes.numpy(), acc.accepted_nodes) and np.array_equal(length.numpy(), acc.accept_length)
    k, v = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    st = torch.ops.kdtree.compact_kv_status([k], [v], torch.tensor([0, -1, 0]), nodes, length, bonus)
    assert st.tolist()[1] == 5 and st.tolist()[0] == 0  # KDT_ERR_OUT_OF_RANGE: a negative prefix
    for op, args in [(torch.ops.kdtree.topk_logprobs_status.default, (drafter, width)),
                     (torch.ops.kdtree.build_trees_status.default, (lp, ids, budget, roots, positions, -1)),
                     (torch.ops.kdtree.verify_greedy_from_logits_status.default,
                      (fields, budget, drafter.shape[1], target, [7], torch.tensor([1, 5, 0])))]:
        torch.library.opcheck(op, args)


def test_a_compiled_status_round_has_no_graph_break_and_matches_eager():
    drafter, roots, positions, target, width, budget = round_inputs(2)
    k0, v0 = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    k1, v1 = k0.clone(), v0.clone()
    want = status_round(drafter, roots, positions, target, k0, v0, width, budget)
    got = torch.compile(status_round, fullgraph=True, backend="aot_eager")(drafter, roots, positions, target, k1, v1,
                                                                          width, budget)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)


def test_the_cpp_cuda_kernels_load_where_they_are_built():
    """libkdtree_torch beside libkdtree (CI builds it) defines the eight operators and their
    CUDA kernels; their CPU kernels, and ragged_trees, are the Python ones."""
    if os.environ.get("KDTREE_EXPECT_TORCH_OPS") == "1":
        assert ops.NATIVE is not None, "libkdtree_torch was expected beside libkdtree (nox -s test builds it)"
    if ops.NATIVE is None:
        pytest.skip("libkdtree_torch is not loaded: set KDTREE_TORCH_OPS=1 (nox -s test builds it beside "
                    "libkdtree; elsewhere CMake -DKDTREE_TORCH_OPS=ON)")
    for name in EIGHT:  # C++ schemas and CUDA kernels, Python CPU kernels on them
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kdtree::{name}", "CUDA"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kdtree::{name}", "CPU"), name
        assert isinstance(getattr(ops, name), ops._NativeOp), name
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::ragged_trees", "CUDA")
    assert not isinstance(ops.ragged_trees, ops._NativeOp)


def test_cpp_kernels_check_their_arguments_before_any_device_work():
    """The C++ CUDA kernels (the *_status operators'), called straight through the
    dispatcher on CPU tensors (no GPU here): their host-side checks raise ValueError naming
    the argument, through the same exception path as on a GPU."""
    if ops.NATIVE is None:
        pytest.skip("libkdtree_torch is not loaded: set KDTREE_TORCH_OPS=1 (nox -s test builds it beside "
                    "libkdtree; elsewhere CMake -DKDTREE_TORCH_OPS=ON)")
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    kd = torch.ops.kdtree
    cases = [
        (lambda: kd.topk_logprobs_status.default.redispatch(cuda, torch.zeros(2, 3), 1),
         r"topk_logprobs_status: logits is on cpu while another argument is a CUDA tensor"),
        (lambda: kd.topk_logprobs_status.default.redispatch(cuda, torch.zeros(2, 3), 9),
         r"topk_logprobs_status: k must be in \[0, min\(V=3, 1024\)\]"),
        (lambda: kd.build_trees_status.default.redispatch(cuda, torch.zeros(2, 3, 4),
                                                          torch.zeros(2, 3, 4, dtype=torch.int32), 4, None, None, -1,
                                                          None, None),
         r"build_trees_status: logprobs is on cpu"),
        (lambda: kd.verify_greedy_from_logits_status.default.redispatch(cuda, [], 4, 2, torch.zeros(1, 5, 3), [],
                                                                        None),
         r"verify_greedy_from_logits_status: fields is empty"),
        (lambda: kd.compact_kv_status.default.redispatch(cuda, [], [], *[torch.zeros(1)] * 4),
         r"compact_kv_status: k_layers is empty"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_the_python_definitions_pass_these_tests_too(tmp_path):
    """With libkdtree_torch loaded here, this file's tests again in a process without it
    (the operators then defined by torch.library.custom_op), so CI runs both definitions."""
    if ops.NATIVE is None:
        pytest.skip("libkdtree_torch is not loaded here: this process already runs the Python definitions")
    import subprocess
    import sys

    env = dict(os.environ, KDTREE_TORCH_OPS="0", KDTREE_EXPECT_TORCH_OPS="0")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
                        "-k", "not the_python_definitions"], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_cpp_kernels_built_for_another_torch_are_not_loaded(monkeypatch):
    if ops.NATIVE is None:
        pytest.skip("libkdtree_torch is not loaded: set KDTREE_TORCH_OPS=1 (nox -s test builds it beside "
                    "libkdtree; elsewhere CMake -DKDTREE_TORCH_OPS=ON)")
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    with pytest.warns(UserWarning, match="built for torch .* this is torch 0.0.0"):
        assert ops._load_native() is None
    monkeypatch.setenv("KDTREE_TORCH_OPS", "0")
    assert ops._load_native() is None


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false", " no "])
def test_kdtree_torch_ops_off_keeps_the_python_kernels(monkeypatch, value):
    monkeypatch.setenv("KDTREE_TORCH_OPS", value)
    assert ops._load_native() is None


def test_a_libkdtree_torch_that_fails_to_load_keeps_the_python_kernels(monkeypatch, tmp_path):
    """A libkdtree_torch.so beside libkdtree, stamped for this torch, that the loader
    refuses (here: not a shared library): a warning naming it and KDTREE_TORCH_OPS=0, no
    exception, the Python kernels kept."""
    import types

    from kdtree import _native

    (tmp_path / "libkdtree_torch.so").write_bytes(b"not a shared library")
    (tmp_path / "libkdtree_torch.torch-version").write_text(torch.__version__ + "\n")
    monkeypatch.setattr(_native, "load", lambda: types.SimpleNamespace(_kdtree_path=str(tmp_path / "libkdtree.so")))
    monkeypatch.delenv("KDTREE_TORCH_OPS", raising=False)
    with pytest.warns(UserWarning, match="could not be loaded .*KDTREE_TORCH_OPS=0"):
        assert ops._load_native() is None


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device (these tests need a GPU)")


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_ops_equal_the_gpu_functions(dtype):
    """On CUDA tensors each operator gives the bits of the function it names (the same
    libkdtree calls), whichever kernels are registered."""
    drafter, roots, positions, target, width, budget = round_inputs(5)
    drafter, roots, positions, target = _cuda(drafter.to(dtype), roots, positions, target.to(dtype))
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    want = kdtree.topk_logprobs(drafter, width)
    assert torch.equal(lp, want.logprobs) and torch.equal(ids, want.ids)
    lp4, ids4 = torch.ops.kdtree.topk_logprobs(drafter[None], width)  # four axes: rows of one view
    assert lp4.shape == (1, *lp.shape) and torch.equal(lp4[0], lp) and torch.equal(ids4[0], ids)

    fields = torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1)
    trees = kdtree.build_trees(lp, ids, budget, root_tokens=roots, root_positions=positions)
    for name, got in zip(kdtree.core.types.TREE_FIELDS, fields, strict=True):
        assert torch.equal(got, getattr(trees, name)), name
    budgets = torch.tensor([9, 0, 4], dtype=torch.int32, device="cuda")
    depths = torch.tensor([4, 4, 2], dtype=torch.int32, device="cuda")
    limited = torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1, budgets, depths)
    want_limited = kdtree.build_trees(lp, ids, budget, root_tokens=roots, root_positions=positions,
                                      request_budgets=budgets, request_depths=depths)
    for name, got in zip(kdtree.core.types.TREE_FIELDS, limited, strict=True):
        assert torch.equal(got, getattr(want_limited, name)), name

    for caps in (None, torch.tensor([1, 5, 0], device="cuda"), torch.tensor(2, device="cuda")):
        nodes, length, bonus = torch.ops.kdtree.verify_greedy_from_logits(list(fields), budget, trees.depth,
                                                                          target, [7, 3], caps)
        host_caps = None if caps is None else caps.cpu().numpy()
        acc = kdtree.verify_greedy_from_logits(trees, target, stop_tokens=[7, 3], max_commit=host_caps)
        assert torch.equal(nodes, acc.accepted_nodes) and torch.equal(length, acc.accept_length)
        assert torch.equal(bonus, acc.bonus_token)

    acc = kdtree.verify_greedy_from_logits(trees, target)
    assert int(acc.accept_length.sum()) > 0  # (rows do move)
    for cache_dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        src = torch.randn(3, 2, 40, 8, device="cuda")
        k, v = src.to(cache_dtype), (2 * src).to(cache_dtype)
        k_want, v_want = k.clone(), v.clone()
        kdtree.compact_kv([k_want], [v_want], positions, acc)
        torch.ops.kdtree.compact_kv([k], [v], positions, acc.accepted_nodes, acc.accept_length, acc.bonus_token)
        same = torch.uint8 if cache_dtype == torch.float8_e4m3fn else cache_dtype
        assert torch.equal(k.view(same), k_want.view(same)) and torch.equal(v.view(same), v_want.view(same))
    torch.cuda.synchronize()


@pytest.mark.gpu
@gpu
def test_gpu_ops_read_grad_tracking_tensors_as_their_values():
    """A target whose logits require grad (a forward outside no_grad) and trees from such
    drafter logits: the raising operators (Python kernels on CUDA) read them detached, as
    the *_status ones (C++) do."""
    drafter, roots, positions, target, width, budget = _cuda(*round_inputs(13)[:4]) + [4, 9]
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter.clone().requires_grad_() * 1.0, width)
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1))
    tracked = target.clone().requires_grad_() * 1.0
    got = torch.ops.kdtree.verify_greedy_from_logits(fields, budget, 4, tracked, [], None)
    *want, status = torch.ops.kdtree.verify_greedy_from_logits_status([f.detach() for f in fields], budget, 4,
                                                                      target, [], None)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and int(status.sum()) == 0


@pytest.mark.gpu
@gpu
def test_gpu_op_errors_name_the_argument_or_the_request():
    drafter, roots, positions, target, width, budget = _cuda(*round_inputs(6)[:4]) + [4, 9]
    with pytest.raises(ValueError, match="k must be in"):
        torch.ops.kdtree.topk_logprobs(drafter, 51)
    bad = drafter.clone()
    bad[1, 2, 4] = float("nan")
    with pytest.raises(ValueError, match=r"request 1, position 2 \(logits\[1, 2\], row 6\)"):
        torch.ops.kdtree.topk_logprobs(bad, width)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    with pytest.raises(TypeError):
        torch.ops.kdtree.build_trees(lp.double(), ids, budget)
    bad_lp = lp.clone()
    bad_lp[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="request 2"):
        torch.ops.kdtree.build_trees(bad_lp, ids, budget, roots, positions, -1)
    with pytest.raises(ValueError, match="request 2"):
        torch.ops.kdtree.build_trees(lp, ids, budget, None, None, -1,
                                     torch.tensor([1, 1, budget + 1], dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError):  # int64 budgets: 2^32 must not wrap to 0
        torch.ops.kdtree.build_trees(lp, ids, budget, None, None, -1,
                                     torch.tensor([1, 1, 2**32], device="cuda"))
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1))
    with pytest.raises(ValueError):
        torch.ops.kdtree.verify_greedy_from_logits(fields[:9], budget, 4, target, [], None)
    with pytest.raises(ValueError, match="must have shape"):
        torch.ops.kdtree.verify_greedy_from_logits(fields, budget + 1, 4, target, [], None)
    k = torch.zeros(3, 2, 40, 8, device="cuda", dtype=torch.bfloat16)
    nodes, length, bonus = torch.ops.kdtree.verify_greedy_from_logits(fields, budget, 4, target, [], None)
    with pytest.raises(ValueError, match="distinct"):
        torch.ops.kdtree.compact_kv([k], [k], positions, nodes, length, bonus)
    with pytest.raises(ValueError, match="request 1"):
        torch.ops.kdtree.compact_kv([k], [k.clone()], torch.tensor([0, -1, 0], device="cuda"), nodes, length, bonus)


@pytest.mark.gpu
@gpu
def test_gpu_status_round_in_a_cuda_graph_equals_eager():
    """The *_status operators on CUDA give the functions' statuses and, captured in a CUDA
    graph, replay the eager round's values (no host read-back inside)."""
    drafter, roots, positions, target, width, budget = round_inputs(8)
    drafter, roots, positions, target = _cuda(drafter, roots, positions, target)
    bad = drafter.clone()
    bad[0, 1, 3] = float("inf")
    lp, ids, st = torch.ops.kdtree.topk_logprobs_status(bad, width)
    want = kdtree.topk_logprobs(bad, width, errors="status")
    assert torch.equal(st, want.row_status) and int(st[0, 1]) == 4
    k0, v0 = torch.randn(3, 2, 40, 8, device="cuda"), torch.randn(3, 2, 40, 8, device="cuda")
    k_eager, v_eager = k0.clone(), v0.clone()
    want = status_round(drafter, roots, positions, target, k_eager, v_eager, width, budget)
    assert int(want[2].sum()) > 0 and all(int(t.abs().sum()) == 0 for t in want[4:])
    k, v = k0.clone(), v0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on these caches (their pointer tables are made then)
        status_round(drafter, roots, positions, target, k, v, width, budget)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = status_round(drafter, roots, positions, target, k, v, width, budget)
    k.copy_(k0)
    v.copy_(v0)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(k, k_eager) and torch.equal(v, v_eager)


@pytest.mark.gpu
@gpu
def test_gpu_sampled_verify_and_mask_ops_equal_the_gpu_functions():
    drafter, roots, positions, target, width, budget = round_inputs(11)
    drafter, roots, positions, target = _cuda(drafter, roots, positions, target)
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, positions, -1))
    trees = ops.tree_batch(fields, budget, 4)
    st = _sampling_settings(3, "cuda")
    st["temperature"] = st["temperature"].float()
    got = torch.ops.kdtree.verify_sample_from_logits(fields, budget, 4, target, st["temperature"], st["seed"],
                                                     st["offset"], st["top_p"].float(), st["top_k"], [7], None)
    want = kdtree.verify_sample_from_logits(trees, target, st["temperature"], seed=st["seed"], offset=st["offset"],
                                            top_p=st["top_p"].float(), top_k=st["top_k"], stop_tokens=[7])
    for a, b in zip(got, (want.accepted_nodes, want.accept_length, want.bonus_token), strict=True):
        assert torch.equal(a, b)
    prefix = torch.tensor([5, 0, 11], device="cuda")
    for kind, dtype in (("bool", None), ("bits", None), ("additive", torch.bfloat16)):
        mask, pos = torch.ops.kdtree.tree_attention_mask(fields, budget, 4, prefix, kind, 40, dtype)
        ref = kdtree.tree_attention_mask(trees, prefix, kind=kind, dtype=dtype or "float32", columns=40)
        assert torch.equal(mask, ref.mask) and torch.equal(pos, ref.positions), kind


@pytest.mark.gpu
@gpu
def test_gpu_tree_attention_op_equals_the_function():
    drafter, roots, positions, target, width, budget = round_inputs(13)
    drafter, roots = _cuda(drafter, roots)
    prefix = torch.tensor([5, 0, 11], device="cuda")
    lp, ids = torch.ops.kdtree.topk_logprobs(drafter, width)
    fields = list(torch.ops.kdtree.build_trees(lp, ids, budget, roots, prefix, -1))
    trees = ops.tree_batch(fields, budget, 4)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(3, budget + 1, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(3, 2, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(3, 2, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    want, _, _ = kdtree.tree_attention(q, k, v, trees, prefix)
    got = torch.ops.kdtree.tree_attention(q, k, v, fields, budget, 4, prefix)
    assert torch.equal(got, want)
    out, lse, status = torch.ops.kdtree.tree_attention_status(q, k, v, fields, budget, 4, prefix, None, None, 40)
    want_out, want_lse, _ = kdtree.tree_attention(q, k, v, trees, prefix, max_prefix=40, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and status.tolist() == [0, 0, 0]
