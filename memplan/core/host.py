"""Host memory on a machine where host and device are the same RAM.

Offloading moves tensors to host memory. On a CPU-only machine the "device" is that
same RAM, so the storages that play the part of host memory are *marked*, and no
memory tracker counts a marked storage:

* ``with host_storage(): buf = x.to("cpu", copy=True)``: every storage an op creates
  inside the block is marked (storages an op merely aliases are not);
* ``mark_host(t)`` marks the storage of an existing tensor.

A mark lives as long as its storage. On CUDA host storages sit on another device and
are not counted anyway; the marks are harmless there.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.core.storage import storages_of, tensors_in

# id(storage) -> weakref to it.  The weakref callback drops the entry when the
# storage dies, so an id reused by a later storage is never mistaken for host.
_HOST: dict[int, weakref.ref] = {}
_TLS = threading.local()


HOST_EVENT_PREFIX = "memplan.host:"  # a profiler event naming the address of a storage marked as host


def mark_storage_host(st: torch.UntypedStorage) -> None:
    key = id(st)
    if key not in _HOST:
        _HOST[key] = weakref.ref(st, lambda _ref, key=key: _HOST.pop(key, None))
        if torch.autograd.profiler._is_profiler_enabled:
            _tell_profiler(st)


def _tell_profiler(st: torch.UntypedStorage) -> None:
    """A profiler counting the CPU allocator's events (`memplan.measure.tracker.profiled_peak`) sees
    host and "device" allocations alike: an event naming the storage's address tells it which block
    is host memory. (A fake storage, planning's, has no address: nothing to tell.)"""
    try:
        address = st.data_ptr()
    except Exception:  # noqa: BLE001 - runs inside a dispatch callback, where raising aborts
        return
    if address:
        with torch.profiler.record_function(f"{HOST_EVENT_PREFIX}{address}"):
            pass


def host_storage_depth() -> int:
    return getattr(_TLS, "host_depth", 0)


def mark_host(*tensors: torch.Tensor) -> None:
    """Mark the storages of ``tensors`` as host memory: no tracker counts them."""
    for t in tensors:
        for st in storages_of(t):
            mark_storage_host(st)


def unmark_host(*tensors: torch.Tensor) -> None:
    """Take the marks of ``mark_host`` off the storages of ``tensors``: device memory again."""
    for t in tensors:
        for st in storages_of(t):
            _HOST.pop(id(st), None)


def is_host_storage(st: torch.UntypedStorage) -> bool:
    """Whether the storage ``st`` is marked as host memory."""
    return id(st) in _HOST


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is marked as host memory."""
    return any(id(st) in _HOST for st in storages_of(t))


def _fresh_outputs(args: Any, kwargs: dict, out: Any) -> Iterator[torch.UntypedStorage]:
    """Output storages of an op that none of its inputs already had.

    Fake storages are let through (marking one is harmless): this runs inside a
    dispatch callback, where raising can abort the process.
    """
    inputs = {id(st) for t in tensors_in((args, kwargs), []) for st in storages_of(t, allow_fake=True)}
    for t in tensors_in(out, []):
        for st in storages_of(t, allow_fake=True):
            if id(st) not in inputs:
                yield st


class _HostMarker(TorchDispatchMode):
    """Marks every storage created while it is active as host memory."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for st in _fresh_outputs(args, kwargs, out):
            mark_storage_host(st)
        return out


@contextlib.contextmanager
def host_storage() -> Iterator[None]:
    """Storages created inside this block are host memory, not device memory.

    The offload runtime allocates its host copies inside this block so that a
    CPU measurement counts only what stays on the "device".  A tracker that is
    active around the block also consults the flag directly, so the marks are
    in place before it would count the new storage.
    """
    _TLS.host_depth = host_storage_depth() + 1
    try:
        with _HostMarker():
            yield
    finally:
        _TLS.host_depth -= 1
