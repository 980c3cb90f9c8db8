"""Models built from :mod:`lowrank_jax.nn` blocks (config dataclass + pure init/apply)."""

from lowrank_jax.models import patch_encoder
from lowrank_jax.models.patch_encoder import PatchEncoderConfig

__all__ = ["PatchEncoderConfig", "patch_encoder"]
