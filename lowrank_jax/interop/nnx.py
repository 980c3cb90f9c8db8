"""Flax nnx: leaves inside modules, and a user's model compressed by replacing submodules.

* :class:`LeafLinear` / :class:`LeafLinearGeneral`: ``nnx.Linear`` / ``nnx.LinearGeneral``
  whose ``kernel`` ``nnx.Param`` holds any lowrank_jax leaf (bias inside) and whose call is
  :func:`lowrank_jax.linear`.
* :func:`compress`: the model's parameters (``nnx.state(model, nnx.Param)`` as a pure dict,
  paths ``'blocks/0/attn/query/kernel'``) go through a plan; in a copy of the model
  (``nnx.clone``) every ``nnx.Linear`` / ``nnx.LinearGeneral`` whose kernel became a leaf is
  replaced by a leaf module. The model's class and ``__call__`` are untouched: its code calls
  ``self.query(x)`` and gets the leaf module. The input model is not modified.
* :func:`with_leaves`: the same surgery from a saved tree (``load_params``), then
  ``nnx.update`` of the other parameters.
* :func:`materialize`: a copy with plain ``nnx.Linear`` / ``nnx.LinearGeneral`` modules.
* :func:`param_tree`: ``nnx.state(model, nnx.Param)`` as a pure dict (what to save, count, or
  split for training with ``nnx.split`` / ``nnx.merge``).
* :func:`prune`: structured pruning by channel groups over the state's paths (MLP hidden
  channels, attention heads; :mod:`lowrank_jax.interop.channel_groups`), scored by weight magnitude or
  by :func:`gradient_scores` through the user's loss.

**Tied layers.** A layer held under two names (``self.last = self.first``, or one module in two
places of a list) is one module: ``nnx.state`` holds its parameters once, at its first path in
nnx's (sorted) order, so plans, channel groups, report rows and saved trees address it by that
path (a rule or group that names it only by another name is refused with an error naming both).
:func:`compress`, :func:`with_leaves`, :func:`prune` and :func:`materialize` put the new module
in every place that holds the layer, so the copy is tied as the model was and every call site
runs the compressed weights. Two different modules that share a parameter variable
(``self.b.kernel = self.a.kernel``) cannot both run one leaf (a leaf replaces the whole layer,
bias included): compressing either is refused, naming both.

**Counts of shared layers.** The report, :func:`lowrank_jax.param_count` and
:func:`lowrank_jax.flops` count what is stored: a tied layer once, in parameters and in FLOPs,
however often the model calls it (the counts read the parameters, not the model's code). A
layer the model calls twice per token executes twice its ``flops``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lowrank_jax.compress import as_plan, normalize_rules
from lowrank_jax.errors import ConfigError, PlanError, ShapeError
from lowrank_jax.interop import channel_groups as _groups
from lowrank_jax.interop.kernels import (
    KERNEL,
    LeafInit,
    _cast_operands,
    compress_tree,
    contract,
    dense_matrix,
    flat_dict,
    kernel_paths,
)
from lowrank_jax.leaves import Dense, Leaf, is_leaf, linear


def _constrain(y: jax.Array, out_sharding: Any) -> jax.Array:
    """``nnx.Linear``'s ``out_sharding`` keyword (``nnx.MultiHeadAttention`` passes it)."""
    return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


