"""lowrank_jax.interop.channel_groups: structured pruning of a user's linen and nnx model by channel
groups over Flax paths. References: NumPy forwards of the same models with the channels
physically deleted, NumPy magnitude scores and selections, and per-sample mask gradients by
central differences of a float64 NumPy forward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowrank_jax as lj
from lowrank_jax.errors import ConfigError, PlanError, ShapeError
from lowrank_jax.interop import ChannelGroup
from lowrank_jax.interop import linen as ljl
from lowrank_jax.interop import nnx as ljn
from lowrank_jax.io import load_params, save_params
from lowrank_jax.leaves.channel_masked import ChannelPruned

# -- the models (the user's code; never changed) ---------------------------------------------


class Block(nn.Module):  # big_vision's encoder block: pre-LN, MHDPA, MLP
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
        y = nn.Dense(32)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(y))


class ViT(nn.Module):
    depth: int = 2

    @nn.compact
    def __call__(self, x):  # [batch, tokens, 10]
        x = nn.Dense(16, name="embedding")(x)
        for i in range(self.depth):
            x = Block(name=f"encoderblock_{i}")(x)
        return nn.Dense(3, name="head", use_bias=False)(nn.LayerNorm(name="norm")(x).mean(1))


class NnxBlock(nnx.Module):
    def __init__(self, d, *, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.mlp = nnx.List([nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)])

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp[1](nnx.gelu(self.mlp[0](x)))


class NnxNet(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Linear(6, 8, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(8, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(axis=1))


def _random(tree, seed):
    """Random biases and LayerNorm parameters too (init makes them 0 and 1, which would hide
    a bias or a norm the reference forgets)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        a + 0.3 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)])


X = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 10))
VIT = ViT()
VARS = _random(VIT.init(jax.random.PRNGKey(0), X), 7)
XN = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 6))
NET = NnxNet(rngs=nnx.Rngs(0))
nnx.update(NET, _random(nnx.state(NET, nnx.Param), 8))

# -- NumPy references --------------------------------------------------------------------------


