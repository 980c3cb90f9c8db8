"""Losses and metrics against plain NumPy references written out here (loops and hand
formulas), never against themselves."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowrank_jax.train import (
    geometric_mean_relative,
    mase,
    mse,
    quantile_loss,
    token_cross_entropy,
    wql,
)

QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _pinball(y, p, tau):
    """Koenker's check function rho_tau(y - p) = max(tau (y - p), (tau - 1)(y - p))."""
    d = y - p
    return max(tau * d, (tau - 1.0) * d)


def _ref_quantile_loss(pred, target, quantiles, mask=None):
    """Chronos-Bolt: 2 x pinball, mean over quantiles, sum over horizon, mean over batch."""
    b, q, h = pred.shape
    total = 0.0
    for i in range(b):
        row = 0.0
        for t in range(h):
            y = target[i, t]
            w = 0.0 if np.isnan(y) else 1.0
            if mask is not None:
                w *= mask[i, t]
            if w == 0.0:
                continue
            row += w * sum(2.0 * _pinball(y, pred[i, k, t], quantiles[k]) for k in range(q)) / q
        total += row
    return total / b


def _rand(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(3, 9, 5), (1, 3, 7)])
def test_quantile_loss_matches_loops(shape):
    b, q, h = shape
    pred, target = _rand(shape, 0), _rand((b, h), 1)
    levels = QUANTILES if q == 9 else (0.1, 0.5, 0.9)
    got = float(quantile_loss(pred, target, levels))
    assert got == pytest.approx(_ref_quantile_loss(pred, target, levels), rel=1e-5)


def test_quantile_loss_masks_nan_and_weights():
    pred, target = _rand((2, 3, 4), 2), _rand((2, 4), 3)
    target[0, 1] = np.nan
    mask = np.array([[1, 1, 0, 1], [1, 0, 1, 1]], np.float32)
    levels = (0.1, 0.5, 0.9)
    got = float(quantile_loss(pred, target, levels, mask=mask))
    assert np.isfinite(got)
    assert got == pytest.approx(_ref_quantile_loss(pred, target, levels, mask), rel=1e-5)


