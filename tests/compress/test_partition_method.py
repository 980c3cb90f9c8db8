"""The ``partition`` plan method on an MLP and a whole encoder layer ("Partitioning Transformer
Networks with Low Intercommunication", sec. II): the function is kept at full rank, the rows
match NumPy, the layer runs under shard_map with exactly the collectives of the formula (read
from the compiled HLO), and the partitioned layer fine-tunes with the library's train step on a
('data', 'model') mesh of 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import lowrank_jax as lj
from lowrank_jax import nn, train
from lowrank_jax.compress.partitioning import collective_bytes, format_collectives
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import Partitioned, get_path

M, R = 4, 2
D_MODEL, HEADS, D_FF = 16, 4, 32
CFG = nn.EncoderLayerConfig(attention=nn.AttentionConfig(use_bias=True),
                            mlp=nn.MLPConfig(activation="gelu", use_bias=True),
                            norm=nn.NormConfig())
RULES = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wo)$")


def plan(**settings):
    return lj.Plan((lj.Step("partition", RULES, {"machines": M, **settings}),))


@pytest.fixture(scope="module")
def layer():
    params = nn.init_encoder_layer(jax.random.PRNGKey(0), CFG, d_model=D_MODEL,
                                   sizes=nn.LayerSizes(HEADS, D_MODEL // HEADS, D_FF))
    # non-zero biases so that their permutation is checked too
    rng = np.random.default_rng(7)

    def bias(path, n):
        if isinstance(n, lj.Leaf):
            return n.with_bias(jnp.asarray(0.1 * rng.normal(size=n.d_out), jnp.float32))
        return n
    params = lj.map_with_path(bias, params)
    x = np.random.default_rng(0).normal(size=(2, 5, D_MODEL)).astype(np.float32)
    return params, x


@pytest.fixture(scope="module")
def partitioned(layer):
    params, _ = layer
    return lj.apply_plan(params, plan(rank=R))


def test_full_rank_keeps_the_layer(layer):
    params, x = layer
    full, report = lj.apply_plan(params, plan(rank=1000))  # capped at d* = exact
    fn = jax.jit(lambda p, x: nn.apply_encoder_layer(p, x, CFG))
    want, got = fn(params, x), fn(full, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    for row in report.rows:
        assert row.kind == "partitioned" and row.error < 1e-6


def test_rows_against_numpy(layer, partitioned):
    params, _ = layer
    new, report = partitioned
    wi_row = report.row("mlp/wi")
    perm = np.concatenate(wi_row.details["outputs_of_machine"])
    np.testing.assert_array_equal(np.sort(perm), np.arange(D_FF))
    for path, cols in (("mlp/wi", perm), ("attn/v", np.arange(D_MODEL))):
        w = lj.materialize_host(get_path(params, path))[:, cols]
        leaf = get_path(new, path)
        assert isinstance(leaf, Partitioned) and leaf.rank == R and leaf.machines == M
        got = lj.materialize_host(leaf)
        row = report.row(path)
        assert row.error == pytest.approx(np.linalg.norm(w - got, 2) / np.linalg.norm(w, 2),
                                          rel=1e-5)
        np.testing.assert_allclose(np.asarray(leaf.bias),
                                   np.asarray(lj.leaves.bias_of(get_path(params, path)))[cols],
                                   rtol=1e-6)
        assert row.details["bytes_per_token"] == R * 4
        assert row.params_after == leaf.param_count()
    # wo: inputs follow wi's machine order, outputs keep the residual order (sec. II.F)
    wo = lj.materialize_host(get_path(params, "mlp/wo"))[perm]
    got = lj.materialize_host(get_path(new, "mlp/wo"))
    a, c = D_FF // M, D_MODEL // M
    for k in range(M):  # the diagonal blocks are kept exactly
        np.testing.assert_allclose(got[k * a:(k + 1) * a, k * c:(k + 1) * c],
                                   wo[k * a:(k + 1) * a, k * c:(k + 1) * c], atol=1e-6)
    tr0, tr1 = (np.array(wi_row.details[k]) for k in ("tr_m0", "tr_m1"))
    assert np.all(tr1 < tr0)


def test_gated_mlp_and_an_unselected_dense_consumer():
    cfg = nn.MLPConfig(activation="silu", gated=True)
    params = {"mlp": nn.init_mlp(jax.random.PRNGKey(1), cfg, d_model=8, d_ff=16)}
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    want = nn.apply_mlp(params["mlp"], x, cfg)
    new, report = lj.apply_plan(params, lj.Plan((lj.Step(
        "partition", (r"mlp/wi_[01]$",), {"machines": 2, "rank": 100}),)))
    assert report.row("mlp/wi_0").details["outputs_of_machine"] == \
        report.row("mlp/wi_1").details["outputs_of_machine"]  # one assignment for both
    assert report.row("mlp/wo").kind == "permuted-inputs"
    np.testing.assert_allclose(np.asarray(nn.apply_mlp(new["mlp"], x, cfg)), np.asarray(want),
                               atol=1e-5)
    with pytest.raises(PlanError, match="every input projection"):
        lj.apply_plan(params, lj.Plan((lj.Step("partition", (r"mlp/wi_0$",),
                                               {"machines": 2, "rank": 1}),)))


def test_settings_and_heads_are_checked(layer):
    params, _ = layer
    with pytest.raises(PlanError, match="machines must be an int >= 2"):
        lj.apply_plan(params, lj.Plan((lj.Step("partition", RULES, {"rank": 1}),)))
    with pytest.raises(PlanError, match="not both"):
        lj.apply_plan(params, plan(rank=1, eps=0.1))
    with pytest.raises(PlanError, match="no rank= or eps="):
        lj.apply_plan(params, plan())
    with pytest.raises(PlanError, match="head count divisible by 8"):
        lj.apply_plan(params, lj.Plan((lj.Step("partition", (r"attn/v$",),
                                               {"machines": 8, "rank": 1}),)))


def offdiag_sigmas(w, m):
    """Singular values of every W~_m' (paper orientation), padded with a zero: [M, d* + 1]."""
    d_in, d_out = w.shape
    a, c = d_in // m, d_out // m
    out = []
    for p in range(m):
        col = w[p * a:(p + 1) * a].T
        tilde = np.concatenate([col[k * c:(k + 1) * c] for k in range(m) if k != p])
        out.append(np.append(np.linalg.svd(tilde, compute_uv=False), 0.0))
    return np.stack(out)


