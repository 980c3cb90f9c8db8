"""`compress` says when a plan changes nothing or little, and which eps / rank reaches a size;
the suggestions are checked against a NumPy count and by compressing again."""

import json

import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.compress import compress
from lowrank_jax.io import save_params

D = 24


def full_rank_params(seed=0):
    """Two layers of Gaussian 24x24 attention matrices: eps-rank at 0.1 is about 20, so a
    factorization (r * 48 parameters) is larger than the matrix (576) and --eps 0.1 keeps all."""
    r = np.random.default_rng(seed)
    layers = []
    for _ in range(2):
        w = {n: lj.Dense(np.asarray(r.normal(size=(D, D)), np.float32)) for n in "qkvo"}
        layers.append({"attn": {"qk": lj.QueryKey.uniform(w["q"], w["k"], 4), "v": w["v"],
                                "o": w["o"], "heads": lj.HeadLayout.uniform(4, D // 4, 0.5)}})
    return {"layers": layers}


def matrices(params):
    return [np.asarray(lj.materialize(leaf), np.float64) for path, leaf in lj.named_leaves(params)
            if path.rsplit("/", 1)[-1] in "qkvo"]


def cost(w, r):
    """Parameters of W after truncation to rank r (kept dense when not smaller)."""
    d_in, d_out = w.shape
    return min(r * (d_in + d_out), d_in * d_out)


def total_at_eps(ws, eps):
    out = 0
    for w in ws:
        s = np.linalg.svd(w, compute_uv=False)
        out += cost(w, max(1, int(np.sum(s / s[0] > eps))))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    params = full_rank_params()
    d = tmp_path_factory.mktemp("sugg") / "params"
    save_params(d, params)
    return d, params


def test_compress_that_changes_nothing_says_so_and_suggests_eps_and_rank(saved, tmp_path, capsys):
    d, params = saved
    js = tmp_path / "rep.json"
    assert main(["compress", str(d), "--eps", "0.1", "--no-progress", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "changed nothing" in out and "8 kept dense" in out
    rep = json.loads(js.read_text())
    assert rep["totals"]["selected"]["params_ratio"] == 1.0
    sugg = rep["suggestions"]
    assert sugg["changed"] == 0 and [t["target"] for t in sugg["targets"]] == [0.5, 0.25]
    ws = matrices(params)
    total = sum(w.size for w in ws)
    # every eps at which the count can change: the normalized singular values
    thresholds = sorted({float(v) for w in ws
                         for v in np.linalg.svd(w, compute_uv=False)
                         / np.linalg.norm(w, 2)})
    for t in sugg["targets"]:
        budget = t["target"] * total
        eps, rank = t["eps"], t["rank"]
        assert f"--eps {eps:g}" in out and f"--rank {rank}" in out
        # the eps reaches the size, and no eps gives a larger model within it (NumPy count)
        n_eps = total_at_eps(ws, eps)
        assert n_eps <= budget
        assert n_eps == max(total_at_eps(ws, e) for e in thresholds
                            if total_at_eps(ws, e) <= budget)
        assert t["eps_ratio"] == pytest.approx(n_eps / total)
        # the largest uniform rank within the size
        assert sum(cost(w, rank) for w in ws) <= budget < sum(cost(w, rank + 1) for w in ws)
        assert t["rank_ratio"] == pytest.approx(sum(cost(w, rank) for w in ws) / total)
        # and the library, run again with them, reaches exactly those sizes
        _, rep_eps = compress(params, eps=eps)
        assert rep_eps.params_after == n_eps and rep_eps.ratio <= t["target"]
        _, rep_rank = compress(params, rank=rank)
        assert rep_rank.params_after == sum(cost(w, rank) for w in ws)


def test_compress_that_changes_little_says_so(tmp_path, capsys):
    """One small rank-1 matrix is factorized, the large full-rank ones are kept: the selected
    weights keep more than 95% of their parameters."""
    params = full_rank_params(1)
    r = np.random.default_rng(2)
    small = np.outer(r.normal(size=8), r.normal(size=8)).astype(np.float32)
    params["extra"] = {"attn": {"v": lj.Dense(small)}}
    d = tmp_path / "params"
    save_params(d, params)
    js = tmp_path / "rep.json"
    assert main(["compress", str(d), "--eps", "0.1", "--no-progress", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    total = 8 * D * D + 64
    kept = (8 * D * D + 16) / total
    assert "changed little" in out and f"{100 * kept:.1f}%" in out and "1 of 9 replaced" in out
    rep = json.loads(js.read_text())
    assert rep["suggestions"]["changed"] == 1
    assert rep["suggestions"]["selected_ratio"] == pytest.approx(kept)
    for t in rep["suggestions"]["targets"]:
        _, again = compress(params, eps=t["eps"])
        assert again.ratio <= t["target"]


def test_compress_that_changes_enough_has_no_note(saved, tmp_path, capsys):
    d, _ = saved
    js = tmp_path / "rep.json"
    assert main(["compress", str(d), "--rank", "4", "--no-progress", "--json", str(js)]) == 0
    assert "note:" not in capsys.readouterr().out
    assert "suggestions" not in json.loads(js.read_text())
