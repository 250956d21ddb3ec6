"""Where the benchmarks' files live: the results they write, the exported graphs, the project README."""
from __future__ import annotations

from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = BENCHMARKS_DIR / "results"
GRAPHS_DIR = BENCHMARKS_DIR / "graphs"
README = BENCHMARKS_DIR.parent / "README.md"
