"""save_params / load_params: exact round trips of every node type, checksums, atomic and safe
writes, and clear errors."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import io as lio
from lowrank_jax import leaves as lj
from lowrank_jax.errors import CheckpointError, LeafTypeError, MissingFileError, OutputExistsError
from lowrank_jax.io import files
from lowrank_jax.nn import AttentionConfig, apply_attention


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

    @property
    def bias(self):
        return None

    def with_bias(self, b):
        raise NotImplementedError

    def keep_inputs(self, idx):
        return _Scaled(parts=tuple(p[idx] for p in self.parts), tags=self.tags, gains=self.gains)

    def keep_outputs(self, idx):
        return _Scaled(parts=tuple(p[:, idx] for p in self.parts), tags=self.tags,
                       gains=self.gains)

    def logical_axes(self):
        return {"parts": (("in", "out"), ("in", "out"))}


_Scaled = lj.leaf_dataclass(_Scaled, meta=("tags", "gains"))

SCALE = 1.0 / math.sqrt(3.0)


def _f32(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _params():
    # Built from NumPy draws: no JAX computation (each new eager op compiles, which is slow).
    rng = np.random.default_rng(0)
    special = jnp.array([[0.0, -0.0, jnp.inf], [-jnp.inf, jnp.nan, 1e-45]], jnp.float32)
    layers = [
        {
            "attn": {
                "q": lj.HeadLowRank(u=_f32(rng, 6, 2, 2), v=_f32(rng, 2, 2, 3)),  # ranks=None
                "k": lj.HeadLowRank(u=_f32(rng, 6, 2, 3), v=_f32(rng, 2, 3, 3),
                                    b=jnp.arange(6.0), ranks=(1, 3)),
                "o": lj.LowRank(u=_f32(rng, 6, 2), v=_f32(rng, 2, 6)),  # b=None
            },
            "mlp": {
                "wi": lj.MaskedBinary(w=_f32(rng, 6, 8), s=_f32(rng, 6, 8), b=jnp.zeros(8),
                                      keep=0.37),
                "wo": lj.Dense(w=_f32(rng, 8, 6)),  # b=None
            },
            "norm": {"scale": jnp.ones((6,), jnp.bfloat16)},
        }
        for _ in range(2)
    ]
    # A current attention block: QueryKey with irregular widths, a frozen binary value
    # projection, and a HeadLayout that kept heads 0, 2, 3 of four.
    signs = rng.integers(-1, 2, (6, 5)).astype(np.int8)
    block = {
        "qk": lj.QueryKey(q=lj.Dense(w=_f32(rng, 6, 6), b=_f32(rng, 6)),
                          k=lj.LowRank(u=_f32(rng, 6, 2), v=_f32(rng, 2, 6)), widths=(3, 1, 2)),
        "v": lj.FrozenBinary(signs=jnp.asarray(signs), alpha=jnp.asarray(np.float32(0.3)),
                             b=_f32(rng, 5)),
        "o": lj.Dense(w=_f32(rng, 5, 6)),
        "heads": lj.HeadLayout(ids=(0, 2, 3), v=(2, 1, 2), scale=SCALE),
    }
    return {
        "layers": layers,
        "block": block,
        "emb": lj.Dense(w=special, b=jnp.zeros((3,))),
        "lr_bias": lj.LowRank(u=_f32(rng, 4, 3), v=_f32(rng, 3, 5), b=_f32(rng, 5)),
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
    x = _f32(np.random.default_rng(1), 3, 6)
    run = jax.jit(lambda attn: [lj.linear(attn[n], x) for n in ("q", "k", "o")])
    np.testing.assert_array_equal(run(params["layers"][0]["attn"]), run(loaded["layers"][0]["attn"]))
    assert lj.flops(loaded, 10) == lj.flops(params, 10)
    assert lj.storage_bits(loaded) == lj.storage_bits(params)


def test_every_node_type_round_trips(saved):
    path, params = saved
    loaded = lio.load_params(path)
    kinds = {type(n) for n in jax.tree_util.tree_leaves(
        loaded, is_leaf=lambda n: type(n) in lj.node_types().values())}
    assert {lj.Dense, lj.LowRank, lj.HeadLowRank, lj.MaskedBinary, lj.FrozenBinary, lj.QueryKey,
            lj.HeadLayout, _Scaled} <= kinds
    block = loaded["block"]
    assert block["qk"].widths == (3, 1, 2) and type(block["qk"].widths) is tuple
    assert block["heads"].ids == (0, 2, 3) and block["heads"].v == (2, 1, 2)
    assert block["heads"].scale == SCALE  # the float comes back exactly
    assert block["v"].signs.dtype == jnp.int8 and block["v"].alpha.shape == ()
    # The upgraded-layout block runs and gives bit-identical outputs.
    x = _f32(np.random.default_rng(2), 1, 4, 6)
    run = jax.jit(lambda p: apply_attention(p, x, AttentionConfig(scaled=True)))
    np.testing.assert_array_equal(run(params["block"]), run(block))


def test_external_leaf_type_is_stored_by_qualified_name(saved):
    path, _ = saved
    doc = json.loads((path / lio.TREE_FILE).read_text())
    assert _node(doc, "custom")["class"] == lj.qualified_name(_Scaled)
    assert _node(doc, "block", "heads")["class"] == "lowrank_jax.leaves.heads.HeadLayout"
    assert _node(doc, "block", "heads")["data"] == {}


def test_metadata(saved):
    path, _ = saved
    assert lio.load_metadata(path) == {"step": 12, "note": "t5-small", "eps": [0.1]}


def test_format_version_and_zero_size_arrays(saved):
    path, _ = saved
    doc = json.loads((path / lio.TREE_FILE).read_text())
    assert doc["format"] == "lowrank_jax.params" and doc["version"] == lio.VERSION == 2
    empty = _node(doc, "extra", 5)
    assert empty["shape"] == [0, 4] and "key" not in empty and "sha256" not in empty


def test_checksums_match_an_independent_sha256(saved):
    path, params = saved
    doc = json.loads((path / lio.TREE_FILE).read_text())
    w = np.asarray(params["emb"].w)  # float32 [2, 3] with inf, nan, -0.0 and a denormal
    want = hashlib.sha256(b"float32:2,3:" + w.tobytes(order="C")).hexdigest()
    assert _node(doc, "emb", "w")["sha256"] == want
    u = np.asarray(params["layers"][1]["attn"]["k"].u)
    assert _node(doc, "layers", 1, "attn", "k", "u")["sha256"] == hashlib.sha256(
        b"float32:6,2,3:" + u.tobytes()).hexdigest()
    s = np.asarray(params["extra"][4])  # a numpy scalar: shape ()
    assert _node(doc, "extra", 4)["sha256"] == hashlib.sha256(b"float32::" + s.tobytes()).hexdigest()


def test_tree_without_arrays_and_single_leaf(tmp_path):
    lio.save_params(tmp_path / "none", {"a": None, "b": [None, ()]})
    assert lio.load_params(tmp_path / "none") == {"a": None, "b": [None, ()]}
    assert not os.path.exists(tmp_path / "none" / lio.ARRAYS_DIR)
    assert lio.load_metadata(tmp_path / "none") == {}
    leaf = lj.LowRank(u=_f32(np.random.default_rng(3), 5, 2), v=_f32(np.random.default_rng(4), 2, 4))
    lio.save_params(tmp_path / "leaf", leaf)
    _assert_identical(leaf, lio.load_params(tmp_path / "leaf"))


def test_state_is_stored_beside_the_parameters(tmp_path):
    params = {"w": lj.Dense(w=jnp.ones((3, 4)), b=jnp.zeros(4))}
    state = {"bn": [{"mean": np.arange(4, dtype=np.float32), "var": jnp.full((4,), 2.0)}]}
    lio.save_params(tmp_path / "ck", params, state=state)
    _assert_identical(lio.load_params(tmp_path / "ck"), params)
    _assert_identical(lio.load_state(tmp_path / "ck"), state)
    lio.save_params(tmp_path / "plain", params)
    assert lio.load_state(tmp_path / "plain") is None
    # Loading the parameters does not read the state's arrays: a damaged state only fails
    # when the state is loaded, and the error names the state's path.
    _edit_tree(tmp_path / "ck", lambda d: _node(d, "bn", 0, "var", root="state").update(
        sha256="0" * 64))
    _assert_identical(lio.load_params(tmp_path / "ck"), params)
    with pytest.raises(CheckpointError, match=r"'<state>/bn/0/var'.*sha256"):
        lio.load_state(tmp_path / "ck")


def test_refuses_overwrite_then_replaces(tmp_path):
    path = tmp_path / "ck"
    path.mkdir()  # an existing empty directory is fine
    lio.save_params(path, {"w": jnp.ones((2,))})
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        lio.save_params(path, {"w": jnp.zeros((3,))})
    np.testing.assert_array_equal(lio.load_params(path)["w"], np.ones((2,)))
    lio.save_params(path, {"v": jnp.zeros((3,))}, overwrite=True)
    _assert_identical(lio.load_params(path), {"v": jnp.zeros((3,))})
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary or backup directory left


def test_overwrite_never_replaces_what_it_did_not_write(tmp_path):
    """overwrite=True replaces a checkpoint, never a directory or file of someone else's."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="refusing to replace .*data.*did not write"):
        lio.save_params(data, {"w": jnp.ones(2)}, overwrite=True)
    assert (data / "notes.txt").read_text() == "keep me" and os.listdir(data) == ["notes.txt"]
    # A checkpoint with a foreign file added is no longer only ours.
    lio.save_params(tmp_path / "ck", {"w": jnp.ones(2)})
    (tmp_path / "ck" / "results.csv").write_text("1,2")
    with pytest.raises(OutputExistsError, match="did not write"):
        lio.save_params(tmp_path / "ck", {"w": jnp.zeros(2)}, overwrite=True)
    assert (tmp_path / "ck" / "results.csv").exists()
    # Another program's tree.json is not ours either; a plain file is refused too.
    other = tmp_path / "other"
    other.mkdir()
    (other / lio.TREE_FILE).write_text(json.dumps({"format": "someone-else"}))
    (tmp_path / "file").write_text("x")
    for target in (other, tmp_path / "file"):
        with pytest.raises(OutputExistsError, match="refusing to replace"):
            lio.save_params(target, {"w": jnp.ones(2)}, overwrite=True)
    assert (tmp_path / "file").read_text() == "x"
    assert lio.is_checkpoint(tmp_path / "ck") is False and lio.is_checkpoint(other) is False
    # A checkpoint whose tree.json is damaged may still be overwritten.
    lio.save_params(tmp_path / "dmg", {"w": jnp.ones(2)})
    (tmp_path / "dmg" / lio.TREE_FILE).write_text("{not json")
    assert lio.is_checkpoint(tmp_path / "dmg")
    lio.save_params(tmp_path / "dmg", {"w": jnp.zeros(2)}, overwrite=True)
    np.testing.assert_array_equal(lio.load_params(tmp_path / "dmg")["w"], np.zeros(2))


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_saves_are_cleaned(tmp_path):
    target = tmp_path / "ck"
    dead = _dead_pid()
    stale = files.temp_path(target, "tmp", pid=dead)
    live = files.temp_path(target, "tmp")  # this process: a save in progress, left alone
    for d in (stale, live):
        os.makedirs(d)
        open(os.path.join(d, "partial"), "w").close()
    lio.save_params(target, {"w": jnp.ones(2)})
    assert not os.path.exists(stale) and os.path.exists(live)
    shutil.rmtree(live)
    # A replacement killed between its two renames left the old checkpoint aside and no
    # target: the next save to that path puts it back instead of deleting it.
    os.rename(target, files.temp_path(target, "old", pid=dead))
    with pytest.raises(OutputExistsError):
        lio.save_params(target, {"w": jnp.zeros(2)})
    np.testing.assert_array_equal(lio.load_params(target)["w"], np.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    # A node that cannot be saved fails before anything is written.
    with pytest.raises(LeafTypeError, match="'a/1'.*set"):
        lio.save_params(tmp_path / "bad", {"a": [jnp.ones(2), {1, 2}]})
    with pytest.raises(LeafTypeError, match="metadata"):
        lio.save_params(tmp_path / "bad", {"a": jnp.ones(2)}, metadata={"f": object()})
    with pytest.raises(LeafTypeError, match="'k'.*PRNG keys"):
        lio.save_params(tmp_path / "bad", {"k": jax.random.key(0)})
    assert os.listdir(tmp_path) == []

    # A failure after orbax wrote the arrays: neither the target nor the temp dir survive, and an
    # existing checkpoint being overwritten is untouched.
    def boom(file, text):
        raise OSError("disk full")

    lio.save_params(tmp_path / "old", {"w": jnp.ones((2,))})
    monkeypatch.setattr(files, "write_text", boom)
    with pytest.raises(OSError, match="disk full"):
        lio.save_params(tmp_path / "new", {"w": jnp.ones((2,))})
    with pytest.raises(OSError, match="disk full"):
        lio.save_params(tmp_path / "old", {"w": jnp.zeros((5,))}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["old"]
    monkeypatch.undo()
    np.testing.assert_array_equal(lio.load_params(tmp_path / "old")["w"], np.ones((2,)))


# ---------------------------------------------------------------------------------------------
# Checksums: flipped bytes in an array file are caught, naming the array and the files.

def test_flipped_bytes_in_an_array_file_are_detected(tmp_path):
    import orbax.checkpoint as ocp

    # Random bits do not compress, so orbax stores them verbatim in a data file (small or
    # compressible arrays are compressed or inlined in checksummed b-tree nodes).
    bits = np.random.default_rng(0).integers(0, 2**32, (64, 64), dtype=np.uint32)
    w = jnp.asarray(bits.view(np.float32))
    path = tmp_path / "ck"
    lio.save_params(path, {"small": jnp.ones(3), "big": lj.Dense(w=w)})
    raw = np.asarray(w).tobytes()
    needle = raw[8192:8224]
    hits = []
    for root, _, names in os.walk(path / lio.ARRAYS_DIR):
        for name in names:
            data = (open(os.path.join(root, name), "rb")).read()
            if needle in data:
                hits.append((os.path.join(root, name), data.index(needle)))
    assert hits, "the array's bytes were not found verbatim in any file orbax wrote"
    for file, i in hits:
        data = bytearray(open(file, "rb").read())
        data[i + 5] ^= 0x40
        open(file, "wb").write(bytes(data))

    # The flip changes exactly one value of what orbax itself reads back ...
    ckptr, arrays_dir = ocp.PyTreeCheckpointer(), str(path / lio.ARRAYS_DIR)
    keys = ckptr.metadata(arrays_dir).item_metadata.tree
    stored = ckptr.restore(arrays_dir, args=ocp.args.PyTreeRestore(
        restore_args={k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys}))
    changed = [k for k, v in stored.items()
               if v.shape == w.shape and np.asarray(v).tobytes() != raw]
    assert len(changed) == 1
    diff = np.asarray(stored[changed[0]]).view(np.uint32) != bits
    assert diff.sum() == 1
    # ... and of what load_params returns without verification,
    unverified = lio.load_params(path, verify=False)
    assert (np.asarray(unverified["big"].w).view(np.uint32) != bits).sum() == 1
    # while the default load refuses it, naming the array's path and the files.
    with pytest.raises(CheckpointError, match=r"array 'big/w' \(arr_\d+ in .*arrays\) is "
                                              r"corrupt.*sha256.*tree\.json"):
        lio.load_params(path)


def test_edited_checksum_is_detected(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "emb", "w").update(sha256="0" * 64))
    with pytest.raises(CheckpointError, match=r"'emb/w'.*corrupt.*expected 0000000000000000"):
        lio.load_params(path)
    _edit_tree(path, lambda d: _node(d, "emb", "w").update(sha256="not-a-digest"))
    with pytest.raises(CheckpointError, match="corrupt skeleton.*'emb/w'.*sha256"):
        lio.load_params(path)
    _edit_tree(path, lambda d: _node(d, "emb", "w").pop("sha256"))
    with pytest.raises(CheckpointError, match="corrupt skeleton.*'emb/w'.*sha256"):
        lio.load_params(path)


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


def _node(doc, *keys, root="tree"):
    node = doc[root]
    for k in keys:
        if node["type"] == "dict":
            node = dict((kk, v) for kk, v in node["items"])[k]
        elif node["type"] == "node":
            node = node["data"][k]
        else:
            node = node["items"][k]
    return node


def test_missing_path(tmp_path):
    with pytest.raises(MissingFileError, match="nowhere.*does not exist"):
        lio.load_params(tmp_path / "nowhere")


def test_path_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        lio.load_params(tmp_path / "f")


def test_dir_without_tree_json(saved, tmp_path):
    path = _copy(saved, tmp_path)
    os.remove(path / lio.TREE_FILE)
    with pytest.raises(MissingFileError, match=r"tree\.json not found.*\['arrays'\]"):
        lio.load_params(path)
    with pytest.raises(FileNotFoundError):
        lio.load_metadata(path)


def test_corrupt_tree_json(saved, tmp_path):
    path = _copy(saved, tmp_path)
    file = path / lio.TREE_FILE
    text = file.read_text()
    file.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"tree\.json is not valid JSON"):
        lio.load_params(path)
    file.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError,
                       match="expected format 'lowrank_jax.params', found 'something"):
        lio.load_params(path)
    file.write_text(text)
    _edit_tree(path, lambda d: _node(d, "layers", 1, "mlp").update(type="set"))
    with pytest.raises(CheckpointError, match="corrupt skeleton.*'layers/1/mlp'.*found 'set'"):
        lio.load_params(path)
    file.write_text(text)
    _edit_tree(path, lambda d: _node(d, "emb", "w").update(shape=[2, -3]))
    with pytest.raises(CheckpointError, match="'emb/w'.*non-negative ints"):
        lio.load_params(path)


