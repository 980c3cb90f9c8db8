"""Chronos (Ansari et al. 2024): mean-scale uniform-bins tokenizer + T5 + sampled forecasts.

Semantics follow ``chronos-forecasting``'s ``chronos.py`` (``MeanScaleUniformBins``,
``ChronosModel``, ``ChronosPipeline.predict``) for ``model_type='seq2seq'``:

* context: the last ``context_length`` values; ``scale = mean |x|`` over the observed (non-NaN)
  values, 1 where that is not > 0; ``token = bucketize(x / scale, boundaries, right=True) +
  n_special_tokens`` clipped to ``[0, n_tokens - 1]``; NaNs become ``pad_token_id`` with
  attention mask 0; an EOS token is appended when ``use_eos_token``.
* forecast: sample ``prediction_length`` tokens autoregressively from the T5 decoder (started
  from ``decoder_start_token_id``) with EOS suppressed (HF ``min_new_tokens``), temperature,
  top-k and top-p as HF's warpers; token ``t`` maps back to ``centers[t - n_special - 1] *
  scale``. Longer horizons loop as the pipeline does: append the per-step median sample to the
  context and forecast again.

Sampling is jit-friendly: static shapes, the encoder runs once, and the decoder steps under
``lax.fori_loop`` with a key-value cache of ``horizon`` positions
(:func:`lowrank_jax.models.t5.decode_loop`): ``O(horizon)`` decoder work per forecast.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.datasets import builtin_series, windows
from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.models import t5 as t5_model
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.hf import HFConfigFiles, HFSpec, hf_files_field
from lowrank_jax.models.t5 import T5Config

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ChronosConfig:
    """A Chronos model: the T5 configuration plus the tokenizer and sampling settings.

    Attributes are named as in ``chronos.ChronosConfig`` (``tokenizer_kwargs`` flattened into
    ``low_limit`` / ``high_limit``). ``hf_files``: the Hugging Face configuration files the model
    was loaded from, as in :class:`~lowrank_jax.models.t5.T5Config` (the top-level config's, not
    ``t5``'s, are the ones an export writes).
    """

    t5: T5Config
    n_tokens: int = 4096
    n_special_tokens: int = 2
    context_length: int = 512
    prediction_length: int = 64
    num_samples: int = 20
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    low_limit: float = -15.0
    high_limit: float = 15.0
    use_eos_token: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        if not isinstance(self.t5, T5Config):
            raise ConfigError(f"ChronosConfig: t5 must be a T5Config, got {type(self.t5).__name__}")
        if not (self.pad_token_id < self.n_special_tokens
                and self.eos_token_id < self.n_special_tokens):
            raise ConfigError(
                f"ChronosConfig: pad_token_id={self.pad_token_id} and eos_token_id="
                f"{self.eos_token_id} must be < n_special_tokens={self.n_special_tokens}"
            )
        if self.n_tokens - self.n_special_tokens - 1 < 2:
            raise ConfigError(f"ChronosConfig: n_tokens={self.n_tokens} leaves fewer than 2 bins")
        if self.n_tokens > self.t5.vocab_size:
            raise ConfigError(
                f"ChronosConfig: n_tokens={self.n_tokens} exceeds the T5 vocab_size "
                f"{self.t5.vocab_size}"
            )
        if not self.high_limit > self.low_limit:
            raise ConfigError(
                f"ChronosConfig: high_limit must exceed low_limit, got {self.low_limit}, "
                f"{self.high_limit}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict, *, t5: T5Config | None = None) -> "ChronosConfig":
        """From a Chronos ``config.json`` dict (a T5 config with a ``chronos_config`` entry)."""
        cc = d.get("chronos_config")
        if not isinstance(cc, dict):
            raise ConfigError("ChronosConfig.from_hf_dict: config has no 'chronos_config' dict")
        if cc.get("tokenizer_class", "MeanScaleUniformBins") != "MeanScaleUniformBins":
            raise ConfigError(
                "ChronosConfig: only tokenizer_class='MeanScaleUniformBins' is supported, got "
                f"{cc.get('tokenizer_class')!r}"
            )
        if cc.get("model_type", "seq2seq") != "seq2seq":
            raise ConfigError(
                "ChronosConfig: only model_type='seq2seq' (T5) Chronos models are supported, "
                f"got {cc.get('model_type')!r}"
            )
        kw = cc.get("tokenizer_kwargs") or {}
        return cls(
            t5=T5Config.from_hf_dict(d) if t5 is None else t5,
            n_tokens=int(cc["n_tokens"]), n_special_tokens=int(cc["n_special_tokens"]),
            context_length=int(cc["context_length"]),
            prediction_length=int(cc["prediction_length"]),
            num_samples=int(cc["num_samples"]), temperature=float(cc["temperature"]),
            top_k=int(cc["top_k"]), top_p=float(cc["top_p"]),
            low_limit=float(kw.get("low_limit", -15.0)),
            high_limit=float(kw.get("high_limit", 15.0)),
            use_eos_token=bool(cc["use_eos_token"]), pad_token_id=int(cc["pad_token_id"]),
            eos_token_id=int(cc["eos_token_id"]),
        )

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` of a Chronos checkpoint: the T5 fields plus
        ``chronos_config`` (what ``ChronosPipeline.from_pretrained`` reads)."""
        return dict(self.t5.to_hf_dict(), chronos_config=self.to_hf_chronos_dict())

    def to_hf_chronos_dict(self) -> dict:
        """The ``chronos_config`` entry of a Chronos ``config.json``."""
        return {
            "tokenizer_class": "MeanScaleUniformBins",
            "tokenizer_kwargs": {"low_limit": self.low_limit, "high_limit": self.high_limit},
            "context_length": self.context_length, "prediction_length": self.prediction_length,
            "n_tokens": self.n_tokens, "n_special_tokens": self.n_special_tokens,
            "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id,
            "use_eos_token": self.use_eos_token, "model_type": "seq2seq",
            "num_samples": self.num_samples, "temperature": self.temperature,
            "top_k": self.top_k, "top_p": self.top_p,
        }


# ---------------------------------------------------------------------------------------------
# Tokenizer (MeanScaleUniformBins).

def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace`` in float32, bit for bit (so token ids agree at bin edges).

    Its CPU kernel computes ``step`` in float32 and walks in from both ends with a fused
    multiply-add: ``start + step * i`` for ``i < steps // 2``, else
    ``end - step * (steps - 1 - i)``, rounded once. In float64 the product of a float32 and a
    small integer is exact, so one rounding to float32 reproduces the FMA.
    """
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(max(steps - 1, 1)))
    i = np.arange(steps, dtype=np.float64)
    lo = np.float64(start32) + step * i
    hi = np.float64(end32) - step * (steps - 1 - i)
    return np.where(np.arange(steps) < steps // 2, lo, hi).astype(np.float32)


def bin_centers(cfg: ChronosConfig) -> np.ndarray:
    """``float32[n_tokens - n_special_tokens - 1]``: the values of the bins."""
    return _linspace_f32(cfg.low_limit, cfg.high_limit, cfg.n_tokens - cfg.n_special_tokens - 1)


def bin_boundaries(cfg: ChronosConfig) -> np.ndarray:
    """``float32[len(centers) + 1]``: ``-1e20``, midpoints of the centers, ``1e20``."""
    c = bin_centers(cfg)
    mid = (c[1:] + c[:-1]) / np.float32(2)
    return np.concatenate([[np.float32(-1e20)], mid, [np.float32(1e20)]]).astype(np.float32)


def _input_transform(cfg: ChronosConfig, x: Array, scale: Array | None):
    x = jnp.asarray(x, jnp.float32)  # [batch, t]
    observed = ~jnp.isnan(x)
    if scale is None:
        total = jnp.sum(jnp.where(observed, jnp.abs(x), 0.0), axis=-1)
        scale = total / jnp.sum(observed, axis=-1).astype(jnp.float32)  # 0/0 -> nan -> 1
        scale = jnp.where(scale > 0, scale, 1.0)  # [batch]
    scaled = x / scale[:, None]
    ids = jnp.searchsorted(jnp.asarray(bin_boundaries(cfg)), scaled, side="right")
    ids = jnp.clip(ids.astype(jnp.int32) + cfg.n_special_tokens, 0, cfg.n_tokens - 1)
    ids = jnp.where(observed, ids, cfg.pad_token_id)
    return ids, observed, scale


def _append_eos(cfg: ChronosConfig, ids: Array, mask: Array):
    b = ids.shape[0]
    ids = jnp.concatenate([ids, jnp.full((b, 1), cfg.eos_token_id, ids.dtype)], axis=1)
    mask = jnp.concatenate([mask, jnp.ones((b, 1), bool)], axis=1)
    return ids, mask


def context_input_transform(cfg: ChronosConfig, context: Array):
    """Tokenize a context (``MeanScaleUniformBins.context_input_transform``).

    Args:
      cfg: Chronos configuration.
      context: ``float[batch, t]`` (or ``[t]``), left-padded with NaN.

    Returns:
      ``(token_ids int32[batch, t'], attention_mask bool[batch, t'], scale float32[batch])``
      with ``t' = min(t, context_length) (+ 1 for EOS)``.
    """
    context = jnp.asarray(context, jnp.float32)
    if context.ndim == 1:
        context = context[None]
    if context.ndim != 2:
        raise DataError(f"chronos: context must be [batch, time] or [time], got {context.shape}")
    context = context[:, -cfg.context_length:]
    ids, mask, scale = _input_transform(cfg, context, None)
    if cfg.use_eos_token:
        ids, mask = _append_eos(cfg, ids, mask)
    return ids, mask, scale


def label_input_transform(cfg: ChronosConfig, label: Array, scale: Array):
    """Tokenize targets with the context's scale (``label_input_transform``)."""
    label = jnp.asarray(label, jnp.float32)
    if label.shape[-1] != cfg.prediction_length:
        raise DataError(
            f"chronos: label length must equal prediction_length={cfg.prediction_length}, "
            f"got {label.shape[-1]}"
        )
    ids, mask, _ = _input_transform(cfg, label, jnp.asarray(scale, jnp.float32))
    if cfg.use_eos_token:
        ids, mask = _append_eos(cfg, ids, mask)
    return ids, mask


def output_transform(cfg: ChronosConfig, samples: Array, scale: Array) -> Array:
    """Token ids ``[batch, n, t]`` -> values ``centers[id - n_special - 1] * scale``."""
    centers = jnp.asarray(bin_centers(cfg))
    idx = jnp.clip(jnp.asarray(samples) - cfg.n_special_tokens - 1, 0, centers.shape[0] - 1)
    return centers[idx] * jnp.asarray(scale)[:, None, None]


# ---------------------------------------------------------------------------------------------
# Model.

def init(key: Array, cfg: ChronosConfig, **layers) -> dict:
    """Random parameters (a T5 tree; ``encoder_layers`` / ``decoder_layers`` as
    :func:`lowrank_jax.models.t5.init`)."""
    return t5_model.init(key, cfg.t5, **layers)


def apply(params: dict, inputs: dict, cfg: ChronosConfig) -> dict:
    """T5 forward on token ids (inputs/outputs as :func:`lowrank_jax.models.t5.apply`)."""
    return t5_model.apply(params, inputs, cfg.t5)


def embed(params: dict, context: Array, cfg: ChronosConfig):
    """Encoder embeddings of a context (``ChronosPipeline.embed``): ``(states, scale)``."""
    ids, mask, scale = context_input_transform(cfg, context)
    return t5_model.encode(params, ids, cfg.t5, attention_mask=mask), scale


def process_logits(logits: Array, *, eos_token_id: int, temperature: float, top_k: int | None,
                   top_p: float) -> Array:
    """HF's sampling pipeline for Chronos: suppress EOS (``min_new_tokens``), then temperature,
    top-k, top-p (:func:`lowrank_jax.models.t5.warp_logits`).

    Removed entries become ``-inf``. ``top_k`` 0/None and ``top_p >= 1`` disable those steps.
    """
    logits = logits.astype(jnp.float32).at[..., eos_token_id].set(-jnp.inf)  # min_new_tokens
    return t5_model.warp_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)


