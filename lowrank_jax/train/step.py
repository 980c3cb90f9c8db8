"""Train steps: one pure update, compiled with ``jax.jit`` (optionally sharded) or ``jax.pmap``.

A step is ``step(state, batch, key=None) -> (state, metrics)``:

1. ``step_key = fold_in(key, state.step)``: randomness (dropout, sampling) differs from step to
   step, is reproducible from ``(key, step)`` and is the same key under ``jit`` and ``pmap``.
   With ``key=None`` the step uses ``state.rng``.
2. ``(loss, aux), grads = value_and_grad(loss_fn)`` over the *trainable* part of the tree only:
   the frozen part (``state.frozen``) is rejoined inside the loss, so it never reaches
   ``jax.grad`` nor the optimizer and comes out bit-identical.
3. ``optax`` update of ``state.params`` and ``state.step + 1``.

Two loss contracts:

* stateless (default): ``loss_fn(params, batch, key) -> (loss, aux)``;
* ``stateful=True``: ``loss_fn(params, model_state, batch, key) -> (loss, aux,
  new_model_state)``. The step stores ``new_model_state`` in ``state.model_state`` (BatchNorm
  running statistics, ...); no gradient flows into it. It must have the structure of the state
  it was given; its arrays are cast back to the dtypes of that state (so a ``bfloat16`` forward
  does not change the state's dtypes).

``params`` is the full (combined) tree; ``aux`` is a dict of scalars. The metrics are
``{**aux, 'loss': loss, 'grad_norm': ||grads||_2}``.

Placement is decided by the leaves, not guessed from shapes here. :func:`make_train_step` with a
``mesh`` places the state with :func:`lowrank_jax.leaves.partition_specs`: every leaf names the
dimensions of its arrays (``'in'``, ``'out'``, ``'rank'``, ``'heads'``, ...), ``axis_rules``
maps names to mesh axes (tensor parallelism: ``{'out': 'model'}`` splits every projection's
output features over the ``'model'`` axis), and ``fsdp=True`` also splits every array of at
least ``fsdp_min_size`` entries along its first unplaced dimension over the batch axis.
Parameters, frozen arrays, the model state and the optimizer moments (optax's ``mu``/``nu``
have the parameters' structure, leaf dataclasses included) all get their leaves' placement.
The global batch is split on its leading dimension over ``batch_axis`` (replicated over the
other mesh axes); XLA inserts the collectives. Sharded and single-device steps compute the same
update up to float reduction order.

Multi-process (``jax.distributed``, one mesh over the devices of every process): every process
calls the step with its own part of the global batch (:func:`shard_batch`), and with the same
initial state, which each process places on its own devices' shards.

:func:`make_pmap_train_step` is the same update under ``jax.pmap`` with gradients averaged by
``lax.pmean``, for code bases that still use ``pmap``; its state carries a leading device axis
(:func:`replicate_for_pmap`). Its model state is averaged over devices with ``pmean`` after
every step (floating arrays; integer arrays such as counters are kept from each device, which
must agree): each device computes, for example, BatchNorm statistics of its own shard of the
batch, and the running statistics are the mean of the per-device updates. That equals the
single-device update for running means of equal-sized shards, not for running variances (the
spread between the device means is missing), as with PyTorch's ``DistributedDataParallel``
without ``SyncBatchNorm``. The jit step computes statistics over the global batch.

Mixed precision: ``compute_dtype=jnp.bfloat16`` casts every float array of the parameter tree
(trainable and frozen) to bf16 inside the loss; the master parameters, the gradients (cast back
to float32 by the transpose of the cast) and the optimizer state stay float32. The batch is not
cast (targets keep their precision): under JAX's type promotion a float32 input times a bf16
weight computes in float32, so ``loss_fn`` (or the model) casts the inputs it wants in bf16.

Buffers of the input state are donated (``donate=True``): do not reuse a state after passing it
to a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import combine, partition_specs, path_str
from lowrank_jax.train.state import TrainState, check_optimizer

Array = jax.Array
LossFn = Callable[..., tuple]


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

    Raises:
      ConfigError: a hyperparameter is out of range.
    """
    who = "default_optimizer"
    if not learning_rate > 0:
        raise ConfigError(f"{who}: learning_rate must be > 0, got {learning_rate}",
                          where="learning_rate", expected="> 0", actual=learning_rate)
    if not (isinstance(total_steps, int) and isinstance(warmup_steps, int)
            and 0 <= warmup_steps < total_steps):
        raise ConfigError(
            f"{who}: need integers 0 <= warmup_steps < total_steps, got "
            f"warmup_steps={warmup_steps!r}, total_steps={total_steps!r}", where="warmup_steps",
            expected="0 <= warmup_steps < total_steps", actual=(warmup_steps, total_steps))
    if weight_decay < 0:
        raise ConfigError(f"{who}: weight_decay must be >= 0, got {weight_decay}",
                          where="weight_decay", expected=">= 0", actual=weight_decay)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=total_steps, end_value=0.0)
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=schedule, weight_decay=weight_decay, mask=_decay_mask)


