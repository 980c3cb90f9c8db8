"""How a workflow reports its progress: the :class:`Progress` interface it is given.

A workflow never prints. It announces its stages through the ``Progress`` passed in (a status
line before a long phase, its duration after it, a bar over a loop with a count) and returns
its results (:class:`~lowrank_jax.recipes.Outcome`). The ``lowrank-jax`` command passes its
:class:`lowrank_jax.cli.status.Status` (which adds a live elapsed-time line on a terminal);
Python callers get :class:`Lines` unless they pass their own.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import ContextManager, Iterable, Iterator, Protocol

from lowrank_jax._progress import progress_bar


class Progress(Protocol):
    """What a workflow may report while it runs.

    Attributes:
      bars: whether loops may show progress (passed on to the library's ``progress=``).
    """

    bars: bool

    def say(self, message: str) -> None:
        """One status line."""

    def phase(self, message: str) -> ContextManager[None]:
        """Announce a phase that may take a while, and its duration when it ends."""

    def bar(self, iterable: Iterable, *, desc: str, total: int | None = None,
            unit: str = "it") -> Iterable:
        """``iterable``, with a progress display when :attr:`bars` is on."""


class Lines:
    """Status lines on stderr (``'<name>: <message>'``) and progress bars where the stream
    allows them (:func:`lowrank_jax._progress.progress_bar`).

    Args:
      name: the prefix of every line (``'lowrank-jax compress'``).
      bars: show progress bars (a tqdm bar on a terminal, a plain line every 30 s elsewhere).
    """

    def __init__(self, name: str, *, bars: bool = True):
        self.name = name
        self.bars = bars

    @property
    def stream(self):
        return sys.stderr

    def say(self, message: str) -> None:
        """One status line on stderr."""
        print(f"{self.name}: {message}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, message: str) -> Iterator[None]:
        """Announce a phase, and report its duration when it ends without an error."""
        self.say(f"{message} ...")
        t0 = time.perf_counter()
        with self._meanwhile(message, t0):
            yield
        self.say(f"{message}: done in {time.perf_counter() - t0:.1f} s")

    def _meanwhile(self, message: str, t0: float) -> ContextManager[None]:
        """What runs beside a phase (nothing here; the command's status adds a live line)."""
        return contextlib.nullcontext()

    def bar(self, iterable: Iterable, *, desc: str, total: int | None = None,
            unit: str = "it") -> Iterable:
        """``iterable`` with a bar (:func:`lowrank_jax._progress.progress_bar`), or as it is
        with bars off."""
        return progress_bar(iterable, desc=desc, total=total, unit=unit, enabled=self.bars,
                            stream=self.stream)


def lines(status: Progress | None, name: str, *, bars: bool = True) -> Progress:
    """``status``, or :class:`Lines` named ``'lowrank-jax <name>'`` when it is ``None``."""
    return status if status is not None else Lines(f"lowrank-jax {name}", bars=bars)


__all__ = ["Lines", "Progress", "lines"]
