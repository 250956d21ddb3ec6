"""Which values share a storage, and which the caller holds: what decides that a run may write into
the memory of an input it reads for the last time (donation)."""
from __future__ import annotations
import operator
from typing import Any
import torch
import torch.fx as fx
from memplan.runtime.program import VALUE
from memplan.ops.transfer import arrive


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
