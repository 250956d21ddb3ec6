"""Put bytes, FLOPs and a runtime estimate on every value of a joint graph.

This is the one place where a value's bytes are computed. Bytes are storage
bytes: a view, a ``detach``, or a ``getitem`` of a multi-output op shares the
storage of the value it came from (read off the fake tensors' storage
identity, so every aliasing op is covered, not just a list of known views),
and a storage is counted once and lives while any alias of it lives.

Runtime is a roofline over a :class:`DeviceProfile`: the larger of FLOPs over
peak FLOP/s and bytes moved over memory bandwidth, plus a per-op launch
overhead; and the host's work per op beside it (`DeviceProfile.with_host`:
added on a CPU, the larger of the two on a GPU, whose host runs ahead).
``profile=True`` in the higher layers replaces it by measurements.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry

from memplan.core.storage import SCRATCH_BYTES, dense_tensors, storage_key
from memplan.passes.paging import FETCH

if TYPE_CHECKING:
    from memplan.capture.signature import Capture


@dataclass(frozen=True)
class DeviceProfile:
    """What a device can do: peak compute, memory bandwidth, link to host memory."""

    name: str
    peak_flops: float  # FLOP/s for float32 matmul-like work
    peak_flops_low_precision: float  # FLOP/s for bf16 / fp16 matmuls
    memory_bandwidth: float  # bytes/s, device memory
    host_bandwidth: float  # bytes/s each way, device <-> host
    op_overhead: float  # seconds of fixed cost per launched op
    allocation_granularity: int = 1  # allocator rounding of each storage, bytes
    # Seconds of host work of one optimizer ``step()`` call beyond its ops (its Python, grouping,
    # hooks): paid once per bucket of updates (`memplan.updates.buckets`). Measured on this
    # project's CPU machine, torch 2.13, one thread: AdamW on one small parameter 49-53 us
    # for-loop, 30 us fused, 84 us foreach; SGD 16 us. ``profile=True`` times the real one.
    optimizer_call: float = 50e-6
    # Seconds of host work per op the planned program runs beyond ``op_overhead`` (its line of
    # generated Python, the dispatcher, the launch call), and whether the host waits for each op
    # (``synchronous``: a CPU, where host and device work add up) or runs ahead of the device (a
    # GPU, where an op costs the larger of the two: a step of small ops is bound by its host).
    host_op_time: float = 0.0
    synchronous: bool = True
    # Kinds of op (`op_kind`) whose time the roofline misjudges on this device, with the factor
    # measured over roofline: work the FLOP counter leaves out (random numbers, normalizations,
    # softmax, pooling), or kernels well below peak (`benchmarks.tools.calibrate_cpu` fits them).
    op_factors: tuple[tuple[str, float], ...] = ()

    @functools.cached_property
    def _factor_of(self) -> dict[str, float]:
        return dict(self.op_factors)

    def op_time(self, flops: float, bytes_moved: float, low_precision: bool = False, kind: str | None = None) -> float:
        peak = self.peak_flops_low_precision if low_precision else self.peak_flops
        roofline = max(flops / peak, bytes_moved / self.memory_bandwidth)
        return self.op_overhead + roofline * self._factor_of.get(kind, 1.0)

    def transfer_time(self, nbytes: int) -> float:
        return nbytes / self.host_bandwidth

    def with_host(self, device_time: float, host_time: float) -> float:
        """An op's time given its device's work and its host's: their sum where the host waits for
        the device, else the larger (the host launches ahead while the device is busy). Per op,
        this takes a stretch of ops to be as host-bound as each of its ops."""
        return device_time + host_time if self.synchronous else max(device_time, host_time)


# Published peak figures (dense, no sparsity). The CPU profile describes a
# small 2-core x86 VM (Sapphire Rapids, AVX-512 and AMX), one thread, fitted
# to its measured op times on Hugging Face GPT-2, ViT and ResNet steps
# (`python -m benchmarks.tools.calibrate_cpu`). Refitted on 2026-12-05 once the
# capture split CPU dropouts into their mask's draw and a multiply
# (`memplan.passes.dropout_split`): three runs gave 128, 131 and 130 GFLOP/s, 16.1,
# 19.1 and 20.5 GB/s (the third is this profile); a fit earlier the same day,
# on the same kernels but the dropout, gave 161 GFLOP/s and 21.6 GB/s, and
# summed to 0.80x this machine's measured op times now: its speed drifts
# between hours, so compare timings only within one process. `profile=True`
# measures the real machine instead.
CPU_OP_FACTORS = (
    ("_log_softmax", 2.96), ("_log_softmax_backward_data", 1.99), ("_native_batch_norm_legit_functional", 4.44),
    ("_safe_softmax", 7.77), ("_scaled_dot_product_flash_attention_for_cpu", 5.34),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", 6.57), ("cat", 2.87), ("convolution", 1.72),
    ("convolution_backward", 2.07), ("dropout_apply", 1.64), ("dropout_mask", 22.5), ("gelu", 1.55),
    ("gelu_backward", 1.56), ("log_softmax_nll_backward", 3.5), ("max_pool2d_with_indices", 21.68), ("max_pool2d_with_indices_backward", 2.21),
    ("native_batch_norm_backward", 2.63), ("native_dropout_backward", 1.6), ("native_layer_norm_backward", 1.57),
    # (log_softmax_nll_backward: `memplan.passes.loss_fusion`'s op, not in the fit above: a later run,
    # against this profile, measured its kernel at 1/1.27 of a factor of 4.5)
    # a dropout the capture leaves whole (a strided input): its two halves' time over its bytes
    ("native_dropout", 14.1),
)
PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", 130e9, 65e9, 20.5e9, 12e9, 4e-6, op_factors=CPU_OP_FACTORS),
    # The GPUs' host work per op: a planned op's line of Python and PyTorch's dispatch and launch,
    # about 10 us a op on a server CPU (the H200 run of benchmarks/results/cuda.md: gpt small at
    # batch 32, a 6.5 ms eager step of about 650 ops a step, waits on its host).
    "a100": DeviceProfile("a100", 19.5e12, 312e12, 2.0e12, 25e9, 6e-6, 512, host_op_time=10e-6, synchronous=False),
    "h100": DeviceProfile("h100", 67e12, 989e12, 3.35e12, 50e9, 5e-6, 512, host_op_time=10e-6, synchronous=False),
    "h200": DeviceProfile("h200", 67e12, 989e12, 4.8e12, 50e9, 5e-6, 512, host_op_time=10e-6, synchronous=False),
}


def get_profile(profile: str | DeviceProfile | None, device: torch.device | str | None = None) -> DeviceProfile:
    """Resolve a profile by name, default from the device (CUDA: the card's name)."""
    if isinstance(profile, DeviceProfile):
        return profile
    if profile is not None:
        try:
            return PROFILES[profile.lower()]
        except KeyError:
            raise ValueError(f"unknown device profile {profile!r}; known: {', '.join(PROFILES)}") from None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev).lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return PROFILES[key]
        return PROFILES["a100"]
    return PROFILES["cpu"]


