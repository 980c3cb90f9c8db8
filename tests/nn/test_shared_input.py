"""Weights that read one input run their first products as one (execution setting
``fuse_products``): q, k and v of self-attention, k and v of cross-attention, a gated MLP's
``wi_0`` and ``wi_1``. Checked against NumPy and against the unfused block, and the program
is checked to hold the one concatenated product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import execution, nn
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import ChannelPruned, Dense, HeadLayout, QueryKey
from lowrank_jax.nn import execution as nn_exec

ON = dict(fuse_products=True, fuse_min_tokens=1)
OFF = dict(fuse_products=False)


def dot_widths(fn, *args) -> list[tuple[int, ...]]:
    """The output shape of every ``dot_general`` in ``fn``'s program (nested ones included)."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is jax.lax.dot_general_p:
                out.append(tuple(eqn.outvars[0].aval.shape))
            for v in eqn.params.values():
                for j in (v if isinstance(v, tuple) else (v,)):
                    if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                        walk(j.jaxpr)
                    elif hasattr(j, "eqns"):
                        walk(j)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def np_linear(leaf, x):
    f = lj.leaves.factors(leaf)
    w = np.asarray(f.second, np.float64)
    if f.first is not None:
        w = np.asarray(f.first, np.float64) @ w
    y = x @ w
    return y if f.bias is None else y + np.asarray(f.bias, np.float64)


def np_attention(params, x, kv, widths, scale):
    """Multi-head attention in float64 NumPy from the weights' factors."""
    q, k, v = (np_linear(params["qk"].q, x), np_linear(params["qk"].k, kv),
               np_linear(params["v"], kv))
    outs, at = [], 0
    for w in widths:
        qh, kh, vh = (a[..., at:at + w] for a in (q, k, v))
        logits = scale * np.einsum("bqd,bkd->bqk", qh, kh)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append(p @ vh)
        at += w
    return np_linear(params["o"], np.concatenate(outs, -1))


def attention_params(kind: str, seed=0, d=12, h=3, w=4, bias=True):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)

    def leaf(key, d_in, d_out, rank):
        if kind == "dense" or rank is None:
            return lj.init_dense(key, d_in, d_out, bias=bias)
        low = lj.init_lowrank(key, d_in, d_out, rank)
        return low.with_bias(0.1 * jnp.arange(d_out, dtype=jnp.float32)) if bias else low

    ranks = {"dense": (None, None, None), "lowrank": (5, 3, 6), "mixed": (5, None, 2)}[kind]
    return {"qk": QueryKey(q=leaf(keys[0], d, h * w, ranks[0]), k=leaf(keys[1], d, h * w, ranks[1]),
                           widths=(w,) * h),
            "v": leaf(keys[2], d, h * w, ranks[2]), "o": lj.init_dense(keys[3], h * w, d, bias=bias),
            "heads": HeadLayout.uniform(h, w, 1.0 / np.sqrt(w))}


@pytest.mark.parametrize("kind", ["dense", "lowrank", "mixed"])
def test_self_attention_fused_equals_numpy_and_unfused(kind):
    p = attention_params(kind)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 12))
    cfg = nn.AttentionConfig()

    def f(p, x):
        return nn.apply_attention(p, x, cfg)

    with execution.settings(**ON):
        fused = f(p, x)
        widths = dot_widths(f, p, x)
    with execution.settings(**OFF):
        plain = f(p, x)
        plain_widths = dot_widths(f, p, x)
    ref = np_attention(p, np.asarray(x, np.float64), np.asarray(x, np.float64), (4,) * 3,
                       0.5)
    np.testing.assert_allclose(np.asarray(fused), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(plain), rtol=1e-5, atol=1e-6)
    firsts = {"dense": 36, "lowrank": 5 + 3 + 6, "mixed": 5 + 12 + 2}[kind]
    assert (2, 7, firsts) in widths and (2, 7, firsts) not in plain_widths
    assert len(widths) == len(plain_widths) - 2  # three first products became one


