"""Measure the peak device memory of a training step.

This module has one job: run a callable (usually one training step) and report
the most device memory that was in use at any moment while it ran.  Every
memory claim memplan makes (a plan fits its budget, the cost model predicts the
peak) is checked against this number.

Two back ends answer the same question:

* **CUDA** asks the caching allocator: ``reset_peak_memory_stats`` before the
  step, ``max_memory_allocated`` after it.  That counts every live allocation
  on the device, whoever made it (rounded up to the allocator's 512-byte
  blocks).
* **CPU** (or any device without allocator statistics) uses
  :class:`MemoryTracker`, a ``TorchDispatchMode`` that watches every ATen op,
  the ones autograd runs during ``backward()`` included, and counts the bytes
  of every live *storage* on the measured device.  A storage is counted once
  however many views share it, and it stops counting when it is freed (a weakref
  callback on the storage's Python object, which torch keeps unique per storage
  and alive exactly as long as the storage).

The CPU resident set
--------------------
A dispatch mode cannot see allocations that happened before it was entered,
and the process holds plenty of host memory that has nothing to do with the
step.  So on CPU the step's memory is defined as:

* **resident** storages: every storage that existed before ``fn`` started and
  that the step touches, i.e. that appears as an input or output of any op
  dispatched while ``fn`` runs (parameters, buffers, inputs, an existing
  ``.grad``).  A resident storage counts from the *start* of ``fn`` until it is
  freed or ``fn`` ends, even if the step first touches it late (a parameter
  used only by the last layer still occupies memory during the first layer);
* **allocated** storages: every storage an op dispatched during ``fn``
  returns, from the op that creates it until it is freed: activations, saved
  tensors, gradients (``.grad`` included: AccumulateGrad keeps the tensor the
  backward op produced) and temporaries.

Tensors the step never touches (say, optimizer state of a step without an
optimizer) are not counted; pass them as ``resident=`` to count them anyway.
Memory that a kernel allocates and frees inside one op (workspaces) is
invisible to a dispatch mode, and so is ``UntypedStorage.resize_`` called
directly (it bypasses the dispatcher; call :meth:`MemoryTracker.refresh`
after it).  Byte counts are exact ``nbytes``, with no allocator rounding.

Host memory
-----------
Offloading moves activations to host memory.  On a CPU-only machine host and
"device" are the same RAM, so storages that play the role of host memory must
be told apart.  They are *marked* as host storages, and no tracker counts a
marked storage:

* ``with host_storage(): buf = x.to("cpu", copy=True)``: every storage that
  an op creates inside the block is marked (storages an op merely aliases, such
  as ``x.to("cpu")`` returning ``x`` itself, are not);
* ``mark_host(t)`` marks the storage of an existing tensor, e.g. a pinned
  buffer pool allocated before the step.

A mark lives as long as the storage.  On CUDA, host storages are on another
device and are not counted anyway; the marks are harmless there.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
)

from memplan.core.host import HOST_EVENT_PREFIX, host_storage_depth, is_host_storage, mark_storage_host
from memplan.core.storage import FAKE_REACHED, PLAIN_TENSOR_TYPES, fake_tensor_types, is_fake, sparse_parts, storage_key, storages_of

__all__ = [
    "MemoryTracker",
    "allocated_during",
    "OpEvent",
    "measure_peak",
    "unmeasured",
]

_LIFT_OPS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})


# --------------------------------------------------------------------------
# The tracker
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class OpEvent:
    """One dispatched op and the bytes live on the device right after it."""

    op: str
    live: int


class _Record:
    """What the tracker knows about one storage it has seen."""

    __slots__ = ("ref", "nbytes", "counted")

    def __init__(self, ref: weakref.ref, nbytes: int, counted: bool) -> None:
        self.ref = ref
        self.nbytes = nbytes
        # False for storages seen but not counted: other devices, host marks.
        self.counted = counted


def _normalize_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    return torch.device(device)


def _check_not_fake() -> None:
    if "torch._subclasses.fake_tensor" not in sys.modules:
        return  # nobody imported it, so no fake mode can be active
    _, fake_mode = fake_tensor_types()
    modes = list(_get_current_dispatch_mode_stack())
    key = getattr(torch._C, "_TorchDispatchModeKey", None)
    if key is not None:
        modes.append(torch._C._get_dispatch_mode(key.FAKE))
    if any(isinstance(m, fake_mode) for m in modes):
        raise RuntimeError(
            "memplan.measure.tracker: cannot measure memory under FakeTensorMode; fake "
            "tensors allocate nothing. Measure with real tensors."
        )


class MemoryTracker(TorchDispatchMode):
    """Count live device storages op by op while the ``with`` block runs.

    ``peak`` is the most bytes live at any moment, ``timeline`` the bytes live
    after each dispatched op.  See the module docstring for what is counted.

    Example::

        with MemoryTracker("cpu") as mt:
            model(x).sum().backward()
        print(mt.peak, mt.timeline[-1])
    """

    def __init__(
        self,
        device: torch.device | str | None = "cpu",
        *,
        record_timeline: bool = True,
        resident: Iterable[torch.Tensor] = (),
        allow_fake: bool = False,
    ) -> None:
        super().__init__()
        # allow_fake: count fake storages too. Not a measurement; the cost
        # model uses it to replay eager autograd on fake tensors.
        self.allow_fake = allow_fake
        self.device = _normalize_device(device)
        self.record_timeline = record_timeline
        self._resident_tensors = list(resident)
        # > 0 inside unmeasured(): ops pass through uncounted.
        self._paused = 0
        self._reset()

    # -- public results -----------------------------------------------------

    @property
    def live(self) -> int:
        """Bytes live now (while active) or at the end of the block (after it)."""
        return self._live

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pre-existing storages the step touched."""
        return self._resident

    @property
    def num_ops(self) -> int:
        return self._num_ops

    @property
    def timeline(self) -> list[OpEvent]:
        """(op, bytes live after it) per dispatched op.

        A resident storage found at op k was live from the start, so the
        events before k are raised by its size here, after the fact.
        """
        late = [0] * (len(self._ops) + 1)
        for index, nbytes in self._late_resident:
            late[index] += nbytes
        # Suffix sums: event i gains every resident storage discovered after it.
        for i in range(len(late) - 2, -1, -1):
            late[i] += late[i + 1]
        return [
            OpEvent(str(op), live + late[i + 1])
            for i, (op, live) in enumerate(zip(self._ops, self._lives))
        ]

    # -- context management -------------------------------------------------

    def __enter__(self) -> "MemoryTracker":
        if not self.allow_fake:
            _check_not_fake()
        self._reset()
        self._active = True
        for t in self._resident_tensors:
            self._see(t, resident=True)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._active = False
            # Drop the weakrefs so their callbacks never fire into a finished
            # measurement, and so the tracker keeps nothing alive.
            self._records.clear()
        # Refused here, not where it was seen: an exception raised inside
        # __torch_dispatch__ can cross a C++ frame that cannot pass it on
        # (autograd on fake tensors), and that aborts the process.
        if self._saw_fake and exc[0] is None:
            raise RuntimeError(FAKE_REACHED)

    def refresh(self) -> None:
        """Re-read the size of every tracked storage.

        Needed only after ``UntypedStorage.resize_`` (which is not dispatched),
        e.g. a runtime that frees a buffer in place with ``resize_(0)``.
        """
        for rec in list(self._records.values()):
            st = rec.ref()
            if st is not None and rec.counted:
                self._resize(rec, st.nbytes())

    # -- dispatch -----------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        # Inputs first: a storage first seen as an input predates the step,
        # except the argument of lift_fresh, which is how ``torch.tensor(...)``
        # hands the dispatcher a constant it has just built.
        resident = func not in _LIFT_OPS
        self._see_all(args, resident)
        if kwargs:
            self._see_all(kwargs.values(), resident)
        out = func(*args, **kwargs)
        self._see_all(out if isinstance(out, (tuple, list)) else (out,), False)
        self._num_ops += 1
        if self.record_timeline:
            self._ops.append(func)
            self._lives.append(self._live)
        return out

    # -- bookkeeping ----------------------------------------------------------

    def _reset(self) -> None:
        self._records: dict[int, _Record] = {}
        self._live = 0
        self.peak = 0
        self._resident = 0
        self._num_ops = 0
        self._ops: list[Any] = []
        self._lives: list[int] = []
        self._late_resident: list[tuple[int, int]] = []
        self._active = False
        self._saw_fake = False

    def _see_all(self, objs: Iterable[Any], resident: bool) -> None:
        # The per-op hot path: plain tensors take no generator, no pytree.
        records = self._records
        for obj in objs:
            if type(obj) in PLAIN_TENSOR_TYPES:
                if obj.layout != torch.strided:
                    # Sparse: counted through its indices and values; nested and others: skipped.
                    self._see_all(sparse_parts(obj), resident)
                    continue
                try:
                    st = obj.untyped_storage()
                except (NotImplementedError, RuntimeError):
                    continue  # other storage-less tensors
                rec = records.get(id(st))
                if rec is None:
                    self._add(st, resident)
                elif rec.counted and not resident:
                    # An op's output may have been resized (``out=`` variants,
                    # ``resize_``); inputs are not re-read to keep ops cheap.
                    self._resize(rec, st.nbytes())
            elif isinstance(obj, torch.Tensor):
                # Subclasses: wrapper subclasses own their inner tensors'
                # storages; fake tensors are refused unless allow_fake, on exit.
                if not self.allow_fake and is_fake(obj):
                    self._saw_fake = True
                    continue
                for st in storages_of(obj, self.allow_fake):
                    rec = records.get(id(st))
                    if rec is None:
                        self._add(st, resident)
                    elif rec.counted and not resident:
                        self._resize(rec, st.nbytes())
            elif isinstance(obj, (list, tuple)):
                self._see_all(obj, resident)
            elif isinstance(obj, dict):
                self._see_all(obj.values(), resident)

    def _see(self, t: torch.Tensor, *, resident: bool) -> None:
        self._see_all((t,), resident)

    def _add(self, st: torch.UntypedStorage, resident: bool) -> None:
        key = id(st)
        dev = st.device
        on_device = dev.type == self.device.type and (self.device.index is None or dev.index == self.device.index)
        # Fake storages live on "meta" whatever device they stand for.
        counted = (on_device or self.allow_fake) and not is_host_storage(st)
        if counted and not resident and host_storage_depth() > 0:
            # Created inside host_storage(): host memory, whatever the order
            # of the dispatch modes.
            mark_storage_host(st)
            counted = False
        nbytes = st.nbytes() if counted else 0
        ref = weakref.ref(st, lambda _ref, key=key: self._on_free(key))
        self._records[key] = _Record(ref, nbytes, counted)
        if not nbytes:
            return
        self._live += nbytes
        if resident:
            # Live since the start of the step: every earlier moment, the
            # peak among them, had it too.
            self._resident += nbytes
            self.peak += nbytes
            if self.record_timeline and self._ops:
                self._late_resident.append((len(self._ops), nbytes))
        self.peak = max(self.peak, self._live)

    def _resize(self, rec: _Record, nbytes: int) -> None:
        if nbytes != rec.nbytes:
            self._live += nbytes - rec.nbytes
            rec.nbytes = nbytes
            self.peak = max(self.peak, self._live)

    def _on_free(self, key: int) -> None:
        rec = self._records.pop(key, None)
        if rec is not None and self._active:
            self._live -= rec.nbytes


