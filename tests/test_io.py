"""save_params / load_params: exact round trips and clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import io as lio
from lowrank_jax.leaves import leaf_dataclass


class _Scaled(lj.Leaf):
    """A leaf defined outside the library: a nested data field and a tuple/list static field."""

    parts: tuple
    tags: tuple = ()
    gains: list | None = None

    @property
    def shape(self):
        return tuple(self.parts[0].shape)

    def apply(self, x):
        return x @ self.to_dense()

    def to_dense(self):
        return self.parts[0] * self.parts[1]

    def param_count(self):
        return sum(int(np.prod(p.shape)) for p in self.parts)

    def storage_bits(self):
        return 32 * self.param_count()

    def flops(self, n_tokens):
        return n_tokens * self.d_in * self.d_out


_Scaled = leaf_dataclass(_Scaled, meta=("tags", "gains"))


def _params():
    ks = jax.random.split(jax.random.key(0), 8)
    special = jnp.array([[0.0, -0.0, jnp.inf], [-jnp.inf, jnp.nan, 1e-45]], jnp.float32)
    layers = [
        {
            "attn": {
                "q": lj.init_head_lowrank(ks[i], 6, 2, 3, 2),  # ranks=None
                "k": lj.HeadLowRank(u=jax.random.normal(ks[i + 2], (6, 2, 3)),
                                    v=jax.random.normal(ks[i + 4], (2, 3, 3)),
                                    b=jnp.arange(6.0), ranks=(1, 3)),
                "o": lj.init_lowrank(ks[i], 6, 6, 2),  # b=None
            },
            "mlp": {
                "wi": lj.init_masked_binary(ks[i + 1], 6, 8, 0.37, bias=True),
                "wo": lj.init_dense(ks[i + 3], 8, 6),  # b=None
            },
            "norm": {"scale": jnp.ones((6,), jnp.bfloat16)},
        }
        for i in range(2)
    ]
    return {
        "layers": layers,
        "emb": lj.Dense(w=special, b=jnp.zeros((3,))),
        "lr_bias": lj.init_lowrank(ks[6], 4, 5, 3, bias=True),
        "extra": (np.arange(5, dtype=np.int8), np.linspace(0, 1, 3), None,
                  np.array([True, False]), np.float32(2.5), jnp.zeros((0, 4))),
        "by_index": {2: [lj.Dense(w=jnp.eye(3), b=None)], 0: None},
        "custom": _Scaled(parts=(jnp.ones((3, 2)), jnp.full((3, 2), 0.5)),
                          tags=(1, "a", 0.1, (2, None)), gains=[1.5, None, True]),
    }


def _assert_identical(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert type(x) is type(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # bit-identical, NaN included


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint shared by the round-trip and error tests (orbax saves are slowish)."""
    path = tmp_path_factory.mktemp("io") / "ckpt"
    params = _params()
    lio.save_params(path, params, metadata={"step": 12, "note": "t5-small", "eps": [0.1]})
    return path, params


def test_round_trip_is_exact(saved):
    path, params = saved
    loaded = lio.load_params(path)
    _assert_identical(params, loaded)
    # Static fields come back with their types (a tuple stays a tuple, so treedefs are equal).
    assert loaded["layers"][0]["attn"]["k"].ranks == (1, 3)
    assert loaded["layers"][0]["attn"]["q"].ranks is None
    assert loaded["layers"][1]["mlp"]["wi"].keep == 0.37
    assert loaded["custom"].tags == (1, "a", 0.1, (2, None))
    assert loaded["custom"].gains == [1.5, None, True]
    assert loaded["layers"][0]["attn"]["o"].b is None and loaded["layers"][1]["mlp"]["wo"].b is None
    # Containers: dict insertion order, int keys, list vs tuple, numpy scalars.
    assert list(loaded) == list(params) and list(loaded["by_index"]) == [2, 0]
    assert isinstance(loaded["by_index"][2], list)
    assert isinstance(loaded["extra"], tuple) and isinstance(loaded["extra"][4], np.float32)
    assert isinstance(loaded["emb"].w, jax.Array) and isinstance(loaded["extra"][1], np.ndarray)
    assert loaded["extra"][1].dtype == np.float64
    # Leaves still compute the same thing and report the same counts.
    x = jax.random.normal(jax.random.key(1), (3, 6))
    for name in ("q", "k", "o"):
        a, b = params["layers"][0]["attn"][name], loaded["layers"][0]["attn"][name]
        np.testing.assert_array_equal(lj.linear(a, x), lj.linear(b, x))
    assert lj.flops(loaded, 10) == lj.flops(params, 10)
    assert lj.storage_bits(loaded) == lj.storage_bits(params)


def test_metadata(saved):
    path, _ = saved
    assert lio.load_metadata(path) == {"step": 12, "note": "t5-small", "eps": [0.1]}


def test_tree_without_arrays_and_single_leaf(tmp_path):
    lio.save_params(tmp_path / "none", {"a": None, "b": [None, ()]})
    assert lio.load_params(tmp_path / "none") == {"a": None, "b": [None, ()]}
    assert not os.path.exists(tmp_path / "none" / lio.ARRAYS_DIR)
    assert lio.load_metadata(tmp_path / "none") == {}
    leaf = lj.init_lowrank(jax.random.key(3), 5, 4, 2)
    lio.save_params(tmp_path / "leaf", leaf)
    _assert_identical(leaf, lio.load_params(tmp_path / "leaf"))


