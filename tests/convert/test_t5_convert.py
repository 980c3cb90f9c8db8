"""Hugging Face T5 checkpoints -> lowrank_jax trees: files, modules, state dicts, errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from lowrank_jax.convert import (  # noqa: E402
    CheckpointError,
    hf_families,
    load_pretrained,
    state_dict_from_params,
)
from lowrank_jax.leaves import (  # noqa: E402
    Dense,
    HeadLayout,
    QueryKey,
    bias_of,
    get_path,
    materialize,
)
from lowrank_jax.models.t5 import T5Config  # noqa: E402

torch.set_num_threads(1)

SMALL = dict(vocab_size=40, d_model=16, d_kv=6, d_ff=24, num_layers=2, num_heads=2,
             relative_attention_num_buckets=8, relative_attention_max_distance=20,
             decoder_start_token_id=0)
Q0 = "encoder.block.0.layer.0.SelfAttention.q.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**SMALL))
    path = tmp_path_factory.mktemp("t5")
    model.save_pretrained(path)
    return path, model


def copy_dir(src, dst, state=None, config=None):
    """A checkpoint directory with (optionally) replaced weights/config."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config or {})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    if state is None:
        state = load_file(os.path.join(src, "model.safetensors"))
    save_file(state, os.path.join(dst, "model.safetensors"))
    return dst


def test_directory_safetensors(saved):
    path, model = saved
    cfg, params = load_pretrained(path)
    assert isinstance(cfg, T5Config) and "t5" in hf_families()
    assert (cfg.d_model, cfg.d_kv, cfg.num_heads) == (16, 6, 2)  # d_kv * heads != d_model
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    attn = params["encoder"]["layers"][0]["attn"]
    # The new structure: a QueryKey with per-head widths and an unscaled HeadLayout (T5).
    assert isinstance(attn["qk"], QueryKey) and attn["qk"].widths == (6, 6)
    heads = attn["heads"]
    assert isinstance(heads, HeadLayout)
    assert (heads.ids, heads.v, heads.scale) == ((0, 1), (6, 6), 1.0)
    q = get_path(params, "encoder/layers/0/attn/qk/q")
    assert isinstance(q, Dense) and q.shape == (16, 12) and bias_of(q) is None
    np.testing.assert_array_equal(np.asarray(materialize(q)), sd[Q0].T)  # [out, in] -> [in, out]
    np.testing.assert_array_equal(
        np.asarray(params["decoder"]["rel_bias"]),
        sd["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"])
    np.testing.assert_array_equal(
        np.asarray(materialize(params["decoder"]["layers"][1]["mlp"]["wo"])),
        sd["decoder.block.1.layer.2.DenseReluDense.wo.weight"].T)
    assert "lm_head" not in params and cfg.tie_word_embeddings


def test_module_state_dict_and_bin_agree(saved, tmp_path):
    path, model = saved
    _, ref = load_pretrained(path)
    _, from_module = load_pretrained(model)  # state_dict() has the tied copies
    state = model.state_dict()
    _, from_sd = load_pretrained(state, config=os.path.join(path, "config.json"))
    d = copy_dir(path, tmp_path / "bin")
    os.remove(d / "model.safetensors")
    torch.save({k: v.clone() for k, v in state.items()}, d / "pytorch_model.bin")
    _, from_bin = load_pretrained(d)
    import jax

    for other in (from_module, from_sd, from_bin):
        for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(other),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="needs config"):
        load_pretrained(state)


def test_sharded_safetensors(saved, tmp_path):
    path, _ = saved
    state = load_file(os.path.join(path, "model.safetensors"))
    keys = sorted(state)
    d = copy_dir(path, tmp_path / "sharded")
    os.remove(d / "model.safetensors")
    halves = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    for name, ks in halves.items():
        save_file({k: state[k] for k in ks}, os.path.join(d, name))
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: n for n, ks in halves.items() for k in ks}}, f)
    _, params = load_pretrained(d)
    np.testing.assert_array_equal(
        np.asarray(materialize(get_path(params, "encoder/layers/0/attn/qk/q"))), state[Q0].T)


