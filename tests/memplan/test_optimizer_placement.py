"""Where the optimizer's state lives and when it updates: host memory, and gradient accumulation.

``optimize(..., optimizer=opt, optimizer_state="host" | "auto", accumulate_steps=k)``. Checked
against eager PyTorch running the usual loop: parameters and optimizer state equal, every
step's measured peak (forward through the last update) at or under the budget, and host
state in storages the CPU tracker counts as host memory, not device memory.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch

import memplan
from memplan.core.config import override
from memplan.core.host import is_host
from memplan.measure.tracker import measure_peak
from memplan.pipeline.sweep import min_budget

from .helpers import build_step


def _adamw(module: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _assert_same(module, reference, optimizer, ref_optimizer) -> None:
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    for p, q in zip(module.parameters(), reference.parameters()):
        for key, value in ref_optimizer.state[q].items():
            torch.testing.assert_close(optimizer.state[p][key].to(value.device), value)


def _loop(module, step_fn, optimizer, args, kwargs, micro_steps: int, accumulate: int = 1,
          clip: float | None = None) -> list[int]:
    """The usual loop with gradient accumulation: the loss scaled by 1/accumulate, ``step()``
    and ``zero_grad()`` every ``accumulate`` micro-steps. Returns each micro-step's measured peak."""
    peaks = []
    for i in range(micro_steps):
        torch.manual_seed(i)
        scale = (lambda loss: loss / accumulate) if accumulate > 1 else (lambda loss: loss)
        peaks.append(measure_peak(lambda: scale(step_fn(*args, **kwargs)).backward()))
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return peaks


@pytest.mark.parametrize("model", ["cnn", "gpt"])
def test_host_state_trains_as_eager_and_leaves_the_device(model):
    module, args, kwargs = build_step(model)
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    on_device = memplan.optimize(module, 10**12, solver="store_all", optimizer=_adamw(module),
                                 example_inputs=args, example_kwargs=kwargs).plan
    planned = memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state="host",
                               example_inputs=args, example_kwargs=kwargs)
    plan = planned.plan
    state = on_device.analysis.optimizer_state_bytes
    assert plan.analysis.optimizer_state_bytes == 0
    assert plan.analysis.host_optimizer_state_bytes == state > 0
    # The state was the only difference: host updates add no device temporaries.
    assert plan.predicted_peak <= on_device.predicted_peak - state
    assert "host memory" in plan.report()

    peaks = _loop(module, planned, optimizer, args, kwargs, 3)
    _loop(reference, reference, ref_optimizer, args, kwargs, 3)
    # Store-all plans predict the whole step to the byte, the first step too (no state on the device).
    assert peaks == [plan.predicted_peak] * 3, (peaks, plan.predicted_peak)
    _assert_same(module, reference, optimizer, ref_optimizer)
    tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(is_host(v) for v in tensors)


@pytest.mark.slow
def test_auto_moves_state_to_host_under_a_budget_the_device_state_cannot_meet():
    """At least the shortfall moves (all of it where the simulator finds host updates, which overlap
    compute, faster than the recomputation just enough would leave: `whole_step_plan`); the step
    trains as eager under its budget."""
    module, args, kwargs = build_step("gpt")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    with override(bucket_bytes=0):  # the least any bucketing needs on the device: one call per parameter
        device_only = memplan.optimize(module, 10**12, solver="store_all", optimizer=_adamw(module),
                                       example_inputs=args, example_kwargs=kwargs).plan
    smallest = min_budget(device_only.analysis)
    state = device_only.analysis.optimizer_state_bytes
    budget = smallest - state // 2
    with pytest.raises(memplan.InfeasibleBudgetError):
        memplan.optimize(module, budget, optimizer=_adamw(module), optimizer_state="device", time_limit=2,
                         example_inputs=args, example_kwargs=kwargs)
    planned = memplan.optimize(module, budget, optimizer=optimizer, time_limit=2)  # optimizer_state="auto"
    peaks = _loop(module, planned, optimizer, args, kwargs, 3)
    _loop(reference, reference, ref_optimizer, args, kwargs, 3)
    analysis = planned.plan.analysis
    moved = analysis.host_optimizer_state_bytes
    print(f"budget {budget} device minimum {smallest} state {state} moved {moved} "
          f"({len(analysis.lowered.host_states)} of {len(analysis.lowered.updates)} parameters) peaks {peaks}")
    assert state // 2 <= moved <= state, "at least the shortfall moves"
    assert all(p <= budget for p in peaks), (peaks, budget)
    _assert_same(module, reference, optimizer, ref_optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [{}, {"updates_after_backward": True}, {"max_grad_norm": 0.05},
                                  {"optimizer_state": "host"}],
                         ids=["in_backward", "after_backward", "clipped", "host_state"])
