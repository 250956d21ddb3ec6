"""Hugging Face models through the torch.compile backend: GPT-2 configured as for training
(``use_cache=False``, which optimize's single-graph capture cannot trace), and the Trainer."""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import memplan
from memplan.measure import measure_peak, profiled_peak
from tests.memplan.helpers import fresh_dynamo  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(config).train()


def test_gpt2_configured_for_training_holds_its_budget_through_the_backend():
    model = _gpt2()
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(0))

    def step(module):
        torch.manual_seed(1)  # the same dropout masks in every step
        module(input_ids=ids, labels=ids).loss.backward()

    step(model)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = measure_peak(lambda: step(model), resident=list(model.parameters()))
    backend = memplan.backend(budget=int(0.8 * eager), time_limit=2)
    compiled = torch.compile(model, backend=backend)
    peaks = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        if i < 2:  # compiles, then the ledger's learning step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step(compiled)
        else:
            peaks.append(profiled_peak(lambda: step(compiled), resident=[*model.parameters(), ids]))
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum(1 for g in backend.graphs if g.levels) >= 1
    assert max(peaks) <= backend.budget, (peaks, backend.budget, eager, backend.report())
    print(f"\nGPT-2 use_cache=False: eager {eager} B, budget {backend.budget} B, measured {peaks}\n{backend.report()}")


def test_the_trainer_trains_a_model_compiled_with_the_backend_to_eager_losses():
    """The route that works: compile the model in place (``model.compile(backend=...)``) before
    handing it to the Trainer, which then sees the model class it expects."""

    def train(use_memplan: bool) -> list[float]:
        model = _gpt2()
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": (ids := torch.randint(0, 500, (32,), generator=g)), "labels": ids} for _ in range(12)]
        if use_memplan:
            model.compile(backend=memplan.backend(budget="3MB", time_limit=2))
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                logging_steps=1, seed=0, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    eager = train(False)
    planned = train(True)
    assert len(eager) == 3 and planned == pytest.approx(eager, rel=1e-6)


def test_optimize_splits_gpt2_configured_for_training_at_its_graph_breaks():
    """One graph cannot follow transformers' mask code with use_cache=False; optimize says so and
    hands the model to the backend: gradients as eager's."""
    model = _gpt2()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    opt = memplan.optimize(model, budget="1GB", time_limit=2)
    with pytest.warns(memplan.GraphBreakWarning):
        torch.manual_seed(1)
        opt(input_ids=ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
