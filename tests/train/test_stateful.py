"""Model state beside the parameters through the train step: a tiny model with BatchNorm
(``lowrank_jax.nn.apply_batch_norm``) whose running statistics change every step. The running
statistics are checked against a NumPy reference; sharded steps equal single-device steps; the
pmap step averages the per-device statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import init_dense, linear, materialize
from lowrank_jax.nn import BatchNormConfig, apply_batch_norm, init_batch_norm
from lowrank_jax.train import (
    TrainState,
    full_params,
    init_train_state,
    make_pmap_train_step,
    make_train_step,
    replicate_for_pmap,
    unreplicate,
)

N_DEV = 8
TOL = 1e-5
BN = BatchNormConfig(momentum=0.1)
OPT = optax.adam(1e-2)
KEY = jax.random.key(3)


def bn_model():
    """``(params, model_state)`` of x -> Dense(16, 32) -> BatchNorm -> relu -> Dense(32, 8).

    The first Dense has no bias, as usual before a BatchNorm: the normalization removes it, so
    its gradient is rounding noise that Adam would blow up to steps of the learning rate.
    """
    k0, k1 = jax.random.split(jax.random.key(0))
    bn_params, bn_state = init_batch_norm(32)
    params = {"l0": init_dense(k0, 16, 32), "bn": bn_params,
              "l1": init_dense(k1, 32, 8)}
    return params, {"bn": bn_state}


def make_bn_loss(counter=None):
    def loss_fn(params, model_state, batch, key):
        del key
        if counter is not None:
            counter[0] += 1  # runs once per trace
        h = linear(params["l0"], batch["x"])  # [b, 32]
        h, bn = apply_batch_norm(params["bn"], h, BN, state=model_state["bn"], train=True)
        y = linear(params["l1"], jax.nn.relu(h))  # [b, 8]
        return jnp.mean(jnp.square(y - batch["y"])), {}, {"bn": bn}

    return loss_fn


def bn_batch(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 16)).astype(np.float32),
            "y": rng.normal(size=(n, 8)).astype(np.float32)}


def reference_running_stats(w, x, old, momentum):
    """PyTorch's BatchNorm1d update in float64 for ``h = x @ w``: biased statistics normalize,
    the running variance takes the unbiased one."""
    h = x.astype(np.float64) @ w.astype(np.float64)
    mean, var = h.mean(axis=0), h.var(axis=0, ddof=1)
    return {"mean": (1 - momentum) * old["mean"] + momentum * mean,
            "var": (1 - momentum) * old["var"] + momentum * var}


def _host(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


def _run(step, state, n=3, record=None):
    for i in range(n):
        if record is not None:  # copies taken before the step donates the state's buffers
            p = full_params(state)
            record.append((np.asarray(materialize(p["l0"])), _host(state.model_state["bn"])))
        state, _ = step(state, bn_batch(seed=i), KEY)
    return state


@pytest.fixture(scope="module")
def single(count_compiles):
    counter, record = [0], []
    params, ms = bn_model()
    step = make_train_step(make_bn_loss(counter), OPT, stateful=True)
    state = init_train_state(params, OPT, key=KEY, model_state=ms)
    with count_compiles(step.jitted) as compiled:
        state = _run(step, state, record=record)
    return {"state": state, "record": record, "traces": counter[0], "step": step,
            "compiled": compiled.count}


def test_running_statistics_follow_batch_norm(single):
    record, state = single["record"], single["state"]
    assert isinstance(state, TrainState) and int(state.step) == 3
    # step i's statistics come from the parameters *before* step i and batch i
    for i, (w, old) in enumerate(record):
        want = reference_running_stats(w, bn_batch(seed=i)["x"], old, BN.momentum)
        got = record[i + 1][1] if i + 1 < len(record) else _host(state.model_state["bn"])
        for name in ("mean", "var"):
            np.testing.assert_allclose(got[name], want[name], atol=TOL, rtol=0, err_msg=name)
    # the statistics moved away from their initial (0, 1), every step
    assert np.abs(record[1][1]["mean"]).max() > 1e-2
    assert np.abs(_host(state.model_state["bn"])["mean"] - record[2][1]["mean"]).max() > 1e-4
    # the state is not trained: it is neither in the parameters nor in the optimizer state
    assert set(state.params["bn"]) == {"scale", "bias"}
    assert set(state.opt_state[0].mu["bn"]) == {"scale", "bias"}
    assert {x.dtype for x in jax.tree.leaves(state.model_state)} == {jnp.dtype(jnp.float32)}


def test_stateful_step_traces_once(single):
    assert single["traces"] == 1
    assert single["compiled"] == 1


@pytest.mark.parametrize("variant", ["sharded", "fsdp"])
def test_sharded_stateful_steps_equal_single_device(single, variant):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    kw = {"fsdp": True, "fsdp_min_size": 32} if variant == "fsdp" else {}
    params, ms = bn_model()
    step = make_train_step(make_bn_loss(), OPT, stateful=True, mesh=mesh, **kw)
    state = _run(step, init_train_state(params, OPT, key=KEY, model_state=ms))
    ref = single["state"]
    # the jit step computes the statistics over the global batch, as on one device
    assert _max_diff(state.model_state, ref.model_state) <= TOL
    assert _max_diff(state.params, ref.params) <= TOL
    assert _max_diff(state.opt_state, ref.opt_state) <= TOL
    assert len(state.model_state["bn"]["mean"].sharding.device_set) == N_DEV
    if variant == "fsdp":  # the model state is placed like any array: 32 entries, split by 8
        assert state.model_state["bn"]["var"].addressable_shards[0].data.shape == (4,)


def test_pmap_averages_the_model_state_over_devices():
    params, ms = bn_model()
    step = make_pmap_train_step(make_bn_loss(), OPT, stateful=True)
    state = init_train_state(params, OPT, key=KEY, model_state=ms)
    w = np.asarray(materialize(params["l0"]))
    x = bn_batch(seed=0)["x"]
    new, _ = step(replicate_for_pmap(state), bn_batch(seed=0), KEY)
    # each device normalizes its own 4 rows; the running statistics are the mean of the
    # per-device updates
    per_device = [reference_running_stats(w, x[d * 4:(d + 1) * 4], _host(ms["bn"]),
                                          BN.momentum) for d in range(N_DEV)]
    got = _host(new.model_state["bn"])  # [devices, 32] each
    for name in ("mean", "var"):
        want = np.mean([p[name] for p in per_device], axis=0)
        for d in range(N_DEV):
            np.testing.assert_allclose(got[name][d], want, atol=TOL, rtol=0)
    # equal shards: the mean of the running means is the global-batch running mean
    global_ = reference_running_stats(w, x, _host(ms["bn"]), BN.momentum)
    np.testing.assert_allclose(unreplicate(got)["mean"], global_["mean"], atol=TOL, rtol=0)


def test_model_state_keeps_its_dtypes_under_bf16():
    params, ms = bn_model()

    def loss_bf16_state(p, s, batch, key):
        loss, aux, new = make_bn_loss()(p, s, batch, key)
        return loss, aux, jax.tree.map(lambda a: a.astype(jnp.bfloat16), new)

    step = make_train_step(loss_bf16_state, OPT, stateful=True, compute_dtype=jnp.bfloat16)
    state, _ = step(init_train_state(params, OPT, key=KEY, model_state=ms), bn_batch(), KEY)
    assert {x.dtype for x in jax.tree.leaves(state.model_state)} == {jnp.dtype(jnp.float32)}
    assert np.abs(np.asarray(state.model_state["bn"]["mean"])).max() > 1e-2


def test_stateful_contract_errors():
    params, ms = bn_model()
    stateful = make_train_step(make_bn_loss(), OPT, stateful=True)
    plain = init_train_state(params, OPT, key=KEY)
    with_state = init_train_state(params, OPT, key=KEY, model_state=ms)
    with pytest.raises(ConfigError, match="stateful=True but state.model_state is None"):
        stateful(plain, bn_batch(), KEY)
    stateless = make_train_step(lambda p, b, k: (jnp.mean(b["x"]), {}), OPT)
    with pytest.raises(ConfigError, match="without stateful=True"):
        stateless(with_state, bn_batch(), KEY)
    two = make_train_step(lambda p, s, b, k: (jnp.mean(b["x"]), {}), OPT, stateful=True)
    with pytest.raises(ConfigError, match=r"\(loss, aux, new_model_state\)"):
        two(init_train_state(params, OPT, key=KEY, model_state=ms), bn_batch(), KEY)
    wrong = make_train_step(lambda p, s, b, k: (jnp.mean(b["x"]), {}, s["bn"]), OPT,
                            stateful=True)
    with pytest.raises(ShapeError, match="structure"):
        wrong(init_train_state(params, OPT, key=KEY, model_state=ms), bn_batch(), KEY)
    with pytest.raises(ConfigError, match="stateful must be True or False"):
        make_train_step(make_bn_loss(), OPT, stateful="yes")
