"""The prepared accelerator run: every goal of the GPU/TPU work measured in one process, one
JSON.

Run on a GPU machine from the repository root (stock CUDA image: Python 3.12, jax with CUDA,
PyTorch, transformers; no network; chronos-forecasting, aeon and tensorly are not needed)::

    PYTHONPATH=. python benchmarks/gpu.py --json gpu.json        # sized for < 8 min on an H200
    PYTHONPATH=. python benchmarks/gpu.py --smoke --json s.json  # every row at tiny sizes (CPU)

On a machine whose JAX backend is the CPU it prints that it needs an accelerator and exits 0
without figures (``--smoke`` runs anyway: a test that the script works end to end, its figures
mean nothing and its goals are not judged).

Sections, in order (each is timed in its own interleaved loop, :func:`benchmarks._harness.
measure`; a section that fails or would start after ``--budget-s`` is recorded as not measured
and the run goes on):

1. **GEMM rates** of the device in this run: ``[n, n] @ [n, n]`` in bf16 (float32 accumulation),
   float32 at JAX's default precision (TF32 on NVIDIA GPUs) and at ``highest``.
2. **Packed kernel correctness**: :func:`lowrank_jax.leaves.packed_kernels.packed_matmul`
   compiled for the device (not interpreted) against NumPy on multi-block grids and odd sizes,
   float32 and bf16, and the first compile of a ``[1024, 2048] x [2048, 2048]`` call.
3. **Packed kernel speed**: a packed binary ``8192 x 8192`` weight through ``linear`` with the
   kernel on, against the dense bf16 product and the XLA packed path (unpack, then dot), at 8,
   32 and 128 tokens.
4. **Models**: a random Chronos-Bolt-base-sized model (d 768, 12 + 12 layers, 256 series x 512
   context; attention spectra ``s_1 exp(-j / tau)``, ``tau = d / 8``, as
   ``benchmarks/models/forward.py``), dense, attention SVD at eps 0.1, and that plus MLP hidden
   units kept 0.3, in bf16 (:func:`lowrank_jax.nn.precision.bf16_forward`) under every
   contender of :data:`CONTENDERS`, the dense float32 forward at the default precision and at
   ``highest``, and PyTorch eager of the same sizes (a ``transformers`` ``T5Model`` on patch
   embeddings, float32 and bf16 weights: chronos-forecasting may be absent, so the stand-in has
   Chronos-Bolt's T5 body without its two small residual blocks), all in one loop. FLOPs are
   counted: twice the weight leaves' multiply-adds of the call
   (:func:`lowrank_jax.compress.frontier.measure.forward_flops`); XLA's GPU cost analysis does
   not count cuBLAS calls.
5. **LowRank leaf**: ``d = 4096``, 32768 tokens, FLOP ratios 0.1, 0.25, 0.5, bf16 and float32;
   four products chained in one program (as in ``benchmarks/layers/linear.py``).
6. **Cached decoding**: a Chronos-T5-small-sized ``T5ForConditionalGeneration`` (random) and the
   same model through ``load_pretrained``: 20 sample paths x 64 tokens, JAX's cached sampler
   against PyTorch ``generate`` on the device; greedy tokens compared (JAX at ``highest``
   precision, PyTorch float32 without TF32, its default).
7. **Train step**: the Chronos-Bolt-base-sized model against the same model factorized from
   initialization (attention q/k/v/o at rank ``d / 4``: about half the attention FLOPs), bf16
   compute, batch 32.

Contenders: :data:`CONTENDERS` is the list of execution-setting combinations the model rows run
under (:func:`lowrank_jax.execution.settings`); add one with a name and its settings, and every
model row is timed under it too, in the same loop; the goals are judged on the best contender,
each contender's figure is in the goal's detail.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import _harness as H  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Contender:
    """A way of running the model rows: a name and the execution settings it applies
    (keywords of :func:`lowrank_jax.execution.settings`)."""

    name: str
    settings: dict = dataclasses.field(default_factory=dict)
    doc: str = ""


#: The execution settings every model row is timed under, in the same loop.
CONTENDERS: list[Contender] = [
    Contender("default", {}, "the library's default execution settings"),
    Contender("fused", {"fuse_products": True},
              "one product for the first factors of q, k and v and for gated MLP inputs "
              "(off by default: no gain measured on CPU)"),
]

#: Sizes of the full run and of ``--smoke``.
FULL = dict(gemm_n=8192, kernel_cases=[(64, 1000, 300), (38, 100, 45), (5, 77, 33),
                                       (300, 2080, 520), (1024, 2048, 2048)],
            kernel_compile=(1024, 2048, 2048), kernel_d=8192, kernel_tokens=(8, 32, 128),
            model=dict(d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12,
                       context_length=512, batch=256),
            lowrank_d=4096, lowrank_tokens=32768, lowrank_chain=4,
            decode=dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                        vocab_size=4096, context=512, horizon=64, num_samples=20),
            train_batch=32, runs=10, eps=0.1, mlp_keep=0.3)
SMOKE = dict(gemm_n=64, kernel_cases=[(38, 100, 45), (5, 77, 33)], kernel_compile=(16, 256, 64),
             kernel_d=256, kernel_tokens=(8,), model=dict(
                 d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=1, context_length=32,
                 batch=4),
             lowrank_d=64, lowrank_tokens=128, lowrank_chain=2,
             decode=dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, vocab_size=64,
                         context=32, horizon=4, num_samples=2),
             train_batch=4, runs=2, eps=0.1, mlp_keep=0.3)

#: The goals, one per line of the goal table, with their targets.
GOALS = {
    "kernel": "packed kernel equals NumPy to 1e-5 (float32) on multi-block grids and odd sizes, "
              "bf16 to bf16 round-off; first compile under 20 s",
    "kernel_speed": "packed kernel, d_in = d_out = 8192: >= 2x faster than the dense bf16 product "
                    "at <= 32 tokens, >= 1.3x at 128",
    "compressed": "compressed model (attention SVD eps 0.1 + MLP kept 0.3), bf16: time ratio to "
                  "dense bf16 <= 1.2 x its counted FLOP ratio",
    "svd": "attention SVD alone: time ratio <= 1.2 x its FLOP ratio",
    "lowrank": "LowRank d 4096, 32768 tokens: time/FLOP <= 1.3 at FLOP ratio 0.1, <= 1.15 at 0.25 "
               "and 0.5, bf16 and float32",
    "gemm_fraction": "dense bf16 forward >= 40% of the bf16 GEMM rate measured in the same run, "
                     "FLOPs counted",
    "keep": "keep: dense bf16 >= 4x PyTorch eager bf16; cached decoding >= 10x generate, greedy "
            "tokens equal",
    "train": "compressed-by-design Chronos-Bolt train step (about half the attention FLOPs) "
             "against the dense one: time ratio reported with its FLOP ratio",
}
TARGETS = {"kernel": "error <= 1e-5 of |x| @ |w|, compile < 20 s",
           "kernel_speed": ">= 2 (<= 32 tokens), >= 1.3 (128 tokens)", "compressed": "<= 1.2",
           "svd": "<= 1.2", "lowrank": "<= 1.3 (0.1), <= 1.15 (0.25, 0.5)",
           "gemm_fraction": ">= 0.4", "keep": ">= 4, >= 10, equal", "train": "reported"}
SECTIONS = ("gemm", "kernel", "kernel_speed", "models", "lowrank", "decode", "train")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the setup, rows and goals as JSON")
    p.add_argument("--smoke", action="store_true",
                   help="every row at tiny sizes, on any backend (CPU included); figures "
                        "meaningless, goals not judged")
    p.add_argument("--runs", type=int, default=None, help="timed rounds per loop")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no section after this many seconds (default 420)")
    p.add_argument("--only", default=None, help=f"comma-separated sections of {SECTIONS}")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    import jax

    backend = jax.default_backend()
    if backend == "cpu" and not args.smoke:
        print("benchmarks/gpu.py needs an accelerator (a GPU or TPU): JAX's default backend is "
              "'cpu' here, so nothing was measured. --smoke runs every row at tiny sizes on "
              "any backend.")
        return 0
    c = dict(SMOKE if args.smoke else FULL)
    runs = args.runs or c["runs"]
    only = SECTIONS if args.only is None else tuple(args.only.split(","))
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown sections {unknown}; expected some of {list(SECTIONS)}")
    run = H.Run("benchmarks.gpu", argv, smoke=args.smoke, runs=runs, sizes=c,
                device_kind=jax.devices()[0].device_kind,
                contenders=[dataclasses.asdict(k) for k in CONTENDERS])
    print(f"# {run.describe()}; device {run.setup['device_kind']}"
          + ("; SMOKE: tiny sizes, figures meaningless" if args.smoke else ""), flush=True)
    t0 = time.perf_counter()
    state = {"gemm": {}}
    rows, notes = [], {}
    for name in only:
        if time.perf_counter() - t0 > args.budget_s:
            notes[name] = f"not run: the budget of {args.budget_s:.0f} s was spent"
            print(f"# {name}: {notes[name]}", flush=True)
            continue
        s0 = time.perf_counter()
        try:
            got = SECTION_FNS[name](c, runs, state)
            for r in got:
                r["section"] = name
            rows.extend(got)
            notes[name] = f"done in {time.perf_counter() - s0:.0f} s"
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            notes[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            traceback.print_exc()
        print(f"# {name}: {notes[name]}", flush=True)
    goals = judge(rows, state, smoke=args.smoke)
    run.setup.update(sections=notes, gemm=state["gemm"])
    run.finish(args.json, rows=rows, goals=goals)
    return 0


# -- helpers ---------------------------------------------------------------------------------

def _sync(x):
    import jax

    return jax.block_until_ready(x)


def _torch_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_call(fn):
    """``fn`` that waits for the device (PyTorch's calls return before the GPU is done)."""
    import torch

    def call():
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out
    return call


def _best(m, name: str) -> float:
    return m.timings.spread(name).min


# -- 1. GEMM ---------------------------------------------------------------------------------

def gemm(c, runs, state) -> list[dict]:
    """The device's GEMM rates in this run (TFLOP/s of the best round: other work only slows a
    round down; medians in the rows)."""
    import jax
    import jax.numpy as jnp

    n = c["gemm_n"]
    ka, kb = jax.random.split(jax.random.key(0))
    a32, b32 = jax.random.normal(ka, (n, n)), jax.random.normal(kb, (n, n))
    a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    f16 = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.float32))
    f32 = jax.jit(lambda x, y: x @ y)
    f32h = jax.jit(lambda x, y: jnp.matmul(x, y, precision="highest"))
    calls = {"bf16": lambda: f16(a16, b16), "float32 default": lambda: f32(a32, b32),
             "float32 highest": lambda: f32h(a32, b32)}
    m = H.measure(calls, runs=runs, warmup=1)
    rows = []
    for k in calls:
        rate = 2 * n ** 3 / _best(m, k) / 1e12
        state["gemm"][k] = rate
        rows.append({"what": f"GEMM {k}", "n": n, "tflops": rate, "median_ms": m.ms(k),
                     "tflops_median": 2 * n ** 3 / m.timings.median(k) / 1e12})
        print(f"#   GEMM {k} n={n}: {rate:.1f} TFLOP/s (best), median {m.ms(k):.2f} ms")
    return rows


