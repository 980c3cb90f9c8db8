"""Placement on a device mesh, decided by the leaves (Flax logical axis rules, levanter names).

Every weight leaf names the dimensions of its arrays (:meth:`Leaf.logical_axes`: ``'in'``,
``'out'``, ``'rank'``, ``'heads'``, ...). :func:`partition_specs` turns those names into
``PartitionSpec`` s with a mapping ``{logical name: mesh axis}`` (tensor parallelism, partitioning
by machine) and, optionally, FSDP: any array of at least ``fsdp_min_size`` entries is split along
its first dimension that is still unplaced and divisible by the FSDP axis size. A train step
applies what this module returns and never guesses from shapes itself.

The mapping works on any tree in which the leaves' structure appears, so optimizer states
(optax's moments have the parameters' structure, leaf dataclasses included) are placed like the
parameters they belong to.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves.base import Leaf, data_fields, is_leaf
from lowrank_jax.leaves.tree import path_str


def _spec_for(shape: tuple[int, ...], names: tuple[str | None, ...], mesh: Mesh,
              rules: Mapping[str, str | None], fsdp_axis: str | None, fsdp_min_size: int,
              where: str) -> P:
    if len(names) != len(shape):
        raise ShapeError(f"partition_specs: {where}: logical_axes names {len(names)} dims "
                         f"{names}, but the array has shape {tuple(shape)}",
                         where=where, expected=len(shape), actual=len(names))
    spec: list[str | None] = [None] * len(shape)
    used = set()
    for i, (dim, name) in enumerate(zip(shape, names, strict=True)):
        axis = rules.get(name) if name is not None else None
        if axis is None or axis in used:
            continue
        if dim % int(mesh.shape[axis]) == 0:
            spec[i] = axis
            used.add(axis)
    if fsdp_axis is not None and fsdp_axis not in used and int(np.prod(shape)) >= fsdp_min_size:
        n = int(mesh.shape[fsdp_axis])
        for i, dim in enumerate(shape):
            if spec[i] is None and dim % n == 0:
                spec[i] = fsdp_axis
                break
    return P(*spec)


def partition_specs(tree: Any, mesh: Mesh, rules: Mapping[str, str | None] | None = None, *,
                    fsdp_axis: str | None = None, fsdp_min_size: int = 2**18) -> Any:
    """A ``PartitionSpec`` for every array of ``tree`` (same structure; ``None`` stays ``None``).

    Args:
      tree: parameters, optimizer states or train states (any tree holding leaves and arrays).
      mesh: the device mesh.
      rules: ``{logical axis name: mesh axis name}`` (e.g. ``{'out': 'model'}`` for
        column-parallel projections, ``{'machine': 'model'}`` for partitioned leaves). A
        dimension is placed only if its size is divisible by the mesh axis; each mesh axis is
        used at most once per array. Plain arrays (embeddings, norm scales) have no names.
      fsdp_axis: also shard arrays of at least ``fsdp_min_size`` entries along their first
        unplaced dimension divisible by this axis's size (FSDP: each device stores ``1/n``).
      fsdp_min_size: size threshold of FSDP.

    Raises:
      ConfigError: a rule or the FSDP axis names an axis the mesh does not have.
    """
    rules = dict(rules or {})
    for name, axis in list(rules.items()) + [("fsdp_axis", fsdp_axis)]:
        if axis is not None and axis not in mesh.axis_names:
            raise ConfigError(f"partition_specs: {name!r} maps to mesh axis {axis!r}, which the "
                              f"mesh does not have (axes {tuple(mesh.axis_names)})",
                              where=name, expected=tuple(mesh.axis_names), actual=axis)

    def plain(path, x):
        if x is None:
            return None
        return _spec_for(tuple(np.shape(x)), (None,) * np.ndim(x), mesh, rules, fsdp_axis,
                         fsdp_min_size, path_str(path))

    def node(path, x):
        if not isinstance(x, Leaf):
            return plain(path, x)
        axes = x.logical_axes()
        kw = {}
        for f in data_fields(x):
            child = getattr(x, f)
            where = f"{path_str(path)}/{f}"
            if child is None:
                kw[f] = None
            elif isinstance(child, Leaf):
                kw[f] = node(path, child)
            else:
                names = tuple(axes.get(f, (None,) * np.ndim(child)))
                kw[f] = _spec_for(tuple(np.shape(child)), names, mesh, rules, fsdp_axis,
                                  fsdp_min_size, where)
        # One level down: the direct children are the leaves of this flatten.
        _, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda c: c is not x)
        return jax.tree_util.tree_unflatten(treedef, [kw[f] for f in data_fields(x)])

    return jax.tree_util.tree_map_with_path(node, tree, is_leaf=lambda x: is_leaf(x) or x is None)


def mesh_shardings(tree: Any, mesh: Mesh, rules: Mapping[str, str | None] | None = None, *,
                   fsdp_axis: str | None = None, fsdp_min_size: int = 2**18) -> Any:
    """:func:`partition_specs` as ``NamedSharding`` s on ``mesh``."""
    specs = partition_specs(tree, mesh, rules, fsdp_axis=fsdp_axis, fsdp_min_size=fsdp_min_size)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda s: isinstance(s, P))


__all__ = ["mesh_shardings", "partition_specs"]
