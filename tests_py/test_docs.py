"""The repository's copy of the tree-rule spec is the team's current spec."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
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


def test_readme_c_example_is_the_example_program():
    """The README's C block is examples/quickstart.c byte for byte: the program ctest builds
    and runs (example_quickstart, and example_installed against `cmake --install`)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```c\n") + len("```c\n")
    block = text[start : text.index("```", start)]
    program = (ROOT / "examples" / "quickstart.c").read_text()
    assert block == program, "the README's C block differs from examples/quickstart.c: paste the file again"


def test_example_expected_output_is_the_reference():
    """examples/quickstart.out (what ctest requires quickstart.c to print) is the Python
    reference's trees and walk for the program's inputs, in the program's layout."""
    from kdtree import reference

    lp = np.array([-0.1, -2.5, -0.2, -2.0, -0.3, -1.9, -0.5, -0.9, -1.0, -1.2, -0.7, -3.0],
                  np.float32).reshape(2, 3, 2)
    ids = np.array([10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61], np.int32).reshape(2, 3, 2)
    trees = reference.build_trees(lp, ids, 4, root_tokens=[5, 6], root_positions=[100, 7], vocab_size=100)
    target = np.zeros((2, 5), np.int32)
    target[0, :3] = [10, 20, 99]
    target[1, 0] = 55
    acc = reference.verify_greedy(trees, target)
    header = (ROOT / "include" / "kdtree.h").read_text()
    version = ".".join(re.search(rf"#define KDT_VERSION_{part} (\d+)", header).group(1)
                       for part in ("MAJOR", "MINOR", "PATCH"))
    abi = re.search(r"#define KDT_ABI_VERSION (\d+)", header).group(1)
    lines = [f"libkdtree {version} (ABI {abi})"]
    for b in range(2):
        lines.append(f"request {b}: {trees.num_nodes[b]} draft nodes")
        lines.append("  node token parent position    logw first_child next_sibling visible")
        for i in range(5):
            vis = "".join("1" if v else "0" for v in trees.visibility[b, i])
            lines.append(f"  {i:4d} {trees.tokens[b, i]:5d} {trees.parents[b, i]:6d} {trees.positions[b, i]:8d} "
                         f"{trees.logw[b, i]:7.4f} {trees.first_child[b, i]:11d} {trees.next_sibling[b, i]:12d} {vis}")
        path = acc.accepted_nodes[b, 1 : acc.accept_length[b] + 1]
        walk = ",".join(f" node {i} (token {trees.tokens[b, i]})" for i in path) or " none"
        bonus = f"bonus token {acc.bonus_token[b]}" if acc.bonus_token[b] >= 0 else "no bonus token"
        lines.append(f"  accepted:{walk}; {bonus}")
    assert (ROOT / "examples" / "quickstart.out").read_text() == "\n".join(lines) + "\n"


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


def test_formats_worked_example_runs_as_shown(lib):
    """The worked example of docs/api.md's "Serving engines' formats" prints what it shows."""
    import doctest

    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Serving engines' formats"):]
    start = section.index("```python\n>>> ") + len("```python\n")
    block = section[start: section.index("```", start)]
    test = doctest.DocTestParser().get_doctest(block, {}, "api.md formats example", "docs/api.md", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 10 and result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
