"""A solved plan for one input signature: the schedule, its predictions, its report.

``make_plan`` runs the pipeline (`memplan.pipeline.stages`) for a budget:
capture -> costs -> Problem -> solver -> Program.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import solvers
from solvers.core.memory import alias_trees
from solvers.core.sequence import tighten_frees
from memplan.planning.analysis import Analysis
from memplan.costs.cost_model import DeviceProfile, output_bytes
from memplan.updates.probe import ParamUpdate, UpdatePlacement, held_after_backward, host_updates, most_bucket_temp_bytes
from memplan.updates.runner import Accumulation
from memplan.updates.host_memory import HostMemoryError, check_host_memory, default_host_limit, host_update_bytes
from memplan.pipeline.options import CLIP_BY, OPTIMIZER_STATES
from memplan.passes.output_use import OutputUse
from memplan.passes.paging import is_paged, paged_bytes
from memplan.planning.decisions import Transfer, ValueDecision, fetched_bytes, transfers_of, value_decisions
from memplan.planning.saved_format import count_params, describe_inputs, graph_signature, input_signature, record_to_json
from memplan.planning.lowering import BACKWARD, CUT_RESERVE, dropped_input_names, updates_after_reads_within
from memplan.runtime.program import Program
from memplan.pipeline.stages import analyze_paged, analyze_placement, analyze_step, build_step, prepare_step, step_bucket_caps
from memplan.core.units import format_bytes
from memplan.core.config import TUNABLES
from memplan.core.host import is_host
from memplan.pipeline.clock import Attempts, PhaseTimer, PlanningClock
from memplan.pipeline.errors import InfeasibleBudgetError, none_where_unfit
from memplan.pipeline.paged_plan import plan_paging_as_needed


@dataclass
class Plan:
    """The plan for one input signature, with what it predicts."""

    budget: int
    predicted_peak: int
    predicted_time: float
    store_all_time: float
    store_all_peak: int
    method: str
    lower_bound: float | None
    solve_time: float
    status: str
    decisions: list[ValueDecision]
    schedule: "solvers.Schedule" = field(repr=False)
    analysis: Analysis = field(repr=False)
    transfers: list[Transfer] = field(default_factory=list)
    predicted_wait: float = 0.0  # predicted time compute waits for host copies
    host_bytes: int = 0  # most host memory the offloaded copies hold at once
    # Gradients the parameters held when the step started (accumulation): on the device all
    # step long, outside the graph; counted in predicted_peak, planned for with the rest of the budget.
    held_gradient_bytes: int = 0
    # A distributed engine's tensors held on the device all step long, outside the graph (DDP's
    # gradient buckets: `memplan.frontend.distributed`); counted in predicted_peak like held gradients.
    engine_bytes: int = 0
    # Where the planning call's time went, seconds per phase in order (`PhaseTimer`; empty for a
    # plan made from a schedule, not by `make_plan`).
    planning_time: dict[str, float] = field(default_factory=dict)

    @property
    def host_memory(self) -> dict[str, int]:
        """What the plan keeps in host memory at most, by kind (name -> bytes): the optimizer state
        its placement moved there with one bucket's update copies, and the activations it pages out."""
        placement = self.analysis.lowered.placement
        held = host_update_bytes(self.analysis.updates, placement.host, placement.bucket_bytes,
                                 placement.accumulate_steps, paged_bytes(self.analysis.capture.graph_module))
        return {**held, "paged activations": self.host_bytes} if self.host_bytes else held

    @property
    def host_traffic(self) -> tuple[int, int]:
        """Bytes the plan moves over the host link in a step that updates: (to the host, back to the
        device). The activations it pages out, and back where read again; each host update's gradient
        and parameter out, and the parameter back (`memplan.updates.host_state`); a paged parameter's
        gradient out, and the parameter in at each of its fetches (`memplan.passes.paging`)."""
        hosted = [u for u in self.analysis.updates if u.name in self.analysis.lowered.placement.host]
        out = sum(t.nbytes for t in self.transfers) + sum(u.grad_bytes * (1 if u.paged else 2) for u in hosted)
        back = (sum(t.nbytes for t in self.transfers if t.back_before is not None)
                + sum(u.grad_bytes for u in hosted if not u.paged) + self.fetched_bytes)
        return out, back

    @property
    def paged_parameters(self) -> frozenset[str]:
        """Names of the parameters the plan keeps in host memory between their uses (`memplan.passes.paging`)."""
        cap = self.analysis.capture
        return frozenset(info.name for node, info in zip(cap.placeholders(), cap.primals)
                         if info.kind == "param" and is_paged(node))

    @functools.cached_property
    def fetched_bytes(self) -> int:
        """Bytes of paged parameters fetched to the device in a step, each fetch of each counted."""
        return fetched_bytes(self.analysis, self.schedule)

    @property
    def link_time(self) -> float:
        """Seconds the host link needs for `host_traffic` at the profile's bandwidth, each direction
        at once (a PCIe link is full duplex): a step cannot be faster; 0 without a host link."""
        bandwidth = host_bandwidth(self.analysis)
        return max(self.host_traffic) / bandwidth if bandwidth else 0.0

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over store-all's (>= 1.0)."""
        return self.predicted_time / self.store_all_time if self.store_all_time else 1.0

    @functools.cached_property
    def output_bytes(self) -> list[int]:
        """Bytes of each output tensor of the step, by output index (read after every backward)."""
        return output_bytes(self.analysis.capture, self.analysis.costs)

    @functools.cached_property
    def simulated(self) -> "solvers.SimResult":
        """The schedule replayed by the simulator on the problem it was solved for (with the host
        link when it moves values to host memory): its memory timeline, step by step."""
        offloads = any(op == "offload" for op, _ in self.schedule)
        return solvers.simulate(problem_for(self.analysis, self.budget, offloads), list(self.schedule))

    @functools.cached_property
    def carried_bytes(self) -> int:
        """Bytes resident when the forward returns beyond what was resident when the step began
        (its parameters, buffers and inputs): what the forward leaves for the backward, and its
        outputs; what this step holds while other code runs between its forward and its backward
        (`solvers.strategies.ledger`)."""
        steps = list(self.schedule)
        cut = next(k for k, (op, node) in enumerate(steps) if op == "compute" and node == BACKWARD)
        problem = self.analysis.lowered.problem
        result = self.simulated
        # timeline[k] is memory after step k: the step before the barrier (which makes the tangents),
        # less the room a carry limit reserves there (`memplan.planning.lowering.CUT_RESERVE`)
        reserve = problem.mem[problem.index[CUT_RESERVE]] if CUT_RESERVE in problem.index else 0
        # an input the caller lets go when forward returns is held to the barrier, not past it,
        # unless the backward reads it (`memplan.passes.output_use.OutputUse.inputs_dropped`)
        computed_after = {problem.index[node] for op, node in steps[cut + 1:] if op == "compute"}
        trees = alias_trees(problem)

        def read_after_cut(x: int) -> bool:  # it, or a view of it (which holds its storage), read or made there
            storage = (x, *trees.descendants.get(x, ()))
            return any(v in computed_after or computed_after.intersection(problem.succs[v]) for v in storage)

        let_go = sum(int(problem.mem[problem.index[x]]) for x in dropped_input_names(self.analysis.capture)
                     if not read_after_cut(problem.index[x]))
        return max(0, int(result.timeline[cut - 1]) - result.initial - reserve - let_go) if cut else 0

    @functools.cached_property
    def phase_peaks(self) -> tuple[int, int]:
        """The most memory the plan holds in its forward and in its backward (the schedule split
        where the backward begins), counting what it really allocates: the room a carry limit
        reserves at the end of forward (``CUT_RESERVE``) is for the other plans of the step, not
        memory of this one. What a step with several plans predicts from (`StepLedger.predict`)."""
        steps = list(self.schedule)
        timeline = self.simulated.timeline.astype("int64").copy()
        problem = self.analysis.lowered.problem
        if CUT_RESERVE in problem.index:
            reserve = int(problem.mem[problem.index[CUT_RESERVE]])
            made = next((k for k, (op, node) in enumerate(steps) if op == "compute" and node == CUT_RESERVE), None)
            if made is not None:
                freed = next((k for k, (op, node) in enumerate(steps)
                              if k > made and op == "free" and node == CUT_RESERVE), len(steps))
                timeline[made:freed] -= reserve  # timeline[k]: memory after step k
        cut = next((k for k, (op, node) in enumerate(steps) if op == "compute" and node == BACKWARD), len(steps))
        initial = int(self.simulated.initial)
        forward = max([initial, *timeline[:cut].tolist()])
        backward = max([initial, *timeline[cut:].tolist()])
        return forward, backward

    @property
    def gap(self) -> float | None:
        """Relative distance (time - bound) / time of the plan's predicted step time from the
        solver's proven lower bound (the same measure as ``solvers.Solution.gap``)."""
        if self.lower_bound is None or self.lower_bound <= 0 or self.predicted_time <= 0:
            return None
        return max(0.0, 1.0 - self.lower_bound / self.predicted_time)

    def record(self) -> dict:
        """What a saved plan records about this plan (`memplan.planning.saved_format`): the fields of
        `memplan.pipeline.saved.SavedPlan` but ``path``."""
        cap = self.analysis.capture
        return dict(
            budget=self.budget,
            predicted_peak=self.predicted_peak,
            predicted_time=self.predicted_time,
            method=self.method,
            status=self.status,
            lower_bound=self.lower_bound,
            solve_time=self.solve_time,
            graph_signature=graph_signature(cap),
            input_signature=input_signature(cap),
            inputs=describe_inputs(cap),
            num_nodes=cap.num_ops(),
            num_params=count_params(cap),
            schedule=self.schedule,
            output_use=cap.output_use,
            **({"placement": self.analysis.lowered.placement,
                "optimizer_state_bytes": self.analysis.all_optimizer_state_bytes}
               if self.analysis.lowered.updates else {}),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` (JSON) for ``memplan.load_plan`` / ``optimize(..., plan=path)``.
        A plan that pages parameters is refused (`NotImplementedError`): ``plan=`` does not page."""
        if self.paged_parameters:
            raise NotImplementedError(f"memplan: this plan pages {len(self.paged_parameters)} parameters to host "
                                      "memory, and a saved plan cannot page them yet (optimize(plan=...) keeps "
                                      "the parameters on the device): plan the step again instead of saving it")
        Path(path).write_text(record_to_json(self.record()))

    def report(self) -> str:
        a = self.analysis
        counts = Counter(d.decision for d in self.decisions)
        recomputed = sum(d.nbytes for d in self.decisions if d.decision == "recompute")
        offloaded = sum(t.nbytes for t in self.transfers)
        lines = [
            "memplan plan",
            f"  parameters       {format_bytes(a.param_bytes)}" + (
                f" ({format_bytes(paged_bytes(a.capture.graph_module))} of them, {len(self.paged_parameters)} "
                f"parameters, paged: in host memory, {format_bytes(self.fetched_bytes)} fetched to the device a step)"
                if self.paged_parameters else ""),
            f"  eager peak       {format_bytes(a.eager_peak)} (eager autograd, replayed on fake tensors)",
            f"  store-all peak   {format_bytes(self.store_all_peak)} (joint graph, every value kept until last use)",
            f"  budget           {format_bytes(self.budget)}",
            f"  planned peak     {format_bytes(self.predicted_peak)} (predicted"
            + (f"; with {format_bytes(self.held_gradient_bytes)} of gradients held from an earlier step"
               if self.held_gradient_bytes else "")
            + (f"; with {format_bytes(self.engine_bytes)} of DDP's gradient buckets" if self.engine_bytes else "")
            + ")",
            f"  overhead         {self.predicted_overhead:.3f}x store-all step time (predicted)",
            f"  method           {self.method} ({self.status}), solved in {self.solve_time:.2f} s"
            + (f", gap {self.gap:.1%}" if self.gap is not None else ""),
            *([f"  planning         {sum(self.planning_time.values()):.2f} s: " + ", ".join(
                f"{phase} {seconds:.2f} s" for phase, seconds in self.planning_time.items() if seconds >= 0.005)]
              if self.planning_time else []),
            f"  values           {counts.get('keep', 0)} kept, {counts.get('recompute', 0)} recomputed "
            f"({format_bytes(recomputed)} not held across the step), {len(self.transfers)} offloaded "
            f"({format_bytes(offloaded)})",
        ]
        if a.lowered.updates:
            low = a.lowered
            when = ("once every gradient is final" if low.updates_after_backward
                    else "in a second backward pass, clipped by the norm a first pass computed, as soon as its "
                         "gradient is final and its last read done" if low.placement.norm_pass
                    else "as soon as its gradient is final and its last read done")
            calls = len(low.buckets)
            lines.append(f"  optimizer        {len(low.updates)} parameters updated in backward in {calls} optimizer "
                         f"call{'s' if calls != 1 else ''} ("
                         + (f"buckets of at most {format_bytes(low.placement.bucket_bytes)}"
                            if low.placement.bucket_bytes else "one per parameter") + f"), each {when}, "
                         f"its gradient freed; {format_bytes(a.optimizer_state_bytes)} of optimizer state on the "
                         "device, in the budget")
            if low.host_states:
                lines.append(f"  host updates     {len(low.host_states)} of them keep their state in host memory "
                             f"({format_bytes(a.host_optimizer_state_bytes)}) and are updated there: "
                             + "; ".join(part for part in (
                                 "a paged parameter's gradient copied out, the parameter stepped where it is"
                                 if any(u.paged for u in a.updates) else "",
                                 "a device parameter's gradient and the parameter copied out, the parameter copied back"
                                 if any(not u.paged and u.name in low.host_states for u in a.updates) else "")
                                 if part))
            if low.placement.accumulate_steps > 1:
                lines.append(f"  accumulation     updates every {low.placement.accumulate_steps} steps; "
                             f"{format_bytes(a.accumulated_gradient_bytes)} of accumulated gradients held "
                             "between them, in the budget")
        if a.capture.output_use:
            lines.append(f"  outputs          {a.capture.output_use.describe()} (seen at an earlier backward, "
                         "or assumed where only such a plan fits)")
        if a.capture.copied_views:
            copied = a.capture.copied_views
            lines.append(f"  copied out       {len(copied)} late-read views ({format_bytes(sum(c.view_bytes for c in copied))}), "
                         f"so the rest of their storages ({format_bytes(sum(c.storage_bytes - c.view_bytes for c in copied))}) "
                         "is freed early")
        if a.capture.dropouts_split:
            split = a.capture.dropouts_split
            applied = {s.apply for s in split}
            by_multiply = sum(d.decision == "recompute" and d.name in applied for d in self.decisions)
            lines.append(f"  dropouts         {len(split)} split into their mask's draw and a multiply; "
                         f"{by_multiply} outputs recomputed by the multiply alone, their masks kept")
        if a.capture.losses_fused:
            saved = sum(a.costs.values[f.fused].nbytes - a.costs.values[f.fused].scratch for f in a.capture.losses_fused)
            lines.append(f"  loss backward    {len(a.capture.losses_fused)} cross-entropy backward(s) in one buffer: "
                         f"{format_bytes(saved)} less held while they run")
        if self.transfers:
            lines.append(f"  host link        {format_bytes(self.host_bytes)} held on host at most; compute waits "
                         f"{self.predicted_wait * 1e3:.2f} ms for copies (predicted)")
            lines.append("  offloaded (largest first): value, size, out after [ms], back before [ms]")
            for t in sorted(self.transfers, key=lambda t: -t.nbytes)[:10]:
                back = f"{t.back_before} [{t.back_time * 1e3:.2f}]" if t.back_before is not None else "-"
                lines.append(f"    {t.name:<28s} {format_bytes(t.nbytes):>10s}  {t.out_after} [{t.out_time * 1e3:.2f}]"
                             f"  {back}")
            if len(self.transfers) > 10:
                lines.append(f"    ... and {len(self.transfers) - 10} more")
        return "\n".join(lines)


def make_plan(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    budget: int,
    *,
    solver: str = "auto",
    time_limit: float | None = None,
    profile: DeviceProfile,
    measure_on: torch.device | None = None,
    scratch_on: torch.device | None = None,
    offload: bool = False,
    output_use: OutputUse = OutputUse(),
    optimizer: torch.optim.Optimizer | None = None,
    grad_norm: bool = False,
    updates_after_backward: bool = False,
    max_grad_norm: float | None = None,
    optimizer_state: str = "auto",
    parameters: str = "device",
    accumulation: Accumulation | None = None,
    clip_by: str = "auto",
    carry_limit: int | None = None,
    started: float | None = None,
    eager_peak: int | None = None,
    handout_bytes: int | None = None,
    host_memory: int | None = None,
    search_minimum: bool = True,
) -> tuple[Plan, Program]:
    """Capture, cost, lower, solve and lower back to a runnable :class:`Program`.

    ``time_limit`` bounds the whole call, from ``started`` (a `time.perf_counter` reading; default:
    now) when the caller did work of its own first (`PlanningClock`; None: `TUNABLES.default_time_limit`,
    stopping at `TUNABLES.default_gap`). ``eager_peak``: the eager step's peak when the caller has replayed
    it already for this output use (it is replayed otherwise).

    ``measure_on``: time every op on that device instead of using the roofline.
    ``scratch_on``: measure there the scratch of the kernels that allocate for themselves
    (`memplan.measure.timing.measure_op_scratch`), which the plan then makes room for.
    ``offload``: let the plan page values to host memory over the profile's host link.
    ``output_use``: what the step is known to do with the outputs (:mod:`memplan.passes.output_use`).
    ``optimizer``: the step also applies this optimizer's updates, in backward, with its state
    in the budget (:mod:`memplan.updates.probe`); ``grad_norm``: keep the norm of the gradients it applies;
    ``updates_after_backward``: every update after backward, not as soon as its gradient is final
    (which is tried first otherwise, and left for this where it does not fit); ``max_grad_norm``:
    clip the gradients' global norm to it before the updates (which then come after backward);
    ``optimizer_state``: "device", "host" (every parameter's state in host memory, updated
    there) or "auto" (on the device, and in host memory for as many parameters as the budget
    needs: `whole_step_plan`); ``parameters``: "host", every parameter lives in host memory between
    its uses, fetched before them (`memplan.passes.paging`); "auto", as many as a step that does not
    fit otherwise needs (`solve_paging_as_needed`); "device", none; ``accumulation``: update once every ``accumulation.steps`` steps;
    ``clip_by`` (with ``max_grad_norm``): "holding" every gradient to the end of backward,
    "norm_pass" (a first backward pass computes the norm) or "auto" (holding where it fits).
    ``carry_limit``: the plan carries at most this many bytes beyond its sources from its forward
    into its backward (`memplan.planning.lowering.CUT_RESERVE`; a graph of a step with several plans).
    ``handout_bytes``: the program hands gradients to a distributed engine (`build_step`).
    ``host_memory``: bytes of host memory the plan may keep there (None: what the machine has
    available now); state moves there only while it fits, and a plan that needs more raises
    `HostMemoryError` (`memplan.updates.host_memory`). ``search_minimum`` False: a step that does not fit
    raises with the lowest peak a solve reached, no minimum searched for (the caller tries something else next).
    """
    if clip_by not in CLIP_BY:
        raise ValueError(f"clip_by={clip_by!r}: give one of {', '.join(CLIP_BY)}")
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state={optimizer_state!r}: give one of {', '.join(OPTIMIZER_STATES)}")
    clock = PlanningClock.begin(time_limit, started)
    phases = PhaseTimer(clock.started)
    phases.lap("eager replay")  # the caller's, for a budget relative to the eager peak (0 when none)
    lap_as = {"capture": "capture", "optimizer": "optimizer", "eager": "eager replay"}

    @contextlib.contextmanager
    def lapped(key: str, text: str):
        yield
        phases.lap(lap_as[key])

    prepared = prepare_step(model, args, kwargs, profile=profile, output_use=output_use, optimizer=optimizer,
                            measure_on=measure_on, eager_peak=eager_peak, stage=lapped,
                            paged=parameters == "host")
    updates = prepared.updates
    steps = accumulation.steps if accumulation is not None else 1
    clipping = max_grad_norm is not None
    forced_pass = clipping and clip_by == "norm_pass" and not updates_after_backward and steps == 1
    first = UpdatePlacement(after_backward=(updates_after_backward or clipping) and not forced_pass,
                            host=frozenset(u.name for u in updates) if optimizer_state == "host" else frozenset(),
                            accumulate_steps=steps, norm_pass=forced_pass,
                            bucket_bytes=step_bucket_caps(updates)[0] if updates else 0)
    analysis = analyze_step(prepared, profile, measure_on=measure_on, placement=first,
                            carry_limit=None if carry_limit is None else (carry_limit, budget), scratch_on=scratch_on)
    phases.lap("analysis")
    clock = clock.sized_to(analysis.num_nodes)
    clock.warn_if_spent("capturing and analyzing the step")
    phases.next(f"solving the step ({analysis.num_nodes:,} ops), {clock.solve_limit():.0f} s of the time limit left")
    solve_options = dict(may_move_state=optimizer_state == "auto",
                         norm_pass=clipping and clip_by == "auto" and not updates_after_backward and steps == 1,
                         solver=solver, clock=clock, offload=offload,
                         host_limit=(default_host_limit(optimizer, model, pageable=parameters == "auto")
                                     if host_memory is None else host_memory))
    if parameters == "auto" and updates and optimizer_state != "device":
        plan = solve_paging_as_needed(analysis, budget, model, optimizer, **solve_options)
    else:
        plan = solve_whole_step(analysis, budget, search_minimum=search_minimum, **solve_options)
    phases.lap("solve")
    program = build_step(plan.analysis, plan.schedule, plan.simulated.timeline, model, optimizer, grad_norm,
                         max_grad_norm, accumulation, handout_bytes)
    phases.lap("runtime")
    return dataclasses.replace(plan, planning_time=phases.seconds), program


def solve_paging_as_needed(analysis: Analysis, budget: int, model: torch.nn.Module,
                           optimizer: torch.optim.Optimizer | None, *, clock: PlanningClock | None = None,
                           **options) -> Plan:
    """`solve_whole_step` (``options`` are its own), and where no plan fits so, the same step with
    parameters paged, as many as it needs (`memplan.pipeline.paged_plan`; ``parameters="auto"``),
    every optimizer state in host memory then. Parameters ``model`` keeps in host memory already
    (an earlier plan's, for other inputs) are paged from the start."""
    def solve(step: Analysis, last: bool, seconds: float | None) -> Plan:
        limited = clock
        if seconds is not None and math.isfinite(seconds):  # (at most that share of what is left)
            limited = (PlanningClock.begin(seconds) if clock is None else
                       dataclasses.replace(clock, limit=min(clock.limit, clock.elapsed() + seconds)))
        return solve_whole_step(step, budget, clock=limited, search_minimum=last, **options)

    placement = dataclasses.replace(analysis.lowered.placement, host=frozenset(u.name for u in analysis.updates))
    return plan_paging_as_needed(analysis, budget, solve,
                                 lambda names: analyze_paged(analysis, names, model, optimizer, placement),
                                 paged_already=frozenset(name for name, p in model.named_parameters() if is_host(p)),
                                 time_left=clock.time_left if clock else lambda: math.inf,
                                 probe_seconds=TUNABLES.placement_probe_seconds)


def solve_whole_step(analysis: Analysis, budget: int, *, may_move_state: bool = True, norm_pass: bool = False,
                     clock: PlanningClock | None = None, host_limit: int | None = None, search_minimum: bool = True,
                     **solve_options) -> Plan:
    """`solve_plan` for a step with optimizer updates: the first placement of them that fits
    (`whole_step_plan`), starting from the analysis' own; each other placement is the same step
    lowered again (its costs reused). ``norm_pass``: the step clips, and may do so with a first
    backward pass instead of holding the gradients. ``clock``: each solve gets what is left of
    the planning call's time limit, and stops at its gap. ``host_limit``: bytes of host memory the
    plan may keep there (None: no limit); a plan that needs more raises `HostMemoryError` (with all
    state on the host from the start, before solving). ``search_minimum``: a step no placement fits
    searches for its minimum budget for the error (False: the error has the lowest peak a solve
    reached, when the caller tries something else next). ``solve_options``: `solve_plan`'s."""
    def options() -> dict:
        """``solve_options``, with what is left of the clock's limit when one is given (read per solve)."""
        if clock is None:
            return solve_options
        return {**solve_options, "time_limit": clock.solve_limit(), "gap": clock.gap}

    recent: list[Analysis] = []  # the last two placements lowered: a probed one is solved again in full
    attempts = Attempts(clock.time_left if clock else lambda: math.inf)

    def solve_for(placement: UpdatePlacement, search_minimum: bool = True, probe: bool = False) -> Plan:
        def attempt() -> Plan:
            again = next((a for a in (analysis, *recent) if a.lowered.placement == placement), None)
            if again is None:
                again = analyze_placement(analysis, placement)
                recent[:] = [*recent[-1:], again]
            chosen = dict(options())
            if probe:
                chosen["time_limit"] = min(chosen.get("time_limit") or math.inf, TUNABLES.placement_probe_seconds)
            return solve_plan(again, budget, search_minimum=search_minimum, **chosen)

        return attempts.run(attempt)

    try:
        if host_limit is not None:
            placed = analysis.lowered.placement
            check_host_memory(host_update_bytes(analysis.updates, placed.host, placed.bucket_bytes,
                                                placed.accumulate_steps, paged_bytes(analysis.capture.graph_module)),
                              host_limit)
        if not analysis.updates:
            plan = solve_plan(analysis, budget, search_minimum=search_minimum, **options())
        else:
            plan = whole_step_plan(solve_for, analysis.updates, analysis.lowered.placement, budget, may_move_state,
                                   norm_pass, step_bucket_caps(analysis.updates),
                                   out_of_time=lambda: not attempts.affordable(), host_limit=host_limit,
                                   search_minimum=search_minimum)
        if host_limit is not None:
            check_host_memory(plan.host_memory, host_limit)
        return plan
    except HostMemoryError as exc:  # (a plan assuming fewer outputs get gradients may fit: `optimize` tries it)
        exc.addend_only_outputs = analysis.capture.addend_only_outputs
        raise




def whole_step_plan(solve_for: Callable[..., Plan], updates: list, first: UpdatePlacement, budget: int,
                    may_move_state: bool, norm_pass: bool = False, caps: Sequence[int] = (0,),
                    out_of_time: Callable[[], bool] = lambda: False, host_limit: int | None = None,
                    search_minimum: bool = True) -> Plan:
    """The plan of the first placement of the optimizer's updates that fits ``budget``, tried in order:

    1. ``first`` (updates as soon as each gradient is final, unless it says after backward);
    2. the same with every update after backward: updates in backward that do not fit bring
       their temporaries while activations are alive; after backward the gradients are held
       to its end instead, as ``optimizer.step()`` after ``backward()``. A clipping step
       (``norm_pass``) holds the gradients first, and then tries a first backward pass that
       computes only the norm (each gradient freed at once), the updates in the second;
    3. with ``may_move_state``, the optimizer state of more parameters in host memory, the
       largest first (`memplan.updates.probe.host_updates`), as many bytes as the last attempt's
       smallest plan was over the budget, then 1 and 2 again; until all state is there.

    Each placement is tried with each bucket cap of ``caps`` in turn (`memplan.updates.buckets.bucket_caps`:
    the largest buckets, the fewest optimizer calls, first; one call per parameter last): the
    first plan that recomputes and moves nothing is taken, else the fastest that fits (the
    predicted time counts each bucket's call).

    While state can still move, what cannot help is not solved (on a billion parameters each
    attempt is a lowering of seconds and a solve): a smaller cap where the first fell short by
    more than its buckets' temporaries could give back, and updates after backward where the
    gradients, parameters and device state alone exceed the budget (`held_after_backward`).
    Nor is the minimum budget searched for then: a solve that finds no plan says how far it got.
    Where no state can move, the minimum is searched for only once no attempt fits, for the error
    (`_searched_minimums`): a step whose first cap falls short and whose next fits searches nothing.
    A placement reached by moving state is solved briefly first, as is every state in host memory
    (`_against_all_on_host`), and the faster is searched in full in what is left of the limit.

    ``solve_for(placement, search_minimum, probe)`` solves the step in one placement (raising
    `InfeasibleBudgetError`; without ``search_minimum``, at once below the trivial bound, and with the
    lowest peak it reached otherwise; with ``probe``, within `TUNABLES.placement_probe_seconds`: a
    placement reached by moving state is probed so, and solved in full only once it fits).
    ``out_of_time()``: another attempt would end past the planning call's limit (`Attempts`): a plan in
    hand is kept (no further bucket cap or refinement is tried).
    ``host_limit``: bytes of host memory the moved state may take (`host_update_bytes`): a state the
    host cannot take is passed over for smaller ones, and where the device still needs more moved
    than the host can take, `HostMemoryError` says so. ``search_minimum`` False: where nothing fits,
    the error has the lowest peak a solve reached, no minimum searched for (the caller pages next).
    Recomputation is tried before host updates (a host update costs a parameter's round trip over
    the host link and the host's lower throughput on every step); once state must move, the
    simulator's predicted times decide between just enough and all of it. The errors of the
    placements tried are let go on leaving: none outlives the call."""
    placement = first
    best: InfeasibleBudgetError | None = None  # the lowest minimum of the placements tried
    errors: list[Exception] = []
    try:
        while True:
            if not updates:
                tries = [placement]
            elif norm_pass:
                tries = [placement, dataclasses.replace(placement, after_backward=False, norm_pass=True)]
            elif placement.after_backward:
                tries = [placement]
            else:
                tries = [placement, dataclasses.replace(placement, after_backward=True)]
            errors = []
            unsearched: list[UpdatePlacement] = []  # attempts that did not fit, their minimum not searched for
            on_device = [u for u in updates if u.name not in placement.host]
            # While state can still move to the host, a placement that cannot fit is told apart
            # without the minimum-budget search (minutes on a billion parameters): the trivial bound,
            # or the lowest peak its solve reached, says how much must move at least.
            can_move = may_move_state and any(u.state_bytes > 0 for u in on_device)
            moved = placement.host != first.host  # (state moved on a shortfall: solved briefly first)
            for attempt in tries:
                if (can_move and attempt.after_backward and len(tries) > 1
                        and held_after_backward(updates, placement.host) > budget):
                    continue  # (the gradients held at once, with the parameters and state, are over already)
                fitting: list[Plan] = []
                savable = None  # what smaller buckets could give back, once the largest fell short
                for cap in caps:
                    if can_move and savable is not None and savable < 0:
                        break  # smaller buckets save only their temporaries: move state instead
                    if fitting and out_of_time():
                        break  # each cap gets what is left of the limit: nothing is
                    at = dataclasses.replace(attempt, bucket_bytes=cap)
                    probe = moved and not fitting
                    try:
                        plan = solve_for(at, search_minimum=False, probe=probe)
                    except (solvers.ScheduleError, InfeasibleBudgetError) as exc:
                        errors.append(exc)
                        if isinstance(exc, InfeasibleBudgetError) and not can_move:
                            unsearched.append(at)
                        if isinstance(exc, InfeasibleBudgetError) and savable is None:
                            savable = most_bucket_temp_bytes(on_device, cap) - (exc.min_budget - budget)
                        continue
                    if plan.predicted_time <= plan.store_all_time * (1 + 1e-9):
                        return plan  # nothing recomputed or moved for these buckets: the fewest calls win
                    if probe:  # it fits: now the search proper, in what is left of the limit
                        # (compared even out of time: the wrong one of the two can double the step's time)
                        at, plan = _against_all_on_host(solve_for, at, plan, updates, host_limit)
                        refined = None if out_of_time() else none_where_unfit(
                            lambda: solve_for(at, search_minimum=False, probe=False))
                        if refined is not None and refined.predicted_time < plan.predicted_time:
                            plan = refined
                        return plan  # (its largest buckets only: the state moved is what sets its time)
                    fitting.append(plan)
                if fitting:  # each fits by recomputing or moving: the fastest, bucket calls and all
                    return min(fitting, key=lambda p: p.predicted_time)
            if unsearched and search_minimum:  # nothing fits and no state can move: the error names the minimum
                plan, errors = _searched_minimums(solve_for, unsearched, errors)
                if plan is not None:
                    return plan
            infeasible = [e for e in errors if isinstance(e, InfeasibleBudgetError)]
            if not infeasible:
                raise errors[-1]
            closest = min(infeasible, key=lambda e: e.min_budget)
            if best is None or closest.min_budget < best.min_budget:
                best = closest
            more = host_updates(on_device, closest.min_budget - budget) if can_move else frozenset()
            if more and host_limit is not None:
                fitting_host = _within_host(updates, placement.host, on_device, closest.min_budget - budget,
                                            host_limit, caps[0])
                if not fitting_host:
                    wanted = host_update_bytes(updates, placement.host | more, caps[0])
                    raise HostMemoryError(sum(wanted.values()), host_limit, wanted) from None
                more = fitting_host
            if not more:
                raise best from None
            placement = dataclasses.replace(placement, host=placement.host | more)
    finally:
        # Each error caught here has a traceback that holds this frame and, through its callers,
        # every frame of the planning call: up to OptimizedModule.forward when a step plans on its
        # first call. Kept in this frame's variables they made a reference cycle that only the cyclic
        # collector frees, and until it ran that forward's frame kept the outputs it returned alive:
        # logits the caller had dropped were held through the backward planned without them, and
        # taken for still held, so the output use learned from the step was given up (#46). Whether
        # the collector ran first depended on allocations, a caller's dispatch mode or profiler.
        best = closest = None
        errors = infeasible = []


def _searched_minimums(solve_for: Callable[..., Plan], attempts: list[UpdatePlacement],
                       errors: list[Exception]) -> tuple[Plan | None, list[Exception]]:
    """``attempts`` solved again with the minimum-budget search, which a solve that fits does not
    need (seconds to minutes a search: each attempt is solved without it first); ``errors`` with
    theirs in place of the unsearched ones. A plan, where a solve now fits."""
    kept: list[Exception] = [e for e in errors if not isinstance(e, InfeasibleBudgetError)]
    for at in attempts:
        try:
            return solve_for(at, search_minimum=True), errors
        except (solvers.ScheduleError, InfeasibleBudgetError) as exc:
            # Its traceback, and that of the error it was raised while handling (its context), would
            # hold this frame, and this frame the list holding it: a cycle through every planning
            # frame above, which `whole_step_plan` must not leave (#46).
            exc.__context__ = exc.__cause__ = None
            kept.append(exc.with_traceback(None))
    return None, kept


def _within_host(updates: Sequence[ParamUpdate], host: frozenset[str], candidates: Sequence[ParamUpdate],
                 need: int, limit: int, cap: int) -> frozenset[str]:
    """Parameters of ``candidates`` whose state moves to the host beside ``host``'s to free ``need``
    bytes of the device, as `host_updates` picks them (the largest states first), passing over
    each that ``limit`` bytes of host memory cannot take beside those."""
    taken: set[str] = set()
    freed = 0
    for u in sorted(candidates, key=lambda u: (-u.state_bytes, u.name)):
        if freed >= need:
            break
        if u.state_bytes > 0 and sum(host_update_bytes(updates, host | taken | {u.name}, cap).values()) <= limit:
            taken.add(u.name)
            freed += u.state_bytes
    return frozenset(taken)


def _against_all_on_host(solve_for: Callable[..., Plan], placement: UpdatePlacement, plan: Plan,
                         updates: Sequence[ParamUpdate], host_limit: int | None = None) -> tuple[UpdatePlacement, Plan]:
    """``placement`` (its brief ``plan``) or every parameter's state in host memory, whichever brief
    plan is faster. Moving just enough state leaves the rest of the budget to recomputation; where
    host updates overlap compute (on a billion-parameter GPT, 1.11x store-all's step with all state
    there against 1.72x with just enough), more state there is faster, and the simulator says which."""
    every = frozenset(u.name for u in updates if u.state_bytes > 0)
    if every <= placement.host:
        return placement, plan
    if host_limit is not None and sum(host_update_bytes(updates, every, placement.bucket_bytes).values()) > host_limit:
        return placement, plan  # (the host cannot take it all)
    other = dataclasses.replace(placement, host=placement.host | every)
    alternative = none_where_unfit(lambda: solve_for(other, search_minimum=False, probe=True))
    if alternative is not None and alternative.predicted_time < plan.predicted_time:
        return other, alternative
    return placement, plan


def host_bandwidth(analysis: Analysis) -> float:
    """Bytes/s of the host link the analysis' device profile describes."""
    profile = analysis.costs.profile
    return profile.host_bandwidth if profile is not None else 0.0


def problem_for(analysis: Analysis, budget: int, offload: bool) -> "solvers.Problem":
    """The analysis' Problem under ``budget``, with the profile's host link when ``offload``."""
    return analysis.lowered.with_budget(budget, host_bandwidth(analysis) if offload else 0.0)


def solve_plan(
    analysis: Analysis, budget: int, *, solver: str = "auto", time_limit: float | None = None,
    offload: bool = False, gap: float | None = None, search_minimum: bool = True,
) -> Plan:
    """Solve an analyzed step for one budget (a sweep solves one analysis many times).

    ``offload=True`` gives the solver the profile's host link: values may be
    paged to host memory and back as well as kept or recomputed. ``gap``: the search may stop
    once its plan is proven within that share of optimal (`solvers.solve`). ``search_minimum=False``:
    no minimum-budget search: a budget below the Problem's trivial lower bound raises at once, the
    bound as its minimum, and one the solve cannot meet raises with the lowest peak it reached
    (``InfeasibleBudgetError.searched`` False)."""
    problem = problem_for(analysis, budget, offload)
    start = time.perf_counter()
    # The minimum-budget search after a failed solve stops with the lowest peak it has found by then
    # (`solvers.strategies.min_budget`): its own time limits bound it on graphs of thousands of
    # values, but its bisection's greedy takes minutes a probe on a billion-parameter graph.
    search_deadline = start + max(time_limit or 0.0, TUNABLES.min_budget_search_seconds)
    try:
        sol = solvers.solve(problem, method=solver, time_limit=time_limit, gap=gap, search_minimum=search_minimum,
                            search_deadline=search_deadline)
    except solvers.Infeasible as exc:
        raise InfeasibleBudgetError(budget, int(exc.min_budget),
                                    addend_only_outputs=analysis.capture.addend_only_outputs,
                                    searched=exc.searched) from None
    if not sol.fits:  # a named method that cannot meet this budget (the search found it feasible)
        raise InfeasibleBudgetError(budget, int(sol.peak), addend_only_outputs=analysis.capture.addend_only_outputs,
                                    method=sol.method)
    schedule = updates_after_reads_within(analysis.lowered, problem, sol.schedule)
    return plan_from_schedule(
        analysis, budget, schedule, method=sol.method, status=sol.status,
        lower_bound=sol.lower_bound, solve_time=time.perf_counter() - start,
    )


def plan_from_schedule(
    analysis: Analysis,
    budget: int,
    schedule: "solvers.Schedule",
    *,
    method: str,
    status: str,
    lower_bound: float | None = None,
    solve_time: float = 0.0,
) -> Plan:
    """A :class:`Plan` for a schedule, validated against the analysis' Problem under ``budget``.

    Peak and time come from the simulator, never from whoever made the schedule.
    Frees are first moved to the last reads (`solvers.core.sequence.tighten_frees`), where the runtime
    frees whatever the schedule says, so that the prediction describes the step that runs.
    Raises ``solvers.ScheduleError`` if the schedule is invalid or over the budget.
    """
    problem = problem_for(analysis, budget, schedule.has_transfers())
    schedule = tighten_frees(problem, schedule)
    result = solvers.validate(problem, schedule)
    return Plan(
        budget=budget,
        predicted_peak=result.peak,
        predicted_time=result.time,
        store_all_time=analysis.store_all.cost,
        store_all_peak=analysis.store_all.peak,
        method=method,
        lower_bound=lower_bound,
        solve_time=solve_time,
        status=status,
        decisions=value_decisions(analysis, schedule),
        schedule=schedule,
        analysis=analysis,
        transfers=transfers_of(problem, schedule, result.clock),
        predicted_wait=result.wait,
        host_bytes=result.host_peak,
    )
