"""What the ``lowrank-jax`` command may write, and where: nothing it did not write is replaced.

Rules, checked before any work starts (so a long run never ends in a refused write) and again
when writing:

* **Outputs are separate from inputs.** An output path may not be an input, contain one, or lie
  inside one (``compress X --out X``, ``convert SRC --out SRC/native``, ``--out .`` when ``.``
  holds the input, ``--json X/report.json`` inside an input checkpoint or inside ``--out``).
  Paths are compared after resolving symbolic links.
* **Only the tool's own outputs are replaced**, and only with ``--overwrite``: a lowrank_jax
  checkpoint (:func:`lowrank_jax.io.is_checkpoint`) for ``compress`` / ``convert``; for other
  directory outputs (``export``) a directory holding this module's marker file
  (:data:`MARKER`) that lists every file the command wrote, and nothing else. An empty directory
  may always be written into. Anything else is refused and left untouched.
* **JSON reports** carry a ``"lowrank_jax_report"`` entry (command and version). An existing
  report file is replaced by the next run without ``--overwrite`` (as before); an empty file
  too. Any other existing file (a plan, a config, someone's data, an older report without the
  entry) is refused, and so is a directory. Reports are written to a temporary sibling and
  renamed, so a reader never sees half a file; temporaries of killed runs are removed by the
  next write to the same path (:func:`lowrank_jax.io.files.clean_stale`). Non-finite numbers
  are written as ``null``, so the file is always valid JSON.

* **Outputs must be writable**, found before any work: an output whose directory cannot be
  created or written (an ancestor is a file, no permission, a read-only file system) is refused
  naming its option (:func:`check_writable`).
* **Two writers never both win.** Directory outputs are written atomically
  (:func:`lowrank_jax.io.atomic_directory`): built beside the target and renamed into place at
  the end, without ever replacing what appeared there meanwhile (another run writing the same
  ``--out`` that finished first, someone's files): the later writer fails with one line naming
  the option, and the target keeps the first writer's complete output. Failures of the final
  write name the option, not the temporary directory (:func:`writing`).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
from typing import Any, Callable, Iterable, Iterator, Mapping

from lowrank_jax.errors import ConfigError, LowrankJaxError, OutputExistsError
from lowrank_jax.io import atomic_directory, is_checkpoint
from lowrank_jax.io.files import clean_stale, is_empty_dir, rename_noreplace, temp_path

#: The marker file a directory output other than a checkpoint carries (``export``, plots).
MARKER = "lowrank_jax_output.json"
MARKER_FORMAT = "lowrank_jax.output"
#: The entry that marks a JSON report as written by ``lowrank-jax``.
REPORT_KEY = "lowrank_jax_report"


def _version() -> str:
    from lowrank_jax import __version__

    return __version__


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _within(inner: str, outer: str) -> bool:
    """Whether the resolved path ``inner`` is ``outer`` or lies inside it."""
    return inner == outer or os.path.commonpath([inner, outer]) == outer


def check_separate(output: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None], *,
                   flag: str = "--out") -> None:
    """Refuse an output that is an input, contains one or lies inside one.

    Args:
      output: the output path (file or directory; it need not exist).
      inputs: ``{name for messages: path or None}`` of what the command reads.
      flag: the option that names ``output``, for messages.

    Raises:
      ConfigError: naming the flag, the output and the input it overlaps.
    """
    out = _real(output)
    for name, path in inputs.items():
        if path is None:
            continue
        src = _real(path)
        if out == src:
            how = "is the input"
        elif _within(src, out):
            how = "contains the input"
        elif _within(out, src):
            how = "lies inside the input"
        else:
            continue
        raise ConfigError(
            f"{flag} {output} {how} {name} {path} (resolved: {src}); writing there could "
            "destroy or change what is being read. Choose an output outside the input",
            where=flag, expected=f"a path outside {src}", actual=out)


def check_parent(path: str | os.PathLike, *, flag: str) -> None:
    """Refuse an output whose parent cannot be a directory (some ancestor is a file).

    Raises:
      ConfigError: naming the flag, the path and the ancestor that is not a directory.
    """
    p = os.path.dirname(os.path.abspath(os.fspath(path)))
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    if p and os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(
            f"{flag} {path}: cannot create it, {p} is a file, not a directory", where=flag,
            expected=f"{p} to be a directory", actual="a file")


def check_writable(path: str | os.PathLike, *, flag: str, inside: bool = False) -> None:
    """Refuse, before any work, an output that could not be written.

    The output (or the directories leading to it) would be created in its nearest existing
    ancestor directory; a temporary directory is created there, with the name the output's own
    temporaries get (:func:`lowrank_jax.io.files.temp_path`), and removed at once. That meets
    every obstacle the real write would meet (an ancestor that is a file, no permission -- which
    does not stop root --, a read-only file system, a pseudo file system) and leaves nothing.

    Args:
      path: the output (file or directory; it need not exist).
      flag: the option that names it, for messages.
      inside: the command writes *into* ``path`` when it is an existing directory (``train``'s
        run directory) rather than beside it.

    Raises:
      ConfigError: naming the flag, the path, the directory that cannot be written and why.
    """
    check_parent(path, flag=flag)
    given, path = os.fspath(path), os.path.abspath(os.fspath(path))
    if inside and os.path.isdir(path):
        where, name = path, "probe"
    else:
        child, where = path, os.path.dirname(path)
        while not os.path.isdir(where) and os.path.dirname(where) != where:
            child, where = where, os.path.dirname(where)
        name = os.path.basename(child)
    probe = temp_path(os.path.join(where, name), "tmp")
    try:
        os.mkdir(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            f"{flag} {given}: cannot write there: creating an entry in {where} fails ({reason}); "
            "choose a writable location", where=flag, expected=f"a writable directory {where}",
            actual=reason) from None
    os.rmdir(probe)


@contextlib.contextmanager
def writing(path: str | os.PathLike, *, flag: str, overwrite: bool = False,
            owned: Callable[[str], bool] | None = None, what: str = "an output of this kind"
            ) -> Iterator[None]:
    """Name the option when the final write of an output fails.

    Everything was checked before the work started (:func:`check_output_dir`), but the
    filesystem may change while a command runs: another run may write the same output first
    (the writers' final rename then refuses to replace it, see
    :func:`lowrank_jax.io.atomic_directory`), the disk may fill. Inside this block such failures
    become one line that names ``flag`` and ``path`` (not a temporary directory, not a library
    function) and says that nothing was written there.

    Args:
      path: the output.
      flag: its option.
      overwrite, owned, what: as for :func:`check_output_dir` (to say what is there now);
        ``owned=None``: the block's own refusals already name the option and pass unchanged.

    Raises:
      OutputExistsError: the output appeared or changed while the command ran.
      OSError: another failure of the write (the class its errno gives, the option in its
        message; no file name: the temporary ones mean nothing to the user).
    """
    try:
        yield
    except (OutputExistsError, OSError) as e:
        named = _name_option(e, path, flag=flag, overwrite=overwrite, owned=owned, what=what)
        if named is None:
            raise
        raise named from None


def _name_option(e: BaseException, path: str | os.PathLike, *, flag: str, overwrite: bool,
                 owned: Callable[[str], bool] | None, what: str) -> BaseException | None:
    """The error to raise instead of ``e`` (a failure of the final write of ``path``), or
    ``None`` to raise ``e`` itself (:func:`writing`)."""
    if isinstance(e, OutputExistsError):
        if owned is None or e.where is None or _real(e.where) != _real(path):
            return None
        refusal = _refusal(path, overwrite=overwrite, owned=owned, what=what, flag=flag)
        text = (refusal[0] if refusal else
                f"{flag} {os.fspath(path)} changed while this command ran")
        return OutputExistsError(
            f"{text}; it appeared or changed while this command ran (another writer?), and "
            "nothing was written there", where=os.fspath(path), expected=e.expected,
            actual=e.actual)
    if not isinstance(e, OSError) or isinstance(e, LowrankJaxError) or e.errno is None:
        return None
    return OSError(e.errno, f"{flag} {os.fspath(path)}: could not write it: "
                   f"{e.strerror or type(e).__name__}; nothing was written there")


# ---------------------------------------------------------------------------------------------
# Directory outputs.

def read_marker(path: str | os.PathLike) -> dict | None:
    """The marker of a directory output, or ``None`` when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(os.fspath(path), MARKER), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == MARKER_FORMAT else None


