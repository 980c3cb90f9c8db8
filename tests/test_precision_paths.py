"""Precision is a choice: the library's own numbers (SVD and eps-rank inputs, decompositions,
compression errors, compression steps) run with full float32 products on every backend, and the
forward runs at the backend's default unless ``matmul_precision`` asks for more.

XLA:CPU computes float32 products in float32 whatever they carry, so these tests look at what
the products carry: every ``dot_general`` bound while a path runs is recorded (its
``precision`` parameter), and the forward's lowered StableHLO is read. The test suite sets
``jax_default_matmul_precision='highest'`` globally (tests/conftest.py); each test here resets
it to unset first, so that only the library's own scoping can put HIGHEST on a product.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import execution, models
from lowrank_jax.analysis import eps_rank, singular_values
from lowrank_jax.compress import (
    Plan,
    Step,
    apply_plan,
    compare_models,
    compress,
    truncated_svd,
)
from lowrank_jax.decomp import btd_ll1, cp_als
from lowrank_jax.errors import ConfigError
from lowrank_jax.nn import bf16_forward

HIGHEST = jax.lax.Precision.HIGHEST


@pytest.fixture
def dots(monkeypatch):
    """Records the precision of every ``dot_general`` bound (traced or eager) during the test,
    with JAX's default precision unset and its caches cleared (a program traced earlier is
    traced again, so its products are seen)."""
    seen = []
    prim = jax.lax.dot_general_p
    original = prim.bind

    def spy(*args, **params):
        seen.append((params.get("precision"), tuple(jnp.result_type(a) for a in args)))
        return original(*args, **params)

    monkeypatch.setattr(prim, "bind", spy)
    jax.clear_caches()
    with jax.default_matmul_precision(None):
        yield seen
    jax.clear_caches()


def all_highest(seen) -> bool:
    return bool(seen) and all(p == (HIGHEST, HIGHEST) for p, _ in seen)


def lowered_precisions(fn, *args) -> list[str]:
    text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"stablehlo\.dot_general.*?precision = \[(\w+), (\w+)\]", text)


def lowrank(seed=0, d_in=12, d_out=10, r=4):
    return lj.init_lowrank(jax.random.PRNGKey(seed), d_in, d_out, r)


def test_the_spy_sees_default_products_where_nothing_scopes_them(dots):
    """The detector can fail: an unscoped product carries no HIGHEST."""
    a = jnp.ones((3, 3))
    jax.jit(lambda x: x @ x)(a)
    assert dots and not all_highest(dots)
    dots.clear()
    cp_als.__wrapped__(jnp.asarray(np.random.default_rng(0).normal(size=(4, 5, 3)),
                                   jnp.float32), 2, n_iter_max=3)
    assert dots and not all_highest(dots)  # cp_als without its reference-precision scope


def test_eps_rank_and_singular_values_of_a_factored_leaf(dots):
    leaf = lowrank()
    assert eps_rank(leaf, 0.01) == 4
    assert singular_values(leaf).shape == (10,)
    assert all_highest(dots)  # u @ v formed (in float64) under HIGHEST


def test_svd_compression_and_its_report(dots):
    tree = {"blk": {"w": lowrank(1, 16, 16, 6)}}
    new, report = compress(tree, rules=["blk/w"], rank=3, keep_dense_if_larger=False)
    assert report.rows[0].kind == "svd"
    assert all_highest(dots)
    dots.clear()
    assert truncated_svd(lowrank(2), rank=2).rank == 2  # outside any plan
    assert all_highest(dots)


def test_decompositions(dots):
    t = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5, 4)), jnp.float32)
    cp_als(t, 3, n_iter_max=4)
    assert all_highest(dots)
    dots.clear()
    btd_ll1(t, 4, n_iter_max=2)
    assert all_highest(dots)


def test_compare_models_errors_and_plan_steps(dots):
    cfg = models.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=16, num_layers=1,
                          num_heads=2)
    params = models.t5.init(jax.random.PRNGKey(0), cfg)
    small, _ = compress(params, rank=2, keep_dense_if_larger=False)
    dots.clear()
    out = compare_models(cfg, params, small, measure_time=False)
    assert out["rel_error"] > 0
    assert all_highest(dots)  # both forwards of the error
    dots.clear()
    # truncatt forms each head's query-key matrix with JAX products; apply_plan scopes them
    apply_plan(params, Plan([Step("truncatt", ("encoder/layers/0/attn/qk",), {"rank": 2})]))
    assert all_highest(dots)


def test_forward_carries_the_execution_setting():
    cfg = lj.nn.AttentionConfig()
    params = lj.nn.init_attention(jax.random.PRNGKey(0), cfg, d_model=8, num_heads=2)
    x = jnp.ones((2, 5, 8))

    def fwd(p, x):
        return lj.nn.apply_attention(p, x, cfg)

    with jax.default_matmul_precision(None):
        plain = lowered_precisions(fwd, params, x)
        with execution.settings(matmul_precision="highest"):
            high = lowered_precisions(fwd, params, x)
            b16 = lowered_precisions(bf16_forward(fwd), params, x)
        with execution.settings(matmul_precision="default"):
            default = lowered_precisions(fwd, params, x)
    assert plain and all(p == ("DEFAULT", "DEFAULT") for p in plain)  # the backend's default
    assert len(high) == len(plain) and all(p == ("HIGHEST", "HIGHEST") for p in high)
    assert b16 and all(p == ("HIGHEST", "HIGHEST") for p in b16)
    assert default == plain
    with execution.reference_precision() as s:
        assert s.matmul_precision == "highest"
    with pytest.raises(ConfigError, match="matmul_precision"):
        execution.Execution(matmul_precision="tf32")


def test_matmul_precision_is_part_of_the_trace_key():
    f = jax.jit(lambda a: a @ a)
    a = jnp.ones((2, 2))
    with jax.default_matmul_precision(None):
        t1 = f.lower(a).as_text()
        with execution.settings(matmul_precision="highest"):
            t2 = f.lower(a).as_text()
        t3 = f.lower(a).as_text()
    assert "HIGHEST" not in t1 and "HIGHEST" in t2 and "HIGHEST" not in t3


def test_sweeps_and_experiments(dots):
    from lowrank_jax.analysis.experiments import theorem3_experiment
    from lowrank_jax.compress import eps_sweep, head_rank_sweep

    cfg = lj.nn.AttentionConfig()
    params = lj.nn.init_attention(jax.random.PRNGKey(0), cfg, d_model=8, num_heads=2)
    head_rank_sweep(params, jnp.ones((1, 3, 8)), cfg, [1, 2])
    assert all_highest(dots)
    dots.clear()
    t5 = models.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    eps_sweep(t5, models.t5.init(jax.random.PRNGKey(0), t5), None, [0.5])
    assert all_highest(dots)
    dots.clear()
    theorem3_experiment(d=8, n_tokens=16, ranks=[2, 4])
    assert all_highest(dots)
