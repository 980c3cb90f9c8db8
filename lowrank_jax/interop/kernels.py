"""Flax parameter dicts <-> lowrank_jax leaves: the part shared by linen and nnx.

A Flax linear layer stores ``{'kernel': [*in_shape, *out_shape], 'bias': [*out_shape]}``
(``nn.Dense``: ``in_shape = (d_in,)``, ``out_shape = (d_out,)``; ``nn.DenseGeneral`` /
``nnx.LinearGeneral`` over heads: ``[d, heads, head_dim]`` for a query projection,
``[heads, head_dim, d]`` for the output projection). :func:`to_leaves` turns the selected
layers' dicts into ``{'kernel': Dense(w [prod(in), prod(out)], b [prod(out)])}`` -- one leaf
holding the bias, as lowrank_jax's own trees do -- plus, for kernels of more than two
dimensions, a sibling ``'kernel_shape'``: a :class:`KernelShape` node with no arrays (like
:class:`~lowrank_jax.HeadLayout`) that records how the matrix folds back. Paths stay Flax's
own: ``'params/Encoder_0/block0/MlpBlock_0/Dense_0/kernel'``.

:func:`compress_tree` applies a :class:`~lowrank_jax.Plan` to such a tree with the library's
:func:`~lowrank_jax.apply_plan` (so counts, reports, every registered method work unchanged);
:func:`materialize_tree` folds every leaf back into plain Flax ``kernel`` / ``bias`` arrays.
Traversal uses :mod:`flax.traverse_util` (``flatten_dict`` / ``unflatten_dict``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.core import unfreeze

from lowrank_jax.compress import Plan, Report, apply_plan, as_plan, normalize_rules, validate_plan
from lowrank_jax.errors import ConfigError, PlanError, ShapeError
from lowrank_jax.leaves import (
    Dense,
    Leaf,
    get_path,
    is_dense,
    is_leaf,
    kept_outputs,
    leaf_dataclass,
    materialize,
)

KERNEL = "kernel"
BIAS = "bias"
SHAPE = "kernel_shape"


class KernelShape:
    """How a 2-D leaf folds back into a Flax kernel of more than two dimensions.

    A pytree node with no array children (nothing for ``jax.grad``, optax or the counts to
    see), saved by :func:`lowrank_jax.io.save_params` like :class:`~lowrank_jax.HeadLayout`.

    Fields:
      in_shape: the kernel's contracted (input) dimensions, e.g. ``(d,)`` for a query
        projection, ``(heads, head_dim)`` for an output projection.
      out_shape: its output dimensions (the bias has this shape).
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def __post_init__(self):
        for name in ("in_shape", "out_shape"):
            v = getattr(self, name)
            if not isinstance(v, (tuple, list)) or not v or any(
                    isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in v):
                raise ShapeError(f"KernelShape: {name} must be a non-empty tuple of positive ints, "
                                 f"got {v!r}", where=name, expected="tuple of ints >= 1", actual=v)
            object.__setattr__(self, name, tuple(int(d) for d in v))

    def __eq__(self, other):  # no arrays: equal by value (leaf_dataclass sets eq=False)
        return type(other) is type(self) and (self.in_shape, self.out_shape) == (
            other.in_shape, other.out_shape)

    def __hash__(self):
        return hash((self.in_shape, self.out_shape))

    @property
    def matrix(self) -> tuple[int, int]:
        """``(d_in, d_out)`` of the 2-D leaf."""
        return math.prod(self.in_shape), math.prod(self.out_shape)


KernelShape = leaf_dataclass(KernelShape, meta=("in_shape", "out_shape"))


def _join(key: tuple) -> str:
    return "/".join(str(k) for k in key)


def flat_dict(tree: Any) -> dict[tuple, Any]:
    """``traverse_util.flatten_dict`` of a (possibly frozen) Flax variable dict; leaves and
    :class:`KernelShape` nodes are values, not dicts."""
    if not isinstance(tree, Mapping):
        raise ConfigError(f"expected a Flax variable dict ({{'params': {{...}}}}), got "
                          f"{type(tree).__name__}", where="params", expected="dict",
                          actual=type(tree).__name__)
    return traverse_util.flatten_dict(unfreeze(tree))


