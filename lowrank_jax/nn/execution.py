"""How the blocks execute: the strategy decisions, read from the execution settings.

The blocks in :mod:`lowrank_jax.nn` say what they compute; this module decides how, from the
active :class:`lowrank_jax.execution.Execution` settings (:func:`lowrank_jax.execution.settings`),
the backend and the shapes at hand:

* :func:`cpu_chunks`: whether large inputs may run a chunk at a time;
* :func:`batch_chunk`: attention's sequences per chunk;
* :func:`token_chunks`: an MLP's token chunks;
* :func:`heads_first`: the layout of attention's weighted sum;
* :func:`fold_plan`: whether attention folds its keys and values into the queries, with the
  factors it folds through;
* :func:`shared_input`: whether weights that read the same input run their first products as
  one (q, k and v; k and v of cross-attention; a gated MLP's two input weights), and those
  products;
* :func:`rank_multiple`: the multiple a backend's matrix units tile ranks by (used by
  compression, not by the blocks).

None of them changes a result beyond float round-off (design decision 17, docs/design/decisions.md). They are
called while a function is traced; the settings they read are part of ``jax.jit``'s cache key,
so changing a setting re-traces.
"""

from __future__ import annotations

import math
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import execution
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import HeadLayout, factors, matmul_flops

#: Whether :func:`shared_input` fuses by default, per backend (``Execution.fuse_products=None``).
#: CPU: off, measured: no consistent gain in a small Chronos-Bolt forward
#: (``benchmarks/models/matrix_units.py``; the design notes on execution have the figures).
#: GPU and TPU: off until measured there against the unfused blocks; ``fuse_products=True``
#: opts in.
FUSE_BY_BACKEND = types.MappingProxyType({"cpu": False, "gpu": False, "tpu": False})

#: Rank multiples by backend (:func:`rank_multiple`). CPU: 1, measured: rounding ranks up to 8
#: or 16 gained nothing consistent on a 2-core AVX-512 CPU (``benchmarks/layers/rank_multiple.py``).
#: GPU and TPU: design values, not measured: tensor cores take the inner dimension of a bf16
#: product in steps of 16 (8 for TF32), TPU matrix units are 128 wide (256 on the newest).
RANK_MULTIPLE_BY_BACKEND = types.MappingProxyType({"cpu": 1, "gpu": 16, "tpu": 128})


def cpu_chunks() -> bool:
    """Whether blocks may run a large input a chunk at a time.

    Setting ``cpu_chunks``: ``True`` / ``False`` force it; ``None`` (default) allows it on a CPU
    backend with one device only. With several devices a block's input may be sharded over
    them (a batch split over a mesh), and a ``lax.map`` over chunks of a sharded axis makes XLA
    gather the whole input onto every device: on 8 simulated CPU devices with the batch sharded
    (``benchmarks/layers/chunks_sharded.py``), an attention block ran 5.1-5.4x slower chunked than
    whole (32 x 256 tokens, d 256) and an MLP block 7.9x (6400 tokens, d 512 / 2048), their
    outputs replicated instead of sharded. On GPU and TPU the fused kernels want the whole
    input.
    """
    forced = execution.current().cpu_chunks
    if forced is not None:
        return forced
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def heads_first() -> bool:
    """Whether attention's weighted sum runs with the heads leading (values ``[b, h, k, w]``).

    Setting ``heads_first``; ``None`` (default): on CPU, where every operand of the per-head
    products is then contiguous, 1.3-1.9x faster for the attention core at 32 x 33
    (Chronos-Bolt), 8 x 64, 2 x 256 and 1 x 512 tokens with 12 heads of 64 on a 2-core AVX-512
    CPU. Other backends keep the einsum as written and leave the layout to XLA (not measured
    there).
    """
    forced = execution.current().heads_first
    if forced is not None:
        return forced
    return jax.default_backend() == "cpu"


