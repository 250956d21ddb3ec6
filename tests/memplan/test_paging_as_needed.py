"""``parameters="auto"`` (the default with ``optimizer=``): parameters paged to host memory only
where the step does not fit otherwise, the largest first (issue #50).

What must hold: a step that fits with its parameters on the device pages nothing; one that does
not pages what it needs, trains to eager's parameters and state within the budget, as predicted;
the attempts page the largest parameters first, as many bytes as the plan was over and more at
each failure, and the plan taken is no slower than every parameter paged (the fixed rule).
"""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import memplan
from memplan.core.host import is_host
from memplan.measure.tracker import measure_peak, profiled_peak
from memplan.pipeline.errors import InfeasibleBudgetError
from memplan.core.config import TUNABLES
from memplan.pipeline.paged_plan import DEVICE_SHARE, PAGING_MARGIN, page_until_fits

from .test_paging import _adamw, _assert_trains_as_eager, _deep_mlp, _train, _whole_step_bytes


class _FrozenTable(nn.Module):
    """A large frozen projection before a small trained head: paging the projection alone is enough."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Linear(256, 256)
        self.table.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(256, 32), nn.GELU(), nn.Linear(32, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(x))


def _frozen_table():
    torch.manual_seed(0)
    model = memplan.WithLoss(_FrozenTable(), lambda out: out.square().mean())
    return model, (torch.randn(4, 256),)


def _trained_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)


def test_a_step_that_fits_with_its_parameters_on_the_device_pages_none():
    model, args, _ = _deep_mlp(depth=2)
    planned = memplan.optimize(model, 10**9, optimizer=_adamw(model), example_inputs=args, time_limit=2)
    assert planned.plan.paged_parameters == frozenset() == planned.paged_parameters
    assert not any(is_host(p) for p in model.parameters())


@pytest.mark.slow
def test_the_largest_parameter_is_paged_where_that_is_enough_and_the_step_trains_as_eager(tmp_path):
    """The parameters fit the budget, the step does not: the frozen projection is paged (the
    largest first), the step trains to eager's numbers at the predicted peak by both witnesses, and
    a second input shape pages at least what the first did (the parameter is in host memory now)."""
    model, args = _frozen_table()
    reference = copy.deepcopy(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = params * 11 // 10
    optimizer = _trained_adamw(model)
    planned = memplan.optimize(model, budget, optimizer=optimizer, example_inputs=args, solver="greedy",
                               time_limit=30)
    plan = planned.plan
    assert "model.table.weight" in plan.paged_parameters
    assert {name for name, p in model.named_parameters() if is_host(p)} == plan.paged_parameters
    assert plan.host_memory["parameters"] == sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                                                 if name in plan.paged_parameters)
    peaks = _train(planned, optimizer, args, {})
    ref_optimizer = _trained_adamw(reference)
    _train(reference, ref_optimizer, args, {})
    assert all(p <= budget for p in peaks) and peaks == [plan.predicted_peak] * len(peaks), (peaks, budget)
    _assert_trains_as_eager(model, reference, optimizer, ref_optimizer)
    resident = [t for t in (*args, *model.buffers(), *model.parameters()) if not is_host(t)]
    witnessed = profiled_peak(lambda: planned(*args).backward(), resident=resident)
    assert abs(witnessed - peaks[-1]) <= 0.01 * peaks[-1], (witnessed, peaks[-1])
    optimizer.zero_grad(set_to_none=True)
    smaller = (args[0][:2],)
    second = planned.prepare(*smaller)
    assert plan.paged_parameters <= second.paged_parameters
    assert measure_peak(lambda: planned(*smaller).backward()) == second.predicted_peak
    with pytest.raises(NotImplementedError, match="plan the step again"):
        plan.save(tmp_path / "paged.json")  # (plan= does not page)


@pytest.mark.slow
def test_a_plan_made_before_a_parameter_was_paged_is_made_again_paging_it():
    """One input shape fits with every parameter on the device, a larger one pages the frozen
    projection: the first shape's plan, which read it on the device, is dropped and made again
    paging it, so no plan reads a host parameter as if it were device memory."""
    model, args = _frozen_table()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = _trained_adamw(model)
    planned = memplan.optimize(model, params * 16 // 10, optimizer=optimizer, solver="greedy", time_limit=30)
    small, large = (args[0][:1],), (torch.randn(64, 256),)
    first = planned.prepare(*small)
    assert not first.paged_parameters
    second = planned.prepare(*large)
    assert "model.table.weight" in second.paged_parameters
    assert list(planned.plans.values()) == [second]
    again = planned.prepare(*small)
    assert second.paged_parameters <= again.paged_parameters
    assert measure_peak(lambda: planned(*small).backward()) == again.predicted_peak


@pytest.mark.slow
def test_a_deep_mlp_eight_times_over_pages_and_is_no_slower_than_every_parameter_paged():
    """At 1/8 of parameters + gradients + AdamW state the parameters alone are over the budget:
    the step pages, trains to eager's numbers at the predicted peak, and its predicted time is at
    most that of every parameter paged (``parameters="host"``, the fixed rule) at the same budget."""
    model, args, kwargs = _deep_mlp()
    reference, fixed_rule = copy.deepcopy(model), copy.deepcopy(model)
    budget = _whole_step_bytes(model) // 8
    optimizer = _adamw(model)
    planned = memplan.optimize(model, budget, optimizer=optimizer, example_inputs=args, solver="greedy",
                               time_limit=30)
    assert planned.plan.paged_parameters
    peaks = _train(planned, optimizer, args, kwargs)
    ref_optimizer = _adamw(reference)
    _train(reference, ref_optimizer, args, kwargs)
    assert all(p <= budget for p in peaks) and peaks == [planned.plan.predicted_peak] * len(peaks)
    _assert_trains_as_eager(model, reference, optimizer, ref_optimizer)
    every = memplan.optimize(fixed_rule, budget, optimizer=_adamw(fixed_rule), parameters="host",
                             example_inputs=args, solver="greedy", time_limit=30).plan
    assert planned.plan.predicted_time <= every.predicted_time * (1 + 1e-9)


# --------------------------------------------------------------------------- #
# The attempts, on a step solved by a stand-in: which parameters each pages
# --------------------------------------------------------------------------- #

BUDGET = 1000
STORE_ALL_TIME = 0.5  # (every stand-in plan is slower: each may be beaten by paging)
SIZES = [("a", 400), ("b", 300), ("c", 300), ("d", 300), ("e", 200), ("f", 100)]


def _stand_in(fits: dict[frozenset[str], float], over_by: dict[frozenset[str], int] | None = None):
    """A ``solve(names, last, seconds)`` whose plans fit where ``fits`` has the set paged (its value the
    predicted time, every state on the host), each other set over the budget by ``over_by``'s bytes
    (default 100); it records the calls."""
    calls = []

    def solve(names: frozenset[str], last: bool, seconds: float | None):
        calls.append((frozenset(names), last, seconds))
        if names in fits:
            return SimpleNamespace(names=names, predicted_time=fits[names], store_all_time=STORE_ALL_TIME,
                                   analysis=SimpleNamespace(lowered=SimpleNamespace(host_states={"a"})))
        raise InfeasibleBudgetError(BUDGET, BUDGET + (over_by or {}).get(names, 100), searched=last)

    return solve, calls


def test_the_attempts_page_the_largest_first_and_at_least_double_at_each_failure():
    every = frozenset(name for name, _ in SIZES)
    solve, calls = _stand_in({frozenset("abcde"): 2.0, every: 3.0}, over_by={frozenset(): 350})
    plan = page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve)
    assert plan.names == frozenset("abcde")
    paged = [names for names, _, _ in calls]
    # the device attempt; every one paged (the fixed rule); then 350 * PAGING_MARGIN bytes ("a" and
    # "b": 700); then at least as many again ("c", "d", "e": 800), faster than every one; in full
    assert 400 < 350 * PAGING_MARGIN <= 700
    assert paged == [frozenset(), every, frozenset("ab"), frozenset("abcde"), frozenset("abcde")]
    # the device attempt gets its share of the (unlimited) time, the paged ones are probed, the
    # chosen one is solved in full
    assert [seconds for _, _, seconds in calls] == [math.inf, 1.0, 1.0, 1.0, None]


def test_every_parameter_paged_is_tried_first_and_kept_where_fewer_paged_are_slower():
    every = frozenset(name for name, _ in SIZES)
    solve, calls = _stand_in({frozenset("a"): 2.0, every: 1.5})
    plan = page_until_fits(list(SIZES), over=50, budget=BUDGET, solve=solve)  # (no device attempt: over already)
    assert plan.names == every
    assert [names for names, _, _ in calls] == [every, frozenset("a"), every]


def test_parameters_paged_already_are_paged_from_the_first_attempt_and_no_time_left_pages_all():
    every = frozenset(name for name, _ in SIZES)
    solve, calls = _stand_in({frozenset("d"): 1.0})
    assert page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve, paged_already=frozenset("d")).names == {"d"}
    assert calls[0][:2] == (frozenset("d"), False)
    solve, calls = _stand_in({every: 1.0})
    assert page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve, time_left=lambda: 0.0).names == every
    assert [names for names, _, _ in calls] == [frozenset(), every]  # (the fixed rule, and no time for more)


def test_no_attempt_is_started_that_would_end_past_the_limit():
    """An injected clock: each solve takes 4 s of a 10 s limit. The device attempt and every parameter
    paged (a plan in hand) take 8 s; an attempt with fewer paged would end at 12 s, and is not started
    (with 2 s left, it used to be)."""
    every = frozenset(name for name, _ in SIZES)
    now = [0.0]
    stand_in, calls = _stand_in({frozenset("abcde"): 2.0, every: 3.0}, over_by={frozenset(): 350})

    def solve(names, last, seconds):
        now[0] += 4.0
        return stand_in(names, last, seconds)

    plan = page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve, time_left=lambda: 10.0 - now[0])
    assert plan.names == every and now[0] == 8.0
    assert [names for names, _, _ in calls] == [frozenset(), every]
    now[0] = 0.0  # with 13 s, the attempt with fewer paged ends within it; its refinement would not
    calls.clear()
    plan = page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve, time_left=lambda: 13.0 - now[0])
    assert [names for names, _, _ in calls] == [frozenset(), every, frozenset("ab")] and now[0] == 12.0
    # A device plan that updates on the host is set against every parameter paged in the rest of the
    # time, which is shared for it: the device attempt using its whole share does not skip it.
    now[0] = 0.0
    share_used, calls = _stand_in({frozenset(): 2.0, every: 1.0})

    def solve_using_its_share(names, last, seconds):
        now[0] += (seconds if seconds is not None else 30.0 - now[0]) + 0.2
        return share_used(names, last, seconds)

    plan = page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve_using_its_share,
                           time_left=lambda: 30.0 - now[0])
    assert plan.names == every and [names for names, _, _ in calls] == [frozenset(), every]


def test_a_device_plan_that_updates_on_the_host_is_set_against_every_parameter_paged_in_the_time_left():
    every = frozenset(name for name, _ in SIZES)
    solve, calls = _stand_in({frozenset(): 2.0, every: 1.0})
    assert page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve, time_left=lambda: 10.0).names == every
    assert calls == [(frozenset(), False, 10.0 * DEVICE_SHARE), (every, False, None)]


def test_a_device_plan_within_the_gap_of_store_all_is_not_set_against_paging():
    """No paged plan is faster than the step with nothing recomputed or moved: a device plan within
    the solver's stopping gap of that time is kept without solving the paged step (tens of seconds
    on llama-7b)."""
    solve, calls = _stand_in({frozenset(): STORE_ALL_TIME * (1 + TUNABLES.default_gap / 2), every_name(): 0.1})
    assert page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve).names == frozenset()
    assert [names for names, _, _ in calls] == [frozenset()]


def every_name() -> frozenset[str]:
    return frozenset(name for name, _ in SIZES)


def test_a_step_that_fits_nowhere_raises_the_error_of_every_parameter_paged():
    every = frozenset(name for name, _ in SIZES)
    solve, calls = _stand_in({}, over_by={every: 7})
    with pytest.raises(InfeasibleBudgetError) as raised:
        page_until_fits(list(SIZES), over=-1, budget=BUDGET, solve=solve)
    assert raised.value.min_budget == BUDGET + 7 and raised.value.searched
    assert calls[-2:] == [(every, False, 1.0), (every, True, None)]  # probed, then in full, its minimum searched
