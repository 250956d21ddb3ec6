"""Issue #48's GPU table in one run on a CUDA device, the caching allocator as the witness.

On this project's CPU machine every peak is a tracker's; on a GPU the allocator itself says how much
device memory a step held (``max_memory_allocated``) and how much it took from the device
(``max_memory_reserved``), compiled code (Inductor's kernels and their buffers) included. One run
covers these parts, in this order:

* ``activations_gpt``: zoo ``gpt`` (small, batch 32) at 50% of eager's measured peak: memplan's
  eager runtime, ``compile=True``, ``torch.compile`` (Inductor) alone, and ``torch.utils.checkpoint``
  around each transformer block (`benchmarks.harness.checkpointing`), in one table;
* ``whole_step``: gpt (small, batch 16) with AdamW updates inside the plan (#27): in backward (75%
  of eager's loop's peak), after backward (85%), state on host (60%; and that plan again with each
  host update joined at once, no overlap: timing only), each against eager's loop with the same
  optimizer, ``foreach=True`` and ``fused=True``; optimizer calls per step
  (``register_step_post_hook``; the loop's own ``optimizer.step()``, which finds no gradient after
  a planned step, counts one) and parameters after 3 steps against eager's;
* ``autocast_gpt``: gpt (small, batch 32) under ``torch.autocast(device, dtype=torch.bfloat16)``,
  eager and memplan at 50% (an error memplan raises there is the row's finding);
* ``gpt2_hf``: a compute-bound step: Hugging Face GPT-2 small (``GPT2Config()`` defaults but
  ``use_cache=False``, random init, fp32, 1024 tokens, the first batch of 8, 4, 2, 1 whose eager
  step fits) at 50%;
* ``mixtral``: a small Hugging Face Mixtral in bf16, where grouped GEMM runs (#30), through
  ``memplan.optimize`` and ``torch.compile(backend=memplan.backend(...))`` at 80%;
* ``activations_resnet50``: zoo ``resnet50`` (small, batch 32) at 50%, both runtimes (and
  ``torch.compile`` if time is left): gradients against eager's, peaks against the budget;
* ``data_parallel``: gpt (small, batch 16) with AdamW inside DDP and FSDP2, world size 1 (NCCL):
  each engine's eager loop, memplan inside it (DDP at 70% of its loop's peak, FSDP2 at 85%),
  parameters after the same steps against the loop's.

``--parts`` picks some (prefixes: ``activations`` is gpt's and ResNet-50's). Every row
(`benchmarks.harness.device_rows`): the budget, the plan's predicted peak, the measured peak
allocated and reserved (each step after ``torch.cuda.empty_cache`` and ``reset_peak_memory_stats``:
what it takes above what was there before it, plus its own parameters, buffers, inputs and
optimizer state, so that other models alive in the process are left out), gradients' max relative
difference from eager's, step time over eager's (median of interleaved rounds, CUDA synchronised
around each step), the plan's predicted step time (``Plan.predicted_overhead``, over store-all's, the
cost model's eager step; ``Plan.predicted_time``, the simulated schedule's seconds, in the JSON) and
|predicted - measured| / eager's step. A part that needs transformers is skipped with a note where
it is missing: the script installs nothing and runs on the machine's own torch.

Time: ``--deadline`` (480 s) counts from the start of the process. Each part gets a share of the
time left, weighted by the seconds it is expected to take on an H100/H200 (`PARTS`: estimates from
the parts' times in the H200 run of `benchmarks/results/cuda.md`, where planning ResNet-50 with
``compile=True`` alone took 182 s; time a part leaves unused goes to the later ones). A part that
would start with less than its minimum, or a row without the time it needs, is recorded as
skipped; a part still running at its share and a quarter is stopped (SIGALRM) and recorded as cut
off; an exception is recorded with its traceback's tail and the next row or part goes on.
``cuda.json`` (every figure) and ``cuda.md`` (the tables) are written into ``--out`` after each part.

    python -m benchmarks.studies.cuda_check --out DIR [--parts activations,whole_step,autocast,gpt2_hf,mixtral]
                                           [--deadline 480] [--time-limit 8]

Dry run, so that the script cannot rot between GPU runs (tests/test_cuda_check.py runs it):
``--device cpu --size tiny`` shrinks every part to toy shapes and batches (ResNet-50 at 80%, as its
parameters leave no plan at 50% there, without its compiled rows), takes peaks from memplan's CPU
tracker (reserved: n/a), runs on one thread, and stands in for Inductor (memplan's ``compile=`` gets
an fx interpreter, ``torch.compile`` the ``aot_eager`` backend): about 40 s on this project's
2-core machine. Nothing it writes is a finding.
"""
from __future__ import annotations

