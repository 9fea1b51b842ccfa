"""A rank of tests/engine/test_nvme_lifecycle.py, started by ``zerocore.tools.rank_processes``
(``run_ranks("tests.support.nvme_rank:rank_main", ...)``): it shards a small stack with its
optimizer on NVMe, trains a step, says it is ready (a file holding its pid), and once the test
says go (a file), ends as its task says: returns (a clean exit), waits to be stopped (SIGTERM to
the launcher), raises (the last rank fails), or is killed (the last rank, SIGKILL: what the
out-of-memory killer does)."""

from __future__ import annotations

import gc
import os
import signal
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerocore
from zerocore.tools import join_rendezvous
from zerocore.tools.rank_processes import receive, watch_launcher
from tests.support.toy_stack import Spec, accumulate_step, make_layers

SPEC = Spec(model="transformer", steps=1, param_dtype=torch.bfloat16)


def rank_main(rank: int, fd: int, launcher: int) -> None:
    link = socket.socket(fileno=fd)
    task = receive(link)
    watch_launcher(rank, link, launcher)
    torch.set_num_threads(1)
    join_rendezvous(task["port"], rank, task["world_size"], "gloo", timeout_s=1800)  # gloo default
    model = zerocore.shard(make_layers(SPEC),
                           mixed_precision=zerocore.MixedPrecision(torch.bfloat16),
                           offload=zerocore.Offload(optimizer="nvme", path=task["path"]))
    opt = zerocore.optim.AdamW(model.trainable_shards(), lr=1e-3)
    accumulate_step(model, SPEC, 0, rank, task["world_size"])
    opt.step()
    Path(task["ready"], f"rank{rank}").write_text(str(os.getpid()))
    end = task["end"]
    while end == "wait" or not os.path.exists(task["go"]):
        time.sleep(0.05)  # until the test has seen every rank's scratch (or is stopped)
    last = task["world_size"] - 1
    if rank == last and end == "raise":
        raise RuntimeError(f"rank {rank} fails (a test's failure)")
    if rank == last and end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # in the failing runs, the other rank waits here for the failed one
    del model, opt  # before the group (docs/decisions.md, "A group destroyed under a live model")
    gc.collect()
    dist.destroy_process_group()
