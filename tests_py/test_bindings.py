"""The ctypes bindings (python/kdtree/_native/__init__.py) against the header and the built .so:

* every symbol of ``_lib.SIGNATURES`` is declared (argtypes, restype, errcheck) on the
  loaded library, with ctypes types that match the header's C prototype;
* the exported ``kdt_`` functions (``nm -D``), the header's ``KDT_API`` declarations and
  ``SIGNATURES`` are the same set, and nothing else leaves the .so;
* ``STATUS_NAMES`` matches the header's enum and ``kdt_status_string``;
* ABI and version numbers agree (header, .so, Python);
* ctypes struct mirrors match the C structs (sizeof / offsetof from a compiled program);
* the loader's error lists every path tried; ``kdtree.reference`` and ``kdtree.kdtr``
  import and work without the .so.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kdtree import _native as _lib

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "include" / "kdtree.h"


def header_text() -> str:
    """The header with comments removed."""
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_prototypes() -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, [argument types]) of every KDT_API function in the header."""
    protos = {}
    pattern = re.compile(r"KDT_API\s+([\w\s\*]+?)\s*\b(kdt_\w+)\s*\(([^)]*)\)\s*;")
    for ret, name, args in pattern.findall(header_text()):
        types = []
        args = " ".join(args.split())
        if args and args != "void":
            for arg in args.split(","):
                arg = arg.strip()
                m = re.match(r"^(.*?)\s*\b(\w+)$", arg)  # drop the parameter name
                types.append(" ".join(m.group(1).replace("*", " * ").split()))
        protos[name] = (" ".join(ret.replace("*", " * ").split()), types)
    return protos


def header_define(name: str) -> int:
    m = re.search(rf"#define {name} (\d+)", HEADER.read_text())
    assert m, f"{name} not found in {HEADER}"
    return int(m.group(1))


def header_struct_fields(struct: str) -> list[str]:
    """Field names of `typedef struct <struct> { ... }` in declaration order."""
    m = re.search(rf"typedef struct {struct}\s*\{{(.*?)\}}\s*{struct}\s*;", header_text(), flags=re.S)
    assert m, f"struct {struct} not found in {HEADER}"
    return re.findall(r"(\w+)\s*;", m.group(1))


# ---- SIGNATURES vs the loaded library and the header ----------------------------------------


def test_every_signature_is_declared_on_the_library(lib):
    for name, (restype, argtypes) in _lib.SIGNATURES.items():
        fn = getattr(lib, name)
        assert fn.argtypes is not None, name
        assert list(fn.argtypes) == list(argtypes), name
        if restype == "status":
            assert fn.restype is ctypes.c_int32, name
            assert fn.errcheck is not None and callable(fn.errcheck), f"{name} has no errcheck"
        else:
            assert fn.restype is restype, name
            assert getattr(fn, "errcheck", None) is None, f"{name} should not check a status"


def test_errcheck_raises_kdtree_error_with_last_error(lib):
    words = ctypes.c_int64()
    with pytest.raises(_lib.KdtreeError) as info:
        lib.kdt_visibility_words(-3, ctypes.byref(words))
    err = info.value
    assert err.status == 1 and err.status_name == "KDT_ERR_INVALID_ARGUMENT"
    assert "kdt_visibility_words" in str(err) and "-3" in str(err)
    assert err.function == "kdt_visibility_words"
    assert lib.kdt_visibility_words(63, ctypes.byref(words)) == 0 and words.value == 2


def _pointee(ctype) -> object:
    return ctype._type_ if isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer) else None


SCALARS = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "size_t": ctypes.c_size_t,
           "uint64_t": ctypes.c_uint64, "float": ctypes.c_float}
STRUCTS = {"kdt_trees": _lib.KdtTrees, "kdt_draft": _lib.KdtDraft, "kdt_kdtr_array": _lib.KdtKdtrArray,
           "kdt_logits": _lib.KdtLogits, "kdt_kv_cache": _lib.KdtKvCache,
           "kdt_paged_kv_cache": _lib.KdtPagedKvCache, "kdt_sampling": _lib.KdtSampling,
           "kdt_attention_rows": _lib.KdtAttentionRows, "kdt_attention_cache": _lib.KdtAttentionCache,
           "kdt_trees_ragged": _lib.KdtTreesRagged, "kdt_stop_sequences": _lib.KdtStopSequences}


