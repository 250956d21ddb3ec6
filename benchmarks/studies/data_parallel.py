"""memplan inside DDP and FSDP2 against each engine's usual ways to fit a rank's step in memory.

Two processes (gloo, CPU, one thread each), each rank its own batch, the zoo GPT at the size
given, AdamW. Per rank and engine, the methods of the whole step (forward, backward, update):

* ``DDP eager``: ``DDP(model)``, ``loss.backward()``, ``optimizer.step()``, ``zero_grad``;
* ``DDP + checkpoint per block``: the same with every transformer block under non-reentrant
  activation checkpointing;
* ``DDP + memplan``: ``memplan.optimize(DDP(model), budget, optimizer=opt)``;
* ``FSDP2 eager``: ``fully_shard`` on every block and on the model, the same loop;
* ``FSDP2 + checkpoint per block``: the same with the blocks checkpointed;
* ``FSDP2 + memplan``: ``memplan.fully_shard(model, budget, optimizer=opt)``, the same loop;
* ``FSDP2 + memplan, state on host``: the same with ``optimizer_state="host"`` (the AdamW state in
  host memory, ``optimizer.step()`` on host copies of the shards; host memory is in no budget).

Budgets are shares of the engine's eager whole-step peak (100/80/65/50%). A method meets a budget
when each rank's measured peak is at or under it; memplan meets it when it plans within it (each
plan is then measured too). The witness is the same for every method of an engine: memplan's
tracker under DDP, the profiler's allocation events under FSDP2 (the tracker, a dispatch mode,
would make dynamo run memplan's compiled blocks eagerly). Reported per method: the lowest budget
met, the step time there over the engine's eager step (median of interleaved rounds), and under
DDP the time from the last collective's issue to its completion (the tail that an all-reduce
overlapped with backward hides), measured with a communication hook and a clock.

    python -m benchmarks.studies.data_parallel [--size tiny] [--rounds 5] [--engines DDP,FSDP2]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memplan
from benchmarks.harness.checkpointing import checkpoint_blocks
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.models.layouts import LAYOUTS
from memplan.measure.tracker import measure_peak, profiled_peak
from memplan.models import zoo

SHARES = (100, 80, 65, 50)
WORLD_SIZE = 2
METHODS = {
    "DDP": ("DDP eager", "DDP + checkpoint per block", "DDP + memplan"),
    "FSDP2": ("FSDP2 eager", "FSDP2 + checkpoint per block", "FSDP2 + memplan", "FSDP2 + memplan, state on host"),
}


class Tail:
    """The communication hook: all-reduces as DDP does, and records when the last collective of a
    backward completed, beside the moment its last gradient was handed over."""

    def __init__(self) -> None:
        self.last_issued = 0.0
        self.last_done = 0.0

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.last_issued = time.perf_counter()

        def done(fut):
            self.last_done = time.perf_counter()
            return fut.value()[0] if isinstance(fut.value(), list) else fut.value()

        return allreduce_hook(state, bucket).then(done)


class ReduceScatterClock:
    """FSDP2's counterpart of `Tail`: wraps its reduce-scatter (`DefaultReduceScatter`, installed once
    per process) and records when the last one of a step was issued and when it completed (FSDP2
    issues each block's as the block's backward ends; on the CPU, gloo's completes before the call
    returns). `reset` before each step: a step that issued none reads 0 for both."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

        self.reset()
        self._watched: set[type] = set()
        self.watch(collectives.DefaultReduceScatter)

    def watch(self, comm_class: type) -> None:
        """Time the reduce-scatters of ``comm_class`` too (memplan's over gloo: an in-place all-reduce)."""
        if comm_class in self._watched:
            return
        self._watched.add(comm_class)
        original = comm_class.__call__

        def timed(comm, *args, **kwargs):
            self.last_issued = time.perf_counter()
            work = original(comm, *args, **kwargs)
            if work is not None and kwargs.get("async_op"):
                work.wait()  # (asked asynchronous: completion is the wait's end)
            self.last_done = time.perf_counter()
            return work

        comm_class.__call__ = timed

    def reset(self) -> None:
        self.last_issued = 0.0
        self.last_done = 0.0


