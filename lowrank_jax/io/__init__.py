"""Save and load parameter trees and models: orbax stores the arrays, ``tree.json`` the rest.

Public API
----------

* :func:`save_params` / :func:`load_params` / :func:`load_state` / :func:`load_metadata`:
  parameter checkpoints (:mod:`lowrank_jax.io.params`);
* :func:`save_model` / :func:`load_model` / :func:`load_model_state`: a parameter checkpoint
  whose metadata holds the model config, plus optional model state (:mod:`lowrank_jax.io.model`);
* :func:`config_to_dict` / :func:`config_from_dict` / :func:`config_classes` /
  :func:`register_config`: configs rebuilt from a registry (:mod:`lowrank_jax.io.configs`);
* :func:`upgrade_attention`: lowrank_jax 0.1 attention blocks to the current layout
  (:mod:`lowrank_jax.io.legacy`);
* :func:`is_checkpoint`, :func:`atomic_directory`: the marker that ``overwrite=True`` respects,
  and atomic directory writes (:mod:`lowrank_jax.io.files`).

Checkpoint format, version 2
----------------------------

A checkpoint is a directory::

    path/
      tree.json   # format tag, version, skeletons, metadata
      arrays/     # an orbax PyTree checkpoint: one entry per non-empty array, arr_000000, ...

``tree.json`` is one JSON object::

    {"format": "lowrank_jax.params",
     "version": 2,
     "tree": NODE,              # the parameter tree
     "state": NODE,             # optional: model state (BatchNorm statistics), or absent
     "train": {...},            # optional: the rest of a train state (see below)
     "metadata": {...}}         # user metadata; a model checkpoint adds "config"

A ``NODE`` is one of::

    {"type": "none"}
    {"type": "dict",  "items": [[KEY, NODE], ...]}       # insertion order; str or int keys
    {"type": "list",  "items": [NODE, ...]}
    {"type": "tuple", "items": [NODE, ...]}
    {"type": "node",  "class": "lowrank_jax.leaves.dense.LowRank",
                      "data": {FIELD: NODE, ...}, "static": {FIELD: STATIC, ...}}
    {"type": "array", "shape": [d0, ...], "dtype": "float32", "kind": "jax",
                      "key": "arr_000000", "sha256": HEX}
    {"type": "namedtuple", "class": "optax...ScaleByAdamState",
                      "items": [[FIELD, NODE], ...]}      # train states only
    {"type": "pytree", "class": "module.QualName", "treedef": "PyTreeDef(...)",
                      "items": [[KEY, NODE], ...]}        # train states only

* ``"node"`` is any class registered with :func:`lowrank_jax.leaves.leaf_dataclass`: weight
  leaves (``Dense``, ``LowRank``, ``HeadLowRank``, ``MaskedBinary``, ``FrozenBinary``, types
  defined outside lowrank_jax), query-key objects (``QueryKey``) and ``HeadLayout``. ``class``
  is the qualified name (``module.QualName``) under which
  :func:`lowrank_jax.leaves.node_types` registers it; on load the class is looked up there
  (or, failing that, a unique registered class with the same ``__name__``), never imported.
  ``data`` holds the child fields, ``static`` the static ones.
* ``STATIC`` is a JSON ``null``, boolean, number or string, ``{"tuple": [STATIC, ...]}`` or
  ``{"list": [STATIC, ...]}`` (tagged so that a tuple comes back as a tuple and treedefs match).
* ``kind`` is ``"jax"`` (restored as a ``jax.Array`` on the default device), ``"numpy"``
  (``numpy.ndarray``) or ``"numpy_scalar"``. Zero-size arrays have no ``key`` and are described
  by the skeleton alone (orbax refuses them). Train states add ``"key"`` (a typed PRNG key
  array, stored as its key data; ``"impl"`` names the key implementation) and ``"bool"`` /
  ``"int"`` / ``"float"`` (Python scalars).
* ``sha256`` is the hex digest of ``"<dtype>:<d0>,<d1>,...:"`` (UTF-8) followed by the array's
  bytes in C order (:func:`lowrank_jax.io.skeleton.array_checksum`). It is verified on load: an
  array whose bytes changed raises :class:`~lowrank_jax.errors.CorruptCheckpointError` naming
  its tree path, ``arrays/`` and ``tree.json``. It is ``null`` only for an array that was split
  over several processes when it was saved.
* ``"namedtuple"`` and ``"pytree"`` nodes hold optimizer states and other pytree node types
  (not leaf types). Without the code that built them a NamedTuple is read back as a
  ``collections.namedtuple`` of the same name and fields; a ``"pytree"`` node is rebuilt only
  by :meth:`lowrank_jax.train.Checkpointer.restore` from a ``like`` tree.

Train states. A step directory of :class:`lowrank_jax.train.Checkpointer` is a checkpoint of
this format: ``tree`` holds the full parameters of the ``TrainState`` (trainable and frozen
parts rejoined), ``state`` its model state, and ``train`` the rest::

    "train": {"layout": "train_state", "step": 7, "data_position": 42, "config": null,
              "frozen": ["bin/w", ...],   # arrays of "tree" held by TrainState.frozen
              "trees": {"step": NODE, "opt_state": NODE, "rng": NODE,
                        "data_position": NODE}}

(``"layout": "tree"`` and no ``trees`` when a whole other tree was saved as ``tree``). So
:func:`load_params` of a step gives the trained parameters, :func:`load_state` the model
state, :func:`lowrank_jax.train.load_train_state` the whole state, and a checkpoint written by
:func:`save_params` starts training: ``fit(loss, path, ...)``. Parameter readers skip
``train``'s arrays.

A damaged checkpoint raises one :class:`~lowrank_jax.errors.CorruptCheckpointError`, one line:
the checkpoint, every array that cannot be read or fails its checksum (tree path and key, such
as ``'enc/w' (arr_000003)``; OCDBT shares its data files among arrays under hashed names, so
arrays are named, not files) and what is wrong with each (``data cut short``, ``its index file
_METADATA is missing``, ...). Its ``arrays`` attribute maps each damaged array's path to that
text. An array file changed in a way that still reads (bytes appended) loads, checked by the
checksums.

A model checkpoint stores ``metadata["config"] = {"__config__": "lowrank_jax.models.t5.T5Config",
"fields": {...}}`` (nested configs encoded the same way), rebuilt from
:func:`config_classes`. A config loaded from a Hugging Face checkpoint holds the checkpoint's
``config.json`` and ``generation_config.json`` in its ``hf_files`` field
(:class:`~lowrank_jax.models.hf.HFConfigFiles`), so they are stored there too and an export
writes them back.

Writes are atomic on a local filesystem: everything is written to a temporary sibling
directory, renamed into place at the end. ``overwrite=True`` replaces only a lowrank_jax
checkpoint (:func:`is_checkpoint`) or an empty directory, never anything else.

Version 1 (lowrank_jax 0.1)
---------------------------

Version 1 files have ``"type": "leaf"`` nodes (``"class"``: short name, ``"qualname"``), no
checksums, no ``state``, attention blocks ``{'q', 'k', 'v', 'o'}`` and configs named
``'module:QualName'``. They still load: :func:`load_model` upgrades the attention blocks to
``{'qk': QueryKey, 'v', 'o', 'heads': HeadLayout}`` from the model family's structure;
:func:`load_params` keeps them (a bare tree has no head count) and warns, and
:func:`upgrade_attention` upgrades them given the number of heads. New files are always written
as version 2.
"""

from lowrank_jax.io.configs import config_classes, config_from_dict, config_to_dict, register_config
from lowrank_jax.io.files import atomic_directory
from lowrank_jax.io.legacy import upgrade_attention
from lowrank_jax.io.model import load_model, load_model_state, save_model
from lowrank_jax.io.params import (
    ARRAYS_DIR,
    FORMAT,
    READABLE_VERSIONS,
    TREE_FILE,
    VERSION,
    Stored,
    is_checkpoint,
    load_metadata,
    load_params,
    load_state,
    read_checkpoint,
    save_params,
)
from lowrank_jax.io.skeleton import array_checksum

__all__ = [
    "ARRAYS_DIR", "FORMAT", "READABLE_VERSIONS", "TREE_FILE", "VERSION", "Stored",
    "array_checksum", "atomic_directory", "config_classes", "config_from_dict", "config_to_dict",
    "is_checkpoint", "load_metadata", "load_model", "load_model_state", "load_params",
    "load_state", "read_checkpoint", "register_config", "save_model", "save_params",
    "upgrade_attention",
]
