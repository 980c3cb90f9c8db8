"""Train steps on 8 simulated CPU devices (``tests/conftest.py``): sharded, FSDP, tensor-parallel
(placement decided by the leaves) and pmap steps equal single-device steps, no retracing,
donation, frozen parts untouched, bf16 compute, and a low-rank / masked-binary Chronos-Bolt that
learns on a real series (aeon's airline). Stateful steps (BatchNorm) are in test_stateful.py."""

import math
import re
from contextlib import nullcontext

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lowrank_jax.datasets import builtin_series
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import (
    HeadLowRank,
    LowRank,
    MaskedBinary,
    init_dense,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    is_leaf,
    linear,
    map_with_path,
    named_leaves,
    partition_specs,
    path_str,
)
from lowrank_jax.models import chronos_bolt, family_of
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.train import (
    PmapTrainStep,
    TrainState,
    TrainStep,
    default_optimizer,
    full_params,
    init_train_state,
    make_pmap_train_step,
    make_train_step,
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


def _mesh_2x4():
    """Data parallel over 2, tensor parallel over 4."""
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


TP_RULES = {"out": "model"}  # column parallel: every projection's output features on 'model'


def _spec(x):
    """The PartitionSpec of an array (or a spec) without trailing ``None`` s."""
    spec = tuple(x.sharding.spec if isinstance(x, jax.Array) else x)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return P(*spec)


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
def runs(count_compiles):
    """5 steps of the same global batch: single device, data parallel, FSDP, pmap."""
    params = _mlp_params(jax.random.key(0))
    batch = _mlp_batch()
    mesh = _mesh()
    out = {"params0": params}
    mesh2 = _mesh_2x4()
    variants = {
        "single": lambda loss: make_train_step(loss, OPT),
        "sharded": lambda loss: make_train_step(loss, OPT, mesh=mesh),
        # threshold 256 shards l0.w [16,64], l1.u/v, l2.u, l3.w/s; the rest stays replicated
        "fsdp": lambda loss: make_train_step(loss, OPT, mesh=mesh, fsdp=True, fsdp_min_size=256),
        "pmap": lambda loss: make_pmap_train_step(loss, OPT),
        # batch over 'data' (2), output features over 'model' (4)
        "tp": lambda loss: make_train_step(loss, OPT, mesh=mesh2, axis_rules=TP_RULES),
        "tp_fsdp": lambda loss: make_train_step(loss, OPT, mesh=mesh2, axis_rules=TP_RULES,
                                                fsdp=True, fsdp_min_size=256),
    }
    for name, make in variants.items():
        counter = [0]
        step = make(_make_mlp_loss(counter))
        state = init_train_state(params, OPT, key=jax.random.key(1))
        if name == "pmap":
            state = replicate_for_pmap(state)
        counting = nullcontext() if name == "pmap" else count_compiles(step.jitted)
        with counting as compiled:
            state, metrics, inputs = _run(step, state, batch)
        out[name] = {"state": unreplicate(state) if name == "pmap" else state,
                     "metrics": metrics, "traces": counter[0], "step": step,
                     "compiled": None if compiled is None else compiled.count,
                     "second_input": inputs[1]}
    return out


def _max_diff(a, b):
    diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)
    return max(jax.tree.leaves(diffs))


PARALLEL = ["sharded", "fsdp", "pmap", "tp", "tp_fsdp"]
ALL = ["single", *PARALLEL]


@pytest.mark.parametrize("variant", PARALLEL)
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
    assert _spec(state.params["l0"].w) == split  # 1024 values, 16 % 8 == 0
    assert _spec(state.params["l2"].u) == split  # [64, 4, 4]
    assert _spec(state.frozen["l3"].w) == split  # frozen arrays are sharded too
    assert _spec(state.params["l0"].b) == rep  # 64 < 256
    assert _spec(state.params["scale"]) == rep
    adam = state.opt_state.inner_state[0]  # inject_hyperparams(adamw): (ScaleByAdamState, ...)
    for moments in (adam.mu, adam.nu):
        assert _spec(moments["l0"].w) == split
        assert _spec(moments["l1"].v) == split
        assert _spec(moments["l0"].b) == rep
    # each device holds 1/8 of a sharded parameter
    assert state.params["l0"].w.addressable_shards[0].data.shape == (2, 64)
    sharded = runs["sharded"]["state"]
    assert _spec(sharded.params["l0"].w) == rep  # plain data parallel: replicated


# Placement that {'out': 'model'} gives each array of the small tree, read off the leaves'
# logical axes (Dense w ('in', 'out'), LowRank u ('in', 'rank') / v ('rank', 'out'), HeadLowRank
# u ('in', 'heads', 'rank') / v ('heads', 'rank', 'head_dim') / b ('out',), MaskedBinary w, s
# ('in', 'out')); plain arrays have no names and stay replicated.
TP_SPECS = {
    "l0/w": P(None, "model"), "l0/b": P("model"),
    "l1/u": P(), "l1/v": P(None, "model"),
    "l2/u": P(), "l2/v": P(), "l2/b": P("model"),
    "l3/s": P(None, "model"), "l3/b": P("model"),
    "scale": P(),
}
# ... plus FSDP over 'data' (2) for arrays of >= 256 entries, on their first free dimension.
TP_FSDP_SPECS = {**TP_SPECS, "l0/w": P("data", "model"), "l1/u": P("data"),
                 "l1/v": P("data", "model"), "l2/u": P("data"), "l2/v": P("data"),
                 "l3/s": P("data", "model")}


