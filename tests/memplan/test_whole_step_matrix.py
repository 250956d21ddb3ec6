"""Issue #27's test matrix: the whole training step planned under one budget.

``memplan.optimize(model, budget, optimizer=opt)`` plans forward, backward and
the optimizer's update together, the optimizer's state inside the budget; the
update runs in the planned backward (as each gradient becomes final, or with
``updates_after_backward=True`` / ``max_grad_norm=`` at the end of backward),
and ``opt.step()`` / ``opt.zero_grad()`` then find nothing to do.

Every test runs the same steps on a deep copy of the model with eager PyTorch
(``backward(); [clip_grad_norm_]; step(); zero_grad()``, the same seed before
each step so that dropout masks agree) and compares parameters, buffers and
the optimizer's state. Every measured peak is the whole loop body of a step,
forward through ``zero_grad()``, the first step included (where torch
allocates the optimizer's state lazily), and it must be at or under a budget
that forces recomputation.
"""
from __future__ import annotations

import copy
import functools
import io
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import memplan
from memplan.measure.tracker import measure_peak
from memplan.updates.probe import UnsupportedOptimizer

from .helpers import build_step

# Small batches: each planned step is a few seconds on a 2-core CPU, and activations still
# outweigh parameters and state, so half of them below store-all forces recomputation.
BATCH = {"mlp": 64, "cnn": 8, "gpt": 4, "unet": 2}
TIME_LIMIT = 0.5  # seconds for the solver: these graphs are small
LR = 1e-2
MAX_NORM = 0.05  # below every zoo model's gradient norm at init: the clip scales
STEPS = 3
MODES = {"in_backward": False, "after_backward": True}
# The matrix's placements: each update as its gradient is final or after backward, with the state
# on the device, or every parameter's state in host memory, updated there.
PLACEMENTS = {"in_backward": {"updates_after_backward": False}, "after_backward": {"updates_after_backward": True},
              "host": {"optimizer_state": "host"}}
ACCUMULATE = 2  # micro-steps per update in the matrix's accumulation variant

Factory = Callable[[nn.Module], torch.optim.Optimizer]


def _groups(module: nn.Module) -> list[dict]:
    """Two param groups with their own lr and weight decay: matrices, then vectors."""
    params = list(module.parameters())
    return [{"params": [p for p in params if p.dim() > 1], "lr": 2e-2, "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "lr": 3e-3, "weight_decay": 0.0}]


OPTIMIZERS: dict[str, Factory] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=LR),
    "adamw_param_groups": lambda m: torch.optim.AdamW(_groups(m)),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam_foreach": lambda m: torch.optim.Adam(m.parameters(), lr=LR, foreach=True),
    "adam_for_loop": lambda m: torch.optim.Adam(m.parameters(), lr=LR, foreach=False),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=LR, fused=True),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these tiny models gain nothing from more, and ``-n 2`` on two cores
    with two threads per worker spends its time waiting on spinning threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _build(name: str, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
    return build_step(name, batch_size=BATCH[name], seed=seed)


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else nullcontext()


def _plan(module, budget, optimizer, args, kwargs, *, autocast=False, **options) -> memplan.OptimizedModule:
    """``memplan.optimize`` planned now, for these inputs: planning inside the first measured step
    would run under the memory tracker's dispatch mode, several times slower."""
    with _autocast(autocast):
        return memplan.optimize(module, budget, optimizer=optimizer, time_limit=TIME_LIMIT, example_inputs=args,
                                example_kwargs=kwargs, **options)


@functools.cache
def _budget(name: str, autocast: bool = False, host: bool = False, accumulate: int = 1) -> int:
    """Half the activations below store-all's whole-step peak with AdamW and the updates in backward
    (one probe per model and worker). Every test of the model gets this budget, whatever its optimizer
    and update placement: `_check_plan` checks that it is below that step's own store-all peak.
    ``host``: the state in host memory (its own, lower peak); ``accumulate``: with that many micro-steps
    per update (the accumulated gradients are held all step)."""
    module, args, kwargs = _build(name)
    placement = {"optimizer_state": "host"} if host else {}
    with _autocast(autocast):
        probe = memplan.optimize(module, 10**12, solver="store_all", optimizer=OPTIMIZERS["adamw"](module),
                                 accumulate_steps=accumulate, example_inputs=args, example_kwargs=kwargs,
                                 **placement)
    analysis = probe.plan.analysis
    assert (analysis.host_optimizer_state_bytes if host else analysis.optimizer_state_bytes) > 0
    return int(analysis.graph_peak - 0.5 * analysis.activation_bytes)


def _steps(step_fn, optimizer, args, kwargs, *, start=0, steps=STEPS, scheduler=None, clip=None, norms=None,
           autocast=False, measure=True, accumulate=1) -> list[int]:
    """The usual loop; each step's measured peak (forward through ``zero_grad()``) when ``measure``.
    ``clip``: the parameters to ``clip_grad_norm_`` to ``MAX_NORM`` between backward and step (the
    eager loop; their norms are appended to ``norms``). ``accumulate``: micro-steps per update, the
    loss scaled by 1/accumulate, ``step()`` and ``zero_grad()`` every ``accumulate``-th."""
    peaks = []
    for step in range(start, start + steps):
        def body(step=step):
            torch.manual_seed(step)  # dropout masks: the same in both runs
            with _autocast(autocast):
                loss = step_fn(*args, **kwargs)
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (step + 1) % accumulate:
                return
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(clip, MAX_NORM))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        if measure:
            peaks.append(measure_peak(body))
        else:
            body()
        if scheduler is not None:
            scheduler.step()
    return peaks


