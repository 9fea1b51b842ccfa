"""Compiled units (``zerocore.Compile``, policies.py): each layer of ``zerocore.shard`` and
each unit of ``zerocore.shard_model`` has its ``forward`` compiled with ``torch.compile``, while
the engine around it (gathers, views, autograd nodes, hooks) stays eager.

Why the forward and not the module's call. ``shard_model`` gathers a unit in forward hooks on
the unit's module; ``module.compile()`` compiles the module's call, hooks included, and dynamo
breaks the graph at every collective and autograd node inside them. The engine instead gives the
module an instance attribute ``forward`` (what ``torch.compile(module)``'s wrapper does to
itself), so ``module(...)`` runs its hooks eagerly and then the compiled forward: one graph per
distinct forward, no break at the engine's boundary. The names of parameters stay the
module's own (``torch.compile(module)`` before sharding works too, its names carrying
``_orig_mod.``, which the engine drops: ``plain_name``).

Why no recompilation. The gathered parameters are installed afresh before every run as plain
tensor attributes viewing a new buffer; dynamo lifts them as graph inputs and guards on their
metadata (dtype, shape, strides, requires_grad), not on their identity or storage, so the same
graph serves every gather, and every instance of one layer class. A forward run without
autograd (``torch.no_grad()``, a recomputed layer's first run) is one more graph per class.
"""

from __future__ import annotations

import torch
from torch import nn

from zerocore.policies import Compile

# The attribute under which ``torch.compile(module)`` keeps the module it wraps.
_WRAPPED = "_orig_mod"


def compile_forward(policy: Compile, module: nn.Module) -> None:
    """Gives ``module`` a compiled ``forward`` (an instance attribute over its class's); its
    hooks, the engine's included, keep running eagerly around it."""
    refuse_compiled_call(module, type(module).__name__)
    module.forward = torch.compile(
        module.forward, fullgraph=policy.fullgraph, dynamic=policy.dynamic,
        backend=policy.backend, mode=policy.mode, options=dict(policy.options) or None)


def refuse_compiled_call(module: nn.Module, what: str) -> None:
    """``module.compile()`` compiles the module's call, hooks included: on a unit of
    ``shard_model`` the engine's hooks, with a graph break at each collective. Refused there
    and under the policy (which would compile the forward a second time), saying what to do."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        raise ValueError(f"zerocore: {what} was compiled with module.compile(), which compiles "
                         f"the module's hooks too (the engine's, under shard_model); pass "
                         f"compile=zerocore.Compile() to the engine instead, or put "
                         f"torch.compile(module) in the module's place before sharding")


def plain_name(name: str) -> str:
    """A parameter's name without the ``_orig_mod`` segments of ``torch.compile`` wrappers, so
    that a compiled model's checkpoints and exports name parameters as the plain model does."""
    if _WRAPPED not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _WRAPPED)