def kernel_paths(tree: Any) -> dict[str, tuple]:
    """``{'a/b/kernel': ('a', 'b')}`` for every linear-layer kernel of a Flax variable dict: an
    array named ``kernel`` with at least two dimensions, or a leaf there already."""
    out = {}
    for key, v in flat_dict(tree).items():
        if key[-1] == KERNEL and (is_leaf(v) or np.ndim(v) >= 2):
            out[_join(key)] = key[:-1]
    return out


def selected_kernels(tree: Any, plan: Plan) -> list[str]:
    """Kernel paths some step of ``plan`` selects (its winning rule is not a skip rule).

    Raises:
      PlanError: a rule matches no kernel of the tree; the message names the rule and lists
        the Flax kernel paths.
    """
    paths = list(kernel_paths(tree))
    chosen = set()
    for i, step in enumerate(plan.steps):
        rules = normalize_rules(step.rules, where=f"step {i} ({step.method})")
        for rule in rules:
            if not any(rule.regex.search(p) for p in paths):
                raise PlanError(
                    f"step {i} ({step.method}): rule {rule.pattern!r} matches no Flax kernel; "
                    f"kernels: {paths[:16]}{' ...' if len(paths) > 16 else ''}",
                    where=rule.pattern, expected="a rule matching some kernel path",
                    actual=paths[:16])
        for p in paths:
            winner = next((r for r in rules if r.regex.search(p)), None)
            if winner is not None and winner.action is not None:
                chosen.add(p)
    return [p for p in paths if p in chosen]


def _in_ndim(path: str, kernel, bias, in_dims: Mapping[str, int] | None) -> int:
    """How many leading kernel dimensions are contracted (the input side)."""
    for pattern, n in (in_dims or {}).items():
        if re.search(pattern, path):
            if not isinstance(n, int) or not 1 <= n < np.ndim(kernel):
                raise ConfigError(f"{path}: in_dims {pattern!r} -> {n!r} must be an int in "
                                  f"[1, {np.ndim(kernel) - 1}] for a kernel of shape "
                                  f"{tuple(np.shape(kernel))}", where=path,
                                  expected=f"int in [1, {np.ndim(kernel) - 1}]", actual=n)
            return n
    if bias is not None:
        bshape, kshape = tuple(np.shape(bias)), tuple(np.shape(kernel))
        if (len(bshape) >= 2 and len(kshape) > len(bshape) and kshape[0] == bshape[0]
                and kshape[-(len(bshape) - 1):] == bshape[1:]) and kshape[-len(bshape):] != bshape:
            raise ShapeError(f"{path}: kernel {kshape} and bias {bshape} share a leading axis of "
                             f"{kshape[0]}: a stack of layers made by nn.scan / nn.vmap; pass "
                             "stacked=('<path of the scanned module>',), e.g. "
                             "stacked=('params/ScanLayer_0',), to compress every layer of it",
                             where=path, expected=f"bias shape ending {kshape[-1:]}",
                             actual=bshape)
        if not bshape or len(bshape) >= len(kshape) or kshape[-len(bshape):] != bshape:
            raise ShapeError(f"{path}: the bias {bshape} is not the trailing (output) part of the "
                             f"kernel {kshape}; a Flax linear layer stores kernel "
                             "[*in_shape, *out_shape] and bias [*out_shape]", where=path,
                             expected=f"bias shape ending {kshape[-1:]}", actual=bshape)
        return len(kshape) - len(bshape)
    if np.ndim(kernel) == 2:
        return 1
    raise ConfigError(f"{path}: a kernel of shape {tuple(np.shape(kernel))} without a bias does "
                      "not say which dimensions are its inputs; pass in_dims={regex: n} (n leading "
                      "dimensions contracted), e.g. {'attention/out/': 2}", where=path,
                      expected="in_dims for this path", actual=None)


