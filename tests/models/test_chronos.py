"""Chronos parity with chronos-forecasting's ``ChronosPipeline`` on a small random T5."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
chronos_ref = pytest.importorskip("chronos")

from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.models import apply as models_apply  # noqa: E402
from lowrank_jax.models import chronos  # noqa: E402

torch.set_num_threads(1)

CHRONOS_CONFIG = dict(
    tokenizer_class="MeanScaleUniformBins",
    tokenizer_kwargs={"low_limit": -15.0, "high_limit": 15.0},
    context_length=24, prediction_length=5, n_tokens=120, n_special_tokens=2, pad_token_id=0,
    eos_token_id=1, use_eos_token=True, model_type="seq2seq", num_samples=4, temperature=1.0,
    top_k=50, top_p=1.0,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    hf_cfg = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0, chronos_config=CHRONOS_CONFIG)
    model = transformers.T5ForConditionalGeneration(hf_cfg)
    with torch.no_grad():  # well-conditioned O(1) signal (HF's init is nearly uniform)
        for n, p in model.named_parameters():
            if "layer_norm" in n:
                p.normal_(1.0, 0.1)
            elif n == "shared.weight" or "relative_attention_bias" in n:
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    path = tmp_path_factory.mktemp("chronos")
    model.save_pretrained(path)
    pipeline = chronos_ref.ChronosPipeline.from_pretrained(path)
    pipeline.model.eval()
    cfg, params = load_pretrained(path)
    return pipeline, cfg, params


def contexts(seed=0, batch=4, length=30):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(batch, length)) * rng.uniform(0.1, 50, (batch, 1))
         + rng.normal(size=(batch, 1)) * 10).astype(np.float32)
    x[0, :9] = np.nan  # left padding
    x[1, [12, 20]] = np.nan  # missing values
    x[2, :] = np.nan  # nothing observed: scale 1
    x[3, -25:] = 0.0  # zeros: scale not > 0 -> 1
    return x


def test_config_loaded(setup):
    _, cfg, params = setup
    assert isinstance(cfg, chronos.ChronosConfig)
    assert (cfg.n_tokens, cfg.context_length, cfg.prediction_length) == (120, 24, 5)
    assert cfg.t5.feed_forward_proj == "gated-gelu" and "lm_head" not in params


def test_bins_bitwise(setup):
    pipeline, cfg, _ = setup
    tok = pipeline.tokenizer
    np.testing.assert_array_equal(chronos.bin_centers(cfg), tok.centers.numpy())
    np.testing.assert_array_equal(chronos.bin_boundaries(cfg), tok.boundaries.numpy())


@pytest.mark.parametrize("seed", [0, 1])
def test_tokenizer_parity(setup, seed):
    pipeline, cfg, _ = setup
    x = contexts(seed)
    ref_ids, ref_mask, ref_scale = pipeline.tokenizer.context_input_transform(torch.tensor(x))
    ids, mask, scale = jax.jit(chronos.context_input_transform, static_argnums=0)(cfg, x)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids.numpy())
    np.testing.assert_array_equal(np.asarray(mask), ref_mask.numpy())
    np.testing.assert_allclose(np.asarray(scale), ref_scale.numpy(), rtol=1e-6)
    assert ids.shape == (4, cfg.context_length + 1)  # truncated, plus EOS

    label = np.random.default_rng(seed + 7).normal(size=(4, cfg.prediction_length)) * 20
    label[0, 2] = np.nan
    ref_l, ref_lm = pipeline.tokenizer.label_input_transform(torch.tensor(label), ref_scale)
    l_ids, l_mask = chronos.label_input_transform(cfg, label, scale)
    np.testing.assert_array_equal(np.asarray(l_ids), ref_l.numpy())
    np.testing.assert_array_equal(np.asarray(l_mask), ref_lm.numpy())

    samples = np.random.default_rng(seed).integers(0, cfg.n_tokens, (4, 3, 6))
    ref_out = pipeline.tokenizer.output_transform(torch.tensor(samples), ref_scale)
    out = chronos.output_transform(cfg, samples, scale)
    np.testing.assert_allclose(np.asarray(out), ref_out.numpy(), rtol=2e-6)


def test_forward_logits_parity(setup):
    pipeline, cfg, params = setup
    ids, mask, _ = pipeline.tokenizer.context_input_transform(torch.tensor(contexts(3)))
    dec = torch.tensor(np.random.default_rng(0).integers(2, cfg.n_tokens, (4, 6)))
    dec[:, 0] = 0
    with torch.no_grad():
        ref = pipeline.model.model(input_ids=ids, attention_mask=mask.long(),
                                   decoder_input_ids=dec)
    out = jax.jit(models_apply, static_argnums=2)(params, {"input_ids": jnp.asarray(ids.numpy()),
                                "attention_mask": jnp.asarray(mask.numpy()),
                                "decoder_input_ids": jnp.asarray(dec.numpy())}, cfg)
    assert np.abs(ref.logits.numpy()).max() > 1.0
    err = np.abs(np.asarray(out["logits"]) - ref.logits.numpy()).max()
    assert err < 1e-4
    enc = np.abs(np.asarray(out["encoder_last_hidden_state"])
                 - ref.encoder_last_hidden_state.numpy()).max()
    assert enc < 1e-4


@pytest.mark.parametrize("horizon", [5, 8])  # 8 > prediction_length: two rounds with median
def test_greedy_predict_matches_pipeline(setup, horizon):
    """top_k=1 makes sampling deterministic, so HF ``generate`` and ours must agree exactly."""
    pipeline, cfg, params = setup
    x = contexts(5)[:2]
    torch.manual_seed(0)
    ref = pipeline.predict(torch.tensor(x), prediction_length=horizon, num_samples=2, top_k=1)
    ours = chronos.predict(params, x, cfg, horizon, 2, jax.random.PRNGKey(0), top_k=1)
    assert ours.shape == (2, 2, horizon)
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)


def test_sampling_deterministic_per_key_and_in_support(setup):
    _, cfg, params = setup
    x = contexts(6)[:2]
    key = jax.random.PRNGKey(42)
    a = chronos.predict(params, x, cfg, None, 16, key)
    b = chronos.predict(params, x, cfg, None, 16, key)
    c = chronos.predict(params, x, cfg, None, 16, jax.random.PRNGKey(43))
    assert a.shape == (2, 16, cfg.prediction_length)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    # Every value is a bin center times the series' scale.
    _, _, scale = chronos.context_input_transform(cfg, x)
    centers = chronos.bin_centers(cfg)
    for i in range(2):
        v = np.asarray(a[i]).ravel() / float(scale[i])
        assert np.min(np.abs(v[:, None] - centers[None, :]), axis=1).max() < 1e-4


def test_cached_sampling_equals_uncached(setup):
    """The key-value cache changes the work, not the samples: the same key draws the same
    tokens as re-running the decoder on the whole prefix at every step."""
    _, cfg, params = setup
    ids, mask, _ = chronos.context_input_transform(cfg, contexts(7)[:2])
    kw = dict(horizon=9, num_samples=6, temperature=2.0, top_k=50, top_p=1.0)
    key = jax.random.PRNGKey(3)
    cached = chronos.sample_tokens(params, ids, mask, cfg, key, **kw)
    uncached = chronos.sample_tokens(params, ids, mask, cfg, key, use_cache=False, **kw)
    assert cached.shape == (2, 6, 9)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))
    # Real sampling: many tokens and distinct paths per series.
    assert len(np.unique(np.asarray(cached))) > 5
    assert len({tuple(p) for p in np.asarray(cached)[0]}) > 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 1, 1.0), (0.7, 5, 1.0),
                                                     (1.3, 0, 0.8), (0.9, 20, 0.5)])
def test_process_logits_matches_hf_warpers(temperature, top_k, top_p):
    from transformers.generation import logits_process as lp

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 3
    procs = [lp.MinNewTokensLengthLogitsProcessor(1, 5, eos_token_id=1)]
    if temperature != 1.0:
        procs.append(lp.TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(top_p))
    ids = torch.zeros((6, 1), dtype=torch.long)
    ref = torch.tensor(logits)
    for p in procs:
        ref = p(ids, ref)
    ours = np.asarray(chronos.process_logits(jnp.asarray(logits), eos_token_id=1,
                                             temperature=temperature, top_k=top_k, top_p=top_p))
    ref = ref.numpy()
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(ours[fin], ref[fin], rtol=1e-6)


def test_config_validation():
    t5cfg = chronos.T5Config(vocab_size=50, d_model=8, d_kv=2, d_ff=8, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="n_tokens"):
        chronos.ChronosConfig(t5=t5cfg, n_tokens=100)
    with pytest.raises(ValueError, match="n_special_tokens"):
        chronos.ChronosConfig(t5=t5cfg, n_tokens=50, eos_token_id=5)
    d = {**t5cfg.to_hf_dict(), "chronos_config": {**CHRONOS_CONFIG, "model_type": "causal"}}
    with pytest.raises(ValueError, match="seq2seq"):
        chronos.ChronosConfig.from_hf_dict(d)
    good = chronos.ChronosConfig(t5=t5cfg, n_tokens=50)
    d = {**t5cfg.to_hf_dict(), "chronos_config": good.to_hf_chronos_dict()}
    loaded = chronos.ChronosConfig.from_hf_dict(d)
    assert dataclasses.replace(loaded, t5=good.t5) == good
    assert loaded.t5.to_hf_dict() == good.t5.to_hf_dict()
    assert dataclasses.replace(good, top_k=3).top_k == 3
