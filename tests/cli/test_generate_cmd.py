"""``lowrank-jax generate``: prompts through the directory's tokenizer.json, cached decoding."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lowrank_jax.cli.main import main  # noqa: E402
from lowrank_jax.convert import load_pretrained  # noqa: E402
from lowrank_jax.models import generate  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, lm):
    d = tmp_path_factory.mktemp("llama")
    tok = lm.stdlib_bpe()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=24,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, eos_token_id=0, bos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return d, tok


def test_generate_continues_prompts(llama_dir, tmp_path, capsys):
    d, tok = llama_dir
    report = tmp_path / "gen.json"
    prompts = ["def main(", "import os\nclass A:"]
    assert main(["generate", str(d), "--prompt", prompts[0], "--prompt", prompts[1],
                 "--max-new-tokens", "6", "--stop-token", "299", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    got = json.loads(report.read_text())["continuations"]
    # the same as the library on the left-padded token ids
    cfg, params = load_pretrained(d)
    enc = [tok.encode(p).ids for p in prompts]
    n = max(map(len, enc))
    ids = np.array([[0] * (n - len(e)) + e for e in enc])
    mask = np.array([[0] * (n - len(e)) + [1] * len(e) for e in enc])
    want = generate(params, cfg, ids, mask, max_new_tokens=6, stop_tokens=[299])
    for row, g, p in zip(want.tolist(), got, prompts, strict=True):
        kept = row[:row.index(299)] if 299 in row else row
        assert g["tokens"] == kept and g["prompt"] == p
        assert g["text"] == tok.decode(kept)
        assert p + g["text"] in out


def test_generate_without_tokenizer_fails_cleanly(llama_dir, tmp_path, capsys):
    d, _ = llama_dir
    assert main(["generate", str(d), "--prompt", "x", "--tokenizer",
                 str(tmp_path / "none.json")]) == 2
    assert "no tokenizer at" in capsys.readouterr().err


def test_convert_compress_export_on_a_llama_directory(llama_dir, tmp_path):
    from lowrank_jax.io import load_model
    from lowrank_jax.models import apply

    d, tok = llama_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    assert main(["compress", str(tmp_path / "ck"), "--rank", "3",
                 "--out", str(tmp_path / "small")]) == 0
    assert main(["export", str(tmp_path / "small"), "--out", str(tmp_path / "hf")]) == 0
    cfg, params = load_model(tmp_path / "small")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = np.array([tok.encode("def f(x):\n    return x").ids])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()
    got = np.asarray(apply(params, {"input_ids": ids}, cfg)["logits"])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # the tokenizer travels with the model: convert, compress and export copy it verbatim
    for out in ("ck", "small", "hf"):
        assert (tmp_path / out / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    assert fast("def f(x):\n    return x")["input_ids"] == ids[0].tolist()
    # so the compressed checkpoint generates without --tokenizer
    assert main(["generate", str(tmp_path / "small"), "--prompt", "x = ",
                 "--max-new-tokens", "3"]) == 0
