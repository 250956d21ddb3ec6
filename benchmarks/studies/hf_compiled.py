"""Hugging Face models, as users build them, planned with and without ``compile=True``.

memplan will be tried on architectures nobody here wrote. This script builds small configurations
of Hugging Face ``transformers`` models (randomly initialised, nothing downloaded), plans each
training step (the model's own loss) at a share of its measured eager peak, with the eager runtime
and with compiled plans, and reports for each: the peak measured by the CPU allocator's events
(`memplan.measure.tracker.profiled_peak`, the witness that sees Inductor's buffers and the scratch CPU
kernels allocate for themselves) against the budget; for the eager runtime also the dispatch-mode
tracker's peak (`memplan.measure.tracker.measure_peak`), the witness its plans are made for on the CPU,
which does not see that scratch;
the largest gradient difference from eager (relative to the parameter's largest eager gradient;
parameters whose eager gradient is zero, such as attention key biases, are left out), step time
over eager (median of interleaved rounds, one thread), and what was compiled. Writes
``benchmarks/results/hf_compiled.md``; skips when ``transformers`` is not installed.

    python -m benchmarks.studies.hf_compiled [--models gpt2,qwen2,...] [--rounds 5]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from benchmarks.harness.report import markdown_table
from memplan.measure.tracker import measure_peak, profiled_peak

RESULTS = RESULTS_DIR / "hf_compiled.md"
# model -> its budget as a share of its eager peak (the convolutional ones cannot go to 50%)
MODELS = {"gpt2": 0.5, "qwen2": 0.5, "distilbert": 0.5, "vit": 0.5, "t5": 0.5, "swin": 0.6, "convnext": 0.8,
          "resnet": 0.9}
ZERO_GRAD = 1e-7  # a parameter whose largest eager gradient is below this has none to compare


class LossStep(torch.nn.Module):
    """A Hugging Face model's training step: its own loss of ``labels`` for ``inputs``."""

    def __init__(self, model: torch.nn.Module, input_name: str):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.input_name: inputs, "labels": labels}).loss


