"""The ``memplan`` command: plan a model's training step from the shell and show the plan.

::

    memplan report gpt2-small --budget 2GB
    memplan report models.py:build --budget 50% --json
    memplan sweep resnet50 --budgets 100%,80%,60%,40%,min --out curve.png

One job: turn a command line into calls on the library (zoo / factory ->
capture -> analysis -> :func:`memplan.pipeline.plan.solve_plan`) and print what comes
back, as rich tables or as JSON. Nothing is planned here that the library
could not plan; nothing big is allocated (zoo models are built on the meta
device, and capture runs on fake tensors).

Errors a user can fix (unknown target, unreadable budget, infeasible budget,
untraceable model) print one line and a hint and exit with status 2; no
traceback unless ``--debug``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.tools.report_view import fmt, print_report, report_data

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1


class CLIError(Exception):
    """A problem the user can fix: printed as one line plus a hint, exit status 2."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


# --------------------------------------------------------------------------- #
# Targets
# --------------------------------------------------------------------------- #


@dataclass
class Target:
    """What to plan: a module whose one call is the differentiable step, and its example inputs."""

    spec: str
    module: Any  # torch.nn.Module; the loss is inside it when the target gave one
    args: tuple
    kwargs: dict
    description: str


def _zoo_name(spec: str) -> bool:
    from memplan.models import zoo

    base = spec.split(":", 1)[0]
    return base in zoo.names() or base in zoo.aliases()


def _known_targets() -> str:
    from memplan.models import zoo

    return ", ".join(zoo.names() + list(zoo.aliases()))


def load_target(spec: str, batch_size: int | None = None, meta: bool = True) -> Target:
    """Resolve TARGET: a zoo name (``gpt2-small``, ``gpt:small``), ``file.py:factory`` or ``pkg.mod:factory``.
    A zoo model is built on the meta device (planning needs no values) unless ``meta`` is False."""
    import memplan
    from memplan.models import zoo

    if _zoo_name(spec):
        try:
            zm = zoo.build(spec, batch_size=batch_size, meta=meta)
        except (KeyError, ValueError) as exc:
            raise CLIError(str(exc).strip("'\""), hint="sizes are listed by `memplan.models.zoo.sizes(name)`") from None
        module = memplan.WithLoss(zm.model, zm.loss_fn)
        return Target(spec, module, tuple(zm.example_inputs), dict(zm.example_kwargs), zm.description)
    if ":" not in spec:
        raise CLIError(
            f"unknown target {spec!r}",
            hint=f"give a built-in model ({_known_targets()}), path/to/file.py:factory or package.module:factory",
        )
    where, name = spec.rsplit(":", 1)
    factory = _load_factory(where, name, spec)
    return _call_factory(factory, spec, batch_size)


def _load_factory(where: str, name: str, spec: str) -> Callable:
    if where.endswith(".py") or "/" in where or Path(where).suffix == ".py":
        path = Path(where)
        if not path.is_file():
            raise CLIError(f"unknown target {spec!r}: no file {where}", hint="TARGET is path/to/file.py:factory")
        mod_name = f"_memplan_target_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look their module up here
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's file: any error is theirs to see
            raise CLIError(f"cannot import {where}: {type(exc).__name__}: {exc}", hint="run with --debug for the traceback") from exc
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise CLIError(
                f"unknown target {spec!r}: no module {exc.name!r}",
                hint=f"give a built-in model ({_known_targets()}), path/to/file.py:factory or package.module:factory",
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise CLIError(f"cannot import {where}: {type(exc).__name__}: {exc}", hint="run with --debug for the traceback") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise CLIError(f"unknown target {spec!r}: {where} has no callable {name!r}",
                       hint="the factory returns (model, example_inputs) or (model, example_inputs, loss_fn)")
    return factory


def _call_factory(factory: Callable, spec: str, batch_size: int | None) -> Target:
    import torch

    import memplan

    kwargs = {}
    if batch_size is not None:
        params = inspect.signature(factory).parameters
        if "batch_size" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise CLIError(f"{spec} takes no batch_size argument", hint="drop --batch-size, or add a batch_size parameter")
        kwargs["batch_size"] = batch_size
    try:
        result = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise CLIError(f"{spec} raised {type(exc).__name__}: {exc}", hint="run with --debug for the traceback") from exc
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], torch.nn.Module):
        raise CLIError(f"{spec} must return (model, example_inputs) or (model, example_inputs, loss_fn)",
                       hint=f"it returned {type(result).__name__}")
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if isinstance(inputs, dict):
        args, kw = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kw = tuple(inputs), {}
    else:
        args, kw = (inputs,), {}
    model.train()
    module = memplan.WithLoss(model, loss_fn) if loss_fn is not None else model
    doc = (inspect.getdoc(factory) or "").strip().splitlines()
    return Target(spec, module, args, kw, f"{type(model).__name__} from {spec}" + (f": {doc[0]}" if doc else ""))


