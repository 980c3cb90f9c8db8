"""Physical removal of masked channels = the masked model, for every family.

For T5 (the Chronos architecture), Chronos-Bolt, ViT and BERT, each built with a different head
count and MLP width in every layer, random input and output masks on every attention and MLP
projection (plus a head that loses all its value channels and one that loses all its
query/key channels) are removed physically; the pruned model must give the masked model's
outputs to 1e-5, its parameter count must be what the removal plan counted, and its FLOPs
(the leaves' own counts with the rows each weight sees, plus nn.attention_score_flops) what
the plan counted. A pruned Chronos-Bolt is saved, loaded, and exported to the PyTorch class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models, nn
from lowrank_jax.compress.prune import (
    Structure,
    add_channel_masks,
    layer_table,
    remove_masked,
    token_counts,
)
from lowrank_jax.leaves import channel_masks, get_path, with_channel_masks
from lowrank_jax.models import BertConfig, ChronosBoltConfig, T5Config, ViTConfig

jax.config.update("jax_default_matmul_precision", "highest")

SIZES = [nn.LayerSizes(num_heads=2, d_head=4, d_ff=12), nn.LayerSizes(num_heads=3, d_head=4,
                                                                       d_ff=24)]
BOLT = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                     num_decoder_layers=1, num_heads=4),
                         context_length=32, prediction_length=8, input_patch_size=8,
                         input_patch_stride=8, use_reg_token=True)
CASES = {
    "t5": (T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                    num_decoder_layers=1, num_heads=4, feed_forward_proj="gated-gelu",
                    relative_attention_num_buckets=8, relative_attention_max_distance=20),
           dict(encoder_layers=SIZES, decoder_layers=SIZES[1:])),
    "chronos_bolt": (BOLT, dict(encoder_layers=SIZES, decoder_layers=SIZES[1:])),
    "vit": (ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=32, num_labels=3),
            dict(layers=SIZES)),
    "bert": (BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=32, max_position_embeddings=40,
                        num_labels=2), dict(layers=SIZES)),
}


def fast_init(fam, cfg, seed: int = 0, **layers):
    """Random parameters of the family's structure, drawn with NumPy (the eager init compiles
    hundreds of small random ops, seconds on a busy machine); norm scales too are random, so
    every parameter matters."""
    shapes = jax.eval_shape(lambda: fam.init(jax.random.PRNGKey(0), cfg, **layers))
    g = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.5 * g.normal(size=s.shape), s.dtype), shapes)


def random_masks(masked, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    masks = {p: ((rng.random(a.size) > 0.25).astype(np.float32),
                 (rng.random(b.size) > 0.25).astype(np.float32))
             for p, (a, b) in channel_masks(masked).items()}
    blocks = sorted({p.rsplit("/", 2)[0] for p in masks if p.endswith("/qk/q")})
    first = blocks[0]
    v_in, v_out = masks[f"{first}/v"]
    v_out[:4] = 0  # head 0 of the first attention block loses every value channel: it goes
    q_in, q_out = masks[f"{first}/qk/q"]
    q_out[4:8] = 0  # head 1 loses every query channel: width 0, uniform attention (or bias)
    return masks


def model_output(fam, cfg, params, inputs):
    """The family's primary output on the model's own scale (a forecaster's quantiles before
    the un-normalization by the series' location and scale, which are in the series' units)."""
    out = fam.apply(params, inputs, cfg)
    y = out[fam.primary_outputs[0]]
    if "loc_scale" in out:
        loc, scale = out["loc_scale"]
        y = (y - loc[:, :, None]) / scale[:, :, None]
    return y


@pytest.mark.parametrize("name", list(CASES))
def test_pruned_equals_masked_per_family(name):
    cfg, layers = CASES[name]
    fam = models.family_of(cfg)
    params = fast_init(fam, cfg, **layers)
    masked = with_channel_masks(add_channel_masks(params), random_masks(add_channel_masks(params),
                                                                        1))
    tokens = token_counts(cfg, params)
    pruned, struct, removal = remove_masked(masked, tokens=tokens, return_structure=True)
    inputs = fam.sample_inputs(cfg, np.random.default_rng(0), 3)
    run = jax.jit(lambda p: model_output(fam, cfg, p, inputs))
    want, got = run(masked), run(pruned)
    err = float(jnp.max(jnp.abs(got - want)))
    assert err <= 1e-5, (name, err)
    # parameters: what the plan counted, and fewer
    saved = struct.total_params - struct.counts(removal)[0]
    assert lj.param_count(pruned) == lj.param_count(params) - saved and saved > 0
    # FLOPs: the leaves' own counts with their rows, plus the attention score products
    flops = sum(get_path(pruned, p).flops(tokens[p]) for p in struct.members)
    for a in struct.attention:
        block = get_path(pruned, a.path)
        flops += nn.attention_score_flops(block, tokens[a.q], tokens[a.k])
    assert flops == struct.counts(removal)[1]
    # the planted heads: head 0 of the first block is gone, head 1 has no query/key channels
    first = sorted(a.path for a in struct.attention)[0]
    block = get_path(pruned, first)
    original = get_path(params, first)["heads"]
    assert block["heads"].ids == tuple(i for i in original.ids if i != 0)
    assert block["qk"].widths[0] == 0 and block["heads"].scale == original.scale
    table = {r["path"]: r for r in layer_table(struct, removal) if r["kind"] == "attention"}
    assert table[first]["heads"] == original.num_heads - 1


def test_structure_counts_without_token_counts_are_per_token():
    cfg, layers = CASES["bert"]
    params = fast_init(models.family_of(cfg), cfg, 1, **layers)
    masked = add_channel_masks(params, (r"mlp/wi$",))
    s = Structure(masked)
    assert s.total_flops == sum(get_path(params, p).flops(1) for p in s.members)
    assert set(s.members) == {p for p, _ in lj.named_leaves(params) if "/mlp/" in p}


def test_pruned_chronos_bolt_saves_loads_and_exports(tmp_path):
    torch = pytest.importorskip("torch")
    bolt_ref = pytest.importorskip("chronos.chronos_bolt")
    from lowrank_jax.convert import save_pretrained
    from lowrank_jax.io import load_model, save_model
    from lowrank_jax.models import chronos_bolt

    params = fast_init(models.family_of(BOLT), BOLT, 2)
    masked = with_channel_masks(add_channel_masks(params), random_masks(add_channel_masks(params),
                                                                        3))
    pruned = remove_masked(masked)
    x = np.random.default_rng(0).normal(size=(2, 32)).cumsum(1).astype(np.float32)
    run = jax.jit(lambda p: chronos_bolt.apply(p, {"context": x}, BOLT)["quantile_preds"])
    ours = np.asarray(run(pruned))
    save_model(tmp_path / "m", BOLT, pruned)
    cfg, back = load_model(tmp_path / "m")
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(pruned)
    np.testing.assert_array_equal(np.asarray(run(back)), ours)
    summary = save_pretrained(BOLT, pruned, tmp_path / "hf")
    assert summary["widened"]
    hf = bolt_ref.ChronosBoltModelForForecasting.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = hf(context=torch.from_numpy(x)).quantile_preds.numpy()
    assert np.abs(ref - ours).max() <= 1e-4
