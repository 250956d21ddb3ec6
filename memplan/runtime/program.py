"""Execute a ``solvers.Schedule`` over a joint graph as straight-line code.

The schedule is cut at its ``BACKWARD`` step into two segments. Each segment
becomes an ``fx.Graph`` holding one node per compute step, in schedule order
(a recomputation is simply a second copy of the node), and torch.fx generates
its Python code, which frees every value right after its last use (an op
with a faster exact kernel on the device, `memplan.ops.kernels`, calls that). The
forward segment returns the model's outputs, the buffer updates and the
values the backward segment reads; the backward segment returns gradients.

Both segments take their inputs "boxed" (one list, cleared on entry) so that
a value carried from forward to backward dies at its last use in backward,
not when the call returns.

``offload`` steps copy a value to host memory (``host:<name>`` in the
generated code) and ``prefetch`` steps copy it back; the copy is carried
across the cut like any other value. On CUDA the copies run on two side
streams (one per direction) into pinned host buffers: a copy waits for the
compute issued before it, a read of a prefetched value waits for its copy
(an event), and ``record_stream`` keeps the allocator from reusing a buffer
while a copy still uses it. On CPU the host copy is a clone whose storage
`memplan.measure.tracker` counts as host memory, so accounting is tested there.

:class:`PlannedStep` is the ``autograd.Function`` that runs the two segments.
"""
from __future__ import annotations

import operator
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

import solvers
from solvers.transforms.ordering import storage_readers
from memplan.capture.signature import Capture
from memplan.ops.kernels import eager_kernel, use_stand_ins
from memplan.updates.names import GRADS_FINAL, NORM_FINAL, NORM_PASS_PREFIX, SQUARE_PREFIX
from memplan.updates.runner import GradClip, UpdateRunner
from memplan.planning.lowering import BACKWARD, RNG_PREFIX, Lowered, is_reference
from memplan.core.storage import value_device
from memplan.ops.transfer import arrive, offload, prefetch
from memplan.runtime.handout import GradientHandout, handout_groups


@dataclass
class Segment:
    """One generated function and the names of what it reads and returns."""

    module: fx.GraphModule
    inputs: list[str]  # names, in the order of the boxed argument list
    outputs: list[str]  # names, in the order of the returned tuple

    def __call__(self, args: list[Any]) -> tuple[Any, ...]:
        return self.module(args)


@dataclass
class Program:
    """A schedule lowered to two runnable segments plus the calling convention."""

    forward: Segment
    backward: Segment
    user_outputs: list[str]  # fx names of the model's tensor outputs, in leaf order
    buffer_updates: list[tuple[int, str]]  # (buffer index, fx name of its new value)
    carried: list[str]  # names forward returns for backward (after outputs and updates)
    grad_outputs: list[str | None]  # per primal: fx name of its gradient, or None
    tangents_for_user: list[int | None]  # per user output: its tangent index, or None
    # Per gradient in `grad_outputs` (the non-None ones, in order): the tangent indices it
    # depends on. One whose tangents all come from outputs the loss does not use is None, as
    # eager autograd leaves it (an optimizer then skips the parameter, weight decay included).
    grad_tangents: list[frozenset[int]]
    # Tangents that may be None (memplan.passes.output_use): the plan was made for a backward
    # without them. Any other tangent whose output gets no gradient is passed as zeros.
    optional_tangents: frozenset[int] = frozenset()
    # Called at each backward with the user outputs (indices) that got no gradient and those
    # the caller no longer held: how memplan.frontend.module learns how the step uses the outputs.
    observer: Callable[[frozenset[int], frozenset[int]], None] | None = None
    # The optimizer updates backward applies (memplan.updates.probe): the runner the backward segment
    # calls, and per update slot the tangent indices its gradient depends on (as grad_tangents).
    updater: UpdateRunner | None = None
    update_tangents: list[frozenset[int]] = field(default_factory=list)
    # With compile=True: what memplan.runtime.inductor.segments compiled of the two segments (its CompileReport).
    compile_report: Any = None
    # Under a distributed engine (`memplan.runtime.handout`): what hands the parameters' gradients
    # to autograd as backward makes them final; the primals it serves get None from backward.
    handout: GradientHandout | None = None
    # Primals (parameters) the step gives no gradient, passed detached under a distributed engine.
    no_gradient: frozenset[int] = frozenset()


