"""No long silent stretch: every phase is announced on stderr, live lines show the elapsed time,
`--no-progress` turns them off."""

import time

import numpy as np

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.cli.status import Status
from lowrank_jax.io import save_params


def test_phase_shows_a_live_elapsed_line_and_its_duration(capsys):
    status = Status("x", bars=True, live_after=0.05)
    with status.phase("working"):
        time.sleep(0.8)
    err = capsys.readouterr().err
    assert err.startswith("lowrank-jax x: working ...\n")
    assert "working: 00:00 elapsed" in err  # the live line (tqdm, refreshed while it runs)
    assert err.rstrip().splitlines()[-1].startswith("lowrank-jax x: working: done in 0.")
    quiet = Status("x", bars=False, live_after=0.05)
    with quiet.phase("working"):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "elapsed" not in err and err.count("\n") == 2  # the two status lines only


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
