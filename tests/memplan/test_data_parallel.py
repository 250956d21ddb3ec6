"""memplan planned inside DistributedDataParallel (gloo on the CPU, two processes, each rank its own batch).

``memplan.optimize(DDP(model), budget[, optimizer=])`` must train to the parameters and
optimizer state plain DDP trains to (an update that used a rank's own gradient, before DDP
averaged it, would show: the ranks' batches differ), with each rank's measured step peak under
its budget and within 2% of the plan's prediction, DDP's gradient buckets included. Two
witnesses measure the peak: memplan's dispatch-mode tracker and the profiler's allocation events.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memplan
from memplan.core.host import is_host
from memplan.measure.tracker import measure_peak, profiled_peak
from memplan.models import zoo
from .helpers import library_llama, run_torchrun_example, spawn_ranks
from memplan.runtime.handout import handout_groups

WORLD_SIZE = 2
STEPS = 3
TIME_LIMIT = 5  # seconds per solve (rank 0 solves for both; at 2 s the CNN case failed once in six runs beside other tests, cause not read)
MODES = {
    "optimizer.step() after backward": None,
    "updates in the plan": {"optimizer_state": "device"},
    "updates in the plan, clipped": {"optimizer_state": "device", "max_grad_norm": 0.05, "grad_norm": True},
    "state on the host": {"optimizer_state": "host"},
}


def _zoo_case(name: str, rank: int, **overrides) -> tuple[nn.Module, tuple]:
    zm = zoo.build(name, size="tiny", batch_size=4, overrides=overrides or None)
    torch.manual_seed(100 + rank)  # each rank its own batch, same shapes
    x = zm.example_inputs[0]
    batch = torch.randint_like(x, 0, 64) if not x.is_floating_point() else torch.randn_like(x)
    return memplan.WithLoss(zm.model, zm.loss_fn), (batch, *zm.example_inputs[1:])


def _llama_case(rank: int) -> tuple[nn.Module, tuple]:
    return library_llama(rank)


# Per case: the budget (a share of the eager forward and backward's peak) with optimizer.step()
# outside, with the updates and state in the plan, with the state on the host: below what the
# step takes without a plan (DDP's buckets and the optimizer's state added), above its minimum.
BUDGETS = {"gpt": ("92%", "150%", "125%"), "cnn": ("92%", "150%", "125%"), "llama": ("115%", "190%", "140%")}
CASES = {
    "gpt": lambda rank: _zoo_case("gpt", rank, dropout=0.0),
    "cnn": lambda rank: _zoo_case("cnn", rank, dropout=0.0),  # BatchNorm: DDP broadcasts its buffers each step
    "llama": _llama_case,
}


class BucketWitness:
    """A DDP communication hook that all-reduces as DDP's own does, and records what the profiler's
    witness needs (DDP's bucket buffers, allocated outside the measured step) and when the first
    collective of a backward was issued (`ops` counted so far by `OpCounter`)."""

    def __init__(self, counter: "OpCounter"):
        self.buffers: dict[int, torch.Tensor] = {}
        self.counter = counter
        self.first_at: int | None = None

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.buffers[bucket.index()] = bucket.buffer()
        if self.first_at is None:
            self.first_at = self.counter.ops
        return allreduce_hook(state, bucket)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops this thread runs (the planned backward's among them), and notes the count at
    the last op that computes a gradient (an aten ``*_backward`` op or a matrix product): the
    step's backward ends with one, before the updates in the plan and DDP's own work."""

    ops = 0
    last_gradient_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        if name.endswith("_backward") or name in ("mm", "bmm", "addmm"):
            self.last_gradient_op = self.ops
        return func(*args, **(kwargs or {}))


def _train(case: str, rank: int, mode: dict | None, bucket_cap_mb: float, as_view: bool) -> None:
    model, args = CASES[case](rank)
    reference = DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    counter = OpCounter()
    witness = BucketWitness(counter)
    ddp.register_comm_hook(None, witness.hook)
    # Which witness checks the prediction: on a CPU the host's memory and the device's are one,
    # so the profiler cannot tell a host copy (optimizer state moved there) from device memory;
    # the tracker can, but cannot see what kernels allocate for themselves (convolution's and the
    # attention backward's scratch), which the profiler sees and kernel_scratch plans room for.
    on_device = mode is None or mode["optimizer_state"] == "device"
    kind = 0 if mode is None else 1 if on_device else 2
    # (a share of the eager forward and backward's peak; the whole step adds the optimizer's state)
    budget = BUDGETS[case][kind]
    planned = memplan.optimize(ddp, budget, time_limit=TIME_LIMIT, kernel_scratch=on_device,
                               **({} if mode is None else {"optimizer": opt, **mode}))
    assert planned is ddp and isinstance(ddp.module, memplan.OptimizedModule)

    def step():
        if mode is None:
            opt.zero_grad()
            planned(*args).backward()
            opt.step()
        else:
            planned(*args).backward()

    clip = (mode or {}).get("max_grad_norm")

    def reference_step() -> torch.Tensor | None:
        ref_opt.zero_grad()
        reference(*args).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip) if clip is not None else None
        ref_opt.step()
        return norm

    for k in range(STEPS):
        norm = reference_step()
        if k < STEPS - 1:
            step()
            continue
        # The last step, measured: by the tracker, then the profiler (the same step twice
        # would update twice: the reference steps once more for the second).
        plan = ddp.module.plan
        if mode is None:
            opt.zero_grad()
        state = [v for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() and not is_host(v)] if mode is not None else []
        held = [p.grad for p in ddp.parameters() if p.grad is not None]
        # (DDP rebuilt its buckets at the second step: the buffers are the ones this step fills)
        counter.ops, counter.last_gradient_op, witness.first_at, witness.buffers = 0, 0, None, {}
        with counter:
            measured = measure_peak(lambda: planned(*args).backward())
        # Overlap, decided by the plan and not by a share of the ops: the first all-reduce goes out
        # before the step's last gradient is computed. (A time-limited solve on a loaded machine can
        # find a plan that recomputes more and makes gradients later: one such plan issued the first
        # all-reduce at op 1353 of 1423, over the 90% this test once asked for.)
        assert witness.first_at is not None and witness.first_at < counter.last_gradient_op, (
            witness.first_at, counter.last_gradient_op, counter.ops)
        if mode is None:
            opt.step()
        assert measured <= plan.budget, (case, mode, measured, plan.budget)
        if not on_device:
            assert abs(measured - plan.predicted_peak) <= 0.02 * plan.predicted_peak, (case, mode, measured,
                                                                                        plan.predicted_peak)
        if clip is not None:  # the global norm of the averaged gradients, as clip_grad_norm_ on DDP gives
            torch.testing.assert_close(ddp.module.grad_norm, norm)
        norm = reference_step()
        if mode is None:
            opt.zero_grad()
        resident = [*ddp.parameters(), *args, *state, *held, *witness.buffers.values()]
        profiled = profiled_peak(lambda: planned(*args).backward(), resident=resident)
        if mode is None:
            opt.step()
        if on_device:
            assert not plan.analysis.lowered.host_states and not plan.transfers
            assert profiled <= plan.budget, (case, mode, "profiled", profiled, plan.budget)
            assert abs(profiled - plan.predicted_peak) <= 0.02 * plan.predicted_peak, (case, mode, profiled,
                                                                                        plan.predicted_peak)
    for (name, p), r in zip(ddp.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, msg=lambda m: f"{case} {mode}: {name}: {m}")
    if mode is not None:
        for p, r in zip(ddp.parameters(), reference.parameters()):
            for key, value in ref_opt.state[r].items():
                torch.testing.assert_close(opt.state[p][key].to(value.device), value)
    assert plan.engine_bytes == sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)


