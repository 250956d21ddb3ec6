"""Every method against exhaustive search on hundreds of tiny DAGs.

* nothing beats the exhaustive optimum (any order);
* Checkmate equals the exhaustive search over its own space (stages in the
  fixed order) with both MILP backends, and on training chains (forward
  chain, loss, backward chain) the true optimum;
* Checkmate is never below the exhaustive search restricted to the same
  order of first computations; how often the fixed order (and Checkmate's
  stage structure) loses is printed;
* `solve` raises Infeasible with the exact minimum budget.
"""
from __future__ import annotations

import functools

import pytest

import solvers
from solvers import METHODS, Infeasible, Problem, solve, validate
from solvers.core import generators as gen
from solvers.methods.exhaustive import min_peak

from .helpers import budgets_between

N_RANDOM = 200
N_CHAINS = 30
TOL = 1e-6


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(a), abs(b))


def _graph(seed: int):
    m = 2 + seed % 7  # 2..8 values to compute
    if seed % 5 == 4:
        return gen.layered(m, seed=seed, width=3, nonrecomputable_prob=0.1)
    return gen.random_dag(m, seed=seed, n_sources=1 + seed % 2, nonrecomputable_prob=0.1 if seed % 3 == 0 else 0.0)


def _record(p: Problem, budget: int, cpsat: bool) -> dict:
    q = p.with_budget(budget)
    rec = {"problem": q, "budget": budget}
    for name in ("exhaustive", "exhaustive_fixed", "exhaustive_stages", "checkmate", "store_all",
                 "recompute_all", "sqrt_n", "greedy", "auto"):
        rec[name] = METHODS[name](q, None)
    if cpsat:
        rec["checkmate_cpsat"] = METHODS["checkmate_cpsat"](q, None)
    return rec


@functools.lru_cache(maxsize=None)
def random_cases() -> list[dict]:
    out = []
    for seed in range(N_RANDOM):
        p = Problem.from_networkx(_graph(seed), 0)
        lo, _ = min_peak(p)
        hi = METHODS["store_all"](p.with_budget(2**40), None).peak
        for k, b in enumerate(budgets_between(lo, hi)):
            out.append(_record(p, b, cpsat=(seed + k) % 3 == 0) | {"seed": seed, "min_budget": lo})
    return out


@functools.lru_cache(maxsize=None)
def chain_cases() -> list[dict]:
    out = []
    for seed in range(N_CHAINS):
        # A training chain: forward chain, loss, backward chain (a unique topological order).
        G = gen.training(gen.chain(2 + seed % 3, seed=1000 + seed), seed=seed, param_prob=0.0)
        p = Problem.from_networkx(G, 0)
        lo, _ = min_peak(p)
        hi = METHODS["store_all"](p.with_budget(2**40), None).peak
        for b in budgets_between(lo, hi):
            out.append(_record(p, b, cpsat=seed % 2 == 0) | {"seed": seed, "min_budget": lo})
    return out


@pytest.mark.slow
def test_enough_cases():
    assert len(random_cases()) >= 2 * N_RANDOM
    assert len(chain_cases()) >= 2 * N_CHAINS


@pytest.mark.parametrize("cases", [random_cases, chain_cases])
def test_exhaustive_solutions_are_valid_and_fit(cases):
    for rec in cases():
        for name in ("exhaustive", "auto"):
            sol = rec[name]
            assert sol.fits, (rec["seed"], rec["budget"], name)  # every budget is >= the exact minimum
            validate(rec["problem"], sol.schedule)
        assert rec["exhaustive"].status == "optimal"


@pytest.mark.parametrize("cases", [random_cases, chain_cases])
def test_nothing_beats_exhaustive(cases):
    for rec in cases():
        best = rec["exhaustive"].cost
        for name, sol in rec.items():
            if not isinstance(sol, solvers.Solution) or not sol.fits:
                continue
            validate(rec["problem"], sol.schedule)
            assert sol.cost >= best - TOL * max(1.0, best), (rec["seed"], rec["budget"], name, sol.cost, best)
            if sol.lower_bound is not None:
                assert sol.lower_bound <= sol.cost + TOL * max(1.0, sol.cost), (rec["seed"], name)


