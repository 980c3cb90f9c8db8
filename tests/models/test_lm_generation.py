"""Cached generation of the decoder-only families: greedy decoding against Hugging Face
``generate``, the sampling rules against a NumPy reference, stop tokens, compressed leaves."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.compress import Plan, Step, apply_plan  # noqa: E402
from lowrank_jax.compress.prune import register_batches  # noqa: E402
from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.errors import DataError  # noqa: E402
from lowrank_jax.models import (  # noqa: E402
    GPT2Config,
    LlamaConfig,
    Sampling,
    apply,
    generate,
    gpt2,
    llama,
)
from lowrank_jax.models.causal import positions_from_mask  # noqa: E402
from lowrank_jax.models.generation import sample_logits  # noqa: E402

BOUND = 1e-4  # the parity bound of the logits


def _prompts(vocab):
    rng = np.random.default_rng(3)
    ids = rng.integers(3, vocab, (3, 8))
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    ids[mask == 0] = 0
    return ids, mask


def _hf(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=67, n_positions=80, n_embd=24, n_layer=2,
                                      n_head=3)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=24, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate(kind, tmp_path):
    model = _hf(kind)
    model.save_pretrained(tmp_path)
    cfg, params = load_pretrained(tmp_path)
    ids, mask = _prompts(model.config.vocab_size)
    tokens = generate(params, cfg, ids, mask, max_new_tokens=64)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             max_new_tokens=64, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_scores=True,
                             return_dict_in_generate=True)
    ref = out.sequences[:, ids.shape[1]:].numpy()
    scores = torch.stack(out.scores, 1).numpy()  # [batch, 64, vocab]
    compared = 0
    for b in range(ids.shape[0]):
        for t in range(64):
            top2 = np.sort(scores[b, t])[-2:]
            if tokens[b, t] != ref[b, t]:
                # only a near-tie may differ; the sequences part there
                assert top2[1] - top2[0] <= 2 * BOUND, (b, t, top2)
                break
            compared += 1
    assert compared >= 0.9 * tokens.size


def test_sampling_rules_match_a_numpy_reference():
    logits = np.array([[2.0, 1.5, 1.0, 0.2, -1.0, 0.9]], np.float32)
    n = 4000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draw = jax.jit(jax.vmap(lambda k, t, kk, p: sample_logits(logits, k, t, kk, p)[0],
                            in_axes=(0, None, None, None)))

    def reference(t, k, p):
        z = logits[0] / t
        order = np.argsort(-z)
        allowed = np.zeros(z.size, bool)
        allowed[order[:k] if k else order] = True
        probs = np.exp(z - z.max()) * allowed
        probs /= probs.sum()
        sorted_p = probs[order]
        before = np.cumsum(sorted_p) - sorted_p
        nucleus = np.zeros(z.size, bool)
        nucleus[order[before < p]] = True
        probs = probs * nucleus
        return probs / probs.sum()

    for t, k, p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (1.0, 4, 0.8)):
        got = np.asarray(draw(keys, np.float32(t), np.int32(k), np.float32(p)))
        freq = np.bincount(got, minlength=logits.shape[1]) / n
        want = reference(t, k, p)
        assert np.all(freq[want == 0] == 0), (t, k, p, freq, want)
        np.testing.assert_allclose(freq, want, atol=0.03)
    # temperature 0 is the argmax whatever the other settings
    assert int(sample_logits(logits, keys[0], 0.0, 2, 0.5)[0]) == 0


def test_sampling_settings_share_one_compilation_and_stop_tokens_end_rows(count_compiles):
    cfg = LlamaConfig(vocab_size=23, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    params = llama.init(jax.random.PRNGKey(1), cfg)
    ids, mask = np.array([[0, 5, 6], [7, 8, 9]]), np.array([[0, 1, 1], [1, 1, 1]])
    greedy = generate(params, cfg, ids, mask, max_new_tokens=6)
    from lowrank_jax.models.generation import _generate

    with count_compiles(_generate) as compiled:
        top1 = generate(params, cfg, ids, mask, max_new_tokens=6,
                        sampling=Sampling(temperature=1.0, top_k=1), seed=5)
        nucleus = generate(params, cfg, ids, mask, max_new_tokens=6,
                           sampling=Sampling(temperature=0.9, top_p=1e-6), seed=6)
    assert compiled.count == 0  # traced settings: no new compilation
    np.testing.assert_array_equal(top1, greedy)
    np.testing.assert_array_equal(nucleus, greedy)
    a = generate(params, cfg, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=2.0),
                 seed=1)
    b = generate(params, cfg, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=2.0),
                 seed=1)
    np.testing.assert_array_equal(a, b)
    stop = int(greedy[0, 2])
    stopped = generate(params, cfg, ids, mask, max_new_tokens=6, stop_tokens=[stop],
                       pad_token_id=22)
    for row, full in zip(stopped, greedy, strict=True):
        hits = np.nonzero(full == stop)[0]
        if hits.size:
            end = hits[0] + 1
            np.testing.assert_array_equal(row[:end], full[:end])
            assert np.all(row[end:] == 22)
        else:
            np.testing.assert_array_equal(row, full)
    with pytest.raises(DataError, match="left-padded"):
        generate(params, cfg, ids, np.array([[1, 1, 0], [1, 1, 1]]), max_new_tokens=2)


def _forward_scores(params, cfg, ids, mask, tokens):
    """The logits each generated token was chosen from, by the uncached forward."""
    seq = np.concatenate([ids, tokens], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
    logits = apply(params, {"input_ids": seq, "attention_mask": full_mask,
                            "position_ids": positions_from_mask(full_mask)}, cfg)["logits"]
    return np.asarray(logits)[:, ids.shape[1] - 1:-1]


def _random_tokens(config, *, batch_size, seed):
    def batches(j):
        rng = np.random.default_rng([seed, j])
        return {"input_ids": rng.integers(0, config.vocab_size, (batch_size, 6))}

    return batches


register_batches("lm_random_tokens", _random_tokens)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_leaf_type_decodes_as_it_runs_forward(kind):
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=29, n_positions=32, n_embd=16, n_layer=2, n_head=2)
        params = gpt2.init(jax.random.PRNGKey(0), cfg)
    else:
        cfg = LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=24,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        params = llama.init(jax.random.PRNGKey(0), cfg)
    plan = Plan((Step("svd", [r"layers/0/attn/(qk/q|qk/k|v|o)$"], {"rank": 3}),
                 Step("binarize", [r"layers/1/mlp/(wi|wi_0)$"], {"keep": 0.5}),
                 Step("partition", [r"layers/1/mlp/wo$"], {"machines": 2, "rank": 3}),
                 Step("prune", [r"layers/0/mlp/(wi|wi_0|wi_1)$"],
                      {"target": 0.25, "steps": 2, "batch_size": 2, "data": "lm_random_tokens"})))
    small, _ = apply_plan(params, plan, config=cfg, key=jax.random.PRNGKey(2))
    ids, mask = np.array([[0, 0, 4, 5], [6, 7, 8, 9]]), np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    tokens, scores = generate(small, cfg, ids, mask, max_new_tokens=5, return_scores=True)
    want = _forward_scores(small, cfg, ids, mask, tokens)
    np.testing.assert_allclose(scores, want, atol=1e-4, rtol=0)
