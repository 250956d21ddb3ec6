"""What the CPU cannot show, checked on a CUDA device: the caching allocator's statistics as the witness.

On this project's CPU machine every peak is a tracker's or the profiler's; on a GPU the allocator
itself says how much device memory the step held (``torch.cuda.max_memory_allocated``), compiled
code (Inductor's Triton kernels and their buffers) included. One run checks, each part on its own
(an error in one is recorded and the next goes on):

* ``activations``: zoo models planned at 50% and 35% of the eager step's measured peak, offload on
  (the CUDA default): measured peak of each step against the budget and the prediction, gradients
  against eager's, step time over eager's; ``compile=True`` at 50% (Inductor compiling the plan's
  runs) and ``torch.compile`` with Inductor beside them;
* ``whole_step``: AdamW updates inside the plan (#27): in backward, after backward, state in host
  memory with its updates overlapping backward (and the same with the overlap switched off, for
  the difference); measured whole-step peaks of 3 steps, parameters and state against eager's;
* ``mixtral``: a small Hugging Face Mixtral in bf16, where grouped GEMM runs (#30).

Times are medians of interleaved repetitions (CUDA synchronised around each step) over eager's.
Writes ``cuda.json`` and ``cuda.md`` into ``--out``.

    python -m benchmarks.studies.cuda_check --out DIR [--parts activations,whole_step,mixtral] [--deadline 480]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

import memplan
from memplan.models import zoo

# "cpu" only for a dry run of this script (``--device cpu --size tiny``): peaks then come from
# memplan's CPU tracker, and nothing here is a CUDA finding.
DEVICE = "cuda"


class Deadline:
    """Seconds left of the run: parts that would start too late are skipped, not cut off."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def _own(module: torch.nn.Module, inputs: Any = (), optimizer: torch.optim.Optimizer | None = None) -> int:
    """Device bytes the step's own resident tensors hold: parameters, buffers, inputs, optimizer
    state (what memplan's budget counts as resident)."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        tensors += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    seen = {}
    for t in tensors:
        if t.device.type == DEVICE:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _peak(step: Callable[[], Any], own: Callable[[], int]) -> int:
    """Device bytes at the step's peak, allocator-measured: what the step allocates above what was
    resident before it, plus the step's own resident tensors (``own()``, read before the step), so
    that other models alive in this process and the libraries' workspaces (cuBLAS keeps one per
    thread and stream) are left out; `workspace` reports the latter."""
    if hasattr(step, "clear"):
        step.clear()  # the gradients the step makes are its own: none held before it
    if DEVICE != "cuda":
        return memplan.measure_peak(step, "cpu")
    resident = own()
    _sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    _sync()
    return int(torch.cuda.max_memory_allocated()) - before + resident


def _times(steps: dict[str, Callable[[], Any]], reps: int) -> dict[str, dict[str, float]]:
    """Per step: median seconds and median / spread of per-round ratios to the first step (eager)."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            if hasattr(steps[n], "clear"):
                steps[n].clear()
            _sync()
            t0 = time.perf_counter()
            steps[n]()
            _sync()
            times[n].append(time.perf_counter() - t0)
    base = times[names[0]]
    out = {}
    for n in names:
        ratios = [t / b for t, b in zip(times[n], base)]
        out[n] = {"median_s": statistics.median(times[n]), "ratio": statistics.median(ratios),
                  "spread": [min(ratios), max(ratios)]}
    return out


WORST: dict[str, Any] = {}  # the last comparison's worst parameter: where a gradient fault shows first


