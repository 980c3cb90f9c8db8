"""A leaf type defined outside the package, with only the public protocol, runs everywhere.

``DiagonalPlusLowRank`` (``W = D + u v`` with ``D`` a sparse "diagonal" of static positions) is
written here, in a test module, the way a user would write a new compression method's leaf. The
library is not changed for it, and it must go through every block, the counts, the compression
report, save/load, the Hugging Face exporter (materialized) and a sharded train step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import nn
from lowrank_jax.leaves import Leaf, array_bits, array_size, leaf_dataclass, slice_bias

jax.config.update("jax_default_matmul_precision", "highest")


class DiagonalPlusLowRank(Leaf):
    """``W = D + u @ v`` where ``D[rows[i], cols[i]] = d[i]`` (a square diagonal at creation;
    removing channels keeps the surviving diagonal entries at their new positions).

    ``u: [d_in, r]``, ``v: [r, d_out]``, ``d: [k]``, ``rows``/``cols``: static positions.
    """

    d: jax.Array
    u: jax.Array
    v: jax.Array
    b: jax.Array | None = None
    rows: tuple[int, ...] = ()
    cols: tuple[int, ...] = ()

    @property
    def shape(self):
        return (self.u.shape[0], self.v.shape[1])

    def apply(self, x):
        y = (x @ self.u) @ self.v
        if self.rows:
            y = y.at[..., np.asarray(self.cols)].add(x[..., np.asarray(self.rows)] * self.d)
        return y if self.b is None else y + self.b

    def to_dense(self):
        w = self.u @ self.v
        if self.rows:
            w = w.at[np.asarray(self.rows), np.asarray(self.cols)].add(self.d)
        return w

    def param_count(self):
        return array_size(self.d) + array_size(self.u) + array_size(self.v) + array_size(self.b)

    def storage_bits(self):
        return array_bits(self.d) + array_bits(self.u) + array_bits(self.v) + array_bits(self.b)

    def flops(self, n_tokens):
        r = self.u.shape[1]
        return n_tokens * (r * (self.d_in + self.d_out) + len(self.rows))

    @property
    def bias(self):
        return self.b

    def with_bias(self, b):
        return dataclasses.replace(self, b=b)

    def keep_inputs(self, idx):
        new_pos = {int(i): j for j, i in enumerate(idx)}
        keep = [k for k, r in enumerate(self.rows) if r in new_pos]
        return DiagonalPlusLowRank(
            d=self.d[np.asarray(keep, int)], u=self.u[idx], v=self.v, b=self.b,
            rows=tuple(new_pos[self.rows[k]] for k in keep), cols=tuple(self.cols[k] for k in keep))

    def keep_outputs(self, idx):
        new_pos = {int(i): j for j, i in enumerate(idx)}
        keep = [k for k, c in enumerate(self.cols) if c in new_pos]
        return DiagonalPlusLowRank(
            d=self.d[np.asarray(keep, int)], u=self.u, v=self.v[:, idx], b=slice_bias(self.b, idx),
            rows=tuple(self.rows[k] for k in keep), cols=tuple(new_pos[self.cols[k]] for k in keep))

    def logical_axes(self):
        return {"d": (None,), "u": ("in", "rank"), "v": ("rank", "out"), "b": ("out",)}


DiagonalPlusLowRank = leaf_dataclass(DiagonalPlusLowRank, meta=("rows", "cols"))


def dplr(key, n: int, r: int, bias: bool = True) -> DiagonalPlusLowRank:
    kd, ku, kv, kb = jax.random.split(key, 4)
    return DiagonalPlusLowRank(
        d=1.0 + 0.1 * jax.random.normal(kd, (n,)), u=jax.random.normal(ku, (n, r)) / np.sqrt(n),
        v=jax.random.normal(kv, (r, n)) / np.sqrt(r),
        b=0.1 * jax.random.normal(kb, (n,)) if bias else None,
        rows=tuple(range(n)), cols=tuple(range(n)))


def reference(leaf) -> np.ndarray:
    """The dense matrix in float64, written independently of ``to_dense``."""
    w = np.asarray(leaf.u, np.float64) @ np.asarray(leaf.v, np.float64)
    for i, (r, c) in enumerate(zip(leaf.rows, leaf.cols, strict=True)):
        w[r, c] += float(leaf.d[i])
    return w


def test_leaf_protocol_against_numpy():
    leaf = dplr(jax.random.PRNGKey(0), 8, 3)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    want = x.astype(np.float64) @ reference(leaf) + np.asarray(leaf.b, np.float64)
    np.testing.assert_allclose(np.asarray(lj.linear(leaf, x)), want, atol=1e-5)
    np.testing.assert_allclose(lj.materialize_host(leaf), reference(leaf), atol=1e-6)
    idx_in, idx_out = np.array([0, 2, 3, 7]), np.array([1, 2, 5])
    sub = lj.keep_outputs(lj.keep_inputs(leaf, idx_in), idx_out)
    np.testing.assert_allclose(np.asarray(lj.materialize(sub)),
                               reference(leaf)[np.ix_(idx_in, idx_out)], atol=1e-6)
    assert lj.param_count(leaf) == 8 + 24 + 24 + 8
    assert lj.flops(leaf, 10) == 10 * (3 * 16 + 8)


def extended_params(key):
    """Attention (q, k, v, o) and MLP of an encoder layer with every weight a DPLR leaf."""
    cfg = nn.EncoderLayerConfig(attention=nn.AttentionConfig(), mlp=nn.MLPConfig(),
                                norm=nn.NormConfig())
    params = nn.init_encoder_layer(key, cfg, d_model=16, sizes=nn.LayerSizes(4, 4, 16))
    keys = iter(jax.random.split(jax.random.PRNGKey(7), 16))

    def swap(path, node):
        return dplr(next(keys), 16, 2) if isinstance(node, Leaf) else node

    return cfg, lj.map_with_path(swap, params)


def test_runs_through_blocks_against_dense():
    cfg, params = extended_params(jax.random.PRNGKey(1))
    dense = lj.map_with_path(
        lambda p, n: lj.Dense(w=jnp.asarray(reference(n), jnp.float32), b=n.b)
        if isinstance(n, DiagonalPlusLowRank) else n, params)
    x = np.random.default_rng(1).normal(size=(2, 5, 16)).astype(np.float32)
    got = nn.apply_encoder_layer(params, x, cfg)
    want = nn.apply_encoder_layer(dense, x, cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # physical head removal goes through the protocol as well
    small = dict(params, attn=nn.keep_heads(params["attn"], [0, 3]))
    y = nn.apply_encoder_layer(small, x, cfg)
    assert y.shape == (2, 5, 16) and bool(jnp.all(jnp.isfinite(y)))


def test_counts_are_sums_over_leaves():
    _, params = extended_params(jax.random.PRNGKey(2))
    leaves = [n for _, n in lj.named_leaves(params)]
    ours = [n for n in leaves if isinstance(n, DiagonalPlusLowRank)]
    assert len(ours) == 6  # q, k, v, o, wi, wo
    assert lj.flops(params, 3) == sum(3 * (2 * 32 + 16) for _ in ours)
    assert lj.param_count(params) == sum(n.param_count() if isinstance(n, Leaf)
                                         else int(np.size(n)) for n in leaves)


def test_save_load_round_trip(tmp_path):
    from lowrank_jax.io import load_params, save_params

    _, params = extended_params(jax.random.PRNGKey(3))
    small = dict(params, attn=nn.keep_heads(params["attn"], [1, 2]))
    save_params(tmp_path / "ckpt", small)
    back = load_params(tmp_path / "ckpt")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(small)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(small), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compress_plan_reports_the_leafs_own_counts():
    _, params = extended_params(jax.random.PRNGKey(4))
    plan = lj.Plan((lj.Step("svd", (r"attn/(v|o)$",), {"rank": 2}),))
    new, report = lj.apply_plan(params, plan)
    for path in ("attn/v", "attn/o"):
        row = report.row(path)
        old = lj.leaves.get_path(params, path)
        assert row.params_before == old.param_count() and row.bits_before == old.storage_bits()
        assert row.flops_before == old.flops(1)
        leaf = lj.leaves.get_path(new, path)
        assert isinstance(leaf, lj.LowRank) and leaf.rank == 2
        assert row.params_after == leaf.param_count()
        # the truncation error is the (r+1)-th singular value of the leaf's own dense matrix
        s = np.linalg.svd(reference(old), compute_uv=False)
        np.testing.assert_allclose(row.error, s[2] / s[0], rtol=1e-6)
    assert isinstance(lj.leaves.get_path(new, "attn/qk/q"), DiagonalPlusLowRank)  # not selected


def bert_with_dplr():
    """A tiny BERT whose attention projections are DPLR leaves."""
    from lowrank_jax.models import BertConfig, bert

    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=32, max_position_embeddings=16)
    params = bert.init(jax.random.PRNGKey(5), cfg)
    keys = iter(jax.random.split(jax.random.PRNGKey(6), 16))
    swapped = []

    def swap(path, node):
        if isinstance(node, Leaf) and "/attn/" in path:
            swapped.append(path)
            return dplr(next(keys), 16, 2)
        return node

    return cfg, lj.map_with_path(swap, params), swapped


def test_hugging_face_export_materializes_the_leaf(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lowrank_jax.convert import save_pretrained
    from lowrank_jax.models import bert

    cfg, params, swapped = bert_with_dplr()
    summary = save_pretrained(cfg, params, tmp_path / "hf")
    assert sorted(summary["materialized"]) == sorted(swapped)
    model = transformers.BertModel.from_pretrained(tmp_path / "hf", **summary["load_kwargs"]).eval()
    ids = np.random.default_rng(0).integers(0, 40, size=(2, 7))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).last_hidden_state.numpy()
    ours = bert.apply(params, {"input_ids": jnp.asarray(ids)}, cfg)["last_hidden_state"]
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)


def test_sharded_train_step_equals_single_device():
    import optax
    from jax.sharding import Mesh

    from lowrank_jax import train

    cfg, params = extended_params(jax.random.PRNGKey(8))
    x = np.random.default_rng(2).normal(size=(8, 5, 16)).astype(np.float32)
    y = np.random.default_rng(3).normal(size=(8, 5, 16)).astype(np.float32)

    def loss_fn(p, batch, key):
        del key
        out = nn.apply_encoder_layer(p, batch["x"], cfg)
        return jnp.mean(jnp.square(out - batch["y"])), {}

    opt = optax.sgd(0.1)
    batch = {"x": x, "y": y}
    single = train.make_train_step(loss_fn, opt)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharded = train.make_train_step(loss_fn, opt, mesh=mesh, axis_rules={"out": "model"},
                                    fsdp=True, fsdp_min_size=16)
    s1 = train.init_train_state(params, opt, key=jax.random.PRNGKey(0))
    s2 = train.init_train_state(params, opt, key=jax.random.PRNGKey(0))
    shardings = sharded.state_shardings(s2)
    # the placement comes from the leaf's own logical axes: v is ('rank', 'out') -> 'out' on
    # 'model' by the rule, then FSDP splits the first free divisible dim (rank 2) over 'data'
    v_spec = lj.leaves.get_path(shardings.params, "attn/v").v.spec
    assert tuple(v_spec) == ("data", "model")
    for _ in range(3):
        s1, m1 = single(s1, batch)
        s2, m2 = sharded(s2, batch)
        np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(train.full_params(s1)),
                    jax.tree_util.tree_leaves(train.full_params(s2)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


class Factored(Leaf):
    """``W = a @ c``: a leaf with only the required core, its bias and the ``factors``
    capability (no surgery, no placement of its own)."""

    a: jax.Array
    c: jax.Array
    bias_: jax.Array | None = None

    @property
    def shape(self):
        return (self.a.shape[0], self.c.shape[1])

    def apply(self, x):
        y = (x @ self.a) @ self.c
        return y if self.bias_ is None else y + self.bias_

    def to_dense(self):
        return self.a @ self.c

    def param_count(self):
        return array_size(self.a) + array_size(self.c) + array_size(self.bias_)

    def storage_bits(self):
        return array_bits(self.a) + array_bits(self.c) + array_bits(self.bias_)

    def flops(self, n_tokens):
        return n_tokens * self.a.shape[1] * (self.d_in + self.d_out)

    @property
    def bias(self):
        return self.bias_

    def factors(self):
        return lj.leaves.Factors(self.a, self.c, None, self.bias_)


Factored = leaf_dataclass(Factored)


def test_a_factored_leaf_folds_keys_like_lowrank():
    """A user's factored key and value leaves take attention's folded path (one query against
    many keys) exactly as ``LowRank`` does: the decision says fold, no key rows are projected,
    and the output equals the float64 NumPy block and the projected block."""
    from jax.extend import core as jex

    from lowrank_jax import execution

    r = np.random.default_rng(11)

    def f(*shape):
        return jnp.asarray(r.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)

    cfg = nn.AttentionConfig()
    p = nn.init_attention(jax.random.PRNGKey(12), cfg, d_model=16, num_heads=4)
    p = dict(p, qk=lj.QueryKey(p["qk"].q, Factored(f(16, 3), f(3, 16), f(16)), (4,) * 4),
             v=Factored(f(16, 2), f(2, 16), f(16)))
    assert nn.fold_keys(p, 1, 20) and not nn.fold_keys(p, 20, 20)
    x, enc = f(2, 1, 16), f(2, 20, 16)
    run = jax.jit(lambda p, x, enc: nn.apply_attention(p, x, cfg, kv=enc))

    def projects_keys(closed):
        def eqns(j):
            for e in j.eqns:
                yield e
                for sub in jex.jaxprs_in_params(e.params):
                    yield from eqns(sub)
        return any(e.primitive.name == "dot_general" and e.outvars[0].aval.shape[:2] == (2, 20)
                   for e in eqns(closed.jaxpr))

    assert not projects_keys(run.trace(p, x, enc).jaxpr)
    folded = run(p, x, enc)
    with execution.settings(fold_keys=False):
        assert projects_keys(run.trace(p, x, enc).jaxpr)
        projected = run(p, x, enc)

    def np_w(leaf):
        return np.asarray(leaf.a, np.float64) @ np.asarray(leaf.c, np.float64)

    x64, e64 = np.asarray(x, np.float64), np.asarray(enc, np.float64)
    wq, bq = np.asarray(p["qk"].q.w, np.float64), np.asarray(p["qk"].q.b, np.float64) \
        if p["qk"].q.b is not None else 0.0
    q = (x64 @ wq + bq).reshape(2, 1, 4, 4)
    k = (e64 @ np_w(p["qk"].k) + np.asarray(p["qk"].k.bias_, np.float64)).reshape(2, 20, 4, 4)
    v = (e64 @ np_w(p["v"]) + np.asarray(p["v"].bias_, np.float64)).reshape(2, 20, 4, 4)
    lg = np.einsum("bqhd,bkhd->bhqk", q, k) * 0.5
    att = np.exp(lg - lg.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", att, v).reshape(2, 1, 16)
    out = out @ np.asarray(p["o"].w, np.float64)
    if p["o"].b is not None:
        out = out + np.asarray(p["o"].b, np.float64)
    np.testing.assert_allclose(np.asarray(folded), out, atol=1e-5)
    np.testing.assert_allclose(np.asarray(folded), np.asarray(projected), atol=1e-5)


def test_missing_optional_capabilities_say_so():
    """A leaf without surgery gets a clear error naming its type and the method to implement;
    placement defaults to replicated arrays."""
    from lowrank_jax.errors import NotSupportedError

    leaf = Factored(jnp.ones((6, 2)), jnp.ones((2, 4)))
    with pytest.raises(NotSupportedError, match=r"Factored does not support keep_inputs.*"
                                                r"implement Factored\.keep_inputs"):
        lj.keep_inputs(leaf, np.array([0, 1]))
    with pytest.raises(NotSupportedError, match="keep_outputs"):
        lj.keep_outputs(leaf, np.array([0]))
    with pytest.raises(NotSupportedError, match="with_bias"):
        leaf.with_bias(jnp.zeros(4))
    assert leaf.logical_axes() == {"a": (None, None), "c": (None, None)}
    assert lj.leaves.weight_shape(leaf) == (6, 4)
