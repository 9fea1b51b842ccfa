"""How a run's ranks share the model across nodes (``--hybrid``, ``--quantize-gradients``): the
checks of a layout against the nodes the run has, and the line that says it (the engine's
options that make it are ``neox.run.recipe.LayoutConfig.policies``).

The nodes are torchrun's (``zerocore.nodes_of`` of its environment, read by the command, at the
edge) or, on one machine under neox's own launcher, ``--nodes`` (the ranks numbered as torchrun
numbers them: node by node). ``--hybrid hsdp`` gives ``zerocore.shard`` the 2-D mesh
``(nodes, ranks per node)`` (``zerocore.node_mesh``): sharded within each node, replicated
across nodes; ``--hybrid hpz`` the same mesh with ``zerocore.Hybrid("hpz")``. Another layout
of zerocore's is one more word in ``neox.run.recipe.HYBRIDS`` and its policy in
``LayoutConfig.policies``.
"""

from __future__ import annotations

from neox.run.recipe import LayoutConfig
from neox.setting import UsageError

__all__ = ["check_layout", "layout_line"]


def check_layout(layout: LayoutConfig, *, world_size: int, nodes: int | None, torchrun: bool,
                 nodes_given: bool) -> None:
    """``UsageError`` (one line) when the recipe's layout cannot run on these nodes: hybrid
    sharding on one node, qgZ without it, ``--nodes`` under torchrun or not dividing the
    ranks. ``nodes``: torchrun's, or ``--nodes``; None when torchrun's environment lacks them."""
    if nodes_given and torchrun:
        raise UsageError("--nodes: under torchrun the nodes are torchrun's (--nnodes); leave "
                         "--nodes out")
    if nodes_given and layout.hybrid is None:
        raise UsageError("--nodes applies to --hybrid (the nodes hybrid sharding replicates "
                         "across); without it the layout is flat: give --hybrid hsdp, or leave "
                         "--nodes out")
    problem = layout.problem()
    if problem is not None:
        raise UsageError(problem)
    if layout.hybrid is None:
        return
    if nodes is None or nodes < 2:
        where = ("torchrun started one node" if torchrun and nodes == 1 else
                 "torchrun's environment does not say the nodes (LOCAL_WORLD_SIZE, GROUP_RANK)"
                 if torchrun else "this machine is one node")
        raise UsageError(f"--hybrid {layout.hybrid} shards within each node and replicates "
                         f"across nodes, and {where}: run under torchrun --nnodes N (N >= 2)"
                         + ("" if torchrun else ", or simulate N nodes here with --nodes N")
                         + ", or give --hybrid none")
    if world_size % nodes:
        raise UsageError(f"--nodes {nodes} does not divide the {world_size} ranks: every node "
                         f"runs as many ranks; give --nproc a multiple of --nodes")


def layout_line(layout: LayoutConfig, ways: str, *, nodes: int, world_size: int) -> str:
    """The start-up line of a run on several nodes: the engine's (``ways``, which begins with
    the layout: "layout: HSDP 2x2: ..."), qgZ said; a flat layout's points to --hybrid."""
    if layout.hybrid is None:
        return (f"layout: flat over {world_size} ranks on {nodes} nodes: every gather and "
                f"reduction spans the nodes; --hybrid hsdp shards within each node instead")
    crossing = "the replicas' all-reduce" if layout.hybrid == "hsdp" else "the cross-node reduce"
    return ways + (f"; {crossing} in {layout.quantize_gradients} (qgZ)"
                   if layout.quantize_gradients else "")
