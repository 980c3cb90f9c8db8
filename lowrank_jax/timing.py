"""Timing several calls against each other on a shared machine.

Only ratios measured in one run mean much on a machine that other processes share: whatever
slows one call down at a given moment slows the call next to it too. :func:`time_interleaved`
times several zero-argument calls in one loop of ``runs`` rounds, every call once per round,
the order reversed on every other round (no call is always first after a pause or always right
after the most expensive one), after ``warmup`` untimed calls of each. It records the wall-clock
seconds of every call and the CPU seconds this process spent in it (all threads; wall time also
holds the waits for cores other processes were using), and the share of the machine's CPU time
other processes used meanwhile (Linux ``/proc/stat``; ``None`` elsewhere).

A call must return only when its work is done: end a JAX call with ``block_until_ready``.

:class:`Timings` gives medians, quartiles and extremes per call, and :meth:`Timings.ratio` the
ratio of two calls: the ratio of their medians, and the spread of the per-round ratios (the two
calls of one round ran under the same conditions), whose quartiles say how far single
measurements fall apart: a range that holds 1 means no measurable difference.

Example::

    from lowrank_jax import timing

    t = timing.time_interleaved({"dense": lambda: f(w, x).block_until_ready(),
                                 "lowrank": lambda: f(lr, x).block_until_ready()}, runs=20)
    r = t.ratio("lowrank", "dense")
    print(f"{r.value:.2f} ({r.paired.q25:.2f}-{r.paired.q75:.2f}), other load {t.other_load}")
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lowrank_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Spread:
    """Order statistics of a sample: median, quartiles (linear interpolation between order
    statistics, NumPy's default percentile) and extremes."""

    median: float
    q25: float
    q75: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one).

        Raises:
          ConfigError: ``values`` is empty.
        """
        v = sorted(float(x) for x in values)
        if not v:
            raise ConfigError("Spread.of: values is empty; expected at least one value")
        return cls(median=_percentile(v, 50.0), q25=_percentile(v, 25.0),
                   q75=_percentile(v, 75.0), min=v[0], max=v[-1])

    def as_dict(self) -> dict:
        """``{median, q25, q75, min, max}``, for JSON."""
        return dataclasses.asdict(self)


def _percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile of sorted values, interpolated linearly between the two nearest
    order statistics (``numpy.percentile``'s default)."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclasses.dataclass(frozen=True)
class Ratio:
    """One call's time over another's.

    Attributes:
      value: the ratio of the two calls' median times.
      paired: the spread of the per-round ratios (the two calls of the same round).
    """

    value: float
    paired: Spread


@dataclasses.dataclass(frozen=True)
class Timings:
    """The seconds of every timed call of :func:`time_interleaved`.

    Attributes:
      names: the calls' names, in the order given.
      wall: wall-clock seconds per call, one tuple per name, one entry per round.
      cpu: this process's CPU seconds per call (``time.process_time``: all threads), same shape.
      other_load: the share of the machine's CPU time that other processes used while the
        loop ran (0 to 1), or ``None`` where it cannot be read (not Linux).
      warmup: untimed calls of each before the loop.
    """

    names: tuple[str, ...]
    wall: tuple[tuple[float, ...], ...]
    cpu: tuple[tuple[float, ...], ...]
    other_load: float | None
    warmup: int

    @property
    def runs(self) -> int:
        """Timed rounds (every call once per round)."""
        return len(self.wall[0]) if self.wall else 0

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ConfigError(f"Timings: no call named {name!r}; the calls are "
                              f"{list(self.names)}") from None

    def seconds(self, name: str, *, cpu: bool = False) -> tuple[float, ...]:
        """The seconds of every round of call ``name`` (wall clock, or with ``cpu=True`` this
        process's CPU time)."""
        i = self._index(name)
        return (self.cpu if cpu else self.wall)[i]

    def median(self, name: str, *, cpu: bool = False) -> float:
        """The median seconds of call ``name``."""
        return self.spread(name, cpu=cpu).median

    def spread(self, name: str, *, cpu: bool = False) -> Spread:
        """Median, quartiles and extremes of call ``name``'s seconds."""
        return Spread.of(self.seconds(name, cpu=cpu))

    def ratio(self, num: str, den: str, *, cpu: bool = False) -> Ratio:
        """Call ``num``'s time over call ``den``'s: the ratio of the medians, and the spread of
        the ratios of the two calls of each round."""
        a, b = self.seconds(num, cpu=cpu), self.seconds(den, cpu=cpu)
        value = Spread.of(a).median / Spread.of(b).median
        return Ratio(value=value, paired=Spread.of([x / y for x, y in zip(a, b, strict=True)]))


def cpu_snapshot() -> tuple[float, float, float] | None:
    """A reading of the machine's CPU counters: ``(busy CPU seconds of the whole machine,
    elapsed CPU seconds of all cores, this process's CPU seconds)``, or ``None`` where
    ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = jiffies[3] + jiffies[4]  # idle + iowait
    t = os.times()
    return (sum(jiffies) - idle) / hz, sum(jiffies) / hz, t.user + t.system


def other_load(before, after) -> float | None:
    """The share (0 to 1) of the machine's CPU time that processes other than this one used
    between two :func:`cpu_snapshot` readings, or ``None`` when either is ``None`` or no time
    passed."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return min(1.0, max(0.0, others / (after[1] - before[1])))


def time_interleaved(calls: Mapping[str, Callable[[], Any]] | Sequence[Callable[[], Any]], *,
                     runs: int, warmup: int = 1, clock: Callable[[], float] | None = None,
                     cpu_clock: Callable[[], float] | None = None) -> Timings:
    """Time zero-argument calls against each other in one interleaved loop.

    Each call is first made ``warmup`` times untimed (compilation, caches), in the order
    given. Then ``runs`` rounds call each once, in the order given on even rounds and reversed
    on odd ones, reading ``clock`` and ``cpu_clock`` right before and after every call.

    Args:
      calls: ``{name: call}``, or a sequence of calls (named ``"0"``, ``"1"``, ...). A call
        must return only when its work is done (``block_until_ready`` for JAX).
      runs: timed rounds, at least 1.
      warmup: untimed calls of each before the rounds, at least 0.
      clock: wall-clock seconds (default ``time.perf_counter``).
      cpu_clock: this process's CPU seconds (default ``time.process_time``).

    Returns:
      The :class:`Timings`, with the share of the machine's CPU other processes used while
      the rounds ran.

    Raises:
      ConfigError: no calls, ``runs < 1`` or ``warmup < 0``.
    """
    if isinstance(calls, Mapping):
        names, fns = tuple(str(k) for k in calls), list(calls.values())
    else:
        fns = list(calls)
        names = tuple(str(i) for i in range(len(fns)))
    if not fns:
        raise ConfigError("time_interleaved: calls is empty; expected at least one call")
    if not isinstance(runs, numbers.Integral) or runs < 1:
        raise ConfigError(f"time_interleaved: runs must be an int >= 1, got {runs!r}")
    if not isinstance(warmup, numbers.Integral) or warmup < 0:
        raise ConfigError(f"time_interleaved: warmup must be an int >= 0, got {warmup!r}")
    clock = clock or time.perf_counter
    cpu_clock = cpu_clock or time.process_time
    runs, warmup = int(runs), int(warmup)
    for fn in fns:
        for _ in range(warmup):
            fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    before = cpu_snapshot()
    for i in range(runs):
        for j in (order if i % 2 == 0 else order[::-1]):
            c0, t0 = cpu_clock(), clock()
            fns[j]()
            t1, c1 = clock(), cpu_clock()
            wall[j].append(t1 - t0)
            cpu[j].append(c1 - c0)
    load = other_load(before, cpu_snapshot())
    return Timings(names=names, wall=tuple(tuple(w) for w in wall),
                   cpu=tuple(tuple(c) for c in cpu), other_load=load, warmup=warmup)


__all__ = ["Ratio", "Spread", "Timings", "cpu_snapshot", "other_load", "time_interleaved"]
