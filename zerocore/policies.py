"""Small frozen policies for ``zerocore.shard``: one concern each, passed by keyword."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import os
from typing import Any, Sequence

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the layers' computation and of gradient communication.

    param_dtype: dtype of the all-gathered parameters the layers compute with, of the shards that
        are all-gathered and of frozen shards. Trainable parameters always keep fp32 master
        weights, and gradients always accumulate in fp32 (over micro-batches) in the gradient
        shard.
    reduce_dtype: dtype in which gradients are reduce-scattered; None means param_dtype (as FSDP
        and DeepSpeed do: half the traffic of fp32 in fp16/bf16 training).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(f"MixedPrecision.{name} must be float32, float16 or bfloat16, "
                                 f"got {value}")

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Whether to start the next layer's all-gather while the current layer computes, in the
    forward pass and in the backward pass (where "next" is the layer before).

    keep_last: keep the last layer gathered from the end of forward to the start of backward,
    instead of freeing it and gathering it again: it is the first layer backward needs, so that
    gather could overlap nothing. Saves one layer's all-gather per forward/backward, for one
    layer's parameters held while the loss is computed. Only when the forward builds a graph
    (grad enabled); a forward never followed by backward releases it at the next forward.

    keep_gathered: a gathered-memory budget per rank, in bytes (or ``"all"``): layers chosen
    from the last one backwards (the order backward needs them), each taken while its gathered
    size (all its parameters in the param dtype) fits in what is left, stay gathered instead of
    being freed and gathered again. A chosen layer's frozen parameters, once gathered, stay so
    across forward, backward, micro-batches and steps (they never change; released by
    ``model.release_gathered()``, which ``zerocore.load_checkpoint`` calls); its trainable ones
    stay gathered from forward to their backward (the optimizer changes them). The results are
    the same bits; the chosen layers' all-gathers are skipped, for at most ``keep_gathered``
    bytes held. 0 (default): none beyond ``keep_last``.
    """

    forward: bool = True
    backward: bool = True
    keep_last: bool = True
    keep_gathered: int | str = 0

    def __post_init__(self) -> None:
        k = self.keep_gathered
        if not (k == "all" or (type(k) is int and k >= 0)):
            raise ValueError(f"Prefetch.keep_gathered must be a number of bytes >= 0 or 'all', "
                             f"got {k!r}")

    def layers_kept(self, gathered_bytes: list[int]) -> frozenset[int]:
        """The layers ``keep_gathered`` chooses, given each layer's gathered size in bytes."""
        if self.keep_gathered == "all":
            return frozenset(range(len(gathered_bytes)))
        left, chosen = self.keep_gathered, set()
        for i in reversed(range(len(gathered_bytes))):
            if 0 < gathered_bytes[i] <= left:
                chosen.add(i)
                left -= gathered_bytes[i]
        return frozenset(chosen)


