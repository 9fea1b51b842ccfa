"""HSDP under torchrun, as two nodes: two torchrun agents on this machine (``--nnodes 2
--nproc-per-node 2``, c10d rendezvous on 127.0.0.1), each starting two gloo ranks that run this
module (``python -m``). Each rank shards the toy transformer flat, then over a 2-D CPU mesh
``(2, 2)``, and trains the HSDP model with accumulation; rank 0 writes what they saw.

What it shows that the in-process tests (test_hsdp.py) cannot: torchrun numbers the ranks so that
a mesh's shard dim is one node's ranks (each shard group's ranks have one ``GROUP_RANK``); the
start-up line of a flat layout says it spans two nodes (read from torchrun's environment); and
the replicas end bitwise equal.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from tests.support.toy_stack import LR, Spec, global_batch, loss_fn, make_layers
from tests.support.two_nodes import run_two_nodes
from tests.support.zerocore_log import logged

SPEC = Spec(model="transformer", steps=2, micro=2)
# Two agents rendezvous, then four ranks import torch and zerocore on a loaded 2-core machine.
TIMEOUT_S = 400


def rank_main(out: str) -> None:
    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    flat, flat_lines = logged(lambda: zerocore.shard(make_layers(SPEC)))
    del flat  # (only its start-up line is looked at)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model, hsdp_lines = logged(lambda: zerocore.shard(make_layers(SPEC), mesh=mesh))
    # The node of every rank of this rank's shard group.
    nodes = [None] * model.world_size
    dist.all_gather_object(nodes, os.environ["GROUP_RANK"], group=model.group)
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR)
    for step in range(SPEC.steps):
        for m in range(SPEC.micro):
            model.set_requires_all_reduce(m == SPEC.micro - 1)
            x, y = global_batch(SPEC, step, m, world)
            loss = loss_fn(SPEC, model(x.chunk(world)[rank]), y.chunk(world)[rank])
            (loss / SPEC.micro).backward()
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256()
    for shard in model.trainable_shards():
        h.update(shard.detach().numpy().tobytes())
    digests = [None] * world
    dist.all_gather_object(digests, (model.rank, h.hexdigest()))
    report = model.comm_report()
    if rank == 0:
        Path(out).write_text(json.dumps(dict(
            flat=flat_lines, hsdp=hsdp_lines, nodes=nodes, digests=digests,
            inter=report.inter_node_bytes, expected=report.expected_replica_all_reduce_bytes,
            steps=SPEC.steps)))
    # Every model released before the group is destroyed: a model is freed by the cycle
    # collector, and gloo torn down under a live one at interpreter exit can abort the process
    # ("terminate called without an active exception": one CI run, rank 3, after a good run).
    del model, opt
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.distributed
def test_hsdp_under_two_torchrun_agents(tmp_path):
    out = tmp_path / "result.json"
    agents = run_two_nodes(["-m", "tests.engine.test_hsdp_torchrun", out], timeout=TIMEOUT_S)
    assert agents.codes == [0, 0], agents.output[-6000:]
    got = json.loads(out.read_text())
    # The flat layout over the two agents says so; the mesh's says HSDP.
    assert len(got["flat"]) == 1 and ("layout: flat over 4 ranks on 2 nodes (torchrun)"
                                      in got["flat"][0]), got["flat"]
    assert len(got["hsdp"]) == 1 and "layout: HSDP 2x2" in got["hsdp"][0], got["hsdp"]
    # Rank 0's shard group is one node's ranks.
    assert len(set(got["nodes"])) == 1, got["nodes"]
    # The replicas: ranks with the same place in the shard dim hold the same bits.
    by_place: dict[int, set[str]] = {}
    for place, digest in got["digests"]:
        by_place.setdefault(place, set()).add(digest)
    assert sorted(by_place) == [0, 1] and all(len(d) == 1 for d in by_place.values()), got
    assert got["inter"] == got["steps"] * got["expected"] > 0


if __name__ == "__main__":
    rank_main(sys.argv[1])
