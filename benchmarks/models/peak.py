"""The machine's limit: every Chronos-Bolt forward as a fraction of the CPU's sustained float32
GEMM rate, against PyTorch eager and ``torch.compile`` on the same threads, with XLA's memory
analysis and the bf16 error.

One process, one interleaved timing loop:

* **GEMM rate**: square float32 matmuls ``[n, n] @ [n, n]`` (``jax.jit``, operands as
  arguments) at several ``n``, timed *inside* the interleaved loop with the models, so that
  every fraction below is taken against a rate measured under the same load; the rate of a size
  is ``2 n^3 / time`` of its best run (other processes only ever slow a run down; the medians
  are in the JSON) and the machine's sustained GEMM rate is the best size's. The same product
  on bf16 operands with float32 accumulation is timed too (is bf16 faster here?).
* **Models**: the Chronos-Bolt-base-sized model of ``benchmarks/models/forward.py`` (random HF init,
  synthetic attention spectra ``tau = d / 8``, batch 32 x context 512; ``--quick``: its small
  config), built and converted by that script's functions:

  - ``torch eager``: the reference ``ChronosBoltModelForForecasting`` under ``inference_mode``;
  - ``torch.compile``: the same module through ``torch.compile`` (default inductor backend),
    compiled outside the loop; skipped with the error as a note when it fails, and in
    ``--quick`` unless ``--compile`` (it compiles for 1-3 minutes on 2 cores);
  - ``jax dense``: ``load_pretrained(module)`` under ``jax.jit``, as the library runs it by
    default: the decoder's one token meets the encoder output with the cross-attention keys and
    values folded into its queries (``lowrank_jax.nn.attention.fold_keys``);
  - ``jax dense projected``: the same with the setting ``fold_keys=False``, every key and value
    projected (PyTorch's algorithm and FLOPs). The 90 % target is taken on this program: it
    measures how close XLA runs the standard forward's FLOPs to the GEMM rate, which the
    default program, doing less work, does not (its executed fraction and its *effective*
    fraction, this program's FLOPs over the default's time, are reported);
  - ``jax svd``: attention q/k/v/o truncated at ``--eps`` (``models.compress_at``; not in
    ``--quick``);
  - ``jax svd+pruned``: the same plus every MLP's hidden units cut to ``--mlp-keep`` of
    ``d_ff`` (``keep_outputs`` of ``wi``, ``keep_inputs`` of ``wo``: the units with the largest
    ``||wi[:, h]|| ||wo[h, :]||``; the structure the ``prune`` method gives hidden units, which
    units are kept does not change the time). The speed recipe (default ``--mlp-keep 0.3``:
    its quality after a short fine-tune is ``methods/recipe_quality.py``'s);
  - ``jax packed MLP``: every MLP weight binarized (Biprop, scores ``|W|``, keep 0.5) and
    packed into bits (``PackedBinary``);
  - ``jax bf16 dense``, ``jax bf16 svd+pruned``: those forwards through
    :func:`lowrank_jax.nn.precision.bf16_forward` (weight leaves stored in bf16, matmuls on
    bf16 operands accumulated in float32).

  After that loop a second one times only the float32 GEMMs, the dense JAX forward
  (``dense_fraction_of_gemm_jax_only_loop``, reported next to the goal's figure: it shows how
  much the PyTorch calls in the shared loop slow the JAX forward down) and its two halves,
  ``chronos_bolt.encode`` and ``chronos_bolt.decode`` each jitted alone, with their share of
  the forward's time and of the GEMM rate (``setup.jax_only_loop.parts`` in the JSON).

  FLOPs of a JAX forward are XLA's ``cost_analysis()['flops']`` of the compiled program
  (2 per multiply-add, what it executes, elementwise work included) on CPU; on another backend
  (XLA:GPU does not count cuBLAS calls) twice the weight leaves' counted multiply-adds
  (:func:`program_flops`); the PyTorch rows are
  charged the FLOPs of ``jax dense projected`` (the same algorithm). ``of GEMM`` = FLOPs /
  best time / GEMM rate (the same statistic on both sides; ``fraction_of_gemm_median`` in the
  JSON uses medians).
  ``vs eager`` = PyTorch eager time / the row's time. Memory: ``param MB`` = bytes of
  the parameter arrays; from ``compiled.memory_analysis()``: ``XLA MB`` = arguments + outputs +
  temporaries (an upper bound of what the forward holds at once; XLA:CPU's own
  ``peak_memory_in_bytes`` leaves the temporaries out, it is in the JSON), ``temp MB`` the
  temporaries. ``rel err``:
  max |y - y_ref| / max |y_ref| of the quantile forecasts, against the float32 twin (bf16 rows)
  or the dense JAX model (the others).

Threads as in ``forward.py``: ``torch.set_num_threads(N)`` and this process pinned to N CPUs
before jax is imported (XLA sizes its pool from them); ``OMP_WAIT_POLICY=PASSIVE``.

Usage::

    python -m benchmarks.models peak --json peak.json        # base config, 7 runs
    python -m benchmarks.models peak --quick                 # small config, 5 runs, no torch.compile
    python -m benchmarks.models peak --quick --memory-scheduler   # XLA:CPU's memory-saving scheduler
    python -m benchmarks.models peak --no-compile            # skip torch.compile
"""

