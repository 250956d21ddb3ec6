"""Measure the runtime of every op of a joint graph, and the host link, on the real device (``profile=True``).

The roofline in :mod:`memplan.costs.cost_model` is a guess; this runs each ATen node
once more on real tensors of the right shapes and takes the median of a few
timings. Inputs are made from the fake values' metadata: floating tensors
are random normal, integer and boolean tensors zero (a valid index for any
embedding or gather). Only one node's inputs and outputs are alive at a
time, so profiling needs no more memory than the largest single op.
"""
from __future__ import annotations

import warnings

import statistics
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from memplan.ops.kernels import eager_kernel
from memplan.core.config import TUNABLES


def _materialize(val: Any, device: torch.device) -> Any:
    def make(t: torch.Tensor) -> torch.Tensor:
        # Fill the storage, then view it with the recorded strides: an in-place fill of a view
        # with overlapping elements (stride 0, as in an expand's gradient) is refused.
        storage = torch.empty(_storage_numel(t), dtype=t.dtype, device=device)
        if storage.is_floating_point() or storage.is_complex():
            storage.normal_()
        else:
            storage.zero_()
        return storage.as_strided(t.shape, t.stride())

    return pytree.tree_map_only(torch.Tensor, make, val)


def _storage_numel(t: torch.Tensor) -> int:
    """Elements a tensor of ``t``'s shape and strides reaches, counted from its first."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds by ``clock`` of ``repeats`` calls of ``fn``, each fenced by device syncs (CUDA's
    kernels run asynchronously: without the syncs a call would time only its launches)."""
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = clock()
        fn()
        _sync(device)
        samples.append(clock() - start)
    return statistics.median(samples)


def measure_op_times(
    gm: fx.GraphModule,
    device: torch.device | str,
    *,
    repeats: int = 3,
    skip: set[str] | None = None,
) -> dict[str, float]:
    """Median seconds of each ``call_function`` node of ``gm`` on ``device``.

    Nodes in ``skip`` (views, getitems: they move no data) are not timed.
    An op that fails on synthetic inputs (one that checks values, not just
    shapes) is left out; the caller keeps its roofline estimate.
    """
    device = torch.device(device)
    skip = skip or set()
    times: dict[str, float] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.name in skip:
                continue
            try:
                args, kwargs = pytree.tree_map_only(
                    fx.Node, lambda n: _materialize(n.meta.get("val"), device), (node.args, node.kwargs)
                )
                kernel = eager_kernel(node)  # what the eager runtime calls (`memplan.ops.kernels`)
                kernel(*args, **kwargs)  # warm-up: first-call allocations, kernel selection
                times[node.name] = median_seconds(lambda: kernel(*args, **kwargs), device, repeats)
            except Exception:  # noqa: BLE001 - value-checking ops keep their estimate
                continue
    return times


def measure_host_bandwidth(device: torch.device | str, nbytes: int = 32 * 2**20, repeats: int = 5,
                           clock: Callable[[], float] = time.perf_counter) -> float:
    """Bytes/s of a copy between ``device`` and host memory, the slower direction.

    CUDA: device buffer to pinned host buffer and back, as the runtime's offloads
    and prefetches do. CPU: a copy into another host buffer, which is what an
    offload is there. The median of ``repeats`` timings per direction."""
    device = torch.device(device)
    numel = nbytes // 4
    on_device = torch.empty(numel, dtype=torch.float32, device=device).normal_()
    on_host = torch.empty(numel, dtype=torch.float32, pin_memory=device.type == "cuda")

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        return median_seconds(lambda: dst.copy_(src, non_blocking=True), device, repeats, clock)

    seconds = max(timed(on_host, on_device), timed(on_device, on_host))
    return nbytes / max(seconds, 1e-9)


