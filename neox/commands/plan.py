"""python -m neox.plan: what a neox.finetune run needs per GPU, and what it moves, before the
machines are rented.

It takes neox.finetune's own model, fine-tuning and step flags (the same names, defaults and
meanings: each is declared once, on its field of neox.run.recipe) plus the machines (--gpus per
node, --nodes, --gpu-memory) and prints, per rank: the shards of parameters, gradients, fp32
masters and Adam state (trainable and frozen apart), the layers gathered at the peak, the
activations with and without recomputation (of the attention kernel that runs: fused, no T x T
weights), the CUDA allocator's headroom, the total against the GPU's memory, and the bytes
all-gathered and reduce-scattered per optimizer step. On several --nodes it plans the layout
--hybrid and --quantize-gradients choose, then compares the layouts (flat, HSDP, HSDP with qgZ):
memory per GPU and bytes per step within and across the nodes. With --link it also plans every
layout of the frozen base (format x placement x keep-gathered budget x recomputation x offload
to the host, fitting --host-memory when given), estimates
each one's step time (neox.run.layout_choice says how) and recommends the fastest that fits;
--frozen-placement auto takes that choice. A --checkpoint is opened for its
configuration and tensor shapes only; no weights are read. The numbers come from
``zerocore.plan``, which runs the step's schedule on fake tensors; on the CPU it agrees with
measured runs (tests/engine/test_plan.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from typing import Any, Callable

import zerocore
from neox.blocks import chosen_blocks
from neox.commands.flags import (HelpFormatter, Parser, add_recipe_flags, argparse_type, finite,
                                 positive_int)
from neox.config import preset_config
from neox.dtypes import DTYPES
from neox.finetune_modes import GROUP as MODE, auto_mode
from neox.run.hardware import GPUS, LINKS, gpu_tflops_of, link_of
from neox.run.layout_choice import (DEFAULT_MFU, Machine, Row, auto_placement, candidates_table,
                                    evaluate, ranked, recommendation)
from neox.run.planning import (DEFAULT_BPE_TOKENS, GiB, Layout, PlanRequest, compare_layouts,
                               fits, layouts_table, needs, offload_of, plan_run,
                               request_from_recipe)
from neox.run.recipe import AUTO_PLACEMENT, MODEL, STEP, offload_words, recipe_from_flags
from neox.setting import UsageError
from neox.weights import WeightsError, open_weights

__all__ = ["build_parser", "main", "recommend", "request_of"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m neox.plan", description=__doc__.split("\n\n")[0],
               formatter_class=HelpFormatter)
    add_recipe_flags(p, (MODEL, MODE, STEP))
    m = p.add_argument_group("the machines")
    m.add_argument("--gpus", type=positive_int, default=8,
                   help="GPUs per node (one rank each)")
    m.add_argument("--nodes", type=positive_int, default=1, help="nodes")
    m.add_argument("--gpu-memory", type=finite, default=80.0, metavar="GIB",
                   help="memory of one GPU in GiB (80: A100/H100 80GB; 141: H200)")
    m.add_argument("--host-memory", type=finite, default=None, metavar="GIB",
                   help="host memory (RAM) of one node in GiB: the plan then also recommends "
                        "the least offload that fits the GPUs and the host (--offload, "
                        "--offload-device), keeping a tenth of the host for everything else; "
                        "with --link, the offloaded layouts must fit it too; the NVMe pool "
                        "(--offload-pool auto) is chosen from it (default: this machine's)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="plan GPU ranks (NCCL) or CPU processes (gloo, as neox.finetune --cpu "
                        "runs them; --gpus is then the process count)")
    m.add_argument("--vocab-size", type=positive_int, default=DEFAULT_BPE_TOKENS,
                   help="the tiny preset's vocabulary: its run takes the tokenizer's (the BPE "
                        "a run trains by default has 8192 tokens)")
    t = p.add_argument_group("the layout's step time (with --link: every frozen-base layout "
                             "planned, the fastest that fits recommended)")
    t.add_argument("--link", type=argparse_type(link_of), default=None, metavar="LINK",
                   help=f"the link between the GPUs of a node: a preset ({', '.join(LINKS)}) or "
                        f"GB/s in one direction")
    t.add_argument("--link-across", type=argparse_type(link_of), default=None, metavar="LINK",
                   help="the link each GPU has to the other nodes (with --nodes 2 or more): a "
                        "preset as --link's, or GB/s in one direction")
    t.add_argument("--link-host", type=argparse_type(link_of), default=link_of("pcie4"),
                   metavar="LINK", help="each GPU's link to the host, which offload's copies "
                                        "cross: a preset as --link's, or GB/s in one direction")
    t.add_argument("--gpu-tflops", type=argparse_type(gpu_tflops_of), default=GPUS["h100"],
                   metavar="GPU", help=f"the GPU's peak dense bf16 TFLOPS: a preset "
                                       f"({', '.join(GPUS)}) or a number (default: h100's)")
    t.add_argument("--mfu", type=finite, default=DEFAULT_MFU,
                   help="the fraction of that peak a step's matmuls reach")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    return p


def request_of(args: argparse.Namespace) -> PlanRequest:
    """The run the flags describe, checked; ``UsageError`` with the flag's name otherwise."""
    if args.checkpoint is not None:
        try:
            with open_weights(args.checkpoint,
                              allow_outside=args.allow_outside_weights) as reader:
                config = reader.config
        except WeightsError as e:
            raise UsageError(f"--checkpoint: {e}") from None
    else:
        config = preset_config(args.model, tokenizer_rows=args.vocab_size)
    kept, recomputed = chosen_blocks(args.filter_layers, args.activation_checkpointing,
                                     config.num_hidden_layers)
    values = dict(vars(args))
    if values["finetune"] == "auto":
        values["finetune"] = auto_mode(has_weights=args.checkpoint is not None)
    if values["frozen_placement"] == AUTO_PLACEMENT:   # main resolves it from the plans
        values["frozen_placement"] = "sharded"
    recipe = recipe_from_flags(values, {"filter_layers": kept,
                                        "activation_checkpointing": recomputed})
    if args.gpu_memory <= 0:
        raise UsageError(f"--gpu-memory {args.gpu_memory:g}: must be a number of GiB above 0")
    problem = (recipe.layout.problem()
               or recipe.sharding.problem(offload=recipe.offload.offload,
                                          offload_device=recipe.offload.offload_device))
    if problem is not None:
        raise UsageError(problem)
    if recipe.layout.hybrid is not None and args.nodes < 2:
        raise UsageError(f"--hybrid {recipe.layout.hybrid} replicates across nodes: plan it with "
                         f"--nodes 2 or more")
    if not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu {args.mfu:g}: must be a fraction of the GPU's peak, above 0 "
                         f"and at most 1")
    if args.link is not None and args.nodes > 1 and args.link_across is None:
        raise UsageError(f"--link on --nodes {args.nodes}: give --link-across too, the link "
                         f"between the nodes")
    if args.host_memory is not None and args.host_memory <= 0:
        raise UsageError(f"--host-memory {args.host_memory:g}: must be a number of GiB above 0")
    problem = recipe.offload.problem(for_a_run=False)
    if problem is not None:
        raise UsageError(problem)
    default_dtype = "bf16" if args.device == "cuda" else "fp32"  # neox.finetune's defaults
    return request_from_recipe(recipe, config, world_size=args.gpus * args.nodes,
                               device=args.device, dtype=DTYPES[args.dtype or default_dtype],
                               nodes=args.nodes,
                               host_memory=(None if args.host_memory is None
                                            else int(args.host_memory * GiB)))


