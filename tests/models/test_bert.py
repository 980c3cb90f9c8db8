"""BERT: parity with Hugging Face ``BertModel`` / ``BertForSequenceClassification`` (float32)."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.models import bert  # noqa: E402

TOL = 1e-4  # whole-model float32 parity (design.md)


def _randomize(model, seed):
    """Re-draw every parameter at a scale where each weight visibly matters (see test_vit)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.15 * torch.randn(p.shape, generator=g)
            p.copy_(1.0 + noise if name.endswith("LayerNorm.weight") else noise)
    return model.eval()


def _load(model):
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    hf_cfg = model.config.to_dict()
    hf_cfg["architectures"] = [type(model).__name__]
    return load_pretrained(state, config=hf_cfg)


def _inputs(cfg, seed, batch=3, seq=13):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[1, seq - 5:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    types = rng.randint(0, cfg.type_vocab_size, (batch, seq)).astype(np.int32)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types)


CASES = [
    ("BertModel", dict(vocab_size=97, hidden_size=32, intermediate_size=64,
                       max_position_embeddings=24, type_vocab_size=2),
     ("last_hidden_state", "pooler_output")),
    ("BertModel", dict(vocab_size=64, hidden_size=48, intermediate_size=112,
                       max_position_embeddings=16, type_vocab_size=3),
     ("last_hidden_state", "pooler_output")),
    ("BertForSequenceClassification", dict(vocab_size=80, hidden_size=64, intermediate_size=128,
                                           max_position_embeddings=20, type_vocab_size=2,
                                           num_labels=3), ("logits",)),
]


@pytest.mark.parametrize("cls_name,kw,outputs", CASES,
                         ids=[f"{c}-d{k['hidden_size']}" for c, k, _ in CASES])
def test_parity_with_hugging_face(cls_name, kw, outputs):
    hf_cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=4,
                                     hidden_act="gelu", **kw)
    model = _randomize(getattr(transformers, cls_name)(hf_cfg), seed=3)
    cfg, params = _load(model)
    inputs = _inputs(cfg, seed=4)
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v).long() for k, v in inputs.items()})
    run = jax.jit(lambda p, i, m, t: bert.apply(
        p, {"input_ids": i, "attention_mask": m, "token_type_ids": t}, cfg))
    got = run(params, inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"])
    for name in outputs:
        assert got[name].shape == tuple(ref[name].shape), name
        # All positions, padded queries included: they attend the valid keys in both.
        diff = np.abs(np.asarray(got[name]) - ref[name].numpy())
        assert diff.max() <= TOL, f"{name}: max abs error {diff.max():.3g}"
    if "logits" in outputs:
        assert "pooler_output" in got


def test_defaults_match_hugging_face_defaults():
    """No attention_mask / token_type_ids: all tokens valid, segment 0 (as BertModel)."""
    hf_cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=16, type_vocab_size=2)
    model = _randomize(transformers.BertModel(hf_cfg), seed=5)
    cfg, params = _load(model)
    ids = np.random.RandomState(6).randint(0, 50, (2, 9)).astype(np.int32)
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids).long())
    got = jax.jit(lambda p, i: bert.apply(p, {"input_ids": i}, cfg))(params, ids)
    for name in ("last_hidden_state", "pooler_output"):
        err = float(np.max(np.abs(np.asarray(got[name]) - ref[name].numpy())))
        assert err <= TOL, f"{name}: max abs error {err:.3g}"


def test_init_structure_and_errors():
    cfg = bert.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=8, num_labels=2)
    shapes = jax.eval_shape(lambda k: bert.init(k, cfg), jax.random.PRNGKey(0))
    assert shapes["embeddings"]["word"].shape == (30, 16)
    assert shapes["encoder"]["layers"][1]["mlp"]["wi"].shape == (16, 32)
    assert "final_norm" not in shapes["encoder"]  # post-norm: no final LayerNorm
    assert shapes["classifier"].shape == (16, 2)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=8"):
        bert.apply(shapes, {"input_ids": np.zeros((1, 9), np.int32)}, cfg)
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        bert.apply(shapes, {"input_ids": np.zeros((1, 4), np.int32),
                            "attention_mask": np.ones((1, 5), np.int32)}, cfg)
    with pytest.raises(ValueError, match="needs the pooler"):
        bert.BertConfig(pooler=False, num_labels=2)
    with pytest.raises(ValueError, match="position_embedding_type must be 'absolute'"):
        bert.BertConfig.from_hf_dict({"model_type": "bert",
                                      "position_embedding_type": "relative_key"})
