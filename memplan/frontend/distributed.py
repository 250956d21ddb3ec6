"""What memplan does not plan yet in distributed training, said before it can go wrong.

A plan with ``optimizer=`` applies each update inside the planned backward, to the
gradient this process computed. Under DistributedDataParallel or FSDP the update must
wait for the gradient reduced across ranks: applied earlier, every rank trains to
different parameters, silently. Until memplan hands gradients to those engines itself,
``optimizer=`` is refused wherever another process can take part in the step: a model
wrapped by DDP, FSDP1 or FSDP2 (``fully_shard``), sharded parameters (DTensor), or an
initialized default process group (a DDP wrapper may be put around the optimized module
after it was made, where it cannot be seen).

Without ``optimizer=`` the numbers are right (DDP averages the gradients before the
caller's ``opt.step()``) but the engine's own tensors (DDP's gradient buckets, FSDP's
all-gathered parameters) are in no plan: `DistributedWarning` says so once.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn


class DistributedTrainingError(RuntimeError):
    """memplan was asked for something in distributed training that it would get wrong."""


class DistributedWarning(UserWarning):
    """The step runs in a process group: the engine's communication tensors are not in the plan."""


_WHAT_TO_DO = (
    "Use memplan.optimize(model, budget) without optimizer= and call optimizer.step() after "
    "backward as usual: the engine then reduces the gradients before the update. (memplan does "
    "not plan DDP's gradient buckets or FSDP's all-gathered parameters yet, so each rank can go "
    "over its budget by about those bytes.)"
)


def engines_in(model: nn.Module) -> list[str]:
    """The distributed engines ``model`` is wrapped by or made of, by name (empty: none)."""
    found: list[str] = []
    if not torch.distributed.is_available():
        return found
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule  # FSDP2 (fully_shard), torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        DTensor = ()
    for module in model.modules():
        if isinstance(module, DistributedDataParallel) and "DistributedDataParallel" not in found:
            found.append("DistributedDataParallel")
        if isinstance(module, FullyShardedDataParallel) and "FSDP" not in found:
            found.append("FSDP")
        if FSDPModule and isinstance(module, FSDPModule) and "FSDP2 (fully_shard)" not in found:
            found.append("FSDP2 (fully_shard)")
    if DTensor and any(isinstance(p, DTensor) for p in model.parameters()):
        found.append("sharded parameters (DTensor)")
    return found


def process_group_size() -> int | None:
    """The default process group's world size, None when there is none."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_world_size()


def refuse_engines_inside(model: nn.Module) -> None:
    """Raise `DistributedTrainingError` for a model already wrapped or sharded by an engine: memplan
    cannot trace through DDP's reducer or FSDP's parameter management (a tracing error otherwise)."""
    engines = engines_in(model)
    if not engines:
        return
    if engines == ["DistributedDataParallel"]:
        route = ("Optimize the model first and wrap the result: DistributedDataParallel(memplan.optimize(model, "
                 "budget)) (without optimizer=; DDP's gradient buckets are not in the plan yet).")
    else:
        route = "memplan does not plan FSDP or sharded (DTensor) parameters yet: train such a model without memplan."
    raise DistributedTrainingError(f"memplan.optimize on a model under {' and '.join(engines)}: {route}")


def refuse_distributed_updates(model: nn.Module) -> None:
    """Raise `DistributedTrainingError` where updates applied in the planned backward would run
    before a distributed engine has reduced the gradients (``optimizer=`` under DDP or FSDP)."""
    engines = engines_in(model)
    if engines:
        raise DistributedTrainingError(
            f"memplan.optimize(..., optimizer=) on a model under {' and '.join(engines)}: memplan would apply each "
            "update inside the planned backward, before the engine reduces the gradients across ranks, and every "
            f"rank would train to different parameters. {_WHAT_TO_DO}"
        )
    size = process_group_size()
    if size is not None:
        raise DistributedTrainingError(
            f"memplan.optimize(..., optimizer=) in a process group (world size {size}): memplan would apply each "
            "update inside the planned backward, before DistributedDataParallel or FSDP (which memplan cannot see "
            "from inside the module they wrap) reduce the gradients across ranks, and the ranks would train to "
            f"different parameters. {_WHAT_TO_DO}"
        )


def warn_unplanned_engine_memory(model: nn.Module) -> bool:
    """Warn (`DistributedWarning`) when the step runs in a process group or under an engine; True if it did."""
    engines = engines_in(model)
    size = process_group_size()
    if not engines and size is None:
        return False
    where = " and ".join(engines) if engines else f"a process group of world size {size}"
    warnings.warn(
        f"memplan: the step runs under {where}. The plan counts this rank's parameters, gradients and "
        "activations, but not the engine's own tensors (DDP's gradient buckets, a second copy of every gradient "
        "unless gradient_as_bucket_view=True; FSDP's all-gathered parameters and reduce-scatter buffers): each "
        "rank can go over its budget by about those bytes.",
        DistributedWarning,
        stacklevel=4,
    )
    return True
