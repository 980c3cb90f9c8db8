"""Training: train states, jit / sharded / pmap train steps, data windows, checkpoints, a loop.

Public API:

* :class:`TrainState`, :func:`init_train_state`, :func:`full_params` -- trainable / frozen
  split (:func:`lowrank_jax.leaves.partition`) plus optimizer state, model state, step, key
  and data position.
* :func:`make_train_step` -> :class:`TrainStep` -- jit-compiled donated step; over a mesh the
  leaves decide the placement (data parallel, FSDP, tensor parallel through ``axis_rules``);
  optional bf16 compute; ``stateful=True`` for models with state (BatchNorm).
  :func:`make_pmap_train_step` -> :class:`PmapTrainStep` -- the same under ``pmap``.
* :func:`default_optimizer` -- AdamW with warmup-cosine; :func:`shard_batch`,
  :func:`replicate`, :func:`replicate_for_pmap`, :func:`unreplicate` -- placement helpers.
* :class:`WindowConfig`, :class:`WindowSampler`, :func:`load_ett_csv`, :func:`default_series`,
  :func:`prefetch_to_device` -- data windows; :class:`ProcessPart` -- a process's part of each
  batch (multi-process data parallelism).
* :class:`Checkpointer` -- train-state checkpoints with exact resume, keep-N and fallback; each
  step is a :mod:`lowrank_jax.io` checkpoint (``io.load_params(step_dir)`` gives its
  parameters); :func:`load_train_state` reads a whole step without ``like``.
* :func:`fit`, :func:`evaluate_forecaster` -- a small training loop (durable JSON-lines log cut
  back on resume, :class:`~lowrank_jax.errors.NonFiniteError` on a NaN loss) and forecast
  evaluation.
* The losses and metrics of :mod:`lowrank_jax.losses` (re-exported).
"""

from lowrank_jax.errors import (  # noqa: F401  (re-exported for compatibility)
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    NonFiniteError,
)
from lowrank_jax.losses import (  # noqa: F401  (re-exported for compatibility)
    IGNORE_INDEX,
    geometric_mean_relative,
    mase,
    mse,
    quantile_loss,
    token_cross_entropy,
    wql,
)
from lowrank_jax.train.checkpoint import Checkpointer, load_train_state
from lowrank_jax.train.data import (
    ProcessPart,
    WindowConfig,
    WindowSampler,
    default_series,
    load_ett_csv,
    prefetch_to_device,
    split_bounds,
)
from lowrank_jax.train.loop import (
    evaluate_forecaster,
    fit,
    truncate_log,
    window_batch,
)
from lowrank_jax.train.state import (
    TrainState,
    check_optimizer,
    full_params,
    init_train_state,
    split_params,
)
from lowrank_jax.train.step import (
    PmapTrainStep,
    TrainStep,
    default_optimizer,
    make_pmap_train_step,
    make_train_step,
    replicate,
    replicate_for_pmap,
    shard_batch,
    unreplicate,
)

# Also importable from here, documented where they live: the losses and metrics
# (lowrank_jax.losses) and the training errors (lowrank_jax.errors).
__all__ = [
    "Checkpointer", "PmapTrainStep", "ProcessPart", "TrainState", "TrainStep", "WindowConfig",
    "WindowSampler", "check_optimizer", "default_optimizer", "default_series",
    "evaluate_forecaster", "fit", "full_params", "init_train_state", "load_ett_csv",
    "load_train_state", "make_pmap_train_step", "make_train_step", "prefetch_to_device",
    "replicate", "replicate_for_pmap", "shard_batch", "split_bounds", "split_params",
    "truncate_log", "unreplicate", "window_batch",
]
