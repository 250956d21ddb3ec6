"""How well memplan's predictions match measurements, per zoo model.

For each model: predicted vs measured peak of the eager step (eager autograd
replayed on fake tensors vs the real step under the storage tracker), of the
joint graph run in order (the simulator vs the runtime), and FLOPs against
``FlopCounterMode``. Then the capture of a 1.3B-parameter GPT on the meta
device: seconds and resident memory, in a fresh process.

    python -m benchmarks.prediction_accuracy [--no-1p3b]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import memplan
from memplan import zoo
from memplan.measure import measure_peak

MODELS = {"mlp": 512, "cnn": 32, "gpt": 16, "unet": 8, "vit": 16, "resnet50": 8}


def _row(name: str, batch: int) -> str:
    zm = zoo.build(name, size="tiny", batch_size=batch)
    step = memplan.WithLoss(zm.model, zm.loss_fn)
    args, kwargs = tuple(zm.example_inputs), dict(zm.example_kwargs)
    a = memplan.analyze(step, args, kwargs)
    torch.manual_seed(0)
    eager = measure_peak(lambda: step(*args, **kwargs).backward())
    opt = memplan.optimize(step, 10**15, solver="store_all", example_inputs=args, example_kwargs=kwargs)
    for p in step.parameters():
        p.grad = None
    graph = measure_peak(lambda: opt(*args, **kwargs).backward())
    with FlopCounterMode(display=False) as fc:
        step(*args, **kwargs).backward()
    flops = fc.get_total_flops()
    return (
        f"| {name} (batch {batch}) | {a.num_nodes} | {a.eager_peak} | {eager} | {a.eager_peak / eager - 1:+.3%} "
        f"| {a.graph_peak} | {graph} | {a.graph_peak / graph - 1:+.3%} | {a.flops / flops - 1:+.3%} |"
    )


def capture_1p3b() -> dict:
    code = textwrap.dedent(
        """
        import json, resource, time
        from memplan import zoo, analyze, WithLoss
        t0 = time.perf_counter()
        zm = zoo.build("gpt-1.3b", meta=True)
        a = analyze(WithLoss(zm.model, zm.loss_fn), tuple(zm.example_inputs), zm.example_kwargs)
        print(json.dumps(dict(seconds=round(time.perf_counter() - t0, 1), nodes=a.num_nodes,
              param_bytes=a.param_bytes, eager_peak=a.eager_peak,
              max_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-1p3b", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/prediction_accuracy.md")
    args = parser.parse_args(argv)
    lines = [
        "| model | ATen ops | eager predicted B | eager measured B | error | graph predicted B | graph measured B | error | FLOPs error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, batch in MODELS.items():
        lines.append(_row(name, batch))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if not args.no_1p3b:
        res = capture_1p3b()
        text += f"\ngpt-1.3b on the meta device, capture + analysis in a fresh process: {json.dumps(res)}\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