@contextlib.contextmanager
def unmeasured() -> Iterator[None]:
    """Hide the work inside this block from every :class:`MemoryTracker` active now.

    For work that runs during a measured call but is not part of the step:
    ``OptimizedModule`` plans lazily on its first call, on fake tensors that
    allocate nothing (a tracker refuses them) and with real work of its own
    (profiling runs). Trackers entered inside the block measure as usual, so
    planning can still replay a step under its own tracker. Storages made
    here that the step later touches are counted then, as resident.
    """
    paused = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, MemoryTracker)]
    for tracker in paused:
        tracker._paused += 1
    try:
        yield
    finally:
        for tracker in paused:
            tracker._paused -= 1


# --------------------------------------------------------------------------
# One number
# --------------------------------------------------------------------------


def _default_device() -> torch.device:
    # A step can only have CUDA-resident memory if something initialized CUDA;
    # a CPU model on a GPU machine is measured on CPU.  Pass device= to be sure.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure_peak(
    fn: Callable[[], Any],
    device: torch.device | str | None = None,
    *,
    resident: Iterable[torch.Tensor] = (),
) -> int:
    """Peak bytes of ``device`` memory in use while ``fn()`` runs.

    On CUDA: the allocator's ``max_memory_allocated`` over the call, which
    counts everything allocated on the device (resident or not).  Elsewhere:
    :class:`MemoryTracker`'s peak, i.e. the touched resident storages plus
    everything the step allocates (see the module docstring); ``resident``
    adds tensors to count even if the step does not touch them.

    ``device=None`` means the current CUDA device if CUDA is initialized, else
    CPU.
    """
    dev = _default_device() if device is None else torch.device(device)
    if dev.type == "cuda":
        _check_not_fake()
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev))
    with MemoryTracker(dev, record_timeline=False, resident=resident) as tracker:
        fn()
    return tracker.peak


