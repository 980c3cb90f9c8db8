"""lowrank_jax trees -> Hugging Face directories: HF -> load_pretrained -> save_pretrained -> HF.

Every model is a tiny random Hugging Face model with O(1) weights (so that a transposed,
misplaced or dropped tensor shows up in the outputs). A dense round trip must reproduce the
original PyTorch outputs (1e-5: the same numbers, only re-filed); a compressed export must
reproduce the JAX model on the compressed parameters (1e-4, the whole-model tolerance).
"""

import json
import logging
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from lowrank_jax.convert import (  # noqa: E402
    CheckpointError,
    load_pretrained,
    save_pretrained,
    state_dict_from_params,
)
from lowrank_jax.errors import ConfigError, OutputExistsError  # noqa: E402
from lowrank_jax.leaves import (  # noqa: E402
    Dense,
    Leaf,
    LowRank,
    QueryKey,
    bias_of,
    get_path,
    init_masked_binary,
    materialize,
    named_leaves,
    replace_paths,
)
from lowrank_jax.models import bert, chronos, patch_encoder, t5, vit  # noqa: E402

torch.set_num_threads(1)

# One compiled forward per model instead of op-by-op dispatch (slow on CPU).
t5_apply = jax.jit(t5.apply, static_argnums=2)
vit_apply = jax.jit(vit.apply, static_argnums=2)
bert_apply = jax.jit(bert.apply, static_argnums=2)
chronos_embed = jax.jit(chronos.embed, static_argnums=2)

EXACT = 1e-5  # same weights re-filed: the outputs must agree to float32 rounding
MODEL = 1e-4  # whole-model parity (design.md)

T5_SMALL = dict(vocab_size=40, d_model=16, d_kv=6, d_ff=24, num_layers=2, num_heads=2,
                relative_attention_num_buckets=8, relative_attention_max_distance=20,
                decoder_start_token_id=0, dropout_rate=0.0)
CHRONOS_CONFIG = dict(
    tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs={"low_limit": -15.0,
                                                              "high_limit": 15.0},
    context_length=16, prediction_length=4, n_tokens=40, n_special_tokens=2, pad_token_id=0,
    eos_token_id=1, use_eos_token=True, model_type="seq2seq", num_samples=3, temperature=1.0,
    top_k=50, top_p=1.0)


def _hf_load(cls, path, **kw):
    """``cls.from_pretrained`` that insists on a complete, exactly matching checkpoint."""
    model, info = cls.from_pretrained(str(path), output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def _err(a, b) -> float:
    a = a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b)))


def _compressed_paths(params) -> set:
    return {p for p, n in named_leaves(params) if isinstance(n, Leaf) and not isinstance(n, Dense)}


def _same_files(original_dir, exported_dir):
    """Exported tensors == the tensors HF's own save_pretrained wrote (keys and values)."""
    ref = load_file(os.path.join(original_dir, "model.safetensors"))
    got = load_file(os.path.join(exported_dir, "model.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
        assert got[k].dtype == np.float32


def _json(path):
    with open(path) as f:
        return json.load(f)


def _hf_roundtrip(model, tmp_path, name):
    """HF save -> load_pretrained -> our save_pretrained; returns (cfg, params, summary, out).
    The export holds the files HF wrote, with the same tensors and the same configuration
    files (an unchanged model changes no field of config.json or generation_config.json)."""
    src = tmp_path / f"{name}_hf"
    model.save_pretrained(str(src))
    cfg, params = load_pretrained(src)
    out = tmp_path / f"{name}_export"
    summary = save_pretrained(cfg, params, out)
    assert summary["materialized"] == [] and summary["path"] == str(out)
    assert sorted(os.listdir(out)) == sorted(os.listdir(src)) == sorted(summary["files"])
    assert "config.json" in summary["files"] and summary["config_changed"] == []
    for name in summary["files"]:
        if name.endswith(".json"):
            assert _json(out / name) == _json(src / name), name
    _same_files(src, out)
    return cfg, params, summary, out


# ---------------------------------------------------------------------------------------------
# T5 and Chronos.

def _t5_ids(vocab, seed=0):
    rs = np.random.RandomState(seed)
    return rs.randint(2, vocab, (2, 7)), rs.randint(2, vocab, (2, 5))


def _t5_logits(model, ids, dec):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids),
                     decoder_input_ids=torch.from_numpy(dec)).logits


