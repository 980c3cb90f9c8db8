"""How the blocks execute: the strategy decisions, read from the execution settings.

The blocks in :mod:`lowrank_jax.nn` say what they compute; this module decides how, from the
active :class:`lowrank_jax.execution.Execution` settings (:func:`lowrank_jax.execution.settings`),
the backend and the shapes at hand:

* :func:`cpu_chunks`: whether large inputs may run a chunk at a time;
* :func:`batch_chunk`: attention's sequences per chunk;
* :func:`token_chunks`: an MLP's token chunks;
* :func:`heads_first`: the layout of attention's weighted sum;
* :func:`fold_plan`: whether attention folds its keys and values into the queries, with the
  factors it folds through.

None of them changes a result beyond float round-off (design decision 17, docs/design/decisions.md). They are
called while a function is traced; the settings they read are part of ``jax.jit``'s cache key,
so changing a setting re-traces.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from lowrank_jax import execution
from lowrank_jax.leaves import HeadLayout, factors, matmul_flops


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


__all__ = ["batch_chunk", "cpu_chunks", "fold_plan", "heads_first", "token_chunks"]
