"""Verification from vocabulary-sharded target logits (kdtree.distributed.target_tokens_sharded)
over torch.distributed with gloo, one process per rank: every rank's tokens, and the
acceptance of kdtree.verify_greedy on them, equal the unsharded verify_greedy_from_logits
and verify_sample_from_logits on the gathered logits (greedy with ties across the slices,
sampled with the same seeds); a rank with a bad shape fails every rank alike.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np

import kdtree

_WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    import kdtree
    from kdtree import KdtreeError
    from kdtree.distributed import target_tokens_sharded

    rank, world, edges, mode, out = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rng = np.random.default_rng(11)
    vocab = edges[-1]
    batch, depth, width, budget = 4, 5, 3, 12
    p = rng.dirichlet(np.ones(width + 1), size=(batch, depth))[..., :width]
    lp = np.ascontiguousarray(np.sort(np.log(p), axis=-1)[..., ::-1].astype(np.float32))
    ids = np.stack([[rng.permutation(vocab)[:width] for _ in range(depth)] for _ in range(batch)]).astype(np.int32)
    trees = kdtree.build_trees(lp, ids, budget, root_tokens=np.arange(batch))
    logits = (rng.standard_normal((batch, budget + 1, vocab)) * 2).astype(np.float32)
    # The target mostly agrees with the tree: its best child gets a high logit.
    for b in range(batch):
        for i in range(budget + 1):
            c = trees.first_child[b, i]
            if c >= 0 and rng.random() < 0.8:
                logits[b, i, trees.tokens[b, c]] = 9.0
    # Exact ties across the slices' boundaries (greedy: the lower global id wins).
    logits[0, 0, :] = -1.0
    logits[0, 0, [edges[1] - 1, edges[1], edges[2]]] = 12.0
    logits[1, 3, :] = -np.inf  # a row of only -inf (greedy: token 0; sampled: no draw)
    lo, hi = edges[rank], edges[rank + 1]
    local = torch.from_numpy(logits[..., lo:hi].copy())
    if mode == "shape" and rank == 2:
        local = local[:, :-1]
    if mode == "disagree":  # a rank that differs from the others: every rank raises, none waits
        errors = []
        for case in ("nodes", "vocab", "seed", "offset"):
            kw = dict(temperature=0.7, seed=5)
            if rank == 1 and case == "nodes":
                kw["nodes"] = np.zeros((batch, budget), np.int64)  # one row short
            if rank == 1 and case == "seed":
                kw["seed"] = 6
            start = None if rank == 1 and case == "offset" else lo  # not an int: that rank's own error
            try:
                target_tokens_sharded(local, start, vocab + (rank == 1 and case == "vocab"), **kw)
                errors.append("accepted")
            except KdtreeError as exc:
                errors.append(str(exc))
        open(out + ".err", "w").write(json.dumps(errors))
        dist.destroy_process_group()
        sys.exit(0)
    result = {}
    try:
        greedy = target_tokens_sharded(local, lo, vocab)
        # The GPU form's merge (no host round trip; one all_gather_into_tensor) on these CPU tensors.
        from kdtree import distributed
        device_form = distributed._target_tokens_sharded_cuda(local, lo, None, None)
        sampled = target_tokens_sharded(local, lo, vocab, temperature=0.7, seed=5, offset=9)
        acc_g = kdtree.verify_greedy(trees, greedy.numpy())
        cap = np.array([3, 2, 9, 1])
        acc_s = kdtree.verify_greedy(trees, sampled.numpy(), max_commit=cap, errors="status")
        # Per request: a greedy request among sampled ones, each with its own seed and offset.
        mixed = target_tokens_sharded(local, lo, vocab, temperature=[0.7, 0.0, 1.3, 0.5], seed=[5, 6, 7, 2**64 - 1],
                                      offset=np.array([9, 10, 11, 12], np.uint64))
        acc_m = kdtree.verify_greedy(trees, mixed.numpy(), errors="status")
        try:
            target_tokens_sharded(local, lo, vocab, temperature=[0.7, 0.0, 1e-9, 0.5])
            bad = "accepted"
        except KdtreeError as exc:
            bad = str(exc)
        open(out + ".bad", "w").write(bad)
        np.savez(out, greedy=greedy.numpy(), sampled=sampled.numpy(), logits=logits, mixed=mixed.numpy(),
                 device_form=device_form.numpy(),
                 m_nodes=acc_m.accepted_nodes, m_len=acc_m.accept_length, m_bonus=acc_m.bonus_token,
                 g_nodes=acc_g.accepted_nodes, g_len=acc_g.accept_length, g_bonus=acc_g.bonus_token,
                 s_nodes=acc_s.accepted_nodes, s_len=acc_s.accept_length, s_bonus=acc_s.bonus_token,
                 s_status=acc_s.request_status, **{f: getattr(trees, f) for f in kdtree.core.types.TREE_FIELDS})
    except KdtreeError as exc:
        open(out + ".err", "w").write(str(exc))
""")


