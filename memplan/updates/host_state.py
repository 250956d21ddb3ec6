"""Optimizer state kept in host memory, and the optimizer stepped there on stand-ins of the parameters.

Two callers: the planned backward's host updates (`memplan.updates.runner.UpdateRunner`, one bucket
at a time on a worker thread) and a sharded model's ``optimizer.step()`` after backward
(`step_sharded_on_host`, installed by ``memplan.fully_shard(..., optimizer_state="host")``). Both
step the user's own optimizer on *stand-ins*: host copies of the parameters, each with a host copy
of its gradient, put in the parameter's place in ``optimizer.state`` while the step runs
(`state_under`), so the optimizer finds the parameter's state there, or creates it there on its
first step, in host memory; the parameters are then copied back. The state stays keyed by the
parameters, so ``state_dict`` and checkpoints see the optimizer as without memplan.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch

from memplan.core.host import host_storage, is_host
from memplan.ops.transfer import copy_back, offload_tensor, wait_host_copy

# The optimizers whose update of a tensor reads nothing but that tensor's own elements (its gradient
# and state, elementwise): stepping a rank's local shard of a parameter then gives what stepping the
# whole sharded parameter gives. (Adafactor's factored moments and L-BFGS's line search read more;
# Adagrad is elementwise but makes its state when built, before `memplan.fully_shard` could place it.)
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
                          torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)


def in_host_memory(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether optimizer state ``t`` of parameter ``p`` is in host memory: on the CPU beside a
    device parameter, or (a CPU "device", in tests) in a storage marked as host."""
    return (t.device.type == "cpu" and p.device.type != "cpu") or is_host(t)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned beside a CUDA device), complete on return."""
    return wait_host_copy(offload_tensor(t))


@contextlib.contextmanager
def state_under(state: dict, stand_ins: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """While the block runs, each parameter's entry of ``state`` (an optimizer's) is under its
    stand-in's key, for a step of the stand-ins; afterwards under the parameter's again, with what
    that step made (the first step's new state included)."""
    for p, stand_in in stand_ins:
        if p in state:
            state[stand_in] = state.pop(p)
    try:
        yield
    finally:
        for p, stand_in in stand_ins:
            if stand_in in state:
                state[p] = state.pop(stand_in)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (a view of its storage); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_like(value: Any, p: torch.Tensor) -> Any:
    """``value``, per-element state of the sharded parameter ``p`` computed on its local shard, as a
    ``DTensor`` sharded as ``p`` is (what the optimizer makes for ``p`` without memplan); scalars
    (Adam's ``step``) and state of a plain parameter as they are."""
    if not hasattr(p, "to_local") or not isinstance(value, torch.Tensor) or hasattr(value, "to_local"):
        return value
    if value.dim() == 0 or value.shape != p.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def check_host_steppable(optimizer: torch.optim.Optimizer, what: str) -> None:
    """Raise where `step_sharded_on_host` would step ``optimizer`` differently than its own ``step``: an
    optimizer whose update of a shard differs from its update of the whole parameter, or one that keeps
    its step count on the device (``capturable``, ``fused``: their kernels run on the device only)."""
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"{what}: {type(optimizer).__name__} is not an elementwise optimizer ({names}): stepped "
                         "on a rank's shards it could update differently than on the whole parameters")
    flags = sorted({flag for g in optimizer.param_groups for flag in ("capturable", "fused") if g.get(flag)})
    if flags:
        raise ValueError(f"{what}: the optimizer is made with {' and '.join(f'{f}=True' for f in flags)}, which "
                         "runs on the device only; make it without, so that its steps can run on the host")


def keep_sharded_state_on_host(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` run `step_sharded_on_host`: the optimizer's state in host memory, each
    step on host copies of the rank's shards. (A bound method on the instance, as an LR scheduler made
    after this wraps it.) A ``load_state_dict`` (a checkpoint's resume), which puts every state tensor
    beside its parameter, is followed by moving the state back to the host at once."""
    optimizer.step = types.MethodType(step_sharded_on_host, optimizer)
    optimizer.register_load_state_dict_post_hook(state_to_host)


def state_to_host(optimizer: torch.optim.Optimizer) -> None:
    """Move ``optimizer``'s per-element state that is not in host memory there (sharded as before)."""
    with torch.no_grad():
        for p, held in optimizer.state.items():
            optimizer.state[p] = {k: _sharded_like(_host_local(v, p), p) for k, v in held.items()}


def step_sharded_on_host(optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
    """One step of ``optimizer`` (over FSDP2's ``DTensor`` shards, or plain tensors) with its state in
    host memory, as ZeRO-Offload steps: every parameter with a gradient has its local shard and its
    gradient's copied to the host, the optimizer's own step runs on those copies (its state moved to
    the host first where a ``load_state_dict`` put it on the device), and the updated shards are copied
    back. The state stays keyed by the parameters, per-element state as ``DTensor`` shards whose local
    tensors are in host memory, so ``torch.distributed.checkpoint`` saves and loads it as without memplan."""
    if closure is not None:
        raise ValueError("memplan: an optimizer whose state is on the host steps without a closure")
    state = optimizer.state
    groups = optimizer.param_groups
    held = [g["params"] for g in groups]
    stand_ins: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for group in groups:
                works = []
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    work = to_host(local_tensor(p))
                    work.grad = to_host(local_tensor(p.grad))
                    works.append(work)
                    stand_ins.append((p, work))
                    if p in state:
                        state[p] = {k: _host_local(v, p) for k, v in state[p].items()}
                group["params"] = works
        with state_under(state, stand_ins), host_storage():
            type(optimizer).step(optimizer)
    finally:
        # (also where a step raised: the groups hold the parameters again, the state is sharded as before)
        for group, params in zip(groups, held):
            group["params"] = params
        for p, work in stand_ins:
            work.grad = None
            if p in state:
                state[p] = {k: _sharded_like(v, p) for k, v in state[p].items()}
    with torch.no_grad():
        for p, work in stand_ins:
            landed = copy_back(local_tensor(p), work)
            if landed is not None:  # (CUDA: compute reads the shard after its copy back)
                torch.cuda.current_stream().wait_event(landed)


def _host_local(value: Any, p: torch.Tensor) -> Any:
    """State ``value`` of ``p`` as the host step reads it: a per-element tensor's local shard in host
    memory (a view of the ``DTensor``'s, where it is there already, so the step updates it in place);
    scalars where the optimizer keeps them."""
    if not isinstance(value, torch.Tensor):
        return value
    local = local_tensor(value)
    if local.dim() == 0 or in_host_memory(local, local_tensor(p)):
        return local
    return to_host(local)