# --------------------------------------------------------------------------- #
# Budgets
# --------------------------------------------------------------------------- #


def parse_budget_arg(text: str, eager_peak: int | None, min_budget: Callable[[], int] | None = None) -> int:
    """Bytes from ``16GB``/``800MiB``/an int, ``50%`` (of the eager peak), or ``min`` (the smallest budget memplan finds a plan for)."""
    from memplan.frontend.budget import budget_fraction, parse_budget, share_of_peak

    text = text.strip()
    if text.lower() == "min":
        if min_budget is None:
            raise CLIError("budget 'min' needs the model analyzed first")
        return min_budget()
    try:
        fraction = budget_fraction(text)
        if fraction is None:
            return parse_budget(int(text) if text.isdigit() else text)
    except ValueError as exc:
        raise CLIError(str(exc), hint="or a percentage of the eager peak such as '50%', or 'min'") from None
    if eager_peak is None:
        raise CLIError(f"budget {text!r} needs the eager peak: analyze the model first")
    return share_of_peak(fraction, eager_peak)


def _check_budget_syntax(text: str) -> None:
    """Reject an unreadable budget before minutes of capture and solving."""
    parse_budget_arg(text, eager_peak=1, min_budget=lambda: 1)


def _bytes_arg(text: str) -> int:
    """An argparse type: bytes from 64GB, 64GiB or an int."""
    from memplan.core.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --------------------------------------------------------------------------- #
# Progress and the analysis
# --------------------------------------------------------------------------- #


class Progress:
    """Spinner lines on stderr, one per stage, each closed with its time; silent under --quiet."""

    def __init__(self, enabled: bool):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, key: str, text: str) -> Iterator[None]:
        start = time.perf_counter()
        outcome = ""
        try:
            if self.enabled:
                with self.console.status(f"{text} ...", spinner="dots"):
                    yield
            else:
                yield
        except BaseException:
            outcome = " (failed)"
            raise
        finally:
            self.times[key] = time.perf_counter() - start
            if self.enabled:
                self.console.print(f"[dim]{text}: {self.times[key]:.1f} s{outcome}[/]", highlight=False)


# --optimizer NAME: the optimizer of the whole step, with torch's default hyperparameters.
OPTIMIZERS = {"sgd": ("SGD", {"lr": 0.01, "momentum": 0.9}), "adam": ("Adam", {}), "adamw": ("AdamW", {})}


def make_named_optimizer(name: str, params: Any) -> Any:
    """The optimizer ``--optimizer name`` means (`OPTIMIZERS`: torch's class, its default hyperparameters) over ``params``."""
    import torch

    cls_name, hyper = OPTIMIZERS[name]
    return getattr(torch.optim, cls_name)(params, **hyper)


def target_optimizer(target: Target, optimizer: str | None, master_weights: bool = False):
    """The optimizer ``--optimizer name`` means over the target's parameters (None without one);
    ``master_weights``: bf16/fp16 paged parameters update through fp32 masters."""
    if optimizer is None:
        return None
    opt = make_named_optimizer(optimizer, target.module.parameters())
    if master_weights:
        from memplan.updates.master_weights import use_master_weights

        use_master_weights(opt)
    return opt


