"""Strategy "hierarchical": near-optimal drop plans for graphs of thousands of values.

The graph is coarsened (views and single-consumer chains folded into their producers) and a plan
chooses which coarse groups to *drop*: release after each cluster of uses and recompute before the
next. A covering ILP picks the drop set (with a host link, also what to page out to host memory),
the simulator measures every plan and feeds its errors back, and the drop plans compete with fast
baselines and with repairs and descents of them. The result is always a simulated schedule.

`solve_hierarchical` runs these phases (`strategy`), each with its share of the time limit
(`settings.TimeShares`):

1. race the fast baselines (store-all fits: done), start the lower bound in a child process;
2. offer the baselines and ``seeds``, polished, and store-all recomputed down to the budget;
3. coarsen, then a portfolio of drop searches (`search.drop_search`), the best polished by
   `search.keep_again`;
4. small graphs: the exhaustive search or Checkmate;
5. repair the plans over budget that cost less than the best fitting one;
6. more store-all descents through other stops, then `pin_search`;
7. the winner polished (nothing fits: the lowest peak), and the lower bound.

The search stops early once its best plan is within `EARLY_GAP` of a quick lower bound.

Modules, each using only those before it:

* `planner`: drop plans and their schedules (`DropPlanner`, `Evaluation`, `Paging`);
* `model`: the covering ILP (`candidates`, `pagings`, `CoverModel`);
* `search`: the ILP with the simulator in the loop (`drop_search`, `repair`, `keep_again`);
* `settings`: the time shares and the sizes of the phases;
* `strategy`: `solve_hierarchical` and its phases over one `SolveState`.
"""
from .model import Candidate, CoverModel, Penalty, candidates, pagings
from .planner import DropPlanner, Evaluation, Paging, held_memory
from .search import SearchLog, drop_search, keep_again, repair
from .settings import BACKGROUND_MIN_LIMIT, BACKGROUND_MIN_VALUES, EARLY_GAP, SHARES, TimeShares
from .strategy import SolveState, solve_hierarchical

__all__ = [
    "BACKGROUND_MIN_LIMIT",
    "BACKGROUND_MIN_VALUES",
    "EARLY_GAP",
    "SHARES",
    "Candidate",
    "CoverModel",
    "DropPlanner",
    "Evaluation",
    "Paging",
    "Penalty",
    "SearchLog",
    "SolveState",
    "TimeShares",
    "candidates",
    "drop_search",
    "held_memory",
    "keep_again",
    "pagings",
    "repair",
    "solve_hierarchical",
]