@dataclass
class ValueCost:
    """Costs of one fx node's value."""

    storages: tuple[int, ...]  # storage keys its value keeps alive
    nbytes: int  # bytes of those storages (what this value alone keeps alive)
    new_bytes: int  # bytes of storages this node allocates (0 for views)
    alias_of: str | None  # the input node whose storage this value lives in
    flops: float
    time: float
    is_random: bool
    scratch: int = 0  # bytes its kernel allocates for itself while it runs (measured: memplan.measure.timing)
    moved: int = 0  # bytes its op reads and writes: the roofline's memory term (0 for views)


@dataclass
class GraphCosts:
    """Per-node costs plus per-storage sizes for one joint graph."""

    values: dict[str, ValueCost]
    storage_bytes: dict[int, int] = field(default_factory=dict)
    storage_owner: dict[int, str] = field(default_factory=dict)  # node that allocates each storage
    profile: DeviceProfile | None = None

    def total_flops(self) -> float:
        return sum(v.flops for v in self.values.values())

    def total_time(self) -> float:
        return sum(v.time for v in self.values.values())


def _rounded_up(n: int, granularity: int) -> int:
    """``n`` bytes as the allocator hands them out: rounded up to its ``granularity``."""
    return int(math.ceil(n / granularity) * granularity) if granularity > 1 and n else n


