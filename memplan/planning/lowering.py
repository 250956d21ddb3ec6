"""Lower a captured, costed joint graph to the torch-free ``solvers.Problem``.

One Problem node per fx value, named as the fx node, plus two kinds of
bookkeeping nodes that make the Problem's memory match what really happens
in a training step:

* ``BACKWARD`` stands for the moment autograd calls our backward: it reads
  every forward output (so it comes after all of them) and holds the incoming
  output gradients, which appear as ``tangents_*`` nodes aliasing it. Every
  step scheduled before ``BACKWARD`` runs in ``forward()``, the rest in
  ``backward()``.
* ``START`` is a zero-byte source read by ops that read nothing else
  (``arange``, ``zeros``): in the Problem, a node without predecessors is an
  input that is never computed, which such ops are not.
* ``<output>@user`` is the reference the caller keeps to each forward output
  until the step ends: an alias of the output that must be resident at the
  end, so its bytes count even if the plan frees its own copy. It hangs off
  ``<output>@returned``, the same reference as forward() hands it over, which
  ``BACKWARD`` reads: the bytes count from the end of forward on. An output
  the caller is known to drop before backward (``memplan.passes.output_use``) has no
  ``@user``: its reference ends at ``BACKWARD``. Tangents get
  a ``@user`` too: autograd holds the output gradients until ``backward()``
  returns.

* ``rng:<op>`` is the generator state captured right before a random op
  (dropout) first runs. The op reads it, so a recomputation can replay the
  same state and draw the same mask, as ``torch.utils.checkpoint`` does:
  random ops are recomputable like any other, only the state (a few
  kilobytes) must be kept.
* ``CUT_RESERVE`` (only with ``carry_limit=``) is room held for others at the
  end of forward: read by ``BACKWARD`` and made after every forward output,
  its bytes are budget - sources - limit - the tangents' (``BACKWARD`` makes them while
  the reserve is still held), so a plan whose peak fits the budget
  carries at most ``limit`` bytes from its forward into its backward (what a
  step with several plans needs: `solvers.strategies.ledger`).

Views and getitems alias their input.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import torch.fx as fx

import solvers
from solvers.transforms.ordering import after_last_reads
from solvers.transforms.repair import add_recomputations
from memplan.capture.signature import Capture
from memplan.costs.cost_model import GraphCosts
from memplan.updates.names import ACCUM_PREFIX, GRADS_FINAL, NORM_FINAL, NORM_PASS_PREFIX, SQUARE_PREFIX, STATE_PREFIX, UPDATE_PREFIX, UPDATED_SUFFIX
from memplan.updates.buckets import BucketMember, bucket_updates
from memplan.updates.probe import ParamUpdate, UpdatePlacement, bucket_temp_bytes, bucket_time, host_bucket_time
from memplan.core.config import TUNABLES
from memplan.core.storage import value_device
from memplan.passes.paging import FETCH, is_paged

BACKWARD = "__backward__"
START = "__start__"
CUT_RESERVE = "__cut_reserve__"
RNG_PREFIX = "rng:"
SCRATCH_PREFIX = "scratch:"  # an op's kernel scratch (GraphCosts scratch): no tensor, held while the op runs
# A CPU generator's state tensor, CUDA's seed and offset; twice, because a
# replay also saves the current state to restore it afterwards.
RNG_STATE_BYTES = {"cpu": 2 * 5056, "cuda": 2 * 16}
USER_SUFFIX = "@user"  # the caller's reference to an output: a sink, held to the step's end
RETURNED_SUFFIX = "@returned"  # the same reference as forward() returns it: read by BACKWARD


def is_reference(name: str) -> bool:
    """Whether ``name`` is a bookkeeping node for the caller's reference to an output or tangent."""
    return name.endswith((USER_SUFFIX, RETURNED_SUFFIX))


