"""Trace a model's forward and backward into one ATen-level joint ``torch.fx`` graph.

Why AOTAutograd's ``partition_fn`` seam (and not ``make_fx`` over a step that
calls ``torch.autograd.grad``): ``make_fx`` sees in-place ops (``relu_``,
BatchNorm's running-stat ``add_``) as mutations in the graph, and
``torch.func.functionalize`` refuses to run autograd inside it. AOTAutograd
functionalizes the joint graph for us, turns buffer mutations into extra
forward outputs (applied once, outside the graph), handles tied parameters and
aliased outputs, and hands the joint graph to the partitioner with
``primals_*`` / ``tangents_*`` placeholders on every torch release since 2.0.
We capture it there and abort the rest of the compile.

Everything runs under a ``FakeTensorMode``: no activation (and, for a model
built on the meta device, no parameter) is ever allocated.

The one job of this module: produce a :class:`Capture`, the joint graph plus
the map from its placeholders and outputs to the model's parameters, buffers,
inputs and outputs.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import enum
import functools
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.passes.compaction import copy_out_late_views
from memplan.passes.dropout_split import split_dropouts
from memplan.passes.loss_fusion import fuse_cross_entropy_backward
from memplan.passes.output_use import OutputUse, addend_only, make_tangents_optional
from memplan.core.storage import storage_key


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


def _primal_label(i: int, param_names: list[str], n_b: int) -> str:
    return param_names[i] if i < len(param_names) else f"input tensor {i - len(param_names) - n_b}"


def _mutated_inputs(call: Callable[[tuple], Any], flat: tuple[torch.Tensor, ...], fake_mode: FakeTensorMode) -> list[int]:
    """Indices of the flat inputs whose data one forward writes to.

    Runs the forward once under functionalization, as AOTAutograd does to
    collect its own metadata: neither version counters nor op schemas catch
    every write (``native_batch_norm`` updates running statistics without
    declaring it), functionalization does.
    """
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    # cuDNN's batch norm writes the running statistics without functionalization seeing it (on
    # an H200 with torch 2.11 only the step counters came out as written, while AOTAutograd's
    # own trace found all three per layer); the native kernel writes the same buffers, visibly.
    with fake_mode, torch.backends.cudnn.flags(enabled=False):
        mode = FunctionalTensorMode()
        with mode:
            wrapped = tuple(FunctionalTensor.to_functional(t) for t in flat)
        with mode, torch.enable_grad():
            call(wrapped)
        return [i for i, w in enumerate(wrapped) if torch._functionalize_has_data_mutation(w.elem)]


class _Captured(Exception):
    """Raised from the partitioner to stop AOTAutograd once the joint graph is in hand."""


def fakeify(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor under ``fake_mode`` standing for ``t`` in a trace (or the eager replay of
    `memplan.planning.analysis`): same shape, strides and dtype, a leaf even where ``t`` is not, and
    on the CPU where ``t`` is a meta tensor."""
    if t.grad_fn is not None:
        # A non-leaf input (another module's output) is a leaf of the traced
        # step: its history lies outside it, and a backward (the eager replay's)
        # must stop there instead of reaching into the fake of that history.
        return fakeify(fake_mode, t.detach()).requires_grad_(True)
    if t.is_meta:
        # A meta tensor (a model built on the meta device, to plan it without
        # memory) is traced as a CPU tensor of the same shape: meta kernels are
        # not the CPU's (some lack autograd formulas, and the joint graph comes
        # out without a backward).
        with fake_mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return fake.requires_grad_(True) if t.requires_grad else fake
    fake = fake_mode.from_tensor(t, static_shapes=True)
    return fake