def test_quantile_loss_hand_value():
    # one series, one step, y = 1: the 0.5 quantile at 0 costs 2 * 0.5 * 1 = 1, the 0.9
    # quantile at 3 costs 2 * 0.1 * 2 = 0.4; mean over the two levels = 0.7
    pred = np.array([[[0.0], [3.0]]], np.float32)
    target = np.array([[1.0]], np.float32)
    assert float(quantile_loss(pred, target, (0.5, 0.9))) == pytest.approx(0.7, rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(pred=hnp.arrays(np.float32, (2, 3, 4), elements=st.floats(-10, 10, width=32)),
       target=hnp.arrays(np.float32, (2, 4), elements=st.floats(-10, 10, width=32)))
def test_quantile_loss_property(pred, target):
    levels = (0.2, 0.5, 0.8)
    got = float(quantile_loss(pred, target, levels))
    assert got >= 0.0
    assert got == pytest.approx(_ref_quantile_loss(pred, target, levels), rel=1e-5, abs=1e-5)


def test_quantile_loss_shape_errors():
    with pytest.raises(ValueError, match="quantile levels"):
        quantile_loss(np.zeros((2, 3, 4)), np.zeros((2, 4)), (0.5,))
    with pytest.raises(ValueError, match="does not match"):
        quantile_loss(np.zeros((2, 3, 4)), np.zeros((2, 5)), (0.1, 0.5, 0.9))


def test_token_cross_entropy_matches_log_softmax_by_hand():
    logits = _rand((2, 5, 7), 4) * 3
    labels = np.random.default_rng(5).integers(0, 7, size=(2, 5))
    labels[1, 3] = -100  # padding: not counted
    mask = np.ones((2, 5), np.float32)
    mask[0, 0] = 0
    total, count = 0.0, 0
    for i in range(2):
        for t in range(5):
            if labels[i, t] == -100 or mask[i, t] == 0:
                continue
            z = logits[i, t].astype(np.float64)
            logsumexp = z.max() + math.log(np.exp(z - z.max()).sum())
            total += logsumexp - z[labels[i, t]]
            count += 1
    got = float(token_cross_entropy(logits, labels, mask=mask))
    assert got == pytest.approx(total / count, rel=1e-5)
    # without the mask only the -100 label is skipped
    ref_all = np.mean([
        np.log(np.exp(logits[i, t].astype(np.float64)).sum()) - logits[i, t, labels[i, t]]
        for i in range(2) for t in range(5) if labels[i, t] != -100])
    assert float(token_cross_entropy(logits, labels)) == pytest.approx(ref_all, rel=1e-5)


def test_token_cross_entropy_errors():
    with pytest.raises(ValueError, match="labels"):
        token_cross_entropy(np.zeros((2, 3, 4)), np.zeros((2, 4), np.int32))
    with pytest.raises(TypeError, match="integer"):
        token_cross_entropy(np.zeros((2, 4)), np.zeros((2,), np.float32))


def test_mse_masked_mean():
    pred, target = _rand((3, 4), 6), _rand((3, 4), 7)
    target[2, 2] = np.nan
    mask = np.ones((3, 4), np.float32)
    mask[0] = 0
    keep = (mask > 0) & ~np.isnan(target)
    ref = np.mean((pred[keep] - target[keep]) ** 2)
    assert float(mse(pred, target, mask=mask)) == pytest.approx(ref, rel=1e-6)
    assert float(mse(pred, np.where(np.isnan(target), 0, target))) == pytest.approx(
        np.mean((pred - np.where(np.isnan(target), 0, target)) ** 2), rel=1e-6)


def test_wql_hand_value():
    # y = [1, 2]; the 0.5 quantile predicts 1 at both steps: pinball = 0 + 0.5 * 1;
    # WQL = 2 * 0.5 / (1 + 2) = 1/3
    pred = np.array([[[1.0, 1.0]]], np.float32)
    target = np.array([[1.0, 2.0]], np.float32)
    assert float(wql(pred, target, (0.5,))) == pytest.approx(1.0 / 3.0, rel=1e-6)


def test_wql_matches_reference_formula():
    rng = np.random.default_rng(8)
    target = rng.gamma(2.0, 2.0, size=(4, 6)).astype(np.float32)
    pred = (target[:, None, :] + rng.normal(size=(4, 9, 6))).astype(np.float32)
    target[3, 5] = np.nan  # missing: out of both sums
    per_level = []
    for k, tau in enumerate(QUANTILES):
        num, den = 0.0, 0.0
        for i in range(4):
            for t in range(6):
                y = target[i, t]
                if np.isnan(y):
                    continue
                num += 2.0 * _pinball(y, pred[i, k, t], tau)
                den += abs(y)
        per_level.append(num / den)
    assert float(wql(pred, target, QUANTILES)) == pytest.approx(np.mean(per_level), rel=1e-5)


def test_mase_hand_values():
    context = np.array([[1.0, 2.0, 4.0, 7.0]], np.float32)
    forecast = np.array([[8.0, 8.0]], np.float32)
    target = np.array([[9.0, 11.0]], np.float32)
    # season 1: naive errors 1, 2, 3 -> 2; MAE (1 + 3) / 2 = 2 -> MASE 1
    assert float(mase(forecast, target, context, season=1)) == pytest.approx(1.0)
    # season 2: |4 - 1|, |7 - 2| -> 4; MASE 0.5
    assert float(mase(forecast, target, context, season=2)) == pytest.approx(0.5)
    # season >= context length falls back to 1 (GluonTS calculate_seasonal_error)
    assert float(mase(forecast, target, context, season=12)) == pytest.approx(1.0)


def test_mase_mean_over_series_matches_loops():
    rng = np.random.default_rng(9)
    context = rng.normal(size=(3, 30)).cumsum(axis=1).astype(np.float32)
    target = rng.normal(size=(3, 6)).astype(np.float32)
    forecast = rng.normal(size=(3, 6)).astype(np.float32)
    m = 12
    ref = []
    for i in range(3):
        naive = np.mean([abs(context[i, t] - context[i, t - m]) for t in range(m, 30)])
        ref.append(np.mean(np.abs(target[i] - forecast[i])) / naive)
    assert float(mase(forecast, target, context, season=m)) == pytest.approx(np.mean(ref),
                                                                            rel=1e-5)
    with pytest.raises(ValueError, match="season"):
        mase(forecast, target, context, season=0)


def test_geometric_mean_relative():
    assert geometric_mean_relative([2.0, 0.5], [1.0, 1.0]) == pytest.approx(1.0)
    assert geometric_mean_relative([0.3, 0.8, 0.5], [0.6, 0.4, 1.0]) == pytest.approx(
        (0.5 * 2.0 * 0.5) ** (1 / 3))
    assert geometric_mean_relative({"a": 1.0, "b": 4.0}, {"b": 1.0, "a": 4.0}) == pytest.approx(
        1.0)
    with pytest.raises(ValueError, match="only in scores"):
        geometric_mean_relative({"a": 1.0, "c": 1.0}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        geometric_mean_relative([0.0], [1.0])
    with pytest.raises(ValueError, match="baseline"):
        geometric_mean_relative([1.0, 2.0], [1.0])


def test_losses_jit_equals_eager():
    pred, target = _rand((2, 9, 4), 10), _rand((2, 4), 11)
    f = jax.jit(lambda p, t: quantile_loss(p, t, QUANTILES))
    assert float(f(pred, target)) == pytest.approx(float(quantile_loss(pred, target, QUANTILES)),
                                                   rel=1e-6)
    # the loss is differentiable in the predictions (what training needs)
    g = jax.grad(lambda p: quantile_loss(p, target, QUANTILES))(jnp.asarray(pred))
    assert g.shape == pred.shape and bool(jnp.all(jnp.isfinite(g)))
