"""``lowrank-jax demo``: the App. J experiments of "Understanding Transformers for Time Series",
then rank analysis and compression of a built-in model, then pretraining compressed
Chronos-Bolt models against compressing a dense one.

Offline and self-contained. Part 1 runs the App. J experiments (Theorem 3 slope, Theorem 4 rank
growth with heads) at reduced sizes (:func:`lowrank_jax.analysis.run_appendix_j` runs the
paper's). Part 2 takes the built-in patch encoder
(:mod:`lowrank_jax.models.patch_encoder`, randomly initialized), feeds it windows of real series
shipped with ``aeon`` (synthetic sinusoids/exponentials/noise if aeon is absent), and shows
what the paper predicts: the embedded inputs are low-rank, the rank grows with depth
(flow-of-ranks), and because the inputs are low-rank the attention weights can be compressed
with Theorem 3's data-aware projection far below what their own spectra allow. Part 3 is
:mod:`lowrank_jax.recipes.pretrain_demo`.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from lowrank_jax.analysis import (
    analyze,
    embedding_rank,
    theorem3_experiment,
    theorem3_width_experiment,
    theorem4_experiment,
)
from lowrank_jax.compress import compress
from lowrank_jax.datasets import builtin_datasets, windows
from lowrank_jax.leaves import Dense, bias_of, is_leaf, map_with_path, materialize, param_count
from lowrank_jax.models import patch_encoder as pe
from lowrank_jax.nn import apply_norm
from lowrank_jax.recipes import outputs
from lowrank_jax.recipes.outcome import Outcome
from lowrank_jax.recipes.pretrain_demo import check_seed, check_steps, run_pretraining_demo
from lowrank_jax.recipes.progress import Progress, lines
from lowrank_jax.runtime import one_blas_thread

# App. J sizes: Theorem 3 (d, tokens), its width sweep (widths, tokens, seeds) and Theorem 4
# (head counts). The paper's d = 512, N = 4096 takes minutes on 2 cores; the slope is the same
# at these sizes. Every size and head count is one more compile of the attention block.
APPENDIX_J_SIZES = {
    True: {"t3": {"d": 128, "n_tokens": 1024},
           "t3w": {"widths": (32, 64, 128), "n_tokens": 512, "seeds": 1},
           "t4": {"heads": (1, 2, 8, 32)}},
    False: {"t3": {"d": 256, "n_tokens": 2048},
            "t3w": {"widths": (32, 64, 128, 256), "n_tokens": 1024, "seeds": 2},
            "t4": {"heads": (1, 2, 4, 8, 16, 32)}},
}
COMPRESSION_RANKS = (4, 8, 16, 32)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def _appendix_j(quick: bool, status: Progress, text: list[str]) -> dict:
    sizes = APPENDIX_J_SIZES[bool(quick)]
    t3s, t3ws = sizes["t3"], sizes["t3w"]
    with status.phase(f"App. J: Theorem 3 at d={t3s['d']}, {t3s['n_tokens']} tokens (the paper: "
                      "d=512, 4096)"):
        t3 = theorem3_experiment(**t3s)
    with status.phase(f"App. J: Theorem 3 error vs width {tuple(t3ws['widths'])}"):
        t3w = theorem3_width_experiment(**t3ws)
    with status.phase(f"App. J: Theorem 4, eps-rank vs number of heads {sizes['t4']['heads']}"):
        t4 = theorem4_experiment(**sizes["t4"])
    text.append("== App. J of \"Understanding Transformers for Time Series\": numerical "
                "experiments ==")
    text.append(f"Theorem 3: log-log slope of ||Y - Y~||_F vs sigma_(d~+1) = {t3.slope:.3f} "
                "(paper: 1)")
    text.append(
        f"Theorem 3: slope of the error vs width d at fixed d~ = {t3w.slope:.3f} "
        f"(paper's reference: 0.5; see theorem3_width_experiment's docstring)"
    )
    text.append("Theorem 4: eps-rank of X + MH-Attention(X) by number of heads")
    text.append(f"  {'eps':>8} {'input':>6} " + " ".join(f"h={h:<4d}" for h in t4.heads))
    for e in t4.eps:
        text.append(
            f"  {e:>8g} {t4.input_eps_rank[e]:>6d} "
            + " ".join(f"{r:<6d}" for r in t4.output_eps_rank[e])
        )
    return {"theorem3": t3.to_dict(), "theorem3_width": t3w.to_dict(), "theorem4": t4.to_dict(),
            "sizes": {k: {a: list(v) if isinstance(v, tuple) else v for a, v in s.items()}
                      for k, s in sizes.items()}}


def _dense_copy(tree):
    """Every weight leaf as a ``Dense`` of its materialized matrix (and its bias).

    The compressed encoders of part 2 are only compared for accuracy, so they run as dense
    copies of their (exact) products: every variant then has the original tree's shapes and
    reuses one compiled forward instead of compiling one per rank.
    """
    return map_with_path(
        lambda _, n: Dense(materialize(n), bias_of(n)) if is_leaf(n) else n, tree)


def run_demo(quick: bool = False, plots_dir: str | None = None, progress: bool = True,
             steps: int | None = None, seed: int = 0, overwrite: bool = False,
             status: Progress | None = None) -> Outcome:
    """Run the demo; return its results, and its report as lines.

    ``rows`` holds the pretraining comparison (keys ``method``, ``size_ratio``, ``time_ratio``,
    ``wql``, ``mase``, relative to the dense model); ``appendix_j`` and ``model`` the first two
    parts; ``seconds`` the wall time of each part.

    Args:
      quick: smaller sizes, a 2 + 1 layer model and 40 training steps (about a minute).
      plots_dir: save PNG plots there. It follows the command's output rules
        (:mod:`lowrank_jax.recipes.outputs`): checked before anything runs, written whole at
        the end (nothing appears there if the demo fails), and never over anything lowrank-jax
        did not write there.
      progress: tqdm progress bars (status lines are shown either way).
      steps: training steps per pretrained model, an int >= 1 (default 600; quick: 40).
      seed: seed of the pretraining part (initialization, batch order, factor draws).
      overwrite: replace ``plots_dir`` if it is a previous lowrank-jax plots directory.
      status: progress reporting (default: status lines on stderr, bars as ``progress``
        says).

    Raises:
      ConfigError: ``steps`` or ``seed`` out of range, or ``plots_dir`` not writable (before
        anything runs).
      OutputExistsError: ``plots_dir`` holds something that may not be replaced.
    """
    steps = check_steps(steps)
    seed = check_seed(seed)
    if plots_dir:
        outputs.check_plots_out(plots_dir, {}, overwrite=overwrite)
    status = lines(status, "demo", bars=bool(progress))
    with one_blas_thread():
        if not plots_dir:
            return _run_demo(bool(quick), None, status, steps, seed)
        with outputs.marked_directory(plots_dir, kind="plots", overwrite=overwrite,
                                      who="demo") as tmp:
            result = _run_demo(bool(quick), tmp, status, steps, seed)
    names = [os.path.basename(p) for p in result["plots"]]
    result["plots"] = [os.path.join(plots_dir, n) for n in names]
    result.lines.append(f"wrote {len(names)} plots to {plots_dir}: {', '.join(names)}")
    return result


def _run_demo(quick: bool, plots_dir: str | None, status: Progress, steps: int | None,
              seed: int) -> Outcome:
    t0 = time.perf_counter()
    seconds = {}
    result = Outcome()
    text = result.lines
    status.say("part 1 of 3: the App. J experiments")
    result["appendix_j"] = _appendix_j(quick, status, text)
    seconds["appendix_j"] = time.perf_counter() - t0

    # Part 2: the built-in model on real series.
    t1 = time.perf_counter()
    status.say("part 2 of 3: rank analysis and compression of the built-in patch encoder")
    with status.phase("loading the built-in series"):
        groups, source = builtin_datasets()
    series = [s for g in groups.values() for s in g]
    cfg = pe.PatchEncoderConfig()
    context = 128
    x = windows(series, context, 64 if quick else 256)
    with status.phase("patch encoder: initializing, compiling and running its forward"):
        params = pe.init(jax.random.PRNGKey(0), cfg)
        apply = jax.jit(lambda p, s: pe.encode(p, s, cfg, return_hidden=True))
        y, hidden = apply(params, x)
        patches = pe.patchify(x, cfg)
        emb = pe.embed(params, patches, cfg)
    text.append(
        f"\n== Built-in model: {cfg.num_layers}-layer patch encoder, d_model={cfg.d_model}, "
        f"{cfg.num_heads} heads, patch={cfg.patch} =="
    )
    text.append(f"data: {x.shape[0]} windows of {context} values from {source}")
    er = embedding_rank(emb, eps=(1e-2, 1e-3))
    text.append(
        f"embedding of {x.shape[0] * patches.shape[1]} patches: eps-rank "
        + ", ".join(f"{r} @ eps={e:g}" for e, r in er["eps_rank"].items())
        + f" out of d_model={cfg.d_model} (patch size {cfg.patch}; Theorem 2 of [1])"
    )

    with status.phase("spectra of the weights and of the hidden states"):
        report = analyze(
            params["encoder"],
            eps=(0.01, 0.05, 0.1),
            hidden=hidden,
            pattern=r"attn/(qk/q|qk/k|v|o)$",
        )
    text.append("\nflow-of-ranks: eps-rank of the hidden states entering each layer")
    for h in report.hidden:
        text.append(
            f"  layer {h.layer}: "
            + ", ".join(f"{r:>3d} @ eps={e:g}" for e, r in h.eps_ranks.items())
        )
    text.append("attention weights (random init) are nearly full rank: mean eps-rank per layer")
    for row in report.layer_summary():
        text.append(
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

    def qkv_size(layers) -> int:
        return param_count([(lp["attn"]["qk"], lp["attn"]["v"]) for lp in layers])

    full = qkv_size(layers)
    # Flow-of-ranks ([1] sec. 5): per-layer ranks from the hidden states' eps-rank at
    # eps = 0.1, against one uniform rank with (about) the same total, both by projection.
    sched = [max(1, min(h.eps_ranks[0.1], cfg.d_model // 2 - 1)) for h in report.hidden]
    uniform = [max(1, round(sum(sched) / len(sched)))] * len(sched)
    jobs = [(method, rank, {"rank": rank, **extra}) for rank in COMPRESSION_RANKS
            for method, extra in (("truncated SVD", {}),
                                  ("input projection (Thm 3)", {"inputs": inputs}))]
    jobs += [(label, ranks, {"schedule": ranks, "inputs": inputs})
             for label, ranks in (("flow-of-ranks schedule", sched), ("uniform", uniform))]
    rows = []
    status.say(f"compressing q/k/v {len(jobs)} ways and running each compressed encoder")
    for method, rank, settings in status.bar(jobs, desc="compress", unit="model"):
        new_enc, _ = compress(params["encoder"], rules=rules, progress=False,
                              keep_dense_if_larger=False, **settings)
        y_c, _ = apply({**params, "encoder": _dense_copy(new_enc)}, x)
        rows.append({"method": method if isinstance(rank, int) else f"{method} {rank}",
                     "rank": rank, "size_ratio": qkv_size(new_enc["layers"]) / full,
                     "rel_error": _rel(y, y_c)})
    text.append("\ncompressing attention q/k/v (no fine-tuning): final-state error on the windows")
    text.append(f"  {'method':<26} {'rank':>5} {'size ratio':>11} {'rel. error':>11}")
    for row in rows[:2 * len(COMPRESSION_RANKS)]:
        text.append(f"  {row['method']:<26} {row['rank']:>5d} {row['size_ratio']:>11.3f} "
                    f"{row['rel_error']:>11.4f}")
    text.append(
        "\nrank per layer from the flow-of-ranks vs uniform at the same budget (input projection)"
    )
    for (label, ranks, _), row in zip(jobs[2 * len(COMPRESSION_RANKS):],
                                      rows[2 * len(COMPRESSION_RANKS):], strict=True):
        text.append(
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
    seconds["model"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    status.say("part 3 of 3: pretraining compressed Chronos-Bolt models")
    pre = run_pretraining_demo(quick=quick, steps=steps, seed=seed, plots_into=plots_dir,
                               progress=status.bars, datasets=(groups, source), status=status)
    text.extend(pre.lines)
    result["rows"] = pre.pop("rows")
    result["pretraining"] = dict(pre)
    if plots_dir:
        result["plots"] += pre.pop("plots")
    seconds["pretraining"] = time.perf_counter() - t2
    seconds["total"] = time.perf_counter() - t0
    result["seconds"] = seconds
    text.append(f"\ndemo finished in {seconds['total']:.1f} s (App. J {seconds['appendix_j']:.0f} "
                f"s, built-in model {seconds['model']:.0f} s, pretraining "
                f"{seconds['pretraining']:.0f} s)")
    return result


def _plots(plots_dir: str, report, appj: dict) -> list[str]:
    from lowrank_jax.analysis.plots import plot_layer_ranks, plot_slope, plot_spectra

    return [
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


__all__ = ["APPENDIX_J_SIZES", "COMPRESSION_RANKS", "run_demo"]
