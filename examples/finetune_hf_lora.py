"""Fine-tune a transformers causal LM with PEFT LoRA under zerocore.shard_model: the model as
transformers builds it, sharded in place by its decoder layers (ZeRO-3), CPU-offloaded optimizer
state, fp32 on gloo processes; then the adapter is exported with PEFT's save_pretrained,
reloaded by PEFT onto the base weights, and used to generate 40 bytes greedily, which must be
the sharded model's own (a check of the export: LoRA on a random base learns little in 40
steps, so the bytes are letters and fragments of words, not verse).

    python examples/finetune_hf_lora.py [--data FILE] [--steps 40] [--nproc 2] [--out DIR]

The model is a small GPT-NeoX from a config (no download: there are no pretrained weights to
fetch here), so the base is a random initialisation saved to OUT/base first; with a pretrained
model, load it with from_pretrained instead and shard it the same way. Tokens are bytes.
"""

import argparse
import gc
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

import zerocore

REPO = Path(__file__).resolve().parent.parent
PROMPT = "ROMEO:\n"
# Greedy, so the sharded model and PEFT's reload must give the same bytes. A byte model this
# small, greedy, soon repeats its likeliest byte (a newline after "ROMEO:\n", forever): no
# byte pair may repeat, so the line shows the letters and words it learnt.
GENERATE = dict(max_new_tokens=40, do_sample=False, no_repeat_ngram_size=2, pad_token_id=0)


def base_model() -> GPTNeoXForCausalLM:
    torch.manual_seed(0)  # every rank builds the same initial weights
    config = GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=256,
                           max_position_embeddings=256, hidden_dropout=0.0,
                           attention_dropout=0.0, bos_token_id=10, eos_token_id=0)
    return GPTNeoXForCausalLM(config)


def windows(text: bytes, seq_len: int, rows: int, step: int, rank: int,
            world: int) -> torch.Tensor:
    """This rank's rows of the step's batch: byte windows at seeded offsets."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(text) - seq_len - 1, (rows * world,), generator=g)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return torch.stack([data[s:s + seq_len] for s in starts.tolist()]).chunk(world)[rank]


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    out = Path(args.out)
    base = base_model()
    if rank == 0:
        base.save_pretrained(out / "base")  # the weights the adapter is for
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["query_key_value", "dense",
                                                            "dense_h_to_4h", "dense_4h_to_h"]))
    layers = model.base_model.model.gpt_neox.layers
    sharded = zerocore.shard_model(model, layers, offload=zerocore.Offload(optimizer=True))
    optimizer = zerocore.optim.AdamW(model.parameters(), lr=args.lr)
    text = Path(args.data).read_bytes()
    for step in range(args.steps):
        ids = windows(text, args.seq_len, args.batch, step, rank, world)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    # Every rank generates (each gather is a collective): the same greedy line everywhere.
    prompt = torch.tensor([list(PROMPT.encode())])
    model.eval()
    with torch.no_grad():
        sharded_line = model.generate(input_ids=prompt, **GENERATE)
    adapter = sharded.full_state_dict(trainable_only=True, to_rank=0)  # collective
    if rank == 0:
        model.save_pretrained(out / "adapter", state_dict=adapter)
        print(f"adapter: {len(adapter)} tensors, "
              f"{sum(t.numel() for t in adapter.values()):,} parameters -> {out / 'adapter'}")
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"),
                                             out / "adapter").eval()
        with torch.no_grad():
            line = reloaded.generate(input_ids=prompt, **GENERATE)
        print("reloaded by peft:", repr(bytes(line[0].tolist()).decode(errors="replace")))
        print("same as the sharded model's:", torch.equal(line, sharded_line))


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, args)
    finally:
        # Free the model (which holds the group) first: its objects refer to each other, so
        # only a collection frees them. Otherwise the group outlives destroy_process_group,
        # and a gloo worker thread that still holds the last gather's tensors releases them
        # during interpreter exit, which aborts the process ("terminate called without an
        # active exception": seen on rank 1 in 1 of 3 runs on 2 busy cores, torch 2.13).
        gc.collect()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(REPO / "tests" / "data" / "shakespeare_excerpt.txt"),
                   help="a text file to train on (default: the tests' Shakespeare excerpt)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--nproc", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (4)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    p.add_argument("--out", default="runs/hf-lora", help="output directory (runs/hf-lora)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = args.port or s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
