"""``lowrank-jax convert SRC --out DIR``: a Hugging Face checkpoint directory to a lowrank_jax
model checkpoint (:func:`lowrank_jax.recipes.run_convert`)."""

from __future__ import annotations

import argparse

from lowrank_jax.cli import common
from lowrank_jax.cli.status import Status


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``convert`` subcommand to ``subparsers``."""
    v = subparsers.add_parser(
        "convert", help="Hugging Face checkpoint directory -> lowrank_jax checkpoint"
    )
    v.add_argument(
        "src", help="directory with config.json and model.safetensors / pytorch_model.bin"
    )
    v.add_argument("--out", required=True, help="output directory (a lowrank_jax model "
                                                "checkpoint; never the input or inside it)")
    v.add_argument("--family", help="force the model family instead of detecting it")
    v.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a lowrank_jax checkpoint (nothing else)")
    v.add_argument("--no-progress", action="store_true", help="no progress bars")
    v.set_defaults(func=run)
    return v


def run(args) -> int:
    """Run ``lowrank-jax convert``. Returns the exit status."""
    from lowrank_jax.recipes.convert import run_convert

    status = Status("convert", bars=not args.no_progress)
    outcome = run_convert(args.src, args.out, family=args.family, overwrite=args.overwrite,
                          status=status)
    return common.finish(outcome, None, command="convert")


__all__ = ["add_parser", "run"]
