"""zerocore: ZeRO-3 sharding of parameters, gradients and optimizer state for PyTorch, on fused
C++/CUDA kernels.

    model = zerocore.shard(layers, mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    optimizer = zerocore.optim.AdamW(model.parameters(), lr=3e-4)

``zerocore.BUILD`` says which kernels were compiled (CPU only or CPU+CUDA) and for which torch;
``python -m zerocore`` prints it.
"""

from zerocore import _extension

BUILD = _extension.load()

# The ops must be registered (above) before these import.
from zerocore import ops, optim, reference  # noqa: E402
from zerocore.device import Platform  # noqa: E402
from zerocore.loss_scale import LossScaler, StepResult  # noqa: E402
from zerocore.policies import (Comm, FrozenWeights, LossScaling, MixedPrecision,  # noqa: E402
                               Offload, Prefetch, Recompute)
from zerocore.compiled import Compile  # noqa: E402
from zerocore.report import CommReport, MemoryReport  # noqa: E402
from zerocore.meta_layer import MetaLayer  # noqa: E402
from zerocore import plan  # noqa: E402  (zerocore.plan.plan, MemoryPlan)
from zerocore.peak_memory import PeakMemory, peak_rss, reset_peak_rss  # noqa: E402
from zerocore.sharded_param import ShardParameter  # noqa: E402
from zerocore.sharded_sequential import ShardedSequential, shard  # noqa: E402
from zerocore.sharded_model import ShardedModel, shard_model, sharding_of  # noqa: E402
from zerocore.agree import PeerError, run_agreed  # noqa: E402
from zerocore.collectives import PeerLost  # noqa: E402
from zerocore.checkpoint import (CheckpointError, CheckpointWriteError,  # noqa: E402
                                 IncompleteCheckpoint, ShardReader, checkpoint_runs,
                                 incomplete_checkpoints, iter_full_layers, latest_checkpoint,
                                 list_checkpoints, load_checkpoint, open_checkpoint,
                                 read_manifest, save_checkpoint, verify_files)

__version__ = "0.1.0"
__all__ = ["BUILD", "ops", "optim", "reference", "shard", "ShardedSequential", "ShardParameter",
           "shard_model", "ShardedModel", "sharding_of",
           "MixedPrecision", "Prefetch", "Offload", "Recompute", "FrozenWeights", "Comm",
           "Compile",
           "LossScaling", "LossScaler", "StepResult",
           "MemoryReport", "CommReport", "run_agreed", "PeerError", "PeerLost", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "list_checkpoints", "checkpoint_runs",
           "incomplete_checkpoints", "IncompleteCheckpoint", "open_checkpoint", "read_manifest",
           "verify_files", "iter_full_layers", "ShardReader", "CheckpointError",
           "CheckpointWriteError", "Platform", "MetaLayer", "plan", "PeakMemory",
           "peak_rss", "reset_peak_rss"]
