"""Models built from :mod:`lowrank_jax.nn` blocks (config dataclass + pure init/apply).

``apply(config, params, **inputs)`` runs any registered model with inputs named as in the
PyTorch forward and outputs keyed like the PyTorch outputs.
"""

from lowrank_jax.models import bert, chronos, chronos_bolt, patch_encoder, t5, vit
from lowrank_jax.models.bert import BertConfig
from lowrank_jax.models.chronos import ChronosConfig
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.models.patch_encoder import PatchEncoderConfig
from lowrank_jax.models.registry import apply, register, registered
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.models.vit import ViTConfig

__all__ = [
    "BertConfig",
    "ChronosBoltConfig",
    "ChronosConfig",
    "PatchEncoderConfig",
    "T5Config",
    "ViTConfig",
    "apply",
    "bert",
    "chronos",
    "chronos_bolt",
    "patch_encoder",
    "register",
    "registered",
    "t5",
    "vit",
]
