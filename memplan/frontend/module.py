"""The public entry point: ``memplan.optimize(model, budget)`` -> :class:`OptimizedModule`.

Like ``torch.compile`` it plans lazily, on the first call (or at once when
``example_inputs`` is given), and caches one plan per input signature.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _disable_current_modes

from memplan.capture.signature import DataDependentPython, InputSignature
from memplan.runtime.inductor.compiler import inductor_compiler
from memplan.runtime.inductor.reports import CompileReport
from memplan.runtime.inductor.segments import compile_program
from memplan.planning.analysis import replay_eager_peak
from memplan.costs.cost_model import get_profile
from memplan.updates.master_weights import use_master_weights
from memplan.frontend.paged import (keep_parameters_on_device, materialize, paging_refusal, put_paged_on_host,
                                    put_parameters_on_host)
from memplan.frontend.distributed import (DataParallel, bucket_buffer_bytes, process_group_size,
                                         refuse_distributed_updates, refuse_engines_inside,
                                         warn_unplanned_engine_memory)
from memplan.core.host import is_host
from memplan.core.storage import storages_of
from memplan.frontend.budget import budget_fraction, parse_budget, share_of_peak
from memplan.core.units import parse_bytes
from memplan.measure.tracker import unmeasured
from memplan.updates.probe import check_optimizer
from memplan.updates.runner import Accumulation
from memplan.updates.host_memory import HostMemoryError
from memplan.passes.output_use import OutputUse, inputs_dropped_after_call
from memplan.pipeline.options import PlanOptions, StepOptions
from memplan.pipeline.plan import InfeasibleBudgetError, Plan, make_plan
from memplan.pipeline.saved import PlanMismatchError, as_saved, make_plan_from_saved
from memplan.measure.timing import measure_host_bandwidth
from memplan.runtime.program import Program, run_program
from memplan.core.units import format_bytes
from memplan.core.config import TUNABLES

def held_gradient_bytes(params: Iterable[nn.Parameter]) -> int:
    """Bytes of the gradients the trainable ``params`` already hold (each storage once).

    Between ``zero_grad()`` calls (gradient accumulation, ``set_to_none=False``)
    they stay on the device for the whole next step, and autograd adds the new
    gradients into them only when each is complete, so both are held at once.
    """
    storages: dict[tuple[str, int], int] = {}
    for p in params:
        g = p.grad
        if p.requires_grad and g is not None:
            # a sparse gradient (nn.Embedding(sparse=True)) is held in its indices and values
            for i, st in enumerate(storages_of(g, allow_fake=True)):
                key = (str(g.device), st.data_ptr() or (id(g), i))  # meta tensors have no address
                storages[key] = st.nbytes()
    return sum(storages.values())


def refuse_meta_parameters(params: dict[str, torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Raise where a step with real inputs would run on parameters left on the meta device (a model
    built under ``torch.device("meta")``, which has shapes but no storage): planning works on them
    (with meta inputs too), training cannot."""
    if not inputs or any(x.is_meta for x in inputs):
        return  # (a plan only)
    meta = [name for name, p in params.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"memplan: {len(meta)} of the model's {len(params)} parameters are on the meta device (built without "
            f"storage; the first: {meta[0]!r}) and the step's inputs are not: materialize them before training "
            "(model.to_empty(device=...) and then initialize them or load a state_dict with load_state_dict(...)); "
            "a plan alone can be made on meta parameters with meta inputs (memplan report, optimize(example_inputs=...))")


class GraphBreakWarning(UserWarning):
    """``optimize`` could not trace the model as one graph and runs it split at its graph breaks."""


class LossOutsideWarning(UserWarning):
    """The loss is computed outside the optimized module, from outputs large enough that its
    memory (not in the plan) can take the step over the budget."""


