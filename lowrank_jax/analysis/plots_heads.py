"""Heat map of per-head ranks, layer x head (irregular attention).

"Vision Transformer with Irregular Attention" (sec. 4.5, Fig. 2) shows that IrrAtt gives the
heads of a block very different query-key ranks. :func:`plot_head_ranks` draws the ranks chosen
per head for every attention block of a model, one row per block, one column per head; the
``lowrank-jax compress`` command calls it with the ranks of a report
(:func:`lowrank_jax.compress.head_ranks`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from lowrank_jax.analysis.plots import pyplot
from lowrank_jax.errors import DataError


def head_rank_grid(ranks: Mapping[str, Sequence[int]]) -> tuple[list[str], np.ndarray]:
    """Ranks per block and head as a matrix.

    Args:
      ranks: ``{block path: ranks per head}`` (for example
        ``{'encoder/layers/0/attn/qk': [3, 9, 0, 4], ...}``), in the order the rows should have.

    Returns:
      ``(labels, grid)``: the block paths and a float ``[blocks, max heads]`` matrix, ``NaN``
      where a block has fewer heads.

    Raises:
      DataError: no blocks, or a rank that is not an integer ``>= 0`` (naming the block).
    """
    if not ranks:
        raise DataError("head_rank_grid: no per-head ranks to show (did the plan run truncatt, "
                        "cp or btd?)", where="ranks", expected="{path: ranks}", actual={})
    labels = list(ranks)
    width = max(len(r) for r in ranks.values())
    grid = np.full((len(labels), width), np.nan)
    for i, path in enumerate(labels):
        row = list(ranks[path])
        for h, r in enumerate(row):
            if isinstance(r, bool) or not float(r).is_integer() or r < 0:
                raise DataError(f"head_rank_grid: {path}: head {h} has rank {r!r}; ranks must be "
                                "integers >= 0", where=path, expected="int >= 0", actual=r)
            grid[i, h] = float(r)
    return labels, grid


def plot_head_ranks(ranks: Mapping[str, Sequence[int]], path: str | None = None, *,
                    title: str = "query-key rank per head", annotate: bool = True):
    """Heat map of the ranks per head, one row per attention block (layer x head).

    Args:
      ranks: ``{block path: ranks per head}`` (:func:`lowrank_jax.compress.head_ranks` of a
        report).
      path: save the figure there (PNG, 120 dpi) and close it; ``None`` returns it open.
      title: figure title.
      annotate: write each rank in its cell.

    Returns:
      The saved path, or the matplotlib ``Figure`` when ``path`` is ``None``.
    """
    labels, grid = head_rank_grid(ranks)
    plt = pyplot()
    shown = [lab.removesuffix("/qk") for lab in labels]
    # room for the row labels (about 0.07 inch a character) and the colour bar
    width = 2.2 + 0.07 * max(len(lab) for lab in shown) + 0.45 * grid.shape[1]
    fig, ax = plt.subplots(figsize=(width, 1.4 + 0.35 * grid.shape[0]))
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis")
    ax.set_xticks(range(grid.shape[1]))
    ax.set_xlabel("head")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(shown, fontsize="small")
    ax.set_title(title)
    if annotate:
        top = np.nanmax(grid) if np.isfinite(grid).any() else 0.0
        for (i, h), r in np.ndenumerate(grid):
            if np.isfinite(r):
                ax.text(h, i, str(int(r)), ha="center", va="center", fontsize="x-small",
                        color="black" if r > 0.6 * top else "white")
    fig.colorbar(im, ax=ax, label="rank")
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["head_rank_grid", "plot_head_ranks"]
