"""`repair.add_recomputations`: bringing an over-budget schedule down by recomputation."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from solvers import Problem, Schedule, simulate, validate
from solvers.core import generators as gen
from solvers.methods.memory_bounds import store_all_peak
from solvers.methods.store_all import solve_store_all
from solvers.strategies.min_budget import min_budget
from solvers.transforms.repair import add_recomputations, recompute_down
from solvers.methods.baselines import with_budget_fraction

from .helpers import exported_graph, graph
def _store_all(G) -> tuple[Problem, Schedule]:
    p = Problem.from_networkx(G, 2**62)
    return p, solve_store_all(p, None).schedule


def _check(p: Problem, before: Schedule, after: Schedule) -> None:
    """The claims that hold for every repair: it replays (the simulator has the last word),
    the peak does not go up, and the cost grows only by computes added to the original ones."""
    r0, r = simulate(p, before), simulate(p, after)
    if r.fits:
        validate(p, after)
    assert r.peak <= r0.peak
    assert (r.computes >= r0.computes).all()  # a move recomputes or moves a compute, never drops one
    assert r.cost == pytest.approx(r0.cost + float(np.dot(r.computes - r0.computes, p.cost)))


FAMILIES = {
    "random_dag": lambda s: gen.random_dag(9, s),
    "random_dag_views": lambda s: gen.random_dag(9, s, view_prob=0.3, nonrecomputable_prob=0.1),
    "training_chain": lambda s: gen.training_like(30, s),
    "training_chain_views": lambda s: gen.training_like(30, s, view_prob=0.3),
    "training_layered": lambda s: gen.training_like(40, s, base="layered"),
    "training_unet": lambda s: gen.training(gen.unet(3, s), s),
}


AT_THE_MINIMUM = {"random_dag": 24, "random_dag_views": 27, "training_chain": 27, "training_chain_views": 27,
                  "training_layered": 17, "training_unet": 10}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_repairing_store_all_on_random_graphs(family):
    fits = {}
    for seed in range(30):
        p0, base = _store_all(FAMILIES[family](seed))
        top, lowest = store_all_peak(p0), min_budget(p0)[0]
        for f in (0.0, 0.5):
            p = p0.with_budget(int(lowest + f * (top - lowest)))
            after = add_recomputations(p, base)
            _check(p, base, after)
            fits.setdefault(f, []).append(simulate(p, after).fits)
    # Measured (30 seeds): at the smallest budget memplan finds (the lowest-peak schedule of
    # its search, recomputed down by this same repair), repairing store-all fits 24 to 27 times
    # per family, 17 on layered and 10 on U-Net training graphs, whose frontier the search
    # pushes furthest; halfway to store-all's peak every training graph fits (random DAGs: 26, 29).
    assert sum(fits[0.0]) >= AT_THE_MINIMUM[family] - 2, fits
    assert sum(fits[0.5]) >= (30 if family.startswith("training") else 24), fits


def test_a_schedule_that_fits_comes_back_unchanged():
    for seed in range(10):
        p, base = _store_all(gen.training_like(30, seed, view_prob=0.3))
        tight = p.with_budget(simulate(p, base).peak)
        assert add_recomputations(tight, base) is base


def test_a_past_deadline_returns_the_schedule_as_it_is():
    p, base = _store_all(gen.training_like(30, 0))
    p = p.with_budget(min_budget(p)[0])
    assert add_recomputations(p, base, deadline=0.0).steps == base.steps


def _skip_chain(view: bool = False) -> Problem:
    """x -> a -> b -> c -> d, and d also reads a: a waits idle across b and c. With
    ``view``, b and d also read w, a view of a, which waits with it."""
    nodes = {"x": (1, 0.0), "a": (10, 1.0)}
    edges = [("x", "a"), ("a", "b"), ("b", "c"), ("c", "d")]
    if view:
        nodes["w"] = (10, 0.0, {"alias_of": "a"})  # made right after a (store-all follows this order)
        edges += [("a", "w"), ("w", "b"), ("w", "d")]
    edges.append(("a", "d"))
    nodes.update({"b": (4, 1.0), "c": (4, 1.0), "d": (1, 1.0)})
    return Problem.from_networkx(graph(nodes, edges), 2**62)


def test_an_idle_value_is_freed_and_recomputed_before_its_next_read():
    p, base = _store_all(_skip_chain().to_networkx())
    assert simulate(p, base).peak == 1 + 10 + 4 + 4  # x, a, b, c while c is computed
    p = p.with_budget(simulate(p, base).peak - 1)
    after = add_recomputations(p, base)
    r = validate(p, after)
    assert r.recomputations == 1 and r.computes[p.index["a"]] == 2
    assert r.cost == simulate(p, base).cost + 1.0


def test_views_held_across_the_peak_go_with_their_base():
    # Freeing a alone would free nothing while w holds its storage: both go after b, and
    # w is made again from the recomputed a.
    p, base = _store_all(_skip_chain(view=True).to_networkx())
    assert p.names.index("w") == 2 and simulate(p, base).peak == 1 + 10 + 4 + 4
    p = p.with_budget(simulate(p, base).peak - 1)
    after = add_recomputations(p, base)
    r = validate(p, after)
    assert r.computes[p.index["a"]] == 2 and r.computes[p.index["w"]] == 2


def test_a_view_read_after_its_base_is_freed_is_remade_with_the_base():
    # As nn.GRU's gates and their detach(): w, a view of a, is read (by d) after a's own free
    # (after c), so it held a's storage that long. Freed across the peak (b, b2), a comes back
    # for c, and w with it: w cannot be remade at d, where a is gone again.
    nodes = {"x": (1, 0.0), "a": (10, 1.0), "w": (10, 0.0, {"alias_of": "a", "same_storage": True}),
             "b": (20, 1.0), "b2": (1, 1.0), "c": (1, 1.0), "d": (1, 1.0)}
    edges = [("x", "a"), ("a", "w"), ("x", "b"), ("b", "b2"), ("a", "c"), ("b2", "c"), ("w", "d"), ("c", "d")]
    p = Problem.from_networkx(graph(nodes, edges), 2**62)
    base = Schedule.from_list([("compute", "a"), ("compute", "w"), ("compute", "b"), ("compute", "b2"),
                               ("free", "b"), ("compute", "c"), ("free", "b2"), ("free", "a"),
                               ("compute", "d"), ("free", "w"), ("free", "c")])
    assert simulate(p, base).peak == 1 + 10 + 20 + 1  # x, a (and w), b, b2 while b2 is computed
    p = p.with_budget(25)
    after = add_recomputations(p, base)
    r = validate(p, after)
    assert r.computes[p.index["a"]] == 2 and r.computes[p.index["w"]] == 2
    steps = [(op.value, v) for op, v in after.steps]
    remade_a = steps.index(("compute", "a"), 1)
    # w is remade while a is resident: before a's next free
    assert steps.index(("compute", "w"), remade_a) < steps.index(("free", "a"), remade_a)


def test_a_value_made_early_and_read_late_is_made_later_at_no_cost():
    # s (a sink, like a gradient) reads only the input: computing it at the end instead costs nothing.
    nodes = {"x": (1, 0.0), "s": (8, 1.0), "a": (4, 1.0), "b": (4, 1.0), "c": (1, 1.0)}
    G = graph(nodes, [("x", "s"), ("x", "a"), ("a", "b"), ("b", "c")])
    p = Problem.from_networkx(G, 2**62)
    base = Schedule.from_list([("compute", "s"), ("compute", "a"), ("compute", "b"), ("free", "a"),
                               ("compute", "c"), ("free", "b")])
    p = p.with_budget(simulate(p, base).peak - 1)
    after = add_recomputations(p, base)
    r = validate(p, after)
    assert r.cost == simulate(p, base).cost and r.recomputations == 0
    assert after.steps[-1] == ("compute", "s")


def test_inputs_gone_by_the_next_read_are_recomputed_as_a_chain():
    # x -> a -> b -> c -> d -> e, e also reads b: b's input a is gone when e runs, and x is a source.
    nodes = {"x": (1, 0.0), "a": (2, 1.0), "b": (10, 1.0), "c": (6, 1.0), "d": (6, 1.0), "e": (1, 1.0)}
    G = graph(nodes, [("x", "a"), ("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("b", "e")])
    p, base = _store_all(G)
    p = p.with_budget(simulate(p, base).peak - 1)
    r = validate(p, add_recomputations(p, base))
    assert r.computes[p.index["b"]] == 2


@functools.lru_cache(maxsize=None)
def _real(name: str) -> Problem:
    pytest.importorskip("solvers.methods.rotor")  # an optional method
    return with_budget_fraction(exported_graph(name), 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt12", "unet"])
def test_rotor_at_30_percent_is_repaired_to_fit(name):
    # Measured: rotor's schedules are 0.146% (gpt12) and 17% (unet) over at 30%; repaired,
    # both fit (gpt12 at cost/total 1.275, unet 1.614, in well under a second each).
    from solvers.methods.rotor import solve_rotor

    p = _real(name)
    base = solve_rotor(p, 20).schedule
    assert not simulate(p, base).fits
    after = add_recomputations(p, base)
    _check(p, base, after)
    assert simulate(p, after).fits


@pytest.mark.slow
@pytest.mark.parametrize("family", ["training_chain", "training_chain_views", "training_unet"])
def test_recomputing_down_in_steps(family):
    """The descent holds the claims of every repair, and halfway to store-all's peak it fits
    as often as the direct repair (measured: 12 of 12 both; the descent costs no more on 5 to 8
    of 12 seeds here, and less on the real graphs where hierarchical uses it)."""
    direct_fits = descent_fits = 0
    for seed in range(12):
        p0, base = _store_all(FAMILIES[family](seed))
        top, lowest = store_all_peak(p0), min_budget(p0)[0]
        p = p0.with_budget(int(lowest + 0.5 * (top - lowest)))
        direct, descent = add_recomputations(p, base), recompute_down(p, base)
        _check(p, base, descent)
        d, s = simulate(p, direct), simulate(p, descent)
        direct_fits += d.fits
        descent_fits += s.fits
    assert descent_fits >= direct_fits - 1 and descent_fits >= 11


def _first_instance_serves_every_reader(p: Problem, schedule: Schedule, v: int) -> bool:
    """Whether ``v``'s first instance lives until each of its readers has been computed once."""
    steps = [(op.value, p.index[node]) for op, node in schedule]
    first_free = steps.index(("free", v)) if ("free", v) in steps else len(steps)
    return all(steps.index(("compute", u)) < first_free for u in p.succs[v])


def test_pinned_values_are_never_freed_and_cost_caps_the_repair():
    checked = 0
    for seed in range(4):
        p0, schedule = _store_all(gen.training(gen.unet(3, seed), seed))
        p = p0.with_budget(int(store_all_peak(p0) * 0.6))
        free = add_recomputations(p, schedule)
        # Values the repair frees across a peak; pinned, it must find other moves.
        moved = [v for v in p.non_sources if not _first_instance_serves_every_reader(p, free, v)]
        for v in moved[:3]:
            pinned = add_recomputations(p, schedule, pinned=frozenset([v]))
            _check(p, schedule, pinned)
            # Chains may still recompute v after its last read; its first instance serves them all.
            assert _first_instance_serves_every_reader(p, pinned, v)
            checked += 1
        # Capped at the cost it starts from, the repair gives up after its first move.
        capped = simulate(p, add_recomputations(p, schedule, max_cost=simulate(p, schedule).cost))
        assert not capped.fits and capped.recomputations <= simulate(p, free).recomputations
    assert checked >= 6
