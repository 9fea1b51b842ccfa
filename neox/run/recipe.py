"""The run recipe: what a fine-tuning run is, as small typed, versioned dataclasses.

Each field is declared once, with its check, its flag (its help, how its text is parsed) and
whether a resumed run may change it (``neox.setting``): the parser of ``neox.finetune`` and
``neox.plan``, the checks of a stored recipe, the identity checks of a resume
(``neox.run.resume``) and their messages derive from the declarations. The training code hands
each function only the part it needs (``ModelRecipe``, ``DataConfig``, ``OptimConfig``,
``LoopConfig``, ``OutputConfig``); every checkpoint stores ``recipe.to_dict()`` (tagged with
``RECIPE_VERSION``), and ``neox.export`` reads it back with ``Recipe.from_dict``. Renaming a
command-line flag therefore changes nothing stored.

Versions (``RECIPE_VERSION`` is the newest field's ``since``): 1, the first; 2 stores frozen
weights in the engine's words (``null`` or ``"int8"``, as ``zerocore.FrozenWeights``; version 1
wrote ``"compute"`` for ``null``) and holds every field; 3 adds ``sample_temperature``; 4,
``compile``; 5, ``offload`` (``--offload params|optimizer|all``); 6, ``hybrid`` and
``quantize_gradients`` (``--hybrid hsdp``, ``--quantize-gradients int8``); 7, ``offload_device``,
``offload_path`` and ``offload_pool`` (``--offload-device nvme``). A field's ``since`` says
from which version recipes always hold it; older ones may lack it and take its default, and its
``upgrade`` turns their values into this version's.
Checkpoints written before the recipe existed stored the command line's ``vars(args)`` under
``extra["args"]``; ``recipe_from_checkpoint`` reads that old form, in this one place.

How the run is launched (processes, ports, timeouts) and what this invocation does with the
output directory (resume, overwrite) are not part of the recipe: they do not change what is
trained.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Mapping

from neox import data as nd
from neox.blocks import ALL_BLOCKS
from neox.config import PRESETS, NeoXConfig
from neox.dtypes import DTYPES
from neox.finetune_modes import FinetuneMode, auto_mode
from neox.setting import (Flag, UsageError, absolute_path, byte_budget, finite_float, flag_dest,
                          flag_name, is_finite, is_int, path_text, problem, setting,
                          setting_of)
from zerocore.policies import DEFAULT_POOL_BYTES, MIN_POOL_BYTES, OFFLOAD_DEVICES

__all__ = ["RECIPE_VERSION", "Recipe", "ModelRecipe", "DataConfig", "OptimConfig", "LoopConfig",
           "OutputConfig", "RecipeError", "recipe_from_checkpoint", "recipe_fields",
           "recipe_from_flags", "FROM_SCRATCH", "OFFLOADS", "HYBRIDS", "offload_words"]

class RecipeError(ValueError):
    """A stored recipe that cannot be read (unknown version, missing or mistyped field)."""


def _check_fields(obj: Any, where: str) -> None:
    for field in dataclasses.fields(obj):
        message = problem(field, getattr(obj, field.name))
        if message is not None:
            raise RecipeError(f"{where}: {message}")


def _bool(x: Any) -> bool:
    return isinstance(x, bool)


def _path_or_none(x: Any) -> bool:
    return x is None or (isinstance(x, str) and x.strip() != "")


def _blocks(x: Any) -> bool:
    return isinstance(x, tuple) and all(is_int(i) and i >= 0 for i in x)


def _at_least(n: int):
    return lambda x: is_int(x) and x >= n


OFFLOADS = ("params", "optimizer", "all")   # --offload's choices
# --hybrid's layouts besides "none" (neox/run/layout.py turns each into zerocore's options).
HYBRIDS = ("hsdp", "hpz")


# The --help sections, in the order the commands list them.
MODEL, STEP, DATA = "model", "the training step (what memory holds)", "data"
OPTIM = "optimisation (on --resume, given flags override the checkpoint's)"
LOOP, OUTPUT = "training loop", "output and checkpoints"

# The defaults of a fine-tuning run, and what replaces them when there are no pretrained
# weights (``--finetune auto`` without --checkpoint): a randomly initialised model learns
# nothing useful through its biases alone, so the built-in run trains the whole preset, at a
# learning rate and for a number of epochs at which the tiny preset visibly learns in a couple
# of minutes on 2 CPU cores. (dests of the flags -> values)
FROM_SCRATCH = {"finetune": auto_mode(has_weights=False), "lr": 2e-3, "warmup": 5, "epochs": 3}

_MUST_BE_PATH = "{name} must be a path or null, got {value!r}"


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """Which model is trained, and how: the weights it starts from, the kept blocks, the
    fine-tuning mode and the compute dtype."""

    checkpoint: str | None = setting(
        None, check=_path_or_none, problem=_MUST_BE_PATH,
        flag=Flag(MODEL, "pretrained weights: a Hugging Face GPT-NeoX directory (e.g. a run's "
                         "OUTPUT_DIR/hf) or EleutherAI 20B slim-weights directory; without it "
                         "--model picks a randomly initialised preset",
                  parse=Path, store=absolute_path))
    preset: str = setting(
        "tiny", check=lambda x: isinstance(x, str), problem="{name} must be a name, got {value!r}",
        flag=Flag(MODEL, "preset when no --checkpoint (random initialisation, for machines "
                         "without weights)", name="--model", choices=tuple(sorted(PRESETS))))
    filter_layers: tuple[int, ...] | None = setting(
        None, check=lambda x: x is None or _blocks(x),
        problem="{name} must be block indices or null, got {value!r}",
        flag=Flag(MODEL, "keep only these transformer blocks, 0-based as in the checkpoint, e.g. "
                         "'0,1' or '0-3'; embedding, final norm and readout are always kept "
                         "(default: all)", late=True))
    allow_outside_weights: bool = setting(
        False, check=_bool, problem="{name} must be a bool",
        flag=Flag(MODEL, "follow weight-index entries and 'latest' pointers that lead out of the "
                         "--checkpoint directory (refused by default)"))
    dtype: str | None = setting(
        None, check=lambda x: x is None or x in DTYPES,
        problem="{name} must be fp32, bf16, fp16 or null, got {value!r}",
        flag=Flag(MODEL, "compute dtype (default: fp32 on the CPU, bf16 on a GPU)",
                  choices=tuple(DTYPES)))
    seed: int = setting(
        0, check=is_int, problem="{name} must be an integer, got {value!r}",
        flag=Flag(MODEL, "seeds a preset's random weights, the LoRA adapters and the data order",
                  parse=int))
    finetune: FinetuneMode = setting(
        FinetuneMode(), check=lambda x: isinstance(x, FinetuneMode),
        problem="{name} must be a FinetuneMode")
    reduce_dtype: str = setting(
        "fp32", check=lambda x: x in DTYPES,
        problem="{name} must be fp32, bf16 or fp16, got {value!r}",
        flag=Flag(STEP, "dtype in which gradients are summed over the ranks: fp32 keeps every "
                        "bit over many ranks; bf16 halves the traffic, losing bits at each hop "
                        "(the compute dtype is --dtype)", choices=tuple(DTYPES), resumable=True))
    # How frozen weights are held and gathered, in the engine's words
    # (``zerocore.FrozenWeights(dtype)``): None, the compute dtype; "int8", quantized once,
    # dequantized after each gather.
    frozen_weights: str | None = setting(
        None, check=lambda x: x in (None, "int8"),
        problem="{name} must be null (the compute dtype) or int8, got {value!r}",
        since=2, upgrade=lambda x: None if x == "compute" else x,
        flag=Flag(STEP, "how frozen weights are held and all-gathered: in the compute dtype, or "
                        "int8 with an fp32 scale per block of 128 (about half of bf16's bytes "
                        "in memory and on the wire, dequantized after each gather; trainable "
                        "weights, masters and optimizer state are never quantized; exports use "
                        "the unquantized base)", choices={"compute": None, "int8": "int8"},
                  text=lambda x: "compute" if x is None else x))

    def __post_init__(self) -> None:
        _check_fields(self, "recipe.model")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text and the tokenizer come from, and how the text is cut."""

    data: str | None = setting(
        None, check=_path_or_none, problem=_MUST_BE_PATH,
        flag=Flag(DATA, "a local UTF-8 text file to train on (default: tiny_shakespeare)",
                  parse=Path, store=absolute_path))
    data_dir: str | None = setting(
        None, check=_path_or_none, problem=_MUST_BE_PATH,
        flag=Flag(DATA, "local copies of the default corpus and tokenizer (default: "
                        "shared/data beside the repository)", parse=Path, store=absolute_path,
                  env="NEOX_DATA_DIR", resumable=True), per_node=True)
    tokenizer: str | None = setting(
        None, check=_path_or_none, problem=_MUST_BE_PATH,
        flag=Flag(DATA, "tokenizer.json (default: the checkpoint's, else a byte-level BPE "
                        "trained on the corpus and cached)", parse=Path, store=absolute_path))
    cache_dir: str | None = setting(
        None, check=_path_or_none, problem=_MUST_BE_PATH,
        flag=Flag(DATA, "downloaded corpus, trained tokenizers and tokenised data are kept here",
                  parse=Path, store=absolute_path, default=nd.default_cache_dir,
                  has_default=True, resumable=True), per_node=True)
    seq_len: int = setting(
        128, check=_at_least(1), problem="{name} must be >= 1, got {value!r}",
        flag=Flag(STEP, "tokens per sequence", parse=int))
    val_fraction: float = setting(
        0.1, check=lambda x: is_finite(x) and 0 <= x < 1,
        problem="{name} must be in [0, 1), got {value!r}",
        flag=Flag(DATA, "fraction of the windows (the corpus's end) held out for validation",
                  parse=finite_float))

    def __post_init__(self) -> None:
        _check_fields(self, "recipe.data")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    lr: float = setting(
        3e-4, check=lambda x: is_finite(x) and x > 0,
        problem="{name} must be a finite number > 0, got {value!r}",
        flag=Flag(OPTIM, f"peak learning rate (default: {3e-4:g}; {FROM_SCRATCH['lr']:g} when "
                         f"training from scratch)", parse=finite_float, resumable=True))
    warmup: int = setting(
        0, check=_at_least(0), problem="{name} must be >= 0, got {value!r}",
        flag=Flag(OPTIM, f"linear warm-up steps (default: 0; {FROM_SCRATCH['warmup']} when "
                         f"training from scratch)", parse=int, resumable=True))
    weight_decay: float = setting(
        0.0, check=lambda x: is_finite(x) and x >= 0,
        problem="{name} must be a finite number >= 0, got {value!r}",
        flag=Flag(OPTIM, "AdamW decoupled weight decay", parse=finite_float, resumable=True))
    # global gradient-norm clip; 0: off
    clip: float = setting(
        1.0, check=lambda x: is_finite(x) and x >= 0,
        problem="{name} must be a finite number >= 0 (0: off), got {value!r}",
        flag=Flag(OPTIM, "global gradient-norm clip (0: off)", parse=finite_float,
                  resumable=True))
    betas: tuple[float, float] = setting(
        (0.9, 0.999), check=lambda x: isinstance(x, tuple) and len(x) == 2 and all(
            is_finite(b) and 0 <= b < 1 for b in x),
        problem="{name} must be two numbers in [0, 1), got {value!r}",
        flag=Flag(OPTIM, "Adam's moment decay rates", parse=finite_float, nargs=2,
                  metavar=("BETA1", "BETA2"), resumable=True))
    eps: float = setting(
        1e-8, check=lambda x: is_finite(x) and x > 0,
        problem="{name} must be a finite number > 0, got {value!r}",
        flag=Flag(OPTIM, "Adam's epsilon", parse=finite_float, resumable=True))

    def __post_init__(self) -> None:
        _check_fields(self, "recipe.optim")


