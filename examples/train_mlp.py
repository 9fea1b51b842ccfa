"""Train a plain MLP stack with zerocore, ZeRO-3 sharded: one process per GPU over NCCL when GPUs
are visible, else 2 gloo processes on the CPU.

    python examples/train_mlp.py [--nproc N] [--steps 50] [--backend auto|gloo|nccl]
    torchrun --nproc-per-node 8 examples/train_mlp.py

Each rank keeps 1/N of every layer's parameters, gradients and Adam state; layers are all-gathered
just before they run and freed after. The same script works under torchrun (it joins the group).
"""

import argparse
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import zerocore


def make_layers(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)  # every rank builds the same initial weights
    layers = [nn.Sequential(nn.Linear(32, width), nn.GELU())]
    layers += [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
               for _ in range(depth)]
    layers += [nn.Linear(width, 1)]
    return layers


def init_distributed(rank: int, world_size: int, backend: str) -> None:
    """Joins the process group; with NCCL, first gives this process its own GPU."""
    if backend == "nccl":
        # Under torchrun LOCAL_RANK is this process's index on its machine (spawned here, the
        # rank is). The modulo serves launchers that show each process only its own GPU.
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        # device_id binds the group to that GPU: NCCL connects now, and zerocore.shard computes
        # there by default.
        dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(rank: int, world_size: int, port: int, steps: int, backend: str) -> None:
    if "RANK" not in os.environ:  # spawned here; under torchrun the environment is set already
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(rank, world_size, backend)
    try:
        run(rank, steps)
    finally:
        # After the model (which holds the group) is gone: a process group destroyed while
        # objects still use it can abort the process at exit. The model's objects refer to
        # each other, so returning from run() alone does not free them: collect them now.
        gc.collect()
        dist.destroy_process_group()


def run(rank: int, steps: int) -> None:
    model = zerocore.shard(make_layers(width=256, depth=4))  # on this rank's GPU with NCCL
    optimizer = zerocore.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scaler = zerocore.LossScaler(model.group, dynamic=False)  # global-norm clipping across ranks
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank draws its own batches
    target_fn = nn.Linear(32, 1)  # the function to learn, the same on every rank (seeded above)
    for step in range(steps):
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = torch.sin(target_fn(x))
        x, y = x.to(model.device), y.to(model.device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        result = scaler.step(optimizer, max_norm=1.0)
        if step == steps - 1:
            report = model.memory_report(optimizer)
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {result.grad_norm:.3f}")
    print(report.table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to spawn (default: one per GPU with NCCL, else 2)")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    parser.add_argument("--port", type=int, default=0,
                        help="rendezvous port (default: a free one)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="auto (default): nccl when a GPU is visible, else gloo")
    args = parser.parse_args()
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:  # torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args.steps, backend)
    else:
        nproc = args.nproc or (torch.cuda.device_count() if backend == "nccl" else 2)
        port = args.port or free_port()
        mp.spawn(train, args=(nproc, port, args.steps, backend), nprocs=nproc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