class LeafLinear(nnx.Module):
    """``nnx.Linear`` on a lowrank_jax leaf: ``y = linear(kernel, x)``.

    Args:
      leaf: any weight leaf ``[in_features, out_features]`` (its bias is the layer's).
      dtype: computation dtype (``None``: the operands' own).
      name: the module's path, for error messages.
    """

    def __init__(self, leaf: Leaf, *, dtype: Any = None, name: str = ""):
        if not is_leaf(leaf):
            raise ConfigError(f"LeafLinear {name}: expected a lowrank_jax leaf, got "
                              f"{type(leaf).__name__}", where=name or "leaf", expected="Leaf",
                              actual=type(leaf).__name__)
        self.kernel = nnx.Param(leaf)
        self.dtype = dtype
        self.name = name

    @classmethod
    def create(cls, in_features: int, out_features: int, *, rngs: nnx.Rngs, use_bias: bool = True,
               leaf_init: LeafInit | None = None, dtype: Any = None) -> "LeafLinear":
        """A fresh layer: ``leaf_init(key, in, out, use_bias)`` (default a :class:`Dense` leaf
        with ``nnx.Linear``'s initializers)."""
        key = rngs.params()
        if leaf_init is None:
            kk, kb = jax.random.split(key)
            w = nnx.initializers.lecun_normal()(kk, (in_features, out_features), jnp.float32)
            leaf = Dense(w=w, b=jnp.zeros((out_features,), jnp.float32) if use_bias else None)
        else:
            leaf = leaf_init(key, in_features, out_features, use_bias)
        return cls(leaf, dtype=dtype)

    def __call__(self, x: jax.Array, *, out_sharding: Any = None) -> jax.Array:
        # x: [..., in] -> [..., out]
        leaf, x = _cast_operands(self.kernel.get_value(), x, self.dtype)
        if x.shape[-1] != leaf.d_in:
            where = f"{self.name}/{KERNEL}" if self.name else KERNEL
            raise ShapeError(f"{where}: the leaf expects inputs of width {leaf.d_in}, got input "
                             f"{tuple(x.shape)}", where=where, expected=leaf.d_in,
                             actual=tuple(x.shape))
        return _constrain(linear(leaf, x), out_sharding)


class LeafLinearGeneral(nnx.Module):
    """``nnx.LinearGeneral`` (no ``batch_axis``) on a 2-D leaf
    ``[prod(in_features), prod(out_features)]``: an attention projection over heads."""

    def __init__(self, leaf: Leaf, in_features: tuple[int, ...], out_features: tuple[int, ...],
                 axis: tuple[int, ...] = (-1,), *, dtype: Any = None, name: str = ""):
        self.in_features = tuple(in_features)
        self.out_features = tuple(out_features)
        self.axis = tuple(axis)
        if not is_leaf(leaf) or len(self.axis) != len(self.in_features):
            raise ConfigError(f"LeafLinearGeneral {name}: expected a leaf and one axis per input "
                              f"feature, got {type(leaf).__name__}, axis {self.axis}, "
                              f"in_features {self.in_features}", where=name or "leaf",
                              expected="Leaf", actual=type(leaf).__name__)
        self.kernel = nnx.Param(leaf)
        self.dtype = dtype
        self.name = name

    def __call__(self, x: jax.Array, *, out_sharding: Any = None) -> jax.Array:
        leaf, x = _cast_operands(self.kernel.get_value(), x, self.dtype)
        where = f"{self.name}/{KERNEL}" if self.name else KERNEL
        return _constrain(contract(leaf, x, self.axis, self.out_features, where), out_sharding)


def _path(p) -> str:
    return "/".join(str(k) for k in p)


def param_tree(model: nnx.Module) -> dict:
    """``nnx.state(model, nnx.Param)`` as a pure nested dict (list indices are int keys)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _linears(model: nnx.Module) -> dict[str, tuple[tuple, nnx.Module]]:
    """``{'a/b/kernel': (path, module)}`` for every nnx.Linear / LinearGeneral of the model."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.Linear, nnx.LinearGeneral, LeafLinear, LeafLinearGeneral)):
            out[_path(path + (KERNEL,))] = (tuple(path), node)
    return out


def _put(parent: Any, key: Any, new: nnx.Module) -> None:
    if isinstance(key, int):
        parent[key] = new
    else:
        setattr(parent, key, new)


def _references(model: nnx.Module) -> dict[int, list[tuple[Any, Any, tuple]]]:
    """``{id(node): [(parent, key, path), ...]}``: every attribute or item through which each
    graph node below ``model`` is held (``path``: the parent's path in ``nnx.iter_graph``
    plus ``key``). A module tied under two names (``self.last = self.first``) has two entries;
    one held by a shared parent has one (replacing it there replaces it under every path
    through that parent)."""
    refs: dict[int, list] = {}
    for path, parent in nnx.iter_graph(model):
        if not isinstance(parent, nnx.Pytree):  # modules, nnx.List, nnx.Dict
            continue
        for key, child in nnx.iter_children(parent):
            if not isinstance(child, nnx.Variable):
                refs.setdefault(id(child), []).append((parent, key, tuple(path) + (key,)))
    return refs


def _replace_everywhere(refs: dict, module: nnx.Module, new: nnx.Module) -> None:
    """Put ``new`` in every place that holds ``module``: tied names stay one (shared) module."""
    for parent, key, _ in refs.get(id(module), ()):
        _put(parent, key, new)


