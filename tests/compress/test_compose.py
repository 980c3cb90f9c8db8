"""Several compression methods in one model (issue 14): one plan makes a Chronos-Bolt whose
attention is low rank (flow-of-ranks schedule), whose encoder is structurally pruned, whose input
embedding is Biprop masked-binary and whose decoder MLP is partitioned over machines.

Checked here: the leaf types that meet in one tree; the model's output against the same model
with every weight rebuilt densely in NumPy from the leaves' arrays (1e-5); every count against
the sum over the leaves computed here from their shapes (the papers' formulas); the report's
per-step totals; a jitted train step that changes only trainable arrays; save/load; the export
to PyTorch (the chronos package's ``ChronosBoltModelForForecasting``, 1e-4); the plan's JSON
round trip; both orders of prune and svd; the ``binarize`` method against NumPy; the composition
fixes (svd and binarize of a pruned weight keep its removed channels removed); bad input.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import lowrank_jax as lj
from lowrank_jax import nn, train
from lowrank_jax.compress import binarize_leaf, materialize_leaves, power_schedule
from lowrank_jax.compress.prune import add_channel_masks, register_batches
from lowrank_jax.errors import LeafTypeError, PlanError
from lowrank_jax.io import load_model, save_model
from lowrank_jax.leaves import (
    ChannelPruned,
    Dense,
    Leaf,
    LowRank,
    MaskedBinary,
    Partitioned,
    bias_of,
    get_path,
    is_leaf,
    named_leaves,
    path_str,
    pruned_leaf,
)
from lowrank_jax.leaves.channel_masked import channel_masks, with_channel_masks
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt, family_of

CFG = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                    num_decoder_layers=1, num_heads=4),
                        context_length=64, prediction_length=16, input_patch_size=16,
                        input_patch_stride=16, use_reg_token=True)
SCHEDULE = power_schedule(4, 0.7, 2)  # flow-of-ranks: d_i = ceil(4 (1 + i)^0.7) = [4, 7]
ATTN = r"attn/(qk/q|qk/k|v|o)$"
ENCODER = r"encoder/layers/\d+/(attn/(qk/q|qk/k|v|o)|mlp/(wi|wo))$"
SVD = lj.Step("svd", (ATTN,), {"schedule": list(SCHEDULE)})
PRUNE = lj.Step("prune", (ENCODER,), {"target": 0.4, "steps": 1, "batch_size": 4,
                                      "data": "test-compose-sines"})
BINARIZE = lj.Step("binarize", (r"input_patch_embedding/",), {"keep": 0.5})
PARTITION = lj.Step("partition", (r"decoder/layers/0/mlp/(wi|wo)$",), {"machines": 2, "rank": 4})
PLAN = lj.Plan((SVD, PRUNE, BINARIZE, PARTITION))
CONTEXT = (np.random.default_rng(0).normal(size=(3, 64)).cumsum(1) * 0.3).astype(np.float32)


def sines(config, *, batch_size, seed):
    """Noisy sines as the prune step's batches (no dataset import, deterministic)."""
    fam = family_of(config)
    n = config.context_length + config.prediction_length

    def batches(j):
        rng = np.random.default_rng((seed, j))
        w = np.sin(np.arange(n)[None] * rng.uniform(0.05, 0.5, (batch_size, 1))
                   + rng.uniform(0, 6, (batch_size, 1)))
        w = (w + 0.1 * rng.standard_normal(w.shape)).astype(np.float32)
        return fam.batch_from_windows(config, w[:, :config.context_length],
                                      w[:, config.context_length:])

    return batches


register_batches("test-compose-sines", sines)
forward = jax.jit(lambda p, c: chronos_bolt.apply(p, {"context": c}, CFG)["quantile_preds"])


# ---------------------------------------------------------------------------------------------
# Independent references: dense matrices and counts from a leaf's arrays, in NumPy.

