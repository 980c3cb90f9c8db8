"""Query-key objects for factorizations of the joint query-key tensor.

"Vision Transformer with Irregular Attention" (sec. 2-3) writes the logits of head ``h`` as
``A_h = X Y_h X^T`` with ``Y_h = W^Q_h (W^K_h)^T`` a slice of the query-key tensor
``Y: [d, d, H]``, and compresses the whole tensor:

* :class:`CPQueryKey` is CP-SlimAtt (eqs. 3-4): ``Y ~ sum_r S^Q(:, r) o S^K(:, r) o S^H(:, r)``
  with projections ``S^Q``, ``S^K`` shared by all heads and a fusion matrix ``S^H: [H, R]``;
  head ``h`` scores ``X S^Q diag(S^H(h, :)) (S^K)^T X^T``.
* :class:`BTDQueryKey` is IrrAtt (eqs. 5-6): ``Y ~ sum_t (A_t B_t^T) o c_t``, one block term of
  rank ``L_t`` per head (``sum_t L_t = R``) and a fusion matrix ``C = [c_1 ... c_T]: [H, T]``;
  head ``h`` scores ``sum_t C(h, t) (X A_t)(X B_t)^T``. With ``C = I`` it is TruncAtt with
  irregular per-head ranks; the head-fusion costs ``N^2 H T`` multiply-adds on top.

(TruncAtt itself, a per-head truncated SVD of ``Y_h``, is a plain
:class:`~lowrank_jax.QueryKey` whose per-head widths are the ranks.)

Both are containers of ordinary weight leaves, as :class:`~lowrank_jax.QueryKey` is: ``q`` and
``k`` are leaves (``Dense`` after a decomposition) whose outputs are the rank-1 terms' query and
key coordinates, so path rules, counts, the trainable split, sharding and checkpoints treat them
like any other weight; ``mix`` is a plain array. **Biases** are exact: the paper ignores them,
but DeiT has query and key biases; augmenting the input with a constant feature 1 makes
``x W + b = [x, 1] [W; b]``, so the query-key tensor is taken over ``d + 1`` features
(:func:`augmented_joint`) and the factors' last rows become the leaves' biases. The logit scale
(the original ``1/sqrt(d_head)``) stays in the block's :class:`~lowrank_jax.HeadLayout`.

:func:`augmented_joint` reads the augmented tensor of *any* query-key object from its logits
alone (four evaluations on basis inputs per entry, in float64), so decompositions and the
Hugging Face exporter work on every query-key type without reading its fields.
"""

from __future__ import annotations

from typing import Any

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
from lowrank_jax.leaves.heads import as_int_tuple, split_heads
from lowrank_jax.leaves.query_key import QK, attention_logits

Array = jax.Array


def _width(leaf, axis: int) -> int | None:
    if isinstance(leaf, Leaf):
        return leaf.shape[axis]
    if isinstance(leaf, CONCRETE):
        return int(np.shape(leaf)[axis])
    return None


def _no_masks(name: str, q_mask, k_mask) -> None:
    if q_mask is not None or k_mask is not None:
        raise ConfigError(f"{name}: fixed query/key activation masks (qkv_keep) need per-head "
                          f"query and key activations; a {name} has shared rank-1 coordinates "
                          "instead. Use a QueryKey for qkv_keep.", where="qkv_keep",
                          expected="QueryKey", actual=name)


def _check_inputs(name: str, q, k, width: int, what: str) -> None:
    for side, leaf in (("q", q), ("k", k)):
        d = _width(leaf, 1)
        if d is not None and d != width:
            raise ShapeError(f"{name}: '{side}' has {d} outputs but {what} is {width}",
                             where=side, expected=width, actual=d)


class _FactoredQK(QK):
    """What CP-SlimAtt and IrrAtt share: projections ``q``, ``k`` to rank-1 coordinates that
    every head reads, and a fusion matrix ``mix`` whose rows are the heads."""

    @property
    def num_heads(self) -> int:
        return int(np.shape(self.mix)[0])

    @property
    def d_q_in(self) -> int:
        return _width(self.q, 0)

    @property
    def d_k_in(self) -> int:
        return _width(self.k, 0)

    def logits(self, xq, xkv, *, q_mask=None, k_mask=None):
        _no_masks(type(self).__name__, q_mask, k_mask)
        return self.logits_from_keys(xq, self.keys(xkv))