def test_untied_head_v1_1_style(saved, tmp_path):
    """Old T5 v1.1 checkpoints: tie_word_embeddings=false and a distinct lm_head.weight."""
    path, _ = saved
    state = load_file(os.path.join(path, "model.safetensors"))
    state["lm_head.weight"] = np.random.default_rng(0).normal(size=(40, 16)).astype(np.float32)
    d = copy_dir(path, tmp_path / "untied", state,
                 {"tie_word_embeddings": False, "feed_forward_proj": "relu"})
    with open(d / "config.json") as f:
        raw = json.load(f)
    raw.pop("scale_decoder_outputs", None)  # as written by transformers 4
    with open(d / "config.json", "w") as f:
        json.dump(raw, f)
    cfg, params = load_pretrained(d)
    assert not cfg.tie_word_embeddings and not cfg.scales_decoder_outputs
    np.testing.assert_array_equal(np.asarray(materialize(params["lm_head"])),
                                  state["lm_head.weight"].T)
    # Same weights but a transformers-5 config (tie forced true): the distinct lm_head wins.
    d5 = copy_dir(path, tmp_path / "untied5", state, {"scale_decoder_outputs": False})
    cfg5, params5 = load_pretrained(d5)
    assert not cfg5.tie_word_embeddings and not cfg5.scales_decoder_outputs
    assert "lm_head" in params5


def test_bfloat16_safetensors(saved, tmp_path):
    """bfloat16 checkpoints (which NumPy cannot hold) load without torch, widened exactly."""
    from safetensors.torch import save_file as save_torch

    path, model = saved
    d = copy_dir(path, tmp_path / "bf16")
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()
             if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                          "lm_head.weight")}
    save_torch(state, str(d / "model.safetensors"))
    _, params = load_pretrained(d)
    np.testing.assert_array_equal(
        np.asarray(materialize(get_path(params, "encoder/layers/0/attn/qk/q"))),
        state[Q0].float().numpy().T)
    assert not np.array_equal(state[Q0].float().numpy(), model.state_dict()[Q0].numpy())


def test_round_trip_to_hf(saved):
    path, _ = saved
    state = load_file(os.path.join(path, "model.safetensors"))
    cfg, params = load_pretrained(path)
    back, materialized, widened = state_dict_from_params(cfg, params)
    assert materialized == [] and widened == []
    assert set(back) == set(state)
    for k in state:
        np.testing.assert_array_equal(back[k], state[k])


def test_missing_unexpected_and_misshaped_keys_all_reported(saved, tmp_path):
    path, _ = saved
    state = load_file(os.path.join(path, "model.safetensors"))
    missing = "decoder.block.1.layer.1.EncDecAttention.k.weight"
    del state[missing]
    state["encoder.block.0.layer.0.SelfAttention.extra.weight"] = np.zeros((3, 4), np.float32)
    state[Q0] = np.zeros((12, 15), np.float32)
    d = copy_dir(path, tmp_path / "bad", state)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(d)
    err = info.value
    msg = str(err)
    assert isinstance(err, ValueError)
    assert str(d / "model.safetensors") in msg
    assert f"missing key '{missing}': expected shape [12, 16]" in msg
    assert "unexpected key 'encoder.block.0.layer.0.SelfAttention.extra.weight': " \
           "actual shape [3, 4]" in msg
    assert f"wrong shape for '{Q0}': expected [12, 16], got [12, 15]" in msg
    assert err.missing == {missing: (12, 16)}
    assert set(err.unexpected) == {"encoder.block.0.layer.0.SelfAttention.extra.weight"}
    assert err.mismatched == {Q0: ((12, 16), (12, 15))}


def test_config_that_does_not_match_weights(saved, tmp_path):
    path, _ = saved
    d = copy_dir(path, tmp_path / "cfg", None, {"d_ff": 32})
    with pytest.raises(CheckpointError, match=r"DenseReluDense.wi.weight': expected \[32, 16\]"):
        load_pretrained(d)


def test_unknown_family_and_override(saved, tmp_path):
    path, _ = saved
    d = copy_dir(path, tmp_path / "opt", None,
                 {"model_type": "opt", "architectures": ["OPTForCausalLM"]})
    with pytest.raises(ValueError, match="unknown model family.*opt"):
        load_pretrained(d)
    cfg, _ = load_pretrained(d, family="t5")
    assert isinstance(cfg, T5Config)
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        load_pretrained(path, family="nope")


def test_truncated_safetensors_and_missing_files(saved, tmp_path):
    path, _ = saved
    d = copy_dir(path, tmp_path / "trunc")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*trunc"):
        load_pretrained(d)
    os.remove(f)
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_pretrained(d)
    os.remove(d / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(d)


def test_safetensors_path_does_not_import_torch(saved):
    path, _ = saved
    code = ("import sys, lowrank_jax.convert as c; c.load_pretrained(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