_CLOCK: list[ReduceScatterClock | None] = []


def _reduce_scatter_clock() -> ReduceScatterClock | None:
    """The process's clock, made once; None where this torch's FSDP2 has no `DefaultReduceScatter`
    (the column then reads "—")."""
    if not _CLOCK:
        try:
            _CLOCK.append(ReduceScatterClock())
        except (ImportError, AttributeError):
            _CLOCK.append(None)
    return _CLOCK[0]


def _build(size: str, rank: int, checkpointed: bool) -> tuple[nn.Module, tuple]:
    zm = zoo.build("gpt", size=size, overrides={"dropout": 0.0})
    if checkpointed:
        checkpoint_blocks(zm.model, LAYOUTS["gpt"])
    tokens, *rest = zm.example_inputs
    batch = torch.randint(0, 64, tokens.shape, generator=torch.Generator().manual_seed(100 + rank))
    return memplan.WithLoss(zm.model, zm.loss_fn), (batch, *rest)


def _method(name: str, size: str, rank: int, budget: int | None):
    """(step function, DDP, its Tail) for one method; None where memplan finds no plan."""
    model, args = _build(size, rank, checkpointed=name == "DDP + checkpoint per block")
    ddp = DDP(model)
    tail = Tail()
    ddp.register_comm_hook(None, tail.hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    if name == "DDP + memplan":
        try:
            ddp = memplan.optimize(ddp, budget, optimizer=opt, time_limit=20, example_inputs=args)
        except (memplan.InfeasibleBudgetError, memplan.DistributedTrainingError):  # (rank 0 could not plan)
            return None

        def step():
            ddp(*args).backward()
    else:
        def step():
            ddp(*args).backward()
            opt.step()
            opt.zero_grad()
    return step, ddp, tail


def _fsdp_method(name: str, size: str, rank: int, budget: int | None):
    """(step function, model, None) for one FSDP2 method; None where memplan finds no plan."""
    from torch.distributed.fsdp import fully_shard

    from memplan.frontend.sharded import find_units, local_state

    model, args = _build(size, rank, checkpointed=name == "FSDP2 + checkpoint per block")
    if name.startswith("FSDP2 + memplan"):  # the optimizer made over the unsharded model, pointed at the shards
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        memplan.fully_shard(model, budget, optimizer=opt, time_limit=20,
                            optimizer_state="host" if name.endswith("on host") else "device")
    else:
        for block in find_units(model):
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(*args).backward()
        opt.step()
        opt.zero_grad()

    step.resident = lambda: local_state(model, opt)
    clock = _reduce_scatter_clock()
    if clock is not None:  # the reduce-scatter FSDP2 runs for this model (memplan's own over gloo)
        clock.watch(type(model._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm))
    return step, model, clock


def _measure(step) -> int:
    """The step's peak once the first steps made the optimizer's state (and DDP's rebuilt buckets, and
    memplan's plans); -1 where memplan refused the budget in the first step (every rank refuses)."""
    try:
        step()
    except (memplan.InfeasibleBudgetError, memplan.DistributedTrainingError):
        return -1
    step()
    if hasattr(step, "resident"):  # FSDP2: the profiler's witness, every thread's allocations
        return profiled_peak(step, resident=step.resident())
    return measure_peak(step)


def _agreed_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, port: int, size: str, rounds: int, queue, shares: tuple[int, ...] = SHARES,
          engines: tuple[str, ...] = tuple(METHODS)) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        result = {}
        for engine in engines:
            make = _method if engine == "DDP" else _fsdp_method
            names = METHODS[engine]
            eager = make(names[0], size, rank, None)
            eager_peak = int(_agreed_max(_measure(eager[0])))
            rows = {names[0]: (100, eager, eager_peak)}  # the engine's eager step: the budgets' 100%
            for name in names[1:]:
                met = None
                for share in shares:
                    budget = eager_peak * share // 100
                    made = make(name, size, rank, budget)
                    ok = made is not None
                    # every rank plans alone: a budget is met only where all of them planned and measured under it
                    ok = _agreed_max(0.0 if ok else 1.0) == 0.0
                    if not ok:
                        break
                    measured = _measure(made[0])
                    peak = int(_agreed_max(measured))
                    if _agreed_max(1.0 if measured < 0 else 0.0) or peak > budget:
                        break
                    met = (share, made, peak)
                rows[name] = met
            times: dict[str, list[float]] = {name: [] for name, met in rows.items() if met}
            tails: dict[str, list[float]] = {name: [] for name in times}
            for _ in range(rounds):  # interleaved rounds
                for name in times:
                    step, _, tail = rows[name][1]
                    if isinstance(tail, ReduceScatterClock):
                        tail.reset()  # (one clock for FSDP2's methods: none reads another's)
                    dist.barrier()
                    start = time.perf_counter()
                    step()
                    elapsed = time.perf_counter() - start
                    times[name].append(_agreed_max(elapsed))
                    if tail is not None and tail.last_issued:
                        tails[name].append(max(0.0, tail.last_done - tail.last_issued))
            base = statistics.median(times[names[0]])
            result[engine] = {name: (rows[name][0], rows[name][2], statistics.median(times[name]) / base,
                                     statistics.median(tails[name]) * 1e3 if tails[name] else None)
                              if rows[name] else None for name in rows} | {"eager_peak": eager_peak}
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size: str, rounds: int, shares: tuple[int, ...] = SHARES, engines: tuple[str, ...] = tuple(METHODS)) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_rank, args=(_free_port(), size, rounds, queue, shares, engines), nprocs=WORLD_SIZE, join=True)
    return queue.get()


