"""The optimizer's updates inside FSDP2's backward: each block's shards updated once its reduce-scatter
has left their gradients (``memplan.fully_shard(..., updates_in_backward=True)``).

FSDP2 reduce-scatters a unit's gradients in its post-backward (``FSDPParamGroup.post_backward``) and
leaves each parameter's shard of the averaged gradient in the sharded parameter's ``.grad``. (It then
runs the parameter's post-accumulate-grad hooks, inside its reduce-scatter stream and before that
stream's event: an update there could not overlap the reduce-scatter.) The updater wraps that method
on every unit's parameter groups and steps the user's optimizer on the unit's shards alone, with those
gradients, which it then drops (`memplan.updates.runner.UpdateRunner` with ``reduced_in_grad``): the
rank holds one unit's gradient shards at a time instead of the whole model's to the end of backward.
A unit's update runs at the next unit's post-backward, so that its reduce-scatter overlaps that unit's
backward (on CUDA the compute stream waits for the reduce-scatter's event there), and the last
units' at the end of backward (a callback queued on autograd's engine, after FSDP2's own).

A micro-step that does not reduce (``set_requires_gradient_sync(False)``) leaves no sharded
gradient: nothing is updated until the step that reduces the accumulated sum; every backward that
reduces updates (as ``memplan.optimize``'s updates in backward do). A block run twice in one forward
(FSDP2 reduces its gradients once per run) is refused: its update would step twice. The optimizer's
``step()`` after backward then finds no gradients and changes nothing; so does
``clip_grad_norm_``, which is why clipping needs the updates after backward (the default).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from memplan.frontend.distributed import DistributedTrainingError
from memplan.updates.runner import UpdateRunner


class UpdatesInBackward:
    """Updates a sharded model's units in its backward (see the module's docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, modules: list[nn.Module], root: nn.Module) -> None:
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        self.runner = UpdateRunner(optimizer, self.params, reduced_in_grad=True)
        self._pending: list[tuple[list[int], Any]] = []  # (slots, the reduce-scatter's event) not yet updated
        self._queued = False
        self._updated: set[int] = set()  # id() of the parameter groups updated in this backward
        self.units_updated = 0  # units updated inside the last backward (tests read it)
        for module in modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                self._wrap(group)
        # Every forward starts a step: what a backward that raised left behind is dropped.
        root.register_forward_pre_hook(lambda module, args: self._new_step())

    def _new_step(self) -> None:
        self._queued = False
        self._pending = []
        self._updated = set()

    def _wrap(self, group: Any) -> None:
        post_backward = group.post_backward

        def post_backward_then_update(*args: Any) -> Any:
            if not self._queued:  # the step's first: its last updates run when autograd's backward ends
                self._queued = True
                self._updated = set()
                self.units_updated = 0
                self.runner.begin(frozenset())
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._update_pending()
            result = post_backward(*args)
            slots = [self.slot[id(fp.sharded_param)] for fp in group.fsdp_params
                     if fp.sharded_param.grad is not None and id(fp.sharded_param) in self.slot]
            if slots:
                if id(group) in self._updated:
                    raise DistributedTrainingError(
                        "memplan.fully_shard(..., updates_in_backward=True): a block ran more than once in one "
                        "forward, and FSDP2 reduces its gradients once per run, so its shards would be updated "
                        "twice. Leave updates_in_backward out (the updates then run at optimizer.step()).")
                self._updated.add(id(group))
                self._pending.append((slots, getattr(group, "_post_reduce_event", None)))
            return result

        group.post_backward = post_backward_then_update

    def _update_pending(self) -> None:
        pending, self._pending = self._pending, []
        for slots, event in pending:
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            self.runner(tuple(slots), [])
            self.units_updated += 1

    def _end_of_backward(self) -> None:
        self._queued = False
        self._update_pending()
        self.runner.finish()
