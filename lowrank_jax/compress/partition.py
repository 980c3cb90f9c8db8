"""The old name of :mod:`lowrank_jax.compress.partitioning` (the ``partition`` method's package,
renamed so that it does not clash with :func:`lowrank_jax.partition`, which splits a tree into
its trainable and frozen parts). Importing it, or any of its modules
(``lowrank_jax.compress.partition.counts``, ...), still works, with a ``DeprecationWarning``.
"""

import importlib
import sys
import warnings

from lowrank_jax.compress.partitioning import *  # noqa: F403 - the same names as before
from lowrank_jax.compress.partitioning import __all__  # noqa: F401

warnings.warn("lowrank_jax.compress.partition is now lowrank_jax.compress.partitioning",
              DeprecationWarning, stacklevel=2)

for _module in ("assign", "bounds", "counts", "factor", "hlo", "keys", "keys_method", "method"):
    sys.modules[f"{__name__}.{_module}"] = importlib.import_module(
        f"lowrank_jax.compress.partitioning.{_module}")
