"""Progress output: live bars on a terminal, plain lines anywhere else.

Every progress display of the library and of the ``lowrank-jax`` command goes through
:func:`progress_bar` (and the command's live elapsed-time lines through :func:`live`), so one
decision holds everywhere: a stream that is a terminal (``isatty()``), or a Jupyter front end
where tqdm draws a widget, gets tqdm's bars, redrawn in place with carriage returns. Anything
else -- a file, a pipe, a CI log -- gets plain lines (:class:`PlainProgress`): a loop that runs
longer than ``every`` seconds (30) prints one line with its count and elapsed time at most that
often and a last one when it ends; a shorter loop prints nothing. A redirected log then holds
whole lines only, and few of them.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator


def _notebook_bars() -> bool:
    """Whether ``tqdm.auto`` chose its Jupyter widget (a kernel with ipywidgets)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return False
    return tqdm.__module__.startswith("tqdm.notebook")


def live(stream: Any = None) -> bool:
    """Whether progress on ``stream`` (default ``sys.stderr``) may be drawn live: ``True`` for a
    terminal, or in a Jupyter kernel where tqdm draws a widget; ``False`` for a file, a pipe or
    a stream that cannot tell (no ``isatty``, or a closed one)."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError, OSError):
        return False
    return _notebook_bars()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class PlainProgress:
    """A progress display of whole lines at a low rate, for streams that are not terminals.

    The subset of tqdm's interface the library uses: iterate over it, or call ``update``;
    ``set_postfix`` / ``set_postfix_str`` (shown in the next line); ``close`` (also at the end
    of the iteration and of a ``with`` block). A line is printed when ``every`` seconds have
    passed since the start or the last line; ``close`` prints a last line only if an earlier
    one was printed, so a short loop stays silent.

    Args:
      iterable: what to iterate over (``None``: count with ``update``).
      desc: the label at the start of each line.
      total: the number of items (default ``len(iterable)`` where it has one).
      unit: the name of an item.
      initial: the count to start from.
      stream: where the lines go (default ``sys.stderr`` at the time of each line).
      every: seconds between lines.
    """

    def __init__(self, iterable: Iterable | None = None, *, desc: str = "",
                 total: int | None = None, unit: str = "it", initial: int = 0,
                 stream: Any = None, every: float = 30.0):
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.desc, self.total, self.unit = iterable, desc, total, unit
        self.n = int(initial)
        self.stream, self.every = stream, float(every)
        self.postfix = ""
        self.lines = 0
        self.closed = False
        self._t0 = self._last = time.monotonic()

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:  # type: ignore[union-attr]
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("PlainProgress: no total")
        return self.total

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self) -> str:
        """The text of one progress line (without the newline)."""
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        post = f", {self.postfix}" if self.postfix else ""
        return (f"{self.desc}: {count} {self.unit}{pct}, "
                f"{_clock(time.monotonic() - self._t0)} elapsed{post}")

    def _print(self) -> None:
        stream = sys.stderr if self.stream is None else self.stream
        print(self.line(), file=stream, flush=True)
        self.lines += 1
        self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more items; print a line if ``every`` seconds have passed."""
        self.n += n
        if not self.closed and time.monotonic() - self._last >= self.every:
            self._print()

    def set_postfix(self, **kw) -> None:
        """Show ``key=value`` pairs at the end of the next line."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:  # noqa: ARG002
        """Show ``s`` at the end of the next line (``refresh`` is tqdm's; lines are not
        redrawn)."""
        self.postfix = str(s)

    def close(self) -> None:
        """End the display: a last line if any was printed before."""
        if self.closed:
            return
        self.closed = True
        if self.lines:
            self._print()


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None,
                 unit: str = "it", initial: int = 0, enabled: bool = True, leave: bool = False,
                 stream: Any = None, every: float = 30.0):
    """A progress display for a loop: a tqdm bar where :func:`live` says so, else a
    :class:`PlainProgress`; nothing (a disabled tqdm, which passes the items through) when not
    ``enabled``.

    Args:
      iterable: what to iterate over (``None``: count with ``update``).
      desc, total, unit, initial: as tqdm's.
      enabled: show progress at all (the caller's ``progress=`` argument).
      leave: keep a finished tqdm bar on the terminal (plain lines stay anyway).
      stream: where it goes (default ``sys.stderr``).
      every: seconds between plain lines.
    """
    from tqdm.auto import tqdm

    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if live(stream):
        return tqdm(iterable, desc=desc, total=total, unit=unit, initial=initial,
                    file=sys.stderr if stream is None else stream, leave=leave)
    return PlainProgress(iterable, desc=desc, total=total, unit=unit, initial=initial,
                         stream=stream, every=every)


__all__ = ["PlainProgress", "live", "progress_bar"]
