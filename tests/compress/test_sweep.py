"""Rank sweeps: every (head, rank) and every eps against explicit truncations run one by one."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models
from lowrank_jax.compress import (
    ATTENTION_QKV_PER_HEAD,
    compress,
    eps_sweep,
    head_rank_sweep,
    head_truncated_svd,
    sample_inputs,
    truncated_svd,
)
from lowrank_jax.compress import sweep as sweep_mod
from lowrank_jax.nn import AttentionConfig, apply_attention, padding_mask

# ---------------------------------------------------------------------------------------------
# Per-head rank sweep.

def _decaying(rng, d_in, d_out):
    a, _ = np.linalg.qr(rng.normal(size=(d_in, d_in)))
    b, _ = np.linalg.qr(rng.normal(size=(d_out, d_out)))
    k = min(d_in, d_out)
    return (a[:, :k] * np.exp(-0.3 * np.arange(k))) @ b[:, :k].T


def _attn(rng, cfg, *, bias=True):
    d_kv = cfg.kv_dim
    shapes = {"q": (cfg.d_model, cfg.inner_dim), "k": (d_kv, cfg.inner_dim),
              "v": (d_kv, cfg.inner_dim), "o": (cfg.inner_dim, cfg.d_model)}
    out = {}
    for n, (di, do) in shapes.items():
        w = np.asarray(_decaying(rng, di, do), np.float32)
        b = np.asarray(0.1 * rng.normal(size=do), np.float32) if bias else None
        out[n] = lj.Dense(jnp.asarray(w), None if b is None else jnp.asarray(b))
    return out


def _np_truncate_head(w, h, dh, r):
    """Plain NumPy: replace head h's column block of w by its best rank-r approximation."""
    w = np.asarray(w, np.float64).copy()
    blk = w[:, h * dh:(h + 1) * dh]
    u, s, vt = np.linalg.svd(blk, full_matrices=False)
    w[:, h * dh:(h + 1) * dh] = (u[:, :r] * s[:r]) @ vt[:r]
    return w


def _loop_reference(params, x, cfg, ranks, which, **kw):
    y = np.asarray(apply_attention(params, x, cfg, **kw), np.float64)
    out = np.zeros((cfg.num_heads, len(ranks)))
    for h in range(cfg.num_heads):
        for j, r in enumerate(ranks):
            p = dict(params)
            for n in which:
                w = _np_truncate_head(params[n].w, h, cfg.head_dim, r)
                p[n] = lj.Dense(jnp.asarray(w, jnp.float32), params[n].b)
            yr = np.asarray(apply_attention(p, x, cfg, **kw), np.float64)
            out[h, j] = np.linalg.norm(yr - y) / np.linalg.norm(y)
    return out


def test_head_rank_sweep_equals_loop_of_explicit_truncations():
    rng = np.random.default_rng(0)
    cfg = AttentionConfig(d_model=24, num_heads=4, d_head=8, use_bias=True)
    params = _attn(rng, cfg)
    x = jnp.asarray(rng.normal(size=(2, 7, 24)), jnp.float32)
    valid = np.ones((2, 7), bool)
    valid[1, -2:] = False
    mask = padding_mask(jnp.asarray(valid))
    bias = jnp.asarray(0.3 * rng.normal(size=(1, 4, 7, 7)), jnp.float32)  # per-head bias
    ranks = [0, 1, 2, 5, 8]
    got = np.asarray(head_rank_sweep(params, x, cfg, ranks, mask=mask, bias=bias))
    assert got.shape == (4, len(ranks))
    ref = _loop_reference(params, x, cfg, ranks, "qkv", mask=mask, bias=bias)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert np.all(ref[:, 0] > 1e-2) and np.all(ref[:, -1] < 1e-5)  # the sweep is not trivial


def test_head_rank_sweep_cross_attention_subset_matches_head_truncated_svd():
    """Only ``v`` truncated, cross-attention with its own kv width, unscaled and activation masks.

    The reference builds each truncated head with head_truncated_svd on that head's block.
    """
    rng = np.random.default_rng(1)
    cfg = AttentionConfig(d_model=16, num_heads=2, d_head=6, d_kv_in=10, scaled=False,
                          qkv_keep=0.75, qkv_mask_seed=3)
    params = _attn(rng, cfg, bias=False)
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(2, 9, 10)), jnp.float32)
    ranks = [1, 3, 6]
    got = np.asarray(head_rank_sweep(params, x, cfg, ranks, which=("v",), kv=kv,
                                     layer_index=2))
    y = np.asarray(apply_attention(params, x, cfg, kv=kv, layer_index=2), np.float64)
    wv = np.asarray(params["v"].w)
    for h in range(2):
        for j, r in enumerate(ranks):
            blk = head_truncated_svd(wv[:, h * 6:(h + 1) * 6], 1, rank=r)
            w = wv.copy()
            w[:, h * 6:(h + 1) * 6] = np.asarray(lj.materialize(blk))
            p = dict(params, v=lj.Dense(jnp.asarray(w)))
            yr = np.asarray(apply_attention(p, x, cfg, kv=kv, layer_index=2), np.float64)
            ref = np.linalg.norm(yr - y) / np.linalg.norm(y)
            assert abs(got[h, j] - ref) <= 1e-5, (h, r, got[h, j], ref)


