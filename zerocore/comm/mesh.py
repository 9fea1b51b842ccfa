"""The ranks a sharded model spans, and how they share its state: ``Mesh`` is what zerocore reads
of a torch ``DeviceMesh`` (``shard(mesh=...)``, as FSDP2's ``fully_shard(mesh=)``) or of a
process group (``shard(group=...)``).

- flat (a group, or a 1-D mesh): parameters, gradients and optimizer state sharded over every
  rank, as ZeRO-3 does;
- HSDP (a 2-D mesh, dims ``(replicate, shard)``): sharded over the shard dim (the ranks of one
  node, when the mesh is laid out as torchrun numbers ranks) and replicated over the replicate
  dim: gathers and reduce-scatters stay in the shard group, and only each rank's gradient shard
  is all-reduced across its replicas (comm/transport.py, ``ReduceAcrossReplicas``);
- hpZ (a 2-D mesh with ``Hybrid("hpz")``): state sharded over every rank, rank (r, s) holding
  slice s·R + r of each flat group (``state_rank``), so that the replicate group of column s
  gathers, in its rank order, exactly slice s of S (the secondary shard, kept within the node
  from forward to backward) and the shard group then gathers the layer from those
  (comm/transport.py, ``AcrossNodes``).

Every check the ranks must agree on runs over ``whole``, the group of every rank of the mesh:
a row (shard group) and a column (replicate group) agreeing apart would leave the other rows
waiting when one refuses.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zerocore.comm.fake import fake_group
from zerocore.policies import Hybrid


@dataclasses.dataclass(frozen=True)
class Mesh:
    # The ranks a layer is gathered within and its gradients reduce-scattered within first:
    # flat and HSDP shard the state over it; hpZ over every rank (``state_group``).
    shard: dist.ProcessGroup
    # HSDP's replicas of the shards, hpZ's ranks of one shard column across the nodes; None:
    # flat, or one replica.
    replicate: dist.ProcessGroup | None
    whole: dist.ProcessGroup              # every rank of the mesh: where the ranks agree
    shape: tuple[int, int]                # (replicas, shards); flat: (1, ranks)
    # The nodes the job spans, by torchrun's environment (``nodes_of``), for the start-up
    # line; None when not launched so, or on one node.
    nodes: int | None = None
    # The global ranks of the mesh, row by row (one row per replica): what the ranks compare.
    ranks: tuple[tuple[int, ...], ...] = ()
    # The device type of the DeviceMesh given (``init_device_mesh``'s), None for a group.
    device_type: str | None = None
    layout: str = "flat"                  # "flat", "hsdp" or "hpz"

    @property
    def hybrid(self) -> bool:
        """Given as a 2-D mesh (a replicate dim of 1 included): HSDP or hpZ."""
        return self.layout != "flat"

    @property
    def replicas(self) -> int:
        return self.shape[0]

    @property
    def world_size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def hpz(self) -> bool:
        return self.layout == "hpz"

    @property
    def replicated(self) -> bool:
        """Whether ranks hold copies of each other's state (HSDP with more than one replica):
        then one replica's ranks alone write checkpoints."""
        return self.layout == "hsdp" and self.replicate is not None

    @property
    def state_group(self) -> dist.ProcessGroup:
        """The group the state (masters, gradients, optimizer state) is sharded over:
        ``model.group``, over which the gradient norm is summed (``LossScaler``)."""
        return self.whole if self.hpz else self.shard

    @property
    def state_size(self) -> int:
        return self.world_size if self.hpz else self.shape[1]

    @property
    def state_rank(self) -> int:
        """Which slice of each flat group this rank holds (``model.rank``): its rank in the
        shard group; with hpZ, s·R + r for its rank s in the shard group and r in the
        replicate group (see the module), which is not its rank in ``state_group``
        (``in_state_order`` reorders)."""
        if not self.hpz:
            return self.shard.rank()
        return self.shard.rank() * self.shape[0] + self.replicate.rank()

    def in_state_order(self, values: list) -> list:
        """``values``, one per rank of ``state_group`` in its rank order (an all-gather's),
        reordered by the slice each rank holds (``state_rank``): the identity except for hpZ,
        whose state group is the whole mesh. Every group's ranks are in global order (torch
        sorts a new group's ranks), so each rank's slice follows from the grid."""
        if not self.hpz:
            return list(values)
        rows = [sorted(row) for row in self.ranks]
        columns = [sorted(column) for column in zip(*self.ranks)]
        slice_of = {g: rows[i].index(g) * self.shape[0] + columns[j].index(g)
                    for i, row in enumerate(self.ranks) for j, g in enumerate(row)}
        out: list = [None] * len(values)
        for w, g in enumerate(sorted(slice_of)):
            out[slice_of[g]] = values[w]
        return out

    def describe(self) -> str:
        """What every rank must have been given alike (compared by ``Sharding``); the nodes
        too, from which a flat layout chooses its gather (``transport.choose``)."""
        nodes = "" if self.nodes is None else f" over {self.nodes} nodes"
        return f"{self.layout} {self.shape} {self.ranks} {self.device_type or 'group'}{nodes}"

    def line(self) -> str:
        """The layout, for the start-up line (``Ways.line``)."""
        replicas, shards = self.shape
        if self.hpz:
            return (f"layout: hpZ {replicas}x{shards}: state sharded over all "
                    f"{replicas * shards} ranks; each forward gathers a layer's shards across "
                    f"the {replicas} nodes into a secondary shard kept in the node of "
                    f"{shards}, from which backward gathers; gradients reduce-scattered within "
                    f"the node, then across the nodes")
        if self.hybrid:
            if replicas == 1:
                return (f"layout: HSDP 1x{shards}, one replica: sharded over all {shards} "
                        f"ranks, nothing to all-reduce")
            return (f"layout: HSDP {replicas}x{shards}: sharded within each group of {shards} "
                    f"(a node), gathered there; gradient shards all-reduced across the "
                    f"{replicas} replicas")
        if self.nodes is not None and self.nodes > 1:
            return (f"layout: flat over {shards} ranks on {self.nodes} nodes (torchrun): "
                    f"every gather and reduction spans the nodes; pass "
                    f"mesh=init_device_mesh(device, ({self.nodes}, "
                    f"{shards // self.nodes}), mesh_dim_names=('replicate', 'shard')) "
                    f"for hybrid sharding (HSDP)")
        return f"layout: flat over {shards} rank{'s' if shards != 1 else ''}"