@pytest.mark.parametrize("cases", [random_cases, chain_cases])
def test_checkmate_equals_exhaustive_over_its_space(cases):
    for rec in cases():
        ref = rec["exhaustive_stages"]
        for name in ("checkmate", "checkmate_cpsat"):
            sol = rec.get(name)
            if sol is None:
                continue
            where = (rec["seed"], rec["budget"], name)
            if ref.fits:
                assert sol.info["milp_status"] == "optimal", where
                assert sol.status == "optimal" and _close(sol.cost, ref.cost), where + (sol.cost, ref.cost)
                assert _close(sol.info["model_bound"], ref.cost), where
            else:
                assert sol.info["milp_status"] == "infeasible", where


def test_checkmate_on_chains_is_optimal():
    for rec in chain_cases():
        for name in ("checkmate", "checkmate_cpsat"):
            sol = rec.get(name)
            if sol is None:
                continue
            assert sol.fits and _close(sol.cost, rec["exhaustive"].cost), (rec["seed"], rec["budget"], name)


def test_fixed_order_never_beats_free_order_and_checkmate_never_beats_fixed():
    for rec in random_cases():
        free, fixed, stages = rec["exhaustive"], rec["exhaustive_fixed"], rec["exhaustive_stages"]
        if fixed.fits:
            assert fixed.cost >= free.cost - TOL
        if stages.fits:
            assert fixed.fits and stages.cost >= fixed.cost - TOL
        if rec["checkmate"].info["milp_status"] != "infeasible":
            assert fixed.fits and rec["checkmate"].cost >= fixed.cost - TOL


def _loss_summary(cases: list[dict], worse: str, better: str) -> str:
    n = len(cases)
    infeasible = sum(1 for r in cases if not r[worse].fits)
    costlier = [(r[worse].cost - r[better].cost) / r[better].cost for r in cases
                if r[worse].fits and r[worse].cost > r[better].cost * (1 + TOL)]
    mean = sum(costlier) / len(costlier) if costlier else 0.0
    top = max(costlier, default=0.0)
    return (f"{worse} vs {better}: {len(costlier) + infeasible}/{n} cases lose "
            f"({infeasible} cannot fit the budget, {len(costlier)} cost more: mean +{100 * mean:.1f}%, "
            f"max +{100 * top:.1f}%)")


def test_report_fixed_versus_free_order(capsys):
    cases = random_cases()
    at_min = [r for r in cases if r["budget"] == r["min_budget"]]
    lines = [
        f"fixed-order statistics over {len(cases)} (graph, budget) cases, {len(at_min)} at the exact minimum budget:",
        "  all budgets:  " + _loss_summary(cases, "exhaustive_fixed", "exhaustive"),
        "  all budgets:  " + _loss_summary(cases, "exhaustive_stages", "exhaustive_fixed"),
        "  all budgets:  " + _loss_summary(cases, "checkmate", "exhaustive"),
        "  min budget:   " + _loss_summary(at_min, "exhaustive_fixed", "exhaustive"),
    ]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert any(not r["exhaustive_fixed"].fits for r in at_min)  # the order does cost memory sometimes


@pytest.mark.slow
def test_infeasible_carries_exact_min_budget():
    for rec in random_cases()[::7] + chain_cases()[::5]:
        p, lo = rec["problem"], rec["min_budget"]
        with pytest.raises(Infeasible) as e:
            solve(p.with_budget(lo - 1))
        assert e.value.min_budget == lo
        assert e.value.memory_lower_bound <= lo
        sol = solve(p.with_budget(lo))
        assert sol.fits and sol.peak <= lo
        validate(p.with_budget(lo), sol.schedule)


@pytest.mark.slow
def test_a_minimum_reported_once_is_planned_at_by_a_new_problem_of_the_same_graph():
    """The minimum-budget search stops its repair at a time limit, so a second search may stop
    higher: a second `memplan.optimize` at the minimum an Infeasible reported (a new Problem of
    the same graph) reuses the first search, and is met."""
    from dataclasses import replace

    from solvers.strategies.min_budget import EXACT_MIN_BUDGET_NODES, min_budget_cached

    first = Problem.from_networkx(gen.training(gen.transformer(2, seed=3), seed=3), budget=1)
    assert first.n_compute > EXACT_MIN_BUDGET_NODES  # searched, not exhaustive
    with pytest.raises(Infeasible) as e:
        solve(first)
    lo = e.value.min_budget
    again = replace(first, budget=lo)  # a new Problem object: its own caches, empty
    assert again.budget_free_cache == {}
    assert min_budget_cached(again) is min_budget_cached(first)
    sol = solve(again)
    assert sol.fits and sol.peak <= lo
    validate(again, sol.schedule)
    other = replace(first, mem=first.mem + 1)  # another graph's sizes: searched anew
    assert min_budget_cached(other) is not min_budget_cached(first)
