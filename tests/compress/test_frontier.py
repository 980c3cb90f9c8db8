"""The compression frontier (lowrank_jax.compress.frontier): Pareto sets and recommendations
against brute force, candidates, scores and counts against NumPy references."""

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.compress import Plan, Step, apply_plan, registered_methods
from lowrank_jax.compress.frontier import (
    Candidate,
    ClassificationData,
    ForecastData,
    OutputData,
    check_budget,
    default_candidates,
    frontier,
    model_flops,
    pareto_front,
    recommend,
)
from lowrank_jax.errors import ConfigError
from lowrank_jax.leaves import Leaf, named_leaves
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt, vit


def brute_front(c, q):
    """Non-dominated points by the definition, O(n^2)."""
    out = []
    for i in range(len(c)):
        if not (np.isfinite(c[i]) and np.isfinite(q[i])):
            continue
        dominated = False
        for j in range(len(c)):
            if j == i or not (np.isfinite(c[j]) and np.isfinite(q[j])):
                continue
            if c[j] <= c[i] and q[j] <= q[i] and (c[j] < c[i] or q[j] < q[i]):
                dominated = True
        if not dominated:
            out.append(i)
    return sorted(out)


@pytest.mark.parametrize("seed", range(6))
def test_pareto_front_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    # small integers: many ties in cost, in loss and whole duplicate points
    c = rng.integers(0, 6, n).astype(float)
    q = rng.integers(0, 6, n).astype(float)
    if seed % 2:
        c[rng.integers(0, n)] = np.nan
        q[rng.integers(0, n)] = np.inf
    got = pareto_front(c, q)
    assert sorted(got.tolist()) == brute_front(c, q)
    assert np.all(np.diff(c[got]) >= 0)  # by increasing cost


def test_pareto_front_continuous_values():
    rng = np.random.default_rng(7)
    c, q = rng.random(200), rng.random(200)
    assert sorted(pareto_front(c, q).tolist()) == brute_front(c, q)


@pytest.mark.parametrize("budget", [0.05, 0.3, 0.5, 0.8, 1.0])
def test_recommend_is_the_best_within_budget_and_on_the_front(budget):
    rng = np.random.default_rng(int(budget * 100))
    c = rng.integers(1, 11, 30) / 10.0
    q = rng.integers(0, 5, 30).astype(float)
    i = recommend(c, q, budget)
    fits = np.flatnonzero(c <= budget)
    if fits.size == 0:
        assert i is None
        return
    assert c[i] <= budget
    assert q[i] == q[fits].min()
    assert c[i] == c[fits][q[fits] == q[fits].min()].min()
    assert i in brute_front(c, q)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_check_budget_rejects(bad):
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        check_budget(bad, "--budget")


def tiny_bolt():
    t5 = T5Config(vocab_size=2, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                  num_heads=2)
    cfg = ChronosBoltConfig(t5=t5, context_length=32, prediction_length=8, input_patch_size=8,
                            input_patch_stride=8, use_reg_token=True)
    return cfg, chronos_bolt.init(jax.random.PRNGKey(0), cfg)


def test_default_candidates_of_a_forecaster():
    cfg, params = tiny_bolt()
    cands, skipped = default_candidates(params, cfg)
    names = [c.name for c in cands]
    assert len(set(names)) == len(names)
    groups = {c.group for c in cands}
    assert {"svd attn", "svd mlp", "svd attn+mlp", "prune", "truncatt", "cp", "btd",
            "truncatt_vo", "prune mlp + svd attn", "truncatt + truncatt_vo"} <= groups
    for g in ("svd attn", "prune", "cp"):
        assert sorted(c.keep for c in cands if c.group == g) == [0.25, 0.5, 0.75]
    by = {c.name: c for c in cands}
    # 2 heads of width 8: per-head ranks round(k * 8), total ranks round(k * 16)
    assert by["truncatt rank=4/head"].plan.steps[0].settings == {"rank": 4}
    assert by["cp R=12"].plan.steps[0].settings == {"rank": 12}
    assert by["prune target=0.25"].plan.steps[0].settings["target"] == 0.25
    combo = by["prune mlp 0.5 + svd attn 0.5"].plan
    assert [s.method for s in combo.steps] == ["prune", "svd"]
    for m in ("lora", "factorize", "partition", "compress_keys"):
        assert m in skipped and skipped[m]
    quick, _ = default_candidates(params, cfg, quick=True)
    assert {c.keep for c in quick} == {0.5}
    only, skipped = default_candidates(params, cfg, methods=["svd"], strengths=[0.3])
    assert [c.name for c in only] == ["svd attn ratio=0.3", "svd mlp ratio=0.3",
                                      "svd attn+mlp ratio=0.3"] and skipped == {}


