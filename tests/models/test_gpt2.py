"""GPT-2 family against the PyTorch original: logits, the fused c_attn / Conv1D converter both
ways, cached decoding."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.convert import load_pretrained, save_pretrained  # noqa: E402
from lowrank_jax.errors import DataError  # noqa: E402
from lowrank_jax.models import GPT2Config, apply, gpt2  # noqa: E402
from lowrank_jax.models.causal import key_mask_for_cache, positions_from_mask  # noqa: E402


def _hf_model(lm, tied=True, n_inner=None, act="gelu_new", heads=3):
    """A random GPT-2 with varied biases and norms (``lm``: tests/lm_builders.py)."""
    return lm.hf_lm("gpt2", seed=0, vary=True, vocab_size=57, n_positions=24, n_embd=heads * 7,
                    n_layer=2, n_head=heads, n_inner=n_inner, activation_function=act,
                    tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)


def _inputs(vocab, batch=3, seq=10):
    rng = np.random.default_rng(2)
    ids = rng.integers(0, vocab, (batch, seq))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("tied,n_inner,act,heads", [(True, None, "gelu_new", 3),
                                                    (False, 29, "gelu", 1)])
def test_logits_and_round_trip_match_transformers(tied, n_inner, act, heads, tmp_path, lm):
    model = _hf_model(lm, tied, n_inner, act, heads)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_pretrained(tmp_path / "hf")
    assert cfg.tie_word_embeddings == tied and ("lm_head" in params) == (not tied)
    # c_attn was split into q, k, v leaves in the x @ W layout (Conv1D is [in, out] already)
    w = model.transformer.h[0].attn.c_attn.weight.detach().numpy()
    d = cfg.n_embd
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["attn"]["v"].to_dense()),
                                  w[:, 2 * d:])
    ids, mask = _inputs(cfg.vocab_size)
    pos = np.asarray(positions_from_mask(mask))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos)).logits.numpy()
    out = np.asarray(apply(params, {"input_ids": ids, "attention_mask": mask,
                                    "position_ids": pos}, cfg)["logits"])
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=1e-4, rtol=0)

    summary = save_pretrained(cfg, params, tmp_path / "out")
    assert summary["config_changed"] == []
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ref_state, back_state = model.state_dict(), back.state_dict()
    assert set(ref_state) == set(back_state)
    for k, v in ref_state.items():
        assert torch.equal(v, back_state[k]), k
    for name in ("config.json", "generation_config.json"):
        assert (json.loads((tmp_path / "hf" / name).read_text())
                == json.loads((tmp_path / "out" / name).read_text())), name


def test_cached_decoding_equals_the_forward():
    cfg = GPT2Config(vocab_size=31, n_positions=16, n_embd=12, n_layer=2, n_head=3)
    params = gpt2.init(jax.random.PRNGKey(0), cfg)
    ids, mask = _inputs(cfg.vocab_size, seq=8)
    pos = positions_from_mask(mask)
    full = np.asarray(apply(params, {"input_ids": ids, "attention_mask": mask,
                                     "position_ids": pos}, cfg)["logits"])
    cache = gpt2.init_cache(params, cfg, batch=3, max_len=10)
    km = key_mask_for_cache(np.concatenate([mask, np.ones((3, 2), mask.dtype)], 1), 10)
    parts = []
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        logits, cache = gpt2.apply_cached(params, ids[:, lo:hi], cfg, cache,
                                          positions=pos[:, lo:hi], key_mask=km)
        parts.append(np.asarray(logits))
    got = np.concatenate(parts, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], full[real], atol=1e-5, rtol=0)


def test_longer_than_n_positions_is_refused():
    cfg = GPT2Config(vocab_size=11, n_positions=4, n_embd=4, n_layer=1, n_head=1)
    params = gpt2.init(jax.random.PRNGKey(0), cfg)
    with pytest.raises(DataError, match="exceeds the model's limit 4"):
        apply(params, {"input_ids": np.zeros((1, 5), np.int32)}, cfg)