def _check_t5_compressed(cfg, params, tmp_path, name, lowrank):
    small = lowrank(params, r"attn/(qk/q|qk/k|v|o)$|mlp/(wi|wi_0|wi_1|wo)$", rank=3)
    expected = _compressed_paths(small)
    assert any("mlp" in p for p in expected) and any("cross_attn" in p for p in expected)
    summary = save_pretrained(cfg, small, tmp_path / f"{name}_lowrank")
    assert set(summary["materialized"]) == expected
    with safe_open(str(tmp_path / f"{name}_lowrank" / "model.safetensors"), "np") as f:
        recorded = f.metadata()["lowrank_jax_materialized"].split(",")
    assert set(recorded) == expected
    hf = _hf_load(transformers.T5ForConditionalGeneration, tmp_path / f"{name}_lowrank")
    ids, dec = _t5_ids(cfg.vocab_size, 1)
    ours = t5_apply(small, {"input_ids": ids, "decoder_input_ids": dec}, cfg)["logits"]
    ref = t5_apply(params, {"input_ids": ids, "decoder_input_ids": dec}, cfg)["logits"]
    assert _err(ours, ref) > 1e-2  # the compression changed the model...
    assert _err(_t5_logits(hf, ids, dec), ours) <= MODEL  # ...and HF runs the compressed one


def test_t5_tied_relu_roundtrip_and_compressed(tmp_path, caplog, randomize, lowrank):
    torch.manual_seed(0)
    model = randomize(transformers.T5ForConditionalGeneration(
        transformers.T5Config(**T5_SMALL, feed_forward_proj="relu")), 1)
    cfg, params, summary, out = _hf_roundtrip(model, tmp_path, "t5")
    assert cfg.tie_word_embeddings and cfg.scales_decoder_outputs
    assert summary["family"] == "t5" and summary["architecture"] == "T5ForConditionalGeneration"
    state = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in state and summary["n_tensors"] == len(state)
    # The file holds exactly the state dict of the params.
    back, _, _ = state_dict_from_params(cfg, params)
    assert set(back) == set(state)
    for k, v in back.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    hf = _hf_load(transformers.T5ForConditionalGeneration, out)
    ids, dec = _t5_ids(cfg.vocab_size)
    assert _err(_t5_logits(hf, ids, dec), _t5_logits(model, ids, dec)) <= EXACT
    with caplog.at_level(logging.WARNING, logger="lowrank_jax.convert"):
        _check_t5_compressed(cfg, params, tmp_path, "t5", lowrank)
    assert "export materialized 32 compressed leaves" in caplog.text
    assert "decoder/layers/1/cross_attn/qk/q" in caplog.text


def test_t5_untied_gated_gelu_roundtrip_and_compressed(tmp_path, randomize, lowrank):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        **T5_SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    model.lm_head.weight = torch.nn.Parameter(torch.empty(40, 16))  # transformers 5 ties it
    model = randomize(model, 2)
    cfg, params, summary, out = _hf_roundtrip(model, tmp_path, "t5v11")
    assert not cfg.tie_word_embeddings and not cfg.scales_decoder_outputs and cfg.is_gated
    assert "lm_head.weight" in load_file(os.path.join(out, "model.safetensors"))
    hf = _hf_load(transformers.T5ForConditionalGeneration, out)
    assert not torch.equal(hf.lm_head.weight, hf.shared.weight)
    ids, dec = _t5_ids(cfg.vocab_size)
    assert _err(_t5_logits(hf, ids, dec), _t5_logits(model, ids, dec)) <= EXACT
    small = lowrank(params, r"lm_head$", rank=4)
    assert isinstance(small["lm_head"], LowRank)
    summary = save_pretrained(cfg, small, tmp_path / "t5v11_head")
    assert summary["materialized"] == ["lm_head"]
    hf = _hf_load(transformers.T5ForConditionalGeneration, tmp_path / "t5v11_head")
    ours = t5_apply(small, {"input_ids": ids, "decoder_input_ids": dec}, cfg)["logits"]
    assert _err(_t5_logits(hf, ids, dec), ours) <= MODEL
    _check_t5_compressed(cfg, params, tmp_path, "t5v11", lowrank)