def test_cross_attention_fuses_keys_and_values():
    p = attention_params("lowrank", seed=3)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 12))
    kv = jax.random.normal(jax.random.PRNGKey(2), (2, 9, 12))
    cfg = nn.AttentionConfig()

    def f(p, x, kv):
        return nn.apply_attention(p, x, cfg, kv=kv)

    with execution.settings(**ON, fold_keys=False):
        fused = f(p, x, kv)
        widths = dot_widths(f, p, x, kv)
    ref = np_attention(p, np.asarray(x, np.float64), np.asarray(kv, np.float64), (4,) * 3,
                       0.5)
    np.testing.assert_allclose(np.asarray(fused), ref, rtol=1e-5, atol=1e-5)
    assert (2, 9, 3 + 6) in widths  # keys' and values' first factors, one product


def test_fused_with_masks_bias_activation_masks_and_chunks():
    p = attention_params("mixed", seed=4)
    x = jax.random.normal(jax.random.PRNGKey(5), (4, 6, 12))
    mask = jnp.asarray(np.random.default_rng(0).random((4, 1, 6, 6)) > 0.3)
    bias = jax.random.normal(jax.random.PRNGKey(6), (1, 3, 6, 6))
    for cfg in (nn.AttentionConfig(), nn.AttentionConfig(qkv_keep=0.5, qkv_mask_seed=3)):
        outs = {}
        for name, s in (("plain", OFF), ("fused", ON),
                        ("fused chunks", dict(ON, cpu_chunks=True, attention_chunk_above_bytes=0,
                                              attention_chunk_bytes=1))):
            with execution.settings(**s):
                outs[name] = np.asarray(nn.apply_attention(p, x, cfg, mask=mask, bias=bias,
                                                           layer_index=1))
        np.testing.assert_allclose(outs["fused"], outs["plain"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outs["fused chunks"], outs["plain"], rtol=1e-5, atol=1e-6)


def test_gated_mlp_fused_equals_numpy():
    cfg = nn.MLPConfig(activation="gelu_tanh", gated=True, use_bias=True)
    p = nn.init_mlp(jax.random.PRNGKey(0), cfg, d_model=10, d_ff=16)
    p["wi_0"] = lj.init_lowrank(jax.random.PRNGKey(3), 10, 16, 4)  # mixed leaf types
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 10))
    with execution.settings(**ON):
        fused = nn.apply_mlp(p, x, cfg)
        widths = dot_widths(lambda p, x: nn.apply_mlp(p, x, cfg), p, x)
    xn = np.asarray(x, np.float64)
    a = np_linear(p["wi_0"], xn)
    gelu = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))
    ref = np_linear(p["wo"], gelu * np_linear(p["wi_1"], xn))
    np.testing.assert_allclose(np.asarray(fused), ref, rtol=1e-5, atol=1e-5)
    assert (3, 5, 4 + 16) in widths


def test_when_products_are_not_fused():
    d, x = lj.init_dense(jax.random.PRNGKey(0), 6, 4), jnp.ones((8, 6))
    low = lj.init_lowrank(jax.random.PRNGKey(1), 6, 4, 2)
    with execution.settings(fuse_products=True, fuse_min_tokens=9):
        assert nn_exec.shared_input([d, low], x) is None  # 8 rows < 9
    with execution.settings(fuse_products=True, fuse_min_tokens=8):
        got = nn_exec.shared_input([d, low], x)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(lj.linear(low, x)),
                                   rtol=1e-6)
        assert nn_exec.shared_input([d], x) is None  # one weight: nothing to fuse
        pruned = ChannelPruned(base=Dense(jnp.ones((3, 4))), rows=(0, 2, 3), d_in_full=6,
                               d_out_full=4)
        assert lj.leaves.factors(pruned).rows == (0, 2, 3)
        assert nn_exec.shared_input([d, pruned], x) is None  # different input rows
        both = nn_exec.shared_input([pruned, pruned], x)  # the same rows: gathered once
        np.testing.assert_allclose(np.asarray(both[0]), np.asarray(lj.linear(pruned, x)))
    with execution.settings(fuse_products=False, fuse_min_tokens=1):
        assert nn_exec.shared_input([d, low], x) is None
    with execution.settings(fuse_products=None, fuse_min_tokens=1):
        on = nn_exec.shared_input([d, low], x) is not None
        assert on == nn_exec.FUSE_BY_BACKEND[jax.default_backend()]
    with pytest.raises(ConfigError, match="fuse_min_tokens"):
        execution.Execution(fuse_min_tokens=0)


