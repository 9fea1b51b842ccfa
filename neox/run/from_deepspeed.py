"""``neox.finetune --resume DSDIR``: a DeepSpeed ZeRO-3 run of a GPT-NeoX model (transformers'
``GPTNeoXForCausalLM``, plain or wrapped by PEFT LoRA) continued on zerocore.

The run is the one the flags describe (model, fine-tuning mode, data, loop and output), a new
run in its output directory. From the DeepSpeed checkpoint it takes the trained parameters' fp32
masters, Adam's moments and step, the loss-scale state and the step count (DeepSpeed's
``global_steps``: the step numbers continue), and, for each optimizer flag not given (--lr,
--betas, --eps, --weight-decay), the DeepSpeed run's value. The frozen weights are the ones
--checkpoint gives, as in every neox run (exports read them there too); the checkpoint's copy of
them must be equal, or the resume is refused. DeepSpeed saves no data order, so the sampler
starts at the beginning of its first epoch (--seed's order), and the log says so.

Names: inside each layer neox uses Hugging Face's parameter names (``neox.model``), so a neox
parameter is DeepSpeed's after a prefix per layer kind (``gpt_neox.layers.{block}.`` and so on;
the readout ``embed_out`` is ``lm_head`` in models of transformers 5);
under PEFT the model is ``base_model.model.``, a LoRA-wrapped projection's own weight and bias
are ``...base_layer.weight``/``.bias`` and its adapters ``...lora_A.<adapter>.weight``.
Everything that can be known from the flags and the files is checked before any process starts
(``check_resume``); the shapes and the frozen weights when the model is built.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from neox.config import NeoXConfig
from neox.finetune_modes import FinetuneMode, prepare_layer
from neox.model import LayerSpec, build_layer, layer_specs
from neox.run.recipe import ModelRecipe
from zerocore.checkpoint import (ADAPTER_CONFIG, DeepSpeedCheckpoint, adapter_names,
                                 is_deepspeed_checkpoint)

__all__ = ["DeepSpeedCheckpoint", "is_deepspeed_checkpoint", "deepspeed_name", "namer",
           "check_resume", "optimizer_settings", "describe", "PEFT_PREFIX"]

PEFT_PREFIX = "base_model.model."
_LAYER_PREFIX = {"embed": "gpt_neox.", "final_norm": "gpt_neox.", "readout": ""}


def _lora_wrapped(module: str, mode: FinetuneMode) -> bool:
    """Whether neox.lora.add_lora wraps the block's projection ``module`` in this mode."""
    return mode.mode == "lora" and any(module == t or module.endswith("." + t)
                                       for t in mode.lora_targets)


def deepspeed_name(spec: LayerSpec, name: str, mode: FinetuneMode, adapter: str | None,
                   readout: str = "embed_out") -> str:
    """The DeepSpeed checkpoint's name of parameter ``name`` of the neox layer ``spec``;
    ``adapter``: the PEFT adapter name when the DeepSpeed model was a PEFT model, else None;
    ``readout``: the output projection's module name in that model (``embed_out`` up to
    transformers 4, ``lm_head`` from 5)."""
    if spec.kind == "readout":
        name = readout + name.removeprefix("embed_out")
    if adapter is not None and spec.kind == "block":
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            name = f"{module}.{leaf}.{adapter}.weight"
        elif _lora_wrapped(module, mode):
            name = f"{module}.base_layer.{leaf}"
    prefix = (f"gpt_neox.layers.{spec.source}." if spec.kind == "block"
              else _LAYER_PREFIX[spec.kind])
    return (PEFT_PREFIX if adapter is not None else "") + prefix + name


def peft_adapter(ckpt: DeepSpeedCheckpoint) -> str | None:
    """The adapter name when the DeepSpeed run's model was a PEFT model (its names start with
    ``base_model.model.``), else None. Raises ValueError for several adapters."""
    names = list(ckpt.trainable) + list(ckpt.frozen)
    if not any(n.startswith(PEFT_PREFIX) for n in names):
        return None
    adapters = sorted(adapter_names(list(ckpt.trainable)))
    if len(adapters) > 1:
        raise ValueError(f"{ckpt.tag_dir}: the DeepSpeed run trained {len(adapters)} LoRA "
                         f"adapters {adapters}; neox trains one")
    return adapters[0] if adapters else "default"


def namer(ckpt: DeepSpeedCheckpoint, specs: list[LayerSpec],
          mode: FinetuneMode) -> Callable[[int, str], str]:
    """``ds_name(layer index, neox name)`` for ``zerocore.checkpoint.deepspeed``'s loader."""
    adapter = peft_adapter(ckpt)
    prefix = PEFT_PREFIX if adapter is not None else ""
    readout = "lm_head" if f"{prefix}lm_head.weight" in {*ckpt.trainable, *ckpt.frozen} \
        else "embed_out"
    return lambda index, name: deepspeed_name(specs[index], name, mode, adapter, readout)


