"""Method "select": valid schedules, sound bounds, and no worse than its own store-all start."""
from __future__ import annotations

import pytest

from solvers import Problem, solve, validate
from solvers.core import generators as gen
from solvers.methods.select import solve_select, use_clusters


def _problems():
    for seed in range(12):
        for base in ("chain", "layered", "transformer"):
            yield f"{base}-{seed}", gen.training_like(60, seed=seed, base=base, view_prob=0.2)
        yield f"unet-{seed}", gen.training(gen.unet(3, seed=seed, view_prob=0.2), seed=seed)


@pytest.mark.parametrize("fraction", [0.9, 0.7, 0.5])
def test_select_schedules_validate_and_bound_holds(fraction):
    fitted = 0
    for name, G in _problems():
        store_all = solve(Problem.from_networkx(G, 2**40), "store_all")
        p = Problem.from_networkx(G, int(store_all.peak * fraction))
        sol = solve_select(p, 10)
        assert sol.lower_bound <= sol.cost + 1e-9, name
        assert sol.cost >= store_all.cost - 1e-9, name
        if sol.fits:
            fitted += 1
            validate(p, sol.schedule)
            assert sol.peak <= p.budget
    assert fitted > 0


def test_use_clusters_split_on_gaps():
    G = gen.chain(3)
    # a value used right away and much later has two clusters
    G.add_node("late", mem=1, cost=1.0)
    G.add_edge(1, "late")
    p = Problem.from_networkx(G, 10**6)
    clusters = use_clusters(p, gap=0)
    v = p.index[1]
    assert len(clusters[v]) == 2


def test_select_prefers_cheap_recomputation():
    # "big" (cheap to recompute) and "small" (expensive) are both read early and
    # late; dropping "big" between its uses fits the budget at +1 cost.
    import networkx as nx

    G = nx.DiGraph()
    for name, mem, cost in [("x", 1, 0.0), ("big", 100, 1.0), ("small", 10, 50.0), ("mid1", 1, 1.0), ("mid2", 1, 1.0),
                            ("late1", 1, 1.0), ("late2", 1, 1.0)]:
        G.add_node(name, mem=mem, cost=cost)
    G.add_edges_from([("x", "big"), ("big", "small"), ("small", "mid1"), ("mid1", "mid2"),
                      ("small", "late1"), ("mid2", "late1"), ("big", "late2"), ("late1", "late2")])
    store_all = solve(Problem.from_networkx(G, 10**6), "store_all")
    assert store_all.peak == 113  # x + big + small + mid2 + late1
    p = Problem.from_networkx(G, 112)  # computing "small" beside "big" needs 111 whatever we do
    sol = solve_select(p, 10)
    assert sol.fits
    validate(p, sol.schedule)
    assert sol.cost == pytest.approx(store_all.cost + 1.0)  # recomputed "big" (cost 1), not "small" (cost 50)