class MetaConstantsAsCPU(torch.overrides.TorchFunctionMode):
    """Swap the meta tensors a model holds outside its state for CPU zeros while tracing.

    A model built on the meta device plans as a CPU model (see :func:`fakeify`),
    but tensors it holds outside its parameters, buffers and inputs (a loss
    closure's labels, a plain tensor attribute) reach the trace as they are.
    Tracing needs them as real CPU tensors (a fake tensor cannot be a graph
    constant), and their values do not matter for planning; they are small
    (labels, masks), so materializing them costs little. Only tensors found on
    the model are swapped: fake tensors' own meta storage must pass untouched.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        # Made here, outside any fake mode: a zeros() made under it would be fake.
        self._cpu: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            id(t): (t, torch.zeros(t.shape, dtype=t.dtype, device="cpu")) for t in _held_meta_tensors(model)
        }

    def _swap(self, t: Any) -> Any:
        entry = self._cpu.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._cpu:
            args, kwargs = pytree.tree_map(self._swap, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _held_meta_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Meta tensors reachable from the model's modules that are not parameters or buffers.

    Looks at plain attributes, containers, ``functools.partial`` objects and
    the closure cells and defaults of functions (a loss closure), a few levels deep.
    """
    state = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    found: dict[int, torch.Tensor] = {}

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_meta and id(obj) not in state:
                found[id(obj)] = obj
            return
        if depth == 0 or isinstance(obj, (str, bytes, int, float, type, torch.nn.Module)):
            return
        if isinstance(obj, (list, tuple, set)):
            children: Any = list(obj)
        elif isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif callable(obj) and hasattr(obj, "__code__"):
            cells = [c.cell_contents for c in (obj.__closure__ or ()) if _cell_filled(c)]
            children = cells + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        else:
            return
        for child in children:
            visit(child, depth - 1)

    for module in model.modules():
        for key, value in vars(module).items():
            if key not in ("_parameters", "_buffers", "_modules"):
                visit(value, 4)
    return list(found.values())


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a variable not yet bound)
        return False
    return True


def module_path(node: fx.Node) -> str:
    """Dotted path of the innermost submodule whose forward produced ``node`` ("" if unknown).

    A backward node reports the module of the forward op it differentiates.
    """
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")
    return next(reversed(stack), "") if stack else ""


