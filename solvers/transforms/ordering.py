"""Write-after-read order: move a step that overwrites a source after every read of that source.

A `Problem` is a DAG of values; it cannot say that computing one value
overwrites another in place (an optimizer update writes its parameter). A
solver may then place such a *writer* before a computation that still reads
the old contents: a backward op that reads the weight or a view of it (a
transposed weight shares its storage), or a recomputation of a forward op. `after_last_reads` repairs a schedule: each writer whose source
is read later is moved to right after that last read, together with the
steps that belong to it (the computes of its successors that read nothing
else, its own free, and the frees of inputs it was the last to read). The
moved schedule is valid whenever the original was; its memory is the
simulator's to judge (inputs held longer to the new position may raise the
peak).
"""
from __future__ import annotations

from typing import Hashable, Mapping

from ..core.memory import alias_trees
from ..core.problem import Problem
from ..core.schedule import Op, Schedule, Step


def storage_readers(problem: Problem, target: int) -> frozenset[int]:
    """``target`` and every view of its storage: reading any of them reads what a writer overwrites."""
    return frozenset((target, *alias_trees(problem).descendants.get(target, ())))


def _last_read(problem: Problem, steps: list[Step], targets: frozenset[int], writer: int) -> int:
    """Position of the last compute (other than ``writer``) that reads one of ``targets``; -1 if none."""
    index, preds = problem.index, problem.preds
    last = -1
    for k, (op, node) in enumerate(steps):
        if op is Op.COMPUTE:
            v = index[node]
            # Taking a view of the storage reads nothing: its readers are targets' readers too.
            if v != writer and v not in targets and targets.intersection(preds[v]):
                last = k
    return last


def _belonging(problem: Problem, steps: list[Step], at: int) -> list[int]:
    """Positions of the steps that go with the writer computed at ``at``: the computes of its
    successors that read only it, then its own free and the frees of its inputs that nothing
    reads between ``at`` and that free."""
    index, preds, succs = problem.index, problem.preds, problem.succs
    writer = index[steps[at].node]
    followers = {s for s in succs[writer] if preds[s] == (writer,)}
    owned = [at]
    pending_inputs = set(preds[writer])
    for k in range(at + 1, len(steps)):
        op, node = steps[k]
        v = index[node]
        if op is Op.COMPUTE:
            if v in followers:
                owned.append(k)
                continue
            pending_inputs -= set(preds[v])  # read again later: its free is not the writer's
        elif op is Op.FREE and (v == writer or v in followers or v in pending_inputs):
            owned.append(k)
            pending_inputs.discard(v)
    return owned


def after_last_reads(problem: Problem, schedule: Schedule,
                     writes: Mapping[Hashable, Hashable | tuple[Hashable, ...]]) -> Schedule:
    """``schedule`` with each writer (a key of ``writes``, naming the source it overwrites, or a
    tuple of the sources) moved after the last compute that reads one of those sources or a view
    of one, with the steps that belong to it."""
    index = problem.index
    steps = list(schedule.steps)
    for writer_name, targets in writes.items():
        writer = index[writer_name]
        at = next((k for k, (op, node) in enumerate(steps) if op is Op.COMPUTE and index[node] == writer), None)
        if at is None:
            continue
        readers = frozenset().union(*(storage_readers(problem, index[t])
                                for t in (targets if isinstance(targets, tuple) else (targets,))))
        last = _last_read(problem, steps, readers, writer)
        if last < at:
            continue
        owned = _belonging(problem, steps, at)
        moved = [steps[k] for k in owned]
        gone = set(owned)
        kept = [s for k, s in enumerate(steps) if k not in gone]
        insert = last + 1 - sum(1 for k in owned if k <= last)
        steps = kept[:insert] + moved + kept[insert:]
    return Schedule(tuple(steps))
