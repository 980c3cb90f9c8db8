"""Train-state checkpoints: round trip, keep-N, exact resume (model state included), device
counts, damaged files; a step is a lowrank_jax.io checkpoint and an io checkpoint starts a run;
steps of the earlier CRC32 format and of lowrank_jax 0.1 (format version 1) still restore."""

import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from lowrank_jax import io as lio
from lowrank_jax.errors import (
    CheckpointError,
    ConfigError,
    LeafTypeError,
    MissingFileError,
    OutputExistsError,
)
from lowrank_jax.io import files
from lowrank_jax.leaves import (
    HeadLowRank,
    combine,
    init_dense,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    linear,
    path_str,
)
from lowrank_jax.train import default_optimizer, fit, full_params
from lowrank_jax.train.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    load_train_state,
)
from lowrank_jax.train.data import WindowConfig, WindowSampler
from lowrank_jax.train.state import TrainState, init_train_state

DATA = os.path.join(os.path.dirname(__file__), "data")

CTX, H = 16, 4


def _params(key, rank=3):
    k = jax.random.split(key, 4)
    return {
        "inp": init_lowrank(k[0], CTX, 8, rank, bias=True),
        "heads": init_head_lowrank(k[1], 8, 2, 4, 2),
        "bin": init_masked_binary(k[2], 8, 8, 0.5),
        "out": init_dense(k[3], 8, H),  # b is None
        "scale": jnp.ones((8,)),
    }


def _state(seed=0, rank=3):
    key = jax.random.key(seed)
    return init_train_state(_params(key, rank), optax.adam(1e-2), key=key)


def _assert_trees_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert type(x) is type(y)
        if jnp.issubdtype(getattr(x, "dtype", np.int64), jax.dtypes.prng_key):
            assert x.dtype == y.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.result_type(x) == np.result_type(y) and np.shape(x) == np.shape(y)
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_any_leaf_types_and_metadata(tmp_path):
    state = _state()
    state = state._replace(step=jnp.asarray(7, jnp.int32),
                           data_position=jnp.asarray(42, jnp.int32))
    ckpt = Checkpointer(tmp_path / "ck")
    assert ckpt.latest_step() is None
    assert ckpt.save(state, metadata={"note": "x"}, config={"lr": 0.01}) == 7
    like = jax.eval_shape(lambda: _state())
    fresh = Checkpointer(tmp_path / "ck")  # a new process sees what the old one wrote
    assert fresh.latest_step() == 7
    got = fresh.restore(like=like)
    assert isinstance(got, TrainState) and got.frozen["bin"].keep == 0.5
    _assert_trees_equal(got, state)
    assert got.frozen["out"].b is None and got.params["out"].b is None
    meta = fresh.metadata()
    assert (meta["step"], meta["data_position"]) == (7, 42)
    assert meta["metadata"] == {"note": "x"} and meta["config"] == {"lr": 0.01}
    with pytest.raises(OutputExistsError, match="step 7 already exists"):
        ckpt.save(state)


def test_keep_n_and_unfinished_save_is_not_a_step(tmp_path):
    state = _state()
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    for s in range(1, 6):
        ckpt.save(state._replace(step=jnp.asarray(s, jnp.int32)))
    assert ckpt.all_steps() == [4, 5]
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]
    # a save interrupted mid-way leaves only orbax's temporary directory: never "latest"
    tmp = tmp_path / "9.orbax-checkpoint-tmp-1234"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "junk").write_bytes(b"\0" * 10)
    assert Checkpointer(tmp_path, max_to_keep=2).latest_step() == 5


def _loss(params, batch):
    h = jnp.tanh(linear(params["inp"], batch["context"]))  # [b, 8]
    h = h + linear(params["bin"], h) * params["scale"]
    pred = linear(params["out"], h)  # [b, H]
    return jnp.mean((pred - batch["target"]) ** 2)


@jax.jit
def _train_step(state, batch):
    opt = optax.adam(1e-2)
    key = jax.random.fold_in(state.rng, state.step)
    noise = 0.01 * jax.random.normal(key, batch["context"].shape)
    batch = dict(batch, context=batch["context"] + noise)
    loss_fn = lambda p: _loss(combine(p, state.frozen), batch)
    grads = jax.grad(loss_fn)(state.params)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    return state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state, data_position=state.data_position + 1)


