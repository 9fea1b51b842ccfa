"""Pretrained weights, read one layer at a time whatever their format: the reader interface,
its error, and turning a reader into materialised layers.

A format is a ``WeightsReader``: it knows the model's ``config`` and returns the tensors of one
layer on request, reading only that layer's bytes. ``iter_layers`` turns a reader into
materialised layers one by one (built on the meta device, filled from ``read``, cast, prepared),
so a consumer that keeps only its shard of each layer holds about one full layer in memory.

Writing a new reader: subclass ``WeightsReader``, set ``self.config`` and ``self.path``,
implement ``read`` (and ``where`` for better messages, ``close`` if files stay open). ``read``
returns the layer's tensors under the layer's local parameter names (the names of
``neox.model.build_layer(kind, config).state_dict()``, e.g. ``"attention.dense.bias"`` for a
block, ``"embed_in.weight"`` for the embedding), on any device and in any floating dtype;
``iter_layers`` checks names and shapes against the model and reports problems through
``where``, so a reader only raises ``WeightsError`` for what it alone can see (a missing or
unreadable file).

Reading by range (rank-local loading): a reader that can return any element range of a tensor
without reading the rest also implements ``shapes`` (names, shapes and dtypes of a layer, read
from headers) and ``read_range``. ``meta_layer`` then builds the checked layer on the meta
device, and a sharding engine reads only the ranges its rank keeps (``zerocore.MetaLayer``):
host memory and I/O per rank fall with the number of ranks.
"""

from __future__ import annotations

import abc
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from neox.config import NeoXConfig
from neox.model import LayerKind, LayerSpec, build_layer, layer_specs
from zerocore.checkpoint import weights_only_failure

__all__ = ["WeightsError", "WeightsReader", "load_state_file", "layer_label", "contained",
           "materialize", "iter_layers", "iter_layer_states", "meta_layer", "flat_range"]


class WeightsError(ValueError):
    """A checkpoint is missing, unreadable or does not match the model. The message names the
    file and, where one is at fault, the tensor."""


def load_state_file(path: Path) -> dict[str, Any]:
    """A ``torch.save``d dict of tensors, memory-mapped so only what is used is read (a pre-zip
    pickle cannot be mapped and is read whole). ``WeightsError`` names the file on failure."""
    try:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling raises many types
        raise WeightsError(f"{path}: {_load_failure(e)}") from None
    if not isinstance(state, dict):
        raise WeightsError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


