"""The interval model of `solvers.methods.lower_bounds`: moments along the graph's main chain solved
together as one MILP, so that a value recomputed for one moment is paid once for all of them."""
from __future__ import annotations
import math
import time
from typing import Callable, Optional
import numpy as np
from ..core.problem import Problem
from solvers.methods.bound_moments import BoundContext, Moment, to_mask


def time_left(time_limit: Optional[float], started: float) -> Optional[float]:
    """What is left of ``time_limit`` seconds counted from ``started`` (at least 0.1 s)."""
    return None if time_limit is None else max(0.1, time_limit - (time.perf_counter() - started))


def solve_lp(problem: Problem, b, y: dict[int, int], time_limit: Optional[float]) -> float:
    """Minimise sum cost[u] * y_u; return a safe lower bound on the optimum (0 if none).

    Costs are scaled to at most 1 first: with costs of 1e-5 (seconds), the
    solver's absolute tolerances (1e-7) would be large relative errors. The
    dual bound is shaved by 1e-6 (scaled) against the remaining tolerances.
    An "infeasible" LP gives 0, not infinity: a tolerance call must never
    claim that no schedule exists."""
    from .milp_backends import RAW_INFEASIBLE

    if not y:
        return 0.0
    scale = max((float(problem.cost[u]) for u in y), default=0.0)
    if scale <= 0:
        return 0.0
    b.minimize([(h, float(problem.cost[u]) / scale) for u, h in y.items()], 0.0)
    raw = b.solve(time_limit, 1)
    if raw.status == RAW_INFEASIBLE or not math.isfinite(raw.bound):
        return 0.0
    return max(0.0, raw.bound - 1e-6 * max(1.0, abs(raw.bound))) * scale


def main_chain(problem: Problem, ctx: BoundContext) -> list[int]:
    """A longest path, in values, through the non-source values that can add memory (not views
    of sources): each is an ancestor of the next, so their first computes come in this order."""
    skip = ctx.skip
    length = np.zeros(problem.n, dtype=np.int64)
    prev = np.full(problem.n, -1, dtype=np.int64)
    for v in range(problem.n):
        if skip[v]:
            continue
        for q in problem.preds[v]:
            if not skip[q] and length[q] > length[v]:
                length[v], prev[v] = length[q], q
        length[v] += 1
    path = []
    v = int(np.argmax(length)) if problem.n else -1
    while v >= 0 and length[v] > 0:
        path.append(v)
        v = int(prev[v])
    return path[::-1]


