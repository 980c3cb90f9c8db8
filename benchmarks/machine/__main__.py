"""``python -m benchmarks.machine NAME [options]``: run one benchmark of this topic."""

from benchmarks._harness import topic_main

if __name__ == "__main__":
    raise SystemExit(topic_main("machine"))
