"""Tests for memplan.measure.tracker: the CPU tracker's numbers are exact, so assert them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from memplan.core.host import host_storage, is_host, mark_host
from memplan.measure.tracker import MemoryTracker, measure_peak, unmeasured

ROOT = Path(__file__).resolve().parents[2]
F32 = 4  # bytes per float32 element


def _run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: a scenario that once aborted the process
    (an exception thrown through a C++ frame: SIGABRT) fails its test there instead
    of killing pytest."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )


def test_allocation_counts_its_bytes():
    kept = []
    assert measure_peak(lambda: kept.append(torch.empty(1000)), "cpu") == 1000 * F32


def test_touched_input_is_resident():
    x = torch.randn(1000)
    # x (resident) and x * 2 (allocated) are live together.
    assert measure_peak(lambda: x * 2, "cpu") == 2 * 1000 * F32


def test_untouched_tensor_is_not_counted_unless_resident():
    x = torch.randn(1000)
    unused = torch.randn(5000)

    def fn():
        return x * 2

    assert measure_peak(fn, "cpu") == 2000 * F32
    assert measure_peak(fn, "cpu", resident=[unused]) == 7000 * F32


def test_free_before_next_allocation_keeps_peak_at_one_tensor():
    def freed():
        a = torch.empty(1000)
        del a
        b = torch.empty(1000)
        return b

    def kept():
        a = torch.empty(1000)
        b = torch.empty(1000)
        return a, b

    assert measure_peak(freed, "cpu") == 1000 * F32
    assert measure_peak(kept, "cpu") == 2000 * F32


def test_views_share_their_base_storage():
    def fn():
        a = torch.empty(1000)
        return a, a[10:], a.view(10, 100), a.view(10, 100).t(), a.unsqueeze(0)

    assert measure_peak(fn, "cpu") == 1000 * F32


def test_in_place_ops_add_nothing():
    x = torch.randn(1000)
    y = torch.randn(1000)

    def fn():
        x.add_(y)
        x.relu_()
        x.mul_(2.0)
        x[:10].zero_()

    assert measure_peak(fn, "cpu") == 2000 * F32


def test_out_variant_resize_is_counted():
    out = torch.empty(0)
    x = torch.randn(1000)
    # out= grows the (resident, empty) storage to 1000 floats.
    assert measure_peak(lambda: torch.mul(x, 2, out=out), "cpu") == 2000 * F32


def test_zero_size_sparse_and_meta_tensors_are_handled():
    sp = torch.randn(10, 10).to_sparse()  # 100 nonzeros
    meta = torch.empty(10**9, device="meta")
    coo_bytes = 100 * (2 * 8 + F32)  # int64 (row, col) indices and a float value per nonzero

    def fn():
        empty = torch.empty(0)
        doubled = sp * 2  # sparse: no single storage; its indices and values are counted
        dense = doubled.to_dense()  # 100 floats
        on_meta = meta * 2  # other device: not CPU memory
        return empty, doubled, dense, on_meta

    # sp is touched, so resident; doubled has indices and values of its own
    assert measure_peak(fn, "cpu") == 2 * coo_bytes + 100 * F32


def test_sparse_tensor_made_inside_one_op_is_counted():
    """``to_sparse`` (like eager's sparse embedding backward) allocates indices and values
    inside one op: the dispatcher sees only the sparse result, which has no storage of its own."""
    dense = torch.randn(100, 100)
    assert measure_peak(lambda: dense.to_sparse(), "cpu") == 100 * 100 * F32 + 100 * 100 * (2 * 8 + F32)


def test_late_touched_resident_counts_from_the_start():
    p = torch.randn(500)

    with MemoryTracker("cpu") as mt:
        a = torch.empty(1000)  # op 0
        del a
        b = p * 2  # op 1: p first touched here
    del b
    # p was live during op 0 too: 1000 + 500 floats at op 0.
    assert mt.peak == 1500 * F32
    assert [e.live for e in mt.timeline] == [1500 * F32, 1000 * F32]
    assert mt.resident_bytes == 500 * F32


def _mlp(depth: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def test_mlp_forward_backward_peak_matches_analysis():
    """Peak of (Linear -> ReLU) x L, eager forward + backward.

    With A = bytes of one [B, D] activation, P = parameter bytes and
    G = one layer's gradient bytes (weight + bias):

    * forward keeps, per layer, the ReLU output (saved by ReLU for its
      backward and by the next addmm as its mat1); the addmm output h dies
      after the ReLU.  The input x is saved by the first addmm.
    * backward at the last layer holds the L-1 earlier ReLU outputs, x, the
      incoming grad g_L (threshold_backward's output), the grad w.r.t. the
      layer input, and the layer's weight and bias gradients, which
      AccumulateGrad keeps as .grad: P + A + (L-1)A + 2A + G = P + (L+2)A + G.
      (The forward's peak, P + (L+2)A during the last ReLU, is G lower.)
    * plus 8 bytes: the float32 loss and the ones-like grad backward() seeds.
    """
    torch.manual_seed(0)
    batch, width, depth = 512, 256, 4
    model = _mlp(depth, width)
    x = torch.randn(batch, width)
    act = batch * width * F32
    params = depth * (width * width + width) * F32
    layer_grads = (width * width + width) * F32
    expected = params + (depth + 2) * act + layer_grads + 2 * F32

    def step():
        loss = model(x).sum()
        loss.backward()

    with MemoryTracker("cpu") as mt:
        step()
    assert mt.peak == expected  # 4_461_576 bytes
    assert mt.resident_bytes == params + act
    # After the step: parameters, x and one .grad per parameter.
    assert mt.live == 2 * params + act
    # The peak is reached in the backward pass (ops the autograd engine ran).
    peak_at = max(range(len(mt.timeline)), key=lambda i: mt.timeline[i].live)
    assert mt.timeline[peak_at].live == expected
    seed_at = [e.op for e in mt.timeline].index("aten.ones_like.default")
    assert peak_at > seed_at

    # measure_peak is the same machinery, hence the same number.
    model.zero_grad(set_to_none=True)
    assert measure_peak(step, "cpu") == expected


def test_grad_created_by_accumulate_grad_is_counted():
    n = 1000
    w = torch.randn(n, requires_grad=True)

    with MemoryTracker("cpu") as mt:
        loss = (w * 2).sum()
        loss.backward()
    assert w.grad is not None
    # Live at the end: w, w.grad, loss.
    assert mt.live == 2 * n * F32 + F32
    # Peak: w, w.grad (from MulBackward), loss, the seeded ones.
    assert mt.peak == 2 * n * F32 + 2 * F32

    # Second step: .grad already exists (resident) and MulBackward's output
    # is a temporary added into it.
    with MemoryTracker("cpu") as mt:
        loss = (w * 2).sum()
        loss.backward()
    assert mt.resident_bytes == 2 * n * F32
    assert mt.peak == 3 * n * F32 + 2 * F32
    assert mt.live == 2 * n * F32 + F32


def test_host_storage_is_not_counted():
    x = torch.randn(1000)
    pool = torch.empty(1000)
    mark_host(pool)
    assert is_host(pool) and not is_host(x)

    def offload_and_back():
        act = x * 2  # 1000 floats on the "device"
        with host_storage():
            host_copy = act.to("cpu", copy=True)  # 1000 floats on the host
        assert is_host(host_copy)
        pool.copy_(act)  # pre-allocated host buffer
        del act
        return host_copy.clone()  # back on the device

    # Device: x + act, then x + the restored copy.
    assert measure_peak(offload_and_back, "cpu") == 2000 * F32


def test_host_storage_marks_without_a_tracker():
    x = torch.randn(100)
    with host_storage():
        h = x.to("cpu", copy=True)
        alias = x.view(10, 10)  # not a new storage: stays device memory
    assert is_host(h)
    assert not is_host(alias)
    assert measure_peak(lambda: h * 2, "cpu") == 100 * F32


def test_measuring_under_fake_mode_raises():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(10)
        with pytest.raises(RuntimeError, match="FakeTensorMode"):
            measure_peak(lambda: x * 2, "cpu")
    # A fake tensor reaching the tracker outside the mode is refused too.
    with pytest.raises(RuntimeError, match="FakeTensor"):
        measure_peak(lambda: x * 2, "cpu")


@pytest.mark.slow
def test_fake_tensor_in_a_measured_autograd_step_raises_instead_of_aborting():
    # Refused inside __torch_dispatch__, the error crossed a C++ frame of autograd on fake
    # tensors that cannot pass it on: 'terminate called ... python_error', SIGABRT.
    out = _run_python(
        """
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from memplan.measure.tracker import measure_peak

        w = FakeTensorMode(allow_non_fake_inputs=True).from_tensor(torch.randn(3, 3)).requires_grad_()
        try:
            measure_peak(lambda: torch.nn.functional.linear(w, w).sum().backward(), "cpu")
        except RuntimeError as err:
            assert "FakeTensor reached the memory tracker" in str(err), err
        else:
            raise AssertionError("a fake step was measured")
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_unmeasured_hides_work_from_the_trackers_active_around_it():
    x = torch.randn(1000)
    with MemoryTracker("cpu") as outer:
        with unmeasured():
            hidden = x * 2
            with MemoryTracker("cpu") as inner:  # entered inside: measures as usual
                inner_out = x * 3
        after = x + 1
    assert inner.peak == 2000 * F32  # x and x * 3
    # x (resident, first touched after the block) and x + 1; x * 2 and x * 3 were never seen.
    assert outer.peak == 2000 * F32
    del hidden, inner_out, after


@pytest.mark.slow
def test_first_call_of_an_optimized_module_measures_the_step_not_the_planning():
    # The first call plans on fake tensors inside the tracker: that aborted the process
    # (SIGABRT). Planning allocates no real memory, so it must add nothing to the peak.
    out = _run_python(
        """
        import copy, json, torch, torch.nn as nn, memplan
        from memplan.measure.tracker import measure_peak

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 2))
        reference = copy.deepcopy(model)
        opt = memplan.optimize(model, 10**9)
        x = torch.randn(128, 64)
        first = measure_peak(lambda: opt(x).sum().backward(), "cpu")
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        second = measure_peak(lambda: opt(x).sum().backward(), "cpu")
        reference(x).sum().backward()
        for g, q in zip(grads, reference.parameters()):
            torch.testing.assert_close(g, q.grad)
        print(json.dumps(dict(first=first, second=second, predicted=opt.plan.predicted_peak)))
        """
    )
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks["first"] == peaks["second"], peaks
    assert abs(peaks["first"] - peaks["predicted"]) <= 0.05 * peaks["predicted"], peaks


def test_default_device_is_cpu_without_cuda():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized: the default device is CUDA")
    kept = []
    assert measure_peak(lambda: kept.append(torch.empty(10))) == 10 * F32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_matches_cpu_tracker_for_mlp():
    torch.manual_seed(0)
    model = _mlp(4, 256)
    x = torch.randn(512, 256)

    def step(m, inp):
        return lambda: m(inp).sum().backward()

    cpu_peak = measure_peak(step(model, x), "cpu")
    model_cuda, x_cuda = model.cuda(), x.cuda()
    for p in model_cuda.parameters():
        p.grad = None
    cuda_peak = measure_peak(step(model_cuda, x_cuda), "cuda")
    # The allocator rounds to 512-byte blocks and cuBLAS may hold a workspace.
    assert cpu_peak <= cuda_peak <= cpu_peak * 1.05 + (8 << 20)


def test_wrapper_subclass_counts_its_inner_storages():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two_tensor.TwoTensor(torch.randn(100), torch.randn(100))
    # Two resident inner tensors, two new inner tensors.
    assert measure_peak(lambda: t * 2, "cpu") == 4 * 100 * F32


def test_refresh_sees_storage_resized_outside_the_dispatcher():
    with MemoryTracker("cpu") as mt:
        a = torch.empty(1000)
        a.untyped_storage().resize_(0)  # not dispatched: the tracker still counts it
        assert mt.live == 1000 * F32
        mt.refresh()
        assert mt.live == 0
        b = torch.empty(500)
    del a, b
    assert mt.peak == 1000 * F32
