"""Compressed-by-design initialization (the factorize method): schedule ranks, counts, scale,
errors, weight reuse."""

import math

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.compress import (
    factorize_init,
    interpolation_schedule,
    power_schedule,
    reuse_weights,
)
from lowrank_jax.errors import PlanError, ShapeError
from lowrank_jax.models import patch_encoder as pe

CFG = pe.PatchEncoderConfig(d_model=64, num_heads=4, d_ff=128, num_layers=4, embed_hidden=32)


@pytest.fixture(scope="module")
def params():
    return pe.init(jax.random.PRNGKey(0), CFG)


def leaves(tree):
    return dict(lj.named_leaves(tree))


ATTN = ("qk/q", "qk/k", "v", "o")


def test_power_schedule_ranks_and_ratio_recount(params):
    d0, alpha = 3.0, 0.5
    sched = power_schedule(d0, alpha, CFG.num_layers)
    assert sched == [math.ceil(d0 * (1 + i) ** alpha) for i in range(4)] == [3, 5, 6, 6]
    new, rep = factorize_init(params, key=jax.random.PRNGKey(1), schedule=sched)
    got = leaves(new)
    dense_total = fact_total = 0
    for i in range(4):
        for n in ATTN:
            leaf = got[f"encoder/layers/{i}/attn/{n}"]
            assert isinstance(leaf, lj.LowRank) and leaf.rank == sched[i]
            dense_total += 64 * 64
            fact_total += lj.param_count(leaf)
    assert isinstance(got["encoder/layers/0/mlp/wi"], lj.Dense)  # not selected
    assert rep.params_before == dense_total and rep.params_after == fact_total
    assert rep.ratio == pytest.approx(fact_total / dense_total)
    for row in rep.rows:
        i = int(row.path.split("/")[2])
        assert row.kind == "lowrank" and row.details["rank"] == sched[i] and row.error is None
        assert row.flops_after == sched[i] * 2 * 64 and row.bits_after == 32 * sched[i] * 2 * 64
    # the input tree is untouched
    assert isinstance(leaves(params)["encoder/layers/0/attn/qk/q"], lj.Dense)


def test_app_k_schedule_endpoints_and_clipping(params):
    sched = interpolation_schedule(2, 40, 0.5, 4, max_rank=32)
    ref = [min(32, math.floor(2 + (40 - 2) * ((layer - 1) / 3) ** 0.5 + 0.5)) for layer in range(1, 5)]
    assert sched == ref and sched[0] == 2 and sched[-1] == 32
    new, _ = factorize_init(params, key=jax.random.PRNGKey(2), schedule=sched)
    assert [leaves(new)[f"encoder/layers/{i}/attn/qk/k"].rank for i in range(4)] == sched


def test_factor_scale_matches_dense(params):
    new, _ = factorize_init(params, key=jax.random.PRNGKey(3), rank=16)
    for i in range(4):
        dense = np.asarray(leaves(params)[f"encoder/layers/{i}/attn/v"].w)
        prod = np.asarray(lj.materialize(leaves(new)[f"encoder/layers/{i}/attn/v"]))
        assert prod.std() == pytest.approx(dense.std(), rel=0.15)


def test_per_head_factorization(params):
    new, rep = factorize_init(params, key=jax.random.PRNGKey(4), rank=5, per_head=True)
    got = leaves(new)
    q, o = got["encoder/layers/2/attn/qk/q"], got["encoder/layers/2/attn/o"]
    assert isinstance(q, lj.HeadLowRank) and q.u.shape == (64, 4, 5) and q.v.shape == (4, 5, 16)
    assert isinstance(o, lj.LowRank) and o.rank == 5  # o consumes heads: one shared sketch
    row = rep.row("encoder/layers/2/attn/qk/q")
    assert row.kind == "head-lowrank" and rep.row("encoder/layers/2/attn/o").kind == "lowrank"
    assert row.params_after == lj.param_count(q) == 4 * 5 * (64 + 16)
    y = jax.jit(lambda p, s: pe.apply(p, {"series": s}, CFG))(
        new, np.random.default_rng(0).normal(size=(2, 64))
    )
    assert np.all(np.isfinite(np.asarray(y["last_hidden_state"])))


def test_keys_are_per_path(params):
    """A weight's factors do not depend on which other weights the rules select."""
    a, _ = factorize_init(params, key=jax.random.PRNGKey(7), rank=3)
    b, _ = factorize_init(params, key=jax.random.PRNGKey(7), rank=3, rules=[r"attn/v$"])
    for i in range(4):
        p = f"encoder/layers/{i}/attn/v"
        np.testing.assert_array_equal(np.asarray(lj.materialize(leaves(a)[p])),
                                      np.asarray(lj.materialize(leaves(b)[p])))
    assert not np.array_equal(np.asarray(lj.materialize(leaves(a)["encoder/layers/0/attn/v"])),
                              np.asarray(lj.materialize(leaves(a)["encoder/layers/1/attn/v"])))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=65), r"encoder/layers/0/attn/o \(shape 64x64\) must be .*\[1, 64\], got 65"),
        (
            dict(rank=17, per_head=True),
            r"attn/qk/q \(shape 64x64, 4 heads\) must be an int in \[1, 16\], got 17",
        ),
        (dict(schedule=[4, 4]), r"schedule has 2 ranks but encoder/layers/2/attn/\w is in layer 2"),
        (dict(rank=4, schedule=[4] * 4), r"exactly one of rank= or schedule="),
        (dict(rank=4, rules=["nothing/matches"]), r"nothing/matches"),
        (dict(rank=4, rules=[("attn/v$", {"rank": 0})]), r"attn/v .* got 0"),
    ],
)
def test_bad_configs_are_rejected(params, kwargs, match):
    with pytest.raises(PlanError, match=match):
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
    with pytest.raises(PlanError, match=r"matches no leaf"):
        reuse_weights(small, other, r"^nope/")
    with pytest.raises(ShapeError, match=r"encoder/layers/0/attn/qk/q: expected LowRank"):
        reuse_weights(small, other, r"attn/qk/q$")
    other_small, _ = factorize_init(other, key=jax.random.PRNGKey(6), rank=5)
    with pytest.raises(ShapeError, match=r"attn/qk/q: expected LowRank of shape \(64, 64\)"):
        reuse_weights(small, other_small, r"attn/qk/q$")  # same type and shape, other rank
