"""How the ranks share the model across nodes (``--hybrid``, ``--quantize-gradients``).
``policies`` gives ``zerocore.shard`` the mesh, ``Hybrid`` and ``Comm`` of the layout; the
checks against the nodes a run has are ``neox.run.layout``'s. Another layout of zerocore's is
one more word in ``HYBRIDS`` and its policy in ``policies``."""

from __future__ import annotations

import dataclasses
from typing import Any

import zerocore
from neox.run.recipe.declaring import STEP, check_fields
from neox.setting import Flag, setting

__all__ = ["LayoutConfig", "HYBRIDS"]

# --hybrid's layouts besides "none".
HYBRIDS = ("hsdp", "hpz")


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """Flat ZeRO-3 over every rank, or hybrid sharding over the nodes' 2-D mesh."""

    # How the ranks share the model across nodes: None, flat ZeRO-3 over every rank; "hsdp",
    # sharded within each node and replicated across nodes (a 2-D mesh (nodes, ranks per
    # node); neox/run/layout.py); "hpz", zerocore.Hybrid("hpz") on that mesh. A resumed run may
    # change it: checkpoints load into any layout.
    hybrid: str | None = setting(
        None, check=lambda x: x is None or x in HYBRIDS, since=6,
        problem=f"{{name}} must be null (flat) or one of {HYBRIDS}, got {{value!r}}",
        flag=Flag(STEP, "how the ranks share the model across nodes: 'none', flat ZeRO-3 over "
                        "every rank (every gather crosses the nodes); 'hsdp', sharded within each "
                        "node and replicated across nodes (only each rank's gradient shard "
                        "crosses them, once per step); 'hpz', ZeRO-3's memory over every rank "
                        "with a node-local copy of each layer's shards from forward to backward "
                        "(backward's gathers stay in the node); the nodes are torchrun's "
                        "(--nnodes), or --nodes on one machine",
                  choices={"none": None, **{h: h for h in HYBRIDS}},
                  text=lambda x: "none" if x is None else x, resumable=True))
    # HSDP's cross-node gradient all-reduce in int8 with a scale per block (zerocore's qgZ,
    # zerocore.Comm(quantize_gradients=)); None: in the reduce dtype.
    quantize_gradients: str | None = setting(
        None, check=lambda x: x in (None, "int8"), since=6,
        problem="{name} must be null or int8, got {value!r}",
        flag=Flag(STEP, "send the gradients across nodes in int8 with an fp32 scale per block "
                        "of 128 (about a quarter of fp32's bytes; within 1%% of the exact run's "
                        "loss on the tests' model), with --hybrid only: gathers and the "
                        "reduction within a node stay exact", choices={"none": None,
                                                                       "int8": "int8"},
                  text=lambda x: "none" if x is None else x, resumable=True))

    def __post_init__(self) -> None:
        check_fields(self, "recipe.layout")

    def policies(self, *, nodes: int, device_type: str, comm: zerocore.Comm) -> dict[str, Any]:
        """``zerocore.shard``'s ``comm`` (``comm`` with this layout's gradient quantization),
        and when hybrid its ``mesh`` ``(nodes, ranks per node)`` and ``hybrid``; the layout is
        checked against the nodes first (``neox.run.layout.check_layout``)."""
        comm = dataclasses.replace(comm, quantize_gradients=self.quantize_gradients)
        if self.hybrid is None:
            return dict(comm=comm)
        return dict(comm=comm, mesh=zerocore.node_mesh(device_type, nodes, what="--hybrid"),
                    hybrid=zerocore.Hybrid(self.hybrid))

    def problem(self) -> str | None:
        """Why the recipe's --quantize-gradients cannot be (None: it can)."""
        if self.quantize_gradients is not None and self.hybrid is None:
            return (f"--quantize-gradients {self.quantize_gradients} quantizes the gradients' "
                    f"all-reduce across nodes, which only --hybrid has: add --hybrid hsdp or "
                    f"hpz, or leave it out")
        return None

    def words(self) -> str:
        """The layout's flags in words, for the run's model line ("" when flat)."""
        if self.hybrid is None:
            return ""
        return (f"; --hybrid {self.hybrid}"
                + (f", gradients across nodes in {self.quantize_gradients}"
                   if self.quantize_gradients else ""))
