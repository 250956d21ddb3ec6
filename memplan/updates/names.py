"""The names the optimizer's update takes in a plan's Problem: its state and accumulated gradients
(sources), each update and its sink, and the markers the updates wait for."""
from __future__ import annotations


STATE_PREFIX = "optstate:"  # a parameter's optimizer state on the device: a source of the Problem
ACCUM_PREFIX = "accum:"  # a parameter's accumulated gradient (accumulate_steps > 1): a source too
UPDATE_PREFIX = "update:"  # applying the optimizer to one parameter (its temporaries are the value)
UPDATED_SUFFIX = "@updated"  # the update's result: a zero-byte sink, so every update runs
GRADS_FINAL = "__grads_final__"  # every gradient of the step is final: updates may start
# Clipping by a first backward pass (``UpdatePlacement.norm_pass``), as LOMO does: its values are
# the backward's again under this prefix, each gradient's square is added up at ``SQUARE_PREFIX``,
# and the updates of the second pass wait for ``NORM_FINAL``.
NORM_PASS_PREFIX = "normpass:"
SQUARE_PREFIX = "square:"
NORM_FINAL = "__grad_norm__"
