"""Compressed-by-design initialization: schedule ranks, counts, scale, errors, weight reuse."""

import math

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.compress import interpolation_schedule, power_schedule
from lowrank_jax.models import patch_encoder as pe
from lowrank_jax.train.pretrain import factorize_init, reuse_weights

CFG = pe.PatchEncoderConfig(d_model=64, num_heads=4, d_ff=128, num_layers=4, embed_hidden=32)


@pytest.fixture(scope="module")
def params():
    return pe.init(jax.random.PRNGKey(0), CFG)


def leaves(tree):
    return dict(lj.named_leaves(tree))


def test_power_schedule_ranks_and_ratio_recount(params):
    d0, alpha = 3.0, 0.5
    sched = power_schedule(d0, alpha, CFG.num_layers)
    assert sched == [math.ceil(d0 * (1 + i) ** alpha) for i in range(4)] == [3, 5, 6, 6]
    new, rep = factorize_init(params, key=jax.random.PRNGKey(1), schedule=sched)
    got = leaves(new)
    dense_total = fact_total = 0
    for i in range(4):
        for n in "qkvo":
            leaf = got[f"encoder/layers/{i}/attn/{n}"]
            assert isinstance(leaf, lj.LowRank) and leaf.rank == sched[i]
            dense_total += 64 * 64
            fact_total += lj.param_count(leaf)
    assert isinstance(got["encoder/layers/0/mlp/wi"], lj.Dense)  # not selected
    assert rep.params_dense == dense_total and rep.params_factorized == fact_total
    assert rep.ratio == pytest.approx(fact_total / dense_total)
    # the input tree is untouched
    assert isinstance(leaves(params)["encoder/layers/0/attn/q"], lj.Dense)


def test_app_k_schedule_endpoints_and_clipping(params):
    sched = interpolation_schedule(2, 40, 0.5, 4, max_rank=32)
    ref = [min(32, math.floor(2 + (40 - 2) * ((layer - 1) / 3) ** 0.5 + 0.5)) for layer in range(1, 5)]
    assert sched == ref and sched[0] == 2 and sched[-1] == 32
    new, _ = factorize_init(params, key=jax.random.PRNGKey(2), schedule=sched)
    assert [leaves(new)[f"encoder/layers/{i}/attn/k"].rank for i in range(4)] == sched


def test_factor_scale_matches_dense(params):
    new, _ = factorize_init(params, key=jax.random.PRNGKey(3), rank=16)
    for i in range(4):
        dense = np.asarray(leaves(params)[f"encoder/layers/{i}/attn/v"].w)
        prod = np.asarray(lj.materialize(leaves(new)[f"encoder/layers/{i}/attn/v"]))
        assert prod.std() == pytest.approx(dense.std(), rel=0.15)


def test_per_head_factorization(params):
    new, rep = factorize_init(params, key=jax.random.PRNGKey(4), rank=5, per_head=True, num_heads=4)
    got = leaves(new)
    q, o = got["encoder/layers/2/attn/q"], got["encoder/layers/2/attn/o"]
    assert isinstance(q, lj.HeadLowRank) and q.u.shape == (64, 4, 5) and q.v.shape == (4, 5, 16)
    assert isinstance(o, lj.LowRank) and o.rank == 5
    row = next(r for r in rep.rows if r.path == "encoder/layers/2/attn/q")
    assert row.params_factorized == lj.param_count(q) == 4 * 5 * (64 + 16)
    y = jax.jit(lambda p, s: pe.apply(p, s, CFG))(
        new, np.random.default_rng(0).normal(size=(2, 64))
    )
    assert np.all(np.isfinite(np.asarray(y)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=65), r"encoder/layers/0/attn/k \(shape 64x64\) must be .*\[1, 64\], got 65"),
        (
            dict(rank=17, per_head=True, num_heads=4),
            r"4 heads\) must be an int in \[1, 16\], got 17",
        ),
        (dict(schedule=[4, 4]), r"schedule has 2 ranks but encoder/layers/2/attn/\w is in layer 2"),
        (dict(rank=4, schedule=[4] * 4), r"exactly one of rank= or schedule="),
        (dict(rank=4, rules=["nothing/matches"]), r"nothing/matches"),
    ],
)
def test_bad_configs_are_rejected(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factorize_init(params, key=jax.random.PRNGKey(0), **kwargs)


def test_reuse_embedding_from_pretrained(params):
    other = pe.init(jax.random.PRNGKey(9), CFG)
    small, _ = factorize_init(params, key=jax.random.PRNGKey(5), rank=4)
    out = reuse_weights(small, other, r"^embed/")
    for path, leaf in leaves(out).items():
        src = leaves(other)[path] if path.startswith("embed/") else leaves(small)[path]
        np.testing.assert_array_equal(
            np.asarray(lj.materialize(leaf)), np.asarray(lj.materialize(src))
        )
    with pytest.raises(ValueError, match=r"matches no leaf"):
        reuse_weights(small, other, r"^nope/")
    with pytest.raises(ValueError, match=r"encoder/layers/0/attn/q: expected LowRank"):
        reuse_weights(small, other, r"attn/q$")
