"""``lowrank-jax frontier`` on a tiny Chronos-Bolt: the report's rows recomputed independently,
the frontier against brute force, the budget, the plots, the errors and the demo model's
cache."""

import contextlib
import io
import json
import os

import jax
import numpy as np
import pytest

from lowrank_jax.cli.main import main
from lowrank_jax.cli.status import Status
from lowrank_jax.compress import Plan, apply_plan
from lowrank_jax.compress.frontier import default_candidates
from lowrank_jax.io import load_model, save_model
from lowrank_jax.leaves import Leaf, named_leaves
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt
from lowrank_jax.recipes import frontier as frontier_mod

BUDGET = 0.9


def tiny_config():
    t5 = T5Config(vocab_size=2, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                  num_heads=2)
    return ChronosBoltConfig(t5=t5, context_length=32, prediction_length=8, input_patch_size=8,
                             input_patch_stride=8, use_reg_token=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = tiny_config()
    d = tmp_path_factory.mktemp("frontier") / "tiny"
    save_model(d, cfg, chronos_bolt.init(jax.random.PRNGKey(0), cfg))
    return d


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier_out")
    argv = ["frontier", str(model_dir), "--data", "builtin", "--budget", str(BUDGET), "--quick",
            "--methods", "svd", "--max-windows", "64", "--json", str(out / "out.json"),
            "--plots", str(out / "plots"), "--no-progress"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(argv)
    with open(out / "out.json") as f:
        report = json.load(f)
    return code, report, out, stdout.getvalue()


def brute_front(c, q):
    return sorted(i for i in range(len(c)) if not any(
        c[j] <= c[i] and q[j] <= q[i] and (c[j] < c[i] or q[j] < q[i]) for j in range(len(c))))


def test_report_has_a_row_per_candidate(run, model_dir):
    code, report, _, _ = run
    assert code == 0
    cfg, params = load_model(model_dir)
    cands, _ = default_candidates(params, cfg, quick=True, methods=["svd"])
    assert [r["name"] for r in report["rows"]] == ["dense"] + [c.name for c in cands]
    assert report["metric"] == "wql" and report["zero_shot"] is True
    assert report["lowrank_jax_report"]["command"] == "frontier"
    for r in report["rows"]:
        assert r["error"] is None
        for k in ("size_ratio", "param_ratio", "flop_ratio", "time_ratio", "wql", "mase"):
            assert np.isfinite(r[k]) and r[k] > 0, (r["name"], k)
    assert report["rows"][0]["wql"] == 1.0 and report["rows"][0]["mase"] == 1.0


def test_counts_recomputed_independently(run, model_dir):
    _, report, _, _ = run
    cfg, params = load_model(model_dir)
    row = next(r for r in report["rows"] if r["name"] == "svd attn+mlp ratio=0.5")
    new, _ = apply_plan(params, Plan.from_dict(row["plan"]), config=cfg)

    def rows(path):  # context 32 in patches of 8: 4 patches, + REG = 5 encoder tokens
        if path.startswith("input_patch_embedding/"):
            return 4
        if path.startswith("encoder/") or "cross_attn/qk/k" in path or "cross_attn/v" in path:
            return 5
        return 1  # the decoder's one step and the output block

    def counts(tree):
        arrays = jax.tree_util.tree_leaves(tree)
        flops = sum(rows(p) * sum(a.size for a in jax.tree_util.tree_leaves(n) if a.ndim == 2)
                    for p, n in named_leaves(tree) if isinstance(n, Leaf))
        return (sum(a.size for a in arrays), sum(a.size * a.dtype.itemsize * 8 for a in arrays),
                flops)

    (p0, b0, f0), (p1, b1, f1) = counts(params), counts(new)
    assert p1 < p0  # something was factorized
    assert (row["params"], row["storage_bits"], row["flops"]) == (p1, b1, f1)
    assert report["rows"][0]["params"] == p0 and report["rows"][0]["flops"] == f0
    assert row["size_ratio"] == pytest.approx(b1 / b0, rel=1e-12)
    assert row["param_ratio"] == pytest.approx(p1 / p0, rel=1e-12)
    assert row["flop_ratio"] == pytest.approx(f1 / f0, rel=1e-12)
    assert row["time_ratio"] == pytest.approx(row["time_ms"] / row["dense_time_ms"], rel=1e-9)


def test_frontier_and_budget_against_brute_force(run):
    _, report, _, _ = run
    rows = report["rows"]
    q = [r["wql"] for r in rows]
    for axis in ("size", "time"):
        c = [r[f"{axis}_ratio"] for r in rows]
        want = sorted((rows[i]["name"] for i in brute_front(c, q)),
                      key=lambda n: next(r[f"{axis}_ratio"] for r in rows if r["name"] == n))
        assert sorted(report["frontier"][axis]) == sorted(want)
        assert [r[f"on_{axis}_frontier"] for r in rows] == [r["name"] in want for r in rows]
        fits = [r for r in rows if r[f"{axis}_ratio"] <= BUDGET]
        best = report["recommended"][axis]
        if not fits:
            assert best is None
            continue
        row = next(r for r in rows if r["name"] == best)
        assert row[f"{axis}_ratio"] <= BUDGET
        assert row["wql"] == min(r["wql"] for r in fits)
    assert report["recommended"]["size"] is not None  # svd at 0.5 fits a budget of 0.9


def test_plots_and_table(run):
    _, report, out, stdout = run
    for name in frontier_mod.PLOTS:
        with open(out / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(out / "plots" / "lowrank_jax_output.json")
    assert report["plots"] == [os.path.join(str(out / "plots"), p) for p in frontier_mod.PLOTS]
    head = "| candidate | size | params | FLOPs | XLA FLOPs | time | WQL | MASE | frontier |"
    table = stdout[stdout.index(head):].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(report["rows"])
    assert table[2].startswith("| dense | 1.000 | 1.000 |")
    best = report["recommended"]["size"]
    line = next(t for t in table if t.startswith(f"| {best} |"))
    assert f"**best size <= {BUDGET:g}**" in line


@pytest.mark.parametrize("budget", ["0", "-0.5", "1.5", "nan"])
def test_bad_budget(model_dir, budget, capsys):
    assert main(["frontier", str(model_dir), f"--budget={budget}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--budget" in err[0] and "(0, 1]" in err[0]


def test_unknown_model_and_method(tmp_path, model_dir, capsys):
    missing = tmp_path / "no_such_model"
    assert main(["frontier", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such checkpoint" in err and len(err.splitlines()) == 1
    assert main(["frontier", str(model_dir), "--methods", "svd", "bogus"]) == 2
    assert "unknown methods ['bogus']" in capsys.readouterr().err


def test_outputs_refused_before_any_work(tmp_path, model_dir, capsys):
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    assert main(["frontier", str(model_dir), "--json", str(other)]) == 2
    assert "not a lowrank-jax JSON report" in capsys.readouterr().err
    assert other.read_text() == '{"mine": 1}'
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "keep.txt").write_text("x")
    assert main(["frontier", str(model_dir), "--plots", str(plots)]) == 2
    assert "--plots" in capsys.readouterr().err and (plots / "keep.txt").exists()


def test_demo_model_comes_from_the_cache(tmp_path, monkeypatch):
    """A cached checkpoint with the same recipe is loaded, not trained again."""
    from lowrank_jax.datasets import builtin_datasets
    from lowrank_jax.recipes.pretrain_demo import DEFAULT_STEPS

    _, source = builtin_datasets()
    cfg = tiny_config()
    params = chronos_bolt.init(jax.random.PRNGKey(3), cfg)
    path = tmp_path / f"demo_chronos_bolt_quick_steps{DEFAULT_STEPS[True]}_seed0"
    recipe = {"quick": True, "steps": DEFAULT_STEPS[True], "seed": 0, "data": source,
              "version": 1}
    save_model(path, cfg, params, metadata={"demo_pretraining": recipe})

    def no_training(*a, **k):
        raise AssertionError("trained although the cache holds the model")

    monkeypatch.setattr("lowrank_jax.train.fit", no_training)
    got_cfg, got, where = frontier_mod.demo_model(quick=True, cache=str(tmp_path),
                                                  status=Status("frontier", bars=False))
    assert where == str(path) and got_cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    monkeypatch.setenv("LOWRANK_JAX_CACHE", "/some/where")
    assert frontier_mod.cache_dir() == "/some/where"
    assert frontier_mod.cache_dir("given") == "given"


def test_csv_data_and_prune_batches(tmp_path):
    """--data CSV: test windows per column (last 20 %), capped evenly; prune candidates draw
    train windows (first 70 %) of the same file through a registered batch source."""
    from lowrank_jax.compress.prune.method import batch_source

    rng = np.random.default_rng(0)
    t = np.arange(400)
    a = 10 + np.sin(t / 7) + 0.1 * rng.normal(size=400)
    b = 5 + np.cos(t / 5) + 0.1 * rng.normal(size=400)
    csv = tmp_path / "series.csv"
    dates = np.datetime64("2020-01-01") + t.astype("timedelta64[h]")
    csv.write_text("date,a,b\n" + "".join(f"{d},{x},{y}\n" for d, x, y in zip(dates, a, b,
                                                                              strict=True)))
    cfg = tiny_config()
    data, wcfg = frontier_mod.forecast_data(cfg, str(csv), max_windows=6,
                                            status=Status("frontier", bars=False))
    assert dict(data.groups) == {"a": (0, 3), "b": (3, 6)}
    # the test split is values 320..400: a window's target lies inside it, scaled by the mean
    # absolute value of its context (the mean scaling of the window sampler)
    ctx, tgt = data.context[0], data.target[0]
    start = next(s for s in range(320, 400 - 8 + 1)
                 if np.allclose(a[s - 32:s] / np.mean(np.abs(a[s - 32:s])), ctx, atol=1e-5))
    np.testing.assert_allclose(tgt, a[start:start + 8] / np.mean(np.abs(a[start - 32:start])),
                               atol=1e-5)
    name = frontier_mod.register_csv_batches(cfg, str(csv), wcfg, seed=0)
    batch = batch_source(name)(cfg, batch_size=4)(0)
    assert batch["context"].shape == (4, 32) and batch["target"].shape == (4, 8)
