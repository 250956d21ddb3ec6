"""Learning what the optimizer's update costs per parameter (`learn_updates`): the state it keeps,
what it allocates while it runs and its time, from a fresh instance of the optimizer's own class
stepping two small parameters under the memory tracker, fitted as ``fixed + per_element * numel``;
and which optimizers memplan can plan (`check_optimizer`). The package docstring says how the
update sits in a plan and runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from memplan.costs.cost_model import PROFILES, DeviceProfile
from memplan.measure.tracker import MemoryTracker, unmeasured
from memplan.core.config import TUNABLES
from memplan.updates.runner import UpdateRunner



class UnsupportedOptimizer(TypeError):
    """The optimizer cannot be learned by stepping a fresh instance of its class."""


@dataclass(frozen=True)
class ParamUpdate:
    """What updating one parameter holds and costs."""

    primal: int  # index among the capture's primals
    name: str  # the parameter's name in the model
    state_bytes: int  # optimizer state kept for it, on its device
    temp_bytes: int  # allocated while its update runs, freed when it ends
    time: float  # seconds: the update's memory traffic at the device's bandwidth, or timed (profile=True)
    grad_bytes: int = 0  # its gradient (parameter-shaped): what accumulating it holds between micro-steps
    # seconds to update it on the host instead: gradient and parameter copied out, the host
    # optimizer's traffic, the parameter copied back; off the compute stream, which spends only
    # ``host_launch`` seconds starting the copies out (`UpdateRunner._step_on_host`)
    host_time: float = 0.0
    host_launch: float = 0.0


@dataclass(frozen=True)
class UpdatePlacement:
    """Where a step's optimizer updates run and where their state lives: one point of what
    `memplan.pipeline.plan.make_plan` chooses among (and the user may fix)."""

    after_backward: bool = False  # every update waits for all gradients (else each for its own)
    host: frozenset[str] = frozenset()  # parameters whose state is in host memory, updated there
    accumulate_steps: int = 1  # micro-steps per update; > 1 holds an accumulated gradient each
    # Clipping (max_grad_norm=) without holding every gradient: a first backward pass computes the
    # global norm only, freeing each gradient once its square is added; the second pass applies
    # the clipped updates as each gradient is final (LOMO). Without it, clipping holds the gradients
    # to the end of backward (after_backward).
    norm_pass: bool = False


@dataclass(frozen=True)
class _Linear:
    fixed: float
    per_element: float

    def at(self, numel: int) -> int:
        return max(0, int(round(self.fixed + self.per_element * numel)))

    def seconds_at(self, numel: int) -> float:
        return max(0.0, self.fixed + self.per_element * numel)


def _fit(points: list[tuple[int, float]]) -> _Linear:
    (n1, y1), (n2, y2) = points
    slope = (y2 - y1) / (n2 - n1)
    return _Linear(y1 - slope * n1, slope)


def _make_like(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], group: dict) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class over ``params``, with ``group``'s hyperparameters."""
    cls = type(optimizer)
    try:
        fresh = cls(params, **getattr(optimizer, "defaults", {}))
    except TypeError:
        fresh = cls(params)
    fresh.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
    return fresh


def _time_update(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype, device: torch.device,
                 numel: int, on_host: bool, repeats: int = 5) -> float:
    """Median seconds of one update of a fresh optimizer on a parameter of ``numel`` elements, its
    state made by a first update: on ``device`` as the planned backward runs it (`UpdateRunner`,
    one optimizer call for the parameter), or ``on_host``, the step the host worker runs."""
    from memplan.measure.timing import median_seconds

    where = torch.device("cpu") if on_host else device
    p = nn.Parameter(torch.zeros(numel, dtype=dtype, device=where))
    grad = torch.full_like(p, 1e-3)
    fresh = _make_like(optimizer, [p], group)
    runner = UpdateRunner(fresh, [p])
    runner.begin(frozenset())

    def once() -> None:
        if on_host:
            p.grad = grad
            fresh.step()
            p.grad = None
        else:
            runner(0, grad)

    once()  # the state is made by the first update
    return median_seconds(once, where, repeats)


def _probe(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype, device: torch.device,
           numel: int) -> tuple[int, int]:
    """(state bytes, temporary bytes) of one update of a fresh optimizer on a parameter of ``numel``
    elements, run as the planned backward runs it (`UpdateRunner`)."""
    p = nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))
    p.grad = torch.full_like(p, 1e-3)
    fresh = _make_like(optimizer, [p], group)
    runner = UpdateRunner(fresh, [p])
    runner.begin(frozenset())
    grad = p.grad
    with MemoryTracker(device, record_timeline=False, resident=[p, grad]) as tracker:
        runner(0, grad)
    state = sum(t.untyped_storage().nbytes() for t in fresh.state[p].values()
                if isinstance(t, torch.Tensor) and t.device == p.device)
    held = p.untyped_storage().nbytes() + grad.untyped_storage().nbytes() + state
    return state, max(0, tracker.peak - held)