@contextlib.contextmanager
def _record_module_paths(model: torch.nn.Module):
    """Tag every traced forward node with ``meta["nn_module_stack"]``.

    AOTAutograd traces under ``fx.traceback.preserve_node_meta()``, which copies
    ``fx.traceback.current_meta["nn_module_stack"]`` onto each node it creates;
    global module hooks keep that entry equal to the stack of submodules whose
    forward is running (dynamo fills it the same way from its own trace).
    """
    import torch.fx.traceback as fx_traceback
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    names = {id(m): name for name, m in model.named_modules()}

    def update(mod: torch.nn.Module, entering: bool) -> None:
        name = names.get(id(mod))
        if name is None:  # a module outside the model (a loss module called on the side)
            return
        # ``preserve_node_meta`` rebinds ``current_meta``: look it up on every call.
        stack = collections.OrderedDict(fx_traceback.current_meta.get("nn_module_stack", ()))
        if entering:
            stack[name] = (name, type(mod))
        else:
            stack.pop(name, None)
        fx_traceback.current_meta["nn_module_stack"] = stack

    saved = fx_traceback.current_meta.get("nn_module_stack")
    handles = [
        register_module_forward_pre_hook(lambda mod, args: update(mod, True)),
        register_module_forward_hook(lambda mod, args, out: update(mod, False)),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if saved is None:
            fx_traceback.current_meta.pop("nn_module_stack", None)
        else:
            fx_traceback.current_meta["nn_module_stack"] = saved


@contextlib.contextmanager
def _reentrant_checkpoints_as_plain_calls():
    """Trace ``checkpoint(fn, *args, use_reentrant=True)`` as the plain call ``fn(*args)``.

    The reentrant variant is an ``autograd.Function`` whose backward reruns
    ``fn`` and calls ``backward()`` inside it, which the joint trace (it
    differentiates with ``torch.autograd.grad``) refuses. memplan plans
    recomputation itself, so the trace wants the plain call, as it already
    gets from the non-reentrant variant. ``checkpoint`` and
    ``checkpoint_sequential`` both reach ``CheckpointFunction.apply``: the
    narrowest seam. As in eager, ``fn``'s outputs require grad only when a
    tensor argument does (eager runs ``fn`` under ``no_grad`` and only the
    Function's outputs are differentiable), so parameters inside a
    checkpoint on a plain input get no gradient, as in eager.
    """
    from unittest import mock

    from torch.utils.checkpoint import CheckpointFunction

    def apply(function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        differentiable = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        with torch.set_grad_enabled(differentiable):
            return function(*args)

    with mock.patch.object(CheckpointFunction, "apply", staticmethod(apply)):
        yield


def _rnn_layers_with_dropout(input, hidden, params, has_biases, num_layers, dropout, train, bidirectional,
                             batch_first, layer_fn):
    """torch's ``_rnn_helper`` decomposition of ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, with its dropout.

    The same loop as torch's (torch/_decomp/decompositions.py) without its line
    ``dropout = dropout if (train and num_layers < i - 1) else 0.0``, which is
    never true and so drops the dropout between stacked layers from every
    traced graph: the model would train as if ``dropout=0``. ``torch.dropout``
    on the sequence-first layer output draws the same mask eager's kernel does.
    """
    from torch._decomp.decompositions import params_hiddens

    input = input.transpose(0, 1) if batch_first else input
    final_hiddens = []
    for i in range(num_layers):
        cur_params, cur_hidden, bidir_params, bidir_hidden = params_hiddens(params, hidden, i, bidirectional)
        fwd_inp, fwd_hidden = layer_fn(input, cur_hidden, cur_params, has_biases)
        final_hiddens.append(fwd_hidden)
        if bidirectional:
            bwd_inp, bwd_hidden = layer_fn(input, bidir_hidden, bidir_params, has_biases, reverse=True)
            final_hiddens.append(bwd_hidden)
            input = torch.cat([fwd_inp, bwd_inp], fwd_inp.dim() - 1)
        else:
            input = fwd_inp
        if dropout != 0 and train and i < num_layers - 1:
            input = torch.dropout(input, dropout, train=True)
    input = input.transpose(0, 1) if batch_first else input
    return input, final_hiddens


@contextlib.contextmanager
def _rnn_dropout_between_layers():
    """Trace stacked RNNs with the dropout between their layers (see :func:`_rnn_layers_with_dropout`).

    Patched only while the installed torch still has the bug, recognized by its
    source line, so a torch that fixes it (or changes the helper) traces its own.
    """
    import inspect
    from unittest import mock

    from torch._decomp import decompositions

    helper = getattr(decompositions, "_rnn_helper", None)
    try:
        buggy = helper is not None and "num_layers < i - 1" in inspect.getsource(helper)
    except (OSError, TypeError):  # no source to read: leave torch's helper alone
        buggy = False
    if not buggy:
        yield
        return
    with mock.patch.object(decompositions, "_rnn_helper", _rnn_layers_with_dropout):
        yield


# Resampling ops that torch traces through Python decompositions (`torch._decomp`) even for
# autograd: the decomposition gathers with index tensors and saves full-size intermediates for
# backward, where eager's kernel saves nothing but sizes (a bilinear 2x upsample: store-all
# 6367368 B against eager's 5327112 B; with eager's kernels 3220616 B).
_EAGER_RESAMPLING = (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
)


class _SharedWhileTracing:
    """A process-wide change that every thread tracing at once shares: the first to enter makes
    it (``make()``, which returns what ``undo`` needs), the last to leave undoes it (a thread that
    undid it while another still traced would pull it from under that one)."""

    def __init__(self, make: Callable[[], Any], undo: Callable[[Any], None]):
        self.make, self.undo = make, undo
        self.lock = threading.Lock()
        self.users = 0
        self.saved: Any = None

    @contextlib.contextmanager
    def __call__(self):
        with self.lock:
            if self.users == 0:
                self.saved = self.make()
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    self.undo(self.saved)
                    self.saved = None


def _set_compiling_flag() -> bool:
    import torch.compiler as compiler

    before = getattr(compiler, "_is_compiling_flag", False)
    compiler._is_compiling_flag = True
    return before


def _restore_compiling_flag(before: bool) -> None:
    import torch.compiler as compiler

    compiler._is_compiling_flag = before


traced_as_compiling = _SharedWhileTracing(_set_compiling_flag, _restore_compiling_flag)
traced_as_compiling.__doc__ = """While tracing, ``torch.compiler.is_compiling()`` is True, as it is under torch.export's
non-strict tracing, which traces the model's Python the same way.

Libraries guard what a trace cannot follow with that check and take a traceable path under
it: transformers skips its packed-sequence detection, which reads a mask's values, and picks a
grouped-GEMM fallback that fake tensors support where the kernel's own meta function refuses
float32. The flag is process-wide (as torch.export's is): eager code another thread runs during
a capture sees it too."""


def _put_back_resampling_kernels(removed: list) -> None:
    for op, key, fn in removed:
        op.py_kernels[key] = fn
        op._dispatch_cache.clear()


def _set_aside_resampling_kernels() -> list:
    """Take the Python Autograd and CompositeImplicitAutograd kernels of `_EAGER_RESAMPLING`'s
    overloads out of their tables; returns (op, key, kernel) for each, to put back."""
    from torch._C import DispatchKey

    removed = []
    for name in _EAGER_RESAMPLING:
        packet = getattr(torch.ops.aten, name, None)
        for overload in ("vec", "default"):
            op = getattr(packet, overload, None) if packet is not None else None
            kernels = getattr(op, "py_kernels", None)
            if not isinstance(kernels, dict):
                continue
            for key in (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd):
                if key in kernels:
                    removed.append((op, key, kernels.pop(key)))
            op._dispatch_cache.clear()
    return removed


# Trace the resampling ops of `_EAGER_RESAMPLING` as eager runs them: one op forward, its
# ``*_backward`` op in backward (the derivative formula of ``derivatives.yaml``). Their Python
# kernels for the Autograd and CompositeImplicitAutograd keys are set aside while tracing (and
# the overloads' dispatch caches cleared, so that the C++ kernels are found), and put back after,
# once no thread traces any more. An op torch no longer has is skipped.
eager_resampling = _SharedWhileTracing(_set_aside_resampling_kernels, _put_back_resampling_kernels)


def _copy_module_paths_to_backward(gm: fx.GraphModule) -> None:
    """Give each backward node the ``nn_module_stack`` of its forward op, as ``fwd_nn_module_stack``.

    Autograd stamps a backward op with the ``seq_nr`` of the forward op whose
    gradient it computes; the first forward node with that ``seq_nr`` is the op
    that created the autograd node.
    """
    forward: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.meta.get("partitioner_tag") == "is_forward" and "seq_nr" in node.meta:
            forward.setdefault(node.meta["seq_nr"], node)
    for node in gm.graph.nodes:
        if node.meta.get("partitioner_tag") == "is_backward" and "seq_nr" in node.meta:
            fwd = forward.get(node.meta["seq_nr"])
            if fwd is not None and fwd.meta.get("nn_module_stack"):
                node.meta["fwd_nn_module_stack"] = fwd.meta["nn_module_stack"]


class _Made(enum.Enum):
    """How the joint graph makes one of its model outputs from an output leaf of the model."""

    LEAF = "leaf"  # the leaf itself
    BASE = "base"  # the leaf's ``_base``: an intermediate some outputs are views of
    COPY = "copy"  # a copy of the leaf: a small view of an intermediate


def _output_sources(tensors: list[torch.Tensor], primals: list[torch.Tensor]
                    ) -> tuple[list[int | OutputView], list[tuple[int, _Made]]]:
    """Which model outputs the joint graph returns, and how each output leaf is made from them.

    Returns (per leaf: graph output index or `OutputView`; per graph output: the leaf it comes
    from and how). A leaf that shares storage with a primal, or with a tensor the model also
    returns, is a view of it. Views of an intermediate the model does not return make that
    intermediate (their ``_base``) a graph output, returned once for all of them, when together
    they hold at least half of its storage (a reshaped or split head): the caller gets eager's
    aliasing, and no copy. A smaller view (one token's state out of a hidden sequence) is copied
    instead: eager would hold its whole base for it, the copy lets the plan free the base. So the
    graph keeps "one tensor, one value, one tangent"."""
    primal_of: dict[int, int] = {}
    for k, p in enumerate(primals):
        primal_of.setdefault(storage_key(p), k)
    keys = [storage_key(t) for t in tensors]
    returned: dict[int, int] = {}  # storage -> the first leaf that is not a view (the tensor itself)
    for i, (key, t) in enumerate(zip(keys, tensors)):
        if t._base is None and key not in primal_of:
            returned.setdefault(key, i)
    viewed: dict[int, dict[tuple, int]] = collections.defaultdict(dict)  # storage -> its views' bytes
    for key, t in zip(keys, tensors):
        viewed[key][(tuple(t.shape), t.stride(), t.storage_offset())] = t.numel() * t.element_size()
    output_of: dict[int, int] = {}
    graph: list[tuple[int, _Made]] = []
    sources: list[int | OutputView] = []
    for i, (key, t) in enumerate(zip(keys, tensors)):
        if key in primal_of:
            base = ("primal", primal_of[key])
        else:
            if key not in output_of:  # the first leaf of this storage decides what the graph returns
                if key in returned:
                    graph.append((returned[key], _Made.LEAF))
                elif 2 * sum(viewed[key].values()) >= t.untyped_storage().nbytes():
                    graph.append((i, _Made.BASE))
                else:  # each small view gets a copy of its own
                    sources.append(len(graph))
                    graph.append((i, _Made.COPY))
                    continue
                output_of[key] = len(graph) - 1
            if returned.get(key) == i:
                sources.append(output_of[key])
                continue
            base = ("output", output_of[key])
        sources.append(OutputView(base, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad))
    return sources, graph


def _graph_output(tensors: list[torch.Tensor], leaf: int, made: _Made) -> torch.Tensor:
    t = tensors[leaf]
    return t._base if made is _Made.BASE else t.clone() if made is _Made.COPY else t


def capture(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    output_use: OutputUse = OutputUse(),
) -> Capture:
    """Trace ``model(*args, **kwargs)`` and its backward into one joint ATen graph.

    Real tensors are swapped for fake ones first, so nothing is allocated.
    Parameters are the module's ``named_parameters()`` (tied weights appear once);
    buffers its ``named_buffers()``; inputs every tensor leaf of ``(args, kwargs)``.
    ``output_use``: how the step uses the outputs (see :mod:`memplan.passes.output_use`);
    each of its ``no_grad`` outputs must be in the capture's ``addend_only_outputs``.
    """
    from torch._functorch.aot_autograd import aot_function

    kwargs = dict(kwargs or {})
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    param_names, buffer_names = list(params), list(buffers)
    in_leaves, in_spec = pytree.tree_flatten((tuple(args), kwargs))
    in_tensor_pos = [i for i, x in enumerate(in_leaves) if isinstance(x, torch.Tensor)]
    in_constants = [None if isinstance(x, torch.Tensor) else x for x in in_leaves]
    signature = InputSignature.of(tuple(args), kwargs, model.training)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_params = [fakeify(fake_mode, p) for p in params.values()]
    fake_buffers = [fakeify(fake_mode, b) for b in buffers.values()]
    fake_inputs = [fakeify(fake_mode, in_leaves[i]) for i in in_tensor_pos]
    for fp, p in zip(fake_params, params.values()):
        fp.requires_grad_(p.requires_grad)

    n_p, n_b = len(fake_params), len(fake_buffers)

    def call_model(flat: tuple[torch.Tensor, ...]) -> Any:
        state = dict(zip(param_names, flat[:n_p]))
        state.update(zip(buffer_names, flat[n_p : n_p + n_b]))
        leaves = list(in_constants)
        for pos, t in zip(in_tensor_pos, flat[n_p + n_b :]):
            leaves[pos] = t
        call_args, call_kwargs = pytree.tree_unflatten(leaves, in_spec)
        return call_with_state(model, state, tuple(call_args), call_kwargs)

    # Pre-pass: one fake forward to learn the output structure, which buffers
    # are mutated, and which outputs alias something.
    flat_fake = tuple(fake_params + fake_buffers + fake_inputs)
    meta_constants = MetaConstantsAsCPU(model)
    try:
        with fake_mode, torch.enable_grad(), meta_constants, _reentrant_checkpoints_as_plain_calls(), \
                traced_as_compiling():
            probe = call_model(flat_fake)
        with meta_constants, _reentrant_checkpoints_as_plain_calls(), traced_as_compiling():
            written = _mutated_inputs(call_model, flat_fake, fake_mode)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a CaptureError
        raise _capture_error(model, exc) from exc
    mutated_buffers = [i - n_p for i in written if n_p <= i < n_p + n_b]
    mutated_other = [i for i in written if not n_p <= i < n_p + n_b]
    if mutated_other:
        raise CaptureError(
            f"the model mutates {len(mutated_other)} of its parameters or inputs in place "
            f"({', '.join(_primal_label(i, param_names, n_b) for i in mutated_other[:3])}); "
            "memplan plans steps that only mutate buffers: change a copy instead of the caller's "
            "tensor (x = x.clone() before x.add_(...), or x = x + ...), register a tensor the model "
            "updates as a buffer, and update parameters outside the step (an optimizer, or torch.no_grad())"
        )
    probe_tensors, out_tree = flatten_output(probe)
    out_tree.sources, graph_outputs = _output_sources(probe_tensors, list(flat_fake))
    user_requires_grad = [(probe_tensors[i]._base if made is _Made.BASE else probe_tensors[i]).requires_grad
                          for i, made in graph_outputs]
    del probe, probe_tensors

    def flat_fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = call_model(flat)
        tensors, _ = flatten_output(out)
        return tuple(_graph_output(tensors, i, made) for i, made in graph_outputs)

    box: dict[str, Any] = {}

    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any):
        box["joint"] = joint
        box["num_fwd_outputs"] = num_fwd_outputs
        raise _Captured()

    compiled = aot_function(flat_fn, fw_compiler=lambda gm, _: gm, partition_fn=partition_fn)
    try:
        # oneDNN's fused RNN kernels return their workspace only when grad
        # mode is on, and our forward segment runs under no_grad: trace the
        # portable decomposition instead.
        with fake_mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the flags context warns about TF32 settings it restores
            with (
                torch.backends.mkldnn.flags(enabled=False),
                _record_module_paths(model),
                meta_constants,
                _reentrant_checkpoints_as_plain_calls(),
                _rnn_dropout_between_layers(),
                eager_resampling(),
                traced_as_compiling(),
            ):
                compiled(*flat_fake)
    except _Captured:
        pass
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc.__cause__, _Captured) or "_Captured" in repr(exc):
            pass
        else:
            raise _capture_error(model, exc) from exc
    if "joint" not in box:
        if not any(t.requires_grad for t in flat_fake) or not any(user_requires_grad):
            raise NothingToDifferentiate(
                "nothing to differentiate: no output requires grad (is the model frozen or in no_grad?)")
        raise CaptureError("AOTAutograd did not produce a joint graph for this model")

    gm: fx.GraphModule = box["joint"]
    _copy_module_paths_to_backward(gm)
    n_user = len(user_requires_grad)
    n_mut = len(mutated_buffers)
    n_fw = box["num_fwd_outputs"]
    n_extra = n_fw - n_mut - n_user
    if n_extra < 0:
        raise CaptureError(f"unexpected joint graph layout: {n_fw} forward outputs for {n_mut} mutations + {n_user} outputs")
    outputs = (
        [OutputInfo("buffer_update", b) for b in mutated_buffers]
        + [OutputInfo("user", i) for i in range(n_user)]
        + [OutputInfo("extra_fw", i) for i in range(n_extra)]
        + [OutputInfo("grad", i) for i in range(len(flat_fake))]
    )
    primals = (
        [PrimalInfo("param", name, i, p.requires_grad) for i, (name, p) in enumerate(params.items())]
        + [PrimalInfo("buffer", name, i, False) for i, name in enumerate(buffer_names)]
        + [PrimalInfo("input", f"input[{j}]", j, in_leaves[pos].requires_grad) for j, pos in enumerate(in_tensor_pos)]
    )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    n_primals = len(placeholders) - len(tangents)
    if n_primals != len(primals):
        raise CaptureError(
            f"joint graph has {n_primals} primal inputs for {len(primals)} parameters/buffers/inputs "
            "(inputs that alias each other are not supported yet)"
        )
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    if len(pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None)) != len(outputs):
        raise CaptureError("unexpected joint graph layout: output count does not match the model's outputs and grads")
    # Tangents are the gradients of the forward outputs that require grad, in order.
    fw_vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in _out_list(gm)[:n_fw]]
    tangent_outputs = [i for i, v in enumerate(fw_vals) if isinstance(v, torch.Tensor) and _requires_grad_out(i, outputs, user_requires_grad)]
    if len(tangent_outputs) != len(tangents):
        raise CaptureError(
            f"unexpected joint graph layout: {len(tangents)} tangents for {len(tangent_outputs)} differentiable outputs"
        )
    _check_buffer_updates(fw_vals[:n_mut], [fake_buffers[b] for b in mutated_buffers],
                          [buffer_names[b] for b in mutated_buffers])
    _check_supported(gm)
    tangent_of_user = {outputs[j].index: t for t, j in zip(tangents, tangent_outputs)}
    addend_only_outputs = frozenset(i for i, t in tangent_of_user.items() if addend_only(t))
    if not output_use.no_grad <= addend_only_outputs:
        raise ValueError(
            f"outputs {sorted(output_use.no_grad - addend_only_outputs)} cannot be planned without a gradient: "
            f"only outputs whose gradient is just added to another one can ({sorted(addend_only_outputs)})"
        )
    if not output_use.dropped <= set(range(n_user)):
        raise ValueError(f"outputs {sorted(output_use.dropped)} to drop: the model has {n_user} output tensors")
    make_tangents_optional([tangent_of_user[i] for i in sorted(output_use.no_grad)])
    dropouts_split = split_dropouts(gm)
    losses_fused = fuse_cross_entropy_backward(gm)
    copied_views = copy_out_late_views(gm)
    return Capture(
        graph_module=gm,
        primals=primals,
        num_tangents=len(tangents),
        tangent_outputs=tangent_outputs,
        outputs=outputs,
        output_tree=out_tree,
        input_spec=in_spec,
        input_constants=in_constants,
        param_names=param_names,
        buffer_names=buffer_names,
        mutated_buffers=mutated_buffers,
        user_requires_grad=user_requires_grad,
        signature=signature,
        copied_views=copied_views,
        dropouts_split=dropouts_split,
        losses_fused=losses_fused,
        addend_only_outputs=addend_only_outputs,
        output_use=output_use,
    )