def _matches(c_type: str, ctype) -> bool:
    """Whether a ctypes declaration is a faithful mirror of one C type."""
    words = [w for w in c_type.split() if w != "const"]
    stars = words.count("*")
    base = " ".join(w for w in words if w != "*")
    if stars == 0:
        return SCALARS.get(base) is ctype
    if base == "char" and stars == 1:
        return ctype is ctypes.c_char_p
    if ctype is ctypes.c_void_p:
        return True  # any pointer may be passed as void*
    inner = _pointee(ctype)
    if inner is None:
        return False
    if stars == 2 or base == "kdt_kdtr_file":  # opaque handle (pointer) or pointer to it
        return stars == 2 and inner is ctypes.c_void_p
    return SCALARS.get(base, STRUCTS.get(base)) is inner


def test_signatures_mirror_header_prototypes():
    protos = header_prototypes()
    assert protos, "no KDT_API prototypes parsed from the header"
    assert set(protos) == set(_lib.SIGNATURES), (
        f"header only: {sorted(set(protos) - set(_lib.SIGNATURES))}; "
        f"SIGNATURES only: {sorted(set(_lib.SIGNATURES) - set(protos))}"
    )
    for name, (ret, args) in protos.items():
        restype, argtypes = _lib.SIGNATURES[name]
        assert len(args) == len(argtypes), f"{name}: {len(args)} C arguments, {len(argtypes)} declared"
        for i, (c_type, ctype) in enumerate(zip(args, argtypes, strict=True)):
            assert _matches(c_type, ctype), f"{name} argument {i}: C {c_type!r} vs ctypes {ctype}"
        if ret == "kdt_status":
            assert restype == "status", name
        elif ret == "void":
            assert restype is None, name
        else:
            assert _matches(ret, restype), f"{name} returns C {ret!r} vs ctypes {restype}"


def _nm_symbols(path: str) -> tuple[set[str], set[str]] | None:
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    functions = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    return names, functions


def test_exported_symbols_are_exactly_the_api(lib):
    found = _nm_symbols(lib._kdtree_path)
    if found is None:
        pytest.skip("nm -D --defined-only is not available")
    names, functions = found
    # kdt_testing_*: the test-only entry points (native/kdt_testing.h), outside the API.
    exported = {n for n in functions if n.startswith("kdt_") and not n.startswith("kdt_testing_")}
    assert exported == set(_lib.SIGNATURES), (
        f".so only: {sorted(exported - set(_lib.SIGNATURES))}; "
        f"SIGNATURES only: {sorted(set(_lib.SIGNATURES) - exported)}"
    )
    assert exported == set(header_prototypes())
    testing = {n for n in functions if n.startswith("kdt_testing_")}
    declared = re.findall(r"KDT_API \w+ (kdt_testing_\w+)\(", (ROOT / "native" / "kdt_testing.h").read_text())
    assert testing == set(declared), f"test entry points {sorted(testing)} vs native/kdt_testing.h {declared}"
    # Hidden default visibility: nothing but the kdt_ API leaves the library.
    others = sorted(n for n in names if not n.startswith("kdt_"))
    assert not others, f"non-API symbols exported: {others}"


# ---- Status enum ----------------------------------------------------------------------------


def test_status_names_match_header():
    enum = re.search(r"typedef enum kdt_status\s*\{(.*?)\}\s*kdt_status;", header_text(), flags=re.S)
    assert enum
    values = {int(v): n for n, v in re.findall(r"\b(KDT_(?:OK|ERR_\w+))\s*=\s*(\d+)", enum.group(1))}
    assert values == _lib.STATUS_NAMES


def test_status_names_match_library(lib):
    for value, name in _lib.STATUS_NAMES.items():
        text = lib.kdt_status_string(value).decode()
        assert text.startswith(name + ":"), (value, name, text)
    top = max(_lib.STATUS_NAMES)
    for unknown in (top + 1, -1, 2**31 - 1):
        assert lib.kdt_status_string(unknown).decode() == "unknown status"


