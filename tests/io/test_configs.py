"""Configs to JSON and back, rebuilt from the registry of config classes only."""

import dataclasses
import json

import pytest

from lowrank_jax import io as lio
from lowrank_jax.errors import ConfigError
from lowrank_jax.models import ChronosBoltConfig, ChronosConfig, T5Config, ViTConfig

T5 = T5Config(vocab_size=40, d_model=12, d_kv=3, d_ff=20, num_layers=2, num_decoder_layers=1,
              num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              layer_norm_epsilon=1e-5)


def test_registry_holds_the_family_configs_and_the_configs_nested_in_them():
    classes = lio.config_classes()
    for cls in (T5Config, ChronosConfig, ChronosBoltConfig, ViTConfig):
        assert classes[f"{cls.__module__}.{cls.__qualname__}"] is cls


def test_nested_config_round_trips():
    cfg = ChronosConfig(t5=T5, n_tokens=40, context_length=16, prediction_length=4,
                        temperature=0.7, top_k=5, low_limit=-3.5, use_eos_token=False)
    d = lio.config_to_dict(cfg)
    assert d["__config__"] == "lowrank_jax.models.chronos.ChronosConfig"
    assert d["fields"]["t5"]["__config__"] == "lowrank_jax.models.t5.T5Config"
    back = lio.config_from_dict(json.loads(json.dumps(d)))
    assert back == cfg and type(back.t5) is T5Config and back.t5.num_decoder_layers == 1


def test_tuple_fields_come_back_as_tuples():
    t5 = dataclasses.replace(T5, vocab_size=1)
    cfg = ChronosBoltConfig(t5=t5, context_length=16, prediction_length=8, input_patch_size=4,
                            input_patch_stride=4, quantiles=(0.1, 0.5, 0.9))
    back = lio.config_from_dict(json.loads(json.dumps(lio.config_to_dict(cfg))))
    assert back == cfg and back.quantiles == (0.1, 0.5, 0.9) and type(back.quantiles) is tuple


def test_reads_the_0_1_spelling():
    d = lio.config_to_dict(T5)
    d["__config__"] = "lowrank_jax.models.t5:T5Config"  # lowrank_jax 0.1: 'module:QualName'
    assert lio.config_from_dict(d) == T5


@pytest.mark.parametrize("name", ["os:system", "builtins.object", "evil.module:T5Configs",
                                  "lowrank_jax.io.files:OutputExistsError"])
def test_refuses_classes_outside_the_registry(name):
    d = {"__config__": name, "fields": {}}
    with pytest.raises(ConfigError, match=rf"ckpt/tree\.json: config class '{name}' is not a "
                                          r"registered lowrank_jax config; known: .*T5Config"):
        lio.config_from_dict(d, source="ckpt/tree.json")


def test_refuses_bad_fields_and_shapes():
    with pytest.raises(ConfigError, match="not a serialized lowrank_jax config"):
        lio.config_from_dict({"fields": {}}, source="f")
    d = lio.config_to_dict(T5)
    d["fields"]["d_modle"] = 3
    with pytest.raises(ConfigError, match=r"T5Config has no fields \['d_modle'\]"):
        lio.config_from_dict(d, source="f")
    d = lio.config_to_dict(T5)
    d["fields"]["num_heads"] = -1
    with pytest.raises(ConfigError, match="cannot build T5Config.*num_heads"):
        lio.config_from_dict(d, source="f")


@dataclasses.dataclass(frozen=True)
class _Inner:
    sizes: tuple[int, ...] = (1, 2)


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner
    names: list = dataclasses.field(default_factory=list)
    rate: float | None = None


def test_unregistered_configs_are_refused_and_registered_ones_round_trip():
    cfg = _Outer(inner=_Inner(sizes=(3, 4, 5)), names=["a", "b"], rate=0.5)
    with pytest.raises(ConfigError, match="_Outer is not a registered config class"):
        lio.config_to_dict(cfg)
    with pytest.raises(ConfigError, match="expected a config dataclass instance, got int"):
        lio.config_to_dict(3)
    lio.register_config(_Outer)  # its nested _Inner is found through the annotation
    back = lio.config_from_dict(json.loads(json.dumps(lio.config_to_dict(cfg))))
    assert back == cfg and type(back.inner.sizes) is tuple and type(back.names) is list