def np_gelu(x):  # jax.nn.gelu(approximate=True), the default of nn.gelu / nnx.gelu
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def np_norm(p, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def np_attention(p, yq, heads=None, mask=None):
    """Multi-head attention with only the heads ``heads`` (deleted, not zeroed) and with
    ``mask [heads]`` multiplying every head's queries, keys, values and its rows of the output
    projection ("Less is More", eq. 4)."""
    n = p["query"]["kernel"].shape[1]
    heads = np.arange(n) if heads is None else np.asarray(heads)
    proj = {}
    for name in ("query", "key", "value"):
        w, b = p[name]["kernel"][:, heads], p[name]["bias"][heads]  # [d, h, hd], [h, hd]
        z = np.einsum("btd,dhe->bthe", yq, w) + b
        proj[name] = z if mask is None else z * mask[heads][:, None]
    q, k, v = proj["query"], proj["key"], proj["value"]
    logits = np.einsum("bqhe,bkhe->bhqk", q / np.sqrt(q.shape[-1]), k)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhe->bqhe", a, v)
    if mask is not None:
        o = o * mask[heads][:, None]
    return np.einsum("bqhe,hed->bqd", o, p["out"]["kernel"][heads]) + p["out"]["bias"]


def np_mlp(p0, p1, x, hidden=None, mask=None):
    hidden = np.arange(p0["kernel"].shape[1]) if hidden is None else np.asarray(hidden)
    h = x @ p0["kernel"][:, hidden] + p0["bias"][hidden]
    if mask is not None:
        h = h * mask[hidden]
    h = np_gelu(h)
    if mask is not None:
        h = h * mask[hidden]
    return h @ p1["kernel"][hidden] + p1["bias"]


def np_vit(variables, x, keep=None, masks=None):
    """The linen ViT; ``keep`` / ``masks``: ``{group name: kept units / mask}``."""
    p, x = f64(variables)["params"], np.asarray(x, np.float64)
    keep, masks = keep or {}, masks or {}
    x = x @ p["embedding"]["kernel"] + p["embedding"]["bias"]
    for i in range(sum(k.startswith("encoderblock_") for k in p)):
        b, name = p[f"encoderblock_{i}"], f"params/encoderblock_{i}"
        att = f"{name}/MultiHeadDotProductAttention_0"
        x = x + np_attention(b["MultiHeadDotProductAttention_0"], np_norm(b["LayerNorm_0"], x),
                             keep.get(att), masks.get(att))
        mlp = f"{name}/Dense_0"
        x = x + np_mlp(b["Dense_0"], b["Dense_1"], np_norm(b["LayerNorm_1"], x), keep.get(mlp),
                       masks.get(mlp))
    return np_norm(p["norm"], x).mean(1) @ p["head"]["kernel"]


def np_net(tree, x, keep=None):
    """The nnx net on :func:`ljn.param_tree`; ``keep``: ``{group name: kept units}``."""
    p, x = f64(tree), np.asarray(x, np.float64)
    keep = keep or {}
    x = x @ p["embed"]["kernel"] + p["embed"]["bias"]
    for i in range(2):
        b = p["blocks"][i]
        x = x + np_attention(b["attn"], np_norm(b["norm"], x), keep.get(f"blocks/{i}/attn"))
        x = x + np_mlp(b["mlp"][0], b["mlp"][1], x, keep.get(f"blocks/{i}/mlp/0"))
    return x.mean(1) @ p["head"]["kernel"]


def np_magnitude(tree, group):
    """RMS of each unit's weights over the group's kernels (flattened to [d_in, d_out])."""
    def at(path):
        node = tree
        for k in path.split("/")[:-1]:
            node = node[int(k)] if isinstance(node, (list, tuple)) or (
                isinstance(node, dict) and k not in node) else node[k]
        return np.asarray(node["kernel"], np.float64), node.get("bias")

    blocks = []
    for path in group.outputs:
        k, b = at(path)
        n_in = k.ndim - np.ndim(b)
        w = k.reshape(int(np.prod(k.shape[:n_in])), -1)
        n = k.shape[n_in] if group.unit == "head" else w.shape[1]
        blocks.append(w.reshape(w.shape[0], n, -1).transpose(1, 0, 2).reshape(n, -1))
    for path in group.inputs:
        k, _ = at(path)
        n = k.shape[0] if group.unit == "head" else k.reshape(-1, k.shape[-1]).shape[0]
        blocks.append(k.reshape(n, -1))
    w = np.concatenate(blocks, axis=1)
    return np.sqrt((w ** 2).mean(1))


def vit_groups(depth=2):
    out = []
    for i in range(depth):
        a = f"params/encoderblock_{i}/MultiHeadDotProductAttention_0"
        out.append(ChannelGroup(a, outputs=tuple(f"{a}/{n}/kernel" for n in ("query", "key",
                                                                            "value")),
                                inputs=(f"{a}/out/kernel",), unit="head"))
        m = f"params/encoderblock_{i}"
        out.append(ChannelGroup(f"{m}/Dense_0", outputs=(f"{m}/Dense_0/kernel",),
                                inputs=(f"{m}/Dense_1/kernel",)))
    return out


# -- tests -------------------------------------------------------------------------------------


def test_numpy_reference_is_the_model():
    np.testing.assert_allclose(np_vit(VARS, X), VIT.apply(VARS, X), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np_net(ljn.param_tree(NET), XN), NET(XN), atol=1e-5, rtol=0)


def test_infer_groups_finds_heads_and_mlps():
    by_name = lambda gs: sorted(gs, key=lambda g: g.name)  # noqa: E731
    # embedding [10, 16] and head [16, 3] are no MLP
    assert by_name(ljl.infer_groups(VARS)) == by_name(vit_groups())
    groups = ljn.infer_groups(NET)
    assert [(g.name, g.unit) for g in groups] == [
        ("blocks/0/attn", "head"), ("blocks/0/mlp/0", "channel"),
        ("blocks/1/attn", "head"), ("blocks/1/mlp/0", "channel")]
    assert groups[1].outputs == ("blocks/0/mlp/0/kernel",)
    assert groups[1].inputs == ("blocks/0/mlp/1/kernel",)
    assert groups[0].inputs == ("blocks/0/attn/out/kernel",)

    class Mlp(nn.Module):  # the second layer is created (and named) first
        @nn.compact
        def __call__(self, x):
            return nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(24)(x)))

    class Bottleneck(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4)(x)))

    x = jnp.ones((1, 8))
    first = (("params/Dense_1/kernel",), ("params/Dense_0/kernel",))  # (outputs, inputs)
    v = Mlp().init(jax.random.PRNGKey(0), x)
    for g in (ljl.infer_groups(v), ljl.infer_groups(v, Mlp(), x)):  # by widths, by calls
        assert [(g[0].outputs, g[0].inputs)] == [first]
    v = Bottleneck().init(jax.random.PRNGKey(0), x)  # widths mislead: the calls tell
    assert [(g.outputs, g.inputs) for g in ljl.infer_groups(v, Bottleneck(), x)] == [first]
    assert ljl.call_order(Bottleneck(), v, x) == ["params/Dense_1/kernel", "params/Dense_0/kernel"]


