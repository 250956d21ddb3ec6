"""FSDP2 (``fully_shard``), planned unit by unit under one budget per rank.

    model = memplan.fully_shard(model, budget="16GB")        # instead of torch's fully_shard calls

shards the model as a torchtitan user does by hand (``fully_shard`` on every block, then on
the model, the root) and plans each block's forward and backward: the block's forward is
compiled by one memplan backend (`memplan.frontend.backend`) for the whole model, so the
blocks share the rank's budget through the backend's ledger (`solvers.strategies.ledger`)
exactly as the graphs of a model with graph breaks do, and FSDP2 itself (its hooks, its
all-gathers and reduce-scatters, its ``DTensor`` shards, the user's optimizer over them) runs
as without memplan. Each block is compiled *before* it is sharded, on its own ``forward``, so
that dynamo traces the block's computation and FSDP2's hooks stay outside the graph.

What FSDP2 holds is in the ledger (`ShardedAccounts`):

* every parameter's local shard, all step, and the root's parameters all-gathered (FSDP2
  keeps the root unsharded from its forward to the end of its backward) with their
  gradients: resident, owned by no plan;
* a block's all-gathered parameters: an input of its plan while it runs (FSDP2 frees them
  after the block's forward and gathers them again for its backward);
* a block's gradient shard (what the reduce-scatter leaves): kept to the step's end, as a
  plan's gradients are; in a step that accumulates (``set_requires_gradient_sync(False)``), the
  whole unreduced gradient, which the steps after hold from their start (`accumulated`);
* while a block's backward runs, the block before it gathered ahead (FSDP2's backward
  prefetch) and the reduce-scatter input of the block after it (`Call.transient`); before its
  forward, for a moment, its all-gather output (`Call.staging`); at the end of backward, the
  root's reduce-scatter input (`StepLedger.closing`): outside every plan, in program order,
  which is what an allocator counts.

The communication library's own buffers (gloo's, NCCL's) are not torch tensors and are in no
plan.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

import warnings
import weakref

from memplan.core.host import is_host
from memplan.core.storage import storage_key
from memplan.core.units import format_bytes
from memplan.frontend.distributed import DistributedTrainingError, DistributedWarning
from memplan.updates.host_state import check_host_steppable, keep_sharded_state_on_host, local_tensor


def _reduces(block: nn.Module) -> bool:
    """Whether FSDP2 reduce-scatters ``block``'s gradients in this step (not under
    ``set_requires_gradient_sync(False)``)."""
    return all(group.reduce_grads for group in block._get_fsdp_state()._fsdp_param_groups)


class ShardedAccounts:
    """What FSDP2 holds on this rank, as the step's ledger counts it (`memplan.frontend.graphs`
    reads it at every call of a block's graph)."""

    def __init__(self, units: list[nn.Module], root: nn.Module, backend: Any):
        self.units = units
        self.root = root
        self.backend = backend  # the `MemplanBackend` whose ledger counts these
        self._by_gathered: dict[int, tuple[Any, int]] = {}  # id(gathered parameter) -> (shard key, shard bytes)
        self._held: dict[Any, int] | None = None
        self._root_counted = False  # whether the root's gathered parameters are in `_held`
        self._held_in: tuple[int, int] | None = None  # (ledger, entries) `_held` was last put into (`hold_in`)
        self.largest_unit = 0  # the largest block's gathered bytes, seen so far
        self.unit_bytes: dict[int, int] = {}  # block index -> its gathered bytes, seen at its calls
        # the root's gathered parameters' gradients (key -> bytes), once FSDP2 gathered them; those the
        # code after the last block makes (a gradient of the loss head's weights)
        self.root_grads: dict[Any, int] = {}
        self.eager_grads: set = set()  # those made by eager code between the blocks or after the last
        self.root_gathered = 0  # the root's gathered parameters' bytes
        # optimizer -> the state it keeps on this rank, in bytes (weakly: a dropped optimizer is forgotten)
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.host_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # those keeping it on the host
        self.group: Any = None  # the process group of FSDP2's mesh (None: the default group)
        self.device = next(root.parameters()).device  # where FSDP2's collectives run (NCCL: CUDA tensors only)
        # reduce-scatter bytes per gathered byte: FSDP2 reduces in MixedPrecisionPolicy.reduce_dtype
        self.reduce_ratio = 1.0
        # The blocks whose forward ran in this step, and those a plan ran for (`check_planned`)
        self.ran: set[int] = set()
        self.planned: set[int] = set()
        self._unit_of: dict[int, int] = {}  # id(gathered parameter) -> its block's index
        self.param_ids = {id(p) for p in root.parameters()}  # the sharded parameters (set by `fully_shard`)
        # block index -> bytes of its gradients left unreduced by the step whose forward ran last
        # (``set_requires_gradient_sync(False)``): what the next step holds from its start (`accumulated`)
        self.unreduced: dict[int, int] = {}
        self.unreduced_finals: dict[Any, int] = {}  # ("grad", shard key) -> shard bytes, of those gradients
        self._record_of: dict[int, Any] = {}  # id(gathered parameter) -> its FSDPParam
        # With updates in backward (`memplan.frontend.sharded_updates`): the optimizer, and per block the
        # bytes its gradient shards and its update's temporaries take while it waits and is updated
        self.updated_by: torch.optim.Optimizer | None = None
        self._updated_ids: frozenset[int] = frozenset()  # id() of the sharded parameters it holds
        self._awaiting: dict[int, int] = {}

    def count_optimizer(self, optimizer: torch.optim.Optimizer, on_host: bool = False) -> None:
        """Count the state ``optimizer`` will keep on this rank (its local shards') as held all step; state
        kept in host memory (``on_host``) is in no budget, and reported as the host's."""
        from memplan.updates.probe import optimizer_state_bytes

        state = optimizer_state_bytes(optimizer, lambda p: local_tensor(p).numel())
        if on_host:
            self.host_optimizers[optimizer] = state
            return
        self.optimizers[optimizer] = state
        self.held_all_step()[("optimizer state", id(optimizer))] = state
        self.hold_in(self.backend.ledger)

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before an optimizer's step (a global hook): an optimizer not given to `fully_shard` that
        steps this model's parameters has its state counted from now on; the plans made before
        left no room for it, so the next step can go over the budget by about it (said once)."""
        if optimizer in self.optimizers or optimizer in self.host_optimizers or not any(
                id(p) in self.param_ids for group in optimizer.param_groups for p in group["params"]):
            return
        self.count_optimizer(optimizer)
        warnings.warn(
            f"memplan.fully_shard: {type(optimizer).__name__} steps this model's parameters but was not given as "
            f"optimizer=: its state ({format_bytes(self.optimizers[optimizer])} on this rank) is counted from now "
            "on, and the next step may go over the budget by about that much while the plans make room. Give it "
            "to memplan.fully_shard(model, budget, optimizer=opt).",
            DistributedWarning,
            stacklevel=3,
        )

    @staticmethod
    def _params(module: nn.Module) -> list[Any]:
        """FSDP2's records of ``module``'s parameters (one ``FSDPParam`` each)."""
        state = module._get_fsdp_state()
        return [fp for group in state._fsdp_param_groups for fp in group.fsdp_params]

    def _refresh(self) -> None:
        """Map each block's all-gathered parameter (FSDP2 makes it at its first all-gather and keeps
        the object, freeing and refilling its storage) to its shard."""
        for index, unit in enumerate(self.units):
            for fp in self._params(unit):
                gathered = getattr(fp, "_unsharded_param", None)
                if gathered is not None:
                    shard = fp._sharded_param_data
                    self._by_gathered[id(gathered)] = (storage_key(shard), shard.numel() * shard.element_size())
                    self._unit_of[id(gathered)] = index
                    self._record_of[id(gathered)] = fp

    def shard_of(self, t: torch.Tensor) -> tuple[Any, int, int] | None:
        """``t``'s shard (key, bytes) and its block's index where ``t`` is a block's all-gathered
        parameter, else None."""
        if not isinstance(t, nn.Parameter):
            return None
        found = self._by_gathered.get(id(t))
        if found is None:
            self._refresh()
            found = self._by_gathered.get(id(t))
        if found is None:
            return None
        self.planned.add(self._unit_of[id(t)])
        return (*found, self._unit_of[id(t)])

    def gradient_bytes(self, unit: int, gathered: torch.Tensor, shard_key: Any, shard_bytes: int) -> int:
        """What block ``unit``'s backward adds, of the gradient of its all-gathered parameter
        ``gathered`` (its shard ``shard_key``, holding ``shard_bytes``), to what the rank holds until
        the step's end: the shard, after the reduce-scatter. Where the block does not reduce in this
        step (``set_requires_gradient_sync(False)``, gradient accumulation), the whole gradient, in
        the reduce dtype, which FSDP2 keeps unsharded for the steps after (`accumulated`): nothing
        more where an earlier step's is held already (this one is added into it)."""
        if _reduces(self.units[unit]):
            # updated in backward, the shard is gone before the step's end (`awaiting_update`)
            return 0 if self._updated_in_backward(gathered) else shard_bytes
        whole = int(gathered.untyped_storage().nbytes() * self.reduce_ratio)
        self.unreduced[unit] = self.unreduced.get(unit, 0) + whole
        self.unreduced_finals[("grad", shard_key)] = shard_bytes
        record = self._record_of.get(id(gathered))
        held = gathered.grad is not None or (record is not None and record.unsharded_accumulated_grad is not None)
        return 0 if held else whole

    def reducing_finals(self) -> dict[Any, int]:
        """("grad", shard key) -> bytes, for the gradients of every block that reduces in this step:
        what each leaves to the step's end (as `gradient_bytes` says once the block runs). Put in the
        ledger as the step begins: under gradient accumulation the finals it holds for the blocks
        not run yet are the last step's, which kept them whole, unreduced."""
        finals: dict[Any, int] = {}
        for block in self.units:
            if not _reduces(block):
                continue
            for fp in self._params(block):
                shard = fp._sharded_param_data
                updated = id(fp.sharded_param) in self._updated_ids
                finals[("grad", storage_key(shard))] = 0 if updated else shard.numel() * shard.element_size()
        return finals

    def rehearsed_finals(self, final: dict[Any, int]) -> dict[Any, int]:
        """``final`` (a first step's call's, key -> bytes) as the rehearsal of the next step counts it:
        a gradient the first step left unreduced is held from the next step's start (`unreduced`), and
        what that step's backward adds is at most its shard."""
        return {k: self.unreduced_finals.get(k, b) for k, b in final.items()}

    def accumulated(self) -> dict[Any, int]:
        """Key -> bytes of the unsharded gradients FSDP2 holds from earlier steps that did not
        reduce (``set_requires_gradient_sync(False)``): held, outside every plan, until the step
        that reduces them, to its end (a block's are freed earlier, at its reduce-scatter: the plans
        whose backward comes after it count them out, `reduced_before_backward`)."""
        return {k: b for module in [*self.units, self.root] for k, b in self._accumulated_of(module).items()}

    def _accumulated_of(self, module: nn.Module) -> dict[Any, int]:
        held: dict[Any, int] = {}
        for fp in self._params(module):
            gathered = getattr(fp, "_unsharded_param", None)
            for grad in (fp.unsharded_accumulated_grad, None if gathered is None else gathered.grad):
                if grad is not None:
                    held[storage_key(grad)] = grad.untyped_storage().nbytes()
        return held

    def reduced_before_backward(self, unit: int) -> int:
        """Bytes of the `accumulated` gradients that are gone by the time block ``unit``'s backward
        runs: those of the blocks after it that reduce in this step (their backward ran first, and
        FSDP2 frees the unsharded gradient once its reduce-scatter has copied it)."""
        return sum(sum(self._accumulated_of(block).values()) for block in self.units[unit + 1:] if _reduces(block))

    def mark_planned(self, args: tuple) -> None:
        """A block's graph ran with nothing to plan (no gradient needed): it is not outside the plans."""
        for t in args:
            if isinstance(t, nn.Parameter):
                self.shard_of(t)  # marks its block

    def check_planned(self, training: bool) -> None:
        """At the end of a step's forward: in a training step, raise on every rank where a block ran
        outside every plan on any rank (dynamo ran its forward eagerly: its memory would be in no
        budget). A collective: every rank's root forward ends at the same point of its step."""
        missed = sorted(self.ran - self.planned)
        self.ran, self.planned = set(), set()
        if not training:
            return
        if self.any_rank(bool(missed)):
            where = f"block(s) {missed[:5]}{' ...' if len(missed) > 5 else ''}" if missed else "a block on another rank"
            raise DistributedTrainingError(
                f"memplan.fully_shard: {where} ran outside memplan's plans (torch.compile ran the forward eagerly: "
                "a recompile limit, or a frame dynamo skips), so the budget would not hold. Run with "
                "TORCH_LOGS=recompiles to see why; torch._dynamo.config.recompile_limit raises the limit")

    def held_all_step(self) -> dict[Any, int]:
        """Key -> bytes FSDP2 holds all step outside every plan: every local shard, the optimizers'
        state (`count_optimizer`), and the root's gathered parameters (counted from the first call
        after the root's forward has gathered them; their gradients are made later: `root_grads`)."""
        if self._held is None:
            self._held = {}
            for module in [*self.units, self.root]:
                for fp in self._params(module):
                    shard = fp._sharded_param_data
                    self._held[storage_key(shard)] = shard.numel() * shard.element_size()
        if not self._root_counted:
            for fp in self._params(self.root):
                gathered = getattr(fp, "_unsharded_param", None)
                if gathered is not None and gathered.untyped_storage().nbytes():
                    self._root_counted = True
                    key, nbytes = storage_key(gathered), gathered.untyped_storage().nbytes()
                    self._held[key] = nbytes
                    self.root_gathered += nbytes
                    if gathered.requires_grad:
                        # its gradient is made by the code after the last block (`root_grads_made_by`)
                        # or at the end of backward (the embedding's), and waits, whole, for the root's
                        # reduce-scatter at the end of backward, which copies it into its input (`closing`)
                        self.root_grads[("grad", key)] = nbytes
        return self._held

    def hold_in(self, ledger: Any) -> None:
        """Put what FSDP2 holds all step into ``ledger`` (a `StepLedger`), where it changed since the
        last time: every block's call asks, and the set changes only when the root is first gathered
        or an optimizer is counted."""
        held = self.held_all_step()
        if self._held_in != (id(ledger), len(held)):
            ledger.hold_resident(held)
            ledger.closing = self.closing
            self._held_in = (id(ledger), len(held))

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective: every rank calls it at the same point)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return flag
        t = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def outside(self, unit: int) -> tuple[int, int]:
        """(transient, staging): the bytes FSDP2 holds outside block ``unit``'s plan (`Call`), in
        program order (what the allocator counts, on any device). While its backward runs: the
        all-gather output of the block before it, gathered ahead of that block's backward (FSDP2's
        backward prefetch), and the reduce-scatter input of the block after it (kept until this
        block's own reduce-scatter is issued, in the reduce dtype). For a moment before its forward:
        its own all-gather output, before it is copied into its parameters. A block not seen yet
        counts as the largest seen."""
        return self.buffers(unit) - self.reduced_before_backward(unit), self._gathered(unit)

    def buffers(self, unit: int) -> int:
        """What FSDP2 holds beside block ``unit``'s backward (`outside`), before the gradients the
        blocks after it freed: the block before it gathered, the reduce-scatter input of the block
        after it, and that block's shards waiting for their update."""
        prefetch = self._gathered(unit - 1) if unit > 0 else 0
        after = unit + 1 < len(self.units)
        reduce_input = int(self._gathered(unit + 1) * self.reduce_ratio) if after else 0
        return prefetch + reduce_input + (self.awaiting_update(unit + 1) if after else 0)

    def _updated_in_backward(self, gathered: torch.Tensor) -> bool:
        """Whether the gradient shard of the all-gathered parameter ``gathered`` is updated (and dropped)
        in backward: with updates in backward, where the optimizer holds its sharded parameter."""
        record = self._record_of.get(id(gathered))
        return record is not None and id(record.sharded_param) in self._updated_ids

    def update_in_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s updates as run in backward, block by block (`memplan.frontend.sharded_updates`)."""
        self.updated_by = optimizer
        self._updated_ids = frozenset(id(p) for g in optimizer.param_groups for p in g["params"])

    def awaiting_update(self, unit: int) -> int:
        """With updates in backward: block ``unit``'s gradient shards, which wait for its update until the
        next block's post-backward, and that update's temporaries (the next block's transient, a bound);
        0 otherwise."""
        if self.updated_by is None:
            return 0
        if unit not in self._awaiting:
            from memplan.updates.probe import update_temp_bytes

            shards = [fp.sharded_param for fp in self._params(self.units[unit])]
            grads = sum(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size()
                        for fp in self._params(self.units[unit]))
            temps = update_temp_bytes(self.updated_by, shards, lambda p: local_tensor(p).numel())
            self._awaiting[unit] = grads + temps
        return self._awaiting[unit]

    @property
    def blocks_done(self) -> bool:
        """Whether this step's forward has run its last block (the code running now is after it)."""
        return len(self.units) - 1 in self.ran

    @property
    def ahead_of_tail(self) -> int:
        """Bytes FSDP2 holds while the code after the last block runs its backward: the last
        block's all-gather output, gathered ahead of its backward by the root's."""
        return self._gathered(len(self.units) - 1)

    def _gathered(self, unit: int) -> int:
        return self.unit_bytes.get(unit, self.largest_unit)

    def saw(self, unit: int, gathered_bytes: int) -> None:
        """Block ``unit``'s call gathered ``gathered_bytes`` of parameters."""
        self.unit_bytes[unit] = gathered_bytes
        self.largest_unit = max(self.largest_unit, gathered_bytes)

    def root_grads_made_by(self, leaves: list) -> dict[Any, int]:
        """The root's gradients (key -> bytes) among those of ``leaves`` (the parameters eager code
        between the blocks, or after the last, makes gradients for): that code's finals in the
        ledger, no longer made at the end of backward (`closing`)."""
        keys = {storage_key(p) for p in leaves if isinstance(p, torch.Tensor)}
        made = {k: b for k, b in self.root_grads.items() if k[1] in keys}
        self.eager_grads.update(made)
        return made

    @property
    def closing(self) -> int:
        """Bytes FSDP2 holds at the end of the step's backward beside every gradient shard and the
        code after the last block's gradients: the root's other gradients (its embedding's, made
        by the root's own backward after the first block's) and its reduce-scatter input (all its
        gradients, in the reduce dtype); with updates in backward, the first block's gradient shards
        and update temporaries too, which wait for the root's post-backward (`awaiting_update`)."""
        root = sum(self.root_grads.values())
        late = sum(b for k, b in self.root_grads.items() if k not in self.eager_grads)
        # with updates in backward, the first block's shards wait for their update until the root's post-backward
        first = self.awaiting_update(0) if self.units else 0
        return late + int(root * self.reduce_ratio) + first


    def categories(self) -> dict[str, int]:
        """What FSDP2 holds on this rank by kind, in bytes (`MemplanBackend.report`): what is held
        all step, and the most the blocks' gathered parameters and the communication buffers take
        at once."""
        held = self.held_all_step()
        optimizer = sum(self.optimizers.values())
        shards = sum(held.values()) - optimizer - self.root_gathered
        comm = max([self.closing, *(max(self.buffers(i), self._gathered(i)) for i in range(len(self.units)))])
        unreduced = {"unreduced gradients (accumulating)": sum(self.unreduced.values())} if self.unreduced else {}
        host = sum(self.host_optimizers.values())
        return {
            "parameter shards": shards,
            "optimizer state (shards)": optimizer,
            **({"optimizer state (shards, host memory: in no budget)": host} if host else {}),
            "root parameters, gathered": self.root_gathered,
            "root gradients": sum(self.root_grads.values()),
            "gradient shards (blocks)": sum(nbytes for _, nbytes in self._by_gathered.values()),
            **unreduced,
            "largest block, gathered": self.largest_unit,
            "communication buffers (most at once)": comm,  # (a block's staging and transient never meet)
        }


def in_place_reduce_scatter() -> Any:
    """A reduce-scatter for FSDP2 (``set_custom_reduce_scatter``) over gloo that allocates nothing.

    Gloo's reduce-scatter clones its whole input (a block's gradients) and frees the clone when its
    worker thread lets the work go: while the next block's backward runs, or not, as the threads
    happen to run, one block's gradients more than the plan counts (seen at 0.45 of the zoo GPT's
    step under FSDP2, in one step of about four: 155,584 B over the budget). This one all-reduces
    FSDP2's input buffer in place (it is FSDP2's own, dropped afterwards) and copies the rank's chunk
    out: twice the bytes on the wire, none allocated. NCCL's reduce-scatter allocates nothing: it
    is left as it is."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class InPlaceReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            dist.all_reduce(input_tensor, op=op, group=group)
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            output_tensor.copy_(input_tensor.view(size, -1)[rank].view_as(output_tensor))
            return None

    return InPlaceReduceScatter()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """What a rank holds on its device between steps under FSDP2: its parameters' local shards (a
    DTensor's ``to_local``; plain tensors as they are) and the optimizer's state tensors, but those
    in host memory (``optimizer_state="host"``)."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)] if optimizer else []
    local = [local_tensor(t) for t in [*model.parameters(), *state]]
    device = local[0].device if local else None
    return [t for t in local if t.device == device and not is_host(t)]


def find_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``, in order: the modules of the one class, held in a
    ``ModuleList`` / ``Sequential`` at least twice, whose instances hold the most parameters
    together (a transformer's layers; a ResNet's blocks across all its stages). Blocks with
    modules of their own come first: single layers (``Linear``, ``Conv2d``) are the blocks only
    of a model that has no other kind. A block inside another block of that class is part of the
    outer one."""
    by_class: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child in module.children():
                if not isinstance(child, (nn.ModuleList, nn.Sequential)):
                    by_class.setdefault(type(child), []).append(child)

    def weight(modules: list[nn.Module]) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    candidates = [ms for ms in by_class.values() if len(ms) >= 2 and weight(ms) > 0]
    composite = [ms for ms in candidates if any(True for _ in ms[0].children())]
    if not candidates:
        return []
    chosen = {id(m) for m in max(composite or candidates, key=weight)}
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: an outer block comes before what it holds
        if id(module) in chosen and id(module) not in inside:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def fully_shard(
    model: nn.Module,
    budget: int | str,
    *,
    units: Iterable[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    mesh: Any = None,
    mp_policy: Any = None,
    solver: str = "auto",
    time_limit: float | None = None,
    kernel_scratch: bool | None = None,
    optimizer_state: str = "device",
    updates_in_backward: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``torch.distributed.fsdp.fully_shard``) and plan it under ``budget``
    bytes per rank (``"16GB"``): see :mod:`memplan.frontend.sharded`. Returns ``model``, now FSDP2's
    root; train it as any FSDP2 model (an optimizer over its parameters, ``optimizer.step()`` after
    backward).

    ``optimizer``: the optimizer that steps the model, made over its parameters before this call
    and not yet stepped: it is pointed at FSDP2's sharded parameters (FSDP2 replaces them), and the
    state it will keep on this rank is counted in the budget from the first step on. An optimizer
    made after this call is met at its first step (counted from then on, with a warning).
    ``optimizer_state="host"``: the optimizer's state lives in host memory and ``optimizer.step()``
    runs there, on host copies of the rank's shards, which are then copied back (ZeRO-Offload's
    arrangement: `memplan.updates.host_state.step_sharded_on_host`); the state is then in no budget.
    Needs ``optimizer`` given, and an elementwise one (SGD, Adam, AdamW, ...): default ``"device"``.
    ``updates_in_backward=True``: each block's shards are updated inside backward, once its reduce-scatter
    has left their gradients (`memplan.frontend.sharded_updates`), which are then dropped: the rank holds
    one block's gradient shards at a time. ``optimizer.step()`` after backward then finds no gradients,
    and so would ``clip_grad_norm_``: clipping needs the updates after backward (the default).
    ``units``: the modules sharded and planned one by one (default: the model's repeated blocks,
    `find_units`). ``mesh`` and ``mp_policy``: FSDP2's own (a 1-D mesh: HSDP is not planned).
    ``solver``, ``time_limit`` and ``kernel_scratch``: each block's plan's, as for
    ``memplan.optimize`` (``kernel_scratch`` on unless False: a rank's memory is what its allocator
    hands out, kernels' own scratch included)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from memplan.frontend.backend import MemplanBackend
    from memplan.frontend.budget import budget_fraction
    from memplan.pipeline.options import PlanOptions

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise DistributedTrainingError(
            "memplan.fully_shard shards the model itself: give it the model before any fully_shard call "
            "(a block must be compiled for its plan before FSDP2 wraps it)")
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise DistributedTrainingError(
            "memplan.fully_shard plans data parallelism only: this model's parameters are already "
            "distributed tensors (tensor parallelism), which memplan does not plan")
    if mesh is not None and mesh.ndim != 1:
        raise DistributedTrainingError(
            f"memplan.fully_shard plans FSDP2 over a 1-D mesh; this mesh has {mesh.ndim} dimensions "
            "(HSDP and other multi-dimensional meshes are not planned)")
    if budget_fraction(budget) is not None:
        raise ValueError(f"memplan.fully_shard: budget={budget!r}: give the rank's budget in bytes (\"16GB\"); "
                         "a share of the eager peak needs the whole step as one graph")
    blocks = list(units) if units is not None else find_units(model)
    if not blocks:
        raise ValueError("memplan.fully_shard found no repeated blocks in this model (a module class held at "
                         "least twice in a ModuleList or Sequential): name the modules to shard and plan with units=[...]")
    if optimizer_state not in ("device", "host"):
        raise ValueError(f"memplan.fully_shard: optimizer_state={optimizer_state!r}; give \"device\" or \"host\"")
    if optimizer_state == "host":
        if optimizer is None:
            raise ValueError("memplan.fully_shard(..., optimizer_state=\"host\") needs the optimizer: give optimizer=opt")
        check_host_steppable(optimizer, "memplan.fully_shard(..., optimizer_state=\"host\")")
    if updates_in_backward and optimizer is None:
        raise ValueError("memplan.fully_shard(..., updates_in_backward=True) needs the optimizer: give optimizer=opt")
    if optimizer is not None and optimizer.state:
        raise DistributedTrainingError(
            "memplan.fully_shard: the optimizer has already stepped; give one made over the model's parameters that "
            "has not (FSDP2 replaces the parameters, and state kept for the old ones would be lost)")
    names = {id(p): n for n, p in model.named_parameters()}
    if optimizer is not None:
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
        if foreign:
            raise DistributedTrainingError(
                f"memplan.fully_shard: the optimizer holds {len(foreign)} tensor(s) that are not this model's parameters")
    # Scratch kernels allocate for themselves (a CPU convolution's, cuDNN's workspaces) is on by
    # default: FSDP2's memory is witnessed by the allocator (every thread's: gloo's, NCCL's), which sees it.
    backend = MemplanBackend(budget, PlanOptions(solver=solver, time_limit=time_limit,
                                                 kernel_scratch=True if kernel_scratch is None else kernel_scratch))
    accounts = backend.sharding = ShardedAccounts(blocks, model, backend)
    policy = mp_policy or MixedPrecisionPolicy()
    options: dict[str, Any] = {"mp_policy": policy}
    if policy.reduce_dtype is not None:
        gathered_dtype = policy.param_dtype or next(model.parameters()).dtype
        accounts.reduce_ratio = policy.reduce_dtype.itemsize / gathered_dtype.itemsize
    if mesh is not None:
        options["mesh"] = mesh
        accounts.group = mesh.get_group()
    # Blocks share their class's code: dynamo compiles it again for a block whose Python attributes
    # differ (a layer index), and past its recompile limit would run the rest eagerly, unplanned.
    import torch._dynamo.config as dynamo_config

    # Each variant of a step (training or eval, a new sequence length) adds one entry per block.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * (len(blocks) + 1))
    for index, block in enumerate(blocks):
        # The block's own forward, compiled: FSDP2's hooks run around it, outside the graph.
        block.forward = torch.compile(block.forward, backend=backend)
        block.register_forward_pre_hook(lambda module, args, index=index: accounts.ran.add(index))
        torch_fully_shard(block, reshard_after_forward=True, **options)
    torch_fully_shard(model, **options)
    import torch.distributed as dist

    if dist.get_backend(accounts.group) == "gloo":
        comm = in_place_reduce_scatter()
        for module in [*blocks, model]:
            module.set_custom_reduce_scatter(comm)
    _compile_loss(model, backend)
    sharded = dict(model.named_parameters())  # FSDP2's sharded parameters now
    accounts.param_ids = {id(p) for p in sharded.values()}
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        if optimizer_state == "host":
            keep_sharded_state_on_host(optimizer)
        accounts.count_optimizer(optimizer, on_host=optimizer_state == "host")
        if updates_in_backward:
            from memplan.frontend.sharded_updates import UpdatesInBackward

            accounts.update_in_backward(optimizer)
            model.memplan_updates = UpdatesInBackward(optimizer, [*blocks, model], model)
    model.memplan_backend = backend
    # The loss head after the last block is eager code in no plan: the backend learns what it holds.
    def forward_done(module: nn.Module, args: Any, output: Any) -> None:
        accounts.check_planned(torch.is_grad_enabled() and module.training)
        backend.end_of_forward(output)

    model.register_forward_hook(forward_done)
    # The optimizer is made after sharding, over the shards: it is met at its first step.
    held = weakref.ref(accounts)  # the hook is global: it must not keep the model alive

    def on_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found = held()
        if found is not None:
            found.on_optimizer_step(opt, args, kwargs)

    model.memplan_optimizer_hook = register_optimizer_step_pre_hook(on_step)
    weakref.finalize(accounts, model.memplan_optimizer_hook.remove)
    return model


def _compile_loss(model: nn.Module, backend: Any) -> None:
    """Where ``model`` is a `memplan.WithLoss`, compile its loss function with the blocks' backend: the
    loss head (a cross-entropy over the logits, the step's largest tensors) is then a plan of the step,
    its backward holding two logits-size buffers where eager code holds three (`memplan.passes.loss_fusion`),
    and its plan lets the logits go when it returns (``WithLoss`` keeps no reference to them). Any other
    model's loss stays eager code, counted as it runs (`MemplanBackend.end_of_forward`)."""
    from memplan.frontend.module import WithLoss

    if not isinstance(model, WithLoss):
        return
    loss = model.loss_fn
    if isinstance(loss, nn.Module):
        loss.forward = torch.compile(loss.forward, backend=backend)
    else:
        model.loss_fn = torch.compile(loss, backend=backend)
