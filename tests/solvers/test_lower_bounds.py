"""Lower bounds against exact optima: `lower_bound` must never exceed the cost
of the best schedule of ANY order (exhaustive search), and the Checkmate LP
relaxation never the optimum of Checkmate's own space."""
from __future__ import annotations

import functools
import math
import random
import time

import networkx as nx
import pytest

from solvers import METHODS, Problem, simulate
from solvers.core import generators as gen
from solvers.methods.bound_moments import BoundContext, moments
from solvers.methods.interval_bound import interval_bound, interval_moments, main_chain
from solvers.methods.lower_bounds import INTERVAL_MOMENTS, lower_bound, lp_lower_bound
from solvers.strategies.auto import solve_auto
from solvers.strategies.min_budget import min_budget
from solvers.transforms.pin_search import pin_search
from solvers.methods.baselines import with_budget_fraction

from .helpers import exported_graph, graph
TOL = 1e-9


def _small_problems(count: int, seed0: int = 0) -> list[tuple[str, Problem]]:
    """Random graphs with at most 8 values to compute, every generator, views and
    non-recomputable values mixed in."""
    out = []
    for i in range(count):
        seed = seed0 + i
        rng = random.Random(seed)
        kind = i % 5
        n = rng.randint(3, 8)
        opts = {"view_prob": 0.4 if i % 3 == 0 else 0.0, "nonrecomputable_prob": 0.2 if i % 4 == 0 else 0.0,
                "same_storage_prob": 0.6 if i % 2 == 0 else 0.0}
        if kind == 0:
            G = gen.chain(n, seed=seed, **opts)
        elif kind == 1:
            G = gen.random_dag(n, seed=seed, n_sources=1 + i % 2, **opts)
        elif kind == 2:
            G = gen.layered(n, seed=seed, **opts)
        else:
            G = gen.training_like(rng.randint(8, 14), seed=seed, base="chain" if kind == 3 else "layered", **opts)
        p = Problem.from_networkx(G, 0)
        if p.n_compute <= 8:
            out.append((f"{kind}-{seed}", p))
    return out