def test_head_rank_sweep_compiles_once_for_all_ranks():
    rng = np.random.default_rng(2)
    cfg = AttentionConfig(d_model=16, num_heads=2)
    params = _attn(rng, cfg)
    x = jnp.asarray(rng.normal(size=(1, 4, 16)), jnp.float32)
    head_rank_sweep(params, x, cfg, [1, 2, 3])
    n = sweep_mod._head_sweep_jit._cache_size()
    head_rank_sweep(params, x, cfg, [4, 5, 8])  # other ranks, same count: no new compile
    assert sweep_mod._head_sweep_jit._cache_size() == n


def test_head_rank_sweep_accepts_factorized_leaves():
    rng = np.random.default_rng(3)
    cfg = AttentionConfig(d_model=16, num_heads=2)
    params = _attn(rng, cfg, bias=False)
    x = jnp.asarray(rng.normal(size=(1, 4, 16)), jnp.float32)
    low = dict(params, q=head_truncated_svd(params["q"], 2, rank=8),
               o=truncated_svd(params["o"], rank=16))
    dense = {n: lj.Dense(lj.materialize(w)) for n, w in low.items()}
    a = head_rank_sweep(low, x, cfg, [1, 4])
    b = head_rank_sweep(dense, x, cfg, [1, 4])
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_head_rank_sweep_errors_name_the_problem():
    rng = np.random.default_rng(4)
    cfg = AttentionConfig(d_model=16, num_heads=2)
    params = _attn(rng, cfg)
    x = jnp.zeros((1, 4, 16))
    with pytest.raises(ValueError, match=r"ranks must be .* ints in \[0, 8\]"):
        head_rank_sweep(params, x, cfg, [9])
    with pytest.raises(ValueError, match="which must be"):
        head_rank_sweep(params, x, cfg, [1], which=("o",))
    with pytest.raises(ValueError, match="missing"):
        head_rank_sweep({k: params[k] for k in "qkv"}, x, cfg, [1])
    with pytest.raises(ValueError, match="mask must be boolean"):
        head_rank_sweep(params, x, cfg, [1], mask=jnp.ones((1, 1, 4, 4)))
    with pytest.raises(ValueError, match="projection 'q' has shape"):
        head_rank_sweep(params, x, dataclasses.replace(cfg, num_heads=4, d_head=8), [1])


# ---------------------------------------------------------------------------------------------
# Model-level eps sweep.

@pytest.fixture(scope="module")
def t5_model():
    cfg = models.T5Config(vocab_size=40, d_model=32, d_kv=4, d_ff=16, num_layers=1,
                          num_heads=4)
    params = models.t5.init(jax.random.PRNGKey(0), cfg)
    inputs = sample_inputs(cfg, batch=2)
    return cfg, params, inputs


EPS = [0.9, 0.5, 0.02]


def _per_eps_reference(cfg, params, inputs, eps, **kw):
    y = np.asarray(models.apply(cfg, params, **inputs)["logits"], np.float64)
    new, report = compress(params, eps=eps, **kw)
    yc = np.asarray(models.apply(cfg, new, **inputs)["logits"], np.float64)
    return report, np.linalg.norm(yc - y) / np.linalg.norm(y), new