def test_chronos_roundtrip_pipeline_and_compressed(tmp_path, randomize, lowrank):
    chronos_ref = pytest.importorskip("chronos")
    torch.manual_seed(0)
    hf_cfg = transformers.T5Config(**T5_SMALL, feed_forward_proj="gated-gelu",
                                   chronos_config=CHRONOS_CONFIG)
    model = randomize(transformers.T5ForConditionalGeneration(hf_cfg), 3)
    cfg, params, summary, out = _hf_roundtrip(model, tmp_path, "chronos")
    assert isinstance(cfg, chronos.ChronosConfig) and summary["family"] == "chronos"
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)["chronos_config"]
    assert written == CHRONOS_CONFIG
    assert load_pretrained(out)[0] == cfg  # and it reads back as the same config

    pipe_ref = chronos_ref.ChronosPipeline.from_pretrained(str(tmp_path / "chronos_hf"))
    pipe = chronos_ref.ChronosPipeline.from_pretrained(str(out))
    context = torch.from_numpy(np.random.RandomState(0).rand(2, 12).astype(np.float32) * 5)
    emb_ref, scale_ref = pipe_ref.embed(context)
    emb, scale = pipe.embed(context)
    assert _err(emb, emb_ref) <= EXACT and _err(scale, scale_ref) == 0.0

    small = lowrank(params, r"attn/(qk/q|qk/k|v|o)$", rank=2)
    summary = save_pretrained(cfg, small, tmp_path / "chronos_lowrank")
    assert set(summary["materialized"]) == _compressed_paths(small)
    pipe = chronos_ref.ChronosPipeline.from_pretrained(str(tmp_path / "chronos_lowrank"))
    emb, _ = pipe.embed(context)
    ours, _ = chronos_embed(small, context.numpy(), cfg)
    assert _err(emb, ours) <= MODEL and _err(emb, emb_ref) > 1e-2


# ---------------------------------------------------------------------------------------------
# ViT / DeiT and BERT.

def _vit_hf_config(cls=transformers.ViTConfig, **kw):
    base = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return cls(**{**base, **kw})


def _pixels(seed=0):
    return np.random.RandomState(seed).randn(2, 3, 32, 32).astype(np.float32)


@pytest.mark.parametrize("kind", ["vit", "deit_teacher"])
def test_vit_deit_roundtrip_and_compressed(tmp_path, kind, randomize, lowrank, head_lowrank):
    torch.manual_seed(0)
    if kind == "vit":
        cls = transformers.ViTForImageClassification
        model = randomize(cls(_vit_hf_config(num_labels=3)), 4)
        heads = ("logits",)
    else:
        cls = transformers.DeiTForImageClassificationWithTeacher
        model = randomize(cls(_vit_hf_config(transformers.DeiTConfig, num_labels=3)), 5)
        heads = ("logits", "cls_logits", "distillation_logits")
    cfg, params, summary, out = _hf_roundtrip(model, tmp_path, kind)
    assert summary["architecture"] == cls.__name__ and summary["load_kwargs"] == {}
    x = torch.from_numpy(_pixels())
    hf = _hf_load(cls, out)
    with torch.no_grad():
        ref, got = model(pixel_values=x), hf(pixel_values=x)
    for name in heads:
        assert _err(got[name], ref[name]) <= EXACT, name

    small = head_lowrank(params, r"attn/(qk/q|qk/k|v)$", rank=2, num_heads=4)
    small = lowrank(small, r"attn/o$|embeddings/patch$|mlp/wi$|classifier$", rank=2)
    kinds = {type(n).__name__ for _, n in named_leaves(small) if isinstance(n, Leaf)}
    assert {"HeadLowRank", "LowRank", "Dense"} <= kinds
    assert bias_of(get_path(small, "encoder/layers/0/attn/qk/q")) is not None  # leaf biases
    summary = save_pretrained(cfg, small, tmp_path / f"{kind}_lowrank")
    assert set(summary["materialized"]) == _compressed_paths(small)
    assert "embeddings/patch" in summary["materialized"]
    hf = _hf_load(cls, tmp_path / f"{kind}_lowrank")
    ours = vit_apply(small, {"pixel_values": x.numpy()}, cfg)
    with torch.no_grad():
        got = hf(pixel_values=x, output_hidden_states=True)
    for name in heads:
        assert _err(got[name], ours[name]) <= MODEL, name
    assert _err(got[heads[0]], ref[heads[0]]) > 1e-2


