"""Shared pytest fixtures for the Python tests of kdtree.

The native library is found only through the package loader (``kdtree._native.load()``:
``KDTREE_LIBRARY``, then the package folder, then ``<repo>/build``); tests that need it
use the ``lib`` fixture (or ``pytestmark = pytest.mark.usefixtures("lib")``) and are
skipped, with the loader's message, when it is not built.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:  # the tests are normally run with PYTHONPATH=python; fall back to this checkout's copy
    import kdtree  # noqa: F401
except ImportError:  # pragma: no cover - depends on how pytest is launched
    sys.path.insert(0, str(ROOT / "python"))


# Markers (``pytest -m "not models and not slow"`` runs the quick core tests):
#   gpu     needs a CUDA GPU (the tests using the ``cuda_device`` fixture)
#   models  loads torch / transformers models (the transformer engine, drafter, apps)
#   slow    takes tens of seconds or more (training smoke test, packaging)
MODEL_MODULES = {"test_hf", "test_drafter", "test_generate_cli", "test_train_smoke"}
SLOW_MODULES = {"test_train_smoke", "test_packaging"}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with the reason where there is none)")
    config.addinivalue_line("markers", "models: loads torch / transformers models")
    config.addinivalue_line("markers", "slow: takes tens of seconds or more")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if "cuda_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
        if module in MODEL_MODULES:
            item.add_marker(pytest.mark.models)
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def _load_native():
    """(library, None) or (None, reason) without raising."""
    from kdtree import _native as _lib

    try:
        return _lib.load(), None
    except Exception as exc:  # noqa: BLE001 - any load failure means "skip", with its text
        return None, f"libkdtree is not built or not loadable ({type(exc).__name__}: {exc})"


@pytest.fixture(scope="session")
def lib():
    """The loaded, declared libkdtree (ctypes.CDLL); skips the test when it is not built."""
    loaded, reason = _load_native()
    if loaded is None:
        pytest.skip(reason)
    return loaded


@pytest.fixture(scope="session")
def cuda_device(lib):
    """torch's first CUDA device, for tests of the GPU paths; skips the test where torch is
    missing or sees no GPU, or where libkdtree was built without CUDA."""
    import ctypes

    from kdtree import KdtreeError

    torch = pytest.importorskip("torch", reason="torch is not installed (the GPU tests use torch tensors)")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device (these tests need a GPU)")
    count = ctypes.c_int32()
    try:
        lib.kdt_cuda_device_count(ctypes.byref(count))
    except KdtreeError as exc:
        pytest.skip(f"libkdtree has no usable CUDA: {exc}")
    return torch.device("cuda", 0)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout's root folder (the one holding include/, python/, build/)."""
    return ROOT


# Runs a rank's script, then leaves without torch's process-group teardown: after a
# barrier (every rank's results are written) the process ends by os._exit. Teardown
# through destroy_process_group or interpreter exit has aborted a rank now and then with
# "terminate called without an active exception" and no Python traceback, after
# transformers' tensor-parallel load (CI runs of 2026-12-04 and 2026-12-05), after the
# rank had written its results. The script's own exit status and traceback are kept.
_RANK_LAUNCHER = """
import os, runpy, sys, traceback
sys.argv = sys.argv[1:]
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
except BaseException:
    traceback.print_exc()
    code = 1
try:
    import torch.distributed as dist
    if code == 0 and dist.is_initialized():
        dist.barrier()
except Exception:
    traceback.print_exc()
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


@pytest.fixture
def spawn_ranks(lib, tmp_path):
    """A function running ``script`` (Python source) as ``world`` processes of one
    torch.distributed world on this machine (gloo): each gets MASTER_ADDR/MASTER_PORT,
    RANK, WORLD_SIZE and LOCAL_RANK, this checkout's package and library, and the
    arguments ``args(rank)``; every process must exit 0 within ``timeout`` seconds (else
    the test fails with its output). A script that leaves its process group initialized
    ends with a barrier and no teardown (see _RANK_LAUNCHER). Returns the processes'
    outputs. Skips without torch or its gloo backend."""
    import os
    import socket
    import subprocess

    import kdtree
    from kdtree import _native as _lib

    torch = pytest.importorskip("torch", reason="torch is not installed (the distributed tests use torch)")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")

    def run(script: str, world: int, args=lambda rank: [], timeout: float = 180.0) -> list[str]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        path = tmp_path / f"rank_script_{port}.py"
        path.write_text(script)
        pythonpath = os.pathsep.join([str(Path(kdtree.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
        procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONPATH=pythonpath,
                       KDTREE_LIBRARY=str(_lib.load()._kdtree_path))
            procs.append(subprocess.Popen([sys.executable, "-c", _RANK_LAUNCHER, str(path), *map(str, args(rank))],
                                          env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"a rank did not finish within {timeout:.0f} s")
            assert p.returncode == 0, text[-3000:]
            outputs.append(text)
        return outputs

    return run