@dataclass
class Lowered:
    """A Problem and the map back to the joint graph."""

    problem: "solvers.Problem"
    graph: nx.DiGraph
    fx_nodes: dict[str, fx.Node]  # Problem node name -> fx node (bookkeeping nodes absent)
    tangents: list[str]  # tangent placeholder names, in order
    sources: list[str]  # primal placeholder names, in order
    rng_of: dict[str, str]  # random op -> the Problem node of its generator state
    # Per parameter the optimizer updates (`memplan.updates.probe`): (the update node of its bucket,
    # the gradient it applies, the parameter's name in the model); its slot is its position here,
    # and a bucket's slots are consecutive (`memplan.updates.buckets`).
    updates: list[tuple[str, str, str]] = field(default_factory=list)
    placement: UpdatePlacement = UpdatePlacement()  # where the updates run, where their state lives
    # A norm pass's values (`memplan.updates.names.NORM_PASS_PREFIX`): copy -> the backward value it recomputes.
    norm_pass: dict[str, str] = field(default_factory=dict)

    @property
    def updates_after_backward(self) -> bool:
        return self.placement.after_backward

    @property
    def host_states(self) -> frozenset[str]:
        """Parameters (model names) whose optimizer state is in host memory, updated there."""
        return self.placement.host if self.updates else frozenset()

    @property
    def buckets(self) -> dict[str, tuple[int, ...]]:
        """Update node -> the slots it updates (one optimizer call), in the order of the updates."""
        out: dict[str, tuple[int, ...]] = {}
        for slot, (update, _, _) in enumerate(self.updates):
            out[update] = out.get(update, ()) + (slot,)
        return out

    @property
    def bucket_grads(self) -> dict[str, list[str]]:
        """Update node -> the gradients it applies, in its slots' order."""
        return {update: [self.updates[slot][1] for slot in slots] for update, slots in self.buckets.items()}

    def norm_pass_value(self, name: str) -> str:
        """The norm pass's copy of the value ``name`` where the pass has one, else ``name`` itself."""
        copy = NORM_PASS_PREFIX + name
        return copy if copy in self.norm_pass else name

    @property
    def parameter_writes(self) -> dict[str, tuple[str, ...]]:
        """Update node -> the parameter placeholders it overwrites in place."""
        return {update: tuple(self.param_nodes[slot] for slot in slots) for update, slots in self.buckets.items()}

    # Per update slot, the parameter's placeholder in the Problem.
    param_nodes: list[str] = field(default_factory=list)

    host_variants: dict[float, "solvers.Problem"] = field(default_factory=dict, repr=False)

    def with_budget(self, budget: int, host_bandwidth: float = 0.0) -> "solvers.Problem":
        """The Problem under ``budget``; ``host_bandwidth`` (bytes/s) > 0 allows offloading.
        Every budget of one host link shares one Problem's budget-free results (its minimum
        budget), so a sweep or a benchmark searches for it once."""
        base = self.host_variants.get(host_bandwidth)
        if base is None:
            base = self.host_variants[host_bandwidth] = self.problem.with_host(host_bandwidth)
        return base.with_budget(budget)


def value_name(node: fx.Node) -> str:
    """The Problem node an fx node's value is: constants are one value per attribute."""
    return f"attr:{node.target}" if node.op == "get_attr" else node.name


def dropped_input_names(cap: Capture) -> list[str]:
    """The placeholders of the input tensors the caller lets go when forward returns
    (`memplan.passes.output_use.OutputUse.inputs_dropped`), in order."""
    dropped = cap.output_use.inputs_dropped
    return [node.name for node, info in zip(cap.placeholders(), cap.primals)
            if info.kind == "input" and info.index in dropped]


def _live_nodes(gm: fx.GraphModule, keep: set[str]) -> set[str]:
    """Nodes that reach an output, plus random ops (dropping one would shift the RNG stream)."""
    live: set[str] = set()
    stack = [n for n in gm.graph.nodes if n.name in keep]
    while stack:
        n = stack.pop()
        if n.name in live:
            continue
        live.add(n.name)
        stack.extend(n.all_input_nodes)
    return live


