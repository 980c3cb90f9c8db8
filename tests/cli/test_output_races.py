"""Outputs of the command line: two writers of one ``--out`` never both succeed (the later one
exits 2 naming the option, the first one's output stays whole), and an output that cannot be
written is refused before any model is loaded, naming its option."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.io import files, is_checkpoint, load_params, save_model, save_params
from lowrank_jax.recipes import outputs

REPO = Path(lj.__file__).resolve().parents[1]


def tiny_params(seed=0, d=16):
    r = np.random.default_rng(seed)
    w = {n: lj.Dense(np.asarray(r.normal(size=(d, d)), np.float32)) for n in "qkvo"}
    attn = {"qk": lj.QueryKey.uniform(w["q"], w["k"], 4), "v": w["v"], "o": w["o"],
            "heads": lj.HeadLayout.uniform(4, d // 4, 0.5)}
    return {"layers": [{"attn": attn}]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("in") / "params"
    save_params(d, tiny_params())
    return d


@pytest.fixture(scope="module")
def model_ckpt(tmp_path_factory):
    from lowrank_jax.models import t5
    from lowrank_jax.models.t5 import T5Config

    cfg = T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                   num_heads=2, feed_forward_proj="relu")
    d = tmp_path_factory.mktemp("model") / "t5"
    save_model(d, cfg, t5.init(jax.random.PRNGKey(0), cfg))
    return d


def v_rank(path) -> int:
    return load_params(path)["layers"][0]["attn"]["v"].rank


def error_line(err: str, command: str) -> str:
    """The one error line; nothing after it, no traceback, no library function's words."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    hits = [i for i, ln in enumerate(lines) if ln.startswith(f"lowrank-jax {command}: error: ")]
    assert len(hits) == 1 and hits[0] == len(lines) - 1, err
    line = lines[-1]
    assert "overwrite=True" not in line and "save_params" not in line, line
    return line