from __future__ import annotations

import os
import time

from benchmarks import _harness as H
from benchmarks.models import forward as M  # imports no framework at load

FRACTION_GOAL = 0.9  # dense Chronos-Bolt forward (keys projected) / GEMM rate
PROJECTED = "jax dense projected"
EAGER_GOAL = 1.3  # JAX dense vs PyTorch eager
COMPRESSED_GOAL = 2.0  # compressed JAX vs dense PyTorch eager
BF16_GOAL = 1e-2  # relative error of the bf16 forward


def gemm_call(jax, jnp, n: int, dtype=None):
    """A zero-argument call of ``[n, n] @ [n, n]`` (jitted, operands as arguments); with
    ``dtype``, operands in that dtype and the product accumulated in float32."""
    a = jax.random.normal(jax.random.key(n), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(n + 1), (n, n), jnp.float32)
    if dtype is None:
        f = jax.jit(lambda x, y: x @ y)
    else:
        a, b = a.astype(dtype), b.astype(dtype)
        f = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a, b))
    return lambda: jax.block_until_ready(f(a, b))


def prune_mlps(params, keep: float):
    """Every ``.../mlp`` block's hidden units cut to ``round(keep * d_ff)``: the units with the
    largest ``||wi[:, h]|| * ||wo[h, :]||`` (Dense leaves)."""
    import numpy as np

    from lowrank_jax.leaves import get_path, keep_inputs, keep_outputs, named_leaves, replace_paths

    new = {}
    for path, node in named_leaves(params):
        if not path.endswith("/mlp/wi"):
            continue
        base = path[: -len("/wi")]
        wi, wo = node, get_path(params, base + "/wo")
        score = (np.linalg.norm(np.asarray(wi.w), axis=0)
                 * np.linalg.norm(np.asarray(wo.w), axis=1))
        k = max(1, round(keep * score.size))
        idx = np.sort(np.argsort(-score, kind="stable")[:k])
        new[base + "/wi"] = keep_outputs(wi, idx)
        new[base + "/wo"] = keep_inputs(wo, idx)
    return replace_paths(params, new)


def binarize_mlps(params, keep: float = 0.5):
    """Every MLP weight as a packed Biprop leaf (``w = W``, scores ``|W|``)."""
    import jax.numpy as jnp

    from lowrank_jax.leaves import MaskedBinary, PackedBinary, map_with_path

    def conv(path, node):
        if path.endswith(("/mlp/wi", "/mlp/wo")):
            return PackedBinary.from_leaf(MaskedBinary(w=node.w, s=jnp.abs(node.w), b=node.b,
                                                       keep=keep))
        return node

    return map_with_path(conv, params)


