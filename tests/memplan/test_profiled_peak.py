"""`profiled_peak` sees what Inductor's compiled code allocates.

Inductor's CPU wrapper allocates its buffers with ``empty_strided_cpu``, outside the
dispatcher, so a dispatch-mode tracker cannot count them; the benchmarks measure every
compiled step with the profiler instead. This checks on a tiny function (a few seconds
to compile) that the profiler really counts those buffers.
"""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from memplan.measure.tracker import profiled_peak

pytestmark = pytest.mark.timeout(180)

N = 1024  # a float32 N x N buffer is 4 MiB
BUFFER = N * N * 4


def _sin_then_matmul(x: torch.Tensor) -> torch.Tensor:
    y = torch.sin(x) * 2  # an Inductor kernel's output buffer (the matmul reads it)
    return (y @ x).sum()  # the matmul's output: a second buffer, live with the first


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_profiled_peak_counts_inductor_buffers(fresh_dynamo):
    x = torch.randn(N, N)
    compiled = torch.compile(_sin_then_matmul)  # default backend: Inductor
    result, code = run_and_get_code(compiled, x)
    wrapper = "\n".join(code)
    # The buffers are the wrapper's own allocations, not dispatched ops.
    assert "empty_strided_cpu" in wrapper, wrapper[:2000]
    torch.testing.assert_close(result, _sin_then_matmul(x), rtol=1e-4, atol=1e-2)

    peak = profiled_peak(lambda: compiled(x), resident=[x])
    # x itself, plus sin's buffer and the matmul's output, live together.
    assert peak >= BUFFER + 2 * BUFFER, peak
    assert peak <= BUFFER + 3 * BUFFER, peak  # nothing counted twice


def test_frees_of_memory_from_an_earlier_window_do_not_lower_the_peak():
    # The profiler reports the free of a block it saw allocated in an earlier profiling
    # session (here: the last step's gradient, dropped at this step's start). Counted, that
    # free made back-to-back measurements of one step differ by the gradient's bytes.
    from memplan.measure.tracker import measure_peak

    w = torch.randn(N, N, requires_grad=True)
    x = torch.randn(8, N)

    def step():
        w.grad = None
        (x @ w).sin().sum().backward()

    peaks = [profiled_peak(step, resident=[w, x]) for _ in range(3)]
    assert peaks[0] == peaks[1] == peaks[2], peaks
    w.grad = None
    tracked = measure_peak(step, resident=[w, x])
    assert abs(peaks[0] - tracked) <= 4096, (peaks, tracked)
    assert peaks[0] >= 2 * BUFFER  # the weight and its gradient


def test_host_memory_is_left_out_and_the_address_reused_for_the_device_is_counted():
    """Storages marked as host memory (`memplan.core.host`) share the CPU allocator with the "device"
    here: the profiler's peak leaves them out, and a device block later given the same address counts."""
    from memplan.core.host import host_storage

    x = torch.randn(N, N)

    def step() -> None:
        with host_storage():
            held = x.clone()  # host: not counted
        a = x * 2  # one device buffer
        del held
        b = x + 1  # may reuse the host block's address: counted
        c = b * a  # three device buffers at once
        del a, b, c

    def device_only() -> None:
        a = x * 2
        b = x + 1
        c = b * a
        del a, b, c

    assert profiled_peak(step) == profiled_peak(device_only) == 3 * BUFFER
