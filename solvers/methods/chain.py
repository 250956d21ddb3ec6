"""Read a joint forward+backward Problem as a heterogeneous chain of stages.

Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains")
and revolve (Griewank) plan over a chain: stage ``k`` turns its input
``a[k-1]`` into its output ``a[k]`` in the forward pass, and its backward
``B[k]`` later reads the stage's kept activations ("x-bar") and the gradient
coming from stage ``k+1``. This module finds such a chain in any DAG, using
structure only (never node names):

1. **Where the backward starts.** Every forward value reaches every
   gradient sink through the loss, while the backward fans out into one
   gradient sink per parameter, so backward values reach fewer sinks. And
   at the end of the forward pass every activation saved for the backward is
   live. The split value is, among the values reaching the most sinks, the
   first one with the most values live across it in the topological order.
   The backward part is everything that depends on the split value; the
   forward part is the rest (values placed after the split that do not
   depend on it, views made for the backward say, move up to right after
   their forward inputs).
2. **Stages.** In the forward order, a position is a cut when at most one
   recomputable forward value is live across it (produced at or before it,
   read by a forward value after it). That value is the stage output; sources
   and values that cannot be recomputed are ignored (they are "pinned", see
   below). Past ``max_stages`` stages, cuts are thinned to stages of about
   equal weight (half cost share, half value count).
3. **Backward stages.** A backward value belongs to the latest stage whose
   forward values it reads, but never to a later stage than the backward
   values it reads (those run first); values reading neither are placed with
   their earliest consumer. Backward stages then run ``L, L-1, ..., 1``.
4. **Merging and pinning.** A forward value read by a backward stage other
   than its own (or, for the stage output, the next one) does not fit the
   chain model. When it is large, or the two stages are close, the stages
   between them are merged (repeated until no such read is left); when it is
   small (at most ``PIN_FRACTION`` of the forward memory, BatchNorm statistics
   say) and read far away, it is pinned, like values that cannot be recomputed: computed once, on the
   first forward pass over its stage, and kept until its last use. Pinned
   memory is a constant reserved out of the budget.

Per stage the chain records costs (advance = only what the output needs,
all = everything the backward keeps, backward) and sizes in bytes measured
with the alias-aware `Residency` on the stage alone: input/output size, the
kept set, the transient peaks of each operation, the gradient handed to the
previous stage and the gradient sinks produced. These are a model for the
dynamic programs; the schedules they produce are always simulated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..core.memory import Residency, alias_trees, memory_of
from ..core.problem import Problem
from ..core.solution import MethodFailed

DEFAULT_MAX_STAGES = 128
# A forward value read by a backward stage other than its own is pinned (kept from its first
# computation to its last use) when it is at most this share of the forward memory; larger
# ones merge the stages in between instead.
PIN_FRACTION = 0.002


@dataclass(frozen=True)
class Stage:
    forward: tuple[int, ...]  # every forward value of the stage, in order (pinned included)
    first: tuple[int, ...]  # first advance over the stage: what the output and the pinned values need
    advance: tuple[int, ...]  # later advances: recomputable values the output needs
    full: tuple[int, ...]  # later F_all: recomputable values the output and the backward need
    backward: tuple[int, ...]  # backward values of the stage, in order
    output: int  # the single value handed to the next stage, -1 when none
    cost_advance: float
    cost_all: float
    cost_backward: float
    out_size: int  # a[k], bytes
    kept_size: int  # x-bar[k]: what F_all leaves for the backward (output included)
    peak_advance: int  # peak above the stage input while advancing (output included)
    peak_all: int  # peak above the stage input during F_all (kept set included)
    peak_backward: int  # peak above the state B[k] starts in (kept set, input, gradient in)
    grad_size: int  # gradient handed to the previous stage (backward values read by earlier stages)
    sink_size: int  # gradient sinks B[k] produces (they stay to the end)
    reads_input: bool  # B[k] reads the previous stage's output
    reads_output: bool  # B[k] reads this stage's output


@dataclass(frozen=True)
class Chain:
    stages: tuple[Stage, ...]
    pinned: frozenset[int]  # computed once, kept until their last use
    pinned_size: int  # their memory, bytes
    split: int  # the value where the backward starts (last forward value)
    base: int  # memory of the sources alone

    @property
    def length(self) -> int:
        return len(self.stages)


# ------------------------------------------------------------------ helpers
def _split_value(problem: Problem) -> int:
    """Among the values reaching the most sinks, the first with the most values live
    across it; see the module doc."""
    n = problem.n
    reach = [0] * n  # bitset of sinks reachable from each value
    is_sink, is_source, succs = problem.is_sink, problem.is_source, problem.succs
    counts = np.full(n, -1, dtype=np.int64)
    for v in range(n - 1, -1, -1):
        bits = (1 << v) if is_sink[v] and not is_source[v] else 0
        for w in succs[v]:
            bits |= reach[w]
        reach[v] = bits
        if not is_source[v]:
            counts[v] = bits.bit_count()
    if counts.max() < 0:
        raise MethodFailed("nothing to compute")
    # live[k]: non-source values computed at or before k and read after k.
    diff = np.zeros(n + 1, dtype=np.int64)
    for v in problem.non_sources:
        if succs[v]:
            diff[v] += 1
            diff[max(succs[v])] -= 1
    live = np.cumsum(diff)[:n]
    candidates = np.flatnonzero(counts == counts.max())
    best = candidates[live[candidates] == live[candidates].max()]
    return int(best[0])


def _descendants(problem: Problem, root: int) -> set[int]:
    out = {root}
    for v in range(root + 1, problem.n):  # index order is topological
        if any(p in out for p in problem.preds[v]):
            out.add(v)
    out.discard(root)
    return out


def _forward_order(problem: Problem, forward: list[int], split: int) -> list[int]:
    """The forward values in index order, except that those placed after the split
    (views of activations made for the backward, say) move up to right after their
    latest forward input, so that they do not look live across the whole forward part."""
    fset = set(forward)
    anchor: dict[int, int] = {}
    keys: dict[int, tuple[int, int, int]] = {}
    for v in forward:  # increasing index: inputs first
        if v <= split:
            anchor[v] = v
            keys[v] = (v, 0, v)
        else:
            anchor[v] = max((anchor[p] for p in problem.preds[v] if p in fset), default=-1)
            keys[v] = (anchor[v], 1, v)
    return sorted(forward, key=keys.__getitem__)


def _ancestors(problem: Problem, roots: Iterable[int], allowed: set[int]) -> set[int]:
    """``roots`` (those in ``allowed``) and their ancestors inside ``allowed``."""
    out: set[int] = set()
    stack = [r for r in roots if r in allowed]
    preds = problem.preds
    while stack:
        v = stack.pop()
        if v in out:
            continue
        out.add(v)
        for p in preds[v]:
            if p in allowed and p not in out:
                stack.append(p)
    return out


def _run(problem: Problem, res: Residency, seq: Sequence[int], keep: set[int]) -> int:
    """Compute ``seq`` on ``res`` (changing it), each value freed after its last read in
    ``seq`` unless it is in ``keep``; return the peak above the memory at the start.
    Running the sequence (rather than adding up a set) gives views their base's storage."""
    start = res.total
    last: dict[int, int] = {}
    preds = problem.preds
    for i, v in enumerate(seq):
        for q in preds[v]:
            last[q] = i
    peak = 0
    is_source = problem.lists().is_source
    for i, v in enumerate(seq):
        if not res.resident[v]:
            res.add(v)
        peak = max(peak, res.total - start)
        for q in preds[v]:
            if last.get(q) == i and q not in keep and not is_source[q] and res.resident[q]:
                res.remove(q)
        if v not in keep and v not in last and res.resident[v]:
            res.remove(v)
    return peak


