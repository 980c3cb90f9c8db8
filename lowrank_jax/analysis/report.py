"""Per-layer rank reports: weights and the hidden states entering each layer (flow-of-ranks).

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility", sec. 4 (Fig. 5): the eps-rank of attention weights and of the inputs to each
layer grows with depth. :func:`analyze` builds the report the CLI prints and writes as JSON.

Per-head eps-ranks (Fig. 9) are reported for every weight whose outputs split into heads
(the query, key and value projections of an attention block), with the head widths read from
the block's parameters (:func:`output_head_widths`), so pruned blocks with heads of different
widths are split correctly.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from lowrank_jax._progress import progress_bar
from lowrank_jax.analysis.rank import eps_rank_from_sv, singular_values, tokens_matrix
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import head_offsets, is_leaf, layer_index, materialize_host, named_leaves
from lowrank_jax.nn import head_widths

DEFAULT_EPS = (0.01, 0.05, 0.1)

#: The attention projections, by path (query and key inside the query-key object).
ATTENTION_PATTERN = r"attn/(qk/q|qk/k|v|o)$"


def output_head_widths(tree: Any, path: str) -> tuple[int, ...] | None:
    """Per-head widths of the *outputs* of the weight at ``path``, read from the enclosing
    attention block (:func:`lowrank_jax.nn.head_widths`): the query-key object's widths for
    ``.../attn/qk/q`` and ``.../attn/qk/k``, the head layout's value widths for ``.../attn/v``.

    ``None`` for the output projection ``.../attn/o`` (its *inputs* split into heads) and for
    weights outside attention blocks.
    """
    if path.rsplit("/", 1)[-1] == "o":
        return None
    return head_widths(tree, path)


@dataclasses.dataclass
class WeightRanks:
    """eps-ranks of one weight matrix."""

    path: str
    layer: int | None
    shape: tuple[int, int]
    leaf_type: str
    eps_ranks: dict[float, int]
    singular_values: list[float]
    head_eps_ranks: dict[float, list[int]] | None = None  # per-head blocks (Fig. 9)


@dataclasses.dataclass
class HiddenRanks:
    """eps-ranks of the hidden states entering one layer (flow-of-ranks)."""

    layer: int
    n_tokens: int
    eps_ranks: dict[float, int]
    singular_values: list[float]


@dataclasses.dataclass
class AnalysisReport:
    """What :func:`analyze` found: the eps-ranks of every weight and of the hidden states.

    Fields:
      eps: the tolerances the ranks were counted at.
      weights: one :class:`WeightRanks` per weight matrix, in tree order.
      hidden: one :class:`HiddenRanks` per layer (flow-of-ranks); empty without inputs.
    """

    eps: tuple[float, ...]
    weights: list[WeightRanks]
    hidden: list[HiddenRanks] = dataclasses.field(default_factory=list)

    def layer_summary(self, pattern: str = ATTENTION_PATTERN) -> list[dict]:
        """Mean eps-rank per layer of the weights whose path matches ``pattern``."""
        by_layer: dict[int, list[WeightRanks]] = {}
        rx = re.compile(pattern)
        for w in self.weights:
            if w.layer is not None and rx.search(w.path):
                by_layer.setdefault(w.layer, []).append(w)
        rows = []
        for layer in sorted(by_layer):
            ws = by_layer[layer]
            rows.append(
                {
                    "layer": layer,
                    "n_weights": len(ws),
                    **{
                        f"mean_rank@{e:g}": float(np.mean([w.eps_ranks[e] for w in ws]))
                        for e in self.eps
                    },
                }
            )
        return rows

    def to_dict(self) -> dict:
        def conv(d):
            return {f"{k:g}": v for k, v in d.items()}

        return {
            "eps": list(self.eps),
            "weights": [
                {
                    "path": w.path,
                    "layer": w.layer,
                    "shape": list(w.shape),
                    "leaf": w.leaf_type,
                    "eps_rank": conv(w.eps_ranks),
                    "singular_values": w.singular_values,
                    **({"head_eps_rank": conv(w.head_eps_ranks)} if w.head_eps_ranks else {}),
                }
                for w in self.weights
            ],
            "layers": self.layer_summary(),
            "hidden": [
                {
                    "layer": h.layer,
                    "n_tokens": h.n_tokens,
                    "eps_rank": conv(h.eps_ranks),
                    "singular_values": h.singular_values,
                }
                for h in self.hidden
            ],
        }

    def format_table(self) -> str:
        eps_cols = [f"r@{e:g}" for e in self.eps]
        lines = [
            f"{'path':<40} {'shape':>12} {'leaf':>12} " + " ".join(f"{c:>8}" for c in eps_cols)
        ]
        for w in self.weights:
            shape = f"{w.shape[0]}x{w.shape[1]}"
            ranks = " ".join(f"{w.eps_ranks[e]:>8d}" for e in self.eps)
            lines.append(f"{w.path:<40} {shape:>12} {w.leaf_type:>12} {ranks}")
        summary = self.layer_summary()
        if summary:
            lines.append("")
            lines.append("attention eps-rank per layer (mean over q/k/v/o):")
            for row in summary:
                vals = " ".join(f"{row[f'mean_rank@{e:g}']:>8.1f}" for e in self.eps)
                lines.append(f"  layer {row['layer']:>3d} {vals}")
        if self.hidden:
            lines.append("")
            lines.append("hidden states entering each layer (flow-of-ranks):")
            for h in self.hidden:
                vals = " ".join(f"{h.eps_ranks[e]:>8d}" for e in self.eps)
                lines.append(f"  layer {h.layer:>3d} tokens={h.n_tokens:<6d} {vals}")
        return "\n".join(lines)


def _eps_tuple(eps) -> tuple[float, ...]:
    eps = (eps,) if isinstance(eps, (int, float)) else tuple(float(e) for e in eps)
    for e in eps:
        if not 0.0 < e < 1.0:
            raise ConfigError(f"eps must be in (0, 1), got {e!r}", where="eps",
                              expected="(0, 1)", actual=e)
    return eps


def weight_ranks(
    params: Any,
    eps: float | Sequence[float] = DEFAULT_EPS,
    *,
    pattern: str | None = None,
    progress: bool = False,
) -> list[WeightRanks]:
    """eps-rank of every weight leaf of ``params`` (paths matching ``pattern`` if given).

    Args:
      params: a parameter tree.
      eps: tolerance(s).
      pattern: optional regular expression over paths.
      progress: show a progress bar.

    Returns:
      One :class:`WeightRanks` per weight, in tree order. For weights whose outputs split into
      heads (:func:`output_head_widths`) also the eps-ranks of each head's column block
      (``W^(i)`` of eq. 18; Fig. 9 middle), split at the block's own head widths.
    """
    eps = _eps_tuple(eps)
    items = [(p, n) for p, n in named_leaves(params) if is_leaf(n)]
    if pattern is not None:
        rx = re.compile(pattern)
        items = [(p, n) for p, n in items if rx.search(p)]
    items = progress_bar(items, desc="spectra", unit="matrix", enabled=progress, leave=True)
    rows = []
    for path, leaf in items:
        sv = singular_values(leaf, name=path)
        head = None
        widths = output_head_widths(params, path)
        if widths:
            w = materialize_host(leaf)
            off = head_offsets(widths)
            head_sv = [np.linalg.svd(w[:, off[i]:off[i + 1]], compute_uv=False)
                       for i in range(len(widths))]
            head = {e: [eps_rank_from_sv(s, e) for s in head_sv] for e in eps}
        rows.append(
            WeightRanks(
                path=path,
                layer=layer_index(path),
                shape=tuple(leaf.shape),
                leaf_type=type(leaf).__name__,
                eps_ranks={e: eps_rank_from_sv(sv, e) for e in eps},
                singular_values=sv.tolist(),
                head_eps_ranks=head,
            )
        )
    return rows


def hidden_state_ranks(
    hidden: Sequence[Any], eps: float | Sequence[float] = DEFAULT_EPS
) -> list[HiddenRanks]:
    """eps-rank of the hidden states entering each layer (sec. 4, Fig. 5c).

    Args:
      hidden: one array ``[..., d]`` per layer, e.g. from
        ``lowrank_jax.nn.apply_encoder(..., return_hidden=True)``; all tokens of the batch form
        the rows of the matrix whose eps-rank is taken.
      eps: tolerance(s).
    """
    eps = _eps_tuple(eps)
    rows = []
    for i, h in enumerate(hidden):
        m = tokens_matrix(h)
        sv = singular_values(m, name=f"hidden[{i}]")
        rows.append(
            HiddenRanks(
                layer=i,
                n_tokens=m.shape[0],
                eps_ranks={e: eps_rank_from_sv(sv, e) for e in eps},
                singular_values=sv.tolist(),
            )
        )
    return rows


def analyze(
    params: Any,
    eps: float | Sequence[float] = DEFAULT_EPS,
    *,
    hidden=None,
    pattern: str | None = None,
    progress: bool = False,
) -> AnalysisReport:
    """The per-layer report: eps-ranks of every weight, and of the hidden states if given.

    Args:
      params: a parameter tree.
      eps: tolerance(s).
      hidden: optional hidden states entering each layer (:func:`hidden_state_ranks`).
      pattern: optional regular expression over weight paths.
      progress: show a progress bar.

    Returns:
      An :class:`AnalysisReport`.
    """
    eps_t = _eps_tuple(eps)
    return AnalysisReport(
        eps=eps_t,
        weights=weight_ranks(params, eps_t, pattern=pattern, progress=progress),
        hidden=hidden_state_ranks(hidden, eps_t) if hidden is not None else [],
    )


__all__ = [
    "ATTENTION_PATTERN", "AnalysisReport", "DEFAULT_EPS", "HiddenRanks", "WeightRanks",
    "analyze", "hidden_state_ranks", "output_head_widths", "weight_ranks",
]
