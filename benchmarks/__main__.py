"""``python -m benchmarks``: list every benchmark by topic, with its command."""

from __future__ import annotations

import importlib

from benchmarks._harness import TOPICS, benchmark_names, summary_line


def main() -> int:
    print(__import__("benchmarks").__doc__.strip())
    for topic in TOPICS:
        doc = (importlib.import_module(f"benchmarks.{topic}").__doc__ or "").strip()
        print(f"\n{topic} (python -m benchmarks.{topic} NAME): {' '.join(doc.split())}")
        for name in benchmark_names(topic):
            print(f"  {name:<22} {summary_line(topic, name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
