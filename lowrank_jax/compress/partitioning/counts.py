"""Communication, storage and FLOP counts of the paper, equation by equation.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec.
II.C-D, eqs. 23-62, for one dense layer ``W`` (``d1 x d0``, the paper's orientation) over ``M``
machines with rank ``r`` (``d0`` inputs, ``d1`` outputs). Each function is one equation as
printed, with the approximations the paper makes (``kappa = d1 / d0``, ``gamma = M r / d0``,
eqs. 38-39) in the ``*_approx`` forms.

Conventions. The paper counts **2 FLOPs per multiply-add** and 1 per added vector element
(sec. II.C.5); the library's :meth:`~lowrank_jax.Leaf.flops` counts **multiply-adds** and no
additions. :func:`executed` gives both for what
:class:`~lowrank_jax.leaves.partitioned.Partitioned` actually runs.

Where the paper is inconsistent:

* eq. 49 prints the middle term ``2 M gamma kappa d^2``; substituting eqs. 38-39 into eq. 48
  gives ``2 M r d1 = 2 gamma kappa d^2``. :func:`flops_baseline_total_eq49` returns the
  printed value; :func:`flops_baseline_total_eq49_corrected` the one that equals eq. 48 (and
  leads to eq. 50, which is right).
* eqs. 51-54 (new method) leave out the ``2 r d0 / M`` FLOPs machine ``m'`` spends on its own
  message ``y~_m' = Sigma~ V~^T x_m'`` (eq. 29), which eq. 46 counts for the baseline.
  :func:`executed` counts it.
* eq. 6 prints ``W_mm'`` as ``(d0/M) x (d1/M)``; it is ``(d1/M) x (d0/M)`` (eq. 42 counts it
  right).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowrank_jax.errors import ConfigError

# -- communication (numbers per token per layer) ---------------------------------------------


def _sizes(d0, d1, machines, rank=None):
    for name, v in (("d0", d0), ("d1", d1), ("machines", machines)) + (
            (("rank", rank),) if rank is not None else ()):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (
                0 if name == "rank" else 1):
            raise ConfigError(f"partition counts: {name} must be a positive int, got {v!r}",
                              where=name, expected="int >= 1", actual=v)


def comm_baseline_regular(r: int) -> int:
    """Eq. 23: numbers a regular machine sends to the central node (SVD method): ``r``."""
    return int(r)


def comm_baseline_central(d1: int) -> int:
    """Eq. 24: numbers the central node sends back (SVD method): ``d1``."""
    return int(d1)


def comm_new(r: int) -> int:
    """Eq. 34: numbers every machine broadcasts (new method): ``r``, in one round."""
    return int(r)


# -- storage (parameters) ---------------------------------------------------------------------


def storage_baseline_regular(d0: int, machines: int, r: int) -> float:
    """Eq. 35: ``r d0 / M`` (the machine's ``Sigma V^T``)."""
    return r * d0 / machines


def storage_baseline_central(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 36: ``r d0 / M + (M r + 1) d1`` (its ``Sigma V^T``, every ``U_m'``, the bias)."""
    return r * d0 / machines + (machines * r + 1) * d1


def storage_baseline_total(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 37: ``r d0 + (M r + 1) d1``."""
    return r * d0 + (machines * r + 1) * d1


def storage_baseline_total_eq40(d: int, kappa: float, gamma: float, machines: int) -> float:
    """Eq. 40: ``gamma d^2 / M + (gamma d + 1) kappa d`` (eq. 37 with ``d0 = d``)."""
    return gamma * d * d / machines + (gamma * d + 1) * kappa * d


def storage_baseline_total_approx(d: int, kappa: float, gamma: float) -> float:
    """Eq. 41: ``gamma kappa d^2 + kappa d`` (large ``M``)."""
    return gamma * kappa * d * d + kappa * d


def storage_new_machine(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 42: ``d0 d1 / M^2 + r d0 / M + (M - 1) r d1 / M + d1 / M`` per machine."""
    m = machines
    return d0 * d1 / m**2 + r * d0 / m + (m - 1) * r * d1 / m + d1 / m


def storage_new_total(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 43: ``d0 d1 / M + r d0 + (M - 1) r d1 + d1``."""
    m = machines
    return d0 * d1 / m + r * d0 + (m - 1) * r * d1 + d1


def storage_new_total_eq44(d: int, kappa: float, gamma: float, machines: int) -> float:
    """Eq. 44: ``(gamma kappa + (kappa (1 - gamma) + gamma) / M) d^2 + kappa d``."""
    return (gamma * kappa + (kappa * (1 - gamma) + gamma) / machines) * d * d + kappa * d


def storage_new_total_approx(d: int, kappa: float, gamma: float) -> float:
    """Eq. 45: ``gamma kappa d^2 + kappa d`` (large ``M``)."""
    return gamma * kappa * d * d + kappa * d


# -- FLOPs (the paper's convention: 2 per multiply-add, 1 per added element) -------------------


def flops_baseline_regular(d0: int, machines: int, r: int) -> float:
    """Eq. 46: ``2 r d0 / M`` (the message ``Sigma V^T x_m'``)."""
    return 2 * r * d0 / machines


def flops_baseline_central(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 47: ``2 r d0 / M + 2 M r d1 + M d1``."""
    return 2 * r * d0 / machines + 2 * machines * r * d1 + machines * d1


def flops_baseline_total(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 48: ``2 r d0 + 2 M r d1 + M d1``."""
    return 2 * r * d0 + 2 * machines * r * d1 + machines * d1


def flops_baseline_total_eq49(d: int, kappa: float, gamma: float, machines: int,
                              r: int) -> float:
    """Eq. 49 as printed: ``2 gamma d^2 / M + 2 M gamma kappa d^2 + gamma kappa d^2 / r``.

    Its middle term is ``M`` times too large (see the module docstring and
    :func:`flops_baseline_total_eq49_corrected`)."""
    return (2 * gamma * d * d / machines + 2 * machines * gamma * kappa * d * d
            + gamma * kappa * d * d / r)


def flops_baseline_total_eq49_corrected(d: int, kappa: float, gamma: float, machines: int,
                                        r: int) -> float:
    """Eq. 49 with the middle term ``2 gamma kappa d^2``: equal to eq. 48."""
    return (2 * gamma * d * d / machines + 2 * gamma * kappa * d * d
            + gamma * kappa * d * d / r)


def flops_baseline_total_approx(d: int, kappa: float, gamma: float, r: int) -> float:
    """Eq. 50: ``gamma (2 + 1/r) kappa d^2``."""
    return gamma * (2 + 1 / r) * kappa * d * d


def flops_new_machine(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 51 as printed: ``2 d0 d1 / M^2 + 2 (M - 1) r d1 / M + d1`` per machine (no
    ``2 r d0 / M`` for the machine's own message: :func:`executed` adds it)."""
    m = machines
    return 2 * d0 * d1 / m**2 + 2 * (m - 1) * r * d1 / m + d1


def flops_new_total(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 52: ``2 d0 d1 / M + 2 (M - 1) r d1 + M d1``."""
    m = machines
    return 2 * d0 * d1 / m + 2 * (m - 1) * r * d1 + m * d1


def flops_new_total_eq53(d: int, kappa: float, gamma: float, machines: int, r: int) -> float:
    """Eq. 53: ``(2 kappa / M + 2 (M - 1) kappa gamma / M + kappa gamma / r) d^2``."""
    m = machines
    return (2 * kappa / m + 2 * (m - 1) * kappa * gamma / m + kappa * gamma / r) * d * d


def flops_new_total_approx(d: int, kappa: float, gamma: float, r: int) -> float:
    """Eq. 54: ``gamma (2 + 1/r) kappa d^2`` (large ``M``)."""
    return gamma * (2 + 1 / r) * kappa * d * d


# -- parameters of the approximations only (sec. II.D) ----------------------------------------


def n0_full_svd(d0: int, d1: int, machines: int, r: int) -> int:
    """Eq. 56: ``N0 = M r (d0 + d1)``: a rank-``M r`` SVD of ``W``."""
    return machines * r * (d0 + d1)


def n1_svd_method(d0: int, d1: int, machines: int, r: int) -> float:
    """Eq. 57: ``N1 = M r (d0 / M + d1)``: the SVD method without biases."""
    return machines * r * (d0 / machines + d1)


def n2_new(d0: int, d1: int, machines: int, r: int) -> float:
    """Eqs. 58-59: ``N2 = d1 d0 / M + (M - 1) d1 r + r d0``: the new method without biases.
    Also its multiply-adds per token (what :meth:`Partitioned.flops` counts)."""
    m = machines
    return d1 * d0 / m + (m - 1) * d1 * r + r * d0


def n0_gamma(d: int, kappa: float, gamma: float) -> float:
    """Eq. 60: ``N0 = gamma (kappa + 1) d^2``."""
    return gamma * (kappa + 1) * d * d


def n1_gamma(d: int, kappa: float, gamma: float, machines: int) -> float:
    """Eq. 61: ``N1 = gamma (kappa + 1/M) d^2``."""
    return gamma * (kappa + 1 / machines) * d * d


def n2_gamma(d: int, kappa: float, gamma: float, machines: int) -> float:
    """Eq. 62: ``N2 = (gamma kappa + (kappa (1 - gamma) + gamma) / M) d^2``."""
    return (gamma * kappa + (kappa * (1 - gamma) + gamma) / machines) * d * d


def kappa_gamma(d0: int, d1: int, machines: int, r: int) -> tuple[float, float]:
    """``(kappa, gamma) = (d1 / d0, M r / d0)`` (eqs. 38-39)."""
    return d1 / d0, machines * r / d0


# -- what is executed --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Counts:
    """Per-machine and total counts of one partitioned layer as
    :class:`~lowrank_jax.leaves.partitioned.Partitioned` runs it (per token).

    Fields:
      machines, rank: ``M``, ``r``.
      sent: numbers each machine broadcasts (eq. 34).
      received: numbers each machine receives from the others, ``(M - 1) r``.
      params_machine, params_total: stored parameters (eqs. 42-43; with a bias).
      macs_machine, macs_total: multiply-adds (the library's convention; the total is eq. 59's
        ``N2`` and :meth:`Partitioned.flops`).
      flops_machine, flops_total: the paper's convention (2 per multiply-add, plus the bias
        and the sum of the ``M`` partial results, ``d1 / M`` each), including the message's
        ``2 r d0 / M`` that eq. 51 leaves out: eq. 51 + ``2 r d0 / M``.
    """

    machines: int
    rank: int
    sent: int
    received: int
    params_machine: float
    params_total: float
    macs_machine: float
    macs_total: float
    flops_machine: float
    flops_total: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def executed(d0: int, d1: int, machines: int, r: int, *, bias: bool = True) -> Counts:
    """Counts of what one partitioned layer executes per token, per machine and in total.

    Args:
      d0, d1: inputs and outputs of the layer (the paper's ``W`` is ``d1 x d0``).
      machines: ``M``.
      r: rank (numbers each machine sends).
      bias: whether the layer stores a bias.

    Returns:
      :class:`Counts`.
    """
    _sizes(d0, d1, machines, r)
    m = machines
    a, c = d0 / m, d1 / m
    r_eff = r if m > 1 else 0
    params = a * c + a * r_eff + (m - 1) * r_eff * c + (c if bias else 0)
    macs = a * c + a * r_eff + (m - 1) * r_eff * c
    flops = 2 * macs + (d1 if bias else d1 - c)  # M partial sums of c numbers (+ the bias)
    return Counts(machines=m, rank=r_eff, sent=r_eff, received=(m - 1) * r_eff,
                  params_machine=params, params_total=m * params, macs_machine=macs,
                  macs_total=m * macs, flops_machine=flops, flops_total=m * flops)


__all__ = [
    "Counts", "comm_baseline_central", "comm_baseline_regular", "comm_new", "executed",
    "flops_baseline_central", "flops_baseline_regular", "flops_baseline_total",
    "flops_baseline_total_approx", "flops_baseline_total_eq49",
    "flops_baseline_total_eq49_corrected", "flops_new_machine", "flops_new_total",
    "flops_new_total_approx", "flops_new_total_eq53", "kappa_gamma", "n0_full_svd", "n0_gamma",
    "n1_gamma", "n1_svd_method", "n2_gamma", "n2_new", "storage_baseline_central",
    "storage_baseline_regular", "storage_baseline_total", "storage_baseline_total_approx",
    "storage_baseline_total_eq40", "storage_new_machine", "storage_new_total",
    "storage_new_total_approx", "storage_new_total_eq44",
]
