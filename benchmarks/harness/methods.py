"""The methods of the comparison, each turned into table cells for one model.

Every method is a function ``(model under test, budgets) -> list[Cell]``:
one cell per budget plus one for the method's own minimum. Methods with a
single configuration (eager, the checkpointing baselines) answer every budget
with it; the configuration's measured peak is their minimum. The compiled
peers search ``activation_memory_budget`` per budget (own minimum: fraction
0). memplan plans each budget in bytes (own minimum: the ``min_budget`` of
the ``InfeasibleBudgetError`` a 1-byte budget raises, then a plan at it), run
by its eager runtime, or with ``compile=True`` by its compiled runtime.
Compiled configurations (``Candidate.compiled``) are measured with the
profiler, and their first step, where Inductor compiles, is timed apart.
"""
from __future__ import annotations

import time
from typing import Callable

import memplan
from benchmarks.harness.checkpointing import checkpoint_blocks, checkpoint_chain
from benchmarks.harness.compile_budget import AOT_EAGER, INDUCTOR, FractionSearch, Peer
from benchmarks.harness.core import Candidate, Cell, ModelUnderTest
from benchmarks.harness.steps import clear_grads

EAGER = "eager"
CKPT_BLOCKS = "checkpoint per block"
CKPT_SEQ = "checkpoint_sequential √n"
COMPILE = INDUCTOR.method
COMPILE_EAGER = AOT_EAGER.method
MEMPLAN = "memplan eager runtime"
MEMPLAN_COMPILED = "memplan compiled"
MEMPLAN_OFFLOAD = "memplan remat+offload"
OWN_MIN = "own min"

Budgets = list[tuple[str, int]]  # (label, bytes)


def _single(method: str, cand: Candidate, budgets: Budgets) -> list[Cell]:
    """One configuration for every budget; its measured peak is its minimum."""
    cells = [Cell(label, b, method, cand) for label, b in budgets]
    cells.append(Cell(OWN_MIN, cand.peak, method, cand))
    return cells


def _unavailable(method: str, budgets: Budgets, status: str, note: str) -> list[Cell]:
    return [Cell(label, b, method, None, status, note) for label, b in budgets + [(OWN_MIN, None)]]


def eager_cells(mut: ModelUnderTest, budgets: Budgets, eager: Candidate, **_) -> list[Cell]:
    return _single(EAGER, eager, budgets)


def checkpoint_block_cells(mut: ModelUnderTest, budgets: Budgets, **_) -> list[Cell]:
    module, params = mut.twin()
    try:
        n = checkpoint_blocks(module.model, mut.layout)
    except (ValueError, AttributeError) as exc:
        return _unavailable(CKPT_BLOCKS, budgets, "n/a", str(exc))
    cand = mut.measure(Candidate(CKPT_BLOCKS, f"{n} blocks", module, params))
    return _single(CKPT_BLOCKS, cand, budgets)


def checkpoint_chain_cells(mut: ModelUnderTest, budgets: Budgets, **_) -> list[Cell]:
    if not mut.layout.chain:
        return _unavailable(CKPT_SEQ, budgets, "n/a", f"no sequential chain ({mut.layout.why_not_chain})")
    module, params = mut.twin()
    shapes = checkpoint_chain(module.model, mut.layout)
    label = ", ".join(f"{n}→{s}" for n, s in shapes) + " segments"
    cand = mut.measure(Candidate(CKPT_SEQ, label, module, params))
    return _single(CKPT_SEQ, cand, budgets)


