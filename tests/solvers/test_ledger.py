"""The step ledger (`solvers.strategies.ledger`): one budget shared by the plans of a step."""
from __future__ import annotations

from solvers.strategies.ledger import StepLedger


def _step(ledger: StepLedger, plans: list[dict], carried: list[int]) -> list[int]:
    """Run one step of ``plans`` (forward in order, backward in reverse); the allowance each got."""
    allowances, tokens = [], []
    for plan, c in zip(plans, carried):
        call = ledger.begin(plan["params"], plan["grads"], plan.get("inputs"), frozenset(plan.get("reads", ())))
        allowances.append(ledger.allowance(call))
        tokens.append(ledger.hold(call, c, plan.get("returns")))
    for token in reversed(tokens):
        ledger.release(token)
    return allowances


def test_allowances_count_what_the_others_hold_in_the_first_and_later_steps():
    plans = [
        {"params": {"w0": 100}, "grads": {"g0": 100}, "inputs": {"x": 10}},
        {"params": {"w1": 200}, "grads": {"g1": 200}},
        {"params": {"w2": 50}, "grads": {"g2": 50}},
    ]
    ledger = StepLedger(10_000)
    first = _step(ledger, plans, carried=[1000, 2000, 3000])
    # First step: only the plans seen so far, and what the earlier ones carry (the batch x counts
    # for every plan but the first, which reads it).
    assert first == [10_000, 10_000 - 100 - 10 - 1000, 10_000 - 100 - 200 - 10 - 1000 - 2000]
    second = _step(ledger, plans, carried=[1000, 2000, 3000])
    # Every step after: every other plan's parameters, and during each backward the gradients of
    # the plans after it (already made, kept to the step's end).
    assert second == [
        10_000 - 200 - 50 - (200 + 50),
        10_000 - 100 - 50 - 10 - 1000 - 50,
        10_000 - 100 - 200 - 10 - 1000 - 2000,
    ]
    assert ledger.complete and not ledger.live


def test_what_a_plan_returns_counts_once_and_not_against_the_plan_that_reads_it():
    ledger = StepLedger(10_000)
    a = ledger.begin({"wa": 100}, {}, {}, frozenset())
    ledger.hold(a, 500, {"h": 300})
    b = ledger.begin({"wb": 100}, {}, {}, frozenset({"h"}))  # reads h: h is in its own plan
    assert ledger.allowance(b) == 10_000 - 100 - 500
    ledger.hold(b, 0, {"h2": 40})
    c = ledger.begin({"wb": 100}, {}, {}, frozenset({"h2"}))  # shares wb with b: counted once
    assert ledger.allowance(c) == 10_000 - 100 - 500 - 300


def test_a_short_plan_makes_the_earlier_ones_carry_less_from_the_next_step():
    ledger = StepLedger(1000)
    tokens = []
    for c in (600, 200):
        call = ledger.begin({}, {}, {}, frozenset())
        tokens.append(ledger.hold(call, c))
    last = ledger.begin({}, {}, {}, frozenset())
    assert ledger.allowance(last) == 200
    ledger.short(last, 400)  # its smallest plan needs 600
    assert ledger.carry_limit(last) is None
    for t in tokens:
        ledger.release(t)
    first = ledger.begin({}, {}, {}, frozenset())  # a new step: the limits apply
    assert ledger.carry_limit(first) == 600 - 300  # 3/4 of the 400, in proportion to 600 of 800
    assert ledger.reserve == {0: 300, 1: 100}


def test_releasing_twice_and_a_step_that_never_ran_backward():
    ledger = StepLedger(1000)
    call = ledger.begin({}, {}, {}, frozenset())
    token = ledger.hold(call, 100)
    ledger.release(token)
    ledger.release(token)
    assert not ledger.live
    again = ledger.begin({}, {}, {}, frozenset())
    assert again.position == 0 and ledger.steps_seen == 1


def test_what_code_between_plans_keeps_counts_with_the_plan_before_it():
    ledger = StepLedger(1000)
    a = ledger.begin({"wa": 100}, {}, {}, frozenset())
    token = ledger.hold(a, 50)
    ledger.hold_with_last({"e": 200, "wa": 100})  # a parameter it saved is counted once, as resident
    b = ledger.begin({}, {}, {}, frozenset())
    assert ledger.allowance(b) == 1000 - 100 - 50 - 200
    c = ledger.begin({}, {}, {}, frozenset({"e"}))  # a plan that reads it has it in its own plan
    assert ledger.allowance(c) == 1000 - 100 - 50
    ledger.release(token)  # gone with the plan before it: its backward runs after that code's
    assert ledger.allowance(c) == 1000 - 100


def test_at_the_first_steps_backwards_every_call_of_the_step_is_counted():
    """A plan made at the first step's backward knows the calls after it, which a plan made at
    its forward cannot: their gradients, already made; and its own account is the caller's."""
    ledger = StepLedger(10_000)
    a = ledger.begin({"wa": 100}, {"ga": 100}, {"x": 10}, frozenset())
    assert ledger.allowance(a) == 10_000  # at its forward: nothing after it is known yet
    token_a = ledger.hold(a, 0, {"ha": 300})
    b = ledger.begin({"wb": 200}, {"gb": 200}, {}, frozenset({"ha"}))
    token_b = ledger.hold(b, 0, {"hb": 40})
    ledger.release(token_b)  # b's backward ran: its gradient is held to the step's end
    # a's: b's parameters and its gradient (a reads the batch x itself)
    assert ledger.backward_allowance(a, token_a) == 10_000 - 200 - 200
    # b's: a's parameters and the batch; what a returned is b's own input, counted in its plan
    assert ledger.backward_allowance(b, token_b) == 10_000 - 100 - 10


def test_a_rehearsal_replays_the_next_step_and_its_carry_limits_are_adopted():
    ledger = StepLedger(1000)
    tokens = [ledger.hold(ledger.begin({}, {}, {}, frozenset()), 0) for _ in range(3)]
    rehearsal = ledger.rehearsal()
    assert not rehearsal.live and ledger.live  # the real step is untouched
    # the rehearsal's first round: the first two plans carry 600 and 200, the third is 400 short
    held = []
    for carried in (600, 200):
        held.append(rehearsal.hold(rehearsal.begin({}, {}, {}, frozenset()), carried))
    last = rehearsal.begin({}, {}, {}, frozenset())
    assert rehearsal.allowance(last) == 200
    rehearsal.short(last, 400)
    rehearsal.live.clear()
    first = rehearsal.begin({}, {}, {}, frozenset())  # its second round: the limits apply
    assert rehearsal.carry_limit(first) == 300
    ledger.adopt(rehearsal)
    for t in tokens:
        ledger.release(t)
    assert ledger.carry_limit(ledger.begin({}, {}, {}, frozenset())) == 300  # the real second step
    assert ledger.steps_seen == 1
