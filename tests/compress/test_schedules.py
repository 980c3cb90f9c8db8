"""Rank schedules vs the formulas of "Understanding Transformers for Time Series" (sec. 5 and
App. K), computed here."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_jax.compress import interpolation_schedule, power_schedule, uniform_schedule


@pytest.mark.parametrize("d0, alpha, D", [(2, 0.25, 12), (3, 0.5, 12), (5, 0.7, 24),
                                          (8, 0.34, 12), (10, 0.58, 12), (1.5, 1.3, 6)])
def test_power_schedule_formula(d0, alpha, D):
    expected = []
    for i in range(D):
        x = d0 * (1 + i) ** alpha
        # exactly integral (d0 at i = 0, sqrt(4)) or away from integers: plain ceil is exact
        assert x == round(x) or abs(x - round(x)) > 1e-6
        expected.append(math.ceil(x))
    assert power_schedule(d0, alpha, D) == expected


def test_power_schedule_alpha_zero_is_constant():
    assert power_schedule(64, 0.0, 6) == [64] * 6  # the baseline row of Table 3
    assert power_schedule(2.5, 0, 3) == [3, 3, 3]


def test_power_schedule_exact_integers_not_bumped():
    # 1.1 * 10 == 11.000000000000002 in floating point; the exact value is 11.
    d0 = 1.1
    expected = [math.ceil(Fraction(11, 10) * (1 + i)) for i in range(12)]
    assert power_schedule(d0, 1.0, 12) == expected
    assert power_schedule(d0, 1.0, 12)[9] == 11
    # squares: (1 + i)^2 for alpha = 2
    assert power_schedule(1, 2.0, 5) == [1, 4, 9, 16, 25]


def test_power_schedule_clipping():
    D, d0, alpha, cap = 10, 4, 1.0, 20
    expected = [min(cap, math.ceil(Fraction(d0) * (1 + i) ** 1)) for i in range(D)]
    assert power_schedule(d0, alpha, D, max_rank=cap) == expected
    assert expected[-1] == cap and expected[3] == 16


def reference_interp(r1, rD, alpha, D):
    out = []
    for ell in range(1, D + 1):
        t = (ell - 1) / (D - 1)
        x = r1 + (rD - r1) * (t ** alpha if ell > 1 else 0.0)
        out.append(math.floor(x + 0.5))
    return out


@pytest.mark.parametrize("r1, rD, alpha, D", [(16, 256, 0.5, 12), (4, 64, 0.3, 6),
                                              (8, 384, 1.7, 24), (32, 8, 0.5, 5)])
def test_interpolation_schedule_formula(r1, rD, alpha, D):
    got = interpolation_schedule(r1, rD, alpha, D)
    assert got == reference_interp(r1, rD, alpha, D)
    assert got[0] == r1 and got[-1] == rD


def test_interpolation_round_half_up_and_edges():
    # l = 2 of 3: 1 + 3 * 0.5 = 2.5 -> 3 (Python's round() would give 2)
    assert interpolation_schedule(1, 4, 1.0, 3) == [1, 3, 4]
    assert interpolation_schedule(7, 100, 0.5, 1) == [7]
    assert interpolation_schedule(5, 9, 0.0, 4) == [5, 9, 9, 9]  # 0^0 taken as 0 at l = 1
    assert interpolation_schedule(16, 256, 0.5, 5, max_rank=100) == [
        min(100, r) for r in reference_interp(16, 256, 0.5, 5)]


@settings(max_examples=50, deadline=None)
@given(r1=st.integers(1, 512), rD=st.integers(1, 512), alpha=st.floats(0.0, 3.0),
       D=st.integers(2, 40))
def test_interpolation_endpoints_exact(r1, rD, alpha, D):
    got = interpolation_schedule(r1, rD, alpha, D)
    assert len(got) == D and got[0] == r1 and got[-1] == rD
    assert all(min(r1, rD) <= r <= max(r1, rD) for r in got)
    diffs = [b - a for a, b in zip(got, got[1:], strict=False)]
    assert all(d >= 0 for d in diffs) or all(d <= 0 for d in diffs)  # monotone


def test_uniform_schedule():
    assert uniform_schedule(8, 4) == [8, 8, 8, 8]


@pytest.mark.parametrize("call, bad", [
    (lambda: power_schedule(0, 0.5, 4), "d0"),
    (lambda: power_schedule(-1, 0.5, 4), "-1"),
    (lambda: power_schedule(2, -0.1, 4), "-0.1"),
    (lambda: power_schedule(2, 0.5, 0), "num_layers"),
    (lambda: power_schedule(2, 0.5, 4, max_rank=0), "max_rank"),
    (lambda: interpolation_schedule(0, 8, 0.5, 4), "r1"),
    (lambda: interpolation_schedule(4, 2.5, 0.5, 4), "2.5"),
    (lambda: interpolation_schedule(4, 8, float("nan"), 4), "nan"),
    (lambda: uniform_schedule(0, 3), "rank"),
    (lambda: uniform_schedule(2, 1.5), "1.5"),
])
def test_schedule_errors(call, bad):
    with pytest.raises(ValueError, match=bad):
        call()
