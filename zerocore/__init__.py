"""zerocore: ZeRO-3 sharding of parameters, gradients and optimizer state for PyTorch, on fused
C++/CUDA kernels.

    model = zerocore.shard(layers, mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    optimizer = zerocore.optim.AdamW(model.parameters(), lr=3e-4)

``zerocore.BUILD`` says which kernels were compiled (CPU only or CPU+CUDA) and for which torch;
``python -m zerocore`` prints it.

This module is the package's face: it names what users call and defines nothing but
``PUBLIC_MODULES``. The wings beneath it, each importing only those below it
(tests/tools/test_structure.py checks it): ``kernels`` (the compiled ops and their plain-PyTorch
definitions), ``comm`` (devices, collectives, transports, agreement), ``engine`` (flat groups,
sharded layers, the two front doors), ``checkpoint`` (sharded checkpoints, consolidation,
DeepSpeed's), ``tools`` (selftest, a launcher's rank processes).
``policies`` (leaf data every wing reads), ``optim``, ``loss_scale`` and ``plan`` sit beside it.

The public surface is the modules ``PUBLIC_MODULES`` names, and in each only the names of its
``__all__`` (docs/api.md lists them, one line each). Every other module is implementation,
with no promise that it stays where it is or keeps its names: the wings beneath hold the code,
and the public modules hand on what users and applications (neox) call. The commands
(``python -m zerocore``, ``zerocore.consolidate``, ``zerocore.from_deepspeed``,
``zerocore.selftest``, ``zerocore.tools.job``) promise their command lines, not their contents.
"""

from zerocore import optim, plan
from zerocore.checkpoint import (CheckpointError, CheckpointWriteError, IncompleteCheckpoint,
                                 ShardReader, checkpoint_runs, incomplete_checkpoints,
                                 iter_full_layers, latest_checkpoint, list_checkpoints,
                                 load_checkpoint, open_checkpoint, read_manifest,
                                 save_checkpoint, verify_files)
from zerocore.comm.agree import PeerError, run_agreed
from zerocore.comm.lockstep import Diverged
from zerocore.comm.peer_loss import is_peer_loss
from zerocore.comm.peer_memory import PeerLost
from zerocore.comm.device import Platform
from zerocore.comm.same_values import ValuesDiffer, agree_values
from zerocore.comm.mesh import from_environment as mesh_from_environment, node_mesh, nodes_of
from zerocore.engine.meta_layer import MetaLayer
from zerocore.engine.peak_memory import PeakMemory, peak_rss, reset_peak_rss
from zerocore.engine.report import CommReport, MemoryReport
from zerocore.engine.sharded_model import ShardedModel, shard_model, sharding_of
from zerocore.engine.sharded_param import ShardParameter
from zerocore.engine.sharded_sequential import ShardedSequential, shard
from zerocore.engine.sharding import BuildError
from zerocore.kernels import ops, reference
from zerocore.kernels.ops import BUILD
from zerocore.loss_scale import LossScaler, StepResult
from zerocore.policies import (AUTO_POOL_HOST_SHARE, DEFAULT_POOL_BYTES, FROZEN_FORMATS,
                               FROZEN_PLACEMENTS, MAX_AUTO_POOL_BYTES, MIN_POOL_BYTES,
                               OFFLOAD_DEVICES, OVERLAPS, Comm, Compile, FrozenWeights, Hybrid,
                               LossScaling, MixedPrecision, Offload, Prefetch, Recompute,
                               auto_pool_bytes)

# The modules whose __all__ is zerocore's API; tests/tools/test_structure.py holds neox, the
# examples, the benchmarks and the documentation's code to them, and docs/api.md to this list.
PUBLIC_MODULES = ("zerocore", "zerocore.optim", "zerocore.plan", "zerocore.checkpoint",
                  "zerocore.consolidate", "zerocore.hf_pretrained", "zerocore.hf_trainer",
                  "zerocore.tools", "zerocore.kernels.ops", "zerocore.kernels.reference")

__version__ = "0.1.0"
__all__ = ["BUILD", "ops", "optim", "reference", "shard", "ShardedSequential", "ShardParameter",
           "shard_model", "ShardedModel", "sharding_of",
           "MixedPrecision", "Prefetch", "Offload", "Recompute", "FrozenWeights", "FROZEN_FORMATS",
           "FROZEN_PLACEMENTS", "Comm",
           "Compile", "Hybrid", "OFFLOAD_DEVICES", "OVERLAPS", "DEFAULT_POOL_BYTES",
           "MAX_AUTO_POOL_BYTES", "AUTO_POOL_HOST_SHARE", "MIN_POOL_BYTES",
           "auto_pool_bytes",
           "LossScaling", "LossScaler", "StepResult",
           "MemoryReport", "CommReport", "run_agreed", "PeerError", "PeerLost", "Diverged",
           "is_peer_loss", "agree_values", "ValuesDiffer",
           "BuildError", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "list_checkpoints", "checkpoint_runs",
           "incomplete_checkpoints", "IncompleteCheckpoint", "open_checkpoint", "read_manifest",
           "verify_files", "iter_full_layers", "ShardReader", "CheckpointError",
           "CheckpointWriteError", "Platform", "MetaLayer", "plan", "PeakMemory",
           "peak_rss", "reset_peak_rss", "node_mesh", "mesh_from_environment", "nodes_of",
           "PUBLIC_MODULES"]
