"""What the lockstep costs (issue 39, item 1: every gather, reduction and optimizer step says
first where each rank is, comm/lockstep.py): the step of the same sharded stack with the
exchange on and off, on both gloo transports, interleaved with an A/A control.

    python bench/lockstep_cost.py [--layers 96] [--width 64] [--rounds 10] [--nproc 2]
    python bench/lockstep_cost.py --neox [--layers 3] [--width 1024] [--rows 2]
    python bench/lockstep_cost.py --exchange [--rounds 20] [--nproc 2 3]
    python bench/lockstep_cost.py --fused [--width 64] [--rounds 20] [--nproc 2 3]

The stack is bench/layer_cost.py's (``Linear(width, width)`` + GELU per layer, fp32, 8 x 16
rows per rank): at width 64 the step is almost all host overhead, so the figure is the host
cost per layer; at a larger width (``--layers 6 --width 512``) it is an end-to-end step whose
arithmetic dominates. ``--neox``: GPT-NeoX blocks (neox/model.py's ``Block``: attention and
MLP, ``--width`` the hidden size, 16 heads, 4x MLP), the shape of a real unit, whose gathers
are megabytes. Models in the same ranks, stepped alternately in a seeded random order
per round:
- ``read, on`` / ``read, on A/A``: peer reading (the default on one host); the identity of a
  gather by reading, and at two ranks of a reduction, rides in its ready message and is
  compared when it is waited for (comm/carried.py's ``ReadCarriedGather``), the other steps'
  exchanged through its pipes; two identical models, whose ratio is the noise band of the run;
- ``read, off``: the same with the exchange switched off (``Lockstep.enabled``, an internal
  switch for this measurement; no policy turns it off);
- ``collective, on`` / ``collective, on A/A`` / ``collective, off``: gloo's collectives
  (``Comm(peer_read="off")``), with an A/A pair of its own (its step is twice peer reading's,
  and its noise need not be the same); the exchange a gather of the lockstep's rows, in which
  the gathers of units small enough carry their parts, and their gradient reductions the
  slices each rank sends the others (comm/carried.py), else one all-reduce of two int64.
  Off, those reductions are the same sums plain: the exchange at two ranks, gloo's all-to-all
  summed in rank order at three and more (``transport.Reduce``).
``--exchange`` times one exchange alone, the way each is made (``Lockstep._all_gather``),
interleaved: an all-gather of one int64 per rank (the first lockstep's) against an all-reduce
(MAX) of two int64 (the second's, when every rank agrees), blocking, and against the lockstep's
own (``Lockstep._all_gather``: that all-reduce issued with ``async_op=True`` and waited for in
slices, so that a long wait can ask where the others are), 200 exchanges per call.
``--fused`` times what a gather of one small unit costs three ways, interleaved, as the
runtime issues them (each gather started before the last is waited for, a small matmul between):
``off``, the data alone (gloo's gather by broadcasts, as the engine gathers:
``broadcast_each``); ``checked first``, the lockstep's exchange before each
(``Lockstep._all_gather``), as a model without small units checks; ``carried``, the identity
appended to each rank's part as 8 bytes, the data and it broadcast together in a shape fixed
for the model, compared once the gather is waited for; ``off A/A``, a second ``off``,
the noise band. ``carried`` is the prototype of that design, now built in the engine
(comm/carried.py; docs/decisions.md, issue 39, "the identity carried in the gathers of small
units").
``--calls`` counts instead (cProfile, exact) what rank 0 of a peer-reading step calls, per
step, the lockstep on: the pipes' system calls and the lockstep's checks, after two steps of
warm-up (``--rounds`` steps; its times are only proportions).
Reported: the median step time over the rounds per layer (microseconds, the slowest rank), and
each "on" against its "off".
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats

import torch
import torch.distributed as dist
from torch import nn

import harness
import zerocore
from neox.config import NeoXConfig
from neox.model import Block

SEQ = 16
VARIANTS = ("read, on", "read, on A/A", "read, off", "collective, on", "collective, on A/A",
            "collective, off")


def stack(layers: int, width: int, neox: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    if neox:
        config = NeoXConfig(vocab_size=64, hidden_size=width, num_hidden_layers=layers,
                            num_attention_heads=16, intermediate_size=4 * width)
        return [Block(config) for _ in range(layers)]
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    base = stack(args.layers, args.width, args.neox)
    engines = {}
    for name in VARIANTS:
        transport, state = name.split(", ")[0], name.split(", ")[1]
        comm = zerocore.Comm() if transport == "read" else zerocore.Comm(peer_read="off")
        model = zerocore.shard(copy.deepcopy(base), comm=comm)
        model.lockstep.enabled = state != "off"
        engines[name] = (model, zerocore.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(args.rows, SEQ, args.width, generator=torch.Generator().manual_seed(rank))

    def step(name: str):
        model, opt = engines[name]

        def run(_round: int) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    rounds = harness.Interleaved({name: step(name) for name in engines}, warmup=2,
                                 before=lambda name: dist.barrier()).run(args.rounds)
    return {name: rounds.median_s(name) / args.layers * 1e6 for name in engines}


EXCHANGES = 200  # per timed call: a call of one exchange would time the barrier's wake-up


def exchange_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    mine = torch.full((1,), 12345, dtype=torch.int64)
    every = torch.zeros(world, dtype=torch.int64)
    extremes = torch.zeros(2, dtype=torch.int64)

    def all_gather(_round: int) -> None:
        for _ in range(EXCHANGES):
            dist.all_gather_into_tensor(every, mine)
            every.tolist()

    def all_reduce(_round: int) -> None:
        for _ in range(EXCHANGES):
            extremes[0], extremes[1] = 12345, -12345
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
            extremes[0].item(), extremes[1].item()

    # The lockstep of a one-layer model on gloo's collectives (its exchange is the one timed).
    lockstep = zerocore.shard([nn.Linear(4, 4)], comm=zerocore.Comm(peer_read="off")).lockstep

    def in_slices(_round: int) -> None:
        for _ in range(EXCHANGES):
            lockstep._all_gather(12345)

    variants = {"all-gather of 1 int64": all_gather, "all-reduce (MAX) of 2 int64": all_reduce,
                "the same, async, waited for in slices (Lockstep's)": in_slices}
    rounds = harness.Interleaved(variants, warmup=2,
                                 before=lambda name: dist.barrier()).run(args.rounds)
    return {name: rounds.median_s(name) / EXCHANGES * 1e6 for name in variants}


def broadcast_each(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, rank: int,
                   ranks: tuple[int, ...]) -> list[dist.Work]:
    """The engine's all-gather on gloo (one broadcast per rank, received in place into its
    slice of ``out``), written here with torch's own calls: the engine's is not public."""
    slices = out.chunk(len(ranks))
    handles = [dist.broadcast(shard if r == rank else slices[r], src=ranks[r], group=group,
                              async_op=True) for r in range(len(ranks))]
    slices[rank].copy_(shard)
    return handles


def fused_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    numel = -(-(args.width * args.width + args.width) // world)  # a Linear's shard, padded
    group = dist.group.WORLD
    ranks = tuple(range(world))
    shard = torch.randn(numel)
    x = torch.randn(args.rows * SEQ, args.width)
    weight = torch.randn(args.width, args.width)
    # The lockstep of a one-layer model on gloo's collectives (its exchange is the one timed).
    lockstep = zerocore.shard([nn.Linear(4, 4)], comm=zerocore.Comm(peer_read="off")).lockstep

    def gathers(start, wait):
        def run(_round: int) -> None:
            pending = start(0)
            for unit in range(1, EXCHANGES + 1):
                following = start(unit) if unit < EXCHANGES else None  # the prefetch
                wait(pending, unit - 1)
                x @ weight  # the unit's arithmetic, overlapping the prefetch
                pending = following
        return run

    def plain_start(_unit: int):
        out = torch.empty(numel * world)
        return out, broadcast_each(out, shard, group, rank, ranks)

    def checked_start(unit: int):
        lockstep._all_gather(unit)
        return plain_start(unit)

    def plain_wait(pending, _unit: int) -> None:
        for handle in pending[1]:
            handle.wait()

    head = numel + numel % 2  # the shard, to a whole number of int64
    row = head + 2  # then the identity, as two float32's bits

    def carried_start(unit: int):
        out = torch.empty(world * row)
        mine = torch.empty(row)
        mine[:numel].copy_(shard)
        mine[head:].view(torch.int64).fill_(unit)
        return out, broadcast_each(out, mine, group, rank, ranks)

    def carried_wait(pending, unit: int) -> None:
        plain_wait(pending, unit)
        said = pending[0].view(world, row)[:, head:].contiguous().view(torch.int64)
        if said.ne(unit).any():
            raise RuntimeError("diverged")  # (cannot happen here: every rank runs this)

    variants = {"off": gathers(plain_start, plain_wait),
                "off A/A": gathers(plain_start, plain_wait),
                "checked first": gathers(checked_start, plain_wait),
                "carried": gathers(carried_start, carried_wait)}
    rounds = harness.Interleaved(variants, warmup=2,
                                 before=lambda name: dist.barrier()).run(args.rounds)
    return {name: rounds.median_s(name) / EXCHANGES * 1e6 for name in variants}


def fused(args: argparse.Namespace) -> None:
    print(harness.header(f"a gather of Linear({args.width}, {args.width})'s shard over gloo, "
                         f"{EXCHANGES} per call, each prefetched; {args.rounds} rounds",
                         packages=("torch",)))
    rows = []
    for nproc in args.nproc:
        per_rank = harness.run_ranks(fused_main, nproc, args)
        worst = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
        rows += [(nproc, name, f"{us:.0f}", f"{us / worst['off']:.3f}")
                 for name, us in worst.items()]
    print(harness.table(("world size", "identity", "µs per gather", "vs off"), rows, "rlrr"))


def exchange(args: argparse.Namespace) -> None:
    print(harness.header(f"one exchange of the lockstep over gloo, {EXCHANGES} per call; "
                         f"{args.rounds} rounds", packages=("torch",)))
    rows = []
    for nproc in args.nproc:
        per_rank = harness.run_ranks(exchange_main, nproc, args)
        worst = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
        first = next(iter(worst.values()))
        rows += [(nproc, name, f"{us:.0f}", f"{us / first:.3f}") for name, us in worst.items()]
    print(harness.table(("world size", "exchange", "µs each", "vs all-gather"), rows, "rlrr"))


# What ``--calls`` counts: the pipes' system calls (by cProfile's names of the builtins) and the
# lockstep's own steps (by function name; ``_say``: an identity said with a ready message).
PIPE_CALLS = {"<built-in method posix.write>": "pipe writes",
              "<built-in method posix.read>": "pipe reads",
              "<method 'poll' of 'select.poll' objects>": "polls"}
LOCKSTEP_CALLS = ("check", "_say", "compare_said")


def calls_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    model = zerocore.shard(stack(args.layers, args.width, args.neox), comm=zerocore.Comm())
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.rows, SEQ, args.width, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(2):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.rounds):
        step()
    profile.disable()
    counts = {}
    for (file, _, name), (_, calls, *_) in pstats.Stats(profile).stats.items():
        if name in PIPE_CALLS:
            counts[PIPE_CALLS[name]] = calls / args.rounds
        elif file.endswith("lockstep.py") and name in LOCKSTEP_CALLS:
            counts[f"Lockstep.{name}"] = calls / args.rounds
    return counts


def calls(args: argparse.Namespace) -> None:
    print(harness.header(f"calls per step of rank 0, {args.layers} layers, peer reading, the "
                         f"lockstep on; {args.rounds} steps", packages=("torch",)))
    print(f"# zerocore from {zerocore.__file__}")
    rows = []
    for nproc in args.nproc:
        counts = harness.run_ranks(calls_main, nproc, args)[0]
        rows += [(nproc, name, f"{n:.0f}") for name, n in sorted(counts.items())]
    print(harness.table(("world size", "call", "per step"), rows, "rlr"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--neox", action="store_true", help="GPT-NeoX blocks, not Linear + GELU")
    p.add_argument("--layers", type=int, default=None, help="default 96, --neox 3")
    p.add_argument("--width", type=int, default=None, help="default 64, --neox 1024")
    p.add_argument("--rows", type=int, default=None, help="rows per rank; default 8, --neox 2")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--nproc", type=int, nargs="+", default=[2])
    p.add_argument("--exchange", action="store_true", help="time one exchange alone")
    p.add_argument("--fused", action="store_true",
                   help="time a small unit's gather: unchecked, checked first, identity carried")
    p.add_argument("--calls", action="store_true",
                   help="count rank 0's pipe calls and lockstep checks per step (peer reading)")
    args = p.parse_args()
    if args.exchange:
        exchange(args)
        return
    for name, plain, neox in (("layers", 96, 3), ("width", 64, 1024), ("rows", 8, 2)):
        if getattr(args, name) is None:
            setattr(args, name, neox if args.neox else plain)
    if args.fused:
        fused(args)
        return
    if args.calls:
        calls(args)
        return
    layer = (f"GPT-NeoX blocks (hidden {args.width}, 16 heads, MLP {4 * args.width})"
             if args.neox else f"layers of Linear({args.width}, {args.width}) + GELU")
    print(harness.header(f"{args.layers} {layer}, fp32, {args.rows} x {SEQ} rows per rank; "
                         f"{args.rounds} rounds", packages=("torch",)))
    rows = []
    for nproc in args.nproc:
        per_rank = harness.run_ranks(rank_main, nproc, args)
        worst = {name: max(r[name] for r in per_rank) for name in VARIANTS}
        for name in VARIANTS:
            off = worst[name.split(", ")[0] + ", off"]
            rows.append((nproc, name, f"{worst[name]:.1f}",
                         f"{worst[name] * args.layers / 1e3:.2f}", f"{worst[name] / off:.3f}"))
    print(harness.table(("world size", "transport, exchange", "µs per layer per step",
                         "ms per step", "vs off"), rows, "rlrrr"))


if __name__ == "__main__":
    main()
