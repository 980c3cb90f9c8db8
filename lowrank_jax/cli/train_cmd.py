"""``lowrank-jax train CONFIG.json --out RUN``: (compressed) pretraining of a forecasting model.

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

The run directory
-----------------

``--out RUN`` holds::

    run.json        # marker of a lowrank_jax train run: the normalized config it was started
                    #   with, and every accepted config change (step, keys, old and new values)
    checkpoints/    # orbax train-state checkpoints (keep-N); a rerun resumes from the newest
    metrics.jsonl   # one JSON object per step: step, loss, step_s (wall clock), eval_* metrics
                    #   every eval_every steps and at the end
    model/          # the final model checkpoint (factors kept)
    summary.json    # steps, final loss, last evaluation, compression report

Reliability rules:

* A directory that is not empty and holds no ``run.json`` is refused and left untouched.
* Rerunning with the same config resumes from the newest checkpoint; ``metrics.jsonl`` is cut
  back to the restored step, so a resumed run's file equals an uninterrupted run's (apart from
  ``step_s``). A rerun of a complete run changes nothing.
* Rerunning with a different config is refused (the error names every key that differs, with
  the stored and the new value) unless ``--resume-changed-config`` is given.
* Every file is written atomically or appended and flushed per record; temporaries of killed
  runs are removed on start; only one process trains in a run directory at a time (a lock).
* A non-finite loss stops the run with :class:`lowrank_jax.train.NonFiniteError` (exit status
  2 from the command), keeping the last good checkpoint; no file holds ``NaN``.
* Multi-process (``--distributed``): every process runs the same command; each feeds its part of
  every global batch (``ProcessPart``), the step runs data parallel over all devices, all
  processes write the checkpoints and process 0 the other files. ``model/`` is not written by
  a multi-process run: rerunning the command in one process (without ``--distributed``) writes
  it from the final checkpoint, training nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from typing import Any, Callable

from lowrank_jax.cli import outputs
from lowrank_jax.cli.outputs import json_safe
from lowrank_jax.errors import ConfigError, OutputExistsError

RUN_FILE = "run.json"
RUN_FORMAT = "lowrank_jax.train_run"
RUN_VERSION = 1
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
WALL_CLOCK_KEYS = ("step_s",)

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


def _schedule(comp: dict, cfg):
    from lowrank_jax.compress import interpolation_schedule, power_schedule

    n = max(cfg.t5.num_layers, cfg.t5.num_decoder_layers or cfg.t5.num_layers)
    limit = cfg.t5.d_model
    if comp["schedule"] == "power":
        return power_schedule(comp["d0"], comp["alpha"], n, max_rank=limit), None
    if comp["schedule"] == "interp":
        return interpolation_schedule(comp["r1"], comp["rD"], comp["alpha"], n,
                                      max_rank=limit), None
    return None, comp["rank"]


# ---------------------------------------------------------------------------------------------
# The run directory.

def _flatten(cfg: Any, prefix: str = "") -> dict:
    if isinstance(cfg, dict) and (cfg or not prefix):
        out = {}
        for k, v in cfg.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: cfg}


def config_diff(old: dict, new: dict) -> dict:
    """The keys whose values differ between two normalized configs.

    Args:
      old, new: normalized configs (:func:`validate_train_config`).

    Returns:
      ``{"section.key": (old value, new value)}``; a key missing on one side has the value
      ``"<absent>"`` there.
    """
    a, b = _flatten(old), _flatten(new)
    missing = "<absent>"
    return {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)}


def _write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON (no NaN) through a temporary file, flushed and renamed."""
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_run_file(out_dir: str) -> dict:
    path = os.path.join(out_dir, RUN_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"train: {path} cannot be read ({type(e).__name__}: {e}); it marks "
                          f"{out_dir} as a lowrank_jax run but is damaged", where=path,
                          expected="a lowrank_jax train run file", actual=str(e)) from None
    if not (isinstance(doc, dict) and doc.get("format") == RUN_FORMAT
            and isinstance(doc.get("config"), dict)):
        raise ConfigError(f"train: {path} is not a lowrank_jax train run file (format "
                          f"{doc.get('format') if isinstance(doc, dict) else None!r})",
                          where=path, expected=RUN_FORMAT, actual="another file")
    return doc


