"""``lowrank-jax demo``: the App. J experiments of "Understanding Transformers for Time Series",
then rank analysis and compression of a built-in model.

Offline and self-contained. Part 1 runs the App. J experiments (Theorem 3 slope, Theorem 4 rank
growth with heads). Part 2 takes the built-in patch encoder
(:mod:`lowrank_jax.models.patch_encoder`, randomly initialized), feeds it windows of real series
shipped with ``aeon`` (synthetic sinusoids/exponentials/noise if aeon is absent), and shows
what the paper predicts: the embedded inputs are low-rank, the rank grows with depth
(flow-of-ranks), and because the inputs are low-rank the attention weights can be compressed
with Theorem 3's data-aware projection far below what their own spectra allow.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from lowrank_jax.analysis import analyze, embedding_rank, run_appendix_j
from lowrank_jax.compress import compress
from lowrank_jax.datasets import builtin_series, windows
from lowrank_jax.leaves import param_count
from lowrank_jax.models import patch_encoder as pe
from lowrank_jax.nn import apply_norm


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _print_appendix_j(res: dict) -> dict:
    t3, t3w, t4 = res["theorem3"], res["theorem3_width"], res["theorem4"]
    print("== App. J of \"Understanding Transformers for Time Series\": numerical experiments ==")
    print(f"Theorem 3: log-log slope of ||Y - Y~||_F vs sigma_(d~+1) = {t3.slope:.3f} (paper: 1)")
    print(
        f"Theorem 3: slope of the error vs width d at fixed d~ = {t3w.slope:.3f} "
        f"(paper's reference: 0.5; see theorem3_width_experiment's docstring)"
    )
    print("Theorem 4: eps-rank of X + MH-Attention(X) by number of heads")
    print(f"  {'eps':>8} {'input':>6} " + " ".join(f"h={h:<4d}" for h in t4.heads))
    for e in t4.eps:
        print(
            f"  {e:>8g} {t4.input_eps_rank[e]:>6d} "
            + " ".join(f"{r:<6d}" for r in t4.output_eps_rank[e])
        )
    return {"theorem3": t3.to_dict(), "theorem3_width": t3w.to_dict(), "theorem4": t4.to_dict()}


def run_demo(quick: bool = False, plots_dir: str | None = None, progress: bool = True,
             steps: int | None = None) -> dict:
    """Run the demo, print its report, and return it as a JSON-able dict.

    ``rows`` holds the pretraining comparison (keys ``method``, ``size_ratio``, ``time_ratio``,
    ``wql``, ``mase``, relative to the dense model); ``appendix_j`` and ``model`` the first two
    parts.
    """
    from lowrank_jax.cli.pretrain_demo import run_pretraining_demo

    t0 = time.perf_counter()
    result: dict = {"appendix_j": _print_appendix_j(run_appendix_j(quick=quick))}

    # Part 2: the built-in model on real series.
    cfg = pe.PatchEncoderConfig()
    params = pe.init(jax.random.PRNGKey(0), cfg)
    series, source = builtin_series()
    context = 128
    x = windows(series, context, 64 if quick else 256)
    apply = jax.jit(lambda p, s: pe.encode(p, s, cfg, return_hidden=True))
    y, hidden = apply(params, x)
    patches = pe.patchify(x, cfg)
    emb = pe.embed(params, patches, cfg)
    print(
        f"\n== Built-in model: {cfg.num_layers}-layer patch encoder, d_model={cfg.d_model}, "
        f"{cfg.num_heads} heads, patch={cfg.patch} =="
    )
    print(f"data: {x.shape[0]} windows of {context} values from {source}")
    er = embedding_rank(emb, eps=(1e-2, 1e-3))
    print(
        f"embedding of {x.shape[0] * patches.shape[1]} patches: eps-rank "
        + ", ".join(f"{r} @ eps={e:g}" for e, r in er["eps_rank"].items())
        + f" out of d_model={cfg.d_model} (patch size {cfg.patch}; Theorem 2 of [1])"
    )

    report = analyze(
        params["encoder"],
        eps=(0.01, 0.05, 0.1),
        hidden=hidden,
        pattern=r"attn/(qk/q|qk/k|v|o)$",
    )
    print("\nflow-of-ranks: eps-rank of the hidden states entering each layer")
    for h in report.hidden:
        print(
            f"  layer {h.layer}: "
            + ", ".join(f"{r:>3d} @ eps={e:g}" for e, r in h.eps_ranks.items())
        )
    print("attention weights (random init) are nearly full rank: mean eps-rank per layer")
    for row in report.layer_summary():
        print(
            f"  layer {row['layer']}: "
            + ", ".join(f"{row[f'mean_rank@{e:g}']:.1f} @ eps={e:g}" for e in report.eps)
        )

    # Compression of q/k/v: plain truncated SVD vs Theorem 3's projection onto the inputs.
    norm_cfg = cfg.encoder.layer.norm
    layers = params["encoder"]["layers"]
    inputs = {}
    for i, h in enumerate(hidden):
        xin = apply_norm(layers[i]["attn_norm"], h, norm_cfg)
        for name in ("qk/q", "qk/k", "v"):
            inputs[f"layers/{i}/attn/{name}"] = np.asarray(xin).reshape(-1, cfg.d_model)
    rules = (r"attn/(qk/q|qk/k|v)$",)
    rows = []

    def qkv_size(layers) -> int:
        return param_count([(lp["attn"]["qk"], lp["attn"]["v"]) for lp in layers])

    full = qkv_size(layers)
    print("\ncompressing attention q/k/v (no fine-tuning): final-state error on the windows")
    print(f"  {'method':<26} {'rank':>5} {'size ratio':>11} {'rel. error':>11}")
    for rank in (4, 8, 16, 32):
        for method, extra in (
            ("truncated SVD", {}),
            ("input projection (Thm 3)", {"inputs": inputs}),
        ):
            new_enc, rep = compress(
                params["encoder"],
                rules=rules,
                rank=rank,
                progress=False,
                keep_dense_if_larger=False,
                **extra,
            )
            y_c, _ = apply({**params, "encoder": new_enc}, x)
            size = qkv_size(new_enc["layers"])
            row = {
                "method": method,
                "rank": rank,
                "size_ratio": size / full,
                "rel_error": _rel(y, y_c),
            }
            rows.append(row)
            print(f"  {method:<26} {rank:>5d} {row['size_ratio']:>11.3f} {row['rel_error']:>11.4f}")
    # Flow-of-ranks ([1] sec. 5): per-layer ranks from the hidden states' eps-rank at
    # eps = 0.1, against one uniform rank with (about) the same total, both by projection.
    sched = [max(1, min(h.eps_ranks[0.1], cfg.d_model // 2 - 1)) for h in report.hidden]
    uniform = [max(1, round(sum(sched) / len(sched)))] * len(sched)
    print(
        "\nrank per layer from the flow-of-ranks vs uniform at the same budget (input projection)"
    )
    for label, ranks in (("flow-of-ranks schedule", sched), ("uniform", uniform)):
        new_enc, rep = compress(
            params["encoder"],
            rules=rules,
            schedule=ranks,
            inputs=inputs,
            progress=False,
            keep_dense_if_larger=False,
        )
        y_c, _ = apply({**params, "encoder": new_enc}, x)
        size = qkv_size(new_enc["layers"])
        row = {
            "method": f"{label} {ranks}",
            "rank": ranks,
            "size_ratio": size / full,
            "rel_error": _rel(y, y_c),
        }
        rows.append(row)
        print(
            f"  {label:<24} ranks={str(ranks):<18} size ratio {row['size_ratio']:.3f}  "
            f"rel. error {row['rel_error']:.4f}"
        )
    result["model"] = {
        "config": {
            k: getattr(cfg, k) for k in ("patch", "d_model", "num_heads", "d_ff", "num_layers")
        },
        "data": source,
        "embedding_eps_rank": {f"{e:g}": r for e, r in er["eps_rank"].items()},
        "analysis": report.to_dict(),
        "compression": rows,
    }
    if plots_dir:
        result["plots"] = _plots(plots_dir, report, result["appendix_j"])

    pre = run_pretraining_demo(quick=quick, steps=steps, plots_dir=plots_dir, progress=progress)
    result["rows"] = pre.pop("rows")
    result["pretraining"] = pre
    if plots_dir:
        result["plots"] += pre.pop("plots")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return result


def _plots(plots_dir: str, report, appj: dict) -> list[str]:
    from lowrank_jax.analysis.plots import plot_layer_ranks, plot_slope, plot_spectra

    os.makedirs(plots_dir, exist_ok=True)
    paths = [
        plot_spectra(
            [h.singular_values for h in report.hidden],
            [f"input to layer {h.layer}" for h in report.hidden],
            os.path.join(plots_dir, "hidden_spectra.png"),
            title="flow-of-ranks: singular values of hidden states",
        ),
        plot_layer_ranks(
            [h.layer for h in report.hidden],
            {e: [h.eps_ranks[e] for h in report.hidden] for e in report.eps},
            os.path.join(plots_dir, "hidden_eps_rank.png"),
            title="eps-rank of the hidden states per layer",
        ),
        plot_slope(
            appj["theorem3"]["x"],
            appj["theorem3"]["error"],
            os.path.join(plots_dir, "theorem3.png"),
            reference_slope=1.0,
            xlabel="sigma_(d~+1)",
            title="Theorem 3 (App. J.1)",
        ),
    ]
    for p in paths:
        print(f"wrote {p}")
    return paths