def analyze_target(target: Target, progress: Progress, device_profile: str | None, optimizer=None,
                   host_state: bool = False, paged: bool = False):
    """The target's step analyzed (with ``optimizer``, from `target_optimizer`: the whole step)."""
    from memplan.costs.cost_model import get_profile
    from memplan.pipeline.stages import analyze

    import torch

    device = next((p.device for p in target.module.parameters()), torch.device("cpu"))
    try:
        profile = get_profile(device_profile, device)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return analyze(target.module, target.args, target.kwargs, device_profile=profile, optimizer=optimizer,
                   host_state=host_state, paged=paged, stage=progress.stage)


def _solve_options(args: argparse.Namespace) -> dict:
    """The solve's options from the command line, checked as ``optimize`` checks them (`PlanOptions`)."""
    from memplan.pipeline.options import PlanOptions

    try:
        options = PlanOptions(solver=args.solver, time_limit=args.time_limit,
                              offload=bool(getattr(args, "offload", False)))
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    return {"solver": options.solver, "time_limit": options.time_limit, "offload": options.offload}


# --------------------------------------------------------------------------- #
# report
# --------------------------------------------------------------------------- #


def cmd_report(args: argparse.Namespace, progress: Progress) -> int:
    from rich.console import Console

    from memplan.pipeline.clock import PlanningClock
    from memplan.pipeline.plan import InfeasibleBudgetError, solve_paging_as_needed, solve_whole_step
    from memplan.pipeline.options import may_page_as_needed
    from memplan.updates.host_memory import default_host_limit

    started = time.perf_counter()  # --time-limit bounds the whole command, as optimize's time_limit does
    _check_budget_syntax(args.budget)
    if args.optimizer_state != "auto" and not args.optimizer:
        raise CLIError(f"--optimizer-state {args.optimizer_state} places an optimizer's state", hint="add --optimizer adamw")
    paged = args.parameters == "host"
    if args.master_weights and args.parameters == "device":
        raise CLIError("--master-weights keeps fp32 masters of paged parameters", hint="leave out --parameters device")
    if paged and (not args.optimizer or args.optimizer_state == "device" or args.fsdp2 or getattr(args, "ddp", False)):
        raise CLIError("--parameters host pages the parameters of one process, updated on the host",
                       hint="add --optimizer adamw; leave out --optimizer-state device, --fsdp2 and --ddp")
    if args.fsdp2:
        return _report_fully_shard(args, progress)
    if args.world_size is not None or args.plot:
        raise CLIError("--world-size and --plot are options of --fsdp2", hint="add --fsdp2")
    options = _solve_options(args)
    with progress.stage("build", f"loading {args.target}"):
        target = load_target(args.target, args.batch_size)
    optimizer = target_optimizer(target, args.optimizer, args.master_weights)
    analysis = analyze_target(target, progress, args.device_profile, optimizer,
                              host_state=args.optimizer_state == "host" or paged, paged=paged)
    engine = 0
    if getattr(args, "ddp", False):
        analysis, engine = _inside_data_parallel(analysis, target.module)
    budget = parse_budget_arg(args.budget, analysis.eager_peak,
                              lambda: _min_budget(analysis, progress, options["offload"]) + engine)
    limit = "" if args.time_limit is None else f", limit {args.time_limit:g} s"
    host_limit = default_host_limit() if args.host_memory is None else args.host_memory
    with progress.stage("solve", f"solving for {fmt(budget)} with {args.solver}{limit}"):
        try:
            clock = PlanningClock.begin(args.time_limit, started).sized_to(analysis.num_nodes)
            solve_options = dict(clock=clock, solver=options["solver"], offload=options["offload"],
                                 may_move_state=args.optimizer_state == "auto" and not paged, host_limit=host_limit)
            # --parameters auto pages what a step that does not fit otherwise needs (one process only)
            if may_page_as_needed(args.parameters, optimizer is not None, args.optimizer_state) and not engine:
                plan = solve_paging_as_needed(analysis, budget, target.module, optimizer, **solve_options)
            else:
                plan = solve_whole_step(analysis, budget - engine, **solve_options)
        except InfeasibleBudgetError as exc:
            if not engine:
                raise
            raise InfeasibleBudgetError(budget, exc.min_budget + engine, engine_bytes=engine) from None
    if engine:
        plan = dataclasses.replace(plan, budget=budget, predicted_peak=plan.predicted_peak + engine, engine_bytes=engine)
    data = report_data(target, plan, progress, args.depth, host_limit)
    if args.save:
        plan.save(args.save)
        data["saved_to"] = str(args.save)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        console = Console()
        print_report(console, target, plan, data, args.top)
        if args.save:
            console.print(f"\nplan saved to {args.save}: reuse it with memplan.optimize(model, plan={str(args.save)!r})")
    return 0


