"""How much a compression changed a model: output error, top-10 overlap, measured time.

:func:`compare_models` runs the original and the compressed parameters of one model on the same
inputs (built by :func:`sample_inputs` unless given) and reports, next to the parameter ratio:

* ``max_abs_error`` and ``rel_error`` (Frobenius) of the primary output (``logits``,
  ``quantile_preds`` or ``last_hidden_state``);
* ``top10_jaccard`` for token models (T5, Chronos): per position, the Jaccard overlap of the
  top-10 tokens of the two models, averaged (seed 000 Table 2, "Overlap");
* ``time_ratio``: median compressed / median original forward time, both jitted, measured
  interleaved in one run so machine noise hits both alike.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.datasets import builtin_series, windows
from lowrank_jax.leaves import flops, param_count
from lowrank_jax.models import BertConfig, ChronosBoltConfig, ChronosConfig, T5Config, ViTConfig
from lowrank_jax.models import apply as model_apply
from lowrank_jax.models import chronos as chronos_model
from lowrank_jax.models import t5 as t5_model

_SAMPLERS: dict[type, Callable[[Any, np.random.Generator, int], dict]] = {}
_PRIMARY = ("quantile_preds", "logits", "last_hidden_state")
_TOKEN_MODELS: tuple[type, ...] = (T5Config, ChronosConfig)


def register_sampler(config_cls: type, fn: Callable[[Any, np.random.Generator, int], dict]) -> None:
    """``fn(config, rng, batch) -> inputs`` builds representative inputs for a model family."""
    _SAMPLERS[config_cls] = fn


def _t5_inputs(cfg: T5Config, rng, batch):
    ids = rng.integers(2, cfg.vocab_size, size=(batch, 32))
    mask = np.ones_like(ids)
    mask[0, -5:] = 0  # some padding
    dec = rng.integers(2, cfg.vocab_size, size=(batch, 16))
    return {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "attention_mask": jnp.asarray(mask, jnp.int32),
        "decoder_input_ids": jnp.asarray(dec, jnp.int32),
    }


def _chronos_inputs(cfg: ChronosConfig, rng, batch):
    # Real series: context tokens and teacher-forced forecast tokens, as in training.
    series, _ = builtin_series()
    ctx_len = min(cfg.context_length, 128)
    w = windows(series, ctx_len + cfg.prediction_length, batch, seed=int(rng.integers(1 << 30)))
    ids, mask, scale = chronos_model.context_input_transform(cfg, w[:, :ctx_len])
    label_ids, _ = chronos_model.label_input_transform(cfg, w[:, ctx_len:], scale)
    dec = t5_model.shift_right(label_ids, cfg.t5)
    return {"input_ids": ids, "attention_mask": mask.astype(jnp.int32), "decoder_input_ids": dec}


def _chronos_bolt_inputs(cfg: ChronosBoltConfig, rng, batch):
    # Real series windows of the model's context length, a few values missing (NaN).
    series, _ = builtin_series()
    w = windows(series, cfg.context_length, batch, seed=int(rng.integers(1 << 30)))
    w[0, : cfg.context_length // 4] = np.nan  # a shorter, left-padded context
    w[1, rng.integers(0, cfg.context_length, size=3)] = np.nan
    return {"context": jnp.asarray(w, jnp.float32)}


def _vit_inputs(cfg: ViTConfig, rng, batch):
    x = rng.normal(size=(batch, cfg.num_channels, cfg.image_size, cfg.image_size))
    return {"pixel_values": jnp.asarray(x, jnp.float32)}


def _bert_inputs(cfg: BertConfig, rng, batch):
    ids = rng.integers(1, cfg.vocab_size, size=(batch, 32))
    mask = np.ones_like(ids)
    mask[0, -5:] = 0
    return {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "attention_mask": jnp.asarray(mask, jnp.int32),
        "token_type_ids": jnp.zeros_like(jnp.asarray(ids, jnp.int32)),
    }


register_sampler(T5Config, _t5_inputs)
register_sampler(ChronosConfig, _chronos_inputs)
register_sampler(ChronosBoltConfig, _chronos_bolt_inputs)
register_sampler(ViTConfig, _vit_inputs)
register_sampler(BertConfig, _bert_inputs)


def sample_inputs(config: Any, *, batch: int = 8, seed: int = 0) -> dict:
    """Representative inputs for ``config``'s model family (real series for forecasters)."""
    for cls in type(config).__mro__:
        if cls in _SAMPLERS:
            return _SAMPLERS[cls](config, np.random.default_rng(seed), batch)
    raise TypeError(f"sample_inputs: no input sampler for {type(config).__name__}; pass inputs=")


