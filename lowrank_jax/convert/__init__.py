"""PyTorch / Hugging Face checkpoints in and out (the only layer that touches torch, lazily).

``config, params = lowrank_jax.convert.load_pretrained(path_or_module_or_state_dict)``.
Family modules register themselves in :mod:`lowrank_jax.convert.hf` on import; a family module
listed in ``_FAMILY_MODULES`` that does not exist (yet) is skipped.
"""

import importlib

from lowrank_jax.convert.errors import CheckpointError
from lowrank_jax.convert.export import save_pretrained
from lowrank_jax.convert.hf import detect_family, families, load_pretrained, register_family

_FAMILY_MODULES = (
    "lowrank_jax.convert.t5",
    "lowrank_jax.convert.vit",
    "lowrank_jax.convert.bert",
    "lowrank_jax.convert.chronos_bolt",
)

for _name in _FAMILY_MODULES:
    try:
        importlib.import_module(_name)
    except ModuleNotFoundError as _e:  # only skip the family module itself being absent
        if _e.name != _name:
            raise
del _name

__all__ = ["CheckpointError", "detect_family", "families", "load_pretrained", "register_family",
           "save_pretrained"]
