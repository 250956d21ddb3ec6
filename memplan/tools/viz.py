"""Views of a plan for people: the numbers behind each picture, and the matplotlib figures.

One job: turn a :class:`~memplan.pipeline.plan.Plan` into what the CLI prints and the
notebook draws, without planning anything new (except :func:`sweep`, which
solves one analysis at several budgets for the trade-off curve).

* :func:`memory_timelines` / :func:`plot_memory`: device memory over the
  predicted step time, eager (the joint graph in order, keeping everything)
  against planned, with the budget and the forward/backward/update phases;
* :func:`memory_breakdown`: the planned memory of the whole step split by what
  holds it (parameters, optimizer state, accumulated gradients, gradients,
  activations, activations back from host), drawn by :func:`plot_memory` as a
  stacked area; optimizer state kept in host memory is noted beside it;
* :func:`rs_matrices` / :func:`plot_rs_matrices`: Checkmate's R and S
  matrices read off the schedule (which value is computed, and which is
  resident, at each stage);
* :func:`layer_breakdown` / :func:`plot_layers`: bytes kept, recomputed and
  offloaded per submodule, and the time recomputation costs there;
* :func:`sweep` / :func:`plot_budget_curve`: predicted overhead against budget;
* :func:`plot_rank_memory`: one rank's step under ``memplan.fully_shard`` by holder (FSDP2's
  shards and buffers, the planned graphs), with the budget and the measured peak.

Every number comes from the one simulator (``solvers.simulate``) over the
plan's own schedule. Figures are ``matplotlib.figure.Figure`` objects built
without pyplot, so nothing here touches the global backend: they save to PNG
through Agg and display inline in notebooks.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

import solvers
from memplan.planning.analysis import Analysis
from memplan.capture.patches import module_path
from memplan.updates.names import ACCUM_PREFIX, STATE_PREFIX
from memplan.pipeline.plan import Plan, problem_for
from memplan.planning.lowering import BACKWARD, is_reference, value_name
from memplan.core.units import format_bytes
from memplan.core.config import TUNABLES
from solvers.core.memory import Residency
from memplan.pipeline.sweep import SweepPoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from memplan.tools.sharded_report import RankReport

def _unit(nbytes: float) -> tuple[float, str]:
    """The decimal unit plots use for values up to ``nbytes`` (plans range from kB to TB)."""
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return scale, name
    return 1.0, "B"


# --------------------------------------------------------------------------- #
# Memory over time
# --------------------------------------------------------------------------- #


@dataclass
class Timeline:
    """Memory after each step of one schedule, against predicted time."""

    time: np.ndarray  # seconds since the step began, after each schedule step (0 first)
    memory: np.ndarray  # bytes resident at the matching time (the sources first)
    backward_start: float  # predicted time at which backward begins
    peak: int
    total_time: float


def _simulate(analysis: Analysis, schedule: solvers.Schedule) -> solvers.SimResult:
    """Replay a schedule on the analysis' Problem, with the host link when it moves values."""
    problem = problem_for(analysis, analysis.lowered.problem.budget, schedule.has_transfers())
    return solvers.simulate(problem, schedule)


def timeline(analysis: Analysis, schedule: solvers.Schedule) -> Timeline:
    """Simulate ``schedule`` on the analysis' Problem; time is the simulator's compute-stream clock
    (each compute's predicted cost, plus any wait for a host copy)."""
    sim = _simulate(analysis, schedule)
    t = np.concatenate([[0.0], np.asarray(sim.clock, dtype=np.float64)])
    mem = np.concatenate([[sim.initial], sim.timeline]).astype(np.int64)
    backward = next((t[k] for k, (op, node) in enumerate(schedule) if op == "compute" and node == BACKWARD), t[-1])
    return Timeline(time=t, memory=mem, backward_start=float(backward), peak=int(sim.peak), total_time=float(t[-1]))


def memory_timelines(plan: Plan) -> tuple[Timeline, Timeline]:
    """(eager, planned) timelines. "Eager" is the joint graph in order, every value kept to its last use.

    Gradients the parameters held when the step began (accumulation: `Plan.held_gradient_bytes`)
    and a distributed engine's buffers (`Plan.engine_bytes`) are on the device all step in both,
    so both include them, as the plan's predicted peak does."""
    held = plan.held_gradient_bytes + getattr(plan, "engine_bytes", 0)
    return tuple(replace(tl, memory=tl.memory + held, peak=tl.peak + held)
                 for tl in (timeline(plan.analysis, plan.analysis.store_all.schedule),
                            timeline(plan.analysis, plan.schedule)))


