"""Which compression should I use? Every applicable method at several strengths, measured.

:func:`frontier` compresses one model with every applicable plan method and a few
combinations of them, each at several strengths (:func:`default_candidates`; every candidate is
an ordinary :class:`~lowrank_jax.compress.Plan`), and measures for each

* its **size**: parameters (:func:`lowrank_jax.param_count`) and storage bits
  (:func:`lowrank_jax.storage_bits`; the size ratio is the ratio of storage bits, so a 1-bit
  weight counts as one bit);
* its **FLOPs**: multiply-adds of the weight leaves for one sample (each leaf's
  ``flops(rows)`` with the rows it sees, :func:`model_flops`), and XLA's count of the whole
  compiled forward (attention scores, norms and softmax included; 2 per multiply-add);
* its **time**: the jitted forward on one batch, timed interleaved with the dense model (one
  call of each per round, the order alternating), median over the rounds, as a ratio to the
  dense median; on a shared machine these ratios are noisy;
* its **quality** on held-out data: WQL and MASE of the forecast for forecasters
  (:class:`ForecastData`; geometric means over datasets relative to the dense model, as
  Chronos reports them), top-1 accuracy for classifiers (:class:`ClassificationData`; against
  the dense model's predictions when no labels are given), otherwise the relative error of the
  primary output against the dense model (:class:`OutputData`).

Results are **zero-shot**: no candidate is fine-tuned after compression (the frontier shows
what each method costs before any recovery training; fine-tuning is a separate step, see
:func:`lowrank_jax.train.fit`).

The exact Pareto frontiers (:func:`pareto_front`) of quality against the size ratio and against
the time ratio are computed, and for a budget ``B`` the best candidate whose ratio is at most
``B`` is recommended on each axis (:func:`recommend`). :func:`plot_frontier` draws them.

Which methods apply is decided by the model's leaves: a method's candidates are made only when
its rules select a node the registered method accepts (its ``accepts`` predicate); methods
that do not make one device's model smaller (``lora``, ``factorize`` from scratch, the
multi-machine ``partition`` and ``compress_keys``) are listed with the reason they were left
out, and so is any registered method without a candidate generator
(:func:`register_candidates` adds one)::

    from lowrank_jax.compress.frontier import ForecastData, frontier
    result = frontier(cfg, params, ForecastData(context, target), budget=0.5, progress=True)
    print(result.format_table())
    result.recommended("size")          # the best candidate at <= half the storage
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import runtime
from lowrank_jax._progress import progress_bar
from lowrank_jax.compress.plan import Plan, Step, apply_plan
from lowrank_jax.compress.registry import registered_methods
from lowrank_jax.compress.rules import ATTENTION_QK, ATTENTION_QKVO, select
from lowrank_jax.errors import ConfigError, DataError, LowrankJaxError, PlanError
from lowrank_jax.leaves import is_leaf, named_leaves, param_count, storage_bits
from lowrank_jax.leaves.channel_masked import count_rows
from lowrank_jax.losses import geometric_mean_relative, mase, wql
from lowrank_jax.models import apply as model_apply
from lowrank_jax.models import family_of, primary_output

#: Path rules of the candidates: attention projections and MLP projections.
ATTENTION = ATTENTION_QKVO
MLP = (r"mlp/(wi|wi_0|wi_1|wo)$",)
VALUES = (r"attn/v$",)
#: Fraction of the selected weights (or of their rank) each method keeps.
STRENGTHS = (0.75, 0.5, 0.25)
QUICK_STRENGTHS = (0.5,)
#: The axes of the frontier: name -> row key of the cost.
AXES = {"size": "size_ratio", "time": "time_ratio"}
#: Registered methods that are not candidates, and why.
NOT_CANDIDATES = {
    "lora": "adds trainable low-rank updates (for fine-tuning): a larger model, not a smaller "
            "one",
    "factorize": "replaces weights by random factors (compressed pretraining, `lowrank-jax "
                 "train`): meaningless without training",
    "partition": "splits layers over machines: it saves bytes sent between machines "
                 "(`lowrank-jax partition` measures them), not one device's size or time",
    "compress_keys": "splits attention over machines by tokens: it saves communication, not "
                     "one device's size or time",
}
#: Errors a candidate may raise that skip it (recorded in its row) instead of ending the run.
CANDIDATE_ERRORS = (LowrankJaxError, ValueError, TypeError, ArithmeticError,
                    np.linalg.LinAlgError)


def check_budget(budget: Any, where: str = "budget") -> float:
    """``budget`` as a float in ``(0, 1]``.

    Raises:
      ConfigError: anything else (naming ``where``).
    """
    if (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
            or not math.isfinite(float(budget)) or not 0.0 < budget <= 1.0):
        raise ConfigError(f"{where} must be a ratio to the dense model in (0, 1] (0.5: at most "
                          f"half its size or time), got {budget!r}", where=where,
                          expected="(0, 1]", actual=budget)
    return float(budget)


# ---------------------------------------------------------------------------------------------
# Candidates.

@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compressed variant of the model.

    Fields:
      name: unique label (``'svd attn ratio=0.5'``).
      group: the method or combination, for colors and grouping (``'svd attn'``).
      keep: the strength: the fraction of the selected weights (or of their rank) kept.
      plan: the :class:`~lowrank_jax.compress.Plan` that makes it.
    """

    name: str
    group: str
    keep: float
    plan: Plan


