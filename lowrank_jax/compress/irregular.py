"""Irregular attention: TruncAtt, CP-SlimAtt and IrrAtt on the joint query-key tensor, and
TruncAtt of the value-output side.

"Vision Transformer with Irregular Attention" (sec. 2-3) compresses the query-key tensor
``Y: [F, F, H]`` (``Y_h = W^Q_h (W^K_h)^T``) of every attention block as a whole. Four plan
methods (``selects='qk'`` for the first three: their rules match ``'.../attn/qk'``):

* ``truncatt`` -- per-head truncated SVD of every slice ``Y_h`` (sec. 2.3; note that it
  factorizes the *product* of a head's query and key weights, not each of them) into a
  :class:`~lowrank_jax.QueryKey` whose per-head widths are the ranks (irregular ranks allowed).
  Row ``error``: ``||Y - Y_r||_F / ||Y||_F``, the root sum of squares of the discarded singular
  values over the norm.
* ``cp`` -- CP-SlimAtt (eqs. 3-4): a rank-``R`` CP of ``Y`` (:func:`~lowrank_jax.decomp.cp_als`
  from an SVD initialisation, then :func:`~lowrank_jax.decomp.cp_epc`) into a
  :class:`~lowrank_jax.leaves.qk_factorized.CPQueryKey`.
* ``btd`` -- IrrAtt (eqs. 5-6, Algorithms 1-3): a BTD-(L,L,1) of ``Y`` with one term per head
  and total rank ``R`` (:func:`~lowrank_jax.decomp.btd_ll1`) into a
  :class:`~lowrank_jax.leaves.qk_factorized.BTDQueryKey`; or, with ``ranks`` given, the sweeps
  from the slices' truncated SVDs at those ranks.
* ``truncatt_vo`` (``selects='weights'``, rules match ``'.../attn/v'``) -- per-head truncated SVD
  of ``W^V_h (W^O_h)^T`` (the paper's VO compression in every experiment): the value and output
  projections of the block get per-head widths equal to the ranks (its
  :class:`~lowrank_jax.HeadLayout` value widths change; the query-key side is untouched).

Biases are exact: the tensor is taken over the inputs augmented with a constant feature
(:func:`~lowrank_jax.leaves.qk_factorized.augmented_joint`; a bias row or column that is zero
everywhere, as in T5, is left out). ``drop_key_bias=True`` zeroes the key-bias column first:
its entries (``x_q W^Q_h b_k + b_q . b_k``) are constant along each row of logits and cancel in
the softmax, so attention outputs are unchanged while less has to be approximated (logits then
differ from the original by a per-query constant). The value bias is folded into the output
bias (``sum_h P_h 1 b_v^T W^O_h = 1 b_v^T W^O`` because softmax rows sum to one; this is not
exact together with fixed value activation masks, ``qkv_keep``). The original logit scale stays
in the block's head layout.

How much to keep is set by ``rank`` (``truncatt``: per head, an int or one int per head;
``cp``/``btd``: the total rank ``R``) or by ``flops_ratio`` with ``n_tokens`` (sec. 3.4, the
"local" rule: every selected block gets the same target): the largest rank whose multiply-adds
stay within ``flops_ratio`` of the block's as given, counted with the paper's formulas
(:func:`attention_macs`, including the ``N^2`` terms and IrrAtt's head fusion, which leaf-level
counts omit), the value-output side at ``vo_rank`` per head if given (the rank a later
``truncatt_vo`` step will apply) or as it is. With these formulas the ratios of Table 1 for
DeiT-S and DeiT-B are reproduced to 0.12 points (tested), and
``select_rank('truncatt', 0.375, n_tokens=197, d_model=384, num_heads=6, d_head=64, vo_rank=32)``
is 16.

Row ``details``: ``head_ranks`` (per head; for ``cp`` the number of rank-1 terms whose largest
fusion weight is in that head, Algorithm 1's assignment), ``rank``, the paper's MACs before and
after and their ratio (with ``n_tokens``), the executed MACs after (zero-padded irregular terms
count as executed), and for ``btd`` the fitting history. :func:`head_ranks` collects them from a
report (for the layer x head heat map, :func:`lowrank_jax.analysis.plots_heads.plot_head_ranks`).

A block without heads (every head pruned, :mod:`lowrank_jax.compress.empty`) has no slice to
factorize: its query-key object (and, for ``truncatt_vo``, its value and output projections) is
passed through unchanged with a row of kind ``'empty'``, before any per-head setting is read
(a list of ranks has one entry per head of the blocks that have heads). The other blocks are
compressed as without it.

What the paper leaves open is decided in :mod:`lowrank_jax.decomp.btd` (rank-0 terms, warm
starts, stopping rule, CPD-EPC) and here: ``btd`` caps each head's rank at the numerical rank
of its slice (at most ``d_head``; Algorithm 1 may give more, which a slice cannot use) and gives
the surplus columns to the heads with the next largest fusion weight; a head with rank 0 attends
exactly uniformly (its row of the fusion matrix is held at zero during the sweeps; see
:func:`btd`, setting ``rank0_uniform``), and ``details['uniform_heads']`` lists the heads whose
row of the fitted fusion matrix is zero. For ``cp``, a head whose ``head_ranks`` is 0 is not
uniform: every rank-1 term still reaches it through its row of ``S^H``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.registry import register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.decomp import btd_ll1, cp_als, cp_epc, cp_to_tensor
from lowrank_jax.errors import PlanError, ShapeError
from lowrank_jax.leaves import (
    QK,
    Dense,
    HeadLayout,
    QueryKey,
    as_query_key,
    bias_of,
    flops,
    get_path,
    head_offsets,
    is_query_key,
    leaf_dtype,
    materialize_host,
    replace_paths,
)
from lowrank_jax.leaves.qk_factorized import BTDQueryKey, CPQueryKey, augmented_joint
from lowrank_jax.nn import attention_params, attention_score_flops

QK_KINDS = ("dense", "truncatt", "cp", "btd")


# ---------------------------------------------------------------------------------------------
# The paper's counts (sec. 2-3, Table 1).

def _int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _per_head(rank, num_heads: int, what: str) -> list[int]:
    if _int(rank):
        return [int(rank)] * num_heads
    if isinstance(rank, Sequence) and not isinstance(rank, (str, bytes)) and len(rank) == num_heads \
            and all(_int(r) for r in rank):
        return [int(r) for r in rank]
    raise PlanError(f"{what} must be an int or {num_heads} ints (one per head), got {rank!r}",
                    where=what, expected=f"int or {num_heads} ints", actual=rank)


def attention_macs(qk: str, qk_rank=None, *, n_tokens: int, d_model: int, num_heads: int,
                   d_head: int, vo_rank=None, d_kv_in: int | None = None,
                   d_out: int | None = None) -> dict:
    """Multiply-adds of one attention block on ``N`` tokens, by the paper's formulas.

    "Vision Transformer with Irregular Attention": the original block costs
    ``4 N F D H + 2 H N^2 D`` (sec. 2.2), its query-key part ``N D H (2F + N)`` (sec. 2.3);
    TruncAtt ``N (sum_h R_h)(2F + N)``; CP-SlimAtt ``N R (2F + N H)`` (the count that reproduces
    Table 1; the text's ``N(N+1)HR`` also counts the ``N H R`` head expansion); IrrAtt
    ``N R (2F + N) + N^2 H^2`` (the head fusion, needed to reproduce Table 1). The value-output
    side costs ``N D H (2F + N)`` dense and ``N (sum_h r_h)(2F + N)`` under TruncAtt. Softmax is
    not counted. ``2F`` generalises to ``d_model + d_kv_in`` (query-key) and
    ``d_kv_in + d_out`` (value-output).

    Args:
      qk: ``'dense'``, ``'truncatt'``, ``'cp'`` or ``'btd'``.
      qk_rank: ``truncatt``: per-head rank (int, or one per head); ``cp``: ``R``; ``btd``: total
        rank ``R`` (int, or one per head); ignored for ``dense``.
      n_tokens: ``N``.
      d_model: ``F`` (the queries' input width).
      num_heads: ``H``.
      d_head: ``D`` of the dense block (query-key and value width per head).
      vo_rank: ``None`` (dense value-output) or the TruncAtt rank per head (int or one per head).
      d_kv_in: keys'/values' input width (default ``d_model``).
      d_out: output width (default ``d_model``).

    Returns:
      ``{'qk', 'vo', 'total'}`` multiply-adds.
    """
    n, f, h, d = int(n_tokens), int(d_model), int(num_heads), int(d_head)
    fk = f if d_kv_in is None else int(d_kv_in)
    fo = f if d_out is None else int(d_out)
    if qk == "dense":
        q = n * d * h * (f + fk + n)
    elif qk == "truncatt":
        q = n * sum(_per_head(qk_rank, h, "qk_rank")) * (f + fk + n)
    elif qk == "cp":
        q = n * int(qk_rank) * (f + fk + n * h)
    elif qk == "btd":
        r = int(qk_rank) if _int(qk_rank) else sum(_per_head(qk_rank, h, "qk_rank"))
        q = n * r * (f + fk + n) + n * n * h * h
    else:
        raise PlanError(f"attention_macs: qk must be one of {QK_KINDS}, got {qk!r}", where="qk",
                        expected=QK_KINDS, actual=qk)
    vo_sum = d * h if vo_rank is None else sum(_per_head(vo_rank, h, "vo_rank"))
    v = n * vo_sum * (fk + fo + n)
    return {"qk": int(q), "vo": int(v), "total": int(q + v)}


def attention_param_count(qk: str, qk_rank=None, *, d_model: int, num_heads: int, d_head: int,
                          vo_rank=None) -> dict:
    """Weights of one attention block by the paper's counts (biases not counted).

    Dense query-key ``2 F D H``; TruncAtt ``2 F sum_h R_h``; CP-SlimAtt ``2 F R + H R``; IrrAtt
    ``2 F R + H^2``; value-output ``2 F D H`` dense, ``2 F sum_h r_h`` under TruncAtt.

    Returns:
      ``{'qk', 'vo', 'total'}``.
    """
    f, h, d = int(d_model), int(num_heads), int(d_head)
    if qk == "dense":
        q = 2 * f * d * h
    elif qk == "truncatt":
        q = 2 * f * sum(_per_head(qk_rank, h, "qk_rank"))
    elif qk == "cp":
        q = 2 * f * int(qk_rank) + h * int(qk_rank)
    elif qk == "btd":
        r = int(qk_rank) if _int(qk_rank) else sum(_per_head(qk_rank, h, "qk_rank"))
        q = 2 * f * r + h * h
    else:
        raise PlanError(f"attention_param_count: qk must be one of {QK_KINDS}, got {qk!r}",
                        where="qk", expected=QK_KINDS, actual=qk)
    vo_sum = d * h if vo_rank is None else sum(_per_head(vo_rank, h, "vo_rank"))
    v = 2 * f * vo_sum
    return {"qk": int(q), "vo": int(v), "total": int(q + v)}


def select_rank(qk: str, flops_ratio: float, *, n_tokens: int, d_model: int, num_heads: int,
                d_head: int, vo_rank=None, before: int | None = None, max_rank: int | None = None,
                d_kv_in: int | None = None, d_out: int | None = None) -> int:
    """The largest rank whose block multiply-adds stay within ``flops_ratio`` (sec. 3.4).

    "Vision Transformer with Irregular Attention": ``FLOPs(R) / FLOPs_orig <= CR`` with ``R``
    the per-head rank (TruncAtt), the CP rank, or the total BTD rank, counted by
    :func:`attention_macs` (value-output side at ``vo_rank``).

    Args:
      qk: ``'truncatt'``, ``'cp'`` or ``'btd'``.
      flops_ratio: the target ``CR`` in ``(0, 1]``.
      n_tokens, d_model, num_heads, d_head, vo_rank, d_kv_in, d_out: see :func:`attention_macs`.
      before: ``FLOPs_orig`` (default: the dense block's :func:`attention_macs`).
      max_rank: largest rank considered (default: ``d_head`` for TruncAtt, ``(d+1)^2`` else).

    Returns:
      The rank (``0`` is possible for TruncAtt and BTD).

    Raises:
      PlanError: even rank 0 (1 for CP) exceeds the target.
    """
    kw = dict(n_tokens=n_tokens, d_model=d_model, num_heads=num_heads, d_head=d_head,
              vo_rank=vo_rank, d_kv_in=d_kv_in, d_out=d_out)
    if before is None:
        before = attention_macs("dense", **{**kw, "vo_rank": None})["total"]
    if max_rank is None:
        max_rank = d_head if qk == "truncatt" else (d_model + 1) * ((d_kv_in or d_model) + 1)
    lo = 1 if qk == "cp" else 0

    def ratio(r):
        return attention_macs(qk, r, **kw)["total"] / before

    if ratio(lo) > flops_ratio:
        raise PlanError(f"select_rank: {qk} at rank {lo} already costs {ratio(lo):.4f} of the "
                        f"block, more than flops_ratio={flops_ratio}", where="flops_ratio",
                        expected=f">= {ratio(lo):.4f}", actual=flops_ratio)
    r = lo
    while r < max_rank and ratio(r + 1) <= flops_ratio:  # cost grows with the rank
        r += 1
    return r


# ---------------------------------------------------------------------------------------------
# From the augmented tensor to query-key objects.

def _bias_rows(y: np.ndarray) -> tuple[bool, bool]:
    """Whether the query-bias row / key-bias column of an augmented tensor are used."""
    return bool(np.any(y[-1] != 0)), bool(np.any(y[:, -1] != 0))


def _core(y: np.ndarray, qb: bool, kb: bool) -> np.ndarray:
    return y[: y.shape[0] - (0 if qb else 1), : y.shape[1] - (0 if kb else 1)]


def _leaf(factor: np.ndarray, d_in: int, with_bias: bool, dtype) -> Dense:
    w = jnp.asarray(factor[:d_in], dtype)
    b = jnp.asarray(factor[d_in], dtype) if with_bias else None
    return Dense(w=w, b=b)


def _slice_svds(y: np.ndarray):
    return [np.linalg.svd(y[:, :, h], full_matrices=False) for h in range(y.shape[2])]


def query_key_from_slices(y_aug: np.ndarray, ranks: Sequence[int], *, dtype=jnp.float32,
                          svds=None) -> tuple[QueryKey, float]:
    """TruncAtt: a :class:`~lowrank_jax.QueryKey` from per-head truncated SVDs of the slices of
    an augmented query-key tensor ("Vision Transformer with Irregular Attention", sec. 2.3).

    Head ``h`` keeps ``ranks[h]`` singular triplets of ``Y~_h``, split evenly
    (``U sqrt(S)`` for the queries, ``V sqrt(S)`` for the keys); the factors' last rows are the
    biases (left out where the tensor's bias row or column is zero).

    Args:
      y_aug: ``[d_q + 1, d_k + 1, H]`` (:func:`~lowrank_jax.leaves.qk_factorized.augmented_joint`).
      ranks: per-head ranks (clipped to the slice's size).
      dtype: dtype of the new leaves.
      svds: the slices' SVDs if already computed.

    Returns:
      ``(qk, error)``: ``error = sqrt(sum of the discarded squared singular values) /
      ||Y~||_F`` over the decomposed tensor.
    """
    y_aug = np.asarray(y_aug, np.float64)
    dq, dk = y_aug.shape[0] - 1, y_aug.shape[1] - 1
    qb, kb = _bias_rows(y_aug)
    y = _core(y_aug, qb, kb)
    svds = _slice_svds(y) if svds is None else svds
    qs, ks, widths, tail = [], [], [], 0.0
    for h, (u, s, vt) in enumerate(svds):
        r = int(min(max(int(ranks[h]), 0), s.size))
        root = np.sqrt(s[:r])
        qs.append(u[:, :r] * root)
        ks.append(vt[:r].T * root)
        widths.append(r)
        tail += float(np.sum(s[r:] ** 2))
    qf = np.concatenate(qs, axis=1) if qs else np.zeros((y.shape[0], 0))
    kf = np.concatenate(ks, axis=1) if ks else np.zeros((y.shape[1], 0))
    norm = float(np.linalg.norm(y))
    qk = QueryKey(q=_leaf(qf, dq, qb, dtype), k=_leaf(kf, dk, kb, dtype), widths=tuple(widths))
    return qk, (math.sqrt(tail) / norm if norm > 0 else 0.0)


def numerical_ranks(y_aug: np.ndarray, *, rtol: float = 1e-10, svds=None) -> list[int]:
    """Rank of every slice of a float64 tensor: singular values above ``rtol`` times the
    largest of the whole tensor (``svds``: the slices' SVDs if already computed)."""
    svs = ([np.linalg.svd(y_aug[:, :, h], compute_uv=False) for h in range(y_aug.shape[2])]
           if svds is None else [s for _, s, _ in svds])
    top = max((float(s[0]) for s in svs if s.size), default=0.0)
    return [int(np.sum(s > rtol * top)) if top > 0 else 0 for s in svs]


def to_query_key(qk: QK, *, max_width: int | None = None, rtol: float = 1e-10,
                 where: str = "qk") -> QueryKey:
    """Any query-key object as an equivalent :class:`~lowrank_jax.QueryKey` (separate q and k
    weights per head), exactly: a float64 SVD of every slice of its augmented query-key tensor,
    kept at the slice's numerical rank (relative ``rtol``).

    This is what the Hugging Face exporter uses for CP-SlimAtt and IrrAtt blocks. A slice of a
    CP model or of a block-term model with a general fusion matrix has rank up to ``R``, more
    than a head of ``d_head`` columns can hold.

    Args:
      qk: the query-key object.
      max_width: the widest head allowed (``d_head`` of the checkpoint); ``None``: no limit.
      rtol: relative threshold of the numerical rank.
      where: parameter path, for messages.

    Raises:
      ShapeError: a slice has rank above ``max_width`` (naming the path, the heads, their ranks
        and the limit).
    """
    separate = as_query_key(qk)
    if separate is not None:
        return separate
    y = augmented_joint(qk)
    qb, kb = _bias_rows(y)
    core = _core(y, qb, kb)
    ranks = numerical_ranks(core, rtol=rtol)
    if max_width is not None and max(ranks, default=0) > max_width:
        bad = {h: r for h, r in enumerate(ranks) if r > max_width}
        raise ShapeError(
            f"{where}: a {type(qk).__name__} cannot be written as separate q/k weights of "
            f"{max_width} columns per head exactly: the query-key slices of heads "
            f"{sorted(bad)} have ranks {[bad[h] for h in sorted(bad)]} > {max_width} (a CP "
            "model or a block-term model whose fusion matrix mixes terms has slices of rank up "
            "to R). Compress with truncatt, or with btd at ranks <= d_head and the fusion "
            "matrix kept diagonal, to export.", where=where, expected=f"ranks <= {max_width}",
            actual=ranks)
    new, _ = query_key_from_slices(y, ranks, dtype=leaf_dtype(qk))
    return new


# ---------------------------------------------------------------------------------------------
# Settings.

SETTINGS = ("rank", "flops_ratio", "n_tokens", "vo_rank", "drop_key_bias", "n_iter_max", "tol",
            "epc", "ranks", "n_iter_term", "cp_n_iter_max", "float64", "rank0_uniform")
OVERRIDES = ("rank", "flops_ratio", "vo_rank", "ranks")


def _check_settings(method: str, s: Mapping, *, complete: bool = True) -> None:
    """Check setting values; with ``complete`` also that exactly one way of choosing the rank
    is given (a step may leave it to per-rule overrides)."""
    given = [k for k in ("rank", "flops_ratio", "ranks") if s.get(k) is not None]
    if (complete and len(given) != 1) or len(given) > 1:
        raise PlanError(f"{method}: give exactly one of rank=, flops_ratio=" +
                        (", ranks=" if method == "btd" else "") + f"; got {given or 'none'}",
                        where="settings", expected="one of rank, flops_ratio", actual=given)
    fr = s.get("flops_ratio")
    if fr is not None:
        if isinstance(fr, bool) or not isinstance(fr, numbers.Real) or not 0 < fr <= 1:
            raise PlanError(f"{method}: flops_ratio must be in (0, 1], got {fr!r}",
                            where="flops_ratio", expected="(0, 1]", actual=fr)
        if not _int(s.get("n_tokens")) or s["n_tokens"] < 1:
            raise PlanError(f"{method}: flops_ratio needs n_tokens (the sequence length N of the "
                            f"paper's MAC formulas, an int >= 1), got {s.get('n_tokens')!r}",
                            where="n_tokens", expected="int >= 1", actual=s.get("n_tokens"))
    if s.get("n_tokens") is not None and (not _int(s["n_tokens"]) or s["n_tokens"] < 1):
        raise PlanError(f"{method}: n_tokens must be an int >= 1, got {s['n_tokens']!r}",
                        where="n_tokens", expected="int >= 1", actual=s["n_tokens"])
    rank = s.get("rank")
    if rank is not None and method in ("cp", "btd") and (not _int(rank) or rank < 1):
        raise PlanError(f"{method}: rank (the total rank R) must be an int >= 1, got {rank!r}",
                        where="rank", expected="int >= 1", actual=rank)
    if rank is not None and method in ("truncatt", "truncatt_vo") and not (
            (_int(rank) and rank >= 0) or (isinstance(rank, Sequence) and not isinstance(
                rank, str) and all(_int(r) and r >= 0 for r in rank))):
        raise PlanError(f"{method}: rank must be an int >= 0 or a list of them (one per head), "
                        f"got {rank!r}", where="rank", expected="int or list of ints",
                        actual=rank)
    for name in ("drop_key_bias", "epc", "float64", "rank0_uniform"):
        if name in s and not isinstance(s[name], bool):
            raise PlanError(f"{method}: {name} must be a bool, got {s[name]!r}", where=name,
                            expected="bool", actual=s[name])
    for name in ("n_iter_max", "n_iter_term", "cp_n_iter_max"):
        if name in s and (not _int(s[name]) or s[name] < 1):
            raise PlanError(f"{method}: {name} must be an int >= 1, got {s[name]!r}", where=name,
                            expected="int >= 1", actual=s[name])


def _validator(method):
    def validate(settings):
        _check_settings(method, settings, complete=False)
    return validate


# ---------------------------------------------------------------------------------------------
# Shared by the query-key methods.

def _block_of(params, path: str, method: str):
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    block = get_path(params, parent) if parent else params
    if not isinstance(block, dict) or not isinstance(block.get("heads"), HeadLayout):
        return parent, None
    return parent, block


def _executed_macs(block, n: int) -> int:
    return int(flops(block, n) + attention_score_flops(block, n, n))


def _target(method: str, sel, params, s, dims) -> tuple[Any, dict]:
    """The rank setting of a query-key step for one selection, and MAC bookkeeping."""
    qk = sel.node
    _, block = _block_of(params, sel.path, method)
    n = s.get("n_tokens")
    info = {}
    vo_after = None
    if n is not None and block is not None:
        _, v, o, heads = attention_params(block, sel.path)
        before = _executed_macs(block, n)
        if s.get("vo_rank") is not None:
            vr = _per_head(s["vo_rank"], heads.num_heads, "vo_rank")
            vo_after = attention_macs("dense", None, n_tokens=n, d_model=qk.d_q_in,
                                      num_heads=heads.num_heads, d_head=1, vo_rank=vr,
                                      d_kv_in=v.shape[0], d_out=o.shape[1])["vo"]
        else:
            vo_after = int(flops({"v": v, "o": o}, n)) + n * n * heads.num_heads * max(
                heads.v, default=0)
        info = {"n_tokens": n, "macs_before": before, "vo_macs_after": vo_after}
    if s.get("flops_ratio") is None:
        return (s.get("ranks") if method == "btd" and s.get("ranks") is not None
                else s["rank"]), info
    if block is None:
        raise PlanError(f"{method}: {sel.path}: flops_ratio needs the query-key object inside an "
                        "attention block ({'qk', 'v', 'o', 'heads'})", where=sel.path,
                        expected="an attention block", actual=sel.path)
    h = qk.num_heads
    before = info["macs_before"]

    def ratio(r):
        q = attention_macs(method, r, n_tokens=n, d_model=qk.d_q_in, num_heads=h, d_head=1,
                           d_kv_in=qk.d_k_in)["qk"]
        return (q + vo_after) / before

    lo = 1 if method == "cp" else 0
    hi = dims if method == "truncatt" else dims * h
    if ratio(lo) > s["flops_ratio"]:
        raise PlanError(f"{method}: {sel.path}: flops_ratio={s['flops_ratio']} is below what rank "
                        f"{lo} costs ({ratio(lo):.4f} of the block with the value-output side "
                        "as set)", where=sel.path, expected=f">= {ratio(lo):.4f}",
                        actual=s["flops_ratio"])
    r = lo
    while r < hi and ratio(r + 1) <= s["flops_ratio"]:
        r += 1
    return r, info


def _augmented(qk, s) -> np.ndarray:
    y = augmented_joint(qk)
    if s.get("drop_key_bias", False):
        y = y.copy()
        y[:, -1] = 0.0
    return y


def _finish_info(info: dict, method: str, rank, qk_before, qk_after, block, sel_path,
                 heads_n: int) -> dict:
    n = info.get("n_tokens")
    if n is None or block is None:
        return {}
    q = attention_macs(method, rank, n_tokens=n, d_model=qk_after.d_q_in, num_heads=heads_n,
                       d_head=1, d_kv_in=qk_after.d_k_in)["qk"]
    after = q + info["vo_macs_after"]
    new_block = {**block, "qk": qk_after}
    return {"n_tokens": n, "macs_before": info["macs_before"], "macs_after": int(after),
            "mhsa_flops_ratio": after / info["macs_before"],
            "executed_macs_after": _executed_macs(new_block, n)}


# ---------------------------------------------------------------------------------------------
# The methods.

def truncatt(params, selection, settings, ctx):
    """The ``truncatt`` plan method (module docstring): per-head truncated SVD of the joint
    query-key slices ("Vision Transformer with Irregular Attention", sec. 2.3).

    Args:
      params, selection, settings, ctx: the method signature of
        :func:`~lowrank_jax.compress.register_method`. Settings: ``rank`` (per head: an int or
        one per head) or ``flops_ratio`` with ``n_tokens``; ``vo_rank``; ``drop_key_bias``.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        _check_settings("truncatt", s)
        qk = sel.node
        if is_empty(qk):  # the query-key object of a block without heads
            rows.append(empty_row(sel))
            continue
        y = _augmented(qk, s)
        qb, kb = _bias_rows(y)
        core = _core(y, qb, kb)
        svds = _slice_svds(core)
        caps = numerical_ranks(core, svds=svds)
        rank, info = _target("truncatt", sel, params, s, max(caps, default=0))
        # a slice has no more than its numerical rank (at most d_head) to keep
        ranks = [min(r, c) for r, c in zip(_per_head(rank, qk.num_heads, f"{sel.path}: rank"),
                                           caps, strict=True)]
        out, err = query_key_from_slices(y, ranks, dtype=leaf_dtype(qk), svds=svds)
        new[sel.path] = out
        _, block = _block_of(params, sel.path, "truncatt")
        kept = list(out.projections().widths)
        details = {"head_ranks": kept, "rank": kept,
                   "uniform_heads": [h for h, r in enumerate(kept) if r == 0],
                   **_finish_info(info, "truncatt", kept, qk, out, block, sel.path,
                                  qk.num_heads)}
        rows.append(Row.compare(sel.path, qk, out, rule=sel.rule, kind="truncatt", error=err,
                                details=details))
    return replace_paths(params, new), rows


def _x64(s) -> bool:
    return bool(s.get("float64", True))


def cp(params, selection, settings, ctx):
    """The ``cp`` plan method: CP-SlimAtt ("Vision Transformer with Irregular Attention",
    eqs. 3-4) from CP-ALS (SVD initialisation) and the error-preserving correction.

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``rank`` (``R``) or
        ``flops_ratio`` with ``n_tokens``; ``vo_rank``; ``drop_key_bias``; ``n_iter_max``
        (ALS sweeps, default 100), ``tol`` (default 1e-8), ``epc`` (default ``True``),
        ``float64`` (decompose in float64, default ``True``).

    Row ``details['head_ranks']`` counts, per head, the rank-1 terms whose largest fusion weight
    lies in that head. A head that counts 0 still receives every term through its row of
    ``S^H`` (CP-ALS leaves no exact zeros there), so it does not attend uniformly and the row
    claims no uniform heads.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        _check_settings("cp", s)
        qk = sel.node
        if is_empty(qk):  # the query-key object of a block without heads
            rows.append(empty_row(sel))
            continue
        y = _augmented(qk, s)
        qb, kb = _bias_rows(y)
        core = _core(y, qb, kb)
        rank, info = _target("cp", sel, params, s, min(core.shape[:2]))
        with jax.enable_x64(_x64(s)):
            t = jnp.asarray(core, jnp.float64 if _x64(s) else jnp.float32)
            res = cp_als(t, int(rank), init="svd", n_iter_max=int(s.get("n_iter_max", 100)),
                         tol=float(s.get("tol", 1e-8)), key=ctx.key)
            factors, als_err = res.factors, float(res.errors[int(res.n_iter) - 1])
            if s.get("epc", True):
                factors = cp_epc(t, None, factors).factors
            fa, fb, fc = (np.asarray(f, np.float64) for f in factors)
            err = float(np.linalg.norm(core - np.asarray(cp_to_tensor(None, factors),
                                                         np.float64)) / np.linalg.norm(core))
        dtype = leaf_dtype(qk)
        out = CPQueryKey(q=_leaf(fa, qk.d_q_in, qb, dtype), k=_leaf(fb, qk.d_k_in, kb, dtype),
                         mix=jnp.asarray(fc, dtype))
        new[sel.path] = out
        _, block = _block_of(params, sel.path, "cp")
        assign = np.argmax(np.abs(fc), axis=0)
        head_r = [int(np.sum(assign == h)) for h in range(qk.num_heads)]
        details = {"rank": int(rank), "head_ranks": head_r, "als_error": als_err,
                   "als_iterations": int(res.n_iter),
                   **_finish_info(info, "cp", int(rank), qk, out, block, sel.path, qk.num_heads)}
        rows.append(Row.compare(sel.path, qk, out, rule=sel.rule, kind="cp", error=err,
                                details=details))
    return replace_paths(params, new), rows


def _pack_terms(a: np.ndarray, b: np.ndarray, ranks: Sequence[int]):
    """Padded term factors ``[T, d, L]`` -> side-by-side ``[d, sum(ranks)]``, each column pair
    rescaled to equal norms (the model is unchanged)."""
    qa, kb = [], []
    for t, r in enumerate(ranks):
        at, bt = a[t][:, :r], b[t][:, :r]
        na, nb = np.linalg.norm(at, axis=0), np.linalg.norm(bt, axis=0)
        ok = (na > 0) & (nb > 0)
        g = np.sqrt(np.where(ok, nb, 1.0) / np.where(ok, na, 1.0))
        qa.append(at * g)
        kb.append(bt / g)
    cat = (lambda xs, d: np.concatenate(xs, axis=1) if xs else np.zeros((d, 0)))
    return cat(qa, a.shape[1]), cat(kb, b.shape[1])


def _uniform_heads(c: np.ndarray, ranks: Sequence[int]) -> list[int]:
    """Heads whose logits are exactly zero: no term of rank > 0 has weight in their row of C."""
    live = np.asarray(ranks) > 0
    return [h for h in range(c.shape[0]) if not np.any(c[h, live] != 0)]


def btd(params, selection, settings, ctx):
    """The ``btd`` plan method: IrrAtt ("Vision Transformer with Irregular Attention",
    eqs. 5-6, Algorithms 1-3).

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``rank`` (total ``R``,
        per-head ranks from Algorithm 1) or ``flops_ratio`` with ``n_tokens``, or ``ranks``
        (one per head: the sweeps start from the slices' truncated SVDs at these ranks);
        ``vo_rank``; ``drop_key_bias``; ``n_iter_max`` (sweeps, default 50), ``tol`` (default
        1e-8), ``n_iter_term`` (Algorithm 2 iterations per term and sweep, default 1),
        ``cp_n_iter_max`` (default 100), ``epc`` (default ``True``), ``float64`` (default
        ``True``), ``rank0_uniform`` (default ``True``, below).

    A head of rank 0 (asked for with ``ranks``, or given none of the ``R`` columns by
    Algorithm 1) attends exactly uniformly by default: the sweeps hold its row of the fusion
    matrix ``C`` at zero (``zero_empty`` of :func:`~lowrank_jax.decomp.btd_ll1`), so no other
    term reaches it and its logits are exactly zero. Algorithm 3 as printed refits every term's
    fusion weights over all heads, and the other terms would give the head logits again; a head
    the user (or Algorithm 1) gave nothing should get nothing, and the ranks in the report
    should describe the model. ``rank0_uniform=False`` runs Algorithm 3 as printed (lower error
    where a head would profit from the others' terms). Row ``details['uniform_heads']`` is read
    off the fitted ``C``, not the ranks: the heads no term of rank > 0 reaches. Fine-tuning the
    fusion matrix afterwards can give those heads weights again.

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        _check_settings("btd", s)
        qk = sel.node
        if is_empty(qk):  # the query-key object of a block without heads
            rows.append(empty_row(sel))
            continue
        h = qk.num_heads
        y = _augmented(qk, s)
        qb, kb = _bias_rows(y)
        core = _core(y, qb, kb)
        rank, info = _target("btd", sel, params, s, min(core.shape[:2]))
        caps = numerical_ranks(core)
        with jax.enable_x64(_x64(s)):
            t = jnp.asarray(core, jnp.float64 if _x64(s) else jnp.float32)
            kw = dict(n_iter_max=int(s.get("n_iter_max", 50)), tol=float(s.get("tol", 1e-8)),
                      n_iter_term=int(s.get("n_iter_term", 1)),
                      zero_empty=bool(s.get("rank0_uniform", True)))
            if s.get("ranks") is not None:
                ranks_in = _per_head(s["ranks"], h, f"{sel.path}: ranks")
                res = btd_ll1(t, init="slices", ranks=ranks_in, **kw)
            else:
                total = int(rank)
                cap = max(caps) if total <= sum(caps) else None
                res = btd_ll1(t, total, init="cp", max_rank=cap, epc=bool(s.get("epc", True)),
                              cp_n_iter_max=int(s.get("cp_n_iter_max", 100)), key=ctx.key, **kw)
            a, b, c = (np.asarray(x, np.float64) for x in (res.a, res.b, res.c))
            ranks = [int(r) for r in np.asarray(res.ranks)]
            n_sweeps = int(res.n_iter)
            history = [float(e) for e in np.asarray(res.errors)[:n_sweeps]]
        fa, fb = _pack_terms(a, b, ranks)
        rec = np.einsum("il,jl->ijl", fa, fb)
        off = head_offsets(tuple(ranks))
        terms = np.stack([rec[:, :, off[t]:off[t + 1]].sum(-1) for t in range(len(ranks))], -1)
        err = float(np.linalg.norm(core - terms @ c.T) / np.linalg.norm(core))
        dtype = leaf_dtype(qk)
        out = BTDQueryKey(q=_leaf(fa, qk.d_q_in, qb, dtype), k=_leaf(fb, qk.d_k_in, kb, dtype),
                          mix=jnp.asarray(c, dtype), ranks=tuple(ranks))
        new[sel.path] = out
        _, block = _block_of(params, sel.path, "btd")
        details = {"rank": ranks, "head_ranks": ranks, "rank_total": int(sum(ranks)),
                   "slice_ranks": caps, "sweeps": n_sweeps, "errors": history,
                   "uniform_heads": _uniform_heads(c, ranks),
                   **_finish_info(info, "btd", int(sum(ranks)), qk, out, block, sel.path, h)}
        rows.append(Row.compare(sel.path, qk, out, rule=sel.rule, kind="btd", error=err,
                                details=details))
    return replace_paths(params, new), rows


def truncatt_vo(params, selection, settings, ctx):
    """The ``truncatt_vo`` plan method: per-head truncated SVD of ``W^V_h (W^O_h)^T``, the
    value-output compression of every experiment of "Vision Transformer with Irregular
    Attention" (sec. 4.2, VO rank 32).

    Rules select the value projections (``'.../attn/v'``); the block's output projection and
    head layout change with them. Head ``h`` keeps ``r_h`` singular triplets of the
    ``[d_kv_in, d_out]`` product (at most its value width: the product has no higher rank):
    ``v_h = U sqrt(S)``, ``o_h = sqrt(S) V^T``. The value bias is folded into the output bias
    (exact because softmax rows sum to one; the value leaf keeps a zero bias). Rows: one for
    ``v`` and one for ``o``; ``error`` is ``||Y - Y_r||_F / ||Y||_F`` over all heads' products.

    Args:
      params, selection, settings, ctx: the method signature. Settings: ``rank`` (an int, or
        one per head).

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        _check_settings("truncatt_vo", s)
        parent, block = _block_of(params, sel.path, "truncatt_vo")
        if block is None or not sel.path.endswith("/v"):
            raise PlanError(f"truncatt_vo: {sel.path} is not the value projection of an attention "
                            "block; select '.../attn/v' paths (for example rules=['attn/v$'])",
                            where=sel.path, expected=".../attn/v", actual=sel.path)
        _, v, o, heads = attention_params(block, parent)
        if is_empty(v):  # a block without heads (or value channels): nothing to truncate
            rows += [empty_row(sel), empty_row(sel, path=f"{parent}/o", node=o)]
            continue
        wv, wo = materialize_host(v), materialize_host(o)
        bv, bo = bias_of(v), bias_of(o)
        ranks_in = _per_head(s["rank"], heads.num_heads, f"{sel.path}: rank")
        off = head_offsets(heads.v)
        vs, os_, widths, tail, total = [], [], [], 0.0, 0.0
        for hh in range(heads.num_heads):
            prod = wv[:, off[hh]:off[hh + 1]] @ wo[off[hh]:off[hh + 1]]
            u, sv, vt = np.linalg.svd(prod, full_matrices=False)
            r = int(min(ranks_in[hh], heads.v[hh], sv.size))
            root = np.sqrt(sv[:r])
            vs.append(u[:, :r] * root)
            os_.append(root[:, None] * vt[:r])
            widths.append(r)
            tail += float(np.sum(sv[r:] ** 2))
            total += float(np.sum(sv ** 2))
        dtype = leaf_dtype(v)
        b_out = None
        if bo is not None or bv is not None:
            b_out = np.zeros(wo.shape[1]) if bo is None else np.asarray(bo, np.float64)
            if bv is not None:
                b_out = b_out + np.asarray(bv, np.float64) @ wo
        # the value bias now lives in the output bias; a zero one keeps the tree's structure
        # (checkpoints with value biases expect one)
        nv = Dense(w=jnp.asarray(np.concatenate(vs, axis=1), dtype),
                   b=None if bv is None else jnp.zeros((sum(widths),), dtype))
        no = Dense(w=jnp.asarray(np.concatenate(os_, axis=0), dtype),
                   b=None if b_out is None else jnp.asarray(b_out, dtype))
        layout = HeadLayout(ids=heads.ids, v=tuple(widths), scale=heads.scale)
        new[parent] = {**block, "v": nv, "o": no, "heads": layout}
        err = math.sqrt(tail / total) if total > 0 else 0.0
        details = {"head_ranks": widths, "rank": widths}
        rows.append(Row.compare(sel.path, v, nv, rule=sel.rule, kind="truncatt-vo", error=err,
                                details=details))
        rows.append(Row.compare(f"{parent}/o", o, no, rule=sel.rule, kind="truncatt-vo",
                                error=err, details=details))
    return replace_paths(params, new), rows


def head_ranks(report) -> dict[str, list[int]]:
    """``{path: ranks per head}`` of the query-key rows of a report (``truncatt``, ``cp``,
    ``btd``; the last step wins), for :func:`lowrank_jax.analysis.plots_heads.plot_head_ranks`.
    """
    out = {}
    for row in report.rows:
        if row.kind in ("truncatt", "cp", "btd") and "head_ranks" in row.details:
            out[row.path] = [int(r) for r in row.details["head_ranks"]]
    return out


def save_head_rank_plot(report, path: str, *, title: str | None = None) -> str | None:
    """Save the layer x head heat map of the ranks a report's ``truncatt`` / ``cp`` / ``btd``
    rows chose (:func:`lowrank_jax.analysis.plots_heads.plot_head_ranks`; needs matplotlib).

    Args:
      report: a :class:`~lowrank_jax.compress.Report`.
      path: the PNG file to write.
      title: figure title (default: the methods of those rows).

    Returns:
      ``path``, or ``None`` when the report has no such rows.
    """
    from lowrank_jax.analysis.plots_heads import plot_head_ranks

    ranks = head_ranks(report)
    if not ranks:
        return None
    kinds = sorted({r.kind for r in report.rows if r.path in ranks})
    return plot_head_ranks(ranks, path, title=title or f"query-key rank per head ({', '.join(kinds)})")


def layer_table(report, params_before, params_after, *, n_tokens: int | None = None,
                seed: int = 0, batch: int = 2) -> list[dict]:
    """Per attention block whose query-key tensor a plan compressed (``truncatt``, ``cp``,
    ``btd`` rows; the last such step wins): the ranks chosen per head, the block's parameter
    and FLOP ratios, and its errors (what ``lowrank-jax compress`` prints and writes).

    The block is the whole ``{qk, v, o}`` (a ``truncatt_vo`` step counts too). FLOPs are the
    multiply-adds executed on ``N`` tokens (weight leaves, the ``N^2`` score and value products;
    zero-padded irregular ranks count as executed), with ``N`` the step's ``n_tokens``, else
    ``n_tokens``, else 16; ``paper_flops_ratio`` is the row's ratio by the paper's formulas
    (present when the step had ``n_tokens``). ``output_error`` is
    ``||y' - y||_F / ||y||_F`` of the block's outputs (:func:`lowrank_jax.nn.apply_attention`,
    no mask or position bias) on ``batch`` sequences of ``N`` standard normal tokens drawn with
    ``seed``; ``tensor_error`` is the row's query-key tensor error.

    Args:
      report: the :class:`~lowrank_jax.compress.Report` of the plan.
      params_before, params_after: the trees the plan read and returned.
      n_tokens: ``N`` for rows whose step did not set ``n_tokens``.
      seed: seed of the sample tokens.
      batch: sample sequences.

    Returns:
      One dict per block, in report order: ``path`` (the block), ``method``, ``head_ranks``,
      ``rank``, ``params_before``, ``params_after``, ``params_ratio``, ``n_tokens``,
      ``macs_before``, ``macs_after``, ``flops_ratio``, ``paper_flops_ratio`` (or ``None``),
      ``tensor_error``, ``output_error``.
    """
    from lowrank_jax.leaves import param_count
    from lowrank_jax.nn import AttentionConfig, apply_attention

    rows = {}
    for row in report.rows:
        if row.kind in QK_KINDS[1:] and "head_ranks" in row.details:
            rows[row.path] = row
    out = []
    rng = np.random.default_rng(seed)
    for path, row in rows.items():
        parent, b0 = _block_of(params_before, path, row.kind)
        _, b1 = _block_of(params_after, path, row.kind)
        if b0 is None or b1 is None:
            continue
        n = int(row.details.get("n_tokens") or n_tokens or 16)
        qk = b0["qk"]
        x = jnp.asarray(rng.standard_normal((batch, n, qk.d_q_in)), jnp.float32)
        kv = x if qk.d_k_in == qk.d_q_in else jnp.asarray(
            rng.standard_normal((batch, n, qk.d_k_in)), jnp.float32)
        cfg = AttentionConfig()
        y0 = np.asarray(apply_attention(b0, x, cfg, kv=kv), np.float64)
        y1 = np.asarray(apply_attention(b1, x, cfg, kv=kv), np.float64)
        blk0 = {k: b0[k] for k in ("qk", "v", "o")}
        blk1 = {k: b1[k] for k in ("qk", "v", "o")}
        p0, p1 = param_count(blk0), param_count(blk1)
        m0, m1 = _executed_macs(b0, n), _executed_macs(b1, n)
        norm = float(np.linalg.norm(y0))
        rank = row.details.get("rank")
        out.append({
            "path": parent, "method": row.kind,
            "head_ranks": [int(r) for r in row.details["head_ranks"]],
            "rank": [int(r) for r in rank] if isinstance(rank, (list, tuple)) else rank,
            "params_before": int(p0), "params_after": int(p1), "params_ratio": p1 / max(p0, 1),
            "n_tokens": n, "macs_before": int(m0), "macs_after": int(m1),
            "flops_ratio": m1 / max(m0, 1),
            "paper_flops_ratio": row.details.get("mhsa_flops_ratio"),
            "tensor_error": None if row.error is None else float(row.error),
            "output_error": float(np.linalg.norm(y1 - y0)) / norm if norm > 0 else 0.0,
        })
    return out


def format_layer_table(layers: Sequence[Mapping]) -> str:
    """:func:`layer_table` as plain text, one line per attention block."""
    head = ("block", "method", "ranks per head", "params", "FLOPs (N)", "paper FLOPs",
            "tensor err", "output err")
    lines = []
    for r in layers:
        paper = r.get("paper_flops_ratio")
        te = r.get("tensor_error")
        lines.append((r["path"], r["method"], ",".join(map(str, r["head_ranks"])),
                      f"{r['params_ratio']:.4f}", f"{r['flops_ratio']:.4f} ({r['n_tokens']})",
                      "" if paper is None else f"{paper:.4f}", "" if te is None else f"{te:.3e}",
                      f"{r['output_error']:.3e}"))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    title = "attention blocks (query-key ranks per head; ratios after/before of the block)"
    return "\n".join([title, fmt(head), "-" * len(fmt(head)), *map(fmt, lines)])


def _is_qk(node) -> bool:
    return is_query_key(node)


register_method("truncatt", truncatt, selects="qk", settings=SETTINGS, overrides=OVERRIDES,
                accepts=_is_qk, validate=_validator("truncatt"))
register_method("cp", cp, selects="qk", settings=SETTINGS, overrides=OVERRIDES, accepts=_is_qk,
                validate=_validator("cp"))
register_method("btd", btd, selects="qk", settings=SETTINGS, overrides=OVERRIDES, accepts=_is_qk,
                validate=_validator("btd"))
register_method("truncatt_vo", truncatt_vo, selects="weights", settings=("rank",),
                overrides=("rank",), validate=_validator("truncatt_vo"))

__all__ = [
    "attention_macs", "attention_param_count", "btd", "cp", "format_layer_table", "head_ranks",
    "layer_table", "numerical_ranks", "query_key_from_slices", "save_head_rank_plot",
    "select_rank", "to_query_key", "truncatt", "truncatt_vo",
]
