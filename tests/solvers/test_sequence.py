"""plan -> schedule: frees after last use, sinks kept, keep sets, plan errors."""
import pytest

from solvers import (
    PlanError,
    Problem,
    StagePlan,
    schedule_from_plan,
    schedule_from_sequence,
    validate,
)

from .helpers import chain_problem, graph


def test_frees_after_last_use():
    p = chain_problem([1, 1, 1])
    s = schedule_from_sequence(p, [1, 2, 3])
    assert [(op.value, n) for op, n in s] == [("compute", "v0"), ("compute", "v1"), ("free", "v0"),
                                              ("compute", "v2"), ("free", "v1")]


def test_recompute_frees_old_instance_first():
    p = chain_problem([1, 1, 1])
    # v0, v1, then recompute v0 (old instance already dead), v2 reads v1.
    s = schedule_from_sequence(p, [1, 2, 1, 3])
    validate(p, s)
    assert [(op.value, n) for op, n in s][:4] == [("compute", "v0"), ("compute", "v1"), ("free", "v0"),
                                                  ("compute", "v0")]


def test_unread_value_freed_immediately_and_sink_kept():
    G = graph({"x": (1, 0), "a": (1, 1), "dead": (5, 1), "b": (1, 1)}, [("x", "a"), ("a", "dead"), ("a", "b")])
    G.add_edge("dead", "b")
    p = Problem.from_networkx(G, 100)
    s = schedule_from_sequence(p, [1, 2, 3])
    ops = [(op.value, n) for op, n in s]
    assert ("free", "b") not in ops  # the sink stays
    assert ops[-1] == ("free", "dead") or ops[-2:] == [("free", "dead"), ("free", "a")]


def test_keep_extends_lifetime_to_stage_end():
    p = chain_problem([1, 1, 1, 1])
    plan = StagePlan(stages=((1,), (2,), (3,), (4,)), keep=(frozenset(), frozenset({1}), frozenset(), frozenset()))
    s = schedule_from_plan(p, plan)
    ops = [(op.value, n) for op, n in s]
    # v0 would die after v1 is computed; keep holds it through stage 1, which ends there too.
    assert ops.index(("free", "v0")) == ops.index(("compute", "v1")) + 1
    plan = StagePlan(stages=((1,), (2,), (3,), (4,)), keep=(frozenset(), frozenset(), frozenset({1}), frozenset()))
    ops = [(op.value, n) for op, n in schedule_from_plan(p, plan)]
    assert ops.index(("free", "v0")) > ops.index(("compute", "v2"))


def test_views_freed_before_bases():
    G = graph({"x": (1, 0), "a": (4, 1), "va": (4, 0, {"alias_of": "a"}), "b": (1, 1)},
              [("x", "a"), ("a", "va"), ("va", "b"), ("a", "b")])
    p = Problem.from_networkx(G, 100)
    ops = [(op.value, n) for op, n in schedule_from_sequence(p, [1, 2, 3])]
    assert ops[-2:] == [("free", "va"), ("free", "a")]


def test_plan_errors():
    p = chain_problem([1, 1])
    with pytest.raises(PlanError, match="before its input"):
        schedule_from_sequence(p, [2])
    with pytest.raises(PlanError, match="source"):
        schedule_from_sequence(p, [0])
