"""Running the optimizer's update inside the planned backward: one parameter at a time as its gradient
is final (`UpdateRunner`), state kept in host memory updated on a host thread (`HostUpdates`),
gradient clipping (`GradClip`), and accumulation over micro-steps (`Accumulation`)."""
from __future__ import annotations

import contextlib
import itertools
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
import torch
import torch.nn as nn
from memplan.core.host import host_storage, is_host, mark_host
from memplan.ops.transfer import HostCopy, copy_back, offload_tensor, wait_host_copy
from memplan.updates.host_state import in_host_memory, state_under, to_host
from memplan.updates.master_weights import keep_master, master_of


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
        """Whether the backward running now (or next) is the one that updates."""
        return self.done + 1 >= self.steps

    def advance(self) -> None:
        self.done = 0 if self.final else self.done + 1


class UpdateRunner(nn.Module):
    """Applies the user's optimizer to one parameter at a time, from inside the planned backward.

    With ``max_norm`` the backward calls `clip` first, at ``GRADS_FINAL``, with every gradient.
    ``host_slots``: the parameters whose optimizer state lives in host memory; their update runs
    there (gradient and parameter copied out, the parameter copied back), ZeRO-Offload style.
    ``accumulation``: update only at the last of its micro-steps (`Accumulation`).
    ``reduced_in_grad``: a distributed engine reduced the gradients into the parameters' ``.grad``
    (`memplan.runtime.handout`): each update steps with that gradient, not the one the backward
    computed, and clears ``.grad`` after it, as the step owns the gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], track_norm: bool = False,
                 max_norm: float | None = None, host_slots: frozenset[int] = frozenset(),
                 accumulation: Accumulation | None = None, reduced_in_grad: bool = False) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.reduced_in_grad = reduced_in_grad
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
        self._token = next(_RUNNER_TOKENS)  # names this runner in an optimizer's `_PlacementMark`
        self._states_at_begin = 0

    def __setstate__(self, state: dict) -> None:  # a copy (deepcopy, pickle) places its state itself
        super().__setstate__(state)
        self._token = next(_RUNNER_TOKENS)

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
        self._states_at_begin = len(self.optimizer.state)

    def place_state(self) -> None:
        """Move each parameter's optimizer state to the memory this plan keeps it in.

        ``optimizer.load_state_dict`` casts all state to its parameter's device, and another
        input signature's plan may have placed a parameter's state elsewhere: either would break
        this plan's budget, so the placement is restored before a step's forward when one of them
        may have happened since this runner last placed it: a ``load_state_dict`` (a post-hook
        forgets the placement, `_PlacementMark`), another runner's placement, or a step that made
        new state (the optimizer makes some of it, such as Adam's ``step``, where it keeps scalars
        rather than where the update runs). Otherwise it costs one comparison."""
        mark = _placement_mark(self.optimizer)
        if mark.runner == self._token:
            return
        state = self.optimizer.state
        for slot, p in enumerate(self.params):
            held = state.get(p)
            if not held:
                continue
            on_host = slot in self.host_slots
            for key, value in list(held.items()):
                if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                    continue
                if on_host and is_host(p) and value.device == p.device and not is_host(value):
                    # Cast to a paged parameter's device (a loaded state dict): host memory already
                    # (on the CPU, where host memory is simulated, its storage is marked so).
                    mark_host(value)
                elif on_host and not in_host_memory(value, p):
                    held[key] = to_host(value)
                elif not on_host and in_host_memory(value, p) and value.shape == p.shape:
                    # Per-element state only: scalars such as Adam's ``step`` stay where the
                    # optimizer itself keeps them (on the CPU unless capturable or fused).
                    held[key] = value.to(p.device, copy=True)
        mark.runner = self._token

    def finish(self) -> None:
        """The step's updates are done: with ``track_norm``, `grad_norm` is the norm of the gradients
        (before clipping, as ``clip_grad_norm_`` returns it). Host updates still in flight are
        joined first: the parameters are final when backward returns."""
        self._host_updates.join()
        if len(self.optimizer.state) != self._states_at_begin:
            # State made by this step's updates (the first): placed before the next step, as the
            # optimizer may make some of it where it keeps scalars rather than where it updates.
            _placement_mark(self.optimizer).runner = None
        if self.track_norm and self.max_norm is None and self.accumulation.final:
            self.grad_norm = None if self._square_sum is None else self._square_sum.sqrt()
        self._square_sum = None
        self._clip_coef = None
        self.accumulation.advance()

    def _add_squares(self, grads: list[torch.Tensor]) -> None:
        """Add the squared L2 norms of ``grads`` to the step's running sum (one device scalar), with
        one ``foreach`` norm per bucket (and per dtype) rather than a norm per gradient."""
        if not grads:
            return
        norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
        square = torch.stack(norms).square().sum()
        self._square_sum = square if self._square_sum is None else self._square_sum.add_(square)

    def _accumulated(self, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` added into the parameter's ``.grad`` as eager autograd accumulates it. At the
        updating micro-step the sum is handed back (and ``.grad`` left at None); before it, the
        sum stays in ``.grad`` and None is returned (nothing to update yet)."""
        p = self.params[slot]
        paged = is_host(p)  # a paged parameter's sum is held beside it, in host memory (`memplan.passes.paging`)
        if paged:
            grad = wait_host_copy(offload_tensor(grad.detach()))
        with torch.no_grad(), host_storage() if paged else contextlib.nullcontext():
            if p.grad is None:
                # Keep the gradient itself where its layout is the parameter's, as AccumulateGrad does.
                p.grad = grad if grad.stride() == p.stride() else torch.empty_like(p).copy_(grad)
            else:
                p.grad.add_(grad)
        if not self.accumulation.final:
            return None
        total, p.grad = p.grad, None
        return total

    def add_norm_squares(self, slots: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        """First backward pass of a norm-pass clip: add a bucket's gradients' squares to the norm
        (they are dropped afterwards; the second pass computes them again to apply them)."""
        self._add_squares([g for slot, g in zip(slots, grads) if slot not in self.skipped])

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
        if self.reduced_in_grad:  # the engine's reduced gradients: their norm is the global one
            grads = [p.grad for p in self.params]
            if any(g is None for slot, g in enumerate(grads) if slot not in self.skipped):
                raise RuntimeError("memplan runtime: clipping ran before the engine reduced every gradient")
        held = [slot for slot, p in enumerate(self.params) if p.grad is not None and not self.reduced_in_grad]
        # (the engine's reduced gradients are the accumulated sums already: nothing to fold in)
        if not self.reduced_in_grad and (self.accumulation.steps > 1 or held):
            self._totals = {slot: self._accumulated(slot, grad) for slot, grad in enumerate(grads)
                            if slot not in self.skipped and grad is not None}
            grads = [self._totals.get(slot) for slot in range(len(grads))]
        self._add_squares([g for slot, g in enumerate(grads) if slot not in self.skipped and g is not None])
        self.clip_by_norm()

    def forward(self, slots: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        """Update one bucket (`memplan.updates.buckets`): the parameters in ``slots``, whose gradients
        ``grads`` are final, by one call of the optimizer (on the host for a bucket of host slots)."""
        params: list[nn.Parameter] = []
        final: list[torch.Tensor] = []
        if self.reduced_in_grad:
            if not self.accumulation.final:
                return  # the engine added this micro-step's gradients into .grad: the last reduces the sums
            grads = [self._reduced(slot) for slot in slots]
        for slot, grad in zip(slots, grads):
            grad = grad if self.reduced_in_grad else self._applied(slot, grad)
            if grad is not None:
                params.append(self.params[slot])
                final.append(grad)
        if not params:
            return
        if self._clip_coef is not None:
            torch._foreach_mul_(final, self._clip_coef)
        elif self.track_norm:
            self._add_squares(final)
        if slots[0] in self.host_slots:
            self._step_on_host(params, final)
        else:
            self._step(params, final)

    def _reduced(self, slot: int) -> torch.Tensor | None:
        """The reduced gradient of ``slot`` (``reduced_in_grad``), taken out of ``.grad``."""
        p = self.params[slot]
        grad, p.grad = p.grad, None
        if grad is None and slot not in self.skipped:
            raise RuntimeError("memplan runtime: an update ran before the engine reduced its parameter's gradient")
        return None if slot in self.skipped else grad

    def _applied(self, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient the update of ``slot`` applies this step, or None when it updates nothing."""
        if slot in self.skipped:
            return None
        # With accumulation, or a step that started with gradients held in .grad (eager would
        # step with their sum), the gradient is added into .grad first.
        if self.accumulation.steps > 1 or self.params[slot].grad is not None or slot in self._totals:
            if slot in self._totals:  # folded in already, by `clip`
                return self._totals.pop(slot)
            return self._accumulated(slot, grad)
        return grad

    def _step(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """Step the optimizer once on ``params`` alone, with ``grads``; each group's hyperparameters,
        read now. (A host update steps a view of the optimizer instead, on another thread:
        `_host_view`.)"""
        groups = self.optimizer.param_groups
        held = [g["params"] for g in groups]
        own = self._members(params)
        for p, grad in zip(params, grads):
            p.grad = grad
        try:
            # Each group sees the bucket's parameters it holds; the others step over nothing.
            for gi, g in enumerate(groups):
                g["params"] = own.get(gi, [])
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, held):
                g["params"] = ps
            for p in params:
                p.grad = None

    def _members(self, params: list[nn.Parameter]) -> dict[int, list[nn.Parameter]]:
        """``params`` by the index of the optimizer group holding each (in the bucket's order)."""
        own: dict[int, list[nn.Parameter]] = {}
        for p in params:
            gi = self._group_of.get(id(p))
            if gi is not None:
                own.setdefault(gi, []).append(p)
        return own

    def _step_on_host(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """Update a bucket whose state is in host memory, overlapped with the rest of backward as
        ZeRO-Offload overlaps it: the gradients and the parameters start copying out now (CUDA:
        on the device-to-host stream), and one host step for the bucket and the copies back run
        on a worker thread (`HostUpdates`), which `finish` joins. The step runs on host copies of
        the parameters under their keys in ``optimizer.state`` for the moment, so the optimizer
        finds and creates the state there, through `_host_view` of the optimizer."""
        grads_out = [offload_tensor(g.detach()) for g in grads]
        # A paged parameter (`memplan.passes.paging`) is in host memory already: stepped where it is,
        # or its fp32 master is (`memplan.updates.master_weights`).
        params_out = [HostCopy(self._host_work(p), p.device) if is_host(p) else offload_tensor(p.detach())
                      for p in params]
        view = self._host_view()  # the groups' hyperparameters as they are now
        groups = [self._group_of.get(id(p)) for p in params]
        self._host_updates.submit(self._host_step, params, view, groups, params_out, grads_out)

    def _host_work(self, p: nn.Parameter) -> torch.Tensor:
        """What the host update of paged ``p`` steps: its fp32 master where it has one, else ``p``."""
        master = master_of(self.optimizer, p)
        return p.detach() if master is None else master

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

    def _host_step(self, params: list[nn.Parameter], view: torch.optim.Optimizer, groups: list[int | None],
                   params_out: list[HostCopy], grads_out: list[HostCopy]) -> Any:
        """On the worker thread: one host update of a bucket, then its parameters' copies back;
        returns the event compute waits for before reading them again (`transfer.copy_back`)."""
        state = self.optimizer.state
        with host_storage(), torch.no_grad():
            works = [wait_host_copy(out) for out in params_out]
            for work, out in zip(works, grads_out):
                grad = wait_host_copy(out)
                work.grad = grad if grad.dtype == work.dtype else grad.to(work.dtype)  # (an fp32 master's)
            for work, gi in zip(works, groups):
                if gi is not None:
                    view.param_groups[gi]["params"].append(work)
            try:
                with state_under(state, list(zip(params, works))):
                    view.step()
            finally:
                for work in works:
                    work.grad = None
        with torch.no_grad():
            landed = None
            for p, work in zip(params, works):
                if work.dtype != p.dtype:
                    keep_master(self.optimizer, p, work)  # (the master's first update made the state)
                if work.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():  # (a paged one is p)
                    landed = copy_back(p.detach(), work)  # (a master rounded into its parameter)
            return landed


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


class _PlacementMark:
    """Which runner last placed an optimizer's state (`UpdateRunner.place_state`); forgotten when
    the optimizer loads a state dict, which puts all state on its parameters' devices."""

    def __init__(self) -> None:
        self.runner: int | None = None

    def loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self.runner = None


_PLACEMENT_MARKS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _PlacementMark]" = weakref.WeakKeyDictionary()
_RUNNER_TOKENS = itertools.count()


def _placement_mark(optimizer: torch.optim.Optimizer) -> _PlacementMark:
    mark = _PLACEMENT_MARKS.get(optimizer)
    if mark is None:
        mark = _PLACEMENT_MARKS[optimizer] = _PlacementMark()
        optimizer.register_load_state_dict_post_hook(mark.loaded)
    return mark


class GradClip(nn.Module):
    """The calls the backward segment makes when the step clips: at ``GRADS_FINAL`` with every
    gradient (`UpdateRunner.clip`); or, with a norm pass, each first-pass gradient's square
    (`square`) and the clip factor at ``NORM_FINAL`` (`UpdateRunner.clip_by_norm`)."""

    def __init__(self, runner: UpdateRunner) -> None:
        super().__init__()
        self.runner = runner

    def forward(self, grads: list[torch.Tensor]) -> None:
        self.runner.clip(grads)

    def square(self, slots: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        self.runner.add_norm_squares(slots, grads)

    def by_norm(self) -> None:
        self.runner.clip_by_norm()