def test_gradient_accumulation_matches_eager(mode):
    module, args, kwargs = build_step("cnn")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    probe = memplan.optimize(module, 10**12, solver="store_all", optimizer=_adamw(module), accumulate_steps=2,
                             example_inputs=args, example_kwargs=kwargs, **mode).plan.analysis
    assert probe.accumulated_gradient_bytes == sum(p.numel() * p.element_size() for p in module.parameters())
    budget = max(int(probe.graph_peak - 0.5 * probe.activation_bytes), min_budget(probe))
    planned = memplan.optimize(module, budget, optimizer=optimizer, accumulate_steps=2, time_limit=2, **mode)
    clip = mode.get("max_grad_norm")
    peaks, ref_peaks = [], []
    for cycle in range(2):
        peaks += _loop(module, planned, optimizer, args, kwargs, 1, accumulate=2)
        ref_peaks += _loop(reference, reference, ref_optimizer, args, kwargs, 1, accumulate=2)
        # Between micro-steps .grad holds the sum so far, as in eager.
        for p, q in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        peaks += _loop(module, planned, optimizer, args, kwargs, 1, accumulate=1)
        ref_peaks += _loop(reference, reference, ref_optimizer, args, kwargs, 1, accumulate=1, clip=clip)
        assert all(p.grad is None for p in module.parameters())
    print(f"{mode}: budget {budget} predicted {planned.plan.predicted_peak} measured {peaks} eager {ref_peaks}")
    assert all(p <= budget for p in peaks), (peaks, budget)
    _assert_same(module, reference, optimizer, ref_optimizer)