def _specs_by_path(tree):
    """``{path: spec}`` of a tree of arrays, of ``PartitionSpec`` s or of shardings."""
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, (P, jax.sharding.Sharding)))[0]
    return {path_str(kp): _spec(x.spec if isinstance(x, jax.sharding.Sharding) else x)
            for kp, x in flat}


@pytest.mark.parametrize("variant, want", [("tp", TP_SPECS), ("tp_fsdp", TP_FSDP_SPECS)])
def test_tensor_parallel_placement_comes_from_the_leaves(runs, variant, want):
    state = runs[variant]["state"]
    adam = state.opt_state.inner_state[0]
    # the parameters, and Adam's moments (the parameters' structure, leaf dataclasses
    # included), lie as the leaves say
    for tree in (state.params, adam.mu, adam.nu):
        assert _specs_by_path(tree) == want
    assert _spec(state.frozen["l3"].w) == want["l3/s"]  # the frozen random weights too
    assert _spec(state.step) == P() and _spec(state.data_position) == P()
    # what the step reports and what partition_specs computes from the leaves alone agree
    fsdp = variant == "tp_fsdp"
    specs = partition_specs(runs["params0"], _mesh_2x4(), TP_RULES,
                            fsdp_axis="data" if fsdp else None, fsdp_min_size=256)
    assert _specs_by_path(specs) == {**want, "l3/w": want["l3/s"]}
    assert _specs_by_path(runs[variant]["step"].state_shardings(state).params) == want
    # each device stores a quarter of l0.w's columns (and half of its rows under FSDP)
    shard = state.params["l0"].w.addressable_shards[0].data.shape
    assert shard == ((8, 16) if fsdp else (16, 16))


@pytest.mark.parametrize("variant", ALL)
def test_step_traces_once(runs, variant):
    # the loss function's Python body runs once per trace: 5 calls, 1 trace
    assert runs[variant]["traces"] == 1, f"{variant} retraced over {N_STEPS} calls"
    if variant != "pmap":  # and compiled once: the outputs fed back match the inputs' placement
        assert runs[variant]["compiled"] == 1, f"{variant} compiled more than once"


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
    for variant in ALL:
        got = [m["noise"] for m in runs[variant]["metrics"]]
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=variant)
    assert len(set(np.round(want, 6))) == N_STEPS


def test_frozen_masked_binary_weights_bit_identical(runs):
    w0 = np.asarray(runs["params0"]["l3"].w)
    s0 = np.asarray(runs["params0"]["l3"].s)
    for variant in ALL:
        state = runs[variant]["state"]
        assert state.params["l3"].w is None  # kept out of the gradient and the optimizer
        np.testing.assert_array_equal(np.asarray(state.frozen["l3"].w), w0, err_msg=variant)
        assert np.abs(np.asarray(state.params["l3"].s) - s0).max() > 1e-3  # scores trained
        full = full_params(state)
        assert isinstance(full["l3"], MaskedBinary) and full["l3"].keep == 0.5
        np.testing.assert_array_equal(np.asarray(full["l3"].w), w0)


def test_donated_inputs_are_consumed_and_caller_params_survive(runs):
    # the output of step 1 went into step 2 as is (no copy) and its buffers were donated
    for variant in ("single", "sharded", "fsdp", "tp", "tp_fsdp"):
        second = runs[variant]["second_input"]
        assert second.params["l1"].u.is_deleted(), variant
        assert second.opt_state.inner_state[0].mu["l1"].u.is_deleted(), variant
        assert not second.rng.is_deleted()  # the key is not donated
    second = runs["pmap"]["second_input"]
    assert isinstance(second, TrainState)  # a plain TrainState with stacked arrays
    assert second.params["l1"].u.is_deleted()
    assert second.opt_state.inner_state[0].mu["l1"].u.is_deleted()
    # init_train_state copies: the caller's tree is still usable
    assert not runs["params0"]["l1"].u.is_deleted()


