"""End to end: HF checkpoint -> `lowrank-jax convert` -> `lowrank-jax compress` on the model."""

import json
import os

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.compress import compare_models, compress, sample_inputs
from lowrank_jax.io import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=96,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    d = tmp_path_factory.mktemp("hf") / "t5"
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def converted(t5_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("native") / "t5"
    assert main(["convert", str(t5_dir), "--out", str(out)]) == 0
    return out


def test_convert_writes_model_checkpoint(converted, t5_dir):
    config, params = load_model(converted)
    ref_cfg, ref_params = lj.convert.load_pretrained(str(t5_dir))
    assert config == ref_cfg
    for (pa, a), (pb, b) in zip(lj.named_leaves(params), lj.named_leaves(ref_params), strict=True):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(lj.materialize(a)), np.asarray(lj.materialize(b)))


def is_projection(path: str) -> bool:
    """An attention projection: '.../attn/qk/q', '.../attn/qk/k', '.../attn/v', '.../attn/o'."""
    return "attn/" in path and path.rsplit("/", 1)[-1] in ("q", "k", "v", "o")


def test_full_rank_compression_changes_no_output(converted):
    config, params = load_model(converted)
    # every attention matrix factorized at its full rank (kept factorized even though larger)
    rules = [r"attn/(qk/q|qk/k|v|o)$"]
    full, rep = compress(params, rules=rules, rank=32, keep_dense_if_larger=False)
    attn = [leaf for path, leaf in lj.named_leaves(full) if is_projection(path)]
    assert attn and all(isinstance(leaf, lj.LowRank) for leaf in attn)
    assert {r.kind for r in rep.rows} == {"svd"}
    ev = compare_models(config, params, full, measure_time=False)
    assert ev["max_abs_error"] <= 1e-4, ev
    assert ev["top10_jaccard"] == 1.0


def test_compress_cli_report_is_recomputed(converted, tmp_path):
    js, out = tmp_path / "rep.json", tmp_path / "small"
    assert (
        main(
            [
                "compress",
                str(converted),
                "--eps",
                "0.1",
                "--out",
                str(out),
                "--json",
                str(js),
                "--time-runs",
                "3",
                "--no-progress",
            ]
        )
        == 0
    )
    rep = json.loads(js.read_text())
    config, params = load_model(converted)
    new_config, new_params = load_model(out)
    assert new_config == config
    before = after = 0
    for path, leaf in lj.named_leaves(params):
        if not (isinstance(leaf, lj.Dense) and is_projection(path)):
            continue
        w = np.asarray(lj.materialize(leaf), np.float64)
        s = np.linalg.svd(w, compute_uv=False)
        r = int(np.sum(s / s[0] > 0.1))
        new_leaf = dict(lj.named_leaves(new_params))[path]
        row = next(x for x in rep["rows"] if x["path"] == path)
        assert row["details"]["rank"] == r
        if r * sum(w.shape) < w.size:
            assert isinstance(new_leaf, lj.LowRank) and new_leaf.rank == r
            np.testing.assert_allclose(
                row["error"], s[r] / s[0] if r < len(s) else 0, atol=1e-5
            )
            after += r * sum(w.shape)
        else:
            assert isinstance(new_leaf, lj.Dense)
            after += w.size
        before += w.size
    sel = rep["totals"]["selected"]
    assert sel["params_before"] == before and sel["params_after"] == after
    # the model-level numbers, recomputed here from the two checkpoints
    ev = rep["model"]
    assert ev["param_ratio"] == pytest.approx(lj.param_count(new_params) / lj.param_count(params))
    inputs = sample_inputs(config)
    fwd = jax.jit(lambda p: lj.models.apply(p, inputs, config)["logits"])
    a, b = np.asarray(fwd(params), np.float64), np.asarray(fwd(new_params), np.float64)
    assert ev["max_abs_error"] == pytest.approx(np.abs(a - b).max(), rel=1e-5)
    ja = []
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), strict=True):
        sx, sy = set(np.argsort(-x)[:10]), set(np.argsort(-y)[:10])
        ja.append(len(sx & sy) / len(sx | sy))
    assert ev["top10_jaccard"] == pytest.approx(np.mean(ja))
    # timed only when some weight changed (an unchanged model's ratio would be noise)
    assert ("time_ratio" in ev) == (rep["changed"] > 0)
    if rep["changed"]:
        assert 0 < ev["time_ratio_quartiles"][0] <= ev["time_ratio_quartiles"][1]


def test_convert_errors_write_nothing(t5_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((t5_dir / "config.json").read_text())
    data = (t5_dir / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated file
    out = tmp_path / "out"
    assert main(["convert", str(bad), "--out", str(out)]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert not out.exists()
    cfg = json.loads((t5_dir / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mystery", ["MysteryModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(data)
    assert main(["convert", str(bad), "--out", str(out)]) == 2
    assert "mystery" in capsys.readouterr().err.lower()
    assert not out.exists() and not any(n.startswith(".out") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("family", ["chronos_bolt", "vit", "bert"])
def test_compress_converted_families_full_rank_is_exact(family, tmp_path):
    """Every family converts, compresses at full rank without changing outputs (<= 1e-4),
    and reports a changed model at a low rank."""
    torch.manual_seed(0)
    if family == "chronos_bolt":
        bolt = pytest.importorskip("chronos.chronos_bolt")
        cfg = transformers.T5Config(
            d_model=32,
            d_kv=8,
            d_ff=48,
            num_layers=2,
            num_decoder_layers=1,
            num_heads=4,
            feed_forward_proj="relu",
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
            architectures=["ChronosBoltModelForForecasting"],
            chronos_config=dict(
                context_length=64,
                prediction_length=8,
                input_patch_size=8,
                input_patch_stride=8,
                quantiles=[0.1, 0.5, 0.9],
                use_reg_token=True,
            ),
        )
        model = bolt.ChronosBoltModelForForecasting(cfg).eval()
    elif family == "vit":
        cfg = transformers.ViTConfig(
            image_size=16,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            num_labels=5,
        )
        model = transformers.ViTForImageClassification(cfg).eval()
    else:
        cfg = transformers.BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
        )
        model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    assert main(["convert", str(src), "--out", str(tmp_path / "native")]) == 0
    config, params = load_model(tmp_path / "native")
    full, _ = compress(params, rank=32, keep_dense_if_larger=False)
    ev = compare_models(config, params, full, measure_time=False)
    assert ev["max_abs_error"] <= 1e-4, ev
    js = tmp_path / "rep.json"
    assert (
        main(
            [
                "compress",
                str(tmp_path / "native"),
                "--rank",
                "2",
                "--json",
                str(js),
                "--time-runs",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    rep = json.loads(js.read_text())["model"]
    assert rep["rel_error"] > 1e-3 and rep["param_ratio"] < 1.0
