"""Anomaly thresholds and scores: a fixed quantile, peaks over threshold (POT), the
point-adjustment protocol, precision / recall / F1.

As used by "Sparse Binary Transformers for Multivariate Time Series Modeling" (arXiv:2308.04637,
sec. 4.2), following OmniAnomaly and TranAD:

* quantile threshold: the ``1 - r`` quantile of reference scores (``r = 1%``, SMD 0.5%);
* POT ("Anomaly Detection in Streams with Extreme Value Theory", Siffer et al., KDD 2017):
  take an initial threshold ``t`` at quantile ``level`` of the reference scores, fit a
  generalized Pareto distribution to the excesses ``s - t > 0`` (``scipy.stats.genpareto``,
  location fixed at 0, maximum likelihood), and return the score exceeded with probability
  ``q``: ``z_q = t + sigma/gamma ((q n / N_t)^(-gamma) - 1)`` (``t - sigma log(q n / N_t)`` for
  ``gamma = 0``). This is the SPOT initialisation; the streaming updates of SPOT (threshold
  moved while scoring the test set) are not applied, so the threshold is fixed before the test
  scores are seen;
* point adjustment: if any point of a contiguous labelled anomaly segment is flagged, the whole
  segment counts as detected.
"""

from __future__ import annotations

import numpy as np

from lowrank_jax.errors import ConfigError, DataError


def _scores(name: str, s) -> np.ndarray:
    a = np.asarray(s, np.float64).reshape(-1)
    if a.size == 0 or not np.all(np.isfinite(a)):
        raise DataError(f"{name}: scores must be a non-empty array of finite values "
                        f"(got {a.size} values, {int(np.sum(~np.isfinite(a)))} non-finite)",
                        where=name)
    return a


def quantile_threshold(scores, r: float = 0.01) -> float:
    """The ``1 - r`` quantile of ``scores`` (NumPy's linear interpolation): a fraction ``r``
    of them lies above it."""
    if not 0.0 < r < 1.0:
        raise ConfigError(f"quantile_threshold: r must be in (0, 1), got {r!r}", where="r",
                          expected="(0, 1)", actual=r)
    return float(np.quantile(_scores("quantile_threshold", scores), 1.0 - r))


def pot_threshold(scores, q: float = 1e-3, level: float = 0.98) -> dict:
    """Peaks-over-threshold threshold of ``scores`` (Siffer et al. 2017, eq. 1 and sec. 3.2).

    Args:
      scores: reference scores (training / validation reconstruction errors).
      q: target exceedance probability of the returned threshold.
      level: quantile of ``scores`` used as the initial threshold ``t``.

    Returns:
      ``{'threshold', 'initial', 'gamma' (shape), 'sigma' (scale), 'n_peaks'}``. When
      ``q >= N_t / n`` the tail fit is not needed (the threshold is the empirical quantile
      ``1 - q``), and that is returned with ``gamma = sigma = None``.
    """
    from scipy.stats import genpareto

    s = _scores("pot_threshold", scores)
    if not 0.0 < q < 1.0:
        raise ConfigError(f"pot_threshold: q must be in (0, 1), got {q!r}", where="q",
                          expected="(0, 1)", actual=q)
    if not 0.0 < level < 1.0:
        raise ConfigError(f"pot_threshold: level must be in (0, 1), got {level!r}",
                          where="level", expected="(0, 1)", actual=level)
    t = float(np.quantile(s, level))
    peaks = s[s > t] - t
    n, n_t = s.size, peaks.size
    if q * n >= n_t:
        return {"threshold": float(np.quantile(s, 1.0 - q)), "initial": t, "gamma": None,
                "sigma": None, "n_peaks": int(n_t)}
    if n_t < 3:
        raise DataError(f"pot_threshold: only {n_t} scores lie above the initial threshold "
                        f"(level={level}); lower level or give more scores", where="level",
                        expected=">= 3 peaks", actual=n_t)
    gamma, _, sigma = genpareto.fit(peaks, floc=0.0)
    r = q * n / n_t
    if abs(gamma) < 1e-12:
        z = t - sigma * np.log(r)
    else:
        z = t + sigma / gamma * (r ** (-gamma) - 1.0)
    return {"threshold": float(z), "initial": t, "gamma": float(gamma), "sigma": float(sigma),
            "n_peaks": int(n_t)}


def segments(flags) -> list[tuple[int, int]]:
    """Contiguous runs of true values as ``(start, end)`` with ``end`` exclusive."""
    f = np.asarray(flags, bool).reshape(-1).astype(np.int8)
    d = np.diff(np.concatenate([[0], f, [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist(),
                    strict=True))


def point_adjust(pred, labels) -> np.ndarray:
    """Point-adjusted predictions: every labelled anomaly segment with at least one flagged
    point is flagged entirely; predictions outside labelled segments are unchanged."""
    p = np.asarray(pred, bool).reshape(-1).copy()
    y = np.asarray(labels, bool).reshape(-1)
    if p.shape != y.shape:
        raise DataError(f"point_adjust: pred and labels must have the same length, got "
                        f"{p.size} and {y.size}", where="pred", expected=y.size, actual=p.size)
    for a, b in segments(y):
        if p[a:b].any():
            p[a:b] = True
    return p


def precision_recall_f1(pred, labels) -> dict:
    """Precision, recall and F1 of boolean predictions (0 where undefined)."""
    p = np.asarray(pred, bool).reshape(-1)
    y = np.asarray(labels, bool).reshape(-1)
    if p.shape != y.shape:
        raise DataError(f"precision_recall_f1: pred and labels differ in length ({p.size} vs "
                        f"{y.size})", where="pred", expected=y.size, actual=p.size)
    tp = int(np.sum(p & y))
    fp = int(np.sum(p & ~y))
    fn = int(np.sum(~p & y))
    prec = tp / (tp + fp) if tp + fp else 0.0
    rec = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return {"precision": prec, "recall": rec, "f1": f1, "tp": tp, "fp": fp, "fn": fn}


def evaluate_threshold(scores, labels, threshold: float, *, adjust: bool = True) -> dict:
    """Flag ``scores > threshold`` and score against ``labels`` (point-adjusted by
    default)."""
    s = _scores("evaluate_threshold", scores)
    pred = s > threshold
    if adjust:
        pred = point_adjust(pred, labels)
    out = precision_recall_f1(pred, labels)
    out["threshold"] = float(threshold)
    out["n_flagged"] = int(pred.sum())
    return out


__all__ = ["evaluate_threshold", "point_adjust", "pot_threshold", "precision_recall_f1",
           "quantile_threshold", "segments"]
