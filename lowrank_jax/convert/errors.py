"""Errors raised by the checkpoint converters."""

from __future__ import annotations


def _shape(s) -> str:
    return "[" + ", ".join(str(int(d)) for d in s) + "]" if s is not None else "?"


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config describes.

    Lists every offending key at once: missing keys with their expected shape, unexpected keys
    with their actual shape, and mis-shaped keys with expected and actual shape.

    Attributes:
      source: where the weights came from (a file path, ``'<state dict>'``, ...).
      missing: ``{key: expected_shape}``.
      unexpected: ``{key: actual_shape}``.
      mismatched: ``{key: (expected_shape, actual_shape)}``.
    """

    def __init__(self, source: str, *, missing: dict | None = None,
                 unexpected: dict | None = None, mismatched: dict | None = None,
                 note: str | None = None):
        self.source = source
        self.missing = dict(missing or {})
        self.unexpected = dict(unexpected or {})
        self.mismatched = dict(mismatched or {})
        lines = [f"checkpoint {source} does not match its config:"]
        for k, s in sorted(self.missing.items()):
            lines.append(f"  missing key {k!r}: expected shape {_shape(s)}")
        for k, s in sorted(self.unexpected.items()):
            lines.append(f"  unexpected key {k!r}: actual shape {_shape(s)}")
        for k, (e, a) in sorted(self.mismatched.items()):
            lines.append(f"  wrong shape for {k!r}: expected {_shape(e)}, got {_shape(a)}")
        if note:
            lines.append(note)
        super().__init__("\n".join(lines))