def test_linen_prune_equals_numpy_model_without_the_channels(tmp_path):
    groups = vit_groups()
    small, report = ljl.prune(VARS, groups, target=0.5)
    # NumPy: magnitude scores, the lowest half of every group's units removed
    keep = {}
    for g in groups:
        s = np_magnitude(VARS, g)
        np.testing.assert_allclose(ljl.magnitude_scores(VARS, [g])[g.name], s, rtol=1e-6)
        keep[g.name] = np.sort(np.argsort(s, kind="stable")[len(s) // 2:])
    info = report.steps[0].info["groups"]
    for g in groups:
        assert info[g.name]["kept"] == len(keep[g.name])
        assert sorted(set(range(info[g.name]["units"])) - set(info[g.name]["removed"])) == \
            list(keep[g.name])
    y = jax.jit(lambda v, x: ljl.apply(VIT, v, x))(small, X)
    np.testing.assert_allclose(y, np_vit(VARS, X, keep=keep), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(y) - np_vit(VARS, X)).max() > 1e-3
    # the model's code is unchanged: materialized, it is a plain Flax tree with zeros
    dense = ljl.materialize(small)
    assert jax.tree_util.tree_structure(dense) == jax.tree_util.tree_structure(VARS)
    np.testing.assert_allclose(VIT.apply(dense, X), y, atol=1e-5, rtol=0)
    # the leaves hold only the kept channels; counts by hand (d 16, 4 heads x 4, hidden 32)
    att = small["params"]["encoderblock_0"]["MultiHeadDotProductAttention_0"]
    q = att["query"]["kernel"]
    assert isinstance(q, ChannelPruned) and q.base.shape == (16, 8) and q.rows is None
    assert isinstance(att["out"]["kernel"], ChannelPruned) and att["out"]["kernel"].cols is None
    rows = {r.path.split("encoderblock_0/")[-1]: r for r in report.rows
            if "encoderblock_0/" in r.path}
    assert rows["Dense_0/kernel"].params_after == 16 * 16 + 16
    assert rows["Dense_1/kernel"].params_after == 16 * 16 + 16
    assert rows["MultiHeadDotProductAttention_0/query/kernel"].params_after == 16 * 8 + 8
    assert rows["MultiHeadDotProductAttention_0/out/kernel"].params_after == 8 * 16 + 16
    assert rows["Dense_1/kernel"].details["in_kept"] == 16
    assert report.tree["params_after"] == lj.param_count(small)
    assert report.tree["params_before"] - report.tree["params_after"] == 2 * (
        2 * 16 * 16 + 16 + 3 * (2 * 4 * 16 + 2 * 4) + 2 * 4 * 16)
    # orbax round trip
    save_params(tmp_path / "ckpt", small)
    back = load_params(tmp_path / "ckpt")
    np.testing.assert_array_equal(ljl.apply(VIT, back, X), ljl.apply(VIT, small, X))
    # other methods act on the kept channels afterwards: per-head svd keeps 2 heads of width 4
    both, rep2 = ljl.compress(small, lj.Step("svd", (r"encoderblock_0/.*kernel$",),
                                             {"rank": 2, "per_head": True}))
    row = next(r for r in rep2.rows if r.path.endswith("encoderblock_0/"
                                                       "MultiHeadDotProductAttention_0/key/kernel"))
    assert (row.kind, row.details["rank"], row.params_after) == ("svd-per-head", [2, 2],
                                                                 2 * 2 * (16 + 4) + 8)
    np.testing.assert_allclose(ljl.apply(VIT, both, X), VIT.apply(ljl.materialize(both), X),
                               atol=1e-5, rtol=0)


def test_nnx_prune_global_equals_numpy_model_without_the_channels():
    groups = ljn.infer_groups(NET)
    tree = ljn.param_tree(NET)
    small, report = ljn.prune(NET, groups, target=0.4, scope="global")
    assert isinstance(NET.blocks[0].mlp[0], nnx.Linear)  # the input model is unchanged
    info = report.steps[0].info["groups"]
    for i in range(2):  # a group that lost units runs on leaves, one that lost none stays plain
        lost = info[f"blocks/{i}/attn"]["kept"] < 2
        assert isinstance(small.blocks[i].attn.value, ljn.LeafLinearGeneral if lost else
                          nnx.LinearGeneral)
        lost = info[f"blocks/{i}/mlp/0"]["kept"] < 16
        assert isinstance(small.blocks[i].mlp[1], ljn.LeafLinear if lost else nnx.Linear)
    assert any(v["kept"] < v["units"] for v in info.values())
    # NumPy: one ranking over all units, lowest first, until 40 % of the parameters are gone
    costs = {g.name: (8 + 1) * 4 * 3 + 4 * 8 if g.unit == "head" else 8 + 1 + 8 for g in groups}
    total = sum(costs[g.name] * (2 if g.unit == "head" else 16) for g in groups)
    units = sorted((s, i, u) for i, g in enumerate(groups)
                   for u, s in enumerate(np_magnitude(tree, g)))
    alive = {g.name: set(range(2 if g.unit == "head" else 16)) for g in groups}
    removed = 0
    for _, i, u in units:
        if removed >= 0.4 * total:
            break
        name = groups[i].name
        if len(alive[name]) > 1:
            alive[name].discard(u)
            removed += costs[name]
    keep = {k: sorted(v) for k, v in alive.items()}
    assert {k: v["kept"] for k, v in info.items()} == {
        k: len(v) for k, v in keep.items()}
    y = nnx.jit(lambda m, x: m(x))(small, XN)
    np.testing.assert_allclose(y, np_net(tree, XN, keep=keep), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ljn.materialize(small)(XN), y, atol=1e-5, rtol=0)
    assert report.tree["params_before"] - report.tree["params_after"] == removed
    assert lj.param_count(ljn.param_tree(small)) == report.tree["params_after"]


def _sq_loss(logits, y):
    return jnp.mean(jnp.sum((logits - y) ** 2, -1))


def test_gradient_scores_are_eq6_of_numpy_mask_gradients():
    model = ViT(depth=1)
    v = _random(model.init(jax.random.PRNGKey(3), X), 9)
    groups = vit_groups(depth=1)
    xs = jax.random.normal(jax.random.PRNGKey(4), (2, 4, 5, 10))
    # targets near the outputs: residuals, gradients and scores of order one
    ys = jnp.stack([model.apply(v, xs[j]) for j in range(2)]) + 0.2 * jax.random.normal(
        jax.random.PRNGKey(5), (2, 4, 3))
    batches = [{"x": xs[j], "y": ys[j]} for j in range(2)]
    alpha = 0.6
    scores = ljl.gradient_scores(lambda t, b: _sq_loss(model.apply(t, b["x"]), b["y"]), v,
                                 groups, batches, alpha=alpha)
    # NumPy: per-sample dL_n/dm_u by central differences of the float64 forward at m = 1
    ema = {g.name: 0.0 for g in groups}
    for b in batches:
        x, y = np.asarray(b["x"], np.float64), np.asarray(b["y"], np.float64)
        for g in groups:
            n = 4 if g.unit == "head" else 32
            grads = np.zeros((x.shape[0], n))
            for u in range(n):
                for sign in (1.0, -1.0):
                    m = np.ones(n)
                    m[u] += sign * 1e-6
                    out = np_vit(v, x, masks={g.name: m})
                    grads[:, u] += sign * ((out - y) ** 2).sum(-1) / 2e-6
            s = np.abs(-grads.mean(0) + 0.5 * (grads ** 2).mean(0))
            ema[g.name] = alpha * s + (1 - alpha) * ema[g.name]
    for g in groups:
        np.testing.assert_allclose(scores[g.name], ema[g.name], atol=1e-5, rtol=0)
    # these scores drive the pruning: the kept units are the best by them
    small, report = ljl.prune(v, groups, target=0.5, scores=scores, scope="global")
    kept = report.steps[0].info["groups"]
    for g in groups:
        removed = kept[g.name]["removed"]
        live = [u for u in range(len(ema[g.name])) if u not in removed]
        assert max(ema[g.name][removed], default=-1) <= min(ema[g.name][live])


def test_nnx_gradient_scores_run_the_model_class():
    net = NnxNet(rngs=nnx.Rngs(5))  # as initialised: outputs of order one, as the scores
    groups = ljn.infer_groups(net)[:2]
    y = net(XN) + 0.2 * jax.random.normal(jax.random.PRNGKey(6), (3, 3))
    scores = ljn.gradient_scores(lambda m, b: _sq_loss(m(b["x"]), b["y"]), net, groups,
                                 [{"x": XN, "y": y}], alpha=1.0)
    tree = ljn.param_tree(net)
    x, y = np.asarray(XN, np.float64), np.asarray(y, np.float64)
    for g in groups:  # the first block's heads and MLP channels
        head = g.unit == "head"
        n = 2 if head else 16
        grads = np.zeros((3, n))
        for u in range(n):  # per-sample dL/dm by central differences, masks on the kernels
            for sign in (1.0, -1.0):
                t = jax.tree_util.tree_map(np.array, f64(tree))
                m = np.ones(n)
                m[u] += sign * 1e-6
                if head:
                    for name in ("query", "key", "value"):
                        t["blocks"][0]["attn"][name]["kernel"] *= m[:, None]
                        t["blocks"][0]["attn"][name]["bias"] *= m[:, None]
                    t["blocks"][0]["attn"]["out"]["kernel"] *= m[:, None, None]
                else:
                    t["blocks"][0]["mlp"][0]["kernel"] *= m
                    t["blocks"][0]["mlp"][0]["bias"] *= m
                    t["blocks"][0]["mlp"][1]["kernel"] *= m[:, None]
                grads[:, u] += sign * ((np_net(t, x) - y) ** 2).sum(-1) / 2e-6
        want = np.abs(-grads.mean(0) + 0.5 * (grads ** 2).mean(0))
        np.testing.assert_allclose(scores[g.name], want, atol=1e-5, rtol=0)


def test_bad_groups_name_the_flax_path():
    a = "params/encoderblock_0/MultiHeadDotProductAttention_0"
    with pytest.raises(ConfigError, match="params/encoderblock_0/Dense_7/kernel") as e:
        ljl.prune(VARS, [ChannelGroup("g", outputs=("params/encoderblock_0/Dense_7/kernel",))],
                  target=0.5)
    assert e.value.where == "params/encoderblock_0/Dense_7/kernel"
    # the MLP's hidden width (32) is not the attention output's input width (4 heads x 4)
    bad = ChannelGroup("g", outputs=("params/encoderblock_0/Dense_0/kernel",),
                       inputs=(f"{a}/out/kernel",))
    with pytest.raises(ShapeError, match=f"{a}/out/kernel") as e:
        ljl.prune(VARS, [bad], target=0.5)
    assert (e.value.where, e.value.expected, e.value.actual) == (f"{a}/out/kernel", 32, 16)
    # whole heads of a 2-D kernel
    with pytest.raises(ShapeError, match="params/encoderblock_0/Dense_0/kernel") as e:
        ljl.prune(VARS, [ChannelGroup("g", outputs=("params/encoderblock_0/Dense_0/kernel",),
                                      unit="head")], target=0.5)
    assert e.value.actual == (32,)
    # heads of two blocks that do not have the same number of heads
    other = Block(heads=2).init(jax.random.PRNGKey(0), jnp.ones((1, 3, 16)))
    mixed = {"params": {"a": VARS["params"]["encoderblock_0"], "b": other["params"]}}
    g = ChannelGroup("g", outputs=("params/a/MultiHeadDotProductAttention_0/query/kernel",
                                   "params/b/MultiHeadDotProductAttention_0/query/kernel"),
                     unit="head")
    with pytest.raises(ShapeError, match="params/b/MultiHeadDotProductAttention_0/query") as e:
        ljl.prune(mixed, [g], target=0.5)
    assert (e.value.expected, e.value.actual) == (4, 2)
    # one kernel's outputs in two groups; a compressed kernel
    g0 = vit_groups()[1]
    with pytest.raises(ConfigError, match="Dense_0/kernel: its outputs are in two groups"):
        ljl.prune(VARS, [g0, ChannelGroup("h", outputs=g0.outputs)], target=0.5)
    small, _ = ljl.compress(VARS, lj.Step("svd", (r"encoderblock_0/Dense_0/kernel$",),
                                          {"rank": 2}))
    with pytest.raises(ConfigError, match="Dense_0/kernel is already a LowRank"):
        ljl.prune(small, [g0], target=0.5)
    with pytest.raises(ConfigError, match="target"):
        ljl.prune(VARS, [g0], target=1.0)
    with pytest.raises(ConfigError, match="scores of group"):
        ljl.prune(VARS, [g0], target=0.5, scores={g0.name: np.ones(31)})
    # the plan's prune method with a target needs a model family; on Flax, groups say it
    with pytest.raises(PlanError, match="channel groups"):
        ljl.compress(VARS, lj.Step("prune", (r"Dense_0/kernel$",), {"target": 0.5}))


# -- one description, one selection: the plan method and the Flax path on the same model ----

D, HIDDEN, WI_BIAS = 6, (10, 14), (True, False)  # two residual MLPs; only the first wi has a bias


class Mlp(nn.Module):
    hidden: int
    bias: bool

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.hidden, use_bias=self.bias, name="Dense_0")(x)
        return x + nn.Dense(x.shape[-1], use_bias=False, name="Dense_1")(nn.gelu(h))


class MlpStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i, (h, b) in enumerate(zip(HIDDEN, WI_BIAS, strict=True)):
            x = Mlp(h, b, name=f"mlp_{i}")(x)
        return x


def np_stack(weights, x, keep=None):
    """The two MLPs in float64 with only the hidden channels ``keep[i]`` (deleted)."""
    x = np.asarray(x, np.float64)
    for i, (w1, b1, w2) in enumerate(weights):
        k = np.arange(w1.shape[1]) if keep is None else np.flatnonzero(keep[i])
        h = x @ w1[:, k] + (0.0 if b1 is None else b1[k])
        x = x + np_gelu(h) @ w2[k]
    return x


def test_plan_method_and_flax_select_the_same_channels_for_the_same_scores():
    from lowrank_jax.compress.prune import (
        Structure,
        add_channel_masks,
        progressive_prune,
        remove_masked,
    )
    from lowrank_jax.interop.channel_groups import resolve_groups
    from lowrank_jax.leaves import Dense, linear, mask_partition

    g = np.random.default_rng(11)
    weights = [(g.normal(size=(D, h)) / np.sqrt(D), g.normal(size=h) if b else None,
                g.normal(size=(h, D)) / np.sqrt(h)) for h, b in zip(HIDDEN, WI_BIAS, strict=True)]
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)  # noqa: E731
    # the same weights as a lowrank_jax tree (MLP blocks wi / wo) and as Flax variables
    tree = {"layers": [{"mlp": {"wi": Dense(w=f32(w1), b=f32(b1)), "wo": Dense(w=f32(w2))}}
                       for w1, b1, w2 in weights]}
    flax_vars = {"params": {f"mlp_{i}": {"Dense_0": {"kernel": f32(w1), **(
        {} if b1 is None else {"bias": f32(b1)})}, "Dense_1": {"kernel": f32(w2)}}
        for i, (w1, b1, w2) in enumerate(weights)}}
    x = g.normal(size=(4, 3, D))

    def run_tree(t, xx):
        for layer in t["layers"]:
            mlp = layer["mlp"]
            xx = xx + linear(mlp["wo"], jax.nn.gelu(linear(mlp["wi"], xx)))
        return xx

    np.testing.assert_allclose(run_tree(tree, f32(x)), np_stack(weights, x), atol=1e-5, rtol=0)
    np.testing.assert_allclose(MlpStack().apply(flax_vars, f32(x)), np_stack(weights, x),
                               atol=1e-5, rtol=0)

    # both describe the MLPs' hidden channels as one group over the two weights
    masked = add_channel_masks(tree, (r"mlp/wi$",))
    plan_groups = {grp.name: grp for grp in Structure(masked).groups if grp.kind == "hidden"}
    flax_groups = resolve_groups(flax_vars, ljl.infer_groups(flax_vars))
    assert [(grp.units, [(s.side, s.size) for s in grp.spans]) for grp in plan_groups.values()] \
        == [(grp.units, [(s.side, s.size) for s in grp.spans]) for grp in flax_groups] \
        == [(h, [("out", 1), ("in", 1)]) for h in HIDDEN]
    assert [grp.cost for grp in flax_groups] == [2 * D + 1, 2 * D]

    # the same scores: distinct, shuffled across both layers
    scores = 0.1 + 0.1 * g.permutation(sum(HIDDEN)).astype(np.float64)
    split = np.split(scores, np.cumsum(HIDDEN)[:-1])
    target = 0.4

    # NumPy: one ranking over both layers, lowest first, the fewest units that remove 40 % of
    # the parameters of the wi / wo pairs (a hidden channel costs its wi column, bias included,
    # and its wo row)
    cost = np.concatenate([np.full(h, 2 * D + int(b)) for h, b in zip(HIDDEN, WI_BIAS,
                                                                      strict=True)])
    order = np.argsort(scores)
    k = int(np.searchsorted(np.cumsum(cost[order]), target * cost.sum() - 1e-9) + 1)
    alive = np.ones(sum(HIDDEN), bool)
    alive[order[:k]] = False
    want = np.split(alive, np.cumsum(HIDDEN)[:-1])
    assert all(w.any() and not w.all() for w in want)  # both layers lose some, keep some

    # the plan method (Algorithm 1, one batch): a loss linear in the masks gives every mask
    # entry the per-sample gradient r, so eq. 6 scores it |-r + r^2 / 2|; r = 1 - sqrt(1 + 2 s)
    # scores it s. The residual-width inputs of wi get large scores (they are not compared).
    paths = [p for p, _ in lj.named_leaves(masked) if p.endswith("/wi")]
    r = []
    for s in split:
        r += [np.full(D, 1.0 - np.sqrt(1.0 + 2 * 1e3)), 1.0 - np.sqrt(1.0 + 2 * s)]
    r = jnp.asarray(np.concatenate(r)[None], jnp.float32)

    def linear_loss(params, batch, key):
        masks = jax.tree_util.tree_leaves(mask_partition(params)[0])  # wi m_in, m_out per layer
        return jnp.sum(batch["r"][0] * jnp.concatenate(masks)), {}

    alpha = 0.5
    res = progressive_prune(masked, linear_loss, [{"r": r}], target=target, steps=1, alpha=alpha)
    for p, s in zip(paths, split, strict=True):
        np.testing.assert_allclose(res.ema[f"{p}/m_out"], alpha * s, rtol=1e-5)
    plan_keep = [res.removal.hidden[p.rsplit("/", 1)[0]] for p in paths]

    # the Flax path, given the same scores
    small, report = ljl.prune(flax_vars, ljl.infer_groups(flax_vars), target=target,
                              scores={grp.name: s for grp, s in zip(flax_groups, split,
                                                                     strict=True)},
                              scope="global")
    info = report.steps[0].info["groups"]
    for grp, w, pk in zip(flax_groups, want, plan_keep, strict=True):
        np.testing.assert_array_equal(pk, w)
        assert info[grp.name]["removed"] == list(np.flatnonzero(~w))

    # and both pruned models compute the stack with those channels deleted
    np.testing.assert_allclose(run_tree(remove_masked(res.params), f32(x)),
                               np_stack(weights, x, want), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ljl.apply(MlpStack(), small, f32(x)), np_stack(weights, x, want),
                               atol=1e-5, rtol=0)


def test_the_old_module_name_still_resolves_with_a_warning():
    import lowrank_jax.interop as interop
    from lowrank_jax.interop import channel_groups

    with pytest.warns(DeprecationWarning, match="interop.channel_groups"):
        from lowrank_jax.interop import prune
    assert prune is channel_groups and prune.ChannelGroup is ChannelGroup
    with pytest.raises(AttributeError, match="nope"):
        interop.nope  # noqa: B018
