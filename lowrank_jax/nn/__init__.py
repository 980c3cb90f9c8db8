"""Pure transformer blocks: attention, masks, norms, MLPs, encoder/decoder layers and stacks.

Every block is an ``init_x(key, cfg, *, sizes...) -> params`` / ``apply_x(params, x, cfg, ...)``
pair with a frozen, hashable config that says what the block means; sizes are arguments of
``init_x`` and are read back from the parameters by ``apply_x``. Every weight matmul goes through
:func:`lowrank_jax.linear` and every attention score through :func:`lowrank_jax.attention_logits`.
"""

from lowrank_jax.nn.attention import (
    AttentionConfig,
    RelativeBiasConfig,
    apply_attention,
    apply_attention_cached,
    attention_cache,
    attention_params,
    attention_score_flops,
    fold_keys,
    head_widths,
    init_attention,
    init_attention_cache,
    init_relative_bias,
    keep_heads,
    relative_bias,
    relative_position_bucket,
)
from lowrank_jax.nn.decoding import apply_decoder_step, init_decoder_cache
from lowrank_jax.nn.layers import (
    DecoderConfig,
    DecoderLayerConfig,
    EncoderConfig,
    EncoderLayerConfig,
    LayerSizes,
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
from lowrank_jax.nn.mlp import ACTIVATIONS, MLPConfig, apply_mlp, init_mlp, keep_hidden
from lowrank_jax.nn.norms import (
    BatchNormConfig,
    NormConfig,
    apply_batch_norm,
    apply_norm,
    init_batch_norm,
    init_norm,
)
from lowrank_jax.nn.precision import (
    bf16_forward,
    cast_weights,
    dot_accumulation_dtypes,
    with_matmul_dtype,
)

__all__ = [
    "ACTIVATIONS", "AttentionConfig", "BatchNormConfig", "DecoderConfig", "DecoderLayerConfig",
    "EncoderConfig", "EncoderLayerConfig", "LayerSizes", "MLPConfig", "NormConfig",
    "RelativeBiasConfig", "activation_keep_count", "apply_attention", "apply_attention_cached",
    "apply_batch_norm", "apply_decoder", "apply_decoder_layer", "apply_decoder_step",
    "apply_encoder", "apply_encoder_layer", "apply_mlp", "apply_norm", "attention_cache",
    "attention_params", "attention_score_flops", "fold_keys", "bf16_forward", "cast_weights", "causal_mask",
    "combine_masks", "dot_accumulation_dtypes", "head_widths", "init_attention",
    "init_attention_cache", "init_batch_norm", "init_decoder", "init_decoder_cache",
    "init_decoder_layer", "init_encoder", "init_encoder_layer", "init_mlp", "init_norm",
    "init_relative_bias", "keep_heads", "keep_hidden", "padding_mask", "qkv_activation_masks",
    "relative_bias", "relative_position_bucket", "step_t_mask", "with_matmul_dtype",
]