def test_refuses_overwrite_then_replaces(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()  # an existing empty directory is fine
    lio.save_params(path, {"w": jnp.ones((2,))})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        lio.save_params(path, {"w": jnp.zeros((3,))})
    np.testing.assert_array_equal(lio.load_params(path)["w"], np.ones((2,)))
    lio.save_params(path, {"v": jnp.zeros((3,))}, overwrite=True)
    _assert_identical(lio.load_params(path), {"v": jnp.zeros((3,))})
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary or backup directory left


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    # A node that cannot be saved fails before anything is written.
    with pytest.raises(TypeError, match="'a/1'.*set"):
        lio.save_params(tmp_path / "bad", {"a": [jnp.ones(2), {1, 2}]})
    with pytest.raises(TypeError, match="metadata"):
        lio.save_params(tmp_path / "bad", {"a": jnp.ones(2)}, metadata={"f": object()})
    assert os.listdir(tmp_path) == []

    # A failure after orbax wrote the arrays: neither the target nor the temp dir survive, and an
    # existing checkpoint being overwritten is untouched.
    def boom(file, text):
        raise OSError("disk full")

    lio.save_params(tmp_path / "old", {"w": jnp.ones((2,))})
    monkeypatch.setattr(lio, "_write_text", boom)
    with pytest.raises(OSError, match="disk full"):
        lio.save_params(tmp_path / "new", {"w": jnp.ones((2,))})
    with pytest.raises(OSError, match="disk full"):
        lio.save_params(tmp_path / "old", {"w": jnp.zeros((5,))}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["old"]
    monkeypatch.undo()
    np.testing.assert_array_equal(lio.load_params(tmp_path / "old")["w"], np.ones((2,)))


# ---------------------------------------------------------------------------------------------
# Load errors: each copies the shared checkpoint and breaks one thing.

def _copy(saved, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(saved[0], dst)
    return dst


def _edit_tree(path, fn):
    file = path / lio.TREE_FILE
    doc = json.loads(file.read_text())
    fn(doc)
    file.write_text(json.dumps(doc))


def _node(doc, *keys):
    node = doc["tree"]
    for k in keys:
        if node["type"] == "dict":
            node = dict((kk, v) for kk, v in node["items"])[k]
        elif node["type"] == "leaf":
            node = node["data"][k]
        else:
            node = node["items"][k]
    return node


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        lio.load_params(tmp_path / "nowhere")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        lio.load_params(tmp_path / "f")


def test_dir_without_tree_json(saved, tmp_path):
    path = _copy(saved, tmp_path)
    os.remove(path / lio.TREE_FILE)
    with pytest.raises(FileNotFoundError, match=r"tree\.json not found.*\['arrays'\]"):
        lio.load_params(path)
    with pytest.raises(FileNotFoundError):
        lio.load_metadata(path)


def test_corrupt_tree_json(saved, tmp_path):
    path = _copy(saved, tmp_path)
    file = path / lio.TREE_FILE
    text = file.read_text()
    file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"tree\.json is not valid JSON"):
        lio.load_params(path)
    file.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="expected format 'lowrank_jax.params', found 'something"):
        lio.load_params(path)
    file.write_text(text)
    _edit_tree(path, lambda d: _node(d, "layers", 1, "mlp").update(type="set"))
    with pytest.raises(ValueError, match="corrupt skeleton.*'layers/1/mlp'.*found 'set'"):
        lio.load_params(path)
    file.write_text(text)
    _edit_tree(path, lambda d: _node(d, "emb", "w").update(shape=[2, -3]))
    with pytest.raises(ValueError, match="'emb/w'.*non-negative ints"):
        lio.load_params(path)


def test_unknown_leaf_type(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "layers", 0, "attn", "o").update(
        {"class": "Tucker", "qualname": "elsewhere.Tucker"}))
    with pytest.raises(ValueError, match="unknown leaf type 'Tucker'.*'layers/0/attn/o'.*LowRank"):
        lio.load_params(path)


def test_invalid_static_field(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "layers", 0, "mlp", "wi")["static"].update(keep=2.0))
    with pytest.raises(ValueError, match="cannot rebuild MaskedBinary at 'layers/0/mlp/wi'.*keep"):
        lio.load_params(path)


def test_arrays_do_not_match_skeleton(saved, tmp_path):
    path = _copy(saved, tmp_path)
    text = (path / lio.TREE_FILE).read_text()
    _edit_tree(path, lambda d: _node(d, "layers", 1, "attn", "k", "u").update(shape=[6, 2, 4]))
    with pytest.raises(ValueError, match=r"'layers/1/attn/k/u'.*expected float32\[6, 2, 4\], "
                                         r"found float32\[6, 2, 3\]"):
        lio.load_params(path)
    (path / lio.TREE_FILE).write_text(text)
    _edit_tree(path, lambda d: _node(d, "emb", "b").update(dtype="int32"))
    with pytest.raises(ValueError, match=r"'emb/b'.*expected int32\[3\], found float32\[3\]"):
        lio.load_params(path)
    (path / lio.TREE_FILE).write_text(text)
    _edit_tree(path, lambda d: _node(d, "emb", "b").update(key="arr_999999"))
    with pytest.raises(ValueError, match=r"missing \['arr_999999 \(emb/b\)'\]"):
        lio.load_params(path)
    (path / lio.TREE_FILE).write_text(text)
    shutil.rmtree(path / lio.ARRAYS_DIR)
    with pytest.raises(ValueError, match="stored arrays but .*arrays does not exist"):
        lio.load_params(path)
