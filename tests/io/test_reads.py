"""Damaged checkpoints: one line naming the checkpoint, every bad array and what is wrong, and
nothing else printed (no orbax / asyncio tracebacks, also not at interpreter exit).

Which arrays a damaged file takes down is worked out here without the library: the arrays hold
random bits, which zstd cannot compress, so orbax stores each one's bytes verbatim and a byte
search finds the file and offset of every array.
"""

import asyncio
import gc
import logging
import os
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import io as lio
from lowrank_jax import models
from lowrank_jax.errors import CheckpointError, CorruptCheckpointError
from lowrank_jax.io import _reads
from lowrank_jax.models import ViTConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bits(rng, *shape):
    return rng.integers(0, 2**32, shape, dtype=np.uint32).view(np.float32)


def _params():
    rng = np.random.default_rng(0)
    return {
        "enc": {"w": jnp.asarray(_bits(rng, 48, 64)), "b": jnp.asarray(_bits(rng, 64))},
        "dec": {"w": jnp.asarray(_bits(rng, 64, 64)), "scale": np.ones(3, np.float32)},
        "head": _bits(rng, 32, 64),  # a NumPy leaf
        "out": jnp.asarray(_bits(rng, 40, 64)),
    }


def _leaves(params):
    return {"enc/w": params["enc"]["w"], "enc/b": params["enc"]["b"],
            "dec/w": params["dec"]["w"], "dec/scale": params["dec"]["scale"],
            "head": params["head"], "out": params["out"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("reads") / "ck"
    params = _params()
    lio.save_params(path, params)
    return path, params


def _locate(path, params):
    """``{file: {array path: (start, end)}}``: where each array's bytes lie in the files."""
    found = {}
    for name, x in _leaves(params).items():
        raw = np.asarray(x).tobytes()
        if len(raw) < 1024:  # small values live inside the index nodes, not in data files
            continue
        for root, _, names in os.walk(path / lio.ARRAYS_DIR):
            for n in names:
                f = os.path.join(root, n)
                data = open(f, "rb").read()
                i = data.find(raw)
                if i >= 0:
                    found.setdefault(f, {})[name] = (i, i + len(raw))
    assert sum(len(v) for v in found.values()) == 4, found  # the four large arrays
    return found


def _copy(saved, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(saved[0], dst)
    return dst


def _shared_file(path, params):
    """The data file holding most arrays and where they lie in it (how orbax spreads the
    arrays over files varies from save to save: one to three files were seen)."""
    found = _locate(path, params)
    return max(found.items(), key=lambda kv: len(kv[1]))


def _check(err, path, expected, what):
    """One line naming the checkpoint and exactly the ``expected`` arrays, saying ``what``."""
    msg = str(err)
    assert "\n" not in msg
    assert f"checkpoint {path} is damaged" in msg
    assert set(err.arrays) == set(expected), msg
    for p in expected:
        assert f"'{p}'" in msg
    for p in set(_leaves(_params())) - set(expected):
        assert f"'{p}'" not in msg
    assert what in msg, msg
    assert "TensorStore(" not in msg and "tensorstore_spec" not in msg


def test_truncated_data_file_names_the_arrays_cut_off(saved, tmp_path):
    path = _copy(saved, tmp_path)
    file, where = _shared_file(path, saved[1])
    # cut in the middle of the first array of the file: it and every array after it are lost
    start, end = min(where.values())
    cut = (start + end) // 2
    with open(file, "r+b") as f:
        f.truncate(cut)
    lost = [p for p, (s, e) in where.items() if e > cut]
    assert len(lost) == len(where) >= 1
    with pytest.raises(CorruptCheckpointError) as err:
        lio.load_params(path)
    _check(err.value, path, lost, "cannot be read: data cut short")
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)
    assert err.value.where == str(path)


def test_truncation_after_some_arrays_keeps_them(saved, tmp_path):
    path = _copy(saved, tmp_path)
    file, where = _shared_file(path, saved[1])
    start, end = max(where.values())  # cut inside the last array only
    with open(file, "r+b") as f:
        f.truncate((start + end) // 2)
    (last,) = [p for p, se in where.items() if se == (start, end)]
    with pytest.raises(CorruptCheckpointError) as err:
        lio.load_params(path)
    _check(err.value, path, [last], f"array '{last}' (arr_")


@pytest.mark.parametrize("damage", ["delete", "empty"])
def test_deleted_or_empty_data_file(saved, tmp_path, damage):
    path = _copy(saved, tmp_path)
    file, where = _shared_file(path, saved[1])
    if damage == "delete":
        os.remove(file)
    else:
        open(file, "wb").close()
    with pytest.raises(CorruptCheckpointError) as err:
        lio.load_params(path)
    _check(err.value, path, list(where), "cannot be read: data cut short")


@pytest.mark.parametrize("damage", ["manifest", "metadata-missing", "metadata-garbled",
                                    "array-metadata-garbled"])
def test_damaged_index_names_every_array(saved, tmp_path, damage):
    path = _copy(saved, tmp_path)
    arrays = path / lio.ARRAYS_DIR
    if damage == "manifest":
        data = (arrays / "manifest.ocdbt").read_bytes()
        (arrays / "manifest.ocdbt").write_bytes(data[: len(data) // 2])
        what = 'its OCDBT index is damaged: data garbled (DATA_LOSS: Error decoding file "manifest'
    elif damage == "metadata-missing":
        os.remove(arrays / "_METADATA")
        what = "its index file _METADATA is missing"
    elif damage == "metadata-garbled":
        (arrays / "_METADATA").write_text('{"tree_metadata": {')
        what = "its index file _METADATA is unreadable"
    else:
        (arrays / "array_metadatas" / "process_0").write_text("{garbage")
        what = "its index file array_metadatas/process_0 is unreadable"
    with pytest.raises(CorruptCheckpointError) as err:
        lio.load_params(path)
    _check(err.value, path, list(_leaves(saved[1])), what)
    assert "none of its 6 arrays" in str(err.value)


def test_flipped_bytes_in_two_arrays_name_both(saved, tmp_path):
    path = _copy(saved, tmp_path)
    at = {name: (file, se) for file, where in _locate(path, saved[1]).items()
          for name, se in where.items()}
    flipped = ["dec/w", "out"]
    for name in flipped:
        file, (start, _) = at[name]
        data = bytearray(open(file, "rb").read())
        data[start + 17] ^= 0x08
        open(file, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError) as err:
        lio.load_params(path)
    _check(err.value, path, flipped, "do not match the sha256 checksum recorded in")
    assert f"2 arrays (in {path / lio.ARRAYS_DIR}): 'dec/w' (arr_" in str(err.value)
    # unverified, the same files load, each flipped array with one changed value
    got, orig = _leaves(lio.load_params(path, verify=False)), _leaves(saved[1])
    for name in orig:
        diff = np.asarray(got[name]).view(np.uint32) != np.asarray(orig[name]).view(np.uint32)
        assert diff.sum() == (1 if name in flipped else 0), name


def test_load_model_and_load_state_report_the_same(tmp_path):
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=8,
                    num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                    num_labels=3)
    rng = np.random.default_rng(0)
    abstract = jax.eval_shape(lambda: models.get_family("vit").init(jax.random.PRNGKey(0), cfg))
    params = jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), abstract)
    path = tmp_path / "vit"
    lio.save_model(path, cfg, params, state={"mean": jnp.arange(4.0)})
    data = (path / lio.ARRAYS_DIR / "manifest.ocdbt").read_bytes()
    (path / lio.ARRAYS_DIR / "manifest.ocdbt").write_bytes(data[:20])
    n = sum(1 for x in jax.tree_util.tree_leaves(params) if x.size)
    for load, who in ((lio.load_model, "load_model"), (lio.load_model_state, "load_model_state")):
        with pytest.raises(CorruptCheckpointError) as err:
            load(path)
        msg = str(err.value)
        assert msg.startswith(f"{who}: checkpoint {path} is damaged: none of its ")
        assert "\n" not in msg and "its OCDBT index is damaged" in msg
    # load_model_state is asked for the state only; load_model for the parameters only
    assert "none of its 1 arrays ('<state>/mean')" in msg
    with pytest.raises(CorruptCheckpointError, match=f"none of its {n} arrays"):
        lio.load_model(path)


# ---------------------------------------------------------------------------------------------
# In a fresh process: nothing but the one line, including at interpreter exit.

_LOAD = """
import sys
from lowrank_jax import io
from lowrank_jax.errors import CorruptCheckpointError
try:
    io.load_params(sys.argv[1])
except CorruptCheckpointError as e:
    print(e)
else:
    print("loaded")
"""


def _env():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LOWRANK_JAX_DEBUG", None)
    return env


def _truncate_every_data_file(saved, tmp_path):
    """Every data file cut to half: several arrays fail to read at once (before the fix this
    printed "Event loop is closed" and "Exception ignored in: <coroutine ...>" tracebacks in
    most runs, some only at interpreter exit)."""
    path = _copy(saved, tmp_path)
    found = _locate(path, saved[1])
    lost = []
    for file, where in found.items():
        cut = os.path.getsize(file) // 2
        with open(file, "r+b") as f:
            f.truncate(cut)
        lost += [p for p, (s, e) in where.items() if e > cut]
    assert len(lost) >= 2
    return path, lost


def test_nothing_else_is_printed_at_exit_over_repeated_runs(saved, tmp_path):
    path, lost = _truncate_every_data_file(saved, tmp_path)
    for _ in range(3):  # the stray output came in some runs only
        proc = subprocess.run([sys.executable, "-c", _LOAD, str(path)], env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "", proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, proc.stdout[-3000:]
        assert f"checkpoint {path} is damaged" in lines[0]
        assert all(f"'{p}'" in lines[0] for p in lost), lines[0]


def test_cli_prints_one_error_line_and_exits_2(saved, tmp_path):
    path, lost = _truncate_every_data_file(saved, tmp_path)
    out = tmp_path / "small"
    cli = "import sys; from lowrank_jax.cli.main import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", cli, "compress", str(path), "--rank", "2",
                           "--out", str(out), "--no-progress"], env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("lowrank-jax compress: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"checkpoint {path} is damaged" in errors[0]
    assert all(f"'{p}'" in errors[0] for p in lost), errors[0]
    # anything else is the command's own stage lines ("loading ...")
    assert all(ln.startswith("lowrank-jax compress: ") for ln in lines), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# The pieces.

def test_describe_keeps_the_status_and_drops_the_spec_dump():
    inner = ValueError('OUT_OF_RANGE: Error reading "arr_000002/0.0" in OCDBT database at local '
                       'file "/x/ck/arrays/": Requested byte range [0, 8202) is not valid for '
                       "value of size 4241")
    try:
        try:
            raise inner
        except ValueError as e:
            raise Exception("Encountered error while reading array index: (slice(0, 4, 1),). "
                            "See full TensorStore details: <TensorStore({\n  'base': {\n"
                            "    'driver': 'zarr',\n  },\n})>.") from e
    except Exception as e:
        outer = e
    assert _reads.describe(outer) == (
        "data cut short (OUT_OF_RANGE: Requested byte range [0, 8202) is not valid for value "
        "of size 4241)")
    zstd = ValueError('FAILED_PRECONDITION: Error reading "arr_000001/0.0" in OCDBT database at '
                      'local file "/x/": Truncated Zstd-compressed stream; at byte 0')
    assert _reads.describe(zstd) == ("data cut short or missing (FAILED_PRECONDITION: Truncated "
                                     "Zstd-compressed stream; at byte 0)")
    index = ValueError('NOT_FOUND: Error reading Byte range [0, 360) of local file '
                       '"/x/ck/arrays/d/c934" [tensorstore_spec=\'{"driver": "zarr"}\']')
    assert _reads.describe(index, root="/x/ck/arrays") == (
        'a file is missing (NOT_FOUND: Error reading Byte range [0, 360) of file "d/c934")')
    # no status: the innermost error, its type and first words; the spec dump goes
    plain = Exception("Encountered error. See full TensorStore details: <TensorStore({...})>.")
    assert _reads.describe(plain) == "Exception: Encountered error"
    assert _reads.describe(KeyError("x" * 500), limit=50).endswith(" ...")
    assert len(_reads.describe(KeyError("x" * 500), limit=50)) == 50
    # what was being handled when the error was raised is not its cause
    try:
        try:
            raise inner
        except ValueError:
            raise RuntimeError("DATA_LOSS: Error decoding manifest") from None
    except RuntimeError as e:
        assert _reads.describe(e) == "data garbled (DATA_LOSS: Error decoding manifest)"


def test_abandoned_orbax_reads_are_dropped_and_nothing_else(caplog):
    loop = asyncio.new_event_loop()
    try:
        async def read():  # stands for a coroutine of orbax: judged by the file it comes from
            raise ValueError("boom")

        read.__code__ = read.__code__.replace(
            co_filename=os.path.join("site-packages", "orbax", "checkpoint", "x.py"))

        async def user_code():
            raise KeyError("x")

        tasks = [loop.create_task(read()), loop.create_task(user_code())]
        loop.run_until_complete(asyncio.wait(tasks))
        caplog.set_level(logging.ERROR, logger="asyncio")
        msg = "Task exception was never retrieved"
        for t in tasks:
            _reads._unless_abandoned(loop, {"message": msg, "exception": t.exception(),
                                            "future": t})
        _reads._unless_abandoned(loop, {"message": "Future exception was never retrieved",
                                        "exception": ValueError("OUT_OF_RANGE [tensorstore_spec=.]"),
                                        "future": loop.create_future()})
        _reads._unless_abandoned(loop, {"message": "some other asyncio error"})
    finally:
        loop.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(logged) == 2, logged
    assert "user_code" in logged[0] and caplog.records[0].exc_info[0] is KeyError
    assert logged[1] == "some other asyncio error"


def test_quiet_reads_touches_only_its_own_thread_and_undoes_itself():
    policy = asyncio.get_event_loop_policy()
    plain_close = type(asyncio.new_event_loop()).close
    seen = {}

    def other_thread():
        loop = asyncio.new_event_loop()
        seen["other"] = "close" in vars(loop)
        loop.close()

    with _reads.quiet_reads():
        with _reads.quiet_reads():  # nested
            mine = asyncio.new_event_loop()
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
        # a pending task finishes before the loop closes, its failure collected
        done = []

        async def late():
            await asyncio.sleep(0.01)
            done.append(1)
            raise ValueError("late")

        task = mine.create_task(late())
        mine.close()
        assert done == [1] and task.done() and mine.is_closed()
        mine.call_soon_threadsafe(print, "dropped")  # after close: no RuntimeError
        assert "new_event_loop" in vars(policy)
    assert "close" in vars(mine) and seen["other"] is False
    assert "new_event_loop" not in vars(policy)
    after = asyncio.new_event_loop()
    assert "close" not in vars(after) and type(after).close is plain_close
    after.close()
    with pytest.raises(RuntimeError, match="closed"):
        after.call_soon_threadsafe(print, "x")


def test_tasks_started_while_the_loop_drains_also_finish_before_it_closes():
    """The restore's shape: a task pending when the first read fails starts new reads with
    ``gather`` and ends at their first failure. The read left pending must still finish before
    the loop closes; left pending, it was destroyed silently at a later garbage collection and
    its coroutine printed "Exception ignored in: <coroutine ...>" (orbax turns the
    ``GeneratorExit`` into an ``Exception``)."""
    finished, unraisable = [], []

    async def failing_read():
        await asyncio.sleep(0.01)
        raise ValueError("data cut short")

    async def slow_read():
        try:
            await asyncio.sleep(0.2)
            finished.append("slow_read")
        except BaseException as e:  # what orbax's _read_array_index_and_device_put does
            raise Exception("Encountered error while reading array index") from e

    async def array_still_opening():
        await asyncio.sleep(0.005)  # still opening its file when the first array fails
        await asyncio.gather(failing_read(), slow_read())

    async def first_array():
        raise ValueError("first array")

    async def restore():
        await asyncio.gather(first_array(), array_still_opening())

    hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with _reads.quiet_reads():
            loop = asyncio.new_event_loop()
            try:
                with pytest.raises(ValueError, match="first array"):
                    loop.run_until_complete(restore())
            finally:
                loop.close()
        left_pending = sum(not t.done() for t in asyncio.all_tasks(loop))
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [repr(u.object) for u in unraisable] == []
    assert left_pending == 0 and finished == ["slow_read"]


def test_orbax_log_records_are_held_back_only_inside(caplog):
    log = logging.getLogger("absl")
    orbax_file = os.path.join("site-packages", "orbax", "checkpoint", "x.py")

    def emit(pathname):
        log.handle(logging.LogRecord("absl", logging.WARNING, pathname, 1, "w", None, None))

    caplog.set_level(logging.WARNING, logger="absl")
    with _reads.quiet_reads():
        emit(orbax_file)
        emit("user.py")
    emit(orbax_file)
    assert [r.pathname for r in caplog.records] == ["user.py", orbax_file]
