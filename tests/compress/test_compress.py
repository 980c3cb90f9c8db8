"""compress() (a one-step svd plan): report numbers, budgets, rules, per-head, inputs, errors --
against NumPy here."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.compress import (
    ATTENTION_QKV_PER_HEAD,
    Report,
    compress,
    power_schedule,
)
from lowrank_jax.errors import PlanError
from lowrank_jax.leaves import (
    Dense,
    HeadLayout,
    HeadLowRank,
    LowRank,
    QueryKey,
    init_dense,
    init_lowrank,
    linear,
    materialize,
    named_leaves,
    param_count,
)

D, FF, LAYERS, HEADS = 24, 48, 3, 4
ATTN = re.compile(r"attn/(qk/q|qk/k|v|o)$")


def make_tree(seed=0):
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    layers = []
    for i in range(LAYERS):
        w = {n: init_dense(next(keys), D, D, bias=(n == "q")) for n in "qkvo"}
        # give layer 1's q a real bias, so "bias kept" is visible
        if i == 1:
            w["q"] = Dense(w["q"].w, jnp.arange(D, dtype=jnp.float32) / D)
        attn = {"qk": QueryKey.uniform(w["q"], w["k"], HEADS), "v": w["v"], "o": w["o"],
                "heads": HeadLayout.uniform(HEADS, D // HEADS, 1 / np.sqrt(D // HEADS))}
        layers.append({
            "attn": attn,
            "norm": {"scale": jnp.ones(D)},
            "mlp": {"wi": init_dense(next(keys), D, FF), "wo": init_dense(next(keys), FF, D)},
        })
    return {"layers": layers, "embed": jax.random.normal(next(keys), (10, D))}


def weights(tree, pattern=ATTN):
    """{path: (w float64, bias size)} of the Dense leaves matched by ``pattern``."""
    out = {}
    for p, leaf in named_leaves(tree):
        if isinstance(leaf, Dense) and pattern.search(p):
            out[p] = (np.asarray(leaf.w, np.float64), 0 if leaf.b is None else leaf.b.size)
    return out


def sv(w):
    # Same LAPACK driver as a thin SVD with vectors, so that candidate eps values (normalized
    # singular values) compare exactly; compute_uv=False may differ in the last bit.
    return np.linalg.svd(w, full_matrices=False)[1]


def np_truncate(w, r):
    U, s, Vt = np.linalg.svd(w, full_matrices=False)
    return (U[:, :r] * s[:r]) @ Vt[:r]


def eps_rank(w, eps):
    s = sv(w)
    return max(1, int(np.sum(s / s[0] > eps)))


def cost(w, nb, r, keep=True):
    """Parameters after truncating ``w`` to rank ``r`` (bias ``nb``), dense if not smaller."""
    before = w.size + nb
    f = r * sum(w.shape) + nb
    return before if keep and f >= before else f


def rank(row):
    """The rank detail of a row (per-head ranks as a tuple)."""
    r = row.details["rank"]
    return tuple(r) if isinstance(r, list) else r


def leaf_at(tree, path):
    return dict(named_leaves(tree))[path]


def snapshot(tree):
    return [(p, type(n), [np.array(a) for a in jax.tree_util.tree_leaves(n)])
            for p, n in named_leaves(tree)]


# ---------------------------------------------------------------------------------------------

def test_eps_report_and_leaves():
    t = make_tree()
    ws = weights(t)
    new, rep = compress(t, eps=0.6)
    assert isinstance(rep, Report) and len(rep.rows) == len(ws) == 4 * LAYERS
    total_before = total_after = 0
    for row in rep.rows:
        w, nb = ws[row.path]
        s = sv(w)
        r = eps_rank(w, 0.6)
        assert tuple(row.details["shape"]) == w.shape and rank(row) == r
        assert row.params_before == w.size + nb
        assert row.params_after == r * 2 * D + nb
        # float32 storage, multiply-adds per token: the counts of the papers, computed here
        assert row.bits_before == 32 * (w.size + nb) and row.bits_after == 32 * (r * 2 * D + nb)
        assert row.flops_before == w.size and row.flops_after == r * 2 * D
        assert row.kind == "svd" and row.method == "svd" and row.step == 0 and row.changed
        assert row.error == pytest.approx(s[r] / s[0], rel=1e-9)
        assert row.error <= 0.6
        leaf = leaf_at(new, row.path)
        assert isinstance(leaf, LowRank) and leaf.rank == r
        np.testing.assert_allclose(np.asarray(materialize(leaf), np.float64), np_truncate(w, r),
                                   atol=1e-5)
        total_before += row.params_before
        total_after += row.params_after
    sel = rep.totals["selected"]
    assert (sel["params_before"], sel["params_after"]) == (total_before, total_after)
    assert rep.ratio == sel["params_ratio"] == total_after / total_before
    assert rep.changed == len(rep.rows)
    # bias kept, and the new tree computes with it
    q1 = leaf_at(new, "layers/1/attn/qk/q")
    x = np.random.default_rng(0).standard_normal((3, D)).astype(np.float32)
    w, _ = ws["layers/1/attn/qk/q"]
    np.testing.assert_allclose(np.asarray(linear(q1, x)),
                               x @ np_truncate(w, q1.rank) + np.arange(D) / D, atol=1e-5)
    # untouched parts are the same objects
    assert new["layers"][0]["mlp"]["wi"] is t["layers"][0]["mlp"]["wi"]
    assert new["embed"] is t["embed"]


def test_input_tree_unchanged():
    t = make_tree()
    before = snapshot(t)
    ids = [id(n) for _, n in named_leaves(t)]
    compress(t, eps=0.3)
    compress(t, ratio=0.5, allocation="energy", per_head=True,
             rules=ATTENTION_QKV_PER_HEAD)
    after = snapshot(t)
    assert [id(n) for _, n in named_leaves(t)] == ids
    assert len(before) == len(after)
    for (p0, t0, a0), (p1, t1, a1) in zip(before, after, strict=True):
        assert p0 == p1 and t0 is t1
        for x0, x1 in zip(a0, a1, strict=True):
            np.testing.assert_array_equal(x0, x1)


def test_rank_and_keep_dense():
    t = make_tree()
    ws = weights(t)
    new, rep = compress(t, rank=12)  # 12 * (24 + 24) == 24 * 24: not smaller
    for row in rep.rows:
        assert row.kind == "kept-dense" and row.params_after == row.params_before
        assert row.error == 0.0
        assert leaf_at(new, row.path) is leaf_at(t, row.path)
    assert rep.ratio == 1.0
    new, rep = compress(t, rank=12, keep_dense_if_larger=False)
    for row in rep.rows:
        w, nb = ws[row.path]
        s = sv(w)
        assert row.kind == "svd" and row.params_after == 12 * 48 + nb
        assert row.error == pytest.approx(s[12] / s[0], rel=1e-9)
    new, rep = compress(t, rank=11)
    assert all(r.kind == "svd" and rank(r) == 11 for r in rep.rows)


def eps_budget_reference(ws, eps, keep=True):
    return sum(cost(w, nb, eps_rank(w, eps), keep) for w, nb in ws.values())


@pytest.mark.parametrize("target", [0.3, 0.45, 0.62, 0.9])
def test_ratio_eps_search_is_exact(target):
    t = make_tree(1)
    rules = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/w")
    ws = weights(t, re.compile(r"attn/(qk/q|qk/k|v|o)$|mlp/w"))
    new, rep = compress(t, rules=rules, ratio=target)
    before = sum(w.size + nb for w, nb in ws.values())
    budget = target * before
    chosen = rep.info()["chosen_eps"]
    cand = sorted({float(c) for w, _ in ws.values() for c in sv(w) / sv(w)[0] if 0 < c < 1})
    assert chosen in cand
    after = eps_budget_reference(ws, chosen)
    assert rep.params_before == before and rep.params_after == after
    assert rep.ratio == pytest.approx(after / before) and rep.ratio <= target
    # the next larger configuration (next smaller eps candidate) would exceed the target
    i = cand.index(chosen)
    assert i > 0 and eps_budget_reference(ws, cand[i - 1]) > budget
    for row in rep.rows:
        w, nb = ws[row.path]
        assert rank(row) == eps_rank(w, chosen)
        assert row.params_after == cost(w, nb, rank(row))


def test_ratio_one_keeps_everything():
    t = make_tree()
    new, rep = compress(t, ratio=1.0)
    assert rep.ratio == 1.0 and all(r.kind == "kept-dense" for r in rep.rows)


def energy_reference(ws, budget):
    """Plain greedy: rank 1 each, then the best sigma_j^2/||W||_F^2/(d_in+d_out) that fits."""
    ranks = {p: 1 for p in ws}
    left = budget - sum(cost(w, nb, 1) for w, nb in ws.values())
    closed = set()
    while True:
        best, best_prio = None, -1.0
        for p, (w, _) in ws.items():
            s = sv(w)
            if p in closed or ranks[p] >= len(s):
                continue
            prio = s[ranks[p]] ** 2 / np.sum(s ** 2) / sum(w.shape)
            if prio > best_prio:
                best, best_prio = p, prio
        if best is None:
            return ranks, left
        c = sum(ws[best][0].shape)
        if c > left:
            closed.add(best)
        else:
            left -= c
            ranks[best] += 1


@pytest.mark.parametrize("target", [0.2, 0.35])
def test_ratio_energy_allocation(target):
    t = make_tree(2)
    rules = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/w")
    ws = weights(t, re.compile(r"attn/(qk/q|qk/k|v|o)$|mlp/w"))
    new, rep = compress(t, rules=rules, ratio=target, allocation="energy")
    before = sum(w.size + nb for w, nb in ws.values())
    budget = target * before
    ranks, left = energy_reference(ws, budget)
    got = {r.path: rank(r) for r in rep.rows}
    assert got == ranks
    assert len(set(ranks.values())) > 1  # energy per cost differs between matrices
    after = sum(cost(w, nb, ranks[p]) for p, (w, nb) in ws.items())
    assert rep.params_after == after <= budget
    # the budget is used up: no matrix can take one more singular value
    for row in rep.rows:
        w, _ = ws[row.path]
        assert row.kind == "svd"
        assert after + sum(w.shape) > budget
    assert budget - after == pytest.approx(left)


@pytest.mark.parametrize("target", [0.9, 1.0])
def test_ratio_energy_near_dense(target):
    # near the dense size some matrices take the "keep it dense" step
    t = make_tree(5)
    rules = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/w")
    new, rep = compress(t, rules=rules, ratio=target, allocation="energy")
    budget = target * rep.params_before
    assert rep.params_after <= budget
    kept = [r for r in rep.rows if r.kind == "kept-dense"]
    assert kept and all(r.params_after == r.params_before for r in kept)
    if target == 1.0:
        assert len(kept) == len(rep.rows) and rep.ratio == 1.0
    for row in rep.rows:  # budget used: no matrix can take its next step
        if row.kind == "svd":
            nxt = min(sum(row.details["shape"]), row.params_before - row.params_after)
            assert rep.params_after + nxt > budget
    ws = weights(t, re.compile(r"attn/(qk/q|qk/k|v|o)$|mlp/w"))
    for row in rep.rows:
        w, nb = ws[row.path]
        if row.kind == "svd":
            assert row.params_after == cost(w, nb, rank(row)) < row.params_before


def test_ratio_energy_per_head_budget():
    t = make_tree(6)
    new, rep = compress(t, rules=ATTENTION_QKV_PER_HEAD, ratio=0.4, allocation="energy",
                        per_head=True)
    budget = 0.4 * rep.params_before
    assert rep.params_after <= budget
    dh = D // HEADS
    for row in rep.rows:
        unit = D + (dh if row.kind == "svd-per-head" else D)
        assert rep.params_after + unit > budget
    assert param_count(new) == param_count(t) - rep.params_before + rep.params_after


def test_lowrank_leaves_are_retruncated():
    t = make_tree()
    for i in range(LAYERS):
        t["layers"][i]["mlp"]["wo"] = init_lowrank(jax.random.PRNGKey(i), FF, D, 6)
    new, rep = compress(t, rules=[r"mlp/wo$"], rank=3)
    for i in range(LAYERS):
        old = t["layers"][i]["mlp"]["wo"]
        prod = np.asarray(old.u, np.float64) @ np.asarray(old.v, np.float64)
        leaf = new["layers"][i]["mlp"]["wo"]
        assert isinstance(leaf, LowRank) and leaf.rank == 3
        np.testing.assert_allclose(np.asarray(materialize(leaf), np.float64),
                                   np_truncate(prod, 3), atol=1e-5)
        s = sv(prod)
        row = rep.row(f"layers/{i}/mlp/wo")
        assert row.params_before == 6 * (FF + D) and row.params_after == 3 * (FF + D)
        assert row.error == pytest.approx(s[3] / s[0], rel=1e-6)
    new, rep = compress(t, rules=[r"mlp/wo$"], rank=6)  # not smaller than the old leaf
    assert all(r.kind == "kept" for r in rep.rows)
    assert new["layers"][0]["mlp"]["wo"] is t["layers"][0]["mlp"]["wo"]


def test_per_head():
    t = make_tree(3)
    ws = weights(t)
    new, rep = compress(t, rules=ATTENTION_QKV_PER_HEAD, eps=0.6, per_head=True)
    dh = D // HEADS
    n_per_head = 0
    x = np.random.default_rng(1).standard_normal((5, D)).astype(np.float32)
    for row in rep.rows:
        w, nb = ws[row.path]
        leaf = leaf_at(new, row.path)
        if row.path.endswith("/o"):  # shared sketch for the output projection
            assert row.kind == "svd" and isinstance(leaf, LowRank)
            assert rank(row) == eps_rank(w, 0.6)
            continue
        heads = [w[:, i * dh:(i + 1) * dh] for i in range(HEADS)]
        ranks = tuple(eps_rank(h, 0.6) for h in heads)
        assert rank(row) == ranks
        if sum(r * (D + dh) for r in ranks) + nb >= w.size + nb:
            assert row.kind == "kept-dense" and leaf is leaf_at(t, row.path)
            continue
        n_per_head += 1
        assert row.kind == "svd-per-head"
        assert isinstance(leaf, HeadLowRank) and leaf.head_ranks == ranks
        ref = np.concatenate([np_truncate(h, r) for h, r in zip(heads, ranks, strict=True)], axis=1)
        assert row.error == pytest.approx(
            np.linalg.norm(w - ref, 2) / np.linalg.norm(w, 2), rel=1e-9)
        assert row.params_after == sum(r * (D + dh) for r in ranks) + nb
        b = 0.0 if leaf.b is None else np.asarray(leaf.b)
        np.testing.assert_allclose(np.asarray(linear(leaf, x)), x @ ref + b, atol=1e-5)
    assert n_per_head >= 6
    assert len({rank(r) for r in rep.rows if r.kind == "svd-per-head"}) > 1


def test_rule_overrides_first_match_and_skip():
    t = make_tree()
    ws = weights(t)
    rules = [
        (r"^layers/0/attn/qk/q$", {"rank": 2}),
        (r"attn/v$", {"eps": 0.3}),
        (r"attn/o$", None),
        (r"^layers/2/attn/qk/k$", {"per_head": True, "rank": 1}),
        r"attn/qk/(q|k)$",
    ]
    new, rep = compress(t, rules=rules, rank=3)
    got = {r.path: r for r in rep.rows}
    assert rank(got["layers/0/attn/qk/q"]) == 2
    assert rank(got["layers/1/attn/qk/q"]) == 3 and rank(got["layers/0/attn/qk/k"]) == 3
    for i in range(LAYERS):
        assert rank(got[f"layers/{i}/attn/v"]) == eps_rank(ws[f"layers/{i}/attn/v"][0], 0.3)
        assert f"layers/{i}/attn/o" not in got
        assert leaf_at(new, f"layers/{i}/attn/o") is leaf_at(t, f"layers/{i}/attn/o")
    # per head: the head count comes from the block's parameters
    assert rank(got["layers/2/attn/qk/k"]) == (1,) * HEADS
    assert got["layers/2/attn/qk/k"].kind == "svd-per-head"
    assert isinstance(leaf_at(new, "layers/2/attn/qk/k"), HeadLowRank)
    assert got["layers/1/attn/qk/q"].rule == r"attn/qk/(q|k)$"


def test_ratio_with_fixed_overrides():
    t = make_tree()
    ws = weights(t)
    new, rep = compress(t, rules=[(r"^layers/0/attn/", {"rank": 1}), r"attn/"], ratio=0.4)
    before = sum(w.size + nb for w, nb in ws.values())
    assert rep.params_after <= 0.4 * before
    for row in rep.rows:
        if row.path.startswith("layers/0/"):
            assert rank(row) == 1
    chosen = rep.info()["chosen_eps"]
    for row in rep.rows:
        if not row.path.startswith("layers/0/"):
            assert rank(row) == eps_rank(ws[row.path][0], chosen)


def round_up(r, k, limit):
    return min(limit, -(-r // k) * k)


@pytest.mark.parametrize("k", [4, 5])
def test_rank_multiple_eps_rounds_up(k):
    t = make_tree(3)
    ws = weights(t)
    new, rep = compress(t, eps=0.6, rank_multiple=k, keep_dense_if_larger=False)
    rounded = 0
    for row in rep.rows:
        w, nb = ws[row.path]
        s = sv(w)
        r0 = eps_rank(w, 0.6)
        r = round_up(r0, k, D)
        rounded += r > r0
        assert rank(row) == r and row.details["rank_multiple"] == k
        assert row.params_after == r * 2 * D + nb and row.flops_after == r * 2 * D
        # more singular values kept: the error is that of rank r, within eps
        assert row.error == pytest.approx(s[r] / s[0], rel=1e-9) and row.error <= 0.6
        leaf = leaf_at(new, row.path)
        assert isinstance(leaf, LowRank) and leaf.rank == r
        np.testing.assert_allclose(np.asarray(materialize(leaf), np.float64), np_truncate(w, r),
                                   atol=1e-5)
    assert rounded >= 3  # the test exercises rounding


def test_rank_multiple_caps_at_head_width_and_rule_override():
    t = make_tree(3)
    ws = weights(t)
    dh = D // HEADS  # 6: multiples of 4 are 4, then the cap 6
    rules = [(r"^layers/0/attn/v$", {"rank_multiple": 1}), r"attn/(qk/q|qk/k|v)$"]
    new, rep = compress(t, rules=rules, eps=0.6, per_head=True, rank_multiple=4,
                        keep_dense_if_larger=False)
    x = np.random.default_rng(1).standard_normal((5, D)).astype(np.float32)
    for row in rep.rows:
        w, nb = ws[row.path]
        heads = [w[:, i * dh:(i + 1) * dh] for i in range(HEADS)]
        k = 1 if row.path == "layers/0/attn/v" else 4
        ranks = tuple(round_up(eps_rank(h, 0.6), k, dh) for h in heads)
        assert row.kind == "svd-per-head" and rank(row) == ranks
        if k == 4:
            assert set(ranks) <= {4, 6}
        leaf = leaf_at(new, row.path)
        ref = np.concatenate([np_truncate(h, r) for h, r in zip(heads, ranks, strict=True)], axis=1)
        b = 0.0 if leaf.b is None else np.asarray(leaf.b)
        np.testing.assert_allclose(np.asarray(linear(leaf, x)), x @ ref + b, atol=1e-5)
    assert any(r != 1 and r % 4 for r in rank(rep.row("layers/0/attn/v")))


@pytest.mark.parametrize("target", [0.4, 0.6])
def test_rank_multiple_ratio_eps_search(target):
    t = make_tree(1)
    k = 4
    ws = weights(t)
    new, rep = compress(t, ratio=target, rank_multiple=k)
    before = sum(w.size + nb for w, nb in ws.values())

    def after(eps):
        return sum(cost(w, nb, round_up(eps_rank(w, eps), k, D)) for w, nb in ws.values())

    chosen = rep.info()["chosen_eps"]
    cand = sorted({float(c) for w, _ in ws.values() for c in sv(w) / sv(w)[0] if 0 < c < 1})
    assert rep.params_after == after(chosen) <= target * before
    # every smaller candidate eps (more singular values) would exceed the budget
    assert all(after(c) > target * before for c in cand if c < chosen)
    for row in rep.rows:
        r = round_up(eps_rank(ws[row.path][0], chosen), k, D)
        assert rank(row) == r and (row.kind == "kept-dense" or r % k == 0)


def energy_blocks_reference(ws, budget, k):
    """Greedy over blocks of k singular values: start at rank k each, then the step with the
    best energy / parameters that fits; one that does not fit closes its matrix. A block that
    would make the factorization as large as the matrix is replaced by "keep it dense": all
    the remaining energy for the remaining parameters."""
    ranks = {p: k for p in ws}
    left = budget - sum(cost(w, nb, k) for w, nb in ws.values())
    closed = set()

    def step(p):  # (energy / parameters, parameters, new rank) of p's next step
        w, nb = ws[p]
        s, r = sv(w), ranks[p]
        dense = w.size + nb
        if cost(w, nb, r + k, keep=False) >= dense:
            return np.sum(s[r:] ** 2) / np.sum(s ** 2) / (dense - cost(w, nb, r)), \
                dense - cost(w, nb, r), len(s)
        return np.sum(s[r:r + k] ** 2) / np.sum(s ** 2) / (k * sum(w.shape)), \
            k * sum(w.shape), r + k

    while True:
        live = [p for p in ws if p not in closed and ranks[p] < len(sv(ws[p][0]))]
        if not live:
            return ranks
        best = max(live, key=lambda p: step(p)[0])
        _, c, r = step(best)
        if c > left:
            closed.add(best)
        else:
            left -= c
            ranks[best] = r


@pytest.mark.parametrize("target", [0.25, 0.4])
def test_rank_multiple_energy_allocation(target):
    t = make_tree(2)
    k = 3
    rules = (r"attn/(qk/q|qk/k|v|o)$", r"mlp/w")
    ws = weights(t, re.compile(r"attn/(qk/q|qk/k|v|o)$|mlp/w"))
    new, rep = compress(t, rules=rules, ratio=target, allocation="energy", rank_multiple=k)
    budget = target * rep.params_before
    ranks = energy_blocks_reference(ws, budget, k)
    got = {r.path: rank(r) for r in rep.rows}
    assert got == ranks
    assert all(r % k == 0 for r in ranks.values()) and len(set(ranks.values())) > 1
    assert rep.params_after == sum(cost(w, nb, ranks[p]) for p, (w, nb) in ws.items()) <= budget
    # the budget is used up: no factorized matrix can take its next block
    for row in rep.rows:
        if row.kind == "svd":
            w, nb = ws[row.path]
            nxt = min(k * sum(w.shape), row.params_before - row.params_after)
            assert rep.params_after + nxt > budget


def test_schedule():
    t = make_tree()
    sched = power_schedule(2, 0.5, LAYERS)  # [2, 3, 4]
    new, rep = compress(t, schedule=sched)
    for row in rep.rows:
        i = int(row.path.split("/")[1])
        w, _ = weights(t)[row.path]
        assert rank(row) == sched[i]
        assert row.error == pytest.approx(sv(w)[sched[i]] / sv(w)[0], rel=1e-9)


def test_inputs_projection():
    t = make_tree()
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 30, 3)) @ rng.standard_normal((3, D))).astype(np.float32)
    path = "layers/1/attn/v"
    new, rep = compress(t, rank=3, inputs={path: x})
    row = rep.row(path)
    assert row.kind == "inputs" and rank(row) == 3
    w = np.asarray(leaf_at(t, path).w, np.float64)
    x2 = x.reshape(-1, D).astype(np.float64)
    B = np.linalg.svd(x2)[2][:3].T
    assert row.error == pytest.approx(
        np.linalg.norm(w - B @ B.T @ w, 2) / np.linalg.norm(w, 2), rel=1e-7)
    y_ref = x2 @ w
    y = np.asarray(linear(leaf_at(new, path), x), np.float64).reshape(-1, D)
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) <= 1e-5
    assert rep.row("layers/1/attn/qk/k").kind == "svd"
    # eps on the inputs' spectrum
    new, rep = compress(t, eps=0.5, inputs={path: x})
    assert rank(rep.row(path)) == eps_rank(x2, 0.5)


def test_report_json_and_table():
    t = make_tree()
    new, rep = compress(t, rules=ATTENTION_QKV_PER_HEAD, per_head=True, eps=0.5)
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["totals"]["selected"]["params_before"] == rep.params_before
    assert d["totals"]["selected"]["params_after"] == rep.params_after
    assert d["totals"]["tree"]["params_before"] == param_count(t)
    assert d["totals"]["tree"]["params_after"] == param_count(new)
    assert d["changed"] == rep.changed
    assert [r["path"] for r in d["rows"]] == [r.path for r in rep.rows]
    for rd, r in zip(d["rows"], rep.rows, strict=True):
        assert rd["details"]["rank"] == (list(rank(r)) if isinstance(rank(r), tuple) else rank(r))
        assert rd["error"] == r.error and rd["kind"] == r.kind and rd["step"] == 0
    assert d["steps"][0]["method"] == "svd" and d["steps"][0]["settings"]["eps"] == 0.5
    table = rep.format_table()
    for r in rep.rows:
        assert r.path in table
    sel_line = next(ln for ln in table.splitlines() if "total (selected)" in ln)
    assert f"{rep.params_before} -> {rep.params_after}" in sel_line


def test_progress_same_result():
    t = make_tree()
    a, ra = compress(t, eps=0.4, progress=True)
    b, rb = compress(t, eps=0.4)
    assert ra.to_dict() == rb.to_dict()
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kwargs, needles", [
    (dict(ratio=0.0), ["ratio", "0.0"]),
    (dict(ratio=1.5), ["ratio", "1.5"]),
    (dict(eps=0.0), ["eps", "0.0"]),
    (dict(eps=1.0), ["eps", "1.0"]),
    (dict(eps=0.1, rank=2), ["eps", "rank"]),
    (dict(rank=25), ["layers/0/attn/o", "25"]),
    (dict(schedule=[2, 3]), ["layers/2/attn/o", "2 ranks", "layer 2"]),
    (dict(rank=2, rules=[r"attn/qk/q$", r"ffn/x"]), ["ffn/x", "layers/0/attn/qk/q"]),
    (dict(rank=7, per_head=True), ["layers/0/attn/qk/q", "7", "min(d_in, d_head)"]),
    (dict(rank=2, rules=[(r"attn/qk/q$", {"rank": 30})]), ["layers/0/attn/qk/q", "30"]),
    (dict(rank=2, rules=[(r"attn/qk/q$", {"per_head": 1})]), ["layers/0/attn/qk/q", "bool"]),
    (dict(rank=2, rules=[(r"attn/qk/q$", {"num_heads": 4})]), ["num_heads", "override"]),
    (dict(rank=2, inputs={"layers/0/mlp/wi": np.ones((4, D))}), ["layers/0/mlp/wi"]),
    (dict(ratio=0.01), ["0.01", "not reachable"]),
    (dict(ratio=0.01, allocation="energy"), ["0.01", "not reachable"]),
    (dict(ratio=0.5, allocation="greedy"), ["allocation", "greedy"]),
    (dict(eps=0.1, rank_multiple=0), ["rank_multiple", "0"]),
    (dict(ratio=0.3, rank_multiple=4), ["0.3", "not reachable", "rank_multiple=4"]),
    (dict(ratio=0.3, allocation="energy", rank_multiple=4), ["not reachable", "rank_multiple=4"]),
    (dict(eps=0.1, rank_multiple=2.0), ["rank_multiple", "2.0"]),
    (dict(eps=0.1, rules=[(r"attn/v$", {"rank_multiple": -8})]), ["layers/0/attn/v", "-8"]),
    (dict(), ["layers/0/attn/o", "eps="]),
])
def test_errors(kwargs, needles):
    with pytest.raises(PlanError) as e:
        compress(make_tree(), **kwargs)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_schedule_needs_layer_index():
    t = {"proj": init_dense(jax.random.PRNGKey(0), 8, 8), **make_tree()}
    with pytest.raises(PlanError, match=r"'proj'.*no layer index"):
        compress(t, rules=[r"^proj$"], schedule=[2, 2, 2])
