"""``lowrank-jax partition`` (lowrank_jax/cli/partition_cmd.py) on a tiny BERT checkpoint: the
table, the JSON report (per layer: assignment, rank, bytes per token, storage and FLOPs per
machine, error, Fig. 5 traces, error-vs-rank curves) and the plots."""

import argparse
import json

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli import partition_cmd
from lowrank_jax.compress.partitioning import counts as ct
from lowrank_jax.errors import OutputExistsError


def parse(argv):
    p = argparse.ArgumentParser(prog="lowrank-jax")
    partition_cmd.add_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from lowrank_jax.io import save_model
    from lowrank_jax.models import BertConfig, bert

    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=32, max_position_embeddings=32)
    params = bert.init(jax.random.PRNGKey(5), cfg)
    path = tmp_path_factory.mktemp("cli") / "bert"
    save_model(path, cfg, params)
    return path, params


def test_partition_command(checkpoint, tmp_path, capsys):
    path, params = checkpoint
    args = parse(["partition", str(path), "--machines", "4", "--rank", "2", "--json",
                  str(tmp_path / "r.json"), "--plots", str(tmp_path / "plots"), "--out",
                  str(tmp_path / "model"), "--samples", "32", "--no-progress"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "encoder/layers/0/mlp/wi" in text and "bytes per token" in text
    rep = json.loads((tmp_path / "r.json").read_text())
    paths = [e["path"] for e in rep["layers"]]
    assert paths == ["encoder/layers/0/attn/o", "encoder/layers/0/attn/qk/q",
                     "encoder/layers/0/attn/qk/k", "encoder/layers/0/attn/v",
                     "encoder/layers/0/mlp/wi", "encoder/layers/0/mlp/wo"]
    for e in rep["layers"]:
        d_in, d_out = e["shape"]
        r = e["rank"]
        assert r == 2 and e["bytes_per_token"] == 4 * r
        assert e["params_machine"] == pytest.approx(ct.storage_new_machine(d_in, d_out, 4, r))
        assert e["flops_machine"] == pytest.approx(ct.flops_new_machine(d_in, d_out, 4, r)
                                                   + 2 * r * d_in / 4)
        assert len(e["tr_m0"]) == 4 and all(a >= b for a, b in zip(e["tr_m0"], e["tr_m1"], strict=True))
        c = e["curves"]
        assert c["rank"][0] == 0 and c["rank"][-1] == e["max_rank"]
        assert c["new"][-1] < 1e-6  # exact at d*
        assert sorted(sum(e["outputs_of_machine"], [])) == list(range(d_out))
    assert rep["bytes_per_token"] == sum(e["bytes_per_token"] for e in rep["layers"])
    assert rep["model"]["rel_error"] >= 0
    assert sorted(rep["plots"]) == ["fig5_traces.png", "fig6_error_vs_rank.png"]
    assert (tmp_path / "plots" / "fig5_traces.png").stat().st_size > 1000
    from lowrank_jax.io import load_model

    _, back = load_model(tmp_path / "model")
    leaf = lj.leaves.get_path(back, "encoder/layers/0/mlp/wi")
    assert isinstance(leaf, lj.leaves.Partitioned) and leaf.machines == 4
    # the reported error is the spectral error of the saved leaf against the permuted weight
    wi = next(e for e in rep["layers"] if e["path"].endswith("mlp/wi"))
    w = lj.materialize_host(lj.leaves.get_path(params, "encoder/layers/0/mlp/wi"))
    perm = np.concatenate(wi["outputs_of_machine"])
    got = lj.materialize_host(leaf)
    assert wi["error"] == pytest.approx(
        np.linalg.norm(w[:, perm] - got, 2) / np.linalg.norm(w, 2), rel=1e-4, abs=1e-6)


def test_refuses_to_replace_what_it_did_not_write(checkpoint, tmp_path):
    path, _ = checkpoint
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "mine.txt").write_text("x")
    args = parse(["partition", str(path), "--machines", "4", "--plots", str(tmp_path / "plots")])
    with pytest.raises(OutputExistsError, match="--plots"):
        args.func(args)
