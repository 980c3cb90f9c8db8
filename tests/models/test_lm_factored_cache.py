"""The factored key-value cache: the same decoding as the full cache, smaller by what its
shapes say."""

import jax
import numpy as np
import pytest

from lowrank_jax.compress import Step, apply_plan
from lowrank_jax.errors import ShapeError
from lowrank_jax.models import GPT2Config, LlamaConfig, generate, gpt2, llama
from lowrank_jax.nn.attention.factored_cache import cache_bytes_per_token


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_factored_cache_decodes_as_the_full_cache(kind):
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=31, n_positions=24, n_embd=16, n_layer=2, n_head=2)
        mod = gpt2
    else:
        cfg = LlamaConfig(vocab_size=31, hidden_size=16, intermediate_size=24,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          qkv_bias=True, o_bias=True)
        mod = llama
    params = mod.init(jax.random.PRNGKey(0), cfg)
    # layer 0 low-rank keys and values (rank 3), layer 1 left dense
    small, _ = apply_plan(params, Step("svd", [r"layers/0/attn/(qk/k|v)$"], {"rank": 3}))
    ids, mask = np.array([[0, 3, 4, 5], [6, 7, 8, 9]]), np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    full_tokens, full_scores = generate(small, cfg, ids, mask, max_new_tokens=6,
                                        return_scores=True)
    tokens, scores = generate(small, cfg, ids, mask, max_new_tokens=6, return_scores=True,
                              factored_cache=True)
    np.testing.assert_allclose(scores, full_scores, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(tokens, full_tokens)

    full = mod.init_cache(small, cfg, batch=2, max_len=10)
    fact = mod.init_cache(small, cfg, batch=2, max_len=10, factored=True)
    f32 = 4
    if kind == "gpt2":  # keys and values folded: rank 3 each instead of 2 heads x 8
        assert set(fact["layers"][0]) == {"ku", "vu"}
        assert cache_bytes_per_token(fact["layers"][0], 10) == 2 * 3 * f32
        assert cache_bytes_per_token(full["layers"][0], 10) == 2 * 16 * f32
    else:  # rotary keys stay full (2 kv heads x 4); values rank 3 instead of 2 x 4
        assert set(fact["layers"][0]) == {"k", "vu"}
        assert cache_bytes_per_token(fact["layers"][0], 10) == (8 + 3) * f32
        assert cache_bytes_per_token(full["layers"][0], 10) == 2 * 8 * f32
    assert set(fact["layers"][1]) == {"k", "v"}  # dense layer: the full cache
    with pytest.raises(ShapeError, match="no axis of 11 positions"):
        cache_bytes_per_token(full["layers"][0], 11)


def test_unequal_query_groups_decode_as_the_dense_block_with_those_heads_zeroed():
    """Query heads removed unequally per key-value head (2 and 1 left) take the per-head gather
    of the grouped attention, full and factored cache alike. Reference: the unpruned model
    whose removed heads' output rows are zero, run uncached (its groups are regular)."""
    from lowrank_jax.leaves import Dense
    from lowrank_jax.models import apply
    from lowrank_jax.models.causal import positions_from_mask
    from lowrank_jax.nn.attention.grouped import keep_query_heads

    cfg = LlamaConfig(vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, o_bias=True)
    params = llama.init(jax.random.PRNGKey(1), cfg)
    params, _ = apply_plan(params, Step("svd", [r"layers/0/attn/v$"], {"rank": 3}))
    keep = [0, 1, 3]  # key-value head 0 keeps both query heads, head 1 one of two
    pruned = {**params, "layers": [dict(lp) for lp in params["layers"]]}
    zeroed = {**params, "layers": [dict(lp) for lp in params["layers"]]}
    for i, lp in enumerate(params["layers"]):
        pruned["layers"][i]["attn"] = keep_query_heads(lp["attn"], keep)
        o = lp["attn"]["o"]
        w = np.array(o.w)
        w[2 * 4:3 * 4] = 0.0  # query head 2's rows of the output projection (head width 4)
        zeroed["layers"][i]["attn"] = {**lp["attn"], "o": Dense(w=w, b=o.b)}
    ids, mask = np.array([[0, 3, 4, 5], [6, 7, 8, 9]]), np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    for factored in (False, True):
        tokens, scores = generate(pruned, cfg, ids, mask, max_new_tokens=5, return_scores=True,
                                  factored_cache=factored)
        seq = np.concatenate([ids, tokens], axis=1)
        full_mask = np.concatenate([mask, np.ones_like(tokens)], axis=1)
        want = apply(zeroed, {"input_ids": seq, "attention_mask": full_mask,
                              "position_ids": positions_from_mask(full_mask)}, cfg)["logits"]
        np.testing.assert_allclose(scores, np.asarray(want)[:, 3:-1], atol=1e-5, rtol=0)
    fact = llama.init_cache(pruned, cfg, batch=2, max_len=9, factored=True)
    assert set(fact["layers"][0]) == {"k", "vu"} and set(fact["layers"][1]) == {"k", "v"}


@pytest.mark.parametrize("factored", [False, True])
def test_decoding_does_not_copy_the_cache_into_another_layout(factored):
    """The cache is stored as the attention products read it (heads before positions): the
    compiled generation (prefill and loop body) has no transpose or copy of a cache-sized array.
    With keys or values stored ``[batch, len, heads, w]``, XLA:CPU copied every layer's cache to
    ``[batch, heads, ...]`` at every step. Dense weights: the factored cache keeps full keys and
    values through its own code path."""
    import re

    import jax.numpy as jnp

    from lowrank_jax.models.generation import _generate  # the compiled program of generate

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    params = gpt2.init(jax.random.PRNGKey(0), cfg)
    batch, prompt, new = 2, 4, 3  # cache [2, 4 heads, 7 positions, 8]: dims all distinct
    cache = gpt2.init_cache(params, cfg, batch=batch, max_len=prompt + new, factored=factored)
    assert {n: a.shape for n, a in cache["layers"][0].items()} == {"k": (2, 4, 7, 8),
                                                                    "v": (2, 4, 7, 8)}
    ids = jnp.ones((batch, prompt), jnp.int32)
    text = _generate.lower(
        params, ids, jnp.ones_like(ids), jax.random.PRNGKey(0), np.float32(0), np.int32(0),
        np.float32(1), jnp.asarray([-1], jnp.int32), cfg=cfg, max_new_tokens=new,
        pad_token_id=0, with_scores=False, factored_cache=factored).compile().as_text()
    assert "f32[2,4,7,8]" in text  # the cache is in the program (the scan below can match)
    moved = [line.strip() for line in text.splitlines()
             if (m := re.search(r"= f32\[([\d,]+)\](?:\{[\d,]*\})? (?:transpose|copy)\(", line))
             and sorted(map(int, m.group(1).split(","))) == [2, 4, 7, 8]]
    assert not moved, "\n".join(moved)
