"""Query-key objects: the second dispatch, beside ``x @ W``, for attention scores.

Attention logits need the query and key projections *jointly*: head ``h`` computes
``A_h = (x W^Q_h)(x_kv W^K_h)^T = x Y_h x_kv^T`` with ``Y_h = W^Q_h (W^K_h)^T`` a slice of the
query-key tensor ``Y: [d_q, d_k, h]`` ("Vision Transformer with Irregular Attention", sec. 2).
A factorization of the whole tensor (CP, block terms) cannot be written as separate ``q`` and
``k`` weights, so blocks never multiply queries by keys by hand: they call
:func:`attention_logits` on the block's query-key object, and each query-key type supplies its
own logits, counts and surgery.

:class:`QueryKey` is the default: two ordinary weight leaves ``q`` and ``k`` and the per-head
widths of their outputs. Irregular widths (per-head truncation of ``Y_h``, pruned channels) are
executed by zero-padding every head to the widest one, and counted as executed.

Query-key objects are *containers*: their weight leaves (``q``, ``k`` or a factorization's
factors) are ordinary :class:`~lowrank_jax.Leaf` s at paths like ``'.../attn/qk/q'``, so path
rules, counts, the trainable split and checkpoints see them like any other weight.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves.base import (
    CONCRETE,
    Leaf,
    keep_inputs,
    keep_outputs,
    leaf_dataclass,
    linear,
    materialize,
)
from lowrank_jax.leaves.heads import as_int_tuple, head_offsets, split_heads

Array = jax.Array


def _no_cache(qk) -> ConfigError:
    return ConfigError(
        f"{type(qk).__name__} does not support key-value caching (it implements no "
        "keys/logits_from_keys); decode without a cache", where="qk",
        expected="a query-key type with keys() and logits_from_keys()",
        actual=type(qk).__name__)


class Projections(NamedTuple):
    """A query-key object in the separable per-head form: queries ``split_heads(x @ q,
    widths)``, keys ``split_heads(x_kv @ k, widths)``, head ``h``'s logits their dot products.

    Fields:
      q, k: the query and key weights (leaves or plain arrays).
      widths: per-head widths of the queries and keys (head-major).
    """

    q: Any
    k: Any
    widths: tuple[int, ...]


class QK(abc.ABC):
    """Protocol of query-key objects (subclasses are :func:`leaf_dataclass` containers).

    Required: :attr:`num_heads`, :attr:`d_q_in`, :attr:`d_k_in`, :meth:`logits`,
    :meth:`score_flops`, :meth:`joint`, :meth:`keep_heads`, :meth:`keep_inputs`. Optional
    capabilities with defaults: :meth:`keys` / :meth:`queries` / :meth:`logits_from_queries`
    (cached decoding and batch chunks; the defaults raise), :meth:`keys_axis` (the axis of the
    key positions in what :meth:`keys` returns; default 1), :meth:`projections` (the separable
    per-head form that key folding and fixed activation masks need; default ``None``),
    :meth:`separable` (whether queries and keys can be projected apart).
    """

    @property
    @abc.abstractmethod
    def num_heads(self) -> int:
        """Number of heads whose logits :meth:`logits` returns."""

    @property
    @abc.abstractmethod
    def d_q_in(self) -> int:
        """Width of the queries' input."""

    @property
    @abc.abstractmethod
    def d_k_in(self) -> int:
        """Width of the keys' input."""

    @abc.abstractmethod
    def logits(self, xq: Array, xkv: Array, *, q_mask: Array | None = None,
               k_mask: Array | None = None) -> Array:
        """Unscaled logits ``[batch, heads, q_len, k_len]`` (biases of the projections
        included). Call :func:`attention_logits` instead.

        ``q_mask`` / ``k_mask`` are fixed activation masks ``[len, width]`` multiplied into the
        per-head queries and keys ("Sparse Binary Transformers", sec. 3.3.1); types without
        per-head query and key activations raise on them.
        """

    def keys(self, xkv: Array, *, k_mask: Array | None = None) -> Array:
        """What a key-value cache keeps of the keys' input: ``[batch, ...]`` with one entry
        per key along axis :meth:`keys_axis` (``[batch, k_len, ...]`` by default), so that
        ``logits(xq, xkv) == logits_from_keys(xq, keys(xkv))`` and keys computed one step at a
        time can be written into a preallocated buffer along that axis
        (:func:`lowrank_jax.nn.apply_attention_cached`). Types that implement both methods
        support cached decoding; the default raises."""
        raise _no_cache(self)

    def keys_axis(self) -> int:
        """The axis of the key positions in what :meth:`keys` returns (at least 1: axis 0 is
        the batch). Cached decoding writes new keys and reads the cache's length along it.
        Default 1 (``[batch, k_len, ...]``); :class:`QueryKey` keeps its per-head keys heads
        first (``[batch, heads, k_len, w]``, axis 2), the layout of the products that read
        them, so that a decoding step does not copy the cache into another layout."""
        return 1

    def logits_from_keys(self, xq: Array, keys: Array, *, q_mask: Array | None = None) -> Array:
        """Unscaled logits ``[batch, heads, q_len, k_len]`` of queries against keys from
        :meth:`keys` (possibly cached): ``logits_from_queries(queries(xq), keys)``."""
        return self.logits_from_queries(self.queries(xq, q_mask=q_mask), keys)

    def queries(self, xq: Array, *, q_mask: Array | None = None) -> Array:
        """The queries' side of the logits, ``[batch, q_len, ...]`` (the counterpart of
        :meth:`keys`): ``logits(xq, xkv) == logits_from_queries(queries(xq), keys(xkv))``, and
        both may be computed on a whole batch and then sliced along axis 0
        (:func:`lowrank_jax.nn.apply_attention` on CPU projects once, then computes the logits
        a chunk of the batch at a time). The default raises (see :meth:`keys`)."""
        raise _no_cache(self)

    def logits_from_queries(self, queries: Array, keys: Array) -> Array:
        """Unscaled logits ``[batch, heads, q_len, k_len]`` from :meth:`queries` and
        :meth:`keys`. The default raises (see :meth:`keys`)."""
        raise _no_cache(self)

    def separable(self) -> bool:
        """Whether :meth:`queries` and :meth:`keys` are implemented, so the projections can
        run on a whole batch and only the logits per chunk. Default: whether the type
        overrides both."""
        cls = type(self)
        return cls.queries is not QK.queries and cls.keys is not QK.keys

    def projections(self) -> Projections | None:
        """The object's separable per-head form (:class:`Projections`), or ``None``.

        A query-key object that answers lets attention fold its keys into the queries
        (:func:`lowrank_jax.nn.execution.fold_keys`, through :func:`~lowrank_jax.leaves.factors`
        of ``k``) and apply fixed per-head activation masks. Default ``None``: joint
        factorizations of the query-key tensor (CP, BTD) have no per-head keys.
        """
        return None

    @abc.abstractmethod
    def score_flops(self, q_len: int, k_len: int) -> int:
        """Multiply-adds of the logits beyond the projections (per batch element), as executed:
        for :class:`QueryKey`, ``q_len * k_len * heads * max(widths)`` (irregular widths run
        zero-padded to the widest head); factorizations add their head-fusion cost."""

    @abc.abstractmethod
    def joint(self) -> Array:
        """The query-key tensor ``Y: [d_q_in, d_k_in, heads]`` (projection biases excluded)."""

    @abc.abstractmethod
    def keep_heads(self, idx: np.ndarray) -> "QK":
        """The object restricted to the heads at positions ``idx`` (sorted, distinct; empty
        keeps no head, and nothing that only heads would read)."""

    @abc.abstractmethod
    def keep_inputs(self, idx: np.ndarray, side: str) -> "QK":
        """Input channels ``idx`` of the queries' (``side='q'``) or keys' (``'k'``) input kept."""


