"""``from_pretrained``: a pretrained Hugging Face model, sharded as it loads, never whole on any
rank.

    from zerocore.hf_pretrained import from_pretrained
    model = from_pretrained(AutoModelForCausalLM, "path/to/model", dtype=torch.bfloat16,
                            peft_config=LoraConfig(...), offload=zerocore.Offload(...))

``transformers``' ``from_pretrained`` builds the whole model in every rank's memory; sharding
afterwards keeps 1/N of it, but the peak was N copies per node. Here the model is built on the
meta device from its config, and ``zerocore.shard_model(read=...)`` asks for each rank's
elements of each parameter, read by offset from the safetensors files (``SafetensorsFiles``)
in pieces of at most ``READ_PIECE_NUMEL`` elements into one buffer: each rank's peak is its
share of the model plus that buffer (``zerocore.plan`` states it: ``MemoryPlan.loading``).

What ``transformers.PreTrainedModel.from_pretrained`` does besides reading, done the same way:
the requested ``dtype`` (stored values converted, as it converts them); parameters tied to
another (``tie_word_embeddings``) read once; non-persistent buffers (rotary ``inv_freq``) and
parameters the checkpoint lacks initialised by the model's own ``initialize_weights`` (what
``from_pretrained`` calls for them; lacking parameters reported as it reports them, with the
same seed on every rank so that the ranks agree); checkpoint keys the model does not have
reported unless the model ignores them; checkpoint keys renamed by transformers' own rules
for the model (legacy names; ``base_model_prefix`` added or removed).
PEFT: ``peft_config`` is applied to the meta model; the adapters are created on the CPU and
initialised by PEFT under ``seed`` (the same on every rank); ``modules_to_save`` copies are read
from the checkpoint like the modules they copy.

Every check of the files and of the model against them runs before anything is allocated, and
its outcome is agreed across the ranks (``zerocore.run_agreed``): a bad directory is one line
on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig
from transformers.utils import logging
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, rename_source_key

import zerocore
from zerocore.checkpoint.safetensors_ranges import SafetensorsError, SafetensorsFiles
from zerocore.hf_trainer import default_units

__all__ = ["from_pretrained", "pretrained_on_meta", "Pretrained", "PretrainedError",
           "SafetensorsFiles"]

# transformers' logger for this module: its report of missing and unexpected keys is a warning
# there too.
logger = logging.get_logger(__name__)
# Checkpoint dtypes a parameter may be stored in (converted to the model's dtype as it is read).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The parts of a PEFT model's parameter names that are not in the base model's checkpoint:
# its wrapper, a LoRA layer's wrapped layer, a modules_to_save copy and the original it keeps.
_PEFT_PARTS = re.compile(r"(^base_model\.model\.)|(\.base_layer(?=\.))|(\.original_module(?=\.))"
                         r"|(\.modules_to_save\.[^.]+(?=\.))")


class PretrainedError(ValueError):
    """A pretrained directory that does not fit the model: one line saying what to do."""


@dataclasses.dataclass
class Pretrained:
    """A model on the meta device (buffers and unread parameters materialised on the CPU) and
    its reader, for ``zerocore.shard_model(model, units, read=pretrained.read)`` or
    ``ShardedTrainer(model, shard_options=dict(read=pretrained.read))``.

    keys: each parameter to read (the model's names) and its checkpoint key.
    missing: parameters the checkpoint lacks, initialised as ``from_pretrained`` does.
    unexpected: checkpoint keys the model does not use (and does not declare ignored).
    """
    model: nn.Module
    files: SafetensorsFiles
    keys: dict[str, str]
    missing: list[str]
    unexpected: list[str]

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``shard_model``'s ``read``: elements ``[start, stop)`` of parameter ``name``, read
        from the files by offset and converted to the parameter's dtype.

        The bytes are read into one buffer this reader keeps (as large as the largest piece
        asked for: ``READ_PIECE_NUMEL`` elements at most, from the engine), so the piece is
        valid until the next read, as the engine uses it (each piece packed before the next
        is read); ``close`` lets the buffer go. A buffer per read, freed after it, costs more
        than its size: once glibc's dynamic mmap threshold has risen, freed blocks of a few
        MiB stay in its heap (up to 200 MiB per rank at 1 B parameters,
        bench/records/2026-12-06-memory-hf-load-1b.md)."""
        key = self.keys[name]
        nbytes = (stop - start) * self.files.entries[key].dtype.itemsize
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        piece = self.files.read(key, start, stop, out=self._buffer)
        return piece.to(self._dtypes[name])

    def __post_init__(self) -> None:
        self._dtypes = {n: p.dtype for n, p in self.model.named_parameters(
            remove_duplicate=False) if n in self.keys}
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        self.files.close()
        self._buffer = torch.empty(0, dtype=torch.uint8)


def checkpoint_name(name: str) -> str:
    """The base model's name of a (PEFT model's) parameter or buffer."""
    return _PEFT_PARTS.sub("", name)


def default_dtype(config: Any, files: SafetensorsFiles) -> torch.dtype:
    """``from_pretrained``'s dtype when none is asked for ("auto" since transformers 5): the
    config's ``dtype``, else the first floating-point tensor's stored dtype, else float32."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    stored = [e.dtype for e in files.entries.values() if e.dtype.is_floating_point]
    return stored[0] if stored else torch.float32


def _build_meta(model_class: Any, config: Any, dtype: torch.dtype,
                model_kwargs: dict[str, Any]) -> nn.Module:
    """The model from its config on the meta device, in ``dtype``, its weights tied as its
    config says."""
    kwargs = dict(model_kwargs, dtype=dtype)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with torch.device("meta"):
        return build(config, **kwargs)


def _match_keys(model: nn.Module, state: dict[str, torch.Tensor], files: SafetensorsFiles
                ) -> dict[str, str]:
    """Each model name (of ``state``) the checkpoint holds, with its key: the key renamed as
    ``from_pretrained`` renames it (the model's legacy names, e.g. GPT-NeoX's ``embed_out``;
    ``base_model_prefix`` removed or added), by transformers' own rules for the model. A key
    that transformers converts (merges or splits into other tensors) is refused: its stored
    layout is not the parameter's, so it cannot be read by range."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out = {}
    for key in files.entries:
        name, converted = rename_source_key(key, renamings, converters,
                                            getattr(model, "base_model_prefix", None), state)
        if converted is not None:
            raise PretrainedError(f"{files.path}: tensor {key!r} is converted by transformers "
                                  f"as it loads ({converted!r}); zerocore reads tensors as "
                                  f"stored: convert the checkpoint once (from_pretrained, then "
                                  f"save_pretrained) and load that")
        if name in state:
            out[name] = key
    return out


def _ignored(patterns: Iterable[str] | None, key: str) -> bool:
    return any(re.search(p, key) for p in patterns or ())


def _check(model: nn.Module, files: SafetensorsFiles) -> tuple[dict[str, str], list[str],
                                                                list[str]]:
    """The model's parameters and persistent buffers matched to the checkpoint, shapes and
    dtypes checked: (name -> key, missing names, unexpected keys). Raises PretrainedError."""
    state = model.state_dict(keep_vars=True)  # persistent entries, tied ones under each name
    matched = _match_keys(model, state, files)
    for name, key in matched.items():
        entry, want = files.entries[key], state[name]
        if entry.shape != tuple(want.shape):
            raise PretrainedError(
                f"{files.path}: tensor {key!r} has shape {list(entry.shape)}, the model built "
                f"from config.json expects {list(want.shape)} for {name}; the config and the "
                f"weights are of different models")
        if want.is_floating_point() and entry.dtype not in FLOAT_DTYPES:
            raise PretrainedError(f"{files.path}: tensor {key!r} is stored as {entry.dtype}; "
                                  f"{name} needs float32, bfloat16 or float16 values")
    used = set(matched.values())
    # A tied entry (the head of tie_word_embeddings) is the tensor of one the checkpoint has:
    # read under that key (a PEFT modules_to_save copy of it is too).
    for name, tensor in state.items():
        partner = next((m for m in list(matched) if state[m] is tensor), None)
        if name not in matched and partner is not None:
            matched[name] = matched[partner]
    missing = [n for n in state if n not in matched
               and not _ignored(getattr(model, "_keys_to_ignore_on_load_missing", None), n)]
    # Old checkpoints hold rotary tables per layer that models now compute (transformers drops
    # them from the report too).
    legacy = r"rotary_emb\.inv_freq" if any(
        n.endswith("rotary_emb.inv_freq") for n, _ in model.named_buffers()) else None
    ignore = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    ignore += [legacy] if legacy else []
    unexpected = [k for k in files.entries if k not in used and not _ignored(ignore, k)]
    return matched, missing, unexpected


def _materialise(module: nn.Module, attr: str, kind: str) -> None:
    """Replaces a meta parameter or buffer by an uninitialised CPU tensor of its shape and
    dtype (``from_pretrained`` does the same before initialising it)."""
    table = module._parameters if kind == "param" else module._buffers
    old = table[attr]
    new = torch.empty_like(old, device="cpu")
    table[attr] = nn.Parameter(new, requires_grad=old.requires_grad) if kind == "param" else new


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _initialise_unread(model: nn.Module, matched: dict[str, str], missing: list[str],
                       seed: int) -> None:
    """Persistent buffers read whole (they are small and every rank keeps them), the
    non-persistent ones and the missing entries initialised by the model's
    ``initialize_weights`` as ``from_pretrained`` initialises them: everything read is marked
    initialised so that it is skipped; the random draws for missing parameters come from
    ``seed``, the same on every rank."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffer_names = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for name in missing:
        module, attr = _owner(model, name)
        _materialise(module, attr, "param" if name in params else "buffer")
    for name in buffer_names:
        module, attr = _owner(model, name)
        if module._buffers[attr] is not None and module._buffers[attr].is_meta:
            _materialise(module, attr, "buffer")
    for name in matched:
        tensor = model.get_parameter(name) if name in params else model.get_buffer(name)
        tensor._is_hf_initialized = True  # the flag from_pretrained sets on what it loaded
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.initialize_weights()


def _read_buffers(model: nn.Module, matched: dict[str, str], files: SafetensorsFiles) -> None:
    """The persistent buffers the checkpoint holds, whole, in the buffer's dtype."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, key in matched.items():
        if name in params:
            continue
        buf = model.get_buffer(name)
        value = files.read(key, 0, files.entries[key].numel).reshape(buf.shape).to(buf.dtype)
        value._is_hf_initialized = True
        module, attr = _owner(model, name)
        module._buffers[attr] = value


def _peft_adapters(model: nn.Module, peft_config: Any, seed: int) -> nn.Module:
    """``get_peft_model`` on the meta model, then each LoRA layer's adapters created on the CPU
    and initialised by PEFT (``reset_lora_parameters``) under ``seed``, in module order: the
    same values on every rank."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, peft_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in peft_model.modules():
            if not hasattr(module, "reset_lora_parameters"):
                continue
            for adapter in list(getattr(module, "lora_A", {})):
                for part in ("lora_A", "lora_B"):
                    getattr(module, part)[adapter].to_empty(device="cpu")
                module.reset_lora_parameters(adapter, peft_config.init_lora_weights)
    return peft_model


def pretrained_on_meta(model_class: Any, path: str | os.PathLike, *,
                       dtype: torch.dtype | None = None, peft_config: Any = None, seed: int = 0,
                       allow_outside: bool = False, group: dist.ProcessGroup | None = None,
                       **model_kwargs: Any) -> Pretrained:
    """A collective: the model of the Hugging Face directory ``path`` on the meta device, ready
    for ``shard_model(read=...)`` (see the module docstring), and its reader. Every rank of
    ``group`` (default: the world, when initialised) must call it; a problem found on any rank
    is raised on every rank before any weight is allocated.

    model_class: ``AutoModelForCausalLM`` or a model class (``LlamaForCausalLM``).
    dtype: the parameters' dtype (stored values are converted); None: ``from_pretrained``'s
        ("auto": the config's, else the stored one).
    peft_config: a PEFT config (``LoraConfig``) applied to the model before it is sharded.
    seed: the random draws of what is not read (adapters, missing parameters).
    allow_outside: follow index entries and symbolic links that leave ``path``.
    model_kwargs: for the model's construction (``attn_implementation="eager"``, say).
    """
    def prepare() -> tuple[nn.Module, SafetensorsFiles, dict[str, str], list[str], list[str]]:
        files = SafetensorsFiles(path, allow_outside=allow_outside)
        if not (files.path / "config.json").is_file():
            raise PretrainedError(f"{files.path}: no config.json; save the model with "
                                  f"save_pretrained, which writes it")
        config = AutoConfig.from_pretrained(str(files.path))
        model = _build_meta(model_class, config, dtype or default_dtype(config, files),
                            model_kwargs)
        matched, missing, unexpected = _check(model, files)
        return model, files, matched, missing, unexpected

    distributed = dist.is_available() and dist.is_initialized()
    run = (lambda fn: zerocore.run_agreed(fn, group=group)) if distributed else (
        lambda fn: fn())
    try:
        model, files, matched, missing, unexpected = run(prepare)
    except SafetensorsError as e:
        raise PretrainedError(str(e)) from None
    if missing:
        # from_pretrained's report: what it initialised rather than loaded.
        logger.warning(f"zerocore.from_pretrained: {type(model).__name__}: {len(missing)} "
                       f"weight(s) not in the checkpoint, newly initialised: "
                       f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        logger.warning(f"zerocore.from_pretrained: {type(model).__name__}: {len(unexpected)} "
                       f"checkpoint key(s) not used: {', '.join(unexpected[:8])}"
                       f"{' ...' if len(unexpected) > 8 else ''}")
    _read_buffers(model, matched, files)
    _initialise_unread(model, matched, missing, seed)
    model.eval()  # as from_pretrained returns it (dropout off until training starts)
    if peft_config is not None:
        model = _peft_adapters(model, peft_config, seed)
    keys, unread = {}, []
    by_tensor: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    for name, p in named:  # tied parameters: each name reads the one key any of them has
        key = matched.get(checkpoint_name(name))
        if key is not None:
            by_tensor.setdefault(id(p), key)
    for name, p in named:
        if p.is_meta:
            if id(p) in by_tensor:
                keys[name] = by_tensor[id(p)]
            else:
                unread.append(name)
    if unread:
        raise PretrainedError(f"zerocore.from_pretrained: parameters {unread[:3]} are neither "
                              f"in the checkpoint nor initialised (created on the meta device "
                              f"by something other than the model or PEFT's LoRA)")
    return Pretrained(model, files, keys, missing, unexpected)


def from_pretrained(model_class: Any, path: str | os.PathLike,
                    units: Iterable[nn.Module] | nn.Module | None = None, *,
                    dtype: torch.dtype | None = None, peft_config: Any = None, seed: int = 0,
                    allow_outside: bool = False, model_kwargs: dict[str, Any] | None = None,
                    **shard_options: Any) -> nn.Module:
    """A collective: ``model_class.from_pretrained(path)`` sharded by ``zerocore.shard_model``
    as it loads, each rank reading only its shards' bytes. Returns the model (its
    ``zerocore_sharding`` the ``ShardedModel``); with ``peft_config``, the PEFT model.

    units: as ``shard_model`` takes them; default the modules ``_no_split_modules`` names (the
        decoder layers). dtype, peft_config, seed, allow_outside: ``pretrained_on_meta``'s.
    model_kwargs: for the model's construction. shard_options: ``shard_model``'s keywords.
    """
    pretrained = pretrained_on_meta(model_class, path, dtype=dtype, peft_config=peft_config,
                                    seed=seed, allow_outside=allow_outside,
                                    group=shard_options.get("group"), **(model_kwargs or {}))
    model = pretrained.model
    with contextlib.closing(pretrained):
        zerocore.shard_model(model, default_units(model) if units is None else units,
                             read=pretrained.read, **shard_options)
    return model