@dataclasses.dataclass(frozen=True)
class CandidateSetting:
    """What a candidate generator gets.

    Fields:
      params: the dense model's parameters.
      config: its config (``None`` for a bare tree).
      strengths: the ``keep`` fractions to make candidates at.
      prune_steps: pruning batches of a ``prune`` candidate (Algorithm 1's ``B``).
      prune_data: the batch source a ``prune`` candidate scores channels on
        (:func:`lowrank_jax.compress.prune.register_batches`).
    """

    params: Any
    config: Any
    strengths: tuple[float, ...]
    prune_steps: int = 8
    prune_data: str = "builtin"


class NotApplicable(Exception):
    """Raised by a candidate generator: the method does not apply to this model (the message
    says why)."""


_GENERATORS: dict[str, Callable[[CandidateSetting], list[Candidate]]] = {}


def register_candidates(method: str, fn: Callable[[CandidateSetting], list[Candidate]]) -> None:
    """Register the candidate generator of a method (or replace one).

    Args:
      method: the registered method's name.
      fn: ``fn(setting: CandidateSetting) -> [Candidate]``; raises :class:`NotApplicable`
        when the method does not apply to the model.
    """
    if not callable(fn):
        raise PlanError(f"register_candidates: {method}: fn must be callable, got {fn!r}",
                        where=method, expected="a callable", actual=fn)
    _GENERATORS[method] = fn


def _require(params: Any, method: str, rules: Sequence) -> list:
    """The nodes ``rules`` select for ``method`` (its kind and ``accepts``), or
    :class:`NotApplicable`."""
    m = registered_methods().get(method)
    if m is None:
        raise NotApplicable(f"{method} is not registered")
    try:
        return select(params, rules, kind=m.selects, accepts=m.accepts, where=method)
    except PlanError:
        raise NotApplicable(f"no node this method accepts matches {list(rules)}") from None


def _head_width(params: Any) -> tuple[int, int]:
    """``(heads, widest head)`` over the model's query-key objects (for per-head ranks)."""
    sel = _require(params, "truncatt", ATTENTION_QK)
    # a block without heads has no widths; a factored query-key object no per-head projections
    widths = [w for s in sel if (p := s.node.projections()) is not None for w in p.widths]
    return max(s.node.num_heads for s in sel), max(widths, default=0)


def _svd(s: CandidateSetting) -> list[Candidate]:
    out = []
    groups = (("svd attn", ATTENTION), ("svd mlp", MLP), ("svd attn+mlp", ATTENTION + MLP))
    for group, rules in groups:
        try:
            _require(s.params, "svd", rules)
        except NotApplicable:
            continue
        out += [Candidate(f"{group} ratio={k:g}", group, k,
                          Plan((Step("svd", rules, {"ratio": k}),))) for k in s.strengths]
    if not out:
        raise NotApplicable("no attention or MLP projection it can truncate")
    return out


def _prune_rules():
    from lowrank_jax.compress.prune import DEFAULT_RULES

    return DEFAULT_RULES


def _check_prunable(s: CandidateSetting) -> None:
    if s.config is None:
        raise NotApplicable("needs a model config (its loss scores the channels)")
    fam = family_of(s.config)
    if fam.loss is None:
        raise NotApplicable(f"family {fam.name!r} has no default loss to score channels")
    if s.prune_data == "builtin" and fam.batch_from_windows is None:
        raise NotApplicable(f"its built-in batches are series windows; family {fam.name!r} is "
                            "not a forecaster (register_batches gives it batches)")


def _prune_step(rules, keep: float, s: CandidateSetting) -> Step:
    return Step("prune", rules, {"target": round(1.0 - keep, 6), "steps": s.prune_steps,
                                 "batch_size": 16, "data": s.prune_data})


def _prune(s: CandidateSetting) -> list[Candidate]:
    _check_prunable(s)
    rules = _prune_rules()
    _require(s.params, "prune", rules)
    return [Candidate(f"prune target={1 - k:g}", "prune", k, Plan((_prune_step(rules, k, s),)))
            for k in s.strengths]


def _truncatt(s: CandidateSetting) -> list[Candidate]:
    _, w = _head_width(s.params)
    out = []
    for k in s.strengths:
        r = max(1, round(k * w))
        out.append(Candidate(f"truncatt rank={r}/head", "truncatt", k,
                             Plan((Step("truncatt", ATTENTION_QK, {"rank": r}),))))
    return out


def _qk_tensor(method: str) -> Callable[[CandidateSetting], list[Candidate]]:
    def gen(s: CandidateSetting) -> list[Candidate]:
        _require(s.params, method, ATTENTION_QK)
        h, w = _head_width(s.params)
        out = []
        for k in s.strengths:
            r = max(1, round(k * h * w))
            out.append(Candidate(f"{method} R={r}", method, k,
                                 Plan((Step(method, ATTENTION_QK, {"rank": r}),))))
        return out

    return gen


def _truncatt_vo(s: CandidateSetting) -> list[Candidate]:
    _require(s.params, "truncatt_vo", VALUES)
    _, w = _head_width(s.params)
    out = []
    for k in s.strengths:
        r = max(1, round(k * w))
        out.append(Candidate(f"truncatt_vo rank={r}/head", "truncatt_vo", k,
                             Plan((Step("truncatt_vo", VALUES, {"rank": r}),))))
    return out


