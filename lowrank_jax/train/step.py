"""Train steps: one pure update, compiled with ``jax.jit`` (optionally sharded) or ``jax.pmap``.

A step is ``step(state, batch, key) -> (state, metrics)``:

1. ``step_key = fold_in(key, state.step)``: randomness (dropout, sampling) differs from step to
   step, is reproducible from ``(key, step)`` and is the same key under ``jit`` and ``pmap``.
   With ``key=None`` the step uses ``state.rng``.
2. ``(loss, aux), grads = value_and_grad(loss_fn)`` over the *trainable* part of the tree only:
   the frozen part (``state.frozen``) is rejoined inside the loss, so it never reaches
   ``jax.grad`` nor the optimizer and comes out bit-identical (design rule 5).
3. ``optax`` update of ``state.params`` and ``state.step + 1``.

``loss_fn(params, batch, key) -> (loss, aux)`` receives the full (combined) tree; ``aux`` is a
dict of scalars. The metrics are ``{**aux, 'loss': loss, 'grad_norm': ||grads||_2}``.

Parallelism:

* :func:`make_train_step` with a ``mesh``: data parallel over the mesh's ``batch_axis``; the
  global batch is split on its leading dimension (``P(batch_axis)``), the state is replicated
  (``P()``) and XLA inserts the gradient all-reduce. ``fsdp=True`` shards every array of the
  state with at least ``fsdp_min_size`` elements and a first dimension divisible by the axis
  size along dim 0 (parameters, frozen arrays and the optax moments alike, so each device
  stores ``1/n`` of them); XLA gathers them for the forward pass. Sharded and single-device
  steps compute the same update up to float reduction order.
* :func:`make_pmap_train_step`: the same update under ``jax.pmap`` with gradients averaged by
  ``lax.pmean``, for code bases that still use ``pmap``. The state carries a leading device
  axis (:func:`replicate_for_pmap`).

Mixed precision: ``compute_dtype=jnp.bfloat16`` casts every float array of the parameter tree
(trainable and frozen) to bf16 inside the loss; the master parameters, the gradients (cast back
to float32 by the transpose of the cast) and the optimizer state stay float32. The batch is not
cast (targets keep their precision): under JAX's type promotion a float32 input times a bf16
weight computes in float32, so ``loss_fn`` (or the model) casts the inputs it wants in bf16.

Buffers of the input state are donated (``donate_argnums=(0,)``): do not reuse a state after
passing it to a step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.leaves import combine, path_str
from lowrank_jax.train.state import TrainState

Array = jax.Array
LossFn = Callable[[Any, Any, Array], tuple[Array, dict]]


# ---------------------------------------------------------------------------------------------
# Optimizer.

def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices, factors, embeddings and scores (``ndim >= 2``), not on norm
    scales and biases (the usual AdamW convention)."""
    return jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)


def default_optimizer(learning_rate: float = 1e-3, total_steps: int = 1000,
                      warmup_steps: int = 100,
                      weight_decay: float = 0.01) -> optax.GradientTransformation:
    """AdamW with a linear warmup from 0 and a cosine decay to 0.

    ``lr(t) = learning_rate * t / warmup_steps`` for ``t < warmup_steps``, then
    ``learning_rate * (1 + cos(pi * (t - warmup_steps) / (total_steps - warmup_steps))) / 2``
    (``optax.warmup_cosine_decay_schedule``). Weight decay applies to arrays with
    ``ndim >= 2``. Hyperparameters are injected (``optax.inject_hyperparams``), so the current
    learning rate is readable as ``opt_state.hyperparams['learning_rate']``.

    Args:
      learning_rate: peak learning rate.
      total_steps: length of the schedule, warmup included.
      warmup_steps: linear warmup steps (``0 <= warmup_steps < total_steps``).
      weight_decay: decoupled weight decay coefficient.

    Returns:
      An optax gradient transformation.
    """
    if not learning_rate > 0:
        raise ValueError(f"default_optimizer: learning_rate must be > 0, got {learning_rate}")
    if not (isinstance(total_steps, int) and isinstance(warmup_steps, int)
            and 0 <= warmup_steps < total_steps):
        raise ValueError(
            f"default_optimizer: need integers 0 <= warmup_steps < total_steps, got "
            f"warmup_steps={warmup_steps!r}, total_steps={total_steps!r}"
        )
    if weight_decay < 0:
        raise ValueError(f"default_optimizer: weight_decay must be >= 0, got {weight_decay}")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=total_steps, end_value=0.0)
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=schedule, weight_decay=weight_decay, mask=_decay_mask)