def _run(state, sampler, n_steps):
    sampler.position = int(state.data_position)
    while int(state.step) < n_steps:
        batch = {k: jnp.asarray(v) for k, v in next(sampler).items()
                 if k in ("context", "target")}
        state = _train_step(state, batch)
        assert int(state.data_position) == sampler.position
    return state


def test_resume_is_bit_exact(tmp_path):
    series = [np.sin(np.arange(300) / 7.0) * 3 + 5, np.cos(np.arange(200) / 5.0) + 2]
    cfg = WindowConfig(CTX, H, stride=2)
    n, k = 12, 5
    make_sampler = lambda: WindowSampler(series, cfg, batch_size=8, seed=3)
    full = _run(_state(), make_sampler(), n)

    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    part = _run(_state(), make_sampler(), k)
    ckpt.save(part)
    del ckpt, part
    # fresh objects, as after a restart
    like = jax.eval_shape(lambda: _state())
    resumed = Checkpointer(tmp_path).restore(like=like)
    assert int(resumed.step) == k and int(resumed.data_position) == k
    resumed = _run(resumed, make_sampler(), n)
    _assert_trees_equal(resumed, full)
    assert not np.array_equal(np.asarray(full.params["inp"].u),
                              np.asarray(_state().params["inp"].u))


def _abstract_on(sharding_for):
    abstract = jax.eval_shape(lambda: _state())
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x)), abstract)


def test_restore_across_device_counts(tmp_path):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    assert mesh.size == 8
    replicated = NamedSharding(mesh, PartitionSpec())
    state = _state(seed=4)
    on8 = jax.device_put(state, replicated)
    assert len(on8.params["inp"].u.sharding.device_set) == 8
    Checkpointer(tmp_path / "from8").save(on8)

    one = SingleDeviceSharding(jax.devices()[0])
    got1 = Checkpointer(tmp_path / "from8").restore(like=_abstract_on(lambda x: one))
    for x in jax.tree_util.tree_leaves(got1):
        assert x.sharding.device_set == {jax.devices()[0]}
    _assert_trees_equal(got1, state)

    # 1 -> 8, with shardings built from mesh=
    Checkpointer(tmp_path / "from1").save(state)
    got8 = Checkpointer(tmp_path / "from1").restore(like=jax.eval_shape(lambda: _state()),
                                                    mesh=mesh)
    for x in jax.tree_util.tree_leaves(got8):
        assert len(x.sharding.device_set) == 8 and x.sharding.is_fully_replicated
    _assert_trees_equal(got8, state)
    # ... and with the caller's own shardings (the first factor split over the mesh)
    split = NamedSharding(mesh, PartitionSpec("data"))
    like = _abstract_on(lambda x: split if x.shape == (CTX, 3) else replicated)
    got = Checkpointer(tmp_path / "from1").restore(like=like, mesh=mesh)
    assert got.params["inp"].u.sharding == split
    _assert_trees_equal(got, state)


def _two_steps(path):
    ckpt = Checkpointer(path, max_to_keep=3)
    s1 = _state(seed=1)._replace(step=jnp.asarray(1, jnp.int32))
    s2 = _state(seed=2)._replace(step=jnp.asarray(2, jnp.int32))
    ckpt.save(s1)
    ckpt.save(s2)
    return ckpt, s1, s2


#: Where a step keeps its arrays and its description: this format (a lowrank_jax.io
#: checkpoint) and the earlier CRC32 one (orbax CheckpointManager items).
ARRAYS = {"current": "arrays", "crc32": "state"}
DESCRIPTION = {"current": "tree.json", "crc32": os.path.join("meta", "metadata")}


def _data_files(step_dir, fmt="current"):
    return [p for p in glob.glob(os.path.join(step_dir, ARRAYS[fmt], "**", "d", "*"),
                                 recursive=True) if os.path.isfile(p)]