def owned_by(kind: str) -> Callable[[str], bool]:
    """A predicate for :func:`lowrank_jax.io.atomic_directory`: a directory is this tool's
    ``kind`` output when its marker says ``kind`` and every entry is a file the marker lists
    (so a file someone added keeps the directory from being replaced)."""

    def owned(path: str) -> bool:
        if not os.path.isdir(path) or os.path.islink(path):
            return False
        doc = read_marker(path)
        if doc is None or doc.get("kind") != kind:
            return False
        files = set(doc.get("files") or ())
        return set(os.listdir(path)) <= files | {MARKER}

    return owned


def describe(path: str | os.PathLike) -> str:
    """What is at ``path``, in words (for refusals)."""
    path = os.fspath(path)
    if os.path.islink(path):
        return "a symbolic link"
    if not os.path.isdir(path):
        return "a file"
    if is_checkpoint(path):
        return "a lowrank_jax checkpoint"
    doc = read_marker(path)
    if doc is not None:
        return f"a lowrank-jax {doc.get('kind')} output with files added by someone else"
    n = len(os.listdir(path))
    return f"a directory of {n} entr{'y' if n == 1 else 'ies'} that lowrank-jax did not write"


def _refusal(path: str | os.PathLike, *, overwrite: bool, owned: Callable[[str], bool],
             what: str, flag: str) -> tuple[str, str] | None:
    """``(message, what is there)`` when ``path`` may not be written, else ``None``."""
    path = os.fspath(path)
    if not os.path.lexists(path) or is_empty_dir(path):
        return None
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    if not overwrite:
        hint = ("pass --overwrite to replace it" if is_dir and owned(path) else
                f"it is {describe(path)}, which --overwrite would not replace either; "
                "choose another path")
        return f"{flag} {path} exists: {hint}", describe(path)
    if not is_dir or not owned(path):
        return (f"{flag} {path}: refusing to replace {describe(path)}; --overwrite replaces only "
                f"{what} or an empty directory. Nothing was changed: remove it yourself or "
                "choose another path", describe(path))
    return None


