"""The training loop and forecast evaluation: ``fit`` trains any loss on any deterministic batch
source (a model with BatchNorm state, a sharded step), resumes bit-exactly from checkpoints and
writes its log; ``evaluate_forecaster`` works for every forecasting family, its metrics checked
against NumPy formulas written out here."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import init_dense, init_lowrank, linear, materialize
from lowrank_jax.models import chronos, chronos_bolt
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.nn import BatchNormConfig, apply_batch_norm, init_batch_norm
from lowrank_jax.train import (
    Checkpointer,
    NonFiniteError,
    TrainState,
    WindowConfig,
    WindowSampler,
    evaluate_forecaster,
    fit,
    init_train_state,
)

KEY = jax.random.key(5)
BN = BatchNormConfig(momentum=0.2)


# -- any batches, any loss: a model with BatchNorm state -------------------------------------

class RandomRegression:
    """A batch source that is not a window sampler: batch ``p`` is drawn from seed ``p``."""

    position = 0

    def batch(self, position):
        rng = np.random.default_rng(position)
        return {"inputs": rng.normal(size=(16, 6)).astype(np.float32),
                "labels": rng.normal(size=(16, 3)).astype(np.float32), "id": position}


def to_batch(raw):
    return {"x": raw["inputs"], "y": raw["labels"]}


def bn_model():
    k0, k1 = jax.random.split(jax.random.key(0))
    bn_params, bn_state = init_batch_norm(12)
    return ({"l0": init_dense(k0, 6, 12), "bn": bn_params, "l1": init_dense(k1, 12, 3)},
            {"bn": bn_state})


def bn_loss(params, model_state, batch, key):
    del key
    h = linear(params["l0"], batch["x"])
    h, bn = apply_batch_norm(params["bn"], h, BN, state=model_state["bn"], train=True)
    y = linear(params["l1"], jax.nn.relu(h))
    return jnp.mean(jnp.square(y - batch["y"])), {}, {"bn": bn}


def bn_eval(params, model_state):
    return {"running_mean": float(jnp.mean(model_state["bn"]["mean"])),
            "w_norm": float(jnp.linalg.norm(materialize(params["l1"])))}


def _assert_states_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fit_is_generic_logs_and_resumes_bit_exactly_with_model_state(tmp_path):
    params, ms = bn_model()
    opt = optax.adam(1e-2)
    common = dict(steps=6, key=KEY, batch_fn=to_batch, model_state=ms, optimizer=opt,
                  progress=False)
    log = tmp_path / "log.jsonl"
    straight, hist = fit(bn_loss, params, RandomRegression(), eval_fn=bn_eval, eval_every=3,
                         log_path=str(log), **common)
    assert isinstance(straight, TrainState)
    assert (int(straight.step), int(straight.data_position)) == (6, 6)
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6]
    assert [sorted(k for k in h if k.startswith("eval_")) for h in (hist[2], hist[3])] == [
        ["eval_running_mean", "eval_w_norm"], []]
    assert [json.loads(line)["loss"] for line in log.read_text().splitlines()] == [
        h["loss"] for h in hist]
    assert np.abs(np.asarray(straight.model_state["bn"]["mean"])).max() > 1e-2  # it moved

    class Stop(Exception):
        pass

    def stop_at_5(p, s):
        raise Stop

    with pytest.raises(Stop):
        fit(bn_loss, params, RandomRegression(), checkpointer=Checkpointer(tmp_path / "ck"),
            checkpoint_every=2, eval_fn=stop_at_5, eval_every=5, **common)
    assert Checkpointer(tmp_path / "ck").latest_step() == 4
    resumed, hist = fit(bn_loss, params, RandomRegression(),
                        checkpointer=Checkpointer(tmp_path / "ck"), checkpoint_every=2, **common)
    assert [h["step"] for h in hist] == [5, 6]
    # parameters, optimizer state, BatchNorm statistics, step and data position: bit-exact
    _assert_states_equal(resumed, straight)
    assert Checkpointer(tmp_path / "ck").all_steps()[-1] == 6


def _window_sampler(batch_size=16):
    t = np.arange(400, dtype=np.float64)
    series = [np.sin(t / 9.0) * 3 + 5 + 0.1 * np.cos(t), np.cos(t / 5.0) + 2]
    return WindowSampler(series, WindowConfig(16, 4, stride=3), batch_size=batch_size, seed=1)


def _window_params():
    k0, k1 = jax.random.split(jax.random.key(1))
    return {"enc": init_lowrank(k0, 16, 64, 8), "head": init_dense(k1, 64, 4, bias=True)}


def window_loss(params, batch, key):
    del key
    pred = linear(params["head"], jnp.tanh(linear(params["enc"], batch["context"])))
    return jnp.mean(jnp.square(pred - batch["target"])), {}


def test_fit_on_a_mesh_resumes_onto_the_placement(tmp_path):
    """(Sharded steps equal single-device ones: test_step.py.)"""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt = optax.adam(1e-2)
    common = dict(steps=4, key=KEY, optimizer=opt, progress=False)
    sharded_kw = dict(mesh=mesh, axis_rules={"rank": "data"})
    sharded, hist = fit(window_loss, _window_params(), _window_sampler(), **sharded_kw, **common)
    assert hist[-1]["loss"] < hist[0]["loss"]
    # the default batch is the windows' context and target; the step placed the state as the
    # leaves say: LowRank u ('in', 'rank') and v ('rank', 'out') have their rank on 'data' by
    # the rule, the Dense head ('in', 'out') has no rule and stays replicated
    assert sharded.params["enc"].u.sharding.spec == P(None, "data")
    assert sharded.params["enc"].v.sharding.spec == P("data")
    assert sharded.params["head"].w.sharding.is_fully_replicated
    # a run interrupted after 2 steps resumes onto the same placement, bit-exactly
    fit(window_loss, _window_params(), _window_sampler(), checkpointer=Checkpointer(tmp_path),
        checkpoint_every=2, **sharded_kw, **dict(common, steps=2))
    resumed, hist = fit(window_loss, _window_params(), _window_sampler(),
                        checkpointer=Checkpointer(tmp_path), **sharded_kw, **common)
    assert [h["step"] for h in hist] == [3, 4]
    assert resumed.params["enc"].u.sharding.spec == P(None, "data")
    _assert_states_equal(resumed, sharded)


def test_fit_rejects_bad_options_before_compiling():
    with pytest.raises(ConfigError, match="steps must be an int >= 1"):
        fit(window_loss, _window_params(), _window_sampler(), steps=0, key=KEY, progress=False)
    with pytest.raises(ConfigError, match="batch_fn must be callable"):
        fit(window_loss, _window_params(), _window_sampler(), steps=1, key=KEY, batch_fn=3,
            progress=False)


# -- forecast evaluation for every forecasting family ----------------------------------------

def ref_wql(pred, target, levels):
    """GluonTS mean weighted quantile loss, by loops."""
    denom = np.abs(target).sum()
    out = []
    for k, q in enumerate(levels):
        total = 0.0
        for b in range(target.shape[0]):
            for t in range(target.shape[1]):
                d = target[b, t] - pred[b, k, t]
                total += 2 * max(q * d, (q - 1) * d)
        out.append(total / denom)
    return float(np.mean(out))


def ref_mase(point, target, context, season):
    scale = np.mean(np.abs(context[:, season:] - context[:, :-season]), axis=1)
    return float(np.mean(np.mean(np.abs(target - point), axis=1) / scale))


BOLT = chronos_bolt.ChronosBoltConfig(
    t5=T5Config(vocab_size=1, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4),
    context_length=16, prediction_length=6, input_patch_size=4, input_patch_stride=4)


def numpy_init(init, cfg, seed=0):
    """Parameters of ``init``'s structure drawn with NumPy (compiling the random initializers
    would cost more than the test)."""
    shapes = jax.eval_shape(lambda: init(jax.random.key(0), cfg))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), shapes)


def _val_windows(sampler):
    """Every window of the split once, in order, as the evaluation sees them."""
    n = sampler.batches_per_epoch
    batches = [sampler.batch(p) for p in range(n)]
    return {k: np.concatenate([b[k] for b in batches])[:sampler.num_windows]
            for k in ("context", "target")}


def test_evaluate_forecaster_chronos_bolt_matches_numpy_metrics():
    params = numpy_init(chronos_bolt.init, BOLT)
    sampler = WindowSampler([np.sin(np.arange(300) / 6.0) * 2 + 4], WindowConfig(16, 4),
                            split="val", batch_size=8)
    assert sampler.num_windows % sampler.batch_size  # the last batch wraps around
    got = evaluate_forecaster(BOLT, params, sampler, season=2)
    w = _val_windows(sampler)
    # the forecast of the whole split at once, cut to the sampler's horizon of 4 (of 6)
    apply = jax.jit(chronos_bolt.apply, static_argnums=2)
    q = np.asarray(apply(params, {"context": w["context"]}, BOLT)["quantile_preds"])
    q = q[:, :, :4].astype(np.float64)
    assert got["n_windows"] == sampler.num_windows == q.shape[0]
    assert got["wql"] == pytest.approx(ref_wql(q, w["target"], BOLT.quantiles), rel=1e-5)
    median = q[:, BOLT.quantiles.index(0.5)]
    assert got["mase"] == pytest.approx(ref_mase(median, w["target"], w["context"], 2), rel=1e-5)


CHRONOS = chronos.ChronosConfig(
    t5=T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2),
    n_tokens=32, context_length=16, prediction_length=2, num_samples=3)


def test_evaluate_forecaster_chronos_uses_sampled_quantiles():
    params = numpy_init(chronos.init, CHRONOS, seed=1)
    sampler = WindowSampler([np.cos(np.arange(200) / 4.0) + 3], WindowConfig(16, 2),
                            split="val", batch_size=8)
    got = evaluate_forecaster(CHRONOS, params, sampler, max_batches=1)
    # batch by batch, as the evaluation runs it (sampling depends on the batch): the family's
    # forecast at levels 0.1 .. 0.9 of the sampled paths, median = level 0.5
    b = sampler.batch(0)
    q = np.asarray(chronos.forecast(params, b["context"], CHRONOS), np.float64)
    levels = chronos.LEVELS
    assert q.shape == (8, 9, 2) and got["n_windows"] == 8
    assert got["wql"] == pytest.approx(ref_wql(q, b["target"], levels), rel=1e-4)
    assert got["mase"] == pytest.approx(
        ref_mase(q[:, levels.index(0.5)], b["target"], b["context"], 1), rel=1e-4)


def test_evaluate_forecaster_errors():
    sampler = WindowSampler([np.sin(np.arange(300) / 6.0) + 4], WindowConfig(16, 8),
                            split="val", batch_size=8)
    with pytest.raises(ConfigError, match="horizon 8 exceeds the model's prediction_length 6"):
        evaluate_forecaster(BOLT, numpy_init(chronos_bolt.init, BOLT), sampler)
    with pytest.raises(ConfigError, match="'t5' is not a forecaster"):
        evaluate_forecaster(BOLT.t5, {}, sampler)


# -- the log survives interruptions; a NaN stops training and nothing non-finite is saved -----

def _strict_records(path):
    """The log's records, parsed as strict JSON (NaN or Infinity raise)."""
    def refuse(name):
        raise ValueError(f"{name} in the log")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


