"""Which plans a frontier measures: every registered method's own candidates (declared in its
record, beside the method) and the combinations of :data:`COMBINATIONS`."""

from __future__ import annotations

import numbers
from typing import Any, Sequence

from lowrank_jax.compress.candidates import (
    ATTENTION,
    MLP,
    QUICK_STRENGTHS,
    STRENGTHS,
    VALUES,
    Combination,
    combination_candidates,
    method_candidates,
)
from lowrank_jax.compress.registry import Candidate, CandidateSetting, registered_methods
from lowrank_jax.compress.rules import ATTENTION_QK
from lowrank_jax.errors import ConfigError, NotApplicableError

#: The two-method plans a frontier adds, each at every strength ``k``: SVD of attention after
#: pruning the MLP's hidden channels (``1 - k`` of them removed); the query-key and the
#: value-output sides of TruncAtt together; SVD of attention with a binary MLP. Each is made
#: only where both of its methods made candidates of their own and apply to its rules.
COMBINATIONS = (
    Combination("prune mlp + svd attn", (("prune", MLP), ("svd", ATTENTION)),
                name="prune mlp {removed:g} + svd attn {strength:g}"),
    Combination("truncatt + truncatt_vo", (("truncatt", ATTENTION_QK), ("truncatt_vo", VALUES)),
                name="truncatt + truncatt_vo rank={truncatt[rank]}/head"),
    Combination("svd attn + binarize mlp", (("svd", ATTENTION), ("binarize", MLP)),
                name="svd attn {strength:g} + binarize mlp {strength:g}"),
)


def _strengths(quick: bool, strengths: Sequence[float] | None) -> tuple[float, ...]:
    out = tuple(QUICK_STRENGTHS if quick else STRENGTHS) if strengths is None else tuple(strengths)
    for k in out:
        if isinstance(k, bool) or not isinstance(k, numbers.Real) or not 0.0 < k < 1.0:
            raise ConfigError(f"frontier: strengths must be fractions kept in (0, 1), got {k!r}",
                              where="strengths", expected="(0, 1)", actual=k)
    return out


def default_candidates(params: Any, config: Any = None, *, quick: bool = False,
                       strengths: Sequence[float] | None = None,
                       methods: Sequence[str] | None = None, prune_steps: int | None = None,
                       prune_data: str = "builtin",
                       combinations: bool | Sequence[Combination] = True
                       ) -> tuple[list[Candidate], dict[str, str]]:
    """Every applicable registered method at several strengths, and a few combinations.

    Args:
      params: the dense model's parameters.
      config: its config (``prune`` needs one).
      quick: one strength (0.5) and 4 pruning batches.
      strengths: the ``keep`` fractions (default :data:`~lowrank_jax.compress.candidates.
        STRENGTHS`, quick :data:`~lowrank_jax.compress.candidates.QUICK_STRENGTHS`), each in
        ``(0, 1)``.
      methods: only these registered methods (default: all); combinations need both parts.
      prune_steps: pruning batches per ``prune`` candidate (default 8, quick 4).
      prune_data: the batch source of ``prune`` candidates.
      combinations: also make the multi-method plans of :data:`COMBINATIONS` (``True``), none
        (``False``), or these :class:`~lowrank_jax.compress.candidates.Combination` s.

    Returns:
      ``(candidates, skipped)``: the candidates of the methods in the order they were
      registered, then the combinations; and ``{method: why it has none}`` for every
      registered method left out.

    Raises:
      ConfigError: a strength outside ``(0, 1)``, or a method in ``methods`` that is not
        registered.
    """
    strengths = _strengths(quick, strengths)
    registered = registered_methods()
    wanted = sorted(registered) if methods is None else list(methods)
    unknown = [m for m in wanted if m not in registered]
    if unknown:
        raise ConfigError(f"frontier: unknown methods {unknown}; registered: {sorted(registered)}",
                          where="methods", expected=sorted(registered), actual=unknown)
    setting = CandidateSetting(params, config, strengths,
                               prune_steps or (4 if quick else 8), prune_data)
    out, skipped, available = [], {}, set()
    with_candidates = [m for m in registered if m in wanted and registered[m].candidates is not None]
    for name in with_candidates + [m for m in wanted if m not in with_candidates]:
        method = registered[name]
        if method.candidates is None:
            skipped[name] = method.no_candidates or (
                "no candidate generator for this method (register_candidates)")
            continue
        try:
            made = method_candidates(method, setting)
        except NotApplicableError as e:
            skipped[name] = f"not applicable: {e}"
            continue
        out += made
        available.add(name)
    table = COMBINATIONS if combinations is True else (combinations or ())
    for combo in table:
        out += combination_candidates(combo, setting, available)
    return out, skipped


__all__ = ["COMBINATIONS", "default_candidates"]