def _as_dict(plan: zerocore.plan.MemoryPlan) -> dict[str, Any]:
    s = plan.state
    return {"trainable_numel": s.trainable_numel, "frozen_numel": s.frozen_numel,
            "state": s.bytes_of(), "on_host": sorted(s.on_host), "peak": plan.peak,
            "peak_phase": plan.peak_phase, "device_peak": plan.device_peak,
            "headroom": plan.headroom, "peak_bytes": plan.peak_bytes,
            "host_peak": plan.host_peak, "activations_peak": plan.activations_peak,
            "gathered_peak": plan.gathered_peak, "windows_peak": plan.windows_peak,
            "nvme_bytes": s.nvme, "nvme_pool_bytes": s.pool, "nvme_pool_chosen": s.pool_chosen,
            "all_gather_bytes": plan.all_gather_bytes,
            "reduce_scatter_bytes": plan.reduce_scatter_bytes,
            "recomputed_layers": list(plan.recomputed_layers),
            "loading_peak_bytes": plan.loading.peak, "loading_held_bytes": plan.loading.held}


def _row_dict(row: Row) -> dict[str, Any]:
    return dataclasses.asdict(row) | {"seconds": row.seconds}


# The offloads a plan tries, from the least traffic to the most: (--offload, --offload-device).
# Parameters on the host cost a copy per gather; NVMe, the disk's bandwidth.
CANDIDATES = ((None, "cpu"), ("optimizer", "cpu"), ("params", "cpu"), ("all", "cpu"),
              ("optimizer", "nvme"), ("params", "nvme"), ("all", "nvme"))
