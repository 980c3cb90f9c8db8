"""Sparse binary transformers ("Sparse Binary Transformers for Multivariate Time Series
Modeling", arXiv:2308.04637): dense vs SBT on the three tasks over seeds, the paper-convention
FLOP and bit ratios (Table 6 rules), and, for a trained JapaneseVowels SBT, the measured stored
size of its packed form against float32 and its inference time (float masked-binary leaves vs
packed leaves vs the dense model), timed interleaved in one run and reported as ratios.

    python -m benchmarks.models sbt --json out.json            # the figures of docs/methods/sparse_binary.md
    python -m benchmarks.models sbt --quick --json quick.json  # a smoke run (about a minute)
    python -m benchmarks.models sbt --tasks classify --seeds 3 --json cls.json
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness as H
from lowrank_jax.analysis import sbt_accounting as acc
from lowrank_jax.io import save_model
from lowrank_jax.leaves import (
    Dense,
    MaskedBinary,
    PackedBinary,
    materialize,
    pack_binary_tree,
    storage_bits,
)
from lowrank_jax.models import sbt
from lowrank_jax.recipes import sbt_tasks as tasks


def dir_bytes(path: str, sub: str | None = None) -> int:
    root = os.path.join(path, sub) if sub else path
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1
            else 0.0, "min": min(values), "max": max(values), "values": values}


def log(msg: str) -> None:
    print(f"[sbt-bench] {msg}", file=sys.stderr, flush=True)


def classification(args, out):
    res = {}
    for ds in args.cls_datasets:
        data = tasks.load_classification_data(ds)
        rows = {}
        for label, binary, keep, epochs in (("dense", False, 1.0, args.dense_epochs),
                                            ("sbt_p0.5", True, 0.5, args.sbt_epochs),
                                            ("sbt_p0.75", True, 0.25, args.sbt_epochs)):
            accs = []
            for seed in range(args.seeds):
                t0 = time.perf_counter()
                r = tasks.run_classification(ds, binary=binary, keep=keep, seed=seed,
                                             epochs=epochs, data=data)
                accs.append(r.metrics["accuracy"])
                log(f"{ds} {label} seed {seed}: accuracy {accs[-1]:.4f} "
                    f"({time.perf_counter() - t0:.0f} s)")
                if ds == "JapaneseVowels" and seed == 0 and label in ("dense", "sbt_p0.5"):
                    out.setdefault("_models", {})[label] = r
            rows[label] = {"epochs": epochs, "accuracy": spread(accs)}
        rows["gap_dense_minus_sbt_p0.5_points"] = 100 * (
            rows["dense"]["accuracy"]["mean"] - rows["sbt_p0.5"]["accuracy"]["mean"])
        res[ds] = rows
    return res


def anomaly(args):
    res = {}
    for ds in args.ad_datasets:
        data = tasks.load_anomaly_data(ds)
        rows = {}
        for label, binary, keep in (("dense", False, 1.0), ("sbt_p0.75", True, 0.25)):
            f1q, f1p, mse = [], [], []
            for seed in range(args.seeds):
                r = tasks.run_anomaly(ds, binary=binary, keep=keep, seed=seed,
                                      epochs=args.ad_epochs, window=args.window, data=data)
                f1q.append(r.metrics["quantile"]["f1"])
                f1p.append(r.metrics["pot"]["f1"])
                mse.append(r.metrics["test_mse"])
                log(f"{ds} {label} seed {seed}: F1 quantile {f1q[-1]:.3f} POT {f1p[-1]:.3f}")
            rows[label] = {"f1_quantile": spread(f1q), "f1_pot": spread(f1p),
                           "test_score_mean": spread(mse)}
        res[ds] = rows
    return res


def forecast(args):
    res = {}
    data = tasks.load_forecast_data("daphnet")
    rows = {}
    for label, binary, keep in (("dense", False, 1.0), ("sbt_p0.5", True, 0.5),
                                ("sbt_p0.75", True, 0.25)):
        mse, mae = [], []
        for seed in range(args.seeds):
            r = tasks.run_forecast("daphnet", binary=binary, keep=keep, seed=seed,
                                   epochs=args.fc_epochs, window=args.window, data=data,
                                   max_train_windows=args.max_windows)
            mse.append(r.metrics["mse"])
            mae.append(r.metrics["mae"])
            naive = r.metrics["naive_mse"]
            log(f"daphnet {label} seed {seed}: MSE {mse[-1]:.4f} MAE {mae[-1]:.4f}")
        rows[label] = {"mse": spread(mse), "mae": spread(mae)}
    rows["naive_last_value_mse"] = naive
    res["daphnet"] = rows
    return res


def storage_and_time(models: dict, repeats: int):
    """Stored size (files written by lowrank_jax.io) and interleaved inference timing."""
    dense, sbt_run = models["dense"], models["sbt_p0.5"]
    cfg_s, cfg_d = sbt_run.config, dense.config
    packed = pack_binary_tree(sbt_run.params)
    # the same trained SBT with every binary weight stored as a float32 Dense matrix
    as_float = jax.tree_util.tree_map(
        lambda x: Dense(jnp.asarray(materialize(x), jnp.float32), x.bias)
        if isinstance(x, (MaskedBinary, PackedBinary)) else x, sbt_run.params,
        is_leaf=lambda x: isinstance(x, (MaskedBinary, PackedBinary)))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, cfg, params, state in (("dense_float32", cfg_d, dense.params, dense.state),
                                         ("sbt_as_float32", cfg_s, as_float, sbt_run.state),
                                         ("sbt_masked_float", cfg_s, sbt_run.params,
                                          sbt_run.state),
                                         ("sbt_packed", cfg_s, packed, sbt_run.state)):
            p = os.path.join(tmp, name)
            save_model(p, cfg, params, state=state)
            paths[name] = p
            out[f"{name}_bytes"] = dir_bytes(p)
            out[f"{name}_array_bytes"] = dir_bytes(p, "arrays")
    # float32 weights of the same SBT architecture (what a binary layer replaces): 32 bits per
    # weight position of every binarized linear
    counts = acc.model_counts(sbt_run.params, cfg_s)
    out["counts_sbt"] = counts
    out["counts_dense"] = acc.model_counts(dense.params, cfg_d)
    out["counts_sbt_as_float32_bits"] = int(storage_bits(as_float))
    for ref in ("dense_float32", "sbt_as_float32"):
        out[f"file_ratio_{ref}_over_packed"] = out[f"{ref}_bytes"] / out["sbt_packed_bytes"]
        out[f"array_ratio_{ref}_over_packed"] = (out[f"{ref}_array_bytes"]
                                                 / out["sbt_packed_array_bytes"])
    out["bits_ratio_sbt_as_float32_over_packed"] = (out["counts_sbt_as_float32_bits"]
                                                    / counts["packed_bits"])
    # the binarized weights alone: float32 positions vs their two bit planes (padding included)
    bin_leaves = [x for x in jax.tree_util.tree_leaves(
        packed, is_leaf=lambda x: isinstance(x, PackedBinary)) if isinstance(x, PackedBinary)]
    w32 = sum(32 * x.d_in * x.d_out for x in bin_leaves)
    wpk = sum(storage_bits(x) for x in bin_leaves)
    out["binary_weights_float32_bits"], out["binary_weights_packed_bits"] = w32, wpk
    out["binary_weights_ratio"] = w32 / wpk

    data = tasks.load_classification_data("JapaneseVowels")
    x, v = jnp.asarray(data["x_test"]), jnp.asarray(data["valid_test"])

    def fwd(cfg):
        return jax.jit(lambda p, s, x, v: sbt.apply(p, {"x": x, "valid": v}, cfg, state=s)[
            "logits"])

    f_s, f_d = fwd(cfg_s), fwd(cfg_d)
    runs = {"sbt_masked_float": (f_s, sbt_run.params, sbt_run.state),
            "sbt_packed": (f_s, packed, sbt_run.state),
            "dense": (f_d, dense.params, dense.state)}
    outs = {k: np.asarray(f(p, s, x, v)) for k, (f, p, s) in runs.items()}
    out["packed_equals_float_exactly"] = bool(np.array_equal(outs["sbt_packed"],
                                                             outs["sbt_masked_float"]))
    m = H.measure({k: (lambda f=f, p=p, s=s: f(p, s, x, v)) for k, (f, p, s) in runs.items()},
                  runs=repeats, warmup=0)
    med = {k: m.timings.median(k) for k in runs}
    out["inference_other_load"] = m.load
    out["inference_median_s"] = med
    out["time_ratio_packed_over_masked_float"] = med["sbt_packed"] / med["sbt_masked_float"]
    out["time_ratio_packed_over_dense"] = med["sbt_packed"] / med["dense"]
    out["time_batch"] = int(x.shape[0])
    return out


def result_rows(out: dict) -> list[dict]:
    """One row per task, dataset and model: the mean and spread of each metric over seeds."""
    rows = []
    for task in ("classification", "anomaly", "forecast"):
        for ds, models in out.get(task, {}).items():
            for model, metrics in models.items():
                if not isinstance(metrics, dict):
                    continue
                row = {"task": task, "dataset": ds, "model": model}
                for k, v in metrics.items():
                    if isinstance(v, dict) and "mean" in v:
                        row[k] = v["mean"]
                        row[f"{k}_std"] = v["std"]
                rows.append(row)
    return rows


def main(argv=None):
    ap = H.parser(__doc__, quick="tiny settings (smoke run)")
    ap.add_argument("--tasks", default="classify,anomaly,forecast")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--dense-epochs", type=int, default=50)
    ap.add_argument("--sbt-epochs", type=int, default=150)
    ap.add_argument("--ad-epochs", type=int, default=15)
    ap.add_argument("--fc-epochs", type=int, default=15)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--max-windows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--datasets", help="comma-separated subset of JapaneseVowels, BasicMotions, "
                    "kdd135, ecg (default: all of the chosen tasks')")
    args = ap.parse_args(argv)
    args.cls_datasets = ["JapaneseVowels", "BasicMotions"]
    args.ad_datasets = ["kdd135", "ecg"]
    if args.datasets:
        chosen = [d.strip() for d in args.datasets.split(",") if d.strip()]
        known = args.cls_datasets + args.ad_datasets
        unknown = [d for d in chosen if d not in known]
        if unknown:
            ap.error(f"--datasets: unknown {unknown}; expected some of {known}")
        args.cls_datasets = [d for d in args.cls_datasets if d in chosen]
        args.ad_datasets = [d for d in args.ad_datasets if d in chosen]
    if args.quick:
        args.seeds, args.dense_epochs, args.sbt_epochs = 1, 3, 3
        args.ad_epochs = args.fc_epochs = 2
        args.window, args.max_windows, args.repeats = 20, 300, 5
        args.cls_datasets, args.ad_datasets = ["JapaneseVowels"], ["kdd135"]
    wanted = set(args.tasks.split(","))
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    run = H.Run(__name__, argv, settings=settings)
    out = {"settings": settings, "backend": jax.default_backend()}
    holder = {}
    if "classify" in wanted:
        out["classification"] = classification(args, holder)
    if "anomaly" in wanted:
        out["anomaly"] = anomaly(args)
    if "forecast" in wanted:
        out["forecast"] = forecast(args)
    out["paper_accounting"] = {n: {**acc.table6_row(n)["exact"],
                                   "note": acc.TABLE6_NOTES.get(n)}
                               for n in acc.TABLE6_CONFIGS}
    goals = {}
    if "_models" in holder:
        si = storage_and_time(holder["_models"], args.repeats)
        out["storage_and_inference"] = si
        goals.update(H.goal(
            "trained SBT (JapaneseVowels): float32 weights' bits / packed bits (binarized "
            "weights)", si["binary_weights_ratio"], measured=f"{si['binary_weights_ratio']:.1f}x"))
        goals.update(H.goal(
            "trained SBT (JapaneseVowels): packed / float masked-binary inference time",
            si["time_ratio_packed_over_masked_float"],
            measured=f"{si['time_ratio_packed_over_masked_float']:.2f} (packed / dense "
                     f"{si['time_ratio_packed_over_dense']:.2f}); outputs equal: "
                     f"{si['packed_equals_float_exactly']}"))
    rows = result_rows(out)
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    out["seconds"] = round(time.perf_counter() - run.t0, 1)
    return run.finish(args.json, rows=rows, goals=goals, **out)


TABLE = H.Table(
    H.Col("task", "task", width=14), H.Col("dataset", "dataset", width=14),
    H.Col("model", "model", width=10), H.Col("accuracy", "accuracy", ".4f"),
    H.Col("F1 quantile", "f1_quantile", ".3f"), H.Col("F1 POT", "f1_pot", ".3f"),
    H.Col("MSE", "mse", ".4f", 8), H.Col("MAE", "mae", ".4f", 8))


if __name__ == "__main__":
    H.run_as_main(__spec__)
