"""Fine-tune a transformers causal LM with PEFT LoRA through transformers' Trainer on zerocore:
the setup of a DeepSpeed ZeRO-3 user (Trainer, LoRA, CPU-offloaded optimizer state, gradient
checkpointing, 16-bit where the device has it), scaled down. zerocore.hf_trainer.ShardedTrainer
is Trainer with the model sharded by its decoder layers (ZeRO-3); the adapter it saves is then
reloaded by PEFT onto the base weights and must generate what the sharded model generates.

    torchrun --nproc-per-node 2 examples/finetune_hf_trainer.py [--steps 30] [--out DIR]
    python examples/finetune_hf_trainer.py --nproc 2      (starts the processes itself)

Across nodes, ``--hybrid hsdp`` shards within each node and replicates across them (HSDP: only
each rank's gradient shard crosses the nodes, once per step), ``--hybrid hpz`` shards over
every rank and keeps a node-local copy for backward (ZeRO++'s hpZ), ``--quantize-gradients
int8`` sends the gradients across the nodes in int8 (qgZ); on each of two nodes (here both on
this machine):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0|1 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 examples/finetune_hf_trainer.py --hybrid hsdp

Started by this script, the processes cannot outlive it (zerocore.tools.run_ranks, as
neox.finetune's ranks): killed, it takes them with it; Ctrl-C stops them. A process that loses
another (killed, failed) says so in one line and exits 3, as neox's ranks do. Bad arguments
are refused in one line before any process starts.

On GPUs each process takes one (NCCL) and computes in bf16 where the GPU supports it; on the CPU
the processes are gloo ones in fp32. The model is a small GPT-NeoX from a config (there are no
pretrained weights to fetch here: the base is a random initialisation saved to OUT/base first);
``--model DIR`` takes a Hugging Face directory instead (safetensors, a vocabulary of at least 256:
tokens are bytes), loaded by zerocore.hf_pretrained with each process reading only its shards'
bytes, LoRA on all its linear layers. At the end the first process prints every process's peak
memory (``peak RSS per rank: ...``).
"""

import argparse
import gc
import math
import os
import resource
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (AutoConfig, AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM,
                          TrainingArguments, default_data_collator)

import zerocore
from zerocore.hf_pretrained import pretrained_on_meta
from zerocore.hf_trainer import ShardedTrainer
from zerocore.tools import receive, run_ranks, watch_launcher

REPO = Path(__file__).resolve().parent.parent
PROMPT = "ROMEO:\n"
# Greedy, so the sharded model and PEFT's reload must give the same bytes; no byte pair may
# repeat, so that the line shows letters rather than the newline a tiny byte model repeats.
GENERATE = dict(max_new_tokens=40, do_sample=False, no_repeat_ngram_size=2, pad_token_id=0)
# A process's exit code when it lost contact with another (neox.finetune's).
EXIT_LOST_PEER = 3


def base_model() -> GPTNeoXForCausalLM:
    torch.manual_seed(0)  # every process builds the same initial weights
    config = GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=256,
                           max_position_embeddings=256, hidden_dropout=0.0,
                           attention_dropout=0.0, bos_token_id=10, eos_token_id=0)
    return GPTNeoXForCausalLM(config)


