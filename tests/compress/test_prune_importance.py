"""Importance scores of "Less is More" (eqs. 5-6) against a hand-derived NumPy reference of the
per-sample mask gradients; invariance to repeating the batch; tied units; EMA; the schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.compress.prune import (
    batch_importance,
    ema,
    importance,
    make_scorer,
    scheduled_fraction,
    unit_gradients,
)
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import Dense, linear, mask_leaf

jax.config.update("jax_default_matmul_precision", "highest")

N, T, D, H, DO = 5, 3, 4, 6, 2


def model():
    g = np.random.default_rng(0)
    w1, b1 = g.normal(size=(D, H)), g.normal(size=H)
    w2, b2 = g.normal(size=(H, DO)), g.normal(size=DO)
    m = {"l1": (g.random(D) > 0.3) * 1.0, "l1o": (g.random(H) > 0.3) * 1.0,
         "l2": (g.random(H) > 0.3) * 1.0, "l2o": np.array([1.0, 0.0])}
    params = {
        "l1": mask_leaf(Dense(w=jnp.asarray(w1, jnp.float32), b=jnp.asarray(b1, jnp.float32)),
                        m["l1"], m["l1o"]),
        "l2": mask_leaf(Dense(w=jnp.asarray(w2, jnp.float32), b=jnp.asarray(b2, jnp.float32)),
                        m["l2"], m["l2o"]),
    }
    x = g.normal(size=(N, T, D))
    t = g.normal(size=(N, T, DO))
    return params, (w1, b1, w2, b2, m), {"x": jnp.asarray(x, jnp.float32),
                                        "t": jnp.asarray(t, jnp.float32)}, x, t


def loss_fn(params, batch, key):
    a = jax.nn.relu(linear(params["l1"], batch["x"]))
    y = linear(params["l2"], a)
    return jnp.mean((y - batch["t"]) ** 2), {}


def numpy_per_sample_grads(w1, b1, w2, b2, m, x, t):
    """dL_n/dm for every sample, L_n = mean over tokens and outputs of (y - t)^2, by hand."""
    out = {k: [] for k in ("l1/m_in", "l1/m_out", "l2/m_in", "l2/m_out")}
    for n in range(x.shape[0]):
        xn, tn = x[n], t[n]
        pre1 = (xn * m["l1"]) @ w1 + b1
        h1 = pre1 * m["l1o"]
        a = np.maximum(h1, 0)
        pre2 = (a * m["l2"]) @ w2 + b2
        h2 = pre2 * m["l2o"]
        dh2 = 2.0 * (h2 - tn) / (T * DO)
        out["l2/m_out"].append((dh2 * pre2).sum(0))
        d_in2 = (dh2 * m["l2o"]) @ w2.T  # dL/d(a * m2_in)
        out["l2/m_in"].append((a * d_in2).sum(0))
        dh1 = d_in2 * m["l2"] * (h1 > 0)
        out["l1/m_out"].append((dh1 * pre1).sum(0))
        out["l1/m_in"].append((xn * ((dh1 * m["l1o"]) @ w1.T)).sum(0))
    return {k: np.stack(v) for k, v in out.items()}


def test_scores_match_hand_derived_per_sample_gradients():
    params, (w1, b1, w2, b2, m), batch, x, t = model()
    g = numpy_per_sample_grads(w1, b1, w2, b2, m, x, t)
    got = batch_importance(loss_fn, params, batch)
    for k, gn in g.items():
        want = np.abs(-gn.mean(0) + 0.5 * (gn ** 2).mean(0))  # eq. 6, averages over N
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-6, err_msg=k)
    # the batch repeated twice has the same scores (the authors' code is N times off here)
    twice = {k: jnp.concatenate([v, v]) for k, v in batch.items()}
    got2 = batch_importance(loss_fn, params, twice)
    for k in got:
        np.testing.assert_allclose(got2[k], got[k], rtol=1e-5, atol=1e-8, err_msg=k)
    # a unit of two channels shares one mask: its per-sample gradient is the sum, then eq. 6
    tied = batch_importance(loss_fn, params, batch, units={"l1/m_out": 2})
    gsum = g["l1/m_out"].reshape(N, H // 2, 2).sum(-1)
    np.testing.assert_allclose(tied["l1/m_out"], np.abs(-gsum.mean(0) + 0.5 * (gsum ** 2).mean(0)),
                               rtol=1e-4, atol=1e-6)


def test_importance_ema_and_schedule_formulas():
    g = np.random.default_rng(1).normal(size=(7, 3))
    np.testing.assert_allclose(np.asarray(importance(g)),
                               np.abs(-g.mean(0) + 0.5 * (g ** 2).mean(0)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(unit_gradients(jnp.asarray(g[:, :2]), 2)),
                               g[:, :2].sum(1, keepdims=True), rtol=1e-6)
    prev, s = np.zeros(3), [np.array([1.0, 2, 3]), np.array([3.0, 0, 1])]
    for sj in s:
        prev = ema(prev, sj, 0.25)
    np.testing.assert_allclose(prev, 0.25 * s[1] + 0.75 * 0.25 * s[0])
    with pytest.raises(ConfigError, match="alpha"):
        ema(prev, prev, 0.0)
    fr = [scheduled_fraction(j, 4, 0.6) for j in range(1, 5)]
    np.testing.assert_allclose(fr, [0.6 * (1 - (1 - j / 4) ** 3) for j in range(1, 5)])
    assert fr[-1] == pytest.approx(0.6)
    steps = np.diff([0.0, *fr])
    assert np.all(np.diff(steps) < 0)  # cubic: fewer channels per batch as pruning proceeds
    np.testing.assert_allclose([scheduled_fraction(j, 4, 0.6, "linear") for j in (1, 4)],
                               [0.15, 0.6])
    with pytest.raises(ConfigError, match="schedule"):
        scheduled_fraction(1, 4, 0.5, "exp")


def test_the_scorer_is_built_and_traced_once_per_loss_and_units():
    traces = [0]

    def counting_loss(params, batch, key):
        traces[0] += 1  # runs at trace time only
        return loss_fn(params, batch, key)

    params, (w1, b1, w2, b2, m), batch, x, t = model()
    first = batch_importance(counting_loss, params, batch)
    n_first = traces[0]
    assert n_first >= 1
    again = batch_importance(counting_loss, params, batch)  # the scorer of the first call
    assert traces[0] == n_first
    for k in first:
        np.testing.assert_array_equal(again[k], first[k])
    assert make_scorer(counting_loss, (1, 1, 1, 1)) is make_scorer(counting_loss, [1, 1, 1, 1])
    assert make_scorer(counting_loss, (1, 1, 1, 1)) is not make_scorer(counting_loss, (1, 2, 1, 1))
    # other units: another scorer, traced anew, with the tied unit's scores
    batch_importance(counting_loss, params, batch, units={"l1/m_out": 2})
    assert traces[0] > n_first
