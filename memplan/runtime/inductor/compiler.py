"""One run compiled by Inductor (``compile_fx_inner``) on fake inputs: strides kept where the caller
sees them, donated inputs passed on, random ops drawing as traced."""
from __future__ import annotations
from dataclasses import dataclass
from typing import Any, Callable
import torch
import torch.fx as fx
from memplan.ops.kernels import dropout_apply_to_fuse
from memplan.core.storage import storage_key
from memplan.runtime.inductor.runs import is_random_op


# The output node's meta key (Inductor's own) listing the outputs whose strides must stay as traced.
KEEP_STRIDES = "user_visible_output_idxs"
# A run's module meta key: the positions of the inputs whose memory the compiled run may reuse.
DONATED = "memplan_donated"
Compiler = Callable[[fx.GraphModule, list[torch.Tensor]], Callable[[list], Any]]


def _extent(t: torch.Tensor) -> int:
    """Bytes of its storage that ``t`` reaches, from the storage's start."""
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def example_inputs(vals: list[torch.Tensor], device: torch.device, whole: bool = False) -> list[torch.Tensor]:
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

    # fallback_random: a random op (a run's first, `is_random_op`) is not decomposed but called as eager's
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
        if not is_random_op(n):
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
