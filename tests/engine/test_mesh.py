"""``mesh=`` on both front doors: a 1-D ``DeviceMesh`` shards as ``group=`` does, to the bit, at
world sizes 1-3; and the meshes zerocore cannot take are refused on every rank, in one line,
before anything is allocated (a mesh and a group, a 3-D mesh, meshes that differ between ranks,
a mesh made for another kind of device than the model computes on, a node shape that does not
divide the world: ``zerocore.node_mesh``). HSDP's training is tests/engine/test_hsdp.py's.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from tests.support.environ import environment
from tests.support.toy_stack import Spec, make_layers, train_digest
from tests.support.zerocore_log import logged

WORLD_SIZES = [1, 2, 3]
DOORS = ["shard", "shard_model"]
# fp32 with accumulation and clipping: every path of a step (the flat engine's).
SPEC = Spec(model="transformer", steps=3, micro=2, max_norm=0.5)
# What a GPU machine would say (``shard(platform=)``), to reach the device check on this CPU.
GPU_HOST = zerocore.Platform(host="gpu-host", torch_cuda="12.4", cuda_device_count=8,
                             kernels_cuda=True, device_uuid=None, usable_cores=64)


def _shard(door: str, **where):
    """(the model, its sharding) of SPEC's stack through a front door."""
    layers = make_layers(SPEC)
    if door == "shard":
        model = zerocore.shard(layers, **where)
        return model, model
    model = nn.Sequential(*layers)
    return model, zerocore.shard_model(model, [model[1], model[2]], **where)


def digest(rank: int, world_size: int, door: str, how: str) -> dict:
    where = {"mesh": init_device_mesh("cpu", (world_size,))} if how == "mesh" else {}
    model, sharding = _shard(door, **where)
    return train_digest(model, SPEC, rank, world_size, sharding=sharding)


@pytest.mark.parametrize("door", DOORS)
def test_a_1d_mesh_shards_as_its_group_does(world, door):
    assert world.run(digest, door, "mesh") == world.run(digest, door, "group")