def interval_moments(chain: list[int], by_node: dict[int, Moment], k: int) -> list[int]:
    """Up to ``k`` moments on ``chain`` for `_interval_rows`: the one with the largest knapsack
    bound, then those with the most memory forced at them (the tightest instants: where a
    value held across them has to be recomputed once more), at least ``len(chain) / 2k``
    chain positions apart, in chain order."""
    ranked = [w for w in chain if w in by_node]
    if not ranked or k < 1:
        return []
    pos = {w: i for i, w in enumerate(chain)}
    spacing = max(1, len(chain) // (2 * k))
    chosen = [max(ranked, key=lambda w: by_node[w].extra)]
    for w in sorted(ranked, key=lambda w: (-by_node[w].forced, -by_node[w].extra)):
        if len(chosen) >= k:
            break
        if all(abs(pos[w] - pos[c]) >= spacing for c in chosen):
            chosen.append(w)
    return sorted(chosen, key=pos.__getitem__)


def _interval_rows(ctx: BoundContext, ws: list[int], b, integer: bool) -> dict[int, int]:
    """The interval model over moments ``ws`` (a chain: each an ancestor of the next) in builder
    ``b``; returns the extra-compute variable of each value (``e_v``, cost ``cost[v]``).

    Moment i is the first compute of ``ws[i]``; interval i is the open time between moments i
    and i+1 (the last one runs to the end). Unlike the cascade, which asks only whether a value
    is computed again after one moment, this model counts recomputations per interval, so a
    value that no budget lets stay across two tight moments pays twice. For every value x that
    adds memory, and every value v that owns its storage (the root of its alias tree), 0/1 in
    any schedule:

    * ``r[x,i]``: some value on x's alias chain (x, its alias parent, ... the root) is resident
      at moment i; 0 when the root is a descendant of ``ws[i]`` (not computed yet); 1 for
      ``ws[i]`` and its inputs;
    * ``c[v,i]``: v is computed in interval i; 0 when v is ``ws[i+1]`` or a descendant of it,
      and for a value that cannot be recomputed once computed.

    Rows (each argued for any schedule):

    * a value x is first computed after moment lo and before moment hi (lo: the last moment
      it descends from; hi: the first it is an ancestor of): each input q of x is then resident,
      so r[q,lo] + sum of c[root(q), lo..hi-1] >= 1 (if no value on q's chain is resident at
      moment lo, the first one to become resident after it was computed, and a view's compute
      reads its parent, which is on the chain: so the root was computed); a sink likewise at
      the end;
    * v computed in interval i reads each input q there: r[q,i] + c[root(q),i] >= c[v,i];
    * residency carries over: r[x,i+1] <= r[x,i] + c[root(x),i] (except for the root
      ``ws[i+1]`` itself, computed at the moment);
    * memory at moment i: sources + mem[x] * r[x,i] for values in no alias tree + a weight per
      alias tree, at least chain_min[x] * r[x,i] for each member x (a resident value on x's
      chain counts a size on that chain), within the budget;
    * computes after the first: e_v >= sum of c[v,j] over the intervals after the first moment
      v is an ancestor of (or is), and e_v >= sum of all c[v,j] - 1.
    """
    from .milp_backends import ONE, ZERO

    p, st, n, k = ctx.p, ctx.st, ctx.p.n, len(ws)
    skip = ctx.skip
    vals = [x for x in range(n) if not skip[x]]
    root = st.root.tolist()
    roots = sorted({root[x] for x in vals})
    unit = b.bool_var if integer else (lambda: b.num_var(0.0, 1.0))
    desc = [to_mask(ctx.desc[w], n) for w in ws]
    upto = [to_mask(ctx.anc[w] | (1 << w), n) for w in ws]  # ancestors of ws[i], and ws[i]
    r: list[dict[int, int]] = []
    c: list[dict[int, int]] = []
    for i, w in enumerate(ws):
        forced = {q for q in p.preds[w] if not skip[q]} | {w}
        r.append({x: ONE if x in forced else ZERO if desc[i][root[x]] and root[x] != w else unit()
                  for x in vals})
        later = desc[i + 1] if i + 1 < k else None
        c.append({v: ZERO if (later is not None and (later[v] or v == ws[i + 1]))
                  or (not p.recomputable[v] and upto[i][v]) else unit() for v in roots})
    add = b.add_folded
    # Inputs read between two moments (or after the last), and sinks at the end.
    lo_of = np.full(n, -1, dtype=np.int64)
    hi_of = np.full(n, k, dtype=np.int64)
    for i in range(k):
        lo_of[desc[i]] = i
    for i in range(k - 1, -1, -1):
        hi_of[upto[i]] = i
    seen: set[tuple[int, int, int]] = set()
    for x in range(n):
        lo, hi = int(lo_of[x]), int(hi_of[x])
        if lo < 0 or p.is_source[x]:
            continue
        for q in p.preds[x]:
            if skip[q] or (q, lo, hi) in seen:
                continue
            seen.add((q, lo, hi))
            add([r[lo][q]] + [c[j][root[q]] for j in range(lo, hi)], [], 1.0, math.inf)
    for s in p.sinks:
        if not skip[s]:
            add([r[k - 1][s], c[k - 1][root[s]]], [], 1.0, math.inf)
    scale = float(p.budget)  # memory in budgets: byte-sized coefficients wreck the LP's tolerances
    cap = (p.budget - ctx.base) / scale
    trees: dict[int, list[int]] = {}
    for x in vals:
        if st.treed[x]:
            trees.setdefault(root[x], []).append(x)
    plain = [x for x in vals if not st.treed[x]]
    for i in range(k):
        ri, ci = r[i], c[i]
        for v in roots:
            if ci[v] == ZERO:
                continue
            for q in p.preds[v]:
                if not skip[q]:
                    add([ri[q], ci[root[q]]], [ci[v]], 0.0, math.inf)
        if i + 1 < k:
            nxt = ws[i + 1]
            for x in vals:
                if root[x] != nxt:
                    add([r[i + 1][x]], [ri[x], ci[root[x]]], -math.inf, 0.0)
        row: dict[int, float] = {}
        fixed = 0.0
        for x in plain:
            if ri[x] == ONE:
                fixed += float(p.mem[x]) / scale
            elif ri[x] != ZERO:
                row[ri[x]] = float(p.mem[x]) / scale
        for members in trees.values():
            heavy = max(float(st.chain_min[m]) for m in members) / scale
            least = max((float(st.chain_min[m]) / scale for m in members if ri[m] == ONE), default=0.0)
            live = [m for m in members if ri[m] not in (ONE, ZERO)]
            if not live:
                fixed += least
                continue
            weight = b.num_var(least, heavy)
            for m in live:
                b.add([(weight, 1.0), (ri[m], -float(st.chain_min[m]) / scale)], 0.0, math.inf)
            row[weight] = 1.0
        if fixed > cap + 1e-12:
            raise ValueError("the memory forced at a moment exceeds the budget")
        if row:
            b.add(list(row.items()), -math.inf, cap - fixed)
    extra: dict[int, int] = {}
    for v in roots:
        if p.cost[v] <= 0:
            continue
        first = next((i for i in range(k) if upto[i][v]), k)
        late = [c[j][v] for j in range(first, k)]
        early = [c[j][v] for j in range(first)]
        if all(h == ZERO for h in late + early):
            continue
        e = b.num_var(0.0, math.inf)
        extra[v] = e
        add([e], late, 0.0, math.inf)
        if early:
            add([e], late + early, -1.0, math.inf)
    return extra


def interval_bound(problem: Problem, ctx: BoundContext, ws: list[int], time_limit: Optional[float],
                   integer: bool = True) -> float:
    """The interval model's bound on the extra cost over moments ``ws`` (`_interval_rows`): its
    LP optimum, or with ``integer`` its MILP's dual bound reached within ``time_limit`` (which
    includes building the model)."""
    from ortools.math_opt.python import mathopt

    from .milp_backends import MathOptBuilder

    if not ws:
        return 0.0
    started = time.perf_counter()
    b = MathOptBuilder(mathopt.SolverType.HIGHS)
    try:
        extra = _interval_rows(ctx, ws, b, integer)
    except (ValueError, AssertionError):  # no schedule fits (`moments` reports that): no bound here
        return 0.0
    return solve_lp(problem, b, extra, time_left(time_limit, started))  # building took seconds on gpt48


def pruned_interval(problem: Problem, ctx: BoundContext, ws: list[int], time_limit: Optional[float],
                    progress: Optional[Callable[[float], None]] = None) -> float:
    """The interval model's bound on moments chosen from ``ws`` by their LP: moments are left out,
    one at a time, while leaving one out raises the LP optimum (within `PRUNE_SHARE` of the time),
    then the MILP runs on what is left in the rest, and, if it closes with time to spare, the MILP
    on all of ``ws``. Returns the largest of those MILPs' dual bounds and the LP optima seen (every
    subset of a chain of moments is a chain, so each is a bound); ``progress`` is called with each
    bound on the way.

    Why leave moments out: the LP is not monotone in its moments. Between two moments more, a
    fractional recomputation can be split over two intervals that each read the same fractional
    residency, where one interval would have needed it whole. Fewer moments also make a MILP that
    HiGHS closes (unet at 30%: 9 moments, LP 1.2856 of the total and a MILP still open after
    60 s at 1.3341; leaving out two, LP 1.3109 and the MILP 1.3492 in 5.6 s)."""
    started = time.perf_counter()
    if time_limit is not None and time_limit < PRUNE_MIN:
        return interval_bound(problem, ctx, ws, time_limit)
    prune_end = None if time_limit is None else started + PRUNE_SHARE * time_limit

    def out_of_time() -> bool:
        return prune_end is not None and time.perf_counter() >= prune_end

    best = interval_bound(problem, ctx, ws, time_left(time_limit, started), integer=False)
    if progress is not None:
        progress(best)
    chosen = ws
    while len(chosen) > 2 and not out_of_time():
        trials = []
        for w in chosen:
            if out_of_time():
                break
            fewer = [x for x in chosen if x != w]
            trials.append((interval_bound(problem, ctx, fewer, time_left(time_limit, started), integer=False), fewer))
        if not trials or max(t[0] for t in trials) <= best * (1 + 1e-9):
            break
        best, chosen = max(trials, key=lambda t: t[0])
        if progress is not None:
            progress(best)
    best = max(best, interval_bound(problem, ctx, chosen, time_left(time_limit, started)))
    if chosen != ws and (time_limit is None or time_limit - (time.perf_counter() - started) >= MILP_MIN):
        # Fewer moments make a weaker integer model: where the MILP on all of them closes in the
        # time left (unet at 50%), it is the better bound.
        if progress is not None:
            progress(best)
        best = max(best, interval_bound(problem, ctx, ws, time_left(time_limit, started)))
    return best
MILP_MIN = 0.5
PRUNE_SHARE = 0.4  # of that run's time, at most, for leaving moments out by their LP (`pruned_interval`)
# With less time than this the run keeps its moments: the LPs would leave the MILP too little
# (unet at 30% with a 2 s bound: 1.3093 of the total pruned against 1.3256 without).
PRUNE_MIN = 4.0
