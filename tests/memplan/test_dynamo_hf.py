"""Hugging Face models as people train them: GPT-2 configured for training (``use_cache=False``)
through the torch.compile backend and through ``optimize``, the Trainer, and Mixtral in float32."""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import memplan
from memplan.measure.tracker import measure_peak, profiled_peak
from tests.memplan.helpers import fresh_dynamo  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(config).train()


@pytest.mark.slow
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


@pytest.mark.slow
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


def _planned_step_against_eager(model, step, inputs, fraction: float, **options):
    """Plan ``step`` (a module whose call returns the loss) at ``fraction`` of eager's measured peak
    with ``memplan.optimize``: (eager peak, budget, plan, measured peaks by the tracker and the
    profiler over two steps), after checking each step's gradients against eager's."""
    resident = [*model.parameters(), *inputs]

    def run(module):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks in every step
        module(*inputs).backward()

    run(step)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    eager = measure_peak(lambda: run(step), resident=resident)
    budget = int(fraction * eager)
    opt = memplan.optimize(step, budget=budget, example_inputs=tuple(inputs), **options)
    assert opt.split is None, "planned as one graph, not split at graph breaks"
    peaks = []
    for measure in (measure_peak, profiled_peak):
        peaks.append(measure(lambda: run(opt), resident=resident))
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    return eager, budget, opt.plan, peaks


class _LossOf(torch.nn.Module):
    """A Hugging Face causal LM called with labels: the step's loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def test_optimize_plans_gpt2_configured_for_training_as_one_graph():
    """With use_cache=False transformers checks a mask's values unless torch.compiler.is_compiling()
    says the model is being traced; capture says so (as torch.export's non-strict tracing does), so
    the model plans as one graph: no graph break, budget held, gradients as eager's."""
    model = _gpt2()
    ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    eager, budget, plan, peaks = _planned_step_against_eager(model, _LossOf(model), [ids], 0.6, time_limit=2)
    assert max(peaks) <= budget, (peaks, budget)
    print(f"\nGPT-2 use_cache=False via optimize: eager {eager} B, budget {budget} B, predicted "
          f"{plan.predicted_peak} B, measured (tracker, profiler) {peaks}")


@pytest.mark.slow
def test_hf_mixtral_in_float32_on_cpu_plans_as_one_graph():
    """transformers' default experts path (grouped GEMM) refuses float32 on fake tensors, but under
    tracing (is_compiling) it takes its fallback op, which fake tensors run: MixtralForCausalLM with
    4 experts, top-2 routing, plans as one graph below eager's peak with eager's gradients."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_cache=False, attn_implementation="eager")
    model = transformers.MixtralForCausalLM(config).train()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    eager, budget, plan, peaks = _planned_step_against_eager(model, _LossOf(model), [ids], 0.75, time_limit=3)
    assert max(peaks) <= budget, (peaks, budget)
    assert abs(plan.predicted_peak - peaks[0]) <= 0.01 * peaks[0], (plan.predicted_peak, peaks)
    print(f"\nMixtral fp32 ({model.config._experts_implementation} experts) via optimize: eager {eager} B, "
          f"budget {budget} B, predicted {plan.predicted_peak} B, measured (tracker, profiler) {peaks}")

    # The backend sees the same one graph (dynamo's is_compiling picks the same fallback op).
    step = _LossOf(model)
    model.zero_grad(set_to_none=True)
    step(ids).backward()
    ref = {n: q.grad.clone() for n, q in model.named_parameters()}
    backend = memplan.backend(budget=budget, time_limit=3)
    compiled = torch.compile(step, backend=backend)
    for _ in range(2):  # compiles, then the ledger's learning step
        model.zero_grad(set_to_none=True)
        compiled(ids).backward()
    model.zero_grad(set_to_none=True)
    through_backend = profiled_peak(lambda: compiled(ids).backward(), resident=[*model.parameters(), ids])
    for name, q in model.named_parameters():
        torch.testing.assert_close(q.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(backend.plans) == 1 and through_backend <= budget, (through_backend, budget, backend.report())
    print(f"Mixtral through the backend: {len(backend.graphs)} graph, measured {through_backend} B")