def _budgets(p: Problem) -> list[int]:
    need, _ = min_budget(p)
    peak = METHODS["store_all"](p.with_budget(2**40), None).peak
    return sorted({need - 1, need, need + (peak - need) // 4, (need + peak) // 2, peak})


@pytest.mark.slow
def test_bound_never_exceeds_the_exhaustive_optimum():
    checked = tighter = 0
    for name, p in _small_problems(320):
        for budget in _budgets(p):
            q = p.with_budget(budget)
            lb = lower_bound(q)
            assert lb >= q.total_cost() - TOL, name
            opt = METHODS["exhaustive"](q, None)
            if not opt.fits:
                continue  # no schedule: any bound is vacuously valid
            assert lb <= opt.cost + TOL * max(1.0, opt.cost), (name, budget, lb, opt.cost)
            checked += 1
            tighter += lb > q.total_cost() + TOL
    assert checked > 400
    assert tighter > 20  # the bound does more than restate total_cost()


def test_forced_recomputation_is_counted_exactly():
    # x -> a -> b -> d -> e, and e also reads a. When d is first computed, b and d
    # (30 bytes with x) leave no room for a (10), so a is recomputed: optimum = total + cost[a].
    G = graph({"x": (1, 0.0), "a": (10, 3.0), "b": (10, 1.0), "d": (20, 1.0), "e": (1, 1.0)},
              [("x", "a"), ("a", "b"), ("b", "d"), ("d", "e"), ("a", "e")])
    p = Problem.from_networkx(G, 32)
    opt = METHODS["exhaustive"](p, None)
    assert opt.fits and math.isclose(opt.cost, p.total_cost() + 3.0)
    assert math.isclose(lower_bound(p), opt.cost)
    # With room for a, nothing is forced.
    assert math.isclose(lower_bound(p.with_budget(41)), p.total_cost())


def test_views_share_their_base_storage():
    # The late view t of a is not an ancestor of d, but keeping it keeps a's storage:
    # either the storage stays resident at d's compute or a is recomputed.
    G = nx.DiGraph()
    for name, mem, cost, extra in [("x", 1, 0.0, {}), ("a", 10, 2.0, {}), ("b", 10, 1.0, {}),
                                   ("d", 20, 1.0, {}), ("t", 10, 0.0, {"alias_of": "a"}), ("e", 1, 1.0, {})]:
        G.add_node(name, mem=mem, cost=cost, **extra)
    G.add_edges_from([("x", "a"), ("a", "b"), ("b", "d"), ("a", "t"), ("d", "e"), ("t", "e")])
    p = Problem.from_networkx(G, 32)
    opt = METHODS["exhaustive"](p, None)
    assert opt.fits
    lb = lower_bound(p)
    assert lb <= opt.cost + TOL
    assert math.isclose(lb, p.total_cost() + 2.0)


def test_infeasible_budget_gives_infinity():
    G = graph({"x": (5, 0.0), "a": (5, 1.0)}, [("x", "a")])
    assert lower_bound(Problem.from_networkx(G, 9)) == math.inf


@pytest.mark.slow
def test_real_graph_is_fast_and_below_the_greedy_cost():
    q = with_budget_fraction(exported_graph("unet"), 0.3)
    lb = lower_bound(q)
    sol = METHODS["greedy"](q, None)
    assert q.total_cost() < lb
    if sol.fits:
        assert lb <= sol.cost
    assert len(moments(q)) == q.n_compute


@pytest.mark.slow
def test_interval_milp_and_autos_bound_stay_below_a_pin_searched_plan_on_a_real_graph():
    # unet at 30%, briefly: the interval model as a MILP on the moments auto's bound starts from,
    # and the bound auto reports, both below the cost of auto's plan after a pin search.
    problem = with_budget_fraction(exported_graph("unet"), 0.3)
    total = problem.total_cost()
    ctx = BoundContext(problem)
    by_node = {m.node: m for m in moments(problem, ctx=ctx)}
    ws = interval_moments(main_chain(problem, ctx), by_node, INTERVAL_MOMENTS)
    milp = total + interval_bound(problem, ctx, ws, 2.0)
    sol = solve_auto(problem, 3.0)
    pinned = simulate(problem, pin_search(problem, sol.schedule, time.perf_counter() + 1.0, seed=7))
    assert pinned.fits
    low, high = max(milp, sol.lower_bound), pinned.cost
    assert total < low <= high


def test_lp_bound_is_below_the_checkmate_milp_optimum():
    # The LP relaxes Checkmate's MILP as built (memory rounded up, views counted
    # conservatively), so it is compared with the MILP's proven optimum, not with
    # exhaustive_stages (whose exact alias accounting can admit cheaper schedules).
    compared = 0
    for name, p in _small_problems(40, seed0=1000)[:25]:
        for budget in _budgets(p)[1:3]:
            q = p.with_budget(budget)
            lp = lp_lower_bound(q, 5.0)
            assert lp >= q.total_cost() - TOL
            milp = METHODS["checkmate_highs"](q, 5.0)
            if milp.status == "optimal" and milp.info.get("fallback") is None:
                assert lp <= milp.cost + 1e-6 * max(1.0, milp.cost), (name, budget, lp, milp.cost)
                compared += 1
    assert compared > 20


def test_cascade_follows_the_inputs_of_a_recomputed_value():
    # u (6) must be dropped at w's compute (x, m1 and w leave 5 bytes), and recomputing
    # u later needs q, which does not fit either: the knapsack charges only u's cost,
    # the cascade LP also charges part of q's.
    G = graph({"x": (1, 0.0), "q": (6, 5.0), "u": (6, 0.1), "m1": (15, 1.0), "w": (10, 1.0), "z": (1, 1.0)},
              [("x", "q"), ("q", "u"), ("u", "m1"), ("m1", "w"), ("w", "z"), ("u", "z")])
    p = Problem.from_networkx(G, 31)
    opt = METHODS["exhaustive"](p, None)
    assert opt.fits and math.isclose(opt.cost, p.total_cost() + 5.1)
    knapsack = lower_bound(p, cascade=False)
    cascade = lower_bound(p)
    assert math.isclose(knapsack, p.total_cost() + 0.1)
    assert knapsack + 0.5 < cascade <= opt.cost + TOL


def _small_budgets(count: int):
    """Every budget from the minimum to store-all's peak of small chains, DAGs, layered
    graphs and U-Nets (exhaustive search solves them), as (seed, problem)."""
    for i in range(count):
        rng = random.Random(i)
        opts = {"view_prob": rng.choice([0.0, 0.3, 0.6]), "nonrecomputable_prob": rng.choice([0.0, 0.0, 0.2]),
                "same_storage_prob": 0.6 if i % 3 == 0 else 0.0}
        n = rng.randint(4, 9)
        G = [lambda: gen.chain(n, seed=i, **opts),
             lambda: gen.random_dag(n, seed=i, n_sources=1, edge_prob=0.5, **opts),
             lambda: gen.layered(n, seed=i, width=2, **opts),
             lambda: gen.unet(max(1, n // 5), seed=i, **opts)][i % 4]()
        p = Problem.from_networkx(G, 0)
        if p.n_compute > 9:
            continue
        need, _ = min_budget(p)
        peak = METHODS["store_all"](p.with_budget(2**40), None).peak
        for budget in range(need, peak + 1):
            yield i, p.with_budget(budget)


@functools.lru_cache(maxsize=None)
def _bounded_budgets() -> list[tuple[int, Problem, float]]:
    """`_small_budgets(1500)` with each one's full `lower_bound`, computed once for the three
    relaxations below (the same file runs on one test worker)."""
    return [(i, q, lower_bound(q)) for i, q in _small_budgets(1500)]


@pytest.mark.slow
@pytest.mark.parametrize("relaxation, least", [("cascade", 30), ("milp", 5), ("interval", 5)])
def test_relaxation_never_exceeds_the_optimum_where_it_is_tighter(relaxation, least):
    # "cascade": the cascade LP (`_cascade_rows`) against the knapsack bounds; "milp": the best
    # moment's cascade and the interval models with 0/1 variables (every schedule is one of
    # their integer points) against the LP bounds; "interval": the interval models against all
    # the others. Wherever the relaxation raises the bound, it must stay at or below the
    # exhaustive optimum (those are the cases that exercise its rows).
    tighter = 0
    for i, q, bound in _bounded_budgets():
        if bound <= lower_bound(q, **{relaxation: False}) + TOL:
            continue
        tighter += 1
        opt = METHODS["exhaustive"](q, None)
        assert opt.fits and bound <= opt.cost + TOL * max(1.0, opt.cost), (i, q.budget, bound, opt.cost)
    assert tighter > least


@pytest.mark.slow
def test_interval_model_never_exceeds_the_optimum_on_any_chain_of_moments():
    # The interval model (`_interval_rows`) on the whole main chain, on its first and last
    # halves, and on the moments `lower_bound` would pick, as LP and MILP: each a relaxation
    # of every schedule, so at or below the exhaustive optimum wherever it charges anything.
    charged = above_others = 0
    for i, q in _small_budgets(600):
        ctx = BoundContext(q)
        chain = main_chain(q, ctx)
        by_node = {m.node: m for m in moments(q, ctx=ctx)}
        half = len(chain) // 2
        choices = [chain, chain[:half], chain[half:], interval_moments(chain, by_node, 3)]
        extras = [interval_bound(q, ctx, ws, None, integer) for ws in choices if ws for integer in (False, True)]
        best = max(extras, default=0.0)
        if best <= TOL:
            continue
        charged += 1
        opt = METHODS["exhaustive"](q, None)
        assert opt.fits and q.total_cost() + best <= opt.cost + TOL * max(1.0, opt.cost), (i, q.budget, best)
        above_others += q.total_cost() + best > lower_bound(q, interval=False) + TOL
    assert charged > 100 and above_others > 5, (charged, above_others)
