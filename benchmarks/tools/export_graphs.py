"""Export the joint graphs of real models as `solvers.Problem` JSON files.

The solver benchmarks (`benchmarks.studies.scale_bench`) and solver tests then run
on the real thing without torch: GPT-2-small-size (12 layers) and a 48-layer
variant, ResNet-50 and a U-Net, each captured on meta tensors (no memory),
loss included, costs from the roofline of the named device profile. The
budget stored in each file is store-all's peak (an unconstrained problem).

    python -m benchmarks.tools.export_graphs [--out benchmarks/graphs]
"""
from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

from benchmarks.harness.paths import GRAPHS_DIR
from memplan.planning.analysis import analyze_capture
from memplan.frontend.module import WithLoss
from memplan.capture.trace import capture
from memplan.costs.cost_model import get_profile
from memplan.models import zoo

# name -> (zoo model, size, config overrides)
GRAPHS = {
    "gpt12": ("gpt", "gpt2-small", {}),
    "gpt48": ("gpt", "gpt2-small", {"layers": 48}),
    "resnet50": ("resnet50", "full", {}),
    "unet": ("unet", "small", {}),
}


def export(name: str, out: Path, profile: str = "h100") -> Path:
    model_name, size, overrides = GRAPHS[name]
    m = zoo.build(model_name, size, meta=True, overrides=overrides)
    step = WithLoss(m.model, m.loss_fn)
    started = time.perf_counter()
    cap = capture(step, m.example_inputs, m.example_kwargs)
    analysis = analyze_capture(cap, get_profile(profile))
    problem = analysis.lowered.problem
    path = out / f"{name}.json.gz"
    with gzip.open(path, "wt") as f:
        f.write(problem.to_json())
    print(f"{name}: {problem.n} values, {problem.n_compute} to compute, store-all peak {problem.budget}, "
          f"{time.perf_counter() - started:.1f} s -> {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GRAPHS_DIR)
    parser.add_argument("names", nargs="*", default=list(GRAPHS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        export(name, args.out)


if __name__ == "__main__":
    main()
