"""The path of one ``lowrank-jax`` command through the library's files.

How easy a command is to follow: run it once (a tiny random T5 saved locally, then
``lowrank-jax compress CKPT --rank 4 --out OUT``), record every call the command's own function
makes into lowrank_jax (its direct callees, with ``sys.setprofile``), and count

* **stops**: the callees' files in call order, consecutive calls into the same file counted
  once;
* **files**: the distinct files among them;
* **returns**: stops in a file the path had already left before (the "back and forth").

``--depth 2`` also counts the calls those callees make (library code between the command
and the work).

The command's own file is counted like any other. Prints the path and writes JSON::

    python -m benchmarks.machine call_path [--json call_path.json]
"""

from __future__ import annotations

import os
import sys
import tempfile

from benchmarks import _harness as H


def command_function():
    """The function the CLI dispatches ``compress`` to (looked up, not hard-coded to a file)."""
    from lowrank_jax.cli import main as cli_main

    for name in ("cmd_compress",):
        if hasattr(cli_main, name):
            return getattr(cli_main, name).__code__
    from lowrank_jax.cli import compress_cmd  # thin-command layout

    return compress_cmd.run.__code__


def tiny_checkpoint(root: str) -> str:
    import jax

    from lowrank_jax.io import save_model
    from lowrank_jax.models import T5Config, t5

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16)
    path = os.path.join(root, "t5")
    save_model(path, cfg, t5.init(jax.random.PRNGKey(0), cfg))
    return path


def _within(frame, target, depth: int) -> bool:
    """Whether ``target`` is among the ``depth`` callers above ``frame``."""
    f = frame.f_back
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code is target:
            return True
        f = f.f_back
    return False


def trace(argv: list[str], depth: int = 1) -> list[str]:
    """Files (relative to the package) of the lowrank_jax functions the command calls, down to
    ``depth`` calls below it (1: its direct callees)."""
    import lowrank_jax
    from lowrank_jax.cli.main import main

    root = os.path.dirname(lowrank_jax.__file__)
    target = command_function()
    level = [0]
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            if frame.f_code is target:
                level[0] += 1
            elif level[0] and _within(frame, target, depth):
                path = frame.f_code.co_filename
                if path.startswith(root):
                    calls.append(os.path.relpath(path, os.path.dirname(root)))
        elif event == "return" and frame.f_code is target:
            level[0] -= 1

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    if code:
        raise SystemExit(f"the command exited with {code}")
    return calls


def summarize(calls: list[str]) -> dict:
    stops = [f for i, f in enumerate(calls) if i == 0 or calls[i - 1] != f]
    seen, returns = set(), 0
    for f in stops:
        if f in seen:
            returns += 1
        seen.add(f)
    return {"stops": len(stops), "files": len(set(stops)), "returns": returns, "path": stops}


def main(argv: list[str] | None = None) -> dict:
    p = H.parser(__doc__, quick="the same (it is short)")
    p.add_argument("--depth", type=int, default=1,
                   help="count calls down to this many levels below the command (default 1)")
    args = p.parse_args(argv)
    run = H.Run(__name__, argv, depth=args.depth)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_checkpoint(tmp)
        calls = trace(["compress", ckpt, "--rank", "4", "--out", os.path.join(tmp, "out"),
                       "--no-progress", "--no-eval"], depth=args.depth)
    result = summarize(calls)
    for i, f in enumerate(result["path"], 1):
        print(f"{i:3d}  {f}")
    result["depth"] = args.depth
    goals = {
        **H.goal(f"lowrank-jax compress (depth {args.depth}): files on the call path",
                 result["files"], measured=f"{result['stops']} stops in {result['files']} files"),
        **H.goal(f"lowrank-jax compress (depth {args.depth}): returns to a file already left",
                 result["returns"], measured=str(result["returns"])),
    }
    rows = [{"stop": i, "file": f} for i, f in enumerate(result["path"], 1)]
    return run.finish(args.json, rows=rows, goals=goals, **result)


if __name__ == "__main__":
    H.run_as_main(__spec__)
