"""`lowrank-jax train`: config validation against the schema, the run directory (marker, stored
config, refusals, a complete run left alone, temporaries of killed runs removed), a NaN loss,
the Chronos family, and exact resume of `fit`."""

import json
import os

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.errors import ConfigError, OutputExistsError
from lowrank_jax.io import load_model
from lowrank_jax.io.files import temp_path
from lowrank_jax.models import chronos, chronos_bolt
from lowrank_jax.recipes.train import run_train
from lowrank_jax.recipes.train_config import build_model_config, load_train_config
from lowrank_jax.train import (
    Checkpointer,
    init_train_state,
)

MODEL = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=4,
             context_length=32, prediction_length=8, patch_size=8)
TINY = dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
            context_length=16, prediction_length=4)


def write(tmp_path, cfg, name="cfg.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


def csv_series(tmp_path):
    """A small ETT-style CSV (no aeon import: faster)."""
    rows = ["date,a,b"] + [f"2020-01-{1 + i // 24:02d} {i % 24:02d}:00:00,{5 + np.sin(i / 7):.6f},"
                           f"{3 + np.cos(i / 4):.6f}" for i in range(240)]
    p = tmp_path / "series.csv"
    p.write_text("\n".join(rows) + "\n")
    return str(p)


def dead_pid():
    pid = 999_999
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_run_lifecycle_resume_refusals_and_a_complete_run_left_alone(tmp_path):
    cfg = {"model": MODEL, "compression": {"schedule": "power", "d0": 2, "alpha": 0.5},
           "data": {"csv": csv_series(tmp_path)},
           "train": {"steps": 4, "batch_size": 8, "eval_every": 2, "checkpoint_every": 2}}
    path, out = write(tmp_path, cfg), tmp_path / "run"
    summary = run_train(path, str(out), progress=False)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert "eval_wql" in lines[1] and "eval_wql" not in lines[0]
    mcfg, params = load_model(out / "model")
    assert mcfg == build_model_config(load_train_config(path)["model"])
    sched = [2, 3]  # ceil(2 (1 + i)^0.5), i = 0, 1
    for p, leaf in lj.named_leaves(params):
        if "attn/" in p and p.rsplit("/", 1)[-1] in ("q", "k", "v", "o"):
            assert isinstance(leaf, lj.LowRank) and leaf.rank == sched[lj.leaves.layer_index(p)]
    sel = summary["compression"]["totals"]["selected"]
    assert sel["params_ratio"] == pytest.approx(sel["params_after"] / sel["params_before"])
    assert sel["params_before"] == sum(  # dense q/k/v/o of the 2 encoder + 1 decoder layers
        32 * 32 for _ in range(4 * (2 + 2 * 1)))
    assert summary["final_loss"] == lines[-1]["loss"] and summary["eval_step"] == 4
    assert summary["eval"]["eval_wql"] == lines[-1]["eval_wql"]
    run_doc = json.loads((out / "run.json").read_text())
    assert run_doc["format"] == "lowrank_jax.train_run"
    assert run_doc["config"] == load_train_config(path)  # normalized, defaults filled in

    # a rerun of the complete run changes nothing (it used to overwrite the summary with an
    # empty one); temporaries of killed runs are removed on start
    stale = [out / ".summary.json.tmp", out / ".run.json.tmp",
             out / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000",
             temp_path(out / "model", "tmp", pid=dead_pid())]
    stale[0].write_text("{")
    stale[1].write_text("{")
    os.makedirs(stale[2] / "state")
    os.makedirs(os.path.join(stale[3], "arrays"))
    before = {n: ((out / n).read_bytes(), (out / n).stat().st_mtime_ns)
              for n in ("summary.json", "metrics.jsonl", "run.json")}
    assert run_train(path, str(out), progress=False) == summary
    assert {n: ((out / n).read_bytes(), (out / n).stat().st_mtime_ns) for n in before} == before
    assert not any(os.path.lexists(p) for p in stale)

    # a changed config is refused, naming every key with its old and new value
    changed = write(tmp_path, {**cfg, "train": {**cfg["train"], "steps": 5, "eval_every": 0,
                                                "learning_rate": 0.002}}, "changed.json")
    with pytest.raises(ConfigError) as e:
        run_train(changed, str(out), progress=False)
    assert "train.learning_rate: 0.001 -> 0.002" in str(e.value)
    assert "train.steps: 4 -> 5" in str(e.value) and "--resume-changed-config" in str(e.value)
    assert {n: ((out / n).read_bytes(), (out / n).stat().st_mtime_ns) for n in before} == before
    # ... unless asked: it continues from step 4 and records the change
    summary5 = run_train(changed, str(out), progress=False, resume_changed_config=True)
    lines5 = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines5] == [1, 2, 3, 4, 5] and lines5[:4] == lines
    assert summary5["steps"] == 5 and summary5["final_loss"] == lines5[-1]["loss"]
    assert summary5["eval_step"] == 4  # the last evaluation, from before the change
    run_doc = json.loads((out / "run.json").read_text())
    assert run_doc["config"]["train"]["learning_rate"] == 0.002
    assert run_doc["changes"] == [{"step": 4, "changed": {
        "train.eval_every": {"old": 2, "new": 0},
        "train.learning_rate": {"old": 0.001, "new": 0.002},
        "train.steps": {"old": 4, "new": 5}}}]
    assert Checkpointer(out / "checkpoints").latest_step() == 5


