"""transformers' Trainer on zerocore against Trainer on FSDP2: step time on 2 gloo ranks (CPU).

    python bench/bench_trainer.py [--steps 20] [--warmup 3] [--repeats 3] [--modes full,lora]

The same seeded GPT-NeoX (from a config, saved once to a temporary directory so that every
engine loads the same weights: hidden 256, 6 layers, 4 heads, MLP 1024, vocabulary 1024, fp32)
trained on the same random tokens (4 x 128 per rank per step) by ``Trainer``'s own loop, under
- ``zerocore``: ``zerocore.hf_trainer.ShardedTrainer`` (``shard_model`` over the decoder layers,
  zerocore's AdamW);
- ``fsdp2``: plain ``transformers.Trainer`` on the model loaded with
  ``from_pretrained(distributed_config=DistributedConfig(fsdp_size=N, fsdp_plan=...))``:
  transformers applies ``fully_shard`` to every decoder layer and to the root, and ``Trainer``
  then trains the DTensor model without wrapping it in DDP (its default optimizer,
  ``adamw_torch_fused``). accelerate's FSDP plugin is not used: with
  ``TrainingArguments(fsdp=..., fsdp_config={"version": 2})`` accelerate 1.15 keeps the plugin
  only for GPU-like devices, and on the CPU (``DistributedType.MULTI_CPU``) it drops it without
  a word and ``Trainer`` trains under DDP; a model sharded with ``fully_shard`` by hand and
  given to a plain ``Trainer`` is wrapped in DDP too, which fails on its DTensors;
- ``ddp``: plain ``Trainer`` on the unsharded model (accelerate's DDP under 2 processes: what
  the FSDP plugin request above actually trains with on the CPU), for reference.

``--modes lora`` adds a PEFT LoRA adapter (r 8 on ``query_key_value`` and ``dense``) before
training; under ``fsdp2`` the adapter is added to the sharded model, so its weights stay
replicated tensors whose gradients ``Trainer`` all-reduces itself (transformers' own handling
of an adapter on a model sharded at load time).

Every engine is built afresh in the same two ranks for each repeat, in alternating order, so
that a drift of the machine reaches all of them. A ``TrainerCallback`` times each optimizer
step (``on_step_begin`` to ``on_step_end``: forward, backward, clipping, the optimizer, the
scheduler; not the data loading or logging between steps); the first ``--warmup`` steps are
dropped. Reported: per repeat the median step time of the slower rank, the median of the
repeats, tokens/s from it, and the ratio to FSDP2 (time ratio, lower is better). The first
losses of every engine are printed and compared (same weights, batches and data order).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch
import transformers
from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

import harness

SEQ, ROWS, VOCAB = 128, 4, 1024
ENGINES = ("zerocore", "fsdp2", "ddp")


def config(layers: int, hidden: int) -> GPTNeoXConfig:
    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=4, intermediate_size=4 * hidden,
                         max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, as this rank sees it."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


def load(engine: str, checkpoint: str, world: int) -> GPTNeoXForCausalLM:
    if engine != "fsdp2":
        return GPTNeoXForCausalLM.from_pretrained(checkpoint)
    from transformers.distributed.configuration_utils import DistributedConfig
    # GPT-NeoX has no fsdp_plan of its own: one FSDP group per decoder layer (resharded after
    # forward, as accelerate's transformer auto-wrap would), the rest in the root's group.
    plan = {"gpt_neox.layers.*": "free_full_weight"}
    return GPTNeoXForCausalLM.from_pretrained(
        checkpoint, distributed_config=DistributedConfig(fsdp_size=world, fsdp_plan=plan))


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft
    torch.manual_seed(0)  # the adapter's initial A matrices, the same for every engine
    return peft.get_peft_model(model, peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query_key_value", "dense"]))


def train_once(engine: str, mode: str, world: int, args: argparse.Namespace,
               data: list[dict[str, torch.Tensor]], out: str) -> dict:
    model = load(engine, args.checkpoint, world)
    if mode == "lora":
        model = with_lora(model)
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=ROWS, max_steps=args.warmup + args.steps,
        learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        # No parameter is unused; DDP's search for them would be a cost of the flag, not of DDP.
        ddp_find_unused_parameters=False)
    timer = StepTimer()
    # This rank's CPU time (all its threads, gloo's included) and the machine's busy time over
    # the run: with the other rank's CPU time, what other work took meanwhile.
    busy0, cpu0, wall0 = harness.machine_busy_s(), time.process_time(), time.perf_counter()
    common = dict(args=targs, train_dataset=data, callbacks=[timer],
                  data_collator=transformers.default_data_collator)
    if engine == "zerocore":
        from zerocore.hf_trainer import ShardedTrainer
        trainer = ShardedTrainer(model=model, **common)
    else:
        trainer = Trainer(model=model, **common)
    # Its printed log lines (one per step, per rank) would bury the tables.
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    trainer.train()
    usage = dict(busy=harness.machine_busy_s() - busy0, cpu=time.process_time() - cpu0,
                 wall=time.perf_counter() - wall0)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapped = type(trainer.model_wrapped).__name__
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under accelerate's
    optimizer = f"{type(inner).__module__.split('.')[0]}.{type(inner).__name__}"
    if inner.param_groups[0].get("fused"):
        optimizer += " (fused)"
    # Free the model and its collectives' buffers before the next engine (and before the
    # process group goes: see harness.run_ranks).
    del trainer, model
    gc.collect()
    return dict(times=timer.times[args.warmup:], losses=losses, wrapped=wrapped,
                optimizer=optimizer, usage=usage)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(1)
    # Every rank builds the whole dataset; Trainer's sampler gives each its own rows.
    ids = torch.randint(0, VOCAB, (world * ROWS * (args.warmup + args.steps), SEQ), generator=g)
    data = [{"input_ids": r, "labels": r} for r in ids]
    results: dict = {}
    with tempfile.TemporaryDirectory() as out:
        for mode in args.modes:
            for rep in range(args.repeats):
                # Alternate the order, so that no engine always runs first (or last) in a repeat.
                order = args.engines if rep % 2 == 0 else args.engines[::-1]
                for engine in order:
                    r = train_once(engine, mode, world, args, data, out)
                    results.setdefault((mode, engine), []).append(r)
    return results


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def own_seconds() -> float:
    """CPU seconds of this process and its joined children (the ranks)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run "
                   "(default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each engine (default 3)")
    p.add_argument("--modes", default="full,lora", help="full and/or lora (default both)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"a subset of {','.join(ENGINES)} (default all; the ratio needs fsdp2)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    args.modes = args.modes.split(",")
    args.engines = args.engines.split(",")
    if unknown := set(args.engines) - set(ENGINES):
        p.error(f"unknown engines {sorted(unknown)}")

    load_before = load_average()
    started = harness.header(packages=("torch", "transformers", "accelerate"))
    # The cores that other work kept busy meanwhile: the machine's busy time less our own.
    busy0, own0, wall0 = harness.machine_busy_s(), own_seconds(), time.monotonic()
    with tempfile.TemporaryDirectory() as checkpoint:
        torch.manual_seed(0)
        model = GPTNeoXForCausalLM(config(args.layers, args.hidden))
        n_params = sum(t.numel() for t in model.parameters())
        model.save_pretrained(checkpoint)
        del model
        args.checkpoint = checkpoint
        # What torchrun would set is set in every rank (harness.rank_env), for accelerate.
        per_rank = harness.run_ranks(rank_main, args.nproc, args, env=dict(OMP_NUM_THREADS="1"))
    load_after = load_average()
    other = ((harness.machine_busy_s() - busy0) - (own_seconds() - own0)) / (time.monotonic() -
                                                                               wall0)

    tokens = args.nproc * ROWS * SEQ  # per optimizer step, all ranks together
    print(started)
    print(f"# GPT-NeoX {args.layers} layers, hidden {args.hidden}, vocabulary {VOCAB}: "
          f"{n_params:,} parameters, fp32; {args.nproc} gloo ranks x {ROWS} x {SEQ} tokens; "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} repeats per engine")
    print(f"# load average (1, 5, 15 min) before {load_before}, after {load_after}; other work "
          f"kept {max(other, 0.0):.2f} cores busy on average during the run")
    print()
    rows = []
    medians: dict = {}
    for mode in args.modes:
        for engine in args.engines:
            runs = list(zip(*(r[(mode, engine)] for r in per_rank)))  # per repeat, by rank
            medians[mode, engine] = [max(statistics.median(x["times"]) for x in ranks)
                                     for ranks in runs]
        for engine in args.engines:
            per_rep = medians[mode, engine]
            mid = statistics.median(per_rep)
            ratio = "-"
            if "fsdp2" in args.engines:
                # Repeat by repeat: the engines of one repeat ran moments apart.
                ratios = [a / b for a, b in zip(per_rep, medians[mode, "fsdp2"])]
                ratio = (f"{statistics.median(ratios):.3f} "
                         f"({', '.join(f'{x:.3f}' for x in ratios)})")
            first = per_rank[0][(mode, engine)][0]
            others = []
            for ranks in zip(*(r[(mode, engine)] for r in per_rank)):
                u = ranks[0]["usage"]  # the machine's busy time, as rank 0 saw it
                own = sum(x["usage"]["cpu"] for x in ranks)
                others.append(max(u["busy"] - own, 0.0) / u["wall"])
            rows.append((mode, engine, f"{first['wrapped']} / {first['optimizer']}",
                         ", ".join(f"{x * 1e3:.1f}" for x in per_rep), f"{mid * 1e3:.1f}",
                         f"{tokens / mid:,.0f}", ratio, ", ".join(f"{x:.2f}" for x in others)))
    print(harness.table(("mode", "engine", "Trainer's model / optimizer", "step ms per repeat, "
                         "median of the slower rank", "median of repeats", "tokens/s",
                         "/ FSDP2: median (per repeat)", "other load per repeat (cores)"),
                        rows, "llllrrrl"))
    print()
    for mode in args.modes:
        ref = per_rank[0][(mode, args.engines[0])][0]["losses"]
        for engine in args.engines:
            losses = per_rank[0][(mode, engine)][0]["losses"]
            diff = max(abs(a - b) for a, b in zip(losses, ref))
            print(f"{mode} {engine}: first losses {', '.join(f'{x:.5f}' for x in losses[:3])}; "
                  f"largest |difference| from {args.engines[0]} over {len(losses)} steps "
                  f"{diff:.2e}")


if __name__ == "__main__":
    main()
