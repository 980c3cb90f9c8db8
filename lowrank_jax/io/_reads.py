"""Reading orbax checkpoints without stray output, and saying in a few words what is wrong.

Shared by parameter checkpoints (:mod:`lowrank_jax.io.params`) and train-state checkpoints
(:mod:`lowrank_jax.train.checkpoint`).

Why this exists: when one array of a damaged checkpoint cannot be read, orbax raises at once
and closes its event loop while the reads of the other arrays are still in flight. Each of
those later prints a traceback of its own ("RuntimeError: Event loop is closed" from
TensorStore's callback threads, "Exception ignored in: <coroutine ...>" when Python collects
them, often at interpreter exit), and orbax logs warnings about the files it could not parse.
:func:`quiet_reads` lets every read finish before the loop closes and holds back orbax's log
records, so the caller's one-line error is all the user sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from typing import Any, Iterator

#: Longest wait for the reads still in flight when orbax closes its event loop (seconds).
_DRAIN_TIMEOUT_S = 120.0

_ORBAX_DIR = os.sep + "orbax" + os.sep


class _Quiet:
    """The state behind :func:`quiet_reads`.

    Only threads inside :func:`quiet_reads` are affected: their orbax log records are dropped
    and the event loops they create (orbax makes one per call) are :func:`_finishing_close`
    loops. The hooks themselves (a logging filter, a wrapper around the event-loop policy's
    ``new_event_loop``) are process-wide, installed while any thread is inside, and removed
    when the last one leaves.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.threads: dict[int, int] = {}  # thread id -> nesting depth
        self.policy = None

    def active(self) -> bool:
        return threading.get_ident() in self.threads

    def filter(self, record: logging.LogRecord) -> bool:
        """``False`` (drop) for an orbax record logged by a thread inside quiet_reads."""
        return not (record.thread in self.threads and _ORBAX_DIR in (record.pathname or ""))

    def enter(self) -> None:
        me = threading.get_ident()
        with self.lock:
            self.threads[me] = self.threads.get(me, 0) + 1
            if len(self.threads) > 1 or self.threads[me] > 1:
                return
            logging.getLogger("absl").addFilter(self.filter)
            policy = _event_loop_policy()
            if policy is not None and "new_event_loop" not in vars(policy):
                make = policy.new_event_loop
                policy.new_event_loop = (
                    lambda: _finishing_close(make()) if self.active() else make())
                self.policy = policy

    def exit(self) -> None:
        me = threading.get_ident()
        with self.lock:
            self.threads[me] -= 1
            if self.threads[me]:
                return
            del self.threads[me]
            if self.threads:
                return
            logging.getLogger("absl").removeFilter(self.filter)
            if self.policy is not None:
                vars(self.policy).pop("new_event_loop", None)
                self.policy = None


_QUIET = _Quiet()


def _event_loop_policy() -> Any:
    # asyncio.new_event_loop() asks the policy; Python 3.14 deprecates the public getter and
    # keeps a private one. Where neither exists, reads are not drained (only noisier).
    get = getattr(asyncio.events, "_get_event_loop_policy", None)
    if get is None:
        get = getattr(asyncio.events, "get_event_loop_policy", None)
    try:
        return get() if get is not None else None
    except Exception:  # pragma: no cover - a policy that cannot be read: leave it alone
        return None