def np_weight(leaf) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W [d_in, d_out] float64, bias or None)`` of a leaf, rebuilt in NumPy from its arrays
    by the formulas of the papers (not by the leaf's own code)."""
    a = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    if isinstance(leaf, Dense):
        return a(leaf.w), a(leaf.b)
    if isinstance(leaf, LowRank):  # W = U V ("Understanding Transformers ...", eq. 19)
        return a(leaf.u) @ a(leaf.v), a(leaf.b)
    if isinstance(leaf, MaskedBinary):  # "Sparse Binary Transformers", eqs. 1-2 (Biprop code)
        w, s = a(leaf.w), a(leaf.s)
        n = w.size
        k = n - int((1 - leaf.keep) * n)
        mask = np.zeros(n)
        mask[np.argsort(-np.abs(s).ravel(), kind="stable")[:k]] = 1
        mask = mask.reshape(w.shape)
        div = k if leaf.divisor == "kept" else max(1, int(leaf.keep * n))
        alpha = np.sum(np.abs(w) * mask) / div
        return alpha * np.where(w >= 0, 1.0, -1.0) * mask, a(leaf.b)
    if isinstance(leaf, Partitioned):  # "Partitioning Transformer Networks", eqs. 26-34
        diag, send, recv = a(leaf.diag), a(leaf.send), a(leaf.recv)
        m, p, c = diag.shape
        w = np.zeros((m * p, m * c))
        for dst in range(m):
            for src in range(m):
                block = diag[dst] if src == dst else send[src] @ recv[dst, (src - dst - 1) % m]
                w[src * p:(src + 1) * p, dst * c:(dst + 1) * c] = block
        return w, None if leaf.b is None else a(leaf.b).reshape(-1)
    if isinstance(leaf, ChannelPruned):  # the base on the kept channels, zeros elsewhere
        base, b = np_weight(leaf.base)
        rows = np.arange(leaf.d_in_full) if leaf.rows is None else np.asarray(leaf.rows)
        cols = np.arange(leaf.d_out_full) if leaf.cols is None else np.asarray(leaf.cols)
        w = np.zeros((leaf.d_in_full, leaf.d_out_full))
        w[np.ix_(rows, cols)] = base
        if b is not None:
            full = np.zeros(leaf.d_out_full)
            full[cols] = b
            b = full
        return w, b
    raise AssertionError(f"no NumPy reference for {type(leaf).__name__}")


def np_counts(leaf) -> tuple[int, int, int]:
    """``(parameters, storage bits, multiply-adds per token)`` of a float32 leaf from its shapes:
    dense and low-rank by size; Biprop by "Sparse Binary Transformers" sec. 5.1 and Table 5 (one
    bit per kept weight plus a float32 gain); partitioned by "Partitioning Transformer Networks"
    eq. 43 and its per-machine products (``M a c + M a r + M (M - 1) r c``)."""
    nb = 0 if bias_of(leaf) is None else int(np.size(bias_of(leaf)))
    if isinstance(leaf, ChannelPruned):
        return np_counts(leaf.base)
    if isinstance(leaf, Dense):
        n = int(np.prod(leaf.w.shape))
        return n + nb, 32 * (n + nb), n
    if isinstance(leaf, LowRank):
        (d_in, r), d_out = leaf.u.shape, leaf.v.shape[1]
        return r * (d_in + d_out) + nb, 32 * (r * (d_in + d_out) + nb), r * (d_in + d_out)
    if isinstance(leaf, MaskedBinary):
        n = int(np.prod(leaf.w.shape))
        k = n - int((1 - leaf.keep) * n)
        return k + 1 + nb, k + 32 + 32 * nb, k
    if isinstance(leaf, Partitioned):
        m, p, c = leaf.diag.shape
        r = leaf.send.shape[-1]
        d_in, d_out = m * p, m * c
        params = d_in * d_out // m + r * d_in + (m - 1) * r * d_out + nb
        return params, 32 * params, m * p * c + m * p * r + m * (m - 1) * r * c
    raise AssertionError(f"no count reference for {type(leaf).__name__}")


def tree_counts(tree) -> tuple[int, int, int]:
    """Sums over the leaves of :func:`np_counts`; plain arrays count their float32 size."""
    total = np.zeros(3, np.int64)
    for _, node in named_leaves(tree):
        if isinstance(node, Leaf):
            total += np_counts(node)
        else:
            n = int(np.size(node))
            assert np.asarray(node).dtype == np.float32
            total += (n, 32 * n, 0)
    return tuple(int(t) for t in total)


def numpy_dense(tree):
    """The tree with every weight leaf replaced by a Dense leaf of its NumPy matrix."""
    def dense(node):
        if not isinstance(node, Leaf):
            return node
        w, b = np_weight(node)
        return Dense(jnp.asarray(w, jnp.float32), None if b is None else jnp.asarray(b, jnp.float32))
    return jax.tree_util.tree_map(dense, tree, is_leaf=is_leaf)


def leaf_types(tree) -> dict[str, str]:
    """``{path: 'Type'}`` or ``'Type(Base)'`` for wrapped leaves."""
    out = {}
    for p, n in named_leaves(tree):
        if isinstance(n, Leaf):
            out[p] = type(n).__name__ + (f"({type(n.base).__name__})"
                                         if isinstance(n, ChannelPruned) else "")
    return out


# ---------------------------------------------------------------------------------------------
# The composed model.

@pytest.fixture(scope="module")
def base():
    return chronos_bolt.init(jax.random.PRNGKey(0), CFG)


@pytest.fixture(scope="module")
def composed(base):
    """The plan, applied after a round trip through JSON (the plan is data)."""
    plan = lj.Plan.from_json(PLAN.to_json())
    new, report = lj.apply_plan(base, plan, config=CFG, key=jax.random.PRNGKey(1))
    return new, report


@pytest.fixture(scope="module")
def composed_out(composed):
    return np.asarray(forward(composed[0], CONTEXT))


def test_plan_json_round_trip_keeps_the_order(tmp_path):
    text = PLAN.to_json()
    assert lj.Plan.from_json(text) == PLAN
    assert [s["method"] for s in json.loads(text)["steps"]] == ["svd", "prune", "binarize",
                                                                 "partition"]
    (tmp_path / "plan.json").write_text(text)
    assert lj.Plan.from_file(tmp_path / "plan.json") == PLAN


def test_one_tree_holds_every_method(composed):
    new, report = composed
    types = leaf_types(new)
    assert {t.split("(")[0] for t in types.values()} >= {"LowRank", "ChannelPruned",
                                                          "MaskedBinary", "Partitioned", "Dense"}
    for path, t in types.items():
        inner = t.split("(")[-1].rstrip(")")  # a pruned weight: the leaf inside the gather
        if path.startswith("encoder/") and "/attn/" in path:
            want = "LowRank"  # svd, then pruned: the factors lost channels
        elif "attn/" in path:
            want = "LowRank"
        elif path.startswith("input_patch_embedding/"):
            want = "MaskedBinary"
        elif path.startswith("decoder/layers/0/mlp/"):
            want = "Partitioned"
        else:
            want = "Dense"  # pruned encoder MLPs, the output embedding
        assert inner == want, path
        assert t.startswith("ChannelPruned") <= path.startswith("encoder/"), path
    pruned = [p for p, t in types.items() if t.startswith("ChannelPruned")]
    assert {p.split("/")[3] for p in pruned} == {"attn", "mlp"}  # residual channels went too
    for path in types:
        if path.startswith("encoder/"):
            row = report.row(path, 1)
            assert row.method == "prune" and row.params_after < row.params_before, path
    # the flow-of-ranks ranks survive pruning (svd first: the rank is the SVD's)
    for path, node in named_leaves(new):
        if "attn/" in path and isinstance(node, Leaf):
            layer = int(path.split("layers/")[1].split("/")[0])
            lowrank = node.base if isinstance(node, ChannelPruned) else node
            assert lowrank.rank == SCHEDULE[layer], path
    assert [s.method for s in report.steps] == ["svd", "prune", "binarize", "partition"]
    assert {r.step for r in report.rows} == {0, 1, 2, 3}


def test_output_equals_numpy_dense_model(composed, composed_out):
    new, _ = composed
    want = np.asarray(forward(numpy_dense(new), CONTEXT))
    np.testing.assert_allclose(composed_out, want, atol=1e-5)


def test_materialize_leaves_against_numpy():
    """materialize_leaves (what an export writes) on one tree of every leaf type here."""
    rng = np.random.default_rng(8)
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    tree = {"dense": Dense(f32(6, 4), f32(4)), "lowrank": LowRank(f32(6, 2), f32(2, 4), f32(4)),
            "binary": MaskedBinary(f32(6, 4), f32(6, 4), f32(4), keep=0.4),
            "pruned": pruned_leaf(LowRank(f32(3, 2), f32(2, 4)), (0, 2, 5), None, 6, 4),
            "split": lj.apply_plan({"w": Dense(f32(6, 4), f32(4))},
                                   lj.Step("partition", ("w$",), {"machines": 2, "rank": 1})
                                   )[0]["w"],
            "norm": f32(6)}
    dense = materialize_leaves(tree)
    for (p, x), (_, y) in zip(named_leaves(dense), named_leaves(tree), strict=True):
        if not isinstance(y, Leaf):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            continue
        w, b = np_weight(y)
        assert isinstance(x, Dense), p
        np.testing.assert_allclose(np.asarray(x.w), w, atol=1e-6, err_msg=p)
        assert (x.b is None) == (b is None), p
        if b is not None:
            np.testing.assert_allclose(np.asarray(x.b), b, atol=1e-7, err_msg=p)


def test_partitioned_mlp_on_a_model_mesh_axis(composed, composed_out):
    """The same composed model with the decoder MLP's two machines on two devices (shard_map
    over 'model', one all-gather of r numbers per token) gives the one-device output."""
    new, _ = composed
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    fn = jax.jit(lambda p, c: chronos_bolt.apply(p, {"context": c}, CFG)["quantile_preds"])
    with jax.set_mesh(mesh):
        got = np.asarray(fn(new, CONTEXT))
    np.testing.assert_allclose(got, composed_out, atol=1e-5)


def test_counts_are_the_sums_of_the_leaves(base, composed):
    new, report = composed
    params, bits, macs = tree_counts(new)
    assert (lj.param_count(new), lj.storage_bits(new), lj.flops(new, 1)) == (params, bits, macs)
    assert lj.flops(new, 7) == 7 * macs
    assert (report.tree["params_after"], report.tree["bits_after"],
            report.tree["flops_after"]) == (params, bits, macs)
    assert report.tree["params_before"] == tree_counts(base)[0]
    # per step: the whole tree before and after it, chained; the rows add up to the change
    chain = [tree_counts(base)]
    for st in report.steps:
        t = st.tree
        assert (t["params_before"], t["bits_before"], t["flops_before"]) == chain[-1]
        chain.append((t["params_after"], t["bits_after"], t["flops_after"]))
        rows = report.step_rows(st.index)
        assert rows and all(r.changed for r in rows)
        for k in ("params", "bits", "flops"):
            assert sum(getattr(r, f"{k}_after") - getattr(r, f"{k}_before") for r in rows) == \
                t[f"{k}_after"] - t[f"{k}_before"], (st.method, k)
    assert chain[-1] == (params, bits, macs)
    for st, line in zip(report.steps, report.format_steps().splitlines()[2:], strict=True):
        assert line.split()[:2] == [str(st.index), st.method]
        assert f"{st.tree['params_before']} -> {st.tree['params_after']}" in line
    assert report.format_table().endswith(report.format_steps())


def test_train_step_changes_only_trainable_arrays(composed):
    new, _ = composed
    opt = optax.adam(1e-2)
    state = train.init_train_state(new, opt, key=jax.random.PRNGKey(2))
    step = train.make_train_step(chronos_bolt.loss(CFG), opt, donate=False)
    batch = sines(CFG, batch_size=4, seed=3)(0)
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    after = train.full_params(state)
    assert jax.tree_util.tree_structure(after) == jax.tree_util.tree_structure(new)
    flat_b, _ = jax.tree_util.tree_flatten_with_path(new)
    flat_a = jax.tree_util.tree_leaves(after)
    mask = jax.tree_util.tree_leaves(lj.trainable_mask(new))
    changed = {}
    for (path, x), y, m in zip(flat_b, flat_a, mask, strict=True):
        same = np.array_equal(np.asarray(x), np.asarray(y))
        name = path_str(path)
        if not m:
            assert same, f"frozen {name} changed"
        changed[name] = not same
    frozen = [p for p, m in zip(changed, mask, strict=True) if not m]
    assert frozen and all(p.endswith("/w") and "input_patch_embedding" in p for p in frozen)
    for prefix, last in (("input_patch_embedding/hidden_layer/", "s"),  # Biprop scores train
                         ("encoder/layers/1/attn/qk/q/", "u"),  # factors of a pruned weight
                         ("encoder/layers/0/mlp/wi/", "w"),  # pruned MLP
                         ("decoder/layers/0/mlp/wi/", "diag"),  # partitioned
                         ("decoder/layers/0/mlp/wo/", "recv"),
                         ("decoder/layers/0/cross_attn/v/", "v")):
        (p,) = [p for p in changed if p.startswith(prefix) and p.endswith("/" + last)]
        assert changed[p], p


def test_save_load_round_trip(tmp_path, composed, composed_out):
    new, _ = composed
    save_model(tmp_path / "m", CFG, new)
    cfg, loaded = load_model(tmp_path / "m")
    assert cfg == CFG
    assert leaf_types(loaded) == leaf_types(new)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(new)
    for x, y in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(new),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(forward(loaded, CONTEXT)), composed_out)


