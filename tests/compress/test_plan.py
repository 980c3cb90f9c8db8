"""Plans as data: JSON round trips, steps applied in order, errors, registered methods, per-head
truncation of pruned blocks, report counts recomputed from the leaves."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import models, nn
from lowrank_jax.compress import (
    ATTENTION_QK,
    ATTENTION_QKVO,
    Plan,
    Row,
    Step,
    apply_plan,
    compress,
    factorize_init,
    register_method,
    registered_methods,
)
from lowrank_jax.errors import MissingFileError, PlanError
from lowrank_jax.leaves import QueryKey, bias_of, get_path, replace_paths

CFG = models.PatchEncoderConfig(patch=4, d_model=16, num_heads=4, d_ff=24, num_layers=2,
                                embed_hidden=8)


@pytest.fixture(scope="module")
def params():
    return models.patch_encoder.init(jax.random.PRNGKey(0), CFG)


@pytest.fixture(scope="module")
def series():
    return {"series": jnp.asarray(np.random.default_rng(0).normal(size=(2, 32)), jnp.float32)}


def dense64(leaf):
    return np.asarray(lj.materialize(leaf), np.float64)


def np_truncate(w, r):
    U, s, Vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    return (U[:, :r] * s[:r]) @ Vt[:r]


def leaves(tree):
    return dict(lj.named_leaves(tree))


# ---------------------------------------------------------------------------------------------
# Plans as data.

EXAMPLE = """{"steps": [{"method": "svd",
  "rules": ["attn/qk/(q|k)$", ["attn/v$", {"rank": 3}], ["^encoder/layers/0/", null]],
  "settings": {"eps": 0.5}}]}"""


def test_json_round_trip_and_file(tmp_path):
    plan = Plan((
        Step("factorize", [r"attn/(qk/q|qk/k|v|o)$"], {"schedule": [2, 3], "per_head": True}),
        Step("svd", [(r"^encoder/layers/0/", None), (r"attn/v$", {"rank": 2}), r"attn/o$"],
             {"eps": 0.1, "keep_dense_if_larger": False}),
    ))
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan and back.to_json() == text
    d = json.loads(text)
    assert d["steps"][0]["settings"]["schedule"] == [2, 3]
    assert d["steps"][1]["rules"] == [["^encoder/layers/0/", None], ["attn/v$", {"rank": 2}],
                                      "attn/o$"]
    f = tmp_path / "plan.json"
    f.write_text(EXAMPLE)
    ex = Plan.from_file(f)
    assert ex.steps[0].rules == (("attn/qk/(q|k)$", {}), ("attn/v$", {"rank": 3}),
                                 ("^encoder/layers/0/", None))
    assert Plan.from_json(ex.to_json()) == ex
    with pytest.raises(MissingFileError, match="nope.json"):
        Plan.from_file(tmp_path / "nope.json")
    with pytest.raises(PlanError, match="is a directory"):
        Plan.from_file(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": [{"method": "svd", "rulez": []}]}')
    with pytest.raises(PlanError, match=r"bad\.json.*steps\[0\].*rulez"):
        Plan.from_file(bad)
    bad.write_text("{not json")
    with pytest.raises(PlanError, match=r"bad\.json.*not valid JSON"):
        Plan.from_file(bad)


def test_example_plan_applies_rules_in_order(params):
    new, rep = apply_plan(params, Plan.from_json(EXAMPLE))
    got = {r.path: r for r in rep.rows}
    # first match wins: the skip rule comes last, so of layer 0 it only skips what the rules
    # before it did not catch (the output projection, which nothing else selects)
    assert sorted(got) == sorted([f"encoder/layers/{i}/attn/{n}" for i in range(2)
                                  for n in ("qk/q", "qk/k", "v")])
    assert all(got[f"encoder/layers/{i}/attn/v"].details["rank"] == 3 for i in range(2))
    assert got["encoder/layers/0/attn/v"].rule == "attn/v$"
    for i in range(2):
        w = dense64(leaves(params)[f"encoder/layers/{i}/attn/qk/q"])
        s = np.linalg.svd(w, compute_uv=False)
        r = got[f"encoder/layers/{i}/attn/qk/q"].details["rank"]
        assert r == max(1, int(np.sum(s / s[0] > 0.5)))
    assert leaves(new)["encoder/layers/0/attn/o"] is leaves(params)["encoder/layers/0/attn/o"]
    # with the skip rule first, layer 0 is left alone
    skip_first = Plan((Step("svd", [("^encoder/layers/0/", None), "attn/qk/(q|k)$"],
                            {"eps": 0.5}),))
    _, rep = apply_plan(params, skip_first)
    assert sorted(r.path for r in rep.rows) == ["encoder/layers/1/attn/qk/k",
                                                "encoder/layers/1/attn/qk/q"]


def test_step_validation():
    with pytest.raises(PlanError, match=r"rule 'attn/\(q\$' is not a valid regular expression"):
        Step("svd", ["attn/v$", "attn/(q$"], {"eps": 0.1})
    with pytest.raises(PlanError, match="JSON values"):
        Step("svd", ["attn/v$"], {"eps": np.ones(2)})
    with pytest.raises(PlanError, match="finite"):
        Step("svd", ["attn/v$"], {"eps": float("nan")})
    with pytest.raises(PlanError, match="method must be a non-empty string"):
        Step("", ["attn/v$"])
    with pytest.raises(PlanError, match=r"step \(svd\): no rules"):
        Plan.from_json('{"steps": [{"method": "svd", "settings": {"eps": 0.1}}]}')


@pytest.mark.parametrize("plan, needles", [
    (Plan((Step("svdd", ATTENTION_QKVO, {"eps": 0.1}),)), ["svdd", "'factorize'", "'svd'"]),
    (Plan((Step("svd", ATTENTION_QKVO, {"epsilon": 0.1}),)), ["step 0 (svd)", "epsilon"]),
    (Plan((Step("svd", ATTENTION_QKVO, {"eps": 0.1}),
           Step("svd", ATTENTION_QKVO, {"eps": 1.5}))), ["step 1 (svd)", "eps", "1.5"]),
    (Plan((Step("svd", ATTENTION_QKVO, {"eps": 0.1}),
           Step("factorize", [("attn/v$", {"eps": 0.2})], {"rank": 2}))),
     ["step 1 (factorize)", "override", "eps"]),
    (Plan((Step("svd", ["attn/vv$"], {"eps": 0.1}),)), ["attn/vv$", "matches no",
                                                         "encoder/layers/0/attn/v"]),
    (Plan((Step("svd", ATTENTION_QKVO, {"rank": 2, "ratio": 0.5}),)), ["rank", "ratio"]),
])
def test_plan_errors(params, plan, needles):
    with pytest.raises(PlanError) as e:
        apply_plan(params, plan)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_bad_second_step_fails_before_first_step_runs(params):
    seen = []

    def spy(p, selection, settings, ctx):
        seen.append(ctx.step)
        return p, []

    register_method("test-spy", spy, settings=())
    assert "test-spy" in registered_methods()
    with pytest.raises(PlanError, match="step 1"):
        apply_plan(params, [Step("test-spy", ["attn/v$"]), Step("svd", ["attn/v$"], {"rank": 0})])
    assert seen == []  # validation ran before any step
    apply_plan(params, [Step("test-spy", ["attn/v$"]), Step("test-spy", ["attn/o$"])])
    assert seen == [0, 1]


def test_inputs_and_keys_errors(params):
    with pytest.raises(PlanError, match=r"encoder/layers/0/mlp/wi.*no step used"):
        apply_plan(params, Step("svd", ["attn/v$"], {"rank": 2}),
                   inputs={"encoder/layers/0/mlp/wi": np.ones((3, 16))})
    with pytest.raises(PlanError, match=r"'nope/w'.*not a weight path"):
        apply_plan(params, Step("svd", ["attn/v$"], {"rank": 2}), inputs={"nope/w": np.ones(3)})
    with pytest.raises(PlanError, match="key="):
        apply_plan(params, Step("factorize", ["attn/v$"], {"rank": 2}))


# ---------------------------------------------------------------------------------------------
# Steps applied in order.

def test_factorize_then_svd_retruncates_per_step(params):
    plan = Plan((Step("factorize", ATTENTION_QKVO, {"rank": 4}),
                 Step("svd", ATTENTION_QKVO, {"rank": 2})))
    new, rep = apply_plan(params, plan, key=jax.random.PRNGKey(1))
    mid, _ = factorize_init(params, key=jax.random.PRNGKey(1), rank=4)  # the same step 0
    assert [r.step for r in rep.rows] == [0] * 8 + [1] * 8
    for r0, r1 in zip(rep.step_rows(0), rep.step_rows(1), strict=True):
        assert r0.path == r1.path and r0.kind == "lowrank" and r1.kind == "svd"
        assert r0.method == "factorize" and r1.method == "svd"
        d_in, d_out = r0.details["shape"]
        assert r0.params_before == d_in * d_out and r0.params_after == 4 * (d_in + d_out)
        assert r1.params_before == r0.params_after and r1.params_after == 2 * (d_in + d_out)
        # step 1 truncates what step 0 produced (the same factors factorize_init draws)
        prod = dense64(leaves(mid)[r0.path])
        np.testing.assert_allclose(dense64(leaves(new)[r0.path]), np_truncate(prod, 2),
                                   atol=1e-5)
        s = np.linalg.svd(prod, compute_uv=False)
        assert r1.error == pytest.approx(s[2] / s[0], rel=1e-6)
    assert rep.params_before == sum(r.params_before for r in rep.step_rows(0))
    assert rep.params_after == sum(r.params_after for r in rep.step_rows(1))
    assert [s.method for s in rep.steps] == ["factorize", "svd"]


def test_svd_on_qk_then_vo_equals_one_step(params, series):
    two, rep2 = apply_plan(params, [Step("svd", [r"attn/qk/(q|k)$"], {"eps": 0.4}),
                                    Step("svd", [r"attn/(v|o)$"], {"eps": 0.4})])
    one, rep1 = compress(params, eps=0.4)
    assert jax.tree_util.tree_structure(two) == jax.tree_util.tree_structure(one)
    for a, b in zip(jax.tree_util.tree_leaves(two), jax.tree_util.tree_leaves(one), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert {r.path for r in rep2.step_rows(0)} == {r.path for r in rep1.rows
                                                   if "/qk/" in r.path}
    assert {r.path for r in rep2.step_rows(1)} == {r.path for r in rep1.rows
                                                   if "/qk/" not in r.path}
    assert rep2.params_after == rep1.params_after and rep2.ratio == rep1.ratio
    y1 = models.apply(one, series, CFG)["last_hidden_state"]
    y2 = models.apply(two, series, CFG)["last_hidden_state"]
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))


def test_report_counts_are_the_leaves_own(params):
    new, rep = apply_plan(params, [
        Step("svd", [r"attn/qk/(q|k)$"], {"eps": 0.3, "per_head": True}),
        Step("svd", [r"mlp/wi$"], {"rank": 3}),
    ])
    for r in rep.rows:
        for tree, tag in ((params, "before"), (new, "after")):
            leaf = get_path(tree, r.path)
            assert getattr(r, f"params_{tag}") == leaf.param_count()
            assert getattr(r, f"bits_{tag}") == leaf.storage_bits()
            assert getattr(r, f"flops_{tag}") == leaf.flops(1)

    def tree_counts(tree):
        n = b = f = 0
        for _, x in lj.named_leaves(tree):
            if isinstance(x, lj.Leaf):
                n, b, f = n + x.param_count(), b + x.storage_bits(), f + x.flops(1)
            else:
                n, b = n + x.size, b + x.size * x.dtype.itemsize * 8
        return n, b, f

    for tree, tag in ((params, "before"), (new, "after")):
        n, b, f = tree_counts(tree)
        assert rep.tree[f"params_{tag}"] == n and rep.tree[f"bits_{tag}"] == b
        assert rep.tree[f"flops_{tag}"] == f
    assert rep.changed == sum(r.changed for r in rep.rows) > 0


# ---------------------------------------------------------------------------------------------
# Per-head truncation of pruned blocks: widths come from the parameters.

def _attn(seed=0):
    return nn.init_attention(jax.random.PRNGKey(seed), nn.AttentionConfig(use_bias=True),
                             d_model=12, num_heads=4, d_head=5, d_v=3)


def test_per_head_svd_on_block_with_removed_heads():
    block = nn.keep_heads(_attn(), [0, 2, 3])  # 3 heads of width 5 (q/k) and 3 (v)
    tree = {"layers": [{"attn": block}]}
    new, rep = compress(tree, rules=[r"attn/(qk/q|v)$"], rank=1, per_head=True)
    for name, width in (("qk/q", 5), ("v", 3)):
        path = f"layers/0/attn/{name}"
        row = rep.row(path)
        assert row.kind == "svd-per-head" and row.details["rank"] == [1, 1, 1]
        w = dense64(get_path(tree, path))
        ref = np.concatenate([np_truncate(w[:, h * width:(h + 1) * width], 1)
                              for h in range(3)], axis=1)
        np.testing.assert_allclose(dense64(get_path(new, path)), ref, atol=1e-5)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 12)), jnp.float32)
    y = nn.apply_attention(new["layers"][0]["attn"], x, nn.AttentionConfig())
    assert y.shape == (2, 6, 12)


def test_per_head_svd_on_irregular_widths_is_a_plan_error():
    block = _attn()
    block = {**block, "qk": block["qk"].keep_channels(np.array([0, 1, 2, 5, 6, 10, 15, 16]))}
    assert block["qk"].widths == (3, 2, 1, 2)
    tree = {"layers": [{"attn": block}]}
    with pytest.raises(PlanError, match=r"layers/0/attn/qk/q.*\(3, 2, 1, 2\)") as e:
        compress(tree, rules=[r"attn/qk/q$"], rank=1, per_head=True)
    assert e.value.where == "layers/0/attn/qk/q"
    # the shared sketch works on the same block
    new, rep = compress(tree, rules=[r"attn/qk/q$"], rank=1)
    assert rep.rows[0].kind == "svd" and rep.rows[0].details["shape"] == [12, 8]


# ---------------------------------------------------------------------------------------------
# Methods registered outside the library.

def _scale(p, selection, settings, ctx):
    new, rows = {}, []
    for sel in selection:
        s = {**settings, **sel.overrides}
        leaf = lj.Dense(s["factor"] * lj.materialize(sel.node), bias_of(sel.node))
        new[sel.path] = leaf
        rows.append(Row.compare(sel.path, sel.node, leaf, rule=sel.rule, kind="scaled",
                                error=abs(s["factor"] - 1.0), details={"factor": s["factor"]}))
    ctx.info["scaled"] = len(rows)
    return replace_paths(p, new), rows


def _balance_qk(p, selection, settings, ctx):
    """Scale q by a and k by 1/a: the logits do not change."""
    new, rows = {}, []
    a = settings["a"]
    for sel in selection:
        qk = sel.node
        q = lj.Dense(a * lj.materialize(qk.q), None if bias_of(qk.q) is None
                     else a * bias_of(qk.q))
        k = lj.Dense(lj.materialize(qk.k) / a, None if bias_of(qk.k) is None
                     else bias_of(qk.k) / a)
        node = QueryKey(q=q, k=k, widths=qk.widths)
        new[sel.path] = node
        rows.append(Row.compare(sel.path, qk, node, rule=sel.rule, kind="balanced"))
    return replace_paths(p, new), rows


def test_method_registered_in_a_test_runs_through_plans(params, series):
    register_method("test-scale", _scale, settings=("factor",))
    register_method("test-balance-qk", _balance_qk, selects="qk", settings=("a",))
    plan = Plan.from_json(json.dumps({"steps": [
        {"method": "test-scale", "rules": [["mlp/wi$", {"factor": 2.0}], "mlp/wo$"],
         "settings": {"factor": 0.5}},
        {"method": "test-balance-qk", "rules": list(ATTENTION_QK), "settings": {"a": 4.0}},
        {"method": "svd", "rules": [r"attn/v$"], "settings": {"rank": 2}},
    ]}))
    new, rep = apply_plan(params, plan)
    old_l, new_l = leaves(params), leaves(new)
    for i in range(2):
        p = f"encoder/layers/{i}"
        np.testing.assert_allclose(dense64(new_l[f"{p}/mlp/wi"]),
                                   2.0 * dense64(old_l[f"{p}/mlp/wi"]), rtol=1e-6)
        np.testing.assert_allclose(dense64(new_l[f"{p}/mlp/wo"]),
                                   0.5 * dense64(old_l[f"{p}/mlp/wo"]), rtol=1e-6)
        np.testing.assert_allclose(dense64(new_l[f"{p}/attn/qk/q"]),
                                   4.0 * dense64(old_l[f"{p}/attn/qk/q"]), rtol=1e-6)
    assert [(r.step, r.method, r.kind) for r in rep.rows] == (
        [(0, "test-scale", "scaled")] * 4 + [(1, "test-balance-qk", "balanced")] * 2
        + [(2, "svd", "svd")] * 2)
    qk_row = rep.row("encoder/layers/0/attn/qk")
    assert qk_row.params_before == qk_row.params_after == 2 * 16 * 16
    assert qk_row.flops_before == 2 * 16 * 16
    assert rep.info(0) == {"scaled": 4}
    # the query-key rescaling leaves the model as it was; only the value truncation acts
    ref, _ = compress(params, rules=[r"attn/v$"], rank=2)
    ref = replace_paths(ref, {p: new_l[p] for p in new_l if "/mlp/" in p})
    y = models.apply(new, series, CFG)["last_hidden_state"]
    y_ref = models.apply(ref, series, CFG)["last_hidden_state"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-4)
    with pytest.raises(PlanError, match=r"matches no query-key object"):
        apply_plan(params, Step("test-balance-qk", [r"attn/v$"], {"a": 2.0}))
