"""What every ``lowrank-jax`` command does the same way: name its inputs, print a workflow's
summary, write its JSON report."""

from __future__ import annotations

from typing import Iterable, Mapping

from lowrank_jax.recipes import outputs
from lowrank_jax.recipes.outcome import Outcome

#: Arguments that name what a command reads (attribute -> name in messages): outputs may not
#: overlap them (``main``'s checks before any work).
INPUT_OPTIONS = {"params": "MODEL", "src": "SRC", "model": "MODEL", "plan": "--plan",
                 "config": "CONFIG"}


def inputs(args) -> dict:
    """``{name in messages: path}`` of what the command of ``args`` reads."""
    return {name: getattr(args, attr) for attr, name in INPUT_OPTIONS.items()
            if isinstance(getattr(args, attr, None), str)}


def finish(outcome: Outcome, json_path: str | None, *, command: str,
           inputs: Mapping[str, str] | None = None,
           outputs_: Iterable[str | None] = ()) -> int:
    """Print a workflow's summary on stdout, then write its report to ``json_path`` (when
    given) and say so. Returns the exit status (0).

    The report is written to a temporary file and renamed, only over a previous report or an
    empty file (:func:`lowrank_jax.recipes.outputs.write_report`); NaN and infinities become
    ``null``.
    """
    for line in outcome.lines:
        print(line)
    if json_path:
        written = outputs.write_report(json_path, outcome, command=command, inputs=inputs,
                                       outputs=outputs_)
        print(f"wrote {written}")
    return 0


__all__ = ["INPUT_OPTIONS", "finish", "inputs"]
