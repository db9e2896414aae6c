"""The committed fixtures/*.kdtr are exactly what tools/make_fixtures.py writes today from
the reference (regenerate with `nox -s fixtures` after changing the reference or the
generator)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from kdtree import kdtr

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "tools" / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


@pytest.mark.parametrize("name", sorted(GEN.FIXTURES))
def test_committed_fixture_is_current(name, tmp_path):
    committed = ROOT / "fixtures" / name
    assert committed.is_file(), f"{committed} is missing: run `nox -s fixtures`"
    fresh = tmp_path / name
    kdtr.save(fresh, GEN.FIXTURES[name]())
    if fresh.read_bytes() != committed.read_bytes():
        old, new = kdtr.load(committed), kdtr.load(fresh)
        changed = [k for k in new if k not in old or not np.array_equal(old[k], new[k], equal_nan=False)]
        pytest.fail(f"{name} is stale ({len(changed)} arrays differ, e.g. {changed[:3]}): run `nox -s fixtures`")


def test_fixtures_hold_cases():
    data = kdtr.load(ROOT / "fixtures" / "trees_cases.kdtr")
    count = int(data["count"])
    assert count >= 50
    # Every case has the inputs and all ten expected fields.
    for c in range(count):
        for field in GEN.TREE_FIELDS:
            assert f"{c}.expect.{field}" in data
