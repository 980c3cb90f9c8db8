"""What a workflow returns: :class:`Outcome`."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class Outcome(dict):
    """The result of a workflow.

    The mapping itself is the workflow's JSON-able report (what a command's ``--json``
    writes); beside it:

    Attributes:
      lines: the summary for a reader, one entry per printed line or block (what the command
        prints on stdout; :attr:`text` joins them).
      values: Python results kept out of the report (the new parameter tree and its config,
        a result object), by name; empty when there are none.

    Equality is the report's: two outcomes with the same report are equal, and an outcome
    equals the plain dict of its report.
    """

    def __init__(self, report: Mapping | None = None, *, lines: Iterable[str] = (),
                 values: Mapping[str, Any] | None = None):
        super().__init__(report or {})
        self.lines = list(lines)
        self.values = dict(values or {})

    @property
    def text(self) -> str:
        """The summary as one string."""
        return "\n".join(self.lines)


__all__ = ["Outcome"]
