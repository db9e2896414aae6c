"""Byte-level n-gram language models: the target and the drafter of the CPU demo.

The demo (``python -m kdtree demo``) needs a target model and a cheaper drafter that run on
any machine with no download. Both are byte-level (vocabulary = the 256 byte values) n-gram
models with *stupid backoff* (Brants et al., "Large Language Models in Machine
Translation", EMNLP 2007), estimated from the Python standard library's own ``.py`` files.

Scoring rule (deterministic, float64). For a context ``h`` (the bytes before the next one)
and a byte ``w``, with ``c(.)`` the corpus counts and ``m = min(order - 1, len(h))``::

    S(w | h) = alpha**k * c(h_j, w) / c(h_j)

where ``h_j`` is the longest suffix of ``h`` of length ``j <= m`` with ``c(h_j, w) > 0`` and
``k = m - j`` the number of back-off steps (``alpha = 0.4``). A byte never seen in the
corpus scores 0. Greedy decoding takes ``argmax_w S(w | h)`` with ties broken by the lower
byte value (``numpy.argmax`` semantics).

The default target has order 16 (contexts of up to 15 bytes): long enough to see past
most indentation to the line before, so its greedy continuation looks like spliced code
rather than an endless run of spaces (an order-8 model quickly loops on spaces; greedy
n-gram decoding still falls into loops sometimes). Pairs seen once are pruned at context
lengths >= 4 (see :class:`NgramCounts`); the model thus uses a long context only where the
corpus repeats it.

Counts are held in compact numpy CSR tables, one per context length ``c = 0 .. order-1``:
sorted unique 56-bit context keys (a splitmix64-mixed polynomial hash of the ``c`` bytes;
a collision would merge two contexts' counts, with probability ~1e-5 for the default
corpus, and would change AR and speculative decoding alike), the context totals, and for
each context a contiguous run of (next byte, count) pairs. Estimation uses
``numpy.unique`` over packed (context key, next byte) keys; it takes seconds for a few MiB
of text, and the tables are cached as a compressed ``.npz`` file (about 24 MiB for the
default 3 MiB corpus, loaded in a fraction of a second) keyed by the format version, the
Python version, the order, the pruning rule and a SHA-256 of the corpus bytes (see
:func:`cache_dir` and :meth:`NgramCounts.load_or_estimate`).

Sources: the DDTree paper (Ringel & Romano, arXiv 2604.12989) uses a transformer target
and a block-diffusion drafter (DFlash); these n-gram models implement the same interfaces
(:class:`kdtree.engine.Target`, :class:`kdtree.engine.Drafter`) so the round loop can be
exercised end to end on CPU.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.files import write_atomically

VOCAB_SIZE = 256
MAX_ORDER = 64
DEFAULT_ORDER = 16
DEFAULT_PRUNE_FROM = 4
DEFAULT_MIN_COUNT = 2
DEFAULT_DRAFT_ORDER = 4
DEFAULT_ALPHA = 0.4
DEFAULT_CORPUS_BYTES = 3 << 20
# 3: compressed; keys delta-coded, offsets as run lengths, counts in the narrowest dtype
CACHE_FORMAT_VERSION = 3
# test suites, third-party packages, and generated tables/data (codec tables, pydoc topics)
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                            "__pycache__", "encodings", "pydoc_data"})


# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------

def stdlib_dir() -> Path:
    """The directory of the running Python's standard library (``sysconfig`` "stdlib")."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Every ``.py`` file under the standard library, test suites and third-party
    packages and generated data excluded (directories named ``test``, ``tests``,
    ``idle_test``, ``site-packages``, ``dist-packages``, ``encodings``, ``pydoc_data``), sorted by their path relative to ``root``
    (a fixed order, so the corpus is reproducible on one installation)."""
    root = stdlib_dir() if root is None else Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(Path(dirpath) / name)
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    return out


@dataclass(frozen=True)
class Corpus:
    """Training text for the n-gram models.

    Attributes:
        data     the concatenated bytes (files in sorted order, each followed by ``b"\\n"``,
                 the whole truncated to the byte cap)
        files    the files that contributed (the last one possibly truncated)
        held_out the file asked to be left out of the corpus (the prompt's file), or None
        sha256   hex digest of ``data`` (part of the cache key)
        skipped  True when ``held_out`` was a corpus file (it would have been read before
                 the byte cap was reached), so this corpus differs from the one without
                 a held-out file (and has its own cache file)
        max_bytes the byte cap the corpus was read with
    """

    data: bytes
    files: tuple[Path, ...]
    held_out: Path | None
    sha256: str
    skipped: bool = False
    max_bytes: int = DEFAULT_CORPUS_BYTES


def load_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, *, hold_out: Path | str | None = None,
                root: Path | None = None) -> Corpus:
    """Read the standard-library corpus (see :func:`stdlib_sources`).

    Files are concatenated in sorted order until ``max_bytes`` bytes (the last file is
    cut). ``hold_out`` (typically the file the prompt is taken from) is skipped, so the
    target never saw the prompt's continuation verbatim. Unreadable files are skipped.

    Raises:
        ValueError: ``max_bytes < 1`` or the corpus is empty.
    """
    if max_bytes < 1:
        raise ValueError(f"corpus byte cap must be >= 1, got {max_bytes}")
    held = Path(hold_out).resolve() if hold_out is not None else None
    parts: list[bytes] = []
    used: list[Path] = []
    total = 0
    skipped = False
    for path in stdlib_sources(root):
        if held is not None and path.resolve() == held:
            skipped = True
            continue
        try:
            chunk = path.read_bytes() + b"\n"
        except OSError:
            continue
        chunk = chunk[: max_bytes - total]
        parts.append(chunk)
        used.append(path)
        total += len(chunk)
        if total >= max_bytes:
            break
    data = b"".join(parts)
    if not data:
        raise ValueError(f"no readable .py files found under {root or stdlib_dir()}")
    return Corpus(data, tuple(used), held, hashlib.sha256(data).hexdigest(), skipped, max_bytes)


# --------------------------------------------------------------------------------------
# Count tables
# --------------------------------------------------------------------------------------

_U64 = np.uint64
_HASH_MUL = _U64(0x100000001B3)          # FNV-1a 64-bit prime, the polynomial base
_HASH_LEN = _U64(0x9E3779B97F4A7C15)     # golden ratio: makes lengths hash apart


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wraps mod 2**64)."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _pow_table(n: int) -> list[np.uint64]:
    out, p = [], 1
    for _ in range(n):
        out.append(_U64(p))
        p = (p * int(_HASH_MUL)) % (1 << 64)
    return out


def _context_key(h: np.ndarray, c: int) -> np.ndarray:
    """56-bit key of a c-byte context from its polynomial hash ``h`` (uint64 [M])."""
    with np.errstate(over="ignore"):
        return _mix(h + _U64(c) * _HASH_LEN) >> _U64(8)


@dataclass
class Level:
    """Counts for one context length ``c`` (CSR layout).

    Attributes:
        keys      uint64 [U]    sorted unique 56-bit context keys: splitmix64 of the
                                polynomial hash ``sum_j (h[-j] + 1) * P**(j-1)`` of the c
                                context bytes (and of c), shifted right by 8
        totals    float64 [U]   c(h): occurrences of the context followed by any byte,
                                counted before pruning
        offsets   int64  [U+1]  the pairs of context u are rows offsets[u]:offsets[u+1]
        next_byte int64  [E]    next byte value, increasing within a context
        count     float64 [E]   c(h, w); pairs with c(h, w) < min_count are dropped at
                                context lengths >= prune_from
    """

    keys: np.ndarray
    totals: np.ndarray
    offsets: np.ndarray
    next_byte: np.ndarray
    count: np.ndarray


def _estimate_level(data: np.ndarray, h: np.ndarray, c: int, min_count: int) -> Level:
    """Count every (c-byte context, next byte) pair of ``data`` (uint8 [T]); ``h[i]`` is the
    polynomial hash of the c bytes before position i (valid for i >= c)."""
    if data.size <= c:
        return Level(np.zeros(0, _U64), np.zeros(0), np.zeros(1, np.int64),
                     np.zeros(0, np.int64), np.zeros(0))
    full = (_context_key(h[c:], c) << _U64(8)) | data[c:].astype(_U64)
    uniq, cnt = np.unique(full, return_counts=True)
    ctx = uniq >> _U64(8)
    starts = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]])
    cnt = cnt.astype(np.float64)
    totals = np.add.reduceat(cnt, starts)
    if min_count > 1:
        group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, uniq.size]))
        keep = cnt >= min_count
        uniq, cnt, group = uniq[keep], cnt[keep], group[keep]
        ctx = ctx[keep]
        kept_groups, starts = np.unique(group, return_index=True)
        totals = totals[kept_groups]
    offsets = np.r_[starts, uniq.size].astype(np.int64)
    return Level(keys=ctx[starts].copy(), totals=totals, offsets=offsets,
                 next_byte=(uniq & _U64(0xFF)).astype(np.int64), count=cnt)


def cache_dir() -> Path:
    """Where count tables are cached: ``$KDTREE_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/kdtree``, else ``~/.cache/kdtree``."""
    env = os.environ.get("KDTREE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kdtree"


class NgramCounts:
    """Byte n-gram counts of one corpus, for every context length ``0 .. order-1``.

    Build with :meth:`estimate` (or :meth:`load_or_estimate` to use the cache). Scoring
    is :meth:`scores`; any model of order ``<= self.order`` can share one instance.

    Count pruning (keeps the tables small): at context lengths ``>= prune_from`` only
    (context, byte) pairs seen at least ``min_count`` times are kept; the context totals
    are those before pruning, so a kept pair keeps its true relative frequency and a
    pruned one backs off.
    """

    def __init__(self, levels: list[Level], order: int, corpus_sha256: str = "",
                 prune_from: int = DEFAULT_PRUNE_FROM, min_count: int = DEFAULT_MIN_COUNT):
        self.levels = levels
        self.order = order
        self.corpus_sha256 = corpus_sha256
        self.prune_from = prune_from
        self.min_count = min_count
        self._pow = _pow_table(order)

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def estimate(cls, data: bytes, order: int = DEFAULT_ORDER, corpus_sha256: str = "", *,
                 prune_from: int = DEFAULT_PRUNE_FROM,
                 min_count: int = DEFAULT_MIN_COUNT) -> NgramCounts:
        """Count all n-grams of length ``1 .. order`` of ``data``.

        Raises:
            ValueError: ``order`` outside ``1 .. MAX_ORDER`` or ``min_count < 1``.
        """
        if not 1 <= order <= MAX_ORDER:
            raise ValueError(f"n-gram order must be in 1..{MAX_ORDER}, got {order}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        arr = np.frombuffer(data, dtype=np.uint8)
        pw = _pow_table(order)
        h = np.zeros(arr.size, _U64)
        levels = []
        with np.errstate(over="ignore"):
            for c in range(order):
                if c >= 1 and arr.size > c:
                    h[c:] += (arr[: arr.size - c].astype(_U64) + _U64(1)) * pw[c - 1]
                levels.append(_estimate_level(arr, h, c, min_count if c >= prune_from else 1))
        return cls(levels, order, corpus_sha256, prune_from, min_count)

    @staticmethod
    def cache_path(order: int, corpus_sha256: str, prune_from: int = DEFAULT_PRUNE_FROM,
                   min_count: int = DEFAULT_MIN_COUNT) -> Path:
        """Cache file for ``order``, the pruning rule and a corpus digest (the Python
        version is in the name because the corpus is that version's standard library)."""
        py = f"py{sys.version_info[0]}{sys.version_info[1]}"
        return cache_dir() / (f"ngram-v{CACHE_FORMAT_VERSION}-{py}-o{order}"
                              f"-p{prune_from}m{min_count}-{corpus_sha256[:24]}.npz")

    @classmethod
    def load_or_estimate(cls, corpus: Corpus, order: int = DEFAULT_ORDER, *,
                         use_cache: bool = True,
                         on_warning: Callable[[str], None] | None = None,
                         ) -> tuple[NgramCounts, bool]:
        """Load the counts of ``corpus`` from the cache, or estimate and store them.

        Returns ``(counts, from_cache)``. A damaged (e.g. truncated) or unwritable cache
        file is not an error: the counts are then estimated (and stored again where
        possible), and ``on_warning`` (if given) receives a one-line description.
        """
        path = cls.cache_path(order, corpus.sha256)
        if use_cache and path.is_file():
            try:
                return cls._load(path, order, corpus.sha256), True
            except Exception as exc:  # noqa: BLE001 - any unreadable cache: rebuild it
                if on_warning is not None:
                    on_warning(f"cache file {path} is unreadable ({type(exc).__name__}: "
                               f"{_first_line(exc)}); estimating the counts again")
        counts = cls.estimate(corpus.data, order, corpus.sha256)
        if use_cache:
            try:
                counts._save(path)
            except OSError as exc:
                if on_warning is not None:
                    on_warning(f"cannot write cache file {path} ({exc.strerror or exc})")
        return counts, False

    def _save(self, path: Path) -> None:
        """Write the tables (format :data:`CACHE_FORMAT_VERSION`) atomically to ``path``.

        Per context length c: ``k0{c}`` the first key, ``klo{c}``/``khi{c}`` the low 32 and
        high bits of the gaps between consecutive keys, ``len{c}`` the pairs per context
        minus one (uint8: 1..256 pairs), ``next{c}``, ``count{c}`` and ``totals{c}``, each in
        the narrowest unsigned dtype that holds it; ``meta`` and ``sha`` (the corpus digest)
        are checked on load.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"meta": np.array([CACHE_FORMAT_VERSION, self.order, self.prune_from,
                                    self.min_count], np.int64),
                  "sha": np.frombuffer(self.corpus_sha256.encode("ascii"), np.uint8)}
        for c, lv in enumerate(self.levels):
            gaps = np.diff(lv.keys)
            arrays[f"k0{c}"] = lv.keys[:1]
            arrays[f"klo{c}"] = (gaps & _U64(0xFFFFFFFF)).astype(np.uint32)
            arrays[f"khi{c}"] = _narrow(gaps >> _U64(32))
            arrays[f"len{c}"] = (np.diff(lv.offsets) - 1).astype(np.uint8)
            arrays[f"next{c}"] = lv.next_byte.astype(np.uint8)
            arrays[f"count{c}"] = _narrow(lv.count.astype(np.uint64))
            arrays[f"totals{c}"] = _narrow(lv.totals.astype(np.uint64))
        write_atomically(path, lambda f: np.savez_compressed(f, **arrays))

    @classmethod
    def _load(cls, path: Path, order: int, sha: str) -> NgramCounts:
        """Read a file written by :meth:`_save`; ValueError if it belongs to another format,
        order or corpus or is inconsistent (zip and CRC errors of a damaged file propagate)."""
        with np.load(path) as z:
            meta = [int(x) for x in z["meta"]]
            if meta[0] != CACHE_FORMAT_VERSION or meta[1] != order:
                raise ValueError("cache format or order mismatch")
            if z["sha"].tobytes().decode("ascii", "replace") != sha:
                raise ValueError("cache file belongs to another corpus")
            levels = []
            for c in range(order):
                gaps = z[f"klo{c}"].astype(_U64) | (z[f"khi{c}"].astype(_U64) << _U64(32))
                keys = np.concatenate([z[f"k0{c}"].astype(_U64), gaps]).cumsum(dtype=_U64)
                offsets = np.zeros(keys.size + 1, np.int64)
                np.cumsum(z[f"len{c}"].astype(np.int64) + 1, out=offsets[1:])
                lv = Level(keys, z[f"totals{c}"].astype(np.float64), offsets,
                           z[f"next{c}"].astype(np.int64), z[f"count{c}"].astype(np.float64))
                if not (lv.totals.size == keys.size and lv.next_byte.size == lv.count.size
                        == offsets[-1]):
                    raise ValueError(f"inconsistent table sizes at context length {c}")
                levels.append(lv)
        return cls(levels, order, sha, meta[2], meta[3])

    # ---- scoring -----------------------------------------------------------------------
    def scores(self, windows: np.ndarray, lengths: np.ndarray, order: int | None = None,
               alpha: float = DEFAULT_ALPHA) -> np.ndarray:
        """Stupid-backoff scores of every next byte for ``M`` contexts at once.

        Args:
            windows: uint8 [M, W], the last ``W`` context bytes of each row, right-aligned
                (column ``W-1`` is the most recent byte); ``W >= order - 1``.
            lengths: int [M], how many trailing bytes of each row are real context (a row
                near the start of a text has a short context; the rest is ignored).
            order: model order to use (``<= self.order``; default ``self.order``).
            alpha: back-off factor.

        Returns:
            float64 [M, 256], ``S(w | h)`` per row (see the module docstring).
        """
        order = self.order if order is None else order
        if not 1 <= order <= self.order:
            raise ValueError(f"order {order} not in 1..{self.order}")
        windows = np.asarray(windows, dtype=np.uint8)
        m, width = windows.shape
        if width < order - 1:
            raise ValueError(f"windows hold {width} bytes, order {order} needs {order - 1}")
        hlen = np.minimum(np.asarray(lengths, dtype=np.int64).reshape(-1), order - 1)
        # context keys of every row at every length (short rows get keys they never use)
        keys = np.empty((order, m), _U64)
        h = np.zeros(m, _U64)
        with np.errstate(over="ignore"):
            for c in range(order):
                if c >= 1:
                    h = h + (windows[:, width - c].astype(_U64) + _U64(1)) * self._pow[c - 1]
                keys[c] = _context_key(h, c)
        out = np.zeros((m, VOCAB_SIZE), np.float64)
        done = np.zeros((m, VOCAB_SIZE), bool)
        mult = np.ones(m, np.float64)
        rows_all = np.arange(m)
        for c in range(order - 1, -1, -1):
            active = hlen >= c
            if not active.any():
                continue
            lv = self.levels[c]
            rows = rows_all[active]
            if lv.keys.size:
                key = keys[c, active]
                idx = np.searchsorted(lv.keys, key)
                found = lv.keys[np.minimum(idx, lv.keys.size - 1)] == key
                if found.any():
                    r = rows[found]
                    u = idx[found]
                    lo = lv.offsets[u]
                    ln = lv.offsets[u + 1] - lo
                    rr = np.repeat(r, ln)
                    src = np.repeat(lo - (np.cumsum(ln) - ln), ln) + np.arange(rr.size)
                    cols = lv.next_byte[src]
                    vals = lv.count[src] / np.repeat(lv.totals[u], ln)
                    fresh = ~done[rr, cols]
                    rr, cols = rr[fresh], cols[fresh]
                    out[rr, cols] = mult[rr] * vals[fresh]
                    done[rr, cols] = True
            # one back-off step for every row that had a context of this length
            mult[rows] *= alpha
        return out


def _narrow(a: np.ndarray) -> np.ndarray:
    """Unsigned integers ``a`` in the narrowest of uint8/16/32/64 that holds them."""
    top = int(a.max()) if a.size else 0
    for dt in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dt).max:
            return a.astype(dt)
    return a.astype(np.uint64)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no detail"


def stale_cache_files() -> list[Path]:
    """Count-table files in :func:`cache_dir` written in an older cache format (they are
    never read again; deleting them is safe)."""
    try:
        found = list(cache_dir().glob("ngram-v*-*.npz"))
    except OSError:
        return []
    out = []
    for f in found:
        m = re.match(r"ngram-v(\d+)-", f.name)
        if m and int(m.group(1)) != CACHE_FORMAT_VERSION:
            out.append(f)
    return sorted(out)


def context_windows(context: Sequence[int] | bytes, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The last ``width`` bytes of ``context`` as a right-aligned uint8 [1, width] window and
    its length int64 [1], the input format of :meth:`NgramCounts.scores`."""
    win = np.zeros((1, width), np.uint8)
    tail = bytes(context[-width:]) if width > 0 else b""
    if tail:
        win[0, width - len(tail):] = np.frombuffer(tail, np.uint8)
    return win, np.array([len(tail)], np.int64)


def greedy(scores: np.ndarray) -> np.ndarray:
    """Argmax of each row, ties to the lower byte value (int32 [...])."""
    return np.argmax(scores, axis=-1).astype(np.int32)


# --------------------------------------------------------------------------------------
# Target and drafter
# --------------------------------------------------------------------------------------

class NgramTarget:
    """The demo's target model: a greedy byte n-gram model (implements
    :class:`kdtree.engine.Target`).

    State: the committed text. A forward on a tree (:meth:`score_tree`) gives, for every
    node ``i`` (root included), the greedy next byte after ``committed + path(i)``, where
    ``path(i)`` are the tokens of ``i``'s draft ancestors and ``i`` itself (the root token
    is the last committed byte, already part of the context). This is exactly what a
    transformer target computes with the tree-attention mask, one call per round.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, counts: NgramCounts, order: int | None = None,
                 alpha: float = DEFAULT_ALPHA):
        self.counts = counts
        self.order = counts.order if order is None else order
        if not 1 <= self.order <= counts.order:
            raise ValueError(f"target order {self.order} not in 1..{counts.order}")
        self.alpha = alpha
        self.text = bytearray()
        self.calls = 0

    def prefill(self, prompt: Sequence[int]) -> None:
        """Start a new sequence with ``prompt`` (byte values) committed."""
        if len(prompt) == 0:
            raise ValueError("the prompt must hold at least one token")
        self.text = bytearray(bytes(prompt))

    def next_token(self) -> int:
        """One autoregressive forward: the greedy byte after the committed text."""
        self.calls += 1
        win, n = context_windows(self.text, self.order - 1)
        return int(greedy(self.counts.scores(win, n, self.order, self.alpha))[0])

    def score_tree(self, trees) -> np.ndarray:
        """One verify forward over every node of every tree (B must be 1: the target holds
        one sequence).

        Args:
            trees: a :class:`kdtree.TreeBatch` whose root token is the last committed byte.

        Returns:
            int32 [B, N+1], the greedy byte at each node (padding rows: -1).
        """
        self.calls += 1
        if trees.batch != 1:
            raise ValueError("NgramTarget holds one sequence; got a batch of "
                             f"{trees.batch} trees")
        n = int(trees.num_nodes[0])
        depths = trees.depths[0, : n + 1]
        parents = trees.parents[0, : n + 1]
        tokens = trees.tokens[0, : n + 1]
        width = self.order - 1
        root_win, root_len = context_windows(self.text, width)
        win = np.zeros((n + 1, width), np.uint8)
        length = np.zeros(n + 1, np.int64)
        win[0], length[0] = root_win[0], root_len[0]
        # a node's context is its parent's plus its own token; parents sit at depth d - 1
        for d in range(1, int(depths.max(initial=0)) + 1):
            sel = np.flatnonzero(depths == d)
            p = parents[sel]
            if width:
                win[sel, :-1] = win[p, 1:]
                win[sel, -1] = tokens[sel]
            length[sel] = np.minimum(length[p] + 1, width)
        out = np.full((1, trees.tokens.shape[1]), -1, np.int32)
        out[0, : n + 1] = greedy(self.counts.scores(win, length, self.order, self.alpha))
        return out

    def commit(self, tokens: Sequence[int], trees=None, acceptance=None) -> None:
        """Append the committed tokens (accepted draft tokens, then the bonus). An n-gram
        model has no KV cache to compact, so the accepted node indices are not needed."""
        self.text.extend(bytes(tokens))

    def drafter_features(self):
        """Features the drafter may condition on (a transformer's hidden states); none."""
        return None


class NgramDrafter:
    """The demo's drafter: a lower-order byte n-gram model unrolled along its own greedy
    chain (implements :class:`kdtree.engine.Drafter`).

    :meth:`draft` returns logits for the ``L`` positions below the root in one call, the
    shape a block-diffusion drafter (DFlash) returns: row ``d`` is
    ``log S(. | context + g_1 .. g_d)`` where ``g_j`` is the drafter's own greedy byte at
    depth ``j``. Zero scores get the finite floor ``log(1e-12)`` (so every logit is finite).
    """

    vocab_size = VOCAB_SIZE
    LOGIT_FLOOR = float(np.log(1e-12))

    def __init__(self, counts: NgramCounts, order: int = DEFAULT_DRAFT_ORDER,
                 alpha: float = DEFAULT_ALPHA):
        if not 1 <= order <= counts.order:
            raise ValueError(f"drafter order {order} not in 1..{counts.order}")
        self.counts = counts
        self.order = order
        self.alpha = alpha
        self.calls = 0

    def draft(self, context: Sequence[int], depth: int, features=None) -> np.ndarray:
        """Logits float32 [depth, 256] for depths 1..depth below the root.

        Args:
            context: committed tokens, the last one being the root token.
            depth: ``L``, number of draft positions (>= 0).
            features: ignored (a neural drafter would take the target's hidden states).
        """
        self.calls += 1
        width = self.order - 1
        win, n = context_windows(context, width)
        out = np.empty((depth, VOCAB_SIZE), np.float32)
        for d in range(depth):
            s = self.counts.scores(win, n, self.order, self.alpha)[0]
            g = int(np.argmax(s))
            with np.errstate(divide="ignore"):
                out[d] = np.maximum(np.log(s), self.LOGIT_FLOOR)
            if width:
                win[0, :-1] = win[0, 1:]
                win[0, -1] = g
                n = np.minimum(n + 1, width)
        return out


def build_models(*, order: int = DEFAULT_ORDER, draft_order: int = DEFAULT_DRAFT_ORDER,
                 corpus_bytes: int = DEFAULT_CORPUS_BYTES, hold_out: Path | str | None = None,
                 use_cache: bool = True) -> tuple[NgramTarget, NgramDrafter, Corpus, bool]:
    """Corpus -> counts (cached) -> (target, drafter, corpus, counts_from_cache)."""
    if not 1 <= draft_order <= order:
        raise ValueError(f"drafter order must be in 1..{order} (the target order), "
                         f"got {draft_order}")
    corpus = load_corpus(corpus_bytes, hold_out=hold_out)
    counts, cached = NgramCounts.load_or_estimate(corpus, order, use_cache=use_cache)
    return NgramTarget(counts, order), NgramDrafter(counts, draft_order), corpus, cached

