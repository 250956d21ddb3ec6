"""One graph dynamo hands the backend, planned: `PlannedGraph` calls its plan per input signature, and in
the first step, before every graph of the step is known, runs it as a checkpoint whose backward plans
and runs it whole."""
from __future__ import annotations
import collections
import contextlib
import operator
import os
import warnings
import weakref
from typing import Any
import torch
import torch.fx as fx
import torch.nn as nn
from solvers.strategies.ledger import Call
from memplan.frontend.module import OptimizedModule
from memplan.capture.signature import CaptureError, NothingToDifferentiate
from memplan.pipeline.plan import InfeasibleBudgetError, Plan
from memplan.passes.output_use import OutputUse, inputs_let_go
from memplan.planning.lowering import BACKWARD
from memplan.runtime.program import PlannedStep, generator_state
from memplan.core.storage import storage_key
from memplan.core.config import TUNABLES




class PlannedGraph:
    """One graph from dynamo, planned for its allowance of the step's budget at each call."""

    def __init__(self, backend: Any, gm: fx.GraphModule, example_inputs: list[Any], index: int):
        self.backend = backend  # the `memplan.frontend.backend.MemplanBackend` that made it (imports this module)
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
        # (shape, budget, carry limit) where no plan fits -> the smallest plan's peak found there
        self.failed: dict[tuple[Any, int, int | None], int] = {}
        self.min_budget: dict[Any, int] = {}  # shape -> the smallest plan's peak, once a budget was below it
        self.last_allowance: int | None = None
        self.unplanned = False  # set when the graph cannot be captured: it then runs as dynamo made it
        self.graph_break = _graph_break_site()  # where dynamo broke the frame after this graph (None: it returned)
        # A graph that changes its inputs in place cannot be captured for a plan (it runs as dynamo
        # made it), nor run twice from its inputs as the first step runs the others.
        self.changes_inputs = _changes_inputs(gm, self.stateful.buffer_set)
        # Positions (among the bound arguments' tensors) of inputs its caller lets go when it returns
        # (`memplan.passes.output_use.inputs_dropped_after_call`), as its first planned call found them;
        # empty for good once a call differs or a backward finds one still held.
        self.inputs_dropped: frozenset[int] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.read_as_numbers:
            args = tuple(a.item() if i in self.read_as_numbers else a for i, a in enumerate(args))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.unplanned or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            if not self.unplanned and self.backend.sharding is not None:
                self.backend.sharding.mark_planned(args)  # a frozen block: nothing to plan, not missed
            return self.gm(*args)  # nothing is saved for a backward: nothing to plan
        if self.changes_inputs:
            self.mark_unplanned(CaptureError("it changes its inputs in place"), stacklevel=3)
            return self.gm(*args)
        ledger = self.backend.ledger
        # One pass over the arguments (this runs every call): parameters and buffers are resident,
        # each parameter makes a gradient, the step's own inputs (the batch) are the caller's, held
        # until the step ends.
        first = not ledger.live
        resident: dict[int, int] = {}
        final: dict[tuple[str, int], int] = {}
        others: dict[int, int] = {}
        gathered: dict[int, int] = {}  # FSDP2's all-gathered parameters: the plan's inputs while it runs
        unit: int | None = None  # FSDP2's block this graph is the forward of
        sharding = self.backend.sharding  # `memplan.frontend.sharded.ShardedAccounts` under FSDP2
        if sharding is not None:
            sharding.hold_in(ledger)
            if first:
                sharding.unreduced.clear()  # (this step's blocks say again what they leave unreduced)
                sharding.unreduced_finals.clear()
                ledger.final_bytes.update({k: b for k, b in sharding.reducing_finals().items() if k in ledger.final_bytes})
        for i, t in enumerate(args):
            if not isinstance(t, torch.Tensor):
                continue
            key, nbytes = storage_key(t), t.untyped_storage().nbytes()
            shard = sharding.shard_of(t) if sharding is not None else None
            if shard is not None:  # held by FSDP2 as its shard; what backward keeps is the gradient's shard
                gathered[key] = nbytes
                unit = shard[2]
                if t.requires_grad:
                    final[("grad", shard[0])] = sharding.gradient_bytes(unit, t, shard[0], shard[1])
            elif isinstance(t, nn.Parameter) or i in self.stateful.buffer_set:
                resident[key] = nbytes
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    final[("grad", key)] = t.numel() * t.element_size()
            else:
                others[key] = nbytes
        step_inputs = {k: b for k, b in others.items() if k not in resident} if first else {}
        eager_saved: dict[int, int] = {}
        if not first:  # what eager code since the last graph saved for its backward is held too
            leaves: list = []
            eager_saved = _saved_by_eager_autograd(tensors, leaves)
            ledger.hold_with_last(eager_saved)
            # and the gradients it makes (its backward runs after this graph's): finals of this call
            final.update(self._eager_grads(leaves, final))
        else:  # what eager code before the first graph saved (a CNN's stem): held to the step's end
            eager_saved = {k: b for k, b in _saved_by_eager_autograd(tensors).items()
                           if k not in resident and k not in others}
        if unit is not None:
            sharding.saw(unit, sum(gathered.values()))
        after_blocks = unit is None and sharding is not None and sharding.blocks_done
        call = ledger.begin(resident, final, step_inputs, frozenset(resident) | frozenset(others) | frozenset(gathered),
                            *self.backend.outside(unit, after_blocks))
        if first and eager_saved:
            ledger.hold_to_end(eager_saved)
        if first and sharding is not None:  # FSDP2's gradients accumulated by earlier steps, unreduced
            ledger.hold_to_end(sharding.accumulated())
        if first:
            self.backend.new_step()
        # Inputs other than the step's own and the resident ones: a plan holds them to its backward.
        returned = ledger.returned  # counted in another account
        held = {k: b for k, b in others.items()
                if k not in ledger.resident and k not in ledger.step_resident and k not in returned}
        bound = self.stateful.bind(args)  # the module's buffers are the plan's buffers, the rest its inputs
        # Inputs the caller lets go when this call returns, which eager autograd did not save either:
        # the plan holds them through its forward only (unless its backward reads them).
        let_go = {k for k in held if k not in eager_saved} & inputs_let_go()
        dropped = self._inputs_dropped(bound, let_go)
        if ledger.steps_seen == 0:  # the first step: its graphs are not all known yet
            return self._discover(call, bound, _Account(resident, final, step_inputs, {**others, **gathered}, held,
                                                        eager_saved, unit, dropped, after_blocks))
        allowance = self.last_allowance = ledger.allowance(call)
        limit = ledger.carry_limit(call)
        args = bound
        try:
            module, over = self.plan_call(allowance, limit, args)
        except CaptureError as exc:
            return self._run_unplanned(exc, args)
        if over:
            # The graphs before this one carry too much for it: they carry less from the next
            # step on (`StepLedger.short`); this call runs its smallest plan, over the budget.
            ledger.short(call, over)
            self.backend.warn_over(self.index, over)
        if module is None:
            raise InfeasibleBudgetError(self.backend.budget, allowance + over + ledger.held_by_others(call))
        out = module(*args)
        # (after the call: the module's plan is now the one for these inputs' shapes)
        ledger.predict(call, *module.plan.phase_peaks, sources=int(module.plan.simulated.initial))
        if dropped and self._returned_let_go(out, dropped):
            dropped = {}
        self._hold_until_backward(call, module.plan, tensors, out, {k: b for k, b in held.items() if k not in dropped})
        if dropped:
            self._check_let_go(out, [t for t in tensors if storage_key(t) in dropped])
        return out

    def _returned_let_go(self, out: Any, dropped: dict[int, int]) -> bool:
        """Whether the call returned a view of an input it was to let go (its caller then holds that
        input through the output): if so, from now on the graph's plans hold their inputs (this call,
        planned otherwise, holds it beside its plan's peak: warned)."""
        kept = {storage_key(t) for t in _tensors(out)} & dropped.keys()
        if not kept:
            return False
        warnings.warn(f"memplan backend: graph {self.index} returned a view of an input its caller lets go "
                      f"({sum(dropped[k] for k in kept)} bytes held beside its plan this step); its next plans "
                      "hold their inputs", UserWarning, stacklevel=3)
        self._hold_inputs_again()
        return True

    def _inputs_dropped(self, bound: tuple, let_go: set) -> dict[int, int]:
        """The storages (key -> bytes) of the inputs in ``bound`` that this call's plans may let go
        when forward returns: those in ``let_go``, where the graph's first planned call let go of the
        same positions (its plans are made for one set); the modules it makes assume them."""
        tensors = [a for a in bound if isinstance(a, torch.Tensor)]
        # (this runs every call: no storage is looked up where the caller declared nothing)
        positions = frozenset(i for i, t in enumerate(tensors) if storage_key(t) in let_go) if let_go else frozenset()
        if self.inputs_dropped is None:
            self.inputs_dropped = positions
        elif positions != self.inputs_dropped and self.inputs_dropped:
            self._hold_inputs_again()
        return {storage_key(tensors[i]): tensors[i].untyped_storage().nbytes() for i in self.inputs_dropped}

    def _hold_inputs_again(self) -> None:
        """From now on every plan of this graph holds its inputs as sources: forget the plans made
        for a caller that lets some go."""
        self.inputs_dropped = frozenset()
        self.levels.clear()
        self.prepared.clear()
        self.failed.clear()
        self.min_budget.clear()

    def _check_let_go(self, out: Any, inputs: list[torch.Tensor]) -> None:
        """After this call's backward, the inputs its plan let go must be gone: where one is still
        held (the caller kept a reference after all), say so, and plan the next calls holding them."""
        from torch.multiprocessing.reductions import StorageWeakRef

        # by storage: a view of the input that the caller kept holds it as well as the input itself
        refs = [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()) for t in inputs]
        step, nodes = _step_node(_tensors(out))
        node = step or (nodes[0] if nodes else None)
        if node is None:
            return

        def check(*_: Any) -> None:
            kept = sum(nbytes for ref, nbytes in refs if not ref.expired())
            if kept and self.inputs_dropped:
                warnings.warn(
                    f"memplan backend: graph {self.index}'s input(s) of {kept} bytes were still held after its "
                    "backward, though its caller declared it lets them go (memplan.WithLoss); the step held more "
                    "than planned, and its next plans hold them", UserWarning, stacklevel=2)
                self._hold_inputs_again()

        node.register_hook(check)

    def _eager_grads(self, leaves: list, final: dict) -> dict:
        """The gradients (key -> bytes) eager code between the last graph and this one makes for the
        parameters ``leaves``, under FSDP2: the root's (`ShardedAccounts.root_grads_made_by`). (Without
        FSDP2 they are not counted yet: a parameter used between graph breaks is rare.)"""
        sharding = self.backend.sharding
        if sharding is None:
            return {}
        made = sharding.root_grads_made_by(leaves)
        self.backend.ledger.closing = sharding.closing
        return made

    def _discover(self, call: Call, args: tuple, account: "_Account") -> Any:
        """The first step's call: run the graph without saving anything for its backward, its
        inputs kept; plan it at its backward, once the step's graphs are all known (`_FirstStep`)."""
        ledger = self.backend.ledger
        record = FirstCall(self, call, args, account)
        self.backend.first_calls.append(record)
        out = _FirstStep.apply(record, *args)
        outputs = _tensors(out)
        if account.dropped and self._returned_let_go(out, account.dropped):
            account.dropped = {}
        record.output_refs = [weakref.ref(o) if isinstance(o, torch.Tensor) else None for o in out]
        seen = {storage_key(t) for t in args if isinstance(t, torch.Tensor)}
        for t in outputs:  # what it returned, by storage, as `_hold_until_backward` counts it
            k = storage_key(t)
            if k not in seen:
                seen.add(k)
                account.outputs[k] = t.untyped_storage().nbytes()
                record.outputs.append(weakref.ref(t))
        # Held to its backward: its inputs no other account counts, its outputs, and the buffer copies.
        record.token = ledger.hold(call, record.kept_bytes, {**account.held, **account.outputs})
        node = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
        if node is not None:
            with contextlib.suppress(TypeError):
                weakref.finalize(node, ledger.release, record.token)
        return list(out) if record.returns_list else out

    def plan_call(self, allowance: int, limit: int | None, args: tuple) -> tuple[OptimizedModule | None, int]:
        """The module for a call given ``allowance`` and carry ``limit``, and how many bytes its
        plan is over the allowance (0 where it fits): planned for both; where the limit asks more
        than the graph can give, for the least carry that fits (the limit raised by what the
        smallest plan under it was over); else for the allowance alone; else its smallest plan."""
        module = self._planned(allowance, limit, args)
        if module is None and limit is not None:
            excess = self._failed_by(args, allowance, limit)
            # The smallest budget found for the limit overstates the carry it lacks (the search is a
            # heuristic): a quarter and a half of it first, or the graph carries more than it must.
            for more in (excess // 4, excess // 2, excess) if excess else ():
                module = self._planned(allowance, limit + more, args) if more else None
                if module is not None:
                    break
            if module is None:  # no limit that fits: keep what this graph needs
                module = self._planned(allowance, None, args)
        if module is not None:
            return module, 0
        least = self.min_budget.get(_shape_key(args), allowance)
        return self._planned(least, None, args, exact=True), max(1, least - allowance)

    def _failed_by(self, args: tuple, budget: int, limit: int | None) -> int | None:
        """How many bytes the smallest plan found for ``args`` at ``budget`` and ``limit`` was over it."""
        shape, budget = _shape_key(args), max(budget, 1)
        failures = [(b, least) for (s, b, l), least in self.failed.items() if s == shape and l == limit and b >= budget]
        return min(failures)[1] - min(failures)[0] if failures else None

    def _module_at_backward(self, record: "FirstCall", tangent_bytes: int) -> OptimizedModule | None:
        """The module that runs ``record``'s call whole at its backward in the first step: the one
        the rehearsal planned for the next steps where it fits what the ledger leaves it now (the
        output gradients held through its forward), else one planned for that; None where the
        graph cannot be planned (it runs as dynamo made it)."""
        ledger = self.backend.ledger
        # its own holdings: what it keeps for this backward, and those of its outputs still alive
        own = record.kept_bytes + sum({storage_key(t): t.untyped_storage().nbytes()
                                       for t in (ref() for ref in record.outputs) if t is not None}.values())
        allowance = self.last_allowance = ledger.backward_allowance(record.call, record.token) - own
        args = record.args
        if self.unplanned:
            return None

        def fits(module: OptimizedModule | None) -> bool:
            return module is not None and _peak_holding(module.prepare(*args), tangent_bytes) <= allowance

        if fits(record.module):
            return record.module
        try:  # the output gradients held through the plan's forward too: a plan for that much less
            module = self._planned(allowance - tangent_bytes, None, args)
            if module is None:
                least = self.min_budget.get(_shape_key(args), allowance)
                module = self._planned(least, None, args, exact=True)
                if module is None:
                    raise InfeasibleBudgetError(self.backend.budget, least + self.backend.budget - allowance)
                if not fits(module):
                    self.backend.warn_over(self.index, _peak_holding(module.plan, tangent_bytes) - allowance)
        except CaptureError as exc:
            self.mark_unplanned(exc)
            return None
        return module

    @property
    def latest_plan(self) -> Plan | None:
        """The plan of the module used last (every module kept in :attr:`levels` has one); None
        before the graph was planned."""
        return next(reversed(self.levels.values())).plan if self.levels else None

    def _run_unplanned(self, exc: CaptureError, args: tuple) -> Any:
        """This graph cannot be planned: from now on it runs as dynamo handed it over (its memory
        outside every plan, said once unless there is simply no backward through it)."""
        self.mark_unplanned(exc)
        return self.stateful(*args)

    def mark_unplanned(self, exc: CaptureError, stacklevel: int = 4) -> None:
        self.unplanned = True
        if not isinstance(exc, NothingToDifferentiate):
            warnings.warn(f"memplan backend: graph {self.index} runs unplanned, outside the budget: {exc}",
                          UserWarning, stacklevel=stacklevel)

    def _planned(self, budget: int, limit: int | None, args: tuple, exact: bool = False) -> OptimizedModule | None:
        """A module with a plan for ``args`` at a budget at most ``budget`` (within ``TUNABLES.reuse_slack`` of
        it, or ``exact``) carrying at most ``limit``; None where no plan fits (remembered per input
        shape, with the smallest plan's peak in :attr:`min_budget`)."""
        budget = max(budget, 1)  # nothing left: a 1-byte attempt still finds the smallest plan
        shape = _shape_key(args)
        if any(s == shape and l == limit and b >= budget for s, b, l in self.failed):
            return None
        key = next(((b, l) for (b, l) in self.levels
                    if l == limit and (b == budget or (not exact and (1 - TUNABLES.reuse_slack) * budget <= b <= budget))),
                   (budget, limit))
        module = self.levels.get(key)
        if module is not None and (key, shape) in self.prepared:
            self.levels.move_to_end(key)
            return module
        if module is None:
            module = OptimizedModule(self.stateful, budget, self.backend.plan_options, carry_limit=limit)
            module.declared_use = OutputUse(inputs_dropped=self.inputs_dropped or frozenset())
            # A graph's outputs get their gradients from the graphs after it, by design: no loss to move inside.
            module.warn_loss_outside = False
            if self.backend.sharding is not None:
                module._warned_distributed = True  # FSDP2's tensors are in the ledger (`memplan.frontend.sharded`)
            self.levels[key] = module
            while len(self.levels) > TUNABLES.max_levels:
                dropped, _ = self.levels.popitem(last=False)
                self.prepared = {(k, sh) for k, sh in self.prepared if k != dropped}
        try:
            module.prepare(*args)
        except CaptureError:
            self.levels.pop(key, None)
            raise
        except InfeasibleBudgetError as exc:
            self.failed[(shape, *key)] = exc.min_budget
            self.levels.pop(key, None)
            if limit is None:
                self.min_budget[shape] = max(self.min_budget.get(shape, 0), exc.min_budget)
            return None
        self.levels.move_to_end(key)
        self.prepared.add((key, shape))
        return module

    def _hold_until_backward(self, call: Call, plan: Plan, inputs: list[torch.Tensor], out: Any,
                             held: dict[int, int]) -> None:
        """Open this call's carried account in the ledger; close it when the backward reaches
        the graph's inputs, or when its autograd graph is dropped without a backward. ``held``:
        its inputs that no other account counts (made by eager code), which the plan holds as
        its sources (`Plan.carried_bytes` leaves them out) and the other graphs must count."""
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
        token = ledger.hold(call, max(0, plan.carried_bytes - sum(returned.values())), {**held, **returned})
        handle: list[Any] = []

        def release(*_grads: Any) -> None:
            ledger.release(token)
            while handle:
                handle.pop().remove()

        step, nodes = _step_node(outputs)
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


def _step_node(outputs: list[torch.Tensor]) -> tuple[Any, list]:
    """The planned step's own autograd node among ``outputs``' (None where none is: a graph run
    unplanned), and every output's node. Its hooks run once the plan's whole backward has returned."""
    nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
    return next((n for n in nodes if getattr(n, "_forward_cls", None) is PlannedStep), None), nodes


class _Account:
    """What one call holds in the step's ledger, by storage (key -> bytes), kept from the first
    step so that its rehearsal of the next steps opens the same accounts."""

    def __init__(self, resident: dict, final: dict, step_inputs: dict, inputs: dict, held: dict, eager_saved: dict,
                 unit: int | None = None, dropped: dict | None = None, after_blocks: bool = False):
        self.resident = resident  # parameters and buffers
        self.final = final  # the gradients its backward makes
        self.step_inputs = step_inputs  # the step's own inputs (the first call only)
        self.inputs = frozenset(resident) | frozenset(inputs)  # every storage it reads
        self.held = held  # inputs no other account counts, held to its backward
        self.eager_saved = eager_saved  # what eager code before it saved for its backward
        self.outputs: dict[int, int] = {}  # what it returned
        self.unit = unit  # FSDP2's block it is the forward of (what FSDP2 holds outside it: `MemplanBackend.outside`)
        # inputs its caller lets go when it returns: held to its backward in the first step (which
        # keeps its inputs), in the next steps by its plan where the backward reads them
        self.dropped = dropped or {}
        self.after_blocks = after_blocks  # a root call of FSDP2 after its last block (`MemplanBackend.outside`)

    @property
    def held_next(self) -> dict:
        """What it holds to its backward from the second step on: ``held`` but the inputs let go."""
        return {k: b for k, b in self.held.items() if k not in self.dropped}


class FirstCall:
    """One call of a graph in the first step: what `_FirstStep` needs at its backward, and what
    the rehearsal of the next steps needs of it."""

    def __init__(self, graph: PlannedGraph, call: Call, args: tuple, account: _Account):
        self.graph = graph
        self.call = call
        self.args: tuple | None = args  # the inputs, held to its backward (as a checkpoint holds them)
        self.account = account
        self.token: int | None = None
        self.module: OptimizedModule | None = None  # planned by the rehearsal for the next steps
        self.returns_list = False
        self.outputs: list[weakref.ref] = []  # what it returned (new storages): alive at its backward or not
        self.output_refs: list[weakref.ref | None] = []  # each output, by position
        self.let_go_versions: dict[int, int] = {}  # position -> version of an input its caller let go
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.rng = _rng_states(tensors)
        # a graph that updates buffers in place (BatchNorm's statistics) runs twice: the second
        # run reads and updates copies of the values the first run read
        self.buffers = {name: b.clone() for name, b in graph.stateful._buffers.items() if b is not None}
        self.kept_bytes = sum(b.untyped_storage().nbytes() for b in self.buffers.values())  # on the device


class _FirstStep(torch.autograd.Function):
    """A graph's call in the first step: the forward runs the graph as dynamo made it, saving
    nothing for the backward but its inputs (as ``torch.utils.checkpoint`` does); the backward
    plans the graph, now that the step's graphs are all known, and runs its plan whole.

    The backward replays the forward's random draws (the generator states are restored) and
    hands buffers the graph updates in place their values from before the forward, in copies,
    so that they are updated once, as in eager mode."""

    @staticmethod
    def forward(ctx, record: FirstCall, *args: Any):
        ctx.record = record
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        versions = [t._version for t in tensors]
        out = record.graph.stateful(*args)
        if [t._version for t in tensors] != versions:  # `_changes_inputs` missed an in-place op on an input
            raise RuntimeError(f"memplan backend: graph {record.graph.index} changed one of its inputs in place, "
                               "which its first step cannot run again from its inputs at its backward")
        # changed in place later, before the backward reads them: caught there (inputs the caller lets
        # go are held by `FirstCall.args` alone, which the backward lets go after its replayed forward)
        ctx.save_for_backward(*(t for t in tensors if storage_key(t) not in record.account.dropped))
        record.let_go_versions = {i: a._version for i, a in enumerate(args)
                                  if isinstance(a, torch.Tensor) and storage_key(a) in record.account.dropped}
        record.returns_list = isinstance(out, list)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        ctx.mark_non_differentiable(*(o for o in outs if isinstance(o, torch.Tensor)
                                      and not (o.is_floating_point() or o.is_complex())))
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        record: FirstCall = ctx.record
        graph, backend = record.graph, record.graph.backend
        ctx.saved_tensors  # noqa: B018 (raises where an input was changed in place since the forward)
        args = record.args
        if any(args[i]._version != v for i, v in record.let_go_versions.items()):
            raise RuntimeError(f"memplan backend: an input of graph {graph.index} was changed in place after its "
                               "forward, which its first step's backward reads again")
        needs = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        given = [g for g in grads if g is not None]
        try:
            if not given:
                return (None, *(None for _ in args))
            with torch.enable_grad():
                backend.rehearse()
                module = graph._module_at_backward(record, sum(g.untyped_storage().nbytes() for g in given))
                # An input the caller let go is held here through the replayed forward only, as its plan
                # holds it in the next steps: its gradient is caught on its way (`_LetGo`), not by a
                # leaf that autograd would keep to the end.
                caught: dict[int, torch.Tensor] = {}
                anchors = {i: torch.empty(0, device=a.device, requires_grad=True) for i, a in enumerate(args)
                           if needs[i] and storage_key(a) in record.account.dropped}
                leaves = [_LetGo.apply(anchors[i], a.detach(), caught, i) if i in anchors
                          else a.detach().requires_grad_() if need else a for i, (a, need) in enumerate(zip(args, needs))]
                wrt = [anchors.get(i, leaf) for i, (leaf, need) in enumerate(zip(leaves, needs)) if need]
                record.args = args = None
                saved_buffers = dict(graph.stateful._buffers)
                graph.stateful._buffers.update(record.buffers)
                try:
                    with _replayed_rng(record.rng):
                        out = module(*leaves) if module is not None else graph.stateful(*leaves)
                finally:
                    graph.stateful._buffers.update(saved_buffers)
                del leaves
                outs = out if isinstance(out, (tuple, list)) else (out,)
                pairs = [(o, g) for o, g in zip(outs, grads)
                         if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
                # the outputs the caller still holds are held through the plan's backward, as they are
                # in a later step: the plan learns how the step uses its outputs from this backward too
                held = [o for o, ref in zip(outs, record.output_refs) if ref is not None and ref() is not None]
                del out, outs
                got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                           if pairs else [None] * len(wrt))
                del pairs, held, wrt
            grads_out = [next(got) if need else None for need in needs]
            return (None, *(caught.pop(i, None) if i in anchors else g for i, g in enumerate(grads_out)))
        finally:
            record.args = None
            backend.ledger.release(record.token)


class _LetGo(torch.autograd.Function):
    """``x`` as a view, differentiable through ``anchor`` (an empty leaf), its gradient put in
    ``caught[i]``: the first step's replay of an input its caller let go, which no leaf holds
    (autograd keeps a leaf it differentiates to the end; this node keeps nothing)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, x: torch.Tensor, caught: dict, i: int):
        ctx.caught, ctx.i = caught, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            ctx.caught[ctx.i] = grad
        return None, None, None, None


def _peak_holding(plan: Plan, extra: int) -> int:
    """The peak of ``plan`` run while ``extra`` bytes (its output gradients) are held from its start,
    not from its backward on: the first step runs a graph's plan whole inside its backward."""
    steps = list(plan.schedule)
    cut = next((k for k, (op, node) in enumerate(steps) if op == "compute" and node == BACKWARD), 0)
    before = int(plan.simulated.timeline[:cut].max()) if cut else plan.simulated.initial
    return max(plan.predicted_peak, before + extra)


def _rng_states(tensors: list[torch.Tensor]) -> tuple[list[torch.device], list[bytes]]:
    """The generator states a replay of a forward on ``tensors`` restores: the CPU generator's and
    each CUDA device's the tensors are on (as ``torch.utils.checkpoint`` saves them), as Python
    bytes: a state tensor held to the backward would be CPU memory in the step (5 kB a graph)."""
    devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    return [torch.device("cpu"), *devices], [_rng_state(d) for d in [torch.device("cpu"), *devices]]


def _rng_state(device: torch.device) -> bytes:
    return generator_state(device)[0]().numpy().tobytes()


def _set_rng_state(device: torch.device, state: bytes) -> None:
    # the bytes' own memory, not the allocator's
    generator_state(device)[1](torch.frombuffer(bytearray(state), dtype=torch.uint8))


@contextlib.contextmanager
def _replayed_rng(saved: tuple[list[torch.device], list[bytes]]):
    """Run with the generators as they were at ``saved``; put them back as they are now after."""
    devices, states = saved
    now = [_rng_state(d) for d in devices]
    for d, state in zip(devices, states):
        _set_rng_state(d, state)
    try:
        yield
    finally:
        for d, state in zip(devices, now):
            _set_rng_state(d, state)


# Methods and functions whose result may share its first argument's memory (views), through which
# an in-place op on the result changes a graph input.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "expand", "expand_as", "squeeze",
    "unsqueeze", "narrow", "select", "flatten", "unflatten", "as_strided", "diagonal", "unbind", "split", "chunk",
    "contiguous", "detach", "__getitem__", "movedim", "swapaxes", "swapdims", "unfold", "real", "imag",
    "type_as", "to", "float", "half", "double", "bfloat16",
})
_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.transpose, torch.t, torch.permute, torch.squeeze, torch.unsqueeze,
    torch.narrow, torch.select, torch.flatten, torch.unflatten, torch.as_strided, torch.diagonal, torch.unbind,
    torch.split, torch.chunk, torch.movedim, torch.swapaxes, torch.detach, getattr,
})