def _report_fully_shard(args: argparse.Namespace, progress: Progress) -> int:
    """``report --fsdp2``: one rank of ``--world-size`` under `memplan.fully_shard` (`memplan.tools.sharded_report`)."""
    from rich.console import Console

    import memplan
    from memplan.tools.sharded_report import report_rank

    world = 2 if args.world_size is None else args.world_size
    for refused, message, hint in [
        (args.ddp, "--ddp and --fsdp2 plan inside different engines", "choose one"),
        (args.budget.strip().lower() == "min", "--fsdp2 plans one budget per rank, not 'min'",
         "give bytes (16GB) or a share of plain FSDP2's step (60%)"),
        (args.offload or args.device_profile or args.save, "--offload, --device-profile and --save are not options "
         "of --fsdp2", "its plans take memplan.fully_shard's defaults (the device's own profile)"),
        (world < 1, f"--world-size {world}: a run has at least one rank", "--world-size 8, say")]:
        if refused:
            raise CLIError(message, hint=hint)

    def build():
        target = load_target(args.target, args.batch_size, meta=False)
        return target.module, target.args, target.kwargs

    make_optimizer = functools.partial(make_named_optimizer, args.optimizer) if args.optimizer else None
    try:
        report = report_rank(build, args.budget, world, make_optimizer, solver=args.solver,
                             time_limit=args.time_limit, stage=progress.stage,
                             optimizer_state="host" if args.optimizer_state == "host" else "device")
    except memplan.InfeasibleBudgetError as exc:  # (the generic hint offers --budget min)
        raise CLIError(f"budget {fmt(exc.budget)} is below the smallest split memplan found for one rank of "
                       f"{world}, {fmt(exc.min_budget)} ({exc.min_budget} bytes)",
                       hint=f"use --budget {_round_up(exc.min_budget)} or more, or more ranks") from None
    if args.plot:
        from memplan.tools.viz import plot_rank_memory

        plot_rank_memory(report).savefig(args.plot)
    if args.json:
        print(json.dumps(report.to_json() | ({"plot": str(args.plot)} if args.plot else {}), indent=1))
    else:
        Console().print(report.table(f"{args.target}: one rank of {world} under memplan.fully_shard (fake process "
                                     "group)"), *([f"memory plot written to {args.plot}"] if args.plot else []))
    return 0


def _inside_data_parallel(analysis, module) -> tuple[Any, int]:
    """The analysis as `memplan.optimize(DDP(model))` plans it (updates after backward, on the
    averaged gradients), and the bytes of DDP's gradient buckets, held all step outside the graph."""
    from memplan.frontend.distributed import bucket_buffer_bytes
    from memplan.pipeline.stages import analyze_placement

    if analysis.updates and not analysis.lowered.placement.after_backward:
        analysis = analyze_placement(analysis, dataclasses.replace(analysis.lowered.placement, after_backward=True))
    return analysis, bucket_buffer_bytes(module.parameters())


def _min_budget(analysis, progress: Progress, offload: bool = False) -> int:
    from memplan.pipeline import sweep as sweeps

    with progress.stage("min_budget", "searching for the smallest budget a plan meets"):
        return sweeps.min_budget(analysis, offload)


# --------------------------------------------------------------------------- #
# sweep
# --------------------------------------------------------------------------- #