def check_output_dir(path: str | os.PathLike, *, overwrite: bool, owned: Callable[[str], bool],
                     what: str, flag: str = "--out") -> None:
    """Refuse, before any work, a directory output that may not be written.

    Args:
      path: the output directory.
      overwrite: ``--overwrite`` was given.
      owned: whether an existing directory is this command's kind of output.
      what: that kind, in words ("a lowrank_jax checkpoint").
      flag: the option, for messages.

    Raises:
      OutputExistsError: ``path`` exists, is not an empty directory, and ``overwrite`` is not
        given or ``path`` is not ``what``.
      ConfigError: ``path`` cannot be written (:func:`check_writable`).
    """
    check_parent(path, flag=flag)
    refusal = _refusal(path, overwrite=overwrite, owned=owned, what=what, flag=flag)
    if refusal is not None:
        expected = "a missing or empty directory" if not overwrite else what
        raise OutputExistsError(refusal[0], where=os.fspath(path), expected=expected,
                                actual=refusal[1])
    check_writable(path, flag=flag)


def check_checkpoint_out(path: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                         *, overwrite: bool, flag: str = "--out") -> None:
    """Refuse, before any work, a model-checkpoint output (``--out``) that is an input, lies
    inside or holds one, or would replace something that is not a lowrank_jax checkpoint
    (:func:`check_separate`, :func:`check_output_dir`)."""
    check_separate(path, inputs, flag=flag)
    check_output_dir(path, overwrite=overwrite, owned=is_checkpoint,
                     what="a lowrank_jax checkpoint", flag=flag)