class CPQueryKey(_FactoredQK):
    """CP-SlimAtt scores ("Vision Transformer with Irregular Attention", eqs. 3-4).

    Fields:
      q: ``[d_q_in, R]`` weight leaf (``S^Q``; its bias is the constant feature's row).
      k: ``[d_k_in, R]`` weight leaf (``S^K``).
      mix: ``[H, R]`` fusion matrix ``S^H`` (a plain array).

    Logits of head ``h``: ``sum_r (x_q S^Q + b_q)_r S^H(h, r) (x_k S^K + b_k)_r``, computed as
    the queries' coordinates scaled per head (``N H R`` multiply-adds, the paper's "+1" in
    ``N(N+1)HR``) and then contracted with the keys' (``N^2 H R``).
    """

    q: Any
    k: Any
    mix: Any

    def __post_init__(self):
        if isinstance(self.mix, CONCRETE):
            if np.ndim(self.mix) != 2:
                raise ShapeError(f"CPQueryKey: mix must be [heads, rank], got shape "
                                 f"{tuple(np.shape(self.mix))}", where="mix",
                                 expected="[heads, rank]", actual=tuple(np.shape(self.mix)))
            _check_inputs("CPQueryKey", self.q, self.k, int(np.shape(self.mix)[1]),
                          "the rank of mix")

    @property
    def rank(self) -> int:
        """The CP rank ``R``."""
        return int(np.shape(self.mix)[1])

    def keys(self, xkv, *, k_mask=None):
        """The keys' CP coordinates ``[batch, k_len, R]`` (shared by all heads: a cache of
        ``R`` numbers per key instead of ``heads * d_head``)."""
        _no_masks("CPQueryKey", None, k_mask)
        return linear(self.k, xkv)  # [b, k_len, R]

    def queries(self, xq, *, q_mask=None):
        """The queries' CP coordinates ``[batch, q_len, R]`` (scaled per head in
        :meth:`logits_from_queries`)."""
        _no_masks("CPQueryKey", q_mask, None)
        return linear(self.q, xq)  # [b, q_len, R]

    def logits_from_queries(self, queries, keys):
        q = queries
        # Heads ahead of the queries, so that the product's rows [b, (H, q_len)] are already
        # the logits' layout: with [b, q_len, H, R] XLA transposes the whole [b, H, q, k]
        # result afterwards (2.2x slower at 256 tokens, benchmarks/layers/query_key.py).
        mix = jnp.asarray(self.mix).astype(q.dtype)
        qh = q[:, None, :, :] * mix[None, :, None, :]  # [b, H, q_len, R]
        return jnp.einsum("bhqr,bkr->bhqk", qh, keys)

    def score_flops(self, q_len, k_len):
        h, r = self.num_heads, self.rank
        return int(q_len) * h * r + int(q_len) * int(k_len) * h * r

    def joint(self):
        return jnp.einsum("ir,jr,hr->ijh", materialize(self.q), materialize(self.k),
                          jnp.asarray(self.mix))

    def keep_heads(self, idx):
        if not len(idx):  # no head reads the shared coordinates: rank 0
            return CPQueryKey(q=keep_outputs(self.q, []), k=keep_outputs(self.k, []),
                              mix=jnp.asarray(self.mix)[:0, :0])
        return CPQueryKey(q=self.q, k=self.k, mix=jnp.asarray(self.mix)[np.asarray(idx, np.int64)])

    def keep_inputs(self, idx, side):
        if side not in ("q", "k"):
            raise ShapeError(f"CPQueryKey.keep_inputs: side must be 'q' or 'k', got {side!r}")
        if side == "q":
            return CPQueryKey(q=keep_inputs(self.q, idx), k=self.k, mix=self.mix)
        return CPQueryKey(q=self.q, k=keep_inputs(self.k, idx), mix=self.mix)


CPQueryKey = leaf_dataclass(CPQueryKey)


