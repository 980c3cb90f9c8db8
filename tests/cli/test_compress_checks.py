"""``lowrank-jax compress`` refuses what it cannot do before reading the model, says so in the
command's words, and reports a measured time only with its spread and only for a changed model."""

import json
import os
import re

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.io import save_model, save_params


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    r = np.random.default_rng(0)
    w = {n: lj.Dense(np.asarray(r.normal(size=(16, 16)), np.float32)) for n in "qkvo"}
    attn = {"qk": lj.QueryKey.uniform(w["q"], w["k"], 4), "v": w["v"], "o": w["o"],
            "heads": lj.HeadLayout.uniform(4, 4, 0.5)}
    d = tmp_path_factory.mktemp("in") / "params"
    save_params(d, {"layers": [{"attn": attn}]})
    return d


@pytest.fixture(scope="module")
def model_ckpt(tmp_path_factory):
    from lowrank_jax.models import t5
    from lowrank_jax.models.t5 import T5Config

    cfg = T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                   num_heads=2, feed_forward_proj="relu")
    d = tmp_path_factory.mktemp("model") / "t5"
    save_model(d, cfg, t5.init(jax.random.PRNGKey(0), cfg))
    return d


@pytest.fixture
def loader(monkeypatch):
    """The model loader, replaced by a recorder that fails."""
    import lowrank_jax.recipes.sources as sources

    called = []

    def load_source(*args, **kw):
        called.append(args)
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(sources, "load_source", load_source)
    return called


def one_line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"lowrank-jax {command}: error: "), err
    return lines[0]


def plan_file(tmp_path, plan) -> str:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    return str(p)


# ---------------------------------------------------------------------------------------------
# Refused before the model is read.

def test_empty_plan_is_refused(ckpt, tmp_path, loader, capsys):
    """A plan without steps would write an unchanged copy: refused, nothing written."""
    plan = plan_file(tmp_path, {"steps": []})
    out = tmp_path / "S"
    assert main(["compress", str(ckpt), "--plan", plan, "--out", str(out), "--no-progress"]) == 2
    line = one_line(capsys.readouterr().err, "compress")
    assert f"--plan {plan} has no steps" in line
    assert loader == [] and not out.exists()