@functools.partial(jax.jit, static_argnames=("cfg", "horizon", "num_samples", "temperature",
                                             "top_k", "top_p", "use_cache"))
def sample_tokens(params: dict, input_ids: Array, attention_mask: Array, cfg: ChronosConfig,
                  key: Array, *, horizon: int, num_samples: int, temperature: float,
                  top_k: int | None, top_p: float, use_cache: bool = True) -> Array:
    """Sample ``num_samples`` token paths of length ``horizon`` (``ChronosModel.forward``).

    The encoder runs once; the decoder keeps a key-value cache (``use_cache=False``: re-runs
    on the whole prefix at every step, as before the cache existed; the same tokens for the
    same key, to round-off in the logits).

    Returns:
      ``int32[batch, num_samples, horizon]``.
    """
    t5 = cfg.t5
    batch = input_ids.shape[0]
    enc = t5_model.encode(params, input_ids, t5, attention_mask=attention_mask)  # [batch, s, d]

    def choose(logits, t, sub):
        del t
        logits = process_logits(logits, eos_token_id=cfg.eos_token_id, temperature=temperature,
                                top_k=top_k, top_p=top_p)  # [n, vocab]
        return jax.random.categorical(sub, logits, axis=-1)

    # HF num_return_sequences: every series repeated num_samples times, consecutively (the
    # cache keeps the encoder's keys and values once per series).
    toks = t5_model.decode_loop(params, enc, t5, key, choose, steps=horizon,
                                attention_mask=attention_mask, repeats=num_samples,
                                use_cache=use_cache)
    return toks.reshape(batch, num_samples, horizon)


