"""The hierarchical strategy's settings: how one solve splits its time limit (`TimeShares`) and
how far each phase goes. The figures behind the values are in ``benchmarks/results/README.md``
("The hierarchical strategy's settings")."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TIME_LIMIT = 30.0  # seconds, when the caller gives none


@dataclass(frozen=True)
class TimeShares:
    """Shares of the time limit ``limit``. A field named ``*_end`` or ``*_deadline`` is an
    instant, ``started + share * limit`` (`SolveState.at`); the others say what they share."""

    # Baselines
    race: float = 0.1  # of the limit, for each method of the baseline race (at least 0.5 s)
    baseline_polish_end: float = 0.2  # the baselines' `keep_recomputed` polish ends by then
    # store-all's descent to the budget by recomputation ends by then (sooner when done: a second or
    # two on thousands of values, which a short limit must leave it: gpt2 12 layers at 50% in 5 s)
    descent_end: float = 0.4
    # The search
    search_deadline: float = 0.85  # the search ends by then, leaving the lower bound its tenth
    # ... or by then when the bound runs in a child process (`background`), which then has the
    # whole limit (up to `bound_end`), its own start included.
    background_search_deadline: float = 0.93
    search_share: float = 0.6  # of the search time (start to deadline) for the drop searches; the rest polishes
    first_share: float = 2 / 3  # of the drop searches' window left, for the first variant (at least 0.5 s) ...
    next_share: float = 0.5  # ... and of what is left then, for each next one (later ones get what earlier ones leave)
    unfit_search_end: float = 0.7  # when nothing fits, the drop searches go on until then
    repair_end: float = 0.9  # repairs of cheaper plans over the budget end by then
    more_descents_share: float = 0.5  # of the search time left, for store-all descents through other stops
    # `pin_search` has the rest of the search time, and stops after this many times the solve so far
    # without a faster plan (a multiple of the time spent, not a share of the limit).
    pin_patience: float = 2.0
    # After the search
    sqrt_n_end: float = 0.5  # when nothing fits, sqrt_n is tried only before then (seconds on large graphs)
    final_polish_end: float = 0.95  # the winner's `keep_recomputed` polish ends by then
    quick_bound_share: float = 0.05  # of the limit, at most, for the quick bound that certifies a plan early
    bound_share: float = 0.1  # of the limit, at most, for the lower bound computed here (at least 0.1 s)
    bound_end: float = 0.98  # the lower bound (last) ends by then: the rest is the final simulation


SHARES = TimeShares()

# (cluster gap as a share of the coarse graph, chains modelled) for each run of the drop search:
# uses further apart than the gap start a new cluster; 1/100 first (it settles quickest).
VARIANTS = ((1 / 100, False), (1 / 50, False), (1 / 50, True), (1 / 25, False), (1 / 100, True), (1 / 25, True),
            (1 / 200, False), (1 / 12, False), (1 / 200, True), (1 / 12, True), (1 / 400, False), (1 / 400, True))
POLISHED = 3  # best plans (of different variants) polished by keep_again, time permitting
# keep_again takes back at most about half of a plan's cost: a drop plan more than this many times
# slower than the best plan is not polished.
KEEP_AGAIN_REACH = 2.0
EXACT_NODES = 8  # exhaustive search up to this many values to compute
CHECKMATE_NODES = 60  # Checkmate on the fine (else coarse) graph up to this many values
MORE_DESCENTS = 64  # store-all descents through other stops, when time is left

# Stopping early: the search stops once its best plan is certified this close to optimal by a
# quick bound (the moments and LPs of `lower_bounds.lower_bound`, no MILP, within
# `TimeShares.quick_bound_share`) or by what the child has proved so far (`background`), so that a
# small model is planned in seconds, not the limit. A caller may stop sooner (`solvers.solve`'s
# ``gap``: memplan's default is 3%).
EARLY_GAP = 0.005
# Only graphs up to this many values try to stop early: on larger ones the quick bound costs
# seconds that the final bound spends again.
EARLY_STOP_MAX_VALUES = 1000

# The lower bound in a child process (`background`): only when a second core is free, the limit
# is at least BACKGROUND_MIN_LIMIT seconds (the child's start, 0.6-1 s, comes out of it; from 3 s on
# it still proves more than the tenth of the limit left to a bound computed here: gpt2 12 layers
# at 50%, 1.0345 of the total in 0.7 s and 1.0444 in 2 s, against 1.0198 in 0.35 s) ...
BACKGROUND_MIN_LIMIT = 3.0
# ... and the graph has more than this many values to compute: on smaller ones the bound takes
# milliseconds here and the exact phase answers, while a child costs a core its interpreter's start.
BACKGROUND_MIN_VALUES = CHECKMATE_NODES
