"""The ``quantize`` plan method: round to nearest per leaf and per layer against NumPy, GPTQ
layer by layer from inputs of the already-quantized prefix (captured here independently, with a
recording leaf of the test's own), quantized low-rank factors, low rank plus quantized residual,
quantization after structured pruning, report rows, errors, and save/load of the result."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import models
from lowrank_jax.compress import Plan, Step, apply_plan
from lowrank_jax.compress.gptq import gptq
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import (
    Int4,
    bias_of,
    get_path,
    kit,
    materialize,
    materialize_host,
    named_leaves,
    replace_paths,
    storage_bits,
)

CFG = models.PatchEncoderConfig(patch=4, d_model=32, num_heads=4, d_ff=48, num_layers=2,
                                embed_hidden=8)
MLP = [r"mlp/(wi|wo)$"]
ATTN = [r"attn/(qk/q|qk/k|v|o)$"]


@pytest.fixture(scope="module")
def params():
    shapes = jax.eval_shape(lambda: models.patch_encoder.init(jax.random.PRNGKey(0), CFG))
    g = np.random.default_rng(0)
    return jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * g.normal(size=s.shape), s.dtype),
                                  shapes)


def np_rtn(w, bits, group):
    """NumPy round to nearest, symmetric (reference): dequantized float64 matrix."""
    w = np.asarray(w, np.float32)
    g = w.shape[0] if group is None else group
    qmax = 2 ** (bits - 1) - 1
    out = []
    for s in range(0, w.shape[0], g):
        blk = w[s:s + g]
        amax = np.abs(blk).max(0)
        scale = np.where(amax == 0, 1, amax / np.float32(qmax)).astype(np.float32)
        out.append(np.clip(np.round(blk / scale), -qmax, qmax) * scale.astype(np.float64))
    return np.concatenate(out)


def weights(tree, pattern):
    import re

    return {p: n for p, n in named_leaves(tree) if re.search(pattern, p)}


def test_rtn_per_leaf_bit_widths_match_numpy(params):
    plan = Plan((Step("quantize", MLP + [(ATTN[0], {"bits": 4, "group": 16})], {"bits": 8}),))
    new, report = apply_plan(params, plan)
    for p, node in weights(params, r"(mlp/(wi|wo)|attn/(qk/q|qk/k|v|o))$").items():
        w = np.asarray(materialize(node), np.float32)
        bits, group = (8, None) if "/mlp/" in p else (4, 16)
        got = np.asarray(materialize(get_path(new, p)), np.float64)
        np.testing.assert_allclose(got, np_rtn(w, bits, group), rtol=2e-7, atol=1e-7)
        b = bias_of(node)
        if b is not None:
            np.testing.assert_array_equal(np.asarray(bias_of(get_path(new, p))), np.asarray(b))
    rows = {r.path: r for r in report.rows}
    r = rows["encoder/layers/0/mlp/wi"]
    assert r.kind == "quantized" and r.details["bits"] == 8 and r.details["group"] is None
    assert r.bits_after == storage_bits(get_path(new, "encoder/layers/0/mlp/wi"))
    assert 0 < r.error < 0.01
    a = rows["encoder/layers/1/attn/v"]
    assert a.details["bits"] == 4 and a.details["group"] == 16
    has_bias = bias_of(get_path(params, "encoder/layers/1/attn/v")) is not None
    assert a.details["bits_per_weight"] == pytest.approx(4 + 32 / 16 + (1 if has_bias else 0))


class Record(kit.Leaf):
    """The test's own recording leaf: ``x`` appended to a host list (eager forward)."""

    inner: object
    tag: str = ""

    @property
    def shape(self):
        return self.inner.shape

    def apply(self, x):
        SEEN.setdefault(self.tag, []).append(np.asarray(x, np.float64).reshape(-1, x.shape[-1]))
        return self.inner.apply(x)

    def to_dense(self):
        return materialize(self.inner)

    def param_count(self):
        return self.inner.param_count()

    def storage_bits(self):
        return self.inner.storage_bits()

    def flops(self, n):
        return self.inner.flops(n)


Record = kit.leaf_dataclass(Record, meta=("tag",))
SEEN: dict = {}