def _choose_cuts(candidates: list[tuple[int, int]], position: dict[int, int], weight: np.ndarray,
                 max_stages: int) -> list[tuple[int, int]]:
    """Keep at most ``max_stages - 1`` of the (position, output) cuts: all of them when there
    are fewer, else cuts about equally spaced in cumulative weight. A cut whose output was
    produced before the previous kept cut is skipped: a stage must produce its own output."""
    total = float(weight.sum())
    # Few enough candidates: keep them all (only the own-output rule applies).
    target = total / max_stages if len(candidates) >= max_stages else 0.0
    cum = np.concatenate([[0.0], np.cumsum(weight)])
    kept: list[tuple[int, int]] = []
    last_pos = -1
    for pos, out in candidates:
        if out != -1 and position[out] <= last_pos:
            continue
        if cum[pos + 1] - cum[last_pos + 1] + 1e-12 < target:
            continue
        kept.append((pos, out))
        last_pos = pos
    return kept


# -------------------------------------------------------------- extraction
def _backward_stages(problem: Problem, backward: list[int], stage_of: dict[int, int], L: int) -> dict[int, int]:
    """Stage of each backward value: the latest forward stage it reads, but no later than
    the backward values it reads; values reading neither go with their earliest consumer."""
    INF = L
    bstage: dict[int, int] = {}
    preds, succs = problem.preds, problem.succs
    for v in backward:
        s = max((stage_of[p] for p in preds[v] if p in stage_of), default=INF)
        for p in preds[v]:
            b = bstage.get(p, INF)
            if b < s:
                s = b
        bstage[v] = s
    for v in reversed(backward):
        if bstage[v] == INF:
            bstage[v] = max((bstage[w] for w in succs[v] if w in bstage), default=0)
    return bstage


