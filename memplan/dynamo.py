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
``REUSE_SLACK`` gets a new plan (at most ``MAX_LEVELS`` kept per graph). The backend sees a
graph only when dynamo compiles it, just before its first run, so **the first step**
plans each graph knowing only the graphs before it: it can exceed the budget by the
parameters and gradients of the graphs after the running one. From the second step on
every graph's allowance counts the whole step. Eager Python between graphs (what dynamo
runs itself) is outside every plan.

What the backend does not do that ``memplan.optimize`` does: own the optimizer update
(``optimizer=``), saved plans (``plan=``) and budgets relative to the eager peak (``"50%"``):
a graph break splits those decisions across plans the backend sees one at a time.
"""
from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from solvers.strategies.ledger import Call, StepLedger
from memplan.api import OptimizedModule, budget_fraction, parse_budget
from memplan.capture import CaptureError, NothingToDifferentiate
from memplan.plan import InfeasibleBudgetError, Plan
from memplan.runtime import PlannedStep
from memplan.storage import storage_key
from memplan.units import format_bytes

# A graph keeps its plan while its allowance stays within this share below the plan's budget
# (and never above it): re-planning for every few bytes another graph's plan moves is not worth a solve.
REUSE_SLACK = 0.05
# Plans at this many budget levels are kept per graph (the least recently used goes first).
MAX_LEVELS = 4
# What the backend passes on to each graph's OptimizedModule.
PLAN_OPTIONS = ("solver", "time_limit", "device_profile", "offload", "profile", "compile", "kernel_scratch")


class BudgetSplitWarning(UserWarning):
    """A graph's smallest plan did not fit what the other graphs of the step left it."""


