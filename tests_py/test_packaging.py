"""`pip wheel .` (pyproject.toml: scikit-build-core over the CMake build) gives a wheel
that, installed in a fresh virtual environment, imports from outside the checkout, loads
the libkdtree inside the installed package and has the ``kdtree`` console script.

Slow: it builds the CPU library (-DKDTREE_CUDA=OFF) and creates a virtual environment,
about 30 s on an idle 2-core machine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# Prints the version the library reports, the package's folder and every mapped file
# named libkdtree (the library the process really loaded, whichever path found it).
PROBE = """
import kdtree
print(kdtree.library_version())
print(kdtree.__file__)
with open("/proc/self/maps") as maps:
    print(sorted({line.split(None, 5)[5].strip() for line in maps if "libkdtree" in line}))
"""


def _header_version() -> str:
    header = (ROOT / "include" / "kdtree.h").read_text()
    return ".".join(re.search(rf"#define KDT_VERSION_{part} (\d+)", header).group(1)
                    for part in ("MAJOR", "MINOR", "PATCH"))


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_wheel_installs_and_loads_its_own_library(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps to see which libkdtree was loaded (Linux only)")
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not on PATH (the wheel build runs the project's CMake build)")
    isolated = importlib.util.find_spec("scikit_build_core") is None  # then pip fetches it
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", str(wheels),
          "-Ccmake.define.KDTREE_CUDA=OFF", *([] if isolated else ["--no-build-isolation"])])
    (wheel,) = wheels.glob("kdtree-*.whl")
    version = _header_version()
    assert wheel.name.startswith(f"kdtree-{version}-py3-none-"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "kdtree/libkdtree.so" in names and "kdtree/__init__.py" in names, names

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    # numpy (a dependency, not installed offline) from this interpreter's environment; it
    # comes after the venv's own site-packages, so the installed kdtree is found first.
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                   .stdout.strip())
    (purelib / "outside.pth").write_text(str(Path(np.__file__).resolve().parents[1]) + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDTREE_LIBRARY", "PYTHONHOME")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = _run([str(python), "-c", PROBE], cwd=outside, env=env).stdout.splitlines()
    package = (purelib / "kdtree").resolve()
    assert probe[0] == version
    assert Path(probe[1]).resolve() == package / "__init__.py"
    assert probe[2] == repr([str(package / "libkdtree.so")])
    script = _run([str(env_dir / "bin" / "kdtree"), "--version"], cwd=outside, env=env)
    assert script.stdout.strip() == f"kdtree {version}"


def test_the_model_dependencies_agree_everywhere_they_are_named():
    """pyproject's models extra, the nox sessions' packages and the CLI's install hint name
    the same pins (kdtree is not on PyPI, so the hint never says pip install kdtree[...])."""
    import ast
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    nox_source = (ROOT / "noxfile.py").read_text()
    tree = ast.parse(nox_source)
    nox_deps = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", "") == "MODEL_DEPS")
    default_torch = nox_deps.elts[0].args[1].value  # os.environ.get("KDTREE_TORCH", <default>)
    nox_pins = [default_torch] + [e.value for e in nox_deps.elts[1:]]
    assert sorted(nox_pins) == sorted(extra)
    from kdtree.apps.generate import MODELS_HINT

    for pin in extra:
        if "==" in pin:
            assert f'"{pin}"' in MODELS_HINT, pin
    assert not re.search(r"install\s+\"?kdtree\[", MODELS_HINT)