def byte_windows(path: str, seq_len: int, rows: int) -> list[dict[str, torch.Tensor]]:
    """``rows`` byte windows of the text at seeded offsets: a dataset Trainer can shuffle."""
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
    starts = torch.randint(0, len(data) - seq_len, (rows,),
                           generator=torch.Generator().manual_seed(0))
    return [{"input_ids": data[s:s + seq_len], "labels": data[s:s + seq_len]}
            for s in starts.tolist()]


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    gpu = torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=2, learning_rate=args.lr, weight_decay=0.01,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0,
        activation_checkpointing=True, bf16=gpu and torch.cuda.is_bf16_supported(),
        use_cpu=not gpu, logging_steps=args.log_every, save_steps=max(1, args.steps // 2),
        save_total_limit=1, report_to=[], disable_tqdm=True, seed=0)
    shard_options = dict(offload=zerocore.Offload(optimizer=True),
                         comm=zerocore.Comm(quantize_gradients=args.quantize_gradients))
    if args.model is None:
        base_dir = out / "base"  # the weights the adapter is for
        base = base_model()
        if training_args.process_index == 0:
            base.save_pretrained(base_dir)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                target_modules=["query_key_value", "dense",
                                                                "dense_h_to_4h",
                                                                "dense_4h_to_h"]))
    else:
        # Built on the meta device; each process reads its shards' bytes as Trainer shards it.
        base_dir = Path(args.model)
        pretrained = pretrained_on_meta(
            AutoModelForCausalLM, base_dir, dtype=torch.float32,
            peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                   target_modules="all-linear"))
        model = pretrained.model
        shard_options["read"] = pretrained.read
    trainer = ShardedTrainer(
        model=model, args=training_args, train_dataset=byte_windows(args.data, args.seq_len, 512),
        data_collator=default_data_collator, shard_options=shard_options, hybrid=args.hybrid)
    if training_args.process_index == 0:
        print(trainer.sharding.ways.line(), flush=True)  # how the ranks share the model
    trainer.train()
    if args.hybrid == "hsdp":  # collective: every replica's shards against the others'
        agree = trainer.sharding.replicas_agree()
        if training_args.process_index == 0:
            print(f"replicas bitwise equal: {agree}", flush=True)
    trainer.save_model(str(out / "adapter"))  # collective: the adapter, written by rank 0

    # Every process generates (each unit's gather is a collective): the same line everywhere.
    device = trainer.sharding.device
    prompt = torch.tensor([list(PROMPT.encode())], device=device)
    model.eval()
    with torch.no_grad():
        sharded_line = model.generate(input_ids=prompt, **GENERATE).cpu()
    if training_args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"losses every {args.log_every} steps: {' '.join(f'{x:.4f}' for x in losses)}",
              flush=True)
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                             out / "adapter").eval()
        with torch.no_grad():
            line = reloaded.generate(input_ids=prompt.cpu(), **GENERATE)
        print("reloaded by peft:", repr(bytes(line[0].tolist()).decode(errors="replace")))
        print("same as the sharded model's:", torch.equal(line, sharded_line), flush=True)
    # Every process's peak resident memory (Linux counts ru_maxrss in KiB), gathered: what
    # loading and training cost each rank (the reload above counts on the first).
    peaks = [None] * training_args.world_size
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    if training_args.process_index == 0:
        print(f"peak RSS per rank: {', '.join(f'{p} MiB' for p in peaks)}", flush=True)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    # What torchrun sets; TrainingArguments (accelerate) then joins the process group.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    # As torchrun does (OMP_NUM_THREADS=1 before Python starts): threads beyond one per process
    # only contend for the cores (measured: 12 steps in 28 s instead of about 1 s on 2 cores).
    torch.set_num_threads(1)
    main_process(args)


def rank_main(rank: int, fd: int, launcher: int) -> None:
    """A process started by ``main``, tied to it (zerocore.tools.run_ranks: it cannot
    outlive the main process, however that ends): its task, then its share of the run."""
    link = socket.socket(fileno=fd)
    world, port, args = receive(link)
    watch_launcher(rank, link, launcher)
    worker(rank, world, port, args)


