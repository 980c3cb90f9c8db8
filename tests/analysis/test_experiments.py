"""App. J experiments of "Understanding Transformers for Time Series": the properties the paper
reports, checked numerically."""

import numpy as np

from lowrank_jax.analysis import theorem3_experiment, theorem3_width_experiment, theorem4_experiment


def test_theorem3_slope_is_one():
    res = theorem3_experiment(d=128, n_tokens=1024)
    assert 0.8 <= res.slope <= 1.2, res.slope
    # Error decreases as the truncation rank grows (sigma_{d+1} shrinks).
    assert res.error[-1] < res.error[0] * 1e-1


def test_theorem3_width_error_grows_with_d():
    res = theorem3_width_experiment(widths=(32, 64, 128), n_tokens=256, seeds=2)
    assert res.slope > 0.3 and np.all(np.diff(res.error) > 0)


def test_theorem4_rank_grows_with_heads():
    res = theorem4_experiment(d=64, n_tokens=256, heads=(1, 4, 32))
    r = res.output_eps_rank[1e-4]
    assert r[-1] > r[0], r
    assert min(r) >= res.input_eps_rank[1e-4] - 1
