"""``lowrank-jax prune`` on decoder-only language models: query heads, key-value groups and MLP
channels scored on text, held-out perplexity, and an export that transformers reloads."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lowrank_jax.cli.main import main  # noqa: E402
from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.io import load_model  # noqa: E402
from lowrank_jax.leaves import Dense, bias_of, get_path, materialize, replace_paths  # noqa: E402
from lowrank_jax.models import apply  # noqa: E402
from lowrank_jax.text import stdlib_corpus  # noqa: E402

FAST = ["--prune-steps", "2", "--batch-size", "4", "--eval-batches", "2", "--seq-len", "16",
        "--no-progress"]


@pytest.fixture(scope="module")
def tok(lm):
    return lm.stdlib_bpe()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tok, lm):
    return lm.saved_lm(tmp_path_factory.mktemp("llama"), "llama", seed=0, tokenizer=tok,
                       vocab_size=300, hidden_size=24, intermediate_size=20, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=6,
                       attention_bias=True)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tok, lm):
    return lm.saved_lm(tmp_path_factory.mktemp("gpt2"), "gpt2", seed=1, tokenizer=tok,
                       vocab_size=300, n_positions=32, n_embd=24, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "corpus.txt"
    f.write_text("".join(stdlib_corpus().read("held_out", max_bytes=20_000)))
    return f


def _ids(tok):
    return np.array([tok.encode("def f(x):\n    return x + 1  # one more").ids])


def _masked_reference(model_dir, layers, d_head):
    """The original model with the removed query heads' output rows and the removed MLP
    channels' output rows set to zero (NumPy), from the kept ids of the report."""
    cfg, params = load_pretrained(model_dir)
    new = {}
    for r in layers:
        i = r["layer"]
        o = get_path(params, f"layers/{i}/attn/o")
        w = np.array(materialize(o))
        for h in range(r["heads_total"]):
            if h not in r["head_ids"]:
                w[h * d_head:(h + 1) * d_head] = 0.0
        new[f"layers/{i}/attn/o"] = Dense(w=w, b=bias_of(o))
        wo = get_path(params, f"layers/{i}/mlp/wo")
        w = np.array(materialize(wo))
        w[[c for c in range(r["mlp_total"]) if c not in r["mlp_ids"]]] = 0.0
        new[f"layers/{i}/mlp/wo"] = Dense(w=w, b=bias_of(wo))
    return cfg, replace_paths(params, new)


def _export_matches(ck, out, cls, ids):
    """Export the checkpoint, reload it in transformers: logits equal the JAX model's."""
    assert main(["export", str(ck), "--out", str(out)]) == 0
    cfg, params = load_model(ck)
    model = cls.from_pretrained(out).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(apply(params, {"input_ids": ids}, cfg)["logits"]), ref,
                               atol=1e-4, rtol=0)
    return cfg, params, model


@pytest.mark.parametrize("equal", [False, True])
def test_llama_heads_groups_and_mlp(llama_dir, tok, tmp_path, capsys, equal):
    report = tmp_path / "r.json"
    assert main(["prune", str(llama_dir), "--kv-groups", "0.5", "--heads", "0.5", "--mlp",
                 "0.25", *FAST, "--out", str(tmp_path / "ck"), "--json", str(report),
                 *(["--mlp-equal"] if equal else [])]) == 0
    out = capsys.readouterr().out
    r = json.loads(report.read_text())
    assert "held-out perplexity before" in out and "lowrank-jax export will" in out
    cfg, params = load_model(tmp_path / "ck")
    # one of 2 key-value groups, then floor(0.5 * 3) of the 3 query heads left in it
    for lp in params["layers"]:
        assert (lp["attn"]["q_heads"].num_heads, lp["attn"]["kv_heads"].num_heads) == (2, 1)
    widths = [int(materialize(lp["mlp"]["wo"]).shape[0]) for lp in params["layers"]]
    assert sum(widths) == 40 - 10 and widths == [row["mlp"] for row in r["layers"]]
    if equal:  # floor(0.25 * 20) from every layer
        assert widths == [15, 15]
    assert [len(row["head_ids"]) for row in r["layers"]] == [2, 2]
    # masked (NumPy reference from the kept ids) vs pruned logits
    ids = _ids(tok)
    mcfg, masked = _masked_reference(llama_dir, r["layers"], d_head=6)
    want = np.asarray(apply(masked, {"input_ids": ids}, mcfg)["logits"])
    got = np.asarray(apply(params, {"input_ids": ids}, cfg)["logits"])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert r["max_abs_diff_masked"] < 1e-5
    assert set(r["perplexity"]) == {"before", "pruned"}
    _, _, model = _export_matches(tmp_path / "ck", tmp_path / "hf", transformers.LlamaForCausalLM,
                                  ids)
    hf = model.config
    assert (hf.num_attention_heads, hf.num_key_value_heads) == (2, 1)
    form = r["export"]
    if len(set(widths)) == 1:  # every layer kept the same width: physically smaller
        assert form == {"physically_smaller": True, "zero_padded": [],
                        "config": {"num_attention_heads": 2, "num_key_value_heads": 1,
                                   "intermediate_size": widths[0]}}
        assert hf.intermediate_size == widths[0]
    else:  # zero-padded to the config's width, and said so
        assert not form["physically_smaller"] and hf.intermediate_size == 20
        assert form["zero_padded"] == [f"layers/{i}/mlp" for i, w in enumerate(widths)
                                       if w != 20]


