"""Position-wise MLP: relu / gelu / gelu_tanh / silu, plain or gated (T5 v1.1)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import init_dense, keep_inputs, keep_outputs, linear
from lowrank_jax.nn import execution

Array = jax.Array

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # exact erf form (BERT, ViT)
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # tanh form (T5 v1.1 gated-gelu)
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """What a feed-forward block means; its widths come from its parameters.

    Attributes:
      activation: ``'relu'``, ``'gelu'`` (exact erf), ``'gelu_tanh'`` or ``'silu'``.
      gated: ``act(x @ wi_0) * (x @ wi_1) @ wo`` (Shazeer 2020, T5 v1.1) instead of
        ``act(x @ wi) @ wo``.
      use_bias: :func:`init_mlp` creates biases on every projection.
    """

    activation: str = "relu"
    gated: bool = False
    use_bias: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"MLPConfig: activation must be one of {tuple(ACTIVATIONS)}, "
                f"got {self.activation!r}", where="activation", expected=tuple(ACTIVATIONS),
                actual=self.activation)
        for name in ("gated", "use_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"MLPConfig: {name} must be a bool, got "
                                  f"{getattr(self, name)!r}", where=name)


def init_mlp(key: Array, cfg: MLPConfig, *, d_model: int, d_ff: int,
             d_out: int | None = None) -> dict:
    """Dense MLP weights.

    Args:
      key: PRNG key.
      cfg: MLP configuration.
      d_model: input width.
      d_ff: hidden width.
      d_out: output width (default ``d_model``).

    Returns:
      ``{'wi': [d_model, d_ff], 'wo': [d_ff, d_out]}``, or for ``gated``
      ``{'wi_0', 'wi_1': [d_model, d_ff], 'wo'}`` (T5 v1.1 names), all Dense leaves.
    """
    for name, val in (("d_model", d_model), ("d_ff", d_ff),
                      ("d_out", d_model if d_out is None else d_out)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"init_mlp: {name} must be a positive int, got {val!r}",
                              where=name, expected="int >= 1", actual=val)
    d_out = d_model if d_out is None else d_out
    k0, k1, ko = jax.random.split(key, 3)
    b = cfg.use_bias
    wo = init_dense(ko, d_ff, d_out, bias=b)
    if cfg.gated:
        return {
            "wi_0": init_dense(k0, d_model, d_ff, bias=b),
            "wi_1": init_dense(k1, d_model, d_ff, bias=b),
            "wo": wo,
        }
    return {"wi": init_dense(k0, d_model, d_ff, bias=b), "wo": wo}


def _hidden_width(params: dict) -> int:
    return int(params["wi_0" if "wi_0" in params else "wi"].shape[1])


def _mlp(params: dict, x: Array, cfg: MLPConfig) -> Array:
    act = ACTIVATIONS[cfg.activation]
    if cfg.gated:
        both = execution.shared_input([params["wi_0"], params["wi_1"]], x)  # one product?
        if both is None:
            both = [linear(params["wi_0"], x), linear(params["wi_1"], x)]
        h = act(both[0]) * both[1]  # [..., d_ff]
    else:
        h = act(linear(params["wi"], x))  # [..., d_ff]
    return linear(params["wo"], h)  # [..., d_out]


def apply_mlp(params: dict, x: Array, cfg: MLPConfig) -> Array:
    """``act(x @ wi) @ wo``, or gated ``(act(x @ wi_0) * (x @ wi_1)) @ wo``.

    The hidden width is whatever the leaves have (each layer of a pruned model its own). On
    CPU a large input runs a chunk of tokens at a time
    (:func:`lowrank_jax.nn.execution.token_chunks`), and a gated MLP's two input weights may
    run as one product (:func:`lowrank_jax.nn.execution.shared_input`); same result up to
    float round-off.

    Args:
      params: weight leaves from :func:`init_mlp`.
      x: ``[..., d_model]``.
      cfg: MLP configuration.

    Returns:
      ``[..., d_out]``.
    """
    lead, d_in = x.shape[:-1], x.shape[-1]
    n_tokens = math.prod(lead)
    n = execution.token_chunks(n_tokens, _hidden_width(params), jnp.dtype(x.dtype).itemsize)
    if n is None:
        return _mlp(params, x, cfg)
    size = -(-n_tokens // n)  # tokens per chunk
    n = -(-n_tokens // size)  # no chunk of padding alone
    flat = x.reshape(n_tokens, d_in)
    if n * size > n_tokens:
        flat = jnp.pad(flat, ((0, n * size - n_tokens), (0, 0)))
    out = jax.lax.map(lambda xc: _mlp(params, xc, cfg), flat.reshape(n, size, d_in))
    return out.reshape(n * size, out.shape[-1])[:n_tokens].reshape(*lead, out.shape[-1])


def keep_hidden(params: dict, idx) -> dict:
    """An MLP restricted to the hidden channels ``idx`` (sorted, distinct): the input
    projection(s) keep those outputs (both ``wi_0`` and ``wi_1`` when gated), ``wo`` keeps those
    inputs. Exactly the MLP with the other channels' weights zeroed, since every activation
    here maps 0 to 0. An empty ``idx`` keeps no channel: the MLP then adds ``wo``'s bias alone
    (zeros without one)."""
    out = dict(params)
    for name in ("wi", "wi_0", "wi_1"):
        if name in params:
            out[name] = keep_outputs(params[name], idx)
    out["wo"] = keep_inputs(params["wo"], idx)
    return out


__all__ = ["ACTIVATIONS", "MLPConfig", "apply_mlp", "init_mlp", "keep_hidden"]
