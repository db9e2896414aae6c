#!/usr/bin/env python3
"""CPU emulation of the CUDA tree builder's threshold descent (version 4 in
native/cuda/trees_cuda.cu), at the level of its decisions: which thresholds it tries, how
many candidates each pass enumerates, when the candidate arrays overflow. It does not
build trees (the kernel's output does not depend on these choices: any threshold sequence
ends in the same P_T, sorted the same way); it exists to tune the threshold policy without
a GPU. Scores follow the spec's arithmetic (subtract, then add, in float64).

    PYTHONPATH=python python tools/emulate_descent.py

Policies: "A" is the kernel as of 5a212dc (a frontier threshold may fall below a
threshold already known to overflow); "C" keeps every later threshold above the highest
overflowing one, interpolating log(count) between the last pass that fit and it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import kdtree  # noqa: E402


def block_threshold(values, k: int) -> float:
    """The kernel's block_threshold: a value with at least min(k, F) finite values >= it
    (two rounds of 256 bins, then the smallest value of the chosen sub-bin)."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    if len(v) == 0:
        return -math.inf
    top, bottom = float(v.max()), float(v.min())
    if top == bottom or k >= len(v):
        return bottom
    scale_a = 256.0 / (top - bottom)
    dig_a = np.minimum(255, ((top - v) * scale_a).astype(np.int64))
    cnt = np.bincount(dig_a, minlength=256)
    cum = np.cumsum(cnt)
    bin_a = int(np.argmax(cum >= k))
    k_left = k - (cum[bin_a] - cnt[bin_a])
    inside = v[dig_a == bin_a]
    dig_b = np.clip(((top - bin_a / scale_a - inside) * 256.0 * scale_a).astype(np.int64), 0, 255)
    bin_b = int(np.argmax(np.cumsum(np.bincount(dig_b, minlength=256)) >= k_left))
    return float(inside[dig_b == bin_b].min())


def enumerate_pt(lp: np.ndarray, T: float, cap: int):
    """|P_T| (stopping past cap), the chain heads below T, and whether any chain stopped at T."""
    L, K = lp.shape
    count, heads, pruned = 0, [], False
    stack = [(None, 0)]  # (parent score, or None for the root; row of the children)
    while stack:
        parent, d = stack.pop()
        if d >= L:
            continue
        w = float(lp[d, 0]) if parent is None else parent + float(lp[d, 0])
        for r in range(K):
            if math.isinf(w):
                break
            if w < T:
                pruned = True
                heads.append(w)
                break
            count += 1
            if count > cap:
                return count, heads, pruned
            stack.append((w, d + 1))
            if r + 1 < K:
                w = (w - float(lp[d, r])) + float(lp[d, r + 1])  # spec: subtract first, then add
    return count, heads, pruned


def first_threshold(lp: np.ndarray, N: int, wide_max: int = 96) -> float:
    """The kernel's first threshold: about the target-th best spine child over the first
    N/2 ranks of each row (target 3N/4 up to N = `wide_max`, else N/2): from N = 512 two
    rounds of bins (block_threshold), below that the lower edge of the chosen bin of one
    round of 256 between lp[0][0] and the lowest spine child."""
    L, K = lp.shape
    half = max(1, N // 2)
    width = min(K, half)
    target = max(1, 3 * N // 4) if N <= wide_max else half
    spine = [0.0]
    for d in range(L - 1):
        spine.append(spine[-1] + float(lp[d, 0]))
    values = [spine[d] + float(lp[d, r]) for d in range(L) for r in range(width)]
    want = min(target, L * width)
    if N >= 512:
        return block_threshold(values, want)
    finite = [v for v in values if math.isfinite(v)]
    top = float(lp[0, 0])
    low = min(finite + [top])
    if not low < top:
        return low
    scale = 256.0 / (top - low)
    bins = np.bincount([min(255, max(0, int((top - v) * scale))) for v in finite], minlength=256)
    cum = np.cumsum(bins)
    if cum[-1] < want:
        return low
    return top - (int(np.argmax(cum >= want)) + 1) / scale


def descend(lp: np.ndarray, N: int, cap: int, policy: str = "A", max_passes: int = 8, wide_max: int = 96):
    """("ok", passes, |P_T|) or ("v3", passes): the kernel would hand over to version 3."""
    T = first_threshold(lp, N, wide_max)
    kept, t_kept, over = 0, float(lp[0, 0]), None
    for p in range(max_passes):
        M, heads, pruned = enumerate_pt(lp, T, cap)
        if M > cap:  # rolled back; retried between the last pass that fit and T
            over = (T, M) if over is None or T > over[0] else over
            mid = 0.5 * (t_kept + T)
            if not T < mid < t_kept:
                return ("v3", p + 1)
            T = mid
            continue
        if M >= N or not pruned:
            return ("ok", p + 1, M)
        kept, t_kept = M, T
        T = block_threshold(heads, N - M)
        if policy == "C" and over is not None and T <= over[0]:
            f = (math.log(1.2 * N) - math.log(max(kept, 1))) / (math.log(over[1]) - math.log(max(kept, 1)))
            T = t_kept + (over[0] - t_kept) * min(max(f, 0.1), 0.9)
    return ("v3", max_passes)


def drafts(kind: str, rng: np.random.Generator, batch: int, N: int, L: int = 16, V: int = 32000) -> np.ndarray:
    """Log-probs [batch, L, N] of tools/bench_gpu.py's drafters ("peaked": randn x 1.5 with a
    hot logit of 14, rounded to bfloat16; "flat": randn x 3) or kdtree_bench_cuda's
    ("c-bench": top-1 -0.08, the rest uniform in [-14, -8])."""
    if kind == "c-bench":
        x = np.sort(rng.uniform(-14, -8, (batch, L, N)), axis=2)[:, :, ::-1].copy()
        x[:, :, 0] = -0.08
        return x.astype(np.float32)
    x = rng.standard_normal((batch, L, V)).astype(np.float32) * (1.5 if kind == "peaked" else 3.0)
    if kind == "peaked":
        x[np.arange(batch)[:, None], np.arange(L)[None, :], rng.integers(0, V, (batch, L))] = 14.0
        bits = x.view(np.uint32)  # round to bfloat16 (nearest even), as the GPU benchmark's logits are
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)
    return kdtree.topk_logprobs(x, N)[0]


def main() -> int:
    rng = np.random.default_rng(0)
    print("Passes per request (v3 = handed over) and the mean |P_T|. The first threshold aims at")
    print("3N/4 spine children up to N = 96, else N/2 (the kernel); the last column at N/2 always.\n")
    print("| drafter | N | candidates | policy A | policy C | policy C, first at N/2 |")
    print("|---|---|---|---|---|---|")
    for kind in ("peaked", "flat", "c-bench"):
        for N in (64, 256, 1024):
            cap = 4 * N if N < 1024 else 2 * N  # the kernel's arrays on an H200
            lps = drafts(kind, rng, 6, N).astype(np.float64)
            row = []
            for policy, wide_max in (("A", 96), ("C", 96), ("C", 0)):
                res = [descend(lps[b], N, cap, policy, wide_max=wide_max) for b in range(len(lps))]
                sizes = [r[2] for r in res if r[0] == "ok"]
                mean = f", mean {sum(sizes) / len(sizes):.0f}" if sizes else ""
                row.append(" ".join(f"{r[1]}" if r[0] == "ok" else f"v3({r[1]})" for r in res) + mean)
            print(f"| {kind} | {N} | {cap} | {' | '.join(row)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