def _check_buffer_updates(values: list[Any], buffers: list[torch.Tensor], names: list[str]) -> None:
    """Each of AOTAutograd's buffer-mutation outputs has its buffer's shape and dtype.

    Which buffers a forward writes comes from a functionalized run of its own (`_mutated_inputs`),
    and the joint graph returns the new values in the same order only if AOTAutograd found the
    same writes. Where they disagree, the step would write a value into the wrong buffer at its
    first forward (seen once on CUDA with torch 2.11: a BatchNorm running mean into a step
    counter); this says so at planning time instead."""
    for value, buffer, name in zip(values, buffers, names):
        if not isinstance(value, torch.Tensor) or value.shape != buffer.shape or value.dtype != buffer.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CaptureError(
                f"the forward writes buffers in place, and memplan's list of them disagrees with AOTAutograd's: "
                f"the new value of {name!r} ({tuple(buffer.shape)} {buffer.dtype}) comes out as {got}. Written "
                f"buffers found: {', '.join(names)}. Please report this with your torch version (meanwhile, "
                "train this model without memplan)"
            )


def _out_list(gm: fx.GraphModule) -> list[Any]:
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    return list(pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))


def _requires_grad_out(i: int, outputs: list[OutputInfo], user_rg: list[bool]) -> bool:
    info = outputs[i]
    if info.kind == "user":
        return user_rg[info.index]
    return False  # buffer updates never require grad; extra forward outputs are not supported for grads


