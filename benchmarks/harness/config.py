"""What one benchmark run covers: models, budgets, repetitions, limits.

Two presets: :func:`full_config` (``python -m benchmarks``; zoo ``small``
models, a step of roughly 0.2-2 s on a laptop CPU) and :func:`quick_config`
(``--quick``; zoo ``tiny`` models, fewer repetitions, a smoke run).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.harness.paths import RESULTS_DIR

# The five models of the comparison, in table order.
DEFAULT_MODELS: tuple[str, ...] = ("gpt", "resnet50", "unet", "vit", "mlp")

# Budgets as fractions of the eager step's measured peak.
DEFAULT_FRACTIONS: tuple[float, ...] = (1.0, 0.7, 0.5, 0.35)


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model at a size, optionally with another batch size."""

    name: str
    size: str
    batch_size: int | None = None

    @property
    def label(self) -> str:
        batch = f", batch {self.batch_size}" if self.batch_size else ""
        return f"{self.name} ({self.size}{batch})"


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run needs to know; the CLI builds one of these."""

    models: tuple[ModelSpec, ...]
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    reps: int = 7  # interleaved timing repetitions per configuration (issue #28: median of at least 7)
    bisect_steps: int = 2  # activation_memory_budget bisection steps per budget
    memplan_time_limit: float = 15.0  # seconds per memplan solve ("auto" uses what it is given on large graphs)
    out_dir: Path = RESULTS_DIR
    device: str = "cpu"
    # Intra-op CPU threads. One by default: on a shared machine, OpenMP
    # barriers with a busy core stall for hundreds of milliseconds at random.
    threads: int = 1
    quick: bool = False
    # Every method compiles into an empty Inductor cache, so its compile time is a
    # user's first compile, not a hit on kernels an earlier run (or method) built.
    cold_compile: bool = True
    plots: bool = True
    methods: tuple[str, ...] = field(default_factory=tuple)  # empty: benchmarks.harness.methods.DEFAULT_METHODS

    def with_(self, **changes) -> "BenchConfig":
        return replace(self, **changes)


def full_config(models: tuple[str, ...] = DEFAULT_MODELS) -> BenchConfig:
    """The run whose results are committed: zoo ``small`` sizes."""
    return BenchConfig(models=tuple(ModelSpec(m, "small") for m in models))


def quick_config(models: tuple[str, ...] = DEFAULT_MODELS) -> BenchConfig:
    """A smoke run: zoo ``tiny`` sizes, 3 repetitions, short searches."""
    return BenchConfig(
        models=tuple(ModelSpec(m, "tiny") for m in models),
        reps=3,
        bisect_steps=2,
        memplan_time_limit=10.0,
        quick=True,
        cold_compile=False,  # a smoke run: warm caches keep it short
    )
