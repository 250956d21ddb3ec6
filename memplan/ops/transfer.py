"""Copies between a device and host memory, on side streams: the one place they are made.

The planned step's offload / prefetch / arrive (`memplan.runtime.program`) and the optimizer's host
updates (`memplan.updates.probe`) both copy here. On CUDA a copy runs on one of two side streams per
device (device-to-host, host-to-device) into or out of pinned host memory, ordered against the
compute stream by events, so that it overlaps compute; the device buffer it reads is recorded on
the copy stream, so the caching allocator does not hand its memory out before the copy has read
it. Elsewhere (a CPU "device", in tests) a copy is a plain clone into storage marked as host
memory (`memplan.core.host.host_storage`), so a CPU measurement counts it apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from memplan.core.host import host_storage


@dataclass
class HostCopy:
    """A value's copy in host memory, and the event that marks its copy complete (CUDA)."""

    host: torch.Tensor
    device: torch.device
    done: Any = None  # torch.cuda.Event on CUDA


@dataclass
class Arriving:
    """A value on its way back to the device; ``arrive`` hands it out once the copy has landed."""

    tensor: torch.Tensor
    landed: Any = None  # torch.cuda.Event on CUDA


_STREAMS: dict[int, tuple[Any, Any]] = {}


def copy_streams(device: torch.device) -> tuple[Any, Any]:
    """The (device-to-host, host-to-device) side streams of a CUDA device, made once."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = (torch.cuda.Stream(device=key), torch.cuda.Stream(device=key))
    return _STREAMS[key]


def offload_tensor(t: torch.Tensor) -> HostCopy:
    if t.is_cuda:
        d2h, _ = copy_streams(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        d2h.wait_stream(torch.cuda.current_stream(t.device))  # t must have been computed
        with torch.cuda.stream(d2h):
            host.copy_(t, non_blocking=True)
        t.record_stream(d2h)  # no reuse of t's memory before the copy has read it
        done = torch.cuda.Event()
        done.record(d2h)
        return HostCopy(host, t.device, done)
    with host_storage():
        host = t.clone(memory_format=torch.preserve_format)
    return HostCopy(host, t.device)


def _prefetch_tensor(copy: HostCopy) -> Arriving:
    if copy.done is not None:
        _, h2d = copy_streams(copy.device)
        out = torch.empty_like(copy.host, device=copy.device)
        h2d.wait_stream(torch.cuda.current_stream(copy.device))  # `out` may reuse memory compute just freed
        h2d.wait_event(copy.done)
        with torch.cuda.stream(h2d):
            out.copy_(copy.host, non_blocking=True)
        out.record_stream(h2d)
        landed = torch.cuda.Event()
        landed.record(h2d)
        return Arriving(out, landed)
    return Arriving(copy.host.clone(memory_format=torch.preserve_format).to(copy.device))


def _arrive_tensor(value: Arriving) -> torch.Tensor:
    if value.landed is not None:
        torch.cuda.current_stream(value.tensor.device).wait_event(value.landed)
    return value.tensor


# A value is a tensor or, for a multi-output op, a tuple of them: each tensor travels on its own.
def offload(value: Any) -> Any:
    """Start copying a value to host memory; the device value may be dropped right away."""
    return pytree.tree_map_only(torch.Tensor, offload_tensor, value)


def prefetch(copy: Any) -> Any:
    """Start copying a host copy back to its device."""
    return pytree.tree_map_only(HostCopy, _prefetch_tensor, copy)


def arrive(value: Any) -> Any:
    """The prefetched value, once its copies have landed (compute waits on their events)."""
    return pytree.tree_map_only(Arriving, _arrive_tensor, value)


def wait_host_copy(copy: HostCopy) -> torch.Tensor:
    """``copy``'s host tensor, once its copy is complete (blocks the calling thread, not a stream)."""
    if copy.done is not None:
        copy.done.synchronize()
    return copy.host


def copy_back(dst: torch.Tensor, host: torch.Tensor) -> Any:
    """Start copying ``host`` into the device tensor ``dst`` in place; returns the event compute must
    wait for before it reads ``dst`` (None where the copy is done on return).

    The caller orders the copy after every earlier reader of ``dst``: the host updates copy a
    parameter back only after its gradient's copy out, which followed all the compute queued
    before it, has completed."""
    if dst.is_cuda:
        _, h2d = copy_streams(dst.device)
        with torch.cuda.stream(h2d):
            dst.copy_(host, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(h2d)
        return landed
    dst.copy_(host)
    return None


@torch.library.custom_op("memplan::fetch_parameter", mutates_args=())
def fetch_parameter(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A paged parameter's copy on ``device`` for the ops that read it (`memplan.passes.paging`):
    the parameter lives in host memory between its uses. On the CPU, where the device is the
    host's own RAM, the copy is a clone into storage not marked as host: device memory, counted.

    A fetch is an op like any other in the joint graph, so a plan may free its copy and fetch
    it again (a recomputation) rather than keep it from the forward to the backward."""
    return host.to(device, copy=True, non_blocking=host.is_pinned())


@fetch_parameter.register_fake
def _fetch_parameter_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(host, device=device)