class OptimizedModule(nn.Module):
    """An ``nn.Module`` that trains like ``model`` under a device-memory budget.

    It shares the original module's parameters, buffers and submodules (same
    names, same ``state_dict``), so optimizers, ``.to()``, ``.train()`` and
    checkpoints work as they do on the original. ``copy.deepcopy`` and
    ``torch.save`` of the whole module carry no cached plans: the copy plans
    again on its first call (from ``plan=``'s saved plan where one was given).
    """

    def __init__(
        self,
        model: nn.Module,
        budget: int | str | None,
        options: PlanOptions = PlanOptions(),
        step: StepOptions = StepOptions(),
        *,
        plan: Any = None,
        graph_breaks: Callable[[], Any] | None = None,
        carry_limit: int | None = None,
        data_parallel: DataParallel | None = None,
    ):
        super().__init__()
        # data_parallel: the DistributedDataParallel this module runs inside (`memplan.frontend.distributed`):
        # its buckets are in the budget, gradients go to it as backward makes them, and the updates
        # (after backward: each needs its gradient reduced) step with the gradients it reduced.
        self.data_parallel = data_parallel
        if data_parallel is not None and step.optimizer is not None:
            step = dataclasses.replace(step, updates_after_backward=True)
        self.plan_options = options
        self.step_options = step
        # graph_breaks=factory: where the forward's Python reads tensor values, the model runs as
        # factory() returns it (torch.compile with memplan's backend: `memplan.frontend.entry.optimize`).
        self.split_factory = graph_breaks
        self.split: Any = None  # (the compiled model, its backend) once the model runs split
        # plan=path (or a SavedPlan / Plan): reuse that schedule instead of solving.
        self.saved_plan = as_saved(plan) if plan is not None else None
        # carry_limit=bytes: the plan carries at most this much from its forward (the backend's ledger)
        self.carry_limit = carry_limit
        # The whole step (`StepOptions`): the optimizer's updates in backward, its state in the budget.
        self.optimizer = step.optimizer  # (the other step options are read from step_options)
        self.accumulation = Accumulation(step.accumulate_steps)
        if self.optimizer is not None:
            check_optimizer(self.optimizer, model)
            if data_parallel is None:
                refuse_distributed_updates(model)
        refuse_engines_inside(model)
        if step.parameters == "host":
            # Paged parameters are updated on the host, with their state there; a model that breaks
            # into graphs is refused at capture (its graphs would not page).
            put_parameters_on_host(model, distributed=data_parallel is not None, compile=options.compile,
                                   saved_plan=self.saved_plan)
            step = self.step_options = dataclasses.replace(step, optimizer_state="host")
            self.split_factory = None
        else:
            keep_parameters_on_device(model)
        # parameters="auto" pages where paging is built, and a plan that needs it says which (`_plan_graph`).
        self.pages_as_needed = (step.may_page_as_needed
                                and paging_refusal(model, distributed=data_parallel is not None,
                                                   compile=options.compile, saved_plan=self.saved_plan) is None)
        if step.optimizer is not None:  # (masters for the parameters a plan pages: none where none can be)
            use_master_weights(step.optimizer, step.master_weights
                               and (step.parameters == "host" or self.pages_as_needed))
        if budget is None and self.saved_plan is not None:
            budget = self.saved_plan.budget
        object.__setattr__(self, "_orig_mod", model)
        # Share the original's state so names and state_dict are unchanged.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        # budget="50%": that share of each input signature's eager peak (replayed on fake tensors),
        # resolved when the signature is planned; `budget` is then the last one resolved.
        self.budget_fraction = budget_fraction(budget)
        self.budget = None if self.budget_fraction is not None else parse_budget(budget)
        self.solver = options.solver
        self.time_limit = options.time_limit
        self.device_profile = options.device_profile
        self._plans: dict[InputSignature, tuple[Plan, Program, list[str], list[str]]] = {}
        self._last_signature: InputSignature | None = None
        # Per input signature: how the last backward used the outputs (memplan.passes.output_use:
        # gradients the loss never sent, outputs the caller had dropped), which the next plan
        # assumes; or None once a step broke such an assumption: the use varies, and these
        # inputs keep the plan that assumes nothing.
        self._output_use: dict[InputSignature, OutputUse | None] = {}
        # What the caller declares about the step's inputs (`OutputUse.inputs_dropped`), under every
        # assumption learned about the outputs: a backend graph whose caller lets an input go sets it.
        self.declared_use = OutputUse()
        # Whether a loss computed outside this module is worth a warning (once); a graph of the backend
        # gets its gradients from the graphs after it by design, and turns it off.
        self.warn_loss_outside = True
        self._warned_hooks = False
        self._warned_distributed = False
        # Called once, at the first step, before its plan is made (``(args, kwargs, held)``): under DDP,
        # `memplan.frontend.entry.share_first_plan_at_first_step` makes that plan once for every rank.
        self.first_step: Callable[[tuple, dict, int], None] | None = None
        self.training = model.training

    # -- copying and pickling -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The module's state without its cached plans, for ``copy.deepcopy`` and pickling.

        A cached plan holds the capture's fake tensors and fx graphs (deep-copying
        those corrupts the heap; pickling them fails on pybind functions) and its
        generated code reads the original model's non-parameter tensors as graph
        constants, so a copy that shared it would not be independent. Plans are a
        pure function of the model and the input signature, so the copy or the
        loaded module plans again on its first call per signature; ``saved_plan``
        (from ``plan=``) is plain data and is kept, so that re-planning reuses it
        instead of solving.
        """
        state = self.__dict__.copy()
        state["_plans"] = {}
        state["_last_signature"] = None
        state["split"] = None  # a compiled model is not copied: the copy splits again on its first call
        state["first_step"] = None  # (it holds the process group)
        return state

    # -- state shared with the original module -------------------------------
    def train(self, mode: bool = True) -> "OptimizedModule":
        self._orig_mod.train(mode)
        self.training = mode
        return self

    @property
    def plan(self) -> Plan:
        """The plan of the most recent input signature."""
        if self.split is not None:
            raise RuntimeError("this model runs split at its graph breaks, a plan per graph: see "
                               ".split[1].report() and .split[1].plans")
        if self._last_signature is None:
            raise RuntimeError("no plan yet: call the module once, or pass example_inputs to memplan.optimize")
        return self._plans[self._last_signature][0]

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """L2 norm of the gradients the optimizer applied in the last step (``optimize(..., optimizer=opt,
        grad_norm=True)``; None otherwise, or before the first step)."""
        if self._last_signature is None:
            return None
        updater = self._plans[self._last_signature][1].updater
        return updater.grad_norm if updater is not None else None

    @property
    def compile_report(self) -> CompileReport | None:
        """What ``compile=True`` compiled for the last step's plan (None without compile=True)."""
        if self._last_signature is None:
            return None
        return self._plans[self._last_signature][1].compile_report

    @property
    def plans(self) -> dict[InputSignature, Plan]:
        return {sig: entry[0] for sig, entry in self._plans.items()}

    def input_signature(self, args: tuple, kwargs: dict, held: int = 0) -> InputSignature:
        """What a plan for these inputs depends on (``held``: bytes of gradients the step starts with)."""
        return InputSignature.of(args, kwargs, self._orig_mod.training, held)

    def bind(self, saved: Any, *args: Any, **kwargs: Any) -> None:
        """Make ``saved`` (a `SavedPlan` made elsewhere for these inputs: another rank's) the plan for
        them, as if planned here (no solve), and the output use it assumes the one these inputs expect
        (a plan that falls back to assuming outputs get no gradient assumes another than declared)."""
        before, self.saved_plan = self.saved_plan, saved
        try:
            self.prepare(*args, **kwargs)
        finally:
            self.saved_plan = before
        if before is None and saved.output_use != self.declared_use:
            self._output_use[self.input_signature(args, kwargs)] = saved.output_use

    def materialize(self, state_dict: Any, device: torch.device | str = "cpu") -> list[str]:
        """Give the model's parameters and buffers left on the meta device storage where the plan
        keeps them (host memory for those it pages, `paged_parameters`, else ``device``), filled from
        ``state_dict`` (a mapping, or a safetensors or ``torch.save`` file) one tensor at a time,
        the parameters kept as the same objects (`memplan.frontend.paged.materialize`)."""
        return materialize(self._orig_mod, state_dict, paged=self.paged_parameters, device=device)

    @property
    def paged_parameters(self) -> frozenset[str]:
        """Names of the parameters that live in host memory between their uses: every one with
        ``parameters="host"``; with "auto", those the plans made so far page."""
        if self.step_options.parameters == "host":
            return frozenset(name for name, _ in self._orig_mod.named_parameters())
        return frozenset(name for plan in self.plans.values() for name in plan.paged_parameters)

    def prepare(self, *args: Any, **kwargs: Any) -> Plan | None:
        """Plan for these inputs now (without running a step), for a step that starts without
        gradients (after ``zero_grad()``), whatever ``.grad`` holds at this moment: a step that
        starts with gradients held gets its own plan on its first call. None where the model
        runs split at graph breaks (its graphs are planned as they run)."""
        if self.split is not None:
            return None
        refuse_meta_parameters(dict(self._orig_mod.named_parameters()),
                               [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)])
        try:
            self._entry(args, kwargs, 0)
        except DataDependentPython as exc:
            self._split_at_graph_breaks(exc)
            return None
        return self.plan

    def _split_at_graph_breaks(self, exc: DataDependentPython) -> None:
        """The model's Python reads tensor values: run it through ``torch.compile`` with memplan's
        backend, which splits it there and plans each graph (the step's budget shared), where that
        keeps what this module promises; else re-raise."""
        if self.split_factory is None:
            raise exc
        blocked = [name for name, on in (("optimizer=", self.optimizer is not None),
                                         ("plan=", self.saved_plan is not None),
                                         ("a budget relative to the eager peak", self.budget_fraction is not None))
                   if on]
        if blocked:
            raise DataDependentPython(
                f"{exc}. memplan can split such a model at its graph breaks (torch.compile with memplan's backend), "
                f"but not with {', '.join(blocked)}, which need the step as one graph") from exc
        warnings.warn(
            f"memplan: {exc.args[0].split(';')[0]}. One graph cannot follow this model's Python: it now runs "
            "through torch.compile with memplan's backend, split where the Python reads tensor values, each "
            "graph planned, the step's budget shared (memplan.backend).",
            GraphBreakWarning,
            stacklevel=4,
        )
        self.split = self.split_factory()

    def _entry(self, args: tuple, kwargs: dict, held: int) -> tuple[Plan, Program, list[str], list[str]]:
        """The plan for these inputs (made now if there is none yet); it becomes :attr:`plan`."""
        sig = InputSignature.of(args, kwargs, self._orig_mod.training, held)
        if self.saved_plan is not None:  # a saved plan is used as it was made
            use = self.saved_plan.output_use
        else:
            use = self._output_use.get(sig) or self.declared_use
        key = sig.for_output_use(use)
        if key not in self._plans:
            # Planning is compile-time work, not part of the step: a MemoryTracker
            # around the first call must see neither the capture's fake tensors
            # (refusing one inside a dispatch callback aborts the process) nor
            # the planner's own real work (profiling runs, meta-model constants);
            # any other dispatch mode of the caller is set aside for the same reason.
            self._warn_hooks()
            refuse_engines_inside(self._orig_mod)  # sharded after optimize(): seen at its first plan
            if not self._warned_distributed and self.data_parallel is None:
                self._warned_distributed = warn_unplanned_engine_memory(self._orig_mod)
            # Assuming that outputs get no gradient (`_optimistic_use`) costs a step nothing, paging
            # parameters costs it the host link: where the assumption may be tried, it comes first.
            assumable = self.pages_as_needed and self._may_assume(sig, use)
            with unmeasured(), _disable_current_modes():
                try:
                    entry = self._make_entry(args, kwargs, held, use, may_page=not assumable)
                except (InfeasibleBudgetError, HostMemoryError) as exc:
                    if use.learned and self.saved_plan is None and sig.for_output_use(self.declared_use) in self._plans:
                        # The plan for how the last step used the outputs does not fit (the search
                        # found none) where the plan that assumes nothing did: keep that one.
                        self._output_use[sig] = None
                        key, entry = sig.for_output_use(self.declared_use), None
                    else:
                        optimistic = self._optimistic_use(sig, use, exc)
                        if optimistic is None and not assumable:
                            raise
                        if optimistic is not None:
                            use = optimistic
                        entry = self._make_entry(args, kwargs, held, use)  # (paging where it must)
                        if optimistic is not None:
                            self._output_use[sig] = use
                        key = sig.for_output_use(use)
            if entry is not None:
                if self.data_parallel is not None:
                    primals = entry[0].analysis.capture.primals
                    self.data_parallel.check_gradients([primals[i].name for i in sorted(entry[1].no_gradient)])
                entry[1].observer = _use_learner(self, sig, use, entry[0])
                self._plans[key] = entry
        self._plans[key] = self._compiled(self._plans[key])
        self._last_signature = key
        return self._plans[key]

    def _warn_hooks(self) -> None:
        """Warn once, naming them, about module hooks: a plan's step runs the captured ATen graph,
        so hooks ran while it was traced and do not run in the steps."""
        if self._warned_hooks:
            return
        self._warned_hooks = True
        hooked = [name or "(the model)" for name, m in self._orig_mod.named_modules()
                  if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]
        if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks):
            hooked.append("(global module hooks)")
        if hooked:
            warnings.warn(
                f"memplan: hooks on {', '.join(hooked[:5])}{' and more' if len(hooked) > 5 else ''} ran while the "
                "step was traced and will not run in the planned steps (the step runs the captured graph). For "
                "hooks that must run every step, compile instead: torch.compile(model, "
                "backend=memplan.backend(budget=...)) runs them as dynamo does.",
                stacklevel=4,
            )

    def _may_assume(self, sig: InputSignature, use: OutputUse) -> bool:
        """Whether a plan that does not fit may be followed by one assuming outputs get no gradient."""
        return self.saved_plan is None and not use.learned and sig not in self._output_use

    def _optimistic_use(self, sig: InputSignature, use: OutputUse,
                        infeasible: InfeasibleBudgetError | HostMemoryError) -> OutputUse | None:
        """When the plan that assumes nothing about the outputs does not fit: what to assume before
        any backward has shown how the step uses them (None: nothing to try).

        Every output whose gradient is only an addend (one the model also uses itself, like
        the logits next to the loss it computes) is assumed to get no gradient, as in
        ``out.loss.backward()``; a loss that does use one still gets exact gradients (see
        ``_learn_output_use``)."""
        if not self._may_assume(sig, use):
            return None
        candidates = infeasible.addend_only_outputs  # read off the capture that plan was made from
        return OutputUse(no_grad=candidates, inputs_dropped=use.inputs_dropped) if candidates else None

    def _learn_output_use(self, sig: InputSignature, planned: OutputUse, plan: Plan,
                          missing: frozenset[int], dropped: frozenset[int]) -> None:
        """After a backward of ``plan``, made for ``sig`` assuming ``planned``, given the outputs that got no
        gradient (``missing``) and those the caller had let go (``dropped``): what the next plan assumes.

        A new assumption is taken up only where it concerns outputs worth re-planning for: at
        least ``TUNABLES.replan_fraction`` of the plan's peak (a logits tensor, not a scalar loss)."""
        self._check_loss_inside(plan, missing)
        arrived = planned.no_grad - missing
        kept = planned.dropped - dropped
        if arrived or kept:
            broken = []
            if arrived:
                broken.append(f"output tensor(s) {sorted(arrived)} got a gradient, but this step was planned without one")
            if kept:
                broken.append(f"output tensor(s) {sorted(kept)} were still held when backward began, but this step "
                              "was planned for a caller that lets them go before")
            saved = self.saved_plan is not None
            warnings.warn(
                f"memplan: {'; '.join(broken)} "
                + ("(the saved plan was made for such a step). " if saved else "(as an earlier step did). ")
                + "The gradients are exact, but the step held more than planned (up to twice those outputs' bytes)"
                + ("; re-plan for this step." if saved else
                   "; from the next call on these inputs use the plan that assumes nothing about the outputs."),
                stacklevel=2,
            )
            self._output_use[sig] = None
            return
        if self.saved_plan is not None or (sig in self._output_use and self._output_use[sig] is None):
            return
        learned = OutputUse(no_grad=missing & plan.analysis.capture.addend_only_outputs, dropped=dropped,
                            inputs_dropped=planned.inputs_dropped)
        changed = (learned.no_grad ^ planned.no_grad) | (learned.dropped ^ planned.dropped)
        if not changed:
            return
        sizes = plan.output_bytes
        if sum(sizes[i] for i in changed) >= TUNABLES.replan_fraction * plan.predicted_peak:
            self._output_use[sig] = learned

    def _check_loss_inside(self, plan: Plan, missing: frozenset[int]) -> None:
        """Warn once when the loss is computed outside the module from outputs that hold a
        significant share of the budget (``TUNABLES.loss_outside_fraction``): the caller's graph between
        them and the loss is not in the plan. A cross-entropy over logits saves a log-softmax
        as large as the logits, so the step can exceed the budget by about the outputs' bytes."""
        if not self.warn_loss_outside:
            return
        cap = plan.analysis.capture
        sizes = plan.output_bytes
        given = [i for i, needs in enumerate(cap.user_requires_grad) if needs and i not in missing]
        outside = sum(sizes[i] for i in given)
        if outside < TUNABLES.loss_outside_fraction * plan.budget:
            return
        self.warn_loss_outside = False
        warnings.warn(
            f"memplan: backward came from outside the optimized module, through {format_bytes(outside)} of its "
            f"outputs ({outside / plan.budget:.0%} of the {format_bytes(plan.budget)} budget). What the caller "
            "computes from them (a loss over logits saves tensors as large as the logits) is not in the plan, "
            "and the step can go over the budget by about that much. Put the loss inside the plan: "
            "memplan.optimize(memplan.WithLoss(model, loss_fn), budget).",
            LossOutsideWarning,
            stacklevel=3,
        )

    def _make_entry(self, args: tuple, kwargs: dict, held: int, use: OutputUse,
                    may_page: bool = True) -> tuple[Plan, Program, list[str], list[str]]:
        """Plan the step for these inputs: solved, or bound from ``plan=``.

        ``held``: bytes of gradients already held (`held_gradient_bytes`); the graph is planned
        for what they leave of the budget, and the plan's peak counts them. ``use``: what the plan
        assumes about the outputs (``memplan.passes.output_use``). ``may_page``: with
        ``parameters="auto"``, the plan may page parameters (False: an attempt made first)."""
        started = time.perf_counter()  # time_limit bounds the whole planning call, this replay included
        budget, eager = self._budget_for(args, kwargs)
        engine = self.engine_bytes
        try:
            # the replay for the budget assumed nothing about the outputs: the plan reuses it then
            plan, program = self._plan_graph(args, kwargs, budget - held - engine, use, started=started,
                                             eager_peak=None if use else eager, may_page=may_page)
        except InfeasibleBudgetError as exc:
            if not held and not engine:
                raise
            raise InfeasibleBudgetError(budget, exc.min_budget + held + engine, held, exc.addend_only_outputs,
                                        engine_bytes=engine) from None
        except PlanMismatchError as exc:
            if not held:
                raise
            raise PlanMismatchError(
                f"{exc} ({format_bytes(held)} of the budget are taken by gradients the parameters already hold "
                "from an earlier step: call optimizer.zero_grad() before the step)"
            ) from None
        if held or engine:
            plan = dataclasses.replace(plan, budget=budget, predicted_peak=plan.predicted_peak + held + engine,
                                       held_gradient_bytes=held, engine_bytes=engine)
        cap = plan.analysis.capture
        return plan, program, cap.param_names, cap.buffer_names

    @property
    def engine_bytes(self) -> int:
        """Bytes a distributed engine holds on the device for the whole step (DDP's gradient buckets)."""
        if self.data_parallel is None:
            return 0
        return bucket_buffer_bytes(self._orig_mod.parameters())

    def _compiled(self, entry: tuple[Plan, Program, list[str], list[str]]) -> tuple[Plan, Program, list[str], list[str]]:
        """``entry`` with its program compiled (``compile=``), its plan predicting the compiled step.

        Compiling checks each compiled run's memory with ``torch.profiler`` on CPU, which cannot
        run inside another profiling session: under one (a caller measuring the step) the plan
        runs eagerly, and compiles on the first call after it."""
        plan, program, param_names, buffer_names = entry
        if not self.plan_options.compile or program.compile_report is not None or torch.autograd._profiler_enabled():
            return entry
        device = next((p.device for p in self._orig_mod.parameters()), torch.device("cpu"))
        compiler = inductor_compiler if self.plan_options.compile is True else self.plan_options.compile
        with unmeasured(), _disable_current_modes():
            program = compile_program(program, plan, device, compiler)
        report = program.compile_report
        plan = dataclasses.replace(plan, predicted_peak=report.predicted_peak,
                                   predicted_time=plan.predicted_time - report.predicted_saving)
        return plan, program, param_names, buffer_names

    def _budget_for(self, args: tuple, kwargs: dict) -> tuple[int, int | None]:
        """The budget in bytes for a step on these inputs: the given one, or its share of their eager
        peak; and that peak (None when the budget is given in bytes: nothing was replayed)."""
        if self.budget_fraction is None:
            return self.budget, None
        eager = replay_eager_peak(self._orig_mod, args, kwargs)
        self.budget = share_of_peak(self.budget_fraction, eager)
        return self.budget, eager

    def _plan_graph(self, args: tuple, kwargs: dict, budget: int, use: OutputUse, *, started: float | None = None,
                    eager_peak: int | None = None, may_page: bool = True) -> tuple[Plan, Program]:
        """The plan and program of the step's graph under ``budget`` (`make_plan`'s ``started`` and ``eager_peak``;
        ``may_page``: `_make_entry`'s)."""
        # (a parameter an earlier plan paged is in host memory: every plan pages it from then on)
        pages = self.pages_as_needed and (may_page or any(is_host(p) for p in self._orig_mod.parameters()))
        model = self._orig_mod
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        profile = get_profile(self.device_profile, device)
        measure_on = device if self.plan_options.profile else None
        if measure_on is not None:  # the host link is measured too, not taken from the table
            profile = dataclasses.replace(profile, host_bandwidth=measure_host_bandwidth(measure_on))
        # kernel_scratch: measure what the kernels that allocate for themselves take (cuDNN's
        # workspaces, oneDNN's reorders, softmax and dropout buffers) and plan room for it. On by
        # default where the measurement that checks the budget sees it: CUDA's allocator, and on
        # the CPU a compiled plan's allocator events (`profiled_peak`; the dispatch-mode tracker
        # of eager steps does not see it).
        scratch = self.plan_options.kernel_scratch
        witnessed = device.type == "cuda" or bool(self.plan_options.compile)
        scratch_on = device if (witnessed if scratch is None else bool(scratch)) else None
        # Offloading pays off where a host link runs beside compute: on by default on CUDA.
        offload = self.plan_options.offload
        offload = device.type == "cuda" if offload is None else bool(offload)
        # Under DDP a gradient handed out stays on the device as .grad: paging it would save nothing.
        offload = offload and self.data_parallel is None
        if self.saved_plan is not None:
            return make_plan_from_saved(self.saved_plan, model, args, kwargs, budget, profile=profile,
                                        measure_on=measure_on, scratch_on=device, optimizer=self.optimizer,
                                        grad_norm=self.step_options.grad_norm, max_grad_norm=self.step_options.max_grad_norm,
                                        accumulation=self.accumulation, handout_bytes=self._handout_bytes)
        plan, program = make_plan(
            model,
            args,
            kwargs,
            budget,
            solver=self.solver,
            time_limit=self.time_limit,
            profile=profile,
            measure_on=measure_on,
            scratch_on=scratch_on,
            offload=offload,
            output_use=use,
            optimizer=self.optimizer,
            grad_norm=self.step_options.grad_norm,
            updates_after_backward=self.step_options.updates_after_backward,
            max_grad_norm=self.step_options.max_grad_norm,
            optimizer_state=self.step_options.optimizer_state,
            parameters="auto" if pages else "host" if self.step_options.parameters == "host" else "device",
            # (an attempt that paging may follow says how far over it is, and searches no minimum)
            search_minimum=pages or not self.pages_as_needed,
            accumulation=self.accumulation,
            clip_by=self.step_options.clip_by,
            carry_limit=self.carry_limit,
            started=started,
            eager_peak=eager_peak,
            handout_bytes=self._handout_bytes,
            host_memory=None if self.plan_options.host_memory is None else parse_bytes(self.plan_options.host_memory),
        )
        if pages and put_paged_on_host(model, plan.paged_parameters):
            # Parameters now in host memory that an earlier plan (other inputs) reads on the device:
            # it is made again, paging them too, when those inputs come back.
            marked = self.paged_parameters | plan.paged_parameters
            self._plans = {sig: entry for sig, entry in self._plans.items() if marked <= entry[0].paged_parameters}
        return plan, program

    @property
    def _handout_bytes(self) -> int | None:
        """Gradients go to the distributed engine in groups of this many bytes (None: returned at backward's end)."""
        return None if self.data_parallel is None else self.data_parallel.bucket_bytes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._orig_mod
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        # One walk of the module tree a step: on a small step each walk is a visible share of it.
        params = dict(model.named_parameters())
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in [*params.values(), *inputs]):
            # Inference: nothing is saved for backward, there is nothing to plan. (A graph whose
            # parameters arrive as inputs, as torch.compile hands them over, is planned.)
            return model(*args, **kwargs)
        # With accumulation, the gradients .grad holds between micro-steps are the plan's own (its
        # accumulation buffers), not an earlier step's to plan around.
        own = self.optimizer is not None and self.accumulation.steps > 1
        if self.optimizer is not None and self.data_parallel is None and process_group_size() is not None:
            # a process group made after optimize(): a DDP or FSDP wrapper may now reduce the gradients
            # after memplan's updates have used them (memplan.frontend.distributed)
            refuse_distributed_updates(model)
        held = 0 if own else held_gradient_bytes(params.values())
        refuse_meta_parameters(params, inputs)
        if self.first_step is not None and self.split is None:
            first_step, self.first_step = self.first_step, None
            first_step(args, kwargs, held)
        if self.split is None:
            try:
                plan, program, param_names, buffer_names = self._entry(args, kwargs, held)
            except DataDependentPython as exc:
                self._split_at_graph_breaks(exc)
        if self.split is not None:
            return self.split[0](*args, **kwargs)
        buffers_by_name = dict(model.named_buffers())
        buffers = [buffers_by_name[n] for n in buffer_names]
        primals = [params[n] for n in param_names] + buffers + inputs
        if program.updater is not None:
            # before forward allocates: a resume (load_state_dict) may have put host state on the device
            program.updater.place_state()
        outputs = run_program(program, buffers, primals)
        return plan.analysis.capture.output_tree.rebuild(list(outputs), primals)


