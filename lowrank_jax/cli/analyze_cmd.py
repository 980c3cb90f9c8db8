"""``lowrank-jax analyze MODEL``: eps-ranks of every weight of a checkpoint or Hugging Face
directory (:func:`lowrank_jax.recipes.run_analyze`)."""

from __future__ import annotations

import argparse
import math

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status
from lowrank_jax.errors import ConfigError

MODEL_HELP = ("a lowrank_jax checkpoint (written by save_params, save_model, or the convert or "
              "compress command) or a Hugging Face directory (config.json + model.safetensors / "
              "pytorch_model.bin), converted in memory")
FAMILY_HELP = "force the model family of a Hugging Face directory instead of detecting it"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``analyze`` subcommand to ``subparsers``."""
    a = subparsers.add_parser("analyze", help="eps-ranks of every weight of a checkpoint or "
                                              "Hugging Face directory")
    a.add_argument("params", metavar="MODEL", help=MODEL_HELP)
    a.add_argument("--eps", type=float, nargs="+", default=[0.01, 0.05, 0.1],
                   help="tolerances of the eps-rank: the number of singular values above EPS "
                   "times the largest one (relative, each in (0, 1); default 0.01 0.05 0.1)")
    a.add_argument("--pattern", help="only weights whose path matches this regular expression")
    a.add_argument("--family", help=FAMILY_HELP)
    a.add_argument("--json", help="write the report as JSON to this file (replaces only a "
                                  "previous lowrank-jax report)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars")
    a.add_argument(
        "--sweep",
        action="store_true",
        help="compression ratio -> output error curve over --sweep-eps, "
        "compiled once; model checkpoints only get the output error",
    )
    a.add_argument("--sweep-eps", type=float, nargs="+",
                   default=[0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01],
                   help="with --sweep: the truncation tolerances of the curve, each relative to "
                   "a matrix's largest singular value, in (0, 1) (default 0.5 down to 0.01)")
    a.add_argument(
        "--sweep-heads",
        action="store_true",
        help="per-head rank sweep of every attention block (synthetic N(0, 1) inputs; head "
        "counts and widths come from the parameters)",
    )
    a.add_argument("--sweep-ranks", type=int, nargs="+",
                   help="with --sweep-heads: the ranks per head to try, each from 1 to the head "
                   "width (default: powers of 2 up to the head width)")
    a.set_defaults(func=run)
    return a


def check_eps_list(flag: str, values) -> None:
    """Every eps threshold in (0, 1), before the model is read."""
    bad = [v for v in values or () if not (math.isfinite(v) and 0 < v < 1)]
    if bad:
        raise ConfigError(f"{flag} values must be numbers in (0, 1), got {bad[0]}", where=flag,
                          expected="(0, 1)", actual=bad[0])


def run(args) -> int:
    """Run ``lowrank-jax analyze``. Returns the exit status."""
    from lowrank_jax.recipes.analyze import run_analyze

    check_eps_list("--eps", args.eps)
    if args.sweep:
        check_eps_list("--sweep-eps", args.sweep_eps)
    status = Status("analyze", bars=not args.no_progress)
    outcome = run_analyze(args.params, eps=args.eps, pattern=args.pattern, family=args.family,
                          sweep_eps=args.sweep_eps if args.sweep else None,
                          sweep_heads=args.sweep_heads, sweep_ranks=args.sweep_ranks,
                          status=status)
    return common.finish(outcome, args.json, command="analyze", inputs=common.inputs(args))


__all__ = ["FAMILY_HELP", "MODEL_HELP", "add_parser", "check_eps_list", "run"]
