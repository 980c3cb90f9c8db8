"""The command line loses nothing: outputs are never inputs, only the tool's own outputs are
replaced, reports are whole files, and every expected failure is one line with exit status 2."""

import hashlib
import json
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

import lowrank_jax as lj
from lowrank_jax.cli.main import main
from lowrank_jax.io import is_checkpoint, load_params, save_params
from lowrank_jax.io.files import temp_path
from lowrank_jax.recipes import outputs


def tiny_params(seed=0, d=16):
    r = np.random.default_rng(seed)
    w = {n: lj.Dense(np.asarray(r.normal(size=(d, d)), np.float32)) for n in "qkvo"}
    attn = {"qk": lj.QueryKey.uniform(w["q"], w["k"], 4), "v": w["v"], "o": w["o"],
            "heads": lj.HeadLayout.uniform(4, d // 4, 0.5)}
    return {"layers": [{"attn": attn, "mlp": {"wi": lj.init_dense(jax.random.PRNGKey(seed), d, 8)}}]}


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    d = tmp_path_factory.mktemp("master") / "params"
    save_params(d, tiny_params())
    return d


@pytest.fixture
def ckpt(master, tmp_path):
    """A fresh copy of the checkpoint for tests that might (wrongly) change it."""
    d = tmp_path / "in" / "params"
    shutil.copytree(master, d)
    return d


def digest(path) -> str:
    """A hash of every file name and byte under ``path`` (or of the file)."""
    h = hashlib.sha256()
    path = str(path)
    if os.path.isfile(path):
        h.update(open(path, "rb").read())
        return h.hexdigest()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, path).encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


def error_line(err: str, command: str) -> str:
    """The one error line; nothing after it, no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    hits = [i for i, ln in enumerate(lines) if ln.startswith(f"lowrank-jax {command}: error: ")]
    assert len(hits) == 1 and hits[0] == len(lines) - 1, err
    return lines[-1]


# ---------------------------------------------------------------------------------------------
# Outputs never overlap inputs.

def test_compress_refuses_out_equal_to_or_holding_the_input(ckpt, tmp_path, monkeypatch, capsys):
    before = digest(ckpt.parent)
    args = ["compress", str(ckpt), "--eps", "0.5", "--no-eval", "--no-progress", "--overwrite"]
    # the input itself (a lowrank_jax checkpoint, so --overwrite alone would have replaced it)
    assert main(args + ["--out", str(ckpt)]) == 2
    line = error_line(capsys.readouterr().err, "compress")
    assert "--out" in line and "is the input" in line and str(ckpt) in line
    # '.' holding the input, a parent of it, a directory inside it
    monkeypatch.chdir(ckpt.parent)
    for out, how in ((".", "contains the input"), (str(ckpt.parent.parent), "contains the input"),
                     (str(ckpt / "sub"), "lies inside the input")):
        assert main(args + ["--out", out]) == 2
        assert how in error_line(capsys.readouterr().err, "compress")
    # a symbolic link to the input is the input
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    assert main(args + ["--out", str(link)]) == 2
    assert "is the input" in error_line(capsys.readouterr().err, "compress")
    assert digest(ckpt.parent) == before


def test_convert_refuses_out_inside_the_source(tmp_path, capsys):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "bert"}')
    (src / "model.safetensors").write_bytes(b"not read: refused before")
    before = digest(src)
    for out in (src, src / "native"):
        assert main(["convert", str(src), "--out", str(out), "--overwrite", "--no-progress"]) == 2
        assert str(src) in error_line(capsys.readouterr().err, "convert")
    assert digest(src) == before and sorted(os.listdir(src)) == ["config.json",
                                                                 "model.safetensors"]


def test_overwrite_replaces_only_a_checkpoint(ckpt, tmp_path, capsys):
    base = ["compress", str(ckpt), "--eps", "0.5", "--no-eval", "--no-progress"]
    # somebody's directory: refused with and without --overwrite, untouched
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    before = digest(theirs)
    for extra in ([], ["--overwrite"]):
        assert main(base + ["--out", str(theirs)] + extra) == 2
        line = error_line(capsys.readouterr().err, "compress")
        assert str(theirs) in line and "did not write" in line
    assert digest(theirs) == before
    # a file at --out: refused
    f = tmp_path / "file.bin"
    f.write_bytes(b"data")
    assert main(base + ["--out", str(f), "--overwrite"]) == 2
    assert "a file" in error_line(capsys.readouterr().err, "compress")
    assert f.read_bytes() == b"data"
    # the tool's own output: refused without --overwrite (saying how), replaced with it
    out = tmp_path / "small"
    assert main(base + ["--out", str(out)]) == 0
    assert main(base + ["--out", str(out)]) == 2
    assert "--overwrite" in error_line(capsys.readouterr().err, "compress")
    assert main(["compress", str(ckpt), "--rank", "2", "--no-progress", "--out", str(out),
                 "--overwrite"]) == 0
    assert is_checkpoint(out)
    assert load_params(out)["layers"][0]["attn"]["v"].rank == 2
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporaries left


# ---------------------------------------------------------------------------------------------
# JSON reports.

def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_json_report_replaces_only_a_report(ckpt, tmp_path, capsys):
    base = ["analyze", str(ckpt), "--eps", "0.1", "--no-progress"]
    # a file that is not a report (a plan, a config): refused, unchanged
    plan = tmp_path / "plan.json"
    plan.write_text('{"steps": []}')
    assert main(base + ["--json", str(plan)]) == 2
    line = error_line(capsys.readouterr().err, "analyze")
    assert str(plan) in line and "not a lowrank-jax JSON report" in line
    assert plan.read_text() == '{"steps": []}'
    # checked before any work, for every command with --json (the demo would run minutes)
    assert main(["demo", "--quick", "--no-progress", "--json", str(plan)]) == 2
    assert "not a lowrank-jax JSON report" in error_line(capsys.readouterr().err, "demo")
    assert plan.read_text() == '{"steps": []}'
    # an empty file, then a previous report: written over; a stale temporary of a killed
    # write is removed
    rep = tmp_path / "rep.json"
    rep.write_text("")
    stale = temp_path(rep, "tmp", pid=dead_pid())
    with open(stale, "w") as fh:
        fh.write('{"half": ')
    assert main(base + ["--json", str(rep)]) == 0
    first = json.loads(rep.read_text())
    assert first["lowrank_jax_report"]["command"] == "analyze"
    assert {w["path"] for w in first["weights"]} >= {"layers/0/attn/v", "layers/0/mlp/wi"}
    assert not os.path.exists(stale)
    assert main(base[:3] + ["0.5", "--no-progress", "--json", str(rep)]) == 0
    second = json.loads(rep.read_text())
    assert list(second["weights"][0]["eps_rank"]) == ["0.5"]
    assert sorted(os.listdir(tmp_path)) == ["in", "plan.json", "rep.json"]
    # inside the input or the output directory: refused before anything runs
    out = tmp_path / "small"
    for path, what in ((ckpt / "r.json", "inside the input"), (out / "r.json", "inside the output")):
        assert main(["compress", str(ckpt), "--eps", "0.5", "--no-progress", "--out", str(out),
                     "--json", str(path)]) == 2
        assert what in error_line(capsys.readouterr().err, "compress")
    assert not out.exists()


def test_report_is_valid_json_without_nan(tmp_path):
    path = tmp_path / "r.json"
    outputs.write_report(path, {"a": float("nan"), "b": [1.0, float("inf")], "c": "x"},
                         command="test")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["a"] is None and doc["b"] == [1.0, None] and doc["c"] == "x"


# ---------------------------------------------------------------------------------------------
# Expected failures: one line, exit 2, the file / key named; nothing written.

def write(path, text):
    path.write_text(text)
    return str(path)


CASES = {
    "json is a directory": (lambda d, c: ["analyze", c, "--json", str(d)], "is a directory"),
    "json under a file": (lambda d, c: ["analyze", c, "--json", write(d / "f", "x") + "/r.json"],
                          "is a file, not a directory"),
    "out under a file": (lambda d, c: ["compress", c, "--eps", "0.5", "--out",
                                       write(d / "f", "x") + "/o"], "is a file, not a directory"),
    "plan is a directory": (lambda d, c: ["compress", c, "--plan", str(d)], "is a directory"),
    "plan not JSON": (lambda d, c: ["compress", c, "--plan", write(d / "p.json", "{steps")],
                      "not valid JSON"),
    "plan without steps": (lambda d, c: ["compress", c, "--plan",
                                         write(d / "p.json", '{"stepz": []}')], "'steps'"),
    "plan step without method": (lambda d, c: ["compress", c, "--plan", write(
        d / "p.json", '{"steps": [{"rules": ["attn/v$"], "settings": {"rank": 2}}]}')],
        "'method'"),
    "bad regular expression": (lambda d, c: ["compress", c, "--eps", "0.5", "--rule", "attn/("],
                               "attn/("),
    "no setting": (lambda d, c: ["compress", c], "--eps"),
    "bad schedule": (lambda d, c: ["compress", c, "--schedule", "power:x:1"], "power:x:1"),
    "time runs": (lambda d, c: ["compress", c, "--eps", "0.5", "--time-runs", "0"],
                  "--time-runs"),
    "input is a file": (lambda d, c: ["analyze", write(d / "f.json", "{}")], "f.json"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expected_failures_are_one_line_with_status_2(case, ckpt, tmp_path, capsys):
    build, needle = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    argv = build(work, str(ckpt)) + ["--no-progress"]
    before = digest(tmp_path)
    assert main(argv) == 2
    line = error_line(capsys.readouterr().err, argv[0])
    assert needle in line, line
    assert digest(tmp_path) == before  # nothing written, nothing removed


def test_corrupt_checkpoint_is_one_line(ckpt, capsys):
    (ckpt / "tree.json").write_text('{"format": "lowrank_jax.params", "vers')
    assert main(["compress", str(ckpt), "--eps", "0.5", "--no-progress"]) == 2
    line = error_line(capsys.readouterr().err, "compress")
    assert "tree.json" in line and "not valid JSON" in line


def test_os_errors_are_one_line(ckpt, tmp_path, monkeypatch, capsys):
    """A failure of the filesystem (here: no permission to rename the report into place, which
    root cannot provoke with mode bits) names the paths and says what was expected."""
    def denied(src, dst):
        raise PermissionError(13, "Permission denied", str(src), None, str(dst))

    monkeypatch.setattr(outputs.os, "replace", denied)  # over a previous report
    monkeypatch.setattr(outputs, "rename_noreplace", denied)  # to a new path
    rep = tmp_path / "r.json"
    assert main(["analyze", str(ckpt), "--no-progress", "--json", str(rep)]) == 2
    line = error_line(capsys.readouterr().err, "analyze")
    assert "Permission denied" in line and str(rep) in line and "no permission" in line
    assert os.listdir(tmp_path) == ["in"]  # the temporary file is gone too
    monkeypatch.setenv("LOWRANK_JAX_DEBUG", "1")
    with pytest.raises(PermissionError):
        main(["analyze", str(ckpt), "--no-progress", "--json", str(rep)])


def test_os_error_with_a_message_keeps_it(ckpt, monkeypatch, capsys):
    import lowrank_jax.analysis

    def missing(*args, **kwargs):
        raise FileNotFoundError("series file /data/x.csv not found")

    monkeypatch.setattr(lowrank_jax.analysis, "analyze", missing)
    assert main(["analyze", str(ckpt), "--no-progress"]) == 2
    assert "series file /data/x.csv not found" in error_line(capsys.readouterr().err, "analyze")


def test_a_bug_keeps_its_traceback(ckpt, monkeypatch):
    import lowrank_jax.analysis

    def broken(*args, **kwargs):
        return {}["no such key"]

    monkeypatch.setattr(lowrank_jax.analysis, "analyze", broken)
    with pytest.raises(KeyError):
        main(["analyze", str(ckpt), "--no-progress"])


def test_json_safe_plain_values_and_no_nan():
    """Reports and the train command's summary share one conversion: NumPy scalars become
    Python numbers, non-finite numbers ``null``, containers are converted throughout."""
    got = outputs.json_safe({"a": np.float32(1.5), "b": [np.int64(3), float("nan")],
                             "c": (np.float64("inf"), True, None, "x"), "d": {"e": -np.inf}})
    assert got == {"a": 1.5, "b": [3, None], "c": [None, True, None, "x"], "d": {"e": None}}
    assert type(got["a"]) is float and type(got["b"][0]) is int and got["c"][1] is True
    json.dumps(got, allow_nan=False)  # valid JSON