def _overwritten_storages(cap: Capture, costs: GraphCosts) -> set[int]:
    """Storages of the buffers the step updates: the runtime copies their new values in when forward returns."""
    placeholders = cap.placeholders()
    mutated = set(cap.mutated_buffers)
    return {
        key
        for node, info in zip(placeholders, cap.primals)
        if info.kind == "buffer" and info.index in mutated
        for key in costs.values[node.name].storages
    }


# Ops that read a buffer only to compute that buffer's update: BatchNorm in training
# normalizes with the batch's statistics, and its running-statistics outputs feed
# the buffer updates, which forward makes before any buffer is overwritten.
_READS_BUFFER_FOR_ITS_UPDATE_ONLY = {"aten._native_batch_norm_legit_functional.default"}


def _reads_overwritten(node: fx.Node, costs: GraphCosts, overwritten: set[int]) -> bool:
    """Whether ``node`` reads a buffer the step overwrites (or a view of one), so it cannot be recomputed.

    The buffer's placeholder is the module's buffer itself, and once forward
    returns it holds the new value: a recomputation in backward would read
    that instead of the value forward read (an EMA updated in place under
    ``no_grad`` and then used), and compute a different activation than eager.
    """
    if not overwritten or str(node.target) in _READS_BUFFER_FOR_ITS_UPDATE_ONLY:
        return False
    return any(overwritten.intersection(costs.values[i.name].storages) for i in node.all_input_nodes)


