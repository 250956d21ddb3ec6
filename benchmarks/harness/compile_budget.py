"""The ``torch.compile`` peer: ``activation_memory_budget`` searched to meet a byte budget.

The peer is ``torch.compile(model)`` as users run it: the default Inductor
backend (C++ kernels on CPU). :data:`AOT_EAGER` is the same search with
decompositions run eagerly and nothing fused (``aot_eager_decomp_partition``),
kept, under its own name, to separate what the partitioner saves from what
Inductor's fusion saves; it is not in the default run.

``torch._functorch.config.activation_memory_budget`` takes a *fraction* (1.0:
save what the default partitioner saves; 0.0: recompute all it may), not
bytes. To meet a byte budget a user has to search it: compile, measure,
adjust. :class:`FractionSearch` does that by bisection on the fraction,
keeping the largest fraction whose measured peak fits (more saved, less
recomputed), and caching every probe so the budgets share them.

Each probe compiles a fresh wrapper whose ``forward`` has its own code object:
dynamo keeps its cache on the code object and does not guard on functorch's
config, so without that every probe would reuse the first compilation.
Random ops are left undecomposed (``torch._inductor.config.fallback_random``)
so that dropout draws the same masks as eager, giving the peer a fair
gradient check.
"""
from __future__ import annotations

import itertools
import time
import types
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn

from benchmarks.harness.core import Candidate, ModelUnderTest
from benchmarks.harness.steps import clear_grads

_TAGS = itertools.count()


@dataclass(frozen=True)
class Peer:
    """A ``torch.compile`` configuration: the method name in the tables and its backend."""

    method: str
    backend: str


INDUCTOR = Peer("Inductor + act. budget", "inductor")
AOT_EAGER = Peer("compile (aot_eager, no fusion) + act. budget", "aot_eager_decomp_partition")


class _Forwarder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def fresh_wrapper(module: nn.Module) -> nn.Module:
    """``module`` behind a forward with a code object of its own (its own dynamo cache)."""
    tag = next(_TAGS)
    base = _Forwarder.forward
    code = base.__code__.replace(co_name=f"forward_{tag}")
    forward = types.FunctionType(code, base.__globals__, f"forward_{tag}", base.__defaults__, base.__closure__)
    cls = type(f"_Forwarder{tag}", (_Forwarder,), {"forward": forward})
    return cls(module)


@dataclass
class Probe:
    """One compiled configuration at one fraction, measured."""

    fraction: float
    candidate: Candidate | None  # None when compiling failed
    cost_s: float  # compile + first step + measured step
    error: str = ""

    @property
    def peak(self) -> int | None:
        return None if self.candidate is None else self.candidate.peak


@dataclass
class SearchResult:
    """What the search settled on for one budget."""

    probe: Probe  # the chosen configuration (the best failing one when none fits)
    consulted: list[Probe]
    met: bool

    @property
    def cost_s(self) -> float:
        return sum(p.cost_s for p in self.consulted)


@dataclass
class FractionSearch:
    """Bisection on ``activation_memory_budget`` against measured peaks, cached across budgets."""

    mut: ModelUnderTest
    steps: int
    peer: Peer = INDUCTOR
    probes: dict[float, Probe] = field(default_factory=dict)

    def probe(self, fraction: float) -> Probe:
        fraction = round(fraction, 4)
        if fraction not in self.probes:
            self.probes[fraction] = self._compile_and_measure(fraction)
        return self.probes[fraction]

    def _compile_and_measure(self, fraction: float) -> Probe:
        mut = self.mut
        start = time.perf_counter()
        wrapper = fresh_wrapper(mut.step)
        try:
            with functorch_config.patch(activation_memory_budget=fraction), inductor_config.patch(
                fallback_random=True
            ):
                compiled = torch.compile(wrapper, backend=self.peer.backend, fullgraph=True)
                clear_grads(mut.eager_params)
                torch.manual_seed(0)
                compiled(*mut.args, **mut.kwargs).backward()  # compiles forward and backward
        except Exception as exc:  # a peer failing is a result, not a crash
            clear_grads(mut.eager_params)
            return Probe(fraction, None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"[:200])
        cand = Candidate(
            method=self.peer.method,
            label=f"fraction {fraction:g}",
            module=compiled,
            params=mut.eager_params,
            compile_s=time.perf_counter() - start,  # the first step: dynamo, AOTAutograd, partitioner, codegen
            compiled=True,
        )
        mut.measure(cand)
        return Probe(fraction, cand, time.perf_counter() - start)

    def _fits(self, p: Probe, budget: int) -> bool:
        return p.peak is not None and p.peak <= budget

    def for_budget(self, budget: int) -> SearchResult:
        """The largest fraction found whose measured peak fits ``budget``.

        Bisection assumes the peak falls as the fraction does; it need not
        (recomputing everything can peak higher than saving some), so when
        fraction 0 does not fit either, a few interior fractions are tried
        before giving up.
        """
        consulted = [self.probe(1.0)]
        if self._fits(consulted[0], budget):
            return SearchResult(consulted[0], consulted, True)
        consulted.append(self.probe(0.0))
        steps = self.steps
        if not self._fits(consulted[-1], budget):
            for f in INTERIOR[: max(1, steps // 2)]:
                consulted.append(self.probe(f))
                steps -= 1
                if self._fits(consulted[-1], budget):
                    break
            else:
                measured = [p for p in consulted if p.peak is not None]
                best = min(measured, key=lambda p: p.peak) if measured else consulted[-1]
                return SearchResult(best, consulted, False)
        # Bracket: lo fits, hi does not; start from everything probed so far.
        lo = max(f for f, p in self.probes.items() if self._fits(p, budget))
        hi = min((f for f, p in self.probes.items() if f > lo and not self._fits(p, budget)), default=1.0)
        for _ in range(max(0, steps)):
            mid = self.probe((lo + hi) / 2)
            consulted.append(mid)
            if self._fits(mid, budget):
                lo = mid.fraction
            else:
                hi = mid.fraction
        return SearchResult(self.probes[round(lo, 4)], consulted, True)


# Tried, in order, when neither end of [0, 1] fits.
INTERIOR = (0.5, 0.25, 0.75)