def _state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, dict]:
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: s for p, s in optimizer.state.items()}


def _assert_same_training(module, reference, optimizer, ref_optimizer, **tol) -> None:
    """Parameters, buffers, every optimizer state entry and the groups' hyperparameters equal."""
    ref_sd = reference.state_dict()
    assert module.state_dict().keys() == ref_sd.keys()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, ref_sd[name], msg=lambda m, name=name: f"{name}: {m}", **tol)
    state, ref_state = _state(optimizer, module), _state(ref_optimizer, reference)
    assert state.keys() == ref_state.keys()
    assert ref_state, "eager kept no optimizer state"
    for name, entries in ref_state.items():
        assert state[name].keys() == entries.keys(), name
        for key, value in entries.items():
            torch.testing.assert_close(state[name][key], value, msg=lambda m, name=name, key=key: f"{name}.{key}: {m}", **tol)
    for group, ref_group in zip(optimizer.param_groups, ref_optimizer.param_groups, strict=True):
        assert {k: v for k, v in group.items() if k != "params"} == \
            {k: v for k, v in ref_group.items() if k != "params"}


def _check_plan(planned: memplan.OptimizedModule, budget: int, forced_after: bool, host: bool = False) -> None:
    plan = planned.plan
    lowered = plan.analysis.lowered
    assert lowered.updates, "the plan applies no update"
    assert plan.predicted_peak <= budget < plan.store_all_peak
    if host:  # every parameter's state in host memory, none on the device
        assert plan.analysis.optimizer_state_bytes == 0 < plan.analysis.host_optimizer_state_bytes
        assert lowered.host_states == {name for _, _, name in lowered.updates}
    else:
        assert plan.analysis.optimizer_state_bytes > 0
        # These budgets fit the state on the device: recomputation is preferred to host updates.
        assert not lowered.host_states
    assert any(d.decision == "recompute" for d in plan.decisions), "the budget forced no recomputation"
    if forced_after:
        assert lowered.updates_after_backward


# -- 1. the matrix: zoo models x update placement x {plain, lr schedule, clip} -----------------

VARIANTS = ("plain", "step_lr", "clip", "accumulate")


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", list(PLACEMENTS))
@pytest.mark.parametrize("model", list(BATCH))
def test_matrix_three_steps_equal_eager_within_the_budget(model, mode, variant):
    host = mode == "host"
    after_backward = MODES.get(mode, False)
    if variant == "accumulate":
        return _accumulating_steps_equal_eager_within_the_budget(model, mode)
    budget = _budget(model, host=host)
    module, args, kwargs = _build(model)
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = OPTIMIZERS["adamw"](module), OPTIMIZERS["adamw"](reference)
    clip = MAX_NORM if variant == "clip" else None
    planned = _plan(module, budget, optimizer, args, kwargs, max_grad_norm=clip, **PLACEMENTS[mode])
    schedules = (None, None)
    if variant == "step_lr":
        schedules = tuple(torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                          for o in (optimizer, ref_optimizer))
    ref_norms: list[torch.Tensor] = []
    norms = []
    peaks = []
    for step in range(STEPS):  # one step at a time: the clip's norms are per step
        peaks += _steps(planned, optimizer, args, kwargs, start=step, steps=1, scheduler=schedules[0])
        if clip is not None:
            norms.append(planned.grad_norm.clone())
    _steps(reference, ref_optimizer, args, kwargs, scheduler=schedules[1], measure=False,
           clip=list(reference.parameters()) if clip is not None else None, norms=ref_norms)

    # With only max_grad_norm= the updates wait for the clip, after backward (or, where that does not
    # fit, in a second backward pass): not asserted here, only that the clip is eager's.
    _check_plan(planned, budget, forced_after=after_backward, host=host)
    print(f"\n{model} {mode} {variant}: budget {budget} B, predicted {planned.plan.predicted_peak} B, measured {peaks}")
    assert all(p <= budget for p in peaks), (peaks, budget)
    if variant == "step_lr":
        assert optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5**STEPS)
    if clip is not None:
        assert all(n > MAX_NORM for n in ref_norms), "the clip did nothing"
        torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms))
    _assert_same_training(module, reference, optimizer, ref_optimizer)


