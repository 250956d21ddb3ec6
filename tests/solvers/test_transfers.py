"""The simulator's host link: offload/prefetch semantics, copy-stream timing,
waits, device memory during transfers, and every transfer rule it enforces."""
from __future__ import annotations

import networkx as nx
import pytest

from solvers import Problem, Schedule, ScheduleError, simulate, validate


def _chain(sizes: list[int], costs: list[float], budget: int = 10**9, bandwidth: float = 1.0,
           capacity: int | None = None) -> Problem:
    """x -> v0 -> v1 -> ... ; a host link moving ``bandwidth`` bytes per time unit."""
    G = nx.DiGraph()
    G.add_node("x", mem=1, cost=0.0)
    prev = "x"
    for i, (m, c) in enumerate(zip(sizes, costs)):
        G.add_node(f"v{i}", mem=m, cost=c)
        G.add_edge(prev, f"v{i}")
        prev = f"v{i}"
    return Problem.from_networkx(G, budget, host_bandwidth=bandwidth, host_capacity=capacity)


def _skip(sizes: list[int], costs: list[float], **kw) -> Problem:
    """A chain where the last value also reads v0 (a long skip connection)."""
    p = _chain(sizes, costs, **kw)
    G = p.to_networkx()
    G.add_edge("v0", f"v{len(sizes) - 1}")
    return Problem.from_networkx(G, p.budget, p.host_bandwidth, p.host_capacity)


