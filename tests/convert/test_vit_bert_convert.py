"""ViT / DeiT / BERT checkpoints through ``load_pretrained``: directories, prefixes, file
formats, and malformed checkpoints (every offending key named with its shapes)."""

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from lowrank_jax.convert import CheckpointError, detect_family, hf_families, load_pretrained  # noqa: E402,I001
from lowrank_jax.leaves import Dense, get_path, materialize  # noqa: E402
from lowrank_jax.models import apply as models_apply, bert, families, vit  # noqa: E402

TOL = 1e-4
# One compiled forward per model instead of op-by-op dispatch (slow on CPU).
vit_apply = jax.jit(vit.apply, static_argnums=2)
bert_apply = jax.jit(bert.apply, static_argnums=2)


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.15 * torch.randn(p.shape, generator=g)
            is_norm_scale = p.ndim == 1 and "norm" in name.lower() and name.endswith("weight")
            p.copy_(1.0 + noise if is_norm_scale else noise)
    return model.eval()


def _vit_hf_config(cls=transformers.ViTConfig, **kw):
    base = dict(image_size=32, patch_size=16, num_channels=3, hidden_size=32,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    base.update(kw)
    return cls(**base)


def _bert_hf_config(**kw):
    base = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=16, type_vocab_size=2)
    base.update(kw)
    return transformers.BertConfig(**base)


