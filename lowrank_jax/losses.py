"""Training losses and evaluation metrics, with the conventions of Chronos / Chronos-Bolt.

Losses (differentiable, ``jnp``):

* :func:`quantile_loss` -- the Chronos-Bolt training loss: twice the pinball loss, mean over
  quantile levels, sum over the horizon, mean over the batch (``chronos_bolt.py``,
  ``ChronosBoltModelForForecasting.forward``).
* :func:`token_cross_entropy` -- Chronos' token loss (T5 cross-entropy, labels ``-100``
  ignored).
* :func:`mse` -- mean squared error.

Metrics (Chronos paper sec. 5.2 / ``chronos-forecasting`` ``scripts/evaluation``, which uses
GluonTS):

* :func:`wql` -- weighted quantile loss: for each level ``q``,
  ``2 * sum |(y - y_q) * (1{y <= y_q} - q)| / sum |y|`` over all series and steps, averaged
  over the levels (GluonTS ``MeanWeightedSumQuantileLoss``).
* :func:`mase` -- mean absolute scaled error of a point forecast (the median in Chronos):
  ``mean_t |y_t - f_t|`` divided by the in-sample seasonal-naive error
  ``mean_t |c_t - c_{t-m}|`` of the context, per series, averaged over series (GluonTS
  ``MASE`` with ``calculate_seasonal_error``; ``m = 1`` when the context is not longer than
  the season).
* :func:`geometric_mean_relative` -- the paper's aggregate: scores divided by a baseline's
  scores per dataset, then the geometric mean over datasets ("Understanding Transformers for
  Time Series", Table 2, reports these).

Missing values (NaN) in targets are masked out everywhere, as the references do.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, DataError, LeafTypeError, ShapeError

Array = jax.Array

#: Label value ignored by :func:`token_cross_entropy` (PyTorch's ``ignore_index`` default).
IGNORE_INDEX = -100


def _check_rank(name: str, x: Array, ndim: int, what: str) -> None:
    if x.ndim != ndim:
        raise ShapeError(f"{name}: expected {what}, got shape {tuple(x.shape)}")


def _levels(name: str, quantiles: Any, n: int) -> Array:
    q = jnp.asarray(quantiles, jnp.float32).reshape(-1)
    if q.shape[0] != n:
        raise ShapeError(f"{name}: {q.shape[0]} quantile levels for {n} quantile forecasts")
    return q


def quantile_loss(pred: Array, target: Array, quantiles: Sequence[float],
                  mask: Array | None = None) -> Array:
    """Chronos-Bolt's training loss (2 x pinball), in the reference's reduction order.

    ``loss[b, q, h] = 2 |(y[b, h] - pred[b, q, h]) (1{y[b, h] <= pred[b, q, h]} - tau_q)| m[b, h]``;
    returned: ``mean_b sum_h mean_q loss``. Chronos-Bolt computes it on the instance-normalized
    scale: pass ``(pred - loc) / scale`` and ``(target - loc) / scale``.

    Args:
      pred: quantile forecasts ``[batch, n_quantiles, horizon]``.
      target: ``[batch, horizon]``; NaN entries are masked.
      quantiles: the ``n_quantiles`` levels ``tau_q``.
      mask: optional ``[batch, horizon]`` weights (1 = observed); multiplied with the NaN mask.

    Returns:
      Scalar loss.
    """
    pred = jnp.asarray(pred)
    target = jnp.asarray(target)
    _check_rank("quantile_loss", pred, 3, "pred [batch, n_quantiles, horizon]")
    _check_rank("quantile_loss", target, 2, "target [batch, horizon]")
    if target.shape != (pred.shape[0], pred.shape[2]):
        raise ShapeError(f"quantile_loss: target shape {tuple(target.shape)} does not match "
                         f"pred [batch, n_quantiles, horizon] = {tuple(pred.shape)}")
    tau = _levels("quantile_loss", quantiles, pred.shape[1]).astype(pred.dtype)
    m = ~jnp.isnan(target)
    m = m.astype(pred.dtype) if mask is None else m.astype(pred.dtype) * jnp.asarray(
        mask, pred.dtype)
    y = jnp.nan_to_num(target)[:, None, :]  # [b, 1, h]
    ind = (y <= pred).astype(pred.dtype)
    loss = 2.0 * jnp.abs((y - pred) * (ind - tau[None, :, None])) * m[:, None, :]
    return loss.mean(axis=1).sum(axis=-1).mean()


def token_cross_entropy(logits: Array, labels: Array, mask: Array | None = None) -> Array:
    """Mean token cross-entropy ``-log softmax(logits)[label]`` over the counted tokens.

    Chronos trains T5 on token ids with ``CrossEntropyLoss(ignore_index=-100)``: tokens with
    label ``-100`` (padding) are not counted. ``mask`` (1 = count) narrows this further.

    Args:
      logits: ``[..., vocab]``.
      labels: int ``[...]``.
      mask: optional ``[...]`` 0/1 weights.

    Returns:
      Scalar: ``sum(nll * m) / max(sum(m), 1)``; the log-softmax is computed in float32.
    """
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    if logits.shape[:-1] != labels.shape:
        raise ShapeError(f"token_cross_entropy: logits {tuple(logits.shape)} must be labels "
                         f"{tuple(labels.shape)} + (vocab,)")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise LeafTypeError(f"token_cross_entropy: labels must be integer ids, got {labels.dtype}",
                            where="labels", expected="an integer dtype", actual=str(labels.dtype))
    m = (labels != IGNORE_INDEX).astype(jnp.float32)
    if mask is not None:
        m = m * jnp.asarray(mask, jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    safe = jnp.where(labels == IGNORE_INDEX, 0, labels)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def mse(pred: Array, target: Array, mask: Array | None = None) -> Array:
    """Mean of ``(pred - target)^2`` over the counted entries (NaN targets and ``mask == 0``
    are not counted); 0 if nothing is counted."""
    pred = jnp.asarray(pred)
    target = jnp.asarray(target)
    if pred.shape != target.shape:
        raise ShapeError(f"mse: pred shape {tuple(pred.shape)} != target shape "
                         f"{tuple(target.shape)}")
    m = (~jnp.isnan(target)).astype(pred.dtype)
    if mask is not None:
        m = m * jnp.asarray(mask, pred.dtype)
    err = jnp.square(pred - jnp.nan_to_num(target)) * m
    return jnp.sum(err) / jnp.maximum(jnp.sum(m), 1.0)


def wql(quantile_preds: Array, target: Array, quantiles: Sequence[float]) -> Array:
    """Weighted quantile loss over a set of series (Chronos' probabilistic metric).

    ``WQL = mean_q [ 2 sum_{b,h} |(y - y_q) (1{y <= y_q} - q)| / sum_{b,h} |y| ]``, sums over
    every series and step of the set (GluonTS ``MeanWeightedSumQuantileLoss``). NaN targets
    are left out of both sums.

    Args:
      quantile_preds: ``[batch, n_quantiles, horizon]``.
      target: ``[batch, horizon]``.
      quantiles: the ``n_quantiles`` levels.

    Returns:
      Scalar WQL.
    """
    pred = jnp.asarray(quantile_preds, jnp.float32)
    target = jnp.asarray(target, jnp.float32)
    _check_rank("wql", pred, 3, "quantile_preds [batch, n_quantiles, horizon]")
    if target.shape != (pred.shape[0], pred.shape[2]):
        raise ShapeError(f"wql: target shape {tuple(target.shape)} does not match "
                         f"quantile_preds [batch, n_quantiles, horizon] = {tuple(pred.shape)}")
    tau = _levels("wql", quantiles, pred.shape[1])
    m = (~jnp.isnan(target)).astype(jnp.float32)
    y = jnp.nan_to_num(target)
    ind = (y[:, None, :] <= pred).astype(jnp.float32)
    ql = 2.0 * jnp.sum(jnp.abs((y[:, None, :] - pred) * (ind - tau[None, :, None]))
                       * m[:, None, :], axis=(0, 2))  # [n_quantiles]
    return jnp.mean(ql / jnp.sum(jnp.abs(y) * m))


def mase(point_forecast: Array, target: Array, context: Array, season: int = 1) -> Array:
    """Mean absolute scaled error (Chronos' point metric, on the median forecast).

    Per series ``b``: ``mean_h |y - f|`` over the seasonal-naive in-sample error
    ``mean_t |c_t - c_{t-m}|`` of its context (``m = season``, or 1 when the context has at
    most ``season`` values, as GluonTS ``calculate_seasonal_error``); the mean over series.
    NaNs in the context or the target are skipped. A constant context gives ``inf`` (as the
    reference).

    Args:
      point_forecast: ``[batch, horizon]`` (e.g. the 0.5 quantile).
      target: ``[batch, horizon]``.
      context: ``[batch, length]`` past values.
      season: seasonal period ``m`` (>= 1), e.g. 12 for monthly data.

    Returns:
      Scalar MASE.
    """
    f = jnp.asarray(point_forecast, jnp.float32)
    y = jnp.asarray(target, jnp.float32)
    c = jnp.asarray(context, jnp.float32)
    if f.ndim == 1:
        f, y, c = f[None], y[None], c[None]
    _check_rank("mase", f, 2, "point_forecast [batch, horizon]")
    _check_rank("mase", c, 2, "context [batch, length]")
    if f.shape != y.shape or c.shape[0] != f.shape[0]:
        raise ShapeError(f"mase: point_forecast {tuple(f.shape)}, target {tuple(y.shape)} and "
                         f"context {tuple(c.shape)} must share the batch (and horizon)")
    if not (isinstance(season, (int, np.integer)) and season >= 1):
        raise ConfigError(f"mase: season must be a positive int, got {season!r}", where="season",
                          expected="int >= 1", actual=season)
    m = int(season) if int(season) < c.shape[1] else 1
    if c.shape[1] < 2:
        raise DataError(f"mase: the context needs at least 2 values, got {c.shape[1]}")
    seasonal_error = jnp.nanmean(jnp.abs(c[:, m:] - c[:, :-m]), axis=1)  # [batch]
    abs_err = jnp.nanmean(jnp.abs(y - f), axis=1)  # [batch]
    return jnp.mean(abs_err / seasonal_error)


def geometric_mean_relative(scores: Sequence[float] | Mapping[str, float] | Array,
                            baseline_scores: Sequence[float] | Mapping[str, float] | Array
                            ) -> float:
    """Geometric mean over datasets of ``score / baseline_score`` (Chronos' aggregate).

    ``exp(mean_d log(s_d / b_d))``. Dicts are matched by dataset name (both must name the same
    datasets); sequences by position.

    Returns:
      The aggregate relative score (a Python float; < 1 is better than the baseline).
    """
    if isinstance(scores, Mapping) or isinstance(baseline_scores, Mapping):
        if not (isinstance(scores, Mapping) and isinstance(baseline_scores, Mapping)):
            raise LeafTypeError("geometric_mean_relative: pass two dicts or two sequences",
                                where="scores", expected="two dicts or two sequences")
        if set(scores) != set(baseline_scores):
            raise DataError(
                "geometric_mean_relative: datasets differ: only in scores "
                f"{sorted(set(scores) - set(baseline_scores))}, only in baseline "
                f"{sorted(set(baseline_scores) - set(scores))}")
        names = sorted(scores)
        s = np.asarray([float(scores[k]) for k in names], np.float64)
        b = np.asarray([float(baseline_scores[k]) for k in names], np.float64)
    else:
        s = np.asarray(scores, np.float64).reshape(-1)
        b = np.asarray(baseline_scores, np.float64).reshape(-1)
        if s.shape != b.shape:
            raise ShapeError(f"geometric_mean_relative: {s.size} scores for {b.size} baseline "
                             "scores")
    if s.size == 0:
        raise DataError("geometric_mean_relative: no scores")
    if not (np.all(s > 0) and np.all(b > 0) and np.all(np.isfinite(s))
            and np.all(np.isfinite(b))):
        raise DataError("geometric_mean_relative: scores and baseline scores must be finite "
                         "and > 0")
    return float(np.exp(np.mean(np.log(s / b))))


__all__ = [
    "IGNORE_INDEX", "geometric_mean_relative", "mase", "mse", "quantile_loss",
    "token_cross_entropy", "wql",
]
