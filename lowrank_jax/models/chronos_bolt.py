"""Chronos-Bolt (Ansari et al. 2024, "Chronos-Bolt"): patched, direct multi-quantile forecaster.

Semantics follow ``chronos-forecasting``'s ``chronos_bolt.py``
(``ChronosBoltModelForForecasting.forward`` and ``ChronosBoltPipeline.predict`` /
``predict_quantiles``):

* context: the last ``context_length`` values; NaN-aware instance normalization
  ``(x - loc) / scale`` with ``loc = nanmean(x)`` (0 if nothing is observed), ``scale =
  sqrt(nanmean((x - loc)^2))`` (1 if nothing is observed, ``1e-5`` if 0);
* patching: left-pad with NaN to a multiple of ``input_patch_size``, cut patches of that size
  every ``input_patch_stride`` values; unobserved values become 0 and the patch of the observed
  mask is concatenated to the patch of values (``[.., 2 * patch]``);
* input embedding: a residual block ``output(act(hidden(x))) + residual(x)`` (no layer norm;
  dropout is inactive in inference), optionally followed by a ``[REG]`` token (``shared[1]``);
* a T5 encoder with key-padding mask "at least one value of the patch observed", then a single
  decoder step from ``shared[decoder_start_token_id]``;
* output: a residual block to ``n_quantiles * prediction_length`` values, reshaped to
  ``[batch, n_quantiles, prediction_length]`` and un-normalized with ``loc``/``scale``.

Every weight matrix (attention, MLP, both residual blocks) is a leaf applied with
:func:`~lowrank_jax.leaves.linear`, so any of them can be compressed.

Parameter tree::

    {'shared': [1 or 2, d_model],                              # start (+ REG) embedding
     'input_patch_embedding': {'hidden_layer', 'output_layer', 'residual_layer'},  # Dense + b
     'encoder': init_encoder(...) tree, 'decoder': init_decoder(...) tree,
     'output_patch_embedding': {'hidden_layer', 'output_layer', 'residual_layer'}}
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.datasets import builtin_series, windows
from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.losses import quantile_loss
from lowrank_jax.models import t5 as t5_model
from lowrank_jax.models.common import check_inputs, layer_sizes
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.models.hf import HFConfigFiles, HFSpec, hf_files_field, linear_rows
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.nn import (
    ACTIVATIONS,
    apply_decoder,
    apply_encoder,
    init_decoder,
    init_encoder,
    padding_mask,
)

Array = jax.Array

#: ``InstanceNorm.eps`` of the reference: the scale of a constant series.
INSTANCE_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class ChronosBoltConfig:
    """A Chronos-Bolt model: the T5 configuration plus the ``chronos_config`` entries.

    Attributes are named as in ``chronos.chronos_bolt.ChronosBoltConfig``. ``t5.vocab_size``
    is the size of ``shared``: 1 (decoder start token) or 2 (plus ``[REG]``), as the reference
    model forces it. ``hf_files``: the Hugging Face configuration files the model was loaded
    from, as in :class:`~lowrank_jax.models.t5.T5Config`.
    """

    t5: T5Config
    context_length: int = 2048
    prediction_length: int = 64
    input_patch_size: int = 16
    input_patch_stride: int = 16
    quantiles: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    use_reg_token: bool = False
    hf_files: HFConfigFiles | None = hf_files_field()

    def __post_init__(self):
        if not isinstance(self.t5, T5Config):
            raise ConfigError(
                f"ChronosBoltConfig: t5 must be a T5Config, got {type(self.t5).__name__}")
        for name in ("context_length", "prediction_length", "input_patch_size",
                     "input_patch_stride"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"ChronosBoltConfig: {name} must be a positive int, got {val!r}")
        if not isinstance(self.quantiles, tuple) or not self.quantiles:
            raise ConfigError(
                f"ChronosBoltConfig: quantiles must be a non-empty tuple of floats, got "
                f"{self.quantiles!r} (pass tuple(levels))")
        if any(not 0.0 < q < 1.0 for q in self.quantiles):
            raise ConfigError(f"ChronosBoltConfig: quantiles must lie in (0, 1), got "
                             f"{self.quantiles}")
        want = 2 if self.use_reg_token else 1
        if self.t5.vocab_size != want:
            raise ConfigError(
                f"ChronosBoltConfig: t5.vocab_size must be {want} (decoder start"
                f"{' + [REG]' if self.use_reg_token else ''}), got {self.t5.vocab_size}")
        if self.t5.decoder_start_token_id >= want:
            raise ConfigError(
                f"ChronosBoltConfig: decoder_start_token_id={self.t5.decoder_start_token_id} "
                f"is outside the {want}-row embedding")

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ChronosBoltConfig":
        """Build from a Hugging Face ``config.json`` dict with a ``chronos_config`` entry.

        ``vocab_size`` is set from ``use_reg_token`` (the reference model overrides it the same
        way), whatever the file says.
        """
        if "chronos_config" not in d:
            raise ConfigError("ChronosBoltConfig.from_hf_dict: no 'chronos_config' in the config")
        cc = d["chronos_config"]
        missing = [k for k in ("context_length", "prediction_length", "input_patch_size",
                               "input_patch_stride", "quantiles") if k not in cc]
        if missing:
            raise ConfigError(
                f"ChronosBoltConfig.from_hf_dict: chronos_config lacks {missing}; is this a "
                "Chronos-Bolt checkpoint?")
        reg = bool(cc.get("use_reg_token", False))
        t5 = T5Config.from_hf_dict({**d, "vocab_size": 2 if reg else 1})
        return cls(
            t5=t5,
            context_length=int(cc["context_length"]),
            prediction_length=int(cc["prediction_length"]),
            input_patch_size=int(cc["input_patch_size"]),
            input_patch_stride=int(cc["input_patch_stride"]),
            quantiles=tuple(float(q) for q in cc["quantiles"]),
            use_reg_token=reg,
        )

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` fields this config determines."""
        d = self.t5.to_hf_dict()
        d["architectures"] = ["ChronosBoltModelForForecasting"]
        d["chronos_config"] = {
            "context_length": self.context_length, "prediction_length": self.prediction_length,
            "input_patch_size": self.input_patch_size,
            "input_patch_stride": self.input_patch_stride, "quantiles": list(self.quantiles),
            "use_reg_token": self.use_reg_token,
        }
        return d

    # -- derived ---------------------------------------------------------------------------

    @property
    def num_quantiles(self) -> int:
        return len(self.quantiles)

    @property
    def activation(self) -> str:
        """``nn`` name of HF's ``dense_act_fn`` (the residual blocks' activation)."""
        return self.t5.activation

    def num_patches(self, length: int) -> int:
        """Number of patches of a context of ``length`` values (``[REG]`` not counted)."""
        length = min(length, self.context_length)
        padded = -(-length // self.input_patch_size) * self.input_patch_size
        return (padded - self.input_patch_size) // self.input_patch_stride + 1


# -- blocks ----------------------------------------------------------------------------------

def init_residual_block(key: Array, d_in: int, d_hidden: int, d_out: int) -> dict:
    """``{'hidden_layer', 'output_layer', 'residual_layer'}`` Dense leaves with biases."""
    kh, ko, kr = jax.random.split(key, 3)
    return {"hidden_layer": init_dense(kh, d_in, d_hidden, bias=True),
            "output_layer": init_dense(ko, d_hidden, d_out, bias=True),
            "residual_layer": init_dense(kr, d_in, d_out, bias=True)}


def apply_residual_block(params: dict, x: Array, activation: str) -> Array:
    """``output(act(hidden(x))) + residual(x)`` (the reference ``ResidualBlock`` in eval mode,
    without its optional layer norm, which Chronos-Bolt does not use)."""
    hid = ACTIVATIONS[activation](linear(params["hidden_layer"], x))
    return linear(params["output_layer"], hid) + linear(params["residual_layer"], x)


def instance_norm(x: Array) -> tuple[Array, tuple[Array, Array]]:
    """NaN-aware standardization over the last axis (reference ``InstanceNorm.forward``).

    Returns:
      ``((x - loc) / scale, (loc, scale))`` with ``loc, scale: [..., 1]``; NaNs stay NaN.
    """
    x = jnp.asarray(x, jnp.float32)
    loc = jnp.nan_to_num(jnp.nanmean(x, axis=-1, keepdims=True), nan=0.0)
    scale = jnp.nan_to_num(
        jnp.sqrt(jnp.nanmean(jnp.square(x - loc), axis=-1, keepdims=True)), nan=1.0)
    scale = jnp.where(scale == 0, INSTANCE_NORM_EPS, scale)
    return (x - loc) / scale, (loc, scale)


def patch(x: Array, size: int, stride: int) -> Array:
    """Left-pad the last axis with NaN to a multiple of ``size``, then cut windows of ``size``
    every ``stride`` values (``torch.Tensor.unfold``): ``[..., L] -> [..., n, size]``."""
    length = x.shape[-1]
    if length % size:
        pad = jnp.full((*x.shape[:-1], size - length % size), jnp.nan, x.dtype)
        x = jnp.concatenate([pad, x], axis=-1)
    n = (x.shape[-1] - size) // stride + 1
    if stride == size:  # windows side by side (Chronos-Bolt's default): a reshape, no gather
        return x.reshape(*x.shape[:-1], n, size)
    idx = np.arange(n)[:, None] * stride + np.arange(size)[None, :]  # [n, size], static
    return x[..., idx]


# -- model -----------------------------------------------------------------------------------

def init(key: Array, cfg: ChronosBoltConfig, *, encoder_layers=None,
         decoder_layers=None) -> dict:
    """Random Chronos-Bolt parameters (Dense leaves; ``N(0, 1)`` embeddings as HF's init).

    ``encoder_layers`` / ``decoder_layers``: optional per-layer
    :class:`~lowrank_jax.nn.LayerSizes`, as :func:`lowrank_jax.models.t5.init`.
    """
    t5 = cfg.t5
    enc = layer_sizes(encoder_layers, t5.encoder_sizes,
                                "chronos_bolt.init: encoder_layers", t5.num_layers)
    dec = layer_sizes(decoder_layers, t5.decoder_sizes,
                                "chronos_bolt.init: decoder_layers", t5.decoder_layers)
    ks, ki, ke, kd, ko = jax.random.split(key, 5)
    d, ff = t5.d_model, t5.d_ff
    return {
        "shared": jax.random.normal(ks, (t5.vocab_size, d), jnp.float32),
        "input_patch_embedding": init_residual_block(ki, 2 * cfg.input_patch_size, ff, d),
        "encoder": init_encoder(ke, t5.encoder, d_model=d, layers=enc),
        "decoder": init_decoder(kd, t5.decoder, d_model=d, layers=dec),
        "output_patch_embedding": init_residual_block(
            ko, d, ff, cfg.num_quantiles * cfg.prediction_length),
    }


def encode(params: dict, context: Array, cfg: ChronosBoltConfig, *,
           mask: Array | None = None) -> dict:
    """Encoder half of the forward pass (reference ``ChronosBoltModelForForecasting.encode``).

    Args:
      params: model parameters.
      context: ``[batch, length]`` float series, NaN where unobserved.
      cfg: model configuration.
      mask: optional ``[batch, length]`` observed mask (default: ``~isnan(context)``).

    Returns:
      ``{'encoder_last_hidden_state': [batch, n, d_model], 'loc_scale': (loc, scale) each
      [batch, 1], 'inputs_embeds': [batch, n, d_model], 'attention_mask': bool[batch, n]}``
      with ``n`` patches (+1 for ``[REG]``).
    """
    context = jnp.asarray(context, jnp.float32)
    if context.ndim != 2:
        raise DataError(f"chronos_bolt: context must be [batch, length], got shape "
                        f"{tuple(context.shape)}", where="context", expected="[batch, length]",
                        actual=tuple(context.shape))
    if mask is None:
        mask = (~jnp.isnan(context)).astype(jnp.float32)
    else:
        mask = jnp.asarray(mask).astype(jnp.float32)
        if mask.shape != context.shape:
            raise DataError(f"chronos_bolt: mask shape {tuple(mask.shape)} must equal the "
                            f"context shape {tuple(context.shape)}", where="mask",
                            expected=tuple(context.shape), actual=tuple(mask.shape))
    batch = context.shape[0]
    if context.shape[-1] > cfg.context_length:
        context = context[:, -cfg.context_length:]
        mask = mask[:, -cfg.context_length:]

    x, loc_scale = instance_norm(context)
    p, s = cfg.input_patch_size, cfg.input_patch_stride
    patched = patch(x, p, s)  # [batch, n, p]
    patched_mask = jnp.nan_to_num(patch(mask, p, s), nan=0.0)  # [batch, n, p]
    patched = jnp.where(patched_mask > 0.0, patched, 0.0)
    feats = jnp.concatenate([patched, patched_mask], axis=-1)  # [batch, n, 2p]
    valid = jnp.sum(patched_mask, axis=-1) > 0  # [batch, n]: some value observed

    embeds = apply_residual_block(params["input_patch_embedding"], feats, cfg.activation)
    if cfg.use_reg_token:
        reg = jnp.broadcast_to(params["shared"][1], (batch, 1, cfg.t5.d_model))
        embeds = jnp.concatenate([embeds, reg.astype(embeds.dtype)], axis=1)
        valid = jnp.concatenate([valid, jnp.ones((batch, 1), bool)], axis=1)
    hidden = apply_encoder(params["encoder"], embeds, cfg.t5.encoder, mask=padding_mask(valid))
    return {"encoder_last_hidden_state": hidden, "loc_scale": loc_scale,
            "inputs_embeds": embeds, "attention_mask": valid}


def decode(params: dict, enc: dict, cfg: ChronosBoltConfig) -> Array:
    """Decoder half of the forward pass (reference ``ChronosBoltModelForForecasting.decode``):
    one decoder step from ``shared[decoder_start_token_id]`` with cross-attention on the
    encoder output.

    Args:
      params: model parameters.
      enc: what :func:`encode` returns (its ``'encoder_last_hidden_state'`` and
        ``'attention_mask'`` are read).
      cfg: model configuration.

    Returns:
      The decoder state ``[batch, 1, d_model]`` (before the output residual block).
    """
    hidden = enc["encoder_last_hidden_state"]
    start = params["shared"][cfg.t5.decoder_start_token_id]
    y = jnp.broadcast_to(start, (hidden.shape[0], 1, cfg.t5.d_model)).astype(hidden.dtype)
    return apply_decoder(params["decoder"], y, cfg.t5.decoder, enc=hidden,
                         cross_mask=padding_mask(enc["attention_mask"]))


INPUTS = ("context", "mask")


def apply(params: dict, inputs: dict, cfg: ChronosBoltConfig) -> dict:
    """Forward pass of ``ChronosBoltModelForForecasting`` in inference (no ``target``).

    Args:
      params: model parameters.
      inputs: ``{'context': [batch, length] series, NaN where unobserved (only the last
        context_length values are used), 'mask': optional [batch, length] observed mask
        (default ~isnan(context))}``.
      cfg: model configuration.

    Returns:
      ``{'quantile_preds': [batch, n_quantiles, prediction_length]`` (in the series' units),
      ``'loc_scale': (loc, scale)`` each ``[batch, 1]``, ``'encoder_last_hidden_state'``,
      ``'last_hidden_state'``: the decoder state ``[batch, 1, d_model]``}.
    """
    inputs = check_inputs(inputs, INPUTS, "chronos_bolt.apply")
    if "context" not in inputs:
        raise DataError("chronos_bolt.apply: inputs need 'context' [batch, length]",
                        where="inputs", expected="context")
    enc = encode(params, inputs["context"], cfg, mask=inputs.get("mask"))
    hidden = enc["encoder_last_hidden_state"]
    batch = hidden.shape[0]
    dec = decode(params, enc, cfg)  # [batch, 1, d_model]
    out = apply_residual_block(params["output_patch_embedding"], dec, cfg.activation)
    preds = out.reshape(batch, cfg.num_quantiles, cfg.prediction_length).astype(jnp.float32)
    loc, scale = enc["loc_scale"]
    preds = preds * scale[:, :, None] + loc[:, :, None]  # InstanceNorm.inverse
    return {"quantile_preds": preds, "loc_scale": enc["loc_scale"],
            "encoder_last_hidden_state": hidden, "last_hidden_state": dec}


# -- pipeline --------------------------------------------------------------------------------

def _as_batch(context) -> np.ndarray | Array:
    """``[batch, length]`` from a 1-D series, a 2-D batch or a list of 1-D series (left-padded
    with NaN, as ``chronos.utils.left_pad_and_stack_1D``)."""
    if isinstance(context, (list, tuple)):
        series = [np.asarray(c, np.float32) for c in context]
        if any(c.ndim != 1 for c in series):
            raise DataError("chronos_bolt: a list context must hold 1-D series", where="context")
        n = max(len(c) for c in series)
        return np.stack([np.concatenate([np.full(n - len(c), np.nan, np.float32), c])
                         for c in series])
    x = jnp.asarray(context, jnp.float32)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2:
        raise DataError(f"chronos_bolt: context must be 1-D, 2-D or a list of 1-D series, got "
                        f"shape {tuple(x.shape)}", where="context", actual=tuple(x.shape))
    return x


def _fit_context(x: Array, cfg: ChronosBoltConfig) -> Array:
    """Truncate to the last ``context_length`` values, as the pipeline does. With
    ``stride == patch size`` a shorter context is also left-padded with NaN to
    ``context_length``: the padded patches are masked out of attention and the patches of the
    real values keep their right-aligned positions, so the forecast is the same while every
    call (and every step of a long horizon) runs at one static shape."""
    c = cfg.context_length
    if x.shape[-1] > c:
        return x[..., -c:]
    if x.shape[-1] < c and cfg.input_patch_stride == cfg.input_patch_size:
        pad = jnp.full((*x.shape[:-1], c - x.shape[-1]), jnp.nan, x.dtype)
        return jnp.concatenate([pad, x], axis=-1)
    return x


@functools.partial(jax.jit, static_argnames=("cfg", "horizon"))
def _predict(params: dict, context: Array, cfg: ChronosBoltConfig, horizon: int) -> Array:
    p, nq, c = cfg.prediction_length, cfg.num_quantiles, cfg.context_length
    pred = apply(params, {"context": context}, cfg)["quantile_preds"]  # [batch, nq, p]
    preds = [pred]
    steps = math.ceil(max(horizon - p, 0) / p)
    if steps:
        batch = context.shape[0]
        ctx = jnp.repeat(context[:, None, :], nq, axis=1)  # [batch, nq, length]
        levels = jnp.asarray(cfg.quantiles, jnp.float32)
    for _ in range(steps):
        # Each quantile's forecast extends its own copy of the context; the nq * nq forecasts
        # are reduced back to nq empirical quantiles (torch.quantile, linear interpolation).
        ctx = jnp.concatenate([ctx, pred], axis=-1)[..., -c:]
        out = apply(params, {"context": ctx.reshape(batch * nq, ctx.shape[-1])}, cfg)
        samples = out["quantile_preds"].reshape(batch, nq * nq, p)
        pred = jnp.moveaxis(jnp.quantile(samples, levels, axis=1), 0, 1)  # [batch, nq, p]
        preds.append(pred)
    return jnp.concatenate(preds, axis=-1)[..., :horizon]


def predict(params: dict, context, cfg: ChronosBoltConfig, horizon: int | None = None) -> Array:
    """Quantile forecasts as ``ChronosBoltPipeline.predict``.

    A horizon longer than ``prediction_length`` is extended the pipeline's way: every quantile
    of the last block is appended to its own copy of the context, the model forecasts the next
    ``prediction_length`` steps for each copy, and the ``n_quantiles**2`` forecasts are reduced
    to the model's quantile levels by linear interpolation; repeated until the horizon is
    covered, then truncated.

    Args:
      params: model parameters.
      context: a 1-D series, a ``[batch, length]`` array (left-padded with NaN) or a list of
        1-D series.
      cfg: model configuration.
      horizon: number of steps (default ``prediction_length``); static.

    Returns:
      ``float32[batch, n_quantiles, horizon]``.
    """
    horizon = cfg.prediction_length if horizon is None else int(horizon)
    if horizon < 1:
        raise ConfigError(f"chronos_bolt.predict: horizon must be >= 1, got {horizon}",
                          where="horizon", expected=">= 1", actual=horizon)
    x = _fit_context(_as_batch(context), cfg)
    return _predict(params, x, cfg, horizon)


def predict_quantiles(params: dict, context, cfg: ChronosBoltConfig, horizon: int | None = None,
                      quantile_levels=None) -> tuple[Array, Array]:
    """Quantiles and mean as ``ChronosBoltPipeline.predict_quantiles``.

    Levels among the model's training quantiles are selected; otherwise the forecasts, with the
    lowest and highest quantile repeated at both ends, are interpolated linearly on an
    equidistant grid (the reference's ``torch.quantile`` over ``n_quantiles + 2`` values, which
    clamps levels outside the trained range to its ends).

    Args:
      params: model parameters.
      context: see :func:`predict`.
      cfg: model configuration.
      horizon: number of steps (default ``prediction_length``).
      quantile_levels: levels to return (default ``0.1, ..., 0.9``).

    Returns:
      ``(quantiles [batch, horizon, n_levels], mean [batch, horizon])``; the mean is the
      median forecast, as in the reference.
    """
    if quantile_levels is None:
        quantile_levels = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    levels = [float(q) for q in quantile_levels]
    train = list(cfg.quantiles)
    if 0.5 not in train:
        raise ConfigError(f"chronos_bolt.predict_quantiles: the mean is the 0.5 quantile, which "
                          f"the model was not trained on (quantiles={train})",
                          where="quantiles", expected="0.5 among them", actual=train)
    preds = jnp.swapaxes(predict(params, context, cfg, horizon), 1, 2)  # [batch, h, nq]
    if set(levels).issubset(train):
        quantiles = preds[..., [train.index(q) for q in levels]]
    else:
        aug = jnp.concatenate([preds[..., :1], preds, preds[..., -1:]], axis=-1)
        quantiles = jnp.quantile(aug, jnp.asarray(levels, aug.dtype), axis=-1)
        quantiles = jnp.moveaxis(quantiles, 0, -1)  # [batch, h, n_levels]
    return quantiles, preds[..., train.index(0.5)]


def sample_inputs(cfg: ChronosBoltConfig, rng: np.random.Generator, batch: int) -> dict:
    """Real series windows (shipped with aeon) of the model's context length, a few values
    missing (NaN)."""
    series, _ = builtin_series()
    w = windows(series, cfg.context_length, batch, seed=int(rng.integers(1 << 30)))
    w[0, : cfg.context_length // 4] = np.nan  # a shorter, left-padded context
    if batch > 1:
        w[1, rng.integers(0, cfg.context_length, size=3)] = np.nan
    return {"context": jnp.asarray(w, jnp.float32)}


def loss(cfg: ChronosBoltConfig):
    """``loss_fn(params, batch, key)``: Chronos-Bolt's quantile loss on the normalized scale.

    The model instance-normalizes each context; as in the reference training code the pinball
    loss is computed on ``(pred - loc) / scale`` against ``(target - loc) / scale``. ``batch``
    holds ``context [b, length]`` and ``target [b, horizon]``.
    """

    def loss_fn(params, batch, key):
        del key  # no dropout
        out = apply(params, {"context": batch["context"]}, cfg)
        loc, scale = out["loc_scale"]  # [b, 1] each
        pred = (out["quantile_preds"] - loc[:, :, None]) / scale[:, :, None]
        target = (batch["target"] - loc) / scale
        return quantile_loss(pred, target, cfg.quantiles), {}

    return loss_fn


def forecast(params: dict, context, cfg: ChronosBoltConfig) -> Array:
    """``quantile_preds [batch, n_quantiles, prediction_length]`` of one forward pass."""
    return apply(params, {"context": context}, cfg)["quantile_preds"]


# -- Hugging Face mapping (``ChronosBoltModelForForecasting``) ------------------------------

ARCHITECTURE = "ChronosBoltModelForForecasting"
RESIDUAL_BLOCKS = ("input_patch_embedding", "output_patch_embedding")


def hf_key_table(cfg: ChronosBoltConfig) -> list:
    """Every tensor of a ``ChronosBoltModelForForecasting`` checkpoint: the T5 encoder-decoder
    without LM head (a 1- or 2-row ``shared``) plus the two residual blocks, each with
    ``hidden_layer``, ``output_layer`` and ``residual_layer`` ``nn.Linear`` weights and biases.
    """
    rows = t5_model.hf_key_table(cfg.t5, lm_head=False)
    d, ff, p = cfg.t5.d_model, cfg.t5.d_ff, cfg.input_patch_size
    dims = {"input_patch_embedding": (2 * p, ff, d),
            "output_patch_embedding": (d, ff, cfg.num_quantiles * cfg.prediction_length)}
    for block in RESIDUAL_BLOCKS:
        d_in, d_hid, d_out = dims[block]
        for layer, (a, b) in (("hidden_layer", (d_in, d_hid)), ("output_layer", (d_hid, d_out)),
                              ("residual_layer", (d_in, d_out))):
            rows += linear_rows(f"{block}.{layer}", f"{block}/{layer}", a, b, bias=True)
    return rows


def hf_optional_keys(cfg: ChronosBoltConfig) -> dict:
    """Keys the reference model itself ignores: the tied ``embed_tokens`` copies, any
    ``lm_head.weight`` and the unused cross-attention relative bias."""
    return {**t5_model.hf_optional_keys(cfg.t5, lm_head=False), "lm_head.weight": None}


def detect_hf(hf_config: dict) -> bool:
    """A Chronos-Bolt ``config.json``: ``ChronosBoltModelForForecasting`` in ``architectures``,
    or a ``chronos_config`` with the Bolt entries ``input_patch_size`` and ``quantiles``."""
    archs = hf_config.get("architectures") or []
    cc = hf_config.get("chronos_config")
    bolt_cc = isinstance(cc, dict) and "input_patch_size" in cc and "quantiles" in cc
    return ARCHITECTURE in archs or bolt_cc


HF_SPEC = HFSpec(detect=detect_hf,
                 config_from_hf=lambda hf_config, state: ChronosBoltConfig.from_hf_dict(hf_config),
                 config_to_hf=lambda cfg: cfg.to_hf_dict(), key_table=hf_key_table,
                 optional=hf_optional_keys)

FAMILY = register_family(ModelFamily(
    name="chronos_bolt", config_cls=ChronosBoltConfig, init=init, apply=apply,
    sample_inputs=sample_inputs, primary_outputs=("quantile_preds",), loss=loss,
    forecast=forecast, forecast_levels=lambda cfg: tuple(cfg.quantiles),
    batch_from_windows=lambda cfg, context, target: {"context": context, "target": target},
    hf=HF_SPEC))


__all__ = [
    "ChronosBoltConfig", "FAMILY", "apply", "apply_residual_block", "decode", "encode",
    "forecast", "init", "init_residual_block", "instance_norm", "loss", "patch", "predict",
    "predict_quantiles", "sample_inputs",
]
