"""``lowrank-jax train CONFIG.json --out RUN``: (compressed) pretraining of a forecasting model
from a JSON config (:mod:`lowrank_jax.recipes.train_config`), resumed from the run directory
(:func:`lowrank_jax.recipes.run_train`)."""

from __future__ import annotations

import argparse

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to ``subparsers``."""
    t = subparsers.add_parser("train", help="pretrain a (compressed-by-design) Chronos-Bolt from "
                                            "a JSON config; resumes from --out/checkpoints")
    t.add_argument("config", help="JSON config file (see lowrank_jax.recipes.train_config)")
    t.add_argument("--out", required=True, help="run directory (run.json, checkpoints, "
                   "metrics.jsonl, model, summary.json); a rerun resumes it")
    t.add_argument("--resume-changed-config", action="store_true",
                   help="continue a run whose stored config differs from CONFIG (refused "
                   "otherwise); the change is recorded in run.json")
    t.add_argument("--distributed", action="store_true",
                   help="multi-process data parallel: call jax.distributed.initialize() first; "
                   "run the same command in every process")
    t.add_argument("--coordinator", help="with --distributed: HOST:PORT of process 0 (default: "
                   "detected from the cluster)")
    t.add_argument("--num-processes", type=int, help="with --distributed: number of processes")
    t.add_argument("--process-id", type=int, help="with --distributed: this process's index")
    t.add_argument("--no-progress", action="store_true", help="no progress bar or status lines")
    t.set_defaults(func=run)
    return t


def run(args) -> int:
    """Run ``lowrank-jax train``. Returns the exit status."""
    from lowrank_jax.recipes.train import run_train

    # Multi-process: the coordinator, process count and id given here, or for those left out,
    # the cluster's auto-detection (SLURM, TPU pods, ...).
    outcome = run_train(args.config, args.out, progress=not args.no_progress,
                        resume_changed_config=args.resume_changed_config,
                        distributed=args.distributed, coordinator=args.coordinator,
                        num_processes=args.num_processes, process_id=args.process_id,
                        status=Status("train"))
    return common.finish(outcome, None, command="train")


__all__ = ["add_parser", "run"]