# Where an offloaded half lives: host memory, or files on a local disk (ZeRO-Infinity).
OFFLOAD_DEVICES = ("cpu", "nvme")
# How the offloaded optimizer's pass runs (``Offload.overlap``).
OVERLAPS = ("exact", "delayed", "off")
# Offload(pool_bytes=None), the default: the pool is chosen from the host's memory
# (``auto_pool_bytes``), a power of two from DEFAULT_POOL_BYTES to MAX_AUTO_POOL_BYTES.
# DEFAULT_POOL_BYTES, the floor, was the constant default until issue 44: a host too small for
# more gets what every run got then.
DEFAULT_POOL_BYTES = 256 * 2**20
# The ceiling: with 1 GiB a pythia-70m pass reads all its moments ahead (537 MiB) and its NVMe
# step was 1.13x the in-memory one (docs/decisions.md, "NVMe offload's bytes in fp32"); more
# reads nothing more ahead for such a model, and a larger one is disk-bound whatever the pool.
MAX_AUTO_POOL_BYTES = 2**30
# The share of a host's memory the pools of all its ranks may take together: 1/20 (5%). NVMe
# offload is for hosts whose memory the model state nearly fills (with room to spare, the
# optimizer in host memory is faster), so the pool must stay a small part of it. The number is
# set by the two cases measured or planned: one rank on a 24 GB host (this project's machine,
# 23.5 GiB of MemTotal) gets 1 GiB (1.18 GiB allowed), the pool of the 1.13x above; eight
# ranks on a 128 GiB node (GPT-NeoX-20B fully fine-tuned on eight 24 GB GPUs, issue 31) get
# 512 MiB each (0.8 GiB allowed): 2 GiB more than the old default on the node, and the plan
# still fits with the optimizer on NVMe. A share of 1/16 would give that node 1 GiB a rank,
# whose plan no longer fits (116.6 GiB of host against the 115.2 it may use: "The NVMe pool's
# default stays 256 MiB").
AUTO_POOL_HOST_SHARE = 20
# The smallest pool: four chunk buffers (engine/nvme_store.py: one read ahead, one stepped, one
# written, one spare), each holding a chunk of the three fp32 arrays Adam steps (master and two
# moments), each array one 4096-byte block at least (what O_DIRECT transfers are aligned to);
# with params="nvme" too, a fourth array, the model copy the step writes.
MIN_POOL_BYTES = 4 * 3 * 4096


def auto_pool_bytes(host_memory: int, ranks_on_host: int) -> int:
    """``Offload(pool_bytes=None)``'s pool on a host of ``host_memory`` bytes (its physical
    memory: the same every run on a machine) shared by ``ranks_on_host`` ranks of the model:
    the largest power of two from ``DEFAULT_POOL_BYTES`` to ``MAX_AUTO_POOL_BYTES`` whose
    ``ranks_on_host`` copies take at most ``1 / AUTO_POOL_HOST_SHARE`` of the host; the floor
    when none does."""
    if ranks_on_host < 1 or host_memory < 0:
        raise ValueError(f"auto_pool_bytes: {ranks_on_host} ranks on a host of {host_memory} "
                         f"bytes")
    room = host_memory // AUTO_POOL_HOST_SHARE // ranks_on_host
    pool = DEFAULT_POOL_BYTES
    while pool * 2 <= min(room, MAX_AUTO_POOL_BYTES):
        pool *= 2
    return pool


def agreed_pool_bytes(hosts: Sequence[tuple[str, int]]) -> int:
    """The auto pool every rank of a model takes, from each rank's ``(host name, host
    memory)`` as every rank received them: the smallest ``auto_pool_bytes`` of any host, for
    the ranks of the model on it (the same answer on every rank, from the same list)."""
    counts = collections.Counter(host for host, _ in hosts)
    return min(auto_pool_bytes(memory, counts[host]) for host, memory in hosts)