class CrashAt(RandomRegression):
    """Dies when asked for batch ``crash`` (after the records of the steps before it)."""

    def __init__(self, crash):
        self.crash = crash

    def batch(self, position):
        if position == self.crash:
            raise KeyboardInterrupt
        return super().batch(position)


def test_log_is_cut_back_to_the_restored_step_on_resume(tmp_path):
    params, ms = bn_model()
    common = dict(steps=6, key=KEY, batch_fn=to_batch, model_state=ms, optimizer=optax.adam(1e-2),
                  eval_fn=bn_eval, eval_every=2, progress=False)
    fit(bn_loss, params, RandomRegression(), log_path=str(tmp_path / "straight.jsonl"), **common)
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    # interrupted after step 5 was logged; the newest checkpoint is step 4
    with pytest.raises(KeyboardInterrupt):
        fit(bn_loss, params, CrashAt(5), log_path=str(log), checkpointer=Checkpointer(ck),
            checkpoint_every=2, **common)
    assert [r["step"] for r in _strict_records(log)] == [1, 2, 3, 4, 5]
    with open(log, "a") as f:  # and a kill in the middle of writing step 6's record
        f.write('{"step": 6, "loss": 0.12')
    resumed, hist = fit(bn_loss, params, RandomRegression(), log_path=str(log),
                        checkpointer=Checkpointer(ck), checkpoint_every=2, **common)
    assert [h["step"] for h in hist] == [5, 6]

    def no_clock(records):
        return [{k: v for k, v in r.items() if k != "step_s"} for r in records]

    want = no_clock(_strict_records(tmp_path / "straight.jsonl"))
    assert no_clock(_strict_records(log)) == want  # no duplicate, no gap, no partial line
    assert [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in want if "eval_w_norm" in r] == [2, 4, 6]
    # a fresh run (nothing to resume) starts a fresh log
    fit(bn_loss, params, RandomRegression(), log_path=str(log), **dict(common, steps=2))
    assert [r["step"] for r in _strict_records(log)] == [1, 2]


