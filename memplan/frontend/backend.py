"""memplan as a ``torch.compile`` backend: every subgraph dynamo hands over is planned,
and the subgraphs of one step share its budget.

    compiled = torch.compile(model, backend=memplan.backend(budget="16GB"))
    compiled = torch.compile(model, backend="memplan", options={"budget": "16GB"})

Dynamo traces the model's Python: data-dependent branches, ``.item()``, boolean-mask
indexing and side-effecting hooks become graph breaks (eager Python between graphs, as
in eager mode), guards and recompilation are dynamo's. Each graph it hands over is a
plain ``fx.GraphModule`` whose parameters arrive as inputs; memplan plans it exactly as
``memplan.optimize`` plans a module (one plan per input signature: a graph that dynamo
made shape-generic gets a plan per concrete shape it is called with).

**The shared budget** (`solvers.strategies.ledger.StepLedger`). While one graph runs, the
others hold memory: their parameters, what their forwards saved for their backwards,
and the gradients their backwards already made. Each call of a graph is planned for its
*allowance*, the budget less those holdings; a graph whose allowance moves by more than
``TUNABLES.reuse_slack`` gets a new plan (at most ``TUNABLES.max_levels`` kept per graph). Eager Python between
graphs (what dynamo runs itself) is outside every plan; what it saves for its backward is
counted against the graphs.

**The first step** (`_FirstStep`). The backend sees a graph only when dynamo compiles it,
just before its first run, so no graph of the first step can be planned knowing the graphs
after it. The first step does not plan its forwards: each graph runs without saving
anything for its backward (its inputs kept, as ``torch.utils.checkpoint`` keeps them), so
the forward holds no more than any later step's. At the first backward every graph of the
step is known: the backend rehearses the next step's forward through a copy of the ledger
(`StepLedger.rehearsal`), planning each graph for its allowance and learning the carry
limits the later steps need, so the second step runs within the budget too; where no
split of the step fits, it raises `SplitBudgetError` there, naming the graph breaks and
the smallest budget found for the split, before any step went over. Each graph's backward
then runs its plan whole (its forward again, then its backward), planned for what the
ledger leaves it at that moment (`StepLedger.backward_allowance`).

What the backend does not do that ``memplan.optimize`` does: own the optimizer update
(``optimizer=``), saved plans (``plan=``) and budgets relative to the eager peak (``"50%"``):
a graph break splits those decisions across plans the backend sees one at a time.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch.fx as fx

from solvers.strategies.ledger import Call, StepLedger
from memplan.frontend.budget import budget_fraction, parse_budget
from memplan.costs.cost_model import DeviceProfile
from memplan.pipeline.options import PlanOptions
from memplan.capture.signature import CaptureError
from memplan.pipeline.plan import InfeasibleBudgetError, Plan
from memplan.core.units import format_bytes
from memplan.frontend.distributed import DistributedTrainingError
from memplan.frontend.graphs import FirstCall, PlannedGraph, tail_bytes_of
from memplan.core.config import TUNABLES


class BudgetSplitWarning(UserWarning):
    """A graph's smallest plan did not fit what the other graphs of the step left it."""


