"""The workflows of :mod:`lowrank_jax.recipes` called from Python: plain arguments, nothing
printed, the same report and summary the command prints and writes, stages through the
``Progress`` passed in, bad arguments refused before anything is read."""

import contextlib
import json

import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import recipes
from lowrank_jax.cli.main import main
from lowrank_jax.errors import ConfigError
from lowrank_jax.io import load_params, save_params
from lowrank_jax.recipes import Lines, Outcome

D = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    g = np.random.default_rng(0)
    w = {n: lj.Dense(np.asarray(g.normal(size=(D, D)), np.float32)) for n in "qkvo"}
    params = {"layers": [{"attn": {"qk": lj.QueryKey.uniform(w["q"], w["k"], 4), "v": w["v"],
                                   "o": w["o"], "heads": lj.HeadLayout.uniform(4, D // 4, 0.5)}}]}
    path = tmp_path_factory.mktemp("recipes") / "params"
    save_params(path, params)
    return path, params


class Recorder:
    """A :class:`~lowrank_jax.recipes.Progress` that records what it is told."""

    def __init__(self):
        self.bars = False
        self.events = []

    def say(self, message):
        self.events.append(("say", message))

    @contextlib.contextmanager
    def phase(self, message):
        self.events.append(("phase", message))
        yield

    def bar(self, iterable, *, desc, total=None, unit="it"):
        self.events.append(("bar", desc))
        return iterable


def test_run_compress_prints_nothing_and_returns_what_the_command_shows(saved, tmp_path,
                                                                       capsys):
    path, params = saved
    status = Recorder()
    out = recipes.run_compress(str(path), rank=2, out=str(tmp_path / "small"), status=status)
    assert capsys.readouterr() == ("", "")  # no stdout, and the status went to the recorder
    assert ("phase", f"loading {path}") in status.events
    assert ("phase", f"saving to {tmp_path / 'small'}") in status.events
    # the compressed tree: every selected matrix is its rank-2 truncation (NumPy reference)
    new = out.values["params"]
    for name in ("v", "o"):
        w = np.asarray(lj.materialize(params["layers"][0]["attn"][name]), np.float64)
        u, s, vt = np.linalg.svd(w)
        want = (u[:, :2] * s[:2]) @ vt[:2]
        got = np.asarray(lj.materialize(new["layers"][0]["attn"][name]), np.float64)
        np.testing.assert_allclose(got, want, atol=1e-4)
    saved_tree = load_params(tmp_path / "small")
    np.testing.assert_array_equal(
        np.asarray(lj.materialize(saved_tree["layers"][0]["attn"]["v"])),
        np.asarray(lj.materialize(new["layers"][0]["attn"]["v"])))
    # the command prints the same summary and writes the same report
    js = tmp_path / "r.json"
    assert main(["compress", str(path), "--rank", "2", "--no-progress", "--json", str(js),
                 "--out", str(tmp_path / "small2")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:-1] == out.text.replace(str(tmp_path / "small"),
                                            str(tmp_path / "small2")).splitlines()
    assert printed[-1] == f"wrote {js}"
    report = json.loads(js.read_text())
    report.pop("lowrank_jax_report")
    assert report == json.loads(json.dumps(out))
    assert out["totals"]["tree"]["params_after"] < out["totals"]["tree"]["params_before"]


def test_run_compress_refuses_before_reading(tmp_path):
    missing = str(tmp_path / "nothing")  # never read: the arguments are refused first
    with pytest.raises(ConfigError, match="give a plan or one of eps, rank, ratio, schedule"):
        recipes.run_compress(missing)
    with pytest.raises(ConfigError, match="a plan and eps"):
        recipes.run_compress(missing, plan=lj.Plan((lj.Step("svd", ("v$",), {"rank": 1}),)),
                             eps=0.1)
    with pytest.raises(ConfigError, match="--plots"):
        recipes.run_compress(missing, rank=2, plots=str(tmp_path / "p"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_default_progress_is_status_lines_on_stderr(saved, capsys):
    path, _ = saved
    out = recipes.run_analyze(str(path), eps=(0.1,), status=Lines("mine", bars=False))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"mine: loading {path} ..." in captured.err.splitlines()
    assert len(out.lines) == 1 and "layers/0/attn/v" in out.lines[0]
    assert {row["path"] for row in out["weights"]} >= {"layers/0/attn/v", "layers/0/attn/o"}
    recipes.run_analyze(str(path), eps=(0.1,))
    err = capsys.readouterr().err
    assert f"lowrank-jax analyze: loading {path} ..." in err.splitlines()


def test_outcome_is_its_report():
    a = Outcome({"x": 1}, lines=["one", "two"], values={"tree": object()})
    assert a == {"x": 1} and a == Outcome({"x": 1}) and a != Outcome({"x": 2})
    assert a.text == "one\ntwo" and json.loads(json.dumps(a)) == {"x": 1}
    assert Outcome().lines == [] and Outcome().values == {}


def test_the_package_loads_its_names_on_use():
    assert recipes.run_demo is __import__("lowrank_jax.recipes.demo",
                                          fromlist=["run_demo"]).run_demo
    assert set(recipes.__all__) <= set(dir(recipes))
    with pytest.raises(AttributeError, match="no_such_name"):
        recipes.no_such_name  # noqa: B018