def test_bert_roundtrip_and_compressed_with_masked_binary(tmp_path, randomize, lowrank):
    torch.manual_seed(0)
    model = randomize(transformers.BertModel(transformers.BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=16, type_vocab_size=2)), 6)
    cfg, params, summary, out = _hf_roundtrip(model, tmp_path, "bert")
    assert summary["architecture"] == "BertModel" and cfg.pooler
    rs = np.random.RandomState(0)
    ids = rs.randint(0, 40, (2, 9))
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    types = rs.randint(0, 2, (2, 9))
    inputs = dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                  token_type_ids=torch.from_numpy(types))
    hf = _hf_load(transformers.BertModel, out)
    with torch.no_grad():
        ref, got = model(**inputs), hf(**inputs)
    assert _err(got.last_hidden_state, ref.last_hidden_state) <= EXACT
    assert _err(got.pooler_output, ref.pooler_output) <= EXACT

    small = lowrank(params, r"attn/(qk/q|qk/k|v|o)$|pooler$", rank=3)
    binary = init_masked_binary(jax.random.PRNGKey(0), 64, 32, keep=0.5, bias=True)
    binary = binary.with_bias(0.1 * jax.random.normal(jax.random.PRNGKey(1), (32,)))
    small = replace_paths(small, {"encoder/layers/1/mlp/wo": binary})
    summary = save_pretrained(cfg, small, tmp_path / "bert_lowrank")
    assert set(summary["materialized"]) == _compressed_paths(small)
    assert "encoder/layers/1/mlp/wo" in summary["materialized"]
    state = load_file(os.path.join(tmp_path / "bert_lowrank", "model.safetensors"))
    np.testing.assert_array_equal(state["encoder.layer.1.output.dense.bias"], bias_of(binary))
    np.testing.assert_array_equal(state["encoder.layer.1.output.dense.weight"],
                                  np.asarray(materialize(binary)).T)
    hf = _hf_load(transformers.BertModel, tmp_path / "bert_lowrank")
    ours = bert_apply(small, {"input_ids": ids, "attention_mask": mask,
                              "token_type_ids": types}, cfg)
    with torch.no_grad():
        got = hf(**inputs)
    assert _err(got.last_hidden_state, ours["last_hidden_state"]) <= MODEL
    assert _err(got.pooler_output, ours["pooler_output"]) <= MODEL
    assert _err(got.pooler_output, ref.pooler_output) > 1e-2


def test_vit_without_qkv_bias_drops_the_zero_biases(tmp_path, randomize):
    model = randomize(transformers.ViTForImageClassification(
        _vit_hf_config(num_labels=2, qkv_bias=False, num_hidden_layers=1)), 7)
    cfg, params, _, out = _hf_roundtrip(model, tmp_path, "vit_nobias")  # same keys as HF's
    assert not cfg.qkv_bias
    x = torch.from_numpy(_pixels(3))
    with torch.no_grad():
        ref = model(pixel_values=x).logits
        got = _hf_load(transformers.ViTForImageClassification, out)(pixel_values=x).logits
    assert _err(got, ref) <= EXACT
    q = get_path(params, "encoder/layers/0/attn/qk/q")
    assert not np.any(np.asarray(bias_of(q)))  # the importer's zero biases
    params = replace_paths(params, {"encoder/layers/0/attn/qk/q": q.with_bias(bias_of(q) + 1.0)})
    with pytest.raises(CheckpointError, match="encoder/layers/0/attn/qk/q/b"):
        save_pretrained(cfg, params, tmp_path / "bad")
    assert not os.path.exists(tmp_path / "bad")