def _accumulating_steps_equal_eager_within_the_budget(model: str, mode: str) -> None:
    """The matrix's accumulation cell: ``accumulate_steps=2``, the usual loop (the loss scaled by
    1/2, ``step()`` and ``zero_grad()`` every second micro-step) for 3 updates, against eager's."""
    host = mode == "host"
    budget = _budget(model, host=host, accumulate=ACCUMULATE)
    module, args, kwargs = _build(model)
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = OPTIMIZERS["adamw"](module), OPTIMIZERS["adamw"](reference)
    planned = _plan(module, budget, optimizer, args, kwargs, accumulate_steps=ACCUMULATE, **PLACEMENTS[mode])
    peaks = _steps(planned, optimizer, args, kwargs, steps=STEPS * ACCUMULATE, accumulate=ACCUMULATE)
    _steps(reference, ref_optimizer, args, kwargs, steps=STEPS * ACCUMULATE, accumulate=ACCUMULATE, measure=False)
    _check_plan(planned, budget, forced_after=MODES.get(mode, False), host=host)
    print(f"\n{model} {mode} accumulate: budget {budget} B, predicted {planned.plan.predicted_peak} B, "
          f"measured {peaks}")
    assert planned.plan.analysis.accumulated_gradient_bytes > 0
    assert all(p <= budget for p in peaks), (peaks, budget)
    _assert_same_training(module, reference, optimizer, ref_optimizer)


# -- 2. other optimizers and param groups --------------------------------------------------------

# One zoo model per optimizer (test_optimizer_step.py runs them all on cnn and gpt, updates in backward).
OTHER = {"adamw_param_groups": "gpt", "sgd_momentum": "unet", "adam_foreach": "cnn", "adam_for_loop": "unet",
         "adamw_fused": "mlp"}


def _fused_supported() -> bool:
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(OTHER))
def test_optimizers_and_param_groups_equal_eager_within_the_budget(kind, mode):
    if kind == "adamw_fused" and not _fused_supported():
        pytest.skip("this torch build has no fused AdamW on the CPU")
    model, after_backward = OTHER[kind], MODES[mode]
    budget = _budget(model)
    module, args, kwargs = _build(model)
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = OPTIMIZERS[kind](module), OPTIMIZERS[kind](reference)
    planned = _plan(module, budget, optimizer, args, kwargs, updates_after_backward=after_backward)
    peaks = _steps(planned, optimizer, args, kwargs, steps=2)
    _steps(reference, ref_optimizer, args, kwargs, steps=2, measure=False)
    _check_plan(planned, budget, forced_after=after_backward)
    assert all(p <= budget for p in peaks), (peaks, budget)
    _assert_same_training(module, reference, optimizer, ref_optimizer)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_that_starts_with_gradients_held_applies_their_sum(mode):
    """Eager: ``backward(); backward(); step()`` steps with the sum of both gradients. Here the first
    backward is through the unplanned model (an auxiliary loss, or a caller that forgot
    ``zero_grad()``), the second through the planned one."""
    module, args, kwargs = _build("mlp")
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    planned = _plan(module, "1GB", optimizer, args, kwargs, updates_after_backward=MODES[mode])
    module(*args, **kwargs).backward()
    reference(*args, **kwargs).backward()
    _steps(planned, optimizer, args, kwargs, steps=1, measure=False)
    _steps(reference, ref_optimizer, args, kwargs, steps=1, measure=False)
    assert planned.plan.held_gradient_bytes > 0
    _assert_same_training(module, reference, optimizer, ref_optimizer)