def test_a_directory_that_is_not_a_run_is_refused_and_left_alone(tmp_path, capsys):
    path = write(tmp_path, {"model": TINY})
    other = tmp_path / "notes"
    other.mkdir()
    (other / "paper.tex").write_text("keep me")
    with pytest.raises(OutputExistsError, match="not a lowrank_jax train run"):
        run_train(path, str(other), progress=False)
    assert sorted(os.listdir(other)) == ["paper.tex"]
    assert main(["train", path, "--out", str(other), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(other) in err and "Traceback" not in err
    assert (other / "paper.tex").read_text() == "keep me"


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"modle": {}}, r"unknown section 'modle'; did you mean 'model'\?"),
        ({"train": {"stesp": 3}}, r"unknown key 'train.stesp'; did you mean 'train.steps'\?"),
        ({"data": {"cvs": "ETTh1.csv"}}, r"unknown key 'data.cvs'; did you mean 'data.csv'\?"),
        ({"compression": {"rank": 4, "per_haed": True}},
         r"unknown key 'compression.per_haed'; did you mean 'compression.per_head'\?"),
        ({"reuse_weights": {"form": "dense/model"}},
         r"unknown key 'reuse_weights.form'; did you mean 'reuse_weights.from'\?"),
        ({"train": {"steps": "10"}}, r'train.steps must be an int >= 1, got "10" \(str\)'),
        ({"train": {"learning_rate": True}},
         r"train.learning_rate must be a finite number > 0, got true \(bool\)"),
        ({"compression": {"rank": 2.5}}, r"compression.rank must be an int >= 1, got 2.5"),
        ({"compression": {"rank": 4, "rules": ["attn/(q"]}},
         r"compression.rules must be a non-empty list of regular expressions"),
        ({"data": {"stride": 0}}, r"data.stride must be an int >= 1 or null, got 0"),
        ({"data": []}, r"section 'data' must be a JSON object, got \[\] \(list\)"),
        ({"model": {"family": "vit"}}, r"model.family must be one of \['chronos_bolt', "
                                       r"'chronos'\], got \"vit\""),
        ({"model": {"family": "chronos", "patch_size": 8}},
         r"model.patch_size applies to family chronos_bolt only, not 'chronos'"),
        ({"compression": {"schedule": "power", "d0": 2}},
         r"schedule 'power' needs key 'compression.alpha'"),
        ({"compression": {"rank": 4, "d0": 2}}, r"compression.d0 does not apply to 'rank'"),
        ({"model": {**MODEL, "context_length": 100000}}, r"context"),
    ],
)
def test_bad_configs_fail_before_anything_is_written(tmp_path, cfg, match):
    with pytest.raises(ValueError, match=match):
        run_train(write(tmp_path, cfg), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_every_problem_in_one_line_from_the_command(tmp_path, capsys):
    path = write(tmp_path, {"data": {"cvs": "x.csv"}, "train": {"steps": -1}})
    assert main(["train", path, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'data.cvs'; did you mean 'data.csv'?" in err and "train.steps must be" in err
    assert path in err
    assert not (tmp_path / "out").exists()


def test_a_nan_loss_stops_with_status_2_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    # a learning rate of 1e30 turns the parameters into ~1e30 after the first update, and the
    # loss into NaN two steps later
    cfg = {"model": TINY, "data": {"csv": csv_series(tmp_path), "stride": 4},
           "train": {"steps": 6, "batch_size": 4, "learning_rate": 1e30, "eval_every": 0,
                     "checkpoint_every": 1}}
    out = tmp_path / "run"
    assert main(["train", write(tmp_path, cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    # the stage line (printed with --no-progress too), then the one-line error
    assert err.count("\n") == 2 and "Traceback" not in err
    assert err.startswith("lowrank-jax train: training steps 1-6 on ")
    assert "training stopped at step 3: the loss is nan" in err.splitlines()[-1]
    assert f"the last good checkpoint, step 2 in {out / 'checkpoints'}, is kept" in err

    def refuse(name):
        raise ValueError(name)

    records = [json.loads(x, parse_constant=refuse)
               for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    ck = Checkpointer(out / "checkpoints")
    assert ck.all_steps() == [1, 2]
    cfg_model = build_model_config(load_train_config(write(tmp_path, cfg))["model"])
    like = jax.eval_shape(lambda: init_train_state(
        chronos_bolt.init(jax.random.PRNGKey(0), cfg_model), lj.train.default_optimizer(),
        key=jax.random.PRNGKey(0)))
    state = ck.restore(like=like)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_chronos_family_trains_from_the_same_config_format(tmp_path, capsys):
    cfg = {"model": {**TINY, "family": "chronos", "n_tokens": 32, "num_samples": 2},
           "compression": {"rank": 2},
           "data": {"csv": csv_series(tmp_path), "stride": 4},
           "train": {"steps": 2, "batch_size": 4, "eval_every": 0, "checkpoint_every": 2}}
    out = tmp_path / "run"
    assert main(["train", write(tmp_path, cfg), "--out", str(out), "--no-progress"]) == 0
    assert "rank 2" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    mcfg, params = load_model(out / "model")
    assert isinstance(mcfg, chronos.ChronosConfig) and mcfg.n_tokens == 32
    assert summary["family"] == "chronos" and np.isfinite(summary["final_loss"])
    ranks = {leaf.rank for _, leaf in lj.named_leaves(params) if isinstance(leaf, lj.LowRank)}
    assert ranks == {2}


def test_cli_train_errors(tmp_path, capsys):
    cfg = write(tmp_path, {"model": TINY})
    assert main(["train", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["train", cfg, "--out", str(tmp_path / "y"), "--process-id", "1"]) == 2
    assert "need --distributed" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
