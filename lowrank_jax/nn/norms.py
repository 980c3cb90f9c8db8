"""LayerNorm and T5-style RMSNorm."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array

_KINDS = ("layer", "rms")


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Normalization over the last axis.

    Attributes:
      kind: ``'layer'`` (LayerNorm, Ba et al. 2016) or ``'rms'`` (T5's RMSNorm, Zhang &
        Sennrich 2019).
      eps: added to the variance (mean square) inside the square root.
      use_bias: LayerNorm only: learn an additive bias. RMSNorm never has one (as T5), so it
        ignores this field.
    """

    kind: str = "layer"
    eps: float = 1e-6
    use_bias: bool = True

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"NormConfig: kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"NormConfig: eps must be a positive float, got {self.eps!r}")

    @property
    def has_bias(self) -> bool:
        """Whether :func:`init_norm` creates a ``'bias'``."""
        return self.kind == "layer" and self.use_bias


def init_norm(d: int, cfg: NormConfig, *, dtype=jnp.float32) -> dict:
    """Identity-initialized norm parameters (no key needed).

    Args:
      d: normalized width.
      cfg: norm configuration.

    Returns:
      ``{'scale': ones[d]}`` plus ``'bias': zeros[d]`` for a LayerNorm with bias.
    """
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"init_norm: d must be a positive int, got {d!r}")
    params = {"scale": jnp.ones((d,), dtype)}
    if cfg.has_bias:
        params["bias"] = jnp.zeros((d,), dtype)
    return params


def apply_norm(params: dict, x: Array, cfg: NormConfig) -> Array:
    """Normalize ``x`` over its last axis (statistics in float32, output in ``x.dtype``).

    LayerNorm: ``(x - mean) / sqrt(var + eps) * scale (+ bias)``, biased variance.
    RMSNorm (T5 ``T5LayerNorm``): ``x * rsqrt(mean(x^2) + eps) * scale``: no mean subtraction,
    no bias.

    Args:
      params: ``{'scale'}`` and optionally ``{'bias'}``, each ``[d]``.
      x: ``[..., d]``.
      cfg: norm configuration.

    Returns:
      ``[..., d]``.
    """
    d = x.shape[-1]
    if tuple(params["scale"].shape) != (d,):
        raise ValueError(
            f"apply_norm: 'scale' must have shape ({d},) to match x {tuple(x.shape)}, "
            f"got {tuple(params['scale'].shape)}"
        )
    xf = x.astype(jnp.float32)  # [..., d]
    if cfg.kind == "rms":
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)  # [..., 1]
        y = xf * jax.lax.rsqrt(var + cfg.eps) * params["scale"].astype(jnp.float32)
    else:
        mean = jnp.mean(xf, axis=-1, keepdims=True)  # [..., 1]
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)  # [..., 1]
        y = (xf - mean) * jax.lax.rsqrt(var + cfg.eps) * params["scale"].astype(jnp.float32)
        if cfg.has_bias:
            y = y + params["bias"].astype(jnp.float32)
    return y.astype(x.dtype)