def nodes_of(environ: Mapping[str, str]) -> int | None:
    """The nodes a torchrun job spans (``WORLD_SIZE / LOCAL_WORLD_SIZE``; ``GROUP_RANK``, the
    node's own rank, says it ran under an agent), or None when that environment is absent."""
    try:
        world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
        int(environ["GROUP_RANK"])
    except (KeyError, ValueError):
        return None
    return world // local if local > 0 and world % local == 0 else None


def flat(group: dist.ProcessGroup, nodes: int | None = None,
         device_type: str | None = None) -> Mesh:
    """The flat layout over ``group`` (of a 1-D mesh made for ``device_type``)."""
    n = group.size()
    return Mesh(group, None, group, (1, n), nodes=nodes,
                ranks=(tuple(dist.get_process_group_ranks(group)),), device_type=device_type)


def layout_of(hybrid: Hybrid | None, replicas: int) -> str:
    """The layout a 2-D mesh of ``replicas`` replicas takes under ``hybrid``: hpZ when asked
    and there are replicas to gather across (``Sharding`` refuses it otherwise), else HSDP."""
    return "hpz" if hybrid is not None and hybrid.layout == "hpz" and replicas > 1 else "hsdp"


def planned(shape: tuple[int, int] | None, world_size: int,
            hybrid: Hybrid | None = None) -> Mesh:
    """A planned world's mesh (``zerocore.plan``): fake groups (comm/fake.py) of each size, of
    which this process is rank 0."""
    if shape is None:
        group = fake_group(world_size)
        return Mesh(group, None, group, (1, world_size))
    replicas, shards = shape
    return Mesh(fake_group(shards), fake_group(replicas) if replicas > 1 else None,
                fake_group(world_size), (replicas, shards),
                layout=layout_of(hybrid, replicas))


