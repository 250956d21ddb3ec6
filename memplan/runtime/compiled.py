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
mask drawn by eager's own kernel, ``fallback_random``: `_random`; on the CPU the capture split
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
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.ops.kernels import aten_target, dropout_apply_to_fuse, with_aten_targets
from memplan.measure.tracker import allocated_during
from memplan.runtime.program import VALUE, Replay, clear_box
from memplan.core.storage import storage_key
from memplan.ops.transfer import arrive, offload

# The output node's meta key (Inductor's own) listing the outputs whose strides must stay as traced.
KEEP_STRIDES = "user_visible_output_idxs"
# A run's module meta key: the positions of the inputs whose memory the compiled run may reuse.
DONATED = "memplan_donated"
# Shorter runs stay eager: a compile costs seconds and a run of one or two ops fuses nothing.
MIN_RUN_OPS = 3
# A compiled run measured this much slower than its eager twin runs eagerly, and so does a whole
# step predicted this much slower than eager (the margin: timing noise).
SLOWER_MARGIN = 1.05
STEP_SLOWER_MARGIN = 1.05
TIMING_ROUNDS = 3  # a compiled run and its eager twin, timed in turn, the best of each
# A run first measured slower, but by less than this, is timed DOUBT_ROUNDS more times before it is
# refused: three rounds refused ConvNeXt's compiled forward in two benchmark runs of three.
DOUBTFUL = 1.3
DOUBT_ROUNDS = 6
COMPILE_PASSES = 3  # each pass makes in their traced layout the values the last one copied
# What the speed check times compiled runs and their eager twins by (seconds): every verdict of
# that check reads this clock, so a test replaces it with one whose time it decides.
CLOCK: Callable[[], float] = time.perf_counter
Compiler = Callable[[fx.GraphModule, list[torch.Tensor]], Callable[[list], Any]]


class CompileWarning(UserWarning):
    """A run of a plan could not be compiled, or compiled to more memory than planned: it runs eagerly."""


@dataclass
class RunReport:
    """What happened to one run of ATen ops."""

    segment: str  # "forward" or "backward"
    first: str  # the name of its first node
    ops: int
    compiled: bool
    reason: str = ""  # why it runs eagerly
    random_ops: int = 0  # random ops' first draws in it (eager's kernels, called by the compiled code)
    compiled_peak: int | None = None  # measured when checked, bytes above what was live before the run
    eager_peak: int | None = None
    compile_s: float = 0.0
    compiled_s: float | None = None  # measured on zero inputs when checked
    eager_s: float | None = None
    donated: int = 0  # inputs read for the last time whose memory the compiled run may reuse


@dataclass
class CompileReport:
    """How a program's segments were compiled."""

    runs: list[RunReport] = field(default_factory=list)
    refused: int = 0  # compiled runs the memory check refused (each then tried as two halves)
    slower: int = 0  # compiled runs measured slower than eager, run eagerly
    # Set when the compiled step as a whole was predicted slower than eager, which then runs instead.
    eager_instead: str = ""
    relaid: int = 0  # values compiled runs hand on laid out otherwise than traced (later runs compiled for it)
    compile_s: float = 0.0  # Inductor's time, refused runs included
    # The plan's predicted peak with the compiled runs' measured differences from eager added.
    predicted_peak: int = 0
    # Predicted time the compiled runs save: each run's predicted time times its measured speed-up.
    predicted_saving: float = 0.0

    @property
    def compiled_ops(self) -> int:
        return sum(r.ops for r in self.runs if r.compiled)

    @property
    def eager_ops(self) -> int:
        return sum(r.ops for r in self.runs if not r.compiled)

    @property
    def donated(self) -> int:
        return sum(r.donated for r in self.runs if r.compiled)

    def summary(self) -> str:
        if self.eager_instead:
            return self.eager_instead
        n = sum(r.compiled for r in self.runs)
        rejected = [r for r in self.runs if not r.compiled and r.reason]
        text = (f"{n} of {len(self.runs)} runs compiled ({self.compiled_ops} ops; {self.eager_ops} ops eager), "
                f"Inductor {self.compile_s:.1f} s, {self.refused} compiled runs refused by the memory check")
        if self.slower:
            text += f", {self.slower} slower than eager run eagerly"
        if self.relaid:
            text += f", {self.relaid} values handed on in Inductor's layout"
        if self.donated:
            text += f", {self.donated} inputs' memory reused"
        if rejected:
            text += "; eager: " + ", ".join(f"{r.segment} run at {r.first} ({r.reason})" for r in rejected)
        return text


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


