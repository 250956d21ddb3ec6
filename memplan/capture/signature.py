"""What a captured step takes and gives: input signatures (the key a plan is cached under), the tree of
the model's outputs, `Capture` (the joint graph with the map from its placeholders and outputs to the
model's parameters, buffers, inputs and outputs), and the errors capture raises."""
from __future__ import annotations
import collections
import contextlib
import copy
import enum
from dataclasses import dataclass, field
from typing import Any, Callable
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from memplan.passes.output_use import OutputUse


class CaptureError(RuntimeError):
    """The model could not be traced into a joint graph; the message says where and why."""


class DataDependentPython(CaptureError):
    """The forward's Python reads tensor values (a branch, ``.item()``, a shape that depends on
    data): one graph cannot follow it, and ``torch.compile`` splits the model there instead."""


class NothingToDifferentiate(CaptureError):
    """No output of the step requires grad: there is no backward to plan."""


# --------------------------------------------------------------------------- #
# Plain data describing the joint graph's calling convention
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PrimalInfo:
    """One ``primals_*`` placeholder: where its tensor comes from at run time."""

    kind: str  # "param" | "buffer" | "input"
    name: str  # parameter / buffer name, or "input[i]" for the i-th flat input tensor
    index: int  # position within its kind
    requires_grad: bool


@dataclass(frozen=True)
class OutputInfo:
    """One entry of the joint graph's output list."""

    kind: str  # "buffer_update" | "user" | "extra_fw" | "grad"
    index: int  # buffer index / model output index (`OutputTree.sources`) / primal index


@dataclass(frozen=True)
class OutputView:
    """A model output that shares storage with another tensor, as eager returns it.

    The joint graph returns each storage once (a view's base, not the view: one tensor, one
    value, one tangent); the output is remade after the step as the same view of its base,
    so it aliases what it aliased in eager mode (``out.view(...)``, ``logits.split(...)``, a
    slice of an input, the input itself) and costs no copy. ``base`` is ``("output", j)``
    (the graph's j-th model output) or ``("primal", k)`` (the k-th parameter, buffer or
    input, in the capture's primal order)."""

    base: tuple[str, int]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool

    def of(self, base: torch.Tensor) -> torch.Tensor:
        """This view of ``base``: ``base`` itself where the view covers it exactly, as eager
        hands back the very tensor a model returns twice (or returns as its input)."""
        if not self.requires_grad and base.requires_grad:
            base = base.detach()  # eager's output was detached (or made under no_grad)
        if (tuple(base.shape), base.stride(), base.storage_offset()) == (self.size, self.stride, self.storage_offset):
            return base
        return base.as_strided(self.size, self.stride, self.storage_offset)


@dataclass
class OutputTree:
    """How to rebuild the model's (possibly nested) output from the graph's outputs.

    Non-tensor leaves (ints, strings, objects of the model's own classes that
    hold no tensors) are kept verbatim from the trace and passed through.
    Objects of the model's own classes that hold tensors (also inside
    containers, and as the items of a dict subclass) are shallow-copied with
    those parts replaced. ``sources`` says where each tensor leaf comes from:
    the graph's model output of that index, or an `OutputView` (empty: leaf i
    is graph output i).
    """

    spec: Any  # pytree spec over the "opened" output
    leaves: list[Any]  # constants, with None where a tensor leaf goes
    tensor_positions: list[int]  # leaf positions that are tensors
    objects: list[_Opened]  # opened custom objects, indexed by their tags in the tree
    sources: list[int | OutputView] = field(default_factory=list)

    def graph_output_of_leaves(self) -> list[int | None]:
        """Per tensor leaf: the graph output whose storage it is (None: a view of a primal)."""
        if not self.sources:
            return list(range(len(self.tensor_positions)))
        return [s if isinstance(s, int) else s.base[1] if s.base[0] == "output" else None for s in self.sources]

    def rebuild(self, tensors: list[torch.Tensor], primals: list[torch.Tensor] = ()) -> Any:
        """The model's output from the graph's model outputs (and the primals, for views of them)."""
        if self.sources:
            bases = {"output": tensors, "primal": primals}
            tensors = [tensors[s] if isinstance(s, int) else s.of(bases[s.base[0]][s.base[1]]) for s in self.sources]
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_positions, tensors):
            leaves[pos] = t
        return _close_objects(pytree.tree_unflatten(leaves, self.spec), self.objects)


