"""The end of a run: validation, the memory and communication reports, the final checkpoint,
the trained parameters, the Hugging Face export and a text sample."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerocore
from neox.config import filtered_config
from neox.lora import merge_lora
from neox.model import layer_specs
from neox.weights import save_hf
from neox.run.recipe import Recipe
from neox.run.run_dir import HF_EXPORT, TOKENIZER, TRAINABLE, MetricsFile
from neox.run.progress import Log
from neox.run.sampling import sample_sharded
from neox.run.trained import trained_layers
from neox.run.build import TrainState
from neox.run.loop import StepsDone, evaluate
from neox.run.memory import report_measured
from neox.run.run_data import RunData
from neox.run.save import save, write_trainable


def finish(state: TrainState, recipe: Recipe, data: RunData, done: StepsDone,
           metrics: MetricsFile | None, run_id: str, *, device: torch.device, rank: int,
           world_size: int, log: Log) -> None:
    """Validation (the loop's at its last step, in that step's metrics line; measured here when
    the run trained no step), the reports, the final checkpoint and the results."""
    val_loss, val_acc = done.validation or evaluate(
        state.model, data.dataset.val, rank=rank, world_size=world_size,
        batch_size=recipe.training.batch_size, device=device)
    log(f"validation: loss {val_loss:.4f}, perplexity {math.exp(min(val_loss, 50)):.2f}, "
        f"accuracy {val_acc:.3f}")
    zerocore.run_agreed(lambda: metrics.close() if metrics is not None else None)
    if done.memory is not None:
        tables: list[Any] = [None] * world_size
        dist.all_gather_object(tables, done.memory.table())
        log("memory per rank (model state, measured vs (2+2+K)·Ψ/N_d):")
        for t in tables:
            log(t)
        log("communication this run:\n" + done.comm.table(steps=state.step - done.first_step,
                                                          micro_batches=recipe.training.grad_accum))
    if recipe.output.measure_memory:
        report_measured(state, recipe, done.measured, device=device, world_size=world_size,
                        log=log)
    if recipe.layout.hybrid == "hsdp":
        # What the checkpoint (replica 0's shards) stands for: every replica's, to the bit.
        # (hpZ has no replicas: every rank holds its own slice.)
        agree = state.model.replicas_agree()
        log(f"replicas: the {state.nodes} replicas' trainable shards are "
            + ("bitwise equal" if agree else "NOT equal (a bug: please report it); the "
                                             "checkpoint holds replica 0's"))
    ckpt = save(state, recipe, data, run_id, rank=rank)
    trained = write_trainable(state, Path(recipe.output.output_dir) / TRAINABLE, rank=rank)
    log(f"saved: checkpoint {ckpt}")
    log(f"saved: trained parameters only {trained}")
    if recipe.output.export_hf:
        log(f"saved: Hugging Face export {export_hf(state, recipe, data, ckpt, rank=rank)}")
    if recipe.output.sample_tokens:
        log(sample_text(state, recipe, data))


def export_hf(state: TrainState, recipe: Recipe, data: RunData, checkpoint: Path, *,
              rank: int) -> Path:
    """The fine-tuned model (kept layers only, LoRA merged) as a Hugging Face directory with the
    run's tokenizer, gathered one layer at a time to rank 0, which alone writes. Collective.
    With quantized frozen weights the engine holds quantized copies of them: rank 0 then takes the
    base weights and the trained tensors of ``checkpoint`` instead, as ``neox.export`` does."""
    model = recipe.model
    specs = layer_specs(state.config, model.filter_layers)
    built = filtered_config(state.config, model.filter_layers)
    out = Path(recipe.output.output_dir) / HF_EXPORT
    scaling = model.finetune.lora_scaling
    if recipe.sharding.frozen_quantized:
        states = (((s.kind, s.index, merge_lora(full, scaling))
                   for s, full in trained_layers(checkpoint, log=lambda *_: None))
                  if rank == 0 else iter(()))
    else:
        states = ((s.kind, s.index, merge_lora(full, scaling)) for s, (_, full) in
                  zip(specs, state.model.iter_full_states(to_rank=0)))

    def write() -> None:
        if rank != 0:
            for _ in states:  # take part in every layer's gather
                pass
            return
        tok = Path(recipe.output.output_dir) / TOKENIZER  # written when the run started
        # A failed write is one CheckpointWriteError line naming the file (checkpoint.durable_io)
        save_hf(out, built, states, overwrite=True, extra_files={TOKENIZER: tok})
    zerocore.run_agreed(write)
    return out


# A short sample shows what the model learnt: continuing the first tokens of the validation
# text (held out, so not a memorised continuation), at a temperature that reads as text
# (--sample-temperature).
SAMPLE_PROMPT_TOKENS, SAMPLE_TOP_K = 8, 40


def sample_text(state: TrainState, recipe: Recipe, data: RunData) -> str:
    """A sample of ``recipe.output.sample_tokens`` tokens from the sharded model, as the lines
    to print. Collective."""
    prompt = data.dataset.val.windows[0][:SAMPLE_PROMPT_TOKENS].long()[None]   # (1, T)
    generator = torch.Generator().manual_seed(recipe.training.seed)
    # Every rank samples the same text (the same prompt, seed and logits); rank 0 prints it.
    ids = sample_sharded(state.model, prompt.to(state.model.device),
                         new_tokens=recipe.output.sample_tokens,
                         temperature=recipe.output.sample_temperature, top_k=SAMPLE_TOP_K,
                         generator=generator, group=state.model.group)[0].tolist()
    start = data.tokenizer.decode(ids[:SAMPLE_PROMPT_TOKENS])
    text = data.tokenizer.decode(ids).lstrip(" ")
    body = "\n".join("  " + line for line in text.splitlines())
    return (f"sample ({recipe.output.sample_tokens} tokens, temperature "
            f"{recipe.output.sample_temperature}, "
            f"top-k {SAMPLE_TOP_K}) continuing {start!r} from the validation text:\n{body}")
