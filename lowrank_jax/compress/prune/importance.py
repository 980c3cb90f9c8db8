"""Channel importance from per-sample mask gradients ("Less is More", eqs. 5-6) and its EMA.

"Less is More: Unlocking Specialization of Time Series Foundation Models via Structured
Pruning" (arXiv:2505.23195), Definition 3 and eqs. 5-6: the importance of channel ``i`` is the
loss change when its mask goes from 1 to 0, approximated to second order with the Fisher
information in place of the Hessian's diagonal::

    s_i = | -(1/N) sum_n dL_n/dm_i + (1/(2N)) sum_n (dL_n/dm_i)^2 |

``L_n`` is the loss of sample ``n`` alone, so the gradients are *per sample* (``jax.vmap`` of
``jax.grad`` over the batch) and both sums are averages over the ``N`` samples: the score of a
batch equals the score of that batch repeated twice. (The authors' code sums over the batch in
the second term, which makes the scores depend on the batch size; not copied here.)

Channels that must go together (the heads of a per-head factorization) form a *unit* whose mask
is shared: its per-sample gradient is the sum of its channels' (chain rule), taken before
squaring. Across batches the scores are smoothed by an exponential moving average,
``s~(j) = alpha s(j) + (1 - alpha) s~(j-1)`` with ``s~(0) = 0`` (sec. 4.3).

:func:`mask_scorer` is the one scoring path: the plan method applies the masks inside
:class:`~lowrank_jax.leaves.ChannelMasked` leaves (:func:`make_scorer`), the Flax interop by
scaling the kernels of a channel group (:func:`lowrank_jax.interop.channel_groups.gradient_scores`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.leaves import combine, path_str
from lowrank_jax.leaves.channel_masked import mask_partition

Array = jax.Array


def importance(grads: Array) -> Array:
    """"Less is More", eq. 6, from per-sample gradients.

    Args:
      grads: ``[N, ...]`` per-sample gradients ``dL_n/dm`` (one row per sample).

    Returns:
      ``[...]``: ``|-mean_n g + 0.5 mean_n g^2|``.
    """
    g = jnp.asarray(grads)
    if g.ndim < 1 or g.shape[0] < 1:
        raise ShapeError(f"importance: grads must be [N, ...] with N >= 1, got shape "
                         f"{tuple(g.shape)}", where="grads", expected="[N, ...]",
                         actual=tuple(g.shape))
    return jnp.abs(-jnp.mean(g, axis=0) + 0.5 * jnp.mean(jnp.square(g), axis=0))


def ema(previous: Any, scores: Any, alpha: float) -> Any:
    """"Less is More", sec. 4.3: ``alpha * scores + (1 - alpha) * previous`` (elementwise,
    over trees of arrays).

    Args:
      previous: the previous EMA (zeros before the first batch).
      scores: this batch's scores (same structure).
      alpha: the EMA coefficient in ``(0, 1]``.
    """
    if not 0.0 < float(alpha) <= 1.0:
        raise ConfigError(f"ema: alpha must be in (0, 1], got {alpha!r}", where="alpha",
                          expected="(0, 1]", actual=alpha)
    return jax.tree_util.tree_map(lambda p, s: alpha * s + (1.0 - alpha) * p, previous, scores)


def unit_gradients(grads: Array, size: int) -> Array:
    """Per-sample gradients of masks shared by ``size`` consecutive channels: ``[N, d] ->
    [N, d / size]`` (the sum over each unit's channels)."""
    if size == 1:
        return grads
    n, d = grads.shape
    return grads.reshape(n, d // size, size).sum(-1)


def mask_paths(masks: Any) -> list[str]:
    """Paths of the mask arrays of a mask tree (:func:`~lowrank_jax.leaves.mask_partition`), in
    flattening order, as ``'<weight path>/m_in'`` / ``'<weight path>/m_out'``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(masks)
    return [path_str(p) for p, _ in flat]


def mask_scorer(loss_of: Callable, units: Sequence[int]) -> Callable:
    """A jitted ``scorer(masks, context, batch) -> (scores, loss)`` for eq. 6 over any way of
    applying masks: the one scoring path of the plan method and the Flax interop.

    Args:
      loss_of: ``loss_of(masks, context, one) -> loss``: the scalar loss of ``one``, a batch of
        one sample (every array ``[1, ...]``), with the masks applied (a tree of ``[d]``
        arrays); ``context`` is passed through unchanged (the rest of the model, a key).
      units: mask entries per pruning unit for every mask array, in flattening order of
        ``masks``: the per-sample gradient of a unit is the sum over its entries
        (:func:`unit_gradients`), taken before squaring.

    Returns:
      ``scorer``: ``batch`` a pytree of ``[N, ...]`` arrays; returns the list of per-unit scores
      (one ``[d / units[i]]`` array per mask array) and the mean per-sample loss. Compiled once
      per mask structure and batch shape.
    """
    units = tuple(int(u) for u in units)

    def per_sample(masks, context, sample):
        one = jax.tree_util.tree_map(lambda a: a[None], sample)  # a batch of one sample
        return jax.value_and_grad(lambda m: loss_of(m, context, one))(masks)

    @jax.jit
    def scorer(masks, context, batch):
        losses, grads = jax.vmap(per_sample, in_axes=(None, None, 0))(masks, context, batch)
        flat = jax.tree_util.tree_leaves(grads)  # [N, d] each
        if len(flat) != len(units):
            raise ShapeError(f"mask_scorer: {len(flat)} mask arrays but {len(units)} unit sizes",
                             where="units", expected=len(flat), actual=len(units))
        scores = [importance(unit_gradients(g, u)) for g, u in zip(flat, units, strict=True)]
        return scores, jnp.mean(losses)

    return scorer


def make_scorer(loss_fn: Callable, units: Sequence[int]) -> Callable:
    """A jitted ``scorer(masks, rest, batch, key) -> (scores, loss)`` for eq. 6 on a tree with
    :class:`~lowrank_jax.leaves.ChannelMasked` weights (:func:`mask_scorer` with the masks put
    back into the tree).

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)`` whose loss is the mean of the
        per-sample losses (every family's default loss is).
      units: channels per pruning unit for every mask array, in flattening order of the mask
        tree (:func:`mask_paths`).

    Returns:
      ``scorer``: ``masks``/``rest`` from :func:`~lowrank_jax.leaves.mask_partition`;
      ``batch`` a dict of ``[N, ...]`` arrays; returns the list of per-unit scores (one
      ``[d / units[i]]`` array per mask array) and the mean per-sample loss. Compiled once per
      mask structure and batch shape. The same ``(loss_fn, units)`` gives the same scorer
      object (the last 8 are kept), so pruning one model to several targets, or
      :func:`batch_importance` on many batches, compiles once.
    """
    units = tuple(int(u) for u in units)
    try:
        return _cached_scorer(loss_fn, units)
    except TypeError:  # an unhashable callable: build an uncached one
        return _build_scorer(loss_fn, units)


def _build_scorer(loss_fn: Callable, units: tuple[int, ...]) -> Callable:
    def loss_of(masks, context, one):
        rest, key = context
        return loss_fn(combine(masks, rest), one, key)[0]

    core = mask_scorer(loss_of, units)

    def scorer(masks, rest, batch, key):
        return core(masks, (rest, key), batch)

    return scorer


_cached_scorer = functools.lru_cache(maxsize=8)(_build_scorer)


def batch_importance(loss_fn: Callable, params: Any, batch: dict, *, key=None,
                     units: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Eq. 6 of "Less is More" for one batch: the importance of every mask entry of the
    :class:`~lowrank_jax.leaves.ChannelMasked` leaves of ``params``.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)`` (mean of per-sample losses).
      params: a tree with masked weights.
      batch: a dict of ``[N, ...]`` arrays.
      key: PRNG key passed to the loss (default ``PRNGKey(0)``).
      units: ``{mask path: channels per unit}`` (default 1 everywhere).

    Returns:
      ``{'<weight path>/m_in' | '<weight path>/m_out': scores}`` (NumPy, one per unit).
    """
    masks, rest = mask_partition(params)
    paths = mask_paths(masks)
    sizes = [int((units or {}).get(p, 1)) for p in paths]
    scorer = make_scorer(loss_fn, sizes)
    key = jax.random.PRNGKey(0) if key is None else key
    scores, _ = scorer(masks, rest, batch, key)
    return {p: np.asarray(s) for p, s in zip(paths, scores, strict=True)}


__all__ = ["batch_importance", "ema", "importance", "make_scorer", "mask_paths", "mask_scorer",
           "unit_gradients"]
