"""lowrank_jax.interop.linen: a user's linen model, defined here, compressed by a plan over Flax
paths and run unchanged through nn.intercept_methods; references are the same unmodified model
on materialized weights and NumPy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowrank_jax as lj
from lowrank_jax.errors import ConfigError, PlanError, ShapeError
from lowrank_jax.interop import KernelShape, leaf_mask
from lowrank_jax.interop import linen as ljl
from lowrank_jax.io import load_params, save_params
from lowrank_jax.train import TrainState, make_train_step


class Encoder1DBlock(nn.Module):  # big_vision style: pre-LN, MHDPA, MLP block
    mlp_dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(y, y)
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(self.mlp_dim)(y)
        y = nn.gelu(y)
        return x + nn.Dense(x.shape[-1])(y)


class TinyViT(nn.Module):
    width: int = 16
    depth: int = 2
    num_classes: int = 5

    @nn.compact
    def __call__(self, x):  # [batch, tokens, features]
        x = nn.Dense(self.width, name="embedding")(x)
        for i in range(self.depth):
            x = Encoder1DBlock(mlp_dim=2 * self.width, num_heads=2, name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(self.num_classes, name="head", use_bias=False)(x.mean(axis=1))


MODEL = TinyViT()
X = jax.random.normal(jax.random.PRNGKey(1), (3, 6, 10))
VARS = MODEL.init(jax.random.PRNGKey(0), X)
BLOCKS = r"encoderblock_\d+/.*kernel$"
PLAN = lj.Plan((lj.Step("svd", (BLOCKS,), {"rank": 3}),))


def _np_rank(w, r):
    u, s, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def test_compressed_equals_model_on_materialized_weights():
    small, report = ljl.compress(VARS, PLAN)
    attn = small["params"]["encoderblock_0"]["MultiHeadDotProductAttention_0"]
    assert isinstance(attn["query"]["kernel"], lj.LowRank)
    assert attn["query"]["kernel_shape"] == KernelShape((16,), (2, 8))
    assert attn["out"]["kernel_shape"] == KernelShape((2, 8), (16,))
    assert "bias" not in attn["query"]  # folded into the leaf
    # layers no rule selects stay plain Flax arrays
    assert isinstance(small["params"]["embedding"]["kernel"], jax.Array)
    y = jax.jit(lambda v, x: ljl.apply(MODEL, v, x))(small, X)
    dense = ljl.materialize(small)
    assert jax.tree_util.tree_structure(dense) == jax.tree_util.tree_structure(VARS)
    y_ref = MODEL.apply(dense, X)  # the unmodified model, plain Flax weights
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
    # the materialized weights are the rank-3 truncations (NumPy SVD, independent)
    for name in ("query", "out"):
        k = VARS["params"]["encoderblock_1"]["MultiHeadDotProductAttention_0"][name]["kernel"]
        got = dense["params"]["encoderblock_1"]["MultiHeadDotProductAttention_0"][name]["kernel"]
        n_in = 1 if name == "query" else 2
        m = np.asarray(k).reshape(int(np.prod(k.shape[:n_in])), -1)
        np.testing.assert_allclose(np.asarray(got).reshape(m.shape), _np_rank(m, 3), atol=1e-5)
    # and the compressed model is not the dense one
    assert np.abs(np.asarray(y) - np.asarray(MODEL.apply(VARS, X))).max() > 1e-3
    # report rows name the Flax paths; counts are the leaves' own
    paths = [r.path for r in report.rows]
    assert "params/encoderblock_0/MLPBlock_0/Dense_0/kernel" not in paths
    assert "params/encoderblock_0/Dense_0/kernel" in paths
    assert "params/encoderblock_1/MultiHeadDotProductAttention_0/out/kernel" in paths
    n_orig = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(VARS))
    assert report.tree["params_before"] == n_orig
    assert lj.param_count(small) == report.tree["params_after"]
    row = next(r for r in report.rows if r.path.endswith("encoderblock_0/Dense_0/kernel"))
    assert (row.params_before, row.params_after) == (16 * 32 + 32, 3 * (16 + 32) + 32)


def test_full_rank_equals_original():
    plan = lj.Step("svd", (r"kernel$",), {"eps": 1e-7, "keep_dense_if_larger": False})
    full, _ = ljl.compress(VARS, plan)
    assert isinstance(full["params"]["head"]["kernel"], lj.LowRank)
    np.testing.assert_allclose(ljl.apply(MODEL, full, X), MODEL.apply(VARS, X), atol=1e-5, rtol=0)


def test_train_step_updates_only_the_factors():
    model = TinyViT(depth=1)  # one block: a small compile
    small, _ = ljl.compress(model.init(jax.random.PRNGKey(0), X), PLAN)
    y = jax.nn.one_hot(jnp.arange(3) % 5, 5)

    def loss_fn(params, batch, key):
        logits = ljl.apply(model, params, batch["x"])
        return optax.softmax_cross_entropy(logits, batch["y"]).mean(), {}

    train, frozen = lj.partition(small, leaf_mask(small))
    opt = optax.adam(1e-2)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=train, frozen=frozen,
                       opt_state=opt.init(train), rng=jax.random.PRNGKey(0),
                       data_position=jnp.zeros((), jnp.int32), model_state=None)
    step = make_train_step(loss_fn, opt, donate=False)
    for _ in range(2):
        state, metrics = step(state, {"x": X, "y": y})
    assert np.isfinite(float(metrics["loss"]))
    new = lj.combine(state.params, state.frozen)
    before = dict(lj.named_leaves(small))
    after = dict(lj.named_leaves(new))
    assert before.keys() == after.keys()
    n_changed = 0
    for path, a in after.items():
        b = before[path]
        if isinstance(a, lj.LowRank):  # the factors moved
            assert not np.array_equal(a.u, b.u) and not np.array_equal(a.v, b.v), path
            n_changed += 1
        else:  # everything else is bit-identical
            assert np.array_equal(np.asarray(a), np.asarray(b)), path
    assert n_changed == 6  # q, k, v, out, Dense_0, Dense_1
    # no dense kernel of a compressed layer exists in what is trained
    for path, a in lj.named_leaves(state.params):
        if a is not None and not isinstance(a, lj.Leaf):
            assert path.endswith(("/u", "/v", "/b")), path


def test_model_written_with_leaf_modules_runs_the_same_params():
    class LeafBlock(nn.Module):  # the MLP of Encoder1DBlock, rewritten with LeafDense
        @nn.compact
        def __call__(self, x):
            y = ljl.LeafDense(32, name="Dense_0")(x)
            return ljl.LeafDenseGeneral((2, 8), name="Dense_1")(nn.gelu(y))

    class FlaxBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(32, name="Dense_0")(x)
            return nn.DenseGeneral((2, 8), name="Dense_1")(nn.gelu(y))

    x = jax.random.normal(jax.random.PRNGKey(2), (4, 16))
    v = FlaxBlock().init(jax.random.PRNGKey(3), x)
    small, _ = ljl.compress(v, lj.Step("svd", ("kernel$",), {"rank": 4}))
    y_leaf = LeafBlock().apply(small, x)  # no interception: the modules hold the leaves
    np.testing.assert_allclose(y_leaf, FlaxBlock().apply(ljl.materialize(small), x), atol=1e-5)
    # init of the leaf modules gives the same tree structure as compress of the Flax modules
    fresh = LeafBlock().init(jax.random.PRNGKey(3), x)
    dense, _ = ljl.compress(v, lj.Step("svd", ("kernel$",), {"rank": 16}),
                            keep_flax_unchanged=False)  # rank >= min(d): kept dense
    assert (jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(dense))
    lr = ljl.LeafDense(8, leaf_init=lambda k, i, o, b: lj.init_lowrank(k, i, o, 2, bias=b))
    p = lr.init(jax.random.PRNGKey(0), x)
    leaf = p["params"]["kernel"]
    assert isinstance(leaf, lj.LowRank) and leaf.rank == 2
    np.testing.assert_allclose(lr.apply(p, x), np.asarray(x) @ (np.asarray(leaf.u) @ leaf.v)
                               + np.asarray(leaf.b), atol=1e-5)


def test_save_load_round_trip(tmp_path):
    small, _ = ljl.compress(VARS, PLAN)
    save_params(tmp_path / "ckpt", small)
    back = load_params(tmp_path / "ckpt")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(small)
    np.testing.assert_array_equal(ljl.apply(MODEL, back, X), ljl.apply(MODEL, small, X))
    np.testing.assert_allclose(MODEL.apply(ljl.materialize(back), X), ljl.apply(MODEL, small, X),
                               atol=1e-5)


def test_rule_matching_no_kernel_names_the_flax_paths():
    with pytest.raises(PlanError, match="MultiHeadDotProductAttention_0/query/kernel") as e:
        ljl.compress(VARS, lj.Step("svd", (r"attention/q$",), {"rank": 2}))
    assert e.value.where == r"attention/q$"


def test_bad_shapes_name_the_flax_path():
    bad = jax.tree_util.tree_map(lambda a: a, VARS)
    bad["params"]["head"] = {"kernel": VARS["params"]["head"]["kernel"], "bias": jnp.zeros(7)}
    with pytest.raises(ShapeError, match="params/head/kernel"):
        ljl.compress(bad, lj.Step("svd", (r"head/kernel$",), {"rank": 2}))
    # compressed params of a model with other widths: the module and the leaf disagree
    small, _ = ljl.compress(VARS, lj.Step("svd", (r"head/kernel$",), {"rank": 2}))
    with pytest.raises(ShapeError, match="params/head/kernel") as e:
        ljl.apply(TinyViT(num_classes=4), small, X)
    assert (e.value.expected, e.value.actual) == (4, 5)
    # an attention projection whose leaf does not fit the module's heads and input width
    attn = nn.MultiHeadDotProductAttention(num_heads=4)
    p = attn.init(jax.random.PRNGKey(0), jnp.ones((1, 3, 16)))
    p["params"]["query"] = {"kernel": lj.Dense(jnp.ones((10, 16)))}
    with pytest.raises(ShapeError, match="params/query/kernel") as e:
        ljl.apply(attn, p, jnp.ones((1, 3, 16)))
    assert (e.value.expected, e.value.actual) == ((16, 16), (10, 16))
    # a 3-D kernel without a bias cannot tell its input dimensions
    v = nn.DenseGeneral((2, 4), use_bias=False).init(jax.random.PRNGKey(0), jnp.ones((1, 6)))
    with pytest.raises(ConfigError, match="params/kernel"):
        ljl.compress(v, lj.Step("svd", ("kernel",), {"rank": 2}))
    small, _ = ljl.compress(v, lj.Step("svd", ("kernel",), {"rank": 2}), in_dims={"kernel": 1})
    assert small["params"]["kernel_shape"] == KernelShape((6,), (2, 4))


def test_leaf_on_unsupported_module_names_the_path():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(4, (3,), name="conv")(x)

    x = jnp.ones((1, 5, 2))
    v = Net().init(jax.random.PRNGKey(0), x)
    small, _ = ljl.compress(v, lj.Step("svd", ("conv/kernel",), {"rank": 1}))
    with pytest.raises(ConfigError, match="params/conv/kernel.*Conv"):
        ljl.apply(Net(), small, x)



def _at(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def test_binarize_equals_model_on_materialized_weights(tmp_path, ref):
    keep = 0.25
    small, report = ljl.compress(VARS, lj.Step("binarize", (BLOCKS,), {"keep": keep}))
    attn = small["params"]["encoderblock_0"]["MultiHeadDotProductAttention_0"]
    assert isinstance(attn["query"]["kernel"], lj.MaskedBinary)
    assert attn["query"]["kernel_shape"] == KernelShape((16,), (2, 8))
    run = jax.jit(lambda v, x: ljl.apply(MODEL, v, x))  # op by op, a top-k mask is slow
    y = run(small, X)
    dense = ljl.materialize(small)
    np.testing.assert_allclose(y, MODEL.apply(dense, X), atol=1e-5, rtol=0)
    assert len(report.rows) == 12
    for row in report.rows:  # every kernel is NumPy's binarization of its [d_in, d_out] matrix
        prefix = row.path[: -len("/kernel")]
        k, b = _at(VARS, prefix)["kernel"], _at(VARS, prefix)["bias"]
        n_in = k.ndim - b.ndim
        want, n_keep = ref.binarize(np.reshape(k, (int(np.prod(k.shape[:n_in])), -1)), keep)
        np.testing.assert_allclose(_at(dense, prefix)["kernel"], want.reshape(k.shape), atol=1e-5)
        np.testing.assert_array_equal(_at(dense, prefix)["bias"], b)  # kept in float
        # counts: one bit per kept weight + a float32 alpha, the bias in float32
        assert (row.kind, row.details["n_keep"]) == ("binary", n_keep)
        assert row.params_after == n_keep + 1 + b.size
        assert row.bits_after == n_keep + 32 + 32 * b.size
    assert report.tree["params_after"] == lj.param_count(small)
    # Biprop trains the scores and the bias, never w
    mask = leaf_mask(small)["params"]["encoderblock_1"]["Dense_0"]["kernel"]
    assert (mask.w, mask.s, mask.b) == (False, True, True)
    # masks frozen (one jit), packed into bits, still run by the unchanged model
    from lowrank_jax.leaves import PackedBinary, pack_binary_tree

    binary = lambda n: isinstance(n, lj.MaskedBinary)  # noqa: E731
    frozen = jax.jit(lambda t: jax.tree_util.tree_map(
        lambda n: n.freeze() if binary(n) else n, t, is_leaf=binary))(small)
    packed = pack_binary_tree(frozen)
    assert isinstance(_at(packed, "params/encoderblock_1/Dense_1")["kernel"], PackedBinary)
    np.testing.assert_allclose(run(packed, X), y, atol=1e-5, rtol=0)
    # orbax round trip
    save_params(tmp_path / "ckpt", small)
    back = load_params(tmp_path / "ckpt")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(small)
    np.testing.assert_array_equal(run(back, X), y)



def test_per_head_svd_on_attention_kernels(ref):
    plan = lj.Step("svd", (r"MultiHeadDotProductAttention_0/.*kernel$",),
                   {"rank": 3, "per_head": True})
    small, report = ljl.compress(VARS, plan)
    attn = small["params"]["encoderblock_1"]["MultiHeadDotProductAttention_0"]
    for name in ("query", "key", "value"):  # [d, heads, head_dim]: one sketch per head
        leaf = attn[name]["kernel"]
        assert isinstance(leaf, lj.HeadLowRank) and leaf.u.shape == (16, 2, 3)  # [d, heads, r]
    assert isinstance(attn["out"]["kernel"], lj.LowRank)  # its inputs are the heads: shared
    y = jax.jit(lambda v, x: ljl.apply(MODEL, v, x))(small, X)
    dense = ljl.materialize(small)
    np.testing.assert_allclose(y, MODEL.apply(dense, X), atol=1e-5, rtol=0)
    for blk in ("encoderblock_0", "encoderblock_1"):
        a0 = VARS["params"][blk]["MultiHeadDotProductAttention_0"]
        a1 = dense["params"][blk]["MultiHeadDotProductAttention_0"]
        for name in ("query", "key", "value"):
            k = np.asarray(a0[name]["kernel"])  # [16, 2, 8]
            np.testing.assert_allclose(np.asarray(a1[name]["kernel"]).reshape(16, 16),
                                       ref.per_head(k.reshape(16, 16), 2, 3), atol=1e-5)
        k = np.asarray(a0["out"]["kernel"]).reshape(16, 16)
        np.testing.assert_allclose(np.asarray(a1["out"]["kernel"]).reshape(16, 16),
                                   _np_rank(k, 3), atol=1e-5)
    kinds = {r.path.rsplit("/", 2)[-2]: (r.kind, r.details["rank"]) for r in report.rows}
    assert kinds == {"query": ("svd-per-head", [3, 3]), "key": ("svd-per-head", [3, 3]),
                     "value": ("svd-per-head", [3, 3]), "out": ("svd", 3)}
    row = next(r for r in report.rows if r.path.endswith("encoderblock_0/"
                                                         "MultiHeadDotProductAttention_0/query/kernel"))
    assert (row.params_before, row.params_after) == (16 * 16 + 16, 2 * 3 * (16 + 8) + 16)
    # a model whose heads are not a kernel axis (nn.Dense) keeps the shared factorization
    full, rep = ljl.compress(VARS, lj.Step("svd", (r"encoderblock_0/Dense_0/kernel$",),
                                           {"rank": 3, "per_head": True}))
    assert isinstance(full["params"]["encoderblock_0"]["Dense_0"]["kernel"], lj.LowRank)


class ScanLayer(nn.Module):  # one layer of a stack run by nn.scan (big_vision's scan=True)
    @nn.compact
    def __call__(self, x, _):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(x, x)
        return x + nn.Dense(8)(nn.gelu(nn.Dense(16)(x))), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(ScanLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)
        return stack(name="encoderblock")(x, None)[0]


def test_scanned_stack_compresses_every_layer(tmp_path, ref):
    from lowrank_jax.interop.kernels import restack, unstack

    model, x = Scanned(), jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
    v = model.init(jax.random.PRNGKey(0), x)
    stack = ("params/encoderblock",)
    plan = [lj.Step("svd", (r"/(query|key|value)/kernel$",), {"rank": 2, "per_head": True}),
            lj.Step("svd", (r"Dense_\d/kernel$", r"out/kernel$"), {"rank": 3})]
    small, report = ljl.compress(v, plan, stacked=stack)
    leaf = small["params"]["encoderblock"]["Dense_0"]["kernel"]  # the layer axis first
    assert isinstance(leaf, lj.LowRank) and leaf.u.shape == (3, 16, 3) and leaf.v.shape == (3, 3, 8)
    assert len(report.rows) == 18  # 6 kernels x 3 layers, at per-layer paths
    assert "params/encoderblock/2/MultiHeadDotProductAttention_0/value/kernel" in {
        r.path for r in report.rows}
    assert report.tree["params_before"] == sum(np.size(a) for a in jax.tree_util.tree_leaves(v))
    run = jax.jit(lambda t, x: ljl.apply(model, t, x))
    y = run(small, x)
    dense = ljl.materialize(small, stacked=stack)
    assert jax.tree_util.tree_structure(dense) == jax.tree_util.tree_structure(v)
    np.testing.assert_allclose(y, model.apply(dense, x), atol=1e-5, rtol=0)
    p0, p1 = v["params"]["encoderblock"], dense["params"]["encoderblock"]
    for i in range(3):  # every layer: NumPy truncations of its own kernels
        np.testing.assert_allclose(p1["Dense_0"]["kernel"][i], ref.rank(p0["Dense_0"]["kernel"][i], 3),
                                   atol=1e-5)
        q = p0["MultiHeadDotProductAttention_0"]["query"]["kernel"][i].reshape(8, 8)
        np.testing.assert_allclose(
            p1["MultiHeadDotProductAttention_0"]["query"]["kernel"][i].reshape(8, 8),
            ref.per_head(q, 2, 2), atol=1e-5)
    # checkpoints hold the per-layer leaves (a stacked array is no leaf of its own)
    save_params(tmp_path / "ckpt", unstack(small, stack))
    np.testing.assert_array_equal(run(restack(load_params(tmp_path / "ckpt"), stack), x), y)
    # errors name the path: no stacked=, ranks per layer, some layers only
    with pytest.raises(ShapeError, match="encoderblock/Dense_0/kernel.*nn.scan"):
        ljl.compress(v, lj.Step("svd", (r"Dense_0/kernel$",), {"rank": 2}))
    with pytest.raises(ShapeError, match=r"params/encoderblock/\d/Dense_0/kernel.*fixed rank"):
        ljl.compress(v, lj.Step("svd", ((r"encoderblock/1/Dense_0/kernel$", {"rank": 2}),
                                        r"Dense_0/kernel$"), {"rank": 3}), stacked=stack)
    with pytest.raises(ShapeError, match=r"params/encoderblock/\d/Dense_0.*select all of them"):
        ljl.compress(v, lj.Step("svd", (r"encoderblock/0/Dense_0/kernel$",), {"rank": 2}),
                     stacked=stack)


class ReusedCompact(nn.Module):  # one nn.Dense called twice (compact)
    @nn.compact
    def __call__(self, x):
        d = nn.Dense(8)
        return d(nn.relu(nn.Dense(8)(nn.relu(d(x)))))


class ReusedSetup(nn.Module):  # one submodule under two attribute names (setup)
    def setup(self):
        self.first = nn.Dense(8)
        self.mid = nn.Dense(8)
        self.last = self.first

    def __call__(self, x):
        return self.last(nn.relu(self.mid(nn.relu(self.first(x)))))


@pytest.mark.parametrize("model,shared,other", [(ReusedCompact(), "Dense_0", "Dense_1"),
                                                (ReusedSetup(), "first", "mid")],
                         ids=["compact", "setup"])
def test_reused_module_runs_the_leaf_at_every_call_and_is_counted_once(model, shared, other, ref):
    """linen keeps one parameter entry for a reused module, so every call is intercepted on the
    leaf; the counts (parameters and FLOPs per token) hold it once."""
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    variables = model.init(jax.random.PRNGKey(0), x)
    assert sorted(variables["params"]) == sorted([shared, other])
    small, report = ljl.compress(variables, lj.Step("svd", (rf"{shared}/kernel$",), {"rank": 2}))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables)["params"]
    w, b = ref.rank(p[shared]["kernel"], 2), p[shared]["bias"]
    xn = np.asarray(x, np.float64)
    h = np.maximum(np.maximum(xn @ w + b, 0) @ p[other]["kernel"] + p[other]["bias"], 0)
    want = h @ w + b
    np.testing.assert_allclose(jax.jit(lambda v, x: ljl.apply(model, v, x))(small, x), want,
                               atol=1e-5, rtol=0)
    row = report.rows[0]
    assert row.params_before == 8 * 8 + 8 and row.params_after == 2 * 16 + 8
    assert row.flops_before == 8 * 8 and row.flops_after == 2 * 16  # once, though called twice
    assert report.tree["params_after"] == lj.param_count(small) < lj.param_count(variables)
