"""Fit the CPU `DeviceProfile` to this machine's measured op times, on models memplan's zoo is not.

The roofline (`memplan.costs.cost_model.DeviceProfile.op_time`) puts FLOPs over peak FLOP/s and bytes over
bandwidth; a plan's predicted overhead is its recomputations' share of that, so a kind of kernel
the roofline misjudges moves the prediction (`benchmarks/studies/time_prediction.py`). This script
captures the training steps of Hugging Face models (GPT-2, ViT, ResNet; small configurations,
random weights), times every op on synthetic inputs (`memplan.measure.timing.measure_op_times`, one
thread) and fits, in order:

* peak FLOP/s, from the ops the FLOP counter counts (matmuls, convolutions): their measured
  time against their FLOPs;
* memory bandwidth, from the plain elementwise ops (no FLOPs counted): their measured time
  against their roofline time, summed;
* per-op factors, for the kinds of op that take at least `MIN_SHARE` of the measured step and
  that the refitted roofline still misjudges by more than `MISJUDGED` (random number
  generation, normalizations, softmax, pooling: work the FLOP counter leaves out).

It prints the fitted profile and a table per op kind. The zoo models (gpt, vit, resnet50) are
left out on purpose: `benchmarks.studies.time_prediction` checks the profile on them.

    python -m benchmarks.tools.calibrate_cpu [--repeats 3]
"""
from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import Callable

import torch

import memplan
from memplan.capture.trace import capture
from memplan.costs.cost_model import PROFILES, annotate, op_kind
from memplan.measure.timing import measure_op_times

MIN_SHARE = 0.002  # of the measured step time, for an op kind to get a factor of its own
MISJUDGED = 1.5  # measured over roofline (or its inverse) beyond which an op kind gets a factor


def hf_models() -> list[tuple[str, torch.nn.Module, tuple]]:
    """The calibration steps: Hugging Face GPT-2, ViT and ResNet, each with its own loss."""
    from transformers import (GPT2Config, GPT2LMHeadModel, ResNetConfig, ResNetForImageClassification, ViTConfig,
                              ViTForImageClassification)
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)

    class Loss(torch.nn.Module):
        def __init__(self, model: torch.nn.Module, **fixed):
            super().__init__()
            self.model, self.fixed = model, fixed

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model(x, labels=labels, **self.fixed).loss

    gpt = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=4000,
                                     bos_token_id=0, eos_token_id=0, use_cache=False))
    ids = torch.randint(0, 4000, (8, 256))
    vit = ViTForImageClassification(ViTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                              intermediate_size=1024, image_size=128, patch_size=16,
                                              num_labels=100, hidden_dropout_prob=0.1))
    resnet = ResNetForImageClassification(ResNetConfig(embedding_size=32, hidden_sizes=[64, 128, 256, 512],
                                                       depths=[2, 2, 2, 2], layer_type="bottleneck",
                                                       num_labels=100))
    images = torch.randn(16, 3, 128, 128)
    labels = torch.randint(0, 100, (16,))
    return [("hf_gpt2", Loss(gpt, use_cache=False), (ids, ids)),
            ("hf_vit", Loss(vit), (images, labels)),
            ("hf_resnet", Loss(resnet), (images, labels))]


def op_rows(repeats: int) -> list[dict]:
    """Per timed op of every calibration step: its kind, FLOPs, bytes moved, roofline and measured seconds."""
    rows = []
    for name, step, args in hf_models():
        step.train()
        cap = capture(step, args, {})
        gm = cap.graph_module
        costs = annotate(gm, PROFILES["cpu"])
        skip = {n for n, v in costs.values.items() if v.alias_of is not None or v.time == 0}
        measured = measure_op_times(gm, "cpu", repeats=repeats, skip=skip)
        for node in gm.graph.nodes:
            if node.name in measured:
                v = costs.values[node.name]
                rows.append({"model": name, "kind": op_kind(node), "flops": v.flops, "moved": v.moved,
                             "roofline": v.time, "measured": measured[node.name]})
        print(f"{name}: {len(measured)} ops timed, {sum(measured.values()) * 1e3:.0f} ms", flush=True)
    return rows


def by_kind(rows: list[dict], *columns: Callable[[dict], float]) -> dict[str, list[float]]:
    """Per kind of op, the sum of each of ``columns`` over its ``rows``."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(columns))
    for r in rows:
        for i, column in enumerate(columns):
            sums[r["kind"]][i] += column(r)
    return sums


def fit(rows: list[dict]) -> memplan.DeviceProfile:
    """The CPU profile refitted to ``rows`` (see the module docstring)."""
    base = PROFILES["cpu"]
    counted = [r for r in rows if r["flops"] > 0]
    # Time each counted op takes beyond the fixed overhead, against its FLOPs: the rate it runs at.
    peak = sum(r["flops"] for r in counted) / sum(max(r["measured"] - base.op_overhead, 1e-9) for r in counted)
    plain = [r for r in rows if r["flops"] == 0 and r["moved"] > 0 and r["kind"] in ELEMENTWISE]
    # Weighted by time, not a median over ops: the many small ops run in cache, while the large
    # ones, which a plan recomputes to save memory, stream from memory.
    # (the roofline without the base's own factors: a fit run on a fitted profile gives the same)
    ratio = (sum(r["measured"] - base.op_overhead for r in plain)
             / sum(base.op_time(r["flops"], r["moved"]) - base.op_overhead for r in plain))
    bandwidth = base.memory_bandwidth / ratio
    profile = dataclasses.replace(base, peak_flops=peak, peak_flops_low_precision=peak / 2,
                                  memory_bandwidth=bandwidth, op_factors=())
    step = sum(r["measured"] for r in rows)
    factors = []
    # each kind's refitted roofline (no factors yet) against its measured time
    refitted = by_kind(rows, lambda r: profile.op_time(r["flops"], r["moved"]), lambda r: r["measured"])
    for kind, (predicted, measured) in sorted(refitted.items()):
        off = measured / predicted if predicted else 1.0
        if measured >= MIN_SHARE * step and not 1 / MISJUDGED <= off <= MISJUDGED:
            factors.append((kind, round(off, 2)))
    return dataclasses.replace(profile, op_factors=tuple(factors))


# Plain elementwise kernels: what the bandwidth is fitted on.
ELEMENTWISE = frozenset({"add", "mul", "sub", "div", "relu", "threshold_backward", "clone", "copy", "where",
                         "gelu", "gelu_backward", "native_dropout_backward", "tanh", "tanh_backward", "neg"})


def main(argv: list[str] | None = None) -> memplan.DeviceProfile:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = op_rows(args.repeats)
    profile = fit(rows)
    step = sum(r["measured"] for r in rows)
    totals = by_kind(rows, lambda r: r["roofline"], lambda r: profile.op_time(r["flops"], r["moved"], kind=r["kind"]),
                     lambda r: r["measured"])
    print(f"\n{'op kind':32s} {'share':>6s} {'old/meas':>9s} {'new/meas':>9s}")
    for kind, (old, new, measured) in sorted(totals.items(), key=lambda kv: -kv[1][2])[:25]:
        print(f"{kind:32s} {measured / step:6.1%} {old / measured:9.2f} {new / measured:9.2f}")
    print(f"\nall ops: old/meas {sum(v[0] for v in totals.values()) / step:.2f}, "
          f"new/meas {sum(v[1] for v in totals.values()) / step:.2f}")
    print(f"\n{profile}")
    return profile


if __name__ == "__main__":
    main()
