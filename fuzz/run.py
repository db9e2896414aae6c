"""Builds the libFuzzer targets of fuzz/, seeds them from fixtures/, runs them for a total
time box, then checks the KDTR corpus differentially against the Python reader.

    python fuzz/run.py [SECONDS]      (default 60: the total, split evenly over the targets)

Targets (each compiled with clang -fsanitize=fuzzer,address,undefined together with the
library's C sources, so the library itself is instrumented):
    kdtr   the KDTR reader (fuzz/fuzz_kdtr.c); seeds: the small fixtures and one small file
           per array of every fixture
    trees  tree build + greedy verify against a reference builder (fuzz/fuzz_trees.c);
           seeds: the cases of fixtures/trees_cases.kdtr
    topk   top-k log-probs against a long double reference (fuzz/fuzz_topk.c); seeds:
           the cases of fixtures/topk_cases.kdtr
Corpora stay in build-fuzz/corpus/<target> between runs; findings (crash-*, timeout-*,
oom-*, leak-*) go to build-fuzz/findings/. Environment: CLANG (default clang).

Prints per target the executions, the corpus size and the findings; exits 1 when a target
found something or the differential check disagrees.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build-fuzz"
sys.path.insert(0, str(ROOT / "python"))

from kdtree import kdtr  # noqa: E402  (after the path insert)

LIB_SOURCES = ["status.c", "trees.c", "verify.c", "topk.c", "kdtr.c", "cuda_stubs.c"]
CFLAGS = ["-g", "-O1", "-std=c11", "-D_POSIX_C_SOURCE=200809L", "-DKDT_BUILDING_LIBRARY",
          "-ffp-contract=off", "-fno-omit-frame-pointer", f"-I{ROOT / 'include'}", f"-I{ROOT / 'native'}"]
SANITIZE = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined"]
TARGETS = {  # name: libFuzzer options
    "kdtr": ["-max_len=8192", f"-dict={ROOT / 'fuzz' / 'kdtr.dict'}"],
    "trees": ["-max_len=1024"],
    "topk": ["-max_len=5000"],
}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def build(clang: str) -> None:
    """The three targets and a plain shared library for the differential check."""
    (OUT / "obj").mkdir(parents=True, exist_ok=True)
    objs = []
    for src in LIB_SOURCES:
        obj = OUT / "obj" / (src + ".o")
        run([clang, *CFLAGS, "-fsanitize=fuzzer-no-link,address,undefined", "-fno-sanitize-recover=undefined",
             "-c", ROOT / "native" / src, "-o", obj])
        objs.append(obj)
    for name in TARGETS:
        run([clang, *CFLAGS, *SANITIZE, ROOT / "fuzz" / f"fuzz_{name}.c", *objs, "-lm", "-o",
             OUT / f"fuzz_{name}"])
    run([clang, *CFLAGS, "-shared", "-fPIC", "-fvisibility=hidden",
         *(ROOT / "native" / s for s in LIB_SOURCES), "-lm", "-o", OUT / "libkdtree_plain.so"])


# ---- Seeds from the fixtures ------------------------------------------------------------------


def _cases(path: Path) -> list[dict[str, np.ndarray]]:
    d = kdtr.load(path)
    return [{k.split(".", 1)[1]: v for k, v in d.items() if k.startswith(f"{i}.")} for i in range(int(d["count"]))]


def seed_kdtr(corpus: Path) -> int:
    n = 0
    for f in sorted((ROOT / "fixtures").glob("*.kdtr")):
        data = f.read_bytes()
        if len(data) <= 8192:
            (corpus / f"seed-{f.stem}").write_bytes(data)
            n += 1
        arrays = kdtr.load(f)
        for i, (name, a) in enumerate(list(arrays.items())[:24]):
            small = a.reshape(-1)[:12] if a.ndim else a
            (corpus / f"seed-{f.stem}-{i}").write_bytes(kdtr.dumps({name: small, "z": a.reshape(-1)[:0]}))
            n += 1
    return n


def seed_trees(corpus: Path) -> int:
    n = 0
    for i, c in enumerate(_cases(ROOT / "fixtures" / "trees_cases.kdtr")):
        lp, ids = c["logprobs"][:2, :6, :5], c["token_ids"][:2, :6, :5]
        b, depth, k = lp.shape
        if b == 0:
            continue
        budget = min(int(c["budget"]), 24)
        vocab = int(c["vocab_size"])
        small_ids = bool(ids.size == 0 or (ids.min() >= 0 and ids.max() < 64))
        flags = 16 | (0 if small_ids else 32) | (1 if vocab > 0 and small_ids else 0) | 2 | 4
        pad = int(c["pad_token"])
        head = bytes([b - 1, depth, k, budget, flags, 255 if pad < 0 else pad % 255, i % 3, 5, 9])[: 7 + i % 3]
        roots = c.get("root_tokens", np.zeros(b, np.int32))
        positions = c.get("root_positions", np.zeros(b, np.int64))
        per = b"".join(bytes([int(roots[j]) % 64 if j < roots.size else 0,
                              int(positions[j]) & 255 if j < positions.size else 0, 0, 3]) for j in range(b))
        ids_bytes = ids.astype(np.uint8).tobytes() if small_ids else ids.astype("<i4").tobytes()
        targets = bytes((7 * j + i) % 256 for j in range(b * (budget + 1)))
        (corpus / f"seed-trees-{i}").write_bytes(head + per + lp.astype("<f4").tobytes() + ids_bytes + targets)
        n += 1
    return n


def seed_topk(corpus: Path) -> int:
    n = 0
    for i, c in enumerate(_cases(ROOT / "fixtures" / "topk_cases.kdtr")):
        x = c["logits"][:4, :300]
        rows, vocab = x.shape
        if rows == 0 or vocab == 0:
            continue
        k = min(int(c["k"]), vocab, 255)
        head = bytes([rows - 1]) + struct.pack("<H", vocab - 1) + bytes([k, 0, 1])
        (corpus / f"seed-topk-{i}").write_bytes(head + x.astype("<f4").tobytes())
        n += 1
    return n


SEEDERS = {"kdtr": seed_kdtr, "trees": seed_trees, "topk": seed_topk}


# ---- Running ----------------------------------------------------------------------------------


def _why(name: str, text: str) -> str:
    """The first line that says what went wrong: the target's own check, or a sanitizer's."""
    for line in text.splitlines():
        if line.startswith(f"fuzz_{name}:") or "runtime error:" in line or "ERROR: AddressSanitizer" in line:
            return line.strip()
    for line in text.splitlines():
        if line.startswith("SUMMARY:") or "ERROR: libFuzzer" in line:
            return line.strip()
    return "(no message)"


def fuzz(name: str, seconds: int) -> dict:
    """Runs one target in libFuzzer's fork mode, which keeps fuzzing after a finding (each
    written to build-fuzz/findings/); then replays each finding to name what it found."""
    corpus = OUT / "corpus" / name
    findings = OUT / "findings"
    corpus.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    seeds = SEEDERS[name](corpus)
    before = set(findings.iterdir())
    log = OUT / f"fuzz_{name}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(OUT / f"fuzz_{name}"), str(corpus), f"-max_total_time={seconds}", "-timeout=10",
             "-fork=1", "-ignore_crashes=1", "-ignore_timeouts=1", "-ignore_ooms=1",
             f"-artifact_prefix={findings}/{name}-", *TARGETS[name]],
            stdout=out, stderr=subprocess.STDOUT,
        )
    elapsed = time.monotonic() - start
    text = log.read_text(errors="replace")
    execs = re.findall(r"^#(\d+): cov:", text, re.M)
    new = sorted(set(findings.iterdir()) - before)
    kinds: dict[str, list[Path]] = {}
    for f in new[:50]:
        replay = subprocess.run([str(OUT / f"fuzz_{name}"), str(f)], capture_output=True, text=True,
                                errors="replace", timeout=120)
        why = _why(name, replay.stdout + replay.stderr)
        kinds.setdefault(re.sub(r"-?\d[\d.e+-]*", "#", why), []).append(f)
    return {"name": name, "seconds": elapsed, "execs": int(execs[-1]) if execs else 0,
            "corpus": sum(1 for _ in corpus.iterdir()), "seeds": seeds, "findings": new, "kinds": kinds,
            "rc": proc.returncode, "log": log}


def main(argv: list[str]) -> int:
    total = int(argv[0]) if argv else 60
    clang = os.environ.get("CLANG", "clang")
    if shutil.which(clang) is None:
        print(f"{clang} not found: install clang (Debian: apt-get install -y clang libclang-rt-14-dev)")
        return 2
    t0 = time.monotonic()
    build(clang)
    print(f"built the targets in {time.monotonic() - t0:.0f} s")
    each = max(1, total // len(TARGETS))
    results = [fuzz(name, each) for name in TARGETS]
    bad = 0
    print(f"\n{'target':8} {'seconds':>8} {'execs':>10} {'execs/s':>9} {'corpus':>7}  findings")
    for r in results:
        print(f"{r['name']:8} {r['seconds']:8.0f} {r['execs']:10d} {r['execs'] / max(r['seconds'], 1e-9):9.0f} "
              f"{r['corpus']:7d}  {len(r['findings'])} ({len(r['kinds'])} distinct"
              f"{' among the first 50' if len(r['findings']) > 50 else ''})")
        for files in r["kinds"].values():
            replay = subprocess.run([str(OUT / f"fuzz_{r['name']}"), str(files[0])], capture_output=True,
                                    text=True, errors="replace", timeout=120)
            print(f"    {len(files)} x {_why(r['name'], replay.stdout + replay.stderr)}")
            print(f"      e.g. {files[0]}")
        if r["findings"] or r["rc"] != 0:
            bad += 1
            if not r["findings"]:
                print(f"    exit status {r['rc']}; see {r['log']}")
    kdtr_inputs = [OUT / "corpus" / "kdtr", *(f for f in (OUT / "findings").glob("kdtr-*"))]
    diff = subprocess.run([sys.executable, str(ROOT / "fuzz" / "kdtr_diff.py"), str(OUT / "libkdtree_plain.so"),
                           *map(str, kdtr_inputs)])
    if diff.returncode != 0:
        bad += 1
    print(f"fuzz: {total} s budget, {time.monotonic() - t0:.0f} s in all; "
          f"{'no findings' if bad == 0 else f'{bad} problem(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
