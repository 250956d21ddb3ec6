"""Small graph builders shared by the solvers tests, and the exported real-model graphs (no torch here)."""
from __future__ import annotations

from pathlib import Path

import networkx as nx

from solvers import Problem

# Joint graphs of real models, exported once as Problem JSON (`python -m benchmarks.tools.export_graphs`).
EXPORTED_GRAPHS = Path(__file__).resolve().parents[2] / "benchmarks" / "graphs"


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


def skip_chain(budget: int) -> Problem:
    """x -> a (big, computed once) -> b1 .. b4 (slow) -> s (slow, small) -> c reads s and a.

    Remat-only must hold a through the whole chain (it cannot be recomputed):
    peak 1 + 8 + 3 + 3 = 15. Paging a out while b2..b4 run needs only 13
    (b4, s and the prefetched a). Copies take 1 time unit, the chain's
    computes 10 each, so they hide."""
    G = nx.DiGraph()
    G.add_node("x", mem=1, cost=0.0)
    G.add_node("a", mem=8, cost=1.0, recomputable=False)
    G.add_edge("x", "a")
    prev = "a"
    for i in range(1, 5):
        G.add_node(f"b{i}", mem=3, cost=10.0)
        G.add_edge(prev, f"b{i}")
        prev = f"b{i}"
    G.add_node("s", mem=1, cost=10.0)
    G.add_edge(prev, "s")
    G.add_node("c", mem=1, cost=1.0)
    G.add_edges_from([("s", "c"), ("a", "c")])
    return Problem.from_networkx(G, budget, host_bandwidth=8.0)


def exported_graph(name: str) -> Problem:
    """The exported graph ``name`` (gpt12, gpt48, resnet50, unet); its budget is unconstrained."""
    return Problem.load(EXPORTED_GRAPHS / f"{name}.json.gz")