def test_export_loads_in_pytorch(tmp_path, composed, composed_out):
    torch = pytest.importorskip("torch")
    bolt_ref = pytest.importorskip("chronos.chronos_bolt")
    from lowrank_jax.convert import save_pretrained

    new, _ = composed
    summary = save_pretrained(CFG, new, tmp_path / "hf")
    compressed = {p for p, n in named_leaves(new) if isinstance(n, Leaf) and not isinstance(n, Dense)}
    assert set(summary["materialized"]) == compressed
    assert set(summary["widened"]) == {"encoder/layers/0/attn", "encoder/layers/0/mlp",
                                       "encoder/layers/1/attn", "encoder/layers/1/mlp"}
    model = bolt_ref.ChronosBoltModelForForecasting.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        got = model(context=torch.from_numpy(CONTEXT)).quantile_preds.numpy()
    assert np.abs(got - composed_out).max() <= 1e-4


# ---------------------------------------------------------------------------------------------
# Order: prune then svd vs svd then prune.

ORDER_RULES = (r"encoder/layers/\d+/attn/(qk/q|qk/k|v|o)$",)
#: per weight: (input channels, output channels) removed. Query/key channels 1 and 9 go in pairs,
#: value channel 2 from v's outputs and o's inputs; residual input 3 of q and residual output 7
#: of o become gathers/scatters (ChannelPruned).
DROP = {"qk/q": ((3,), (1, 9)), "qk/k": ((), (1, 9)), "v": ((), (2,)), "o": ((2,), (7,))}
RANK = 3


