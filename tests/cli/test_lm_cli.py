"""``lowrank-jax analyze``, ``compress`` and ``export`` straight on Hugging Face directories of
decoder-only language models (GPT-2's fused ``c_attn`` read as three weights)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowrank_jax.cli.main import main  # noqa: E402
from lowrank_jax.io import load_model  # noqa: E402
from lowrank_jax.models import apply  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, lm):
    d = tmp_path_factory.mktemp("lms")
    return {"llama": lm.saved_lm(d / "llama", "llama", seed=0, vary=True, vocab_size=64,
                                 hidden_size=24, intermediate_size=20, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=6,
                                 attention_bias=True),
            "gpt2": lm.saved_lm(d / "gpt2", "gpt2", seed=1, vary=True, vocab_size=64,
                                n_positions=32, n_embd=24, n_layer=2, n_head=4)}


def _np_eps_ranks(w, eps):
    s = np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)
    return s, {str(e): int(np.sum(s > e * s[0])) for e in eps}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_analyze_reads_the_directory(dirs, kind, tmp_path):
    report = tmp_path / "a.json"
    assert main(["analyze", str(dirs[kind]), "--eps", "0.1", "0.5", "--json", str(report),
                 "--no-progress"]) == 0
    rows = {r["path"]: r for r in json.loads(report.read_text())["weights"]}
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[kind])
    if kind == "llama":  # nn.Linear [out, in]
        want = {"layers/1/mlp/wo": model.model.layers[1].mlp.down_proj.weight.T,
                "layers/0/attn/qk/k": model.model.layers[0].self_attn.k_proj.weight.T}
    else:  # Conv1D [in, out]; c_attn is q, k and v side by side
        c_attn = model.transformer.h[0].attn.c_attn.weight
        want = {"layers/0/attn/v": c_attn[:, 48:], "layers/0/attn/qk/q": c_attn[:, :24],
                "layers/1/mlp/wi": model.transformer.h[1].mlp.c_fc.weight}
    for path, w in want.items():
        s, ranks = _np_eps_ranks(w.detach().numpy(), (0.1, 0.5))
        assert rows[path]["shape"] == list(w.shape)
        np.testing.assert_allclose(rows[path]["singular_values"], s, rtol=1e-5)
        assert rows[path]["eps_rank"] == ranks


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_compress_the_directory_then_export(dirs, kind, tmp_path):
    assert main(["compress", str(dirs[kind]), "--ratio", "0.5", "--no-eval", "--out",
                 str(tmp_path / "c"), "--no-progress"]) == 0
    assert main(["export", str(tmp_path / "c"), "--out", str(tmp_path / "hf")]) == 0
    cfg, params = load_model(tmp_path / "c")
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
    got = np.asarray(apply(params, {"input_ids": ids}, cfg)["logits"])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    with torch.no_grad():  # and compression changed the model
        dense = transformers.AutoModelForCausalLM.from_pretrained(dirs[kind]).eval()
        assert np.max(np.abs(dense(input_ids=torch.tensor(ids)).logits.numpy() - ref)) > 1e-3
