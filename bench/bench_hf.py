"""A transformers model as it is, sharded three ways: step time and memory per rank.

    python bench/bench_hf.py [--nproc 2] [--steps 12] [--layers 6] [--hidden 256]

The same GPT-NeoX (from a config: hidden 256, 6 layers, vocabulary 4096, fp32) and the same
batches (4 sequences of 128 tokens per rank, labels = inputs) under
- ``shard_model``: ``zerocore.shard_model(model, model.gpt_neox.layers)``, zerocore's AdamW;
- ``fsdp2``: ``fully_shard`` on every decoder layer and on the model, over a 1-D "cpu" mesh,
  ``torch.optim.AdamW(fused=True)`` (the fastest torch optimizer on the CPU);
- ``zerocore.shard`` does not apply: a transformers decoder layer takes the attention mask and
  the rotary embeddings besides the hidden states, and the embedding and head are not layers of
  a stack, which is why ``shard_model`` exists.
Both models live in the same gloo ranks and are stepped alternately (one step each, in a
seeded random order per round), so the machine's load affects both alike. Reported: the median
step time over the rounds (the ratio is of the medians), the model state each rank holds
(parameters, gradients, optimizer state: bytes of tensors), and the peak of tensor bytes
allocated during one step (``zerocore.PeakMemory``: the profiler's allocation record).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import harness
import zerocore

SEQ, ROWS = 128, 4
ADAMW = dict(lr=1e-4, weight_decay=0.01)


def build(layers: int, hidden: int) -> GPTNeoXForCausalLM:
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=4096, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=8, intermediate_size=4 * hidden,
                           max_position_embeddings=SEQ, hidden_dropout=0.0,
                           attention_dropout=0.0, attn_implementation="sdpa")
    return GPTNeoXForCausalLM(config)


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def model_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    state = sum(local_bytes(v) for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return sum(local_bytes(p) + local_bytes(p.grad) for p in params) + state


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.item()


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    engines = {}
    model = build(args.layers, args.hidden)
    zerocore.shard_model(model, model.gpt_neox.layers)
    engines["shard_model"] = (model, zerocore.optim.AdamW(model.parameters(), **ADAMW))
    model = build(args.layers, args.hidden)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.gpt_neox.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)
    except (RuntimeError, TypeError, NotImplementedError):
        opt = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=True)
    engines["fsdp2"] = (model, opt)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 4096, (ROWS, SEQ), generator=g) for _ in range(4)]
    losses: dict[str, list[float]] = {k: [] for k in engines}

    def stepper(name: str):
        model, opt = engines[name]
        return lambda r: losses[name].append(step(model, opt, batches[r % len(batches)]))
    rounds = harness.Interleaved({name: stepper(name) for name in engines}, warmup=2,
                                 before=lambda _: dist.barrier(),
                                 settle=dist.barrier).run(args.steps)
    out = {}
    for name, (model, opt) in engines.items():
        with zerocore.PeakMemory(torch.device("cpu")) as peak:
            step(model, opt, batches[0])
        out[name] = dict(median_s=rounds.median_s(name),
                         state_bytes=model_state(model, opt), step_peak=peak.peak_bytes,
                         losses=losses[name][:3])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed rounds (default 12)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    per_rank = dict(enumerate(harness.run_ranks(rank_main, args.nproc, args)))
    model = build(args.layers, args.hidden)
    n = sum(p.numel() for p in model.parameters())
    print(harness.header(f"GPT-NeoX {args.layers} layers, hidden {args.hidden}, vocab 4096, "
                         f"{n:,} parameters, fp32; {args.nproc} gloo ranks x {ROWS} x {SEQ} "
                         f"tokens; {args.steps} rounds"))
    rows = []
    for label, key, scale, unit in [
            ("step time, median", "median_s", 1e3, "ms"),
            ("model state (params + grads + Adam)", "state_bytes", 2**-20, "MiB"),
            ("peak tensor bytes during a step", "step_peak", 2**-20, "MiB")]:
        a = max(per_rank[r]["shard_model"][key] for r in per_rank)
        b = max(per_rank[r]["fsdp2"][key] for r in per_rank)
        rows.append((label, f"{a * scale:.2f} {unit}", f"{b * scale:.2f} {unit}", f"{a / b:.3f}"))
    print(harness.table(("per rank (worst rank)", "shard_model", "FSDP2", "ratio"), rows, "lrrr"))
    print("first losses (rank 0):", {k: [round(x, 4) for x in v["losses"]]
                                     for k, v in per_rank[0].items()})


if __name__ == "__main__":
    main()
