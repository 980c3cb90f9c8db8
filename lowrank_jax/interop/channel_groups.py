"""Structured pruning of a Flax model: channel groups over Flax paths, scores, removal.

lowrank_jax's own ``prune`` method reads which weights share channels from the structure of
its trees (attention blocks with a :class:`~lowrank_jax.HeadLayout`, MLP blocks ``wi``/``wo``).
A Flax model does not declare it: ``Dense_0``'s outputs feed ``Dense_1`` only because the
module's ``__call__`` says so. Here the user states it as data, a :class:`ChannelGroup` per set
of shared channels, or lets :func:`infer_groups` propose the common patterns. Checked against
the tree's kernels, each declaration becomes a
:class:`~lowrank_jax.compress.prune.groups.PruneGroup`, the description of prunable structure
the ``prune`` plan method builds for lowrank_jax trees, and the scores and the selection are
the plan method's own (:func:`~lowrank_jax.compress.prune.mask_scorer`,
:func:`~lowrank_jax.compress.prune.ema`, :func:`~lowrank_jax.compress.prune.select_removed`);
this module only says where the kernels are and how a group's mask multiplies them:

* an MLP: ``ChannelGroup('.../MlpBlock_0/Dense_0', outputs=('.../Dense_0/kernel',),
  inputs=('.../Dense_1/kernel',))``: hidden channel ``j`` is output ``j`` of the first layer
  and input ``j`` of the second; it goes from both;
* attention heads (``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``):
  ``ChannelGroup('.../attn', outputs=(query, key, value kernels [d, heads, head_dim]),
  inputs=(out kernel [heads, head_dim, d],), unit='head')``: head ``h`` goes from all four;
* any other sharing the user knows of (query/key channel pairs: ``outputs=(query, key)``,
  ``unit='channel'``; a gated MLP: ``outputs=(gate, up)``, ``inputs=(down,)``).

Scores, one per unit (a channel or a head) of each group:

* :func:`magnitude_scores`: the root-mean-square of the unit's weights over the group's
  kernels (magnitude pruning; no data, no model);
* :func:`gradient_scores`: "Less is More" (Zhao et al., arXiv:2505.23195) eqs. 5-6, the
  second-order Taylor estimate of the loss change when the unit's mask goes from 1 to 0,
  ``s = |-mean_n dL_n/dm + 1/2 mean_n (dL_n/dm)^2|``, with per-sample gradients of one mask
  shared by the group's kernels (the chain rule sums over them before squaring), through the
  user's own loss function on the unchanged model, smoothed by an EMA over batches (sec. 4.3).

:func:`select_units` keeps the best units (``scope='group'``: each group loses the ``target``
fraction of its units, as torch-pruning's default; ``scope='global'``: one ranking across all
groups, as "Less is More" ranks, best with gradient scores, which estimate comparable loss
changes; every group keeps at least one unit) and :func:`prune_tree` removes the others.

**How removed channels run in the unchanged model.** The kernels of a group become
:class:`~lowrank_jax.leaves.ChannelPruned` leaves through the ``prune`` plan method: a kernel
that loses outputs computes only the kept ones and places them into a zero vector of the full
width; a kernel that loses inputs gathers only the kept ones. Physically smaller plain kernels
would not run: ``nn.Dense(features=mlp_dim)`` and ``nn.DenseGeneral(features=(num_heads,
head_dim))`` fix the width in the model's code, and linen checks a stored parameter against it
(``ScopeParamShapeError`` for a ``[d, mlp_dim']`` kernel); ``nnx.MultiHeadAttention`` keeps
``num_heads`` too. The full-width leaves keep every module's widths, so linen runs them through
:func:`lowrank_jax.interop.linen.apply` and nnx through the leaf modules, with no change to the
model's code. The pruned layers store and multiply only the kept channels (the counts and the
report say so); what is not saved: the zero-filled hidden activation between the two MLP layers,
and the attention scores of a removed head, which the Flax attention function still computes on
zero queries and keys (its output is never read: the output projection gathers the kept heads
only). Because the second kernel never reads a removed channel, the result equals the model with
those channels deleted whatever the activation does at 0.

Other methods compose afterwards (``svd``, ``binarize``, ``per_head`` svd act on the kept
channels, :func:`~lowrank_jax.leaves.channel_masked.pruned_base`); prune the plain Flax kernels
first.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from lowrank_jax.compress import Report, Step
from lowrank_jax.compress.prune import PruneGroup, Span, UnitTable, ema, mask_scorer
from lowrank_jax.compress.prune.groups import (
    SCOPES,
    additive_fraction,
    check_scope,
    check_target,
    select_removed,
)
from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.interop.kernels import (
    BIAS,
    KERNEL,
    KernelShape,
    _in_ndim,
    _join,
    compress_tree,
    flat_dict,
    kernel_paths,
    to_leaves,
)
from lowrank_jax.leaves import is_leaf
from lowrank_jax.leaves.channel_masked import mask_leaf

UNITS = ("channel", "head")


@dataclasses.dataclass(frozen=True)
class ChannelGroup:
    """Channels that several Flax kernels share and that are removed together: the user's
    declaration by kernel paths, which :func:`resolve_groups` turns into a
    :class:`~lowrank_jax.compress.prune.groups.PruneGroup` against the tree's shapes.

    Fields:
      name: the group's name (scores are keyed by it), e.g. the path of the module whose
        outputs the channels are.
      outputs: kernel paths whose *outputs* are the channels (an MLP's first layer; the
        query, key and value kernels ``[d, heads, head_dim]``).
      inputs: kernel paths whose *inputs* are the channels (the MLP's second layer; the
        attention output kernel ``[heads, head_dim, d]``).
      unit: ``'channel'``: one output (input) feature of the flattened kernel is a unit;
        ``'head'``: the first output (input) dimension of kernels over heads is, each head all
        of its ``head_dim`` features.
    """

    name: str
    outputs: tuple[str, ...]
    inputs: tuple[str, ...] = ()
    unit: str = "channel"

    def __post_init__(self):
        for f in ("outputs", "inputs"):
            v = getattr(self, f)
            v = (v,) if isinstance(v, str) else tuple(v)
            if any(not isinstance(p, str) for p in v):
                raise ConfigError(f"ChannelGroup {self.name!r}: {f} must be kernel paths, got "
                                  f"{v!r}", where=self.name, expected="str paths", actual=v)
            object.__setattr__(self, f, v)
        if not self.outputs:
            raise ConfigError(f"ChannelGroup {self.name!r}: no outputs; a group needs the kernel(s) "
                              "whose outputs are the channels", where=self.name,
                              expected="at least one output kernel", actual=())
        if self.unit not in UNITS:
            raise ConfigError(f"ChannelGroup {self.name!r}: unit must be one of {UNITS}, got "
                              f"{self.unit!r}", where=self.name, expected=UNITS, actual=self.unit)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    key: tuple               # its key in the flat Flax dict
    shape: KernelShape
    bias: bool               # it has a bias (scaled and counted with its outputs)


def _resolve(tree: Any, groups: Iterable[ChannelGroup], in_dims: Mapping[str, int] | None
             ) -> tuple[dict, list[PruneGroup], dict[str, _Kernel]]:
    """Check the groups against the tree; ``(flat tree, groups, {kernel path: _Kernel})``.

    Raises:
      ConfigError: a path that is no kernel, a kernel that is already a leaf, a kernel on the
        same side of two groups, duplicate group names.
      ShapeError: a kernel whose channel count does not match the group's (naming the path,
        the expected and the actual count), ``unit='head'`` on a kernel not over heads.
    """
    flat = flat_dict(tree)
    keys = {_join(k): k for k in flat}
    kernels = list(kernel_paths(tree))
    found: dict[str, _Kernel] = {}
    seen: dict[tuple[str, str], str] = {}
    names: set[str] = set()
    out = []
    for g in groups:
        if not isinstance(g, ChannelGroup):
            raise ConfigError(f"expected ChannelGroup declarations, got {type(g).__name__}",
                              where="groups", expected="ChannelGroup", actual=type(g).__name__)
        if g.name in names:
            raise ConfigError(f"two channel groups are named {g.name!r}; names key the scores",
                              where=g.name, expected="unique names", actual=g.name)
        names.add(g.name)
        spans, units, first = [], None, None
        for side, paths in (("out", g.outputs), ("in", g.inputs)):
            for path in paths:
                key = keys.get(path)
                if key is None or key[-1] != KERNEL or path not in kernels:
                    raise ConfigError(
                        f"group {g.name!r}: {path!r} is not a kernel of the Flax tree; kernels: "
                        f"{kernels[:12]}{' ...' if len(kernels) > 12 else ''}", where=path,
                        expected="a kernel path", actual=path)
                kernel = flat[key]
                if is_leaf(kernel):
                    raise ConfigError(
                        f"group {g.name!r}: {path} is already a {type(kernel).__name__} leaf; "
                        "prune the plain Flax kernels first, then compress (svd and binarize act "
                        "on the kept channels)", where=path, expected="a plain Flax kernel",
                        actual=type(kernel).__name__)
                if (path, side) in seen:
                    raise ConfigError(f"{path}: its {side}puts are in two groups "
                                      f"({seen[path, side]!r} and {g.name!r})", where=path,
                                      expected="one group per side", actual=[seen[path, side],
                                                                            g.name])
                seen[path, side] = g.name
                bias = flat.get(key[:-1] + (BIAS,))
                n = _in_ndim(path, kernel, bias, in_dims)
                shape = KernelShape(tuple(np.shape(kernel))[:n], tuple(np.shape(kernel))[n:])
                dims = shape.out_shape if side == "out" else shape.in_shape
                if g.unit == "head":
                    if len(dims) < 2:
                        raise ShapeError(
                            f"group {g.name!r} (unit='head'): {path} has {side}put shape {dims}, "
                            "not (heads, head_dim, ...); a kernel over heads is "
                            "[d, heads, head_dim] (outputs) or [heads, head_dim, d] (inputs)",
                            where=path, expected="(heads, head_dim)", actual=dims)
                    n_units, size = dims[0], math.prod(dims[1:])
                else:
                    n_units, size = math.prod(dims), 1
                if units is None:
                    units, first = n_units, path
                elif n_units != units:
                    what = "heads" if g.unit == "head" else "channels"
                    raise ShapeError(
                        f"group {g.name!r}: {path} has {n_units} {side}put {what} (kernel shape "
                        f"{tuple(np.shape(kernel))}) but {first} has {units}; the kernels of a "
                        f"group share their {what}", where=path, expected=units, actual=n_units)
                found[path] = _Kernel(key=key, shape=shape, bias=bias is not None)
                d_in, d_out = shape.matrix
                cost = size * (d_in + int(bias is not None)) if side == "out" else size * d_out
                spans.append(Span(path, side, size, cost))
        out.append(PruneGroup(g.name, tuple(spans), int(units),
                              kind="heads" if g.unit == "head" else "channels", min_keep=1))
    return flat, out, found


def resolve_groups(tree: Any, groups: Iterable[ChannelGroup], *,
                   in_dims: Mapping[str, int] | None = None) -> list[PruneGroup]:
    """The declarations checked against the tree's kernels, as the
    :class:`~lowrank_jax.compress.prune.groups.PruneGroup` s that scores and selection use:
    one span per kernel (``size`` features per unit: 1, or a head's ``head_dim``; ``cost``
    its parameters per unit, an output kernel's bias included), ``min_keep=1``.

    Raises:
      ConfigError, ShapeError: as :func:`prune_tree` (the path named).
    """
    return _resolve(tree, groups, in_dims)[1]


def _matrix(flat: dict, k: _Kernel):
    return jnp.reshape(flat[k.key], k.shape.matrix)


def _natural(k) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t)
                 for t in re.findall(r"\d+|\D+", str(k)))


def infer_groups(tree: Any, *, call_order: Iterable[str] | None = None) -> list[ChannelGroup]:
    """Channel groups of the common Flax patterns, read from names and shapes.

    * **attention**: a module with children ``query``, ``key``, ``value``, ``out`` whose
      kernels are ``[d, heads, head_dim]`` (x3) and ``[heads, head_dim, d]``
      (``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``, big_vision): one group
      of whole heads, named by the module's path;
    * **MLP**: a module with exactly two children holding 2-D kernels ``[d, h]`` and
      ``[h, d]`` with ``h > d``: one group of the ``h`` hidden channels, the ``[d, h]`` kernel
      the first layer (its path names the group). Shapes chain both ways in a residual MLP and
      names do not tell the order (``nn.Dense(d)(nn.gelu(nn.Dense(h)(x)))`` names the *second*
      layer ``Dense_0``): with ``call_order`` the layer called first is the first layer;
      without it the hidden width is taken to be the larger, as transformer MLPs expand
      (``h == d`` is then skipped, and a bottleneck, ``h < d``, would be read the wrong way
      round: give ``call_order`` or declare it).
      big_vision's ``MlpBlock``, an ``nnx.List`` of two ``nnx.Linear``, and two ``nn.Dense``
      beside the norms and attention of an encoder block all match.

    It reads names and shapes, not the model's code: check the groups it returns (they print)
    before pruning; declare anything else (gated MLPs, query/key channel pairs) by hand.

    Args:
      tree: a Flax variable dict (linen) or an nnx parameter tree
        (:func:`lowrank_jax.interop.nnx.param_tree`).
      call_order: kernel paths in the order the model calls their layers
        (:func:`lowrank_jax.interop.linen.infer_groups` records it from an abstract call).

    Returns:
      A list of :class:`ChannelGroup`, in tree order.
    """
    rank = {p: i for i, p in enumerate(call_order or ())}
    flat = flat_dict(tree)
    kernels = {k[:-1]: v for k, v in flat.items() if k[-1] == KERNEL and np.ndim(v) >= 2
               and not is_leaf(v)}
    children: dict[tuple, list] = {}
    for mod in kernels:
        if mod:
            children.setdefault(mod[:-1], []).append(mod[-1])
    groups = []
    for parent, names in children.items():
        shapes = {n: np.shape(kernels[parent + (n,)]) for n in names}
        if {"query", "key", "value", "out"} <= set(names):
            q, k, v, o = (shapes[n] for n in ("query", "key", "value", "out"))
            if (len(q) == len(k) == len(v) == 3 and len(o) == 3 and q[1] == k[1] == v[1] == o[0]
                    and v[2] == o[1]):
                p = lambda n, parent=parent: _join(parent + (n, KERNEL))  # noqa: E731
                groups.append(ChannelGroup(_join(parent), outputs=(p("query"), p("key"),
                                                                   p("value")),
                                           inputs=(p("out"),), unit="head"))
                continue
        dense = sorted((n for n in names if len(shapes[n]) == 2), key=_natural)
        if len(dense) == 2:
            a, b = dense
            (d, h), (h2, d2) = shapes[a], shapes[b]
            pa, pb = _join(parent + (a, KERNEL)), _join(parent + (b, KERNEL))
            known = call_order is not None and pa in rank and pb in rank
            if h == h2 and d == d2 and (known or h != d):
                if (rank[pb] < rank[pa]) if known else h < d:  # b is the first layer
                    a, b = b, a
                groups.append(ChannelGroup(_join(parent + (a,)),
                                           outputs=(_join(parent + (a, KERNEL)),),
                                           inputs=(_join(parent + (b, KERNEL)),)))
    order = {_join(k[:-1]): i for i, k in enumerate(flat)}
    return sorted(groups, key=lambda g: order.get(g.outputs[0][: -len(KERNEL) - 1], 0))


def magnitude_scores(tree: Any, groups: Iterable[ChannelGroup], *,
                     in_dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Weight-magnitude score of every unit: the root-mean-square of its kernel weights over
    the group's kernels (columns of the output kernels, rows of the input kernels; biases not
    included). Needs no data.

    Returns:
      ``{group name: float64 [units]}``.
    """
    flat, resolved, kernels = _resolve(tree, groups, in_dims)
    out = {}
    for g in resolved:
        sq = np.zeros(g.units)
        count = 0
        for sp in g.spans:
            w = np.asarray(_matrix(flat, kernels[sp.path]), np.float64)
            w = w if sp.side == "out" else w.T  # [other, units * size]
            sq += (w.reshape(w.shape[0], g.units, sp.size) ** 2).sum(axis=(0, 2))
            count += w.shape[0] * sp.size
        out[g.name] = np.sqrt(sq / count)
    return out


def _scaled(flat: dict, resolved: list[PruneGroup], kernels: dict[str, _Kernel],
            masks: list[jax.Array]) -> dict:
    """The Flax tree with every group's mask applied: output kernels' columns and biases, input
    kernels' rows multiplied by their unit's mask ("Less is More", eq. 4, on plain kernels)."""
    new = dict(flat)
    for g, mask in zip(resolved, masks, strict=True):
        for sp in g.spans:
            k = kernels[sp.path]
            mk = jnp.repeat(mask, sp.size)
            w = jnp.reshape(new[k.key], k.shape.matrix)
            w = w * (mk[None, :] if sp.side == "out" else mk[:, None])
            new[k.key] = jnp.reshape(w, k.shape.in_shape + k.shape.out_shape).astype(
                flat[k.key].dtype)
            if k.bias and sp.side == "out":
                bkey = k.key[:-1] + (BIAS,)
                new[bkey] = (jnp.reshape(new[bkey], (-1,)) * mk).reshape(
                    np.shape(flat[bkey])).astype(flat[bkey].dtype)
    return traverse_util.unflatten_dict(new)


def gradient_scores(loss_fn: Callable[[Any, Any], Any], tree: Any,
                    groups: Iterable[ChannelGroup], batches: Iterable, *, alpha: float = 0.5,
                    keep: Mapping[str, Any] | None = None,
                    in_dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """"Less is More" eqs. 5-6 for every unit, through the user's loss, EMA over batches.

    For one shared mask ``m_u`` per unit (multiplying the columns and biases of the group's
    output kernels and the rows of its input kernels, eq. 4), the per-sample gradients
    ``g_n = dL_n/dm_u`` at the current masks give ``s_u = |-mean_n g_n + 1/2 mean_n g_n^2|``
    (:func:`lowrank_jax.compress.prune.mask_scorer`, the plan method's scorer); across batches
    ``s~ = alpha s + (1 - alpha) s~`` from zero (sec. 4.3).

    Args:
      loss_fn: ``loss_fn(tree, batch) -> loss`` (or ``(loss, aux)``): the mean loss of a batch
        under a Flax variable dict, e.g. ``lambda v, b: xent(model.apply(v, b['x']), b['y'])``
        (the model unchanged; it sees plain arrays). Each sample is scored alone, as a batch
        of one.
      tree: the Flax variable dict (plain kernels).
      groups: the :class:`ChannelGroup` declarations.
      batches: an iterable of batches (pytrees of ``[N, ...]`` arrays; one shape compiles once).
      alpha: the EMA coefficient in ``(0, 1]``.
      keep: ``{group name: bool [units]}`` units already removed (mask 0) while scoring.
      in_dims: see :func:`lowrank_jax.interop.kernels.to_leaves`.

    Returns:
      ``{group name: float64 [units]}`` (the EMA after the last batch).
    """
    flat, resolved, kernels = _resolve(tree, groups, in_dims)
    dtype = jnp.result_type(*[flat[kernels[sp.path].key] for g in resolved for sp in g.spans])
    masks = [jnp.ones((g.units,), dtype) if keep is None or g.name not in keep
             else jnp.asarray(np.asarray(keep[g.name], bool), dtype) for g in resolved]

    def loss_of(m, flat, one):
        out = loss_fn(_scaled(flat, resolved, kernels, m), one)
        return out[0] if isinstance(out, tuple) else out

    scorer = mask_scorer(loss_of, UnitTable.of_groups(resolved).sizes)
    avg = [np.zeros(g.units, np.float64) for g in resolved]
    n = 0
    for batch in batches:
        s, _ = scorer(masks, flat, batch)
        avg = ema(avg, [np.asarray(v, np.float64) for v in s], alpha)
        n += 1
    if n == 0:
        raise ConfigError("gradient_scores: no batches", where="batches",
                          expected="at least one batch", actual=0)
    return {g.name: a for g, a in zip(resolved, avg, strict=True)}


def select_units(tree: Any, groups: Iterable[ChannelGroup], scores: Mapping[str, Any], *,
                 target: float, scope: str = "group",
                 in_dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Which units to keep: the lowest-scoring go until ``target`` of the groups' parameters is
    removed; every group keeps at least one unit
    (:func:`lowrank_jax.compress.prune.select_removed`, the plan method's ranking).

    Args:
      tree, groups: the Flax tree and the declarations.
      scores: ``{group name: [units]}`` (:func:`magnitude_scores`, :func:`gradient_scores`).
      target: fraction of the grouped kernels' parameters (biases of output kernels included)
        to remove, in ``[0, 1)``.
      scope: ``'group'``: each group loses ``floor(target * units)`` units; ``'global'``: one
        ranking over all groups' units (ties by group, then unit), removed in order of score
        until the removed parameters reach ``target`` of the total.

    Returns:
      ``{group name: bool [units]}`` (``True``: kept).
    """
    check_target(target)
    check_scope(scope)
    _, resolved, _ = _resolve(tree, groups, in_dims)
    s = []
    for g in resolved:
        v = None if g.name not in scores else np.asarray(scores[g.name], np.float64)
        if v is None or v.shape != (g.units,) or not np.all(np.isfinite(v)):
            raise ConfigError(f"prune: scores of group {g.name!r} must be {g.units} finite "
                              f"numbers, got {None if v is None else v.shape}", where=g.name,
                              expected=(g.units,), actual=None if v is None else v.shape)
        s.append(v)
    table = UnitTable.of_groups(resolved)
    alive = np.ones(table.total, bool)
    costs = np.repeat([g.cost for g in resolved], table.counts)
    gone = select_removed(np.concatenate(s) if s else np.zeros(0), alive, goal=float(target),
                          fraction=additive_fraction(costs), unit_group=table.unit_group,
                          min_keep=[g.min_keep for g in resolved], scope=scope)
    alive[gone] = False
    return {g.name: a.copy() for g, a in zip(resolved, table.split(alive), strict=True)}


def mask_tree(tree: Any, groups: Iterable[ChannelGroup], keep: Mapping[str, Any], *,
              in_dims: Mapping[str, int] | None = None) -> dict:
    """The Flax tree with every grouped kernel a :class:`~lowrank_jax.leaves.ChannelMasked`
    leaf (bias folded in, ``kernel_shape`` beside kernels over heads) whose masks say what
    ``keep`` keeps: the input of the ``prune`` plan method (which removes masked channels
    physically) and of a plan that prunes, then compresses.
    """
    _, resolved, kernels = _resolve(tree, groups, in_dims)
    flat = flat_dict(to_leaves(tree, sorted(kernels), in_dims=in_dims))
    alive = []
    for g in resolved:
        k = np.asarray(keep[g.name], bool)
        if k.shape != (g.units,):
            raise ShapeError(f"prune: keep of group {g.name!r} must be bool [{g.units}], "
                             f"got shape {k.shape}", where=g.name, expected=(g.units,),
                             actual=k.shape)
        alive.append(k)
    kept = UnitTable.of_groups(resolved).channel_keep(
        np.concatenate(alive) if alive else np.zeros(0, bool))
    for path, (m_in, m_out) in kept.items():
        key = kernels[path].key
        flat[key] = mask_leaf(flat[key], *(None if m is None else m.astype(np.float32)
                                           for m in (m_in, m_out)))
    return traverse_util.unflatten_dict(flat)


def prune_tree(tree: Any, groups: Iterable[ChannelGroup], *, target: float,
               scores: str | Mapping[str, Any] = "magnitude", scope: str = "group",
               in_dims: Mapping[str, int] | None = None) -> tuple[dict, Report]:
    """Remove the lowest-scoring units of every group (module docstring).

    Args:
      tree: a Flax variable dict with plain kernels (linen variables, or an nnx parameter tree).
      groups: :class:`ChannelGroup` declarations (or :func:`infer_groups`).
      target: fraction of the grouped kernels' parameters to remove (:func:`select_units`).
      scores: ``'magnitude'`` (:func:`magnitude_scores`) or ``{group name: [units]}`` (e.g.
        :func:`gradient_scores`).
      scope: ``'group'`` or ``'global'`` (:func:`select_units`).
      in_dims: see :func:`lowrank_jax.interop.kernels.to_leaves`.

    Returns:
      ``(new_tree, report)``: the grouped kernels as
      :class:`~lowrank_jax.leaves.ChannelPruned` leaves (kernels of groups that lost nothing
      stay plain), the report of the ``prune`` plan step (rows ``kind='pruned'`` with
      ``in_kept`` / ``out_kept`` at Flax paths; counts as for native trees); its step info
      holds ``groups``: ``{name: {'units', 'kept', 'removed': [unit indices]}}``.
    """
    groups = list(groups)
    if isinstance(scores, str):
        if scores != "magnitude":
            raise ConfigError(f"prune: scores must be 'magnitude' or a dict of per-group scores "
                              f"(gradient_scores), got {scores!r}", where="scores",
                              expected="'magnitude' or a dict", actual=scores)
        scores = magnitude_scores(tree, groups, in_dims=in_dims)
    keep = select_units(tree, groups, scores, target=target, scope=scope, in_dims=in_dims)
    masked = mask_tree(tree, groups, keep, in_dims=in_dims)
    paths = sorted({p for g in groups for p in (*g.outputs, *g.inputs)})
    rule = "^(" + "|".join(re.escape(p) for p in paths) + ")$"
    new, report = compress_tree(masked, Step("prune", (rule,)), in_dims=in_dims)
    report.steps[0].info["groups"] = {
        name: {"units": int(k.size), "kept": int(k.sum()),
               "removed": [int(u) for u in np.flatnonzero(~k)]} for name, k in keep.items()}
    return new, report


__all__ = ["ChannelGroup", "SCOPES", "UNITS", "gradient_scores", "infer_groups",
           "magnitude_scores", "mask_tree", "prune_tree", "resolve_groups", "select_units"]