def test_public_status_lookup():
    import numpy as np

    import kdtree

    assert kdtree.status_name(0) == "KDT_OK"
    assert kdtree.status_name(np.int32(4)) == "KDT_ERR_VALUE"
    assert kdtree.status_name(np.array(15, np.int32)) == "KDT_ERR_INTERNAL"
    assert kdtree.status_name(99) == "status 99"
    for value, name in _lib.STATUS_NAMES.items():  # every code both ways, against the header's enum
        assert kdtree.status_name(value) == name and kdtree.status_code(name) == value
    # a status array from errors="status" reads back by name
    trees = kdtree.build_trees(np.array([[[0.0, np.nan]]], np.float32), np.array([[[1, 2]]], np.int32), 2,
                               errors="status")
    assert [kdtree.status_name(s) for s in trees.request_status] == ["KDT_ERR_VALUE"]
    for bad in (4.0, True, np.array([1, 2]), "4"):
        with pytest.raises(TypeError, match="status must be an integer"):
            kdtree.status_name(bad)
    torch = pytest.importorskip("torch", reason="torch is not installed (status arrays of torch tensors)")
    assert kdtree.status_name(torch.tensor([0, 4], dtype=torch.int32)[1]) == "KDT_ERR_VALUE"
    for bad in (torch.tensor(4.0), torch.tensor([1, 2]), torch.tensor(True)):
        with pytest.raises(TypeError, match="status must be an integer"):
            kdtree.status_name(bad)
    with pytest.raises(KeyError, match="'KDT_ERR_NOPE' is not a kdt_status name; the names are \\['KDT_OK'"):
        kdtree.status_code("KDT_ERR_NOPE")


# ---- Versions ---------------------------------------------------------------------------------


def test_abi_version(lib):
    assert lib.kdt_abi_version() == _lib.ABI_VERSION == header_define("KDT_ABI_VERSION")


def test_library_version(lib):
    import kdtree

    want = ".".join(str(header_define(f"KDT_VERSION_{p}")) for p in ("MAJOR", "MINOR", "PATCH"))
    assert lib.kdt_version().decode() == want
    assert kdtree.library_version() == want
    assert kdtree.__version__ == want, "the Python package and the header disagree on the version"


# ---- Struct layouts -------------------------------------------------------------------------

C_STRUCTS = dict(STRUCTS)


def test_struct_field_names_match_header():
    for c_name, mirror in C_STRUCTS.items():
        assert [f[0] for f in mirror._fields_] == header_struct_fields(c_name), c_name


