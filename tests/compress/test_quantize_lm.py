"""The ``quantize`` method on the decoder-only families (a Llama-style model with grouped-query
attention and an untied output projection, a GPT-2 with tied embeddings): round-to-nearest int8
and GPTQ int4 with groups of 128 calibrated on batches of token ids through the model's own
forward. Every integer product against a NumPy dequantize-then-multiply, the model's logits
against the float model rebuilt from the NumPy-dequantized weights, the exported (dequantized)
Hugging Face directory reloaded in transformers, and cached greedy generation against the
uncached forward."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import lowrank_jax as lj  # noqa: E402
from lowrank_jax import leaves as L  # noqa: E402
from lowrank_jax.compress import Step, apply_plan  # noqa: E402
from lowrank_jax.compress.prune import register_batches  # noqa: E402
from lowrank_jax.convert import load_pretrained, save_pretrained  # noqa: E402
from lowrank_jax.errors import PlanError  # noqa: E402
from lowrank_jax.models import apply, generate  # noqa: E402
from lowrank_jax.models.causal import positions_from_mask  # noqa: E402

ATTN = r"attn/(qk/q|qk/k|v|o)$"
MLP = r"mlp/(wi|wi_0|wi_1|wo)$"
CALIBRATION_LEN = 12


def _calibration(config, *, batch_size, seed):
    """Batches of token ids alone (no attention mask: no padding), as a text corpus gives."""
    def batches(j):
        rng = np.random.default_rng([seed, j, 7])
        return {"input_ids": rng.integers(0, config.vocab_size, (batch_size, CALIBRATION_LEN))}

    return batches


register_batches("lm_quantize_test", _calibration)
GPTQ = {"bits": 4, "group": 128, "algorithm": "gptq", "data": "lm_quantize_test", "samples": 6}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, lm):
    """Grouped-query attention (4 query heads over 2 key-value heads), an untied output
    projection, and a down projection of 160 inputs (groups of 128 and 32)."""
    return lm.saved_lm(tmp_path_factory.mktemp("llama_q"), "llama", seed=0, vocab_size=53,
                       hidden_size=32, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, lm):
    """Tied embeddings; an MLP output projection of 192 inputs (groups of 128 and 64)."""
    return lm.saved_lm(tmp_path_factory.mktemp("gpt2_q"), "gpt2", seed=1, vocab_size=53,
                       n_positions=32, n_embd=48, n_layer=2, n_head=4)


def np_dequantize(leaf) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W float64 [d_in, d_out], bias)`` of an Int8 / Int4 leaf from its stored arrays."""
    if isinstance(leaf, L.Int8):
        w = np.asarray(leaf.q, np.float64) * np.asarray(leaf.scale, np.float64)[None]
    else:
        assert isinstance(leaf, L.Int4), type(leaf)
        p = np.asarray(leaf.packed)
        nib = np.empty((2 * p.shape[0], p.shape[1]), np.float64)
        nib[0::2], nib[1::2] = p & 15, p >> 4  # row 2k in the low nibble, 2k + 1 in the high
        rows = np.repeat(np.arange(len(leaf.group_sizes)), leaf.group_sizes)
        zero = 8.0 if leaf.zero is None else np.asarray(leaf.zero, np.float64)[rows]
        w = (nib[:leaf.d_in] - zero) * np.asarray(leaf.scale, np.float64)[rows]
    return w, None if leaf.b is None else np.asarray(leaf.b, np.float64)


def _quantized(params) -> dict:
    return {p: n for p, n in lj.named_leaves(params) if L.is_quantized(n)}