def test_default_candidates_decided_by_the_leaves():
    key = jax.random.PRNGKey(0)
    params = {"mlp": {"wi": lj.init_dense(key, 8, 16), "wo": lj.init_dense(key, 16, 8)}}
    cands, skipped = default_candidates(params, None, quick=True)
    binary = ["binarize mlp"] if "binarize" in registered_methods() else []
    quant = ["quantize rtn", "lowrank + quantize"] if "quantize" in registered_methods() else []
    assert [c.group for c in cands] == ["svd mlp"] + binary + quant
    for m in ("truncatt", "cp", "btd", "truncatt_vo"):
        assert skipped[m].startswith("not applicable")
    assert "model config" in skipped["prune"]
    with pytest.raises(ConfigError, match="unknown methods"):
        default_candidates(params, None, methods=["nope"])
    with pytest.raises(ConfigError, match="strengths"):
        default_candidates(params, None, strengths=[1.0])


def np_wql(pred, y, levels):
    tau = np.asarray(levels)[None, :, None]
    ind = (y[:, None, :] <= pred).astype(float)
    return float(np.mean(2 * np.sum(np.abs((y[:, None, :] - pred) * (ind - tau)), axis=(0, 2))
                         / np.sum(np.abs(y))))


def np_mase(f, y, c):
    scale = np.mean(np.abs(np.diff(c, axis=1)), axis=1)
    return float(np.mean(np.mean(np.abs(y - f), axis=1) / scale))


def test_forecast_scores_against_numpy():
    cfg, _ = tiny_bolt()
    levels = tuple(cfg.quantiles)
    rng = np.random.default_rng(0)
    n, h = 30, 8
    context = rng.normal(size=(n, 32)).astype(np.float32) + 5
    target = rng.normal(size=(n, h)).astype(np.float32) + 5
    base = np.sort(rng.normal(size=(n, len(levels), h)), axis=1) + 5
    other = base + 0.3 * rng.normal(size=base.shape)
    other.sort(axis=1)
    groups = {"a": (0, 12), "b": (12, 30)}
    data = ForecastData(context, target, groups)
    dense = data.scores(base.astype(np.float32), cfg)
    got = data.score(other.astype(np.float32), dense, cfg)
    med = levels.index(0.5)
    for m, fn in (("wql", lambda p, a, b: np_wql(p[a:b], target[a:b], levels)),
                  ("mase", lambda p, a, b: np_mase(p[a:b, med], target[a:b], context[a:b]))):
        ratios = [fn(other, a, b) / fn(base, a, b) for a, b in groups.values()]
        np.testing.assert_allclose(got[m], np.exp(np.mean(np.log(ratios))), rtol=1e-5)
    np.testing.assert_allclose(got["wql_abs"], np_wql(other, target, levels), rtol=1e-5)
    pooled = ForecastData(context, target).score(other.astype(np.float32), dense, cfg)
    np.testing.assert_allclose(pooled["mase"], np_mase(other[:, med], target, context)
                               / np_mase(base[:, med], target, context), rtol=1e-5)


