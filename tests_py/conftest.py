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
