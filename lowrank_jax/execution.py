"""How blocks and leaves execute: one explicit settings object, part of every trace's key.

Execution settings change how a computation runs, never what it computes (up to float
round-off): whether attention folds its keys and values into few queries, whether large
inputs run a chunk at a time on a CPU, whether weights that read the same input run as one
product, whether a packed binary weight uses its Pallas kernel, and at what precision float32
products run on an accelerator.
They are gathered in one frozen :class:`Execution` record and set for a region of code with
:func:`settings`::

    from lowrank_jax import execution

    with execution.settings(fold_keys=False, attention_chunk_above_bytes=None):
        y = jax.jit(forward)(params, x)   # traced with these settings

The active record is a JAX *user context* (``jax.make_user_context``): it is part of the key of
``jax.jit``'s tracing and compilation caches, so a function traced under one setting is traced
again under another, instead of silently keeping the path it was first traced with (module
constants read at trace time had that flaw). Settings apply where a function is *traced*: a
function jitted inside the ``with`` block and called outside it is traced again, with the
settings active at that call.

Nothing here reads the backend: fields whose value is ``None`` mean "the backend's default",
and :mod:`lowrank_jax.nn.execution` (blocks) and :mod:`lowrank_jax.leaves.packed_kernels`
(the packed-binary kernel) resolve them when they trace.

This module sits at the bottom of the package with :mod:`lowrank_jax.errors`: leaves and
blocks import it, it imports neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable, Iterator

import jax

from lowrank_jax.errors import ConfigError

#: Environment variable giving the packed-binary kernel's default (read once, at import).
PACKED_KERNEL_ENV = "LOWRANK_JAX_PACKED_KERNEL"
_KERNEL_MODES = ("auto", "on", "off")

#: Values of :attr:`Execution.matmul_precision` besides ``None`` (JAX's
#: ``jax.default_matmul_precision`` names): ``'default'`` is the backend's fastest float32
#: product (TF32 on NVIDIA GPUs since Ampere, one bfloat16 pass on TPUs), ``'high'`` three
#: bfloat16 passes on TPUs (TF32 on GPUs), ``'highest'`` full float32 (six bfloat16 passes on
#: TPUs). XLA:CPU computes every float32 product in float32 whatever the value.
MATMUL_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class Execution:
    """Execution settings (hashable; every field a Python value).

    Fields:
      fold_keys: let attention fold the key and value projections into the queries when that
        executes fewer multiply-adds (a one-token decoder's cross-attention;
        :func:`lowrank_jax.nn.execution.fold_keys`). Exact reassociation; ``False``: always
        project the keys and values (the standard algorithm).
      cpu_chunks: run large attention and MLP inputs a chunk at a time. ``None`` (default): on a
        CPU backend with one device only (:func:`lowrank_jax.nn.execution.cpu_chunks`);
        ``True`` / ``False`` force it on any backend.
      attention_chunk_above_bytes: chunk attention when the whole batch's float32 logits
        exceed this many bytes (``None``: never).
      factored_attention_chunk_above_bytes: the same for query-key objects without separate
        per-head projections (CP-SlimAtt, BTD), when it is the smaller (``None``: as
        ``attention_chunk_above_bytes``).
      attention_chunk_bytes: chunks of as many sequences as keep a chunk's logits within this
        many bytes (at least one sequence).
      mlp_chunk_above_bytes: chunk an MLP's tokens when its hidden activations exceed this many
        bytes (``None``: never).
      mlp_chunk_bytes: at most this many bytes of hidden activations per MLP chunk.
      heads_first: compute attention's weighted sum with the heads leading (values
        ``[b, h, k, w]``). ``None`` (default): on CPU only, where it was measured faster.
      packed_kernel: ``'auto'`` (the default), ``'on'`` or ``'off'``: whether a packed binary
        leaf runs the Pallas kernel (:func:`lowrank_jax.leaves.packed_kernels.use_kernel`).
        The environment variable ``LOWRANK_JAX_PACKED_KERNEL``, read once when lowrank_jax is
        imported, sets the default.
      fuse_products: run the first products of weights that read the same input as one
        product (q, k and v of self-attention, k and v of cross-attention, a gated MLP's
        ``wi_0`` and ``wi_1``; :func:`lowrank_jax.nn.execution.shared_input`). ``None``
        (default): the backend's entry in :data:`lowrank_jax.nn.execution.FUSE_BY_BACKEND`;
        ``True`` / ``False`` force it.
      fuse_min_tokens: fuse only inputs of at least this many rows (the weights are
        concatenated on every call, a copy that a product of few rows does not repay). The
        default of 64 is a guess, not a measurement: fusion is off by default where measured.
      matmul_precision: ``None`` (default): leave the precision of float32 products to JAX
        (``jax_default_matmul_precision``, unset: the backend's default, TF32 on recent NVIDIA
        GPUs, one bfloat16 pass on TPUs); ``'default'``, ``'high'`` or ``'highest'``
        (:data:`MATMUL_PRECISIONS`): :func:`settings` enters
        ``jax.default_matmul_precision(value)`` with the record, so every product traced in the
        block carries it. :func:`reference_precision` is ``'highest'``, the precision of the
        library's own checks and decompositions.

    The default thresholds were measured on a 2-core AVX-512 CPU (``benchmarks/layers/attention.py``,
    ``benchmarks/layers/mlp.py``; docs/benchmarks.md has the figures).
    """

    fold_keys: bool = True
    cpu_chunks: bool | None = None
    attention_chunk_above_bytes: int | None = 64 << 20
    factored_attention_chunk_above_bytes: int | None = 8 << 20
    attention_chunk_bytes: int = 2 << 20
    mlp_chunk_above_bytes: int | None = 16 << 20
    mlp_chunk_bytes: int = 8 << 20
    heads_first: bool | None = None
    packed_kernel: str = "auto"
    fuse_products: bool | None = None
    fuse_min_tokens: int = 64
    matmul_precision: str | None = None

    def __post_init__(self):
        for name in ("fold_keys",):
            _check_bool(name, getattr(self, name), allow_none=False)
        _check_bytes("fuse_min_tokens", self.fuse_min_tokens, allow_none=False, minimum=1)
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise ConfigError(f"Execution.matmul_precision must be None or one of "
                              f"{MATMUL_PRECISIONS}, got {self.matmul_precision!r}",
                              where="matmul_precision",
                              expected="None | " + " | ".join(MATMUL_PRECISIONS),
                              actual=self.matmul_precision)
        for name in ("cpu_chunks", "heads_first", "fuse_products"):
            _check_bool(name, getattr(self, name), allow_none=True)
        for name in ("attention_chunk_above_bytes", "factored_attention_chunk_above_bytes",
                     "mlp_chunk_above_bytes"):
            _check_bytes(name, getattr(self, name), allow_none=True, minimum=0)
        for name in ("attention_chunk_bytes", "mlp_chunk_bytes"):
            _check_bytes(name, getattr(self, name), allow_none=False, minimum=1)
        if self.packed_kernel not in _KERNEL_MODES:
            raise ConfigError(f"Execution.packed_kernel must be one of {_KERNEL_MODES}, got "
                              f"{self.packed_kernel!r}", where="packed_kernel",
                              expected=" | ".join(_KERNEL_MODES), actual=self.packed_kernel)

    def replace(self, **changes) -> "Execution":
        """A copy with ``changes`` (field names as keywords; unknown names are an error)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"Execution has no settings {unknown}; known: "
                              f"{[f.name for f in dataclasses.fields(self)]}",
                              where=", ".join(unknown), expected="an Execution field",
                              actual=unknown)
        return dataclasses.replace(self, **changes)


