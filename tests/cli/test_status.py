"""No long silent stretch: every phase is announced on stderr, live lines show the elapsed time,
`--no-progress` turns them off."""

import io
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax import _progress
from lowrank_jax.cli.main import main
from lowrank_jax.cli.status import Status
from lowrank_jax.io import save_model, save_params
from lowrank_jax.models import ChronosBoltConfig, T5Config, chronos_bolt


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_phase_shows_a_live_elapsed_line_and_its_duration(monkeypatch):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: False)
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    status = Status("x", bars=True, live_after=0.05)
    with status.phase("working"):
        time.sleep(0.8)
    err = term.getvalue()
    assert err.startswith("lowrank-jax x: working ...\n")
    assert "working: 00:00 elapsed" in err  # the live line (tqdm, refreshed while it runs)
    done = re.fullmatch(r"lowrank-jax x: working: done in (\d+\.\d) s", err.rstrip().splitlines()[-1])
    assert done and float(done.group(1)) >= 0.8, err  # at least the 0.8 s slept (more on a busy machine)
    for bars, stream in ((False, FakeTerminal()), (True, io.StringIO())):
        # --no-progress, or stderr not a terminal: the two status lines only
        monkeypatch.setattr("sys.stderr", stream)
        quiet = Status("x", bars=bars, live_after=0.05)
        with quiet.phase("working"):
            time.sleep(0.3)
        err = stream.getvalue()
        assert "elapsed" not in err and "\r" not in err and err.count("\n") == 2, (bars, err)


def test_analyze_sweeps_are_announced(tmp_path, capsys):
    r = np.random.default_rng(0)
    w = {n: lj.Dense(np.asarray(r.normal(size=(8, 8)), np.float32)) for n in "qkvo"}
    attn = {"qk": lj.QueryKey.uniform(w["q"], w["k"], 2), "v": w["v"], "o": w["o"],
            "heads": lj.HeadLayout.uniform(2, 4, 0.5)}
    save_params(tmp_path / "p", {"layers": [{"attn": attn}]})
    assert main(["analyze", str(tmp_path / "p"), "--sweep", "--sweep-eps", "0.5", "0.1",
                 "--sweep-heads", "--no-progress"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lowrank-jax analyze: ")]
    text = "\n".join(lines)
    for what in ("loading", "eps-ranks and spectra", "eps sweep over 2 values",
                 "per-head rank sweep of 1 attention blocks"):
        assert what in text, err
    assert "elapsed" not in err  # --no-progress


# The stages of `compress` with evaluation and an output: each one's status line(s).
COMPRESS_STAGES = ("loading ", "applying the plan (1 step: svd)",
                   "computing the singular values of the selected weights",
                   "evaluating the model (", "saving to ")


def _tiny_model(path):
    t5 = T5Config(vocab_size=2, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
                  num_heads=4)
    cfg = ChronosBoltConfig(t5=t5, context_length=32, prediction_length=8, input_patch_size=8,
                            input_patch_stride=8, use_reg_token=True)
    save_model(path, cfg, chronos_bolt.init(jax.random.PRNGKey(0), cfg))


def _stage_lines(err: str) -> str:
    return "\n".join(ln for ln in err.splitlines() if ln.startswith("lowrank-jax compress: "))


def test_compress_into_a_log_file_writes_whole_lines_only(tmp_path):
    # the command, progress on (no --no-progress), stderr a file: no bars (the svd step's bar
    # and the suggestions' spectra bar used to be written there), no carriage return
    _tiny_model(tmp_path / "m")
    log = tmp_path / "stderr.log"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}  # this checkout's lowrank_jax
    with open(log, "wb") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "lowrank_jax.cli.main", "compress", str(tmp_path / "m"),
             "--eps", "0.3", "--no-eval", "--out", str(tmp_path / "out")],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
    raw = log.read_bytes()
    assert proc.returncode == 0, raw.decode()
    assert b"\r" not in raw, raw[:2000]
    lines = _stage_lines(raw.decode())
    for stage in COMPRESS_STAGES:
        if stage != "evaluating the model (":
            assert stage in lines, (stage, lines)
    # every line of the log is a status line (a short run prints no loop lines)
    assert all(ln.startswith("lowrank-jax compress: ") for ln in raw.decode().splitlines()), raw


@pytest.mark.parametrize("progress", [True, False])
def test_compress_prints_each_stage_with_or_without_progress(progress, tmp_path, capsys):
    # stderr is not a terminal here (capsys): with progress on, no live line during the
    # evaluation either
    _tiny_model(tmp_path / "m")
    assert main(["compress", str(tmp_path / "m"), "--eps", "0.3", "--time-runs", "2",
                 "--out", str(tmp_path / "out")] + ([] if progress else ["--no-progress"])) == 0
    err = capsys.readouterr().err
    lines = _stage_lines(err)
    for stage in COMPRESS_STAGES:
        assert stage in lines, (stage, err)
    assert "evaluating the model" in lines and ": done in " in lines
    assert "\r" not in err and "elapsed" not in err