def top_k_jaccard(a, b, k: int = 10) -> float:
    """Mean over positions of ``|top_k(a) & top_k(b)| / |top_k(a) | top_k(b)|`` (last axis)."""
    a = np.asarray(a).reshape(-1, np.shape(a)[-1])
    b = np.asarray(b).reshape(-1, np.shape(b)[-1])
    ta = np.argpartition(-a, k - 1, axis=-1)[:, :k]
    tb = np.argpartition(-b, k - 1, axis=-1)[:, :k]
    scores = []
    for x, y in zip(ta, tb, strict=True):
        sx, sy = set(x.tolist()), set(y.tolist())
        scores.append(len(sx & sy) / len(sx | sy))
    return float(np.mean(scores))


def _primary(out: dict) -> str:
    for key in _PRIMARY:
        if key in out:
            return key
    raise KeyError(f"compare_models: no primary output among {list(out)}")


def _token_count(inputs: dict) -> int:
    for v in inputs.values():
        return int(np.prod(np.shape(v)[:2]))
    return 0


def compare_models(
    config: Any,
    params: Any,
    new_params: Any,
    *,
    inputs: dict | None = None,
    time_runs: int = 20,
    measure_time: bool = True,
) -> dict:
    """Compare a compressed model with the original on the same inputs.

    Args:
      config: the model config (any registered family).
      params: original parameters.
      new_params: compressed parameters of the same model.
      inputs: model inputs (default :func:`sample_inputs`).
      time_runs: timed forward calls of each model (median reported).
      measure_time: set ``False`` to skip timing (tests).

    Returns:
      A dict: ``output``, ``max_abs_error``, ``rel_error``, ``top10_jaccard`` (token models),
      ``param_ratio``, ``flop_ratio`` (weight leaves, for the batch's tokens), ``time_ratio``.
    """
    inputs = sample_inputs(config) if inputs is None else inputs
    fwd = jax.jit(lambda p, inp: model_apply(config, p, **inp))
    ref = fwd(params, inputs)
    new = fwd(new_params, inputs)
    key = _primary(ref)
    a, b = np.asarray(ref[key], np.float64), np.asarray(new[key], np.float64)
    n_tok = _token_count(inputs)
    out = {
        "output": key,
        "max_abs_error": float(np.max(np.abs(a - b))),
        "rel_error": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)),
        "param_ratio": param_count(new_params) / param_count(params),
        "flop_ratio": flops(new_params, n_tok) / max(flops(params, n_tok), 1),
    }
    if isinstance(config, _TOKEN_MODELS) and key == "logits":
        out["top10_jaccard"] = top_k_jaccard(a, b, 10)
    if measure_time:
        t_ref, t_new = [], []
        for _ in range(time_runs):  # interleaved: noise hits both
            t0 = time.perf_counter()
            jax.block_until_ready(fwd(params, inputs))
            t1 = time.perf_counter()
            jax.block_until_ready(fwd(new_params, inputs))
            t2 = time.perf_counter()
            t_ref.append(t1 - t0)
            t_new.append(t2 - t1)
        out["time_ratio"] = float(np.median(t_new) / np.median(t_ref))
        out["time_ms"] = {
            "original": 1e3 * float(np.median(t_ref)),
            "compressed": 1e3 * float(np.median(t_new)),
        }
    return out