def storage_nbytes(t: torch.Tensor, granularity: int = 1) -> int:
    """Bytes of a tensor's whole storage, rounded up as the allocator would."""
    return _rounded_up(t.untyped_storage().nbytes(), granularity)


_aten = torch.ops.aten
# ATen's functional copy and scatter ops keep `self`'s strides by cloning all of its storage
# (clone_preserve_strides): the output is as large as that storage, however little of it
# `self` covers. Fake tensors may report only the bytes the strides reach.
_CLONE_SELF_STORAGE = {_aten.copy.default, _aten.slice_scatter.default, _aten.select_scatter.default,
                       _aten.diagonal_scatter.default, _aten.as_strided_scatter.default}


# Loss kernels that compute the elementwise loss into a buffer and reduce it into that
# same storage: on CPU the returned 0-dim loss holds a storage as large as the broadcast
# input (measured with torch 2.13: mse_loss of two 64x48 float tensors returns 12288
# bytes), alive for as long as the loss is. Fake tensors report 4 bytes.
_REDUCED_IN_ELEMENTWISE_BUFFER = {_aten.mse_loss.default, _aten.smooth_l1_loss.default,
                                  _aten.soft_margin_loss.default, _aten.binary_cross_entropy.default}


def _reduced_loss_nbytes(node: fx.Node, t: torch.Tensor) -> int | None:
    """Bytes of the elementwise buffer behind a reduced loss (see above); None for other nodes."""
    if node.target not in _REDUCED_IN_ELEMENTWISE_BUFFER or t.dim() != 0 or t.device.type != "cpu":
        return None
    shapes = [a.meta["val"].shape for a in node.args[:2] if isinstance(a, fx.Node)]
    return math.prod(torch.broadcast_shapes(*shapes)) * t.element_size() if shapes else None


def _allocated_nbytes(node: fx.Node, t: torch.Tensor, granularity: int) -> int:
    """Bytes the real kernel allocates for ``node``'s new storage holding ``t``."""
    n = storage_nbytes(t, granularity)
    loss_buffer = _reduced_loss_nbytes(node, t)
    if loss_buffer is not None:
        return max(n, _rounded_up(loss_buffer, granularity))
    if node.target not in _CLONE_SELF_STORAGE or not node.args or not isinstance(node.args[0], fx.Node):
        return n
    base = node.args[0].meta.get("val")
    # A self with internal overlap (a broadcast) is cloned densely instead.
    if isinstance(base, torch.Tensor) and not any(st == 0 and sz > 1 for st, sz in zip(base.stride(), base.shape)):
        n = max(n, storage_nbytes(base, granularity))
    return n


def _is_random(node: fx.Node) -> bool:
    target = node.target
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def op_kind(node: fx.Node) -> str:
    """The kind of op a node runs, as `DeviceProfile.op_factors` names it: the ATen op's name
    without its overload (``native_dropout``), or the callable's name."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(node.target, "__name__", str(node.target))


def node_flops(node: fx.Node) -> float:
    """FLOPs of one ATen node, from torch's own flop formulas on its fake values."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is None or packet not in flop_registry:
        return 0.0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    return float(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))


def _views_another_fake(node: fx.Node, values: dict[str, "ValueCost"]) -> bool:
    """Whether ``node`` is an ATen view (its result aliases its first argument) whose fake value was
    traced from another fake tensor than its argument's node holds: make_fx gives a graph constant a
    fake value of its own, and an optional tangent's sum (`memplan.passes.output_use`) is a new node."""
    first = node.args[0] if node.op == "call_function" and node.args else None
    schema = getattr(node.target, "_schema", None)
    if (not isinstance(first, fx.Node) or schema is None or len(schema.returns) != 1 or not schema.arguments
            or schema.returns[0].alias_info is None or schema.arguments[0].alias_info is None
            or schema.returns[0].alias_info.is_write or not values[first.name].storages):
        return False
    keys = {storage_key(t) for t in dense_tensors(node.meta.get("val"))}
    return len(keys) == 1 and not keys & set(values[first.name].storages)