def check_plots_out(path: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                    *, overwrite: bool, flag: str = "--plots") -> None:
    """Refuse, before any work, a plots directory that cannot be drawn (matplotlib missing) or
    written (as :func:`check_checkpoint_out`, replacing only a previous plots directory).

    Raises:
      ConfigError: matplotlib is not installed (naming the ``plot`` extra).
      OutputExistsError: see :func:`check_output_dir`.
    """
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"{flag} needs matplotlib: pip install 'lowrank-jax[plot]'",
                          where=flag, expected="matplotlib installed", actual="not installed")
    check_separate(path, inputs, flag=flag)
    check_output_dir(path, overwrite=overwrite, owned=owned_by("plots"),
                     what="a previous lowrank-jax plots directory", flag=flag)


def check_outputs(inputs: Mapping[str, str | os.PathLike | None], *,
                  out: str | os.PathLike | None = None, plots: str | os.PathLike | None = None,
                  json_path: str | os.PathLike | None = None, overwrite: bool = False) -> None:
    """Refuse, before any work, the usual outputs of a command: a checkpoint (``--out``:
    :func:`check_checkpoint_out`), a plots directory (``--plots``: :func:`check_plots_out`) and
    a JSON report (``--json``: :func:`check_report_path`, which may not lie inside the other
    two); ``None`` skips one."""
    if out:
        check_checkpoint_out(out, inputs, overwrite=overwrite)
    if plots:
        check_plots_out(plots, inputs, overwrite=overwrite)
    if json_path:
        check_report_path(json_path, inputs, (out, plots))


@contextlib.contextmanager
def marked_directory(path: str | os.PathLike, *, kind: str, overwrite: bool, who: str,
                     info: Mapping | None = None, flag: str = "--plots") -> Iterator[str]:
    """Write a directory output with a marker, atomically.

    Yields a temporary directory to fill. On success a marker listing every file written
    (relative paths) is added and the directory is renamed to ``path``, replacing a previous
    ``kind`` output only when ``overwrite``; on an error nothing changes at ``path``. A
    failure of the directory's own writing (not of the caller's block) names ``flag``
    (:func:`writing`).

    Args:
      path: the output directory.
      kind: the kind of output (``'export'``, ``'plots'``).
      overwrite: replace a previous output of the same kind.
      who: the command, for messages.
      info: JSON-able extra fields for the marker.
      flag: the option that names ``path``.
    """
    owned = owned_by(kind)
    in_body = False  # the caller's own failures (while it fills the directory) pass unchanged
    try:
        with atomic_directory(path, overwrite=overwrite, owned=owned, who=who) as tmp:
            in_body = True
            yield tmp
            in_body = False
            files = sorted(os.listdir(tmp))
            doc = {"format": MARKER_FORMAT, "kind": kind, "command": who, "version": _version(),
                   "files": files, **dict(info or {})}
            with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
                json.dump(json_safe(doc), f, indent=2, allow_nan=False)
                f.write("\n")
    except (OutputExistsError, OSError) as e:
        named = None if in_body else _name_option(
            e, path, flag=flag, overwrite=overwrite, owned=owned,
            what=f"a previous lowrank-jax {kind} directory")
        if named is None:
            raise
        raise named from None


@contextlib.contextmanager
def writing_checkpoint(path: str | os.PathLike, *, overwrite: bool,
                       flag: str = "--out") -> Iterator[None]:
    """:func:`writing` for a lowrank_jax checkpoint output (``save_model`` / ``save_params``)."""
    with writing(path, flag=flag, overwrite=overwrite, owned=is_checkpoint,
                 what="a lowrank_jax checkpoint"):
        yield


# ---------------------------------------------------------------------------------------------
# JSON reports.

def json_safe(x: Any) -> Any:
    """``x`` as plain JSON values: NumPy scalars become Python numbers and every non-finite
    number ``None`` (JSON has no NaN); mappings, lists and tuples are converted throughout."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def is_report(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file a previous ``--json`` wrote (or an empty file)."""
    path = os.fspath(path)
    if not os.path.isfile(path) or os.path.islink(path):
        return False
    if os.path.getsize(path) == 0:
        return True
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get(REPORT_KEY), dict)


