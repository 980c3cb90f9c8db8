"""A small training loop and forecast evaluation, for any model family.

:func:`fit` runs a jitted train step (optionally sharded over a mesh) over the batches of a
deterministic batch source such as :class:`~lowrank_jax.train.data.WindowSampler`, with
optional checkpoints (exact resume: the source position is part of the state), a progress
bar, periodic evaluation and metrics written as JSON lines. It knows nothing about the model:
the loss, the batch construction and the evaluation are arguments. A model family supplies them
(``family.loss(cfg)``, ``family.batch_from_windows``).

Durability: the log is appended and fsynced record by record and cut back to the restored step
on resume; a state is checkpointed only when every value in it is finite; a NaN or infinite
loss stops training with :class:`NonFiniteError`.

:func:`evaluate_forecaster` computes WQL and MASE (Chronos' metrics) of any forecasting family
(``family_of(config).forecast``) over a whole split.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import warnings
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax._progress import progress_bar
from lowrank_jax.errors import ConfigError, NonFiniteError
from lowrank_jax.leaves import path_str
from lowrank_jax.losses import mase, wql
from lowrank_jax.models import family_of
from lowrank_jax.train.state import TrainState, full_params, init_train_state
from lowrank_jax.train.step import default_optimizer, make_train_step


class BatchSource(Protocol):
    """What :func:`fit` and :func:`evaluate_forecaster` read batches from.

    ``batch(position)`` must be a pure function of ``position`` (so a resumed run sees the same
    batches); ``position`` is where a fresh run starts. :class:`~lowrank_jax.train.WindowSampler`
    is one.
    """

    position: int

    def batch(self, position: int) -> Any: ...


def window_batch(raw: Mapping[str, Any]) -> dict:
    """The default batch of :func:`fit`: a window's ``context`` and ``target`` as arrays.

    Args:
      raw: a :class:`~lowrank_jax.train.WindowSampler` batch.

    Returns:
      ``{'context': [b, context_length], 'target': [b, horizon]}``.
    """
    return {"context": jnp.asarray(raw["context"]), "target": jnp.asarray(raw["target"])}


@functools.lru_cache(maxsize=8)
def _forecast_fn(config: Any) -> Callable:
    """The jitted forecast of ``config``'s family, made once per config (periodic evaluations
    during training then trace it once)."""
    fam = family_of(config)
    return jax.jit(lambda p, c: fam.forecast(p, c, config))


def evaluate_forecaster(config: Any, params: Any, sampler, *, season: int = 1,
                        max_batches: int | None = None) -> dict:
    """WQL and MASE of a forecasting model over the windows of ``sampler`` (one pass, in order).

    The model runs through its family's ``forecast(params, context, config) -> [batch,
    n_levels, prediction_length]`` at the levels ``forecast_levels(config)`` (Chronos-Bolt: its
    trained quantiles; Chronos: quantiles of sampled paths). The forecast horizon is
    ``sampler``'s horizon (at most the model's ``prediction_length``); MASE uses the median
    (level 0.5, else the median over levels) as the point forecast and each window's context
    for the seasonal-naive scale.

    Args:
      config: a model config of a registered forecasting family.
      params: the model parameters.
      sampler: a :class:`~lowrank_jax.train.WindowSampler` (or any object with its
        ``batch(position) -> {'context', 'target', ...}``, ``batches_per_epoch``,
        ``num_windows`` and ``batch_size``).
      season: MASE's seasonal period.
      max_batches: evaluate at most this many batches.

    Returns:
      ``{'wql', 'mase', 'n_windows'}``.

    Raises:
      ConfigError: the family has no forecast, or the sampler's horizon exceeds the model's.
    """
    fam = family_of(config)
    if fam.forecast is None or fam.forecast_levels is None:
        raise ConfigError(f"evaluate_forecaster: model family {fam.name!r} is not a forecaster "
                          "(its ModelFamily has no forecast)", where="config",
                          expected="a forecasting family", actual=fam.name)
    levels = tuple(float(q) for q in fam.forecast_levels(config))
    try:
        fwd = _forecast_fn(config)
    except TypeError:  # an unhashable config: no reuse
        fwd = jax.jit(lambda p, c: fam.forecast(p, c, config))
    first = sampler.batch(0)
    horizon = np.shape(first["target"])[1]
    length = jax.eval_shape(fwd, params, jnp.asarray(first["context"])).shape[-1]  # no compile
    if horizon > length:
        raise ConfigError(
            f"evaluate_forecaster: the sampler's horizon {horizon} exceeds the model's "
            f"prediction_length {length}", where="sampler.horizon", expected=f"<= {length}",
            actual=horizon)
    preds, targets, contexts = [], [], []
    n = sampler.batches_per_epoch
    if max_batches is not None:
        n = min(max_batches, n)
    for pos in range(n):
        b = first if pos == 0 else sampler.batch(pos)
        q = np.asarray(fwd(params, jnp.asarray(b["context"])))  # [b, levels, prediction_length]
        preds.append(q[:, :, :horizon])
        targets.append(np.asarray(b["target"]))
        contexts.append(np.asarray(b["context"]))
    # the last batch of an epoch wraps around to the first windows: count each window once
    keep = min(sampler.num_windows, n * sampler.batch_size)
    pred, target, context = (np.concatenate(a)[:keep] for a in (preds, targets, contexts))
    median = pred[:, levels.index(0.5)] if 0.5 in levels else np.median(pred, 1)
    return {
        "wql": float(wql(pred, target, levels)),
        "mase": float(mase(median, target, context, season=season)),
        "n_windows": int(pred.shape[0]),
    }


def _finite_or_none(value: Any) -> Any:
    """An evaluation value as JSON can hold it: scalars (NumPy and JAX ones included) become
    Python numbers, non-finite ones ``None``; anything else is left as it is."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    a = np.asarray(value) if isinstance(value, (float, np.generic, np.ndarray, jax.Array)) \
        else None
    if a is None or a.ndim != 0 or a.dtype.kind not in "biuf":
        return value
    if a.dtype.kind == "b":
        return bool(a)
    if a.dtype.kind in "iu":
        return int(a)
    return float(a) if math.isfinite(float(a)) else None


