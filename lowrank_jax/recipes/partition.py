"""The ``partition`` workflow: split a model's MLPs and attention projections over machines
with the method of "Partitioning Transformer Networks with Low Intercommunication" (Thill &
Divsalar; the ``partition`` plan method, :mod:`lowrank_jax.compress.partitioning`).

Per weight: the assignment of its outputs to machines (Algorithm 1 or the LP), the rank
(numbers each machine broadcasts per token), the bytes per token, storage and FLOPs per
machine, and the relative error; for a model checkpoint also the model's output error on its
sample inputs. ``plots`` draws the paper's Fig. 5 (``Tr M0`` / ``Tr M1`` per machine, eqs.
109-110) and the error against the rank next to the SVD-method baseline (Figs. 6-7's
comparison; here on standard normal inputs, since a checkpoint carries no data:
``benchmarks/methods/partition.py`` does it on real data). ``out`` saves the partitioned model (the
leaves run under ``jax.shard_map`` when the model is called under ``jax.set_mesh`` of a mesh
with a ``model`` axis).
"""

from __future__ import annotations

import os

import numpy as np

from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines

#: The weights partitioned by default: every attention projection and every MLP projection.
DEFAULT_RULES = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wi_0|wi_1|wo)$")
#: At most this many weights get a panel in the plots (the JSON has every weight).
MAX_PANELS = 16


def curves(dec, machines: int, samples: int, seed: int = 0) -> dict:
    """Relative output error against the rank, new method vs the SVD method (and the rank-``M r``
    full SVD), on ``samples`` standard normal inputs; the bound of eq. 94 (mean over inputs).

    Args:
      dec: the weight's :class:`~lowrank_jax.compress.partitioning.Decomposition`.
      machines: ``M``.
      samples: number of inputs.
      seed: of the inputs.

    Returns:
      ``{'rank', 'new', 'svd', 'full_svd', 'bound_new', 'bound_svd'}`` lists.
    """
    from lowrank_jax.compress.partitioning import (
        error_terms,
        full_svd_matrix,
        relative_output_errors,
        svd_method_matrix,
    )

    x = np.random.default_rng(seed).standard_normal((samples, dec.w.shape[0]))
    top = dec.max_rank
    ranks = sorted({int(r) for r in np.unique(np.linspace(0, top, min(top + 1, 17)).round())})
    out = {k: [] for k in ("rank", "new", "svd", "full_svd", "bound_new", "bound_svd")}
    ratio = np.linalg.norm(x, axis=1) / np.maximum(np.linalg.norm(x @ dec.w, axis=1), 1e-300)
    for r in ranks:
        t = error_terms(dec, r, x)
        svd = svd_method_matrix(dec.w, machines, r)
        s0 = dec.sigma0[:, r].max() if r < dec.sigma0.shape[1] else 0.0
        out["rank"].append(r)
        out["new"].append(float(np.nanmean(t["rel"])))
        out["svd"].append(float(np.nanmean(relative_output_errors(dec.w, svd, x))))
        out["full_svd"].append(float(np.nanmean(relative_output_errors(
            dec.w, full_svd_matrix(dec.w, machines * r), x))))
        out["bound_new"].append(float(np.nanmean(t["eq94"])))
        out["bound_svd"].append(float(np.sqrt(machines) * s0 * np.mean(ratio)))
    return out