def _binarize(s: CandidateSetting) -> list[Candidate]:
    out = []
    for group, rules in (("binarize mlp", MLP), ("binarize attn+mlp", ATTENTION + MLP)):
        try:
            _require(s.params, "binarize", rules)
        except NotApplicable:
            continue
        out += [Candidate(f"{group} keep={k:g}", group, k,
                          Plan((Step("binarize", rules, {"keep": k}),))) for k in s.strengths]
    if not out:
        raise NotApplicable("no attention or MLP projection it can binarize")
    return out


register_candidates("svd", _svd)
register_candidates("prune", _prune)
register_candidates("truncatt", _truncatt)
register_candidates("cp", _qk_tensor("cp"))
register_candidates("btd", _qk_tensor("btd"))
register_candidates("truncatt_vo", _truncatt_vo)
register_candidates("binarize", _binarize)


def _combinations(s: CandidateSetting, available: set[str]) -> list[Candidate]:
    """Plans of two methods: SVD of attention after pruning the MLP's hidden channels; the
    query-key and the value-output sides of TruncAtt together; SVD of attention with a binary
    MLP. Made only where both parts apply."""
    out = []
    if {"svd", "prune"} <= available:
        try:
            _check_prunable(s)
            _require(s.params, "prune", MLP)
            _require(s.params, "svd", ATTENTION)
            out += [Candidate(f"prune mlp {1 - k:g} + svd attn {k:g}", "prune mlp + svd attn", k,
                              Plan((_prune_step(MLP, k, s),
                                    Step("svd", ATTENTION, {"ratio": k}))))
                    for k in s.strengths]
        except NotApplicable:
            pass
    if {"truncatt", "truncatt_vo"} <= available:
        try:
            _require(s.params, "truncatt_vo", VALUES)
            _, w = _head_width(s.params)
            for k in s.strengths:
                r = max(1, round(k * w))
                out.append(Candidate(f"truncatt + truncatt_vo rank={r}/head",
                                     "truncatt + truncatt_vo", k,
                                     Plan((Step("truncatt", ATTENTION_QK, {"rank": r}),
                                           Step("truncatt_vo", VALUES, {"rank": r})))))
        except NotApplicable:
            pass
    if {"svd", "binarize"} <= available:
        try:
            _require(s.params, "binarize", MLP)
            _require(s.params, "svd", ATTENTION)
            out += [Candidate(f"svd attn {k:g} + binarize mlp {k:g}", "svd attn + binarize mlp",
                              k, Plan((Step("svd", ATTENTION, {"ratio": k}),
                                       Step("binarize", MLP, {"keep": k}))))
                    for k in s.strengths]
        except NotApplicable:
            pass
    return out


def default_candidates(params: Any, config: Any = None, *, quick: bool = False,
                       strengths: Sequence[float] | None = None,
                       methods: Sequence[str] | None = None, prune_steps: int | None = None,
                       prune_data: str = "builtin", combinations: bool = True
                       ) -> tuple[list[Candidate], dict[str, str]]:
    """Every applicable registered method at several strengths, and a few combinations.

    Args:
      params: the dense model's parameters.
      config: its config (``prune`` needs one).
      quick: one strength (0.5) and 4 pruning batches.
      strengths: the ``keep`` fractions (default :data:`STRENGTHS`, quick
        :data:`QUICK_STRENGTHS`), each in ``(0, 1)``.
      methods: only these registered methods (default: all); combinations need both parts.
      prune_steps: pruning batches per ``prune`` candidate (default 8, quick 4).
      prune_data: the batch source of ``prune`` candidates.
      combinations: also make the two-method plans.

    Returns:
      ``(candidates, skipped)``: the candidates in method order, and ``{method: why it has
      none}`` for every registered method left out.

    Raises:
      ConfigError: a strength outside ``(0, 1)``, or a method in ``methods`` that is not
        registered.
    """
    strengths = tuple(QUICK_STRENGTHS if quick else STRENGTHS) if strengths is None else tuple(
        strengths)
    for k in strengths:
        if isinstance(k, bool) or not isinstance(k, numbers.Real) or not 0.0 < k < 1.0:
            raise ConfigError(f"frontier: strengths must be fractions kept in (0, 1), got {k!r}",
                              where="strengths", expected="(0, 1)", actual=k)
    registered = registered_methods()
    wanted = sorted(registered) if methods is None else list(methods)
    unknown = [m for m in wanted if m not in registered]
    if unknown:
        raise ConfigError(f"frontier: unknown methods {unknown}; registered: {sorted(registered)}",
                          where="methods", expected=sorted(registered), actual=unknown)
    setting = CandidateSetting(params, config, strengths,
                               prune_steps or (4 if quick else 8), prune_data)
    out, skipped, available = [], {}, set()
    order = [m for m in _GENERATORS if m in wanted] + [m for m in wanted if m not in _GENERATORS]
    for name in order:
        if name in NOT_CANDIDATES:
            skipped[name] = NOT_CANDIDATES[name]
            continue
        gen = _GENERATORS.get(name)
        if gen is None:
            skipped[name] = "no candidate generator for this method (register_candidates)"
            continue
        try:
            made = gen(setting)
        except NotApplicable as e:
            skipped[name] = f"not applicable: {e}"
            continue
        out += made
        available.add(name)
    if combinations:
        out += _combinations(setting, available)
    return out, skipped


