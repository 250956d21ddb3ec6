"""What tracing a real model needs beyond AOTAutograd: patches in force while a step is traced (meta
constants, module paths, reentrant checkpoints, RNN dropout, resampling kernels) and their undoing."""
from __future__ import annotations
import collections
import contextlib
import functools
import threading
from typing import Any, Callable
import torch
import torch.fx as fx
import torch.utils._pytree as pytree


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

    @property
    def swapped(self) -> list[torch.Tensor]:
        """The model's meta tensors that zeros stand in for."""
        return [t for t, _ in self._cpu.values()]

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
def record_module_paths(model: torch.nn.Module):
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
def reentrant_checkpoints_as_plain_calls():
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
def rnn_dropout_between_layers():
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


class SharedWhileTracing:
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


def set_compiling_flag() -> bool:
    import torch.compiler as compiler

    before = getattr(compiler, "_is_compiling_flag", False)
    compiler._is_compiling_flag = True
    return before


def restore_compiling_flag(before: bool) -> None:
    import torch.compiler as compiler

    compiler._is_compiling_flag = before


def put_back_resampling_kernels(removed: list) -> None:
    for op, key, fn in removed:
        op.py_kernels[key] = fn
        op._dispatch_cache.clear()


def set_aside_resampling_kernels() -> list:
    """Take the Python Autograd and CompositeImplicitAutograd kernels of `EAGER_RESAMPLING`'s
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


def copy_module_paths_to_backward(gm: fx.GraphModule) -> None:
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


traced_as_compiling = SharedWhileTracing(set_compiling_flag, restore_compiling_flag)
traced_as_compiling.__doc__ = """While tracing, ``torch.compiler.is_compiling()`` is True, as it is under torch.export's
non-strict tracing, which traces the model's Python the same way.

Libraries guard what a trace cannot follow with that check and take a traceable path under
it: transformers skips its packed-sequence detection, which reads a mask's values, and picks a
grouped-GEMM fallback that fake tensors support where the kernel's own meta function refuses
float32. The flag is process-wide (as torch.export's is): eager code another thread runs during
a capture sees it too."""


# Trace the resampling ops of `EAGER_RESAMPLING` as eager runs them: one op forward, its
# ``*_backward`` op in backward (the derivative formula of ``derivatives.yaml``). Their Python
# kernels for the Autograd and CompositeImplicitAutograd keys are set aside while tracing (and
# the overloads' dispatch caches cleared, so that the C++ kernels are found), and put back after,
# once no thread traces any more. An op torch no longer has is skipped.
eager_resampling = SharedWhileTracing(set_aside_resampling_kernels, put_back_resampling_kernels)
