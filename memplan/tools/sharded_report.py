"""`memplan report --fsdp2`: one rank of an FSDP2 run, planned and measured in this process.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``) stands in for the
other ranks: every collective returns at once, with the shapes a real run of ``world_size`` ranks
has and no values. The rank's memory is then what a real rank's is (its parameter and optimizer
shards, the gathered blocks, FSDP2's buffers, the planned graphs), while the numbers it trains to
mean nothing. So one machine can say, before a job is launched, what each rank of it holds under
`memplan.fully_shard` at a budget, and check it: the step is run and its peak measured by the
profiler's allocation events (every thread's), beside the peak the ledger predicts.

A budget given as a share is a share of plain FSDP2's measured step (``fully_shard`` on the same
blocks and the model), run first in the same fake world. The rank runs on the CPU (the fake
world's mesh is a CPU mesh, and the witness counts the CPU's allocations): on a GPU machine too,
it says what a rank of the same step on the CPU holds.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

# A model, its inputs and keyword inputs: a fresh one per call (a model is sharded in place).
Build = Callable[[], tuple[nn.Module, tuple, dict]]
# The optimizer of the step, over a model's parameters (None: no optimizer).
MakeOptimizer = Callable[[Any], torch.optim.Optimizer] | None


@dataclass(frozen=True)
class RankReport:
    """One rank's step under `memplan.fully_shard`, planned and measured (bytes throughout)."""

    world_size: int
    budget: int
    eager_peak: int | None  # plain FSDP2's measured step, where the budget was a share of it
    predicted_peak: int  # the ledger's (`MemplanBackend.predicted_peak`)
    measured_peak: int  # the profiler's, over one whole step after planning
    categories: dict[str, int]  # what FSDP2 holds on the rank (`ShardedAccounts.categories`)
    graphs: list[dict] = field(default_factory=list)  # per planned graph: allowance, planned peak, carried
    text: str = ""  # `MemplanBackend.report()`

    def table(self, title: str) -> Any:
        """The report as a ``rich`` table: budget, prediction and measurement, FSDP2's holdings, each graph."""
        from rich.table import Table

        from memplan.core.units import format_bytes

        table = Table(title=title)
        table.add_column("")
        table.add_column("bytes", justify="right")
        share = f" ({self.budget / self.eager_peak:.0%} of plain FSDP2)" if self.eager_peak else ""
        table.add_row("budget", format_bytes(self.budget) + share)
        if self.eager_peak:
            table.add_row("plain FSDP2's step (measured)", format_bytes(self.eager_peak))
        table.add_row("predicted peak", format_bytes(self.predicted_peak))
        table.add_row("measured peak (the profiler's)", format_bytes(self.measured_peak))
        table.add_section()
        for name, nbytes in self.categories.items():
            table.add_row(name, format_bytes(nbytes))
        table.add_section()
        for g in self.graphs:
            table.add_row(f"graph {g['graph']}: planned peak (allowance {format_bytes(g['allowance'])})",
                          format_bytes(g["planned_peak"]))
        return table

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "budget": self.budget, "eager_peak": self.eager_peak,
                "predicted_peak": self.predicted_peak, "measured_peak": self.measured_peak,
                "categories": self.categories, "graphs": self.graphs}


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of ``world_size`` ranks, this process rank 0, for the block inside; yields
    its mesh, on the CPU (FSDP2 would otherwise shard onto an accelerator the inputs are not on; the
    profiler's witness counts the CPU's allocations)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized: the offline FSDP2 report makes its own")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _measured_step(model: nn.Module, args: tuple, kwargs: dict, opt: torch.optim.Optimizer | None,
                   warmup: int) -> int:
    """The peak of one whole step after ``warmup`` steps (planning, the optimizer's state made)."""
    from memplan.frontend.sharded import local_state
    from memplan.measure.tracker import profiled_peak

    def step() -> None:
        model(*args, **kwargs).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()

    for _ in range(warmup):
        step()
    return profiled_peak(step, resident=local_state(model, opt))


def eager_peak(build: Build, world_size: int, make_optimizer: MakeOptimizer) -> int:
    """Plain FSDP2's measured step on one rank of ``world_size``: ``fully_shard`` on the blocks
    `memplan.fully_shard` would plan (`find_units`) and on the model."""
    from torch.distributed.fsdp import fully_shard

    from memplan.frontend.sharded import find_units

    with fake_world(world_size) as mesh:
        model, args, kwargs = build()
        for block in find_units(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = make_optimizer(model.parameters()) if make_optimizer else None
        return _measured_step(model, args, kwargs, opt, warmup=1)


def plan_one_rank(build: Build, budget: int, world_size: int, make_optimizer: MakeOptimizer, *,
                  solver: str = "auto", time_limit: float | None = None, eager: int | None = None,
                  optimizer_state: str = "device") -> RankReport:
    """Shard and plan a fresh model with `memplan.fully_shard` at ``budget`` bytes per rank, on rank
    0 of a fake world of ``world_size`` ranks; run it, and report what it predicts and measures.
    ``optimizer_state``: `memplan.fully_shard`'s ("device", or "host": stepped in host memory)."""
    import memplan

    with fake_world(world_size) as mesh:
        model, args, kwargs = build()
        opt = make_optimizer(model.parameters()) if make_optimizer else None
        memplan.fully_shard(model, budget, optimizer=opt, mesh=mesh, solver=solver, time_limit=time_limit,
                            optimizer_state=optimizer_state)
        measured = _measured_step(model, args, kwargs, opt, warmup=2)
        backend = model.memplan_backend
        graphs = [{"graph": g.index, "allowance": g.last_allowance or 0, "planned_peak": g.latest_plan.predicted_peak,
                   "carried": g.latest_plan.carried_bytes} for g in backend.graphs if g.latest_plan is not None]
        return RankReport(world_size, budget, eager, backend.predicted_peak, measured, backend.sharding.categories(),
                          graphs, backend.report())


def report_rank(build: Build, budget: str, world_size: int, make_optimizer: MakeOptimizer, *, solver: str = "auto",
                time_limit: float | None = None, stage: Callable[[str, str], Any] | None = None,
                optimizer_state: str = "device") -> RankReport:
    """What ``memplan report --fsdp2`` does: where ``budget`` (``"16GB"``, bytes, ``"60%"``) is a share,
    plain FSDP2's step is measured first (`eager_peak`); then `plan_one_rank`. ``stage(name, text)``: a
    context for each phase (the CLI's progress display)."""
    from memplan.core.units import format_bytes
    from memplan.frontend.budget import budget_fraction, parse_budget, share_of_peak

    stage = stage or (lambda name, text: contextlib.nullcontext())
    fraction, eager = budget_fraction(budget), None
    if fraction is not None:
        with stage("eager", f"plain FSDP2's step, one rank of {world_size}"):
            eager = eager_peak(build, world_size, make_optimizer)
    nbytes = share_of_peak(fraction, eager) if fraction is not None else parse_budget(budget)
    with stage("solve", f"sharding, planning and running one rank of {world_size} at {format_bytes(nbytes)}"):
        return plan_one_rank(build, nbytes, world_size, make_optimizer, solver=solver, time_limit=time_limit,
                             eager=eager, optimizer_state=optimizer_state)