def test_gptq_layer_by_layer_uses_inputs_of_the_quantized_prefix(params):
    settings = {"bits": 4, "group": 16, "algorithm": "gptq", "samples": 3, "seed": 1}
    new, report = apply_plan(params, Plan((Step("quantize", MLP, settings),)), config=CFG)
    step = report.steps[0]
    assert step.info["stages"] == ["encoder/layers/0", "encoder/layers/1"]
    # inputs of layers/1/mlp/wi with layer 0 quantized (from the result), captured here
    inputs = models.patch_encoder.sample_inputs(CFG, np.random.default_rng(1), 3)
    prefix = replace_paths(params, {p: get_path(new, p) for p in ("encoder/layers/0/mlp/wi",
                                                                  "encoder/layers/0/mlp/wo")})
    for tree, tag in ((prefix, "quantized prefix"), (params, "dense")):
        SEEN.clear()
        node = get_path(tree, "encoder/layers/1/mlp/wi")
        models.patch_encoder.apply(replace_paths(tree, {"encoder/layers/1/mlp/wi": Record(node, tag)}),
                                   inputs, CFG)
        x = np.concatenate(SEEN[tag])
        w = np.asarray(materialize(node), np.float32)
        c, s, z, sizes = gptq(jnp.asarray(w), jnp.asarray(x.T @ x, jnp.float32), bits=4,
                              group=16)
        ref = Int4.from_codes(c.astype(np.int64), s, None, group_sizes=sizes)
        same = np.array_equal(np.asarray(materialize(ref)),
                              np.asarray(materialize(get_path(new, "encoder/layers/1/mlp/wi"))))
        assert same == (tag == "quantized prefix")
    row = {r.path: r for r in report.rows}["encoder/layers/1/mlp/wo"]
    assert row.details["algorithm"] == "gptq" and 0 < row.details["output_error"] < 0.2


def test_gptq_without_calibration_is_a_plan_error(params):
    with pytest.raises(PlanError, match="config= to apply_plan"):
        apply_plan(params, Step("quantize", MLP, {"algorithm": "gptq"}))
    with pytest.raises(PlanError, match="bits must be 4 or 8"):
        apply_plan(params, Step("quantize", MLP, {"bits": 3}))
    with pytest.raises(PlanError, match=r"encoder/layers/0/mlp/wi.*zero_point needs bits=4"):
        apply_plan(params, Step("quantize", [(MLP[0], {"zero_point": True})], {"bits": 8}))


def test_quantized_lowrank_factors_and_lowrank_plus_quantized_residual(params):
    new, report = apply_plan(params, Plan((Step("svd", ATTN, {"rank": 4}),
                                           Step("quantize", ATTN, {"bits": 8}))))
    p = "encoder/layers/0/attn/v"
    lr = get_path(apply_plan(params, Step("svd", ATTN, {"rank": 4}))[0], p)
    from lowrank_jax.leaves import factors

    f = factors(lr)
    u, v = np.asarray(f.first, np.float32), np.asarray(f.second, np.float32)
    np.testing.assert_allclose(np.asarray(materialize(get_path(new, p)), np.float64),
                               np_rtn(u, 8, None) @ np_rtn(v, 8, None), rtol=1e-5, atol=1e-6)
    row = {r.path: r for r in report.rows if r.step == 1}[p]
    assert row.kind == "quantized-factors"
    # int8 values (8 of 32 bits) plus a float32 scale per output of each factor
    assert row.bits_after == (32 * 4 + 4 * 32) * 8 + (4 + 32) * 32

    new, report = apply_plan(params, Step("quantize", MLP, {"bits": 4, "group": 16, "rank": 3}))
    p = "encoder/layers/1/mlp/wo"
    w = materialize_host(get_path(params, p))
    uu, sv, vt = np.linalg.svd(w, full_matrices=False)
    low = (uu[:, :3] * sv[:3]) @ vt[:3]
    # the float32 factors' product, as stored
    root = np.sqrt(sv[:3])
    lu = (uu[:, :3] * root).astype(np.float32).astype(np.float64)
    lv = (root[:, None] * vt[:3]).astype(np.float32).astype(np.float64)
    want = np_rtn(w - lu @ lv, 4, 16) + lu @ lv
    got = materialize_host(get_path(new, p))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    row = {r.path: r for r in report.rows}[p]
    assert row.kind == "lowrank+quantized" and row.details["rank"] == 3
    plain = apply_plan(params, Step("quantize", MLP, {"bits": 4, "group": 16}))[1]
    assert row.error < {r.path: r for r in plain.rows}[p].error
    assert np.linalg.norm(w - low) > 0  # the residual is not zero: the test can fail
    # CALDERA's low-precision factors: int8 factors, the residual of their product in int4
    new, report = apply_plan(params, Step("quantize", MLP, {"bits": 4, "group": 16, "rank": 3,
                                                            "factor_bits": 8}))
    qu, qv = np_rtn(lu, 8, None), np_rtn(lv, 8, None)
    want = np_rtn(w - qu @ qv, 4, 16) + qu @ qv
    np.testing.assert_allclose(materialize_host(get_path(new, p)), want, rtol=1e-5, atol=1e-5)
    assert {r.path: r for r in report.rows}[p].details["factor_bits"] == 8