def hidden(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


# ---------------------------------------------------------------------------------------------
# Two writers: deterministic interleavings.

def test_out_written_by_another_run_while_this_one_worked(ckpt, tmp_path, monkeypatch, capsys):
    """Staggered runs: the other run's checkpoint appears after this run's checks, before its
    save starts. Refused in the command's words; the other checkpoint is untouched."""
    import lowrank_jax.compress

    out = tmp_path / "S"
    real = lowrank_jax.compress.apply_plan

    started = []

    def other_run_finishes(*args, **kw):
        result = real(*args, **kw)
        if not started:  # the other run, whose own apply_plan comes here too
            started.append(True)
            assert main(["compress", str(ckpt), "--rank", "3", "--no-progress", "--out",
                         str(out)]) == 0
        return result

    monkeypatch.setattr(lowrank_jax.compress, "apply_plan", other_run_finishes)
    assert main(["compress", str(ckpt), "--rank", "2", "--no-progress", "--out", str(out)]) == 2
    line = error_line(capsys.readouterr().err, "compress")
    assert f"--out {out} exists" in line and "pass --overwrite" in line
    assert "while this command ran" in line
    assert v_rank(out) == 3
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("command", ["compress", "export"])
def test_out_that_appears_between_the_last_check_and_the_rename(command, ckpt, model_ckpt,
                                                                tmp_path, monkeypatch, capsys):
    """The other writer lands in the instant between the last check and the final rename."""
    out = tmp_path / "S"
    real = files.rename_noreplace
    landed = []

    def other_writer_lands(src, dst):
        if not landed and os.path.abspath(dst) == str(out):
            landed.append(True)
            save_params(out, tiny_params(seed=1))  # a complete checkpoint of someone else
        return real(src, dst)

    monkeypatch.setattr(files, "rename_noreplace", other_writer_lands)
    argv = (["compress", str(ckpt), "--rank", "2"] if command == "compress" else
            ["export", str(model_ckpt)])
    assert main(argv + ["--no-progress", "--out", str(out)]) == 2
    line = error_line(capsys.readouterr().err, command)
    assert f"--out {out}" in line and "while this command ran" in line
    assert landed and is_checkpoint(out)
    np.testing.assert_array_equal(  # the other writer's checkpoint, whole
        np.asarray(lj.materialize(load_params(out)["layers"][0]["attn"]["v"])),
        np.asarray(lj.materialize(tiny_params(seed=1)["layers"][0]["attn"]["v"])))
    assert hidden(tmp_path) == []


def test_overwrite_refuses_what_replaced_its_own_output_meanwhile(ckpt, tmp_path, monkeypatch,
                                                                  capsys):
    """--overwrite replaces a previous checkpoint; if someone's directory took its place while
    the command ran, that directory is refused and left as it is."""
    out = tmp_path / "S"
    assert main(["compress", str(ckpt), "--rank", "2", "--no-progress", "--out", str(out)]) == 0
    real = files.atomic_directory

    class Swap:
        def __call__(self, path, **kw):
            if os.path.abspath(path) == str(out):
                import shutil

                shutil.rmtree(out)
                out.mkdir()
                (out / "notes.txt").write_text("mine")
            return real(path, **kw)

    monkeypatch.setattr(files, "atomic_directory", Swap())
    assert main(["compress", str(ckpt), "--rank", "3", "--no-progress", "--out", str(out),
                 "--overwrite"]) == 2
    line = error_line(capsys.readouterr().err, "compress")
    assert f"--out {out}" in line and "refusing to replace" in line
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert hidden(tmp_path) == []


def test_json_report_that_appears_meanwhile_is_not_replaced(ckpt, tmp_path, monkeypatch, capsys):
    rep = tmp_path / "r.json"
    real = outputs.rename_noreplace

    def user_writes(src, dst):
        rep.write_text('{"mine": 1}')
        return real(src, dst)

    monkeypatch.setattr(outputs, "rename_noreplace", user_writes)
    assert main(["analyze", str(ckpt), "--no-progress", "--json", str(rep)]) == 2
    line = error_line(capsys.readouterr().err, "analyze")
    assert f"--json {rep}" in line and "not a lowrank-jax JSON report" in line
    assert rep.read_text() == '{"mine": 1}'
    assert hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Two writers: the real race, two processes.

def test_two_processes_writing_one_out(ckpt, tmp_path):
    """``compress --out S`` twice at once: exactly one exits 0, the other exits 2 with one line
    naming --out, and S is the winner's complete checkpoint (repeated)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for trial in range(3):
        out = tmp_path / f"S{trial}"
        procs = {rank: subprocess.Popen(
            [sys.executable, "-m", "lowrank_jax.cli.main", "compress", str(ckpt), "--rank",
             str(rank), "--no-progress", "--out", str(out)], env=env, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (2, 3)}
        done = {rank: (p.wait(timeout=300), p.stderr.read()) for rank, p in procs.items()}
        for p in procs.values():
            p.stdout.close()
            p.stderr.close()
        codes = sorted(rc for rc, _ in done.values())
        assert codes == [0, 2], done
        winner = next(rank for rank, (rc, _) in done.items() if rc == 0)
        loser_err = next(err for rc, err in done.values() if rc == 2)
        line = error_line(loser_err, "compress")
        assert f"--out {out}" in line, line
        assert is_checkpoint(out) and v_rank(out) == winner
        assert hidden(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Unwritable outputs: refused before anything is loaded, naming the option.

TRAIN_CONFIG = {"model": dict(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                              num_heads=2, context_length=16, prediction_length=4),
                "train": {"steps": 1, "batch_size": 8}}
PLOTS_PLAN = {"steps": [{"method": "truncatt_vo", "rules": ["attn/v$"], "settings": {"rank": 2}},
                        {"method": "btd", "rules": ["attn/qk$"],
                         "settings": {"flops_ratio": 0.7, "n_tokens": 6, "vo_rank": 2}}]}

# (command line before the output option, the output option)
CASES = [
    (["analyze", "{ckpt}"], "--json"),
    (["compress", "{ckpt}", "--rank", "2"], "--out"),
    (["compress", "{ckpt}", "--rank", "2"], "--json"),
    (["compress", "{ckpt}", "--plan", "{plan}"], "--plots"),
    (["convert", "{ckpt}"], "--out"),
    (["export", "{model}"], "--out"),
    (["export", "{model}", "--out", "{free}"], "--json"),
    (["prune", "{model}"], "--out"),
    (["prune", "{model}"], "--json"),
    (["prune", "{model}"], "--plots"),
    (["partition", "{ckpt}"], "--out"),
    (["partition", "{ckpt}"], "--json"),
    (["partition", "{ckpt}"], "--plots"),
    (["frontier", "{model}"], "--json"),
    (["frontier", "{model}"], "--plots"),
    (["frontier", "demo", "--quick"], "--cache"),
    (["sbt", "classify"], "--out"),
    (["sbt", "classify"], "--json"),
    (["sbt", "classify"], "--plots"),
    (["train", "{config}"], "--out"),
    (["demo", "--quick"], "--plots"),
    (["demo", "--quick"], "--json"),
]


@pytest.fixture
def loaders(monkeypatch):
    """Every way a command starts its real work, replaced by a recorder that fails."""
    import lowrank_jax.recipes.demo as demo
    import lowrank_jax.recipes.frontier as frontier
    import lowrank_jax.recipes.sbt_tasks as sbt_tasks
    import lowrank_jax.recipes.sources as sources
    import lowrank_jax.recipes.train as train

    called = []

    def recorder(name):
        def loader(*args, **kw):
            called.append(name)
            raise AssertionError(f"{name} was called before the outputs were checked")
        return loader

    for mod, name in ((sources, "load_source"), (demo, "_run_demo"), (frontier, "demo_model"),
                      (sbt_tasks, "load_classification_data"), (train, "build_model_config")):
        monkeypatch.setattr(mod, name, recorder(name))
    return called


@pytest.mark.parametrize("argv, option", CASES, ids=[f"{a[0]} {o}" for a, o in CASES])
def test_unwritable_output_is_refused_before_loading(argv, option, ckpt, model_ckpt, tmp_path,
                                                     loaders, capsys):
    pytest.importorskip("matplotlib")
    blocker = tmp_path / "a_file"  # as root, permissions stop nothing: the parent is a file
    blocker.write_text("x")
    target = blocker / ("r.json" if option == "--json" else "out")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLOTS_PLAN))
    config = tmp_path / "train.json"
    config.write_text(json.dumps(TRAIN_CONFIG))
    values = {"ckpt": str(ckpt), "model": str(model_ckpt), "plan": str(plan),
              "config": str(config), "free": str(tmp_path / "free")}
    args = [a.format(**values) for a in argv] + [option, str(target), "--no-progress"]
    before = sorted(os.listdir(tmp_path))
    assert main(args) == 2
    line = error_line(capsys.readouterr().err, argv[0])
    assert f"{option} {target}" in line and f"{blocker} is a file" in line, line
    assert loaders == []
    assert sorted(os.listdir(tmp_path)) == before and blocker.read_text() == "x"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("option", ["--out", "--json"])
def test_output_on_a_file_system_that_takes_no_new_entries(option, ckpt, loaders, capsys):
    """/proc takes no new entries, even from root: found by creating (and removing) a
    temporary entry where the output would go, before anything is loaded."""
    target = "/proc/lowrank_jax_test_output" + (".json" if option == "--json" else "")
    assert main(["compress", str(ckpt), "--rank", "2", option, target, "--no-progress"]) == 2
    line = error_line(capsys.readouterr().err, "compress")
    assert f"{option} {target}: cannot write there" in line and "/proc" in line
    assert loaders == [] and not os.path.exists(target)


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True,
                    reason="root writes into read-only directories")
def test_read_only_directory(ckpt, tmp_path, loaders, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["compress", str(ckpt), "--rank", "2", "--out", str(ro / "S"),
                     "--no-progress"]) == 2
    finally:
        ro.chmod(0o755)
    line = error_line(capsys.readouterr().err, "compress")
    assert f"--out {ro / 'S'}: cannot write there" in line
    assert loaders == [] and os.listdir(ro) == []


def test_write_that_fails_late_names_the_option(ckpt, tmp_path, monkeypatch, capsys):
    """A failure of the final write itself (the disk fills) names --out, not a temporary
    directory, and leaves nothing behind."""
    import errno

    import lowrank_jax.io.params as params_io

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".S.tmp-x"))

    monkeypatch.setattr(params_io.files, "write_text", full)
    out = tmp_path / "S"
    assert main(["compress", str(ckpt), "--rank", "2", "--no-progress", "--out", str(out)]) == 2
    line = error_line(capsys.readouterr().err, "compress")
    assert f"--out {out}: could not write it: No space left on device" in line
    assert ".tmp" not in line and not out.exists() and hidden(tmp_path) == []