class _ByIdentity:
    """A key part equal only to one made from the very same object.

    It holds the object, so the object's ``id`` cannot be reused by another
    while a plan keyed on it lives.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_VALUE_TYPES = (bool, int, float, complex, str, bytes, type(None), enum.Enum,
                torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)


def _constant_key(leaf: Any, depth: int = 0) -> Any:
    """A hashable key that is equal for two non-tensor input leaves only if one graph serves both.

    The capture runs the forward's Python on the leaf's value and bakes what it
    reads into the graph (a branch on ``cfg.use_b``, the ``dtype`` of a
    ``.to(dtype)``), so a leaf is keyed by its value, never by its type alone:

    * primitives, enums and torch's own value types (dtype, device, Size, ...):
      the value, with its type (``2`` and ``2.0`` trace differently);
    * lists, tuples, dicts and objects with a ``__dict__`` (SimpleNamespace,
      dataclasses, config classes): their type plus their items or
      attributes, keyed the same way, so mutating a config in place replans;
    * other hashable objects that define their own ``__eq__``: the object;
    * everything else (functions, modules, tensors held inside a config,
      structures nested deeper than 6 levels): the object's identity. This
      never reuses a plan for a different object, but it cannot see a change
      made *inside* such an object between calls, and a fresh one (a new
      lambda per call) plans again every call: pass such values as tensors,
      or as plain data, to have them compared by value.
    """
    kind = type(leaf)
    if isinstance(leaf, _VALUE_TYPES):
        return ("C", kind, leaf)
    if depth < 6 and not isinstance(leaf, torch.Tensor):
        if isinstance(leaf, (list, tuple)):
            return ("L", kind, tuple(_constant_key(v, depth + 1) for v in leaf))
        if isinstance(leaf, dict):
            return ("M", kind, tuple((_constant_key(k, depth + 1), _constant_key(v, depth + 1)) for k, v in leaf.items()))
        if hasattr(leaf, "__dict__") and not callable(leaf):
            return ("D", kind, _constant_key(vars(leaf), depth + 1))
    if kind.__eq__ is not object.__eq__ and kind.__hash__ is not None and not isinstance(leaf, torch.Tensor):
        try:
            hash(leaf)
            return ("V", kind, leaf)
        except TypeError:  # a hashable type holding something unhashable
            pass
    return ("I", _ByIdentity(leaf))


@dataclass(frozen=True)
class InputSignature:
    """What a plan depends on: shapes, dtypes, devices of the inputs, plus mode flags."""

    key: tuple

    @staticmethod
    def of(args: tuple, kwargs: dict, training: bool, held_gradient_bytes: int = 0) -> "InputSignature":
        """``held_gradient_bytes``: gradients the parameters already hold when the step starts
        (accumulation): they take part of the budget, so the plan differs."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                parts.append(("T", tuple(leaf.shape), str(leaf.dtype), leaf.device.type, leaf.requires_grad))
            else:
                parts.append(_constant_key(leaf))
        autocast = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
            torch.is_autocast_enabled("cuda") if torch.cuda.is_available() else False,
        )
        return InputSignature(
            (str(spec), tuple(parts), training, torch.is_grad_enabled(), str(autocast), held_gradient_bytes)
        )

    def for_output_use(self, use: OutputUse) -> "InputSignature":
        """This signature, for a step that uses the outputs as ``use`` says: a plan of its own
        (see :mod:`memplan.passes.output_use`)."""
        return InputSignature(self.key + (("output_use", use.key()),)) if use else self


@dataclass
class Capture:
    """The joint forward+backward graph of one model at one input signature."""

    graph_module: fx.GraphModule
    primals: list[PrimalInfo]
    num_tangents: int
    tangent_outputs: list[int]  # for each tangent placeholder: the joint output index it is the gradient of
    outputs: list[OutputInfo]
    output_tree: OutputTree
    input_spec: Any  # pytree spec of (args, kwargs)
    input_constants: list[Any]  # non-tensor input leaves (None where a tensor goes)
    param_names: list[str]
    buffer_names: list[str]
    mutated_buffers: list[int]  # buffer indices whose new values are "buffer_update" outputs
    user_requires_grad: list[bool]  # per model output the graph returns (`OutputTree.sources`)
    signature: InputSignature
    copied_views: list = field(default_factory=list)  # memplan.passes.compaction.CopiedView: views copied out of their storage
    dropouts_split: list = field(default_factory=list)  # memplan.passes.dropout_split.SplitDropout: dropouts now a mask draw and a multiply
    losses_fused: list = field(default_factory=list)  # memplan.passes.loss_fusion.FusedLossBackward: cross-entropy backwards in one buffer
    # Model outputs (graph output indices, `OutputTree.sources`) whose gradient is an addend only
    # (memplan.passes.output_use), and how the step this graph was made for uses the outputs (the
    # no_grad ones have optional tangents).
    addend_only_outputs: frozenset[int] = frozenset()
    output_use: OutputUse = OutputUse()

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def num_ops(self) -> int:
        """ATen ops of the joint graph (its ``call_function`` nodes)."""
        return sum(1 for n in self.graph.nodes if n.op == "call_function")

    def output_nodes(self) -> list[fx.Node | None]:
        (out,) = [n for n in self.graph.nodes if n.op == "output"]
        return list(pytree.tree_leaves(out.args[0], is_leaf=lambda x: x is None))


