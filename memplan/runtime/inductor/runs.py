"""Cutting a segment into runs: maximal stretches of pure, deterministic ATen ops that no Python step
interrupts, each handed on as an fx module of its own."""
from __future__ import annotations
import operator
from typing import Any
import torch
import torch.fx as fx
from memplan.ops.kernels import aten_target, with_aten_targets
from memplan.runtime.program import Replay, clear_box


def is_header(node: fx.Node, box: fx.Node) -> bool:
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


def is_random_op(node: fx.Node) -> bool:
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
    earlier = {n for n in run if is_random_op(n)}
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
                     if (is_random_op(n) and not _draws_whatever_the_layout(n))
                     or (n.op == "call_module" and isinstance(root.get_submodule(n.target), Replay))
                     for i in n.all_input_nodes if tensor_valued(i))


def tensor_valued(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def grouped_runs(nodes: list[fx.Node]) -> list[tuple[bool, list[fx.Node]]]:
    """Cut ``nodes`` (schedule order) into maximal runs: (compilable, nodes)."""
    groups: list[tuple[bool, list[fx.Node]]] = []
    members: set[fx.Node] = set()
    for node in nodes:
        # an item of a multi-output value stays with the op that made it, compiled or not
        kind = groups[-1][0] if node.target is operator.getitem and node.args[0] in members else _compilable(node)
        if is_random_op(node):
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


def around_escaping_tuples(run: list[fx.Node], escaping: list[str]) -> list[list[fx.Node]]:
    """``run`` cut around each multi-output op whose tuple is read after it (by the segment's
    output: the backward takes a dropout's mask from the tuple the forward carries). A compiled run
    hands on tensors only, so that op and its items run eagerly; the stretches on either side may
    still compile (ViT at 50%: a 149-op run ran eagerly for one dropout's tuple)."""
    pieces: list[list[fx.Node]] = [[]]
    tuples = {n for n in run if n.name in escaping and not tensor_valued(n)}
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


def items_with_their_op(body: list[fx.Node]) -> list[fx.Node]:
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


def run_module(root: torch.nn.Module, nodes: list[fx.Node], reads: list[str], writes: list[str],
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


def calling_aten(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` calling the ATen ops themselves, not their stand-ins (`memplan.ops.kernels`): the code the
    plan's timeline and its kernels' measured scratch describe, which a compiled run is checked
    against (a dropout compiled calls the op's own kernel, with its scratch)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    with_aten_targets(graph)
    return fx.GraphModule(gm, graph)
