"""Coarsening round trips and the hierarchical method, checked by the simulator
(and against the exhaustive optimum on tiny graphs)."""
from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from solvers import METHODS, Problem, simulate, validate
from solvers.core.generators import layered, random_dag, training_like
from solvers.core.memory import memory_of
from solvers.core.schedule import Op, Schedule, Step
from solvers.methods.exhaustive import solve_exhaustive
from solvers.methods.memory_bounds import store_all_peak
from solvers.methods.store_all import solve_store_all
from solvers.strategies.hierarchical import (
    EARLY_GAP,
    CoverModel,
    DropPlanner,
    candidates,
    pagings,
    solve_hierarchical,
)
from solvers.strategies.hierarchical.search import _floor_stages
from solvers.strategies.hierarchical.strategy import _Incumbent
from solvers.strategies.min_budget import min_budget
from solvers.strategies.offload import solve_offload
from solvers.transforms.coarsen import coarsen
from solvers.methods.baselines import with_budget_fraction

from .helpers import exported_graph, graph
def _graphs_with_views():
    for seed in range(6):
        yield Problem.from_networkx(random_dag(14, seed=seed, view_prob=0.4, n_sources=2), 10**9)
        yield Problem.from_networkx(layered(16, seed=seed, view_prob=0.4), 10**9)
        yield Problem.from_networkx(training_like(60, seed=seed, base="transformer", view_prob=0.3), 10**9)