def to_leaves(tree: Any, paths, *, in_dims: Mapping[str, int] | None = None) -> dict:
    """The Flax variable dict with the kernels at ``paths`` turned into :class:`Dense` leaves.

    Args:
      tree: a Flax variable dict (``{'params': {...}}``, or an nnx state as a pure dict).
      paths: kernel paths (``'params/Dense_0/kernel'``) to convert.
      in_dims: ``{regex: n}``: the kernels whose path matches have ``n`` input dimensions
        (needed only for kernels of more than two dimensions without a bias).

    Returns:
      A new dict: at each path ``{'kernel': Dense(w, b)}`` (+ ``'kernel_shape'`` for kernels of
      more than two dimensions); the ``'bias'`` entry is folded into the leaf.
    """
    flat = flat_dict(tree)
    keys = {_join(k): k for k in flat}  # nnx paths hold int keys (list indices)
    for path in paths:
        key = keys.get(path, tuple(path.split("/")))
        kernel = flat.get(key)
        if kernel is None:
            raise PlanError(f"{path}: no kernel at this Flax path", where=path,
                            expected="a kernel path", actual=None)
        if is_leaf(kernel):
            continue
        prefix = key[:-1]
        bias = flat.pop(prefix + (BIAS,), None)
        n = _in_ndim(path, kernel, bias, in_dims)
        shape = KernelShape(tuple(np.shape(kernel))[:n], tuple(np.shape(kernel))[n:])
        d_in, d_out = shape.matrix
        kernel = jnp.asarray(kernel)
        flat[key] = Dense(w=kernel.reshape(d_in, d_out),
                          b=None if bias is None else jnp.asarray(bias).reshape(d_out))
        if np.ndim(kernel) > 2:
            flat[prefix + (SHAPE,)] = shape
    return traverse_util.unflatten_dict(flat)


# one compiled program per leaf type and shape: op by op, a binary leaf's top-k mask alone
# dispatches dozens of small programs
dense_matrix = jax.jit(materialize)


def _fold(path: str, leaf: Leaf, shape: KernelShape | None) -> tuple[Any, Any]:
    w, b = dense_matrix(leaf), leaf.bias
    if shape is None:
        return w, b
    if tuple(leaf.shape) != shape.matrix:
        raise ShapeError(f"{path}: leaf of shape {tuple(leaf.shape)} does not fold into the kernel "
                         f"{shape.in_shape + shape.out_shape}", where=path,
                         expected=shape.matrix, actual=tuple(leaf.shape))
    return (w.reshape(shape.in_shape + shape.out_shape),
            None if b is None else b.reshape(shape.out_shape))


def _stack_keys(flat: dict, stacked, where: str) -> list[tuple]:
    prefixes = []
    for p in stacked or ():
        key = tuple(p.split("/")) if isinstance(p, str) else tuple(p)
        if not any(k[:len(key)] == key and len(k) > len(key) for k in flat):
            mods = sorted({_join(k[:2]) for k in flat})[:12]
            raise ConfigError(f"{where}: stacked prefix {p!r} names no module of the tree; "
                              f"modules: {mods}", where=str(p), expected="a module path",
                              actual=p)
        prefixes.append(key)
    return prefixes


def unstack(tree: Any, stacked) -> dict:
    """The layers of ``nn.scan`` / ``nn.vmap`` stacks as separate subtrees.

    ``nn.scan(..., variable_axes={'params': 0})`` stores every parameter of the scanned module
    with a leading layer axis: ``'params/ScanLayer_0/Dense_0/kernel'`` is ``[L, d_in, d_out]``.
    Here every node under a stacked prefix (plain arrays, and leaves whose arrays all carry the
    layer axis) becomes ``L`` nodes at ``'<prefix>/0/...'``, ..., ``'<prefix>/<L-1>/...'``: the
    per-layer tree a plan, the counts and :func:`materialize_tree` work on. :func:`restack`
    is the inverse.

    Args:
      tree: a Flax variable dict.
      stacked: paths of the scanned modules (``('params/ScanLayer_0',)``), layer axis 0.

    Raises:
      ConfigError: a prefix that names no module.
      ShapeError: arrays under a prefix without one common leading axis (naming the path).
    """
    flat = flat_dict(tree)
    for pre in _stack_keys(flat, stacked, "unstack"):
        inner = {k: v for k, v in flat.items() if k[:len(pre)] == pre}
        n = None
        for k, v in inner.items():
            for a in jax.tree_util.tree_leaves(v):
                if n is None:
                    n, first = np.shape(a)[0] if np.ndim(a) else None, k
                if not np.ndim(a) or np.shape(a)[0] != n:
                    raise ShapeError(f"{_join(k)}: under the stacked module {_join(pre)} every "
                                     f"array has the layer axis first, of length {n} as at "
                                     f"{_join(first)}; got shape {np.shape(a)}", where=_join(k),
                                     expected=n, actual=np.shape(a))
        for k, v in inner.items():
            del flat[k]
            for i in range(n):
                flat[pre + (i,) + k[len(pre):]] = jax.tree_util.tree_map(lambda a, i=i: a[i], v)
    return traverse_util.unflatten_dict(flat)


