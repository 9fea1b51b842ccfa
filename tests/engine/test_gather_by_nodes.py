"""A flat layout over several nodes gathers across them, then within each (issue 40, item 5):
gloo's broadcasts (binomial trees) sent 2.5x a gather's bytes across the nodes on 2 nodes x 2,
where FSDP2's ring all-gather sends 1.5x. ``transport.GatherByNodes`` sends each shard into
each other node once. The nodes are torchrun's environment (WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK), set in each rank of one host as torchrun sets it on each node; reading each
other's memory is off, as it is between real nodes.

Checked: the same bits as the broadcasts (training, both doors, 2x2, 2x1, 3x1), the same bytes
counted (``comm_report`` and the plan are unchanged), and each link's bytes, counted where each
message is sent (``CommCounter.link_bytes``), equal to the formula below and below FSDP2's.
"""

from __future__ import annotations

import os

import pytest
from torch import nn

import zerocore
from tests.support.environ import environment
from tests.support.toy_stack import Spec, make_layers, train_digest

# fp32, accumulation and clipping: every gather of a step (forward, backward, the norm's).
SPEC = Spec(model="transformer", steps=2, micro=2, max_norm=0.5)
NODE_SHAPES = [(2, 2), (2, 1), (3, 1)]   # (nodes, ranks per node)
TORCHRUN = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def torchrun_env(rank: int, nodes: int, per_node: int) -> dict[str, str]:
    return dict(WORLD_SIZE=str(nodes * per_node), LOCAL_WORLD_SIZE=str(per_node),
                GROUP_RANK=str(rank // per_node))


def shard(door: str, gather: str):
    """(the model, its sharding) of SPEC's stack, flat, gloo's transport (no reading)."""
    comm = zerocore.Comm(peer_read="off", gather=gather)
    layers = make_layers(SPEC)
    if door == "shard":
        model = zerocore.shard(layers, comm=comm)
        return model, model
    model = nn.Sequential(*layers)
    return model, zerocore.shard_model(model, [model[1], model[2]], comm=comm)


def trained(rank: int, world_size: int, door: str, gather: str, per_node: int) -> dict:
    with environment(torchrun_env(rank, world_size // per_node, per_node)):
        model, sharding = shard(door, gather)
    out = train_digest(model, SPEC, rank, world_size, sharding=sharding)
    report = sharding.comm_report()
    out.update(ways=report.ways, gathered=report.all_gather_bytes,
               reduced=report.reduce_scatter_bytes, inter=report.inter_node_bytes,
               links=dict(sharding.counter.link_bytes))
    return out


# Both doors on 2 x 2 (a node of two: both steps); the others' shapes through one.
@pytest.mark.parametrize("door, nodes, per_node", [("shard_model", 2, 2)] + [
    ("shard", *shape) for shape in NODE_SHAPES])
def test_gathering_by_nodes_trains_as_the_broadcasts_do(worlds, door, nodes, per_node):
    world = worlds(nodes * per_node)
    by_nodes = world.run(trained, door, "auto", per_node)
    broadcasts = world.run(trained, door, "collective", per_node)
    for a, b in zip(by_nodes, broadcasts):
        assert a["ways"].startswith("gather: nodes;") and b["ways"].startswith("gather: coll")
        assert a["digest"] == b["digest"]
        # What is counted is the collective's buffer, whatever the way: the report (and the
        # plan, which predicts it) did not change.
        assert (a["gathered"], a["reduced"], a["inter"]) == \
               (b["gathered"], b["reduced"], b["inter"])
        assert b["links"] == {}  # the backend's collectives choose their own links


@pytest.mark.parametrize("nodes, per_node", NODE_SHAPES)
def test_each_shard_crosses_into_each_other_node_once(worlds, nodes, per_node):
    world_size = nodes * per_node
    runs = worlds(world_size).run(trained, "shard", "nodes", per_node)
    gathered = runs[0]["gathered"]   # B summed over the step's gathers: every rank's alike
    assert all(r["gathered"] == gathered for r in runs)
    links: dict[tuple[int, int], int] = {}
    for r in runs:
        assert not set(links) & set(r["links"])  # each rank counts what it sends
        links.update(r["links"])
    node = [g // per_node for g in range(world_size)]
    across = {k: v for k, v in links.items() if node[k[0]] != node[k[1]]}
    within = {k: v for k, v in links.items() if node[k[0]] == node[k[1]]}
    # A gather of B bytes over N = R·S ranks (b = B/N a shard): across the nodes each rank
    # sends its shard to the R-1 ranks of its column, (R-1)·b, and nothing else; within, each
    # sends its column's R shards to the S-1 others of its node, R·(S-1)·b. Per rank
    # (N-1)·b in all, an all-gather's; across the nodes ·B in all, the least any gather
    # can send (each node lacks (R-1)/R·B).
    shard_bytes = gathered // world_size
    assert set(across) == {(g, h) for g in range(world_size) for h in range(world_size)
                           if g % per_node == h % per_node and g != h}
    assert set(across.values()) == {shard_bytes}
    assert sum(across.values()) == (nodes - 1) * gathered
    assert sum(within.values()) == world_size * nodes * (per_node - 1) * shard_bytes
    for g in range(world_size):
        assert sum(v for (a, _), v in links.items() if a == g) == (world_size - 1) * shard_bytes
    # FSDP2's all-gather on gloo, a ring in rank order: (N-1)·b over each link, R of which
    # cross a node boundary.
    ring = nodes * (world_size - 1) * shard_bytes
    assert sum(across.values()) <= ring
    assert max(across.values()) <= (world_size - 1) * shard_bytes


def refused(rank: int, world_size: int, env: dict[str, str], only_rank: int | None = None
            ) -> str:
    """The message of sharding flat asking for the gather by nodes (``only_rank``: the
    environment set on that rank alone, the others without torchrun's)."""
    env = env if only_rank in (None, rank) else {}
    with environment(env, also=TORCHRUN):
        for k in set(TORCHRUN) - set(env):
            os.environ.pop(k, None)
        try:
            shard("shard", "nodes")
        except ValueError as e:
            return str(e)
    return "not refused"


def test_gathering_by_nodes_on_one_node_is_refused_on_every_rank(worlds):
    one_node = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    for env in (one_node, {}):
        for message in worlds(2).run(refused, env):
            assert "Comm(gather='nodes') needs a flat layout of gloo ranks on the CPU over two " \
                   "or more torchrun nodes" in message, message


def test_ranks_told_other_nodes_are_refused_on_every_rank(worlds):
    # The way is chosen from the nodes, so the ranks agree on them with the mesh first: a rank
    # whose environment says other nodes would otherwise gather by other messages and wait
    # for ones never sent until the timeout.
    two_nodes = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
    for rank, message in enumerate(worlds(2).run(refused, {**two_nodes, "GROUP_RANK": "0"}, 0)):
        assert message == ("zerocore.shard: mesh differs across ranks: rank 0: 'flat (1, 2) "
                           "((0, 1),) group over 2 nodes'; rank 1: 'flat (1, 2) ((0, 1),) "
                           "group'; every rank must pass the same meshes"), (rank, message)
