"""Text display of decoding results: the time-per-stage table, byte tokens as short
strings, long byte runs folded, and one round's draft tree drawn as indented text."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.rounds import STAGES, GenerationResult


def stage_lines(result: GenerationResult) -> list[str]:
    """The time-per-stage table of a DDTree generation: a header, then one line per stage
    (``STAGES``) with total ms, ms per round and share of the round time."""
    lines = ["time per stage (DDTree)   total ms   per round ms   share"]
    total = sum(result.times.values()) or 1.0
    for name in STAGES:
        v = result.times[name]
        per = 1e3 * v / result.rounds if result.rounds else 0.0
        lines.append(f"  {name:<8}               {1e3 * v:9.2f}   {per:12.3f}   {100 * v / total:4.1f}%")
    return lines


def escape_token(tok: int) -> str:
    """A byte token as a short quoted string: printable ASCII as itself, ``\\n``, ``\\t``,
    ``\\r``, else ``\\xNN``; ids >= 256 as ``<id>``."""
    if tok < 0:
        return "<none>"
    if tok >= 256:
        return f"<{tok}>"
    special = {10: "\\n", 9: "\\t", 13: "\\r", 39: "\\'", 92: "\\\\"}
    if tok in special:
        s = special[tok]
    elif 32 <= tok < 127:
        s = chr(tok)
    else:
        s = f"\\x{tok:02x}"
    return f"'{s}'"


def byte_runs(data: bytes | Sequence[int], min_run: int) -> list[tuple[int, int, int]]:
    """Maximal runs of one repeated byte at least ``min_run`` (>= 2) long, as
    ``(start, length, byte)`` in order of position."""
    if min_run < 2:
        raise ValueError(f"min_run must be >= 2, got {min_run}")
    raw = bytes(data)
    return [(m.start(), m.end() - m.start(), raw[m.start()])
            for m in re.finditer(rb"(?s)(.)\1{%d,}" % (min_run - 1), raw)]


def printable(data: bytes | Sequence[int], *, min_run: int | None = None,
              marks: tuple[str, str] = ("\u27e8", "\u27e9")) -> str:
    """Bytes as text for a terminal: printable ASCII, newlines and tabs as they are,
    every other byte as ``\\xNN``.

    With ``min_run``, each run of one byte repeated at least ``min_run`` times (see
    :func:`byte_runs`) is drawn as a marker such as ``\u27e8' ' x 240\u27e9`` (``marks`` are
    the brackets), so long runs of spaces or newlines stay visible and short.
    """
    raw = bytes(data)
    runs = byte_runs(raw, min_run) if min_run is not None else []
    out = []
    pos = 0
    for start, length, b in [*runs, (len(raw), 0, -1)]:
        for x in raw[pos:start]:
            out.append(chr(x) if 32 <= x < 127 or x in (9, 10) else f"\\x{x:02x}")
        if b >= 0:
            out.append(f"{marks[0]}{escape_token(b)} x {length}{marks[1]}")
        pos = start + length
    return "".join(out)


def render_tree(trees: Any, b: int = 0, acceptance: Any = None, *, max_nodes: int = 48,
                token_str: Callable[[int], str] = escape_token) -> str:
    """Draw request ``b`` of a :class:`kdtree.TreeBatch` as indented text.

    One line per node, depth-first with children in node order (decreasing score), indented
    two spaces per depth: marker (``*`` on the accepted path), token, ``logw`` and node
    number. Only nodes ``0 .. max_nodes`` are drawn (the best ``max_nodes`` by score; as
    parents precede children this is a connected subtree), plus the accepted path's nodes
    wherever they rank; a last line says how many were left out. With ``acceptance`` the
    accepted path is marked and the bonus token named.
    """
    n = int(trees.num_nodes[b])
    shown = min(n, max(0, max_nodes))
    accepted: set[int] = set()
    if acceptance is not None:
        row = acceptance.accepted_nodes[b]
        accepted = {int(i) for i in row[: 1 + int(acceptance.accept_length[b])] if i >= 0}
    fc, ns = trees.first_child[b], trees.next_sibling[b]
    lines = [f"{'*' if 0 in accepted else ' '} root {token_str(int(trees.tokens[b, 0]))} "
             f"(position {int(trees.positions[b, 0])}, last committed token)"]
    stack = []
    c = int(fc[0])
    if c != -1:
        stack.append(c)
    # iterative pre-order: push siblings after children so children come first
    while stack:
        i = stack.pop()
        sib = int(ns[i])
        if sib != -1:
            stack.append(sib)
        if i > shown and i not in accepted:
            continue
        d = int(trees.depths[b, i])
        mark = "*" if i in accepted else " "
        lines.append(f"{'  ' * d}{mark} {token_str(int(trees.tokens[b, i])):<7} "
                     f"logw={float(trees.logw[b, i]):8.3f}  #{i}")
        child = int(fc[i])
        if child != -1:
            stack.append(child)
    extra = sum(1 for i in accepted if i > shown)
    if shown + extra < n:
        also = f" and the {extra} accepted beyond them" if extra else ""
        lines.append(f"... {n - shown - extra} more of {n} nodes not shown (drawing the best {shown}{also})")
    if acceptance is not None:
        k = int(acceptance.accept_length[b])
        bonus = int(acceptance.bonus_token[b])
        lines.append(f"accepted path: {k} draft node(s) marked *; bonus token "
                     f"{token_str(bonus) if bonus >= 0 else 'none'}")
    return "\n".join(lines)