def resample_max(tl: Timeline, width: int, until: float | None = None) -> np.ndarray:
    """``width`` bins over [0, until] (default: the timeline's end), each the peak within it.

    Peaks survive the resampling: a bin never shows less than the highest
    memory reached inside it, so a terminal strip cannot hide a spike.
    """
    until = tl.total_time if until is None else until
    out = np.zeros(width, dtype=np.int64)
    if width <= 0 or until <= 0:
        return out
    edges = np.linspace(0.0, until, width + 1)
    # The memory after step k holds from time[k] to time[k+1]: a bin sees the
    # level it starts in plus every step that starts inside it.
    first = np.maximum(np.searchsorted(tl.time, edges[:-1], side="right") - 1, 0)
    stop = np.searchsorted(tl.time, edges[1:], side="left")
    stop[-1] = len(tl.time)
    for i in range(width):
        out[i] = tl.memory[first[i] : max(stop[i], first[i] + 1)].max()
    return out


# --------------------------------------------------------------------------- #
# Memory by category: what holds the device memory at each step
# --------------------------------------------------------------------------- #


# (field of MemoryBreakdown, legend label, colour), bottom of the stack first: what is resident all
# step long sits at the bottom, so the wiggles on top are the activations and gradients.
BREAKDOWN_CATEGORIES: tuple[tuple[str, str, str], ...] = (
    ("parameters", "parameters, buffers, inputs", "#4c72b0"),
    ("optimizer_state", "optimizer state", "#8172b3"),
    ("accumulated_gradients", "accumulated gradients", "#937860"),
    ("gradients", "gradients", "#dd8452"),
    ("activations", "activations, temporaries", "#55a868"),
    ("from_host", "activations back from host", "#64b5cd"),
    ("engine_buffers", "DDP's gradient buckets", "#c44e52"),
)
_CATEGORY = {name: i for i, (name, _, _) in enumerate(BREAKDOWN_CATEGORIES)}


@dataclass
class MemoryBreakdown:
    """Planned device memory at each point of the planned timeline, split by what holds it.

    Every array is indexed like `Timeline.time`: the sources first, then one entry per
    schedule step (a compute counts while it runs). At every index the categories add up
    to the planned `Timeline.memory` there: each storage is counted once, for the value
    the simulator's alias rule counts it for, in that value's category.
    """

    time: np.ndarray  # seconds since the step began (the simulator's compute-stream clock)
    parameters: np.ndarray  # sources the step reads: parameters, buffers, inputs, constants
    optimizer_state: np.ndarray  # optimizer state on the device (``optstate:`` sources)
    accumulated_gradients: np.ndarray  # ``accum:`` buffers and gradients held from an earlier step
    gradients: np.ndarray  # the parameters' gradients, from their computation to their update or the end
    activations: np.ndarray  # everything else: activations, backward and update temporaries
    from_host: np.ndarray  # activations whose resident copy was prefetched from host memory
    engine_buffers: np.ndarray  # a distributed engine's tensors, all step long (`Plan.engine_bytes`)
    backward_start: float  # predicted time at which backward begins
    update_start: float | None  # when the first optimizer update starts (None: the step has none)
    update_end: float | None  # when the last optimizer update ends
    updates_after_backward: bool  # the updates wait for every gradient (else each follows its own)
    host_optimizer_state_bytes: int  # optimizer state kept and updated in host memory: not on this curve
    host_state_params: int  # parameters whose optimizer state lives in host memory

    @property
    def total(self) -> np.ndarray:
        """Planned device memory at each index: the sum of the categories."""
        return sum(getattr(self, name) for name, _, _ in BREAKDOWN_CATEGORIES)

    @property
    def peak_index(self) -> int:
        """Index of the first point at the planned peak."""
        return int(np.argmax(self.total))

    def at(self, k: int) -> dict[str, int]:
        """Bytes per category at index ``k`` (negative: from the end, as in numpy)."""
        return {name: int(getattr(self, name)[k]) for name, _, _ in BREAKDOWN_CATEGORIES}

    def most(self) -> dict[str, int]:
        """The most bytes each category holds at any point of the step."""
        return {name: int(getattr(self, name).max()) for name, _, _ in BREAKDOWN_CATEGORIES}