def lower(cap: Capture, costs: GraphCosts, budget: int | None = None,
          updates: Sequence[ParamUpdate] = (), placement: UpdatePlacement = UpdatePlacement(),
          carry_limit: tuple[int, int] | None = None) -> Lowered:
    """Build the Problem for ``cap`` with the per-value costs in ``costs``; ``updates``: the
    optimizer updates the step applies (`memplan.updates`), with the state they keep, placed
    as ``placement`` says (each as soon as its gradient is final, or once all are; state on
    the device or in host memory). ``carry_limit=(limit, budget)``: a plan under ``budget``
    carries at most ``limit`` bytes beyond its sources into the backward (``CUT_RESERVE``)."""
    gm = cap.graph_module
    out_nodes = cap.output_nodes()
    placeholders = cap.placeholders()
    primal_nodes = placeholders[: len(cap.primals)]
    tangent_nodes = placeholders[len(cap.primals) :]

    fw_outputs: list[str] = []
    user_outputs: list[str] = []
    held_by_caller: set[str] = set()  # user outputs the caller still holds when backward starts
    sinks: list[str] = []
    for info, node in zip(cap.outputs, out_nodes):
        if not isinstance(node, fx.Node):
            continue
        if info.kind in ("buffer_update", "user", "extra_fw"):
            fw_outputs.append(node.name)
            if info.kind == "user":
                user_outputs.append(node.name)
                if info.index not in cap.output_use.dropped:
                    held_by_caller.add(node.name)
        else:
            sinks.append(node.name)
    random_nodes = {n.name for n in gm.graph.nodes if n.op == "call_function" and costs.values[n.name].is_random}
    live = _live_nodes(gm, set(fw_outputs) | set(sinks) | random_nodes)

    tangent_names = {n.name for n in tangent_nodes}
    depends_on_tangent: set[str] = set()
    for n in gm.graph.nodes:
        if n.name in tangent_names or any(i.name in depends_on_tangent for i in n.all_input_nodes):
            depends_on_tangent.add(n.name)

    overwritten = _overwritten_storages(cap, costs)
    G = nx.DiGraph()
    fx_map: dict[str, fx.Node] = {}
    rng_of: dict[str, str] = {}
    by_name = {n.name: n for n in gm.graph.nodes}

    def add_value(name: str, *, mem: int, cost: float, recomputable: bool, preds: list[str], alias_of: str | None,
                  same_storage: bool = False):
        attrs = dict(mem=int(mem), cost=float(cost), recomputable=recomputable)
        if alias_of is not None:
            attrs["alias_of"] = alias_of
            if same_storage:
                attrs["same_storage"] = True
        G.add_node(name, **attrs)
        for p in preds:
            G.add_edge(p, name)

    def add_backward_barrier():
        before = list(dict.fromkeys(fw_outputs))
        tangent_bytes = sum(costs.values[t.name].nbytes for t in tangent_nodes)
        if carry_limit is not None:
            limit, at_budget = carry_limit
            sources = sum(costs.values[n.name].nbytes for n in primal_nodes)
            # BACKWARD reads the reserve and makes the tangents: they are held together for a moment,
            # so the reserve leaves the tangents' room too, and the carried bytes meet the limit exactly
            add_value(CUT_RESERVE, mem=max(0, at_budget - sources - limit - tangent_bytes), cost=0.0,
                      recomputable=False, preds=before or [START], alias_of=None)
            before.append(CUT_RESERVE)
        add_value(
            BACKWARD,
            mem=tangent_bytes,
            cost=0.0,
            recomputable=False,
            preds=before,
            alias_of=None,
        )
        for t in tangent_nodes:
            nbytes = costs.values[t.name].nbytes
            add_value(t.name, mem=nbytes, cost=0.0, recomputable=False, preds=[BACKWARD], alias_of=BACKWARD)
            # autograd holds the output gradients it passes to backward() until backward returns
            add_value(t.name + USER_SUFFIX, mem=nbytes, cost=0.0, recomputable=False, preds=[t.name], alias_of=t.name,
                      same_storage=True)

    dropped_inputs = set(dropped_input_names(cap))
    for node in primal_nodes:
        # An input the caller lets go when forward returns: not a source (held to the end) but a
        # value made at the start (before every reader: it is there when the step begins) that
        # lives to the barrier and then as long as the backward reads it. It cannot be made
        # again, nor copied out (the caller holds it through the forward).
        let_go = node.name in dropped_inputs
        if let_go and START not in G:
            add_value(START, mem=0, cost=0.0, recomputable=False, preds=[], alias_of=None)
        # A paged parameter lives in host memory (`memplan.passes.paging`): its fetch is what holds device bytes.
        add_value(node.name, mem=0 if is_paged(node) else costs.values[node.name].nbytes, cost=0.0,
                  recomputable=False, preds=[START] if let_go else [], alias_of=None)
        fx_map[node.name] = node
    # Tensors the model holds outside its parameters and buffers (a closure's
    # target, a plain tensor attribute) are graph constants: inputs too.
    for node in gm.graph.nodes:
        if node.op == "get_attr" and value_name(node) not in G:
            add_value(value_name(node), mem=costs.values[node.name].nbytes, cost=0.0, recomputable=False, preds=[], alias_of=None)
    if START not in G:
        add_value(START, mem=0, cost=0.0, recomputable=False, preds=[], alias_of=None)
    barrier_added = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in live:
            continue
        if not barrier_added and node.name in depends_on_tangent:
            add_backward_barrier()
            barrier_added = True
        vc = costs.values[node.name]
        preds = list(dict.fromkeys(value_name(i) for i in node.all_input_nodes)) or [START]
        if vc.scratch:
            # What the op's kernel allocates for itself while it runs: a value only it reads, so a
            # schedule holds it for that compute (and each recomputation) and frees it right after.
            add_value(SCRATCH_PREFIX + node.name, mem=vc.scratch, cost=0.0, recomputable=True, preds=[START],
                      alias_of=None)
            preds.append(SCRATCH_PREFIX + node.name)
        if vc.is_random:
            rng = rng_of[node.name] = RNG_PREFIX + node.name
            add_value(rng, mem=RNG_STATE_BYTES.get(value_device(node).type, 16), cost=0.0, recomputable=False, preds=[START], alias_of=None)
            preds.append(rng)
        add_value(
            node.name,
            mem=vc.nbytes,
            cost=vc.time,
            recomputable=not _reads_overwritten(node, costs, overwritten),
            preds=preds,
            alias_of=value_name(by_name[vc.alias_of]) if vc.alias_of is not None else None,
            # A view of all its base's storage (not one output of a multi-output op):
            # its siblings from the same base share those bytes.
            same_storage=vc.alias_of is not None and set(vc.storages) == set(costs.values[vc.alias_of].storages),
        )
        fx_map[node.name] = node
        if node.name in user_outputs:
            returned = node.name + RETURNED_SUFFIX
            add_value(returned, mem=vc.nbytes, cost=0.0, recomputable=False, preds=[node.name],
                      alias_of=node.name, same_storage=True)
            # One the caller drops before backward (memplan.passes.output_use) is let go at the barrier.
            if node.name in held_by_caller:
                add_value(node.name + USER_SUFFIX, mem=vc.nbytes, cost=0.0, recomputable=False, preds=[returned],
                          alias_of=returned, same_storage=True)
    if not barrier_added:
        add_backward_barrier()
    # The caller holds each output from the moment forward() returns it. A sink alone would let a
    # plan drop the output and take the reference only at the end (the step then measures above
    # its prediction), so the reference is taken before BACKWARD too; neither node can be
    # recomputed, so the storage stays resident from then to the end.
    for name in user_outputs:
        if name + RETURNED_SUFFIX in G:
            G.add_edge(name + RETURNED_SUFFIX, BACKWARD)
    for name in dropped_inputs:  # the caller holds it until forward returns: a copy to the host frees nothing
        G.add_edge(name, BACKWARD)
        G.nodes[name]["offloadable"] = False
    for t in tangent_nodes:
        fx_map[t.name] = t
    G, update_nodes, param_nodes = _add_updates(G, cap, primal_nodes, updates, placement)
    norm_pass: dict[str, str] = {}
    if placement.norm_pass:
        G, norm_pass = _add_norm_pass(G, update_nodes, tangent_names, updates)
    fx_map.update((copy, fx_map[original]) for copy, original in norm_pass.items())
    # Bookkeeping values (the backward barrier, generator states) have no tensor the runtime could copy.
    for name in G.nodes:
        if name not in fx_map:
            G.nodes[name]["offloadable"] = False
    problem = solvers.Problem.from_networkx(G, budget if budget is not None else _unbounded(G))
    return Lowered(
        problem=problem,
        graph=G,
        fx_nodes=fx_map,
        tangents=[t.name for t in tangent_nodes],
        sources=[n.name for n in primal_nodes],
        rng_of=rng_of,
        updates=update_nodes,
        param_nodes=param_nodes,
        placement=placement,
        norm_pass=norm_pass,
    )


