"""Fault injection: ``lowrank-jax train`` killed (SIGKILL) at random points several times in a
row and interrupted once with Ctrl-C (SIGINT), resumed each time, ends bit-identical to an
uninterrupted run: the same final parameters, the same ``metrics.jsonl`` (apart from the
wall-clock ``step_s``), the same ``summary.json``, and no temporary file left behind.

The runs are subprocesses of ``python -m lowrank_jax.cli.main train``: a tiny Chronos-Bolt on a
small CSV file, a checkpoint every 2 steps (most of the time is spent saving, so kills land in
the middle of saves as well as of steps). JAX's persistent compilation cache, shared by the
runs (the suite's own where it has one), keeps each restart short; it changes no result (the
same executable is loaded).
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from lowrank_jax.io import load_model
from lowrank_jax.leaves import materialize, named_leaves

STEPS = 12
CONFIG = {
    "model": {"d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 1, "num_decoder_layers": 1,
              "num_heads": 2, "context_length": 16, "prediction_length": 4, "patch_size": 4},
    "compression": {"rank": 2},
    "train": {"steps": STEPS, "batch_size": 4, "eval_every": 4, "eval_batches": 1,
              "checkpoint_every": 2, "keep": 2},
}
SEED = 20240611
N_KILLS = 3


def _write_inputs(tmp_path):
    t = np.arange(240)
    rows = ["date,a,b"] + [
        f"2020-01-{1 + i // 24:02d} {i % 24:02d}:00:00,{5 + np.sin(i / 7):.6f},{3 + np.cos(i / 4):.6f}"
        for i in t]
    csv = tmp_path / "series.csv"
    csv.write_text("\n".join(rows) + "\n")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**CONFIG, "data": {"csv": str(csv), "stride": 4}}))
    return str(cfg)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(cache):
    """The runs' environment; ``cache`` is their compilation cache where the suite has none
    (``conftest.py``'s, shared by every test and run, is used otherwise: its entries of an
    earlier test run make even the first start short)."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0",
               JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1")
    env.pop("LOWRANK_JAX_DEBUG", None)
    # the child imports this checkout even where the package is not installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def _start(cfg, run, env):
    cmd = [sys.executable, "-m", "lowrank_jax.cli.main", "train", cfg, "--out", str(run),
           "--no-progress"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _latest_checkpoint(run):
    d = run / "checkpoints"
    steps = [int(n) for n in os.listdir(d) if n.isdigit()] if d.is_dir() else []
    return max(steps, default=0)


def _last_logged_step(run):
    try:
        lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            continue
    return 0


def _interrupt(proc, run, rng, sig, *, early):
    """Send ``sig`` at a random point: during start-up (``early``), or a random fraction of a
    step after the log reached a random step past the newest checkpoint."""
    if early:
        time.sleep(rng.uniform(0.5, 4.0))
    else:  # past what the log held at the start (its stale tail is cut off on resume)
        done = max(_latest_checkpoint(run), _last_logged_step(run))
        target = min(STEPS - 1, done + int(rng.integers(1, 4)))
        while proc.poll() is None and _last_logged_step(run) < target:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
    if proc.poll() is not None:
        return False  # finished first
    proc.send_signal(sig)
    proc.wait(120)
    return True


def _records(run):
    return [{k: v for k, v in json.loads(line).items() if k != "step_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _temporaries(run):
    return [os.path.join(d, n) for d, dirs, files in os.walk(run) for n in dirs + files
            if "tmp" in n.lower()]


def test_kills_and_ctrl_c_resume_to_the_uninterrupted_run(tmp_path):
    cfg = _write_inputs(tmp_path)
    env = _env(tmp_path / "jax_cache")
    ref_run, run = tmp_path / "reference", tmp_path / "run"
    rng = np.random.default_rng(SEED)
    t0 = time.perf_counter()
    # the uninterrupted run; once it has compiled (and filled the cache), the interrupted runs
    # go alongside it
    reference = _start(cfg, ref_run, env)
    # interruptions: one during start-up, then at random points of training; one is Ctrl-C
    plan = [(signal.SIGKILL, True)] + [(signal.SIGKILL, False)] * (N_KILLS - 1)
    plan.insert(2, (signal.SIGINT, False))
    landed = []
    for i, (sig, early) in enumerate(plan):
        if i == 1:
            while reference.poll() is None and _last_logged_step(ref_run) < 4:  # 1st eval done
                time.sleep(0.05)
        proc = _start(cfg, run, env)
        before = _latest_checkpoint(run)
        t1 = time.perf_counter()
        if _interrupt(proc, run, rng, sig, early=early):
            landed.append((sig.name, before, _last_logged_step(run), round(time.perf_counter() - t1, 1)))
            _, err = proc.communicate()
            if sig == signal.SIGINT:
                assert proc.returncode == 130, err
                assert "Traceback" not in err and "interrupted" in err, err
            else:
                assert proc.returncode == -signal.SIGKILL
    final = _start(cfg, run, env)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    out_ref, err_ref = reference.communicate(timeout=300)
    assert reference.returncode == 0, err_ref
    elapsed = time.perf_counter() - t0
    print(f"interruptions (signal, checkpoint before, logged step at the signal): {landed}; "
          f"{elapsed:.0f} s")
    # the interruptions hit training, not only start-up, and the final run resumed
    assert sum(1 for s, _, logged, _ in landed if logged > 0) >= N_KILLS - 1, landed
    assert "resuming from step" in out

    _, want = load_model(ref_run / "model")
    _, got = load_model(run / "model")
    pairs = list(zip(named_leaves(want), named_leaves(got), strict=True))
    for (pa, a), (pb, b) in pairs:  # bit-identical
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(materialize(a)), np.asarray(materialize(b)))
    assert _records(run) == _records(ref_run)
    assert [r["step"] for r in _records(run)] == list(range(1, STEPS + 1))
    assert [r["step"] for r in _records(run) if "eval_wql" in r] == [4, 8, 12]
    assert json.loads((run / "summary.json").read_text()) == json.loads(
        (ref_run / "summary.json").read_text())
    assert _temporaries(run) == [] and _temporaries(ref_run) == []
    assert sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl", "model", "run.json",
                                       "summary.json"]
