"""A method's frontier candidates: the rules they use, their strengths, and how a declared
:class:`~lowrank_jax.compress.registry.Candidates` becomes candidate plans.

Every method carries its candidates in its record (``register_method(..., candidates=...)``),
next to its function, so adding a method touches its own module only. Most methods declare
them as data::

    register_method("svd", svd, ..., candidates=Candidates(
        groups=(("svd attn", ATTENTION), ("svd mlp", MLP)),
        settings=lambda s, keep: {"ratio": keep}, label="ratio={ratio:g}"))

which gives ``svd attn ratio=0.75``, ``svd attn ratio=0.5``, ... one candidate per group whose
rules select a node the method accepts and per strength (:func:`method_candidates`); the same
declaration gives the method's step inside a combination of methods
(:func:`combination_candidates`, the table :data:`lowrank_jax.compress.frontier.COMBINATIONS`).
A method whose candidates do not fit that shape registers a function
``fn(setting: CandidateSetting) -> [Candidate]`` instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from lowrank_jax.compress.plan import Plan, Step
from lowrank_jax.compress.registry import (
    Candidate,
    Candidates,
    CandidateSetting,
    Method,
    registered_methods,
)
from lowrank_jax.compress.rules import ATTENTION_QKVO, select
from lowrank_jax.errors import NotApplicableError, PlanError

#: Path rules of the candidates: attention projections, MLP projections, value projections.
ATTENTION = ATTENTION_QKVO
MLP = (r"mlp/(wi|wi_0|wi_1|wo)$",)
VALUES = (r"attn/v$",)
#: Fraction of the selected weights (or of their rank) each method keeps.
STRENGTHS = (0.75, 0.5, 0.25)
QUICK_STRENGTHS = (0.5,)


def require(params: Any, method: str, rules: Sequence) -> list:
    """The nodes ``rules`` select for ``method`` (its kind and ``accepts``).

    Raises:
      NotApplicableError: the method is not registered, or the rules select no node it
        accepts.
    """
    m = registered_methods().get(method)
    if m is None:
        raise NotApplicableError(f"{method} is not registered", where=method)
    try:
        return select(params, rules, kind=m.selects, accepts=m.accepts, where=method)
    except PlanError:
        raise NotApplicableError(f"no node this method accepts matches {list(rules)}",
                                 where=method, actual=list(rules)) from None


def _name(label: str, settings: dict, keep: float) -> str:
    return label.format(**{**settings, "strength": keep, "removed": 1 - keep})


def declared_step(method: str, spec: Candidates, setting: CandidateSetting, rules: Sequence,
                  keep: float) -> tuple[Step, dict]:
    """The step of ``method`` on ``rules`` at strength ``keep``, and its settings."""
    settings = spec.settings(setting, keep)
    return Step(method, tuple(rules), settings), settings


def method_candidates(method: Method, setting: CandidateSetting) -> list[Candidate]:
    """The candidates of one registered method for one model.

    Args:
      method: the method's record (its ``candidates``: a declared
        :class:`~lowrank_jax.compress.registry.Candidates` or a function).
      setting: the model and the strengths.

    Returns:
      The candidates, in group then strength order.

    Raises:
      NotApplicableError: the method does not apply to the model (the message says why).
    """
    spec = method.candidates
    if not isinstance(spec, Candidates):
        return list(spec(setting))
    if spec.check is not None:
        spec.check(setting)
    out = []
    for group, rules in spec.groups:
        try:
            require(setting.params, method.name, rules)
        except NotApplicableError:
            if len(spec.groups) == 1:
                raise
            continue
        for k in setting.strengths:
            step, settings = declared_step(method.name, spec, setting, rules, k)
            out.append(Candidate(f"{group} {_name(spec.label, settings, k)}", group, k,
                                 Plan((step,))))
    if not out:
        raise NotApplicableError(spec.none, where=method.name)
    return out


@dataclasses.dataclass(frozen=True)
class Combination:
    """Several methods in one plan, declared as data.

    Fields:
      group: the candidates' group (``'prune mlp + svd attn'``).
      parts: ``((method, rules), ...)`` in plan order; every method declares its candidates
        (a :class:`~lowrank_jax.compress.registry.Candidates`), whose ``settings`` give its
        step at each strength.
      name: a candidate's name, formatted with ``strength`` (``keep``), ``removed``
        (``1 - keep``) and each part's settings under its method's name
        (``'truncatt + truncatt_vo rank={truncatt[rank]}/head'``).
      strengths: the strengths of its candidates (``None``: the frontier's).
    """

    group: str
    parts: tuple[tuple[str, tuple], ...]
    name: str
    strengths: tuple[float, ...] | None = None


def combination_candidates(combo: Combination, setting: CandidateSetting,
                           available: set[str]) -> list[Candidate]:
    """The candidates of one combination: made only when every part's method made candidates
    of its own (``available``) and every part applies to the model; otherwise none."""
    methods = registered_methods()
    if not all(m in available and isinstance(methods[m].candidates, Candidates)
               for m, _ in combo.parts):
        return []
    try:
        for m, rules in combo.parts:
            spec = methods[m].candidates
            if spec.check is not None:
                spec.check(setting)
            require(setting.params, m, rules)
        out = []
        for k in combo.strengths or setting.strengths:
            steps, fields = [], {}
            for m, rules in combo.parts:
                step, fields[m] = declared_step(m, methods[m].candidates, setting, rules, k)
                steps.append(step)
            out.append(Candidate(_name(combo.name, fields, k), combo.group, k,
                                 Plan(tuple(steps))))
        return out
    except NotApplicableError:
        return []


__all__ = [
    "ATTENTION", "Candidate", "CandidateSetting", "Candidates", "Combination", "MLP",
    "QUICK_STRENGTHS", "STRENGTHS", "VALUES", "combination_candidates", "declared_step",
    "method_candidates", "require",
]
