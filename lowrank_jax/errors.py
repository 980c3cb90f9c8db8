"""One error hierarchy for lowrank_jax.

Every error the library raises on purpose is a :class:`LowrankJaxError`. Each kind also derives
from the built-in exception a caller would expect (``ValueError``, ``TypeError``,
``FileNotFoundError``), so ``except ValueError`` keeps working, while
``except lowrank_jax.errors.LowrankJaxError`` catches everything the library reports.

The message names *where* (a parameter path, a file, a config key), *what was expected* and
*what was found*; the same three are kept as attributes (``where``, ``expected``, ``actual``)
for programs that want to react to them.

This module sits at the bottom of the package: it imports nothing from lowrank_jax.
"""

from __future__ import annotations

from typing import Any


class LowrankJaxError(Exception):
    """Base class of every error lowrank_jax raises on purpose.

    Args:
      message: the full message. When ``where``, ``expected`` or ``actual`` are given and the
        message does not already contain them, they are appended as
        ``"(at W: expected E, got A)"``.
      where: a parameter path (``'encoder/layers/3/attn/v'``), a file or a config key.
      expected: what was expected (a shape, a type, a range).
      actual: what was found.
    """

    def __init__(self, message: str, *, where: str | None = None, expected: Any = None,
                 actual: Any = None):
        self.where = where
        self.expected = expected
        self.actual = actual
        super().__init__(message)


class ConfigError(LowrankJaxError, ValueError):
    """A configuration value (a config dataclass field, a JSON config key, a CLI flag) is
    invalid."""


class ShapeError(LowrankJaxError, ValueError):
    """Arrays or leaves do not have the shapes a computation needs."""


class PlanError(LowrankJaxError, ValueError):
    """A compression plan is malformed or cannot be applied (bad rule, unknown method, a
    setting out of range)."""


class NotApplicableError(PlanError):
    """A method does not apply to a model (no node its rules select, no config to score with,
    ...): raised by a method's frontier candidates, which are then left out with the message as
    the reason."""


class CheckpointError(LowrankJaxError, ValueError):
    """A checkpoint (lowrank_jax or Hugging Face) is missing, corrupt, or does not match the
    model it is loaded into.

    For key-level mismatches every offending key is listed at once: missing keys with their
    expected shape, unexpected keys with their actual shape, and mis-shaped keys with both.

    Attributes:
      source: where the weights came from (a file path, ``'<state dict>'``, ...).
      missing: ``{key: expected_shape}``.
      unexpected: ``{key: actual_shape}``.
      mismatched: ``{key: (expected_shape, actual_shape)}``.
    """

    def __init__(self, source: str, *, missing: dict | None = None,
                 unexpected: dict | None = None, mismatched: dict | None = None,
                 note: str | None = None, message: str | None = None, expected=None,
                 actual=None):
        self.source = source
        self.missing = dict(missing or {})
        self.unexpected = dict(unexpected or {})
        self.mismatched = dict(mismatched or {})
        if message is not None:
            lines = [message]
        else:
            lines = [f"checkpoint {source} does not match its config:"]
        for k, s in sorted(self.missing.items()):
            lines.append(f"  missing key {k!r}: expected shape {_shape(s)}")
        for k, s in sorted(self.unexpected.items()):
            lines.append(f"  unexpected key {k!r}: actual shape {_shape(s)}")
        for k, (e, a) in sorted(self.mismatched.items()):
            lines.append(f"  wrong shape for {k!r}: expected {_shape(e)}, got {_shape(a)}")
        if note:
            lines.append(note)
        super().__init__("\n".join(lines), where=source, expected=expected, actual=actual)


class CorruptCheckpointError(CheckpointError):
    """Files of a checkpoint are missing, truncated or altered, so arrays cannot be read or do
    not match their checksums.

    Args:
      message: the full message (one line naming the checkpoint, the arrays and what is
        wrong).
      where: the checkpoint (or step) directory.
      expected, actual: the two values that differ, where there is one such pair.
      arrays: ``{array path: what is wrong}`` for every damaged array found (empty when the
        damage is not tied to arrays, such as an unreadable metadata file).
    """

    def __init__(self, message: str, *, where: str, expected: Any = None, actual: Any = None,
                 arrays: dict | None = None):
        super().__init__(where, message=message, expected=expected, actual=actual)
        self.arrays = dict(arrays or {})


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint is intact but does not match ``like`` (paths, shapes, dtypes, structure).

    Args:
      message: the full message (it names the step directory).
      where: the step directory.
      expected, actual: what ``like`` has and what the checkpoint holds, where one value
        differs.
    """

    def __init__(self, message: str, *, where: str, expected: Any = None, actual: Any = None):
        super().__init__(where, message=message, expected=expected, actual=actual)


class NonFiniteError(LowrankJaxError, ValueError):
    """Training produced a NaN or infinite loss, gradient or state; nothing non-finite was saved.

    ``where`` is ``'step N'``, ``actual`` the offending value or parameter path.
    """


class DataError(LowrankJaxError, ValueError):
    """Input data (series, token ids, images, CSV files) is unusable as given."""


class LeafTypeError(LowrankJaxError, TypeError):
    """A value's type is not supported: by an operation (for example truncating a binary leaf)
    or for saving."""


class NotSupportedError(LeafTypeError):
    """A leaf type does not implement an optional capability an operation needs (structured
    pruning's channel surgery, a bias, ...). The message names the leaf type, the capability
    and the operation, and says which method to implement."""


class PathError(LowrankJaxError, KeyError):
    """A parameter path (``'encoder/layers/3/attn/v'``) or a report row names nothing in the
    tree or report it is looked up in."""

    def __str__(self) -> str:  # the message, not KeyError's quoted repr of it
        return str(self.args[0]) if self.args else ""


class MissingDependencyError(LowrankJaxError, ImportError):
    """An optional dependency a feature needs is not installed (the message says which extra
    to install)."""


class MissingFileError(LowrankJaxError, FileNotFoundError):
    """A file or directory the library needs does not exist."""


class OutputExistsError(LowrankJaxError, FileExistsError):
    """An output path exists and may not be replaced."""


def _shape(s) -> str:
    if s is None:
        return "?"
    return "[" + ", ".join(str(int(d)) for d in s) + "]"


__all__ = [
    "CheckpointError", "ConfigError", "CorruptCheckpointError", "DataError",
    "IncompatibleCheckpointError", "LeafTypeError", "LowrankJaxError", "MissingDependencyError",
    "MissingFileError", "NonFiniteError", "NotApplicableError", "NotSupportedError",
    "OutputExistsError", "PathError", "PlanError", "ShapeError",
]