@dataclasses.dataclass(frozen=True)
class Offload:
    """Offload: what lives off the compute device, and where: in (pinned) host memory
    (``"cpu"``) or in files on a local disk (``"nvme"``, ZeRO-Infinity). Two independent
    halves; both together are the full offload (FSDP2's CPUOffloadPolicy, DeepSpeed's
    offload_param with offload_optimizer, each with its own ``device``). docs/decisions.md,
    "CPU offload: the stream design", "Parameter offload (issue 31, item 1)" and "NVMe offload
    (issue 31, item 2)".

    optimizer: False, or where the optimizer lives: ``"cpu"`` (``True`` means ``"cpu"``) or
        ``"nvme"``. The fp32 master shard, its gradient and the Adam moments live on the host
        and are stepped there by the CPU fused kernel; gradient shards go to the host after
        each reduce-scatter and the updated model copy comes back before the next all-gather
        (into a device mirror of it, kept between steps, unless ``params`` is set too). On CUDA
        both copies run on side streams, overlapping computation. ``"nvme"``: the fp32 masters
        and the Adam moments live in a scratch file under ``path`` instead of in host memory,
        and the CPU Adam steps them chunk by chunk through ``pool_bytes`` of host buffers,
        reading the next chunk and writing the last while it steps one; the gradients and the
        model copy the kernel writes (in the param dtype, fp32 included) stay in host memory.
        In fp32 (parameters not on NVMe) that copy holds the master's very bits, so it is the
        master, stepped in place, and the scratch holds the two moments alone.
    params: False, or where every parameter shard the layers are gathered from lives:
        ``"cpu"`` (``True`` means ``"cpu"``) or ``"nvme"``. The trainable model copies (with
        ``optimizer``), and the frozen shards, int8 ones included. The device holds a layer's
        shard only for the window of its all-gather: it is uploaded (on CUDA, on a side stream)
        when the gather starts, on the prefetch schedule, so while the layer before computes,
        and dropped once the gather has consumed it; backward's gather uploads it again.
        Without ``optimizer``, as DeepSpeed's offload_param alone, the optimizer stays on the
        device: the fp32 master, its gradient and the Adam moments are device tensors, and the
        16-bit copy is not kept at all: each window is derived on the device from the master
        (one rounding pass, bitwise what the optimizer would have written), since the device
        holds the master anyway; in fp32 compute the master is itself what is gathered and
        stays on the device. What this saves is the frozen shards (LoRA, bias-only: nearly all
        the parameters) and the 16-bit copies. Training is bitwise the same as without offload.
    path: the directory NVMe offload keeps its scratch in (a local disk; each rank's scratch is
        one file in it, with no name: the kernel frees it when the rank ends, however it ends).
        Needed with ``"nvme"``, refused without. Checked before anything is built: it must be
        an existing, writable directory, and hold the scratch (reserved as the layers are
        built); each is one line, on every rank.
    pool_bytes: the host memory NVMe offload's chunks move through (``"nvme"`` only): what
        host memory holds of the masters and moments, at most. Larger chunks mean fewer,
        longer reads and writes, and more read ahead; at least ``MIN_POOL_BYTES``. None (the
        default) chooses it from the host's memory (``auto_pool_bytes``): the largest power
        of two from 256 MiB to 1 GiB such that the pools of the model's ranks on a host take
        at most a twentieth of its physical memory (or of its container's limit, where lower:
        ``host_memory_bytes``); the ranks agree on the smallest any host allows, each rank's
        host and memory as its ``Platform`` says (``shard(platform=)``, else detected), so
        every rank's pool is the same. ``zerocore.plan`` chooses it the same way from its
        ``host_memory`` and ranks per node.

    cpu_threads: CPU threads a GPU rank steps its optimizer with on the CPU (torch's thread
    count for the duration of ``zerocore.optim``'s step on offloaded shards; the process's own
    count is left as the caller set it): None gives each rank its share of the host's cores
    (the cores this process may use divided by the ranks on this host, never more than torch
    uses already), so N ranks do not oversubscribe the host N times; a number sets exactly that.
    Ranks computing on the CPU step with the thread count their launcher chose.

    overlap: with ``optimizer`` offloaded, whether its pass overlaps the next forward:
    ``"exact"`` (the default) makes ``optimizer.step()`` do what is collective (the lockstep's
    check; the gradient norm, clipping and loss scale are the caller's, before it) and hand
    the per-layer Adam work to one host worker, which steps the layers in forward order while
    the next forward runs: each layer's gather waits for that layer's update alone, and
    whatever reads the state whole (a step, ``zero_grad(set_to_none=False)``, state dicts,
    checkpoints, full states) waits for the whole pass first. Bitwise the same results as
    ``"off"``, which steps everything inside ``step()``. A failure of the pass is raised at
    the next step or checkpoint, on every rank. With ``params="nvme"`` the pass stays inside
    ``step()`` (the gathers' reads share its pool). ``"delayed"`` (opt-in, not exact: the
    ZeRO-Offload paper's delayed parameter update) lets step t's pass overlap step t+1's whole
    forward and backward: the gathers read a published copy of the weights, refreshed by each
    ``step()`` from the settled state before it starts its own pass, so each forward computes
    with the weights from before the last update (step 1's forward and step 2's both use the
    initial weights; the gradients of step t+1, computed on W_{t-1}, are applied on top of
    W_t). It costs a second host copy of the trainable shards in the param dtype, and step
    t's gradients, held by its pass until step t+1's ``step()`` (both in the plan). A load (a
    resume) publishes what it loaded: the delay restarts there, as at a first step.
    docs/offload.md, docs/decisions.md ("The one-step-delayed optimizer pass").
    """

    optimizer: bool | str = False
    params: bool | str = False
    cpu_threads: int | None = None
    path: str | None = None
    pool_bytes: int | None = None
    overlap: str = "exact"

    def __post_init__(self) -> None:
        for name in ("optimizer", "params"):
            value = getattr(self, name)
            if value is True:
                object.__setattr__(self, name, "cpu")  # frozen: normalised once, here
            elif value is not False and value not in OFFLOAD_DEVICES:
                raise ValueError(f"Offload.{name} must be False, True (the host), 'cpu' or "
                                 f"'nvme', got {value!r}")
        if self.cpu_threads is not None and (type(self.cpu_threads) is not int
                                             or self.cpu_threads < 1):
            raise ValueError(f"Offload.cpu_threads must be a positive int or None, got "
                             f"{self.cpu_threads!r}")
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
                raise ValueError(f"Offload.path must be a directory's path, got {self.path!r}")
            object.__setattr__(self, "path", os.fspath(self.path))
        if self.params == "nvme" and self.optimizer == "cpu":
            raise ValueError("Offload(params='nvme', optimizer='cpu'): the 16-bit copies the "
                             "host optimizer writes every step would go to NVMe while its "
                             "fp32 masters, twice their size, stay in host memory; give "
                             "optimizer='nvme' too (or params='cpu')")
        if self.nvme and self.path is None:
            raise ValueError("Offload: 'nvme' needs path=, the directory (on a local disk) to "
                             "keep the scratch files in")
        if not self.nvme and self.path is not None:
            raise ValueError(f"Offload(path={self.path!r}) is where NVMe offload keeps its "
                             f"scratch; give optimizer='nvme' or params='nvme', or leave path "
                             f"out")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"Offload.overlap must be one of {', '.join(map(repr, OVERLAPS))}, "
                             f"got {self.overlap!r}")
        if self.overlap == "delayed" and not self.optimizer:
            raise ValueError("Offload(overlap='delayed') delays the offloaded optimizer's "
                             "update; give optimizer='cpu' or 'nvme' too (or leave overlap out)")
        if self.overlap == "delayed" and self.params == "nvme":
            raise ValueError("Offload(overlap='delayed', params='nvme'): the gathers would read "
                             "the model copies from NVMe, where the pass writes them; give "
                             "params='cpu' (or False), or overlap='exact'")
        least = self.min_pool_bytes
        if self.pool_bytes is not None and (type(self.pool_bytes) is not int
                                            or self.pool_bytes < least):
            raise ValueError(f"Offload.pool_bytes must be None (chosen from the host's memory) "
                             f"or an int >= {least} (four chunk buffers of "
                             f"{least // 4 // 4096} 4 KiB blocks), got {self.pool_bytes!r}")

    @property
    def any(self) -> bool:
        """Whether anything lives off the device (a host arena is needed)."""
        return bool(self.optimizer or self.params)

    def with_pool(self, host_memory: int, ranks_on_host: int) -> Offload:
        """This policy with ``pool_bytes`` chosen (``auto_pool_bytes``) when it is None; as it
        is when given."""
        if self.pool_bytes is not None:
            return self
        return dataclasses.replace(self, pool_bytes=auto_pool_bytes(host_memory, ranks_on_host))

    @property
    def min_pool_bytes(self) -> int:
        """The smallest ``pool_bytes`` (``MIN_POOL_BYTES``, a third more when the step writes
        model copies to NVMe too)."""
        both = self.optimizer == "nvme" and self.params == "nvme"
        return MIN_POOL_BYTES * 4 // 3 if both else MIN_POOL_BYTES

    @property
    def overlaps(self) -> bool:
        """Whether the optimizer's pass runs on the host worker, overlapping the next forward
        (``overlap``): offloaded optimizer state, and parameters not on NVMe."""
        return (self.overlap in ("exact", "delayed") and bool(self.optimizer)
                and self.params != "nvme")

    @property
    def delayed(self) -> bool:
        """Whether the optimizer's update is one step delayed (``overlap="delayed"``): the
        gathers read a published copy that each ``step()`` refreshes."""
        return self.overlap == "delayed"

    @property
    def nvme(self) -> bool:
        """Whether either half lives on NVMe (a scratch file under ``path``)."""
        return "nvme" in (self.optimizer, self.params)


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Activation recomputation ("activation checkpointing"): a chosen layer's forward keeps
    only its input; its backward, which gathers the layer's parameters again anyway, runs the
    forward once more under autograd (with the random-number state and autocast settings of the
    first run, so dropout draws the same masks) and then differentiates. Activation memory falls
    from every layer's intermediate tensors to one tensor per chosen layer plus one layer's
    intermediates at a time; each chosen layer's forward runs twice.

    layers: ``"all"``, or the positions in the stack (0-based) of the layers to recompute.
    every: of the layers named by ``layers``, recompute every k-th, starting with the first
        (``Recompute(every=2)``: layers 0, 2, 4, ...), to trade less memory for less time.

    Gradients are bitwise those without recomputation: the same operations run on the same
    values in the same order. A layer whose forward builds no graph (frozen, with an input that
    needs no gradient) keeps nothing either way and is not affected.
    """

    layers: str | tuple[int, ...] = "all"
    every: int = 1

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, str):
            if layers != "all":
                raise ValueError(f"Recompute.layers must be 'all' or layer positions, got "
                                 f"{layers!r}")
        else:
            try:
                chosen = tuple(sorted(set(layers)))
            except TypeError:
                raise ValueError(f"Recompute.layers must be 'all' or layer positions, got "
                                 f"{layers!r}") from None
            if not all(type(i) is int and i >= 0 for i in chosen):
                raise ValueError(f"Recompute.layers: positions are integers >= 0, got "
                                 f"{layers!r}")
            object.__setattr__(self, "layers", chosen)  # frozen: normalised once, here
        if type(self.every) is not int or self.every < 1:
            raise ValueError(f"Recompute.every must be an integer >= 1, got {self.every!r}")

    def selects(self, index: int) -> bool:
        """Whether the layer at position ``index`` of the stack is recomputed."""
        if self.layers == "all":
            return index % self.every == 0
        if index not in self.layers:
            return False
        return self.layers.index(index) % self.every == 0

    def check_range(self, num_layers: int) -> None:
        """ValueError when a chosen position lies beyond a stack of ``num_layers`` layers."""
        if self.layers != "all":
            beyond = [i for i in self.layers if i >= num_layers]
            if beyond:
                raise ValueError(f"Recompute.layers: {beyond} lie beyond the stack, which has "
                                 f"{num_layers} layers (positions 0..{num_layers - 1})")


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling for fp16, with DeepSpeed's defaults: start at 2**16, halve on
    overflow once `hysteresis` consecutive overflows were seen, double after `window` steps
    without overflow, never below `min_scale`."""

    init_scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.init_scale <= 0 or self.min_scale <= 0 or self.window < 1 or self.hysteresis < 1:
            raise ValueError(f"invalid LossScaling {self}: scales must be > 0, window and "
                             f"hysteresis >= 1")