def restack(tree: Any, stacked) -> dict:
    """The inverse of :func:`unstack`: the layers under each stacked prefix joined again along
    a leading axis (plain arrays, and leaves of one type and shape in every layer, which
    ``nn.scan`` slices back into per-layer leaves inside the scanned module).

    Raises:
      ShapeError: the layers were not compressed alike -- a kernel that is a leaf in some
        layers only, or leaves of different types, ranks or shapes (``eps`` and ``ratio``
        choose a rank per layer; a stack needs a fixed ``rank``). The message names the first
        differing path and the per-layer types and shapes.
    """
    flat = flat_dict(tree)
    for pre in _stack_keys(flat, stacked, "restack"):
        layers: dict[int, dict] = {}
        for k in [k for k in flat if k[:len(pre)] == pre]:
            if len(k) <= len(pre) + 1 or not isinstance(k[len(pre)], (int, np.integer)):
                raise ConfigError(f"{_join(k)}: not a layer of the unstacked module "
                                  f"{_join(pre)}", where=_join(k), expected=f"{_join(pre)}/<i>/...",
                                  actual=_join(k))
            layers.setdefault(int(k[len(pre)]), {})[k[len(pre) + 1:]] = flat.pop(k)
        n = len(layers)
        if sorted(layers) != list(range(n)):
            raise ShapeError(f"{_join(pre)}: layers {sorted(layers)} are not 0..{n - 1}",
                             where=_join(pre), expected=list(range(n)), actual=sorted(layers))
        rests = list(layers[0])
        for i in range(n):
            if set(layers[i]) != set(rests):
                diff = sorted(set(layers[i]) ^ set(rests), key=str)[0]
                raise ShapeError(
                    f"{_join(pre + (i,) + diff)}: the layers of the stack {_join(pre)} were not "
                    "compressed alike (a rule selected some layers only); nn.scan runs one "
                    rf"module on every layer: select all of them (e.g. {_join(pre)}/\d+/...)",
                    where=_join(pre + (i,) + diff), expected=sorted(map(_join, rests))[:8],
                    actual=sorted(map(_join, layers[i]))[:8])
        for rest in rests:
            nodes = [layers[i][rest] for i in range(n)]
            sig = [(jax.tree_util.tree_structure(v),
                    [np.shape(a) for a in jax.tree_util.tree_leaves(v)]) for v in nodes]
            bad = next((i for i in range(n) if not (sig[i][0] == sig[0][0] and
                                                   sig[i][1] == sig[0][1])), None)
            if bad is not None:
                where = _join(pre + (bad,) + rest)
                kinds = [f"{type(v).__name__} {s[1]}"
                         for v, s in zip(nodes, sig, strict=True)]
                raise ShapeError(
                    f"{where}: the layers of the stack {_join(pre)} differ here ({kinds[:4]}); "
                    "nn.scan needs one type and shape per layer: compress a stack with a fixed "
                    "rank (rank=, not eps or ratio, which choose ranks per layer)", where=where,
                    expected=kinds[0], actual=kinds[bad])
            flat[pre + rest] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *nodes)
    return traverse_util.unflatten_dict(flat)