def fixed_masks(tree):
    """The encoder attention masked by hand (the same channels in both orders)."""
    tree = add_channel_masks(tree, ORDER_RULES)
    masks = {}
    for p, (m_in, m_out) in channel_masks(tree).items():
        d_in, d_out = DROP[p.split("attn/")[1]]
        m_in, m_out = m_in.copy(), m_out.copy()
        m_in[list(d_in)] = 0
        m_out[list(d_out)] = 0
        masks[p] = (m_in, m_out)
    return with_channel_masks(tree, masks)


def best_rank(w, r):
    U, s, Vt = np.linalg.svd(w, full_matrices=False)
    return (U[:, :r] * s[:r]) @ Vt[:r], s


def test_prune_then_svd_vs_svd_then_prune(base):
    """With the same channels removed, the two orders differ only in what the SVD sees: prune
    then svd is the best rank-r approximation of the kept block (Eckart-Young); svd then prune
    is the kept block of the best rank-r approximation of the whole matrix. Both are checked in
    NumPy, both trees are counted right and run."""
    svd = lj.Step("svd", ORDER_RULES, {"rank": RANK})
    prune = lj.Step("prune", ORDER_RULES, {})
    prune_first, rep_p = lj.apply_plan(fixed_masks(base), lj.Plan((prune, svd)))
    factored, rep_s = lj.apply_plan(base, svd)
    svd_first, rep_s2 = lj.apply_plan(fixed_masks(factored), prune)
    assert leaf_types(prune_first) == leaf_types(svd_first)
    for path, w_full in named_leaves(base):
        if not (path.startswith("encoder/") and "/attn/" in path and isinstance(w_full, Leaf)):
            continue
        w = np.asarray(w_full.w, np.float64)
        d_in, d_out = DROP[path.split("attn/")[1]]
        rows = np.setdiff1d(np.arange(32), d_in)
        cols = np.setdiff1d(np.arange(32), d_out)
        kept = w[np.ix_(rows, cols)]
        want_p, s_kept = best_rank(kept, RANK)  # prune, then svd
        want_s = best_rank(w, RANK)[0][np.ix_(rows, cols)]  # svd, then prune
        got = {}
        for name, tree in (("p", prune_first), ("s", svd_first)):
            leaf = get_path(tree, path)
            inner = leaf.base if isinstance(leaf, ChannelPruned) else leaf
            assert isinstance(inner, LowRank) and inner.rank == RANK, path
            got[name] = np_weight(inner)[0]
            assert lj.param_count(leaf) == RANK * (rows.size + cols.size)
        np.testing.assert_allclose(got["p"], want_p, atol=1e-5, err_msg=path)
        np.testing.assert_allclose(got["s"], want_s, atol=1e-5, err_msg=path)
        assert np.abs(got["p"] - got["s"]).max() > 1e-3  # the orders differ
        assert np.linalg.norm(kept - want_p, 2) <= np.linalg.norm(kept - want_s, 2) + 1e-9
        # the svd rows say which matrix each SVD saw
        row_p, row_s = rep_p.row(path, 1), rep_s.row(path, 0)
        assert row_p.details["shape"] == [rows.size, cols.size]
        assert row_p.error == pytest.approx(s_kept[RANK] / s_kept[0], rel=1e-5)
        s_full = np.linalg.svd(w, compute_uv=False)
        assert row_s.details["shape"] == [32, 32]
        assert row_s.error == pytest.approx(s_full[RANK] / s_full[0], rel=1e-5)
        assert rep_p.row(path, 0).params_after == row_p.params_before  # svd got the pruned one
        assert rep_s2.row(path).params_before == row_s.params_after  # prune got the factors
    outs = []
    for tree in (prune_first, svd_first):
        assert (lj.param_count(tree), lj.storage_bits(tree), lj.flops(tree, 1)) == \
            tree_counts(tree)
        outs.append(np.asarray(forward(tree, CONTEXT)))
        assert np.all(np.isfinite(outs[-1]))
    assert np.abs(outs[0] - outs[1]).max() > 1e-4


