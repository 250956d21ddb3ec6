"""The exported joint graphs of real models (``benchmarks/graphs``), read back without torch.

`benchmarks.tools.export_graphs` writes them; the solver studies read them here and set
their budgets the same way.
"""
from __future__ import annotations


from benchmarks.harness.paths import GRAPHS_DIR
from solvers import Problem
from solvers.methods.baselines import with_budget_fraction as with_fraction  # noqa: F401 - the studies' name for it


def load(name: str) -> Problem:
    """The exported graph ``name`` as a Problem; its stored budget is store-all's peak (unconstrained)."""
    return Problem.load(GRAPHS_DIR / f"{name}.json.gz")
