"""Training data: forecasting windows over time series, ETT-style CSV files, device prefetch.

A :class:`WindowSampler` cuts ``(context, target)`` windows out of a list of series and serves
them in fixed-size batches (fixed shapes, so a jitted step compiles once). Conventions:

* **Channel independence.** A multivariate series ``[T, V]`` is treated as ``V`` univariate
  series, one per variate (as Chronos does). Its channels are named ``"name[j]"``.
* **Splits by time.** Each (univariate) series of length ``T`` is split at
  ``round(T * train)`` and ``round(T * (train + val))`` into train / validation / test parts
  (default 70% / 10% / 20%). A window belongs to the split that holds its *target*; its
  *context* may reach back into earlier data (a validation window's context may lie in the
  training part, a test window's in the training and validation parts), as in the usual
  forecasting protocol. A training window never sees later data.
* **Scaling** per window, from the context only (the target is scaled the same way):
  ``"mean"`` divides by ``mean(|context|)`` (Chronos' mean scaling; a zero scale becomes 1);
  ``"standard"`` subtracts the context mean and divides by its standard deviation; ``None``
  leaves values as they are. Each batch carries ``loc`` and ``scale`` so that forecasts can be
  mapped back: ``y = y_scaled * scale + loc``.
* **Determinism.** ``sampler.batch(position)`` depends only on ``(seed, position)``: batch
  ``p`` holds windows ``p * batch_size ... (p + 1) * batch_size - 1`` of an endless sequence of
  epochs, each epoch a permutation of all windows drawn from ``numpy.random.default_rng((seed,
  epoch))`` (no permutation when ``shuffle=False``). Iterating advances ``.position`` by one
  per batch; storing it (``TrainState.data_position``) and setting it back resumes the exact
  batch sequence.

Bad configurations (a horizon or context longer than a series' split, ``batch_size < 1``,
``stride < 1``, non-finite values) are rejected when the sampler is built, before anything is
compiled, with a message naming the series and the lengths involved.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import warnings
from typing import Any, Iterable, Iterator, Sequence

import jax
import numpy as np

from lowrank_jax.errors import ConfigError, DataError, MissingFileError

SPLITS = ("train", "val", "test")
SCALINGS = ("mean", "standard", None)


@dataclasses.dataclass(frozen=True)
class WindowConfig:
    """How windows are cut and scaled.

    Attributes:
      context_length: number of past values the model sees.
      horizon: number of future values to predict.
      stride: distance between the target starts of consecutive windows of one series.
      splits: fractions ``(train, val, test)`` of each series, by time; they must sum to 1.
      scaling: ``"mean"`` (Chronos), ``"standard"`` or ``None``.
    """

    context_length: int
    horizon: int
    stride: int = 1
    splits: tuple[float, float, float] = (0.7, 0.1, 0.2)
    scaling: str | None = "mean"

    def __post_init__(self):
        for name in ("context_length", "horizon", "stride"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"WindowConfig: {name} must be an int >= 1, got {v!r}",
                                  where=name, expected="int >= 1", actual=v)
        splits = tuple(float(f) for f in self.splits)
        if len(splits) != 3 or any(not np.isfinite(f) or f < 0 for f in splits):
            raise ConfigError(
                f"WindowConfig: splits must be three non-negative fractions (train, val, test), "
                f"got {self.splits!r}", where="splits"
            )
        if abs(sum(splits) - 1.0) > 1e-6:
            raise ConfigError(f"WindowConfig: splits must sum to 1, got {self.splits!r} "
                              f"(sum {sum(splits):.6g})", where="splits", expected=1.0,
                              actual=sum(splits))
        object.__setattr__(self, "splits", splits)
        if self.scaling not in SCALINGS:
            raise ConfigError(
                f"WindowConfig: scaling must be one of {SCALINGS}, got {self.scaling!r}",
                where="scaling", expected=SCALINGS, actual=self.scaling
            )


def split_bounds(length: int, splits: Sequence[float]) -> dict[str, tuple[int, int]]:
    """The time ranges of the splits of one series.

    Args:
      length: number of values of the series.
      splits: fractions ``(train, val, test)``.

    Returns:
      ``{split: (start, end)}``, boundaries at ``round(length * train)`` and
      ``round(length * (train + val))``.
    """
    b1 = int(round(length * splits[0]))
    b2 = int(round(length * (splits[0] + splits[1])))
    b2 = min(max(b2, b1), length)
    return {"train": (0, b1), "val": (b1, b2), "test": (b2, length)}


def _as_channels(series_list: Any, names: Sequence[str] | None
                 ) -> tuple[list[np.ndarray], list[str]]:
    """Flatten ``[T]`` / ``[T, V]`` series into univariate float64 channels with names."""
    if isinstance(series_list, np.ndarray) or isinstance(series_list, jax.Array):
        series_list = [series_list]
    series_list = list(series_list)
    if not series_list:
        raise DataError("WindowSampler: series_list is empty")
    if names is not None and len(names) != len(series_list):
        raise DataError(
            f"WindowSampler: got {len(names)} names for {len(series_list)} series"
        )
    channels, channel_names = [], []
    for i, s in enumerate(series_list):
        name = str(names[i]) if names is not None else f"series {i}"
        try:
            a = np.asarray(s, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise DataError(f"WindowSampler: {name} is not numeric: {e}") from e
        if a.ndim == 1:
            cols = [(name, a)]
        elif a.ndim == 2:
            cols = [(f"{name}[{j}]", a[:, j]) for j in range(a.shape[1])]
        else:
            raise DataError(
                f"WindowSampler: {name} must be [time] or [time, variates], got shape {a.shape}"
            )
        for cname, c in cols:
            bad = np.flatnonzero(~np.isfinite(c))
            if bad.size:
                raise DataError(
                    f"WindowSampler: {cname} has {bad.size} non-finite values (first at time "
                    f"index {bad[0]}); fill or drop them before sampling", where=cname
                )
            channels.append(np.ascontiguousarray(c))
            channel_names.append(cname)
    return channels, channel_names


class WindowSampler:
    """Deterministic batches of forecasting windows (see the module docstring).

    Args:
      series_list: a list of series, each ``[T]`` or ``[T, V]`` (array-like), or one array.
      cfg: a :class:`WindowConfig`.
      split: ``"train"``, ``"val"`` or ``"test"``.
      batch_size: windows per batch (>= 1). Batches always have exactly this many windows
        (the sequence wraps into the next epoch), so shapes are fixed.
      seed: seed of the epoch permutations.
      names: optional names of the series, used in errors and in ``channel_names``.
      shuffle: permute windows each epoch (default: only for ``split="train"``).
      position: initial position (e.g. ``int(state.data_position)`` on resume).
      skip_short: drop channels that are too short for the split (instead of raising) as long
        as at least one remains; the names of the dropped ones are in ``skipped``.

    Each batch is a dict of NumPy arrays:
      ``context`` float32[b, context_length], ``target`` float32[b, horizon] (both scaled),
      ``loc``, ``scale`` float32[b], ``series`` int32[b] (channel index), ``start``
      int32[b] (time index of the first target value).

    Raises:
      ConfigError: ``batch_size < 1``, an unknown split, a ``cfg`` that is no WindowConfig.
      DataError: non-finite values, or a channel whose split cannot hold one window (its name,
        length, split range and the window lengths are in the message).
    """

    def __init__(self, series_list: Any, cfg: WindowConfig, split: str = "train",
                 batch_size: int = 32, seed: int = 0, *, names: Sequence[str] | None = None,
                 shuffle: bool | None = None, position: int = 0, skip_short: bool = False):
        if not isinstance(cfg, WindowConfig):
            raise ConfigError(f"WindowSampler: cfg must be a WindowConfig, got "
                              f"{type(cfg).__name__}", where="cfg", expected="WindowConfig",
                              actual=type(cfg).__name__)
        if split not in SPLITS:
            raise ConfigError(f"WindowSampler: split must be one of {SPLITS}, got {split!r}",
                              where="split", expected=SPLITS, actual=split)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ConfigError(f"WindowSampler: batch_size must be an int >= 1, got "
                              f"{batch_size!r}", where="batch_size", expected="int >= 1",
                              actual=batch_size)
        self.cfg = cfg
        self.split = split
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
        channels, channel_names = _as_channels(series_list, names)

        ctx, h, stride = cfg.context_length, cfg.horizon, cfg.stride
        kept, kept_names, starts_per, problems = [], [], [], []
        for c, cname in zip(channels, channel_names, strict=True):
            lo, hi = split_bounds(c.size, cfg.splits)[split]
            first = max(lo, ctx)  # the context may reach back before the split, not before 0
            last = hi - h         # the target must end inside the split
            if last < first:
                if hi - lo < h:
                    why = (f"its {split} split holds {hi - lo} values (time {lo}..{hi}) but "
                           f"horizon={h}")
                else:
                    why = (f"a window needs context_length + horizon = {ctx} + {h} = {ctx + h} "
                           f"values ending inside the {split} split, but the split ends at time "
                           f"{hi}")
                problems.append(f"{cname} (length {c.size}): {why}")
                continue
            kept.append(c)
            kept_names.append(cname)
            starts_per.append(np.arange(first, last + 1, stride, dtype=np.int64))
        if problems and not (skip_short and kept):
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise DataError(
                "WindowSampler: no room for a window in " + "; ".join(problems[:3]) + more
                + f". splits={cfg.splits}; use shorter context/horizon, other splits, longer "
                "series" + ("" if skip_short else ", or skip_short=True to drop short series"),
                where=problems[0].split(" (length")[0]
            )
        self.skipped = [p.split(" (length")[0] for p in problems]
        self.channel_names = kept_names
        lengths = np.array([c.size for c in kept], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self._values = np.concatenate(kept)
        self._series = np.concatenate([np.full(s.size, i, np.int64)
                                       for i, s in enumerate(starts_per)])
        self._starts = np.concatenate(starts_per)
        self._span = np.arange(-ctx, h, dtype=np.int64)
        self._perm_cache: dict[int, np.ndarray] = {}
        self.position = int(position)

    # -----------------------------------------------------------------------------------------

    @property
    def num_windows(self) -> int:
        """Number of distinct windows in this split."""
        return int(self._starts.size)

    @property
    def batches_per_epoch(self) -> int:
        """``ceil(num_windows / batch_size)``: batches that cover every window at least once."""
        return -(-self.num_windows // self.batch_size)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows)
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)
            self._perm_cache = {epoch: perm}  # keep one epoch: positions are mostly sequential
        return perm

    def window_indices(self, position: int) -> np.ndarray:
        """The windows of a batch.

        Args:
          position: the batch number (``>= 0``).

        Returns:
          ``int64[batch_size]`` indices into all windows of the split.
        """
        if position < 0:
            raise ConfigError(f"WindowSampler: position must be >= 0, got {position}")
        n = self.num_windows
        flat = np.arange(position * self.batch_size, (position + 1) * self.batch_size,
                         dtype=np.int64)
        epochs, within = np.divmod(flat, n)
        out = np.empty_like(flat)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._epoch_order(int(e))[within[sel]]
        return out

    def batch(self, position: int) -> dict[str, np.ndarray]:
        """A batch, as a pure function of ``(seed, position)``.

        Args:
          position: the batch number (``>= 0``).

        Returns:
          The dict of arrays described in the class docstring.
        """
        idx = self.window_indices(int(position))
        series, starts = self._series[idx], self._starts[idx]
        ctx = self.cfg.context_length
        gather = (self._offsets[series] + starts)[:, None] + self._span[None, :]
        win = self._values[gather]  # [b, ctx + horizon], float64
        context, target = win[:, :ctx], win[:, ctx:]
        if self.cfg.scaling == "mean":
            loc = np.zeros(len(idx))
            scale = np.mean(np.abs(context), axis=1)
        elif self.cfg.scaling == "standard":
            loc = np.mean(context, axis=1)
            scale = np.std(context, axis=1)
        else:
            loc, scale = np.zeros(len(idx)), np.ones(len(idx))
        scale = np.where(scale > 0, scale, 1.0)
        return {
            "context": ((context - loc[:, None]) / scale[:, None]).astype(np.float32),
            "target": ((target - loc[:, None]) / scale[:, None]).astype(np.float32),
            "loc": loc.astype(np.float32),
            "scale": scale.astype(np.float32),
            "series": series.astype(np.int32),
            "start": starts.astype(np.int32),
        }

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch(self.position)
        self.position += 1
        return out

    def __repr__(self) -> str:
        return (f"WindowSampler(split={self.split!r}, channels={len(self.channel_names)}, "
                f"windows={self.num_windows}, batch_size={self.batch_size}, "
                f"position={self.position}, cfg={self.cfg})")


# ---------------------------------------------------------------------------------------------
# Series sources.

def load_ett_csv(path: str | os.PathLike, *, return_dates: bool = False):
    """Load an ETT-style CSV file: a date column first, then one numeric column per variate.

    Args:
      path: the CSV file (e.g. ``ETTh1.csv`` with columns ``date,HUFL,HULL,...,OT``).
      return_dates: also return the parsed dates.

    Returns:
      ``(names, values)``: the variate names and ``float64[T, V]``; with ``return_dates``,
      ``(names, values, dates)`` where ``dates`` is ``datetime64[ns][T]``.

    Raises:
      MissingFileError: ``path`` does not exist (a ``FileNotFoundError``).
      DataError: the first column is not a date column, dates are not strictly increasing,
        there is no variate column, or a variate holds non-numeric or missing values (the file,
        column, row and value are named).
    """
    import pandas as pd

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MissingFileError(f"load_ett_csv: no such file {path}", where=path)
    try:
        df = pd.read_csv(path)
    except Exception as e:  # pandas raises several types for malformed files
        raise DataError(f"load_ett_csv: cannot parse {path} as CSV: {e}", where=path) from e
    if df.shape[1] < 2:
        raise DataError(
            f"load_ett_csv: {path} has columns {list(df.columns)}; expected a date column "
            "followed by at least one numeric variate"
        )
    date_col = df.columns[0]
    raw = df[date_col]
    if pd.api.types.is_numeric_dtype(raw) or pd.api.types.is_bool_dtype(raw):
        raise DataError(
            f"load_ett_csv: {path}: the first column '{date_col}' must hold dates (ETT layout: "
            f"date, variate, ...), but it holds numbers (first value {raw.iloc[0]!r}); is the "
            "date column missing?"
        )
    with warnings.catch_warnings():  # "could not infer format" for unusual date formats
        warnings.simplefilter("ignore", UserWarning)
        dates = pd.to_datetime(raw.astype(str), errors="coerce")
    bad = np.flatnonzero(dates.isna().to_numpy())
    if bad.size:
        r = int(bad[0])
        raise DataError(
            f"load_ett_csv: {path}: the first column '{date_col}' must hold dates (ETT layout: "
            f"date, variate, ...), but row {r + 2} has {raw.iloc[r]!r} ({bad.size} unparsable "
            "values)"
        )
    d = dates.to_numpy()
    nonmono = np.flatnonzero(np.diff(d) <= np.timedelta64(0, "ns"))
    if nonmono.size:
        r = int(nonmono[0]) + 1
        raise DataError(
            f"load_ett_csv: {path}: dates in column '{date_col}' must be strictly increasing; "
            f"row {r + 2} ({raw.iloc[r]!r}) does not come after row {r + 1} "
            f"({raw.iloc[r - 1]!r})"
        )
    names, cols = [], []
    for col in df.columns[1:]:
        values = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            r = int(bad[0])
            raise DataError(
                f"load_ett_csv: {path}: column '{col}' must be numeric, but row {r + 2} has "
                f"{df[col].iloc[r]!r} ({bad.size} non-numeric or missing values)"
            )
        names.append(str(col))
        cols.append(values)
    values = np.stack(cols, axis=1)
    return (names, values, d) if return_dates else (names, values)


def default_series() -> tuple[list[np.ndarray], str]:
    """The embedded default data: real series shipped with aeon (synthetic if aeon is missing).

    Returns:
      ``(series_list, source)`` as :func:`lowrank_jax.datasets.builtin_series`: univariate
      ``float64[T]`` series and a description of where they came from.
    """
    from lowrank_jax.datasets import builtin_series

    return builtin_series()


class ProcessPart:
    """This process's part of every batch of a batch source, for multi-process data parallelism.

    With ``count`` processes, batch ``p`` of ``source`` (``batch_size`` rows) is split into
    ``count`` consecutive blocks of ``batch_size / count`` rows and process ``index`` gets block
    ``index``: every process feeds its own rows and together they make the global batch
    (the train step assembles it with ``jax.make_array_from_process_local_data``). Every array
    of a batch is split along its first dimension.

    Args:
      source: a deterministic batch source (``batch(position)``, ``position``), e.g. a
        :class:`WindowSampler` built identically in every process.
      index: this process (default ``jax.process_index()``).
      count: the number of processes (default ``jax.process_count()``).

    Raises:
      ConfigError: ``index`` is not in ``[0, count)``.
      DataError: (from :meth:`batch`) a batch's size is not divisible by ``count``.
    """

    def __init__(self, source: Any, index: int | None = None, count: int | None = None):
        self.source = source
        self.index = jax.process_index() if index is None else int(index)
        self.count = jax.process_count() if count is None else int(count)
        if not 0 <= self.index < self.count:
            raise ConfigError(f"ProcessPart: index {self.index} is not in [0, {self.count})",
                              where="index", expected=f"0 <= index < {self.count}",
                              actual=self.index)
        self.position = source.position

    def batch(self, position: int) -> Any:
        """Rows ``index * b / count ... (index + 1) * b / count - 1`` of ``source.batch(position)``.

        Args:
          position: the batch position.

        Returns:
          The batch with every array cut to this process's rows.
        """
        full = self.source.batch(position)
        flat, treedef = jax.tree_util.tree_flatten(full)
        sizes = {np.shape(x)[0] for x in flat}
        size = sizes.pop() if len(sizes) == 1 else None
        if size is None or size % self.count:
            raise DataError(f"ProcessPart: batch {position} has batch sizes {sorted(sizes)}; "
                            f"need one size divisible by the {self.count} processes",
                            where=f"batch {position}", expected=f"a multiple of {self.count}",
                            actual=size)
        n = size // self.count
        return jax.tree_util.tree_unflatten(
            treedef, [x[self.index * n:(self.index + 1) * n] for x in flat])


# ---------------------------------------------------------------------------------------------
# Prefetch.

_END = object()


class _Prefetcher:
    def __init__(self, iterator: Iterable, size: int, sharding: Any):
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._source = iter(iterator)
        self._sharding = sharding
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="lowrank_jax-prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            for batch in self._source:
                if self._sharding is None:
                    batch = jax.device_put(batch)
                else:
                    batch = jax.device_put(batch, self._sharding)
                if not self._put((True, batch)):
                    return
            self._put((True, _END))
        except BaseException as e:  # forwarded to the consumer, raised there
            self._put((False, e))

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        ok, item = self._queue.get()
        if not ok:
            self._done = True
            raise item
        if item is _END:
            self._done = True
            raise StopIteration
        return item

    def close(self):
        """Stop the background thread (batches already taken from the source are dropped)."""
        self._stop.set()
        self._done = True
        self._thread.join(timeout=5)

    def __del__(self):
        self._stop.set()


def prefetch_to_device(iterator: Iterable, size: int = 2, sharding: Any = None) -> Iterator:
    """Iterate over ``iterator`` with up to ``size`` batches already placed on devices.

    A background thread pulls batches from ``iterator`` and ``jax.device_put``s them (with
    ``sharding``: a ``jax.sharding.Sharding``, or a pytree of them matching a batch, e.g.
    ``NamedSharding(mesh, P("data"))`` for data parallelism), so producing the next batch
    overlaps the current step. Order is preserved; an exception in ``iterator`` is raised by
    ``next`` at the point where it occurred. Call ``.close()`` on the result to stop early.

    Note that pulling from a :class:`WindowSampler` advances its ``.position`` ahead of the
    consumer by up to ``size + 1`` batches: store the position of the batch consumed (e.g.
    ``state.step``-based), not ``sampler.position``, for exact resume.

    Args:
      iterator: any iterable of batches.
      size: number of batches placed ahead.
      sharding: where to place them (``None``: the default device).

    Returns:
      An iterator over the placed batches, with a ``close()`` method.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"prefetch_to_device: size must be an int >= 1, got {size!r}")
    return _Prefetcher(iterator, size, sharding)


__all__ = ["ProcessPart", "WindowConfig", "WindowSampler", "default_series", "load_ett_csv",
           "prefetch_to_device", "split_bounds"]