def refusal(rank: int, world_size: int, door: str, how: str) -> str:
    where: dict = {}
    if how == "both":
        where = dict(mesh=init_device_mesh("cpu", (world_size,)),
                     group=torch.distributed.group.WORLD)
    elif how == "3-D":
        where = dict(mesh=init_device_mesh("cpu", (1, 1, world_size)))
    elif how == "not a mesh":
        where = dict(mesh=(1, world_size))
    elif how == "device":
        where = dict(mesh=init_device_mesh("cpu", (world_size,)), device="cuda",
                     platform=GPU_HOST)
    elif how == "cuda mesh":
        # torch builds a "cuda" mesh over gloo's CPU groups without complaint; the model
        # computes where the group's backend says (the CPU), and the mesh alone says otherwise.
        where = dict(mesh=init_device_mesh("cuda", (world_size,)))
    elif how == "differ":
        # Every rank builds both meshes (building one is collective); rank 0 passes the other.
        hsdp = init_device_mesh("cpu", (2, world_size // 2))
        flat = init_device_mesh("cpu", (1, world_size))
        where = dict(mesh=flat if rank == 0 else hsdp)
    elif how == "differ device":
        # The same shape made for another device on rank 0: refused by every rank together,
        # not by rank 0 alone while the others wait for it.
        cuda, cpu = init_device_mesh("cuda", (world_size,)), init_device_mesh("cpu", (world_size,))
        where = dict(mesh=cuda if rank == 0 else cpu)
    try:
        _shard(door, **where)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "built"


REFUSALS = {
    "both": r"ValueError: zerocore\.{door}: give group= or mesh=, not both",
    "3-D": r"ValueError: zerocore\.{door}: mesh has 3 dims \(1, 1, \d\); zerocore takes a 1-D "
           r"mesh \(shard\) or a 2-D one \(replicate, shard\)",
    "not a mesh": r"TypeError: zerocore\.{door}: mesh must be a torch\.distributed\.device_mesh"
                  r"\.DeviceMesh",
    "device": r"ValueError: zerocore\.{door}: the mesh was made for 'cpu' but the model "
              r"computes on 'cuda'",
    "cuda mesh": r"ValueError: zerocore\.{door}: the mesh was made for 'cuda' but the model "
                 r"computes on 'cpu' \(from the process group's backend, or device=\); build the "
                 r"mesh with init_device_mesh\('cpu', \.\.\.\)$",
}


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_a_mesh_zerocore_cannot_take_is_refused_on_every_rank(world, door, how):
    for message in world.run(refusal, door, how):
        assert "\n" not in message
        assert re.match(REFUSALS[how].format(door=door), message), message


@pytest.mark.parametrize("door", DOORS)
def test_meshes_differing_between_ranks_are_refused_on_every_rank(worlds, door):
    messages = worlds(4).run(refusal, door, "differ")
    for m in messages:
        assert m == (f"ValuesDiffer: zerocore.{door}: mesh differs across ranks: rank 0: "
                     f"'hsdp (1, 4) ((0, 1, 2, 3),) cpu'; ranks 1-3: 'hsdp (2, 2) ((0, 1), "
                     f"(2, 3)) cpu'; every rank must pass the same meshes"), m


def _unordered(rank: int, world_size: int, door: str, hybrid: str | None) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    grid = [[1, 0]] if world_size == 2 else [[0, 3], [2, 1]]
    mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("replicate", "shard"))
    try:
        _shard(door, mesh=mesh, **({"hybrid": zerocore.Hybrid(hybrid)} if hybrid else {}))
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("world_size, hybrid", [(2, None), (4, None), (4, "hpz")])
@pytest.mark.parametrize("door", DOORS)
def test_a_mesh_whose_rows_or_columns_are_not_increasing_is_refused(worlds, door, world_size,
                                                                    hybrid):
    """torch numbers a group's ranks in increasing order: in a mesh laid out otherwise, ranks
    would hold other slices than the layout gives them (measured: hpZ's loss off by 1e-2 in
    4 steps, two ranks owning one slice). Refused on every rank."""
    grid = "[[1, 0]]" if world_size == 2 else "[[0, 3], [2, 1]]"
    for m in worlds(world_size).run(_unordered, door, hybrid):
        assert m.startswith(f"zerocore.{door}: the mesh {grid} does not number its ranks in "
                            f"increasing order"), m


@pytest.mark.parametrize("door", DOORS)
def test_a_mesh_for_another_device_on_one_rank_is_refused_on_every_rank(worlds, door):
    """Rank 0's mesh alone is made for "cuda": its refusal travels with the ranks' devices
    (agree_on_devices), so the others raise it too instead of waiting for rank 0."""
    for m in worlds(3).run(refusal, door, "differ device"):
        assert m == (f"ValueError: zerocore.{door}: the mesh was made for 'cuda' but the model "
                     f"computes on 'cpu' (from the process group's backend, or device=); build "
                     f"the mesh with init_device_mesh('cpu', ...) (ranks 0)"), m


def start_up_line(rank: int, world_size: int, environ: dict, shape) -> str | None:
    """The line rank 0 logs when sharding, under a launcher's environment (as torchrun sets
    it; restored after)."""
    with environment(environ):
        where = {"mesh": init_device_mesh("cpu", shape)} if shape is not None else {}
        _, records = logged(lambda: _shard("shard", **where))
    return records[0] if records else None


def test_the_start_up_line_names_the_layout(worlds):
    world = worlds(4)
    torchrun = dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    flat = world.run(start_up_line, torchrun, None)
    assert flat[1:] == [None, None, None]  # rank 0 says it, once
    assert ("zerocore.shard: 4 ranks on cpu; layout: flat over 4 ranks on 2 nodes (torchrun): "
            "every gather and reduction spans the nodes; pass mesh=init_device_mesh(device, "
            "(2, 2), mesh_dim_names=('replicate', 'shard')) for hybrid sharding (HSDP); "
            "gather: ") in flat[0], flat[0]
    hsdp = world.run(start_up_line, torchrun, (2, 2))
    assert ("zerocore.shard: 4 ranks on cpu; layout: HSDP 2x2: sharded within each group of 2 "
            "(a node), gathered there; gradient shards all-reduced across the 2 replicas; "
            "gather: ") in hsdp[0], hsdp[0]
    alone = world.run(start_up_line, {}, None)
    assert "; layout: flat over 4 ranks; gather: " in alone[0], alone[0]


def node_meshes(rank: int, world_size: int, nodes: int) -> str | tuple:
    """``zerocore.node_mesh("cpu", nodes)``'s mesh (its shape, rows and dim names), or its
    refusal; beside what torch's own ``init_device_mesh`` does with that shape."""
    try:
        torch_says = init_device_mesh("cpu", (nodes, world_size // nodes)).mesh.tolist()
    except RuntimeError as e:
        torch_says = f"RuntimeError: {e}"
    try:
        mesh = zerocore.node_mesh("cpu", nodes)
    except ValueError as e:
        return f"ValueError: {e}", torch_says
    return (tuple(mesh.shape), mesh.mesh.tolist(), mesh.mesh_dim_names), torch_says


def test_a_node_mesh_is_torchruns_layout_or_refused_on_every_rank(worlds):
    world = worlds(4)
    for mesh, _ in world.run(node_meshes, 2):  # the ranks of a node are a row: torchrun's order
        assert mesh == ((2, 2), [[0, 1], [2, 3]], ("replicate", "shard"))
    for got, torch_says in world.run(node_meshes, 3):
        # Torch takes a (3, 1) mesh over 4 ranks and leaves rank 3 out, silently.
        assert torch_says == [[0], [1], [2]] or torch_says.startswith("RuntimeError"), torch_says
        assert got == ("ValueError: zerocore.node_mesh: 3 nodes do not divide the world of 4 "
                       "ranks: the shard dim (ranks per node) must divide the world; run as "
                       "many ranks on every node"), got


@pytest.mark.parametrize("environ, message", [
    ({}, "zerocore.from_environment: hybrid sharding takes its nodes from torchrun's environment "
         "(WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK), which this process does not have: start it "
         "with torchrun --nnodes N --nproc-per-node M, or pass a 2-D mesh"),
    (dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", GROUP_RANK="0"),
     "zerocore.from_environment: hybrid sharding replicates across nodes, and torchrun started "
     "one node (4 ranks): run with --nnodes 2 or more, or shard flat"),
    (dict(WORLD_SIZE="5", LOCAL_WORLD_SIZE="2", GROUP_RANK="1"),
     "zerocore.from_environment: LOCAL_WORLD_SIZE=2 does not divide WORLD_SIZE=5: the shard dim "
     "(ranks per node) must divide the world; run as many ranks on every node"),
])
def test_nodes_from_an_environment_that_has_none_are_refused(environ, message):
    # Read from the environment passed alone: refused before any collective.
    with pytest.raises(ValueError) as e:
        zerocore.mesh_from_environment("cpu", environ)
    assert str(e.value) == message