def predict(params: dict, context: Array, cfg: ChronosConfig, horizon: int | None = None,
            num_samples: int | None = None, key: Array | None = None, *,
            temperature: float | None = None, top_k: int | None = None,
            top_p: float | None = None) -> Array:
    """Sampled forecasts (``ChronosPipeline.predict``).

    Args:
      params: model parameters.
      context: ``float[batch, t]`` or ``[t]``, left-padded with NaN.
      cfg: Chronos configuration.
      horizon: forecast length (default ``prediction_length``); longer horizons are forecast
        ``prediction_length`` at a time, appending the per-step median sample (the lower
        median, as ``torch.median``) to the context in between, as the pipeline does.
      num_samples: sample paths per series (default ``cfg.num_samples``).
      key: PRNG key (required).
      temperature, top_k, top_p: override the config's sampling settings.

    Returns:
      ``float32[batch, num_samples, horizon]``.
    """
    if key is None:
        raise ConfigError("chronos.predict: pass a PRNG key (key=jax.random.PRNGKey(...))",
                          where="key", expected="a PRNG key", actual=None)
    horizon = cfg.prediction_length if horizon is None else int(horizon)
    num_samples = cfg.num_samples if num_samples is None else int(num_samples)
    settings = dict(
        temperature=float(cfg.temperature if temperature is None else temperature),
        top_k=int(cfg.top_k if top_k is None else top_k),
        top_p=float(cfg.top_p if top_p is None else top_p),
    )
    context = jnp.asarray(context, jnp.float32)
    if context.ndim == 1:
        context = context[None]
    chunks, remaining = [], horizon
    while remaining > 0:
        ids, mask, scale = context_input_transform(cfg, context)
        key, sub = jax.random.split(key)
        length = min(remaining, cfg.prediction_length)
        tokens = sample_tokens(params, ids, mask, cfg, sub, horizon=length,
                               num_samples=num_samples, **settings)
        values = output_transform(cfg, tokens, scale)  # [batch, n, length]
        chunks.append(values)
        remaining -= length
        if remaining > 0:
            lower_median = jnp.sort(values, axis=1)[:, (num_samples - 1) // 2]  # [batch, length]
            context = jnp.concatenate([context, lower_median], axis=-1)
    return jnp.concatenate(chunks, axis=-1)


def sample_inputs(cfg: ChronosConfig, rng: np.random.Generator, batch: int) -> dict:
    """Real series (shipped with aeon): context tokens and teacher-forced forecast tokens, as in
    training."""
    series, _ = builtin_series()
    ctx_len = min(cfg.context_length, 128)
    w = windows(series, ctx_len + cfg.prediction_length, batch, seed=int(rng.integers(1 << 30)))
    return batch_from_windows(cfg, w[:, :ctx_len], w[:, ctx_len:], labels=False)


def batch_from_windows(cfg: ChronosConfig, context, target, *, labels: bool = True) -> dict:
    """Tokenized model inputs from series windows: the context's tokens, the target's tokens
    (scaled by the context) as ``labels`` and, shifted right, as ``decoder_input_ids``."""
    ids, mask, scale = context_input_transform(cfg, context)
    label_ids, _ = label_input_transform(cfg, target, scale)
    out = {"input_ids": ids, "attention_mask": mask.astype(jnp.int32),
           "decoder_input_ids": t5_model.shift_right(label_ids, cfg.t5)}
    if labels:
        out["labels"] = label_ids
    return out


def loss(cfg: ChronosConfig):
    """Default objective: Chronos' token cross-entropy on ``batch_from_windows`` batches."""
    return t5_model.loss(cfg.t5)


LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def forecast(params: dict, context, cfg: ChronosConfig, *, key=None) -> Array:
    """Quantiles ``[batch, 9, prediction_length]`` (levels 0.1..0.9) of ``cfg.num_samples``
    sampled paths (:func:`predict`, PRNG key 0 unless given)."""
    key = jax.random.PRNGKey(0) if key is None else key
    samples = predict(params, context, cfg, key=key)  # [batch, n, h]
    return jnp.moveaxis(jnp.quantile(samples, jnp.asarray(LEVELS), axis=1), 0, 1)


# ---------------------------------------------------------------------------------------------
# Hugging Face mapping: a T5 checkpoint whose config.json has a ``chronos_config`` entry.

def detect_hf(hf_config: dict) -> bool:
    """A Chronos (T5) ``config.json``: a T5 config with a ``chronos_config`` that is not
    Chronos-Bolt's."""
    chronos_cfg = hf_config.get("chronos_config")
    if not isinstance(chronos_cfg, dict):
        return False
    return (hf_config.get("model_type", "t5") == "t5" and "input_patch_size" not in chronos_cfg
            and "ChronosBoltModelForForecasting" not in (hf_config.get("architectures") or []))


def config_from_hf(hf_config: dict, state) -> ChronosConfig:
    """:class:`ChronosConfig` from a ``config.json`` dict and the checkpoint's tensors (the T5
    part as :func:`lowrank_jax.models.t5.config_from_hf`)."""
    return ChronosConfig.from_hf_dict(hf_config, t5=t5_model.config_from_hf(hf_config, state))


HF_SPEC = HFSpec(detect=detect_hf, config_from_hf=config_from_hf,
                 config_to_hf=lambda cfg: cfg.to_hf_dict(),
                 key_table=lambda cfg: t5_model.hf_key_table(cfg.t5),
                 optional=lambda cfg: t5_model.hf_optional_keys(cfg.t5))

FAMILY = register_family(ModelFamily(
    name="chronos", config_cls=ChronosConfig, init=init, apply=apply,
    sample_inputs=sample_inputs, primary_outputs=("logits",), token_outputs=True, loss=loss,
    forecast=forecast, forecast_levels=lambda cfg: LEVELS,
    batch_from_windows=batch_from_windows, hf=HF_SPEC))


__all__ = [
    "ChronosConfig", "FAMILY", "LEVELS", "apply", "batch_from_windows", "bin_boundaries",
    "bin_centers", "context_input_transform", "embed", "forecast", "init",
    "label_input_transform", "loss", "output_transform", "predict", "process_logits",
    "sample_inputs", "sample_tokens",
]
