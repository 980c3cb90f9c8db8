"""lowrank_jax's benchmarks, by topic: ``layers``, ``models``, ``methods``, ``machine``.

Run one from the repository root as ``python -m benchmarks.<topic> <name> [--quick] [--json
PATH]`` (``python -m benchmarks.<topic>`` lists a topic's benchmarks, ``python -m benchmarks``
all of them), and the performance goals in one go with ``python -m benchmarks.run_all``.
Every benchmark runs on the shared harness (``benchmarks/_harness.py``): one timing loop
(:mod:`lowrank_jax.timing`), outputs checked against a reference, one table format, one JSON
schema (setup, rows, goals named by what they measure). Figures and their commands:
``benchmarks/README.md``.
"""
