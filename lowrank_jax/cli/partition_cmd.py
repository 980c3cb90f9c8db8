"""``lowrank-jax partition MODEL --machines 8 --eps 0.1 --json report.json --plots DIR``: split
a model's MLPs and attention projections over ``--machines`` machines with the method of
"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar;
:func:`lowrank_jax.recipes.run_partition`).

It prints, per weight, the rank (numbers each machine broadcasts per token), the bytes per
token, storage and FLOPs per machine, the relative error and the assignment; for a model
checkpoint also the model's output error. ``--plots`` draws the paper's Fig. 5 and the error
against the rank next to the SVD-method baseline; ``--out`` saves the partitioned model.
"""

from __future__ import annotations

import argparse
import math

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError


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


def _check(args) -> None:
    from lowrank_jax.recipes import outputs

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
    inputs = {"MODEL": args.params}
    outputs.check_outputs(inputs, out=args.out, plots=args.plots, json_path=args.json,
                          overwrite=args.overwrite)


def run(args) -> int:
    """Run ``lowrank-jax partition`` (module docstring). Returns the exit status."""
    from lowrank_jax.recipes.partition import run_partition

    _check(args)
    outcome = run_partition(
        args.params, machines=args.machines, eps=args.eps, rank=args.rank,
        relative=args.relative, assignment=args.assignment, rules=args.rule,
        samples=args.samples, evaluate=not args.no_eval, family=args.family, out=args.out,
        plots=args.plots, overwrite=args.overwrite,
        status=Status("partition", bars=not args.no_progress))
    return common.finish(outcome, args.json, command="partition", inputs={"MODEL": args.params},
                         outputs_=(args.out, args.plots))


__all__ = ["add_parser", "run"]
