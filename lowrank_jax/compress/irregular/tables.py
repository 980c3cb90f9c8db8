"""Reading a plan's query-key rows: the ranks chosen per head (and their layer x head heat
map), and a table per attention block of its parameter and FLOP ratios and errors (what
``lowrank-jax compress`` prints and writes)."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.irregular.counts import QK_KINDS, executed_macs
from lowrank_jax.compress.irregular.methods import block_of


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
        parent, b0 = block_of(params_before, path, row.kind)
        _, b1 = block_of(params_after, path, row.kind)
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
        m0, m1 = executed_macs(b0, n), executed_macs(b1, n)
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

__all__ = ["format_layer_table", "head_ranks", "layer_table", "save_head_rank_plot"]