BAD_VALUES = {
    "eps 0": (["--eps", "0"], "--eps must be a number in (0, 1), got 0.0"),
    "eps 1.5": (["--eps", "1.5"], "--eps must be a number in (0, 1), got 1.5"),
    "eps nan": (["--eps", "nan"], "--eps must be a number in (0, 1), got nan"),
    "rank 0": (["--rank", "0"], "--rank must be an int >= 1, got 0"),
    "rank -3": (["--rank", "-3"], "--rank must be an int >= 1, got -3"),
    "ratio 0": (["--ratio", "0"], "--ratio must be a number in (0, 1], got 0.0"),
    "ratio 2": (["--ratio", "2"], "--ratio must be a number in (0, 1], got 2.0"),
    "rank multiple": (["--rank", "2", "--rank-multiple", "0"], "--rank-multiple must be an int"),
    "num layers": (["--schedule", "power:2:0.5", "--num-layers", "0"], "--num-layers must be"),
    "schedule d0": (["--schedule", "power:0:0.5"], "--schedule power:0:0.5: d0 must be"),
    "schedule alpha": (["--schedule", "power:2:-1"], "--schedule power:2:-1: alpha must be"),
    "schedule r1": (["--schedule", "interp:2.5:8:0.5"], "R1 must be a whole number >= 1"),
    "rule regex": (["--eps", "0.5", "--rule", "attn/("], "--rule 'attn/(' is not a valid"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused_before_loading(case, ckpt, loader, capsys):
    argv, needle = BAD_VALUES[case]
    assert main(["compress", str(ckpt), *argv, "--no-progress"]) == 2
    assert needle in one_line(capsys.readouterr().err, "compress")
    assert loader == []


@pytest.mark.parametrize("step, needle", [
    ({"method": "svd", "rules": ["attn/v$"], "settings": {"eps": 5}},
     "eps must be a number in (0, 1), got 5"),
    ({"method": "svd", "rules": ["attn/v$"], "settings": {"rank": 0}}, "rank must be an int"),
    ({"method": "no-such-method", "rules": ["attn/v$"]}, "no-such-method"),
    ({"method": "svd", "rules": ["attn/v$"], "settings": {"rnak": 2}}, "unknown settings"),
])
def test_bad_plan_is_refused_before_loading(step, needle, ckpt, tmp_path, loader, capsys):
    plan = plan_file(tmp_path, {"steps": [step]})
    assert main(["compress", str(ckpt), "--plan", plan, "--no-progress"]) == 2
    line = one_line(capsys.readouterr().err, "compress")
    assert needle in line and (f"--plan {plan}" in line or plan in line)
    assert loader == []


@pytest.mark.parametrize("argv, needle", [
    (["--eps", "0.1", "2"], "--eps values must be numbers in (0, 1), got 2.0"),
    (["--sweep", "--sweep-eps", "0.5", "0"], "--sweep-eps values must be numbers in (0, 1)"),
])
def test_analyze_values_are_refused_before_loading(argv, needle, ckpt, loader, capsys):
    assert main(["analyze", str(ckpt), *argv, "--no-progress"]) == 2
    assert needle in one_line(capsys.readouterr().err, "analyze")
    assert loader == []


@pytest.mark.parametrize("argv, needle", [(["--eps", "-1"], "--eps must be a number > 0"),
                                          (["--rank", "-1"], "--rank must be an int >= 0")])
def test_partition_values_are_refused_before_loading(argv, needle, ckpt, loader, capsys):
    assert main(["partition", str(ckpt), *argv, "--no-progress"]) == 2
    assert needle in one_line(capsys.readouterr().err, "partition")
    assert loader == []


# ---------------------------------------------------------------------------------------------
# Messages name the argument, not a library function.

FUNCTION_PREFIX = re.compile(r"error: (load_\w+|read_\w+|save_\w+): ")


def test_reader_errors_name_the_argument(ckpt, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["compress", str(missing), "--rank", "2", "--no-progress"]) == 2
    line = one_line(capsys.readouterr().err, "compress")
    assert not FUNCTION_PREFIX.search(line), line
    assert f"error: MODEL: no checkpoint at {missing}" in line
    assert main(["convert", str(missing), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    line = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln][0]
    assert not FUNCTION_PREFIX.search(line) and f"error: SRC: {missing} is not a directory" in line
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tree.json").write_text("{not json")
    assert main(["analyze", str(bad), "--no-progress"]) == 2
    line = one_line(capsys.readouterr().err, "analyze")
    assert not FUNCTION_PREFIX.search(line) and "MODEL: " in line and "not valid JSON" in line


# ---------------------------------------------------------------------------------------------
# The measured time: with its spread, and only for a changed model.

def test_time_ratio_has_its_spread(model_ckpt, tmp_path, capsys):
    js = tmp_path / "r.json"
    assert main(["compress", str(model_ckpt), "--rank", "1", "--time-runs", "3", "--no-progress",
                 "--json", str(js)]) == 0
    out = capsys.readouterr().out
    ev = json.loads(js.read_text())["model"]
    lo, hi = ev["time_ratio_quartiles"]
    assert 0 < lo <= hi and ev["time_runs"] == 3
    text = (f"measured time ratio {ev['time_ratio']:.3f} (middle half of 3 paired runs: "
            f"{lo:.3f}-{hi:.3f}")
    assert text in out
    assert ("no measurable difference" in out) == (lo <= 1.0 <= hi)


def test_unchanged_model_is_not_timed(model_ckpt, tmp_path, capsys):
    """--eps 1e-6 keeps every (full-rank) weight dense: the model is unchanged, and a measured
    ratio would be noise presented as a result."""
    js = tmp_path / "r.json"
    assert main(["compress", str(model_ckpt), "--eps", "1e-6", "--time-runs", "3",
                 "--no-progress", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    rep = json.loads(js.read_text())
    assert rep["changed"] == 0 and rep["rows"]  # weights were selected; none was replaced
    assert "this plan changed nothing" in out
    assert "time not measured (no weight changed" in out and "measured time ratio" not in out
    assert "time_ratio" not in rep["model"] and "time_ms" not in rep["model"]
    assert rep["model"]["max_abs_error"] == 0.0
    assert os.listdir(tmp_path) == ["r.json"]
