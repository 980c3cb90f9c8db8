"""The leaf protocol: one ``x @ W`` dispatch, explicit densification, counts, surgery, placement.

Every weight matrix in a lowrank_jax parameter tree is a *leaf*: a frozen dataclass that is a
pytree node (its arrays are children, its sizes are static metadata). Blocks never look inside a
leaf; they call :func:`linear`. A new compression method adds a new :class:`Leaf` subclass that
implements the abstract methods below, and no block changes.

Conventions (see docs/design/architecture.md):

* Flax orientation: ``y = x @ W`` with ``W: [d_in, d_out]``.
* FLOPs count multiply-adds of the matrix products actually executed (the convention of
  "Sparse Binary Transformers for Multivariate Time Series Modeling", Table 5, and of
  "Partitioning Transformer Networks with Low Intercommunication" once its factor of 2 per
  multiply-add is removed); bias additions and activation work are not counted.
* Storage bits count what must be stored to run the leaf at inference.

The protocol: a required core every leaf answers, and optional capabilities with defaults.

========================  ==================================================================
required core             :attr:`Leaf.shape`, :meth:`Leaf.apply` (through :func:`linear`),
                          :meth:`Leaf.to_dense` (through :func:`materialize`),
                          :meth:`Leaf.param_count`, :meth:`Leaf.storage_bits`,
                          :meth:`Leaf.flops`
surgery (optional)        :meth:`Leaf.keep_inputs`, :meth:`Leaf.keep_outputs` (physical removal
                          of channels), :attr:`Leaf.bias`, :meth:`Leaf.with_bias`; the
                          defaults raise :class:`~lowrank_jax.errors.NotSupportedError`
                          naming the leaf type and the method to implement
fast paths (optional)     :meth:`Leaf.factors` (``W`` as stored factors, so attention can fold
                          keys and values through them); the default ``None`` means "no fast
                          path": blocks then take the general path, with the same result
placement (optional)      :meth:`Leaf.logical_axes` (a logical axis name per array dimension;
                          :func:`lowrank_jax.leaves.mesh_shardings` maps names to a mesh); the
                          default names no dimension (replicated, FSDP still shards by size)
training (optional)       :meth:`Leaf.trainable` (which children ``jax.grad`` sees); the
                          default trains every array child
========================  ==================================================================

Blocks, compressors and converters ask a leaf for a capability through the dispatch functions
here (:func:`linear`, :func:`factors`, :func:`keep_inputs`, :func:`bias_of`, ...), never which
class it is, so a leaf type written outside lowrank_jax takes every path a built-in one takes
(``tests/test_extension.py``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import LeafTypeError, NotSupportedError, ShapeError

Array = jax.Array

#: Array types that count as concrete (shape checks run on them, not on tracers or sentinels).
CONCRETE = (jax.Array, np.ndarray)


# ---------------------------------------------------------------------------------------------
# Registered node classes (leaf types, query-key objects, static head layouts).

_NODE_TYPES: dict[str, type] = {}


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: the key under which node classes are registered."""
    return f"{cls.__module__}.{cls.__qualname__}"


def node_types() -> dict[str, type]:
    """Every class registered with :func:`leaf_dataclass`, by qualified name.

    The checkpoint reader rebuilds nodes from this registry (never by importing a module named
    in a file): a checkpoint holding a leaf type defined outside lowrank_jax loads once the
    module defining that type has been imported.
    """
    return dict(_NODE_TYPES)


