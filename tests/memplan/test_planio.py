"""Saved plans: round trip, reuse without solving, and every way a plan can be the wrong one."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import memplan
import solvers
from memplan.models import zoo
from memplan.planning.saved_format import graph_signature, input_signature
from memplan.pipeline.saved import SavedPlan

from .helpers import build_step, clear_grads, twin


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tight plan for the tiny GPT step (with recomputation), saved to disk."""
    module, args, kwargs = build_step("gpt")
    eager_peak = memplan.analyze(module, args, kwargs).eager_peak
    opt = memplan.optimize(module, int(eager_peak * 0.75), example_inputs=args, example_kwargs=kwargs)
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    opt.plan.save(path)
    return opt.plan, path


def test_round_trip_keeps_schedule_and_predictions(saved):
    plan, path = saved
    loaded = memplan.load_plan(path)
    assert isinstance(loaded, SavedPlan)
    assert loaded.schedule == plan.schedule
    assert loaded.budget == plan.budget and loaded.predicted_peak == plan.predicted_peak
    assert loaded.method == plan.method and loaded.status == plan.status
    assert loaded.graph_signature == graph_signature(plan.analysis.capture)
    assert loaded.input_signature == input_signature(plan.analysis.capture)
    assert json.loads(path.read_text())["format"] == "memplan.Plan"


def test_optimize_with_saved_plan_does_not_solve_and_trains_like_eager(saved, monkeypatch):
    plan, path = saved
    module, args, kwargs = build_step("gpt")
    reference = twin(module)

    real_solve = solvers.solve

    def no_solving(problem, method="auto", time_limit=None):
        # The analysis still computes its store-all baseline; nothing else may be solved.
        if method != "store_all":
            raise AssertionError(f"a saved plan must not be solved again (method {method!r})")
        return real_solve(problem, method, time_limit)

    monkeypatch.setattr(solvers, "solve", no_solving)
    opt = memplan.optimize(module, plan=path, example_inputs=args, example_kwargs=kwargs)  # budget: the saved one
    assert opt.plan.schedule == plan.schedule
    assert opt.plan.budget == plan.budget and opt.plan.predicted_peak == plan.predicted_peak
    assert any(d.decision == "recompute" for d in opt.plan.decisions)

    torch.manual_seed(0)
    opt(*args, **kwargs).backward()
    torch.manual_seed(0)
    reference(*args, **kwargs).backward()
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    clear_grads(module)


def test_plan_made_on_meta_device_is_reused_on_cpu(tmp_path):
    meta_step, meta_args, meta_kwargs = build_step("mlp", meta=True)
    assert all(p.is_meta for p in meta_step.parameters())
    opt = memplan.optimize(meta_step, "1GB", example_inputs=meta_args, example_kwargs=meta_kwargs)
    path = tmp_path / "meta.json"
    opt.plan.save(path)

    module, args, kwargs = build_step("mlp")
    reused = memplan.optimize(module, plan=path, example_inputs=args, example_kwargs=kwargs)
    assert reused.plan.schedule == opt.plan.schedule
    reused(*args, **kwargs).backward()
    assert all(p.grad is not None for p in module.parameters())


def test_other_inputs_are_rejected_with_both_shapes(saved):
    _, path = saved
    model = zoo.build("mlp").model
    opt = memplan.optimize(model, "1GB", example_inputs=(torch.randn(8, 32),))
    opt.plan.save(path.parent / "mlp.json")
    with pytest.raises(memplan.PlanMismatchError) as info:
        memplan.optimize(model, plan=path.parent / "mlp.json", example_inputs=(torch.randn(3, 32),))
    msg = str(info.value)
    assert "other inputs" in msg and "float32[8, 32]" in msg and "float32[3, 32]" in msg


def test_other_model_same_inputs_is_rejected(tmp_path):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    b = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    x = torch.randn(5, 16)
    path = tmp_path / "a.json"
    memplan.optimize(a, "1GB", example_inputs=(x,)).plan.save(path)
    with pytest.raises(memplan.PlanMismatchError) as info:
        memplan.optimize(b, plan=path, example_inputs=(x,))
    assert "different model" in str(info.value)
    # The same architecture with other weights is the same graph: the plan applies.
    a2 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    assert memplan.optimize(a2, plan=path, example_inputs=(x,)).plan.predicted_peak > 0


def test_saved_plan_over_a_smaller_budget_is_rejected(saved):
    plan, path = saved
    module, args, kwargs = build_step("gpt")
    with pytest.raises(memplan.PlanMismatchError) as info:
        memplan.optimize(module, plan.predicted_peak - 1, plan=path, example_inputs=args, example_kwargs=kwargs)
    assert "over the budget" in str(info.value)


def test_edited_schedule_fails_validation(saved, tmp_path):
    _, path = saved
    data = json.loads(path.read_text())
    # Drop the first compute step: everything downstream reads a value that is not resident.
    first = next(i for i, (op, _) in enumerate(data["schedule"]) if op == "compute")
    del data["schedule"][first]
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    module, args, kwargs = build_step("gpt")
    with pytest.raises(memplan.PlanMismatchError) as info:
        memplan.optimize(module, plan=bad, example_inputs=args, example_kwargs=kwargs)
    assert "not a valid schedule" in str(info.value)


@pytest.mark.parametrize("text", ["not json", "{}", '{"format": "memplan.Plan", "version": 99}',
                                  '{"format": "memplan.Plan", "version": 1}'])
def test_unreadable_files_say_so(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(memplan.PlanMismatchError) as info:
        memplan.load_plan(path)
    assert str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        memplan.load_plan("/nonexistent/plan.json")


def test_meta_and_cpu_builds_capture_the_same_graph():
    """A meta-device model traces as its CPU twin (loss labels held in a closure included)."""
    from memplan.capture.trace import capture

    sigs = []
    for meta in (True, False):
        module, args, kwargs = build_step("gpt", batch_size=2, meta=meta)
        cap = capture(module, args, kwargs)
        sigs.append((graph_signature(cap), input_signature(cap)))
    assert sigs[0] == sigs[1]


def test_a_plan_predicts_the_step_that_runs_even_from_a_schedule_with_late_frees(saved):
    """The runtime frees each value after its last read whatever the schedule says; a schedule
    (saved, or from any solver) that frees later than that is predicted as the runtime runs it."""
    from memplan.measure.tracker import measure_peak
    from memplan.pipeline.plan import plan_from_schedule

    plan, _ = saved
    steps = list(plan.schedule.steps)
    # Hold every value computed only once to the end of the step (recomputed ones must be freed
    # before they are computed again).
    once = {node for node in plan.schedule.computes() if plan.schedule.computes().count(node) == 1}
    late = [s for s in steps if not (s.op is solvers.Op.FREE and s.node in once)]
    late += [s for s in steps if s.op is solvers.Op.FREE and s.node in once]
    late_plan = plan_from_schedule(plan.analysis, plan.budget, solvers.Schedule(tuple(late)), method="late",
                                   status="feasible")
    assert late_plan.predicted_peak == plan.predicted_peak
    module, args, kwargs = build_step("gpt")
    opt = memplan.optimize(module, plan=plan, example_inputs=args, example_kwargs=kwargs)
    clear_grads(module)
    torch.manual_seed(0)
    assert measure_peak(lambda: opt(*args, **kwargs).backward()) == late_plan.predicted_peak
