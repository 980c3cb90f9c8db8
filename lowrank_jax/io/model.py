"""Model checkpoints: a parameter checkpoint whose metadata holds the model config.

:func:`save_model` stores the config (``metadata['config']``, see
:mod:`lowrank_jax.io.configs`), the parameters and, for stateful families, the model state
(BatchNorm running statistics). :func:`load_model` returns ``(config, params)``;
:func:`load_model_state` the state. A lowrank_jax 0.1 model checkpoint (format version 1) is
upgraded on load: its attention blocks get the head structure that the model family builds for
the stored config (:func:`lowrank_jax.io.legacy.upgrade_model_tree`).
"""

from __future__ import annotations

import os
from typing import Any

from lowrank_jax.errors import CheckpointError, ConfigError
from lowrank_jax.io.configs import config_from_dict, config_to_dict
from lowrank_jax.io.legacy import upgrade_model_tree
from lowrank_jax.io.params import read_checkpoint, save_params

#: The metadata key holding the serialized config.
CONFIG_KEY = "config"


def save_model(path: str | os.PathLike, config: Any, params: Any, *, state: Any = None,
               metadata: dict | None = None, overwrite: bool = False,
               extra_files: dict | None = None) -> None:
    """Save a model: its config, parameters and optional state, atomically.

    Compressed leaves are saved as they are (factors, masks, scores); nothing is densified.

    Args:
      path: target directory (see :func:`lowrank_jax.io.save_params`).
      config: the model config (a registered config class,
        :func:`lowrank_jax.io.config_classes`).
      params: the parameter tree.
      state: the model state of a stateful family (``family.init_state``: BatchNorm running
        statistics), or ``None``.
      metadata: extra JSON-serializable metadata (the key ``'config'`` is reserved).
      overwrite: replace an existing lowrank_jax checkpoint at ``path``.
      extra_files: ``{file name: path}`` of files copied verbatim into the checkpoint
        directory (a language model's tokenizer files), as :func:`lowrank_jax.io.save_params`.

    Raises:
      ConfigError: ``config`` is not a registered config class, or ``metadata`` uses the
        reserved key ``'config'``.
      OutputExistsError, LeafTypeError, MissingFileError: as
        :func:`lowrank_jax.io.save_params`.
    """
    meta = dict(metadata or {})
    if CONFIG_KEY in meta:
        raise ConfigError(f"save_model: metadata key '{CONFIG_KEY}' is reserved for the model "
                          "config; rename it", where=f"metadata/{CONFIG_KEY}")
    meta[CONFIG_KEY] = config_to_dict(config)
    save_params(path, params, metadata=meta, overwrite=overwrite, state=state,
                extra_files=extra_files)


def _config(stored, who: str) -> Any:
    meta = stored.metadata
    if CONFIG_KEY not in meta:
        raise CheckpointError(stored.tree_file, message=(
            f"{who}: {os.path.dirname(stored.tree_file)} holds a parameter tree without a model "
            "config (written by save_params, not save_model); use load_params"))
    return config_from_dict(meta[CONFIG_KEY], source=stored.tree_file)


def load_model(path: str | os.PathLike, *, verify: bool = True) -> tuple[Any, Any]:
    """``(config, params)`` of a checkpoint written by :func:`save_model`.

    Format version 1 checkpoints (lowrank_jax 0.1) load too, with their attention blocks
    upgraded to the current layout; the upgraded model computes what the 0.1 model did.

    Args:
      path: the checkpoint directory.
      verify: check every array against its stored checksum.

    Returns:
      The config and the parameter tree.

    Raises:
      MissingFileError: ``path`` or its ``tree.json`` does not exist.
      CheckpointError: the checkpoint holds no config, is corrupt, or (version 1) does not fit
        the model its config describes.
      ConfigError: the stored config names an unregistered class or does not build it.
    """
    stored = read_checkpoint(path, state=False, verify=verify, who="load_model")
    config = _config(stored, "load_model")
    params = stored.params
    if stored.version == 1:
        params = upgrade_model_tree(params, config, stored.tree_file)
    return config, params


def load_model_state(path: str | os.PathLike, *, verify: bool = True) -> Any:
    """The model state saved with ``save_model(..., state=...)``, or ``None`` if none was.

    Args:
      path: the checkpoint directory (written by :func:`save_model`).
      verify: check every state array against its stored checksum.

    Returns:
      The state tree or ``None`` (stateless families; format version 1 checkpoints).
    """
    stored = read_checkpoint(path, params=False, verify=verify, who="load_model_state")
    _config(stored, "load_model_state")
    return stored.state


__all__ = ["CONFIG_KEY", "load_model", "load_model_state", "save_model"]
