"""The lowrank-jax command on saved parameter trees: reports recomputed independently."""

import json
import os

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.io import load_params, save_params


def np_eps_rank(w, eps):
    s = np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)
    return int(np.sum(s / s[0] > eps))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    key = jax.random.PRNGKey(0)
    r = np.random.default_rng(0)
    layers = []
    for _ in range(2):
        w = {}
        for n in "qkvo":
            # Decaying spectrum so eps truncation actually drops something.
            a, _ = np.linalg.qr(r.normal(size=(16, 16)))
            b, _ = np.linalg.qr(r.normal(size=(16, 16)))
            m = (a * np.exp(-0.4 * np.arange(16))) @ b.T
            w[n] = lj.Dense(np.asarray(m, np.float32))
        # 4 heads of width 4: the head structure lives in the parameters
        attn = {"qk": lj.QueryKey.uniform(w["q"], w["k"], 4), "v": w["v"], "o": w["o"],
                "heads": lj.HeadLayout.uniform(4, 4, 0.5)}
        layers.append({"attn": attn, "mlp": {"wi": lj.init_dense(key, 16, 32)}})
    params = {"layers": layers}
    d = tmp_path_factory.mktemp("ckpt") / "params"
    save_params(d, params)
    return d, params


PROJ = {"q": "qk/q", "k": "qk/k", "v": "v", "o": "o"}


def weight(params, i, n):
    """The dense matrix of projection ``n`` of layer ``i`` (float64)."""
    return np.asarray(lj.materialize(lj.leaves.get_path(params["layers"][i]["attn"], PROJ[n])),
                      np.float64)


def test_analyze_writes_json_matching_numpy(saved, tmp_path, capsys):
    d, params = saved
    out = tmp_path / "report.json"
    assert (
        main(["analyze", str(d), "--eps", "0.1", "0.01", "--json", str(out), "--no-progress"]) == 0
    )
    printed = capsys.readouterr().out
    assert "layers/1/attn/v" in printed
    rep = json.loads(out.read_text())
    by_path = {w["path"]: w for w in rep["weights"]}
    assert set(by_path) == {f"layers/{i}/attn/{PROJ[n]}" for i in range(2) for n in "qkvo"} | {
        "layers/0/mlp/wi",
        "layers/1/mlp/wi",
    }
    for i in range(2):
        w = weight(params, i, "q")
        assert by_path[f"layers/{i}/attn/qk/q"]["eps_rank"]["0.1"] == np_eps_rank(w, 0.1)
        assert by_path[f"layers/{i}/attn/qk/q"]["eps_rank"]["0.01"] == np_eps_rank(w, 0.01)
        # per-head ranks: the query-key object says 4 heads -> 4 column blocks of 4
        heads = [np_eps_rank(w[:, h * 4 : (h + 1) * 4], 0.1) for h in range(4)]
        assert by_path[f"layers/{i}/attn/qk/q"]["head_eps_rank"]["0.1"] == heads


def test_compress_saves_factorized_tree_and_report(saved, tmp_path):
    d, params = saved
    out_dir, js = tmp_path / "small", tmp_path / "c.json"
    assert (
        main(
            [
                "compress",
                str(d),
                "--eps",
                "0.1",
                "--out",
                str(out_dir),
                "--json",
                str(js),
                "--no-progress",
            ]
        )
        == 0
    )
    new = load_params(out_dir)
    rep = json.loads(js.read_text())
    before = after = 0
    for i in range(2):
        assert isinstance(new["layers"][i]["mlp"]["wi"], lj.Dense)  # not selected by default rules
        for n in "qkvo":
            w = weight(params, i, n)
            leaf = lj.leaves.get_path(new["layers"][i]["attn"], PROJ[n])
            r = np_eps_rank(w, 0.1)
            assert isinstance(leaf, lj.LowRank) and leaf.rank == r
            s = np.linalg.svd(w, compute_uv=False)
            err = np.linalg.norm(w - np.asarray(lj.materialize(leaf), np.float64), 2) / s[0]
            assert err <= 0.1 + 1e-5
            np.testing.assert_allclose(err, s[r] / s[0], atol=1e-4)
            before += w.size
            after += r * 32
    sel = rep["totals"]["selected"]
    assert sel["params_before"] == before
    assert sel["params_after"] == after
    np.testing.assert_allclose(sel["params_ratio"], after / before, rtol=1e-9)


