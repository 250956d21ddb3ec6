"""Where memplan's compiled step and ``torch.compile``'s differ in time, at a budget both fit.

Both run Inductor's kernels for the same ops; what can differ is which kernels run (the plan's
segments against AOTAutograd's partition), the ATen kernels the compiled code calls (convolutions,
matmuls), the Python between them (memplan's runtime, dynamo's guards), and what the CPU
allocator costs: a freed buffer glibc hands back to the system is paid for again, page by page
(a minor page fault each), when the next step allocates it.

For each zoo model, in one process with one thread: eager, memplan with ``compile=True`` at
``--fraction`` of eager's measured peak, and ``torch.compile(model)`` (Inductor, its default
activation budget) step in interleaved rounds. Reported per method: the step time over eager's
and over Inductor's (medians of per-round ratios, spreads min-max), the minor page faults of the
forward and of the backward (``getrusage``, medians), the profiled peak, and the step's self CPU
time by kind (ATen kernels, Inductor's generated kernels, the rest) from ``torch.profiler``.

Each model runs twice, each time in a fresh process: with glibc's default allocator settings,
and with freed memory kept mapped (``mallopt``: no trimming, no ``mmap`` for large blocks), so
the faults' share of a gap can be told from the kernels'. Writes
``benchmarks/results/inductor_gap.md``.

    python -m benchmarks.studies.inductor_gap [--models resnet50,gpt,vit] [--size small] [--fraction 1.0]
                                      [--rounds 9]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter

import torch

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.report import markdown_table, spread
from benchmarks.harness.zoo_options import zoo_arguments
from memplan.measure.tracker import measure_peak, profiled_peak
from memplan.models import zoo

RESULTS = RESULTS_DIR / "inductor_gap.md"
MODES = ("glibc defaults", "freed memory kept")
PROFILED_STEPS = 3
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """Ask glibc to keep what is freed mapped: no trimming of the heap's top, no ``mmap`` of large
    blocks (each returned to the system on free). Setting them also stops glibc's own adjusting."""
    libc = ctypes.CDLL("libc.so.6")
    for param in (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD):
        if libc.mallopt(param, 1 << 30) != 1:
            raise RuntimeError(f"mallopt({param}) refused")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _kind(key: str) -> str:
    """A profiler event's kind: Inductor's generated kernels, ATen ops, or everything else."""
    if "cpp_fused" in key or "triton_" in key:
        return "generated"
    if key.startswith("aten::") or key.startswith("memplan::"):
        return "aten"
    return "other"