def _gradient_names(analysis: Analysis) -> set[str]:
    """Problem nodes that are the step's gradients: those the updates apply, and every graph
    output of kind "grad" (without an optimizer they are held to the step's end)."""
    low, cap = analysis.lowered, analysis.capture
    names = {grad for _, grad, _ in low.updates}
    for info, node in zip(cap.outputs, cap.output_nodes()):
        if info.kind == "grad" and node is not None:
            names.add(value_name(node))
    return names


def _categories(analysis: Analysis, problem: solvers.Problem) -> list[int]:
    """Per Problem node, the index in `BREAKDOWN_CATEGORIES` its bytes count in (a value
    prefetched from host moves to ``from_host`` while that copy is resident)."""
    grads = _gradient_names(analysis)
    is_source = problem.lists().is_source
    out = []
    for v, name in enumerate(map(str, problem.names)):
        if name.startswith(STATE_PREFIX):
            out.append(_CATEGORY["optimizer_state"])
        elif name.startswith(ACCUM_PREFIX):
            out.append(_CATEGORY["accumulated_gradients"])
        elif is_source[v]:  # primals and graph constants; bookkeeping sources hold no bytes
            out.append(_CATEGORY["parameters"])
        elif name in grads:
            out.append(_CATEGORY["gradients"])
        else:
            out.append(_CATEGORY["activations"])
    return out


def category_bytes(problem: solvers.Problem, schedule: solvers.Schedule, category: list[int]) -> np.ndarray:
    """Device bytes per category (rows, as `BREAKDOWN_CATEGORIES`) before the first step and
    after each step of ``schedule`` (columns); ``category[v]``: node ``v``'s row.

    The schedule is replayed on the simulator's own resident set (`solvers.core.memory.Residency`),
    which says which value each storage's bytes count against (`Residency.holders`), so each
    storage lands in one category and the rows add up to the simulator's memory at every step.
    A value brought back from host memory counts as such while it is resident."""
    residency = Residency(problem)
    now = list(category)  # the category each value counts in now (prefetched copies move)
    counted: dict[int, int] = {}  # bytes each value is counted for now
    totals = [0] * len(BREAKDOWN_CATEGORIES)

    def recount(v: int) -> None:
        held = residency.holders(v)
        for w in residency.related(v):
            new, old = held.get(w, 0), counted.get(w, 0)
            if new != old:
                totals[now[w]] += new - old
                counted[w] = new

    for v in problem.sources:
        recount(v)
    columns = [list(totals)]
    index = problem.index
    for op, node in schedule:
        v = index[node]
        if op is solvers.Op.COMPUTE or op is solvers.Op.PREFETCH:
            if v in residency:
                continue
            # v holds no bytes before this add, so its category can change without moving any.
            activation = category[v] == _CATEGORY["activations"]
            now[v] = _CATEGORY["from_host"] if op is solvers.Op.PREFETCH and activation else category[v]
            residency.add(v)
            recount(v)
        elif op is solvers.Op.FREE and v in residency:
            residency.remove(v)
            recount(v)
        columns.append(list(totals))
    return np.asarray(columns, dtype=np.int64).T


