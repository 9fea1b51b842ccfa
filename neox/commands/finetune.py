"""python -m neox.finetune: fine-tune a GPT-NeoX model with zerocore's ZeRO-3 sharding.

With no arguments: a tiny randomly initialised GPT-NeoX, bias fine-tuning, tiny_shakespeare (or
the offline fallback corpus), 2 gloo processes on the CPU; a couple of minutes on 2 cores.
With CUDA GPUs: one process per GPU over NCCL. Under torchrun (RANK/WORLD_SIZE set): joins that
process group, which is how it runs across machines.

This module is the edge: it parses the flags into a ``neox.run.recipe.Recipe``, checks everything
that can be checked before a process starts (flag ranges, files, the model's block count, the
output directory), and hands the run to ``neox.run.launch``. Under torchrun the ranks first agree
the flags every node parsed for itself (``neox.run.same_recipe``), then run those checks together.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch

import zerocore
from neox.blocks import chosen_blocks
from neox.commands.flags import (HelpFormatter, Parser, add_recipe_flags, explicit_flags, finite,
                                 nonnegative_int, positive_int, recipe_argument)
from neox.config import NeoXConfig, preset_config
from neox.dtypes import resolve_dtype
from neox.finetune_modes import GROUP as MODE, auto_mode
from neox.run import from_deepspeed as nds
from neox.run.invocation import Invocation
from neox.run.launch import (LaunchConfig, RunRequest, launch, local_world_size,
                             run_under_torchrun)
from neox.run.layout import check_layout
from neox.run.progress import say
from neox.run.layout_choice import auto_placement
from neox.run.planning import request_from_recipe
from neox.run.recipe import (AUTO_PLACEMENT, DATA, LOOP, MODEL, OPTIM, OUTPUT, STEP, FROM_SCRATCH,
                             Recipe, recipe_from_flags)
from neox.run.resume import deepspeed_recipe, resume_recipe
from neox.run.same_recipe import given_flags
from neox.run.run_dir import CHECKPOINTS, OutputDirError, find_resume_checkpoint, warn_incomplete
from neox.setting import UsageError
from neox.weights import WeightsError, open_weights

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m neox.finetune", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter)
    groups = add_recipe_flags(p, (MODEL, MODE, STEP, DATA, OPTIM, LOOP, OUTPUT))
    for field in dataclasses.fields(Invocation):
        recipe_argument(groups[OUTPUT], field)
    r = p.add_argument_group("processes")
    r.add_argument("--nproc", type=positive_int, default=2,
                   help="CPU processes (gloo) when there is no GPU; with GPUs: one per GPU, at "
                        "most the GPU count")
    r.add_argument("--oversubscribe", action="store_true",
                   help="allow more CPU processes than this machine has cores")
    r.add_argument("--port", type=nonnegative_int, default=0,
                   help="rendezvous port (0: pick a free one)")
    r.add_argument("--timeout", type=finite, default=300.0,
                   help="seconds a collective may wait before the run fails instead of hanging")
    r.add_argument("--cpu", action="store_true", help="use the CPU (gloo) even if GPUs exist")
    r.add_argument("--nodes", type=positive_int, default=None,
                   help="with --hybrid on one machine: lay the --nproc ranks out as this many "
                        "nodes, as torchrun numbers them (node by node), to try a layout before "
                        "renting the machines; under torchrun the nodes are torchrun's")
    return p


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
    # Directories the run creates if need be: what exists of each path must be a directory.
    for flag, path in (("--cache-dir", args.cache_dir), ("--data-dir", args.data_dir)):
        there = next((p for p in [path, *path.parents] if p.exists()), None) \
            if path is not None else None
        if there is not None and not there.is_dir():
            raise UsageError(f"{flag} {path}: {'it' if there == path else there} is a file, "
                             f"not a directory; give a directory (it is created if need be)")
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


def auto_placed(recipe: Recipe, config: NeoXConfig, *, world_size: int, use_cuda: bool,
                nodes: int, log: Any) -> Recipe:
    """``recipe`` with the placement ``--frozen-placement auto`` stands for: the plan's
    (``neox.run.layout_choice.auto_placement``) for this run's ranks and one device's memory
    (a GPU's; on the CPU the host's available memory shared by the processes), said once."""
    if use_cuda:
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // world_size
    device = torch.device("cuda" if use_cuda else "cpu")
    request = request_from_recipe(recipe, config, world_size=world_size, device=device.type,
                                  dtype=resolve_dtype(recipe.model.dtype, device), nodes=nodes)
    placement, line = auto_placement(request, memory)
    log(line)
    return dataclasses.replace(recipe, sharding=dataclasses.replace(
        recipe.sharding, frozen_placement=placement))


def run_request(args: argparse.Namespace, use_cuda: bool, log: Any, *, torchrun: bool,
                nodes: int | None) -> RunRequest:
    """The run the flags ask for, checked as far as the flags, the file system and the nodes
    allow (``nodes``: torchrun's, or --nodes). Raises ``UsageError`` or ``OutputDirError``."""
    check_flags(args, use_cuda)
    resolve_auto_mode(args, log)
    # The recipe the flags describe, their block lists checked against the model's block count.
    kept, recomputed = chosen_blocks(args.filter_layers, args.activation_checkpointing,
                                     model_config(args).num_hidden_layers)
    # --frozen-placement auto is resolved below, once a resume's recipe is merged: until then
    # the placement is the default's (a recipe never holds "auto").
    auto = args.frozen_placement == AUTO_PLACEMENT
    recipe = recipe_from_flags(vars(args) | ({"frozen_placement": "sharded"} if auto else {}),
                               {"filter_layers": kept, "activation_checkpointing": recomputed})
    resume = deepspeed = None
    for flag in ("allow_unverified", "data_changed"):
        if getattr(args, flag) and args.resume is None:
            raise UsageError(f"--{flag.replace('_', '-')} applies to --resume only")
    if args.resume is not None and nds.is_deepspeed_checkpoint(args.resume):
        for flag in ("allow_unverified", "data_changed"):
            if getattr(args, flag):
                raise UsageError(f"--{flag.replace('_', '-')} applies to a neox checkpoint; "
                                 f"a DeepSpeed checkpoint is checked whole, and records no "
                                 f"data order (the run's sampler starts at the beginning)")
        deepspeed = args.resume.resolve()
        recipe = deepspeed_recipe(recipe, args.explicit, args.resume, model_config(args), log)
    elif args.resume is not None:
        resume = find_resume_checkpoint(args.resume, Path(recipe.output.output_dir)
                                        if "output_dir" in args.explicit else None)
        recipe = resume_recipe(recipe, args.explicit, resume,
                               allow_unverified=args.allow_unverified, log=log)
        # (The output directory's own checkpoints are reported when it is taken.)
        own = (Path(recipe.output.output_dir) / CHECKPOINTS).resolve()
        if resume != args.resume and args.resume.resolve() != own:
            warn_incomplete(args.resume, log)
    problem = (recipe.offload.problem(for_a_run=True)  # (a resume's flags merged)
               or recipe.sharding.problem(offload=recipe.offload.offload,
                                          offload_device=recipe.offload.offload_device))
    if problem is not None:
        raise UsageError(problem)
    # The layout of the recipe (a resumed run's included) against the nodes.
    world = (int(os.environ["WORLD_SIZE"]) if torchrun else
             local_world_size(args.nproc, use_cuda))
    if auto:
        recipe = auto_placed(recipe, model_config(args), world_size=world, use_cuda=use_cuda,
                             nodes=nodes or 1, log=log)
    check_layout(recipe.layout, world_size=world, nodes=nodes, torchrun=torchrun,
                 nodes_given=args.nodes is not None)
    return RunRequest(recipe=recipe, resume=resume, overwrite=args.overwrite,
                      allow_unverified=args.allow_unverified, data_changed=args.data_changed,
                      deepspeed=deepspeed)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit = explicit_flags(parser, argv)
    use_cuda = torch.cuda.is_available() and not args.cpu
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    log = say if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    nodes = zerocore.nodes_of(os.environ) if torchrun else (args.nodes or 1)
    launch_config = LaunchConfig(nproc=args.nproc, port=args.port, timeout=args.timeout,
                                 use_cuda=use_cuda, nodes=nodes or 1)
    if torchrun:
        # Possibly many machines, each of which parsed its own flags: this process is one rank
        # of torchrun's group, and the ranks agree the flags, then check them, together.
        flags = given_flags(vars(args))
        return run_under_torchrun(
            lambda: run_request(args, use_cuda, log, torchrun=True, nodes=nodes), flags,
            launch_config)
    try:
        request = run_request(args, use_cuda, log, torchrun=False, nodes=nodes)
    except (UsageError, OutputDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return launch(request, launch_config)