def _shared_variables(linears: dict) -> dict[int, list[str]]:
    """``{id(layer): [kernel paths of the other layers]}`` for layers that share their kernel
    or bias variable with a different layer (``self.b.kernel = self.a.kernel``)."""
    holders: dict[int, dict[int, str]] = {}
    for where, (_, m) in linears.items():
        for name in (KERNEL, "bias"):
            var = getattr(m, name, None)
            if isinstance(var, nnx.Variable):
                holders.setdefault(id(var), {})[id(m)] = where
    out: dict[int, set[str]] = {}
    for mods in holders.values():
        for i in mods if len(mods) > 1 else ():
            out.setdefault(i, set()).update(w for j, w in mods.items() if j != i)
    return {i: sorted(v) for i, v in out.items()}


def _aliases(model: nnx.Module) -> dict[str, str]:
    """``{other kernel path: state kernel path}`` for every layer held under more than one
    name (``self.last = self.first``: ``{'last/kernel': 'first/kernel'}``)."""
    refs = _references(model)
    out = {}
    for where, (path, m) in _linears(model).items():
        for _, _, p in refs.get(id(m), ()):
            if tuple(p) != tuple(path):
                out[_path(p + (KERNEL,))] = where
    return out


def _check_alias_rules(model: nnx.Module, plan: Any) -> None:
    """A rule that matches a tied layer only under its second name: say so (the state, and so
    the plan, knows it under its first)."""
    aliases = _aliases(model)
    if not aliases:
        return
    plan = as_plan(plan)
    paths = list(kernel_paths(param_tree(model)))
    for i, step in enumerate(plan.steps):
        for rule in normalize_rules(step.rules, where=f"step {i} ({step.method})"):
            hit = [a for a in aliases if rule.regex.search(a)]
            if hit and not any(rule.regex.search(p) for p in paths):
                raise PlanError(
                    f"step {i} ({step.method}): rule {rule.pattern!r} matches {hit[0]} only, which "
                    f"is the layer {aliases[hit[0]]} under a second name (one module, tied); "
                    f"rules match the path nnx.state gives it: {aliases[hit[0]]}",
                    where=rule.pattern, expected=aliases[hit[0]], actual=hit[0])


def _check_alias_groups(model: nnx.Module, groups) -> None:
    aliases = _aliases(model)
    for g in groups if aliases else ():
        for p in (*g.outputs, *g.inputs):
            if p in aliases:
                raise ConfigError(f"channel group {g.name!r}: {p} is the layer {aliases[p]} under "
                                  "a second name (one module, tied); name it by the path "
                                  f"nnx.state gives it: {aliases[p]}", where=p,
                                  expected=aliases[p], actual=p)


def _leaf_module(where: str, module: nnx.Module, leaf: Leaf) -> nnx.Module:
    name = where[: -len(KERNEL) - 1]
    if isinstance(module, (nnx.Linear, LeafLinear)):
        d_out = module.out_features if isinstance(module, nnx.Linear) else None
        if d_out is not None and leaf.d_out != d_out:
            raise ShapeError(f"{where}: the leaf has {leaf.d_out} outputs but the module has "
                             f"out_features={d_out}", where=where, expected=d_out,
                             actual=leaf.d_out)
        return LeafLinear(leaf, dtype=module.dtype, name=name)
    if isinstance(module, LeafLinearGeneral):
        return LeafLinearGeneral(leaf, module.in_features, module.out_features, module.axis,
                                 dtype=module.dtype, name=name)
    if module.batch_axis:
        raise ConfigError(f"{where}: LinearGeneral with batch_axis={dict(module.batch_axis)} is "
                          "not supported with a leaf kernel", where=where, expected="{}",
                          actual=dict(module.batch_axis))
    return LeafLinearGeneral(leaf, module.in_features, module.out_features, module.axis,
                             dtype=module.dtype, name=name)


