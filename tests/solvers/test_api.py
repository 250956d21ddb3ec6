"""solve(), the registry, Infeasible, time limits, generators, and the torch-free rule."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import solvers
from solvers import (
    METHODS,
    Infeasible,
    MethodFailed,
    Problem,
    memory_lower_bound,
    solve,
    validate,
)
from solvers.core import generators as gen

from .helpers import chain_problem

ROOT = Path(__file__).resolve().parents[2]


def test_registry_has_the_contract_methods():
    for name in ("auto", "checkmate", "checkmate_cpsat", "checkmate_mip", "store_all", "recompute_all",
                 "sqrt_n", "greedy", "exhaustive", "exhaustive_fixed"):
        assert callable(METHODS[name])


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        solve(chain_problem([1, 1]), "nope")


def test_solution_fields():
    p = Problem.from_networkx(gen.training_like(30, seed=2), 0)
    peak = solve(p.with_budget(2**40), "store_all").peak
    sol = solve(p.with_budget(int(peak * 0.8)), "checkmate", time_limit=20)
    assert sol.method == "checkmate" and sol.status in ("optimal", "feasible")
    assert sol.solve_time > 0 and sol.lower_bound <= sol.cost and 0 <= sol.gap < 1
    assert sol.peak <= int(peak * 0.8)
    validate(p.with_budget(int(peak * 0.8)), sol.schedule)


def test_infeasible_below_trivial_bound():
    p = chain_problem([3, 4, 5], input_size=2)
    lower = memory_lower_bound(p)
    assert lower == 2 + 4 + 5
    with pytest.raises(Infeasible) as e:
        solve(p.with_budget(lower - 1), "store_all")
    assert e.value.min_budget == lower and e.value.memory_lower_bound == lower and e.value.budget == lower - 1


def test_views_read_together_do_not_inflate_the_trivial_bound():
    # q, k and v: views of one storage through their own chains (split -> getitem -> view),
    # read by one op. Held with their base they cost one storage, not three: the bound
    # counted three and refused every budget below it, store-all's peak included.
    G = nx.DiGraph()
    G.add_node("x", mem=2, cost=0)
    G.add_node("qkv", mem=12, cost=1)
    G.add_edge("x", "qkv")
    G.add_node("split", mem=12, cost=0, alias_of="qkv", same_storage=True)
    G.add_edge("qkv", "split")
    for name in "qkv":
        G.add_node(f"get_{name}", mem=12, cost=0, alias_of="split", same_storage=True)
        G.add_edge("split", f"get_{name}")
        G.add_node(f"view_{name}", mem=12, cost=0, alias_of=f"get_{name}", same_storage=True)
        G.add_edge(f"get_{name}", f"view_{name}")
    G.add_node("attn", mem=4, cost=1)
    G.add_edges_from((f"view_{name}", "attn") for name in "qkv")
    p = Problem.from_networkx(G, 0)
    peak = solve(p.with_budget(2**40), "store_all").peak
    assert peak == 2 + 12 + 4
    assert memory_lower_bound(p) == peak  # attn with its inputs, held through qkv
    assert solve(p.with_budget(peak)).fits


def test_over_budget_method_on_feasible_problem():
    # store_all cannot meet a budget that recomputation can: status says so, no exception.
    G = gen.training(gen.chain(3, seed=1), seed=1, param_prob=0.0)
    p = Problem.from_networkx(G, 0)
    need, _ = solvers.min_budget(p)
    peak = solve(p.with_budget(2**40), "store_all").peak
    assert need < peak
    sol = solve(p.with_budget(need), "store_all")
    assert sol.status == "over_budget" and not sol.fits
    assert solve(p.with_budget(need)).fits


@pytest.mark.slow
def test_time_limit_is_honoured():
    p = Problem.from_networkx(gen.training_like(120, seed=5), 0)
    peak = solve(p.with_budget(2**40), "store_all").peak
    q = p.with_budget(int(peak * 0.6))
    for method in ("checkmate", "checkmate_cpsat"):
        sol = solve(q, method, time_limit=3.0)
        # Generous: only a gross overrun fails (HiGHS once took 5-8x its limit on huge models).
        assert sol.solve_time < 3.0 + 60.0
        assert sol.fits == (sol.peak <= q.budget)
        if sol.lower_bound is not None:
            assert sol.lower_bound <= sol.cost + 1e-6


def test_exhaustive_refuses_large_graphs():
    p = Problem.from_networkx(gen.chain(12, seed=0), 100)
    with pytest.raises(MethodFailed):
        solve(p, "exhaustive")


def test_recompute_all_gives_up_instead_of_exploding(monkeypatch):
    import solvers.methods.recompute_all as ra

    monkeypatch.setattr(ra, "MAX_COMPUTES", 50)
    p = Problem.from_networkx(gen.training_like(60, seed=0), 2**40)
    with pytest.raises(MethodFailed):
        solve(p, "recompute_all")
    assert solve(p, "auto").fits  # auto falls back on the others


def test_empty_and_trivial_problems():
    G = nx.DiGraph()
    G.add_node("x", mem=3, cost=0.0)
    p = Problem.from_networkx(G, 3)
    for method in ("auto", "checkmate", "checkmate_cpsat", "store_all", "greedy", "sqrt_n", "recompute_all",
                   "exhaustive"):
        sol = solve(p, method)
        assert len(sol.schedule) == 0 and sol.peak == 3 and sol.cost == 0


@pytest.mark.parametrize("make", [
    lambda s: gen.chain(10, seed=s), lambda s: gen.layered(20, seed=s), lambda s: gen.unet(3, seed=s),
    lambda s: gen.transformer(2, seed=s), lambda s: gen.random_dag(8, seed=s),
    lambda s: gen.training_like(60, seed=s, base="transformer", view_prob=0.3),
])
def test_generators_are_seeded_dags(make):
    a, b, c = make(1), make(1), make(2)
    assert nx.is_directed_acyclic_graph(a)
    assert list(a.nodes(data=True)) == list(b.nodes(data=True)) and list(a.edges) == list(b.edges)
    assert list(a.nodes(data=True)) != list(c.nodes(data=True)) or list(a.edges) != list(c.edges)
    p = Problem.from_networkx(a, 0)
    assert p.names == tuple(a.nodes)  # generators insert in topological order
    for v in a.nodes:
        assert isinstance(a.nodes[v]["mem"], int) and a.nodes[v]["mem"] >= 0


def test_training_like_sizes():
    for n in (50, 100, 200, 500):
        size = Problem.from_networkx(gen.training_like(n, seed=0), 0).n
        assert 0.8 * n <= size <= 1.2 * n


def test_solvers_never_import_torch():
    code = ("import sys, solvers, solvers.core.generators, solvers.methods.checkmate, solvers.registry; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    banned = ("import " + "torch", "from " + "torch")  # spelled apart so this file passes its own check
    for path in list((ROOT / "solvers").rglob("*.py")) + list((ROOT / "tests" / "solvers").glob("*.py")):
        text = path.read_text()
        assert not any(b in text for b in banned), path


def test_a_budget_below_the_trivial_bound_raises_without_a_search_when_asked():
    """``search_minimum=False``: the bound is the answer, no minimum-budget search runs (on a
    billion-parameter graph that search took minutes); ``searched`` says which it is."""
    p = Problem.from_networkx(gen.training_like(60, seed=3), 0)
    lower = memory_lower_bound(p)
    with pytest.raises(Infeasible) as quick:
        solve(p.with_budget(lower - 1), search_minimum=False)
    assert not quick.value.searched and quick.value.min_budget == lower
    with pytest.raises(Infeasible) as searched:
        solve(p.with_budget(lower - 1))
    assert searched.value.searched and searched.value.min_budget >= lower


def test_the_greedy_stops_at_its_time_limit_and_the_search_at_its_deadline():
    import time

    from solvers.methods.greedy import solve_greedy
    from solvers.strategies.min_budget import min_budget

    p = Problem.from_networkx(gen.training_like(400, seed=5), 0)
    tight = p.with_budget(memory_lower_bound(p))
    with pytest.raises(MethodFailed, match="out of time"):
        solve_greedy(tight, 0.0)
    started = time.perf_counter()
    found, schedule = min_budget(p, deadline=started)  # out of time at once: the best start it has
    assert found >= memory_lower_bound(p)
    assert solvers.simulate(p.with_budget(found), list(schedule)).peak == found


def test_a_budget_the_solve_cannot_meet_raises_the_lowest_peak_it_reached_without_a_search_when_asked():
    """Above the trivial bound but below what any plan reaches, ``search_minimum=False`` raises after
    the solve with the lowest peak that solve reached (an achievable budget, not a searched minimum)
    and no minimum-budget search: the whole step then moves optimizer state by that shortfall."""
    p = Problem.from_networkx(gen.training_like(60, seed=3), 0)
    lower = memory_lower_bound(p)
    with pytest.raises(Infeasible) as searched:
        solve(p.with_budget(lower), time_limit=1.0)
    assert searched.value.min_budget > lower + 1  # (this graph's plans all peak above its bound)
    budget = (lower + searched.value.min_budget) // 2
    with pytest.raises(Infeasible) as quick:
        solve(p.with_budget(budget), time_limit=1.0, search_minimum=False)
    assert not quick.value.searched and quick.value.min_budget > budget and quick.value.memory_lower_bound == lower
    assert "lowest peak the solve reached" in str(quick.value)