def _two_steps_of(fmt, path):
    """Steps 1 and 2 in ``path``, written now or by the earlier format (a fixture); the
    ``like`` and the states of both steps."""
    if fmt == "current":
        ckpt, s1, s2 = _two_steps(path)
        return ckpt, jax.eval_shape(lambda: _state()), s1, s2
    shutil.copytree(os.path.join(DATA, "train_state_v2"), path, dirs_exist_ok=True)
    like = jax.eval_shape(_v2_state)
    return (Checkpointer(path, max_to_keep=3), like, _expected(like, "train_state_v2/1"),
            _expected(like, "train_state_v2/2"))


@pytest.mark.parametrize("fmt", ["current", "crc32"])
@pytest.mark.parametrize("damage", ["truncate", "delete", "flip", "swap", "meta"])
def test_corrupt_latest_gives_clear_error_and_previous_survives(tmp_path, damage, fmt):
    ckpt, like, s1, _ = _two_steps_of(fmt, tmp_path)
    step_dir = str(tmp_path / "2")
    if damage == "meta":
        os.remove(os.path.join(step_dir, DESCRIPTION[fmt]))
    elif damage == "swap":  # readable files with other contents: only the checksums tell
        shutil.rmtree(os.path.join(step_dir, ARRAYS[fmt]))
        shutil.copytree(str(tmp_path / "1" / ARRAYS[fmt]), os.path.join(step_dir, ARRAYS[fmt]))
    else:
        files = _data_files(step_dir, fmt)
        assert files
        for f in files:
            if damage == "truncate":
                with open(f, "r+b") as fh:
                    fh.truncate(os.path.getsize(f) // 2)
            elif damage == "delete":
                os.remove(f)
            else:
                b = bytearray(open(f, "rb").read())
                for i in range(len(b) // 3, len(b), 7):
                    b[i] ^= 0x5A
                open(f, "wb").write(bytes(b))
    fresh = Checkpointer(tmp_path, max_to_keep=3)
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {step_dir}\b") as err:
        fresh.restore(like=like)
    if damage == "swap":
        assert "fails its checksum" in str(err.value)
    # one line naming the damaged arrays (paths of the state) and what is wrong, no spec dump
    msg = str(err.value)
    assert "\n" not in msg and "TensorStore(" not in msg and "tensorstore_spec" not in msg
    assert msg.startswith(f"Checkpointer: checkpoint {step_dir} is damaged: ")
    if damage == "meta":
        said = {"current": f"its skeleton {step_dir}/tree.json is missing",
                "crc32": f"its metadata {step_dir}/meta cannot be read"}[fmt]
        assert said in msg and not err.value.arrays
    else:
        paths = {path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(s1)[0]}
        assert err.value.arrays and set(err.value.arrays) <= paths
        named = sum(f"'{p}'" in msg for p in err.value.arrays)
        assert named == min(len(err.value.arrays), 8)  # the rest are counted
        # (the damaged files include the index's: then no array can be read)
        what = {"truncate": "data cut short", "delete": "missing", "flip": "",
                "swap": "fails its checksum"}[damage]
        assert what in msg and ("cannot be read" in msg or "none of its" in msg
                                or damage == "swap")
    assert fresh.latest_step() == 2 and fresh.all_steps() == [1, 2]
    _assert_trees_equal(fresh.restore(step=1, like=like), s1)
    with pytest.warns(UserWarning) as record:
        got = fresh.restore(like=like, fallback=True)
    messages = [str(w.message) for w in record]
    assert any(step_dir in m and "falling back" in m for m in messages)
    assert any("restored step 1, the newest good checkpoint" in m for m in messages)
    _assert_trees_equal(got, s1)


def test_incompatible_like_is_rejected_with_the_mismatch(tmp_path):
    ckpt, _, _ = _two_steps(tmp_path)
    where = str(tmp_path / "2")
    wrong_rank = jax.eval_shape(lambda: _state(rank=2))
    with pytest.raises(IncompatibleCheckpointError,
                       match=rf"{where}.*params/inp/u.*\[16, 2\]") as err:
        ckpt.restore(like=wrong_rank)
    assert (err.value.where, err.value.expected, err.value.actual) == (where, [16, 2], [16, 3])
    extra = jax.eval_shape(lambda: _state()._replace(frozen={"new": jnp.zeros(3)}))
    with pytest.raises(IncompatibleCheckpointError, match="in `like` but not saved"):
        ckpt.restore(like=extra)
    # same arrays, different static field (HeadLowRank.ranks): a different treedef
    def ranked():
        st = _state()
        hl = st.params["heads"]
        return st._replace(params=dict(st.params, heads=HeadLowRank(hl.u, hl.v, hl.b, (2, 1))))
    with pytest.raises(IncompatibleCheckpointError, match="static leaf fields"):
        ckpt.restore(like=jax.eval_shape(ranked))
    with pytest.raises(FileNotFoundError, match="no step 5.*available steps: \\[1, 2\\]") as err:
        ckpt.restore(step=5, like=wrong_rank)
    assert isinstance(err.value, MissingFileError)


def test_plain_trees_numpy_scalars_and_empty_arrays(tmp_path):
    tree = {"np": np.arange(6, dtype=np.int16).reshape(2, 3), "npscalar": np.float32(2.5),
            "py": 3, "empty": jnp.zeros((0, 4)), "none": None,
            "keys": jax.random.split(jax.random.key(1), 3), "old_key": jax.random.PRNGKey(5)}
    ckpt = Checkpointer(tmp_path, async_save=True)
    with pytest.raises(ConfigError, match="no 'step' field; pass step="):
        ckpt.save(tree)
    with pytest.raises(LeafTypeError, match="state node 'obj' has type object"):
        ckpt.save({**tree, "obj": object()}, step=3)
    assert ckpt.all_steps() == []  # nothing was written
    ckpt.save(tree, step=3)
    ckpt.wait_until_finished()
    got = Checkpointer(tmp_path).restore(like=tree)
    assert type(got["np"]) is np.ndarray and got["np"].dtype == np.int16
    assert type(got["npscalar"]) is np.float32 and got["npscalar"] == 2.5
    assert type(got["py"]) is int and got["py"] == 3
    assert got["empty"].shape == (0, 4) and got["none"] is None
    _assert_trees_equal(got, tree)
    with pytest.raises(IncompatibleCheckpointError, match=r"'np' is int16\[2, 3\] but `like` has"):
        Checkpointer(tmp_path).restore(like=dict(tree, np=np.zeros((2, 3), np.float32)))


def test_model_state_round_trip(tmp_path):
    model_state = {"bn": {"mean": jnp.arange(8.0), "var": jnp.full((8,), 2.0)},
                   "count": jnp.asarray(3, jnp.int32)}
    key = jax.random.key(0)
    state = init_train_state(_params(key), optax.adam(1e-2), key=key, model_state=model_state)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state)
    like = jax.eval_shape(lambda: state)
    got = Checkpointer(tmp_path).restore(like=like)
    _assert_trees_equal(got, state)
    assert [e["path"] for e in ckpt.metadata()["leaves"] if e["path"].startswith("model_state")] \
        == ["model_state/bn/mean", "model_state/bn/var", "model_state/count"]
    # a model state of another structure, or none, is named
    other = like._replace(model_state={**like.model_state, "extra": like.step})
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"in `like` but not saved: \['model_state/extra'\]"):
        Checkpointer(tmp_path).restore(like=other)
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"saved but not in `like`: \['model_state/bn/mean'"):
        Checkpointer(tmp_path).restore(like=like._replace(model_state=None))


