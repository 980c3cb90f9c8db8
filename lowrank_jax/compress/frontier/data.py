"""Held-out data of a frontier run and the quality of a candidate on it: forecasts (WQL and
MASE relative to the dense model), classifiers (top-1 accuracy or agreement) and any other model
(relative error of its primary output)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import DataError
from lowrank_jax.losses import geometric_mean_relative, mase, wql
from lowrank_jax.models import apply as model_apply
from lowrank_jax.models import family_of, primary_output


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


__all__ = ["ClassificationData", "ForecastData", "OutputData", "is_classifier"]
