"""Hugging Face GPT-NeoX directories: reading them one layer at a time, and writing them.

Reading (``HFReader``): ``config.json`` plus one of
``model.safetensors.index.json`` (sharded safetensors), ``model.safetensors``,
``pytorch_model.bin.index.json`` (sharded pickles) or ``pytorch_model.bin``. Safetensors files
are opened with ``safe_open`` and only the requested tensors are read; ``.bin`` files are
loaded with ``torch.load(mmap=True, weights_only=True)``, so only the pages of the tensors
used are read (pre-1.6 non-zip pickles cannot be mapped and are loaded whole).

Reading by range (``shapes``, ``read_range``; ``neox.weights.base``): safetensors through
``get_slice`` (only the rows holding the range are copied out of the mapped file), ``.bin``
through the memory-mapped tensor (only the pages of the range are touched).

Checkpoint names map to layer-local names by a prefix (see ``neox.model``). The readout is
``embed_out.weight`` on disk (``lm_head.weight`` in a transformers-5 ``state_dict()``; both
are accepted). Buffers older transformers versions saved (``attention.bias``,
``attention.masked_bias``, ``attention.rotary_emb.inv_freq``) are skipped.

Writing (``save_hf``): ``config.json``, one safetensors file per layer and the index, streamed
one layer at a time into a temporary directory renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from neox.weights.base import (WeightsError, WeightsReader, contained, flat_range,
                               layer_label, load_state_file)
from neox.config import NeoXConfig
from neox.model import LayerKind, build_layer
from zerocore.checkpoint import writing

__all__ = ["HFReader", "is_hf_directory", "save_hf", "hf_key", "WEIGHT_FILES"]

# In the order transformers prefers them.
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors",
                "pytorch_model.bin.index.json", "pytorch_model.bin")

# Block-local names of buffers old checkpoints carry; the model recomputes them.
_LEGACY_BLOCK_BUFFERS = frozenset({"attention.bias", "attention.masked_bias",
                                   "attention.rotary_emb.inv_freq"})
_LEGACY_MODEL_BUFFERS = frozenset({"rotary_emb.inv_freq"})  # after the gpt_neox. prefix

_BLOCK_KEY = re.compile(r"layers\.(\d+)\.(.+)")

# safetensors' dtype names; anything else is read as a non-float type, which the layer's
# checks then refuse with the tensor's name.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def hf_key(kind: LayerKind, index: int | None, name: str) -> str:
    """The checkpoint name of layer-local tensor ``name``."""
    if kind == "block":
        return f"gpt_neox.layers.{index}.{name}"
    if kind == "readout":
        return name
    return f"gpt_neox.{name}"


def is_hf_directory(path: Path) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory."""
    return (path / "config.json").is_file() or any((path / f).is_file() for f in WEIGHT_FILES)


def _classify(key: str) -> tuple[LayerKind, int | None, str] | None:
    """(kind, block index, local name) of a checkpoint key; None for a legacy buffer; raises
    KeyError for a key that is no GPT-NeoX tensor."""
    if key.startswith(("embed_out.", "lm_head.")):
        return "readout", None, "embed_out." + key.split(".", 1)[1]
    # Checkpoints of the bare GPTNeoXModel have no "gpt_neox." prefix.
    k = key[len("gpt_neox."):] if key.startswith("gpt_neox.") else key
    m = _BLOCK_KEY.fullmatch(k)
    if m:
        local = m.group(2)
        return None if local in _LEGACY_BLOCK_BUFFERS else ("block", int(m.group(1)), local)
    if k.startswith("embed_in."):
        return "embed", None, k
    if k.startswith("final_layer_norm."):
        return "final_norm", None, k
    if k in _LEGACY_MODEL_BUFFERS:
        return None
    raise KeyError(key)


