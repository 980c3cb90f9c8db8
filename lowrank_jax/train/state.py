"""The training state: trainable and frozen parameters, optimizer state, model state, step, key
and data position.

``TrainState`` is a ``NamedTuple`` (a pytree without registration, as optax states are). The
parameter tree is split once, here, with :func:`lowrank_jax.leaves.partition`: ``params`` holds
what ``jax.grad`` sees and ``frozen`` holds the rest (the random weights ``w`` of
:class:`~lowrank_jax.leaves.MaskedBinary`, the signs of a
:class:`~lowrank_jax.leaves.FrozenBinary`, and any non-float array), each with ``None`` in the
other's places. :func:`full_params` rejoins them. Model state beside the parameters (BatchNorm
running statistics) is a third tree, ``model_state``: the train step replaces it with what the
loss returns and never differentiates it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.errors import ConfigError
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
      model_state: model state beside the parameters (BatchNorm running statistics, ...), or
        ``None`` for stateless models. A stateful train step stores the state its loss returns.
    """

    step: Array
    params: Any
    frozen: Any
    opt_state: Any
    rng: Array
    data_position: Array
    model_state: Any = None


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def split_params(params: Any) -> tuple[Any, Any]:
    """Split a parameter tree into what is trained and what is frozen.

    Args:
      params: a full parameter tree.

    Returns:
      ``(trainable, frozen)`` as :func:`lowrank_jax.leaves.partition`, with the leaves' own
      :func:`~lowrank_jax.leaves.trainable_mask` and every non-float array (int tables, boolean
      masks) also frozen, since ``jax.grad`` rejects them.
    """
    mask = trainable_mask(params)
    mask = jax.tree_util.tree_map(lambda m, x: bool(m) and _is_float(x), mask, params)
    return partition(params, mask)


def check_optimizer(optimizer: Any, who: str) -> optax.GradientTransformation:
    """``optimizer`` if it is an optax transformation, else a
    :class:`~lowrank_jax.errors.ConfigError`.

    Args:
      optimizer: the object to check.
      who: the caller's name, for the message.

    Returns:
      ``optimizer``.
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(
            f"{who}: optimizer must be an optax GradientTransformation (e.g. optax.adamw(...) "
            f"or default_optimizer()), got {type(optimizer).__name__}", where="optimizer",
            expected="optax.GradientTransformation", actual=type(optimizer).__name__)
    return optimizer


def init_train_state(params: Any, optimizer: optax.GradientTransformation, *, key: Array,
                     data_position: int = 0, model_state: Any = None) -> TrainState:
    """Split ``params`` into trainable and frozen parts and initialize the optimizer on the
    trainable part.

    Args:
      params: a full parameter tree (any mix of leaf types and plain arrays).
      optimizer: an optax gradient transformation (e.g.
        :func:`~lowrank_jax.train.default_optimizer`).
      key: PRNG key stored as ``state.rng``.
      data_position: initial sampler position.
      model_state: the model's state beside its parameters (e.g. the running statistics from
        :func:`lowrank_jax.nn.init_batch_norm`), or ``None`` for a stateless model.

    Returns:
      A :class:`TrainState` at step 0, holding copies of the arrays of ``params`` and
      ``model_state`` (steps donate the state's buffers; the caller's trees stay valid).

    Raises:
      ConfigError: ``optimizer`` is not an optax transformation, or ``params`` holds no
        trainable float array.
    """
    check_optimizer(optimizer, "init_train_state")
    # The state owns copies of the arrays: train steps donate the state's buffers, which must
    # not invalidate the caller's trees.
    copy = lambda t: jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    params = copy(params)
    trainable, frozen = split_params(params)
    if not jax.tree_util.tree_leaves(trainable):
        raise ConfigError("init_train_state: the parameter tree has no trainable float array",
                          where="params", expected="at least one trainable float array",
                          actual="none")
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=trainable,
        frozen=frozen,
        opt_state=optimizer.init(trainable),
        rng=key,
        data_position=jnp.asarray(data_position, jnp.int32),
        model_state=None if model_state is None else copy(model_state),
    )


def full_params(state: TrainState) -> Any:
    """The full parameter tree of a train state.

    Args:
      state: a :class:`TrainState`.

    Returns:
      ``combine(state.params, state.frozen)``.
    """
    return combine(state.params, state.frozen)


__all__ = ["TrainState", "check_optimizer", "full_params", "init_train_state", "split_params"]
