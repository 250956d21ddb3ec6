"""memplan under DDP and FSDP2 (gloo on the CPU, two processes): what it refuses until it plans them.

``optimizer=`` applies updates inside the planned backward, before the engine reduces the
gradients: each rank would train to different parameters. Every way of getting there must
raise `memplan.DistributedTrainingError` before a parameter changes.
"""
from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

import memplan
from memplan.frontend.distributed import engines_in, process_group_size
from .helpers import free_port

WORLD_SIZE = 2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def _loss_model() -> nn.Module:
    return memplan.WithLoss(_mlp(), lambda y: y.square().mean())


def _refused(make, *names: str) -> None:
    with pytest.raises(memplan.DistributedTrainingError) as caught:
        make()
    for name in names:
        assert name in str(caught.value), str(caught.value)
    assert "memplan.optimize(DDP(model" in str(caught.value) and "memplan.fully_shard(model" in str(caught.value)


def _rank(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    # made and planned before the process group exists, then wrapped by DDP: refused at the first step
    early = _loss_model()
    early_opt = memplan.optimize(early, "1MB", optimizer=torch.optim.AdamW(early.parameters()),
                                 example_inputs=(x,))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        _checks(x, early, early_opt)
    finally:
        # Every DDP module of the checks holds the group (its reducer does, through reference
        # cycles too): freed now, the group and its gloo threads end with destroy_process_group.
        # Left to the interpreter's exit, a gloo thread could still hold tensors when Python is
        # torn down, and the rank aborted (SIGABRT, "terminate called without an active exception").
        del early, early_opt
        gc.collect()
        torch.distributed.destroy_process_group()


def _checks(x: torch.Tensor, early: nn.Module, early_opt: nn.Module) -> None:
    """Each rank's checks, in the process group; every module they make is gone when they return."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert process_group_size() == WORLD_SIZE
    wrapped = DDP(early_opt)
    before = [p.detach().clone() for p in early.parameters()]
    _refused(lambda: wrapped(x), f"world size {WORLD_SIZE}")
    for p, b in zip(early.parameters(), before):  # nothing was updated
        assert torch.equal(p, b)

    # in the process group, with and without an engine seen around the model
    model = _loss_model()
    _refused(lambda: memplan.optimize(model, "1MB", optimizer=torch.optim.AdamW(model.parameters())),
             "process group")
    ddp = DDP(_loss_model())
    assert engines_in(ddp) == ["DistributedDataParallel"]
    # optimizer= on the DDP itself is planned (tests/memplan/test_data_parallel.py, accumulation too),
    # but not what needs the reduced gradients earlier than memplan has them: a norm pass
    with pytest.raises(memplan.DistributedTrainingError, match="clip_by='holding'"):
        memplan.optimize(ddp, "1MB", optimizer=torch.optim.AdamW(ddp.parameters()), max_grad_norm=1.0,
                         clip_by="norm_pass")
    planned = memplan.optimize(ddp, "1MB")
    with pytest.raises(memplan.DistributedTrainingError, match="already optimized"):
        memplan.optimize(DDP(planned.module), "1MB")
    sharded = _loss_model()
    fully_shard(sharded.model[0])
    fully_shard(sharded)
    assert "FSDP2 (fully_shard)" in engines_in(sharded)
    _refused(lambda: memplan.optimize(sharded, "1MB", optimizer=torch.optim.AdamW(sharded.parameters())),
             "FSDP2 (fully_shard)")

    # a parameter the step gives no gradient: DDP must be told to look for it (eager DDP fails too, later)
    class PartlyUsed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.used(x).square().mean()

    with pytest.raises(memplan.DistributedTrainingError, match="find_unused_parameters=True"):
        memplan.optimize(DDP(PartlyUsed()), "300%")(x)
    planned, reference = memplan.optimize(DDP(PartlyUsed(), find_unused_parameters=True), "300%"), \
        DDP(PartlyUsed(), find_unused_parameters=True)
    for _ in range(2):
        planned(x).backward()
        reference(x).backward()
    for p, r in zip(planned.parameters(), reference.parameters()):
        assert (p.grad is None) == (r.grad is None)
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad)

    # frozen parameters are no unused ones: planned as DDP trains them (no find_unused_parameters needed)
    frozen, frozen_reference = PartlyUsed(), PartlyUsed()
    for model in (frozen, frozen_reference):
        model.unused.requires_grad_(False)
    frozen, frozen_reference = memplan.optimize(DDP(frozen), "300%"), DDP(frozen_reference)
    frozen(x).backward()
    frozen_reference(x).backward()
    for p, r in zip(frozen.parameters(), frozen_reference.parameters()):
        assert (p.grad is None) == (r.grad is None)
    # DDP's static graph delays its first all-reduce past memplan's updates
    with pytest.raises(memplan.DistributedTrainingError, match="static_graph"):
        static = DDP(_loss_model(), static_graph=True)
        memplan.optimize(static, "1MB", optimizer=torch.optim.AdamW(static.parameters()))

    # an engine inside the optimized model: a clear error with the supported order, not a tracing error
    with pytest.raises(memplan.DistributedTrainingError, match="outermost module"):
        memplan.optimize(nn.Sequential(DDP(_loss_model())), "1MB")
    with pytest.raises(memplan.DistributedTrainingError, match="does not plan FSDP"):
        memplan.optimize(sharded, "1MB")
    late = _loss_model()
    late_opt = memplan.optimize(late, "1MB")  # sharded after optimize(): refused at its first plan
    fully_shard(late)
    with pytest.raises(memplan.DistributedTrainingError, match="does not plan FSDP"):
        late_opt(x)

    # without optimizer= the numbers are DDP's own; the engine's unplanned tensors are said once
    plain = DDP(memplan.optimize(_loss_model(), "1MB"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plain(x).backward()
        plain(x).backward()
    said = [w for w in seen if issubclass(w.category, memplan.DistributedWarning)]
    assert len(said) == 1, [str(w.message) for w in seen]
    reference = DDP(_loss_model())
    reference(x).backward()
    reference(x).backward()
    for p, r in zip(plain.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.slow
def test_optimizer_in_a_process_group_is_refused_before_any_update():
    mp.spawn(_rank, args=(free_port(),), nprocs=WORLD_SIZE, join=True)


def test_a_single_process_model_has_no_engine():
    model = _loss_model()
    assert engines_in(model) == []
    assert process_group_size() is None
    memplan.optimize(model, "1MB", optimizer=torch.optim.AdamW(model.parameters()))  # not refused
