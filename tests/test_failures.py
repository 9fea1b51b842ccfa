"""A rank that dies mid-training must not hang the others: they fail with an error within the
process group's timeout."""

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dist_utils import free_port

# The survivors must give up within this many seconds (the process group's timeout is 10 s; the
# rest is slack for a loaded 2-core machine).
BOUND_S = 60.0


def _rank(rank: int, port: int, results) -> None:
    import zerocore
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=10))
    torch.manual_seed(0)
    model = zerocore.shard([nn.Linear(8, 8), nn.Linear(8, 8)])
    if rank == 1:
        os._exit(3)  # dies without a word, as a killed process would
    start = time.monotonic()
    try:
        for _ in range(100):
            model(torch.randn(4, 8)).sum().backward()
        results.put(("no error", time.monotonic() - start))
    except Exception as e:  # gloo reports the lost peer (or the timeout) as RuntimeError
        results.put((type(e).__name__, time.monotonic() - start))


def test_dead_rank_gives_an_error_not_a_hang():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, seconds = results.get(timeout=BOUND_S + 120)  # + start-up of two interpreters
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert kind != "no error"
    assert seconds < BOUND_S