def keys_projected(fn):
    """``fn`` traced with the execution setting ``fold_keys=False``: every attention projects
    its keys and values (the standard algorithm, the FLOPs PyTorch executes). Jit the result
    as its own function: the setting applies while tracing."""
    from lowrank_jax import execution

    def run(*args):
        with execution.settings(fold_keys=False):
            return fn(*args)
    return run


def dense_parts(jax, chronos_bolt, cfg, params, x) -> dict:
    """The dense forward's halves as jitted calls: ``{name: (call, XLA's FLOPs)}``. The
    decoder's input is the encoder's output, computed once outside the timed calls; the
    forward's rest (the output residual block and the un-normalization) is what the two
    halves leave of the forward's time. The decoder runs as by default (its cross-attention
    keys folded into the queries) and with the keys projected."""
    from lowrank_jax.compress.frontier.measure import forward_flops

    enc_fn = jax.jit(lambda p, c: chronos_bolt.encode(p, c, cfg))

    def dec(p, e):
        return chronos_bolt.decode(p, e, cfg)

    enc = jax.block_until_ready(enc_fn(params, x))
    out = {}
    for name, fn, arg in (("encoder (chronos_bolt.encode)", enc_fn, x),
                          ("decoder (chronos_bolt.decode)", jax.jit(dec), enc),
                          ("decoder, keys projected", jax.jit(keys_projected(dec)), enc)):
        flops = program_flops(fn.lower(params, arg).compile(),
                              lambda fn=fn, arg=arg: forward_flops(fn, params, arg))
        out[name] = (lambda fn=fn, arg=arg: jax.block_until_ready(fn(params, arg)), flops)
    return out


def program_flops(compiled, count) -> float:
    """FLOPs of a compiled forward: XLA's ``cost_analysis`` on CPU (what the program executes,
    elementwise work included); on other backends, whose count leaves out library calls (XLA:GPU
    does not count cuBLAS GEMMs), twice the weight leaves' counted multiply-adds (``count()``,
    :func:`lowrank_jax.compress.frontier.measure.forward_flops`)."""
    from lowrank_jax.compress.frontier.measure import xla_flops

    flops = xla_flops(compiled)
    return float(flops) if flops is not None else 2.0 * count()


