"""Sessions for building, testing and running kdtree (``nox -l`` lists them).

The two commands a new machine needs (README):
    nox -s demo          # the main job: DDTree speculative decoding on standard-library text
    nox -s build test    # build libkdtree and run every native and Python test

Only Python 3.11+, CMake >= 3.20 and a C compiler are required. The library is built into
``build/``; the Python package is used from ``python/`` (PYTHONPATH), so nothing is
installed outside nox's virtual environments.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
BUILD = ROOT / "build"
PYTHON_DEPS = ["numpy>=1.26", "ml_dtypes>=0.4", "tqdm>=4.60"]
# scikit-build-core: tests_py/test_packaging.py builds the wheel without fetching it.
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "scikit-build-core>=0.10"]
# The transformer engine (kdtree.hf, kdtree.drafter): transformers is pinned to the release
# the tests run against. torch stays below 2.14 so that machines holding a local CPU wheel
# of 2.13 use it; KDTREE_TORCH overrides the requirement (e.g. "torch==2.14.1"). accelerate:
# transformers' tensor-parallel loading (load_causal_lm(tp=True), generate --tp) needs it.
MODEL_DEPS = [os.environ.get("KDTREE_TORCH", "torch>=2.4,<2.14"), "transformers==5.24.0", "tokenizers==0.23.3",
              "safetensors==0.8.0", "matplotlib>=3.7", "accelerate==1.16.0"]

nox.options.sessions = ["build", "test"]
nox.options.reuse_existing_virtualenvs = True


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT / "python"), "PYTHONUNBUFFERED": "1"}


def _cmake_build(session: nox.Session, *extra: str, target: str | None = None) -> None:
    """Configures (warnings are errors under CI=true or KDTREE_WERROR=1) and builds
    everything the build folder is configured for, or only `target`."""
    werror = "ON" if os.environ.get("CI") or os.environ.get("KDTREE_WERROR") == "1" else "OFF"
    session.run("cmake", "-S", str(ROOT), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release",
                f"-DKDTREE_WERROR={werror}", *extra, external=True)
    jobs = str(os.cpu_count() or 2)
    session.run("cmake", "--build", str(BUILD), "--parallel", jobs, *(["--target", target] if target else []),
                external=True)


@nox.session(python=False)
def build(session: nox.Session) -> None:
    """Build libkdtree.so, the native tests and the C example into build/ with CMake."""
    _cmake_build(session, *session.posargs)


@nox.session
def test(session: nox.Session) -> None:
    """Run the native tests (ctest; GPU tests skip without a GPU) and pytest; builds first."""
    _cmake_build(session)
    session.install(*PYTHON_DEPS, *TEST_DEPS, *MODEL_DEPS)
    # the torch operators' C++ CUDA kernels, for the torch just installed (skipped with a
    # notice without a C++ compiler; CI, which has one, checks that they load)
    python = str(Path(session.bin) / "python")
    _cmake_build(session, "-DKDTREE_TORCH_OPS=AUTO", f"-DPython3_EXECUTABLE={python}")
    session.run("ctest", "--test-dir", str(BUILD), "-L", "cpu", "--output-on-failure", external=True)
    # GPU tests (built when nvcc is found) skip with exit 77 where there is no GPU; -V shows
    # their output, which states why.
    session.run("ctest", "--test-dir", str(BUILD), "-L", "cuda", "-V", "--no-tests=ignore", external=True)
    env = _env()
    if os.environ.get("CI"):
        env["KDTREE_EXPECT_TORCH_OPS"] = env["KDTREE_TORCH_OPS"] = "1"
    session.run("python", "-m", "pytest", str(ROOT / "tests_py"), "-q", "-rs", *session.posargs, env=env)


@nox.session
def fixtures(session: nox.Session) -> None:
    """Regenerate fixtures/*.kdtr from the Python reference (tests check they are current)."""
    session.install(*PYTHON_DEPS)
    session.run("python", str(ROOT / "tools" / "make_fixtures.py"), env=_env())
    session.run("python", str(ROOT / "tools" / "make_kdtr_sample.py"), env=_env())


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: lossless DDTree decoding of the shipped transformer pair on CPU.

    Extra arguments go to ``python -m kdtree demo`` (e.g. ``nox -s demo -- --budget 256``,
    ``-- --plot round.png``, or ``-- --model ngram`` for the byte n-gram pair).
    """
    _cmake_build(session, target="kdtree")
    session.install(*PYTHON_DEPS, *MODEL_DEPS)
    session.run("python", "-m", "kdtree", "demo", *session.posargs, env=_env())


@nox.session
def bench(session: nox.Session) -> None:
    """C tree builder vs the Python reference, side by side (prints a table)."""
    _cmake_build(session)
    session.install(*PYTHON_DEPS)
    session.run("python", str(ROOT / "tools" / "bench_trees.py"), *session.posargs, env=_env())


@nox.session(name="bench-gpu", python=False, default=False)
def bench_gpu(session: nox.Session) -> None:
    """GPU kernels vs the published torch + host-heap path (device machine; needs torch).

    Uses the ``python`` on PATH (torch is large and GPU machines often have no network):
    run it where ``python -c "import torch"`` works, as ``python -m nox -s bench-gpu`` if a
    version manager's shim would pick another interpreter. Builds libkdtree with CUDA first,
    which stays in the build's CMake cache (``nox -s build -- -DKDTREE_CUDA=AUTO`` resets it),
    with the GPU benchmark programs of tools/ (KDTREE_BUILD_BENCHMARKS=ON, also kept).
    """
    if subprocess.run(["python", "-c", "import torch"], capture_output=True).returncode != 0:
        session.error(
            "bench-gpu needs torch: `python -c 'import torch'` fails for the python on PATH "
            f"({shutil.which('python')}); run `python -m nox -s bench-gpu` with an interpreter that has torch"
        )
    _cmake_build(session, "-DKDTREE_CUDA=ON", "-DKDTREE_BUILD_BENCHMARKS=ON")
    session.run("python", str(ROOT / "tools" / "bench_gpu.py"), *session.posargs, env=_env(), external=True)


@nox.session(name="bench-engine", python=False, default=False)
def bench_engine(session: nox.Session) -> None:
    """The batched engine on a GPU, side by side: AR, the chain and DDTree (N = 16 .. 256 and
    auto) at B = 1, 4, 16, 64, the single-sequence engine and transformers' generate; with
    ``-- --qwen3-8b`` also the Qwen3-8B-shaped round timings and projection (device machine).

    Uses the ``python`` on PATH, which must have torch with CUDA and transformers (as
    bench-gpu); builds libkdtree with CUDA first. Arguments go to
    ``tools/bench_engine_gpu.py`` (``-- --help``).
    """
    if subprocess.run(["python", "-c", "import torch, transformers"], capture_output=True).returncode != 0:
        session.error("bench-engine needs torch and transformers for the python on PATH "
                      f"({shutil.which('python')})")
    _cmake_build(session, "-DKDTREE_CUDA=ON", target="kdtree")
    session.run("python", str(ROOT / "tools" / "bench_engine_gpu.py"), *session.posargs, env=_env(), external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check on the project's Python code (and clang-format differences, advisory).

    Only the project's own Python is checked (python/, tests_py/, tools/, noxfile.py), so a
    script of yours in the checkout (say, a --prompt-file for the demo) does not fail it.
    clang-format, when installed, prints where the C code differs from .clang-format but
    does not fail the session.
    """
    session.install("ruff==0.17.6")
    session.run("ruff", "check", *(str(ROOT / p) for p in ("python", "tests_py", "tools", "noxfile.py")))
    found = session.run("which", "clang-format", external=True, silent=True, success_codes=[0, 1])
    if found:
        files = [str(p) for d in ("include", "native", "tests_native") for p in sorted((ROOT / d).glob("*.[ch]"))]
        session.run("clang-format", "--dry-run", *files, external=True)
    else:
        session.log("clang-format not installed: C formatting not checked")


# ---- Sanitizers and fuzzing -----------------------------------------------------------------

# pytest files that drive libkdtree through ctypes and need no torch: run against the ASan build.
SANITIZE_PYTESTS = ["test_adversarial.py", "test_bindings.py", "test_fixtures.py", "test_handworked.py",
                    "test_kdtr.py", "test_parity.py", "test_properties.py"]
ASAN_FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
TSAN_FLAGS = "-fsanitize=thread -g"


def _sanitizer_build(session: nox.Session, folder: Path, flags: str, *targets: str) -> None:
    """Configures and builds the CPU library (and tests) in its own folder with these flags."""
    session.run("cmake", "-S", str(ROOT), "-B", str(folder), "-DKDTREE_CUDA=OFF",
                "-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}",
                f"-DCMAKE_EXE_LINKER_FLAGS={flags}", f"-DCMAKE_SHARED_LINKER_FLAGS={flags}", external=True)
    target_args = ["--target", *targets] if targets else []
    session.run("cmake", "--build", str(folder), "--parallel", str(os.cpu_count() or 2), *target_args,
                external=True)


def _asan_runtime(session: nox.Session, folder: Path) -> str:
    """The ASan runtime of the compiler that built `folder` (to LD_PRELOAD into Python)."""
    cache = (folder / "CMakeCache.txt").read_text()
    compiler = re.search(r"^CMAKE_C_COMPILER:\w+=(.*)$", cache, re.M).group(1)
    for name in ("libasan.so", "libclang_rt.asan-x86_64.so", "libclang_rt.asan.so"):
        found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if os.path.isabs(found) and os.path.exists(found):
            return found
    session.error(f"cannot find the ASan runtime of {compiler} (tried -print-file-name=libasan.so and clang's)")


@nox.session(default=False)
def sanitize(session: nox.Session) -> None:
    """ASan + UBSan and TSan runs of the CPU library (build-asan/, build-tsan/; CUDA off).

    build-asan: -fsanitize=address,undefined (UBSan errors fatal); ctest -L cpu on it, then the
    pytest files that drive the library without torch, against that .so (KDTREE_LIBRARY, the
    ASan runtime preloaded, leak checks off for Python). build-tsan: -fsanitize=thread, and
    tests_native/test_threads.c (the CPU entry points from 8 threads at once) under it.
    Extra arguments go to pytest. Needs only gcc (its sanitizer runtimes ship with it).
    """
    asan = ROOT / "build-asan"
    _sanitizer_build(session, asan, ASAN_FLAGS)
    # example_installed builds a separate, uninstrumented program against `cmake --install` of
    # this build: an ASan library under it fails ASan's runtime-first check, not the code
    # (the test session runs it on the plain build).
    session.run("ctest", "--test-dir", str(asan), "-L", "cpu", "-E", "^example_installed$", "--output-on-failure",
                external=True, env={"UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
    session.install(*PYTHON_DEPS, *TEST_DEPS)
    session.run("python", "-m", "pytest", *(str(ROOT / "tests_py" / f) for f in SANITIZE_PYTESTS), "-q", "-rs",
                "-p", "no:cacheprovider", *session.posargs,
                env={**_env(), "KDTREE_LIBRARY": str(asan / "libkdtree.so"), "LD_PRELOAD": _asan_runtime(session, asan),
                     "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})
    tsan = ROOT / "build-tsan"
    _sanitizer_build(session, tsan, TSAN_FLAGS, "test_threads")
    session.run("ctest", "--test-dir", str(tsan), "-R", "^test_threads$", "--output-on-failure", external=True,
                env={"TSAN_OPTIONS": "halt_on_error=1 second_deadlock_stack=1"})


def _clang_fuzzer_works(clang: str) -> bool:
    """True when `clang` can link a libFuzzer target with ASan and UBSan."""
    if shutil.which(clang) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "t.c"
        src.write_text("#include <stddef.h>\n#include <stdint.h>\n"
                       "int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) { (void)d; (void)n; return 0; }\n")
        probe = subprocess.run([clang, "-fsanitize=fuzzer,address,undefined", str(src), "-o", str(Path(tmp) / "t")],
                               capture_output=True)
    return probe.returncode == 0


def _ensure_clang(session: nox.Session) -> str:
    """clang with libFuzzer; installs it with apt-get (as root, Debian/Ubuntu) when missing."""
    clang = os.environ.get("CLANG", "clang")
    if _clang_fuzzer_works(clang):
        return clang
    hint = "install clang and its runtimes (Debian 12: apt-get install -y clang libclang-rt-14-dev)"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        session.error(f"{clang} cannot build libFuzzer targets: {hint}")
    session.run("apt-get", "update", external=True)
    session.run("apt-get", "install", "-y", "clang", external=True)
    version = subprocess.run([clang, "--version"], capture_output=True, text=True).stdout
    major = re.search(r"version (\d+)", version)
    if not _clang_fuzzer_works(clang) and major:
        session.run("apt-get", "install", "-y", f"libclang-rt-{major.group(1)}-dev", external=True)
    if not _clang_fuzzer_works(clang):
        session.error(f"{clang} still cannot build libFuzzer targets: {hint}")
    return clang


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """libFuzzer runs of the KDTR reader, tree build + verify and top-k (fuzz/; needs clang).

    ``nox -s fuzz -- 600`` fuzzes for 600 seconds in all (default 60), split evenly over the
    three targets, seeded from fixtures/; corpora stay in build-fuzz/corpus/ and findings go
    to build-fuzz/findings/. Then every KDTR corpus and crash file goes through the C and the
    Python reader, which must agree. Prints execs and findings per target; fails on any.
    Installs clang with apt-get when it is missing and this runs as root.
    """
    clang = _ensure_clang(session)
    session.install(*PYTHON_DEPS)
    session.run("python", str(ROOT / "fuzz" / "run.py"), *session.posargs, env={**_env(), "CLANG": clang})
