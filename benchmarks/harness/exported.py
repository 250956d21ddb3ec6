"""The exported joint graphs of real models (``benchmarks/graphs``), read back without torch.

`benchmarks.tools.export_graphs` writes them; the solver studies read them here and set
their budgets the same way.
"""
from __future__ import annotations

import gzip

from benchmarks.harness.paths import GRAPHS_DIR
from solvers import METHODS, Problem
from solvers.core.memory import memory_of


def load(name: str) -> Problem:
    """The exported graph ``name`` as a Problem; its stored budget is store-all's peak (unconstrained)."""
    with gzip.open(GRAPHS_DIR / f"{name}.json.gz", "rt") as f:
        return Problem.from_json(f.read())


def with_fraction(problem: Problem, fraction: float) -> Problem:
    """``problem`` with its budget at the sources plus ``fraction`` of store-all's activation memory."""
    peak = METHODS["store_all"](problem, None).peak
    base = memory_of(problem, [])
    return problem.with_budget(int(base + fraction * (peak - base)))