def test_a_resume_restores_the_plans_placement_of_the_state():
    """``load_state_dict`` casts the state to each parameter's device; the next step puts it back
    in host memory before it allocates anything, so that step too holds the budget."""
    module, args, kwargs = build_step("cnn")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    planned = memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state="host",
                               example_inputs=args, example_kwargs=kwargs)
    _loop(module, planned, optimizer, args, kwargs, 2)
    _loop(reference, reference, ref_optimizer, args, kwargs, 2)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    resumed = torch.optim.AdamW(module.parameters())
    resumed.load_state_dict(torch.load(saved))
    assert not any(is_host(v) for s in resumed.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    planned = memplan.optimize(module, planned.budget, solver="store_all", optimizer=resumed,
                               optimizer_state="host", example_inputs=args, example_kwargs=kwargs)
    torch.manual_seed(0)  # as the reference's _loop seeds its step
    peak = measure_peak(lambda: planned(*args, **kwargs).backward())
    _loop(reference, reference, ref_optimizer, args, kwargs, 1)
    # The loaded state sat on the device; it left before forward allocated anything.
    assert peak == planned.plan.predicted_peak
    assert all(is_host(v) for s in resumed.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    _assert_same(module, reference, resumed, ref_optimizer)


def test_bad_placement_options_get_one_clear_error():
    module, args, kwargs = build_step("mlp", batch_size=8)
    with pytest.raises(ValueError, match="optimizer_state="):
        memplan.optimize(module, "1GB", optimizer=_adamw(module), optimizer_state="disk")
    with pytest.raises(ValueError, match="accumulate_steps="):
        memplan.optimize(module, "1GB", optimizer=_adamw(module), accumulate_steps=0)
    with pytest.raises(ValueError, match="needs optimizer="):
        memplan.optimize(module, "1GB", accumulate_steps=2)
    with pytest.raises(ValueError, match="host_memory="):
        memplan.optimize(module, "1GB", optimizer=_adamw(module), host_memory="plenty")


def test_state_that_the_host_memory_cannot_take_is_refused_before_any_step():
    """``optimizer_state="host"`` with ``host_memory`` below the AdamW state: one clear error naming
    what the plan would keep there, raised when planning, the model and optimizer untouched; with
    room for it, `Plan.host_memory` says what the host holds."""
    module, args, kwargs = build_step("mlp", batch_size=8)
    before = [p.detach().clone() for p in module.parameters()]
    optimizer = _adamw(module)
    state = 2 * sum(p.numel() * p.element_size() for p in module.parameters())  # exp_avg, exp_avg_sq
    with pytest.raises(memplan.HostMemoryError, match="of host memory") as raised:
        memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state="host",
                         host_memory=state // 2, example_inputs=args, example_kwargs=kwargs)
    assert raised.value.parts["optimizer state"] >= state  # (and each parameter's step count)
    assert not optimizer.state and all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    plan = memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state="host",
                            host_memory=10 * state, example_inputs=args, example_kwargs=kwargs).plan
    assert plan.host_memory["optimizer state"] == plan.analysis.host_optimizer_state_bytes == raised.value.parts["optimizer state"]
    assert plan.host_memory["update copies"] >= state  # every parameter and gradient, and the temporaries
    # per step over the link: each gradient and parameter out, each parameter back; no activations paged
    assert plan.host_traffic == (state, state // 2) and not plan.transfers
    bandwidth = plan.analysis.costs.profile.host_bandwidth
    assert plan.link_time == pytest.approx(state / bandwidth)


def test_a_saved_whole_step_plan_runs_as_made_and_refuses_another_optimizer(tmp_path):
    module, args, kwargs = build_step("cnn")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    made = memplan.optimize(module, 10**12, solver="store_all", optimizer=_adamw(module), optimizer_state="host",
                            accumulate_steps=2, example_inputs=args, example_kwargs=kwargs).plan
    made.save(tmp_path / "step.json")
    path = str(tmp_path / "step.json")
    for wrong, match in [({}, "pass optimizer="),
                         ({"optimizer": torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)}, "state"),
                         ({"optimizer": _adamw(module)}, "accumulate_steps=2")]:
        steps = {"accumulate_steps": 2} if "optimizer" in wrong and match == "state" else {}
        with pytest.raises(memplan.PlanMismatchError, match=match):
            memplan.optimize(module, plan=path, example_inputs=args, example_kwargs=kwargs, **wrong, **steps)
    planned = memplan.optimize(module, plan=path, optimizer=optimizer, accumulate_steps=2)
    peaks = _loop(module, planned, optimizer, args, kwargs, 4, accumulate=2)
    _loop(reference, reference, ref_optimizer, args, kwargs, 4, accumulate=2)
    assert planned.plan.analysis.lowered.placement == made.analysis.lowered.placement
    assert planned.plan.predicted_peak == made.predicted_peak
    # The loop's own loss / 2 (a 4-byte scalar the caller holds through backward) is outside the plan.
    assert all(p <= made.predicted_peak + 4 for p in peaks), (peaks, made.predicted_peak)
    _assert_same(module, reference, optimizer, ref_optimizer)


@pytest.mark.slow
def test_clipping_by_a_norm_pass_where_holding_every_gradient_does_not_fit():
    """LOMO's two passes: the first backward computes only the global norm, each gradient freed
    once its square is added; the second applies the clipped updates as each gradient is final.
    On a parameter-heavy step (batch 1) its smallest budget is below holding every gradient's."""
    from memplan.planning.analysis import analyze_capture
    from memplan.capture.trace import capture
    from memplan.costs.cost_model import get_profile
    from memplan.updates.probe import UpdatePlacement, learn_updates

    module, args, kwargs = build_step("gpt", batch_size=1)
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    cap = capture(module, args, kwargs)
    profile = get_profile("cpu")
    updates = learn_updates(optimizer, module, [p.name for p in cap.primals], profile)
    holding = min_budget(analyze_capture(cap, profile, None, None, updates, UpdatePlacement(after_backward=True)))
    two_pass = min_budget(analyze_capture(cap, profile, None, None, updates, UpdatePlacement(norm_pass=True)))
    assert two_pass < holding, (two_pass, holding)
    # Planned with room: the solver runs on the clock (a loaded machine finds worse plans), and the
    # searched minimum is a schedule the update ordering may still lengthen (a forward op reading
    # a weight recomputed after its update). The memory claim is the two searched minima above.
    budget = int(1.05 * holding)
    planned = memplan.optimize(module, budget, optimizer=optimizer, max_grad_norm=0.05, grad_norm=True,
                               optimizer_state="device", clip_by="norm_pass", time_limit=3)
    peaks, norms, ref_norms = [], [], []
    for step in range(3):
        peaks += _loop(module, planned, optimizer, args, kwargs, 1)
        norms.append(planned.grad_norm)
        torch.manual_seed(0)
        reference(*args, **kwargs).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    plan = planned.plan
    print(f"holding minimum {holding}, norm pass minimum {two_pass}, budget {budget}, predicted "
          f"{plan.predicted_peak}, measured {peaks}, overhead {plan.predicted_overhead:.3f}")
    assert plan.analysis.lowered.placement.norm_pass
    assert all(p <= budget for p in peaks), (peaks, budget)
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms))
    _assert_same(module, reference, optimizer, ref_optimizer)


