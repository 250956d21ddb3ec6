"""The optimizer's update inside the plan: what it holds, what it allocates, and how it runs.

With ``memplan.optimize(model, budget, optimizer=opt)`` the budget covers the
whole training step, forward through the last parameter update, and memplan
applies the update itself, inside backward. That takes three things, each
here:

* **What the update costs** (`learn_updates`): per parameter, the bytes of
  optimizer state the optimizer keeps for it, the bytes its update
  allocates while it runs, and a time (a roofline, or timed with ``profile=True``). They are learned, not
  looked up: a fresh instance of the optimizer's own class with the
  parameter group's hyperparameters steps two small parameters of the same
  dtype and device under `memplan.measure.tracker.MemoryTracker`, and the bytes
  are fitted as ``fixed + per_element * numel`` (so a 1.3B-parameter model
  is costed without allocating it). Any ``torch.optim`` optimizer, and any
  other with the same interface, is learned the same way; one that cannot be
  stepped so raises `UnsupportedOptimizer` naming it.
* **Where the update sits in the plan** (`memplan.planning.lowering.lower`): each
  parameter's state is a source (resident for the whole step, as it is
  across steps), and its update is a value that reads the parameter's
  gradient, so the gradient is freed once it has been applied: as soon as
  it is final, in the Problem's order. The update writes the parameter in
  place, so no computation may read the parameter after it; a schedule that
  places one too early (a backward op or a recomputation still reads the
  weight) gets it moved after that read (`solvers.transforms.ordering`).
  Where that puts the plan over the budget, every update waits instead for
  all gradients of the step (``GRADS_FINAL``), as ``optimizer.step()``
  after ``backward()`` would.
* **How it runs** (`UpdateRunner`): the backward segment calls it at the
  update's place in the schedule with the gradient; it runs the user's own
  optimizer on that one parameter (its ``param_groups`` read at that moment,
  so an LR scheduler or ``add_param_group`` takes effect) and drops the
  gradient.

The training-loop contract: ``loss.backward()`` updates the parameters the
optimizer holds and leaves their ``.grad`` at ``None``; ``optimizer.step()``
and ``optimizer.zero_grad()`` then find no gradients and change nothing, so
the usual loop gives the parameters eager PyTorch gives. With
``grad_norm=True`` the L2 norm of the gradients applied in the last step is
kept (`UpdateRunner.grad_norm`, ``OptimizedModule.grad_norm``) for logging;
it costs one device scalar that the plan does not count. Step hooks
registered on the optimizer run once per parameter. ``max_grad_norm=`` clips
exactly as ``torch.nn.utils.clip_grad_norm_`` over the gradients the optimizer
applies: the global norm needs every gradient, so the updates then wait for
the end of backward (`UpdateRunner.clip` runs at ``GRADS_FINAL``).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from memplan.costs.cost_model import PROFILES, DeviceProfile
from memplan.core.host import host_storage, is_host
from memplan.measure.tracker import MemoryTracker, unmeasured
from memplan.ops.transfer import HostCopy, copy_back, offload_tensor, wait_host_copy
from memplan.core.config import TUNABLES

STATE_PREFIX = "optstate:"  # a parameter's optimizer state on the device: a source of the Problem
ACCUM_PREFIX = "accum:"  # a parameter's accumulated gradient (accumulate_steps > 1): a source too
UPDATE_PREFIX = "update:"  # applying the optimizer to one parameter (its temporaries are the value)
UPDATED_SUFFIX = "@updated"  # the update's result: a zero-byte sink, so every update runs
GRADS_FINAL = "__grads_final__"  # every gradient of the step is final: updates may start
# Clipping by a first backward pass (``UpdatePlacement.norm_pass``), as LOMO does: its values are
# the backward's again under this prefix, each gradient's square is added up at ``SQUARE_PREFIX``,
# and the updates of the second pass wait for ``NORM_FINAL``.
NORM_PASS_PREFIX = "normpass:"
SQUARE_PREFIX = "square:"
NORM_FINAL = "__grad_norm__"



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


@dataclass
class Accumulation:
    """Gradient accumulation over ``steps`` micro-steps (``optimize(..., accumulate_steps=k)``):
    the optimizer updates at the last backward of every ``steps``; the earlier ones add their
    gradients into ``.grad``, as eager autograd does. Shared by every plan of one module, so
    that the count runs across input signatures."""

    steps: int = 1
    done: int = 0  # backward passes of the current cycle already finished

    @property
    def final(self) -> bool:
        """Whether the backward running now is the one that updates."""
        return self.done + 1 >= self.steps

    def advance(self) -> None:
        self.done = 0 if self.final else self.done + 1


class UpdateRunner(nn.Module):
    """Applies the user's optimizer to one parameter at a time, from inside the planned backward.

    With ``max_norm`` the backward calls `clip` first, at ``GRADS_FINAL``, with every gradient.
    ``host_slots``: the parameters whose optimizer state lives in host memory; their update runs
    there (gradient and parameter copied out, the parameter copied back), ZeRO-Offload style.
    ``accumulation``: update only at the last of its micro-steps (`Accumulation`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], track_norm: bool = False,
                 max_norm: float | None = None, host_slots: frozenset[int] = frozenset(),
                 accumulation: Accumulation | None = None) -> None:
        super().__init__()
        self.optimizer = optimizer
        object.__setattr__(self, "params", params)  # not registered: the model owns them
        self.track_norm = track_norm or max_norm is not None
        self.max_norm = max_norm
        self.host_slots = host_slots
        self.accumulation = accumulation or Accumulation()
        self._clip_coef: torch.Tensor | None = None
        self._totals: dict[int, torch.Tensor] = {}  # accumulated gradients `clip` folded in already
        self.skipped: frozenset[int] = frozenset()
        self._square_sum: torch.Tensor | None = None
        self._group_of: dict[int, int] = {}
        self.grad_norm: torch.Tensor | None = None
        self._host_updates = HostUpdates()

    def begin(self, skipped: frozenset[int]) -> None:
        """A step starts; the slots in ``skipped`` get no gradient in it (eager autograd leaves
        their ``.grad`` at None, and the optimizer skips them). The groups are read now: an
        ``add_param_group`` since the last step takes effect."""
        self._host_updates.join()  # a backward that raised may have left some in flight
        self.skipped = skipped
        self._square_sum = None
        self._clip_coef = None
        self._totals = {}
        self._group_of = {id(p): gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}

    def place_state(self) -> None:
        """Move each parameter's optimizer state to the memory this plan keeps it in.

        ``optimizer.load_state_dict`` casts all state to its parameter's device, and another
        input signature's plan may have placed a parameter's state elsewhere: either would break
        this plan's budget, so the placement is restored before each step's forward (a check
        per parameter when nothing moved)."""
        state = self.optimizer.state
        for slot, p in enumerate(self.params):
            held = state.get(p)
            if not held:
                continue
            on_host = slot in self.host_slots
            for key, value in list(held.items()):
                if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                    continue
                if on_host and not _in_host_memory(value, p):
                    held[key] = _to_host(value)
                elif not on_host and _in_host_memory(value, p) and value.shape == p.shape:
                    # Per-element state only: scalars such as Adam's ``step`` stay where the
                    # optimizer itself keeps them (on the CPU unless capturable or fused).
                    held[key] = value.to(p.device, copy=True)

    def finish(self) -> None:
        """The step's updates are done: with ``track_norm``, `grad_norm` is the norm of the gradients
        (before clipping, as ``clip_grad_norm_`` returns it). Host updates still in flight are
        joined first: the parameters are final when backward returns."""
        self._host_updates.join()
        if self.track_norm and self.max_norm is None and self.accumulation.final:
            self.grad_norm = None if self._square_sum is None else self._square_sum.sqrt()
        self._square_sum = None
        self._clip_coef = None
        self.accumulation.advance()

    def _add_square(self, grad: torch.Tensor) -> None:
        """Add the squared L2 norm of ``grad`` to the step's running sum (one device scalar)."""
        square = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).square()
        self._square_sum = square if self._square_sum is None else self._square_sum.add_(square)

    def _accumulated(self, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` added into the parameter's ``.grad`` as eager autograd accumulates it. At the
        updating micro-step the sum is handed back (and ``.grad`` left at None); before it, the
        sum stays in ``.grad`` and None is returned (nothing to update yet)."""
        p = self.params[slot]
        with torch.no_grad():
            if p.grad is None:
                # Keep the gradient itself where its layout is the parameter's, as AccumulateGrad does.
                p.grad = grad if grad.stride() == p.stride() else torch.empty_like(p).copy_(grad)
            else:
                p.grad.add_(grad)
        if not self.accumulation.final:
            return None
        total, p.grad = p.grad, None
        return total

    def add_norm_square(self, slot: int, grad: torch.Tensor) -> None:
        """First backward pass of a norm-pass clip: add this gradient's square to the norm (it is
        dropped afterwards; the second pass computes it again to apply it)."""
        if slot not in self.skipped:
            self._add_square(grad)

    def clip_by_norm(self) -> None:
        """End of the first pass: the global norm is known; the second pass's updates clip by it."""
        if self._square_sum is None:
            return
        total = self._square_sum.sqrt()
        self._square_sum = None
        self.grad_norm = total
        self._clip_coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)

    def clip(self, grads: list[torch.Tensor | None]) -> None:
        """With ``max_norm``: every gradient of the step is final; scale them all, in place, as
        ``torch.nn.utils.clip_grad_norm_`` does, before the first update (an exact clip needs
        the norm of all of them). ``grads`` are per slot; skipped slots are left out. With
        accumulation, the norm is that of the accumulated gradients, at the updating micro-step."""
        if not self.accumulation.final:
            return
        held = [slot for slot, p in enumerate(self.params) if p.grad is not None]
        if self.accumulation.steps > 1 or held:
            self._totals = {slot: self._accumulated(slot, grad) for slot, grad in enumerate(grads)
                            if slot not in self.skipped and grad is not None}
            grads = [self._totals.get(slot) for slot in range(len(grads))]
        for slot, grad in enumerate(grads):
            if slot not in self.skipped and grad is not None:
                self._add_square(grad)
        self.clip_by_norm()

    def forward(self, slot: int, grad: torch.Tensor) -> None:
        if slot in self.skipped:
            return
        p = self.params[slot]
        # With accumulation, or a step that started with gradients held in .grad (eager would
        # step with their sum), the gradient is added into .grad first.
        if self.accumulation.steps > 1 or p.grad is not None or slot in self._totals:
            if slot in self._totals:  # folded in already, by `clip`
                grad = self._totals.pop(slot)
            else:
                total = self._accumulated(slot, grad)
                if total is None:
                    return
                grad = total
        if self._clip_coef is not None:
            grad = grad.mul_(self._clip_coef.to(grad.dtype))
        elif self.track_norm:
            self._add_square(grad)
        if slot in self.host_slots:
            self._step_on_host(p, grad)
        else:
            self._step(p, grad)

    def _step(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Step the optimizer on ``p`` alone, with ``grad``; its group's hyperparameters, read now.
        (A host update steps a view of the optimizer instead, on another thread: `_host_view`.)"""
        groups = self.optimizer.param_groups
        held = [g["params"] for g in groups]
        own = self._group_of.get(id(p))
        p.grad = grad
        try:
            # Only this parameter's group sees it: the others step over nothing.
            for gi, g in enumerate(groups):
                g["params"] = [p] if gi == own else []
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, held):
                g["params"] = ps
            p.grad = None

    def _step_on_host(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Update ``p`` with its state in host memory, overlapped with the rest of backward as
        ZeRO-Offload overlaps it: the gradient and the parameter start copying out now (CUDA:
        on the device-to-host stream), and the host step and the copy back run on a worker
        thread (`HostUpdates`), which `finish` joins. The step runs on a host copy of the
        parameter under its key in ``optimizer.state`` for the moment, so the optimizer finds
        and creates the state there, through `_host_view` of the optimizer."""
        grad_out = offload_tensor(grad.detach())
        param_out = offload_tensor(p.detach())
        view = self._host_view()  # the groups' hyperparameters as they are now
        own = self._group_of.get(id(p))
        self._host_updates.submit(self._host_step, p, view, own, param_out, grad_out)

    def _host_view(self) -> torch.optim.Optimizer:
        """The user's optimizer with groups of its own, holding no parameters; its state,
        defaults and hooks are the optimizer's. A host step on the worker thread steps this
        view, so it never sees the groups a device step on the backward thread swaps at the same
        time (`_step`)."""
        view = object.__new__(type(self.optimizer))
        view.__dict__.update(self.optimizer.__dict__)
        # An LR scheduler wraps ``step`` on the instance, bound to the real optimizer (and its
        # groups): the view steps through its class's ``step`` instead.
        view.__dict__.pop("step", None)
        view.param_groups = [{**g, "params": []} for g in self.optimizer.param_groups]
        return view

    def _host_step(self, p: nn.Parameter, view: torch.optim.Optimizer, group: int | None, param_out: HostCopy,
                   grad_out: HostCopy) -> Any:
        """On the worker thread: one host update, then the parameter's copy back; returns the
        event compute waits for before reading ``p`` again (`transfer.copy_back`)."""
        state = self.optimizer.state
        with host_storage(), torch.no_grad():
            work = wait_host_copy(param_out)
            work.grad = wait_host_copy(grad_out)
            if group is not None:
                view.param_groups[group]["params"] = [work]
            if p in state:
                state[work] = state.pop(p)
            try:
                view.step()
            finally:
                if work in state:
                    state[p] = state.pop(work)
                work.grad = None
        with torch.no_grad():
            return copy_back(p.detach(), work)


class HostUpdates:
    """Host updates in flight: one worker thread runs them in order (so a parameter's updates
    never race), and `join` waits for all of them and orders the compute stream after their
    copies back. Torch's CPU kernels release the GIL, so the host work overlaps the backward
    that the calling thread goes on launching."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def __getstate__(self) -> dict:  # a copy of the module (deepcopy, pickle) starts with none in flight
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def submit(self, fn: Any, *args: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memplan-host-update")
        self._pending.append(self._pool.submit(fn, *args))

    def join(self) -> None:
        """Every update submitted has been applied, and the device reads the parameters after
        their copies back (an error in one is raised here, after all have ended)."""
        pending, self._pending = self._pending, []
        wait(pending)
        for future in pending:
            landed = future.result()
            if landed is not None:
                torch.cuda.current_stream().wait_event(landed)


def _in_host_memory(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether optimizer state ``t`` of parameter ``p`` is in host memory: on the CPU beside a
    device parameter, or (a CPU "device", in tests) in a storage marked as host."""
    return (t.device.type == "cpu" and p.device.type != "cpu") or is_host(t)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned beside a CUDA device), complete on return."""
    return wait_host_copy(offload_tensor(t))


class GradClip(nn.Module):
    """The calls the backward segment makes when the step clips: at ``GRADS_FINAL`` with every
    gradient (`UpdateRunner.clip`); or, with a norm pass, each first-pass gradient's square
    (`square`) and the clip factor at ``NORM_FINAL`` (`UpdateRunner.clip_by_norm`)."""

    def __init__(self, runner: UpdateRunner) -> None:
        super().__init__()
        self.runner = runner

    def forward(self, grads: list[torch.Tensor]) -> None:
        self.runner.clip(grads)

    def square(self, slot: int, grad: torch.Tensor) -> None:
        self.runner.add_norm_square(slot, grad)

    def by_norm(self) -> None:
        self.runner.clip_by_norm()
