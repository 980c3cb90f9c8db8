"""Atomic directory writes that never replace what they did not write.

A directory output is built in a temporary sibling (``.NAME.tmp-HOST-PID-RANDOM``) and renamed
into place when complete, so a reader sees either the old directory or the new one, never a
half-written one. Replacing an existing directory moves it aside first
(``.NAME.old-HOST-PID-RANDOM``) and deletes it only after the new one is in place.

Only directories the caller recognises as its own (a predicate, for checkpoints
:func:`lowrank_jax.io.is_checkpoint`) or empty directories are ever replaced; anything else at
the target path is refused with :class:`~lowrank_jax.errors.OutputExistsError`, even with
``overwrite=True``, and left untouched.

A process killed in the middle leaves its temporary sibling behind. The next write to the same
target removes the leftovers of processes that are no longer running on this host; a
``.old-`` directory whose replacement never arrived (the kill fell between the two renames) is
moved back to the target instead, so the previous output is never lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
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
        is false or ``owned`` does not recognise it. Nothing is written.
    """
    path = os.path.abspath(os.fspath(path))
    clean_stale(path)
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
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = temp_path(path, "tmp")
    try:
        os.makedirs(tmp)
        yield tmp
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(src: str, dst: str) -> None:
    """Move the finished directory ``src`` to ``dst``, replacing whatever is there."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return
    old = temp_path(dst, "old")
    os.rename(dst, old)
    try:
        os.rename(src, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _remove(old)


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


__all__ = ["atomic_directory", "clean_stale", "is_empty_dir", "temp_path", "write_text"]