class SplitBudgetError(InfeasibleBudgetError):
    """No split of the step fits the budget: the model, split at its graph breaks, needs at least
    ``min_budget`` (the smallest budget at which memplan found plans for every graph of the step)."""

    def __init__(self, budget: int, min_budget: int, graphs: int, breaks: list[str], lower: int, found: bool = True,
                 sharded: bool = False):
        super().__init__(budget, min_budget)
        self.breaks = breaks
        self.lower_bound = lower  # no split fits below this: a graph's smallest plan with what the others must hold
        sites = "; ".join(breaks) if breaks else "no graph break recorded"
        each = "block" if sharded else "graph of the split"
        smallest = (f"the smallest budget at which memplan found plans for every {each} is "
                    f"{format_bytes(min_budget)} ({min_budget} bytes)" if found else
                    f"memplan found no plans for the split up to {format_bytes(min_budget)} ({min_budget} bytes)")
        if sharded:  # memplan.fully_shard: the graphs are FSDP2's blocks
            self.args = (
                f"memplan.fully_shard: the budget {format_bytes(budget)} per rank is too small for this model's "
                "blocks under FSDP2. While a block runs, the rank holds every parameter's shard, the optimizer's "
                "state, the root module's gathered parameters and gradients, what the other blocks keep for their "
                "backwards, and FSDP2's staging and prefetched parameters: no plan can fit below "
                f"{format_bytes(lower)}, and {smallest}. Raise the budget, "
                "shard over more ranks, or shrink the batch. Raised at the first step's backward, before any step "
                "went over the budget.",
            )
            return
        self.args = (
            f"memplan backend: the step budget {format_bytes(budget)} is too small for this model split at its "
            f"{len(breaks)} graph break(s) into {graphs} graphs ({sites}). While one graph runs, the others hold "
            f"their parameters, what they keep for their backwards and their gradients: no split can fit below "
            f"{format_bytes(lower)}, and {smallest}. Raise the budget, remove the graph breaks (a model traced as "
            "one graph is planned whole), or shrink the batch. Raised at the first step's backward, before any "
            "step went over the budget.",
        )


