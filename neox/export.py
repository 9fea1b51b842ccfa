"""python -m neox.export CKPT OUT: a fine-tuning checkpoint as a Hugging Face directory, on the
CPU, one layer at a time, without the processes that trained it.

The base weights come from where the run took them (its ``--checkpoint``, or the preset's seeded
random initialisation), the trained parameters from the checkpoint's fp32 master shards; both are
recorded in the checkpoint's manifest. LoRA adapters are merged into the weights (default) or,
with ``--lora separate``, the base model is exported unchanged and the adapters are written
beside it in PEFT's layout (``adapter/adapter_model.safetensors`` + ``adapter_config.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from zerocore.checkpoint import CheckpointError as ShardCheckpointError
from zerocore.checkpoint import read_manifest
from zerocore.consolidate import iter_full_layers

from neox.weights import RandomInit, WeightsError, iter_layers, open_weights
from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.weights.hf import hf_key, save_hf
from neox.lora import merge_lora
from neox.model import layer_specs


def _run_settings(ckpt: Path) -> tuple[dict[str, Any], NeoXConfig]:
    extra = read_manifest(ckpt)["extra"]
    if "args" not in extra or "config" not in extra:
        raise ShardCheckpointError(f"{ckpt}: not a checkpoint of neox.finetune (its manifest "
                                   f"has no run settings); use python -m zerocore.consolidate")
    return extra["args"], NeoXConfig.from_hf_dict(extra["config"])


def trained_layers(ckpt: Path, log=print) -> Iterator[tuple[Any, str, int | None,
                                                            dict[str, torch.Tensor]]]:
    """(layer spec, kind, block index in the exported model, full fine-tuned state) per layer."""
    args, config = _run_settings(ckpt)
    reader = (open_weights(args["checkpoint"]) if args.get("checkpoint")
              else RandomInit(config, seed=args["seed"]))
    mode = FinetuneMode(args["finetune"], lora_rank=args["lora_rank"],
                        lora_alpha=args["lora_alpha"],
                        lora_targets=tuple(t.strip() for t in args["lora_targets"].split(",")),
                        seed=args["seed"])
    specs = layer_specs(config, args["filter_layers"])
    base = iter_layers(reader, filter_layers=args["filter_layers"])
    trained = iter_full_layers(ckpt, trainable_only=True)
    for i, (spec, layer, (j, tensors)) in enumerate(zip(specs, base, trained)):
        assert i == j
        prepare_layer(layer, i, mode)
        state = layer.state_dict()
        unknown = set(tensors) - set(state)
        if unknown:
            raise ShardCheckpointError(f"{ckpt}: layer {i} has trained tensors {sorted(unknown)} "
                                       f"that the rebuilt model does not have")
        for name, t in tensors.items():
            state[name] = t.to(state[name].dtype)
        log(f"layer {i + 1}/{len(specs)}: {spec.kind}, {len(tensors)} trained tensors")
        yield spec, spec.kind, spec.index, state


def export(ckpt: Path, out: Path, *, lora: str = "merged", log=print) -> Path:
    args, config = _run_settings(ckpt)
    specs = layer_specs(config, args["filter_layers"])
    built = dataclasses.replace(config, num_hidden_layers=len(specs) - 3)
    scaling = args["lora_alpha"] / args["lora_rank"]
    adapters: dict[str, torch.Tensor] = {}

    def states():
        for spec, kind, index, state in trained_layers(ckpt, log):
            if lora == "separate":
                for name in [k for k in state if ".lora_" in k]:
                    module, _, which = name.rpartition(".")
                    key = "base_model.model." + hf_key(kind, index, f"{module}.{which}.weight")
                    adapters[key] = state.pop(name).float().contiguous()
                yield kind, index, state
            else:
                yield kind, index, merge_lora(state, scaling)

    save_hf(out, built, states())
    if lora == "separate" and adapters:
        adapter_dir = out / "adapter"
        adapter_dir.mkdir()
        save_file(adapters, str(adapter_dir / "adapter_model.safetensors"))
        # PEFT matches a target against the end of a module's dotted name, as neox.lora does.
        targets = [t.strip() for t in args["lora_targets"].split(",")]
        (adapter_dir / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args["lora_rank"],
            "lora_alpha": args["lora_alpha"], "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "target_modules": targets,
            "base_model_name_or_path": str(out)}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neox.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a neox.finetune checkpoint (step-XXXXXXXX)")
    p.add_argument("out", type=Path, help="output directory (must not exist or be empty)")
    p.add_argument("--lora", choices=["merged", "separate"], default="merged",
                   help="merge LoRA adapters into the weights, or write them beside the base "
                        "model in PEFT's layout")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, lora=args.lora)
    except (WeightsError, ShardCheckpointError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
