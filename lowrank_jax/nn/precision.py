"""Reduced-precision inference: matmuls on ``bfloat16`` operands accumulated in ``float32``,
weights of the linear leaves stored in ``bfloat16``.

The policy (as ``torch.autocast`` on bf16 hardware, and what matrix units compute natively):

* every ``dot_general`` of a function whose operands are floating (the leaves' ``x @ W``, the
  attention scores and the weighted values alike) multiplies ``bfloat16`` operands and
  accumulates in ``float32`` (``preferred_element_type=float32``); its result is cast back to
  the dtype the traced program gave it, so the rest of the program is unchanged;
* everything else (norms, softmax, residual sums, embeddings, the loss) keeps the dtypes it
  was traced with: with :func:`cast_weights`, activations stay ``float32`` (a ``float32`` input
  times a ``bfloat16`` weight promotes to ``float32`` in JAX), so only the matmul operands are
  rounded;
* :func:`cast_weights` stores the floating arrays of every weight leaf (``Dense``, ``LowRank``,
  ``HeadLowRank``, binary gains, biases, ...) in ``bfloat16``: half their bytes. Plain arrays
  outside leaves (norm scales, embedding tables, position biases) and integer arrays (packed
  bits, ``int8`` signs, masks) are left as they are.

:func:`with_matmul_dtype` is a program transformation, not a flag the leaves read: it traces
the function once (``jax.make_jaxpr``) and evaluates the traced program with each
``dot_general`` replaced. No leaf and no block changes; ``linear`` dispatch stays as it is.
Programs inside ``jit``, ``scan``, ``while_loop`` / ``fori_loop``, ``cond``, ``remat`` and custom
derivative rules are transformed too; the bodies of ``shard_map`` and Pallas kernels keep
their own dtypes (they are bound unchanged).

Example::

    fwd = jax.jit(bf16_forward(lambda p, x: chronos_bolt.forecast(p, x, cfg)))
    y16 = fwd(params, context)   # params float32: cast inside; or pass cast_weights(params)

On a CPU without bf16 instructions this is about numbers and memory, not speed: on the AVX2
machine measured (``benchmarks/models/peak.py``) XLA:CPU (jax 0.10) runs bf16 products at 0.7x the
float32 rate, and a bf16 forward takes 1.3-1.5x the float32 time. On a Xeon with AMX bf16
matrix units the same XLA:CPU ran a small Chronos-Bolt forward (d_model 256, 16 series) in
about 0.4x the float32 time (``benchmarks/models/matrix_units.py``).

Float32 forwards (without this module) run at the backend's default precision for float32
products: full float32 on CPU, TF32 on NVIDIA GPUs since Ampere, one bfloat16 pass on TPUs.
The execution setting ``matmul_precision`` (:class:`lowrank_jax.execution.Execution`) asks for
another (``'highest'``: full float32 everywhere); the library's own checks, decompositions and
compression errors always run at ``'highest'`` (:func:`lowrank_jax.execution.reference_precision`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import is_leaf

#: primitives whose inner programs are bound unchanged (their own dtype rules apply)
OPAQUE = ("pallas_call", "shard_map")


def _check_float(dtype: Any, name: str) -> Any:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ConfigError(f"{name} must be a float dtype, got {dtype!r}", where=name,
                          expected="a float dtype", actual=dtype) from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ConfigError(f"{name} must be a float dtype, got {dt}", where=name,
                          expected="a float dtype", actual=str(dt))
    return dt


def cast_weights(params: Any, dtype: Any = jnp.bfloat16) -> Any:
    """``params`` with the floating arrays of every weight leaf cast to ``dtype``.

    Arrays outside leaves (norm scales, embedding tables, relative-position biases, model
    state) and integer arrays inside them (packed bits, ``int8`` signs) are kept.

    Args:
      params: a parameter tree.
      dtype: float dtype for the weights (default ``bfloat16``).
    """
    dt = _check_float(dtype, "dtype")

    def cast_leaf(leaf):
        return jax.tree_util.tree_map(
            lambda a: a.astype(dt) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a,
            leaf)

    return jax.tree_util.tree_map(lambda n: cast_leaf(n) if is_leaf(n) else n, params,
                                  is_leaf=lambda n: is_leaf(n))


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _struct(v) -> jax.ShapeDtypeStruct:
    a = v.aval
    return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


class _Policy:
    def __init__(self, operand: Any, accumulate: Any):
        self.operand, self.accumulate = operand, accumulate

    def closed(self, cj: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
        """A closed program with the same signature, its matmuls replaced."""
        return jax.make_jaxpr(lambda *a: self.eval(cj.jaxpr, cj.consts, a))(
            *[_struct(v) for v in cj.jaxpr.invars])

    def dot(self, eqn, lhs, rhs):
        out_dtype = eqn.outvars[0].aval.dtype
        params = dict(eqn.params, preferred_element_type=self.accumulate)
        y = jax.lax.dot_general_p.bind(lhs.astype(self.operand), rhs.astype(self.operand),
                                       **params)
        return y.astype(out_dtype)

    def eval(self, jaxpr: jex.Jaxpr, consts, args) -> list:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jex.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = c
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            prim = eqn.primitive
            if prim is jax.lax.dot_general_p and all(map(_is_float, ins)):
                outs = [self.dot(eqn, *ins)]
            elif prim.name == "remat" or prim.name == "checkpoint":
                outs = self.eval(eqn.params["jaxpr"], (), ins)  # inline (inference only)
            else:
                params = eqn.params
                if prim.name not in OPAQUE:
                    params = {k: self._param(v) for k, v in params.items()}
                outs = prim.bind(*ins, **prim.get_bind_params(params))
                if not prim.multiple_results:
                    outs = [outs]
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def _param(self, v):
        if isinstance(v, jex.ClosedJaxpr):
            return self.closed(v)
        if isinstance(v, tuple) and v and all(isinstance(b, jex.ClosedJaxpr) for b in v):
            return tuple(self.closed(b) for b in v)
        return v


def with_matmul_dtype(fn: Callable, dtype: Any = jnp.bfloat16,
                      accumulate: Any = jnp.float32) -> Callable:
    """``fn`` with every floating ``dot_general`` computed on ``dtype`` operands, accumulated in
    ``accumulate``.

    Args:
      fn: a function of array pytrees (close over configs and other static arguments).
      dtype: operand dtype of the matmuls (default ``bfloat16``).
      accumulate: ``preferred_element_type`` of the matmuls (default ``float32``); each result
        is then cast to the dtype it had in ``fn``'s program.

    Returns:
      A function with ``fn``'s signature and output structure and dtypes. It traces ``fn`` on
      every call; wrap it in ``jax.jit``.
    """
    pol = _Policy(_check_float(dtype, "dtype"), _check_float(accumulate, "accumulate"))

    @functools.wraps(fn)
    def wrapped(*args):
        flat, tree = jax.tree_util.tree_flatten(args)
        closed, out_shape = jax.make_jaxpr(lambda *f: fn(*tree.unflatten(f)),
                                           return_shape=True)(*flat)
        outs = pol.eval(closed.jaxpr, closed.consts, flat)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped


def bf16_forward(fn: Callable, *, cast: bool = True) -> Callable:
    """``fn(params, *inputs)`` in bf16 with float32 accumulation: the weight leaves of
    ``params`` cast to ``bfloat16`` (:func:`cast_weights`, when ``cast``) and every matmul on
    ``bfloat16`` operands accumulated in ``float32`` (:func:`with_matmul_dtype`).

    Args:
      fn: ``fn(params, *inputs)`` (close over the config).
      cast: cast the weight leaves inside the call (set ``False`` when ``params`` were cast
        once beforehand, to keep the bf16 copy in memory instead of the float32 one).

    Returns:
      A function of ``(params, *inputs)``; wrap it in ``jax.jit``.
    """
    inner = with_matmul_dtype(fn)

    def run(params, *inputs):
        return inner(cast_weights(params) if cast else params, *inputs)

    return functools.wraps(fn)(run)


def dot_accumulation_dtypes(fn: Callable, *args) -> list:
    """``(preferred_element_type, operand dtypes)`` of every ``dot_general`` in ``fn(*args)``'s
    program, nested programs included, in program order (``None``: the dot has no preferred
    type and accumulates in its operands' dtype)."""
    found: list = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is jax.lax.dot_general_p:
                found.append((eqn.params.get("preferred_element_type"),
                              tuple(v.aval.dtype for v in eqn.invars)))
            for v in eqn.params.values():
                for j in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(j, jex.ClosedJaxpr):
                        walk(j.jaxpr)
                    elif isinstance(j, jex.Jaxpr):
                        walk(j)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


__all__ = ["bf16_forward", "cast_weights", "dot_accumulation_dtypes", "with_matmul_dtype"]
