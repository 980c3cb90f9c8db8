"""Atomic directory writes that never replace what they did not write.

A directory output is built in a temporary sibling (``.NAME.tmp-HOST-PID-RANDOM``) and renamed
into place when complete, so a reader sees either the old directory or the new one, never a
half-written one. Replacing an existing directory moves it aside first
(``.NAME.old-HOST-PID-RANDOM``) and deletes it only after the new one is in place.

Only directories the caller recognises as its own (a predicate, for checkpoints
:func:`lowrank_jax.io.is_checkpoint`) or empty directories are ever replaced; anything else at
the target path is refused with :class:`~lowrank_jax.errors.OutputExistsError`, even with
``overwrite=True``, and left untouched.

Without ``overwrite`` the final rename never replaces anything that appeared while the
directory was being written (another writer's output, someone's files): it fails with
:class:`~lowrank_jax.errors.OutputExistsError` and the target keeps what is there. Only the
empty directory that was at the target when the write started is replaced (it is removed just
before the rename, which fails if anything was put into it). The rename uses Linux's
``renameat2(RENAME_NOREPLACE)`` (:func:`rename_noreplace`); where the system lacks it, a plain
``rename(2)``, which refuses a file or a non-empty directory at the target but would replace
an empty directory created in the instant between the last check and the rename. With
``overwrite`` the existing target is moved aside and checked again *after* the move (so what
is checked is what gets deleted); anything that is not the writer's kind of output is put
back and refused.

A process killed in the middle leaves its temporary sibling behind. The next write to the same
target removes the leftovers of processes that are no longer running on this host; a
``.old-`` directory whose replacement never arrived (the kill fell between the two renames) is
moved back to the target instead, so the previous output is never lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import shutil
import socket
import sys
import uuid
from typing import Callable, Iterator

from lowrank_jax.errors import ConfigError, OutputExistsError

_KINDS = ("tmp", "old")


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_path(target: str | os.PathLike, kind: str = "tmp", *, pid: int | None = None) -> str:
    """The path of a temporary sibling of ``target`` owned by process ``pid`` on this host.

    Args:
      target: the output directory.
      kind: ``'tmp'`` (a directory being written) or ``'old'`` (a replaced directory awaiting
        deletion).
      pid: owning process (default: this process).

    Returns:
      ``PARENT/.NAME.KIND-HOST-PID-RANDOM``.
    """
    if kind not in _KINDS:
        raise ConfigError(f"temp_path: kind must be one of {_KINDS}, got {kind!r}", where="kind",
                          expected=_KINDS, actual=kind)
    parent, name = os.path.split(os.path.abspath(os.fspath(target)))
    pid = os.getpid() if pid is None else int(pid)
    return os.path.join(parent, f".{name}.{kind}-{_host_tag()}-{pid}-{uuid.uuid4().hex[:12]}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def clean_stale(target: str | os.PathLike) -> list[str]:
    """Remove the temporary siblings of ``target`` left by dead processes of this host.

    A stale ``.old-`` sibling is moved back to ``target`` when ``target`` does not exist (a
    replacement was killed between its two renames); otherwise it is deleted. Siblings owned
    by running processes or other hosts are left alone.

    Args:
      target: the output directory.

    Returns:
      The sibling paths removed or restored.
    """
    target = os.path.abspath(os.fspath(target))
    parent, name = os.path.split(target)
    if not os.path.isdir(parent):
        return []
    pattern = re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-{_host_tag()}-(\d+)-[0-9a-f]+$")
    done = []
    for entry in sorted(os.listdir(parent)):
        m = pattern.match(entry)
        if m is None or _alive(int(m.group(2))):
            continue
        path = os.path.join(parent, entry)
        if m.group(1) == "old" and not os.path.lexists(target):
            os.rename(path, target)
        else:
            _remove(path)
        done.append(path)
    return done


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _renameat2():
    """libc's ``renameat2`` (Linux, glibc >= 2.28), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst`` only if nothing is at ``dst``, atomically where the system can.

    On Linux this is ``renameat2(RENAME_NOREPLACE)``: it fails if anything is at ``dst`` (a
    file, a symbolic link, a directory, an empty directory), with no window between the check
    and the rename. Where that is missing (other systems, old C libraries, file systems that
    refuse the flag) a file is moved with ``link(2)`` + ``unlink(2)`` (``link`` fails when
    ``dst`` exists; where hard links are not supported, a check and ``rename(2)``), and a
    directory with a check followed by ``rename(2)``, which itself refuses a file or a
    non-empty directory at ``dst``; only an empty directory created in the instant between the
    check and the rename would be replaced there.

    Args:
      src: the path to move.
      dst: its new path.

    Raises:
      FileExistsError: something is at ``dst`` (``errno.EEXIST``); ``src`` is unchanged.
      OSError: any other failure of the rename.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            _raise_rename(code, src, dst)
    if os.path.lexists(dst):
        _raise_rename(errno.EEXIST, src, dst)
    if not os.path.isdir(src) or os.path.islink(src):
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError:  # no hard links here: rename, after the check above
            os.rename(src, dst)
            return
        os.unlink(src)
        return
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            _raise_rename(errno.EEXIST, src, dst)
        raise


