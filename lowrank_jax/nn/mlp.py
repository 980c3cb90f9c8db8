"""Position-wise MLP: relu / gelu / gelu_tanh / silu, plain or gated (T5 v1.1)."""

from __future__ import annotations

import dataclasses

import jax

from lowrank_jax.leaves import init_dense, linear

Array = jax.Array

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # exact erf form (BERT, ViT)
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # tanh form (T5 v1.1 gated-gelu)
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Feed-forward block.

    Attributes:
      d_model: input and output width.
      d_ff: hidden width.
      activation: ``'relu'``, ``'gelu'`` (exact erf), ``'gelu_tanh'`` or ``'silu'``.
      gated: ``act(x @ wi_0) * (x @ wi_1) @ wo`` (Shazeer 2020, T5 v1.1) instead of
        ``act(x @ wi) @ wo``.
      use_bias: biases on every projection.
    """

    d_model: int
    d_ff: int
    activation: str = "relu"
    gated: bool = False
    use_bias: bool = False

    def __post_init__(self):
        for name in ("d_model", "d_ff"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"MLPConfig: {name} must be a positive int, got {val!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MLPConfig: activation must be one of {tuple(ACTIVATIONS)}, "
                f"got {self.activation!r}"
            )


def init_mlp(key: Array, cfg: MLPConfig) -> dict:
    """Dense MLP weights.

    Args:
      key: PRNG key.
      cfg: MLP configuration.

    Returns:
      ``{'wi': [d_model, d_ff], 'wo': [d_ff, d_model]}``, or for ``gated``
      ``{'wi_0', 'wi_1': [d_model, d_ff], 'wo'}`` (T5 v1.1 names), all Dense leaves.
    """
    k0, k1, ko = jax.random.split(key, 3)
    b = cfg.use_bias
    wo = init_dense(ko, cfg.d_ff, cfg.d_model, bias=b)
    if cfg.gated:
        return {
            "wi_0": init_dense(k0, cfg.d_model, cfg.d_ff, bias=b),
            "wi_1": init_dense(k1, cfg.d_model, cfg.d_ff, bias=b),
            "wo": wo,
        }
    return {"wi": init_dense(k0, cfg.d_model, cfg.d_ff, bias=b), "wo": wo}


def apply_mlp(params: dict, x: Array, cfg: MLPConfig) -> Array:
    """``act(x @ wi) @ wo``, or gated ``(act(x @ wi_0) * (x @ wi_1)) @ wo``.

    Args:
      params: weight leaves from :func:`init_mlp`.
      x: ``[..., d_model]``.
      cfg: MLP configuration.

    Returns:
      ``[..., d_model]``.
    """
    act = ACTIVATIONS[cfg.activation]
    if cfg.gated:
        h = act(linear(params["wi_0"], x)) * linear(params["wi_1"], x)  # [..., d_ff]
    else:
        h = act(linear(params["wi"], x))  # [..., d_ff]
    return linear(params["wo"], h)  # [..., d_model]
