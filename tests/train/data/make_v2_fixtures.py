"""Write the fixtures of tests/train in the train-state format of lowrank_jax 0.2's first
checkpointer: orbax ``CheckpointManager`` step directories ``<step>/state`` (arrays) and
``<step>/meta`` (JSON: paths, shapes, dtypes, CRC32 checksums, treedef), format
``lowrank_jax.train_state`` version 2.

This script needs the code that writes that format on ``PYTHONPATH`` (the commit before
``train.Checkpointer`` moved to the ``lowrank_jax.io`` format)::

    git worktree add /tmp/lowrank_jax-crc32 f3f244c
    cd /tmp/lowrank_jax-crc32 && PYTHONPATH=$PWD python3 \
        /path/to/repo/tests/train/data/make_v2_fixtures.py /path/to/repo/tests/train/data

It writes, under ``OUT``:

* ``train_state_v2/``: steps 1 and 2 of a ``TrainState`` (``LowRank``, ``HeadLowRank``,
  ``MaskedBinary``, ``Dense`` without bias, a plain array; Adam; a typed PRNG key), each after
  real updates (the Adam moments are not zero);
* ``train_state_v2_stateful/``: step 3 of a ``TrainState`` with model state (BatchNorm-like
  statistics) and the default optimizer (injected hyperparameters, masked weight decay), saved
  with metadata and a config;
* ``tree_v2/``: step 3 of a plain tree (NumPy arrays, a NumPy scalar, a Python int, an empty
  array, ``None``, typed and raw PRNG keys);
* ``train_state_v2_expected.npz``: every array of these, under ``<fixture>/<step>/<path>``
  (PRNG keys as their key data), as the writing run held them.

The tests build the structures (``like=``) with the same initializers, and compare the values
restored by the current code with the ``.npz``.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.leaves import (
    combine,
    init_dense,
    init_head_lowrank,
    init_lowrank,
    init_masked_binary,
    linear,
    path_str,
)
from lowrank_jax.train import Checkpointer, default_optimizer, init_train_state


def params(key):
    """The parameters of ``train_state_v2``: one leaf of each kind, small."""
    k = jax.random.split(key, 4)
    return {"inp": init_lowrank(k[0], 6, 4, 2, bias=True),
            "heads": init_head_lowrank(k[1], 4, 2, 2, 2),
            "bin": init_masked_binary(k[2], 4, 4, 0.5), "out": init_dense(k[3], 4, 3),
            "scale": jnp.ones((4,))}


def _loss(p, x):
    h = jnp.tanh(linear(p["inp"], x))
    h = h + linear(p["bin"], h) * p["scale"] + linear(p["heads"], h)
    return jnp.mean(linear(p["out"], h) ** 2)


def _update(state, optimizer, model_state_update=None):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(9), state.step), (5, 6))
    grads = jax.grad(lambda p: _loss(combine(p, state.frozen), x))(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    state = state._replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                           opt_state=opt_state, data_position=state.data_position + 5)
    if model_state_update is not None:
        state = state._replace(model_state=model_state_update(state.model_state))
    return state


def model_state():
    """The model state of ``train_state_v2_stateful`` at initialization."""
    return {"bn": {"mean": jnp.zeros((4,)), "var": jnp.ones((4,))},
            "count": jnp.asarray(0, jnp.int32)}


def _bump(ms):
    return {"bn": {"mean": ms["bn"]["mean"] + 0.25, "var": ms["bn"]["var"] * 1.5},
            "count": ms["count"] + 1}


def plain_tree():
    """The tree of ``tree_v2``."""
    return {"np": np.arange(6, dtype=np.int16).reshape(2, 3), "npscalar": np.float32(2.5),
            "py": 3, "empty": jnp.zeros((0, 4)), "none": None,
            "keys": jax.random.split(jax.random.key(1), 3), "old_key": jax.random.PRNGKey(5)}


def _dump(out: dict, prefix: str, tree) -> None:
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.issubdtype(getattr(x, "dtype", np.int64), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[f"{prefix}/{path_str(p) or '<root>'}"] = np.asarray(x)


def main(root: str) -> None:
    expected = {}
    opt = optax.adam(1e-2)
    state = init_train_state(params(jax.random.key(0)), opt, key=jax.random.key(1))
    ck = Checkpointer(os.path.join(root, "train_state_v2"), max_to_keep=None)
    for step in (1, 2):
        state = _update(state, opt)
        ck.save(state)
        _dump(expected, f"train_state_v2/{step}", state)
    ck.close()

    opt = default_optimizer(learning_rate=1e-2, total_steps=10, warmup_steps=1)
    state = init_train_state(params(jax.random.key(2)), opt, key=jax.random.key(3),
                             model_state=model_state())
    for _ in range(3):
        state = _update(state, opt, _bump)
    ck = Checkpointer(os.path.join(root, "train_state_v2_stateful"))
    ck.save(state, metadata={"written_by": "the CRC32 train-state format (version 2)"},
            config={"lr": 0.01, "steps": 10})
    ck.close()
    _dump(expected, "train_state_v2_stateful/3", state)

    ck = Checkpointer(os.path.join(root, "tree_v2"))
    ck.save(plain_tree(), step=3)
    ck.close()
    _dump(expected, "tree_v2/3", plain_tree())
    np.savez(os.path.join(root, "train_state_v2_expected.npz"), **expected)


if __name__ == "__main__":
    main(sys.argv[1])