def batch_chunk(batch: int, heads: int, q_len: int, k_len: int, *,
                factored: bool = False) -> int | None:
    """Sequences per chunk of :func:`~lowrank_jax.nn.apply_attention`, or ``None`` (the whole
    batch at once).

    Not from any paper: an execution choice for CPUs. The logits ``[batch, H, q, k]`` of a
    large batch do not fit in the caches, and the softmax and the weighted sum then read them
    back from memory; chunk by chunk (``lax.map``) they stay in cache. On a 2-core AVX-512 CPU
    the attention of 32 sequences of 256 tokens with 12 heads of 64 ran 1.9x faster one
    sequence at a time (295 -> 154 ms), 6.5x with heads of rank 6 (194 -> 30 ms)
    (``benchmarks/layers/attention.py``). Since the weighted sum runs heads first (:func:`heads_first`)
    whole blocks are 1.2-1.4x faster, and what chunks still gain is mostly glibc's page faults
    on blocks larger than a thread arena's 64 MB heap: with tcmalloc preloaded (no faults)
    chunks gained 0.84-1.02x over eight sizes. Hence the setting
    ``attention_chunk_above_bytes`` of 64 MB: with freed memory kept, chunks gain 1.02-1.40x
    above it (32 x 256, 64 x 197, 8 and 16 x 512 tokens) and lost up to 8 % below it; they also
    hold fewer temporaries under differentiation. Query-key objects without separate per-head
    projections (``factored``: CP-SlimAtt, BTD), whose logits are built from shared factors
    with more memory traffic per logit, still gain from the cache (1.06-1.14x at 12-48 MB of
    logits with freed memory kept, 1.08-1.12x with tcmalloc; d 768, 12 heads, CP rank 74, BTD
    term ranks 5 and 14): they chunk above ``factored_attention_chunk_above_bytes`` (8 MB).
    Chunks hold as many sequences as keep their logits within ``attention_chunk_bytes`` (2 MB;
    at least one sequence, the largest divisor of the batch).

    Off where :func:`cpu_chunks` says so and for ``attention_chunk_above_bytes=None``.

    Args:
      batch, heads, q_len, k_len: the logits' shape.
      factored: the block's query-key object has no separate per-head projections
        (:meth:`lowrank_jax.QK.projections` is ``None``).
    """
    s = execution.current()
    if s.attention_chunk_above_bytes is None or not cpu_chunks():
        return None
    above = s.attention_chunk_above_bytes
    if factored and s.factored_attention_chunk_above_bytes is not None:
        above = min(above, s.factored_attention_chunk_above_bytes)
    per_seq = 4 * heads * q_len * k_len
    if batch <= 1 or batch * per_seq <= above:
        return None
    chunk = max(1, min(batch, s.attention_chunk_bytes // max(per_seq, 1)))
    while batch % chunk:
        chunk -= 1
    return chunk if chunk < batch else None


def token_chunks(n_tokens: int, d_hidden: int, itemsize: int = 4) -> int | None:
    """How many chunks :func:`~lowrank_jax.nn.apply_mlp` splits ``n_tokens`` tokens into, or
    ``None`` (all at once).

    Not from any paper: an execution choice for CPUs, as :func:`batch_chunk` is for attention.
    The hidden activations ``[tokens, d_hidden]`` of a large input do not fit in the caches:
    the first product writes them to memory and the second reads them back. A chunk of tokens
    at a time (``lax.map``), they stay in cache. Measured on a 2-core AVX-512 CPU
    (``benchmarks/layers/mlp.py``): MLP blocks 1.14-1.22x faster at 4096-16384 tokens (d 768 / 3072 on
    16384 tokens 1.17x, gated d 768 / 2048 1.22x, d 1024 / 4096 on 8192 tokens 1.15x), a 4-layer
    ViT-Base-width encoder on 32 images 1.09x; at 12 MB of hidden activations or less chunks
    gained nothing, hence the setting ``mlp_chunk_above_bytes`` of 16 MB, with chunks of at
    most ``mlp_chunk_bytes`` (8 MB). The gradient keeps each chunk's hidden activations for the
    backward pass, as without chunks, and runs as fast (1.01x).

    Off where :func:`cpu_chunks` says so and for ``mlp_chunk_above_bytes=None``. Chunks are
    equal: the tokens are padded with zero rows up to a multiple of the chunk (fewer than one
    row per chunk), and the padding's outputs are dropped.
    """
    s = execution.current()
    if s.mlp_chunk_above_bytes is None or not cpu_chunks():
        return None
    total = int(n_tokens) * int(d_hidden) * int(itemsize)
    if n_tokens <= 1 or total <= s.mlp_chunk_above_bytes:
        return None
    return min(int(n_tokens), max(2, math.ceil(total / s.mlp_chunk_bytes)))


def _fold_cost(f, width: int) -> tuple[int, int]:
    """``(multiply-adds, d)``: one head's ``width``-vector through ``W^T`` onto the ``d``
    inputs the weight reads (or the other way): ``width * d`` dense, ``(width + d) * r``
    through rank-``r`` factors."""
    if f.first is None:
        return width * int(f.second.shape[0]), int(f.second.shape[0])
    return (width + int(f.first.shape[0])) * int(f.first.shape[1]), int(f.first.shape[0])


def fold_plan(qk: Any, v: Any, heads: HeadLayout, q_len: int, k_len: int):
    """``(key factors, value factors)`` when attention should fold its keys and values into
    the queries for ``q_len`` queries against ``k_len`` keys, else ``None``.

    Not from any paper: an exact reassociation that pays when few queries meet many keys, such
    as a one-token decoder's cross-attention (Chronos-Bolt decodes a single token against the
    encoder output). Head ``h``'s logits ``(x W^Q_h)(x_kv W^K_h)^T`` are computed as
    ``((x W^Q_h) (W^K_h)^T) x_kv^T``, and its values ``p_h (x_kv W^V_h)`` as
    ``(p_h x_kv) W^V_h``: the ``k_len`` rows of the key and value projections are replaced by
    ``q_len * heads`` vectors of the input's width. A factored key or value weight
    (:meth:`lowrank_jax.Leaf.factors`, ``W = U V``) is folded through its factors, never rebuilt.
    Chosen when, per sequence,

        q_len * h * (fold(k) + 2 * k_len * d_kv + fold(v))
          < flops(k, k_len) + flops(v, k_len) + q_len * k_len * h * (w_qk + w_v)

    with ``fold(W) = w * d_kv`` for a dense weight and ``(w + d_kv) * r`` for rank-``r``
    factors (``w`` the widest head), ``flops`` the leaves' own counts of projecting the keys'
    ``k_len`` rows, and ``d_kv`` the input width the weight reads. Needs a query-key object in
    the separable per-head form (:meth:`lowrank_jax.QK.projections`) whose key weight and the
    block's value weight answer :func:`lowrank_jax.leaves.factors` (dense weights, ``LowRank``,
    a ``ChannelPruned`` that removed inputs only, or a user's leaf with the capability), and
    the setting ``fold_keys`` (default on). Self-attention never qualifies with dense weights
    (``q_len == k_len`` costs more folded).

    Measured (``benchmarks/models/peak.py``, 2-core AVX-512 CPU, batch 32 x 33 encoder rows): the
    Chronos-Bolt-base decoder took 83-92 ms instead of 224-252 ms, the whole forward 1.07-1.15x
    less time.
    """
    if not execution.current().fold_keys:
        return None
    proj = qk.projections()
    if proj is None:
        return None
    fk, fv = factors(proj.k), factors(v)
    if fk is None or fv is None:
        return None
    h = heads.num_heads
    w_qk, w_v = max(proj.widths, default=0), max(heads.v, default=0)
    (in_k, d_k), (out_v, d_v) = _fold_cost(fk, w_qk), _fold_cost(fv, w_v)
    projected = (matmul_flops(proj.k, k_len) + matmul_flops(v, k_len)
                 + q_len * k_len * h * (w_qk + w_v))
    folded = q_len * h * (in_k + k_len * (d_k + d_v) + out_v)
    return (fk, fv) if folded < projected else None


def _same_rows(fs) -> bool:
    return len({f.rows for f in fs}) == 1


def shared_input_plan(weights, n_tokens: int):
    """The :class:`~lowrank_jax.leaves.Factors` of ``weights`` when they should run their
    first products on one input as a single product, else ``None``.

    Not from any paper: an execution choice for matrix units. Weights that read the same input
    (q, k and v of self-attention, k and v of cross-attention, a gated MLP's ``wi_0`` and
    ``wi_1``) multiply it by their first factors (``U`` of a rank-``r`` weight ``U V``, the
    whole matrix of a dense one) side by side: ``x [U_q | U_k | U_v]`` is one product with the
    sum of the widths instead of three narrow ones, then each part goes through its second
    factor. Exact: the concatenation of the three products (up to float round-off). Needs every
    weight to answer :func:`lowrank_jax.leaves.factors` with the same input rows (dense
    weights, ``LowRank``, a ``ChannelPruned`` that removed the same inputs, or a user's leaf
    with the capability), at least two weights, and an input of at least
    ``fuse_min_tokens`` rows: the factors are concatenated on every call, a copy of the
    weights that a product of one decoding step does not repay.

    Setting ``fuse_products``; ``None`` (default): :data:`FUSE_BY_BACKEND`. Off on CPU, where
    it was measured: a Chronos-Bolt forward (d_model 256, 4 + 4 layers, 16 series x 33
    tokens) ran 0.94-1.08x the unfused time (this process's CPU time, dense and compressed,
    float32 and bf16, on a 2-core AVX-512 / AMX Xeon), the concatenation of the weights
    costing what one wider product saves. Off on GPU and TPU until measured there, where
    fewer, wider products are the usual gain (fewer kernel launches, fuller tiles).
    """
    s = execution.current()
    on = s.fuse_products
    if on is None:
        on = FUSE_BY_BACKEND.get(jax.default_backend(), False)
    if not on or len(weights) < 2 or int(n_tokens) < s.fuse_min_tokens:
        return None
    fs = [factors(w) for w in weights]
    if any(f is None for f in fs) or not _same_rows(fs):
        return None
    return fs


def shared_input(weights, x: Any) -> list | None:
    """``[linear(w, x) for w in weights]`` computed with one product for the first factors
    when :func:`shared_input_plan` says so; ``None`` otherwise (the block then runs each
    weight on its own).

    Args:
      weights: weight leaves (or plain arrays) reading the same input.
      x: the input ``[..., d_in]``.
    """
    n_tokens = math.prod(x.shape[:-1])
    fs = shared_input_plan(weights, n_tokens)
    if fs is None:
        return None
    rows = fs[0].rows
    xr = x if rows is None else x[..., np.asarray(rows, np.int64)]
    firsts = [f.second if f.first is None else f.first for f in fs]
    sizes = [int(a.shape[1]) for a in firsts]
    joint = xr @ jnp.concatenate(firsts, axis=1)  # the one product: [..., sum of widths]
    outs, at = [], 0
    for f, n in zip(fs, sizes, strict=True):
        part = joint[..., at:at + n]
        at += n
        y = part if f.first is None else part @ f.second
        outs.append(y if f.bias is None else y + f.bias)
    return outs


def rank_multiple(backend: str | None = None) -> int:
    """The multiple that ranks are rounded up to for ``backend`` (default: JAX's default
    backend), from :data:`RANK_MULTIPLE_BY_BACKEND`: what ``rank_multiple='backend'`` means
    in the ``svd`` compression method.

    Only the CPU entry is measured (1: no rounding); the GPU (16) and TPU (128) entries are
    design values from the matrix units' tile sizes, not measured speed-ups.
    """
    name = jax.default_backend() if backend is None else backend
    if name not in RANK_MULTIPLE_BY_BACKEND:
        raise ConfigError(f"rank_multiple: no entry for backend {name!r}; known: "
                          f"{sorted(RANK_MULTIPLE_BY_BACKEND)}", where="backend",
                          expected=sorted(RANK_MULTIPLE_BY_BACKEND), actual=name)
    return RANK_MULTIPLE_BY_BACKEND[name]


__all__ = ["FUSE_BY_BACKEND", "RANK_MULTIPLE_BY_BACKEND", "batch_chunk", "cpu_chunks",
           "fold_plan", "heads_first", "rank_multiple", "shared_input", "shared_input_plan",
           "token_chunks"]
