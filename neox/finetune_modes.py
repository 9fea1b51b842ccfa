"""What is trained: the fine-tuning modes, applied to each layer before it is sharded.

- ``biases`` (default, as in the source article): per transformer block the attention qkv bias,
  the attention output bias and the MLP h→4h bias; everything else frozen.
- ``lora``: LoRA adapters on the chosen projections of every block are the only trainable
  parameters.
- ``full``: every parameter.
"""

from __future__ import annotations

import dataclasses
import torch
from torch import nn

from neox.lora import add_lora
from neox.setting import Flag, comma_list, finite_float, first_problem, is_finite, is_int, setting

MODES = ("biases", "lora", "full")
# --finetune auto: biases when there are pretrained weights; without them there is nothing to
# fine-tune, so the whole preset trains from scratch (neox.finetune also changes its
# optimisation defaults then).
FINETUNE_DEFAULT_MODE = "biases"
BIAS_NAMES = ("attention.query_key_value.bias", "attention.dense.bias", "mlp.dense_h_to_4h.bias")


# The --help section of the mode's flags.
GROUP = "fine-tuning mode"


@dataclasses.dataclass(frozen=True)
class FinetuneMode:
    mode: str = setting(
        "biases", check=lambda m: m in MODES,
        problem="unknown fine-tuning mode {value!r}; choose one of " + str(MODES),
        flag=Flag(GROUP, "what to train; auto: biases with --checkpoint, and without one "
                         "(nothing pretrained to fine-tune) full training of the preset from "
                         "scratch", name="--finetune", choices=("auto",) + MODES,
                  default="auto", has_default=True))
    lora_rank: int = setting(
        8, check=lambda r: is_int(r) and r >= 1,
        problem="LoRA rank must be an integer >= 1, got {value!r}",
        flag=Flag(GROUP, "rank r of each LoRA adapter (--finetune lora)", parse=int))
    lora_alpha: float = setting(
        16.0, check=lambda a: is_finite(a) and a > 0,
        problem="LoRA alpha must be a finite number > 0, got {value!r}",
        flag=Flag(GROUP, "LoRA scaling numerator: adapters add (alpha / r) * B A",
                  parse=finite_float))
    lora_targets: tuple[str, ...] = setting(
        ("query_key_value", "attention.dense"),
        check=lambda t: isinstance(t, tuple) and bool(t) and all(
            isinstance(x, str) and x for x in t),
        problem="LoRA targets must be projection names, got {value!r}",
        flag=Flag(GROUP, "comma-separated projections that get adapters", parse=comma_list,
                  text=",".join))
    # For the LoRA initialisation, identical on every rank.
    seed: int = setting(0, check=is_int, problem="the LoRA seed must be an integer, got "
                        "{value!r}", follows="seed")

    def __post_init__(self) -> None:
        message = first_problem(self)
        if message is not None:
            raise ValueError(message)

    @property
    def lora_scaling(self) -> float:
        """What each adapter's B A is multiplied by: alpha / r."""
        return self.lora_alpha / self.lora_rank


def auto_mode(has_weights: bool) -> str:
    """What ``--finetune auto`` trains: biases of pretrained weights, everything otherwise."""
    return FINETUNE_DEFAULT_MODE if has_weights else "full"


def is_block(layer: nn.Module) -> bool:
    return hasattr(layer, "attention") and hasattr(layer, "mlp")


def prepare_layer(layer: nn.Module, index: int, mode: FinetuneMode) -> nn.Module:
    """Sets requires_grad (and inserts LoRA adapters) on one layer; ``index`` is the layer's
    position in the stack, used to seed its adapters."""
    if mode.mode == "full":
        layer.requires_grad_(True)
        return layer
    layer.requires_grad_(False)
    if not is_block(layer):
        return layer
    if mode.mode == "biases":
        params = dict(layer.named_parameters())
        for name in BIAS_NAMES:
            # A model without attention biases (attention_bias=False) trains the MLP bias only.
            if name in params:
                params[name].requires_grad_(True)
    else:
        gen = torch.Generator().manual_seed(mode.seed * 100003 + index)
        add_lora(layer, list(mode.lora_targets), mode.lora_rank, mode.lora_alpha, gen)
        for name, p in layer.named_parameters():
            p.requires_grad_(name.endswith("lora_A") or name.endswith("lora_B"))
    return layer
