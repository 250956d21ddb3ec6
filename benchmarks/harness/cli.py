"""``python -m benchmarks``: memplan against today's memory-saving methods, side by side.

Writes ``benchmarks/results/``: ``README.md`` (summary and one table per
model), ``<model>.md``, ``<model>.png`` (time ratio against measured peak)
and ``results.json``. ``--quick`` runs tiny models with fewer repetitions;
``--update-readme`` writes the summary table, with links to these files, into the
project README between ``<!-- bench:start -->`` and ``<!-- bench:end -->``. ``--from-results
results.json`` runs nothing: it writes the Markdown (and the README summary)
again from a finished run.

Without ``--methods`` the rows are those of issue #28's tables: eager,
checkpoint per block, checkpoint_sequential, Inductor + act. budget, memplan
eager runtime, memplan compiled. Those tables::

    python -m benchmarks --models gpt,vit,resnet50 --update-readme
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.harness.config import (
    DEFAULT_FRACTIONS,
    DEFAULT_MODELS,
    full_config,
    quick_config,
)
from benchmarks.harness.methods import ALIASES
from benchmarks.harness.paths import README, RESULTS_DIR
from benchmarks.harness.readme import update_readme
from benchmarks.harness.report import (
    dump_json,
    from_json,
    full_report,
    model_section,
    readme_summary,
    summary_markdown,
)
from benchmarks.harness.runner import ModelResult, run


def environment(threads: int, load_before: float) -> str:
    """Torch, device, threads, and the 1-minute load average before and after the run.

    The timing protocol wants an otherwise idle machine; the load says whether it was.
    """
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {threads} thread{'s' * (threads > 1)}"
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    return f"torch {torch.__version__}, {dev}, {platform.machine()}, {load}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, 3 repetitions, short searches (smoke run)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo names")
    p.add_argument("--budgets", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                   help="comma-separated fractions of eager's measured peak")
    p.add_argument("--methods", default="", help=f"comma-separated subset of {','.join(ALIASES)} (eager always runs)")
    p.add_argument("--reps", type=int, default=None, help="interleaved timing repetitions")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1: stable timings)")
    p.add_argument("--batch-size", type=int, default=None, help="override every model's batch size")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--update-readme", action="store_true", help="write the summary into README.md")
    p.add_argument("--from-results", type=Path, default=None, metavar="JSON",
                   help="run nothing: write the Markdown again from this results.json (into --out)")
    p.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_config(ns: argparse.Namespace):
    models = tuple(m for m in ns.models.split(",") if m)
    cfg = (quick_config if ns.quick else full_config)(models)
    changes: dict = dict(
        fractions=tuple(float(f) for f in ns.budgets.split(",") if f),
        out_dir=ns.out,
        plots=not ns.no_plots,
        threads=ns.threads,
        device="cuda" if torch.cuda.is_available() else "cpu",
        methods=tuple(ALIASES[m] for m in ns.methods.split(",") if m),
    )
    if ns.reps is not None:
        changes["reps"] = ns.reps
    if ns.batch_size is not None:
        changes["models"] = tuple(type(s)(s.name, s.size, ns.batch_size) for s in cfg.models)
    return cfg.with_(**changes)


def write_results(
    results: list[ModelResult], out: Path, total_s: float, plots: bool, env: str, json_too: bool = True
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(full_report(results, total_s, env))
    if json_too:
        (out / "results.json").write_text(dump_json(results, total_s, env))
    for r in results:
        (out / f"{r.spec.name}.md").write_text(model_section(r))
        if plots:
            from benchmarks.harness.plots import plot_model

            plot_model(r, out / f"{r.spec.name}.png")


def regenerate(source: Path, out: Path, plots: bool) -> tuple[list[ModelResult], float, str]:
    """The Markdown (and plots) of ``out`` written again from the run saved in ``source``."""
    results, total, env = from_json(json.loads(source.read_text()))
    same = source.resolve() == (out / "results.json").resolve()
    write_results(results, out, total, plots, env, json_too=not same)
    return results, total, env


def _link(readme: Path, out: Path) -> str:
    """``out`` as the README links it: relative to the README's folder where it lies below it."""
    try:
        return out.resolve().relative_to(readme.resolve().parent).as_posix()
    except ValueError:
        return out.resolve().as_posix()


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    cfg = build_config(ns)
    if ns.from_results is not None:
        results, total, env = regenerate(ns.from_results, cfg.out_dir, cfg.plots)
    else:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        results = run(cfg)
        total = time.perf_counter() - start
        env = environment(cfg.threads, load_before)
        write_results(results, cfg.out_dir, total, cfg.plots, env)
    summary = summary_markdown(results, total, env)
    print(summary)
    if ns.update_readme:
        update_readme(ns.readme, readme_summary(results, total, env, _link(ns.readme, cfg.out_dir)))
    print(f"results in {cfg.out_dir} ({total:.0f} s)")
    return 0
