"""The ``factorize`` method: compressed-by-design weights, born factorized.

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and
Compressibility" (sec. 5, Fig. 7, Tables 3-4) pretrains models whose attention is low rank from
the start. Instead of truncating trained weights, every selected weight is replaced by freshly
drawn factors: a :class:`~lowrank_jax.LowRank` (eq. 19) or, with ``per_head``, a
:class:`~lowrank_jax.HeadLowRank` (eq. 20) for weights whose outputs are heads (the output
projection and weights outside attention get the shared form), at a rank given by ``rank`` or by
a layer ``schedule``: the flow-of-ranks power law ``d_i = ceil(d_0 (1 + i)^alpha)`` (sec. 5),
the App. K interpolation, or a uniform rank (:mod:`lowrank_jax.compress.schedules`).

:func:`factorize_init` is the one-step plan applied to a freshly initialized model;
:func:`reuse_weights` copies weights (typically the input embedding) from a pretrained
checkpoint, the right half of Fig. 7.

Settings: ``rank`` or ``schedule`` (one of them, unless every rule overrides ``rank``),
``per_head`` (bool). Rule overrides: ``rank``, ``per_head``. Needs ``key=`` in
:func:`~lowrank_jax.compress.apply_plan`. Row ``error`` is ``None`` (fresh factors approximate
nothing); ``details``: ``shape``, ``rank``, ``std`` (the entry scale matched).

A weight with no inputs or no outputs (of an emptied attention block or MLP,
:mod:`lowrank_jax.compress.empty`) has no factors to draw: it is passed through unchanged with
a row of kind ``'empty'``, whatever its rank or schedule says. Every other weight gets the
factors it would get without it (the key of a weight depends on its path only).
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from lowrank_jax.analysis import output_head_widths
from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.plan import Plan, Step, apply_plan
from lowrank_jax.compress.registry import Context, register_method
from lowrank_jax.compress.report import Report, Row
from lowrank_jax.compress.rules import ATTENTION_QKVO, Selection
from lowrank_jax.compress.svd import is_int, truncatable, uniform_head_widths
from lowrank_jax.errors import PlanError, ShapeError
from lowrank_jax.leaves import (
    HeadLowRank,
    LowRank,
    bias_of,
    is_leaf,
    layer_index,
    leaf_dtype,
    map_with_path,
    materialize_host,
    named_leaves,
    replace_paths,
)

SETTINGS = ("rank", "schedule", "per_head")
OVERRIDES = ("rank", "per_head")


def check_settings(settings: Mapping) -> None:
    """Validate the ``factorize`` settings.

    Raises:
      PlanError: both rank and schedule, a rank or schedule entry that is not an int >= 1, a
        non-bool ``per_head``.
    """
    rank, schedule = settings.get("rank"), settings.get("schedule")
    if rank is not None and schedule is not None:
        raise PlanError("factorize: give exactly one of rank= or schedule=", where="settings",
                        expected="rank or schedule", actual=["rank", "schedule"])
    if rank is not None and (not is_int(rank) or rank < 1):
        raise PlanError(f"factorize: rank must be an int >= 1, got {rank!r}", where="rank",
                        expected="int >= 1", actual=rank)
    if schedule is not None and (isinstance(schedule, (str, bytes))
                                 or not isinstance(schedule, Sequence)
                                 or not all(is_int(r) and r >= 1 for r in schedule)):
        raise PlanError(f"factorize: schedule must be a list of ints >= 1 (one rank per layer), "
                        f"got {schedule!r}", where="schedule", expected="list of ints >= 1",
                        actual=schedule)
    if "per_head" in settings and not isinstance(settings["per_head"], bool):
        raise PlanError(f"factorize: per_head must be a bool, got {settings['per_head']!r}",
                        where="per_head", expected="bool", actual=settings["per_head"])


def _rank_for(path: str, overrides: Mapping, settings: Mapping):
    if "rank" in overrides:
        return overrides["rank"]
    if settings.get("rank") is not None:
        return settings["rank"]
    schedule = settings.get("schedule")
    if schedule is None:
        raise PlanError(f"factorize: {path} has no rank: give rank= or schedule=, or a rank "
                        "override in its rule", where=path, expected="rank or schedule",
                        actual=None)
    i = layer_index(path)
    if i is None:
        raise PlanError(f"factorize: {path} has no layer index ('layers/<i>/') for the schedule",
                        where=path, expected="a path with layers/<i>/", actual=path)
    if i >= len(schedule):
        raise PlanError(f"factorize: schedule has {len(schedule)} ranks but {path} is in layer "
                        f"{i}; give one rank per layer", where=path, expected=f"> {i} ranks",
                        actual=len(schedule))
    return schedule[i]


def _path_key(key, path: str):
    """A key per path: independent of which other weights the rules select."""
    return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def factorize(params: Any, selection: list[Selection], settings: dict, ctx: Context):
    """The ``factorize`` method (module docstring): ``(new_params, rows)``.

    The factors are Gaussian, scaled so that every entry of ``u @ v`` has the standard
    deviation of the weight it replaces (so the model starts at the dense model's scale; the
    paper does not say how it initializes its factors): ``u ~ N(0, 1/d_in)``,
    ``v ~ N(0, std^2 d_in / r)``. Biases are kept.
    """
    check_settings(settings)
    plans = []
    for sel in selection:
        path, ov = sel.path, sel.overrides
        ph = ov.get("per_head", settings.get("per_head", False))
        if not isinstance(ph, bool):
            raise PlanError(f"factorize: {path}: per_head must be a bool, got {ph!r}",
                            where=path, expected="bool", actual=ph)
        if is_empty(sel.node):  # a weight of an emptied block: no factor to draw
            plans.append((sel, None, None))
            continue
        r = _rank_for(path, ov, settings)
        d_in, d_out = sel.node.shape
        widths = output_head_widths(params, path) if ph else None
        if widths is not None:
            widths = uniform_head_widths("factorize", path, d_out, widths)
        limit = min(d_in, widths[0]) if widths else min(d_in, d_out)
        if not (is_int(r) and 1 <= r <= limit):
            raise PlanError(
                f"factorize: rank for {path} (shape {d_in}x{d_out}"
                + (f", {len(widths)} heads" if widths else "")
                + f") must be an int in [1, {limit}], got {r!r}", where=path,
                expected=f"[1, {limit}]", actual=r)
        plans.append((sel, int(r), widths))

    live = [sel for sel, r, _ in plans if r is not None]
    key = ctx.require_key(live[0].path) if live else None
    new, rows = {}, []
    for sel, r, widths in plans:
        if r is None:
            rows.append(empty_row(sel))
            continue
        node = sel.node
        d_in, d_out = node.shape
        std = float(np.std(materialize_host(node)))
        dtype = leaf_dtype(node)
        ku, kv = jax.random.split(_path_key(key, sel.path))
        # entry variance of u @ v = r var(u) var(v): var(u) = 1/d_in, var(v) = std^2 d_in / r
        su, sv = 1.0 / np.sqrt(d_in), std * np.sqrt(d_in / r)
        if widths:
            h, dh = len(widths), widths[0]
            leaf = HeadLowRank(u=su * jax.random.normal(ku, (d_in, h, r), dtype),
                               v=sv * jax.random.normal(kv, (h, r, dh), dtype), b=bias_of(node))
            kind = "head-lowrank"
        else:
            leaf = LowRank(u=su * jax.random.normal(ku, (d_in, r), dtype),
                           v=sv * jax.random.normal(kv, (r, d_out), dtype), b=bias_of(node))
            kind = "lowrank"
        new[sel.path] = leaf
        rows.append(Row.compare(sel.path, node, leaf, rule=sel.rule, kind=kind,
                                details={"shape": [d_in, d_out], "rank": r, "std": std}))
    return replace_paths(params, new), rows


register_method("factorize", factorize, settings=SETTINGS, overrides=OVERRIDES,
                accepts=truncatable, validate=check_settings,
                no_candidates="replaces weights by random factors (compressed pretraining, "
                              "`lowrank-jax train`): meaningless without training")


def factorize_init(params: Any, *, key, rules: Sequence = ATTENTION_QKVO,
                   rank: int | None = None, schedule: Sequence[int] | None = None,
                   per_head: bool = False) -> tuple[Any, Report]:
    """Replace the selected weights by freshly initialized factorized leaves.

    The one-step plan ``Step("factorize", rules, {rank | schedule, per_head})`` applied with
    :func:`~lowrank_jax.compress.apply_plan` (see :func:`factorize` for the scale).

    Args:
      params: a parameter tree (e.g. from a model's ``init``); it is not modified.
      key: PRNG key.
      rules: path rules selecting the weights (default: the attention projections; add
        ``r"mlp/(wi|wo)"`` to factorize the MLP too).
      rank: one rank for every selected weight, or
      schedule: one rank per layer index (``layers/<i>/`` in the path), e.g. from
        :func:`~lowrank_jax.compress.power_schedule`.
      per_head: :class:`~lowrank_jax.HeadLowRank` with the rank per head for weights whose
        outputs are heads (q, k, v; widths from the attention block); the output projection
        stays a shared ``LowRank``.

    Returns:
      ``(new_params, report)``; ``report.ratio`` is the parameter ratio of the selected weights
      (recountable with :func:`lowrank_jax.param_count`).

    Raises:
      PlanError: neither or both of ``rank``/``schedule``; a rank below 1 or above what the
        matrix (or head) allows, naming the path; a schedule too short; a rule matching nothing.
    """
    if (rank is None) == (schedule is None):
        raise PlanError("factorize_init: give exactly one of rank= or schedule=",
                        where="rank/schedule", expected="one of them",
                        actual={"rank": rank, "schedule": schedule})
    settings = {"per_head": per_head}
    settings.update({"rank": rank} if rank is not None else {"schedule": list(schedule)})
    return apply_plan(params, Plan((Step("factorize", tuple(rules) if not isinstance(rules, str)
                                         else rules, settings),)), key=key)


def _signature(node):
    """Type, tree structure and array shapes: what must agree for a weight to be reused."""
    shapes = [np.shape(a) for a in jax.tree_util.tree_leaves(node)]
    return type(node), jax.tree_util.tree_structure(node), shapes


def reuse_weights(params: Any, pretrained: Any, pattern: str) -> Any:
    """Copy every leaf whose path matches ``pattern`` from ``pretrained`` into ``params``.

    "Understanding Transformers for Time Series", Fig. 7 (right half), pretrains compressed
    models that reuse the embedding of the original checkpoint; for Chronos-Bolt pass
    ``pattern=r"^(input_patch_embedding|shared)"``.

    Args:
      params: the tree to copy into (not modified).
      pretrained: the tree to copy from.
      pattern: a regular expression over paths (``re.search``).

    Returns:
      A new tree.

    Raises:
      PlanError: an invalid pattern, or one that matches nothing.
      ShapeError: a matched leaf missing from ``pretrained``, or of another type, structure
        or shape (naming the path).
    """
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise PlanError(f"reuse_weights: pattern {pattern!r} is not a valid regular expression: "
                        f"{e}", where=pattern) from None
    src = dict(named_leaves(pretrained))
    hits = []

    def describe(node):
        shape = node.shape if is_leaf(node) else np.shape(node)
        arrays = [tuple(np.shape(a)) for a in jax.tree_util.tree_leaves(node)]
        return f"{type(node).__name__} of shape {tuple(shape)} (arrays {arrays})"

    def copy(path, node):
        if not rx.search(path):
            return node
        if path not in src:
            raise ShapeError(f"reuse_weights: {path} matches {pattern!r} but is not in the "
                             "pretrained tree", where=path, expected=describe(node), actual=None)
        other = src[path]
        if _signature(other) != _signature(node):
            raise ShapeError(f"reuse_weights: {path}: expected {describe(node)}, pretrained has "
                             f"{describe(other)}", where=path, expected=describe(node),
                             actual=describe(other))
        hits.append(path)
        return other

    out = map_with_path(copy, params)
    if not hits:
        raise PlanError(f"reuse_weights: pattern {pattern!r} matches no leaf of params",
                        where=pattern, expected="a matching path", actual=None)
    return out


__all__ = ["OVERRIDES", "SETTINGS", "check_settings", "factorize", "factorize_init",
           "reuse_weights"]
