"""Training: train states, jit / sharded / pmap train steps, losses and metrics.

Public API:

* :class:`TrainState`, :func:`init_train_state`, :func:`full_params` -- trainable / frozen
  split (:func:`lowrank_jax.partition`) plus optimizer state, step, key and data position.
* :func:`make_train_step` -- jit-compiled donated step, data parallel / FSDP over a mesh,
  optional bf16 compute; :func:`make_pmap_train_step` -- the same under ``pmap``.
* :func:`default_optimizer` -- AdamW with warmup-cosine; :func:`shard_batch`,
  :func:`replicate`, :func:`replicate_for_pmap`, :func:`unreplicate` -- placement helpers.
* :func:`quantile_loss`, :func:`token_cross_entropy`, :func:`mse` -- losses;
  :func:`wql`, :func:`mase`, :func:`geometric_mean_relative` -- Chronos' metrics.
* Data windows (``data.py``) and checkpoints (``checkpoint.py``) when those modules exist.
"""

import importlib

from lowrank_jax.losses import (
    IGNORE_INDEX,
    geometric_mean_relative,
    mase,
    mse,
    quantile_loss,
    token_cross_entropy,
    wql,
)
from lowrank_jax.train.state import TrainState, full_params, init_train_state, split_params
from lowrank_jax.train.step import (
    Replicated,
    default_optimizer,
    make_pmap_train_step,
    make_train_step,
    replicate,
    replicate_for_pmap,
    shard_batch,
    unreplicate,
)

__all__ = [
    "IGNORE_INDEX", "Replicated", "TrainState", "default_optimizer", "full_params", "geometric_mean_relative",
    "init_train_state", "make_pmap_train_step", "make_train_step", "mase", "mse",
    "quantile_loss", "replicate", "replicate_for_pmap", "shard_batch", "split_params",
    "token_cross_entropy", "unreplicate", "wql",
]

# data.py and checkpoint.py are written separately: export what they define, when they exist,
# so this package imports (and its steps work) without them.
_OPTIONAL = {
    "data": ("WindowConfig", "WindowSampler", "default_series", "load_ett_csv",
             "prefetch_to_device"),
    "checkpoint": ("Checkpointer",),
}
for _module, _names in _OPTIONAL.items():
    try:
        _mod = importlib.import_module(f"lowrank_jax.train.{_module}")
    except ImportError:
        continue
    for _name in _names:
        if hasattr(_mod, _name):
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)
del _OPTIONAL, _module, _names