def inspect_run_dir(out_dir: str, config: dict, *, resume_changed_config: bool = False
                    ) -> tuple[str, dict | None]:
    """Decide what a run directory is, without changing anything.

    Args:
      out_dir: the ``--out`` directory.
      config: the normalized config of this run.
      resume_changed_config: accept a directory whose stored config differs.

    Returns:
      ``(kind, run_doc)``: ``kind`` is ``'new'`` (missing or empty directory), ``'resume'``
      (same config) or ``'changed'`` (config differs and ``resume_changed_config``);
      ``run_doc`` is the stored ``run.json`` (``None`` when new).

    Raises:
      OutputExistsError: ``out_dir`` is a file, or a non-empty directory without ``run.json``.
      ConfigError: the stored config differs (every differing key with both values) and
        ``resume_changed_config`` is false, or ``run.json`` is damaged.
    """
    if os.path.lexists(out_dir) and (os.path.islink(out_dir) or not os.path.isdir(out_dir)):
        raise OutputExistsError(f"train: --out {out_dir} exists and is not a directory",
                                where=out_dir, expected="a run directory", actual="a file")
    # a run killed while writing its marker leaves only the marker's temporary file
    if not os.path.isdir(out_dir) or not set(os.listdir(out_dir)) - {f".{RUN_FILE}.tmp"}:
        return "new", None
    if not os.path.isfile(os.path.join(out_dir, RUN_FILE)):
        raise OutputExistsError(
            f"train: {out_dir} is not empty and is not a lowrank_jax train run (it has no "
            f"{RUN_FILE}); refusing to use it (nothing was changed). Choose a new or empty "
            "--out directory", where=out_dir, expected=f"an empty directory or a run with "
            f"{RUN_FILE}", actual="a directory of other files")
    doc = _read_run_file(out_dir)
    diff = config_diff(doc["config"], config)
    if not diff:
        return "resume", doc
    if not resume_changed_config:
        listed = ", ".join(f"{k}: {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"train: the config differs from the one {out_dir} was started with ({listed}); "
            "pass --resume-changed-config (run_train(..., resume_changed_config=True)) to "
            "continue this run with the new config, or choose another --out",
            where=os.path.join(out_dir, RUN_FILE), expected=doc["config"], actual=config)
    return "changed", doc


def _lock(out_dir: str) -> int | None:
    """An exclusive lock on the run directory, held while the returned descriptor is open."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX: no lock
        return None
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise OutputExistsError(
            f"train: {out_dir} is in use by another running lowrank-jax train; wait for it or "
            "choose another --out", where=out_dir, expected="a run directory not in use",
            actual="locked") from None
    return fd


def clean_temporaries(out_dir: str) -> list[str]:
    """Remove what killed runs left in a run directory: the temporary files of atomic writes
    (``.run.json.tmp``, ``.summary.json.tmp``) and the temporary siblings of ``model/``
    (the checkpointer removes its own on start).

    Args:
      out_dir: the run directory (locked by this process).

    Returns:
      The paths removed.
    """
    from lowrank_jax.io.files import clean_stale

    removed = []
    for name in (RUN_FILE, SUMMARY_FILE):
        tmp = os.path.join(out_dir, f".{name}.tmp")
        if os.path.lexists(tmp):
            os.remove(tmp)
            removed.append(tmp)
    return removed + clean_stale(os.path.join(out_dir, "model"))


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl`` file.

    Args:
      path: the file.

    Returns:
      One dict per line (a missing file: none).
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(records: list[dict], steps: int, source: str, family: str, report) -> dict:
    last = records[-1] if records else {}
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    last_eval = evals[-1] if evals else {}
    return {
        "steps": steps, "family": family, "data": source,
        "final_loss": last.get("loss"),
        "eval_step": last_eval.get("step"),
        "eval": {k: v for k, v in last_eval.items() if k.startswith("eval_")},
        "compression": json_safe(report.to_dict()) if report else None,
    }


# ---------------------------------------------------------------------------------------------
# Running.

def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` for ``--distributed``: explicit values, or the cluster's
    auto-detection (SLURM, TPU pods, ...) for those left ``None``.

    Args:
      coordinator: ``host:port`` of process 0's coordinator.
      num_processes: the number of processes.
      process_id: this process's index.
    """
    import jax

    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def _from_primary(value: bool) -> bool:
    """Process 0's ``value`` in every process (one collective; ``value`` with one process)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def _all_agree(ok: bool) -> bool:
    """Whether every process reports ``ok`` (one collective; ``ok`` itself with one process)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray(ok, np.int32))
    return bool(np.all(flags))


