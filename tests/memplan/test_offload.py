"""Offload end to end on CPU: plans that page activations to host memory reach
budgets recomputation alone cannot, train to eager's gradients, and the
measured device peak (host copies excluded) stays under the budget."""
from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

import memplan

from .helpers import assert_measured_peak, assert_same_step, build_step, clear_grads

MODELS = ["mlp", "cnn", "gpt", "unet"]


@functools.lru_cache(maxsize=None)
def _minimums(name: str) -> tuple[int, int]:
    """Smallest budget memplan meets without and with offload."""
    module, args, kwargs = build_step(name)
    found = []
    for offload in (False, True):
        with pytest.raises(memplan.InfeasibleBudgetError) as info:
            memplan.optimize(module, 1, example_inputs=args, example_kwargs=kwargs, offload=offload)
        found.append(info.value.min_budget)
    return found[0], found[1]


def _step(module, args, kwargs):
    torch.manual_seed(0)
    loss = module(*args, **kwargs)
    loss.backward()
    return loss.detach()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_offload_meets_budgets_recompute_cannot(name):
    remat_min, offload_min = _minimums(name)
    print(f"{name}: min budget remat {remat_min}, with offload {offload_min}")
    assert offload_min < remat_min  # issue #6: on every zoo model
    budget = offload_min  # a budget only offload can meet
    module, args, kwargs = build_step(name)
    reference = copy.deepcopy(module)
    opt = memplan.optimize(module, budget, example_inputs=args, example_kwargs=kwargs, offload=True, time_limit=4)
    plan = opt.plan
    assert plan.predicted_peak <= budget
    assert plan.transfers, "a budget below remat's minimum needs offloaded values"
    with pytest.raises(memplan.InfeasibleBudgetError):
        memplan.optimize(copy.deepcopy(module), budget, example_inputs=args, example_kwargs=kwargs,
                         offload=False, time_limit=4)

    measured = assert_measured_peak(opt, module, args, kwargs, budget)
    print(f"  budget {budget} predicted {plan.predicted_peak} measured {measured}, "
          f"{len(plan.transfers)} offloaded")

    clear_grads(module)
    assert_same_step(module, reference, _step(opt, args, kwargs), _step(reference, args, kwargs))


@pytest.mark.slow
def test_offload_is_never_predicted_slower_than_recompute():
    module, args, kwargs = build_step("gpt")
    store_all = memplan.analyze(module, args, kwargs).graph_peak
    for fraction in (0.7, 0.5):
        budget = int(store_all * fraction)
        remat = memplan.optimize(module, budget, example_inputs=args, example_kwargs=kwargs, offload=False,
                                 time_limit=4).plan
        # (the offload search has more candidates to try than the remat one: under a loaded CI's CPU, 4 s
        # left it at a remat-like plan 0.2% slower than the remat solve's, 8.4638 against 8.4468 ms)
        paged = memplan.optimize(module, budget, example_inputs=args, example_kwargs=kwargs, offload=True,
                                 time_limit=10).plan
        print(f"{fraction:.0%}: remat {remat.predicted_time * 1e3:.3f} ms, with offload "
              f"{paged.predicted_time * 1e3:.3f} ms ({len(paged.transfers)} offloaded)")
        assert paged.predicted_peak <= budget
        assert paged.predicted_time <= remat.predicted_time * (1 + 1e-9)


def test_report_and_saved_plan_carry_the_transfers(tmp_path):
    _, offload_min = _minimums("gpt")
    module, args, kwargs = build_step("gpt")
    opt = memplan.optimize(module, offload_min, example_inputs=args, example_kwargs=kwargs, offload=True,
                           time_limit=4)
    plan = opt.plan
    assert plan.transfers
    text = plan.report()
    assert "offloaded (largest first)" in text
    biggest = max(plan.transfers, key=lambda t: t.nbytes)
    assert biggest.name in text and biggest.out_after in text
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert any(step[0] == "offload" for step in json.loads(path.read_text())["schedule"])
    again = memplan.optimize(copy.deepcopy(module), plan=str(path), example_inputs=args, example_kwargs=kwargs)
    assert [t.name for t in again.plan.transfers] == [t.name for t in plan.transfers]
    assert again.plan.predicted_peak == plan.predicted_peak
