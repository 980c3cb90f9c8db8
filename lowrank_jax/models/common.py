"""Helpers shared by the model modules: input checks and per-layer sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError

Array = jax.Array


def layer_sizes(given, default: tuple, name: str, expected_len: int) -> tuple:
    """``given`` per-layer :class:`~lowrank_jax.nn.LayerSizes` (one per layer), or ``default``
    when ``None``."""
    if given is None:
        return default
    given = tuple(given)
    if len(given) != expected_len:
        raise ConfigError(f"{name} must give one LayerSizes per layer ({expected_len}), got "
                          f"{len(given)}", where=name, expected=expected_len, actual=len(given))
    return given


def check_inputs(inputs, allowed: tuple[str, ...], owner: str) -> dict:
    """``inputs`` as a dict whose keys are among ``allowed`` (a clear error otherwise)."""
    if not isinstance(inputs, dict):
        raise DataError(f"{owner}: inputs must be a dict of arrays named as in the PyTorch "
                        f"forward ({', '.join(allowed)}), got {type(inputs).__name__}",
                        where="inputs", expected="dict", actual=type(inputs).__name__)
    unknown = sorted(set(inputs) - set(allowed))
    if unknown:
        raise DataError(f"{owner}: unknown inputs {unknown}; expected some of {list(allowed)}",
                        where="inputs", expected=list(allowed), actual=unknown)
    return inputs


def check_token_ids(ids, vocab_size: int, name: str, owner: str) -> Array:
    """Integer ``[batch, seq]`` ids inside the vocabulary (checked when the values are known,
    i.e. outside ``jit``; inside it an out-of-range id would read NaN)."""
    ids = jnp.asarray(ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise DataError(
            f"{owner}: {name} must be an integer array [batch, seq], got shape "
            f"{tuple(ids.shape)} and dtype {ids.dtype}", where=name,
            expected="int[batch, seq]", actual=f"{ids.dtype}{list(ids.shape)}")
    if not isinstance(ids, jax.core.Tracer) and ids.size:
        host = np.asarray(ids)  # NumPy: no traced ops, even when called under jit on a constant
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= vocab_size:
            raise DataError(f"{owner}: {name} must lie in [0, vocab_size={vocab_size}), got ids "
                            f"in [{lo}, {hi}]", where=name, expected=f"[0, {vocab_size})",
                            actual=(lo, hi))
    return ids



__all__ = ["check_inputs", "check_token_ids", "layer_sizes"]
