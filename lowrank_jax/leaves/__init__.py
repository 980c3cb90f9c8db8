"""Leaf types, the ``x @ W`` dispatch, ``materialize`` and counts (bottom layer)."""

from lowrank_jax.leaves.base import (
    Leaf,
    combine,
    flops,
    is_leaf,
    layer_index,
    leaf_dataclass,
    linear,
    map_with_path,
    materialize,
    named_leaves,
    param_count,
    partition,
    path_str,
    storage_bits,
    trainable_mask,
)
from lowrank_jax.leaves.dense import Dense, LowRank
from lowrank_jax.leaves.head_lowrank import HeadLowRank
from lowrank_jax.leaves.init import init_dense, init_head_lowrank, init_lowrank
from lowrank_jax.leaves.masked_binary import MaskedBinary, init_masked_binary, keep_count, top_mask

__all__ = [
    "Dense", "HeadLowRank", "Leaf", "LowRank", "MaskedBinary", "combine", "flops",
    "init_dense", "init_head_lowrank", "init_lowrank", "init_masked_binary", "is_leaf",
    "keep_count", "layer_index", "leaf_dataclass", "linear", "map_with_path", "materialize",
    "named_leaves", "param_count", "partition", "path_str", "storage_bits", "top_mask",
    "trainable_mask",
]
