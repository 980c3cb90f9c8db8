"""``lowrank-jax sbt {classify,anomaly,forecast} --dataset NAME --prune 0.5 --json out.json
--plots DIR``: train and evaluate a sparse binary transformer ("Sparse Binary Transformers for
Multivariate Time Series Modeling", Gorbett et al., KDD 2023, arXiv:2308.04637), or with
``--dense`` its dense twin, on a dataset shipped with aeon (:func:`lowrank_jax.recipes.run_sbt`).

It prints the metrics, the paper-convention (Table 5) FLOP and bit counts of this configuration
and the library's honest counts (one status line per epoch); ``--out`` saves the trained model
with its binary weights packed into bits, ``--plots`` draws the training curves (and for
anomalies the scores with both thresholds). Outputs follow :mod:`lowrank_jax.recipes.outputs`.
"""

from __future__ import annotations

import argparse

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError
from lowrank_jax.recipes.sbt import TASKS


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``sbt`` subcommand to ``subparsers``."""
    p = subparsers.add_parser(
        "sbt", help="train and evaluate a sparse binary transformer (SBT) on a time-series "
                    "task: classification, anomaly detection or single-step forecasting")
    p.add_argument("task", choices=TASKS, help="the task: classify (accuracy), anomaly (F1 of "
                   "detected anomalies) or forecast (single-step MSE / MAE)")
    p.add_argument("--dataset", help="classify: JapaneseVowels | BasicMotions; anomaly: kdd135 "
                                     "| ecg; forecast: daphnet (default: the first)")
    p.add_argument("--prune", type=float, help="pruning rate p of the binary weights (keep = "
                                               "1 - p; default 0.5, anomaly 0.75)")
    p.add_argument("--dense", action="store_true", help="the dense transformer instead")
    p.add_argument("--epochs", type=int, help="training epochs (default: classify SBT 250, "
                                              "dense 50; anomaly 50; forecast 30)")
    p.add_argument("--batch-size", type=int, help="samples per training batch (default: "
                   "classify 8, else 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--d-model", type=int, default=32, help="model width d (default 32)")
    p.add_argument("--heads", type=int, default=2, help="attention heads per layer (default 2)")
    p.add_argument("--layers", type=int, default=2, help="encoder layers (default 2)")
    p.add_argument("--d-ff", type=int, default=256, help="MLP hidden width (default 256)")
    p.add_argument("--window", type=int, default=50,
                   help="anomaly / forecast: time steps per window w (default 50)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initialization and the batches (default 0)")
    p.add_argument("--json", help="write the report as JSON to this file")
    p.add_argument("--plots", help="write plots into this directory")
    p.add_argument("--out", help="save the trained model (binary weights packed) here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace previous outputs of this tool")
    p.add_argument("--no-progress", action="store_true", help="no live status lines")
    p.set_defaults(func=run)
    return p


def _check(args) -> None:
    from lowrank_jax.recipes import outputs

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
    # the data come from the installed aeon package: no input path to keep apart
    outputs.check_outputs({}, out=args.out, plots=args.plots, json_path=args.json,
                          overwrite=args.overwrite)


def run(args) -> int:
    """Run ``lowrank-jax sbt`` (module docstring). Returns the exit status."""
    from lowrank_jax.recipes.sbt import run_sbt

    _check(args)
    outcome = run_sbt(args.task, dataset=args.dataset, prune=args.prune, dense=args.dense,
                      epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      d_model=args.d_model, heads=args.heads, layers=args.layers,
                      d_ff=args.d_ff, window=args.window, seed=args.seed, out=args.out,
                      plots=args.plots, overwrite=args.overwrite,
                      status=Status("sbt", bars=not args.no_progress))
    return common.finish(outcome, args.json, command="sbt", inputs={},
                         outputs_=(args.out, args.plots))


__all__ = ["add_parser", "run"]
