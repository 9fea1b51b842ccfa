"""A fine-tuning checkpoint as a Hugging Face directory, on the CPU, one layer at a time,
without the processes that trained it (``python -m neox.export``).

The base weights come from where the run took them (its ``--checkpoint``, or the preset's seeded
random initialisation), the trained parameters from the checkpoint's fp32 master shards; both are
recorded in the checkpoint's manifest (the run's recipe and model configuration). LoRA adapters
are merged into the weights (default) or, with ``lora="separate"``, the base model is exported
unchanged and the adapters are written beside it in PEFT's layout
(``adapter/adapter_model.safetensors`` + ``adapter_config.json``).

The checkpoint is verified whole before any path its recipe names is opened; one of a format
older than rank-file identities is exported only with ``allow_unverified``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from neox.config import filtered_config
from neox.lora import merge_lora
from neox.model import LayerKind, layer_specs
from neox.run.run_dir import TOKENIZER, TRAINABLE, OutputDirError
from neox.run.trained import RunCheckpoint, checkpoint_tokenizer, open_run, trained_layers
from neox.weights import save_hf
from neox.weights.hf import hf_key
from zerocore.checkpoint import make_dir, write_atomically

__all__ = ["export", "export_trainable", "refuse_output_over_inputs"]


def _take_adapters(state: dict[str, torch.Tensor], kind: LayerKind, index: int | None,
                   adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Moves a layer's LoRA tensors into ``adapters`` under PEFT's names."""
    for name in [k for k in state if ".lora_" in k]:
        module, _, which = name.rpartition(".")
        key = "base_model.model." + hf_key(kind, index, f"{module}.{which}.weight")
        adapters[key] = state.pop(name).float().contiguous()
    return state


def _tokenizer_file(ckpt: RunCheckpoint, given: Path | None, log) -> dict[str, Path]:
    """The run's tokenizer for the export (``given`` wins), or nothing, with a note saying where
    it was looked for."""
    if given is not None:
        return {TOKENIZER: given}
    found, looked = checkpoint_tokenizer(ckpt)
    if found is None:
        log(f"note: the run's tokenizer.json was not found (looked in "
            f"{', '.join(str(p) for p in looked)}); the export has none: pass --tokenizer FILE")
        return {}
    return {TOKENIZER: found}


def refuse_output_over_inputs(out: Path, ckpt: Path, others: dict[str, Path] | None = None
                              ) -> None:
    """Refuses ``out`` when writing it (``--overwrite`` replaces it whole) would delete or
    change what the export reads: it is, or contains, the checkpoint (a run's directory holds
    its checkpoints) or one of ``others`` (the base weights, the tokenizer: ``{what: path}``),
    or it lies inside the checkpoint. ``OutputDirError``; nothing is written."""
    where = out.resolve()
    inputs = {"the checkpoint being exported": ckpt, **(others or {})}
    for what, path in inputs.items():
        path = path.resolve()
        if where == path or where in path.parents:
            raise OutputDirError(
                f"{out} {'is' if where == path else 'contains'} {what} ({path}): writing the "
                f"export there would delete it; choose an output directory outside it (nothing "
                f"was written)")
    if ckpt.resolve() in where.parents:
        raise OutputDirError(f"{out} is inside the checkpoint {ckpt}: writing there would "
                             f"change the checkpoint; choose an output directory outside it "
                             f"(nothing was written)")


def _verified(ckpt: Path, allow_unverified: bool, log) -> RunCheckpoint:
    run = open_run(ckpt, allow_unverified=allow_unverified)
    if run.unverified:
        log(f"note: {ckpt} cannot be verified ({run.unverified}); exporting it as "
            f"--allow-unverified asks")
    return run


def export_trainable(ckpt: Path, out: Path, *, overwrite: bool = False,
                     allow_unverified: bool = False, log=print) -> Path:
    """Only the trained tensors, under the model's own (Hugging Face) names: small, and no base
    weights are read. ``out/trainable.safetensors``."""
    refuse_output_over_inputs(out, ckpt)
    run = _verified(ckpt, allow_unverified, log)
    recipe, config = run.recipe, run.config
    specs = layer_specs(config, recipe.model.filter_layers)
    tensors = {}
    for spec, (_, trained) in zip(specs, run.reader.full_layers(trainable_only=True)):
        tensors.update({hf_key(spec.kind, spec.index, name): t.contiguous()
                        for name, t in trained.items()})
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(out)
    make_dir(out, parents=True)
    return write_atomically(out / TRAINABLE, lambda tmp: save_file(tensors, str(tmp)))


def export(ckpt: Path, out: Path, *, lora: str = "merged", overwrite: bool = False,
           tokenizer: Path | None = None, log=print, allow_unverified: bool = False) -> Path:
    """The checkpoint as a Hugging Face directory ``out`` (see the module docstring). Refuses
    an ``out`` that holds anything the export reads (``refuse_output_over_inputs``)."""
    refuse_output_over_inputs(out, ckpt)
    run = _verified(ckpt, allow_unverified, log)
    recipe, config = run.recipe, run.config
    extra_files = _tokenizer_file(run, tokenizer, log)
    base = {"the base weights": Path(recipe.model.checkpoint)} \
        if recipe.model.checkpoint is not None else {}
    refuse_output_over_inputs(out, ckpt, {**base, **{"the tokenizer": f
                                                     for f in extra_files.values()}})
    mode = recipe.model.finetune
    built = filtered_config(config, recipe.model.filter_layers)
    adapters: dict[str, torch.Tensor] = {}

    def states():
        for spec, state in trained_layers(run, log):
            if lora == "separate":
                yield spec.kind, spec.index, _take_adapters(state, spec.kind, spec.index,
                                                            adapters)
            else:
                yield spec.kind, spec.index, merge_lora(state, mode.lora_scaling)

    save_hf(out, built, states(), overwrite=overwrite, extra_files=extra_files)
    if lora == "separate" and adapters:
        adapter_dir = out / "adapter"
        make_dir(adapter_dir, parents=True)
        write_atomically(adapter_dir / "adapter_model.safetensors",
                         lambda tmp: save_file(adapters, str(tmp)))
        # PEFT matches a target against the end of a module's dotted name, as neox.lora does.
        config = json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": mode.lora_rank,
            "lora_alpha": mode.lora_alpha, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "target_modules": list(mode.lora_targets),
            "base_model_name_or_path": str(out)}, indent=1)
        write_atomically(adapter_dir / "adapter_config.json", lambda tmp: tmp.write_text(config))
    return out
