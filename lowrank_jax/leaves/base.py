"""The leaf protocol: one ``x @ W`` dispatch, explicit densification, counts.

Every weight matrix in a lowrank_jax parameter tree is a *leaf*: a frozen dataclass that is a
pytree node (its arrays are children, its sizes are static metadata). Blocks never look inside a
leaf; they call :func:`linear`. A new compression method adds a new :class:`Leaf` subclass that
implements the five abstract methods below, and no block changes.

Conventions (see ``design.md``):

* Flax orientation: ``y = x @ W`` with ``W: [d_in, d_out]``.
* FLOPs count multiply-adds of the matrix product (the convention of seed 003 Table 5 and seed 004
  eqs. 42-54); bias additions and activation work are not counted.
* Storage bits count what must be stored to run the leaf at inference.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


class Leaf(abc.ABC):
    """Base class of all compressed-weight leaf types.

    Subclasses are frozen dataclasses registered as pytrees (see :func:`leaf_dataclass`).
    """

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """``(d_in, d_out)`` of the dense matrix this leaf represents."""

    @abc.abstractmethod
    def apply(self, x: Array) -> Array:
        """Compute ``x @ W (+ b)`` for ``x: [..., d_in]``. Call :func:`linear` instead."""

    @abc.abstractmethod
    def to_dense(self) -> Array:
        """The dense ``[d_in, d_out]`` matrix. Call :func:`materialize` instead."""

    @abc.abstractmethod
    def param_count(self) -> int:
        """Number of stored parameters (bias included)."""

    @abc.abstractmethod
    def storage_bits(self) -> int:
        """Bits needed to store the leaf for inference (bias included)."""

    @abc.abstractmethod
    def flops(self, n_tokens: int) -> int:
        """Multiply-adds of ``x @ W`` for ``n_tokens`` input rows."""

    def trainable(self) -> "Leaf":
        """Same-structure tree of bools: which children ``jax.grad`` should see.

        The default trains every array child. Leaves with frozen parts (for example the random
        weights of :class:`~lowrank_jax.MaskedBinary`) override this.
        """
        return jax.tree_util.tree_map(lambda _: True, self)

    @property
    def d_in(self) -> int:
        return self.shape[0]

    @property
    def d_out(self) -> int:
        return self.shape[1]


def leaf_dataclass(cls: type, *, meta: tuple[str, ...] = ()) -> type:
    """Make ``cls`` a frozen dataclass and register it as a pytree node.

    Fields named in ``meta`` are static (hashable Python values, part of the treedef); all
    other fields are array children, keyed by attribute name (``GetAttrKey``).

    Rebuilding a leaf from its children (``tree_unflatten``) bypasses ``__init__`` and so
    ``__post_init__``: the shape checks run when a user constructs a leaf, not when JAX
    rebuilds one whose children are scalars (``tree_map`` to norms, as ``optax.global_norm``
    does), stacked arrays (``pmap``/``vmap`` outputs) or sentinels (``partition``).
    """
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    data = tuple(n for n in names if n not in meta)
    static = tuple(meta)

    def flatten_with_keys(obj):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data)
        return children, tuple(getattr(obj, n) for n in static)

    def flatten(obj):
        return tuple(getattr(obj, n) for n in data), tuple(getattr(obj, n) for n in static)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for n, v in zip(data, children, strict=True):
            object.__setattr__(obj, n, v)
        for n, v in zip(static, aux, strict=True):
            object.__setattr__(obj, n, v)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


def _check_input(leaf_name: str, d_in: int, x: Array) -> None:
    if x.shape[-1:] != (d_in,):
        raise ValueError(
            f"linear: {leaf_name} expects inputs with last dimension d_in={d_in}, "
            f"got an input of shape {tuple(x.shape)}"
        )


def linear(w: Leaf | Array, x: Array) -> Array:
    """``x @ W`` for any leaf type: the one dispatch every block uses.

    Args:
      w: a :class:`Leaf`, or a plain ``[d_in, d_out]`` array (treated as a dense weight).
      x: inputs ``[..., d_in]``.

    Returns:
      ``[..., d_out]``.
    """
    if isinstance(w, Leaf):
        _check_input(type(w).__name__, w.d_in, x)
        return w.apply(x)
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"linear: a plain weight must be 2-D [d_in, d_out], got shape {w.shape}")
    _check_input("weight array", w.shape[0], x)
    return x @ w


def materialize(w: Leaf | Array) -> Array:
    """The dense ``[d_in, d_out]`` matrix of a leaf: the only way to densify."""
    if isinstance(w, Leaf):
        return w.to_dense()
    return jnp.asarray(w)


def is_leaf(x: Any) -> bool:
    """``tree_util`` predicate: stop at weight leaves so they are visited whole."""
    return isinstance(x, Leaf)


# ---------------------------------------------------------------------------------------------
# Tree paths and traversal.

def path_str(path: tuple) -> str:
    """``('layers', 0, 'attn', 'q')``-style key path -> ``'layers/0/attn/q'``."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        else:  # FlattenedIndexKey and anything else
            parts.append(str(getattr(k, "key", k)))
    return "/".join(parts)


