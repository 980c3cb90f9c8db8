"""save_model / load_model / load_model_state: config, parameters and state together."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import io as lio
from lowrank_jax import leaves as lj
from lowrank_jax import models
from lowrank_jax.errors import CheckpointError, ConfigError
from lowrank_jax.models import ViTConfig

CFG = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
                num_attention_heads=2, intermediate_size=12, num_labels=3)


@dataclasses.dataclass(frozen=True)
class _Unregistered:
    d_model: int = 4


def _same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert type(x) is type(y) and x.dtype == y.dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    # The family's tree filled with NumPy draws (tracing init computes nothing: fast).
    rng = np.random.default_rng(0)
    abstract = jax.eval_shape(lambda: models.get_family("vit").init(jax.random.PRNGKey(0), CFG))
    params = jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), abstract)
    # One compressed projection: a model checkpoint stores leaves as they are.
    attn = params["encoder"]["layers"][0]["attn"]
    q = lj.LowRank(u=jnp.asarray(rng.standard_normal((8, 3)), jnp.float32),
                   v=jnp.asarray(rng.standard_normal((3, 8)), jnp.float32), b=attn["qk"].q.bias)
    params = lj.replace_paths(params, {"encoder/layers/0/attn/qk/q": q})
    state = {"bn": {"mean": jnp.arange(4.0), "var": np.ones(4, np.float32)}, "count": np.int64(7)}
    path = tmp_path_factory.mktemp("model") / "vit"
    lio.save_model(path, CFG, params, state=state, metadata={"source": "test"})
    return path, params, state


def test_round_trip(vit):
    path, params, state = vit
    cfg, loaded = lio.load_model(path)
    assert cfg == CFG
    _same(params, loaded)
    assert type(loaded["encoder"]["layers"][0]["attn"]["qk"].q) is lj.LowRank
    _same(lio.load_model_state(path), state)
    meta = lio.load_metadata(path)
    assert meta["source"] == "test"
    assert meta["config"]["__config__"] == "lowrank_jax.models.vit.ViTConfig"


def test_stateless_model_has_no_state(tmp_path):
    params = {"w": lj.Dense(w=jnp.ones((2, 2)))}
    lio.save_model(tmp_path / "m", CFG, params)
    assert lio.load_model_state(tmp_path / "m") is None
    _same(lio.load_model(tmp_path / "m")[1], params)


def test_errors(vit, tmp_path):
    path, params, _ = vit
    with pytest.raises(ConfigError, match="metadata key 'config' is reserved"):
        lio.save_model(tmp_path / "x", CFG, params, metadata={"config": {}})
    with pytest.raises(ConfigError, match="expected a config dataclass instance, got dict"):
        lio.save_model(tmp_path / "x", {"d": 1}, params)
    with pytest.raises(ConfigError, match="_Unregistered is not a registered config class"):
        lio.save_model(tmp_path / "x", _Unregistered(), params)
    lio.save_params(tmp_path / "bare", {"w": jnp.ones(2)})
    for load in (lio.load_model, lio.load_model_state):
        with pytest.raises(CheckpointError, match="without a model config.*use load_params"):
            load(tmp_path / "bare")
    assert not (tmp_path / "x").exists()
