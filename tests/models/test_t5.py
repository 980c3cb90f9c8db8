"""T5 parity with Hugging Face ``T5ForConditionalGeneration`` (float32, random small configs)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.leaves import LowRank, get_path, materialize, replace_paths  # noqa: E402
from lowrank_jax.models import apply as models_apply  # noqa: E402
from lowrank_jax.models import t5  # noqa: E402

torch.set_num_threads(1)

# v1.0: relu, tied head (decoder output scaled); v1.1: gated-gelu, untied head, d_kv*h != d.
CONFIGS = {
    "v1_0_relu_tied": dict(vocab_size=120, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                           num_heads=4, feed_forward_proj="relu", tie_word_embeddings=True,
                           relative_attention_num_buckets=8,
                           relative_attention_max_distance=20),
    "v1_1_gated_untied": dict(vocab_size=150, d_model=48, d_kv=16, d_ff=96, num_layers=2,
                              num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                              tie_word_embeddings=False, relative_attention_num_buckets=32,
                              relative_attention_max_distance=128),
}


def make_hf(name, seed=0):
    """A random HF model; the v1.1 one gets a separate lm_head (transformers 5 always ties)."""
    torch.manual_seed(seed)
    kw = CONFIGS[name]
    hf_cfg = transformers.T5Config(decoder_start_token_id=0, dropout_rate=0.0, **kw)
    model = transformers.T5ForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():  # HF's init gives tiny outputs; make them O(1)
            if "layer_norm" in n:
                p.normal_(1.0, 0.1)
            elif n == "shared.weight":
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:  # Linear [out, in]: unit-variance outputs, well conditioned
                p.normal_(0.0, p.shape[1] ** -0.5)
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1)
    if not kw["tie_word_embeddings"]:
        model.lm_head.weight = torch.nn.Parameter(
            torch.randn(kw["vocab_size"], kw["d_model"]) * kw["d_model"] ** -0.5)
    return model


def random_inputs(vocab, batch=3, s=11, t=7, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (batch, s))
    mask = np.ones((batch, s), np.int64)
    mask[1, 8:] = 0  # padding
    mask[2, 4:] = 0
    dec = rng.integers(2, vocab, (batch, t))
    dec[:, 0] = 0
    dmask = np.ones((batch, t), np.int64)
    dmask[2, 5:] = 0
    return ids, mask, dec, dmask


def hf_forward(model, ids, mask, dec, dmask=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    decoder_input_ids=torch.tensor(dec),
                    decoder_attention_mask=None if dmask is None else torch.tensor(dmask))
    return {k: out[k].numpy() for k in ("logits", "encoder_last_hidden_state")}


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def converted(request):
    model = make_hf(request.param)
    cfg, params = load_pretrained(model)
    return request.param, model, cfg, params


@pytest.fixture(scope="module")
def forward(converted):
    """``models.apply`` under one jit per config (eager op-by-op dispatch is slow on CPU)."""
    _, _, cfg, _ = converted
    return jax.jit(lambda p, **kw: models_apply(p, kw, cfg))


def test_config_from_module(converted):
    name, model, cfg, params = converted
    kw = CONFIGS[name]
    assert isinstance(cfg, t5.T5Config)
    assert cfg.tie_word_embeddings == kw["tie_word_embeddings"]
    assert cfg.scales_decoder_outputs == kw["tie_word_embeddings"]
    assert ("lm_head" in params) == (not kw["tie_word_embeddings"])
    assert cfg.decoder_layers == kw.get("num_decoder_layers", kw["num_layers"])


@pytest.mark.parametrize("with_decoder_mask", [False, True])
def test_forward_parity(converted, forward, with_decoder_mask):
    name, model, cfg, params = converted
    ids, mask, dec, dmask = random_inputs(cfg.vocab_size)
    dmask = dmask if with_decoder_mask else None
    ref = hf_forward(model, ids, mask, dec, dmask)
    out = forward(params, input_ids=jnp.asarray(ids),
                         attention_mask=jnp.asarray(mask), decoder_input_ids=jnp.asarray(dec),
                         decoder_attention_mask=None if dmask is None else jnp.asarray(dmask))
    assert set(out) == {"last_hidden_state", "encoder_last_hidden_state", "logits"}
    assert out["logits"].shape == ref["logits"].shape
    # Sanity: the values are O(1), so 1e-4 absolute is a real test.
    assert np.abs(ref["logits"]).max() > 1.0
    assert max_err(out["encoder_last_hidden_state"], ref["encoder_last_hidden_state"]) < 1e-4
    assert max_err(out["logits"], ref["logits"]) < 1e-4


def test_decoder_hidden_and_encode(converted):
    name, model, cfg, params = converted
    ids, mask, dec, _ = random_inputs(cfg.vocab_size, seed=3)
    with torch.no_grad():
        enc_ref = model.encoder(input_ids=torch.tensor(ids),
                                attention_mask=torch.tensor(mask)).last_hidden_state
        dec_ref = model.decoder(input_ids=torch.tensor(dec), encoder_hidden_states=enc_ref,
                                encoder_attention_mask=torch.tensor(mask)).last_hidden_state
    enc = jax.jit(t5.encode, static_argnums=2)(params, jnp.asarray(ids), cfg,
                                               attention_mask=jnp.asarray(mask))
    assert max_err(enc, enc_ref.numpy()) < 1e-4
    out = jax.jit(t5.apply, static_argnums=2)(
        params, {"encoder_outputs": enc, "attention_mask": jnp.asarray(mask),
                 "decoder_input_ids": jnp.asarray(dec)}, cfg)
    assert max_err(out["last_hidden_state"], dec_ref.numpy()) < 1e-4


def test_labels_shift_and_loss(converted, forward):
    name, model, cfg, params = converted
    ids, mask, dec, _ = random_inputs(cfg.vocab_size, seed=4)
    labels = dec.copy()
    labels[0, -2:] = -100
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    labels=torch.tensor(labels))
    out = forward(params, input_ids=jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                  labels=jnp.asarray(labels))
    assert max_err(out["logits"], ref.logits.numpy()) < 1e-4
    assert abs(float(out["loss"]) - float(ref.loss)) < 1e-4


def test_jit_matches_eager(converted, forward):
    _, _, cfg, params = converted
    ids, mask, dec, _ = random_inputs(cfg.vocab_size, seed=5)
    jitted = forward(params, input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    eager = t5.apply(params, {"input_ids": ids, "attention_mask": mask,
                              "decoder_input_ids": dec}, cfg)
    assert max_err(jitted["logits"], eager["logits"]) < 1e-5


def test_lowrank_leaf_runs_in_place_of_dense(converted, forward):
    """A full-rank LowRank factorization of one projection gives the same logits."""
    _, _, cfg, params = converted
    ids, mask, dec, _ = random_inputs(cfg.vocab_size, seed=6)
    path = "decoder/layers/0/cross_attn/qk/q"
    w = np.asarray(materialize(get_path(params, path)))
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    p2 = replace_paths(params, {path: LowRank(u=jnp.asarray(u * s), v=jnp.asarray(vt))})
    a = forward(params, input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    b = forward(p2, input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    assert max_err(a["logits"], b["logits"]) < 1e-4
    assert type(get_path(p2, path)).__name__ == "LowRank"


def hf_greedy(model, ids, mask, steps, **kw):
    # use_cache=False: transformers 5 sizes its decoder cache by num_layers, so a model with
    # num_decoder_layers != num_layers (the v1.1 config) fails in its cached generate.
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             max_new_tokens=steps, do_sample=False, num_beams=1,
                             use_cache=False, **kw)
    return out.numpy()[:, 1:]  # HF's output starts with the decoder start token


def test_greedy_generate_matches_hf(converted):
    """Cached greedy decoding equals HF ``generate`` token for token, including a sequence
    that stops at its EOS (then emits pad tokens) while the others go on."""
    _, model, cfg, params = converted
    ids, mask, _, _ = random_inputs(cfg.vocab_size, seed=7)
    steps = 9
    ours = np.asarray(t5.generate(params, ids, cfg, attention_mask=mask, max_new_tokens=steps))
    ref = hf_greedy(model, ids, mask, steps)
    assert ref.shape == (3, steps) and ours.shape == (3, steps)
    np.testing.assert_array_equal(ours, ref)
    # Make a token that one sequence emits (first at step t) and no other sequence emits the
    # EOS: that sequence stops there and pads, the others go on unchanged.
    i, t = next((i, t) for t in [*range(1, steps - 1), 0] for i in range(3)
                if ours[i, t] not in ours[i, :t] and ours[i, t] != cfg.pad_token_id
                and ours[i, t] not in np.delete(ours, i, axis=0))
    eos = int(ours[i, t])
    first = ours
    ours = np.asarray(t5.generate(params, ids, dataclasses.replace(cfg, eos_token_id=eos),
                                  attention_mask=mask, max_new_tokens=steps))
    ref = hf_greedy(model, ids, mask, steps, eos_token_id=eos)
    np.testing.assert_array_equal(ours[:, :ref.shape[1]], ref)
    assert np.all(ours[i, t + 1:] == cfg.pad_token_id) and ours[i, t] == eos
    np.testing.assert_array_equal(ours[i, :t + 1], first[i, :t + 1])
    np.testing.assert_array_equal(np.delete(ours, i, axis=0), np.delete(first, i, axis=0))


def test_generate_cached_equals_uncached_when_sampling(converted):
    _, _, cfg, params = converted
    ids, mask, _, _ = random_inputs(cfg.vocab_size, seed=8)
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=True, top_k=20, top_p=0.9,
              temperature=0.8, key=jax.random.PRNGKey(5), min_new_tokens=7)
    a = np.asarray(t5.generate(params, ids, cfg, **kw))
    b = np.asarray(t5.generate(params, ids, cfg, use_cache=False, **kw))
    np.testing.assert_array_equal(a, b)
    assert not np.any(a == cfg.eos_token_id)  # min_new_tokens suppresses EOS
    with pytest.raises(ValueError, match="PRNG key"):
        t5.generate(params, ids, cfg, do_sample=True)
    with pytest.raises(ValueError, match="max_new_tokens"):
        t5.generate(params, ids, cfg, max_new_tokens=0)
    with pytest.raises(ValueError, match="vocab_size"):
        t5.generate(params, ids + cfg.vocab_size, cfg)


def test_kth_largest_equals_sorting():
    """The bitwise k-th largest against NumPy's sort: ties, infinities, signed zeros,
    subnormal and huge magnitudes, every k from 1 to n on a small row."""
    rng = np.random.default_rng(0)
    kth = jax.jit(t5.kth_largest)  # k traced: one compile per row length
    for trial in range(30):
        n = int(rng.integers(1, 200))
        x = (rng.standard_normal((4, n)) * 10.0 ** rng.uniform(-42, 35)).astype(np.float32)
        x[0, : n // 3] = x[0, -1]  # ties
        x[1, ::3] = -np.inf
        x[2, ::5] = np.inf
        x[3, ::2] = -0.0
        k = int(rng.integers(1, n + 1))
        np.testing.assert_array_equal(np.asarray(kth(jnp.asarray(x), k)),
                                      np.sort(x, axis=-1)[:, -k], err_msg=f"trial {trial}")
    x = jnp.asarray(rng.standard_normal((2, 7)).astype(np.float32))
    got = np.stack([np.asarray(kth(x, k)) for k in range(1, 8)], axis=-1)
    np.testing.assert_array_equal(got, -np.sort(-np.asarray(x), axis=-1))


def test_init_tree_matches_converted_structure(converted):
    _, _, cfg, params = converted
    fresh = jax.eval_shape(lambda k: t5.init(k, cfg), jax.random.PRNGKey(0))
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(fresh), jax.tree_util.tree_leaves(params),
                    strict=True):
        assert a.shape == b.shape


def test_config_rules():
    base = t5.T5Config(vocab_size=10, d_model=8, d_kv=2, d_ff=16, num_layers=1, num_heads=2)
    assert base.scales_decoder_outputs and base.decoder_layers == 1
    assert not dataclasses.replace(base, tie_word_embeddings=False).scales_decoder_outputs
    # transformers >= 5 writes tie_word_embeddings=true and scale_decoder_outputs separately.
    c = t5.T5Config.from_hf_dict({**base.to_hf_dict(), "scale_decoder_outputs": False})
    assert c.tie_word_embeddings and not c.scales_decoder_outputs
    with pytest.raises(ValueError, match="feed_forward_proj"):
        t5.T5Config(feed_forward_proj="gated-swish")
    with pytest.raises(ValueError, match="decoder_input_ids or labels"):
        t5.apply({}, {"input_ids": jnp.zeros((1, 3), int)}, base)
