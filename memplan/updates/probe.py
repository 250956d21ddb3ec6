"""Learning what the optimizer's update costs per parameter (`learn_updates`): the state it keeps,
what it allocates while it runs and its time, from a fresh instance of the optimizer's own class
stepping two small parameters under the memory tracker, fitted as ``fixed + per_element * numel``;
and which optimizers memplan can plan (`check_optimizer`). The package docstring says how the
update sits in a plan and runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
    # seconds of its share of an update: its memory traffic at the device's bandwidth, or timed
    # (profile=True); the fixed cost of the optimizer call that updates its bucket is ``call_time``
    time: float
    grad_bytes: int = 0  # its gradient (parameter-shaped): what accumulating it holds between micro-steps
    # seconds to update it on the host instead: gradient and parameter copied out, the host
    # optimizer's traffic, the parameter copied back; off the compute stream, which spends only
    # ``host_launch`` seconds starting the copies out (`UpdateRunner._step_on_host`)
    host_time: float = 0.0
    host_launch: float = 0.0
    # One optimizer call's fixed seconds (its Python, hooks and per-call launches): paid once per
    # bucket (`memplan.updates.buckets`), on the device's host and on the host worker alike.
    call_time: float = 0.0
    # How one call's temporaries over a bucket add up (`bucket_temp_bytes`): the share of each
    # earlier parameter's still alive while a later one's peak (1 for ``foreach``, whose ops make
    # lists), and the share of the one just before it alone (a for-loop optimizer's last
    # ``denom``, held by its Python variable until the next parameter's is made); learned by
    # stepping two and three parameters in one call.
    temp_share: float = 1.0
    temp_carry: float = 0.0
    # The parameter itself lives in host memory (`memplan.passes.paging`): its host update steps it
    # there, with no copy of it out or back.
    paged: bool = False
    # Bytes of its fp32 master in host memory (`memplan.updates.master_weights`; 0: none)
    master_bytes: int = 0


@dataclass(frozen=True)
class UpdatePlacement:
    """Where a step's optimizer updates run and where their state lives: one point of what
    `memplan.pipeline.plan.make_plan` chooses among (and the user may fix)."""

    after_backward: bool = False  # every update waits for all gradients (else each for its own)
    host: frozenset[str] = frozenset()  # parameters whose state is in host memory, updated there
    accumulate_steps: int = 1  # micro-steps per update; > 1 holds an accumulated gradient each
    # A bucket of updates (one optimizer call, `memplan.updates.buckets`) holds at most this many
    # parameter bytes (one parameter always fits); 0: one call per parameter.
    bucket_bytes: int = 0
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
                 numels: tuple[int, ...], on_host: bool, repeats: int = 5) -> float:
    """Median seconds of one update of a fresh optimizer on parameters of ``numels`` elements in one
    call, their state made by a first update: on ``device`` as the planned backward runs a bucket
    (`UpdateRunner`), or ``on_host``, the step the host worker runs."""
    from memplan.measure.timing import median_seconds

    where = torch.device("cpu") if on_host else device
    ps = [nn.Parameter(torch.zeros(n, dtype=dtype, device=where)) for n in numels]
    grads = [torch.full_like(p, 1e-3) for p in ps]
    fresh = _make_like(optimizer, ps, group)
    runner = UpdateRunner(fresh, ps)
    runner.begin(frozenset())
    slots = tuple(range(len(ps)))

    def once() -> None:
        if on_host:
            for p, g in zip(ps, grads):
                p.grad = g
            fresh.step()
            for p in ps:
                p.grad = None
        else:
            runner(slots, grads)

    once()  # the state is made by the first update
    return median_seconds(once, where, repeats)


def _probe(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype, device: torch.device,
           numels: tuple[int, ...]) -> tuple[int, int]:
    """(state bytes, temporary bytes) of one update of a fresh optimizer on parameters of ``numels``
    elements in one call, run as the planned backward runs a bucket (`UpdateRunner`)."""
    ps = [nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) for n in numels]
    grads = [torch.full_like(p, 1e-3) for p in ps]
    fresh = _make_like(optimizer, ps, group)
    runner = UpdateRunner(fresh, ps)
    runner.begin(frozenset())
    with MemoryTracker(device, record_timeline=False, resident=[*ps, *grads]) as tracker:
        runner(tuple(range(len(ps))), grads)
    state = sum(t.untyped_storage().nbytes() for p in ps for t in fresh.state[p].values()
                if isinstance(t, torch.Tensor) and t.device == p.device)
    held = sum(t.untyped_storage().nbytes() for t in (*ps, *grads)) + state
    return state, max(0, tracker.peak - held)


def _temp_overlap(small: int, large: int, small_then_large: int, two_small_then_large: int) -> tuple[float, float]:
    """(share, carry) of `ParamUpdate`: how earlier parameters' temporaries outlive their update in
    one call, from a small parameter's temporaries alone (``small``), a large one's (``large``),
    and the peaks over a call on (small, large) and (small, small, large). The large one peaks
    last: (small, large) adds ``(carry + share) * small`` to ``large``, and (small, small, large)
    ``(carry + 2 * share) * small``. (0, 0) where the small one allocates nothing."""
    if small <= 0:
        return 0.0, 0.0
    one, two = (small_then_large - large) / small, (two_small_then_large - large) / small
    share = min(1.0, max(0.0, two - one))
    return share, min(1.0, max(0.0, one - share))


def bucket_temp_bytes(updates: list[ParamUpdate]) -> int:
    """Bytes one optimizer call over ``updates`` (a bucket, in its order) allocates while it runs: at
    each parameter's update, its own temporaries, the share of every earlier one's still alive
    (`ParamUpdate.temp_share`) and the share of the one just before (`ParamUpdate.temp_carry`)."""
    share = max((u.temp_share for u in updates), default=0.0)
    carry = max((u.temp_carry for u in updates), default=0.0)
    most, before, previous = 0.0, 0, 0
    for u in updates:
        most = max(most, u.temp_bytes + carry * previous + share * before)
        before += u.temp_bytes
        previous = u.temp_bytes
    return int(round(most))


def bucket_time(updates: list[ParamUpdate]) -> float:
    """Seconds of one optimizer call over ``updates`` on the device: one call's fixed cost and each
    parameter's share."""
    return max(u.call_time for u in updates) + sum(u.time for u in updates)


