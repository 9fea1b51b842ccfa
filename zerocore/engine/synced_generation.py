"""Generation at different lengths per rank for ``zerocore.shard_model`` models: ``transformers``'
``generate`` keeps a rank whose sequences are done running forwards (``synced_gpus``) while any
other rank still generates, so that every gather has all its ranks; it chooses that by itself for
the models it knows to be sharded, those for which ``is_fsdp_managed_module`` is true, which
reads the attribute ``_is_fsdp_managed_module``. The engine sets that attribute on the model's
generating modules (docs/decisions.md, "Generation at different lengths per rank", says why this
way, and everything else that reads the attribute).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from zerocore.comm.mesh import Mesh

# What transformers reads (``transformers.distributed.fsdp.is_fsdp_managed_module``), on the
# module whose ``generate`` runs, to default ``synced_gpus`` to True.
SYNCED_GENERATION_ATTR = "_is_fsdp_managed_module"


def mark_synced_generation(model: nn.Module, mesh: Mesh) -> list[nn.Module]:
    """Marks each module of ``model`` whose class has ``generate`` (the causal LM; with PEFT
    also its inner causal LM, where PEFT's ``generate`` runs), returning those marked. Only
    where the mesh is the whole default group and has more than one rank: transformers agrees
    the ranks' state over the default group (``dist.all_reduce`` with no group), and only when
    its size is above 1; a model sharded over fewer ranks than the world is left unmarked
    (``synced_gpus=True`` would wait for ranks outside the model)."""
    if mesh.world_size < 2 or not dist.is_initialized() or \
            dist.get_world_size() != mesh.world_size:
        return []
    marked = [m for m in model.modules() if callable(getattr(type(m), "generate", None))]
    for module in marked:
        setattr(module, SYNCED_GENERATION_ATTR, True)
    return marked


def unmark_synced_generation(marked: list[nn.Module]) -> None:
    for module in marked:
        if SYNCED_GENERATION_ATTR in vars(module):
            delattr(module, SYNCED_GENERATION_ATTR)
