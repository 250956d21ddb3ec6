"""rotor and revolve: schedules replay in the simulator and fit whenever the status
says so; rotor matches the exhaustive optimum on small chains; revolve's
recomputation count is Griewank's binomial formula on homogeneous chains."""
from __future__ import annotations

import functools
import math

import pytest

from solvers import (
    METHODS,
    MethodFailed,
    Problem,
    Solution,
    min_budget,
    simulate,
    validate,
)
from solvers.core import generators as gen
from solvers.core.memory import memory_of
from solvers.methods.chain import extract_chain
from solvers.methods.revolve import binomial_table, griewank_advances, solve_revolve
from solvers.methods.rotor import solve_rotor

from .helpers import exported_graph, graph


def check(p: Problem, sol: Solution, where) -> None:
    """The schedule replays, its numbers are the simulator's, it fits unless over_budget,
    and the bound is below the cost."""
    result = simulate(p, sol.schedule)
    if sol.status == "over_budget":
        assert result.peak > p.budget, where
    else:
        assert sol.status in ("optimal", "feasible"), where
        validate(p, sol.schedule)
    assert result.peak == sol.peak and math.isclose(result.cost, sol.cost, rel_tol=1e-12), where
    assert sol.lower_bound is not None and sol.lower_bound <= sol.cost + 1e-9 * max(1.0, sol.cost), where


def store_all_peak(p: Problem) -> int:
    return METHODS["store_all"](p.with_budget(2**62), None).peak


def activation_budget(p: Problem, fraction: float) -> int:
    """``fraction`` of store-all's memory above the sources."""
    base = memory_of(p, [])
    return int(base + fraction * (store_all_peak(p) - base))


def small_chains() -> list[tuple[str, Problem]]:
    out = []
    for n in (2, 3):
        for param_prob in (0.0, 0.5, 1.0):
            for seed in range(6):
                p = Problem.from_networkx(gen.training(gen.chain(n, seed=seed), seed=seed, param_prob=param_prob), 0)
                if p.n_compute <= 8:
                    out.append((f"chain{n}-p{param_prob}-s{seed}", p))
    return out


