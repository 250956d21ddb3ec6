"""Tests for memplan.models.zoo: every model trains at tiny size; big ones build on meta."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memplan.measure.tracker import MemoryTracker
from memplan.models import zoo


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_tiny_model_trains_with_finite_grads(name):
    zm = zoo.build(name)
    assert zm.size == "tiny" and zm.name == name
    assert zm.model.training
    loss = zm.step()
    assert loss.dim() == 0 and torch.isfinite(loss)
    for pname, p in zm.model.named_parameters():
        if not p.requires_grad:
            continue
        if pname in zm.unused_params:
            assert p.grad is None, f"{name}.{pname} is declared unused but got a grad"
            continue
        assert p.grad is not None, f"{name}.{pname} got no grad"
        assert torch.isfinite(p.grad).all(), f"{name}.{pname} has a non-finite grad"


def test_builds_are_deterministic_and_keep_the_callers_rng():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = zoo.build("gpt")
    assert torch.equal(torch.rand(3), expected_next)

    b = zoo.build("gpt")
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert not torch.equal(sa["wte.weight"], zoo.build("gpt", seed=1).model.state_dict()["wte.weight"])


def test_gpt_lm_head_is_tied_to_the_token_embedding():
    model = zoo.build("gpt").model
    assert model.lm_head.weight is model.wte.weight
    # Counted once as a parameter, and it gets gradient from both uses.
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_gpt_1_3b_on_meta_allocates_nothing():
    with MemoryTracker("cpu") as mt:
        zm = zoo.build("gpt-1.3b", meta=True)
    assert mt.peak == 0
    assert (zm.name, zm.size) == ("gpt", "gpt-1.3b")
    assert 1.2e9 <= zm.num_params() <= 1.45e9
    tensors = [*zm.model.parameters(), *zm.model.buffers(), *zm.example_inputs]
    assert all(t.device.type == "meta" for t in tensors)
    assert zm.example_inputs[0].shape == (2, 2048)


def test_published_sizes_match_their_parameter_counts():
    # Same counts as the reference implementations (GPT-2, torchvision).
    assert zoo.build("gpt2-small", meta=True).num_params() == 124_439_808
    assert zoo.build("resnet50", "full", meta=True).num_params() == 25_557_032
    assert zoo.build("vit-b16", meta=True).num_params() == 86_567_656
    llama = zoo.build("llama-7b", meta=True)  # Llama 2's 7B, in bf16 as its size names
    assert llama.num_params() == 6_738_415_616
    assert {p.dtype for p in llama.model.parameters()} == {torch.bfloat16}


def test_names_aliases_and_sizes():
    assert set(zoo.names()) == {"mlp", "cnn", "resnet50", "gpt", "unet", "vit", "dict_out", "hf_style", "llama"}
    assert zoo.build("resnet50").size == "tiny"
    assert zoo.build("gpt:small", meta=True).size == "small"
    assert zoo.build("gpt2-small", meta=True, batch_size=1).example_inputs[0].shape == (1, 1024)
    assert "gpt-1.3b" in zoo.sizes("gpt")
    with pytest.raises(KeyError):
        zoo.build("no-such-model")
    with pytest.raises(KeyError):
        zoo.build("mlp", "huge")
    with pytest.raises(ValueError):
        zoo.build("gpt2-small", size="tiny")


def test_dtype_casts_floats_only():
    zm = zoo.build("dict_out", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in zm.model.parameters())
    assert zm.example_kwargs["mask"].dtype == torch.float64
    zm = zoo.build("gpt", dtype=torch.bfloat16, meta=True)
    assert zm.model.wte.weight.dtype == torch.bfloat16
    assert zm.example_inputs[0].dtype == torch.int64


def test_dict_out_has_a_keyword_input_and_a_non_differentiable_output():
    zm = zoo.build("dict_out")
    assert set(zm.example_kwargs) == {"mask"}
    out = zm.model(*zm.example_inputs, **zm.example_kwargs)
    assert set(out) == {"logits", "aux", "pred"}
    assert out["logits"].requires_grad and out["aux"].requires_grad
    assert not out["pred"].requires_grad and out["pred"].dtype == torch.int64


def test_hf_style_returns_a_dataclass_with_nested_kv_and_its_cache_untouched():
    zm = zoo.build("hf_style")
    cache = zm.example_kwargs["cache"]
    out = zm.model(*zm.example_inputs, **zm.example_kwargs)
    assert dataclasses.is_dataclass(out)
    assert out.cache is cache
    assert isinstance(out.past_key_values, tuple) and len(out.past_key_values) == 2
    assert all(isinstance(kv, tuple) and len(kv) == 2 for kv in out.past_key_values)
    assert zm.loss_fn(out) is out.loss


def test_batchnorm_runs_in_train_mode():
    zm = zoo.build("cnn")
    bn = zm.model.stem[1]
    before = bn.running_mean.clone()
    zm.step()
    assert int(bn.num_batches_tracked) == 1
    assert not torch.equal(bn.running_mean, before)
