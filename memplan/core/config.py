"""Every tunable of memplan in one place: the thresholds, margins, counts and sizes that decide
how plans are made, checked, run and drawn.

Code reads them where it uses them, from `TUNABLES`, so a change takes effect at once; tests
change them through `override` (a context manager, or `override_tunables` as a pytest
fixture helper), and nothing monkeypatches a module's constant. Options a user gives per call
(`memplan.PlanOptions`, `memplan.StepOptions`) are not here: these are the project's own
settings, with the reason for each value beside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass
class Tunables:
    """memplan's tunables, each with its reason."""

    # ---- planning time (memplan.pipeline.plan) ----
    default_time_limit: float = 8.0
    """``optimize()`` without a ``time_limit`` plans within this many seconds, whole call (the eager
    replay of a relative budget, capture, costs, solve, runtime): a model reaches its first planned
    step in seconds. A graph of more than `default_free_ops` ATen ops gets more (`PlanningClock.sized_to`)."""
    default_gap: float = 0.03
    """Without a ``time_limit`` the search stops as soon as its plan is proven within this gap of
    optimal (with one, it goes on to the strategy's own, tighter gap)."""
    default_free_ops: int = 2500
    """... for a joint graph of up to this many ATen ops (a 12-layer GPT-2's has 2,052, the zoo's ViT
    1,071): the planning-latency benchmark's first steps stay within 10 s (issue #28) ..."""
    default_seconds_per_op: float = 0.032
    """... and each op beyond them adds this many seconds: capture, analysis and each solve grow with
    the graph, and a 1.3B-parameter GPT's (3,810 ops, 50 s in all) needs about 15 s of search, where 8 s
    in all left its plan 1.5x slower."""
    progress_after_seconds: float = 5.0
    """A planning call that has run this long says on stderr, one line per phase, what it has done and
    what it does next (a billion-parameter step plans for about a minute: silence looks like a hang)."""
    placement_probe_seconds: float = 1.0
    """A whole step's placement reached by moving optimizer state to the host is first solved this
    long (`memplan.pipeline.plan.whole_step_plan`): a placement that cannot fit fails in seconds, not
    the whole limit, and only one that fits is searched further."""
    reorder_repair_seconds: float = 20.0
    """A schedule that moving the optimizer updates after their parameters' reads put over the budget
    is recomputed down again for at most this long in all, past the time limit if need be: the plan is
    lost otherwise (`memplan.planning.lowering.updates_after_reads_within`; a 1.3B-parameter GPT's: 7 s, then 6 s)."""
    min_solve_time: float = 1.0
    """The solver gets at least this many seconds, whatever capture took: a plan is still needed."""

    # ---- compiled runs (memplan.runtime.inductor) ----
    min_run_ops: int = 3
    """Shorter runs stay eager: a compile costs seconds and a run of one or two ops fuses nothing."""
    compile_passes: int = 3
    """Compile passes of a segment: each makes in their traced layout the values the last one copied."""
    slower_margin: float = 1.05
    """A compiled run measured this much slower than its eager twin runs eagerly (the margin is
    timing noise)."""
    step_slower_margin: float = 1.05
    """A whole step predicted this much slower compiled than eager runs eagerly."""
    timing_rounds: int = 3
    """A compiled run and its eager twin are timed in turn this many times, the best of each kept."""
    doubtful: float = 1.3
    """A run first measured slower, but by less than this factor, is timed `doubt_rounds` more times
    before it is refused (three rounds refused ConvNeXt's compiled forward in two benchmark runs of three)."""
    doubt_rounds: int = 6
    """The timings of a doubtful run."""
    clock: Callable[[], float] = time.perf_counter
    """What the speed check times compiled runs and their eager twins by (seconds): every verdict of
    that check reads it, so a test gives a clock whose time it decides."""

    # ---- the torch.compile backend (memplan.frontend) ----
    reuse_slack: float = 0.05
    """A graph keeps its plan while its allowance stays within this share below the plan's budget (and
    never above it): re-planning for every few bytes another graph's plan moves is not worth a solve."""
    max_levels: int = 16
    """Plans at this many budget levels are kept per graph, the least recently used going first: a graph
    called at many places in a step (an expert's, at every layer) has a level for each."""
    rehearsals: int = 6
    """The first step's rehearsal of the next steps replays the step at most this many times while the
    carry limits settle (each replay is what one more step would learn)."""
    min_budget_tries: int = 3
    """Budgets tried, at most, in looking for the smallest budget of a split that does not fit."""

    # ---- what the step does with its outputs and loss (memplan.frontend.module, memplan.passes.output_use) ----
    replan_fraction: float = 0.01
    """What learning how a step uses its outputs must be worth before memplan plans again: the bytes of
    the outputs concerned, as a fraction of the peak of the plan in use."""
    loss_outside_fraction: float = 0.05
    """A loss computed outside the module from outputs this large a share of the budget is worth a warning."""

    # ---- graph passes and costs ----
    max_view_fraction: float = 0.5
    """A late view is copied out when the copy frees at least as many bytes as it takes (memplan.passes.compaction)."""
    loss_scratch_blocks: int = 32
    """The fused loss backward makes its gradient this many blocks of rows at a time off the CPU: one
    block's bytes are the op's scratch (memplan.ops.fused_loss)."""
    min_scratch_bytes: int = 256
    """Kernel scratch under this many bytes is the allocator's rounding or a scalar, not worth a node of
    the Problem (memplan.measure.timing)."""

    # ---- the optimizer's probe (memplan.updates.probe) ----
    probe_numels: tuple[int, int] = (1024, 4096)
    """Numels of the two probe parameters each (group, dtype, device) is stepped with."""
    timing_numels: tuple[int, int] = (1 << 14, 1 << 18)
    """Numels of the two parameters an update is timed on with ``profile=True``: large enough that the
    per-element time shows above the fixed cost of one optimizer call (which the fit keeps)."""

    min_budget_search_seconds: float = 30.0
    """After a solve that does not fit, the minimum-budget search (what an InfeasibleBudgetError names,
    and how much optimizer state a whole step moves to the host) stops after the solve's time limit
    or this many seconds, whichever is longer, with the lowest peak found by then: on graphs of
    thousands of values it ends well before; on a 1.3B-parameter GPT each of its greedy probes took
    43-113 s."""

    # ---- update buckets (memplan.updates.buckets) ----
    bucket_bytes: int = 25 << 20
    """A bucket of optimizer updates (one ``step()`` call) holds at most this many parameter bytes at
    first: DDP's default bucket (25 MB), so that a bucket nests in the unit a distributed engine
    reduces, and what a bucket holds longer (its early gradients, one call's temporaries) stays a
    small share of a large model's step. A plan that does not fit so is made with one call per
    parameter."""
    min_buckets: int = 4
    """...and at most this share (1/n) of all the updated bytes, so that a small model's updates still
    come in several calls that overlap the rest of backward rather than one at its end."""

    # ---- plots (memplan.tools.viz) ----
    budget_shown_above_peak: float = 1.5
    """A budget more than this many times both peaks is left off plot_memory's scale."""
    plot_bins: int = 800
    """plot_memory draws this many slices of time (about one per pixel), each at its highest point."""


TUNABLES = Tunables()


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Tunables]:
    """Set some of `TUNABLES` inside the block, and put them back after; an unknown name raises."""
    known = {f.name for f in dataclasses.fields(Tunables)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"memplan has no tunable {', '.join(unknown)}; it has {', '.join(sorted(known))}")
    before = {name: getattr(TUNABLES, name) for name in changes}
    for name, value in changes.items():
        setattr(TUNABLES, name, value)
    try:
        yield TUNABLES
    finally:
        for name, value in before.items():
            setattr(TUNABLES, name, value)