def test_rotor_matches_exhaustive_on_small_chains():
    fitted = total = 0
    for name, p in small_chains():
        need, _ = min_budget(p)
        peak = store_all_peak(p)
        for budget in sorted({need, need + (peak - need) // 4, (need + peak) // 2, peak}):
            q = p.with_budget(budget)
            exact = METHODS["exhaustive"](q, 10)
            assert exact.status == "optimal"
            sol = solve_rotor(q, 5)
            check(q, sol, (name, budget))
            # The program's cost model is exact when nothing is pinned: it is the simulated cost.
            assert math.isclose(sol.info["dp_value"], sol.cost, rel_tol=1e-9), (name, budget)
            total += 1
            if sol.fits:
                fitted += 1
                # Measured: whenever rotor fits it finds the exhaustive optimum (78 of 78 cases).
                assert math.isclose(sol.cost, exact.cost, rel_tol=1e-9), (name, budget, sol.cost, exact.cost)
            if budget == peak:
                assert sol.fits and sol.status == "optimal", (name, budget)
    # Rotor's space is the stage-wise schedules: at the minimum budget the exhaustive search
    # sometimes fits by interleaving stages, rotor does not (9 of 87 cases, all at or next to it).
    assert fitted >= 0.85 * total, (fitted, total)


@functools.lru_cache(maxsize=None)
def chain_problems() -> list[tuple[str, Problem]]:
    out = []
    for i, n in enumerate((40, 90, 160)):
        for opts in ({}, {"view_prob": 0.3}, {"nonrecomputable_prob": 0.1}):
            G = gen.training_like(n, seed=10 + i, base="chain", **opts)
            out.append((f"train-chain{n}-{sorted(opts)}", Problem.from_networkx(G, 0)))
    for n in (8, 20):
        out.append((f"training(chain{n})", Problem.from_networkx(gen.training(gen.chain(n, seed=n), seed=n), 0)))
    return out


@functools.lru_cache(maxsize=None)
def chain_solutions() -> list[tuple[str, float, Problem, Solution, Solution]]:
    out = []
    for name, p in chain_problems():
        for fraction in (1.0, 0.7, 0.5, 0.3):
            q = p.with_budget(activation_budget(p, fraction))
            out.append((name, fraction, q, solve_rotor(q, 5), solve_revolve(q, 5)))
    return out


@pytest.mark.slow
def test_training_chains_replay_and_fit():
    fits = {"rotor": 0, "revolve": 0}
    for name, fraction, q, rotor, revolve in chain_solutions():
        for sol in (rotor, revolve):
            check(q, sol, (name, fraction, sol.method))
            fits[sol.method] += sol.fits
        assert rotor.fits or fraction < 0.7, (name, fraction)
        assert revolve.fits or fraction < 1.0, (name, fraction)
    # Measured: 32 of 44 each; at 0.5 and 0.3 the small graphs are below what any
    # method reaches (Checkmate's MILP does not fit them either).
    assert min(fits.values()) >= 30, fits


def test_rotor_is_no_worse_than_revolve_on_chains():
    for name, fraction, q, rotor, revolve in chain_solutions():
        if rotor.fits and revolve.fits:
            assert rotor.cost <= revolve.cost + 1e-9 * revolve.cost, (name, fraction, rotor.cost, revolve.cost)


def test_binomial_table_is_griewanks_formula():
    T, _ = binomial_table(30)
    for length in range(1, 31):
        for c in range(1, 31):
            assert T[length, c] == griewank_advances(length, c), (length, c)
    # Known values: one snapshot reverses l steps with l(l-1)/2 advances.
    assert griewank_advances(10, 1) == 45 and griewank_advances(4, 2) == 4


@pytest.mark.parametrize("n,c", [(6, 1), (10, 2), (10, 3), (16, 3), (20, 4), (30, 5)])
def test_revolve_recomputations_on_a_homogeneous_chain(n, c):
    # A chain of equal steps mirrored into a training graph without parameters:
    # stages are v1..vn and the loss, each backward step reads one activation.
    G = gen.training(gen.chain(n, seed=n, mem_range=(4, 4), cost_range=(1.0, 1.0)), seed=n, param_prob=0.0)
    p = Problem.from_networkx(G, 10**9)
    sol = solve_revolve(p, None, snapshots=c)
    steps = sol.info["stages"]
    assert steps == n + 1
    result = validate(p, sol.schedule)
    # Every extra forward computation is one of revolve's advances.
    assert result.recomputations == griewank_advances(steps, c) == sol.info["advances"]


def test_revolve_uses_more_snapshots_with_more_memory():
    G = gen.training(gen.chain(24, seed=3, mem_range=(4, 4), cost_range=(1.0, 1.0)), seed=3, param_prob=0.0)
    p = Problem.from_networkx(G, 10**9)
    peaks = [solve_revolve(p, None, snapshots=c).peak for c in (1, 2, 4, 8, 24)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_no_chain_structure_fails():
    # Nothing after the forward part: no backward.
    p = Problem.from_networkx(gen.chain(1, seed=0), 10**9)
    with pytest.raises(MethodFailed):
        solve_rotor(p, 1)
    # Every backward step reads every activation: no cut survives.
    nodes = {"x": (1, 0.0), "loss": (1, 1.0)}
    edges = [("x", "v1"), ("v4", "loss")]
    for i in range(1, 5):
        nodes[f"v{i}"] = (10, 1.0)
        nodes[f"g{i}"] = (10, 2.0)
        if i > 1:
            edges.append((f"v{i - 1}", f"v{i}"))
        edges += [(f"v{j}", f"g{i}") for j in range(1, 5)]
        edges.append((f"g{i + 1}" if i < 4 else "loss", f"g{i}"))
    p = Problem.from_networkx(graph(nodes, edges), 10**9)
    with pytest.raises(MethodFailed, match="reads across every cut"):
        solve_rotor(p, 1)
    with pytest.raises(MethodFailed):
        solve_revolve(p, 1)


def test_chain_extraction_on_a_training_chain():
    G = gen.training(gen.chain(12, seed=1), seed=1, param_prob=0.5)
    p = Problem.from_networkx(G, 0)
    chain = extract_chain(p)
    # One stage per forward step plus the loss; every value is in exactly one stage.
    assert chain.length == 13
    seen = [v for st in chain.stages for v in st.forward + st.backward]
    assert sorted(seen) == sorted(p.non_sources)
    assert all(st.output != -1 for st in chain.stages)


@functools.lru_cache(maxsize=None)
def real(name: str) -> Problem:
    return exported_graph(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt12", "unet"])
def test_real_graphs(name):
    p = real(name)
    for fraction in (0.7, 0.5, 0.3):
        q = p.with_budget(activation_budget(p, fraction))
        for method in (solve_rotor, solve_revolve):
            sol = method(q, 10)
            check(q, sol, (name, fraction, method.__name__))
            # Measured: both fit gpt12 at 70% and 50%; rotor fits the U-Net there only with
            # its skip connections pinned (the second chain it tries).
            if fraction >= 0.5 and (name == "gpt12" or method is solve_rotor):
                assert sol.fits, (fraction, method.__name__)
            if name == "unet" and method is solve_rotor and fraction >= 0.5:
                assert sol.info.get("pin_skips"), sol.info


def test_any_dag_gives_a_schedule_or_method_failed():
    # Graphs of every generator, chain-like or not: either MethodFailed or a schedule that replays.
    from .test_methods import _graphs

    outcomes = {"failed": 0, "fits": 0, "over_budget": 0}
    for name, G in _graphs(70, 50, 0):
        p = Problem.from_networkx(G, 0)
        for fraction in (1.0, 0.6):
            q = p.with_budget(int(store_all_peak(p) * fraction))
            for method in (solve_rotor, solve_revolve):
                try:
                    sol = method(q, 1)
                except MethodFailed:
                    outcomes["failed"] += 1
                    continue
                check(q, sol, (name, fraction, method.__name__))
                outcomes["fits" if sol.fits else "over_budget"] += 1
    assert outcomes["fits"] > outcomes["failed"], outcomes