def test_base_models_without_pooler_report_load_kwargs(tmp_path):
    cfg = bert.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=8, pooler=False)
    params = bert.init(jax.random.PRNGKey(0), cfg)
    summary = save_pretrained(cfg, params, tmp_path / "bert")
    assert summary["load_kwargs"] == {"add_pooling_layer": False}
    hf = _hf_load(transformers.BertModel, tmp_path / "bert", **summary["load_kwargs"])
    ids = np.random.RandomState(0).randint(0, 20, (1, 5))
    with torch.no_grad():
        got = hf(input_ids=torch.from_numpy(ids)).last_hidden_state
    assert _err(got, bert_apply(params, {"input_ids": ids}, cfg)["last_hidden_state"]) <= MODEL
    vcfg = vit.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32, distillation=True)
    summary = save_pretrained(vcfg, vit.init(jax.random.PRNGKey(1), vcfg), tmp_path / "deit")
    assert summary["architecture"] == "DeiTModel"
    assert summary["load_kwargs"] == {"add_pooling_layer": False}
    _hf_load(transformers.DeiTModel, tmp_path / "deit", **summary["load_kwargs"])


# ---------------------------------------------------------------------------------------------
# Malformed cases: the documented error, and nothing written.

@pytest.fixture(scope="module")
def tiny_t5():
    cfg = t5.T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                      relative_attention_num_buckets=4, relative_attention_max_distance=8)
    return cfg, t5.init(jax.random.PRNGKey(0), cfg)


def _listing(d):
    return sorted(os.listdir(d))


def test_non_empty_target_needs_overwrite(tmp_path, tiny_t5):
    cfg, params = tiny_t5
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not empty.*overwrite=True"):
        save_pretrained(cfg, params, target)
    assert _listing(target) == ["keep.txt"] and _listing(tmp_path) == ["out"]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OutputExistsError, match="not a directory"):
        save_pretrained(cfg, params, tmp_path / "a_file", overwrite=True)
    # An empty directory is fine; overwrite=True replaces a non-empty one entirely.
    (tmp_path / "empty").mkdir()
    save_pretrained(cfg, params, tmp_path / "empty")
    assert _listing(tmp_path / "empty") == ["config.json", "model.safetensors"]
    save_pretrained(cfg, params, target, overwrite=True)
    assert _listing(target) == ["config.json", "model.safetensors"]
    assert _listing(tmp_path) == ["a_file", "empty", "out"]  # no temp or backup left
    assert load_pretrained(target)[0].to_hf_dict() == cfg.to_hf_dict()


def test_unknown_config_type(tmp_path, tiny_t5):
    class OtherConfig:
        pass

    with pytest.raises(ConfigError, match="no model family is registered for config type "
                                          "OtherConfig"):
        save_pretrained(OtherConfig(), tiny_t5[1], tmp_path / "out")
    # A registered family without a Hugging Face mapping is named as such.
    pcfg = patch_encoder.PatchEncoderConfig()
    with pytest.raises(ConfigError, match="'patch_encoder' has no Hugging Face mapping"):
        save_pretrained(pcfg, tiny_t5[1], tmp_path / "out")
    assert _listing(tmp_path) == []


