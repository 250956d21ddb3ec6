"""Small graph builders shared by the solvers tests (no torch here)."""
from __future__ import annotations

import networkx as nx

from solvers import Problem


def graph(nodes: dict, edges: list[tuple], **attrs_by_node) -> nx.DiGraph:
    """``nodes``: name -> (mem, cost) or (mem, cost, extra-attrs dict); edges: (u, v)."""
    G = nx.DiGraph()
    for name, spec in nodes.items():
        mem, cost = spec[0], spec[1]
        extra = spec[2] if len(spec) > 2 else {}
        G.add_node(name, mem=mem, cost=cost, **extra)
    G.add_edges_from(edges)
    return G


def chain_problem(sizes: list[int], budget: int = 10**9, input_size: int = 1) -> Problem:
    """x -> v0 -> v1 -> ... with the given sizes, cost 1 each."""
    G = nx.DiGraph()
    G.add_node("x", mem=input_size, cost=0.0)
    prev = "x"
    for i, s in enumerate(sizes):
        G.add_node(f"v{i}", mem=s, cost=1.0)
        G.add_edge(prev, f"v{i}")
        prev = f"v{i}"
    return Problem.from_networkx(G, budget)


def budgets_between(lo: int, hi: int) -> list[int]:
    """The minimum, a point in between and the unconstrained peak."""
    return sorted({lo, lo + (hi - lo) // 3, (lo + hi) // 2, hi})