MESH_2D = ("mesh=init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names="
           "('replicate', 'shard'))")


def refuse_hybrid(mesh: Mesh, hybrid: Hybrid | None, what: str, fix: str = MESH_2D) -> None:
    """A hybrid layout asked for where the mesh cannot give it (no 2-D mesh; hpZ with one
    replica): one line, the same on every rank once the mesh and the policies are agreed.
    ``fix``: how the caller passes a 2-D mesh."""
    if hybrid is None:
        return
    if not mesh.hybrid:
        raise ValueError(f"{what}: Hybrid({hybrid.layout!r}) needs a 2-D mesh (replicate, "
                         f"shard) and this model has none ({mesh.line()}); pass {fix}, or "
                         f"leave hybrid out")
    if hybrid.layout == "hpz" and not mesh.hpz:
        raise ValueError(f"{what}: Hybrid('hpz') gathers across the mesh's replicate dim and "
                         f"this mesh has one replica ({mesh.line()}); pass a 2-D mesh with "
                         f"more than one replica (a node each), or leave hybrid out")


def check_shape(shape: object, world_size: int, what: str) -> tuple[int, int] | None:
    """A planned mesh's ``(replicas, shards)``, checked against the world size."""
    if shape is None:
        return None
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(type(n) is int and n >= 1 for n in shape)):
        raise ValueError(f"{what}: mesh must be a (replicate, shard) pair of positive ints "
                         f"(HSDP), or None (flat), got {shape!r}")
    if shape[0] * shape[1] != world_size:
        raise ValueError(f"{what}: a mesh of {shape[0]} replicas x {shape[1]} shards is "
                         f"{shape[0] * shape[1]} ranks, not world_size={world_size}: the shard "
                         f"dim must divide the world")
    return shape


