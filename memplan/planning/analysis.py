"""``memplan.analyze``: what one training step of an unmodified model costs.

Two predictions, both on fake tensors (nothing allocated):

* ``graph_peak``: running the captured joint graph in order, every value kept
  from its computation to its last use. It comes from the one simulator
  (``solvers.simulate``) over the store-all schedule, the arithmetic every
  plan is checked by.
* ``eager_peak``: the unmodified model under eager autograd. Eager does not
  run the joint graph: it saves what each autograd node chooses (CPU dropout
  saves a float mask where the traced graph keeps a bool one), accumulates
  gradients in place, and so on. Rather than model those rules, we replay the
  eager step on fake tensors under the same storage tracker that measures
  real steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import solvers
from solvers.core.solution import finish
from memplan.capture.patches import MetaConstantsAsCPU
from memplan.capture.signature import Capture, flatten_output, swapped_state
from memplan.capture.patches import eager_resampling, traced_as_compiling
from memplan.capture.trace import fakeify
from memplan.costs.cost_model import DeviceProfile, GraphCosts, annotate
from memplan.updates.names import ACCUM_PREFIX, STATE_PREFIX
from memplan.updates.probe import ParamUpdate, UpdatePlacement
from memplan.passes.output_use import OutputUse
from memplan.planning.lowering import BACKWARD, Lowered, lower, updated_after_reads


@dataclass
class Analysis:
    """Sizes and predicted costs of one eager training step."""

    num_nodes: int  # ATen ops in the joint graph
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    activation_bytes: int  # storages the forward leaves for the backward (what autograd saves)
    eager_peak: int  # predicted peak bytes of one eager forward+backward
    flops: float  # total FLOPs of forward+backward
    predicted_time: float  # seconds, store-all, on the profile's device
    profile: DeviceProfile
    capture: Capture = field(repr=False)
    costs: GraphCosts = field(repr=False)
    lowered: Lowered = field(repr=False)
    store_all: "solvers.Solution" = field(repr=False)
    optimizer_state_bytes: int = 0  # state the optimizer keeps on the device for the parameters it updates
    host_optimizer_state_bytes: int = 0  # the state it keeps in host memory (updates there)
    accumulated_gradient_bytes: int = 0  # gradients held between micro-steps (accumulate_steps > 1)
    updates: tuple[ParamUpdate, ...] = ()  # what the optimizer's update costs per parameter (learned)

    @property
    def all_optimizer_state_bytes(self) -> int:
        """The optimizer's state for the parameters it updates, on the device and in host memory."""
        return self.optimizer_state_bytes + self.host_optimizer_state_bytes

    @property
    def graph_peak(self) -> int:
        """Predicted peak of executing the joint graph in order, freeing after last use."""
        return self.store_all.peak


def saved_activation_bytes(cap: Capture, costs: GraphCosts, low: Lowered) -> int:
    """Bytes of the distinct storages computed in forward and read in backward."""
    fwd: set[str] = set()
    storages: set[int] = set()
    seen_backward = False
    graph = low.graph
    for name in graph.nodes:
        if name in low.tangents or name == BACKWARD:
            seen_backward = True
            continue
        if not seen_backward:
            if name in low.fx_nodes and low.fx_nodes[name].op == "call_function":
                fwd.add(name)
            continue
        for pred in graph.predecessors(name):
            if pred in fwd:
                storages.update(s for s in costs.values[pred].storages if costs.storage_owner[s] in fwd)
    return sum(costs.storage_bytes[s] for s in storages)


