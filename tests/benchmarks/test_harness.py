"""benchmarks/_harness.py: tables, goals, checked outputs, the JSON schema and the topic
dispatcher (no timings are asserted: the clock is lowrank_jax.timing's, tested there)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks import _harness as H
from lowrank_jax import timing


def test_table_aligns_and_formats():
    t = H.Table(H.Col("what", "what", width=6), H.Col("ms", "ms", ".2f", 7),
                H.Col("load", "load", "%"), H.Col("n", lambda r: len(r["what"])))
    assert t.header() == "what        ms load n"
    assert t.line({"what": "ab", "ms": 1.234, "load": 0.25}) == "ab        1.23  25% 2"
    assert t.line({"what": "abc", "ms": None, "load": None}) == "abc          -  n/a 3"


def test_goal_entry_schema():
    g = H.goal("LowRank leaf time/FLOP at FLOP ratio ~0.1", 1.3, target="<= 1.15", holds=False,
               measured="worst 1.30", d=768)
    assert g == {"LowRank leaf time/FLOP at FLOP ratio ~0.1": {
        "value": 1.3, "target": "<= 1.15", "holds": False, "measured": "worst 1.30", "d": 768}}
    assert H.goal("x", 2)["x"]["target"] == "reported"
    assert H.goal("x", 2)["x"]["holds"] is None


def test_measure_checks_outputs_against_the_reference():
    ref = np.array([[1.0, -4.0], [2.0, 0.0]])
    calls = {"ref": lambda: ref, "close": lambda: ref + np.array([[0.0, 0.5], [0.0, 0.0]]),
             "pair": lambda: (ref, 2 * ref)}
    seen = []
    calls["counted"] = lambda: seen.append(1) or ref
    m = H.measure(calls, runs=3, warmup=1,
                  check={"close": "ref", "counted": "ref", "pair": "pair"})
    assert m.max_abs_error["close"] == 0.5
    assert m.rel_error["close"] == pytest.approx(0.5 / 4.0)  # over max |reference|
    assert m.max_abs_error["counted"] == 0.0 and m.max_abs_error["pair"] == 0.0
    assert len(seen) == 1 + 1 + 3  # the check, the warm-up, the rounds
    assert m.timings.names == ("ref", "close", "pair", "counted") and m.timings.runs == 3
    with pytest.raises(ValueError, match="different structure"):
        H.measure({"a": lambda: (ref, ref), "b": lambda: ref}, runs=1, check={"a": "b"})


def test_measure_relative_error_per_array():
    """A pytree output: each array's difference over that array's own scale, the largest."""
    a = (np.array([100.0]), np.array([1.0]))
    b = (np.array([100.0]), np.array([1.1]))
    m = H.measure({"a": lambda: a, "b": lambda: b}, runs=1, check={"a": "b"})
    assert m.max_abs_error["a"] == pytest.approx(0.1)
    assert m.rel_error["a"] == pytest.approx(0.1 / 1.1)


def test_measured_ratios_and_time_per_flop():
    t = timing.Timings(names=("lowrank", "dense"), wall=((2.0, 4.0, 3.0), (6.0, 8.0, 10.0)),
                       cpu=((1.0,) * 3, (1.0,) * 3), other_load=0.1, warmup=0)
    m = H.Measured(t, {}, {}, {"lowrank": 25.0, "dense": 100.0})
    assert m.ms("dense") == pytest.approx(8000.0)
    assert m.ratio("lowrank", "dense") == pytest.approx(3.0 / 8.0)
    assert m.flop_ratio("lowrank", "dense") == 0.25
    assert m.time_per_flop("lowrank", "dense") == pytest.approx(1.5)
    assert m.load == 0.1


def test_run_writes_one_schema(tmp_path, capsys):
    run = H.Run("benchmarks.layers.linear", ["--quick", "--d", "256"], runs=3)
    assert run.setup["command"] == "python -m benchmarks.layers linear --quick --d 256"
    assert H.command("benchmarks.gpu", ["--quick"]) == "python -m benchmarks.gpu --quick"
    path = tmp_path / "out.json"
    out = run.finish(str(path), rows=[{"d": 256, "ms": np.float32(1.5)}],
                     goals=H.goal("a thing", 0.5, target="<= 1", holds=True,
                                  measured="0.50"), extra={"k": 1})
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(out, default=H._plain))
    assert list(data)[:3] == ["setup", "rows", "goals"] and data["extra"] == {"k": 1}
    for key in ("date", "command", "machine", "cpu_count", "python", "jax", "backend", "devices",
                "malloc", "keep_freed_memory", "xla_flags", "seconds", "other_load", "runs"):
        assert key in data["setup"], key
    assert data["rows"] == [{"d": 256, "ms": 1.5}]
    assert data["goals"]["a thing"]["holds"] is True
    assert "# a thing: 0.50 (target <= 1: met)" in capsys.readouterr().out


def test_write_json_is_all_or_nothing(tmp_path):
    path = tmp_path / "r.json"
    H.write_json(str(path), {"a": 1})
    with pytest.raises(ValueError):
        H.write_json(str(path), {"a": float("nan")}, allow_nan=False)
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]  # no temporary file left


def test_topic_main_lists_and_rejects(capsys):
    assert H.topic_main("layers", ["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m benchmarks.layers NAME" in out
    for name in ("linear", "mlp", "query_key"):
        assert f"  {name} " in out
    assert H.topic_main("layers", []) == 0
    assert H.topic_main("layers", ["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
