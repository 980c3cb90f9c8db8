"""Hugging Face / PyTorch checkpoints in and out (the only layer that touches torch, lazily).

``config, params = load_pretrained(path_or_model_or_state_dict)`` and
``save_pretrained(config, params, path)``, for every model family whose
:class:`~lowrank_jax.models.ModelFamily` has a Hugging Face mapping
(:class:`~lowrank_jax.models.hf.HFSpec`: one key table read by both directions). Nothing here
is specific to a family; a family defined outside lowrank_jax converts once it is registered.
``*.safetensors`` files are read and written without torch.
"""

from lowrank_jax.convert.export import save_pretrained, state_dict_from_params
from lowrank_jax.convert.files import read_weights
from lowrank_jax.convert.load import (
    detect_family,
    hf_families,
    load_pretrained,
    params_from_state_dict,
)
from lowrank_jax.errors import CheckpointError  # noqa: F401  (documented in lowrank_jax.errors)

__all__ = ["detect_family", "hf_families", "load_pretrained",
           "params_from_state_dict", "read_weights", "save_pretrained",
           "state_dict_from_params"]