def run_ranks(spawn_ranks, tmp_path, mode, world=3, edges=(0, 700, 1400, 2003)):
    outs = [str(tmp_path / f"{mode}{r}") for r in range(world)]
    spawn_ranks(_WORKER, world, lambda r: [r, world, json.dumps(list(edges)), mode, outs[r]])
    return outs


def test_sharded_verification_equals_the_unsharded(spawn_ranks, tmp_path):
    outs = run_ranks(spawn_ranks, tmp_path, "ok")
    results = [np.load(o + ".npz") for o in outs]
    first = results[0]
    trees = kdtree.TreeBatch(**{f: first[f] for f in kdtree.core.types.TREE_FIELDS}, budget=12, depth=5)
    logits = first["logits"]
    greedy = kdtree.verify_greedy_from_logits(trees, logits)
    cap = np.array([3, 2, 9, 1])
    sampled = kdtree.verify_sample_from_logits(trees, logits, 0.7, seed=5, offset=9, max_commit=cap,
                                               errors="status")
    # The tokens themselves: the host argmax, and the host's documented draw, row by row.
    want_greedy = np.argmax(logits, axis=-1).astype(np.int32)
    assert want_greedy[0, 0] == 699  # the tie at 699, 700, 1400 goes to the lowest id
    from kdtree.core import sampling
    for r in results:
        np.testing.assert_array_equal(r["greedy"], want_greedy)
        np.testing.assert_array_equal(r["device_form"], want_greedy)
        np.testing.assert_array_equal(r["g_nodes"], greedy.accepted_nodes)
        np.testing.assert_array_equal(r["g_len"], greedy.accept_length)
        np.testing.assert_array_equal(r["g_bonus"], greedy.bonus_token)
        np.testing.assert_array_equal(r["s_len"], sampled.accept_length)
        np.testing.assert_array_equal(r["s_bonus"], sampled.bonus_token)
        np.testing.assert_array_equal(r["s_nodes"], sampled.accepted_nodes)
    for b in range(4):
        draws = sampling.gumbel_draws(logits[b], 0.7, 5, 9, b, np.arange(13))
        np.testing.assert_array_equal(first["sampled"][b], draws)
    assert first["sampled"][1, 3] == -1  # only -inf: no draw
    assert int(greedy.accept_length.sum()) > 0
    # Per-request temperatures, seeds and offsets: the unsharded call with the same arrays.
    temps, seeds, offsets = [0.7, 0.0, 1.3, 0.5], [5, 6, 7, 2**64 - 1], [9, 10, 11, 12]
    mixed = kdtree.verify_sample_from_logits(trees, logits, np.array(temps, np.float32),
                                             seed=np.array(seeds, np.uint64), offset=np.array(offsets, np.uint64),
                                             errors="status")
    for r in results:
        np.testing.assert_array_equal(r["m_nodes"], mixed.accepted_nodes)
        np.testing.assert_array_equal(r["m_len"], mixed.accept_length)
        np.testing.assert_array_equal(r["m_bonus"], mixed.bonus_token)
    np.testing.assert_array_equal(first["mixed"][1], want_greedy[1])  # temperature 0: the argmax
    for b in (0, 2, 3):
        draws = sampling.gumbel_draws(logits[b], temps[b], seeds[b], offsets[b], b, np.arange(13))
        np.testing.assert_array_equal(first["mixed"][b], draws)
    # A bad per-request temperature is the same error, naming the request, on every rank.
    bad = {Path(o + ".bad").read_text() for o in outs}
    assert len(bad) == 1 and "temperature of request 2 must be 0, or finite and >= 1e-6" in bad.pop()


def test_a_rank_with_another_shape_fails_every_rank(spawn_ranks, tmp_path):
    errors = [Path(o + ".err").read_text() for o in run_ranks(spawn_ranks, tmp_path, "shape")]
    assert len(set(errors)) == 1
    assert "rank 2 has leading shape [4, 12], rank 0 [4, 13]: every rank needs the same" in errors[0]


def test_ranks_that_disagree_fail_every_rank(spawn_ranks, tmp_path):
    """Another nodes shape, vocabulary or seed on one rank: every rank raises (the rank with
    the bad nodes its own error, the others name it), none waits in the second gather."""
    errors = [json.loads(Path(o + ".err").read_text()) for o in run_ranks(spawn_ranks, tmp_path, "disagree")]
    nodes, vocab, seed, offset = zip(*errors, strict=True)
    assert "vocab_offset must be an int" in offset[1]
    assert all("rank(s) [1] failed in target_tokens_sharded" in e for e in (offset[0], offset[2]))
    assert "nodes must have shape (4, 13), got (4, 12)" in nodes[1]
    assert all("rank(s) [1] failed in target_tokens_sharded" in e for e in (nodes[0], nodes[2]))
    assert len(set(vocab)) == 1 and "rank 1 passes vocab = 2004, rank 0 2003" in vocab[0]
    assert len(set(seed)) == 1 and "rank 1 passes other sampling settings than rank 0" in seed[0]