def is_query_key(x: Any) -> bool:
    """Whether ``x`` is a query-key object (any :class:`QK` type)."""
    return isinstance(x, QK)


def attention_logits(qk: QK, xq: Array, xkv: Array, *, q_mask: Array | None = None,
                     k_mask: Array | None = None) -> Array:
    """Logits ``[batch, heads, q_len, k_len]`` of any query-key object (unscaled).

    Args:
      qk: a :class:`QK` object (a block's ``params['qk']``).
      xq: queries' input ``[batch, q_len, d_q_in]``.
      xkv: keys' input ``[batch, k_len, d_k_in]``.
      q_mask, k_mask: optional fixed activation masks ``[len, width]``.
    """
    if not isinstance(qk, QK):
        raise ShapeError(f"attention_logits: expected a query-key object (QueryKey, ...), got "
                         f"{type(qk).__name__}", expected="QK", actual=type(qk).__name__)
    return qk.logits(xq, xkv, q_mask=q_mask, k_mask=k_mask)


class QueryKey(QK):
    """The default query-key object: weight leaves ``q``, ``k`` and per-head widths.

    Fields:
      q: ``[d_q_in, sum(widths)]`` weight leaf (any leaf type), bias allowed.
      k: ``[d_k_in, sum(widths)]`` weight leaf, bias allowed.
      widths: static width of every head, head-major (head ``h`` is the ``widths[h]``
        columns after the heads before it). A head of width 0 has constant logits: with no
        other bias it attends uniformly. Per-head truncated SVD of ``Y_h`` (TruncAtt) and
        pruned channels make widths differ between heads.
    """

    q: Any
    k: Any
    widths: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "widths", as_int_tuple(self.widths, "QueryKey widths"))
        for name in ("q", "k"):
            leaf = getattr(self, name)
            if isinstance(leaf, Leaf):
                d = leaf.d_out
            elif isinstance(leaf, CONCRETE):
                d = leaf.shape[-1]
            else:
                continue
            if d != sum(self.widths):
                raise ShapeError(
                    f"QueryKey: '{name}' has {d} outputs but the head widths {self.widths} "
                    f"sum to {sum(self.widths)}", where=name, expected=sum(self.widths),
                    actual=d)

    @classmethod
    def uniform(cls, q, k, num_heads: int) -> "QueryKey":
        """``q`` and ``k`` split into ``num_heads`` heads of equal width."""
        d = q.d_out if isinstance(q, Leaf) else np.shape(q)[-1]
        if num_heads < 1 or d % num_heads:
            raise ShapeError(f"QueryKey.uniform: num_heads={num_heads} does not divide the "
                             f"{d} outputs of q", expected="a divisor", actual=num_heads)
        return cls(q=q, k=k, widths=(d // num_heads,) * num_heads)

    @property
    def num_heads(self) -> int:
        return len(self.widths)

    @property
    def d_q_in(self) -> int:
        return self.q.d_in if isinstance(self.q, Leaf) else np.shape(self.q)[0]

    @property
    def d_k_in(self) -> int:
        return self.k.d_in if isinstance(self.k, Leaf) else np.shape(self.k)[0]

    def logits(self, xq, xkv, *, q_mask=None, k_mask=None):
        return self.logits_from_keys(xq, self.keys(xkv, k_mask=k_mask), q_mask=q_mask)

    def keys(self, xkv, *, k_mask=None):
        """Per-head keys ``[batch, heads, k_len, max(widths)]`` (zero-padded per head; heads
        before positions, :meth:`keys_axis` 2)."""
        k = split_heads(linear(self.k, xkv), self.widths)  # [b, k_len, h, w]
        if k_mask is not None:  # [k_len, w] -> [k_len, 1, w]: the same mask for every head
            k = k * k_mask[:, None, :].astype(k.dtype)
        return jnp.swapaxes(k, 1, 2)  # [b, h, k_len, w]

    def keys_axis(self):
        return 2

    def queries(self, xq, *, q_mask=None):
        """Per-head queries ``[batch, q_len, heads, max(widths)]`` (zero-padded per head)."""
        q = split_heads(linear(self.q, xq), self.widths)  # [b, q_len, h, w]
        if q_mask is not None:
            q = q * q_mask[:, None, :].astype(q.dtype)
        return q

    def logits_from_queries(self, queries, keys):
        return jnp.einsum("bqhd,bhkd->bhqk", queries, keys)  # keys heads first

    def projections(self) -> Projections:
        return Projections(self.q, self.k, self.widths)

    def score_flops(self, q_len, k_len):
        return int(q_len) * int(k_len) * self.num_heads * max(self.widths, default=0)

    def joint(self):
        q, k = materialize(self.q), materialize(self.k)
        off = head_offsets(self.widths)
        slices = [q[:, off[h]:off[h + 1]] @ k[:, off[h]:off[h + 1]].T
                  for h in range(self.num_heads)]
        return jnp.stack(slices, axis=-1)  # [d_q, d_k, h]

    def keep_heads(self, idx):
        idx = [int(i) for i in idx]
        off = head_offsets(self.widths)
        cols = np.concatenate([np.arange(off[h], off[h + 1]) for h in idx] or
                              [np.zeros(0, np.int64)]).astype(np.int64)
        return QueryKey(q=keep_outputs(self.q, cols), k=keep_outputs(self.k, cols),
                        widths=tuple(self.widths[h] for h in idx))

    def keep_channels(self, idx) -> "QueryKey":
        """Query/key channels ``idx`` (positions in the concatenated ``sum(widths)`` layout)
        kept in both projections: the channel-level removal of structured pruning. A head
        may be left with width 0 (it then attends uniformly, up to any bias)."""
        idx = np.asarray(idx, np.int64)
        off = head_offsets(self.widths)
        widths = tuple(int(np.sum((idx >= off[h]) & (idx < off[h + 1])))
                       for h in range(self.num_heads))
        return QueryKey(q=keep_outputs(self.q, idx), k=keep_outputs(self.k, idx), widths=widths)

    def keep_inputs(self, idx, side):
        if side not in ("q", "k"):
            raise ShapeError(f"QueryKey.keep_inputs: side must be 'q' or 'k', got {side!r}")
        if side == "q":
            return QueryKey(q=keep_inputs(self.q, idx), k=self.k, widths=self.widths)
        return QueryKey(q=self.q, k=keep_inputs(self.k, idx), widths=self.widths)


QueryKey = leaf_dataclass(QueryKey, meta=("widths",))


def as_query_key(qk: Any) -> QueryKey | None:
    """``qk`` as separate per-head query and key weights: ``qk`` itself when it is a
    :class:`QueryKey`, a ``QueryKey`` on its :meth:`QK.projections` when it has them, ``None``
    when it has none (a joint factorization: :func:`lowrank_jax.compress.to_query_key` solves
    for equivalent weights)."""
    if isinstance(qk, QueryKey):
        return qk
    proj = qk.projections() if isinstance(qk, QK) else None
    return None if proj is None else QueryKey(q=proj.q, k=proj.k, widths=proj.widths)

__all__ = ["QK", "Projections", "QueryKey", "as_query_key", "attention_logits", "is_query_key"]
