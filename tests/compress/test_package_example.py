"""The worked example of the ``lowrank_jax.compress`` package docstring (adding a method with its
frontier candidates) runs as printed: the method works in a plan, and its candidates are
measured by the frontier."""

import textwrap

import jax
import numpy as np
import pytest

import lowrank_jax as lj
import lowrank_jax.compress as compress
from lowrank_jax.compress import Plan, Step, apply_plan, registry
from lowrank_jax.compress.candidates import MLP
from lowrank_jax.compress.frontier import OutputData, default_candidates, frontier
from lowrank_jax.leaves import named_leaves
from lowrank_jax.models import vit


def docstring_example() -> str:
    """The code block after 'Adding a method is one module' in the package docstring."""
    doc = compress.__doc__
    start = doc.index("::\n", doc.index("Adding a method is one module")) + 3
    lines = []
    for line in doc[start:].splitlines():
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


@pytest.fixture
def sketch(monkeypatch):
    """The example's method, registered for one test."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    namespace = {}
    exec(compile(docstring_example(), "<compress docstring>", "exec"), namespace)  # noqa: S102
    assert "sketch" in registry.registered_methods()
    return namespace["sketch"]


def tiny_vit():
    cfg = vit.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        num_labels=3)
    return cfg, vit.init(jax.random.PRNGKey(0), cfg)


def _rank(keep, d_in, d_out):
    return max(1, int(keep * d_in * d_out / (d_in + d_out)))


def test_the_example_is_in_the_docstring():
    code = docstring_example()
    assert "def sketch(params, selection, settings, ctx):" in code
    assert 'register_method("sketch", sketch' in code and "candidates=Candidates(" in code


def test_example_method_runs_in_a_plan(sketch):
    cfg, params = tiny_vit()
    plan = Plan((Step("sketch", MLP, {"keep": 0.5}),))
    new, rep = apply_plan(params, plan, key=jax.random.PRNGKey(3), config=cfg)
    before = dict(named_leaves(params))
    rows = {r.path: r for r in rep.rows}
    mlp = [p for p in before if "/mlp/" in p]
    assert sorted(rows) == sorted(mlp) and len(mlp) == 4
    for path, node in named_leaves(new):
        if path not in rows:
            continue
        w = np.asarray(lj.materialize(before[path]), np.float64)
        d_in, d_out = w.shape
        r = _rank(0.5, d_in, d_out)
        u, v = (np.asarray(x, np.float64) for x in node.factors()[:2])
        assert u.shape == (d_in, r) and v.shape == (r, d_out)
        # Q has orthonormal columns and Q^T W is the projection of W onto them
        np.testing.assert_allclose(u.T @ u, np.eye(r), atol=1e-5)
        np.testing.assert_allclose(u @ v, u @ (u.T @ w), atol=1e-5)
        # no rank-r matrix is closer to W than its truncated SVD (Eckart-Young)
        s = np.linalg.svd(w, compute_uv=False)
        assert np.linalg.norm(w - u @ v) >= np.sqrt(np.sum(s[r:] ** 2)) - 1e-5
        assert rows[path].kind == "sketch"
        assert rows[path].params_after == r * (d_in + d_out) + d_out  # factors and the bias
        np.testing.assert_array_equal(np.asarray(lj.leaves.bias_of(node)),
                                      np.asarray(lj.leaves.bias_of(before[path])))
    out = vit.apply(new, vit.sample_inputs(cfg, np.random.default_rng(0), 2), cfg)
    assert np.all(np.isfinite(np.asarray(out["logits"])))


def test_example_method_candidates_in_the_frontier(sketch):
    cfg, params = tiny_vit()
    cands, skipped = default_candidates(params, cfg, methods=["sketch"])
    assert [c.name for c in cands] == [f"sketch mlp keep={k:g}" for k in (0.75, 0.5, 0.25)]
    assert skipped == {}
    inputs = vit.sample_inputs(cfg, np.random.default_rng(1), 4)
    result = frontier(cfg, params, OutputData(inputs), methods=["sketch"], quick=True,
                      time_runs=1)
    rows = {r["name"]: r for r in result.rows}
    assert list(rows) == ["dense", "sketch mlp keep=0.5"]
    row = rows["sketch mlp keep=0.5"]
    assert row["error"] is None and row["group"] == "sketch mlp"
    # storage of float32 arrays, counted independently: the MLP weights become factors
    bits = sum(32 * np.asarray(a).size for a in jax.tree_util.tree_leaves(params))
    saved = 0
    for path, node in named_leaves(params):
        if "/mlp/" in path:
            d_in, d_out = np.asarray(lj.materialize(node)).shape
            saved += 32 * (d_in * d_out - _rank(0.5, d_in, d_out) * (d_in + d_out))
    assert row["size_ratio"] == pytest.approx((bits - saved) / bits, rel=1e-12)
    assert 0 < row["rel_error"] < 1
