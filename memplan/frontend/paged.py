"""``optimize(..., parameters="host")``: what it refuses, and the parameters put in host memory.

Paged parameters (`memplan.passes.paging`) are built for one process, a model captured whole,
on the CPU, where host memory is simulated: the storages of the parameters are marked as host
memory (`memplan.core.host`), so no measurement counts them, and each fetch's copy is device
memory. What is not built yet is refused here with what to do, before anything is planned.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from memplan.core.host import mark_host
from memplan.frontend.distributed import engines_in, process_group_size

_WHERE = "memplan.optimize(..., parameters=\"host\")"


def put_parameters_on_host(model: nn.Module, *, distributed: bool, compile: Any, saved_plan: Any) -> None:
    """Check that ``model``'s parameters can be paged as built, and mark them as host memory.
    Raises `NotImplementedError` naming the route for what is not built yet."""
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise NotImplementedError(
            f"{_WHERE} on {', '.join(sorted(devices - {'cpu'}))}: paging parameters runs on the CPU, where host "
            "memory is simulated, in this release; on a GPU, give the budget room for the parameters and put "
            "the optimizer's state on the host (optimizer_state=\"host\")")
    if distributed or engines_in(model) or process_group_size() is not None:
        raise NotImplementedError(f"{_WHERE} under DDP, FSDP or a process group is not built: train one process, "
                                  "or leave the parameters on the device")
    if compile:
        raise NotImplementedError(f"{_WHERE} with compile= is not built: leave compile off")
    if saved_plan is not None:
        raise NotImplementedError(f"{_WHERE} with plan= is not built: plan the step again (leave plan= out)")
    mark_host(*model.parameters())
