"""Train with memplan inside FSDP2, each rank under its own budget.

    torchrun --nproc-per-node 2 examples/fsdp_train.py            # CPU, gloo
    torchrun --nproc-per-node 8 examples/fsdp_train.py --budget 16GB --backend nccl

The recipe is plain FSDP2's but for one line: ``memplan.fully_shard`` takes the place of the
``fully_shard`` calls on the blocks and on the model. It shards them as those calls do and plans
each block under the rank's budget, which counts the shards, the optimizer's state (the optimizer
is made before, over the unsharded model, and memplan points it at the shards), the blocks'
gathered parameters and the loss computed after the last block.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import memplan
from memplan.models import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="4MB", help="per rank, in bytes or as '16GB'")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial parameters on every rank
    zm = zoo.build("gpt", size="tiny", batch_size=8, device=device or "cpu", overrides={"dropout": 0.0})
    model = memplan.WithLoss(zm.model, zm.loss_fn)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The one line memplan adds, in place of fully_shard(block) for each block and fully_shard(model).
    model = memplan.fully_shard(model, args.budget, optimizer=optimizer)

    generator = torch.Generator().manual_seed(rank)  # each rank its own batches
    tokens, *rest = zm.example_inputs
    for step in range(args.steps):
        batch = torch.randint(0, 64, tokens.shape, generator=generator).to(tokens.device)
        loss = model(batch, *rest)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(model.memplan_backend.report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
