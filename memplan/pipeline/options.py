"""The options of ``memplan.optimize``, ``memplan.backend`` and the CLI, as typed data.

Two groups, each checked once, here:

* `PlanOptions`: how each plan is made and run. ``optimize``, the ``torch.compile`` backend
  (per graph) and the CLI take them.
* `StepOptions`: what the step does beyond forward and backward (the optimizer's update,
  clipping, accumulation). Only ``optimize`` takes them: they need the step as one graph.

Both front ends name every field as a keyword parameter, so an editor shows them; these
classes are where each is documented and validated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from memplan.costs.cost_model import DeviceProfile
from memplan.core.units import parse_bytes

OPTIMIZER_STATES = ("auto", "device", "host")
CLIP_BY = ("auto", "holding", "norm_pass")
PARAMETER_PLACES = ("auto", "device", "host")


@dataclass(frozen=True)
class PlanOptions:
    """How each plan is made and run."""

    solver: str = "auto"
    """The solving method or strategy, by its name in ``solvers/registry.py`` ("auto": the
    hierarchical search, with a lower bound that says how far from optimal its plan is)."""

    time_limit: float | None = None
    """Seconds for the whole planning call of one input signature (capture, costs and the eager
    replay included); None: 8 s (more for a joint graph beyond 2,500 ATen ops,
    `memplan.core.config.Tunables.default_free_ops`), stopping earlier once the plan is proven within
    3% of optimal."""

    device_profile: str | DeviceProfile | None = None
    """The cost table that estimates each op's time: "cpu", "a100", "h100", "h200" or a
    `DeviceProfile`; None: the table for the model's device."""

    offload: bool | None = None
    """Let the plan page activations to host memory over the host link, as well as recompute
    them. None: on for CUDA models, off on the CPU (where it is a real copy, for testing)."""

    profile: bool = False
    """Time every op of the step (and the host link) on the model's device instead of
    estimating them from ``device_profile``."""

    compile: bool | Callable[..., Any] = False
    """Compile each plan's runs of ATen ops with Inductor, the plan's memory decisions kept
    (True), or with a compiler ``fn(graph_module, example_inputs)`` returning a boxed callable."""

    host_memory: int | str | None = None
    """Bytes of host memory the plan may keep there ("64GB", or an int): optimizer state moved
    to the host, its updates' copies, activations paged out. State moves there only while it
    fits, and a plan that needs more is refused (`memplan.HostMemoryError`). None: what the
    machine has available when it plans (``MemAvailable``)."""

    kernel_scratch: bool | None = None
    """Measure the memory that kernels allocate for themselves (cuDNN's workspaces, oneDNN's
    reorders) and plan room for it. None: on where the budget's witness sees it (CUDA, and
    compiled plans on the CPU)."""

    def __post_init__(self) -> None:
        if not isinstance(self.solver, str):
            raise TypeError(f"memplan: solver={self.solver!r}; give a method name such as 'auto'")
        if self.time_limit is not None and (isinstance(self.time_limit, bool) or not self.time_limit > 0):
            raise ValueError(f"memplan: time_limit={self.time_limit!r}; give seconds above 0, or None")
        if self.host_memory is not None:
            try:
                parse_bytes(self.host_memory)
            except ValueError:
                raise ValueError(f"memplan: host_memory={self.host_memory!r}; give bytes such as '64GB' or an int, "
                                 "or None for what the machine has") from None
        if not (isinstance(self.compile, bool) or callable(self.compile)):
            raise TypeError(f"memplan.optimize: compile={self.compile!r}; give True, False or a compiler")