def extract_chain(problem: Problem, max_stages: int = DEFAULT_MAX_STAGES, pin_skips: bool = False) -> Chain:
    """The chain of ``problem`` (see the module doc). Raises `MethodFailed` when
    there is no backward part or fewer than two stages.

    ``pin_skips``: also pin forward values read far ahead in the forward part (more
    than 1/16 of it later: the skip connections of a U-Net, say), which otherwise
    leave no cut in between; they then stay resident from the forward to their last use.

    The chain is the graph's, whatever the budget: made once per graph (`Problem.budget_free_cache`),
    where rotor's runs asked for it four times a solve (0.7 s each on a 1.3B-parameter GPT's graph)."""
    key = ("chain", max_stages, pin_skips)
    cache = problem.budget_free_cache
    if key not in cache:
        try:
            cache[key] = _extract_chain(problem, max_stages, pin_skips)
        except MethodFailed as exc:
            cache[key] = str(exc)
    found = cache[key]
    if isinstance(found, str):
        raise MethodFailed(found)
    return found


def _extract_chain(problem: Problem, max_stages: int, pin_skips: bool) -> Chain:
    lists = problem.lists()
    preds, succs = problem.preds, problem.succs
    recomputable = lists.recomputable
    split = _split_value(problem)
    after = _descendants(problem, split)
    forward = _forward_order(problem, [v for v in problem.non_sources if v not in after], split)
    fwd_set = set(forward)
    backward = [v for v in problem.non_sources if v not in fwd_set]
    if not backward:
        raise MethodFailed("no backward part: the graph is not a forward+backward chain")
    pos = {v: i for i, v in enumerate(forward)}
    nf = len(forward)

    # Cuts: positions crossed by at most one recomputable forward value.
    pinned: set[int] = {v for v in forward if not recomputable[v]}
    if pin_skips:
        span = max(4, nf // 16)
        for v in forward:
            uses = [pos[w] for w in succs[v] if w in pos]
            if uses and max(uses) - pos[v] > span:
                pinned.add(v)
    crossing = np.zeros(nf + 1, dtype=np.int64)
    last_fwd_use = {}
    for v in forward:
        if v in pinned:
            continue
        uses = [pos[w] for w in succs[v] if w in pos]
        if uses:
            last_fwd_use[v] = max(uses)
            crossing[pos[v]] += 1
            crossing[max(uses)] -= 1
    crossing = np.cumsum(crossing)[:nf]  # crossing[k]: values live across the cut after position k
    # A storage shared by views must not be split between stages (each stage would count it):
    # no cut inside the span of an alias tree's forward members.
    roots = alias_trees(problem).root
    span: dict[int, list[int]] = {}
    for k, v in enumerate(forward):
        span.setdefault(int(roots[v]), [k, k])[1] = k  # positions increase: the last one is the max
    in_tree = np.zeros(nf + 1, dtype=np.int64)
    for r, (lo, hi) in span.items():
        if hi > lo:
            in_tree[lo] += 1
            in_tree[hi] -= 1
    crossing = crossing + np.cumsum(in_tree)[:nf] * 2  # a tree spanning k makes k no cut
    candidates: list[tuple[int, int]] = []
    live: set[int] = set()
    ends: dict[int, list[int]] = {}
    for k, v in enumerate(forward):
        for u in ends.pop(k, ()):  # values whose last forward read is at k stop crossing
            live.discard(u)
        if v in last_fwd_use:
            live.add(v)
            ends.setdefault(last_fwd_use[v], []).append(v)
        if k < nf - 1 and crossing[k] <= 1:
            assert len(live) == crossing[k]
            candidates.append((k, next(iter(live)) if live else -1))
    cost = problem.cost
    fcost = np.array([cost[v] for v in forward])
    weight = (fcost / max(fcost.sum(), 1e-300) + 1.0 / nf) / 2  # cost share, with a floor so cost-free runs count
    cuts = _choose_cuts(candidates, pos, weight, max_stages)
    if not cuts:
        raise MethodFailed("no chain structure: no cut in the forward part")
    # Merge stages until every backward stage reads only its own forward values and
    # the previous stage's output; small values read elsewhere are pinned instead.
    small = PIN_FRACTION * float(sum(problem.mem[v] for v in forward))
    while True:
        L = len(cuts) + 1
        bounds = [-1] + [c for c, _ in cuts] + [nf - 1]
        outputs = [out for _, out in cuts] + [split]
        stage_of = {v: k for k in range(L) for v in forward[bounds[k] + 1: bounds[k + 1] + 1]}
        bstage = _backward_stages(problem, backward, stage_of, L)
        merge = np.zeros(L, dtype=np.int64)  # +1/-1 marks: cut after stage k is removed where the sum > 0
        extra: set[int] = set()
        for v in forward:
            k = stage_of[v]
            for w in succs[v]:
                j = bstage.get(w)
                if j is None or j == k or (j == k + 1 and v == outputs[k]) or v in pinned:
                    continue
                if problem.mem[v] <= small and abs(j - k) > 2:
                    extra.add(v)  # far apart: pinning a small value beats merging many stages
                else:
                    lo, hi = min(j, k), max(j, k)
                    merge[lo] += 1
                    merge[hi] -= 1
        removed = np.cumsum(merge) > 0
        if not removed.any():
            pinned |= extra
            break
        cuts = [c for i, c in enumerate(cuts) if not removed[i]]
    if not cuts:
        raise MethodFailed("no chain structure: the backward reads across every cut")
    fwd_of_stage = [forward[bounds[k] + 1: bounds[k + 1] + 1] for k in range(L)]
    bwd_of_stage: list[list[int]] = [[] for _ in range(L)]
    for v in backward:
        bwd_of_stage[bstage[v]].append(v)
    # Forward values that neither the next stage, nor the backward, nor a pinned value
    # needs (forward sinks, say) are computed once too: pin them.
    for k in range(L):
        members = fwd_of_stage[k]
        mset = set(members)
        roots = [v for v in members if v in pinned or v == outputs[k]]
        roots += [p for w in bwd_of_stage[k] for p in preds[w] if p in mset]
        needed = _ancestors(problem, roots, mset)
        pinned.update(v for v in members if v not in needed)
    base = memory_of(problem, [])
    pinned_size = memory_of(problem, pinned) - base

    stages: list[Stage] = []
    for k in range(L):
        members = fwd_of_stage[k]
        mset = set(members)
        out = outputs[k]
        prev_out = outputs[k - 1] if k > 0 else -1
        prev_in = [prev_out] if prev_out != -1 and prev_out not in pinned else []
        movable = mset - pinned
        kept = {p for w in bwd_of_stage[k] for p in preds[w] if p in movable}
        if out != -1 and out not in pinned:
            kept.add(out)
        first = sorted(_ancestors(problem, ([out] if out != -1 else []) + [v for v in members if v in pinned], mset))
        advance = sorted(_ancestors(problem, [out] if out != -1 and out not in pinned else [], movable))
        full = sorted(_ancestors(problem, kept, movable))
        bwd = bwd_of_stage[k]
        grad_in = {p for w in bwd for p in preds[w] if p in bstage and bstage[p] > k}
        # Gradient handed to stage k-1: values of stages >= k read by stages < k.
        handed = {p for j in range(k) for w in bwd_of_stage[j] for p in preds[w] if p in bstage and bstage[p] >= k}
        sinks = {v for v in bwd if problem.is_sink[v]}
        out_keep = {out} if out != -1 and out not in pinned else set()
        peak_adv = _run(problem, Residency(problem, prev_in), advance, set(prev_in) | out_keep)
        res = Residency(problem, prev_in)
        before = res.total
        peak_all = _run(problem, res, full, set(prev_in) | kept)
        kept_size = res.total - before
        # The backward starts from the kept set as F_all left it, plus the gradient it reads.
        for v in sorted(grad_in):
            if not res.resident[v]:
                res.add(v)
        peak_b = _run(problem, res, bwd, set(prev_in) | handed | sinks)
        stages.append(Stage(
            forward=tuple(members), first=tuple(first), advance=tuple(advance), full=tuple(full),
            backward=tuple(bwd), output=out if out not in pinned else -1,
            cost_advance=float(sum(cost[v] for v in advance)), cost_all=float(sum(cost[v] for v in full)),
            cost_backward=float(sum(cost[v] for v in bwd)),
            out_size=int(problem.mem[out]) if out != -1 and out not in pinned else 0,
            kept_size=int(kept_size), peak_advance=int(peak_adv), peak_all=int(peak_all), peak_backward=int(peak_b),
            grad_size=int(memory_of(problem, handed) - base) if handed else 0,
            sink_size=int(memory_of(problem, sinks) - base) if sinks else 0,
            reads_input=bool(prev_in) and any(prev_in[0] in preds[w] for w in bwd),
            reads_output=bool(out_keep) and any(out in preds[w] for w in bwd),
        ))
    if L < 2:
        raise MethodFailed("no chain structure: a single stage")
    return Chain(stages=tuple(stages), pinned=frozenset(pinned), pinned_size=int(pinned_size), split=split, base=base)


# ------------------------------------------------------------ translation
class SequenceBuilder:
    """Turns chain operations into a compute order of the problem's values.

    ``advance(k)``: compute what stage k's output needs (on the first pass over
    the stage, also its pinned values); ``forward_all(k)``: compute what the
    output and B[k] need; ``backward(k)``: compute B[k]."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.seq: list[int] = []
        self.visited = [False] * chain.length

    def _first(self, k: int) -> bool:
        if self.visited[k]:
            return False
        self.visited[k] = True
        return True

    def advance(self, k: int) -> None:
        st = self.chain.stages[k]
        self.seq.extend(st.first if self._first(k) else st.advance)

    def forward_all(self, k: int) -> None:
        st = self.chain.stages[k]
        # The first pass computes every forward value of the stage, pinned ones included.
        self.seq.extend(st.forward if self._first(k) else st.full)

    def backward(self, k: int) -> None:
        self.seq.extend(self.chain.stages[k].backward)