def _add_updates(G: nx.DiGraph, cap: Capture, primal_nodes: list[fx.Node], updates: Sequence[ParamUpdate],
                 placement: UpdatePlacement) -> tuple[nx.DiGraph, list[tuple[str, str, str]], list[str]]:
    """``G`` with the optimizer's state and updates; (update node, gradient, parameter name) per
    updated parameter; and each one's parameter placeholder.

    The parameters are updated in buckets (`memplan.updates.buckets`: consecutive in the order their
    gradients are final in the Problem's order, up to ``placement.bucket_bytes``), one update node
    each: it reads every gradient, parameter and state of its bucket, and its value is the
    temporaries one optimizer call over the bucket allocates (`bucket_temp_bytes`), read at once
    by a zero-byte sink so that every update runs. Device state is a source (resident all step, as
    across steps). A bucket whose state is in host memory has no state nodes and no device
    temporaries; its host work (copies and the host's step) runs beside compute, as `UpdateRunner`
    runs it. With accumulation, each parameter's accumulated gradient is a source the update reads:
    held all step, as from the second micro-step on (less is held before it, and after the update).
    An update overwrites its parameters, which no computation may read after it. With
    ``after_backward`` every update waits for ``GRADS_FINAL``, which reads every sink of the
    step, so nothing can. Otherwise each update comes right after its bucket's last gradient in
    the Problem's order, and `updated_after_reads` moves the ones a schedule places too early.
    """
    grad_of = {info.index: node.name for info, node in zip(cap.outputs, cap.output_nodes())
               if info.kind == "grad" and isinstance(node, fx.Node)}
    # No gradient reaches a parameter: eager's optimizer skips it too.
    updates = [u for u in updates if u.primal in grad_of]
    if not updates:
        return G, [], []
    after_backward = placement.after_backward
    if after_backward:
        sinks = [v for v in G.nodes if G.out_degree(v) == 0 and G.in_degree(v) > 0]
        G.add_node(GRADS_FINAL, mem=0, cost=0.0, recomputable=False)
        G.add_edges_from((v, GRADS_FINAL) for v in sinks)
    position = {v: k for k, v in enumerate(G.nodes)}
    ready = sorted(updates, key=lambda u: (position[grad_of[u.primal]], u.primal))
    by_name = {u.name: u for u in ready}
    members = [BucketMember(u.name, u.grad_bytes, u.name in placement.host) for u in ready]
    out: list[tuple[str, str, str]] = []
    param_nodes: list[str] = []
    follows: dict[str, list[str]] = {}  # gradient -> the update and sink that follow it in the order
    written: dict[str, list[str]] = {}  # update node -> the parameter placeholders it overwrites
    for bucket in bucket_updates(members, placement.bucket_bytes):
        group = [by_name[name] for name in bucket]
        params = [primal_nodes[u.primal].name for u in group]
        grads = [grad_of[u.primal] for u in group]
        update = UPDATE_PREFIX + params[0] + (f"+{len(params) - 1}" if len(params) > 1 else "")
        written[update] = params
        if group[0].name in placement.host:
            # The host's work overlaps compute, on a stream of its own (solvers.Problem.host_work).
            G.add_node(update, mem=0, cost=sum(u.host_launch for u in group), host_work=host_bucket_time(group),
                       recomputable=False)
        else:
            G.add_node(update, mem=bucket_temp_bytes(group), cost=bucket_time(group), recomputable=False)
            for u, param in zip(group, params):
                G.add_node(STATE_PREFIX + param, mem=u.state_bytes, cost=0.0, recomputable=False)
                G.add_edge(STATE_PREFIX + param, update)
        for u, param, grad in zip(group, params, grads):
            G.add_edges_from([(grad, update), (param, update)])
            if placement.accumulate_steps > 1:
                # (a paged parameter's sum is held in host memory, beside it)
                G.add_node(ACCUM_PREFIX + param, mem=0 if u.paged else u.grad_bytes, cost=0.0, recomputable=False)
                G.add_edge(ACCUM_PREFIX + param, update)
            out.append((update, grad, u.name))
            param_nodes.append(param)
        if after_backward:
            G.add_edge(GRADS_FINAL, update)
        G.add_node(update + UPDATED_SUFFIX, mem=0, cost=0.0, recomputable=False)
        G.add_edge(update, update + UPDATED_SUFFIX)
        follows.setdefault(grads[-1], []).extend([update, update + UPDATED_SUFFIX])
    if after_backward:
        return G, out, param_nodes
    fetches = {n.name for n in cap.graph_module.graph.find_nodes(op="call_function", target=FETCH)}
    for reader, tokens in _add_read_tokens(G, written, fetches).items():
        follows.setdefault(reader, []).extend(tokens)  # each token right after its reader
    # The Problem's order is G's insertion order: the states first, with the other sources (the
    # coarsening takes every source to come before what reads it), each update right after its
    # bucket's last gradient.
    states = [v for v in G.nodes if v.startswith((STATE_PREFIX, ACCUM_PREFIX))]
    moved = set(states).union(*follows.values())
    order = states + [w for v in G.nodes if v not in moved for w in (v, *follows.get(v, ()))]
    H = nx.DiGraph()
    H.add_nodes_from((v, G.nodes[v]) for v in order)
    H.add_edges_from(G.edges)
    return H, out, param_nodes