def _check_bool(name, value, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise ConfigError(f"Execution.{name} must be True, False{' or None' if allow_none else ''}"
                          f", got {value!r}", where=name, expected="bool", actual=value)


def _check_bytes(name, value, *, allow_none: bool, minimum: int) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"Execution.{name} must be an integer >= {minimum}"
                          f"{' or None' if allow_none else ''}, got {value!r}", where=name,
                          expected=f"int >= {minimum}", actual=value)


def _default() -> Execution:
    mode = os.environ.get(PACKED_KERNEL_ENV, "auto").strip().lower()
    if mode not in _KERNEL_MODES:
        raise ConfigError(f"{PACKED_KERNEL_ENV} must be 'auto', 'on' or 'off', got {mode!r}",
                          where=PACKED_KERNEL_ENV, expected="auto | on | off", actual=mode)
    return Execution(packed_kernel=mode)


#: The default settings of this process (``LOWRANK_JAX_PACKED_KERNEL`` applied).
DEFAULT = _default()
_CONTEXT = jax.make_user_context(DEFAULT)


def current() -> Execution:
    """The settings active here (what a function traced now runs with)."""
    return _CONTEXT.value


@contextlib.contextmanager
def settings(execution: Execution | None = None, /, **changes) -> Iterator[Execution]:
    """Run the enclosed code with other execution settings.

    Args:
      execution: a whole :class:`Execution` record (default: the active one).
      **changes: fields to change on top of it, for example ``fold_keys=False``.

    Yields:
      The active :class:`Execution`.

    Functions traced inside the block (jitted or not) use these settings; ``jax.jit``'s caches
    key on them, so the same jitted function traced earlier with other settings is traced
    again. A ``matmul_precision`` other than ``None`` also enters
    ``jax.default_matmul_precision`` for the block (itself part of ``jax.jit``'s keys).
    """
    base = current() if execution is None else execution
    if not isinstance(base, Execution):
        raise ConfigError(f"settings: expected an Execution, got {type(base).__name__}",
                          where="execution", expected="Execution", actual=type(base).__name__)
    new = base.replace(**changes) if changes else base
    with contextlib.ExitStack() as stack:
        stack.enter_context(_CONTEXT(new))
        if new.matmul_precision is not None:
            stack.enter_context(jax.default_matmul_precision(new.matmul_precision))
        yield new


def reference_precision() -> contextlib.AbstractContextManager[Execution]:
    """The active settings with ``matmul_precision='highest'``: float32 products in full
    float32 on every backend.

    What the library's own numbers run under, whatever the forward's precision: the parity
    checks against reference implementations, the output errors of compression reports
    (:func:`lowrank_jax.compress.compare_models`), decompositions (CP, BTD) and the dense
    matrices handed to SVDs. A GPU's default float32 product (TF32, about 10 bits of mantissa)
    would otherwise put a relative error near 1e-3 into figures meant to resolve 1e-5. On
    XLA:CPU it changes nothing (its float32 products are always full float32); the products
    traced inside carry ``precision=HIGHEST`` all the same.
    """
    return settings(matmul_precision="highest")


def at_reference_precision(fn: Callable) -> Callable:
    """``fn`` run under :func:`reference_precision` (a decorator)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with reference_precision():
            return fn(*args, **kwargs)

    return wrapped


__all__ = ["DEFAULT", "MATMUL_PRECISIONS", "Execution", "PACKED_KERNEL_ENV",
           "at_reference_precision", "current", "reference_precision", "settings"]
