"""Multi-token stop sequences in the verification walks (kdt_stop_sequences).

Hand-worked walks (a sequence inside the round, one spanning the history, a partial
match, a bonus that completes one, the cap), a property test against the pure-Python
reference on random trees and targets, the from-logits walks on the host, errors, and
the GPU walks against the host's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdtree
from kdtree import _native as _lib
from kdtree import reference

pytestmark = pytest.mark.usefixtures("lib")


def chain_trees():
    """One request, a chain 10 -> 20 -> 30 -> 40 (root token 5), plus a sibling 21 of 20."""
    lp = np.log(np.array([[[0.9, 0.05], [0.8, 0.1], [0.9, 0.05], [0.9, 0.05]]], np.float32))
    ids = np.array([[[10, 11], [20, 21], [30, 31], [40, 41]]], np.int32)
    trees = kdtree.build_trees(lp, ids, 5, root_tokens=[5])
    assert trees.tokens[0, :5].tolist() == [5, 10, 20, 30, 40]
    return trees


def target_along(trees, tokens):
    """Target choices: at node i the token in `tokens` for it (dict node -> token), else 999."""
    t = np.full((1, trees.budget + 1), 999, np.int32)
    for node, tok in tokens.items():
        t[0, node] = tok
    return t


def test_sequence_inside_the_round():
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})
    full = kdtree.verify_greedy(trees, target)
    assert full.accept_length.tolist() == [4] and full.bonus_token.tolist() == [50]
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[20, 30]])
    assert acc.accept_length.tolist() == [3] and acc.bonus_token.tolist() == [-1]
    assert acc.accepted_nodes[0, :4].tolist() == [0, 1, 2, 3]
    # A partial match (20 then 31) never stops; a longer sequence that does not complete either.
    for seqs in ([[20, 31]], [[10, 20, 30, 40, 50]], [[99, 10]]):
        acc = kdtree.verify_greedy(trees, target, stop_sequences=seqs)
        assert acc.accept_length.tolist() == [4] and acc.bonus_token.tolist() == [50], seqs


def test_sequence_spanning_the_history():
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})
    # Committed before: ..., 7, 5 (5 is the root's token). The sequence 7 5 10 ends at the first node.
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[7, 5, 10]], stop_history=[[-1, 3, 7, 5]])
    assert acc.accept_length.tolist() == [1] and acc.bonus_token.tolist() == [-1]
    # Without the history the same sequence cannot match (7 is not known) ...
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[7, 5, 10]])
    assert acc.accept_length.tolist() == [4]
    # ... but one that begins at the root does: with no history the root's token (5) is the
    # stream's last committed token, on every walk (the from-logits ones too)
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[5, 10]])
    assert acc.accept_length.tolist() == [1] and acc.bonus_token.tolist() == [-1]
    logits = np.zeros((1, trees.budget + 1, 60), np.float32)
    logits[0, np.arange(5), [10, 20, 30, 40, 50]] = 1.0
    for walk in (kdtree.verify_greedy_from_logits(trees, logits, stop_sequences=[[5, 10]]),
                 kdtree.verify_sample_from_logits(trees, logits * 1000, 1.0, seed=3, offset=0,
                                                  stop_sequences=[[5, 10]]),
                 kdtree.verify_sample_from_logits(trees, logits * 1000, [1.0], seed=3, offset=0, top_k=[3],
                                                  stop_sequences=[[5, 10]])):
        assert walk.accept_length.tolist() == [1] and walk.bonus_token.tolist() == [-1]
    # a history given replaces the root: one that does not end at 5 does not match
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[5, 10]], stop_history=[[5, 6]])
    assert acc.accept_length.tolist() == [4]
    # -1 (fewer committed tokens) never matches.
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[3, 7, 5, 10, 20]], stop_history=[[-1, 7, 5]])
    assert acc.accept_length.tolist() == [4]
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[3, 7, 5, 10, 20]], stop_history=[[3, 7, 5]])
    assert acc.accept_length.tolist() == [2] and acc.bonus_token.tolist() == [-1]


def test_no_sequence_at_all_is_no_stop():
    """[] and an empty prepared set are no stop sequences alike (a history is then unused);
    a history without any stop_sequences argument is still refused."""
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})
    empty = kdtree.stop_sequences([])
    assert empty.sequences == () and empty.longest == 0
    for seqs in ([], (), empty):
        for history in (None, [[5]]):
            acc = kdtree.verify_greedy(trees, target, stop_sequences=seqs, stop_history=history)
            assert acc.accept_length.tolist() == [4] and acc.bonus_token.tolist() == [50]
    with pytest.raises(kdtree.KdtreeError, match="stop_history is given without stop_sequences"):
        kdtree.verify_greedy(trees, target, stop_history=[[5]])
    with pytest.raises(kdtree.KdtreeTypeError, match="like must be a CUDA array"):
        kdtree.stop_sequences([], like=np.zeros(2))


def test_bonus_that_completes_a_sequence_is_committed():
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[40, 50]])
    assert acc.accept_length.tolist() == [4] and acc.bonus_token.tolist() == [50]


def test_cap_and_sequences():
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})
    # Cap 1: only the bonus 10 (accepting 10 and a bonus would pass the cap).
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[10, 20]], max_commit=1)
    assert acc.accept_length.tolist() == [0] and acc.bonus_token.tolist() == [10]
    # Cap 2: 10 and 20 accepted; 20 completes the sequence, which ends the walk with no
    # bonus: the same two tokens the cap allows (a stop token at the cap does the same).
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[10, 20]], max_commit=2)
    assert acc.accept_length.tolist() == [2] and acc.bonus_token.tolist() == [-1]
    acc = kdtree.verify_greedy(trees, target, stop_tokens=[20], max_commit=2)
    assert acc.accept_length.tolist() == [2] and acc.bonus_token.tolist() == [-1]
    # Without a stop, cap 2 is 10 then the bonus 20.
    acc = kdtree.verify_greedy(trees, target, stop_sequences=[[30, 99]], max_commit=2)
    assert acc.accept_length.tolist() == [1] and acc.bonus_token.tolist() == [20]


def test_from_logits_walks_use_them():
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})
    logits = np.full((1, trees.budget + 1, 64), -5.0, np.float32)
    np.put_along_axis(logits, np.minimum(target, 63)[..., None], 5.0, -1)
    logits[0, 4, 50] = 5.0
    acc = kdtree.verify_greedy_from_logits(trees, logits, stop_sequences=[[20, 30]])
    assert acc.accept_length.tolist() == [3] and acc.bonus_token.tolist() == [-1]
    cold = kdtree.verify_sample_from_logits(trees, logits * 100, 1.0, seed=1, offset=0,
                                            stop_sequences=[[20, 30]])  # peaked: draws the argmax
    assert cold.accept_length.tolist() == [3]
    batch = kdtree.verify_sample_from_logits(trees, logits * 100, [1.0], seed=1, offset=0, top_k=[2],
                                             stop_sequences=[[7, 5, 10]], stop_history=[[7, 5]])
    assert batch.accept_length.tolist() == [1] and batch.bonus_token.tolist() == [-1]


@pytest.mark.parametrize("seqs, history, error, match", [
    ([[]], None, kdtree.KdtreeError, "1 to 16"),
    ([list(range(17))], None, kdtree.KdtreeError, "1 to 16"),
    ([[3, -4]], None, kdtree.KdtreeError, "negative token id -4"),
    (5, None, TypeError, "sequence of token sequences"),
    ([7], None, TypeError, r"stop_sequences\[0\] must be an ordered sequence"),
    ([{7, 8}], None, TypeError, r"stop_sequences\[0\] must be an ordered sequence .* got set"),
    ([np.array(5)], None, TypeError, r"stop_sequences\[0\] must be an ordered sequence"),
    (None, [[1, 2]], kdtree.KdtreeError, "stop_history is given without stop_sequences"),
    ([[1, 2]], [[1, 2], [3, 4]], kdtree.KdtreeError, r"stop_history must have shape \(1, H\)"),
])
def test_bad_stop_sequences(seqs, history, error, match):
    trees = chain_trees()
    with pytest.raises(error, match=match):
        kdtree.verify_greedy(trees, target_along(trees, {0: 10}), stop_sequences=seqs, stop_history=history)


@st.composite
def walks(draw):
    """Random trees, targets that often follow them, sequences made of tokens on the trees'
    paths (so that they match), and histories."""
    batch = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 5))
    width = draw(st.integers(1, 3))
    budget = draw(st.integers(1, 20))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(width + 1), size=(batch, depth))[..., :width]
    lp = np.ascontiguousarray(np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32))
    ids = np.stack([[rng.permutation(6)[:width] for _ in range(depth)] for _ in range(batch)]).astype(np.int32)
    trees = kdtree.build_trees(lp, ids, budget, root_tokens=rng.integers(0, 6, batch))
    first = np.where(trees.first_child >= 0, np.take_along_axis(trees.tokens, np.maximum(trees.first_child, 0), 1),
                     rng.integers(0, 6, trees.first_child.shape))
    target = np.where(rng.random(first.shape) < 0.8, first, rng.integers(0, 6, first.shape)).astype(np.int32)
    nseq = draw(st.integers(1, 4))
    seqs = [draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)) for _ in range(nseq)]
    hist_len = draw(st.integers(0, 4))
    history = rng.integers(-1, 6, (batch, hist_len)) if draw(st.booleans()) else None
    cap = rng.integers(0, 6, batch) if draw(st.booleans()) else None
    return trees, target, seqs, history, cap


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks())
def test_property_matches_the_reference(case):
    trees, target, seqs, history, cap = case
    got = kdtree.verify_greedy(trees, target, stop_sequences=seqs, stop_history=history, max_commit=cap)
    want = reference.verify_greedy(trees, target, stop_sequences=seqs, stop_history=history, max_commit=cap)
    np.testing.assert_array_equal(got.accept_length, want.accept_length)
    np.testing.assert_array_equal(got.bonus_token, want.bonus_token)
    np.testing.assert_array_equal(got.accepted_nodes[:, : want.accepted_nodes.shape[1]], want.accepted_nodes)


def test_errors_status_uses_each_requests_history():
    # errors="status" walks request by request after a failure: each must see its own row.
    trees = chain_trees()
    two = kdtree.TreeBatch(**{f: np.ascontiguousarray(np.concatenate([getattr(trees, f)] * 3))
                              for f in kdtree.core.types.TREE_FIELDS}, budget=trees.budget, depth=trees.depth)
    target = np.concatenate([target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40, 4: 50})] * 3)
    target[1, 0] = -3  # request 1 fails
    acc = kdtree.verify_greedy(two, target, stop_sequences=[[7, 10]], stop_history=[[1], [7], [7]],
                               errors="status")
    assert acc.request_status.tolist()[1] == _lib.STATUS["KDT_ERR_VALUE"]
    assert acc.accept_length.tolist() == [4, 0, 1]


@pytest.mark.gpu
def test_gpu_walks_match_the_host(cuda_device):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    for _ in range(20):
        batch, depth, width, budget = 8, 6, 3, 24
        p = rng.dirichlet(np.ones(width + 1), size=(batch, depth))[..., :width]
        lp = np.ascontiguousarray(np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32))
        ids = np.stack([[rng.permutation(8)[:width] for _ in range(depth)] for _ in range(batch)]).astype(np.int32)
        cpu_trees = kdtree.build_trees(lp, ids, budget, root_tokens=rng.integers(0, 8, batch))
        gpu_trees = kdtree.build_trees(torch.from_numpy(lp).to(cuda_device), torch.from_numpy(ids).to(cuda_device),
                                       budget, root_tokens=cpu_trees.tokens[:, 0])
        first = np.where(cpu_trees.first_child >= 0,
                         np.take_along_axis(cpu_trees.tokens, np.maximum(cpu_trees.first_child, 0), 1), 7)
        target = np.where(rng.random(first.shape) < 0.85, first, rng.integers(0, 8, first.shape)).astype(np.int32)
        seqs = [rng.integers(0, 8, rng.integers(1, 5)).tolist() for _ in range(5)]
        history = rng.integers(-1, 8, (batch, 6))
        cap = rng.integers(1, 8, batch)
        want = kdtree.verify_greedy(cpu_trees, target, stop_sequences=seqs, stop_history=history, max_commit=cap)
        got = kdtree.verify_greedy(gpu_trees, torch.from_numpy(target).to(cuda_device), stop_sequences=seqs,
                                   stop_history=history, max_commit=cap)
        for name in ("accepted_nodes", "accept_length", "bonus_token"):
            np.testing.assert_array_equal(getattr(got, name).cpu().numpy(), getattr(want, name), err_msg=name)
        logits = np.full((batch, budget + 1, 8), -4.0, np.float32)
        np.put_along_axis(logits, target[..., None], 4.0, -1)
        got = kdtree.verify_greedy_from_logits(gpu_trees, torch.from_numpy(logits).to(cuda_device),
                                               stop_sequences=seqs, stop_history=history, max_commit=cap)
        for name in ("accepted_nodes", "accept_length", "bonus_token"):
            np.testing.assert_array_equal(getattr(got, name).cpu().numpy(), getattr(want, name), err_msg=name)


def test_prepared_sequences_on_the_host():
    """kdtree.stop_sequences packs and checks once; host calls read its sequences."""
    prepared = kdtree.stop_sequences([[10, 20], (7,)])
    assert prepared.sequences == ((10, 20), (7,)) and prepared.longest == 2
    assert prepared.tokens.tolist() == [10, 20, 7] and prepared.offsets.tolist() == [0, 2, 3]
    trees = chain_trees()
    target = target_along(trees, {0: 10, 1: 20, 2: 30, 3: 40})
    got = kdtree.verify_greedy(trees, target, stop_sequences=prepared)
    want = kdtree.verify_greedy(trees, target, stop_sequences=[[10, 20], [7]])
    assert int(got.accept_length[0]) == int(want.accept_length[0]) == 2
    for bad, match in (([[1] * 17], "1 to 16"), ([[-2]], "negative")):
        with pytest.raises(kdtree.KdtreeError, match=match):
            kdtree.stop_sequences(bad)
    with pytest.raises(TypeError, match="like must be a CUDA array"):
        kdtree.stop_sequences([[1]], like=np.zeros(3))
    # a batch of sequences as one 2-D entry, and a scalar history, are errors, not reshaped
    with pytest.raises(kdtree.KdtreeTypeError, match="flat sequence of token ids"):
        kdtree.verify_greedy(trees, target, stop_sequences=[[[10, 20]]])
    with pytest.raises(kdtree.KdtreeError, match="got a scalar"):
        kdtree.verify_greedy(trees, target, stop_sequences=[[10, 20]], stop_history=4)


@pytest.mark.gpu
def test_gpu_prepared_sequences_and_a_device_history_inside_a_cuda_graph(cuda_device):
    """Sequences prepared on the device and a device history are used in place: the call
    captures in a CUDA graph, and replays after the history changes see the new history."""
    torch = pytest.importorskip("torch")
    trees_cpu = chain_trees()
    target = target_along(trees_cpu, {0: 10, 1: 20, 2: 30, 3: 40})
    lp = np.log(np.array([[[0.9, 0.05], [0.8, 0.1], [0.9, 0.05], [0.9, 0.05]]], np.float32))
    ids = np.array([[[10, 11], [20, 21], [30, 31], [40, 41]]], np.int32)
    trees = kdtree.build_trees(torch.from_numpy(lp).to(cuda_device), torch.from_numpy(ids).to(cuda_device), 5,
                               root_tokens=[5])
    tgt = torch.from_numpy(target).to(cuda_device)
    prepared = kdtree.stop_sequences([[3, 5, 10], [30, 40, 50]], like=tgt)
    history = torch.tensor([[0, 0, 5]], dtype=torch.int32, device=cuda_device)
    acc = kdtree.verify_greedy(trees, tgt, stop_sequences=prepared, stop_history=history, errors="status")
    assert int(acc.accept_length[0]) == 4  # nothing completes: 5 10 20 30 40, and the bonus
    with pytest.raises(kdtree.KdtreeError, match="prepare them once"):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            kdtree.verify_greedy(trees, tgt, stop_sequences=[[3, 5, 10]], stop_history=history, out=acc,
                                 errors="status")
    # host sequences with a device history, outside a capture: the sequences copied, the
    # history read in place (here nothing completes: 0 5 | 10 20 ...)
    loose = kdtree.verify_greedy(trees, tgt, stop_sequences=[[3, 5, 10]], stop_history=history)
    assert int(loose.accept_length[0]) == 4
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kdtree.verify_greedy(trees, tgt, stop_sequences=prepared, stop_history=history, out=acc, errors="status")
    history.copy_(torch.tensor([[0, 3, 5]], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    assert int(acc.accept_length[0]) == 1  # 3 5 | 10 completes [3, 5, 10]: the walk ends after 10
    want = kdtree.verify_greedy(trees_cpu, target, stop_sequences=[[3, 5, 10], [30, 40, 50]],
                                stop_history=[[0, 3, 5]])
    np.testing.assert_array_equal(acc.accepted_nodes.cpu().numpy(), want.accepted_nodes)
