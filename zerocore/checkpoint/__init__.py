"""Checkpoints: the engine's sharded checkpoints (``sharded``: save, load, at any world size),
their directory rules (``dirs``), manifest (``manifest``) and verified reading (``reader``),
atomic writes (``durable_io``), full weights rebuilt from the shards (``consolidate``), and
DeepSpeed ZeRO-3 checkpoints read without DeepSpeed (``deepspeed``). This module names what
applications use; ``consolidate`` (safetensors) is imported only by those who write files with
it (``zerocore.consolidate``), so that ``import zerocore`` needs no more than the engine does.

This module is the public face of checkpoints (docs/api.md): saving, loading and resuming, the
verified reading, DeepSpeed's checkpoints, and the durable writes an application's own files
(exports beside a run's checkpoints) go through. The modules beneath are implementation."""

from zerocore.checkpoint.deepspeed import (ADAPTER_CONFIG, DeepSpeedCheckpoint,
                                           DeepSpeedCheckpointError, adapter_names,
                                           is_deepspeed_checkpoint, load_deepspeed_checkpoint)
from zerocore.checkpoint.dirs import (IncompleteCheckpoint, checkpoint_runs,
                                      incomplete_checkpoints, latest_checkpoint, list_checkpoints)
from zerocore.checkpoint.durable_io import make_dir, write_atomically, writing
from zerocore.checkpoint.errors import (CheckpointError, CheckpointWriteError,
                                       weights_only_failure)
from zerocore.checkpoint.manifest import (COMMIT, FORMAT, MANIFEST, model_fingerprint,
                                          rank_file, read_manifest, unverified_reason)
from zerocore.checkpoint.reader import (ShardReader, iter_full_layers, open_checkpoint,
                                        verify_files)
from zerocore.checkpoint.sharded import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "list_checkpoints", "latest_checkpoint",
           "checkpoint_runs", "incomplete_checkpoints", "IncompleteCheckpoint", "read_manifest",
           "verify_files", "open_checkpoint", "iter_full_layers", "ShardReader",
           "model_fingerprint", "rank_file", "unverified_reason", "CheckpointError",
           "CheckpointWriteError", "MANIFEST", "COMMIT", "FORMAT", "weights_only_failure",
           "load_deepspeed_checkpoint", "is_deepspeed_checkpoint", "DeepSpeedCheckpoint",
           "DeepSpeedCheckpointError", "adapter_names", "ADAPTER_CONFIG",
           "writing", "write_atomically", "make_dir"]
