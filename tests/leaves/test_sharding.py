"""Placement decided by the leaves: logical_axes of every leaf, partition_specs / mesh_shardings
on a mesh of 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS), optimizer states."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lowrank_jax import leaves as lj
from lowrank_jax.errors import ConfigError

NAMES = {"in", "out", "rank", "heads", "head_dim", "machine", None}


def f32(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices()
    assert len(devices) >= 8, "tests/conftest.py must give 8 simulated CPU devices"
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))  # data 2, model 4


@functools.lru_cache(maxsize=2)
def leaves(bias=True):
    """One leaf of every type, d_in 16 and d_out 8 (HeadLowRank: 4 heads of d_head 2)."""
    b = (lambda n: f32(99, (n,))) if bias else (lambda n: None)
    mb = lj.MaskedBinary(f32(4, (16, 8)), f32(5, (16, 8)), b(8), keep=0.5)
    return {
        "dense": lj.Dense(f32(0, (16, 8)), b(8)),
        "lowrank": lj.LowRank(f32(1, (16, 2)), f32(2, (2, 8)), b(8)),
        "head_lowrank": lj.HeadLowRank(f32(3, (16, 4, 2)), f32(6, (4, 2, 2)), b(8),
                                       ranks=(2, 1, 2, 2)),
        "masked_binary": mb,
        "frozen_binary": mb.freeze(),
    }


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["dense", "lowrank", "head_lowrank", "masked_binary",
                                  "frozen_binary"])
def test_logical_axes_cover_every_array_child(kind, bias):
    leaf = leaves(bias)[kind]
    axes = leaf.logical_axes()
    for f in lj.data_fields(leaf):
        child = getattr(leaf, f)
        if child is None:
            continue
        assert f in axes, f"{kind}.{f} has no logical axes"
        assert len(axes[f]) == np.ndim(child), (kind, f, axes[f], np.shape(child))
        assert set(axes[f]) <= NAMES
    assert set(axes) <= set(lj.data_fields(leaf))  # no names for fields that do not exist


def specs_by_path(specs):
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))
    return {lj.path_str(p): s for p, s in flat}


def test_tensor_parallel_rules(mesh):
    tree = dict(leaves(), odd=lj.Dense(f32(7, (16, 6))), emb=f32(8, (32, 8)))
    got = specs_by_path(lj.partition_specs(tree, mesh, {"out": "model"}))
    expected = {
        "dense/w": P(None, "model"), "dense/b": P("model"),
        "lowrank/u": P(None, None), "lowrank/v": P(None, "model"), "lowrank/b": P("model"),
        "head_lowrank/u": P(None, None, None), "head_lowrank/v": P(None, None, None),
        "head_lowrank/b": P("model"),
        "masked_binary/w": P(None, "model"), "masked_binary/s": P(None, "model"),
        "masked_binary/b": P("model"),
        "frozen_binary/signs": P(None, "model"), "frozen_binary/alpha": P(),
        "frozen_binary/b": P("model"),
        "odd/w": P(None, None),  # 6 outputs do not split over 4 devices: left whole
        "emb": P(None, None),  # plain arrays have no names
    }
    assert got == expected
    heads = specs_by_path(lj.partition_specs(tree["head_lowrank"], mesh, {"heads": "model"}))
    assert heads == {"u": P(None, "model", None), "v": P("model", None, None), "b": P(None)}
    # A mesh axis is used at most once per array: 'in' takes it first.
    both = specs_by_path(lj.partition_specs(tree["dense"], mesh, {"in": "model", "out": "model"}))
    assert both == {"w": P("model", None), "b": P("model")}


def test_fsdp_splits_first_divisible_dim_of_big_arrays(mesh):
    tree = {
        "dense": lj.Dense(f32(0, (16, 8)), f32(1, (8,))),
        "emb": f32(2, (32, 8)),
        "odd_first": f32(3, (3, 40)),  # 3 is not divisible by 2: the second dim is split
        "odd_both": f32(4, (3, 25)),  # nothing divisible: stays whole
        "small": f32(5, (4, 4)),  # below fsdp_min_size
    }
    got = specs_by_path(lj.partition_specs(tree, mesh, {"out": "model"}, fsdp_axis="data",
                                           fsdp_min_size=64))
    assert got == {
        "dense/w": P("data", "model"), "dense/b": P("model"),
        "emb": P("data", None), "odd_first": P(None, "data"), "odd_both": P(None, None),
        "small": P(None, None),
    }


def test_unknown_mesh_axis_raises(mesh):
    tree = leaves()
    with pytest.raises(ConfigError, match="'tensor'"):
        lj.partition_specs(tree, mesh, {"out": "tensor"})
    with pytest.raises(ConfigError, match="fsdp_axis"):
        lj.partition_specs(tree, mesh, fsdp_axis="fsdp")


def test_mesh_shardings_place_arrays_and_results_match(mesh):
    tree = leaves()
    shardings = lj.mesh_shardings(tree, mesh, {"out": "model"}, fsdp_axis="data",
                                  fsdp_min_size=32)
    placed = jax.device_put(tree, shardings)
    assert placed["dense"].w.sharding.shard_shape((16, 8)) == (8, 2)
    assert placed["lowrank"].u.sharding.shard_shape((16, 2)) == (8, 2)  # FSDP on 'in'
    assert placed["lowrank"].v.sharding.shard_shape((2, 8)) == (2, 2)  # 16 < 32: no FSDP
    assert placed["dense"].b.sharding.shard_shape((8,)) == (2,)
    x = f32(9, (4, 16))
    apply = jax.jit(lambda t, x: {k: lj.linear(v, x) for k, v in t.items()})
    sharded, single = apply(placed, x), apply(tree, x)
    for k in tree:
        np.testing.assert_allclose(np.asarray(sharded[k]), np.asarray(single[k]), atol=1e-5)


def test_optimizer_state_gets_the_parameters_specs(mesh):
    params = dict(leaves(), emb=f32(8, (32, 8)))
    train, _ = lj.partition(params)  # MaskedBinary.w, FrozenBinary signs/alpha are None here
    state = optax.adam(1e-3).init(train)
    kw = dict(rules={"out": "model"}, fsdp_axis="data", fsdp_min_size=64)
    p_specs = lj.partition_specs(train, mesh, **kw)
    s_specs = lj.partition_specs(state, mesh, **kw)
    adam = s_specs[0]
    assert adam.count == P()
    for moments in (adam.mu, adam.nu):
        assert jax.tree_util.tree_structure(moments, is_leaf=lambda s: isinstance(s, P)) == \
            jax.tree_util.tree_structure(p_specs, is_leaf=lambda s: isinstance(s, P))
        assert specs_by_path(moments) == specs_by_path(p_specs)
    assert specs_by_path(p_specs)["dense/w"] == P("data", "model")
    assert "masked_binary/w" not in specs_by_path(p_specs)  # frozen: no spec, no moments
    placed = jax.device_put(state, lj.mesh_shardings(state, mesh, **kw))
    assert placed[0].mu["dense"].w.sharding.shard_shape((16, 8)) == (8, 2)


def test_attention_block_containers_are_placed(mesh):
    # QueryKey is a container (its q and k are placed like any leaf); HeadLayout has no arrays.
    block = {"qk": lj.QueryKey.uniform(lj.Dense(f32(10, (16, 8))), lj.Dense(f32(11, (16, 8))), 4),
             "v": lj.Dense(f32(12, (16, 8))), "o": lj.Dense(f32(13, (8, 16))),
             "heads": lj.HeadLayout.uniform(4, 2, 0.5)}
    specs = lj.partition_specs(block, mesh, {"out": "model"})
    lay = specs["heads"]  # the static layout, unchanged
    assert isinstance(lay, lj.HeadLayout) and (lay.ids, lay.v, lay.scale) == ((0, 1, 2, 3),
                                                                             (2,) * 4, 0.5)
    assert specs_by_path(specs) == {"qk/q/w": P(None, "model"), "qk/k/w": P(None, "model"),
                                    "v/w": P(None, "model"), "o/w": P(None, "model")}
    placed = jax.device_put(block, lj.mesh_shardings(block, mesh, {"out": "model"}))
    assert placed["qk"].widths == (2, 2, 2, 2) and placed["heads"].scale == 0.5
    assert placed["qk"].q.w.sharding.shard_shape((16, 8)) == (16, 2)
