"""Views of a plan for people: the numbers behind each picture, and the matplotlib figures.

One job: turn a :class:`~memplan.plan.Plan` into what the CLI prints and the
notebook draws, without planning anything new (except :func:`sweep`, which
solves one analysis at several budgets for the trade-off curve).

* :func:`memory_timelines` / :func:`plot_memory`: device memory over the
  predicted step time, eager (the joint graph in order, keeping everything)
  against planned, with the budget and the forward/backward phases;
* :func:`rs_matrices` / :func:`plot_rs_matrices`: Checkmate's R and S
  matrices read off the schedule (which value is computed, and which is
  resident, at each stage);
* :func:`layer_breakdown` / :func:`plot_layers`: bytes kept, recomputed and
  offloaded per submodule, and the time recomputation costs there;
* :func:`sweep` / :func:`plot_budget_curve`: predicted overhead against budget.

Every number comes from the one simulator (``solvers.simulate``) over the
plan's own schedule. Figures are ``matplotlib.figure.Figure`` objects built
without pyplot, so nothing here touches the global backend: they save to PNG
through Agg and display inline in notebooks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

import solvers
from memplan.analysis import Analysis
from memplan.capture import module_path
from memplan.plan import InfeasibleBudgetError, Plan, problem_for, solve_plan
from memplan.problem import BACKWARD, is_reference
from memplan.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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


def _simulate(analysis: Analysis, schedule: "solvers.Schedule") -> "solvers.SimResult":
    """Replay a schedule on the analysis' Problem, with the host link when it moves values."""
    problem = problem_for(analysis, analysis.lowered.problem.budget, schedule.has_transfers())
    return solvers.simulate(problem, schedule)


def timeline(analysis: Analysis, schedule: "solvers.Schedule") -> Timeline:
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
    are on the device all step in both, so both include them, as the plan's predicted peak does."""
    held = plan.held_gradient_bytes
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


BUDGET_SHOWN_ABOVE_PEAK = 1.5  # a budget more than this many times both peaks is left off plot_memory's scale


def plot_memory(plan: Plan, *, title: str | None = None) -> "Figure":
    """Memory over predicted time, eager vs planned, budget line, forward/backward phases shaded.

    One axes; three lines: eager, planned, budget; and a band for gradients held from an earlier step.
    A budget far above both peaks (``optimize(model, "1TB")`` to keep everything) does not set the
    scale, or both curves would be flat at the bottom: its line is left out and the legend says so.
    """
    from matplotlib.figure import Figure

    eager, planned = memory_timelines(plan)
    budget_shown = plan.budget <= BUDGET_SHOWN_ABOVE_PEAK * max(eager.peak, planned.peak)
    top = max(eager.peak, planned.peak, plan.budget if budget_shown else 0)
    scale, unit = _unit(top)
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(eager.time * 1e3, eager.memory / scale, label=f"eager, keep everything (peak {eager.peak / scale:.2f} {unit})",
            color="tab:gray")
    ax.plot(planned.time * 1e3, planned.memory / scale, label=f"planned (peak {planned.peak / scale:.2f} {unit})",
            color="tab:blue")
    budget_label = f"budget {plan.budget / scale:.2f} {unit}" if budget_shown else \
        f"budget {format_bytes(plan.budget)}, off the scale"
    ax.axhline(plan.budget / scale if budget_shown else math.nan, color="tab:red", linestyle="--", label=budget_label)
    end = max(eager.total_time, planned.total_time) * 1e3
    if plan.held_gradient_bytes:
        ax.axhspan(0, plan.held_gradient_bytes / scale, color="tab:purple", alpha=0.15,
                   label=f"gradients held from an earlier step ({plan.held_gradient_bytes / scale:.2f} {unit})")
    ax.axvspan(0, planned.backward_start * 1e3, color="tab:green", alpha=0.06)
    ax.axvspan(planned.backward_start * 1e3, end, color="tab:orange", alpha=0.06)
    ymax = top / scale * 1.1
    ax.text(planned.backward_start * 1e3 / 2, ymax * 0.97, "forward", ha="center", va="top", color="tab:green")
    ax.text((planned.backward_start * 1e3 + end) / 2, ymax * 0.97, "backward", ha="center", va="top", color="tab:orange")
    ax.set_xlim(0, end)
    ax.set_ylim(0, ymax)
    ax.set_xlabel("predicted time in the step (ms, planned schedule shaded)")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title or f"memory over one training step: {plan.method}, {plan.predicted_overhead:.2f}x time")
    ax.legend(loc="lower right", fontsize="small")
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


def rs_matrices(plan_or_schedule: "Plan | solvers.Schedule", analysis: Analysis | None = None) -> RSMatrices:
    if isinstance(plan_or_schedule, Plan):
        schedule, analysis = plan_or_schedule.schedule, plan_or_schedule.analysis
    else:
        schedule = plan_or_schedule
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


def plot_rs_matrices(plan: Plan, *, title: str | None = None) -> "Figure":
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
            return getattr(root, "__name__", "") == "WithLoss" and getattr(root, "__module__", "") == "memplan.api"
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


def plot_layers(plan: Plan, depth: int = 2, *, top: int = 30, title: str | None = None) -> "Figure":
    """Horizontal stacked bars of kept / recomputed / offloaded bytes per submodule. One axes."""
    from matplotlib.figure import Figure

    rows = layer_breakdown(plan, depth)
    if len(rows) > top:  # the largest rows, still in graph order
        keep = set(id(r) for r in sorted(rows, key=lambda r: -(r.kept_bytes + r.recomputed_bytes + r.offloaded_bytes))[:top])
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


# --------------------------------------------------------------------------- #
# Budget sweep
# --------------------------------------------------------------------------- #


@dataclass
class SweepPoint:
    """One budget of a sweep; ``plan`` is None when the budget is infeasible."""

    label: str  # how the budget was asked for ("80%", "min", "2GB")
    budget: int
    plan: Plan | None
    min_budget: int | None = None  # set when infeasible

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    def as_dict(self) -> dict:
        p = self.plan
        return {
            "label": self.label,
            "budget": self.budget,
            "feasible": p is not None,
            "planned_peak": p.predicted_peak if p else None,
            "predicted_overhead": p.predicted_overhead if p else None,
            "method": p.method if p else None,
            "status": p.status if p else "infeasible",
            "gap": p.gap if p else None,
            "solve_time": p.solve_time if p else None,
            "min_budget": self.min_budget,
        }


def min_budget(analysis: Analysis, offload: bool = False) -> int:
    """The smallest budget the solvers can meet for this step (paging to host memory if ``offload``)."""
    return int(solvers.min_budget(problem_for(analysis, analysis.lowered.problem.budget, offload))[0])


def sweep(
    analysis: Analysis,
    budgets: Iterable[tuple[str, int]],
    *,
    solver: str = "auto",
    time_limit: float | None = None,
    on_point=None,
    offload: bool = False,
) -> list[SweepPoint]:
    """Solve one analyzed step at each ``(label, budget)``; ``on_point(point)`` after each."""
    points = []
    for label, budget in budgets:
        try:
            point = SweepPoint(label, budget, solve_plan(analysis, budget, solver=solver, time_limit=time_limit,
                                                           offload=offload))
        except InfeasibleBudgetError as exc:
            point = SweepPoint(label, budget, None, exc.min_budget)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


def plot_budget_curve(points: Sequence[SweepPoint], *, eager_peak: int | None = None, title: str | None = None) -> "Figure":
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