class HFReader(WeightsReader):
    """Reads a Hugging Face GPT-NeoX directory layer by layer (see the module docstring).

    ``config`` overrides ``config.json``. Opening reads the configuration and the list of
    tensor names (the index, or the single file's header); tensors are read by ``read``.
    ``allow_outside``: accept files outside ``path`` -- index entries naming them, or symbolic
    links leading to them (refused by default, except a hub cache snapshot's links into its
    ``blobs``; see ``neox.weights.base.contained``).
    """

    def __init__(self, path: str | Path, *, config: NeoXConfig | None = None,
                 allow_outside: bool = False):
        self.path = Path(path)
        self._allow_outside = allow_outside
        self._bin_cache: tuple[Path, dict[str, torch.Tensor]] | None = None
        self._safe_cache: tuple[Path, Any] | None = None  # the last safetensors file opened
        self.config = config if config is not None else self._read_config()
        self._weights = self._find_weights()  # the index or single weight file
        self._is_safetensors = self._weights.name.startswith("model.safetensors")
        file_of = self._tensor_files()        # checkpoint key -> file name in self.path
        self._file_of = file_of
        # (kind, index) -> {local name: checkpoint key}
        self._layers: dict[tuple[LayerKind, int | None], dict[str, str]] = {}
        n = self.config.num_hidden_layers
        for key, file in file_of.items():
            try:
                where = _classify(key)
            except KeyError:
                raise WeightsError(f"{self.path / file}: unknown tensor '{key}', not part "
                                      f"of a GPT-NeoX model") from None
            if where is None:
                continue
            kind, index, local = where
            if kind == "block" and index >= n:
                raise WeightsError(f"{self.path / file}: tensor '{key}' belongs to block "
                                      f"{index}, but the configuration has {n} blocks "
                                      f"(0..{n - 1})")
            names = self._layers.setdefault((kind, index), {})
            if local in names:
                raise WeightsError(f"{self.path / file}: tensors '{names[local]}' and "
                                      f"'{key}' are both {layer_label(kind, index)} {local}")
            names[local] = key
        if self.config.tie_word_embeddings and ("readout", None) not in self._layers:
            embed = self._layers.get(("embed", None), {})
            if "embed_in.weight" in embed:
                self._layers[("readout", None)] = {"embed_out.weight": embed["embed_in.weight"]}

    # -- opening ----------------------------------------------------------------------------

    def _read_config(self) -> NeoXConfig:
        file = self.path / "config.json"
        if not file.is_file():
            raise WeightsError(f"{file}: missing; a Hugging Face checkpoint directory needs "
                                  f"its config.json (or pass a config)")
        contained(self.path, file.name, what="the configuration",
                  allow_outside=self._allow_outside)
        try:
            return NeoXConfig.from_hf_dict(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise WeightsError(f"{file}: cannot read: {e}") from None
        except ValueError as e:
            raise WeightsError(f"{file}: {e}") from None

    def _find_weights(self) -> Path:
        for name in WEIGHT_FILES:
            if (self.path / name).is_file():
                return contained(self.path, name, what="the weight file",
                                 allow_outside=self._allow_outside)
        raise WeightsError(f"{self.path}: no weights; expected one of "
                              f"{', '.join(WEIGHT_FILES)}")

    def _tensor_files(self) -> dict[str, str]:
        w = self._weights
        if w.name.endswith(".index.json"):
            try:
                weight_map = json.loads(w.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{w}: not a readable weight index ({e!r})") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise WeightsError(f"{w}: weight_map must map tensor names to file names")
            for file in sorted(set(weight_map.values())):
                contained(self.path, file, what=f"{w.name} (weight_map) names",
                          allow_outside=self._allow_outside)
            return dict(weight_map)
        if self._is_safetensors:
            try:
                with safe_open(w, framework="pt") as f:
                    keys = list(f.keys())
            except Exception as e:  # safetensors raises its own error types
                raise WeightsError(f"{w}: not a readable safetensors file ({e})") from None
        else:
            keys = list(self._load_bin(w))
        return {k: w.name for k in keys}

    # -- reading ----------------------------------------------------------------------------

    def _load_bin(self, file: Path) -> dict[str, torch.Tensor]:
        """The state dict of one .bin file, memory-mapped. Only the last file is kept: layers
        are read in order, so each file of a sharded checkpoint is mapped once."""
        if self._bin_cache is not None and self._bin_cache[0] == file:
            return self._bin_cache[1]
        self._bin_cache = None
        state = load_state_file(file)
        self._bin_cache = (file, state)
        return state

    def _file_for(self, key: str) -> Path:
        file = self.path / self._file_of[key]
        if not file.is_file():
            listed = f" (listed in {self._weights.name})" if self._weights.name.endswith(
                ".index.json") else ""
            raise WeightsError(f"{file}: missing file{listed}; it holds tensor '{key}'")
        return file

    def read(self, kind: LayerKind, index: int | None = None) -> dict[str, torch.Tensor]:
        names = self._layers.get((kind, index), {})
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for local, key in names.items():
            by_file.setdefault(self._file_for(key), []).append((local, key))
        out: dict[str, torch.Tensor] = {}
        for file, items in by_file.items():
            if self._is_safetensors:
                try:
                    with safe_open(file, framework="pt") as f:
                        present = set(f.keys())
                        for local, key in items:
                            if key not in present:
                                raise WeightsError(f"{file}: tensor '{key}' is listed in "
                                                      f"{self._weights.name} but not in the file")
                            out[local] = f.get_tensor(key)
                except WeightsError:
                    raise
                except Exception as e:
                    raise WeightsError(f"{file}: cannot read ({e})") from None
            else:
                state = self._load_bin(file)
                for local, key in items:
                    if key not in state:
                        raise WeightsError(f"{file}: tensor '{key}' is listed in "
                                              f"{self._weights.name} but not in the file")
                    out[local] = state[key]
        return out

    # -- reading by range -------------------------------------------------------------------

    def _safe(self, file: Path) -> Any:
        """An open safetensors file (the header parsed once per file, kept while the layers of
        that file are read)."""
        if self._safe_cache is None or self._safe_cache[0] != file:
            self._safe_cache = None
            try:
                self._safe_cache = (file, safe_open(file, framework="pt"))
            except Exception as e:  # safetensors raises its own error types
                raise WeightsError(f"{file}: cannot read ({e})") from None
        return self._safe_cache[1]

    def _located(self, kind: LayerKind, index: int | None) -> list[tuple[str, str, Path]]:
        """(local name, checkpoint key, file) of each tensor of a layer."""
        return [(local, key, self._file_for(key))
                for local, key in self._layers.get((kind, index), {}).items()]

    def shapes(self, kind: LayerKind, index: int | None = None
               ) -> dict[str, tuple[torch.Size, torch.dtype]]:
        out = {}
        for local, key, file in self._located(kind, index):
            if self._is_safetensors:
                f = self._safe(file)
                if key not in f.keys():
                    raise WeightsError(f"{file}: tensor '{key}' is listed in "
                                       f"{self._weights.name} but not in the file")
                sl = f.get_slice(key)
                out[local] = (torch.Size(sl.get_shape()),
                              _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8))
            else:
                t = self._bin_tensor(file, key)
                out[local] = (t.shape, t.dtype)
        return out

    def read_range(self, kind: LayerKind, index: int | None, name: str, start: int,
                   stop: int) -> torch.Tensor:
        key = self._layers[(kind, index)][name]
        file = self._file_for(key)
        if not self._is_safetensors:
            # A view of the mapped file: whoever copies it touches only the range's pages.
            return self._bin_tensor(file, key).reshape(-1)[start:stop]
        sl = self._safe(file).get_slice(key)
        try:
            return flat_range(lambda r0, r1: sl[r0:r1], tuple(sl.get_shape()), start, stop)
        except Exception as e:
            raise WeightsError(f"{file}: cannot read tensor '{key}' ({e})") from None

    def _bin_tensor(self, file: Path, key: str) -> torch.Tensor:
        state = self._load_bin(file)
        if key not in state:
            raise WeightsError(f"{file}: tensor '{key}' is listed in {self._weights.name} but "
                               f"not in the file")
        return state[key]

    def where(self, kind: LayerKind, index: int | None, name: str) -> str:
        key = self._layers.get((kind, index), {}).get(name)
        if key is not None:
            return f"{self.path / self._file_of[key]}: tensor '{key}'"
        return f"{self._weights}: tensor '{hf_key(kind, index, name)}'"

    def close(self) -> None:
        self._bin_cache = None
        self._safe_cache = None


# -- writing ----------------------------------------------------------------------------------

def _layer_order(config: NeoXConfig) -> list[tuple[LayerKind, int | None]]:
    return ([("embed", None)] + [("block", i) for i in range(config.num_hidden_layers)]
            + [("final_norm", None), ("readout", None)])


def save_hf(directory: str | Path, config: NeoXConfig,
            layer_states: Iterable[tuple[LayerKind, int | None, Mapping[str, torch.Tensor]]],
            *, overwrite: bool = False,
            extra_files: Mapping[str, str | Path] | None = None) -> Path:
    """Writes a Hugging Face directory that ``transformers.GPTNeoXForCausalLM.from_pretrained``
    loads: ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` (one per layer) and
    ``model.safetensors.index.json``.

    layer_states: ``(kind, index, tensors)`` for every layer of the model ``config`` describes
        (blocks 0..num_hidden_layers-1), tensors under layer-local names, in any order, on any
        device; consumed one at a time, so a generator that gathers one layer at a time keeps
        memory near one layer. ``neox.weights.iter_layer_states(model)`` produces it.
    overwrite: replace an existing non-empty ``directory`` (otherwise ``FileExistsError``).
    extra_files: ``{name in the export: source file}`` copied alongside (tokenizer.json, ...).

    Tied embeddings are written untied (``embed_out.weight`` stored, ``tie_word_embeddings``
    false): the layers hold separate copies, and fine-tuning may have changed one of them.
    Everything is written into a temporary sibling directory that is renamed to ``directory``
    only once complete, so an interrupted export leaves no partial model. Returns the path.
    """
    directory = Path(directory)
    if directory.exists() and not (directory.is_dir() and not any(directory.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{directory} exists and is not an empty directory; choose "
                                  f"another output path or pass overwrite=True")
    order = _layer_order(config)
    n_files = len(order)
    file_names = {spec: f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
                  for i, spec in enumerate(order)}
    with writing(directory, "create"):
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial",
                                    dir=directory.parent))
    try:
        weight_map: dict[str, str] = {}
        total_size = 0
        dtype: torch.dtype | None = None
        for kind, index, state in layer_states:
            spec = (kind, index)
            label = layer_label(kind, index)
            if spec not in file_names:
                raise ValueError(f"save_hf: unexpected layer {label}; the configuration has "
                                 f"blocks 0..{config.num_hidden_layers - 1}")
            if file_names[spec] in weight_map.values():
                raise ValueError(f"save_hf: {label} was given twice")
            expected = {n: t.shape for n, t in
                        build_layer(kind, config, device="meta").state_dict().items()}
            if set(state) != set(expected):
                raise ValueError(f"save_hf: {label} has tensors {sorted(state)}, expected "
                                 f"{sorted(expected)}")
            tensors = {}
            for name, t in state.items():
                if t.shape != expected[name]:
                    raise ValueError(f"save_hf: {label} tensor '{name}' has shape "
                                     f"{tuple(t.shape)}, expected {tuple(expected[name])}")
                # A private contiguous CPU copy: safetensors refuses tensors that share storage
                # (views of one flat buffer, as a sharding engine produces).
                tensors[hf_key(kind, index, name)] = t.detach().to(
                    device="cpu", memory_format=torch.contiguous_format, copy=True)
            if kind == "embed":
                dtype = tensors["gpt_neox.embed_in.weight"].dtype
            with writing(directory / file_names[spec]):  # safetensors' error: one line
                save_file(tensors, tmp / file_names[spec], metadata={"format": "pt"})
            for key, t in tensors.items():
                weight_map[key] = file_names[spec]
                total_size += t.numel() * t.element_size()
            del tensors, state
        written = set(weight_map.values())
        missing = [layer_label(*s) for s in order if file_names[s] not in written]
        if missing:
            raise ValueError(f"save_hf: no tensors were given for {', '.join(missing)}")

        hf_config = dataclasses.replace(config, tie_word_embeddings=False).to_hf_dict()
        hf_config["dtype"] = str(dtype).removeprefix("torch.")
        with writing(directory / "config.json"):
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True)
                                             + "\n")
        index = {"metadata": {"total_size": total_size},
                 "weight_map": dict(sorted(weight_map.items()))}
        with writing(directory / "model.safetensors.index.json"):
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for name, source in (extra_files or {}).items():
            with writing(directory / name):
                shutil.copyfile(source, tmp / name)

        os.chmod(tmp, 0o755)  # mkdtemp makes it private to the user
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _replace_dir(tmp: Path, directory: Path) -> None:
    """``tmp`` becomes ``directory`` (an earlier one is removed only once replaced)."""
    with writing(directory, f"rename {tmp} to"):
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".old",
                                        dir=directory.parent))
            os.replace(directory, old / "x")
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