def main_process(args: argparse.Namespace) -> None:
    try:
        run(args)
    except Exception as e:
        if not zerocore.is_peer_loss(e):
            raise
        # Another process failed or was killed, and says so (or its launcher does): this one
        # says it lost it, in one line, not with a traceback of whichever collective it was in,
        # and leaves at once: the group it would tear down is broken (as neox's ranks do).
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error (rank {os.environ.get('RANK', 0)}): lost contact with another process "
              f"({first[:200]}); it failed or was killed (see above)", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        os._exit(EXIT_LOST_PEER)
    finally:
        # Free the model (which holds the group) before the group: see finetune_hf_lora.py.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def check(args: argparse.Namespace, torchrun: bool) -> str | None:
    """What is wrong with the arguments, in one line (None: nothing), found before any process
    starts or any weight is built."""
    if args.model is not None:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            return (f"--model {model}: not a Hugging Face model directory (no config.json); "
                    f"give the directory save_pretrained wrote")
        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError) as e:
            return f"--model {model}: its config.json cannot be read ({' '.join(str(e).split())})"
        if getattr(config, "vocab_size", 0) < 256:
            return (f"--model {model}: a vocabulary of {config.vocab_size}; tokens here are "
                    f"bytes, so it needs at least 256")
    else:
        config = base_model().config
    positions = getattr(config, "max_position_embeddings", None) or config.n_positions
    data = Path(args.data)
    if not torchrun and args.nproc < 1:
        return f"--nproc {args.nproc}: give 1 or more processes"
    if args.steps < 1:
        return f"--steps {args.steps}: give 1 or more optimizer steps"
    if args.batch < 1:
        return f"--batch {args.batch}: give 1 or more sequences per process"
    if args.log_every < 1:
        return f"--log-every {args.log_every}: give 1 or more steps"
    if args.quantize_gradients is not None and args.hybrid is None:
        return (f"--quantize-gradients {args.quantize_gradients} quantizes the gradients' "
                f"all-reduce across nodes, which only --hybrid has: add --hybrid hsdp or hpz")
    nodes = zerocore.nodes_of(os.environ) if torchrun else None
    if args.hybrid is not None and (nodes or 1) < 2:
        return (f"--hybrid {args.hybrid} lays the ranks out in nodes: "
                f"run under torchrun --nnodes N (N >= 2)"
                + (f"; torchrun started {nodes} node" if nodes else ""))
    if not 1 <= args.seq_len <= positions:
        return f"--seq-len {args.seq_len}: the model has {positions} positions; give 1 to " \
               f"{positions}"
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr {args.lr}: give a positive, finite learning rate"
    if not data.is_file():
        return f"--data {data}: no such file" + (" (a directory)" if data.is_dir() else "")
    try:
        size = data.stat().st_size
        with open(data, "rb"):
            pass
    except OSError as e:
        return f"--data {data}: cannot be read ({e.strerror or e})"
    if size <= args.seq_len:
        return f"--data {data}: {size} bytes, too short for windows of --seq-len " \
               f"{args.seq_len}; give a longer text or a smaller --seq-len"
    out = Path(args.out)
    probe = out / f".write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e}); choose a writable directory"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(REPO / "tests" / "data" / "shakespeare_excerpt.txt"),
                   help="a text file to train on (default: the tests' Shakespeare excerpt)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--nproc", type=int, default=2,
                   help="processes to start when not under torchrun (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--batch", type=int, default=4, help="sequences per process per micro-batch")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory (safetensors) to fine-tune, each process "
                        "reading only its shards (default: a small GPT-NeoX from a config)")
    p.add_argument("--out", default="runs/hf-trainer", help="output directory (runs/hf-trainer)")
    p.add_argument("--log-every", type=int, default=5, help="steps between logged losses")
    p.add_argument("--hybrid", choices=("none", "hsdp", "hpz"), default="none",
                   help="across torchrun's nodes: 'hsdp' shards within each node, replicated "
                        "across nodes; 'hpz' shards over every rank with a node-local copy "
                        "for backward (default: none, flat over every rank)")
    p.add_argument("--quantize-gradients", choices=("none", "int8"), default="none",
                   help="with --hybrid: the gradients' all-reduce across nodes in int8 (qgZ)")
    args = p.parse_args(argv)
    args.hybrid = None if args.hybrid == "none" else args.hybrid
    args.quantize_gradients = None if args.quantize_gradients == "none" else \
        args.quantize_gradients
    torchrun = "RANK" in os.environ
    problem = check(args, torchrun)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if torchrun:
        main_process(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The processes are this script's own module, imported by name (its folder is on the path).
    return run_ranks(f"{Path(__file__).stem}:rank_main", args.nproc, (args.nproc, port, args),
                     marker="hf-trainer-rank")


if __name__ == "__main__":
    sys.exit(main())
