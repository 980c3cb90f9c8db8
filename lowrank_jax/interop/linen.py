"""Flax linen: leaves inside modules, and a user's unchanged model run on compressed params.

* :class:`LeafDense` / :class:`LeafDenseGeneral`: drop-in ``nn.Dense`` / ``nn.DenseGeneral``
  whose ``'kernel'`` parameter is any lowrank_jax leaf (bias inside) and whose call is
  :func:`lowrank_jax.linear`. Their parameter tree is exactly what :func:`compress` makes of
  ``nn.Dense`` / ``nn.DenseGeneral`` parameters, so a model can be written with them or keep
  its ``nn.Dense`` and run through :func:`intercept`.
* :func:`compress`: a plan over Flax's own paths (``'params/.../Dense_0/kernel'``).
* :func:`intercept` / :func:`apply`: ``nn.intercept_methods`` replaces ``nn.Dense.__call__`` and
  ``nn.DenseGeneral.__call__`` (and so the projections inside ``nn.MultiHeadDotProductAttention``)
  by the leaf's ``linear`` wherever the module's kernel is a leaf; every other module runs its
  own code.
* :func:`materialize`: plain Flax ``kernel`` / ``bias`` arrays the original model accepts.
* :func:`prune`: structured pruning by channel groups over Flax paths (MLP hidden channels,
  attention heads; :mod:`lowrank_jax.interop.channel_groups`), scored by weight magnitude or by
  :func:`gradient_scores` through the user's loss.

A submodule called more than once (one ``nn.Dense`` instance reused, or one submodule under two
attribute names) has one parameter entry, so a plan compresses it once and every call runs the
leaf; the counts hold it once, in parameters and FLOPs, however often the model calls it.

Kernels stacked by ``nn.scan`` (a leading layer axis): ``compress(..., stacked=('params/
ScanLayer_0',))`` compresses every layer (:func:`lowrank_jax.interop.kernels.unstack`) and
stacks the leaves again, which ``nn.scan`` slices per layer. Not covered: ``nn.Conv``,
``nn.Einsum`` and ``DenseGeneral(batch_dims=...)`` -- a leaf there is an error naming the path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.errors import ConfigError, ShapeError
from lowrank_jax.interop import channel_groups as _groups
from lowrank_jax.interop.kernels import (
    KERNEL,
    SHAPE,
    KernelShape,
    LeafInit,
    _cast_operands,
    compress_tree,
    contract,
    materialize_tree,
)
from lowrank_jax.leaves import Dense, Leaf, is_leaf, linear


def _where(module: nn.Module) -> str:
    return "/".join(("params",) + tuple(module.path) + (KERNEL,))


def _check_features(where: str, leaf: Leaf, features: tuple[int, ...]) -> None:
    d_out = 1
    for f in features:
        d_out *= f
    if leaf.d_out != d_out:
        raise ShapeError(f"{where}: the leaf has {leaf.d_out} outputs but the module has features "
                         f"{features}", where=where, expected=d_out, actual=leaf.d_out)


def _default_leaf(kernel_init, bias_init, param_dtype) -> LeafInit:
    def init(key, d_in, d_out, use_bias):
        kk, kb = jax.random.split(key)
        b = bias_init(kb, (d_out,), param_dtype) if use_bias else None
        return Dense(w=kernel_init(kk, (d_in, d_out), param_dtype), b=b)

    return init


class LeafDense(nn.Module):
    """``nn.Dense`` whose ``'kernel'`` is a lowrank_jax leaf (the bias lives in the leaf).

    Attributes:
      features: output width.
      use_bias: whether the initial leaf has a bias.
      leaf_init: ``(key, d_in, d_out, use_bias) -> Leaf``, e.g. a low-rank-by-design
        ``lambda k, i, o, b: lj.init_lowrank(k, i, o, 8, bias=b)``; default a :class:`Dense`
        leaf from ``kernel_init`` / ``bias_init`` (``nn.Dense``'s defaults).
      dtype: computation dtype (``None``: the operands' own).
    """

    features: int
    use_bias: bool = True
    leaf_init: LeafInit | None = None
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    param_dtype: Any = jnp.float32
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., d_in] -> [..., features]
        init = self.leaf_init or _default_leaf(self.kernel_init, self.bias_init, self.param_dtype)
        leaf = _param(self, KERNEL, lambda key: init(key, x.shape[-1], self.features,
                                                     self.use_bias))
        _check_features(_where(self), leaf, (self.features,))
        leaf, x = _cast_operands(leaf, x, self.dtype)
        return linear(leaf, x)


class LeafDenseGeneral(nn.Module):
    """``nn.DenseGeneral`` (``batch_dims=()``) whose ``'kernel'`` is a 2-D leaf
    ``[prod(in_shape), prod(features)]`` beside a ``'kernel_shape'``
    (:class:`~lowrank_jax.interop.KernelShape`): an attention projection over heads
    (``features=(heads, head_dim)``, or ``axis=(-2, -1)`` for the output projection).
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    use_bias: bool = True
    leaf_init: LeafInit | None = None
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    param_dtype: Any = jnp.float32
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = _tuple(self.features)
        axis = _tuple(self.axis)
        in_shape = tuple(x.shape[a] for a in axis)
        shape = KernelShape(in_shape, features)
        init = self.leaf_init or _default_leaf(self.kernel_init, self.bias_init, self.param_dtype)
        leaf = _param(self, KERNEL, lambda key: init(key, *shape.matrix, self.use_bias))
        stored = _param(self, SHAPE, lambda key: shape)
        if stored != shape:
            where = _where(self)
            raise ShapeError(f"{where}: the stored kernel_shape {stored} does not match this call "
                             f"({shape})", where=where, expected=shape, actual=stored)
        leaf, x = _cast_operands(leaf, x, self.dtype)
        return contract(leaf, x, axis, features, _where(self))


def _param(module: nn.Module, name: str, init: Callable) -> Any:
    """The stored parameter if there is one (any leaf type: ``self.param`` would compare its
    arrays with a fresh ``Dense`` init's), else a new one."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, init)


def _tuple(v) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, Sequence) else (v,)


def _interceptor(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not module.has_variable("params", KERNEL):
        return next_fun(*args, **kwargs)
    leaf = module.get_variable("params", KERNEL)
    if not is_leaf(leaf):
        return next_fun(*args, **kwargs)
    where = _where(module)
    if isinstance(module, (LeafDense, LeafDenseGeneral)):
        return next_fun(*args, **kwargs)
    if len(args) != 1 or kwargs:
        raise ConfigError(f"{where}: a leaf kernel runs a layer called with one input, got "
                          f"{len(args)} positional and {sorted(kwargs)} keyword arguments",
                          where=where, expected="module(x)", actual=len(args))
    x = args[0]
    if isinstance(module, nn.Dense):
        _check_features(where, leaf, (module.features,))
        leaf, x = _cast_operands(leaf, x, module.dtype)
        if x.shape[-1] != leaf.d_in:
            raise ShapeError(f"{where}: the leaf expects inputs of width {leaf.d_in}, got input "
                             f"{tuple(x.shape)}", where=where, expected=leaf.d_in,
                             actual=tuple(x.shape))
        return linear(leaf, x)
    if isinstance(module, nn.DenseGeneral):
        if tuple(module.batch_dims):
            raise ConfigError(f"{where}: DenseGeneral with batch_dims={module.batch_dims} is not "
                              "supported with a leaf kernel", where=where, expected="()",
                              actual=module.batch_dims)
        leaf, x = _cast_operands(leaf, x, module.dtype)
        return contract(leaf, x, _tuple(module.axis), _tuple(module.features), where)
    raise ConfigError(f"{where}: {type(module).__name__} has a lowrank_jax leaf as its kernel; only "
                      "nn.Dense and nn.DenseGeneral (batch_dims=()) run on leaves -- leave this "
                      "path out of the plan's rules", where=where,
                      expected="nn.Dense or nn.DenseGeneral", actual=type(module).__name__)


@contextlib.contextmanager
def intercept():
    """Context in which ``nn.Dense`` / ``nn.DenseGeneral`` run on their leaf kernels.

    Trace (``jax.jit``) inside it: the leaves are pytrees, so a function traced here on
    compressed parameters keeps running on the factors when called again.
    """
    with nn.intercept_methods(_interceptor):
        yield


def apply(model: nn.Module, variables: Any, *args, **kwargs) -> Any:
    """``model.apply(variables, *args, **kwargs)`` with the leaves intercepted
    (:func:`intercept`); jit-able. The model's code is not changed."""
    with intercept():
        return model.apply(variables, *args, **kwargs)


def compress(variables: Any, plan: Any, **kwargs) -> tuple[dict, Any]:
    """Apply a compression plan to linen variables by rules over Flax's paths.

    Args:
      variables: ``model.init(...)`` output, ``{'params': {...}, ...}``.
      plan: a :class:`~lowrank_jax.Plan` (or step / list / dict); rules match kernel paths
        such as ``'params/Encoder_0/encoderblock_0/MlpBlock_0/Dense_0/kernel'`` and
        ``'.../MultiHeadDotProductAttention_0/query/kernel'``.
      **kwargs: ``in_dims``, ``keep_flax_unchanged``, ``stacked`` (modules stacked by
        ``nn.scan``; see
        :func:`lowrank_jax.interop.kernels.compress_tree`) and :func:`~lowrank_jax.apply_plan`'s
        keywords.

    Returns:
      ``(new_variables, report)``; run the unchanged model with :func:`apply`.
    """
    return compress_tree(variables, plan, **kwargs)


def materialize(variables: Any, *, stacked=None) -> dict:
    """Plain Flax variables (every leaf densified with :func:`lowrank_jax.materialize`) that the
    original model runs with ``model.apply``; ``stacked``: the ``nn.scan`` stacks given to
    :func:`compress`."""
    return materialize_tree(variables, stacked=stacked)


def call_order(model: nn.Module, variables: Any, *args, **kwargs) -> list[str]:
    """Kernel paths of the ``nn.Dense`` / ``nn.DenseGeneral`` layers in the order ``model``
    calls them, from an abstract call (``jax.eval_shape``: nothing is computed)."""
    order: list[str] = []

    def record(next_fun, a, kw, context):
        m = context.module
        if context.method_name == "__call__" and isinstance(m, (nn.Dense, nn.DenseGeneral)):
            where = _where(m)
            if where not in order:
                order.append(where)
        return next_fun(*a, **kw)

    def run(v, *a):
        with nn.intercept_methods(record):
            return model.apply(v, *a, **kwargs)

    jax.eval_shape(run, variables, *args)
    return order


def infer_groups(variables: Any, model: nn.Module | None = None, *args, **kwargs) -> list:
    """Channel groups of the common patterns of ``variables`` (attention heads of
    ``nn.MultiHeadDotProductAttention``, two-layer MLPs):
    :func:`lowrank_jax.interop.channel_groups.infer_groups`. With ``model`` and its inputs
    (``infer_groups(variables, model, x)``), which MLP layer comes first is read from the
    order the model calls them (:func:`call_order`) instead of from their widths. Check what
    it returns."""
    order = None if model is None else call_order(model, variables, *args, **kwargs)
    return _groups.infer_groups(variables, call_order=order)


def magnitude_scores(variables: Any, groups, **kwargs) -> dict:
    """Weight-magnitude scores per unit: :func:`lowrank_jax.interop.channel_groups.magnitude_scores`."""
    return _groups.magnitude_scores(variables, groups, **kwargs)


def gradient_scores(loss_fn: Callable[[Any, Any], Any], variables: Any, groups, batches,
                    **kwargs) -> dict:
    """"Less is More" eq. 6 per unit through ``loss_fn(variables, batch) -> loss``, which runs
    the unchanged model (``model.apply``) on plain arrays:
    :func:`lowrank_jax.interop.channel_groups.gradient_scores`."""
    return _groups.gradient_scores(loss_fn, variables, groups, batches, **kwargs)


def prune(variables: Any, groups, *, target: float, scores: Any = "magnitude",
          scope: str = "group", in_dims=None) -> tuple[dict, Any]:
    """Structured pruning of linen variables by channel groups
    (:func:`lowrank_jax.interop.channel_groups.prune_tree`, whose module docstring says how removed
    channels run in the unchanged model: full-width
    :class:`~lowrank_jax.leaves.ChannelPruned` leaves, because ``nn.Dense(features=...)``
    rejects a narrower plain kernel).

    Args:
      variables: ``model.init(...)`` output with plain kernels.
      groups: :class:`~lowrank_jax.interop.channel_groups.ChannelGroup` s (or :func:`infer_groups`).
      target: fraction of the grouped kernels' parameters to remove.
      scores: ``'magnitude'`` or :func:`gradient_scores`'s dict.
      scope: ``'group'`` (each group loses ``target`` of its units) or ``'global'``.
      in_dims: ``{regex: n}`` for kernels over heads without a bias.

    Returns:
      ``(new_variables, report)``; run them with :func:`apply`, compress them further with
      :func:`compress`.
    """
    return _groups.prune_tree(variables, groups, target=target, scores=scores, scope=scope,
                             in_dims=in_dims)


__all__ = ["LeafDense", "LeafDenseGeneral", "apply", "call_order", "compress", "gradient_scores",
           "infer_groups", "intercept", "magnitude_scores", "materialize", "prune"]