def named_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, node)`` for every weight leaf and every plain array of ``tree``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    for path, node in flat:
        yield path_str(path), node


def map_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """Like ``tree_map`` but ``fn(path, node)`` sees whole leaves; returns a new tree."""
    return jax.tree_util.tree_map_with_path(lambda p, n: fn(path_str(p), n), tree, is_leaf=is_leaf)


_LAYER_RE = re.compile(r"(?:^|/)layers/(\d+)(?:/|$)")


def layer_index(path: str) -> int | None:
    """The layer index in a path such as ``encoder/layers/3/attn/q`` (``None`` if absent)."""
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# Counts summed over a tree (seed 003 Table 5, seed 004 eqs. 42-54 are sums over leaves).

def _array_bits(a: Any) -> int:
    a = np.asarray(a) if not hasattr(a, "dtype") else a
    return int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize * 8


def param_count(tree: Any) -> int:
    """Total stored parameters: leaves report their own count, plain arrays their size."""
    total = 0
    for _, node in named_leaves(tree):
        total += node.param_count() if isinstance(node, Leaf) else int(np.prod(np.shape(node)))
    return total


def storage_bits(tree: Any) -> int:
    """Total storage in bits: leaves report their own, plain arrays ``size * dtype bits``."""
    total = 0
    for _, node in named_leaves(tree):
        total += node.storage_bits() if isinstance(node, Leaf) else _array_bits(node)
    return total


def flops(tree: Any, n_tokens: int) -> int:
    """Multiply-adds of every weight leaf applied to ``n_tokens`` rows (plain arrays: 0)."""
    return sum(node.flops(n_tokens) for _, node in named_leaves(tree) if isinstance(node, Leaf))


# ---------------------------------------------------------------------------------------------
# Trainable / frozen split (equinox-style partition and combine).

def trainable_mask(tree: Any) -> Any:
    """Tree of bools with ``tree``'s structure: ``True`` where ``jax.grad`` should look."""
    return jax.tree_util.tree_map(
        lambda n: n.trainable() if isinstance(n, Leaf) else True, tree, is_leaf=is_leaf
    )


def partition(tree: Any, mask: Any | None = None) -> tuple[Any, Any]:
    """Split ``tree`` into ``(trainable, frozen)``; the other side holds ``None``.

    Args:
      tree: a parameter tree.
      mask: a bool tree of the same structure (default :func:`trainable_mask`).

    Returns:
      Two trees with ``tree``'s structure; pass the first to ``jax.grad`` and rejoin with
      :func:`combine`.
    """
    mask = trainable_mask(tree) if mask is None else mask
    train = jax.tree_util.tree_map(lambda x, m: x if m else None, tree, mask)
    frozen = jax.tree_util.tree_map(lambda x, m: None if m else x, tree, mask)
    return train, frozen


def combine(*trees: Any) -> Any:
    """Inverse of :func:`partition`: take the first non-``None`` value at each position."""

    def pick(*xs):
        for x in xs:
            if x is not None:
                return x
        return None

    return jax.tree_util.tree_map(pick, *trees, is_leaf=lambda x: x is None)
