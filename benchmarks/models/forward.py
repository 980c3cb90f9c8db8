"""Chronos-Bolt forward: JAX against PyTorch ``chronos-forecasting``, and compressed against dense.

One process, one interleaved timing loop:

* the reference ``chronos.chronos_bolt.ChronosBoltModelForForecasting`` (PyTorch eager,
  ``inference_mode``), randomly initialised with a chronos-bolt-base-sized T5 config (d_model 768,
  d_kv 64, 12 heads, d_ff 3072, ReLU, 12 encoder + 12 decoder layers), context 512, patch 16,
  64-step horizon, 9 quantiles, ``[REG]`` token; batch 32;
* the same model converted with ``lowrank_jax.convert.load_pretrained(module)``, under
  ``jax.jit`` (parameters are an argument of the jitted function, not folded constants);
* that JAX model compressed with ``lowrank_jax.compress.compress(params, eps=eps)`` (default
  rules: attention q/k/v/o of encoder self-, decoder self- and cross-attention; a matrix whose
  factors would be larger stays dense) for each ``--eps``.

Synthetic spectra (stand-in for trained weights). No pretrained weights are available here, and a
random matrix has a flat spectrum, so an eps-truncation would keep (nearly) everything. The paper
(Fig. 4) reports that trained TSFM attention weights are low-rank; as a documented stand-in every
attention matrix W (q/k/v/o, all three attention kinds) is replaced, in the PyTorch module before
conversion, by ``U diag(s) V^T`` with the singular vectors of the random W and
``s_j = s_1 exp(-j / tau)``, ``tau = min(d_in, d_out) / --tau-div`` (default 8, i.e. d/8). The
PyTorch model, the dense JAX model and every compressed model share these weights. The eps-rank
of such a matrix is about ``tau * ln(1 / eps) + 1``.

Threads: PyTorch gets ``torch.set_num_threads(N)``. XLA:CPU (jax 0.10) has no intra-op
thread-count flag (``intra_op_parallelism_threads`` is a TensorFlow option; XLA rejects unknown
flags); its thread pool is sized from the CPUs the process may run on, so the process is pinned
to N CPUs with ``os.sched_setaffinity`` before jax is imported, and ``XLA_FLAGS`` gets
``--xla_cpu_multi_thread_eigen=true`` (the default, stated explicitly). ``N`` defaults to the
CPUs available to the process.

Every figure is the median of ``--runs`` calls after warm-up; within each run all models are
called once, the order reversed on every other run. The CPU share other processes used meanwhile
is printed next to the figures: on a shared machine only the ratios of one run mean anything.

Usage::

    python -m benchmarks.models forward             # base config, batch 32, eps 0.01 0.05 0.1
    python -m benchmarks.models forward --quick     # small config, 3 runs: a smoke test
    python -m benchmarks.models forward --json out.json --runs 9 --threads 2
"""

from __future__ import annotations

import os
import sys
import time

from benchmarks import _harness as H

QUANTILES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
SPEEDUP_GOAL = 2.0  # JAX at least 2x faster than PyTorch eager
TIME_FLOP_GOAL = 1.2  # compressed time ratio within 1.2x of its FLOP ratio

#: chronos-bolt-base's T5 config (amazon/chronos-bolt-base: T5-efficient style, ReLU MLP).
BASE = dict(d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12,
            num_decoder_layers=12, feed_forward_proj="relu", context_length=512,
            input_patch_size=16, prediction_length=64, batch=32)
QUICK = dict(d_model=256, d_kv=32, num_heads=8, d_ff=1024, num_layers=4,
             num_decoder_layers=4, feed_forward_proj="relu", context_length=256,
             input_patch_size=16, prediction_length=64, batch=8)


# -- machine ---------------------------------------------------------------------------------

