"""What train states add to the skeleton: PRNG keys, Python scalars, NamedTuples and other
pytree nodes (``TreeEncoder(extended=True)``), the ``train`` section that parameter readers
skip, structure comparison, and clear errors for malformed entries."""

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import io as lio
from lowrank_jax import leaves as lj
from lowrank_jax.errors import CheckpointError, LeafTypeError
from lowrank_jax.io import files
from lowrank_jax.io.params import write_contents
from lowrank_jax.io.skeleton import (
    TreeEncoder,
    build_tree,
    collect_arrays,
    flat_arrays,
    generic_namedtuple,
    structure_diff,
)


class Moments(NamedTuple):
    count: jax.Array
    mu: dict


def _state_like():
    key = jax.random.key(3)
    return {"opt": (Moments(jnp.asarray(2, jnp.int32), {"w": jnp.arange(4.0)}), ()),
            "rng": jax.random.split(key, 2), "n": 7, "lr": 0.5, "flag": False,
            "leaf": lj.init_lowrank(key, 4, 3, 2)}


def _write(path, params, train_trees, metadata=None):
    """A checkpoint holding ``params`` and a ``train`` section, as the trainer writes it."""
    enc = TreeEncoder("test", extended=True)
    doc = {"format": lio.FORMAT, "version": lio.VERSION, "tree": enc.encode(params),
           "train": {"layout": "tree", "trees": {n: enc.encode(t, n)
                                                 for n, t in train_trees.items()}},
           "metadata": metadata or {}}
    with files.atomic_directory(path, who="test") as tmp:
        write_contents(tmp, json.dumps(doc), enc.arrays)
    return doc


def test_extended_trees_round_trip_without_the_classes(tmp_path):
    tree = _state_like()
    enc = TreeEncoder("test", extended=True)
    spec = enc.encode(tree)
    specs = collect_arrays(json.loads(json.dumps(spec)), "mem")
    assert {p for p, _ in specs.values()} == {
        "opt/0/count", "opt/0/mu/w", "rng", "n", "lr", "flag", "leaf/u", "leaf/v"}
    got = build_tree(spec, enc.arrays, "mem")
    moments = got["opt"][0]
    # the NamedTuple comes back as a namedtuple of the same name and fields, the same class
    # each time it is read
    assert type(moments).__name__ == "Moments" and type(moments)._fields == ("count", "mu")
    assert type(build_tree(spec, enc.arrays, "mem")["opt"][0]) is type(moments)
    assert type(moments) is generic_namedtuple(f"{Moments.__module__}.Moments", ("count", "mu"))
    assert got["opt"][1] == ()
    assert jnp.issubdtype(got["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]),
                                  jax.random.key_data(tree["rng"]))
    assert (type(got["n"]), got["n"], type(got["lr"]), got["lr"]) == (int, 7, float, 0.5)
    assert got["flag"] is False
    np.testing.assert_array_equal(got["opt"][0].mu["w"], np.arange(4.0))
    assert isinstance(got["leaf"], lj.LowRank)
    np.testing.assert_array_equal(got["leaf"].u, tree["leaf"].u)


def test_parameter_readers_skip_the_train_section(tmp_path):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32)}
    _write(tmp_path / "ck", params, {"opt_state": _state_like()["opt"],
                                     "rng": jax.random.key(0)}, {"note": 1})
    got = lio.load_params(tmp_path / "ck")
    assert sorted(got) == ["b", "w"]
    np.testing.assert_array_equal(got["w"], params["w"])
    assert lio.load_metadata(tmp_path / "ck") == {"note": 1}
    assert lio.read_checkpoint(tmp_path / "ck").state is None
    assert lio.is_checkpoint(tmp_path / "ck")
    # the train section's arrays are checked against the files like any other
    tree_file = tmp_path / "ck" / "tree.json"
    doc = json.loads(tree_file.read_text())
    doc["train"]["trees"]["opt_state"]["items"][0]["items"][0][1]["kind"] = "complex"
    tree_file.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"corrupt skeleton.*'<train>/opt_state/0/count'.*"
                                              r"kind"):
        lio.load_params(tmp_path / "ck")
    doc["train"] = ["not", "an", "object"]
    tree_file.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="'train' section that is not an object"):
        lio.load_params(tmp_path / "ck")