def host_bucket_time(updates: list[ParamUpdate]) -> float:
    """Seconds of one host update of ``updates``: their copies and host steps, one call's fixed cost."""
    return max(u.call_time for u in updates) + sum(u.host_time for u in updates)


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
    learned: dict[tuple, tuple[_Linear, _Linear, tuple[float, float]]] = {}
    timed: dict[tuple, tuple[_Linear, _Linear, float]] = {}
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
                    learned[key] = _learn_bytes(optimizer, group, p.dtype, device)
                state_fit, temp_fit, (share, carry) = learned[key]
                numel = p.numel()
                state, temp = state_fit.at(numel), temp_fit.at(numel)
                param_bytes = numel * p.element_size()
                # Read parameter, gradient and state; write parameter and state.
                moved = 3 * param_bytes + 2 * state
                if measure_times and p.device.type != "meta":
                    if key not in timed:
                        timed[key] = _learn_times(optimizer, group, p.dtype, device)
                    device_fit, host_fit, call = timed[key]
                    on_device, host_step = device_fit.seconds_at(numel) - call, host_fit.seconds_at(numel) - call
                else:
                    # The roofline's launch overhead is counted once per parameter, as each
                    # parameter's ops are; one call's Python is the profile's ``optimizer_call``.
                    on_device = profile.op_time(10.0 * numel, moved)
                    host_step = HOST_PROFILE.op_time(10.0 * numel, moved)
                    call = profile.optimizer_call
                # The gradient and the parameter copied out, the parameter copied back.
                on_host = profile.transfer_time(3 * param_bytes) + max(0.0, host_step)
                out.append(ParamUpdate(primal_of[names[id(p)]], names[id(p)], state, temp,
                                       max(0.0, on_device), param_bytes, on_host, 2 * profile.op_overhead,
                                       call_time=call, temp_share=share, temp_carry=carry))
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, numel_of: Callable[[nn.Parameter], int]) -> int:
    """The bytes of state ``optimizer`` keeps once it has stepped every parameter it holds (with a
    gradient), each parameter counted as ``numel_of(p)`` elements (a rank's local shard of a
    ``DTensor`` parameter), learned by the same probes as `learn_updates`."""
    held = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return sum(state_fit.at(numel_of(p)) for p, (state_fit, _, _) in _learned_per_param(optimizer, held))


