"""The time of one planning call: its limit, counted from its start, and where the time went."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from memplan.core.config import TUNABLES

Result = TypeVar("Result")


class PlanningTimeWarning(UserWarning):
    """Capturing and analyzing the step took longer than optimize()'s time_limit."""


@dataclass(frozen=True)
class PlanningClock:
    """The time limit of one planning call, counted from its start (`time.perf_counter`), and the
    gap at which its search stops (None: the solver's own)."""

    started: float
    limit: float
    gap: float | None
    chosen: bool = True  # the caller gave the limit (else the default, which a graph's size may raise)

    @classmethod
    def begin(cls, time_limit: float | None, started: float | None = None) -> "PlanningClock":
        """The clock of a call that started at ``started`` (default: now) with ``time_limit``
        (None: `TUNABLES.default_time_limit`, stopping at `TUNABLES.default_gap`; `sized_to` raises it
        for a large graph)."""
        started = time.perf_counter() if started is None else started
        if time_limit is None:
            return cls(started, TUNABLES.default_time_limit, TUNABLES.default_gap, chosen=False)
        return cls(started, float(time_limit), None)

    def sized_to(self, ops: int) -> "PlanningClock":
        """This clock for a joint graph of ``ops`` ATen ops: a default limit grows by
        `TUNABLES.default_seconds_per_op` for each op beyond `TUNABLES.default_free_ops`; a limit the
        caller chose stays."""
        if self.chosen:
            return self
        beyond = max(0, ops - TUNABLES.default_free_ops)
        return dataclasses.replace(self, limit=self.limit + TUNABLES.default_seconds_per_op * beyond)

    def spent(self) -> bool:
        """Whether the limit has passed (a solve would get only `TUNABLES.min_solve_time`)."""
        return self.elapsed() >= self.limit

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def time_left(self) -> float:
        """Seconds left of the limit (negative once it has passed)."""
        return self.limit - self.elapsed()

    def solve_limit(self) -> float:
        """Seconds the solver may take now: what is left of the limit, at least `TUNABLES.min_solve_time`."""
        return max(TUNABLES.min_solve_time, self.time_left())

    def warn_if_spent(self, what: str) -> None:
        """Warn when ``what`` (the work before the solver) has taken the whole limit already."""
        took = self.elapsed()
        if took >= self.limit:
            warnings.warn(
                f"memplan: {what} took {took:.1f} s, more than the planning time limit of {self.limit:g} s; "
                f"the solver still gets {TUNABLES.min_solve_time:g} s to find a plan. Raise time_limit= to let it search "
                "longer, or save the plan (Plan.save, optimize(plan=...)) to skip planning next time.",
                PlanningTimeWarning,
                stacklevel=2,
            )


@dataclass
class PhaseTimer:
    """Seconds per phase of a planning call, each phase timed from the end of the one before
    (the first from ``last``); a phase named twice adds up. Once the call has run
    `TUNABLES.progress_after_seconds`, each phase's end and each `next` go to stderr as one line."""

    last: float
    seconds: dict[str, float] = field(default_factory=dict)
    began: float = field(init=False)

    def __post_init__(self) -> None:
        self.began = self.last

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now
        self._say(f"{phase} took {self.seconds[phase]:.1f} s")

    def next(self, what: str) -> None:
        """Say (past the progress threshold) what the call does now."""
        self._say(what)

    def _say(self, text: str) -> None:
        elapsed = time.perf_counter() - self.began
        if elapsed >= TUNABLES.progress_after_seconds:
            sys.stderr.write(f"memplan: planning, {elapsed:.0f} s in: {text}\n")
            sys.stderr.flush()


@dataclass
class Attempts:
    """The attempts of a planning call, timed, so that one that is optional (a plan is in hand
    already) is started only where what is left of the limit covers what the last one took: on a
    billion-parameter step an attempt costs seconds before a solver's own limit applies (the step
    lowered again for another placement, the solver's baselines), so an attempt started with a
    second left ends many seconds past the limit."""

    time_left: Callable[[], float]
    """Seconds left of the planning call's limit (infinite: no limit)."""

    last: float = 0.0
    """Seconds the last attempt took."""

    def run(self, attempt: Callable[[], Result]) -> Result:
        """``attempt()``, timed."""
        before = self.time_left()
        try:
            return attempt()
        finally:
            took = before - self.time_left()
            self.last = took if math.isfinite(took) else 0.0

    def affordable(self) -> bool:
        """Whether another attempt would end within the limit, taking as long as the last."""
        left = self.time_left()
        return left > 0 and left >= self.last