def _flags(offload: str | None, device: str) -> str:
    if offload is None:
        return "no offload"
    return f"--offload {offload}" + (" --offload-device nvme" if device == "nvme" else "")


def recommend(request: PlanRequest, *, ranks_per_node: int, gpu_memory: int,
              host_memory: int,
              plan: Callable[[PlanRequest], zerocore.plan.MemoryPlan] = plan_run
              ) -> tuple[tuple[str | None, str] | None, list[str]]:
    """The first of ``CANDIDATES`` that fits (None: none does), and a line for each tried
    (``plan``: ``plan_run`` or a cache of it)."""
    lines = []
    for offload, device in CANDIDATES:
        tried = dataclasses.replace(request, offload=offload in ("optimizer", "all"),
                                    offload_params=offload in ("params", "all"),
                                    offload_device=device)
        try:
            need = needs(plan(tried), ranks_per_node)
        except ValueError as e:  # the engine refuses it (a pool too small for the shards)
            lines.append(f"  {_flags(offload, device):<42}refused: {e}")
            continue
        ok = fits(need, request.device, gpu_memory, host_memory)
        gpu = f"{need[0] / GiB:.1f} GiB per GPU, " if request.device == "cuda" else ""
        nvme = f", {need[2] / GiB:.1f} GiB on NVMe" if need[2] else ""
        lines.append(f"  {_flags(offload, device):<42}{gpu}{need[1] / GiB:.1f} GiB of host "
                     f"memory per node{nvme}: {'fits' if ok else 'does not fit'}")
        if ok:
            return (offload, device), lines
    return None, lines