def table(result: dict, size: str, rounds: int, seconds: float, command: str = "",
          shares: tuple[int, ...] = SHARES) -> str:
    lines = [
        f"# memplan inside DDP and FSDP2 (2 ranks, gloo, CPU), zoo GPT `{size}`, AdamW",
        "",
        "Budgets are shares of the engine's eager whole-step peak per rank (given by engine). Each cell is "
        "what every rank met: the lowest budget, the peak measured there (memplan's tracker under DDP, the "
        "profiler's allocation events under FSDP2), the step time over the engine's eager step (median of "
        f"{rounds} interleaved rounds), and the last collective's time from issue to completion (the "
        "communication left after backward's last gradient: DDP's last all-reduce, FSDP2's last "
        "reduce-scatter, the root's).",
        "",
        "| method | lowest budget met | measured peak | step time / engine's eager | last collective (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for engine, rows in result.items():
        for name, row in rows.items():
            if name == "eager_peak":
                continue
            if row is None:
                lines.append(f"| {name} | none of {shares} | — | — | — |")
                continue
            share, peak, ratio, tail_ms = row
            tail = "—" if tail_ms is None else f"{tail_ms:.2f}"
            lines.append(f"| {name} | {share}% | {peak:,} B | {ratio:.2f}x | {tail} |")
    peaks = ", ".join(f"{engine} eager {rows['eager_peak']:,} B" for engine, rows in result.items())
    lines += ["", f"Eager whole-step peaks per rank: {peaks}.", "",
              f"`{command or f'python -m benchmarks.studies.data_parallel --size {size} --rounds {rounds}'}`, "
              f"{seconds:.0f} s, torch {torch.__version__}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shares", default=",".join(map(str, SHARES)),
                        help="budgets to try, percent of DDP eager's peak, largest first")
    parser.add_argument("--engines", default=",".join(METHODS), help="engines to compare: DDP, FSDP2 or both")
    parser.add_argument("--out", default=str(RESULTS_DIR / "data_parallel.md"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engines = tuple(e.strip() for e in args.engines.split(","))
    unknown = [e for e in engines if e not in METHODS]
    if unknown:
        parser.error(f"unknown engine(s) {unknown}: choose from {list(METHODS)}")
    shares = tuple(int(x) for x in args.shares.split(","))
    result = run(args.size, args.rounds, shares, engines)
    given = sys.argv[1:] if argv is None else argv
    command = ("python -m benchmarks.studies.data_parallel " + " ".join(given)) if given else ""
    text = table(result, args.size, args.rounds, time.perf_counter() - started, command, shares)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
