"""The ``train`` workflow: ``lowrank-jax train CONFIG.json --out RUN``, (compressed) pretraining
of a forecasting model from a config (:mod:`lowrank_jax.recipes.train_config`) in a run
directory that a rerun resumes.

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

import json
import os
from typing import Any

from lowrank_jax.errors import ConfigError, OutputExistsError
from lowrank_jax.recipes import outputs
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.outputs import json_safe
from lowrank_jax.recipes.progress import Progress, lines
from lowrank_jax.recipes.train_config import build_model_config, load_train_config, schedule

RUN_FILE = "run.json"
RUN_FORMAT = "lowrank_jax.train_run"
RUN_VERSION = 1
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
WALL_CLOCK_KEYS = ("step_s",)


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
              resume_changed_config: bool = False, distributed: bool = False,
              coordinator: str | None = None, num_processes: int | None = None,
              process_id: int | None = None, status: Progress | None = None) -> Outcome:
    """Train as the config says, in the run directory ``out_dir`` (see the module docstring).

    Args:
      config_path: the JSON config file.
      out_dir: the run directory (created, resumed, or refused).
      progress: show a progress bar.
      resume_changed_config: continue a run whose stored config differs from this one (the
        change is recorded in ``run.json``).
      distributed: one process of a multi-process run: :func:`init_distributed` first, with
        ``coordinator``, ``num_processes`` and ``process_id`` (those left ``None``: the
        cluster's auto-detection). Every process calls this with the same arguments.
      coordinator, num_processes, process_id: see ``distributed``.
      status: progress reporting (default: status lines on stderr).

    Returns:
      The summary written to ``out_dir/summary.json`` (for a run that was already complete,
      the stored one; nothing is rewritten; ``{}`` in processes other than process 0), with
      what happened (compressed by design, resumed, complete, saved) as lines.

    Raises:
      ConfigError: a bad config, a changed config without ``resume_changed_config``, or
        ``coordinator`` / ``num_processes`` / ``process_id`` without ``distributed``.
      OutputExistsError: ``out_dir`` is not a lowrank_jax run, or is in use.
      NonFiniteError: the loss became NaN or infinite (the last good checkpoint is kept).
      DataError, MissingFileError, CheckpointError: bad data, missing files, unusable
        checkpoints.
    """
    import jax
    import numpy as np

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

    if distributed:
        init_distributed(coordinator, num_processes, process_id)
    elif any(v is not None for v in (coordinator, num_processes, process_id)):
        raise ConfigError("train: --coordinator, --num-processes and --process-id need "
                          "--distributed", where="--distributed", expected="--distributed",
                          actual="not given")
    c = load_train_config(config_path)
    status = lines(status, "train")
    text: list[str] = []
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
        sched, rank = schedule(comp, cfg)
        kw = {"rules": tuple(comp["rules"])} if comp["rules"] else {}
        params, report = factorize_init(params, key=jax.random.fold_in(key, 2), schedule=sched,
                                        rank=rank, per_head=comp["per_head"], **kw)
        if primary:
            how = f"schedule {sched}" if sched else f"rank {rank}"
            text.append(f"compressed by design: {how}, attention size ratio {report.ratio:.3f}")
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
                text.append(f"resuming {out_dir} with a changed config: "
                            f"{sorted(change['changed'])}")
        # complete: the last step is checkpointed and the summary (written last) is there; a
        # single process also needs model/ (a multi-process run does not write it, see below)
        done = (latest == t["steps"] and os.path.isfile(summary_path)
                and (n_proc > 1 or os.path.isdir(model_path)))
        if _from_primary(done):
            summary = {}
            if primary:
                with open(summary_path, encoding="utf-8") as f:
                    summary = json.load(f)
                text.append(f"{out_dir} is already complete ({t['steps']} steps); nothing to do")
            return Outcome(summary, lines=text)
        if latest is not None and primary:
            text.append(f"resuming from step {latest} in {out_dir}/checkpoints")

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

        if primary:  # a line per stage, with or without progress
            status.say(f"training steps {(latest or 0) + 1}-{t['steps']} on {source} "
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
            return Outcome()
        summary = _summary(read_metrics(metrics_path), t["steps"], source, fam.name, report)
        if n_proc == 1:
            status.say(f"saving the model to {model_path}")
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
        text.append(f"trained {t['steps']} steps: final loss {summary['final_loss']}, {saved}, "
                    f"metrics in {metrics_path}")
        return Outcome(summary, lines=text)
    finally:
        if lock is not None:
            os.close(lock)


__all__ = ["METRICS_FILE", "RUN_FILE", "SUMMARY_FILE", "clean_temporaries", "config_diff",
           "init_distributed", "inspect_run_dir", "read_metrics", "run_train"]