import time

_STARTED = time.perf_counter()  # --deadline counts from here: imports and CUDA's start included

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

import memplan  # noqa: E402
from benchmarks.harness.checkpointing import checkpoint_blocks  # noqa: E402
from benchmarks.harness.device_rows import (RUN, WORST, Deadline, add_times, autocast_ctx, count_calls,  # noqa: E402
                                            grad_error, loss_step, markdown, mb, measure, own_bytes, plan_fields,
                                            recorded, scaled, skip, tail, time_steps)
from benchmarks.models.layouts import LAYOUTS  # noqa: E402
from memplan.models import zoo  # noqa: E402


class SectionTimeout(BaseException):
    """A section ran past its hard deadline. Not an ``Exception``, so that no row's handler takes it."""


def _compiler() -> Any:
    """``compile=`` for memplan: Inductor on CUDA; in a dry run an fx interpreter (boxed, as Inductor's)."""
    if RUN.device == "cuda":
        return True

    def interpreter(gm: torch.fx.GraphModule, examples: Any) -> Callable[[list], Any]:
        return lambda box: torch.fx.Interpreter(gm).boxed_run(box)
    return interpreter


class LM(torch.nn.Module):
    """A Hugging Face causal LM as one differentiable step: ids in, the loss out."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids).loss


# -- sections -----------------------------------------------------------------------------------


def activations(out: dict, sec: Deadline, base: torch.nn.Module, args: tuple, kwargs: dict, *, time_limit: float,
                fraction: float = 0.5, compiled: bool | str = True, inductor: bool | str = True,
                checkpoint: bool = False, autocast: bool = False, needs: dict[str, float] | None = None) -> None:
    """One model's step: eager, memplan at ``fraction`` of eager's measured peak (eager runtime,
    and compiled), ``torch.compile`` alone, checkpoint per block (zoo gpt), in ``out["rows"]``.
    ``compiled``, ``inductor``: a string is the reason that row is skipped."""
    needs = {"plan": 20, "compiled": 45, "inductor": 20, "checkpoint": 5, **(needs or {})}
    rows: list[dict] = out.setdefault("rows", [])
    own = lambda m: (lambda: own_bytes(m, (args, kwargs)))  # noqa: E731

    t0 = time.perf_counter()
    eager = copy.deepcopy(base)
    eager_step = loss_step(eager, args, kwargs, autocast)
    torch.manual_seed(0)
    eager_step()  # warm-up: cuBLAS / cuDNN workspaces are allocated once, then resident
    eager_row: dict[str, Any] = {"method": "eager", "key": "eager"}
    measure(eager_row, eager_step, own(eager), n=1)
    rows.append(eager_row)
    eager_peak = eager_row["measured"][0]
    reference = {n: p.grad.detach().clone() for n, p in eager.named_parameters() if p.grad is not None}
    out.update(eager_peak=eager_peak, param_bytes=sum(p.numel() * p.element_size() for p in eager.parameters()))
    torch.manual_seed(0)
    eager_step.clear()
    eager_step()
    out["eager_again_grad_error"] = grad_error(eager, reference)  # the floor: eager against itself
    eager_row["row_s"] = time.perf_counter() - t0
    steps: dict[str, Callable[[], Any]] = {"eager": eager_step}
    budget = int(fraction * eager_peak)
    out["budget"] = budget

    for name, comp in [("memplan", False)] + ([("memplan compiled", True)] if compiled else []):
        row: dict[str, Any] = {"method": f"{name} {fraction:.0%}", "key": name, "budget": budget}
        rows.append(row)
        if comp and isinstance(compiled, str):
            row["skipped"] = compiled
            continue
        if skip(row, sec, needs["compiled" if comp else "plan"]):
            continue
        with recorded(row):
            module = copy.deepcopy(base)
            t0 = time.perf_counter()
            with autocast_ctx(autocast):
                opt = memplan.optimize(module, budget, example_inputs=args, example_kwargs=kwargs,
                                       time_limit=time_limit, compile=_compiler() if comp else False)
            row["plan_s"] = time.perf_counter() - t0
            step = loss_step(opt, args, kwargs, autocast)
            torch.manual_seed(0)
            t0 = time.perf_counter()
            step()  # compile=True compiles here
            row["first_step_s"] = time.perf_counter() - t0
            measure(row, step, own(module))
            plan_fields(row, opt)
            row["grad_error"] = grad_error(module, reference)
            row["worst_grad"] = dict(WORST)
            steps[name] = step

    if inductor:  # the compiler people use, as they run it
        label = "torch.compile (Inductor)" if RUN.device == "cuda" else "torch.compile (aot_eager, dry run)"
        row = {"method": label, "key": "torch.compile"}
        rows.append(row)
        if isinstance(inductor, str):
            row["skipped"] = inductor
        elif not skip(row, sec, needs["inductor"]):
            with recorded(row):
                module = torch.compile(copy.deepcopy(base), backend="inductor" if RUN.device == "cuda" else "aot_eager")
                step = loss_step(module, args, kwargs, autocast)
                t0 = time.perf_counter()
                torch.manual_seed(0)
                step()
                row["compile_s"] = time.perf_counter() - t0
                measure(row, step, own(module), dynamo=True)
                row["of_eager"] = max(row["measured"]) / eager_peak
                row["grad_error"] = grad_error(module, reference)
                steps["torch.compile"] = step

    if checkpoint:  # what people write by hand: torch.utils.checkpoint around each block
        row = {"method": "checkpoint per block", "key": "checkpoint"}
        rows.append(row)
        if not skip(row, sec, needs["checkpoint"]):
            with recorded(row):
                module = copy.deepcopy(base)
                blocks = checkpoint_blocks(module.model, LAYOUTS["gpt"])
                row["note"] = f"non-reentrant torch.utils.checkpoint around each of the {blocks} blocks"
                step = loss_step(module, args, kwargs, autocast)
                torch.manual_seed(0)
                step()
                measure(row, step, own(module))
                row["of_eager"] = max(row["measured"]) / eager_peak
                row["grad_error"] = grad_error(module, reference, drop=("block",))
                steps["checkpoint"] = step
    t0 = time.perf_counter()
    out["times"] = time_steps(steps)
    out["timing_s"] = time.perf_counter() - t0
    add_times(rows, out["times"])


def _zoo(name: str, size: str, batch: int) -> tuple[torch.nn.Module, tuple, dict]:
    built = zoo.build(name, size=size, batch_size=batch, device=RUN.device)
    return memplan.WithLoss(built.model, built.loss_fn), tuple(built.example_inputs), dict(built.example_kwargs)


def activations_zoo(out: dict, sec: Deadline, name: str, size: str, batch: int, time_limit: float,
                    **options: Any) -> None:
    out["model"] = f"{name} ({size}, batch {batch})" + (", bf16 autocast" if options.get("autocast") else "")
    base, args, kwargs = _zoo(name, size, batch)
    activations(out, sec, base, args, kwargs, time_limit=time_limit, **options)


def _loop(module: torch.nn.Module, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict,
          updates_inside: bool = False) -> Callable[[], None]:
    """One step of a training loop: forward and backward, then the optimizer's step (left out where
    the updates run inside the step: memplan's under DDP)."""
    def step() -> None:
        module(*args, **kwargs).backward()
        if not updates_inside:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def _param_error(module: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest |p - p_eager| / max|p_eager| over the parameters, by name (FSDP2's gathered whole)."""
    def whole(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()

    ref = {n: whole(p) for n, p in reference.named_parameters()}
    return max((whole(p) - ref[n]).abs().max().item() / (ref[n].abs().max().item() or 1.0)
               for n, p in module.named_parameters())


def whole_step(out: dict, sec: Deadline, size: str, batch: int, time_limit: float) -> None:
    """The training loop with AdamW, eager against memplan's updates inside the plan, per optimizer kind."""
    out["model"] = f"gpt ({size}, batch {batch})"
    base, args, kwargs = _zoo("gpt", size, batch)
    rows: list[dict] = out.setdefault("rows", [])

    modes = [("in backward", dict(optimizer_state="device"), 0.75),
             ("after backward", dict(optimizer_state="device", updates_after_backward=True), 0.85),
             ("state on host", dict(optimizer_state="host"), 0.6)]
    steps: dict[str, Callable[[], Any]] = {}
    base_of: dict[str, str] = {}
    for kind in ("foreach", "fused"):
        def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
            return torch.optim.AdamW(m.parameters(), lr=1e-3, **{kind: True})

        eager_key = f"eager, {kind}"
        eager_row: dict[str, Any] = {"method": "eager loop", "optimizer": kind, "key": eager_key}
        if kind != "foreach":
            eager_row["note"] = "step time over eager's loop with foreach AdamW"
        rows.append(eager_row)
        with recorded(eager_row):
            eager = copy.deepcopy(base)
            eager_opt = adamw(eager)
            eager_step = _loop(eager, eager_opt, args, kwargs)
            measure(eager_row, eager_step, lambda: own_bytes(eager, (args, kwargs), eager_opt), n=3,
                     calls=count_calls(eager_opt))
            steps[eager_key] = eager_step
        if "error" in eager_row:
            continue
        for label, options, fraction in modes:
            row: dict[str, Any] = {"method": label, "optimizer": kind, "key": f"{label}, {kind}"}
            rows.append(row)
            if skip(row, sec, 20):
                continue
            with recorded(row):
                module = copy.deepcopy(base)
                optimizer = adamw(module)
                calls = count_calls(optimizer)
                budget = wanted = int(fraction * max(eager_row["measured"]))
                t0 = time.perf_counter()
                for attempt in range(3):
                    try:
                        opt = memplan.optimize(module, budget, optimizer=optimizer, time_limit=time_limit,
                                               example_inputs=args, example_kwargs=kwargs, **options)
                        break
                    except memplan.InfeasibleBudgetError:
                        if attempt == 2 or skip(row, sec, 20):
                            raise
                        budget = int(budget * 1.1)
                row["plan_s"] = time.perf_counter() - t0
                row["budget"] = budget
                if budget != wanted:
                    row["note"] = f"{fraction:.0%} of eager's peak ({mb(wanted)}) had no plan: budget raised"
                step = _loop(opt, optimizer, args, kwargs)
                measure(row, step, lambda: own_bytes(module, (args, kwargs), optimizer), n=3, calls=calls)
                plan_fields(row, opt)
                # after 3 steps each, parameters against eager's 3 steps (the loops saw the same data)
                row["param_error_after_3"] = _param_error(module, eager)
                steps[row["key"]] = step
                base_of[row["key"]] = eager_key
                if label == "state on host":
                    serial = {"method": "state on host, no overlap", "optimizer": kind,
                              "key": f"{label} serial, {kind}",
                              "note": "the plan above, each host update joined as soon as it is submitted; timing only",
                              "predicted_time_ratio": row["predicted_time_ratio"],
                              "predicted_time_s": row["predicted_time_s"]}
                    rows.append(serial)
                    steps[serial["key"]] = _without_overlap(step)
                    base_of[serial["key"]] = eager_key
    if steps:
        out["times"] = time_steps(steps, base_of)
        add_times(rows, out["times"])


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


def _transformers(out: dict) -> Any:
    """transformers, or None with the section marked skipped (it is not installed here)."""
    try:
        import transformers
    except ImportError as exc:
        out["skipped"] = f"transformers is not installed on this machine ({exc}); nothing installed"
        return None
    out["transformers"] = transformers.__version__
    return transformers


def gpt2_hf(out: dict, sec: Deadline, time_limit: float) -> None:
    """Compute-bound: Hugging Face GPT-2 small at 1024 tokens, the largest batch that fits, at 50%."""
    transformers = _transformers(out)
    if transformers is None:
        return
    if RUN.tiny:
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256)
        seq, batches = 64, (2,)
    else:
        config, seq, batches = transformers.GPT2Config(), 1024, (8, 4, 2, 1)
    config.use_cache = False  # a training step's: no key/value cache in the outputs
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(RUN.device).train()
    base = LM(model)
    for batch in batches:
        ids = torch.randint(0, config.vocab_size, (batch, seq), device=RUN.device)
        try:
            base(ids).backward()
            break
        except torch.cuda.OutOfMemoryError:
            ids = None
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
    if ids is None:
        raise RuntimeError(f"no batch of {batches} fits an eager step")
    model.zero_grad(set_to_none=True)
    out["model"] = (f"GPT2LMHeadModel ({config.n_layer} layers, width {config.n_embd}, "
                    f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters), fp32, batch {batch}x{seq}")
    activations(out, sec, base, (ids,), {}, time_limit=time_limit, compiled=False, inductor=False,
                needs={"plan": 40})


def mixtral(out: dict, sec: Deadline, time_limit: float) -> None:
    transformers = _transformers(out)
    if transformers is None:
        return
    hidden, layers, batch, seq = (32, 1, 2, 16) if RUN.tiny else (128, 2, 4, 64)
    config = transformers.MixtralConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                        use_cache=False)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(device=RUN.device, dtype=torch.bfloat16)
    ids = torch.randint(0, 512, (batch, seq), device=RUN.device)
    out.update(model=f"MixtralForCausalLM ({layers} layers, 4 experts, top 2, hidden {hidden}), bf16, "
                     f"batch {batch}x{seq}",
               experts_implementation=str(getattr(config, "_experts_implementation", None)))
    rows: list[dict] = out.setdefault("rows", [])
    eager = LM(copy.deepcopy(model))
    eager_step = loss_step(eager, (ids,), {})
    eager_step()
    eager_row: dict[str, Any] = {"method": "eager", "key": "eager"}
    measure(eager_row, eager_step, lambda: own_bytes(eager, ids), n=1)
    rows.append(eager_row)
    eager_peak = eager_row["measured"][0]
    reference = {n: p.grad.detach().clone() for n, p in eager.named_parameters() if p.grad is not None}
    steps: dict[str, Callable[[], Any]] = {"eager": eager_step}
    for entry in ("memplan.optimize", "torch.compile(backend=memplan.backend(...))"):
        budget = int(0.8 * eager_peak)
        row: dict[str, Any] = {"method": f"{entry} 80%", "key": entry, "budget": budget}
        rows.append(row)
        if skip(row, sec, 15):
            continue
        with recorded(row):
            module = LM(copy.deepcopy(model))
            if entry == "memplan.optimize":  # graph breaks (if any) hand it to the backend
                wrapped = memplan.optimize(module, budget, time_limit=time_limit)
            else:
                wrapped = torch.compile(module, backend=memplan.backend(budget=budget, time_limit=time_limit))
            step = loss_step(wrapped, (ids,), {})
            for _ in range(3):  # the backend's split holds from the third step
                step.clear()
                torch.manual_seed(0)
                step()
            measure(row, step, lambda: own_bytes(module, ids), dynamo=entry != "memplan.optimize")
            row["grad_error"] = grad_error(module, reference)
            if getattr(wrapped, "plan", None) is not None:
                plan_fields(row, wrapped)
            steps[entry] = step
    out["times"] = time_steps(steps)
    add_times(rows, out["times"])


def data_parallel(out: dict, sec: Deadline, size: str, batch: int, time_limit: float) -> None:
    """gpt with AdamW inside DDP and FSDP2 (#49), world size 1 (NCCL on CUDA, gloo in a dry run):
    each engine's eager loop, then memplan inside it at a share of that loop's peak (DDP: 70%,
    updates after backward in the plan; FSDP2: 85%, ``memplan.fully_shard``, the loop's own
    ``optimizer.step()``). Peaks by the allocator on CUDA (the profiler's events in a dry run, as
    FSDP2's blocks run through dynamo); parameters after the same steps against the eager loop's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from memplan.frontend.distributed import bucket_buffer_bytes
    from memplan.frontend.sharded import find_units

    out["model"] = f"gpt ({size}, batch {batch}), world size 1"
    base, args, kwargs = _zoo("gpt", size, batch)
    rows: list[dict] = out.setdefault("rows", [])
    steps: dict[str, Callable[[], Any]] = {}
    base_of: dict[str, str] = {}
    dist.init_process_group("nccl" if RUN.device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def own(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
            # DDP's gradient buckets, allocated when it was made, live through the step (memplan counts them)
            buckets = bucket_buffer_bytes(module.parameters()) if isinstance(module, DDP) else 0
            return buckets + own_bytes(module, (args, kwargs), optimizer)

        def engine_rows(engine: str, wrap: Callable[[torch.nn.Module], torch.nn.Module], fraction: float,
                        planned: Callable[[torch.nn.Module, torch.optim.Optimizer, int], tuple[Any, Any, bool]],
                        dynamo: bool) -> None:
            eager_row: dict[str, Any] = {"method": f"{engine} eager loop", "key": f"{engine} eager"}
            rows.append(eager_row)
            with recorded(eager_row):
                eager = wrap(copy.deepcopy(base))
                eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
                eager_step = _loop(eager, eager_opt, args, kwargs)
                torch.manual_seed(0)  # (each step seeded, as `measure` seeds its own: the same dropout)
                eager_step()  # FSDP2's lazy start and DDP's bucket rebuild: before the measured steps
                measure(eager_row, eager_step, lambda: own(eager, eager_opt), n=2)
                steps[eager_row["key"]] = eager_step
                base_of[eager_row["key"]] = eager_row["key"]  # (each engine's rows over its own eager loop)
            memplan_row: dict[str, Any] = {"method": f"{engine} + memplan", "key": f"{engine} memplan"}
            rows.append(memplan_row)
            if "error" in eager_row or skip(memplan_row, sec, 20):
                return
            with recorded(memplan_row):
                budget = memplan_row["budget"] = int(fraction * max(eager_row["measured"]))
                module = copy.deepcopy(base)
                optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
                t0 = time.perf_counter()
                wrapped, predicts, inside = planned(module, optimizer, budget)
                step = _loop(wrapped, optimizer, args, kwargs, updates_inside=inside)
                torch.manual_seed(0)
                step()  # planned in the first step (FSDP2's blocks: rehearsed for the next at its backward)
                memplan_row["plan_s"] = time.perf_counter() - t0
                measure(memplan_row, step, lambda: own(wrapped, optimizer), n=2, dynamo=dynamo)
                predicts(memplan_row)
                # after as many steps as the eager loop (3), on the same batch
                memplan_row["param_error_after_3"] = _param_error(wrapped, eager)
                steps[memplan_row["key"]] = step
                base_of[memplan_row["key"]] = eager_row["key"]

        def ddp_planned(module, optimizer, budget):
            ddp = DDP(module)
            memplan.optimize(ddp, budget, optimizer=optimizer, time_limit=time_limit)  # (DDP shares the parameters)
            return ddp, lambda row: plan_fields(row, ddp.module), True

        def fsdp_planned(module, optimizer, budget):
            memplan.fully_shard(module, budget, optimizer=optimizer, time_limit=time_limit)
            return module, lambda row: row.update(predicted=module.memplan_backend.predicted_peak), False

        def fsdp_wrap(module):
            for block in find_units(module):
                fully_shard(block)
            fully_shard(module)
            return module

        engine_rows("DDP", DDP, 0.7, ddp_planned, dynamo=False)
        engine_rows("FSDP2", fsdp_wrap, 0.85, fsdp_planned, dynamo=True)
        if steps:
            out["times"] = time_steps(steps, base_of)
            add_times(rows, out["times"])
    finally:
        dist.destroy_process_group()


TITLES = {
    "activations_gpt": "Activations: gpt at 50% of eager's peak, four ways",
    "whole_step": "Whole step with AdamW (#27): updates inside the plan against eager's loop",
    "autocast_gpt": "bf16 autocast: gpt",
    "gpt2_hf": "Compute-bound: Hugging Face GPT-2 small, 1024 tokens",
    "mixtral": "Mixture of experts (#30): Mixtral in bf16",
    "activations_resnet50": "ResNet-50: gradients and peaks, both runtimes",
    "data_parallel": "DDP and FSDP2 (#49), world size 1: memplan inside each engine against its eager loop",
}


# -- the run ------------------------------------------------------------------------------------

# Each part: its weight (seconds it is planned for on an H100/H200 in a 480 s run: its share of the
# time left is its weight over the remaining parts') and the least time worth starting it with.
PARTS: dict[str, tuple[float, float]] = {
    "activations_gpt": (60, 30),
    "whole_step": (80, 40),
    "autocast_gpt": (30, 15),
    "gpt2_hf": (60, 30),
    "mixtral": (30, 15),
    "activations_resnet50": (220, 30),
    "data_parallel": (40, 20),
}


def _on_alarm(signum: int, frame: Any) -> None:
    raise SectionTimeout()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the parts asked for; returns the results written to ``cuda.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default=",".join(PARTS), help="parts (or prefixes of them), comma separated")
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run, from its start")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="memplan's time_limit per plan (default 8 s; 0.5 s with --size tiny)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script, nothing measured on CUDA")
    parser.add_argument("--size", default="small", help="zoo size (tiny for a dry run)")
    args = parser.parse_args(argv)
    RUN.device, RUN.tiny = args.device, args.size == "tiny"
    RUN.reps, RUN.measures = (3, 1) if RUN.tiny else (7, 2)
    if RUN.device == "cpu":
        torch.set_num_threads(1)  # a dry run beside other work (the test suite's workers): no oversubscription
    time_limit = args.time_limit or (0.5 if RUN.tiny else 8.0)
    total = Deadline(args.deadline, start=_STARTED)
    args.out.mkdir(parents=True, exist_ok=True)
    size = args.size
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if RUN.device == "cuda" else "cpu (dry run)",
                               "torch": torch.__version__, "size": size, "time_limit": time_limit,
                               "deadline_s": args.deadline}
    try:  # its version only: the parts that use it import it
        results["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        results["transformers"] = None

    def save() -> None:
        results["wall_s"] = time.perf_counter() - _STARTED
        (args.out / "cuda.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "cuda.md").write_text(markdown(results, TITLES))

    # Toy shapes for a dry run: smaller batches (a CPU step, and memplan's tracker over it, stay in
    # milliseconds), and ResNet-50 at 80%, as at toy sizes its parameters leave no plan at 50%.
    gpt_batch, step_batch, cast_batch, resnet_batch = (4, 8, 4, 8) if RUN.tiny else (32, 16, 32, 32)
    resnet = dict(fraction=0.8, compiled="dry run: memplan checks each of ResNet-50's ~90 compiled runs, minutes "
                  "on this CPU; activations_gpt runs the compiled path",
                  inductor="dry run: activations_gpt runs torch.compile") if RUN.tiny else {}
    run: dict[str, Callable[[dict, Deadline], None]] = {
        "activations_gpt": lambda o, s: activations_zoo(o, s, "gpt", size, gpt_batch, time_limit, checkpoint=True),
        "whole_step": lambda o, s: whole_step(o, s, size, step_batch, time_limit),
        "autocast_gpt": lambda o, s: activations_zoo(o, s, "gpt", size, cast_batch, time_limit, autocast=True,
                                                     compiled=False, inductor=False),
        "gpt2_hf": lambda o, s: gpt2_hf(o, s, time_limit),
        "mixtral": lambda o, s: mixtral(o, s, time_limit),
        "activations_resnet50": lambda o, s: activations_zoo(o, s, "resnet50", size, resnet_batch, time_limit,
                                                             needs={"compiled": 190, "inductor": 40}, **resnet),
        "data_parallel": lambda o, s: data_parallel(o, s, size, step_batch, time_limit),
    }
    wanted = [w for w in args.parts.split(",") if w]
    selected = [key for key in PARTS if any(key.startswith(w) for w in wanted)]
    unknown = [w for w in wanted if not any(key.startswith(w) for key in PARTS)]
    if unknown:
        parser.error(f"no part starts with {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    for i, key in enumerate(selected):
        weight, minimum = PARTS[key]
        left = total.left() - 5  # for the last save
        share = left * weight / sum(PARTS[k][0] for k in selected[i:])
        out: dict[str, Any] = {"share_s": share}
        results[key] = out
        if left < scaled(minimum):
            out["skipped"] = f"deadline: {max(left, 0):.0f} s left of the run, at least {scaled(minimum):.0f} s needed"
            save()
            continue
        hard = max(1.0, min(share * 1.25 + 10, left))
        t0 = time.perf_counter()
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, hard)
        try:
            run[key](out, Deadline(share))
        except SectionTimeout:
            out["cut_off"] = f"still running {hard:.0f} s after it started (its share: {share:.0f} s): stopped there"
        except Exception:
            out["error"] = tail()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        out["wall_s"] = time.perf_counter() - t0
        print(f"{key}: {out['wall_s']:.1f} s", flush=True)
        save()
        gc.collect()
        torch._dynamo.reset()
        if RUN.device == "cuda":
            torch.cuda.empty_cache()
    save()
    return results


if __name__ == "__main__":
    if any(isinstance(part, dict) and part.get("cut_off") for part in main().values()):
        sys.stdout.flush()
        os._exit(0)  # a part stopped mid-call may leave threads or compile workers behind: no waiting for them