def memory_breakdown(plan: Plan) -> MemoryBreakdown:
    """The plan's device memory over its predicted step, split into parameters, optimizer state,
    accumulated gradients, gradients, activations (and those back from host), with the phases."""
    analysis = plan.analysis
    low = analysis.lowered
    problem = problem_for(analysis, low.problem.budget, plan.schedule.has_transfers())
    planned = timeline(analysis, plan.schedule)
    rows = category_bytes(problem, plan.schedule, _categories(analysis, problem))
    fields = {name: rows[i] for i, (name, _, _) in enumerate(BREAKDOWN_CATEGORIES)}
    # Gradients the parameters held when the step began are on the device all step (memory_timelines).
    fields["accumulated_gradients"] = fields["accumulated_gradients"] + getattr(plan, "held_gradient_bytes", 0)
    fields["engine_buffers"] = fields["engine_buffers"] + getattr(plan, "engine_bytes", 0)
    updates = {update for update, _, _ in low.updates}
    at = [k for k, (op, node) in enumerate(plan.schedule) if op is solvers.Op.COMPUTE and node in updates]
    host_states = getattr(low, "host_states", frozenset())
    return MemoryBreakdown(
        time=planned.time, **fields, backward_start=planned.backward_start,
        # Compute k runs from time[k] to time[k + 1] (time[0] is the step's start).
        update_start=float(planned.time[at[0]]) if at else None,
        update_end=float(planned.time[at[-1] + 1]) if at else None,
        updates_after_backward=bool(low.updates_after_backward),
        host_optimizer_state_bytes=int(getattr(analysis, "host_optimizer_state_bytes", 0) or 0),
        host_state_params=len(host_states),
    )




