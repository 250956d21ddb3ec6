"""The error a budget no plan fits raises, with the lowest peak memplan found; and the attempts
for which not fitting is no error."""
from __future__ import annotations

from typing import Callable, TypeVar

import solvers
from memplan.core.units import format_bytes
from memplan.updates.host_memory import HostMemoryError

Solved = TypeVar("Solved")


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget; ``min_budget`` is the lowest peak of the plans memplan found
    (`solvers.strategies.min_budget.min_budget`: a search, not a proof; a plan between the two may exist),
    or, with ``searched`` False, a bound or the lowest peak one solve reached (`whole_step_plan`).
    ``addend_only_outputs``: the graph's outputs whose gradient is an addend only
    (`Capture.addend_only_outputs`), which a plan could do without (`memplan.passes.output_use`)."""

    def __init__(self, budget: int, min_budget: int, held_gradient_bytes: int = 0,
                 addend_only_outputs: frozenset[int] = frozenset(), searched: bool = True, engine_bytes: int = 0,
                 method: str | None = None):
        self.budget = budget
        # A named solver that could not meet a budget the search finds feasible: ``min_budget`` is its
        # smallest plan's peak, and "auto" may do better.
        self.method = method
        self.engine_bytes = engine_bytes
        self.min_budget = min_budget
        # False: ``min_budget`` was not searched for (`solvers.solve`'s ``search_minimum=False``): a
        # lower bound, or the lowest peak a solve reached; a placement of the whole step that cannot
        # fit, told apart without a search.
        self.searched = searched
        self.held_gradient_bytes = held_gradient_bytes
        self.addend_only_outputs = addend_only_outputs
        held = (
            f"; that counts {format_bytes(held_gradient_bytes)} of gradients the parameters already hold from an "
            "earlier step (accumulation): call optimizer.zero_grad() before the step, or raise the budget"
            if held_gradient_bytes else "; raise the budget or shrink the batch"
        )
        if engine_bytes:
            held += (f" (it counts {format_bytes(engine_bytes)} of the distributed engine's buffers: DDP's gradient "
                     "buckets)")
        found = f"solver {method!r} made" if method else "memplan found"
        if method:
            held += "; solver='auto' searches further"
        super().__init__(
            f"budget {format_bytes(budget)} is below the smallest plan {found} for this model and input: "
            f"{format_bytes(min_budget)} ({min_budget} bytes){held}"
        )


def none_where_unfit(attempt: Callable[[], Solved]) -> Solved | None:
    """``attempt()``, or None where its plan does not fit: the budget (`InfeasibleBudgetError`), the
    host's memory (`HostMemoryError`) or any schedule (`solvers.ScheduleError`). For the attempts
    made while another plan is in hand, or before one that may fit: not fitting is no error there."""
    try:
        return attempt()
    except (InfeasibleBudgetError, HostMemoryError, solvers.ScheduleError):
        return None
