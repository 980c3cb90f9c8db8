"""A real two-process run: ``jax.distributed`` on CPU with gloo collectives.

Two local processes (``distributed_worker.py``) train a small model data parallel, one device
each, every process feeding its half of each global batch; they checkpoint, and a second
``fit`` resumes from the checkpoint across both processes. Here, in one process, the final
checkpoint is restored and compared with a single-process run of the same steps on the same
global batches: equal to 1e-6 (float reduction order differs), as are both processes' copies
of the parameters and the losses in the log process 0 wrote. The two processes then run
``lowrank-jax train --distributed`` on a tiny Chronos-Bolt config; its last checkpoint equals a
single-process run of the same config to 1e-6, and a single-process rerun writes its model.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax.io import load_model
from lowrank_jax.leaves import init_dense, init_lowrank, linear, path_str
from lowrank_jax.models import chronos_bolt
from lowrank_jax.recipes.train import run_train
from lowrank_jax.train import (
    Checkpointer,
    WindowConfig,
    WindowSampler,
    default_optimizer,
    fit,
    full_params,
    init_train_state,
)

LEARNING_RATE = 1e-2


def sampler():
    t = np.arange(400, dtype=np.float64)
    series = [np.sin(t / 9.0) * 3 + 5 + 0.1 * np.cos(t), np.cos(t / 5.0) + 2]
    return WindowSampler(series, WindowConfig(16, 4, stride=3), batch_size=16, seed=1)


def optimizer():
    return optax.adam(LEARNING_RATE)


def model():
    k0, k1 = jax.random.split(jax.random.key(1))
    params = {"enc": init_lowrank(k0, 16, 64, 8), "head": init_dense(k1, 64, 4, bias=True)}

    def loss_fn(params, batch, key):
        del key
        pred = linear(params["head"], jnp.tanh(linear(params["enc"], batch["context"])))
        return jnp.mean(jnp.square(pred - batch["target"])), {}

    return params, loss_fn


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flat(tree):
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _train_config(tmp_path):
    rows = ["date,a,b"] + [f"2020-01-{1 + i // 24:02d} {i % 24:02d}:00:00,{5 + np.sin(i / 7):.6f},"
                           f"{3 + np.cos(i / 4):.6f}" for i in range(240)]
    (tmp_path / "series.csv").write_text("\n".join(rows) + "\n")
    cfg = {"model": {"d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 1,
                     "num_decoder_layers": 1, "num_heads": 2, "context_length": 16,
                     "prediction_length": 4, "patch_size": 4},
           "data": {"csv": str(tmp_path / "series.csv"), "stride": 4},
           "train": {"steps": 2, "batch_size": 8, "eval_every": 0, "checkpoint_every": 2}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    return str(tmp_path / "cfg.json")


def test_two_processes_train_checkpoint_and_match_one(tmp_path):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0",
               PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    port, config = _free_port(), _train_config(tmp_path)
    procs = [subprocess.Popen([sys.executable, worker, str(i), "2", str(port), str(tmp_path),
                               config], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    # meanwhile, the same 4 steps in one process, and the same train command
    params, loss_fn = model()
    single, history = fit(loss_fn, params, sampler(), steps=4, key=jax.random.key(7),
                          optimizer=optimizer(), progress=False)
    one = run_train(config, str(tmp_path / "one"), progress=False)
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"process {i}: done" in out, out[-3000:]

    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.all_steps() == [2, 4]
    like = jax.eval_shape(lambda: init_train_state(params, optimizer(), key=jax.random.key(7)))
    restored = ck.restore(like=like)
    assert int(restored.step) == 4 and int(restored.data_position) == 4
    want = _flat(full_params(single))
    got = _flat(full_params(restored))
    assert sorted(got) == sorted(want)
    moved = max(float(np.abs(got[k] - _flat(params)[k]).max()) for k in want)
    assert moved > 1e-3  # training changed the parameters
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    for i in range(2):  # each process held the same parameters
        with np.load(tmp_path / f"final_{i}.npz") as f:
            assert sorted(f.files) == sorted(want)
            for k in want:
                np.testing.assert_array_equal(f[k], got[k])
    log = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in log], [h["loss"] for h in history],
                               rtol=1e-6)

    # lowrank-jax train --distributed: process 0 wrote the run's files, all wrote checkpoints
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl", "run.json",
                                       "summary.json"]
    two = json.loads((run / "summary.json").read_text())
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-6)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2]
    cfg, want_model = load_model(tmp_path / "one" / "model")
    like = jax.eval_shape(lambda: init_train_state(  # the state `lowrank-jax train` checkpoints
        chronos_bolt.init(jax.random.PRNGKey(0), cfg),
        default_optimizer(1e-3, total_steps=2, warmup_steps=1), key=jax.random.PRNGKey(0)))
    state = Checkpointer(run / "checkpoints").restore(like=like)
    got, want = _flat(full_params(state)), _flat(want_model)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
    # one process writes the model from the final checkpoint, training nothing
    assert run_train(config, str(run), progress=False) == two
    _, model2 = load_model(run / "model")
    for k, v in _flat(model2).items():
        np.testing.assert_array_equal(v, got[k])
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