def _v1_like():
    """The state lowrank_jax 0.1 saved in tests/train/data/train_state_v1 (same structure,
    built with today's initializers; the values come from the checkpoint)."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"inp": init_lowrank(k[0], 6, 4, 2, bias=True),
              "heads": init_head_lowrank(k[1], 4, 2, 2, 2),
              "bin": init_masked_binary(k[2], 4, 4, 0.5), "out": init_dense(k[3], 4, 3),
              "scale": jnp.ones((4,))}
    return init_train_state(params, optax.adam(1e-2), key=jax.random.key(1))


def test_reads_version_1_checkpoints(tmp_path):
    """A checkpoint written by lowrank_jax 0.1 (commit 984970a, whose TrainState had no
    model_state) restores into today's TrainState with ``model_state=None``; the expected
    arrays were dumped by the same 0.1 run into train_state_v1_expected.npz."""
    directory = tmp_path / "v1"
    shutil.copytree(os.path.join(DATA, "train_state_v1"), directory)
    expected = np.load(os.path.join(DATA, "train_state_v1_expected.npz"))
    ckpt = Checkpointer(directory)
    meta = ckpt.metadata()
    assert (meta["version"], meta["step"], meta["data_position"]) == (1, 1, 5)
    assert meta["metadata"] == {"written_by": "lowrank_jax 0.1 (984970a)"}
    got = ckpt.restore(like=jax.eval_shape(_v1_like))
    assert isinstance(got, TrainState) and got.model_state is None
    assert got.frozen["bin"].keep == 0.5 and got.params["out"].b is None
    assert got.frozen["bin"].divisor == got.params["bin"].divisor == "kept"  # 0.1's alpha
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    assert sorted(path_str(p) for p, _ in flat) == sorted(expected.files)
    for p, x in flat:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        np.testing.assert_array_equal(np.asarray(x), expected[path_str(p)], err_msg=path_str(p))
    # the Adam moments were saved after one update: they are not all zero
    assert np.abs(expected["opt_state/0/mu/inp/u"]).min() > 0
    # a version-1 checkpoint has no model state to restore into a like that has one
    with_state = jax.eval_shape(lambda: _v1_like()._replace(model_state={"m": jnp.zeros(2)}))
    with pytest.raises(IncompatibleCheckpointError, match="in `like` but not saved"):
        ckpt.restore(like=with_state)


# -- the earlier CRC32 format (fixtures written by it, tests/train/data/make_v2_fixtures.py) ---

def _v2_params(key):
    """The parameters of the fixtures train_state_v2* (structure; values come from them)."""
    k = jax.random.split(key, 4)
    return {"inp": init_lowrank(k[0], 6, 4, 2, bias=True),
            "heads": init_head_lowrank(k[1], 4, 2, 2, 2),
            "bin": init_masked_binary(k[2], 4, 4, 0.5), "out": init_dense(k[3], 4, 3),
            "scale": jnp.ones((4,))}


def _v2_state():
    return init_train_state(_v2_params(jax.random.key(0)), optax.adam(1e-2),
                            key=jax.random.key(1))


def _v2_model_state():
    return {"bn": {"mean": jnp.zeros((4,)), "var": jnp.ones((4,))},
            "count": jnp.asarray(0, jnp.int32)}


def _v2_stateful():
    return init_train_state(_v2_params(jax.random.key(2)),
                            default_optimizer(learning_rate=1e-2, total_steps=10, warmup_steps=1),
                            key=jax.random.key(3), model_state=_v2_model_state())


def _v2_tree():
    return {"np": np.arange(6, dtype=np.int16).reshape(2, 3), "npscalar": np.float32(2.5),
            "py": 3, "empty": jnp.zeros((0, 4)), "none": None,
            "keys": jax.random.split(jax.random.key(1), 3), "old_key": jax.random.PRNGKey(5)}


def _expected(like, prefix):
    """``like`` filled with the arrays the fixture's writer dumped under ``prefix``."""
    npz = np.load(os.path.join(DATA, "train_state_v2_expected.npz"))

    def value(kp, x):
        a = npz[f"{prefix}/{path_str(kp) or '<root>'}"]
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jnp.asarray(a), impl=str(jax.random.key_impl(
                jax.random.key(0))))
        return jnp.asarray(a)

    flat = jax.tree_util.tree_flatten_with_path(like)[0]
    assert {f"{prefix}/{path_str(kp) or '<root>'}" for kp, _ in flat} == {
        f for f in npz.files if f.startswith(prefix + "/")}
    return jax.tree_util.tree_map_with_path(value, like)


