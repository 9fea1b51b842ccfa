"""python -m neox.finetune: fine-tune a GPT-NeoX model with zerocore's ZeRO-3 sharding.

With no arguments: a tiny randomly initialised GPT-NeoX, bias fine-tuning, tiny_shakespeare (or
the offline fallback corpus), 2 gloo processes on the CPU; a couple of minutes on 2 cores.
With CUDA GPUs: one process per GPU over NCCL. Under torchrun (RANK/WORLD_SIZE set): joins that
process group, which is how it runs across machines.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neox.cli import DTYPES, UsageError, parse_layers

# Seconds the other ranks get to exit by themselves once one has failed.
SHUTDOWN_GRACE_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m neox.finetune", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--checkpoint", type=Path, default=None,
                   help="a Hugging Face GPT-NeoX directory or EleutherAI 20B slim-weights "
                        "directory; without it --model picks a randomly initialised preset")
    m.add_argument("--model", default="tiny",
                   help="preset when no --checkpoint: tiny, pythia-70m, pythia-160m, ... "
                        "(random initialisation, for machines without weights)")
    m.add_argument("--filter-layers", default=None,
                   help="keep only these transformer blocks, 0-based as in the checkpoint, e.g. "
                        "'0,1' or '0-3'; embedding, final norm and readout are always kept")
    m.add_argument("--finetune", choices=["biases", "lora", "full"], default="biases",
                   help="what to train")
    m.add_argument("--lora-rank", type=int, default=8,
                   help="rank r of each LoRA adapter (--finetune lora)")
    m.add_argument("--lora-alpha", type=float, default=16.0,
                   help="LoRA scaling numerator: adapters add (alpha / r) * B A")
    m.add_argument("--lora-targets", default="query_key_value,attention.dense",
                   help="comma-separated projections that get adapters")
    m.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="compute dtype (default: fp32 on CPU, bf16 on GPU)")
    d = p.add_argument_group("data")
    d.add_argument("--data", type=Path, default=None,
                   help="a local UTF-8 text file to train on (default: tiny_shakespeare)")
    d.add_argument("--data-dir", type=Path, default=None,
                   help="local copies of the default corpus and tokenizer (default: "
                        "shared/data beside the repository)")
    d.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json (default: the checkpoint's, else a byte-level BPE trained "
                        "on the corpus and cached)")
    d.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "zerocore",
                   help="downloaded corpus, trained tokenizers and tokenised data are kept here")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    d.add_argument("--val-fraction", type=float, default=0.1,
                   help="fraction of the windows (the corpus's end) held out for validation")
    t = p.add_argument_group("training")
    t.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    t.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per rank per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    t.add_argument("--epochs", type=int, default=1,
                   help="passes over the training windows (each seen once per epoch)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    t.add_argument("--seed", type=int, default=0,
                   help="seeds the random initialisation, LoRA adapters and data order")
    t.add_argument("--offload-optimizer", action="store_true",
                   help="keep fp32 masters, gradients and Adam moments in CPU memory")
    t.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: at end)")
    t.add_argument("--output-dir", type=Path, default=Path("runs") / "neox-finetune",
                   help="metrics.jsonl, checkpoints/, trainable.safetensors, hf/ go here")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--save-every", type=int, default=0,
                   help="save a sharded checkpoint every N steps (one is always saved at the end)")
    c.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep")
    c.add_argument("--resume", type=Path, default=None,
                   help="continue from a checkpoint (a step-XXXXXXXX directory, or a folder of "
                        "them: the latest); any number of ranks")
    c.add_argument("--export-hf", action="store_true",
                   help="also write the fine-tuned model as a Hugging Face directory (LoRA "
                        "merged) to OUTPUT_DIR/hf")
    r = p.add_argument_group("processes")
    r.add_argument("--nproc", type=int, default=2,
                   help="CPU processes (gloo) when there is no GPU; with GPUs: one per GPU")
    r.add_argument("--port", type=int, default=0, help="rendezvous port (0: pick a free one)")
    r.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the run fails instead of hanging")
    r.add_argument("--cpu", action="store_true", help="use the CPU (gloo) even if GPUs exist")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Cheap checks before any process starts."""
    args.filter_layers = parse_layers(args.filter_layers)
    for name in ("seq_len", "batch_size", "grad_accum", "epochs", "nproc", "lora_rank"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_steps is not None and args.max_steps < 1:
        raise UsageError("--max-steps must be >= 1")
    if args.data is not None and not args.data.is_file():
        raise UsageError(f"--data {args.data}: no such file")
    if args.checkpoint is not None and not args.checkpoint.exists():
        raise UsageError(f"--checkpoint {args.checkpoint}: no such file or directory")
    if args.resume is not None and not args.resume.exists():
        raise UsageError(f"--resume {args.resume}: no such checkpoint directory")
    if args.tokenizer is not None and not args.tokenizer.exists():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file or directory")


def describe_environment(use_cuda: bool) -> None:
    n = torch.cuda.device_count() if use_cuda else 0
    for i in range(n):
        print(f"GPU {i}: {torch.cuda.get_device_name(i)}")
    print(f"n_gpus: {n}")
    print(f"NCCL available: {dist.is_nccl_available()}   gloo available: "
          f"{dist.is_gloo_available()}   MPI available: {dist.is_mpi_available()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one process ---------------------------------------------------------------------------------


def worker(rank: int, world_size: int, args: argparse.Namespace, init_method: str,
           use_cuda: bool) -> None:
    # Imported here, not at the top: the launcher (and --help) need not load the engine.
    from neox.training import PeerFailed, run_training
    code = 0
    try:
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local_rank)
        else:
            # Processes on one machine share its cores: more threads than cores only contend.
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=args.timeout))
        if rank == 0:
            print(f"Distributed: backend {backend}, world size {world_size}, "
                  f"init {init_method}")
        run_training(args, rank=rank, world_size=world_size,
                     device=torch.device("cuda", torch.cuda.current_device()) if use_cuda
                     else torch.device("cpu"))
    except (UsageError, ValueError, FileNotFoundError) as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        code = 2
    except PeerFailed:
        code = 2  # another rank reported the error (neox.training.agree)
    except Exception:
        traceback.print_exc()
        code = 1
    if code:
        # Leave at once: the failed run's objects still hold the process group, and tearing it
        # down under them at interpreter exit can abort the process (gloo: "terminate called
        # without an active exception"), which would bury the message above.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_cuda = torch.cuda.is_available() and not args.cpu
    describe_environment(use_cuda)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun, possibly many machines
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://", use_cuda)
        return 0
    world_size = torch.cuda.device_count() if use_cuda else args.nproc
    init_method = f"tcp://127.0.0.1:{args.port or free_port()}"
    context = mp.spawn(worker, args=(world_size, args, init_method, use_cuda),
                       nprocs=world_size, join=False)
    try:
        # The grace period lets the other ranks stop on their own after one fails (after a user
        # error they all do) instead of being terminated with a warning each.
        while not context.join(grace_period=SHUTDOWN_GRACE_S):
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code != 2:  # 2: a user error, already reported in one line by the rank
            print(f"error: a training process exited with code {e.exit_code}; see its message "
                  f"above", file=sys.stderr)
        return e.exit_code if e.exit_code and e.exit_code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