@dataclass(frozen=True)
class StepOptions:
    """What the step does beyond forward and backward: ``optimize``'s only."""

    optimizer: Any = None
    """A ``torch.optim.Optimizer`` over the model's parameters: its update runs inside the
    planned step and its state is in the budget (``loss.backward()`` applies the update)."""

    grad_norm: bool = False
    """Keep the L2 norm of the gradients applied in the last step as ``OptimizedModule.grad_norm``."""

    updates_after_backward: bool = False
    """Run every update after the whole backward, as ``optimizer.step()`` would, instead of
    each as soon as its gradient is final."""

    max_grad_norm: float | None = None
    """Clip the global gradient norm to this before the updates, as
    ``torch.nn.utils.clip_grad_norm_`` would between ``backward()`` and ``step()``."""

    optimizer_state: str = "auto"
    """Where the optimizer's state lives: "device", "host" (ZeRO-Offload style: the update
    runs on the host) or "auto" (on the device; as much in host memory as the budget needs)."""

    accumulate_steps: int = 1
    """Update once every this many backward passes, the gradients added up in ``.grad`` between."""

    parameters: str = "auto"
    """Where the parameters live between their uses: "device", "host" (every one paged,
    ZeRO-Infinity style: fetched to the device before its readers, the copy kept from the forward
    to the backward or fetched again as the budget asks; the update runs on the host, the
    optimizer's state there too) or "auto" (on the device, and paged, the largest first, for as
    many as a step that does not fit otherwise needs; where paging is built: one process, on the
    CPU, without ``compile=`` or ``plan=``). Paging needs ``optimizer=``; on the CPU it is simulated."""

    master_weights: bool = False
    """With ``parameters`` "host" or "auto": update each bf16 or fp16 paged parameter through an fp32 master copy
    in host memory, its optimizer state in fp32 too, and round the result into the parameter
    (ZeRO-Offload's mixed precision); the device only ever holds the low-precision copies."""

    clip_by: str = "auto"
    """How ``max_grad_norm`` gets the global norm: "holding" every gradient to the end of
    backward, "norm_pass" (a first backward computes the norm only, a second applies the
    clipped updates), or "auto" (holding where it fits)."""

    @property
    def may_page_as_needed(self) -> bool:
        """`may_page_as_needed` for these options."""
        return may_page_as_needed(self.parameters, self.optimizer is not None, self.optimizer_state)

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and self.optimizer is None:
            raise ValueError("memplan.optimize: max_grad_norm= clips before memplan's updates; it needs optimizer=")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"memplan.optimize: optimizer_state={self.optimizer_state!r}; give one of "
                             f"{', '.join(map(repr, OPTIMIZER_STATES))}")
        steps = self.accumulate_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"memplan.optimize: accumulate_steps={steps!r}; give a positive int")
        if steps > 1 and self.optimizer is None:
            raise ValueError("memplan.optimize: accumulate_steps= counts steps between memplan's updates; it needs "
                             "optimizer= (without one, accumulate as usual: gradients held in .grad are planned for)")
        if self.parameters not in PARAMETER_PLACES:
            raise ValueError(f"memplan.optimize: parameters={self.parameters!r}; give one of "
                             f"{', '.join(map(repr, PARAMETER_PLACES))}")
        if self.parameters == "host":
            if self.optimizer is None:
                raise ValueError("memplan.optimize(..., parameters=\"host\"): paged parameters are updated where "
                                 "they live, on the host; give the optimizer: optimizer=opt")
            if self.optimizer_state == "device":
                raise ValueError("memplan.optimize(..., parameters=\"host\", optimizer_state=\"device\"): a paged "
                                 "parameter's update runs on the host, with its state there; leave optimizer_state "
                                 "at \"auto\" or give \"host\"")
        if self.master_weights and self.parameters == "device":
            raise ValueError("memplan.optimize(..., master_weights=True): the fp32 masters live with the paged "
                             "parameters in host memory; give parameters=\"host\" or \"auto\"")
        if self.clip_by not in CLIP_BY:
            raise ValueError(f"memplan.optimize: clip_by={self.clip_by!r}; give one of {', '.join(map(repr, CLIP_BY))}")


def may_page_as_needed(parameters: str, has_optimizer: bool, optimizer_state: str) -> bool:
    """``parameters="auto"`` may page: the update is in the step and its state may leave the device
    (where paging is built, `memplan.frontend.paged.paging_refusal`, says the front end)."""
    return parameters == "auto" and has_optimizer and optimizer_state != "device"
