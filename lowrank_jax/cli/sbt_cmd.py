"""``lowrank-jax sbt {classify,anomaly,forecast} --dataset NAME --prune 0.5 --json out.json
--plots DIR``.

Trains a sparse binary transformer ("Sparse Binary Transformers for Multivariate Time Series
Modeling", Gorbett et al., KDD 2023, arXiv:2308.04637), or with ``--dense`` its dense twin, on a
dataset shipped with aeon and evaluates it:

* ``classify``: JapaneseVowels (padded to 29 steps) or BasicMotions; test accuracy;
* ``anomaly``: ``kdd135`` (UCR/KDD-cup series 135) or ``ecg``; score = MSE of the last step of
  each window (step-T mask), thresholds by the ``1 - r`` quantile of validation scores and by
  POT (scipy's generalized Pareto fit), point-adjusted precision / recall / F1;
* ``forecast``: ``daphnet`` (9 channels, split by time); single-step MSE / MAE.

It prints one line per epoch, a summary, the paper-convention (Table 5) FLOP and bit counts of
this configuration and the library's honest counts; ``--out`` saves the trained model with its
binary weights packed into bits (:class:`~lowrank_jax.leaves.PackedBinary`); ``--plots``
draws the training curves and, for anomalies, the score series with both thresholds and the
labelled and detected segments. Outputs follow :mod:`lowrank_jax.cli.outputs`.

Wire it into ``lowrank_jax.cli.main`` with ``sbt_cmd.add_parser(sub)`` (dispatch on
``args.command == "sbt"`` to :func:`run`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lowrank_jax.cli import outputs
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError

DEFAULT_DATASET = {"classify": "JapaneseVowels", "anomaly": "kdd135", "forecast": "daphnet"}
DEFAULT_PRUNE = {"classify": 0.5, "anomaly": 0.75, "forecast": 0.5}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``sbt`` subcommand to ``subparsers``."""
    p = subparsers.add_parser(
        "sbt", help="train and evaluate a sparse binary transformer (SBT) on a time-series "
                    "task: classification, anomaly detection or single-step forecasting")
    p.add_argument("task", choices=("classify", "anomaly", "forecast"))
    p.add_argument("--dataset", help="classify: JapaneseVowels | BasicMotions; anomaly: kdd135 "
                                     "| ecg; forecast: daphnet (default: the first)")
    p.add_argument("--prune", type=float, help="pruning rate p of the binary weights (keep = "
                                               "1 - p; default 0.5, anomaly 0.75)")
    p.add_argument("--dense", action="store_true", help="the dense transformer instead")
    p.add_argument("--epochs", type=int, help="training epochs (default: classify SBT 250, "
                                              "dense 50; anomaly 50; forecast 30)")
    p.add_argument("--batch-size", type=int, help="default: classify 8, else 128")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--d-model", type=int, default=32, help="model width d (default 32)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--window", type=int, default=50,
                   help="anomaly / forecast window w (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plots", help="write plots into this directory")
    p.add_argument("--out", help="save the trained model (binary weights packed) here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace previous outputs of this tool")
    p.add_argument("--no-progress", action="store_true", help="no live status lines")
    return p


def _check(args) -> None:
    dataset = args.dataset or DEFAULT_DATASET[args.task]
    from lowrank_jax.analysis.sbt_tasks import DATASETS

    if dataset not in DATASETS[args.task]:
        raise ConfigError(f"--dataset {dataset!r} is not available for '{args.task}'; choose "
                          f"one of {list(DATASETS[args.task])} (shipped with aeon)",
                          where="--dataset", expected=list(DATASETS[args.task]), actual=dataset)
    prune = DEFAULT_PRUNE[args.task] if args.prune is None else args.prune
    if not 0.0 <= prune < 1.0:
        raise ConfigError(f"--prune must be in [0, 1), got {prune}", where="--prune",
                          expected="[0, 1)", actual=prune)
    for flag, v in (("--epochs", args.epochs), ("--batch-size", args.batch_size),
                    ("--d-model", args.d_model), ("--heads", args.heads),
                    ("--layers", args.layers), ("--d-ff", args.d_ff)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}", where=flag, expected=">= 1",
                              actual=v)
    if args.window < 2:
        raise ConfigError(f"--window must be >= 2, got {args.window}", where="--window",
                          expected=">= 2", actual=args.window)
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}", where="--lr", expected="> 0",
                          actual=args.lr)
    if args.d_model % args.heads:
        raise ConfigError(f"--heads {args.heads} must divide --d-model {args.d_model}",
                          where="--heads", expected=f"a divisor of {args.d_model}",
                          actual=args.heads)
    if args.out:  # the data come from the installed aeon package: no input path to keep apart
        outputs.check_checkpoint_out(args.out, {}, overwrite=args.overwrite)
    if args.plots:
        outputs.check_plots_out(args.plots, {}, overwrite=args.overwrite)
    if args.json:
        outputs.check_report_path(args.json, {}, (args.out, args.plots))
    args.dataset, args.prune = dataset, prune


