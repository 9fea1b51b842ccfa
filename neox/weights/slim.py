"""EleutherAI GPT-NeoX "slim weights" (the GPT-NeoX-20B release): read one layer at a time,
merging the tensor-parallel partitions into the single-device layout of ``neox.model``.

The format is a DeepSpeed pipeline checkpoint without optimizer state: one file per pipeline
layer and tensor-parallel rank, ``layer_XX-model_YY-model_states.pt`` (YY the rank), each a
``torch.save``d dict of that layer's tensors on that rank under Megatron names. For a model of
L transformer blocks the pipeline layers are

    XX = 0          embedding           word_embeddings.weight  (vocabulary rows split by rank)
    XX = 1          parameter-free stage, no file (ignored if present)
    XX = 2 .. L+1   block XX-2          input_layernorm.*, attention.*, post_attention_layernorm.*,
                                        mlp.*  (the same names as Hugging Face's, per block;
                                        NeoX since 2024-09 names the MLP mlp.linear1 / linear2)
    XX = L+2        parameter-free stage, no file (ignored if present)
    XX = L+3        final layer norm    norm.weight, norm.bias
    XX = L+4        output projection   final_linear.weight (no file when tied to the embedding)

GPT-NeoX-20B: L = 44, so files 00, 02..45, 47, 48 for ranks 00 and 01.

How each tensor is merged (``BLOCK_RULES``):

- Column-parallel linears (``attention.query_key_value``, ``mlp.dense_h_to_4h`` alias
  ``mlp.linear1``, weight and bias), the vocabulary-parallel embedding and the column-parallel
  output layer: rank p holds rows ``[p*n/tp, (p+1)*n/tp)`` of the output dimension, so the ranks
  are concatenated on dim 0.
  The qkv rows of one rank are laid out per head as [q | k | v] (NeoX views the rank's output
  as ``(heads on the rank, 3 * head size)`` and splits the last axis), which is Hugging Face's
  ``query_key_value`` layout for those heads; concatenating the ranks gives Hugging Face's
  layout for heads [rank 0's, rank 1's, ...], and the attention output weight's input columns
  are concatenated in the same rank order, so every head keeps its own output columns.
- Row-parallel weights (``attention.dense``, ``mlp.dense_4h_to_h`` alias ``mlp.linear2``):
  rank p holds a slice of the input columns; concatenated on dim 1.
- Row-parallel biases (``attention.dense.bias``, ``mlp.dense_4h_to_h.bias``): every rank holds
  a full-size copy. Which single bias the merged model adds depends on where NeoX adds them;
  see ``row_parallel_bias_merge``: summed over ranks with the parallel ("GPT-J") residual, as
  GPT-NeoX-20B was trained, one copy (the mean of identical copies) with the sequential one.
- Layer norms (replicated): averaged over ranks, as EleutherAI's own 20B merge script does
  (the copies receive identical gradients, so they agree; averaging keeps them unchanged and
  does not depend on which rank is chosen). Copies that are not bitwise equal are averaged
  too, with a ``PartitionsDifferWarning`` naming the file, the tensor and the largest
  difference; so are the row-parallel bias copies when they are merged by "mean".
- ``attention.rotary_emb.inv_freq``: a buffer recomputed from the configuration; skipped.

Reading by range (``shapes``, ``read_range``): a merged row of a column-parallel tensor lives
in one partition, and a row of a row-parallel weight is the same row of every partition side by
side, so a range of the merged tensor is read from the memory-mapped partitions' rows alone.

Configuration: a NeoX YAML (``20B.yml``: ``num-layers``, ``hidden-size``, ... with ``-`` and
``_`` interchangeable, JSON-ish with comments) found next to the weights, in ``configs/``
there, or in ``../configs/`` (the release puts the layer files in ``global_step150000/`` and
the YAML in ``configs/``). Several YAML files in that folder are merged, as NeoX merges its
config files. The vocabulary size is read from the embedding files (NeoX pads it, so the YAML
alone does not give it), and the MLP width from the shapes of the first readable block (NeoX
rounds it up, and some versions rounded it to a multiple of 512 whatever the YAML said; a
width the YAML does state is checked against it, see ``neox_yaml._mlp_width``). A gated MLP
(``linear1`` twice as wide as ``linear2``'s input: NeoX's swiglu, geglu, ...) is refused.
With no YAML the ``gpt-neox-20b`` preset is used, and the reader's ``description`` says so.
``config=`` overrides either.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import torch

from neox.config import PRESETS, NeoXConfig
from neox.model import LayerKind
from neox.weights.base import (WeightsError, WeightsReader, contained, flat_range,
                               layer_label, load_state_file)
from neox.weights.neox_yaml import config_from_neox_yaml, normalize_keys, read_neox_yaml

__all__ = ["SlimReader", "open_slim", "is_slim_directory", "find_slim_directory",
           "slim_file_name", "pipeline_layer", "row_parallel_bias_merge", "MergeRule",
           "BLOCK_RULES", "SLIM_PRESET", "PartitionsDifferWarning"]

SLIM_PRESET = "gpt-neox-20b"
_FILE_RE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")



class MergeRule(enum.Enum):
    """How the tensor-parallel partitions of one tensor become the single-device tensor."""

    CAT_OUT = "concatenate on dim 0 (column-parallel)"
    CAT_IN = "concatenate on dim 1 (row-parallel)"
    ROW_BIAS = "row-parallel bias (summed or one copy)"
    REPLICATED = "replicated (averaged, after checking the copies agree)"


CAT_OUT, CAT_IN = MergeRule.CAT_OUT, MergeRule.CAT_IN
ROW_BIAS, REPLICATED = MergeRule.ROW_BIAS, MergeRule.REPLICATED

# Merge rules, by Megatron name.

BLOCK_RULES: dict[str, MergeRule] = {
    "input_layernorm.weight": REPLICATED,
    "input_layernorm.bias": REPLICATED,
    "post_attention_layernorm.weight": REPLICATED,
    "post_attention_layernorm.bias": REPLICATED,
    "attention.query_key_value.weight": CAT_OUT,
    "attention.query_key_value.bias": CAT_OUT,
    "attention.dense.weight": CAT_IN,
    "attention.dense.bias": ROW_BIAS,
    "mlp.dense_h_to_4h.weight": CAT_OUT,
    "mlp.dense_h_to_4h.bias": CAT_OUT,
    "mlp.dense_4h_to_h.weight": CAT_IN,
    "mlp.dense_4h_to_h.bias": ROW_BIAS,
    # The same MLP under the names NeoX uses since 2024-09-07 (EleutherAI/gpt-neox commit
    # 0d4bdb96, megatron/model/transformer.py ParallelMLP: linear1 a ColumnParallelLinear,
    # linear2 a RowParallelLinear, built and added exactly as dense_h_to_4h/dense_4h_to_h were).
    "mlp.linear1.weight": CAT_OUT,
    "mlp.linear1.bias": CAT_OUT,
    "mlp.linear2.weight": CAT_IN,
    "mlp.linear2.bias": ROW_BIAS,
}
# Megatron name -> layer-local name where they differ.
_RENAMES: dict[LayerKind, dict[str, str]] = {
    "block": {"mlp.linear1.weight": "mlp.dense_h_to_4h.weight",
              "mlp.linear1.bias": "mlp.dense_h_to_4h.bias",
              "mlp.linear2.weight": "mlp.dense_4h_to_h.weight",
              "mlp.linear2.bias": "mlp.dense_4h_to_h.bias"},
    "embed": {"word_embeddings.weight": "embed_in.weight"},
    "final_norm": {"norm.weight": "final_layer_norm.weight",
                   "norm.bias": "final_layer_norm.bias"},
    "readout": {"final_linear.weight": "embed_out.weight"},
}
_IGNORED = frozenset({"attention.rotary_emb.inv_freq"})
# The MLP's input and output projection weights under either name, newer first.
_MLP_UP = ("mlp.linear1.weight", "mlp.dense_h_to_4h.weight")
_MLP_DOWN = ("mlp.linear2.weight", "mlp.dense_4h_to_h.weight")


class PartitionsDifferWarning(UserWarning):
    """Copies of a replicated tensor differ between tensor-parallel partitions (they are
    averaged anyway)."""

RowBiasMerge = Literal["sum", "mean"]


def row_parallel_bias_merge(use_parallel_residual: bool) -> RowBiasMerge:
    """How the ranks' copies of a row-parallel bias combine into the one bias the merged
    model adds once.

    With the parallel ("GPT-J") residual (``gpt-j-residual: true``, GPT-NeoX-20B and Pythia),
    NeoX builds ``attention.dense`` and ``mlp.dense_4h_to_h`` with ``parallel_output=True``: no
    all-reduce inside the linear. Each rank adds its own bias copy to its *partial* output,
    and only then are the ranks' ``attn + mlp`` sums all-reduced, so the bias reaching the
    residual stream is the sum of the copies: "sum". (This is what EleutherAI's merge20b.py,
    their convert_neox_to_hf.py and labml's 20B loader do; in the 20B files each copy is about
    half of the effective bias.) With the sequential residual the linear all-reduces first and
    every rank adds its (identical) copy to the same full output, so the bias is one copy:
    "mean" (of equal copies; a mean rather than rank 0's so the result does not depend on a
    rank choice)."""
    return "sum" if use_parallel_residual else "mean"


def slim_file_name(layer: int, rank: int) -> str:
    return f"layer_{layer:02d}-model_{rank:02d}-model_states.pt"


def pipeline_layer(kind: LayerKind, index: int | None, num_blocks: int) -> int:
    """The pipeline layer (XX in the file name) holding a layer of a model of ``num_blocks``."""
    if kind == "embed":
        return 0
    if kind == "block":
        return index + 2
    if kind == "final_norm":
        return num_blocks + 3
    if kind == "readout":
        return num_blocks + 4
    raise ValueError(f"unknown layer kind {kind!r}")


def is_slim_directory(path: str | Path) -> bool:
    """Whether ``path`` holds slim-weights layer files."""
    path = Path(path)
    return path.is_dir() and any(_FILE_RE.fullmatch(p.name) for p in path.iterdir())


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the layers are cut into files, from the YAML (or the 20B defaults)."""

    tp: int | None               # model-parallel-size; None = count the partition files
    tied_output: bool            # no output-projection file: the readout is the embedding
    output_parallelism: str      # "column" (split vocabulary rows) or "row"


