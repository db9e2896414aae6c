#!/usr/bin/env python3
"""Counts of the CUDA top-k row kernel's candidate work (native/cuda/topk_cuda.cu,
topk_row_kernel, 16-bit logits) on the host, for the kernel as of 5be2785 (element keys made
from staged vectors; 52a5a52 replaced them with vector keys) and for other starting
thresholds. It models, per row: the trips of 256 vectors of 8 logits (thread tid
of warp w holds vectors j * 128 + tid, j = 0, 1), the first threshold t0, the vectors
staged in each warp's list (max >= tau's value), the 32-element key passes (whole passes
of 4 vectors, at most 64 vectors a warp a trip, made at the next trip's start), the keys
that pass tau, and the refines (more than refine_at keys: keep `retain`, tau = the
smallest kept key - 1). It does not time anything; it exists to compare starting rules
by the work they leave, before writing a kernel. Meant for rows much longer than a trip:
the last trip's padding is modelled as -inf logits (the kernel reads the row's edges
element by element instead), so short rows count keys the kernel never makes.

Rules (--start):
  warp-max   the kernel: each warp takes the ceil(k / 4)-th largest of its 32 thread maxima
             over trip 0 (16 logits a thread), t0 is the smallest of the 4 warps' values;
  block-max  t0 = the k-th largest of the block's 128 thread maxima over trip 0;
  exact      t0 = the exact k-th largest logit of trip 0 (a block select over 2,048);
  warp-maxN  as warp-max, over the first N trips (each thread's max of 16 N logits; the
             trips' vectors are kept in shared memory, then staged against t0).

    python tools/emulate_topk_start.py --rows 64
"""

from __future__ import annotations

import argparse
import math

import numpy as np

NT, U, WARPS = 128, 2, 4
VEC = 8  # 16-bit logits in a 16-byte vector
TRIP = NT * U  # vectors a trip
PASS_VECS = 32 // VEC
MAX_VECS_A_TRIP = 32 * U  # key making per warp per trip


