"""Save and restore time of train-state checkpoints (``train.Checkpointer``) and parameter
checkpoints (``io.save_params`` / ``io.load_params``) on this machine.

A train state of about ``--params`` million parameters (Dense and LowRank leaves, Adam, so the
state holds three times as many floats) is saved ``--repeats`` times into a fresh step and
restored as many times; the median wall-clock times are printed, with the size on disk.
Checksums are computed on save and verified on restore (the default).

    PYTHONPATH=$PWD python benchmarks/checkpoints.py --params 4 --repeats 5
"""

import argparse
import os
import statistics
import tempfile
import time

import jax
import optax

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
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=4.0, help="millions of parameters")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
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
    print(f"train state: {n / 1e6:.1f} M values, {step_bytes / 2**20:.1f} MiB per step")
    print(f"| what | median s ({a.repeats} runs) |\n|---|---|")
    print(f"| Checkpointer.save | {save:.3f} |\n| Checkpointer.restore | {restore:.3f} |")
    print(f"| io.save_params (parameters only) | {psave:.3f} |")
    print(f"| io.load_params (parameters only) | {pload:.3f} |")


if __name__ == "__main__":
    main()
