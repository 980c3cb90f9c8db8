"""The paper's counts of an attention block ("Vision Transformer with Irregular Attention",
sec. 2-3, Table 1): multiply-adds and weights of the dense, TruncAtt, CP-SlimAtt and IrrAtt
query-key sides and of the value-output side, the rank that meets a FLOP ratio (sec. 3.4), and
the multiply-adds a block actually executes."""

from __future__ import annotations

import numbers
from typing import Sequence

from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import flops
from lowrank_jax.nn import attention_score_flops

#: The query-key sides :func:`attention_macs` counts.
QK_KINDS = ("dense", "truncatt", "cp", "btd")


def is_int(x) -> bool:
    """Whether ``x`` is an int (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def per_head(rank, num_heads: int, what: str) -> list[int]:
    """``rank`` (an int, or one int per head) as one int per head.

    Raises:
      PlanError: anything else (naming ``what``).
    """
    if is_int(rank):
        return [int(rank)] * num_heads
    if isinstance(rank, Sequence) and not isinstance(rank, (str, bytes)) and len(rank) == num_heads \
            and all(is_int(r) for r in rank):
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
        q = n * sum(per_head(qk_rank, h, "qk_rank")) * (f + fk + n)
    elif qk == "cp":
        q = n * int(qk_rank) * (f + fk + n * h)
    elif qk == "btd":
        r = int(qk_rank) if is_int(qk_rank) else sum(per_head(qk_rank, h, "qk_rank"))
        q = n * r * (f + fk + n) + n * n * h * h
    else:
        raise PlanError(f"attention_macs: qk must be one of {QK_KINDS}, got {qk!r}", where="qk",
                        expected=QK_KINDS, actual=qk)
    vo_sum = d * h if vo_rank is None else sum(per_head(vo_rank, h, "vo_rank"))
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
        q = 2 * f * sum(per_head(qk_rank, h, "qk_rank"))
    elif qk == "cp":
        q = 2 * f * int(qk_rank) + h * int(qk_rank)
    elif qk == "btd":
        r = int(qk_rank) if is_int(qk_rank) else sum(per_head(qk_rank, h, "qk_rank"))
        q = 2 * f * r + h * h
    else:
        raise PlanError(f"attention_param_count: qk must be one of {QK_KINDS}, got {qk!r}",
                        where="qk", expected=QK_KINDS, actual=qk)
    vo_sum = d * h if vo_rank is None else sum(per_head(vo_rank, h, "vo_rank"))
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


def executed_macs(block, n: int) -> int:
    """Multiply-adds an attention block executes on ``n`` tokens: its weight leaves, and the
    ``N^2`` score and value products (zero-padded irregular heads count as executed)."""
    return int(flops(block, n) + attention_score_flops(block, n, n))


__all__ = ["QK_KINDS", "attention_macs", "attention_param_count", "executed_macs", "select_rank"]
