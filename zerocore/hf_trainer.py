"""``ShardedTrainer``: transformers' ``Trainer`` training a model sharded by zerocore (ZeRO-3).

    from zerocore.hf_trainer import ShardedTrainer
    trainer = ShardedTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                             shard_options=dict(offload=zerocore.Offload(optimizer=True)))
    trainer.train()                 # or train(resume_from_checkpoint=True)
    trainer.save_model("out")       # a PEFT adapter directory, or a Hugging Face model directory

Under ``torchrun`` (gloo on CPU, NCCL on GPUs) ``Trainer`` keeps its own loop: its data order,
gradient accumulation, learning-rate schedulers, logging, evaluation and callbacks. What it
does through its own machinery for a replicated model is done here for a sharded one:

- the model is sharded in ``__init__`` by ``zerocore.shard_model`` (units: the modules whose
  class ``model._no_split_modules`` names, as accelerate's FSDP auto-wrap picks them, unless
  ``units`` says otherwise), never wrapped in DDP and never moved (zerocore placed the shards);
- the optimizer is ``zerocore.optim.AdamW`` over the flat shards, with ``TrainingArguments``'
  lr, betas, eps and weight decay, and ``Trainer``'s own parameter groups: no decay for what
  ``Trainer.get_decay_parameter_names`` leaves out (biases and norms), as per-parameter
  overrides on the shards (``param_overrides``); ``optimizers=`` is refused;
- ``max_grad_norm`` clips by the global norm over every rank's shards
  (``ShardedModel.clip_grad_norm_``), which is what ``Trainer`` logs as ``grad_norm``;
- ``save_model`` gathers the shards onto rank 0 and writes what ``Trainer`` would: a PEFT model
  saves its adapter, any other model a Hugging Face directory;
- a ``Trainer`` checkpoint (``checkpoint-N/``) holds that export, ``Trainer``'s own files
  (state, scheduler, RNG) and zerocore's sharded checkpoint in ``checkpoint-N/zerocore/``
  (masters, Adam moments, steps: ``zerocore.save_checkpoint``); ``resume_from_checkpoint``
  restores from it at the same or another number of processes.

Mixed precision is zerocore's (``shard_options["mixed_precision"]``): ``bf16=True`` without it
shards with bf16 parameters and fp32 gradient reduction. ``fp16=True`` is refused: ``Trainer``
would unscale through ``torch.amp.GradScaler``, which does not know flat shards; use bf16, or
zerocore's own loop with ``zerocore.LossScaler``. Importing this module needs transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

import zerocore
from zerocore.sharded_model import ShardedModel

CHECKPOINT_DIR = "zerocore"  # inside each checkpoint-N/ of Trainer


class _TrainStep(nn.Module):
    """What ``Trainer`` trains and evaluates through: the sharded model itself, behind a module
    that is not ``Trainer.model``, so that ``Trainer`` prepares only the optimizer with
    accelerate: it neither wraps the model in DistributedDataParallel (zerocore reduces the
    gradients) nor moves it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules whose class ``_no_split_modules`` names (the decoder layers of a transformers
    model, also inside a PEFT model), outermost only. Raises ValueError when there are none."""
    names = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    units: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if type(m).__name__ in names and m is not model:
            units.append(m)
            inside.update(id(sub) for sub in m.modules())
    if not units:
        raise ValueError(f"ShardedTrainer: {type(model).__name__} names no layers in "
                         f"_no_split_modules; pass units= (e.g. model.model.layers)")
    return units


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` on a model that it shards with ``zerocore.shard_model``.

    units: the modules gathered and freed one at a time (default: ``default_units(model)``).
    shard_options: further keyword arguments of ``zerocore.shard_model`` (``offload``,
        ``frozen_weights``, ``prefetch``, ``mixed_precision``, ``comm``, ...).
    Every other argument is ``Trainer``'s; ``model`` must not be sharded yet.
    """

    def __init__(self, model: nn.Module, args: Any = None, *,
                 units: Iterable[nn.Module] | nn.Module | None = None,
                 shard_options: dict[str, Any] | None = None, **kwargs: Any):
        if isinstance(getattr(model, "zerocore_sharding", None), ShardedModel):
            raise ValueError("ShardedTrainer: the model is sharded already; pass it unsharded "
                             "(ShardedTrainer shards it: units=..., shard_options=...)")
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError("ShardedTrainer: optimizers=(optimizer, ...) is not supported: the "
                             "optimizer must step the flat shards (zerocore.optim.AdamW, built "
                             "from TrainingArguments); pass a scheduler only as (None, scheduler)")
        if args is None:
            raise ValueError("ShardedTrainer: pass args=TrainingArguments(...)")
        if args.fp16:
            raise ValueError("ShardedTrainer: fp16=True is not supported (Trainer would unscale "
                             "through torch.amp.GradScaler, which does not know flat shards); "
                             "use bf16=True, or zerocore's own loop with zerocore.LossScaler")
        options = dict(shard_options or {})
        if "mixed_precision" not in options and args.bf16:
            # zerocore's mixed precision, not autocast: the gathered parameters are bf16 and
            # the gradients are reduced in fp32, as DeepSpeed's bf16 mode does by default.
            options["mixed_precision"] = zerocore.MixedPrecision(torch.bfloat16, torch.float32)
        if args.bf16 and options["mixed_precision"].param_dtype != torch.bfloat16:
            raise ValueError("ShardedTrainer: bf16=True but shard_options['mixed_precision'] "
                             f"computes in {options['mixed_precision'].param_dtype}; make them "
                             "agree")
        # Trainer's parameter groups, decided on the unsharded model (it reads the parameters
        # that each module owns, which sharding takes away).
        self._decayed = set(self.get_decay_parameter_names(model))
        device = args.device  # joins the process group (accelerate's PartialState) first
        if "device" not in options and device.type != "cpu":
            options["device"] = device
        self.sharding = zerocore.shard_model(
            model, default_units(model) if units is None else units, **options)
        super().__init__(model=model, args=args, **kwargs)

    # -- what Trainer does to a replicated model, for a sharded one ---------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # zerocore placed the shards (and offloaded ones stay on the host)

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        # Also for evaluation: accelerate would otherwise prepare the model there, moving it to
        # the device (offloaded shards too).
        if isinstance(model, _TrainStep):
            return model  # a later train() call
        return _TrainStep(model)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            args = self.args
            decayed = self._decayed
            optimizer = zerocore.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon, weight_decay=args.weight_decay,
                param_overrides=lambda name: None if name in decayed else {"weight_decay": 0.0})
            # Wrapped here, without device placement: accelerate would otherwise copy the whole
            # state to the device and back (and offloaded state does not belong there).
            self.optimizer = AcceleratedOptimizer(optimizer, device_placement=False)
            self.optimizer._is_accelerate_prepared = True
        return self.optimizer

    @property
    def zerocore_optimizer(self) -> zerocore.optim.AdamW:
        """The ``zerocore.optim.AdamW`` that steps the shards (under accelerate's wrapper)."""
        return self.optimizer.optimizer

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.sharding.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = self.sharding.clip_grad_norm_(float("inf"))
        return grad_norm

    # -- saving and resuming -------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: gathers the model onto rank 0, which writes what ``Trainer`` would: the
        adapter of a PEFT model (only the trainable parameters travel), else the whole model
        (``save_pretrained``), with the tokenizer and the arguments."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.sharding.full_state_dict(trainable_only=_is_peft(self.model), to_rank=0)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        zerocore.save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.state.global_step,
                                 self.sharding, self.zerocore_optimizer, keep_last=0)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights come with the optimizer state, from zerocore's checkpoint (below); only
        # check now, before training starts, that there is one.
        _zerocore_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        zerocore.load_checkpoint(_zerocore_checkpoint(checkpoint), self.sharding,
                                 self.zerocore_optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _zerocore_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """The zerocore step directory inside a ``Trainer`` checkpoint."""
    root = Path(checkpoint) / CHECKPOINT_DIR
    steps = zerocore.list_checkpoints(root) if root.is_dir() else []
    if not steps:
        raise ValueError(f"ShardedTrainer: {checkpoint} holds no zerocore checkpoint "
                         f"({CHECKPOINT_DIR}/step-N); was it written by ShardedTrainer?")
    return steps[-1]
