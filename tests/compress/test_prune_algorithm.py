"""Algorithm 1 of "Less is More" (progressive global pruning) and the ``prune`` plan method.

* Planted, exactly useless channels (MLP hidden channels and value channels whose outgoing
  weights are zero) are removed before any channel with a positive score; Chronos-Bolt's
  single-step decoder self-attention gets exactly zero query/key scores (they go first) while
  its value/output path is scored like any other weight; the target is met with the fewest
  units (one unit fewer misses it).
* LowRank (rows of u / columns of v), HeadLowRank (whole heads) and MaskedBinary (frozen) weights
  are pruned through the leaf protocol, and the pruned layer equals the masked one.
* The ``prune`` method composes with ``svd`` in one plan; bad settings and fixed Q/K/V
  activation masks are refused before anything runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models, nn
from lowrank_jax.compress import Plan, Step, apply_plan
from lowrank_jax.compress.prune import (
    DEFAULT_RULES,
    Structure,
    add_channel_masks,
    builtin_batches,
    progressive_prune,
    remove_masked,
    token_counts,
)
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import (
    FrozenBinary,
    HeadLowRank,
    LowRank,
    get_path,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    replace_paths,
)
from lowrank_jax.models import ChronosBoltConfig, T5Config

jax.config.update("jax_default_matmul_precision", "highest")

BOLT = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                     num_decoder_layers=1, num_heads=4),
                         context_length=32, prediction_length=8, input_patch_size=8,
                         input_patch_stride=8, use_reg_token=True)
PLANTED_HIDDEN = (3, 7, 11, 20)
PLANTED_V = (5, 6)


def fast_init(cfg, seed: int = 0):
    fam = models.family_of(cfg)
    shapes = jax.eval_shape(lambda: fam.init(jax.random.PRNGKey(0), cfg))
    g = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * g.normal(size=s.shape), s.dtype),
                                  shapes)


def planted_bolt():
    params = fast_init(BOLT)
    wo = get_path(params, "encoder/layers/0/mlp/wo")
    o = get_path(params, "encoder/layers/1/attn/o")
    return replace_paths(params, {
        "encoder/layers/0/mlp/wo": dataclasses.replace(
            wo, w=wo.w.at[np.asarray(PLANTED_HIDDEN)].set(0.0)),
        "encoder/layers/1/attn/o": dataclasses.replace(
            o, w=o.w.at[np.asarray(PLANTED_V)].set(0.0)),
    })


def test_algorithm1_on_chronos_bolt():
    params = planted_bolt()
    masked = add_channel_masks(params)
    batches = builtin_batches(BOLT, batch_size=6, seed=0)
    target = 0.4
    res = progressive_prune(masked, models.family_of(BOLT).loss(BOLT), batches, target=target,
                            steps=3, tokens=token_counts(BOLT, params), config=BOLT)
    planted = {("encoder/layers/0/mlp/wi/m_out", j) for j in PLANTED_HIDDEN}
    planted |= {("encoder/layers/0/mlp/wo/m_in", j) for j in PLANTED_HIDDEN}
    planted |= {("encoder/layers/1/attn/v/m_out", j) for j in PLANTED_V}
    planted |= {("encoder/layers/1/attn/o/m_in", j) for j in PLANTED_V}
    first = [tuple(u) for u in res.history[0]["removed"]]
    # every planted unit goes in the first batch, and nothing with a positive EMA before them
    last = max(first.index(u) for u in planted)
    assert all(res.ema[p][j] == 0.0 for p, j in first[:last + 1])
    assert all(res.ema[p][j] == 0.0 for p, j in planted)
    # the single-step decoder: queries/keys score exactly zero, the value/output path does not
    dec = "decoder/layers/0/self_attn"
    for w in ("qk/q", "qk/k"):
        for side in ("m_in", "m_out"):
            assert np.all(res.ema[f"{dec}/{w}/{side}"] == 0.0)
    assert np.all(res.ema[f"{dec}/v/m_in"] > 0) and np.all(res.ema[f"{dec}/o/m_out"] > 0)
    assert res.removal.qk[dec].sum() == 0 and res.removal.vo[dec].sum() > 0
    # K shrinks (cubic schedule); the target is met, and one unit fewer would miss it
    ks = [h["k"] for h in res.history]
    assert ks[0] > ks[-1] > 0 and sum(ks) == sum(len(h["removed"]) for h in res.history)
    assert res.params_fraction >= target
    path, unit = res.history[-1]["removed"][-1]
    alive = {p: a.copy() for p, a in res.alive.items()}
    alive[path][unit] = True
    keep = {}
    for p, a in alive.items():
        weight, side = p.rsplit("/", 1)
        g = res.structure.granularity(weight)[0 if side == "m_in" else 1]
        keep.setdefault(weight, [None, None])[0 if side == "m_in" else 1] = np.repeat(a, g)
    assert res.structure.fractions(res.structure.removal(keep))[0] < target
    assert 0 < res.flops_fraction < 1


def test_factorized_and_binary_leaves_are_pruned_through_the_protocol():
    cfg = nn.EncoderLayerConfig(attention=nn.AttentionConfig(), mlp=nn.MLPConfig("gelu"),
                                norm=nn.NormConfig())
    g = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: nn.init_encoder_layer(
        jax.random.PRNGKey(0), cfg, d_model=16, sizes=nn.LayerSizes(4, 4, 32)))
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * g.normal(size=s.shape),
                                                           s.dtype), shapes)
    k = jax.random.PRNGKey(1)
    qk = params["attn"]["qk"]
    params = replace_paths(params, {
        "attn/qk": dataclasses.replace(qk, q=init_head_lowrank(k, 16, 4, 4, 2),
                                       k=init_head_lowrank(jax.random.PRNGKey(2), 16, 4, 4, 2)),
        "attn/v": init_lowrank(k, 16, 16, 3),
        "mlp/wi": init_masked_binary(k, 16, 32, 0.5),
        "mlp/wo": init_lowrank(k, 32, 16, 4)})
    x = jnp.asarray(g.normal(size=(6, 5, 16)), jnp.float32)
    y = jnp.asarray(g.normal(size=(6, 5, 16)), jnp.float32)

    def loss_fn(p, batch, key):
        return jnp.mean((nn.apply_encoder_layer(p, batch["x"], cfg) - batch["y"]) ** 2), {}

    masked = add_channel_masks(params, (r"attn/(qk/q|qk/k|v|o)$", r"mlp/(wi|wo)$"))
    s = Structure(masked)
    assert s.granularity("attn/qk/q") == (1, 4) and s.granularity("attn/qk/k") == (1, 4)
    res = progressive_prune(masked, loss_fn, [{"x": x, "y": y}] * 2, target=0.45, steps=2)
    pruned = remove_masked(res.params)
    run = jax.jit(lambda p: nn.apply_encoder_layer(p, x, cfg))
    np.testing.assert_allclose(np.asarray(run(pruned)), np.asarray(run(res.params)), atol=1e-5)
    q = pruned["attn"]["qk"].q
    q = q.base if isinstance(q, lj.leaves.ChannelPruned) else q
    assert isinstance(q, HeadLowRank) and set(pruned["attn"]["qk"].widths) <= {0, 4}
    v = pruned["attn"]["v"]
    vb = v.base if isinstance(v, lj.leaves.ChannelPruned) else v
    assert isinstance(vb, LowRank) and vb.u.shape[0] == int(res.removal.rows["attn/v"].sum())
    assert vb.v.shape[1] == int(res.removal.vo["attn"].sum())
    wi = pruned["mlp"]["wi"]
    assert isinstance(wi.base if isinstance(wi, lj.leaves.ChannelPruned) else wi, FrozenBinary)
    assert lj.param_count(pruned) < lj.param_count(params)


def test_prune_method_composes_with_svd_and_refuses_bad_input():
    params = fast_init(BOLT, 1)
    plan = Plan((Step("svd", (r"encoder/.*attn/v$",), {"rank": 2}),
                 Step("prune", DEFAULT_RULES, {"target": 0.3, "steps": 2, "batch_size": 4})))
    new, report = apply_plan(params, plan, config=BOLT)
    info = report.info(1)
    assert info["params_fraction"] >= 0.3 and len(info["history"]) == 2
    assert {r.kind for r in report.step_rows(1)} == {"pruned"}
    v = get_path(new, "encoder/layers/0/attn/v")
    assert isinstance(v.base if isinstance(v, lj.leaves.ChannelPruned) else v, LowRank)
    assert report.tree["params_after"] < report.tree["params_before"]
    # bad settings fail before any step runs; a target needs the config
    with pytest.raises(PlanError, match="target"):
        apply_plan(params, Plan((Step("prune", DEFAULT_RULES, {"target": 1.5}),)), config=BOLT)
    with pytest.raises(PlanError, match="config"):
        apply_plan(params, Plan((Step("prune", DEFAULT_RULES, {"target": 0.5}),)))
    with pytest.raises(PlanError, match="batch source"):
        apply_plan(params, Plan((Step("prune", DEFAULT_RULES, {"target": 0.5, "data": "nope"}),)),
                   config=BOLT)
    with pytest.raises(PlanError, match="masked"):
        apply_plan(params, Plan((Step("prune", DEFAULT_RULES, {}),)))


def test_fixed_activation_masks_and_partitioned_leaves_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        enc: nn.EncoderConfig

    layer = nn.EncoderLayerConfig(attention=nn.AttentionConfig(qkv_keep=0.5),
                                  mlp=nn.MLPConfig(), norm=nn.NormConfig())
    cfg = Cfg(nn.EncoderConfig(layer=layer))
    params = nn.init_encoder_layer(jax.random.PRNGKey(0), layer, d_model=8,
                                   sizes=nn.LayerSizes(2, 4, 8))
    with pytest.raises(PlanError, match="qkv_keep"):
        Structure(add_channel_masks(params, (r"attn/v$",)), config=cfg)
    Structure(add_channel_masks(params, (r"mlp/wi$",)), config=cfg)  # MLPs alone are fine
    from lowrank_jax.leaves import Partitioned

    # 2 machines, blocks of 4 x 4 (8 -> 8), rank 1: cannot lose single channels
    part = Partitioned(diag=jnp.ones((2, 4, 4)), send=jnp.ones((2, 4, 1)),
                       recv=jnp.ones((2, 1, 1, 4)))
    assert part.shape == (8, 8)
    bad = replace_paths(params, {"mlp/wi": part})
    with pytest.raises(PlanError, match="mlp/wi"):
        Structure(add_channel_masks(bad, (r"mlp/wi$",)))
