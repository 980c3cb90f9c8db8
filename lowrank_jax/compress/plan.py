"""A compression plan is data: steps of (method, path rules, settings), applied in order.

As an optax ``chain`` is a list of transformations and big_vision's per-layer policies are
regex rules, a :class:`Plan` is a tuple of :class:`Step` s, each naming a registered method
(:func:`~lowrank_jax.compress.register_method`), the rules that select what it touches
(:mod:`lowrank_jax.compress.rules`) and its settings. A plan prints, compares, and round-trips
through JSON::

    {"steps": [
      {"method": "svd",
       "rules": ["attn/qk/(q|k)$", ["attn/v$", {"rank": 8}], ["^encoder/layers/0/", null]],
       "settings": {"eps": 0.1}}
    ]}

:func:`apply_plan` applies the steps in order to one tree and returns the new tree (the input is
never modified) and one :class:`~lowrank_jax.compress.Report` whose rows carry the step index.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Mapping, Sequence

import jax

from lowrank_jax import execution, runtime
from lowrank_jax._progress import progress_bar
from lowrank_jax.compress.registry import Context, get_method
from lowrank_jax.compress.report import Report, StepSummary, count_totals, counts
from lowrank_jax.compress.rules import candidates, normalize_rules, select
from lowrank_jax.errors import MissingFileError, PlanError


def _freeze(x: Any, where: str) -> Any:
    """Settings values as immutable, JSON-representable Python values (lists become tuples)."""
    if isinstance(x, Mapping):
        return {str(k): _freeze(v, where) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v, where) for v in x)
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        if not math.isfinite(float(x)):
            raise PlanError(f"{where}: setting values must be finite, got {x!r}", where=where,
                            expected="a finite number", actual=x)
        return float(x)
    raise PlanError(f"{where}: setting values must be JSON values (numbers, strings, bools, "
                    f"lists, dicts, null), got {type(x).__name__} {x!r}", where=where,
                    expected="a JSON value", actual=type(x).__name__)


def _thaw(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_thaw(v) for v in x]
    return x


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a plan: a method, the rules selecting what it touches, its settings.

    Args:
      method: a registered method name (``'svd'``, ``'factorize'``, ...).
      rules: path rules, first match wins (:mod:`lowrank_jax.compress.rules`): regex strings or
        ``(regex, overrides-dict-or-None)`` pairs. Stored normalized as ``(pattern, action)``
        pairs.
      settings: the method's settings (JSON values; lists are stored as tuples).

    Raises:
      PlanError: no rules, a malformed rule or an invalid regular expression (naming the
        rule), settings that are not a dict of JSON values.
    """

    method: str
    rules: tuple = ()
    settings: Mapping = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.method, str) or not self.method:
            raise PlanError(f"Step: method must be a non-empty string, got {self.method!r}",
                            where="method", expected="a method name", actual=self.method)
        where = f"step ({self.method})"
        compiled = normalize_rules(self.rules, where=where)
        if not compiled:
            raise PlanError(f"{where}: no rules: give at least one path rule (for example "
                            "ATTENTION_QKVO, the attention projections)", where="rules",
                            expected="at least one rule", actual=[])
        object.__setattr__(self, "rules", tuple(
            (r.pattern, None if r.action is None else _freeze(r.action, f"{where}: rule "
                                                              f"{r.pattern!r}"))
            for r in compiled))
        if not isinstance(self.settings, Mapping):
            raise PlanError(f"{where}: settings must be a dict, got {self.settings!r}",
                            where="settings", expected="dict", actual=self.settings)
        object.__setattr__(self, "settings", _freeze(self.settings, f"{where}: settings"))

    def to_dict(self) -> dict:
        """JSON-able form (a rule without overrides is written as its pattern)."""
        rules = [p if a == {} else [p, _thaw(a)] for p, a in self.rules]
        return {"method": self.method, "rules": rules, "settings": _thaw(self.settings)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sequence of :class:`Step` s applied in order by :func:`apply_plan`."""

    steps: tuple[Step, ...] = ()

    def __post_init__(self):
        steps = self.steps
        if isinstance(steps, Step):
            steps = (steps,)
        if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)):
            raise PlanError(f"Plan: steps must be a sequence of Step, got {steps!r}",
                            where="steps", expected="a list of steps", actual=steps)
        for i, s in enumerate(steps):
            if not isinstance(s, Step):
                raise PlanError(f"Plan: step {i} must be a Step, got {type(s).__name__}",
                                where=f"steps[{i}]", expected="Step", actual=type(s).__name__)
        object.__setattr__(self, "steps", tuple(steps))

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"steps": [s.to_dict() for s in self.steps]}

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text (:meth:`from_json` reads it back to an equal plan)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<plan>") -> "Plan":
        """A plan from its dict form ``{"steps": [{"method", "rules", "settings"}, ...]}``."""
        if not isinstance(d, Mapping) or set(d) != {"steps"} or not isinstance(d["steps"], list):
            got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
            raise PlanError(f"{source}: a plan must be an object with one key 'steps' (a list "
                            f"of steps), got {got}", where=source,
                            expected={"steps": "list"}, actual=got)
        steps = []
        for i, s in enumerate(d["steps"]):
            where = f"{source}: steps[{i}]"
            if not isinstance(s, Mapping) or "method" not in s:
                raise PlanError(f"{where}: a step must be an object with 'method' (and "
                                f"'rules', 'settings'), got {s!r}", where=where,
                                expected=["method", "rules", "settings"], actual=s)
            extra = set(s) - {"method", "rules", "settings"}
            if extra:
                raise PlanError(f"{where}: unknown keys {sorted(extra)}; a step has 'method', "
                                "'rules' and 'settings'", where=where,
                                expected=["method", "rules", "settings"], actual=sorted(extra))
            rules = s.get("rules", [])
            if not isinstance(rules, list):
                raise PlanError(f"{where}: 'rules' must be a list, got {rules!r}", where=where,
                                expected="list", actual=rules)
            rules = [tuple(r) if isinstance(r, list) else r for r in rules]
            steps.append(Step(s["method"], tuple(rules), s.get("settings") or {}))
        return cls(tuple(steps))

    @classmethod
    def from_json(cls, text: str, *, source: str = "<plan>") -> "Plan":
        """A plan from JSON text (see the module docstring)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{source}: not valid JSON: {e}", where=source,
                            expected="JSON", actual=str(e)) from None
        return cls.from_dict(d, source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Plan":
        """A plan from a JSON file.

        Raises:
          MissingFileError: the file does not exist.
          PlanError: the path is a directory, or the file is not a valid plan (the message names
            the file).
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            raise PlanError(f"plan file {path} is a directory; expected a JSON file", where=path,
                            expected="a JSON file", actual="a directory")
        if not os.path.isfile(path):
            raise MissingFileError(f"plan file {path} does not exist", where=path)
        with open(path) as f:
            return cls.from_json(f.read(), source=path)


def as_plan(plan: Any) -> Plan:
    """A :class:`Plan` from a plan, a single step, a list of steps or a plan dict."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Step):
        return Plan((plan,))
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan)
    if isinstance(plan, (list, tuple)):
        return Plan(tuple(plan))
    raise PlanError(f"apply_plan: expected a Plan, a Step, a list of steps or a plan dict, got "
                    f"{type(plan).__name__}", where="plan", expected="Plan",
                    actual=type(plan).__name__)


