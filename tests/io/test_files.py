"""Atomic directory writes (lowrank_jax.io.files): the final rename never replaces what appeared
at the target while the output was written, and ``overwrite`` replaces only the writer's own
kind of output, checked on what is actually moved aside."""

import errno
import os

import pytest

from lowrank_jax.errors import OutputExistsError
from lowrank_jax.io import files


@pytest.fixture(params=["renameat2", "fallback"])
def rename_mode(request, monkeypatch):
    """Run a test with Linux's renameat2(RENAME_NOREPLACE) and with the portable fallback."""
    if request.param == "renameat2":
        if files._RENAMEAT2 is None:
            pytest.skip("no renameat2 on this system")
    else:
        monkeypatch.setattr(files, "_RENAMEAT2", None)
    return request.param


def listing(path) -> dict:
    """Every file under ``path`` with its text (or ``path``'s own text for a file)."""
    path = str(path)
    if os.path.islink(path):
        return {"link": os.readlink(path)}
    if os.path.isfile(path):
        return {"": open(path).read()}
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, path)] = open(p).read()
    return out


def leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


# ---------------------------------------------------------------------------------------------
# rename_noreplace

def make(kind: str, path):
    if kind == "file":
        path.write_text("theirs")
    elif kind == "symlink":
        path.symlink_to("/nonexistent-target")
    elif kind == "directory":
        path.mkdir()
        (path / "theirs.txt").write_text("theirs")
    elif kind == "empty directory":
        path.mkdir()


@pytest.mark.parametrize("src_kind", ["file", "directory"])
@pytest.mark.parametrize("dst_kind", ["file", "symlink", "directory", "empty directory"])
def test_rename_noreplace_refuses_anything_at_the_target(rename_mode, src_kind, dst_kind,
                                                         tmp_path):
    if rename_mode == "fallback" and src_kind == "directory" and dst_kind == "empty directory":
        pytest.skip("documented: rename(2) would replace an empty directory created in the "
                    "instant after the check; a directory present at the check is refused")
    src, dst = tmp_path / "src", tmp_path / "dst"
    make("directory" if src_kind == "directory" else "file", src)
    make(dst_kind, dst)
    before_src, before_dst = listing(src), listing(dst)
    with pytest.raises(FileExistsError) as info:
        files.rename_noreplace(src, dst)
    assert info.value.errno == errno.EEXIST
    assert listing(src) == before_src and listing(dst) == before_dst