def _is_header(node: fx.Node, box: fx.Node) -> bool:
    """The boxed calling convention's own nodes: the argument list, its unpacking, its clearing."""
    if node.op == "placeholder":
        return True
    if node.op == "call_function" and node.target is operator.getitem and node.args[0] is box:
        return True
    return node.op == "call_function" and node.target is clear_box


def _pure_op(node: fx.Node, seeded: bool) -> bool:
    """An ATen op that writes none of its inputs, random (``seeded``) or deterministic."""
    op = aten_target(node)  # a stand-in (`memplan.ops.kernels`) computes its op: Inductor gets the op
    return (node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and not op._schema.is_mutable
            and (torch.Tag.nondeterministic_seeded in op.tags) == seeded)


def _compilable(node: fx.Node) -> bool:
    """A node Inductor may take: a pure, deterministic ATen op."""
    return _pure_op(node, seeded=False)


def _random(node: fx.Node) -> bool:
    """A random ATen op's first run (dropout's mask drawn). Inductor compiles it as a call of eager's
    own kernel (``fallback_random``), which draws eager's mask from the generator as it stands
    there. Where the plan replays the op, the state was saved just before it (a Python step), so
    the op opens a run; the replays are Python steps, never in a run."""
    return _pure_op(node, seeded=True)


def _layout_pinned(op: Any) -> bool:
    """Inductor pins the inputs of ``op`` to the layout of the graph it compiles (with
    ``fallback_random``, dropout's: its kernel fills the mask in its input's memory order)."""
    try:
        from torch._inductor.lowering import maybe_layout_constraints
    except ImportError:  # an Inductor without the registry: the op opens a run, as before
        return False
    return maybe_layout_constraints(op) is not None


def _draws_whatever_the_layout(node: fx.Node) -> bool:
    """Whether random op ``node`` draws the same values whatever its input's layout: memplan's
    dropout mask (`memplan.passes.dropout_split`) fills a contiguous buffer of its own."""
    return aten_target(node) is torch.ops.memplan.dropout_mask.default


def _draws_mid_run(node: fx.Node, run: list[fx.Node]) -> bool:
    """Whether random op ``node`` (no state saved before it) may join ``run``: it draws the same
    values whatever its input's layout, or Inductor keeps that input laid out as compiled
    (`_DrawingAsTraced` makes that eager's layout); and every random op already in the run is
    its ancestor, so that no order Inductor may pick draws them otherwise than eager."""
    if not (_draws_whatever_the_layout(node) or _layout_pinned(aten_target(node))):
        return False
    earlier = {n for n in run if _random(n)}
    if not earlier:
        return True
    members, seen, stack = set(run), set(), list(node.all_input_nodes)
    while stack and earlier:
        n = stack.pop()
        if n in seen or n not in members:
            continue
        seen.add(n)
        earlier.discard(n)
        stack.extend(n.all_input_nodes)
    return not earlier


def drawn_from(root: torch.nn.Module, nodes: list[fx.Node]) -> frozenset[str]:
    """The values random ops among ``nodes`` draw from, at their first run or a replay. They keep
    their traced layout wherever they are made: a random kernel fills its mask in memory order,
    so an input laid out otherwise (a convolution's output channels-last) would draw another
    mask than eager's, and a replay another than the first run's."""
    return frozenset(i.name for n in nodes
                     if (_random(n) and not _draws_whatever_the_layout(n))
                     or (n.op == "call_module" and isinstance(root.get_submodule(n.target), Replay))
                     for i in n.all_input_nodes if _tensor_valued(i))


