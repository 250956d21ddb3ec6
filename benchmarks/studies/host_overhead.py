"""How much host work memplan adds to a step where the host is the bottleneck.

A small step is bound by the host (dispatch, Python, one call per op) on a CPU as a small GPU
step is, so the host work memplan adds over eager is measured here without a GPU: a model-library
GPT-2 (2 layers, width 64, batch 1, 32 tokens), one thread. Rows, each a ratio to its eager
counterpart, the median of per-round ratios over interleaved rounds:

* ``store-all``: forward + backward through memplan's runtime at a budget that keeps everything,
  over eager forward + backward;
* ``whole step, in backward`` / ``after backward`` / ``state on the host``: forward, backward and
  AdamW's update through memplan (``optimizer=``), over eager's loop (forward, backward,
  ``optimizer.step()``, ``zero_grad``) with the same AdamW (``foreach``, and ``fused`` beside it).

The optimizer calls per step (memplan's update buckets) are counted with a step hook.

    python -m benchmarks.studies.host_overhead [--rounds 25] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

import memplan
from benchmarks.harness.paths import RESULTS_DIR


class LMStep(nn.Module):
    """A causal LM's training step: its own loss of the inputs shifted by one."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def tiny_gpt2(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """GPT-2 from ``transformers`` at 2 layers, width 64, 4 heads; one sequence of 32 tokens."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=1000,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(seed))
    return LMStep(model), ids


def adamw(module: nn.Module, **kind: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, **kind)


def _calls(optimizer: torch.optim.Optimizer) -> list[int]:
    """A counter of ``optimizer.step`` calls, kept by a step hook."""
    count = [0]
    optimizer.register_step_post_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def _eager_loop(step: nn.Module, optimizer: torch.optim.Optimizer | None, ids: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        step(ids).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            for p in step.parameters():
                p.grad = None
    return run


def _planned_loop(opt: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        opt(ids).backward()
        for p in opt.parameters():
            p.grad = None
    return run


def _median_ratios(pairs: dict[str, tuple[Callable[[], None], Callable[[], None]]], rounds: int,
                   reps: int) -> dict[str, tuple[float, float, float]]:
    """Per row: (median of per-round ratios, its min, its max); each round times every row's
    candidate and baseline ``reps`` times each, interleaved, and takes the median of each."""
    ratios: dict[str, list[float]] = {name: [] for name in pairs}
    for fn, base in pairs.values():  # warm-up: plans made, state created, caches filled
        for _ in range(3):
            fn(), base()
    for _ in range(rounds):
        for name, (fn, base) in pairs.items():
            times: dict[str, list[float]] = {"fn": [], "base": []}
            for _ in range(reps):
                for key, f in (("base", base), ("fn", fn)):
                    start = time.perf_counter()
                    f()
                    times[key].append(time.perf_counter() - start)
            ratios[name].append(statistics.median(times["fn"]) / statistics.median(times["base"]))
    return {name: (statistics.median(r), min(r), max(r)) for name, r in ratios.items()}


def run(rounds: int, reps: int, threads: int) -> str:
    torch.set_num_threads(threads)
    step, ids = tiny_gpt2()
    eager_peak = memplan.measure_peak(lambda: step(ids).backward())
    rows: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
    calls: dict[str, tuple[int, int]] = {}
    eager_fb = copy.deepcopy(step)
    store_all = memplan.optimize(copy.deepcopy(step), budget=10 * eager_peak, example_inputs=(ids,))
    rows["store-all (forward + backward)"] = (_planned_loop(store_all, ids), _eager_loop(eager_fb, None, ids))
    eager_steps = {kind: copy.deepcopy(step) for kind in ("foreach", "fused")}
    eager_opts = {kind: adamw(m, **{kind: True}) for kind, m in eager_steps.items()}
    for label, options in (("in backward", {}), ("after backward", {"updates_after_backward": True}),
                           ("state on the host", {"optimizer_state": "host"})):
        model = copy.deepcopy(step)
        opt = adamw(model, foreach=True)
        count = _calls(opt)
        planned = memplan.optimize(model, budget=10 * eager_peak, example_inputs=(ids,), optimizer=opt, **options)
        for kind in ("foreach", "fused"):
            rows[f"whole step, {label} / eager {kind}"] = (_planned_loop(planned, ids),
                                                           _eager_loop(eager_steps[kind], eager_opts[kind], ids))
        planned_loop = _planned_loop(planned, ids)
        planned_loop()
        count[0] = 0
        planned_loop()  # one step, its optimizer calls counted
        calls[label] = (count[0], len([p for p in model.parameters() if p.requires_grad]))
    results = _median_ratios(rows, rounds, reps)
    lines = [f"## Host overhead: model-library GPT-2 (2 layers, width 64, batch 1, 32 tokens), {threads} thread(s)", "",
             f"{rounds} interleaved rounds of {reps} repetitions each; the ratio is the median of per-round ratios "
             "of medians (min - max over rounds in brackets). Eager's optimizer is AdamW with the same "
             "hyperparameters; memplan's is AdamW(foreach=True).", "",
             "| step | memplan / eager | min - max |", "|---|---|---|"]
    for name, (median, low, high) in results.items():
        lines.append(f"| {name} | {median:.3f} | {low:.3f} - {high:.3f} |")
    lines += ["", "| whole step | optimizer calls per step | parameters |", "|---|---|---|"]
    for label, (n_calls, n_params) in calls.items():
        lines.append(f"| {label} | {n_calls} | {n_params} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "host_overhead.md")
    args = parser.parse_args(argv)
    text = run(args.rounds, args.reps, args.threads)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
