"""Compile a program's segments with Inductor, keeping the plan's memory decisions.

A segment (`memplan.runtime.program.Segment`) is straight-line fx code in schedule
order. Most of it is plain ATen ops; between them sit Python steps that
Inductor must not see: the capture of a random op's generator state and its
replays, offload / prefetch / arrive, optimizer updates, gradient clipping.
This module cuts a segment's nodes into *runs* (each item of a multi-output
op taken right after it, so that a run hands on tensors, never a tuple):
maximal stretches of pure,
deterministic ATen ops (a run never crosses a Python step, so no value moves
across one), each of which may open with one random op's first run (dropout's
mask drawn by eager's own kernel, ``fallback_random``: `is_random_op`; on the CPU the capture split
the mask's draw from its multiply, `memplan.passes.dropout_split`, and the multiply is fused). Each run
long enough to gain from fusion is decomposed with Inductor's table and
compiled by Inductor
(``compile_fx_inner``) on fake inputs; everything else runs as generated fx
code, as in the eager runtime.

Memory decisions do not move. A run takes its inputs boxed: the executor
hands over the only reference to a value whose last use is in that run, and
Inductor's code frees each input and buffer after its last use inside the
run. Inductor may still reorder inside a run, add buffers its
decompositions need, or return an output that views a larger buffer; so
every compiled run is checked when it is built: run on zero inputs, compiled
and eager, its peak (allocator events, `memplan.measure.tracker.profiled_peak`, or
CUDA allocator stats) and the bytes its outputs keep alive must not exceed
the eager run's. A run that fails the check, or fails to compile, runs
eagerly (a warning names it). The eager runtime's peaks are what the plan
predicts, so the compiled step stays within the planned peak.

A run may also write into the memory of inputs it reads for the last time
(`_Segmenting.donatable`): values the step made, that nothing else reads
later or holds (no source, no output the caller holds, no tangent, nothing a
copy to the host reads, no view of one of these), that no compiled run
handed out sharing a buffer, each a whole storage. Inductor reuses such *donated*
inputs for its own buffers, as it does in a backward that AOTAutograd
compiles; without it, every buffer a run makes is fresh memory, and on the
CPU a freed buffer glibc has handed back to the system is paid again in page
faults (`benchmarks/results/inductor_gap.md`).
"""
from __future__ import annotations

import dataclasses
import operator
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
import torch.fx as fx

from memplan.runtime.program import VALUE
from memplan.core.storage import storage_key
from memplan.ops.transfer import offload
from memplan.runtime.inductor.check import best_times, check_run, seconds_per_call
from memplan.runtime.inductor.compiler import Compiler, DONATED, KEEP_STRIDES, inductor_compiler
from memplan.runtime.inductor.layouts import LayoutGuard, Restrided, is_dense, layout_of
from memplan.runtime.inductor.reports import CompileReport, CompileWarning, RunReport
from memplan.runtime.inductor.runs import around_escaping_tuples, calling_aten, drawn_from, grouped_runs, is_header, items_with_their_op, is_random_op, run_module, tensor_valued
from memplan.runtime.inductor.sharing import alias_roots, held_all_step, shared_storage, sharing_storage
from memplan.core.config import TUNABLES


@dataclass
class Stage:
    """One call of the compiled segment: a run (compiled or generated fx code) with boxed inputs."""

    fn: Callable[[list], Any]
    reads: list[str]
    last: frozenset[str]  # reads whose last use this is: handed over, not kept
    writes: list[str]


