"""Cached text generation for decoder-only language models (GPT-2, Llama-style).

:func:`generate` runs a whole generation -- the prompt through the model once (prefill), then
one token per step against the key-value cache -- as one compiled program: the loop is a
``lax.scan`` and the sampling settings (temperature, top-k, top-p) are traced values, so
greedy decoding and every sampling setting share one compilation per model, batch and length.

Prompts of different lengths are batched with left padding: every row's padding slots are
hidden from attention and its tokens take positions counted over its real tokens (as Hugging
Face ``generate`` does), so each row decodes as it would alone. The family's
``init_cache`` / ``apply_cached`` (:class:`~lowrank_jax.models.ModelFamily`) do the model's
part; every weight goes through :func:`lowrank_jax.linear`, so a compressed model decodes with
its compressed leaves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.models.causal import key_mask_for_cache, positions_from_mask
from lowrank_jax.models.family import ModelFamily, family_of

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
      temperature: ``0`` for greedy decoding (the most likely token), else the logits are
        divided by it before sampling.
      top_k: sample among the ``top_k`` most likely tokens (``0``: all).
      top_p: nucleus sampling ("The Curious Case of Neural Text Degeneration",
        arXiv:1904.09751): sample among the most likely tokens whose probabilities sum to at
        least ``top_p`` (``1.0``: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ConfigError(f"Sampling: temperature must be >= 0, got {self.temperature!r}",
                              where="temperature", expected=">= 0", actual=self.temperature)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"Sampling: top_k must be an int >= 0, got {self.top_k!r}",
                              where="top_k", expected="int >= 0", actual=self.top_k)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"Sampling: top_p must be in (0, 1], got {self.top_p!r}",
                              where="top_p", expected="(0, 1]", actual=self.top_p)


def sample_logits(logits: Array, key: Array, temperature, top_k, top_p) -> Array:
    """One token per row of ``logits [batch, vocab]``: the argmax where ``temperature == 0``,
    else a sample of ``softmax(logits / temperature)`` restricted to the top-k tokens and the
    top-p nucleus (the most likely token is always allowed). All three settings may be traced;
    greedy decoding skips the sort the sampling needs (``lax.cond``).
    """
    logits = logits.astype(jnp.float32)
    t = jnp.asarray(temperature, jnp.float32)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample():
        return _sample(logits, key, t, top_k, top_p)

    return jax.lax.cond(t > 0, sample, greedy)


def _sample(logits: Array, key: Array, t, top_k, top_p) -> Array:
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(t, 1e-6)
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.asarray(top_k, jnp.int32)
    kth = jnp.take_along_axis(ordered, jnp.clip(k - 1, 0, vocab - 1)[None, None].repeat(
        logits.shape[0], 0), axis=-1)  # [batch, 1]
    keep = jnp.where(k > 0, scaled >= kth, True)
    # nucleus over the (top-k restricted) distribution: keep a token when the mass of the
    # tokens strictly more likely than it is below top_p
    ordered = jnp.where(jnp.where(k > 0, ordered >= kth, True), ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    inside = before < jnp.asarray(top_p, jnp.float32)
    cutoff = jnp.min(jnp.where(inside, ordered, jnp.inf), axis=-1, keepdims=True)
    keep = jnp.logical_and(keep, scaled >= cutoff)
    return jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf),
                                  axis=-1).astype(jnp.int32)


def _causal_family(cfg) -> ModelFamily:
    fam = family_of(cfg)
    if fam.init_cache is None or fam.apply_cached is None:
        raise ConfigError(f"generate: family {fam.name!r} is not a decoder-only language model "
                          "(it has no init_cache / apply_cached)", where="config",
                          expected="a decoder-only family (gpt2, llama)", actual=fam.name)
    return fam


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "pad_token_id",
                                             "with_scores", "factored_cache"))
def _generate(params, ids, mask, key, temperature, top_k, top_p, stops, *, cfg,
              max_new_tokens: int, pad_token_id: int, with_scores: bool,
              factored_cache: bool = False):
    fam = _causal_family(cfg)
    batch, prompt = ids.shape
    total = prompt + max_new_tokens
    cache = fam.init_cache(params, cfg, batch=batch, max_len=total,
                           **({"factored": True} if factored_cache else {}))
    key_mask = key_mask_for_cache(mask, total)
    logits, cache = fam.apply_cached(params, ids, cfg, cache, positions=positions_from_mask(mask),
                                     key_mask=key_mask, last_only=True)
    next_pos = jnp.sum(mask.astype(jnp.int32), axis=1)  # [batch]

    def step(carry, step_key):
        last, cache, pos, done = carry
        tok = sample_logits(last, step_key, temperature, top_k, top_p)
        tok = jnp.where(done, pad_token_id, tok)
        done = jnp.logical_or(done, jnp.any(tok[:, None] == stops[None, :], axis=-1))
        logits, cache = fam.apply_cached(params, tok[:, None], cfg, cache,
                                         positions=pos[:, None], key_mask=key_mask)
        return (logits[:, -1], cache, pos + 1, done), (tok, last if with_scores else None)

    keys = jax.random.split(key, max_new_tokens)
    done0 = jnp.zeros((batch,), jnp.bool_)
    _, (tokens, scores) = jax.lax.scan(step, (logits[:, -1], cache, next_pos, done0), keys)
    return jnp.swapaxes(tokens, 0, 1), (jnp.swapaxes(scores, 0, 1) if with_scores else None)


def generate(params, cfg, input_ids, attention_mask=None, *, max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_tokens=(), pad_token_id: int = 0,
             seed: int = 0, return_scores: bool = False, factored_cache: bool = False):
    """Continue every prompt by ``max_new_tokens`` tokens with a key-value cache.

    Args:
      params: the model's parameters (any leaf types).
      cfg: its config (a decoder-only family: GPT-2 or Llama-style).
      input_ids: ``int[batch, prompt]``, left-padded when the prompts differ in length.
      attention_mask: ``[batch, prompt]``, 0 on the padding (default: no padding).
      max_new_tokens: tokens generated per row.
      sampling: :class:`Sampling` (default greedy).
      stop_tokens: token ids that end a row: the stop token is emitted, every later token of
        that row is ``pad_token_id``.
      pad_token_id: what a finished row emits.
      seed: random seed of the sampling.
      return_scores: also return the logits each token was chosen from.
      factored_cache: keep low-rank keys and values as ``x U`` in the cache where that is
        exact and smaller (:mod:`lowrank_jax.nn.attention.factored_cache`); the tokens are
        those of the full cache.

    Returns:
      ``tokens int32[batch, max_new_tokens]`` (NumPy), and with ``return_scores`` also
      ``scores float32[batch, max_new_tokens, vocab]``.
    """
    _causal_family(cfg)
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[1] < 1:
        raise DataError(f"generate: input_ids must be int[batch, prompt >= 1], got "
                        f"{ids.dtype}{list(ids.shape)}", where="input_ids",
                        expected="int[batch, prompt]", actual=f"{ids.dtype}{list(ids.shape)}")
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise DataError(f"generate: attention_mask must have the shape of input_ids "
                        f"{ids.shape}, got {mask.shape}", where="attention_mask",
                        expected=ids.shape, actual=mask.shape)
    if np.any(mask.sum(axis=1) == 0):
        raise DataError("generate: every prompt needs at least one real token (a row of "
                        "attention_mask is all 0)", where="attention_mask")
    if np.any(np.diff(mask.astype(np.int64), axis=1) < 0):
        raise DataError("generate: prompts must be left-padded (attention_mask 0...0 1...1 per "
                        "row)", where="attention_mask", expected="left padding")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 1):
        raise DataError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}",
                        where="max_new_tokens", expected=">= 1", actual=max_new_tokens)
    if not isinstance(sampling, Sampling):
        raise ConfigError(f"generate: sampling must be a Sampling, got "
                          f"{type(sampling).__name__}", where="sampling")
    stops = np.asarray(list(stop_tokens) or [-1], np.int32)
    tokens, scores = _generate(params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32),
                               jax.random.PRNGKey(seed), np.float32(sampling.temperature),
                               np.int32(sampling.top_k), np.float32(sampling.top_p),
                               jnp.asarray(stops), cfg=cfg, max_new_tokens=max_new_tokens,
                               pad_token_id=int(pad_token_id), with_scores=bool(return_scores),
                               factored_cache=bool(factored_cache))
    if return_scores:
        return np.asarray(tokens), np.asarray(scores)
    return np.asarray(tokens)


__all__ = ["Sampling", "generate", "sample_logits"]
