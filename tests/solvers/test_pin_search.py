"""`solvers.transforms.pin_search`: keeping what a greedy repair recomputes, checked by the simulator on
joint graphs of U-Nets, transformers and layered networks: every result fits, none costs more
than its start, and most cost less."""
from __future__ import annotations

import pytest

from solvers import METHODS, Problem, simulate, validate
from solvers.core.generators import training, training_like, unet
from solvers.core.sequence import schedule_from_sequence
from solvers.core.uses import compute_sequence, without_unread
from solvers.methods.memory_bounds import store_all_peak
from solvers.transforms.pin_search import pin_search
from solvers.transforms.repair import recompute_down


def _problems():
    for seed in range(6):
        yield Problem.from_networkx(training(unet(3, seed=seed), seed), 10**12)
        yield Problem.from_networkx(training(unet(2, seed=seed, view_prob=0.5), seed), 10**12)
        yield Problem.from_networkx(training_like(60, seed=seed, base="transformer", view_prob=0.3), 10**12)
        yield Problem.from_networkx(training_like(40, seed=seed, base="layered"), 10**12)


def test_unread_recomputations_go_and_nothing_else():
    p = Problem.from_networkx(training(unet(2, seed=0), 0), 10**12)
    seq = compute_sequence(p, METHODS["store_all"](p, None).schedule)
    again = seq + seq[len(seq) // 2:]  # a second pass nobody reads but the sinks
    kept = without_unread(p, again)
    assert kept[:len(seq)] == seq
    result = validate(p, schedule_from_sequence(p, kept))
    # Only the sinks' last instances (and what they read) may stay recomputed.
    assert result.cost <= simulate(p, schedule_from_sequence(p, again)).cost
    assert without_unread(p, seq) == seq


@pytest.mark.slow
def test_pinned_schedules_fit_and_never_cost_more():
    checked = improved = 0
    for p0 in _problems():
        top = store_all_peak(p0)
        for fraction in (0.45, 0.6, 0.75):
            p = p0.with_budget(int(top * fraction))
            start = recompute_down(p, METHODS["store_all"](p, None).schedule)
            before = simulate(p, start)
            if not before.fits:
                continue
            after = validate(p, pin_search(p, start))  # the simulator has the last word
            assert after.cost <= before.cost * (1 + 1e-9)
            checked += 1
            improved += after.cost < before.cost * (1 - 1e-9)
    assert checked >= 30 and improved >= 25  # 38 and 36 when written


def test_a_schedule_over_the_budget_comes_back_unchanged():
    p0 = Problem.from_networkx(training(unet(3, seed=1), 1), 10**12)
    p = p0.with_budget(int(store_all_peak(p0) * 0.5))
    schedule = METHODS["store_all"](p, None).schedule
    assert not simulate(p, schedule).fits
    assert pin_search(p, schedule) is schedule


@pytest.mark.slow
def test_kicks_go_on_past_the_local_optimum_and_never_lose_it():
    checked = improved = 0
    for seed in (3, 4):
        for G in (training(unet(3, seed=seed), seed), training(unet(4, seed=seed), seed),
                  training_like(80, seed=seed, base="layered")):
            p0 = Problem.from_networkx(G, 10**12)
            p = p0.with_budget(int(store_all_peak(p0) * 0.6))
            start = recompute_down(p, METHODS["store_all"](p, None).schedule)
            if not simulate(p, start).fits:
                continue
            local = simulate(p, pin_search(p, start))
            kicked = validate(p, pin_search(p, start, kicks=4))
            assert kicked.cost <= local.cost * (1 + 1e-9)
            checked += 1
            improved += kicked.cost < local.cost * (1 - 1e-9)
    assert checked >= 5 and improved >= 2  # 6 and 3 when written


def test_patience_stops_the_search_only_while_it_finds_nothing():
    p0 = Problem.from_networkx(training(unet(3, seed=3), 3), 10**12)
    p = p0.with_budget(int(store_all_peak(p0) * 0.6))
    start = recompute_down(p, METHODS["store_all"](p, None).schedule)
    before = simulate(p, start)
    assert before.fits
    assert pin_search(p, start, patience=0.0) is start  # no time at all without a faster plan
    # Every improvement restarts the wait: with an hour of patience the search runs to its end,
    # the same local optimum as without a clock (first improvement, same order: deterministic).
    patient = validate(p, pin_search(p, start, kicks=0, patience=3600.0))
    assert patient.cost == simulate(p, pin_search(p, start, kicks=0)).cost < before.cost
