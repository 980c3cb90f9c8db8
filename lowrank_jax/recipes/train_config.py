"""The config of ``lowrank-jax train`` (:func:`lowrank_jax.recipes.run_train`, compressed
pretraining of a forecasting model): its schema, validation, loading, and the model config and
rank schedule it describes.

Config format
-------------

The config file is one JSON object with the sections below. Every section and every key is
optional; a missing key takes the default shown. Unknown keys, misspelled keys (the error
suggests the closest valid one) and values of the wrong type are refused before anything is
built or written::

    {
      "model": {
        "family": "chronos_bolt",      # or "chronos" (any family with a forecast and
                                       #   batch_from_windows; others are refused)
        "d_model": 64, "d_kv": 16, "d_ff": 256, "num_layers": 4, "num_decoder_layers": 2,
        "num_heads": 4, "context_length": 64, "prediction_length": 16,
        "feed_forward_proj": "relu",
        "patch_size": 8, "use_reg_token": true,     # chronos_bolt only
        "n_tokens": 4096, "num_samples": 20         # chronos only
      },
      "compression": null,             # dense; or one of
        {"schedule": "power", "d0": 4, "alpha": 0.7}          # flow-of-ranks d_i = ceil(d0 (1+i)^alpha)
        {"schedule": "interp", "r1": 4, "rD": 32, "alpha": 0.5}   # App. K interpolation
        {"rank": 8}                                              # uniform rank
        # each optionally with "per_head": true and "rules": ["attn/(qk/q|qk/k|v|o)$", ...]
      "reuse_weights": null,           # or {"from": "dense_run/model",
                                       #     "pattern": "^(input_patch_embedding|shared)"}
      "data": {"csv": null,            # an ETT-style CSV file; null: the built-in aeon series
               "stride": null},        # window stride; null: the prediction length
      "train": {"steps": 600, "batch_size": 64, "learning_rate": 1e-3, "seed": 0,
                "eval_every": 100, "eval_batches": 4, "checkpoint_every": 100, "keep": 3}
    }

The schedules are those of "Understanding Transformers for Time Series: Rank Structure,
Flow-of-Ranks, and Compressibility" (sec. 5 and App. K).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from typing import Any, Callable

from lowrank_jax.errors import ConfigError

FAMILIES = ("chronos_bolt", "chronos")


# ---------------------------------------------------------------------------------------------
# Schema.

@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its default, the check of its value and what the check expects."""

    default: Any
    check: Callable[[Any], bool]
    expected: str
    families: tuple[str, ...] = FAMILIES


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _pos_int(default: Any, families: tuple[str, ...] = FAMILIES) -> Key:
    return Key(default, lambda v: _is_int(v) and v >= 1, "an int >= 1", families)


def _nonneg_int(default: Any) -> Key:
    return Key(default, lambda v: _is_int(v) and v >= 0, "an int >= 0")


def _opt(key: Key) -> Key:
    return Key(key.default, lambda v: v is None or key.check(v), key.expected + " or null",
               key.families)


