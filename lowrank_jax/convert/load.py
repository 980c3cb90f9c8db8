"""Hugging Face checkpoints -> lowrank_jax ``(config, params)``, for every registered family.

The family is recognised from ``config.json`` by the ``detect`` of every registered family's
:class:`~lowrank_jax.models.hf.HFSpec` (exactly one must accept it); its config is translated
by the spec, and its key table says where each tensor goes. The tree's structure (leaf types,
query-key objects, head layouts) is the one the family's ``init`` builds for that config,
obtained with ``jax.eval_shape`` (nothing is computed) and filled with the checkpoint's arrays,
so this module has no family-specific code. Checking is strict: every missing, unexpected and
mis-shaped key is reported at once in a :class:`~lowrank_jax.errors.CheckpointError`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.convert.files import (
    CONFIG_NAME,
    config_dict,
    file_dict,
    hf_model,
    read_config,
    read_generation_config,
    read_weights,
    to_numpy,
)
from lowrank_jax.errors import CheckpointError, ConfigError, MissingFileError
from lowrank_jax.leaves import Dense, get_path, replace_paths
from lowrank_jax.models import ModelFamily, families, family_of
from lowrank_jax.models.hf import HFConfigFiles, HFSpec, with_hf_files


def hf_families() -> dict[str, ModelFamily]:
    """The registered families that have a Hugging Face mapping, by name."""
    return {name: fam for name, fam in families().items() if fam.hf is not None}


def detect_family(hf_config: dict) -> str:
    """The name of the one registered family whose ``hf.detect`` accepts ``hf_config``.

    Args:
      hf_config: a parsed ``config.json``.

    Returns:
      The family name (``'t5'``, ``'chronos'``, ``'chronos_bolt'``, ``'vit'``, ``'bert'``, ...).

    Raises:
      ConfigError: no family, or several, accept it.
    """
    hits = [name for name, fam in hf_families().items() if fam.hf.detect(hf_config)]
    if len(hits) == 1:
        return hits[0]
    what = (f"model_type={hf_config.get('model_type')!r}, "
            f"architectures={hf_config.get('architectures')!r}")
    if not hits:
        raise ConfigError(
            f"load_pretrained: unknown model family ({what}); families with a Hugging Face "
            f"mapping: {sorted(hf_families())}. Pass family=... if the config is unusual.",
            where="config.json", expected=sorted(hf_families()), actual=what)
    raise ConfigError(f"load_pretrained: several families match ({what}): {hits}; pass family=",
                      where="config.json", expected="one family", actual=hits)


def hf_spec(family: ModelFamily) -> HFSpec:
    """The family's :class:`HFSpec`, or a :class:`ConfigError` if it has none."""
    if family.hf is None:
        raise ConfigError(f"model family {family.name!r} has no Hugging Face mapping "
                          f"(ModelFamily.hf is None); families with one: {sorted(hf_families())}",
                          where="family", expected=sorted(hf_families()), actual=family.name)
    return family.hf


def _get_family(name: str) -> ModelFamily:
    known = hf_families()
    if name not in known:
        raise ConfigError(f"load_pretrained: unknown family {name!r}; families with a Hugging "
                          f"Face mapping: {sorted(known)}", where="family",
                          expected=sorted(known), actual=name)
    return known[name]


def _table_key(spec: HFSpec, key: str, known) -> str:
    """The table's name of a checkpoint key: renamed, then with a base-model prefix removed
    if only that makes it known."""
    key = spec.rename(key)
    if key in known:
        return key
    for prefix in spec.base_prefixes:
        if key.startswith(prefix) and key[len(prefix):] in known:
            return key[len(prefix):]
    return key


def params_from_state_dict(config: Any, state: Mapping[str, Any], *,
                           source: str = "<state dict>") -> Any:
    """The lowrank_jax parameter tree of ``config`` from a Hugging Face state dict.

    Linear weights are transposed once, PyTorch ``[out, in...]`` -> ``[prod(in...), out]``,
    into :class:`~lowrank_jax.Dense` leaves; the rest of the tree (query-key objects, head
    layouts, leaf types) is what ``family.init(key, config)`` builds.

    Args:
      config: a config of a family with a Hugging Face mapping.
      state: ``{key: array or torch tensor}`` (any spelling the family's spec accepts).
      source: named in errors (a file path, ``'<state dict>'``, ...).

    Returns:
      The parameter tree (float32).

    Raises:
      CheckpointError: listing every missing, unexpected and mis-shaped key, with expected and
        actual shapes.
    """
    family = family_of(config)
    spec = hf_spec(family)
    state = spec.from_checkpoint(state)
    rows = spec.key_table(config)
    table = {r.key: r for r in rows if r.key is not None}
    optional = {k: (None if s is None else tuple(s)) for k, s in spec.optional(config).items()}
    known = set(table) | set(optional)
    found: dict[str, np.ndarray] = {}
    unexpected, mismatched = {}, {}
    for ck, value in state.items():
        key = _table_key(spec, ck, known)
        shape = tuple(int(d) for d in np.shape(value))
        if key in table and key not in found:
            found[key] = value
            if shape != table[key].shape:
                mismatched[ck] = (table[key].shape, shape)
        elif key in optional and key not in table:
            if optional[key] is not None and shape != optional[key]:
                mismatched[ck] = (optional[key], shape)
        else:  # unknown, or a second spelling of a key already read
            unexpected[ck] = shape
    missing = {k: r.shape for k, r in table.items() if k not in found}
    if missing or unexpected or mismatched:
        raise CheckpointError(source, missing=missing, unexpected=unexpected,
                              mismatched=mismatched, note=f"({family.name} config: {config!r})")

    structure = jax.eval_shape(lambda: family.init(jax.random.PRNGKey(0), config))
    weights: dict[str, dict] = {}
    new: dict[str, Any] = {}
    for r in rows:
        if r.kind == "zero":
            weights.setdefault(r.path, {})["b"] = jnp.zeros(r.shape, jnp.float32)
            continue
        a = np.asarray(to_numpy(found[r.key]), dtype=np.float32)
        if r.kind == "linear":  # [out, in...] -> [prod(in...), out], once
            weights.setdefault(r.path, {})["w"] = jnp.asarray(a.reshape(a.shape[0], -1).T)
        elif r.kind == "bias":
            weights.setdefault(r.path, {})["b"] = jnp.asarray(a)
        else:
            new[r.path] = jnp.asarray(a.reshape(np.shape(get_path(structure, r.path))))
    for path, parts in weights.items():
        new[path] = Dense(w=parts["w"], b=parts.get("b"))
    params = replace_paths(structure, new)
    _check_structure(family, structure, params)
    return params