# A segment node's meta key: the name of the plan's value it makes.
VALUE = "memplan_value"
HOST_PREFIX = "host:"


def host_name(value: str) -> str:
    """The name of ``value``'s host copy in the generated code."""
    return HOST_PREFIX + value


def _split(schedule: solvers.Schedule) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    steps = [(op, str(node)) for op, node in schedule]
    for i, (op, node) in enumerate(steps):
        if op == "compute" and node == BACKWARD:
            return steps[:i], steps[i + 1 :]
    raise ValueError("schedule never computes the backward barrier")


def clear_box(box: list) -> None:
    """Drop the caller's references to the inputs (the boxed calling convention)."""
    box.clear()


def generator_state(device: str | torch.device) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    """Get and set the state of the default generator of ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return (lambda: torch.cuda.get_rng_state(dev)), (lambda state: torch.cuda.set_rng_state(state, dev))
    return torch.get_rng_state, torch.set_rng_state


def _rng_state(device: str) -> torch.Tensor:
    """The generator state a random op is about to draw from."""
    return generator_state(device)[0]()


class Replay(torch.nn.Module):
    """Run a random op again from the generator state of its first run, then restore the generator."""

    def __init__(self, target: Any, device: str):
        super().__init__()
        self.target = target
        self.get_state, self.set_state = generator_state(device)

    def forward(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        saved = self.get_state()
        self.set_state(state)
        try:
            return self.target(*args, **kwargs)
        finally:
            self.set_state(saved)


def _build_segment(
    steps: list[tuple[str, str]],
    low: Lowered,
    available: list[str],
    outputs: list[str],
    constants: torch.nn.Module,
    computed: set[str],
    updater: UpdateRunner | None = None,
    first_step: int = 0,
    replayed: frozenset[str] = frozenset(),
    timeline: Any = None,
    handout: tuple[GradientHandout, list[tuple[int, list[str]]]] | None = None,
) -> Segment:
    """Generate one segment: boxed inputs ``available``, compute steps in order, return ``outputs``.

    Only inputs that are read are unpacked. ``free`` steps need no code: fx's
    codegen drops each value after its last use, which is never later than
    the schedule's own free. ``computed`` holds the random ops already run
    (by an earlier segment); it is updated; ``replayed`` names those the schedule runs
    again, whose first run saves the generator state the replays draw from. Each node made
    for a step records that step's index in the whole schedule (``steps[0]`` is step
    ``first_step``) as ``meta["memplan_step"]``: where the simulator's timeline says how much
    memory the step runs beside (`memplan.runtime.inductor.segments`); with the plan's ``timeline``, ops below its
    peak may run in place (`memplan.ops.kernels.use_stand_ins`). ``handout``: the `GradientHandout` and, per
    group in order, the index in ``steps`` after which its gradients (named) are all made.
    """
    fx_nodes = low.fx_nodes
    root = torch.nn.Module()
    graph = fx.Graph()
    box = graph.placeholder("args_list")
    env: dict[str, fx.Node] = {}
    needed = _reads(steps, low) | set(outputs) | {g for _, grads in (handout[1] if handout else []) for g in grads}
    for i, name in enumerate(available):
        if name in needed:
            # named after the value, so the generated code reads like the joint graph
            env[name] = _made(name, graph.create_node("call_function", operator.getitem, (box, i),
                                                      name=_identifier(name)))
            _copy_meta(env[name], name, low)
    graph.call_function(clear_box, (box,))

    arriving: dict[str, fx.Node] = {}  # prefetched values not read yet
    # Update node -> the slots of its bucket and their gradients: one optimizer call each.
    grads_of = low.bucket_grads
    update_slot = {update: (slots, grads_of[update]) for update, slots in low.buckets.items()}
    if update_slot and updater is not None:
        root.updater = updater
        if updater.max_norm is not None:
            root.clip = GradClip(updater)

    def value(name: str) -> fx.Node:
        if name in arriving:  # the first read waits for the copy
            env[name] = _made(name, graph.call_function(arrive, (arriving.pop(name),), name=_identifier(name)))
            _copy_meta(env[name], name, low)
        return env[name]

    def arg(n: fx.Node) -> fx.Node:
        if n.op == "get_attr":
            setattr(root, n.target, getattr(constants, n.target))
            return graph.get_attr(n.target)
        return value(n.name)

    def pass_arg(n: fx.Node) -> fx.Node:
        copy = NORM_PASS_PREFIX + n.name
        return value(copy) if copy in low.norm_pass else arg(n)

    square_of = {SQUARE_PREFIX + update: (slots, [low.norm_pass_value(g) for g in grads])
                 for update, (slots, grads) in update_slot.items()} if low.norm_pass else {}

    pending = list(handout[1]) if handout is not None else []
    if handout is not None:
        root.handout = handout[0]

    def hand_out(up_to: int) -> None:  # the groups whose last gradient is made at or before step up_to
        while pending and pending[0][0] <= up_to:
            _, grads = pending.pop(0)
            group = len(handout[1]) - len(pending) - 1
            graph.call_module("handout", (group, [value(g) for g in grads]))

    for k, (op, name) in enumerate(steps, start=first_step):
        hand_out(k - first_step - 1)
        _mark_step(graph, k)
        if op in ("offload", "prefetch"):
            if name not in fx_nodes:  # bookkeeping values have no tensor to copy
                raise ValueError(f"memplan runtime: cannot {op} {name!r}: it is not a value of the graph")
            if op == "offload":
                env[host_name(name)] = graph.call_function(offload, (value(name),),
                                                           name=_identifier(host_name(name)))
            else:
                env.pop(name, None)
                arriving[name] = graph.call_function(prefetch, (env[host_name(name)],),
                                                     name=_identifier(f"arriving_{name}"))
            continue
        if op == "compute" and name in update_slot:
            slots, grads = update_slot[name]
            graph.call_module("updater", (slots, [value(g) for g in grads]))
            continue
        if op == "compute" and name == GRADS_FINAL and hasattr(root, "clip"):
            # every gradient is final: the global norm, and the clip, before the first update
            graph.call_module("clip", ([value(grad) for _, grad, _ in low.updates],))
            continue
        if op == "compute" and name in square_of:  # a norm pass's gradient: its square joins the norm
            slots, grads = square_of[name]
            graph.call_method("square", (graph.get_attr("clip"), slots, [value(g) for g in grads]))
            continue
        if op == "compute" and name == NORM_FINAL:
            graph.call_method("by_norm", (graph.get_attr("clip"),))
            continue
        if op == "compute" and name in low.norm_pass:  # the backward value again, from the pass's own inputs
            env[name] = _made(name, graph.node_copy(fx_nodes[name], pass_arg))
            continue
        if op != "compute" or name not in fx_nodes or fx_nodes[name].op == "placeholder":
            continue
        node = fx_nodes[name]
        rng = low.rng_of.get(name)
        if rng is None:
            env[name] = _made(name, graph.node_copy(node, arg))
        elif name not in computed:
            if name in replayed:  # first run of a replayed op: remember the generator state it draws from
                env[rng] = graph.create_node("call_function", _rng_state, (str(value_device(node)),),
                                             name=_identifier(rng))
            # (an op never replayed saves nothing: no Python step between it and the ops around it,
            # which a compiled run can then take in one piece)
            env[name] = _made(name, graph.node_copy(node, arg))
            computed.add(name)
        else:
            replay = f"replay_{node.name}"
            setattr(root, replay, Replay(eager_kernel(node), str(value_device(node))))
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), arg)
            env[name] = _made(name, graph.call_module(replay, (env[rng], *args), kwargs))
            env[name].meta["val"] = node.meta.get("val")  # what the runs that read it are compiled for
    hand_out(len(steps))
    _mark_step(graph, first_step + len(steps))
    graph.output(tuple(value(name) for name in outputs))
    use_stand_ins(graph, timeline)
    graph.lint()
    return Segment(fx.GraphModule(root, graph), list(available), list(outputs))


def _made(name: str, node: fx.Node) -> fx.Node:
    """``node``, marked as making the plan's value ``name`` (a recomputation's node is named apart)."""
    node.meta[VALUE] = name
    return node


def _mark_step(graph: fx.Graph, step: int) -> None:
    """Record on the nodes made since the last mark that they were made for schedule step ``step - 1``."""
    node = graph._root.prev  # the newest node
    while node.op != "root" and "memplan_step" not in node.meta:
        node.meta["memplan_step"] = step - 1
        node = node.prev


def _copy_meta(node: fx.Node, name: str, low: Lowered) -> None:
    """Give a segment's input (or an arrived copy) the joint graph's metadata of its value (its
    fake ``val``), as ``node_copy`` gives computed nodes: `memplan.runtime.inductor.segments` reads layouts from it."""
    source = low.fx_nodes.get(name.removeprefix(NORM_PASS_PREFIX))
    if source is not None:
        node.meta.update(source.meta)


def _identifier(name: str) -> str:
    return name.replace(":", "_").replace("@", "_")


def _reads(steps: list[tuple[str, str]], low: Lowered) -> set[str]:
    reads: set[str] = set()
    grads_of_update = low.bucket_grads
    for op, name in steps:
        if op == "compute" and name in low.norm_pass:
            reads.update(low.norm_pass_value(i.name) for i in low.fx_nodes[name].all_input_nodes)
            continue
        if op == "compute" and name.startswith(SQUARE_PREFIX):
            reads.update(low.norm_pass_value(grad) for grad in grads_of_update[name[len(SQUARE_PREFIX):]])
            continue
        if op == "compute" and name in grads_of_update:
            reads.update(grads_of_update[name])
        elif op == "compute" and name == GRADS_FINAL:  # a clipping step reads every applied gradient
            reads.update(grad for _, grad, _ in low.updates)
        if op == "prefetch":
            reads.add(host_name(name))
        elif op == "offload":
            reads.add(name)
        if op == "compute" and name in low.fx_nodes:
            reads.update(i.name for i in low.fx_nodes[name].all_input_nodes)
            if name in low.rng_of:
                reads.add(low.rng_of[name])
    return reads


def build_program(cap: Capture, low: Lowered, schedule: solvers.Schedule,
                  updater: UpdateRunner | None = None, timeline: Any = None, handout_bytes: int | None = None) -> Program:
    """Turn a validated schedule into a :class:`Program`; ``updater`` applies the optimizer
    updates of ``low`` (`memplan.updates.probe`) where the schedule computes them; ``timeline`` (the
    simulator's memory at each step) keeps the step's peak the one predicted (`memplan.ops.kernels`):
    without it, every op whose input dies there may run in place. ``handout_bytes``: hand the
    parameters' gradients to autograd in groups of about that many bytes as the schedule makes
    them final (`memplan.runtime.handout`; a distributed engine's buckets), not at backward's end."""
    fw_steps, bw_steps = _split(schedule)
    if low.updates and updater is None:
        raise ValueError("memplan runtime: the plan updates parameters, but no UpdateRunner was given")
    _check_no_read_after_update(low, bw_steps)
    out_nodes = cap.output_nodes()
    user_outputs: list[str] = []
    buffer_updates: list[tuple[int, str]] = []
    grad_outputs: list[str | None] = [None] * len(cap.primals)
    for info, node in zip(cap.outputs, out_nodes):
        name = node.name if isinstance(node, fx.Node) else None
        if info.kind == "user":
            user_outputs.append(name)
        elif info.kind == "buffer_update":
            buffer_updates.append((info.index, name))
        elif info.kind == "grad":
            grad_outputs[info.index] = name
    applied = {grad for _, grad, _ in low.updates}  # gradients backward applies instead of returning
    handout = None
    no_gradient = frozenset()
    if handout_bytes is not None:
        # A parameter the step gives no gradient keeps no autograd edge to the step: a distributed
        # engine that looks for unused parameters (DDP's find_unused_parameters) finds it unused,
        # as it does in eager autograd, and marks it ready itself.
        no_gradient = frozenset(i for i, (info, g) in enumerate(zip(cap.primals, grad_outputs))
                                if info.kind == "param" and info.requires_grad and g is None)
        handout = _handout_plan(cap, low, bw_steps, grad_outputs, handout_bytes)
        handed = set(handout[0].primals)
        handed_grads = [grad_outputs[i] for i in handout[0].primals]
        handout[0].tangents = tangents_reaching(cap.graph_module, low.tangents, handed_grads)
        _check_updates_after_handout(low, bw_steps, handout[1], clipping=updater is not None and updater.max_norm is not None)
        grad_outputs = [None if i in handed else g for i, g in enumerate(grad_outputs)]
    grad_outputs = [None if g in applied else g for g in grad_outputs]

    # Resident at the cut: computed in forward and not freed there.
    resident: dict[str, None] = dict.fromkeys(low.sources)
    for op, name in fw_steps:
        if op in ("compute", "prefetch"):
            resident[name] = None
        elif op == "free":
            resident.pop(name, None)
        elif op == "offload":
            resident[host_name(name)] = None  # host copies are never freed within the step
    bw_reads = _reads(bw_steps, low) | {g for g in grad_outputs if g is not None} | applied
    if handout is not None:  # (a gradient made in forward is carried to its handout)
        bw_reads |= {g for _, grads in handout[1] for g in grads}
    computed: set[str] = set()
    runs = Counter(name for op, name in fw_steps + bw_steps if op == "compute" and name in low.rng_of)
    replayed = frozenset(name for name, count in runs.items() if count > 1)
    # A generator state exists once its op has run; one whose op first runs in backward is made there.
    rng_made_in_forward = {low.rng_of[name] for op, name in fw_steps if op == "compute" and name in low.rng_of}
    carried = [
        n
        for n in resident
        if n in bw_reads
        and n not in low.tangents
        and not is_reference(n)
        and (not n.startswith(RNG_PREFIX) or n in rng_made_in_forward)
    ]
    fw_outputs = list(user_outputs) + [name for _, name in buffer_updates] + carried
    constants = cap.graph_module
    forward = _build_segment(fw_steps, low, low.sources, fw_outputs, constants, computed, replayed=replayed,
                             timeline=timeline)
    bw_outputs = [g for g in grad_outputs if g is not None]
    backward = _build_segment(bw_steps, low, carried + low.tangents, bw_outputs, constants, computed, updater,
                              first_step=len(fw_steps) + 1, replayed=replayed, timeline=timeline, handout=handout)

    tangent_of_output = {out_idx: t for t, out_idx in enumerate(cap.tangent_outputs)}
    user_joint_index = [i for i, info in enumerate(cap.outputs) if info.kind == "user"]
    tangents_for_user = [tangent_of_output.get(j) for j in user_joint_index]
    grad_tangents = tangents_reaching(cap.graph_module, low.tangents, bw_outputs)
    optional = frozenset(tangents_for_user[i] for i in cap.output_use.no_grad)
    update_tangents = tangents_reaching(cap.graph_module, low.tangents, [grad for _, grad, _ in low.updates])
    return Program(forward, backward, user_outputs, buffer_updates, carried, grad_outputs, tangents_for_user,
                   grad_tangents, optional, updater=updater if low.updates else None, update_tangents=update_tangents,
                   handout=handout[0] if handout is not None else None, no_gradient=no_gradient)


def _handout_plan(cap: Capture, low: Lowered, bw_steps: list[tuple[str, str]], grad_outputs: list[str | None],
                  cap_bytes: int) -> tuple[GradientHandout, list[tuple[int, list[str]]]]:
    """The `GradientHandout` of the trainable parameters' gradients, grouped in the order
    ``bw_steps`` makes them (`handout_groups`), and per group the step after which it goes out."""
    # A gradient the plan frees and computes again (cheaper than holding it through the peak)
    # goes out after its last computation: the one the plan holds.
    made_at = {name: k for k, (op, name) in enumerate(bw_steps) if op == "compute"}
    # a gradient the backward segment does not compute (an input passed through) goes out at its end
    order = sorted(((made_at.get(g, len(bw_steps)), i, g) for i, (info, g) in enumerate(zip(cap.primals, grad_outputs))
                    if g is not None and info.kind == "param"))
    nbytes = {g: _value_bytes(low, g) for _, _, g in order}
    groups = handout_groups([(i, nbytes[g]) for _, i, g in order], cap_bytes)
    grad_of = {i: g for _, i, g in order}
    at = {i: k for k, i, _ in order}
    return GradientHandout(groups), [(max(at[i] for i in group), [grad_of[i] for i in group]) for group in groups]


def _check_updates_after_handout(low: Lowered, bw_steps: list[tuple[str, str]],
                                 groups: list[tuple[int, list[str]]], clipping: bool) -> None:
    """Under a distributed engine every update (and a clip) steps with the engine's reduced gradients,
    complete only once the last group is out: refuse a schedule that runs one before (a gradient the
    plan freed and computed again after the updates began)."""
    if not groups or not low.updates:
        return
    last = max(at for at, _ in groups)
    early = [name for k, (op, name) in enumerate(bw_steps)
             if op == "compute" and k <= last and (name in low.buckets or (clipping and name == GRADS_FINAL))]
    if early:
        raise ValueError(f"memplan runtime: {early[0]!r} runs before the last gradients go to the distributed engine "
                         f"(step {last}): it would step with gradients not yet reduced")


def _value_bytes(low: Lowered, name: str) -> int:
    """Bytes of the graph value ``name`` (its fake tensor's), 0 when it has none."""
    val = low.fx_nodes[name].meta.get("val") if name in low.fx_nodes else None
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _check_no_read_after_update(low: Lowered, bw_steps: list[tuple[str, str]]) -> None:
    """An update overwrites its parameter in place: a compute that reads the parameter after it
    would see the new values. Planning moves updates after their parameters' last reads
    (`memplan.planning.lowering.updated_after_reads`); this refuses a schedule where that does not hold."""
    problem, names = low.problem, low.problem.names
    # A view of a parameter (its transpose) shares the parameter's storage: reading it reads the parameter.
    readers = {update: {str(names[v]) for param in params for v in storage_readers(problem, problem.index[param])}
               for update, params in low.parameter_writes.items()}
    overwritten: set[str] = set()
    for op, name in bw_steps:
        if op != "compute":
            continue
        if name in readers:
            overwritten |= readers[name]
        elif name in low.fx_nodes and overwritten and name not in overwritten:  # a view reads nothing
            read = overwritten.intersection(i.name for i in low.fx_nodes[name].all_input_nodes)
            if read:
                raise ValueError(f"memplan runtime: {name!r} reads {sorted(read)[0]!r} after the update that "
                                 "overwrites it")


def tangents_reaching(gm: fx.GraphModule, tangents: list[str], outputs: list[str]) -> list[frozenset[int]]:
    """For each node named in ``outputs``: the indices (in ``tangents``) of the tangent
    placeholders among its ancestors in ``gm``."""
    index = {name: i for i, name in enumerate(tangents)}
    reach: dict[str, int] = {}  # node -> bit set of tangent indices
    for node in gm.graph.nodes:
        bits = 1 << index[node.name] if node.name in index else 0
        for inp in node.all_input_nodes:
            bits |= reach.get(inp.name, 0)
        reach[node.name] = bits
    return [frozenset(i for i in range(len(tangents)) if reach.get(name, 0) >> i & 1) for name in outputs]


class PlannedStep(torch.autograd.Function):
    """Forward runs the forward segment; backward runs the rest of the schedule.

    Values carried to backward live in a plain list on ``ctx`` (so backward can
    drop each at its last use), detached, so that none of them links back to an
    output's autograd graph (a detached alias of an output breaks the output ->
    grad_fn -> ctx reference cycle as ``save_for_backward`` would). The user
    outputs among them are not saved with ``save_for_backward``: autograd holds
    a saved tensor until backward returns, past the last use the plan frees it
    at, which a plan for a caller that drops the output does not count (a
    block's output carried into its backward, 256 KB over the plan). Their
    version counters, shared with the detached aliases, are checked instead, as
    autograd checks saved tensors. Outputs are held by weak references only:
    one the caller drops before backward is freed at its last use in the plan
    (there, if the plan does not carry it), and backward sees that it was dropped.
    """

    @staticmethod
    def forward(ctx, program: Program, buffers: list[torch.Tensor], *primals: torch.Tensor):
        # The graph already holds autocast's casts; autocast must not cast again.
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            results = program.forward(list(primals))
        n_out, n_upd = len(program.user_outputs), len(program.buffer_updates)
        outputs = results[:n_out]
        if n_upd:
            # One foreach copy for all of them: a ResNet-50 has 159 (BatchNorm's running statistics
            # and counters), each a tiny tensor whose copy costs little more than its dispatch.
            with torch.no_grad():
                torch._foreach_copy_([buffers[b_idx] for b_idx, _ in program.buffer_updates],
                                     list(results[n_out : n_out + n_upd]))
        carried = list(results[n_out + n_upd :])
        output_ids = {id(o): i for i, o in enumerate(outputs)}
        ctx.program = program
        # the parameters the backward hands their gradients to (the primals hold them for the call only)
        ctx.handout_params = [primals[i] for i in program.handout.primals] if program.handout is not None else None
        ctx.carried = [v.detach() if isinstance(v, torch.Tensor) else v for v in carried]
        # (position in carried, version) of each carried user output: the caller may change one in place
        ctx.output_versions = [(k, v._version) for k, v in enumerate(carried) if id(v) in output_ids]
        # (shape, strides, dtype, device): what a zero gradient for each output looks like
        ctx.output_layouts = [(o.shape, o.stride(), o.dtype, o.device) for o in outputs]
        ctx.output_refs = [weakref.ref(o) for o in outputs]
        non_diff = [o for o, t in zip(outputs, program.tangents_for_user) if t is None]
        ctx.mark_non_differentiable(*non_diff)
        # Autograd would otherwise hand backward a zero tensor for every non-differentiable
        # output: memory no plan counts. Backward makes zeros only where the graph reads them.
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        if ctx.carried is None:
            raise RuntimeError("memplan: backward through the same planned step twice is not supported")
        program: Program = ctx.program
        box = ctx.carried
        ctx.carried = None  # from here on, `box` holds the only references
        for k, version in ctx.output_versions:
            if box[k]._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: an output of the memplan step (shape {tuple(box[k].shape)}) is at version "
                    f"{box[k]._version}; expected version {version} instead")
        dropped = frozenset(i for i, ref in enumerate(ctx.output_refs) if ref() is None)
        tangent_slots: list[Any] = [None] * sum(t is not None for t in program.tangents_for_user)
        given: set[int] = set()  # tangents the loss reached
        for out_idx, t_idx in enumerate(program.tangents_for_user):
            if t_idx is not None:
                grad = grad_outputs[out_idx]
                if grad is not None:
                    given.add(t_idx)
                    tangent_slots[t_idx] = grad
                elif t_idx not in program.optional_tangents:
                    # an output the loss does not use: the zeros autograd would have made (the Problem counts them)
                    tangent_slots[t_idx] = _zeros_shaped_like(*ctx.output_layouts[out_idx])
        if program.observer is not None:
            program.observer(frozenset(i for i, t in enumerate(program.tangents_for_user)
                                       if t is not None and t not in given), dropped)
        box.extend(tangent_slots)
        del tangent_slots
        if program.updater is not None:
            program.updater.begin(frozenset(slot for slot, needs in enumerate(program.update_tangents)
                                            if _unreached(needs, given)))
        if program.handout is not None:
            program.handout.begin(ctx.handout_params, frozenset(
                i for i, needs in zip(program.handout.primals, program.handout.tangents) if _unreached(needs, given)))
        results = program.backward(box)
        if program.handout is not None:
            program.handout.finish()
        if program.updater is not None:
            program.updater.finish()
        grads = [None if _unreached(needs, given) else g
                 for g, needs in zip(results, program.grad_tangents, strict=True)]
        del results
        per_primal = []
        it = iter(grads)
        for g in program.grad_outputs:
            per_primal.append(next(it) if g is not None else None)
        return (None, None, *per_primal)


def _unreached(needs: frozenset[int], given: set[int]) -> bool:
    """A gradient that depends on tangents (``needs``) none of which the loss sent (``given``):
    eager autograd gives it none (the parameter keeps ``.grad`` None, an optimizer skips it)."""
    return bool(needs) and not needs & given


def _zeros_shaped_like(shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """``torch.zeros_like`` of a tensor with this layout, without holding the tensor."""
    return torch.zeros_like(torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device=device)


def run_program(program: Program, buffers: list[torch.Tensor], primals: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Apply the planned step to flat primals; returns the user outputs (differentiable)."""
    if program.no_gradient:
        primals = [p.detach() if i in program.no_gradient else p for i, p in enumerate(primals)]
    return PlannedStep.apply(program, buffers, *primals)
