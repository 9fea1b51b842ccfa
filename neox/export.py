"""python -m neox.export CKPT OUT: a fine-tuning checkpoint as a Hugging Face directory, on the
CPU, one layer at a time, without the processes that trained it.

The base weights come from where the run took them (its ``--checkpoint``, or the preset's seeded
random initialisation), the trained parameters from the checkpoint's fp32 master shards; both are
recorded in the checkpoint's manifest (the run's recipe and model configuration). LoRA adapters
are merged into the weights (default) or, with ``--lora separate``, the base model is exported
unchanged and the adapters are written beside it in PEFT's layout
(``adapter/adapter_model.safetensors`` + ``adapter_config.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from neox.config import NeoXConfig, filtered_config
from neox.finetune_modes import prepare_layer
from neox.lora import merge_lora
from neox.model import LayerKind, LayerSpec, layer_specs
from neox.recipe import Recipe, RecipeError, recipe_from_checkpoint
from neox.weights import RandomInit, WeightsError, iter_layers, open_weights, save_hf
from neox.weights.hf import hf_key
from zerocore.checkpoint import CheckpointError, iter_full_layers, read_manifest

__all__ = ["export", "trained_layers", "run_settings", "main"]


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


def _take_adapters(state: dict[str, torch.Tensor], kind: LayerKind, index: int | None,
                   adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Moves a layer's LoRA tensors into ``adapters`` under PEFT's names."""
    for name in [k for k in state if ".lora_" in k]:
        module, _, which = name.rpartition(".")
        key = "base_model.model." + hf_key(kind, index, f"{module}.{which}.weight")
        adapters[key] = state.pop(name).float().contiguous()
    return state


def export(ckpt: Path, out: Path, *, lora: str = "merged", overwrite: bool = False,
           log=print) -> Path:
    recipe, config = run_settings(ckpt)
    mode = recipe.model.finetune
    built = filtered_config(config, recipe.model.filter_layers)
    adapters: dict[str, torch.Tensor] = {}

    def states():
        for spec, state in trained_layers(ckpt, log):
            if lora == "separate":
                yield spec.kind, spec.index, _take_adapters(state, spec.kind, spec.index,
                                                            adapters)
            else:
                yield spec.kind, spec.index, merge_lora(state, mode.lora_scaling)

    save_hf(out, built, states(), overwrite=overwrite)
    if lora == "separate" and adapters:
        adapter_dir = out / "adapter"
        adapter_dir.mkdir()
        save_file(adapters, str(adapter_dir / "adapter_model.safetensors"))
        # PEFT matches a target against the end of a module's dotted name, as neox.lora does.
        (adapter_dir / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": mode.lora_rank,
            "lora_alpha": mode.lora_alpha, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "target_modules": list(mode.lora_targets),
            "base_model_name_or_path": str(out)}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neox.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a neox.finetune checkpoint (step-XXXXXXXX)")
    p.add_argument("out", type=Path, help="output directory (must not exist or be empty)")
    p.add_argument("--lora", choices=["merged", "separate"], default="merged",
                   help="merge LoRA adapters into the weights, or write them beside the base "
                        "model in PEFT's layout")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists (it is replaced only once the export is "
                        "complete)")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, lora=args.lora, overwrite=args.overwrite)
    except FileExistsError:
        print(f"error: {args.out} exists and is not an empty directory; choose another output "
              f"directory, or pass --overwrite to replace it", file=sys.stderr)
        return 2
    except (WeightsError, CheckpointError, RecipeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {e.filename or args.out}: [Errno {e.errno}] "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