def main(argv: list[str] | None = None, *,
         plan: Callable[[PlanRequest], zerocore.plan.MemoryPlan] | None = None) -> int:
    """plan: a cache of ``plan_run`` to plan through (default: this call's own); a caller that
    runs the command more than once on one model (its text, then its JSON) may share one:
    a request's plan is the same every time."""
    args = build_parser().parse_args(argv)
    try:
        request = request_of(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    memory = int(args.gpu_memory * GiB)
    if plan is None:   # (a candidate may be the request)
        plan = functools.lru_cache(maxsize=None)(plan_run)
    # The layout choice counts each candidate's FLOPs; the request counts them too then, so
    # that a candidate equal to it is planned once.
    request = dataclasses.replace(request, count_flops=args.link is not None)
    auto_line = None
    if args.frozen_placement == AUTO_PLACEMENT:
        placement, auto_line = auto_placement(request, memory, plan)
        request = dataclasses.replace(request, frozen_placement=placement)
    chosen = plan(request)
    # The other side of the trade: without recomputation when it is on, with it on every
    # kept block when it is off.
    kept = request.filter_layers or tuple(range(request.config.num_hidden_layers))
    other = plan(dataclasses.replace(request, recompute=() if request.recompute else kept))
    rows: list[Row] = []
    if args.link is not None:
        machine = Machine(memory=memory, tflops=args.gpu_tflops, link=args.link,
                          link_across=args.link_across, mfu=args.mfu, link_host=args.link_host,
                          host_memory=(None if args.host_memory is None
                                       else int(args.host_memory * GiB)),
                          ranks_per_node=args.gpus)
        rows = evaluate(request, machine, plan,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    # On several nodes, every layout beside the chosen one (planned once).
    layouts = [] if args.nodes < 2 else compare_layouts(request, args.nodes,
                                                        planned={Layout(
                                                            request.hybrid,
                                                            request.quantize_gradients): chosen},
                                                        plan_of=plan)
    if args.json:
        out = {"plan": _as_dict(chosen), "other_recompute": _as_dict(other),
               "device_memory": memory,
               "layouts": {r.layout.name: dataclasses.asdict(r) | {"layout": r.layout.name}
                           for r in layouts}}
        if args.host_memory is not None:
            best, _ = recommend(request, ranks_per_node=args.gpus, gpu_memory=memory,
                                host_memory=int(args.host_memory * GiB), plan=plan)
            out["recommended"] = (None if best is None else
                                  {"offload": best[0], "offload_device": best[1]})
        if auto_line is not None:
            out["frozen_placement"] = request.frozen_placement
        if rows:
            order = ranked(rows)
            out["candidates"] = [_row_dict(r) for r in rows]
            out["recommended_layout"] = _row_dict(order[0]) if order else None
        print(json.dumps(out))
        return 0
    r = request
    blocks = len(kept)
    what = args.checkpoint or args.model
    recomputed = (f"{len(chosen.recomputed_layers)} of {blocks} blocks recomputed"
                  if r.recompute else "no recomputation")
    print(f"{what}: {blocks} of {r.config.num_hidden_layers} blocks, fine-tuning "
          f"{r.mode.mode}, {str(r.dtype).removeprefix('torch.')} compute, gradients reduced "
          f"in {str(r.reduce_dtype).removeprefix('torch.')}; {r.batch_size} x {r.seq_len} "
          f"tokens per rank and micro-batch, {r.grad_accum} micro-batch(es) per step; "
          f"{recomputed}; "
          f"{offload_words(r.offload_params, r.offload) or 'nothing'} offloaded to "
          f"{'NVMe' if r.offload_device == 'nvme' else 'the host'}"
          + (f"; --keep-gathered {r.keep_gathered}" if r.keep_gathered else "")
          + (f"; frozen weights in {r.frozen_weights}, {r.frozen_placement}"
             if r.frozen_weights is not None else ""))
    print(f"{r.world_size} ranks ({args.gpus} {'GPUs' if r.device == 'cuda' else 'processes'} "
          f"x {args.nodes} node(s)), {args.gpu_memory:g} GiB each")
    if auto_line is not None:
        print(auto_line)
    print(chosen.table(memory if r.device == "cuda" else None))
    tokens = r.batch_size * r.seq_len   # one micro-batch's, the forward the pass overlaps
    for line in zerocore.plan.overlap_lines(chosen, offload_of(r), tokens=tokens):
        print(f"  {line}")
    label = "without recomputation" if r.recompute else "recomputing every kept block"
    print(f"{label}: activations at the peak {other.peak['activations'] / GiB:.2f} GiB, total "
          f"{other.peak_bytes / GiB:.2f} GiB"
          + (f" ({'fits' if other.peak_bytes <= memory else 'does NOT fit'})"
             if r.device == "cuda" else ""))
    if chosen.host_peak:
        print(f"host memory per node for the offloaded state: "
              f"{chosen.host_peak * args.gpus / GiB:.1f} GiB")
    if chosen.state.nvme:
        print(f"NVMe per node for the scratch (--offload-path): "
              f"{chosen.state.nvme * args.gpus / GiB:.1f} GiB")
    if args.host_memory is not None:
        best, lines = recommend(r, ranks_per_node=args.gpus, gpu_memory=memory,
                                host_memory=int(args.host_memory * GiB), plan=plan)
        where = (f"{args.gpu_memory:g} GiB GPUs and " if r.device == "cuda" else "")
        print(f"offloads tried for {where}{args.host_memory:g} GiB of host memory per node "
              f"(a tenth of it kept spare):")
        print("\n".join(lines))
        print(f"recommended: {_flags(*best)}" if best is not None else
              "recommended: nothing fits; more ranks (--gpus, --nodes), LoRA, "
              "--activation-checkpointing or a shorter --seq-len would shrink it")
    if layouts:
        print(f"layouts on {args.nodes} nodes x {args.gpus} "
              f"{'GPUs' if r.device == 'cuda' else 'processes'} (--hybrid, "
              f"--quantize-gradients):")
        print(layouts_table(layouts))
    if rows:
        across = f", {args.link_across.name} across nodes" if r.nodes > 1 or r.mesh else ""
        print(f"frozen-base layouts (step time = FLOPs at {args.mfu:g} of {args.gpu_tflops:g} "
              f"TFLOPS + bytes sent at {args.link.name} ({args.link.gb_per_s:g} GB/s one way)"
              f"{across} + offload's copies at {args.link_host.name} "
              f"({args.link_host.gb_per_s:g} GB/s); the rest of the run as above):")
        print(candidates_table(rows, blocks))
        print(recommendation(rows, machine, blocks))
    return 0