def test_crc32_fixtures_restore_bit_exactly(tmp_path):
    """Steps written by the earlier format (CRC32, orbax CheckpointManager, version 2) restore
    into today's structures with the same bits, step, data position, optimizer state and
    metadata."""
    shutil.copytree(DATA, tmp_path / "data")
    ck = Checkpointer(tmp_path / "data" / "train_state_v2")
    assert ck.all_steps() == [1, 2] and ck.removed_temporaries == []
    like = jax.eval_shape(_v2_state)
    for step in (1, 2):
        meta = ck.metadata(step)
        assert (meta["format"], meta["version"]) == ("lowrank_jax.train_state", 2)
        assert (meta["step"], meta["data_position"]) == (step, 5 * step)
        got = ck.restore(step, like=like)
        assert isinstance(got, TrainState) and got.model_state is None
        assert type(got.opt_state[0]) is type(like.opt_state[0])  # optax's own class
        _assert_trees_equal(got, _expected(like, f"train_state_v2/{step}"))
        assert int(got.step) == step and int(got.data_position) == 5 * step
    # the Adam moments were saved after real updates: not all zero
    assert np.abs(np.asarray(got.opt_state[0].mu["inp"].u)).min() > 0

    ck = Checkpointer(tmp_path / "data" / "train_state_v2_stateful")
    meta = ck.metadata()
    assert meta["step"] == 3 and meta["config"] == {"lr": 0.01, "steps": 10}
    assert meta["metadata"] == {"written_by": "the CRC32 train-state format (version 2)"}
    like = jax.eval_shape(_v2_stateful)
    got = ck.restore(like=like)
    _assert_trees_equal(got, _expected(like, "train_state_v2_stateful/3"))
    assert float(got.model_state["bn"]["mean"][0]) == 0.75  # three updates of +0.25
    assert float(got.opt_state.hyperparams["learning_rate"]) > 0

    tree = _v2_tree()
    got = Checkpointer(tmp_path / "data" / "tree_v2").restore(like=tree)
    _assert_trees_equal(got, tree)
    assert type(got["py"]) is int and type(got["npscalar"]) is np.float32
    assert got["none"] is None and got["empty"].shape == (0, 4)


