"""Per-layer rank schedules for the "flow-of-ranks".

"Understanding Transformers for Time Series: Rank Structure, Flow-of-Ranks, and Compressibility",
sec. 5 and App. K.

The numerical rank of a layer's input grows with depth (sec. 4), so deeper layers get
larger ranks. Each function returns a list of Python ints, one per layer (layer ``i`` of
``lowrank_jax.leaves.layer_index``), usable as the ``schedule`` setting of the ``svd`` and
``factorize`` methods (``compress(..., schedule=...)``, ``factorize_init(..., schedule=...)``).

Floating point: ``d0 * (1 + i) ** alpha`` may land a hair above an integer it equals exactly
(``8 ** (1/3) = 2.0000000000000004``), and ``ceil`` would then jump to the next integer. The
schedules therefore round with a relative slack of ``1e-9``: ``ceil(x - 1e-9 max(1, |x|))``
and, for half-up rounding, ``floor(x + 0.5 + 1e-9 max(1, |x|))``. Values genuinely within
``1e-9`` of an integer boundary are treated as lying on it.
"""

from __future__ import annotations

import math
import numbers

from lowrank_jax.errors import ConfigError

_SLACK = 1e-9


def _ceil(x: float) -> int:
    return int(math.ceil(x - _SLACK * max(1.0, abs(x))))


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5 + _SLACK * max(1.0, abs(x))))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_layers(fn: str, num_layers) -> int:
    if not _is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"{fn}: num_layers must be an int >= 1, got {num_layers!r}")
    return int(num_layers)


def _check_alpha(fn: str, alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not (
        math.isfinite(alpha) and alpha >= 0
    ):
        raise ConfigError(f"{fn}: alpha must be a finite number >= 0, got {alpha!r}")
    return float(alpha)


def _check_rank(fn: str, name: str, r) -> int:
    if not _is_int(r) or r < 1:
        raise ConfigError(f"{fn}: {name} must be an int >= 1, got {r!r}")
    return int(r)


def _clip(ranks: list[int], max_rank: int | None, fn: str) -> list[int]:
    if max_rank is None:
        return ranks
    max_rank = _check_rank(fn, "max_rank", max_rank)
    return [min(r, max_rank) for r in ranks]


def power_schedule(d0: float, alpha: float, num_layers: int, *,
                   max_rank: int | None = None) -> list[int]:
    """Sec. 5: ``d_i = ceil(d0 (1 + i)^alpha)`` for layers ``i = 0, ..., D - 1``.

    Args:
      d0: base rank ``d~_0 > 0`` (a real number; the paper uses 2..64).
      alpha: growth exponent ``>= 0`` (``alpha = 0`` gives a constant rank ``ceil(d0)``).
      num_layers: ``D``.
      max_rank: optional cap (for example the hidden size); ranks are ``min(d_i, max_rank)``.

    Returns:
      ``[d_0, ..., d_{D-1}]`` as ints, each ``>= 1``. ``ceil`` is taken with a ``1e-9`` relative
      slack (module docstring).
    """
    fn = "power_schedule"
    if isinstance(d0, bool) or not isinstance(d0, numbers.Real) or not (
        math.isfinite(d0) and d0 > 0
    ):
        raise ConfigError(f"{fn}: d0 must be a finite number > 0, got {d0!r}")
    alpha = _check_alpha(fn, alpha)
    num_layers = _check_layers(fn, num_layers)
    ranks = [max(1, _ceil(float(d0) * (1.0 + i) ** alpha)) for i in range(num_layers)]
    return _clip(ranks, max_rank, fn)


def interpolation_schedule(r1: int, rD: int, alpha: float, num_layers: int, *,
                           max_rank: int | None = None) -> list[int]:
    """App. K: ``r_l = r_1 + (r_D - r_1) ((l - 1) / (D - 1))^alpha``, ``l = 1..D``.

    Rounded half up to an int (``floor(x + 1/2)`` with the module's ``1e-9`` slack). The
    endpoints are exact: ``r_1`` at ``l = 1`` for every ``alpha`` (``0^0`` is taken as 0 there,
    so ``alpha = 0`` gives ``[r_1, r_D, ..., r_D]``) and ``r_D`` at ``l = D``. ``D = 1`` gives
    ``[r_1]``. ``alpha < 1`` is concave in depth (the paper's suggestion, ``alpha = 0.5``);
    ``r_D < r_1`` gives a decreasing schedule.

    Args:
      r1: rank of the first layer (the paper: median eps-rank of the input embeddings, or 16).
      rD: rank of the last layer (the paper: ``d / 2``).
      alpha: exponent ``>= 0``.
      num_layers: ``D``.
      max_rank: optional cap applied after rounding.

    Returns:
      ``[r_1, ..., r_D]`` as ints.
    """
    fn = "interpolation_schedule"
    r1 = _check_rank(fn, "r1", r1)
    rD = _check_rank(fn, "rD", rD)
    alpha = _check_alpha(fn, alpha)
    D = _check_layers(fn, num_layers)
    if D == 1:
        return _clip([r1], max_rank, fn)
    ranks = []
    for ell in range(1, D + 1):
        t = (ell - 1) / (D - 1)
        frac = 0.0 if ell == 1 else t ** alpha
        ranks.append(_round_half_up(r1 + (rD - r1) * frac))
    return _clip(ranks, max_rank, fn)


def uniform_schedule(rank: int, num_layers: int) -> list[int]:
    """The same rank for every layer (the "without flow-of-ranks" baseline, Table 4)."""
    fn = "uniform_schedule"
    rank = _check_rank(fn, "rank", rank)
    return [rank] * _check_layers(fn, num_layers)


__all__ = ["interpolation_schedule", "power_schedule", "uniform_schedule"]