# ---------------------------------------------------------------------------------------------
# The binarize method.

def small_tree(bias=True):
    rng = np.random.default_rng(3)
    w = rng.normal(size=(10, 7)).astype(np.float32)
    b = rng.normal(size=7).astype(np.float32) if bias else None
    return {"mlp": {"wi": Dense(jnp.asarray(w), None if b is None else jnp.asarray(b))}}, w, b


@pytest.mark.parametrize("keep,divisor", [(0.3, "reference"), (0.5, "kept"), (1.0, "reference")])
def test_binarize_against_numpy(keep, divisor):
    tree, w, b = small_tree()
    new, report = lj.apply_plan(tree, lj.Step("binarize", ("mlp/wi$",),
                                              {"keep": keep, "divisor": divisor}))
    leaf = new["mlp"]["wi"]
    assert isinstance(leaf, MaskedBinary) and leaf.keep == keep and leaf.divisor == divisor
    np.testing.assert_array_equal(np.asarray(leaf.w), w)  # the trained signs are kept
    np.testing.assert_array_equal(np.asarray(leaf.s), np.abs(w))  # magnitude scores
    n = w.size
    k = n - int((1 - keep) * n)
    top = np.argsort(-np.abs(w).ravel())[:k]
    mask = np.zeros(n)
    mask[top] = 1
    alpha = np.abs(w).ravel()[top].sum() / (k if divisor == "kept" else int(keep * n))
    want = alpha * np.sign(w) * mask.reshape(w.shape)
    np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(leaf.b), b)
    x = np.random.default_rng(4).normal(size=(3, 10)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lj.linear(leaf, x)), x @ want + b, atol=1e-5)
    row = report.row("mlp/wi")
    assert row.kind == "binary" and row.details["n_keep"] == k
    assert row.details["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert row.error == pytest.approx(np.linalg.norm(w - want, 2) / np.linalg.norm(w, 2),
                                      rel=1e-5)
    assert (row.params_before, row.params_after) == (n + 7, k + 1 + 7)
    assert (row.bits_before, row.bits_after) == (32 * (n + 7), k + 32 + 32 * 7)
    assert (row.flops_before, row.flops_after) == (n, k)
    # Biprop trains the scores and the bias, not the weights
    assert lj.trainable_mask(leaf).w is False and lj.trainable_mask(leaf).s is True


