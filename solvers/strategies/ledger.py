"""One step's budget shared by several plans that run in it (graph breaks, FSDP2 units).

A training step with graph breaks runs plans 1..k forward, then their backwards in
reverse. While plan i runs (forward or backward), memory outside it is held by the
others:

* what stays resident all step and belongs to another plan (its parameters);
* what earlier plans' forwards left for their backwards (their *carried* bytes),
  from the moment each forward returns until its backward has run;
* what later plans' backwards already produced and the step keeps to its end
  (their parameters' gradients), during plan i's backward.

The ledger keeps those three accounts and answers, for a plan about to run, the
*allowance*: the budget less what the others hold. Each plan is then solved for its
allowance by the usual solvers, so the one simulator checks each of them; the ledger
only splits the budget. Holdings are keyed (a parameter's storage), so a tensor two
plans share is counted once.

The plans arrive in call order, and "later" means later in the previous step's order:
at its forward, the first step knows nothing of the plans after the running one (their
parameters and gradients are not yet seen), so an allowance given then can be too
generous by exactly those bytes; from the second step on the ledger knows the whole
step. By the first step's backwards every call of it has been seen: `backward_allowance`
counts them (a caller that defers the first step's plans to its backward, as
`memplan.frontend.backend` does, holds the budget there too), and `rehearsal` is a copy of the
ledger in which the caller plays the next step's forward through, plan by plan, before it
runs, to learn its carry limits (`adopt` takes them back). A step ends when no plan's
carried bytes are held any more (every backward has run) and a new forward begins.

Torch-free: keys are any hashables, bytes are ints.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Hashable


@dataclass(frozen=True)
class Call:
    """One run of a plan in a step: its position in the step's call order, and the keys of
    the resident tensors it owns (its parameters) and of the gradients its backward keeps."""

    position: int
    owned: frozenset  # its inputs: parameters, the step's inputs, what earlier plans returned
    final: frozenset
    # Bytes a distributed engine holds outside the plan while its backward runs (FSDP2's next
    # unit's parameters, gathered ahead, and the previous unit's reduce-scatter input).
    transient: int = 0
    # Bytes an engine holds for a moment before the forward runs, beside the plan's inputs only
    # (FSDP2's all-gather output, copied into the unit's parameters).
    staging: int = 0


@dataclass
class StepLedger:
    """The budget of one training step, shared by the plans that run in it, in call order."""

    budget: int
    resident: dict[Hashable, int] = field(default_factory=dict)  # key -> bytes, resident all step, every step
    step_resident: dict[Hashable, int] = field(default_factory=dict)  # key -> bytes, resident all of this step
    final_bytes: dict[Hashable, int] = field(default_factory=dict)  # key -> bytes kept to the step's end
    # hold token -> (call position, carried bytes, {key: bytes} of what the forward returned) not yet released
    live: dict[int, tuple[int, int, dict[Hashable, int]]] = field(default_factory=dict)
    # call position -> bytes less than it once carried that its plan may carry into its backward
    reserve: dict[int, int] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)  # reserve to add when the next step begins
    most_carried: dict[int, int] = field(default_factory=dict)  # call position -> most it carried in a step
    calls: list[Call] = field(default_factory=list)  # this step's calls so far
    last_calls: list[Call] = field(default_factory=list)  # the previous step's calls
    steps_seen: int = 0
    # call position -> the step's predicted memory while that call runs (`predict`), this step's
    # and the previous step's; and bytes an engine holds at the step's end beside every gradient
    predicted: dict[int, int] = field(default_factory=dict)
    last_predicted: dict[int, int] = field(default_factory=dict)
    closing: int = 0
    _tokens: int = 0

    def begin(self, resident: dict[Hashable, int], final: dict[Hashable, int],
              step_resident: dict[Hashable, int] | None = None, inputs: frozenset = frozenset(),
              transient: int = 0, staging: int = 0) -> Call:
        """A plan is about to run its forward, owning ``resident`` (held every step: parameters)
        and ``step_resident`` (held to this step's end: the step's inputs, which the caller keeps)
        and making ``final`` (key -> bytes each), reading ``inputs`` (keys: what another plan
        returned is counted in this plan, not as the other's); an engine holds ``transient``
        bytes outside it while its backward runs and ``staging`` for a moment before its forward
        (`Call`). A call while nothing is carried starts a new step."""
        if not self.live and self.calls:
            self.last_calls, self.calls = self.calls, []
            if self.predicted:  # (the first step's calls predict nothing: its rehearsal did, `adopt`)
                self.last_predicted, self.predicted = self.predicted, {}
            self.step_resident = {}
            self.steps_seen += 1
            for pos, more in self.pending.items():
                # a plan cannot carry less than nothing: its reserve stops at what it carried
                self.reserve[pos] = min(self.reserve.get(pos, 0) + more, self.most_carried.get(pos, 0))
            self.pending = {}
        step_resident = step_resident or {}
        self.resident.update(resident)
        self.step_resident.update(step_resident)
        self.final_bytes.update(final)
        call = Call(len(self.calls), frozenset(resident) | frozenset(step_resident) | frozenset(inputs),
                    frozenset(final), transient, staging)
        self.calls.append(call)
        return call

    def hold_to_end(self, held: dict[Hashable, int]) -> None:
        """``held`` (key -> bytes) stays resident to this step's end and belongs to no plan (what eager
        code before the step's first plan saved for its backward, which runs last)."""
        self.step_resident.update(held)

    def hold_resident(self, held: dict[Hashable, int]) -> None:
        """``held`` (key -> bytes) stays resident every step and belongs to no plan (a distributed
        engine's parameter shards): every plan counts it among the others' holdings."""
        self.resident.update(held)

    @property
    def returned(self) -> dict[Hashable, int]:
        """Key -> bytes of what the forwards whose backwards are still to run returned: counted in
        their accounts, against the plans that do not read it (`hold`)."""
        return {k: b for _, _, outs in self.live.values() for k, b in outs.items()}

    def _others(self, call: Call) -> tuple[int, int]:
        """What the others hold while ``call`` runs: (in its forward, more in its backward). In its
        forward, their resident tensors and every carried account still open; in its backward also
        the gradients of the calls after it in the previous step's order and what an engine holds
        then (`Call.transient`)."""
        resident = sum(b for k, b in {**self.resident, **self.step_resident}.items() if k not in call.owned)
        returned = {k: b for k, b in self.returned.items() if k not in call.owned}
        carried = sum(c for _, c, _ in self.live.values()) + sum(returned.values())
        later = set().union(*(c.final for c in self.last_calls[call.position + 1:])) - call.final - call.owned
        return resident + carried, sum(self.final_bytes[k] for k in later) + call.transient

    def held_by_others(self, call: Call) -> int:
        """Bytes the other plans hold at some moment while ``call`` runs (its forward or its
        backward: `_others`), an engine's staging before its forward included (beside the plan's
        inputs only, but counted against its whole peak: a simpler bound, and staging is small)."""
        forward, more = self._others(call)
        return forward + max(more, call.staging)

    def predict(self, call: Call, forward_peak: int, backward_peak: int, sources: int = 0) -> int:
        """The step's memory while ``call`` runs, its plan holding at most ``forward_peak`` in its
        forward and ``backward_peak`` in its backward (`memplan.pipeline.plan.Plan.phase_peaks`),
        ``sources`` at its start (beside an engine's `Call.staging`); kept for `predicted_peak`."""
        forward, more = self._others(call)
        peak = max(forward + max(forward_peak, sources + call.staging), forward + more + backward_peak)
        self.predicted[call.position] = peak
        return peak

    @property
    def predicted_peak(self) -> int:
        """The most memory predicted at any call of the last whole step and of this one, or at its
        end, where every gradient is kept beside ``closing`` (both steps: under gradient accumulation
        a step that reduces and one that does not take turns)."""
        calls = [*self.last_predicted.values(), *self.predicted.values()]
        return max([self.at_end, *calls]) if calls else 0

    @property
    def at_end(self) -> int:
        """Bytes held at the step's end, after every backward: what is resident, every gradient kept,
        and ``closing``."""
        return sum({**self.resident, **self.step_resident}.values()) + sum(self.final_bytes.values()) + self.closing

    def backward_allowance(self, call: Call, token: int | None = None) -> int:
        """What ``call``'s plan may peak at when it is planned at its backward, ``token`` being its
        own account (left out: the caller knows which of its own holdings are still alive): the
        budget less the others' resident tensors, every other carried account still open, and the
        gradients of the calls after it in *this* step, whose backwards have run."""
        others = {t: v for t, v in self.live.items() if t != token}
        resident = sum(b for k, b in {**self.resident, **self.step_resident}.items() if k not in call.owned)
        returned = {k: b for _, _, outs in others.values() for k, b in outs.items() if k not in call.owned}
        carried = sum(c for _, c, _ in others.values()) + sum(returned.values())
        later = set().union(*(c.final for c in self.calls[call.position + 1:])) - call.final - call.owned
        return self.budget - resident - carried - sum(self.final_bytes[k] for k in later) - call.transient

    def rehearsal(self) -> "StepLedger":
        """A copy of this ledger in which the step now running has ended: its calls are the
        previous step's, so the copy's allowances for a replay of them count the whole step.
        Replaying the step through it (`begin`, `allowance`, `carry_limit`, `hold`, `short`, and
        ``live.clear()`` between rounds) is what the next steps would do, without running them."""
        copied = copy.deepcopy(self)
        copied.live = {}
        return copied

    def adopt(self, rehearsed: "StepLedger") -> None:
        """Take the carry limits ``rehearsed`` settled on, and what it predicted, for the next step
        of this ledger."""
        self.predicted = dict(rehearsed.predicted)
        self.reserve = dict(rehearsed.reserve)
        self.most_carried = dict(rehearsed.most_carried)
        self.pending = {}

    def allowance(self, call: Call) -> int:
        """What ``call``'s plan may peak at: the budget less what the others hold."""
        return self.budget - self.held_by_others(call)

    def carry_limit(self, call: Call) -> int | None:
        """The most ``call``'s plan may carry from its forward into its backward so that the calls
        after it fit (None: no limit): what it carried before, less its reserve."""
        if not self.reserve.get(call.position):
            return None
        return max(0, self.most_carried.get(call.position, 0) - self.reserve[call.position])

    def short(self, call: Call, deficit: int) -> None:
        """``call``'s smallest plan is ``deficit`` bytes over its allowance: from the next step on, the
        earlier calls whose carried bytes are held now carry that much less between them (`carry_limit`),
        each in proportion to what it carries, never less than nothing. Where no earlier call carries anything, nothing can give way: the
        budget is too small for this split."""
        carried = {pos: c for pos, c, _ in self.live.values() if pos < call.position and c > 0}
        total = sum(carried.values())
        for pos, c in carried.items():
            # several later calls may be short in one step: the earlier ones give the most any asked
            self.pending[pos] = max(self.pending.get(pos, 0), -(-deficit * c // total))

    def hold_with_last(self, held: dict[Hashable, int]) -> None:
        """``held`` (key -> bytes) is kept for the backward by code that ran between the last plan
        and the next (eager Python between graphs): it counts with that last plan's account, against
        the plans that do not read it, and goes with it (its backward runs after that code's)."""
        if self._tokens in self.live:
            self.live[self._tokens][2].update(
                (k, b) for k, b in held.items() if k not in self.resident and k not in self.step_resident)

    def hold(self, call: Call, carried: int, returned: dict[Hashable, int] | None = None) -> int:
        """A forward returned ``returned`` (key -> bytes), leaving ``carried`` more bytes for its
        backward; returns the token to release. What it returned counts against the plans that
        do not read it until the backward has run (the backward may read it too)."""
        self._tokens += 1
        self.live[self._tokens] = (call.position, int(carried), dict(returned or {}))
        self.most_carried[call.position] = max(self.most_carried.get(call.position, 0), int(carried))
        return self._tokens

    def release(self, token: int) -> None:
        """That forward's backward ran (or its graph was dropped): its carried bytes are gone.
        Releasing twice is harmless (a backward hook and the graph's end may both report it)."""
        self.live.pop(token, None)

    @property
    def complete(self) -> bool:
        """Whether one whole step has been seen, so that allowances know every plan of it."""
        return self.steps_seen > 0
