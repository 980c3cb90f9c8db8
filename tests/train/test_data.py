"""Window sampler, ETT CSV loader, default series and device prefetch."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lowrank_jax.errors import ConfigError, DataError, MissingFileError
from lowrank_jax.train.data import (
    WindowConfig,
    WindowSampler,
    default_series,
    load_ett_csv,
    prefetch_to_device,
    split_bounds,
)


def _reference_windows(series, ctx, h, stride, split, splits=(0.7, 0.1, 0.2)):
    """All (channel, target start) pairs, written plainly."""
    out = []
    for i, s in enumerate(series):
        T = len(s)
        b1, b2 = round(T * splits[0]), round(T * (splits[0] + splits[1]))
        lo, hi = {"train": (0, b1), "val": (b1, b2), "test": (b2, T)}[split]
        t = max(lo, ctx)
        while t + h <= hi:
            out.append((i, t))
            t += stride
    return out


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_windows_match_plain_reference(split):
    rng = np.random.default_rng(0)
    series = [rng.normal(size=200) + 5, rng.normal(size=97) - 3]
    cfg = WindowConfig(context_length=12, horizon=4, stride=3, scaling=None)
    s = WindowSampler(series, cfg, split=split, batch_size=5, seed=1)
    ref = _reference_windows(series, 12, 4, 3, split)
    assert s.num_windows == len(ref)
    seen = set()
    for p in range(s.batches_per_epoch):
        b = s.batch(p)
        assert b["context"].shape == (5, 12) and b["target"].shape == (5, 4)
        assert b["context"].dtype == np.float32
        for k in range(5):
            i, t = int(b["series"][k]), int(b["start"][k])
            np.testing.assert_array_equal(b["context"][k], series[i][t - 12:t].astype(np.float32))
            np.testing.assert_array_equal(b["target"][k], series[i][t:t + 4].astype(np.float32))
            seen.add((i, t))
    # one epoch covers every window (the last batch wraps into the next epoch)
    assert seen == set(ref)


def test_target_inside_split_context_may_reach_back():
    series = [np.arange(100.0)]
    cfg = WindowConfig(context_length=20, horizon=5, scaling=None)
    lo, hi = split_bounds(100, cfg.splits)["val"]
    assert (lo, hi) == (70, 80)
    s = WindowSampler(series, cfg, split="val", batch_size=6)
    starts = {int(t) for p in range(s.batches_per_epoch) for t in s.batch(p)["start"]}
    assert starts == set(range(70, 76))
    b = s.batch(0)
    assert b["target"].min() >= 70 and b["target"].max() < 80
    assert b["context"].min() < 70  # the context lies in the training part
    train = WindowSampler(series, cfg, split="train", batch_size=4)
    assert max(int(t) for p in range(train.batches_per_epoch) for t in train.batch(p)["start"]) \
        + 5 <= 70


def test_multivariate_is_channel_independent():
    rng = np.random.default_rng(1)
    mv = rng.normal(size=(80, 3))
    cfg = WindowConfig(context_length=8, horizon=2, scaling=None)
    a = WindowSampler([mv], cfg, batch_size=4, seed=3, names=["ett"])
    b = WindowSampler([mv[:, 0], mv[:, 1], mv[:, 2]], cfg, batch_size=4, seed=3)
    assert a.channel_names == ["ett[0]", "ett[1]", "ett[2]"]
    for p in range(3):
        ba, bb = a.batch(p), b.batch(p)
        for k in ba:
            np.testing.assert_array_equal(ba[k], bb[k])


def test_scaling_mean_and_standard():
    rng = np.random.default_rng(2)
    x = rng.normal(size=120) * 7 + 3
    for scaling in ("mean", "standard"):
        cfg = WindowConfig(context_length=16, horizon=4, scaling=scaling)
        s = WindowSampler([x], cfg, batch_size=3, seed=0)
        b = s.batch(2)
        for k in range(3):
            t = int(b["start"][k])
            c, y = x[t - 16:t], x[t:t + 4]
            if scaling == "mean":
                loc, scale = 0.0, np.abs(c).mean()
            else:
                loc, scale = c.mean(), c.std()
            np.testing.assert_allclose(b["scale"][k], scale, rtol=1e-6)
            np.testing.assert_allclose(b["loc"][k], loc, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(b["context"][k], (c - loc) / scale, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(b["target"][k], (y - loc) / scale, rtol=1e-5, atol=1e-6)
    # an all-zero context gets scale 1, not a division by zero
    z = WindowSampler([np.zeros(50)], WindowConfig(8, 2), batch_size=2).batch(0)
    assert np.all(z["scale"] == 1) and np.all(np.isfinite(z["context"]))


def test_batches_deterministic_in_position_and_resume():
    rng = np.random.default_rng(3)
    series = [rng.normal(size=150), rng.normal(size=(90, 2))]
    cfg = WindowConfig(context_length=10, horizon=3)
    a = WindowSampler(series, cfg, batch_size=7, seed=11)
    run = [next(a) for _ in range(30)]  # several epochs
    assert a.position == 30
    b = WindowSampler(series, cfg, batch_size=7, seed=11, position=17)
    for p in range(17, 30):
        got = next(b)
        for k in got:
            np.testing.assert_array_equal(got[k], run[p][k])
    # random access equals sequential; another seed gives another order
    np.testing.assert_array_equal(a.batch(5)["context"], run[5]["context"])
    c = WindowSampler(series, cfg, batch_size=7, seed=12)
    assert not np.array_equal(c.batch(0)["start"], run[0]["start"])
    # an epoch is a permutation: no window repeats within it
    idx = np.concatenate([a.window_indices(p) for p in range(a.num_windows // 7)])
    assert len(set(idx.tolist())) == idx.size
    # validation / test are unshuffled by default
    v = WindowSampler(series, cfg, split="test", batch_size=4)
    np.testing.assert_array_equal(v.window_indices(0), np.arange(4))


def test_rejects_bad_configs_with_clear_messages():
    series = [np.arange(100.0), np.arange(30.0)]
    with pytest.raises(DataError, match=r"short.*length 30.*horizon=10") as err:
        WindowSampler(series, WindowConfig(4, 10), split="val", names=["long", "short"])
    assert err.value.where == "short"
    with pytest.raises(DataError, match=r"series 1 \(length 30\).*16 \+ 8 = 24.*ends at time 21"):
        WindowSampler(series, WindowConfig(16, 8), split="train")
    with pytest.raises(DataError, match="horizon=200"):
        WindowSampler(series, WindowConfig(4, 200))
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1"):
        WindowSampler(series, WindowConfig(4, 2), batch_size=0)
    with pytest.raises(ConfigError, match="stride must be an int >= 1") as err:
        WindowConfig(4, 2, stride=0)
    assert (err.value.where, err.value.actual) == ("stride", 0)
    with pytest.raises(ConfigError, match="splits must sum to 1"):
        WindowConfig(4, 2, splits=(0.5, 0.1, 0.1))
    with pytest.raises(ConfigError, match="scaling"):
        WindowConfig(4, 2, scaling="max")
    with pytest.raises(DataError, match=r"series 0 has 1 non-finite.*index 3"):
        WindowSampler([np.array([1.0, 2, 3, np.nan] + [1.0] * 50)], WindowConfig(4, 2))
    s = WindowSampler(series, WindowConfig(16, 8), skip_short=True)
    assert s.channel_names == ["series 0"] and s.skipped == ["series 1"]


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_load_ett_csv(tmp_path):
    rows = ["date,HUFL,HULL,OT"]
    rng = np.random.default_rng(4)
    ref = rng.normal(size=(48, 3)).round(4)
    for t in range(48):
        rows.append(f"2016-07-01 {t % 24:02d}:00:00".replace("07-01", f"07-{1 + t // 24:02d}")
                    + "," + ",".join(str(v) for v in ref[t]))
    p = _write(tmp_path, "ETTh1.csv", "\n".join(rows) + "\n")
    names, values, dates = load_ett_csv(p, return_dates=True)
    assert names == ["HUFL", "HULL", "OT"]
    np.testing.assert_array_equal(values, ref)
    assert dates[0] == np.datetime64("2016-07-01T00:00") and dates[-1] == np.datetime64(
        "2016-07-02T23:00")
    s = WindowSampler([values], WindowConfig(8, 4), batch_size=2, names=["ETTh1"])
    assert s.channel_names == ["ETTh1[0]", "ETTh1[1]", "ETTh1[2]"]


def test_load_ett_csv_errors(tmp_path):
    bad_num = _write(tmp_path, "a.csv", "date,x,y\n2020-01-01,1,2\n2020-01-02,oops,3\n")
    with pytest.raises(DataError, match=r"a\.csv.*column 'x'.*row 3.*'oops'"):
        load_ett_csv(bad_num)
    no_date = _write(tmp_path, "b.csv", "x,y\n1,2\n3,4\n")
    with pytest.raises(DataError, match=r"b\.csv.*first column 'x' must hold dates"):
        load_ett_csv(no_date)
    unsorted = _write(tmp_path, "c.csv", "date,x\n2020-01-02,1\n2020-01-01,2\n")
    with pytest.raises(DataError, match=r"c\.csv.*strictly increasing.*row 3"):
        load_ett_csv(unsorted)
    missing = _write(tmp_path, "d.csv", "date,x\n2020-01-01,1\n2020-01-02,\n")
    with pytest.raises(DataError, match=r"d\.csv.*column 'x'.*row 3"):
        load_ett_csv(missing)
    with pytest.raises(MissingFileError, match="nope.csv"):
        load_ett_csv(tmp_path / "nope.csv")
    assert issubclass(MissingFileError, FileNotFoundError) and issubclass(DataError, ValueError)


def test_default_series_are_real_and_usable():
    series, source = default_series()
    assert len(series) >= 1 and all(s.ndim == 1 and np.all(np.isfinite(s)) for s in series)
    if source.startswith("aeon"):
        # aeon's airline series: 144 monthly passenger counts starting at 112
        assert "airline" in source and series[0].size == 144 and series[0][0] == 112
    s = WindowSampler(series, WindowConfig(32, 8), batch_size=4)
    assert np.all(np.isfinite(s.batch(0)["context"]))


def test_prefetch_preserves_order_and_places_on_devices():
    cfg = WindowConfig(8, 2)
    s = WindowSampler([np.arange(200.0) + 1], cfg, batch_size=8, seed=5)
    ref = [s.batch(p) for p in range(6)]
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    src = (s.batch(p) for p in range(6))
    got = list(prefetch_to_device(src, size=2, sharding=sharding))
    assert len(got) == 6
    for g, r in zip(got, ref, strict=True):
        assert isinstance(g["context"], jax.Array) and g["context"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(g["context"]), r["context"])
    plain = list(prefetch_to_device(iter(ref), size=1))
    assert plain[0]["target"].devices() == {jax.devices()[0]}

    def broken():
        yield ref[0]
        raise RuntimeError("source failed")

    it = prefetch_to_device(broken())
    np.testing.assert_array_equal(np.asarray(next(it)["context"]), ref[0]["context"])
    with pytest.raises(RuntimeError, match="source failed"):
        next(it)
    it = prefetch_to_device(iter(s), size=2)
    next(it)
    it.close()