def test_gpt2_heads_and_mlp_on_a_text_file(gpt2_dir, tok, text_file, tmp_path):
    report = tmp_path / "r.json"
    assert main(["prune", str(gpt2_dir), "--heads", "0.5", "--mlp", "0.25", "--text",
                 str(text_file), *FAST, "--out", str(tmp_path / "ck"), "--json",
                 str(report)]) == 0
    r = json.loads(report.read_text())
    cfg, params = load_model(tmp_path / "ck")
    assert [lp["attn"]["heads"].num_heads for lp in params["layers"]] == [2, 2]
    assert sum(int(materialize(lp["mlp"]["wo"]).shape[0]) for lp in params["layers"]) == 192 - 48
    ids = _ids(tok)
    mcfg, masked = _masked_reference(gpt2_dir, r["layers"], d_head=6)
    np.testing.assert_allclose(np.asarray(apply(params, {"input_ids": ids}, cfg)["logits"]),
                               np.asarray(apply(masked, {"input_ids": ids}, mcfg)["logits"]),
                               atol=1e-5, rtol=0)
    # GPT-2's head width is n_embd / n_head: pruned heads are zero-padded on export
    assert not r["export"]["physically_smaller"]
    assert {f"layers/{i}/attn" for i in range(2)} <= set(r["export"]["zero_padded"])
    _export_matches(tmp_path / "ck", tmp_path / "hf", transformers.GPT2LMHeadModel, ids)
    # the perplexity before pruning, from the PyTorch original on the held-out windows (the
    # last tenth of the file's 16-token windows; 2 batches of 4)
    stream = tok.encode(text_file.read_text()).ids + [0]
    windows = np.array(stream[:len(stream) // 16 * 16]).reshape(-1, 16)
    n_held = max(1, round(0.1 * len(windows)))
    held = windows[-n_held:][:8]
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    with torch.no_grad():
        loss = model(input_ids=torch.tensor(held), labels=torch.tensor(held)).loss.item()
    assert r["perplexity"]["before"] == pytest.approx(np.exp(loss), rel=1e-4)
    assert (r["text"]["held_out_windows"], r["text"]["train_windows"]) == (
        n_held, len(windows) - n_held)


@pytest.mark.parametrize("heads", [0.0, 0.5])
def test_gpt2_equal_mlp_widths_export_smaller(gpt2_dir, tok, tmp_path, heads):
    """Every layer keeps floor-equal MLP widths: the export's n_inner is the kept width (GPT-2's
    heads, when pruned, stay zero-padded: its head width is n_embd / n_head)."""
    report = tmp_path / "r.json"
    assert main(["prune", str(gpt2_dir), "--heads", str(heads), "--mlp", "0.25", "--mlp-equal",
                 *FAST, "--out", str(tmp_path / "ck"), "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert [row["mlp"] for row in r["layers"]] == [72, 72]  # 96 - floor(0.25 * 96)
    padded = [f"layers/{i}/attn" for i in range(2)] if heads else []
    assert r["export"] == {"physically_smaller": not heads, "zero_padded": padded,
                           "config": {"n_inner": 72}}
    _, _, model = _export_matches(tmp_path / "ck", tmp_path / "hf", transformers.GPT2LMHeadModel,
                                  _ids(tok))
    assert model.config.n_inner == 72 and model.config.n_head == 4
    assert tuple(model.transformer.h[0].mlp.c_fc.weight.shape) == (24, 72)  # Conv1D [in, out]
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["n_inner"] == 72


def test_fine_tuning_with_lora_and_another_tokenizer(gpt2_dir, llama_dir, text_file, tmp_path):
    """A lowrank_jax checkpoint (no tokenizer.json of its own), a directory of text, LoRA."""
    report = tmp_path / "r.json"
    assert main(["convert", str(gpt2_dir), "--out", str(tmp_path / "ck0")]) == 0
    assert main(["prune", str(tmp_path / "ck0"), "--mlp", "0.5", "--text", str(text_file.parent),
                 "--tokenizer", str(llama_dir / "tokenizer.json"), "--finetune-steps", "3",
                 "--lora", "2", "--lr", "1e-2", *FAST, "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert len(r["finetune_loss"]) == 3 and set(r["perplexity"]) == {"before", "pruned",
                                                                      "finetuned"}
    assert r["perplexity"]["finetuned"] != r["perplexity"]["pruned"]
    assert r["text"]["files"] == 1 and r["text"]["source"] == str(text_file.parent)


def _error(capsys) -> str:
    """The one error line on stderr (status lines of the loading may come before it)."""
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("lowrank-jax prune: error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize("extra,flag", [
    (["--target", "0.5"], "--target"),            # a forecaster's option
    (["--heads", "0.5", "--data", "builtin"], "--data"),
    (["--heads", "0.5", "--plots", "PLOTS"], "--plots"),
    ([], "--heads"),                              # nothing to remove
    (["--heads", "1.5"], "--heads"),              # refused before loading
    (["--mlp", "0.5", "--text", "NO_SUCH"], "--text"),
    (["--mlp", "0.5", "--seq-len", "64"], "--seq-len"),  # longer than n_positions 32
    (["--mlp", "0.5", "--tokenizer", "EMPTY_DIR"], "--tokenizer"),  # no tokenizer.json there
    (["--mlp", "0.5", "--alpha", "0.3"], "--alpha"),
])
def test_bad_options_fail_in_one_line(gpt2_dir, tmp_path, capsys, extra, flag):
    extra = [str(tmp_path / "plots") if e == "PLOTS" else e for e in extra]
    extra = [str(tmp_path / "none") if e == "NO_SUCH" else e for e in extra]
    (tmp_path / "empty").mkdir()
    extra = [str(tmp_path / "empty") if e == "EMPTY_DIR" else e for e in extra]
    assert main(["prune", str(gpt2_dir), *extra, "--out", str(tmp_path / "ck"),
                 "--no-progress"]) == 2
    err = _error(capsys)
    assert flag in err, err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "plots").exists()


def test_gpt2_has_no_key_value_groups(gpt2_dir, tmp_path, capsys):
    assert main(["prune", str(gpt2_dir), "--kv-groups", "0.5", "--no-progress"]) == 2
    err = _error(capsys)
    assert "--kv-groups" in err and "gpt2" in err


def test_language_model_options_are_refused_for_other_models(tmp_path, capsys):
    import jax

    from lowrank_jax.io import save_model
    from lowrank_jax.models import t5
    from lowrank_jax.models.t5 import T5Config

    cfg = T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                   num_heads=2, feed_forward_proj="relu")
    save_model(tmp_path / "t5", cfg, t5.init(jax.random.PRNGKey(0), cfg))
    assert main(["prune", str(tmp_path / "t5"), "--mlp", "0.5", "--no-progress"]) == 2
    err = _error(capsys)
    assert "--mlp" in err and "t5" in err


def test_mlp_channel_scores_match_pytorch_autograd(llama_dir):
    """The gate derivative of every MLP channel, against the PyTorch original's gradients."""
    from lowrank_jax.models import family_of
    from lowrank_jax.recipes.prune_lm import mlp_channel_scores

    cfg, params = load_pretrained(llama_dir)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 300, (3, 10)) for _ in range(2)]
    got = mlp_channel_scores(params, family_of(cfg).loss(cfg), lambda j: {
        "input_ids": batches[j]}, 2)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    downs = [layer.mlp.down_proj.weight for layer in model.model.layers]  # [d, ff]
    total = [np.zeros(20) for _ in downs]
    for ids in batches:
        model.zero_grad()
        t = torch.tensor(ids)
        model(input_ids=t, labels=t).loss.backward()
        for acc, w in zip(total, downs, strict=True):
            acc += (w * w.grad).sum(0).detach().double().numpy()
    for g, want in zip(got, total, strict=True):
        np.testing.assert_allclose(g, np.abs(want / 2), rtol=1e-4, atol=1e-8)


def test_channel_selection_across_layers_and_per_layer():
    from lowrank_jax.recipes.prune_lm import select_channels

    scores = [np.array([0.1, 0.2, 0.9]), np.array([0.05, 0.3, 0.4, 0.5])]
    keep = select_channels(scores, 0.6)  # floor(0.6 * 7) = 4 lowest: 0.05, 0.1, 0.2, 0.3
    assert [k.tolist() for k in keep] == [[False, False, True], [False, False, True, True]]
    keep = select_channels([np.array([0.1, 0.2]), np.array([0.3, 0.4, 0.5])], 0.8)
    # 4 of 5 would empty a layer: each keeps its best
    assert [k.sum() for k in keep] == [1, 1]
    keep = select_channels(scores, 0.5, equal=True)  # floor(1.5) = 1 and floor(2) = 2
    assert [k.tolist() for k in keep] == [[False, True, True], [False, False, True, True]]
