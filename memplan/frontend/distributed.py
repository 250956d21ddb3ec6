"""memplan in distributed training: the engine it plans inside, and what it refuses.

**DistributedDataParallel, planned.** ``memplan.optimize(DDP(model, ...), budget, ...)``
plans ``model`` for the DDP module it is given (`DataParallel`, read from it): the plan
counts DDP's gradient buckets (`bucket_buffer_bytes`), the planned backward hands each
group of gradients to DDP as soon as the schedule has computed them (`GradientHandout`,
so DDP's all-reduce overlaps the rest of backward), and with ``optimizer=`` the updates run
after backward, on the gradients DDP has averaged. The DDP module is returned, its
``module`` now the optimized one.

**Refused.** A plan with ``optimizer=`` applies each update inside the planned backward.
Under an engine memplan does not plan for, the update would use the gradient this process
computed, before the engine reduced it across ranks: every rank would train to different
parameters, silently. So ``optimizer=`` is refused wherever another process can take part
in the step and memplan was not given the engine: a model wrapped by FSDP1 or FSDP2
(``fully_shard``), sharded parameters (DTensor), a DDP wrapper put around the optimized
module, or an initialized default process group (such a wrapper cannot be seen from inside).

Without ``optimizer=`` and without the engine given, the numbers are right (DDP averages
the gradients before the caller's ``opt.step()``) but the engine's own tensors (DDP's
gradient buckets, FSDP's all-gathered parameters) are in no plan: `DistributedWarning`
says so once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn


class DistributedTrainingError(RuntimeError):
    """memplan was asked for something in distributed training that it would get wrong."""


class DistributedWarning(UserWarning):
    """The step runs in a process group: the engine's communication tensors are not in the plan."""


_WHAT_TO_DO = (
    "Under DistributedDataParallel, give memplan the DDP module: memplan.optimize(DDP(model, ...), budget, "
    "optimizer=opt) plans inside it. Under FSDP2, call memplan.fully_shard(model, budget, optimizer=opt) on the "
    "unsharded model in place of the fully_shard calls: it shards and plans every block, and optimizer.step() "
    "runs after backward as usual."
)


@dataclass(frozen=True)
class DataParallel:
    """The DistributedDataParallel module a plan is made inside, as memplan reads it (`of`)."""

    world_size: int
    # DDP's bucket_cap_mb in bytes: the planned backward hands gradients out in groups of about
    # this size (`memplan.runtime.handout`), so that a DDP bucket fills as soon as it can.
    bucket_bytes: int
    # DDP's gradient_as_bucket_view: .grad is a view of DDP's bucket (True) or a tensor of its own.
    gradient_as_bucket_view: bool
    # DDP's find_unused_parameters: DDP itself marks ready the parameters a step gives no gradient.
    find_unused_parameters: bool = False

    @staticmethod
    def of(ddp: nn.Module) -> "DataParallel":
        """What memplan plans for in ``ddp`` (a ``DistributedDataParallel``)."""
        return DataParallel(world_size=torch.distributed.get_world_size(ddp.process_group),
                            bucket_bytes=int(ddp.bucket_bytes_cap),
                            gradient_as_bucket_view=bool(ddp.gradient_as_bucket_view),
                            find_unused_parameters=bool(ddp.find_unused_parameters))

    def check_gradients(self, without: list[str]) -> None:
        """Raise `DistributedTrainingError` when the step gives parameters ``without`` no gradient and
        DDP waits for every one (eager DDP fails too, at the next step, less plainly)."""
        if without and not self.find_unused_parameters:
            raise DistributedTrainingError(
                f"this step gives {len(without)} parameter(s) no gradient ({', '.join(without[:3])}"
                f"{', ...' if len(without) > 3 else ''}), and DistributedDataParallel waits for every gradient: "
                "make the DDP with find_unused_parameters=True, or freeze them (requires_grad=False)")


