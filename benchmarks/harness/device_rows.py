"""What `benchmarks.studies.cuda_check` measures with, and how it writes its tables.

A row is a dict: what was run (``method``, ``key`` naming its step in the timings), its ``budget``,
the plan's predictions (`plan_fields`), the measured peaks (`measure`: allocated and reserved on
CUDA, memplan's tracker on the CPU), the gradients' difference from eager's (`grad_error`), step
times over eager's (`time_steps`, `add_times`), and ``skipped`` / ``error`` where it did not run.
`markdown` turns the run's results into tables, a column for each figure some row has.
"""
from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

import memplan
from memplan.measure.tracker import profiled_peak


@dataclass
class Run:
    """How this process measures (set once by the script's ``main``)."""

    device: str = "cuda"  # "cpu" only for a dry run: peaks from memplan's tracker, nothing a CUDA finding
    tiny: bool = False  # --size tiny: toy shapes, and the time each row needs scaled down
    reps: int = 7  # interleaved timing rounds
    measures: int = 2  # measured steps per row (the whole step's: 3)


RUN = Run()


class Deadline:
    """Seconds left: rows and sections that would start too late are skipped."""

    def __init__(self, seconds: float, start: float | None = None) -> None:
        self.end = (time.perf_counter() if start is None else start) + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def scaled(seconds: float) -> float:
    """Seconds something takes on the GPU at the real sizes; a tenth of that in a dry run."""
    return seconds * (0.1 if RUN.tiny else 1.0)


def skip(row: dict, sec: Deadline, seconds: float) -> bool:
    """Mark ``row`` skipped when ``sec`` has less time left than it needs (GPU seconds)."""
    need = scaled(seconds)
    if sec.left() >= need:
        return False
    row["skipped"] = f"deadline: {max(sec.left(), 0):.1f} s left of the section, about {need:.1f} s needed"
    return True


def tail() -> str:
    """The current exception's traceback, its last frames."""
    return traceback.format_exc(limit=-6)


@contextlib.contextmanager
def recorded(row: dict):
    """Run a row's work: an exception is recorded in the row (its traceback's tail) and the caller
    goes on; the seconds it took are recorded too."""
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        row.pop("skipped", None)
        row["error"] = tail()
    finally:
        row["row_s"] = time.perf_counter() - t0


def sync() -> None:
    if RUN.device == "cuda":
        torch.cuda.synchronize()


def autocast_ctx(on: bool):
    return torch.autocast(RUN.device, dtype=torch.bfloat16) if on else contextlib.nullcontext()


# -- measuring ----------------------------------------------------------------------------------


