"""Built-in time series for demos and checks: real series shipped with aeon, else synthetic.

The bottom of the package (no lowrank_jax imports), so every layer may use it. Training data
pipelines (window samplers, ETT-style CSV loaders) belong to the ``train`` layer.
"""

from __future__ import annotations

import warnings

import numpy as np

# Real series that aeon ships inside its wheel (no download): monthly airline passengers, solar
# power, PBS sales, a UCR anomaly-archive series (KDD TSAD 135), an ECG recording, household
# electric devices, the GunPoint segmentation series and Daphnet gait accelerometers (9 channels,
# each used as a univariate series).
_AEON_LOADERS = (
    "load_airline", "load_solar", "load_PBS_dataset", "load_kdd_tsad_135",
    "load_ecg_diff_count_3", "load_electric_devices_segmentation",
    "load_gun_point_segmentation", "load_daphnet_s06r02e0",
)


def builtin_datasets() -> tuple[dict[str, list[np.ndarray]], str]:
    """The built-in series grouped by dataset: ``({name: [series, ...]}, description)``.

    Real series shipped with aeon (NaNs dropped, each at least 32 long; a multivariate dataset
    gives one series per channel), or synthetic ones grouped by kind if aeon is not installed.
    Per-dataset groups are what Chronos-style evaluation needs: scores are computed per
    dataset and aggregated by geometric mean relative to a baseline.
    """
    try:
        from aeon import datasets as ds

        groups: dict[str, list[np.ndarray]] = {}
        for name in _AEON_LOADERS:
            fn = getattr(ds, name, None)
            if fn is None:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    y = fn()
            except Exception:  # a loader whose file is missing: skip it
                continue
            y = y[0] if isinstance(y, tuple) else y
            y = y.to_numpy() if hasattr(y, "to_numpy") else y
            a = np.asarray(y, dtype=np.float64)
            a = a.reshape(a.shape[0], -1) if a.ndim > 1 else a[:, None]
            cols = [c[np.isfinite(c)] for c in a.T]
            cols = [c for c in cols if c.size >= 32]
            if cols:
                groups[name.removeprefix("load_")] = cols
        if groups:
            return groups, f"aeon ({', '.join(groups)})"
    except ImportError:
        pass
    t = np.arange(2048, dtype=np.float64)
    rng = np.random.default_rng(0)
    groups = {
        "sinusoids": [np.sin(2 * np.pi * t / p) for p in (12, 24, 50, 168)],
        "exponentials": [np.exp(-t / 400.0), np.exp(t / 2048.0)],
        "white_noise": [rng.normal(size=t.size)],
    }
    return groups, "synthetic (sinusoids, exponentials, white noise; install aeon for real series)"


def builtin_series() -> tuple[list[np.ndarray], str]:
    """All built-in series in one list: ``(series, description)`` (see :func:`builtin_datasets`)."""
    groups, source = builtin_datasets()
    return [s for group in groups.values() for s in group], source


def windows(series: list[np.ndarray], length: int, n: int, seed: int = 0) -> np.ndarray:
    """``n`` windows of ``length`` values (a short series is stretched by interpolation)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = series[i % len(series)]
        if s.size < length:
            s = np.interp(np.linspace(0, s.size - 1, length), np.arange(s.size), s)
        start = rng.integers(0, s.size - length + 1)
        out.append(s[start : start + length])
    return np.stack(out)


__all__ = ["builtin_datasets", "builtin_series", "windows"]