def _replace(model: nnx.Module, tree: dict) -> nnx.Module:
    """A copy of ``model`` with a leaf module wherever ``tree`` holds a leaf kernel, put in
    every place that holds the layer (a tied layer stays one module under all its names)."""
    new = nnx.clone(model)
    linears = _linears(new)
    refs = _references(new)
    shared = None
    for key, v in flat_dict(tree).items():
        if not is_leaf(v):
            continue
        where = _path(key)
        if key[-1] != KERNEL or where not in linears:
            raise ConfigError(f"{where}: a lowrank_jax leaf here does not belong to an nnx.Linear "
                              "or nnx.LinearGeneral of the model (only their kernels run on "
                              "leaves)", where=where, expected=sorted(linears)[:8], actual=where)
        _, module = linears[where]
        shared = _shared_variables(linears) if shared is None else shared
        if id(module) in shared:
            others = shared[id(module)]
            raise ConfigError(
                f"{where}: this layer shares its kernel or bias variable with {others} (a "
                "different module holding the same nnx.Param); a leaf replaces the whole layer, so "
                "the other would stay dense. Tie the modules instead (self.b = self.a), or leave "
                "these layers out of the plan", where=where, expected="a layer of its own",
                actual=[where, *others])
        _replace_everywhere(refs, module, _leaf_module(where, module, v))
    return new


def compress(model: nnx.Module, plan: Any, **kwargs) -> tuple[nnx.Module, Any]:
    """Apply a compression plan to an nnx model; the model itself is not modified.

    Args:
      model: any ``nnx.Module``.
      plan: a :class:`~lowrank_jax.Plan` (or step / list / dict); rules match the kernel paths
        of ``nnx.state(model, nnx.Param)``: ``'layers/0/linear1/kernel'``,
        ``'attn/query/kernel'``.
      **kwargs: :func:`~lowrank_jax.apply_plan`'s keywords (``key``, ``inputs``, ...).

    Returns:
      ``(new_model, report)``: a copy whose compressed layers are :class:`LeafLinear` /
      :class:`LeafLinearGeneral` (a tied layer under every name it has, still one module);
      the report as for native trees (rows at nnx paths; a tied layer once, at its state path,
      counted once: module docstring).

    Raises:
      PlanError: a rule matching no kernel (naming the rule and listing the kernel paths), or
        matching a tied layer only by its second name (naming both).
      ConfigError: a selected kernel of a module that is not Linear / LinearGeneral, or of a
        layer that shares its kernel or bias variable with another module (naming the paths).
    """
    _check_alias_rules(model, plan)
    tree, report = compress_tree(param_tree(model), plan, in_dims=_in_dims(model), **kwargs)
    return _replace(model, tree), report


def _in_dims(model: nnx.Module) -> dict[str, int]:
    """``{'^path$': n}``: the input dimensions of every ``nnx.LinearGeneral`` kernel, from the
    module (a kernel over heads without a bias does not say them)."""
    return {"^" + re.escape(p) + "$": len(m.in_features) for p, (_, m) in _linears(model).items()
            if isinstance(m, (nnx.LinearGeneral, LeafLinearGeneral))}


def with_leaves(model: nnx.Module, tree: dict) -> nnx.Module:
    """A copy of ``model`` running ``tree`` (e.g. ``load_params`` of a saved
    :func:`param_tree` of a compressed model): leaf kernels replace their modules (a tied layer
    under every name it has), every other parameter is set with ``nnx.update``.

    Raises:
      ConfigError / ShapeError: a leaf at a path that is no Linear kernel, a leaf of the wrong
        width, or a tree that does not match the model's parameters (naming the path).
    """
    new = _replace(model, tree)
    state = nnx.state(new, nnx.Param)
    want = {_path(k) for k in flat_dict(nnx.to_pure_dict(state))}
    got = {_path(k) for k in flat_dict(tree)}
    if want != got:
        missing, extra = sorted(want - got), sorted(got - want)
        where = (missing or extra)[0]
        raise ConfigError(f"with_leaves: the tree does not match the model's parameters: "
                          f"missing {missing[:8]}, unexpected {extra[:8]}", where=where,
                          expected=missing[:8], actual=extra[:8])
    nnx.replace_by_pure_dict(state, tree)
    nnx.update(new, state)
    return new


