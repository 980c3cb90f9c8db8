"""The ``binarize`` plan method: trained dense weights become Biprop masked-binary leaves.

"Sparse Binary Transformers for Multivariate Time Series Modeling" (Gorbett et al., KDD 2023,
arXiv:2308.04637, sec. 3.2, eqs. 1-2) trains masked-binary weights from random initial
weights and scores: ``W_eff = alpha sign(W) M`` with ``M`` the top ``keep`` fraction of the
scores' magnitudes and ``alpha = ||M * W||_1 / floor(keep n)``. As a plan method it is applied
to weights that were trained dense (or came out of an earlier step), so it starts from them::

    Step("binarize", [r"input_patch_embedding/"], {"keep": 0.5})

Every selected weight ``W`` (any float leaf; a factorized one is densified exactly in float64)
becomes a :class:`~lowrank_jax.MaskedBinary` with

* ``w = W``: the trained signs are kept, and ``alpha`` is the mean magnitude of the kept
  entries (up to the divisor, below), which is the gain that minimises
  ``||W - alpha sign(W) M||_F`` for a fixed mask. The paper's random ``w`` would throw the
  trained weight away;
* ``s = |W|`` (``scores='magnitude'``, the default): the initial mask keeps the largest
  entries, i.e. magnitude pruning, the closest masked-binary weight to ``W`` in that sense; the
  scores then train from there (Biprop's estimator, the leaf's backward). ``scores='uniform'``
  draws them as the paper's code does, ``U(-1/sqrt(d_in), 1/sqrt(d_in))`` (a random initial
  mask, for training the mask from scratch; needs ``key=`` in
  :func:`~lowrank_jax.compress.apply_plan`);
* the leaf's bias (if any) kept in float and trainable; ``w`` frozen (Biprop trains only the
  scores: :meth:`~lowrank_jax.MaskedBinary.trainable`).

A weight whose residual-width channels a ``prune`` step removed (a
:class:`~lowrank_jax.leaves.ChannelPruned` leaf) is binarized on its kept channels only
(:func:`~lowrank_jax.leaves.channel_masked.pruned_base`): the removed rows and columns stay removed and
are not counted, and the keep fraction applies to the weights that are left.

Settings: ``keep`` (fraction of weights kept, in ``(0, 1]``, default 0.5; the paper's prune
rate is ``p = 1 - keep``), ``divisor`` (``'reference'``, the default: ``floor(keep n)``, as
Biprop's code; ``'kept'``: the number of kept entries, as the paper's eq. 2 writes it, which
makes ``alpha`` exactly the mean kept magnitude), ``scores`` (``'magnitude'`` or
``'uniform'``). Rules may override ``keep``.

A weight with no inputs or no outputs (of an emptied attention block or MLP,
:mod:`lowrank_jax.compress.empty`) is passed through unchanged with a row of kind ``'empty'``:
there is no entry to keep, and a binary leaf would only add a gain. The other weights are
binarized as without it (with ``scores='uniform'`` each weight's key is still the one of its
position in the selection).

Row ``error``: ``||W - W_b||_2 / ||W||_2`` in float64 (``W_b`` the new leaf's effective
weight). ``details``: ``shape`` (of the kept channels for a pruned weight), ``keep``,
``n_keep`` (kept entries), ``alpha``, ``scores``, ``divisor``. Counts are the leaf's own: one
bit per kept weight plus a float32 ``alpha`` (sec. 5.1), ``n_tokens * n_keep`` multiply-adds
(Table 5).
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.compress.candidates import ATTENTION, MLP
from lowrank_jax.compress.empty import empty_row, is_empty
from lowrank_jax.compress.registry import Candidates, Context, register_method
from lowrank_jax.compress.report import Row
from lowrank_jax.compress.rules import Selection
from lowrank_jax.compress.svd import truncatable, weight_matrix
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import MaskedBinary, materialize, materialize_host, replace_paths
from lowrank_jax.leaves.channel_masked import pruned_base

SETTINGS = ("keep", "divisor", "scores")
OVERRIDES = ("keep",)
DEFAULTS = {"keep": 0.5, "divisor": "reference", "scores": "magnitude"}
SCORES = ("magnitude", "uniform")
DIVISORS = ("reference", "kept")


def check_keep(keep: Any, where: str = "keep") -> float:
    """``keep`` as a float in ``(0, 1]``.

    Raises:
      PlanError: not a number in ``(0, 1]`` (naming ``where``: the setting or the path).
    """
    if isinstance(keep, bool) or not isinstance(keep, numbers.Real) or not 0.0 < keep <= 1.0:
        raise PlanError(f"binarize: {where}: keep must be a fraction in (0, 1] (the fraction "
                        f"of weights kept; prune rate p = 1 - keep), got {keep!r}", where=where,
                        expected="(0, 1]", actual=keep)
    return float(keep)


def check_settings(settings: Mapping) -> None:
    """Validate the step's settings (module docstring).

    Raises:
      PlanError: ``keep`` outside ``(0, 1]``, an unknown ``divisor`` or ``scores``.
    """
    s = {**DEFAULTS, **settings}
    check_keep(s["keep"])
    if s["divisor"] not in DIVISORS:
        raise PlanError(f"binarize: divisor must be one of {DIVISORS}, got {s['divisor']!r}",
                        where="divisor", expected=DIVISORS, actual=s["divisor"])
    if s["scores"] not in SCORES:
        raise PlanError(f"binarize: scores must be one of {SCORES}, got {s['scores']!r}",
                        where="scores", expected=SCORES, actual=s["scores"])


def binarize_leaf(node: Any, path: str, *, keep: float, divisor: str = "reference",
                  scores: str = "magnitude", key=None) -> MaskedBinary:
    """One weight as a :class:`~lowrank_jax.MaskedBinary` (module docstring): ``w`` the
    weight, scores ``|W|`` or the paper's uniform draw, the bias kept.

    Args:
      node: a float weight leaf (all of its arrays trainable) or a 2-D array.
      path: its parameter path, for messages.
      keep: fraction of weights kept, in ``(0, 1]``.
      divisor: ``'reference'`` or ``'kept'`` (:class:`~lowrank_jax.MaskedBinary`).
      scores: ``'magnitude'`` or ``'uniform'`` (needs ``key``).
      key: PRNG key for ``scores='uniform'``.

    Raises:
      PlanError: a bad ``keep`` (naming the path); ``scores='uniform'`` without a key.
      LeafTypeError: a leaf with frozen arrays (already binary).
    """
    keep = check_keep(keep, path)
    mat, bias, dtype = weight_matrix("binarize", node, path)
    w = jnp.asarray(mat, dtype)
    if scores == "magnitude":
        s = jnp.abs(w)
    else:
        if key is None:
            raise PlanError(f"binarize: {path}: scores='uniform' draws random scores; pass key= "
                            "to apply_plan", where=path, expected="a PRNG key", actual=None)
        bound = 1.0 / np.sqrt(mat.shape[0])
        s = jax.random.uniform(key, mat.shape, dtype, -bound, bound)
    return MaskedBinary(w=w, s=s, b=bias, keep=keep, divisor=divisor)


def binarize(params: Any, selection: list[Selection], settings: dict,
             ctx: Context) -> tuple[Any, list[Row]]:
    """The ``binarize`` plan method: ``fn(params, selection, settings, ctx) -> (params, rows)``
    (module docstring).

    Args:
      params: the tree (not modified).
      selection: the selected float weight leaves.
      settings: ``keep``, ``divisor``, ``scores``.
      ctx: the step's context (its key for ``scores='uniform'``).

    Returns:
      ``(new_params, rows)``, one row per selected weight (``kind='binary'``, or
      ``'empty'`` for a weight of an emptied block, passed through).

    Raises:
      PlanError: bad settings or a bad ``keep`` override (naming the path), ``scores='uniform'``
        without a key.
    """
    check_settings(settings)
    s = {**DEFAULTS, **settings}
    keys = [None] * len(selection)
    live = [sel for sel in selection if not is_empty(sel.node)]
    if s["scores"] == "uniform" and live:
        # one key per selected weight, empty ones included: the others draw what they would
        # draw without them being empty
        key = ctx.require_key(live[0].path)
        keys = list(jax.random.split(key, max(len(selection), 1)))
    new, rows = {}, []
    for sel, k in zip(selection, keys, strict=False):
        keep = check_keep(sel.overrides.get("keep", s["keep"]), sel.path)
        base, put_back, _ = pruned_base(sel.node)  # a pruned weight: its kept channels
        if is_empty(base):  # a weight of an emptied block: nothing to binarize
            rows.append(empty_row(sel))
            continue
        binary = binarize_leaf(base, sel.path, keep=keep, divisor=s["divisor"],
                               scores=s["scores"], key=k)
        leaf = put_back(binary)
        # one compiled program per shape (the leaf's forward op by op would compile dozens)
        w_b = np.asarray(_dense(binary), np.float64)  # alpha sign(w) M: entries 0 or +-alpha
        before = materialize_host(base)
        norm = float(np.linalg.norm(before, 2))
        err = float(np.linalg.norm(before - w_b, 2)) / norm if norm > 0 else 0.0
        details = {"shape": [int(d) for d in base.shape], "keep": keep,
                   "n_keep": int(binary.n_keep), "alpha": float(np.abs(w_b).max()),
                   "scores": s["scores"], "divisor": s["divisor"]}
        new[sel.path] = leaf
        rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="binary",
                                error=err, details=details))
    return replace_paths(params, new), rows


_dense = jax.jit(materialize)


#: Frontier candidates: the MLP, and attention with the MLP, each keeping ``keep`` of the
#: weights.
CANDIDATES = Candidates(
    groups=(("binarize mlp", MLP), ("binarize attn+mlp", ATTENTION + MLP)),
    settings=lambda s, keep: {"keep": keep}, label="keep={keep:g}",
    none="no attention or MLP projection it can binarize")

register_method("binarize", binarize, settings=SETTINGS, overrides=OVERRIDES,
                accepts=truncatable, validate=check_settings, candidates=CANDIDATES)

__all__ = ["DEFAULTS", "OVERRIDES", "SETTINGS", "binarize", "binarize_leaf", "check_keep",
           "check_settings"]