def _peer_cells(peer: Peer, mut: ModelUnderTest, budgets: Budgets, bisect_steps: int) -> list[Cell]:
    """The fraction search per budget; the note gives what finding the fraction cost."""
    search = FractionSearch(mut, bisect_steps, peer)
    cells = []
    for label, b in budgets:
        res = search.for_budget(b)
        if res.probe.candidate is None:
            cells.append(Cell(label, b, peer.method, None, "error", res.probe.error))
            continue
        note = f"search: {len(res.consulted)} probes, {res.cost_s:.0f} s"
        cells.append(Cell(label, b, peer.method, res.probe.candidate, note=note))
    lowest = search.probe(0.0)
    if lowest.candidate is None:
        cells.append(Cell(OWN_MIN, None, peer.method, None, "error", lowest.error))
    else:
        cells.append(Cell(OWN_MIN, lowest.peak, peer.method, lowest.candidate, note="fraction 0"))
    return cells


def compile_cells(mut: ModelUnderTest, budgets: Budgets, bisect_steps: int = 4, **_) -> list[Cell]:
    """``torch.compile(model)`` with Inductor, ``activation_memory_budget`` searched."""
    return _peer_cells(INDUCTOR, mut, budgets, bisect_steps)


def compile_eager_cells(mut: ModelUnderTest, budgets: Budgets, bisect_steps: int = 4, **_) -> list[Cell]:
    """The same search with ``aot_eager_decomp_partition``: the partitioner without Inductor's fusion."""
    return _peer_cells(AOT_EAGER, mut, budgets, bisect_steps)


def _first_step_s(cand: Candidate, mut: ModelUnderTest) -> float:
    """Wall time of one unmeasured step: where a compiled runtime compiles, kept out of the measurement."""
    clear_grads(cand.params)
    start = time.perf_counter()
    cand.module(*mut.args, **mut.kwargs).backward()
    elapsed = time.perf_counter() - start
    clear_grads(cand.params)
    return elapsed


def _memplan_candidate(
    method: str, mut: ModelUnderTest, budget: int, time_limit: float, seen: dict[tuple, Candidate], **options
) -> Candidate:
    """Plan at ``budget`` and measure; a plan identical to one already measured reuses it."""
    start = time.perf_counter()
    opt = memplan.optimize(
        mut.step,
        budget,
        example_inputs=mut.args,
        example_kwargs=mut.kwargs,
        solver="auto",
        time_limit=time_limit,
        **options,
    )
    plan_s = time.perf_counter() - start
    plan = opt.plan
    key = (plan.predicted_peak, plan.predicted_time, plan.method)
    if key in seen:
        return seen[key]
    cand = Candidate(
        method,
        f"{plan.method}, predicted {plan.predicted_peak / 1e6:.1f} MB, {plan.predicted_overhead:.2f}x",
        opt,
        mut.eager_params,
        plan_s=plan_s,
        compiled=bool(options.get("compile")),
    )
    if cand.compiled:
        _split_compile_time(cand, mut)
    seen[key] = mut.measure(cand)
    return cand


def _split_compile_time(cand: Candidate, mut: ModelUnderTest) -> None:
    """Inductor's seconds apart from planning's, and what was compiled in the note.

    The compiled runtime's ``compile_report`` (``OptimizedModule.compile_report``) times
    Inductor; when it exists right after ``optimize`` the compiling was part of that call and
    leaves ``plan_s``. Without a report, the first step's wall time stands for the compile time.
    """
    compiled_in_optimize = getattr(cand.module, "compile_report", None)
    first_step_s = _first_step_s(cand, mut)
    report = getattr(cand.module, "compile_report", None)
    if report is None:
        cand.compile_s = first_step_s
        return
    cand.compile_s = report.compile_s
    if compiled_in_optimize is not None:
        cand.plan_s -= report.compile_s
    cand.note = report.summary()


def _compile_not_accepted(exc: TypeError, options: dict) -> bool:
    """``optimize`` refused ``compile=`` (a memplan without the compiled runtime)."""
    return "compile" in options and "compile" in str(exc)