def _changes_inputs(gm: fx.GraphModule, buffers: frozenset[int]) -> bool:
    """Whether the graph changes one of its inputs (other than the module buffers at ``buffers``,
    which `_GraphWithBuffers` hands over) in place: an in-place op (``add_``, ``x[i] = v``,
    ``+=``, ``inplace=True``, ``out=``) on an input or on a view of one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    aliases = {n for i, n in enumerate(placeholders) if i not in buffers}
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        first = node.args[0]
        if node.op == "call_method":
            name, view = node.target, node.target in _VIEW_METHODS
        else:
            name, view = getattr(node.target, "__name__", ""), node.target in _VIEW_FUNCTIONS
        in_place = ((name.endswith("_") and not name.endswith("__")) or node.target in _IN_PLACE_OPERATORS
                    or node.kwargs.get("inplace") is True or "out" in node.kwargs)
        if first in aliases and in_place:
            return True
        if first in aliases and view:
            aliases.add(node)
    return False


_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
})


def _graph_break_site() -> str | None:
    """Where dynamo broke the frame it is compiling a graph from (``file:line `code```, and why),
    read while the backend is called; None when the graph ends with the frame's return, or where
    dynamo does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        reason = InstructionTranslator.current_tx().output.compile_subgraph_reason
    except Exception:  # not called by dynamo (a test calling the backend itself), or dynamo changed
        return None
    if reason is None or not getattr(reason, "graph_break", False) or not reason.user_stack:
        return None
    frame = reason.user_stack[-1]
    why = reason.reason.strip().splitlines()[0] if reason.reason else ""
    why = "a branch on a tensor's value" if why.startswith("generic_jump") else why
    code = (frame.line or "").strip()
    return f"{os.path.basename(frame.filename)}:{frame.lineno} `{code}`" + (f" ({why})" if why else "")


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


