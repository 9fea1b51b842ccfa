"""Starting gloo ranks on this host for a benchmark script, and collecting what each returns.

``run_ranks(fn, nproc, *args)`` spawns ``nproc`` processes, each calling ``fn(rank, nproc,
*args)`` inside its own gloo process group (on a free local port), and returns the results by
rank. ``fn`` must be importable (a module-level function of a script run as ``__main__``).
"""

from __future__ import annotations

import gc
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
               results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, fn(rank, world, *args)))
    finally:
        gc.collect()  # free what holds the group first (see examples/train_mlp.py)
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any,
              timeout_s: float = 1800) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, fn, args, results))
             for r in range(nproc)]
    for proc in procs:
        proc.start()
    by_rank = dict(results.get(timeout=timeout_s) for _ in procs)
    for proc in procs:
        proc.join()
    return [by_rank[r] for r in range(nproc)]
