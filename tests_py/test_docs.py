"""The repository's copy of the tree-rule spec is the team's current spec."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "spec" / "ddtree-tree-build.md"


def test_spec_copy_matches_shared_spec():
    if not SHARED.is_file():
        pytest.skip("maintainers only: compares docs/spec with the team's copy of the spec, which this "
                    "clone does not have (nothing is wrong with it)")
    copy = ROOT / "docs" / "spec" / "ddtree-tree-build.md"
    assert copy.read_text() == SHARED.read_text(), (
        "docs/spec/ddtree-tree-build.md differs from the shared spec: copy it again")


def test_readme_names_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "nox -s demo" in text and "nox -s build test" in text


def test_readme_gpu_example_is_the_one_the_device_runs():
    """tools/readme_gpu_example.py (run on the GPU machine by tools/device_check.sh) is the
    README's GPU example, verbatim."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\nimport torch\n") + len("```python\n")
    block = text[start : text.index("```", start)]
    script = (ROOT / "tools" / "readme_gpu_example.py").read_text()
    assert script.split('"""\n\n', 1)[-1] == block


def test_readme_c_example_is_inside_a_tested_program():
    """Every line of the README's C snippet appears, in order, in
    tests_native/test_readme_example.c, which ctest builds, runs and checks."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```c\n") + len("```c\n")
    block = [line.strip() for line in text[start : text.index("```", start)].splitlines() if line.strip()]
    program = [line.strip() for line in (ROOT / "tests_native" / "test_readme_example.c").read_text().splitlines()]
    at = 0
    for line in block:
        assert line in program[at:], f"README C line not in tests_native/test_readme_example.c (in order): {line}"
        at = program.index(line, at) + 1


def test_api_md_decoding_example_runs(monkeypatch):
    """The decoding example of docs/api.md runs as written (from the repository root) and
    its lossless assertion holds."""
    pytest.importorskip("torch", reason="torch is not installed (nox -s test installs it)")
    pytest.importorskip("transformers", reason="transformers is not installed (nox -s test installs it)")
    text = (ROOT / "docs" / "api.md").read_text()
    start = text.index("```python\nfrom pathlib import Path\n") + len("```python\n")
    block = text[start : text.index("```", start)]
    monkeypatch.chdir(ROOT)
    exec(compile(block, "docs/api.md", "exec"), {"__name__": "api_example"})


def _relative_links(path: Path) -> list[tuple[str, Path]]:
    """(link text as written, resolved target) of every relative Markdown link in `path`."""
    import re

    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        out.append((target, (path.parent / target.split("#", 1)[0]).resolve()))
    return out


def test_doc_links_resolve():
    """Every relative link in README.md and docs/ (the performance page and its history
    included) names a file of the repository."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages
              for target, resolved in _relative_links(page) if not resolved.exists()]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_history_index_lists_every_entry():
    """docs/history/README.md links each history entry once, and each entry is named
    <date>-<commit>-<topic>.md."""
    import re

    history = ROOT / "docs" / "history"
    entries = sorted(p.name for p in history.glob("*.md") if p.name != "README.md")
    assert entries, "docs/history/ holds no entries"
    for name in entries:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[0-9a-f]{7}-[a-z0-9-]+\.md", name), name
    listed = [target for target, _ in _relative_links(history / "README.md") if target != "../performance.md"]
    assert sorted(listed) == entries