# ---------------------------------------------------------------------------------------------
# Held-out data and quality.

def _batched(x: np.ndarray, batch: int) -> list[tuple[np.ndarray, int]]:
    """``(chunk, n_real)`` of ``batch`` rows each (the last one zero-padded): one compiled
    shape for every call."""
    out = []
    for start in range(0, len(x), batch):
        chunk = x[start:start + batch]
        pad = batch - len(chunk)
        if pad:
            chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
        out.append((chunk, batch - pad))
    return out


@functools.partial(jax.jit, static_argnums=(3, 4))
def _forecast_metrics(pred, target, context, spans: tuple, levels: tuple):
    """``[(wql, mase)]`` of the rows ``a:b`` of every span: one compiled program for all the
    datasets and candidates (instead of one compile per operation and dataset size)."""
    median = pred[:, levels.index(0.5)] if 0.5 in levels else jnp.median(pred, 1)
    return [(wql(pred[a:b], target[a:b], levels), mase(median[a:b], target[a:b], context[a:b]))
            for a, b in spans]


@dataclasses.dataclass(frozen=True)
class ForecastData:
    """Held-out forecasting windows (scaled as the model expects them).

    Fields:
      context: ``[n, context_length]`` past values.
      target: ``[n, horizon]`` future values (``horizon <= prediction_length``).
      groups: ``{dataset: (start, stop)}`` rows of each dataset: WQL and MASE are then geometric
        means over datasets of the ratio to the dense model (Chronos' aggregate); ``None``: one
        pooled ratio.
      description: where the windows come from (for reports).
      batch: windows per forward call (the timed batch is the first one).
    """

    context: np.ndarray
    target: np.ndarray
    groups: Mapping[str, tuple[int, int]] | None = None
    description: str = ""
    batch: int = 256

    metric = "wql"
    higher_is_better = False

    def __post_init__(self):
        c, t = np.asarray(self.context, np.float32), np.asarray(self.target, np.float32)
        if c.ndim != 2 or t.ndim != 2 or len(c) != len(t) or len(c) == 0:
            raise DataError(f"ForecastData: expected context [n, length] and target [n, horizon] "
                            f"with the same n >= 1, got {c.shape} and {t.shape}", where="context",
                            expected="[n, length], [n, horizon]", actual=(c.shape, t.shape))
        object.__setattr__(self, "context", c)
        object.__setattr__(self, "target", t)
        object.__setattr__(self, "batch", int(min(self.batch, len(c))))

    def forward(self, config: Any, params: Any) -> Callable:
        fam = family_of(config)
        if fam.forecast is None:
            raise DataError(f"ForecastData: family {fam.name!r} has no forecast", where="data",
                            expected="a forecasting family", actual=fam.name)
        return jax.jit(lambda p, c: fam.forecast(p, c, config))

    def timing_input(self):
        return _batched(self.context[:self.batch], self.batch)[0][0]

    def predict(self, compiled: Callable, params: Any) -> np.ndarray:
        outs = [np.asarray(compiled(params, c))[:n]
                for c, n in _batched(self.context, self.batch)]
        return np.concatenate(outs)[:, :, :self.target.shape[1]]  # [n, levels, horizon]

    def scores(self, pred: np.ndarray, config: Any) -> dict:
        """Absolute WQL / MASE (:mod:`lowrank_jax.losses`), pooled and per group."""
        levels = tuple(float(q) for q in family_of(config).forecast_levels(config))
        spans = {"pooled": (0, len(pred)), **dict(self.groups or {})}
        values = _forecast_metrics(pred, self.target, self.context,
                                   tuple(tuple(int(i) for i in v) for v in spans.values()), levels)
        return {name: {"wql": float(w), "mase": float(m)}
                for name, (w, m) in zip(spans, values, strict=True)}

    def score(self, pred: np.ndarray, dense: dict, config: Any) -> dict:
        """``wql`` / ``mase`` relative to the dense model's (``dense``: :meth:`scores` of its
        forecast), and the absolute pooled values."""
        own = self.scores(pred, config)
        out = {"wql_abs": own["pooled"]["wql"], "mase_abs": own["pooled"]["mase"]}
        groups = [g for g in own if g != "pooled"]
        for m in ("wql", "mase"):
            try:
                out[m] = (geometric_mean_relative({g: own[g][m] for g in groups},
                                                  {g: dense[g][m] for g in groups}) if groups
                          else own["pooled"][m] / dense["pooled"][m])
            except (ValueError, ZeroDivisionError):  # a zero or non-finite score
                out[m] = float("nan")
        return out


@dataclasses.dataclass(frozen=True)
class ClassificationData:
    """Held-out inputs of a classifier (logits ``[batch, classes]``).

    Fields:
      inputs: the model's inputs dict, batch first.
      labels: ``[batch]`` class ids; ``None``: the dense model's top-1 predictions (the metric
        is then called ``agreement``).
      description: where the inputs come from.
    """

    inputs: Mapping[str, Any]
    labels: Any = None
    description: str = ""

    higher_is_better = True

    @property
    def metric(self) -> str:
        return "accuracy" if self.labels is not None else "agreement"

    def forward(self, config: Any, params: Any) -> Callable:
        return _output_forward(config, params, self.inputs)

    def timing_input(self):
        return dict(self.inputs)

    def predict(self, compiled: Callable, params: Any) -> np.ndarray:
        return np.asarray(compiled(params, dict(self.inputs)))

    def scores(self, pred: np.ndarray, config: Any) -> dict:
        return {"top1": np.argmax(pred, -1)}

    def score(self, pred: np.ndarray, dense: dict, config: Any) -> dict:
        labels = dense["top1"] if self.labels is None else np.asarray(self.labels)
        return {self.metric: float(np.mean(np.argmax(pred, -1) == labels))}


