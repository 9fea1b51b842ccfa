"""A forward on one rank alone, across two torchrun agents (issue 39): two agents on this machine
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), each starting two gloo ranks
that run this module (``python -m``). The ranks shard the toy transformer over a 2-D CPU mesh
``(2, 2)`` (HSDP, or hpZ: one node per replica), train one agreed step, then the last rank (on
the second agent) runs a forward without autograd for a sample while the others go on training.

What it shows that the in-process tests (test_divergence.py) cannot: the ranks are numbered by
torchrun's rendezvous, each agent's ranks read each other's memory and reach the other node's
only through the whole mesh's exchange, and every rank of both agents refuses with the same
``Diverged`` naming what each was doing. ``zerocore.Comm``'s timeout is at its default (30
minutes), so a refusal within the test's bound cannot be the timeout's. Each rank writes what it
got; the ranks then leave normally (every rank left the same exchange, so the group still works).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from tests.support.toy_stack import LR, Spec, global_batch, loss_fn, make_layers
from tests.support.two_nodes import run_two_nodes

SPEC = Spec(model="transformer")
# Two agents rendezvous, then four ranks import torch and zerocore, shard and train one step on
# a loaded 2-core machine (about a minute); far below Comm's timeout (1800 s).
TIMEOUT_S = 400
ADVICE = "every rank must run the same forwards and backwards"


def rank_main(out: str, layout: str) -> None:
    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    hybrid = zerocore.Hybrid("hpz") if layout == "hpz" else None
    model = zerocore.shard(make_layers(SPEC), mesh=mesh, hybrid=hybrid)
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR)

    batches = [global_batch(SPEC, step, 0, world) for step in range(2)]
    x, y = batches[0]
    loss_fn(SPEC, model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()
    outcome = "no error"
    try:
        if rank == world - 1:  # a sample for the log, on this rank alone
            with torch.no_grad():
                model(global_batch(SPEC, 1, 0, 1)[0])
        x, y = batches[1]
        loss_fn(SPEC, model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    except Exception as e:  # noqa: BLE001  (what each rank got is the result)
        outcome = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.txt").write_text(outcome)
    del model, opt  # freed before the group is destroyed (test_hsdp_torchrun.py says why)
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
def test_a_forward_on_one_rank_across_two_torchrun_agents_is_refused_on_every_rank(
        tmp_path, layout):
    agents = run_two_nodes(["-m", "tests.engine.test_divergence_torchrun", tmp_path, layout],
                           timeout=TIMEOUT_S)
    assert agents.codes == [0, 0], agents.output[-6000:]
    for rank in range(4):
        outcome = (tmp_path / f"rank{rank}.txt").read_text()
        assert outcome.startswith("Diverged: zerocore: the ranks diverged"), (rank, outcome)
        assert "rank 3 gathers" in outcome, (rank, outcome)
        assert "a forward without autograd" in outcome, (rank, outcome)
        assert "ranks 0, 1, 2 gather" in outcome, (rank, outcome)
        assert "for forward of micro-batch 0" in outcome, (rank, outcome)
        assert ADVICE in outcome, (rank, outcome)
        assert "raise the timeout" not in outcome, (rank, outcome)


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