def build(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The step of ``name`` (small, random weights) and its inputs."""
    import transformers as hf
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def ids(batch: int, seq: int, vocab: int = 1000) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, seq), generator=g)

    def images(batch: int, size: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)

    if name == "gpt2":
        config = hf.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=128, use_cache=False)
        x = ids(4, 128)
        return LossStep(hf.GPT2LMHeadModel(config), "input_ids"), (x, x)
    if name == "qwen2":
        config = hf.Qwen2Config(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, use_cache=False)
        x = ids(4, 128)
        return LossStep(hf.Qwen2ForCausalLM(config), "input_ids"), (x, x)
    if name == "distilbert":
        config = hf.DistilBertConfig(n_layers=3, dim=128, hidden_dim=512, n_heads=4, vocab_size=1000, num_labels=3)
        return (LossStep(hf.DistilBertForSequenceClassification(config), "input_ids"),
                (ids(4, 128), torch.randint(0, 3, (4,), generator=g)))
    if name == "t5":
        config = hf.T5Config(d_model=128, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=1000,
                             d_kv=32, decoder_start_token_id=0, pad_token_id=0)
        return LossStep(hf.T5ForConditionalGeneration(config), "input_ids"), (ids(4, 64), ids(4, 32))
    if name == "vit":
        config = hf.ViTConfig(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=512, num_labels=10)
        return LossStep(hf.ViTForImageClassification(config), "pixel_values"), images(8, 64)
    if name == "swin":
        config = hf.SwinConfig(image_size=128, patch_size=4, embed_dim=32, depths=[1, 1, 2, 1], num_heads=[2, 2, 4, 8],
                               window_size=4, num_labels=10)
        return LossStep(hf.SwinForImageClassification(config), "pixel_values"), images(8, 128)
    if name == "convnext":
        config = hf.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_labels=10)
        return LossStep(hf.ConvNextForImageClassification(config), "pixel_values"), images(8, 64)
    if name == "resnet":
        config = hf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                 layer_type="bottleneck", num_labels=10)
        return LossStep(hf.ResNetForImageClassification(config), "pixel_values"), images(8, 64)
    raise ValueError(f"unknown model {name!r}; give some of {', '.join(MODELS)}")


def _step(module: torch.nn.Module, args: tuple) -> Callable[[], None]:
    def run() -> None:
        for p in module.parameters():
            p.grad = None
        torch.manual_seed(1)  # the same dropout masks in every step
        module(*args).backward()
    return run


def _grad_error(module: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, p in module.named_parameters():
        ref = reference.get(name)
        if ref is not None and ref.abs().max() > ZERO_GRAD:
            worst = max(worst, float((p.grad - ref).abs().max() / ref.abs().max()))
    return worst


def measure(name: str, fraction: float, rounds: int) -> list[dict]:
    """Rows for ``name``: the eager runtime and compiled plans at ``fraction`` of its eager peak."""
    step, args = build(name)
    eager = copy.deepcopy(step)
    resident = [*eager.parameters(), *eager.buffers(), *args]
    eager_peak = profiled_peak(_step(eager, args), resident=resident)
    reference = {n: p.grad.clone() for n, p in eager.named_parameters() if p.grad is not None}
    budget = int(fraction * eager_peak)
    runs, rows = {"eager": _step(eager, args)}, []
    for compiled in (False, True):
        module = copy.deepcopy(step)
        opt = memplan.optimize(module, budget, compile=compiled)
        label = "memplan compiled" if compiled else "memplan eager runtime"
        row = {"model": name, "budget": f"{fraction:.0%} ({budget / 1e6:.2f} MB)", "runtime": label}
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.prepare(*args)
        except memplan.InfeasibleBudgetError as exc:
            rows.append({**row, "measured peak (MB)": "—", "met": f"below its smallest plan ({exc.min_budget / 1e6:.2f} MB)",
                         "grad error": "—", "prepare s": "—", "compiled": "—", "time x eager": "—"})
            continue
        prepare_s = time.perf_counter() - started
        held = [*module.parameters(), *module.buffers(), *args]
        peak = profiled_peak(_step(opt, args), resident=held)
        shown = f"{peak / 1e6:.2f}"
        if not compiled:
            tracked = measure_peak(_step(opt, args), resident=held)
            shown = f"{tracked / 1e6:.2f} (allocator: {shown})"
        runs[label] = _step(opt, args)
        rows.append({**row, "measured peak (MB)": shown, "met": "yes" if (peak if compiled else tracked) <= budget else "NO",
                     "grad error": f"{_grad_error(module, reference):.1e}", "prepare s": f"{prepare_s:.1f}",
                     "compiled": opt.compile_report.summary() if compiled else "—"})
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            started = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - started)
    for row in rows:
        if row["runtime"] not in runs:
            continue
        ratios = [t / e for t, e in zip(times[row["runtime"]], times["eager"])]
        row["time x eager"] = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: nothing to measure")
        return []
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        rows += measure(name, MODELS[name], args.rounds)
        for row in rows[-2:]:
            print(row, flush=True)
    order = ["model", "budget", "runtime", "measured peak (MB)", "met", "grad error", "time x eager", "prepare s",
             "compiled"]
    text = (
        "# Hugging Face models, planned with and without compile=True\n\n"
        f"`python -m benchmarks.studies.hf_compiled --models {args.models} --rounds {args.rounds}` (method in the "
        "module's docstring): small configurations, random weights, each step the model's own loss; budget a "
        "share of the eager peak measured by the CPU allocator's events; `grad error`: the largest gradient "
        "difference from eager over the parameter's largest eager gradient; `time x eager`: median (spread) of "
        "interleaved rounds, one thread; `prepare s`: planning and, compiled, Inductor.\n\n"
        + markdown_table(order, [[row[k] for k in order] for row in rows]) + "\n"
    )
    args.out.write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