def check_report_path(path: str | os.PathLike,
                      inputs: Mapping[str, str | os.PathLike | None] | None = None,
                      outputs: Iterable[str | os.PathLike | None] = (), *,
                      flag: str = "--json") -> None:
    """Refuse, before any work, a JSON report path that may not be written.

    Raises:
      ConfigError: the path is an input, lies inside an input or an output directory, or
        cannot be written (:func:`check_writable`).
      OutputExistsError: it is a directory, or an existing file that is not a report.
    """
    _check_report_target(path, inputs, outputs, flag=flag)
    check_writable(path, flag=flag)


def _check_report_target(path: str | os.PathLike,
                         inputs: Mapping[str, str | os.PathLike | None] | None,
                         outputs: Iterable[str | os.PathLike | None], *, flag: str) -> None:
    check_parent(path, flag=flag)
    check_separate(path, dict(inputs or {}), flag=flag)
    for out in outputs:
        if out is not None and _within(_real(path), _real(out)):
            raise ConfigError(
                f"{flag} {path} lies inside the output directory {out}; put the report beside "
                "it (a file inside would make the output something the tool did not write)",
                where=flag, expected=f"a path outside {out}", actual=os.fspath(path))
    path = os.fspath(path)
    if os.path.isdir(path):
        raise OutputExistsError(f"{flag} {path} is a directory; expected a file path for the "
                                "JSON report", where=path, expected="a file", actual="a directory")
    if os.path.lexists(path) and not is_report(path):
        raise OutputExistsError(
            f"{flag} {path} exists and is not a lowrank-jax JSON report (no "
            f"'{REPORT_KEY}' entry); refusing to replace it. Nothing was changed: choose "
            "another path or remove the file", where=path, expected="a previous report",
            actual="another file")


def write_report(path: str | os.PathLike, obj: Mapping, *, command: str,
                 inputs: Mapping[str, str | os.PathLike | None] | None = None,
                 outputs: Iterable[str | os.PathLike | None] = (), flag: str = "--json") -> str:
    """Write ``obj`` as a JSON report to ``path`` (temp file + rename; checked as in
    :func:`check_report_path`).

    The file is written to a temporary sibling and renamed into place. A previous report (or an
    empty file) is replaced; when nothing was at ``path`` at the last check, the rename never
    replaces what appeared there meanwhile (:func:`lowrank_jax.io.files.rename_noreplace`): a
    report another run wrote first is replaced, anything else refused.

    Args:
      path: the report file.
      obj: a JSON-able mapping; a ``"lowrank_jax_report"`` entry (command, version) is added
        in front.
      command: the command that wrote it.
      inputs, outputs: as for :func:`check_report_path`.
      flag: the option that names ``path``.

    Returns:
      The absolute path written.
    """
    outputs = tuple(outputs)
    _check_report_target(path, inputs, outputs, flag=flag)
    path = os.path.abspath(os.fspath(path))
    doc = {REPORT_KEY: {"command": command, "version": _version()},
           **{k: v for k, v in obj.items() if k != REPORT_KEY}}
    text = json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n"
    with writing(path, flag=flag):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        clean_stale(path)
        tmp = temp_path(path, "tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            for _ in range(2):
                # again: something may have appeared meanwhile
                _check_report_target(path, inputs, outputs, flag=flag)
                if os.path.lexists(path):  # a previous report: replaced
                    os.replace(tmp, path)
                    break
                try:
                    rename_noreplace(tmp, path)
                    break
                except FileExistsError:
                    continue  # appeared in between: replace it only if it is a report
            else:  # pragma: no cover - appeared, vanished and appeared again
                raise OutputExistsError(f"{flag} {path} keeps changing while being written",
                                        where=path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    return path


__all__ = ["MARKER", "REPORT_KEY", "check_checkpoint_out", "check_output_dir", "check_outputs",
           "check_parent", "check_plots_out", "check_report_path", "check_separate",
           "check_writable",
           "describe", "is_report", "json_safe", "marked_directory", "owned_by", "read_marker",
           "write_report", "writing", "writing_checkpoint"]
