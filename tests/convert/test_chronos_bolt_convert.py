"""Chronos-Bolt checkpoint conversion: detection, strict key checking, round trip."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
bolt_ref = pytest.importorskip("chronos.chronos_bolt")

from lowrank_jax.convert import (  # noqa: E402
    CheckpointError,
    detect_family,
    load_pretrained,
    state_dict_from_params,
)
from lowrank_jax.leaves import Dense, bias_of  # noqa: E402
from lowrank_jax.models import get_family  # noqa: E402
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig  # noqa: E402

BOLT = get_family("chronos_bolt").hf
CHRONOS = get_family("chronos").hf

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(1)
    hf_cfg = transformers.T5Config(
        d_model=16,
        d_kv=4,
        d_ff=24,
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
            context_length=32,
            prediction_length=8,
            input_patch_size=4,
            input_patch_stride=4,
            quantiles=[0.1, 0.5, 0.9],
            use_reg_token=True,
        ),
    )
    model = bolt_ref.ChronosBoltModelForForecasting(hf_cfg).eval()
    path = tmp_path_factory.mktemp("bolt")
    model.save_pretrained(path)
    with open(path / "config.json") as f:
        config = json.load(f)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model, path, config, state


def test_config_from_checkpoint(saved):
    _, path, config, _ = saved
    cfg, params = load_pretrained(path, family="chronos_bolt")
    assert isinstance(cfg, ChronosBoltConfig)
    assert (
        cfg.context_length,
        cfg.prediction_length,
        cfg.input_patch_size,
        cfg.input_patch_stride,
        cfg.quantiles,
        cfg.use_reg_token,
    ) == (32, 8, 4, 4, (0.1, 0.5, 0.9), True)
    assert (cfg.t5.d_model, cfg.t5.num_layers, cfg.t5.decoder_layers, cfg.t5.vocab_size) == (
        16,
        2,
        1,
        2,
    )
    assert params["shared"].shape == (2, 16)
    ipe = params["input_patch_embedding"]
    assert isinstance(ipe["hidden_layer"], Dense) and ipe["hidden_layer"].shape == (8, 24)
    assert bias_of(ipe["hidden_layer"]).shape == (24,)
    assert params["output_patch_embedding"]["output_layer"].shape == (24, 3 * 8)
    assert ChronosBoltConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_detect(saved):
    _, _, config, _ = saved
    assert BOLT.detect(config)
    plain_chronos = {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "chronos_config": {"context_length": 512, "n_tokens": 4096},
    }
    assert not BOLT.detect(plain_chronos)
    assert not BOLT.detect({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})
    assert not BOLT.detect({"model_type": "vit", "architectures": ["ViTModel"]})


def test_load_pretrained_detects_bolt(saved):
    _, path, config, _ = saved
    assert not CHRONOS.detect(config)
    assert detect_family(config) == "chronos_bolt"
    cfg, _ = load_pretrained(path)
    assert isinstance(cfg, ChronosBoltConfig)


def test_module_state_dict_and_round_trip(saved):
    """A live module's state dict carries the tied embed_tokens copies: accepted. Converting
    back reproduces every canonical tensor exactly."""
    model, _, config, state = saved
    cfg, params = load_pretrained(model, family="chronos_bolt")
    back, materialized, _ = state_dict_from_params(cfg, params)
    assert materialized == []
    assert set(back) | {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} == set(state)
    for k, v in back.items():
        np.testing.assert_array_equal(v, state[k], err_msg=k)


# -- malformed checkpoints --------------------------------------------------------------------


def _load(config, state):
    return load_pretrained(state, family="chronos_bolt", config=config)


def test_missing_key(saved):
    _, _, config, state = saved
    bad = dict(state)
    del bad["input_patch_embedding.residual_layer.bias"]
    del bad["decoder.block.0.layer.1.EncDecAttention.k.weight"]
    with pytest.raises(CheckpointError) as e:
        _load(config, bad)
    assert e.value.missing == {
        "input_patch_embedding.residual_layer.bias": (16,),
        "decoder.block.0.layer.1.EncDecAttention.k.weight": (16, 16),
    }
    assert "input_patch_embedding.residual_layer.bias" in str(e.value)
    assert "expected shape [16]" in str(e.value)


def test_unexpected_key(saved):
    _, _, config, state = saved
    bad = dict(
        state,
        **{
            "output_patch_embedding.layer_norm.weight": np.ones(24, np.float32),
            "encoder.block.2.layer.0.SelfAttention.q.weight": np.ones((16, 16)),
        },
    )
    with pytest.raises(CheckpointError) as e:
        _load(config, bad)
    assert e.value.unexpected == {
        "output_patch_embedding.layer_norm.weight": (24,),
        "encoder.block.2.layer.0.SelfAttention.q.weight": (16, 16),
    }
    assert not e.value.missing and not e.value.mismatched


def test_wrong_shapes_all_reported(saved):
    """A checkpoint for another prediction_length / patch size: every key named, with both
    shapes."""
    _, _, config, state = saved
    bad = dict(state)
    bad["output_patch_embedding.output_layer.weight"] = np.zeros((3 * 12, 24), np.float32)
    bad["output_patch_embedding.output_layer.bias"] = np.zeros((3 * 12,), np.float32)
    bad["input_patch_embedding.hidden_layer.weight"] = np.zeros((24, 16), np.float32)
    bad["shared.weight"] = np.zeros((1, 16), np.float32)
    with pytest.raises(CheckpointError) as e:
        _load(config, bad)
    assert e.value.mismatched == {
        "output_patch_embedding.output_layer.weight": ((24, 24), (36, 24)),
        "output_patch_embedding.output_layer.bias": ((24,), (36,)),
        "input_patch_embedding.hidden_layer.weight": ((24, 8), (24, 16)),
        "shared.weight": ((2, 16), (1, 16)),
    }
    msg = str(e.value)
    assert (
        "wrong shape for 'output_patch_embedding.output_layer.weight': expected [24, 24], "
        "got [36, 24]" in msg
    )
    assert "input_patch_size=4" in msg


def test_wrong_shape_of_an_ignorable_key(saved):
    _, _, config, state = saved
    bad = dict(state, **{"encoder.embed_tokens.weight": np.zeros((5, 16), np.float32)})
    with pytest.raises(CheckpointError) as e:
        _load(config, bad)
    assert e.value.mismatched == {"encoder.embed_tokens.weight": ((2, 16), (5, 16))}


def test_corrupt_weights_file(saved, tmp_path):
    _, path, _, _ = saved
    for name in ("config.json",):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    data = (path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_pretrained(tmp_path, family="chronos_bolt")


def test_config_without_bolt_entries(saved):
    _, _, config, state = saved
    cfg = json.loads(json.dumps(config))
    del cfg["chronos_config"]["input_patch_size"]
    with pytest.raises(ValueError, match="input_patch_size"):
        _load(cfg, state)


def test_save_pretrained_round_trip_and_compressed_export(saved, tmp_path, lowrank):
    """load_pretrained -> save_pretrained -> ChronosBoltModelForForecasting.from_pretrained gives
    the same forecasts; a compressed model exports (materialized) to forecasts equal to ours."""
    import jax

    from lowrank_jax.convert import save_pretrained
    from lowrank_jax.models import chronos_bolt as bolt

    model, path, _, _ = saved
    cfg, params = load_pretrained(path)
    out = tmp_path / "export"
    summary = save_pretrained(cfg, params, out)
    assert summary["materialized"] == []
    back = bolt_ref.ChronosBoltModelForForecasting.from_pretrained(out).eval()
    x = torch.tensor(np.random.default_rng(0).normal(size=(3, 32)).cumsum(1), dtype=torch.float32)
    with torch.no_grad():
        ref = model(context=x).quantile_preds.numpy()
        got = back(context=x).quantile_preds.numpy()
    assert np.abs(got - ref).max() == 0.0

    small = lowrank(params, r"attn/(qk/q|qk/k|v|o)$", rank=2)
    summary = save_pretrained(cfg, small, tmp_path / "small")
    assert summary["materialized"] and all("attn/" in p for p in summary["materialized"])
    back = bolt_ref.ChronosBoltModelForForecasting.from_pretrained(tmp_path / "small").eval()
    with torch.no_grad():
        hf_small = back(context=x).quantile_preds.numpy()
    ours = np.asarray(
        jax.jit(lambda p, c: bolt.apply(p, {"context": c}, cfg))(small, x.numpy())["quantile_preds"]
    )
    assert np.abs(hf_small - ours).max() <= 1e-4
    assert np.abs(hf_small - ref).max() > 1e-3  # the compression did change the model
