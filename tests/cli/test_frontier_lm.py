"""``lowrank-jax frontier`` on a decoder-only language model: with the directory's
``tokenizer.json`` its pruning candidates are scored on real text and measured; without one they
are skipped with a message naming the option."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lowrank_jax.cli.main import main  # noqa: E402
from lowrank_jax.compress.prune.method import batch_source  # noqa: E402
from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.recipes.frontier import TEXT_BATCHES  # noqa: E402
from lowrank_jax.text import stdlib_corpus  # noqa: E402

FAST = ["--quick", "--methods", "prune", "prune_heads", "--time-runs", "1", "--budget", "0.9",
        "--no-progress"]


@pytest.fixture(scope="module")
def tok(lm):
    return lm.stdlib_bpe()


def _llama(lm, d, tok=None):
    return lm.saved_lm(d, "llama", tokenizer=tok, vocab_size=300, hidden_size=24,
                       intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, head_dim=6, max_position_embeddings=32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tok, lm):
    return _llama(lm, tmp_path_factory.mktemp("llama"), tok)


def test_pruning_candidates_measured_on_the_directorys_text(llama_dir, tok, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["frontier", str(llama_dir), *FAST, "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    rows = {row["name"]: row for row in r["rows"]}
    for name in ("prune target=0.5", "prune_heads target=0.5"):
        assert not rows[name].get("error"), rows[name]
        assert rows[name]["size_ratio"] < 1.0 and np.isfinite(rows[name]["rel_error"])
        assert rows[name]["rel_error"] > 0.0  # something was removed
    assert "prune" not in r["skipped"] and "prune_heads" not in r["skipped"]
    # the frontier's GPTQ candidates calibrate on the same text: the quantize method's forward
    # on that source runs the model on its token ids
    from lowrank_jax.compress.quantize import _forward

    cfg, params = load_pretrained(llama_dir)
    logits = _forward(cfg, 2, 0, data=TEXT_BATCHES)(params)["logits"]
    assert logits.shape == (2, 32, 300) and np.isfinite(np.asarray(logits)).all()
    # evaluated on held-out text windows (32 windows of the model's 32 positions)
    assert r["data"].startswith("32 held-out windows of 32 tokens of python standard")
    # the pruning batches are the standard library's training text, tokenized by the
    # directory's tokenizer: decoded, every window's text between end-of-file tokens (id 0) is
    # a piece of a training file
    cfg, _ = load_pretrained(llama_dir)
    ids = batch_source(TEXT_BATCHES)(cfg, batch_size=3, seed=0)(0)["input_ids"]
    assert ids.shape == (3, 32)
    train = "".join(stdlib_corpus().read("train", max_bytes=400_000))
    pieces = [tok.decode([int(i) for i in part]).strip("\ufffd")
              for row in ids for part in np.split(row, np.flatnonzero(row == 0))]
    pieces = [p for p in pieces if len(p) > 8]
    assert pieces and all(p in train for p in pieces)


def test_without_a_tokenizer_the_pruning_candidates_are_skipped_saying_how(tmp_path, capsys, lm):
    d = _llama(lm, tmp_path / "llama")
    report = tmp_path / "r.json"
    assert main(["frontier", str(d), *FAST, "--json", str(report)]) == 0
    err = capsys.readouterr().err
    assert f"no tokenizer.json in {d}" in err and "--tokenizer" in err
    r = json.loads(report.read_text())
    for method in ("prune", "prune_heads"):
        assert "--tokenizer" in r["skipped"][method], r["skipped"]
    assert not any(row["name"].startswith("prune") for row in r["rows"])


def test_text_options_refused_where_they_do_not_apply(tmp_path, capsys, llama_dir, lm):
    assert main(["frontier", str(llama_dir), "--tokenizer", str(tmp_path / "none.json"),
                 *FAST]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    d = _llama(lm, tmp_path / "bare")
    assert main(["frontier", str(d), "--text", str(llama_dir / "config.json"), *FAST]) == 2
    assert "no tokenizer at" in capsys.readouterr().err
    # a model that is not a language model
    import jax

    from lowrank_jax.io import save_model
    from lowrank_jax.models import T5Config, t5

    cfg = T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                   num_heads=2, feed_forward_proj="relu")
    save_model(tmp_path / "t5", cfg, t5.init(jax.random.PRNGKey(0), cfg))
    assert main(["frontier", str(tmp_path / "t5"), "--tokenizer", str(llama_dir), *FAST]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer is for decoder-only language models; 't5' is not one" in err
