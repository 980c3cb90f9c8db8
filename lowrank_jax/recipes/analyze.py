"""The ``analyze`` workflow: eps-ranks and spectra of every weight of a model, and optionally
the compression ratio -> output error curve and per-head rank sweeps."""

from __future__ import annotations

from typing import Sequence

from lowrank_jax.errors import LeafTypeError
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.progress import Progress, lines


def run_analyze(model: str, *, eps: Sequence[float] = (0.01, 0.05, 0.1),
                pattern: str | None = None, family: str | None = None,
                sweep_eps: Sequence[float] | None = None, sweep_heads: bool = False,
                sweep_ranks: Sequence[int] | None = None,
                status: Progress | None = None) -> Outcome:
    """Analyze a lowrank_jax checkpoint or a Hugging Face directory.

    Args:
      model: the checkpoint or Hugging Face directory
        (:func:`lowrank_jax.recipes.sources.load_source`).
      eps: the eps thresholds of the eps-ranks.
      pattern: only weights whose path matches this regular expression.
      family: force the model family of a Hugging Face directory.
      sweep_eps: also the ratio -> error curve over these eps (Table 2 of "Understanding
        Transformers for Time Series"; the output error needs a model checkpoint).
      sweep_heads: also a per-head rank sweep of every attention block (synthetic N(0, 1)
        inputs; head counts and widths come from the parameters).
      sweep_ranks: the ranks of the per-head sweep (default: powers of 2 up to the head width).
      status: progress reporting (default: status lines on stderr).

    Returns:
      The :meth:`~lowrank_jax.analysis.AnalysisReport.to_dict` report, with ``sweep``
      (``eps`` and/or ``heads``) when a sweep was asked for, and its tables as lines.
    """
    from lowrank_jax.analysis import analyze
    from lowrank_jax.recipes import sources

    status = lines(status, "analyze")
    src = sources.load_source(model, status=status, family=family)
    status.say(f"eps-ranks and spectra of every weight ({pattern or 'all weights'})")
    report = analyze(src.params, eps=eps, pattern=pattern, progress=status.bars)
    out = Outcome(report.to_dict(), lines=[report.format_table()])
    if sweep_eps or sweep_heads:
        out["sweep"] = {}
    if sweep_eps:
        out["sweep"]["eps"] = _eps_sweep(src.config, src.params, sweep_eps, status, out.lines)
    if sweep_heads:
        out["sweep"]["heads"] = _head_sweeps(src.params, sweep_ranks, status, out.lines)
    return out


def _eps_sweep(config, params, values: Sequence[float], status: Progress,
               text: list[str]) -> list[dict]:
    """The ratio -> error curve (Table 2 of "Understanding Transformers for Time Series")."""
    from lowrank_jax.compress import eps_sweep

    with status.phase(f"eps sweep over {len(values)} values (decompositions, one "
                      "compile, one run per value)"):
        rows = eps_sweep(config, params, None, values)
    if config is None:
        text.append("\neps sweep (bare parameter tree, no model config: sizes and weight errors "
                    "only; save a model checkpoint to get the output error)")
    else:
        text.append(f"\neps sweep ({type(config).__name__}, attention q/k/v/o truncated at eps, "
                    f"one compiled run; error of '{rows[0]['output']}' on sample inputs)")
    head = f"{'eps':>8}  {'size ratio':>10}  {'max weight err':>14}"
    head += f"  {'rel output err':>14}" if config is not None else ""
    text.append(head)
    for r in rows:
        line = f"{r['eps']:>8.4g}  {r['size_ratio']:>10.4f}  {r['max_weight_error']:>14.3e}"
        line += f"  {r['rel_error']:>14.3e}" if config is not None else ""
        text.append(line)
    return rows


def _head_sweeps(params, sweep_ranks: Sequence[int] | None, status: Progress,
                 text: list[str]) -> list[dict]:
    """head_rank_sweep on every attention block, on synthetic N(0, 1) inputs. Head counts,
    widths and the logit scale come from each block's parameters."""
    import numpy as np

    from lowrank_jax.compress import attention_blocks, head_rank_sweep

    rng = np.random.default_rng(0)
    out = []
    blocks = attention_blocks(params)
    status.say(f"per-head rank sweep of {len(blocks)} attention blocks")
    for prefix, block in status.bar(blocks, desc="head sweeps", unit="block"):
        qk = block["qk"]
        proj = qk.projections()  # the per-head form (QueryKey); None for a joint tensor
        if proj is None:
            raise LeafTypeError(
                f"--sweep-heads: the attention block {prefix} has no per-head query and key "
                f"projections (its query-key object is a {type(qk).__name__}); the per-head "
                "rank sweep truncates q, k and v of one head", where=prefix,
                expected="a QueryKey", actual=type(qk).__name__)
        k = min(qk.d_q_in, max(proj.widths, default=0))
        if k == 0:  # every head (or every query/key channel) pruned: nothing to truncate
            out.append({"block": prefix, "ranks": [], "rel_error": []})
            continue
        ranks = sorted({r for r in (sweep_ranks or []) if 0 <= r <= k}) or sorted(
            {min(2 ** i, k) for i in range(int(np.log2(k)) + 1)} | {k})
        x = rng.normal(size=(2, 32, qk.d_q_in)).astype(np.float32)
        kv = None if qk.d_k_in == qk.d_q_in and "cross" not in prefix else rng.normal(
            size=(2, 32, qk.d_k_in)).astype(np.float32)
        err = np.asarray(head_rank_sweep(block, x, None, ranks, kv=kv))
        out.append({"block": prefix, "ranks": ranks, "rel_error": err.tolist()})
    text.append(f"\nper-head rank sweep (q/k/v of one head truncated, synthetic N(0, 1) inputs, "
                f"relative output error; {len(out)} attention blocks)")
    for b in out:
        if not b["ranks"]:
            text.append(f"{b['block']}  no query/key channels left (pruned): nothing to truncate")
            continue
        text.append(f"{b['block']}  ranks {b['ranks']}")
        for h, row in enumerate(b["rel_error"]):
            text.append(f"  head {h:>2}: " + " ".join(f"{e:.2e}" for e in row))
    return out


__all__ = ["run_analyze"]