# --------------------------------------------------------------------------- #
# Output flattening that also opens the model's own objects
# --------------------------------------------------------------------------- #


@dataclass
class _Opened:
    """How to rebuild one output object that pytree cannot see into, once its tensors are new.

    Dataclasses, caches and dict subclasses pytree does not know (HF
    ``ModelOutput`` before transformers registered it: an ``OrderedDict``
    subclass whose fields are both items and attributes) are rebuilt as a
    shallow copy of the traced object with the opened parts replaced.
    """

    template: Any  # the object from the trace
    item_keys: list[Any]  # a dict subclass's keys, in order (every item is opened)
    attrs: list[str]  # attributes that hold tensors, directly or inside containers
    aliases: dict[str, Any]  # attribute -> item key whose value is that very object (ModelOutput's fields)


_OBJECT_TAG = "__memplan_object__"
_MAX_OBJECT_DEPTH = 8  # objects nested deeper (or in a cycle) are left closed, and checked by _hidden_tensor


def _has_tensor_leaf(tree: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(tree))


def _is_plain_object(x: Any) -> bool:
    """An object whose state memplan may open: not a class, not a module (its parameters are not outputs)."""
    return not isinstance(x, (type, torch.nn.Module, torch.Tensor))


def _map_children(node: Any, fn: Callable[[Any], Any]) -> Any:
    """A pytree node with ``fn`` applied to its children: one level, by the node type's own
    flatten and unflatten.

    Not ``pytree.tree_map(fn, node, is_leaf=lambda y: y is not node)``: pytree keeps ``is_leaf``
    in a reference cycle, and the lambda would keep ``node`` (a model's output, with its
    tensors) alive after the caller's last reference, until the next garbage collection.
    """
    node_def = pytree.SUPPORTED_NODES[pytree._get_node_type(node)]
    children, context = node_def.flatten_fn(node)
    return node_def.unflatten_fn([fn(c) for c in children], context)


def _open_objects(tree: Any, objects: list[_Opened]) -> Any:
    """Replace objects pytree cannot see into (dataclasses, caches, dict subclasses) by tagged dicts.

    An attribute is opened wherever it holds tensors, also inside tuples,
    lists or further objects (``past_key_values``: a tuple of tuples): a
    tensor left inside the template would come back as the trace's fake tensor.
    """

    def visit(x: Any, depth: int = 0) -> Any:
        if isinstance(x, torch.Tensor) or x is None or depth > _MAX_OBJECT_DEPTH:
            return x
        if pytree._get_node_type(x) in pytree.SUPPORTED_NODES:
            return _map_children(x, lambda c: visit(c, depth + 1))
        if not _is_plain_object(x):
            return x
        keys = list(x.keys()) if isinstance(x, dict) else []
        items = [visit(dict.__getitem__(x, k), depth + 1) for k in keys]
        item_of = {id(dict.__getitem__(x, k)): k for k in keys}
        attrs: dict[str, Any] = {}
        aliases: dict[str, Any] = {}
        for name, value in (vars(x).items() if hasattr(x, "__dict__") else ()):
            if id(value) in item_of and value is not None:
                aliases[name] = item_of[id(value)]  # one object, reached two ways: keep it one
                continue
            opened = visit(value, depth + 1)
            if _has_tensor_leaf(opened):
                attrs[name] = opened
        if not attrs and not _has_tensor_leaf(items):
            return x
        objects.append(_Opened(x, keys, list(attrs), aliases))
        return {_OBJECT_TAG: len(objects) - 1, "items": items, "attrs": attrs}

    return visit(tree)


