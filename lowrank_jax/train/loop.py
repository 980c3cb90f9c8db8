"""A small training loop and forecast evaluation for Chronos-Bolt-style models.

``fit`` runs a jitted train step over a :class:`~lowrank_jax.train.data.WindowSampler`, with
optional checkpoints (exact resume: the sampler position is part of the state), a progress
bar, periodic evaluation and metrics written as JSON lines. ``evaluate_forecaster`` computes
WQL and MASE (Chronos' metrics) over a whole split.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.models import chronos_bolt
from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
from lowrank_jax.losses import mase, quantile_loss, wql
from lowrank_jax.train.state import full_params, init_train_state
from lowrank_jax.train.step import default_optimizer, make_train_step


def bolt_loss_fn(cfg: ChronosBoltConfig) -> Callable:
    """``loss_fn(params, batch, key)``: Chronos-Bolt's quantile loss on the normalized scale.

    The model instance-normalizes each context; as in the reference training code the pinball
    loss is computed on ``(pred - loc) / scale`` against ``(target - loc) / scale``.
    """

    def loss_fn(params, batch, key):
        del key  # no dropout
        out = chronos_bolt.apply(params, cfg, context=batch["context"])
        loc, scale = out["loc_scale"]  # [b, 1] each
        pred = (out["quantile_preds"] - loc[:, :, None]) / scale[:, :, None]
        target = (batch["target"] - loc) / scale
        return quantile_loss(pred, target, cfg.quantiles), {}

    return loss_fn


def evaluate_forecaster(
    cfg: ChronosBoltConfig, params: Any, sampler, *, season: int = 1, max_batches: int | None = None
) -> dict:
    """WQL and MASE of ``params`` over the windows of ``sampler`` (one pass, in order).

    The forecast horizon is ``sampler``'s horizon (at most ``cfg.prediction_length``); MASE
    uses the median quantile as the point forecast and each window's context for the
    seasonal-naive scale.
    """
    fwd = jax.jit(lambda p, c: chronos_bolt.apply(p, cfg, context=c)["quantile_preds"])
    preds, targets, contexts = [], [], []
    n = sampler.batches_per_epoch
    if max_batches is not None:
        n = min(max_batches, n)
    for pos in range(n):
        b = sampler.batch(pos)
        q = fwd(params, b["context"])[:, :, : b["target"].shape[1]]
        preds.append(np.asarray(q))
        targets.append(np.asarray(b["target"]))
        contexts.append(np.asarray(b["context"]))
    # the last batch of an epoch wraps around to the first windows: count each window once
    keep = min(sampler.num_windows, n * sampler.batch_size)
    pred, target, context = (np.concatenate(a)[:keep] for a in (preds, targets, contexts))
    median = pred[:, list(cfg.quantiles).index(0.5)] if 0.5 in cfg.quantiles else np.median(pred, 1)
    return {
        "wql": float(wql(pred, target, cfg.quantiles)),
        "mase": float(mase(median, target, context, season=season)),
        "n_windows": int(pred.shape[0]),
    }


def fit(
    loss_fn: Callable,
    params: Any,
    sampler,
    *,
    steps: int,
    key,
    optimizer=None,
    learning_rate: float = 1e-3,
    checkpointer=None,
    checkpoint_every: int = 0,
    eval_fn: Callable | None = None,
    eval_every: int = 0,
    log_path: str | None = None,
    progress: bool = True,
    desc: str = "train",
) -> tuple[Any, list[dict]]:
    """Train ``params`` for ``steps`` steps on ``sampler``'s batches.

    Args:
      loss_fn: ``loss_fn(params, batch, key) -> (loss, aux)``.
      params: initial parameters (any leaves; frozen parts stay frozen).
      sampler: a :class:`~lowrank_jax.train.data.WindowSampler` (its ``batch(position)`` is
        deterministic, so a resumed run sees the same batches).
      steps: total number of steps (a resumed run continues up to it).
      key: PRNG key.
      optimizer: optax transformation (default: AdamW with warmup-cosine over ``steps``).
      checkpointer: optional :class:`~lowrank_jax.train.checkpoint.Checkpointer`; when it holds
        a checkpoint, training resumes from the latest one.
      checkpoint_every: save every this many steps (and at the end) when a checkpointer is given.
      eval_fn: ``eval_fn(params) -> dict`` run every ``eval_every`` steps and at the end.
      log_path: append one JSON object per logged step (loss, step time, eval metrics).
      progress: show a tqdm progress bar.

    Returns:
      ``(params, history)`` with one dict per logged step.
    """
    optimizer = optimizer or default_optimizer(
        learning_rate=learning_rate, total_steps=steps, warmup_steps=max(1, steps // 20)
    )
    state = init_train_state(params, optimizer, key=key, data_position=sampler.position)
    if checkpointer is not None and checkpointer.latest_step() is not None:
        like = jax.eval_shape(lambda: state)
        state = checkpointer.restore(like=like)
    step_fn = make_train_step(loss_fn, optimizer)
    start = int(state.step)
    history: list[dict] = []
    log = open(log_path, "a") if log_path else None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start, desc=desc, unit="step", leave=False)
    try:
        for _ in range(start, steps):
            pos = int(state.data_position)
            batch = {
                k: jnp.asarray(v)
                for k, v in sampler.batch(pos).items()
                if k in ("context", "target")
            }
            t0 = time.perf_counter()
            state, metrics = step_fn(state, batch, None)
            state = state._replace(data_position=state.data_position + 1)
            step = int(state.step)
            row = {"step": step, "loss": float(metrics["loss"]), "step_s": time.perf_counter() - t0}
            if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps):
                row.update({f"eval_{k}": v for k, v in eval_fn(full_params(state)).items()})
            history.append(row)
            if log:
                log.write(json.dumps(row) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
            if (
                checkpointer is not None
                and checkpoint_every
                and (step % checkpoint_every == 0 or step == steps)
            ):
                checkpointer.save(state)
    finally:
        if bar is not None:
            bar.close()
        if log:
            log.close()
    return full_params(state), history
