"""The paper's Table 5 counting rules reproduce every entry of its Table 6 ("Sparse Binary
Transformers for Multivariate Time Series Modeling", arXiv:2308.04637), with the documented
exceptions; exact integers checked by hand from the rules."""

import dataclasses

import pytest

from lowrank_jax.analysis import sbt_accounting as A
from lowrank_jax.errors import ConfigError

# Integers worked out by hand from the rules (see the module docstring), e.g. JapaneseVowels
# dense FLOPs = (12*32 + 32*9 + 2*(32*32 + 2*32*256)) + 2*3*32*32*29
#             + 2*(29*32 + 2*(2*29*29*16 + 29*29)) = 326,532.
EXACT = {
    "JapaneseVowels": {"dense_flops": 326_532, "sbt_flops": 156_148, "dense_bits": 2_416_928,
                       "sbt_bits": 45_728},
    "SMD": {"dense_flops": 19_513_552, "sbt_flops": 1_863_484},
    "MSL": {"dense_bits": 7_158_944, "sbt_bits": 221_540},
    "InsectWingbeat": {"dense_flops": 5_420_640, "sbt_flops": 2_673_120},
    "ECL": {"dense_flops": 204_758_100, "sbt_flops": 74_543_450},
}

# Printed entries that the stated dimensions do not give (index into the Table 6 tuple).
EXCEPTIONS = {
    ("ArabicDigits", 2), ("ArabicDigits", 3), ("ArabicDigits", 5),  # FLOPs fit w = 65
    ("FaceDetection", 3),  # printed 281.3K, positions give 280.8K
    ("JapaneseVowels", 4),  # 45,728 bits printed as 0.04M (truncated)
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_integers(name):
    got = A.paper_counts(A.TABLE6_CONFIGS[name])
    for key, val in EXACT[name].items():
        assert got[key] == val, (name, key)


@pytest.mark.parametrize("name", sorted(A.TABLE6))
def test_table6_as_printed(name):
    row = A.table6_row(name)
    for i, (ours, printed) in enumerate(zip(row["computed"], row["printed"], strict=True)):
        digits = 2 if printed == 0.04 else 1
        if (name, i) in EXCEPTIONS:
            assert round(ours, digits) != printed
            assert row["note"] or name == "JapaneseVowels"
        else:
            assert round(ours, digits) == printed, (name, i, ours, printed)


def test_arabic_flops_fit_w65_and_jv_bits_truncated():
    c = dataclasses.replace(A.TABLE6_CONFIGS["ArabicDigits"], w=A.ARABIC_FLOPS_WINDOW)
    got = A.paper_counts(c)
    assert round(got["dense_flops"] / 1e6, 1) == 2.8 and round(got["sbt_flops"] / 1e6, 1) == 1.3
    assert int(A.paper_counts(A.TABLE6_CONFIGS["JapaneseVowels"])["sbt_bits"] / 1e4) / 100 == 0.04


def test_rules_respond_to_settings():
    jv = A.TABLE6_CONFIGS["JapaneseVowels"]
    # Q/K/V masks with k = 1 cost more than nothing pruned? No: attention term grows with k.
    lo, hi = (A.paper_counts(dataclasses.replace(jv, keep=k))["sbt_flops"] for k in (0.25, 0.5))
    assert lo < hi
    # ECL's printed SBT FLOPs need k = 0.5: at its stated k = 0.25 they are lower.
    ecl = dataclasses.replace(A.TABLE6_CONFIGS["ECL"], flops_keep=None)
    assert A.paper_counts(ecl)["sbt_flops"] < 74_543_450
    with pytest.raises(ConfigError):
        A.PaperConfig("x", "regression", 1, 2, 4, 0.5, 1)
    with pytest.raises(ConfigError):
        A.table6_row("Nope")