def made_on_first_rank(group: Any, make: Callable[[], str]) -> str:
    """``make()`` (a saved plan's JSON) run on the group's first rank only and broadcast to every
    rank: one solve for all ranks, where time-limited solves on each would differ and compete for
    the cores. Every rank must call it at the same point (``optimize(DDP(model), example_inputs=)``, or
    the first step, where every rank's inputs have one signature); a plan made at a later call is
    made on each rank instead, with no collective that a rank that never sees those inputs would not
    enter. Raises `DistributedTrainingError` on the other ranks
    when the first could not plan (its own error on the first)."""
    dist = torch.distributed
    first = dist.get_global_rank(group, 0) if group is not None else 0
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == first:
        try:
            box = [make()]
        except Exception as exc:  # every rank must hear of it, or they wait in the broadcast forever
            failure, box = exc, [exc.__class__.__name__ + ": " + str(exc)]
        box = [("plan", box[0]) if failure is None else ("error", box[0])]
    dist.broadcast_object_list(box, src=first, group=group)
    if failure is not None:
        raise failure
    kind, text = box[0]
    if kind == "error":
        raise DistributedTrainingError(f"rank {first} planned the step for every rank and could not: {text}")
    return text


def is_data_parallel(model: nn.Module) -> bool:
    """``model`` is a ``DistributedDataParallel`` (the module memplan plans inside)."""
    if not torch.distributed.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def bucket_buffer_bytes(params: Iterable[nn.Parameter]) -> int:
    """Bytes of DDP's gradient buckets for ``params``: one flat buffer per bucket, holding every
    trainable parameter's gradient once, allocated when DDP is made and held for as long as it
    lives (a second copy of every gradient, unless ``gradient_as_bucket_view`` makes ``.grad`` a
    view of it)."""
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def refuse_unsupported_data_parallel(ddp: nn.Module, step: Any, optimized: bool) -> None:
    """Raise `DistributedTrainingError` for what memplan does not plan inside DDP yet: the model
    DDP wraps already optimized (``optimized``) or sharded, and, with ``optimizer=``, a static graph or
    clipping by a norm pass (each needs the engine's reduced gradients earlier than memplan has them)."""
    inner = ddp.module
    if optimized:
        raise DistributedTrainingError(
            "memplan.optimize on a DistributedDataParallel whose module is already optimized: give memplan the "
            "DDP of the original model, memplan.optimize(DDP(model), budget)")
    engines = engines_in(inner)
    if engines:
        raise DistributedTrainingError(
            f"memplan.optimize on a DistributedDataParallel of a model under {' and '.join(engines)}: memplan plans "
            "DDP of a model that is not sharded (tensor parallelism, FSDP and HSDP are not planned)")
    if step.optimizer is None:
        return
    if getattr(ddp, "static_graph", False):
        raise DistributedTrainingError(
            "memplan.optimize(DDP(model, static_graph=True), ..., optimizer=): with a static graph DDP delays its "
            "first all-reduce to the end of backward, after memplan's updates would have run. Make the DDP without "
            "static_graph, or leave out optimizer= and call optimizer.step() after backward.")
    if step.max_grad_norm is not None and step.clip_by == "norm_pass":
        raise DistributedTrainingError(
            "memplan.optimize(DDP(model), ..., max_grad_norm=, clip_by='norm_pass'): under DDP the norm is that of "
            "the averaged gradients, known once backward has handed them all out; use clip_by='holding' or 'auto'.")


def reduce_at_last_micro_step(ddp: nn.Module) -> None:
    """Under ``accumulate_steps=k``, let ``ddp`` reduce the gradients only at the backward that
    updates, the k-th, as eager DDP does inside ``no_sync()`` for the others: the earlier ones add
    into ``.grad`` on each rank, the last all-reduces the sums, and the updates after it step with
    them. DDP reads ``require_backward_grad_sync`` at the start of each forward: a forward pre-hook
    sets it from the step's count just before (after a ``no_sync()`` the caller entered too, which
    would otherwise keep the last micro-step from reducing)."""
    ddp.register_forward_pre_hook(_reduce_only_when_updating)


def _reduce_only_when_updating(ddp: nn.Module, args: Any) -> None:
    ddp.require_backward_grad_sync = ddp.module.accumulation.final


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
        route = ("memplan plans a DistributedDataParallel only as the outermost module: wrap the model, then "
                 "optimize the wrapper, memplan.optimize(DDP(model, ...), budget).")
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
