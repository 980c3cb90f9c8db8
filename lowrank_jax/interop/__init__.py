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
* :mod:`lowrank_jax.interop.channel_groups`: structured pruning of Flax models:
  :class:`~lowrank_jax.interop.channel_groups.ChannelGroup` declarations over Flax paths (or
  ``infer_groups``), resolved into the ``prune`` method's
  :class:`~lowrank_jax.compress.prune.PruneGroup` s and scored and selected by its path
  (magnitude and gradient, "Less is More" eq. 6, scores), removal. It was
  ``lowrank_jax.interop.prune`` (beside the ``prune`` method's package
  :mod:`lowrank_jax.compress.prune`); that name still resolves, with a ``DeprecationWarning``.
* :mod:`lowrank_jax.interop.kernels`: the shared part: Flax ``kernel`` / ``bias`` dicts <->
  leaves (:class:`KernelShape` for kernels over heads), ``compress_tree``,
  ``materialize_tree``, ``leaf_mask`` (train only the factors).
"""

import warnings

from lowrank_jax.interop import channel_groups, linen, nnx
from lowrank_jax.interop.channel_groups import ChannelGroup
from lowrank_jax.interop.kernels import (
    KernelShape,
    compress_tree,
    kernel_paths,
    leaf_mask,
    materialize_tree,
    to_leaves,
)

__all__ = ["ChannelGroup", "KernelShape", "channel_groups", "compress_tree", "kernel_paths",
           "leaf_mask", "linen", "materialize_tree", "nnx", "to_leaves"]


def __getattr__(name: str):
    if name == "prune":  # the module's old name
        warnings.warn("lowrank_jax.interop.prune is now lowrank_jax.interop.channel_groups",
                      DeprecationWarning, stacklevel=2)
        return channel_groups
    raise AttributeError(f"module 'lowrank_jax.interop' has no attribute {name!r}")
