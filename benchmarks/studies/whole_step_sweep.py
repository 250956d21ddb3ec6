"""The whole step's measured peak against its budget and its prediction, over models, budgets and modes.

Each cell trains a model the usual way (``loss = model(...).loss``, or the zoo's loss;
``loss.backward(); opt.step(); opt.zero_grad()``; only the loss kept, as a training loop
keeps it) with ``memplan.optimize(model, budget, optimizer=AdamW)`` in one optimizer mode,
at a share of eager's whole-step peak (or at the smallest budget memplan finds), and
measures a step after two warm-up steps by two witnesses:

* the dispatch-mode tracker (`memplan.measure_peak`): parameters, inputs and the
  device-resident optimizer state counted from the start, memplan's host-marked storages
  (optimizer state it placed in host memory) left out;
* the CPU allocator's events (`memplan.measure.tracker.profiled_peak`), the next step, the same
  resident tensors counted. On this CPU-only machine host memory is the same allocator, so
  with state in host memory it also sees what the host updates allocate (the host copies of
  gradients and parameters, the update's temporaries), which the tracker leaves out as host
  memory: there it reads above the tracker by about those, and is no witness of the budget.

Models: the zoo's GPT and CNN (the loss inside, `memplan.WithLoss`) and causal LMs from
Hugging Face ``transformers`` built small (2 layers, hidden 128, vocabulary 1000, batch
2 x 64 tokens, fp32). ``python -m benchmarks.studies.whole_step_sweep`` writes
``benchmarks/results/whole_step_sweep.md``.
"""
from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

import memplan
from benchmarks.harness.paths import RESULTS_DIR
from memplan.core.host import is_host
from memplan.measure.tracker import measure_peak, profiled_peak
from memplan.models import zoo

RESULTS = RESULTS_DIR / "whole_step_sweep.md"
MODES = {
    "in backward": {},
    "after backward": {"updates_after_backward": True},
    "state on host": {"optimizer_state": "host"},
}
FRACTIONS = (0.9, 0.7, 0.5)


def _library_lm(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers as tf
        small = dict(vocab_size=1000)
        if name == "gpt2":
            return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, **small))
        if name == "bloom":
            return tf.BloomForCausalLM(tf.BloomConfig(n_layer=2, hidden_size=128, n_head=4, **small))
        if name == "qwen2":
            return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=256,
                                                      max_position_embeddings=128, **small))
        if name == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                                      num_key_value_heads=2, intermediate_size=256,
                                                      max_position_embeddings=128, **small))
        if name == "mamba":
            return tf.MambaForCausalLM(tf.MambaConfig(num_hidden_layers=2, hidden_size=128, state_size=8,
                                                      use_cache=False, **small))
        raise KeyError(name)
    return build


LIBRARY = ("gpt2", "bloom", "qwen2", "llama", "mamba")
ZOO = ("gpt", "cnn")


def _case(name: str) -> tuple[torch.nn.Module, dict[str, Any], Callable[[Any], torch.Tensor]]:
    """(module, keyword inputs, loss of its output) for one model, seeded."""
    torch.manual_seed(0)
    if name in ZOO:
        zm = zoo.build(name, size="tiny")
        module = memplan.WithLoss(zm.model, zm.loss_fn)
        names = [f"x{i}" for i in range(len(zm.example_inputs))]

        class Positional(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, **kw):
                return self.inner(*(kw[n] for n in names), **zm.example_kwargs)

        return Positional(module), dict(zip(names, zm.example_inputs)), lambda out: out
    model = _library_lm(name)()
    model.train()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}, lambda out: out.loss


def _resident(module, optimizer, inputs) -> list[torch.Tensor]:
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and not is_host(v)]
    return [*module.parameters(), *inputs.values(), *state]


def _step(step_module, loss_of, optimizer, inputs) -> Callable[[], None]:
    def step() -> None:
        loss_of(step_module(**inputs)).backward()  # only the loss is kept
        optimizer.step()
        optimizer.zero_grad()
    return step