def order_keys(values: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """The kernel's element keys: order key of the float32 value (-0 as +0) in the high
    word, ~column in the low word, so ties go to the lower column."""
    v = values.astype(np.float32)
    v = np.where(v == 0, np.float32(0), v)
    u = v.view(np.uint32).astype(np.uint64)
    ok = np.where(u & 0x80000000, (~u) & 0xFFFFFFFF, u | 0x80000000)
    return (ok << np.uint64(32)) | ((~columns.astype(np.uint64)) & np.uint64(0xFFFFFFFF))


def value_of(key: int) -> float:
    """tau's value rounded down, as the kernel's tv (keys above the top word's NaN codes)."""
    th = key >> 32
    if th <= 0x007FFFFF:  # -inf's key and below (NaN codes): every value passes
        return -math.inf
    u = th & 0x7FFFFFFF if th & 0x80000000 else (~th) & 0xFFFFFFFF
    return float(np.array([u], np.uint32).view(np.float32)[0])


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and back."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def warp_t0(vmax_by_thread: np.ndarray, k: int) -> float:
    """The kernel's t0: per warp the ceil(k / 4)-th largest of 32 thread maxima, then the
    smallest over the warps."""
    j = math.ceil(k / WARPS)
    per = np.sort(vmax_by_thread.reshape(WARPS, 32), axis=1)[:, ::-1]
    return float(per[:, j - 1].min())


def run_row(row: np.ndarray, k: int, start: str, retain: int, refine_at: int) -> dict:
    n = len(row)
    trips = -(-n // (TRIP * VEC))
    frame = np.full(trips * TRIP * VEC, -np.inf, np.float32)
    frame[:n] = row
    vecs = frame.reshape(trips, U, NT, VEC)  # [trip, j, tid, element]
    cols = np.arange(trips * TRIP * VEC, dtype=np.int64).reshape(trips, U, NT, VEC)
    stats = dict(staged=0, passes=0, keys=0, refines=0, staging_trips=0)
    buf: list[np.ndarray] = []
    count = 0
    tau = 0
    tv = -math.inf
    lists: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(WARPS)]

    def make_keys(w: int, q: int) -> None:
        nonlocal count
        take, lists[w][:] = lists[w][:q], lists[w][q:]
        stats["passes"] += q // PASS_VECS
        if not take:
            return
        x = np.concatenate([t[0] for t in take])
        c = np.concatenate([t[1] for t in take])
        sel = x >= tv
        keys = order_keys(x[sel], c[sel])
        keys = keys[keys > np.uint64(tau)]
        stats["keys"] += len(keys)
        buf.append(keys)
        count += len(keys)

    def refine() -> None:
        nonlocal count, tau, tv, buf
        allk = np.sort(np.concatenate(buf))[::-1]
        kept = allk[: max(k, min(retain, len(allk)))]
        buf = [kept]
        count = len(kept)
        tau = int(kept[-1]) - 1
        tv = value_of(tau)
        stats["refines"] += 1

    def stage(t: int) -> None:
        vm = vecs[t].max(axis=2)  # [j, tid]
        want = vm >= tv
        if want.any():
            stats["staging_trips"] += 1
        for j in range(U):
            for w in range(WARPS):
                lanes = np.flatnonzero(want[j, w * 32 : (w + 1) * 32]) + w * 32
                for tid in lanes:
                    lists[w].append((vecs[t, j, tid], cols[t, j, tid]))
                stats["staged"] += len(lanes)

    def trip_start() -> None:
        for w in range(WARPS):
            ns = len(lists[w])
            if ns >= PASS_VECS:
                make_keys(w, min(ns - ns % PASS_VECS, MAX_VECS_A_TRIP))

    first = 1
    if start.startswith("warp-max") and start != "warp-max":
        first = int(start[len("warp-max"):])
    first = min(first, trips)
    # The first `first` trips set t0, then are staged against it.
    if start == "exact":
        t0 = float(np.sort(vecs[0].reshape(-1))[::-1][k - 1])
    elif start == "block-max":
        t0 = float(np.sort(vecs[0].max(axis=(0, 2)))[::-1][k - 1])
    else:
        tmax = vecs[:first].max(axis=(0, 1, 3))  # [tid]: the thread's max over the trips
        t0 = warp_t0(tmax, k)
    tau = int(order_keys(np.array([t0], np.float32), np.array([0xFFFFFFFF]))[0]) - 1
    tv = value_of(tau)
    for t in range(first):
        trip_start()
        stage(t)
        if count > refine_at:
            refine()
    for t in range(first, trips):
        trip_start()
        stage(t)
        if count > refine_at:
            refine()
    for w in range(WARPS):  # the row's end: every list's keys
        make_keys(w, len(lists[w]))
        stats["passes"] += 1 if len(lists[w]) % PASS_VECS else 0
    top = np.sort(np.concatenate(buf))[::-1][:k]
    want = np.sort(order_keys(frame[:n], np.arange(n)))[::-1][:k]
    assert np.array_equal(top, want), "the emulation lost a top-k element"
    return stats


def rows(kind: str, n: int, vocab: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        x = rng.standard_normal(vocab).astype(np.float32)
        if kind == "peaked":  # tools/bench_gpu.py's drafter_logits
            x *= 1.5
            x[rng.integers(vocab)] = 14.0
        out.append(bf16(x))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--kind", choices=["peaked", "flat"], default="peaked")
    ap.add_argument("--starts", default="warp-max,block-max,exact,warp-max2,warp-max4")
    args = ap.parse_args()
    k = args.k
    retain, refine_at = k + max(k // 4, 8), max(3 * k, 192)
    data = rows(args.kind, args.rows, args.vocab, np.random.default_rng(1))
    print(f"{args.rows} {args.kind} rows, V = {args.vocab}, k = {k}, refine_at {refine_at}, retain {retain}")
    print("| start | staged vectors | key passes | keys | refines | trips staging |  (means a row)")
    print("|---|---|---|---|---|---|")
    for start in args.starts.split(","):
        tot: dict[str, float] = {}
        for r in data:
            for name, v in run_row(r, k, start, retain, refine_at).items():
                tot[name] = tot.get(name, 0) + v / len(data)
        print(f"| {start} | {tot['staged']:.0f} | {tot['passes']:.0f} | {tot['keys']:.0f} | "
              f"{tot['refines']:.1f} | {tot['staging_trips']:.1f} |")


if __name__ == "__main__":
    main()
