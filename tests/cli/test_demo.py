"""``lowrank-jax demo``: one quick run checked against independent recounts, and argument checks.

The quick demo runs once for the module (``demo --quick --steps 3``); the other tests are
argument checks that must fail before any work, and the evaluation shortcut of the pretraining
part checked against :func:`lowrank_jax.train.evaluate_forecaster`.
"""

import contextlib
import io
import json
import math
import os

import jax
import numpy as np
import pytest

import lowrank_jax.recipes.demo as demo_mod
from lowrank_jax.cli.main import main
from lowrank_jax.errors import ConfigError
from lowrank_jax.models import chronos_bolt
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.recipes import Outcome, outputs
from lowrank_jax.recipes.pretrain_demo import (
    eval_windows,
    forecast_scores,
    make_forward,
    run_pretraining_demo,
)
from lowrank_jax.train import evaluate_forecaster
from lowrank_jax.train.data import WindowConfig, WindowSampler

STEPS = 1  # the least --help allows: one optimizer step (no warmup) must work


def strict_json(path):
    """Parse ``path`` refusing NaN / Infinity (which ``json.loads`` accepts by default)."""

    def refuse(name):
        raise AssertionError(f"{path} holds {name}: not valid JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


PLOTS = ["hidden_eps_rank.png", "hidden_spectra.png", "pretrained_eps_rank_per_layer.png",
         "pretrained_singular_values.png", "theorem3.png", "time_accuracy_frontier.png"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("demo")
    js, plots = root / "demo.json", root / "plots"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["demo", "--quick", "--steps", str(STEPS), "--no-progress", "--json", str(js),
                   "--plots", str(plots)])
    assert rc == 0, err.getvalue()
    return strict_json(js), out.getvalue(), err.getvalue()


def test_plots_written_whole_with_a_marker(quick, tmp_path_factory):
    res, out, _ = quick
    plots = os.path.dirname(res["plots"][0])
    assert sorted(os.path.basename(p) for p in res["plots"]) == PLOTS
    assert sorted(os.listdir(plots)) == sorted(PLOTS + [outputs.MARKER])
    assert outputs.read_marker(plots)["files"] == PLOTS
    assert f"wrote {len(PLOTS)} plots to {plots}" in out
    assert not [n for n in os.listdir(os.path.dirname(plots)) if n.startswith(".")]


def test_appendix_j_theorem3_slope(quick):
    res, _, _ = quick
    assert 0.8 <= res["appendix_j"]["theorem3"]["slope"] <= 1.2
    t4 = res["appendix_j"]["theorem4"]
    # Theorem 4: the eps-rank of X + MH-Attention(X) does not fall with more heads, and grows
    for ranks in t4["output_eps_rank"].values():
        assert ranks == sorted(ranks)
    assert t4["output_eps_rank"]["0.0001"][-1] > t4["output_eps_rank"]["0.0001"][0]


def test_projection_beats_svd_at_equal_size(quick):
    res, _, _ = quick
    rows = [r for r in res["model"]["compression"] if isinstance(r["rank"], int)]
    by = {(r["method"], r["rank"]): r for r in rows}
    for rank in (4, 8, 16, 32):
        svd, proj = by[("truncated SVD", rank)], by[("input projection (Thm 3)", rank)]
        # equal size (rank r on a 128x128 matrix: 256 r of 128^2), and Theorem 3's projection
        # is the better one on low-rank inputs
        assert svd["size_ratio"] == proj["size_ratio"] == pytest.approx(rank * 256 / (128 * 128))
        assert proj["rel_error"] < svd["rel_error"]
    # the flow-of-ranks and uniform schedules of part 2 (rank lists) at about the same size
    sched = [r for r in res["model"]["compression"] if isinstance(r["rank"], list)]
    assert len(sched) == 2
    for r in sched:
        assert r["size_ratio"] == pytest.approx(sum(256 * k for k in r["rank"]) / (4 * 128 * 128))


def test_flow_of_ranks_grows_with_depth(quick):
    res, _, _ = quick
    hidden = res["model"]["analysis"]["hidden"]
    ranks = [h["eps_rank"]["0.05"] for h in hidden]
    assert ranks == sorted(ranks) and ranks[-1] > ranks[0]


def test_pretraining_rows_keys_and_recounted_sizes(quick):
    res, _, _ = quick
    pre = res["rows"]
    for row in pre:
        assert {"method", "size_ratio", "time_ratio", "wql", "mase"} <= set(row)
        assert all(isinstance(row[k], float) and math.isfinite(row[k])
                   for k in ("size_ratio", "time_ratio", "wql", "mase"))
        assert row["time_ratio"] > 0
    assert pre[0]["method"] == "dense" and pre[0]["wql"] == pre[0]["mase"] == 1.0
    by = {r["method"]: r for r in pre}
    for r in pre:  # an SVD that keeps every matrix dense is the dense model
        if r.get("kept_dense"):
            assert r["size_ratio"] == 1.0 and r["wql"] == r["mase"] == 1.0
    assert any(m.startswith("svd eps=") and not by[m]["kept_dense"] for m in by)
    info = res["pretraining"]
    sched = info["schedule"]
    flow = by[f"pretrained flow-of-ranks {sched}"]
    uni = by[f"pretrained uniform rank {info['uniform_rank']}"]
    # same budget (within one rank step), both far below dense
    assert abs(flow["size_ratio"] - uni["size_ratio"]) < 0.05 and flow["size_ratio"] < 0.5
    # size ratios recounted: rank r on a d x d attention matrix costs 2 d r of d^2; an encoder
    # layer has 4 attention matrices (q, k, v, o), a decoder layer 8 (self and cross)
    cfg = info["config"]
    d, n_enc, n_dec = cfg["d_model"], cfg["encoder_layers"], cfg["decoder_layers"]
    ranks = [sched[i] for i in range(n_enc) for _ in range(4)] + [
        sched[i] for i in range(n_dec) for _ in range(8)
    ]
    assert flow["size_ratio"] == pytest.approx(sum(2 * d * r for r in ranks) / (d * d * len(ranks)))
    assert uni["size_ratio"] == pytest.approx(2 * d * info["uniform_rank"] / (d * d))
    # the sizes the rows report are the parameters of the trees: fewer for the factorized ones
    assert flow["params"] < by["dense"]["params"] and uni["params"] < by["dense"]["params"]


def test_steps_are_honoured_exactly(quick):
    res, _, _ = quick
    assert res["pretraining"]["steps"] == STEPS
    assert set(res["pretraining"]["training"]) == {"dense", "flow-of-ranks", "uniform"}
    for t in res["pretraining"]["training"].values():
        assert t["steps_run"] == STEPS


def test_status_lines_announce_every_part(quick):
    _, out, err = quick
    for part in ("part 1 of 3", "part 2 of 3", "part 3 of 3", "training dense",
                 "training flow-of-ranks", "training uniform", "evaluating"):
        assert part in err
    # results on stdout; the single-seed table makes no claim about which pretrained row wins
    assert "pretrained flow-of-ranks" in out and "One seed" in out
    assert "better than uniform" not in out and "beats" not in out


@pytest.mark.parametrize("argv, name, actual", [
    (["--steps", "0"], "--steps", "0"),
    (["--steps", "-5"], "--steps", "-5"),
    (["--seed", "-1"], "--seed", "-1"),
])
def test_bad_arguments_exit_2_before_any_work(argv, name, actual, tmp_path, monkeypatch, capsys):
    def must_not_run(**kw):
        raise AssertionError("the demo ran despite a bad argument")

    monkeypatch.setattr(demo_mod, "run_demo", must_not_run)
    js = tmp_path / "demo.json"
    assert main(["demo", "--quick", "--no-progress", "--json", str(js), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and name in err and actual in err and ">=" in err
    assert not js.exists()


def test_user_files_in_plots_are_never_replaced(tmp_path, monkeypatch, capsys):
    """`demo --plots DIR` over a directory holding the user's files (even with a plot's name)
    is refused before any work, with and without --overwrite, and the files are untouched."""
    pytest.importorskip("matplotlib")
    ran = []
    monkeypatch.setattr(demo_mod, "_run_demo", lambda *a, **kw: ran.append(1))
    mine = tmp_path / "p"
    mine.mkdir()
    (mine / "theorem3.png").write_text("mine")
    for extra in ([], ["--overwrite"]):
        assert main(["demo", "--quick", "--no-progress", "--plots", str(mine), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--plots {mine}" in err
        assert "did not write" in err
    assert ran == [] and os.listdir(mine) == ["theorem3.png"]
    assert (mine / "theorem3.png").read_text() == "mine"


def fake_demo(fail: bool = False):
    """A stand-in for the demo's work that writes two plots where it is told to."""
    def run(quick, plots_dir, status, steps, seed):
        paths = []
        for name in ("a.png", "b.png"):
            with open(os.path.join(plots_dir, name), "w") as f:
                f.write(name)
            paths.append(os.path.join(plots_dir, name))
        if fail:
            raise KeyboardInterrupt
        return Outcome({"plots": paths, "rows": []})
    return run


def test_plots_are_replaced_only_with_overwrite(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    plots, js = tmp_path / "plots", tmp_path / "demo.json"
    monkeypatch.setattr(demo_mod, "_run_demo", fake_demo(fail=True))
    assert main(["demo", "--no-progress", "--plots", str(plots)]) == 130
    assert os.listdir(tmp_path) == []  # an interrupted demo leaves nothing
    monkeypatch.setattr(demo_mod, "_run_demo", fake_demo())
    assert main(["demo", "--no-progress", "--plots", str(plots), "--json", str(js)]) == 0
    assert sorted(os.listdir(plots)) == ["a.png", "b.png", outputs.MARKER]
    assert strict_json(js)["plots"] == [str(plots / "a.png"), str(plots / "b.png")]
    capsys.readouterr()
    assert main(["demo", "--no-progress", "--plots", str(plots)]) == 2  # its own: --overwrite
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["demo", "--no-progress", "--plots", str(plots), "--overwrite"]) == 0
    assert sorted(os.listdir(plots)) == ["a.png", "b.png", outputs.MARKER]
    assert sorted(os.listdir(tmp_path)) == ["demo.json", "plots"]
    # the report may not go inside the plots directory (checked before any work)
    ran = []
    monkeypatch.setattr(demo_mod, "_run_demo", lambda *a, **kw: ran.append(1))
    assert main(["demo", "--no-progress", "--plots", str(tmp_path / "new"),
                 "--json", str(tmp_path / "new" / "r.json")]) == 2
    assert "inside the output" in capsys.readouterr().err and ran == []


def test_a_failure_of_the_work_is_not_blamed_on_plots(tmp_path, monkeypatch, capsys):
    """The demo's work runs while its plots directory is being filled: an OS error of the work
    keeps its own message (it is not a failure to write --plots), and nothing is written."""
    pytest.importorskip("matplotlib")

    def missing(*args, **kw):
        raise FileNotFoundError("series file /data/x.csv not found")

    monkeypatch.setattr(demo_mod, "_run_demo", missing)
    assert main(["demo", "--no-progress", "--plots", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "series file /data/x.csv not found" in err
    assert "--plots" not in err and os.listdir(tmp_path) == []


def test_plots_must_be_a_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_mod, "run_demo", lambda **kw: pytest.fail("ran"))
    f = tmp_path / "plots"
    f.write_text("not a directory")
    assert main(["demo", "--quick", "--no-progress", "--plots", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--plots" in err and str(f) in err


def test_python_api_rejects_zero_steps():
    # steps=0 used to mean "the default" (600 steps); now it is an error naming the argument
    for fn in (demo_mod.run_demo, run_pretraining_demo):
        with pytest.raises(ConfigError, match="steps must be an int >= 1"):
            fn(steps=0)
        with pytest.raises(ConfigError, match="steps"):
            fn(steps=2.5)


def test_json_is_strict_nan_written_as_null(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_mod, "run_demo", lambda **kw: Outcome({
        "rows": [{"method": "dense", "size_ratio": 1.0, "time_ratio": 1.0, "wql": float("nan"),
                  "mase": float("inf")}]}))
    js = tmp_path / "demo.json"
    assert main(["demo", "--no-progress", "--json", str(js)]) == 0
    row = strict_json(js)["rows"][0]
    assert row["wql"] is None and row["mase"] is None and row["size_ratio"] == 1.0


def test_one_pass_evaluation_equals_evaluate_forecaster():
    """The demo scores every dataset from one forward pass over all test windows; that must
    equal evaluate_forecaster on each dataset's own sampler."""
    t5 = T5Config(vocab_size=2, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                  num_heads=2, feed_forward_proj="relu")
    cfg = ChronosBoltConfig(t5=t5, context_length=32, prediction_length=8, input_patch_size=8,
                            input_patch_stride=8, use_reg_token=True)
    params = chronos_bolt.init(jax.random.PRNGKey(3), cfg)
    rng = np.random.default_rng(0)
    t = np.arange(900)
    groups = {  # 3 datasets of different sizes, one too short for a test window
        "sines": [np.sin(2 * np.pi * t / p) + 2 for p in (12, 30)],
        "walk": [np.cumsum(rng.normal(size=700)) + 50],
        "short": [np.ones(20)],
    }
    wcfg = WindowConfig(context_length=32, horizon=8, stride=8)
    windows = eval_windows(groups, wcfg)
    assert set(windows.spans) == {"sines", "walk"}
    got = forecast_scores(make_forward(cfg), params, windows, levels=cfg.quantiles)
    total = 0
    for name in ("sines", "walk"):
        sampler = WindowSampler(groups[name], wcfg, split="test", batch_size=64, skip_short=True)
        ref = evaluate_forecaster(cfg, params, sampler)
        assert got["per_dataset"][name]["n_windows"] == ref["n_windows"]
        np.testing.assert_allclose(got["per_dataset"][name]["wql"], ref["wql"], rtol=1e-5)
        np.testing.assert_allclose(got["per_dataset"][name]["mase"], ref["mase"], rtol=1e-5)
        total += ref["n_windows"]
    assert got["pooled"]["n_windows"] == total
