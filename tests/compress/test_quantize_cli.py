"""``lowrank-jax compress --plan`` with a ``quantize`` step on a Hugging Face BERT directory:
the lowrank-jax checkpoint keeps the packed integers (and loads bit-exact), ``export`` writes a
dequantized float checkpoint that transformers loads (outputs equal ours to 1e-4) and says so."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.io import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_compress_plan_quantize_then_export(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=48)
    model = transformers.BertModel(cfg).eval()
    d = tmp_path / "bert"
    model.save_pretrained(d)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"steps": [{
        "method": "quantize", "rules": ["mlp/(wi|wo)$", ["attn/(qk/q|qk/k|v|o)$", {"bits": 8}]],
        "settings": {"bits": 4, "group": 16, "algorithm": "gptq", "samples": 4}}]}))
    small = tmp_path / "small"
    assert main(["compress", str(d), "--plan", str(plan), "--out", str(small), "--time-runs", "1",
                 "--no-progress"]) == 0
    config, params = load_model(small)
    quant = {p: n for p, n in lj.named_leaves(params) if lj.leaves.is_quantized(n)}
    assert len(quant) == 6
    ints = [a for n in quant.values() for a in jax.tree_util.tree_leaves(n)
            if np.asarray(a).dtype.kind in "ui"]
    assert {np.asarray(a).dtype for a in ints} == {np.dtype(np.uint8), np.dtype(np.int8)}
    capsys.readouterr()

    hf = tmp_path / "hf"
    assert main(["export", str(small), "--out", str(hf), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dequantized (integer weights written as float32 values" in out
    assert all(p in out for p in quant)
    back = transformers.BertModel.from_pretrained(hf).eval()
    ids = np.random.default_rng(0).integers(1, 50, size=(2, 7))
    with torch.no_grad():
        ref = back(input_ids=torch.tensor(ids)).last_hidden_state.numpy()
    ours = lj.models.apply(params, {"input_ids": jnp.asarray(ids)}, config)["last_hidden_state"]
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
    assert back.encoder.layer[0].intermediate.dense.weight.dtype == torch.float32