def resolve(group: dist.ProcessGroup | None, mesh: DeviceMesh | None, what: str, *,
            nodes: int | None = None, hybrid: Hybrid | None = None) -> Mesh:
    """The layout ``shard(group=, mesh=, hybrid=)`` asks for (neither: flat over the world;
    a 2-D mesh: HSDP, or hpZ when ``hybrid`` says so). ``nodes``: ``nodes_of`` the launcher's
    environment, read by the caller. A hybrid layout the mesh cannot give is refused later,
    once every rank agrees on the mesh and the policies (``refuse_hybrid``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed to be initialised: call "
                           f"torch.distributed.init_process_group(...) first (for one process: "
                           f"backend='gloo', world_size=1, rank=0)")
    if mesh is None:
        return flat(group if group is not None else dist.group.WORLD, nodes)
    if group is not None:
        raise ValueError(f"{what}: give group= or mesh=, not both (a mesh has its own groups: "
                         f"1-D for sharding over it, 2-D (replicate, shard) for HSDP)")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a torch.distributed.device_mesh.DeviceMesh "
                        f"(init_device_mesh(...)), got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"{what}: mesh has {mesh.ndim} dims {tuple(mesh.shape)}; zerocore "
                         f"takes a 1-D mesh (shard) or a 2-D one (replicate, shard)")
    if mesh.get_coordinate() is None:
        raise ValueError(f"{what}: this rank ({dist.get_rank()}) is not in the mesh "
                         f"{mesh.mesh.tolist()}; call it only on the mesh's ranks")
    if mesh.ndim == 1:
        return flat(mesh.get_group(0), nodes, mesh.device_type)
    replicas, shards = (int(n) for n in mesh.shape)
    ranks = tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())
    # torch numbers a group's ranks in increasing global order, whatever the mesh's order: a
    # rank's place in its row (shard group) and column (replicate group) is then its place in
    # the mesh only if both increase, which init_device_mesh's meshes do. Otherwise the slices
    # ranks hold would not be the ones the layout gives them (hpZ's s·R + r, HSDP's replicas
    # summing the same slice): refused, alike on every rank (every rank holds the same mesh).
    if any(list(row) != sorted(row) for row in ranks) or \
            any(list(col) != sorted(col) for col in zip(*ranks)):
        raise ValueError(f"{what}: the mesh {[list(row) for row in ranks]} does not number its "
                         f"ranks in increasing order along each row and each column; build it "
                         f"with init_device_mesh(device_type, (replicate, shard)), or order "
                         f"its rows and columns so")
    everyone = sorted(r for row in ranks for r in row)
    if everyone == list(range(dist.get_world_size())):
        whole = dist.group.WORLD
    else:  # made by the mesh's ranks alone (the world's others take no part)
        whole = dist.new_group(everyone, use_local_synchronization=True)
    return Mesh(mesh.get_group(1), mesh.get_group(0) if replicas > 1 else None, whole,
                (replicas, shards), nodes=nodes, ranks=ranks,
                layout=layout_of(hybrid, replicas), device_type=mesh.device_type)


def device_refusal(mesh: Mesh, device_type: str, what: str) -> str | None:
    """Why a mesh made for another kind of device than the one the model computes on (the
    group's backend's, or ``device=``) is refused, or None. The ranks exchange it with their
    devices (``agree_on_devices``), so a rank given another mesh is refused on every rank."""
    if mesh.device_type is not None and mesh.device_type != device_type:
        return (f"{what}: the mesh was made for {mesh.device_type!r} but the model "
                f"computes on {device_type!r} (from the process group's backend, or "
                f"device=); build the mesh with init_device_mesh({device_type!r}, ...)")
    return None


def node_mesh(device_type: str, nodes: int, *, what: str = "zerocore.node_mesh") -> DeviceMesh:
    """Collective: the 2-D mesh ``(nodes, ranks per node)`` over the initialised world, dims
    ``("replicate", "shard")``, as torchrun numbers ranks (node by node): HSDP's, sharded within
    each node. Checked first, alike on every rank (the world size and ``nodes`` are the same
    everywhere), with zerocore's message where torch would raise its own or, for a shard dim
    that leaves ranks out, none at all."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed to be initialised: call "
                           f"torch.distributed.init_process_group(...) first")
    world = dist.get_world_size()
    if type(nodes) is not int or nodes < 1:
        raise ValueError(f"{what}: nodes must be an int >= 1, got {nodes!r}")
    if world % nodes:
        raise ValueError(f"{what}: {nodes} nodes do not divide the world of {world} ranks: the "
                         f"shard dim (ranks per node) must divide the world; run as many ranks "
                         f"on every node")
    return init_device_mesh(device_type, (nodes, world // nodes),
                            mesh_dim_names=("replicate", "shard"))


def from_environment(device_type: str, environ: Mapping[str, str], *,
                     what: str = "zerocore.from_environment") -> DeviceMesh:
    """Collective: ``node_mesh`` of the nodes torchrun started (``nodes_of(environ)``; the
    caller passes its environment, read nowhere else). Refused, alike on every rank, when the
    process was not started by torchrun or the job has one node (no replica to share with)."""
    nodes = nodes_of(environ)
    if nodes is None:
        if all(k in environ for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")):
            raise ValueError(f"{what}: LOCAL_WORLD_SIZE={environ['LOCAL_WORLD_SIZE']} does not "
                             f"divide WORLD_SIZE={environ['WORLD_SIZE']}: the shard dim (ranks "
                             f"per node) must divide the world; run as many ranks on every node")
        raise ValueError(f"{what}: hybrid sharding takes its nodes from torchrun's environment "
                         f"(WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK), which this process does "
                         f"not have: start it with torchrun --nnodes N --nproc-per-node M, or "
                         f"pass a 2-D mesh")
    if nodes == 1:
        raise ValueError(f"{what}: hybrid sharding replicates across nodes, and torchrun "
                         f"started one node ({environ['WORLD_SIZE']} ranks): run with "
                         f"--nnodes 2 or more, or shard flat")
    return node_mesh(device_type, nodes, what=what)