def _check_structure(family: ModelFamily, structure, params) -> None:
    """The filled tree must be exactly the tree ``init`` builds: a key table that misses an
    array, or places one at another shape, is a bug of the family's table."""
    want = jax.tree_util.tree_flatten_with_path(structure)[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    bad = [jax.tree_util.keystr(p) for p, a in got if isinstance(a, jax.ShapeDtypeStruct)]
    if not bad and jax.tree_util.tree_structure(structure) == jax.tree_util.tree_structure(params):
        bad = [jax.tree_util.keystr(p) for (p, a), (_, b) in zip(want, got, strict=True)
               if tuple(a.shape) != tuple(np.shape(b))]
    elif not bad:
        bad = ["(tree structure differs from init's)"]
    if bad:
        raise CheckpointError(
            f"<key table of family {family.name!r}>",
            message=f"the Hugging Face key table of family {family.name!r} does not fill the "
                    f"tree its init builds (a bug of the table); wrong or unfilled: {bad}")


def load_pretrained(source, *, family: str | None = None, config=None):
    """``(config, params)`` from a Hugging Face checkpoint, without network access.

    Args:
      source: a local directory (``config.json`` plus ``model.safetensors``, a sharded
        ``model.safetensors.index.json`` or ``pytorch_model.bin``); a ``transformers`` model
        or a chronos-forecasting pipeline; or a state dict ``{key: tensor or array}`` (then
        ``config`` is required).
      family: the family's name (:func:`lowrank_jax.models.families`) instead of detecting it
        from ``config.json``.
      config: the Hugging Face config (dict, path or ``PretrainedConfig``) for a state dict;
        replaces the module's or directory's config otherwise.

    Returns:
      The family's config dataclass and parameter tree (``Dense`` leaves, ``[d_in, d_out]``).
      The config carries the source's ``config.json`` and ``generation_config.json`` verbatim
      in its ``hf_files`` field (:class:`~lowrank_jax.models.hf.HFConfigFiles`; a config
      class without that field carries nothing), so that
      :func:`~lowrank_jax.convert.save_pretrained` writes back what lowrank_jax does not
      model (dropout, initializer and cache settings, labels, decoding defaults). The
      generation config is read from a checkpoint directory (or from a ``config=``
      directory), or taken from a live model that can generate.

    Raises:
      CheckpointError: the weights do not match the config (every offending key is listed) or
        a weights file cannot be read.
      MissingFileError: no directory, ``config.json`` or weights file.
      ConfigError: unknown or ambiguous family, or an invalid config (or an invalid
        ``generation_config.json``).
    """
    generation, architecture = None, None
    config_dir = (os.fspath(config) if isinstance(config, (str, os.PathLike))
                  and os.path.isdir(config) else None)
    if isinstance(source, (str, os.PathLike)):
        directory = os.fspath(source)
        if not os.path.isdir(directory):
            raise MissingFileError(f"load_pretrained: {directory} is not a directory",
                                   where=directory)
        hf_config = config_dict(config) or read_config(os.path.join(directory, CONFIG_NAME))
        state, where = read_weights(directory)
        generation = read_generation_config(config_dir or directory)
    elif isinstance(source, dict):
        hf_config = config_dict(config)
        if hf_config is None:
            raise ConfigError("load_pretrained: a state dict needs config= (the Hugging Face "
                              "config: a dict, a config.json path or a PretrainedConfig)",
                              where="config", expected="a config", actual=None)
        state, where = {k: to_numpy(v) for k, v in source.items()}, "<state dict>"
        if config_dir is not None:
            generation = read_generation_config(config_dir)
    else:
        module = hf_model(source)
        hf_config = config_dict(config if config is not None else module.config)
        state = {k: to_numpy(v) for k, v in module.state_dict().items()}
        where = f"<{type(module).__name__}>"
        if config_dir is not None:
            generation = read_generation_config(config_dir)
        elif module.can_generate() and getattr(module, "generation_config", None) is not None:
            generation = file_dict(module.generation_config)
        if config is None:  # the config.json the module's save_pretrained would write
            config, architecture = module.config, type(module).__name__
    fam = _get_family(family if family is not None else detect_family(hf_config))
    spec = fam.hf
    cfg = spec.config_from_hf(hf_config, {spec.rename(k): v for k, v in state.items()})
    # the file as written: a PretrainedConfig in the form its save_pretrained writes
    written = file_dict(hf_config if config is None or isinstance(config, (str, os.PathLike))
                        else config)
    if architecture is not None:
        written["architectures"] = [architecture]
    cfg = with_hf_files(cfg, HFConfigFiles(config=written, generation_config=generation,
                                           loaded=cfg))
    return cfg, params_from_state_dict(cfg, state, source=where)


__all__ = ["detect_family", "hf_families", "hf_spec", "load_pretrained",
           "params_from_state_dict"]
