"""Kernel scratch: memory an op's kernel allocates for itself, below the dispatcher, planned for.

oneDNN's CPU convolutions reorder their inputs into scratch buffers (as cuDNN takes workspaces
from the CUDA allocator); a dispatch-mode tracker does not see them, the allocator does
(`memplan.measure.tracker.profiled_peak` here). With ``kernel_scratch=True`` each such op's scratch is
measured once per signature and is a value of the Problem that the op reads, so a plan makes
room for it: the allocator-measured peak then holds the budget.
"""
from __future__ import annotations

import pytest

import torch
import torch.nn.functional as F

import memplan
from memplan.capture.trace import capture
from memplan.costs.cost_model import annotate
from memplan.measure.tracker import profiled_peak
from memplan.models import zoo
from memplan.planning.lowering import SCRATCH_PREFIX, lower
from memplan.measure.timing import measure_op_scratch


def _cnn():
    built = zoo.build("cnn", size="tiny")
    return memplan.WithLoss(built.model, built.loss_fn), tuple(built.example_inputs)


def test_convolutions_have_scratch_and_measuring_it_leaves_the_random_state_alone():
    step, args = _cnn()
    cap = capture(step, args)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    scratch = measure_op_scratch(cap.graph_module, "cpu")  # cnn tiny has dropout: it draws
    assert torch.equal(torch.rand(4), expected)
    convs = [n.name for n in cap.graph_module.graph.nodes if n.op == "call_function"
             and str(n.target) in ("aten.convolution.default", "aten.convolution_backward.default")]
    assert convs and all(scratch.get(name, 0) > 0 for name in convs)
    # Each scratch is a value only its op reads, held while that op runs.
    low = lower(cap, annotate(cap.graph_module, None, None, scratch))
    for name, nbytes in scratch.items():
        node = SCRATCH_PREFIX + name
        assert low.graph.nodes[node]["mem"] == nbytes and list(low.graph.successors(node)) == [name]


@pytest.mark.slow
def test_a_plan_with_kernel_scratch_holds_its_budget_by_the_allocators_count():
    step, args = _cnn()
    reference = torch.nn.utils.parameters_to_vector(step.parameters()).detach().clone()
    torch.manual_seed(0)
    step(*args).backward()
    eager_grads = [p.grad.clone() for p in step.parameters()]
    for p in step.parameters():
        p.grad = None

    opt = memplan.optimize(step, "85%", kernel_scratch=True, time_limit=3)
    torch.manual_seed(0)
    opt(*args).backward()  # plans, then runs
    for p in step.parameters():
        p.grad = None
    plan = opt.plan
    assert any(str(v).startswith(SCRATCH_PREFIX) for v in plan.analysis.lowered.graph.nodes)

    def run() -> None:
        torch.manual_seed(0)
        opt(*args).backward()

    resident = [*step.parameters(), *step.buffers(), *args]
    measured = profiled_peak(run, resident=resident)
    assert measured <= plan.budget
    assert abs(measured - plan.predicted_peak) <= 0.01 * plan.predicted_peak
    for p, want in zip(step.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, want)
    assert torch.equal(torch.nn.utils.parameters_to_vector(step.parameters()), reference)


@pytest.mark.slow
def test_a_saved_plan_with_scratch_is_measured_again_when_loaded(tmp_path):
    step, args = _cnn()
    opt = memplan.optimize(step, "85%", kernel_scratch=True, time_limit=3, example_inputs=args)
    path = tmp_path / "plan.json"
    opt.plan.save(path)
    again = memplan.optimize(step, plan=path, example_inputs=args)
    assert again.plan.predicted_peak == opt.plan.predicted_peak
    out = again(*args)
    assert torch.isfinite(out).all()
    F.mse_loss(out, torch.zeros_like(out)).backward()
