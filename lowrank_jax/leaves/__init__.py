"""Leaf types, the ``x @ W`` and query-key dispatches, ``materialize``, counts, surgery and
placement (the bottom layer of lowrank_jax).

What users of leaves call is listed in ``__all__``; what authors of new leaf types need
(``leaf_dataclass``, the ``Leaf`` / ``QK`` protocols, count helpers, ``Factors``) is gathered in
:mod:`lowrank_jax.leaves.kit`. Every name stays importable from here.
"""

from lowrank_jax.leaves import kit  # noqa: F401  (the leaf authors' kit, a submodule)
from lowrank_jax.leaves.base import (
    bias_of,
    factors,
    is_leaf,
    keep_inputs,
    keep_outputs,
    leaf_dtype,
    linear,
    materialize,
    materialize_host,
    matmul_flops,
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

# The leaf authors' names (lowrank_jax.leaves.kit), importable from here as before.
from lowrank_jax.leaves.kit import (  # noqa: E402, F401
    CONCRETE,
    QK,
    Factors,
    Leaf,
    Projections,
    array_bits,
    array_size,
    check_bias,
    data_fields,
    leaf_dataclass,
    meta_fields,
    node_fields,
    node_types,
    qualified_name,
    require_leaf,
    slice_bias,
)
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
from lowrank_jax.leaves.quantized import (
    FakeQuant,
    Int4,
    Int8,
    Int8A8,
    ProductLeaf,
    SumLeaf,
    as_fake_quant,
    dequantize_tree,
    fake_quantize,
    freeze_fake_quant,
    is_quantized,
    quantize_weight,
)
from lowrank_jax.leaves.query_key import (
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
    "BTDQueryKey", "CPQueryKey", "ChannelMasked", "ChannelPruned", "CompressedKeys", "Dense",
    "FakeQuant", "FixedBias", "FrozenBinary", "HeadLayout", "HeadLowRank", "Int4", "Int8",
    "Int8A8",
    "LoRA", "LowRank", "MaskedBinary", "PackedBinary", "Partitioned", "ProductLeaf", "QueryKey",
    "SumLeaf", "as_fake_quant", "dequantize_tree", "fake_quantize", "freeze_fake_quant",
    "is_quantized", "quantize_weight", "add_lora",
    "alpha_divisor",
    "as_query_key", "attention_logits", "augmented_joint", "bias_of", "channel_masks",
    "check_tokens", "combine", "count_rows", "factors", "flops", "get_path", "head_offsets",
    "init_dense", "init_head_lowrank", "init_lora", "init_lowrank", "init_masked_binary",
    "is_channel_masked", "is_dense", "is_leaf", "is_lora", "is_query_key", "is_uniform",
    "keep_count", "keep_inputs", "keep_outputs", "kept_counts", "kept_outputs", "layer_index",
    "leaf_dtype", "linear", "map_with_path", "mask_leaf", "mask_partition", "materialize",
    "materialize_host", "matmul_flops", "merge_heads", "merge_lora", "mesh_shardings",
    "named_leaves", "pack_binary_tree", "pack_bits", "pack_pm1", "param_count", "partition",
    "partition_specs", "path_str", "pruned_leaf", "replace_paths", "split_heads", "storage_bits",
    "top_mask", "trainable_mask", "unmask", "unpack_bits", "weight_shape", "with_channel_masks",
    "with_kept_divisor", "xnor_dot",
]