# ---------------------------------------------------------------------------------------------
# Placement helpers.

def _check_mesh(mesh: Any, batch_axis: str, who: str) -> int:
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}",
                          where="mesh", expected="jax.sharding.Mesh", actual=type(mesh).__name__)
    if batch_axis not in mesh.axis_names:
        raise ConfigError(
            f"{who}: batch_axis {batch_axis!r} is not an axis of the mesh (axes "
            f"{tuple(mesh.axis_names)}); build it as Mesh(np.array(jax.devices()), "
            f"({batch_axis!r},)) or pass batch_axis=", where="batch_axis",
            expected=tuple(mesh.axis_names), actual=batch_axis)
    return int(mesh.shape[batch_axis])


def _check_batch(batch: Any, n_devices: int, who: str, what: str) -> int:
    """Validate the batch's leading dimension on the host, before anything is traced."""
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise ShapeError(f"{who}: the batch has no arrays", where="batch")
    sizes = {}
    for path, x in flat:
        shape = np.shape(x)
        name = path_str(path) or "<batch>"
        if len(shape) == 0:
            raise ShapeError(f"{who}: batch entry {name!r} is a scalar; every batch array "
                             "needs a leading batch dimension", where=name,
                             expected="[batch, ...]", actual=())
        sizes[name] = shape[0]
    if len(set(sizes.values())) > 1:
        raise ShapeError(f"{who}: batch arrays disagree on the batch size: {sizes}",
                         where="batch", expected="one batch size", actual=sizes)
    size = next(iter(sizes.values()))
    if n_devices > 1 and size % n_devices:
        raise ShapeError(
            f"{who}: batch size {size} is not divisible by the {n_devices} devices of {what}; "
            f"use a global batch size that is a multiple of {n_devices} (e.g. "
            f"{max(n_devices, size - size % n_devices)})", where="batch",
            expected=f"a multiple of {n_devices}", actual=size)
    return size


def _put(x: Any, sharding: Any) -> Any:
    """``device_put`` unless ``x`` already lies as ``sharding`` says: a step's outputs go
    straight back in (their buffers are donated, not copied, and the step does not retrace).

    Over a mesh that spans several processes, a value this process holds whole (a NumPy
    array, or a ``jax.Array`` on its own devices) is taken to be the same value in every
    process (the state of a run initialised from the same key): each process fills its own
    devices' shards from it.
    """
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _multiprocess(mesh: Mesh) -> bool:
    """Whether ``mesh`` spans devices of more than one process."""
    return len({d.process_index for d in mesh.devices.flat}) > 1


def _batch_devices(mesh: Mesh, batch_axis: str) -> int:
    """How many parts of the batch this process feeds: the number of distinct positions along
    ``batch_axis`` held by its devices (all of them when the mesh is in one process)."""
    if not _multiprocess(mesh):
        return int(mesh.shape[batch_axis])
    axis = mesh.axis_names.index(batch_axis)
    me = jax.process_index()
    local = {idx[axis] for idx, d in np.ndenumerate(mesh.devices) if d.process_index == me}
    return len(local)