def test_a_run_resumes_from_crc32_steps_and_continues_in_this_format(tmp_path):
    """``fit`` resumes from a step of the earlier format; its new steps are io checkpoints, and
    keep-N removes the old steps in turn."""
    directory = tmp_path / "run"
    shutil.copytree(os.path.join(DATA, "train_state_v2"), directory)
    series = [np.sin(np.arange(300) / 7.0) * 3 + 5, np.cos(np.arange(200) / 5.0) + 2]
    sampler = WindowSampler(series, WindowConfig(6, 3, stride=2), batch_size=4, seed=3)

    def loss(p, batch, key):
        del key
        h = jnp.tanh(linear(p["inp"], batch["context"]))
        h = h + linear(p["bin"], h) * p["scale"] + linear(p["heads"], h)
        return jnp.mean((linear(p["out"], h) - batch["target"]) ** 2), {}

    kw = dict(steps=4, key=jax.random.key(1), optimizer=optax.adam(1e-2), checkpoint_every=1,
              progress=False)
    state, hist = fit(loss, _v2_params(jax.random.key(0)), sampler,
                      checkpointer=Checkpointer(directory, max_to_keep=3), **kw)
    assert [h["step"] for h in hist] == [3, 4]  # resumed from step 2
    assert Checkpointer(directory).all_steps() == [2, 3, 4]
    assert sorted(os.listdir(directory / "3")) == ["arrays", "tree.json"]
    assert os.path.isdir(directory / "2" / "meta")  # the old step, still readable
    _assert_trees_equal(lio.load_params(directory / "4"), full_params(state))
    like = jax.eval_shape(_v2_state)
    _assert_trees_equal(Checkpointer(directory).restore(2, like=like),
                        _expected(like, "train_state_v2/2"))


# -- a step is a lowrank_jax.io checkpoint, and an io checkpoint starts a run -----------------