def test_save_params_still_refuses_what_only_train_states_hold(tmp_path):
    with pytest.raises(LeafTypeError, match="'k'.*PRNG keys"):
        lio.save_params(tmp_path / "a", {"k": jax.random.key(0)})
    with pytest.raises(LeafTypeError, match="unsupported node at 'm' of type Moments"):
        lio.save_params(tmp_path / "a", {"m": Moments(jnp.ones(1), {})})
    with pytest.raises(LeafTypeError, match="unsupported node at 'n' of type int"):
        lio.save_params(tmp_path / "a", {"n": 3})
    with pytest.raises(LeafTypeError, match="state node 'o' has type object"):
        TreeEncoder("test", extended=True).encode({"o": object()})
    assert not os.path.exists(tmp_path / "a")


def test_structure_diff_names_the_first_difference():
    enc = lambda t: TreeEncoder("t", extended=True, abstract=True).encode(t)  # noqa: E731
    key = jax.random.key(0)
    hl = lj.init_head_lowrank(key, 8, 2, 4, 2)
    base = {"a": [jnp.ones(2), jnp.ones(3)], "h": hl, "m": Moments(jnp.ones(()), {})}
    assert structure_diff(enc(base), enc(base)) is None
    # a shape is not structure: arrays are the caller's to compare
    assert structure_diff(enc(base), enc(dict(base, a=[jnp.ones(5), jnp.ones(3)]))) is None
    other_ranks = lj.HeadLowRank(hl.u, hl.v, hl.b, (2, 1))
    assert structure_diff(enc(base), enc(dict(base, h=other_ranks))) == (
        f"at 'h': HeadLowRank static field ranks {hl.ranks!r} vs (2, 1)")
    assert structure_diff(enc(base), enc(dict(base, a=(jnp.ones(2), jnp.ones(3))))) == (
        "at 'a': list vs tuple")
    assert structure_diff(enc(base), enc(dict(base, a=[jnp.ones(2)]))) == (
        "at 'a': a list of 2 vs 1 items")
    assert structure_diff(enc(base), enc({**base, "z": None})).startswith(
        "at the root: dict with keys")
    # a NamedTuple is not a tuple
    assert structure_diff(enc(base), enc(dict(base, m=(jnp.ones(()), {})))) == (
        f"at 'm': NamedTuple {Moments.__module__}.{Moments.__qualname__} vs tuple")
    # the stored arrays' keys and checksums do not matter
    stored = TreeEncoder("t", extended=True).encode(base)
    assert structure_diff(stored, enc(base)) is None
    assert [p for p, _ in flat_arrays(stored)] == ["a/0", "a/1", "h/u", "h/v", "m/count"]


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["items"][0][1].update(items=[["not an identifier", {"type": "none"}]]),
     "identifiers as the field names"),
    (lambda s: s["items"][0][1].pop("class"), "a 'class' name for a namedtuple"),
    (lambda s: s["items"][1][1].pop("impl"), "an 'impl' name for a PRNG key array"),
    (lambda s: s["items"][2][1].update(shape=[2]), "the shape \\[\\] of a Python int"),
    (lambda s: s.update(type="bag"), "a node type in none/dict/list/tuple/namedtuple/pytree"),
])
def test_malformed_extended_entries_are_named(edit, message):
    spec = TreeEncoder("t", extended=True).encode(
        {"m": Moments(jnp.ones(()), {}), "k": jax.random.key(0), "n": 3})
    spec = json.loads(json.dumps(spec))
    edit(spec)
    with pytest.raises(CheckpointError, match=f"corrupt skeleton.*{message}"):
        collect_arrays(spec, "tree.json")