def own_bytes(module: torch.nn.Module, inputs: Any = (), optimizer: torch.optim.Optimizer | None = None) -> int:
    """Device bytes the step's own resident tensors hold: parameters, buffers, inputs, optimizer
    state (what memplan's budget counts as resident); of FSDP2's sharded ones (DTensors), the
    rank's local shards."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        tensors += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    seen = {}
    for t in (t.to_local() if hasattr(t, "to_local") else t for t in tensors):
        if t.device.type == RUN.device:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def peak(step: Callable[[], Any], own: Callable[[], int], dynamo: bool = False) -> dict[str, int | None]:
    """Device bytes at the step's peak, allocated and reserved: what the step takes above what was
    there before it, plus the step's own resident tensors (``own()``, read before the step), so that
    other models alive in this process and the libraries' workspaces are left out. The cache is
    emptied first, so that reserved counts every segment the step needs. On the CPU (dry run):
    memplan's tracker, and no reserved figure; for a step through dynamo (``dynamo``), the
    profiler's allocation events, since dynamo runs a frame eagerly under the tracker's dispatch
    mode (the tracker would measure eager's step)."""
    if hasattr(step, "clear"):
        step.clear()  # the gradients the step makes are its own: none held before it
    if RUN.device != "cuda":
        if dynamo:
            return {"allocated": own() + profiled_peak(step), "reserved": None}
        return {"allocated": memplan.measure_peak(step, "cpu"), "reserved": None}
    resident = own()
    sync()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync()
    return {"allocated": int(torch.cuda.max_memory_allocated()) - allocated + resident,
            "reserved": int(torch.cuda.max_memory_reserved()) - reserved + resident,
            "reserved_in_process": int(torch.cuda.max_memory_reserved())}


def measure(row: dict, step: Callable[[], Any], own: Callable[[], int], n: int | None = None,
             calls: list[int] | None = None, dynamo: bool = False) -> None:
    """``n`` (`RUN.measures`) seeded steps' peaks into ``row`` (and the optimizer calls each made,
    counted in ``calls``); ``dynamo``: the step runs through torch.compile (`peak`)."""
    peaks, counted = [], []
    for _ in range(n or RUN.measures):
        torch.manual_seed(0)
        if calls is not None:
            calls[0] = 0
        peaks.append(peak(step, own, dynamo))
        if calls is not None:
            counted.append(calls[0])
    row["measured"] = [p["allocated"] for p in peaks]
    row["reserved"] = [p["reserved"] for p in peaks]
    if RUN.device == "cuda":
        row["reserved_in_process"] = [p["reserved_in_process"] for p in peaks]
    if calls is not None:
        row["optimizer_calls"] = counted
    if row.get("budget"):
        row["under_budget"] = max(row["measured"]) <= row["budget"]
        if RUN.device == "cuda":
            row["reserved_under_budget"] = max(row["reserved"]) <= row["budget"]


def count_calls(optimizer: torch.optim.Optimizer) -> list[int]:
    """A counter of ``optimizer.step`` calls (host updates step a view sharing its hooks: counted too)."""
    box = [0]

    def hook(*_: Any) -> None:
        box[0] += 1
    optimizer.register_step_post_hook(hook)
    return box


def time_steps(steps: dict[str, Callable[[], Any]], base: dict[str, str] | None = None) -> dict[str, dict]:
    """Per step: median seconds over `RUN.reps` interleaved rounds (each round starting one step
    further on), and median / spread of the per-round ratios to its base (eager: the first step
    unless ``base`` names another)."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(RUN.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if hasattr(steps[n], "clear"):
                steps[n].clear()
            sync()
            t0 = time.perf_counter()
            steps[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    out = {}
    for n in names:
        b = (base or {}).get(n, names[0])
        ratios = [t / e for t, e in zip(times[n], times[b])]
        out[n] = {"median_s": statistics.median(times[n]), "ratio": statistics.median(ratios),
                  "spread": [min(ratios), max(ratios)], "base": b}
    return out


def add_times(rows: list[dict], times: dict[str, dict]) -> None:
    """Each row's step time over its eager step, and its plan's prediction of it: the predicted
    overhead over store-all (which the cost model takes for eager's step), that times eager's
    measured step, and |predicted - measured| / eager's step (= |predicted ratio - measured ratio|);
    beside it the cost model's own step time in seconds (``Plan.predicted_time``, the simulated
    schedule's) against the measured one."""
    for row in rows:
        t = times.get(row.get("key"))
        if t is None:
            continue
        eager_s = times[t["base"]]["median_s"]
        row.update(time_ratio=t["ratio"], spread=t["spread"], step_ms=t["median_s"] * 1e3)
        if row.get("predicted_time_ratio") is not None:
            row["predicted_step_ms"] = row["predicted_time_ratio"] * eager_s * 1e3
            row["time_error"] = abs(row["predicted_time_ratio"] - t["ratio"])
            row["time_error_cost_model_s"] = abs(row["predicted_time_s"] - t["median_s"]) / eager_s


def plan_fields(row: dict, opt: Any) -> None:
    """What the plan of ``opt`` (a `memplan.OptimizedModule`) predicts: peak, step time over
    store-all's and in seconds, and what it pages out."""
    plan = opt.plan
    row.update(predicted=plan.predicted_peak, predicted_time_ratio=plan.predicted_overhead,
               predicted_time_s=plan.predicted_time, plan_method=plan.method,
               offloaded_bytes=sum(t.nbytes for t in plan.transfers), predicted_wait=plan.predicted_wait)
    if getattr(opt, "compile_report", None) is not None:
        row["compile_report"] = opt.compile_report.summary()


WORST: dict[str, Any] = {}  # the last comparison's worst parameter: where a gradient fault shows first


def canonical(name: str, drop: tuple[str, ...] = ()) -> str:
    """A parameter's name as eager's module has it: without torch.compile's ``_orig_mod`` (and the
    components in ``drop``, such as a checkpoint wrapper's ``block``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod" and part not in drop)


def grad_error(module: torch.nn.Module, reference: dict[str, torch.Tensor], drop: tuple[str, ...] = ()) -> float:
    """Largest |g - g_eager| / max|g_eager| over the parameters (its parameter in `WORST`)."""
    worst, matched = 0.0, 0
    WORST.clear()
    for name, p in module.named_parameters():
        ref = reference.get(canonical(name, drop))
        if ref is None or p.grad is None:
            continue
        matched += 1
        scale = ref.abs().max().item() or 1.0
        error = (p.grad.float() - ref.float()).abs().max().item() / scale
        if error > worst:
            worst = error
            WORST.update(parameter=name, max_abs_eager=scale, error=error)
    if matched < len(reference):
        raise RuntimeError(f"gradients of {matched} of {len(reference)} parameters to compare")
    return worst


def loss_step(module: torch.nn.Module, args: tuple, kwargs: dict, autocast: bool = False) -> Callable[[], None]:
    """One forward (under bf16 autocast if asked) and backward."""
    def step() -> None:
        with autocast_ctx(autocast):
            loss = module(*args, **kwargs)
        loss.backward()
    step.clear = lambda: [setattr(p, "grad", None) for p in module.parameters()]
    return step



# -- the report ---------------------------------------------------------------------------------


def mb(b: Any) -> str:
    return "-" if b is None else f"{b / 1e6:.2f} MB"


def _peaks(row: dict, key: str) -> str:
    values = row.get(key)
    if not values:
        return "-"
    if all(v is None for v in values):
        return "n/a"
    text = " / ".join(mb(v) for v in values)
    budget = row.get("budget")
    if budget and max(values) > budget:
        text += f" (over by {max(values) / budget - 1:.1%})"
    elif key == "measured" and row.get("of_eager"):
        text += f" ({row['of_eager']:.0%} of eager)"
    return text


def _notes(row: dict) -> str:
    if row.get("skipped"):
        return "skipped: " + row["skipped"]
    if row.get("error"):
        return "error: " + row["error"].strip().splitlines()[-1][:200]
    notes = [row[k] for k in ("note", "compile_report") if row.get(k)]
    if row.get("offloaded_bytes"):
        notes.append(f"{mb(row['offloaded_bytes'])} offloaded")
    text = "; ".join(notes)
    return text if len(text) <= 300 else text[:300] + "... (cuda.json has it all)"


COLUMNS: list[tuple[str, str, Callable[[dict], str]]] = [  # header, the key that shows it, the cell
    ("method", "method", lambda r: r["method"]),
    ("optimizer", "optimizer", lambda r: f"AdamW {r['optimizer']}"),
    ("budget", "budget", lambda r: mb(r.get("budget"))),
    ("predicted peak", "predicted", lambda r: mb(r.get("predicted"))),
    ("allocated", "measured", lambda r: _peaks(r, "measured")),
    ("reserved", "reserved", lambda r: _peaks(r, "reserved")),
    ("grads vs eager (max rel)", "grad_error", lambda r: f"{r['grad_error']:.1e}" if "grad_error" in r else "-"),
    ("params vs eager after 3 steps (max rel)", "param_error_after_3",
     lambda r: f"{r['param_error_after_3']:.1e}" if "param_error_after_3" in r else "-"),
    ("optimizer calls / step", "optimizer_calls", lambda r: " / ".join(map(str, r.get("optimizer_calls", []))) or "-"),
    ("step time", "time_ratio",
     lambda r: f"{r['time_ratio']:.2f}x ({r['step_ms']:.2f} ms)" if "time_ratio" in r else "-"),
    ("spread", "spread", lambda r: "{:.2f}-{:.2f}".format(*r["spread"]) if "spread" in r else "-"),
    ("predicted time", "predicted_time_ratio",
     lambda r: f"{r['predicted_time_ratio']:.2f}x" if r.get("predicted_time_ratio") is not None else "-"),
    ("abs(pred - meas) / eager", "time_error", lambda r: f"{r['time_error']:.2f}" if "time_error" in r else "-"),
    ("notes", "method", _notes),
]


def markdown(results: dict, titles: dict[str, str]) -> str:
    """The run's ``results`` (the script's JSON) as Markdown: a header, then a table per part."""
    dry = RUN.device != "cuda"
    lines = ["# Checks on a CUDA device" + (" (CPU dry run: no CUDA finding)" if dry else ""), "",
             f"{results.get('device')}; torch {results.get('torch')}; transformers {results.get('transformers')}; "
             f"{results.get('wall_s', 0):.0f} s in all. Allocated: `torch.cuda.max_memory_allocated`, reserved: "
             "`torch.cuda.max_memory_reserved`, each over one step after `empty_cache` and "
             "`reset_peak_memory_stats`, less what was there before the step, plus the step's own "
             "parameters, buffers, inputs and optimizer state." if not dry else
             f"{results.get('device')}; torch {results.get('torch')}: peaks from memplan's CPU tracker, "
             "no reserved figure, compilers stood in for; the run checks that the script works.",
             "", "Step time: median of interleaved rounds over eager's (whole step: eager's loop with the same "
             "optimizer); predicted time: `Plan.predicted_overhead` (over store-all, the cost model's eager step); "
             "abs(pred - meas) / eager: the two ratios' distance, in eager steps.", ""]
    for key, part in results.items():
        if not isinstance(part, dict):
            continue
        lines += [f"## {titles.get(key, key)}", ""]
        head = [part.get("model", "")]
        if "wall_s" in part:
            head.append(f"{part['wall_s']:.0f} s of a {part.get('share_s', 0):.0f} s share")
        if part.get("eager_again_grad_error") is not None:
            head.append(f"eager against itself: {part['eager_again_grad_error']:.1e}")
        lines += ["; ".join(h for h in head if h) + ".", ""]
        for flag in ("skipped", "cut_off"):
            if part.get(flag):
                lines += [f"{flag.replace('_', ' ')}: {part[flag]}", ""]
        if part.get("error"):
            lines += ["error:", "", "```", part["error"].strip(), "```", ""]
        rows = part.get("rows") or []
        if rows:
            cols = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
            lines.append("| " + " | ".join(c[0] for c in cols) + " |")
            lines.append("|" + "---|" * len(cols))
            for r in rows:
                lines.append("| " + " | ".join(c[2](r).replace("|", "/") for c in cols) + " |")
            lines.append("")
    return "\n".join(lines) + "\n"
