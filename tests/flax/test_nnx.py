"""lowrank_jax.interop.nnx: a user's nnx model, defined here, compressed by a plan over its
state paths (submodules replaced in a copy); references are the same model class with plain
nnx.Linear layers on the materialized weights, and NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowrank_jax as lj
from lowrank_jax.errors import ConfigError, PlanError, ShapeError
from lowrank_jax.interop import nnx as ljn
from lowrank_jax.io import load_params, save_params


class Block(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.mlp = nnx.List([nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)])

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp[1](nnx.gelu(self.mlp[0](x)))


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = nnx.List([Block(8, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(axis=1))


MODEL = Net(rngs=nnx.Rngs(0))
X = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 6))
PLAN = lj.Plan((lj.Step("svd", (r"blocks/\d+/.*kernel$",), {"rank": 2}),))


def test_compressed_equals_model_on_materialized_weights():
    y_before = MODEL(X)
    small, report = ljn.compress(MODEL, PLAN)
    assert isinstance(MODEL.blocks[0].mlp[0], nnx.Linear)  # the input model is unchanged
    np.testing.assert_array_equal(MODEL(X), y_before)
    assert type(small) is Net and isinstance(small.blocks[0].mlp[0], ljn.LeafLinear)
    assert isinstance(small.blocks[1].attn.out, ljn.LeafLinearGeneral)
    assert isinstance(small.embed, nnx.Linear)  # not selected
    y = nnx.jit(lambda m, x: m(x))(small, X)
    dense = ljn.materialize(small)
    assert isinstance(dense.blocks[1].attn.query, nnx.LinearGeneral)
    np.testing.assert_allclose(y, dense(X), atol=1e-5, rtol=0)
    # the materialized kernels are NumPy rank-2 truncations of the originals
    k = np.asarray(MODEL.blocks[0].attn.out.kernel.get_value())  # [heads, head_dim, d]
    u, s, vt = np.linalg.svd(k.reshape(8, 8).astype(np.float64))
    ref = ((u[:, :2] * s[:2]) @ vt[:2]).reshape(k.shape)
    np.testing.assert_allclose(dense.blocks[0].attn.out.kernel.get_value(), ref, atol=1e-5)
    assert np.abs(np.asarray(y) - np.asarray(y_before)).max() > 1e-3
    paths = [r.path for r in report.rows]
    assert "blocks/0/mlp/1/kernel" in paths and "blocks/1/attn/query/kernel" in paths
    assert len(paths) == 12
    n_orig = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(nnx.state(MODEL, nnx.Param)))
    assert report.tree["params_before"] == n_orig
    assert lj.param_count(ljn.param_tree(small)) == report.tree["params_after"]


def test_full_rank_equals_original():
    plan = lj.Step("svd", (r"kernel$",), {"eps": 1e-7, "keep_dense_if_larger": False})
    full, _ = ljn.compress(MODEL, plan)
    assert isinstance(full.head.kernel.get_value(), lj.LowRank)
    np.testing.assert_allclose(full(X), MODEL(X), atol=1e-5, rtol=0)


def test_save_load_round_trip(tmp_path):
    small, _ = ljn.compress(MODEL, PLAN)
    save_params(tmp_path / "ckpt", ljn.param_tree(small))
    back = ljn.with_leaves(MODEL, load_params(tmp_path / "ckpt"))
    np.testing.assert_array_equal(back(X), small(X))
    # split / merge keeps the leaves as Param values
    graphdef, state = nnx.split(back)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(X), small(X))


def test_leaf_modules_directly():
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 6))
    layer = ljn.LeafLinear.create(6, 5, rngs=nnx.Rngs(0),
                                  leaf_init=lambda k, i, o, b: lj.init_lowrank(k, i, o, 2, bias=b))
    leaf = layer.kernel.get_value()
    np.testing.assert_allclose(layer(x), np.asarray(x) @ (np.asarray(leaf.u) @ leaf.v)
                               + np.asarray(leaf.b), atol=1e-5)
    with pytest.raises(ShapeError, match="expects inputs of width 6"):
        layer(jnp.ones((2, 7)))


def test_errors_name_the_nnx_path():
    with pytest.raises(PlanError, match="blocks/0/attn/query/kernel"):
        ljn.compress(MODEL, lj.Step("svd", (r"attn/q$",), {"rank": 2}))
    small, _ = ljn.compress(MODEL, lj.Step("svd", (r"^head/kernel$",), {"rank": 2}))
    tree = ljn.param_tree(small)
    tree["head"]["kernel"] = lj.Dense(jnp.ones((8, 4)))
    with pytest.raises(ShapeError, match="head/kernel"):
        ljn.with_leaves(MODEL, tree)
    tree = ljn.param_tree(small)
    tree["blocks"][0]["norm"]["scale"] = lj.Dense(jnp.ones((8, 8)))
    with pytest.raises(ConfigError, match="blocks/0/norm/scale"):
        ljn.with_leaves(MODEL, tree)


def test_binarize_equals_model_on_materialized_weights(tmp_path, ref):
    keep = 0.5
    small, report = ljn.compress(MODEL, lj.Step("binarize", (r"blocks/\d+/.*kernel$",),
                                                 {"keep": keep}))
    assert isinstance(small.blocks[0].attn.key.kernel.get_value(), lj.MaskedBinary)
    assert isinstance(small.blocks[1].mlp[1], ljn.LeafLinear)
    y = nnx.jit(lambda m, x: m(x))(small, X)
    dense = ljn.materialize(small)
    np.testing.assert_allclose(y, dense(X), atol=1e-5, rtol=0)
    for blk in range(2):
        for name in ("query", "out"):
            k = np.asarray(getattr(MODEL.blocks[blk].attn, name).kernel.get_value())
            n_in = 1 if name == "query" else 2
            want, n_keep = ref.binarize(k.reshape(int(np.prod(k.shape[:n_in])), -1), keep)
            got = getattr(dense.blocks[blk].attn, name).kernel.get_value()
            np.testing.assert_allclose(got, want.reshape(k.shape), atol=1e-5)
            row = next(r for r in report.rows if r.path == f"blocks/{blk}/attn/{name}/kernel")
            assert row.params_after == n_keep + 1 + 8  # + alpha + the float bias
    assert report.tree["params_after"] == lj.param_count(ljn.param_tree(small))
    save_params(tmp_path / "ckpt", ljn.param_tree(small))
    back = ljn.with_leaves(MODEL, load_params(tmp_path / "ckpt"))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(back, X), y)


def test_per_head_svd_on_attention_kernels(ref):
    small, report = ljn.compress(MODEL, lj.Step("svd", (r"attn/.*kernel$",),
                                                 {"rank": 2, "per_head": True}))
    assert isinstance(small.blocks[1].attn.value.kernel.get_value(), lj.HeadLowRank)
    assert isinstance(small.blocks[1].attn.out.kernel.get_value(), lj.LowRank)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(small, X), ljn.materialize(small)(X),
                               atol=1e-5, rtol=0)
    dense = ljn.materialize(small)
    for blk in range(2):
        for name in ("query", "key", "value"):  # [8, 2 heads, 4]
            k = np.asarray(getattr(MODEL.blocks[blk].attn, name).kernel.get_value())
            got = np.asarray(getattr(dense.blocks[blk].attn, name).kernel.get_value())
            np.testing.assert_allclose(got.reshape(8, 8), ref.per_head(k.reshape(8, 8), 2, 2),
                                       atol=1e-5)
        k = np.asarray(MODEL.blocks[blk].attn.out.kernel.get_value()).reshape(8, 8)
        got = np.asarray(dense.blocks[blk].attn.out.kernel.get_value()).reshape(8, 8)
        np.testing.assert_allclose(got, ref.rank(k, 2), atol=1e-5)
    assert sorted({r.kind for r in report.rows}) == ["svd", "svd-per-head"]
