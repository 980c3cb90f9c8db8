"""ViT / DeiT: parity with Hugging Face PyTorch models on tiny random configs (float32)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.leaves import Dense, linear  # noqa: E402
from lowrank_jax.models import vit  # noqa: E402

TOL = 1e-4  # whole-model float32 parity (design.md)


def _randomize(model, seed):
    """Re-draw every parameter with a scale at which each weight visibly matters.

    HF initializes tokens to zero (DeiT) and weights with std 0.02; that would let a swapped
    token or a dropped bias pass a 1e-4 check.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.15 * torch.randn(p.shape, generator=g)
            is_norm_scale = p.ndim == 1 and "norm" in name.lower() and name.endswith("weight")
            p.copy_(1.0 + noise if is_norm_scale else noise)
    return model.eval()


def _hf_config(cls, **kw):
    base = dict(image_size=32, num_channels=3, num_hidden_layers=2, num_attention_heads=4,
                hidden_act="gelu", layer_norm_eps=1e-12)
    base.update(kw)
    return cls(**base)


def _load(model):
    """Through the converter (state dict as save_pretrained writes it)."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    hf_cfg = model.config.to_dict()
    hf_cfg["architectures"] = [type(model).__name__]
    return load_pretrained(state, config=hf_cfg)


def _init_apply(cfg, x, seed=0):
    """Parameters with init's structure (random NumPy values: compiling init is slow on CPU)
    and the jit-compiled outputs."""
    shapes = jax.eval_shape(lambda k: vit.init(k, cfg), jax.random.PRNGKey(seed))
    rng = np.random.RandomState(seed)
    params = jax.tree_util.tree_map(
        lambda s: (0.1 * rng.randn(*s.shape)).astype(np.float32), shapes)
    return params, jax.jit(lambda p, x: vit.apply(p, {"pixel_values": x}, cfg))(params, x)


def _images(cfg, seed, batch=3):
    return np.random.RandomState(seed).randn(batch, 3, cfg.image_size, cfg.image_size).astype(
        np.float32)


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - b.detach().numpy())))


CASES = [
    # (HF class, config kwargs, outputs compared)
    ("ViTModel", dict(patch_size=8, hidden_size=48, intermediate_size=96),
     ("last_hidden_state", "pooler_output")),
    ("ViTModel", dict(patch_size=16, hidden_size=32, intermediate_size=64),
     ("last_hidden_state", "pooler_output")),
    ("ViTForImageClassification", dict(patch_size=8, hidden_size=32, intermediate_size=80,
                                       num_labels=7), ("logits",)),
    ("ViTForImageClassification", dict(patch_size=16, hidden_size=64, intermediate_size=128,
                                       num_labels=3), ("logits",)),
    ("DeiTForImageClassificationWithTeacher", dict(patch_size=8, hidden_size=48,
                                                   intermediate_size=96, num_labels=5),
     ("logits", "cls_logits", "distillation_logits")),
    ("DeiTForImageClassificationWithTeacher", dict(patch_size=16, hidden_size=32,
                                                   intermediate_size=64, num_labels=4),
     ("logits", "cls_logits", "distillation_logits")),
    ("DeiTForImageClassification", dict(patch_size=8, hidden_size=32, intermediate_size=64,
                                        num_labels=6), ("logits",)),
    ("DeiTModel", dict(patch_size=16, hidden_size=32, intermediate_size=64),
     ("last_hidden_state", "pooler_output")),
]


@pytest.mark.parametrize("cls_name,kw,outputs", CASES,
                         ids=[f"{c}-p{k['patch_size']}-d{k['hidden_size']}" for c, k, _ in CASES])
def test_parity_with_hugging_face(cls_name, kw, outputs):
    torch.manual_seed(0)
    cfg_cls = transformers.DeiTConfig if cls_name.startswith("DeiT") else transformers.ViTConfig
    model = _randomize(getattr(transformers, cls_name)(_hf_config(cfg_cls, **kw)), seed=1)
    cfg, params = _load(model)
    x = _images(cfg, seed=2)
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(x))
    got = jax.jit(lambda p, x: vit.apply(p, {"pixel_values": x}, cfg))(params, x)
    if "last_hidden_state" not in outputs:
        assert "last_hidden_state" in got
    for name in outputs:
        assert got[name].shape == tuple(ref[name].shape), name
        err = _max_err(got[name], ref[name])
        assert err <= TOL, f"{name}: max abs error {err:.3g}"
    assert set(got) >= set(outputs)


def test_patch_embedding_equals_conv():
    cfg = vit.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=16,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    rng = np.random.RandomState(0)
    w = (0.1 * rng.randn(16, 3, 8, 8)).astype(np.float32)  # outputs O(1), as in a model
    b = rng.randn(16).astype(np.float32)
    x = rng.randn(2, 3, 32, 32).astype(np.float32)
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w),
                                     torch.from_numpy(b), stride=8)  # [2, 16, 4, 4]
    ref = ref.flatten(2).transpose(1, 2).numpy()  # [2, 16 patches, 16]
    leaf = Dense(w=jnp.asarray(w.reshape(16, -1).T), b=jnp.asarray(b))
    got = linear(leaf, vit.patchify(x, cfg))
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=0)


def test_init_apply_shapes_and_heads():
    cfg = vit.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=3,
                        distillation=True)
    params, out = _init_apply(cfg, _images(cfg, 0, batch=2))
    assert params["embeddings"]["patch"].shape == (3 * 8 * 8, 32)
    assert params["embeddings"]["position"].shape == (16 + 2, 32)
    assert out["last_hidden_state"].shape == (2, 18, 32)
    np.testing.assert_allclose(out["logits"], (out["cls_logits"] + out["distillation_logits"]) / 2,
                               rtol=1e-6, atol=1e-6)
    single = dataclasses.replace(cfg, distillation_head=False)
    p1, out1 = _init_apply(single, _images(cfg, 0, batch=2))
    assert "distillation_classifier" not in p1
    assert set(out1) == {"last_hidden_state", "logits"}


def test_config_errors_speak():
    with pytest.raises(ValueError, match="patch_size=12 must divide image_size=32"):
        vit.ViTConfig(image_size=32, patch_size=12)
    with pytest.raises(ValueError, match="image_size must be an int"):
        vit.ViTConfig.from_hf_dict({"model_type": "vit", "image_size": [32, 48]})
    cfg = vit.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32)
    params = jax.eval_shape(lambda k: vit.init(k, cfg), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"pixel_values must be NCHW \[batch, 3, 32, 32\]"):
        vit.apply(params, {"pixel_values": np.zeros((1, 32, 32, 3), np.float32)}, cfg)


def test_from_hf_dict_reads_heads():
    base = {"model_type": "deit", "image_size": 32, "patch_size": 8, "hidden_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64,
            "id2label": {"0": "a", "1": "b", "2": "c"}}
    teacher = vit.ViTConfig.from_hf_dict(
        {**base, "architectures": ["DeiTForImageClassificationWithTeacher"]})
    assert teacher.distillation and teacher.teacher_head and teacher.num_labels == 3
    assert not teacher.pooler
    plain = vit.ViTConfig.from_hf_dict({**base, "architectures": ["DeiTModel"]})
    assert plain.num_labels == 0 and plain.pooler and plain.distillation
    v = vit.ViTConfig.from_hf_dict({**base, "model_type": "vit",
                                    "architectures": ["ViTForImageClassification"]})
    assert not v.distillation and v.num_labels == 3 and not v.pooler