def test_a_step_is_an_io_checkpoint(tmp_path):
    model_state = {"bn": {"mean": jnp.arange(4.0), "var": jnp.full((4,), 2.0)}}
    state = init_train_state(_params(jax.random.key(3)),
                             default_optimizer(learning_rate=1e-2, total_steps=10, warmup_steps=1),
                             key=jax.random.key(4), model_state=model_state)
    state = state._replace(step=jnp.asarray(5, jnp.int32), data_position=jnp.asarray(9, jnp.int32))
    ck = Checkpointer(tmp_path)
    ck.save(state, metadata={"note": "x"}, config={"lr": 0.01})
    step_dir = ck.step_dir(5)
    assert lio.is_checkpoint(step_dir)
    # the parameters (trainable and frozen rejoined), the model state and the metadata
    _assert_trees_equal(lio.load_params(step_dir), full_params(state))
    _assert_trees_equal(lio.load_state(step_dir), model_state)
    assert lio.load_metadata(step_dir) == {"note": "x"}
    # ... and the whole state, without `like`: the optimizer's NamedTuples keep their names
    # and fields, the values their bits
    got = load_train_state(step_dir)
    assert isinstance(got, TrainState)
    for field in ("step", "params", "frozen", "rng", "data_position", "model_state"):
        _assert_trees_equal(getattr(got, field), getattr(state, field))
    names = lambda t: [(type(x).__name__, getattr(type(x), "_fields", None))  # noqa: E731
                       for x in jax.tree_util.tree_leaves(
                           t, is_leaf=lambda y: isinstance(y, tuple) and hasattr(y, "_fields"))]
    assert names(got.opt_state) == names(state.opt_state)
    for a, b in zip(jax.tree_util.tree_leaves(got.opt_state),
                    jax.tree_util.tree_leaves(state.opt_state), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and a.dtype == b.dtype
    # a parameter checkpoint is not a train state
    lio.save_params(tmp_path / "p", full_params(state))
    with pytest.raises(CheckpointError, match="holds parameters, not a train state"):
        load_train_state(tmp_path / "p")


def test_an_io_checkpoint_starts_fit_with_a_fresh_optimizer(tmp_path):
    series = [np.sin(np.arange(300) / 7.0) * 3 + 5, np.cos(np.arange(200) / 5.0) + 2]
    make_sampler = lambda: WindowSampler(series, WindowConfig(CTX, H, stride=2), batch_size=8,
                                         seed=3)

    def loss(p, batch, key):
        del key
        return _loss(p, batch), {}

    params = _params(jax.random.key(6))
    lio.save_params(tmp_path / "pre", params)
    kw = dict(steps=3, key=jax.random.key(7), optimizer=optax.adam(1e-2), progress=False)
    want, want_hist = fit(loss, params, make_sampler(), **kw)
    got, got_hist = fit(loss, str(tmp_path / "pre"), make_sampler(), **kw)
    assert [h["loss"] for h in got_hist] == [h["loss"] for h in want_hist]
    _assert_trees_equal(got, want)
    # a trained step starts a new run too (fine-tuning: its parameters, a fresh optimizer)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(want)
    again, hist = fit(loss, ck.step_dir(3), make_sampler(), **kw)
    assert [h["step"] for h in hist] == [1, 2, 3]
    assert not np.array_equal(np.asarray(again.params["inp"].u), np.asarray(want.params["inp"].u))
    with pytest.raises(MissingFileError, match="no checkpoint at"):
        fit(loss, str(tmp_path / "nothing"), make_sampler(), **kw)


def test_optimizer_states_and_other_pytree_nodes_round_trip(tmp_path):
    from jax.tree_util import register_pytree_with_keys_class

    @register_pytree_with_keys_class
    class Box:
        def __init__(self, a, b, tag):
            self.a, self.b, self.tag = a, b, tag

        def tree_flatten_with_keys(self):
            return ((jax.tree_util.GetAttrKey("a"), self.a),
                    (jax.tree_util.GetAttrKey("b"), self.b)), self.tag

        @classmethod
        def tree_unflatten(cls, tag, children):
            return cls(*children, tag)

        def __repr__(self):
            return f"Box({self.tag})"

    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2))
    tree = {"opt": opt.init({"w": jnp.ones((3, 2))}), "box": Box(jnp.arange(3.0), None, "t"),
            "t": (1.5, True)}
    ck = Checkpointer(tmp_path)
    ck.save(tree, step=1)
    got = ck.restore(like=jax.eval_shape(lambda: tree))
    _assert_trees_equal(got, tree)
    assert got["box"].tag == "t" and type(got["t"][0]) is float and got["t"][1] is True
    with pytest.raises(IncompatibleCheckpointError, match=r"another tree structure.*'box'"):
        ck.restore(like=dict(tree, box=Box(jnp.arange(3.0), None, "other")))
    # without `like` a node type io cannot rebuild is named
    with pytest.raises(CheckpointError, match=r"Box node at 'box'.*like="):
        load_train_state(ck.step_dir(1))
    with pytest.raises(CheckpointError, match=r"Box node at 'box'.*like="):
        lio.load_params(ck.step_dir(1))


