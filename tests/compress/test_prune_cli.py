"""``lowrank-jax prune`` end to end on a tiny Chronos-Bolt checkpoint (its own parser; the command
is wired into ``lowrank_jax.cli.main`` separately), and its refusals before any work."""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli import prune_cmd
from lowrank_jax.errors import ConfigError, OutputExistsError
from lowrank_jax.io import is_checkpoint, load_model, save_model
from lowrank_jax.models import BertConfig, ChronosBoltConfig, T5Config, family_of

BOLT = ChronosBoltConfig(t5=T5Config(vocab_size=2, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                     num_decoder_layers=1, num_heads=4),
                         context_length=32, prediction_length=8, input_patch_size=8,
                         input_patch_stride=8, use_reg_token=True)


def fast_init(cfg, seed=0):
    fam = family_of(cfg)
    shapes = jax.eval_shape(lambda: fam.init(jax.random.PRNGKey(0), cfg))
    g = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * g.normal(size=s.shape), s.dtype),
                                  shapes)


def parse(argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    prune_cmd.add_parser(sub)
    return p.parse_args(["prune", *argv])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prune_cli") / "model"
    save_model(path, BOLT, fast_init(BOLT))
    return str(path)


def test_prune_command_end_to_end(model_dir, tmp_path, capsys):
    out, plots, rep = tmp_path / "out", tmp_path / "plots", tmp_path / "r.json"
    args = parse([model_dir, "--target", "0.4", "--prune-steps", "2", "--batch-size", "6",
                  "--finetune-steps", "1", "--lora", "2", "--eval-batches", "1",
                  "--no-progress", "--out", str(out), "--plots", str(plots), "--json", str(rep)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "kept head ids" in text and "decoder/layers/0/self_attn" in text
    doc = json.loads(rep.read_text())
    assert doc["lowrank_jax_report"]["command"] == "prune"
    assert doc["params_fraction"] >= 0.4 and doc["max_abs_diff_masked"] <= 1e-4
    for stage in ("before", "pruned", "finetuned"):
        assert set(doc[stage]) == {"val", "test"} and doc[stage]["test"]["wql"] > 0
    assert len(doc["history"]) == 2 and len(doc["finetune_loss"]) == 1
    attn = {r["path"]: r for r in doc["layers"] if r["kind"] == "attention"}
    assert attn["decoder/layers/0/self_attn"]["qk"] == 0  # single step: q/k go first
    assert sorted(os.listdir(plots)) == ["fig6_pruned_fraction.png", "lowrank_jax_output.json",
                                         "pruning_history.png"]
    assert is_checkpoint(out)
    cfg, saved = load_model(out)
    assert cfg == BOLT and doc["params_after"] < doc["params_before"]
    assert lj.param_count(saved) > doc["params_after"]  # the pruned weights plus LoRA updates
    assert any(isinstance(n, lj.leaves.LoRA) for _, n in lj.named_leaves(saved))
    # the tool never replaces what it did not write
    args = parse([model_dir, "--prune-steps", "1", "--out", str(out)])
    with pytest.raises(OutputExistsError, match="--overwrite"):
        args.func(args)
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": 1}')
    args = parse([model_dir, "--json", str(foreign)])
    with pytest.raises(OutputExistsError, match="not a lowrank-jax JSON report"):
        args.func(args)


def test_prune_command_refuses_bad_input(model_dir, tmp_path):
    for argv, match in ((["--target", "1.2"], "--target"), (["--prune-steps", "0"], "--prune-steps"),
                        (["--alpha", "0"], "--alpha"), (["--data", str(tmp_path / "x.csv")],
                                                          "no such CSV")):
        args = parse([model_dir, *argv])
        with pytest.raises((ConfigError, FileNotFoundError), match=match):
            args.func(args)
    args = parse([model_dir, "--out", model_dir + "/inside"])
    with pytest.raises(ConfigError, match="inside the input"):
        args.func(args)
    bert = BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=8, max_position_embeddings=8)
    save_model(tmp_path / "bert", bert, fast_init(bert))
    args = parse([str(tmp_path / "bert")])
    with pytest.raises(ConfigError, match="prunes forecasters.*'bert'"):
        args.func(args)