def leaf_dataclass(cls: type | None = None, *, meta: tuple[str, ...] = ()):
    """Make ``cls`` a frozen dataclass, register it as a pytree node and as a node type.

    Usable as ``Cls = leaf_dataclass(Cls, meta=(...))`` or as a decorator
    ``@leaf_dataclass(meta=("ranks",))``. Fields named in ``meta`` are static (hashable Python
    values, part of the treedef, so XLA compiles fixed shapes); all other fields are children
    (arrays, nested leaves or ``None``), keyed by attribute name (``GetAttrKey``), so parameter
    paths read ``.../qk/q``.

    Rebuilding a node from its children (``tree_unflatten``) bypasses ``__init__`` and so
    ``__post_init__``: the shape checks run when a user constructs a leaf, not when JAX rebuilds
    one whose children are scalars (``tree_map`` to norms, as ``optax.global_norm`` does),
    stacked arrays (``pmap``/``vmap`` outputs) or sentinels (``partition``).
    """
    if cls is None:
        return lambda c: leaf_dataclass(c, meta=meta)
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = set(meta) - set(names)
    if unknown:
        raise LeafTypeError(f"leaf_dataclass: {cls.__name__} has no fields {sorted(unknown)} (meta)")
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
    cls.__lowrank_jax_data__ = data
    cls.__lowrank_jax_meta__ = static
    _NODE_TYPES[qualified_name(cls)] = cls
    return cls


def data_fields(node: Any) -> tuple[str, ...]:
    """Names of the child (array) fields of a registered node class or instance."""
    return type(node).__lowrank_jax_data__ if not isinstance(node, type) else \
        node.__lowrank_jax_data__


def meta_fields(node: Any) -> tuple[str, ...]:
    """Names of the static fields of a registered node class or instance."""
    return type(node).__lowrank_jax_meta__ if not isinstance(node, type) else \
        node.__lowrank_jax_meta__