def run_train(config_path: str, out_dir: str, *, progress: bool = True,
              resume_changed_config: bool = False) -> dict:
    """Train as the config says, in the run directory ``out_dir`` (see the module docstring).

    Args:
      config_path: the JSON config file.
      out_dir: the run directory (created, resumed, or refused).
      progress: show a progress bar.
      resume_changed_config: continue a run whose stored config differs from this one (the
        change is recorded in ``run.json``).

    Returns:
      The summary written to ``out_dir/summary.json`` (for a run that was already complete,
      the stored one; nothing is rewritten).

    Raises:
      ConfigError: a bad config, or a changed config without ``resume_changed_config``.
      OutputExistsError: ``out_dir`` is not a lowrank_jax run, or is in use.
      NonFiniteError: the loss became NaN or infinite (the last good checkpoint is kept).
      DataError, MissingFileError, CheckpointError: bad data, missing files, unusable
        checkpoints.
    """
    import jax
    import numpy as np

    from lowrank_jax.cli.status import Status
    from lowrank_jax.compress import factorize_init, reuse_weights
    from lowrank_jax.io import load_model, save_model
    from lowrank_jax.models import get_family
    from lowrank_jax.train import (
        Checkpointer,
        IncompatibleCheckpointError,
        ProcessPart,
        WindowConfig,
        WindowSampler,
        default_series,
        evaluate_forecaster,
        fit,
        full_params,
        load_ett_csv,
    )

    c = load_train_config(config_path)
    t = c["train"]
    out_dir = os.path.abspath(out_dir)
    n_proc, me = jax.process_count(), jax.process_index()
    primary = me == 0
    if t["batch_size"] % n_proc:
        raise ConfigError(f"{config_path}: train.batch_size {t['batch_size']} must be divisible "
                          f"by the {n_proc} processes (each feeds an equal part)",
                          where="train.batch_size", expected=f"a multiple of {n_proc}",
                          actual=t["batch_size"])
    # Read-only checks first: nothing is created for a run that is refused. (With several
    # processes, process 0 checks once, below, and tells the others.)
    kind, doc = "new", None
    if n_proc == 1:
        kind, doc = inspect_run_dir(out_dir, c, resume_changed_config=resume_changed_config)
        outputs.check_writable(out_dir, flag="--out", inside=True)  # before the model is built
    cfg = build_model_config(c["model"])
    fam = get_family(c["model"]["family"])
    if fam.forecast is None or fam.batch_from_windows is None:  # pragma: no cover - schema
        raise ConfigError(f"{config_path}: model.family {fam.name!r} cannot be trained on series "
                          "windows", where="model.family", actual=fam.name)
    if c["data"]["csv"]:
        _, values = load_ett_csv(c["data"]["csv"])
        series, source = [values[:, j] for j in range(values.shape[1])], c["data"]["csv"]
    else:
        series, source = default_series()
    wcfg = WindowConfig(context_length=cfg.context_length, horizon=cfg.prediction_length,
                        stride=c["data"]["stride"] or cfg.prediction_length)
    # Samplers are built (and bad windows rejected) before anything is compiled.
    train = WindowSampler(series, wcfg, split="train", batch_size=t["batch_size"], seed=t["seed"],
                          skip_short=True)
    val = WindowSampler(series, wcfg, split="val", batch_size=256, seed=t["seed"], skip_short=True)
    key = jax.random.PRNGKey(t["seed"])
    params = jax.jit(fam.init, static_argnums=1)(key, cfg)  # one compiled program, not many
    comp, report = c["compression"], None
    if comp:
        sched, rank = _schedule(comp, cfg)
        kw = {"rules": tuple(comp["rules"])} if comp["rules"] else {}
        params, report = factorize_init(params, key=jax.random.fold_in(key, 2), schedule=sched,
                                        rank=rank, per_head=comp["per_head"], **kw)
        if primary:
            print(f"compressed by design: {'schedule ' + str(sched) if sched else f'rank {rank}'}"
                  f", attention size ratio {report.ratio:.3f}")
    if c["reuse_weights"]:
        r = c["reuse_weights"]
        _, pretrained = load_model(r["from"])
        params = reuse_weights(params, pretrained, r["pattern"])

    lock = None
    try:
        ok = True
        if primary:
            try:
                os.makedirs(out_dir, exist_ok=True)
                lock = _lock(out_dir)
                # again, under the lock: another run may have started in between
                kind, doc = inspect_run_dir(out_dir, c,
                                            resume_changed_config=resume_changed_config)
                clean_temporaries(out_dir)
                if kind == "new":  # the marker first: a directory is ours before we fill it
                    _write_json_atomic(os.path.join(out_dir, RUN_FILE),
                                       {"format": RUN_FORMAT, "version": RUN_VERSION,
                                        "config": c, "changes": []})
            except BaseException:
                _all_agree(False)
                raise
        if not _all_agree(ok):
            raise OutputExistsError(f"train: process 0 refused the run directory {out_dir} "
                                    "(see its message)", where=out_dir)
        ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), max_to_keep=t["keep"])
        latest = ckpt.latest_step()
        metrics_path = os.path.join(out_dir, METRICS_FILE)
        summary_path = os.path.join(out_dir, SUMMARY_FILE)
        model_path = os.path.join(out_dir, "model")
        if latest is not None and latest > t["steps"]:
            raise ConfigError(f"{config_path}: train.steps is {t['steps']} but {out_dir} is "
                              f"already at step {latest}", where="train.steps",
                              expected=f">= {latest}", actual=t["steps"])
        if primary:
            if kind == "changed":
                change = {"step": latest or 0, "changed": {
                    k: {"old": a, "new": b} for k, (a, b) in config_diff(doc["config"], c).items()}}
                _write_json_atomic(os.path.join(out_dir, RUN_FILE),
                                   {**doc, "config": c, "changes": [*doc.get("changes", []),
                                                                    change]})
                print(f"resuming {out_dir} with a changed config: {sorted(change['changed'])}")
        # complete: the last step is checkpointed and the summary (written last) is there; a
        # single process also needs model/ (a multi-process run does not write it, see below)
        done = (latest == t["steps"] and os.path.isfile(summary_path)
                and (n_proc > 1 or os.path.isdir(model_path)))
        if _from_primary(done):
            summary = {}
            if primary:
                with open(summary_path, encoding="utf-8") as f:
                    summary = json.load(f)
                print(f"{out_dir} is already complete ({t['steps']} steps); nothing to do")
            return summary
        if latest is not None and primary:
            print(f"resuming from step {latest} in {out_dir}/checkpoints")

        mesh, source_fn = None, train
        if n_proc > 1:
            from jax.sharding import Mesh

            mesh = Mesh(np.array(jax.devices()), ("data",))
            source_fn = ProcessPart(train)

        def host(tree):  # the evaluation runs on each process's own copy
            if n_proc == 1:
                return tree
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(tree, tiled=True)

        if primary:  # a line per stage, with or without progress (lowrank_jax.cli.status)
            Status("train").say(f"training steps {(latest or 0) + 1}-{t['steps']} on {source} "
                                f"(the first compiles the train step); log in {metrics_path}")
        try:
            state, _ = fit(
                fam.loss(cfg), params, source_fn, steps=t["steps"],
                key=jax.random.fold_in(key, 1),
                batch_fn=lambda w: fam.batch_from_windows(cfg, w["context"], w["target"]),
                learning_rate=t["learning_rate"], mesh=mesh, checkpointer=ckpt,
                checkpoint_every=t["checkpoint_every"],
                eval_fn=lambda p: evaluate_forecaster(cfg, host(p), val,
                                                      max_batches=t["eval_batches"]),
                eval_every=t["eval_every"], log_path=metrics_path,
                progress=progress and primary, desc="train")
        except IncompatibleCheckpointError:
            if primary and kind == "changed":  # the change cannot continue this run: undo it
                _write_json_atomic(os.path.join(out_dir, RUN_FILE), doc)
            raise
        ckpt.wait_until_finished()
        if not primary:
            return {}
        summary = _summary(read_metrics(metrics_path), t["steps"], source, fam.name, report)
        if n_proc == 1:
            Status("train").say(f"saving the model to {model_path}")
            save_model(model_path, cfg, full_params(state),
                       metadata={"config_file": os.path.abspath(config_path), "data": source,
                                 "run": RUN_FILE}, overwrite=True)
            saved = f"model saved to {model_path}"
        else:
            # lowrank_jax.io saves through orbax, whose multi-process barriers wait for every
            # process: process 0 cannot write model/ alone. The final state is in the last
            # checkpoint; a single-process rerun of this command writes model/ from it.
            saved = (f"final state in {ckpt.step_dir(t['steps'])}; rerun this command without "
                     f"--distributed to write {model_path} from it")
        _write_json_atomic(summary_path, summary)
        print(f"trained {t['steps']} steps: final loss {summary['final_loss']}, {saved}, metrics "
              f"in {metrics_path}")
        return summary
    finally:
        if lock is not None:
            os.close(lock)


__all__ = ["build_model_config", "clean_temporaries", "config_diff",
           "init_distributed", "inspect_run_dir", "load_train_config", "read_metrics",
           "run_train", "validate_train_config"]