def materialize_tree(tree: Any, *, only_dense: bool = False, stacked=None) -> dict:
    """Every leaf of a Flax variable dict folded back into plain ``kernel`` / ``bias`` arrays
    (through :func:`lowrank_jax.materialize`, the only way the library densifies).

    Args:
      tree: a dict from :func:`to_leaves` / :func:`compress_tree`.
      only_dense: fold only plain :class:`Dense` leaves (those a plan left unchanged) and keep
        compressed ones.
      stacked: paths of ``nn.scan`` stacks (:func:`unstack`).
    """
    if stacked:
        return restack(materialize_tree(unstack(tree, stacked), only_dense=only_dense), stacked)
    flat = flat_dict(tree)
    out = {}
    for key, v in flat.items():
        if key[-1] == SHAPE and isinstance(v, KernelShape):
            leaf = flat.get(key[:-1] + (KERNEL,))
            if is_leaf(leaf) and (not only_dense or is_dense(leaf)):
                continue
            out[key] = v
        elif is_leaf(v) and (not only_dense or is_dense(v)):
            shape = flat.get(key[:-1] + (SHAPE,))
            w, b = _fold(_join(key), v, shape if isinstance(shape, KernelShape) else None)
            out[key] = w
            if b is not None:
                out[key[:-1] + (BIAS,)] = b
        else:
            out[key] = v
    return traverse_util.unflatten_dict(out)


