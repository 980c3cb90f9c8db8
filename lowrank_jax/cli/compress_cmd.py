"""``lowrank-jax compress MODEL``: a compression plan, or one truncated-SVD step, applied to a
checkpoint or Hugging Face directory (:func:`lowrank_jax.recipes.run_compress`)."""

from __future__ import annotations

import argparse
import math
import os
import re

from lowrank_jax.cli import common
from lowrank_jax.cli.analyze_cmd import FAMILY_HELP, MODEL_HELP
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``compress`` subcommand to ``subparsers``."""
    c = subparsers.add_parser("compress", help="compress a checkpoint or Hugging Face directory "
                                               "(truncated SVD, or a plan)")
    c.add_argument("params", metavar="MODEL", help=MODEL_HELP)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--plan", help="a JSON compression plan: {'steps': [{'method', 'rules', "
                   "'settings'}]} with at least one step, checked before the model is read "
                   "(see lowrank_jax.compress.Plan)")
    g.add_argument("--eps", type=float, help="truncated SVD of every selected matrix: "
                   "keep the singular values above EPS times the matrix's largest one (relative, "
                   "0 < EPS < 1), so that the spectral-norm error is at most EPS ||W||")
    g.add_argument("--rank", type=int, help="truncated SVD of every selected matrix to "
                   "this rank (number of singular values kept, >= 1)")
    g.add_argument("--ratio", type=float, help="keep this fraction of the selected "
                   "weights' parameters, in (0, 1] (compressed / original)")
    g.add_argument("--schedule", help="a rank per layer: power:D0:ALPHA (rank "
                   "ceil(D0 (1 + i)^ALPHA) for layer i) or interp:R1:RD:ALPHA (from rank R1 at the "
                   "first layer to RD at the last); needs --num-layers")
    c.add_argument(
        "--rule",
        action="append",
        help="path regex selecting weights (first match wins; '!regex' skips); "
        "default: attention q/k/v/o",
    )
    c.add_argument("--per-head", action="store_true",
                   help="per-head sketching of q/k/v (head widths come from the parameters)")
    c.add_argument("--seed", type=int, default=0, help="PRNG seed of methods that draw random "
                   "numbers (an integer; default 0)")
    c.add_argument("--num-layers", type=int, help="number of layers the --schedule spans")
    c.add_argument(
        "--allocation",
        choices=["eps", "energy"],
        default="eps",
        help="with --ratio: one global eps, or ranks by singular-value energy",
    )
    c.add_argument("--rank-multiple", type=int, metavar="K",
                   help="round every chosen rank up to a multiple of K (never a larger error; "
                   "matrix kernels tile by 8-16 on GPUs, 128 on TPUs; on a 2-core AVX-512 CPU "
                   "ranks 26-30 ran 1.06-1.22x faster at 32)")
    c.add_argument("--family", help=FAMILY_HELP)
    c.add_argument("--out", help="save the compressed tree to this directory (a lowrank_jax "
                                 "checkpoint; never the input or inside it)")
    c.add_argument("--plots", help="with a plan of truncatt/cp/btd steps: write the layer x head "
                   "heat map of the query-key ranks (head_ranks.png) to this directory")
    c.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a lowrank_jax checkpoint, --plots if lowrank-jax "
                   "wrote it (nothing else)")
    c.add_argument("--json", help="write the report as JSON to this file (replaces only a "
                                  "previous lowrank-jax report)")
    c.add_argument(
        "--no-eval",
        action="store_true",
        help="skip running the model (error, overlap, time ratio) for model checkpoints",
    )
    c.add_argument("--time-runs", type=int, default=20, help="timed forward calls per model for the "
                   "time ratio (default 20)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.set_defaults(func=run)
    return c


def check(args) -> None:
    """Flag errors before anything is read."""
    from lowrank_jax.recipes import outputs
    from lowrank_jax.recipes.compress import parse_schedule

    given = [f for f, v in (("--eps", args.eps), ("--rank", args.rank), ("--ratio", args.ratio),
                            ("--schedule", args.schedule)) if v is not None]
    if args.plan and given:
        raise ConfigError(f"--plan replaces --eps/--rank/--ratio/--schedule; give one or the "
                          f"other (got --plan and {', '.join(given)})", where="--plan",
                          expected="--plan alone", actual=given)
    if not args.plan and not given:
        raise ConfigError("give --plan FILE, or one of --eps/--rank/--ratio/--schedule",
                          where="--eps/--rank/--ratio/--schedule/--plan",
                          expected="one of them", actual=None)
    if args.plan and args.rank_multiple is not None:
        raise ConfigError("--rank-multiple sets the svd step of --eps/--rank/--ratio/--schedule; "
                          "with --plan put \"rank_multiple\" in the plan's svd step settings",
                          where="--rank-multiple", expected="no --plan", actual=args.rank_multiple)
    if args.plan and os.path.isdir(args.plan):
        raise ConfigError(f"--plan {args.plan} is a directory; expected a JSON plan file",
                          where="--plan", expected="a file", actual="a directory")
    if args.schedule:
        parse_schedule(args.schedule)
    _check_svd_values(args)
    if args.rule:
        for r in args.rule:
            try:
                re.compile(r[1:] if r.startswith("!") else r)
            except re.error as e:
                raise ConfigError(f"--rule {r!r} is not a valid regular expression: {e}",
                                  where="--rule", expected="a regular expression",
                                  actual=r) from None
    if args.time_runs < 1:
        raise ConfigError(f"--time-runs must be >= 1, got {args.time_runs}", where="--time-runs",
                          expected=">= 1", actual=args.time_runs)
    if args.plots:
        if not args.plan:
            raise ConfigError("--plots draws the query-key ranks per head of a plan's truncatt, "
                              "cp or btd steps; give --plan", where="--plots",
                              expected="--plan with such a step", actual=None)
        outputs.check_plots_out(args.plots, {**common.inputs(args), "--out": args.out},
                                overwrite=args.overwrite)
        if args.json:
            outputs.check_report_path(args.json, common.inputs(args), (args.out, args.plots))


def _check_svd_values(args) -> None:
    """--eps / --rank / --ratio / --rank-multiple / --num-layers in range (before the model is
    read)."""

    def bad(flag, value, expected):
        raise ConfigError(f"{flag} must be {expected}, got {value}", where=flag,
                          expected=expected, actual=value)

    if args.eps is not None and not (math.isfinite(args.eps) and 0 < args.eps < 1):
        bad("--eps", args.eps, "a number in (0, 1)")
    if args.rank is not None and args.rank < 1:
        bad("--rank", args.rank, "an int >= 1")
    if args.ratio is not None and not (math.isfinite(args.ratio) and 0 < args.ratio <= 1):
        bad("--ratio", args.ratio, "a number in (0, 1]")
    if args.rank_multiple is not None and args.rank_multiple < 1:
        bad("--rank-multiple", args.rank_multiple, "an int >= 1")
    if args.num_layers is not None and args.num_layers < 1:
        bad("--num-layers", args.num_layers, "an int >= 1")


def run(args) -> int:
    """Run ``lowrank-jax compress``. Returns the exit status."""
    from lowrank_jax.recipes.compress import run_compress

    check(args)
    status = Status("compress", bars=not args.no_progress)
    outcome = run_compress(
        args.params, plan=args.plan, eps=args.eps, rank=args.rank, ratio=args.ratio,
        schedule=args.schedule, rules=args.rule, per_head=args.per_head,
        allocation=args.allocation, rank_multiple=args.rank_multiple,
        num_layers=args.num_layers, seed=args.seed, family=args.family, out=args.out,
        plots=args.plots, overwrite=args.overwrite, evaluate=not args.no_eval,
        time_runs=args.time_runs, status=status)
    return common.finish(outcome, args.json, command="compress", inputs=common.inputs(args),
                         outputs_=(args.out, args.plots))


__all__ = ["add_parser", "check", "run"]
