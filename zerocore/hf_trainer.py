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
- under torchrun across nodes, ``hybrid="hsdp"`` shards within each node and replicates across
  nodes (HSDP): the 2-D mesh ``(nodes, ranks per node)`` is built from torchrun's environment
  (``zerocore.mesh_from_environment``) unless ``shard_options`` gives one (``mesh=``); with a
  2-D mesh, the replicas' all-reduce runs once per optimizer step, with the backward of
  ``Trainer``'s last micro-batch of an accumulation (its ``sync_gradients``);
- ``max_grad_norm`` clips by the global norm over every rank's shards (what ``Trainer`` logs
  as ``grad_norm``), inside the fused Adam kernel, through ``zerocore.LossScaler``;
- ``fp16=True`` trains with fp16 parameters, fp32 masters and reduction, and DeepSpeed's
  dynamic loss scaling (``zerocore.LossScaler``): an inf or nan gradient on any rank skips the
  step on all, and the scheduler with it, as ``Trainer`` does with ``GradScaler``;
- ``save_model`` gathers the shards onto rank 0 and writes what ``Trainer`` would: a PEFT model
  saves its adapter (its ``modules_to_save`` copies included: each module reports its gathered
  parameters to PEFT while it saves), any other model a Hugging Face directory;
- a ``Trainer`` checkpoint (``checkpoint-N/``) holds that export, ``Trainer``'s own files
  (state, scheduler, RNG) and zerocore's sharded checkpoint in ``checkpoint-N/zerocore/``
  (masters, Adam moments, steps: ``zerocore.save_checkpoint``); ``resume_from_checkpoint``
  restores from it at the same or another number of processes, and ``load_best_model_at_end``
  loads the best one's weights.

Trainers built on ``Trainer`` take it as a mixin, first: ``class ShardedSFTTrainer(ShardedTrainer,
trl.SFTTrainer): pass`` trains with TRL's loss and data handling (tested).

Mixed precision is zerocore's (``shard_options["mixed_precision"]``, else from ``bf16``/``fp16``:
16-bit parameters, fp32 gradient reduction), never accelerate's autocast or ``GradScaler``
(which know nothing of flat shards). Importing this module needs transformers and accelerate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.utils import logging

import zerocore
from zerocore.comm.lockstep import STATS
from zerocore.loss_scale import global_grad_stats
from zerocore.engine.sharded_model import ShardedModel
from zerocore.policies import HYBRID_LAYOUTS

__all__ = ["ShardedTrainer", "default_units"]

CHECKPOINT_DIR = "zerocore"  # inside each checkpoint-N/ of Trainer
# ``hybrid=``'s layouts, zerocore.Hybrid's: each takes the mesh of torchrun's nodes.
HYBRIDS = HYBRID_LAYOUTS
logger = logging.get_logger(__name__)


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


class _ScaleGrad(torch.autograd.Function):
    """The loss unchanged forward (``Trainer`` logs it), its gradient times the loss scale
    backward: fp16 loss scaling for every gradient below."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _ScaledStep(AcceleratedOptimizer):
    """accelerate's optimizer wrapper (``Trainer`` calls ``step``, ``zero_grad`` and
    ``step_was_skipped`` on it), stepping through ``ShardedTrainer._optimizer_step``. Made
    here, without device placement: accelerate would otherwise copy the whole optimizer state
    to the device and back (and offloaded state does not belong there)."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Any):
        super().__init__(optimizer, device_placement=False)
        self._step = step
        self._is_accelerate_prepared = True  # Trainer's accelerator.prepare leaves it as it is

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ShardedTrainer's optimizer takes no closure")
        if self.gradient_state.sync_gradients:
            self._is_overflow = self._step()  # what step_was_skipped reports


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


