"""Save and restore time of train-state checkpoints (``train.Checkpointer``) and parameter
checkpoints (``io.save_params`` / ``io.load_params``) on this machine.

A train state of about ``--params`` million parameters (Dense and LowRank leaves, Adam, so the
state holds three times as many floats) is saved ``--repeats`` times into a fresh step and
restored as many times; the median wall-clock times are printed, with the size on disk.
Checksums are computed on save and verified on restore (the default).

    python -m benchmarks.machine checkpoints --params 4 --repeats 5
"""

from __future__ import annotations

import os
import tempfile

import jax
import optax

from benchmarks import _harness as H
from lowrank_jax import io as lio
from lowrank_jax.leaves import init_dense, init_lowrank
from lowrank_jax.train import Checkpointer, full_params, init_train_state


def _params(millions: float):
    d = 512
    n = max(1, round(millions * 1e6 / (d * d + 2 * d * 64)))  # Dense d x d + LowRank rank 64
    keys = jax.random.split(jax.random.key(0), 2 * n)
    return {f"layer{i}": {"dense": init_dense(keys[2 * i], d, d, bias=True),
                          "low": init_lowrank(keys[2 * i + 1], d, d, 64)} for i in range(n)}


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _median_s(fn, repeats: int) -> float:
    """Median seconds of ``fn(i)`` for ``i = 0 .. repeats - 1``, called in that order (a
    restore reads what the save of the same ``i`` wrote, so the calls are not interleaved)."""
    count = iter(range(repeats))
    return H.time_calls({"call": lambda: fn(next(count))}, runs=repeats,
                        warmup=0).median("call")


def main(argv=None) -> dict:
    ap = H.parser(__doc__, quick="1 M parameters, 2 repeats")
    ap.add_argument("--params", type=float, default=None,
                    help="millions of parameters (default 4; quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5; quick 2")
    a = ap.parse_args(argv)
    a.params = a.params or (1.0 if a.quick else 4.0)
    a.repeats = a.repeats or (2 if a.quick else 5)
    run = H.Run(__name__, argv, params_millions=a.params, repeats=a.repeats)
    params = _params(a.params)
    state = init_train_state(params, optax.adam(1e-3), key=jax.random.key(1))
    jax.block_until_ready(state)
    like = jax.eval_shape(lambda: state)
    n = sum(x.size for x in jax.tree_util.tree_leaves(state))
    with tempfile.TemporaryDirectory() as tmp:
        ck = Checkpointer(os.path.join(tmp, "ck"), max_to_keep=None)
        save = _median_s(lambda i: ck.save(state, step=i + 1), a.repeats)
        restore = _median_s(lambda i: jax.block_until_ready(ck.restore(i + 1, like=like)),
                            a.repeats)
        step_bytes = _size(ck.step_dir(1))
        p = full_params(state)
        psave = _median_s(lambda i: lio.save_params(os.path.join(tmp, f"p{i}"), p), a.repeats)
        pload = _median_s(lambda i: jax.block_until_ready(lio.load_params(
            os.path.join(tmp, f"p{i}"))), a.repeats)
    print(f"# {run.describe()}; train state: {n / 1e6:.1f} M values, "
          f"{step_bytes / 2**20:.1f} MiB per step")
    rows = [{"what": "Checkpointer.save", "median_s": save},
            {"what": "Checkpointer.restore", "median_s": restore},
            {"what": "io.save_params (parameters only)", "median_s": psave},
            {"what": "io.load_params (parameters only)", "median_s": pload}]
    print(f"| what | median s ({a.repeats} runs) |\n|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['median_s']:.3f} |")
    return run.finish(a.json, rows=rows, state_values=n, step_bytes=step_bytes)


if __name__ == "__main__":
    H.run_as_main(__spec__)