def test_host_updates_read_the_groups_when_they_start_and_run_the_step_hooks_once_per_bucket():
    # Host updates step a view of the optimizer on a worker thread (memplan.updates.runner.HostUpdates):
    # an LR scheduler's change between steps must reach them, and the optimizer's own hooks run.
    module, args, kwargs = build_step("mlp")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=1, gamma=0.5)
    calls: list[int] = []
    optimizer.register_step_pre_hook(lambda opt, a, kw: calls.append(1))
    planned = memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state="host",
                               example_inputs=args, example_kwargs=kwargs)
    for step in range(3):
        torch.manual_seed(step)
        planned(*args, **kwargs).backward()
        optimizer.step()  # finds no gradients: memplan applied the update in backward
        optimizer.zero_grad()
        scheduler.step()
        torch.manual_seed(step)
        reference(*args, **kwargs).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_scheduler.step()
    _assert_same(module, reference, optimizer, ref_optimizer)
    buckets = len(planned.plan.analysis.lowered.buckets)
    assert len(calls) == 3 * (buckets + 1)  # one per bucket, plus the user's own step() call
    assert all(is_host(t) for s in optimizer.state.values() for t in s.values() if t.dim() > 0)


def test_host_updates_clip_exactly_as_clip_grad_norm():
    module, args, kwargs = build_step("mlp")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    planned = memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state="host",
                               max_grad_norm=0.05, example_inputs=args, example_kwargs=kwargs)
    for step in range(3):
        torch.manual_seed(step)
        planned(*args, **kwargs).backward()
        torch.manual_seed(step)
        reference(*args, **kwargs).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(planned.grad_norm, norm)
    _assert_same(module, reference, optimizer, ref_optimizer)


@pytest.mark.parametrize("state", ["device", "host"])
def test_profile_times_the_updates_and_the_plan_trains_as_eager(state):
    """``profile=True`` times the optimizer's own updates (on the device and on the host) instead of
    a roofline of their traffic; the plan made with those times trains as eager."""
    from memplan.costs.cost_model import PROFILES
    from memplan.updates.probe import learn_updates

    module, args, kwargs = build_step("mlp")
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = _adamw(module), _adamw(reference)
    planned = memplan.optimize(module, 10**12, solver="store_all", optimizer=optimizer, optimizer_state=state,
                               profile=True, example_inputs=args, example_kwargs=kwargs)
    timed = planned.plan.analysis.updates
    roofline = learn_updates(optimizer, module, [n for n, _ in module.named_parameters()], PROFILES["cpu"])
    assert len(timed) == len(roofline) > 0
    # Measured, not the roofline (which, for these small parameters, leaves out the optimizer call).
    assert all(t.time != r.time and t.host_time != r.host_time for t, r in zip(timed, roofline))
    peaks = _loop(module, planned, optimizer, args, kwargs, 2)
    _loop(reference, reference, ref_optimizer, args, kwargs, 2)
    assert max(peaks) <= planned.plan.predicted_peak
    _assert_same(module, reference, optimizer, ref_optimizer)


class _Planned:
    """Stands for a `Plan` in `whole_step_plan`: its predicted step time, against store-all's 1.0."""

    store_all_time = 1.0

    def __init__(self, predicted_time: float):
        self.predicted_time = predicted_time