def test_binarize_uniform_scores_need_a_key():
    tree, w, _ = small_tree(bias=False)
    step = lj.Step("binarize", ("mlp/wi$",), {"keep": 0.5, "scores": "uniform"})
    with pytest.raises(PlanError, match="key") as e:
        lj.apply_plan(tree, step)
    assert e.value.where == "mlp/wi"
    a, _ = lj.apply_plan(tree, step, key=jax.random.PRNGKey(5))
    b, _ = lj.apply_plan(tree, step, key=jax.random.PRNGKey(5))
    s = np.asarray(a["mlp"]["wi"].s)
    np.testing.assert_array_equal(s, np.asarray(b["mlp"]["wi"].s))
    assert np.abs(s).max() <= 1 / np.sqrt(10) and np.unique(s).size == s.size
    np.testing.assert_array_equal(np.asarray(a["mlp"]["wi"].w), w)


def test_binarize_of_a_pruned_weight_keeps_its_removed_channels_removed():
    """Regression: a weight whose channels prune removed (ChannelPruned) is binarized on its
    kept channels; the removed rows/columns stay out of the leaf and of its counts."""
    rng = np.random.default_rng(6)
    base = Dense(jnp.asarray(rng.normal(size=(5, 3)), jnp.float32))
    pruned = pruned_leaf(base, (0, 2, 3, 6, 7), (1, 2, 4), 8, 6)
    new, report = lj.apply_plan({"w": pruned}, lj.Step("binarize", ("w$",), {"keep": 0.4}))
    leaf = new["w"]
    assert isinstance(leaf, ChannelPruned) and isinstance(leaf.base, MaskedBinary)
    assert (leaf.rows, leaf.cols, leaf.shape) == (pruned.rows, pruned.cols, (8, 6))
    k = 15 - int(0.6 * 15)
    assert leaf.param_count() == k + 1 and report.row("w").details["n_keep"] == k
    w, _ = np_weight(leaf)
    np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), w, atol=1e-7)
    assert np.count_nonzero(w) == k  # nothing outside the kept channels
    np.testing.assert_array_equal(np.asarray(leaf.base.w), np.asarray(base.w))