# ---------------------------------------------------------------------------------------------
# Placement helpers.

def _check_mesh(mesh: Any, batch_axis: str, who: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if batch_axis not in mesh.axis_names:
        raise ValueError(
            f"{who}: batch_axis {batch_axis!r} is not an axis of the mesh (axes "
            f"{tuple(mesh.axis_names)}); build it as Mesh(np.array(jax.devices()), "
            f"({batch_axis!r},))"
        )
    return int(mesh.shape[batch_axis])


def _check_batch(batch: Any, n_devices: int, who: str, what: str) -> int:
    """Validate the batch's leading dimension on the host, before anything is traced."""
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise ValueError(f"{who}: the batch has no arrays")
    sizes = {}
    for path, x in flat:
        shape = np.shape(x)
        name = path_str(path) or "<batch>"
        if len(shape) == 0:
            raise ValueError(f"{who}: batch entry {name!r} is a scalar; every batch array "
                             "needs a leading batch dimension")
        sizes[name] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{who}: batch arrays disagree on the batch size: {sizes}")
    size = next(iter(sizes.values()))
    if n_devices > 1 and size % n_devices:
        raise ValueError(
            f"{who}: batch size {size} is not divisible by the {n_devices} devices of {what}; "
            f"use a global batch size that is a multiple of {n_devices} (e.g. "
            f"{max(n_devices, size - size % n_devices)})"
        )
    return size


def shard_batch(batch: Any, mesh: Mesh, batch_axis: str = "data") -> Any:
    """Place a global batch on ``mesh``, split along its leading dimension over ``batch_axis``.

    Raises:
      ValueError: when the batch size is not divisible by the size of ``batch_axis``.
    """
    n = _check_mesh(mesh, batch_axis, "shard_batch")
    _check_batch(batch, n, "shard_batch", f"mesh axis {batch_axis!r}")
    sharding = NamedSharding(mesh, P(batch_axis))
    return jax.tree_util.tree_map(lambda x: _put(x, sharding), batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of ``tree`` on every device of ``mesh`` (``P()``)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"replicate: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    sharding = NamedSharding(mesh, P())
    return jax.tree_util.tree_map(lambda x: _put(x, sharding), tree)


def _put(x: Any, sharding: NamedSharding) -> Any:
    """``device_put`` unless ``x`` already has exactly this sharding: a step's outputs go
    straight back in (their buffers are donated, not copied, and the step does not retrace)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _state_shardings(state: TrainState, mesh: Mesh, batch_axis: str, fsdp: bool,
                     fsdp_min_size: int) -> TrainState:
    """Replicated everywhere; with ``fsdp``, large arrays split along dim 0 over ``batch_axis``.

    The rule looks at shapes only, so a parameter and its optax moments (same shape) always
    get the same sharding. Works on concrete arrays and on tracers (shapes are static).
    """
    n = int(mesh.shape[batch_axis])
    rep = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(batch_axis))

    def spec(x):
        shape = np.shape(x)
        if fsdp and len(shape) >= 1 and int(np.prod(shape)) >= fsdp_min_size \
                and shape[0] % n == 0:
            return split
        return rep

    tmap = jax.tree_util.tree_map
    return TrainState(step=rep, params=tmap(spec, state.params), frozen=tmap(spec, state.frozen),
                      opt_state=tmap(spec, state.opt_state), rng=rep, data_position=rep)


class Replicated:
    """A tree replicated for ``pmap``: its flat arrays, each with a leading device axis, and
    its tree structure.

    The arrays are kept flat because leaf dataclasses check their shapes when rebuilt, and a
    ``Dense`` whose ``w`` is ``[n, d_in, d_out]`` is no valid leaf; inside ``pmap`` every
    device sees the per-device shapes and the tree is rebuilt there. Build with
    :func:`replicate_for_pmap`, read back with :func:`unreplicate`.
    """

    def __init__(self, arrays: Sequence[Array], treedef: Any):
        self.arrays = list(arrays)
        self.treedef = treedef

    def unflatten(self) -> Any:
        """The tree for per-device arrays (inside ``pmap``)."""
        return jax.tree_util.tree_unflatten(self.treedef, self.arrays)

    def __repr__(self) -> str:
        return f"Replicated({len(self.arrays)} arrays, {self.treedef})"


jax.tree_util.register_pytree_node(
    Replicated, lambda r: (r.arrays, r.treedef), lambda treedef, arrays: Replicated(arrays, treedef))


def _pmap_sharding(devices: Sequence[jax.Device], axis_name: str) -> NamedSharding:
    # The layout pmap gives its outputs: one slice of the leading axis per device, on a mesh
    # named after the pmap axis. Inputs placed the same way do not retrace the step.
    return NamedSharding(Mesh(np.array(devices), (axis_name,)), P(axis_name))


def replicate_for_pmap(tree: Any, devices: Sequence[jax.Device] | None = None,
                       axis_name: str = "batch") -> Replicated:
    """Copy every array of ``tree`` to each device for ``pmap`` (leading axis ``len(devices)``).

    Args:
      tree: e.g. a :class:`TrainState`.
      devices: default ``jax.local_devices()``.
      axis_name: the ``axis_name`` of the pmap step (only decides the arrays' sharding).

    Returns:
      A :class:`Replicated` holding the stacked arrays and the structure of ``tree``.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    sharding = _pmap_sharding(devices, axis_name)
    arrays, treedef = jax.tree_util.tree_flatten(tree)

    def rep(x):
        x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.device_put(jnp.broadcast_to(x[None], (n, *x.shape)), sharding)

    return Replicated([rep(x) for x in arrays], treedef)


def unreplicate(tree: Any) -> Any:
    """The first copy of a :class:`Replicated` tree (or of every array of a plain tree whose
    arrays have a leading device axis, such as ``pmap`` outputs)."""
    if isinstance(tree, Replicated):
        return jax.tree_util.tree_unflatten(tree.treedef, [x[0] for x in tree.arrays])
    return jax.tree_util.tree_map(lambda x: x[0], tree)


# ---------------------------------------------------------------------------------------------
# The update.

def _check_compute_dtype(compute_dtype: Any, who: str) -> Any:
    if compute_dtype is None:
        return None
    try:
        dt = jnp.dtype(compute_dtype)
    except TypeError as e:
        raise TypeError(f"{who}: compute_dtype must be a float dtype, got {compute_dtype!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{who}: compute_dtype must be a float dtype, got {dt}")
    return dt


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree_util.tree_map(cast, tree)


def _global_norm(tree: Any) -> Array:
    """``||tree||_2`` over the arrays' leaves (not ``optax.global_norm``: its ``tree_map`` to
    scalars rebuilds leaf dataclasses around 0-d arrays, which their shape checks reject)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree_util.tree_leaves(tree)))


def _make_update(loss_fn: LossFn, optimizer: optax.GradientTransformation, compute_dtype: Any,
                 axis_name: str | None, constrain: Callable[[TrainState], TrainState] | None):
    """The pure ``(state, batch, key) -> (state, metrics)`` shared by the jit and pmap steps."""

    def update(state: TrainState, batch: Any, key: Array | None):
        key = state.rng if key is None else key
        step_key = jax.random.fold_in(key, state.step)

        def objective(trainable):
            params = combine(trainable, state.frozen)
            if compute_dtype is not None:
                params = _cast_floats(params, compute_dtype)
            out = loss_fn(params, batch, step_key)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
                raise TypeError("train step: loss_fn(params, batch, key) must return "
                                "(loss, aux) with aux a dict of scalars (use {} for none)")
            loss, aux = out
            if jnp.shape(loss) != ():
                raise ValueError(f"train step: loss_fn must return a scalar loss, got shape "
                                 f"{jnp.shape(loss)}")
            return jnp.asarray(loss, jnp.float32), aux

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
            loss, aux = jax.lax.pmean((loss, aux), axis_name)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state)
        if constrain is not None:
            new_state = constrain(new_state)
        metrics = {**aux, "loss": loss, "grad_norm": _global_norm(grads)}
        return new_state, metrics

    return update


def _check_state(state: Any, who: str) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"{who}: state must be a TrainState (from init_train_state), got "
                        f"{type(state).__name__}")


def _is_train_state_def(treedef: Any) -> bool:
    try:
        return isinstance(treedef.unflatten([None] * treedef.num_leaves), TrainState)
    except Exception:  # a node type that cannot be rebuilt around None
        return False


def _check_common(loss_fn: Any, optimizer: Any, who: str) -> None:
    if not callable(loss_fn):
        raise TypeError(f"{who}: loss_fn must be callable (params, batch, key) -> (loss, aux)")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"{who}: optimizer must be an optax GradientTransformation, got "
                        f"{type(optimizer).__name__}")


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, batch_axis: str = "data", fsdp: bool = False,
                    fsdp_min_size: int = 2**18, compute_dtype: Any = None,
                    donate: bool = True) -> Callable:
    """A jit-compiled train step, optionally data parallel (and FSDP) over a mesh.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)``; ``params`` is the full tree,
        ``aux`` a dict of scalars.
      optimizer: optax transformation, the one the state was initialized with.
      mesh: ``None``: plain ``jax.jit`` where the inputs live. A mesh: the batch is split over
        ``batch_axis`` and the state replicated (or FSDP-sharded), placed by the step itself.
      batch_axis: mesh axis of the data (and FSDP) split.
      fsdp: shard arrays of at least ``fsdp_min_size`` elements whose first dimension is
        divisible by the size of ``batch_axis`` (parameters and optimizer moments).
      fsdp_min_size: size threshold of ``fsdp``.
      compute_dtype: e.g. ``jnp.bfloat16``: the float parameters are cast to it inside the loss;
        master parameters and optimizer state stay in their dtype.
      donate: donate the input state's buffers.

    Returns:
      ``step(state, batch, key=None) -> (state, metrics)``. The batch size (leading dimension)
      is checked on the host before anything is compiled. ``step.jitted`` is the underlying
      ``jax.jit`` function, called as ``jitted(state._replace(rng=None), state.rng, batch,
      key)`` (the key is not donated); ``step.state_shardings(state)`` gives the placement.
    """
    who = "make_train_step"
    _check_common(loss_fn, optimizer, who)
    compute_dtype = _check_compute_dtype(compute_dtype, who)
    if not (isinstance(fsdp_min_size, int) and fsdp_min_size >= 1):
        raise ValueError(f"{who}: fsdp_min_size must be a positive int, got {fsdp_min_size!r}")
    if mesh is None:
        if fsdp:
            raise ValueError(f"{who}: fsdp=True needs a mesh to shard over")
        n_dev = 1
        constrain = None
    else:
        n_dev = _check_mesh(mesh, batch_axis, who)

        def constrain(state):
            return jax.lax.with_sharding_constraint(
                state, _state_shardings(state, mesh, batch_axis, fsdp, fsdp_min_size))

    update = _make_update(loss_fn, optimizer, compute_dtype, None, constrain)

    def update_kept_rng(state: TrainState, rng: Array, batch: Any, key: Array | None):
        # state.rng travels outside the donated argument: a caller may pass key=state.rng (or
        # a device_put may hand back one buffer for both), and donating a buffer that is also
        # a non-donated argument is an error in XLA (a crash on some backends).
        new_state, metrics = update(state._replace(rng=rng), batch, key)
        return new_state._replace(rng=None), metrics

    jitted = jax.jit(update_kept_rng, donate_argnums=(0,) if donate else ())

    def state_shardings(state: TrainState) -> TrainState | None:
        if mesh is None:
            return None
        return _state_shardings(state, mesh, batch_axis, fsdp, fsdp_min_size)

    def step(state: TrainState, batch: Any, key: Array | None = None):
        _check_state(state, "train step")
        _check_batch(batch, n_dev, "train step",
                     "the mesh" if mesh is None else f"mesh axis {batch_axis!r}")
        if mesh is not None:
            shardings = state_shardings(state)
            state = jax.tree_util.tree_map(_put, state, shardings)
            batch = shard_batch(batch, mesh, batch_axis)
            if key is not None:
                key = _put(key, NamedSharding(mesh, P()))
        rng = state.rng
        key = rng if key is None else key  # same signature either way: no second trace
        new_state, metrics = jitted(state._replace(rng=None), rng, batch, key)
        return new_state._replace(rng=rng), metrics

    step.jitted = jitted
    step.state_shardings = state_shardings
    step.mesh = mesh
    return step


def make_pmap_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                         axis_name: str = "batch", compute_dtype: Any = None,
                         devices: Sequence[jax.Device] | None = None,
                         donate: bool = True) -> Callable:
    """The train step under ``jax.pmap``: the same update, gradients averaged with ``pmean``.

    Each device computes ``loss_fn`` on its ``batch_size / n`` examples; the mean of the
    per-device gradients equals the gradient of the global-batch mean when ``loss_fn`` is an
    unweighted mean over examples (a masked mean weights devices equally instead).

    Args:
      loss_fn, optimizer, compute_dtype, donate: as :func:`make_train_step`.
      axis_name: the ``pmap`` axis name (usable in ``loss_fn`` for collectives).
      devices: default ``jax.local_devices()``.

    Returns:
      ``step(state, batch, key=None) -> (state, metrics)`` where ``state`` is a
      :class:`Replicated` train state (:func:`replicate_for_pmap`; :func:`unreplicate` turns it
      back into a :class:`TrainState`), ``batch`` is the *global* batch
      ``[batch, ...]`` (reshaped here to ``[n, batch / n, ...]`` after the divisibility check)
      and ``metrics`` are the device-averaged scalars. ``step.pmapped`` is the pmapped function.
    """
    who = "make_pmap_train_step"
    _check_common(loss_fn, optimizer, who)
    compute_dtype = _check_compute_dtype(compute_dtype, who)
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    update = _make_update(loss_fn, optimizer, compute_dtype, axis_name, None)

    def flat_update(rep: Replicated, batch: Any, key: Array | None):
        new_state, metrics = update(rep.unflatten(), batch, key)
        arrays, treedef = jax.tree_util.tree_flatten(new_state)
        return Replicated(arrays, treedef), metrics

    sharding = _pmap_sharding(devices, axis_name)
    pmapped = jax.pmap(flat_update, axis_name=axis_name, in_axes=(0, 0, None), devices=devices,
                       donate_argnums=(0,) if donate else ())

    def step(state: Replicated, batch: Any, key: Array | None = None):
        if not isinstance(state, Replicated):
            raise TypeError(f"pmap train step: state must be replicate_for_pmap(state), got "
                            f"{type(state).__name__}")
        if not _is_train_state_def(state.treedef):
            raise TypeError("pmap train step: the replicated tree must be a TrainState "
                            "(from init_train_state)")
        lead = {np.shape(x)[:1] for x in state.arrays}
        if lead != {(n,)}:
            raise ValueError(
                f"pmap train step: the state must carry a leading axis of {n} devices (found "
                f"leading dims {sorted(lead)}); use replicate_for_pmap(state)"
            )
        size = _check_batch(batch, n, "pmap train step", f"{n} local devices")
        state = Replicated([_put(x, sharding) for x in state.arrays], state.treedef)

        def split(x):
            shape = (n, size // n, *np.shape(x)[1:])
            return np.reshape(x, shape) if isinstance(x, np.ndarray) else jnp.reshape(x, shape)

        new_state, metrics = pmapped(state, jax.tree_util.tree_map(split, batch), key)
        return new_state, unreplicate(metrics)

    step.pmapped = pmapped
    return step


__all__ = [
    "Replicated", "default_optimizer", "make_pmap_train_step", "make_train_step", "replicate",
    "replicate_for_pmap", "shard_batch", "unreplicate",
]