def tree_bytes(jax, tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


TABLE = H.Table(
    H.Col("model", "model", width=20), H.Col("GFLOP", "gflop", ".1f", 7),
    H.Col("ms", "median_ms", ".1f", 9), H.Col("GFLOP/s", "gflops", ".1f", 8),
    H.Col("of GEMM", "fraction_of_gemm", ".3f"), H.Col("vs eager", "speedup_vs_eager", ".2f"),
    H.Col("param MB", "param_mb", ".1f", 9), H.Col("XLA MB", "xla_mb", ".1f", 8),
    H.Col("temp MB", "xla_temp_mb", ".1f", 8), H.Col("rel err", "rel_err", ".2e", 9))


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="forward.py's small config (d_model 256, 4+4 layers, batch 8), "
                 "5 runs")
    p.add_argument("--eps", type=float, default=0.1, help="attention eps of the svd rows")
    p.add_argument("--mlp-keep", type=float, default=0.3,
                   help="MLP hidden units kept (default 0.3: the speed recipe, whose quality "
                   "methods/recipe_quality.py measures)")
    p.add_argument("--gemm", type=int, nargs="+", default=None,
                   help="GEMM sizes n (default 1024 2048 3072; quick 1024 2048)")
    p.add_argument("--threads", type=int, default=None, help="default: CPUs available")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default 7; quick 5)")
    p.add_argument("--memory-scheduler", action="store_true",
                   help="XLA:CPU's memory-minimizing scheduler instead of the default "
                   "concurrency-optimized one (--xla_cpu_enable_concurrency_optimized_scheduler"
                   "=false): what the packed model's temporaries become")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--compile", action="store_true", help="run torch.compile in --quick too")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    c = dict(M.QUICK if args.quick else M.BASE)
    runs = args.runs if args.runs is not None else (5 if args.quick else 7)
    if args.memory_scheduler:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_"
                                   "concurrency_optimized_scheduler=false").strip()
    sizes = args.gemm or ([1024, 2048] if args.quick else [1024, 2048, 3072])
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads if args.threads is not None else avail
    xla_flags = M._set_threads(threads)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from lowrank_jax.compress.frontier.measure import forward_flops
    from lowrank_jax.convert import load_pretrained
    from lowrank_jax.models import chronos_bolt
    from lowrank_jax.nn.precision import bf16_forward, cast_weights

    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    run = H.Run(__name__, argv, torch=torch.__version__, threads=threads,
                torch_threads=torch.get_num_threads(),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), config=c, runs=runs,
                eps=args.eps, mlp_keep=args.mlp_keep, seed=args.seed,
                memory_scheduler=args.memory_scheduler)
    setup = run.setup
    print(f"# {run.describe()}; torch {torch.__version__}; {threads} threads "
          f"(torch.get_num_threads()={torch.get_num_threads()}, XLA pinned, XLA_FLAGS "
          f"'{xla_flags}'); config {c}")

    # -- GEMM ----------------------------------------------------------------------------
    gemm_fns = {f"GEMM n={n}": (n, gemm_call(jax, jnp, n)) for n in sizes}
    bf16_n = max(n for n in sizes if n <= 2048) if min(sizes) <= 2048 else min(sizes)
    gemm_fns[f"GEMM bf16 n={bf16_n}"] = (bf16_n, gemm_call(jax, jnp, bf16_n, jnp.bfloat16))

    # -- models --------------------------------------------------------------------------
    t0 = time.perf_counter()
    model = M.build_reference(c, args.seed)
    M.shape_spectra(model, 8.0)
    cfg, dense = load_pretrained(model)
    x_np = M.contexts(c, args.seed)
    x_t = torch.tensor(x_np)
    x = jax.device_put(x_np)
    (_, svd, rep), = M.compress_at(dense, [args.eps])
    svd_pruned = prune_mlps(svd, args.mlp_keep)
    packed = binarize_mlps(dense)
    print(f"# models built in {time.perf_counter() - t0:.0f} s (svd eps {args.eps}: attention "
          f"size ratio {rep['ratio']:.3f}; MLP hidden units kept {args.mlp_keep})", flush=True)

    def fwd_fn(prm, ctx):
        return chronos_bolt.forecast(prm, ctx, cfg)

    fwd = jax.jit(fwd_fn)
    fwd_projected = jax.jit(keys_projected(fwd_fn))
    fwd16 = jax.jit(bf16_forward(fwd_fn, cast=False))
    jax_models = {  # name: (jitted forward, params, reference name)
        "jax dense": (fwd, dense, None),
        PROJECTED: (fwd_projected, dense, "jax dense"),
        **({} if args.quick else {f"jax svd eps={args.eps:g}": (fwd, svd, "jax dense")}),
        "jax svd+pruned": (fwd, svd_pruned, "jax dense"),
        "jax packed MLP": (fwd, packed, "jax dense"),
        "jax bf16 dense": (fwd16, cast_weights(dense), "jax dense"),
        "jax bf16 svd+pruned": (fwd16, cast_weights(svd_pruned), "jax svd+pruned"),
    }
    stats, outs = {}, {}
    t0 = time.perf_counter()
    for name, (f, prm, _) in jax_models.items():
        compiled = f.lower(prm, x).compile()
        mem = compiled.memory_analysis()
        flops = program_flops(compiled, lambda f=f, prm=prm: forward_flops(f, prm, x))
        stats[name] = {"flops": flops, "param_bytes": tree_bytes(jax, prm),
                       "xla": {k: int(getattr(mem, k)) for k in (
                           "argument_size_in_bytes", "output_size_in_bytes",
                           "temp_size_in_bytes", "alias_size_in_bytes",
                           "peak_memory_in_bytes")}}
        outs[name] = np.asarray(f(prm, x))
    print(f"# compiled {len(jax_models)} JAX forwards in {time.perf_counter() - t0:.0f} s",
          flush=True)

    def torch_eager():
        with torch.inference_mode():
            return model(context=x_t).quantile_preds

    torch_models = {"torch eager": torch_eager}
    no_compile = args.no_compile or (args.quick and not args.compile)
    compile_note = ("skipped (--no-compile)" if args.no_compile else
                    "skipped in --quick (--compile runs it)") if no_compile else None
    if not no_compile:
        t0 = time.perf_counter()
        try:
            compiled_model = torch.compile(model)

            def torch_compiled():
                with torch.inference_mode():
                    return compiled_model(context=x_t).quantile_preds

            outs["torch.compile"] = torch_compiled().numpy()
            torch_models["torch.compile"] = torch_compiled
            compile_note = f"compiled in {time.perf_counter() - t0:.0f} s"
        except Exception as e:  # noqa: BLE001 - any failure of the compiler is reported
            compile_note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"# torch.compile: {compile_note}", flush=True)
    outs["torch eager"] = torch_eager().numpy()

    # -- timing --------------------------------------------------------------------------
    calls = {k: fn for k, (_, fn) in gemm_fns.items()} | torch_models
    for name, (f, prm, _) in jax_models.items():
        calls[name] = lambda f=f, prm=prm: f(prm, x)
    names = list(calls)
    t0 = time.perf_counter()
    m = H.measure(calls, runs=runs, warmup=args.warmup)
    loop_s = time.perf_counter() - t0
    load = m.load
    med = {n: m.timings.median(n) for n in names}
    best_t = {n: m.timings.spread(n).min for n in names}
    gemm = [{"name": k, "n": n, "median_ms": med[k] * 1e3, "best_ms": best_t[k] * 1e3,
             "gflops": 2 * n ** 3 / best_t[k] / 1e9,
             "gflops_median": 2 * n ** 3 / med[k] / 1e9} for k, (n, _) in gemm_fns.items()]
    best = max((g for g in gemm if "bf16" not in g["name"]), key=lambda g: g["gflops"])
    gemm_gflops = best["gflops"]
    gemm_gflops_median = max(g["gflops_median"] for g in gemm if "bf16" not in g["name"])

    # The same fraction with nothing but the dense JAX forward and the float32 GEMMs in the
    # loop: PyTorch's calls between them (its thread pool, the caches they leave) may slow the
    # JAX forward down in the shared loop.
    # The dense forward's two halves are timed in the same loop (where the forward's time
    # goes: the encoder's large products against the decoder's one token per series).
    parts = dense_parts(jax, chronos_bolt, cfg, dense, x)
    solo = {k: calls[k] for k in (*(k for k in gemm_fns if "bf16" not in k), "jax dense",
                                  PROJECTED)}
    solo.update({k: fn for k, (fn, _) in parts.items()})
    ms = H.measure(solo, runs=runs, warmup=0)
    solo_load = ms.load
    solo_best = {k: ms.timings.spread(k).min for k in solo}
    solo_gemm = max(2 * gemm_fns[k][0] ** 3 / solo_best[k] for k in gemm_fns if "bf16" not in k)

    dense_flops = stats[PROJECTED]["flops"]  # what PyTorch executes: charged to its rows
    solo_fraction = dense_flops / solo_best[PROJECTED] / solo_gemm
    part_rows = [{"part": k, "gflop": fl / 1e9, "best_ms": solo_best[k] * 1e3,
                  "fraction_of_gemm": fl / solo_best[k] / solo_gemm,
                  "share_of_forward_time": solo_best[k] / solo_best["jax dense"]}
                 for k, (_, fl) in parts.items()]
    ref_out = outs["jax dense"]
    rows = []
    for name in names[len(gemm_fns):]:
        s = stats.get(name)
        flops = s["flops"] if s else dense_flops
        ref_name = jax_models[name][2] if name in jax_models else "jax dense"
        err = None
        if ref_name is not None:
            ref = outs[ref_name]
            err = float(np.max(np.abs(outs[name] - ref)) / np.max(np.abs(ref)))
        rows.append({
            "model": name, "gflop": flops / 1e9, "median_ms": med[name] * 1e3,
            "best_ms": best_t[name] * 1e3,
            "times_ms": [t * 1e3 for t in m.timings.seconds(name)],
            "gflops": flops / best_t[name] / 1e9,
            "fraction_of_gemm": flops / best_t[name] / 1e9 / gemm_gflops,
            "fraction_of_gemm_median": flops / med[name] / 1e9 / gemm_gflops_median,
            "speedup_vs_eager": med["torch eager"] / med[name],
            "param_mb": (s["param_bytes"] if s else sum(
                t.numel() * t.element_size() for t in model.parameters())) / 1e6,
            "xla_mb": sum(s["xla"][k] for k in ("argument_size_in_bytes",
                                                "output_size_in_bytes",
                                                "temp_size_in_bytes")) / 1e6 if s else None,
            "xla_temp_mb": s["xla"]["temp_size_in_bytes"] / 1e6 if s else None,
            "xla": s["xla"] if s else None, "rel_err": err, "rel_err_vs": ref_name,
        })
    del ref_out

    # -- print ---------------------------------------------------------------------------
    ld = "n/a" if load is None else f"{100 * load:.0f}%"
    print(f"# batch {c['batch']} x context {c['context_length']}; median of {runs} interleaved "
          f"runs (loop {loop_s:.0f} s, other processes used {ld} of the CPUs)")
    for g in gemm:
        print(f"# {g['name']}: {g['gflops']:.1f} GFLOP/s in its best run ({g['best_ms']:.1f} ms; "
              f"median {g['gflops_median']:.1f})" + ("  <- the GEMM rate" if g is best else ""))
    print("# GFLOP = XLA cost_analysis of the compiled forward (torch rows: jax dense "
          "projected's); GFLOP/s and of GEMM (= GFLOP/s / GEMM rate) from the best of the runs "
          "(other load only slows a run down), ms and vs eager (= torch eager ms / ms) from "
          "the medians; rel err = max|y - ref| / max|ref| (bf16 rows vs their float32 twin, "
          "others vs jax dense)")
    print(TABLE.header())
    for r in rows:
        print(TABLE.line(r))
    by = {r["model"]: r for r in rows}
    print(f"# JAX-only loop (GEMM {solo_gemm / 1e9:.1f} GFLOP/s): dense forward "
          f"{solo_best['jax dense'] * 1e3:.1f} ms; keys projected {solo_best[PROJECTED] * 1e3:.1f} "
          f"ms, {solo_fraction:.3f} of the GEMM rate; parts of the default forward:")
    for r in part_rows:
        print(f"#   {r['part']}: {r['best_ms']:.1f} ms ({100 * r['share_of_forward_time']:.0f} % "
              f"of the forward's time), {r['gflop']:.1f} GFLOP, {r['fraction_of_gemm']:.3f} of "
              f"the GEMM rate")
    print(f"# torch.compile: {compile_note}")
    total_s = time.perf_counter() - t_start
    setup.update(gemm=gemm, gemm_n=best["n"], gemm_gflops=gemm_gflops,
                 gemm_gflops_median=gemm_gflops_median, torch_compile=compile_note,
                 loop_other_load=load, loop_s=loop_s,
                 jax_only_loop={"gemm_gflops": solo_gemm / 1e9,
                                "dense_ms": solo_best["jax dense"] * 1e3,
                                "projected_ms": solo_best[PROJECTED] * 1e3,
                                "fraction_of_gemm": solo_fraction, "other_load": solo_load,
                                "parts": part_rows},
                 total_s=total_s, attention_size_ratio=rep["ratio"])
    return run.finish(args.json, rows=rows,
                      goals=goals(by, setup, gemm_gflops, compile_note))


