"""Host memory as a limit of the plan: what a plan keeps in host memory, against what the host has.

A plan may put four things in host memory: the parameters it pages (`memplan.passes.paging`, with
their fp32 masters and summed gradients where it keeps them), the optimizer state of the parameters
its placement updates there (all step long), the copies its host updates work on (every hosted
parameter and gradient: each bucket's are copied out as backward makes them, and wait for the one
worker that steps them, `memplan.updates.runner`; and one bucket's optimizer temporaries at a
time), and the activations it pages out (`Plan.host_bytes`, the most held at once). A planning call is given the
bytes of host memory it may use (``host_memory=``; by default what the machine has available when
it plans): state moves to the host only while it fits there, and a plan that needs more is refused
with `HostMemoryError`, before anything is allocated.
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

from memplan.core.host import is_host
from memplan.core.units import format_bytes
from memplan.updates.host_state import in_host_memory
from memplan.updates.probe import ParamUpdate, most_bucket_temp_bytes


class HostMemoryError(ValueError):
    """A plan would need more host memory than the planning call may use: ``needed`` bytes, of
    which ``parts`` says what (name -> bytes), against ``available``."""

    def __init__(self, needed: int, available: int, parts: dict[str, int]):
        self.needed, self.available, self.parts = needed, available, dict(parts)
        # The step's outputs whose gradient is only an addend (`Capture.addend_only_outputs`), set by
        # `make_plan`: a plan that assumes they get none needs less moved to the host, and may fit.
        self.addend_only_outputs: frozenset[int] = frozenset()
        super().__init__(
            f"memplan: the plan needs {format_bytes(needed)} of host memory ({describe_parts(parts)}), more than the "
            f"{format_bytes(available)} it may use there (host_memory=; by default what the machine has "
            "available): " + ("free host memory, or keep the parameters on the device (parameters='device')"
                              if parts.get("parameters") else
                              "raise the device budget (less moves to the host), free host memory, or keep the "
                              "optimizer state on the device (optimizer_state='device')"))


def describe_parts(parts: dict[str, int]) -> str:
    """``parts`` (name -> bytes held in host memory) as people read them: "optimizer state 1.50 GB, ..."."""
    return ", ".join(f"{name} {format_bytes(b)}" for name, b in parts.items() if b)


def available_host_memory() -> int:
    """Bytes of host memory available now: the kernel's estimate of what can be allocated without
    swapping (``MemAvailable``), or the physical memory where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_update_bytes(updates: Iterable[ParamUpdate], host: frozenset[str], bucket_bytes: int,
                      accumulate_steps: int = 1, paged_bytes: int = 0) -> dict[str, int]:
    """What the updates run in host memory hold there at most (name -> bytes): the ``paged_bytes``
    of parameters paged there (`memplan.passes.paging.paged_bytes`: every parameter, updated or
    frozen), the fp32 masters of those updated through one (`ParamUpdate.master_bytes`), the
    optimizer state of the parameters in ``host``, and the copies of their parameters and
    gradients, all of which may wait for the host worker at once (backward copies each bucket out as it is made, faster than
    the host steps them), with one bucket's optimizer temporaries (a bucket holds up to
    ``bucket_bytes`` of parameters). With ``accumulate_steps`` > 1 a paged parameter's gradient is
    summed there too, between micro-steps."""
    hosted = [u for u in updates if u.name in host]
    parts = {"parameters": paged_bytes} if paged_bytes else {}
    if not hosted:
        return parts
    # A paged parameter is in host memory all step, and its update steps it there: only its
    # gradient is copied out (and summed there between micro-steps).
    paged_grads = sum(u.grad_bytes for u in hosted if u.paged)
    if paged_grads and accumulate_steps > 1:
        parts["accumulated gradients"] = paged_grads
    masters = sum(u.master_bytes for u in hosted)
    if masters:
        parts["fp32 master weights"] = masters
    return {**parts, "optimizer state": sum(u.state_bytes for u in hosted),
            "update copies": 2 * sum(u.grad_bytes for u in hosted) - paged_grads
            + most_bucket_temp_bytes(hosted, bucket_bytes)}


def default_host_limit(optimizer: object = None, model: torch.nn.Module | None = None, pageable: bool = False) -> int:
    """The host memory a planning call may use when not told: what the machine has available now,
    and what of this plan's is in host memory already (this plan's to count, not taken): the state
    of ``optimizer`` an earlier plan put there, and ``model``'s paged parameters; with ``pageable``
    (a plan that may page them), each of its parameters in the CPU's memory, which pages where it is."""
    paged = 0 if model is None else sum(p.untyped_storage().nbytes() for p in model.parameters()
                                        if is_host(p) or (pageable and p.device.type == "cpu"))
    return available_host_memory() + state_held_on_host(optimizer) + paged


def state_held_on_host(optimizer: object) -> int:
    """Bytes of ``optimizer``'s state already in host memory (`memplan.updates.host_state.in_host_memory`):
    a plan made after the first step finds them taken from what the machine has available, and
    counts them among its own."""
    if optimizer is None:
        return 0
    return sum(v.untyped_storage().nbytes() for p, state in optimizer.state.items() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() and in_host_memory(v, p))


def check_host_memory(parts: dict[str, int], available: int) -> None:
    """Raise `HostMemoryError` where ``parts`` (name -> bytes a plan keeps in host memory) add up
    to more than ``available``."""
    needed = sum(parts.values())
    if needed > available:
        raise HostMemoryError(needed, available, parts)