def test_quantize_after_structured_pruning(params):
    from lowrank_jax.compress.prune import add_channel_masks
    from lowrank_jax.leaves import channel_masks, with_channel_masks

    masked = add_channel_masks(params)
    rng = np.random.default_rng(0)
    masks = {}
    for p, (a, b) in channel_masks(masked).items():
        m_out = np.ones(b.size, np.float32)
        if p.endswith("mlp/wi"):
            m_out[rng.permutation(b.size)[: b.size // 2]] = 0  # half the hidden channels
        masks[p] = (np.ones(a.size, np.float32), m_out)
    masked = with_channel_masks(masked, masks)
    pruned, _ = apply_plan(masked, Step("prune", [r"."], {}))
    new, report = apply_plan(pruned, Step("quantize", MLP, {"bits": 8}))
    rows = {r.path: r for r in report.rows}
    assert rows["encoder/layers/0/mlp/wi"].details["shape"] == [32, 24]
    assert rows["encoder/layers/0/mlp/wo"].details["shape"] == [24, 32]
    for p in ("encoder/layers/0/mlp/wi", "encoder/layers/0/mlp/wo"):
        before = materialize_host(get_path(pruned, p))
        after = materialize_host(get_path(new, p))
        assert before.shape == after.shape
        assert np.abs(after - before).max() <= np.abs(before).max() / 127
    r = rows["encoder/layers/0/mlp/wi"]
    assert r.bits_after < r.bits_before / 3  # int8 codes of the kept channels only


def test_quantized_model_saves_and_loads_bit_exact(params, tmp_path):
    from lowrank_jax.io import load_params, save_params

    new, _ = apply_plan(params, Step("quantize", MLP + ATTN, {"bits": 4, "group": 16,
                                                             "zero_point": True}))
    save_params(tmp_path / "q", new)
    back = load_params(tmp_path / "q")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(new)
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(back), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert dataclasses.is_dataclass(get_path(back, "encoder/layers/0/mlp/wi"))


def test_frontier_measures_quantized_and_composed_candidates():
    from lowrank_jax.compress.frontier import ClassificationData, frontier
    from lowrank_jax.compress.registry import CandidateSetting
    from lowrank_jax.models import vit

    cfg = vit.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=32,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        num_labels=5)
    params = vit.init(jax.random.PRNGKey(0), cfg)
    from lowrank_jax.compress.quantize import candidates

    cands = candidates(CandidateSetting(params=params, config=cfg, strengths=(0.5,)))
    groups = {c.group for c in cands}
    assert {"quantize rtn", "quantize gptq", "svd + quantize", "lowrank + quantize"} <= groups
    x = np.random.default_rng(0).normal(size=(16, 1, 8, 8)).astype(np.float32)
    res = frontier(cfg, params, ClassificationData({"pixel_values": x}, np.arange(16) % 5),
                   candidates=cands, time_runs=1)
    rows = {r["name"]: r for r in res.rows}
    for c in cands:
        r = rows[c.name]
        assert r["error"] is None, r["error"]
        assert 0 < r["size_ratio"] < 1 and r["accuracy"] is not None
    # the same grid by either algorithm: the same size
    assert rows["quantize rtn int4 g32"]["size_ratio"] == rows["quantize gptq int4 g32"][
        "size_ratio"]
    # with a batch source (a language model's text), GPTQ candidates calibrate on it
    named = candidates(CandidateSetting(params=params, config=cfg, strengths=(0.5,),
                                        prune_data="text"))
    steps = [s for c in named for s in c.plan.steps if s.method == "quantize"]
    gptq = [s for s in steps if s.settings.get("algorithm") == "gptq"]
    assert gptq and all(s.settings["data"] == "text" for s in gptq)
    assert all("data" not in s.settings for s in steps if s not in gptq)
    assert all("data" not in s.settings for c in cands for s in c.plan.steps)


def test_gptq_calibrates_on_a_named_batch_source_of_a_forecaster():
    from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt

    cfg = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                        num_decoder_layers=1, num_heads=2),
                            context_length=32, prediction_length=8, input_patch_size=8,
                            input_patch_stride=8, use_reg_token=True)
    params = chronos_bolt.init(jax.random.PRNGKey(0), cfg)
    plan = Step("quantize", [r"mlp/(wi|wo)$"], {"bits": 4, "group": 8, "algorithm": "gptq",
                                                "data": "builtin", "samples": 4})
    new, report = apply_plan(params, plan, config=cfg)
    # the encoder's layer is reached (and quantized) before the decoder's
    assert report.steps[0].info["stages"] == ["encoder/layers/0", "decoder/layers/0"]
    assert all(r.details["algorithm"] == "gptq" for r in report.rows)
    with pytest.raises(PlanError, match="^quantize: unknown batch source .nope."):
        apply_plan(params, Step("quantize", [r"mlp/wi$"], {"algorithm": "gptq", "data": "nope"}),
                   config=cfg)