def shard_batch(batch: Any, mesh: Mesh, batch_axis: str = "data") -> Any:
    """Place a global batch on ``mesh``, split along its leading dimension over ``batch_axis``
    (replicated over the mesh's other axes).

    When ``mesh`` spans several processes (``jax.distributed``), ``batch`` is this process's
    part of the global batch (its rows, in process order, e.g. from
    :class:`~lowrank_jax.train.ProcessPart`); the global array is assembled with
    ``jax.make_array_from_process_local_data``. Arrays that are already global pass through.

    Args:
      batch: a pytree of arrays ``[batch, ...]`` (process-local over a multi-process mesh).
      mesh: the device mesh.
      batch_axis: the mesh axis of the data split.

    Returns:
      The batch as ``jax.Array`` s sharded ``P(batch_axis)``.

    Raises:
      ShapeError: the batch size is not divisible by the size of ``batch_axis`` (over a
        multi-process mesh: by the number of positions along it that this process holds).
      ConfigError: ``batch_axis`` is not an axis of ``mesh``.
    """
    _check_mesh(mesh, batch_axis, "shard_batch")
    n = _batch_devices(mesh, batch_axis)
    _check_batch(batch, n, "shard_batch", f"mesh axis {batch_axis!r}"
                 + (" held by this process" if _multiprocess(mesh) else ""))
    sharding = NamedSharding(mesh, P(batch_axis))
    if not _multiprocess(mesh):
        return jax.tree_util.tree_map(lambda x: _put(x, sharding), batch)

    def assemble(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return _put(x, sharding)  # already global
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map(assemble, batch)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every array of ``tree`` on every device of ``mesh``.

    Args:
      tree: any pytree of arrays.
      mesh: the device mesh.

    Returns:
      The tree with every array replicated (``P()``).
    """
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"replicate: mesh must be a jax.sharding.Mesh, got "
                          f"{type(mesh).__name__}", where="mesh", actual=type(mesh).__name__)
    sharding = NamedSharding(mesh, P())
    return jax.tree_util.tree_map(lambda x: _put(x, sharding), tree)


def _pmap_sharding(devices: Sequence[jax.Device], axis_name: str) -> NamedSharding:
    # The layout pmap gives its outputs: one slice of the leading axis per device. Inputs
    # placed the same way do not retrace the step.
    return NamedSharding(Mesh(np.array(devices), (axis_name,)), P(axis_name))


def replicate_for_pmap(tree: Any, devices: Sequence[jax.Device] | None = None,
                       axis_name: str = "batch") -> Any:
    """Copy every array of ``tree`` to each device for ``pmap``.

    Leaf dataclasses are rebuilt around the stacked arrays as they are (rebuilding a node skips
    its construction checks), so a :class:`TrainState` stays a ``TrainState`` whose arrays
    carry a leading device axis.

    Args:
      tree: e.g. a :class:`TrainState`.
      devices: default ``jax.local_devices()``.
      axis_name: the ``axis_name`` of the pmap step (only decides the arrays' sharding).

    Returns:
      ``tree`` with every array ``x`` replaced by ``[len(devices), *x.shape]`` copies, one per
      device.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    sharding = _pmap_sharding(devices, axis_name)

    def rep(x):
        x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.device_put(jnp.broadcast_to(x[None], (n, *x.shape)), sharding)

    return jax.tree_util.tree_map(rep, tree)


def unreplicate(tree: Any) -> Any:
    """The first copy of a tree whose arrays carry a leading device axis (``pmap`` states and
    outputs).

    Args:
      tree: e.g. the state returned by a pmap step.

    Returns:
      ``tree`` with every array ``x`` replaced by ``x[0]``.
    """
    return jax.tree_util.tree_map(lambda x: x[0], tree)


# ---------------------------------------------------------------------------------------------
# The update.

def _check_compute_dtype(compute_dtype: Any, who: str) -> Any:
    if compute_dtype is None:
        return None
    try:
        dt = jnp.dtype(compute_dtype)
    except TypeError as e:
        raise ConfigError(f"{who}: compute_dtype must be a float dtype, got {compute_dtype!r}",
                          where="compute_dtype", expected="a float dtype",
                          actual=compute_dtype) from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ConfigError(f"{who}: compute_dtype must be a float dtype, got {dt}",
                          where="compute_dtype", expected="a float dtype", actual=str(dt))
    return dt


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree_util.tree_map(cast, tree)


def _restore_dtypes(new: Any, old: Any) -> Any:
    """``new`` cast to the dtypes of ``old`` (same structure, else a ShapeError)."""
    new_def, old_def = jax.tree_util.tree_structure(new), jax.tree_util.tree_structure(old)
    if new_def != old_def:
        raise ShapeError(
            "stateful train step: loss_fn must return a model state with the structure of the "
            f"one it received: got {new_def}, expected {old_def}", where="model_state",
            expected=str(old_def), actual=str(new_def))
    return jax.tree_util.tree_map(lambda n, o: jnp.asarray(n).astype(jnp.result_type(o)), new, old)


def _pmean_floats(tree: Any, axis_name: str) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        tree)


def _make_update(loss_fn: LossFn, optimizer: optax.GradientTransformation, compute_dtype: Any,
                 axis_name: str | None, constrain: Callable[[TrainState], TrainState] | None,
                 stateful: bool):
    """The pure ``(state, batch, key) -> (state, metrics)`` shared by the jit and pmap steps."""
    contract = ("loss_fn(params, model_state, batch, key) must return (loss, aux, "
                "new_model_state)" if stateful else
                "loss_fn(params, batch, key) must return (loss, aux)")

    def update(state: TrainState, batch: Any, key: Array | None):
        key = state.rng if key is None else key
        step_key = jax.random.fold_in(key, state.step)

        def objective(trainable):
            params = combine(trainable, state.frozen)
            if compute_dtype is not None:
                params = _cast_floats(params, compute_dtype)
            if stateful:
                out = loss_fn(params, state.model_state, batch, step_key)
                ok = isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], dict)
            else:
                out = loss_fn(params, batch, step_key)
                ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)
            if not ok:
                raise ConfigError(f"train step: {contract}, with aux a dict of scalars (use {{}} "
                                  "for none)", where="loss_fn", expected=contract,
                                  actual=type(out).__name__)
            loss, aux = out[0], out[1]
            # the new model state is an output, not a parameter: no gradient flows into it
            model_state = jax.lax.stop_gradient(_restore_dtypes(out[2], state.model_state)) \
                if stateful else state.model_state
            if jnp.shape(loss) != ():
                raise ShapeError(f"train step: loss_fn must return a scalar loss, got shape "
                                 f"{jnp.shape(loss)}", where="loss", expected=(),
                                 actual=jnp.shape(loss))
            return jnp.asarray(loss, jnp.float32), (aux, model_state)

        (loss, (aux, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(
            state.params)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
            loss, aux = jax.lax.pmean((loss, aux), axis_name)
            if stateful:
                model_state = _pmean_floats(model_state, axis_name)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                                   model_state=model_state)
        if constrain is not None:
            new_state = constrain(new_state)
        metrics = {**aux, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return new_state, metrics

    return update


def _check_state(state: Any, stateful: bool, who: str) -> None:
    if not isinstance(state, TrainState):
        raise ConfigError(f"{who}: state must be a TrainState (from init_train_state), got "
                          f"{type(state).__name__}", where="state", expected="TrainState",
                          actual=type(state).__name__)
    if stateful and state.model_state is None:
        raise ConfigError(
            f"{who}: the step was made with stateful=True but state.model_state is None; pass "
            "the model's state to init_train_state(..., model_state=...)", where="model_state",
            expected="a model state", actual=None)
    if not stateful and state.model_state is not None:
        raise ConfigError(
            f"{who}: the state holds a model_state but the step was made without stateful=True, "
            "so it would never be updated; make the step with stateful=True and a loss "
            "loss_fn(params, model_state, batch, key) -> (loss, aux, new_model_state)",
            where="model_state", expected=None, actual="a model state")


def _check_common(loss_fn: Any, optimizer: Any, stateful: Any, who: str) -> None:
    if not callable(loss_fn):
        raise ConfigError(f"{who}: loss_fn must be callable", where="loss_fn",
                          expected="a callable", actual=type(loss_fn).__name__)
    check_optimizer(optimizer, who)
    if not isinstance(stateful, bool):
        raise ConfigError(f"{who}: stateful must be True or False, got {stateful!r}",
                          where="stateful", expected="bool", actual=stateful)


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """A jit-compiled train step (built by :func:`make_train_step`).

    Call it as ``step(state, batch, key=None) -> (state, metrics)``. The batch size (leading
    dimension) is checked on the host before anything is compiled; with a mesh, the state and
    the batch are placed before the call (arrays already placed there are passed as they are).

    Attributes:
      jitted: the underlying ``jax.jit`` function, called as
        ``jitted(state._replace(rng=None), state.rng, batch, key)`` (the key is not donated).
      mesh: the mesh, or ``None`` for a plain ``jax.jit`` step where the inputs live.
      batch_axis: the mesh axis of the data split (and of FSDP).
      fsdp: whether large arrays are also split over ``batch_axis``.
      fsdp_min_size: the FSDP size threshold.
      axis_rules: ``{logical axis: mesh axis}`` applied to the leaves' logical axes.
      stateful: whether the loss takes and returns a model state.
    """

    jitted: Callable
    mesh: Mesh | None
    batch_axis: str
    fsdp: bool
    fsdp_min_size: int
    axis_rules: Mapping[str, str | None]
    stateful: bool

    def state_shardings(self, state: TrainState) -> TrainState | None:
        """Where the step places ``state``: a ``TrainState`` of ``NamedSharding`` s (``None``
        without a mesh).

        Args:
          state: a train state, concrete or abstract (``jax.eval_shape``).

        Returns:
          The shardings, decided by the leaves (:func:`lowrank_jax.leaves.partition_specs`);
          ``step``, ``rng`` and ``data_position`` are replicated.
        """
        if self.mesh is None:
            return None
        return _state_shardings(state, self.mesh, self.axis_rules,
                                self.batch_axis if self.fsdp else None, self.fsdp_min_size)

    def __call__(self, state: TrainState, batch: Any, key: Array | None = None):
        """One update.

        Args:
          state: a :class:`TrainState` (donated).
          batch: a pytree of arrays with a common leading batch dimension.
          key: PRNG key of this run (default ``state.rng``); the step folds in ``state.step``.

        Returns:
          ``(new_state, metrics)``.
        """
        _check_state(state, self.stateful, "train step")
        if self.mesh is None:
            _check_batch(batch, 1, "train step", "the mesh")
        else:
            batch = shard_batch(batch, self.mesh, self.batch_axis)  # checks the batch first
            state = jax.tree_util.tree_map(_put, state, self.state_shardings(state))
            if key is not None:
                key = _put(key, NamedSharding(self.mesh, P()))
        rng = state.rng
        key = rng if key is None else key  # same signature either way: no second trace
        new_state, metrics = self.jitted(state._replace(rng=None), rng, batch, key)
        return new_state._replace(rng=rng), metrics


def _canonical(spec: P) -> P:
    """``spec`` without trailing ``None`` s: the spelling jit gives its outputs, so a step's
    outputs and freshly placed inputs share one compiled executable."""
    parts = tuple(spec)
    while parts and parts[-1] is None:
        parts = parts[:-1]
    return P(*parts)


def _state_shardings(state: TrainState, mesh: Mesh, rules: Mapping[str, str | None],
                     fsdp_axis: str | None, fsdp_min_size: int) -> TrainState:
    """The leaves' placement of every part of ``state`` (see the module docstring)."""

    def shard(tree):
        specs = partition_specs(tree, mesh, rules, fsdp_axis=fsdp_axis,
                                fsdp_min_size=fsdp_min_size)
        return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, _canonical(s)), specs,
                                      is_leaf=lambda s: isinstance(s, P))

    rep = NamedSharding(mesh, P())
    return TrainState(step=rep, params=shard(state.params), frozen=shard(state.frozen),
                      opt_state=shard(state.opt_state), rng=rep, data_position=rep,
                      model_state=shard(state.model_state))


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, batch_axis: str = "data", fsdp: bool = False,
                    fsdp_min_size: int = 2**18, axis_rules: Mapping[str, str | None] | None = None,
                    stateful: bool = False, compute_dtype: Any = None,
                    donate: bool = True) -> TrainStep:
    """A jit-compiled train step, optionally sharded over a mesh as the leaves say.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)``, or with ``stateful=True``
        ``loss_fn(params, model_state, batch, key) -> (loss, aux, new_model_state)``;
        ``params`` is the full tree, ``aux`` a dict of scalars.
      optimizer: optax transformation, the one the state was initialized with.
      mesh: ``None``: plain ``jax.jit`` where the inputs live. A mesh: the batch is split over
        ``batch_axis`` and the state placed by :func:`lowrank_jax.leaves.partition_specs` (each
        leaf's logical axes, ``axis_rules``, FSDP); the step places its inputs itself.
      batch_axis: mesh axis of the data split (and of FSDP).
      fsdp: also split every array of at least ``fsdp_min_size`` entries along its first
        unplaced dimension divisible by the size of ``batch_axis`` (parameters, frozen arrays,
        model state and optimizer moments alike, so each device stores ``1/n`` of them).
      fsdp_min_size: size threshold of ``fsdp``.
      axis_rules: ``{logical axis name: mesh axis}``, e.g. ``{'out': 'model'}`` to split the
        output features of every projection (and their optimizer moments) over a ``'model'``
        axis (tensor parallelism). Names the leaves use: ``'in'``, ``'out'``, ``'rank'``,
        ``'heads'``, ``'head_dim'``, ``'machine'``.
      stateful: the loss takes and returns a model state (see the module docstring).
      compute_dtype: e.g. ``jnp.bfloat16``: the float parameters are cast to it inside the loss;
        master parameters and optimizer state stay in their dtype.
      donate: donate the input state's buffers.

    Returns:
      A :class:`TrainStep`: ``step(state, batch, key=None) -> (state, metrics)``, with
      ``step.jitted``, ``step.mesh`` and ``step.state_shardings(state)``.

    Raises:
      ConfigError: a bad option (no mesh for ``fsdp`` or ``axis_rules``, an axis the mesh does
        not have, a non-float ``compute_dtype``, an optimizer that is not optax).
    """
    who = "make_train_step"
    _check_common(loss_fn, optimizer, stateful, who)
    compute_dtype = _check_compute_dtype(compute_dtype, who)
    if isinstance(fsdp_min_size, bool) or not isinstance(fsdp_min_size, int) or fsdp_min_size < 1:
        raise ConfigError(f"{who}: fsdp_min_size must be a positive int, got {fsdp_min_size!r}",
                          where="fsdp_min_size", expected="int >= 1", actual=fsdp_min_size)
    if axis_rules is not None and not isinstance(axis_rules, Mapping):
        raise ConfigError(f"{who}: axis_rules must be a dict {{logical axis: mesh axis}}, got "
                          f"{type(axis_rules).__name__}", where="axis_rules",
                          expected="dict", actual=type(axis_rules).__name__)
    rules = dict(axis_rules or {})
    if mesh is None:
        if fsdp:
            raise ConfigError(f"{who}: fsdp=True needs a mesh to shard over", where="fsdp",
                              expected="mesh=Mesh(...)", actual=None)
        if rules:
            raise ConfigError(f"{who}: axis_rules {rules} need a mesh to shard over",
                              where="axis_rules", expected="mesh=Mesh(...)", actual=None)
        constrain = None
    else:
        _check_mesh(mesh, batch_axis, who)
        fsdp_axis = batch_axis if fsdp else None
        partition_specs({}, mesh, rules, fsdp_axis=fsdp_axis)  # ConfigError for unknown axes

        def constrain(state):
            return jax.lax.with_sharding_constraint(
                state, _state_shardings(state, mesh, rules, fsdp_axis, fsdp_min_size))

    update = _make_update(loss_fn, optimizer, compute_dtype, None, constrain, stateful)

    def update_kept_rng(state: TrainState, rng: Array, batch: Any, key: Array | None):
        # state.rng travels outside the donated argument: a caller may pass key=state.rng (or
        # a device_put may hand back one buffer for both), and donating a buffer that is also
        # a non-donated argument is an error in XLA (a crash on some backends).
        new_state, metrics = update(state._replace(rng=rng), batch, key)
        return new_state._replace(rng=None), metrics

    jitted = jax.jit(update_kept_rng, donate_argnums=(0,) if donate else ())
    return TrainStep(jitted=jitted, mesh=mesh, batch_axis=batch_axis, fsdp=bool(fsdp),
                     fsdp_min_size=fsdp_min_size, axis_rules=rules, stateful=stateful)