def _check_supported(gm: fx.GraphModule) -> None:
    """Reject graph constructs the planner cannot execute, naming the op."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            raise CaptureError(f"unsupported higher-order op {node.target} at node {node.name}")
        if node.op not in ("placeholder", "call_function", "output", "get_attr"):
            raise CaptureError(f"unsupported node kind {node.op} ({node.name})")


def _capture_error(model: torch.nn.Module, exc: BaseException) -> CaptureError:
    """Turn a tracing failure into one message naming the module and op where it happened."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for fr in reversed(frames):
        if "site-packages/torch" not in fr.filename and "memplan/capture/trace.py" not in fr.filename:
            where = f" at {fr.filename}:{fr.lineno} ({fr.name}: {fr.line})"
            break
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = ""
    if type(exc).__name__ in ("DataDependentOutputException", "GuardOnDataDependentSymNode"):
        # The op name alone (aten._local_scalar_dense) does not tell a user what their code did.
        hint = ("; the forward reads a tensor's value in Python (.item(), float(t), bool(t), `if t > 0:`; "
                "also nn.BatchNorm with momentum=None), which one planned graph cannot follow: "
                "keep the value a tensor (torch.where, masks), compute it outside the model, or let torch.compile "
                "split the model there (memplan.optimize does, unless graph_breaks=False; or memplan.backend)")
    elif type(exc).__name__ == "DynamicOutputShapeException":
        # The op name (aten.nonzero) names neither the user's construct nor a way out.
        hint = ("; an op's output shape depends on tensor values (x[bool_mask], nonzero, masked_select, "
                "unique, repeat_interleave by a tensor), and a plan is made for fixed shapes: keep shapes "
                "fixed (torch.where, multiply or masked_fill by the mask, a masked sum/mean), or compute the "
                "indices outside the model and pass them in as a tensor, or let torch.compile split the model there "
                "(memplan.optimize does, unless graph_breaks=False; or memplan.backend)")
    kind = DataDependentPython if hint else CaptureError
    return kind(f"cannot trace {type(model).__name__}{where}: {type(exc).__name__}: {reason}{hint}")