def _grid(n: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return plt, fig, axes.flat


def plot(rows: list[dict], directory: str) -> list[str]:
    """Fig. 5 (``Tr M0`` / ``Tr M1`` per machine) and the error-vs-rank curves, one panel per
    weight (the first :data:`MAX_PANELS`). Returns the file names."""
    shown = rows[:MAX_PANELS]
    plt, fig, axes = _grid(len(shown))
    for ax, row in zip(axes, shown, strict=False):
        m = np.arange(len(row["tr_m0"]))
        ax.bar(m - 0.2, row["tr_m0"], 0.4, label="Tr M0 (SVD method)")
        ax.bar(m + 0.2, row["tr_m1"], 0.4, label="Tr M1 (partition)")
        ax.set_title(row["path"], fontsize=8)
        ax.set_xlabel("machine m'", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "fig5_traces.png"), dpi=110)
    plt.close(fig)
    plt, fig, axes = _grid(len(shown))
    for ax, row in zip(axes, shown, strict=False):
        c = row["curves"]
        ax.plot(c["rank"], c["new"], "o-", ms=3, label="partition (new)")
        ax.plot(c["rank"], c["svd"], "s-", ms=3, label="SVD method")
        ax.plot(c["rank"], c["full_svd"], ":", label="full SVD, rank M r")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_title(row["path"], fontsize=8)
        ax.set_xlabel("r (numbers sent per machine)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "fig6_error_vs_rank.png"), dpi=110)
    plt.close(fig)
    return ["fig5_traces.png", "fig6_error_vs_rank.png"]


def run_partition(model: str, *, machines: int = 8, eps: float | None = None,
                  rank: int | None = None, relative: bool = False, assignment: str = "greedy",
                  rules: list[str] | None = None, samples: int = 256, evaluate: bool = True,
                  family: str | None = None, out: str | None = None, plots: str | None = None,
                  overwrite: bool = False, status: Progress | None = None) -> Outcome:
    """Partition a model over ``machines`` machines (module docstring).

    Args:
      model: a lowrank_jax checkpoint or a Hugging Face directory.
      machines: the number of machines M (>= 2).
      eps: the paper's rank rule, the smallest r with max sigma_(r+1) <= eps/sqrt(M), so that
        ||Delta|| <= eps ||x|| (default 0.1 when ``rank`` is not given).
      rank: the same rank r for every weight instead.
      relative: ``eps`` relative to each weight's spectral norm.
      assignment: how MLP hidden units are assigned to machines: ``'greedy'`` (Algorithm 1 as
        its box states it), ``'greedy-rows'`` (as its prose does), ``'lp'`` (the LP relaxation)
        or ``'contiguous'``.
      rules: path regexes of the weights to partition (first match wins; ``'!regex'`` skips);
        default: attention q/k/v/o and MLP projections.
      samples: standard normal inputs per weight for the error curves.
      evaluate: the model's output error (model checkpoints only).
      family: force the model family of a Hugging Face directory.
      out: save the partitioned model there.
      plots: draw Fig. 5 and the error-vs-rank curves into this directory.
      overwrite: replace ``out`` / ``plots`` if lowrank-jax wrote them.
      status: progress reporting (default: status lines on stderr).

    Returns:
      The report (``machines``, ``settings``, per-weight ``layers`` with their curves,
      ``bytes_per_token``, ``totals``, ``rows``, ``model``, ``plots``), the table as lines;
      ``values``: ``params`` (the partitioned tree) and ``config``.
    """
    from lowrank_jax.compress import select
    from lowrank_jax.compress.partitioning import partition_weights
    from lowrank_jax.compress.report import Report
    from lowrank_jax.recipes import outputs, sources

    settings = {"machines": machines, "assignment": assignment, "relative": bool(relative)}
    if rank is not None:
        settings["rank"] = rank
    else:
        settings["eps"] = 0.1 if eps is None else eps
    status = lines(status, "partition")
    src = sources.load_source(model, status=status, family=family)
    params = src.params
    selection = select(params, sources.parse_rules(rules, DEFAULT_RULES), where="--rule")
    with status.phase(f"partitioning {len(selection)} weights over {machines} machines "
                      "(assignment and SVD of every off-diagonal block)"):
        new, rows, decs = partition_weights(params, selection, settings)
    report = Report.build(params, new, rows)
    text = [f"{'path':<34}{'rank':>5}{'d*':>5}{'B/token':>9}{'params/mach':>13}"
            f"{'MACs/mach':>11}{'error':>11}  assignment"]
    layers = []
    for row in rows:
        d = row.details
        if row.kind != "partitioned":
            text.append(f"{row.path:<34}  ({row.kind}: {d.get('reason', '')})")
            continue
        text.append(f"{row.path:<34}{d['rank']:>5}{d['max_rank']:>5}{d['bytes_per_token']:>9}"
                    f"{d['params_machine']:>13.0f}{d['macs_machine']:>11.0f}{row.error:>11.3e}  "
                    f"{d['assignment']} ({d['order']})")
        entry = {"path": row.path, "error": row.error, **d}
        dec, _ = decs[row.path]
        entry["curves"] = curves(dec, machines, samples)
        layers.append(entry)
    total_bytes = sum(e["bytes_per_token"] for e in layers)
    text.append(f"\n{len(layers)} weights partitioned over {machines} machines: each machine "
                f"broadcasts {total_bytes} bytes per token per forward pass (sum over the "
                f"weights; eq. 34); parameters {report.tree['params_before']} -> "
                f"{report.tree['params_after']}")
    result = Outcome({"machines": machines, "settings": settings, "layers": layers,
                      "bytes_per_token": total_bytes, "totals": report.totals,
                      "rows": [r.to_dict() for r in report.rows]}, lines=text,
                     values={"params": new, "config": src.config})
    text = result.lines
    if src.config is not None and evaluate:
        from lowrank_jax.compress import compare_models

        with status.phase("evaluating the model (original and partitioned, on one device, on "
                          "sample inputs)"):
            ev = compare_models(src.config, params, new, measure_time=False)
        result["model"] = ev
        text.append(f"model: {ev['output']} relative error {ev['rel_error']:.3e}, max abs "
                    f"error {ev['max_abs_error']:.3e}")
    if plots:
        with status.phase(f"plotting to {plots}"), outputs.marked_directory(
                plots, kind="plots", overwrite=overwrite, who="partition") as tmp:
            result["plots"] = plot(layers, tmp)
        text.append(f"wrote plots to {plots}")
    if out:
        from lowrank_jax.io import save_model, save_params

        meta = {**src.metadata, "partition": settings}
        with status.phase(f"saving to {out}"), outputs.writing_checkpoint(
                out, overwrite=overwrite):
            if src.config is not None:
                save_model(out, src.config, new, metadata=meta, overwrite=overwrite,
                           extra_files=src.extra_files())
            else:
                save_params(out, new, metadata=meta, overwrite=overwrite)
        text.append(f"saved the partitioned model to {out}")
    return result


__all__ = ["DEFAULT_RULES", "MAX_PANELS", "curves", "plot", "run_partition"]
