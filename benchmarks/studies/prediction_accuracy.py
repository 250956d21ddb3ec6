"""How well memplan's predictions match measurements, per zoo model.

For each zoo model, and for the library-style models of
`memplan.models.library_style` (LSTM, GRU, split attention, gated MLP):
predicted vs measured peak of the eager step (eager autograd
replayed on fake tensors vs the real step under the storage tracker), of the
joint graph run in order (the simulator vs the runtime), and FLOPs against
``FlopCounterMode``. Then the capture of a 1.3B-parameter GPT on the meta
device: seconds and resident memory, in a fresh process.

    python -m benchmarks.studies.prediction_accuracy [--no-1p3b]
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
from benchmarks.harness.paths import RESULTS_DIR
from memplan.measure.tracker import measure_peak
from memplan.models import zoo
from memplan.models.library_style import LIBRARY_STYLE, square_loss

MODELS = {"mlp": 512, "cnn": 32, "gpt": 16, "unet": 8, "vit": 16, "resnet50": 8}


NOTES = """
Eager columns replay eager autograd on fake tensors, so they inherit PyTorch's meta kernels: on CPU,
`nn.LSTM` runs oneDNN's fused layer (`aten.mkldnn_rnn_layer`), whose meta kernel reports far less
workspace than oneDNN allocates, and `FlopCounterMode` counts no FLOPs in it. The graph columns,
which plans are made from, run the decomposed joint graph instead.
"""


def _zoo_row(name: str, batch: int) -> str:
    zm = zoo.build(name, size="tiny", batch_size=batch)
    return _row(f"{name} (batch {batch})", memplan.WithLoss(zm.model, zm.loss_fn), tuple(zm.example_inputs),
                dict(zm.example_kwargs))


def _library_row(name: str) -> str:
    torch.manual_seed(0)
    model, args = LIBRARY_STYLE[name]()
    return _row(f"{name} (library-style)", memplan.WithLoss(model, square_loss), args, {})


def _row(label: str, step: torch.nn.Module, args: tuple, kwargs: dict) -> str:
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
        f"| {label} | {a.num_nodes} | {a.eager_peak} | {eager} | {_error(a.eager_peak, eager)} "
        f"| {a.graph_peak} | {graph} | {_error(a.graph_peak, graph)} | {_error(a.flops, flops)} |"
    )


def _error(predicted: float, measured: float) -> str:
    # FlopCounterMode counts no FLOPs in ops it has no formula for (oneDNN's fused RNN layers).
    return f"{predicted / measured - 1:+.3%}" if measured else "n/a (measured 0)"


def capture_1p3b() -> dict:
    code = textwrap.dedent(
        """
        import json, resource, time
        from memplan import analyze, WithLoss
        from memplan.models import zoo
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
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "prediction_accuracy.md")
    args = parser.parse_args(argv)
    lines = [
        "| model | ATen ops | eager predicted B | eager measured B | error | graph predicted B | graph measured B | error | FLOPs error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, batch in MODELS.items():
        lines.append(_zoo_row(name, batch))
        print(lines[-1], flush=True)
    for name in LIBRARY_STYLE:
        lines.append(_library_row(name))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n" + NOTES
    if not args.no_1p3b:
        res = capture_1p3b()
        text += f"\ngpt-1.3b on the meta device, capture + analysis in a fresh process: {json.dumps(res)}\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