# The formats frozen weights can be held in (``FrozenWeights.dtype``), each with its default
# block: int8's 128 (docs/decisions.md, "int8 frozen weights"), QLoRA's 64 for NF4, and 128 for
# fp8 (zerocore/kernels/formats.py says why).
FROZEN_FORMATS = {"int8": 128, "nf4": 64, "fp8": 128}
# Where frozen weights live: sharded like the trainable ones and all-gathered, or replicated.
FROZEN_PLACEMENTS = ("sharded", "replicated")


@dataclasses.dataclass(frozen=True)
class FrozenWeights:
    """How frozen parameters are kept and gathered. ``dtype=None`` (default): in the compute
    dtype, as the trainable ones. A quantized ``dtype``: each frozen flat group is quantized
    once, at ``shard()`` (and at a load), from its fp32 values, by blocks of ``block``
    consecutive elements with an fp32 scale per block, and dequantized into the compute dtype
    right before the layer uses it, in one fused pass per rank's part:

    - ``"int8"``: symmetric int8, scale = block absmax / 127 (``zerocore.ops.
      dequantize_blockwise_``); 1 + 4 / block bytes per parameter, about half of bf16, a
      quarter of fp32; each element off by at most half its block's scale;
    - ``"nf4"``: QLoRA's 4-bit NormalFloat, scale = block absmax, two codes a byte
      (``dequantize_nf4_``); 1/2 + 4 / block bytes per parameter (block 64: 0.5625);
    - ``"fp8"``: e4m3fn, scale = block absmax / 448 (``dequantize_fp8_``); as int8's bytes.

    zerocore/kernels/formats.py states NF4's and fp8's rounding and error bounds.

    block: elements per scale; None: the format's default (``FROZEN_FORMATS``: 128 for int8
        and fp8, 64 for NF4). int8 takes [16, 4096], NF4 and fp8 multiples of 32 there (their
        kernels' vector step).
    placement: ``"sharded"`` (default): each rank holds its shard of the quantized values, and
        each use all-gathers the quantized bytes (or, unquantized, the compute dtype's) and
        dequantizes every rank's part. ``"replicated"``: every rank holds the whole quantized
        frozen base (quantized per rank's part exactly as when sharded, so the same bits) and
        dequantizes a unit into a transient buffer just before it runs, in forward and in
        backward, freed after it as a gathered buffer is: nothing frozen is gathered. Needs a
        quantized dtype. With ``Offload(params="cpu")`` the whole quantized base lives in host
        memory and each unit's bytes are uploaded before it is dequantized (not with
        ``params="nvme"``). Trainable parameters stay sharded either way.

    Trainable parameters, master weights and optimizer state are never quantized; checkpoints
    never hold the quantized values (docs/decisions.md: "int8 frozen weights", "Quantized frozen
    weights, sharded or replicated")."""

    dtype: str | None = None
    block: int | None = None
    placement: str = "sharded"

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in FROZEN_FORMATS:
            raise ValueError(f"FrozenWeights.dtype must be None or one of "
                             f"{tuple(FROZEN_FORMATS)}, got {self.dtype!r}")
        if self.block is None:  # frozen: normalised once, here
            object.__setattr__(self, "block", FROZEN_FORMATS.get(self.dtype, 128))
        step = 32 if self.dtype in ("nf4", "fp8") else 1
        if type(self.block) is not int or not 16 <= self.block <= 4096 or self.block % step:
            what = "an int in [16, 4096]" if step == 1 else f"a multiple of {step} in [32, 4096]"
            raise ValueError(f"FrozenWeights.block must be {what}"
                             f"{f' for {self.dtype}' if step != 1 else ''}, got {self.block!r}")
        if self.placement not in FROZEN_PLACEMENTS:
            raise ValueError(f"FrozenWeights.placement must be one of {FROZEN_PLACEMENTS}, got "
                             f"{self.placement!r}")
        if self.placement == "replicated" and self.dtype is None:
            raise ValueError("FrozenWeights(placement='replicated') holds the whole frozen base "
                             "quantized on every rank; give dtype='nf4', 'fp8' or 'int8' too "
                             "(or leave placement 'sharded')")

    @property
    def quantized(self) -> bool:
        """Whether frozen groups are held quantized (any ``dtype`` but None)."""
        return self.dtype is not None

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole frozen base (``placement="replicated"``)."""
        return self.placement == "replicated"

    @property
    def int8_block(self) -> int | None:
        return self.block if self.dtype == "int8" else None

    def frozen_nbytes(self, numel: int, param_bytes: int) -> int:
        """Bytes that ``numel`` frozen elements take (and one gather of them moves): per
        element a byte (int8, fp8) or half (NF4) and an fp32 scale per block (``numel`` a
        whole number of blocks, as shards are), else ``param_bytes`` each."""
        if self.dtype is None:
            return numel * param_bytes
        codes = numel // 2 if self.dtype == "nf4" else numel
        return codes + 4 * numel // self.block


# What the ranks' own transport waits when no timeout is given: gloo's default process-group
# timeout (torch.distributed.init_process_group's documentation: 30 minutes for backends other
# than NCCL). The transport cannot read the group's own timeout (torch has no public way), so a
# run with a shorter one should pass it here too.
DEFAULT_TIMEOUT_S = 1800.0
PEER_READ_CHOICES = ("auto", "off")
GATHER_CHOICES = ("auto", "collective", "read", "nodes")
REDUCE_CHOICES = ("auto", "collective", "exchange", "read")


@dataclasses.dataclass(frozen=True)
class Comm:
    """How the ranks exchange parameters and gradients, and how long one waits for another.

    timeout: seconds (or a ``datetime.timedelta``) that any wait of zerocore's own transport
        (below) may last before this rank raises ``zerocore.PeerLost`` naming the rank it
        waited for (stopped, hung, or gone); give the timeout of ``init_process_group``, which
        bounds gloo's and NCCL's collectives the same way. None: 1800 s (gloo's default).
    peer_read: ``"auto"`` (default): gloo ranks of one Linux host that may read each other's
        memory gather and reduce by reading it directly, signalling through anonymous pipes
        (docs/decisions.md, "Communication between gloo ranks of one host"); ``"off"``:
        gloo's collectives only. The values are the same bits either way (every reduction on
        gloo sums in rank order).
    gather, reduce: how parameters are all-gathered and gradients reduced (comm/transport.py
        describes each way): ``"auto"`` (default) takes the fastest that applies; gather
        ``"collective"``, ``"read"`` or ``"nodes"`` (gloo ranks of a flat layout over torchrun
        nodes: across them, then within each, the fewest bytes across); reduce
        ``"collective"``, ``"exchange"`` (two gloo ranks) or ``"read"`` (gloo ranks of one
        host). Every way gives the same bits; the named ones are for comparing them (tests,
        benchmarks), and one that does not apply is refused when the model is sharded.
    quantize_gradients: None (default), or ``"int8"``: the gradients' reduction across the
        nodes (HSDP's all-reduce of the gradient shards across the replicas; hpZ's
        reduce-scatter of the secondary gradient slices) travels in int8 with an fp32 scale per
        ``quantize_block`` elements, summed in fp32 (zerocore/comm/quantized_reduce.py, ZeRO++'s
        qgZ): about a quarter of fp32's bytes across the nodes, half of bf16's, within the error
        bound stated there; gathers and reductions inside the node stay exact. Needs a 2-D mesh
        with more than one replica (refused otherwise).
    """

    timeout: float | datetime.timedelta | None = None
    peer_read: str = "auto"
    gather: str = "auto"
    reduce: str = "auto"
    quantize_gradients: str | None = None
    quantize_block: int = 128

    def __post_init__(self) -> None:
        t = self.timeout
        seconds = t.total_seconds() if isinstance(t, datetime.timedelta) else t
        if t is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                              or not 0 < seconds < math.inf):
            raise ValueError(f"Comm.timeout must be a number of seconds > 0 (or a timedelta), "
                             f"got {t!r}")
        for name, choices in (("peer_read", PEER_READ_CHOICES), ("gather", GATHER_CHOICES),
                              ("reduce", REDUCE_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"Comm.{name} must be one of {choices}, got "
                                 f"{getattr(self, name)!r}")
        if self.quantize_gradients not in (None, "int8"):
            raise ValueError(f"Comm.quantize_gradients must be None or 'int8', got "
                             f"{self.quantize_gradients!r}")
        if type(self.quantize_block) is not int or not 16 <= self.quantize_block <= 4096 \
                or self.quantize_block % 16:
            raise ValueError(f"Comm.quantize_block must be a multiple of 16 in [16, 4096], got "
                             f"{self.quantize_block!r}")
        if self.peer_read == "off" and "read" in (self.gather, self.reduce):
            raise ValueError(f"Comm(peer_read='off') with gather={self.gather!r}, "
                             f"reduce={self.reduce!r}: reading is off; ask for another way")

    @property
    def timeout_s(self) -> float:
        t = self.timeout
        if t is None:
            return DEFAULT_TIMEOUT_S
        return float(t.total_seconds() if isinstance(t, datetime.timedelta) else t)


@dataclasses.dataclass(frozen=True)
class Compile:
    """``torch.compile`` each layer's (or unit's) forward, the engine staying eager around it
    (zerocore/engine/compiled.py says how); the fields are ``torch.compile``'s.

    fullgraph: one graph per forward or an error (the default here, not torch's): a graph break
        inside a layer would otherwise go unnoticed and cost a Python round trip per step.
    dynamic: None (torch's default) compiles for the first shapes seen and once more, with
        symbolic shapes, when a shape changes; False compiles once per distinct shape.
    backend, mode, options: passed through (``options`` as a tuple of (name, value) pairs, or a
        dict, which is stored sorted as pairs so that the policy stays hashable; torch.compile
        refuses mode and options together).
    """

    fullgraph: bool = True
    dynamic: bool | None = None
    backend: str = "inductor"
    mode: str | None = None
    options: tuple[tuple[str, Any], ...] | dict[str, Any] = ()

    def __post_init__(self) -> None:
        if isinstance(self.options, dict):
            object.__setattr__(self, "options", tuple(sorted(self.options.items())))
        if not isinstance(self.backend, str):
            raise ValueError(f"zerocore.Compile.backend is a backend's name, got "
                             f"{type(self.backend).__name__}")


HYBRID_LAYOUTS = ("hsdp", "hpz")


@dataclasses.dataclass(frozen=True)
class Hybrid:
    """How a 2-D mesh ``(replicate, shard)`` shares the model (``shard(mesh=..., hybrid=...)``;
    a 2-D mesh without it is HSDP). docs/decisions.md, "Hybrid sharding (issue 30)".

    layout: ``"hsdp"``: parameters, gradients and optimizer state sharded over the shard dim (a
        node) and replicated over the replicate dim; only gradient shards cross the nodes.
        ``"hpz"`` (ZeRO++'s hpZ): masters, gradients and optimizer state sharded over all R·S
        ranks (ZeRO-3's memory); a layer's forward gathers its 16-bit weights across the nodes
        once and keeps a node-local secondary shard (1/S of the layer) until its backward,
        whose gather reads only those, within the node; gradients are reduce-scattered within
        the node, then across the nodes (in int8 with ``Comm(quantize_gradients="int8")``).
        Needs a 2-D mesh with more than one replica.
    """

    layout: str = "hsdp"

    def __post_init__(self) -> None:
        if self.layout not in HYBRID_LAYOUTS:
            raise ValueError(f"Hybrid.layout must be one of {HYBRID_LAYOUTS}, got "
                             f"{self.layout!r}")
