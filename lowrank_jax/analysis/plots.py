"""Plots people would rather look at than read (matplotlib is the optional ``plot`` extra)."""

from __future__ import annotations

from typing import Sequence

from lowrank_jax.errors import MissingDependencyError


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend (the optional ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("plots need matplotlib: pip install 'lowrank-jax[plot]'",
                                     where="matplotlib", expected="installed",
                                     actual="missing") from e
    return plt


def _save(plt, fig, ax, path: str, xlabel: str, ylabel: str, title: str) -> str:
    """Label the axes, add the legend, write ``path`` (120 dpi) and close the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_spectra(spectra: Sequence, labels: Sequence[str], path: str, *, title: str = "") -> str:
    """Normalized singular values ``sigma_j / sigma_1`` on a log scale ("Understanding
    Transformers for Time Series", Figs. 2, 5c)."""
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, lab in zip(spectra, labels, strict=True):
        s = np.asarray(s, dtype=float)
        ax.semilogy(np.arange(1, len(s) + 1), s / s[0], label=lab)
    return _save(plt, fig, ax, path, "index j", "sigma_j / sigma_1", title)


def plot_layer_ranks(layers: Sequence[int], ranks: dict, path: str, *, title: str = "",
                     ylabel: str = "eps-rank") -> str:
    """eps-rank per layer, one line per eps (flow-of-ranks, Fig. 5a)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for eps, r in ranks.items():
        ax.plot(list(layers), list(r), marker="o", label=f"eps={eps:g}")
    return _save(plt, fig, ax, path, "layer", ylabel, title)


def plot_slope(x, y, path: str, *, reference_slope: float, xlabel: str, title: str = "") -> str:
    """Log-log error plot with a reference line of the given slope (Fig. 15)."""
    import numpy as np

    plt = pyplot()
    x, y = np.asarray(x, float), np.asarray(y, float)
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.loglog(x, y, "o-", label="measured")
    ref = y[0] * (x / x[0]) ** reference_slope
    ax.loglog(x, ref, "--", label=f"slope {reference_slope:g}")
    return _save(plt, fig, ax, path, xlabel, "||Y - Y~||_F", title)


__all__ = ["plot_layer_ranks", "plot_slope", "plot_spectra", "pyplot"]