def _layout_from_yaml(args: Mapping[str, Any], where: str) -> _Layout:
    a = normalize_keys(args)
    tp = a.get("model_parallel_size")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise WeightsError(f"{where}: model-parallel-size must be a positive integer, "
                              f"got {tp!r}")
    parallelism = a.get("output_layer_parallelism", "column")
    if parallelism not in ("column", "row"):
        raise WeightsError(f"{where}: output-layer-parallelism is {parallelism!r}; expected "
                              f"'column' or 'row'")
    return _Layout(tp=tp, tied_output=not a.get("no_weight_tying", False),
                   output_parallelism=parallelism)


def _find_yaml(path: Path) -> list[Path]:
    """The NeoX config files for the layer files in ``path``: the first of ``path``,
    ``path/configs``, ``path/../configs`` that holds any ``*.yml``/``*.yaml``."""
    for folder in (path, path / "configs", path.parent / "configs"):
        if folder.is_dir():
            files = sorted(p for p in folder.iterdir()
                           if p.suffix in (".yml", ".yaml") and p.is_file())
            if files:
                return files
    return []


def _first(state: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        if name in state:
            return name, state[name]
    return None


def _block_mlp_width(files: list[Path], parts: list[Mapping[str, Any]]) -> int | None:
    """The MLP width of one block, from its partitions' shapes: the output rows of the MLP's
    input projection, summed over the ranks. None when a partition lacks the matrices (reading
    the block reports that). A partition whose input projection is not exactly as wide as the
    output projection's input is refused: twice as wide is NeoX's gated MLP, which the model
    does not implement, and anything else cannot run in NeoX either."""
    width = 0
    for file, state in zip(files, parts):
        up, down = _first(state, _MLP_UP), _first(state, _MLP_DOWN)
        if up is None or down is None:
            return None
        (up_name, w_up), (down_name, w_down) = up, down
        if not (isinstance(w_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
                and w_up.dim() == 2 and w_down.dim() == 2):
            return None
        rows, cols = w_up.shape[0], w_down.shape[1]
        if rows == 2 * cols:
            raise WeightsError(
                f"{file}: '{up_name}' has {rows} output rows, twice the {cols} input columns of "
                f"'{down_name}': a gated MLP (NeoX's swiglu, geglu, reglu, glu or bilinear "
                f"activation, whose linear1 holds the value and the gate), which this model "
                f"does not implement; not supported")
        if rows != cols:
            raise WeightsError(f"{file}: '{up_name}' has {rows} output rows but '{down_name}' "
                               f"{cols} input columns; they must be equal")
        width += rows
    return width


def _check_copies(files: list[Path], key: str, label: str, tensors: list[torch.Tensor],
                  rule: MergeRule) -> None:
    """Warns (``PartitionsDifferWarning``) when the ranks' copies of a replicated tensor are not
    bitwise equal.

    Bitwise, not within a tolerance: every rank computes a replicated tensor's gradient from
    the same all-reduced inputs and applies the same optimizer step, so in a deterministic run
    the copies stay bit-identical, and any difference at all means the ranks drifted apart.
    Drift does happen (non-deterministic layer-norm backward kernels, bf16: BigScience's
    Megatron-DeepSpeed found diverging layer norms across tensor-parallel ranks and added a
    forced sync), and it is worth knowing about whatever its size. No tolerance would suit
    every dtype and model, and flagging a tiny drift costs a warning, not a refusal: the
    largest difference in the message lets the user judge it."""
    first = tensors[0]
    differ = [f.name for f, t in zip(files[1:], tensors[1:]) if not torch.equal(t, first)]
    if not differ:
        return
    # fp64: the difference of two fp32 (or 16-bit) values is exact or nearly so there.
    stacked = torch.stack([t.detach().to(torch.float64) for t in tensors])
    largest = (stacked.amax(dim=0) - stacked.amin(dim=0)).max().item()
    kind = ("is replicated across tensor-parallel partitions" if rule == REPLICATED else
            "is merged by 'mean', which expects identical copies on every partition,")
    warnings.warn(
        f"{files[0]}: tensor '{key}' of {label} {kind} but its copy differs in "
        f"{', '.join(differ)} (largest absolute difference {largest:.3g}); averaging the "
        f"copies, as EleutherAI's merge does", PartitionsDifferWarning, stacklevel=3)


# -- the reader ---------------------------------------------------------------------------------

class SlimReader(WeightsReader):
    """Reads a GPT-NeoX slim-weights directory one layer at a time (see the module docstring).

    path: the folder holding the ``layer_XX-model_YY-model_states.pt`` files.
    config: overrides the configuration (YAML or preset).
    yaml_files: the NeoX config files to use; default: looked up next to the weights.
    row_parallel_bias: "sum" or "mean" of the ranks' row-parallel bias copies; default from
        the configuration (``row_parallel_bias_merge``).
    allow_outside: accept layer files that are symbolic links leading out of ``path``
        (refused by default, see ``neox.weights.base.contained``).

    Opening lists the files and reads the YAML; when the configuration comes from the YAML
    the embedding files and the first readable block's files are mapped (tensor shapes only)
    to learn the vocabulary size and the MLP width. Nothing else is read until ``read``,
    which loads only that layer's partition files (memory-mapped). ``description`` says where
    the configuration came from and how the partitions are merged.
    """

    def __init__(self, path: str | Path, *, config: NeoXConfig | None = None,
                 yaml_files: Iterable[str | Path] | None = None,
                 row_parallel_bias: RowBiasMerge | None = None, allow_outside: bool = False):
        self.path = Path(path)
        if not self.path.is_dir():
            raise WeightsError(f"{self.path}: no such slim-weights directory")
        self._files: dict[tuple[int, int], Path] = {}
        for p in self.path.iterdir():
            m = _FILE_RE.fullmatch(p.name)
            if m:
                contained(self.path, p.name, what="the layer file",
                          allow_outside=allow_outside)
                self._files[(int(m.group(1)), int(m.group(2)))] = p
        # (kind, index) -> {local name: Megatron name} of the layers read, for messages: the
        # MLP has two possible names in the files.
        self._read_names: dict[tuple[LayerKind, int | None], dict[str, str]] = {}
        # The last layer's checked partitions, for the range reads that follow ``shapes``.
        self._parts_cache: tuple[
            tuple[LayerKind, int | None],
            dict[str, tuple[str, MergeRule, list[torch.Tensor]]]] | None = None
        if not self._files:
            raise WeightsError(f"{self.path}: no layer_XX-model_YY-model_states.pt files")

        yaml_files = list(yaml_files) if yaml_files is not None else _find_yaml(self.path)
        names = ", ".join(str(f) for f in yaml_files)
        args = read_neox_yaml(yaml_files) if yaml_files else None
        if args is not None:
            layout = _layout_from_yaml(args, names)
        else:
            # GPT-NeoX-20B: no weight tying, column-parallel output layer.
            layout = _Layout(tp=None, tied_output=False, output_parallelism="column")
        ranks = {rank for (_, rank) in self._files}
        self.tp = layout.tp if layout.tp is not None else max(ranks) + 1
        extra = sorted(f for (_, rank), f in self._files.items() if rank >= self.tp)
        if extra:
            raise WeightsError(f"{extra[0]}: a tensor-parallel rank beyond the "
                                  f"model-parallel-size {self.tp} of {names}")
        self._output_parallelism = layout.output_parallelism

        if config is not None:
            self.config = config
            source = "the configuration passed in"
            if args is not None:
                source += f" (file layout from {names})"
        elif args is not None:
            vocab = self._vocab_size_from_embedding()
            from_yaml = config_from_neox_yaml(args, vocab_size=vocab, where=names)
            found = self._mlp_width_from_blocks(from_yaml.num_hidden_layers)
            self.config = from_yaml
            source = f"{names} (vocabulary size {vocab} from the embedding files"
            if found is not None and found[0] != from_yaml.intermediate_size:
                width, file = found
                self.config = config_from_neox_yaml(args, vocab_size=vocab, where=names,
                                                    mlp_width=width, mlp_width_where=str(file))
                source += (f"; MLP width {width} from {file.name}, where the YAML alone gives "
                           f"{from_yaml.intermediate_size}")
            source += ")"
        else:
            self.config = PRESETS[SLIM_PRESET]
            source = (f"the {SLIM_PRESET} preset: no NeoX YAML found in {self.path}, "
                      f"{self.path / 'configs'} or {self.path.parent / 'configs'}")
        self._tied_output = layout.tied_output or self.config.tie_word_embeddings
        self._check_layer_files()

        if row_parallel_bias is None:
            row_parallel_bias = row_parallel_bias_merge(self.config.use_parallel_residual)
        if row_parallel_bias not in ("sum", "mean"):
            raise ValueError(f"row_parallel_bias must be 'sum' or 'mean', got "
                             f"{row_parallel_bias!r}")
        self.row_parallel_bias: RowBiasMerge = row_parallel_bias
        residual = "parallel" if self.config.use_parallel_residual else "sequential"
        self.description = (
            f"GPT-NeoX slim weights in {self.path}: {self.tp} tensor-parallel partition(s), "
            f"{self.config.num_hidden_layers} blocks; configuration from {source}; "
            f"row-parallel biases merged by {row_parallel_bias} ({residual} residual), layer "
            f"norms averaged over partitions")

    # -- opening ----------------------------------------------------------------------------

    def _vocab_size_from_embedding(self) -> int:
        rows = 0
        for rank in range(self.tp):
            file = self._partition_file(0, rank, "embed", None)
            state = self._load(file)
            t = state.get("word_embeddings.weight")
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise WeightsError(f"{file}: tensor 'word_embeddings.weight' missing or not "
                                      f"a matrix; cannot tell the vocabulary size")
            rows += t.shape[0]
        return rows

    def _mlp_width_from_blocks(self, num_blocks: int) -> tuple[int, Path] | None:
        """(MLP width, a file it was read from) of the first block whose partition files are
        all present and load; None when none does. A block that cannot be read is skipped
        here (reading it reports why), so a partial download still opens."""
        for index in range(num_blocks):
            layer = pipeline_layer("block", index, num_blocks)
            files = [self._files.get((layer, rank)) for rank in range(self.tp)]
            if any(f is None for f in files):
                continue
            try:
                parts = [self._load(f) for f in files]
            except WeightsError:
                continue
            width = _block_mlp_width(files, parts)
            if width is not None:
                return width, files[0]
        return None

    def _check_layer_files(self) -> None:
        n = self.config.num_hidden_layers
        known = {0, 1, n + 2, n + 3, n + 4} | set(range(2, n + 2))
        for (layer, _), file in sorted(self._files.items()):
            if layer not in known:
                raise WeightsError(
                    f"{file}: pipeline layer {layer} does not exist in a model of {n} blocks "
                    f"(layers 0, 2..{n + 1}, {n + 3}, {n + 4}); the configuration does not "
                    f"match these weights")

    # -- reading ----------------------------------------------------------------------------

    def _partition_file(self, layer: int, rank: int, kind: LayerKind,
                        index: int | None) -> Path:
        file = self._files.get((layer, rank))
        if file is None or not file.is_file():
            raise WeightsError(
                f"{self.path / slim_file_name(layer, rank)}: missing; it holds tensor-parallel "
                f"partition {rank} of {self.tp} of {layer_label(kind, index)}")
        return file

    _load = staticmethod(load_state_file)

    def _source(self, kind: LayerKind, index: int | None) -> tuple[int, dict[str, MergeRule]]:
        """(pipeline layer, {Megatron name: merge rule}) of a layer."""
        n = self.config.num_hidden_layers
        if kind == "block":
            if index is None or not 0 <= index < n:
                raise WeightsError(f"{self.path}: block {index} does not exist; the "
                                      f"configuration has {n} blocks")
            return pipeline_layer(kind, index, n), BLOCK_RULES
        if kind == "embed":
            return 0, {"word_embeddings.weight": CAT_OUT}
        if kind == "final_norm":
            return n + 3, {"norm.weight": REPLICATED, "norm.bias": REPLICATED}
        if kind == "readout":
            rule = CAT_OUT if self._output_parallelism == "column" else CAT_IN
            return n + 4, {"final_linear.weight": rule}
        raise ValueError(f"unknown layer kind {kind!r}")

    def _tied_readout(self) -> bool:
        n = self.config.num_hidden_layers
        return self._tied_output and not any((n + 4, r) in self._files for r in range(self.tp))

    def _layer(self, kind: LayerKind, index: int | None
               ) -> dict[str, tuple[str, MergeRule, list[torch.Tensor]]]:
        """``{local name: (Megatron name, merge rule, the partitions' tensors)}`` of one layer
        (not a tied readout), after every check of the files; the partitions are memory-mapped,
        so nothing is read but what is used. The last layer's are kept for ``read_range``."""
        if self._parts_cache is not None and self._parts_cache[0] == (kind, index):
            return self._parts_cache[1]
        self._parts_cache = None
        layer, rules = self._source(kind, index)
        files = [self._partition_file(layer, r, kind, index) for r in range(self.tp)]
        parts = [self._load(f) for f in files]
        for file, state in zip(files, parts):
            for key in state:
                if key not in rules and key not in _IGNORED:
                    raise WeightsError(
                        f"{file}: unknown tensor '{key}' for {layer_label(kind, index)} "
                        f"(expected {sorted(rules)})")
        label = layer_label(kind, index)
        if kind == "block":
            _block_mlp_width(files, parts)  # refuses a gated MLP with a message of its own
        renames = _RENAMES.get(kind, {})
        out: dict[str, tuple[str, MergeRule, list[torch.Tensor]]] = {}
        for key, rule in rules.items():
            present = [key in state for state in parts]
            if not any(present):
                continue  # absent everywhere: materialize reports it if the model needs it
            if not all(present):
                file = files[present.index(False)]
                raise WeightsError(f"{file}: tensor '{key}' is missing from this partition "
                                      f"but present in {files[present.index(True)].name}")
            local = renames.get(key, key)
            if local in out:
                raise WeightsError(f"{files[0]}: tensors '{out[local][0]}' and '{key}' are both "
                                   f"{label} {local} (NeoX's older and newer name)")
            tensors = [state[key] for state in parts]
            self._check_partitions(files, key, tensors)
            if len(tensors) > 1 and (rule == REPLICATED or (
                    rule == ROW_BIAS and self.row_parallel_bias == "mean")):
                # "mean" is the merge for copies that should be identical (see
                # row_parallel_bias_merge), so they are checked like the replicated ones.
                _check_copies(files, key, label, tensors, rule)
            out[local] = (key, rule, tensors)
        del parts
        self._read_names[(kind, index)] = {local: key for local, (key, _, _) in out.items()}
        self._parts_cache = ((kind, index), out)
        return out

    def read(self, kind: LayerKind, index: int | None = None) -> dict[str, torch.Tensor]:
        if kind == "readout" and self._tied_readout():
            embedding = self.read("embed")["embed_in.weight"]
            return {"embed_out.weight": embedding}
        out = {local: self._merge(rule, tensors)
               for local, (_, rule, tensors) in self._layer(kind, index).items()}
        self._parts_cache = None  # read whole: nothing more to read from these files
        return out

    def shapes(self, kind: LayerKind, index: int | None = None
               ) -> dict[str, tuple[torch.Size, torch.dtype]]:
        if kind == "readout" and self._tied_readout():
            shape, dtype = self.shapes("embed")["embed_in.weight"]
            return {"embed_out.weight": (shape, dtype)}
        out = {}
        for local, (_, rule, tensors) in self._layer(kind, index).items():
            shape = list(tensors[0].shape)
            if rule in (CAT_OUT, CAT_IN) and shape:
                shape[0 if rule == CAT_OUT else 1] *= len(tensors)
            out[local] = (torch.Size(shape), tensors[0].dtype)
        return out

    def read_range(self, kind: LayerKind, index: int | None, name: str, start: int,
                   stop: int) -> torch.Tensor:
        """Column-parallel tensors: the merged rows come from the partitions that hold them;
        row-parallel weights: the same rows of every partition, side by side; the small
        replicated tensors and row-parallel biases are merged whole and cut."""
        if kind == "readout" and self._tied_readout():
            return self.read_range("embed", None, "embed_in.weight", start, stop)
        _, rule, tensors = self._layer(kind, index)[name]
        shape = tuple(self.shapes(kind, index)[name][0])
        if rule == CAT_OUT:
            per = tensors[0].shape[0]

            def rows(r0: int, r1: int) -> torch.Tensor:
                return torch.cat([t[max(r0 - p * per, 0): max(min(r1 - p * per, per), 0)]
                                  for p, t in enumerate(tensors)])
        elif rule == CAT_IN:
            def rows(r0: int, r1: int) -> torch.Tensor:
                return torch.cat([t[r0:r1] for t in tensors], dim=1)
        else:
            merged = self._merge(rule, tensors)

            def rows(r0: int, r1: int) -> torch.Tensor:
                return merged[r0:r1]
        return flat_range(rows, shape, start, stop)

    @staticmethod
    def _check_partitions(files: list[Path], key: str, tensors: list[Any]) -> None:
        # Megatron splits every dimension evenly, and replicated tensors are full copies,
        # so all partitions of a tensor have the same shape and dtype.
        for file, t in zip(files, tensors):
            if not isinstance(t, torch.Tensor):
                raise WeightsError(f"{file}: '{key}' is a {type(t).__name__}, not a tensor")
        first = tensors[0]
        for file, t in zip(files[1:], tensors[1:]):
            if t.shape != first.shape:
                raise WeightsError(
                    f"{file}: tensor '{key}' has shape {tuple(t.shape)} but "
                    f"{tuple(first.shape)} in {files[0].name}; tensor-parallel partitions of "
                    f"one tensor must have equal shapes")
            if t.dtype != first.dtype:
                raise WeightsError(f"{file}: tensor '{key}' is {t.dtype} but {first.dtype} "
                                      f"in {files[0].name}")

    def _merge(self, rule: MergeRule, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) == 1:
            return tensors[0]
        if rule == CAT_OUT:
            return torch.cat(tensors, dim=0)
        if rule == CAT_IN:
            return torch.cat(tensors, dim=1)
        # Sums and means in fp32, rounded once to the stored dtype: with fp16 copies this is
        # as exact as the dtype allows, and identical copies come back unchanged.
        dtype = tensors[0].dtype
        acc = torch.stack([t.float() for t in tensors]).sum(dim=0)
        if rule == ROW_BIAS and self.row_parallel_bias == "sum":
            return acc.to(dtype)
        assert rule in (ROW_BIAS, REPLICATED), rule
        return (acc / len(tensors)).to(dtype)

    def close(self) -> None:
        self._parts_cache = None

    def where(self, kind: LayerKind, index: int | None, name: str) -> str:
        if kind == "readout" and self._tied_readout():
            return (self.where("embed", None, "embed_in.weight")
                    + " (the output projection is tied to the embedding)")
        try:
            layer, _ = self._source(kind, index)
        except WeightsError:
            return super().where(kind, index, name)
        # The name the files used, once read; else the older name, which is also the local
        # one inside a block.
        default = {} if kind == "block" else {v: k for k, v in _RENAMES.get(kind, {}).items()}
        key = self._read_names.get((kind, index), {}).get(name) or default.get(name, name)
        others = f" (and the other {self.tp - 1} partition(s))" if self.tp > 1 else ""
        return f"{self.path / slim_file_name(layer, 0)}{others}: tensor '{key}'"


def find_slim_directory(path: str | Path, *, allow_outside: bool = False) -> Path | None:
    """The folder holding the layer files: ``path`` itself, or the checkpoint ``path/latest``
    names (DeepSpeed's layout: ``latest`` holds e.g. ``global_step150000``), or the only
    ``global_step*`` folder with layer files. None if there is none; a ``WeightsError`` if
    there are several and no ``latest``, or if ``latest`` leads out of ``path`` and not
    ``allow_outside``."""
    path = Path(path)
    if is_slim_directory(path):
        return path
    latest = path / "latest"
    if latest.is_file():
        candidate = contained(path, latest.read_text().strip(), what="its 'latest' file names",
                              allow_outside=allow_outside)
        if is_slim_directory(candidate):
            return candidate
    steps = sorted(p for p in path.glob("global_step*") if is_slim_directory(p))
    if len(steps) > 1:
        names = ", ".join(p.name for p in steps)
        raise WeightsError(f"{path}: several checkpoints ({names}) and no 'latest' file; "
                              f"give the one to load")
    return steps[0] if steps else None


def open_slim(path: str | Path, *, config: NeoXConfig | None = None,
              row_parallel_bias: RowBiasMerge | None = None,
              allow_outside: bool = False) -> SlimReader:
    """Opens GPT-NeoX slim weights: ``path`` is the folder with the layer files, or the
    release's top folder (with ``latest`` and ``global_step150000/``). ``allow_outside``:
    follow a ``latest`` or layer files leading out of ``path``. See ``SlimReader``."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"{path}: no such directory")
    found = find_slim_directory(path, allow_outside=allow_outside)
    if found is None:
        raise WeightsError(f"{path}: no GPT-NeoX slim weights "
                              f"(layer_XX-model_YY-model_states.pt files)")
    return SlimReader(found, config=config, row_parallel_bias=row_parallel_bias,
                      allow_outside=allow_outside)
