"""Pieces shared by the decoder-only language models (GPT-2, Llama-style): input checks, the
causal mask with padding, position ids, the next-token loss and the key-value cache's outer
structure.

The cache of a decoder-only model is a plain pytree with static shapes::

    {'index': int32[],              # buffer slot of the next token (shared by the batch)
     'layers': [{'k', 'v'}, ...]}   # per layer, [batch, heads, max_len, width]

With left-padded prompts every row writes the same buffer slot at each step; a row's padding
slots are hidden by the ``key_mask`` and its tokens get their own positions (``position_ids``
counted over its real tokens, as Hugging Face ``generate`` does), so rows of different lengths
decode together exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import DataError, ShapeError
from lowrank_jax.models.common import check_inputs, check_token_ids

Array = jax.Array

INPUTS = ("input_ids", "attention_mask", "position_ids")


def lm_inputs(inputs, vocab_size: int, owner: str, max_len: int | None = None):
    """``(input_ids, attention_mask or None, position_ids)`` of a forward call, checked.

    Default ``position_ids`` are ``0 .. seq - 1`` for every row (as the Hugging Face forward
    without a cache); pass them to run left-padded rows at their own positions."""
    inputs = check_inputs(inputs, INPUTS, owner)
    if "input_ids" not in inputs:
        raise DataError(f"{owner}: inputs need 'input_ids'", where="inputs",
                        expected="input_ids")
    ids = check_token_ids(inputs["input_ids"], vocab_size, "input_ids", owner)
    seq = ids.shape[1]
    if max_len is not None and seq > max_len:
        raise DataError(f"{owner}: sequence length {seq} exceeds the model's limit {max_len}",
                        where="input_ids", expected=f"<= {max_len}", actual=seq)
    mask = inputs.get("attention_mask")
    if mask is not None:
        mask = jnp.asarray(mask)
        if tuple(mask.shape) != tuple(ids.shape):
            raise DataError(f"{owner}: attention_mask must have the shape of input_ids "
                            f"{tuple(ids.shape)}, got {tuple(mask.shape)}",
                            where="attention_mask", expected=tuple(ids.shape),
                            actual=tuple(mask.shape))
    pos = inputs.get("position_ids")
    if pos is None:
        pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None], ids.shape)
    else:
        pos = jnp.asarray(pos)
        if tuple(pos.shape) != tuple(ids.shape):
            raise DataError(f"{owner}: position_ids must have the shape of input_ids "
                            f"{tuple(ids.shape)}, got {tuple(pos.shape)}",
                            where="position_ids", expected=tuple(ids.shape),
                            actual=tuple(pos.shape))
    return ids, mask, pos


def causal_padding_mask(attention_mask: Array | None, seq: int) -> Array:
    """Boolean ``[batch or 1, 1, seq, seq]``: query ``i`` may attend key ``j <= i`` that is not
    padding."""
    causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))[None, None]
    if attention_mask is None:
        return causal
    return jnp.logical_and(causal, jnp.asarray(attention_mask).astype(jnp.bool_)[:, None, None, :])


def positions_from_mask(attention_mask: Array) -> Array:
    """Position ids of left-padded rows: ``cumsum(mask) - 1``, padding at 0 (what Hugging
    Face ``generate`` passes)."""
    m = jnp.asarray(attention_mask).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def key_mask_for_cache(attention_mask: Array, max_len: int) -> Array:
    """``[batch, 1, 1, max_len]`` boolean key mask of a cache whose first slots hold a padded
    prompt (``attention_mask [batch, prompt]``) and whose later slots hold generated tokens."""
    m = jnp.asarray(attention_mask).astype(jnp.bool_)
    b, p = m.shape
    if max_len < p:
        raise ShapeError(f"key_mask_for_cache: max_len {max_len} is shorter than the prompt "
                         f"({p})", where="max_len", expected=f">= {p}", actual=max_len)
    full = jnp.concatenate([m, jnp.ones((b, max_len - p), jnp.bool_)], axis=1)
    return full[:, None, None, :]


def check_cache(cache, n_layers: int, owner: str) -> None:
    """``cache`` must be ``{'index', 'layers': [n_layers entries]}``."""
    layers = cache.get("layers") if isinstance(cache, dict) else None
    if not (isinstance(layers, (list, tuple)) and "index" in cache and len(layers) == n_layers):
        raise ShapeError(f"{owner}: cache must come from the family's init_cache for this "
                         f"model ({n_layers} layers)", where="cache",
                         expected=f"{n_layers} layers", actual=type(cache).__name__)


def next_token_loss(apply_fn, cfg):
    """Default objective of a language model: mean cross-entropy of the next token over the
    real tokens (``attention_mask``, default all), on ``batch = {'input_ids', ...}``; aux:
    ``{'perplexity'}`` of the batch."""

    def loss_fn(params, batch, key):
        del key  # no dropout
        ids = jnp.asarray(batch["input_ids"])
        logits = apply_fn(params, dict(batch), cfg)["logits"].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        mask = batch.get("attention_mask")
        w = (jnp.ones_like(nll) if mask is None
             else jnp.asarray(mask)[:, 1:].astype(jnp.float32))
        mean = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
        return mean, {"perplexity": jnp.exp(mean)}

    return loss_fn


def sample_token_inputs(vocab_size: int, rng: np.random.Generator, batch: int,
                        seq: int = 16) -> dict:
    """Random token ids ``[batch, seq]`` with left padding in the first row."""
    ids = rng.integers(0, vocab_size, size=(batch, seq))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": jnp.asarray(ids, jnp.int32),
            "attention_mask": jnp.asarray(mask, jnp.int32)}


__all__ = ["INPUTS", "causal_padding_mask", "check_cache", "key_mask_for_cache", "lm_inputs",
           "next_token_loss", "positions_from_mask", "sample_token_inputs"]
