"""Faster eager code for a segment's ops, exact to the bit: stand-ins and in-place variants.

Eager autograd never calls some of the ops a joint graph holds: ``nn.Dropout`` runs
``aten.dropout`` (a float mask, one multiply each way), while the traced graph holds
``aten.native_dropout`` and its backward, which keep a bool mask (a quarter of the bytes,
which plans count on) and multiply by it. On CPU a multiply of a float tensor by a bool one
first copies the mask into a float temporary through a scalar conversion loop (about 4x
slower than converting from ``uint8``), and the backward allocates two results where one
would do. ViT's store-all plan ran 5-6% slower than eager autograd, most of it there.

The capture splits a CPU dropout of a contiguous input into two ops of this module
(`memplan.passes.dropout_split`): ``memplan::dropout_mask``, the op's draw, and
``memplan::dropout_apply``, the output made from the mask. Their kernels, and the backward's
stand-in, compute what the op computes, bit for bit: the same generator draws in the same
order, the same products (a mask entry is 0 or 1, so ``mask * x`` equals ``x * mask`` and
``(g * m) * s`` equals ``(m * g) * s``, NaN and signed zeros included), the mask in the same
layout (a dropout of a strided input stays the op). They only take a shorter way: the mask
converted from its bytes, the products made in place in the one buffer that is returned.

A traced graph is functional: ``relu`` where ResNet's module runs ``relu_``, ``add`` where it
adds the skip connection in place. Each result is a fresh buffer, written while the input it
replaces is still cached; on CPU that made ResNet-50's ReLUs 2.5x slower than eager's in-place
ones. Where an elementwise op's first input dies at that op (no other value shares its
storage, none reads it later, it is not a step input or output, no offload copies it to host
memory: on CUDA that copy reads it on a side stream after the offload returns) and has the result's shape,
dtype and strides, the op runs as its in-place variant: the same kernel, the same values, in
the buffer that was about to be freed. Memory only drops, while that op runs (the plan counted
both buffers there) and, for an item of a multi-output op (BatchNorm's output), until the last
item is taken (the op's tuple holds them all till then). So that the step's peak stays the one
the plan predicts, to the byte, an op whose saving would fall on the plan's peak stays out of
place: the plan did not count on the room.

The eager runtime (`memplan.runtime.program`) runs these where they apply (`use_stand_ins`); the op
itself stays in the node's meta (`aten_target`), which is what compiled runs
(`memplan.runtime.inductor.segments`) hand to Inductor and check their memory against, and the cost model
(`memplan.measure.timing`) times and measures the kernel that runs (`eager_kernel`). Inductor calls
the mask's kernel as an op of its own and gets ``dropout_apply`` as a multiply it fuses with
the ops around it (`dropout_apply_to_fuse`).
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from memplan.ops import fused_loss
from memplan.ops.transfer import offload
from memplan.core.storage import dense_tensors, storage_key, value_device

aten = torch.ops.aten

# Where a node whose target was replaced keeps the ATen op it stands in for, and whether it was
# replaced by the op's in-place variant.
ATEN_TARGET = "memplan_aten_target"
IN_PLACE = "memplan_in_place"


def _dropout_scale(p: float) -> float:
    """``native_dropout``'s own: the kept values' factor, 0 when everything is dropped."""
    kept = 1.0 - p
    return 0.0 if kept == 0 else 1.0 / kept


def drawn_as_the_op(x: torch.Tensor, train: bool | None) -> bool:
    """Whether `dropout_mask` and `dropout_apply` compute ``native_dropout`` of ``x`` as the CPU op
    does: in training, on a non-empty input laid out contiguous (the op's multiply lays out the
    output of a strided one by rules not worth copying)."""
    return (train is None or train) and x.numel() > 0 and x.is_contiguous()


# Random: no pass may merge two draws (a custom op's tags need torch 2.5)
_SEEDED = ({"tags": (torch.Tag.nondeterministic_seeded,)}
           if "tags" in inspect.signature(torch.library.custom_op).parameters else {})


@torch.library.custom_op("memplan::dropout_mask", mutates_args=(), **_SEEDED)
def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The bool mask ``aten.native_dropout`` draws for contiguous ``x`` on the CPU (its kept entries
    True), the generator advanced as the op advances it. An op of its own so that Inductor calls
    it as a kernel, after ``x`` is made: a draw that read no input could be moved before another."""
    return _draw_mask(x, p)


def _empty_mask(x: torch.Tensor) -> torch.Tensor:
    """The buffer ``native_dropout``'s mask is drawn into for contiguous ``x``: bool, contiguous."""
    return torch.empty_like(x, dtype=torch.bool, memory_format=torch.contiguous_format)


def _draw_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    return _empty_mask(x).bernoulli_(1.0 - p)