@dataclasses.dataclass(frozen=True)
class OutputData:
    """Held-out inputs of a model scored by the relative error of its primary output against
    the dense model's (``||y - y_dense||_F / ||y_dense||_F``).

    Fields:
      inputs: the model's inputs dict, batch first.
      description: where the inputs come from.
    """

    inputs: Mapping[str, Any]
    description: str = ""

    metric = "rel_error"
    higher_is_better = False

    def forward(self, config: Any, params: Any) -> Callable:
        return _output_forward(config, params, self.inputs)

    def timing_input(self):
        return dict(self.inputs)

    def predict(self, compiled: Callable, params: Any) -> np.ndarray:
        return np.asarray(compiled(params, dict(self.inputs)), np.float64)

    def scores(self, pred: np.ndarray, config: Any) -> dict:
        return {"output": pred}

    def score(self, pred: np.ndarray, dense: dict, config: Any) -> dict:
        ref = dense["output"]
        return {"rel_error": float(np.linalg.norm(pred - ref) / max(np.linalg.norm(ref), 1e-30))}


def _output_forward(config: Any, params: Any, inputs: Mapping) -> Callable:
    fam = family_of(config)
    key = primary_output(fam, jax.eval_shape(lambda p: fam.apply(p, dict(inputs), config),
                                             params))
    return jax.jit(lambda p, inp: model_apply(p, inp, config)[key])


def is_classifier(config: Any, params: Any, inputs: Mapping) -> bool:
    """Whether the model's primary output is ``logits [batch, classes]`` (not per token)."""
    fam = family_of(config)
    shapes = jax.eval_shape(lambda p: fam.apply(p, dict(inputs), config), params)
    key = primary_output(fam, shapes)
    return key == "logits" and len(shapes[key].shape) == 2 and not fam.token_outputs


# ---------------------------------------------------------------------------------------------
# Counts and time.

def leaf_rows(config: Any, params: Any, inputs: Mapping | None = None) -> dict[str, int]:
    """Rows (tokens times batch) each weight leaf sees in one forward pass of one sample of the
    family's representative inputs (or of ``inputs``): an abstract trace
    (:func:`~lowrank_jax.leaves.channel_masked.count_rows`), nothing is computed."""
    fam = family_of(config)
    if inputs is None:
        inputs = fam.sample_inputs(config, np.random.default_rng(0), 1)
    else:
        inputs = {k: np.asarray(v)[:1] for k, v in inputs.items()}
    return count_rows(lambda p: fam.apply(p, dict(inputs), config), params)


def model_flops(config: Any, params: Any, inputs: Mapping | None = None, *,
                rows: Mapping[str, int] | None = None) -> int:
    """Multiply-adds of the weight leaves in one forward pass of one sample: each leaf's
    ``flops(rows)`` with the rows it sees (:func:`leaf_rows`).

    Args:
      config, params, inputs: as for :func:`leaf_rows`.
      rows: rows per path already counted (for example on the uncompressed model, whose paths a
        compressed one often keeps); used when it covers every weight leaf of ``params``.

    Attention score products are not included (see :func:`lowrank_jax.nn.attention_score_flops`);
    :func:`frontier` reports them inside XLA's count of the compiled program.
    """
    leaves = [(path, node) for path, node in named_leaves(params) if is_leaf(node)]
    if rows is None or any(path not in rows for path, _ in leaves):
        rows = leaf_rows(config, params, inputs)
    return int(sum(node.flops(rows.get(path, 0)) for path, node in leaves))


def _xla_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - an optional estimate some backends do not give
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    value = (cost or {}).get("flops")
    return float(value) if value is not None and value >= 0 else None


def time_interleaved(calls: Sequence[Callable[[], Any]], runs: int) -> list[float]:
    """Median seconds of each call, the calls run in turn every round (the order reversed on
    odd rounds), so that machine noise hits them alike. Each call is run once first (warm-up).
    """
    for call in calls:
        jax.block_until_ready(call())
    times: list[list[float]] = [[] for _ in calls]
    order = list(range(len(calls)))
    for i in range(runs):
        for j in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(calls[j]())
            times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


# ---------------------------------------------------------------------------------------------
# Frontier.

def pareto_front(cost: Sequence[float], loss: Sequence[float]) -> np.ndarray:
    """Indices of the points no other point dominates, both coordinates minimized.

    Point ``j`` dominates ``i`` when ``cost_j <= cost_i`` and ``loss_j <= loss_i`` with one of
    them strict; equal points do not dominate each other (both are kept). Points with a
    non-finite coordinate are left out. Sorted by cost, then loss, then index.
    """
    c, q = np.asarray(cost, np.float64), np.asarray(loss, np.float64)
    if c.shape != q.shape or c.ndim != 1:
        raise ValueError(f"pareto_front: cost and loss must be 1-D of one length, got {c.shape} "
                         f"and {q.shape}")
    idx = np.flatnonzero(np.isfinite(c) & np.isfinite(q))
    order = idx[np.lexsort((idx, q[idx], c[idx]))]
    out, best, i = [], math.inf, 0
    while i < len(order):
        j = i
        while j < len(order) and c[order[j]] == c[order[i]]:
            j += 1
        low = q[order[i]]  # the lowest loss at this cost
        if low < best:
            out += [int(k) for k in order[i:j] if q[k] == low]
            best = low
        i = j
    return np.asarray(out, np.int64)