def validate_plan(plan: Plan) -> None:
    """Check every step before any runs: the method exists, its setting and override names are
    known, the method's own value checks pass.

    Raises:
      PlanError: naming the step, the method and the offending key or value.
    """
    for i, step in enumerate(plan.steps):
        m = get_method(step.method)
        where = f"step {i} ({step.method})"
        if m.settings is not None:
            unknown = set(step.settings) - m.settings
            if unknown:
                raise PlanError(f"{where}: unknown settings {sorted(unknown)}; {step.method} "
                                f"understands {sorted(m.settings)}", where=where,
                                expected=sorted(m.settings), actual=sorted(unknown))
        if m.overrides is not None:
            for pattern, action in step.rules:
                unknown = set(action or ()) - m.overrides
                if unknown:
                    raise PlanError(f"{where}: rule {pattern!r}: unknown override keys "
                                    f"{sorted(unknown)}; allowed: {sorted(m.overrides)}",
                                    where=pattern, expected=sorted(m.overrides),
                                    actual=sorted(unknown))
        if m.validate is not None:
            try:
                m.validate(dict(step.settings))
            except PlanError as e:
                raise PlanError(f"{where}: {e}", where=e.where or where, expected=e.expected,
                                actual=e.actual) from None


def apply_plan(params: Any, plan: Any, *, key=None, inputs: Mapping | None = None,
               config: Any = None, progress: bool = False,
               head_widths: Any = None, blas_threads: int | None = 1) -> tuple[Any, Report]:
    """Apply the steps of a plan in order to one parameter tree.

    Every step is validated before the first one runs. Step ``i`` selects nodes in the tree
    as step ``i - 1`` left it, with its own rules, and calls its method.

    Args:
      params: a parameter tree (not modified).
      plan: a :class:`Plan` (or a :class:`Step`, a list of steps, or a plan dict).
      key: PRNG key for methods that draw random numbers (``factorize``); step ``i`` gets
        ``jax.random.fold_in(key, i)``.
      inputs: ``{path: activations [..., d_in]}`` for data-aware methods (``svd`` projects those
        weights onto the leading subspace of their inputs). Every path must be a weight of
        ``params`` and be used by some step.
      config: the model config, passed to methods that need it.
      progress: show progress (bars on a terminal, plain lines elsewhere:
        :func:`lowrank_jax._progress.progress_bar`).
      head_widths: ``head_widths(tree, path) -> per-head output widths | None`` for trees that
        do not record heads in attention blocks (:mod:`lowrank_jax.interop`: Flax kernels over
        heads); ``svd``'s ``per_head`` asks it before the attention block.
      blas_threads: the most threads of the host BLAS / LAPACK while the steps run
        (:func:`lowrank_jax.runtime.blas_threads`; ``None``: leave them as they are). One by
        default: the decompositions of a model's weights are faster on one thread on a busy
        machine and about as fast on an idle one (figures in :mod:`lowrank_jax.runtime`).

    Returns:
      ``(new_params, report)``: the new tree and a :class:`~lowrank_jax.compress.Report` with
      one row per selected node per step (the step index in ``row.step``).

    Raises:
      PlanError: an unknown method, an unknown setting or override key, a bad setting value,
        a bad regular expression, a rule matching nothing (listing the available paths),
        ``inputs`` for a path that is no weight or that no step used.
      ConfigError: ``blas_threads`` not an int >= 1 or None.
    """
    plan = as_plan(plan)
    validate_plan(plan)
    runtime.check_blas_threads(blas_threads)
    inputs = dict(inputs or {})
    if inputs:
        weights = [p for p, _ in candidates(params, "weights")]
        for p in inputs:
            if p not in weights:
                raise PlanError(f"apply_plan: inputs given for {p!r}, which is not a weight "
                                f"path of params; weights: {weights[:12]}", where=p,
                                expected="a weight path", actual=p)
    tree = params
    rows, summaries, used = [], [], set()
    steps = progress_bar(plan.steps, desc="plan", unit="step",
                         enabled=progress and len(plan.steps) >= 2, leave=True)
    # Decompositions, importance scores and errors in full float32 on every backend
    # (execution.reference_precision): a GPU's default TF32 products would blur them.
    with runtime.blas_threads(blas_threads), execution.reference_precision():
        for i, step in enumerate(steps):
            m = get_method(step.method)
            where = f"step {i} ({step.method})"
            selection = select(tree, step.rules, kind=m.selects, accepts=m.accepts,
                               allowed=m.overrides, where=where)
            ctx = Context(step=i, method=step.method,
                          key=None if key is None else jax.random.fold_in(key, i),
                          inputs=inputs, config=config, progress=progress,
                          head_widths=head_widths)
            counts_in = counts(tree)
            tree, step_rows = m.fn(tree, selection, dict(step.settings), ctx)
            used |= ctx.used_inputs
            rows.extend(dataclasses.replace(r, step=i, method=step.method) for r in step_rows)
            summaries.append(StepSummary(index=i, method=step.method, rules=step.rules,
                                         settings=step.settings, info=dict(ctx.info),
                                         tree=count_totals(counts_in, counts(tree))))
    unused = sorted(set(inputs) - used)
    if unused:
        raise PlanError(f"apply_plan: inputs given for {unused}, which no step used (only "
                        "methods that project onto inputs, such as svd, use them, for the "
                        "weights their rules select)", where=unused[0],
                        expected="paths selected by a data-aware step", actual=unused)
    return tree, Report.build(params, tree, rows, summaries)


__all__ = ["Plan", "Step", "apply_plan", "as_plan", "validate_plan"]
