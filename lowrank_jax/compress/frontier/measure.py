"""What a frontier run counts and times: the rows each weight leaf sees, the multiply-adds of
the weight leaves, XLA's count of a compiled program, and interleaved timing.

FLOPs are counted, not read from XLA, wherever they are compared across backends: XLA:GPU's
``cost_analysis()`` does not count the library calls (cuBLAS GEMMs) that do most of a model's
work (a Chronos-Bolt-base forward of about 1.6 TFLOP reported as 53 GFLOP on an NVIDIA H200).
:func:`forward_flops` counts the weight leaves' multiply-adds of any call from the leaves' own
``flops``; :func:`xla_flops` gives XLA's count on CPU only."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import timing
from lowrank_jax.leaves import is_leaf, named_leaves
from lowrank_jax.leaves.channel_masked import count_rows
from lowrank_jax.models import family_of


def leaf_rows(config: Any, params: Any, inputs: Mapping | None = None) -> dict[str, int]:
    """Rows (tokens times batch) each weight leaf sees in one forward pass of one sample of the
    family's representative inputs (or of ``inputs``): an abstract trace
    (:func:`~lowrank_jax.leaves.channel_masked.count_rows`), nothing is computed."""
    fam = family_of(config)
    if inputs is None:
        inputs = fam.sample_inputs(config, np.random.default_rng(0), 1)
    else:
        inputs = {k: np.asarray(v)[:1] for k, v in inputs.items()}
    return count_rows(lambda p: fam.apply(p, dict(inputs), config), params)


def model_flops(config: Any, params: Any, inputs: Mapping | None = None, *,
                rows: Mapping[str, int] | None = None) -> int:
    """Multiply-adds of the weight leaves in one forward pass of one sample: each leaf's
    ``flops(rows)`` with the rows it sees (:func:`leaf_rows`).

    Args:
      config, params, inputs: as for :func:`leaf_rows`.
      rows: rows per path already counted (for example on the uncompressed model, whose paths a
        compressed one often keeps); used when it covers every weight leaf of ``params``.

    Attention score products are not included (see :func:`lowrank_jax.nn.attention_score_flops`);
    :func:`frontier` reports them inside XLA's count of the compiled program.
    """
    leaves = [(path, node) for path, node in named_leaves(params) if is_leaf(node)]
    if rows is None or any(path not in rows for path, _ in leaves):
        rows = leaf_rows(config, params, inputs)
    return int(sum(node.flops(rows.get(path, 0)) for path, node in leaves))


def forward_flops(fn: Callable[..., Any], params: Any, *args: Any) -> int:
    """Multiply-adds of the weight leaves in one call ``fn(params, *args)``: each leaf's
    ``flops(rows)`` with the rows it is applied to in that call, found by an abstract trace
    (:func:`~lowrank_jax.leaves.channel_masked.count_rows`; nothing is computed).

    Counted, so the same on every backend. Attention's score and weighted-value products (no
    weight leaf; :func:`lowrank_jax.nn.attention_score_flops`) and elementwise work are not
    included. Twice this is the FLOP count in the GEMM sense (a multiply and an add).

    Args:
      fn: ``fn(params, *args)``, for example ``lambda p, x: chronos_bolt.forecast(p, x, cfg)``.
      params: the parameter tree whose leaves are counted.
      *args: the call's other arguments (arrays or ``jax.ShapeDtypeStruct``).
    """
    def call(p):  # shapes become arrays inside the abstract trace: nothing is allocated
        return fn(p, *jax.tree_util.tree_map(
            lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a,
            args))

    rows = count_rows(call, params)
    return int(sum(node.flops(rows.get(path, 0)) for path, node in named_leaves(params)
                   if is_leaf(node)))


def _platform_of(compiled) -> str | None:
    """The platform a compiled program runs on (from its input shardings), ``None`` if
    unknown."""
    try:
        for sharding in jax.tree_util.tree_leaves(compiled.input_shardings):
            for device in sharding.device_set:
                return device.platform
    except (AttributeError, TypeError):
        return None
    return None


def xla_flops(compiled) -> float | None:
    """XLA's FLOP count of a compiled program on CPU (2 per multiply-add, elementwise work
    included); ``None`` on other backends, whose count leaves out library calls (XLA:GPU's
    does not count cuBLAS GEMMs: count with :func:`forward_flops` there), and where the backend
    gives none."""
    if _platform_of(compiled) not in (None, "cpu"):
        return None
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - an optional estimate some backends do not give
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    value = (cost or {}).get("flops")
    return float(value) if value is not None and value >= 0 else None


def time_interleaved(calls: Sequence[Callable[[], Any]], runs: int) -> list[float]:
    """Median seconds of each call, the calls run in turn every round (the order reversed on
    odd rounds), so that machine noise hits them alike. Each call is run once first (warm-up).
    The loop is :func:`lowrank_jax.timing.time_interleaved`'s.
    """
    t = timing.time_interleaved([lambda c=c: jax.block_until_ready(c()) for c in calls],
                                runs=runs, warmup=1)
    return [t.median(name) for name in t.names]


__all__ = ["forward_flops", "leaf_rows", "model_flops", "time_interleaved", "xla_flops"]