def profiled_peak(fn: Callable[[], Any], resident: Iterable[torch.Tensor] = ()) -> int:
    """Peak CPU bytes while ``fn()`` runs, read from ``torch.profiler``'s allocation events: the
    second witness, for code a dispatch mode cannot watch.

    ``torch.compile`` runs a frame eagerly while a ``TorchDispatchMode`` such as
    :class:`MemoryTracker` is active (and Inductor's kernels allocate outside the dispatcher),
    so a compiled step is measured here instead: every allocation and free the CPU allocator
    reports during ``fn``, summed in time order, plus the bytes of the distinct storages of
    ``resident`` (what was allocated before ``fn`` and lives through it: parameters, inputs).
    It also counts what kernels allocate inside themselves, below the dispatcher (the scratch of
    CPU convolutions), which :class:`MemoryTracker` cannot see; on steps without such kernels the
    two agree within the allocator's alignment (tests/memplan/test_dynamo.py).
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int, int]] = []
    host_marks: list[tuple[int, int]] = []  # (time, address) of each storage marked as host memory
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        elif node.name.startswith(HOST_EVENT_PREFIX):
            host_marks.append((node.start_time_ns, int(node.name[len(HOST_EVENT_PREFIX):])))
        stack.extend(node.children)
    events.sort()
    host = _host_blocks(events, host_marks)
    # A free is counted only when its block was allocated inside this window: the profiler also
    # reports frees of blocks it saw allocated in an *earlier* profiling session (last step's
    # gradients, freed by this step's zero_grad), which would otherwise lower the peak by their
    # bytes; what was allocated before ``fn`` counts through ``resident`` alone. Host memory
    # (storages `memplan.core.host` marked: offloaded copies, host-resident optimizer state) is
    # on the same allocator here and is left out, as the device's allocator would not see it.
    live: dict[int, int] = {}
    running = peak = 0
    for i, (_, size, ptr) in enumerate(events):
        if size < 0:
            if live.pop(ptr, None) is None:
                continue
        elif i in host:
            continue
        else:
            live[ptr] = size
        running += size
        peak = max(peak, running)
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in resident}
    return peak + sum(storages.values())


def _host_blocks(events: list[tuple[int, int, int]], marks: list[tuple[int, int]]) -> set[int]:
    """Indices into ``events`` (time-sorted allocator events: time, bytes, address) of the allocations
    that ``marks`` (time, address) name as host memory: at each mark, the latest allocation at its
    address before it."""
    latest: dict[int, int] = {}  # address -> index of its latest allocation so far
    host: set[int] = set()
    marks = sorted(marks)
    m = 0
    for i, (time, size, ptr) in enumerate(events):
        while m < len(marks) and marks[m][0] < time:
            if marks[m][1] in latest:
                host.add(latest[marks[m][1]])
            m += 1
        if size > 0:
            latest[ptr] = i
    for _, address in marks[m:]:
        if address in latest:
            host.add(latest[address])
    return host


def allocated_during(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes the device's allocator handed out while ``fn()`` ran, above what was in use
    before it: CUDA's allocator statistics, or on the CPU the profiler's allocation events
    (`profiled_peak`), which also see what kernels allocate for themselves."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return profiled_peak(fn)
