"""Checkpoints written by lowrank_jax 0.1 (format version 1) still load, and the upgraded models
compute what the 0.1 models computed.

The fixtures under ``data/v1`` were written by lowrank_jax 0.1.0 with
``data/make_v1_fixtures.py``: a tiny T5 and a tiny ViT, with attention weights compressed to
``LowRank``, ``HeadLowRank`` (irregular ranks) and ``MaskedBinary`` leaves, and the 0.1.0
models' outputs on fixed inputs. When the 0.1.0 source is available (``LOWRANK_JAX_V1_SRC``),
one test also regenerates the fixtures with it in a subprocess and checks those.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from lowrank_jax import io as lio
from lowrank_jax import leaves as lj
from lowrank_jax import models
from lowrank_jax.errors import CheckpointError, ShapeError

DATA = os.path.join(os.path.dirname(__file__), "data")
V1 = os.path.join(DATA, "v1")
# The fixtures' outputs were computed with XLA's default backend optimization; the tests
# compile at level 0 (tests/conftest.py), which contracts multiply-adds into FMAs differently,
# so a model's outputs differ in their last bits (measured: 1.1e-6 on one ViT output of
# magnitude 0.43, 0 differences at level 2). 1e-5 is the block tolerance, ten times tighter
# than a model's.
TOL = 1e-5


def _inputs_outputs(npz_file):
    ref = np.load(npz_file)
    inputs = {k[3:]: ref[k] for k in ref.files if k.startswith("in_")}
    outputs = {k[4:]: ref[k] for k in ref.files if k.startswith("out_")}
    return inputs, outputs


def _check_outputs(directory, name):
    config, params = lio.load_model(os.path.join(directory, name))
    inputs, want = _inputs_outputs(os.path.join(directory, f"{name}.npz"))
    got = jax.jit(lambda p, x: models.apply(p, x, config))(params, inputs)
    assert set(want) <= set(got)
    for key, ref in want.items():
        np.testing.assert_allclose(np.asarray(got[key]), ref, rtol=0, atol=TOL, err_msg=key)
    return config, params


def test_fixtures_are_format_version_1():
    for name in ("t5", "vit"):
        with open(os.path.join(V1, name, lio.TREE_FILE)) as f:
            doc = json.load(f)
        assert doc["version"] == 1 and doc["metadata"]["config"]["__config__"].count(":") == 1


def test_t5_upgrade_gives_the_0_1_outputs():
    config, params = _check_outputs(V1, "t5")
    assert type(config) is models.T5Config
    enc = params["encoder"]["layers"][0]["attn"]
    assert set(enc) == {"qk", "v", "o", "heads"}
    assert type(enc["qk"].q) is lj.LowRank and type(enc["qk"].k) is lj.HeadLowRank
    assert enc["qk"].k.ranks == (1, 2)  # irregular per-head ranks kept
    assert enc["qk"].widths == (4, 4)
    assert enc["heads"].ids == (0, 1) and enc["heads"].v == (4, 4)
    assert enc["heads"].scale == 1.0  # T5: unscaled
    dec = params["decoder"]["layers"][0]
    assert type(dec["self_attn"]["v"]) is lj.MaskedBinary
    assert type(dec["cross_attn"]["o"]) is lj.LowRank


def test_vit_upgrade_gives_the_0_1_outputs():
    config, params = _check_outputs(V1, "vit")
    attn = params["encoder"]["layers"][0]["attn"]
    assert attn["heads"].scale == 0.5  # 1/sqrt(d_head = 4)
    assert type(attn["v"]) is lj.HeadLowRank and attn["v"].ranks == (3, 2)
    assert type(params["encoder"]["layers"][0]["mlp"]["wi"]) is lj.MaskedBinary


def test_bare_v1_tree_warns_and_upgrade_attention_matches_load_model():
    for name, scaled in (("t5", False), ("vit", True)):
        path = os.path.join(V1, name)
        with pytest.warns(UserWarning, match=r"0\.1 checkpoint.*load_model.*upgrade_attention"):
            bare = lio.load_params(path)
        blocks = [p for p, _ in lj.named_leaves(bare) if p.endswith("/attn/q")]
        assert blocks  # the 0.1 layout is kept: '.../attn/q', not '.../attn/qk/q'
        _, upgraded = lio.load_model(path)
        mine = lio.upgrade_attention(bare, num_heads=2, scaled=scaled)
        assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(upgraded)
        for x, y in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(upgraded),
                        strict=True):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    with pytest.raises(ShapeError, match="'encoder/layers/0/attn'.*num_heads=3 does not divide"):
        lio.upgrade_attention(bare, num_heads=3)


def test_v2_checkpoints_do_not_warn(tmp_path):
    lio.save_params(tmp_path / "ck", {"attn": {"q": lj.Dense(w=np.ones((2, 2), np.float32)),
                                               "k": lj.Dense(w=np.ones((2, 2), np.float32)),
                                               "v": lj.Dense(w=np.ones((2, 2), np.float32)),
                                               "o": lj.Dense(w=np.ones((2, 2), np.float32))}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(lio.load_params(tmp_path / "ck")["attn"]) == {"q", "k", "v", "o"}


def test_v1_tree_that_does_not_fit_its_config_is_refused(tmp_path):
    path = tmp_path / "t5"
    shutil.copytree(os.path.join(V1, "t5"), path)
    file = path / lio.TREE_FILE
    doc = json.loads(file.read_text())
    doc["metadata"]["config"]["fields"]["d_ff"] = 16  # the stored MLP has d_ff=12
    file.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"does not match the t5 model(.|\n)*wrong shape for "
                                              r"'decoder/layers/0/mlp/wo': expected \[16, 8\], "
                                              r"got \[12, 8\]"):
        lio.load_model(path)


def _v1_source():
    src = os.environ.get("LOWRANK_JAX_V1_SRC")
    return src if src and os.path.isfile(os.path.join(src, "lowrank_jax", "io.py")) else None


@pytest.mark.skipif(_v1_source() is None, reason="set LOWRANK_JAX_V1_SRC to a lowrank_jax 0.1.0 "
                    "checkout to regenerate the version 1 fixtures")
def test_fixtures_regenerated_by_the_0_1_release(tmp_path):
    src = _v1_source()
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(DATA, "make_v1_fixtures.py"),
                           str(tmp_path)], cwd=src, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("t5", "vit"):
        _check_outputs(str(tmp_path), name)