@pytest.mark.parametrize("k", range(18))
def test_coarse_schedules_expand_to_valid_fine_schedules(k):
    problem = list(_graphs_with_views())[k]
    c = coarsen(problem)
    assert sorted(v for ms in c.members for v in ms) == list(range(problem.n))
    cp = c.coarse
    lo = memory_of(cp, [])
    top = METHODS["store_all"](cp, None).peak
    for budget in (top, (lo + top) // 2):
        for method in ("store_all", "greedy", "recompute_all", "sqrt_n"):
            sol = METHODS[method](cp.with_budget(budget), None)
            fine = simulate(problem, c.fine_schedule_of(sol.schedule))  # raises on an invalid schedule
            # Conservative coarse memory: the fine schedule never needs more, and costs the same.
            assert fine.peak <= sol.peak
            assert fine.cost == pytest.approx(sol.cost)


def test_coarsening_shrinks_real_graphs():
    problem = exported_graph("gpt12")
    c = coarsen(problem)
    assert c.coarse.n_compute < problem.n_compute / 2
    sol = METHODS["store_all"](c.coarse, None)
    assert simulate(problem, c.fine_schedule_of(sol.schedule)).peak <= sol.peak


def _training(seed: int, n: int, base: str) -> Problem:
    return Problem.from_networkx(training_like(n, seed=seed, base=base, view_prob=0.2), 10**9)


@pytest.mark.slow
@pytest.mark.parametrize("seed,base", [(0, "chain"), (1, "layered"), (2, "transformer"), (3, "transformer")])
def test_hierarchical_fits_training_graphs(seed, base):
    problem = _training(seed, 150, base)
    lo, _ = min_budget(problem)
    hi = METHODS["store_all"](problem, None).peak
    for budget in (lo + (hi - lo) // 4, (lo + hi) // 2):
        p = problem.with_budget(budget)
        sol = solve_hierarchical(p, 2.0)
        result = validate(p, sol.schedule)  # raises when invalid or over budget
        assert sol.fits and result.cost == pytest.approx(sol.cost)
        assert sol.lower_bound is not None and sol.lower_bound <= sol.cost * (1 + 1e-9)
        assert sol.cost >= p.total_cost() * (1 - 1e-9)
        # Never worse than the baselines it starts from.
        for method in ("greedy", "select"):
            other = METHODS[method](p, None)
            if other.fits:
                assert sol.cost <= other.cost * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_hierarchical_on_unet(fraction):
    p = with_budget_fraction(exported_graph("unet"), fraction)
    sol = solve_hierarchical(p, 5.0)
    validate(p, sol.schedule)
    assert sol.fits and sol.status == "feasible"
    assert sol.info["coarse_nodes"] < p.n_compute


def test_hierarchical_against_exhaustive_optimum():
    """Tiny graphs (n_compute <= 8): the method as shipped runs the exhaustive search there, so it
    must be optimal; the drop search alone (``exact=False``) is compared with the optimum too. Its
    mean ratio is printed (run with -s); the assertion only guards against a regression."""
    shipped, alone, misses = [], [], 0
    for seed in range(12):
        G = random_dag(7, seed=seed, view_prob=0.3, n_sources=1) if seed % 2 else layered(8, seed=seed, view_prob=0.3)
        problem = Problem.from_networkx(G, 10**9)
        if problem.n_compute > 8:
            continue
        lo, _ = min_budget(problem)
        hi = METHODS["store_all"](problem, None).peak
        for budget in ((lo + hi) // 2, lo + (hi - lo) // 4):
            p = problem.with_budget(budget)
            exact = solve_exhaustive(p)
            for out, sol in ((shipped, solve_hierarchical(p, 2.0)), (alone, solve_hierarchical(p, 2.0, exact=False))):
                if out is alone and not sol.fits:
                    misses += 1  # near the minimum budget the drop search and the baselines may all fail
                    continue
                validate(p, sol.schedule)
                assert sol.cost >= exact.cost * (1 - 1e-9)  # nothing beats the optimum
                out.append(sol.cost / exact.cost)
    assert shipped and max(shipped) == pytest.approx(1.0)
    mean = sum(alone) / len(alone)
    print(f"drop search alone / optimum on {len(alone)} tiny instances: mean {mean:.4f}, max {max(alone):.4f}, "
          f"{misses} instances without a fitting plan")
    assert mean <= DROP_SEARCH_TINY_MEAN
    assert misses <= len(shipped) // 4


# Measured mean of drop search alone / optimum on the tiny instances above (see the report); a
# regression guard, not the 2% target.
DROP_SEARCH_TINY_MEAN = 1.5


def test_the_search_stops_once_a_plan_is_certified_near_optimal():
    # At 90% of store-all's peak on these graphs the first plans are within EARLY_GAP of the quick
    # bound (0.03 s, against 7-9 s for the searches that run to the limit): the search ends there,
    # reporting that bound, and what is left of the limit goes unused. The limit is 40 s so that the
    # quick bound's share (2 s; its cascade LP is skipped after half of it) is 100x the 0.01 s it
    # takes alone: at 10 s a loaded CI once skipped the cascade, and seed 0's plan (1.0048 of the
    # bound with it) stayed 1.006 of the weaker bound, uncertified.
    for seed in range(3):
        p = Problem.from_networkx(training_like(60, seed, base="transformer"), 2**62)
        p = p.with_budget(int(0.9 * store_all_peak(p)))
        sol = solve_hierarchical(p, 40.0)
        assert sol.fits and "certified_at" in sol.info, sol.info
        assert sol.cost <= (1 + EARLY_GAP) * sol.lower_bound
        assert sol.info["bound_from"] == "lower_bounds.lower_bound (quick)"
        assert not sol.info["variants"] and "pin_search" not in sol.info["clock"]  # searches skipped


# --------------------------------------------- keep / recompute / offload (host link)
def _with_link(p: Problem) -> Problem:
    """``p`` with a host link fast enough to move every byte once in a step."""
    return p.with_host(float(p.mem.sum()) / p.total_cost())


def _transformer_with_link(seed: int) -> Problem:
    return _with_link(Problem.from_networkx(training_like(80, seed=seed, base="transformer"), 10**12))


def test_covering_ilp_pages_out_below_the_remat_minimum():
    # Nothing in these graphs can be recomputed (as with values computed from state the step
    # overwrites), so no remat-only plan fits below store-all's peak. At 80% of it, the drop
    # search's covering ILP pages values out across their idle spans instead: every plan fits
    # and copies.
    # A fixed floor, not a searched one: a minimum found by a time-limited search moves with the
    # machine's load, and the 10 s search often beat it by recomputation alone.
    for seed in range(4):
        G = training_like(80, seed=seed, base="transformer")
        nx.set_node_attributes(G, False, "recomputable")
        p = _with_link(Problem.from_networkx(G, 10**12))
        p = p.with_budget(int(0.8 * store_all_peak(p)))
        assert not solve_hierarchical(p.with_host(0.0), 3.0, exact=False).fits
        sol = solve_hierarchical(p, 3.0, exact=False)
        assert sol.fits and sol.info["chosen"] == "drop_ilp" and "paging" in sol.info["variant"], sol.info
        result = validate(p, sol.schedule)  # the simulator has the last word on memory and time
        assert result.peak <= p.budget and result.transferred > 0 and sol.schedule.offloads()
        assert result.time >= result.cost


def test_pagings_respect_the_link_and_what_cannot_be_recomputed():
    p = _transformer_with_link(0)
    p = p.with_budget(store_all_peak(p) // 2)
    c = coarsen(p)
    planner = DropPlanner(c, max(1, c.coarse.n // 50))
    cands, penalties = candidates(planner, chains=False)
    pages = pagings(planner, cands, p)
    assert pages and all(cands[q.cand].group == q.group for q in pages)
    clock = np.concatenate([[0.0], np.cumsum(c.coarse.cost)])
    for q in pages:  # the device copy is gone only between the end of the copy out and the start of the copy in
        assert clock[q.first] >= q.out_span[1] - 1e-12 and clock[q.last + 1] <= q.in_span[0] + 1e-12
        assert q.out_span[1] - q.out_span[0] == pytest.approx(q.size / p.host_bandwidth)
    # A link too slow for any gap: nothing to page, and the remat-only candidates are unchanged.
    slow = p.with_host(p.host_bandwidth * 1e-6)
    slow_planner = DropPlanner(coarsen(slow), planner.gap)
    slow_cands, _ = candidates(slow_planner, chains=False)
    assert pagings(slow_planner, slow_cands, slow) == []
    remat_cands, _ = candidates(DropPlanner(coarsen(p.with_host(0.0)), planner.gap), chains=False)
    assert [cd.group for cd in remat_cands] == [cd.group for cd in cands if cd.droppable]
    # The ILP never drops a group that cannot be recomputed, and pages only groups it keeps.
    model = CoverModel(cands, penalties, c.coarse.n, c.coarse.cost, pages)
    need = {t: float(c.coarse.mem.max()) for t in range(0, c.coarse.n, 7)}
    x, y = model.solve(need, 10.0)
    for q, on in zip(pages, y):
        assert not (on and x[q.cand])
    assert not any(x[i] for i, cd in enumerate(cands) if not cd.droppable)


def test_floor_stages_are_the_peaks_no_drop_can_lower():
    # a, b, c are read again later (idle across the stages in between); g1, g2 and s are
    # gradients (sinks); p and q are each read once, by s. Keep-all at budget 45 is over at
    # p (49: a, b idle), g2 (47: a idle), q and s (47: only sinks, the values the step reads
    # and p, which is computed once and read once, so that a drop cannot release it).
    G = graph({"x": (1, 0.0), "a": (10, 1.0), "b": (10, 1.0), "c": (10, 1.0), "g1": (8, 1.0), "p": (10, 1.0),
               "g2": (8, 1.0), "q": (10, 1.0), "s": (10, 1.0)},
              [("x", "a"), ("a", "b"), ("a", "c"), ("b", "c"), ("c", "g1"), ("c", "p"), ("b", "g2"), ("a", "q"),
               ("p", "s"), ("q", "s")])
    p = Problem.from_networkx(G, 45)
    c = coarsen(p)
    planner = DropPlanner(c, 1)
    by_group = {cd.group: cd for cd in candidates(planner, False)[0]}
    keep_all = planner.evaluate(frozenset())
    stage = {p.names[ms[0]]: g for g, ms in enumerate(c.members)}
    over = {name for name, g in stage.items() if keep_all.stage_peak[g] > 45}
    assert over == {"p", "g2", "q", "s"}
    floors = _floor_stages(planner, keep_all, by_group, np.full(c.coarse.n, 45))
    assert floors == {stage["q"]: 47, stage["s"]: 47}
    # Over a limit of 47 only p's stage is left, where a and b sit idle: not a floor.
    assert _floor_stages(planner, keep_all, by_group, np.full(c.coarse.n, 47)) == {}


def test_the_incumbent_keeps_the_fastest_plan_and_the_fastest_without_copies():
    remat = Schedule((Step(Op.COMPUTE, "a"),))
    paged = Schedule((Step(Op.COMPUTE, "a"), Step(Op.OFFLOAD, "a")))
    best = _Incumbent()
    assert best.offer(remat, 2.0, "remat")
    assert best.offer(paged, 1.0, "paged")  # faster, with a copy: the best plan, not pin_search's start
    assert not best.offer(remat, 1.5, "slower remat")
    assert (best.schedule, best.time, best.label) == (paged, 1.0, "paged")
    assert best.remat == (remat, 1.5, "slower remat")


@pytest.mark.slow
def test_seeds_join_the_incumbent_and_plans_over_budget_are_ignored():
    # Plans made elsewhere (solve_offload hands over its paged descents) are what the search
    # must beat: the answer is never slower than a fitting seed, and a seed over the budget
    # (store-all here) is not taken. A 1 s search alone ends slower than these seeds on seeds 1-3
    # (146.6 against 132.6, for one).
    for seed in range(4):
        p = _transformer_with_link(seed)
        p = p.with_budget(store_all_peak(p) // 2)
        paged = solve_offload(p, 4.0, hierarchical_share=0.0)
        assert paged.fits
        seed_time = validate(p, paged.schedule).time
        over = solve_store_all(p).schedule
        sol = solve_hierarchical(p, 1.0, exact=False, seeds=[(over, "store_all"), (paged.schedule, "paged")])
        result = validate(p, sol.schedule)
        assert result.time <= seed_time * (1 + 1e-9)
        assert sol.info["chosen"] != "store_all"


def test_a_drop_search_goes_past_its_deadline_until_its_first_fit_and_no_further():
    # A run cut off before its first fitting plan has searched for nothing (the 12-layer GPT-2 at
    # 50% of its eager peak found none in the second it had of a 4 s solve). With its deadline
    # already past, the search returns nothing; given until `first_fit_by`, it returns a plan that
    # fits, and stops once it has one (long before that instant).
    import time

    from solvers.strategies.hierarchical.search import SearchLog, drop_search

    p = with_budget_fraction(Problem.from_networkx(training_like(120, seed=3, base="transformer"), 10**12), 0.4)
    c = coarsen(p)
    now = time.perf_counter()
    assert drop_search(DropPlanner(c, 2), p.budget, now, SearchLog(), chains=False) is None
    started = time.perf_counter()
    log = SearchLog()
    found = drop_search(DropPlanner(c, 2), p.budget, started, log, chains=False, first_fit_by=started + 600)
    assert found is not None and found.fits(p.budget)
    assert validate(p, found.schedule).peak <= p.budget
    # it stopped at the first fitting plan: every plan it evaluated before the last was over budget
    assert log.history and all(h["peak"] > p.budget for h in log.history[:-1]), log.history
