"""memplan planned inside FSDP2 (gloo on the CPU, two processes, each rank its own batch).

``memplan.fully_shard(model, budget, optimizer=opt)`` must train to the parameters and AdamW
state that torch's own ``fully_shard`` on the same blocks trains to (an update on a rank's
unreduced gradient would show: the ranks' batches differ), with each rank's measured step peak
under its budget and within 2% of the peak it predicts. The witness is the profiler's allocation
events (every thread's: gloo's included); memplan's dispatch-mode tracker would make dynamo run the
compiled blocks eagerly. The first step, where memplan plans, runs outside the profiler: planning
measures kernels' scratch with a profiler of its own, and profilers do not nest.
"""
from __future__ import annotations

import copy
import pytest
import torch
import torch.nn as nn

import memplan
from memplan.frontend.sharded import find_units, local_state
from memplan.measure.tracker import profiled_peak
from memplan.models import zoo
from .helpers import library_llama, run_torchrun_example, spawn_ranks

WORLD_SIZE = 2
STEPS = 4  # the first unmeasured (memplan plans in it), then three measured


def _gpt(rank: int) -> tuple[nn.Module, tuple]:
    zm = zoo.build("gpt", size="tiny", batch_size=16, overrides={"dropout": 0.0})
    torch.manual_seed(100 + rank)  # each rank its own batch, same shapes
    x = torch.randint_like(zm.example_inputs[0], 0, 64)
    return memplan.WithLoss(zm.model, zm.loss_fn), (x,)


def _llama(rank: int) -> tuple[nn.Module, tuple]:
    return library_llama(rank, (4, 64))


def _cnn(rank: int) -> tuple[nn.Module, tuple]:
    """The zoo CNN (BatchNorm, its stem before the first block eager code in no plan)."""
    zm = zoo.build("cnn", size="tiny", batch_size=32, overrides={"dropout": 0.0})
    torch.manual_seed(100 + rank)
    return memplan.WithLoss(zm.model, zm.loss_fn), (torch.randn_like(zm.example_inputs[0]),)


# Batches per optimizer step: the CNN accumulates gradients over two (FSDP2's
# set_requires_gradient_sync(False) on the first), the others step after each.
MICRO_BATCHES = {"gpt": 1, "llama": 1, "cnn": 2, "gpt-in-backward": 1}


def _batches(case: str, rank: int, args: tuple) -> list[tuple]:
    """``args`` and the case's further micro-batches (each rank its own, the same shapes)."""
    generator = torch.Generator().manual_seed(200 + rank)
    more = [tuple(torch.randn(a.shape, generator=generator) if a.is_floating_point()
                  else torch.randint(0, 64, a.shape, generator=generator) for a in args)
            for _ in range(MICRO_BATCHES[case] - 1)]
    return [args, *more]


CASES = {"gpt": _gpt, "llama": _llama, "cnn": _cnn, "gpt-in-backward": _gpt}
# The budget per rank, as a share of what the same step takes under plain FSDP2 (measured here).
# The CNN's stem (eager, before the first block) holds half of its step: memplan plans the rest. At
# 0.925 its block 1 keeps one feature map more than at 0.92, and the reducing micro-step's prediction
# once counted the later blocks' gradients, reduced and updated already, twice (4.6% over the peak).
SHARE = {"gpt": 0.85, "llama": 0.8, "cnn": 0.925, "gpt-in-backward": 0.85}
# Where each case keeps its optimizer's state: the GPT's on the host (stepped there, ZeRO-Offload's
# arrangement), which leaves the AdamW moments (a third of plain FSDP2's resident bytes) out of its budget.
OPTIMIZER_STATE = {"gpt": "host", "llama": "device", "cnn": "device", "gpt-in-backward": "host"}
# Where each case runs its updates: the CNN's inside backward, each block's once its reduce-scatter is
# done (and only at the micro-step that reduces), the others' at optimizer.step() after backward; the
# GPT's once more inside backward, its state on the host (each block's shards stepped there in backward).
IN_BACKWARD = {"gpt": False, "llama": False, "cnn": True, "gpt-in-backward": True}


