"""``lowrank-jax train CONFIG.json``: (compressed) pretraining of a Chronos-Bolt model.

The config file is JSON; every section is optional and defaults to the demo's small model::

    {
      "model": {"d_model": 64, "d_kv": 16, "d_ff": 256, "num_layers": 4,
                "num_decoder_layers": 2, "num_heads": 4, "context_length": 64,
                "prediction_length": 16, "patch_size": 8, "use_reg_token": true},
      "compression": {"schedule": "power", "d0": 4, "alpha": 0.7}      # flow-of-ranks, sec. 5
                  or {"schedule": "interp", "r1": 4, "rD": 32, "alpha": 0.5}   # App. K
                  or {"rank": 8}                                    # uniform
                  (+ "per_head": true, "rules": ["attn/(q|k|v|o)$"]) or null for dense,
      "reuse_weights": {"from": "dense_ckpt/model", "pattern": "^(input_patch_embedding|shared)"},
      "data": {"csv": "ETTh1.csv"} or {} (the built-in aeon series), "stride": 16,
      "train": {"steps": 600, "batch_size": 64, "learning_rate": 1e-3, "seed": 0,
                "eval_every": 100, "checkpoint_every": 100, "keep": 3}
    }

Outputs in ``--out``: ``checkpoints/`` (orbax; a rerun resumes from the latest),
``metrics.jsonl`` (one line per step, evaluation metrics every ``eval_every`` steps),
``model/`` (the final model checkpoint, factors kept) and ``summary.json``.
"""

from __future__ import annotations

import json
import os

import jax

_MODEL_DEFAULTS = dict(d_model=64, d_kv=16, d_ff=256, num_layers=4, num_decoder_layers=2,
                       num_heads=4, context_length=64, prediction_length=16, patch_size=8,
                       use_reg_token=True, feed_forward_proj="relu")
_TRAIN_DEFAULTS = dict(steps=600, batch_size=64, learning_rate=1e-3, seed=0, eval_every=100,
                       checkpoint_every=100, keep=3)
_SECTIONS = {"model", "compression", "reuse_weights", "data", "train"}


def _merge(section: str, given: dict | None, defaults: dict, path: str) -> dict:
    given = given or {}
    if not isinstance(given, dict):
        raise ValueError(f"{path}: section '{section}' must be an object, got {given!r}")
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"{path}: unknown keys in '{section}': {sorted(unknown)}; "
                         f"expected some of {sorted(defaults)}")
    return {**defaults, **given}


