"""``lowrank-jax demo``: the App. J experiments, rank analysis of a built-in model, and
pretraining compressed Chronos-Bolt models against compressing a dense one
(:func:`lowrank_jax.recipes.run_demo`)."""

from __future__ import annotations

import argparse
import contextlib
import os

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``subparsers``."""
    d = subparsers.add_parser(
        "demo", help="App. J experiments, rank analysis of a built-in model, and pretraining "
                     "compressed Chronos-Bolt models against compressing a dense one")
    d.add_argument("--quick", action="store_true",
                   help="smaller sizes, a 2+1 layer model, 40 training steps (about a minute)")
    d.add_argument("--steps", type=int,
                   help="training steps per pretrained model, >= 1 (default 600; --quick: 40)")
    d.add_argument("--seed", type=int, default=0,
                   help="seed of the pretraining part, >= 0 (initialization, batches, factors)")
    d.add_argument("--json", help="write the results as JSON to this path (replaces only a "
                                  "previous lowrank-jax report)")
    d.add_argument("--plots", help="directory for PNG plots (a new or empty directory; written "
                                   "whole when the demo ends)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace --plots if lowrank-jax wrote it (nothing else)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars or status lines")
    d.set_defaults(func=run)
    return d


@contextlib.contextmanager
def _quick_compile(quick: bool):
    """``--quick`` runs compile more than they compute: XLA's backend at optimization level 0.

    The quick demo spends most of its time compiling tiny models; LLVM's optimization passes
    cost more there than they save (on 2 CPU cores: about 30% less CPU time for
    ``demo --quick``, but 15% more for the full demo, which trains longer). Applied only when
    ``XLA_FLAGS`` chooses no level, and only if JAX has not started its backend yet (it reads
    the flags once); the variable is restored afterwards.
    """
    flags = os.environ.get("XLA_FLAGS")
    if not quick or "xla_backend_optimization_level" in (flags or ""):
        yield
        return
    os.environ["XLA_FLAGS"] = ((flags or "") + " --xla_backend_optimization_level=0").strip()
    try:
        yield
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


def run(args) -> int:
    """Run ``lowrank-jax demo``. Returns the exit status."""
    from lowrank_jax.recipes import demo, outputs
    from lowrank_jax.recipes.pretrain_demo import check_seed, check_steps

    # before minutes of work: 0 steps is an error, not "default"; outputs as every command's
    check_steps(args.steps, "--steps")
    check_seed(args.seed, "--seed")
    if args.plots:
        outputs.check_plots_out(args.plots, {}, overwrite=args.overwrite)
    if args.json:
        outputs.check_report_path(args.json, {}, (args.plots,))
    with _quick_compile(args.quick):
        outcome = demo.run_demo(quick=args.quick, plots_dir=args.plots,
                                progress=not args.no_progress, steps=args.steps,
                                seed=args.seed, overwrite=args.overwrite,
                                status=Status("demo", bars=not args.no_progress))
    # strict JSON: NaN or inf are written as null
    return common.finish(outcome, args.json, command="demo", outputs_=(args.plots,))


__all__ = ["add_parser", "run"]