def measure(name: str, size: str, fraction: float, rounds: int, time_limit: float) -> dict:
    """One model's methods, stepped in interleaved rounds; the figures of the module docstring."""
    from torch._inductor import config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    zm = zoo.build(name, size=size)
    model = memplan.WithLoss(zm.model, zm.loss_fn)
    args, kwargs = tuple(zm.example_inputs), dict(zm.example_kwargs)
    resident = [*model.parameters(), *args]

    def run(step) -> tuple[float, int, int]:
        """Step time, then the forward's and the backward's minor page faults."""
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        start, before = time.perf_counter(), _faults()
        loss = step(*args, **kwargs)
        between = _faults()
        loss.backward()
        return time.perf_counter() - start, between - before, _faults() - between

    eager_peak = measure_peak(lambda: run(model), resident=resident)
    budget = int(fraction * eager_peak)
    opt = memplan.optimize(model, budget, example_inputs=args, example_kwargs=kwargs, compile=True,
                           time_limit=time_limit)
    with inductor_config.patch(fallback_random=True):  # eager's dropout masks, as memplan draws them
        inductor = torch.compile(model, fullgraph=True)
        run(inductor)
    steps = {"eager": model, "memplan compiled": opt, "Inductor": inductor}
    for step in steps.values():
        run(step)
    samples: dict[str, list[tuple[float, int, int]]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(rounds):
        for key in order[r % 3:] + order[:r % 3]:
            samples[key].append(run(steps[key]))
    times = {k: [s[0] for s in v] for k, v in samples.items()}
    methods = {}
    for key, step in steps.items():
        by_kind: Counter[str] = Counter()
        for _ in range(PROFILED_STEPS):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(step)
            for event in prof.key_averages():
                by_kind[_kind(event.key)] += event.self_cpu_time_total / 1e3 / PROFILED_STEPS
        over_eager = [t / e for t, e in zip(times[key], times["eager"])]
        over_inductor = [t / i for t, i in zip(times[key], times["Inductor"])]
        methods[key] = {
            "step_ms": statistics.median(times[key]) * 1e3,
            "over_eager": statistics.median(over_eager), "eager_spread": (min(over_eager), max(over_eager)),
            "over_inductor": statistics.median(over_inductor),
            "inductor_spread": (min(over_inductor), max(over_inductor)),
            "forward_faults": statistics.median(s[1] for s in samples[key]),
            "backward_faults": statistics.median(s[2] for s in samples[key]),
            "peak": (measure_peak if key == "eager" else profiled_peak)(lambda: run(step), resident=resident),
            "profile_ms": dict(by_kind),
        }
    report = opt.compile_report
    return {"model": name, "fraction": fraction, "budget": budget, "methods": methods,
            "compiled": report.summary() if report is not None else "not compiled"}


def _one(ns: argparse.Namespace) -> None:
    """A model in one mode, in this (fresh) process; its figures as JSON on stdout's last line."""
    if ns.mode == MODES[1]:
        keep_freed_memory()
    from torch._inductor import config as inductor_config

    # Inductor's kernels as profiler events of their own (otherwise their time is their caller's)
    inductor_config.cpp.enable_kernel_profile = True
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    row = measure(ns.one, ns.size, ns.fraction, ns.rounds, ns.time_limit)
    row["mode"] = ns.mode
    print(json.dumps(row))


def _rows(row: dict) -> list[list[str]]:
    lines = []
    for key, m in row["methods"].items():
        prof = m["profile_ms"]
        lines.append([
            row["model"], row["mode"], key, f"{m['step_ms']:.0f} ms",
            f"{m['over_eager']:.3f}x ({spread(m['eager_spread'])})",
            f"{m['over_inductor']:.3f}x ({spread(m['inductor_spread'])})",
            f"{m['forward_faults']:.0f} / {m['backward_faults']:.0f}",
            f"{m['peak'] / 1e6:.1f}" + (" (over)" if m["peak"] > row["budget"] and key != "eager" else ""),
            f"{prof.get('aten', 0):.1f}", f"{prof.get('generated', 0):.1f}", f"{prof.get('other', 0):.1f}",
        ])
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = zoo_arguments(__doc__, "resnet50,gpt,vit", 1.0, 9, RESULTS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one model, one mode, this process
    parser.add_argument("--mode", choices=MODES, default=MODES[0], help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.one:
        _one(ns)
        return
    started = time.perf_counter()
    rows = []
    for name in ns.models.split(","):
        for mode in MODES:
            cmd = [sys.executable, "-m", "benchmarks.studies.inductor_gap", "--one", name, "--mode", mode,
                   "--size", ns.size, "--fraction", str(ns.fraction), "--rounds", str(ns.rounds),
                   "--time-limit", str(ns.time_limit)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{name} ({mode}) failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# memplan compiled against torch.compile at {ns.fraction:.0%} of eager's peak: where the time goes",
        "",
        f"Zoo models at size {ns.size}; {ns.rounds} interleaved rounds (eager, memplan `compile=True`, "
        "`torch.compile` with Inductor), one thread, each model and mode in a fresh process. Ratios: medians of "
        "per-round ratios (min-max). Faults: minor page faults of the forward / the backward (medians). "
        "Peak: eager's by the dispatch tracker, the compiled ones by the profiler's allocation events. "
        f"Profile: self CPU ms per step (mean of {PROFILED_STEPS} profiled steps) in ATen kernels (convolutions, "
        "matmuls and other ops the compiled code calls), Inductor's generated kernels, and the rest (Python, "
        "autograd, memplan's runtime, dynamo). \"freed memory kept\": glibc told not to return freed memory "
        "(`mallopt`), so no step pays page faults for what the last one freed.",
        "",
    ]
    header = ("model", "allocator", "method", "step", "× eager", "× Inductor", "faults fwd / bwd", "peak MB",
              "ATen ms", "generated ms", "other ms")
    lines.append(markdown_table(header, [line for row in rows for line in _rows(row)]))
    lines.append("")
    lines.extend(f"* {row['model']} ({row['mode']}), memplan's compiled runs: {row['compiled']}" for row in rows)
    lines.append("")
    lines.append(f"Generated by `python -m benchmarks.studies.inductor_gap` in {(time.perf_counter() - started) / 60:.1f} min "
                 f"(torch {torch.__version__}).")
    ns.out.parent.mkdir(exist_ok=True)
    ns.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