def test_eps_rule_in_a_plan(layer):
    params, _ = layer
    eps = 0.5
    _, report = lj.apply_plan(params, plan(eps=eps))
    perm = np.concatenate(report.row("mlp/wi").details["outputs_of_machine"])
    for row in report.rows:
        w = lj.materialize_host(get_path(params, row.path))
        w = w[:, perm] if row.path == "mlp/wi" else (w[perm] if row.path == "mlp/wo" else w)
        s = offdiag_sigmas(w, M).max(axis=0)
        want = int(np.nonzero(s <= eps / np.sqrt(M))[0][0])  # eqs. 100-101
        assert row.details["rank"] == want
        assert row.details["sigma_max"] == pytest.approx(s[want], abs=1e-9)


@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:M]), ("model",))


def compiled_collectives(fn, *args):
    return collective_bytes(jax.jit(fn).lower(*args).compile())


def test_mlp_sends_r_numbers_per_machine_and_nothing_else(partitioned, layer, mesh4):
    new, _ = partitioned
    _, x = layer
    tokens = x.shape[0] * x.shape[1]
    mlp = new["mlp"]
    with jax.set_mesh(mesh4):
        cols = compiled_collectives(lambda p, x: nn.apply_mlp(p, x, CFG.mlp), mlp, x)
        y = jax.jit(lambda p, x: nn.apply_mlp(p, x, CFG.mlp))(mlp, x)
    print(format_collectives(cols, tokens))
    assert [c.kind for c in cols] == ["all-gather", "all-gather"]  # wi, wo: nothing else
    for c in cols:
        assert c.group_size == M and c.dtype == "f32"
        assert c.bytes == tokens * R * 4  # r float32 numbers per machine per token (eq. 34)
        assert c.result_shapes[0][-2:] == (M, R)
    want = nn.apply_mlp(mlp, x, CFG.mlp)
    assert np.abs(np.asarray(y) - np.asarray(want)).max() <= 1e-5 * np.abs(np.asarray(want)).max()