def recommend(cost: Sequence[float], loss: Sequence[float], budget: float) -> int | None:
    """Index of the lowest-loss point with ``cost <= budget`` (ties: the lower cost, then the
    lower index), or ``None`` when none fits. The point is on :func:`pareto_front`."""
    budget = check_budget(budget)
    c, q = np.asarray(cost, np.float64), np.asarray(loss, np.float64)
    ok = np.flatnonzero(np.isfinite(c) & np.isfinite(q) & (c <= budget))
    if ok.size == 0:
        return None
    return int(ok[np.lexsort((ok, c[ok], q[ok]))[0]])


@dataclasses.dataclass
class FrontierResult:
    """The measured candidates and their frontiers.

    Fields:
      rows: one dict per candidate, the dense model first (``name``, ``group``, ``keep``,
        ``plan``, ``params``, ``storage_bits``, ``flops``, ``xla_flops``, ``size_ratio``,
        ``param_ratio``, ``flop_ratio``, ``xla_flop_ratio``, ``time_ratio``, ``time_ms``,
        the metrics, ``apply_seconds``, ``error`` (a message when the candidate failed));
      metric: the quality metric the frontier uses (``'wql'``, ``'accuracy'``, ``'agreement'``
        or ``'rel_error'``); ``higher_is_better`` its direction.
      budget: the budget of :meth:`recommended`.
      skipped: ``{method: why it has no candidate}``.
      info: data, timing settings, family.
    """

    rows: list[dict]
    metric: str
    higher_is_better: bool
    budget: float
    skipped: dict
    info: dict = dataclasses.field(default_factory=dict)

    def _loss(self) -> np.ndarray:
        q = np.asarray([np.nan if r.get(self.metric) is None else r[self.metric]
                        for r in self.rows], np.float64)
        return -q if self.higher_is_better else q

    def _cost(self, axis: str) -> np.ndarray:
        if axis not in AXES:
            raise ConfigError(f"frontier: axis must be one of {sorted(AXES)}, got {axis!r}",
                              where="axis", expected=sorted(AXES), actual=axis)
        return np.asarray([np.nan if r.get(AXES[axis]) is None else r[AXES[axis]]
                           for r in self.rows], np.float64)

    def frontier(self, axis: str) -> list[dict]:
        """The rows on the Pareto frontier of quality against ``axis`` (``'size'`` or
        ``'time'``), by increasing cost."""
        return [self.rows[i] for i in pareto_front(self._cost(axis), self._loss())]

    def recommended(self, axis: str, budget: float | None = None) -> dict | None:
        """The best row whose ``axis`` ratio is at most ``budget`` (default :attr:`budget`),
        or ``None``."""
        i = recommend(self._cost(axis), self._loss(), self.budget if budget is None else budget)
        return None if i is None else self.rows[i]

    def to_dict(self) -> dict:
        """JSON-able: rows (with ``on_size_frontier`` / ``on_time_frontier``), frontiers and
        recommendations by name."""
        front = {a: {r["name"] for r in self.frontier(a)} for a in AXES}
        rows = [{**r, **{f"on_{a}_frontier": r["name"] in front[a] for a in AXES}}
                for r in self.rows]
        rec = {a: (None if (r := self.recommended(a)) is None else r["name"]) for a in AXES}
        return {"metric": self.metric, "higher_is_better": self.higher_is_better,
                "budget": self.budget, "zero_shot": True, "rows": rows,
                "frontier": {a: [r["name"] for r in self.frontier(a)] for a in AXES},
                "recommended": rec, "skipped": dict(self.skipped), **self.info}

    def format_table(self) -> str:
        """A markdown table: one line per candidate; ``S`` / ``T`` mark the size and time
        frontiers, ``best`` the recommendation at the budget."""
        metrics = [m for m in ("wql", "mase", "accuracy", "agreement", "rel_error")
                   if any(r.get(m) is not None for r in self.rows)]
        rec = {a: (r["name"] if (r := self.recommended(a)) else None) for a in AXES}
        front = {a: {r["name"] for r in self.frontier(a)} for a in AXES}
        head = ["candidate", "size", "params", "FLOPs", "XLA FLOPs", "time"] + [
            m.upper() if m in ("wql", "mase") else m for m in metrics] + ["frontier"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

        def f(v, fmt=".3f"):
            return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else \
                format(v, fmt)

        for r in self.rows:
            marks = [a[0].upper() for a in AXES if r["name"] in front[a]]
            marks += [f"**best {a} <= {self.budget:g}**" for a in AXES if rec[a] == r["name"]]
            if r.get("error"):
                marks = [f"failed: {r['error'][:80]}"]
            cells = [r["name"], f(r.get("size_ratio")), f(r.get("param_ratio")),
                     f(r.get("flop_ratio")), f(r.get("xla_flop_ratio")), f(r.get("time_ratio"))]
            cells += [f(r.get(m), ".4f") for m in metrics] + [" ".join(marks)]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def frontier(config: Any, params: Any, data: Any, *, candidates: Sequence[Candidate] | None = None,
             budget: float = 0.5, quick: bool = False, time_runs: int | None = None, key=None,
             progress: bool = False, methods: Sequence[str] | None = None,
             prune_data: str = "builtin", on_row: Callable[[dict], None] | None = None,
             blas_threads: int | None = 1) -> FrontierResult:
    """Compress one model every applicable way and measure size, FLOPs, time and quality
    (module docstring). Zero-shot: nothing is fine-tuned.

    Args:
      config: the model config (a registered family).
      params: the dense (uncompressed) parameters.
      data: held-out data: :class:`ForecastData`, :class:`ClassificationData` or
        :class:`OutputData`.
      candidates: the candidates (default :func:`default_candidates`).
      budget: ratio in ``(0, 1]`` for the recommendations.
      quick: default candidates at one strength; 3 timing rounds.
      time_runs: interleaved timing rounds per candidate (default 9; quick 3).
      key: PRNG key of the plans (candidate ``i`` gets ``fold_in(key, i)``; default key 0).
      progress: a bar over the candidates (on a terminal; plain lines elsewhere:
        :func:`lowrank_jax._progress.progress_bar`).
      methods: only these registered methods (default candidates only).
      prune_data: the batch source of ``prune`` candidates (default candidates only).
      on_row: called with every finished row (for logging).
      blas_threads: the most threads of the host BLAS / LAPACK during the run (the candidates'
        decompositions; :func:`lowrank_jax.runtime.blas_threads`, ``None``: leave them as they
        are). One by default, as in :func:`~lowrank_jax.compress.apply_plan`.

    Returns:
      A :class:`FrontierResult`; a candidate that failed to apply or to run has a row with
      ``error`` and no measurements.

    Raises:
      ConfigError: ``budget`` outside ``(0, 1]``, ``time_runs < 1``, ``blas_threads`` not an
        int >= 1 or None.
    """
    budget = check_budget(budget)
    runs = time_runs if time_runs is not None else (3 if quick else 9)
    if isinstance(runs, bool) or not isinstance(runs, numbers.Integral) or runs < 1:
        raise ConfigError(f"frontier: time_runs must be an int >= 1, got {runs!r}",
                          where="time_runs", expected=">= 1", actual=runs)
    runtime.check_blas_threads(blas_threads)
    with runtime.blas_threads(blas_threads):
        return _frontier(config, params, data, candidates, budget, quick, runs, key, progress,
                         methods, prune_data, on_row)


def _frontier(config, params, data, candidates, budget, quick, runs, key, progress, methods,
              prune_data, on_row) -> FrontierResult:
    """:func:`frontier` after its checks, under its BLAS thread limit."""
    skipped: dict = {}
    if candidates is None:
        candidates, skipped = default_candidates(params, config, quick=quick, methods=methods,
                                                 prune_data=prune_data)
    names = [c.name for c in candidates]
    if len(set(names)) != len(names) or "dense" in names:
        raise ConfigError("frontier: candidate names must be unique and not 'dense'",
                          where="candidates", expected="unique names", actual=names)
    key = jax.random.PRNGKey(0) if key is None else key
    fwd = data.forward(config, params)
    x = data.timing_input()
    sample = None if isinstance(data, ForecastData) else data.timing_input()
    t0 = time.perf_counter()
    dense_fn = fwd.lower(params, x).compile()
    dense_pred = data.predict(dense_fn, params)
    dense_scores = data.scores(dense_pred, config)
    rows_dense = leaf_rows(config, params, sample)
    base = {"params": param_count(params), "storage_bits": storage_bits(params),
            "flops": model_flops(config, params, rows=rows_dense),
            "xla_flops": _xla_flops(dense_fn)}
    dense_row = {"name": "dense", "group": "dense", "keep": 1.0, "plan": None, **base,
                 "size_ratio": 1.0, "param_ratio": 1.0, "flop_ratio": 1.0,
                 "xla_flop_ratio": 1.0 if base["xla_flops"] else None, "time_ratio": 1.0,
                 **data.score(dense_pred, dense_scores, config), "apply_seconds": 0.0,
                 "seconds": time.perf_counter() - t0, "error": None}
    dense_ms = 1e3 * time_interleaved([lambda: dense_fn(params, x)], runs)[0]
    dense_row["time_ms"] = dense_ms
    rows = [dense_row]
    if on_row is not None:
        on_row(dense_row)
    bar = progress_bar(list(enumerate(candidates)), desc="frontier", unit="candidate",
                       enabled=progress)
    for i, cand in bar:
        bar.set_postfix_str(cand.name, refresh=True)
        t0 = time.perf_counter()
        row = {"name": cand.name, "group": cand.group, "keep": cand.keep,
               "plan": cand.plan.to_dict(), "error": None}
        try:
            new, _ = apply_plan(params, cand.plan, key=jax.random.fold_in(key, i), config=config,
                                blas_threads=None)  # frontier's own setting holds
            row["apply_seconds"] = time.perf_counter() - t0
            fn = fwd.lower(new, x).compile()
            pred = data.predict(fn, new)
            counts = {"params": param_count(new), "storage_bits": storage_bits(new),
                      "flops": model_flops(config, new, sample, rows=rows_dense),
                      "xla_flops": _xla_flops(fn)}
            t_dense, t_new = time_interleaved([lambda: dense_fn(params, x),
                                               lambda fn=fn, new=new: fn(new, x)], runs)
            row.update(counts)
            row.update({
                "size_ratio": counts["storage_bits"] / base["storage_bits"],
                "param_ratio": counts["params"] / base["params"],
                "flop_ratio": counts["flops"] / max(base["flops"], 1),
                "xla_flop_ratio": (counts["xla_flops"] / base["xla_flops"]
                                   if counts["xla_flops"] and base["xla_flops"] else None),
                "time_ratio": t_new / t_dense, "time_ms": 1e3 * t_new,
                "dense_time_ms": 1e3 * t_dense,
                **data.score(pred, dense_scores, config)})
        except CANDIDATE_ERRORS as e:
            row["error"] = f"{type(e).__name__}: {e}"
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if on_row is not None:
            on_row(row)
    bar.close()
    info = {"family": family_of(config).name, "data": getattr(data, "description", ""),
            "timing": {"runs": runs, "interleaved_with_dense": True, "statistic": "median"},
            "n_candidates": len(candidates)}
    return FrontierResult(rows, data.metric, data.higher_is_better, budget, skipped, info)


# ---------------------------------------------------------------------------------------------
# Plots.

_METRIC_LABELS = {"wql": "WQL relative to dense (lower is better)",
                  "accuracy": "accuracy (higher is better)",
                  "agreement": "top-1 agreement with dense (higher is better)",
                  "rel_error": "relative output error (lower is better)"}
_AXIS_LABELS = {"size": "size (storage bits) relative to dense",
                "time": "measured forward time relative to dense (median, interleaved)"}


def plot_frontier(result: FrontierResult, path: str, *, axes: Sequence[str] = ("size", "time"),
                  title: str | None = None) -> str:
    """Quality against the size and/or time ratio: every candidate (color by method), the
    Pareto frontier as a step line, the budget as a dashed line and the recommended candidate
    as a star; frontier points are labelled.

    Args:
      result: a :class:`FrontierResult`.
      path: the PNG file to write.
      axes: ``'size'``, ``'time'`` or both (one panel each).
      title: figure title.

    Returns:
      ``path``.
    """
    from lowrank_jax.analysis.plots import pyplot

    plt = pyplot()
    rows = [r for r in result.rows if not r.get("error") and r.get(result.metric) is not None]
    groups = [g for g in dict.fromkeys(r["group"] for r in rows) if g != "dense"]
    cmap = plt.get_cmap("tab20" if len(groups) > 10 else "tab10")
    style = {g: (cmap(i % cmap.N), "os^vD<>phXPd8H"[i % 14]) for i, g in enumerate(groups)}
    style["dense"] = ("black", "*")
    fig, panels = plt.subplots(1, len(axes), figsize=(6.2 * len(axes), 5.2), squeeze=False)
    handles: dict = {}
    for ax, axis in zip(panels[0], axes, strict=True):
        key = AXES[axis]
        for g in ["dense", *groups]:
            pts = [r for r in rows if r["group"] == g and r.get(key) is not None]
            if pts:
                handles[g] = ax.scatter([r[key] for r in pts], [r[result.metric] for r in pts],
                                        s=70 if g == "dense" else 34, color=style[g][0],
                                        marker=style[g][1], alpha=0.85, zorder=3)
        front = [r for r in result.frontier(axis) if r.get(key) is not None]
        if front:
            (handles["Pareto frontier"],) = ax.step(
                [r[key] for r in front], [r[result.metric] for r in front], where="post",
                color="black", lw=1.0, alpha=0.6, zorder=2)
            for r in front:
                ax.annotate(r["name"], (r[key], r[result.metric]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points", alpha=0.85)
        handles[f"budget {result.budget:g}"] = ax.axvline(result.budget, color="gray", ls="--",
                                                          lw=1.0)
        best = result.recommended(axis)
        if best is not None:
            handles[f"best with ratio <= {result.budget:g}"] = ax.scatter(
                [best[key]], [best[result.metric]], s=300, marker="o", facecolor="none",
                edgecolor="red", linewidths=1.6, zorder=4)
            ax.annotate(f"best <= {result.budget:g}: {best['name']}", (best[key],
                        best[result.metric]), fontsize=7, color="red", xytext=(8, -12),
                        textcoords="offset points")
        else:
            ax.annotate(f"no candidate <= {result.budget:g}", (result.budget, 0.98),
                        xycoords=("data", "axes fraction"), fontsize=7, color="gray",
                        ha="left", va="top", xytext=(3, 0), textcoords="offset points")
        ax.set_xlabel(_AXIS_LABELS[axis])
        ax.set_ylabel(_METRIC_LABELS.get(result.metric, result.metric))
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=7,
               ncol=min(6, len(handles)), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    rows_legend = -(-len(handles) // min(6, len(handles)))
    fig.tight_layout(rect=(0, 0.035 * rows_legend + 0.01, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = [
    "AXES", "ATTENTION", "Candidate", "CandidateSetting", "ClassificationData", "ForecastData",
    "FrontierResult", "MLP", "NOT_CANDIDATES", "NotApplicable", "OutputData", "STRENGTHS",
    "check_budget", "default_candidates", "frontier", "is_classifier", "leaf_rows", "model_flops",
    "pareto_front", "plot_frontier", "recommend", "register_candidates", "time_interleaved",
]