def _is_regex(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        re.compile(v)
    except re.error:
        return False
    return True


MODEL = {
    "family": Key("chronos_bolt", lambda v: v in FAMILIES, f"one of {list(FAMILIES)}"),
    "d_model": _pos_int(64), "d_kv": _pos_int(16), "d_ff": _pos_int(256),
    "num_layers": _pos_int(4), "num_decoder_layers": _pos_int(2), "num_heads": _pos_int(4),
    "context_length": _pos_int(64), "prediction_length": _pos_int(16),
    "feed_forward_proj": Key("relu", lambda v: isinstance(v, str), "a string (relu, gated-gelu)"),
    "patch_size": _pos_int(8, ("chronos_bolt",)),
    "use_reg_token": Key(True, lambda v: isinstance(v, bool), "true or false", ("chronos_bolt",)),
    "n_tokens": Key(4096, lambda v: _is_int(v) and v >= 5, "an int >= 5", ("chronos",)),
    "num_samples": _pos_int(20, ("chronos",)),
}
COMPRESSION = {
    "schedule": Key(None, lambda v: v in (None, "power", "interp"), "'power', 'interp' or null"),
    "d0": Key(None, lambda v: _is_num(v) and v > 0, "a number > 0"),
    "alpha": Key(None, lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    "r1": _pos_int(None), "rD": _pos_int(None), "rank": _pos_int(None),
    "per_head": Key(False, lambda v: isinstance(v, bool), "true or false"),
    "rules": Key(None, lambda v: v is None or (isinstance(v, list) and v
                                               and all(_is_regex(r) for r in v)),
                 "a non-empty list of regular expressions or null"),
}
REUSE = {
    "from": Key(None, lambda v: isinstance(v, str) and v != "", "a model checkpoint path"),
    "pattern": Key(r"^(input_patch_embedding|shared)", _is_regex, "a regular expression"),
}
DATA = {
    "csv": Key(None, lambda v: v is None or (isinstance(v, str) and v != ""),
               "a CSV file path or null"),
    "stride": _opt(_pos_int(None)),
}
TRAIN = {
    "steps": _pos_int(600), "batch_size": _pos_int(64),
    "learning_rate": Key(1e-3, lambda v: _is_num(v) and v > 0, "a finite number > 0"),
    "seed": _nonneg_int(0), "eval_every": _nonneg_int(100), "eval_batches": _pos_int(4),
    "checkpoint_every": _nonneg_int(100), "keep": _pos_int(3),
}
#: section -> (schema, whether the section may be null)
SCHEMA = {"model": (MODEL, False), "compression": (COMPRESSION, True),
          "reuse_weights": (REUSE, True), "data": (DATA, False), "train": (TRAIN, False)}


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _unknown(path: str, what: str, name: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return (f"{path}: unknown {what} '{prefix}{name}'{hint} (valid {what}s"
            f"{' of ' + repr(prefix[:-1]) if prefix else ''}: {', '.join(valid)})")


def _section(path: str, name: str, given: Any, problems: list[str],
             family: str | None = None) -> dict | None:
    schema, nullable = SCHEMA[name]
    if given is None:
        if nullable:
            return None
        given = {}
    if not isinstance(given, dict):
        problems.append(f"{path}: section '{name}' must be a JSON object"
                        f"{' or null' if nullable else ''}, got {json.dumps(given)} "
                        f"({_type_name(given)})")
        return None
    out = {}
    for key, value in given.items():
        where = f"{name}.{key}"
        if key not in schema:
            problems.append(_unknown(path, "key", key, sorted(schema), f"{name}."))
            continue
        spec = schema[key]
        if not spec.check(value):
            problems.append(f"{path}: {where} must be {spec.expected}, got {json.dumps(value)} "
                            f"({_type_name(value)})")
            continue
        out[key] = value
    if family is not None:  # model keys that belong to another family
        for key in given:
            if key in schema and family not in schema[key].families:
                problems.append(f"{path}: model.{key} applies to family "
                                f"{' / '.join(schema[key].families)} only, not {family!r}")
    keys = [k for k, s in schema.items() if family is None or family in s.families]
    return {k: out.get(k, schema[k].default) for k in keys}


def _check_compression(path: str, comp: dict | None, given: dict, problems: list[str]) -> None:
    if comp is None:
        return
    modes = {"power": ("d0", "alpha"), "interp": ("r1", "rD", "alpha"), None: ("rank",)}
    kind = comp["schedule"]
    if kind is None and comp["rank"] is None:
        problems.append(f"{path}: compression needs 'schedule' ('power' or 'interp') or "
                        f"'rank', got {json.dumps(given)}; use null for a dense model")
        return
    need = modes[kind]
    for key in need:
        if comp[key] is None:
            problems.append(f"{path}: compression.schedule {kind!r} needs key "
                            f"'compression.{key}'")
    other = {k for ks in modes.values() for k in ks} - set(need)
    for key in sorted(other):
        if key in given:
            mode = f"schedule {kind!r}" if kind else "'rank'"
            problems.append(f"{path}: compression.{key} does not apply to {mode}")


def validate_train_config(cfg: Any, path: str = "<config>") -> dict:
    """Validate a training config against the schema and fill in the defaults.

    Args:
      cfg: the parsed JSON config (see the module docstring).
      path: the file it came from, for messages.

    Returns:
      The normalized config: every section present, every key with its value or default
      (``compression`` and ``reuse_weights`` may be ``None``).

    Raises:
      ConfigError: an unknown section or key (with the closest valid name), a value of the wrong
        type or out of range (with the expected type), a missing or inapplicable compression
        key. Every problem is listed, in one line.
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a train config must be a JSON object, got "
                          f"{_type_name(cfg)}", where=path, expected="a JSON object",
                          actual=_type_name(cfg))
    problems: list[str] = []
    for name in cfg:
        if name not in SCHEMA:
            problems.append(_unknown(path, "section", name, sorted(SCHEMA)))
    model_given = cfg.get("model")
    family = model_given.get("family", "chronos_bolt") if isinstance(model_given, dict) else None
    if family not in FAMILIES:
        family = None  # reported by the model section
    out = {"model": _section(path, "model", model_given, problems, family or "chronos_bolt")}
    for name in ("compression", "reuse_weights", "data", "train"):
        out[name] = _section(path, name, cfg.get(name), problems)
    if isinstance(cfg.get("compression"), dict):
        _check_compression(path, out["compression"], cfg["compression"], problems)
    if out["reuse_weights"] is not None and out["reuse_weights"]["from"] is None:
        problems.append(f"{path}: reuse_weights needs 'reuse_weights.from' (a model checkpoint "
                        "path)")
    if problems:
        raise ConfigError("; ".join(problems), where=path, expected="a valid train config",
                          actual=problems[0])
    return out


def load_train_config(path: str) -> dict:
    """Read and validate a training config file.

    Args:
      path: the JSON file.

    Returns:
      The normalized config (:func:`validate_train_config`).

    Raises:
      MissingFileError: the file does not exist.
      ConfigError: it is not valid JSON, or not a valid config (the key, the closest valid
        key and the expected type are named).
    """
    from lowrank_jax.errors import MissingFileError

    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise MissingFileError(f"train: config file {path} does not exist", where=path) from None
    except IsADirectoryError:
        raise ConfigError(f"train: config {path} is a directory, not a JSON file",
                          where=path, expected="a JSON file", actual="a directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"train: {path} is not valid JSON: {e}", where=path,
                          expected="JSON", actual=str(e)) from None
    return validate_train_config(cfg, path)


def build_model_config(m: dict):
    """The model config of a normalized ``model`` section.

    Args:
      m: the ``model`` section (:func:`validate_train_config`).

    Returns:
      A ``ChronosBoltConfig`` or a ``ChronosConfig``.

    Raises:
      ConfigError: the sizes do not make a valid model (the model config's own message).
    """
    from lowrank_jax.models.t5 import T5Config

    family = m.get("family", "chronos_bolt")
    vocab = (2 if m["use_reg_token"] else 1) if family == "chronos_bolt" else m["n_tokens"]
    t5 = T5Config(vocab_size=vocab, d_model=m["d_model"], d_kv=m["d_kv"], d_ff=m["d_ff"],
                  num_layers=m["num_layers"], num_decoder_layers=m["num_decoder_layers"],
                  num_heads=m["num_heads"], feed_forward_proj=m["feed_forward_proj"])
    if family == "chronos":
        from lowrank_jax.models.chronos import ChronosConfig

        return ChronosConfig(t5=t5, n_tokens=m["n_tokens"], context_length=m["context_length"],
                             prediction_length=m["prediction_length"],
                             num_samples=m["num_samples"])
    from lowrank_jax.models.chronos_bolt import ChronosBoltConfig

    return ChronosBoltConfig(t5=t5, context_length=m["context_length"],
                             prediction_length=m["prediction_length"],
                             input_patch_size=m["patch_size"], input_patch_stride=m["patch_size"],
                             use_reg_token=m["use_reg_token"])


def schedule(comp: dict, cfg) -> tuple[list[int] | None, int | None]:
    """``(schedule, rank)`` of a normalized ``compression`` section for the model ``cfg``: the
    per-layer ranks of a ``power`` / ``interp`` schedule (at most ``d_model``) and ``None``, or
    ``None`` and the uniform ``rank``."""
    from lowrank_jax.compress import interpolation_schedule, power_schedule

    n = max(cfg.t5.num_layers, cfg.t5.num_decoder_layers or cfg.t5.num_layers)
    limit = cfg.t5.d_model
    if comp["schedule"] == "power":
        return power_schedule(comp["d0"], comp["alpha"], n, max_rank=limit), None
    if comp["schedule"] == "interp":
        return interpolation_schedule(comp["r1"], comp["rD"], comp["alpha"], n,
                                      max_rank=limit), None
    return None, comp["rank"]


__all__ = ["COMPRESSION", "DATA", "FAMILIES", "MODEL", "REUSE", "SCHEMA", "TRAIN", "Key",
           "build_model_config", "load_train_config", "schedule", "validate_train_config"]
