"""Update buckets: the parameters one optimizer call updates together.

Calling the user's optimizer once per parameter costs a ``step()`` call's host work (its Python,
its hooks, one launch per op) per parameter; on a host-bound step that is most of the step. A
bucket is a run of parameters whose gradients become final one after another in backward; the
whole bucket is updated by one call (a ``foreach`` or ``fused`` optimizer then launches one
kernel per op for all of it). Holding a bucket's early gradients until its last one is final,
and the temporaries of one call over the bucket, are what the plan pays for it: the lowering
gives each bucket one update node whose value is those temporaries and which reads every
gradient of the bucket, so the solver sees both (`memplan.planning.lowering`).

A bucket never mixes parameters updated on the device with ones updated on the host, and never
spans two *units* given by an outer partition (a DDP gradient bucket, an FSDP2 module): buckets
nest inside the units a distributed engine hands gradients over in, so one mechanism serves both.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketMember:
    """One parameter, in the order its gradient becomes final."""

    name: str  # the parameter's name in the model
    nbytes: int  # its bytes (its gradient's, as held until the bucket updates)
    on_host: bool = False  # its state is in host memory and it is updated there


def bucket_updates(members: Sequence[BucketMember], cap_bytes: int,
                   units: Sequence[Collection[str]] = ()) -> list[tuple[str, ...]]:
    """Split ``members`` (in gradient-final order) into buckets of consecutive parameters.

    A bucket closes before a parameter that would take its bytes over ``cap_bytes`` (a bucket
    always holds at least one parameter; ``cap_bytes=0`` gives one per parameter), that is
    updated elsewhere (host or device), or that belongs to another of ``units`` (the names in
    no unit are one unit together: with no ``units``, nothing is split for them)."""
    unit_of = {name: k for k, unit in enumerate(units) for name in unit}
    buckets: list[list[BucketMember]] = []
    for m in members:
        last = buckets[-1] if buckets else None
        if (last is not None and last[-1].on_host == m.on_host
                and unit_of.get(last[-1].name) == unit_of.get(m.name)
                and sum(b.nbytes for b in last) + m.nbytes <= cap_bytes):
            last.append(m)
        else:
            buckets.append([m])
    return [tuple(m.name for m in bucket) for bucket in buckets]


def bucket_caps(param_bytes: Sequence[int], largest: int, min_buckets: int) -> list[int]:
    """The bucket caps a plan tries, in order, the first that fits the budget taken: every update
    in one call where the step is small enough (each call costs host time, and a synchronous
    device overlaps nothing with it), else buckets of ``largest`` bytes (DDP's 25 MB, so that they
    nest in its buckets); then ``1/min_buckets`` of the updated bytes, so that several calls free
    gradients along backward; then one call per parameter (0), which holds the least."""
    total = sum(param_bytes)
    return list(dict.fromkeys([min(total, largest), min(largest, -(-total // max(1, min_buckets))), 0]))