READ_PREFIX = "read:"  # a zero-byte token: this backward read of a parameter is done


def _add_read_tokens(G: nx.DiGraph, buckets: dict[str, list[str]], fetches: set[str]) -> dict[str, list[str]]:
    """Make each update in backward wait (in ``G``, in place) for the backward reads of its
    parameters (``buckets``: update node -> the parameter placeholders it overwrites), of their
    views, and of the copies ``fetches`` makes of paged ones (`memplan.passes.paging`): a copy
    fetched again for a backward reader must be fetched before the update writes the parameter.

    An update overwrites its parameter, but it does not read what the parameter's other readers
    compute (``dX = dY @ W`` next to ``dW``), so no edge says it must come after them: a solver
    would place it right after its gradient, and `updated_after_reads` would then move it later,
    the gradient and temporaries held longer than the solver planned (a plan over its budget).
    A zero-byte token per backward reader, read by the update, says it instead; the token is
    computed as soon as its reader is, so it holds nothing. A recomputation of a reader after
    the update is still possible in the Problem; `updated_after_reads` and the runtime's check
    keep that case exact. Returns each reader's tokens."""
    backward = nx.descendants(G, BACKWARD)
    tokens: dict[str, list[str]] = {}
    for update, params in buckets.items():
        views, stack = set(params), list(params)
        while stack:  # the parameters and every view of them
            v = stack.pop()
            for s in G.successors(v):
                if (G.nodes[s].get("alias_of") == v or s in fetches) and s not in views:
                    views.add(s)
                    stack.append(s)
        readers = {s for v in views for s in G.successors(v)
                   if s in backward and s not in views and s != update and not s.startswith(READ_PREFIX)}
        for reader in sorted(readers):
            token = f"{READ_PREFIX}{reader}>{update[len(UPDATE_PREFIX):]}"
            G.add_node(token, mem=0, cost=0.0, recomputable=False)
            G.add_edges_from([(reader, token), (token, update)])
            tokens.setdefault(reader, []).append(token)
    return tokens


