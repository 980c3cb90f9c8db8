"""Execution choices that depend on the backend, shared by the blocks.

Not configuration: they change no result, only how a block runs (README design decision 17).
"""

from __future__ import annotations

import jax


def cpu_chunks() -> bool:
    """Whether blocks may run a large input a chunk at a time: on a CPU backend with one device.

    :func:`~lowrank_jax.nn.attention.batch_chunk` and :func:`~lowrank_jax.nn.mlp.token_chunks`
    ask this first. With several devices a block's input may be sharded over them (a batch split
    over a mesh), and a ``lax.map`` over chunks of a sharded axis makes XLA gather the whole
    input onto every device: on 8 simulated CPU devices with the batch sharded
    (``benchmarks/chunks_sharded.py``), an attention block ran 5.1-5.4x slower chunked than
    whole (32 x 256 tokens, d 256) and an MLP block 7.9x (6400 tokens, d 512 / 2048), their
    outputs replicated instead of sharded. On GPU and TPU the fused kernels want the whole
    input. Read when a function is traced.
    """
    return jax.default_backend() == "cpu" and jax.device_count() == 1
