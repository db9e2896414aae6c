"""Pictures of a DDTree generation (matplotlib, imported on use): the acceptance-length
histogram and one round's draft tree with the accepted path."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def tree_layout(trees: Any, b: int = 0, max_nodes: int = 30,
                extra: Iterable[int] = ()) -> dict[int, tuple[float, float]]:
    """(x, y) of nodes 0 .. min(n, max_nodes) of request ``b`` and of the nodes in
    ``extra`` (a root-connected set, e.g. the accepted path): x = depth, y = order of the
    node's first leaf in a depth-first walk with children in node order (so siblings stack
    by decreasing score). Parents precede children in node order, so the drawn nodes form a
    connected subtree."""
    n = min(int(trees.num_nodes[b]), max(0, max_nodes))
    also = {int(i) for i in extra}
    fc, ns = trees.first_child[b], trees.next_sibling[b]
    pos: dict[int, tuple[float, float]] = {}
    next_y = [0.0]

    def place(i: int) -> float:
        kids = []
        c = int(fc[i])
        while c != -1:
            if c <= n or c in also:
                kids.append(c)
            c = int(ns[c])
        if not kids:
            y = next_y[0]
            next_y[0] += 1.0
        else:
            ys = [place(c) for c in kids]
            y = (ys[0] + ys[-1]) / 2.0
        pos[i] = (float(trees.depths[b, i]), y)
        return y

    place(0)
    return pos


def plot_round(result: Any, path: str | Path, *, token_str: Callable[[int], str] = str, max_nodes: int = 30) -> None:
    """Write ``path`` (PNG, SVG or any matplotlib format): the histogram of tokens committed
    per round of ``result`` (a :class:`kdtree.engine.GenerationResult`) and its snapshot
    round's draft tree, the accepted path in orange.

    Raises:
        ImportError: matplotlib is missing. ValueError: the result has no rounds.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from exc
    if not result.committed:
        raise ValueError("the generation has no rounds to draw")
    fig, (ax_h, ax_t) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [1, 2.2]})
    hist = Counter(result.committed)
    ks = list(range(1, max(hist) + 1))
    ax_h.bar(ks, [hist.get(k, 0) for k in ks], color="#4c72b0")
    ax_h.set_xlabel("tokens committed per round (accepted draft tokens + bonus)")
    ax_h.set_ylabel("rounds")
    ax_h.yaxis.get_major_locator().set_params(integer=True)
    # whole tokens, also with a single bar (the default locator goes fractional below 2 ticks)
    ax_h.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax_h.set_title(f"acceptance length: mean {result.mean_acceptance_length:.2f} over {result.rounds} rounds")
    snap = result.snapshot
    ax_t.set_axis_off()
    if snap is not None:
        trees, acc = snap.trees, snap.acceptance
        m = int(acc.accept_length[0])
        path_nodes = {int(i) for i in acc.accepted_nodes[0][: m + 1]}
        pos = tree_layout(trees, 0, max_nodes, extra=path_nodes)
        for i, (x, y) in pos.items():
            if i == 0:
                continue
            px, py = pos[int(trees.parents[0, i])]
            on = i in path_nodes
            ax_t.plot([px, x], [py, y], color="#dd8452" if on else "#999999", lw=2.5 if on else 1.0, zorder=1)
        for i, (x, y) in pos.items():
            on = i in path_nodes
            label = token_str(int(trees.tokens[0, i])).replace("\n", "\\n")
            ax_t.text(x, y, label[:12], ha="center", va="center", fontsize=8, zorder=2,
                      bbox=dict(boxstyle="round,pad=0.2", fc="#fbe3d2" if on else "white",
                                ec="#dd8452" if on else "#777777"))
        ax_t.invert_yaxis()
        ax_t.set_title(f"draft tree of round {snap.index} ({len(pos) - 1} of {int(trees.num_nodes[0])} nodes: the "
                       f"best and the accepted path, in orange, then bonus {token_str(int(acc.bonus_token[0]))!r})")
        xs = [p[0] for p in pos.values()]
        ys = [p[1] for p in pos.values()]
        ax_t.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
        ax_t.set_ylim(max(ys) + 0.8, min(ys) - 0.8)
    fig.tight_layout()
    from ..core.files import write_atomically

    fmt = Path(path).suffix.lower().lstrip(".") or "png"
    try:
        write_atomically(path, lambda f: fig.savefig(f, format=fmt))  # all of the file or none
    finally:
        plt.close(fig)
