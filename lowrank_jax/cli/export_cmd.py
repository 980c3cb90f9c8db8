"""``lowrank-jax export MODEL --out DIR``: a lowrank_jax model checkpoint to a Hugging Face
directory that the PyTorch class loads (:func:`lowrank_jax.recipes.run_export`)."""

from __future__ import annotations

import argparse

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers``."""
    e = subparsers.add_parser(
        "export", help="lowrank_jax model checkpoint -> Hugging Face directory that the PyTorch "
                       "class loads (compressed leaves densified, narrower layers zero-padded)")
    e.add_argument("model", metavar="MODEL", help="a lowrank_jax model checkpoint (or a Hugging "
                                                  "Face directory, written again)")
    e.add_argument("--out", required=True, help="output directory (config.json, "
                                                "model.safetensors and a lowrank-jax marker file)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a previous export (nothing else)")
    e.add_argument("--json", help="write the export summary as JSON to this file")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    e.set_defaults(func=run)
    return e


def run(args) -> int:
    """Run ``lowrank-jax export``. Returns the exit status."""
    from lowrank_jax.recipes.convert import run_export

    status = Status("export", bars=not args.no_progress)
    outcome = run_export(args.model, args.out, overwrite=args.overwrite, status=status)
    return common.finish(outcome, args.json, command="export", inputs=common.inputs(args),
                         outputs_=(args.out,))


__all__ = ["add_parser", "run"]