class _RealRnnWorkspaces(TorchDispatchMode):
    """Give fake ``mkldnn_rnn_layer`` calls the workspace the real oneDNN kernel allocates.

    On CPU, eager ``nn.LSTM`` training runs oneDNN's fused layer (GRU and RNN do not), which returns
    a workspace the backward reads. Its fake implementation returns an empty one, so the
    replay missed it: a 2-layer LSTM (hidden 64, batch 8, 50 steps) replayed at 0.9 MB
    against 4.1 MB measured. The size is opaque (oneDNN's primitive reports it), so the
    real kernel runs once per distinct call on zeros of the same shapes, outside the fake
    mode; the fake result then carries an empty workspace of that size. Enter it below the
    storage tracker, so that the tracker sees the resized output.
    """

    def __init__(self) -> None:
        super().__init__()
        self._numel: dict[tuple, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not torch.ops.aten.mkldnn_rnn_layer.default or out[3].numel() > 0:
            return out
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)
        if key not in self._numel:
            with _disable_current_modes():
                real = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
                self._numel[key] = func(*real, **kwargs)[3].numel()
        return (*out[:3], out[3].new_empty(self._numel[key]))


def replay_eager_peak(model: torch.nn.Module, args: tuple, kwargs: dict, output_use: OutputUse = OutputUse(),
                      output_of_leaves: list[int | None] | None = None) -> int:
    """Peak bytes of one eager forward+backward, replayed on fake tensors.

    Output gradients are ones, allocated when backward starts, as a loss's
    gradient would be. The caller holds every output through backward, as the
    first plan assumes, unless ``output_use`` says otherwise: its ``dropped``
    outputs are let go before backward, its ``no_grad`` ones get no gradient.
    ``output_use`` counts the graph's model outputs; ``output_of_leaves`` maps each
    output tensor leaf to one (`OutputTree.graph_output_of_leaves`; default: leaf i is output i).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.measure.tracker import MemoryTracker

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {}
    # fakeify: meta tensors are replayed as CPU tensors, as capture traces them.
    for name, p in model.named_parameters():
        state[name] = fakeify(fake_mode, p).requires_grad_(p.requires_grad)
    for name, b in model.named_buffers():
        state[name] = fakeify(fake_mode, b)
    fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: fakeify(fake_mode, t), (args, kwargs)
    )
    device = next((t.device for t in state.values()), torch.device("cpu"))
    meta_constants = MetaConstantsAsCPU(model)  # a meta model's loss labels, as capture traces them
    # The fake state stays swapped in through backward too: a reentrant checkpoint reruns
    # its function there, and with the real parameters back in place it would accumulate
    # fake gradients into their .grad. (Capture, which always runs first, has already
    # refused a forward that reassigns a parameter or buffer.)
    # Traced as capture traces it (`traced_as_compiling`): the fake tensors follow the same path.
    with fake_mode, meta_constants, eager_resampling(), traced_as_compiling(), _RealRnnWorkspaces(), \
            MemoryTracker(device, allow_fake=True, record_timeline=False) as tracker, \
            swapped_state(model, state):
        out = model(*fake_args, **fake_kwargs)
        outputs = flatten_output(out)[0]
        del out
        of = output_of_leaves if output_of_leaves is not None else list(range(len(outputs)))
        held = [t for t, j in zip(outputs, of, strict=True) if j not in output_use.dropped]
        roots = [t for t, j in zip(outputs, of, strict=True) if t.requires_grad and j not in output_use.no_grad]
        del outputs
        grads = [torch.ones_like(t) for t in roots]
        torch.autograd.backward(roots, grads)
        del roots, grads, held
    return tracker.peak


def replay_eager_peak_of(cap: Capture, model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """`replay_eager_peak` for the step ``cap`` was made for (its output use and output views)."""
    return replay_eager_peak(model, args, kwargs, cap.output_use, cap.output_tree.graph_output_of_leaves())


def analyze_capture(
    cap: Capture, profile: DeviceProfile, eager_peak: int | None = None, measure_on: torch.device | None = None,
    updates: Sequence[ParamUpdate] = (), placement: UpdatePlacement = UpdatePlacement(),
    costs: GraphCosts | None = None, carry_limit: tuple[int, int] | None = None,
    scratch_on: torch.device | None = None,
) -> Analysis:
    """Costs, Problem and store-all baseline for a capture; ``measure_on`` times every op there;
    ``scratch_on`` measures there what the kernels that allocate for themselves take (`memplan.measure.timing.measure_op_scratch`);
    ``updates``: the optimizer updates the step applies (`memplan.updates.probe`), placed as
    ``placement`` says. ``costs``: the capture's costs when they are already known (another
    lowering of the same step). ``carry_limit``: `memplan.planning.lowering.lower`'s."""
    if costs is None:
        costs = _costs(cap, profile, measure_on, scratch_on)
    low = lower(cap, costs, updates=updates, placement=placement, carry_limit=carry_limit)
    store_all = solvers.solve(low.problem, method="store_all")
    if low.updates:  # the Problem's order may update a parameter before its last read
        store_all = finish(low.problem, updated_after_reads(low, low.problem, store_all.schedule), "store_all",
                           time.perf_counter())

    def kind_bytes(kind: str) -> int:
        names = [n.name for n, p in zip(cap.placeholders(), cap.primals) if p.kind == kind]
        return sum(costs.values[n].nbytes for n in names)

    return Analysis(
        num_nodes=cap.num_ops(),
        param_bytes=kind_bytes("param"),
        buffer_bytes=kind_bytes("buffer"),
        input_bytes=kind_bytes("input"),
        activation_bytes=saved_activation_bytes(cap, costs, low),
        eager_peak=eager_peak if eager_peak is not None else store_all.peak,
        flops=costs.total_flops(),
        predicted_time=store_all.cost,
        profile=profile,
        capture=cap,
        costs=costs,
        lowered=low,
        store_all=store_all,
        optimizer_state_bytes=_node_bytes(low, STATE_PREFIX),
        host_optimizer_state_bytes=_host_state_bytes(low, updates),
        accumulated_gradient_bytes=_node_bytes(low, ACCUM_PREFIX),
        updates=tuple(updates),
    )