class MemplanBackend:
    """A ``torch.compile`` backend that plans every graph under one shared step budget.

    One instance per compiled model: its :attr:`ledger` is that model's step. ``options``
    (`memplan.pipeline.options.PlanOptions`, as ``memplan.optimize`` takes them) apply to each graph's plan."""

    def __init__(self, budget: int | str, options: PlanOptions = PlanOptions()):
        if budget_fraction(budget) is not None:
            raise ValueError(
                f"memplan.backend: budget={budget!r}: a share of the eager peak needs the whole step's graph, and "
                "the backend sees a step's graphs one at a time; give bytes (\"16GB\"), or use memplan.optimize"
            )
        self.budget = parse_budget(budget)
        self.plan_options = options
        self.ledger = StepLedger(self.budget)
        self.graphs: list[PlannedGraph] = []
        self.overruns = 0  # calls that ran over their allowance (their smallest plan did not fit)
        self.first_calls: list[FirstCall] = []  # the first step's calls, in order, until it is rehearsed
        self.rehearsed = False
        # FSDP2's holdings, where `memplan.fully_shard` made this backend (`memplan.frontend.sharded`)
        self.sharding: Any = None
        # The *tail*: eager code after the step's last graph (a loss head: logits, log-softmax), in no
        # plan. Its backward runs while every graph still holds what it carried; what it holds then
        # (`end_of_forward`) is one more call of the ledger.
        self.tail_bytes = 0
        self.tail_final: dict[Any, int] = {}  # the gradients the tail's backward makes (key -> bytes)

    def new_step(self) -> None:
        """A step begins: the first step's calls are no longer needed (a first step without a backward
        leaves the next steps to learn the split as they run)."""
        self.first_calls = []
        self.rehearsed = False

    def end_of_forward(self, outputs: Any) -> None:
        """The step's forward has returned ``outputs`` (a hook on the model calls this where memplan owns
        the model's call: `memplan.fully_shard`). What the tail (eager code after the last graph) holds
        at its backward is read off the autograd graph (`tail_bytes_of`): in the first step it is kept
        for the rehearsal of the next; in later steps the tail is a call of the ledger after the last
        graph, and where it does not fit beside what the graphs carry, they carry less from the next
        step on."""
        if not self.ledger.live:
            return  # no graph of this step waits for a backward
        # counted elsewhere: what is held all step, and what the graphs returned (their accounts)
        held = {*self.ledger.resident, *self.ledger.step_resident,
                *self.ledger.returned}
        leaves: list = []
        self.tail_bytes = tail_bytes_of(outputs, held, leaves)
        if self.sharding is not None:
            self.tail_final = self.sharding.root_grads_made_by(leaves)
            self.ledger.closing = self.sharding.closing
        if self.ledger.steps_seen == 0:
            # the first step's graphs carry nothing: the rehearsal makes room for the tail; its call is
            # opened all the same, so that the gradients it makes count in the first step's backwards
            # and in the rehearsal's
            self._tail_call(self.ledger)
            return
        over = self._tail_over(self.ledger)
        if over > 0:
            self.warn_over("the code after the last graph", over)

    def outside(self, unit: int | None, after_blocks: bool = False) -> tuple[int, int]:
        """What a distributed engine holds outside the plan of a call that is FSDP2's block ``unit``
        (`Call.transient`, `Call.staging`), or of the root's code ``after_blocks`` (a loss head: the
        last block, gathered ahead of its backward while that code's backward runs); nothing for
        any other call."""
        if self.sharding is None:
            return 0, 0
        if unit is not None:
            return self.sharding.outside(unit)
        return (self.sharding.ahead_of_tail, 0) if after_blocks else (0, 0)

    @property
    def predicted_peak(self) -> int:
        """The step's predicted peak: the most at any call of the last whole step (its plan's
        forward or backward beside what the other plans and the engine hold), or at its end
        (`StepLedger.predicted_peak`); 0 before a step was planned."""
        return self.ledger.predicted_peak

    def _tail_call(self, ledger: StepLedger) -> Call | None:
        """Open the tail's call in ``ledger`` (None where there is no tail), its memory predicted."""
        if not self.tail_bytes:
            return None
        # Under FSDP2 the root's backward begins here and gathers the last block ahead of its backward.
        call = ledger.begin({}, self.tail_final, {}, frozenset(),
                            self.sharding.ahead_of_tail if self.sharding is not None else 0)
        ledger.predict(call, 0, self.tail_bytes)
        return call

    def _tail_over(self, ledger: StepLedger) -> int:
        """Open the tail's call in ``ledger``; the bytes it is over its allowance (0: it fits), which the
        calls carrying now give way from the next step on (`StepLedger.short`)."""
        call = self._tail_call(ledger)
        if call is None:
            return 0
        over = self.tail_bytes - ledger.allowance(call)
        if over > 0:
            ledger.short(call, over)
        return max(0, over)

    def rehearse(self) -> None:
        """At the first step's first backward, with every graph of the step known: play the next
        step's forward through a copy of the ledger, planning each call for its allowance, as many
        times as the carry limits take to settle (each replay is what one more step would learn),
        and keep the limits it settles on, so that the second step runs within the budget. Where no
        split fits, raise `SplitBudgetError` with the smallest budget found for the split."""
        if self.rehearsed or not self.first_calls:
            return
        self.rehearsed = True
        if self.sharding is None:
            self._rehearse()
            return
        # Under FSDP2 every rank rehearses here, at the same point of its first step: where one rank's
        # budget is too small, every rank raises (a rank that went on would wait in FSDP2's next
        # collective for the one that stopped).
        failed: Exception | None = None
        try:
            self._rehearse()
        except Exception as exc:  # any rank's failure stops them all (the others would wait in FSDP2)
            failed = exc
        if self.sharding.any_rank(failed is not None) and failed is None:
            raise DistributedTrainingError(
                "memplan.fully_shard: another rank found its budget too small for its blocks (its error says "
                "by how much); every rank stops here")
        if failed is not None:
            raise failed

    def _rehearse(self) -> None:
        calls = [c for c in self.first_calls if c.args is not None]
        rehearsed, short, floor = self._replay(self.ledger.rehearsal(), calls)
        if not short:
            self.ledger.adopt(rehearsed)
            return
        # No split fits. At least `floor` more bytes are needed (a graph's smallest plan, with the
        # graphs before it carrying nothing but what they return); try budgets from there up.
        lower = self.budget + max(floor, 0)
        need, found = self.budget + (floor if floor > 0 else min(short.values())), None
        for _ in range(TUNABLES.min_budget_tries):
            trial = self.ledger.rehearsal()
            trial.budget, trial.reserve, trial.pending, trial.most_carried = need, {}, {}, {}
            _, short, floor = self._replay(trial, calls)
            if not short:
                found = need
                break
            need += floor if floor > 0 else max(short.values())
        graphs = sorted({c.graph.index for c in calls})
        breaks = [f"after graph {g.index}: {g.graph_break}" for g in self.graphs
                  if g.index in graphs[:-1] and g.graph_break]
        raise SplitBudgetError(self.budget, found if found is not None else need, len(graphs), breaks,
                               lower=lower, found=found is not None, sharded=self.sharding is not None)

    def _replay(self, ledger: StepLedger, calls: list[FirstCall]) -> tuple[StepLedger, dict[int, int], int]:
        """Replay the step's ``calls`` through ``ledger`` (a rehearsal) until no call is short of its
        allowance or the limits cannot help; the ledger, what each call of the last replay was short
        by (call position -> bytes; empty when the split fits), and the most any call was short by
        beyond all that the calls before it carried (> 0: no carry limit can make the split fit)."""
        short: dict[int, int] = {}
        floor = 0
        for _ in range(TUNABLES.rehearsals):
            short, floor = {}, 0
            for record in calls:
                graph, account = record.graph, record.account
                first = not ledger.live
                if account.eager_saved and not first:
                    ledger.hold_with_last(account.eager_saved)
                carried_before = sum(c for _, c, _ in ledger.live.values())
                final = account.final if self.sharding is None else self.sharding.rehearsed_finals(account.final)
                call = ledger.begin(account.resident, final, account.step_inputs, account.inputs,
                                    *self.outside(account.unit, account.after_blocks))
                if account.eager_saved and first:
                    ledger.hold_to_end(account.eager_saved)
                if first and self.sharding is not None:  # what the step rehearsed leaves unreduced, held in the next
                    ledger.hold_to_end({("unreduced", unit): b for unit, b in self.sharding.unreduced.items()})
                carried = 0
                if not graph.unplanned:
                    try:
                        module, over = graph.plan_call(ledger.allowance(call), ledger.carry_limit(call), record.args)
                    except CaptureError as exc:
                        graph.mark_unplanned(exc)
                        module, over = None, 0
                    if over:
                        short[call.position] = over
                        floor = max(floor, over - carried_before)
                        ledger.short(call, over)
                    if module is not None:
                        record.module = module
                        plan = module.prepare(*record.args)  # the plan for these inputs' shapes
                        ledger.predict(call, *plan.phase_peaks, sources=int(plan.simulated.initial))
                        carried = max(0, plan.carried_bytes - sum(account.outputs.values()))
                # (a graph that holds its inputs again since the first step let one go holds them all)
                held = account.held_next if graph.inputs_dropped else account.held
                ledger.hold(call, carried, {**held, **account.outputs})
            carried_before = sum(c for _, c, _ in ledger.live.values())
            over = self._tail_over(ledger)
            if over:
                short[len(calls)] = over
                floor = max(floor, over - carried_before)
            ledger.live.clear()  # the replayed step's backwards have run
            if ledger.at_end > ledger.budget:  # every gradient and an engine's last buffers: nothing gives way
                short[len(calls) + 1] = ledger.at_end - ledger.budget
                floor = max(floor, ledger.at_end - ledger.budget)
            if not short or floor > 0:
                break
            settled = {pos: min(ledger.reserve.get(pos, 0) + more, ledger.most_carried.get(pos, 0))
                       for pos, more in ledger.pending.items()}
            if all(settled[pos] == ledger.reserve.get(pos, 0) for pos in settled):
                break  # nothing carried gives way any more: this budget is too small for the split
        return ledger, short, floor

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graph = PlannedGraph(self, gm, example_inputs, len(self.graphs))
        self.graphs.append(graph)
        return graph

    def warn_over(self, graph: int | str, over: int) -> None:
        """Say that a step runs over the budget while the ledger learns the split."""
        self.overruns += 1
        if self.overruns > 1 and self.ledger.steps_seen > 0 and self.overruns % 10:
            return  # once while learning, then every tenth time: a split that never settles
        warnings.warn(
            f"memplan backend: {graph if isinstance(graph, str) else f'graph {graph}'} needs {format_bytes(over)} "
            "more than the step budget leaves it "
            f"after what the other graphs hold; this step runs over the {format_bytes(self.budget)} budget, and "
            "the graphs before it plan for less from the next step on. If this repeats, the budget is too small "
            "for the model split at these graph breaks.",
            BudgetSplitWarning,
            stacklevel=3,
        )

    def reset(self) -> None:
        """``torch._dynamo.reset()``: forget the graphs and the step."""
        self.graphs.clear()
        self.ledger = StepLedger(self.budget)
        self.new_step()

    @property
    def plans(self) -> list[Plan]:
        """The most recent plan of each graph that has one, in compile order."""
        return [g.latest_plan for g in self.graphs if g.latest_plan is not None]

    def report(self) -> str:
        """One line per graph: its last allowance and its plan's predicted peak and carried bytes."""
        lines = [f"memplan backend: {len(self.graphs)} graph(s), step budget {format_bytes(self.budget)}"]
        for g in self.graphs:
            plan = g.latest_plan
            if plan is None:
                lines.append(f"  graph {g.index}: not planned (no gradient needed)")
                continue
            lines.append(f"  graph {g.index}: allowance {format_bytes(g.last_allowance or 0)}, planned peak "
                         f"{format_bytes(plan.predicted_peak)}, carried to backward {format_bytes(plan.carried_bytes)}")
        if self.predicted_peak:
            lines.append(f"  predicted step peak {format_bytes(self.predicted_peak)} (every graph with what the "
                         "others and the code between them hold)")
        if self.sharding is not None:
            lines.append("  FSDP2 on this rank: " + ", ".join(
                f"{name} {format_bytes(nbytes)}" for name, nbytes in self.sharding.categories().items()))
        return "\n".join(lines)