def test_unknown_format_version(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: d.update(version=3))
    with pytest.raises(CheckpointError, match=r"format version 3.*reads versions \[1, 2\].*newer"):
        lio.load_params(path)


def test_unknown_leaf_type(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "layers", 0, "attn", "o").update(
        {"class": "elsewhere.Tucker"}))
    with pytest.raises(CheckpointError,
                       match="unknown leaf type 'Tucker'.*'layers/0/attn/o'.*LowRank"):
        lio.load_params(path)


def test_node_fields_must_match_the_class(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "block", "qk")["static"].pop("widths"))
    with pytest.raises(CheckpointError, match="node QueryKey at 'block/qk'.*widths"):
        lio.load_params(path)


def test_invalid_static_field(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "layers", 0, "mlp", "wi")["static"].update(keep=2.0))
    with pytest.raises(CheckpointError,
                       match="cannot rebuild MaskedBinary at 'layers/0/mlp/wi'.*keep"):
        lio.load_params(path)
    shutil.rmtree(path)
    path = _copy(saved, tmp_path)
    _edit_tree(path, lambda d: _node(d, "block", "qk")["static"].update(
        widths={"tuple": [3, 1, 3]}))
    with pytest.raises(CheckpointError, match="cannot rebuild QueryKey at 'block/qk'.*sum to 7"):
        lio.load_params(path)