class BTDQueryKey(_FactoredQK):
    """IrrAtt scores: a BTD-(L,L,1) factorization of the query-key tensor ("Vision Transformer
    with Irregular Attention", eqs. 5-6).

    Fields:
      q: ``[d_q_in, sum(ranks)]`` weight leaf: the terms' ``A_t`` side by side (term-major),
        its bias the constant feature's row.
      k: ``[d_k_in, sum(ranks)]`` weight leaf: the ``B_t``.
      mix: ``[H, T]`` fusion matrix ``C`` (``C(h, t)``: weight of term ``t`` in head ``h``).
      ranks: static rank ``L_t`` of every term.

    Logits of head ``h``: ``sum_t C(h, t) (x_q A_t + a_t)(x_k B_t + b_t)^T``. Terms of unequal
    rank are executed zero-padded to the largest (the padding is gathered from an appended zero
    column: it is not a parameter, stays exactly zero and receives no gradient), so
    :meth:`score_flops` counts ``N^2 T max(ranks)`` for the terms plus ``N^2 H T`` for the head
    fusion. A term of rank 0 contributes nothing; with ``C = I`` its head's logits are
    constant (uniform attention, no NaN).
    """

    q: Any
    k: Any
    mix: Any
    ranks: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "ranks", as_int_tuple(self.ranks, "BTDQueryKey ranks"))
        if isinstance(self.mix, CONCRETE):
            if np.ndim(self.mix) != 2 or np.shape(self.mix)[1] != len(self.ranks):
                raise ShapeError(f"BTDQueryKey: mix must be [heads, terms={len(self.ranks)}], "
                                 f"got shape {tuple(np.shape(self.mix))}", where="mix",
                                 expected=f"[heads, {len(self.ranks)}]",
                                 actual=tuple(np.shape(self.mix)))
        _check_inputs("BTDQueryKey", self.q, self.k, sum(self.ranks), "sum(ranks)")

    @property
    def num_terms(self) -> int:
        return len(self.ranks)

    def keys(self, xkv, *, k_mask=None):
        """The keys' per-term coordinates ``[batch, k_len, T, max(ranks)]``."""
        _no_masks("BTDQueryKey", None, k_mask)
        return split_heads(linear(self.k, xkv), self.ranks)  # [b, k_len, T, L]

    def queries(self, xq, *, q_mask=None):
        """The queries' per-term coordinates ``[batch, q_len, T, max(ranks)]``."""
        _no_masks("BTDQueryKey", q_mask, None)
        return split_heads(linear(self.q, xq), self.ranks)  # [b, q_len, T, L]

    def logits_from_queries(self, queries, keys):
        q = queries
        # The terms with T leading make the head fusion one [H, T] @ [T, b q k] product;
        # fused per batch element ([b, T, q, k] and a batched [H, T] product) XLA:CPU ran it
        # 2.6x slower at 256 tokens (benchmarks/layers/query_key.py). One transpose of the logits
        # remains.
        terms = jnp.einsum("bqtl,bktl->tbqk", q, keys)  # [T, b, q_len, k_len]
        t, b, nq, nk = terms.shape
        mix = jnp.asarray(self.mix).astype(terms.dtype)
        heads = (mix @ terms.reshape(t, b * nq * nk)).reshape(mix.shape[0], b, nq, nk)
        return heads.transpose(1, 0, 2, 3)

    def score_flops(self, q_len, k_len):
        n = int(q_len) * int(k_len)
        return n * self.num_terms * max(self.ranks, default=0) + n * self.num_heads * self.num_terms

    def joint(self):
        q = split_heads(materialize(self.q), self.ranks)  # [d_q, T, L]
        k = split_heads(materialize(self.k), self.ranks)  # [d_k, T, L]
        return jnp.einsum("itl,jtl,ht->ijh", q, k, jnp.asarray(self.mix))

    def as_cp(self) -> CPQueryKey:
        """The same logits as a :class:`CPQueryKey` of rank ``R = sum(ranks)``: the head
        fusion folded into the queries (``S^Q = [A_1 ... A_T]``, ``S^K = [B_1 ... B_T]``,
        ``S^H(h, r) = C(h, t(r))`` for the term ``t(r)`` of column ``r``).

        Not from the paper: an execution choice for inference. The BTD form executes
        ``N^2 (T max(ranks) + H T)`` multiply-adds for the logits but writes and reads a
        ``[T, batch, N, N]`` intermediate for its head fusion, a pass over memory as large as
        the logits themselves per stage; the CP form executes more (``N^2 H R``) in one
        product with no intermediate. Which is faster depends on the term rank: on a 2-core
        AVX-512 CPU (``benchmarks/layers/query_key.py``, ``N = 256``, 512-8192 tokens, ``H`` = 8 and
        12 terms) the CP form was 1.0-1.9x faster at term rank 5 (though it executes 1.8-1.9x
        the multiply-adds), 0.7-1.2x at 14 and 0.6-0.9x at 30; measure on your
        hardware before choosing. The counts follow the form: a CPQueryKey counts what it
        executes.
        Parameters are the same arrays (``q``, ``k`` shared; ``mix`` gathered), so the result
        is no longer a BTD for further compression or fine-tuning of the fusion matrix.
        """
        term = np.repeat(np.arange(len(self.ranks)), self.ranks)  # term of every column
        return CPQueryKey(q=self.q, k=self.k, mix=jnp.asarray(self.mix)[:, term])

    def keep_heads(self, idx):
        if not len(idx):  # no head fuses the terms: no terms
            return BTDQueryKey(q=keep_outputs(self.q, []), k=keep_outputs(self.k, []),
                               mix=jnp.asarray(self.mix)[:0, :0], ranks=())
        return BTDQueryKey(q=self.q, k=self.k, mix=jnp.asarray(self.mix)[np.asarray(idx, np.int64)],
                           ranks=self.ranks)

    def keep_inputs(self, idx, side):
        if side not in ("q", "k"):
            raise ShapeError(f"BTDQueryKey.keep_inputs: side must be 'q' or 'k', got {side!r}")
        if side == "q":
            return BTDQueryKey(q=keep_inputs(self.q, idx), k=self.k, mix=self.mix,
                               ranks=self.ranks)
        return BTDQueryKey(q=self.q, k=keep_inputs(self.k, idx), mix=self.mix, ranks=self.ranks)


