"""What compiling a program reports: each run's fate (compiled, refused, failed) and the totals a plan's report shows."""
from __future__ import annotations
from dataclasses import dataclass, field


class CompileWarning(UserWarning):
    """A run of a plan could not be compiled, or compiled to more memory than planned: it runs eagerly."""


@dataclass
class RunReport:
    """What happened to one run of ATen ops."""

    segment: str  # "forward" or "backward"
    first: str  # the name of its first node
    ops: int
    compiled: bool
    reason: str = ""  # why it runs eagerly
    random_ops: int = 0  # random ops' first draws in it (eager's kernels, called by the compiled code)
    compiled_peak: int | None = None  # measured when checked, bytes above what was live before the run
    eager_peak: int | None = None
    compile_s: float = 0.0
    compiled_s: float | None = None  # measured on zero inputs when checked
    eager_s: float | None = None
    donated: int = 0  # inputs read for the last time whose memory the compiled run may reuse


@dataclass
class CompileReport:
    """How a program's segments were compiled."""

    runs: list[RunReport] = field(default_factory=list)
    refused: int = 0  # compiled runs the memory check refused (each then tried as two halves)
    slower: int = 0  # compiled runs measured slower than eager, run eagerly
    # Set when the compiled step as a whole was predicted slower than eager, which then runs instead.
    eager_instead: str = ""
    relaid: int = 0  # values compiled runs hand on laid out otherwise than traced (later runs compiled for it)
    compile_s: float = 0.0  # Inductor's time, refused runs included
    # The plan's predicted peak with the compiled runs' measured differences from eager added.
    predicted_peak: int = 0
    # Predicted time the compiled runs save: each run's predicted time times its measured speed-up.
    predicted_saving: float = 0.0

    @property
    def compiled_ops(self) -> int:
        return sum(r.ops for r in self.runs if r.compiled)

    @property
    def eager_ops(self) -> int:
        return sum(r.ops for r in self.runs if not r.compiled)

    @property
    def donated(self) -> int:
        return sum(r.donated for r in self.runs if r.compiled)

    def summary(self) -> str:
        if self.eager_instead:
            return self.eager_instead
        n = sum(r.compiled for r in self.runs)
        rejected = [r for r in self.runs if not r.compiled and r.reason]
        text = (f"{n} of {len(self.runs)} runs compiled ({self.compiled_ops} ops; {self.eager_ops} ops eager), "
                f"Inductor {self.compile_s:.1f} s, {self.refused} compiled runs refused by the memory check")
        if self.slower:
            text += f", {self.slower} slower than eager run eagerly"
        if self.relaid:
            text += f", {self.relaid} values handed on in Inductor's layout"
        if self.donated:
            text += f", {self.donated} inputs' memory reused"
        if rejected:
            text += "; eager: " + ", ".join(f"{r.segment} run at {r.first} ({r.reason})" for r in rejected)
        return text