@dropout_mask.register_fake
def _dropout_mask_fake(x: torch.Tensor, p: float) -> torch.Tensor:
    return _empty_mask(x)


def _scale_as_the_op(p: float, dtype: torch.dtype) -> float:
    """The factor ``native_dropout``'s output is scaled by: a Scalar, which the op's kernel rounds
    to a half-precision input's dtype first (its backward multiplies by a wrapped number, which it
    does not round: `native_dropout_backward`)."""
    return float(torch.tensor(_dropout_scale(p), dtype=dtype))


@torch.library.custom_op("memplan::dropout_apply", mutates_args=())
def dropout_apply(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """``aten.native_dropout``'s output for contiguous ``x`` and the bool ``mask`` it drew, without
    drawing: a deterministic op, so a plan recomputes a dropout's output by one multiply (the mask
    kept, `memplan.passes.dropout_split`) where replaying the op draws the whole mask again."""
    return _apply_mask(x, mask, p)


@dropout_apply.register_fake
def _dropout_apply_fake(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _apply_mask(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """The op's output in one buffer: the mask converted from its bytes, times ``x``, times the
    op's factor (not through the dispatcher: the eager runtime calls this every step)."""
    out = mask.view(torch.uint8).to(x.dtype).mul_(x)
    return aten.mul_.Scalar(out, _dropout_scale(p))


def dropout_apply_to_fuse(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """`dropout_apply` for Inductor to compile (a decomposition): ``x * mask * scale``. The same
    values: a mask entry is 0 or 1, so ``x * mask`` is exact, and the one rounding left is the
    scaling's, by the op's own factor."""
    return x * mask * _scale_as_the_op(p, x.dtype)


def native_dropout_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward``: ``grad * mask * scale`` in one buffer."""
    if (mask.dtype != torch.bool or grad.shape != mask.shape or not grad.is_contiguous()
            or not mask.is_contiguous()):  # not the op's own mask, or strided: no shortcut
        return aten.native_dropout_backward.default(grad, mask, scale)
    out = mask.view(torch.uint8).to(grad.dtype)
    return out.mul_(grad).mul_(scale)


# Per ATen op, the stand-in run on the CPU. (CUDA's kernels for these ops are already fused.)
CPU_STAND_INS: dict[Any, Callable[..., Any]] = {
    aten.native_dropout_backward.default: native_dropout_backward,
    # memplan's own ops: their kernels called straight, not through the dispatcher
    torch.ops.memplan.dropout_mask.default: _draw_mask,
    torch.ops.memplan.dropout_apply.default: _apply_mask,
}


# memplan's own ops whose kernels the eager runtime calls straight on every device: ops inside a
# custom op are hidden from a dispatch-mode tracker, so a step measured so would miss their scratch.
OWN_KERNELS: dict[Any, Callable[..., Any]] = {
    torch.ops.memplan.log_softmax_nll_backward.default: fused_loss.fused_kernel,
}


def aten_target(node: fx.Node) -> Any:
    """The ATen op ``node`` computes, whether it calls it or its stand-in."""
    return node.meta.get(ATEN_TARGET, node.target)


def eager_kernel(node: fx.Node) -> Any:
    """What the eager runtime calls for ``node``: its op's stand-in where there is one for the
    device its value lives on, else its target."""
    op = aten_target(node)
    if op in OWN_KERNELS:
        return OWN_KERNELS[op]
    if op in CPU_STAND_INS and value_device(node).type == "cpu":
        return CPU_STAND_INS[op]
    return node.target


def in_place_variant(op: Any) -> Any:
    """The in-place variant of elementwise ATen op ``op`` (``aten.relu_.default`` for
    ``aten.relu.default``), or None."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags:
        return None
    packet = getattr(torch.ops.aten, op.overloadpacket.__name__ + "_", None)
    variant = getattr(packet, op._overloadname, None) if packet is not None else None
    if variant is None or not variant._schema.arguments or not variant._schema.arguments[0].is_write:
        return None
    return variant


def _fresh(op: Any) -> bool:
    """Whether ``op`` returns new storage: a functional ATen op none of whose results aliases an input."""
    return isinstance(op, torch._ops.OpOverload) and not op._schema.is_mutable and all(
        r.alias_info is None for r in op._schema.returns)


def _made_fresh(node: fx.Node) -> bool:
    """Whether ``node``'s value is storage an op of the graph made (not a step input, a constant, a view)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        maker = node.args[0]
        return isinstance(maker, fx.Node) and maker.op == "call_function" and _fresh(aten_target(maker))
    return _fresh(aten_target(node))


def _same_layout(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.layout == torch.strided
            and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() == 0 and a.device == b.device)


class _Storages:
    """Which storages each node of a graph reads, and where each is read last (the output: never)."""

    def __init__(self, nodes: list[fx.Node]):
        self.parent: dict[int, int] = {}
        self.last_read: dict[int, int] = {}
        # Storages an offload copies to host memory: on CUDA the copy reads them on a side stream
        # after the offload returns, so no op may write them in place (they count as read to the end).
        self.copied: set[int] = set()
        for position, node in enumerate(nodes):
            for key in self.reads(node):
                self.last_read[key] = len(nodes) if node.op == "output" else position
            if node.op == "call_function" and node.target is offload:
                self.copied |= self.reads(node)

    def find(self, key: int) -> int:
        while key in self.parent:
            key = self.parent[key]
        return key

    def of(self, node: fx.Node, item: int | None = None) -> set[int]:
        val = node.meta.get("val")
        if item is not None and isinstance(val, (tuple, list)):
            val = val[item] if item < len(val) else None
        return {self.find(storage_key(t)) for t in dense_tensors(val)}

    def reads(self, node: fx.Node) -> set[int]:
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            return self.of(node.args[0], node.args[1] if isinstance(node.args[1], int) else None)
        return set().union(*(self.of(i) for i in node.all_input_nodes))

    def merge(self, into: int, key: int) -> None:
        """``key``'s storage is now ``into``'s (a result written in place into it)."""
        if key != into:
            self.parent[key] = into
            self.last_read[into] = max(self.last_read.get(into, -1), self.last_read.pop(key, -1))


def _dies_into(node: fx.Node, position: int, storages: _Storages) -> bool:
    """Whether ``node`` may write its result into its first input: it is the last reader of that
    input's storage, which an op of the graph made, and the result is laid out as that input."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node) or not _made_fresh(first):
        return False
    if not _same_layout(first.meta.get("val"), node.meta.get("val")):
        return False
    keys = storages.of(first)
    # (``add(a, a)`` may run in place: each element is read before it is written)
    if len(keys) != 1 or keys & storages.copied or any(keys & storages.of(i) for i in node.all_input_nodes
                                                       if i is not first):
        return False
    return storages.last_read.get(next(iter(keys))) == position


def _below_peak(nodes: list[fx.Node], position: int, position_of: dict[fx.Node, int], timeline: Sequence[float],
                peak: float) -> bool:
    """Whether the plan's memory stays under ``peak`` wherever running ``nodes[position]`` in place
    saves memory: at that op, and, for an item of a multi-output op, until the op's tuple is last read."""
    first = nodes[position].args[0]
    end = position
    if first.target is operator.getitem:
        end = max([end, *(position_of[u] for u in first.args[0].users)])
    steps = [n.meta.get("memplan_step") for n in nodes[position:end + 1]]
    return steps[0] is not None and all(timeline[k] < peak for k in steps if k is not None)


def use_stand_ins(graph: fx.Graph, timeline: Sequence[float] | None = None) -> int:
    """Run ``graph`` (straight-line code, in order) on faster exact code, in place: each op with a
    stand-in for its device calls it, each elementwise op whose first input dies there runs in
    place (see the module docstring). With ``timeline`` (the plan's memory during each schedule
    step, which nodes name in ``meta["memplan_step"]``) only ops below its peak run in place.
    Each changed node keeps its op in its meta; returns how many changed."""
    nodes = list(graph.nodes)
    storages = _Storages(nodes)
    position_of = {n: i for i, n in enumerate(nodes)}
    peak = max(timeline, default=0) if timeline is not None else None
    replaced = 0
    for position, node in enumerate(nodes):
        if node.op != "call_function" or ATEN_TARGET in node.meta:
            continue
        kernel = eager_kernel(node)
        variant = in_place_variant(node.target) if kernel is node.target else None
        if variant is not None and _dies_into(node, position, storages) and (
                peak is None or _below_peak(nodes, position, position_of, timeline, peak)):
            (into,) = storages.of(node.args[0])
            for key in storages.of(node):
                storages.merge(into, key)
            kernel = variant
            node.meta[IN_PLACE] = True
        if kernel is not node.target:
            node.meta[ATEN_TARGET] = node.target
            node.target = kernel
            replaced += 1
    return replaced


def with_aten_targets(graph: fx.Graph, only_in_place: bool = False) -> None:
    """Undo `use_stand_ins` on ``graph`` (in place): every node calls its ATen op again, or with
    ``only_in_place`` every node made in-place does (the stand-ins stay)."""
    for node in graph.nodes:
        if ATEN_TARGET in node.meta and (node.meta.get(IN_PLACE) or not only_in_place):
            node.target = node.meta.pop(ATEN_TARGET)
            node.meta.pop(IN_PLACE, None)
