"""The frontier's figure: quality against the size and time ratios."""

from __future__ import annotations

from typing import Sequence

from lowrank_jax.compress.frontier.pareto import AXES, FrontierResult

_METRIC_LABELS = {"wql": "WQL relative to dense (lower is better)",
                  "accuracy": "accuracy (higher is better)",
                  "agreement": "top-1 agreement with dense (higher is better)",
                  "rel_error": "relative output error (lower is better)"}
_AXIS_LABELS = {"size": "size (storage bits) relative to dense",
                "time": "measured forward time relative to dense (median, interleaved)"}


def plot_frontier(result: FrontierResult, path: str, *, axes: Sequence[str] = ("size", "time"),
                  title: str | None = None) -> str:
    """Quality against the size and/or time ratio: every candidate (color by method), the
    Pareto frontier as a step line, the budget as a dashed line and the recommended candidate
    as a star; frontier points are labelled.

    Args:
      result: a :class:`FrontierResult`.
      path: the PNG file to write.
      axes: ``'size'``, ``'time'`` or both (one panel each).
      title: figure title.

    Returns:
      ``path``.
    """
    from lowrank_jax.analysis.plots import pyplot

    plt = pyplot()
    rows = [r for r in result.rows if not r.get("error") and r.get(result.metric) is not None]
    groups = [g for g in dict.fromkeys(r["group"] for r in rows) if g != "dense"]
    cmap = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    style = {g: (cmap(i % cmap.N), "os^vD<>phXPd8H"[i % 14]) for i, g in enumerate(groups)}
    style["dense"] = ("black", "*")
    fig, panels = plt.subplots(1, len(axes), figsize=(6.2 * len(axes), 5.2), squeeze=False)
    handles: dict = {}
    for ax, axis in zip(panels[0], axes, strict=True):
        key = AXES[axis]
        for g in ["dense", *groups]:
            pts = [r for r in rows if r["group"] == g and r.get(key) is not None]
            if pts:
                handles[g] = ax.scatter([r[key] for r in pts], [r[result.metric] for r in pts],
                                        s=70 if g == "dense" else 34, color=style[g][0],
                                        marker=style[g][1], alpha=0.85, zorder=3)
        front = [r for r in result.frontier(axis) if r.get(key) is not None]
        if front:
            (handles["Pareto frontier"],) = ax.step(
                [r[key] for r in front], [r[result.metric] for r in front], where="post",
                color="black", lw=1.0, alpha=0.6, zorder=2)
            for r in front:
                ax.annotate(r["name"], (r[key], r[result.metric]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points", alpha=0.85)
        handles[f"budget {result.budget:g}"] = ax.axvline(result.budget, color="gray", ls="--",
                                                          lw=1.0)
        best = result.recommended(axis)
        if best is not None:
            handles[f"best with ratio <= {result.budget:g}"] = ax.scatter(
                [best[key]], [best[result.metric]], s=300, marker="o", facecolor="none",
                edgecolor="red", linewidths=1.6, zorder=4)
            ax.annotate(f"best <= {result.budget:g}: {best['name']}", (best[key],
                        best[result.metric]), fontsize=7, color="red", xytext=(8, -12),
                        textcoords="offset points")
        else:
            ax.annotate(f"no candidate <= {result.budget:g}", (result.budget, 0.98),
                        xycoords=("data", "axes fraction"), fontsize=7, color="gray",
                        ha="left", va="top", xytext=(3, 0), textcoords="offset points")
        ax.set_xlabel(_AXIS_LABELS[axis])
        ax.set_ylabel(_METRIC_LABELS.get(result.metric, result.metric))
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=7,
               ncol=min(6, len(handles)), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    rows_legend = -(-len(handles) // min(6, len(handles)))
    fig.tight_layout(rect=(0, 0.035 * rows_legend + 0.01, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["plot_frontier"]