def backend(
    budget: int | str,
    *,
    solver: str = "auto",
    time_limit: float | None = None,
    device_profile: str | DeviceProfile | None = None,
    offload: bool | None = None,
    profile: bool = False,
    compile: bool | Callable[..., Any] = False,
    kernel_scratch: bool | None = None,
    host_memory: int | str | None = None,
) -> MemplanBackend:
    """``torch.compile(model, backend=memplan.backend(budget="16GB"))``: see :mod:`memplan.frontend.backend`.

    ``budget`` is the whole step's, in bytes or a string such as ``"16GB"``. The other options are
    `memplan.pipeline.options.PlanOptions`' (as for ``memplan.optimize``), applied to each graph's plan;
    ``optimize``'s step options (``optimizer=`` and the rest) and ``plan=`` need the step as one graph."""
    return MemplanBackend(budget, PlanOptions(solver=solver, time_limit=time_limit, device_profile=device_profile,
                                              offload=offload, profile=profile, compile=compile,
                                              kernel_scratch=kernel_scratch, host_memory=host_memory))


# torch.compile(model, backend="memplan", options={...}) calls the registered function once per
# graph with the same options dict: one backend (one ledger) per dict, that is per compiled model.
_BY_OPTIONS: dict[int, tuple[dict, MemplanBackend]] = {}


def memplan_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict | None = None) -> Any:
    """The backend registered as ``"memplan"``; ``options`` holds ``budget`` and the per-graph options."""
    options = options or {}
    if "budget" not in options:
        raise ValueError('torch.compile(backend="memplan") needs options={"budget": ...} (bytes or "16GB")')
    entry = _BY_OPTIONS.get(id(options))
    if entry is None or entry[0] is not options:
        rest = {k: v for k, v in options.items() if k != "budget"}
        unknown = set(rest) - {f.name for f in dataclasses.fields(PlanOptions)}
        if unknown:
            raise TypeError(f"unknown option(s) for the memplan backend: {', '.join(sorted(unknown))} (it takes budget "
                            "and memplan.pipeline.options.PlanOptions' fields; optimizer= and plan= are memplan.optimize's)")
        entry = (options, backend(options["budget"], **rest))
        _BY_OPTIONS[id(options)] = entry
    return entry[1](gm, example_inputs)


def register() -> None:
    """Make ``backend="memplan"`` known to ``torch.compile`` (also done by the package's
    ``torch_dynamo_backends`` entry point, without importing memplan)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "memplan" not in _BACKENDS:
        register_backend(memplan_backend, name="memplan")