def _one_plan_for_all_ranks(case: str, rank: int) -> None:
    """With example inputs, the first rank solves and the others bind its plan (no solve there)."""
    model, args = CASES[case](rank)
    planned = memplan.optimize(DDP(model), BUDGETS[case][0], time_limit=TIME_LIMIT, example_inputs=args)
    plan = planned.module.plan
    schedules: list = [None] * WORLD_SIZE
    torch.distributed.all_gather_object(schedules, list(plan.schedule))
    assert all(s == schedules[0] for s in schedules)
    assert ("solve" in plan.planning_time) == (rank == 0), plan.planning_time
    planned(*args).backward()  # and it runs
    # Without example inputs the first step's plan is made once too, where every rank's inputs have
    # one signature; where they differ, each rank plans its own (and no rank waits for another).
    # (a signature differs by the module's mode: rank 1 in eval mode, the case has no dropout)
    for shared in (True, False):
        planned = memplan.optimize(DDP(CASES[case](rank)[0]), BUDGETS[case][0], time_limit=TIME_LIMIT)
        planned.train(shared or rank == 0)
        planned(*args).backward()
        plan = planned.module.plan
        torch.distributed.all_gather_object(schedules, list(plan.schedule))
        assert all(s == schedules[0] for s in schedules) or not shared
        assert ("solve" in plan.planning_time) == (rank == 0 or not shared), plan.planning_time
    # an infeasible budget on the first rank is an error on every rank, not a hang
    with pytest.raises((memplan.InfeasibleBudgetError, memplan.DistributedTrainingError), match="below|could not"):
        memplan.optimize(DDP(CASES[case](rank)[0]), "1kB", time_limit=5, example_inputs=args)