# -- 3. checkpoints -----------------------------------------------------------------------------

def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_equal_trees(a, b) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_equal_trees(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_trees(x, y)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_after_two_steps_resumes_as_eager(mode):
    """Two planned steps, ``state_dict()`` of model and optimizer through torch.save / torch.load,
    a fresh model and optimizer load them and are planned again: one more step equals eager's third."""
    model, after_backward = "cnn", MODES[mode]
    budget = _budget(model)
    module, args, kwargs = _build(model)
    reference = copy.deepcopy(module)
    optimizer, ref_optimizer = OPTIMIZERS["adamw"](module), OPTIMIZERS["adamw"](reference)
    planned = _plan(module, budget, optimizer, args, kwargs, updates_after_backward=after_backward)
    peaks = _steps(planned, optimizer, args, kwargs, steps=2)

    saved = optimizer.state_dict()
    assert saved["state"], "the planned steps left no optimizer state"
    assert all(int(s["step"]) == 2 for s in saved["state"].values())
    loaded_model, loaded_optimizer = _roundtrip((module.state_dict(), saved))
    _assert_equal_trees(loaded_optimizer, optimizer.state_dict())

    fresh, _, _ = _build(model)
    with torch.no_grad():  # other weights: the checkpoint must replace them
        for p in fresh.parameters():
            p.normal_()
    fresh_optimizer = OPTIMIZERS["adamw"](fresh)
    fresh.load_state_dict(loaded_model)
    fresh_optimizer.load_state_dict(loaded_optimizer)
    replanned = _plan(fresh, budget, fresh_optimizer, args, kwargs, updates_after_backward=after_backward)
    peaks += _steps(replanned, fresh_optimizer, args, kwargs, start=2, steps=1)
    _steps(reference, ref_optimizer, args, kwargs, measure=False)

    assert all(p <= budget for p in peaks), (peaks, budget)
    _assert_same_training(fresh, reference, fresh_optimizer, ref_optimizer)
    _assert_equal_trees(_roundtrip(fresh_optimizer.state_dict()), fresh_optimizer.state_dict())


# -- 4. autocast -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_bf16_autocast_step_is_close_to_eager_within_the_budget(mode):
    """fp32 parameters, forward under CPU bf16 autocast, AdamW. bf16 rounds the traced graph's
    backward differently from eager autograd (gradients differ by about 1%), and Adam turns a
    gradient's sign on near-zero entries into a whole lr step, hence the loose tolerances and
    the small lr."""
    model, after_backward = "gpt", MODES[mode]
    lr = 1e-3
    budget = _budget(model, autocast=True)
    module, args, kwargs = _build(model)
    reference = copy.deepcopy(module)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr)
    planned = _plan(module, budget, optimizer, args, kwargs, autocast=True, updates_after_backward=after_backward)
    peaks = _steps(planned, optimizer, args, kwargs, steps=2, autocast=True)
    _steps(reference, ref_optimizer, args, kwargs, steps=2, autocast=True, measure=False)

    _check_plan(planned, budget, forced_after=after_backward)
    assert any(n.meta.get("val") is not None and getattr(n.meta["val"], "dtype", None) == torch.bfloat16
               for n in planned.plan.analysis.capture.graph.nodes), "the plan holds no bf16 value"
    assert all(p <= budget for p in peaks), (peaks, budget)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p, dict(reference.named_parameters())[name], atol=2e-2, rtol=2e-2)
    # The updates themselves (the test above is loose enough to pass without any).
    moved = torch.cat([(p.detach() - start[n]).flatten() for n, p in module.named_parameters()])
    ref_moved = torch.cat([(p.detach() - start[n]).flatten() for n, p in reference.named_parameters()])
    assert (moved - ref_moved).norm() <= 0.2 * ref_moved.norm()
    state, ref_state = _state(optimizer, module), _state(ref_optimizer, reference)
    assert state.keys() == ref_state.keys()
    for name, entries in ref_state.items():
        assert int(state[name]["step"]) == int(entries["step"]) == 2
        for key in ("exp_avg", "exp_avg_sq"):  # within 5% of each tensor's largest entry
            scale = entries[key].abs().max().clamp_min(1e-30)
            torch.testing.assert_close(state[name][key] / scale, entries[key] / scale, atol=5e-2, rtol=0,
                                       msg=lambda m, name=name, key=key: f"{name}.{key}: {m}")


# -- 5. bad inputs -------------------------------------------------------------------------------