def test_svd_of_a_pruned_weight_factors_its_kept_channels():
    """Regression: svd of a ChannelPruned weight used to factor the zero-padded full matrix
    (the removed rows stored as zeros in U, counted); it now factors the kept channels."""
    rng = np.random.default_rng(7)
    kept = rng.normal(size=(6, 9))
    pruned = pruned_leaf(Dense(jnp.asarray(kept, jnp.float32)), (0, 1, 4, 5, 8, 9),
                         None, 12, 9)
    new, report = lj.apply_plan({"w": pruned}, lj.Step("svd", ("w$",), {"rank": 2}))
    leaf = new["w"]
    assert isinstance(leaf, ChannelPruned) and isinstance(leaf.base, LowRank)
    assert leaf.base.shape == (6, 9) and leaf.rows == pruned.rows
    assert lj.param_count(leaf) == 2 * (6 + 9) == report.row("w").params_after
    U, s, Vt = np.linalg.svd(kept)
    want = np.zeros((12, 9))
    want[list(pruned.rows)] = (U[:, :2] * s[:2]) @ Vt[:2]
    np.testing.assert_allclose(np.asarray(lj.materialize(leaf)), want, atol=1e-5)
    assert report.row("w").error == pytest.approx(s[2] / s[0], rel=1e-6)
    # data-aware (App. D): activations come at the full width; the kept rows are projected
    x = rng.normal(size=(40, 12)).astype(np.float32)
    new, report = lj.apply_plan({"w": pruned}, lj.Step("svd", ("w$",), {"rank": 2}),
                                inputs={"w": x})
    basis = np.linalg.svd(x[:, list(pruned.rows)].astype(np.float64))[2][:2].T  # [6, 2]
    want[:] = 0
    want[list(pruned.rows)] = basis @ (basis.T @ kept)
    assert report.row("w").kind == "inputs" and isinstance(new["w"], ChannelPruned)
    np.testing.assert_allclose(np.asarray(lj.materialize(new["w"])), want, atol=1e-5)


def test_step_totals_include_the_partners_a_step_changes():
    """Regression for the per-step summary: pruning only ``mlp/wi`` also slices ``mlp/wo``
    (the hidden channels go from both); the step's rows cover ``wi``, its tree totals both."""
    cfg = nn.MLPConfig()
    mlp = nn.init_mlp(jax.random.PRNGKey(0), cfg, d_model=8, d_ff=16)
    masked = add_channel_masks({"mlp": mlp}, (r"mlp/wi$",))
    (path, (m_in, m_out)), = channel_masks(masked).items()
    m_out = m_out.copy()
    m_out[[2, 3, 11]] = 0
    masked = with_channel_masks(masked, {path: (m_in, m_out)})
    new, report = lj.apply_plan(masked, lj.Step("prune", (r"mlp/wi$",), {}))
    assert new["mlp"]["wi"].shape == (8, 13) and new["mlp"]["wo"].shape == (13, 8)
    (row,) = report.step_rows(0)
    assert row.params_before - row.params_after == 3 * 8  # wi's columns
    t = report.steps[0].tree
    assert t["params_before"] - t["params_after"] == 2 * 3 * 8  # and wo's rows
    assert t["params_after"] == lj.param_count(new) == tree_counts(new)[0]


# ---------------------------------------------------------------------------------------------
# Bad input and refused orders: clear errors naming the setting, the rule or the path.

@pytest.mark.parametrize("keep", [0, 0.0, -0.2, 1.5, True, "half"])
def test_binarize_keep_outside_0_1_is_refused_before_any_step(keep):
    tree, _, _ = small_tree()
    plan = lj.Plan((lj.Step("svd", ("mlp/wi$",), {"rank": 2}),
                    lj.Step("binarize", ("mlp/wi$",), {"keep": keep})))
    with pytest.raises(PlanError, match=r"step 1 \(binarize\).*keep must be a fraction in "
                                        r"\(0, 1\]") as e:
        lj.apply_plan(tree, plan)
    assert e.value.where == "keep" and e.value.actual == keep


