"""Rank sweeps: every (head, rank) and every eps against explicit truncations run one by one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models
from lowrank_jax.compress import (
    ATTENTION_QKV_PER_HEAD,
    attention_blocks,
    compress,
    eps_sweep,
    head_rank_sweep,
    head_truncated_svd,
    sample_inputs,
    truncated_svd,
)
from lowrank_jax.compress import sweep as sweep_mod
from lowrank_jax.errors import ConfigError, LeafTypeError, ShapeError
from lowrank_jax.leaves import HeadLayout, QueryKey, head_offsets
from lowrank_jax.nn import AttentionConfig, apply_attention, padding_mask

# ---------------------------------------------------------------------------------------------
# Per-head rank sweep.

def _decaying(rng, d_in, d_out):
    a, _ = np.linalg.qr(rng.normal(size=(d_in, d_in)))
    b, _ = np.linalg.qr(rng.normal(size=(d_out, d_out)))
    k = min(d_in, d_out)
    return (a[:, :k] * np.exp(-0.3 * np.arange(k))) @ b[:, :k].T


def _attn(rng, *, d_model, num_heads, d_head, d_kv_in=None, scaled=True, bias=True):
    """An attention block {'qk', 'v', 'o', 'heads'} with decaying spectra."""
    d_kv = d_model if d_kv_in is None else d_kv_in
    inner = num_heads * d_head
    shapes = {"q": (d_model, inner), "k": (d_kv, inner), "v": (d_kv, inner),
              "o": (inner, d_model)}
    w = {}
    for n, (di, do) in shapes.items():
        m = np.asarray(_decaying(rng, di, do), np.float32)
        b = np.asarray(0.1 * rng.normal(size=do), np.float32) if bias else None
        w[n] = lj.Dense(jnp.asarray(m), None if b is None else jnp.asarray(b))
    scale = 1 / np.sqrt(d_head) if scaled else 1.0
    return {"qk": QueryKey.uniform(w["q"], w["k"], num_heads), "v": w["v"], "o": w["o"],
            "heads": HeadLayout.uniform(num_heads, d_head, scale)}


def _proj(params, n):
    return params["qk"].q if n == "q" else params["qk"].k if n == "k" else params[n]


def _with(params, n, leaf):
    """The block with projection ``n`` (q, k or v) replaced."""
    if n == "v":
        return dict(params, v=leaf)
    qk = params["qk"]
    q, k = (leaf, qk.k) if n == "q" else (qk.q, leaf)
    return dict(params, qk=QueryKey(q=q, k=k, widths=qk.widths))


def _np_truncate_head(w, lo, hi, r):
    """Plain NumPy: replace the column block [lo, hi) of w by its best rank-r approximation."""
    w = np.asarray(w, np.float64).copy()
    blk = w[:, lo:hi]
    u, s, vt = np.linalg.svd(blk, full_matrices=False)
    w[:, lo:hi] = (u[:, :r] * s[:r]) @ vt[:r]
    return w


def _loop_reference(params, x, cfg, ranks, which, **kw):
    run = jax.jit(lambda p: apply_attention(p, x, cfg, **kw))  # one compile for the loop
    y = np.asarray(run(params), np.float64)
    widths = {"q": params["qk"].widths, "k": params["qk"].widths, "v": params["heads"].v}
    h_num = params["heads"].num_heads
    out = np.zeros((h_num, len(ranks)))
    for h in range(h_num):
        for j, r in enumerate(ranks):
            p = params
            for n in which:
                off = head_offsets(widths[n])
                leaf = _proj(params, n)
                w = _np_truncate_head(leaf.w, off[h], off[h + 1], r)
                p = _with(p, n, lj.Dense(jnp.asarray(w, jnp.float32), leaf.b))
            yr = np.asarray(run(p), np.float64)
            out[h, j] = np.linalg.norm(yr - y) / np.linalg.norm(y)
    return out


def test_head_rank_sweep_equals_loop_of_explicit_truncations():
    rng = np.random.default_rng(0)
    params = _attn(rng, d_model=24, num_heads=4, d_head=8)
    cfg = AttentionConfig()
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
    params = _attn(rng, d_model=16, num_heads=2, d_head=6, d_kv_in=10, scaled=False,
                   bias=False)
    cfg = AttentionConfig(qkv_keep=0.75, qkv_mask_seed=3)
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


def test_head_rank_sweep_pruned_block_with_irregular_widths():
    """Heads removed and channels pruned: widths come from the block, heads are padded."""
    from lowrank_jax.nn import keep_heads

    rng = np.random.default_rng(6)
    params = keep_heads(_attn(rng, d_model=16, num_heads=4, d_head=5), [0, 2, 3])
    params = dict(params, qk=params["qk"].keep_channels(np.array([0, 1, 2, 5, 7, 10, 11, 12,
                                                                  13, 14])))
    assert params["qk"].widths == (3, 2, 5) and params["heads"].ids == (0, 2, 3)
    x = jnp.asarray(rng.normal(size=(2, 6, 16)), jnp.float32)
    bias = jnp.asarray(0.3 * rng.normal(size=(1, 4, 6, 6)), jnp.float32)  # original heads
    cfg = AttentionConfig()
    ranks = [0, 1, 2, 4]
    got = np.asarray(head_rank_sweep(params, x, cfg, ranks, bias=bias))
    ref = _loop_reference(params, x, cfg, ranks, "qkv", bias=bias)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    got = np.asarray(head_rank_sweep(params, x, cfg, ranks, which=("q", "k"), bias=bias))
    ref = _loop_reference(params, x, cfg, ranks, "qk", bias=bias)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert ref[1, 2] < 1e-5 < ref[2, 2]  # head 1's q/k have width 2: exact from rank 2 on


def test_head_rank_sweep_compiles_once_for_all_ranks(monkeypatch):
    rng = np.random.default_rng(2)
    params = _attn(rng, d_model=16, num_heads=2, d_head=8)
    x = jnp.asarray(rng.normal(size=(1, 4, 16)), jnp.float32)
    traces = []
    real = sweep_mod.apply_attention
    monkeypatch.setattr(sweep_mod, "apply_attention",
                        lambda *a, **k: traces.append(1) or real(*a, **k))
    head_rank_sweep(params, x, None, [1, 2, 3])
    n = len(traces)
    assert n > 0
    head_rank_sweep(params, x, None, [4, 5, 8])  # other ranks, same count: no new trace
    assert len(traces) == n


def test_head_rank_sweep_accepts_factorized_leaves():
    rng = np.random.default_rng(3)
    params = _attn(rng, d_model=16, num_heads=2, d_head=8, bias=False)
    x = jnp.asarray(rng.normal(size=(1, 4, 16)), jnp.float32)
    low = _with(params, "q", head_truncated_svd(params["qk"].q, 2, rank=8))
    low = dict(low, o=truncated_svd(params["o"], rank=16))
    dense = _with(_with(dict(low, v=lj.Dense(lj.materialize(low["v"])),
                             o=lj.Dense(lj.materialize(low["o"]))),
                        "q", lj.Dense(lj.materialize(low["qk"].q))),
                  "k", lj.Dense(lj.materialize(low["qk"].k)))
    a = head_rank_sweep(low, x, None, [1, 4])
    b = head_rank_sweep(dense, x, None, [1, 4])
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_head_rank_sweep_errors_name_the_problem():
    rng = np.random.default_rng(4)
    params = _attn(rng, d_model=16, num_heads=2, d_head=8)
    x = jnp.zeros((1, 4, 16))
    with pytest.raises(ConfigError, match=r"ranks must be .* ints in \[0, 8\]"):
        head_rank_sweep(params, x, None, [9])
    with pytest.raises(ConfigError, match="which must be"):
        head_rank_sweep(params, x, None, [1], which=("o",))
    with pytest.raises(ShapeError, match=r"missing \['o'\]"):
        head_rank_sweep({k: params[k] for k in ("qk", "v", "heads")}, x, None, [1])
    with pytest.raises(ShapeError, match="mask must be boolean"):
        head_rank_sweep(params, x, None, [1], mask=jnp.ones((1, 1, 4, 4)))
    with pytest.raises(ShapeError, match=r"bias has 1 heads|bias must be 4-D"):
        head_rank_sweep(params, x, None, [1], bias=jnp.ones((4, 4)))
    with pytest.raises(LeafTypeError, match="QueryKey"):
        from lowrank_jax.leaves import QK

        class Joint(QK):  # a query-key object without per-head q/k projections
            num_heads = 2
            d_q_in = d_k_in = 16
            logits = score_flops = joint = keep_heads = keep_inputs = None

        head_rank_sweep(dict(params, qk=Joint()), x, None, [1])


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
    y = np.asarray(models.apply(params, inputs, cfg)["logits"], np.float64)
    new, report = compress(params, eps=eps, **kw)
    yc = np.asarray(models.apply(new, inputs, cfg)["logits"], np.float64)
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
    base = float(jnp.mean(jnp.square(models.apply(params, inputs, cfg)["logits"])))
    kinds = set()
    for row, eps in zip(rows, EPS, strict=True):
        report, rel, new = _per_eps_reference(cfg, params, inputs, eps)
        kinds |= {r.kind for r in report.rows}
        assert row["size_ratio"] == report.ratio
        assert row["params_after"] == report.params_after
        assert row["params_before"] == report.params_before
        assert row["max_weight_error"] == pytest.approx(
            max(r.error for r in report.rows), rel=1e-12)
        assert row["output"] == "logits"
        # rel_error is already relative to ||y||: 1e-5 of ||y|| absolute.
        assert abs(row["rel_error"] - rel) <= 1e-5, (eps, row["rel_error"], rel)
        loss = float(jnp.mean(jnp.square(models.apply(new, inputs, cfg)["logits"])))
        assert row["loss"] == pytest.approx(loss, rel=1e-5)
        assert row["base_loss"] == pytest.approx(base, rel=1e-5)
    assert {"svd", "kept-dense"} <= kinds  # both branches of compress are exercised
    assert rows[0]["size_ratio"] < rows[-1]["size_ratio"]
    assert rows[0]["rel_error"] > rows[-1]["rel_error"]
    assert rows[-1]["rel_error"] == 0.0  # eps 0.02 keeps everything dense: exactly the model
    assert rows[-1]["size_ratio"] == 1.0


def test_eps_sweep_per_head_rules_and_lax_map(t5_model):
    cfg, params, inputs = t5_model
    kw = dict(rules=ATTENTION_QKV_PER_HEAD, per_head=True)
    rows = eps_sweep(cfg, params, inputs, EPS[:2], batch_size=1, **kw)
    kinds = set()
    for row, eps in zip(rows, EPS[:2], strict=True):
        report, rel, _ = _per_eps_reference(cfg, params, inputs, eps, **kw)
        kinds |= {r.kind for r in report.rows}
        assert row["size_ratio"] == report.ratio
        assert row["max_weight_error"] == pytest.approx(
            max(r.error for r in report.rows), rel=1e-9)
        assert abs(row["rel_error"] - rel) <= 1e-5, (eps, row["rel_error"], rel)
    assert {"svd-per-head", "svd"} <= kinds  # o stays shared under ATTENTION_QKV_PER_HEAD


def test_eps_sweep_bare_tree_sizes_only():
    rng = np.random.default_rng(5)
    params = {"layers": [{"attn": _attn(rng, d_model=12, num_heads=3, d_head=4, bias=False)}
                         for _ in range(2)]}
    rows = eps_sweep(None, params, None, [0.5, 0.1, 1e-3])
    for row, eps in zip(rows, [0.5, 0.1, 1e-3], strict=True):
        _, report = compress(params, eps=eps)
        assert row["size_ratio"] == report.ratio
        assert row["max_weight_error"] == max(r.error for r in report.rows)
        assert "rel_error" not in row
    rows = eps_sweep(None, params, None, [0.5], per_head=True, rules=ATTENTION_QKV_PER_HEAD)
    _, report = compress(params, eps=0.5, per_head=True, rules=ATTENTION_QKV_PER_HEAD)
    assert rows[0]["size_ratio"] == report.ratio
    with pytest.raises(ValueError, match="eps must be a number in"):
        eps_sweep(None, params, None, [1.5])
    with pytest.raises(ValueError, match="eps_values is empty"):
        eps_sweep(None, params, None, [])


def test_attention_blocks_finds_every_block(t5_model):
    _, params, _ = t5_model
    found = [p for p, _ in attention_blocks(params)]
    assert found == ["decoder/layers/0/cross_attn", "decoder/layers/0/self_attn",
                     "encoder/layers/0/attn"]


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
