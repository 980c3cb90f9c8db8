"""The training state: trainable and frozen parameters, optimizer state, step, key, data position.

``TrainState`` is a ``NamedTuple`` (a pytree without registration, as optax states are). The
parameter tree is split once, here, with :func:`lowrank_jax.partition`: ``params`` holds what
``jax.grad`` sees and ``frozen`` holds the rest (the random weights ``w`` of
:class:`~lowrank_jax.MaskedBinary`, and any non-float array), each with ``None`` in the other's
places. :func:`full_params` rejoins them (design rule 5).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.leaves import combine, partition, trainable_mask

Array = jax.Array


class TrainState(NamedTuple):
    """Everything a train step reads and writes.

    Fields:
      step: ``int32[]`` number of optimizer updates applied so far.
      params: trainable part of the parameter tree (``None`` where frozen).
      frozen: frozen part of the parameter tree (``None`` where trainable).
      opt_state: the optax state of ``params``.
      rng: the PRNG key the step falls back to when it is called without one.
      data_position: ``int32[]`` position of the data sampler, stored for exact resume. The
        train step leaves it unchanged; the training loop sets it
        (``state._replace(data_position=jnp.asarray(p, jnp.int32))``).
    """

    step: Array
    params: Any
    frozen: Any
    opt_state: Any
    rng: Array
    data_position: Array


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def split_params(params: Any) -> tuple[Any, Any]:
    """``(trainable, frozen)``: the leaves' own :func:`~lowrank_jax.trainable_mask`, with every
    non-float array (int tables, boolean masks) also frozen, since ``jax.grad`` rejects them."""
    mask = trainable_mask(params)
    mask = jax.tree_util.tree_map(lambda m, x: bool(m) and _is_float(x), mask, params)
    return partition(params, mask)


def init_train_state(params: Any, optimizer: optax.GradientTransformation, *, key: Array,
                     data_position: int = 0) -> TrainState:
    """Split ``params`` into trainable and frozen parts and initialize the optimizer on the
    trainable part.

    Args:
      params: a full parameter tree (any mix of leaf types and plain arrays).
      optimizer: an optax gradient transformation (e.g. :func:`default_optimizer`).
      key: PRNG key stored as ``state.rng``.
      data_position: initial sampler position.

    Returns:
      A :class:`TrainState` at step 0, holding copies of the arrays of ``params`` (steps
      donate the state's buffers; the caller's tree stays valid).
    """
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise TypeError(
            f"init_train_state: optimizer must be an optax GradientTransformation, got "
            f"{type(optimizer).__name__}"
        )
    # The state owns copies of the arrays: train steps donate the state's buffers, which must
    # not invalidate the caller's ``params``.
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
    trainable, frozen = split_params(params)
    if not jax.tree_util.tree_leaves(trainable):
        raise ValueError("init_train_state: the parameter tree has no trainable float array")
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=trainable,
        frozen=frozen,
        opt_state=optimizer.init(trainable),
        rng=key,
        data_position=jnp.asarray(data_position, jnp.int32),
    )


def full_params(state: TrainState) -> Any:
    """The full parameter tree: ``combine(state.params, state.frozen)``."""
    return combine(state.params, state.frozen)


__all__ = ["TrainState", "full_params", "init_train_state", "split_params"]
