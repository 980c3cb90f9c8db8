"""The ``lowrank-jax`` command: ``analyze``, ``compress``, ``convert``, ``export``, ``train``,
``demo``, and the method commands ``prune`` (:mod:`~lowrank_jax.cli.prune_cmd`),
``partition`` (:mod:`~lowrank_jax.cli.partition_cmd`) and ``sbt``
(:mod:`~lowrank_jax.cli.sbt_cmd`).

User errors (bad arguments, missing, unreadable or malformed files, outputs that may not be
written) print one line (a list of keys may follow) naming the file, key or option, what was
expected and what was found, and exit with status 2; set ``LOWRANK_JAX_DEBUG=1`` to get the
traceback instead. Outputs are never an input, and only the tool's own outputs are replaced
(see :mod:`lowrank_jax.recipes.outputs`). Long phases announce themselves on stderr
(:mod:`lowrank_jax.cli.status`).
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

#: The subcommands in the order ``--help`` lists them; each module adds its parser (with its
#: ``run`` as ``func``): parse, call one workflow of :mod:`lowrank_jax.recipes`, print.
COMMANDS = (analyze_cmd, compress_cmd, convert_cmd, export_cmd, demo_cmd, train_cmd, prune_cmd,
            frontier_cmd, partition_cmd, sbt_cmd, generate_cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowrank-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
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
