"""Shared test helpers: a model+loss wrapper and an eager reference step."""
from __future__ import annotations

import copy
import gc
from typing import Callable

import pytest
import torch
import torch.nn as nn

from memplan import WithLoss
from memplan.models import zoo


# Batch sizes at which activations, not parameters, dominate each tiny model's
# step: otherwise there is nothing for a plan to save.
ACTIVATION_HEAVY_BATCH = {"mlp": 512, "cnn": 32, "gpt": 16, "unet": 8, "dict_out": 256, "vit": 16, "resnet50": 8}


def build_step(name: str, size: str = "tiny", **kw):
    """(WithLoss module, args, kwargs) for a zoo model, activation-heavy by default."""
    kw.setdefault("batch_size", ACTIVATION_HEAVY_BATCH.get(name))
    zm = zoo.build(name, size=size, **kw)
    return WithLoss(zm.model, zm.loss_fn), tuple(zm.example_inputs), dict(zm.example_kwargs)


def clear_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None
    gc.collect()


def assert_same_step(module: nn.Module, reference: nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor) -> None:
    """Losses and every parameter's gradient equal between a planned module and its eager twin."""
    torch.testing.assert_close(loss, ref_loss)
    ref_params = dict(reference.named_parameters())
    for pname, p in module.named_parameters():
        if ref_params[pname].grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, ref_params[pname].grad, msg=lambda m: f"{pname}: {m}")


def assert_close_step(module: nn.Module, reference: nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor) -> None:
    """Loss and gradients within fused kernels' rounding of its eager twin's (a compiled step)."""
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), rp in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def twin(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: no graph can capture it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # data-dependent Python control flow
            return y * 2
        return y


def assert_measured_peak(opt: nn.Module, module: nn.Module, args: tuple, kwargs: dict, budget: int) -> int:
    """One seeded step of ``opt``, planned for ``module``: its measured peak is under ``budget``
    and within 5% of the plan's prediction. Returns the measured peak."""
    from memplan.measure.tracker import measure_peak

    clear_grads(module)
    torch.manual_seed(0)
    measured = measure_peak(lambda: opt(*args, **kwargs).backward())
    predicted = opt.plan.predicted_peak
    assert measured <= budget, (measured, budget)
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)
    return measured


def recomputing_budget(module: nn.Module, args: tuple) -> int:
    """A budget under which the step of ``module(*args)`` must recompute: half its activations
    below its store-all peak, but not below the least budget the solvers meet."""
    import memplan
    from memplan.pipeline.sweep import min_budget

    analysis = memplan.optimize(module, 10**12, solver="store_all", example_inputs=args).plan.analysis
    return max(int(analysis.graph_peak - 0.5 * analysis.activation_bytes), min_budget(analysis))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean dynamo cache (import it into a test module to use it)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class HFLossStep(nn.Module):
    """A Hugging Face model's training step: the model's own loss of ``labels`` for ``inputs``,
    passed to it as ``input_name`` (``input_ids``, ``pixel_values``)."""

    def __init__(self, model: nn.Module, input_name: str):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.input_name: inputs, "labels": labels}).loss


def hf_step(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A small Hugging Face model's training step (seeded random weights) and its inputs: "distilbert"
    (a 3-layer sequence classifier, 4 x 128 tokens) or "resnet" (bottleneck blocks, 8 images of
    64 x 64). Needs ``transformers``."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "distilbert":
        config = transformers.DistilBertConfig(n_layers=3, dim=128, hidden_dim=512, n_heads=4, vocab_size=1000,
                                               num_labels=3)
        step = HFLossStep(transformers.DistilBertForSequenceClassification(config), "input_ids")
        return step, (torch.randint(0, 1000, (4, 128), generator=g), torch.randint(0, 3, (4,), generator=g))
    if name == "resnet":
        config = transformers.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                           layer_type="bottleneck", num_labels=10)
        step = HFLossStep(transformers.ResNetForImageClassification(config), "pixel_values")
        return step, (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
    raise ValueError(f"no Hugging Face step named {name!r}")


def free_port() -> int:
    """A TCP port free on this machine now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(body: Callable[..., None], *args, world_size: int = 2) -> None:
    """``body(rank, *args)`` in ``world_size`` processes joined in one gloo group (`_in_group`)."""
    import torch.multiprocessing as mp

    mp.spawn(_in_group, args=(free_port(), world_size, body, args), nprocs=world_size, join=True)


def _in_group(rank: int, port: int, world_size: int, body: Callable[..., None], args: tuple) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    body(rank, *args)
    # The group is torn down only after a body that returned: its DDP and FSDP modules (which hold
    # the group, through reference cycles too) are gone by then. Torn down while a failed body's
    # traceback still held them, a rank aborted (SIGABRT) before spawn could report the failure:
    # a failing rank now exits through spawn, which prints its traceback.
    gc.collect()
    dist.destroy_process_group()


def run_torchrun_example(script: str, *args: str) -> str:
    """Run ``examples/<script>`` on two processes with torchrun (CPU, gloo); its stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(root / "examples" / script), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class _LibraryLoss(nn.Module):
    """A model-library causal LM with its own loss, inside the module memplan plans."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids).loss


def library_llama(rank: int, shape: tuple[int, int] = (2, 32)) -> tuple[nn.Module, tuple]:
    """A 2-layer Hugging Face Llama (the same weights on every rank) with its loss, and token ids of
    ``shape``, each rank its own."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, max_position_embeddings=64, vocab_size=256)
    model = tf.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(100 + rank))
    return _LibraryLoss(model), (ids,)