def test_without_transfers_time_equals_cost():
    p = _chain([2, 3, 4], [1.0, 2.0, 3.0])
    r = simulate(p, Schedule.from_list([("compute", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2"),
                                        ("free", "v1")]))
    assert r.time == r.cost == 6.0 and r.wait == 0 and r.transferred == 0 and r.host_peak == 0


def test_overlapped_offload_and_prefetch_cost_no_time():
    # v0 (4 bytes, 4 time units to copy) idles while v1..v4 run (10 units each).
    p = _skip([4, 1, 1, 1, 1], [1.0, 10.0, 10.0, 10.0, 1.0], bandwidth=1.0)
    steps = [("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2"),
             ("free", "v1"), ("prefetch", "v0"), ("compute", "v3"), ("free", "v2"), ("compute", "v4"),
             ("free", "v3"), ("free", "v0")]
    r = validate(p, Schedule.from_list(steps))
    assert r.cost == 32.0 and r.time == 32.0 and r.wait == 0.0
    assert r.transferred == 8 and r.host_peak == 4
    # device memory: x=1 always; v0 gone between its free and its prefetch
    assert list(r.timeline) == [5, 5, 6, 2, 3, 2, 6, 7, 6, 7, 6, 2]


def test_compute_waits_for_a_late_prefetch():
    p = _skip([4, 1, 1, 1, 1], [1.0, 10.0, 10.0, 1.0, 1.0], bandwidth=1.0)
    steps = [("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2"),
             ("free", "v1"), ("compute", "v3"), ("free", "v2"), ("prefetch", "v0"), ("compute", "v4"),
             ("free", "v3"), ("free", "v0")]
    r = validate(p, Schedule.from_list(steps))
    # v3 ends at 22; the prefetch takes 4 units, so v4 starts at 26 instead of 22.
    assert r.wait == pytest.approx(4.0) and r.time == pytest.approx(27.0) and r.cost == pytest.approx(23.0)


def test_free_waits_for_its_offload_and_copies_queue_per_direction():
    p = _chain([4, 4, 1], [1.0, 1.0, 1.0], bandwidth=1.0)
    steps = [("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("offload", "v1"), ("free", "v0"),
             ("compute", "v2"), ("free", "v1")]
    r = simulate(p, Schedule.from_list(steps))
    # v0's copy runs 1..5; v1's queues behind it, 5..9. free v0 waits until 5; free v1 until 9.
    assert r.time == pytest.approx(9.0) and r.wait == pytest.approx(3.0 + 3.0)
    assert r.host_peak == 8


def test_prefetch_counts_from_issue_and_can_exceed_budget():
    p = _skip([4, 1, 1], [1.0, 10.0, 1.0], budget=6, bandwidth=1.0)
    ok = [("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("free", "v0"), ("prefetch", "v0"),
          ("compute", "v2"), ("free", "v1"), ("free", "v0")]
    with pytest.raises(ScheduleError) as e:
        validate(p, Schedule.from_list(ok))  # x + v1 + v0 + v2 = 7 > 6 while v2 computes
    assert e.value.kind == "over-budget"
    assert simulate(p, Schedule.from_list(ok)).peak == 7


def test_reads_of_offloaded_values_need_a_prefetch():
    p = _skip([4, 1, 1], [1.0, 1.0, 1.0])
    steps = [("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2")]
    with pytest.raises(ScheduleError) as e:
        simulate(p, Schedule.from_list(steps))
    assert e.value.kind == "read-not-resident"


def test_a_host_copy_serves_several_prefetches():
    p = _skip([4, 1, 1], [1.0, 10.0, 1.0])
    steps = [("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("free", "v0"), ("prefetch", "v0"),
             ("free", "v0"), ("prefetch", "v0"), ("compute", "v2"), ("free", "v1"), ("free", "v0")]
    r = validate(p, Schedule.from_list(steps))
    assert r.transferred == 12 and r.host_peak == 4


@pytest.mark.parametrize("steps, kind", [
    ([("offload", "v0")], "offload-not-resident"),
    ([("compute", "v0"), ("offload", "v0"), ("offload", "v0")], "already-offloaded"),
    ([("prefetch", "v0")], "prefetch-no-copy"),
    ([("compute", "v0"), ("offload", "v0"), ("prefetch", "v0")], "already-resident"),
    ([("offload", "x")], "offload-forbidden"),
    ([("compute", "v0"), ("offload", "v0"), ("compute", "v1"), ("offload", "v1")], "host-full"),
])
def test_transfer_rules(steps, kind):
    p = _chain([4, 4], [1.0, 1.0], capacity=6)
    with pytest.raises(ScheduleError) as e:
        simulate(p, Schedule.from_list(steps))
    assert e.value.kind == kind


def test_views_cannot_be_offloaded():
    G = nx.DiGraph()
    G.add_node("x", mem=1, cost=0.0)
    G.add_node("a", mem=4, cost=1.0)
    G.add_node("view", mem=4, cost=0.0, alias_of="a")
    G.add_edges_from([("x", "a"), ("a", "view")])
    p = Problem.from_networkx(G, 100, host_bandwidth=1.0)
    with pytest.raises(ScheduleError) as e:
        simulate(p, Schedule.from_list([("compute", "a"), ("compute", "view"), ("offload", "view")]))
    assert e.value.kind == "offload-forbidden"


def test_host_link_round_trips_through_json():
    p = _chain([4, 4], [1.0, 1.0], bandwidth=2.5, capacity=6)
    q = Problem.from_json(p.to_json())
    assert q.host_bandwidth == 2.5 and q.host_capacity == 6
    assert q.with_budget(3).host_bandwidth == 2.5
    assert Problem.from_json(p.with_host(0.0).to_json()).has_host is False


def test_values_marked_not_offloadable_are_rejected_and_survive_io():
    G = _chain([4, 1], [1.0, 1.0]).to_networkx()
    G.nodes["v0"]["offloadable"] = False  # e.g. a bookkeeping value with no tensor behind it
    p = Problem.from_networkx(G, 10**9, host_bandwidth=1.0)
    with pytest.raises(ScheduleError) as info:
        simulate(p, Schedule.from_list([("compute", "v0"), ("offload", "v0")]))
    assert info.value.kind == "offload-forbidden"
    for q in (Problem.from_json(p.to_json()), Problem.from_networkx(p.to_networkx(), p.budget, 1.0),
              p.with_host(2.0)):
        assert list(q.offloadable) == [False, False, True]  # the source x is never offloadable
    from solvers.transforms.paging import add_offloads

    paged = add_offloads(p.with_budget(3), Schedule.from_list([("compute", "v0"), ("compute", "v1")]))
    assert "v0" not in paged.offloads()


def _held_by_view(depth: int) -> tuple[Problem, Schedule]:
    """x -> b (8 bytes) -> a chain of ``depth`` views of b; b itself is freed at once and
    only the last view holds b's storage across c1..c4 (slow, 4 bytes), read by the end."""
    G = nx.DiGraph()
    G.add_node("x", mem=1, cost=0.0)
    G.add_node("b", mem=8, cost=1.0)
    G.add_edge("x", "b")
    prev = "b"
    for i in range(depth):
        G.add_node(f"w{i}", mem=8, cost=0.0, alias_of=prev)
        G.add_edge(prev, f"w{i}")
        prev = f"w{i}"
    last = "x"
    for i in range(1, 5):
        G.add_node(f"c{i}", mem=4, cost=10.0)
        G.add_edge(last, f"c{i}")
        last = f"c{i}"
    G.add_node("end", mem=1, cost=1.0)
    G.add_edge(last, "end")
    G.add_edge(prev, "end")
    p = Problem.from_networkx(G, 10**9, host_bandwidth=4.0)
    steps = [("compute", "b")] + [("compute", f"w{i}") for i in range(depth)]
    steps += [("free", "b")] + [("free", f"w{i}") for i in range(depth - 1)]
    steps += [("compute", "c1"), ("compute", "c2"), ("free", "c1"), ("compute", "c3"), ("free", "c2"),
              ("compute", "c4"), ("free", "c3"), ("compute", "end")]
    return p, Schedule.from_list(steps)


@pytest.mark.parametrize("depth", [1, 3])
def test_storage_held_only_by_views_is_paged_out(depth):
    from solvers.transforms.paging import add_offloads

    p, schedule = _held_by_view(depth)
    before = simulate(p, schedule)
    assert before.peak == 17  # x, b's storage, two chain values
    budget = 14  # x, b back, c4 and the end
    paged = add_offloads(p.with_budget(budget), schedule)
    r = validate(p.with_budget(budget), paged)
    assert paged.offloads()[0] == "b"  # the storage only views hold goes first
    assert r.cost == before.cost  # views are re-made for free
    print(f"depth {depth}: offloaded {paged.offloads()}, time {r.time} (compute {r.cost})")


def test_host_work_overlaps_compute_and_ends_the_step_when_it_is_later():
    # v0 and v1 each start 5 units of host work (an update computed in host memory); the host
    # runs them one after another, beside compute.
    def problem(last_cost: float) -> Problem:
        G = nx.DiGraph()
        G.add_node("x", mem=1, cost=0.0)
        G.add_node("v0", mem=1, cost=1.0, host_work=5.0)
        G.add_node("v1", mem=1, cost=1.0, host_work=5.0)
        G.add_node("v2", mem=1, cost=last_cost)
        G.add_edges_from([("x", "v0"), ("x", "v1"), ("x", "v2")])
        return Problem.from_networkx(G, 10**9)

    steps = Schedule.from_list([("compute", "v0"), ("compute", "v1"), ("compute", "v2")])
    # host: v0's work 1..6, v1's 6..11; compute ends at 2 + last_cost
    assert simulate(problem(20.0), steps).time == pytest.approx(22.0)  # hidden behind compute
    late = simulate(problem(1.0), steps)
    assert late.time == pytest.approx(11.0) and late.cost == pytest.approx(3.0)
    # The attribute survives networkx and JSON round trips.
    p = problem(1.0)
    assert Problem.from_json(p.to_json()).host_work.tolist() == p.host_work.tolist() == [0.0, 5.0, 5.0, 0.0]
    assert Problem.from_networkx(p.to_networkx(), p.budget).host_work.tolist() == p.host_work.tolist()