def _host_state_bytes(low: Lowered, updates: Sequence[ParamUpdate]) -> int:
    """Bytes of optimizer state in host memory: of the parameters the step updates (one that gets
    no gradient has no update) whose state the placement keeps there."""
    updated = {name for _, _, name in low.updates} & low.host_states
    return sum(u.state_bytes for u in updates if u.name in updated)


def _node_bytes(low: Lowered, prefix: str) -> int:
    """Bytes of the Problem's nodes named with ``prefix`` (the optimizer's sources)."""
    return sum(d["mem"] for v, d in low.graph.nodes(data=True) if v.startswith(prefix))


def costs_with_added_nodes(cap: Capture, known: GraphCosts, profile: DeviceProfile) -> GraphCosts:
    """Costs of ``cap``, whose graph is a copy of the one ``known`` costs with nodes added (the
    fetches of `memplan.passes.paging.with_paged`): each known node keeps its time and scratch
    (measured ones too), the added ones are estimated."""
    return annotate(cap.graph_module, profile, {name: v.time for name, v in known.values.items()},
                    {name: v.scratch for name, v in known.values.items() if v.scratch})


def _costs(cap: Capture, profile: DeviceProfile, measure_on: torch.device | None,
           scratch_on: torch.device | None = None) -> GraphCosts:
    """The capture's costs: the profile's roofline, or each op timed on ``measure_on``; with
    ``scratch_on``, the kernel scratch of the ops that have some, measured there."""
    measured = scratch = None
    if measure_on is not None:
        from memplan.measure.timing import measure_op_times

        estimate = annotate(cap.graph_module, profile)
        aliases = {name for name, v in estimate.values.items() if v.alias_of is not None}
        measured = measure_op_times(cap.graph_module, measure_on, skip=aliases)
    if scratch_on is not None:
        from memplan.measure.timing import measure_op_scratch

        scratch = measure_op_scratch(cap.graph_module, scratch_on)
    return annotate(cap.graph_module, profile, measured, scratch)
