"""``lowrank-jax partition MODEL --machines 8 --eps 0.1 --json report.json --plots DIR``.

Splits a model's MLPs and attention projections over ``--machines`` machines with the method of
"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar; the
``partition`` plan method, :mod:`lowrank_jax.compress.partition`) and reports, per weight: the
assignment of its outputs to machines (Algorithm 1 or the LP), the rank (numbers each machine
broadcasts per token), the bytes per token, storage and FLOPs per machine, and the relative
error; for a model checkpoint also the model's output error on its sample inputs. ``--plots``
draws the paper's Fig. 5 (``Tr M0`` / ``Tr M1`` per machine, eqs. 109-110) and the error
against the rank next to the SVD-method baseline (Figs. 6-7's comparison; here on standard
normal inputs, since a checkpoint carries no data: ``benchmarks/partition.py`` does it on real
data). ``--out`` saves the partitioned model (the leaves run under ``jax.shard_map`` when the
model is called under ``jax.set_mesh`` of a mesh with a ``model`` axis).

Wire it into ``lowrank_jax.cli.main`` with ``partition_cmd.add_parser(sub)``.
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

from lowrank_jax.cli import outputs
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError

#: The weights partitioned by default: every attention projection and every MLP projection.
DEFAULT_RULES = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wi_0|wi_1|wo)$")
#: At most this many weights get a panel in the plots (the JSON has every weight).
MAX_PANELS = 16


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``partition`` subcommand to ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser(
        "partition", help="split a model over machines with low intercommunication (Thill & "
                          "Divsalar): per-layer assignment, rank, bytes per token, errors")
    p.add_argument("params", metavar="MODEL",
                   help="a lowrank_jax checkpoint or a Hugging Face directory")
    p.add_argument("--machines", type=int, default=8, help="number of machines M (default 8)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--eps", type=float,
                   help="the paper's rank rule: smallest r with max sigma_(r+1) <= eps/sqrt(M), "
                        "so that ||Delta|| <= eps ||x|| (default 0.1)")
    g.add_argument("--rank", type=int, help="the same rank r for every weight")
    p.add_argument("--relative", action="store_true",
                   help="--eps relative to each weight's spectral norm")
    p.add_argument("--assignment", choices=("greedy", "greedy-rows", "lp", "contiguous"),
                   default="greedy", help="how MLP hidden units are assigned to machines: "
                   "Algorithm 1 as its box states it (greedy), as its prose does (greedy-rows), "
                   "the LP relaxation (lp), or in order (default greedy)")
    p.add_argument("--rule", action="append",
                   help="path regex of the weights to partition (first match wins; '!regex' "
                        "skips); default: attention q/k/v/o and MLP projections")
    p.add_argument("--family", help="force the model family of a Hugging Face directory")
    p.add_argument("--json", help="write the report as JSON to this file")
    p.add_argument("--plots", help="write Fig. 5 and error-vs-rank plots to this directory")
    p.add_argument("--out", help="save the partitioned model to this directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out / --plots if lowrank-jax wrote them")
    p.add_argument("--samples", type=int, default=256,
                   help="standard normal inputs per weight for the error curves (default 256)")
    p.add_argument("--no-eval", action="store_true", help="skip the model's output error")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def _check(args) -> dict:
    if args.machines < 2:
        raise ConfigError(f"--machines must be >= 2, got {args.machines}", where="--machines",
                          expected=">= 2", actual=args.machines)
    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}", where="--samples",
                          expected=">= 1", actual=args.samples)
    if args.rank is not None and args.rank < 0:
        raise ConfigError(f"--rank must be an int >= 0, got {args.rank}", where="--rank",
                          expected=">= 0", actual=args.rank)
    if args.eps is not None and not (math.isfinite(args.eps) and args.eps > 0):
        raise ConfigError(f"--eps must be a number > 0, got {args.eps}", where="--eps",
                          expected="> 0", actual=args.eps)
    settings = {"machines": args.machines, "assignment": args.assignment,
                "relative": bool(args.relative)}
    if args.rank is not None:
        settings["rank"] = args.rank
    else:
        settings["eps"] = 0.1 if args.eps is None else args.eps
    inputs = {"MODEL": args.params}
    if args.out:
        outputs.check_checkpoint_out(args.out, inputs, overwrite=args.overwrite)
    if args.plots:
        outputs.check_plots_out(args.plots, inputs, overwrite=args.overwrite)
    if args.json:
        outputs.check_report_path(args.json, inputs, (args.out, args.plots))
    return settings


def curves(dec, machines: int, samples: int, seed: int = 0) -> dict:
    """Relative output error against the rank, new method vs the SVD method (and the rank-``M r``
    full SVD), on ``samples`` standard normal inputs; the bound of eq. 94 (mean over inputs).

    Args:
      dec: the weight's :class:`~lowrank_jax.compress.partition.Decomposition`.
      machines: ``M``.
      samples: number of inputs.
      seed: of the inputs.

    Returns:
      ``{'rank', 'new', 'svd', 'full_svd', 'bound_new', 'bound_svd'}`` lists.
    """
    from lowrank_jax.compress.partition import (
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


def run(args) -> int:
    """Run ``lowrank-jax partition`` (module docstring). Returns the exit status."""
    from lowrank_jax.cli.sources import load_source, parse_rules
    from lowrank_jax.compress import select
    from lowrank_jax.compress.partition import partition_weights
    from lowrank_jax.compress.report import Report

    settings = _check(args)
    status = Status("partition", bars=not args.no_progress)
    src = load_source(args.params, status=status, family=args.family)
    params = src.params
    selection = select(params, parse_rules(args.rule, DEFAULT_RULES), where="--rule")
    with status.phase(f"partitioning {len(selection)} weights over {args.machines} machines "
                      "(assignment and SVD of every off-diagonal block)"):
        new, rows, decs = partition_weights(params, selection, settings)
    report = Report.build(params, new, rows)
    head = (f"{'path':<34}{'rank':>5}{'d*':>5}{'B/token':>9}{'params/mach':>13}"
            f"{'MACs/mach':>11}{'error':>11}  assignment")
    print(head)
    layers = []
    for row in rows:
        d = row.details
        if row.kind != "partitioned":
            print(f"{row.path:<34}  ({row.kind}: {d.get('reason', '')})")
            continue
        print(f"{row.path:<34}{d['rank']:>5}{d['max_rank']:>5}{d['bytes_per_token']:>9}"
              f"{d['params_machine']:>13.0f}{d['macs_machine']:>11.0f}{row.error:>11.3e}  "
              f"{d['assignment']} ({d['order']})")
        entry = {"path": row.path, "error": row.error, **d}
        dec, _ = decs[row.path]
        entry["curves"] = curves(dec, args.machines, args.samples)
        layers.append(entry)
    total_bytes = sum(e["bytes_per_token"] for e in layers)
    print(f"\n{len(layers)} weights partitioned over {args.machines} machines: each machine "
          f"broadcasts {total_bytes} bytes per token per forward pass (sum over the weights; "
          f"eq. 34); parameters {report.tree['params_before']} -> {report.tree['params_after']}")
    out = {"machines": args.machines, "settings": settings, "layers": layers,
           "bytes_per_token": total_bytes, "totals": report.totals,
           "rows": [r.to_dict() for r in report.rows]}
    if src.config is not None and not args.no_eval:
        from lowrank_jax.compress import compare_models

        with status.phase("evaluating the model (original and partitioned, on one device, on "
                          "sample inputs)"):
            ev = compare_models(src.config, params, new, measure_time=False)
        out["model"] = ev
        print(f"model: {ev['output']} relative error {ev['rel_error']:.3e}, max abs error "
              f"{ev['max_abs_error']:.3e}")
    if args.plots:
        with status.phase(f"plotting to {args.plots}"), outputs.marked_directory(
                args.plots, kind="plots", overwrite=args.overwrite, who="partition") as tmp:
            out["plots"] = plot(layers, tmp)
        print(f"wrote plots to {args.plots}")
    if args.out:
        from lowrank_jax.io import save_model, save_params

        meta = {**src.metadata, "partition": settings}
        with status.phase(f"saving to {args.out}"), outputs.writing_checkpoint(
                args.out, overwrite=args.overwrite):
            if src.config is not None:
                save_model(args.out, src.config, new, metadata=meta, overwrite=args.overwrite)
            else:
                save_params(args.out, new, metadata=meta, overwrite=args.overwrite)
        print(f"saved the partitioned model to {args.out}")
    if args.json:
        written = outputs.write_report(args.json, out, command="partition",
                                       inputs={"MODEL": args.params},
                                       outputs=(args.out, args.plots))
        print(f"wrote {written}")
    return 0


__all__ = ["DEFAULT_RULES", "add_parser", "curves", "plot", "run"]
