"""The Hugging Face records of the model families (``ModelFamily.hf``): key tables that cover
exactly the tree ``init`` builds, config translation both ways, detection. Torch-free."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import Leaf, bias_of, get_path, named_leaves
from lowrank_jax.models import bert, chronos, chronos_bolt, families, family_of, t5, vit
from lowrank_jax.models.hf import HFRow, HFSpec, Widen, attention_rows, linear_rows, mlp_rows

T5 = t5.T5Config(vocab_size=20, d_model=8, d_kv=3, d_ff=16, num_layers=2, num_decoder_layers=1,
                 num_heads=2, relative_attention_num_buckets=8,
                 relative_attention_max_distance=20, feed_forward_proj="gated-gelu",
                 tie_word_embeddings=False, scale_decoder_outputs=False)
CONFIGS = {
    "t5": T5,
    "t5_tied_relu": dataclasses.replace(T5, feed_forward_proj="relu", tie_word_embeddings=True,
                                        scale_decoder_outputs=True),
    "chronos": chronos.ChronosConfig(
        t5=dataclasses.replace(T5, vocab_size=50, tie_word_embeddings=True,
                               scale_decoder_outputs=True), n_tokens=50),
    "chronos_bolt": chronos_bolt.ChronosBoltConfig(
        t5=dataclasses.replace(T5, vocab_size=2, tie_word_embeddings=True,
                               scale_decoder_outputs=True),
        context_length=16, prediction_length=4, input_patch_size=4, input_patch_stride=4,
        quantiles=(0.1, 0.5, 0.9), use_reg_token=True),
    "deit_teacher": vit.ViTConfig(image_size=16, patch_size=8, hidden_size=8,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=16, num_labels=3, distillation=True,
                                  pooler=False),
    "vit_base_no_qkv_bias": vit.ViTConfig(image_size=16, patch_size=8, hidden_size=8,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=16, qkv_bias=False, pooler=True),
    "bert_classifier": bert.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=16,
                                       max_position_embeddings=8, num_labels=2),
    "bert_base_no_pooler": bert.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=16,
                                           max_position_embeddings=8, pooler=False),
}


def _structure(cfg):
    return jax.eval_shape(lambda: family_of(cfg).init(jax.random.PRNGKey(0), cfg))


def _state(rows, seed=0):
    """Random checkpoint tensors of every keyed row (what a file for the table holds)."""
    rng = np.random.default_rng(seed)
    return {r.key: rng.standard_normal(r.shape).astype(np.float32) for r in rows if r.key}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_key_table_covers_exactly_the_init_tree(name):
    cfg = CONFIGS[name]
    spec = family_of(cfg).hf
    assert isinstance(spec, HFSpec)
    rows = spec.key_table(cfg)
    keys = [r.key for r in rows if r.key is not None]
    assert len(keys) == len(set(keys)), "duplicate checkpoint keys"
    tree = _structure(cfg)
    for r in rows:
        node = get_path(tree, r.path)
        if r.kind == "linear":  # PyTorch [out, in...] is the leaf's [prod(in...), out]
            assert isinstance(node, Leaf), r.path
            assert node.shape == (math.prod(r.shape[1:]), r.shape[0]), r.path
        elif r.kind in ("bias", "zero"):
            assert tuple(bias_of(node).shape) == r.shape, r.path
        else:
            assert not isinstance(node, Leaf) and math.prod(node.shape) == math.prod(r.shape)
    paths = {r.path for r in rows}
    assert {p for p, _ in named_leaves(tree)} == paths  # nothing in the tree is left out
    # Every weight leaf with a bias has a 'bias' or a 'zero' row, and only those.
    with_bias = {p for p, n in named_leaves(tree) if isinstance(n, Leaf) and bias_of(n) is not None}
    assert with_bias == {r.path for r in rows if r.kind in ("bias", "zero")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trip_and_detection(name):
    cfg = CONFIGS[name]
    fam = family_of(cfg)
    hf_config = fam.hf.config_to_hf(cfg)
    assert hf_config["model_type"] and hf_config["architectures"]
    hits = [n for n, f in families().items() if f.hf is not None and f.hf.detect(hf_config)]
    assert hits == [fam.name]
    state = _state(fam.hf.key_table(cfg))
    assert fam.hf.config_from_hf(hf_config, state) == cfg


def test_load_kwargs_name_what_config_json_cannot_record():
    assert vit.HF_SPEC.load_kwargs(CONFIGS["deit_teacher"]) == {}
    assert vit.HF_SPEC.load_kwargs(CONFIGS["vit_base_no_qkv_bias"]) == {}
    assert bert.HF_SPEC.load_kwargs(CONFIGS["bert_base_no_pooler"]) == {
        "add_pooling_layer": False}
    assert t5.HF_SPEC.load_kwargs(T5) == {}


def test_t5_head_is_decided_by_the_weights():
    """transformers 5 writes tie_word_embeddings=true even for an untied (v1.1) head: an
    lm_head.weight that differs from shared.weight unties it; an equal one (a live tied
    module's state dict) does not."""
    tied = CONFIGS["t5_tied_relu"]
    hf_config = tied.to_hf_dict()
    shared = np.ones((20, 8), np.float32)
    assert t5.config_from_hf(hf_config, {"shared.weight": shared,
                                         "lm_head.weight": shared.copy()}) == tied
    untied = t5.config_from_hf(hf_config, {"shared.weight": shared,
                                           "lm_head.weight": 2 * shared})
    assert not untied.tie_word_embeddings and untied.scales_decoder_outputs


def test_vit_and_bert_read_the_pooler_from_the_keys():
    base = vit.ViTConfig(image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=16)
    d = base.to_hf_dict()
    assert vit.config_from_hf(d, {"pooler.dense.weight": 0}).pooler
    assert not vit.config_from_hf(d, {"layernorm.weight": 0}).pooler
    b = CONFIGS["bert_base_no_pooler"]
    assert not bert.config_from_hf(b.to_hf_dict(), {"embeddings.word_embeddings.weight": 0}).pooler
    assert bert.config_from_hf(b.to_hf_dict(), {"bert.pooler.dense.weight": 0}).pooler


def test_transformers5_module_names_are_renamed():
    r = vit.rename_hf_key
    assert r("vit.layers.3.attention.q_proj.weight") == \
        "vit.encoder.layer.3.attention.attention.query.weight"
    assert r("layers.0.attention.o_proj.bias") == "encoder.layer.0.attention.output.dense.bias"
    assert r("deit.layers.1.mlp.fc1.weight") == "deit.encoder.layer.1.intermediate.dense.weight"
    assert r("layers.1.mlp.fc2.weight") == "encoder.layer.1.output.dense.weight"
    assert r("vit.layernorm.weight") == "vit.layernorm.weight"


def test_attention_rows_carry_the_head_structure():
    rows = attention_rows({n: f"a.{n}" for n in "qkvo"}, "enc/attn", d_q=8, d_kv_in=6, d_out=8,
                          num_heads=2, d_head=3, scale=0.5, bias=True, qkv_bias=False)
    by_key = {(r.key, r.kind): r for r in rows}
    q = by_key[("a.q.weight", "linear")]
    assert (q.path, q.shape) == ("enc/attn/qk/q", (6, 8))
    assert q.widen == Widen("qk", 1, 3, 2, "enc/attn", 0.5)
    k = by_key[("a.k.weight", "linear")]
    assert k.shape == (6, 6) and k.widen.by == "qk"
    assert by_key[("a.v.weight", "linear")].widen == Widen("v", 1, 3, 2, "enc/attn")
    o = by_key[("a.o.weight", "linear")]
    assert o.shape == (8, 6) and o.widen == Widen("v", 0, 3, 2, "enc/attn")
    assert by_key[("a.o.bias", "bias")].widen is None  # the output bias is not per head
    zeros = [r for r in rows if r.kind == "zero"]  # q/k/v biases absent from the checkpoint
    assert sorted(r.path for r in zeros) == ["enc/attn/qk/k", "enc/attn/qk/q", "enc/attn/v"]
    assert all(r.shape == (6,) and r.key is None for r in zeros)
    mlp = mlp_rows({"wi": "m.i", "wo": "m.o"}, "enc/mlp", d_model=8, d_ff=16, bias=True)
    assert [(r.key, r.widen.axis if r.widen else None) for r in mlp] == [
        ("m.i.weight", 1), ("m.i.bias", 0), ("m.o.weight", 0), ("m.o.bias", None)]


def test_rows_validate():
    with pytest.raises(ConfigError, match="kind must be one of"):
        HFRow("a", "a", "matrix", (1,))
    with pytest.raises(ConfigError, match="exactly the 'zero' rows have no key"):
        HFRow(None, "a", "bias", (1,))
    with pytest.raises(ConfigError, match="exactly the 'zero' rows have no key"):
        HFRow("a.bias", "a", "zero", (1,))
    with pytest.raises(ConfigError, match="by must be one of"):
        Widen("heads", 0)
    with pytest.raises(ConfigError, match="only one axis"):
        linear_rows("a", "a", 2, 2, bias=False, widen_out=Widen("hidden", 1, 2),
                    widen_in=Widen("hidden", 0, 2))
