"""A fine-tuning run's checkpoint as a model: the base weights the run started from (its
pretrained weights, or the preset's seeded random initialisation) with the checkpoint's trained
tensors in place, layer by layer, and the tokenizer the run used.

Everything needed is recorded in the checkpoint (the run's recipe, the model's configuration,
the tokenizer's checksum), so ``neox.export``, ``neox.evaluate`` and ``neox.generate`` work from
a checkpoint alone, without the processes that trained it.

The recipe names paths (the base weights, the tokenizer, the output directory): none is opened
before the whole checkpoint is verified (``open_run``: manifest, COMMIT, every rank file's
checksum, identity and contents), since a manifest edited with its checksums recomputed would
otherwise point the readers anywhere. Each function takes a checkpoint directory (verified
then) or a ``RunCheckpoint`` that ``open_run`` returned (verified once for all of them).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Iterator

import torch

from neox.config import NeoXConfig, filtered_config
from neox.finetune_modes import prepare_layer
from neox.lora import merge_lora
from neox.model import LayerSpec, NeoXModel, build_layer, layer_specs
from neox.run.recipe import Recipe, recipe_from_checkpoint
from neox.run.run_dir import (CHECKPOINTS, RUN_FILE, TOKENIZER, TOKENIZER_SHA256,
                              find_resume_checkpoint)
from neox.weights import RandomInit, iter_layers, open_weights
from zerocore.checkpoint import (CheckpointError, MANIFEST, ShardReader, open_checkpoint,
                                 unverified_reason)

__all__ = ["RunCheckpoint", "open_run", "run_settings", "trained_layers", "trained_model",
           "run_checkpoint", "find_tokenizer", "checkpoint_tokenizer"]


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    """A neox.finetune checkpoint, verified, with the recipe and model configuration it
    stored."""

    path: Path
    reader: ShardReader        # every rank file checked; reads the trained tensors
    recipe: Recipe
    config: NeoXConfig

    @property
    def extra(self) -> dict:
        return self.reader.manifest["extra"]

    @property
    def unverified(self) -> str | None:
        """Why the checkpoint could not be verified (an older format, read as asked)."""
        return unverified_reason(self.reader.manifest)


def open_run(ckpt: "Path | RunCheckpoint", *, allow_unverified: bool = False) -> RunCheckpoint:
    """The checkpoint verified (``zerocore.open_checkpoint``), then its recipe read. Raises
    ``CheckpointError`` or ``RecipeError``. ``allow_unverified``: accept a checkpoint of a
    format older than rank-file identities."""
    if isinstance(ckpt, RunCheckpoint):
        return ckpt
    reader = open_checkpoint(ckpt, allow_unverified=allow_unverified)
    recipe, config = recipe_from_checkpoint(reader.manifest["extra"], str(ckpt))
    return RunCheckpoint(Path(ckpt), reader, recipe, config)


def run_settings(ckpt: "Path | RunCheckpoint") -> tuple[Recipe, NeoXConfig]:
    """The recipe and model configuration stored in a neox.finetune checkpoint."""
    run = open_run(ckpt)
    return run.recipe, run.config


def trained_layers(ckpt: "Path | RunCheckpoint", log=print
                   ) -> Iterator[tuple[LayerSpec, dict[str, torch.Tensor]]]:
    """(layer spec, full fine-tuned state) per kept layer: the base weights with the
    checkpoint's trained tensors in place."""
    run = open_run(ckpt)
    recipe, config, ckpt = run.recipe, run.config, run.path
    model = recipe.model
    reader = (open_weights(model.checkpoint, allow_outside=model.allow_outside_weights)
              if model.checkpoint is not None else RandomInit(config, seed=model.seed))
    specs = layer_specs(config, model.filter_layers)
    base = iter_layers(reader, filter_layers=model.filter_layers)
    trained = run.reader.full_layers(trainable_only=True)
    with reader:
        for i, (spec, layer, (j, tensors)) in enumerate(zip(specs, base, trained)):
            assert i == j
            prepare_layer(layer, i, model.finetune)
            state = layer.state_dict()
            unknown = set(tensors) - set(state)
            if unknown:
                raise CheckpointError(f"{ckpt}: layer {i} has trained tensors {sorted(unknown)} "
                                      f"that the rebuilt model does not have")
            for name, t in tensors.items():
                state[name] = t.to(state[name].dtype)
            log(f"layer {i + 1}/{len(specs)}: {spec.kind}, {len(tensors)} trained tensors")
            yield spec, state


def trained_model(ckpt: "Path | RunCheckpoint", *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> NeoXModel:
    """The fine-tuned model of a checkpoint (kept blocks only, LoRA merged), in one process."""
    ckpt = open_run(ckpt)
    recipe, config = ckpt.recipe, ckpt.config
    built = filtered_config(config, recipe.model.filter_layers)
    scaling = recipe.model.finetune.lora_scaling
    layers = []
    for spec, state in trained_layers(ckpt, log=lambda *a, **k: None):
        layer = build_layer(spec.kind, built, device="meta")
        merged = {k: v.to(device=device, dtype=dtype or v.dtype)
                  for k, v in merge_lora(state, scaling).items()}
        layer.load_state_dict(merged, strict=True, assign=True)
        layers.append(layer)
    return NeoXModel(built, layers, source_layers=recipe.model.filter_layers)


def run_checkpoint(path: Path) -> Path | None:
    """The training checkpoint ``path`` names: a step directory itself, or the newest of the
    run in a run's output directory or its checkpoints folder; None when ``path`` is neither
    (pretrained weights, say)."""
    if (path / MANIFEST).is_file():
        return path
    if (path / RUN_FILE).is_file() or (path / CHECKPOINTS).is_dir():
        return find_resume_checkpoint(path / CHECKPOINTS, path)
    if path.name == CHECKPOINTS and path.is_dir():
        return find_resume_checkpoint(path, path.parent)
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def find_tokenizer(ckpt: Path, recipe: Recipe, sha256: str | None) -> tuple[Path | None,
                                                                              list[Path]]:
    """The tokenizer file the run of ``ckpt`` used: the first of its output directory's copy
    (beside the checkpoints folder, or where the recipe says), the ``--tokenizer`` it was given,
    the pretrained weights' ``tokenizer.json``, whose checksum is ``sha256`` (for checkpoints
    that recorded none, the first that exists). Returns it (or None) and the places looked."""
    candidates = [ckpt.parent.parent / TOKENIZER, Path(recipe.output.output_dir) / TOKENIZER]
    if recipe.data.tokenizer:
        given = Path(recipe.data.tokenizer)
        candidates.append(given / TOKENIZER if given.is_dir() else given)
    if recipe.model.checkpoint:
        candidates.append(Path(recipe.model.checkpoint) / TOKENIZER)
    for candidate in candidates:
        if candidate.is_file() and (sha256 is None or _sha256(candidate) == sha256):
            return candidate, candidates
    return None, candidates


def checkpoint_tokenizer(ckpt: "Path | RunCheckpoint") -> tuple[Path | None, list[Path]]:
    """``find_tokenizer`` for a checkpoint, reading what it recorded."""
    run = open_run(ckpt)
    sha = run.extra.get(TOKENIZER_SHA256)
    return find_tokenizer(run.path, run.recipe, sha if isinstance(sha, str) else None)