def head_widths(tree: Any, path: str) -> tuple[int, ...] | None:
    """Per-head output widths of the leaf at a Flax kernel path, from its ``kernel_shape``.

    A kernel over heads (``nn.DenseGeneral`` / ``nnx.LinearGeneral`` query, key, value:
    ``[d, heads, head_dim]``) has ``out_shape = (heads, head_dim)``: ``heads`` outputs of width
    ``head_dim`` each. Kernels with one output dimension (``nn.Dense``, the output projection
    ``[heads, head_dim, d]``, whose *inputs* are heads) have none. For a leaf whose removed
    output channels are gone (:class:`~lowrank_jax.leaves.ChannelPruned`, after ``prune``), the
    widths of the kept outputs per head (heads with none kept left out). The ``svd`` method's
    ``per_head`` reads this through :func:`lowrank_jax.apply_plan`'s ``head_widths``.
    """
    parts = path.split("/")
    if parts[-1] != KERNEL:
        return None
    try:
        shape = get_path(tree, "/".join(parts[:-1] + [SHAPE]))
        leaf = get_path(tree, path)
    except (KeyError, ValueError, IndexError, AttributeError, TypeError):
        return None
    if not isinstance(shape, KernelShape) or len(shape.out_shape) < 2:
        return None
    heads, width = shape.out_shape[0], math.prod(shape.out_shape[1:])
    cols = kept_outputs(leaf)
    if cols is not None:
        kept = np.bincount(np.asarray(cols) // width, minlength=heads)
        return tuple(int(k) for k in kept if k)
    return (width,) * heads


def compress_tree(tree: Any, plan: Any, *, in_dims: Mapping[str, int] | None = None,
                  keep_flax_unchanged: bool = True, stacked=None,
                  **kwargs) -> tuple[dict, Report]:
    """Apply a plan to a Flax variable dict by path rules over Flax's own paths.

    The kernels some step selects become leaves (:func:`to_leaves`), then
    :func:`lowrank_jax.apply_plan` runs as on any lowrank_jax tree (same methods, rows, counts).

    Args:
      tree: a Flax variable dict (linen ``{'params': {...}}``).
      plan: a :class:`~lowrank_jax.Plan`, a step, a list of steps or a plan dict; rules match
        kernel paths such as ``'params/Encoder_0/block0/MlpBlock_0/Dense_0/kernel'``.
      in_dims: see :func:`to_leaves`.
      keep_flax_unchanged: layers a plan left dense go back to plain Flax ``kernel`` / ``bias``.
      stacked: paths of modules stacked by ``nn.scan`` / ``nn.vmap`` (``('params/ScanLayer_0',)``,
        layer axis 0): the plan sees one subtree per layer (:func:`unstack`; rules and report
        rows at ``'params/ScanLayer_0/3/Dense_0/kernel'``, rank schedules by layer index) and
        the result is stacked again (:func:`restack`: every layer must come out with the same
        leaf type and shapes, e.g. a fixed ``rank``), which ``nn.scan`` slices back into
        per-layer leaves when the unchanged model runs.
      **kwargs: passed to :func:`~lowrank_jax.apply_plan` (``key``, ``inputs``, ...).

    ``svd`` with ``per_head=True`` truncates every head of a kernel over heads separately
    (:func:`head_widths`; a :class:`~lowrank_jax.HeadLowRank` leaf, seed 000 eq. 20); other
    kernels get the shared factorization, as in the library's own trees.

    Returns:
      ``(new_tree, report)``.

    Raises:
      PlanError: a rule matching no kernel (naming the rule, listing the kernel paths), or
        anything :func:`~lowrank_jax.apply_plan` raises.
      ShapeError / ConfigError: a kernel whose bias does not fit, or whose input dimensions
        cannot be told (naming the Flax path).
    """
    plan = as_plan(plan)
    validate_plan(plan)
    for i, step in enumerate(plan.steps):
        if step.method == "prune" and "target" in step.settings:
            raise PlanError(f"step {i} (prune): a target on a Flax tree needs to know which "
                            "kernels share channels, which a Flax model does not declare: use "
                            "lowrank_jax.interop.linen.prune / nnx.prune with channel groups "
                            "(interop.ChannelGroup, infer_groups), or mask_tree and then a "
                            "plan whose prune step has no target", where="target",
                            expected="interop.*.prune(tree, groups, target=...)",
                            actual=step.settings["target"])
    if stacked:
        tree = unstack(tree, stacked)
    leaves = to_leaves(tree, selected_kernels(tree, plan), in_dims=in_dims)
    new, report = apply_plan(leaves, plan, head_widths=head_widths, **kwargs)
    if keep_flax_unchanged:
        new = materialize_tree(new, only_dense=True)
    if stacked:
        new = restack(new, stacked)
    return new, report


def contract(leaf: Leaf, x: jax.Array, axis: tuple[int, ...], out_shape: tuple[int, ...],
             where: str) -> jax.Array:
    """``DenseGeneral`` through the leaf: contract ``x``'s ``axis`` dimensions (in that order)
    with the leaf's inputs and unfold its outputs to ``out_shape``.

    ``x: [..., *in_shape]`` (contracted axes anywhere) -> ``[*free axes of x, *out_shape]``, the
    order ``jax.lax.dot_general`` gives, so it equals ``nn.DenseGeneral`` on the materialized
    kernel.
    """
    from lowrank_jax.leaves import linear

    axis = tuple(a % x.ndim for a in axis)
    free = tuple(a for a in range(x.ndim) if a not in axis)
    in_shape = tuple(x.shape[a] for a in axis)
    d_in, d_out = leaf.shape
    if math.prod(in_shape) != d_in or math.prod(out_shape) != d_out:
        raise ShapeError(f"{where}: the leaf is [{d_in}, {d_out}] but the layer contracts inputs "
                         f"{in_shape} into features {out_shape} (input shape {tuple(x.shape)})",
                         where=where, expected=(math.prod(in_shape), math.prod(out_shape)),
                         actual=(d_in, d_out))
    xt = jnp.transpose(x, free + axis).reshape(tuple(x.shape[a] for a in free) + (d_in,))
    y = linear(leaf, xt)
    return y.reshape(tuple(x.shape[a] for a in free) + tuple(out_shape))


def leaf_mask(tree: Any) -> Any:
    """Bool tree: the leaves' own trainable children ``True``, every plain array (norm scales,
    embeddings, layers left dense) ``False``: to train only the factors."""
    from lowrank_jax.leaves import is_leaf

    return jax.tree_util.tree_map(lambda n: n.trainable() if is_leaf(n) else False, tree,
                                  is_leaf=is_leaf)


LeafInit = Callable[[jax.Array, int, int, bool], Leaf]
"""``leaf_init(key, d_in, d_out, bias) -> leaf`` of the linen and nnx layers."""


def _cast_operands(leaf: Leaf, x: jax.Array, dtype) -> tuple[Leaf, jax.Array]:
    """Both operands of a layer in ``dtype`` (Flax's ``promote_dtype``; the leaf's floating
    arrays only); ``None``: as they are. Shared by the linen and nnx layers."""
    if dtype is None:
        return leaf, x
    fl = lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
    return jax.tree_util.tree_map(fl, leaf), jnp.asarray(x, dtype)


__all__ = ["KernelShape", "compress_tree", "contract", "head_widths", "kernel_paths", "leaf_mask",
           "materialize_tree", "restack", "selected_kernels", "to_leaves", "unstack"]