_AT_LEAST_1 = "{name} must be >= 1, got {value!r}"
_AT_LEAST_0 = "{name} must be >= 0, got {value!r}"


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The training loop: batches, steps, evaluation, and where the optimizer state lives."""

    batch_size: int = setting(
        16, check=_at_least(1), problem=_AT_LEAST_1,
        flag=Flag(STEP, "sequences per rank per micro-batch", parse=int, resumable=True))
    grad_accum: int = setting(
        1, check=_at_least(1), problem=_AT_LEAST_1,
        flag=Flag(STEP, "micro-batches per optimizer step", parse=int, resumable=True))
    epochs: int = setting(
        1, check=_at_least(1), problem=_AT_LEAST_1,
        flag=Flag(LOOP, f"passes over the training windows, each seen once per epoch (default: "
                        f"1; {FROM_SCRATCH['epochs']} when training from scratch)", parse=int,
                  resumable=True))
    max_steps: int | None = setting(
        None, check=lambda x: x is None or _at_least(1)(x),
        problem="{name} must be >= 1 or null, got {value!r}",
        flag=Flag(LOOP, "stop after this many steps (default: the epochs' steps)", parse=int,
                  resumable=True))
    eval_every: int = setting(
        0, check=_at_least(0), problem=_AT_LEAST_0,
        flag=Flag(LOOP, "validate every N steps (0: at the end only)", parse=int,
                  resumable=True))
    seed: int = setting(0, check=is_int, problem="{name} must be an integer, got {value!r}",
                        follows="seed")   # the data order
    offload_optimizer: bool = setting(
        False, check=_bool, problem="{name} must be a bool",
        flag=Flag(STEP, "keep fp32 masters, gradients and Adam moments in CPU memory (as "
                        "--offload optimizer)", resumable=True))
    # What lives in CPU memory (zerocore.Offload): with offload_optimizer, the optimizer is
    # offloaded when either says so.
    offload: str | None = setting(
        None, check=lambda x: x is None or x in OFFLOADS,
        problem=f"{{name}} must be one of {OFFLOADS} or null, got {{value!r}}",
        flag=Flag(STEP, "what lives in CPU memory: 'optimizer' (fp32 masters, gradients and "
                        "Adam moments, stepped there), 'params' (every parameter shard, frozen "
                        "ones too: the device holds a layer's only while its all-gather reads "
                        "it; the optimizer stays on the device), 'all' (both) (default: none)",
                  choices=OFFLOADS, resumable=True), since=5)
    # Where what --offload names lives (zerocore.Offload's optimizer=/params= device): host
    # memory, or scratch files on a local disk (ZeRO-Infinity). Bitwise the same either way,
    # so a resumed run may change it, and the path and pool with it.
    offload_device: str = setting(
        "cpu", check=lambda x: x in OFFLOAD_DEVICES,
        problem=f"{{name}} must be one of {OFFLOAD_DEVICES}, got {{value!r}}",
        flag=Flag(STEP, "where what --offload names lives: 'cpu' (host memory) or 'nvme' "
                        "(ZeRO-Infinity: the fp32 masters and Adam moments in a scratch file "
                        "per rank in --offload-path, on a local disk, stepped through "
                        "--offload-pool of host memory; the gradients and 16-bit copies stay "
                        "in host memory) (default: cpu)", choices=OFFLOAD_DEVICES,
                  resumable=True), since=7)
    offload_path: str | None = setting(
        None, check=_path_or_none, problem="{name} must be a directory, got {value!r}",
        flag=Flag(STEP, "the directory --offload-device nvme keeps its scratch in (a local "
                        "disk with room for 12 bytes per trained parameter per node; the files "
                        "have no name and go when the ranks end, however they end)",
                  parse=path_text, store=absolute_path, metavar="DIR", resumable=True),
        since=7, per_node=True)
    offload_pool: int = setting(
        DEFAULT_POOL_BYTES, check=_at_least(MIN_POOL_BYTES),
        problem=f"{{name}} must be a size of at least {MIN_POOL_BYTES} bytes, got {{value!r}}",
        flag=Flag(STEP, "host memory per rank that --offload-device nvme reads and writes "
                        "through (e.g. 256MiB, 1GiB): all it holds of the masters and moments "
                        "at once; larger means longer transfers", parse=byte_budget,
                  metavar="SIZE", text=lambda x: f"{x // 2**20}MiB", resumable=True), since=7)
    # steps in a row with NaN/inf loss or gradients: stop
    max_nonfinite_steps: int = setting(
        3, check=_at_least(1), problem=_AT_LEAST_1,
        flag=Flag(LOOP, "stop the run when the loss or the gradients have been NaN or infinite "
                        "this many steps in a row (nothing non-finite is ever saved)", parse=int,
                  resumable=True))
    # Blocks (checkpoint indices, among the kept ones) whose activations are recomputed in
    # backward instead of kept; () none. Of those, every k-th is (the first, the k+1-th, ...).
    # Results are bitwise the same either way, so a resumed run may change them.
    activation_checkpointing: tuple[int, ...] = setting(
        (), check=_blocks, problem="{name} must be block indices, got {value!r}",
        flag=Flag(STEP, "recompute blocks' activations in backward instead of keeping them: "
                        "alone, every kept block; or a block list as --filter-layers takes "
                        "(checkpoint numbering, e.g. '0-21'); same results, bitwise, for one "
                        "more forward of those blocks (default: off)", nargs="?",
                  const=ALL_BLOCKS, default=None, has_default=True, metavar="BLOCKS",
                  late=True, resumable=True))
    activation_checkpointing_every: int = setting(
        1, check=_at_least(1), problem=_AT_LEAST_1,
        flag=Flag(STEP, "of the blocks --activation-checkpointing chooses, recompute every K-th "
                        "(the first, the K+1-th, ...): less memory saved, less time spent",
                  parse=int, metavar="K", resumable=True))
    # How the ranks share the model across nodes: None, flat ZeRO-3 over every rank; "hsdp",
    # sharded within each node and replicated across nodes (a 2-D mesh (nodes, ranks per
    # node); neox/run/layout.py); "hpz", zerocore.Hybrid("hpz") on that mesh. A resumed run may
    # change it: checkpoints load into any layout.
    hybrid: str | None = setting(
        None, check=lambda x: x is None or x in HYBRIDS, since=6,
        problem=f"{{name}} must be null (flat) or one of {HYBRIDS}, got {{value!r}}",
        flag=Flag(STEP, "how the ranks share the model across nodes: 'none', flat ZeRO-3 over "
                        "every rank (every gather crosses the nodes); 'hsdp', sharded within each "
                        "node and replicated across nodes (only each rank's gradient shard "
                        "crosses them, once per step); 'hpz', ZeRO-3's memory over every rank "
                        "with a node-local copy of each layer's shards from forward to backward "
                        "(backward's gathers stay in the node); the nodes are torchrun's "
                        "(--nnodes), or --nodes on one machine",
                  choices={"none": None, **{h: h for h in HYBRIDS}},
                  text=lambda x: "none" if x is None else x, resumable=True))
    # HSDP's cross-node gradient all-reduce in int8 with a scale per block (zerocore's qgZ,
    # zerocore.Comm(quantize_gradients=)); None: in the reduce dtype.
    quantize_gradients: str | None = setting(
        None, check=lambda x: x in (None, "int8"), since=6,
        problem="{name} must be null or int8, got {value!r}",
        flag=Flag(STEP, "send the gradients across nodes in int8 with an fp32 scale per block "
                        "of 128 (about a quarter of fp32's bytes; within 1%% of the exact run's "
                        "loss on the tests' model), with --hybrid only: gathers and the "
                        "reduction within a node stay exact", choices={"none": None,
                                                                       "int8": "int8"},
                  text=lambda x: "none" if x is None else x, resumable=True))
    # Gathered-memory budget per rank (zerocore.Prefetch.keep_gathered): bytes, or "all".
    # Bitwise neutral too: a resumed run may change it.
    compile: bool = setting(
        False, check=_bool, problem="{name} must be a bool", since=4,
        flag=Flag(STEP, "compile each layer's forward (embedding, blocks, head) with "
                        "torch.compile (zerocore.Compile; the sharding engine stays eager "
                        "around it); the first steps take longer while it compiles",
                  resumable=True))
    keep_gathered: int | str = setting(
        0, check=lambda x: x == "all" or _at_least(0)(x), since=2,
        problem="{name} must be a number of bytes >= 0 or 'all', got {value!r}",
        flag=Flag(STEP, "gathered-memory budget per rank (e.g. 2GiB, 512MiB, a byte count, or "
                        "'all'): layers from the last one backwards that fit stay gathered, so "
                        "their backward all-gather is skipped and their frozen weights are "
                        "gathered once for the whole run; same results, bitwise (default: 0, "
                        "none beyond the last layer)", parse=byte_budget, metavar="SIZE",
                  resumable=True))

    def __post_init__(self) -> None:
        _check_fields(self, "recipe.loop")

    @property
    def offloaded_params(self) -> bool:
        """Whether the parameter shards live in CPU memory (``zerocore.Offload(params=)``)."""
        return self.offload in ("params", "all")

    @property
    def offloaded_optimizer(self) -> bool:
        """Whether the optimizer state lives off the device: ``--offload optimizer|all``, or
        ``--offload-optimizer`` (``zerocore.Offload(optimizer=)``), in host memory or on NVMe
        (``offload_device``)."""
        return self.offload_optimizer or self.offload in ("optimizer", "all")

    def offload_policy(self) -> dict[str, Any]:
        """``zerocore.Offload``'s keywords for this loop: each half offloaded to
        ``offload_device``, with the NVMe path and pool."""
        nvme = self.offload_device == "nvme"
        return dict(optimizer=self.offload_device if self.offloaded_optimizer else False,
                    params=self.offload_device if self.offloaded_params else False,
                    path=self.offload_path if nvme else None,
                    pool_bytes=self.offload_pool)

    def offload_problem(self, *, for_a_run: bool) -> str | None:
        """What is wrong with the offload flags together, in one line (None: nothing):
        --offload-device nvme with nothing offloaded, or for a run without --offload-path (a
        plan needs none: it writes nothing). (A path with --offload-device cpu is unused: a
        run resumed in memory keeps the path its checkpoint's recipe names.)"""
        if self.offload_device != "nvme":
            return None
        if not (self.offloaded_optimizer or self.offloaded_params):
            return ("--offload-device nvme: nothing is offloaded; add --offload optimizer "
                    "(the fp32 masters and Adam moments on NVMe), params or all")
        if for_a_run and self.offload_path is None:
            return ("--offload-device nvme needs --offload-path DIR, the directory on a local "
                    "disk to keep the scratch files in")
        return None


def offload_words(params: bool, optimizer: bool) -> str:
    """What lives in CPU memory, in words: "parameter shards and optimizer state", ...; ""
    for nothing."""
    return " and ".join(w for w, on in (("parameter shards", params),
                                        ("optimizer state", optimizer)) if on)


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """What the run writes, and where."""

    output_dir: str = setting(
        str(Path("runs") / "neox-finetune"), check=lambda x: isinstance(x, str) and x != "",
        problem="{name} must be a path, got {value!r}",
        flag=Flag(OUTPUT, "metrics.jsonl, checkpoints/, trainable.safetensors, hf/ go here; one "
                          "run per directory", parse=Path, store=str, resumable=True))
    save_every: int = setting(
        0, check=_at_least(0), problem=_AT_LEAST_0,
        flag=Flag(OUTPUT, "save a sharded checkpoint every N steps (0: only at the end)",
                  parse=int, resumable=True))
    keep_last: int = setting(
        3, check=_at_least(1), problem=_AT_LEAST_1,
        flag=Flag(OUTPUT, "checkpoints of this run to keep", parse=int, resumable=True))
    export_hf: bool = setting(
        False, check=_bool, problem="{name} must be a bool",
        flag=Flag(OUTPUT, "also write the fine-tuned model as a Hugging Face directory (LoRA "
                          "merged) to OUTPUT_DIR/hf", resumable=True))
    sample_tokens: int = setting(
        48, check=_at_least(0), problem=_AT_LEAST_0,
        flag=Flag(OUTPUT, "print a sample of this many tokens at the end, continuing the start "
                          "of the validation text (0: none)", parse=int, resumable=True))
    # The end-of-run sample's temperature; 0: greedy, the same text for the same weights.
    sample_temperature: float = setting(
        0.8, check=lambda x: is_finite(x) and x >= 0, since=3,
        problem="{name} must be a finite number >= 0 (0: greedy), got {value!r}",
        flag=Flag(OUTPUT, "temperature of that sample (0: greedy, so that two runs' samples "
                          "differ only where their weights do)", parse=finite_float,
                  resumable=True))
    measure_memory: bool = setting(
        False, check=_bool, problem="{name} must be a bool",
        flag=Flag(OUTPUT, "measure each rank's peak memory over the training steps after the "
                          "first (torch's profiler on the CPU, the allocator's peak on a GPU) and "
                          "print it beside python -m neox.plan's prediction, with each rank's "
                          "peak resident set", resumable=True))

    def __post_init__(self) -> None:
        _check_fields(self, "recipe.output")


_PARTS: dict[str, type] = {"model": ModelRecipe, "data": DataConfig, "optim": OptimConfig,
                           "loop": LoopConfig, "output": OutputConfig}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that defines a fine-tuning run; stored in each of its checkpoints."""

    model: ModelRecipe = ModelRecipe()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    loop: LoopConfig = LoopConfig()
    output: OutputConfig = OutputConfig()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict, tagged with the version."""
        d: dict[str, Any] = {"version": RECIPE_VERSION}
        for name in _PARTS:
            d[name] = _jsonable(dataclasses.asdict(getattr(self, name)))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """The inverse of ``to_dict``, for every version this neox reads. Unknown versions,
        unknown or missing fields and wrong types are ``RecipeError``s naming the field."""
        if not isinstance(d, Mapping):
            raise RecipeError(f"recipe: must be a mapping, got {type(d).__name__}")
        version = d.get("version")
        if not (is_int(version) and 1 <= version <= RECIPE_VERSION):
            raise RecipeError(f"recipe.version: {version!r} is not a recipe version this neox "
                              f"reads (1 to {RECIPE_VERSION}); a newer neox wrote it")
        unknown = sorted(set(d) - set(_PARTS) - {"version"})
        if unknown:
            raise RecipeError(f"recipe: unknown fields {unknown}")
        parts = {}
        for name, kind in _PARTS.items():
            if not isinstance(d.get(name), Mapping):
                raise RecipeError(f"recipe.{name}: missing or not a mapping")
            parts[name] = _from_fields(kind, d[name], f"recipe.{name}", version)
        return cls(**parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def _from_fields(kind: type, d: Mapping[str, Any], where: str, version: int) -> Any:
    """A dataclass from its stored fields (of recipe ``version``): lists back to tuples, a
    nested settings dataclass (the fine-tuning mode) read the same way, values of older
    versions upgraded."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise RecipeError(f"{where}: unknown fields {unknown}")
    missing = sorted(n for n, f in fields.items() if n not in d and setting_of(f).since <= version)
    if missing:
        raise RecipeError(f"{where}: missing fields {missing}")
    values: dict[str, Any] = {}
    for name, value in d.items():
        field = fields[name]
        s = setting_of(field)
        if dataclasses.is_dataclass(field.default):
            if not isinstance(value, Mapping):
                raise RecipeError(f"{where}.{name}: not a mapping")
            value = _from_fields(type(field.default), value, f"{where}.{name}", version)
        elif isinstance(value, list):
            value = tuple(value)
        if s.upgrade is not None and version < s.since:
            value = s.upgrade(value)
        values[name] = value
    try:
        return kind(**values)
    except (TypeError, ValueError) as e:  # FinetuneMode raises ValueError for a bad mode
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"{where}: {e}") from None


def recipe_fields() -> Iterator[tuple[tuple[str, ...], dataclasses.Field]]:
    """(path, field) of every field of a recipe, in declaration order, the fine-tuning mode's
    included: ``(("model", "finetune", "lora_rank"), <field>)``."""
    def walk(kind: type, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        for field in dataclasses.fields(kind):
            if dataclasses.is_dataclass(field.default):
                yield from walk(type(field.default), path + (field.name,))
            else:
                yield path + (field.name,), field
    for name, kind in _PARTS.items():
        yield from walk(kind, (name,))


# The version a recipe is written with: the newest of its fields' ``since``, so that declaring a
# field with ``since=N + 1`` is what makes this neox write version N + 1 (and an older neox refuse
# it as newer, instead of misreading it).
RECIPE_VERSION = max(setting_of(field).since for _, field in recipe_fields())


def flag_value(field: dataclasses.Field, value: Any) -> Any:
    """A flag's parsed value as its field holds it."""
    flag = setting_of(field).flag
    assert flag is not None
    if isinstance(flag.choices, Mapping):
        value = flag.choices[value]
    if isinstance(value, list):
        value = tuple(value)
    if flag.store is not None and not flag.late:
        value = flag.store(value)
    return value


def recipe_from_flags(values: Mapping[str, Any], late: Mapping[str, Any] = {}) -> Recipe:
    """The recipe that flag values describe: ``values`` by the flags' dests (as a parsed
    namespace holds them; flags absent take their fields' defaults), ``late`` the values of
    the fields the command resolved itself (the block lists, by dest). A value its field's
    check refuses is a ``UsageError`` naming the flag."""
    built: dict[tuple[str, ...], Any] = {}
    for path, field in recipe_fields():
        s = setting_of(field)
        if s.flag is not None and flag_dest(field) in late:
            value = late[flag_dest(field)]
        elif s.flag is not None and flag_dest(field) in values and not s.flag.late:
            value = flag_value(field, values[flag_dest(field)])
        elif s.follows is not None and s.follows in values:
            value = values[s.follows]
        else:
            continue
        message = problem(field, value, name=flag_name(field) if s.flag else None)
        if message is not None:
            raise UsageError(message if s.flag is None or "{name}" in s.problem
                             else f"{flag_name(field)}: {message}")
        built[path] = value
    return _assemble(built)


def _assemble(values: Mapping[tuple[str, ...], Any]) -> Recipe:
    """A recipe from field values by path, the others their defaults."""
    def make(kind: type, path: tuple[str, ...]) -> Any:
        args = {}
        for field in dataclasses.fields(kind):
            here = path + (field.name,)
            if dataclasses.is_dataclass(field.default):
                args[field.name] = make(type(field.default), here)
            elif here in values:
                args[field.name] = values[here]
        return kind(**args)
    return Recipe(**{name: make(kind, (name,)) for name, kind in _PARTS.items()})


def _from_legacy_args(a: Mapping[str, Any]) -> Recipe:
    """A recipe from the ``vars(args)`` that checkpoints stored before ``RECIPE_VERSION`` 1
    (neox.finetune's flags at commit fb213e3). Only fields that were flags then exist here;
    the rest take their defaults."""
    try:
        filter_layers = a["filter_layers"]
        return Recipe(
            model=ModelRecipe(
                checkpoint=a["checkpoint"], preset=a["model"], seed=a["seed"],
                filter_layers=tuple(filter_layers) if filter_layers is not None else None,
                finetune=FinetuneMode(
                    a["finetune"], lora_rank=a["lora_rank"], lora_alpha=a["lora_alpha"],
                    lora_targets=tuple(t.strip() for t in a["lora_targets"].split(",")),
                    seed=a["seed"]),
                dtype=a["dtype"]),
            data=DataConfig(data=a["data"], data_dir=a["data_dir"], tokenizer=a["tokenizer"],
                            cache_dir=a["cache_dir"], seq_len=a["seq_len"],
                            val_fraction=a["val_fraction"]),
            optim=OptimConfig(lr=a["lr"], warmup=a["warmup"], weight_decay=a["weight_decay"],
                              clip=a["clip"]),
            loop=LoopConfig(batch_size=a["batch_size"], grad_accum=a["grad_accum"],
                            epochs=a["epochs"], max_steps=a["max_steps"],
                            eval_every=a["eval_every"], seed=a["seed"],
                            offload_optimizer=a["offload_optimizer"]),
            output=OutputConfig(output_dir=a["output_dir"], save_every=a["save_every"],
                                keep_last=max(1, a["keep_last"]), export_hf=a["export_hf"]))
    except KeyError as e:
        raise RecipeError(f"run settings (old format): {e.args[0]!r} is missing") from None
    except (TypeError, AttributeError, ValueError) as e:
        if isinstance(e, RecipeError):
            raise
        raise RecipeError(f"run settings (old format): {e}") from None


def recipe_from_checkpoint(extra: Mapping[str, Any], where: str) -> tuple[Recipe, NeoXConfig]:
    """The recipe and model configuration a ``neox.finetune`` checkpoint stored (its manifest's
    ``extra``), in the current form or the one before ``RECIPE_VERSION`` 1. ``where`` names
    the checkpoint in messages. Raises ``RecipeError``."""
    if "recipe" in extra:
        try:
            recipe = Recipe.from_dict(extra["recipe"])
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None
    elif "args" in extra:
        try:
            recipe = _from_legacy_args(extra["args"])
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None
    else:
        raise RecipeError(f"{where}: not a checkpoint of neox.finetune (its manifest has no run "
                          f"recipe); use python -m zerocore.consolidate")
    if not isinstance(extra.get("config"), Mapping):
        raise RecipeError(f"{where}: the run's model configuration is missing from the manifest")
    try:
        config = NeoXConfig.from_hf_dict(extra["config"])
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: the stored model configuration is invalid: {e}") from None
    return recipe, config