def test_struct_layouts_match_c(tmp_path):
    cc = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler (cc, gcc, clang) to measure the C structs")
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "kdtree.h"', "int main(void) {"]
    for c_name, mirror in C_STRUCTS.items():
        lines.append(f'  printf("{c_name} sizeof %zu\\n", sizeof({c_name}));')
        for field, _ in mirror._fields_:
            lines.append(
                f'  printf("{c_name} {field} %zu %zu\\n", offsetof({c_name}, {field}), '
                f"sizeof((({c_name}*)0)->{field}));"
            )
    lines.append('  printf("kdt_status sizeof %zu\\n", sizeof(kdt_status));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    build = subprocess.run([cc, "-std=c99", "-I", str(ROOT / "include"), str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"layout program does not compile:\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    measured = {}
    for line in run.stdout.splitlines():
        parts = line.split()
        measured[(parts[0], parts[1])] = tuple(int(x) for x in parts[2:])
    for c_name, mirror in C_STRUCTS.items():
        assert measured[(c_name, "sizeof")] == (ctypes.sizeof(mirror),), c_name
        for field, _ in mirror._fields_:
            desc = getattr(mirror, field)
            assert measured[(c_name, field)] == (desc.offset, desc.size), f"{c_name}.{field}"
    assert measured[("kdt_status", "sizeof")] == (ctypes.sizeof(ctypes.c_int32),)


# ---- Loader -----------------------------------------------------------------------------------


def _isolated_package(tmp_path: Path) -> Path:
    """A copy of python/kdtree under tmp_path/python (no build/ folder next to it, no .so)."""
    dest = tmp_path / "python" / "kdtree"
    shutil.copytree(ROOT / "python" / "kdtree", dest,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.dylib", "*.dll"))
    return dest.parent


def _run(code: str, pythonpath: Path, library: str | None, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KDTREE_LIBRARY")}
    env["PYTHONPATH"] = str(pythonpath)
    if library is not None:
        env["KDTREE_LIBRARY"] = library
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


LOAD_AND_REPORT = """
    import kdtree                      # must import without the library
    from kdtree import _native as _lib
    try:
        _lib.load()
    except kdtree.LibraryNotFoundError as exc:
        print("MESSAGE", str(exc))
        print("IMPORTERROR", isinstance(exc, ImportError))
    else:
        print("LOADED", _lib._LIB._kdtree_path)
"""


def test_loader_error_lists_every_path(tmp_path):
    pkg = _isolated_package(tmp_path)
    res = _run(LOAD_AND_REPORT, pkg, None, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "MESSAGE" in res.stdout, res.stdout
    message = res.stdout
    tried = [tmp_path / "build" / _lib.LIBRARY_NAME, pkg / "kdtree" / _lib.LIBRARY_NAME]
    for path in tried:
        assert str(path.resolve()) in message, (str(path), message)
    assert message.count("not found") >= 2
    assert "KDTREE_LIBRARY" in message and "IMPORTERROR True" in message


def test_explicit_library_override_does_not_fall_back(tmp_path):
    """KDTREE_LIBRARY naming a missing file or a non-kdtree file is an error, even when a
    build exists elsewhere (a typo must not silently load another library)."""
    pkg = _isolated_package(tmp_path)
    missing = tmp_path / "nowhere" / "libkdtree-missing.so"
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"not a shared library")
    for path in (missing, garbage):
        res = _run(LOAD_AND_REPORT, pkg, str(path), tmp_path)
        assert res.returncode == 0, res.stderr
        assert "MESSAGE" in res.stdout and f"KDTREE_LIBRARY={path}" in res.stdout, res.stdout


def test_loader_error_names_a_broken_library(tmp_path):
    pkg = _isolated_package(tmp_path)
    bogus = tmp_path / "libkdtree.so"
    bogus.write_text("not an ELF file\n")
    res = _run(LOAD_AND_REPORT, pkg, str(bogus), tmp_path)
    assert res.returncode == 0, res.stderr
    assert "MESSAGE" in res.stdout and str(bogus) in res.stdout
    line = next(x for x in res.stdout.splitlines() if str(bogus) in x)
    assert "not found" not in line  # the dlopen failure is reported, not "not found"


def test_loader_rejects_abi_mismatch(lib, tmp_path):
    code = """
        from kdtree import _native as _lib
        _lib.ABI_VERSION = 999
        try:
            _lib.load()
        except _lib.LibraryNotFoundError as exc:
            print("MESSAGE", exc)
    """
    res = _run(code, ROOT / "python", lib._kdtree_path, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "ABI version" in res.stdout and "999" in res.stdout, res.stdout


def test_reference_and_kdtr_work_without_the_library(tmp_path):
    pkg = _isolated_package(tmp_path)
    code = """
        import numpy as np
        import kdtree.reference as reference
        import kdtree.kdtr as kdtr
        from kdtree import _native as _lib
        lp = np.log(np.array([[[.5, .4, .1], [.5, .3, .2]]], np.float32))
        ids = np.array([[[1, 2, 3], [4, 5, 6]]], np.int32)
        t = reference.build_trees(lp, ids, 3)
        acc = reference.verify_greedy(t, np.array([[1, 4, 0, 9]]))
        data = kdtr.loads(kdtr.dumps({"tokens": t.tokens}))
        assert (data["tokens"] == t.tokens).all()
        print("TOKENS", t.tokens.tolist(), "COMMIT", acc.committed(t))
        print("LOADED", _lib._LIB is not None)
    """
    res = _run(code, pkg, str(tmp_path / "missing.so"), tmp_path)
    assert res.returncode == 0, res.stderr
    assert "TOKENS [[-1, 1, 2, 4]] COMMIT [1, 4, 9]" in res.stdout, res.stdout
    assert "LOADED False" in res.stdout