def test_an_optimizer_over_other_parameters_is_a_value_error():
    module, _, _ = _build("mlp")
    stranger = nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(list(module.parameters()) + list(stranger.parameters()))
    with pytest.raises(ValueError, match="2 of the optimizer's parameters are not parameters of the model"):
        memplan.optimize(module, "1GB", optimizer=optimizer)
    with pytest.raises(ValueError, match="not parameters of the model"):
        memplan.optimize(module, "1GB", optimizer=torch.optim.SGD(stranger.parameters(), lr=0.1))


@pytest.mark.parametrize("thing", ["adamw", torch.optim.AdamW, {"lr": 0.1}], ids=["str", "class", "dict"])
def test_a_non_optimizer_is_a_type_error(thing):
    module, _, _ = _build("mlp")
    with pytest.raises(TypeError, match=rf"takes a torch.optim.Optimizer, got {type(thing).__name__}"):
        memplan.optimize(module, "1GB", optimizer=thing)


# Not strict: the read tokens (memplan.planning.lowering._add_read_tokens) let some searches' schedules
# survive the move, so whether it fails depends on the schedule the search finds.
MIN_BUDGET_BUG = pytest.mark.xfail(strict=False, raises=memplan.InfeasibleBudgetError, reason=(
    "bug: with updates in backward the error's min_budget comes from the minimum-budget search on the "
    "Problem, which does not see that each update is then moved after its parameter's last read "
    "(a recomputation of a forward op that reads the weight can come after the update) "
    "(memplan.planning.lowering.updated_after_reads): that schedule goes over the 'minimum' (mlp tiny, batch 64: "
    "263368 B searched, 263880 B after the move), the plan falls back to updates after backward, and "
    "optimize(budget=min_budget) raises InfeasibleBudgetError naming a larger minimum (299208 B; "
    "optimizer_state='auto': 121900 B, then 173104 B)"))


@pytest.mark.slow
@pytest.mark.parametrize("state", ["device", "auto"])
@pytest.mark.parametrize("mode", [pytest.param("in_backward", marks=MIN_BUDGET_BUG), "after_backward"])
def test_a_budget_below_the_whole_step_minimum_names_the_minimum(mode, state):
    """The error gives the minimum, and that minimum works: planned at it, the step is measured
    under it. ``optimizer_state="auto"`` moves state to host memory before it gives up, so its
    budget is below the parameters alone."""
    after_backward = MODES[mode]
    module, args, kwargs = _build("mlp")
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    optimizer = OPTIMIZERS["adamw"](module)
    # Parameters and AdamW's state alone take about 3x the parameters' bytes.
    budget = 3 * params if state == "device" else params // 2
    options = {"updates_after_backward": after_backward, "optimizer_state": state}
    with pytest.raises(memplan.InfeasibleBudgetError) as info:
        memplan.optimize(module, budget, optimizer=optimizer, example_inputs=args, **options)
    minimum = info.value.min_budget
    assert info.value.budget == budget < minimum
    assert f"({minimum} bytes)" in str(info.value)

    planned = _plan(module, minimum, optimizer, args, kwargs, **options)
    peaks = _steps(planned, optimizer, args, kwargs, steps=2)
    assert all(p <= minimum for p in peaks), (peaks, minimum)


class _NeedsSchedule(torch.optim.Optimizer):
    """A custom optimizer whose constructor needs an extra required argument."""

    def __init__(self, params, *, schedule, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.schedule = schedule

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.schedule(0))


UNPROBEABLE = {
    "LBFGS": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1),  # step() needs a closure
    "SparseAdam": lambda m: torch.optim.SparseAdam(list(m.parameters())),  # dense gradients refused
    "_NeedsSchedule": lambda m: _NeedsSchedule(m.parameters(), schedule=lambda step: 1.0),
}


@pytest.mark.parametrize("cls", list(UNPROBEABLE))
def test_an_optimizer_that_cannot_be_probed_gets_one_clear_error(cls):
    module, args, _ = _build("mlp")
    optimizer = UNPROBEABLE[cls](module)
    with pytest.raises(UnsupportedOptimizer, match=rf"memplan cannot learn what {cls} holds") as info:
        memplan.optimize(module, "1GB", optimizer=optimizer, example_inputs=args)
    assert isinstance(info.value, TypeError)
    # Nothing ran: the model's parameters hold no gradient, the optimizer no state.
    assert all(p.grad is None for p in module.parameters())
    assert not optimizer.state