def annotate(
    gm: fx.GraphModule, profile: DeviceProfile | None = None, measured_times: dict[str, float] | None = None,
    scratch: dict[str, int] | None = None,
) -> GraphCosts:
    """Costs of every node in ``gm``, whose ``meta['val']`` hold fake tensors.

    ``measured_times`` (from :func:`memplan.measure.timing.measure_op_times`)
    replaces the roofline estimate for the nodes it has. ``scratch`` (from
    :func:`memplan.measure.timing.measure_op_scratch`): the bytes an op's kernel
    allocates for itself while it runs, which no fake tensor shows.
    """
    measured_times = measured_times or {}
    scratch = scratch or {}
    profile = profile or PROFILES["cpu"]
    gran = profile.allocation_granularity
    values: dict[str, ValueCost] = {}
    storage_bytes: dict[int, int] = {}
    owner_of: dict[int, str] = {}  # storage key -> node whose value first held it
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if _views_another_fake(node, values):
            # the view is its argument's storage all the same
            base = values[node.args[0].name]
            values[node.name] = ValueCost(storages=base.storages, nbytes=base.nbytes, new_bytes=0,
                                          alias_of=node.args[0].name, flops=0.0,
                                          time=measured_times.get(node.name, profile.with_host(0.0, profile.host_op_time)),
                                          is_random=False)
            continue
        tensors = dense_tensors(node.meta.get("val"))
        keys: list[int] = []
        new_bytes = 0
        for t in tensors:
            key = storage_key(t)
            if key in keys:
                continue
            keys.append(key)
            if key not in storage_bytes:
                storage_bytes[key] = _allocated_nbytes(node, t, gran)
                owner_of[key] = node.name
                new_bytes += storage_bytes[key]
        alias_of = None
        if keys and new_bytes == 0 and node.op != "placeholder":
            # Every storage already existed: a view / getitem / detach. It lives
            # inside the input that holds the largest of its storages: a sparse
            # tensor built around indices (often a view of an input) and values
            # keeps the values alive, and they are what its memory is.
            main = max(keys, key=lambda k: storage_bytes[k])  # the first of the largest
            for inp in node.all_input_nodes:
                if main in values[inp.name].storages:
                    alias_of = inp.name
                    break
        low_precision = any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)
        if node.op == "call_function":
            flops = node_flops(node)
            moved = new_bytes + sum(values[i.name].nbytes for i in node.all_input_nodes if alias_of is None)
            if node.target is FETCH:  # a paged parameter's copy in: its bytes over the host link
                device = profile.transfer_time(new_bytes)
            else:
                device = profile.op_time(flops, moved, low_precision, op_kind(node)) if new_bytes or flops else 0.0
            # A view launches nothing, but the host still runs it (`DeviceProfile.host_op_time`);
            # taking an output of a multi-output op is a Python index.
            host = 0.0 if node.target is operator.getitem else profile.host_op_time
            time = measured_times.get(node.name, profile.with_host(device, host))
        else:
            flops, time, moved = 0.0, 0.0, 0
        values[node.name] = ValueCost(
            storages=tuple(keys),
            nbytes=sum(storage_bytes[k] for k in keys),
            new_bytes=new_bytes,
            alias_of=alias_of,
            flops=flops,
            time=time,
            is_random=node.op == "call_function" and _is_random(node),
            scratch=scratch.get(node.name, node.meta.get(SCRATCH_BYTES, 0)),
            moved=moved,
        )
    return GraphCosts(values, storage_bytes, owner_of, profile)


def output_bytes(cap: Capture, costs: GraphCosts) -> list[int]:
    """Bytes of each of a capture's output tensors, by output index, as the cost model counts them."""
    sizes = [0] * len(cap.user_requires_grad)
    for info, node in zip(cap.outputs, cap.output_nodes()):
        if info.kind == "user" and isinstance(node, fx.Node):
            sizes[info.index] = costs.values[node.name].nbytes
    return sizes