# -- 2. packed kernel correctness ------------------------------------------------------------

def _ternary(seed, d_in, d_out):
    import numpy as np

    r = np.random.default_rng(seed)
    return (np.where(r.random((d_in, d_out)) < 0.5, -1, 1)
            * (r.random((d_in, d_out)) < 0.5)).astype(np.int64)


def _np_words(bits):
    import numpy as np

    d_out, d_in = bits.shape
    padded = np.zeros((d_out, 32 * (-(-d_in // 32))), bool)
    padded[:, :d_in] = bits
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def kernel(c, runs, state) -> list[dict]:
    """The kernel as compiled for this device against NumPy: ``max |got - ref| / (|x| @ |w|)``
    (``ref`` in float64 from the inputs the kernel multiplies: bf16-rounded for bf16), target
    1e-5; and the first compile of the large call."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from lowrank_jax.leaves import packed_kernels as K

    # First: the compile of a large call, before any other call of the kernel is compiled.
    m, d_in, d_out = c["kernel_compile"]
    args = (jax.ShapeDtypeStruct((m, d_in), jnp.bfloat16),
            jax.ShapeDtypeStruct((d_out, -(-d_in // 32)), jnp.uint32),
            jax.ShapeDtypeStruct((d_out, -(-d_in // 32)), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.float32))
    t0 = time.perf_counter()
    jax.jit(lambda *a: K.packed_matmul(*a, d_in)).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    rows = [{"what": "packed kernel first compile", "m": m, "d_in": d_in, "d_out": d_out,
             "seconds": compile_s}]
    print(f"#   kernel first compile [{m}, {d_in}] x [{d_in}, {d_out}]: {compile_s:.1f} s")
    for m, d_in, d_out in c["kernel_cases"]:
        t = _ternary(m + d_in + d_out, d_in, d_out)
        sign, mask = jnp.asarray(_np_words((t < 0).T)), jnp.asarray(_np_words((t != 0).T))
        x = np.random.default_rng(m).standard_normal((m, d_in)).astype(np.float32)
        for dtype in ("float32", "bfloat16"):
            got = np.asarray(K.packed_matmul(jnp.asarray(x, dtype), sign, mask, jnp.float32(0.37),
                                             d_in), np.float64)
            xr = (x if dtype == "float32"
                  else x.astype(ml_dtypes.bfloat16)).astype(np.float64)
            w = 0.37 * t
            err = float(np.max(np.abs(got - xr @ w) / (np.abs(xr) @ np.abs(w) + 1e-30)))
            rows.append({"what": "packed kernel vs NumPy", "m": m, "d_in": d_in, "d_out": d_out,
                         "dtype": dtype, "error": err, "platform": K.platform()})
            print(f"#   kernel [{m}, {d_in}] x [{d_in}, {d_out}] {dtype}: error {err:.2e} "
                  "(of |x| @ |w|)")
    return rows


# -- 3. packed kernel speed ------------------------------------------------------------------

def kernel_speed(c, runs, state) -> list[dict]:
    """``linear`` on a packed ``d x d`` leaf with the kernel, against the dense bf16 product of
    the same weights and the XLA packed path, bf16 inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lowrank_jax as lj
    from lowrank_jax import execution
    from lowrank_jax.leaves import PackedBinary
    from lowrank_jax.leaves import packed_kernels as K

    d = c["kernel_d"]
    r = np.random.default_rng(0)
    words = (d, -(-d // 32))
    sign = jnp.asarray(r.integers(0, 2 ** 32, words, dtype=np.uint32))
    mask = jnp.asarray(r.integers(0, 2 ** 32, words, dtype=np.uint32))
    alpha = jnp.float32(0.02)
    leaf = PackedBinary(sign_bits=sign, mask_bits=mask, alpha=alpha, d_in=d)
    w16 = leaf.to_dense().astype(jnp.bfloat16)
    dense = jax.jit(lambda w, x: jax.lax.dot(x, w, preferred_element_type=jnp.float32))
    fns = {}
    for mode in ("on", "off"):
        with execution.settings(packed_kernel=mode):
            fns[mode] = jax.jit(lambda p, x: lj.linear(p, x))
    narrow = jax.jit(lambda x, s, k: K.packed_matmul(x, s, k, alpha, d, block_n=32))
    rows = []
    for n in c["kernel_tokens"]:
        x = jax.random.normal(jax.random.key(n), (n, d)).astype(jnp.bfloat16)
        with execution.settings(packed_kernel="on"):
            k_on = fns["on"].lower(leaf, x).compile()
        with execution.settings(packed_kernel="off"):
            k_off = fns["off"].lower(leaf, x).compile()
        calls = {"dense bf16": lambda x=x: dense(w16, x),
                 "packed kernel": lambda x=x, f=k_on: f(leaf, x),
                 "packed kernel block_n=32": lambda x=x: narrow(x, sign, mask),
                 "packed XLA": lambda x=x, f=k_off: f(leaf, x)}
        m = H.measure(calls, runs=runs, warmup=1,
                      check={k: "dense bf16" for k in calls if k != "dense bf16"})
        row = {"what": "packed kernel speed", "d": d, "tokens": n,
               "dense_ms": m.ms("dense bf16"), "kernel_ms": m.ms("packed kernel"),
               "xla_packed_ms": m.ms("packed XLA"),
               "kernel_block_n_32_ms": m.ms("packed kernel block_n=32"),
               "speedup_block_n_32": m.ratio("dense bf16", "packed kernel block_n=32"),
               "speedup_vs_dense": m.ratio("dense bf16", "packed kernel"),
               "rel_error": m.rel_error["packed kernel"]}
        rows.append(row)
        print(f"#   packed {d}x{d}, {n} tokens: dense {row['dense_ms']:.3f} ms, kernel "
              f"{row['kernel_ms']:.3f} ms ({row['speedup_vs_dense']:.2f}x), XLA packed "
              f"{row['xla_packed_ms']:.3f} ms; rel error {row['rel_error']:.1e}")
    return rows


# -- 4. models -------------------------------------------------------------------------------

def bolt_config(mc: dict):
    from lowrank_jax.models.chronos_bolt import ChronosBoltConfig
    from lowrank_jax.models.t5 import T5Config

    t5 = T5Config(vocab_size=2, d_model=mc["d_model"], d_kv=mc["d_kv"], d_ff=mc["d_ff"],
                  num_layers=mc["num_layers"], num_decoder_layers=mc["num_layers"],
                  num_heads=mc["num_heads"], feed_forward_proj="relu")
    return ChronosBoltConfig(t5=t5, context_length=mc["context_length"], prediction_length=64,
                             input_patch_size=16, input_patch_stride=16, use_reg_token=True)


ATTENTION = re.compile(r"attn/(qk/q|qk/k|v|o)$")


def shaped_spectra(params, tau_div: float = 8.0, seed: int = 0):
    """Every attention matrix replaced by ``U diag(s_1 exp(-j / tau)) V^T`` with random
    orthogonal ``U``, ``V`` (QR of Gaussians) and ``s_1`` the matrix's largest singular value
    estimate ``sqrt(d_in) * std``; ``tau = min(shape) / tau_div``."""
    import jax.numpy as jnp
    import numpy as np

    from lowrank_jax.leaves import Dense, named_leaves, replace_paths

    r = np.random.default_rng(seed)
    new = {}
    for path, node in named_leaves(params):
        if not ATTENTION.search(path):
            continue
        w = np.asarray(node.to_dense(), np.float32)
        k = min(w.shape)
        u, _ = np.linalg.qr(r.standard_normal((w.shape[0], k)).astype(np.float32))
        v, _ = np.linalg.qr(r.standard_normal((w.shape[1], k)).astype(np.float32))
        s = 2.0 * float(np.std(w)) * np.sqrt(max(w.shape)) * np.exp(-np.arange(k) / (k / tau_div))
        new[path] = Dense(w=jnp.asarray((u * s) @ v.T, jnp.float32))
    return replace_paths(params, new)


def models(c, runs, state) -> list[dict]:
    import jax

    from benchmarks.models import forward as M
    from benchmarks.models import peak as P
    from lowrank_jax import execution
    from lowrank_jax.compress.frontier.measure import forward_flops
    from lowrank_jax.models import chronos_bolt
    from lowrank_jax.nn.precision import bf16_forward, cast_weights

    mc = c["model"]
    cfg = bolt_config(mc)
    t0 = time.perf_counter()
    dense = shaped_spectra(chronos_bolt.init(jax.random.key(0), cfg))
    (_, svd, rep), = M.compress_at(dense, [c["eps"]])
    pruned = P.prune_mlps(svd, c["mlp_keep"])
    variants = {"dense": dense, f"svd eps {c['eps']:g}": svd,
                f"svd eps {c['eps']:g} + MLP kept {c['mlp_keep']:g}": pruned}
    x_np = M.contexts({"batch": mc["batch"], "context_length": mc["context_length"]}, 0)
    x = jax.device_put(x_np)

    def fwd(p, ctx):
        return chronos_bolt.forecast(p, ctx, cfg)

    flops = {k: 2 * forward_flops(fwd, p, x) for k, p in variants.items()}
    print(f"#   models built in {time.perf_counter() - t0:.0f} s; attention size ratio "
          f"{rep['ratio']:.3f}; counted GFLOP " + ", ".join(
              f"{k} {v / 1e9:.1f}" for k, v in flops.items()), flush=True)
    t0 = time.perf_counter()
    calls, meta = {}, {}
    for cont in CONTENDERS:
        for k, p in variants.items():
            p16 = cast_weights(p)
            with execution.settings(**cont.settings):
                f = jax.jit(bf16_forward(fwd, cast=False)).lower(p16, x).compile()
            name = f"{cont.name}: {k} bf16"
            calls[name] = lambda f=f, p16=p16: f(p16, x)
            meta[name] = {"contender": cont.name, "model": k, "dtype": "bf16", "flops": flops[k]}
    f32 = jax.jit(fwd).lower(dense, x).compile()
    with jax.default_matmul_precision("highest"):
        f32h = jax.jit(lambda p, v: fwd(p, v)).lower(dense, x).compile()
    calls["dense float32 default"] = lambda: f32(dense, x)
    calls["dense float32 highest"] = lambda: f32h(dense, x)
    for k in ("dense float32 default", "dense float32 highest"):
        meta[k] = {"contender": "default", "model": "dense", "dtype": k[6:], "flops": flops["dense"]}
    torch_calls = torch_standin(cfg, mc)
    for k, fn in torch_calls.items():
        calls[k] = fn
        meta[k] = {"contender": "pytorch eager", "model": "dense (T5 stand-in)",
                   "dtype": k.split()[-1], "flops": flops["dense"]}
    print(f"#   compiled {len(calls) - len(torch_calls)} JAX forwards in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    # The error of the dense forward's bf16 and default-precision programs (the compressed
    # models compute other functions).
    check = {k: "dense float32 highest" for k in calls
             if k == "dense float32 default" or k.endswith(": dense bf16")}
    m = H.measure(calls, runs=runs, warmup=1, check=check)
    rows = []
    for k in calls:
        info = meta[k]
        best = _best(m, k)
        rows.append({"what": "model forward", "name": k, **info, "median_ms": m.ms(k),
                     "best_ms": best * 1e3, "tflops": info["flops"] / best / 1e12,
                     "rel_error_vs_highest": m.rel_error.get(k)})
    state["models"] = {r["name"]: r for r in rows}
    state["model_names"] = list(variants)
    for r in rows:
        err = r["rel_error_vs_highest"]
        print(f"#   {r['name']}: {r['median_ms']:.2f} ms, {r['tflops']:.1f} TFLOP/s counted"
              + ("" if err is None else f", rel error vs highest {err:.1e}"))
    return rows


def torch_standin(cfg, mc) -> dict:
    """PyTorch eager forwards of Chronos-Bolt's T5 body at these sizes (``transformers``'
    ``T5Model`` on ``[batch, patches + 1, d]`` embeddings and one decoder position), float32
    and with bf16 weights; ``{}`` when PyTorch or transformers is missing."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    dev = _torch_device()
    hf = transformers.T5Config(d_model=mc["d_model"], d_kv=mc["d_kv"], d_ff=mc["d_ff"],
                               num_layers=mc["num_layers"], num_heads=mc["num_heads"],
                               feed_forward_proj="relu", dropout_rate=0.0, vocab_size=2)
    torch.manual_seed(0)
    model = transformers.T5Model(hf).eval().to(dev)
    n = cfg.num_patches(cfg.context_length) + 1
    enc = torch.randn(mc["batch"], n, mc["d_model"], device=dev)
    dec = torch.randn(mc["batch"], 1, mc["d_model"], device=dev)
    model16 = transformers.T5Model(hf).eval().to(dev).to(torch.bfloat16)

    def run(mdl, dtype):
        def call():
            with torch.inference_mode():
                return mdl(inputs_embeds=enc.to(dtype),
                           decoder_inputs_embeds=dec.to(dtype)).last_hidden_state
        return _torch_call(call)

    return {"torch eager float32": run(model, torch.float32),
            "torch eager bf16": run(model16, torch.bfloat16)}


# -- 5. LowRank leaf -------------------------------------------------------------------------

def lowrank(c, runs, state) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import lowrank_jax as lj
    from lowrank_jax.nn.precision import cast_weights

    d, n, chain = c["lowrank_d"], c["lowrank_tokens"], c["lowrank_chain"]
    ratios = (0.1, 0.25, 0.5)
    keys = jax.random.split(jax.random.key(1), chain * (1 + len(ratios)) + 1)
    kinds = {"dense": [lj.init_dense(k, d, d) for k in keys[1:1 + chain]]}
    for i, q in enumerate(ratios):
        r = max(1, round(q * d / 2))
        ks = keys[1 + chain * (1 + i):1 + chain * (2 + i)]
        kinds[f"rank {r} (ratio {q:g})"] = [lj.init_lowrank(k, d, d, r) for k in ks]

    def program(leaves, x):
        for leaf in leaves:
            x = lj.linear(leaf, x)
        return x

    prog = jax.jit(program)
    x32 = jax.random.normal(keys[0], (n, d))
    x16 = x32.astype(jnp.bfloat16)
    rows = []
    for dtype, x in (("bf16", x16), ("float32", x32)):
        calls = {}
        for k, leaves in kinds.items():
            lv = cast_weights(leaves) if dtype == "bf16" else leaves
            calls[k] = lambda lv=lv, x=x: prog(lv, x)
        m = H.measure(calls, runs=runs, warmup=1)
        base = lj.flops(kinds["dense"][0], n)
        for (k, leaves), q in zip(list(kinds.items())[1:], ratios, strict=True):
            fr = lj.flops(leaves[0], n) / base
            tr = m.ratio(k, "dense")
            rows.append({"what": "LowRank leaf", "dtype": dtype, "d": d, "tokens": n,
                         "target_ratio": q, "name": k, "flop_ratio": fr, "time_ratio": tr,
                         "time_per_flop": tr / fr, "dense_ms": m.ms("dense") / chain,
                         "lowrank_ms": m.ms(k) / chain})
            print(f"#   LowRank {dtype} {k}: time/FLOP {tr / fr:.2f} (time {tr:.3f}, FLOPs "
                  f"{fr:.3f})")
    return rows


# -- 6. decoding -----------------------------------------------------------------------------

def decode(c, runs, state) -> list[dict]:
    import jax
    import numpy as np
    import torch

    from benchmarks.models.decode import build_hf
    from lowrank_jax.convert import load_pretrained
    from lowrank_jax.models import chronos

    dc = c["decode"]
    model = build_hf(dc, 0)
    t5_cfg, params = load_pretrained(model)
    dev = _torch_device()
    model = model.to(dev)
    cfg = chronos.ChronosConfig(t5=t5_cfg, n_tokens=dc["vocab_size"], context_length=dc["context"],
                                prediction_length=dc["horizon"], num_samples=dc["num_samples"],
                                top_k=50)
    rng = np.random.default_rng(0)
    context = np.cumsum(rng.normal(size=(1, dc["context"])), axis=1).astype(np.float32)
    ids, mask, _ = chronos.context_input_transform(cfg, context)
    ids_t = torch.tensor(np.asarray(ids), device=dev)
    mask_t = torch.tensor(np.asarray(mask), device=dev)
    n, h = dc["num_samples"], dc["horizon"]

    def torch_generate(top_k=50):
        with torch.inference_mode():
            out = model.generate(input_ids=ids_t, attention_mask=mask_t, min_new_tokens=h,
                                 max_new_tokens=h, do_sample=True, num_return_sequences=n,
                                 eos_token_id=1, pad_token_id=0, temperature=1.0, top_k=top_k,
                                 top_p=1.0)
        if dev == "cuda":
            torch.cuda.synchronize()
        return out[:, 1:].cpu().numpy()

    def jax_sample(top_k=50):
        return _sync(chronos.sample_tokens(params, ids, mask, cfg, jax.random.PRNGKey(0),
                                           horizon=h, num_samples=n, temperature=1.0,
                                           top_k=top_k, top_p=1.0))

    with jax.default_matmul_precision("highest"):
        greedy_jax = np.asarray(jax_sample(top_k=1)).reshape(n, h)
    greedy_equal = bool(np.array_equal(greedy_jax, torch_generate(top_k=1)))
    m = H.measure({"torch generate": torch_generate, "jax cached": jax_sample}, runs=runs,
                  warmup=1)
    speedup = m.ratio("torch generate", "jax cached")
    print(f"#   cached decoding {n} paths x {h} tokens: {speedup:.1f}x generate; greedy tokens "
          f"equal: {greedy_equal}")
    state["decode"] = {"speedup": speedup, "greedy_equal": greedy_equal}
    return [{"what": "cached decoding", "paths": n, "tokens": h,
             "torch_ms": m.ms("torch generate"), "jax_ms": m.ms("jax cached"),
             "speedup": speedup, "greedy_equal": greedy_equal}]


# -- 7. train step ---------------------------------------------------------------------------

def train(c, runs, state) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lowrank_jax.compress import factorize_init
    from lowrank_jax.compress.frontier.measure import forward_flops
    from lowrank_jax.models import chronos_bolt
    from lowrank_jax.train import default_optimizer, init_train_state, make_train_step

    mc = c["model"]
    cfg = bolt_config(mc)
    key = jax.random.key(0)
    dense = chronos_bolt.init(key, cfg)
    rank = mc["d_model"] // 4
    factored, _ = factorize_init(dense, key=key, rank=rank)
    b = c["train_batch"]
    rng = np.random.default_rng(0)
    ctx = rng.normal(size=(b, cfg.context_length)).cumsum(axis=1)
    tgt = ctx[:, -1:] + rng.normal(size=(b, cfg.prediction_length)).cumsum(axis=1)
    batch = {"context": jnp.asarray(ctx, jnp.float32), "target": jnp.asarray(tgt, jnp.float32)}
    opt = default_optimizer(learning_rate=1e-4, total_steps=10_000, warmup_steps=10)
    loss_fn = chronos_bolt.loss(cfg)
    variants = {"dense": dense, f"attention factorized at rank {rank}": factored}
    states, calls = {}, {}
    for name, p in variants.items():
        states[name] = init_train_state(p, opt, key=key)
        step = make_train_step(loss_fn, opt, compute_dtype=jnp.bfloat16)

        def call(name=name, step=step):
            states[name], metrics = step(states[name], batch, None)
            return metrics["loss"]
        calls[name] = call
    m = H.measure(calls, runs=runs, warmup=2)

    def fwd(p, v):
        return chronos_bolt.forecast(p, v, cfg)

    base = forward_flops(fwd, dense, batch["context"])
    rows = []
    for name, p in variants.items():
        fr = forward_flops(fwd, p, batch["context"]) / base
        tr = m.ratio(name, "dense")
        rows.append({"what": "train step", "name": name, "step_ms": m.ms(name),
                     "time_ratio": tr, "flop_ratio": fr, "batch": b})
        print(f"#   train step {name}: {m.ms(name):.1f} ms, time ratio {tr:.3f}, FLOP ratio "
              f"{fr:.3f}")
    return rows


SECTION_FNS = {"gemm": gemm, "kernel": kernel, "kernel_speed": kernel_speed, "models": models,
               "lowrank": lowrank, "decode": decode, "train": train}


# -- goals -----------------------------------------------------------------------------------

def judge(rows: list[dict], state: dict, *, smoke: bool) -> dict:
    """One goal per line of the goal table; ``value None`` (not measured) where its section
    did not run. In ``--smoke`` nothing is judged (``holds`` is ``None``)."""
    by = {}
    for r in rows:
        by.setdefault(r["section"], []).append(r)
    out = {}

    def add(key, value, holds, measured, **detail):
        if smoke:
            holds, measured = None, f"smoke run (tiny sizes, not judged): {measured}"
        out.update(H.goal(GOALS[key], value, target=TARGETS[key], holds=holds,
                          measured=measured, **detail))

    def missing(key, section):
        out.update(H.goal(GOALS[key], None, holds=None,
                          measured=f"not measured: section {section!r} did not run"))

    if "kernel" in by:
        errs = [r for r in by["kernel"] if "error" in r]
        comp = [r for r in by["kernel"] if "seconds" in r]
        worst = max(r["error"] for r in errs)
        ok = worst <= 1e-5 and all(r["seconds"] < 20 for r in comp)
        add("kernel", {"worst_error": worst, "compile_s": comp[0]["seconds"]}, ok,
            f"worst error {worst:.1e} of |x| @ |w| over {len(errs)} cases "
            f"(platform {errs[0]['platform']}); first compile {comp[0]['seconds']:.1f} s")
    else:
        missing("kernel", "kernel")
    if "kernel_speed" in by:
        sp = {r["tokens"]: max(r["speedup_vs_dense"], r["speedup_block_n_32"])
              for r in by["kernel_speed"]}
        ok = (all(v >= 2.0 for t, v in sp.items() if t <= 32)
              and all(v >= 1.3 for t, v in sp.items() if t == 128))
        add("kernel_speed", sp, ok, ", ".join(f"{t} tokens: {v:.2f}x" for t, v in sp.items()))
    else:
        missing("kernel_speed", "kernel_speed")
    if "models" in by:
        mods = state["models"]
        names = state["model_names"]

        def ratios(model):
            per = {}
            for cont in CONTENDERS:
                a, d = mods[f"{cont.name}: {model} bf16"], mods[f"{cont.name}: {names[0]} bf16"]
                tr = a["median_ms"] / d["median_ms"]
                fr = a["flops"] / d["flops"]
                per[cont.name] = {"time_ratio": tr, "flop_ratio": fr, "time_per_flop": tr / fr}
            best = min(per, key=lambda k: per[k]["time_per_flop"])
            return per, best

        for key, model in (("compressed", names[2]), ("svd", names[1])):
            per, best = ratios(model)
            v = per[best]
            add(key, v["time_per_flop"], v["time_per_flop"] <= 1.2,
                f"time ratio {v['time_ratio']:.3f} at counted FLOP ratio {v['flop_ratio']:.3f}: "
                f"{v['time_per_flop']:.2f} (best contender {best!r})", contenders=per)
        rate = state["gemm"].get("bf16")
        fr = {cont.name: mods[f"{cont.name}: {names[0]} bf16"]["tflops"] / rate
              for cont in CONTENDERS} if rate else {}
        if fr:
            best = max(fr, key=fr.get)
            add("gemm_fraction", fr[best], fr[best] >= 0.4,
                f"{fr[best]:.2f} of {rate:.0f} TFLOP/s (best contender {best!r})", contenders=fr)
        else:
            missing("gemm_fraction", "gemm")
    else:
        for key in ("compressed", "svd", "gemm_fraction"):
            missing(key, "models")
    if "lowrank" in by:
        lim = {0.1: 1.3, 0.25: 1.15, 0.5: 1.15}
        v = {f"{r['dtype']} {r['target_ratio']:g}": r["time_per_flop"] for r in by["lowrank"]}
        ok = all(r["time_per_flop"] <= lim[r["target_ratio"]] for r in by["lowrank"])
        add("lowrank", v, ok, ", ".join(f"{k}: {x:.2f}" for k, x in v.items()))
    else:
        missing("lowrank", "lowrank")
    keep = {}
    if "models" in by and "torch eager bf16" in state["models"]:
        mods = state["models"]
        keep["dense_bf16_vs_torch_bf16"] = max(
            mods["torch eager bf16"]["median_ms"] / mods[f"{c.name}: dense bf16"]["median_ms"]
            for c in CONTENDERS)
    if "decode" in by:
        keep.update(decode_speedup=state["decode"]["speedup"],
                    greedy_equal=state["decode"]["greedy_equal"])
    if keep:
        full = len(keep) == 3
        ok = (full and keep["dense_bf16_vs_torch_bf16"] >= 4 and keep["decode_speedup"] >= 10
              and keep["greedy_equal"]) if full else None
        add("keep", keep, ok, ", ".join(f"{k}: {x:.2f}" if isinstance(x, float) else f"{k}: {x}"
                                        for k, x in keep.items()))
    else:
        missing("keep", "models/decode")
    if "train" in by:
        r = by["train"][1]
        add("train", {"time_ratio": r["time_ratio"], "flop_ratio": r["flop_ratio"]}, None,
            f"time ratio {r['time_ratio']:.3f} at FLOP ratio {r['flop_ratio']:.3f}")
    else:
        missing("train", "train")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