# ATen ops whose kernels allocate memory for themselves while they run, beyond their outputs: found by
# running every op of the zoo's joint graphs under the profiler (CPU: oneDNN's convolutions reorder their
# inputs and weights, batch / layer / group norm backward and dropout keep float temporaries). On CUDA,
# cuDNN's convolutions take their workspace from the caching allocator the same way.
SCRATCH_OPS: frozenset[str] = frozenset({
    "aten.convolution.default",
    "aten.convolution_backward.default",
    "aten._native_batch_norm_legit_functional.default",
    "aten.native_batch_norm_backward.default",
    "aten.native_layer_norm_backward.default",
    "aten.native_group_norm_backward.default",
    "aten.native_dropout.default",
    "aten.native_dropout_backward.default",
    "aten._safe_softmax.default",
    # attention kernels keep per-thread or per-block buffers of their own (the CPU flash
    # attention backward: 16 KB on the zoo GPT, beside the gradients it returns)
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._scaled_dot_product_cudnn_attention_backward.default",
})


_SCRATCH_CACHE: dict[tuple, int] = {}


def _signature(node: fx.Node, device: torch.device) -> tuple:
    """What an op's scratch depends on: the op, its tensors' layouts, its other arguments."""
    def key(x: Any) -> Any:
        if isinstance(x, fx.Node):
            val = x.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("T", tuple(val.shape), tuple(val.stride()), val.dtype)
            return ("V", repr(val))
        return repr(x)

    return (str(node.target), str(device), tuple(pytree.tree_map(key, list(node.args))),
            tuple(sorted((k, repr(pytree.tree_map(key, v))) for k, v in node.kwargs.items())))


def _warn_profiling() -> None:
    warnings.warn("memplan: kernel scratch is not measured while a torch.profiler session runs (profilers do not "
                  "nest): this plan leaves no room for it; plan the step once outside the profiler",
                  UserWarning, stacklevel=4)


def measure_op_scratch(gm: fx.GraphModule, device: torch.device | str) -> dict[str, int]:
    """Bytes each op of `SCRATCH_OPS` in ``gm`` allocates for itself while it runs (its peak on the
    device allocator, less its new outputs), measured once per op signature on ``device`` with
    synthetic inputs; ops under `TUNABLES.min_scratch_bytes` are left out.

    The caller's random state is left as it was (dropout draws here). An op that fails on synthetic
    inputs is left out (no scratch known)."""
    from memplan.measure.tracker import allocated_during

    device = torch.device(device)
    forked = [device.index or 0] if device.type == "cuda" else []
    scratch: dict[str, int] = {}
    # On the CPU the measure is a profiler session of its own, and profilers do not nest (a second
    # session inside a running one crashes the process): under someone else's profiler, nothing is
    # measured (or remembered) until a plan is made outside it.
    profiling = device.type == "cpu" and torch.autograd.profiler._is_profiler_enabled
    with torch.no_grad(), torch.random.fork_rng(devices=forked):
        for node in gm.graph.nodes:
            if node.op != "call_function" or str(node.target) not in SCRATCH_OPS:
                continue
            sig = _signature(node, device)
            if sig not in _SCRATCH_CACHE and profiling:
                _warn_profiling()
                continue
            if sig not in _SCRATCH_CACHE:
                held: list[Any] = []
                try:
                    args, kwargs = pytree.tree_map_only(
                        fx.Node, lambda n: _materialize(n.meta.get("val"), device), (node.args, node.kwargs))
                    # The op itself, not its CPU stand-in (`memplan.ops.kernels`, which needs no scratch):
                    # it is what compiled runs call (dropout), and what a compiled run is checked against.
                    node.target(*args, **kwargs)  # warm-up: kernel selection, first-call allocations
                    peak = allocated_during(lambda: held.append(node.target(*args, **kwargs)), device)
                    inputs = {t.untyped_storage().data_ptr()
                              for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
                    outputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                               for t in pytree.tree_leaves(held) if isinstance(t, torch.Tensor)}
                    fresh = sum(n for ptr, n in outputs.items() if ptr not in inputs)
                    _SCRATCH_CACHE[sig] = max(0, peak - fresh)
                except Exception:  # noqa: BLE001 - an op that checks values: no scratch known
                    _SCRATCH_CACHE[sig] = 0
                finally:
                    del held
            if _SCRATCH_CACHE[sig] >= TUNABLES.min_scratch_bytes:
                scratch[node.name] = _SCRATCH_CACHE[sig]
    return scratch