def plot(result, directory: str) -> list[str]:
    """Training curves, and for anomaly detection the score series with both thresholds and the
    labelled / detected segments. Returns the file names written."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lowrank_jax.analysis.anomaly import segments

    files = []
    hist = result.history
    ep = [h["epoch"] for h in hist]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(ep, [h["train_loss"] for h in hist], label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    for key in ("test_accuracy", "train_accuracy", "val_mse"):
        if key in hist[0]:
            ax2.plot(ep, [h[key] for h in hist], "--", label=key.replace("_", " "))
    ax2.set_ylabel("accuracy" if "test_accuracy" in hist[0] else "validation MSE")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    kind = "dense" if not result.config.binary else f"SBT p={1 - result.config.keep:g}"
    ax.set_title(f"{result.dataset} ({kind}): training")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "training.png"), dpi=120)
    plt.close(fig)
    files.append("training.png")
    if result.task == "anomaly":
        s, y = result.extra["scores"], result.extra["labels"]
        thr = result.extra["thresholds"]
        fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
        axes[0].plot(result.extra["test"][:, 0], lw=0.6, color="k")
        axes[0].set_ylabel("series (z)")
        axes[1].semilogy(np.maximum(s, 1e-12), lw=0.6, label="score (last-step MSE)")
        for name, c in (("quantile", "tab:orange"), ("pot", "tab:red")):
            axes[1].axhline(thr[name], color=c, ls="--", label=f"{name} threshold")
        for a, b in segments(y):
            for axx in axes:
                axx.axvspan(a, b, color="tab:green", alpha=0.3)
        for a, b in segments(s > thr["pot"]):
            axes[1].axvspan(a, max(b, a + 1), ymin=0.0, ymax=0.06, color="tab:red")
        axes[1].legend(fontsize=8, loc="upper left")
        axes[1].set_xlabel("test step (green: labelled anomalies; red ticks: flagged by POT)")
        fig.tight_layout()
        fig.savefig(os.path.join(directory, "anomaly_scores.png"), dpi=120)
        plt.close(fig)
        files.append("anomaly_scores.png")
    if result.task == "forecast":
        pred, tgt = result.extra["prediction"], result.extra["target"]
        n = min(600, len(pred))
        fig, ax = plt.subplots(figsize=(10, 3.2))
        ax.plot(tgt[:n, 0], lw=0.8, label="actual (channel 0)")
        ax.plot(pred[:n, 0], lw=0.8, label="forecast")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(directory, "forecast.png"), dpi=120)
        plt.close(fig)
        files.append("forecast.png")
    return files


def run(args) -> int:
    """Run ``lowrank-jax sbt`` (module docstring). Returns the exit status."""
    _check(args)
    from lowrank_jax.analysis import sbt_accounting as acc
    from lowrank_jax.analysis import sbt_tasks as tasks

    status = Status("sbt", bars=not args.no_progress)
    keep = 1.0 - args.prune
    kind = "dense" if args.dense else f"SBT (p = {args.prune:g}, keep {keep:g})"
    loaders = {"classify": tasks.load_classification_data, "anomaly": tasks.load_anomaly_data,
               "forecast": tasks.load_forecast_data}
    with status.phase(f"loading {args.dataset} (shipped with aeon)"):
        data = loaders[args.task](args.dataset)
    kw = dict(binary=not args.dense, keep=1.0 if args.dense else keep, seed=args.seed,
              lr=args.lr, d_model=args.d_model, num_heads=args.heads, d_ff=args.d_ff,
              num_layers=args.layers, data=data)
    if args.epochs is not None:
        kw["epochs"] = args.epochs
    if args.batch_size is not None:
        kw["batch"] = args.batch_size
    if args.task != "classify":
        kw["window"] = args.window

    def progress(rec):
        extra = "  ".join(f"{k} {v:.4f}" for k, v in rec.items()
                          if k not in ("epoch", "epochs", "seconds", "train_loss"))
        status.say(f"epoch {rec['epoch']}/{rec['epochs']}  train loss {rec['train_loss']:.4f}  "
                   f"{extra}  ({rec['seconds']:.0f} s)")

    status.say(f"training the {kind} on {args.dataset} ({args.task}); the first epoch "
               "includes compilation")
    t0 = time.perf_counter()
    result = tasks.RUNNERS[args.task](args.dataset, progress=progress, **kw)
    seconds = time.perf_counter() - t0
    cfg = result.config
    m = result.metrics
    if args.task == "classify":
        print(f"{args.dataset} {kind}: test accuracy {100 * m['accuracy']:.2f}%")
    elif args.task == "anomaly":
        for name in ("quantile", "pot"):
            e = m[name]
            print(f"{args.dataset} {kind}: {name:>8} threshold {e['threshold']:.4g}  P "
                  f"{e['precision']:.3f} R {e['recall']:.3f} F1 {e['f1']:.3f} "
                  "(point-adjusted)")
    else:
        print(f"{args.dataset} {kind}: test MSE {m['mse']:.4f} MAE {m['mae']:.4f} "
              f"(last-value baseline MSE {m['naive_mse']:.4f})")
    task = {"classify": "classification"}.get(args.task, args.task)
    n_out = cfg.n_out
    paper = acc.paper_counts(acc.PaperConfig(
        name=args.dataset, task=task, m=cfg.n_features, w=cfg.window, d=cfg.d_model,
        keep=keep if keep > 0 else 1.0, n_out=n_out, heads=cfg.num_heads,
        layers=cfg.num_layers, d_ff=cfg.d_ff))
    honest = acc.model_counts(result.params, cfg)
    print(f"paper convention (Table 5): dense {paper['dense_bits']:,} bits, "
          f"{paper['dense_flops']:,} FLOPs; SBT {paper['sbt_bits']:,} bits, "
          f"{paper['sbt_flops']:,} FLOPs (x{paper['size_ratio']:.1f} size, "
          f"x{paper['flops_ratio']:.1f} FLOPs)")
    print(f"this model as executed: {honest['flops_per_token']:,.0f} multiply-adds per step; "
          f"stored {honest['packed_bits']:,} bits packed")
    report = {"task": args.task, "dataset": args.dataset, "settings": {
        "dense": args.dense, "prune": args.prune, "seed": args.seed, "d_model": args.d_model,
        "heads": args.heads, "layers": args.layers, "d_ff": args.d_ff,
        "window": cfg.window, "epochs": len(result.history)},
        "metrics": m, "history": result.history, "seconds": round(seconds, 1),
        "paper_counts": paper, "model_counts": honest}
    if args.plots:
        with status.phase(f"plotting to {args.plots}"), outputs.marked_directory(
                args.plots, kind="plots", overwrite=args.overwrite, who="sbt") as tmp:
            report["plots"] = plot(result, tmp)
        print(f"wrote plots to {args.plots}")
    if args.out:
        from lowrank_jax.io import save_model
        from lowrank_jax.leaves import pack_binary_tree

        with status.phase(f"saving to {args.out} (binary weights packed)"), \
                outputs.writing_checkpoint(args.out, overwrite=args.overwrite):
            save_model(args.out, cfg, pack_binary_tree(result.params), state=result.state,
                       metadata={"sbt": report["settings"]}, overwrite=args.overwrite)
        print(f"saved the model to {args.out}")
    if args.json:
        written = outputs.write_report(args.json, report, command="sbt", inputs={},
                                       outputs=(args.out, args.plots))
        print(f"wrote {written}")
    return 0


__all__ = ["add_parser", "plot", "run"]