def update_temp_bytes(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                      numel_of: Callable[[nn.Parameter], int]) -> int:
    """Bytes one call of ``optimizer`` over ``params`` alone allocates while it runs (`bucket_temp_bytes`),
    each parameter counted as ``numel_of(p)`` elements, learned by the same probes as `learn_updates`."""
    return bucket_temp_bytes([ParamUpdate(0, "", 0, temp_fit.at(numel_of(p)), 0.0, temp_share=share, temp_carry=carry)
                              for p, (_, temp_fit, (share, carry)) in _learned_per_param(optimizer, params)])


def _learned_per_param(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
                       ) -> list[tuple[nn.Parameter, tuple[_Linear, _Linear, tuple[float, float]]]]:
    """Each of ``params`` that ``optimizer`` holds, with what `_learn_bytes` learns for its group, dtype
    and device (probed once for each)."""
    group_of = {id(p): (gi, g) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    learned: dict[tuple, tuple[_Linear, _Linear, tuple[float, float]]] = {}
    out = []
    with unmeasured():
        for p in params:
            if id(p) not in group_of:
                continue
            gi, group = group_of[id(p)]
            key = (gi, p.dtype, p.device)
            if key not in learned:
                learned[key] = _learn_bytes(optimizer, group, p.dtype, p.device)
            out.append((p, learned[key]))
    return out


def _learn_bytes(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype,
                 device: torch.device) -> tuple[_Linear, _Linear, tuple[float, float]]:
    """State and temporary bytes of one parameter's update as ``fixed + per_element * numel``, and how
    a bucket's temporaries add up (`ParamUpdate.temp_share`, ``temp_carry``), from probes on small
    parameters."""
    n1, n2 = TUNABLES.probe_numels
    try:
        (s1, t1), (s2, t2) = (_probe(optimizer, group, dtype, device, (n,)) for n in (n1, n2))
        _, pair = _probe(optimizer, group, dtype, device, (n1, n2))
        _, triple = _probe(optimizer, group, dtype, device, (n1, n1, n2))
    except Exception as exc:  # the optimizer's own error says what it needs
        raise UnsupportedOptimizer(
            f"memplan cannot learn what {type(optimizer).__name__} holds and allocates: stepping a "
            f"fresh instance on a small parameter failed ({type(exc).__name__}: {exc}). "
            "memplan.optimize(..., optimizer=) needs an optimizer whose class can be built over "
            "new parameters with its param group's hyperparameters and stepped."
        ) from exc
    return _fit([(n1, s1), (n2, s2)]), _fit([(n1, t1), (n2, t2)]), _temp_overlap(t1, t2, pair, triple)


def _learn_times(optimizer: torch.optim.Optimizer, group: dict, dtype: torch.dtype,
                 device: torch.device) -> tuple[_Linear, _Linear, float]:
    """One parameter's update time on the device and on the host as ``fixed + per_element * numel``,
    and one call's fixed seconds: what two parameters updated in one call on the device save over
    two calls (at most the device fit's fixed part)."""
    n1, n2 = TUNABLES.timing_numels
    t1, t2 = (_time_update(optimizer, group, dtype, device, (n,), False) for n in (n1, n2))
    on_device = _fit([(n1, t1), (n2, t2)])
    on_host = _fit([(n, _time_update(optimizer, group, dtype, device, (n,), True)) for n in (n1, n2)])
    call = max(0.0, t1 + t2 - _time_update(optimizer, group, dtype, device, (n1, n2), False))
    return on_device, on_host, min(call, max(0.0, on_device.fixed))


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


def held_after_backward(updates: list[ParamUpdate], host: frozenset[str]) -> int:
    """Bytes the device holds at once when backward ends with every update after it: each updated
    parameter (as large as its gradient), its gradient, and its optimizer state unless in ``host``."""
    return sum(2 * u.grad_bytes + (0 if u.name in host else u.state_bytes) for u in updates)


def most_bucket_temp_bytes(updates: list[ParamUpdate], cap: int) -> int:
    """About the most temporaries one bucket of ``updates`` at ``cap`` holds (`bucket_temp_bytes` adds
    up each member's at most, and members' temporaries grow with their size): the largest members'
    until their gradients reach the cap, the one that crosses it included (one member at cap 0)."""
    total = filled = 0
    for u in sorted(updates, key=lambda u: -u.temp_bytes):
        total += u.temp_bytes
        filled += u.grad_bytes
        if filled >= cap:
            break
    return total


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