def _plain(m: LeafLinear | LeafLinearGeneral) -> nnx.Module:
    """The plain nnx layer computing what the leaf module computes, on the densified leaf."""
    leaf = m.kernel.get_value()
    w, b = dense_matrix(leaf), leaf.bias
    kw = dict(use_bias=b is not None, dtype=m.dtype, param_dtype=w.dtype)
    if isinstance(m, LeafLinear):
        lin = nnx.eval_shape(lambda: nnx.Linear(leaf.d_in, leaf.d_out, rngs=nnx.Rngs(0), **kw))
        shape_w, shape_b = w.shape, leaf.d_out
    else:  # eval_shape: no random init of a kernel that is overwritten
        lin = nnx.eval_shape(lambda: nnx.LinearGeneral(m.in_features, m.out_features,
                                                       axis=m.axis, rngs=nnx.Rngs(0), **kw))
        shape_w, shape_b = m.in_features + m.out_features, m.out_features
    lin.kernel.set_value(w.reshape(shape_w))
    if b is not None:
        lin.bias.set_value(b.reshape(shape_b))
    return lin


def materialize(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with plain ``nnx.Linear`` / ``nnx.LinearGeneral`` layers holding the
    densified leaves (:func:`lowrank_jax.materialize`; a tied layer becomes one plain module
    under every name it has)."""
    new = nnx.clone(model)
    refs = _references(new)
    for _, m in _linears(new).values():
        if isinstance(m, (LeafLinear, LeafLinearGeneral)):
            _replace_everywhere(refs, m, _plain(m))
    return new


def infer_groups(model: nnx.Module) -> list:
    """Channel groups of the common patterns of the model's parameters (heads of
    ``nnx.MultiHeadAttention``, two-``nnx.Linear`` MLPs):
    :func:`lowrank_jax.interop.channel_groups.infer_groups` on :func:`param_tree`. Check what it
    returns."""
    return _groups.infer_groups(param_tree(model))


def magnitude_scores(model: nnx.Module, groups) -> dict:
    """Weight-magnitude scores per unit: :func:`lowrank_jax.interop.channel_groups.magnitude_scores`."""
    groups = list(groups)
    _check_alias_groups(model, groups)
    return _groups.magnitude_scores(param_tree(model), groups, in_dims=_in_dims(model))


def gradient_scores(loss_fn: Callable[[nnx.Module, Any], Any], model: nnx.Module, groups,
                    batches, **kwargs) -> dict:
    """"Less is More" eq. 6 per unit through ``loss_fn(model, batch) -> loss`` on the unchanged
    model class (rebuilt with ``nnx.merge`` from the masked parameters; every other variable
    as the model holds it): :func:`lowrank_jax.interop.channel_groups.gradient_scores`."""
    groups = list(groups)
    _check_alias_groups(model, groups)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def tree_loss(tree, batch):
        p = jax.tree_util.tree_map(lambda a: a, params)  # a fresh State for this trace
        nnx.replace_by_pure_dict(p, tree)
        return loss_fn(nnx.merge(graphdef, p, rest), batch)

    return _groups.gradient_scores(tree_loss, nnx.to_pure_dict(params), groups, batches,
                                  in_dims=_in_dims(model), **kwargs)


def prune(model: nnx.Module, groups, *, target: float, scores: Any = "magnitude",
          scope: str = "group") -> tuple[nnx.Module, Any]:
    """Structured pruning of an nnx model by channel groups; the model itself is not modified
    (:func:`lowrank_jax.interop.channel_groups.prune_tree`; the grouped layers become
    :class:`LeafLinear` / :class:`LeafLinearGeneral` on full-width
    :class:`~lowrank_jax.leaves.ChannelPruned` leaves, so ``nnx.MultiHeadAttention`` keeps its
    ``num_heads`` and the model class its code).

    Args:
      model: any ``nnx.Module`` with plain ``nnx.Linear`` / ``nnx.LinearGeneral`` layers.
      groups: :class:`~lowrank_jax.interop.channel_groups.ChannelGroup` s over the state paths
        (``'blocks/0/mlp/0/kernel'``), or :func:`infer_groups`.
      target, scores, scope: as :func:`lowrank_jax.interop.channel_groups.prune_tree`.

    A tied layer is pruned under every name it has (each call site runs the kept channels);
    groups name it by its state path.

    Returns:
      ``(new_model, report)``.
    """
    groups = list(groups)
    _check_alias_groups(model, groups)
    tree, report = _groups.prune_tree(param_tree(model), groups, target=target, scores=scores,
                                     scope=scope, in_dims=_in_dims(model))
    return _replace(model, tree), report


__all__ = ["LeafLinear", "LeafLinearGeneral", "compress", "gradient_scores", "infer_groups",
           "magnitude_scores", "materialize", "param_tree", "prune", "with_leaves"]
