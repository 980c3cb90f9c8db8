"""A small Chronos-Bolt-style patch encoder: the built-in model of ``lowrank-jax demo``.

Series are instance-normalized, cut into patches of ``patch`` values, embedded by a residual
MLP (the continuous embedding of "Understanding Transformers for Time Series",
Theorem 2: ``W_3 x + W_2 act(W_1 x)``) and run
through a T5-style encoder (RMSNorm, pre-norm, relative position bias, unscaled attention).
It is small and randomly initialized: it exists to show rank structure and compression on a
model whose inputs are real time series, offline. Full Chronos-Bolt lives in a later module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.datasets import builtin_series, windows
from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.leaves import init_dense, linear
from lowrank_jax.models.family import ModelFamily, register_family
from lowrank_jax.nn import (
    AttentionConfig,
    EncoderConfig,
    EncoderLayerConfig,
    LayerSizes,
    MLPConfig,
    NormConfig,
    RelativeBiasConfig,
    apply_encoder,
    init_encoder,
)


@dataclasses.dataclass(frozen=True)
class PatchEncoderConfig:
    patch: int = 16
    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_layers: int = 4
    embed_hidden: int = 256

    def __post_init__(self):
        for f in ("patch", "d_model", "num_heads", "d_ff", "num_layers", "embed_hidden"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"PatchEncoderConfig.{f} must be a positive int, got {v!r}",
                                  where=f, expected="int >= 1", actual=v)
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"PatchEncoderConfig: num_heads={self.num_heads} must divide d_model={self.d_model}"
            )

    @property
    def encoder(self) -> EncoderConfig:
        layer = EncoderLayerConfig(
            attention=AttentionConfig(scaled=False),
            mlp=MLPConfig(activation="relu"),
            norm=NormConfig(kind="rms", eps=1e-6),
            prenorm=True,
        )
        return EncoderConfig(
            layer=layer,
            final_norm=True,
            relative_bias=RelativeBiasConfig(num_buckets=32, max_distance=128),
        )

    @property
    def encoder_sizes(self) -> tuple[LayerSizes, ...]:
        return LayerSizes.uniform(self.num_layers, num_heads=self.num_heads,
                                  d_head=self.d_model // self.num_heads, d_ff=self.d_ff)


def init(key, cfg: PatchEncoderConfig) -> dict:
    """Parameters: ``embed`` (residual MLP) and ``encoder``."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "embed": {
            "hidden": init_dense(k1, cfg.patch, cfg.embed_hidden, bias=True),
            "output": init_dense(k2, cfg.embed_hidden, cfg.d_model, bias=True),
            "residual": init_dense(k3, cfg.patch, cfg.d_model, bias=True),
        },
        "encoder": init_encoder(k4, cfg.encoder, d_model=cfg.d_model, layers=cfg.encoder_sizes),
    }


def patchify(series, cfg: PatchEncoderConfig):
    """Instance-normalize ``[batch, T]`` series and cut them into ``[batch, T // patch, patch]``."""
    series = jnp.asarray(series, jnp.float32)
    if series.ndim != 2 or series.shape[1] % cfg.patch:
        raise DataError(
            f"patchify: expected series [batch, T] with T a multiple of patch={cfg.patch}, "
            f"got shape {tuple(series.shape)}"
        )
    mean = series.mean(axis=1, keepdims=True)
    std = series.std(axis=1, keepdims=True) + 1e-5
    z = (series - mean) / std
    return z.reshape(series.shape[0], -1, cfg.patch)


def embed(params: dict, patches, cfg: PatchEncoderConfig):
    """Residual-MLP patch embedding ``[..., patch] -> [..., d_model]`` (Theorem 2's form)."""
    e = params["embed"]
    h = jax.nn.relu(linear(e["hidden"], patches))
    return linear(e["output"], h) + linear(e["residual"], patches)


def encode(params: dict, series, cfg: PatchEncoderConfig, *, return_hidden: bool = False):
    """Encode ``[batch, T]`` series to ``[batch, T // patch, d_model]`` states.

    With ``return_hidden=True`` also returns the hidden states entering each encoder layer.
    """
    x = embed(params, patchify(series, cfg), cfg)  # [batch, L, d_model]
    return apply_encoder(params["encoder"], x, cfg.encoder, return_hidden=return_hidden)


def apply(params: dict, inputs: dict, cfg: PatchEncoderConfig) -> dict:
    """``{'last_hidden_state': encode(params, inputs['series'], cfg)}``."""
    if not isinstance(inputs, dict) or set(inputs) != {"series"}:
        raise DataError("patch_encoder.apply: inputs must be {'series': [batch, T]}",
                        where="inputs", expected=["series"],
                        actual=sorted(inputs) if isinstance(inputs, dict) else inputs)
    return {"last_hidden_state": encode(params, inputs["series"], cfg)}


def sample_inputs(cfg: PatchEncoderConfig, rng: np.random.Generator, batch: int) -> dict:
    """Windows of real series (shipped with aeon), 8 patches long."""
    series, _ = builtin_series()
    w = windows(series, 8 * cfg.patch, batch, seed=int(rng.integers(1 << 30)))
    return {"series": jnp.asarray(w, jnp.float32)}


FAMILY = register_family(ModelFamily(
    name="patch_encoder", config_cls=PatchEncoderConfig, init=init, apply=apply,
    sample_inputs=sample_inputs, primary_outputs=("last_hidden_state",)))


__all__ = [
    "FAMILY", "PatchEncoderConfig", "apply", "embed", "encode", "init", "patchify",
    "sample_inputs",
]
