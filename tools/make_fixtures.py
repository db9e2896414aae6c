"""Writes the native tests' fixtures from the pure-Python reference (``nox -s fixtures``).

Every expected value in ``fixtures/*.kdtr`` comes from :mod:`kdtree.reference`, never from
the C code under test. Generation is deterministic (fixed seeds), so
``tests_py/test_fixtures.py`` can check that the committed files are what this script
writes today.

Files (KDTR, docs/kdtr-format.md), each holding ``count`` (0-d int64) and per case ``c``
arrays named ``<c>.<name>``:

- ``trees_cases.kdtr``: inputs ``logprobs`` float32 [B,L,K], ``token_ids`` int32 [B,L,K],
  ``budget``, ``vocab_size`` (0 = unchecked), ``pad_token`` (0-d int64), ``root_tokens``
  int32 [B] and ``root_positions`` int64 [B] (zero-size when absent), and expected
  ``num_nodes``, ``tokens``, ``depths``, ``parents``, ``logw``, ``positions``,
  ``visibility`` (bool), ``visibility_bits``, ``first_child``, ``next_sibling``.
- ``verify_cases.kdtr``: a tree (``budget``, ``depth``, ``num_nodes``, ``tokens``,
  ``first_child``, ``next_sibling``), ``target_tokens`` int32 [B,N+1], ``stop_tokens``
  int32 [S], ``max_commit`` int64 [B] (zero-size: no cap), expected ``accepted_nodes``,
  ``accept_length``, ``bonus_token``.
- ``topk_cases.kdtr``: ``logits`` float32 [R,V], ``k``, expected ``logprobs`` float32
  [R,k] (compare within 1e-6) and ``ids`` int32 [R,k] (exact).
- ``bad_cases.kdtr``: tree-builder inputs the library must reject, with the expected
  ``status`` (kdt_status value) and a substring ``where`` (uint8 UTF-8) of the message.

Usage: ``PYTHONPATH=python python tools/make_fixtures.py [output folder]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from kdtree import kdtr, reference  # noqa: E402

TREE_FIELDS = ("num_nodes", "tokens", "depths", "parents", "logw", "positions",
               "visibility", "visibility_bits", "first_child", "next_sibling")

KDT_ERR_VALUE = 4
KDT_ERR_OUT_OF_RANGE = 5


def _draft(rng: np.random.Generator, batch: int, depth: int, width: int, kind: str):
    """Drafter-like top-K log-probs and ids for one case."""
    vocab = max(width, 1) + int(rng.integers(0, 40))
    if kind == "ties":
        # Values from a tiny set: many cumulative scores tie exactly.
        lp = -rng.integers(0, 3, size=(batch, depth, width)).astype(np.float32)
        lp = -np.sort(-lp, axis=-1)
        ids = np.zeros((batch, depth, width), np.int32)
        for b in range(batch):
            for d in range(depth):
                ids[b, d] = rng.permutation(vocab)[:width]
        return lp, ids, vocab
    scale = {"peaked": 4.0, "flat": 0.5, "bf16": 1.0}.get(kind, 1.0)
    logits = (rng.standard_normal((batch, depth, vocab)) * scale).astype(np.float32)
    if kind == "bf16":
        logits = logits.astype(ml_dtypes.bfloat16).astype(np.float32)
    if kind == "neginf":
        logits[rng.random(logits.shape) < 0.3] = -np.inf
        logits[..., 0] = np.maximum(logits[..., 0], 0.0)  # every row keeps a finite entry
    lp, ids = reference.topk_logprobs(logits, width)
    if kind == "deadrow" and depth > 1:
        lp[:, depth // 2, :] = -np.inf  # the tree stops above this depth
    return lp, ids, vocab


def tree_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261130)
    out: dict[str, np.ndarray] = {}
    specs = []
    for kind in ("peaked", "flat", "bf16", "ties", "neginf", "deadrow"):
        for budget, depth, width, batch in ((1, 1, 1, 1), (2, 2, 3, 1), (5, 3, 2, 2), (7, 4, 7, 3),
                                            (16, 6, 5, 2), (19, 15, 19, 1), (33, 8, 40, 2),
                                            (64, 15, 64, 1), (0, 3, 3, 1), (10, 0, 4, 1),
                                            (12, 5, 0, 1), (9, 20, 1, 2)):
            specs.append((kind, budget, depth, width, batch))
    for c, (kind, budget, depth, width, batch) in enumerate(specs):
        lp, ids, vocab = _draft(rng, batch, depth, width, kind)
        with_roots = c % 3 == 0
        roots = rng.integers(0, max(vocab, 1), size=batch).astype(np.int32) if with_roots else None
        pos = rng.integers(0, 10_000, size=batch).astype(np.int64) if c % 2 == 0 else None
        pad = -1 if c % 4 else 0
        vocab_arg = vocab if c % 5 else None
        tree = reference.build_trees(lp, ids, budget, root_tokens=roots, root_positions=pos,
                                     vocab_size=vocab_arg, pad_token=pad)
        p = f"{c}."
        out[p + "logprobs"] = lp.astype(np.float32)
        out[p + "token_ids"] = ids.astype(np.int32)
        out[p + "budget"] = np.array(budget, np.int64)
        out[p + "vocab_size"] = np.array(vocab_arg or 0, np.int64)
        out[p + "pad_token"] = np.array(pad, np.int64)
        out[p + "root_tokens"] = roots if roots is not None else np.zeros(0, np.int32)
        out[p + "root_positions"] = pos if pos is not None else np.zeros(0, np.int64)
        for f in TREE_FIELDS:
            out[p + "expect." + f] = np.ascontiguousarray(getattr(tree, f))
    return {"count": np.array(len(specs), np.int64), **out}


def verify_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {}
    count = 0
    for budget, depth, width in ((1, 1, 1), (4, 3, 2), (16, 5, 4), (64, 15, 8), (33, 4, 33)):
        for variant in range(8):
            batch = 1 + variant % 3
            lp, ids, _ = _draft(rng, batch, depth, width, "peaked")
            tree = reference.build_trees(lp, ids, budget, root_tokens=np.zeros(batch, np.int32))
            target = rng.integers(0, width + 40, size=(batch, budget + 1)).astype(np.int32)
            for b in range(batch):  # follow a random child most of the time: deep walks
                for i in range(budget + 1):
                    kids = np.flatnonzero(tree.parents[b] == i)
                    if kids.size and rng.random() < 0.85:
                        target[b, i] = tree.tokens[b, rng.choice(kids)]
            stops = (rng.choice(ids.reshape(-1), size=variant % 3).astype(np.int32)
                     if ids.size else np.zeros(0, np.int32))
            caps = (rng.integers(0, depth + 3, size=batch).astype(np.int64)
                    if variant % 2 else np.zeros(0, np.int64))
            acc = reference.verify_greedy(tree, target, stop_tokens=stops.tolist(),
                                          max_commit=caps if caps.size else None)
            p = f"{count}."
            out[p + "budget"] = np.array(budget, np.int64)
            out[p + "depth"] = np.array(depth, np.int64)
            for f in ("num_nodes", "tokens", "first_child", "next_sibling"):
                out[p + f] = np.ascontiguousarray(getattr(tree, f))
            out[p + "target_tokens"] = target
            out[p + "stop_tokens"] = stops
            out[p + "max_commit"] = caps
            out[p + "expect.accepted_nodes"] = acc.accepted_nodes
            out[p + "expect.accept_length"] = acc.accept_length
            out[p + "expect.bonus_token"] = acc.bonus_token
            count += 1
    return {"count": np.array(count, np.int64), **out}


def topk_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    out: dict[str, np.ndarray] = {}
    count = 0
    for vocab in (1, 7, 1025, 8193):
        for k in sorted({0, 1, vocab // 2, vocab}):
            x = rng.standard_normal((3, vocab)).astype(np.float32) * 3
            if count % 2:
                x = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # ties
            if vocab > 1:
                x[1, ::3] = -np.inf
            lp, ids = reference.topk_logprobs(x, k)
            p = f"{count}."
            out[p + "logits"] = x
            out[p + "k"] = np.array(k, np.int64)
            out[p + "expect.logprobs"] = lp
            out[p + "expect.ids"] = ids
            count += 1
    return {"count": np.array(count, np.int64), **out}


def bad_cases() -> dict[str, np.ndarray]:
    """Builder inputs to reject: (status, message substring)."""
    base_lp = np.log(np.array([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]],
                               [[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]]], np.float32))
    base_ids = np.array([[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]], np.int32)
    cases = []

    def case(mutate, status, where, vocab=0):
        lp, ids = base_lp.copy(), base_ids.copy()
        mutate(lp, ids)
        cases.append((lp, ids, status, where, vocab))

    case(lambda lp, ids: lp.__setitem__((1, 1, 2), np.nan), KDT_ERR_VALUE, "request 1, depth 2, rank 2")
    case(lambda lp, ids: lp.__setitem__((0, 0, 0), np.inf), KDT_ERR_VALUE, "request 0, depth 1, rank 0")
    case(lambda lp, ids: lp.__setitem__((1, 0, 2), 0.0), KDT_ERR_VALUE, "request 1, depth 1, rank 2")
    case(lambda lp, ids: ids.__setitem__((1, 1, 1), 4), KDT_ERR_VALUE, "request 1, depth 2, rank 1")
    case(lambda lp, ids: ids.__setitem__((0, 1, 0), -3), KDT_ERR_OUT_OF_RANGE, "request 0, depth 2, rank 0")
    case(lambda lp, ids: ids.__setitem__((1, 0, 2), 7), KDT_ERR_OUT_OF_RANGE, "request 1, depth 1, rank 2", vocab=7)
    # The same checks when a vocabulary is given (the library may use another method).
    case(lambda lp, ids: ids.__setitem__((1, 1, 2), 5), KDT_ERR_VALUE, "request 1, depth 2, rank 2", vocab=10)
    case(lambda lp, ids: ids.__setitem__((0, 1, 1), -1), KDT_ERR_OUT_OF_RANGE, "request 0, depth 2, rank 1", vocab=10)
    out: dict[str, np.ndarray] = {"count": np.array(len(cases), np.int64)}
    for c, (lp, ids, status, where, vocab) in enumerate(cases):
        p = f"{c}."
        out[p + "logprobs"] = lp
        out[p + "token_ids"] = ids
        out[p + "budget"] = np.array(8, np.int64)
        out[p + "vocab_size"] = np.array(vocab, np.int64)
        out[p + "status"] = np.array(status, np.int64)
        out[p + "where"] = np.frombuffer(where.encode(), np.uint8).copy()
    return out


FIXTURES = {
    "trees_cases.kdtr": tree_cases,
    "verify_cases.kdtr": verify_cases,
    "topk_cases.kdtr": topk_cases,
    "bad_cases.kdtr": bad_cases,
}


def main(argv: list[str]) -> int:
    folder = Path(argv[1]) if len(argv) > 1 else ROOT / "fixtures"
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in FIXTURES.items():
        arrays = make()
        kdtr.save(folder / name, arrays)
        print(f"wrote {folder / name} ({len(arrays)} arrays, {(folder / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
