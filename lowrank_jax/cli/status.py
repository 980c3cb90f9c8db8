"""Status lines and progress for the ``lowrank-jax`` command: no long silent stretch.

Every phase that can take more than a few seconds (reading a checkpoint, converting a Hugging
Face directory, decompositions, compiling and timing a model, sweeps, saving) is announced on
stderr before it starts (``lowrank-jax compress: evaluating the model ...``) and reported with
its duration when it ends. With progress on and stderr a terminal, a phase without a natural
count shows a live line with the elapsed time (refreshed every half second); loops with a count
get a tqdm bar with an estimate of the time left. When stderr is not a terminal (a file, a pipe,
a CI log) there are no live lines and no bars, whose carriage returns would fill the log: the
status lines stay, and a loop that runs longer than half a minute prints a plain line with its
count at most every 30 s (:mod:`lowrank_jax._progress`, the one decision for every progress
display). ``--no-progress`` turns the live lines, bars and loop lines off and keeps the status
lines, one per stage. stdout stays for the results (tables, summaries).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from lowrank_jax._progress import live
from lowrank_jax.recipes.progress import Lines


class Status(Lines):
    """Status lines and progress bars of one command: the
    :class:`~lowrank_jax.recipes.Progress` the command passes to its workflow.

    Args:
      command: the subcommand's name (lines start with ``'lowrank-jax <command>: '``).
      bars: show progress: live lines and bars on a terminal, plain loop lines elsewhere
        (``False`` with ``--no-progress``).
      live_after: seconds a phase runs before its live elapsed-time line appears.
    """

    def __init__(self, command: str, *, bars: bool = True, live_after: float = 2.0):
        super().__init__(f"lowrank-jax {command}", bars=bars)
        self.command = command
        self.live_after = live_after

    @contextlib.contextmanager
    def _meanwhile(self, message: str, t0: float) -> Iterator[None]:
        """The live elapsed-time line of a phase (with bars on and stderr a terminal)."""
        stop = threading.Event()
        thread = None
        if self.bars and live(self.stream):
            thread = threading.Thread(target=self._tick, args=(message, t0, stop), daemon=True)
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join()

    def _tick(self, message: str, t0: float, stop: threading.Event) -> None:
        from tqdm.auto import tqdm

        if stop.wait(self.live_after):  # short phases need no live line
            return
        bar = tqdm(total=None, desc=message, bar_format="{desc}: {elapsed} elapsed",
                   file=self.stream, leave=False)
        bar.start_t = time.time() - (time.perf_counter() - t0)  # tqdm counts in time.time()
        try:
            while not stop.wait(0.5):
                bar.refresh()
        finally:
            bar.close()


__all__ = ["Status"]
