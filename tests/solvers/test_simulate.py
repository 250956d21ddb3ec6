"""simulate/validate on hand-built schedules: known peaks, every violation, aliases."""
import networkx as nx
import numpy as np
import pytest

from solvers import Problem, Schedule, ScheduleError, simulate, validate
from solvers.core.memory import Residency, memory_of

from .helpers import chain_problem, graph


def test_chain_peak_and_timeline():
    p = chain_problem([2, 3, 4], input_size=1)
    s = Schedule.from_list([("compute", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2"), ("free", "v1")])
    r = validate(p, s)
    # x=1 always; v0 -> 3; v1 -> 6; free v0 -> 4; v2 -> 8 (during compute: v1 + v2 + x); free v1 -> 5
    assert r.initial == 1
    assert r.timeline.tolist() == [3, 6, 4, 8, 5]
    assert r.peak == 8 and r.peak_step == 3
    assert r.cost == 3.0 and r.recomputations == 0
    assert r.final == 5 and r.fits


def test_recomputation_counted():
    p = chain_problem([1, 1, 1])
    s = Schedule.from_list([("compute", "v0"), ("compute", "v1"), ("free", "v0"), ("free", "v1"),
                            ("compute", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2")])
    r = simulate(p, s)
    assert r.cost == 5.0
    assert r.recomputations == 2
    assert r.computes[p.index["v0"]] == 2


def test_budget_exceeded_names_step():
    p = chain_problem([2, 3, 4], budget=7)
    s = Schedule.from_list([("compute", "v0"), ("compute", "v1"), ("free", "v0"), ("compute", "v2")])
    r = simulate(p, s)  # simulate reports, does not raise
    assert r.over_budget_step == 3 and not r.fits and r.peak == 8
    with pytest.raises(ScheduleError, match="step 3") as e:
        validate(p, s)
    assert e.value.kind == "over-budget" and e.value.step == 3


def test_inputs_alone_over_budget():
    p = chain_problem([1], budget=0, input_size=5)
    with pytest.raises(ScheduleError, match="inputs alone") as e:
        validate(p, Schedule.from_list([("compute", "v0")]))
    assert e.value.step == -1


@pytest.mark.parametrize("steps, kind, pattern", [
    ([("compute", "v1")], "read-not-resident", "reads 'v0', which is not resident"),
    ([("compute", "x")], "compute-source", "source"),
    ([("free", "x")], "free-source", "source"),
    ([("free", "v0")], "free-not-resident", "not resident"),
    ([("compute", "v0"), ("compute", "v0")], "already-resident", "already resident"),
    ([("compute", "zz")], "unknown-node", "unknown node"),
    ([("compute", "v0")], "never-computed", "'v1' is never computed"),
    ([("compute", "v0"), ("compute", "v1"), ("free", "v1")], "sink-missing", "sink 'v1'"),
    ([("compute", "v0"), ("offload", "v0")], "no-host-link", "no host link"),
])
def test_each_violation(steps, kind, pattern):
    p = chain_problem([1, 1])
    with pytest.raises(ScheduleError, match=pattern) as e:
        validate(p, Schedule.from_list(steps))
    assert e.value.kind == kind


def test_first_violation_wins():
    p = chain_problem([5, 5], budget=7)
    # Step 1 goes over budget before step 2's bad free.
    steps = [("compute", "v0"), ("compute", "v1"), ("free", "x")]
    with pytest.raises(ScheduleError) as e:
        validate(p, Schedule.from_list(steps))
    assert e.value.kind == "over-budget" and e.value.step == 1
    with pytest.raises(ScheduleError) as e:
        simulate(p, Schedule.from_list(steps))
    assert e.value.kind == "free-source"


def test_unknown_op_string():
    p = chain_problem([1])
    with pytest.raises(ScheduleError) as e:
        validate(p, [("launch", "v0")])
    assert e.value.kind == "unknown-op"


def test_non_recomputable_computed_twice():
    G = graph({"x": (1, 0), "mask": (2, 1.0, {"recomputable": False}), "y": (1, 1.0)},
              [("x", "mask"), ("mask", "y")])
    p = Problem.from_networkx(G, 100)
    s = [("compute", "mask"), ("free", "mask"), ("compute", "mask"), ("compute", "y")]
    with pytest.raises(ScheduleError, match="not recomputable") as e:
        validate(p, s)
    assert e.value.kind == "recompute-forbidden" and e.value.step == 2


def test_during_compute_counts_inputs_and_output():
    # Diamond: peak while computing d = a + b + c + d + x.
    G = graph({"x": (1, 0), "a": (2, 1), "b": (3, 1), "c": (4, 1), "d": (5, 1)},
              [("x", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    p = Problem.from_networkx(G, 100)
    s = [("compute", "a"), ("compute", "b"), ("compute", "c"), ("free", "a"), ("compute", "d"),
         ("free", "b"), ("free", "c")]
    r = validate(p, s)
    assert r.peak == 1 + 3 + 4 + 5 and r.timeline.tolist() == [3, 6, 10, 8, 13, 10, 6]


# ----------------------------------------------------------------- aliases

def _views():
    # base (8) -> view1 (aliases base, 8) -> view2 (aliases view1, 8) -> out (1)
    G = graph({"x": (1, 0), "base": (8, 1), "view1": (8, 0.1, {"alias_of": "base"}),
               "view2": (8, 0.1, {"alias_of": "view1"}), "out": (1, 1)},
              [("x", "base"), ("base", "view1"), ("view1", "view2"), ("view2", "out")])
    return Problem.from_networkx(G, 100)


def test_view_chain_shares_storage():
    p = _views()
    s = [("compute", "base"), ("compute", "view1"), ("compute", "view2"), ("free", "view1"),
         ("compute", "out"), ("free", "view2"), ("free", "base")]
    r = validate(p, s)
    # Views add nothing while their base (or an alias ancestor) is resident.
    assert r.timeline.tolist() == [9, 9, 9, 9, 10, 10, 2]
    assert r.peak == 10


def test_view_counts_once_base_is_gone():
    p = _views()
    # Free the base first: view1 then counts its own size; view2 stays covered by view1.
    s = [("compute", "base"), ("compute", "view1"), ("compute", "view2"), ("free", "base"),
         ("free", "view1"), ("compute", "out"), ("free", "view2")]
    r = validate(p, s)
    assert r.timeline.tolist() == [9, 9, 9, 9, 9, 10, 2]


def test_freeing_a_base_can_raise_memory():
    # A view bigger than its base (e.g. an expand accounted at full size): freeing
    # the base makes the view count, so memory goes up on a free.
    G = graph({"x": (1, 0), "base": (2, 1), "big": (6, 0.1, {"alias_of": "base"}), "out": (1, 1)},
              [("x", "base"), ("base", "big"), ("big", "out")])
    p = Problem.from_networkx(G, 5)
    s = [("compute", "base"), ("compute", "big"), ("free", "base"), ("compute", "out"), ("free", "big")]
    r = simulate(p, s)
    assert r.timeline.tolist() == [3, 3, 7, 8, 2]
    with pytest.raises(ScheduleError, match="step 2"):
        validate(p, s)


def test_tuple_and_getitems():
    # A multi-output op: the tuple owns the storage, the getitems alias it.
    G = graph({"x": (1, 0), "tup": (10, 2), "g0": (4, 0.0, {"alias_of": "tup"}),
               "g1": (6, 0.0, {"alias_of": "tup"}), "use0": (1, 1), "use1": (1, 1)},
              [("x", "tup"), ("tup", "g0"), ("tup", "g1"), ("g0", "use0"), ("g1", "use1")])
    p = Problem.from_networkx(G, 100)
    s = [("compute", "tup"), ("compute", "g0"), ("compute", "g1"), ("free", "tup"),
         ("compute", "use0"), ("free", "g0"), ("compute", "use1"), ("free", "g1")]
    r = validate(p, s)
    assert r.timeline.tolist() == [11, 11, 11, 11, 12, 8, 9, 3]


def _split():
    # qkv (12) -> q, k, v: views of all of qkv's storage (as split/unbind outputs are), one
    # (part) of it only; each read by its own consumer.
    G = graph({"x": (1, 0), "qkv": (12, 2), "q": (12, 0.0, {"alias_of": "qkv", "same_storage": True}),
               "k": (12, 0.0, {"alias_of": "qkv", "same_storage": True}),
               "qt": (12, 0.0, {"alias_of": "q", "same_storage": True}), "part": (4, 0.0, {"alias_of": "qkv"}),
               "a": (1, 1), "b": (1, 1), "c": (1, 1)},
              [("x", "qkv"), ("qkv", "q"), ("qkv", "k"), ("q", "qt"), ("qkv", "part"),
               ("qt", "a"), ("k", "a"), ("k", "b"), ("part", "c")])
    return Problem.from_networkx(G, 100)


def test_views_of_one_whole_storage_count_it_once():
    p = _split()
    s = [("compute", "qkv"), ("compute", "q"), ("compute", "k"), ("compute", "qt"), ("compute", "part"),
         ("free", "qkv"), ("free", "q"),
         # qt and k hold qkv's one storage (12); the part counts on its own (4)
         ("compute", "a"), ("free", "qt"), ("compute", "b"), ("free", "k"), ("compute", "c"), ("free", "part")]
    r = validate(p, s)
    assert r.timeline.tolist() == [13, 13, 13, 13, 13, 17, 17, 18, 18, 19, 7, 8, 4]
    # Without the marks every view may hold a different part: each counts.
    plain = Problem(p.names, p.preds, p.mem, p.cost, p.recomputable, p.alias_of, 100)
    assert simulate(plain, s).timeline.tolist()[5:8] == [29, 29, 30]


def test_views_of_two_instances_of_a_storage_count_twice():
    p = _split()
    # q is made from the first qkv, k and part from a recomputed one: two storages.
    s = [("compute", "qkv"), ("compute", "q"), ("free", "qkv"), ("compute", "qkv"), ("compute", "k"),
         ("compute", "part"), ("free", "qkv"), ("compute", "qt"), ("free", "q"), ("compute", "a"), ("free", "qt"),
         ("compute", "b"), ("free", "k"), ("compute", "c"), ("free", "part")]
    assert validate(p, s).timeline.tolist() == [13, 13, 13, 25, 25, 25, 29, 29, 29, 30, 18, 19, 7, 8, 4]
    # A resident set given outright (no schedule) is one instance of each storage.
    assert memory_of(p, [p.index["q"], p.index["k"], p.index["qt"]]) == 1 + 12


def test_same_storage_needs_a_base_of_the_same_size():
    with pytest.raises(ValueError, match="same_storage"):
        Problem.from_networkx(graph({"x": (1, 0), "y": (2, 1), "z": (1, 0.0, {"alias_of": "y", "same_storage": True})},
                                    [("x", "y"), ("y", "z")]), 10)
    with pytest.raises(ValueError, match="same_storage"):
        Problem.from_networkx(graph({"x": (1, 0), "y": (2, 1, {"same_storage": True})}, [("x", "y")]), 10)
    p = _split()
    back = Problem.from_json(p.to_json())
    assert back.same_storage.tolist() == p.same_storage.tolist() and p.same_storage.sum() == 3
    assert Problem.from_networkx(p.to_networkx(), 100).same_storage.tolist() == p.same_storage.tolist()
    assert p.with_host(1.0).same_storage.tolist() == p.same_storage.tolist()


def test_view_of_input_is_free():
    G = graph({"x": (5, 0), "xv": (5, 0.0, {"alias_of": "x"}), "y": (2, 1)}, [("x", "xv"), ("xv", "y")])
    p = Problem.from_networkx(G, 100)
    r = validate(p, [("compute", "xv"), ("compute", "y"), ("free", "xv")])
    assert r.timeline.tolist() == [5, 7, 7]


def _from_scratch(p, resident: set, storage: dict) -> int:
    """Reference: a resident value counts unless an alias ancestor on the same storage
    instance (every link in between on that instance too) is resident; values that hold
    one whole storage (same_storage links up to the same member, same instance) count once."""
    total, counted = 0, set()
    for v in resident:
        a, covered = int(p.alias_of[v]), False
        while a >= 0 and storage.get(a) == storage.get(v):
            if a in resident:
                covered = True
                break
            a = int(p.alias_of[a])
        whole = v
        while p.same_storage[whole]:
            whole = int(p.alias_of[whole])
        if not covered and (whole, storage.get(v)) not in counted:
            counted.add((whole, storage.get(v)))
            total += int(p.mem[v])
    return total


@pytest.mark.parametrize("make", [_views, _split])
def test_residency_matches_from_scratch_sums(make):
    # Incremental alias arithmetic equals a from-scratch evaluation on random toggles,
    # where every add of a value that owns its storage makes a new storage instance.
    p = make()
    rng = np.random.default_rng(0)
    res = Residency(p)
    resident = set(p.sources)
    storage = {v: ("source", v) for v in p.sources}
    made = 0
    for _ in range(400):
        v = int(rng.choice(p.non_sources))
        if v in res:
            res.remove(v)
            resident.discard(v)
        else:
            res.add(v)
            resident.add(v)
            a = int(p.alias_of[v])
            made += 1
            storage[v] = storage.get(a, ("new", made)) if a >= 0 else ("new", made)
        assert res.total == _from_scratch(p, resident, storage)
    # Without recomputation the instances never differ: the plain alias rule.
    fresh = Residency(p)
    for v in p.non_sources:
        fresh.add(v)
    assert fresh.total == memory_of(p, p.non_sources)


def test_a_view_of_an_earlier_instance_counts_beside_the_recomputed_base():
    # base -> view; the base is freed and computed again while the old view lives:
    # two storages exist, as in the runtime.
    G = nx.DiGraph()
    G.add_node("x", mem=1, cost=0.0)
    G.add_node("base", mem=10, cost=1.0)
    G.add_node("view", mem=10, cost=0.0, alias_of="base")
    G.add_node("out", mem=1, cost=1.0)
    G.add_edges_from([("x", "base"), ("base", "view"), ("view", "out"), ("base", "out")])
    p = Problem.from_networkx(G, 100)
    r = simulate(p, Schedule.from_list([("compute", "base"), ("compute", "view"), ("free", "base"),
                                        ("compute", "base"), ("compute", "out"), ("free", "view"),
                                        ("free", "base")]))
    assert list(r.timeline) == [11, 11, 11, 21, 22, 12, 2]


def test_schedule_json_round_trip(tmp_path):
    s = Schedule.from_list([("compute", "a"), ("compute", 3), ("free", "a")])
    again = Schedule.from_json(s.to_json())
    assert again == s and list(again) == list(s)
    op, node = again[1]
    assert op == "compute" and node == 3
    s.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json") == s


def test_views_apart_never_counts_fewer_bytes():
    # `Problem.with_views_apart` is the rule that counts each view on its own: at every step
    # of any schedule it holds at least the bytes of the exact rule, so a plan that fits it fits.
    from solvers import METHODS
    from solvers.core import generators as gen

    compared = shared = 0
    for seed in range(40):
        p = Problem.from_networkx(gen.random_dag(12, seed=seed, view_prob=0.6, same_storage_prob=0.8), 10**9)
        apart = p.with_views_apart()
        assert not apart.same_storage.any() and apart.budget == p.budget
        assert Problem.from_networkx(gen.random_dag(6, seed=seed), 1).with_views_apart().same_storage.sum() == 0
        for method in ("store_all", "greedy", "recompute_all"):
            for budget in (10**9, int(simulate(p, METHODS["store_all"](p, None).schedule).peak * 0.7)):
                q = p.with_budget(budget)
                sol = METHODS[method](q, None)
                exact, counted_apart = simulate(q, sol.schedule), simulate(q.with_views_apart(), sol.schedule)
                assert (exact.timeline <= counted_apart.timeline).all() and exact.cost == counted_apart.cost
                compared += 1
                shared += bool((exact.timeline < counted_apart.timeline).any())
    assert compared == 240 and shared > 10, shared