def test_output_error_score():
    rng = np.random.default_rng(1)
    ref, new = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    data = OutputData({"x": ref})
    got = data.score(new, data.scores(ref, None), None)["rel_error"]
    np.testing.assert_allclose(got, np.sqrt(np.sum((new - ref) ** 2) / np.sum(ref ** 2)),
                               rtol=1e-12)


def test_model_flops_against_a_hand_count():
    cfg, params = tiny_bolt()
    new, _ = apply_plan(params, Plan((Step("svd", (r"attn/(qk/q|qk/k|v|o)$",), {"rank": 2}),)))

    def rows(path):  # context 32 in patches of 8: 4 patches, + REG = 5 encoder tokens
        if path.startswith("input_patch_embedding/"):
            return 4
        if path.startswith("encoder/") or "cross_attn/qk/k" in path or "cross_attn/v" in path:
            return 5
        return 1  # the decoder's one step and the output block

    for tree in (params, new):
        want = sum(rows(p) * sum(a.size for a in jax.tree_util.tree_leaves(n) if a.ndim == 2)
                   for p, n in named_leaves(tree) if isinstance(n, Leaf))
        assert model_flops(cfg, tree) == want


def test_frontier_on_a_classifier_recomputed():
    cfg = vit.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                        num_labels=5)
    params = vit.init(jax.random.PRNGKey(0), cfg)
    x = np.random.default_rng(0).normal(size=(24, 1, 8, 8)).astype(np.float32)
    labels = np.arange(24) % 5
    plan = Plan((Step("svd", (r"mlp/(wi|wo)$",), {"rank": 2}),))
    bad = Plan((Step("svd", (r"no/such/weight$",), {"rank": 2}),))
    res = frontier(cfg, params, ClassificationData({"pixel_values": x}, labels),
                   candidates=[Candidate("svd mlp r2", "svd", 0.1, plan),
                               Candidate("bad", "svd", 0.5, bad)], budget=0.9, time_runs=2)
    assert res.metric == "accuracy" and res.higher_is_better
    dense, row, failed = res.rows
    assert row["error"] is None
    assert "PlanError" in failed["error"] and failed.get("size_ratio") is None  # recorded
    new, _ = apply_plan(params, plan, key=jax.random.fold_in(jax.random.PRNGKey(0), 0),
                        config=cfg)

    def acc(p):
        logits = np.asarray(vit.apply(p, {"pixel_values": x}, cfg)["logits"])
        return float(np.mean(logits.argmax(-1) == labels))

    assert dense["accuracy"] == acc(params) and row["accuracy"] == acc(new)
    sizes = [sum(a.size for a in jax.tree_util.tree_leaves(t)) for t in (params, new)]
    bits = [sum(a.size * a.dtype.itemsize * 8 for a in jax.tree_util.tree_leaves(t))
            for t in (params, new)]
    assert (dense["params"], row["params"]) == tuple(sizes)
    assert row["size_ratio"] == bits[1] / bits[0]
    assert row["time_ratio"] > 0 and row["time_ms"] > 0
    best = res.recommended("size")
    fits = [r for r in res.rows[:2] if r["size_ratio"] <= 0.9]
    assert (best is None) == (not fits)
    if fits:
        assert best["accuracy"] == max(r["accuracy"] for r in fits)
    assert [r["name"] for r in res.frontier("size")] == [
        res.rows[i]["name"] for i in brute_front([r["size_ratio"] for r in res.rows[:2]],
                                                 [-r["accuracy"] for r in res.rows[:2]])]


def test_agreement_without_labels():
    data = ClassificationData({"x": np.zeros((4, 3))})
    ref = np.array([[0, 1, 0], [2, 0, 0], [0, 0, 3], [1, 0, 0]], float)
    new = np.array([[0, 1, 0], [0, 2, 0], [0, 0, 3], [0, 1, 0]], float)
    assert data.metric == "agreement"
    assert data.score(new, data.scores(ref, None), None) == {"agreement": 0.5}