def _add_norm_pass(G: nx.DiGraph, update_nodes: list[tuple[str, str, str]], tangents: set[str],
                   updates: Sequence[ParamUpdate]) -> tuple[nx.DiGraph, dict[str, str]]:
    """``G`` with a first backward pass that only computes the gradients' global norm, for
    clipping without holding every gradient (LOMO's two passes), placed in the order before the
    backward it repeats; and its values (copy -> original).

    Every backward value some updated gradient needs is there again under ``NORM_PASS_PREFIX``,
    reading the forward's values and the tangents as the original does; each copied gradient is
    read by a ``SQUARE_PREFIX`` step (its square added to the norm: a device scalar, counted as
    nothing), which frees it; ``NORM_FINAL`` reads them all, and every update waits for it. The
    solver then decides, as for any value, what of the forward both passes keep or recompute."""
    backward = nx.descendants(G, BACKWARD) - tangents
    grads = {grad for _, grad, _ in update_nodes}
    needed = set(grads)
    for grad in grads:
        needed |= nx.ancestors(G, grad)
    copied = [v for v in G.nodes if v in backward and v in needed and not is_reference(v)]
    if any(u.startswith(RNG_PREFIX) for v in copied for u in G.predecessors(v)):
        raise ValueError("memplan: a norm pass cannot recompute a random op of backward")
    in_pass = set(copied)
    for v in copied:
        attrs = dict(G.nodes[v])
        if attrs.get("alias_of") in in_pass:
            attrs["alias_of"] = NORM_PASS_PREFIX + attrs["alias_of"]
        G.add_node(NORM_PASS_PREFIX + v, **attrs)
    for v in copied:
        G.add_edges_from((NORM_PASS_PREFIX + u if u in in_pass else u, NORM_PASS_PREFIX + v)
                         for u in G.predecessors(v) if not u.startswith(NORM_PASS_PREFIX))
    time_of = {u.name: u.time for u in updates}
    G.add_node(NORM_FINAL, mem=0, cost=0.0, recomputable=False)
    squares: list[str] = []
    for update, grad, name in update_nodes:
        square = SQUARE_PREFIX + update  # one per bucket: its gradients' norms in one call
        if square not in G:
            G.add_node(square, mem=0, cost=0.0, recomputable=False)
            G.add_edges_from([(square, NORM_FINAL), (NORM_FINAL, update)])
            squares.append(square)
        # Reading one gradient, about a fifth of an update's traffic (which reads and writes five).
        G.nodes[square]["cost"] += time_of[name] / 5
        source = NORM_PASS_PREFIX + grad if grad in in_pass else grad  # one no tangent reaches: as it is
        G.add_edge(source, square)
    # The Problem's order is G's: the pass right before the first backward value it repeats.
    block = [NORM_PASS_PREFIX + v for v in copied] + squares + [NORM_FINAL]
    in_block = set(block)
    rest = [v for v in G.nodes if v not in in_block]
    at = rest.index(copied[0]) if copied else len(rest)
    order = rest[:at] + block + rest[at:]
    H = nx.DiGraph()
    H.add_nodes_from((v, G.nodes[v]) for v in order)
    H.add_edges_from(G.edges)
    return H, {NORM_PASS_PREFIX + v: v for v in copied}