def _save(model, path, **kw):
    model.save_pretrained(str(path), **kw)
    return str(path)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    """A saved ViTForImageClassification (prefixed keys + head)."""
    torch.manual_seed(0)
    model = _randomize(transformers.ViTForImageClassification(_vit_hf_config(num_labels=4)), 1)
    return model, _save(model, tmp_path_factory.mktemp("vit_cls"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A saved BertModel (unprefixed keys + pooler)."""
    torch.manual_seed(0)
    model = _randomize(transformers.BertModel(_bert_hf_config()), 2)
    return model, _save(model, tmp_path_factory.mktemp("bert"))


def _pixels(seed=0):
    return np.random.RandomState(seed).randn(2, 3, 32, 32).astype(np.float32)


def _err(got, ref):
    return float(np.max(np.abs(np.asarray(got) - ref.detach().numpy())))


def test_families_registered_and_detected():
    assert {"vit", "bert"} <= set(hf_families())
    assert detect_family({"model_type": "vit"}) == "vit"
    assert detect_family({"model_type": "deit"}) == "vit"
    assert detect_family({"model_type": "bert"}) == "bert"


def test_vit_classifier_directory(vit_dir):
    model, path = vit_dir
    cfg, params = load_pretrained(path)
    assert isinstance(cfg, vit.ViTConfig) and cfg.num_labels == 4 and not cfg.pooler
    # Flax orientation: Linear [out, in] transposed; conv [d, C, p, p] -> [C*p*p, d].
    q = model.vit.layers[0].attention.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(
        materialize(get_path(params, "encoder/layers/0/attn/qk/q")), q.T)
    heads = params["encoder"]["layers"][0]["attn"]["heads"]  # scaled: 1/sqrt(32 / 4)
    assert heads.ids == (0, 1, 2, 3) and heads.scale == pytest.approx(8 ** -0.5)
    assert isinstance(params["embeddings"]["patch"], Dense)
    assert params["embeddings"]["patch"].shape == (3 * 16 * 16, 32)
    x = _pixels()
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(x))
    got = jax.jit(lambda p, x: vit.apply(p, {"pixel_values": x}, cfg))(params, x)
    assert _err(got["logits"], ref.logits) <= TOL


def test_vit_base_model_without_prefix_and_without_pooler(tmp_path):
    for add_pool in (True, False):
        model = _randomize(transformers.ViTModel(_vit_hf_config(patch_size=8),
                                                 add_pooling_layer=add_pool), 3)
        path = _save(model, tmp_path / f"pool{add_pool}")
        cfg, params = load_pretrained(path)
        assert cfg.pooler is add_pool and ("pooler" in params) is add_pool
        x = _pixels(1)
        with torch.no_grad():
            ref = model(pixel_values=torch.from_numpy(x))
        got = jax.jit(lambda p, x, cfg=cfg: vit.apply(p, {"pixel_values": x}, cfg))(params, x)
        assert _err(got["last_hidden_state"], ref.last_hidden_state) <= TOL
        if add_pool:
            assert _err(got["pooler_output"], ref.pooler_output) <= TOL


def test_deit_teacher_pytorch_bin_and_module(tmp_path):
    """``pytorch_model.bin`` and an in-memory module (transformers 5.x key names) both load."""
    model = _randomize(transformers.DeiTForImageClassificationWithTeacher(
        _vit_hf_config(transformers.DeiTConfig, patch_size=8, num_labels=3)), 4)
    path = _save(model, tmp_path / "deit")
    # transformers 5 writes only safetensors: rewrite the same keys as a pytorch_model.bin.
    st = os.path.join(path, "model.safetensors")
    torch.save({k: torch.from_numpy(v) for k, v in safetensors_numpy.load_file(st).items()},
               os.path.join(path, "pytorch_model.bin"))
    os.remove(st)
    cfg, params = load_pretrained(path)
    assert cfg.distillation and cfg.teacher_head
    cfg_m, params_m = load_pretrained(model)
    assert cfg_m == cfg
    x = _pixels(2)
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(x))
    for p in (params, params_m):
        got = vit_apply(p, {"pixel_values": x}, cfg)
        for name in ("logits", "cls_logits", "distillation_logits"):
            assert _err(got[name], ref[name]) <= TOL, name


def test_bert_directory_and_prefixed_classifier(bert_dir, tmp_path):
    model, path = bert_dir
    cfg, params = load_pretrained(path)
    assert isinstance(cfg, bert.BertConfig) and cfg.pooler and cfg.num_labels == 0
    ids = np.random.RandomState(0).randint(0, 40, (2, 7)).astype(np.int32)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3], np.int32)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids).long(),
                    attention_mask=torch.from_numpy(mask).long())
    got = bert_apply(params, {"input_ids": ids, "attention_mask": mask}, cfg)
    assert _err(got["pooler_output"], ref.pooler_output) <= TOL

    clf = _randomize(transformers.BertForSequenceClassification(_bert_hf_config(num_labels=5)), 6)
    cfg_c, params_c = load_pretrained(_save(clf, tmp_path / "clf"))
    assert cfg_c.num_labels == 5
    with torch.no_grad():
        ref_c = clf(input_ids=torch.from_numpy(ids).long())
    assert _err(bert_apply(params_c, {"input_ids": ids}, cfg_c)["logits"], ref_c.logits) <= TOL


def test_bert_old_position_ids_buffer_is_ignored(bert_dir, tmp_path):
    _, path = bert_dir
    state = safetensors_numpy.load_file(os.path.join(path, "model.safetensors"))
    state["embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
    cfg, params = load_pretrained(state, config=os.path.join(path, "config.json"))
    assert cfg.hidden_size == 32


def _tampered(src, dst, edit):
    """Copy a saved directory with its safetensors state edited by ``edit(state)``."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    state = safetensors_numpy.load_file(os.path.join(src, "model.safetensors"))
    edit(state)
    safetensors_numpy.save_file(state, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_vit_malformed_checkpoint_names_every_key(vit_dir, tmp_path):
    _, path = vit_dir

    def edit(state):
        del state["vit.encoder.layer.1.attention.attention.key.weight"]
        del state["classifier.bias"]
        state["vit.encoder.layer.0.extra.weight"] = np.zeros((3, 2), np.float32)
        state["vit.embeddings.position_embeddings"] = np.zeros((1, 6, 32), np.float32)
        state["vit.encoder.layer.0.intermediate.dense.weight"] = np.zeros((64, 31), np.float32)

    with pytest.raises(CheckpointError) as info:
        load_pretrained(_tampered(path, tmp_path / "bad", edit))
    err = info.value
    assert err.missing == {"vit.encoder.layer.1.attention.attention.key.weight": (32, 32),
                           "classifier.bias": (4,)}
    assert err.unexpected == {"vit.encoder.layer.0.extra.weight": (3, 2)}
    assert err.mismatched == {"vit.embeddings.position_embeddings": ((1, 5, 32), (1, 6, 32)),
                              "vit.encoder.layer.0.intermediate.dense.weight":
                                  ((64, 32), (64, 31))}
    msg = str(err)
    assert "missing key 'classifier.bias': expected shape [4]" in msg
    assert "unexpected key 'vit.encoder.layer.0.extra.weight': actual shape [3, 2]" in msg
    assert ("wrong shape for 'vit.embeddings.position_embeddings': expected [1, 5, 32], "
            "got [1, 6, 32]") in msg


def test_bert_malformed_and_foreign_heads(bert_dir, tmp_path):
    _, path = bert_dir

    def edit(state):
        del state["encoder.layer.0.attention.output.LayerNorm.bias"]
        state["cls.predictions.bias"] = np.zeros((40,), np.float32)
        state["embeddings.word_embeddings.weight"] = np.zeros((41, 32), np.float32)

    with pytest.raises(CheckpointError) as info:
        load_pretrained(_tampered(path, tmp_path / "bad", edit))
    err = info.value
    assert err.missing == {"encoder.layer.0.attention.output.LayerNorm.bias": (32,)}
    assert err.unexpected == {"cls.predictions.bias": (40,)}
    assert err.mismatched == {"embeddings.word_embeddings.weight": ((40, 32), (41, 32))}


def test_models_apply_entry_point(vit_dir, bert_dir):
    """``lowrank_jax.models.apply(params, inputs, config)`` dispatches to ViT/BERT."""
    assert families()["vit"].config_cls is vit.ViTConfig
    assert families()["bert"].config_cls is bert.BertConfig
    cfg, params = load_pretrained(vit_dir[1])
    x = _pixels(3)
    run = jax.jit(models_apply, static_argnums=2)
    np.testing.assert_array_equal(run(params, {"pixel_values": x}, cfg)["logits"],
                                  vit_apply(params, {"pixel_values": x}, cfg)["logits"])
    cfg_b, params_b = load_pretrained(bert_dir[1])
    ids = np.arange(6, dtype=np.int32)[None]
    np.testing.assert_array_equal(
        run(params_b, {"input_ids": ids}, cfg_b)["pooler_output"],
        bert_apply(params_b, {"input_ids": ids}, cfg_b)["pooler_output"])