@pytest.mark.parametrize("src_kind", ["file", "directory"])
def test_rename_noreplace_moves_to_a_free_path(rename_mode, src_kind, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make("directory" if src_kind == "directory" else "file", src)
    before = listing(src)
    files.rename_noreplace(src, dst)
    assert not os.path.lexists(src) and listing(dst) == before


# ---------------------------------------------------------------------------------------------
# atomic_directory: something appears between the check (block start) and the rename (end)

@pytest.mark.parametrize("kind", ["file", "symlink", "directory", "empty directory"])
def test_target_that_appears_meanwhile_is_not_replaced(rename_mode, kind, tmp_path):
    target = tmp_path / "out"
    with pytest.raises(OutputExistsError) as info:
        with files.atomic_directory(target, who="test") as tmp:
            with open(os.path.join(tmp, "out.txt"), "w") as f:
                f.write("ours")
            make(kind, target)  # another writer, between the check and the rename
    assert info.value.where == str(target)
    assert "appeared while" in str(info.value)
    expected = {"file": {"": "theirs"}, "symlink": {"link": "/nonexistent-target"},
                "directory": {"theirs.txt": "theirs"}, "empty directory": {}}[kind]
    assert listing(target) == expected
    assert leftovers(tmp_path) == []  # our temporary directory is gone


def test_another_writers_complete_output_is_kept(rename_mode, tmp_path):
    """Two writers of the same kind: the one that renames first wins, the other fails."""
    target = tmp_path / "out"
    with pytest.raises(OutputExistsError):
        with files.atomic_directory(target, who="test") as tmp_a:
            with open(os.path.join(tmp_a, "out.txt"), "w") as f:
                f.write("a")
            with files.atomic_directory(target, who="test") as tmp_b:  # finishes first
                with open(os.path.join(tmp_b, "out.txt"), "w") as f:
                    f.write("b")
    assert listing(target) == {"out.txt": "b"}
    assert leftovers(tmp_path) == []


def test_empty_directory_present_at_the_start_is_replaced(rename_mode, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with files.atomic_directory(target, who="test") as tmp:
        with open(os.path.join(tmp, "out.txt"), "w") as f:
            f.write("ours")
    assert listing(target) == {"out.txt": "ours"}
    assert leftovers(tmp_path) == []


def test_empty_directory_filled_meanwhile_is_not_replaced(rename_mode, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(OutputExistsError, match="appeared while"):
        with files.atomic_directory(target, who="test") as tmp:
            with open(os.path.join(tmp, "out.txt"), "w") as f:
                f.write("ours")
            (target / "theirs.txt").write_text("theirs")
    assert listing(target) == {"theirs.txt": "theirs"}
    assert leftovers(tmp_path) == []


def has_marker(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "out.txt"))


def test_overwrite_checks_what_it_moves_aside(rename_mode, tmp_path):
    """With overwrite, an output of the writer's kind is replaced; if it was swapped for
    something else while the new one was written, that is put back and refused."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "out.txt").write_text("previous")
    # the previous output is replaced
    with files.atomic_directory(target, overwrite=True, owned=has_marker, who="test") as tmp:
        with open(os.path.join(tmp, "out.txt"), "w") as f:
            f.write("new")
    assert listing(target) == {"out.txt": "new"}
    # swapped for someone's directory meanwhile: refused, theirs left in place
    with pytest.raises(OutputExistsError, match="refusing to replace"):
        with files.atomic_directory(target, overwrite=True, owned=has_marker, who="test") as tmp:
            with open(os.path.join(tmp, "out.txt"), "w") as f:
                f.write("newer")
            (target / "out.txt").unlink()
            (target / "theirs.txt").write_text("theirs")
    assert listing(target) == {"theirs.txt": "theirs"}
    assert leftovers(tmp_path) == []


def test_overwrite_loses_to_a_writer_that_lands_in_between(rename_mode, tmp_path, monkeypatch):
    """After the old output is moved aside, another writer's output lands at the target
    before the rename: this writer fails, the other's output stays, nothing is left behind."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "out.txt").write_text("previous")
    real = files.rename_noreplace

    def racing(src, dst):
        if str(dst) == str(target) and not os.path.lexists(dst):
            os.mkdir(dst)
            with open(os.path.join(dst, "out.txt"), "w") as f:
                f.write("other writer")
        return real(src, dst)

    monkeypatch.setattr(files, "rename_noreplace", racing)
    with pytest.raises(OutputExistsError, match="appeared while"):
        with files.atomic_directory(target, overwrite=True, owned=has_marker, who="test") as tmp:
            with open(os.path.join(tmp, "out.txt"), "w") as f:
                f.write("ours")
    assert listing(target) == {"out.txt": "other writer"}
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# save_pretrained's final rename (convert/export.py)

def test_save_pretrained_does_not_replace_an_export_that_appeared(tmp_path, monkeypatch):
    import jax

    from lowrank_jax.convert import export
    from lowrank_jax.models import t5
    from lowrank_jax.models.t5 import T5Config

    cfg = T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
                   num_heads=2, feed_forward_proj="relu")
    params = t5.init(jax.random.PRNGKey(0), cfg)
    target = tmp_path / "hf"
    real = files.rename_noreplace

    def other_writer_first(src, dst):
        if str(dst) == str(target) and not os.path.lexists(dst):
            os.mkdir(dst)
            with open(os.path.join(dst, "config.json"), "w") as f:
                f.write("{}")  # the other export finished between the last check and the rename
        return real(src, dst)

    monkeypatch.setattr(files, "rename_noreplace", other_writer_first)
    with pytest.raises(OutputExistsError, match="appeared while"):
        export.save_pretrained(cfg, params, target)
    assert listing(target) == {"config.json": "{}"}
    assert leftovers(tmp_path) == []
    # with overwrite the export replaces it, and an empty directory is always written into
    monkeypatch.setattr(files, "rename_noreplace", real)
    export.save_pretrained(cfg, params, target, overwrite=True)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export.save_pretrained(cfg, params, empty)
    assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]
    assert leftovers(tmp_path) == []