BTDQueryKey = leaf_dataclass(BTDQueryKey, meta=("ranks",))


def augmented_joint(qk: QK) -> np.ndarray:
    """The query-key tensor of any query-key object with its biases, in float64.

    With ``x~ = [x, 1]`` the logits of head ``h`` are ``x~_q Y~_h x~_k^T`` ("Vision Transformer
    with Irregular Attention", sec. 2.3, extended to biased projections): ``Y~`` is
    ``[d_q_in + 1, d_k_in + 1, H]``, its top-left block the tensor of :meth:`QK.joint`, its last
    row the query bias's terms ``b_q (W^K_h)^T``, its last column the key bias's
    ``W^Q_h b_k^T``, its corner ``b_q . b_k``. The entries are read from the logits on basis
    inputs (``e_i`` and 0 on each side; an affine-bilinear map is fixed by them), evaluated in
    float64, so this works for every query-key type through :func:`attention_logits` alone.

    Args:
      qk: a query-key object.

    Returns:
      ``float64 [d_q_in + 1, d_k_in + 1, heads]``.
    """
    if not isinstance(qk, QK):
        raise ShapeError(f"augmented_joint: expected a query-key object, got {type(qk).__name__}",
                         expected="QK", actual=type(qk).__name__)
    dq, dk = qk.d_q_in, qk.d_k_in
    with jax.enable_x64(True):
        qk64 = jax.tree_util.tree_map(
            lambda a: jnp.asarray(np.asarray(a, np.float64))
            if np.issubdtype(np.asarray(a).dtype, np.floating) else jnp.asarray(a), qk)
        xq = jnp.concatenate([jnp.zeros((1, dq)), jnp.eye(dq)])[None]  # [1, dq + 1, dq]
        xk = jnp.concatenate([jnp.zeros((1, dk)), jnp.eye(dk)])[None]
        lg = np.asarray(attention_logits(qk64, xq, xk)[0], np.float64)  # [H, dq + 1, dk + 1]
    y = np.empty((dq + 1, dk + 1, lg.shape[0]))
    base = lg[:, 0, 0]
    y[:dq, :dk] = np.transpose(lg[:, 1:, 1:] - lg[:, 1:, :1] - lg[:, :1, 1:]
                               + base[:, None, None], (1, 2, 0))
    y[:dq, dk] = (lg[:, 1:, 0] - base[:, None]).T
    y[dq, :dk] = (lg[:, 0, 1:] - base[:, None]).T
    y[dq, dk] = base
    return y


__all__ = ["BTDQueryKey", "CPQueryKey", "augmented_joint"]