def _load_failure(e: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line (zerocore's words, with what to
    do instead for weights)."""
    reason = weights_only_failure(e)
    if reason.startswith("refused"):
        return (f"{reason}; neox loads tensors only: use the model's safetensors files, or a "
                f"copy of the weights you trust")
    return f"cannot load ({' '.join(reason.split())})"


def _inside_roots(root: Path) -> list[Path]:
    """The resolved folders a file of the weights directory ``root`` may resolve into: ``root``
    itself and, for a Hugging Face hub cache snapshot (``models--org--name/snapshots/<rev>``),
    the download's ``blobs`` folder. huggingface_hub itself writes every file of a snapshot as
    a symbolic link to ``../../blobs/<hash>``, so that layout is one self-contained download,
    and refusing it would refuse every model loaded from the cache."""
    base = root.resolve()
    roots = [base]
    if base.parent.name == "snapshots" and base.parent.parent.name.startswith("models--"):
        roots.append(base.parent.parent / "blobs")
    return roots


def contained(root: Path, name: str, *, what: str, allow_outside: bool) -> Path:
    """``root / name``, refused with a ``WeightsError`` when it resolves outside ``root`` (an
    absolute name, ``..``, or a symbolic link leading out) unless ``allow_outside``: a weights
    directory that names files elsewhere is not self-contained, and following such names
    silently could read files the user never pointed at. ``what`` says who names the file,
    for the message ("its 'latest' file names", "the weight file")."""
    target = root / name
    if not allow_outside:
        resolved = target.resolve()
        if not any(resolved == r or r in resolved.parents for r in _inside_roots(root)):
            raise WeightsError(f"{root}: {what} {name!r}, which leads outside the weights "
                               f"directory (to {resolved}); copy the file into it, or allow "
                               f"files outside explicitly (allow_outside=True, "
                               f"--allow-outside-weights)")
    return target


def layer_label(kind: LayerKind, index: int | None) -> str:
    """``"block 3"``, ``"embed"``, ...: how messages name a layer."""
    return f"block {index}" if kind == "block" else kind


class WeightsReader(abc.ABC):
    """Reads one layer of a GPT-NeoX checkpoint at a time. Usable as a context manager.

    Attributes every reader sets:
        config: the model's configuration (``num_hidden_layers`` = blocks in the checkpoint).
        path:   the checkpoint's location, for messages.
    """

    config: NeoXConfig
    path: Path

    @abc.abstractmethod
    def read(self, kind: LayerKind, index: int | None = None) -> dict[str, torch.Tensor]:
        """The tensors of one layer, under its local parameter names (see the module
        docstring). ``index`` is the block's index in the checkpoint (0-based) for
        ``kind="block"`` and None otherwise. Reads only this layer's bytes. Legacy buffers the
        model does not use are left out. Raises ``WeightsError`` for missing/unreadable
        files."""

    def where(self, kind: LayerKind, index: int | None, name: str) -> str:
        """Where tensor ``name`` (local name) of a layer lives, for error messages: a file and
        the tensor's name in it. Override to be precise; the default names the checkpoint."""
        return f"{self.path}: {layer_label(kind, index)} tensor '{name}'"

    def shapes(self, kind: LayerKind, index: int | None = None
               ) -> dict[str, tuple[torch.Size, torch.dtype]] | None:
        """``{local name: (shape, dtype)}`` of one layer's tensors, read without their values,
        when this reader can read element ranges (``read_range``); None (this default) when it
        can only read whole layers."""
        return None

    def read_range(self, kind: LayerKind, index: int | None, name: str, start: int,
                   stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` of a layer, flattened row-major
        (1-D, its stored dtype), reading little more than those elements. Only for readers
        whose ``shapes`` is not None."""
        raise NotImplementedError(f"{type(self).__name__} reads whole layers only")

    def close(self) -> None:
        """Releases open files. Reading again after closing may reopen them."""

    def __enter__(self) -> "WeightsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _expected_tensors(layer: nn.Module) -> dict[str, tuple[torch.Size, bool]]:
    return {n: (t.shape, t.is_floating_point()) for n, t in layer.state_dict().items()}


def _check_tensors(reader: WeightsReader, spec: LayerSpec, layer: nn.Module,
                   tensors: dict[str, torch.Tensor]) -> None:
    expected = _expected_tensors(layer)
    where = lambda name: reader.where(spec.kind, spec.source, name)  # noqa: E731
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise WeightsError(f"{where(missing[0])}: missing from the checkpoint"
                              + (f" (and {len(missing) - 1} more tensors of "
                                 f"{layer_label(spec.kind, spec.source)})" if len(missing) > 1
                                 else ""))
    unknown = sorted(n for n in tensors if n not in expected)
    if unknown:
        raise WeightsError(f"{where(unknown[0])}: unknown tensor, not part of a GPT-NeoX "
                              f"{spec.kind} with this configuration (expected "
                              f"{sorted(expected)})")
    for name, (shape, _) in expected.items():
        t = tensors[name]
        if t.shape != shape:
            raise WeightsError(f"{where(name)}: shape {tuple(t.shape)} does not match the "
                                  f"configuration, which needs {tuple(shape)}")
        if not t.is_floating_point():
            raise WeightsError(f"{where(name)}: dtype {t.dtype} is not a floating type")


def materialize(reader: WeightsReader, spec: LayerSpec, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> nn.Module:
    """One layer, built on the meta device and filled from ``reader`` (checked, then cast to
    ``dtype`` -- None keeps the stored dtype -- and moved to ``device``, default CPU)."""
    layer = build_layer(spec.kind, reader.config, device="meta")
    tensors = reader.read(spec.kind, spec.source)
    _check_tensors(reader, spec, layer, tensors)
    device = torch.device(device) if device is not None else torch.device("cpu")
    state = {n: t.to(device=device, dtype=dtype or t.dtype) for n, t in tensors.items()}
    del tensors
    layer.load_state_dict(state, strict=True, assign=True)
    return layer


def meta_layer(reader: WeightsReader, spec: LayerSpec) -> nn.Module | None:
    """One layer on the meta device, its parameters in the stored dtypes, names and shapes
    checked as ``materialize`` checks them, nothing read but headers; None when ``reader``
    cannot read by range. Its values are ``reader.read_range(spec.kind, spec.source, ...)``."""
    found = reader.shapes(spec.kind, spec.source)
    if found is None:
        return None
    layer = build_layer(spec.kind, reader.config, device="meta")
    tensors = {n: torch.empty(shape, dtype=dtype, device="meta")
               for n, (shape, dtype) in found.items()}
    _check_tensors(reader, spec, layer, tensors)
    layer.load_state_dict(tensors, strict=True, assign=True)
    return layer


def flat_range(rows: Callable[[int, int], torch.Tensor], shape: tuple[int, ...], start: int,
               stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` from a function giving its
    rows ``[r0, r1)`` (along dim 0): the rows that hold the range, cut to it. Reads at most a
    row on either side beyond the range."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    r0, r1 = start // row, -(-stop // row)
    return rows(r0, r1).reshape(-1)[start - r0 * row: stop - r0 * row]


def iter_layers(reader: WeightsReader, *, filter_layers: Iterable[int] | None = None,
                dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                prepare: Callable[[nn.Module], None] | None = None) -> Iterator[nn.Module]:
    """Yields the kept layers in order -- embedding, the ``filter_layers`` blocks (0-based
    checkpoint indices, all when None), final norm, readout -- each materialised from
    ``reader`` only when asked for. ``prepare(layer)`` runs on each before it is yielded (to set
    ``requires_grad``, add adapters, ...). ``neox.model.layer_specs(reader.config,
    filter_layers)`` lists the same layers without reading anything."""
    for spec in layer_specs(reader.config, filter_layers):
        layer = materialize(reader, spec, dtype=dtype, device=device)
        if prepare is not None:
            prepare(layer)
        yield layer
        del layer  # before the next one is read: one layer in memory at a time


def iter_layer_states(layers: Iterable[nn.Module],
                      ) -> Iterator[tuple[LayerKind, int | None, dict[str, torch.Tensor]]]:
    """``(kind, index, state_dict)`` for each layer of a stack (a ``NeoXModel`` or a list of
    ``neox.model`` layers), blocks numbered 0.. in stack order: the input ``save_hf`` takes."""
    block = 0
    for layer in layers:
        kind = getattr(layer, "kind", None)
        if kind is None:
            raise ValueError(f"{type(layer).__name__} is not a neox.model layer (no .kind)")
        index = None
        if kind == "block":
            index, block = block, block + 1
        yield kind, index, layer.state_dict()