def test_binarize_bad_override_and_settings_name_the_path_or_key():
    tree, _, _ = small_tree()
    with pytest.raises(PlanError, match="mlp/wi: keep must be") as e:
        lj.apply_plan(tree, lj.Step("binarize", [("mlp/wi$", {"keep": 1.2})], {}))
    assert e.value.where == "mlp/wi" and e.value.actual == 1.2
    for settings, key in (({"divisor": "mean"}, "divisor"), ({"scores": "gaussian"}, "scores")):
        with pytest.raises(PlanError, match=key) as e:
            lj.apply_plan(tree, lj.Step("binarize", ("mlp/wi$",), settings))
        assert e.value.where == key
    with pytest.raises(PlanError, match=r"unknown settings \['kep'\]"):
        lj.apply_plan(tree, lj.Step("binarize", ("mlp/wi$",), {"kep": 0.5}))


def test_a_rule_matching_nothing_names_the_rule_and_the_paths(composed):
    new, _ = composed
    with pytest.raises(PlanError, match=r"step 0 \(binarize\): rule 'encoder/mlp/wi\$' matches "
                                        r"no weight leaf.*available paths") as e:
        lj.apply_plan(new, lj.Step("binarize", (r"encoder/mlp/wi$",), {}))
    assert e.value.where == "encoder/mlp/wi$"
    # binary weights are no float matrices for svd, partition or another binarize
    for method, settings in (("svd", {"rank": 2}), ("binarize", {})):
        with pytest.raises(PlanError, match="matches no weight leaf this method accepts"):
            lj.apply_plan(new, lj.Step(method, (r"input_patch_embedding/",), settings))
    with pytest.raises(LeafTypeError, match="partition: input_patch_embedding/hidden_layer: "
                                            "cannot truncate a MaskedBinary"):
        lj.apply_plan(new, lj.Step("partition", (r"input_patch_embedding/",),
                                   {"machines": 2, "rank": 1}))
    with pytest.raises(LeafTypeError, match="input_patch_embedding/hidden_layer"):
        binarize_leaf(new["input_patch_embedding"]["hidden_layer"],
                      "input_patch_embedding/hidden_layer", keep=0.5)


def test_refused_and_working_orders():
    """What the compose module says about the orders of prune with partition and binarize
    (that binarize then prune freezes the binary weights is tests/leaves/test_surgery.py's)."""
    cfg = nn.MLPConfig()
    tree = {"mlp": nn.init_mlp(jax.random.PRNGKey(0), cfg, d_model=16, d_ff=32)}
    mlp = (r"mlp/(wi|wo)$",)
    run = jax.jit(lambda p, x: nn.apply_mlp(p["mlp"], x, cfg))
    x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32)

    def masked(t, drop):  # hidden channels `drop` masked
        t = add_channel_masks(t, mlp)
        ms = {p: (mi, mo.copy()) for p, (mi, mo) in channel_masks(t).items()}
        ms["mlp/wi"][1][list(drop)] = 0
        return with_channel_masks(t, ms)

    prune = lj.Step("prune", mlp, {})
    partition = lj.Step("partition", mlp, {"machines": 2, "rank": 2})
    # partition then prune: a partitioned weight cannot lose single channels
    split, _ = lj.apply_plan(tree, partition)
    with pytest.raises(PlanError, match="mlp/wi is a Partitioned, which cannot lose single "
                                        "channels") as e:
        lj.apply_plan(add_channel_masks(split, mlp), prune)
    assert e.value.where == "mlp/wi"
    # prune then partition: the pruned hidden width must split evenly over the machines
    odd, _ = lj.apply_plan(masked(tree, (5,)), prune)
    with pytest.raises(PlanError, match="mlp/wi: 31 outputs are not divisible by machines = 2"):
        lj.apply_plan(odd, partition)
    even, _ = lj.apply_plan(masked(tree, (5, 9)), prune)
    both, _ = lj.apply_plan(even, lj.Step("partition", mlp, {"machines": 2, "rank": 1000}))
    assert isinstance(both["mlp"]["wi"], Partitioned) and both["mlp"]["wi"].shape == (16, 30)
    np.testing.assert_allclose(np.asarray(run(both, x)), np.asarray(run(even, x)),  # full rank
                               atol=1e-5)
    # prune then binarize: binary on the kept channels, scores trainable
    pb, _ = lj.apply_plan(even, lj.Step("binarize", mlp, {"keep": 0.5}))
    assert isinstance(pb["mlp"]["wi"], MaskedBinary) and pb["mlp"]["wi"].shape == (16, 30)
    assert lj.trainable_mask(pb["mlp"]["wi"]).s is True
