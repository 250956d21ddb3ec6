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
import enum
import traceback
import warnings
from pathlib import Path
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
from memplan.capture.patches import (MetaConstantsAsCPU, copy_module_paths_to_backward, eager_resampling, record_module_paths,
                                     reentrant_checkpoints_as_plain_calls, rnn_dropout_between_layers, traced_as_compiling)
from memplan.capture.signature import Capture, CaptureError, DataDependentPython, InputSignature, NothingToDifferentiate, OutputInfo, OutputView, PrimalInfo, call_with_state, flatten_output


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
    if meta_constants.swapped and any(not in_leaves[pos].is_meta for pos in in_tensor_pos):
        # Zeros stand in for them while a meta model is planned; a step on real inputs would train on the zeros.
        shapes = ", ".join(str(tuple(t.shape)) for t in meta_constants.swapped[:3])
        raise CaptureError(
            f"the model holds {len(meta_constants.swapped)} tensor(s) on the meta device outside its parameters and "
            f"buffers (a loss closure's labels, a plain attribute; shapes {shapes}) and the step's inputs are real: "
            "planning alone can use them, a step cannot. Make them real tensors (or pass them as inputs) before training")
    try:
        with fake_mode, torch.enable_grad(), meta_constants, reentrant_checkpoints_as_plain_calls(), \
                traced_as_compiling():
            probe = call_model(flat_fake)
        with meta_constants, reentrant_checkpoints_as_plain_calls(), traced_as_compiling():
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
                record_module_paths(model),
                meta_constants,
                reentrant_checkpoints_as_plain_calls(),
                rnn_dropout_between_layers(),
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
    copy_module_paths_to_backward(gm)
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
    ours = str(Path(__file__).resolve().parent)  # the capture package's own frames (trace, patches) are no site
    for fr in reversed(frames):
        if "site-packages/torch" not in fr.filename and not str(Path(fr.filename).resolve()).startswith(ours):
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
