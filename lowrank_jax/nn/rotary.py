"""Rotary position embeddings ("RoFormer: Enhanced Transformer with Rotary Position Embedding",
arXiv:2104.09864), as Llama-style models apply them.

Channel ``i < w/2`` of every query and key head and channel ``i + w/2`` form a pair that is
rotated by the angle ``position * inv_freq[i]`` (the "rotate half" layout of Hugging Face
Llama, not interleaved pairs). The logit of query position ``p`` and key position ``p'`` then
depends on ``p' - p`` only. The frequencies follow Hugging Face's rope types:

* ``'default'``: ``inv_freq[i] = theta ** (-2 i / w)``;
* ``'linear'``: the default frequencies divided by ``factor`` (position interpolation,
  "Extending Context Window of Large Language Models via Positional Interpolation",
  arXiv:2306.15595);
* ``'llama3'``: Llama 3.1's smooth interpolation (low frequencies divided by ``factor``, high
  ones kept, a linear blend between ``low_freq_factor`` and ``high_freq_factor``).

Frequencies are computed in float32 in the order Hugging Face computes them, so angles agree to
float32 round-off.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError

Array = jax.Array

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (Hugging Face ``rope_parameters``).

    Attributes:
      rope_type: ``'default'``, ``'linear'`` or ``'llama3'``.
      theta: the base wavelength (``rope_theta``).
      factor: ``'linear'`` / ``'llama3'``: the scaling factor.
      low_freq_factor, high_freq_factor, original_max_position_embeddings: ``'llama3'`` only.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"RopeConfig: rope_type must be one of {ROPE_TYPES}, got "
                              f"{self.rope_type!r}", where="rope_type", expected=ROPE_TYPES,
                              actual=self.rope_type)
        for name in ("theta", "factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"RopeConfig: {name} must be a positive number, got {v!r}",
                                  where=name, expected="> 0", actual=v)
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"RopeConfig: llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}", where="high_freq_factor",
                expected=f"> {self.low_freq_factor}", actual=self.high_freq_factor)

    @classmethod
    def from_hf(cls, d: dict, owner: str = "RopeConfig.from_hf") -> "RopeConfig":
        """From a ``config.json`` dict: ``rope_parameters`` (transformers 5) or the older
        ``rope_theta`` and ``rope_scaling`` keys (a ``rope_scaling`` with ``type`` instead of
        ``rope_type`` included). Other rope types are refused."""
        params = d.get("rope_parameters")
        if params is None:
            params = dict(d.get("rope_scaling") or {})
            if "rope_theta" in d:
                params.setdefault("rope_theta", d["rope_theta"])
        params = dict(params)
        if "rope_type" not in params and "type" in params:
            params["rope_type"] = params["type"]
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"{owner}: rope type {rope_type!r} is not supported; supported: "
                              f"{ROPE_TYPES}", where="rope_parameters.rope_type",
                              expected=ROPE_TYPES, actual=rope_type)
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{owner}: partial_rotary_factor "
                              f"{params['partial_rotary_factor']} is not supported (only 1.0)",
                              where="rope_parameters.partial_rotary_factor", expected=1.0,
                              actual=params["partial_rotary_factor"])
        kw = {"rope_type": rope_type, "theta": float(params.get("rope_theta", 10000.0))}
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kw.update(low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]),
                      original_max_position_embeddings=int(
                          params.get("original_max_position_embeddings",
                                     d.get("max_position_embeddings", 8192))))
        return cls(**kw)

    def to_hf(self) -> dict:
        """The ``rope_parameters`` dict (transformers 5 form)."""
        d = {"rope_type": self.rope_type, "rope_theta": float(self.theta)}
        if self.rope_type in ("linear", "llama3"):
            d["factor"] = float(self.factor)
        if self.rope_type == "llama3":
            d.update(low_freq_factor=float(self.low_freq_factor),
                     high_freq_factor=float(self.high_freq_factor),
                     original_max_position_embeddings=int(self.original_max_position_embeddings))
        return d


def inv_frequencies(cfg: RopeConfig, head_dim: int) -> np.ndarray:
    """The ``head_dim / 2`` inverse frequencies (float32), as Hugging Face computes them."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ConfigError(f"inv_frequencies: head_dim must be an even int >= 2, got {head_dim!r}",
                          where="head_dim", expected="even int >= 2", actual=head_dim)
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(cfg.theta), exps)).astype(np.float32)
    if cfg.rope_type == "linear":
        inv = (inv / np.float32(cfg.factor)).astype(np.float32)
    elif cfg.rope_type == "llama3":
        old = cfg.original_max_position_embeddings
        low_wavelen = old / cfg.low_freq_factor
        high_wavelen = old / cfg.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(cfg.factor), inv)
        smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor
                                                          - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(cfg.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rotary_angles(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """``(cos, sin)`` of ``positions [batch, seq]`` times the frequencies, each
    ``[batch, seq, head_dim]`` (the half repeated, as Hugging Face), float32."""
    pos = jnp.asarray(positions).astype(jnp.float32)
    freqs = pos[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [b, s, w/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [b, s, w]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate per-head queries or keys ``x [batch, seq, heads, w]`` by ``cos``/``sin``
    ``[batch, seq, w]`` (:func:`rotary_angles`): ``x cos + rotate_half(x) sin`` with
    ``rotate_half([a, b]) = [-b, a]``. Computed in float32, returned in ``x.dtype``."""
    w = x.shape[-1]
    if cos.shape[-1] != w or w % 2:
        raise ShapeError(f"apply_rotary: head width {w} must be even and equal to the angles' "
                         f"{cos.shape[-1]}", where="x", expected=cos.shape[-1], actual=w)
    xf = x.astype(jnp.float32)
    half = w // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rot * sin[:, :, None, :]
    return out.astype(x.dtype)


__all__ = ["ROPE_TYPES", "RopeConfig", "apply_rotary", "inv_frequencies", "rotary_angles"]
