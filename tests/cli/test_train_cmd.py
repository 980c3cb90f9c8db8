"""`lowrank-jax train`: config validation, compressed pretraining run, exact resume of `fit`."""

import json

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.train_cmd import build_model_config, load_train_config, run_train
from lowrank_jax.io import load_model
from lowrank_jax.models import chronos_bolt
from lowrank_jax.train import Checkpointer, WindowConfig, WindowSampler, default_series, fit, full_params

MODEL = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=4,
             context_length=32, prediction_length=8, patch_size=8)


def write(tmp_path, cfg):
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_train_run_writes_model_metrics_and_schedule(tmp_path):
    cfg = {"model": MODEL, "compression": {"schedule": "power", "d0": 2, "alpha": 0.5},
           "train": {"steps": 4, "batch_size": 8, "eval_every": 2, "checkpoint_every": 2}}
    out = tmp_path / "run"
    summary = run_train(write(tmp_path, cfg), str(out), progress=False)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert "eval_wql" in lines[1] and "eval_wql" not in lines[0]
    mcfg, params = load_model(out / "model")
    assert mcfg == build_model_config(load_train_config(write(tmp_path, cfg))["model"])
    sched = [2, 3]  # ceil(2 (1 + i)^0.5), i = 0, 1
    for path, leaf in lj.named_leaves(params):
        if "attn/" in path and path.rsplit("/", 1)[-1] in ("q", "k", "v", "o"):
            assert isinstance(leaf, lj.LowRank) and leaf.rank == sched[lj.leaves.layer_index(path)]
    sel = summary["compression"]["totals"]["selected"]
    assert sel["params_ratio"] == pytest.approx(sel["params_after"] / sel["params_before"])
    assert sel["params_before"] == sum(  # dense q/k/v/o of the 2 encoder + 1 decoder layers
        32 * 32 for _ in range(4 * (2 + 2 * 1)))


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"modle": {}}, r"unknown sections \['modle'\]"),
        ({"train": {"stesp": 3}}, r"unknown keys in 'train': \['stesp'\]"),
        ({"compression": {"schedule": "power", "d0": 2}}, r"needs key 'alpha'"),
        ({"model": {**MODEL, "context_length": 100000}}, r"context"),
    ],
)
def test_bad_configs_fail_before_training(tmp_path, cfg, match):
    with pytest.raises(ValueError, match=match):
        run_train(write(tmp_path, cfg), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_fit_resumes_bit_exactly(tmp_path):
    cfg = build_model_config({**load_train_config(write(tmp_path, {}))["model"], **MODEL})
    series, _ = default_series()
    wcfg = WindowConfig(context_length=32, horizon=8, stride=8)
    params = chronos_bolt.init(jax.random.PRNGKey(0), cfg)
    loss = chronos_bolt.loss(cfg)

    def sampler():
        return WindowSampler(series, wcfg, split="train", batch_size=8, seed=0, skip_short=True)

    straight, _ = fit(loss, params, sampler(), steps=6, key=jax.random.PRNGKey(1), progress=False)
    straight = full_params(straight)

    class Stop(Exception):
        pass

    def stop_at_5(p):
        raise Stop

    ck = Checkpointer(tmp_path / "ck", max_to_keep=2)
    with pytest.raises(Stop):
        fit(loss, params, sampler(), steps=6, key=jax.random.PRNGKey(1), checkpointer=ck,
            checkpoint_every=2, eval_fn=stop_at_5, eval_every=5, progress=False)
    ck.wait_until_finished()
    assert ck.latest_step() == 4
    resumed, hist = fit(loss, params, sampler(), steps=6, key=jax.random.PRNGKey(1),
                        checkpointer=Checkpointer(tmp_path / "ck", max_to_keep=2),
                        checkpoint_every=2, progress=False)
    resumed = full_params(resumed)
    assert [h["step"] for h in hist] == [5, 6]
    for (pa, a), (pb, b) in zip(lj.named_leaves(straight), lj.named_leaves(resumed), strict=True):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(lj.materialize(a)), np.asarray(lj.materialize(b)))


def test_cli_train_subcommand(tmp_path, capsys):
    from lowrank_jax.cli.main import main

    cfg = write(tmp_path, {"model": MODEL, "compression": {"rank": 3},
                           "train": {"steps": 2, "batch_size": 8, "eval_every": 2,
                                     "checkpoint_every": 2}})
    assert main(["train", cfg, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "rank 3" in capsys.readouterr().out
    _, params = load_model(tmp_path / "run" / "model")
    ranks = {leaf.rank for path, leaf in lj.named_leaves(params) if isinstance(leaf, lj.LowRank)}
    assert ranks == {3}
    assert main(["train", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "missing.json" in capsys.readouterr().err