def test_batch_not_divisible_rejected_before_compile(count_compiles):
    counter = [0]
    loss = _make_mlp_loss(counter)
    mesh = _mesh()
    state = init_train_state(_mlp_params(jax.random.key(0)), OPT, key=KEY)
    bad = _mlp_batch(n=12)
    step = make_train_step(loss, OPT, mesh=mesh)
    with count_compiles(step.jitted) as compiled, \
            pytest.raises(ValueError, match=r"batch size 12 .*8 devices"):
        step(state, bad, KEY)
    pstep = make_pmap_train_step(loss, OPT)
    with pytest.raises(ValueError, match=r"batch size 12 .*8 "):
        pstep(replicate_for_pmap(state), bad, KEY)
    with pytest.raises(ValueError, match=r"batch size 12"):
        shard_batch(bad, mesh)
    assert counter[0] == 0  # nothing was traced, so nothing compiled
    assert compiled.count == 0
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
    with pytest.raises(ConfigError, match="'model' is not an axis"):
        make_train_step(loss, OPT, mesh=_mesh(), batch_axis="model")
    with pytest.raises(ConfigError, match="needs a mesh"):
        make_train_step(loss, OPT, fsdp=True)
    with pytest.raises(ConfigError, match="need a mesh"):
        make_train_step(loss, OPT, axis_rules=TP_RULES)
    # a rule naming an axis the mesh does not have fails when the step is made
    with pytest.raises(ConfigError, match="'out' maps to mesh axis 'model'.*axes \\('data',\\)"):
        make_train_step(loss, OPT, mesh=_mesh(), axis_rules=TP_RULES)
    with pytest.raises(ConfigError, match="float dtype"):
        make_train_step(loss, OPT, compute_dtype=jnp.int32)
    with pytest.raises(ConfigError, match="optax"):
        make_train_step(loss, object())
    with pytest.raises(ConfigError, match="TrainState"):
        make_train_step(loss, OPT)({"w": 1}, _mlp_batch(), KEY)
    with pytest.raises(ConfigError, match="warmup_steps"):
        default_optimizer(total_steps=10, warmup_steps=10)
    # a loss that breaks its contract is named when the step is traced
    state = init_train_state(_mlp_params(jax.random.key(0)), OPT, key=KEY)
    with pytest.raises(ConfigError, match=r"must return \(loss, aux\)"):
        make_train_step(lambda p, b, k: 0.0, OPT)(state, _mlp_batch(), KEY)
    with pytest.raises(ShapeError, match="scalar loss"):
        make_train_step(lambda p, b, k: (jnp.zeros(2), {}), OPT)(state, _mlp_batch(), KEY)


def test_steps_are_small_objects_not_functions_with_attributes(runs):
    step = runs["fsdp"]["step"]
    assert isinstance(step, TrainStep) and step.fsdp and step.mesh.axis_names == ("data",)
    assert runs["fsdp"]["compiled"] == 1  # one compilation for five calls
    assert make_train_step(_make_mlp_loss([0]), OPT).state_shardings(runs["params0"]) is None
    pstep = runs["pmap"]["step"]
    assert isinstance(pstep, PmapTrainStep) and len(pstep.devices) == N_DEV


def test_replicate_for_pmap_keeps_the_train_state_type():
    state = init_train_state(_mlp_params(jax.random.key(0)), OPT, key=KEY)
    rep = replicate_for_pmap(state)
    # no wrapper: the leaf dataclasses hold the stacked arrays directly
    assert isinstance(rep, TrainState) and isinstance(rep.params["l1"], LowRank)
    assert rep.params["l0"].w.shape == (N_DEV, 16, 64)
    assert rep.opt_state.inner_state[0].mu["l2"].u.shape == (N_DEV, 64, 4, 4)
    assert rep.frozen["l3"].keep == 0.5 and rep.frozen["l3"].w.shape == (N_DEV, 64, 8)
    assert len(rep.params["l0"].w.sharding.device_set) == N_DEV  # one copy per device
    back = unreplicate(rep)
    np.testing.assert_array_equal(np.asarray(back.params["l0"].w),
                                  np.asarray(state.params["l0"].w))
    with pytest.raises(ShapeError, match="leading axis of 8 devices"):
        make_pmap_train_step(_make_mlp_loss([0]), OPT)(state, _mlp_batch(), KEY)


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
        if not is_leaf(node):  # norm scales, embeddings, bias tables
            return node
        d_in, d_out = node.shape
        if re.search(r"attn/(qk/q|qk/k|v)$", path):
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




def test_compressed_chronos_bolt_learns_airline_and_keeps_frozen_weights():
    params = _compressed_bolt()
    kinds = {type(n).__name__ for _, n in named_leaves(params)}
    assert {"HeadLowRank", "LowRank", "MaskedBinary", "Dense"} <= kinds
    q = params["encoder"]["layers"][0]["attn"]["qk"].q
    assert isinstance(q, HeadLowRank)
    assert isinstance(params["decoder"]["layers"][0]["mlp"]["wi"], LowRank)
    batch = _airline_windows()
    steps = 25
    opt = default_optimizer(learning_rate=1e-2, total_steps=steps, warmup_steps=3)
    # the family's loss: Chronos-Bolt's quantile loss on the instance-normalized scale
    loss = family_of(BOLT).loss(BOLT)
    step = make_train_step(loss, opt, mesh=_mesh())  # data parallel over 8 devices
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
    got_q = full_params(state)["encoder"]["layers"][0]["attn"]["qk"].q
    assert float(jnp.max(jnp.abs(got_q.u - q.u))) > 1e-4  # per-head factors trained
