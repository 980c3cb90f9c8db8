"""The kit for writing a leaf type or a query-key type of your own.

A leaf is a frozen dataclass registered with :func:`leaf_dataclass` that subclasses
:class:`Leaf` and implements the required core: ``shape``, ``apply``, ``to_dense``,
``param_count``, ``storage_bits`` and ``flops``. Everything else is an optional capability with
a default (surgery raises :class:`~lowrank_jax.errors.NotSupportedError` naming the method to
implement; :meth:`Leaf.factors` returns ``None``, so blocks take the general path; placement
replicates the arrays). A query-key type subclasses :class:`QK` the same way. Once its module is
imported, the new type runs through every block, the counts, compression plans, checkpoints and
the sharded train step with no change to the library (``tests/test_extension.py`` writes one)::

    import dataclasses
    from lowrank_jax.leaves import kit

    @kit.leaf_dataclass
    class Scaled(kit.Leaf):
        w: jax.Array
        s: jax.Array                      # [d_out] column scales

        @property
        def shape(self):
            return tuple(self.w.shape)

        def apply(self, x):
            return (x @ self.w) * self.s

        def to_dense(self):
            return self.w * self.s

        def param_count(self):
            return kit.array_size(self.w) + kit.array_size(self.s)

        def storage_bits(self):
            return kit.array_bits(self.w) + kit.array_bits(self.s)

        def flops(self, n_tokens):
            return n_tokens * self.d_in * self.d_out

The names here are for leaf authors; :mod:`lowrank_jax.leaves` holds what users of leaves call.
"""

from lowrank_jax.errors import NotSupportedError  # noqa: F401  (documented in lowrank_jax.errors)
from lowrank_jax.leaves.base import (
    CONCRETE,
    Factors,
    Leaf,
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
from lowrank_jax.leaves.channel_masked import input_granularity, output_granularity
from lowrank_jax.leaves.heads import (  # noqa: F401  (documented in lowrank_jax.leaves)
    head_offsets,
    is_uniform,
    merge_heads,
    split_heads,
)
from lowrank_jax.leaves.query_key import QK, Projections

# Also importable from here for authors' convenience, documented where they live:
# NotSupportedError (lowrank_jax.errors), head_offsets, is_uniform, merge_heads, split_heads
# (lowrank_jax.leaves).
__all__ = [
    "CONCRETE", "Factors", "Leaf", "Projections", "QK", "array_bits", "array_size",
    "check_bias", "data_fields", "input_granularity", "leaf_dataclass", "meta_fields",
    "node_fields", "node_types", "output_granularity", "qualified_name", "require_leaf",
    "slice_bias",
]