def _check_products_and_logits(cfg, params, quant) -> dict:
    """Products of every integer leaf against NumPy; logits against the float model with the
    NumPy-dequantized weights. Returns ``{path: W float64}``."""
    rng = np.random.default_rng(0)
    deq = {}
    for path, leaf in quant.items():
        w, b = np_dequantize(leaf)
        deq[path] = w
        x = rng.standard_normal((2, 5, w.shape[0])).astype(np.float32)
        ref = x.astype(np.float64) @ w + (0 if b is None else b)
        got = np.asarray(L.linear(leaf, jnp.asarray(x)), np.float64)
        bound = np.abs(x.astype(np.float64)) @ np.abs(w) + 1e-30
        assert np.max(np.abs(got - ref) / bound) < 1e-6, path
    floats = L.replace_paths(params, {
        p: lj.Dense(w=jnp.asarray(deq[p], jnp.float32),
                    b=None if L.bias_of(n) is None else jnp.asarray(L.bias_of(n)))
        for p, n in quant.items()})
    assert not _quantized(floats)
    ids, mask = _prompts(cfg.vocab_size)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask)}
    got = np.asarray(apply(params, inputs, cfg)["logits"])
    want = np.asarray(apply(floats, inputs, cfg)["logits"])
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)
    return deq


def _prompts(vocab):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, vocab, (2, 9))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    ids[mask == 0] = 0
    return ids, mask


def _export_matches(cfg, params, out, cls, quant):
    """Export (dequantized), reload in transformers: logits within 1e-4 of the JAX model's."""
    summary = save_pretrained(cfg, params, out)
    assert sorted(summary["dequantized"]) == sorted(quant)
    model = cls.from_pretrained(out).eval()
    ids, mask = _prompts(cfg.vocab_size)
    pos = np.asarray(positions_from_mask(mask))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos)).logits.numpy()
    got = np.asarray(apply(params, {"input_ids": ids, "attention_mask": mask,
                                    "position_ids": pos}, cfg)["logits"])
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=0)
    return model


def _generation_is_the_forward_argmax(cfg, params):
    """Greedy tokens through the cache: their scores equal the uncached forward's logits, and
    every token is the forward's argmax (up to a near-tie within the logits' bound)."""
    ids, mask = _prompts(cfg.vocab_size)
    tokens, scores = generate(params, cfg, ids, mask, max_new_tokens=6, return_scores=True)
    seq = np.concatenate([ids, tokens], axis=1)
    full = np.concatenate([mask, np.ones_like(tokens)], axis=1)
    logits = np.asarray(apply(params, {"input_ids": seq, "attention_mask": full,
                                       "position_ids": positions_from_mask(full)},
                              cfg)["logits"])[:, ids.shape[1] - 1:-1]
    np.testing.assert_allclose(scores, logits, atol=1e-4, rtol=0)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    ties = top2[..., 1] - top2[..., 0] <= 2e-4
    assert np.all((tokens == logits.argmax(-1)) | ties)
    assert ties.sum() <= 1


def _rows(report) -> dict:
    return {r.path: r for r in report.rows}