def _finishing_close(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    """``loop``, whose ``close()`` first lets its pending tasks finish, and which ignores
    completions that arrive after it closed."""
    close, call_soon_threadsafe = loop.close, loop.call_soon_threadsafe

    def close_after_pending() -> None:
        if not loop.is_closed() and not loop.is_running():
            _finish_pending(loop)
        close()

    def call_soon_threadsafe_unless_closed(callback, *args, **kwargs):
        # TensorStore reports the end of a read through this, from its own threads. A read
        # that no task awaits any more (its awaiter was cancelled) may end after the loop
        # closed; its result has no taker, so it is dropped instead of raising there.
        try:
            return call_soon_threadsafe(callback, *args, **kwargs)
        except RuntimeError:
            if loop.is_closed():
                return None
            raise

    loop.close = close_after_pending
    loop.call_soon_threadsafe = call_soon_threadsafe_unless_closed
    loop.set_exception_handler(_unless_abandoned)
    return loop


#: What asyncio says about tasks whose failure nobody collected (when they are collected).
_ABANDONED = ("exception was never retrieved", "was destroyed but it is pending")


def _unless_abandoned(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The exception handler of a :func:`_finishing_close` loop: it drops what asyncio says
    about an orbax read whose failure nobody collected; everything else is logged as usual.

    orbax awaits its per-array read tasks one after the other; once one fails, the failures of
    the others are never collected, and asyncio would log each of them (with the whole
    TensorStore spec) when the task is garbage-collected. The caller reports the failure.
    """
    if any(m in str(context.get("message", "")) for m in _ABANDONED) and _orbax_read(context):
        return
    loop.default_exception_handler(context)


def _orbax_read(context: dict) -> bool:
    """Whether an asyncio error context is about an orbax task or a TensorStore read."""
    fut = context.get("future") or context.get("task")
    if isinstance(fut, asyncio.Task):
        code = getattr(fut.get_coro(), "cr_code", None)
        if code is not None and _ORBAX_DIR in code.co_filename:
            return True
    error = context.get("exception")
    return error is not None and "tensorstore" in str(error).lower()


def _finish_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Run ``loop`` until no task of it is pending (at most :data:`_DRAIN_TIMEOUT_S`; what is
    left then is cancelled), and collect the failures of the tasks it waited for.

    Waiting for the tasks pending now is not enough: one of them may start new tasks before it
    ends. orbax's restore does: a per-array task that was still opening its file when the first
    read failed goes on to ``asyncio.gather`` its shard reads, and ends as soon as one of them
    fails, leaving the others pending. A task still pending when the loop closes is destroyed
    silently later (``gather`` turns off asyncio's warning for its children), and its
    coroutine, closed by the garbage collector, prints "Exception ignored in: <coroutine ...>"
    (orbax turns the ``GeneratorExit`` into an ``Exception``). So this waits in rounds until
    none is left.
    """
    deadline = loop.time() + _DRAIN_TIMEOUT_S
    waited: set[asyncio.Task] = set()
    while True:
        pending = {t for t in asyncio.all_tasks(loop) if not t.done()}
        if not pending:
            break
        waited |= pending
        left = deadline - loop.time()
        if left <= 0:  # give up: cancel what is left, wait briefly for it to unwind
            for t in pending:
                t.cancel()
            loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
            break
        loop.run_until_complete(asyncio.wait(pending, timeout=left))
    for t in waited:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: asyncio does not log it when the task is collected


@contextlib.contextmanager
def quiet_reads() -> Iterator[None]:
    """Run orbax reads so that a failure prints nothing by itself.

    While the block runs, every event loop that orbax creates lets its pending tasks finish
    before it closes (so no read is abandoned in flight), and orbax's log records are dropped.
    Reads that succeed behave exactly as without it. Nesting and concurrent use from several
    threads are fine.
    """
    _QUIET.enter()
    try:
        yield
    finally:
        _QUIET.exit()


# ---------------------------------------------------------------------------------------------
# What is wrong, in a few words.

_STATUS = re.compile(r"\b([A-Z][A-Z_]+[A-Z]): (.*)", re.S)
_OCDBT_PLACE = re.compile(r'Error (?:reading|decoding) "[^"]*" in OCDBT database at [^:]*"[^"]*": ')
_LOCAL_FILE = re.compile(r'local file "([^"]*)"')
_SPEC_DUMP = re.compile(r"\. See full TensorStore details:.*", re.S)
_SPEC_TAIL = re.compile(r"\s*\[tensorstore_spec[^=]*=.*", re.S)
_OPENING = re.compile(r'Error opening "\w+" driver: ')

#: TensorStore status codes in plain words.
_PLAIN = {
    "OUT_OF_RANGE": "data cut short",
    "NOT_FOUND": "a file is missing",
    "DATA_LOSS": "data garbled",
    "FAILED_PRECONDITION": "data does not decode",
    "INVALID_ARGUMENT": "data does not decode",
}


def describe(error: BaseException, *, root: str | None = None, limit: int = 240) -> str:
    """A one-line account of why orbax / TensorStore could not read something.

    The innermost TensorStore status in the exception chain is used (orbax wraps it in a
    message that dumps the whole TensorStore spec); OCDBT's "in database at ..." is dropped
    (the caller names the checkpoint) and file paths under ``root`` are made relative.

    Args:
      error: the exception raised by orbax.
      root: a directory whose prefix is removed from file paths in the text.
      limit: the longest text returned (characters).

    Returns:
      For example ``'data cut short (OUT_OF_RANGE: Requested byte range [0, 8202) is not valid
      for value of size 4241)'``.
    """
    chain, seen = [], set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__  # not __context__: what was being handled when it was raised
    for e in reversed(chain):
        m = _STATUS.search(str(e))
        if m:
            text = _OPENING.sub("", _OCDBT_PLACE.sub("", _SPEC_TAIL.sub("", m.group(2))))
            status = m.group(1)
            plain = _PLAIN.get(status, "unreadable")
            if "Truncated" in text or "truncated" in text:
                plain = "data cut short or missing"
            return _squeeze(f"{plain} ({status}: {text})", root, limit)
    e = chain[-1]
    text = _SPEC_DUMP.sub("", str(e))
    return _squeeze(f"{type(e).__name__}: {text}" if text else type(e).__name__, root, limit)


def _squeeze(text: str, root: str | None, limit: int) -> str:
    if root:
        base = os.path.join(os.path.abspath(root), "")
        text = _LOCAL_FILE.sub(lambda m: f'file "{_relative(m.group(1), base)}"', text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _relative(path: str, base: str) -> str:
    return path[len(base):] or "." if path.startswith(base) else path


def index_damage(arrays_dir: str) -> str | None:
    """What is wrong with the files orbax reads before any array of ``arrays_dir``.

    Checks orbax's JSON files (``_METADATA``, ``_sharding``, ``array_metadatas/*``) and, for an
    OCDBT checkpoint, that the OCDBT manifest and b-tree can be opened and listed. It reads no
    array data. Call it after a read failed, to say why every array is unreadable.

    Args:
      arrays_dir: an orbax PyTree checkpoint directory.

    Returns:
      A short description naming the damaged file, or ``None`` when these files look intact.
    """
    checks = [("_METADATA", True), ("_sharding", False)]
    meta_dir = os.path.join(arrays_dir, "array_metadatas")
    if os.path.isdir(meta_dir):
        checks += [(os.path.join("array_metadatas", n), False) for n in sorted(os.listdir(meta_dir))]
    for name, required in checks:
        file = os.path.join(arrays_dir, name)
        if not os.path.isfile(file):
            if required:
                return f"its index file {name} is missing"
            continue
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
            if not text:
                return f"its index file {name} is empty"
            json.loads(text)
        except (OSError, ValueError) as e:
            return f"its index file {name} is unreadable ({_squeeze(str(e), arrays_dir, 160)})"
    manifest = os.path.join(arrays_dir, "manifest.ocdbt")
    if not os.path.isfile(manifest):
        # OCDBT's data lies under d/ (ocdbt.process_*/d/ before the per-process parts are
        # merged); without them this is not an OCDBT checkpoint (orbax's use_ocdbt=False)
        ocdbt = any(n == "d" or n.startswith("ocdbt.process_") for n in os.listdir(arrays_dir))
        return "its OCDBT manifest manifest.ocdbt is missing" if ocdbt else None
    try:
        import tensorstore as ts  # orbax's own dependency
    except ImportError:  # pragma: no cover
        return None
    try:
        # a context of its own: the default one caches what an earlier failed read saw
        store = ts.KvStore.open({"driver": "ocdbt", "base": "file://" + os.path.abspath(arrays_dir)
                                 + "/"}, context=ts.Context()).result()
        keys = store.list().result()
    except Exception as e:  # TensorStore reports a damaged index as ValueError
        return f"its OCDBT index is damaged: {describe(e, root=arrays_dir)}"
    if not keys:
        return "its OCDBT index lists no arrays"
    return None


#: Arrays named in a message; the rest are counted.
MAX_LISTED = 8


def list_damage(problems: dict[tuple[str, str], str], where: str) -> str:
    """The damaged arrays of a checkpoint and what is wrong with each, for a one-line message.

    Arrays with the same problem are grouped; at most :data:`MAX_LISTED` are named.

    Args:
      problems: ``{(array path, storage key): what is wrong}``, the text read after the array,
        e.g. ``'cannot be read: data cut short (...)'``.
      where: the directory holding the arrays (named once).

    Returns:
      ``"array 'a/w' (arr_000003 in DIR) cannot be read: ..."`` for one array,
      ``"2 arrays (in DIR): 'a/w' (arr_000003), 'b' (arr_000007) cannot be read: ..."`` for
      several.
    """
    items = sorted(problems.items(), key=lambda kv: kv[0][1])
    if len(items) == 1:
        (path, key), what = items[0]
        return f"array '{path}' ({key} in {where}) {what}"
    groups: dict[str, list[str]] = {}
    for (path, key), what in items[:MAX_LISTED]:
        groups.setdefault(what, []).append(f"'{path}' ({key})")
    more = len(items) - MAX_LISTED
    return (f"{len(items)} arrays (in {where}): "
            + "; ".join(f"{', '.join(g)} {what}" for what, g in groups.items())
            + (f"; and {more} more arrays" if more > 0 else ""))


def list_names(paths: list[str]) -> str:
    """``"'a', 'b', 'c'"``, with at most :data:`MAX_LISTED` names and a count of the rest."""
    more = len(paths) - MAX_LISTED
    return ", ".join(f"'{p}'" for p in paths[:MAX_LISTED]) + (f" and {more} more" if more > 0
                                                                else "")


def read_each(arrays_dir: str, restore_args: dict, *, partial: bool) -> tuple[dict, dict]:
    """Restore the arrays of an orbax PyTree checkpoint one at a time, to find the bad ones.

    Slower than one restore of everything (each call reads the checkpoint's metadata again);
    meant for after such a restore failed, to name every array that cannot be read.

    Args:
      arrays_dir: the orbax checkpoint directory (a flat dict of arrays).
      restore_args: ``{key: orbax RestoreArgs}`` of the arrays to read.
      partial: the checkpoint holds other keys too (orbax's ``partial_restore``).

    Returns:
      ``(arrays, problems)``: the arrays read, ``{key: array}``, and for every other key what
      is wrong (:func:`describe`), ``{key: text}``.
    """
    import orbax.checkpoint as ocp

    ckptr = ocp.PyTreeCheckpointer()
    arrays, problems = {}, {}
    with quiet_reads():
        for key, args in restore_args.items():
            try:
                out = ckptr.restore(arrays_dir, args=ocp.args.PyTreeRestore(
                    item={key: 0}, restore_args={key: args}, partial_restore=partial))
                arrays[key] = out[key]
            except Exception as e:  # orbax / TensorStore raise many types for bad files
                problems[key] = describe(e, root=arrays_dir)
    return arrays, problems


__all__ = ["MAX_LISTED", "describe", "index_damage", "list_damage", "list_names", "quiet_reads",
           "read_each"]