def _tensor_valued(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _groups(nodes: list[fx.Node]) -> list[tuple[bool, list[fx.Node]]]:
    """Cut ``nodes`` (schedule order) into maximal runs: (compilable, nodes)."""
    groups: list[tuple[bool, list[fx.Node]]] = []
    members: set[fx.Node] = set()
    for node in nodes:
        # an item of a multi-output value stays with the op that made it, compiled or not
        kind = groups[-1][0] if node.target is operator.getitem and node.args[0] in members else _compilable(node)
        if _random(node):
            if groups and groups[-1][0] and _draws_mid_run(node, groups[-1][1]):
                groups[-1][1].append(node)
                members.add(node)
            else:  # opens a run of its own (after its saved state, or where Inductor might reorder draws)
                groups.append((True, [node]))
                members = {node}
            continue
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(node)
        else:
            groups.append((kind, [node]))
            members = set()
        members.add(node)
    return groups


def _around_escaping_tuples(run: list[fx.Node], escaping: list[str]) -> list[list[fx.Node]]:
    """``run`` cut around each multi-output op whose tuple is read after it (by the segment's
    output: the backward takes a dropout's mask from the tuple the forward carries). A compiled run
    hands on tensors only, so that op and its items run eagerly; the stretches on either side may
    still compile (ViT at 50%: a 149-op run ran eagerly for one dropout's tuple)."""
    pieces: list[list[fx.Node]] = [[]]
    tuples = {n for n in run if n.name in escaping and not _tensor_valued(n)}
    for n in run:
        is_item = n.target is operator.getitem and n.args[0] in tuples
        if n in tuples:
            pieces.append([n])
        elif is_item:
            pieces[-1].append(n)
        elif pieces[-1] and pieces[-1][0] in tuples:
            pieces.append([n])
        else:
            pieces[-1].append(n)
    return [p for p in pieces if p]


def _items_with_their_op(body: list[fx.Node]) -> list[fx.Node]:
    """``body`` with each item taken from a multi-output value (``getitem``) moved to right after
    the op that made it. Taking an item computes and allocates nothing, and only reads that op:
    done at once, a run that makes a tuple hands on its items (tensors), never the tuple (a
    layer norm recomputed in backward, its items read after a dropout's replay, cut ViT's whole
    backward from compilation), and an item nothing reads is freed with the op instead of with
    its last sibling's read: no value lives longer."""
    made = set(body)
    items: dict[fx.Node, list[fx.Node]] = {}
    for n in body:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in made:
            items.setdefault(n.args[0], []).append(n)
    moved = {i for its in items.values() for i in its}
    ordered: list[fx.Node] = []

    def emit(n: fx.Node) -> None:
        ordered.append(n)
        for item in items.get(n, ()):
            emit(item)

    for n in body:
        if n not in moved:
            emit(n)
    return ordered


def _run_module(root: torch.nn.Module, nodes: list[fx.Node], reads: list[str], writes: list[str],
                boxed: bool, calls_aten: bool = False) -> fx.GraphModule:
    """``nodes`` as their own GraphModule: inputs ``reads`` (boxed or positional), outputs ``writes``;
    with ``calls_aten`` (for Inductor) every node calls its ATen op, not its stand-in (`memplan.ops.kernels`)."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    if boxed:
        box = graph.placeholder("args_list")
        for i, name in enumerate(reads):
            env[name] = graph.call_function(operator.getitem, (box, i))
        graph.call_function(clear_box, (box,))
    else:
        for name in reads:
            env[name] = graph.placeholder(name)
    for node in nodes:
        env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    graph.output(tuple(env[n] for n in writes))
    # In-place variants (`memplan.ops.kernels`) assume each value an op made is a buffer of its own,
    # which a compiled run's outputs need not be (one may view another's buffer); and the plan's
    # timeline, which a compiled run is checked against, counts the functional ops' buffers.
    with_aten_targets(graph, only_in_place=not calls_aten)
    graph.lint()
    return fx.GraphModule(root, graph)


def _calling_aten(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` calling the ATen ops themselves, not their stand-ins (`memplan.ops.kernels`): the code the
    plan's timeline and its kernels' measured scratch describe, which a compiled run is checked
    against (a dropout compiled calls the op's own kernel, with its scratch)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    with_aten_targets(graph)
    return fx.GraphModule(gm, graph)


def _extent(t: torch.Tensor) -> int:
    """Bytes of its storage that ``t`` reaches, from the storage's start."""
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _examples(vals: list[torch.Tensor], device: torch.device, whole: bool = False) -> list[torch.Tensor]:
    """Zeros laid out like ``vals`` (zeros: valid as indices, so gathers stay in range), sharing
    storage where ``vals`` do (fake or real): a value and its alias (``detach``) are one buffer in
    the step, and a check that gave each its own would count a buffer the step does not hold
    (GPT's loss backward, its log-softmax read twice, was refused for one logits-size buffer)."""
    sizes: dict[int, int] = {}
    for v in vals:
        size = v.untyped_storage().nbytes() if whole else _extent(v)
        sizes[storage_key(v)] = max(sizes.get(storage_key(v), 0), size)
    buffers = {key: torch.zeros(size, dtype=torch.uint8, device=device) for key, size in sizes.items()}
    return [torch.empty(0, dtype=v.dtype, device=device).set_(
        buffers[storage_key(v)].untyped_storage(), v.storage_offset(), v.shape, v.stride()) for v in vals]


def inductor_compiler(gm: fx.GraphModule, examples: list[torch.Tensor]) -> Callable[[list], Any]:
    """Decompose ``gm`` (ATen) with Inductor's table on fake inputs laid out like ``examples`` (any
    tensors, fake ones included: only their layout is read) and compile it; the result takes its
    inputs boxed."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    # Outputs the caller sees (`KEEP_STRIDES`) leave with their traced strides: one computed in
    # another (a weight's gradient from channels-last inputs) is copied into it, a copy Inductor
    # fuses into the kernel that makes it. The others may leave in the layout Inductor prefers
    # (channels-last convolutions), which the runs that read them are compiled for.
    out = gm.graph.find_nodes(op="output")[0]
    keep = out.meta.get(KEEP_STRIDES)
    traced = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in out.args[0]]

    def traced_layouts(*args: Any) -> tuple:
        outs = _DrawingAsTraced(gm).run(*args)
        return tuple(torch.ops.prims.copy_strided.default(o, traced[i].stride())
                     if keep is not None and i in keep and isinstance(o, torch.Tensor)
                     and isinstance(traced[i], torch.Tensor) and o.stride() != traced[i].stride() else o
                     for i, o in enumerate(outs))

    # fallback_random: a random op (a run's first, `_random`) is not decomposed but called as eager's
    # kernel, so it draws eager's mask from the state the plan saved for it.
    # On the CPU a dropout split at capture (`memplan.passes.dropout_split`) is its mask's kernel and
    # `dropout_apply` as a multiply to fuse: the op's own multiply by a bool mask converts it
    # through a scalar loop, a copy that fused code never makes.
    mode = FakeTensorMode()
    with mode, inductor_config.patch(fallback_random=True):
        table = {**select_decomp_table(), torch.ops.memplan.dropout_apply.default: dropout_apply_to_fuse}
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in examples]
        try:
            decomposed = make_fx(traced_layouts, decomposition_table=table)(*fakes)
        except (RuntimeError, ValueError) as exc:
            if not _is_view_error(exc):
                raise
            # A decomposition laid an intermediate out otherwise than the eager kernel, and a view
            # the trace recorded cannot take it (T5's attention): those views become reshapes,
            # which copy only where a view cannot be made (the memory check sees any copy).
            _views_as_reshapes(gm)
            decomposed = make_fx(traced_layouts, decomposition_table=table)(*fakes)
    if keep is not None:
        decomposed.graph.find_nodes(op="output")[0].meta[KEEP_STRIDES] = list(keep)
        # Inductor's graph cache keys on the module, node meta left out: the module's own meta is in.
        decomposed.meta[KEEP_STRIDES] = tuple(keep)
    donated = list(gm.meta.get(DONATED, ()))
    decomposed.meta[DONATED] = tuple(donated)  # in the cache key: the same code may not donate elsewhere
    # Moving nodes for locality may hold a buffer past the point the plan frees it.
    with inductor_config.patch(reorder_for_locality=False, fallback_random=True):
        if not donated:
            return compile_fx_inner(decomposed, fakes)
        # Inductor takes donated inputs from AOTAutograd's metadata, in a backward graph only (where
        # it also asks contiguous inputs of ATen ops it has no lowering or layout rule for).
        from torch._guards import TracingContext, tracing

        context = TracingContext(mode)
        context.fw_metadata = _Donations(donated)
        with tracing(context):
            return compile_fx_inner(decomposed, fakes, is_backward=True)


@dataclass
class _Donations:
    """What Inductor reads of AOTAutograd's metadata (``fw_metadata``) to reuse a graph's inputs."""

    bw_donated_idxs: list[int]


class _DrawingAsTraced(fx.Interpreter):
    """Runs a run's graph, handing each random op its inputs laid out as traced (a copy where a
    decomposition laid one out otherwise): Inductor pins a random op's inputs to the layout of
    the graph it compiles, and a random kernel fills its output in its input's memory order, so
    this is what makes a random op in mid-run draw eager's values."""

    def run_node(self, n: fx.Node) -> Any:
        if not _random(n):
            return super().run_node(n)

        def as_traced(i: fx.Node) -> Any:
            value, traced = self.env[i], i.meta.get("val")
            relaid = isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor) \
                and value.stride() != traced.stride()
            if relaid:
                return torch.ops.prims.copy_strided.default(value, traced.stride())
            return value

        args, kwargs = fx.node.map_arg((n.args, n.kwargs), as_traced)
        return getattr(self, n.op)(n.target, args, kwargs)