@dataclasses.dataclass(frozen=True, eq=False)
class PmapTrainStep:
    """A ``jax.pmap`` train step (built by :func:`make_pmap_train_step`).

    Call it as ``step(state, batch, key=None) -> (state, metrics)`` with ``state`` from
    :func:`replicate_for_pmap` (a :class:`TrainState` whose arrays carry a leading device axis)
    and the *global* batch ``[batch, ...]`` (split here into ``[n, batch / n, ...]`` after the
    divisibility check). ``metrics`` are the device-averaged scalars; :func:`unreplicate` turns
    the returned state back into a plain one.

    Attributes:
      pmapped: the pmapped update ``(state, batch [n, b/n, ...], key) -> (state, metrics)``.
      devices: the devices, in order.
      axis_name: the pmap axis name.
      stateful: whether the loss takes and returns a model state.
    """

    pmapped: Callable
    devices: tuple
    axis_name: str
    stateful: bool

    def __call__(self, state: TrainState, batch: Any, key: Array | None = None):
        """One update on every device; see the class docstring.

        Args:
          state: the replicated state (donated).
          batch: the global batch.
          key: PRNG key of this run (default ``state.rng``, the same on every device).

        Returns:
          ``(new_state, metrics)``: the replicated new state and unreplicated metrics.
        """
        who = "pmap train step"
        _check_state(state, self.stateful, who)
        n = len(self.devices)
        lead = {np.shape(x)[:1] for x in jax.tree_util.tree_leaves(state)}
        if lead != {(n,)}:
            raise ShapeError(
                f"{who}: the state must carry a leading axis of {n} devices (found leading "
                f"dims {sorted(lead)}); use replicate_for_pmap(state)", where="state",
                expected=(n,), actual=sorted(lead))
        size = _check_batch(batch, n, who, f"{n} local devices")
        sharding = _pmap_sharding(self.devices, self.axis_name)
        state = jax.tree_util.tree_map(lambda x: _put(x, sharding), state)

        def split(x):
            shape = (n, size // n, *np.shape(x)[1:])
            return np.reshape(x, shape) if isinstance(x, np.ndarray) else jnp.reshape(x, shape)

        new_state, metrics = self.pmapped(state, jax.tree_util.tree_map(split, batch), key)
        return new_state, unreplicate(metrics)


def make_pmap_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                         axis_name: str = "batch", stateful: bool = False,
                         compute_dtype: Any = None, devices: Sequence[jax.Device] | None = None,
                         donate: bool = True) -> PmapTrainStep:
    """The train step under ``jax.pmap``: the same update, gradients averaged with ``pmean``.

    Each device computes ``loss_fn`` on its ``batch_size / n`` examples; the mean of the
    per-device gradients equals the gradient of the global-batch mean when ``loss_fn`` is an
    unweighted mean over examples (a masked mean weights devices equally instead). With
    ``stateful=True`` the floating arrays of the new model state are averaged over devices
    (``pmean``; see the module docstring for what that means for BatchNorm).

    Args:
      loss_fn, optimizer, stateful, compute_dtype, donate: as :func:`make_train_step`.
      axis_name: the ``pmap`` axis name (usable in ``loss_fn`` for collectives).
      devices: default ``jax.local_devices()``.

    Returns:
      A :class:`PmapTrainStep`.
    """
    who = "make_pmap_train_step"
    _check_common(loss_fn, optimizer, stateful, who)
    compute_dtype = _check_compute_dtype(compute_dtype, who)
    devices = tuple(jax.local_devices() if devices is None else devices)
    update = _make_update(loss_fn, optimizer, compute_dtype, axis_name, None, stateful)
    pmapped = jax.pmap(update, axis_name=axis_name, in_axes=(0, 0, None), devices=devices,
                       donate_argnums=(0,) if donate else ())
    return PmapTrainStep(pmapped=pmapped, devices=devices, axis_name=axis_name,
                         stateful=stateful)


__all__ = [
    "PmapTrainStep", "TrainStep", "default_optimizer", "make_pmap_train_step", "make_train_step",
    "replicate", "replicate_for_pmap", "shard_batch", "unreplicate",
]
