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


def _num_layers(params) -> int | None:
    """The deepest stack's layer count (for --schedule), read from the parameters."""
    from lowrank_jax.leaves import layer_index, named_leaves

    idx = [layer_index(p) for p, _ in named_leaves(params)]
    idx = [i for i in idx if i is not None]
    return max(idx) + 1 if idx else None


def _load(path):
    """``(config or None, params, metadata)`` of a params or model checkpoint (0.1 model
    checkpoints are upgraded to the current attention layout)."""
    from lowrank_jax.io import load_metadata, load_model, load_params

    meta = load_metadata(path)
    config, params = load_model(path) if "config" in meta else (None, load_params(path))
    return config, params, {k: v for k, v in meta.items() if v is not None}


def cmd_analyze(args) -> int:
    from lowrank_jax.analysis import analyze

    config, params, meta = _load(args.params)
    report = analyze(params, eps=args.eps, pattern=args.pattern, progress=not args.no_progress)
    print(report.format_table())
    out = report.to_dict()
    if args.sweep or args.sweep_heads:
        out["sweep"] = _analyze_sweep(args, config, params)
    _write_json(args.json, out)
    return 0


def _analyze_sweep(args, config, params) -> dict:
    """``analyze --sweep``: the ratio -> error curve (Table 2 of "Understanding Transformers for
    Time Series") and per-head sweeps."""
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
        result["heads"] = _head_sweeps(args, params)
    return result


def _head_sweeps(args, params) -> list[dict]:
    """head_rank_sweep on every attention block, on synthetic N(0, 1) inputs. Head counts,
    widths and the logit scale come from each block's parameters."""
    import numpy as np

    from lowrank_jax.compress import attention_blocks, head_rank_sweep

    rng = np.random.default_rng(0)
    out = []
    for prefix, block in attention_blocks(params):
        qk = block["qk"]
        k = min(qk.d_q_in, max(qk.widths))
        ranks = sorted({r for r in (args.sweep_ranks or []) if 0 <= r <= k}) or sorted(
            {min(2 ** i, k) for i in range(int(np.log2(k)) + 1)} | {k})
        x = rng.normal(size=(2, 32, qk.d_q_in)).astype(np.float32)
        kv = None if qk.d_k_in == qk.d_q_in and "cross" not in prefix else rng.normal(
            size=(2, 32, qk.d_k_in)).astype(np.float32)
        err = np.asarray(head_rank_sweep(block, x, None, ranks, kv=kv))
        out.append({"block": prefix, "ranks": ranks, "rel_error": err.tolist()})
    print(f"\nper-head rank sweep (q/k/v of one head truncated, synthetic N(0, 1) inputs, "
          f"relative output error; {len(out)} attention blocks)")
    for b in out:
        print(f"{b['block']}  ranks {b['ranks']}")
        for h, row in enumerate(b["rel_error"]):
            print(f"  head {h:>2}: " + " ".join(f"{e:.2e}" for e in row))
    return out


def cmd_compress(args) -> int:
    import jax

    from lowrank_jax.compress import Plan, Step, apply_plan
    from lowrank_jax.io import save_model, save_params

    config, params, meta = _load(args.params)
    if args.plan:
        if any(v is not None for v in (args.eps, args.rank, args.ratio, args.schedule)):
            raise SystemExit("--plan replaces --eps/--rank/--ratio/--schedule; give one or the "
                             "other")
        plan = Plan.from_file(args.plan)
    else:
        settings: dict = {"per_head": args.per_head, "allocation": args.allocation}
        if args.schedule:
            from lowrank_jax.compress import interpolation_schedule, power_schedule

            kind, *vals = args.schedule.split(":")
            n_layers = args.num_layers or _num_layers(params)
            if not n_layers:
                raise SystemExit("--schedule needs --num-layers (no 'layers/<i>/' in the paths)")
            nums = [float(v) for v in vals]
            if kind == "power" and len(nums) == 2:
                settings["schedule"] = power_schedule(nums[0], nums[1], int(n_layers))
            elif kind == "interp" and len(nums) == 3:
                settings["schedule"] = interpolation_schedule(int(nums[0]), int(nums[1]), nums[2],
                                                              int(n_layers))
            else:
                raise SystemExit("--schedule: expected 'power:D0:ALPHA' or 'interp:R1:RD:ALPHA', "
                                 f"got {args.schedule!r}")
        elif args.eps is not None:
            settings["eps"] = args.eps
        elif args.rank is not None:
            settings["rank"] = args.rank
        elif args.ratio is not None:
            settings["ratio"] = args.ratio
        else:
            raise SystemExit("compress: give --plan, or one of --eps/--rank/--ratio/--schedule")
        plan = Plan((Step("svd", _parse_rules(args.rule), settings),))
    new_params, report = apply_plan(params, plan, key=jax.random.PRNGKey(args.seed),
                                    config=config, progress=not args.no_progress)
    print(report.format_table())
    out = report.to_dict()
    out["plan"] = plan.to_dict()
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
        meta_out["plan"] = plan.to_dict()
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
    save_model(args.out, config, params, metadata={"source": os.path.abspath(args.src)},
               overwrite=args.overwrite)
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
    a.add_argument("--pattern", help="only weights whose path matches this regular expression")
    a.add_argument("--json", help="write the report as JSON to this path")
    a.add_argument("--no-progress", action="store_true")
    a.add_argument(
        "--sweep",
        action="store_true",
        help="compression ratio -> output error curve over --sweep-eps, "
        "compiled once; model checkpoints only get the output error",
    )
    a.add_argument("--sweep-eps", type=float, nargs="+",
                   default=[0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01])
    a.add_argument(
        "--sweep-heads",
        action="store_true",
        help="per-head rank sweep of every attention block (synthetic N(0, 1) inputs; head "
        "counts and widths come from the parameters)",
    )
    a.add_argument("--sweep-ranks", type=int, nargs="+",
                   help="ranks for --sweep-heads (default: powers of 2 up to d_head)")
    a.set_defaults(func=cmd_analyze)

    c = sub.add_parser("compress", help="truncated-SVD compression of a saved parameter tree")
    c.add_argument("params", help="directory written by lowrank_jax.io.save_params")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--plan", help="a JSON compression plan: {'steps': [{'method', 'rules', "
                   "'settings'}]} (see lowrank_jax.compress.Plan)")
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
    c.add_argument("--per-head", action="store_true",
                   help="per-head sketching of q/k/v (head widths come from the parameters)")
    c.add_argument("--seed", type=int, default=0, help="PRNG seed of methods that draw numbers")
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
