"""The ``lowrank-jax`` command: ``analyze``, ``compress``, ``convert``, ``train`` and ``demo``.

User errors (bad arguments, missing or malformed checkpoints) print one line and exit with
status 2; set ``LOWRANK_JAX_DEBUG=1`` to get the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _write_json(path: str | None, obj) -> None:
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)  # never leave a half-written report
    print(f"wrote {path}")


def _parse_rules(rules: list[str] | None):
    from lowrank_jax.compress import ATTENTION_QKVO

    if not rules:
        return ATTENTION_QKVO
    out = []
    for r in rules:
        if r.startswith("!"):
            out.append((r[1:], None))  # '!regex' skips matching weights
        else:
            out.append(r)
    return tuple(out)


def _model_dims(config) -> dict:
    """num_heads / num_layers of a model config, for per-head analysis and schedules."""
    if config is None:
        return {}
    for cfg in (config, getattr(config, "t5", None)):
        if cfg is None:
            continue
        heads = getattr(cfg, "num_heads", None) or getattr(cfg, "num_attention_heads", None)
        layers = getattr(cfg, "num_layers", None) or getattr(cfg, "num_hidden_layers", None)
        if heads or layers:
            return {"num_heads": heads, "num_layers": layers}
    return {}


def _load(path):
    """``(config or None, params, metadata)`` of a params or model checkpoint."""
    from lowrank_jax.io import config_from_dict, load_metadata, load_params

    meta = load_metadata(path)
    config = config_from_dict(meta["config"], source=str(path)) if "config" in meta else None
    meta = {**_model_dims(config), **{k: v for k, v in meta.items() if v is not None}}
    return config, load_params(path), meta


def cmd_analyze(args) -> int:
    from lowrank_jax.analysis import analyze

    config, params, meta = _load(args.params)
    num_heads = args.heads or meta.get("num_heads")
    report = analyze(
        params,
        eps=args.eps,
        num_heads=num_heads,
        pattern=args.pattern,
        progress=not args.no_progress,
    )
    print(report.format_table())
    out = report.to_dict()
    if args.sweep or args.sweep_heads:
        out["sweep"] = _analyze_sweep(args, config, params, num_heads)
    _write_json(args.json, out)
    return 0


def _analyze_sweep(args, config, params, num_heads) -> dict:
    """``analyze --sweep``: the ratio -> error curve (seed 000 Table 2) and per-head sweeps."""
    from lowrank_jax.compress import eps_sweep

    result: dict = {}
    if args.sweep:
        rows = eps_sweep(config, params, None, args.sweep_eps)
        result["eps"] = rows
        if config is None:
            print("\neps sweep (bare parameter tree, no model config: sizes and weight errors "
                  "only; save a model checkpoint to get the output error)")
        else:
            print(f"\neps sweep ({type(config).__name__}, attention q/k/v/o truncated at eps, "
                  f"one compiled run; error of '{rows[0]['output']}' on sample inputs)")
        head = f"{'eps':>8}  {'size ratio':>10}  {'max weight err':>14}"
        head += f"  {'rel output err':>14}" if config is not None else ""
        print(head)
        for r in rows:
            line = f"{r['eps']:>8.4g}  {r['size_ratio']:>10.4f}  {r['max_weight_error']:>14.3e}"
            line += f"  {r['rel_error']:>14.3e}" if config is not None else ""
            print(line)
    if args.sweep_heads:
        result["heads"] = _head_sweeps(args, config, params, num_heads)
    return result


def _head_sweeps(args, config, params, num_heads) -> list[dict]:
    """head_rank_sweep on every attention block, on synthetic N(0, 1) inputs."""
    import numpy as np

    from lowrank_jax.compress import head_rank_sweep
    from lowrank_jax.leaves import materialize, named_leaves
    from lowrank_jax.models import T5Config
    from lowrank_jax.nn import AttentionConfig

    if not num_heads:
        raise ValueError("--sweep-heads needs --heads (or num_heads in the checkpoint metadata)")
    blocks: dict = {}
    for path, node in named_leaves(params):
        prefix, _, name = path.rpartition("/")
        if prefix.endswith("attn") and name in ("q", "k", "v", "o"):
            blocks.setdefault(prefix, {})[name] = node
    # T5-family attention is unscaled (T5 folds 1/sqrt(d_head) into its init).
    unscaled = isinstance(config, T5Config) or isinstance(getattr(config, "t5", None), T5Config)
    rng = np.random.default_rng(0)
    out = []
    for prefix, attn in blocks.items():
        if set(attn) != {"q", "k", "v", "o"}:
            continue
        d_model, inner = np.shape(materialize(attn["q"]))
        d_kv = np.shape(materialize(attn["k"]))[0]
        if inner % num_heads:
            raise ValueError(f"--sweep-heads: {prefix}: {num_heads} heads do not divide {inner}")
        cfg = AttentionConfig(d_model=int(d_model), num_heads=int(num_heads),
                              d_head=int(inner // num_heads), d_kv_in=int(d_kv),
                              scaled=not unscaled)
        k = min(cfg.head_dim, cfg.d_model, cfg.kv_dim)
        ranks = sorted({r for r in (args.sweep_ranks or []) if 0 <= r <= k}) or sorted(
            {min(2 ** i, k) for i in range(int(np.log2(k)) + 1)} | {k})
        x = rng.normal(size=(2, 32, cfg.d_model)).astype(np.float32)
        kv = None if "cross" not in prefix and d_kv == d_model else rng.normal(
            size=(2, 32, cfg.kv_dim)).astype(np.float32)
        err = np.asarray(head_rank_sweep(attn, x, cfg, ranks, kv=kv))
        out.append({"block": prefix, "ranks": ranks, "rel_error": err.tolist()})
    print(f"\nper-head rank sweep (q/k/v of one head truncated, synthetic N(0, 1) inputs, "
          f"relative output error; {len(out)} attention blocks)")
    for b in out:
        print(f"{b['block']}  ranks {b['ranks']}")
        for h, row in enumerate(b["rel_error"]):
            print(f"  head {h:>2}: " + " ".join(f"{e:.2e}" for e in row))
    return out


def cmd_compress(args) -> int:
    from lowrank_jax.compress import compress
    from lowrank_jax.io import save_model, save_params

    config, params, meta = _load(args.params)
    num_heads = args.heads or meta.get("num_heads")
    schedule = None
    if args.schedule:
        from lowrank_jax.compress import interpolation_schedule, power_schedule

        kind, *vals = args.schedule.split(":")
        n_layers = args.num_layers or meta.get("num_layers")
        if not n_layers:
            raise SystemExit(
                "--schedule needs --num-layers (or num_layers in the checkpoint metadata)"
            )
        nums = [float(v) for v in vals]
        if kind == "power" and len(nums) == 2:
            schedule = power_schedule(nums[0], nums[1], int(n_layers))
        elif kind == "interp" and len(nums) == 3:
            schedule = interpolation_schedule(int(nums[0]), int(nums[1]), nums[2], int(n_layers))
        else:
            raise SystemExit(
                "--schedule: expected 'power:D0:ALPHA' or 'interp:R1:RD:ALPHA', "
                f"got {args.schedule!r}"
            )
    new_params, report = compress(
        params,
        rules=_parse_rules(args.rule),
        eps=args.eps,
        rank=args.rank,
        ratio=args.ratio,
        schedule=schedule,
        per_head=args.per_head,
        num_heads=num_heads,
        allocation=args.allocation,
        progress=not args.no_progress,
    )
    print(report.format_table())
    out = report.to_dict()
    if config is not None and not args.no_eval:
        from lowrank_jax.compress import compare_models

        ev = compare_models(config, params, new_params, time_runs=args.time_runs)
        out["model"] = ev
        print(
            f"\nmodel: parameter ratio {ev['param_ratio']:.4f}, FLOP ratio {ev['flop_ratio']:.4f}, "
            f"{ev['output']} max abs error {ev['max_abs_error']:.3e}, "
            f"rel. error {ev['rel_error']:.3e}"
            + (f", top-10 Jaccard {ev['top10_jaccard']:.3f}" if "top10_jaccard" in ev else "")
            + f", measured time ratio {ev['time_ratio']:.3f}"
        )
    if args.out:
        meta_out = {k: v for k, v in meta.items() if k != "config"}
        meta_out["compression"] = out["totals"]
        if config is not None:
            save_model(args.out, config, new_params, metadata=meta_out, overwrite=args.overwrite)
        else:
            save_params(args.out, new_params, metadata=meta_out, overwrite=args.overwrite)
        print(f"saved compressed parameters to {args.out} (factors kept, nothing densified)")
    _write_json(args.json, out)
    return 0


def cmd_convert(args) -> int:
    from lowrank_jax.convert import load_pretrained
    from lowrank_jax.io import save_model
    from lowrank_jax.leaves import param_count

    config, params = load_pretrained(args.src, family=args.family)
    save_model(
        args.out,
        config,
        params,
        metadata={"source": os.path.abspath(args.src), **_model_dims(config)},
        overwrite=args.overwrite,
    )
    print(
        f"converted {args.src} ({type(config).__name__}, {param_count(params):,} parameters) "
        f"to {args.out}"
    )
    return 0


def cmd_demo(args) -> int:
    from lowrank_jax.cli.demo import run_demo

    result = run_demo(quick=args.quick, plots_dir=args.plots, progress=not args.no_progress,
                      steps=args.steps)
    _write_json(args.json, result)
    return 0


def cmd_train(args) -> int:
    from lowrank_jax.cli.train_cmd import run_train

    if args.distributed:
        import jax

        # Multi-host: coordinator address, process count and id come from the environment
        # (or the cluster's auto-detection: SLURM, TPU pods, ...).
        jax.distributed.initialize()
    run_train(args.config, args.out, progress=not args.no_progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowrank-jax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("analyze", help="eps-ranks of every weight of a saved parameter tree")
    a.add_argument("params", help="directory written by lowrank_jax.io.save_params")
    a.add_argument("--eps", type=float, nargs="+", default=[0.01, 0.05, 0.1])
    a.add_argument("--heads", type=int, help="number of heads (per-head ranks of q/k/v)")
    a.add_argument("--pattern", help="only weights whose path matches this regular expression")
    a.add_argument("--json", help="write the report as JSON to this path")
    a.add_argument("--no-progress", action="store_true")
    a.add_argument(
        "--sweep",
        action="store_true",
        help="compression ratio -> output error curve over --sweep-eps (seed 000 Table 2), "
        "compiled once; model checkpoints only get the output error",
    )
    a.add_argument("--sweep-eps", type=float, nargs="+",
                   default=[0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01])
    a.add_argument(
        "--sweep-heads",
        action="store_true",
        help="per-head rank sweep of every attention block (synthetic N(0, 1) inputs)",
    )
    a.add_argument("--sweep-ranks", type=int, nargs="+",
                   help="ranks for --sweep-heads (default: powers of 2 up to d_head)")
    a.set_defaults(func=cmd_analyze)

    c = sub.add_parser("compress", help="truncated-SVD compression of a saved parameter tree")
    c.add_argument("params", help="directory written by lowrank_jax.io.save_params")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--eps", type=float, help="truncate every selected matrix at this eps")
    g.add_argument("--rank", type=int, help="truncate every selected matrix to this rank")
    g.add_argument("--ratio", type=float, help="target parameter ratio of the selected weights")
    g.add_argument("--schedule", help="layer rank schedule: power:D0:ALPHA or interp:R1:RD:ALPHA")
    c.add_argument(
        "--rule",
        action="append",
        help="path regex selecting weights (first match wins; '!regex' skips); "
        "default: attention q/k/v/o",
    )
    c.add_argument("--per-head", action="store_true", help="per-head sketching (seed 000 eq. 20)")
    c.add_argument("--heads", type=int, help="number of heads (for --per-head)")
    c.add_argument("--num-layers", type=int, help="number of layers (for --schedule)")
    c.add_argument(
        "--allocation",
        choices=["eps", "energy"],
        default="eps",
        help="with --ratio: one global eps, or ranks by singular-value energy",
    )
    c.add_argument("--out", help="save the compressed tree to this directory")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--json", help="write the report as JSON to this path")
    c.add_argument(
        "--no-eval",
        action="store_true",
        help="skip running the model (error, overlap, time ratio) for model checkpoints",
    )
    c.add_argument("--time-runs", type=int, default=20, help="timed forward calls per model")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_compress)

    v = sub.add_parser(
        "convert", help="Hugging Face checkpoint directory -> lowrank_jax checkpoint"
    )
    v.add_argument(
        "src", help="directory with config.json and model.safetensors / pytorch_model.bin"
    )
    v.add_argument("--out", required=True, help="output directory (a lowrank_jax model checkpoint)")
    v.add_argument("--family", help="force the model family instead of detecting it")
    v.add_argument("--overwrite", action="store_true")
    v.set_defaults(func=cmd_convert)

    d = sub.add_parser(
        "demo", help="App. J experiments, rank analysis of a built-in model, and pretraining "
                     "compressed Chronos-Bolt models against compressing a dense one")
    d.add_argument("--quick", action="store_true", help="smaller sizes and few training steps")
    d.add_argument("--steps", type=int, help="training steps per pretrained model (default 600)")
    d.add_argument("--json", help="write the results as JSON to this path")
    d.add_argument("--plots", help="directory for PNG plots")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_demo)

    t = sub.add_parser("train", help="pretrain a (compressed-by-design) Chronos-Bolt from a "
                                     "JSON config; resumes from --out/checkpoints")
    t.add_argument("config", help="JSON config file (see lowrank_jax.cli.train_cmd)")
    t.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, model")
    t.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        if os.environ.get("LOWRANK_JAX_DEBUG"):
            raise
        print(f"lowrank-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