def cmd_sweep(args: argparse.Namespace, progress: Progress) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from memplan.pipeline import sweep as sweeps
    from memplan.tools import viz

    labels = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if not labels:
        raise CLIError("--budgets is empty", hint="for example --budgets 100%,80%,60%,40%,min")
    for label in labels:
        _check_budget_syntax(label)
    options = _solve_options(args)
    with progress.stage("build", f"loading {args.target}"):
        target = load_target(args.target, args.batch_size)
    analysis = analyze_target(target, progress, args.device_profile, target_optimizer(target, args.optimizer))
    find_min = functools.lru_cache(maxsize=1)(lambda: _min_budget(analysis, progress, options["offload"]))
    budgets = [(label, parse_budget_arg(label, analysis.eager_peak, find_min)) for label in labels]
    with progress.stage("solve", f"solving {len(budgets)} budgets with {args.solver}"):
        points = sweeps.sweep(analysis, budgets, **options)

    out = Path(args.out)
    try:
        fig = viz.plot_budget_curve(points, eager_peak=analysis.eager_peak,
                                    title=f"{target.spec}: memory / time trade-off (predicted)")
        fig.savefig(out, dpi=110)
    except ImportError as exc:
        raise CLIError(f"cannot draw the curve: {exc}", hint="pip install 'memplan[viz]' (matplotlib)") from None

    if args.json:
        print(json.dumps({
            "target": target.spec, "eager_peak": analysis.eager_peak, "param_bytes": analysis.param_bytes,
            "points": [p.as_dict() for p in points], "png": str(out),
        }, indent=1))
        return 0
    console = Console()
    console.print(f"{target.description}\neager peak {fmt(analysis.eager_peak)}, parameters {fmt(analysis.param_bytes)}")
    methods = sorted({p.plan.method for p in points if p.plan is not None})
    console.print(f"method: {', '.join(methods) or args.solver}; overhead is predicted step time over store-all's")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col, justify in (("budget", "left"), ("bytes", "right"), ("planned peak", "right"), ("overhead", "right"),
                         ("status", "left"), ("gap", "right"), ("solve", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for p in points:
        if p.plan is None:
            table.add_row(p.label, fmt(p.budget), "[red]infeasible[/]", "-", f"min {fmt(p.min_budget)}", "-", "-")
            continue
        gap = "-" if p.plan.gap is None else f"{p.plan.gap:.1%}"
        status = p.plan.status if len(methods) == 1 else f"{p.plan.method} {p.plan.status}"
        table.add_row(p.label, fmt(p.budget), fmt(p.plan.predicted_peak), f"{p.plan.predicted_overhead:.3f}x",
                      status, gap, f"{p.plan.solve_time:.2f}s")
    console.print(table)
    console.print(f"curve written to {out}")
    return 0


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memplan",
        description="Plan a PyTorch training step's memory under a budget: keep, recompute or offload each activation.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{report,sweep}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("target", metavar="TARGET",
                       help="built-in model (gpt2-small, resnet50, unet, mlp, gpt:small, ...), "
                            "path/to/file.py:factory or package.module:factory; a factory returns "
                            "(model, example_inputs) or (model, example_inputs, loss_fn)")
        p.add_argument("--batch-size", type=int, default=None, help="batch size (zoo models; factories taking batch_size)")
        p.add_argument("--solver", default="auto", help="solver method (default: auto)")
        p.add_argument("--time-limit", type=float, default=None,
                       help="seconds of planning: report's whole command, as optimize's time_limit (default 8, "
                            "more beyond 2,500 graph ops); sweep's each budget (default: the solver's own 30)")
        p.add_argument("--device-profile", default=None, help="cost model: cpu, a100, h100, h200 (default: the model's device)")
        p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                       help="allow offloading activations to host memory")
        p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                       help="plan the whole step: this optimizer's state and update in the budget (torch defaults)")
        p.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
        p.add_argument("--quiet", action="store_true", help="no progress display on stderr")
        p.add_argument("--debug", action="store_true", help="show tracebacks")

    report = sub.add_parser("report", help="plan one budget and show the plan")
    common(report)
    report.add_argument("--budget", required=True,
                        help="bytes (16GB, 800MiB), a percentage of the eager peak (50%%), or min")
    report.add_argument("--save", metavar="PLAN.json", default=None, help="write the plan for memplan.optimize(plan=...)")
    report.add_argument("--optimizer-state", choices=("auto", "device", "host"), default="auto",
                        help="with --optimizer: where its state lives; auto moves to host memory as much as the "
                             "budget needs (--fsdp2: device unless host)")
    report.add_argument("--parameters", choices=("auto", "device", "host"), default="auto",
                        help="with --optimizer: host pages every parameter from host memory (fetched before its "
                             "uses, updated on the host with its state); auto pages the largest as the budget "
                             "needs, device none")
    report.add_argument("--master-weights", action="store_true",
                        help="with --optimizer: update bf16/fp16 paged parameters through fp32 masters on the host")
    report.add_argument("--host-memory", type=_bytes_arg, default=None, metavar="BYTES",
                        help="host memory the plan may keep there (64GB): optimizer state, its update copies, "
                             "paged activations; more is refused (default: what this machine has available)")
    report.add_argument("--depth", type=int, default=2, help="module path components per table row (default 2)")
    report.add_argument("--top", type=int, default=25, help="largest modules shown in the table (default 25)")
    report.add_argument("--ddp", action="store_true",
                        help="plan one rank's step inside DistributedDataParallel: its gradient buckets in the "
                             "budget, the updates after backward (as memplan.optimize(DDP(model), ...) plans it)")
    report.add_argument("--fsdp2", action="store_true",
                        help="plan and run one rank under memplan.fully_shard, the other ranks a fake process "
                             "group: its shards, FSDP2's buffers and the planned blocks, predicted and measured")
    report.add_argument("--world-size", type=int, default=None, help="ranks of the --fsdp2 run (default 2)")
    report.add_argument("--plot", metavar="PNG", default=None, help="with --fsdp2: draw the rank's memory by holder")
    report.set_defaults(func=cmd_report)

    sweep = sub.add_parser("sweep", help="plan several budgets and draw the memory/time trade-off")
    common(sweep)
    sweep.add_argument("--budgets", default="100%,80%,60%,40%,min",
                       help="comma-separated budgets: bytes, percentages of the eager peak, min (default %(default)s)")
    sweep.add_argument("--out", default="memplan-sweep.png", help="PNG of the curve (default %(default)s)")
    sweep.set_defaults(func=cmd_sweep)
    return parser


