"""Pure transformer blocks: attention, masks, norms, MLPs, encoder/decoder layers and stacks.

Every block is an ``init_x(key, cfg) -> params`` / ``apply_x(params, x, cfg, ...)`` pair with a
frozen, hashable config; every weight matmul goes through :func:`lowrank_jax.leaves.linear`.
"""

from lowrank_jax.nn.attention import (
    AttentionConfig,
    RelativeBiasConfig,
    apply_attention,
    init_attention,
    init_relative_bias,
    relative_bias,
    relative_position_bucket,
)
from lowrank_jax.nn.layers import (
    DecoderConfig,
    DecoderLayerConfig,
    EncoderConfig,
    EncoderLayerConfig,
    apply_decoder,
    apply_decoder_layer,
    apply_encoder,
    apply_encoder_layer,
    init_decoder,
    init_decoder_layer,
    init_encoder,
    init_encoder_layer,
)
from lowrank_jax.nn.masks import (
    activation_keep_count,
    causal_mask,
    combine_masks,
    padding_mask,
    qkv_activation_masks,
    step_t_mask,
)
from lowrank_jax.nn.mlp import ACTIVATIONS, MLPConfig, apply_mlp, init_mlp
from lowrank_jax.nn.norms import NormConfig, apply_norm, init_norm

__all__ = [
    "ACTIVATIONS", "AttentionConfig", "DecoderConfig", "DecoderLayerConfig", "EncoderConfig",
    "EncoderLayerConfig", "MLPConfig", "NormConfig", "RelativeBiasConfig",
    "activation_keep_count", "apply_attention", "apply_decoder", "apply_decoder_layer",
    "apply_encoder", "apply_encoder_layer", "apply_mlp", "apply_norm", "causal_mask",
    "combine_masks", "init_attention", "init_decoder", "init_decoder_layer", "init_encoder",
    "init_encoder_layer", "init_mlp", "init_norm", "init_relative_bias", "padding_mask",
    "qkv_activation_masks", "relative_bias", "relative_position_bucket", "step_t_mask",
]