def test_encoder_layer_collectives_next_to_the_formula(partitioned, layer, mesh4):
    new, report = partitioned
    _, x = layer
    tokens = x.shape[0] * x.shape[1]
    fn = lambda p, x: nn.apply_encoder_layer(p, x, CFG)  # noqa: E731
    with jax.set_mesh(mesh4):
        cols = compiled_collectives(fn, new, x)
        y = jax.jit(fn)(new, x)
    print(format_collectives(cols, tokens))
    want = np.asarray(fn(new, x))
    assert np.abs(np.asarray(y) - want).max() <= 1e-5 * np.abs(want).max()
    gathers = [c for c in cols if c.kind == "all-gather"]
    reduces = [c for c in cols if c.kind == "all-reduce"]
    assert len(gathers) + len(reduces) == len(cols)  # nothing else
    # formula: one all-gather of r numbers per machine per token for each of q, k, v, o, wi, wo
    partitioned_leaves = [r for r in report.rows if r.kind == "partitioned"]
    assert len(gathers) == len(partitioned_leaves) == 6
    assert sum(c.bytes for c in gathers) == tokens * sum(r.details["bytes_per_token"]
                                                         for r in partitioned_leaves)
    # the two LayerNorms: mean and variance over features split across machines, one float32
    # partial sum per token each (not in the paper, which has no norms across machines)
    assert sum(c.bytes for c in reduces) == tokens * 2 * 2 * 4
    assert all(c.group_size == M for c in cols)


def test_fine_tunes_on_a_data_and_model_mesh(partitioned, layer):
    new, _ = partitioned
    rng = np.random.default_rng(3)
    batch = {"x": rng.normal(size=(4, 5, D_MODEL)).astype(np.float32),
             "y": rng.normal(size=(4, 5, D_MODEL)).astype(np.float32)}

    def loss_fn(p, b, key):
        del key
        return jnp.mean(jnp.square(nn.apply_encoder_layer(p, b["x"], CFG) - b["y"])), {}

    opt = optax.sgd(0.1)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    single = train.make_train_step(loss_fn, opt)
    sharded = train.make_train_step(loss_fn, opt, mesh=mesh, axis_rules={"machine": "model"})
    s1 = train.init_train_state(new, opt, key=jax.random.PRNGKey(0))
    s2 = train.init_train_state(new, opt, key=jax.random.PRNGKey(0))
    spec = get_path(sharded.state_shardings(s2).params, "mlp/wi").diag.spec
    assert tuple(spec)[0] == "model"  # placed by the leaf's logical axes
    losses = []
    for _ in range(3):
        s1, m1 = single(s1, batch)
        losses.append(float(m1["loss"]))
    with jax.set_mesh(mesh):  # the leaves' shard_map uses the mesh of the trace
        for want in losses:
            s2, m2 = sharded(s2, batch)
            assert float(m2["loss"]) == pytest.approx(want, rel=1e-5)
    assert float(m2["loss"]) < float(loss_fn(new, batch, None)[0])
    for a, b in zip(jax.tree_util.tree_leaves(train.full_params(s1)),
                    jax.tree_util.tree_leaves(train.full_params(s2)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert tuple(get_path(s2.params, "mlp/wi").diag.sharding.spec)[0] == "model"
