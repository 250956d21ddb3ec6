"""Every method on many random graphs of every generator: the schedule replays,
fits whenever the status says so, and the lower bound never exceeds the cost."""
from __future__ import annotations

import functools
import math

import pytest

from solvers import METHODS, Problem, ScheduleError, Solution, simulate, validate
from solvers.core import generators as gen

CONSTRUCTIVE = ("store_all", "recompute_all", "sqrt_n", "greedy")
FRACTIONS = (1.0, 0.75, 0.55, 0.4)


def _graphs(count: int, max_nodes: int, seed0: int) -> list[tuple[str, object]]:
    out = []
    for i in range(count):
        seed = seed0 + i
        kind = i % 7
        n = 4 + (seed * 7919) % max(1, max_nodes - 4)
        opts = {"view_prob": 0.3 if i % 4 == 0 else 0.0, "nonrecomputable_prob": 0.1 if i % 5 == 0 else 0.0,
                "same_storage_prob": 0.6 if i % 8 == 0 else 0.0}
        if kind == 0:
            G = gen.chain(n, seed=seed, **opts)
        elif kind == 1:
            G = gen.layered(n, seed=seed, **opts)
        elif kind == 2:
            G = gen.unet(max(1, n // 6), seed=seed, **opts)
        elif kind == 3:
            G = gen.transformer(max(1, n // 12), seed=seed, **opts)
        elif kind == 4:
            G = gen.random_dag(n, seed=seed, n_sources=1 + i % 3, **opts)
        elif kind == 5:
            G = gen.training_like(n, seed=seed, base="chain", **opts)
        else:
            G = gen.training_like(max(12, n), seed=seed, base="layered" if i % 2 else "transformer", **opts)
        out.append((f"{['chain', 'layered', 'unet', 'transformer', 'random', 'train-chain', 'train-mix'][kind]}-{seed}", G))
    return out


def check_solution(p: Problem, sol: Solution, where) -> None:
    if sol.status == "over_budget":
        result = simulate(p, sol.schedule)  # raises on any broken rule except the budget
        assert result.peak > p.budget and result.over_budget_step is not None, where
    else:
        assert sol.status in ("optimal", "feasible"), where
        result = validate(p, sol.schedule)
    assert result.peak == sol.peak and math.isclose(result.cost, sol.cost, rel_tol=1e-12, abs_tol=1e-12), where
    if sol.lower_bound is not None:
        assert sol.lower_bound <= sol.cost + 1e-6 * max(1.0, sol.cost), where
        assert sol.lower_bound >= p.total_cost() - 1e-6 * max(1.0, p.total_cost()) or sol.method.startswith(
            "exhaustive"), where


@functools.lru_cache(maxsize=None)
def _problems(count: int, max_nodes: int, seed0: int) -> list[tuple[str, Problem, int]]:
    out = []
    for name, G in _graphs(count, max_nodes, seed0):
        p = Problem.from_networkx(G, 0)
        peak = METHODS["store_all"](p.with_budget(2**40), None).peak
        out.append((name, p, peak))
    return out


N_GRAPHS = 600


def test_over_budget_schedules_fail_validation():
    for name, p, peak in _problems(N_GRAPHS, 60, 0)[:100]:
        q = p.with_budget(int(peak * 0.4))
        sol = METHODS["store_all"](q, None)
        if not sol.fits:
            with pytest.raises(ScheduleError, match="exceeds the budget"):
                validate(q, sol.schedule)


@pytest.mark.slow
def test_constructive_methods_on_hundreds_of_graphs():
    solved = 0
    for name, p, peak in _problems(N_GRAPHS, 60, 0):
        for frac in FRACTIONS:
            q = p.with_budget(int(peak * frac))
            for method in CONSTRUCTIVE:
                sol = METHODS[method](q, None)
                check_solution(q, sol, (name, frac, method))
                solved += 1
        # store_all at its own peak is optimal by definition.
        assert METHODS["store_all"](p.with_budget(peak), None).status == "optimal"
    assert solved == N_GRAPHS * len(FRACTIONS) * len(CONSTRUCTIVE)


def test_greedy_fits_when_there_is_room():
    # With the whole store_all peak available, the greedy never evicts and costs the minimum.
    for name, p, peak in _problems(N_GRAPHS, 60, 0)[:300]:
        sol = METHODS["greedy"](p.with_budget(peak), None)
        assert sol.fits and sol.status == "optimal" and sol.info["evictions"] == 0, name


@pytest.mark.slow
def test_checkmate_backends_on_random_graphs():
    from solvers import min_budget

    for i, (name, p, peak) in enumerate(_problems(30, 14, 50_000)):
        need, _ = min_budget(p)
        for budget in (need, (need + peak) // 2):
            q = p.with_budget(budget)
            backend = ("checkmate", "checkmate_cpsat", "checkmate_scip")[i % 3]
            sol = METHODS[backend](q, 1.0)
            check_solution(q, sol, (name, budget, backend))
            if sol.info.get("fallback") is None:
                assert sol.fits, (name, budget, backend)


@pytest.mark.slow
def test_auto_always_fits_above_the_minimum():
    from solvers import Infeasible, min_budget, solve

    for name, p, peak in _problems(16, 30, 90_000):
        need, schedule = min_budget(p)
        validate(p.with_budget(need), schedule)
        for budget in (need, (need + peak) // 2):
            sol = solve(p.with_budget(budget), "auto", time_limit=1.0)
            check_solution(p.with_budget(budget), sol, (name, budget))
            assert sol.fits and sol.method == "auto", (name, budget)
        if need > 0:
            with pytest.raises(Infeasible) as e:
                solve(p.with_budget(need - 1), "greedy")
            assert e.value.min_budget == need


def test_every_registered_method_is_valid_and_no_better_than_the_optimum():
    """Each method in the registry, on small random graphs at the exact minimum budget and
    half-way to store-all: a valid schedule (or ``over_budget`` / MethodFailed, never a
    broken one), never cheaper than the exhaustive optimum, with a bound never above it."""
    from solvers import MethodFailed, min_budget

    tol = 1e-6
    checked = {name: 0 for name in METHODS}
    for name, p, peak in _problems(12, 9, 7_000):
        if p.n_compute > 10:
            continue  # beyond the exhaustive search
        need, _ = min_budget(p)
        for budget in (need, (need + peak) // 2):
            q = p.with_budget(budget)
            optimum = METHODS["exhaustive"](q, None)
            assert optimum.fits and optimum.status == "optimal", name
            for method, solve in METHODS.items():
                try:
                    sol = solve(q, 0.5)
                except MethodFailed:
                    continue
                check_solution(q, sol, (name, budget, method))
                checked[method] += 1
                if sol.fits:
                    assert sol.cost >= optimum.cost * (1 - tol), (name, budget, method)
                if sol.lower_bound is not None:
                    assert sol.lower_bound <= optimum.cost * (1 + tol), (name, budget, method)
    assert all(count > 0 for count in checked.values()), checked