def truncate_log(path: str, step: int) -> int:
    """Cut a JSON-lines log back to the records of steps ``<= step``.

    Records are kept from the start of the file up to the first one that is incomplete (a
    killed write), unreadable, or of a later step; the rest is removed, so a resumed run
    appends exactly the records an uninterrupted run would have.

    Args:
      path: the log file (nothing happens when it does not exist).
      step: the step the run resumes from (0 for a fresh run: everything is removed).

    Returns:
      The number of records kept.
    """
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        data = f.read()
    keep, kept, pos = 0, 0, 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            break  # a partial last line
        try:
            rec = json.loads(data[pos:end])
        except ValueError:
            break
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or rec["step"] > step:
            break
        pos = keep = end + 1
        kept += 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return kept


def _finite_flags(tree: Any) -> tuple[list[str], Callable]:
    """The paths of the float arrays of ``tree`` and a jitted function giving, for each, whether
    all its values are finite (one boolean vector, computed where the arrays live)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    idx = [i for i, (_, x) in enumerate(flat)
           if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    paths = [path_str(flat[i][0]) for i in idx]

    @jax.jit
    def flags(t):
        leaves = jax.tree_util.tree_leaves(t)
        return jnp.stack([jnp.all(jnp.isfinite(leaves[i])) for i in idx]) if idx else \
            jnp.ones((0,), bool)

    return paths, flags


def _check_positive(name: str, value: Any, *, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"fit: {name} must be an int >= {low}, got {value!r}", where=name,
                          expected=f"int >= {low}", actual=value)


def fit(
    loss_fn: Callable,
    params: Any | str | os.PathLike,
    sampler: BatchSource,
    *,
    steps: int,
    key,
    batch_fn: Callable[[Any], Any] = window_batch,
    model_state: Any = None,
    optimizer=None,
    learning_rate: float = 1e-3,
    mesh=None,
    fsdp: bool = False,
    axis_rules: Mapping[str, str | None] | None = None,
    checkpointer=None,
    checkpoint_every: int = 0,
    eval_fn: Callable | None = None,
    eval_every: int = 0,
    log_path: str | None = None,
    progress: bool = True,
    desc: str = "train",
) -> tuple[TrainState, list[dict]]:
    """Train ``params`` for ``steps`` steps on the batches of ``sampler``.

    Step ``t`` (counting from 0) trains on ``batch_fn(sampler.batch(p))`` where ``p`` is the
    source position stored in the state (``sampler.position`` for a fresh run, ``+1`` per
    step), so a run resumed from a checkpoint sees exactly the batches of an uninterrupted one.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)``, or, when ``model_state`` is
        given, ``loss_fn(params, model_state, batch, key) -> (loss, aux, new_model_state)``
        (e.g. ``family_of(cfg).loss(cfg)``).
      params: initial parameters (any leaves; frozen parts stay frozen), or the path of a
        checkpoint to take them from: one written by :func:`lowrank_jax.io.save_params` /
        :func:`~lowrank_jax.io.save_model`, or a step directory of a
        :class:`~lowrank_jax.train.Checkpointer` (read with
        :func:`lowrank_jax.io.load_params`). Only the parameters are taken: the optimizer
        starts fresh and the step at 0 (to continue a run, give its ``checkpointer``). A
        model state stored there is not taken: pass
        ``model_state=lowrank_jax.io.load_state(path)``.
      sampler: a deterministic batch source (:class:`BatchSource`, e.g. a
        :class:`~lowrank_jax.train.data.WindowSampler`).
      steps: total number of steps (a resumed run continues up to it).
      key: PRNG key (the step key is ``fold_in(key, step)``).
      batch_fn: turns what ``sampler.batch`` returns into the batch ``loss_fn`` takes; default
        :func:`window_batch` (the windows' context and target). For a model family trained on
        windows: ``lambda w: family.batch_from_windows(cfg, w['context'], w['target'])``.
      model_state: the model's initial state (BatchNorm running statistics; for a stateful
        family ``family.init_state(params, cfg)``); ``None`` for a stateless model. When
        given, the step is stateful (see ``loss_fn``).
      optimizer: optax transformation (default: AdamW with warmup-cosine over ``steps``, a
        warmup of ``steps // 20`` steps, at least 1 and at most ``steps - 1``: a single step
        runs at the peak learning rate).
      learning_rate: peak learning rate of the default optimizer.
      mesh, fsdp, axis_rules: placement, as :func:`~lowrank_jax.train.make_train_step`.
      checkpointer: optional :class:`~lowrank_jax.train.checkpoint.Checkpointer`; when it holds
        a checkpoint, training resumes from the latest one (parameters, optimizer and model
        state, step, key and data position; ``params`` then only gives the structure).
      checkpoint_every: save every this many steps (and at the end) when a checkpointer is given.
      eval_fn: run every ``eval_every`` steps and at the end: ``eval_fn(params) -> dict``, or
        ``eval_fn(params, model_state) -> dict`` for a stateful model.
      eval_every: evaluation period in steps (0: never).
      log_path: the run's JSON-lines log: one object per step (``step``, ``loss``, ``step_s``
        -- the wall-clock time of the step --, and ``eval_*`` metrics where evaluated; a
        non-finite evaluation value is written as ``null``). Each record is appended, flushed
        and fsynced before the checkpoint of its step is saved. On start the file is cut back
        to the records of steps up to the restored one (:func:`truncate_log`; a fresh run
        empties it), so a run resumed after a kill or Ctrl-C leaves the same file as an
        uninterrupted one (apart from ``step_s``).
      progress: show a tqdm progress bar.
      desc: the progress bar's label.

    Returns:
      ``(state, history)``: the final :class:`~lowrank_jax.train.TrainState`
      (:func:`~lowrank_jax.train.full_params` gives the parameters, ``state.model_state`` the
      model state) and one dict per step run.

    Multi-process (``jax.distributed``): give a ``mesh`` over the devices of all processes;
    every process calls ``fit`` with the same arguments except ``sampler``, which yields this
    process's part of each global batch (see :func:`~lowrank_jax.train.make_train_step`).
    Process 0 writes the log and shows the progress bar; all processes take part in the
    checkpoints.

    Raises:
      ConfigError: a bad option (before anything is compiled), or a restored state beyond
        ``steps``.
      NonFiniteError: the loss or the gradient norm of a step is NaN or infinite, or the state
        about to be checkpointed holds a non-finite value. Nothing of that step is saved
        (neither its log record nor a checkpoint); earlier checkpoints are kept.
    """
    _check_positive("steps", steps)
    _check_positive("checkpoint_every", checkpoint_every, zero_ok=True)
    _check_positive("eval_every", eval_every, zero_ok=True)
    if not callable(batch_fn):
        raise ConfigError(f"fit: batch_fn must be callable, got {type(batch_fn).__name__}",
                          where="batch_fn", expected="a callable",
                          actual=type(batch_fn).__name__)
    if isinstance(params, (str, os.PathLike)):
        from lowrank_jax.io import load_params

        params = load_params(params)
    stateful = model_state is not None
    optimizer = optimizer or default_optimizer(  # one step: no warmup, the step at the peak
        learning_rate=learning_rate, total_steps=steps,
        warmup_steps=min(max(1, steps // 20), steps - 1))
    step_fn = make_train_step(loss_fn, optimizer, mesh=mesh, fsdp=fsdp, axis_rules=axis_rules,
                              stateful=stateful)
    state = init_train_state(params, optimizer, key=key, data_position=int(sampler.position),
                             model_state=model_state)
    if checkpointer is not None and checkpointer.latest_step() is not None:
        like = jax.eval_shape(lambda: state)
        shardings = step_fn.state_shardings(like)
        if shardings is not None:  # restore straight onto the step's placement
            like = jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)
        state = checkpointer.restore(like=like)

    def evaluate(st: TrainState) -> dict:
        args = (full_params(st), st.model_state) if stateful else (full_params(st),)
        return eval_fn(*args)

    start = int(state.step)
    if start > steps:
        where = checkpointer.directory if checkpointer is not None else "state"
        raise ConfigError(f"fit: the restored state is at step {start}, beyond steps={steps} "
                          f"({where}); give steps >= {start}", where="steps",
                          expected=f">= {start}", actual=steps)
    primary = jax.process_index() == 0  # one process writes the log and shows progress
    history: list[dict] = []
    log = None
    if log_path and primary:
        kept = truncate_log(log_path, start)
        if kept < start:
            warnings.warn(f"fit: {log_path} holds {kept} records but the run resumes at step "
                          f"{start}; the records of the missing steps cannot be recreated",
                          stacklevel=2)
        log = open(log_path, "a", encoding="utf-8")
    bar = progress_bar(total=steps, initial=start, desc=desc, unit="step",
                       enabled=progress and primary)
    finite_paths, finite_flags = None, None

    def stop(step: int, what: str, actual: Any) -> NonFiniteError:
        last = checkpointer.latest_step() if checkpointer is not None else None
        kept = (f"the last good checkpoint, step {last} in {checkpointer.directory}, is kept"
                if last is not None else "no checkpoint was saved")
        return NonFiniteError(
            f"training stopped at step {step}: {what} is {actual}, not finite; nothing of this "
            f"step was saved and {kept}. Lower the learning rate or check the data",
            where=f"step {step}", expected="finite values", actual=actual)

    try:
        for _ in range(start, steps):
            batch = batch_fn(sampler.batch(int(state.data_position)))
            t0 = time.perf_counter()
            state, metrics = step_fn(state, batch, None)
            state = state._replace(data_position=state.data_position + 1)
            step = int(state.step)
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise stop(step, "the loss", loss)
            if "grad_norm" in metrics and not math.isfinite(float(metrics["grad_norm"])):
                raise stop(step, "the gradient norm", float(metrics["grad_norm"]))
            row = {"step": step, "loss": loss, "step_s": time.perf_counter() - t0}
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps):
                row.update({f"eval_{k}": _finite_or_none(v) for k, v in evaluate(state).items()})
            history.append(row)
            if log:  # the record reaches the file before a checkpoint of its step exists
                log.write(json.dumps(row, allow_nan=False) + "\n")
                log.flush()
                os.fsync(log.fileno())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
            if (
                checkpointer is not None
                and checkpoint_every
                and (step % checkpoint_every == 0 or step == steps)
            ):
                if finite_flags is None:
                    finite_paths, finite_flags = _finite_flags(state)
                ok = np.asarray(finite_flags(state))
                if not ok.all():
                    raise stop(step, f"'{finite_paths[int(np.argmin(ok))]}' of the state",
                               "not finite")
                checkpointer.save(state)
    finally:
        if bar is not None:
            bar.close()
        if log:
            log.close()
    return state, history


__all__ = ["BatchSource", "evaluate_forecaster", "fit", "truncate_log", "window_batch"]
