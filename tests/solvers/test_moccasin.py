"""Moccasin's CP-SAT model against brute force: its schedules replay and fit,
never beat the exact optimum, reach the optimum of the fixed-order space when
the model is solved, and its reported lower bound holds for every schedule."""
from __future__ import annotations

import math

import networkx as nx
import pytest

import solvers.methods.moccasin as moccasin
from solvers import METHODS, Problem, validate
from solvers.methods.baselines import best_baseline
from solvers.methods.exhaustive import solve_exhaustive_fixed
from solvers.methods.moccasin import _instances_of_hint, solve_moccasin

from .test_lower_bounds import _budgets, _small_problems

TOL = 1e-9


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    monkeypatch.setattr(moccasin, "THREADS", 1)


def _check(q: Problem, sol, opt) -> None:
    if sol.fits:
        result = validate(q, sol.schedule)
        assert math.isclose(result.cost, sol.cost) and result.peak == sol.peak
    if opt.fits:
        # The warm start fits whenever anything does on these graphs, and it is the fallback.
        assert sol.fits
        assert sol.cost >= opt.cost - TOL * max(1.0, opt.cost)
        assert sol.lower_bound is not None and sol.lower_bound <= opt.cost + TOL * max(1.0, opt.cost)
        assert sol.lower_bound >= q.total_cost() - TOL


@pytest.mark.slow
def test_fixed_order_model_reaches_the_fixed_order_optimum_without_views():
    # Without views the model's memory is exact, and with two instances per value the
    # optimum of the fixed-order space on these graphs is inside the model: compare
    # with exhaustive search over the same order of first computations.
    compared = 0
    for name, p in _small_problems(60, seed0=5000):
        if (p.alias_of >= 0).any():
            continue
        for budget in _budgets(p):
            q = p.with_budget(budget)
            sol = solve_moccasin(q, 2.0)
            opt = METHODS["exhaustive"](q, None)
            _check(q, sol, opt)
            if sol.info.get("model_status") != "OPTIMAL":
                continue
            order, _ = _instances_of_hint(q, best_baseline(q).schedule)
            fixed = solve_exhaustive_fixed(q, None, order=order)
            if max(fixed.schedule.computes().count(x) for x in set(fixed.schedule.computes())) > 2:
                continue  # needs more than two instances of some value: outside the model
            assert math.isclose(sol.cost, fixed.cost, rel_tol=1e-9, abs_tol=1e-9), (name, budget)
            compared += 1
    assert compared > 30


@pytest.mark.slow
def test_free_order_with_views_and_nonrecomputable_values():
    improved = 0
    for name, p in _small_problems(35, seed0=7000):
        for budget in _budgets(p):
            q = p.with_budget(budget)
            sol = solve_moccasin(q, 2.0, free_order=True)
            opt = METHODS["exhaustive"](q, None)
            _check(q, sol, opt)
            improved += sol.info.get("schedule_from") == "model"
    assert improved > 5


def test_view_of_a_view_is_counted_conservatively():
    # a (8) -> view v of a (8) -> b reads v; c reads a late. The model counts v's own
    # size, so its schedules never exceed what the simulator measures.
    G = nx.DiGraph()
    for name, mem, cost, extra in [("x", 1, 0.0, {}), ("a", 8, 2.0, {}), ("v", 8, 0.01, {"alias_of": "a"}),
                                   ("b", 6, 1.0, {}), ("d", 6, 1.0, {}), ("c", 1, 1.0, {})]:
        G.add_node(name, mem=mem, cost=cost, **extra)
    G.add_edges_from([("x", "a"), ("a", "v"), ("v", "b"), ("b", "d"), ("d", "c"), ("a", "c")])
    p = Problem.from_networkx(G, 0)
    for budget in range(10, 30):
        q = p.with_budget(budget)
        sol = solve_moccasin(q, 5.0, free_order=budget % 2 == 0)
        _check(q, sol, METHODS["exhaustive"](q, None))


def test_training_graph_of_a_hundred_values():
    from solvers.core import generators as gen
    from solvers.core.memory import memory_of

    p = Problem.from_networkx(gen.training_like(100, seed=3), 0)
    peak = METHODS["store_all"](p.with_budget(2**40), None).peak
    base = memory_of(p, [])
    q = p.with_budget(int(base + 0.5 * (peak - base)))
    sol = solve_moccasin(q, 2.0)
    assert sol.fits
    validate(q, sol.schedule)
    assert sol.cost <= best_baseline(q).cost + TOL
    assert q.total_cost() <= sol.lower_bound <= sol.cost
    assert sol.solve_time < 15.0
