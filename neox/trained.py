"""A fine-tuning run's checkpoint as a model: the base weights the run started from (its
pretrained weights, or the preset's seeded random initialisation) with the checkpoint's trained
tensors in place, layer by layer, and the tokenizer the run used.

Everything needed is recorded in the checkpoint (the run's recipe, the model's configuration,
the tokenizer's checksum), so ``neox.export``, ``neox.evaluate`` and ``neox.generate`` work from
a checkpoint alone, without the processes that trained it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import torch

from neox.config import NeoXConfig, filtered_config
from neox.finetune_modes import prepare_layer
from neox.lora import merge_lora
from neox.model import LayerSpec, NeoXModel, build_layer, layer_specs
from neox.recipe import Recipe, recipe_from_checkpoint
from neox.run_dir import (CHECKPOINTS, RUN_FILE, TOKENIZER, TOKENIZER_SHA256,
                          find_resume_checkpoint)
from neox.weights import RandomInit, iter_layers, open_weights
from zerocore.checkpoint import CheckpointError, MANIFEST, iter_full_layers, read_manifest

__all__ = ["run_settings", "trained_layers", "trained_model", "run_checkpoint",
           "find_tokenizer", "checkpoint_tokenizer"]


def run_settings(ckpt: Path) -> tuple[Recipe, NeoXConfig]:
    """The recipe and model configuration stored in a neox.finetune checkpoint."""
    return recipe_from_checkpoint(read_manifest(ckpt)["extra"], str(ckpt))


def trained_layers(ckpt: Path, log=print) -> Iterator[tuple[LayerSpec, dict[str, torch.Tensor]]]:
    """(layer spec, full fine-tuned state) per kept layer: the base weights with the
    checkpoint's trained tensors in place."""
    recipe, config = run_settings(ckpt)
    model = recipe.model
    reader = (open_weights(model.checkpoint, allow_outside=model.allow_outside_weights)
              if model.checkpoint is not None else RandomInit(config, seed=model.seed))
    specs = layer_specs(config, model.filter_layers)
    base = iter_layers(reader, filter_layers=model.filter_layers)
    trained = iter_full_layers(ckpt, trainable_only=True)
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


def trained_model(ckpt: Path, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> NeoXModel:
    """The fine-tuned model of a checkpoint (kept blocks only, LoRA merged), in one process."""
    recipe, config = run_settings(ckpt)
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


def checkpoint_tokenizer(ckpt: Path) -> tuple[Path | None, list[Path]]:
    """``find_tokenizer`` for a checkpoint, reading what it recorded."""
    recipe, _ = run_settings(ckpt)
    sha = read_manifest(ckpt)["extra"].get(TOKENIZER_SHA256)
    return find_tokenizer(ckpt, recipe, sha if isinstance(sha, str) else None)