def test_setting_is_part_of_the_trace_key():
    cfg = nn.MLPConfig(gated=True)
    p = nn.init_mlp(jax.random.PRNGKey(0), cfg, d_model=6, d_ff=8)
    x = jnp.ones((4, 6))
    f = jax.jit(lambda p, x: nn.apply_mlp(p, x, cfg))
    with execution.settings(**ON):
        fused = f.lower(p, x).as_text()
    with execution.settings(**OFF):
        plain = f.lower(p, x).as_text()
    assert fused.count("dot_general") == plain.count("dot_general") - 1
    assert "tensor<4x16xf32>" in fused and "tensor<4x16xf32>" not in plain


def test_fused_products_under_bf16_forward_multiply_bf16():
    p = attention_params("lowrank", seed=7)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 12))
    cfg = nn.AttentionConfig()

    def f(p, x):
        return nn.apply_attention(p, x, cfg)

    with execution.settings(**ON):
        got = nn.dot_accumulation_dtypes(nn.bf16_forward(f, cast=False), nn.cast_weights(p), x)
        y16 = nn.bf16_forward(f)(p, x)
        y32 = f(p, x)
    assert got and all(acc == jnp.float32 and ops == (jnp.bfloat16, jnp.bfloat16)
                       for acc, ops in got)
    assert float(jnp.max(jnp.abs(y16 - y32)) / jnp.max(jnp.abs(y32))) < 3e-2


def test_cast_weights_stores_factors_and_gains_in_bf16():
    p = attention_params("lowrank", seed=2)
    mb = lj.leaves.init_masked_binary(jax.random.PRNGKey(0), 12, 36, 0.5)
    p["v"] = lj.leaves.PackedBinary.from_leaf(mb)
    cast = nn.cast_weights(p)
    for arr in jax.tree_util.tree_leaves(cast):
        if jnp.issubdtype(arr.dtype, jnp.floating):
            assert arr.dtype == jnp.bfloat16
    assert any(a.dtype == jnp.uint32 for a in jax.tree_util.tree_leaves(cast["v"]))


def test_rank_multiple_by_backend_and_in_the_svd_method():
    from lowrank_jax.compress import compress
    from lowrank_jax.errors import PlanError

    assert nn_exec.rank_multiple("cpu") == 1
    assert nn_exec.rank_multiple("gpu") == 16 and nn_exec.rank_multiple("tpu") == 128
    with pytest.raises(ConfigError, match="backend"):
        nn_exec.rank_multiple("abacus")
    tree = {"blk": {"w": lj.init_dense(jax.random.PRNGKey(0), 20, 20)}}
    _, rep = compress(tree, rules=["blk/w"], rank=5, rank_multiple="backend",
                      keep_dense_if_larger=False)
    m = nn_exec.rank_multiple()  # this backend's: 1 on CPU
    assert rep.rows[0].details["rank"] == min(20, -(-5 // m) * m)
    _, rep8 = compress(tree, rules=["blk/w"], rank=5, rank_multiple=8,
                       keep_dense_if_larger=False)
    assert rep8.rows[0].details["rank"] == 8
    with pytest.raises(PlanError, match="rank_multiple"):
        compress(tree, rules=["blk/w"], rank=5, rank_multiple="gpu")