# ``TrainingArguments``' fields each rank may hold its own: torchrun's numbering, where and how
# a rank logs or reports (never a collective), its data loader's worker processes, its own
# waits, and secrets (never sent, never named). Every other field (a subclass's too: TRL's
# SFTConfig) changes the run and is agreed across the ranks.
RANKS_OWN_ARGUMENTS = frozenset({
    "local_rank", "log_level", "log_level_replica", "log_on_each_node", "disable_tqdm",
    "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "logging_dir", "hub_token", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "skip_memory_metrics", "ddp_timeout"})
# ``shard_options`` each rank gives its own: its device; the mesh is agreed by zerocore.shard
# (its layout, in the engine's words); the reader of a model built on the meta device
# (``zerocore.hf_pretrained``: each rank reads its own part of the files; the files and the
# model are agreed as it is built).
RANKS_OWN_OPTIONS = frozenset({"device", "mesh", "read"})


def agreed_arguments(args: Any, shard_options: dict[str, Any],
                     hybrid: str | None) -> dict[str, Any]:
    """What every rank of a ``ShardedTrainer`` must be given alike, by name: the
    ``TrainingArguments`` fields but ``RANKS_OWN_ARGUMENTS``, ``shard_options`` but
    ``RANKS_OWN_OPTIONS`` (an NVMe ``Offload``'s path is each rank's own disk), and ``hybrid``."""
    agreed: dict[str, Any] = {f"TrainingArguments.{f.name}": getattr(args, f.name)
                              for f in dataclasses.fields(args)
                              if f.name not in RANKS_OWN_ARGUMENTS}
    for key, value in sorted(shard_options.items()):
        if key in RANKS_OWN_OPTIONS:
            continue
        if isinstance(value, zerocore.Offload) and value.path is not None:
            value = dataclasses.replace(value, path="(each rank's own)")
        agreed[f"shard_options[{key!r}]"] = value
    agreed["hybrid"] = hybrid
    return agreed


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` on a model that it shards with ``zerocore.shard_model``.

    units: the modules gathered and freed one at a time (default: ``default_units(model)``).
    shard_options: further keyword arguments of ``zerocore.shard_model`` (``offload``,
        ``frozen_weights``, ``prefetch``, ``mixed_precision``, ``comm``, ``mesh``, ...).
    hybrid: ``"hsdp"``: sharded within each node, replicated across nodes; ``"hpz"``
        (``zerocore.Hybrid("hpz")``): state sharded over every rank, with a node-local
        secondary shard of each layer from its forward to its backward; either over the mesh
        ``shard_options["mesh"]``, else the one torchrun's environment says (``--nnodes N``,
        N >= 2: refused otherwise). With ``comm=zerocore.Comm(quantize_gradients="int8")``
        the gradients cross the nodes in int8 (qgZ).
    Every other argument is ``Trainer``'s; ``model`` must not be sharded yet.
    """

    def __init__(self, model: nn.Module, args: Any = None, *,
                 units: Iterable[nn.Module] | nn.Module | None = None,
                 shard_options: dict[str, Any] | None = None, hybrid: str | None = None,
                 **kwargs: Any):
        if isinstance(getattr(model, "zerocore_sharding", None), ShardedModel):
            raise ValueError("ShardedTrainer: the model is sharded already; pass it unsharded "
                             "(ShardedTrainer shards it: units=..., shard_options=...)")
        if args is None:
            raise ValueError("ShardedTrainer: pass args=TrainingArguments(...)")
        device = args.device  # joins the process group (accelerate's PartialState) first
        # Each rank built its own arguments: the ranks agree them before anything is checked
        # on one rank alone or built.
        if dist.is_initialized() and dist.get_world_size() > 1:
            zerocore.agree_values(
                agreed_arguments(args, shard_options or {}, hybrid), what="ShardedTrainer",
                advice="every rank must be given the same TrainingArguments, shard_options and "
                       "hybrid", device=device,
                node=int(os.environ["GROUP_RANK"]) if "GROUP_RANK" in os.environ else None)
        _refuse_unsupported(model, args, kwargs)
        if hybrid is not None and hybrid not in HYBRIDS:
            raise ValueError(f"ShardedTrainer: hybrid must be None (flat) or one of {HYBRIDS}, "
                             f"got {hybrid!r}")
        options = dict(shard_options or {})
        wanted = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        if "mixed_precision" not in options and wanted is not None:
            # zerocore's mixed precision, not autocast: the gathered parameters are 16-bit and
            # the gradients are reduced in fp32, as DeepSpeed does by default.
            options["mixed_precision"] = zerocore.MixedPrecision(wanted, torch.float32)
        dtype = options.get("mixed_precision", zerocore.MixedPrecision()).param_dtype
        if dtype != (wanted or torch.float32):
            raise ValueError(f"ShardedTrainer: TrainingArguments(bf16={args.bf16}, "
                             f"fp16={args.fp16}) but shard_options['mixed_precision'] computes "
                             f"in {dtype}; make them agree")
        # Trainer's parameter groups, decided on the unsharded model (it reads the parameters
        # that each module owns, which sharding takes away).
        self._decayed = set(self.get_decay_parameter_names(model))
        if "device" not in options and device.type != "cpu":
            options["device"] = device
        if hybrid is not None and "mesh" not in options:
            # The nodes are torchrun's, read here, at the door, as zerocore.shard_model reads
            # them for its start-up line.
            options["mesh"] = zerocore.mesh_from_environment(
                device.type, os.environ, what=f"ShardedTrainer(hybrid={hybrid!r})")
        if hybrid is not None and "hybrid" not in options:
            options["hybrid"] = zerocore.Hybrid(hybrid)
        self.sharding = zerocore.shard_model(
            model, default_units(model) if units is None else units, **options)
        # Steps every optimizer step: clipping and unscaling folded into the fused kernel; with
        # fp16 the dynamic loss scale and the skip of a step with an inf/nan gradient anywhere.
        self.loss_scaler = zerocore.LossScaler(self.sharding.group, dynamic=dtype == torch.float16,
                                               counter=self.sharding.counter,
                                               device=self.sharding.device)
        self._grad_stats: tuple[float, bool] | None = None  # this step's, once computed
        super().__init__(model=model, args=args, **kwargs)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # zerocore computes in the sharded dtype itself: no autocast, no GradScaler.
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

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
            self.optimizer = _ScaledStep(optimizer, self._optimizer_step)
        return self.optimizer

    @property
    def zerocore_optimizer(self) -> zerocore.optim.AdamW:
        """The ``zerocore.optim.AdamW`` that steps the shards (under accelerate's wrapper)."""
        return self.optimizer.optimizer

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        # The model itself, not the wrapper: Trainer reads its class (whether the label
        # smoother shifts labels), and accelerate does not know the wrapper.
        model = model.module if isinstance(model, _TrainStep) else model
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        if not (self.loss_scaler.dynamic and torch.is_grad_enabled()):
            return out
        loss, rest = out if return_outputs else (out, None)
        # In fp32: an fp16 loss times 65536 would overflow by itself.
        loss = _ScaleGrad.apply(loss.float(), self.loss_scaler.loss_scale)
        return (loss, rest) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: Any,
                      num_items_in_batch: Any = None) -> torch.Tensor:
        # HSDP: the replicas' all-reduce with the backward of the accumulation's last
        # micro-batch alone (Trainer's own boundary: accelerate's sync_gradients, which its
        # optimizer step follows); the earlier ones' sums wait in fp32. Flat: nothing changes.
        self.sharding.set_requires_all_reduce(bool(self.accelerator.sync_gradients))
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # Only measured here: the clipping happens in the step, inside the fused kernel.
        return self._global_grad_norm()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self._global_grad_norm() if grad_norm is None else grad_norm

    def _global_grad_norm(self) -> torch.Tensor:
        """Collective: the norm of the unscaled gradients over every rank's shards (nan when one
        is inf or nan), the same on every rank; kept for this step's ``_optimizer_step``."""
        grads = [s.grad for s in self.sharding.trainable_shards() if s.grad is not None]
        self.sharding.lockstep.before_step(STATS)  # the ranks agree on where they are first
        self._grad_stats = global_grad_stats(grads, self.sharding.group, self.sharding.counter,
                                             self.sharding.device)
        return torch.tensor(self.loss_scaler.grad_norm(*self._grad_stats))

    def _optimizer_step(self) -> bool:
        """Steps the shards; True when the step was skipped (fp16: a gradient overflowed)."""
        if self._grad_stats is None:
            self._global_grad_norm()
        stats, self._grad_stats = self._grad_stats, None
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else None
        result = self.loss_scaler.step_with_stats(self.zerocore_optimizer, *stats,
                                                  max_norm=max_norm)
        if result.skipped and not self.loss_scaler.dynamic and self.args.should_log:
            # fp16 skips steps by design; in bf16/fp32 an inf/nan gradient is a diverged run.
            logger.warning(f"ShardedTrainer: step {self.state.global_step + 1} skipped: a "
                           f"gradient is inf or nan on some rank (the run may have diverged)")
        return result.skipped

    # -- saving and resuming -------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: gathers the model onto rank 0, which writes what ``Trainer`` would: the
        adapter of a PEFT model (only the trainable parameters travel), else the whole model
        (``save_pretrained``), with the tokenizer and the arguments."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = self.sharding.full_state_dict(trainable_only=_is_peft(self.model), to_rank=0)
        if self.args.should_save:
            with _modules_report_their_parameters(self.model, state):
                self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        zerocore.save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.state.global_step,
                                 self.sharding, self.zerocore_optimizer, scaler=self.loss_scaler,
                                 keep_last=0)
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
                                 self.zerocore_optimizer, scaler=self.loss_scaler)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(scheduler):
            raise ValueError(f"ShardedTrainer: {checkpoint} has no {SCHEDULER_NAME}; without it "
                             f"the learning-rate schedule would restart at step 0")
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


    def _load_best_model(self) -> None:
        # load_best_model_at_end: the best checkpoint's weights (and its optimizer state, which
        # training no longer needs), from its zerocore checkpoint, on every rank.
        zerocore.load_checkpoint(_zerocore_checkpoint(self.state.best_model_checkpoint),
                                 self.sharding, self.zerocore_optimizer, scaler=self.loss_scaler)


@contextlib.contextmanager
def _modules_report_their_parameters(model: nn.Module,
                                     state: dict[str, torch.Tensor]) -> Iterator[None]:
    """While a save runs: each module's ``state_dict()`` holds its own parameters again, as
    unsharded, valued from ``state`` (the gathered full state, the model's names). Sharding took
    them off the modules, and PEFT chooses what to save of a ``modules_to_save`` copy by asking
    that module for its keys (``ModulesToSaveWrapper.adapter_state_dict``): without them the
    trained copy is left out of the adapter, which then does not reload. Public hooks
    (``register_state_dict_post_hook``), removed when the save ends."""
    own: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        own.setdefault(module, {})[leaf] = tensor
    handles = []
    for name, module in model.named_modules():
        if own.get(name):
            def report(mod: nn.Module, sd: dict, prefix: str, meta: Any,
                       mine: dict[str, torch.Tensor] = own[name]) -> None:
                for leaf, tensor in mine.items():
                    sd.setdefault(prefix + leaf, tensor)
            handles.append(module.register_state_dict_post_hook(report))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
        raise ValueError(f"ShardedTrainer: {checkpoint} holds no committed zerocore checkpoint "
                         f"({CHECKPOINT_DIR}/step-N): it was not written by ShardedTrainer, or "
                         f"with save_only_model=True, or the save was cut short; resume from an "
                         f"earlier checkpoint-N")
    return steps[-1]


def _refuse_unsupported(model: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """One line for each of Trainer's options that a sharded model cannot honour (each would
    otherwise be ignored or act on the shards as if they were the model)."""
    optimizers = kwargs.get("optimizers", (None, None))
    optim = getattr(args.optim, "value", args.optim)
    refused = [
        (not isinstance(model, nn.Module),
         "model must be the nn.Module itself (load it first: it is sharded before Trainer "
         "sees it); model_init is not supported either"),
        (kwargs.get("model_init") is not None, "model_init is not supported: pass the model"),
        (tuple(optimizers) != (None, None),
         "optimizers=(...) is not supported: the optimizer is zerocore's AdamW over the flat "
         "shards, built from TrainingArguments, and a scheduler must be built on it: override "
         "create_scheduler for a schedule of your own"),
        (kwargs.get("optimizer_cls_and_kwargs") is not None,
         "optimizer_cls_and_kwargs is not supported (zerocore's AdamW steps the shards)"),
        (optim not in ("adamw_torch", "adamw_torch_fused"),
         f"optim={optim} is not supported: zerocore's AdamW steps the shards (leave "
         f"optim at its default)"),
        (args.fp16_full_eval or args.bf16_full_eval,
         "fp16_full_eval/bf16_full_eval are not supported (they would cast the shards); "
         "evaluation computes in the sharded dtype already"),
        (args.save_on_each_node,
         "save_on_each_node is not supported: rank 0 gathers and writes the export, and the "
         "sharded checkpoints need one file system that every rank writes to"),
        (args.save_only_model and args.load_best_model_at_end,
         "save_only_model=True with load_best_model_at_end=True is not supported: the best "
         "weights are loaded from the checkpoints' zerocore state, which save_only_model "
         "leaves out"),
        (args.torch_compile, "torch_compile is not supported with ShardedTrainer yet"),
        (args.n_gpu > 1,
         "one process sees several GPUs (Trainer would use DataParallel): start one process "
         "per GPU with torchrun"),
    ]
    for bad, why in refused:
        if bad:
            raise ValueError(f"ShardedTrainer: {why}")
