"""Train steps on 8 simulated CPU devices (``tests/conftest.py``): sharded, FSDP and pmap steps
equal single-device steps, no retracing, donation, frozen parts untouched, bf16 compute, and a
low-rank / masked-binary Chronos-Bolt that learns on a real series (aeon's airline)."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lowrank_jax.datasets import builtin_series
from lowrank_jax.leaves import (
    Dense,
    HeadLowRank,
    LowRank,
    MaskedBinary,
    init_dense,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    linear,
    map_with_path,
    named_leaves,
)
from lowrank_jax.models import chronos_bolt
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.train import (
    Replicated,
    TrainState,
    default_optimizer,
    full_params,
    init_train_state,
    make_pmap_train_step,
    make_train_step,
    quantile_loss,
    replicate,
    replicate_for_pmap,
    shard_batch,
    unreplicate,
)

N_DEV = 8
N_STEPS = 5
TOL = 1e-5


def _mesh():
    assert jax.device_count() == N_DEV, "tests/conftest.py must set 8 host devices"
    return Mesh(np.array(jax.devices()), ("data",))


# -- a small tree with every leaf type -------------------------------------------------------

def _mlp_params(key):
    k = jax.random.split(key, 4)
    return {
        "l0": init_dense(k[0], 16, 64, bias=True),
        "l1": init_lowrank(k[1], 64, 64, 8),
        "l2": init_head_lowrank(k[2], 64, 4, 16, 4, bias=True),
        "l3": init_masked_binary(k[3], 64, 8, 0.5, bias=True),
        "scale": jnp.ones((64,), jnp.float32),
    }


def _make_mlp_loss(counter):
    def loss_fn(params, batch, key):
        counter[0] += 1  # Python side effect: runs once per trace
        h = jax.nn.relu(linear(params["l0"], batch["x"]))
        h = jax.nn.relu(linear(params["l1"], h)) * params["scale"]
        h = jnp.tanh(linear(params["l2"], h))
        y = linear(params["l3"], h)
        loss = jnp.mean(jnp.square(y - batch["y"]))
        return loss, {"noise": jax.random.uniform(key)}

    return loss_fn


def _mlp_batch(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 16)).astype(np.float32),
            "y": rng.normal(size=(n, 8)).astype(np.float32)}


OPT = default_optimizer(learning_rate=1e-2, total_steps=100, warmup_steps=2)
KEY = jax.random.key(7)


def _run(step, state, batch, n=N_STEPS):
    metrics, inputs = [], []
    for _ in range(n):
        inputs.append(state)
        state, m = step(state, batch, KEY)
        metrics.append(jax.tree.map(float, m))
    return state, metrics, inputs


@pytest.fixture(scope="module")
def runs():
    """5 steps of the same global batch: single device, data parallel, FSDP, pmap."""
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch()
    mesh = _mesh()
    out = {"params0": params}
    variants = {
        "single": lambda loss: make_train_step(loss, OPT),
        "sharded": lambda loss: make_train_step(loss, OPT, mesh=mesh),
        # threshold 256 shards l0.w [16,64], l1.u/v, l2.u, l3.w/s; the rest stays replicated
        "fsdp": lambda loss: make_train_step(loss, OPT, mesh=mesh, fsdp=True, fsdp_min_size=256),
        "pmap": lambda loss: make_pmap_train_step(loss, OPT),
    }
    for name, make in variants.items():
        counter = [0]
        step = make(_make_mlp_loss(counter))
        state = init_train_state(params, OPT, key=jax.random.key(1))
        if name == "pmap":
            state = replicate_for_pmap(state)
        state, metrics, inputs = _run(step, state, batch)
        out[name] = {"state": unreplicate(state) if name == "pmap" else state,
                     "metrics": metrics, "traces": counter[0], "step": step,
                     "second_input": inputs[1]}
    return out


def _max_diff(a, b):
    diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)
    return max(jax.tree.leaves(diffs))


@pytest.mark.parametrize("variant", ["sharded", "fsdp", "pmap"])
def test_parallel_steps_equal_single_device(runs, variant):
    ref, got = runs["single"]["state"], runs[variant]["state"]
    assert int(got.step) == N_STEPS
    assert _max_diff(ref.params, got.params) <= TOL
    assert _max_diff(ref.opt_state, got.opt_state) <= TOL
    np.testing.assert_allclose([m["loss"] for m in runs[variant]["metrics"]],
                               [m["loss"] for m in runs["single"]["metrics"]], rtol=1e-6)
    # the parameters did move: the comparison is not between two untouched trees
    assert _max_diff(runs["params0"]["l0"].w, got.params["l0"].w) > 1e-3


def test_fsdp_shards_large_params_and_their_moments(runs):
    state = runs["fsdp"]["state"]
    split, rep = P("data"), P()
    assert state.params["l0"].w.sharding.spec == split  # 1024 values, 16 % 8 == 0
    assert state.params["l2"].u.sharding.spec == split  # [64, 4, 4]
    assert state.frozen["l3"].w.sharding.spec == split  # frozen arrays are sharded too
    assert state.params["l0"].b.sharding.spec == rep  # 64 < 256
    assert state.params["scale"].sharding.spec == rep
    adam = state.opt_state.inner_state[0]  # inject_hyperparams(adamw): (ScaleByAdamState, ...)
    for moments in (adam.mu, adam.nu):
        assert moments["l0"].w.sharding.spec == split
        assert moments["l1"].v.sharding.spec == split
        assert moments["l0"].b.sharding.spec == rep
    # each device holds 1/8 of a sharded parameter
    assert state.params["l0"].w.addressable_shards[0].data.shape == (2, 64)
    sharded = runs["sharded"]["state"]
    assert sharded.params["l0"].w.sharding.spec == rep  # plain data parallel: replicated


@pytest.mark.parametrize("variant", ["single", "sharded", "fsdp", "pmap"])
def test_step_traces_once(runs, variant):
    # the loss function's Python body runs once per trace: 5 calls, 1 trace
    assert runs[variant]["traces"] == 1, f"{variant} retraced over {N_STEPS} calls"


def test_chex_max_traces_and_second_call():
    counter = [0]
    loss = chex.assert_max_traces(_make_mlp_loss(counter), n=1)
    step = make_train_step(loss, optax.sgd(1e-2), mesh=_mesh())
    state = init_train_state(_mlp_params(jax.random.key(3)), optax.sgd(1e-2), key=KEY)
    batch = _mlp_batch()
    state, _ = step(state, batch, KEY)
    state, _ = step(state, batch, KEY)  # a retrace would raise AssertionError from chex
    state, _ = step(state, _mlp_batch(seed=1), jax.random.key(9))  # new data, same shapes
    # the state's own key as the step key: not donated, so no buffer is donated twice
    state, _ = step(state, batch, state.rng)
    state, _ = step(state, batch)  # key=None falls back to state.rng
    assert counter[0] == 1
    assert int(state.step) == 5


def test_key_is_folded_with_the_step_number(runs):
    # aux 'noise' = uniform(fold_in(key, step)): differs per step, reproducible, same for all
    want = [float(jax.random.uniform(jax.random.fold_in(KEY, i))) for i in range(N_STEPS)]
    for variant in ("single", "sharded", "fsdp", "pmap"):
        got = [m["noise"] for m in runs[variant]["metrics"]]
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=variant)
    assert len(set(np.round(want, 6))) == N_STEPS


def test_frozen_masked_binary_weights_bit_identical(runs):
    w0 = np.asarray(runs["params0"]["l3"].w)
    s0 = np.asarray(runs["params0"]["l3"].s)
    for variant in ("single", "sharded", "fsdp", "pmap"):
        state = runs[variant]["state"]
        assert state.params["l3"].w is None  # kept out of the gradient and the optimizer
        np.testing.assert_array_equal(np.asarray(state.frozen["l3"].w), w0, err_msg=variant)
        assert np.abs(np.asarray(state.params["l3"].s) - s0).max() > 1e-3  # scores trained
        full = full_params(state)
        assert isinstance(full["l3"], MaskedBinary) and full["l3"].keep == 0.5
        np.testing.assert_array_equal(np.asarray(full["l3"].w), w0)


def test_donated_inputs_are_consumed_and_caller_params_survive(runs):
    # the output of step 1 went into step 2 as is (no copy) and its buffers were donated
    for variant in ("single", "sharded", "fsdp"):
        second = runs[variant]["second_input"]
        assert second.params["l1"].u.is_deleted(), variant
        assert second.opt_state.inner_state[0].mu["l1"].u.is_deleted(), variant
        assert not second.rng.is_deleted()  # the key is not donated
    second = runs["pmap"]["second_input"]
    assert isinstance(second, Replicated)
    assert all(x.is_deleted() for x in second.arrays if x.ndim >= 3)  # stacked weight arrays
    # init_train_state copies: the caller's tree is still usable
    assert not runs["params0"]["l1"].u.is_deleted()


def test_batch_not_divisible_rejected_before_compile():
    counter = [0]
    loss = _make_mlp_loss(counter)
    mesh = _mesh()
    state = init_train_state(_mlp_params(jax.random.key(0)), OPT, key=KEY)
    bad = _mlp_batch(n=12)
    step = make_train_step(loss, OPT, mesh=mesh)
    with pytest.raises(ValueError, match=r"batch size 12 .*8 devices"):
        step(state, bad, KEY)
    pstep = make_pmap_train_step(loss, OPT)
    with pytest.raises(ValueError, match=r"batch size 12 .*8 "):
        pstep(replicate_for_pmap(state), bad, KEY)
    with pytest.raises(ValueError, match=r"batch size 12"):
        shard_batch(bad, mesh)
    assert counter[0] == 0  # nothing was traced, so nothing compiled
    assert step.jitted._cache_size() == 0
    # arrays that disagree on the batch size
    with pytest.raises(ValueError, match="disagree"):
        step(state, {"x": np.zeros((16, 16), np.float32), "y": np.zeros((8, 8), np.float32)},
             KEY)
    assert counter[0] == 0


def test_shard_batch_splits_rows_and_replicate_copies():
    mesh = _mesh()
    batch = shard_batch(_mlp_batch(n=32), mesh)
    assert batch["x"].sharding.spec == P("data")
    assert [s.data.shape for s in batch["x"].addressable_shards] == [(4, 16)] * N_DEV
    rep = replicate({"w": np.arange(6.0).reshape(2, 3)}, mesh)
    assert rep["w"].sharding.is_fully_replicated and len(rep["w"].sharding.device_set) == N_DEV


def test_bad_configurations_are_clear():
    loss = _make_mlp_loss([0])
    with pytest.raises(ValueError, match="'model' is not an axis"):
        make_train_step(loss, OPT, mesh=_mesh(), batch_axis="model")
    with pytest.raises(ValueError, match="needs a mesh"):
        make_train_step(loss, OPT, fsdp=True)
    with pytest.raises(TypeError, match="float dtype"):
        make_train_step(loss, OPT, compute_dtype=jnp.int32)
    with pytest.raises(TypeError, match="optax"):
        make_train_step(loss, object())
    with pytest.raises(TypeError, match="TrainState"):
        make_train_step(loss, OPT)({"w": 1}, _mlp_batch(), KEY)
    with pytest.raises(ValueError, match="warmup_steps"):
        default_optimizer(total_steps=10, warmup_steps=10)


def test_default_optimizer_is_adamw_warmup_cosine():
    lr, total, warm = 1e-2, 20, 4
    opt = default_optimizer(lr, total, warm, weight_decay=0.1)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    state = opt.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)  # zero gradient: only weight decay moves w
    w, b = 1.0, 1.0
    for t in range(total):
        if t < warm:
            want = lr * t / warm
        else:
            want = lr * 0.5 * (1 + math.cos(math.pi * (t - warm) / (total - warm)))
        updates, state = opt.update(grads, state, params)
        assert float(state.hyperparams["learning_rate"]) == pytest.approx(want, abs=1e-9)
        params = optax.apply_updates(params, updates)
        w -= want * 0.1 * w  # decoupled decay on matrices
    np.testing.assert_allclose(np.asarray(params["w"]), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(params["b"]), b)  # no decay on vectors


def test_bf16_compute_keeps_float32_master_params():
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch()
    opt = optax.sgd(1e-2)
    f32 = make_train_step(_make_mlp_loss([0]), opt, mesh=_mesh())
    seen = {}

    def loss_bf16(p, b, k):
        seen["dtypes"] = {x.dtype for x in jax.tree.leaves(p)}
        # the step casts parameters only; inputs follow the parameters' dtype here, else
        # f32 inputs would promote every matmul back to f32
        b = {"x": b["x"].astype(p["l0"].w.dtype), "y": b["y"]}
        return _make_mlp_loss([0])(p, b, k)

    bf16 = make_train_step(loss_bf16, opt, mesh=_mesh(), compute_dtype=jnp.bfloat16)
    s32, m32 = f32(init_train_state(params, opt, key=KEY), batch, KEY)
    s16, m16 = bf16(init_train_state(params, opt, key=KEY), batch, KEY)
    assert seen["dtypes"] == {jnp.dtype(jnp.bfloat16)}  # the forward saw bf16 parameters
    assert {x.dtype for x in jax.tree.leaves(s16.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(s16.frozen)} == {jnp.dtype(jnp.float32)}
    # bf16 keeps 8 mantissa bits. Measured on this model: loss 1e-4 and grad norm 1.6e-3
    # relative to f32; the bounds are 10x looser, and equality would mean nothing was cast
    loss16, loss32 = float(m16["loss"]), float(m32["loss"])
    assert loss16 != loss32
    assert abs(loss16 - loss32) <= 1e-3 * loss32
    assert abs(float(m16["grad_norm"]) - float(m32["grad_norm"])) <= 2e-2 * float(
        m32["grad_norm"])
    # the update is an f32 update of f32 masters, close to the f32 step
    delta32 = s32.params["l0"].w - params["l0"].w
    delta16 = s16.params["l0"].w - params["l0"].w
    assert float(jnp.max(jnp.abs(delta16 - delta32))) <= 0.1 * float(jnp.max(jnp.abs(delta32)))


# -- a compressed Chronos-Bolt on a real series ------------------------------------------------

BOLT = chronos_bolt.ChronosBoltConfig(
    t5=T5Config(vocab_size=1, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                feed_forward_proj="relu"),
    context_length=48, prediction_length=12, input_patch_size=8, input_patch_stride=8)


def _compressed_bolt_structure(key):
    """Per-head low rank q/k/v, shared low rank o and MLPs, Biprop in the output block."""
    params = chronos_bolt.init(key, BOLT)
    t5 = BOLT.t5

    def rewrite(path, node):
        if not isinstance(node, Dense):
            return node
        d_in, d_out = node.shape
        if re.search(r"attn/(q|k|v)$", path):
            return init_head_lowrank(key, d_in, t5.num_heads, t5.d_kv, 4)
        if re.search(r"(attn/o|mlp/wi|mlp/wo)$", path):
            return init_lowrank(key, d_in, d_out, 8)
        if path == "output_patch_embedding/hidden_layer":
            return init_masked_binary(key, d_in, d_out, 0.5, bias=True)
        return node

    return map_with_path(rewrite, params)


def _compressed_bolt(seed=0):
    """Values drawn with NumPy on the structure above (its shapes come from ``eval_shape``):
    compiling the random initializers would cost more than the whole training run."""
    shapes = jax.eval_shape(_compressed_bolt_structure, jax.random.key(0))
    rng = np.random.default_rng(seed)

    def fill(path, x):
        name = str(path[-1])
        if "scale" in name:
            return np.ones(x.shape, np.float32)
        if len(x.shape) == 1:  # biases
            return np.zeros(x.shape, np.float32)
        std = 1.0 / np.sqrt(np.prod(x.shape[:-1]))
        return (std * rng.standard_normal(x.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def _airline_windows():
    series, source = builtin_series()
    assert "airline" in source, source  # aeon ships the airline passengers series
    y = np.asarray(series[0], np.float32)  # 144 monthly values
    ctx, h = BOLT.context_length, BOLT.prediction_length
    starts = np.arange(0, 80)  # 80 windows, divisible by 8 devices
    return {"context": np.stack([y[s:s + ctx] for s in starts]),
            "target": np.stack([y[s + ctx:s + ctx + h] for s in starts])}


def _bolt_loss(params, batch, key):
    del key
    out = chronos_bolt.apply(params, BOLT, context=batch["context"])
    loc, scale = out["loc_scale"]  # [b, 1] each
    # Chronos-Bolt's loss lives on the instance-normalized scale
    pred = (out["quantile_preds"] - loc[:, :, None]) / scale[:, :, None]
    target = (batch["target"] - loc) / scale
    return quantile_loss(pred, target, BOLT.quantiles), {}


def test_compressed_chronos_bolt_learns_airline_and_keeps_frozen_weights():
    params = _compressed_bolt()
    kinds = {type(n).__name__ for _, n in named_leaves(params)}
    assert {"HeadLowRank", "LowRank", "MaskedBinary", "Dense"} <= kinds
    q = params["encoder"]["layers"][0]["attn"]["q"]
    assert isinstance(q, HeadLowRank)
    assert isinstance(params["decoder"]["layers"][0]["mlp"]["wi"], LowRank)
    batch = _airline_windows()
    steps = 25
    opt = default_optimizer(learning_rate=1e-2, total_steps=steps, warmup_steps=3)
    step = make_train_step(_bolt_loss, opt, mesh=_mesh())  # data parallel over 8 devices
    state = init_train_state(params, opt, key=KEY)
    assert isinstance(state, TrainState)
    losses = []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    # metrics['loss'] is the loss before each update, on the same 80 windows every step
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert losses[-1] < min(losses[:5])
    mb0 = params["output_patch_embedding"]["hidden_layer"]
    mb = full_params(state)["output_patch_embedding"]["hidden_layer"]
    np.testing.assert_array_equal(np.asarray(mb.w), np.asarray(mb0.w))  # frozen: bit-identical
    assert float(jnp.max(jnp.abs(mb.s - mb0.s))) > 1e-4  # scores trained (straight-through)
    got_q = full_params(state)["encoder"]["layers"][0]["attn"]["q"]
    assert float(jnp.max(jnp.abs(got_q.u - q.u))) > 1e-4  # per-head factors trained