def test_int8_activations_by_plan_rule_model_error_and_refusals(params, tmp_path):
    from lowrank_jax.io import load_params, save_params
    from lowrank_jax.leaves import Int8, Int8A8, linear

    plan = Step("quantize", [(MLP[0], {"activations": "int8"})] + ATTN, {"bits": 8})
    new, report = apply_plan(params, plan)
    rows = {r.path: r for r in report.rows}
    wi, q = get_path(new, "encoder/layers/0/mlp/wi"), get_path(new, "encoder/layers/0/attn/qk/q")
    assert type(wi) is Int8A8 and type(q) is Int8
    assert rows["encoder/layers/0/mlp/wi"].details["activations"] == "int8"
    assert rows["encoder/layers/0/attn/v"].details["activations"] is None
    # the same codes as weight-only int8; the product rounds the rows of x (NumPy reference)
    w = np.asarray(materialize(get_path(params, "encoder/layers/0/mlp/wi")), np.float32)
    np.testing.assert_allclose(materialize_host(wi), np_rtn(w, 8, None), rtol=2e-7, atol=1e-7)
    x = np.random.default_rng(5).standard_normal((6, w.shape[0])).astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    sx = (amax * np.float32(1 / 127)).astype(np.float32)
    xq = np.clip(np.round(x * (np.float32(1) / sx)), -127, 127).astype(np.int64)
    acc = xq @ np.asarray(wi.q, np.int64)
    b = bias_of(wi)
    ref = acc.astype(np.float32) * sx * np.asarray(wi.scale) + (0 if b is None else np.asarray(b))
    np.testing.assert_allclose(np.asarray(linear(wi, jnp.asarray(x))), ref, rtol=1e-6,
                               atol=1e-6 * np.abs(ref).max())
    # model level: W8A8 on the MLP moves the output by more than weight-only int8 does, and
    # still by a small fraction of the output scale
    inputs = models.patch_encoder.sample_inputs(CFG, np.random.default_rng(0), 4)

    def out(tree):
        return np.asarray(models.patch_encoder.apply(tree, inputs, CFG)["last_hidden_state"],
                          np.float64)

    y = out(params)
    w_only = out(apply_plan(params, Step("quantize", MLP + ATTN, {"bits": 8}))[0])
    a8 = out(new)
    err_w, err_a = (np.abs(v - y).max() / np.abs(y).max() for v in (w_only, a8))
    assert err_w < err_a < 0.05, (err_w, err_a)
    save_params(tmp_path / "a8", new)
    back = load_params(tmp_path / "a8")
    assert type(get_path(back, "encoder/layers/0/mlp/wi")) is Int8A8
    np.testing.assert_array_equal(out(back), a8)
    # refused where it cannot apply, naming the path, before anything is quantized
    with pytest.raises(PlanError, match=r"encoder/layers/0/mlp/wi.*activations='int8' needs "
                                        r"bits=8.*bits=4"):
        apply_plan(params, Step("quantize", [(MLP[0], {"activations": "int8"})], {"bits": 4}))
    with pytest.raises(PlanError, match="low rank plus a quantized residual"):
        apply_plan(params, Step("quantize", MLP, {"activations": "int8", "rank": 2}))
    with pytest.raises(PlanError, match="activations must be null"):
        apply_plan(params, Step("quantize", MLP, {"activations": "int4"}))
    svd = apply_plan(params, Step("svd", ATTN, {"rank": 4}))[0]
    with pytest.raises(PlanError, match=r"encoder/layers/0/attn/.*factorized.*factors=false"):
        apply_plan(svd, Step("quantize", ATTN, {"activations": "int8"}))
    flat = apply_plan(svd, Step("quantize", ATTN, {"activations": "int8", "factors": False}))[0]
    assert type(get_path(flat, "encoder/layers/0/attn/v")) is Int8A8
