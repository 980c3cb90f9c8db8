"""The ECG anomaly data of the sparse-binary-transformer tasks are aeon's series in aeon's
documented order (regression: the train and test series were swapped, so the test labels
were all zero and every F1 on ``ecg`` was 0)."""

import warnings

import numpy as np
import pytest

pytest.importorskip("aeon")

from lowrank_jax.recipes.sbt_tasks import load_anomaly_data  # noqa: E402


def test_ecg_train_is_anomaly_free_and_test_holds_the_labels():
    from aeon.datasets import load_ecg_diff_count_3

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # aeon's docstring: X_test, y_test, X_train, y_train = load_ecg_diff_count_3(...)
        x_test, y_test, x_train, y_train = load_ecg_diff_count_3("semi-supervised")
        data = load_anomaly_data("ecg")
    assert not np.asarray(y_train).any()  # semi-supervised: a clean training series
    assert data["labels"].sum() == np.asarray(y_test).sum() > 0
    np.testing.assert_array_equal(data["labels"], np.asarray(y_test).astype(bool))
    mu, sd = np.mean(x_train), np.std(x_train) + 1e-8  # z-scored with the training statistics
    np.testing.assert_allclose(data["train"][:, 0], (x_train - mu) / sd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(data["test"][:, 0], (x_test - mu) / sd, rtol=1e-5, atol=1e-5)