def goals(by: dict, setup: dict, gemm_gflops: float, compile_note: str | None) -> dict:
    """The forwards against the GEMM rate and PyTorch, the compressed one against dense
    PyTorch eager, the bf16 error, and memory."""
    c = setup["config"]
    cfg = f"d_model {c['d_model']}, batch {c['batch']}"
    dense, proj, sp = by["jax dense"], by[PROJECTED], by["jax svd+pruned"]
    load = H.percent(setup["loop_other_load"])
    out = H.goal(
        f"dense Chronos-Bolt forward, keys and values projected (the standard algorithm) / GEMM "
        f"rate ({cfg})", proj["fraction_of_gemm"], target=f">= {FRACTION_GOAL}",
        holds=proj["fraction_of_gemm"] >= FRACTION_GOAL,
        measured=f"{proj['fraction_of_gemm']:.2f} ({proj['gflops']:.0f} of {gemm_gflops:.0f} "
                 f"GFLOP/s, GEMM n={setup['gemm_n']}); load {load}")
    eff = proj["gflop"] / dense["best_ms"] * 1e3 / gemm_gflops
    out.update(H.goal(
        "dense forward as run by default (decoder's cross-attention keys folded into its "
        "query): executed FLOPs / GEMM rate; effective (the projected program's FLOPs / this "
        "time)", dense["fraction_of_gemm"], effective=eff,
        measured=f"{dense['fraction_of_gemm']:.2f} ({dense['gflop']:.1f} GFLOP executed, "
                 f"{dense['median_ms']:.0f} ms vs {proj['median_ms']:.0f} ms projected); "
                 f"effective {eff:.2f}"))
    out.update(H.goal(
        "JAX dense forward (default) vs PyTorch eager, same threads", dense["speedup_vs_eager"],
        target=f">= {EAGER_GOAL}", holds=dense["speedup_vs_eager"] >= EAGER_GOAL,
        measured=f"{dense['speedup_vs_eager']:.2f}x ({by['torch eager']['median_ms']:.0f} ms vs "
                 f"{dense['median_ms']:.0f} ms)"))
    if "torch.compile" in by:
        tc = by["torch.compile"]
        out.update(H.goal("JAX dense forward vs torch.compile", tc["median_ms"] / dense["median_ms"],
                          measured=f"{tc['median_ms'] / dense['median_ms']:.2f}x "
                                   f"({tc['median_ms']:.0f} ms vs {dense['median_ms']:.0f} ms)"))
    else:
        out.update(H.goal("JAX dense forward vs torch.compile", None,
                          measured=f"not run: {compile_note}"))
    keep = setup["mlp_keep"]
    mlp = "MLP halved" if keep == 0.5 else f"MLP hidden units kept {keep:g}"
    out.update(H.goal(
        f"compressed (SVD attention eps {setup['eps']:g} + {mlp}) vs dense PyTorch eager",
        sp["speedup_vs_eager"], target=f">= {COMPRESSED_GOAL}",
        holds=sp["speedup_vs_eager"] >= COMPRESSED_GOAL,
        measured=f"{sp['speedup_vs_eager']:.2f}x ({sp['gflop']:.1f} of {proj['gflop']:.1f} "
                 "GFLOP)"))
    b16 = [r for r in by.values() if "bf16" in r["model"]]
    err = max(r["rel_err"] for r in b16)
    out.update(H.goal(
        "bf16 forward (f32 accumulation): max error / largest forecast", err,
        target=f"< {BF16_GOAL:g}", holds=err < BF16_GOAL,
        measured=", ".join(f"{r['model'][9:]}: {r['rel_err']:.1e} ({r['median_ms']:.0f} ms)"
                           for r in b16) + f"; float32 dense {dense['median_ms']:.0f} ms"))
    out.update(H.goal(
        "memory: parameter MB / XLA arguments+outputs+temporaries MB",
        {r["model"]: [r["param_mb"], r["xla_mb"]] for r in by.values() if r.get("xla_mb")},
        measured="; ".join(f"{r['model'][4:]}: {r['param_mb']:.0f} / {r['xla_mb']:.0f}"
                           for r in by.values() if r.get("xla_mb"))))
    return out


if __name__ == "__main__":
    H.run_as_main(__spec__)
