"""LayerNorm, T5-style RMSNorm, and BatchNorm with running statistics (model state)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowrank_jax.errors import ConfigError, ShapeError

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
            raise ConfigError(f"NormConfig: kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ConfigError(f"NormConfig: eps must be a positive float, got {self.eps!r}")

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
        raise ConfigError(f"init_norm: d must be a positive int, got {d!r}")
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
        raise ShapeError(
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


# ---------------------------------------------------------------------------------------------
# BatchNorm: parameters plus model state (running statistics).

@dataclasses.dataclass(frozen=True)
class BatchNormConfig:
    """Batch normalization over every axis but the last (PyTorch ``BatchNorm1d`` on
    ``[batch, features, time]``, i.e. statistics over batch and time).

    Attributes:
      eps: added to the variance inside the square root.
      momentum: running statistics are updated as ``(1 - momentum) * running + momentum *
        batch`` (PyTorch's convention; the running variance uses the unbiased batch variance,
        the normalization the biased one, as PyTorch does).
    """

    eps: float = 1e-5
    momentum: float = 0.1

    def __post_init__(self):
        if not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ConfigError(f"BatchNormConfig: eps must be a positive float, got {self.eps!r}",
                              where="eps")
        if not isinstance(self.momentum, (int, float)) or not 0.0 <= self.momentum <= 1.0:
            raise ConfigError(f"BatchNormConfig: momentum must be in [0, 1], got "
                              f"{self.momentum!r}", where="momentum")


def init_batch_norm(d: int, *, dtype=jnp.float32) -> tuple[dict, dict]:
    """``(params, state)``: ``{'scale': ones, 'bias': zeros}`` and running statistics
    ``{'mean': zeros, 'var': ones}``, each ``[d]``."""
    if not isinstance(d, int) or d < 1:
        raise ConfigError(f"init_batch_norm: d must be a positive int, got {d!r}", where="d")
    return ({"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)},
            {"mean": jnp.zeros((d,), jnp.float32), "var": jnp.ones((d,), jnp.float32)})


def apply_batch_norm(params: dict, x: Array, cfg: BatchNormConfig, *, state: dict,
                     train: bool) -> tuple[Array, dict]:
    """Batch normalization of ``x: [..., d]`` over all leading axes.

    Training (``train=True``): normalize with the batch's mean and biased variance, and return
    updated running statistics. Evaluation: normalize with the running statistics, which are
    returned unchanged.

    Returns:
      ``(y [..., d], new_state)``.
    """
    d = x.shape[-1]
    for name in ("scale", "bias"):
        if tuple(params[name].shape) != (d,):
            raise ShapeError(f"apply_batch_norm: '{name}' must have shape ({d},), got "
                             f"{tuple(params[name].shape)}", where=name, expected=(d,),
                             actual=tuple(params[name].shape))
    xf = x.astype(jnp.float32)
    axes = tuple(range(xf.ndim - 1))
    if train:
        n = 1
        for a in axes:
            n *= xf.shape[a]
        mean = jnp.mean(xf, axis=axes)
        var = jnp.mean(jnp.square(xf - mean), axis=axes)
        unbiased = var * (n / max(n - 1, 1))
        m = cfg.momentum
        new_state = {"mean": (1 - m) * state["mean"] + m * mean,
                     "var": (1 - m) * state["var"] + m * unbiased}
    else:
        mean, var = state["mean"], state["var"]
        new_state = state
    y = (xf - mean) * jax.lax.rsqrt(var + cfg.eps) * params["scale"].astype(jnp.float32)
    y = y + params["bias"].astype(jnp.float32)
    return y.astype(x.dtype), new_state


__all__ = ["BatchNormConfig", "NormConfig", "apply_batch_norm", "apply_norm", "init_batch_norm",
           "init_norm"]