def _saved_by_eager_autograd(inputs: list[torch.Tensor], leaves: list | None = None) -> dict[int, int]:
    """Storages (key -> bytes) that eager autograd saved for backward between the planned graphs
    and these inputs: the ``_saved_*`` tensors of every autograd node reached back from the inputs,
    stopping at planned steps (their memory is in their plans) and at leaves (appended to
    ``leaves`` where given: the parameters that code's backward makes gradients for).

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
        if type(node).__name__ == "AccumulateGrad":
            if leaves is not None:
                leaves.append(node.variable)
            continue
        if isinstance(node, (PlannedStep._backward_cls, _FirstStep._backward_cls)):
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


def tail_bytes_of(outputs: Any, held: Any = (), leaves: list | None = None) -> int:
    """What the eager code that made ``outputs`` (tensors in any nesting) after the last planned graph
    (a loss head) holds at the height of its backward: the outputs themselves, what it saved for its
    backward (`_saved_by_eager_autograd`), and two gradients as large as the largest of those in
    flight (the one a node receives and the one it makes). Storages whose keys are in ``held`` (held
    all step, counted elsewhere: the root's gathered weights, the graphs' outputs) are left out. The
    parameters it makes gradients for are appended to ``leaves`` where given."""
    tensors = _tensors(outputs)
    saved = {k: b for k, b in _saved_by_eager_autograd(tensors, leaves).items() if k not in held}
    own = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    own = {k: b for k, b in own.items() if k not in held and k not in saved}
    return sum(saved.values()) + sum(own.values()) + 2 * max([*saved.values(), *own.values()], default=0)


def _shape_key(args: tuple) -> tuple:
    """What a plan depends on in a graph's arguments: each tensor's shape and dtype, other values as they are."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
