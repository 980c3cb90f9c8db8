"""Compressed-by-design models for pretraining (seed 000 sec. 5, Fig. 7, Tables 3-4).

Instead of compressing a trained model, the selected weights are *born* factorized: every
selected ``Dense`` leaf is replaced by a freshly initialized :class:`~lowrank_jax.LowRank` (or
per-head :class:`~lowrank_jax.HeadLowRank`, seed 000 eq. 20) whose rank follows a layer
schedule: the flow-of-ranks power law ``d_i = ceil(d_0 (1 + i)^alpha)`` (sec. 5), the App. K
interpolation, or a uniform rank. :func:`reuse_weights` copies weights (typically the input
embedding) from a pretrained checkpoint, the right half of seed 000 Fig. 7.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from lowrank_jax.compress.rules import ATTENTION_QKVO, select
from lowrank_jax.leaves import (
    Dense,
    HeadLowRank,
    LowRank,
    layer_index,
    map_with_path,
    named_leaves,
)


@dataclasses.dataclass
class FactorizedRow:
    path: str
    shape: tuple[int, int]
    rank: int
    params_dense: int
    params_factorized: int


@dataclasses.dataclass
class FactorizeReport:
    rows: list[FactorizedRow]

    @property
    def params_dense(self) -> int:
        return sum(r.params_dense for r in self.rows)

    @property
    def params_factorized(self) -> int:
        return sum(r.params_factorized for r in self.rows)

    @property
    def ratio(self) -> float:
        """Parameters of the selected weights, factorized / dense (the "size ratio")."""
        return self.params_factorized / self.params_dense if self.rows else 1.0

    def to_dict(self) -> dict:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "params_dense": self.params_dense,
            "params_factorized": self.params_factorized,
            "ratio": self.ratio,
        }


def _rank_for(path: str, rank, schedule, owner: str) -> int:
    if schedule is None:
        return rank
    i = layer_index(path)
    if i is None:
        raise ValueError(f"{owner}: {path} has no layer index ('layers/<i>/') for the schedule")
    if i >= len(schedule):
        raise ValueError(
            f"{owner}: schedule has {len(schedule)} ranks but {path} is in layer {i}; "
            "give one rank per layer"
        )
    return schedule[i]


def factorize_init(
    params: Any,
    *,
    key,
    rules: Sequence = ATTENTION_QKVO,
    rank: int | None = None,
    schedule: Sequence[int] | None = None,
    per_head: bool = False,
    num_heads: int | None = None,
) -> tuple[Any, FactorizeReport]:
    """Replace the selected ``Dense`` weights by freshly initialized factorized leaves.

    The factors are Gaussian, scaled so that every entry of ``u @ v`` has the standard
    deviation of the dense weight it replaces (so the model starts at the dense model's scale;
    seed 000 does not say how it initializes its factors). Biases are kept.

    Args:
      params: a parameter tree (e.g. from a model's ``init``); it is not modified.
      key: PRNG key.
      rules: path rules selecting the weights (default: attention q/k/v/o; add
        ``r"mlp/(wi|wo)"`` to factorize the MLP too).
      rank: one rank for every selected weight, or
      schedule: one rank per layer index (``layers/<i>/`` in the path), e.g. from
        :func:`~lowrank_jax.compress.power_schedule`.
      per_head: :class:`~lowrank_jax.HeadLowRank` with the rank per head for q/k/v
        (``num_heads`` needed); the output projection ``o`` stays a shared ``LowRank``.
      num_heads: number of heads, for ``per_head``.

    Returns:
      ``(new_params, report)``; the report's ``ratio`` is the parameter ratio of the selected
      weights (recountable with :func:`lowrank_jax.param_count`).

    Raises:
      ValueError: neither or both of ``rank``/``schedule``; a rank below 1 or above what the
        matrix (or head) allows, naming the path; a schedule too short; a rule matching nothing.
    """
    owner = "factorize_init"
    if (rank is None) == (schedule is None):
        raise ValueError(f"{owner}: give exactly one of rank= or schedule=")
    if per_head and not (isinstance(num_heads, int) and num_heads >= 1):
        raise ValueError(
            f"{owner}: per_head=True needs num_heads (a positive int), got {num_heads!r}"
        )
    plan = {}
    for sel in select(params, rules):
        leaf = sel.leaf
        if not isinstance(leaf, Dense):
            raise ValueError(
                f"{owner}: {sel.path} is a {type(leaf).__name__}; expected a Dense leaf"
            )
        r = _rank_for(sel.path, rank, schedule, owner)
        d_in, d_out = leaf.shape
        head = per_head and sel.path.rsplit("/", 1)[-1] in ("q", "k", "v")
        if head and d_out % num_heads:
            raise ValueError(
                f"{owner}: num_heads={num_heads} does not divide {sel.path}'s d_out={d_out}"
            )
        limit = min(d_in, d_out // num_heads) if head else min(d_in, d_out)
        if not (isinstance(r, (int, np.integer)) and 1 <= r <= limit):
            raise ValueError(
                f"{owner}: rank for {sel.path} (shape {d_in}x{d_out}"
                + (f", {num_heads} heads" if head else "")
                + f") must be an int in [1, {limit}], got {r!r}"
            )
        plan[sel.path] = (int(r), head)

    keys = dict(zip(sorted(plan), jax.random.split(key, max(len(plan), 1)), strict=False))
    rows = []

    def rewrite(path, node):
        if path not in plan:
            return node
        r, head = plan[path]
        d_in, d_out = node.shape
        std = float(np.std(np.asarray(node.w)))
        ku, kv = jax.random.split(keys[path])
        dtype = node.w.dtype
        # entry variance of u @ v = r * var(u) * var(v): var(u) = 1/d_in, var(v) = std^2 d_in / r
        su, sv = 1.0 / np.sqrt(d_in), std * np.sqrt(d_in / r)
        if head:
            dh = d_out // num_heads
            u = su * jax.random.normal(ku, (d_in, num_heads, r), dtype)
            v = sv * jax.random.normal(kv, (num_heads, r, dh), dtype)
            new = HeadLowRank(u=u, v=v, b=node.b)
            n_fact = num_heads * r * (d_in + dh)
        else:
            u = su * jax.random.normal(ku, (d_in, r), dtype)
            v = sv * jax.random.normal(kv, (r, d_out), dtype)
            new = LowRank(u=u, v=v, b=node.b)
            n_fact = r * (d_in + d_out)
        rows.append(FactorizedRow(path, (d_in, d_out), r, d_in * d_out, n_fact))
        return new

    new_params = map_with_path(rewrite, params)
    rows.sort(key=lambda row: row.path)
    return new_params, FactorizeReport(rows)


def reuse_weights(params: Any, pretrained: Any, pattern: str) -> Any:
    """Copy every leaf whose path matches ``pattern`` from ``pretrained`` into ``params``.

    Seed 000 Fig. 7 (right half) pretrains compressed models that reuse the embedding of the
    original checkpoint; for Chronos-Bolt pass ``pattern=r"^(input_patch_embedding|shared)"``.

    Raises:
      ValueError: the pattern matches nothing, or a matched leaf is missing from
        ``pretrained`` or has another type or shape (naming the path).
    """
    import re

    rx = re.compile(pattern)
    src = dict(named_leaves(pretrained))
    hits = []

    def copy(path, node):
        if not rx.search(path):
            return node
        if path not in src:
            raise ValueError(
                f"reuse_weights: {path} matches {pattern!r} but is not in the pretrained tree"
            )
        other = src[path]
        if type(other) is not type(node) or np.shape(_dense(other)) != np.shape(_dense(node)):
            raise ValueError(
                f"reuse_weights: {path}: expected {type(node).__name__} of shape "
                f"{np.shape(_dense(node))}, pretrained has {type(other).__name__} of shape "
                f"{np.shape(_dense(other))}"
            )
        hits.append(path)
        return other

    out = map_with_path(copy, params)
    if not hits:
        raise ValueError(f"reuse_weights: pattern {pattern!r} matches no leaf of params")
    return out


def _dense(node):
    return node.w if isinstance(node, Dense) else node
