"""Writes fixtures/kdtr_sample.kdtr with the Python KDTR writer (docs/kdtr-format.md).

tests_native/test_kdtr.c reads the file and checks it against the values below, which it
hard-codes; tests_py/test_kdtr.py checks that this script still reproduces the committed
bytes. Run from anywhere:

    PYTHONPATH=python python3 tools/make_kdtr_sample.py [output path]
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from kdtree import kdtr  # noqa: E402


def sample_arrays() -> dict[str, np.ndarray]:
    """The hand-specified array set (in file order) that the fixture holds."""
    bf16_bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001, 0x7FC0], dtype=np.uint16)
    return {
        "int32_2x3": np.arange(6, dtype=np.int32).reshape(2, 3),
        # 1.0, -2.0, +inf, smallest subnormal, quiet NaN
        "bf16_bits": bf16_bits.view(ml_dtypes.bfloat16),
        "f64_scalar": np.array(1.5, dtype=np.float64),
        "empty_0x4": np.zeros((0, 4), dtype=np.float32),
        "bool_mask": np.array([True, False, True]),
        "f16_pair": np.array([0.5, -1.0], dtype=np.float16),  # bits 0x3800, 0xBC00
        "u16_\u03b2": np.array([1, 65535], dtype=np.uint16),  # a non-ASCII name: "u16_β"
        "i64_neg": np.array([-(2**63), -1, 2**63 - 1], dtype=np.int64),
    }


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else ROOT / "fixtures" / "kdtr_sample.kdtr"
    kdtr.save(out, sample_arrays())
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
