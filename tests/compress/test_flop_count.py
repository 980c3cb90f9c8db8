"""Counted FLOPs (the weight leaves' own counts over the rows each sees in one call) against a
hand count, and XLA's count read on CPU only."""

import types

import jax
import jax.numpy as jnp
import numpy as np

import lowrank_jax as lj
from lowrank_jax.compress.frontier.measure import forward_flops, xla_flops


def model(params, x):
    """A block: q on every token, a low-rank projection on every token, a head on the first
    token of each sequence only, applied twice to a bias-free pooled row."""
    h = lj.linear(params["q"], x)                     # [b, t, 24] -> [b, t, 16]
    h = lj.linear(params["lr"], h)                    # [b, t, 16] -> [b, t, 12], rank 3
    y = lj.linear(params["head"], h[:, 0])            # [b, 12] -> [b, 5]
    return lj.linear(params["head2"], lj.linear(params["head2"], y))  # [b, 5] -> [b, 5], twice


def test_forward_flops_matches_a_hand_count():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"q": lj.init_dense(k[0], 24, 16), "lr": lj.init_lowrank(k[1], 16, 12, 3),
              "head": lj.init_dense(k[2], 12, 5), "head2": lj.init_dense(k[3], 5, 5)}
    b, t = 3, 7
    hand = (b * t * 24 * 16          # q: every token
            + b * t * (16 * 3 + 3 * 12)  # low-rank: two factors
            + b * 12 * 5             # head: one token per sequence
            + 2 * b * 5 * 5)         # head2: applied twice
    x = jax.ShapeDtypeStruct((b, t, 24), jnp.float32)
    assert forward_flops(model, params, x) == hand
    # XLA:CPU counts 2 FLOPs per multiply-add of the same products.
    dense = {"q": params["q"], "head": params["head"]}
    compiled = jax.jit(lambda p, v: lj.linear(p["head"], lj.linear(p["q"], v)[:, 0][:, :12])
                       ).lower(dense, jnp.zeros((b, t, 24))).compile()
    assert xla_flops(compiled) == 2 * (b * t * 24 * 16 + b * 12 * 5)


def test_xla_flops_only_on_cpu():
    """On another platform XLA's count leaves out library calls: ``None``, count instead."""
    compiled = jax.jit(lambda a: a @ a).lower(np.ones((4, 4), np.float32)).compile()
    assert xla_flops(compiled) == 2 * 4 ** 3
    device = types.SimpleNamespace(platform="gpu")
    fake = types.SimpleNamespace(
        input_shardings=((types.SimpleNamespace(device_set=[device]),), {}),
        cost_analysis=lambda: {"flops": 53.0})
    assert xla_flops(fake) is None
