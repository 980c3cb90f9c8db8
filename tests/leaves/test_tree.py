"""Trees of leaves: counts' argument checks, float64 host materialization, paths, node types."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import leaves as lj
from lowrank_jax.errors import ConfigError


def f32(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def small_tree():
    """Two attention-like layers with a QueryKey container, a head layout and plain arrays."""
    def layer(seed):
        qk = lj.QueryKey.uniform(lj.Dense(jnp.asarray(f32(seed, (4, 4)))),
                                 lj.Dense(jnp.asarray(f32(seed + 1, (4, 4)))), 2)
        return {"attn": {"qk": qk, "v": lj.Dense(jnp.asarray(f32(seed + 2, (4, 4)))),
                         "heads": lj.HeadLayout.uniform(2, 2, 0.5)},
                "norm": jnp.ones((4,))}
    return {"layers": [layer(0), layer(10)], "emb": jnp.zeros((3, 4))}


@pytest.mark.parametrize("n", [-1, -100, 1.5, True, "3", None])
def test_flops_rejects_bad_token_counts(n):
    tree = small_tree()
    with pytest.raises(ConfigError, match="n_tokens must be an int >= 0"):
        lj.flops(tree, n)


def test_flops_accepts_zero_and_numpy_ints():
    tree = small_tree()
    assert lj.flops(tree, 0) == 0
    assert lj.flops(tree, np.int64(2)) == 2 * 2 * 3 * 16  # 2 layers x (q, k, v) x 4 x 4


def test_materialize_host_lowrank_is_a_float64_product():
    u, v = f32(0, (9, 4)), f32(1, (4, 7))
    leaf = lj.LowRank(jnp.asarray(u), jnp.asarray(v), jnp.asarray(f32(2, (7,))))
    ref = u.astype(np.float64) @ v.astype(np.float64)  # bias excluded
    got = lj.materialize_host(leaf)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=1e-13, atol=1e-13)
    # A float32 product rounded up to float64 would be off by ~1e-7: this is a real check.
    f32_err = np.max(np.abs(np.asarray(lj.materialize(leaf), np.float64) - ref))
    assert f32_err > 1e-9
    # 64-bit mode is switched off again afterwards.
    assert jnp.zeros(1).dtype == jnp.float32 and not jax.config.jax_enable_x64


def test_materialize_host_other_leaves():
    u, v = f32(3, (5, 2, 3)), f32(4, (2, 3, 2))
    hl = lj.HeadLowRank(jnp.asarray(u), jnp.asarray(v), ranks=(3, 1))
    ref = np.concatenate([u[:, 0].astype(np.float64) @ v[0],
                          u[:, 1, :1].astype(np.float64) @ v[1, :1]], axis=1)
    np.testing.assert_allclose(lj.materialize_host(hl), ref, rtol=1e-13, atol=1e-13)
    signs = np.array([[1, -1], [0, 1]], np.int8)
    fb = lj.FrozenBinary(jnp.asarray(signs), jnp.float32(0.3))
    got = lj.materialize_host(fb)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.float64(np.float32(0.3)) * signs)
    w = f32(5, (3, 2))
    np.testing.assert_array_equal(lj.materialize_host(jnp.asarray(w)), w.astype(np.float64))


def test_get_path_and_replace_paths():
    tree = small_tree()
    q = lj.get_path(tree, "layers/1/attn/qk/q")
    assert q is tree["layers"][1]["attn"]["qk"].q
    assert lj.get_path(tree, "layers/0/attn/heads").scale == 0.5
    assert lj.get_path(tree, "") is tree
    new_q = lj.Dense(jnp.ones((4, 4)))
    new_attn = {"replaced": True}
    out = lj.replace_paths(tree, {"layers/1/attn/qk/q": new_q, "layers/0/attn": new_attn})
    assert out["layers"][1]["attn"]["qk"].q is new_q
    assert out["layers"][1]["attn"]["qk"].k is tree["layers"][1]["attn"]["qk"].k
    assert out["layers"][1]["attn"]["qk"].widths == (2, 2)
    assert out["layers"][0]["attn"] is new_attn
    assert out["emb"] is tree["emb"] and out["layers"][1]["norm"] is tree["layers"][1]["norm"]
    # The input is not modified.
    assert tree["layers"][1]["attn"]["qk"].q is q and "qk" in tree["layers"][0]["attn"]
    assert lj.replace_paths(tree, {}) is tree
    with pytest.raises(KeyError, match="layers/5"):
        lj.replace_paths(tree, {"layers/5/attn": new_attn})


def test_named_leaves_paths_walk_into_containers():
    names = [p for p, _ in lj.named_leaves(small_tree())]
    assert names == [
        "emb",
        "layers/0/attn/qk/q", "layers/0/attn/qk/k", "layers/0/attn/v", "layers/0/norm",
        "layers/1/attn/qk/q", "layers/1/attn/qk/k", "layers/1/attn/v", "layers/1/norm",
    ]
    assert lj.layer_index("layers/1/attn/qk/q") == 1 and lj.layer_index("emb") is None


def test_node_types_registry():
    reg = lj.node_types()
    for cls in (lj.Dense, lj.LowRank, lj.HeadLowRank, lj.MaskedBinary, lj.FrozenBinary,
                lj.QueryKey, lj.HeadLayout):
        assert reg[lj.qualified_name(cls)] is cls
    assert lj.qualified_name(lj.Dense) == "lowrank_jax.leaves.dense.Dense"
    reg.clear()  # a copy: the registry itself is unchanged
    assert lj.qualified_name(lj.Dense) in lj.node_types()
    assert lj.meta_fields(lj.MaskedBinary) == ("keep", "divisor")
    assert lj.data_fields(lj.FrozenBinary) == ("signs", "alpha", "b")