def _use_learner(module: OptimizedModule, sig: InputSignature, planned: OutputUse, plan: Plan):
    """The observer a plan's backward reports how the outputs were used to (`Program.observer`).

    It holds the module weakly: the module holds the plan, which holds the observer."""
    ref = weakref.ref(module)

    def observe(missing: frozenset[int], dropped: frozenset[int]) -> None:
        owner = ref()
        if owner is not None:
            owner._learn_output_use(sig, planned, plan, missing, dropped)

    return observe


class WithLoss(nn.Module):
    """``model`` followed by ``loss_fn``: one call is the whole differentiable step.

    Wrap a model this way before :func:`optimize` to put the loss inside the
    plan: its memory (a cross-entropy's log-softmax over the logits is as
    large as the logits) is then planned and counted like every other value,
    and the only output gradient is the scalar loss's. Parameters keep their
    names under ``model.``.
    """

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model(*args, **kwargs)
        if torch.compiler.is_compiling():  # traced whole: the loss is in the same graph
            return self.loss_fn(out)
        # The loss function's graph (`memplan.fully_shard` compiles it) gets the model's outputs, to
        # which nothing here holds a reference once it returns: its plan may let them go then.
        held = (args, kwargs, list(self.parameters()), list(self.buffers()))  # (out may hold views of these)
        with inputs_dropped_after_call(out, kept=held):
            return self.loss_fn(out)