def _accumulation_and_the_backend(case: str, rank: int) -> None:
    """Without optimizer=: accumulation under ``no_sync()`` gives plain DDP's gradients (the ones
    held between micro-steps counted in the plan); with it, ``accumulate_steps=2`` trains as DDP's
    loop with ``no_sync()`` does; and ``torch.compile`` of a DDP module with
    memplan's backend trains as DDP does, with a warning that DDP's buckets are not in its budget."""
    model, args = CASES[case](rank)
    reference = DDP(copy.deepcopy(model))
    planned = memplan.optimize(DDP(model), BUDGETS[case][0], time_limit=TIME_LIMIT)
    for ddp in (reference, planned):
        with ddp.no_sync():
            ddp(*args).backward()
        ddp(*args).backward()
    for p, r in zip(planned.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    assert planned.module.plan.held_gradient_bytes == planned.module.plan.engine_bytes  # every gradient held

    # With optimizer= and accumulate_steps=2 memplan accumulates, and DDP reduces only at the second
    # micro-step (as inside no_sync() for the first; clipped by the global norm of the averaged sums):
    # two steps train as eager DDP's loop does, even with the user's own no_sync() around each.
    model, args = CASES[case](rank)
    other = (torch.randint_like(args[0], 0, 64),)  # each rank's second micro-batch, its own
    reference = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ddp = DDP(model)
    reductions = [0]

    def counted(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        reductions[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counted)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    planned = memplan.optimize(ddp, BUDGETS[case][1], time_limit=TIME_LIMIT, optimizer=opt, accumulate_steps=2,
                               max_grad_norm=0.5)
    for cycle in range(2):
        with reference.no_sync():
            reference(*args).backward()
        reference(*other).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        reductions[0] = 0
        first = measure_peak(lambda: planned(*args).backward())
        assert reductions[0] == 0, reductions  # the first micro-step: no all-reduce
        with ddp.no_sync():  # memplan's count decides, not the caller's context
            second = measure_peak(lambda: planned(*other).backward())
        assert reductions[0] > 0
        plan = ddp.module.plan
        if cycle:  # (the first cycle's first update made the optimizer's state: the plan counts it from then)
            assert max(first, second) <= plan.budget, (first, second, plan.budget)
            assert abs(max(first, second) - plan.predicted_peak) <= 0.02 * plan.predicted_peak, (first, second, plan)
    for p, r in zip(planned.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r)
        for key, value in ref_opt.state[r].items():
            if isinstance(value, torch.Tensor) and value.dim():
                torch.testing.assert_close(opt.state[p][key], value, msg=key)

    model, args = CASES[case](rank)
    reference = DDP(copy.deepcopy(model))
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend=memplan.backend(10_000_000))
    with pytest.warns(memplan.DistributedWarning, match="gradient buckets"):
        compiled(*args).backward()
    reference(*args).backward()
    for p, r in zip(ddp.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


def _checkpoint_resumes(case: str, rank: int, directory: str) -> None:
    """A whole step with the optimizer's state on the host, saved with torch.distributed.checkpoint
    after two steps and loaded into a fresh DDP module and optimizer, takes the third step to the
    parameters and state of the run that never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def made() -> tuple[nn.Module, torch.optim.Optimizer, tuple]:
        model, args = CASES[case](rank)
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        return memplan.optimize(ddp, BUDGETS[case][2], time_limit=TIME_LIMIT, optimizer=opt, optimizer_state="host"), opt, args

    first, first_opt, args = made()
    for _ in range(2):
        first(*args).backward()
    model_state, optim_state = get_state_dict(first, first_opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    first(*args).backward()

    second, second_opt, _ = made()
    model_state, optim_state = get_state_dict(second, second_opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    set_state_dict(second, second_opt, model_state_dict=model_state, optim_state_dict=optim_state)
    second(*args).backward()
    assert second.module.plan.analysis.lowered.host_states  # the state lives on the host, as it did
    for p, q in zip(second.parameters(), first.parameters()):
        torch.testing.assert_close(p, q)
        for key, value in first_opt.state[q].items():
            torch.testing.assert_close(second_opt.state[p][key], value)
            assert is_host(second_opt.state[p][key]) == is_host(value)


def _rank(rank: int, case: str, as_view: bool, directory: str = "") -> None:
    if case == "gpt" and not as_view:
        _one_plan_for_all_ranks(case, rank)
        _accumulation_and_the_backend(case, rank)
        _checkpoint_resumes(case, rank, directory)
    # (gradients as bucket views change where .grad lives, not how the state is placed or clipped:
    # that case runs the two modes without host state or clipping, to keep make test short)
    # (the library Llama likewise: host state and clipping are the zoo models' rows)
    modes = list(MODES.values())[:2] if as_view or case == "llama" else MODES.values()
    for mode in modes:
        # small buckets: several DDP buckets, so that the first all-reduce goes out mid-backward
        _train(case, rank, mode, bucket_cap_mb=0.02, as_view=as_view)


@pytest.mark.slow
@pytest.mark.parametrize("case,as_view", [("gpt", False), ("cnn", False), ("llama", False), ("gpt", True)])
def test_memplan_inside_ddp_trains_as_ddp_under_each_ranks_budget(case, as_view, tmp_path):
    if case == "llama":
        pytest.importorskip("transformers")
    spawn_ranks(_rank, case, as_view, str(tmp_path / "checkpoint"), world_size=WORLD_SIZE)


def test_handout_groups_follow_the_order_and_cut_at_the_cap():
    order = [(5, 40), (2, 40), (7, 100), (1, 10), (0, 10)]
    assert handout_groups(order, 80) == [(5, 2), (7,), (1, 0)]
    assert handout_groups(order, 0) == [(5,), (2,), (7,), (1,), (0,)]
    assert handout_groups([], 80) == []


def test_gradients_handed_out_as_made_leave_the_plan_and_the_numbers_unchanged():
    """In one process (no DDP to reduce anything): the planned backward hands its gradients to
    autograd in groups as it makes them, the updates step with what ``.grad`` then holds, and
    the step trains as eager does, its measured peak the plan's (less DDP's buckets, which do
    not exist here). The budget makes the plan free two gradients through the peak and compute
    them again: they go out after the second computation, not held from the first."""
    from memplan.frontend.distributed import DataParallel
    from memplan.frontend.module import OptimizedModule
    from memplan.pipeline.options import PlanOptions, StepOptions

    zm = zoo.build("gpt", size="tiny", batch_size=4, overrides={"dropout": 0.0})
    model = memplan.WithLoss(zm.model, zm.loss_fn)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    engine = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = OptimizedModule(model, 1_219_910 + engine, PlanOptions(time_limit=TIME_LIMIT),
                              StepOptions(optimizer=opt, updates_after_backward=True),
                              data_parallel=DataParallel(world_size=1, bucket_bytes=20_000,
                                                         gradient_as_bucket_view=False))
    for _ in range(STEPS):
        measured = measure_peak(lambda: planned(*zm.example_inputs).backward())
        ref_opt.zero_grad()
        reference(*zm.example_inputs).backward()
        ref_opt.step()
    plan = planned.plan
    program = planned._plans[planned._last_signature][1]
    assert len(program.handout.groups) >= 3
    assert plan.engine_bytes == engine
    assert measured == plan.predicted_peak - engine <= plan.budget - engine
    assert all(p.grad is None for p in model.parameters())  # the step owns the gradients
    # the report and the memory plot show DDP's buckets as their own category, all step long
    from memplan.tools import viz

    breakdown = viz.memory_breakdown(plan)
    assert (breakdown.engine_buffers == engine).all()
    assert int(breakdown.total.max()) == plan.predicted_peak
    assert "of DDP's gradient buckets" in plan.report()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r)


@pytest.mark.slow
def test_the_torchrun_example_trains_on_two_processes():
    out = run_torchrun_example("ddp_train.py", "--steps", "2")
    assert "step 1: loss" in out and "DDP's gradient buckets" in out, out[-2000:]


def test_a_saved_plan_that_updates_in_backward_is_refused_inside_ddp(tmp_path):
    """Under DDP every update needs the averaged gradients, after backward: a plan saved with its
    updates in backward (made outside DDP) is refused, not run on gradients DDP has not reduced."""
    from memplan.frontend.distributed import DataParallel
    from memplan.frontend.module import OptimizedModule
    from memplan.pipeline.options import PlanOptions, StepOptions
    from memplan.planning.saved_format import PlanMismatchError

    zm = zoo.build("mlp", size="tiny", batch_size=64)
    model = memplan.WithLoss(zm.model, zm.loss_fn)
    opt = torch.optim.AdamW(model.parameters())
    outside = memplan.optimize(model, "100%", optimizer=opt, time_limit=5, example_inputs=zm.example_inputs)
    assert not outside.plan.analysis.lowered.placement.after_backward
    outside.plan.save(tmp_path / "plan.json")
    inside = OptimizedModule(model, None, PlanOptions(), StepOptions(optimizer=opt), plan=tmp_path / "plan.json",
                             data_parallel=DataParallel(world_size=1, bucket_bytes=1 << 20, gradient_as_bucket_view=False))
    with pytest.raises(PlanMismatchError, match="after backward"):
        inside.prepare(*zm.example_inputs)