def _trained_here(config: NeoXConfig, model: ModelRecipe) -> list[tuple[int, str]]:
    """(layer index, neox name) of every parameter the flags train, from layers built on the
    meta device (nothing allocated but LoRA's small adapters)."""
    out = []
    for i, spec in enumerate(layer_specs(config, model.filter_layers)):
        layer = prepare_layer(build_layer(spec.kind, config, device="meta"), i, model.finetune)
        out += [(i, n) for n, p in layer.named_parameters() if p.requires_grad]
    return out


def _lora_config(ckpt: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """The PEFT LoRA config saved beside the checkpoint (where Hugging Face's Trainer puts it),
    if any."""
    for path in (ckpt.tag_dir.parent / ADAPTER_CONFIG, ckpt.tag_dir / ADAPTER_CONFIG):
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except ValueError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
            return config if isinstance(config, dict) else None
    return None


def _trained_names(ckpt: DeepSpeedCheckpoint, config: NeoXConfig, model: ModelRecipe) -> set[str]:
    """DeepSpeed's names of the parameters ``model`` trains."""
    name = namer(ckpt, layer_specs(config, model.filter_layers), model.finetune)
    return {name(i, n) for i, n in _trained_here(config, model)}


def _mode_flags(ckpt: DeepSpeedCheckpoint, config: NeoXConfig, model: ModelRecipe,
                alpha: Any) -> str:
    """The --finetune flags that train exactly what the DeepSpeed run trained, if any: each
    candidate is tried as check_resume tries the flags."""
    lora_a = [n for n in ckpt.trainable if ".lora_A." in n]
    candidates = [("--finetune full", FinetuneMode("full")),
                  ("--finetune biases", FinetuneMode("biases"))]
    if lora_a:
        rank = ckpt.trainable[lora_a[0]].shape[0]
        modules = sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in lora_a})
        # neox matches a target by the end of the module's name: "dense" alone is the
        # attention's output projection ("attention.dense"; the MLP's are dense_*).
        targets = tuple("attention.dense" if m == "dense" else m for m in modules)
        lora_alpha = float(alpha) if isinstance(alpha, (int, float)) else model.finetune.lora_alpha
        candidates.insert(0, (f"--finetune lora --lora-rank {rank}"
                              + (f" --lora-alpha {alpha:g}" if isinstance(alpha, (int, float))
                                 else "") + f" --lora-targets {','.join(targets)}",
                              FinetuneMode("lora", lora_rank=rank, lora_alpha=lora_alpha,
                                           lora_targets=targets)))
    there = set(ckpt.trainable)
    for text, mode in candidates:
        if _trained_names(ckpt, config, dataclasses.replace(model, finetune=mode)) == there:
            return text
    return "none of neox's fine-tuning modes trains exactly these"


def check_resume(ckpt: DeepSpeedCheckpoint, config: NeoXConfig, model: ModelRecipe) -> None:
    """Whether the flags' model trains what the DeepSpeed run trained, under the same names
    and LoRA settings; ValueError (one line, with the flags that would) if not."""
    where = ckpt.tag_dir
    mode = model.finetune
    lora = _lora_config(ckpt)
    alpha = lora.get("lora_alpha") if lora else None
    here = _trained_names(ckpt, config, model)
    there = set(ckpt.trainable)
    if here != there:
        only_here, only_there = sorted(here - there), sorted(there - here)
        raise ValueError(
            f"{where}: the flags (--finetune {mode.mode}) train {len(here)} parameters, "
            f"the DeepSpeed run trained {len(there)} ({len(only_here)} only here, e.g. "
            f"{only_here[:1]}; {len(only_there)} only there, e.g. {only_there[:1]}); give the "
            f"model and mode the run trained: {_mode_flags(ckpt, config, model, alpha)}")
    if mode.mode == "lora" and lora is not None:
        if isinstance(alpha, (int, float)) and float(alpha) != float(mode.lora_alpha):
            raise ValueError(f"{where}: the DeepSpeed run's LoRA alpha was {alpha:g} (its "
                             f"{ADAPTER_CONFIG}), --lora-alpha {mode.lora_alpha:g} here; give "
                             f"--lora-alpha {alpha:g}")
        changed = [k for k in ("use_rslora", "use_dora") if lora.get(k)]
        if changed:
            raise ValueError(f"{where}: the DeepSpeed run's LoRA used {changed[0]}, "
                             f"which neox's LoRA does not implement")


def optimizer_settings(ckpt: DeepSpeedCheckpoint) -> dict[str, Any]:
    """The DeepSpeed run's AdamW settings at the save (its first parameter group's), under
    neox.finetune's flag names."""
    group = ckpt.param_groups[0] if ckpt.param_groups else {}
    out = {k: group[k] for k in ("lr", "eps", "weight_decay") if k in group}
    if "betas" in group:
        out["betas"] = tuple(float(b) for b in group["betas"])
    return out


def describe(ckpt: DeepSpeedCheckpoint) -> str:
    return (f"{ckpt.tag_dir} (DeepSpeed {ckpt.ds_version}, ZeRO-3 over {ckpt.world_size} ranks, "
            f"step {ckpt.global_steps})")

