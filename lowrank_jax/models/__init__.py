"""Models built from :mod:`lowrank_jax.nn` blocks: a config dataclass plus pure ``init`` /
``apply`` per family, each registered once as a :class:`ModelFamily`.

``apply(params, inputs, config)`` runs any registered model with inputs named as in the
PyTorch forward and outputs keyed like the PyTorch outputs; :func:`family_of` gives the whole
record (loss, sample inputs, Hugging Face mapping, forecast).
"""

from lowrank_jax.models import (
    bert,
    causal,
    chronos,
    chronos_bolt,
    generation,
    gpt2,
    llama,
    patch_encoder,
    sbt,
    t5,
    vit,
)
from lowrank_jax.models.bert import BertConfig
from lowrank_jax.models.chronos import ChronosConfig
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.models.family import (
    ModelFamily,
    apply,
    families,
    family_of,
    get_family,
    primary_output,
    register_family,
)
from lowrank_jax.models.generation import Sampling, generate
from lowrank_jax.models.gpt2 import GPT2Config
from lowrank_jax.models.llama import LlamaConfig
from lowrank_jax.models.patch_encoder import PatchEncoderConfig
from lowrank_jax.models.sbt import SBTConfig
from lowrank_jax.models.t5 import T5Config
from lowrank_jax.models.vit import ViTConfig

__all__ = [
    "BertConfig", "ChronosBoltConfig", "ChronosConfig", "GPT2Config", "LlamaConfig", "ModelFamily",
    "PatchEncoderConfig", "SBTConfig", "Sampling", "T5Config", "ViTConfig", "apply", "bert",
    "causal", "chronos", "chronos_bolt", "families", "family_of", "generate", "generation",
    "get_family", "gpt2", "llama", "patch_encoder", "primary_output", "register_family", "sbt",
    "t5", "vit",
]