class Poisoned(RandomRegression):
    """Batch ``at`` makes the step non-finite: inputs with inf (``'loss'``), or a finite loss
    whose gradient is NaN (``'grad'``)."""

    def __init__(self, at, how):
        self.at, self.how = at, how

    def batch(self, position):
        b = super().batch(position)
        b["gate"] = np.ones((16,), np.float32)
        if position == self.at and self.how == "loss":
            b["inputs"][3, 2] = np.inf
        if position == self.at and self.how == "grad":
            b["gate"][:] = 0.0
        return b


def gated_loss(params, batch, key):
    del key
    y = linear(params["l1"], jax.nn.relu(linear(params["l0"], batch["x"])))
    mse = jnp.mean(jnp.square(y - batch["y"]))
    # sqrt(0) has an infinite derivative: with the gate shut the loss is finite (mse) and the
    # gradient of the root is inf * 0 = NaN
    root = jnp.sqrt(jnp.mean(batch["gate"]) * jnp.sum(jnp.square(params["l1"].w)))
    return mse + 0.0 * root, {}


def gated_batch(raw):
    return {"x": raw["inputs"], "y": raw["labels"], "gate": raw["gate"]}


def _dense_model():
    k0, k1 = jax.random.split(jax.random.key(3))
    return {"l0": init_dense(k0, 6, 12), "l1": init_dense(k1, 12, 3)}