def test_malformed_params_name_every_path_and_write_nothing(tmp_path, tiny_t5):
    cfg, params = tiny_t5
    qk = params["encoder"]["layers"][0]["attn"]["qk"]
    wo = params["decoder"]["layers"][0]["mlp"]["wo"]
    bad = replace_paths(params, {
        "encoder/layers/0/attn/qk": QueryKey(q=get_path(params, "encoder/layers/0/attn/qk/q"),
                                             k=None, widths=qk.widths),  # missing k
        "decoder/final_norm": {"scale": np.ones(7, np.float32)},  # mis-shaped
        "decoder/layers/0/mlp/wo": wo.with_bias(np.ones(8, np.float32)),  # T5 stores none
    })
    bad["lm_head"] = Dense(w=np.zeros((8, 20), np.float32))  # no place in a tied T5
    target = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        save_pretrained(cfg, bad, target)
    err = e.value
    assert set(err.missing) == {"encoder/layers/0/attn/qk/k"}
    assert err.missing["encoder/layers/0/attn/qk/k"] == (8, 8)
    assert err.mismatched == {"decoder/final_norm/scale": ((8,), (7,))}
    assert set(err.unexpected) == {"lm_head", "decoder/layers/0/mlp/wo/b"}
    assert _listing(tmp_path) == []
    # A linear path holding a plain array of the wrong kind is named too.
    bad2 = dict(params, shared=Dense(w=np.zeros((20, 8), np.float32)))
    with pytest.raises(CheckpointError, match="shared .*must be a plain array"):
        save_pretrained(cfg, bad2, target)
    assert _listing(tmp_path) == []


def test_error_while_writing_leaves_nothing(tmp_path, tiny_t5, monkeypatch):
    cfg, params = tiny_t5
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    import safetensors.numpy

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(cfg, params, target, overwrite=True)
    assert _listing(tmp_path) == ["out"] and _listing(target) == ["old.txt"]


_TOY_FAMILY = """
import dataclasses, sys
import jax, numpy as np
from lowrank_jax.convert import load_pretrained, save_pretrained, state_dict_from_params
from lowrank_jax.leaves import Dense, LowRank, bias_of, init_dense, materialize
from lowrank_jax.models import ModelFamily, register_family
from lowrank_jax.models.hf import HFRow, HFSpec


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    d: int = 3


def init(key, cfg):
    return {"proj": init_dense(key, cfg.d, 2, bias=True),
            "table": jax.numpy.zeros((4,), jax.numpy.float32)}


def key_table(cfg):
    return [HFRow("proj.weight", "proj", "linear", (2, cfg.d)),
            HFRow("proj.bias", "proj", "bias", (2,)),
            HFRow("table", "table", "array", (1, 4))]


spec = HFSpec(detect=lambda d: d.get("model_type") == "toy",
              config_from_hf=lambda d, state: ToyConfig(d=int(d["d"])),
              config_to_hf=lambda cfg: {"model_type": "toy", "architectures": ["Toy"],
                                        "d": cfg.d},
              key_table=key_table)
register_family(ModelFamily(name="toy", config_cls=ToyConfig, init=init, apply=None,
                            sample_inputs=None, primary_outputs=(), hf=spec))
w = np.arange(6, dtype=np.float32).reshape(3, 2)
params = {"proj": LowRank(u=w, v=np.eye(2, dtype=np.float32), b=np.ones(2, np.float32)),
          "table": np.arange(4, dtype=np.float32)}
state, mat, widened = state_dict_from_params(ToyConfig(), params)
np.testing.assert_array_equal(state["proj.weight"], w.T)
np.testing.assert_array_equal(state["proj.bias"], np.ones(2))
assert state["table"].shape == (1, 4) and mat == ["proj"] and widened == []
summary = save_pretrained(ToyConfig(), params, sys.argv[1])
assert summary["family"] == "toy" and summary["n_tensors"] == 3
assert summary["materialized"] == ["proj"] and summary["architecture"] == "Toy"
cfg, back = load_pretrained(sys.argv[1])
assert cfg == ToyConfig()
assert isinstance(back["proj"], Dense)
np.testing.assert_array_equal(np.asarray(materialize(back["proj"])), w)
np.testing.assert_array_equal(np.asarray(bias_of(back["proj"])), np.ones(2))
np.testing.assert_array_equal(np.asarray(back["table"]), np.arange(4))
print("TOY OK")
"""


def test_new_family_exports_and_imports_through_its_spec(tmp_path):
    """The extension point: a family registered outside the converters (a ModelFamily with an
    HFSpec) saves and loads with no converter code; compressed leaves are materialized. Run in
    a fresh interpreter so that the toy family does not stay registered for other tests."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _TOY_FAMILY, str(tmp_path / "toy")],
                       capture_output=True, text=True, env=env, cwd=root)
    assert r.returncode == 0 and "TOY OK" in r.stdout, r.stderr[-3000:]
