"""Train with memplan inside DistributedDataParallel, each rank under its own budget.

    torchrun --nproc-per-node 2 examples/ddp_train.py            # CPU, gloo
    torchrun --nproc-per-node 8 examples/ddp_train.py --budget 16GB --backend nccl

The recipe is plain DDP's but for one line: the DDP module goes through ``memplan.optimize``,
which plans the model inside it (DDP's gradient buckets in the budget) and returns it.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import memplan
from memplan.models import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="100%", help="per rank: bytes, '16GB', or a share of the eager peak")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    zm = zoo.build("gpt", size="tiny", batch_size=8, device=device or "cpu", overrides={"dropout": 0.0})
    model = memplan.WithLoss(zm.model, zm.loss_fn)

    model = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The one line memplan adds. With example inputs rank 0 solves once and every rank runs its plan.
    model = memplan.optimize(model, args.budget, optimizer=optimizer, example_inputs=zm.example_inputs)

    generator = torch.Generator().manual_seed(rank)  # each rank its own batches
    tokens, *rest = zm.example_inputs
    for step in range(args.steps):
        batch = torch.randint(0, 64, tokens.shape, generator=generator).to(tokens.device)
        loss = model(batch, *rest)
        loss.backward()  # the updates run inside it, on the gradients DDP averaged
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(model.module.plan.report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