@pytest.mark.parametrize("how, lr, step, what", [
    ("loss", 1e-2, 3, "the loss is nan"),
    ("grad", 1e-2, 3, "the gradient norm is nan"),
    # float32(1e39) = inf: a finite loss and finite gradients make non-finite parameters
    (None, 1e39, 1, "'params/l0/w' of the state is not finite"),
])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_nonfinite_values_stop_training_and_are_never_saved(tmp_path, how, lr, step, what):
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    with pytest.raises(NonFiniteError, match=f"stopped at step {step}: {what}") as e:
        fit(gated_loss, _dense_model(), Poisoned(2, how), steps=6, key=KEY,
            batch_fn=gated_batch, optimizer=optax.sgd(lr), checkpointer=Checkpointer(ck),
            checkpoint_every=1, log_path=str(log), progress=False)
    assert e.value.where == f"step {step}" and "\n" not in str(e.value)
    checkpointer = Checkpointer(ck)
    assert checkpointer.all_steps() == list(range(1, step))
    if step > 1:
        assert f"the last good checkpoint, step {step - 1} in {ck}, is kept" in str(e.value)
    else:
        assert "no checkpoint was saved" in str(e.value)
    like = jax.eval_shape(lambda: init_train_state(_dense_model(), optax.sgd(lr), key=KEY))
    for s in checkpointer.all_steps():
        state = checkpointer.restore(s, like=like)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    # the log is valid JSON (no NaN) and holds the steps before the stop, the last one's
    # record included only if its loss was finite
    assert [r["step"] for r in _strict_records(log)] == list(range(1, step + (how is None)))