def _error(console, message: str, hint: str | None) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if hint:
        console.print(f"[dim]hint: {escape(hint)}[/]", highlight=False, soft_wrap=True)


def _round_up(nbytes: int) -> str:
    """A budget string at or just above ``nbytes``, as a person would type it (``12.27GB``)."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return f"{math.ceil(nbytes / scale * 100) / 100:g}{unit}"
    return str(nbytes)


def _user_error(exc: BaseException) -> tuple[str, str | None] | None:
    """(message, hint) for an error the user can fix, None for anything else."""
    import memplan

    if isinstance(exc, CLIError):
        return str(exc), exc.hint
    if isinstance(exc, memplan.InfeasibleBudgetError):
        return (
            f"budget {fmt(exc.budget)} is below the smallest plan memplan found, {fmt(exc.min_budget)} ({exc.min_budget} bytes)",
            f"use --budget {_round_up(exc.min_budget)} or more (or --budget min), or a smaller --batch-size",
        )
    if isinstance(exc, memplan.HostMemoryError):
        from memplan.updates.host_memory import describe_parts

        return (f"the plan needs {fmt(exc.needed)} of host memory ({describe_parts(exc.parts)}), more than the "
                f"{fmt(exc.available)} "
                "it may use there",
                "give --host-memory the training machine's (this one's is the default), or --parameters device"
                if exc.parts.get("parameters") else
                "raise --budget (less moves to the host), --host-memory, or use --optimizer-state device")
    if isinstance(exc, memplan.CaptureError):
        return str(exc), (
            "memplan traces forward+backward with AOTAutograd on fake tensors; data-dependent Python control "
            "flow and .item() cannot be traced (--debug shows the traceback)"
        )
    if isinstance(exc, (memplan.PlanMismatchError, OSError)):
        return str(exc), None
    if isinstance(exc, NotImplementedError) and str(exc).startswith("memplan"):
        return str(exc), None
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = Progress(enabled=not args.quiet)
    try:
        return args.func(args, progress)
    except KeyboardInterrupt:
        progress.console.print("interrupted")
        return 130
    except BrokenPipeError:  # `memplan report ... --json | head`: the reader left, nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback, unless --debug
        if args.debug:
            raise
        known = _user_error(exc)
        if known is not None:
            _error(progress.console, *known)
            return EXIT_USER_ERROR
        _error(progress.console, f"internal error: {type(exc).__name__}: {exc}",
               "run with --debug for the traceback, and report it")
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
