"""The ``lowrank-jax`` command: one subcommand per workflow of :mod:`lowrank_jax.recipes`.

Each subcommand is a thin module (``cli/<name>_cmd.py``) that parses its options, calls one
workflow and prints; :data:`DESCRIPTION` is what ``lowrank-jax --help`` prints, in plain
sentences.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from lowrank_jax import runtime
from lowrank_jax.cli import (
    analyze_cmd,
    common,
    compress_cmd,
    convert_cmd,
    demo_cmd,
    export_cmd,
    frontier_cmd,
    generate_cmd,
    partition_cmd,
    prune_cmd,
    sbt_cmd,
    train_cmd,
)
from lowrank_jax.errors import LowrankJaxError

#: ``lowrank-jax --help``: what the tool does, every subcommand, how errors and outputs behave.
DESCRIPTION = """\
Compress transformers with lowrank_jax. Commands: analyze (eps-ranks of every weight),
compress (truncated SVD or a compression plan), convert (a Hugging Face checkpoint to a
lowrank_jax checkpoint), export (back to a directory the PyTorch class loads), demo (the
offline demonstration), train (pretrain a compressed-by-design Chronos-Bolt from a JSON
config), prune (structured pruning, then fine-tuning), frontier (which compression should I
use: every applicable method measured, with Pareto frontiers), partition (split a model over
machines with low intercommunication), sbt (sparse binary transformers on time-series
tasks), and generate (continue text prompts with a GPT-2 or Llama-style model). Run
lowrank-jax COMMAND --help for a command's options.

User errors (bad arguments; missing, unreadable or malformed files; outputs that may not be
written) print one line naming the file, key or option, what was expected and what was found,
and exit with status 2; set LOWRANK_JAX_DEBUG=1 to see the traceback instead. Outputs are never
an input, and only the tool's own earlier outputs are replaced. Long phases announce themselves
on stderr."""

#: The subcommands in the order ``--help`` lists them; each module adds its parser (with its
#: ``run`` as ``func``): parse, call one workflow of :mod:`lowrank_jax.recipes`, print.
COMMANDS = (analyze_cmd, compress_cmd, convert_cmd, export_cmd, demo_cmd, train_cmd, prune_cmd,
            frontier_cmd, partition_cmd, sbt_cmd, generate_cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowrank-jax", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        parser = command.add_parser(sub)
        if parser.description is None:  # the one-line help, as a sentence, heads COMMAND --help
            text = sub._choices_actions[-1].help or ""  # noqa: SLF001 - argparse keeps it there
            parser.description = text[:1].upper() + text[1:] + ("." if text else "")
    return p


def _preflight(args) -> None:
    """Check every output before any work: not an input, not inside one, replaceable only if
    the tool wrote it (:mod:`lowrank_jax.recipes.outputs`)."""
    from lowrank_jax.io import is_checkpoint
    from lowrank_jax.recipes import outputs

    owners = {"compress": (is_checkpoint, "a lowrank_jax checkpoint"),
              "convert": (is_checkpoint, "a lowrank_jax checkpoint"),
              "export": (outputs.owned_by("export"), "a previous lowrank-jax export")}
    out = getattr(args, "out", None) if args.command in owners else None
    inputs = common.inputs(args)
    if out:
        outputs.check_separate(out, inputs)
        owned, what = owners[args.command]
        outputs.check_output_dir(out, overwrite=args.overwrite, owned=owned, what=what)
    if getattr(args, "json", None):
        outputs.check_report_path(args.json, inputs, (out,))


#: Failures a user can cause (bad input, unreadable or unwritable files); anything else is a
#: bug and keeps its traceback.
_EXPECTED = (LowrankJaxError, ValueError, TypeError, OSError, re.error)

_OS_HINTS = (
    (IsADirectoryError, "expected a file, found a directory"),
    (NotADirectoryError, "expected a directory, found a file in the path"),
    (PermissionError, "no permission: check the owner and mode of the path"),
    (FileNotFoundError, "expected an existing path, found nothing"),
    (FileExistsError, "expected nothing at the path, found something"),
)


def _message(e: BaseException) -> str:
    """The user-facing text of an expected failure."""
    if isinstance(e, LowrankJaxError) or not isinstance(e, OSError) or e.strerror is None:
        return str(e)  # a message written for the user (or not an OS error at all)
    names = " -> ".join(str(n) for n in (e.filename, e.filename2) if n is not None)
    hint = next((h for cls, h in _OS_HINTS if isinstance(e, cls)), None)
    text = f"{e.strerror or type(e).__name__}" + (f": {names}" if names else "")
    return text + (f" ({hint})" if hint else "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:
        # the command owns its process: freed memory is kept for reuse (no page faults on every
        # large XLA buffer; lowrank_jax.runtime). main([...]) from Python leaves malloc alone.
        runtime.apply_env(default=True)
    try:
        _preflight(args)
        with runtime.one_blas_thread():  # host LAPACK: faster on one thread (lowrank_jax.runtime)
            return args.func(args)
    except _EXPECTED as e:
        if os.environ.get("LOWRANK_JAX_DEBUG"):
            raise
        print(f"lowrank-jax {args.command}: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get("LOWRANK_JAX_DEBUG"):
            raise
        print(f"lowrank-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