def _raise_rename(code: int, src: str, dst: str):
    if code in (errno.EEXIST, errno.ENOTEMPTY):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst)
    raise OSError(code, os.strerror(code), src, None, dst)


def _identity(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the real directory ``path``, or ``None``."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) and not os.path.islink(path) else None


def is_empty_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a real (not symlinked) directory with no entries.

    Args:
      path: a filesystem path.

    Returns:
      ``True`` for an empty directory.
    """
    path = os.fspath(path)
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False,
                     owned: Callable[[str], bool] | None = None,
                     who: str = "write") -> Iterator[str]:
    """Write a directory atomically: yield a temporary directory, rename it to ``path``.

    Args:
      path: the target directory (local filesystem).
      overwrite: replace an existing ``path`` that ``owned`` recognises.
      owned: ``owned(path) -> bool``: whether an existing non-empty ``path`` is an output this
        writer may replace. ``None``: nothing non-empty is ever replaced.
      who: the caller's name, for messages.

    Yields:
      The temporary directory to fill. When the block finishes it replaces ``path``; when the
      block raises, the temporary directory is removed and ``path`` is untouched.

    Raises:
      OutputExistsError: ``path`` exists, is not an empty directory, and either ``overwrite``
        is false or ``owned`` does not recognise it (checked when the block starts, and again
        at the final rename: a target that appeared or changed meanwhile is refused the same
        way, see the module docstring). Nothing is written; its ``where`` is ``path``.
    """
    path = os.path.abspath(os.fspath(path))
    clean_stale(path)
    _check_replaceable(path, overwrite=overwrite, owned=owned, who=who)
    empty = _identity(path) if is_empty_dir(path) else None
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path(path, "tmp")
    try:
        os.makedirs(tmp)
        yield tmp
        _replace_dir(tmp, path, overwrite=overwrite, owned=owned, who=who, empty=empty)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_replaceable(path: str, *, overwrite: bool, owned: Callable[[str], bool] | None,
                       who: str) -> None:
    """Refuse a target that is not missing, not empty and not replaceable (see
    :func:`atomic_directory`)."""
    if os.path.lexists(path) and not is_empty_dir(path):
        if not overwrite:
            raise OutputExistsError(
                f"{who}: {path} exists and is not empty; pass overwrite=True to replace it",
                where=path, expected="a missing or empty directory", actual="not empty")
        if os.path.islink(path) or not os.path.isdir(path) or owned is None or not owned(path):
            what = ("a symbolic link" if os.path.islink(path) else
                    "a file" if not os.path.isdir(path) else "a directory it did not write")
            raise OutputExistsError(
                f"{who}: refusing to replace {path}: it is {what}. overwrite=True replaces only "
                "an output of the same kind (a lowrank_jax checkpoint) or an empty directory; "
                "remove it yourself or choose another path",
                where=path, expected="a lowrank_jax output or an empty directory", actual=what)


def _appeared(who: str, path: str) -> OutputExistsError:
    return OutputExistsError(
        f"{who}: {path} appeared while the output was being written (another writer?); "
        "nothing was written there. Pass overwrite=True to replace it, or choose another path",
        where=path, expected="nothing at the path", actual="something that appeared meanwhile")


def _replace_dir(src: str, dst: str, *, overwrite: bool = False,
                 owned: Callable[[str], bool] | None = None, who: str = "write",
                 empty: tuple[int, int] | None = None) -> None:
    """Move the finished directory ``src`` to ``dst`` (module docstring).

    Args:
      src: the finished temporary directory.
      dst: the target.
      overwrite: replace an existing ``dst`` that ``owned`` recognises (or an empty one).
      owned: as for :func:`atomic_directory`.
      who: for messages.
      empty: the identity (:func:`_identity`) of the empty directory that was at ``dst`` when
        the write started, which may be replaced without ``overwrite``; ``None``: there was
        none, and nothing at ``dst`` is replaced.

    Raises:
      OutputExistsError: without ``overwrite``, something other than that empty directory is
        at ``dst``; with it, something that is neither empty nor ``owned``. ``dst`` is as it
        was (``src`` is left for the caller to remove).
    """
    if not overwrite:
        if empty is not None and _identity(dst) == empty:
            try:
                os.rmdir(dst)  # fails if something was put into it meanwhile
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                raise _appeared(who, dst) from None
        try:
            rename_noreplace(src, dst)
        except FileExistsError:
            raise _appeared(who, dst) from None
        return
    old = temp_path(dst, "old")
    try:
        os.rename(dst, old)
    except FileNotFoundError:
        old = None
    if old is not None and not is_empty_dir(old) and (
            os.path.islink(old) or not os.path.isdir(old) or owned is None or not owned(old)):
        _put_back(old, dst, who)  # it changed meanwhile into something not ours: refuse
        _check_replaceable(dst, overwrite=True, owned=owned, who=who)  # says what it is
        raise _appeared(who, dst)  # it changed yet again
    try:
        rename_noreplace(src, dst)
    except BaseException as e:
        if old is not None:
            try:
                rename_noreplace(old, dst)
            except OSError:  # another writer's output is there now; ours was replaced anyway
                _remove(old)
        if isinstance(e, FileExistsError):
            raise _appeared(who, dst) from None
        raise
    if old is not None:
        _remove(old)


def _put_back(old: str, dst: str, who: str) -> None:
    """Move what was set aside at ``old`` back to ``dst``; if something took ``dst`` meanwhile,
    keep it under a name :func:`clean_stale` leaves alone, and say where."""
    try:
        rename_noreplace(old, dst)
    except FileExistsError:
        parent, name = os.path.split(dst)
        kept = os.path.join(parent, f".{name}.kept-{uuid.uuid4().hex[:12]}")
        os.rename(old, kept)
        raise OutputExistsError(
            f"{who}: {dst} changed twice while the output was being written; what was there is "
            f"kept at {kept}, nothing was written", where=dst, expected="an output of this kind",
            actual="changed meanwhile") from None


def write_text(file: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``file`` and flush it to disk (``fsync``).

    Args:
      file: the file to create or truncate.
      text: its content.

    Returns:
      ``None``.
    """
    with open(file, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def copy_files(directory: str | os.PathLike, files, *, reserved=(), who: str = "write") -> list[str]:
    """Copy ``files`` (``{name: source path}``) verbatim into ``directory`` (an output being
    written, e.g. the temporary directory of :func:`atomic_directory`).

    Used for the files that travel with a model but are not the writer's own, such as a
    language model's tokenizer files.

    Args:
      directory: an existing directory.
      files: ``{file name: path of the file to copy}``; names are plain file names.
      reserved: names the writer itself writes; copying over them is refused.
      who: the caller's name, for messages.

    Returns:
      The names copied, sorted.

    Raises:
      ConfigError: a name is not a plain file name, or is reserved (``where`` is
        ``files/NAME``); MissingFileError: a source is not a readable file.
    """
    from lowrank_jax.errors import MissingFileError

    names = sorted(files)
    for name in names:
        if not name or name != os.path.basename(name) or name in (".", ".."):
            raise ConfigError(f"{who}: extra file name {name!r} is not a plain file name",
                              where=f"files/{name}", expected="a file name without a directory",
                              actual=name)
        if name in reserved:
            raise ConfigError(f"{who}: extra file {name!r} would replace the writer's own file",
                              where=f"files/{name}", expected=f"a name not in {sorted(reserved)}",
                              actual=name)
        if not os.path.isfile(files[name]):
            raise MissingFileError(f"{who}: extra file {name!r}: {os.fspath(files[name])} is not a "
                                   "file", where=f"files/{name}")
    for name in names:
        shutil.copyfile(files[name], os.path.join(directory, name))
    return names


__all__ = ["atomic_directory", "clean_stale", "copy_files", "is_empty_dir", "rename_noreplace",
           "temp_path", "write_text"]
