"""Llama-style family (Llama, Qwen2, Mistral) against the PyTorch originals: logits, converter
round trips, config reading, cached decoding."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.convert import load_pretrained, save_pretrained  # noqa: E402
from lowrank_jax.errors import ConfigError, DataError  # noqa: E402
from lowrank_jax.models import LlamaConfig, apply, llama  # noqa: E402
from lowrank_jax.models.causal import key_mask_for_cache, positions_from_mask  # noqa: E402
from lowrank_jax.nn.rotary import RopeConfig  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# (model type, heads, kv heads, head_dim, bias, tied, rope): GQA ratios 1, 2 and 4, odd widths,
# biases on and off, tied and untied, the three rope types
GRID = [
    ("llama", 3, 3, None, False, False, None),
    ("llama", 4, 2, 6, True, True, {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}),
    ("llama", 4, 1, 10, False, True, LLAMA3),
    ("qwen2", 4, 2, None, None, False, None),
    ("mistral", 8, 2, 4, None, False, None),
]


def _hf_model(lm, model_type, heads, kv, head_dim, bias, tied, rope, layers=2):
    """A random model of the grid with varied biases and norms (``lm``: tests/lm_builders.py)."""
    kw = dict(vocab_size=53, hidden_size=heads * 5,
              intermediate_size=37, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, tie_word_embeddings=tied, max_position_embeddings=64)
    if head_dim is None:
        kw["hidden_size"] = heads * 6  # even head width
    else:
        kw["head_dim"] = head_dim
    if rope is not None:
        kw["rope_parameters"] = rope
    if model_type == "llama":
        kw.update(attention_bias=bias, mlp_bias=bias)
    elif model_type == "mistral":
        kw["sliding_window"] = 32
    return lm.hf_lm(model_type, seed=0, vary=True, **kw)


def _inputs(vocab, batch=3, seq=11):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, (batch, seq))
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("case", GRID, ids=[f"{g[0]}-h{g[1]}-kv{g[2]}" for g in GRID])
def test_logits_and_round_trip_match_transformers(case, tmp_path, lm):
    model = _hf_model(lm, *case)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_pretrained(tmp_path / "hf")
    assert cfg.model_type == case[0] and cfg.num_key_value_heads == case[2]
    ids, mask = _inputs(model.config.vocab_size)
    pos = np.asarray(positions_from_mask(mask))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos)).logits.numpy()
    out = np.asarray(apply(params, {"input_ids": ids, "attention_mask": mask,
                                    "position_ids": pos}, cfg)["logits"])
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=1e-4, rtol=0)

    summary = save_pretrained(cfg, params, tmp_path / "out")
    assert summary["config_changed"] == [] and summary["materialized"] == []
    back = type(model).from_pretrained(tmp_path / "out").eval()
    ref_state, back_state = model.state_dict(), back.state_dict()
    assert set(ref_state) == set(back_state)
    for k, v in ref_state.items():
        assert torch.equal(v, back_state[k]), k
    for name in ("config.json", "generation_config.json"):
        src = json.loads((tmp_path / "hf" / name).read_text())
        dst = json.loads((tmp_path / "out" / name).read_text())
        assert src == dst, name


def test_cached_decoding_equals_the_forward():
    cfg = LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, o_bias=True)
    import jax

    params = llama.init(jax.random.PRNGKey(0), cfg)
    ids, mask = _inputs(cfg.vocab_size, seq=9)
    pos = positions_from_mask(mask)
    full = np.asarray(apply(params, {"input_ids": ids, "attention_mask": mask,
                                     "position_ids": pos}, cfg)["logits"])
    cache = llama.init_cache(params, cfg, batch=3, max_len=12)
    km = key_mask_for_cache(np.concatenate([mask, np.ones((3, 3), mask.dtype)], 1), 12)
    # cache holds one entry per key-value head
    assert cache["layers"][0]["k"].shape == (3, 2, 12, 4)  # [batch, kv heads, len, w]
    parts = []
    for lo, hi in ((0, 5), (5, 6), (6, 9)):
        logits, cache = llama.apply_cached(params, ids[:, lo:hi], cfg, cache,
                                           positions=pos[:, lo:hi], key_mask=km)
        parts.append(np.asarray(logits))
    got = np.concatenate(parts, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], full[real], atol=1e-5, rtol=0)
    assert int(cache["index"]) == 9
    # a prompt's prefill: the last token's logits alone
    last, cache = llama.apply_cached(params, ids, cfg, llama.init_cache(params, cfg, batch=3,
                                                                        max_len=12),
                                     positions=pos, key_mask=km, last_only=True)
    assert last.shape == (3, 1, cfg.vocab_size) and int(cache["index"]) == 9
    np.testing.assert_allclose(np.asarray(last)[:, 0], full[:, -1], atol=1e-5, rtol=0)


def test_reads_older_rope_keys_and_writes_rope_parameters():
    old = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
           "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    cfg = LlamaConfig.from_hf_dict(old)
    assert cfg.rope == RopeConfig(rope_type="linear", theta=1234.0, factor=4.0)
    assert cfg.to_hf_dict()["rope_parameters"] == {"rope_type": "linear", "rope_theta": 1234.0,
                                                   "factor": 4.0}
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported"):
        LlamaConfig.from_hf_dict({**old, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_rotary_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lowrank_jax.nn.rotary import inv_frequencies

    for rope in ({"rope_type": "linear", "rope_theta": 77.0, "factor": 3.0}, LLAMA3):
        hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                      rope_parameters=dict(rope))
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
        got = inv_frequencies(RopeConfig.from_hf(hf.to_dict()), 32)
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-6)


def test_mistral_refuses_sequences_longer_than_the_window():
    cfg = LlamaConfig(model_type="mistral", vocab_size=11, hidden_size=8, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      sliding_window=4)
    import jax

    params = llama.init(jax.random.PRNGKey(0), cfg)
    apply(params, {"input_ids": jnp.zeros((1, 4), jnp.int32)}, cfg)
    with pytest.raises(DataError, match="exceed the model's sliding_window=4"):
        apply(params, {"input_ids": jnp.zeros((1, 5), jnp.int32)}, cfg)
    with pytest.raises(DataError, match="sliding_window"):
        llama.init_cache(params, cfg, batch=1, max_len=6)


def test_bad_configs_are_refused():
    with pytest.raises(ConfigError, match="num_key_value_heads=3 must divide"):
        LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="qwen2 model has q, k, v biases"):
        LlamaConfig(model_type="qwen2", hidden_size=16, num_attention_heads=4,
                    num_key_value_heads=4)
