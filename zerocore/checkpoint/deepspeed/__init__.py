"""A DeepSpeed ZeRO-3 checkpoint, read without DeepSpeed: ``export`` writes it as safetensors
under the model's own parameter names (the command ``python -m zerocore.from_deepspeed``), and
``load_deepspeed_checkpoint`` resumes such a run on a zerocore-sharded model.

The concepts, in the order a reading uses them:
- ``unpickler``: the files are pickles, read by torch's weights-only unpickler with an allowlist
  (DeepSpeed's own classes mapped to inert records: nothing in a file can run code); tensors are
  references into the file, read later, only the bytes of the tensor being written
  (``os.pread``-style), so host memory stays near the largest tensor, whatever the model's size;
- ``reader``: ``DeepSpeedCheckpoint``, one saved tag opened and checked before anything is
  written (files present for every rank, world size, stage, DeepSpeed version, every flat
  tensor's size against the parameter shapes, records inside their files);
- ``streaming_safetensors``: a safetensors file written one tensor at a time;
- ``exporting``: ``export``, what ``python -m zerocore.from_deepspeed`` writes;
- ``resume``: ``load_deepspeed_checkpoint``, the run continued on zerocore.

Each failure is one ``DeepSpeedCheckpointError`` line (a ``ValueError``) saying what is wrong and
what to do. ZeRO stage 1/2 checkpoints, tensor- or pipeline-parallel ones (``mp_rank_01``...)
and DeepSpeed versions before 0.10 are refused, saying so.
"""

from zerocore.checkpoint.deepspeed.exporting import (ADAPTER_CONFIG, ADAPTER_FILE, MODEL_FILE,
                                                     TRAINABLE_FILE, adapter_names, export,
                                                     peft_name)
from zerocore.checkpoint.deepspeed.reader import DeepSpeedCheckpoint, is_deepspeed_checkpoint
from zerocore.checkpoint.deepspeed.resume import load_deepspeed_checkpoint
from zerocore.checkpoint.errors import DeepSpeedCheckpointError

__all__ = ["DeepSpeedCheckpoint", "DeepSpeedCheckpointError", "export",
           "load_deepspeed_checkpoint", "is_deepspeed_checkpoint", "peft_name", "adapter_names",
           "MODEL_FILE", "TRAINABLE_FILE", "ADAPTER_FILE", "ADAPTER_CONFIG"]
