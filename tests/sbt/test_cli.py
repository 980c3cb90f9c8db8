"""``lowrank-jax sbt``: a tiny anomaly run end to end (report, plots, packed model that loads
and reproduces the scores' model), and bad arguments refused before any work."""

import argparse
import json
import os

import numpy as np
import pytest

from lowrank_jax.cli import sbt_cmd
from lowrank_jax.errors import ConfigError


def parse(argv):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    sbt_cmd.add_parser(sub)
    return ap.parse_args(["sbt", *argv])


def test_anomaly_end_to_end(tmp_path):
    rep, plots, out = tmp_path / "r.json", tmp_path / "plots", tmp_path / "model"
    args = parse(["anomaly", "--dataset", "kdd135", "--prune", "0.5", "--epochs", "1",
                  "--window", "8", "--d-model", "8", "--d-ff", "16", "--layers", "1",
                  "--json", str(rep), "--plots", str(plots), "--out", str(out),
                  "--no-progress"])
    assert sbt_cmd.run(args) == 0
    doc = json.loads(rep.read_text())
    assert doc["lowrank_jax_report"]["command"] == "sbt"
    for name in ("quantile", "pot"):
        e = doc["metrics"][name]
        assert 0.0 <= e["f1"] <= 1.0 and e["tp"] + e["fn"] == 12  # 12 labelled anomalies
    assert doc["paper_counts"]["sbt_bits"] < doc["paper_counts"]["dense_bits"]
    assert set(doc["plots"]) == {"training.png", "anomaly_scores.png"}
    assert all(os.path.getsize(plots / f) > 1000 for f in doc["plots"])
    from lowrank_jax.io import load_model
    from lowrank_jax.leaves import PackedBinary

    cfg, params = load_model(out)
    assert cfg.window == 8 and isinstance(params["layers"][0]["mlp"]["wi"], PackedBinary)
    assert len(doc["history"]) == 1 and np.isfinite(doc["history"][0]["val_mse"])


@pytest.mark.parametrize("argv", [["classify", "--dataset", "kdd135"],
                                  ["anomaly", "--prune", "1.0"],
                                  ["forecast", "--heads", "3"],
                                  ["classify", "--epochs", "0"]])
def test_bad_arguments(argv, tmp_path):
    with pytest.raises(ConfigError):
        sbt_cmd.run(parse(argv + ["--json", str(tmp_path / "x.json")]))
    assert not (tmp_path / "x.json").exists()
