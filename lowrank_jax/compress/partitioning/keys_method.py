"""The ``compress_keys`` plan method: attention with keys sent as ``K`` numbers per head.

"Partitioning Transformer Networks with Low Intercommunication" (Thill & Divsalar), sec. III.A:
each selected query-key object (a :class:`~lowrank_jax.QueryKey` at ``'.../attn/qk'``) becomes
a :class:`~lowrank_jax.leaves.partitioned.CompressedKeys`: per head, the basis of eq. 135
(``basis='cqk'``, default) or eq. 136 (``'pca'``) estimated from calibration activations, its
first ``keys`` vectors, and the constant of eq. 124. Under a mesh the tokens are split over
``mesh_axis`` and each machine sends ``keys`` numbers per key per head.

Calibration: ``apply_plan(..., inputs={'<path>/q': x})`` with ``x [..., d_in]`` the activations
entering the query projection (and ``'<path>/k'`` for cross-attention keys; default the same).
Statistics are over every query with every key of the calibration set (``pairs='all'``) or
query ``n`` with key ``n`` (``'matched'``).

Settings: ``keys`` (``K``, int >= 0, required), ``basis``, ``pairs``, ``mesh_axis``; rules may
override ``keys`` and ``basis``. Row ``error``: ``||L - L^||_F / ||L||_F`` of the logits over the
calibration pairs; ``details``: ``keys``, ``basis``, ``bound`` (eq. 134 per head),
``mean_rel_error`` (Fig. 8's measure, over the calibration pairs), ``bytes_per_key`` (all
heads, float32).

A block without heads (every head pruned, :mod:`lowrank_jax.compress.empty`) sends no keys: its
query-key object is passed through unchanged with a row of kind ``'empty'``, and calibration
inputs given for it count as used (it needs none).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.partitioning.keys import METHODS, PAIRS, key_basis
from lowrank_jax.compress.registry import Context, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.compress.rules import Selection
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import get_path, leaf_dtype, linear, replace_paths
from lowrank_jax.leaves.partitioned import CompressedKeys
from lowrank_jax.nn import head_widths

SETTINGS = ("keys", "basis", "pairs", "mesh_axis")
OVERRIDES = ("keys", "basis")


def validate(settings: dict) -> None:
    """Check the step's settings; raises :class:`PlanError`."""
    k = settings.get("keys")
    if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0):
        raise PlanError(f"compress_keys: keys must be an int >= 0, got {k!r}", where="keys",
                        expected="int >= 0", actual=k)
    if settings.get("basis", "cqk") not in METHODS:
        raise PlanError(f"compress_keys: basis must be one of {METHODS}, got "
                        f"{settings['basis']!r}", where="basis", expected=METHODS,
                        actual=settings["basis"])
    if settings.get("pairs", "all") not in PAIRS:
        raise PlanError(f"compress_keys: pairs must be one of {PAIRS}, got "
                        f"{settings['pairs']!r}", where="pairs", expected=PAIRS,
                        actual=settings["pairs"])


def _heads(params: Any, path: str, x: Any, side: str, widths: tuple[int, ...]) -> np.ndarray:
    """Per-head activations ``[h, n, d_head]`` of the projection at ``path/side``."""
    y = np.asarray(linear(get_path(params, f"{path}/{side}"), jnp.asarray(x)), np.float64)
    y = y.reshape(-1, sum(widths))
    return y.reshape(y.shape[0], len(widths), widths[0]).transpose(1, 0, 2)


def compress_keys(params: Any, selection: list[Selection], settings: dict,
                  ctx: Context) -> tuple[Any, list[Row]]:
    """The ``compress_keys`` method (module docstring): ``fn(params, selection, settings, ctx)``.

    "Partitioning Transformer Networks with Low Intercommunication", sec. III.A, eqs. 123-136.

    Args:
      params: the tree (not modified).
      selection: the selected query-key objects.
      settings: ``keys``, ``basis``, ``pairs``, ``mesh_axis``.
      ctx: the step's context (calibration ``inputs``).

    Returns:
      ``(new_params, rows)``.
    """
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        validate(s)
        if s.get("keys") is None:
            raise PlanError(f"compress_keys: {sel.path}: no keys= (numbers sent per key and "
                            "head)", where=sel.path, expected="keys=K", actual=None)
        if is_empty(sel.node):  # a block without heads: no key to send
            ctx.input_for(f"{sel.path}/q")
            ctx.input_for(f"{sel.path}/k")
            rows.append(empty_row(sel))
            continue
        widths = head_widths(params, f"{sel.path}/q")
        if widths is None or len(set(widths)) != 1:
            raise PlanError(f"compress_keys: {sel.path}: needs a QueryKey with equal head "
                            f"widths, got widths {widths}", where=sel.path,
                            expected="a QueryKey with equal widths", actual=widths)
        xq = ctx.input_for(f"{sel.path}/q")
        if xq is None:
            raise PlanError(f"compress_keys: {sel.path}: the basis is estimated from data; pass "
                            f"inputs={{'{sel.path}/q': x}} to apply_plan (x: the activations "
                            "entering the query projection)", where=sel.path,
                            expected="calibration inputs", actual=None)
        xk = ctx.input_for(f"{sel.path}/k")
        xk = xq if xk is None else xk
        num = min(int(s["keys"]), widths[0])
        q = _heads(params, sel.path, xq, "q", widths)
        k = _heads(params, sel.path, xk, "k", widths)
        pairs = s.get("pairs", "all")
        bases = [key_basis(q[h], k[h], method=s.get("basis", "cqk"), pairs=pairs)
                 for h in range(len(widths))]
        basis = np.stack([b.u[:, :num] for b in bases])  # [h, d_head, K]
        offset = np.array([b.tail[num] for b in bases])
        dt = leaf_dtype(get_path(params, f"{sel.path}/q"))
        leaf = CompressedKeys.from_query_key(sel.node, jnp.asarray(basis, dt),
                                             jnp.asarray(offset, dt),
                                             mesh_axis=s.get("mesh_axis", "model"))
        num_err = den = 0.0
        rel = []
        for h, b in enumerate(bases):
            exact = q[h] @ k[h].T if pairs == "all" else np.sum(q[h] * k[h], axis=1)
            qu, ku = q[h] @ b.u[:, :num], k[h] @ b.u[:, :num]
            est = (qu @ ku.T if pairs == "all" else np.sum(qu * ku, axis=1)) + b.tail[num]
            num_err += float(np.sum((exact - est) ** 2))
            den += float(np.sum(exact ** 2))
            rel.append(np.abs(exact - est).ravel() / np.maximum(np.abs(exact).ravel(), 1e-300))
        details = {"keys": num, "basis": s.get("basis", "cqk"), "pairs": pairs,
                   "bound": [float(b.bound[num]) for b in bases],
                   "mean_rel_error": float(np.mean(np.concatenate(rel))),
                   "bytes_per_key": num * len(widths) * 4}
        new[sel.path] = leaf
        rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="compressed-keys",
                                error=np.sqrt(num_err / den) if den else 0.0, details=details))
    return replace_paths(params, new), rows


register_method("compress_keys", compress_keys, selects="qk", settings=SETTINGS,
                overrides=OVERRIDES, validate=validate,
                no_candidates="splits attention over machines by tokens: it saves "
                              "communication, not one device's size or time")

__all__ = ["OVERRIDES", "SETTINGS", "compress_keys", "validate"]