def _steps(time: np.ndarray, total: np.ndarray, bins: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(edges in ms, columns): what to draw of a timeline, as a staircase of columns over ``edges``.

    Column j >= 1 (the memory while step j - 1 runs) holds from ``time[j - 1]`` to ``time[j]``.
    Each of ``bins`` equal slices of time shows the column where ``total`` is highest inside it:
    no peak is lost, the categories still add up, and the many steps that take no time (frees,
    views) do not draw a comb of vertical lines.
    """
    bins = TUNABLES.plot_bins if bins is None else bins
    n = len(time) - 1
    if n == 0 or time[-1] <= 0:
        return np.array([0.0, 1e-9]), np.array([0])
    edges = np.linspace(0.0, float(time[-1]), bins + 1)
    lo = np.maximum(np.searchsorted(time, edges[:-1], side="left"), 1)  # first column ending in the slice
    hi = np.minimum(np.searchsorted(time, edges[1:], side="left"), n)  # last column starting in it
    cols = np.array([lo[i] + int(np.argmax(total[lo[i]:max(hi[i], lo[i]) + 1])) for i in range(bins)])
    return edges * 1e3, cols


def _step_xy(edges: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Points of the staircase that holds ``y[i]`` from ``edges[i]`` to ``edges[i + 1]``."""
    return np.repeat(edges, 2)[1:-1], np.repeat(y, 2)


def plot_memory(plan: Plan, *, title: str | None = None) -> Figure:
    """The planned step's device memory over predicted time as a stack of what holds it, against eager.

    One axes. The stack: parameters (with buffers and inputs), optimizer state, accumulated
    gradients, gradients, activations and temporaries, activations back from host (the
    categories of `memory_breakdown`; empty ones are left out of the legend). Three lines:
    eager (keep everything), the planned total, the budget. Shaded: forward, backward and the
    optimizer's update phase; optimizer state held in host memory is a legend entry, not an area.
    A budget far above both peaks (``optimize(model, "1TB")`` to keep everything) does not set
    the scale, or both curves would be flat at the bottom: its line is left out and the legend says so.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    eager, _ = memory_timelines(plan)
    bd = memory_breakdown(plan)
    total = bd.total
    peak = int(total.max())
    budget_shown = plan.budget <= TUNABLES.budget_shown_above_peak * max(eager.peak, peak)
    top = max(eager.peak, peak, plan.budget if budget_shown else 0)
    scale, unit = _unit(top)
    end = max(eager.total_time, float(bd.time[-1])) * 1e3
    ymax = top / scale * 1.12  # headroom for the phase names
    fig = Figure(figsize=(10.5, 4.6), layout="constrained")
    ax = fig.add_subplot()

    # Phases behind everything: forward | backward | updates (the updates may overlap backward).
    backward = bd.backward_start * 1e3
    ax.axvspan(0, backward, color="tab:green", alpha=0.06, lw=0, zorder=0)
    ax.axvspan(backward, end, color="tab:orange", alpha=0.06, lw=0, zorder=0)
    phases = [("forward", 0.0, backward, "tab:green"), ("backward", backward, end, "tab:orange")]
    if bd.update_start is not None:
        u0, u1 = bd.update_start * 1e3, bd.update_end * 1e3
        ax.axvspan(u0, u1, color="tab:purple", alpha=0.10, lw=0, zorder=0)
        for x in (u0, u1):  # the band's edges stay visible across the stack
            ax.axvline(x, color="tab:purple", linestyle=":", linewidth=0.9, zorder=3)
        phases[1] = ("backward", backward, u0 if bd.updates_after_backward else end, "tab:orange")
        phases.append(("updates" if bd.updates_after_backward else "updates (during backward)", u0, u1, "tab:purple"))
    for name, x0, x1, color in phases:
        if x1 <= x0:
            continue
        if name == "updates" and x1 - x0 < 0.12 * end:
            # A short phase at the end of the step: its name runs down its left edge instead.
            ax.text(x0, ymax * 0.985, f"{name} ", ha="right", va="top", rotation=90, color=color, fontsize="small")
        else:
            y = ymax * (0.925 if name.endswith("(during backward)") else 0.975)
            ax.text((x0 + x1) / 2, y, name, ha="center", va="top", color=color, fontsize="small", clip_on=True)

    # The stack, bottom first: what stays all step, then what comes and goes.
    edges, cols = _steps(bd.time, total)
    at_peak, most = bd.at(bd.peak_index), bd.most()
    handles = []
    base = np.zeros(len(cols))
    for name, label, color in BREAKDOWN_CATEGORIES:
        values = getattr(bd, name)
        if not values.any():
            continue
        layer = values[cols] / scale
        x, y0 = _step_xy(edges, base)
        _, y1 = _step_xy(edges, base + layer)
        ax.fill_between(x, y0, y1, color=color, alpha=0.85, lw=0, zorder=1)
        text = f"{label}: {at_peak[name] / scale:.2f} {unit}"
        if most[name] > 1.05 * at_peak[name]:  # what comes and goes may be small at the peak, large elsewhere
            text += f" (up to {most[name] / scale:.2f})"
        handles.append(Patch(color=color, alpha=0.85, label=text))
        base = base + layer
    handles.reverse()  # the legend reads top to bottom, like the stack

    # Lines: eager, the planned total (the stack's outline), the budget.
    e_edges, e_cols = _steps(eager.time, eager.memory)
    ex, ey = _step_xy(e_edges, eager.memory[e_cols] / scale)
    (eager_line,) = ax.plot(ex, ey, color="tab:gray", linewidth=1.0, zorder=2,
                            label=f"eager, keep everything (peak {eager.peak / scale:.2f} {unit})")
    px, py = _step_xy(edges, total[cols] / scale)
    (planned_line,) = ax.plot(px, py, color="black", linewidth=0.8, zorder=2,
                              label=f"planned (peak {peak / scale:.2f} {unit}; areas: bytes at the peak)")
    budget_label = f"budget {plan.budget / scale:.2f} {unit}" if budget_shown else \
        f"budget {format_bytes(plan.budget)}, off the scale"
    budget_line = ax.axhline(plan.budget / scale if budget_shown else math.nan, color="tab:red", linestyle="--",
                             linewidth=1.0, label=budget_label)
    ax.scatter([bd.time[bd.peak_index] * 1e3], [peak / scale], marker="v", color="black", s=18, zorder=4)
    legend = [eager_line, planned_line, budget_line, *handles]
    if bd.host_optimizer_state_bytes > 0:
        # Not device memory, so not an area: a hatched entry says where the rest of the state is.
        color = BREAKDOWN_CATEGORIES[_CATEGORY["optimizer_state"]][2]
        legend.append(Patch(facecolor="none", edgecolor=color, hatch="////",
                            label=f"optimizer state in host memory: {bd.host_optimizer_state_bytes / scale:.2f} {unit}\n"
                                  f"({bd.host_state_params} parameter{'s' * (bd.host_state_params != 1)}, "
                                  "updated on the host)"))

    ax.set_xlim(0, end)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("predicted time in the step (ms)")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title or f"memory over one training step: {plan.method}, {plan.predicted_overhead:.2f}x time")
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


# --------------------------------------------------------------------------- #
# Checkmate's R and S matrices
# --------------------------------------------------------------------------- #


@dataclass
class RSMatrices:
    """R[t, j]: value j is computed in stage t. S[t, j]: value j is resident when stage t starts.

    Stage t ends with the first computation of value t (columns are values in
    the order the schedule first computes them), as in Checkmate, where stage
    t is the one that computes node t; recomputations fall in the stages that
    need them.
    """

    R: np.ndarray  # bool, stages x values
    S: np.ndarray  # bool, stages x values
    values: list[str]
    backward_stage: int  # first stage of the backward pass


def rs_matrices(plan_or_schedule: Plan | solvers.Schedule, analysis: Analysis | None = None) -> RSMatrices:
    """Checkmate's R and S matrices of a plan's (or a bare) schedule; ``analysis`` is not needed."""
    schedule = plan_or_schedule.schedule if isinstance(plan_or_schedule, Plan) else plan_or_schedule
    column: dict[str, int] = {}
    R: list[set[int]] = []
    S: list[set[int]] = []
    resident: set[str] = set()
    computed: set[str] = set()
    stage_start: set[str] | None = None
    for op, node in schedule:
        node = str(node)
        if op == "compute":
            if stage_start is None:
                stage_start = set(resident)  # frees after the last stage's closing compute belong to it
            resident.add(node)
            computed.add(node)
            if node not in column:
                column[node] = len(column)
                R.append({column[v] for v in computed if v in column})
                S.append({column[v] for v in stage_start if v in column})
                computed, stage_start = set(), None
        elif op == "free":
            resident.discard(node)
    if computed:  # recomputations after the last first-compute (sinks computed again at the end)
        R.append({column[v] for v in computed})
        S.append({column[v] for v in (stage_start or set())})
    n = len(column)
    Rm = np.zeros((len(R), n), dtype=bool)
    Sm = np.zeros((len(S), n), dtype=bool)
    for t, (r, s) in enumerate(zip(R, S)):
        Rm[t, list(r)] = True
        Sm[t, list(s)] = True
    return RSMatrices(Rm, Sm, list(column), column.get(BACKWARD, n))


def plot_rs_matrices(plan: Plan, *, title: str | None = None) -> Figure:
    """Checkmate-style R (computed) and S (resident) matrices, stages down, values across. Two axes."""
    from matplotlib.figure import Figure

    rs = rs_matrices(plan)
    fig = Figure(figsize=(11, 5.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, mat, name, cmap in ((axes[0], rs.R, "R: computed in stage", "Blues"), (axes[1], rs.S, "S: resident at stage start", "Greens")):
        ax.imshow(mat, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=1)
        ax.axhline(rs.backward_stage - 0.5, color="tab:orange", linewidth=0.8)
        ax.set_title(f"{name} ({int(mat.sum())} cells)")
        ax.set_xlabel("value (order of first computation)")
    # Recomputations are single cells off R's diagonal: too small to see at this scale, so ring them.
    extra = rs.R.copy()
    n = min(extra.shape)
    extra[np.arange(n), np.arange(n)] = False
    stages, values = np.nonzero(extra)
    if len(stages):
        axes[0].scatter(values, stages, s=30, facecolors="none", edgecolors="tab:red", linewidths=1.0,
                        label="recomputation")
        axes[0].legend(loc="upper right", fontsize="small")
    axes[0].set_ylabel("stage (line: backward begins)")
    recomputes = int(rs.R.sum() - rs.R.shape[1])
    fig.suptitle(title or f"schedule as Checkmate matrices: {len(rs.values)} values, {recomputes} recomputations")
    return fig


# --------------------------------------------------------------------------- #
# Per-module breakdown
# --------------------------------------------------------------------------- #


@dataclass
class LayerRow:
    """What the plan does with the activations one submodule saves for backward."""

    module: str
    kept_bytes: int = 0  # held from forward to backward
    recomputed_bytes: int = 0  # dropped after forward, computed again in backward
    offloaded_bytes: int = 0  # paged to host and back
    recompute_time: float = 0.0  # predicted seconds spent recomputing this module's values
    values: int = 0  # saved storages counted in the row

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _module_label(path: str, wrapped: bool, depth: int) -> str:
    if wrapped:  # memplan.WithLoss: the model lives under "model.", the loss at the top
        if not path:
            return "(loss)"
        path = path.removeprefix("model").removeprefix(".")
        if not path:
            return "(model)"
    if not path:
        return "(top level)"
    return ".".join(path.split(".")[:depth]) if depth > 0 else path


def _is_with_loss(analysis: Analysis) -> bool:
    for node in analysis.capture.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            root = next(iter(stack.values()))[1]
            return getattr(root, "__name__", "") == "WithLoss" and getattr(root, "__module__", "") == "memplan.frontend.module"
    return False


def layer_breakdown(plan: Plan, depth: int = 2) -> list[LayerRow]:
    """Saved activations and recomputation time per submodule path, cut to ``depth`` components.

    A storage is *saved* when the forward computes it and the backward reads
    it. It is *recomputed* when the plan computes its owner more than once,
    *offloaded* when the plan pages it out, *kept* otherwise. Recompute time
    counts every extra computation, saved value or not. Rows come in graph
    order of their first op.
    """
    analysis = plan.analysis
    low, costs = analysis.lowered, analysis.costs
    problem = low.problem
    wrapped = _is_with_loss(analysis)

    store_all = [str(n) for op, n in analysis.store_all.schedule if op == "compute"]
    cut = store_all.index(BACKWARD) if BACKWARD in store_all else len(store_all)
    forward = set(store_all[:cut])
    sim = _simulate(analysis, plan.schedule)
    computes = {str(problem.names[i]): int(c) for i, c in enumerate(sim.computes)}
    offloaded = {str(n) for op, n in plan.schedule if op == "offload"}

    rows: dict[str, LayerRow] = {}

    def row_for(name: str) -> LayerRow:
        node = low.fx_nodes.get(name)
        label = _module_label(module_path(node) if node is not None else "", wrapped, depth)
        return rows.setdefault(label, LayerRow(label))

    # Rows in graph order.
    for name in store_all:
        if name in low.fx_nodes and low.fx_nodes[name].op == "call_function":
            row_for(name)

    saved_storages: dict[int, str] = {}  # storage -> owner node
    for name in forward:
        if name not in low.fx_nodes or low.fx_nodes[name].op != "call_function":
            continue
        readers = [s for s in low.graph.successors(name) if s != BACKWARD and not is_reference(str(s))]
        if not any(r not in forward for r in readers):
            continue
        for storage in costs.values[name].storages:
            owner = costs.storage_owner.get(storage)
            if owner in forward and owner in low.fx_nodes and low.fx_nodes[owner].op == "call_function":
                saved_storages[storage] = owner
    for storage, owner in saved_storages.items():
        row = row_for(owner)
        nbytes = costs.storage_bytes[storage]
        row.values += 1
        if owner in offloaded:
            row.offloaded_bytes += nbytes
        elif computes.get(owner, 1) > 1:
            row.recomputed_bytes += nbytes
        else:
            row.kept_bytes += nbytes
    for name, count in computes.items():
        if count > 1 and name in low.fx_nodes:
            row_for(name).recompute_time += (count - 1) * float(problem.cost[problem.index[name]])
    return [r for r in rows.values() if r.values or r.recompute_time]


def plot_layers(plan: Plan, depth: int = 2, *, top: int = 30, title: str | None = None) -> Figure:
    """Horizontal stacked bars of kept / recomputed / offloaded bytes per submodule. One axes."""
    from matplotlib.figure import Figure

    rows = layer_breakdown(plan, depth)
    if len(rows) > top:  # the largest rows, still in graph order
        keep = {id(r) for r in sorted(rows, key=lambda r: -(r.kept_bytes + r.recomputed_bytes + r.offloaded_bytes))[:top]}
        rows = [r for r in rows if id(r) in keep]
    scale, unit = _unit(max((r.kept_bytes + r.recomputed_bytes + r.offloaded_bytes for r in rows), default=0))
    fig = Figure(figsize=(9, max(2.5, 0.28 * len(rows) + 1.2)), layout="constrained")
    ax = fig.add_subplot()
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for attr, label, color in (
        ("kept_bytes", "kept", "tab:blue"),
        ("recomputed_bytes", "recomputed", "tab:orange"),
        ("offloaded_bytes", "offloaded", "tab:purple"),
    ):
        vals = np.array([getattr(r, attr) for r in rows], dtype=float) / scale
        ax.barh(y, vals, left=left, color=color, label=label)
        left += vals
    ax.set_yticks(y, [r.module for r in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(f"saved activations ({unit})")
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(title or "what the plan does with each module's saved activations")
    return fig


def plot_budget_curve(points: Sequence[SweepPoint], *, eager_peak: int | None = None, title: str | None = None) -> Figure:
    """Predicted step-time overhead against budget (one line), infeasible budgets marked. One axes."""
    from matplotlib.figure import Figure

    ok = sorted((p for p in points if p.feasible), key=lambda p: p.budget)
    bad = [p for p in points if not p.feasible]
    scale, unit = _unit(max([p.budget for p in points] + [eager_peak or 0]))
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([p.budget / scale for p in ok], [p.plan.predicted_overhead for p in ok], marker="o", color="tab:blue",
            label="planned")
    for p in ok:
        ax.annotate(p.label, (p.budget / scale, p.plan.predicted_overhead), textcoords="offset points", xytext=(4, 4),
                    fontsize="small")
    if bad:
        # Below the smallest budget memplan found a plan for: shade it, mark the budgets asked for there.
        floor = max(p.min_budget or p.budget for p in bad) / scale
        ax.axvspan(0, floor, color="tab:red", alpha=0.08, label=f"no plan found (below {floor:.3g} {unit})")
        ax.scatter([p.budget / scale for p in bad], [1.0] * len(bad), marker="x", color="tab:red")
        for p in bad:
            ax.annotate(p.label, (p.budget / scale, 1.0), textcoords="offset points", xytext=(4, 4), fontsize="small")
        ax.set_xlim(left=min(p.budget for p in points) / scale * 0.9)
    if eager_peak:
        ax.axvline(eager_peak / scale, color="tab:gray", linestyle=":", label=f"eager peak {eager_peak / scale:.2f} {unit}")
    ax.set_xlabel(f"budget ({unit})")
    ax.set_ylabel("predicted step time / store-all")
    ax.set_title(title or "memory / time trade-off")
    ax.legend(fontsize="small")
    return fig


def plot_rank_memory(report: "RankReport", *, title: str | None = None) -> Figure:
    """One rank's step under `memplan.fully_shard` (`memplan.tools.sharded_report.RankReport`) as one
    stacked bar: what FSDP2 holds all step (parameter shards, optimizer state shards, the root's
    gathered parameters), and the rest of the predicted peak (the planned graphs with the gathered
    blocks, gradients and FSDP2's communication buffers, whose most at once is marked inside it);
    the budget, the measured peak and plain FSDP2's step as lines."""
    from matplotlib.figure import Figure

    held = {name: report.categories.get(name, 0)
            for name in ("parameter shards", "optimizer state (shards)", "root parameters, gathered")}
    rest = max(0, report.predicted_peak - sum(held.values()))
    parts = {**held, "planned graphs, gathered blocks, gradients, buffers": rest}
    scale, unit = _unit(max(report.budget, report.measured_peak, report.predicted_peak, report.eager_peak or 0))
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.add_subplot()
    left = 0.0
    for (name, nbytes), color in zip(parts.items(), ("tab:blue", "tab:purple", "tab:cyan", "tab:orange")):
        ax.barh(0, nbytes / scale, left=left, color=color, label=f"{name} {format_bytes(nbytes)}")
        left += nbytes / scale
    comm = report.categories.get("communication buffers (most at once)", 0)
    if comm:
        start = sum(held.values()) / scale
        ax.barh(0, comm / scale, left=start, height=0.25, color="tab:red", alpha=0.6,
                label=f"of which FSDP2's communication buffers, most at once {format_bytes(comm)}")
    ax.axvline(report.budget / scale, color="black", linestyle="--", label=f"budget {format_bytes(report.budget)}")
    ax.axvline(report.measured_peak / scale, color="tab:green", label=f"measured {format_bytes(report.measured_peak)}")
    if report.eager_peak:
        ax.axvline(report.eager_peak / scale, color="tab:gray", linestyle=":",
                   label=f"plain FSDP2 {format_bytes(report.eager_peak)}")
    ax.set_yticks([])
    ax.set_xlabel(f"bytes on one rank ({unit})")
    ax.set_title(title or f"one rank of {report.world_size} under memplan.fully_shard: predicted peak "
                          f"{format_bytes(report.predicted_peak)}")
    fig.legend(fontsize="small", loc="outside lower center", ncol=2)
    return fig