class CompiledGraph:
    """One graph from dynamo, planned for its allowance of the step's budget at each call."""

    def __init__(self, backend: "MemplanBackend", gm: fx.GraphModule, example_inputs: list[Any], index: int):
        self.backend = backend
        self.gm = gm
        self.index = index
        self.read_as_numbers = _scalars_read_as_numbers(gm)
        self.stateful = _GraphWithBuffers(gm, example_inputs)
        # (budget, carry limit) -> a module planned for them, least recently used first
        self.levels: collections.OrderedDict[tuple[int, int | None], OptimizedModule] = collections.OrderedDict()
        # (level, shape) pairs whose module already holds a plan: later calls go straight to the step
        # (a module's own signature lookup would repeat the work `prepare` did, on every call)
        self.prepared: set[tuple[tuple[int, int | None], Any]] = set()
        # Per input shape (an expert's graph is called with as many shapes as token counts):
        self.failed: set[tuple[Any, int, int | None]] = set()  # (shape, budget, carry limit) where no plan fits
        self.min_budget: dict[Any, int] = {}  # shape -> the smallest plan's peak, once a budget was below it
        self.last_allowance: int | None = None
        self.unplanned = False  # set when the graph cannot be captured: it then runs as dynamo made it

    def __call__(self, *args: Any) -> Any:
        if self.read_as_numbers:
            args = tuple(a.item() if i in self.read_as_numbers else a for i, a in enumerate(args))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.unplanned or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return self.gm(*args)  # nothing is saved for a backward: nothing to plan
        ledger = self.backend.ledger
        # One pass over the arguments (this runs every call): parameters and buffers are resident,
        # each parameter makes a gradient, the step's own inputs (the batch) are the caller's, held
        # until the step ends.
        first = not ledger.live
        resident: dict[int, int] = {}
        final: dict[tuple[str, int], int] = {}
        others: dict[int, int] = {}
        for i, t in enumerate(args):
            if not isinstance(t, torch.Tensor):
                continue
            key, nbytes = storage_key(t), t.untyped_storage().nbytes()
            if isinstance(t, nn.Parameter) or i in self.stateful.buffer_set:
                resident[key] = nbytes
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    final[("grad", key)] = t.numel() * t.element_size()
            else:
                others[key] = nbytes
        step_inputs = {k: b for k, b in others.items() if k not in resident} if first else {}
        if not first:  # what eager code since the last graph saved for its backward is held too
            ledger.hold_with_last(_saved_by_eager_autograd(tensors))
        call = ledger.begin(resident, final, step_inputs, frozenset(resident) | frozenset(others))
        allowance = self.last_allowance = ledger.allowance(call)
        limit = ledger.carry_limit(call)
        args = self.stateful.bind(args)  # the module's buffers are the plan's buffers, the rest its inputs
        try:
            module = self._planned(allowance, limit, args)
        except CaptureError as exc:
            return self._run_unplanned(exc, args)
        if module is None and limit is not None:  # the limit asked too much of this graph: keep what it needs
            module = self._planned(allowance, None, args)
        if module is None:
            # The graphs before this one carry too much for it: they carry less from the next
            # step on (`StepLedger.short`); this call runs its smallest plan, over the budget.
            least = self.min_budget.get(_shape_key(args), allowance)
            ledger.short(call, least - allowance)
            self.backend.warn_over(self.index, least - allowance)
            module = self._planned(least, None, args, exact=True)
            if module is None:
                raise InfeasibleBudgetError(self.backend.budget, least + ledger.held_by_others(call))
        out = module(*args)
        self._hold_until_backward(call, module.plan, tensors, out)
        return out

    @property
    def latest_plan(self) -> Plan | None:
        """The plan of the module used last (every module kept in :attr:`levels` has one); None
        before the graph was planned."""
        return next(reversed(self.levels.values())).plan if self.levels else None

    def _run_unplanned(self, exc: CaptureError, args: tuple) -> Any:
        """This graph cannot be planned: from now on it runs as dynamo handed it over (its memory
        outside every plan, said once unless there is simply no backward through it)."""
        self.unplanned = True
        if not isinstance(exc, NothingToDifferentiate):
            warnings.warn(f"memplan backend: graph {self.index} runs unplanned, outside the budget: {exc}",
                          UserWarning, stacklevel=3)
        return self.stateful(*args)

    def _planned(self, budget: int, limit: int | None, args: tuple, exact: bool = False) -> OptimizedModule | None:
        """A module with a plan for ``args`` at a budget at most ``budget`` (within ``REUSE_SLACK`` of
        it, or ``exact``) carrying at most ``limit``; None where no plan fits (remembered per input
        shape, with the smallest plan's peak in :attr:`min_budget`)."""
        budget = max(budget, 1)  # nothing left: a 1-byte attempt still finds the smallest plan
        shape = _shape_key(args)
        if any(s == shape and l == limit and b >= budget for s, b, l in self.failed):
            return None
        key = next(((b, l) for (b, l) in self.levels
                    if l == limit and (b == budget or (not exact and (1 - REUSE_SLACK) * budget <= b <= budget))),
                   (budget, limit))
        module = self.levels.get(key)
        if module is not None and (key, shape) in self.prepared:
            self.levels.move_to_end(key)
            return module
        if module is None:
            module = OptimizedModule(self.stateful, budget, carry_limit=limit, **self.backend.plan_options)
            # A graph's outputs get their gradients from the graphs after it, by design: no loss to move inside.
            module._warned_loss_outside = True
            self.levels[key] = module
            while len(self.levels) > MAX_LEVELS:
                dropped, _ = self.levels.popitem(last=False)
                self.prepared = {(k, sh) for k, sh in self.prepared if k != dropped}
        try:
            module.prepare(*args)
        except CaptureError:
            self.levels.pop(key, None)
            raise
        except InfeasibleBudgetError as exc:
            self.failed.add((shape, *key))
            self.levels.pop(key, None)
            if limit is None:
                self.min_budget[shape] = max(self.min_budget.get(shape, 0), exc.min_budget)
            return None
        self.levels.move_to_end(key)
        self.prepared.add((key, shape))
        return module

    def _hold_until_backward(self, call: Call, plan: Plan, inputs: list[torch.Tensor], out: Any) -> None:
        """Open this call's carried account in the ledger; close it when the backward reaches
        the graph's inputs, or when its autograd graph is dropped without a backward."""
        ledger = self.backend.ledger
        # What the graph returned, by storage (a view of an input is no new memory): the plan's
        # carried bytes include it, the ledger counts it apart, once, against the graphs that do not read it.
        seen = {storage_key(t) for t in inputs}
        returned: dict[int, int] = {}
        outputs = _tensors(out)
        for t in outputs:
            k = storage_key(t)
            if k not in seen:
                seen.add(k)
                returned[k] = t.untyped_storage().nbytes()
        token = ledger.hold(call, max(0, plan.carried_bytes - sum(returned.values())), returned)
        handle: list[Any] = []

        def release(*_grads: Any) -> None:
            ledger.release(token)
            while handle:
                handle.pop().remove()

        nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
        step = next((n for n in nodes if getattr(n, "_forward_cls", None) is PlannedStep), None)
        if step is not None:
            # The planned step's own autograd node: its post-hook runs once its backward (the
            # plan's whole backward) has returned, and goes with the node. One hook, where a hook
            # on every input would cost a registration per parameter per call.
            step.register_hook(release)
        else:
            needing = [t for t in inputs if t.requires_grad]
            handle.append(torch.autograd.graph.register_multi_grad_hook(needing, release, mode="any"))
        node = step or (nodes[0] if nodes else None)
        if node is not None:
            try:
                weakref.finalize(node, ledger.release, token)
            except TypeError:  # an output view's node takes no weak reference; the hook still releases
                pass