def test_moving_state_probes_the_new_placement_first_and_skips_what_cannot_fit():
    """`whole_step_plan` while state can move: an attempt short by more than its buckets' temporaries
    tries no smaller cap, updates after backward are not solved where the parameters, gradients and
    device state alone exceed the budget, no minimum is searched for; the placement reached by moving
    state is solved briefly (``probe``), as is every state in host memory, and the faster of the two
    is solved in full, at the largest bucket cap only."""
    from memplan.pipeline.plan import InfeasibleBudgetError, whole_step_plan
    from memplan.updates.probe import ParamUpdate, UpdatePlacement

    updates = [ParamUpdate(primal=0, name="big", state_bytes=800, temp_bytes=50, time=0.0, grad_bytes=100),
               ParamUpdate(primal=1, name="small", state_bytes=100, temp_bytes=5, time=0.0, grad_bytes=10)]
    calls = []

    def solve_for(placement: UpdatePlacement, search_minimum: bool = True, probe: bool = False):
        calls.append((sorted(placement.host), placement.after_backward, placement.bucket_bytes, probe, search_minimum))
        if "big" not in placement.host:
            raise InfeasibleBudgetError(1000, 1300, searched=False)  # short by 300, its temporaries 55
        if "small" in placement.host:  # (host updates that overlap compute: faster than recomputing)
            return _Planned(1.8 if probe else 1.2)
        return _Planned(2.0 if probe else 1.5)

    plan = whole_step_plan(solve_for, updates, UpdatePlacement(), 1000, may_move_state=True, caps=(1 << 20, 0))
    assert plan.predicted_time == 1.2
    assert calls == [([], False, 1 << 20, False, False),  # short: cap 0 and after backward (1,120 B held) skipped
                     (["big"], False, 1 << 20, True, False), (["big", "small"], False, 1 << 20, True, False),
                     (["big", "small"], False, 1 << 20, False, False)]  # (state moved: the largest cap only)
    # A first placement that fits with recomputation tries the smaller caps only while time is left.
    caps_tried = []

    def fits_at_once(placement: UpdatePlacement, search_minimum: bool = True, probe: bool = False):
        caps_tried.append(placement.bucket_bytes)
        return _Planned(1.5)

    whole_step_plan(fits_at_once, updates, UpdatePlacement(), 10**6, True, caps=(1 << 20, 0), out_of_time=lambda: True)
    assert caps_tried == [1 << 20]
    whole_step_plan(fits_at_once, updates, UpdatePlacement(), 10**6, True, caps=(1 << 20, 0))
    assert caps_tried == [1 << 20, 1 << 20, 0]


def test_state_moves_to_the_host_only_while_it_fits_there():
    """`whole_step_plan` with ``host_limit``: the state moved must fit the host beside one bucket's
    update copies (`host_update_bytes`); all of it on the host is not tried where it does not fit,
    a state the host cannot take is passed over for smaller ones, and where the device needs more moved
    than the host can take, `HostMemoryError` says so."""
    from memplan.pipeline.plan import InfeasibleBudgetError, whole_step_plan
    from memplan.updates.host_memory import host_update_bytes
    from memplan.updates.probe import ParamUpdate, UpdatePlacement

    updates = [ParamUpdate(primal=0, name="big", state_bytes=800, temp_bytes=50, time=0.0, grad_bytes=100),
               ParamUpdate(primal=1, name="small", state_bytes=100, temp_bytes=5, time=0.0, grad_bytes=10)]
    # state, and one bucket's parameters, gradients and temporaries
    assert host_update_bytes(updates, frozenset({"big"}), 1 << 20) == {"optimizer state": 800, "update copies": 250}
    assert sum(host_update_bytes(updates, frozenset({"big", "small"}), 1 << 20).values()) == 900 + 220 + 55
    calls = []

    def solve_for(placement: UpdatePlacement, search_minimum: bool = True, probe: bool = False):
        calls.append((sorted(placement.host), probe))
        if "big" not in placement.host:
            raise InfeasibleBudgetError(1000, 1300, searched=False)
        return _Planned(1.2 if "small" in placement.host else (2.0 if probe else 1.5))

    plan = whole_step_plan(solve_for, updates, UpdatePlacement(), 1000, may_move_state=True, caps=(1 << 20,),
                           host_limit=1100)
    assert plan.predicted_time == 1.5
    assert calls == [([], False), (["big"], True), (["big"], False)]  # (all on the host: 1,175 B, not tried)
    # 1,000 B of host: "big" (1,050 B with its copies) is passed over for "small", which is not enough
    calls.clear()
    with pytest.raises(memplan.HostMemoryError, match="1.18 kB of host memory") as raised:
        whole_step_plan(solve_for, updates, UpdatePlacement(), 1000, may_move_state=True, caps=(1 << 20,),
                        host_limit=1000)
    assert calls == [([], False), (["small"], True)]
    assert raised.value.parts == {"optimizer state": 900, "update copies": 275}