def _eager_peak(name: str) -> int:
    module, inputs, loss_of = _case(name)
    optimizer = torch.optim.AdamW(module.parameters())
    step = _step(module, loss_of, optimizer, inputs)
    step(), step()
    return measure_peak(step, resident=_resident(module, optimizer, inputs))


def _cell(name: str, budget: int | str, mode: dict, time_limit: float) -> dict:
    module, inputs, loss_of = _case(name)
    optimizer = torch.optim.AdamW(module.parameters())
    try:
        opt = memplan.optimize(module, budget, optimizer=optimizer, time_limit=time_limit, example_inputs=(),
                               example_kwargs=inputs, **mode)
    except memplan.InfeasibleBudgetError as exc:
        return {"infeasible": exc.min_budget}
    step = _step(opt, loss_of, optimizer, inputs)
    step(), step()
    tracker = measure_peak(step, resident=_resident(module, optimizer, inputs))
    allocator = profiled_peak(step, resident=_resident(module, optimizer, inputs))
    plan = opt.plan
    return {"budget": plan.budget, "predicted": plan.predicted_peak, "tracker": tracker, "allocator": allocator,
            "host": plan.analysis.host_optimizer_state_bytes, "plans": len(opt.plans)}


def _smallest(name: str, mode: dict, time_limit: float) -> int | None:
    """The smallest whole-step budget memplan reports for this model and mode."""
    module, inputs, _ = _case(name)
    try:
        memplan.optimize(module, 1, optimizer=torch.optim.AdamW(module.parameters()), time_limit=time_limit,
                         example_inputs=(), example_kwargs=inputs, **mode)
    except memplan.InfeasibleBudgetError as exc:
        return exc.min_budget
    return None


def _row(name: str, label: str, mode_name: str, r: dict) -> str:
    if "infeasible" in r:
        return f"| {name} | {label} | {mode_name} | infeasible (smallest {r['infeasible']:,} B) | | | | | |"
    b, p, t, a = r["budget"], r["predicted"], r["tracker"], r["allocator"]
    ok = "yes" if t <= b and abs(t - p) <= 0.01 * p else "**no**"
    return (f"| {name} | {label} | {mode_name} | {b:,} | {p:,} | {t:,} ({(t - p) / p:+.2%}) | "
            f"{a:,} ({(a - p) / p:+.2%}) | {r['host']:,} | {ok} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO + LIBRARY))
    parser.add_argument("--time-limit", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    lines = [
        "# The whole step's peak against its budget and prediction",
        "",
        f"`python -m benchmarks.studies.whole_step_sweep` (torch {torch.__version__}, one thread, `time_limit` "
        f"{args.time_limit:g} s). AdamW (torch defaults), the loop keeps only the loss; the third step by the "
        "tracker (host-marked storages apart), the fourth by the allocator's events. Budgets: shares of eager's "
        "whole-step peak (the same loop, tracker) and the smallest budget memplan reports (`min`). 'holds': "
        "tracker at or under the budget and within 1% of the prediction.",
        "",
        "| model | budget | updates | budget (B) | predicted (B) | tracker (B) | allocator events (B) | "
        "state on host (B) | holds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    started = time.perf_counter()
    for name in args.models.split(","):
        eager = _eager_peak(name)
        lines.append(f"| {name} | eager {eager:,} B | | | | | | | |")
        for mode_name, mode in MODES.items():
            budgets = [(f"{f:.0%}", int(f * eager)) for f in FRACTIONS]
            smallest = _smallest(name, mode, args.time_limit)
            if smallest is not None:
                budgets.append(("min", smallest))
            for label, budget in budgets:
                lines.append(_row(name, label, mode_name, _cell(name, budget, mode, args.time_limit)))
                print(lines[-1], flush=True)
    lines += ["", f"{time.perf_counter() - started:.0f} s in all.", ""]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
