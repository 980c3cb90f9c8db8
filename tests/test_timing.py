"""lowrank_jax.timing: the interleaved loop with a fake clock (order, alternation, warm-up),
and its statistics recomputed here with NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from lowrank_jax import timing
from lowrank_jax.errors import ConfigError


class FakeClock:
    """A clock that only moves when a call says so: call ``name`` in its ``k``-th timed round
    takes ``durations[name][k]`` seconds of wall time and half as much CPU time."""

    def __init__(self, durations: dict[str, list[float]], warmup: int):
        self.now = 0.0
        self.cpu = 0.0
        self.durations = durations
        self.warmup = warmup
        self.log: list[str] = []

    def call(self, name: str):
        def run():
            k = sum(n == name for n in self.log) - self.warmup  # timed rounds before this one
            self.log.append(name)
            if k >= 0:
                self.now += self.durations[name][k]
                self.cpu += self.durations[name][k] / 2
        return run


def make(durations, warmup=1):
    clock = FakeClock(durations, warmup)
    t = timing.time_interleaved({n: clock.call(n) for n in durations}, runs=len(
        next(iter(durations.values()))), warmup=warmup, clock=lambda: clock.now,
        cpu_clock=lambda: clock.cpu)
    return clock, t


DURATIONS = {"a": [4.0, 5.0, 3.0, 8.0, 6.0], "b": [2.0, 4.0, 3.0, 2.0, 9.0],
             "c": [1.0, 1.0, 2.0, 1.0, 1.0]}


def test_warmup_first_then_rounds_alternating_order():
    clock, t = make(DURATIONS, warmup=2)
    warm = ["a", "a", "b", "b", "c", "c"]  # each call's warm-up, in the order given
    rounds = [["a", "b", "c"], ["c", "b", "a"]] * 2 + [["a", "b", "c"]]
    assert clock.log == warm + [n for r in rounds for n in r]
    assert t.names == ("a", "b", "c") and t.runs == 5 and t.warmup == 2


def test_seconds_per_round_wall_and_cpu():
    _, t = make(DURATIONS)
    for name, want in DURATIONS.items():
        assert t.seconds(name) == pytest.approx(want)
        assert t.seconds(name, cpu=True) == pytest.approx([w / 2 for w in want])


def test_spread_matches_numpy_percentiles():
    _, t = make(DURATIONS)
    for name, want in DURATIONS.items():
        s = t.spread(name)
        assert s.median == pytest.approx(np.median(want))
        assert [s.q25, s.q75] == pytest.approx(np.percentile(want, [25, 75]))
        assert (s.min, s.max) == (min(want), max(want))
        assert t.median(name, cpu=True) == pytest.approx(np.median(want) / 2)
    even = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    s = timing.Spread.of(even)
    assert [s.q25, s.median, s.q75] == pytest.approx(np.percentile(even, [25, 50, 75]))
    assert s.as_dict() == {"median": s.median, "q25": s.q25, "q75": s.q75, "min": 1.0,
                           "max": 9.0}


def test_ratio_of_medians_and_paired_spread():
    _, t = make(DURATIONS)
    r = t.ratio("b", "a")
    assert r.value == pytest.approx(np.median(DURATIONS["b"]) / np.median(DURATIONS["a"]))
    paired = np.asarray(DURATIONS["b"]) / np.asarray(DURATIONS["a"])  # same round
    assert r.paired.median == pytest.approx(np.median(paired))
    assert [r.paired.q25, r.paired.q75] == pytest.approx(np.percentile(paired, [25, 75]))
    assert (r.paired.min, r.paired.max) == pytest.approx((paired.min(), paired.max()))
    # the ratio of medians is not the median of ratios: 3/5 against 0.8 here
    assert r.value == pytest.approx(0.6) and r.paired.median == pytest.approx(0.8)


def test_a_sequence_of_calls_is_named_by_position():
    seen = []
    t = timing.time_interleaved([lambda: seen.append(0), lambda: seen.append(1)], runs=3,
                                warmup=0)
    assert t.names == ("0", "1") and seen == [0, 1, 1, 0, 0, 1]
    assert len(t.seconds("1")) == 3 and all(s >= 0 for s in t.seconds("1"))


@pytest.mark.parametrize("kwargs, match", [({"calls": {}, "runs": 3}, "calls is empty"),
                                           ({"runs": 0}, "runs must be an int >= 1, got 0"),
                                           ({"runs": 2.5}, "runs must be an int"),
                                           ({"runs": 2, "warmup": -1}, "warmup must be")])
def test_bad_arguments(kwargs, match):
    kwargs = {"calls": {"x": lambda: None}, **kwargs}
    with pytest.raises(ConfigError, match=match):
        timing.time_interleaved(**kwargs)


def test_unknown_name_and_empty_spread():
    _, t = make(DURATIONS)
    with pytest.raises(ConfigError, match=r"no call named 'd'.*\['a', 'b', 'c'\]"):
        t.median("d")
    with pytest.raises(ConfigError, match="values is empty"):
        timing.Spread.of([])


def test_other_load_from_snapshots():
    # (busy machine s, elapsed machine s, this process's s)
    assert timing.other_load((10.0, 100.0, 2.0), (16.0, 110.0, 5.0)) == pytest.approx(0.3)
    assert timing.other_load((10.0, 100.0, 2.0), (12.0, 110.0, 5.0)) == 0.0  # clipped
    assert timing.other_load(None, (1.0, 2.0, 0.0)) is None
    assert timing.other_load((1.0, 2.0, 0.0), (1.0, 2.0, 0.0)) is None  # no time passed


def test_cpu_snapshot_reads_proc_stat_or_none(monkeypatch):
    snap = timing.cpu_snapshot()
    if snap is not None:  # Linux
        busy, total, mine = snap
        assert 0 <= busy <= total and mine >= 0

    def no_file(*a, **k):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", no_file)
    assert timing.cpu_snapshot() is None
    _, t = make({"a": [1.0]})
    assert t.other_load is None