def _memplan_cells(
    method: str, mut: ModelUnderTest, budgets: Budgets, time_limit: float, **options
) -> list[Cell]:
    cells = []
    seen: dict[tuple, Candidate] = {}
    try:
        memplan.optimize(
            mut.step, 1, example_inputs=mut.args, example_kwargs=mut.kwargs, time_limit=time_limit, **options
        )
        minimum = 1
    except memplan.InfeasibleBudgetError as exc:
        minimum = exc.min_budget
    except TypeError as exc:
        if _compile_not_accepted(exc, options):
            return _unavailable(method, budgets, "n/a", f"skipped: this memplan.optimize has no compile= ({exc})"[:200])
        return _unavailable(method, budgets, "error", f"{type(exc).__name__}: {exc}"[:200])
    except Exception as exc:
        return _unavailable(method, budgets, "error", f"{type(exc).__name__}: {exc}"[:200])
    for label, b in budgets + [(OWN_MIN, minimum)]:
        if b < minimum:
            cells.append(Cell(label, b, method, None, "infeasible", f"min {minimum / 1e6:.1f} MB"))
            continue
        try:
            cand = _memplan_candidate(method, mut, b, time_limit, seen, **options)
        except memplan.InfeasibleBudgetError as exc:
            cells.append(Cell(label, b, method, None, "infeasible", f"min {exc.min_budget / 1e6:.1f} MB"))
            continue
        except Exception as exc:
            cells.append(Cell(label, b, method, None, "error", f"{type(exc).__name__}: {exc}"[:200]))
            continue
        cells.append(Cell(label, b, method, cand))
    return cells


def memplan_cells(mut: ModelUnderTest, budgets: Budgets, memplan_time_limit: float = 30.0, **_) -> list[Cell]:
    return _memplan_cells(MEMPLAN, mut, budgets, memplan_time_limit)


def memplan_compiled_cells(
    mut: ModelUnderTest, budgets: Budgets, memplan_time_limit: float = 30.0, **_
) -> list[Cell]:
    """memplan's plans run by its compiled runtime (``optimize(..., compile=True)``). These rows are
    measured by the allocator's events (`memplan.measure.tracker.profiled_peak`), which count the scratch the
    CPU kernels allocate for themselves: the plans make room for it (``kernel_scratch=True``)."""
    return _memplan_cells(MEMPLAN_COMPILED, mut, budgets, memplan_time_limit, compile=True, kernel_scratch=True)


def memplan_offload_cells(
    mut: ModelUnderTest, budgets: Budgets, memplan_time_limit: float = 30.0, **_
) -> list[Cell]:
    return _memplan_cells(MEMPLAN_OFFLOAD, mut, budgets, memplan_time_limit, offload=True)


MethodFn = Callable[..., list[Cell]]

# Table order.
METHODS: dict[str, MethodFn] = {
    EAGER: eager_cells,
    CKPT_BLOCKS: checkpoint_block_cells,
    CKPT_SEQ: checkpoint_chain_cells,
    COMPILE: compile_cells,
    COMPILE_EAGER: compile_eager_cells,
    MEMPLAN: memplan_cells,
    MEMPLAN_COMPILED: memplan_compiled_cells,
    MEMPLAN_OFFLOAD: memplan_offload_cells,
}

# What runs when no --methods are given: the six rows of issue #28's tables.
# The eager-decomposition peer and offloading (a real copy on CPU) are asked for by name.
DEFAULT_METHODS: tuple[str, ...] = (EAGER, CKPT_BLOCKS, CKPT_SEQ, COMPILE, MEMPLAN, MEMPLAN_COMPILED)

# Short names for --methods.
ALIASES: dict[str, str] = {
    "eager": EAGER,
    "ckpt": CKPT_BLOCKS,
    "ckpt_seq": CKPT_SEQ,
    "inductor": COMPILE,
    "compile": COMPILE,
    "compile_aot_eager": COMPILE_EAGER,
    "memplan": MEMPLAN,
    "memplan_compiled": MEMPLAN_COMPILED,
    "offload": MEMPLAN_OFFLOAD,
}