def _grad_error(module: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """Largest |g - g_eager| / max|g_eager| over the parameters (its parameter in `WORST`)."""
    worst = 0.0
    matched = 0
    WORST.clear()
    for name, p in module.named_parameters():
        ref = reference.get(name.replace("_orig_mod.", ""))  # torch.compile's wrapper prefixes the names
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


def _loss_step(module: torch.nn.Module, args: tuple, kwargs: dict) -> Callable[[], None]:
    def step() -> None:
        module(*args, **kwargs).backward()
    step.clear = lambda: [setattr(p, "grad", None) for p in module.parameters()]
    return step


def activations(name: str, size: str, batch: int | None, fractions: tuple[float, ...], dl: Deadline,
                time_limit: float) -> dict:
    built = zoo.build(name, size=size, batch_size=batch, device=DEVICE)
    base = memplan.WithLoss(built.model, built.loss_fn)
    args, kwargs = tuple(built.example_inputs), dict(built.example_kwargs)
    out: dict[str, Any] = {"model": f"{name} ({size}, batch {batch or 'default'})"}

    eager = copy.deepcopy(base)
    eager_step = _loss_step(eager, args, kwargs)
    torch.manual_seed(0)
    eager_step()  # warm-up: cuBLAS / cuDNN workspaces are allocated once, then resident
    _sync()
    resident = _allocated()
    params = sum(p.numel() * p.element_size() for p in eager.parameters())
    torch.manual_seed(0)
    eager_peak = _peak(eager_step, lambda: _own(eager, (args, kwargs)))
    reference = {n: p.grad.detach().clone() for n, p in eager.named_parameters() if p.grad is not None}
    out.update(eager_peak=eager_peak, resident_before_step=resident, param_bytes=params)
    torch.manual_seed(0)
    eager_step.clear()
    eager_step()
    out["eager_again_grad_error"] = _grad_error(eager, reference)  # the floor: eager against itself
    steps: dict[str, Callable[[], Any]] = {"eager": eager_step}
    rows = []
    for fraction in fractions:
        if dl.left() < 60:
            rows.append({"fraction": fraction, "skipped": "deadline"})
            continue
        for compiled in (False, True) if fraction == 0.5 else (False,):
            if compiled and dl.left() < 150:  # Inductor compiles every run of the plan: minutes on a cold cache
                rows.append({"fraction": fraction, "compiled": True, "skipped": "deadline"})
                continue
            label = f"memplan {fraction:.0%}" + (" compiled" if compiled else "")
            row: dict[str, Any] = {"fraction": fraction, "compiled": compiled}
            try:
                module = copy.deepcopy(base)
                budget = int(fraction * eager_peak)
                t0 = time.perf_counter()
                opt = memplan.optimize(module, budget, example_inputs=args, example_kwargs=kwargs,
                                       time_limit=time_limit, compile=compiled)
                row["plan_s"] = time.perf_counter() - t0
                step = _loss_step(opt, args, kwargs)
                torch.manual_seed(0)
                t0 = time.perf_counter()
                step()  # compile=True compiles here
                row["first_step_s"] = time.perf_counter() - t0
                peaks = []
                for _ in range(2):
                    torch.manual_seed(0)
                    peaks.append(_peak(step, lambda: _own(module, (args, kwargs))))
                plan = opt.plan
                row.update(budget=budget, measured=peaks, predicted=plan.predicted_peak,
                           under_budget=max(peaks) <= budget, grad_error=_grad_error(module, reference),
                           worst_grad=dict(WORST),
                           predicted_time_ratio=plan.predicted_time / plan.store_all_time,
                           offloaded_bytes=sum(t.nbytes for t in plan.transfers), offloaded_values=len(plan.transfers),
                           predicted_wait=plan.predicted_wait)
                if compiled and opt.compile_report is not None:
                    row["compile_report"] = opt.compile_report.summary()
                steps[label] = step
            except Exception:
                row["error"] = traceback.format_exc(limit=8)
            rows.append(row)
    if dl.left() > 90:
        try:  # the compiler people use, as they run it
            inductor = torch.compile(copy.deepcopy(base))
            step = _loss_step(inductor, args, kwargs)
            t0 = time.perf_counter()
            torch.manual_seed(0)
            step()
            row = {"method": "torch.compile (Inductor)", "compile_s": time.perf_counter() - t0}
            torch.manual_seed(0)
            row["measured"] = [_peak(step, lambda: _own(inductor, (args, kwargs)))]
            row["grad_error"] = _grad_error(inductor, reference)
            steps["inductor"] = step
            rows.append(row)
        except Exception:
            rows.append({"method": "torch.compile (Inductor)", "error": traceback.format_exc(limit=8)})
    out["rows"] = rows
    out["times"] = _times(steps, reps=7)
    return out


def whole_step(name: str, size: str, batch: int | None, dl: Deadline, time_limit: float) -> dict:
    built = zoo.build(name, size=size, batch_size=batch, device=DEVICE)
    base = memplan.WithLoss(built.model, built.loss_fn)
    args, kwargs = tuple(built.example_inputs), dict(built.example_kwargs)

    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)

    def loop(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            module(*args, **kwargs).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step

    eager = copy.deepcopy(base)
    eager_opt = adamw(eager)
    eager_step = loop(eager, eager_opt)
    eager_peaks = []
    for _ in range(3):
        torch.manual_seed(0)
        eager_peaks.append(_peak(eager_step, lambda: _own(eager, (args, kwargs), eager_opt)))
    out: dict[str, Any] = {"model": f"{name} ({size}, batch {batch or 'default'})", "eager_peaks": eager_peaks}
    steps: dict[str, Callable[[], Any]] = {"eager": eager_step}
    rows = []
    modes = [("in backward", dict(optimizer_state="device"), 0.75),
             ("after backward", dict(optimizer_state="device", updates_after_backward=True), 0.85),
             ("state on host", dict(optimizer_state="host"), 0.6),
             ("state on host, no overlap", dict(optimizer_state="host"), 0.6)]
    for label, options, fraction in modes:
        if dl.left() < 45:
            rows.append({"mode": label, "skipped": "deadline"})
            continue
        row: dict[str, Any] = {"mode": label}
        try:
            module = copy.deepcopy(base)
            optimizer = adamw(module)
            budget = int(fraction * max(eager_peaks))
            for _ in range(4):
                try:
                    t0 = time.perf_counter()
                    opt = memplan.optimize(module, budget, optimizer=optimizer, time_limit=time_limit,
                                           example_inputs=args, example_kwargs=kwargs, **options)
                    break
                except memplan.InfeasibleBudgetError:
                    budget = int(budget * 1.1)
            row["plan_s"] = time.perf_counter() - t0
            step = loop(opt, optimizer)
            if label.endswith("no overlap"):
                row["note"] = "host updates joined one by one (HostUpdates.submit then join)"
                step = _without_overlap(step)
            peaks = []
            for _ in range(3):
                torch.manual_seed(0)
                peaks.append(_peak(step, lambda: _own(module, (args, kwargs), optimizer)))
            plan = opt.plan
            ref_params = dict(eager.named_parameters())
            # after 3 steps each, parameters against eager's 3 steps (the loops saw the same data)
            err = max((p.detach().float() - ref_params[n].detach().float()).abs().max().item()
                      for n, p in module.named_parameters())
            row.update(budget=budget, predicted=plan.predicted_peak, measured=peaks,
                       under_budget=max(peaks) <= budget, param_error_after_3=err,
                       predicted_time_ratio=plan.predicted_time / plan.store_all_time)
            steps[label] = step
        except Exception:
            row["error"] = traceback.format_exc(limit=8)
        rows.append(row)
    out["rows"] = rows
    out["times"] = _times(steps, reps=7)
    return out


def _without_overlap(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with each host update joined as soon as it is submitted (no overlap)."""
    from memplan.updates.runner import HostUpdates

    def serial() -> None:
        submit = HostUpdates.submit

        def submit_and_join(self, fn, *a):
            submit(self, fn, *a)
            self.join()
        HostUpdates.submit = submit_and_join
        try:
            step()
        finally:
            HostUpdates.submit = submit
    return serial


def mixtral(dl: Deadline, time_limit: float) -> dict:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).to(device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (4, 64), device=DEVICE)
    out: dict[str, Any] = {"model": "MixtralForCausalLM (2 layers, 4 experts, top 2, hidden 128), bf16, batch 4x64",
                           "experts_implementation": str(getattr(config, "_experts_implementation", None))}

    class LM(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids, labels=ids).loss

    eager = LM(copy.deepcopy(model))
    eager_step = _loss_step(eager, (ids,), {})
    eager_step()
    eager_peak = _peak(eager_step, lambda: _own(eager, ids))
    reference = {n: p.grad.detach().clone() for n, p in eager.named_parameters() if p.grad is not None}
    out["eager_peak"] = eager_peak
    rows = []
    for entry in ("optimize", "backend"):
        for fraction in (0.8,):
            if dl.left() < 40:
                break
            row: dict[str, Any] = {"entry": entry, "fraction": fraction}
            try:
                module = LM(copy.deepcopy(model))
                budget = int(fraction * eager_peak)
                if entry == "optimize":  # graph breaks (if any) hand it to the backend
                    wrapped = memplan.optimize(module, budget, time_limit=time_limit)
                else:
                    wrapped = torch.compile(module, backend=memplan.backend(budget=budget, time_limit=time_limit))
                step = _loss_step(wrapped, (ids,), {})
                for _ in range(3):  # the backend's split holds from the third step
                    step()
                peaks = [_peak(step, lambda: _own(module, ids)) for _ in range(2)]
                row.update(budget=budget, measured=peaks, under_budget=max(peaks) <= budget,
                           grad_error=_grad_error(module, reference))
            except Exception:
                row["error"] = traceback.format_exc(limit=8)
            rows.append(row)
    out["rows"] = rows
    return out


def _markdown(results: dict) -> str:
    lines = ["# Checks on a CUDA device", "",
             f"{results.get('device')}; torch {torch.__version__}; peaks from `torch.cuda.max_memory_allocated` "
             "over each step, everything resident included.", ""]
    lines.append("```json")
    lines.append(json.dumps(results, indent=1, default=str)[:60000])
    lines.append("```")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="whole_step,activations,mixtral")
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--time-limit", type=float, default=8.0, help="memplan's time_limit per plan")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script, nothing measured on CUDA")
    parser.add_argument("--size", default="small", help="zoo size (tiny for a dry run)")
    args = parser.parse_args()
    dl = Deadline(args.deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    global DEVICE
    DEVICE = args.device
    size = args.size
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
                               "torch": torch.__version__}

    def save() -> None:
        (args.out / "cuda.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "cuda.md").write_text(_markdown(results))

    parts: dict[str, Callable[[], Any]] = {
        "whole_step": lambda: whole_step("gpt", size, 16, dl, args.time_limit),
        "activations_gpt": lambda: activations("gpt", size, 32, (0.5, 0.35), dl, args.time_limit),
        "mixtral": lambda: mixtral(dl, args.time_limit),
        "activations_resnet50": lambda: activations("resnet50", size, 32, (0.5,), dl, args.time_limit),
    }
    wanted = args.parts.split(",")
    for key, fn in parts.items():
        if not any(key.startswith(w) for w in wanted):
            continue
        if dl.left() < 40:
            results[key] = {"skipped": "deadline"}
            continue
        t0 = time.perf_counter()
        try:
            results[key] = fn()
        except Exception:
            results[key] = {"error": traceback.format_exc(limit=10)}
        results[key]["wall_s"] = time.perf_counter() - t0
        print(f"{key}: {results[key]['wall_s']:.1f} s", flush=True)
        save()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
