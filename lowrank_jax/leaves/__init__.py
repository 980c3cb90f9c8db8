"""Leaf types, the ``x @ W`` and query-key dispatches, ``materialize``, counts, surgery and
placement (the bottom layer of lowrank_jax)."""

from lowrank_jax.leaves.base import (
    Factors,
    Leaf,
    array_bits,
    array_size,
    bias_of,
    check_bias,
    data_fields,
    factors,
    is_leaf,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    leaf_dtype,
    linear,
    materialize,
    materialize_host,
    matmul_flops,
    meta_fields,
    node_fields,
    node_types,
    qualified_name,
    require_leaf,
    slice_bias,
    weight_shape,
)
from lowrank_jax.leaves.channel_masked import (
    ChannelMasked,
    ChannelPruned,
    channel_masks,
    count_rows,
    is_channel_masked,
    kept_counts,
    kept_outputs,
    mask_leaf,
    mask_partition,
    pruned_leaf,
    unmask,
    with_channel_masks,
)
from lowrank_jax.leaves.dense import Dense, LowRank, is_dense
from lowrank_jax.leaves.head_lowrank import HeadLowRank
from lowrank_jax.leaves.heads import HeadLayout, head_offsets, is_uniform, merge_heads, split_heads
from lowrank_jax.leaves.init import init_dense, init_head_lowrank, init_lowrank
from lowrank_jax.leaves.lora import LoRA, add_lora, init_lora, is_lora, merge_lora
from lowrank_jax.leaves.masked_binary import (
    FixedBias,
    FrozenBinary,
    MaskedBinary,
    alpha_divisor,
    init_masked_binary,
    keep_count,
    top_mask,
    with_kept_divisor,
)
from lowrank_jax.leaves.packed_binary import (
    PackedBinary,
    pack_binary_tree,
    pack_bits,
    pack_pm1,
    unpack_bits,
    xnor_dot,
)
from lowrank_jax.leaves.partitioned import CompressedKeys, Partitioned
from lowrank_jax.leaves.qk_factorized import BTDQueryKey, CPQueryKey, augmented_joint
from lowrank_jax.leaves.query_key import (
    QK,
    Projections,
    QueryKey,
    as_query_key,
    attention_logits,
    is_query_key,
)
from lowrank_jax.leaves.sharding import mesh_shardings, partition_specs
from lowrank_jax.leaves.tree import (
    check_tokens,
    combine,
    flops,
    get_path,
    layer_index,
    map_with_path,
    named_leaves,
    param_count,
    partition,
    path_str,
    replace_paths,
    storage_bits,
    trainable_mask,
)

__all__ = [
    "ChannelMasked", "ChannelPruned", "LoRA", "add_lora", "channel_masks", "count_rows",
    "init_lora", "is_channel_masked", "is_lora", "kept_counts", "kept_outputs", "mask_leaf",
    "mask_partition", "with_kept_divisor",
    "merge_lora", "pruned_leaf", "unmask", "with_channel_masks",
    "BTDQueryKey", "CPQueryKey", "augmented_joint",
    "Factors", "Projections", "as_query_key", "factors", "weight_shape", "matmul_flops", "is_query_key",
    "QK", "Dense", "FrozenBinary", "HeadLayout", "HeadLowRank", "Leaf", "LowRank",
    "CompressedKeys", "Partitioned",
    "MaskedBinary", "QueryKey", "array_bits", "array_size", "attention_logits", "bias_of",
    "check_bias", "check_tokens", "combine", "data_fields", "flops", "get_path", "head_offsets",
    "init_dense", "init_head_lowrank", "init_lowrank", "init_masked_binary", "is_leaf",
    "is_dense", "is_uniform", "keep_count", "keep_inputs", "keep_outputs", "layer_index", "leaf_dataclass",
    "leaf_dtype", "linear", "map_with_path", "materialize", "materialize_host", "merge_heads",
    "mesh_shardings", "meta_fields", "node_fields", "named_leaves", "node_types", "param_count", "partition",
    "partition_specs", "path_str", "qualified_name", "replace_paths", "require_leaf",
    "slice_bias", "split_heads", "storage_bits", "top_mask", "trainable_mask",
    "FixedBias", "alpha_divisor", "PackedBinary", "pack_binary_tree", "pack_bits", "pack_pm1",
    "unpack_bits", "xnor_dot",
]
