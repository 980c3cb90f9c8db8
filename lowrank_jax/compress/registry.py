"""The method registry: every compression method is one function with one signature.

A method is ``fn(params, selection, settings, ctx) -> (new_params, rows)``:

* ``params``: the tree as the previous step left it (never mutate it; return a new tree, for
  example with :func:`lowrank_jax.replace_paths`);
* ``selection``: the :class:`~lowrank_jax.compress.rules.Selection` s of the step's rules
  (path, node, the per-rule overrides, the rule pattern), in tree order;
* ``settings``: the step's settings (a fresh dict); a node's effective settings are
  ``{**settings, **selection.overrides}``;
* ``ctx``: a :class:`Context` (PRNG key of the step, activations for data-aware methods, the
  model config, progress flag, step index, and ``info`` for step-level notes);
* ``rows``: one :class:`~lowrank_jax.compress.Row` per selected node
  (:meth:`Row.compare <lowrank_jax.compress.Row.compare>` fills the counts from the leaves).

Adding a method is a module with the function and one :func:`register_method` call::

    import jax.numpy as jnp

    from lowrank_jax import Dense, materialize
    from lowrank_jax.compress import Row, register_method
    from lowrank_jax.leaves import replace_paths

    def round_weights(params, selection, settings, ctx):
        new, rows = {}, []
        for sel in selection:
            leaf = Dense(jnp.round(materialize(sel.node), settings.get("decimals", 2)))
            new[sel.path] = leaf
            rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="rounded"))
        return replace_paths(params, new), rows

    register_method("round", round_weights, settings=("decimals",))

after which ``Step("round", ["mlp/"], {"decimals": 1})`` works in any plan and in JSON. (Dense
drops the bias here; a real method keeps it with :func:`lowrank_jax.leaves.bias_of`.) The record
also carries the method's frontier candidates (``candidates=``, a :class:`Candidates` or a
function; :mod:`lowrank_jax.compress.candidates`), or why it has none (``no_candidates=``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

from lowrank_jax.compress.rules import KINDS
from lowrank_jax.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Context:
    """What a method may need beyond the tree and its settings.

    Fields:
      step: index of the step in the plan.
      method: the step's method name.
      key: the step's PRNG key (``fold_in(key, step)`` of the key given to ``apply_plan``), or
        ``None`` when no key was given.
      inputs: activations entering weights, ``{path: x [..., d_in]}`` (data-aware methods such
        as the input projection of ``svd``). Read them with :meth:`input_for`, which records
        that they were used.
      config: the model config, or ``None``.
      progress: show progress bars.
      info: step-level notes the method may add (shown in the report's step summary).
      head_widths: ``head_widths(tree, path) -> widths | None``: how a weight's outputs split
        into heads where the tree does not record it in an attention block (a Flax
        ``DenseGeneral`` kernel ``[d, heads, head_dim]``); ``svd``'s ``per_head`` asks it first.
    """

    step: int = 0
    method: str = ""
    key: Any = None
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: Any = None
    progress: bool = False
    info: dict = dataclasses.field(default_factory=dict)
    head_widths: Callable[[Any, str], Any] | None = None
    used_inputs: set = dataclasses.field(default_factory=set, repr=False)

    def input_for(self, path: str):
        """The activations given for ``path`` (``None`` if none), marking them used."""
        if path in self.inputs:
            self.used_inputs.add(path)
            return self.inputs[path]
        return None

    def require_key(self, path: str | None = None):
        """The step's key, or a :class:`~lowrank_jax.errors.PlanError` saying a key is
        needed."""
        if self.key is None:
            raise PlanError(f"step {self.step} ({self.method}): this method draws random "
                            f"numbers; pass key= to apply_plan", where=path or f"step {self.step}",
                            expected="a PRNG key", actual=None)
        return self.key


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compressed variant of a model, for the frontier.

    Fields:
      name: unique label (``'svd attn ratio=0.5'``).
      group: the method or combination, for colors and grouping (``'svd attn'``).
      keep: the strength: the fraction of the selected weights (or of their rank) kept.
      plan: the :class:`~lowrank_jax.compress.Plan` that makes it.
    """

    name: str
    group: str
    keep: float
    plan: Any


@dataclasses.dataclass(frozen=True)
class CandidateSetting:
    """What a method's candidates are made for.

    Fields:
      params: the dense model's parameters.
      config: its config (``None`` for a bare tree).
      strengths: the ``keep`` fractions to make candidates at.
      prune_steps: pruning batches of a ``prune`` candidate (Algorithm 1's ``B``).
      prune_data: the batch source a ``prune`` candidate scores channels on (``'builtin'``: the
        family's own batches; or a name given to
        :func:`lowrank_jax.compress.prune.register_batches`).
    """

    params: Any
    config: Any
    strengths: tuple[float, ...]
    prune_steps: int = 8
    prune_data: str = "builtin"


@dataclasses.dataclass(frozen=True)
class Candidates:
    """A method's frontier candidates declared as data: one one-step plan per group of rules
    and strength (:func:`lowrank_jax.compress.candidates.method_candidates` makes them), and
    the step a combination of methods takes from it
    (:data:`lowrank_jax.compress.frontier.COMBINATIONS`).

    Fields:
      groups: ``((group, rules), ...)``: every group whose rules select a node the method
        accepts gives one candidate per strength, named ``f"{group} {label}"``.
      settings: ``settings(setting: CandidateSetting, keep: float) -> dict``: the step's
        settings at strength ``keep`` (the fraction kept); may raise
        :class:`~lowrank_jax.errors.NotApplicableError`.
      label: the rest of a candidate's name, formatted with the settings and ``strength``
        (``keep``) and ``removed`` (``1 - keep``): ``'ratio={ratio:g}'``.
      check: ``check(setting) -> None``, raising
        :class:`~lowrank_jax.errors.NotApplicableError` when the method cannot apply to the
        model whatever the rules (``None``: no check).
      none: the reason given when several groups all select nothing (one group gives the
        rules' own reason).
    """

    groups: tuple[tuple[str, tuple], ...]
    settings: Callable[[CandidateSetting, float], dict]
    label: str
    check: Callable[[CandidateSetting], None] | None = None
    none: str = "no node this method accepts matches its rules"


@dataclasses.dataclass(frozen=True)
class Method:
    """A registered method.

    Fields:
      name: the name plans use.
      fn: ``fn(params, selection, settings, ctx) -> (new_params, rows)``.
      selects: ``'weights'`` (weight leaves) or ``'qk'`` (query-key objects).
      settings: the setting names the method understands (``None``: any).
      overrides: the setting names a rule may override (``None``: any of ``settings``).
      accepts: predicate on a node: which nodes of ``selects`` the method can take; rules are
        matched against those only (``None``: all).
      validate: ``validate(settings) -> None``, raising
        :class:`~lowrank_jax.errors.PlanError` on bad values; run for every step before any
        step runs, so a bad setting in the last step fails before the first one works.
      candidates: the method's frontier candidates (:func:`lowrank_jax.compress.frontier.
        default_candidates`): a declared :class:`Candidates`, or a function
        ``fn(setting: CandidateSetting) -> [Candidate]`` raising
        :class:`~lowrank_jax.errors.NotApplicableError` when the method does not apply to the
        model; ``None``: none.
      no_candidates: why the method has no candidates by design (listed among the frontier's
        skipped methods), or ``None``.
    """

    name: str
    fn: Callable
    selects: str = "weights"
    settings: frozenset | None = None
    overrides: frozenset | None = None
    accepts: Callable[[Any], bool] | None = None
    validate: Callable[[dict], None] | None = None
    candidates: Candidates | Callable[[CandidateSetting], list[Candidate]] | None = None
    no_candidates: str | None = None


_METHODS: dict[str, Method] = {}


def register_method(name: str, fn: Callable, *, selects: str = "weights",
                    settings: Iterable[str] | None = None,
                    overrides: Iterable[str] | None = None,
                    accepts: Callable[[Any], bool] | None = None,
                    validate: Callable[[dict], None] | None = None,
                    candidates: Candidates | Callable | None = None,
                    no_candidates: str | None = None) -> Method:
    """Register (or replace) a compression method.

    Args:
      name: the name plans use (``Step(name, rules, settings)``).
      fn: ``fn(params, selection, settings, ctx) -> (new_params, rows)`` (module docstring).
      selects: ``'weights'`` or ``'qk'``.
      settings: setting names the method understands; others are rejected before any step
        runs (``None``: accept any).
      overrides: setting names a rule may override (default: all of ``settings``).
      accepts: which nodes the method can take (rules only see those).
      validate: checks setting values before any step runs.
      candidates: its frontier candidates: a :class:`Candidates` or a function
        ``fn(setting: CandidateSetting) -> [Candidate]`` (:class:`Method`).
      no_candidates: why it has none by design (shown by the frontier).

    Returns:
      The registered :class:`Method`.
    """
    if not isinstance(name, str) or not name:
        raise PlanError(f"register_method: name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise PlanError(f"register_method: {name}: fn must be callable, got {fn!r}")
    if selects not in KINDS:
        raise PlanError(f"register_method: {name}: selects must be one of {KINDS}, got "
                        f"{selects!r}", where=name, expected=KINDS, actual=selects)
    _check_candidates(name, candidates, "register_method")
    settings = None if settings is None else frozenset(settings)
    overrides = settings if overrides is None else frozenset(overrides)
    m = Method(name=name, fn=fn, selects=selects, settings=settings, overrides=overrides,
               accepts=accepts, validate=validate, candidates=candidates,
               no_candidates=no_candidates)
    _METHODS[name] = m
    return m


def _check_candidates(name: str, candidates: Any, where: str) -> None:
    if candidates is not None and not (isinstance(candidates, Candidates) or callable(candidates)):
        raise PlanError(f"{where}: {name}: candidates must be a Candidates or a function of a "
                        f"CandidateSetting, got {candidates!r}", where=name,
                        expected="Candidates or a callable", actual=candidates)


def register_candidates(method: str, fn: Candidates | Callable) -> Method:
    """Give a registered method frontier candidates (or replace them): the same as passing
    ``candidates=`` to :func:`register_method`.

    Args:
      method: the registered method's name.
      fn: a :class:`Candidates`, or ``fn(setting: CandidateSetting) -> [Candidate]`` raising
        :class:`~lowrank_jax.errors.NotApplicableError` when the method does not apply to the
        model.

    Returns:
      The updated :class:`Method`.

    Raises:
      PlanError: ``method`` is not registered, or ``fn`` is neither.
    """
    if fn is None:
        raise PlanError(f"register_candidates: {method}: fn must be a Candidates or a callable, "
                        "got None", where=method, expected="Candidates or a callable", actual=None)
    _check_candidates(method, fn, "register_candidates")
    m = dataclasses.replace(get_method(method), candidates=fn, no_candidates=None)
    _METHODS[method] = m
    return m


def get_method(name: str) -> Method:
    """The method registered as ``name`` (a :class:`~lowrank_jax.errors.PlanError` listing the
    known ones otherwise)."""
    if name not in _METHODS:
        raise PlanError(f"unknown compression method {name!r}; known: {sorted(_METHODS)}",
                        where="method", expected=sorted(_METHODS), actual=name)
    return _METHODS[name]


def registered_methods() -> dict[str, Method]:
    """Every registered method, by name."""
    return dict(_METHODS)


__all__ = ["Candidate", "CandidateSetting", "Candidates", "Context", "Method", "get_method",
           "register_candidates", "register_method", "registered_methods"]