def test_arrays_do_not_match_skeleton(saved, tmp_path):
    path = _copy(saved, tmp_path)
    text = (path / lio.TREE_FILE).read_text()
    _edit_tree(path, lambda d: _node(d, "layers", 1, "attn", "k", "u").update(shape=[6, 2, 4]))
    with pytest.raises(CheckpointError, match=r"'layers/1/attn/k/u'.*expected float32\[6, 2, 4\], "
                                              r"found float32\[6, 2, 3\]"):
        lio.load_params(path)
    (path / lio.TREE_FILE).write_text(text)
    _edit_tree(path, lambda d: _node(d, "emb", "b").update(dtype="int32"))
    with pytest.raises(CheckpointError, match=r"'emb/b'.*expected int32\[3\], found float32\[3\]"):
        lio.load_params(path)
    (path / lio.TREE_FILE).write_text(text)
    _edit_tree(path, lambda d: _node(d, "emb", "b").update(key="arr_999999"))
    with pytest.raises(CheckpointError, match=r"missing \['arr_999999 \(emb/b\)'\]"):
        lio.load_params(path)
    (path / lio.TREE_FILE).write_text(text)
    shutil.rmtree(path / lio.ARRAYS_DIR)
    with pytest.raises(CheckpointError, match="stored arrays but .*arrays does not exist"):
        lio.load_params(path)


def test_extra_files_are_copied_verbatim_in_the_same_write(tmp_path):
    from lowrank_jax.errors import ConfigError

    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b'{"model": "x", "bytes": "\\u00e9"}\n')
    params = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    lio.save_params(tmp_path / "ck", params, extra_files={"tokenizer.json": tok})
    assert (tmp_path / "ck" / "tokenizer.json").read_bytes() == tok.read_bytes()
    np.testing.assert_array_equal(np.asarray(lio.load_params(tmp_path / "ck")["w"]), params["w"])
    # the checkpoint's own names, paths and missing sources are refused before anything is written
    for extra, err, where in [({"tree.json": tok}, ConfigError, "files/tree.json"),
                              ({"arrays": tok}, ConfigError, "files/arrays"),
                              ({"sub/tokenizer.json": tok}, ConfigError, "files/sub/tokenizer.json"),
                              ({"vocab.json": tmp_path / "none"}, MissingFileError, "files/vocab.json")]:
        with pytest.raises(err) as e:
            lio.save_params(tmp_path / "bad", params, extra_files=extra)
        assert e.value.where == where
        assert not (tmp_path / "bad").exists()
        assert sorted(os.listdir(tmp_path)) == ["ck", "tokenizer.json"]