def test_eps_sweep_rows_equal_compress_then_apply(t5_model, monkeypatch):
    cfg, params, inputs = t5_model
    calls = {"apply": 0, "loss": 0}
    real_apply = sweep_mod.model_apply

    def counting_apply(*a, **k):
        calls["apply"] += 1
        return real_apply(*a, **k)

    def loss_fn(out):
        calls["loss"] += 1
        return jnp.mean(jnp.square(out["logits"]))

    monkeypatch.setattr(sweep_mod, "model_apply", counting_apply)
    rows = eps_sweep(cfg, params, inputs, EPS, loss_fn=loss_fn)
    assert calls == {"apply": 1, "loss": 1}  # one trace for all eps values: one compile

    assert [r["eps"] for r in rows] == EPS
    base = float(jnp.mean(jnp.square(models.apply(cfg, params, **inputs)["logits"])))
    kinds = set()
    for row, eps in zip(rows, EPS, strict=True):
        report, rel, new = _per_eps_reference(cfg, params, inputs, eps)
        kinds |= {r.method for r in report.rows}
        assert row["size_ratio"] == report.ratio
        assert row["params_after"] == report.params_after
        assert row["params_before"] == report.params_before
        assert row["max_weight_error"] == pytest.approx(
            max(r.rel_spectral_error for r in report.rows), rel=1e-12)
        assert row["output"] == "logits"
        # rel_error is already relative to ||y||: 1e-5 of ||y|| absolute.
        assert abs(row["rel_error"] - rel) <= 1e-5, (eps, row["rel_error"], rel)
        loss = float(jnp.mean(jnp.square(models.apply(cfg, new, **inputs)["logits"])))
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["base_loss"] == pytest.approx(base, rel=1e-5)
    assert {"svd", "kept-dense"} <= kinds  # both branches of compress are exercised
    assert rows[0]["size_ratio"] < rows[-1]["size_ratio"]
    assert rows[0]["rel_error"] > rows[-1]["rel_error"]
    assert rows[-1]["rel_error"] == 0.0  # eps 0.02 keeps everything dense: exactly the model
    assert rows[-1]["size_ratio"] == 1.0


def test_eps_sweep_per_head_rules_and_lax_map(t5_model):
    cfg, params, inputs = t5_model
    kw = dict(rules=ATTENTION_QKV_PER_HEAD, per_head=True, num_heads=4)
    rows = eps_sweep(cfg, params, inputs, EPS[:2], batch_size=1, **kw)
    kinds = set()
    for row, eps in zip(rows, EPS[:2], strict=True):
        report, rel, _ = _per_eps_reference(cfg, params, inputs, eps, **kw)
        kinds |= {r.method for r in report.rows}
        assert row["size_ratio"] == report.ratio
        assert row["max_weight_error"] == pytest.approx(
            max(r.rel_spectral_error for r in report.rows), rel=1e-9)
        assert abs(row["rel_error"] - rel) <= 1e-5, (eps, row["rel_error"], rel)
    assert {"svd-per-head", "svd"} <= kinds  # o stays shared under ATTENTION_QKV_PER_HEAD


def test_eps_sweep_bare_tree_sizes_only():
    rng = np.random.default_rng(5)
    params = {"layers": [{"attn": {n: lj.Dense(jnp.asarray(_decaying(rng, 12, 12), jnp.float32))
                                   for n in "qkvo"}} for _ in range(2)]}
    rows = eps_sweep(None, params, None, [0.5, 0.1, 1e-3])
    for row, eps in zip(rows, [0.5, 0.1, 1e-3], strict=True):
        _, report = compress(params, eps=eps)
        assert row["size_ratio"] == report.ratio
        assert "rel_error" not in row
    with pytest.raises(ValueError, match="eps must be a number in"):
        eps_sweep(None, params, None, [1.5])
    with pytest.raises(ValueError, match="eps_values is empty"):
        eps_sweep(None, params, None, [])


# ---------------------------------------------------------------------------------------------
# CLI: analyze --sweep.

def test_cli_analyze_sweep_on_model_checkpoint(t5_model, tmp_path, capsys):
    from lowrank_jax.cli.main import main
    from lowrank_jax.io import save_model

    cfg, params, _ = t5_model
    d = tmp_path / "model"
    save_model(d, cfg, params)
    js = tmp_path / "a.json"
    argv = ["analyze", str(d), "--eps", "0.1", "--sweep", "--sweep-eps", "0.9", "0.3",
            "--sweep-heads", "--sweep-ranks", "1", "4", "--json", str(js), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "size ratio" in printed
    rep = json.loads(js.read_text())
    rows = rep["sweep"]["eps"]
    ref = eps_sweep(cfg, params, sample_inputs(cfg), [0.9, 0.3])
    for got, want in zip(rows, ref, strict=True):
        assert got["size_ratio"] == want["size_ratio"]
        assert got["rel_error"] == pytest.approx(want["rel_error"], abs=1e-6)
    heads = rep["sweep"]["heads"]
    assert heads and all(np.shape(h["rel_error"]) == (4, 2) for h in heads)
    assert heads[0]["ranks"] == [1, 4]
