"""How long ``memplan report`` takes on a model too big for its budget, and how good its plan is.

Issue #50's planning target: ``memplan report gpt-1.3b --budget 16GB --optimizer adamw`` (the whole
step with AdamW: parameters, gradients and state alone exceed 16 GB, so state must move to the
host) answers within 60 s on the 2-core CPU machine, with a plan whose predicted step time is at
most that of the better fixed rule (here: all of the optimizer's state on the host; parameter
paging is not built yet) and within 5% of what a 600 s solve finds. Each row is one ``memplan
report ... --json`` in a fresh process, as a user runs it: its wall time includes the import,
capture and analysis. Writes ``benchmarks/results/big_model_planning.md``.

    python -m benchmarks.studies.big_model_planning [--target gpt-1.3b] [--budget 16GB]
                                                    [--reference-limit 600] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.report import markdown_table

RESULTS = RESULTS_DIR / "big_model_planning.md"
ROOT = Path(__file__).resolve().parents[2]
TARGET_SECONDS = 60.0
WITHIN_REFERENCE = 0.05


@dataclass
class Row:
    """One ``memplan report`` run: what it was asked, how long it took, what it planned."""

    name: str
    options: tuple[str, ...]
    wall: float
    predicted: float
    store_all: float
    peak: int
    budget: int
    host_state: int


def run_report(target: str, budget: str, name: str, *options: str) -> Row:
    """``memplan report TARGET --budget BUDGET --optimizer adamw OPTIONS --json`` in a fresh process."""
    command = [sys.executable, "-m", "memplan.tools.cli", "report", target, "--budget", budget,
               "--optimizer", "adamw", *options, "--json", "--quiet"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout)
    s = data["summary"]
    return Row(name, options, wall, s["predicted_time"], s["store_all_time"], s["planned_peak"], s["budget"],
               data["memory"]["host_optimizer_state_bytes"])


def table(target: str, budget: str, rows: list[Row]) -> str:
    """The results page: a row per run, then whether the targets hold."""
    from memplan.core.units import format_bytes

    default, fixed, reference = rows
    lines = [f"# Planning a model bigger than its budget: `memplan report {target} --budget {budget} --optimizer adamw`",
             "", "Each row one `memplan report ... --json` in a fresh process on this machine (wall time from the "
             "command's start: import, capture, analysis, solve and report). `predicted` is the plan's predicted "
             "step time, against store-all's (everything kept, no budget).", ""]
    body = [[r.name, " ".join(r.options) or "(defaults)", f"{r.wall:.1f}", f"{r.predicted:.1f}",
             f"{r.predicted / r.store_all:.3f}x", format_bytes(r.peak), format_bytes(r.host_state)] for r in rows]
    lines.append(markdown_table(("run", "options", "wall s", "predicted s", "of store-all", "planned peak",
                                 "optimizer state on the host"), body))
    lines += ["", f"- default call within {TARGET_SECONDS:.0f} s: {'yes' if default.wall <= TARGET_SECONDS else 'no'} "
              f"({default.wall:.1f} s)",
              f"- at most the fixed rule's predicted time: {'yes' if default.predicted <= fixed.predicted * (1 + 1e-9) else 'no'} "
              f"({default.predicted:.1f} against {fixed.predicted:.1f})",
              f"- within {WITHIN_REFERENCE:.0%} of the long solve: "
              f"{'yes' if default.predicted <= reference.predicted * (1 + WITHIN_REFERENCE) else 'no'} "
              f"({default.predicted / reference.predicted:.3f}x its {reference.predicted:.1f})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gpt-1.3b")
    parser.add_argument("--budget", default="16GB")
    parser.add_argument("--reference-limit", type=float, default=600.0, help="the long solve's --time-limit")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = [run_report(args.target, args.budget, "memplan, default"),
            run_report(args.target, args.budget, "fixed rule: all state on the host", "--optimizer-state", "host"),
            run_report(args.target, args.budget, "memplan, long solve", "--time-limit", f"{args.reference_limit:g}")]
    text = table(args.target, args.budget, rows)
    args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