def learn_updates(optimizer: torch.optim.Optimizer, model: nn.Module, primal_names: list[str],
                  profile: DeviceProfile, measure_times: bool = False) -> list[ParamUpdate]:
    """Per parameter the optimizer updates: its state and temporary bytes, and its update time.

    ``primal_names``: the capture's primal names (parameters first, by name). ``measure_times``
    (``profile=True``): the update's time on the device and on the host are measured, by timing the
    optimizer's own class on two parameters per (group, dtype, device) (`TUNABLES.timing_numels`) and fitting
    ``fixed + per_element * numel`` as for the bytes; else the update's memory traffic at the
    profile's bandwidth (the device's, and `HOST_PROFILE`'s for the host), which leaves out the cost
    of one optimizer call per parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    primal_of = {n: i for i, n in enumerate(primal_names)}
    learned: dict[tuple, tuple[_Linear, _Linear]] = {}
    timed: dict[tuple, tuple[_Linear, _Linear]] = {}
    out: list[ParamUpdate] = []
    with unmeasured():
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if not p.requires_grad or names.get(id(p)) not in primal_of:
                    continue
                # A model built on the meta device is costed by probes on the CPU.
                device = torch.device("cpu") if p.device.type == "meta" else p.device
                key = (gi, p.dtype, device)
                if key not in learned:
                    try:
                        points = [_probe(optimizer, group, p.dtype, device, n) for n in TUNABLES.probe_numels]
                    except Exception as exc:  # the optimizer's own error says what it needs
                        raise UnsupportedOptimizer(
                            f"memplan cannot learn what {type(optimizer).__name__} holds and allocates: stepping a "
                            f"fresh instance on a small parameter failed ({type(exc).__name__}: {exc}). "
                            "memplan.optimize(..., optimizer=) needs an optimizer whose class can be built over "
                            "new parameters with its param group's hyperparameters and stepped."
                        ) from exc
                    learned[key] = (_fit([(n, s) for n, (s, _) in zip(TUNABLES.probe_numels, points)]),
                                    _fit([(n, t) for n, (_, t) in zip(TUNABLES.probe_numels, points)]))
                state_fit, temp_fit = learned[key]
                numel = p.numel()
                state, temp = state_fit.at(numel), temp_fit.at(numel)
                param_bytes = numel * p.element_size()
                # Read parameter, gradient and state; write parameter and state.
                moved = 3 * param_bytes + 2 * state
                if measure_times and p.device.type != "meta":
                    if key not in timed:
                        timed[key] = tuple(  # type: ignore[assignment]
                            _fit([(n, _time_update(optimizer, group, p.dtype, device, n, on_host))
                                  for n in TUNABLES.timing_numels])
                            for on_host in (False, True))
                    device_fit, host_fit = timed[key]
                    on_device, host_step = device_fit.seconds_at(numel), host_fit.seconds_at(numel)
                else:
                    on_device = profile.op_time(10.0 * numel, moved)
                    host_step = HOST_PROFILE.op_time(10.0 * numel, moved)
                # The gradient and the parameter copied out, the parameter copied back.
                on_host = profile.transfer_time(3 * param_bytes) + host_step
                out.append(ParamUpdate(primal_of[names[id(p)]], names[id(p)], state, temp,
                                       on_device, param_bytes, on_host, 2 * profile.op_overhead))
    return out


# The host's throughput for updates computed there (optimizer_state="host") where they are not
# timed (`learn_updates`' ``measure_times``, which ``profile=True`` turns on).
HOST_PROFILE = PROFILES["cpu"]


def host_updates(updates: list[ParamUpdate], need: int) -> frozenset[str]:
    """The parameters whose optimizer state moves to host memory to free at least ``need`` bytes
    of the device (all of them if that is not enough).

    The state is resident all step, so each byte moved lowers the whole-step peak by a byte at
    every moment, and a host update's time grows with the parameter's size, as the bytes do:
    taking the largest states first moves the fewest parameters for the bytes."""
    chosen: list[str] = []
    freed = 0
    for u in sorted(updates, key=lambda u: (-u.state_bytes, u.name)):
        if freed >= need:
            break
        if u.state_bytes > 0:
            chosen.append(u.name)
            freed += u.state_bytes
    return frozenset(chosen)


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    """Raise a clear error when ``optimizer`` is not an optimizer over ``model``'s parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"memplan.optimize(optimizer=...) takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    own = {id(p) for p in model.parameters()}
    foreign = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in own]
    if foreign:
        raise ValueError(
            f"memplan.optimize(optimizer=...): {len(foreign)} of the optimizer's parameters are not parameters of "
            "the model being optimized; build the optimizer over model.parameters() (the same tensors memplan "
            "wraps)"
        )