def _policy(case: str) -> dict:
    """FSDP2's options for ``case``: the library Llama computes in bf16 with fp32 shards and reductions
    (MixedPrecisionPolicy), the others in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if case != "llama":
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple]) -> list[int]:
    """Each step's peak over its forwards and backwards, one per batch in ``batches`` (gradients
    accumulated unreduced, ``set_requires_gradient_sync(False)``, until the last: FSDP2 keeps them
    unsharded in between), the profiler's, what FSDP2 and the optimizer held before counted too;
    the optimizer's step after it; the first step unmeasured. Each batch is copied in as its
    forward begins and dropped after its backward (as a data loader hands batches out): the
    batches waiting their turn are the caller's, not the step's."""
    def forwards_and_backwards() -> None:
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            args = tuple(t.clone() for t in batch)
            model(*args).backward()
            del args

    peaks = []
    for step in range(STEPS):
        if step == 0:
            forwards_and_backwards()
        else:
            peaks.append(profiled_peak(forwards_and_backwards, resident=local_state(model, opt)))
        opt.step()
        opt.zero_grad()
    return peaks


def _checkpoint_resumes(case: str, rank: int, budget: int, directory: str) -> None:
    """Saved with torch.distributed.checkpoint after two steps and loaded into a fresh model that
    memplan.fully_shard sharded, with a fresh optimizer: the third step reaches the parameters and
    AdamW state of the run that never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def made() -> tuple[nn.Module, torch.optim.Optimizer, tuple]:
        torch.manual_seed(0)  # the same initial parameters on every rank and in both runs
        model, args = CASES[case](rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return memplan.fully_shard(model, budget, optimizer=opt, time_limit=2,
                                   optimizer_state=OPTIMIZER_STATE[case]), opt, args

    def step(model: nn.Module, opt: torch.optim.Optimizer, args: tuple) -> None:
        model(*args).backward()
        opt.step()
        opt.zero_grad()

    first, first_opt, args = made()
    for _ in range(2):
        step(first, first_opt, args)
    model_state, optim_state = get_state_dict(first, first_opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    step(first, first_opt, args)

    second, second_opt, _ = made()
    model_state, optim_state = get_state_dict(second, second_opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    set_state_dict(second, second_opt, model_state_dict=model_state, optim_state_dict=optim_state)
    step(second, second_opt, args)
    for (name, p), q in zip(first.named_parameters(), second.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), msg=name)
        for key, value in first_opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim():
                torch.testing.assert_close(second_opt.state[q][key].full_tensor(), value.full_tensor(), msg=key)


def _rank(rank: int, case: str, directory: str = "") -> None:
    from torch.distributed.fsdp import fully_shard

    model, args = CASES[case](rank)
    batches = _batches(case, rank, args)
    reference = copy.deepcopy(model)
    for block in find_units(reference):
        fully_shard(block, **_policy(case))
    fully_shard(reference, **_policy(case))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    eager = _train(reference, ref_opt, batches)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # (the median step: a step's peak is one tensor higher now and then, when a reference cycle
    # that holds one, a Hugging Face cache's, is collected later)
    budget = int(SHARE[case] * sorted(eager)[len(eager) // 2])
    with pytest.raises(memplan.DistributedTrainingError, match="before any fully_shard"):
        memplan.fully_shard(reference, budget)  # already sharded: memplan shards the model itself
    # (2 s of solving: make test's time; the library Llama's case failed 2 of 3 runs at 2 s, cause not
    # read yet, and passes at 5 s)
    sharded = memplan.fully_shard(model, budget, optimizer=opt, time_limit=5 if case == "llama" else 2,
                                  optimizer_state=OPTIMIZER_STATE[case], updates_in_backward=IN_BACKWARD[case],
                                  **_policy(case))
    assert sharded is model and len(model.memplan_backend.graphs) == 0
    peaks = _train(model, opt, batches)
    if IN_BACKWARD[case]:  # every block and the root updated inside the last backward, their gradients dropped
        assert model.memplan_updates.units_updated == len(model.memplan_backend.sharding.units) + 1
    assert max(peaks) <= budget, (case, peaks, budget, eager)
    assert max(peaks) < max(eager)
    predicted, measured = model.memplan_backend.predicted_peak, sorted(peaks)[len(peaks) // 2]
    assert abs(predicted - measured) <= 0.02 * measured, (case, predicted, peaks)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), msg=name)
        for key, value in ref_opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim():
                torch.testing.assert_close(opt.state[q][key].full_tensor(), value.full_tensor(), msg=f"{name} {key}")
    if directory:
        torch._dynamo.reset()
        _checkpoint_resumes(case, rank, budget, directory)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt", "llama", "cnn", "gpt-in-backward"])
def test_memplan_fully_shard_trains_as_fsdp2_under_each_ranks_budget(case, tmp_path):
    # (the GPT also resumes from a torch.distributed.checkpoint: one spawn, to keep make test short)
    spawn_ranks(_rank, case, str(tmp_path) if case == "gpt" else "", world_size=WORLD_SIZE)


def test_the_blocks_are_the_repeated_modules_and_bad_inputs_are_refused_before_sharding():
    model, _ = _gpt(0)
    blocks = find_units(model)
    assert blocks and all(type(b).__name__ == "GPTBlock" for b in blocks)
    with pytest.raises(ValueError, match="in bytes"):
        memplan.fully_shard(model, "50%")
    opt = torch.optim.AdamW(model.parameters())
    model(*_gpt(0)[1]).backward()
    opt.step()
    with pytest.raises(memplan.DistributedTrainingError, match="already stepped"):
        memplan.fully_shard(model, "1GB", optimizer=opt)
    with pytest.raises(ValueError, match="no repeated blocks"):
        memplan.fully_shard(nn.Linear(2, 2), "1GB")
    with pytest.raises(ValueError, match="give \"device\" or \"host\""):
        memplan.fully_shard(model, "1GB", optimizer_state="cpu")
    with pytest.raises(ValueError, match="needs the optimizer"):
        memplan.fully_shard(model, "1GB", optimizer_state="host")
    with pytest.raises(ValueError, match="needs the optimizer"):
        memplan.fully_shard(model, "1GB", updates_in_backward=True)
    with pytest.raises(ValueError, match="not an elementwise optimizer"):
        memplan.fully_shard(model, "1GB", optimizer=torch.optim.LBFGS(model.parameters()), optimizer_state="host")
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())  # nothing sharded


def test_a_step_on_the_host_updates_as_the_optimizer_does_and_keeps_its_state_there():
    """The host step (`step_sharded_on_host`) on plain tensors, three steps against the same optimizer
    stepped as usual: the same parameters and state, the state in host memory, the state dict's keys the
    usual ones; state a load_state_dict put beside the parameters is moved back to the host at once. An
    optimizer stepped on the device only (capturable, fused) is refused."""
    from memplan.core.host import is_host
    from memplan.updates.host_state import check_host_steppable, keep_sharded_state_on_host

    torch.manual_seed(0)
    plain, hosted = nn.Linear(8, 4), nn.Linear(8, 4)
    hosted.load_state_dict(plain.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, hosted)]
    keep_sharded_state_on_host(opts[1])
    scheduler = torch.optim.lr_scheduler.StepLR(opts[1], step_size=1, gamma=0.5)  # wraps the host step
    x = torch.randn(16, 8)
    for step in range(3):
        for m, opt in zip((plain, hosted), opts):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opts[0].param_groups[0]["lr"] *= 0.5
        scheduler.step()
        if step == 1:  # a resume: load_state_dict casts the state to the parameters' device, memplan back
            opts[1].load_state_dict(copy.deepcopy(opts[1].state_dict()))
            assert is_host(opts[1].state[hosted.weight]["exp_avg"])
    for p, q in zip(plain.parameters(), hosted.parameters()):
        torch.testing.assert_close(q, p)
        for key, value in opts[0].state[p].items():
            torch.testing.assert_close(opts[1].state[q][key], value)
        assert is_host(opts[1].state[q]["exp_avg"]) and is_host(opts[1].state[q]["exp_avg_sq"])
    assert opts[1].state_dict()["state"].keys() == opts[0].state_dict()["state"].keys()
    with pytest.raises(ValueError, match="capturable=True"):
        check_host_steppable(torch.optim.AdamW(plain.parameters(), capturable=True), "host")


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The names of the ops this thread runs, in order (a backward's, FSDP2's collectives among them)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _reduce_scatter_overlaps_backward(rank: int) -> None:
    """With three blocks, the first block's gradients go to FSDP2's reduce-scatter while the other
    blocks' backwards are still to run: each block's backward is a plan of its own."""
    zm = zoo.build("gpt", size="tiny", batch_size=4, overrides={"dropout": 0.0, "layers": 3})
    torch.manual_seed(rank)
    model = memplan.fully_shard(memplan.WithLoss(zm.model, zm.loss_fn), "1GB", time_limit=2)
    x = torch.randint_like(zm.example_inputs[0], 0, 64)
    for _ in range(2):  # the second step runs the plans (the first plans at its backward)
        loss = model(x)
        recorder = OpRecorder()
        with recorder:
            loss.backward()
    ops = recorder.names
    # (over gloo memplan reduce-scatters by an in-place all-reduce: `sharded.in_place_reduce_scatter`)
    reduce_scatters = [i for i, name in enumerate(ops) if "reduce_scatter" in name or "allreduce" in name]
    matmuls = [i for i, name in enumerate(ops) if name.startswith(("aten.mm", "aten.addmm", "aten.bmm"))]
    assert len(reduce_scatters) == 4, reduce_scatters  # the three blocks and the root
    assert reduce_scatters[0] < matmuls[-1], (reduce_scatters, matmuls[-1])
    assert sum(reduce_scatters[0] < i for i in matmuls) >= len(matmuls) // 3


def _too_small(rank: int) -> None:
    model, args = _gpt(rank)
    # rank 0 is given a budget below its blocks' smallest plans, rank 1 a large one
    memplan.fully_shard(model, "200KB" if rank == 0 else "1GB", time_limit=2)
    expected = memplan.SplitBudgetError if rank == 0 else memplan.DistributedTrainingError
    with pytest.raises(expected, match="too small"):
        model(*args).backward()
    # A block dynamo runs eagerly (past its recompile limit: the library Llama's layers differ
    # in a Python attribute, so each is compiled again) would be in no plan: refused.
    torch._dynamo.reset()
    model, args = _llama(rank)
    memplan.fully_shard(model, "1GB", time_limit=2)
    with torch._dynamo.config.patch(recompile_limit=1), \
            pytest.raises(memplan.DistributedTrainingError, match=r"block\(s\) \[1\] ran outside"):
        model(*args)
    torch._dynamo.reset()
    _reduce_scatter_overlaps_backward(rank)


@pytest.mark.slow
def test_a_budget_too_small_on_one_rank_stops_every_rank_a_block_outside_the_plans_is_refused_and_reduce_scatters_overlap():
    spawn_ranks(_too_small, world_size=WORLD_SIZE)


@pytest.mark.slow
def test_the_torchrun_example_trains_on_two_processes():
    out = run_torchrun_example("fsdp_train.py", "--steps", "2")
    assert "step 1: loss" in out and "memplan backend" in out, out[-2000:]