def load_train_config(path: str) -> dict:
    """Read and validate a training config file (clear errors name the file and the key)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"train: config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"train: {path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"train: {path} must hold a JSON object")
    unknown = set(cfg) - _SECTIONS
    if unknown:
        raise ValueError(f"{path}: unknown sections {sorted(unknown)}; expected {sorted(_SECTIONS)}")
    cfg["model"] = _merge("model", cfg.get("model"), _MODEL_DEFAULTS, path)
    cfg["train"] = _merge("train", cfg.get("train"), _TRAIN_DEFAULTS, path)
    cfg["data"] = cfg.get("data") or {}
    return cfg


def build_model_config(m: dict):
    from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
    from lowrank_jax.models.t5 import T5Config

    t5 = T5Config(vocab_size=2 if m["use_reg_token"] else 1, d_model=m["d_model"], d_kv=m["d_kv"],
                  d_ff=m["d_ff"], num_layers=m["num_layers"],
                  num_decoder_layers=m["num_decoder_layers"], num_heads=m["num_heads"],
                  feed_forward_proj=m["feed_forward_proj"])
    return ChronosBoltConfig(t5=t5, context_length=m["context_length"],
                             prediction_length=m["prediction_length"],
                             input_patch_size=m["patch_size"], input_patch_stride=m["patch_size"],
                             use_reg_token=m["use_reg_token"])


def _schedule(comp: dict, cfg, path: str):
    from lowrank_jax.compress import interpolation_schedule, power_schedule

    n = max(cfg.t5.num_layers, cfg.t5.num_decoder_layers or cfg.t5.num_layers)
    limit = cfg.t5.d_model
    kind = comp.get("schedule")
    try:
        if kind == "power":
            return power_schedule(comp["d0"], comp["alpha"], n, max_rank=limit), None
        if kind == "interp":
            return interpolation_schedule(comp["r1"], comp["rD"], comp["alpha"], n, max_rank=limit), None
    except KeyError as e:
        raise ValueError(f"{path}: compression schedule {kind!r} needs key {e}") from None
    if kind is None and "rank" in comp:
        return None, comp["rank"]
    raise ValueError(f"{path}: compression needs 'schedule': 'power' | 'interp', or 'rank'; got {comp}")


def run_train(config_path: str, out_dir: str, *, progress: bool = True) -> dict:
    """Train as the config says; returns the summary written to ``out_dir/summary.json``."""
    from lowrank_jax.compress import factorize_init, reuse_weights
    from lowrank_jax.io import load_model, save_model
    from lowrank_jax.models import family_of
    from lowrank_jax.train import (
        Checkpointer,
        WindowConfig,
        WindowSampler,
        default_series,
        evaluate_forecaster,
        fit,
        full_params,
        load_ett_csv,
    )

    c = load_train_config(config_path)
    cfg = build_model_config(c["model"])
    t = c["train"]
    if c["data"].get("csv"):
        names, values = load_ett_csv(c["data"]["csv"])
        series, source = [values[:, j] for j in range(values.shape[1])], c["data"]["csv"]
    else:
        series, source = default_series()
    wcfg = WindowConfig(context_length=cfg.context_length, horizon=cfg.prediction_length,
                        stride=int(c["data"].get("stride", cfg.prediction_length)))
    # Samplers are built (and bad windows rejected) before anything is compiled.
    train = WindowSampler(series, wcfg, split="train", batch_size=t["batch_size"], seed=t["seed"],
                          skip_short=True)
    val = WindowSampler(series, wcfg, split="val", batch_size=256, seed=t["seed"], skip_short=True)
    key = jax.random.PRNGKey(t["seed"])
    fam = family_of(cfg)
    params = fam.init(key, cfg)
    comp = c.get("compression")
    report = None
    if comp:
        sched, rank = _schedule(comp, cfg, config_path)
        kw = {"rules": tuple(comp["rules"])} if comp.get("rules") else {}
        params, report = factorize_init(params, key=jax.random.fold_in(key, 2), schedule=sched,
                                        rank=rank, per_head=bool(comp.get("per_head")), **kw)
        print(f"compressed by design: {'schedule ' + str(sched) if sched else f'rank {rank}'}, "
              f"attention size ratio {report.ratio:.3f}")
    if c.get("reuse_weights"):
        r = c["reuse_weights"]
        _, pretrained = load_model(r["from"])
        params = reuse_weights(params, pretrained, r.get("pattern", r"^(input_patch_embedding|shared)"))
    os.makedirs(out_dir, exist_ok=True)
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), max_to_keep=t["keep"])
    if ckpt.latest_step() is not None:
        print(f"resuming from step {ckpt.latest_step()} in {out_dir}/checkpoints")
    state, history = fit(
        fam.loss(cfg), params, train, steps=t["steps"], key=jax.random.fold_in(key, 1),
        batch_fn=lambda w: fam.batch_from_windows(cfg, w["context"], w["target"]),
        learning_rate=t["learning_rate"], checkpointer=ckpt, checkpoint_every=t["checkpoint_every"],
        eval_fn=lambda p: evaluate_forecaster(cfg, p, val, max_batches=4), eval_every=t["eval_every"],
        log_path=os.path.join(out_dir, "metrics.jsonl"), progress=progress, desc="train")
    params = full_params(state)
    ckpt.wait_until_finished()
    save_model(os.path.join(out_dir, "model"), cfg, params,
               metadata={"config_file": os.path.abspath(config_path), "data": source},
               overwrite=True)
    summary = {
        "steps": t["steps"], "data": source,
        "final_loss": history[-1]["loss"] if history else None,
        "eval": {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("eval_")},
        "compression": report.to_dict() if report else None,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    print(f"trained {t['steps']} steps: final loss {summary['final_loss']}, model saved to "
          f"{out_dir}/model, metrics in {out_dir}/metrics.jsonl")
    return summary

