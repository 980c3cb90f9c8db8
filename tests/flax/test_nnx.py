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


# -- tied layers ------------------------------------------------------------------------------


class Tied(nnx.Module):
    """One MLP applied twice (ALBERT-style sharing): ``up``/``down`` and ``up_again`` /
    ``down_again`` are the same modules, and ``mid`` its own layer between the two calls."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(6, 12, rngs=rngs)
        self.down = nnx.Linear(12, 6, rngs=rngs)
        self.mid = nnx.Linear(6, 6, rngs=rngs)
        self.up_again = self.up
        self.down_again = self.down

    def __call__(self, x):
        h = x + self.down(nnx.relu(self.up(x)))
        h = nnx.relu(self.mid(h))
        return h + self.down_again(nnx.relu(self.up_again(h)))


TIED = Tied(rngs=nnx.Rngs(4))
XT = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (3, 6)), np.float64)


def np_tied(up, down, mid, x):
    """The tied model in NumPy from ``(kernel, bias)`` pairs; both calls of the MLP read the
    same ``up`` and ``down``."""
    relu = lambda z: np.maximum(z, 0.0)  # noqa: E731
    h = x + relu(x @ up[0] + up[1]) @ down[0] + down[1]
    h = relu(h @ mid[0] + mid[1])
    return h + relu(h @ up[0] + up[1]) @ down[0] + down[1]


def dense_pairs(model):
    return {n: (np.asarray(getattr(model, n).kernel.get_value(), np.float64),
                np.asarray(getattr(model, n).bias.get_value(), np.float64))
            for n in ("up", "down", "mid")}


def test_tied_numpy_reference_is_the_model():
    p = dense_pairs(TIED)
    np.testing.assert_allclose(TIED(jnp.asarray(XT, jnp.float32)), np_tied(p["up"], p["down"],
                                                                           p["mid"], XT),
                               atol=1e-5, rtol=0)


def test_tied_layer_is_compressed_under_both_names_and_counted_once(ref, tmp_path):
    p = dense_pairs(TIED)
    small, report = ljn.compress(TIED, lj.Step("svd", (r"^(up|down)/kernel$",), {"rank": 2}))
    assert small.up is small.up_again and small.down is small.down_again  # still tied
    assert isinstance(small.up_again, ljn.LeafLinear)
    assert isinstance(small.down_again.kernel.get_value(), lj.LowRank)
    # both call sites run the rank-2 truncation (NumPy SVD of the original kernels)
    trunc = {n: (ref.rank(p[n][0], 2), p[n][1]) for n in ("up", "down")}
    want = np_tied(trunc["up"], trunc["down"], p["mid"], XT)
    y = nnx.jit(lambda m, x: m(x))(small, jnp.asarray(XT, jnp.float32))
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=0)
    assert np.abs(want - np_tied(p["up"], p["down"], p["mid"], XT)).max() > 1e-2
    # counted once: the state holds each layer once, the report agrees and is smaller
    assert sorted(r.path for r in report.rows) == ["down/kernel", "up/kernel"]
    n_before = 6 * 12 + 12 + 12 * 6 + 6 + 6 * 6 + 6
    n_after = 2 * (6 + 12) + 12 + 2 * (12 + 6) + 6 + 6 * 6 + 6
    assert report.tree["params_before"] == n_before
    assert lj.param_count(ljn.param_tree(small)) == report.tree["params_after"] == n_after
    assert n_after < n_before
    # FLOPs per token of what is stored: each tied layer once (the model calls it twice)
    row = {r.path: r for r in report.rows}
    assert row["up/kernel"].flops_before == 6 * 12 and row["up/kernel"].flops_after == 2 * 18
    assert lj.flops(ljn.param_tree(small), 1) == 2 * 18 + 2 * 18
    # materialize keeps the tie and runs the same weights at both call sites
    dense = ljn.materialize(small)
    assert type(dense.up) is nnx.Linear and dense.up is dense.up_again
    np.testing.assert_allclose(dense(jnp.asarray(XT, jnp.float32)), want, atol=1e-5, rtol=0)
    # with_leaves from a saved tree: the same surgery, tied, every call site on the leaves
    save_params(tmp_path / "ckpt", ljn.param_tree(small))
    back = ljn.with_leaves(TIED, load_params(tmp_path / "ckpt"))
    assert back.down is back.down_again and isinstance(back.down_again, ljn.LeafLinear)
    np.testing.assert_allclose(back(jnp.asarray(XT, jnp.float32)), want, atol=1e-5, rtol=0)
    assert lj.param_count(ljn.param_tree(back)) == n_after
    assert isinstance(TIED.up_again, nnx.Linear)  # the input model is unchanged


def test_tied_layer_is_pruned_under_both_names():
    from lowrank_jax.interop import ChannelGroup

    p = dense_pairs(TIED)
    group = ChannelGroup("up", outputs=("up/kernel",), inputs=("down/kernel",))
    small, report = ljn.prune(TIED, [group], target=0.5)
    assert small.up is small.up_again and isinstance(small.up_again, ljn.LeafLinear)
    assert small.down is small.down_again and isinstance(small.down_again, ljn.LeafLinear)
    # NumPy: the 6 of 12 hidden channels with the largest RMS over up's column and down's row
    rms = np.sqrt((np.concatenate([p["up"][0].T, p["down"][0]], 1) ** 2).mean(1))
    keep = np.sort(np.argsort(-rms, kind="stable")[:6])
    assert report.steps[0].info["groups"]["up"]["kept"] == 6
    cut = {"up": (p["up"][0][:, keep], p["up"][1][keep]), "down": (p["down"][0][keep], p["down"][1]),
           "mid": p["mid"]}
    want = np_tied(cut["up"], cut["down"], cut["mid"], XT)
    y = nnx.jit(lambda m, x: m(x))(small, jnp.asarray(XT, jnp.float32))
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=0)
    assert np.abs(want - np_tied(p["up"], p["down"], p["mid"], XT)).max() > 1e-2
    n_before = lj.param_count(ljn.param_tree(TIED))
    assert lj.param_count(ljn.param_tree(small)) == report.tree["params_after"]
    assert n_before - report.tree["params_after"] == 6 * (6 + 1) + 6 * 6  # once, not twice


def test_tied_layer_named_by_its_second_name_or_sharing_a_variable_is_refused():
    from lowrank_jax.interop import ChannelGroup

    with pytest.raises(PlanError, match="up_again/kernel only, which is the layer up/kernel"):
        ljn.compress(TIED, lj.Step("svd", (r"up_again/kernel$",), {"rank": 2}))
    with pytest.raises(ConfigError, match="down_again/kernel is the layer down/kernel"):
        ljn.prune(TIED, [ChannelGroup("u", outputs=("up/kernel",),
                                      inputs=("down_again/kernel",))], target=0.5)

    class SharedKernel(nnx.Module):
        def __init__(self, *, rngs):
            self.a = nnx.Linear(8, 8, rngs=rngs)
            self.b = nnx.Linear(8, 8, rngs=rngs)
            self.b.kernel = self.a.kernel  # one variable, two modules with their own biases

        def __call__(self, x):
            return self.b(self.a(x))

    model = SharedKernel(rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=r"a/kernel: this layer shares its kernel or bias "
                                          r"variable with \['b/kernel'\]"):
        ljn.compress(model, lj.Step("svd", (r"^a/kernel$",), {"rank": 2}))