class CompiledSegment:
    """A segment run as stages; same calling convention as `memplan.runtime.program.Segment`."""

    def __init__(self, source: Any, unpack: list[tuple[int, str]], constants: dict[str, Any],
                 stages: list[Stage], outputs: list[str], outputs_laid_out: dict[int, torch.Tensor] | None = None):
        self.source = source  # the eager Segment it was made from
        self.inputs, self.outputs = source.inputs, source.outputs
        self.unpack, self.constants, self.stages, self.output_names = unpack, constants, stages, outputs
        # by output position: the outputs laid out otherwise than traced
        self.outputs_laid_out: dict[int, torch.Tensor] = outputs_laid_out or {}
        self.copied: frozenset[str] = frozenset()  # values copied into their traced layout for eager code

    def __call__(self, args: list[Any]) -> tuple[Any, ...]:
        env = dict(self.constants)
        for i, name in self.unpack:
            env[name] = args[i]
        args.clear()
        for stage in self.stages:
            box = [env.pop(n) if n in stage.last else env[n] for n in stage.reads]
            results = stage.fn(box)
            del box
            env.update(zip(stage.writes, results))
            del results
        out = tuple(env[n] for n in self.output_names)
        env.clear()
        return out


@dataclass
class _Segmenting:
    """What cutting one segment into stages needs to know about it."""

    root: torch.nn.Module
    name: str  # "forward" or "backward"
    position: dict[fx.Node, int]  # body node -> its index
    last_use: dict[str, int]  # value -> index of the last body node that reads it (len(body): the output)
    constants: dict[str, Any]
    device: torch.device
    report: CompileReport
    compiler: Compiler
    check: bool
    timeline: Any  # memory after each schedule step (for a compute: during it), the simulator's
    budget: int
    step_cost: list[float]  # each schedule step's predicted time (the cost model's units; 0 but for computes)
    # Values laid out otherwise than traced (Inductor may return a convolution's output
    # channels-last): the later runs that read them are compiled for that layout. The backward
    # starts with what the forward carries to it.
    laid_out: dict[str, torch.Tensor]
    keep_strides: frozenset[str]  # values the program hands out: their strides stay as traced
    sources: frozenset[str]  # the step's inputs: parameters, buffers, the batch
    # Node -> the node whose storage it lives in (`shared_storage`), and the storages others hold
    # beyond the plan (the step's sources, the outputs the caller holds, the tangents): those are
    # never a compiled run's to reuse.
    storage_of: dict[str, str] = field(default_factory=dict)
    value_of: dict[str, str] = field(default_factory=dict)  # node -> the plan's value it makes
    exposed: frozenset[str] = frozenset()
    # Plan values a compiled run hands out in one buffer with another of its outputs, or as part
    # of a larger one (Inductor's CPU `cat` writes an input of it into the cat's buffer): no
    # graph shows that sharing, so no run donates them, nor what shares their storage. Shared by
    # the two segments: the backward reads what the forward's runs handed out.
    shared_at_runtime: set[str] = field(default_factory=set)
    copied: set[str] = field(default_factory=set)  # values copied into their traced layout (`restrided`)

    def planned_bytes(self, members: list[fx.Node]) -> int:
        """The most memory the plan has in use during ``members``' steps."""
        steps = [n.meta["memplan_step"] for n in members if "memplan_step" in n.meta]
        return int(max(self.timeline[k] for k in steps)) if steps else self.budget

    def escaping(self, members: list[fx.Node]) -> list[str]:
        """The values of ``members`` read after the last of them."""
        end = self.position[members[-1]]
        return [n.name for n in members if self.last_use.get(n.name, -1) > end]

    def last_of(self, members: list[fx.Node], reads: list[str]) -> frozenset[str]:
        """The ``reads`` whose last use is in ``members``: handed over to the run, not kept."""
        end = self.position[members[-1]]
        return frozenset(r for r in reads if self.last_use[r] <= end and r not in self.constants)

    def donatable(self, members: list[fx.Node], reads: list[str], vals: list[torch.Tensor]) -> list[int]:
        """Positions of the ``reads`` whose memory the compiled run may reuse once it has read them:
        their last use is in ``members``, nothing beyond the plan holds them (`exposed`), no other
        value sharing their storage is read by the run or lives after it, and each is its storage,
        whole and dense (Inductor reuses an input as a buffer of the input's own size)."""
        if not self.check:  # runs compiled unchecked could hand out shared buffers unseen
            return []
        last = self.last_of(members, reads)
        end = self.position[members[-1]]
        read = set(reads)

        def alone(name: str) -> bool:
            sharing = self.nodes_in[self.storage_of[name]]
            return (self.storage_of[name] not in self.exposed
                    and not any(self.value_of.get(o, o) in self.shared_at_runtime for o in sharing)
                    and not any(o != name and (o in read or self.last_use.get(o, -1) > end) for o in sharing))

        def whole(v: torch.Tensor) -> bool:
            return (v.storage_offset() == 0 and is_dense(v)
                    and v.numel() * v.element_size() == v.untyped_storage().nbytes())

        return [i for i, (r, v) in enumerate(zip(reads, vals))
                if r in last and r in self.storage_of and alone(r) and whole(v)]

    @cached_property
    def nodes_in(self) -> dict[str, list[str]]:
        """Each storage of `storage_of` -> the nodes living in it."""
        nodes: dict[str, list[str]] = {}
        for node_name, storage in self.storage_of.items():
            nodes.setdefault(storage, []).append(node_name)
        return nodes

    def stages(self, members: list[fx.Node], compile_it: bool) -> list[Stage]:
        """``members`` as one stage, compiled where asked and accepted; a compiled run the check
        refuses is tried again as two halves before it falls back to eager code."""
        inside = {n.name for n in members}
        reads = list(dict.fromkeys(i.name for n in members for i in n.all_input_nodes if i.name not in inside))
        writes = self.escaping(members)
        last = self.last_of(members, reads)
        eager = run_module(self.root, members, reads, writes, boxed=True)
        entry = RunReport(self.name, members[0].name, sum(n.op == "call_function" for n in members), compiled=False,
                          random_ops=sum(is_random_op(n) for n in members))
        restride: list[Stage] = []
        if compile_it:
            compiled = self.compile_run(members, reads, writes, eager, entry)
            if compiled is None and entry.compiled_peak is None and any(r in self.laid_out for r in reads):
                # Compiled for the layouts earlier runs hand it, it failed (a `view` that cannot take
                # them: ConvNeXt's whole backward ran eagerly): again, on copies laid out as traced.
                restride = self.restrided(reads, members)
                compiled = self.compile_run(members, reads, writes, eager, entry)
            if compiled is not None:
                return [*restride, Stage(compiled, reads, last, writes)]
            # halved when over its memory (timed only once it fits: one slower than eager is not)
            refused = entry.compiled_peak is not None and entry.compiled_s is None
            cut = _cut(members, self) if refused else None
            if cut is not None:
                return [*restride, *self.stages(members[:cut], True), *self.stages(members[cut:], True)]
            self.report.runs.append(entry)
            if entry.compiled_s is None:  # not a choice of speed: say why it is not compiled
                warnings.warn(f"memplan: {self.name} run at {members[0].name!r} ({len(members)} ops) runs eagerly: "
                              f"{entry.reason}", CompileWarning, stacklevel=5)
        else:
            self.report.runs.append(entry)
        for w in writes:  # eager code lays its results out as traced, as far as is known
            self.laid_out.pop(w, None)
        # Eager code assumes the traced layouts (a `view` fails on others).
        return [*restride, *self.restrided(reads, members), Stage(eager, reads, last, writes)]

    def restrided(self, reads: list[str], members: list[fx.Node]) -> list[Stage]:
        """A Python step laying out as traced the ``reads`` a compiled run handed on otherwise (each
        copy taking its original's place; none when there are none); from then on they are traced."""
        relaid = [r for r in reads if r in self.laid_out]
        if not relaid:
            return []
        self.copied.update(relaid)
        copy = Restrided([self.traced(r, members).stride() for r in relaid])
        # the copies are time the compiled runs cost beyond their own
        self.report.predicted_saving -= seconds_per_call(copy, [self.laid_out.pop(r) for r in relaid], self.device)
        return [Stage(copy, relaid, frozenset(relaid), relaid)]

    def traced(self, name: str, members: list[fx.Node]) -> Any:
        """The traced value (fake tensor) of ``name``, read by ``members``."""
        return next(i.meta.get("val") for n in members for i in n.all_input_nodes if i.name == name)

    def compile_run(self, members: list[fx.Node], reads: list[str], writes: list[str], eager: fx.GraphModule,
                    entry: RunReport) -> Callable[[list], Any] | None:
        """The compiled run, accepted by the check; None (and ``entry.reason``) when not."""
        by_name = {i.name: i for n in members for i in n.all_input_nodes}
        traced = [self.constants[r] if r in self.constants else by_name[r].meta.get("val") for r in reads]
        vals = [self.laid_out.get(r, v) for r, v in zip(reads, traced)]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            entry.reason = "an input is not a tensor (" + ", ".join(
                f"{r}: {type(v).__name__}" for r, v in zip(reads, vals) if not isinstance(v, torch.Tensor)) + ")"
            return None
        positional = run_module(self.root, members, reads, writes, boxed=False, calls_aten=True)
        positional.graph.find_nodes(op="output")[0].meta[KEEP_STRIDES] = [
            i for i, w in enumerate(writes) if w in self.keep_strides]
        positional.meta[DONATED] = self.donatable(members, reads, vals)
        entry.donated = len(positional.meta[DONATED])
        started = TUNABLES.clock()
        try:
            with torch.no_grad():
                compiled = self.compiler(positional, vals)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager run in place
            first = str(exc).splitlines()[0] if str(exc) else ""
            entry.reason = f"it did not compile ({type(exc).__name__}: {first[:200]})"
            return None
        finally:
            entry.compile_s = TUNABLES.clock() - started
            self.report.compile_s += entry.compile_s
        if self.check:
            # held through the run: values read later, and the step's inputs (parameters, buffers,
            # the batch), which the caller keeps however early the run lets go of them
            keep = [r not in self.last_of(members, reads) or r in self.sources for r in reads]
            return self._checked(compiled, eager, members, writes, vals, traced, keep, entry)
        entry.compiled = True
        self.report.runs.append(entry)
        return LayoutGuard(compiled, eager, vals, f"{self.name} run at {members[0].name!r}")

    def _checked(self, compiled: Callable[[list], Any], eager: fx.GraphModule, members: list[fx.Node],
                 writes: list[str], vals: list[torch.Tensor], traced_vals: list[torch.Tensor], keep: list[bool],
                 entry: RunReport) -> Callable[[list], Any] | None:
        """``compiled``, once its peak and outputs pass the check against ``eager`` (and timed); None
        and ``entry.reason`` when not. The trial runs draw from a forked generator: a run that opens
        with a random op must not move the caller's random stream."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            try:
                with torch.no_grad():
                    # its eager twin as the plan runs it, inputs laid out as traced
                    entry.compiled_peak, entry.eager_peak, why, layouts = check_run(
                        compiled, calling_aten(eager), vals, keep, self.device, traced_vals)
            except Exception as exc:  # noqa: BLE001 - compiled code that fails to run is not used
                first = str(exc).splitlines()[0] if str(exc) else ""
                entry.reason = f"it compiled but failed to run ({type(exc).__name__}: {first[:200]})"
                return None
            traced_of = {n.name: n.meta.get("val") for n in members}
            # exact strides: autograd copies a gradient whose strides are not its parameter's, even
            # where they differ only in a dimension of size 1 (a 1x1 convolution's weight)
            moved = [w for w, val in zip(writes, layouts)
                     if w in self.keep_strides and val.stride() != traced_of[w].stride()]
            if moved:  # a gradient or output laid out otherwise would be copied to its traced layout
                entry.reason = f"compiled, it hands out {', '.join(moved[:3])} laid out otherwise than traced"
                self.report.refused += 1
                return None
            # The plan runs this run beside `planned - eager_peak` bytes; compiled, it must still fit.
            planned = self.planned_bytes(members) + entry.compiled_peak - entry.eager_peak
            if not why and planned > self.budget:
                why = (f"peak {entry.compiled_peak} B against eager's {entry.eager_peak} B, "
                       f"{planned - self.budget} B over the budget there")
            if why:
                entry.reason = f"compiled, it takes more memory than planned ({why})"
                self.report.refused += 1
                return None
            # The cost model times eager ops; the compiled run's measured speed-up scales its steps' share.
            with torch.no_grad():
                entry.compiled_s, entry.eager_s = best_times([(compiled, vals), (eager, traced_vals)], self.device,
                                                           TUNABLES.timing_rounds)
            # (not where its eager code would need copies of values laid out otherwise: they cost
            # memory the plan does not have, and time)
            relaid = any(isinstance(v, torch.Tensor) and v is not t for v, t in zip(vals, traced_vals))
            if TUNABLES.slower_margin * entry.eager_s < entry.compiled_s < TUNABLES.doubtful * entry.eager_s and not relaid:
                with torch.no_grad():
                    again = best_times([(compiled, vals), (eager, traced_vals)], self.device, TUNABLES.doubt_rounds)
                entry.compiled_s, entry.eager_s = min(entry.compiled_s, again[0]), min(entry.eager_s, again[1])
            if entry.compiled_s > TUNABLES.slower_margin * entry.eager_s and not relaid:
                # Inductor's kernels are not always faster (small depthwise convolutions and layer
                # norms on a channels-last layout: ConvNeXt's ran 17-21% slower than eager's)
                entry.reason = (f"compiled, it runs slower than eager ({entry.compiled_s * 1e3:.2f} ms against "
                                f"{entry.eager_s * 1e3:.2f} ms)")
                self.report.slower += 1
                return None
            self.report.predicted_peak = max(self.report.predicted_peak, planned)
            together = Counter(storage_key(val) for val in layouts)
            self.shared_at_runtime.update(
                self.value_of.get(name, name) for name, val in zip(writes, layouts)
                if together[storage_key(val)] > 1 or val.untyped_storage().nbytes() > val.numel() * val.element_size())
            for name, val in zip(writes, layouts):
                if layout_of(val) != layout_of(traced_of[name]):
                    self.laid_out[name] = val
                    self.report.relaid += 1
            steps = {n.meta["memplan_step"] for n in members if "memplan_step" in n.meta}
            planned_s = sum(self.step_cost[k] for k in steps)
            self.report.predicted_saving += planned_s * (1 - entry.compiled_s / max(entry.eager_s, 1e-9))
        entry.compiled = True
        self.report.runs.append(entry)
        return LayoutGuard(compiled, eager, vals, f"{self.name} run at {members[0].name!r}")


def _cut(members: list[fx.Node], seg: _Segmenting) -> int | None:
    """Where to halve a refused run: near its middle, both halves long enough to compile, and no
    multi-output value (a tuple) crossing the cut. None when there is no such place."""
    if len(members) < 2 * TUNABLES.min_run_ops:
        return None
    middle = len(members) // 2
    for offset in range(len(members)):
        for cut in (middle + offset, middle - offset):
            if TUNABLES.min_run_ops <= cut <= len(members) - TUNABLES.min_run_ops and all(
                    tensor_valued(n) for n in members[:cut] if n.name in seg.escaping(members[:cut])):
                return cut
    return None


def compile_segment(segment: Any, name: str, device: torch.device, report: CompileReport, timeline: Any,
                    budget: int, step_cost: list[float], compiler: Compiler = inductor_compiler,
                    check: bool = True, inputs_laid_out: dict[int, torch.Tensor] | None = None,
                    free_outputs: frozenset[int] = frozenset(), sources: frozenset[str] = frozenset(),
                    keep: frozenset[str] = frozenset(), exposed: frozenset[str] = frozenset(),
                    alias_root: dict[str, str] | None = None,
                    shared_at_runtime: set[str] | None = None) -> CompiledSegment:
    """``segment`` with its runs of ATen ops compiled by ``compiler`` (see the module docstring).

    ``inputs_laid_out``: by argument position, inputs that arrive laid out otherwise than traced;
    ``free_outputs``: positions of outputs that may leave laid out otherwise (what the forward
    carries to the backward alone). The result's ``outputs_laid_out`` says, by position, which did.
    ``sources``: names of the step's inputs (parameters, buffers, the batch), which outlive it;
    ``keep``: values made in their traced layout wherever made (the result's ``copied`` names those
    that had to be copied into it for eager code); ``exposed``: the values others hold beyond the
    plan, and ``alias_root`` which values share storage (`alias_roots`): a compiled run reuses the
    memory of none of those; without ``alias_root``, of no input at all. ``shared_at_runtime``
    (updated): the values compiled runs hand out sharing a buffer (`_Segmenting`)."""
    root = segment.module
    nodes = list(root.graph.nodes)
    box, output = nodes[0], nodes[-1]
    unpack = [(n.args[1], n.name) for n in nodes if n.op == "call_function" and n.target is operator.getitem
              and n.args[0] is box]
    constants = {n.name: getattr(root, n.target) for n in nodes if n.op == "get_attr"}
    body = items_with_their_op([n for n in nodes[1:-1] if not is_header(n, box) and n.op != "get_attr"])
    position = {n: i for i, n in enumerate(body)}
    last_use: dict[str, int] = {}
    for n in body:
        for i in n.all_input_nodes:
            last_use[i.name] = position[n]
    for i in output.all_input_nodes:
        last_use[i.name] = len(body)
    results = list(output.args[0])
    handed_out = frozenset(n.name for i, n in enumerate(results) if i not in free_outputs and isinstance(n, fx.Node))
    handed_out |= drawn_from(root, body) | keep
    names_of = dict(unpack)
    laid_out = {names_of[i]: val for i, val in (inputs_laid_out or {}).items() if i in names_of}
    storage_of = shared_storage(root.graph, alias_root) if alias_root is not None else {}
    # held beyond the plan: what the caller holds, and what a copy to the host reads (on CUDA it
    # runs on a side stream, and may still be reading when a run reuses the memory)
    held = frozenset(storage_of[n.name] for n in nodes if n.meta.get(VALUE) in exposed and n.name in storage_of)
    copied = [a for n in nodes if n.op == "call_function" and n.target is offload for a in n.all_input_nodes]
    # (a tuple copied whole: its items)
    copied += [item for a in copied for item in a.users if item.target is operator.getitem]
    held |= {storage_of[a.name] for a in copied if a.name in storage_of}
    seg = _Segmenting(root, name, position, last_use, constants, device, report, compiler, check, timeline, budget,
                      step_cost, laid_out, handed_out, sources, storage_of,
                      {n.name: n.meta.get(VALUE, n.name) for n in nodes}, held,
                      shared_at_runtime if shared_at_runtime is not None else set())

    # Runs too short to gain, or whose escaping values are not plain tensors, join the eager code.
    plan: list[tuple[bool, list[fx.Node]]] = []
    for kind, group in grouped_runs(body):
        for members in (around_escaping_tuples(group, seg.escaping(group)) if kind else [group]):
            compiles = kind and len(members) >= TUNABLES.min_run_ops and all(
                tensor_valued(n) for n in members if n.name in seg.escaping(members))
            if plan and not compiles and not plan[-1][0]:
                plan[-1][1].extend(members)
            else:
                plan.append((compiles, list(members)))
    stages = [stage for kind, members in plan for stage in seg.stages(members, kind)]
    compiled = CompiledSegment(segment, unpack, constants, stages, [n.name for n in results],
                               {i: laid_out[n.name] for i, n in enumerate(results)
                                if isinstance(n, fx.Node) and n.name in laid_out})
    compiled.copied = frozenset(seg.copied)
    return compiled


def compile_program(program: Any, plan: Any, device: torch.device, compiler: Compiler = inductor_compiler,
                    check: bool = True) -> Any:
    """``program`` (`memplan.runtime.program.Program`, built from ``plan``) with both segments compiled; its
    ``compile_report`` says what was, and the peak the plan now predicts."""
    problem = plan.analysis.lowered.problem
    steps = list(plan.schedule)
    timeline = plan.simulated.timeline
    step_cost = [float(problem.cost[problem.index[node]]) if op == "compute" and node in problem.index else 0.0
                 for op, node in steps]
    # outside the graph's plan: its timeline and budget are without them
    held = plan.held_gradient_bytes + getattr(plan, "engine_bytes", 0)
    budget = plan.budget - held
    # The forward returns outputs, buffer updates, then what it carries to the backward, which
    # the backward takes first, in that order (by position: a segment names its values itself).
    handed = len(program.user_outputs) + len(program.buffer_updates)
    sources = held_all_step(problem, plan.analysis.lowered.sources)
    roots = alias_roots(problem)
    # The caller holds the outputs (and the buffers updated), autograd or the caller the tangents.
    tangents = program.backward.inputs[len(program.carried):]
    exposed = sharing_storage(roots, [*sources, *program.user_outputs, *(n for _, n in program.buffer_updates),
                                      *tangents])
    backward_graph = program.backward.module.graph
    position_of = {n.name: n.args[1] for n in backward_graph.nodes if n.op == "call_function"
                   and n.target is operator.getitem and n.args[0].op == "placeholder"}
    # what the forward carries may leave laid out otherwise, unless a random op in backward draws from it
    kept_carried = {position_of[v] for v in drawn_from(program.backward.module, list(backward_graph.nodes))
                    if v in position_of}
    keep_forward: frozenset[str] = frozenset()
    keep_backward: frozenset[str] = frozenset()
    # Eager code (a refused run) gets values a compiled run laid out otherwise as copies in their
    # traced layout; copies cost memory the plan does not have (Hugging Face ResNet at 90% measured
    # 769 KB over its budget). So each later pass makes the values the last one copied in their
    # traced layout where they are made.
    for _ in range(TUNABLES.compile_passes):
        shared: set[str] = set()
        report = CompileReport(predicted_peak=plan.predicted_peak - held)
        forward = compile_segment(program.forward, "forward", device, report, timeline, budget, step_cost, compiler,
                                  check, free_outputs=frozenset(handed + i for i in range(len(program.carried))
                                                                if i not in kept_carried),
                                  sources=sources, keep=keep_forward, exposed=exposed, alias_root=roots,
                                  shared_at_runtime=shared)
        carried = {i - handed: val for i, val in forward.outputs_laid_out.items() if i >= handed}
        backward = compile_segment(program.backward, "backward", device, report, timeline, budget, step_cost,
                                   compiler, check, inputs_laid_out=carried, sources=sources, keep=keep_backward,
                                   exposed=exposed, alias_root=roots, shared_at_runtime=shared)
        if not (forward.copied or backward.copied):
            break
        keep_forward |= forward.copied
        keep_backward |= backward.copied
        kept_carried |= {position_of[v] for v in backward.copied if v in position_of}
    report.predicted_peak += held
    if -report.predicted_saving > (TUNABLES.step_slower_margin - 1) * plan.predicted_time:
        # Inductor's code is not faster everywhere (small convolutions, layouts copied between runs)
        report.eager_instead = (f"compiled, the step was predicted {-report.predicted_saving * 1e3:.2f} ms slower "
                                f"than eager ({sum(r.compiled for r in report.runs)} of {len(report.runs)} runs "
                                "compiled): it runs eagerly")
        report.predicted_peak, report.predicted_saving, report.runs = plan.predicted_peak, 0.0, []
        return dataclasses.replace(program, compile_report=report)
    program = dataclasses.replace(program, forward=forward, backward=backward)
    return dataclasses.replace(program, compile_report=report)