def _close_objects(tree: Any, objects: list[_Opened]) -> Any:
    """Inverse of :func:`_open_objects`: shallow-copy each template with its new parts."""

    def visit(x: Any) -> Any:
        if isinstance(x, dict) and _OBJECT_TAG in x:
            return rebuild(objects[x[_OBJECT_TAG]], [visit(v) for v in x["items"]],
                           {k: visit(v) for k, v in x["attrs"].items()})
        if type(x) in (list, tuple):
            return type(x)(visit(v) for v in x)
        if type(x) is dict:
            return {k: visit(v) for k, v in x.items()}
        if pytree._get_node_type(x) in pytree.SUPPORTED_NODES and not isinstance(x, torch.Tensor):
            return _map_children(x, visit)
        return x

    def rebuild(opened: _Opened, items: list[Any], attrs: dict[str, Any]) -> Any:
        template = opened.template
        if isinstance(template, dict):
            # Not copy.copy: an OrderedDict subclass copies by calling cls(), which a
            # dataclass with required fields refuses. No user __setitem__ runs either.
            obj = type(template).__new__(type(template))
            if hasattr(template, "__dict__"):
                obj.__dict__.update(vars(template))
            setitem = collections.OrderedDict.__setitem__ if isinstance(obj, collections.OrderedDict) else dict.__setitem__
            for key, value in zip(opened.item_keys, items):
                setitem(obj, key, value)
        else:
            obj = copy.copy(template)
        for name, value in attrs.items():
            object.__setattr__(obj, name, value)
        for name, key in opened.aliases.items():
            object.__setattr__(obj, name, dict.__getitem__(obj, key))
        return obj

    return visit(tree)


def _hidden_tensor(x: Any, depth: int = 0, seen: set[int] | None = None) -> bool:
    """Whether a constant output leaf still holds a tensor somewhere inside it."""
    seen = set() if seen is None else seen
    if isinstance(x, torch.Tensor):
        return True
    if depth > 2 * _MAX_OBJECT_DEPTH or id(x) in seen or not _is_plain_object(x):
        return False
    seen.add(id(x))
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(_hidden_tensor(v, depth + 1, seen) for v in x)
    if isinstance(x, dict) and any(_hidden_tensor(v, depth + 1, seen) for v in x.values()):
        return True
    slots = [name for cls in type(x).__mro__ for name in getattr(cls, "__slots__", ()) if isinstance(name, str)]
    state = [getattr(x, name, None) for name in slots] + (list(vars(x).values()) if hasattr(x, "__dict__") else [])
    return any(_hidden_tensor(v, depth + 1, seen) for v in state)


def flatten_output(out: Any) -> tuple[list[Any], OutputTree]:
    """Flatten a model output into its tensor leaves and a tree that rebuilds it."""
    objects: list[_Opened] = []
    opened = _open_objects(out, objects)
    leaves, spec = pytree.tree_flatten(opened)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and _hidden_tensor(leaf):
            # Passed through as a constant, it would hand the caller the trace's fake tensors.
            raise CaptureError(
                f"the model's output holds tensors inside a {type(leaf).__name__} that memplan cannot open "
                "(a list or set subclass, __slots__, or nested too deep): return tensors in tuples, lists, dicts, dataclasses or "
                f"plain objects, or register {type(leaf).__name__} with torch.utils._pytree.register_pytree_node"
            )
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    tensors = [leaves[i] for i in positions]
    return tensors, OutputTree(spec, constants, positions, objects)


# --------------------------------------------------------------------------- #
# The capture itself
# --------------------------------------------------------------------------- #


def swapped_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager:
    """A context in which ``model``'s parameters and buffers are ``state``; the originals come back after.

    ``torch.func.functional_call`` with ``tie_weights=True`` swaps a tensor in
    once per name it has (a submodule registered under two parents has two)
    and restores the names in the same order, so the second name puts back
    the first one's replacement: the model keeps the fake tensors of the trace
    as its parameters. Restoring in reverse order (``stack_weights``) puts the
    original back last. What the model holds at each name on exit is written
    back into ``state``.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(model, state, tie_weights=True, strict=False, stack_weights=True)


def call_with_state(model: torch.nn.Module, state: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """``model(*args, **kwargs)`` with its parameters and buffers swapped for ``state`` (`swapped_state`).

    Raises :class:`CaptureError` when the forward assigns a new tensor to a
    parameter or buffer (``self.count = self.count + 1``): the trace would
    drop that update, and the model would silently stop counting.
    """
    before = dict(state)
    with swapped_state(model, state):
        out = model(*args, **kwargs)
    # _reparametrize_module writes what it finds at each name back into ``state``.
    reassigned = [name for name, t in state.items() if t is not before[name]]
    if reassigned:
        raise CaptureError(
            f"the forward assigns a new tensor to {', '.join(map(repr, reassigned[:3]))} "
            "(like `self.count = self.count + 1`), an update memplan's planned step would drop: "
            "update it in place instead (`self.count.add_(1)`, `self.ema.copy_(new)`, under torch.no_grad())"
        )
    return out
