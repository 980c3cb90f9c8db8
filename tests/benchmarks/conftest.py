"""The benchmarks are a package at the repository's root (``benchmarks``), not part of the
installed library: make the root importable when pytest was started without it on the path."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)