def _is_view_error(exc: BaseException) -> bool:
    text = str(exc)
    return "Cannot view a tensor" in text or "view size is not compatible" in text


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """Each ``view`` / ``_unsafe_view`` of ``gm`` as a ``reshape`` (in place): equal values, a copy
    only where the input's layout admits no view. A run's ops are pure, so no write can tell."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.view.default,
                                                           torch.ops.aten._unsafe_view.default):
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _peak_of(fn: Callable[[], Any], device: torch.device, lay_out: bool = False) -> tuple[int, int, list[torch.Tensor]]:
    """(peak bytes allocated while ``fn`` runs, bytes its result keeps alive, with ``lay_out`` fake
    tensors laid out as its result is, else []), from the allocator."""
    kept: list[int] = []
    layouts: list[torch.Tensor] = []

    def call() -> None:
        result = fn()
        kept.append(sum({storage_key(t): t.untyped_storage().nbytes()
                         for t in result if isinstance(t, torch.Tensor)}.values()))
        if lay_out:
            with FakeTensorMode():
                layouts.extend(_examples(list(result), device, whole=True))

    return allocated_during(call, device), kept[0], layouts


def _check(compiled: Callable[[list], Any], eager: fx.GraphModule, vals: list[torch.Tensor], keep: list[bool],
           device: torch.device, traced: list[torch.Tensor] | None = None) -> tuple[int, int, str, list[torch.Tensor]]:
    """Run both on zero inputs (those marked in ``keep`` stay referenced, as values read later
    do in the step), the compiled run laid out as ``vals``, its eager twin as ``traced`` (as the
    plan's eager step has them; default ``vals``): (compiled peak, eager peak, why the compiled
    run is refused, or "", the compiled run's outputs as laid out, fake)."""

    def call(fn: Callable[[list], Any], vals: list[torch.Tensor]) -> Callable[[], Any]:
        held: list[torch.Tensor] = []

        def run() -> Any:
            box = _examples(vals, device)
            held.extend(t for t, k in zip(box, keep) if k)
            return fn(box)
        return run

    c_peak, c_kept, layouts = _peak_of(call(compiled, vals), device, lay_out=True)
    e_peak, e_kept, _ = _peak_of(call(eager, vals if traced is None else traced), device)
    if c_kept > e_kept:
        return c_peak, e_peak, f"outputs keep {c_kept} B > eager {e_kept} B", layouts
    return c_peak, e_peak, "", layouts


def _seconds(fn: Callable[[list], Any], vals: list[torch.Tensor], device: torch.device, reps: int = 2) -> float:
    """The best of ``reps`` timed calls of ``fn`` on zero inputs (the inputs made outside the timing)."""
    return _best_of([(fn, vals)], device, reps)[0]


def _best_of(calls: list[tuple[Callable[[list], Any], list[torch.Tensor]]], device: torch.device,
             reps: int) -> list[float]:
    """Each call's best of ``reps`` timings on zero inputs, the calls taken in turn each round, so
    that a burst of other work on the machine falls on all of them alike."""
    best = [float("inf")] * len(calls)
    for _ in range(reps):
        for i, (fn, vals) in enumerate(calls):
            box = _examples(vals, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = CLOCK()
            out = fn(box)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], CLOCK() - started)
            del out
    return best


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
            return (v.storage_offset() == 0 and _dense(v)
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
        eager = _run_module(self.root, members, reads, writes, boxed=True)
        entry = RunReport(self.name, members[0].name, sum(n.op == "call_function" for n in members), compiled=False,
                          random_ops=sum(_random(n) for n in members))
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
        copy = _Restrided([self.traced(r, members).stride() for r in relaid])
        # the copies are time the compiled runs cost beyond their own
        self.report.predicted_saving -= _seconds(copy, [self.laid_out.pop(r) for r in relaid], self.device)
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
        positional = _run_module(self.root, members, reads, writes, boxed=False, calls_aten=True)
        positional.graph.find_nodes(op="output")[0].meta[KEEP_STRIDES] = [
            i for i, w in enumerate(writes) if w in self.keep_strides]
        positional.meta[DONATED] = self.donatable(members, reads, vals)
        entry.donated = len(positional.meta[DONATED])
        started = CLOCK()
        try:
            with torch.no_grad():
                compiled = self.compiler(positional, vals)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager run in place
            first = str(exc).splitlines()[0] if str(exc) else ""
            entry.reason = f"it did not compile ({type(exc).__name__}: {first[:200]})"
            return None
        finally:
            entry.compile_s = CLOCK() - started
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
                    entry.compiled_peak, entry.eager_peak, why, layouts = _check(
                        compiled, _calling_aten(eager), vals, keep, self.device, traced_vals)
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
            # The plan runs this stretch beside `planned - eager_peak` bytes; compiled, it must still fit.
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
                entry.compiled_s, entry.eager_s = _best_of([(compiled, vals), (eager, traced_vals)], self.device,
                                                           TIMING_ROUNDS)
            # (not where its eager code would need copies of values laid out otherwise: they cost
            # memory the plan does not have, and time)
            relaid = any(isinstance(v, torch.Tensor) and v is not t for v, t in zip(vals, traced_vals))
            if SLOWER_MARGIN * entry.eager_s < entry.compiled_s < DOUBTFUL * entry.eager_s and not relaid:
                with torch.no_grad():
                    again = _best_of([(compiled, vals), (eager, traced_vals)], self.device, DOUBT_ROUNDS)
                entry.compiled_s, entry.eager_s = min(entry.compiled_s, again[0]), min(entry.eager_s, again[1])
            if entry.compiled_s > SLOWER_MARGIN * entry.eager_s and not relaid:
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
                if _layout(val) != _layout(traced_of[name]):
                    self.laid_out[name] = val
                    self.report.relaid += 1
            steps = {n.meta["memplan_step"] for n in members if "memplan_step" in n.meta}
            planned_s = sum(self.step_cost[k] for k in steps)
            self.report.predicted_saving += planned_s * (1 - entry.compiled_s / max(entry.eager_s, 1e-9))
        entry.compiled = True
        self.report.runs.append(entry)
        return LayoutGuard(compiled, eager, vals, f"{self.name} run at {members[0].name!r}")


class _Restrided:
    """A Python step: its inputs copied into the given strides, the originals let go."""

    def __init__(self, strides: list[tuple[int, ...]]):
        self.strides = strides

    def __call__(self, box: list) -> tuple[torch.Tensor, ...]:
        values = list(box)
        box.clear()
        out = []
        while values:  # each original is freed once its copy is made
            t = values.pop(0)
            out.append(torch.empty_strided(t.shape, self.strides[len(out)], dtype=t.dtype,
                                           device=t.device).copy_(t))
            del t
        return tuple(out)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill the span they reach, each place once (in some order of dimensions)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that matter: those of dimensions longer than 1 (others never move an index)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


class LayoutGuard:
    """A compiled run that runs only on inputs laid out as it was compiled for.

    Inductor's code asserts its inputs' strides. The layouts come from the capture's fake
    tensors, and an eager kernel may lay out its output otherwise (a CPU convolution choosing
    channels-last, or not): the first call whose inputs differ switches the run to its eager
    twin for good, with a `CompileWarning`."""

    def __init__(self, compiled: Callable[[list], Any], eager: Callable[[list], Any], vals: list[torch.Tensor],
                 where: str):
        self.compiled: Callable[[list], Any] | None = compiled
        self.eager, self.where = eager, where
        self.layouts = [_layout(v) for v in vals]

    def __call__(self, box: list) -> Any:
        if self.compiled is not None:
            if all(_layout(t) == lay for t, lay in zip(box, self.layouts)):
                return self.compiled(box)
            warnings.warn(f"memplan: {self.where} was compiled for other input strides than the step gives it "
                          f"(an eager kernel chose another layout); it runs eagerly from now on", CompileWarning,
                          stacklevel=2)
            self.compiled = None
        return self.eager(box)


def _cut(members: list[fx.Node], seg: _Segmenting) -> int | None:
    """Where to halve a refused run: near its middle, both halves long enough to compile, and no
    multi-output value (a tuple) crossing the cut. None when there is no such place."""
    if len(members) < 2 * MIN_RUN_OPS:
        return None
    middle = len(members) // 2
    for offset in range(len(members)):
        for cut in (middle + offset, middle - offset):
            if MIN_RUN_OPS <= cut <= len(members) - MIN_RUN_OPS and all(
                    _tensor_valued(n) for n in members[:cut] if n.name in seg.escaping(members[:cut])):
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
    body = _items_with_their_op([n for n in nodes[1:-1] if not _is_header(n, box) and n.op != "get_attr"])
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
    for kind, group in _groups(body):
        for members in (_around_escaping_tuples(group, seg.escaping(group)) if kind else [group]):
            compiles = kind and len(members) >= MIN_RUN_OPS and all(
                _tensor_valued(n) for n in members if n.name in seg.escaping(members))
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


def _aliases_its_input(node: fx.Node, alias_root: dict[str, str]) -> list[fx.Node]:
    """The inputs of ``node`` its result may alias: a view's (or in-place op's) argument, by its
    schema; an argument the plan says its value views (``alias_root``: an op whose schema says
    nothing, `aten._unsafe_view`); an item of a tuple (a split's), what the tuple's op aliases;
    none for any other op, whose result is new storage."""
    if node.op != "call_function":
        return []
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _aliases_its_input(node.args[0], alias_root)
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return [a for a, arg in zip(node.args, schema.arguments)
                if isinstance(a, fx.Node) and arg.alias_info is not None]
    value = node.meta.get(VALUE)
    root = alias_root.get(value)
    if root is None or root == value:
        return []
    return [a for a in node.all_input_nodes if alias_root.get(a.meta.get(VALUE)) == root]


def _is_input(node: fx.Node) -> bool:
    """Whether ``node`` is a value a segment is given: an item of its boxed argument list, or a
    copy arriving from the host."""
    return node.op == "call_function" and (node.target is arrive or (
        node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"))


def shared_storage(graph: fx.Graph, alias_root: dict[str, str]) -> dict[str, str]:
    """Each tensor node of a segment's ``graph`` -> a name for the storage it lives in: a view's is
    its argument's; inputs (items of the boxed argument list, copies arriving from the host) that
    view the same value of the plan (``alias_root``: `alias_roots`) share one; any other op's
    result is storage of its own (so a recomputation is not its first computation's)."""
    storage: dict[str, str] = {}
    for node in graph.nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        aliased = [storage[a.name] for a in _aliases_its_input(node, alias_root) if a.name in storage]
        if aliased:
            storage[node.name] = aliased[0]
            # an op aliasing several inputs joins their storages
            for other in aliased[1:]:
                for n, s in storage.items():
                    if s == other:
                        storage[n] = aliased[0]
        elif node.meta.get(VALUE) in alias_root and _is_input(node):
            storage[node.name] = "value:" + alias_root[node.meta[VALUE]]
        else:
            storage[node.name] = node.name
    return storage


def alias_roots(problem: Any) -> dict[str, str]:
    """Each value of ``problem`` -> the value whose storage it views (itself when it views none)."""
    def root(i: int) -> int:
        while problem.alias_of[i] >= 0:
            i = int(problem.alias_of[i])
        return i

    return {str(name): str(problem.names[root(i)]) for i, name in enumerate(problem.names)}


def sharing_storage(roots: dict[str, str], names: list[str]) -> frozenset[str]:
    """``names`` and every value sharing storage with one of them (``roots``: `alias_roots`)."""
    shared = {roots[n] for n in names if n in roots}
    return frozenset(names) | {n for n, r in roots.items() if r in shared}


def held_all_step(problem: Any, sources: list[str]) -> frozenset[str]:
    """The step's sources (parameters, buffers, the batch) and every value that views one (a
    weight's transpose): the model holds their storage all step, however early a run lets go of
    them. A check that freed a carried transpose when the run did saw DistilBERT's compiled
    backward 34 KB under its eager twin; in the step, with the parameters' storage held, it
    peaked 359 KB over it (and over the budget)."""
    return sharing_storage(alias_roots(problem), sources)


def compile_program(program: Any, plan: Any, device: torch.device, compiler: Compiler = inductor_compiler,
                    check: bool = True) -> Any:
    """``program`` (`memplan.runtime.program.Program`, built from ``plan``) with both segments compiled; its
    ``compile_report`` says what was, and the peak the plan now predicts."""
    problem = plan.analysis.lowered.problem
    steps = list(plan.schedule)
    timeline = plan.simulated.timeline
    step_cost = [float(problem.cost[problem.index[node]]) if op == "compute" and node in problem.index else 0.0
                 for op, node in steps]
    held = plan.held_gradient_bytes  # outside the graph's plan: its timeline and budget are without them
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
    for _ in range(COMPILE_PASSES):
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
    if -report.predicted_saving > (STEP_SLOWER_MARGIN - 1) * plan.predicted_time:
        # Inductor's code is not faster everywhere (small convolutions, layouts copied between runs)
        report.eager_instead = (f"compiled, the step was predicted {-report.predicted_saving * 1e3:.2f} ms slower "
                                f"than eager ({sum(r.compiled for r in report.runs)} of {len(report.runs)} runs "
                                "compiled): it runs eagerly")
        report.predicted_peak, report.predicted_saving, report.runs = plan.predicted_peak, 0.0, []
        return dataclasses.replace(program, compile_report=report)
    program = dataclasses.replace(program, forward=forward, backward=backward)
    return dataclasses.replace(program, compile_report=report)
