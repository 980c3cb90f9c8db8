"""Flax interop: compress a user's own Flax model (linen or nnx) without rewriting it.

Sits above :mod:`lowrank_jax.compress` and :mod:`lowrank_jax.io` in the layer order; nothing in
the library imports it (only the tests and benchmarks), so ``import lowrank_jax`` does not
import flax.

* :mod:`lowrank_jax.interop.linen`: :class:`~lowrank_jax.interop.linen.LeafDense`,
  :class:`~lowrank_jax.interop.linen.LeafDenseGeneral`, ``compress`` (a plan over Flax paths),
  ``apply`` / ``intercept`` (the unchanged model through ``nn.intercept_methods``),
  ``materialize``.
* :mod:`lowrank_jax.interop.nnx`: :class:`~lowrank_jax.interop.nnx.LeafLinear`,
  :class:`~lowrank_jax.interop.nnx.LeafLinearGeneral`, ``compress`` (submodules replaced in a
  copy of the model), ``with_leaves``, ``materialize``.
* :mod:`lowrank_jax.interop.prune`: structured pruning of Flax models:
  :class:`~lowrank_jax.interop.prune.ChannelGroup` declarations over Flax paths (or
  ``infer_groups``), magnitude and gradient ("Less is More" eq. 6) scores, removal.
* :mod:`lowrank_jax.interop.kernels`: the shared part: Flax ``kernel`` / ``bias`` dicts <->
  leaves (:class:`KernelShape` for kernels over heads), ``compress_tree``,
  ``materialize_tree``, ``leaf_mask`` (train only the factors).
"""

from lowrank_jax.interop import linen, nnx, prune
from lowrank_jax.interop.kernels import (
    KernelShape,
    compress_tree,
    kernel_paths,
    leaf_mask,
    materialize_tree,
    to_leaves,
)
from lowrank_jax.interop.prune import ChannelGroup

__all__ = ["ChannelGroup", "KernelShape", "compress_tree", "kernel_paths", "leaf_mask", "linen",
           "materialize_tree", "nnx", "prune", "to_leaves"]
