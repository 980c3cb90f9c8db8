"""Quantile and POT thresholds against direct scipy / NumPy computations, point adjustment and
precision / recall / F1 on hand-made examples."""

import numpy as np
import pytest
from scipy import stats

from lowrank_jax.analysis import anomaly as ad
from lowrank_jax.errors import ConfigError, DataError


def test_pot_threshold_against_direct_scipy_fit():
    s = stats.lognorm.rvs(0.8, size=5000, random_state=np.random.default_rng(0))
    q, level = 1e-4, 0.97
    got = ad.pot_threshold(s, q=q, level=level)
    # Direct: initial threshold, excesses, scipy's GPD fit, the GPD quantile of the tail.
    t = np.quantile(s, level)
    peaks = s[s > t] - t
    c, loc, scale = stats.genpareto.fit(peaks, floc=0)
    ref = t + stats.genpareto.ppf(1 - q * len(s) / len(peaks), c, loc=0, scale=scale)
    assert got["n_peaks"] == len(peaks) and got["initial"] == pytest.approx(t)
    assert got["gamma"] == pytest.approx(c, rel=1e-6)
    assert got["threshold"] == pytest.approx(ref, rel=1e-9)
    assert got["threshold"] > s.max() * 0.5
    # an exceedance probability within the empirical range needs no tail fit
    easy = ad.pot_threshold(s, q=0.1, level=0.97)
    assert easy["gamma"] is None and easy["threshold"] == pytest.approx(np.quantile(s, 0.9))


def test_quantile_threshold_and_errors():
    s = np.arange(101.0)
    assert ad.quantile_threshold(s, 0.01) == pytest.approx(99.0)
    with pytest.raises(ConfigError):
        ad.quantile_threshold(s, 0.0)
    with pytest.raises(DataError):
        ad.quantile_threshold([1.0, np.nan])
    with pytest.raises(ConfigError):
        ad.pot_threshold(s, q=2.0)


def test_point_adjust_hand_example():
    labels = np.array([0, 1, 1, 1, 0, 0, 1, 1, 0, 1], bool)
    pred = np.array([1, 0, 1, 0, 0, 0, 0, 0, 0, 1], bool)
    adj = ad.point_adjust(pred, labels)
    np.testing.assert_array_equal(adj, [1, 1, 1, 1, 0, 0, 0, 0, 0, 1])
    m = ad.precision_recall_f1(adj, labels)
    # tp: 3 (first segment) + 1 (last) = 4; fp: 1 (index 0); fn: 2 (second segment)
    assert (m["tp"], m["fp"], m["fn"]) == (4, 1, 2)
    assert m["precision"] == pytest.approx(0.8) and m["recall"] == pytest.approx(4 / 6)
    assert m["f1"] == pytest.approx(2 * 0.8 * (4 / 6) / (0.8 + 4 / 6))
    assert ad.segments(labels) == [(1, 4), (6, 8), (9, 10)]
    e = ad.evaluate_threshold(np.where(pred, 2.0, 0.0), labels, 1.0)
    assert e["f1"] == pytest.approx(m["f1"]) and e["n_flagged"] == 5
    raw = ad.evaluate_threshold(np.where(pred, 2.0, 0.0), labels, 1.0, adjust=False)
    assert raw["tp"] == 2
    with pytest.raises(DataError):
        ad.point_adjust(pred[:3], labels)
    assert ad.precision_recall_f1(np.zeros(3, bool), np.zeros(3, bool))["f1"] == 0.0