def node_fields(node: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(children, static)`` of a registered node: its array fields and its static fields by
    name (what a serializer writes; blocks ask for capabilities instead)."""
    return ({n: getattr(node, n) for n in data_fields(node)},
            {n: getattr(node, n) for n in meta_fields(node)})


# ---------------------------------------------------------------------------------------------
# The weight-leaf protocol.

class Factors(NamedTuple):
    """A weight as the factors it is stored as: ``W[rows, :] = first @ second`` (the rows not
    in ``rows`` are zero), plus its bias.

    Fields:
      first: ``[n_read, r]``, or ``None`` when the weight is one dense matrix (``W = second``).
      second: ``[r, d_out]`` (``[n_read, d_out]`` when ``first`` is ``None``).
      rows: static sorted input positions the weight reads (``None``: all ``d_in``).
      bias: ``[d_out]`` or ``None``.

    Arrays as stored, nothing computed: a block may multiply through them in any order.
    """

    first: Array | None
    second: Array
    rows: tuple[int, ...] | None = None
    bias: Array | None = None


def _not_supported(leaf: Any, method: str, needed_by: str) -> NotSupportedError:
    name = type(leaf).__name__
    return NotSupportedError(
        f"{name} does not support {method} (needed by {needed_by}); implement "
        f"{name}.{method} to enable it", where=name, expected=method, actual="not implemented")


class Leaf(abc.ABC):
    """Base class of all weight leaf types (one matrix ``W: [d_in, d_out]``, possibly
    compressed).

    Subclasses are frozen dataclasses registered with :func:`leaf_dataclass`. A new leaf must
    implement the required core (:attr:`shape`, :meth:`apply`, :meth:`to_dense`,
    :meth:`param_count`, :meth:`storage_bits`, :meth:`flops`); the optional capabilities
    (surgery, bias, factors, placement, training) have defaults that either say clearly that
    the leaf does not support them or take the general path.
    """

    # -- required core: compute -------------------------------------------------------------

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """``(d_in, d_out)`` of the dense matrix this leaf represents."""

    @abc.abstractmethod
    def apply(self, x: Array) -> Array:
        """Compute ``x @ W (+ b)`` for ``x: [..., d_in]``. Call :func:`linear` instead."""

    @abc.abstractmethod
    def to_dense(self) -> Array:
        """The dense ``[d_in, d_out]`` matrix (bias excluded). Call :func:`materialize`."""

    # -- required core: counts --------------------------------------------------------------

    @abc.abstractmethod
    def param_count(self) -> int:
        """Number of stored parameters (bias included)."""

    @abc.abstractmethod
    def storage_bits(self) -> int:
        """Bits needed to store the leaf for inference (bias included)."""

    @abc.abstractmethod
    def flops(self, n_tokens: int) -> int:
        """Multiply-adds of ``x @ W`` for ``n_tokens`` input rows, as executed."""

    # -- optional: surgery ------------------------------------------------------------------

    @property
    def bias(self) -> Array | None:
        """The bias ``[d_out]`` or ``None``. Default: not supported."""
        raise _not_supported(self, "bias", "reading the bias: compression, export, folding")

    def with_bias(self, b: Array | None) -> "Leaf":
        """The same leaf with bias ``b`` (``[d_out]`` or ``None``). Default: not supported."""
        raise _not_supported(self, "with_bias", "replacing the bias")

    def keep_inputs(self, idx: np.ndarray) -> "Leaf":
        """A leaf computing ``x[..., idx] @ W[idx, :]``: the input channels ``idx`` kept.

        ``idx`` is a sorted 1-D integer NumPy array of distinct channels (static). Used by
        structured pruning: the result is physically smaller. ``idx`` may be empty: a leaf
        with no inputs computes its bias alone (zeros without one) and should store nothing
        else that could only multiply zeros. Default: not supported.
        """
        raise _not_supported(self, "keep_inputs", "structured pruning's channel removal")

    def keep_outputs(self, idx: np.ndarray) -> "Leaf":
        """A leaf computing ``(x @ W + b)[..., idx]``: the output channels ``idx`` kept.
        ``idx`` may be empty (a leaf with no outputs computes ``[..., 0]``). Default: not
        supported."""
        raise _not_supported(self, "keep_outputs", "structured pruning's channel removal")

    # -- optional: fast paths ---------------------------------------------------------------

    def factors(self) -> Factors | None:
        """The weight as the arrays it is stored as (:class:`Factors`), or ``None``.

        A leaf that answers lets attention fold its keys and values into the queries through
        the factors (:func:`lowrank_jax.nn.execution.fold_keys`), never rebuilding ``W``.
        Default ``None``: no fast path; blocks take the general path, with the same result.
        """
        return None

    # -- optional: placement ----------------------------------------------------------------

    def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        """A logical axis name for every dimension of every array child.

        Names in use: ``'in'`` / ``'out'`` (the matrix's input and output features),
        ``'rank'`` (a factorization's inner dimension), ``'heads'``, ``'head_dim'``,
        ``'machine'`` (partitioned leaves). ``None`` marks a dimension with no name.
        :func:`lowrank_jax.leaves.mesh_shardings` maps names to mesh axes; FSDP shards any
        dimension by size. Entries for children that are ``None`` are ignored.

        Default: no dimension named (the arrays are replicated unless FSDP shards them).
        """
        out = {}
        for name in data_fields(self):
            child = getattr(self, name)
            if child is not None and hasattr(child, "ndim"):
                out[name] = (None,) * int(child.ndim)
        return out

    # -- optional: training -----------------------------------------------------------------

    def trainable(self) -> "Leaf":
        """Same-structure tree of bools: which children ``jax.grad`` should see.

        The default trains every array child. Leaves with frozen parts (for example the random
        weights of :class:`~lowrank_jax.MaskedBinary`) override this.
        """
        return jax.tree_util.tree_map(lambda _: True, self)

    # -- derived ----------------------------------------------------------------------------

    @property
    def d_in(self) -> int:
        return self.shape[0]

    @property
    def d_out(self) -> int:
        return self.shape[1]


class _StoredBias:
    """The bias members of a leaf dataclass that stores its bias as a field ``b: Array | None``.

    :attr:`Leaf.bias` returns ``b``; :meth:`Leaf.with_bias` is ``dataclasses.replace(self,
    b=b)``, so the leaf's ``__post_init__`` checks the new bias. Put it before :class:`Leaf`
    in the bases (``class Dense(_StoredBias, Leaf)``) so these members take the place of the
    not-supported defaults. It declares no field: the dataclass's fields, ``__init__`` and
    pytree flattening (hence checkpoints) are the leaf's own, and the leaf still counts ``b``
    in its :meth:`Leaf.param_count` and :meth:`Leaf.storage_bits`. A leaf whose bias is
    anything else (a wrapped leaf's, reshaped, dropped with the wrapper) writes its own.
    """

    @property
    def bias(self) -> Array | None:
        return self.b

    def with_bias(self, b: Array | None) -> "Leaf":
        return dataclasses.replace(self, b=b)


# ---------------------------------------------------------------------------------------------
# Dispatch functions: the only way blocks and surgery touch a weight.

def _check_input(leaf_name: str, d_in: int, x: Array) -> None:
    if x.shape[-1:] != (d_in,):
        raise ShapeError(
            f"linear: {leaf_name} expects inputs with last dimension d_in={d_in}, "
            f"got an input of shape {tuple(x.shape)}", expected=d_in, actual=tuple(x.shape))


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
        raise ShapeError(f"linear: a plain weight must be 2-D [d_in, d_out], got shape {w.shape}",
                         expected="[d_in, d_out]", actual=tuple(w.shape))
    _check_input("weight array", w.shape[0], x)
    return x @ w


def materialize(w: Leaf | Array) -> Array:
    """The dense ``[d_in, d_out]`` matrix of a leaf: the only way to densify."""
    if isinstance(w, Leaf):
        return w.to_dense()
    return jnp.asarray(w)


def materialize_host(w: Leaf | Array) -> np.ndarray:
    """The dense matrix of a leaf in float64 on the host (for decompositions and analysis).

    The leaf's arrays are cast to float64 and :meth:`Leaf.to_dense` runs with 64-bit types
    enabled, so a factorized leaf's product is formed in float64, not through a float32 matmul.
    Works for any leaf type, including ones defined outside lowrank_jax.
    """
    if not isinstance(w, Leaf):
        return np.asarray(w, dtype=np.float64)
    with jax.enable_x64(True):
        w64 = jax.tree_util.tree_map(
            lambda a: jnp.asarray(np.asarray(a, np.float64))
            if jnp.issubdtype(np.asarray(a).dtype, jnp.floating) else jnp.asarray(a), w)
        return np.asarray(w64.to_dense(), dtype=np.float64)


def leaf_dtype(w: Leaf | Array):
    """The floating dtype of a leaf (of its first floating array child) or of an array."""
    for a in jax.tree_util.tree_leaves(w):
        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
            return jnp.asarray(a).dtype
    return jnp.float32


def bias_of(w: Leaf | Array) -> Array | None:
    """The bias of a weight leaf (``None`` for a plain array)."""
    return w.bias if isinstance(w, Leaf) else None


def weight_shape(w: Leaf | Array) -> tuple[int, ...]:
    """``(d_in, d_out)`` of a leaf, the shape of anything else (a plain array)."""
    if isinstance(w, Leaf):
        return tuple(int(d) for d in w.shape)
    return tuple(int(d) for d in np.shape(w))


def factors(w: Leaf | Array) -> Factors | None:
    """``w`` as stored factors (:meth:`Leaf.factors`): a plain ``[d_in, d_out]`` array is one
    dense factor; ``None`` for a leaf without the capability (or anything else)."""
    if isinstance(w, Leaf):
        return w.factors()
    if np.ndim(w) != 2:
        return None
    return Factors(None, jnp.asarray(w), None, None)


def matmul_flops(w: Leaf | Array, n_tokens: int) -> int:
    """Multiply-adds of ``x @ W`` for ``n_tokens`` rows: the leaf's own count
    (:meth:`Leaf.flops`), ``n_tokens * d_in * d_out`` for a plain array. (The tree counts of
    :func:`lowrank_jax.flops` count plain arrays as 0: they are not weights there.)"""
    if isinstance(w, Leaf):
        return int(w.flops(int(n_tokens)))
    return int(n_tokens) * int(np.shape(w)[0]) * int(np.shape(w)[1])


def _check_idx(idx, size: int, what: str, where: str) -> np.ndarray:
    idx = np.asarray(idx)
    if idx.shape == (0,):  # nothing kept: ``[]`` is a float64 array to NumPy
        return np.zeros(0, np.int64)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ShapeError(f"{where}: {what} indices must be a 1-D integer array, got "
                         f"{idx.dtype}{list(idx.shape)}")
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise ShapeError(f"{where}: {what} indices must lie in [0, {size}), got range "
                         f"[{idx.min()}, {idx.max()}]", expected=f"[0, {size})",
                         actual=(int(idx.min()), int(idx.max())))
    if np.any(np.diff(idx) <= 0):
        raise ShapeError(f"{where}: {what} indices must be sorted and distinct")
    return idx.astype(np.int64)


def keep_inputs(w: Leaf | Array, idx) -> Leaf | Array:
    """``w`` restricted to the input channels ``idx`` (rows of ``W``); see
    :meth:`Leaf.keep_inputs`. A plain array is sliced."""
    if isinstance(w, Leaf):
        return w.keep_inputs(_check_idx(idx, w.d_in, "input", type(w).__name__))
    a = jnp.asarray(w)
    return a[_check_idx(idx, a.shape[0], "input", "array")]


def keep_outputs(w: Leaf | Array, idx) -> Leaf | Array:
    """``w`` restricted to the output channels ``idx`` (columns of ``W`` and of the bias)."""
    if isinstance(w, Leaf):
        return w.keep_outputs(_check_idx(idx, w.d_out, "output", type(w).__name__))
    a = jnp.asarray(w)
    return a[:, _check_idx(idx, a.shape[1], "output", "array")]


def is_leaf(x: Any) -> bool:
    """``tree_util`` predicate: stop at weight leaves so they are visited whole."""
    return isinstance(x, Leaf)


def require_leaf(x: Any, where: str, what: str = "a weight leaf") -> Leaf:
    """``x`` if it is a :class:`Leaf`, else a :class:`~lowrank_jax.errors.LeafTypeError`."""
    if not isinstance(x, Leaf):
        raise LeafTypeError(f"{where}: expected {what}, got {type(x).__name__}",
                            where=where, expected="Leaf", actual=type(x).__name__)
    return x


def array_bits(a: Any) -> int:
    """``size * dtype bits`` of an array (0 for ``None``)."""
    if a is None:
        return 0
    a = np.asarray(a) if not hasattr(a, "dtype") else a
    return int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize * 8


def array_size(a: Any) -> int:
    """Number of entries of an array (0 for ``None``)."""
    return 0 if a is None else int(np.prod(np.shape(a)))


def check_bias(name: str, b, d_out: int) -> None:
    """Shared shape check for optional biases (only on concrete arrays, not tree sentinels)."""
    if isinstance(b, CONCRETE) and tuple(b.shape) != (d_out,):
        raise ShapeError(f"{name}: bias b must have shape ({d_out},), got {tuple(b.shape)}",
                         expected=(d_out,), actual=tuple(b.shape))


def slice_bias(b, idx: np.ndarray):
    """``b[idx]`` for an optional bias."""
    return None if b is None else b[idx]


__all__ = [
    "CONCRETE", "Factors", "Leaf", "array_bits", "array_size", "bias_of", "check_bias",
    "data_fields", "factors", "is_leaf", "keep_inputs", "keep_outputs", "leaf_dataclass",
    "leaf_dtype", "linear", "materialize", "materialize_host", "matmul_flops", "meta_fields",
    "node_fields", "node_types", "qualified_name", "require_leaf", "slice_bias", "weight_shape",
]
