"""The three tasks of "Sparse Binary Transformers for Multivariate Time Series Modeling"
(Gorbett et al., KDD 2023, arXiv:2308.04637, sec. 4) end to end on real data shipped with aeon.

* :func:`run_classification`: UEA JapaneseVowels (padded to 29 steps) or BasicMotions;
  accuracy on the test split.
* :func:`run_anomaly`: a univariate labelled series (``kdd135``: aeon's UCR/KDD-cup series 135;
  ``ecg``: aeon's ECG ``diff_count_3`` semi-supervised series); the model reconstructs the last
  step of each sliding window (step-T mask), the score is its MSE, thresholds by a fixed
  quantile and by POT, precision / recall / F1 with point adjustment.
* :func:`run_forecast`: single-step forecasting (last step zeroed and reconstructed) of the
  9-channel Daphnet series, split by time; MSE / MAE on standardized values.

Training follows the paper's code where it is stated (Adam 1e-3, classification batch 8 with
grad-norm clipping 4.0, anomaly / forecast batch 128 and the last-step MSE). Choices made
where the paper leaves it open, or where its code does something users would not expect:

* Classification reports the test accuracy after the last epoch (the code prints test accuracy
  every epoch and selects nothing; choosing the best test epoch would be optimistic).
* Anomaly / forecast keep the parameters of the epoch with the lowest *validation* loss (the
  last 20% of the anomaly-free training series, resp. a time split), with early stopping after
  ``patience`` epochs; the code's StepLR is not used. The code picks the forecasting checkpoint
  on training loss and, for MSL/SMAP, validates on the test set.
* Anomaly thresholds are fixed before the test scores are seen: the quantile threshold is the
  ``1 - r`` quantile of validation scores (the paper's text; its code pools train, validation
  and *test* scores), POT is fitted on training + validation scores (the paper's text).
* Test windows start at the first step with ``w - 1`` steps of history; the first ``w - 1``
  test points are preceded by the last training points (the test series of these datasets
  continues the training series), so every test point gets a score.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.analysis import anomaly as ad
from lowrank_jax.errors import ConfigError, DataError
from lowrank_jax.models import sbt
from lowrank_jax.train import full_params, init_train_state, make_train_step

CLASSIFICATION = ("JapaneseVowels", "BasicMotions")
ANOMALY = ("kdd135", "ecg")
FORECAST = ("daphnet",)
DATASETS = {"classify": CLASSIFICATION, "anomaly": ANOMALY, "forecast": FORECAST}


# ---------------------------------------------------------------------------------------------
# Data (aeon ships these files; nothing is downloaded or cached).

def _quiet_aeon():
    import warnings

    warnings.filterwarnings("ignore", module="aeon")


def _check_name(name: str, known: tuple[str, ...], what: str) -> None:
    if name not in known:
        raise ConfigError(f"unknown {what} dataset {name!r}; available offline: {list(known)}",
                          where="dataset", expected=list(known), actual=name)


def load_classification_data(name: str) -> dict:
    """UEA data as ``{'x_train' [n, w, m], 'valid_train' [n, w], 'y_train', 'x_test',
    'valid_test', 'y_test', 'classes', 'lengths'}``: z-scored per feature with the training
    statistics (over real steps), padded with zeros (the mean) after each series to the
    longest length of either split (JapaneseVowels: 29)."""
    _check_name(name, CLASSIFICATION, "classification")
    _quiet_aeon()
    from aeon.datasets import load_classification

    splits = {s: load_classification(name, split=s) for s in ("train", "test")}
    classes = sorted(set(np.asarray(splits["train"][1]).tolist()))
    series = {s: [np.asarray(a, np.float64).T for a in splits[s][0]] for s in splits}  # [t, m]
    w = max(len(a) for s in series for a in series[s])
    flat = np.concatenate(series["train"], axis=0)
    mu, sd = flat.mean(0), flat.std(0) + 1e-8
    out = {"classes": classes, "window": w}
    for s in ("train", "test"):
        n, m = len(series[s]), series[s][0].shape[1]
        x = np.zeros((n, w, m), np.float32)
        valid = np.zeros((n, w), bool)
        for i, a in enumerate(series[s]):
            x[i, : len(a)] = (a - mu) / sd
            valid[i, : len(a)] = True
        y = np.asarray([classes.index(v) for v in np.asarray(splits[s][1]).tolist()], np.int32)
        out.update({f"x_{s}": x, f"valid_{s}": valid, f"y_{s}": y})
    return out


def load_anomaly_data(name: str) -> dict:
    """``{'train' [T, 1], 'test' [T', 1], 'labels' [T'] bool}``, z-scored with the training
    statistics."""
    _check_name(name, ANOMALY, "anomaly")
    _quiet_aeon()
    if name == "kdd135":
        from aeon.datasets import load_kdd_tsad_135

        train, _ = load_kdd_tsad_135(split="train")
        test, labels = load_kdd_tsad_135(split="test")
    else:
        from aeon.datasets import load_ecg_diff_count_3

        # aeon returns (X_test, y_test, X_train, y_train); the training series has no anomalies
        test, labels, train, _ = load_ecg_diff_count_3("semi-supervised")
    train = np.asarray(train, np.float64).reshape(len(train), -1)
    test = np.asarray(test, np.float64).reshape(len(test), -1)
    mu, sd = train.mean(0), train.std(0) + 1e-8
    return {"train": ((train - mu) / sd).astype(np.float32),
            "test": ((test - mu) / sd).astype(np.float32),
            "labels": np.asarray(labels).astype(bool).reshape(-1)}


def load_forecast_data(name: str) -> dict:
    """The 9-channel Daphnet series (aeon ``load_daphnet_s06r02e0``) split by time 70/10/20,
    z-scored with the training statistics: ``{'train', 'val', 'test'}`` each ``[T, 9]``."""
    _check_name(name, FORECAST, "forecasting")
    _quiet_aeon()
    from aeon.datasets import load_daphnet_s06r02e0

    x, _ = load_daphnet_s06r02e0()
    x = np.asarray(x, np.float64)
    n = len(x)
    a, b = int(0.7 * n), int(0.8 * n)
    mu, sd = x[:a].mean(0), x[:a].std(0) + 1e-8
    z = ((x - mu) / sd).astype(np.float32)
    return {"train": z[:a], "val": z[a:b], "test": z[b:]}


def sliding_windows(series: np.ndarray, w: int) -> np.ndarray:
    """All windows ``[T - w + 1, w, m]`` of a ``[T, m]`` series (a copy)."""
    if len(series) < w:
        raise DataError(f"sliding_windows: series of {len(series)} steps is shorter than the "
                        f"window {w}", where="window", expected=f"<= {len(series)}", actual=w)
    return np.lib.stride_tricks.sliding_window_view(series, w, axis=0).transpose(0, 2, 1).copy()


# ---------------------------------------------------------------------------------------------
# Training.

@dataclasses.dataclass
class RunResult:
    """One trained model and what was measured on it."""

    task: str
    dataset: str
    config: sbt.SBTConfig
    seed: int
    params: Any
    state: Any
    metrics: dict
    history: list
    extra: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        return {"task": self.task, "dataset": self.dataset, "seed": self.seed,
                "binary": self.config.binary, "keep": self.config.keep,
                "prune": round(1.0 - self.config.keep, 6), "metrics": self.metrics,
                "history": self.history}


def _batches(n: int, batch: int, rng: np.random.Generator):
    """Index batches of one epoch: a permutation cut into ``ceil(n / batch)`` batches, the
    last one topped up with random other indices (static shapes: one compiled step)."""
    perm = rng.permutation(n)
    k = max(1, math.ceil(n / batch))
    pad = k * batch - n
    if pad:
        perm = np.concatenate([perm, rng.choice(n, pad, replace=n < pad)])
    return perm.reshape(k, batch)


def make_predict(cfg: sbt.SBTConfig, chunk: int = 512) -> Callable:
    """``predict(params, state, x, valid=None) -> np.ndarray`` of the primary output (eval
    mode), jitted once per chunk size; inputs are run in chunks of ``chunk`` (the last one
    padded)."""

    @jax.jit
    def fwd(params, state, x, valid):
        inputs = {"x": x} if valid is None else {"x": x, "valid": valid}
        out = sbt.apply(params, inputs, cfg, state=state, train=False)
        return out["logits"] if cfg.task == "classification" else out["reconstruction"][:, -1]

    def predict(params, state, x, valid=None):
        n = len(x)
        c = min(chunk, n)
        outs = []
        for i in range(0, n, c):
            xb = x[i:i + c]
            vb = None if valid is None else valid[i:i + c]
            k = len(xb)
            if k < c:
                xb = np.concatenate([xb, np.zeros((c - k,) + xb.shape[1:], xb.dtype)])
                if vb is not None:
                    vb = np.concatenate([vb, np.ones((c - k,) + vb.shape[1:], bool)])
            outs.append(np.asarray(fwd(params, state, jnp.asarray(xb),
                                       None if vb is None else jnp.asarray(vb)))[:k])
        return np.concatenate(outs)

    return predict


def _progress(cb, **kw):
    if cb is not None:
        cb(kw)


def _train(cfg: sbt.SBTConfig, seed: int, data: dict, *, epochs: int, batch: int, lr: float,
           clip: float | None, evaluate: Callable, select: str | None, patience: int | None,
           progress: Callable | None):
    """Shared epoch loop: ``data`` has ``'x'`` (and ``'valid'``, ``'y'``) training arrays.

    ``evaluate(params, state) -> dict`` runs after every epoch; with ``select`` (a key of that
    dict, lower is better) the best epoch's parameters are kept and training stops after
    ``patience`` epochs without improvement."""
    params = sbt.init(jax.random.PRNGKey(seed), cfg)
    state0 = sbt.init_state(params, cfg)
    opt = optax.chain(optax.clip_by_global_norm(clip), optax.adam(lr)) if clip else optax.adam(lr)
    step = make_train_step(sbt.loss(cfg), opt, stateful=cfg.stateful)
    ts = init_train_state(params, opt, key=jax.random.PRNGKey(seed + 1), model_state=state0)
    rng = np.random.default_rng(seed)
    n = len(data["x"])
    history, best, best_val, since = [], None, np.inf, 0
    t0 = time.perf_counter()
    for ep in range(epochs):
        losses, accs = [], []
        for idx in _batches(n, batch, rng):
            b = {k: jnp.asarray(v[idx]) for k, v in data.items()}
            ts, m = step(ts, b)
            losses.append(m["loss"])
            if "accuracy" in m:
                accs.append(m["accuracy"])
        rec = {"epoch": ep + 1, "train_loss": float(np.mean(jax.device_get(losses)))}
        if accs:
            rec["train_accuracy"] = float(np.mean(jax.device_get(accs)))
        p, s = full_params(ts), ts.model_state
        rec.update(evaluate(p, s))
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        history.append(rec)
        _progress(progress, **rec, epochs=epochs)
        if select is not None:
            if rec[select] < best_val:
                best_val, since = rec[select], 0
                best = (jax.tree_util.tree_map(np.asarray, p),
                        jax.tree_util.tree_map(np.asarray, s))
            else:
                since += 1
                if patience is not None and since >= patience:
                    break
    if select is not None and best is not None:
        return best[0], best[1], history
    return full_params(ts), ts.model_state, history


def _check_epochs(epochs, batch):
    for name, v in (("epochs", epochs), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}", where=name,
                              expected=">= 1", actual=v)


def run_classification(dataset: str = "JapaneseVowels", *, binary: bool = True,
                       keep: float = 0.5, seed: int = 0, epochs: int | None = None,
                       batch: int = 8, lr: float = 1e-3, d_model: int = 32,
                       num_heads: int = 2, d_ff: int = 256, num_layers: int = 2,
                       data: dict | None = None, progress: Callable | None = None) -> RunResult:
    """Train and test a classifier (paper sec. 4.1). Default epochs: the code's (SBT 250,
    dense 50 on JapaneseVowels)."""
    data = data or load_classification_data(dataset)
    epochs = epochs if epochs is not None else (250 if binary else 50)
    _check_epochs(epochs, batch)
    m = data["x_train"].shape[2]
    cfg = sbt.SBTConfig(n_features=m, window=data["window"], task="classification",
                        n_classes=len(data["classes"]), d_model=d_model, num_heads=num_heads,
                        d_ff=d_ff, num_layers=num_layers, binary=binary, keep=keep,
                        mask_seed=seed)
    predict = make_predict(cfg)

    def evaluate(p, s):
        logits = predict(p, s, data["x_test"], data["valid_test"])
        return {"test_accuracy": float(np.mean(logits.argmax(-1) == data["y_test"]))}

    train = {"x": data["x_train"], "valid": data["valid_train"], "y": data["y_train"]}
    params, state, hist = _train(cfg, seed, train, epochs=epochs, batch=batch, lr=lr, clip=4.0,
                                 evaluate=evaluate, select=None, patience=None,
                                 progress=progress)
    return RunResult("classify", dataset, cfg, seed, params, state,
                     {"accuracy": hist[-1]["test_accuracy"]}, hist)


def _regression_split(train: np.ndarray, w: int, val_frac: float = 0.2):
    cut = int(len(train) * (1 - val_frac))
    return sliding_windows(train[:cut], w), sliding_windows(train[cut - w + 1:], w)


def run_anomaly(dataset: str = "kdd135", *, binary: bool = True, keep: float = 0.75,
                seed: int = 0, epochs: int = 50, batch: int = 128, lr: float = 1e-3,
                window: int = 50, d_model: int = 32, num_heads: int = 2, d_ff: int = 256,
                num_layers: int = 2, patience: int = 5, r: float = 0.01, pot_q: float = 1e-3,
                pot_level: float = 0.98, data: dict | None = None,
                progress: Callable | None = None) -> RunResult:
    """Train on the anomaly-free training series, score every test point by the MSE of its
    reconstruction from the ``window - 1`` steps before it, and evaluate the quantile and POT
    thresholds with point adjustment (paper sec. 4.2)."""
    data = data or load_anomaly_data(dataset)
    _check_epochs(epochs, batch)
    m = data["train"].shape[1]
    cfg = sbt.SBTConfig(n_features=m, window=window, task="anomaly", d_model=d_model,
                        num_heads=num_heads, d_ff=d_ff, num_layers=num_layers, binary=binary,
                        keep=keep, mask_seed=seed)
    predict = make_predict(cfg)
    x_tr, x_val = _regression_split(data["train"], window)

    def scores(p, s, x):
        return np.mean(np.square(predict(p, s, x) - x[:, -1]), axis=-1)

    def evaluate(p, s):
        return {"val_mse": float(np.mean(scores(p, s, x_val)))}

    params, state, hist = _train(cfg, seed, {"x": x_tr}, epochs=epochs, batch=batch, lr=lr,
                                 clip=None, evaluate=evaluate, select="val_mse",
                                 patience=patience, progress=progress)
    full = np.concatenate([data["train"][-(window - 1):], data["test"]])
    x_te = sliding_windows(full, window)
    s_te = scores(params, state, x_te)
    s_tr, s_val = scores(params, state, x_tr), scores(params, state, x_val)
    q_thr = ad.quantile_threshold(s_val, r)
    pot = ad.pot_threshold(np.concatenate([s_tr, s_val]), q=pot_q, level=pot_level)
    labels = data["labels"]
    metrics = {"quantile": ad.evaluate_threshold(s_te, labels, q_thr),
               "pot": {**ad.evaluate_threshold(s_te, labels, pot["threshold"]),
                       "gamma": pot["gamma"], "sigma": pot["sigma"]},
               "test_mse": float(np.mean(s_te)),
               "best_val_mse": float(min(h["val_mse"] for h in hist))}
    return RunResult("anomaly", dataset, cfg, seed, params, state, metrics, hist,
                     extra={"scores": s_te, "labels": labels, "test": data["test"],
                            "thresholds": {"quantile": q_thr, "pot": pot["threshold"]}})


def run_forecast(dataset: str = "daphnet", *, binary: bool = True, keep: float = 0.5,
                 seed: int = 0, epochs: int = 30, batch: int = 128, lr: float = 1e-3,
                 window: int = 50, d_model: int = 32, num_heads: int = 2, d_ff: int = 256,
                 num_layers: int = 2, patience: int = 5, max_train_windows: int | None = None,
                 data: dict | None = None, progress: Callable | None = None) -> RunResult:
    """Single-step forecasting (paper sec. 4.3): the last step of each window is zeroed and
    reconstructed; MSE / MAE of that step on the standardized test split."""
    data = data or load_forecast_data(dataset)
    _check_epochs(epochs, batch)
    m = data["train"].shape[1]
    cfg = sbt.SBTConfig(n_features=m, window=window, task="forecast", d_model=d_model,
                        num_heads=num_heads, d_ff=d_ff, num_layers=num_layers, binary=binary,
                        keep=keep, mask_seed=seed)
    predict = make_predict(cfg)
    x_tr = sliding_windows(data["train"], window)
    if max_train_windows is not None and len(x_tr) > max_train_windows:
        x_tr = x_tr[:: math.ceil(len(x_tr) / max_train_windows)]
    x_val = sliding_windows(np.concatenate([data["train"][-(window - 1):], data["val"]]), window)
    x_te = sliding_windows(np.concatenate([data["val"][-(window - 1):], data["test"]]), window)

    def evaluate(p, s):
        return {"val_mse": float(np.mean(np.square(predict(p, s, x_val) - x_val[:, -1])))}

    params, state, hist = _train(cfg, seed, {"x": x_tr}, epochs=epochs, batch=batch, lr=lr,
                                 clip=None, evaluate=evaluate, select="val_mse",
                                 patience=patience, progress=progress)
    pred = predict(params, state, x_te)
    err = pred - x_te[:, -1]
    metrics = {"mse": float(np.mean(np.square(err))), "mae": float(np.mean(np.abs(err))),
               "naive_mse": float(np.mean(np.square(x_te[:, -2] - x_te[:, -1]))),
               "best_val_mse": float(min(h["val_mse"] for h in hist))}
    return RunResult("forecast", dataset, cfg, seed, params, state, metrics, hist,
                     extra={"prediction": pred, "target": x_te[:, -1]})


RUNNERS = {"classify": run_classification, "anomaly": run_anomaly, "forecast": run_forecast}

__all__ = ["ANOMALY", "CLASSIFICATION", "DATASETS", "FORECAST", "RUNNERS", "RunResult",
           "load_anomaly_data", "load_classification_data", "load_forecast_data",
           "make_predict", "run_anomaly", "run_classification", "run_forecast",
           "sliding_windows"]