class _GraphWithBuffers(nn.Module):
    """A dynamo graph whose module buffers are buffers again.

    Dynamo hands a module's buffers (BatchNorm's running statistics) to the graph as inputs,
    which the graph updates in place; memplan plans steps that update buffers (applied once,
    after the forward) but not steps that write to their inputs. The inputs dynamo took from
    a module's ``_buffers`` are registered here, so that a plan treats them as buffers; the
    tensors are the model's own, rebound on every call (a module may replace a buffer)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        super().__init__()
        self.graph_module = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.buffer_positions: list[int] = []
        for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
            grapharg = node.meta.get("grapharg")
            source = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
            if isinstance(example, torch.Tensor) and "._buffers[" in source:
                self.register_buffer(f"b{i}", example)
                self.buffer_positions.append(i)
        self.buffer_set = frozenset(self.buffer_positions)
        self.arity = len(placeholders)

    def bind(self, args: tuple) -> tuple:
        """Take this call's buffers from ``args``; the other arguments, for :meth:`forward`."""
        for i in self.buffer_positions:
            self._buffers[f"b{i}"] = args[i]
        return tuple(a for i, a in enumerate(args) if i not in self.buffer_set)

    def forward(self, *rest: Any) -> Any:
        it = iter(rest)
        args = [self._buffers[f"b{i}"] if i in self.buffer_set else next(it) for i in range(self.arity)]
        return self.graph_module(*args)


def _scalars_read_as_numbers(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of inputs the graph only reads as Python numbers (``x.item()``), rewritten in
    place to take the number itself.

    With ``dynamic=True`` dynamo passes a module's float attributes (LayerNorm's ``eps``) as 0-d
    tensors and reads them with ``.item()`` inside the graph; a plan is made on fake tensors,
    whose values cannot be read. The number is a constant of the input signature instead (its
    plan is reused while the value stays the same, as dynamo's own guards would have it)."""
    positions = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        users = list(node.users)
        if users and all(u.op == "call_method" and u.target == "item" and len(u.args) == 1 for u in users):
            for user in users:
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
            positions.append(i)
    if positions:
        gm.recompile()
    return frozenset(positions)


def _saved_by_eager_autograd(inputs: list[torch.Tensor]) -> dict[int, int]:
    """Storages (key -> bytes) that eager autograd saved for backward between the planned graphs
    and these inputs: the ``_saved_*`` tensors of every autograd node reached back from the inputs,
    stopping at planned steps (their memory is in their plans) and at leaves.

    Eager Python between graphs (what dynamo runs itself, frames it skips) keeps tensors for its
    backward like any eager code; the ledger has to count them to know what a graph is left."""
    saved: dict[int, int] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in inputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, PlannedStep._backward_cls) or type(node).__name__ == "AccumulateGrad":
            continue
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed by a backward
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    saved[storage_key(t)] = t.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return saved


def _shape_key(args: tuple) -> tuple:
    """What a plan depends on in a graph's arguments: each tensor's shape and dtype, other values as they are."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class MemplanBackend:
    """A ``torch.compile`` backend that plans every graph under one shared step budget.

    One instance per compiled model: its :attr:`ledger` is that model's step. ``options``
    are those of ``memplan.optimize`` that apply per graph: ``solver``, ``time_limit``,
    ``device_profile``, ``offload``, ``profile``."""

    def __init__(self, budget: int | str, **options: Any):
        if budget_fraction(budget) is not None:
            raise ValueError(
                f"memplan.backend: budget={budget!r}: a share of the eager peak needs the whole step's graph, and "
                "the backend sees a step's graphs one at a time; give bytes (\"16GB\"), or use memplan.optimize"
            )
        unknown = set(options) - set(PLAN_OPTIONS)
        if unknown:
            raise TypeError(f"unknown option(s) for memplan.backend: {', '.join(sorted(unknown))} (it takes budget= "
                            f"and {', '.join(PLAN_OPTIONS)}; optimizer= and plan= are memplan.optimize's)")
        self.budget = parse_budget(budget)
        self.plan_options = options
        self.ledger = StepLedger(self.budget)
        self.graphs: list[CompiledGraph] = []
        self.overruns = 0  # calls that ran over their allowance (their smallest plan did not fit)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graph = CompiledGraph(self, gm, example_inputs, len(self.graphs))
        self.graphs.append(graph)
        return graph

    def warn_over(self, graph: int, over: int) -> None:
        """Say that a step runs over the budget while the ledger learns the split."""
        self.overruns += 1
        if self.overruns > 1 and self.ledger.steps_seen > 0 and self.overruns % 10:
            return  # once while learning, then every tenth time: a split that never settles
        warnings.warn(
            f"memplan backend: graph {graph} needs {format_bytes(over)} more than the step budget leaves it "
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
        return "\n".join(lines)


def backend(budget: int | str, **options: Any) -> MemplanBackend:
    """``torch.compile(model, backend=memplan.backend(budget="16GB"))``: see :mod:`memplan.dynamo`."""
    return MemplanBackend(budget, **options)


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
        entry = (options, MemplanBackend(options["budget"], **rest))
        _BY_OPTIONS[id(options)] = entry
    return entry[1](gm, example_inputs)


def register() -> None:
    """Make ``backend="memplan"`` known to ``torch.compile`` (also done by the package's
    ``torch_dynamo_backends`` entry point, without importing memplan)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "memplan" not in _BACKENDS:
        register_backend(memplan_backend, name="memplan")
