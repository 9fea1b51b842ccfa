"""python -m neox.finetune: fine-tune a GPT-NeoX model with zerocore's ZeRO-3 sharding.

With no arguments: a tiny randomly initialised GPT-NeoX, bias fine-tuning, tiny_shakespeare (or
the offline fallback corpus), 2 gloo processes on the CPU; a couple of minutes on 2 cores.
With CUDA GPUs: one process per GPU over NCCL. Under torchrun (RANK/WORLD_SIZE set): joins that
process group, which is how it runs across machines.

This module is the edge: it parses the flags into a ``neox.recipe.Recipe``, checks everything
that can be checked before a process starts (flag ranges, files, the model's block count, the
output directory), and hands the run to ``neox.launch``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from neox import data as nd
from neox.cli import (ALL_BLOCKS, HelpFormatter, Parser, UsageError, add_mode_arguments,
                      add_model_arguments, add_step_arguments, auto_mode, default_data_dir_flag,
                      finite_float, nonnegative_int, parse_layers, positive_int, preset_config,
                      recompute_blocks)
from neox import from_deepspeed as nds
from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode
from neox.launch import LaunchConfig, RunRequest, launch, run_under_torchrun
from neox.recipe import (DataConfig, LoopConfig, ModelRecipe, OptimConfig, OutputConfig, Recipe,
                         RecipeError, recipe_from_checkpoint)
from neox.run_dir import (CHECKPOINTS, OutputDirError, find_resume_checkpoint,
                           warn_incomplete)
from neox.weights import WeightsError, open_weights
from zerocore.checkpoint import CheckpointError, open_checkpoint, unverified_reason


# The defaults of a fine-tuning run, and what replaces them when there are no pretrained
# weights: a randomly initialised model learns nothing useful through its biases alone, so the
# built-in run (no --checkpoint) trains the whole preset, at a learning rate and for a number of
# epochs at which the tiny preset visibly learns in a couple of minutes on 2 CPU cores.
FINETUNE_DEFAULTS = {"finetune": auto_mode(has_weights=True), "lr": 3e-4, "warmup": 0,
                     "epochs": 1}
FROM_SCRATCH = {"finetune": auto_mode(has_weights=False), "lr": 2e-3, "warmup": 5, "epochs": 3}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m neox.finetune", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter)
    add_model_arguments(p, for_training=True)
    add_mode_arguments(p)
    add_step_arguments(p)
    d = p.add_argument_group("data")
    d.add_argument("--data", type=Path, default=None,
                   help="a local UTF-8 text file to train on (default: tiny_shakespeare)")
    d.add_argument("--data-dir", type=Path, default=default_data_dir_flag(),
                   help="local copies of the default corpus and tokenizer (default: "
                        "shared/data beside the repository)")
    d.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json (default: the checkpoint's, else a byte-level BPE trained "
                        "on the corpus and cached)")
    d.add_argument("--cache-dir", type=Path, default=nd.default_cache_dir(),
                   help="downloaded corpus, trained tokenizers and tokenised data are kept here")
    d.add_argument("--val-fraction", type=finite_float, default=0.1,
                   help="fraction of the windows (the corpus's end) held out for validation")
    o = p.add_argument_group("optimisation (on --resume, given flags override the checkpoint's)")
    o.add_argument("--lr", type=finite_float, default=FINETUNE_DEFAULTS["lr"],
                   help=f"peak learning rate (default: {FINETUNE_DEFAULTS['lr']:g}; "
                        f"{FROM_SCRATCH['lr']:g} when training from scratch)")
    o.add_argument("--warmup", type=nonnegative_int, default=FINETUNE_DEFAULTS["warmup"],
                   help=f"linear warm-up steps (default: {FINETUNE_DEFAULTS['warmup']}; "
                        f"{FROM_SCRATCH['warmup']} when training from scratch)")
    o.add_argument("--weight-decay", type=finite_float, default=0.0,
                   help="AdamW decoupled weight decay")
    o.add_argument("--betas", type=finite_float, nargs=2, default=(0.9, 0.999),
                   metavar=("BETA1", "BETA2"), help="Adam's moment decay rates")
    o.add_argument("--eps", type=finite_float, default=1e-8, help="Adam's epsilon")
    o.add_argument("--clip", type=finite_float, default=1.0,
                   help="global gradient-norm clip (0: off)")
    t = p.add_argument_group("training loop")
    t.add_argument("--epochs", type=positive_int, default=FINETUNE_DEFAULTS["epochs"],
                   help=f"passes over the training windows, each seen once per epoch (default: "
                        f"{FINETUNE_DEFAULTS['epochs']}; {FROM_SCRATCH['epochs']} when training "
                        f"from scratch)")
    t.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many steps (default: the epochs' steps)")
    t.add_argument("--eval-every", type=nonnegative_int, default=0,
                   help="validate every N steps (0: at the end only)")
    t.add_argument("--max-nonfinite-steps", type=positive_int, default=3,
                   help="stop the run when the loss or the gradients have been NaN or infinite "
                        "this many steps in a row (nothing non-finite is ever saved)")
    c = p.add_argument_group("output and checkpoints")
    c.add_argument("--output-dir", type=Path, default=Path("runs") / "neox-finetune",
                   help="metrics.jsonl, checkpoints/, trainable.safetensors, hf/ go here; one "
                        "run per directory")
    c.add_argument("--save-every", type=nonnegative_int, default=0,
                   help="save a sharded checkpoint every N steps (0: only at the end)")
    c.add_argument("--keep-last", type=positive_int, default=3,
                   help="checkpoints of this run to keep")
    c.add_argument("--resume", type=Path, default=None,
                   help="continue a run from a checkpoint (a step-XXXXXXXX directory, or a folder "
                        "of them: the newest of its run); flags not given are the checkpoint's; "
                        "any number of ranks. Or continue a DeepSpeed ZeRO-3 run of a GPT-NeoX "
                        "model (its directory holding 'latest', or a global_stepN directory) as "
                        "a new run of the flags given (the same model and --finetune mode): its "
                        "weights, Adam state and step are loaded, the optimizer flags not given "
                        "are its; its data order is not saved, so the sampler starts at the "
                        "beginning")
    c.add_argument("--allow-unverified", action="store_true",
                   help="with --resume: accept a checkpoint of an older format (1 or 2), whose "
                        "rank files do not record which save, rank and step they are of")
    c.add_argument("--data-changed", action="store_true",
                   help="with --resume: the training text differs from the one the run trained "
                        "on, and that is intended; the weights and optimizer continue, the data "
                        "order restarts at the beginning of the current epoch")
    c.add_argument("--overwrite", action="store_true",
                   help="start a new run in an output directory that holds another run, deleting "
                        "its checkpoints, metrics and exports first")
    c.add_argument("--export-hf", action="store_true",
                   help="also write the fine-tuned model as a Hugging Face directory (LoRA "
                        "merged) to OUTPUT_DIR/hf")
    c.add_argument("--measure-memory", action="store_true",
                   help="measure each rank's peak memory over the training steps after the "
                        "first (torch's profiler on the CPU, the allocator's peak on a GPU) and "
                        "print it beside python -m neox.plan's prediction, with each rank's "
                        "peak resident set")
    c.add_argument("--sample-tokens", type=nonnegative_int, default=48,
                   help="print a sample of this many tokens at the end, continuing the start of "
                        "the validation text (0: none)")
    r = p.add_argument_group("processes")
    r.add_argument("--nproc", type=positive_int, default=2,
                   help="CPU processes (gloo) when there is no GPU; with GPUs: one per GPU, at "
                        "most the GPU count")
    r.add_argument("--oversubscribe", action="store_true",
                   help="allow more CPU processes than this machine has cores")
    r.add_argument("--port", type=nonnegative_int, default=0,
                   help="rendezvous port (0: pick a free one)")
    r.add_argument("--timeout", type=finite_float, default=300.0,
                   help="seconds a collective may wait before the run fails instead of hanging")
    r.add_argument("--cpu", action="store_true", help="use the CPU (gloo) even if GPUs exist")
    return p


# Each flag that is part of the recipe: (recipe part, field). Flags that say which model and
# data a run trains are its identity: a resumed run must keep them. The others apply when
# given on --resume, overriding the checkpoint's value with a log line.
IDENTITY_FLAGS = ("checkpoint", "model", "filter_layers", "allow_outside_weights", "dtype",
                  "frozen_weights", "seed", "finetune", "lora_rank", "lora_alpha", "lora_targets",
                  "data", "tokenizer", "seq_len", "val_fraction")
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "lr": ("optim", "lr"), "warmup": ("optim", "warmup"),
    "weight_decay": ("optim", "weight_decay"), "betas": ("optim", "betas"),
    "eps": ("optim", "eps"), "clip": ("optim", "clip"),
    "batch_size": ("loop", "batch_size"), "grad_accum": ("loop", "grad_accum"),
    "epochs": ("loop", "epochs"), "max_steps": ("loop", "max_steps"),
    "eval_every": ("loop", "eval_every"), "offload_optimizer": ("loop", "offload_optimizer"),
    "max_nonfinite_steps": ("loop", "max_nonfinite_steps"),
    "activation_checkpointing": ("loop", "activation_checkpointing"),
    "activation_checkpointing_every": ("loop", "activation_checkpointing_every"),
    "keep_gathered": ("loop", "keep_gathered"),
    "output_dir": ("output", "output_dir"), "save_every": ("output", "save_every"),
    "keep_last": ("output", "keep_last"), "export_hf": ("output", "export_hf"),
    "sample_tokens": ("output", "sample_tokens"),
    "measure_memory": ("output", "measure_memory"),
    "data_dir": ("data", "data_dir"), "cache_dir": ("data", "cache_dir"),
    "reduce_dtype": ("model", "reduce_dtype"),
}


def explicit_flags(argv: Sequence[str] | None) -> set[str]:
    """The destinations of the flags actually given on the command line (not defaults)."""
    probe = build_parser()
    # argparse fills in a default only where the namespace lacks the attribute: start from a
    # namespace holding a marker everywhere, and what the command line set is what changed.
    marker = object()
    namespace = argparse.Namespace(**{dest: marker for dest in vars(probe.parse_args([]))})
    probe.parse_args(argv, namespace=namespace)
    return {dest for dest, value in vars(namespace).items() if value is not marker}


def _path(p: Path | None) -> str | None:
    """A path as the recipe stores it: absolute, so that the run can be resumed and exported
    from any working directory."""
    return None if p is None else str(p.resolve())


def recipe_from_flags(args: argparse.Namespace, filter_layers: tuple[int, ...] | None,
                      num_blocks: int | None = None) -> Recipe:
    """The recipe the flags describe (``filter_layers`` already checked against the model's
    ``num_blocks``, which is read from the model when not given)."""
    recomputed: tuple[int, ...] = ()
    if args.activation_checkpointing is not None:
        if num_blocks is None:
            num_blocks = model_blocks(args)
        kept = filter_layers if filter_layers is not None else tuple(range(num_blocks))
        choice = args.activation_checkpointing
        if choice != ALL_BLOCKS:
            choice = parse_layers(choice, flag="--activation-checkpointing").blocks(num_blocks)
        recomputed = recompute_blocks(choice, kept)
    try:
        mode = FinetuneMode(args.finetune, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                            lora_targets=tuple(t.strip() for t in args.lora_targets.split(",")
                                               if t.strip()),
                            seed=args.seed)
        return Recipe(
            model=ModelRecipe(checkpoint=_path(args.checkpoint), preset=args.model, seed=args.seed,
                              filter_layers=filter_layers, finetune=mode, dtype=args.dtype,
                              reduce_dtype=args.reduce_dtype,
                              allow_outside_weights=args.allow_outside_weights,
                              frozen_weights=args.frozen_weights),
            data=DataConfig(data=_path(args.data), data_dir=_path(args.data_dir),
                            tokenizer=_path(args.tokenizer), cache_dir=_path(args.cache_dir),
                            seq_len=args.seq_len, val_fraction=args.val_fraction),
            optim=OptimConfig(lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                              clip=args.clip, betas=tuple(args.betas), eps=args.eps),
            loop=LoopConfig(batch_size=args.batch_size, grad_accum=args.grad_accum,
                            epochs=args.epochs, max_steps=args.max_steps,
                            eval_every=args.eval_every, seed=args.seed,
                            offload_optimizer=args.offload_optimizer,
                            max_nonfinite_steps=args.max_nonfinite_steps,
                            activation_checkpointing=recomputed,
                            activation_checkpointing_every=args.activation_checkpointing_every,
                            keep_gathered=args.keep_gathered),
            output=OutputConfig(output_dir=str(args.output_dir), save_every=args.save_every,
                                keep_last=args.keep_last, export_hf=args.export_hf,
                                sample_tokens=args.sample_tokens,
                                measure_memory=args.measure_memory))
    except (RecipeError, ValueError) as e:
        raise UsageError(_flag_message(str(e))) from None


def _flag_message(message: str) -> str:
    """A recipe's validation message in terms of the flag ("recipe.optim: lr must be ..." ->
    "--lr must be ...")."""
    for phrase, flag in (("LoRA rank", "--lora-rank"), ("LoRA alpha", "--lora-alpha"),
                         ("LoRA targets", "--lora-targets")):
        if message.startswith(phrase):
            return f"{flag}: {message}"
    for part in ("model", "data", "optim", "loop", "output"):
        prefix = f"recipe.{part}: "
        if message.startswith(prefix):
            rest = message[len(prefix):]
            field, _, tail = rest.partition(" ")
            return f"--{field.replace('_', '-')} {tail}"
    return message


def resolve_auto_mode(args: argparse.Namespace, log: Any) -> None:
    """``--finetune auto``: biases when there are pretrained weights (or a checkpoint to resume,
    whose own mode then applies); without them, training from scratch, with the from-scratch
    defaults for the flags that were not given."""
    if args.finetune != "auto":
        return
    if args.checkpoint is not None or args.resume is not None:
        args.finetune = auto_mode(has_weights=True)
        return
    for dest, value in FROM_SCRATCH.items():
        if dest not in args.explicit or dest == "finetune":
            setattr(args, dest, value)
    log(f"no --checkpoint: there are no pretrained weights to fine-tune, so this run trains the "
        f"{args.model} preset from scratch (--finetune full, --lr {args.lr:g}, --warmup "
        f"{args.warmup}, --epochs {args.epochs}); give --checkpoint DIR to fine-tune pretrained "
        f"weights (their biases by default)")


def check_flags(args: argparse.Namespace, use_cuda: bool) -> None:
    """What can be known to be wrong from the flags and the file system alone."""
    paths = (("--data", args.data, "file"), ("--checkpoint", args.checkpoint, "directory"),
             ("--tokenizer", args.tokenizer, "file or directory"),
             ("--resume", args.resume, "directory"))
    for flag, path, kind in paths:
        if path is None:
            continue
        if not path.exists():
            raise UsageError(f"{flag} {path}: no such {kind}")
        if kind == "file" and not path.is_file():
            raise UsageError(f"{flag} {path}: not a file")
    if not 0 < args.timeout <= 24 * 3600:
        raise UsageError(f"--timeout {args.timeout:g}: must be more than 0 and at most a day "
                         f"(86400 seconds)")
    if args.port > 65535:
        raise UsageError(f"--port {args.port}: ports go up to 65535 (0 picks a free one)")
    if use_cuda:
        gpus = torch.cuda.device_count()
        if args.nproc > gpus and "nproc" in args.explicit:
            raise UsageError(f"--nproc {args.nproc}: this machine has {gpus} GPU(s); neox runs "
                             f"one process per GPU")
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        if args.nproc > cores and not args.oversubscribe:
            raise UsageError(f"--nproc {args.nproc}: this machine has {cores} CPU core(s) "
                             f"available; more processes than cores only contend (and each holds "
                             f"a copy of the data and one layer); use --nproc {cores}, or "
                             f"--oversubscribe to run them anyway")


def model_config(args: argparse.Namespace) -> NeoXConfig:
    """The configuration of the model the flags name, reading at most a config file (a tiny
    preset's vocabulary is the tokenizer's, not known yet)."""
    if args.checkpoint is None:
        return preset_config(args.model)
    try:
        with open_weights(args.checkpoint, allow_outside=args.allow_outside_weights) as reader:
            return reader.config
    except WeightsError as e:
        raise UsageError(f"--checkpoint: {e}") from None


def model_blocks(args: argparse.Namespace) -> int:
    """The block count of the model the flags name."""
    return model_config(args).num_hidden_layers


# The optimizer flags a run resumed from DeepSpeed takes from the DeepSpeed run when not given.
DEEPSPEED_OPTIM_FLAGS = ("lr", "betas", "eps", "weight_decay")


def deepspeed_recipe(args: argparse.Namespace, flags: Recipe, log: Any) -> Recipe:
    """The recipe of a run continuing the DeepSpeed checkpoint ``args.resume``: the flags',
    with the DeepSpeed run's optimizer settings for the optimizer flags not given. The
    checkpoint is opened and checked whole (its pickles read safely), and what the flags train
    is checked against what it trained, before any process starts."""
    for flag in ("allow_unverified", "data_changed"):
        if getattr(args, flag):
            raise UsageError(f"--{flag.replace('_', '-')} applies to a neox checkpoint; a "
                             f"DeepSpeed checkpoint is checked whole, and records no data order "
                             f"(the run's sampler starts at the beginning)")
    try:
        ckpt = nds.DeepSpeedCheckpoint(args.resume)
        nds.check_resume(ckpt, model_config(args), flags.model)
    except (CheckpointError, ValueError) as e:  # DeepSpeedCheckpointError is both
        raise UsageError(f"--resume: {e}") from None
    theirs = nds.optimizer_settings(ckpt)
    parts = flags.to_dict()
    for dest in DEEPSPEED_OPTIM_FLAGS:
        if dest in theirs and dest not in args.explicit:
            value = list(theirs[dest]) if dest == "betas" else theirs[dest]
            if parts["optim"][dest] != value:
                log(f"resume: --{dest.replace('_', '-')} {_show(value)}: the DeepSpeed run's "
                    f"(give the flag to change it)")
            parts["optim"][dest] = value
    log(f"resume: continuing the DeepSpeed run of {nds.describe(ckpt)} as a new run of these "
        f"flags")
    return Recipe.from_dict(parts)


def resume_recipe(args: argparse.Namespace, flags: Recipe, checkpoint: Path,
                  log: Any) -> Recipe:
    """The recipe of a resumed run: the checkpoint's, with the flags that were given applied.
    Flags that change which model or data is trained must agree with the checkpoint. The whole
    checkpoint is verified first (every rank file's checksum, identity and contents): nothing
    its recipe names (data, cache, output directory, weights) is opened before."""
    try:
        manifest = open_checkpoint(checkpoint,
                                   allow_unverified=args.allow_unverified).manifest
        stored, _ = recipe_from_checkpoint(manifest["extra"], str(checkpoint))
    except (RecipeError, CheckpointError) as e:
        raise UsageError(f"--resume: {e}") from None
    if unverified_reason(manifest):
        log(f"note: {checkpoint} cannot be verified ({unverified_reason(manifest)}); resuming "
            f"from it as --allow-unverified asks")
    mine, theirs = flags.to_dict(), stored.to_dict()
    for dest in [d for d in IDENTITY_FLAGS if d in args.explicit]:
        ours, saved = _identity_value(mine, dest), _identity_value(theirs, dest)
        if dest in ("checkpoint", "data", "tokenizer") and ours is not None \
                and saved is not None:
            ours, saved = str(Path(ours).resolve()), str(Path(saved).resolve())
        if ours != saved:
            raise UsageError(
                f"--{dest.replace('_', '-')} {_show(ours)} differs from the checkpoint's "
                f"{_show(saved)}; a resumed run continues the same model and data: drop the "
                f"flag, or start a new run (without --resume)")
    parts = {name: dict(theirs[name]) for name in ("model", "data", "optim", "loop", "output")}
    for dest, (part, field) in FLAG_FIELDS.items():
        if dest in args.explicit and mine[part][field] != theirs[part][field]:
            parts[part][field] = mine[part][field]
            log(f"resume: --{dest.replace('_', '-')} {_show(mine[part][field])} overrides the "
                f"checkpoint's {_show(theirs[part][field])}")
    return Recipe.from_dict({"version": theirs["version"], **parts})


def _identity_value(recipe: dict[str, Any], dest: str) -> Any:
    model, data = recipe["model"], recipe["data"]
    mode = model["finetune"]
    return {"checkpoint": model["checkpoint"], "model": model["preset"],
            "filter_layers": model["filter_layers"], "dtype": model["dtype"],
            "allow_outside_weights": model["allow_outside_weights"], "seed": model["seed"],
            "finetune": mode["mode"], "lora_rank": mode["lora_rank"],
            "lora_alpha": mode["lora_alpha"], "lora_targets": mode["lora_targets"],
            "data": data["data"], "tokenizer": data["tokenizer"], "seq_len": data["seq_len"],
            "val_fraction": data["val_fraction"]}[dest]


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return "(none)" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.explicit = explicit_flags(argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    log = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    try:
        check_flags(args, use_cuda)
        resolve_auto_mode(args, log)
        ranges = parse_layers(args.filter_layers)
        num_blocks = model_blocks(args)
        kept = ranges.blocks(num_blocks) if ranges is not None else None
        recipe = recipe_from_flags(args, kept, num_blocks)
        resume = deepspeed = None
        for flag in ("allow_unverified", "data_changed"):
            if getattr(args, flag) and args.resume is None:
                raise UsageError(f"--{flag.replace('_', '-')} applies to --resume only")
        if args.resume is not None and nds.is_deepspeed_checkpoint(args.resume):
            deepspeed = args.resume.resolve()
            recipe = deepspeed_recipe(args, recipe, log)
        elif args.resume is not None:
            resume = find_resume_checkpoint(args.resume, Path(recipe.output.output_dir)
                                            if "output_dir" in args.explicit else None)
            recipe = resume_recipe(args, recipe, resume, log)
            # (The output directory's own checkpoints are reported when it is taken.)
            own = (Path(recipe.output.output_dir) / CHECKPOINTS).resolve()
            if resume != args.resume and args.resume.resolve() != own:
                warn_incomplete(args.resume, log)
    except (UsageError, OutputDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    launch_config = LaunchConfig(nproc=args.nproc, port=args.port, timeout=args.timeout,
                                 use_cuda=use_cuda)
    request = RunRequest(recipe=recipe, resume=resume, overwrite=args.overwrite,
                         allow_unverified=args.allow_unverified, data_changed=args.data_changed,
                         deepspeed=deepspeed)
    if torchrun:  # possibly many machines: this process is one rank of torchrun's group
        return run_under_torchrun(request, launch_config)
    return launch(request, launch_config)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The run is over (its ranks are gone, the output directory's lock released): leave
    # without the interpreter's teardown, which with torch imported takes 0.5-0.7 s on a busy
    # 2-core machine; after SIGTERM it counted against the 2 s in which the run must be gone.
    os._exit(code)