def updated_after_reads(low: Lowered, problem: "solvers.Problem", schedule: "solvers.Schedule") -> "solvers.Schedule":
    """``schedule`` with each optimizer update moved after the last computation that reads its
    parameter (`solvers.transforms.ordering`): the update overwrites the parameter in place."""
    if not low.updates:
        return schedule
    return after_last_reads(problem, schedule, low.parameter_writes)


def updates_after_reads_within(low: Lowered, problem: "solvers.Problem",
                               schedule: "solvers.Schedule") -> "solvers.Schedule":
    """``schedule`` with each optimizer update after the last read of its parameter, which it
    overwrites (`updated_after_reads`), and back under the budget where that moved an update past a
    recomputed read: the update's gradient and temporaries are then held longer than the solver
    planned (a 1.3B-parameter GPT's 530 s search: 16.33 GB against 16 GB). Values are recomputed
    down to the budget again (`add_recomputations`, `TUNABLES.reorder_repair_seconds` in all) and the
    updates moved again, while that lowers the peak; a schedule still over fails the plan's validation."""
    solved = schedule
    schedule = updated_after_reads(low, problem, schedule)
    if not low.updates or schedule.steps == solved.steps:
        return schedule  # (nothing moved: the solver's schedule fits as it is)
    deadline = time.perf_counter() + TUNABLES.reorder_repair_seconds
    peak = solvers.simulate(problem, list(schedule.steps)).peak
    for _ in range(REORDER_REPAIR_ROUNDS):
        if peak <= problem.budget or time.perf_counter() >= deadline:
            break
        repaired = updated_after_reads(low, problem, add_recomputations(problem, schedule, deadline))
        lower = solvers.simulate(problem, list(repaired.steps)).peak
        if lower >= peak:
            break  # (the repair is deterministic: another round would do the same)
        schedule, peak = repaired, lower
    return schedule


REORDER_REPAIR_ROUNDS = 4  # (the 1.3B GPT's schedule fitted after two)


def _unbounded(G: nx.DiGraph) -> int:
    return int(sum(d["mem"] for _, d in G.nodes(data=True))) + 1