def test_llama_rtn_int8_and_gptq_int4_g128(llama_dir, tmp_path):
    cfg, params = load_pretrained(llama_dir)
    assert cfg.num_key_value_heads == 2 and not cfg.tie_word_embeddings
    embed = np.asarray(params["embed"])
    weights = 2 * 7  # q, k, v, o, gate, up, down per layer

    q8, report = apply_plan(params, Step("quantize", [ATTN, MLP], {"bits": 8}), config=cfg)
    quant = _quantized(q8)
    assert len(quant) == weights and all(isinstance(n, L.Int8) for n in quant.values())
    assert "lm_head" not in quant  # not selected: stays float
    deq = _check_products_and_logits(cfg, q8, quant)
    for path, w in deq.items():  # round to nearest: half a step of the channel's scale
        orig = np.asarray(L.materialize(L.get_path(params, path)), np.float64)
        step = np.abs(orig).max(0) / 127
        assert np.all(np.abs(w - orig) <= 0.5 * step * (1 + 1e-5) + 1e-12), path
    _export_matches(cfg, q8, tmp_path / "int8", transformers.LlamaForCausalLM, quant)

    # GPTQ int4 g128, the output projection asked for too (8 bits: a rule override)
    g4, report = apply_plan(params, Step("quantize", [ATTN, MLP, [r"^lm_head$", {"bits": 8}]],
                                         GPTQ), config=cfg)
    quant = _quantized(g4)
    assert len(quant) == weights + 1 and isinstance(quant["lm_head"], L.Int8)
    down = quant["layers/0/mlp/wo"]
    assert isinstance(down, L.Int4) and down.group_sizes == (128, 32)
    np.testing.assert_array_equal(np.asarray(g4["embed"]), embed)  # the input table: float
    deq = _check_products_and_logits(cfg, g4, quant)

    # the calibration inputs were the batch of token ids: layer 0's q sees RMSNorm(embed[ids])
    ids = _calibration(cfg, batch_size=GPTQ["samples"], seed=0)(0)["input_ids"]
    x = embed[ids].astype(np.float64).reshape(-1, cfg.hidden_size)
    x = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    x = x * np.asarray(params["layers"][0]["input_norm"]["scale"], np.float64)
    h = x.T @ x
    rows = _rows(report)
    for path in ("layers/0/attn/qk/q", "layers/0/attn/qk/k", "layers/0/attn/v"):
        w = np.asarray(L.materialize(L.get_path(params, path)), np.float64)
        dw = w - deq[path]
        want = np.sqrt(np.trace(dw.T @ h @ dw) / np.trace(w.T @ h @ w))
        np.testing.assert_allclose(rows[path].details["output_error"], want, rtol=1e-4)
    # GPTQ at the same size beats round to nearest on those inputs
    rtn, _ = apply_plan(params, Step("quantize", [ATTN, MLP], {"bits": 4, "group": 128}),
                        config=cfg)
    w = np.asarray(L.materialize(L.get_path(params, "layers/0/attn/qk/q")), np.float64)

    def h_error(wq):
        return np.trace((w - wq).T @ h @ (w - wq))

    rtn_q = np_dequantize(L.get_path(rtn, "layers/0/attn/qk/q"))[0]
    assert h_error(deq["layers/0/attn/qk/q"]) < h_error(rtn_q)

    _export_matches(cfg, g4, tmp_path / "gptq", transformers.LlamaForCausalLM, quant)
    _generation_is_the_forward_argmax(cfg, g4)


def test_gpt2_tied_embeddings_stay_float(gpt2_dir, tmp_path):
    cfg, params = load_pretrained(gpt2_dir)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    wte = np.asarray(params["wte"])
    g4, report = apply_plan(params, Step("quantize", [ATTN, MLP], GPTQ), config=cfg)
    quant = _quantized(g4)
    assert len(quant) == 2 * 6  # q, k, v, o, wi, wo per layer
    assert quant["layers/1/mlp/wo"].group_sizes == (128, 64)
    assert sorted(r.path for r in report.rows) == sorted(quant)
    # the tied output projection is the embedding table, which stays float32 and bit-exact
    np.testing.assert_array_equal(np.asarray(g4["wte"]), wte)
    assert g4["wte"].dtype == jnp.float32
    _check_products_and_logits(cfg, g4, quant)
    model = _export_matches(cfg, g4, tmp_path / "gptq", transformers.GPT2LMHeadModel, quant)
    assert model.config.tie_word_embeddings
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), wte)
    _generation_is_the_forward_argmax(cfg, g4)

    q8, _ = apply_plan(params, Step("quantize", [ATTN, MLP], {"bits": 8}), config=cfg)
    _check_products_and_logits(cfg, q8, _quantized(q8))
    # the embedding table is no weight leaf a plan can select: asking for it is an error
    with pytest.raises(PlanError, match="wte"):
        apply_plan(params, Step("quantize", [r"^wte$"], {"bits": 8}), config=cfg)


def test_calibration_batch_without_input_ids_is_a_clear_error():
    cfg = lj.models.LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=16,
                                num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1)
    params = lj.models.llama.init(jax.random.PRNGKey(0), cfg)
    register_batches("lm_quantize_test_bad", lambda config, *, batch_size, seed: (
        lambda j: {"tokens": np.zeros((batch_size, 4), np.int32)}))
    with pytest.raises(PlanError, match="input_ids"):
        apply_plan(params, Step("quantize", [ATTN], {**GPTQ, "data": "lm_quantize_test_bad"}),
                   config=cfg)