def test_temporaries_of_killed_saves_in_this_format_are_removed(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    ck.save(_state(), step=1)
    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    stale = files.temp_path(ck.step_dir(2), pid=dead)
    live = files.temp_path(ck.step_dir(3))
    for d in (stale, live):
        os.makedirs(os.path.join(d, "arrays"))
    again = Checkpointer(tmp_path / "ck")
    assert again.removed_temporaries == [stale]
    assert os.path.isdir(live) and again.all_steps() == [1]
    shutil.rmtree(live)


def test_async_save_is_complete_after_waiting(tmp_path):
    state = _state()
    with Checkpointer(tmp_path, async_save=True) as ck:
        ck.save(state, step=1)
        donated = jax.jit(lambda s: s, donate_argnums=0)(state)  # the buffers are reused
        ck.save(donated._replace(step=jnp.asarray(2, jnp.int32)))  # waits for step 1 first
    assert Checkpointer(tmp_path).all_steps() == [1, 2]
    like = jax.eval_shape(lambda: _state())
    _assert_trees_equal(Checkpointer(tmp_path).restore(1, like=like), _state())


@pytest.mark.parametrize("fmt", ["current", "crc32"])
def test_checkpoint_errors_are_checkpoint_errors_naming_the_step(tmp_path, fmt):
    _, like, _, _ = _two_steps_of(fmt, tmp_path)
    os.remove(os.path.join(str(tmp_path / "2"), DESCRIPTION[fmt]))
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path).restore(like=like)
    assert isinstance(err.value, CorruptCheckpointError)
    assert err.value.where == str(tmp_path / "2")
    with pytest.raises(ConfigError, match="max_to_keep"):
        Checkpointer(tmp_path, max_to_keep=0)


# -- interrupted saves: no temporaries left, Ctrl-C waits for the save ------------------------

def test_temporaries_of_interrupted_saves_are_removed_on_start(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    ck.save(_state(), step=1)
    # what a save killed in the middle leaves: orbax's unfinished step directory
    tmp = tmp_path / "ck" / "2.orbax-checkpoint-tmp-1731000000123456"
    os.makedirs(tmp / "state")
    (tmp / "state" / "partial").write_bytes(b"\0" * 10)
    kept = Checkpointer(tmp_path / "ck", clean=False)  # a live writer may own it
    assert kept.removed_temporaries == [] and tmp.exists() and kept.all_steps() == [1]
    ck = Checkpointer(tmp_path / "ck")
    assert ck.removed_temporaries == [str(tmp)] and sorted(os.listdir(tmp_path / "ck")) == ["1"]
    ck.save(_state(), step=2)  # the step can be saved again
    assert ck.all_steps() == [1, 2]


@pytest.fixture
def default_sigint():
    """Python's default SIGINT handler for the test, whatever the worker process had (under
    pytest-xdist a worker's handler is not always the default one); restored after."""
    import signal

    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


def test_ctrl_c_during_a_save_takes_effect_after_the_save(tmp_path, default_sigint):
    import signal

    ck = Checkpointer(tmp_path / "ck")
    save = ck._write_step

    def interrupted_save(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C arrives in the middle of the save
        return save(*args, **kwargs)

    ck._write_step = interrupted_save
    state = _state()
    with pytest.raises(KeyboardInterrupt):
        ck.save(state, step=3)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert Checkpointer(tmp_path / "ck").all_steps() == [3]  # complete, not a temporary
    assert not glob.glob(str(tmp_path / "ck" / "*tmp*"))
    like = jax.eval_shape(lambda: _state())
    _assert_trees_equal(Checkpointer(tmp_path / "ck").restore(like=like), state)
