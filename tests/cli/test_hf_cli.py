"""The command line on Hugging Face directories: `analyze` and `compress` read them directly,
`export` writes one that the PyTorch class loads (outputs equal ours to 1e-4), and nothing but
a previous export is ever replaced."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.io import load_metadata, load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=48)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    d = tmp_path_factory.mktemp("hf") / "bert"
    model.save_pretrained(d)
    return d, {k: v.numpy() for k, v in model.state_dict().items()}


def snapshot(path):
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def np_eps_rank(w, eps):
    s = np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)
    return int(np.sum(s / s[0] > eps))


def test_analyze_reads_a_hugging_face_directory(bert_dir, tmp_path, capsys):
    d, state = bert_dir
    js = tmp_path / "a.json"
    assert main(["analyze", str(d), "--eps", "0.3", "--no-progress", "--json", str(js)]) == 0
    assert "reading the Hugging Face directory" in capsys.readouterr().err
    by_path = {w["path"]: w for w in json.loads(js.read_text())["weights"]}
    for i in range(2):
        for name, key in (("qk/q", "attention.self.query"), ("v", "attention.self.value"),
                          ("o", "attention.output.dense")):
            w = state[f"encoder.layer.{i}.{key}.weight"].T  # PyTorch [out, in] -> [in, out]
            got = by_path[f"encoder/layers/{i}/attn/{name}"]["eps_rank"]["0.3"]
            assert got == np_eps_rank(w, 0.3)


def test_compress_hf_directory_then_export_loads_in_pytorch(bert_dir, tmp_path, capsys):
    d, state = bert_dir
    source = snapshot(d)
    small = tmp_path / "small"
    assert main(["compress", str(d), "--rank", "3", "--out", str(small), "--time-runs", "1",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    # a status line before each long phase, in order
    phases = ["reading the Hugging Face directory", "applying the plan", "evaluating the model",
              f"saving to {small}"]
    at = [err.find(f"lowrank-jax compress: {p}") for p in phases]
    assert all(i >= 0 for i in at) and at == sorted(at), err
    assert err.count(": done in ") == 3, err  # each timed phase reports its duration
    assert load_metadata(small)["source"] == os.path.abspath(d)
    config, params = load_model(small)
    low = {p: leaf for p, leaf in lj.named_leaves(params) if isinstance(leaf, lj.LowRank)}
    assert len(low) == 8 and all(leaf.rank == 3 for leaf in low.values())

    hf = tmp_path / "hf_small"
    assert main(["export", str(small), "--out", str(hf), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "writing the Hugging Face directory" in err
    assert "BertModel" in out and "materialized (densified) 8:" in out
    assert all(p in out for p in low)
    assert "BertModel.from_pretrained(" in out
    assert sorted(os.listdir(hf)) == ["config.json", "lowrank_jax_output.json",
                                      "model.safetensors"]
    model = transformers.BertModel.from_pretrained(hf).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, size=(2, 9))
    mask = np.ones_like(ids)
    mask[0, -3:] = 0
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    ours = lj.models.apply(params, {"input_ids": jnp.asarray(ids),
                                    "attention_mask": jnp.asarray(mask)}, config)
    np.testing.assert_allclose(np.asarray(ours["last_hidden_state"]),
                               ref.last_hidden_state.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(ours["pooler_output"]), ref.pooler_output.numpy(),
                               atol=1e-4)
    # the export is recognised as the tool's own: refused without --overwrite, replaced with it
    assert main(["export", str(small), "--out", str(hf), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(small), "--out", str(hf), "--overwrite", "--no-progress"]) == 0
    # a Hugging Face directory the tool did not write is never replaced, nor one that someone
    # added a file to
    capsys.readouterr()
    assert main(["export", str(small), "--out", str(d), "--overwrite", "--no-progress"]) == 2
    assert "did not write" in capsys.readouterr().err
    (hf / "README.md").write_text("notes")
    assert main(["export", str(small), "--out", str(hf), "--overwrite", "--no-progress"]) == 2
    assert (hf / "README.md").read_text() == "notes"
    assert snapshot(d) == source
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_export_of_a_bare_parameter_checkpoint_is_refused(tmp_path, capsys):
    from lowrank_jax.io import save_params

    save_params(tmp_path / "p", {"w": lj.Dense(np.ones((2, 2), np.float32))})
    assert main(["export", str(tmp_path / "p"), "--out", str(tmp_path / "hf"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bare parameter checkpoint" in err and str(tmp_path / "p") in err
    assert not (tmp_path / "hf").exists()


def test_convert_announces_its_phases(bert_dir, tmp_path, capsys):
    d, _ = bert_dir
    out = tmp_path / "native"
    assert main(["convert", str(d), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.index("reading the Hugging Face directory") < err.index(f"saving to {out} ...")
    assert err.count(": done in ") == 2