def test_compress_errors_exit_2_with_message(saved, tmp_path, capsys):
    d, _ = saved
    assert main(["compress", str(d), "--eps", "1.5", "--no-progress"]) == 2
    assert "1.5" in capsys.readouterr().err
    assert (
        main(["compress", str(d), "--eps", "0.1", "--rule", "nothing/here", "--no-progress"]) == 2
    )
    assert "nothing/here" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "missing" in capsys.readouterr().err
    # a failed compress writes nothing
    assert not (tmp_path / "never").exists()
    assert (
        main(
            ["compress", str(d), "--rank", "99", "--out", str(tmp_path / "never"), "--no-progress"]
        )
        == 2
    )
    err = capsys.readouterr().err
    # the first selected weight in tree order (dict keys sorted: attn/o before attn/qk/...)
    assert "layers/0/attn/o" in err and "got 99" in err and "[1, 16]" in err
    assert not (tmp_path / "never").exists()




@pytest.mark.parametrize("command", ["prune", "partition"])
def test_method_commands_are_wired_into_lowrank_jax(command, tmp_path, capsys):
    """The method commands are reachable from ``lowrank-jax`` and fail like every command: one
    line naming the missing input, exit status 2."""
    missing = tmp_path / "no_model"
    assert main([command, str(missing), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lowrank-jax {command}: error:") and str(missing) in err
    assert len(err.splitlines()) == 1 and not missing.exists()


def test_sbt_command_is_wired_into_lowrank_jax(tmp_path, capsys):
    """``lowrank-jax sbt`` refuses an unknown dataset before any work: one line, exit 2."""
    js = tmp_path / "r.json"
    assert main(["sbt", "classify", "--dataset", "NoSuchSet", "--json", str(js)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowrank-jax sbt: error:") and "NoSuchSet" in err
    assert len(err.splitlines()) == 1 and not js.exists()


def test_quick_demo_compiles_at_optimization_level_0_and_restores_the_flags(monkeypatch):
    from lowrank_jax.cli.demo_cmd import _quick_compile

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with _quick_compile(True):
        assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    assert "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    with _quick_compile(True):
        assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2",
                                                   "--xla_backend_optimization_level=0"]
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    with _quick_compile(False):  # the full demo keeps XLA's default
        assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    with _quick_compile(True):  # the user's choice wins
        assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=3"


def test_compress_rank_multiple_rounds_eps_ranks_up(saved, tmp_path, capsys):
    d, params = saved
    js = tmp_path / "c.json"
    # eps-ranks of 5 (spectra exp(-0.4 j)) rounded up to 6: still smaller than the 16 x 16
    assert main(["compress", str(d), "--eps", "0.2", "--rank-multiple", "3", "--json", str(js),
                 "--no-progress"]) == 0
    rep = json.loads(js.read_text())
    rows = {w["path"]: w for w in rep["rows"]}
    for i in range(2):
        for n in "qkvo":
            w = weight(params, i, n)
            r = -(-np_eps_rank(w, 0.2) // 3) * 3
            assert np_eps_rank(w, 0.2) % 3 and r % 3 == 0
            row = rows[f"layers/{i}/attn/{PROJ[n]}"]
            assert row["kind"] == "svd" and row["details"]["rank"] == r
            assert row["details"]["rank_multiple"] == 3
    assert main(["compress", str(d), "--plan", str(js), "--rank-multiple", "4",
                 "--no-progress"]) == 2
    assert "--rank-multiple" in capsys.readouterr().err
