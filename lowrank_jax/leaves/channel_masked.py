"""Channel masks on a weight leaf and the physically pruned form of a leaf.

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured
Pruning" (Zhao et al., arXiv:2505.23195), eq. 4, puts an input mask and an output mask on every
linear layer::

    h = f(x * m_in) * m_out = x (W * (m_in^T m_out)) + b * m_out

:class:`ChannelMasked` wraps any weight leaf with the two masks. The masks are *inputs* of the
forward pass, not parameters: :meth:`ChannelMasked.trainable` marks them ``False`` (the
optimizer never sees them), and :func:`mask_partition` splits a tree into its masks and the
rest, so that ``jax.grad`` of a loss with respect to the masks gives ``dL/dm`` (the importance
scores of eqs. 5-6 are built from those gradients).

:class:`ChannelPruned` is what a masked leaf becomes when its masked channels are physically
removed but the width it reads from or writes to must stay (the residual stream: the layer
norms and the model width are kept): the inputs it keeps are gathered (``x[..., rows]``), a
smaller leaf runs on them, and the outputs it keeps are placed back into a zero vector of the
full width (``cols``). Inside attention and MLP blocks, channels are removed from both sides of
a block instead (heads, query/key and value/output channel pairs, hidden channels), which needs
no gather; that surgery lives in :mod:`lowrank_jax.compress.prune`.

Also here, because they read leaf fields: :func:`output_granularity` (how many outputs a leaf
can lose at a time: one, or a whole head of a :class:`~lowrank_jax.HeadLowRank`),
:func:`kept_counts` (parameters and multiply-adds of a leaf restricted to some channels,
without slicing its arrays, for the leaf types of lowrank_jax; any other leaf type is sliced
through the protocol) and :func:`count_rows` (how many input rows each leaf sees in one
forward pass, from an abstract trace).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import LeafTypeError, PathError, ShapeError
from lowrank_jax.leaves import head_lowrank
from lowrank_jax.leaves.base import (
    CONCRETE,
    Array,
    Leaf,
    bias_of,
    factors,
    is_leaf,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    linear,
    materialize,
)
from lowrank_jax.leaves.dense import Dense, LowRank
from lowrank_jax.leaves.head_lowrank import HeadLowRank
from lowrank_jax.leaves.masked_binary import FixedBias, FrozenBinary, MaskedBinary
from lowrank_jax.leaves.partitioned import Partitioned
from lowrank_jax.leaves.tree import map_with_path, named_leaves, partition

# ---------------------------------------------------------------------------------------------
# The masked leaf (eq. 4).

def rebuild(node: Any, **children: Any) -> Any:
    """``node`` with some children replaced, rebuilt through its pytree definition (not its
    constructor, whose checks need arrays): for trees of bools such as :meth:`Leaf.trainable`."""
    from lowrank_jax.leaves.base import data_fields

    _, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda c: c is not node)
    return jax.tree_util.tree_unflatten(
        treedef, [children.get(f, getattr(node, f)) for f in data_fields(node)])


class ChannelMasked(Leaf):
    """A weight leaf with an input and an output channel mask ("Less is More", eq. 4).

    ``linear(ChannelMasked(base, m_in, m_out), x) = (linear(base, x * m_in)) * m_out``, which is
    ``x (W * (m_in^T m_out)) + b * m_out``.

    Fields:
      base: any weight leaf ``[d_in, d_out]``.
      m_in: ``[d_in]`` input mask (1 keeps a channel, 0 removes it).
      m_out: ``[d_out]`` output mask.

    The masks are forward-pass inputs: :meth:`trainable` marks them ``False``, so the train
    step and :func:`~lowrank_jax.partition` keep them out of the optimizer, and
    :func:`mask_partition` gives them to ``jax.grad`` instead. Counts are the base leaf's (a
    masked leaf stores and executes everything; only physical removal makes it smaller).
    """

    base: Any
    m_in: Array
    m_out: Array

    def __post_init__(self):
        if not isinstance(self.base, Leaf):
            raise LeafTypeError(f"ChannelMasked: base must be a weight leaf, got "
                                f"{type(self.base).__name__}", where="base", expected="Leaf",
                                actual=type(self.base).__name__)
        if isinstance(self.base, ChannelMasked):
            raise LeafTypeError("ChannelMasked: the base is already masked; set its masks with "
                                "with_channel_masks instead of masking twice", where="base")
        for name, d in (("m_in", self.base.d_in), ("m_out", self.base.d_out)):
            m = getattr(self, name)
            if isinstance(m, CONCRETE) and tuple(m.shape) != (d,):
                raise ShapeError(f"ChannelMasked: {name} must have shape ({d},) for a base of "
                                 f"shape {self.base.shape}, got {tuple(m.shape)}", where=name,
                                 expected=(d,), actual=tuple(m.shape))

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape

    def apply(self, x: Array) -> Array:
        y = linear(self.base, x * self.m_in.astype(x.dtype))
        return y * self.m_out.astype(y.dtype)

    def to_dense(self) -> Array:
        w = materialize(self.base)
        return self.m_in.astype(w.dtype)[:, None] * w * self.m_out.astype(w.dtype)[None, :]

    def param_count(self) -> int:
        return self.base.param_count()

    def storage_bits(self) -> int:
        return self.base.storage_bits()

    def flops(self, n_tokens: int) -> int:
        return self.base.flops(n_tokens)

    def trainable(self) -> "ChannelMasked":
        return rebuild(self, base=self.base.trainable(), m_in=False, m_out=False)

    @property
    def bias(self):
        """The effective bias ``b * m_out`` (``None`` if the base has none)."""
        b = bias_of(self.base)
        return None if b is None else b * self.m_out.astype(b.dtype)

    def with_bias(self, b):
        """The base leaf gets bias ``b``; the output mask still applies to it."""
        return dataclasses.replace(self, base=self.base.with_bias(b))

    def keep_inputs(self, idx):
        return ChannelMasked(base=keep_inputs(self.base, idx), m_in=self.m_in[idx],
                             m_out=self.m_out)

    def keep_outputs(self, idx):
        return ChannelMasked(base=keep_outputs(self.base, idx), m_in=self.m_in,
                             m_out=self.m_out[idx])

    def logical_axes(self):
        return {"m_in": ("in",), "m_out": ("out",)}


ChannelMasked = leaf_dataclass(ChannelMasked)


def _check_positions(pos, size: int, what: str) -> tuple[int, ...] | None:
    if pos is None:
        return None
    pos = tuple(int(p) for p in pos)
    if any(b <= a for a, b in zip(pos, pos[1:], strict=False)) or (pos and (
            pos[0] < 0 or pos[-1] >= size)):
        raise ShapeError(f"ChannelPruned: {what} must be sorted, distinct positions in "
                         f"[0, {size}), got {pos[:8]}{'...' if len(pos) > 8 else ''}",
                         where=what, expected=f"sorted in [0, {size})", actual=pos[:8])
    return pos


class ChannelPruned(Leaf):
    """A leaf whose removed channels are gone but whose full widths stay.

    ``y = scatter_cols(linear(base, x[..., rows]))``: the ``len(rows)`` kept inputs are
    gathered from ``x: [..., d_in]``, the smaller ``base: [len(rows), len(cols)]`` runs on them
    and its outputs are placed at positions ``cols`` of a ``[..., d_out]`` zero vector. The
    physical form of a :class:`ChannelMasked` leaf whose inputs or outputs are the residual
    stream ("Less is More", sec. 4.1: residual-width input channels become row slices; the
    model width and the norms stay).

    Fields:
      base: the weight leaf on the kept channels.
      rows: static sorted positions of the kept inputs (``None``: all, ``base.d_in == d_in``).
      cols: static sorted positions of the kept outputs (``None``: all).
      d_in, d_out: the full widths.

    Counts are the base leaf's: the gather and the scatter move data but multiply nothing.
    :meth:`to_dense` is the zero-padded ``[d_in, d_out]`` matrix; :attr:`bias` the zero-padded
    bias.
    """

    base: Any
    rows: tuple[int, ...] | None = None
    cols: tuple[int, ...] | None = None
    d_in_full: int = 0
    d_out_full: int = 0

    def __post_init__(self):
        if not isinstance(self.base, Leaf):
            raise LeafTypeError(f"ChannelPruned: base must be a weight leaf, got "
                                f"{type(self.base).__name__}", where="base", expected="Leaf",
                                actual=type(self.base).__name__)
        rows = _check_positions(self.rows, self.d_in_full, "rows")
        cols = _check_positions(self.cols, self.d_out_full, "cols")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "cols", cols)
        n_in = self.d_in_full if rows is None else len(rows)
        n_out = self.d_out_full if cols is None else len(cols)
        if self.base.shape != (n_in, n_out):
            raise ShapeError(f"ChannelPruned: base has shape {self.base.shape} but rows/cols keep "
                             f"({n_in}, {n_out}) of ({self.d_in_full}, {self.d_out_full})",
                             where="base", expected=(n_in, n_out), actual=self.base.shape)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.d_in_full, self.d_out_full)

    def apply(self, x: Array) -> Array:
        if self.rows is not None:
            x = x[..., np.asarray(self.rows, np.int64)]  # [..., len(rows)]
        y = linear(self.base, x)  # [..., len(cols)]
        if self.cols is None:
            return y
        # a gather from [y, 0] is cheaper than a scatter into zeros on CPU
        inv = np.full(self.d_out_full, len(self.cols), np.int64)
        inv[np.asarray(self.cols, np.int64)] = np.arange(len(self.cols))
        y = jnp.concatenate([y, jnp.zeros((*y.shape[:-1], 1), y.dtype)], axis=-1)
        return y[..., inv]  # [..., d_out]

    def factors(self):
        """The base's factors on the kept inputs, when only inputs were removed (structured
        pruning's residual-stream rows); ``None`` when outputs were removed too (the scatter
        into ``d_out`` is not a product of stored factors)."""
        if self.cols is not None:
            return None
        f = factors(self.base)
        if f is None or f.rows is not None:
            return None
        return f._replace(rows=self.rows)

    def to_dense(self) -> Array:
        w = materialize(self.base)
        rows = np.arange(self.d_in_full) if self.rows is None else np.asarray(self.rows, np.int64)
        cols = np.arange(self.d_out_full) if self.cols is None else np.asarray(self.cols, np.int64)
        full = jnp.zeros((self.d_in_full, self.d_out_full), w.dtype)
        return full.at[np.ix_(rows, cols)].set(w)

    def param_count(self) -> int:
        return self.base.param_count()

    def storage_bits(self) -> int:
        return self.base.storage_bits()

    def flops(self, n_tokens: int) -> int:
        return self.base.flops(n_tokens)

    def trainable(self) -> "ChannelPruned":
        return rebuild(self, base=self.base.trainable())

    @property
    def bias(self):
        """The zero-padded ``[d_out]`` bias (``None`` if the base has none)."""
        b = bias_of(self.base)
        if b is None or self.cols is None:
            return b
        return jnp.zeros((self.d_out_full,), b.dtype).at[np.asarray(self.cols)].set(b)

    def with_bias(self, b):
        """The base gets ``b`` at the kept outputs; entries elsewhere belong to removed
        channels and are dropped."""
        if b is not None and self.cols is not None:
            b = b[np.asarray(self.cols, np.int64)]
        return dataclasses.replace(self, base=self.base.with_bias(b))

    def keep_inputs(self, idx):
        idx = np.asarray(idx, np.int64)
        rows = np.arange(self.d_in_full) if self.rows is None else np.asarray(self.rows, np.int64)
        pos = np.flatnonzero(np.isin(rows, idx))  # base inputs that survive
        new_rows = np.searchsorted(idx, rows[pos])
        base = self.base if pos.size == rows.size else keep_inputs(self.base, pos)
        full = new_rows.size == idx.size
        return ChannelPruned(base=base, rows=None if full else tuple(new_rows.tolist()),
                             cols=self.cols, d_in_full=int(idx.size), d_out_full=self.d_out_full)

    def keep_outputs(self, idx):
        idx = np.asarray(idx, np.int64)
        cols = np.arange(self.d_out_full) if self.cols is None else np.asarray(self.cols, np.int64)
        pos = np.flatnonzero(np.isin(cols, idx))
        new_cols = np.searchsorted(idx, cols[pos])
        base = self.base if pos.size == cols.size else keep_outputs(self.base, pos)
        full = new_cols.size == idx.size
        return ChannelPruned(base=base, rows=self.rows, cols=None if full else
                             tuple(new_cols.tolist()), d_in_full=self.d_in_full,
                             d_out_full=int(idx.size))

    def logical_axes(self):
        return {}


ChannelPruned = leaf_dataclass(ChannelPruned, meta=("rows", "cols", "d_in_full", "d_out_full"))


def pruned_leaf(base: Leaf, rows, cols, d_in: int, d_out: int) -> Leaf:
    """``base`` (already restricted to the kept channels) placed in the full widths: ``base``
    itself when nothing is gathered or scattered, else a :class:`ChannelPruned`.

    Args:
      base: the leaf on the kept channels, ``[len(rows), len(cols)]``.
      rows: sorted kept input positions in ``[0, d_in)`` (``None`` or all: no gather).
      cols: sorted kept output positions in ``[0, d_out)`` (``None`` or all: no scatter).
      d_in, d_out: the full widths.
    """
    rows = None if rows is None or len(rows) == d_in else tuple(int(r) for r in rows)
    cols = None if cols is None or len(cols) == d_out else tuple(int(c) for c in cols)
    if rows is None and cols is None:
        return base
    return ChannelPruned(base=base, rows=rows, cols=cols, d_in_full=int(d_in),
                         d_out_full=int(d_out))


@functools.singledispatch
def pruned_base(leaf: Any) -> tuple[Any, Callable[[Any], Any], Callable[[Any], Any]]:
    """``(base, put_back, base_inputs)``: the leaf a compression method should replace, how to
    put its replacement back, and what the base reads of the weight's inputs.

    For a :class:`ChannelPruned` leaf the base is the leaf on the kept channels,
    ``put_back(new)`` puts ``new`` (same shape as the base) behind the same gather and scatter,
    and ``base_inputs(x)`` is ``x[..., rows]`` (activations ``[..., d_in]`` entering the weight,
    for data-aware methods). So a method applied after ``prune`` (``svd``, ``binarize``) keeps
    the removed channels removed and uncounted instead of storing them as zeros. For any other
    leaf: ``(leaf, identity, identity)``. Leaf types outside lowrank_jax that wrap a leaf the
    same way register with ``pruned_base.register``.
    """
    return leaf, _same, _same


def _same(x: Any) -> Any:
    return x


@pruned_base.register
def _(leaf: ChannelPruned) -> tuple[Any, Callable[[Any], Any], Callable[[Any], Any]]:
    base, put, take = pruned_base(leaf.base)
    rows = None if leaf.rows is None else np.asarray(leaf.rows, np.int64)
    return (base, lambda new: dataclasses.replace(leaf, base=put(new)),
            lambda x: take(x if rows is None else np.asarray(x)[..., rows]))


# ---------------------------------------------------------------------------------------------
# Masks in a tree.

def is_channel_masked(x: Any) -> bool:
    """Whether ``x`` is a :class:`ChannelMasked` leaf."""
    return isinstance(x, ChannelMasked)


def mask_leaf(leaf: Leaf, m_in=None, m_out=None) -> ChannelMasked:
    """``leaf`` with channel masks (all ones by default, in the leaf's float dtype).

    Args:
      leaf: a weight leaf (a :class:`ChannelMasked` leaf gets its masks replaced).
      m_in, m_out: optional masks ``[d_in]`` / ``[d_out]``.
    """
    if isinstance(leaf, ChannelMasked):
        leaf = leaf.base
    if not isinstance(leaf, Leaf):
        raise LeafTypeError(f"mask_leaf: expected a weight leaf, got {type(leaf).__name__}",
                            expected="Leaf", actual=type(leaf).__name__)
    from lowrank_jax.leaves.base import leaf_dtype

    dt = leaf_dtype(leaf)
    m_in = jnp.ones((leaf.d_in,), dt) if m_in is None else jnp.asarray(m_in, dt)
    m_out = jnp.ones((leaf.d_out,), dt) if m_out is None else jnp.asarray(m_out, dt)
    return ChannelMasked(base=leaf, m_in=m_in, m_out=m_out)


def channel_masks(tree: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{path: (m_in, m_out)}`` (NumPy) of every :class:`ChannelMasked` leaf of ``tree``."""
    return {p: (np.asarray(n.m_in), np.asarray(n.m_out)) for p, n in named_leaves(tree)
            if isinstance(n, ChannelMasked)}


def with_channel_masks(tree: Any, masks: dict[str, tuple[Any, Any]]) -> Any:
    """A new tree whose :class:`ChannelMasked` leaves at the paths of ``masks`` carry the given
    ``(m_in, m_out)`` (cast to the current masks' dtype; shapes checked).

    Raises:
      KeyError: a path of ``masks`` is not a masked leaf of ``tree``.
    """
    todo = dict(masks)

    def put(path, node):
        if path not in todo:
            return node
        if not isinstance(node, ChannelMasked):
            raise PathError(f"with_channel_masks: {path} is a {type(node).__name__}, not a "
                           "ChannelMasked leaf")
        m_in, m_out = todo.pop(path)
        return ChannelMasked(base=node.base, m_in=jnp.asarray(m_in, node.m_in.dtype),
                             m_out=jnp.asarray(m_out, node.m_out.dtype))

    out = map_with_path(put, tree)
    if todo:
        raise PathError(f"with_channel_masks: no masked leaf at {sorted(todo)}")
    return out


def mask_selector(tree: Any) -> Any:
    """A bool tree with ``tree``'s structure: ``True`` at the masks of every
    :class:`ChannelMasked` leaf, ``False`` elsewhere (for :func:`~lowrank_jax.partition`)."""

    def sel(node):
        if isinstance(node, ChannelMasked):
            return _selected(node)
        return jax.tree_util.tree_map(lambda _: False, node)

    return jax.tree_util.tree_map(sel, tree, is_leaf=is_leaf)


def _selected(node: ChannelMasked):
    return rebuild(node, base=jax.tree_util.tree_map(lambda _: False, node.base), m_in=True,
                   m_out=True)


def mask_partition(tree: Any) -> tuple[Any, Any]:
    """Split ``tree`` into ``(masks, rest)``: the masks of its :class:`ChannelMasked` leaves and
    everything else (``None`` in the other's places); :func:`~lowrank_jax.combine` rejoins them.

    ``jax.grad(lambda m: loss(combine(m, rest)))(masks)`` is ``dL/dm`` for every mask
    ("Less is More", eqs. 5-6), with the weights held fixed.
    """
    return partition(tree, mask_selector(tree))


def unmask(tree: Any) -> Any:
    """``tree`` with every :class:`ChannelMasked` leaf replaced by its base leaf."""
    return jax.tree_util.tree_map(
        lambda n: n.base if isinstance(n, ChannelMasked) else n, tree, is_leaf=is_leaf)


# ---------------------------------------------------------------------------------------------
# What a leaf can lose, and what it costs, without slicing it.

@functools.singledispatch
def output_granularity(leaf: Any) -> int | None:
    """How many consecutive outputs a leaf can lose at a time: 1 for a leaf whose output
    channels are independent, ``d_head`` for a :class:`~lowrank_jax.HeadLowRank` (whole heads
    only), ``None`` for a leaf that cannot lose channels one by one (a
    :class:`~lowrank_jax.Partitioned` leaf must keep as many per machine). Leaf types defined
    outside lowrank_jax default to 1 (register another value with
    ``output_granularity.register``)."""
    return 1


@output_granularity.register
def _(leaf: HeadLowRank) -> int:
    return leaf.d_head


@output_granularity.register
def _(leaf: Partitioned) -> None:
    return None


@output_granularity.register
def _(leaf: ChannelMasked) -> int | None:
    return output_granularity(leaf.base)


@output_granularity.register
def _(leaf: ChannelPruned) -> int | None:
    return output_granularity(leaf.base) if leaf.cols is None else 1


def kept_outputs(leaf: Any) -> tuple[int, ...] | None:
    """The output positions a leaf still computes after physical pruning (a
    :class:`ChannelPruned` that removed outputs: its ``cols``), ``None`` when every output is
    computed (any other leaf, or a plain array)."""
    if isinstance(leaf, ChannelPruned) and leaf.cols is not None:
        return tuple(int(c) for c in leaf.cols)
    return None


@functools.singledispatch
def input_granularity(leaf: Any) -> int | None:
    """As :func:`output_granularity`, for input channels (1 for every built-in leaf except
    :class:`~lowrank_jax.Partitioned`)."""
    return 1


@input_granularity.register
def _(leaf: Partitioned) -> None:
    return None


@input_granularity.register
def _(leaf: ChannelMasked) -> int | None:
    return input_granularity(leaf.base)


def _bool_idx(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.asarray(mask, bool))


@functools.singledispatch
def kept_counts(leaf: Any, rows: np.ndarray, cols: np.ndarray, n_tokens: int) -> tuple[int, int]:
    """``(parameters, multiply-adds for n_tokens rows)`` of ``leaf`` restricted to the input
    channels where ``rows`` is true and the output channels where ``cols`` is true: the counts
    of ``keep_outputs(keep_inputs(leaf, rows), cols)``, computed without slicing arrays for the
    built-in leaf types (the pruning schedule evaluates it many times). Other leaf types are
    sliced through the protocol.

    Args:
      leaf: a weight leaf.
      rows: bool ``[d_in]``.
      cols: bool ``[d_out]``.
      n_tokens: rows of input for the multiply-add count.
    """
    sub = keep_outputs(keep_inputs(leaf, _bool_idx(rows)), _bool_idx(cols))
    return sub.param_count(), sub.flops(n_tokens)


def _nb(leaf, cols) -> int:
    return int(np.count_nonzero(cols)) if bias_of(leaf) is not None else 0


@kept_counts.register
def _(leaf: Dense, rows, cols, n_tokens):
    r, c = int(np.count_nonzero(rows)), int(np.count_nonzero(cols))
    return r * c + _nb(leaf, cols), n_tokens * r * c


@kept_counts.register
def _(leaf: LowRank, rows, cols, n_tokens):
    r, c = int(np.count_nonzero(rows)), int(np.count_nonzero(cols))
    rank = leaf.rank if r and c else 0  # LowRank.keep_inputs / keep_outputs of nothing
    return rank * (r + c) + _nb(leaf, cols), n_tokens * rank * (r + c)


@kept_counts.register
def _(leaf: HeadLowRank, rows, cols, n_tokens):
    r = int(np.count_nonzero(rows))
    per_head = np.asarray(cols, bool).reshape(leaf.num_heads, leaf.d_head)
    if np.any(per_head.any(1) & ~per_head.all(1)):
        raise ShapeError("kept_counts: a HeadLowRank leaf can only lose whole heads",
                         expected="whole heads")
    heads = np.flatnonzero(per_head.all(1)) if r else np.zeros(0, np.int64)  # no input: rank 0
    ranks = [leaf.head_ranks[h] for h in heads]
    params = sum(k * (r + leaf.d_head) for k in ranks)
    # executed as HeadLowRank.flops says: on the true ranks when they are irregular and sum to
    # less than EXACT_BELOW of the padded ones, else padded to the widest
    exact = (leaf.ranks is not None
             and sum(ranks) < head_lowrank.EXACT_BELOW * len(ranks) * leaf.max_rank)
    flops = n_tokens * (sum(ranks) if exact else len(ranks) * leaf.max_rank) * (r + leaf.d_head)
    return int(params) + _nb(leaf, cols), int(flops)


def _nonzero_signs(leaf) -> np.ndarray:
    return np.asarray(leaf.signs) != 0


@kept_counts.register
def _(leaf: FrozenBinary, rows, cols, n_tokens):
    nz = _nonzero_signs(leaf)
    n = int(np.count_nonzero(nz[np.ix_(np.asarray(rows, bool), np.asarray(cols, bool))]))
    return n + 1 + _nb(leaf, cols), n_tokens * n


@kept_counts.register
def _(leaf: MaskedBinary, rows, cols, n_tokens):
    # surgery freezes the mask and alpha first (MaskedBinary.keep_inputs)
    if bool(np.all(rows)) and bool(np.all(cols)):
        return leaf.param_count(), leaf.flops(n_tokens)
    return kept_counts(leaf.freeze(), rows, cols, n_tokens)


@kept_counts.register
def _(leaf: FixedBias, rows, cols, n_tokens):
    params, flops = kept_counts(leaf.leaf, rows, cols, n_tokens)
    return params + int(np.count_nonzero(cols)), flops


@kept_counts.register
def _(leaf: ChannelMasked, rows, cols, n_tokens):
    return kept_counts(leaf.base, rows, cols, n_tokens)


@kept_counts.register
def _(leaf: ChannelPruned, rows, cols, n_tokens):
    r = rows if leaf.rows is None else np.asarray(rows, bool)[np.asarray(leaf.rows, np.int64)]
    c = cols if leaf.cols is None else np.asarray(cols, bool)[np.asarray(leaf.cols, np.int64)]
    return kept_counts(leaf.base, r, c, n_tokens)


@functools.singledispatch
def surgery_form(leaf: Any) -> Any:
    """The form a leaf takes under channel surgery, with all channels kept: the leaf itself,
    except a :class:`~lowrank_jax.MaskedBinary`, which surgery freezes first
    (:class:`~lowrank_jax.FrozenBinary`, same outputs), also inside a
    :class:`~lowrank_jax.leaves.FixedBias`. :func:`kept_counts` on it is cheap to evaluate
    many times."""
    return leaf


@surgery_form.register
def _(leaf: MaskedBinary) -> Any:
    return leaf.freeze()


@surgery_form.register
def _(leaf: FixedBias) -> Any:
    inner = surgery_form(leaf.leaf)
    return leaf if inner is leaf.leaf else FixedBias(inner, leaf.b)


# ---------------------------------------------------------------------------------------------
# Rows per leaf in one forward pass.

class _RowProbe(Leaf):
    """Records how many input rows it is applied to while a function is traced abstractly
    (used by :func:`count_rows` only; never stored in a model)."""

    base: Any
    tag: str = ""

    @property
    def shape(self):
        return self.base.shape

    def apply(self, x):
        _ROWS[self.tag] = _ROWS.get(self.tag, 0) + int(math.prod(x.shape[:-1]))
        return linear(self.base, x)

    def to_dense(self):
        return materialize(self.base)

    def param_count(self):
        return self.base.param_count()

    def storage_bits(self):
        return self.base.storage_bits()

    def flops(self, n_tokens):
        return self.base.flops(n_tokens)

    @property
    def bias(self):
        return bias_of(self.base)

    def with_bias(self, b):
        return dataclasses.replace(self, base=self.base.with_bias(b))

    def keep_inputs(self, idx):
        return dataclasses.replace(self, base=keep_inputs(self.base, idx))

    def keep_outputs(self, idx):
        return dataclasses.replace(self, base=keep_outputs(self.base, idx))

    def logical_axes(self):
        return {}


_RowProbe = leaf_dataclass(_RowProbe, meta=("tag",))
_ROWS: dict[str, int] = {}


def count_rows(fn: Callable[[Any], Any], tree: Any, paths: Iterable[str] | None = None
               ) -> dict[str, int]:
    """How many input rows (tokens times batch) each weight leaf of ``tree`` is applied to in
    ``fn(tree)``, from an abstract trace (``jax.eval_shape``: nothing is computed).

    Args:
      fn: runs the model, ``fn(params) -> anything``.
      tree: the parameter tree.
      paths: the leaves to count (default: every weight leaf).

    Returns:
      ``{path: rows}``; a leaf applied several times counts all its rows, a leaf never applied
      counts 0.
    """
    wanted = None if paths is None else set(paths)

    def wrap(path, node):
        if isinstance(node, Leaf) and (wanted is None or path in wanted):
            return _RowProbe(base=node, tag=path)
        return node

    probed = map_with_path(wrap, tree)
    _ROWS.clear()
    try:
        jax.eval_shape(fn, probed)
        got = dict(_ROWS)
    finally:
        _ROWS.clear()
    tags = [p for p, n in named_leaves(probed) if isinstance(n, _RowProbe)]
    return {p: int(got.get(p, 0)) for p in tags}


__all__ = [
    "ChannelMasked", "ChannelPruned", "channel_masks", "count_rows", "input_granularity",
    "is_channel_masked", "kept_counts", "kept_outputs", "mask_leaf", "mask_partition", "mask_selector",
    "output_granularity", "pruned_base", "pruned_leaf", "rebuild", "surgery_form", "unmask",
    "with_channel_masks",
]
