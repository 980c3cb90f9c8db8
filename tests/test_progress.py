"""lowrank_jax._progress: the one decision (is the stream a terminal?) and what each side writes:
tqdm's bars, redrawn with carriage returns, on a terminal; whole lines at a low rate elsewhere."""

import io

import pytest

from lowrank_jax import _progress
from lowrank_jax._progress import PlainProgress, live, progress_bar


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self):
        return True


def test_live_only_for_a_terminal(monkeypatch, tmp_path):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: False)
    assert live(FakeTerminal()) is True
    assert live(io.StringIO()) is False
    with open(tmp_path / "log", "w") as f:  # a real file
        assert live(f) is False
    assert live(f) is False  # closed: isatty raises ValueError
    assert live(object()) is False  # no isatty


def test_live_in_a_notebook_where_tqdm_draws_a_widget(monkeypatch):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: True)
    assert live(io.StringIO()) is True
    assert live(object()) is False


def test_default_stream_is_stderr_at_call_time(monkeypatch):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: False)
    monkeypatch.setattr("sys.stderr", FakeTerminal())
    assert live() is True
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert live() is False


def test_a_terminal_gets_a_tqdm_bar(monkeypatch):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: False)
    term = FakeTerminal()
    assert list(progress_bar(range(3), desc="work", stream=term)) == [0, 1, 2]
    out = term.getvalue()
    assert "\r" in out and "work:   0%" in out and "0/3" in out  # tqdm, redrawn in place


def test_a_file_gets_plain_lines_at_a_low_rate(monkeypatch):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: False)
    f = io.StringIO()
    assert list(progress_bar(range(3), desc="work", unit="matrix", stream=f, every=0)) == [0, 1, 2]
    lines = f.getvalue().splitlines()
    assert "\r" not in f.getvalue() and f.getvalue().endswith("\n")
    # one line per item (every=0) and a last one at the end
    assert [ln.split(",")[0] for ln in lines] == [
        "work: 1/3 matrix (33%)", "work: 2/3 matrix (67%)", "work: 3/3 matrix (100%)",
        "work: 3/3 matrix (100%)"]
    assert all(ln.endswith("00:00 elapsed") for ln in lines)
    quiet = io.StringIO()  # a short loop at the default rate prints nothing
    assert list(progress_bar(range(3), desc="work", stream=quiet)) == [0, 1, 2]
    assert quiet.getvalue() == ""


def test_off_writes_nothing_anywhere(monkeypatch):
    monkeypatch.setattr(_progress, "_notebook_bars", lambda: False)
    for stream in (FakeTerminal(), io.StringIO()):
        bar = progress_bar(total=2, desc="work", enabled=False, stream=stream, every=0)
        bar.update(1)
        bar.set_postfix(loss="1.0")
        bar.close()
        assert list(progress_bar([4, 5], desc="work", enabled=False, stream=stream)) == [4, 5]
        assert stream.getvalue() == ""


def test_plain_progress_counts_and_postfix():
    f = io.StringIO()
    bar = PlainProgress(total=10, initial=4, desc="train", unit="step", stream=f, every=0)
    bar.set_postfix(loss="0.5000")
    bar.update(2)
    bar.set_postfix_str("svd")
    bar.update(0)
    bar.close()
    bar.close()  # once only
    lines = f.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("train: 6/10 step (60%), ") and lines[0].endswith(", loss=0.5000")
    assert lines[1].endswith("elapsed, svd")
    counted = io.StringIO()
    with PlainProgress(desc="x", stream=counted, every=0) as b:  # no total: the count only
        b.update(3)
    assert counted.getvalue().splitlines()[0].startswith("x: 3 it, ")
    with pytest.raises(TypeError):
        len(PlainProgress(iter([1]), desc="x"))
    assert len(PlainProgress([1, 2], desc="x")) == 2