def _set_threads(n: int) -> str:
    """Pin this process to ``n`` CPUs and set the XLA flag, before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("benchmarks.models: threads must be set before jax is imported")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus:
        if n > len(cpus):
            raise SystemExit(f"--threads {n}: only {len(cpus)} CPUs are available")
        os.sched_setaffinity(0, cpus[:n])
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        flags = (flags + " --xla_cpu_multi_thread_eigen=true").strip()
    os.environ["XLA_FLAGS"] = flags
    # PyTorch's OpenMP workers otherwise busy-wait after each parallel region and take the
    # cores from the XLA call that follows in the interleaved loop (and vice versa).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return flags


# -- models ----------------------------------------------------------------------------------

def build_reference(c: dict, seed: int):
    """Randomly initialised (HF T5 init) ``ChronosBoltModelForForecasting`` in eval mode."""
    import torch
    import transformers
    from chronos import chronos_bolt as bolt_ref

    torch.manual_seed(seed)
    hf_cfg = transformers.T5Config(
        d_model=c["d_model"], d_kv=c["d_kv"], d_ff=c["d_ff"], num_layers=c["num_layers"],
        num_decoder_layers=c["num_decoder_layers"], num_heads=c["num_heads"],
        feed_forward_proj=c["feed_forward_proj"], dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, architectures=["ChronosBoltModelForForecasting"],
        chronos_config=dict(context_length=c["context_length"],
                            prediction_length=c["prediction_length"],
                            input_patch_size=c["input_patch_size"],
                            input_patch_stride=c["input_patch_size"], quantiles=QUANTILES,
                            use_reg_token=True))
    return bolt_ref.ChronosBoltModelForForecasting(hf_cfg).eval()


ATTN_SUFFIXES = tuple(f"{kind}.{m}.weight" for kind in ("SelfAttention", "EncDecAttention")
                      for m in "qkvo")


def shape_spectra(model, tau_div: float) -> int:
    """Give every attention matrix of ``model`` the spectrum ``s_1 exp(-j / tau)``, in place.

    Keeps the singular vectors and the largest singular value of the random matrix;
    ``tau = min(shape) / tau_div``. Returns the number of matrices changed.
    """
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(ATTN_SUFFIXES):
                continue
            u, s, vh = torch.linalg.svd(p, full_matrices=False)  # float32: a construction
            tau = min(p.shape) / tau_div
            j = torch.arange(s.numel(), dtype=torch.float32)
            new = s[0] * torch.exp(-j / tau)
            p.copy_((u * new) @ vh)
            n += 1
    return n


def compress_at(params, eps_values):
    """``[(eps, params, report dict)]``: attention q/k/v/o truncated at every eps, each matrix
    decomposed once.

    ``compress(params, eps=e)`` would decompose every selected matrix again for each ``e`` (144
    float64 SVDs of 768 x 768 per call, minutes on two shared cores). The public pieces of the
    ``svd`` method do the same work once: :func:`~lowrank_jax.compress.svd_method.prepare_truncation`
    per matrix, then ranks at each eps (:func:`~lowrank_jax.compress.svd_method.decide_ranks`)
    and the new leaf (``Truncation.row``, which also keeps a matrix dense when its factors
    would be larger), exactly what ``compress`` does.
    """
    from lowrank_jax.compress import ATTENTION_QKVO, select
    from lowrank_jax.compress.svd_method import decide_ranks, prepare_truncation
    from lowrank_jax.leaves import replace_paths

    truncs = [prepare_truncation(params, sel) for sel in select(params, ATTENTION_QKVO)]
    out = []
    for eps in eps_values:
        new, rows = {}, []
        for t in truncs:
            leaf, row = t.row(decide_ranks(t, "eps", {"eps": eps}), keep_dense=True)
            if row.changed:
                new[t.path] = leaf
            rows.append(row)
        before = sum(r.params_before for r in rows)
        after = sum(r.params_after for r in rows)
        out.append((eps, replace_paths(params, new),
                    {"ratio": after / before, "rows": rows}))
    return out


def contexts(c: dict, seed: int):
    """``[batch, context_length]`` float32 random walks with per-series level, scale and drift;
    two series are left-padded with NaN and one has missing values (the masking paths run).

    aeon's bundled series (airline 144, solar 289 values) are shorter than a 512-step context,
    hence the random walks.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    b, n = c["batch"], c["context_length"]
    steps = rng.normal(size=(b, n)) + rng.normal(scale=0.05, size=(b, 1))
    x = (np.cumsum(steps, axis=1) * rng.uniform(0.5, 20.0, (b, 1))
         + rng.normal(scale=50.0, size=(b, 1))).astype(np.float32)
    x[0, : n // 3] = np.nan
    x[1, : n - 100] = np.nan
    x[2, rng.choice(n, 20, replace=False)] = np.nan
    return x


def token_counts(cfg, batch: int) -> dict:
    """Rows each weight matrix is applied to in one forward pass."""
    n = cfg.num_patches(cfg.context_length)
    return {"patches": batch * n, "encoder": batch * (n + int(cfg.use_reg_token)),
            "decoder": batch}


def weight_flops(params, tokens: dict) -> int:
    """Multiply-adds of every weight matmul of one forward (``lowrank_jax.flops`` per leaf with
    the rows that leaf sees: patches for the input block, patches + [REG] for the encoder and
    the cross-attention k/v, one decoder step per series otherwise). The attention products
    (scores and weighted values) are not weight matmuls and are not counted."""
    import lowrank_jax as lj
    from lowrank_jax.leaves import Leaf, named_leaves

    total = 0
    for path, node in named_leaves(params):
        if not isinstance(node, Leaf):
            continue
        if path.startswith("input_patch_embedding/"):
            n = tokens["patches"]
        elif path.startswith("encoder/") or path.endswith(("cross_attn/k", "cross_attn/v")):
            n = tokens["encoder"]
        else:
            n = tokens["decoder"]
        total += lj.flops(node, n)
    return total


def memory_stats(fn, params, x) -> dict:
    """XLA's compiled memory analysis of ``fn(params, x)``."""
    m = fn.lower(params, x).compile().memory_analysis()
    out = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                          "temp_size_in_bytes", "alias_size_in_bytes")}
    out["total_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                          + out["temp_size_in_bytes"])
    return out


# -- report ----------------------------------------------------------------------------------

TABLE = H.Table(
    H.Col("model", "model", width=10), H.Col("attn size", "attn_size_ratio", ".3f"),
    H.Col("params", "param_ratio", ".3f", 7), H.Col("flops", "flop_ratio", ".3f", 7),
    H.Col("time", "time_ratio", ".3f", 7), H.Col("time/flop", "time_per_flop", ".2f"),
    H.Col("param MB", lambda r: r["param_bytes"] / 1e6 if r["param_bytes"] else None, ".1f", 9),
    H.Col("bytes", "param_bytes_ratio", ".3f", 7),
    H.Col("XLA MB", lambda r: r["xla_total_bytes"] / 1e6 if r["xla_total_bytes"] else None,
          ".1f", 8),
    H.Col("XLA mem", "xla_mem_ratio", ".3f"), H.Col("ms", "median_ms", ".1f", 8),
    H.Col("max abs err", "max_abs_err", ".3e"), H.Col("rel err", "rel_err", ".2e", 8))


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="small config (d_model 256, 4+4 layers, context 256, batch 8), "
                 "3 runs")
    p.add_argument("--eps", type=float, nargs="+", default=[0.01, 0.05, 0.1])
    p.add_argument("--batch", type=int, default=None, help="series per call (default 32)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both frameworks (default: CPUs available)")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 5; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 1)")
    p.add_argument("--tau-div", type=float, default=8.0,
                   help="synthetic spectrum decay: tau = min(d_in, d_out) / TAU_DIV")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    c = dict(QUICK if args.quick else BASE)
    if args.batch is not None:
        c["batch"] = args.batch
    runs = args.runs if args.runs is not None else (3 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else 1
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads if args.threads is not None else avail
    xla_flags = _set_threads(threads)

    import jax
    import numpy as np
    import torch

    import lowrank_jax as lj
    from lowrank_jax.convert import load_pretrained
    from lowrank_jax.models import chronos_bolt

    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    run = H.Run(__name__, argv, torch=torch.__version__,
                affinity=(sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else None),
                threads=threads, torch_threads=torch.get_num_threads(),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), config=c, runs=runs,
                warmup=warmup, tau_div=args.tau_div, eps=args.eps, seed=args.seed)
    setup = run.setup
    print(f"# {run.describe()}; torch {torch.__version__}; "
          f"threads: torch.get_num_threads()={torch.get_num_threads()}, XLA pinned to CPUs "
          f"{setup['affinity']} (XLA_FLAGS='{xla_flags}'), "
          f"OMP_WAIT_POLICY={setup['omp_wait_policy']}")
    print(f"# config: {c}")

    # -- models --------------------------------------------------------------------------
    t0 = time.perf_counter()
    model = build_reference(c, args.seed)
    n_shaped = shape_spectra(model, args.tau_div)
    print(f"# built and shaped the PyTorch model in {time.perf_counter() - t0:.0f} s")
    print(f"# synthetic spectra: {n_shaped} attention matrices set to s_j = s_1 exp(-j/tau), "
          f"tau = d/{args.tau_div:g} (singular vectors of the random init kept); stand-in for "
          "trained low-rank attention (Fig. 4 of 'Understanding Transformers for Time "
          "Series'), shared by every model below")
    cfg, params = load_pretrained(model)
    x_np = contexts(c, args.seed)
    x_t = torch.tensor(x_np)
    scale = np.sqrt(np.nanmean((x_np - np.nanmean(x_np, axis=1, keepdims=True)) ** 2, axis=1))
    x = jax.device_put(x_np)

    fwd = jax.jit(lambda prm, ctx: chronos_bolt.forecast(prm, ctx, cfg))

    def torch_fwd():
        with torch.inference_mode():
            return model(context=x_t).quantile_preds

    ref = torch_fwd().numpy()
    dense_out = np.asarray(fwd(params, x))
    parity = float(np.abs(dense_out - ref).max())

    def rel_err(a, b) -> float:
        """Max abs difference in units of each series' scale (Chronos-Bolt's normalization)."""
        return float((np.abs(a - b).max(axis=(1, 2)) / scale).max())

    parity_rel = rel_err(dense_out, ref)
    print(f"# parity JAX vs PyTorch: max abs diff {parity:.3e} ({parity_rel:.2e} in units of "
          f"the series' scale; largest forecast {rel_err(ref, 0 * ref):.3g} scale units)")

    tokens = token_counts(cfg, c["batch"])
    dense_flops = weight_flops(params, tokens)
    dense_count = lj.param_count(params)
    dense_bits = lj.storage_bits(params)
    dense_mem = memory_stats(fwd, params, x)

    t0 = time.perf_counter()
    variants = []  # (eps, params, report)
    for eps, cp, rep in compress_at(params, args.eps):
        kept = sum(not r.changed for r in rep["rows"])
        ranks = [r.details["rank"] for r in rep["rows"] if r.changed]
        print(f"# eps={eps:g}: attention size ratio {rep['ratio']:.3f}; "
              f"{len(rep['rows']) - kept} factorized "
              f"(ranks {min(ranks) if ranks else '-'}..{max(ranks) if ranks else '-'}), "
              f"{kept} kept dense")
        variants.append((eps, cp, rep))
    print(f"# compressed at {len(args.eps)} eps values in {time.perf_counter() - t0:.0f} s "
          "(one float64 SVD per matrix)")

    # -- timing --------------------------------------------------------------------------
    def jax_call(prm):
        return lambda: fwd(prm, x)

    calls = {"torch": torch_fwd, "jax dense": jax_call(params),
             **{f"eps={eps:g}": jax_call(cp) for eps, cp, _ in variants}}
    for _, cp, _ in variants:  # compile outside the timed loop
        jax.block_until_ready(fwd(cp, x))
    t0 = time.perf_counter()
    m = H.measure(calls, runs=runs, warmup=warmup)
    loop_s = time.perf_counter() - t0
    load = m.load
    med = [m.timings.median(n) for n in calls]
    times = [m.timings.seconds(n) for n in calls]
    torch_ms, dense_ms = med[0] * 1e3, med[1] * 1e3
    speedup = med[0] / med[1]

    rows = [{
        "model": "torch", "eps": None, "attn_size_ratio": None, "param_ratio": None,
        "flop_ratio": None, "time_ratio": med[0] / med[1], "time_per_flop": None,
        "param_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
        "param_bytes_ratio": None, "xla_total_bytes": None, "xla_mem_ratio": None,
        "median_ms": torch_ms, "times_ms": [t * 1e3 for t in times[0]],
        "max_abs_err": parity, "rel_err": parity_rel,
    }, {
        "model": "jax dense", "eps": None, "attn_size_ratio": 1.0, "param_ratio": 1.0,
        "flop_ratio": 1.0, "time_ratio": 1.0, "time_per_flop": 1.0,
        "param_bytes": dense_bits // 8, "param_bytes_ratio": 1.0,
        "xla_total_bytes": dense_mem["total_bytes"], "xla_mem_ratio": 1.0, "xla": dense_mem,
        "params": dense_count, "weight_flops": dense_flops,
        "median_ms": dense_ms, "times_ms": [t * 1e3 for t in times[1]],
        "max_abs_err": 0.0, "rel_err": 0.0,
    }]
    for (eps, cp, rep), m, ts in zip(variants, med[2:], times[2:], strict=True):
        out = np.asarray(fwd(cp, x))
        err = float(np.abs(out - dense_out).max())
        mem = memory_stats(fwd, cp, x)
        fl = weight_flops(cp, tokens)
        flop_ratio = fl / dense_flops
        time_ratio = m / med[1]
        rows.append({
            "model": f"eps={eps:g}", "eps": eps, "attn_size_ratio": rep["ratio"],
            "param_ratio": lj.param_count(cp) / dense_count, "flop_ratio": flop_ratio,
            "time_ratio": time_ratio, "time_per_flop": time_ratio / flop_ratio,
            "param_bytes": lj.storage_bits(cp) // 8,
            "param_bytes_ratio": lj.storage_bits(cp) / dense_bits,
            "xla_total_bytes": mem["total_bytes"],
            "xla_mem_ratio": mem["total_bytes"] / dense_mem["total_bytes"], "xla": mem,
            "params": lj.param_count(cp), "weight_flops": fl,
            "kept_dense": sum(r.method == "kept-dense" for r in rep["rows"]),
            "factorized": sum(r.method != "kept-dense" for r in rep["rows"]),
            "median_ms": m * 1e3, "times_ms": [t * 1e3 for t in ts],
            "max_abs_err": err, "rel_err": rel_err(out, dense_out),
        })

    # -- print ---------------------------------------------------------------------------
    ld = "n/a" if load is None else f"{100 * load:.0f}%"
    print(f"# batch {c['batch']} x context {c['context_length']}: {tokens['encoder']} encoder "
          f"rows, {tokens['decoder']} decoder rows; median of {runs} interleaved runs after "
          f"{warmup} warm-up (loop {loop_s:.0f} s, other processes used {ld} of the CPUs)")
    print("# ratios are compressed / dense JAX. attn size = report.ratio (q/k/v/o params); "
          "params = whole model; flops = weight matmuls of the forward; time/flop = time "
          "ratio / flop ratio (goal <= 1.2); bytes = storage_bits ratio; XLA MB = argument + "
          "output + temp of the compiled forward; errors vs dense JAX quantile_preds "
          "(torch row: vs JAX dense), rel = max abs error / the series' scale (std of its "
          "context), worst series")
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    goal1 = speedup >= SPEEDUP_GOAL
    comp = [r for r in rows[2:] if r["flop_ratio"] < 0.999]
    print(f"# JAX speedup over PyTorch eager: {speedup:.2f}x ({torch_ms:.0f} ms vs "
          f"{dense_ms:.0f} ms; goal >= {SPEEDUP_GOAL:g}x: {'met' if goal1 else 'NOT met'})")
    for r in rows[2:]:
        note = ("no matrix factorized: the model is the dense one" if r["factorized"] == 0
                else ("met" if r["time_per_flop"] <= TIME_FLOP_GOAL else "NOT met"))
        print(f"# {r['model']}: time ratio {r['time_ratio']:.3f} vs flop ratio "
              f"{r['flop_ratio']:.3f} -> {r['time_per_flop']:.2f} (goal <= {TIME_FLOP_GOAL}: "
              f"{note})")
    total_s = time.perf_counter() - t_start
    setup.update(parity_max_abs=parity, speedup=speedup, tokens=tokens, loop_s=loop_s,
                 total_s=total_s, loop_other_load=load,
                 targets={"speedup_ge_2": goal1,
                          "time_per_flop_le_1.2": {r["model"]: r["time_per_flop"] <= 1.2
                                                   for r in comp}})
    return run.finish(args.json, rows=rows, goals=goals(rows, load))


def goals(rows: list[dict], load: float | None) -> dict:
    """The worst time/FLOP of the models in which a matrix was factorized."""
    comp = [r for r in rows[2:] if r.get("factorized")]
    if not comp:
        return H.goal("SVD-compressed Chronos-Bolt time/FLOP (attention)", None,
                      target=f"<= {TIME_FLOP_GOAL}",
                      measured="no matrix factorized at these eps")
    worst = max(comp, key=lambda r: r["time_per_flop"])
    detail = ", ".join(f"{r['model']}: {r['time_per_flop']:.2f}" for r in comp)
    return H.goal("SVD-compressed Chronos-Bolt time/FLOP (attention)", worst["time_per_flop"],
                  target=f"<= {TIME_FLOP_GOAL}", holds=worst["time_per_flop"] <= TIME_FLOP_GOAL,
                  measured=f"worst {worst['time_per_flop']:.2f} ({detail}); load "
                           f"{H.percent(load)}")


if __name__ == "__main__":
    H.run_as_main(__spec__)
