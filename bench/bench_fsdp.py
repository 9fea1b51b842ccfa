"""End-to-end training step of zerocore against PyTorch FSDP2, DeepSpeed ZeRO-3 and one unsharded
process, 2 gloo ranks on the CPU, at three model sizes of residual MLP blocks (the default) or of
GPT-NeoX blocks from neox at 128-512 tokens per sequence (``--sizes neox-...``, SIZES).

Run (not part of the default test run):

    python -m pytest bench/bench_fsdp.py --benchmark-only -s

Every engine trains the same model (DEPTH residual MLP blocks of width WIDTH, each one layer)
from the same initial weights on the same batches, one engine after the other in the same pytest
run, each in its own fresh processes:
- ``zerocore``: ``zerocore.shard(layers)`` + ``zerocore.optim.AdamW`` (fused kernel on flat
  shards). Optional configurations (``--engines``): ``zerocore-no-keep-last``
  (``Prefetch(keep_last=False)``), ``zerocore-offload`` (``Offload(optimizer=True)``: with CPU
  ranks the same memory, so this measures the offload path's own copies), and
  ``zerocore-before``, the engine of another checkout (``--zerocore-before PATH``) for A/B runs
  of an engine change; ``zerocore-gloo``, ``zerocore-exchange`` and ``zerocore-read-gathers``,
  the engine with some of its communication optimisations turned off (``ZEROCORE_VARIANTS``),
  for before/after comparisons in one run; ``zerocore-compiled``, each block's forward compiled
  (``compile=zerocore.Compile()``);
- ``fsdp2-compiled``: ``torch.compile(block, fullgraph=True)`` per block, then ``fully_shard``
  on each compiled block and on the root (torchtitan's order), as ``fsdp2`` otherwise;
- ``fsdp2``: ``fully_shard`` on every layer and on the root, over a 1-D "cpu" DeviceMesh, +
  ``torch.optim.AdamW(fused=True)`` (``foreach=True`` if fused is refused on DTensor parameters;
  the table says which ran);
- ``deepspeed`` and ``deepspeed-per-layer``: ``deepspeed.initialize`` with ZeRO stage 3 and its
  own AdamW (FusedAdam, its CPU build compiled just in time on first use), gloo, on the CPU
  accelerator (``DS_ACCELERATOR=cpu``). ``deepspeed`` keeps DeepSpeed's defaults, under which a
  model this small is gathered whole once per step and kept gathered through backward
  (``stage3_max_reuse_distance`` and ``stage3_max_live_parameters`` 1e9, prefetch bucket 5e7
  elements); ``deepspeed-per-layer`` sets them so that it gathers one block at a time, with one
  block prefetched, in forward and again in backward, as zerocore and FSDP2 do
  (``DEEPSPEED_PER_LAYER``). Skipped, with the install line, when DeepSpeed is not installed;
- ``unsharded``: one process, one thread, plain ``nn.Sequential`` + ``torch.optim.AdamW(fused=
  True)``, on both ranks' batches at once (the same global batch): perfect 2-way scaling would
  make the 2-rank engines' step time 0.50 of its.
One step is forward + MSE loss + backward + optimizer step + ``zero_grad()``.

What the numbers mean. The parent process drives the ranks step by step over pipes, and
pytest-benchmark times each round trip (``benchmark.pedantic``, WARMUP untimed rounds, then
STEPS timed rounds of one step); it includes the pipe round trip and waking the ranks (a few ms
at most). Each rank also times its step and its phases (forward with the loss, backward,
optimizer step with zero_grad) with ``time.perf_counter``, and counts the CPU time its process
used meanwhile (``getrusage``: the compute thread and gloo's threads). The end-of-run tables
give, per model size:
- the median over steps of the slower rank's time, its ratio to FSDP2, to DeepSpeed per layer
  and to the unsharded process;
- the median CPU time per step and rank, and how many cores other processes kept busy meanwhile
  (a lower bound): figures taken under load measure the scheduler as much as the engines;
- per rank, the model-state bytes (parameter, gradient and optimizer-state shards, measured from
  the tensors after a step, before ``zero_grad``) next to the ZeRO-3 prediction 16·Ψ/N in fp32;
  the RSS before the model is built; the peak RSS over the process's life (``ru_maxrss``, which
  includes building the unsharded model) and over training only (Linux ``VmHWM``, reset once the
  model is built and sharded);
- where a step's time goes, mean over the timed steps (so the parts add up to the mean step):
  for zerocore, computation in forward and in backward, time blocked waiting for all-gathers,
  for gradient reductions, issuing both (the own shard's copy, packing gradients), the optimizer
  step and other (the loss, between phases); for the others, forward, backward and optimizer;
- the largest relative difference of every engine's per-rank losses from the reference
  engine's (FSDP2's when it ran), asserted small: they train the same model on the same data.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import resource
import statistics
import sys
import time
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import harness
from neox.config import NeoXConfig
from neox.model import build_layer, init_weights

WORLD_SIZE = 2
# Model sizes, name -> (blocks, width); each block is width -> 4·width -> width. The issue's
# three workloads: the engines' relative standing as the model grows (more blocks, or wider).
SIZES = {"6x256": (6, 256), "12x256": (12, 256), "6x512": (6, 512),
         # GPT-NeoX blocks from neox (attention + MLP, parallel residual, rotary), as users train
         # them (issue 23, item 4): (blocks, hidden size), at the sequence length in NEOX_SEQ.
         "neox-6x256-t128": (6, 256), "neox-6x256-t512": (6, 256), "neox-6x512-t256": (6, 512)}
NEOX_SEQ = {"neox-6x256-t128": 128, "neox-6x256-t512": 512, "neox-6x512-t256": 256}
NEOX_HEADS = 8
# Tokens per rank per step, as (sequences, positions): the residual MLPs' shape; the GPT-NeoX
# workloads keep 8 x 128 tokens per rank (sequences = 1024 / their length, at least 2).
BATCH = (8, 16)
NEOX_TOKENS = 1024
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
WARMUP = 3   # untimed steps: first-touch allocations, optimizer state creation, gloo set-up
STEPS = 15   # timed steps
BATCHES = 4  # distinct batches per rank, drawn before timing and cycled
# Seconds a rank may take to start (import torch, zerocore, DeepSpeed and its first JIT build of
# FusedAdam: about 2.5 minutes on 2 cores) and to answer a step.
START_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 300.0
# Largest relative difference allowed between an engine's per-rank losses and the reference
# engine's, over the WARMUP + STEPS + 1 steps. All run the same fp32 model on the same data;
# what differs is rounding: the order of the gradient sums, FSDP2's and DeepSpeed's Adam
# kernels (torch's fused AdamW and DeepSpeed's CPU FusedAdam use other instruction sequences
# than zerocore's), and for the unsharded process one MSE over both ranks' batches instead of
# the mean of two. Measured: about 1e-7 at every size; 1e-5 leaves room for the drift over
# the steps while any real difference in what is trained (a missed gradient, a wrong
# average) shows at 1e-3 or more from the second step on.
LOSS_RTOL = 1e-5

# zerocore's configurations (_Zerocore's arguments).
ZEROCORE_VARIANTS = {
    "zerocore": {},
    "zerocore-no-keep-last": {"keep_last": False},
    "zerocore-offload": {"offload": True},
    "zerocore-before": {},
    # The slower ways of moving parameters and gradients (zerocore.Comm; comm/transport.py),
    # for before/after comparisons in one run: gloo's collectives only (broadcasts and an
    # all-reduce, the engine before issue 15); gathers by gloo, reductions by exchanging halves;
    # gathers by reading the other ranks' memory, reductions by exchanging halves.
    "zerocore-gloo": {"comm": {"gather": "collective", "reduce": "collective"}},
    "zerocore-exchange": {"comm": {"gather": "collective", "reduce": "exchange"}},
    "zerocore-read-gathers": {"comm": {"reduce": "exchange"}},
    # Each block's forward compiled (zerocore.Compile(); issue 23, item 2), against
    # "fsdp2-compiled": fully_shard per block around torch.compile per block, as torchtitan does.
    "zerocore-compiled": {"compile": True},
}
ALL_ENGINES = ["fsdp2", "zerocore", "deepspeed", "unsharded", "deepspeed-per-layer",
               "fsdp2-compiled", *[name for name in ZEROCORE_VARIANTS if name != "zerocore"]]
# The default run, in this order at each size: the sharded engines alternate with the others so
# that a drift of the machine's speed during the run does not favour either side.
DEFAULT_ENGINES = ["fsdp2", "zerocore", "deepspeed", "unsharded", "deepspeed-per-layer"]
# ZeRO-3 model state per parameter in fp32: parameter 4 + gradient 4 + Adam moments 8.
STATE_BYTES_PER_PARAM = 16
DEEPSPEED_INSTALL = ("DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed  "
                     "(see bench/README.md)")


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): the feed-forward half of a pre-norm transformer layer."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, width)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def neox_config(size: str) -> NeoXConfig:
    depth, width = SIZES[size]
    return NeoXConfig(vocab_size=2, hidden_size=width, num_hidden_layers=depth,
                      num_attention_heads=NEOX_HEADS, intermediate_size=4 * width,
                      max_position_embeddings=NEOX_SEQ[size])


def _block(size: str) -> nn.Module:
    width = SIZES[size][1]
    if size in NEOX_SEQ:
        return build_layer("block", neox_config(size))
    return Block(width, 4 * width)


def make_layers(size: str) -> list[nn.Module]:
    torch.manual_seed(0)  # the same initial weights on every rank and for every engine
    layers = [_block(size) for _ in range(SIZES[size][0])]
    if size in NEOX_SEQ:
        gen = torch.Generator().manual_seed(0)
        for layer in layers:
            init_weights(layer, generator=gen)
    return layers


def batch_shape(size: str) -> tuple[int, int]:
    """(sequences, positions) per rank per step."""
    if size in NEOX_SEQ:
        return max(2, NEOX_TOKENS // NEOX_SEQ[size]), NEOX_SEQ[size]
    return BATCH


def num_params(size: str) -> int:
    with torch.device("meta"):  # counted without allocating or drawing random numbers
        return SIZES[size][0] * sum(p.numel() for p in _block(size).parameters())


def _batches(rank: int, size: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, alike per engine
    shape = (*batch_shape(size), SIZES[size][1])
    return [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen))
            for _ in range(BATCHES)]


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of t (its local shard for a DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def deepspeed_config(size: str, per_layer: bool) -> dict[str, Any]:
    """DeepSpeed's configuration: ZeRO-3, its own AdamW with our hyperparameters, fp32.

    per_layer: gather one block at a time, as zerocore and FSDP2 do, instead of DeepSpeed's
    defaults (under which this model stays gathered from its first use in forward to its last
    in backward). DeepSpeed fetches per submodule (each Linear, LayerNorm) following the trace
    of the previous step:
    - ``stage3_max_reuse_distance`` 0: release a submodule's parameters right after use (the
      default 1e9 keeps any parameter that is used again within 1e9 elements, i.e. all of them
      until backward);
    - ``stage3_max_live_parameters`` two blocks: the block computing and the one prefetched;
    - ``stage3_prefetch_bucket_size`` one block: prefetch one block ahead (default 5e7
      elements, the whole model here).
    ``stage3_param_persistence_threshold`` stays at its default (1e5 elements): DeepSpeed keeps
    tensors smaller than that whole on every rank in both configurations (here the norms and
    biases: 1.2-1.4% of Ψ), a design choice of its own, not a gathering schedule.
    """
    zero: dict[str, Any] = {"stage": 3}
    if per_layer:
        b = num_params(size) // SIZES[size][0]  # one block
        zero.update(stage3_max_reuse_distance=0, stage3_max_live_parameters=2 * b,
                    stage3_prefetch_bucket_size=b)
    return {
        "train_micro_batch_size_per_gpu": batch_shape(size)[0],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                  "eps": ADAMW["eps"],
                                                  "weight_decay": ADAMW["weight_decay"]}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


# -- the engines, on a rank -----------------------------------------------------------------------

class _Engine:
    """One engine on one rank: ``forward`` (returns the output), ``backward``, ``step``."""

    optimizer_kind: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, zero_grad: bool) -> None:
        self.optimizer.step()
        if zero_grad:
            self.optimizer.zero_grad()

    def comm_seconds(self) -> dict[str, float]:
        """Seconds spent in communication so far, by kind (zerocore only)."""
        return {}

    def model_state(self) -> dict[str, int] | None:
        return None


class _Zerocore(_Engine):
    def __init__(self, size: str, keep_last: bool = True, offload: bool = False,
                 comm: dict[str, Any] | None = None, compile: bool = False) -> None:
        import zerocore

        # Only the options a run asks for: "zerocore-before" may be a checkout older than
        # some of them (compile=, say).
        options = {"compile": zerocore.Compile()} if compile else {}
        self.model = zerocore.shard(make_layers(size),
                                    prefetch=zerocore.Prefetch(keep_last=keep_last),
                                    offload=zerocore.Offload(optimizer=offload),
                                    comm=zerocore.Comm(**(comm or {})), **options)
        self.optimizer = zerocore.optim.AdamW(self.model.parameters(), **ADAMW)
        self.optimizer_kind = "zerocore.optim.AdamW (fused kernel)"

    def comm_seconds(self) -> dict[str, float]:
        c = self.model.counter
        return {k: getattr(c, k, 0.0) for k in ("gather_issue_s", "gather_wait_s",
                                                 "reduce_issue_s", "reduce_wait_s")}

    def model_state(self) -> dict[str, int]:
        r = self.model.memory_report(self.optimizer)
        return dict(params=r.param_bytes + r.master_bytes, grads=r.grad_bytes,
                    optimizer=r.optimizer_bytes)


class _Fsdp2(_Engine):
    def __init__(self, size: str, compile: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        layers = make_layers(size)
        if compile:
            # torchtitan's order: each block compiled, then sharded (FSDP2's hooks stay
            # outside the compiled forward).
            layers = [torch.compile(layer, fullgraph=True) for layer in layers]
        self.model = nn.Sequential(*layers)
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        try:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW, fused=True)
            self.optimizer_kind = "torch.optim.AdamW(fused=True)"
        except (RuntimeError, TypeError, NotImplementedError):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW, foreach=True)
            self.optimizer_kind = "torch.optim.AdamW(foreach=True)"

    def model_state(self) -> dict[str, int]:
        params = list(self.model.parameters())
        opt = sum(_local_bytes(v) for st in self.optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)  # not the scalar step count
        return dict(params=sum(_local_bytes(p) for p in params),
                    grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                    optimizer=opt)


class _Unsharded(_Engine):
    def __init__(self, size: str) -> None:
        self.model = nn.Sequential(*make_layers(size))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **ADAMW, fused=True)
        self.optimizer_kind = "torch.optim.AdamW(fused=True), 1 process"

    def model_state(self) -> dict[str, int]:
        params = list(self.model.parameters())
        opt = sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                  for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return dict(params=sum(p.numel() * 4 for p in params),
                    grads=sum(p.grad.numel() * 4 for p in params if p.grad is not None),
                    optimizer=opt)


class _DeepSpeed(_Engine):
    def __init__(self, size: str, per_layer: bool) -> None:
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines, every step
        model = nn.Sequential(*make_layers(size))
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            config=deepspeed_config(size, per_layer))
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        self.optimizer_kind = f"DeepSpeed {deepspeed.__version__} {type(inner).__name__}"

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)

    def step(self, zero_grad: bool) -> None:
        # DeepSpeed's step zeroes the gradients itself; its gradient buffer is allocated once.
        self.model.step()

    def model_state(self) -> dict[str, int] | None:
        """DeepSpeed's ZeRO-3 optimizer's own buffers: the flat parameter partitions (in fp32
        also its masters), the flat fp32 gradient partitions, Adam's moments."""
        opt = self.optimizer
        try:
            params = sum(t.numel() * t.element_size() for t in opt.fp16_partitioned_groups_flat)
            masters = sum(t.numel() * t.element_size() for t in opt.fp32_partitioned_groups_flat
                          if not any(t is p for p in opt.fp16_partitioned_groups_flat))
            grads = opt.grad_partitions_flat_buffer
            moments = sum(v.numel() * v.element_size() for st in opt.optimizer.state.values()
                          for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        except AttributeError:  # another DeepSpeed version's internals
            return None
        return dict(params=params + masters, grads=grads.numel() * grads.element_size(),
                    optimizer=moments)


def _make_engine(engine_name: str, size: str) -> _Engine:
    if engine_name in ZEROCORE_VARIANTS:
        return _Zerocore(size, **ZEROCORE_VARIANTS[engine_name])
    if engine_name in ("fsdp2", "fsdp2-compiled"):
        return _Fsdp2(size, compile=engine_name == "fsdp2-compiled")
    if engine_name == "unsharded":
        return _Unsharded(size)
    if engine_name in ("deepspeed", "deepspeed-per-layer"):
        return _DeepSpeed(size, per_layer=engine_name == "deepspeed-per-layer")
    raise ValueError(f"unknown engine {engine_name!r}; known: {ALL_ENGINES}")


def _world_size(engine_name: str) -> int:
    return 1 if engine_name == "unsharded" else WORLD_SIZE


def _rank_batches(engine_name: str, rank: int, size: str
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if engine_name != "unsharded":
        return _batches(rank, size)
    # One process doing both ranks' work: their batches side by side, batch i of each.
    every = [_batches(r, size) for r in range(WORLD_SIZE)]
    return [(torch.cat([b[i][0] for b in every]), torch.cat([b[i][1] for b in every]))
            for i in range(BATCHES)]


PHASES = ("forward_s", "backward_s", "optimizer_s")


def _train_step(engine: _Engine, batch: tuple[torch.Tensor, torch.Tensor],
                zero_grad: bool = True) -> tuple[float, dict[str, float]]:
    """One step; returns the loss and the seconds of each phase, and of each kind of
    communication within forward and backward (zerocore)."""
    x, y = batch
    c0 = engine.comm_seconds()
    t0 = time.perf_counter()
    loss = nn.functional.mse_loss(engine.forward(x), y)
    t1 = time.perf_counter()
    c1 = engine.comm_seconds()
    engine.backward(loss)
    t2 = time.perf_counter()
    c2 = engine.comm_seconds()
    engine.step(zero_grad)
    t3 = time.perf_counter()
    phases = dict(forward_s=t1 - t0, backward_s=t2 - t1, optimizer_s=t3 - t2)
    for k in c0:
        phases[f"forward_{k}"] = c1[k] - c0[k]
        phases[f"backward_{k}"] = c2[k] - c1[k]
    return loss.item(), phases


def _cpu_s() -> float:
    """CPU seconds this process used so far, all its threads (gloo's included), to the µs."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank_main(rank: int, world_size: int, engine_name: str, size: str, port: int,
               zerocore_path: str | None, conn: Any) -> None:
    """One rank: join the group, build the engine, then answer the parent's commands."""
    try:
        if zerocore_path is not None:  # zerocore-before: the engine of another checkout
            sys.path.insert(0, zerocore_path)
        # One compute thread: two ranks on two cores would only contend with more. The
        # unsharded process does one core's work too (both ranks' batches, one after the other).
        # DeepSpeed picks its accelerator from DS_ACCELERATOR, and joins the existing group from
        # the rank variables join_gloo sets.
        harness.join_gloo(rank, world_size, port, timeout_s=STEP_TIMEOUT_S,
                          env=dict(DS_ACCELERATOR="cpu") if engine_name.startswith("deepspeed")
                          else None)
        # Every engine's code is loaded before the baseline RSS is read, so it is alike for all
        # (DeepSpeed only in its own runs: it is optional).
        from torch.distributed import fsdp  # noqa: F401
        import zerocore

        if zerocore_path is not None:
            assert zerocore.__file__.startswith(os.path.abspath(zerocore_path)), zerocore.__file__
        if engine_name.startswith("deepspeed"):
            import deepspeed  # noqa: F401

        base_rss_kib = harness.status_kib("VmRSS")
        engine = _make_engine(engine_name, size)
        batches = _rank_batches(engine_name, rank, size)
        gc.collect()  # the unsharded model built above is gone: measure training from here
        hwm_reset = harness.reset_peak_rss()
        conn.send(("ok", (engine.optimizer_kind, _cpu_s())))
        step = 0
        while True:
            command = conn.recv()
            if command == "stop":
                break
            if command == "step":
                t0, c0 = time.perf_counter(), _cpu_s()
                loss, phases = _train_step(engine, batches[step % BATCHES])
                conn.send(("ok", (time.perf_counter() - t0, _cpu_s() - c0, loss, phases)))
            elif command == "report":
                cpu_s = _cpu_s()  # before the extra step: the parent's load window ends here
                # One more (untimed) step, measured before zero_grad frees the gradient shards.
                loss, _ = _train_step(engine, batches[step % BATCHES], zero_grad=False)
                state = engine.model_state()
                if hasattr(engine.optimizer, "zero_grad"):
                    engine.optimizer.zero_grad()
                conn.send(("ok", dict(state=state, loss=loss, cpu_s=cpu_s,
                                      base_rss_kib=base_rss_kib,
                                      maxrss_kib=resource.getrusage(
                                          resource.RUSAGE_SELF).ru_maxrss,
                                      train_hwm_kib=(harness.status_kib("VmHWM")
                                                     if hwm_reset else None))))
            step += 1
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    dist.barrier()
    dist.destroy_process_group()


# -- the parent: ranks driven step by step --------------------------------------------------------

class Ranks:
    """The ranks running one engine at one size; ``step()`` runs one training step on all."""

    def __init__(self, engine: str, size: str, zerocore_path: str | None = None):
        self.engine = engine
        ctx = mp.get_context("spawn")
        port = harness.free_port()
        world = _world_size(engine)
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main,
                            args=(rank, world, engine, size, port, zerocore_path, child),
                            daemon=True, name=f"bench-{engine}-{size}-rank{rank}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        started = self._collect(START_TIMEOUT_S, "start")
        self.optimizer_kind = started[0][0]
        self.rank_cpu0 = [cpu for _, cpu in started]
        self.step_times: list[list[float]] = []  # per step, per rank: seconds
        self.step_cpu: list[list[float]] = []    # per step, per rank: CPU seconds
        self.losses: list[list[float]] = []      # per step, per rank
        self.phases: list[list[dict[str, float]]] = []  # per step, per rank
        self.wall0, self.busy0 = time.monotonic(), harness.machine_busy_s()
        self.parent_cpu0 = sum(os.times()[:2])

    def _collect(self, timeout: float, what: str) -> list[Any]:
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                self.close()
                raise RuntimeError(f"{self.engine} rank {rank}: no answer to '{what}' within "
                                   f"{timeout:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", "the process died (see its traceback above)"
            if status != "ok":
                self.close()
                raise RuntimeError(f"{self.engine} rank {rank} failed during '{what}':\n{value}")
            answers.append(value)
        return answers

    def _command(self, command: str, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send(command)
        return self._collect(timeout, command)

    def step(self) -> None:
        answers = self._command("step", STEP_TIMEOUT_S)
        self.step_times.append([a[0] for a in answers])
        self.step_cpu.append([a[1] for a in answers])
        self.losses.append([a[2] for a in answers])
        self.phases.append([a[3] for a in answers])

    def report(self) -> list[dict[str, Any]]:
        wall = time.monotonic() - self.wall0
        busy = harness.machine_busy_s()
        parent_cpu = sum(os.times()[:2]) - self.parent_cpu0
        reports = self._command("report", STEP_TIMEOUT_S)
        if busy is not None and self.busy0 is not None:
            ours = parent_cpu + sum(r["cpu_s"] - c0 for r, c0 in zip(reports, self.rank_cpu0))
            self.other_load = max(busy - self.busy0 - ours, 0.0) / wall
        else:
            self.other_load = None
        return reports

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send("stop")
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(30.0)
            if p.is_alive():
                p.terminate()
                p.join(5.0)


@dataclasses.dataclass
class EngineResult:
    engine: str
    size: str
    optimizer_kind: str
    step_s: list[float]           # per timed step: the slower rank's in-rank time
    step_cpu_s: list[float]       # per timed step: CPU seconds, mean over ranks
    losses: list[list[float]]     # per step (warm-up included), per rank
    # per timed step: the slower rank's phases (forward, backward, optimizer, communication)
    phases: list[dict[str, float]]
    reports: list[dict[str, Any]]  # per rank
    benchmark_median_s: float | None
    other_load: float | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.step_cpu_s)

    def mean_phase(self, key: str) -> float:
        return statistics.fmean(p.get(key, 0.0) for p in self.phases)

    def mean_losses(self) -> list[float]:
        """Per step, the loss over the global batch (the mean of the ranks' equal-size ones)."""
        return [statistics.fmean(per_rank) for per_rank in self.losses]

    @property
    def peak_train_rss_kib(self) -> int | None:
        values = [r["train_hwm_kib"] for r in self.reports]
        return None if None in values else max(values)


def loss_difference(a: EngineResult, b: EngineResult) -> float:
    """Largest relative difference of two engines' losses over the steps both ran: per rank
    when both ran the same ranks, else of the global-batch losses."""
    n = min(len(a.losses), len(b.losses))
    if len(a.losses[0]) == len(b.losses[0]):
        pairs = [(x, y) for i in range(n) for x, y in zip(a.losses[i], b.losses[i])]
    else:
        pairs = list(zip(a.mean_losses()[:n], b.mean_losses()[:n]))
    return max(abs(x - y) / abs(y) for x, y in pairs)


class _SummaryPlugin:
    """Prints the comparison tables at the end of the run, next to pytest-benchmark's table
    (registered by the ``results`` fixture: a test module cannot define hooks itself)."""

    def __init__(self, found: dict[tuple[str, str], EngineResult]):
        self.found = found

    def pytest_terminal_summary(self, terminalreporter):
        if self.found:
            terminalreporter.section("zerocore vs FSDP2 vs DeepSpeed: training step, 2 gloo "
                                     "ranks on CPU, fp32")
            for line in summary_lines(self.found):
                terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def results(request):
    """The engines' results by (size, engine), filled by the tests, printed at the end."""
    found: dict[tuple[str, str], EngineResult] = {}
    request.config.pluginmanager.register(_SummaryPlugin(found), "zerocore-bench-fsdp-summary")
    return found


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _per_rank(values: list[str]) -> str:
    return " / ".join(values)


def _ratio(a: EngineResult | None, b: EngineResult | None) -> str:
    return "-" if a is None or b is None else f"{a.median_s / b.median_s:.3f}"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _size_lines(size: str, engines: list[EngineResult]) -> list[str]:
    depth, width = SIZES[size]
    psi = num_params(size)
    predicted = STATE_BYTES_PER_PARAM * psi // WORLD_SIZE
    by_name = {r.engine: r for r in engines}
    fsdp2, ds_layer, single = (by_name.get(n) for n in ("fsdp2", "deepspeed-per-layer",
                                                         "unsharded"))
    what = (f"GPT-NeoX blocks from neox (hidden {width}, {NEOX_HEADS} heads, MLP {4 * width})"
            if size in NEOX_SEQ else f"residual MLP blocks {width}->{4 * width}->{width}")
    rows, seq = batch_shape(size)
    lines = [f"### {size}: {depth} {what}, Ψ = {psi:,} fp32 parameters",
             "",
             f"Batch {rows}x{seq} tokens per rank (the unsharded process: both ranks' "
             f"batches); {WARMUP} warm-up + {STEPS} timed steps; 1 thread per process; 'a / b' "
             f"is rank 0 / rank 1.",
             "",
             "| engine | optimizer | step ms, median (slower rank) | min | pytest-benchmark "
             "median ms | CPU ms per step and rank | / FSDP2 | / DeepSpeed per layer | "
             "/ unsharded | other load (cores) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in engines:
        bench = "-" if r.benchmark_median_s is None else _ms(r.benchmark_median_s)
        load = "-" if r.other_load is None else f"{r.other_load:.2f}"
        lines.append(f"| {r.engine} | {r.optimizer_kind} | {_ms(r.median_s)} | "
                     f"{_ms(min(r.step_s))} | {bench} | {_ms(r.median_cpu_s)} | "
                     f"{_ratio(r, fsdp2)} | {_ratio(r, ds_layer)} | {_ratio(r, single)} | "
                     f"{load} |")
    lines += ["",
              "| engine | model state MiB per rank (params + grads + optimizer) | 16Ψ/N MiB | "
              "measured / predicted | RSS MiB before the model | peak RSS MiB, process | "
              "peak RSS MiB, training |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in engines:
        reps = r.reports
        if all(rep["state"] for rep in reps):
            states = [sum(rep["state"].values()) for rep in reps]
            parts = _per_rank([f"{_mib(s)} ({_mib(rep['state']['params'])} + "
                               f"{_mib(rep['state']['grads'])} + "
                               f"{_mib(rep['state']['optimizer'])})"
                               for s, rep in zip(states, reps)])
            ratio = _per_rank([f"{s / predicted:.4f}" for s in states])
        else:
            parts = ratio = "-"
        base = _per_rank([_mib(rep["base_rss_kib"] * 1024) for rep in reps])
        rss = _per_rank([_mib(rep["maxrss_kib"] * 1024) for rep in reps])
        hwm = _per_rank([_mib(rep["train_hwm_kib"] and rep["train_hwm_kib"] * 1024)
                         for rep in reps])
        lines.append(f"| {r.engine} | {parts} | {_mib(predicted)} | {ratio} | {base} | {rss} | "
                     f"{hwm} |")
    lines += ["", "Where a step's time goes, ms, mean over the timed steps of the slower rank:",
              "",
              "| engine | step | forward compute | backward compute | waiting on all-gathers | "
              "waiting on reductions | issuing (own shard, packing gradients) | optimizer | "
              "other |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in engines:
        step = statistics.fmean(r.step_s)
        fwd, bwd, opt = (r.mean_phase(k) for k in PHASES)
        has_comm = any("forward_gather_wait_s" in p for p in r.phases)
        if has_comm:
            f_wait = r.mean_phase("forward_gather_wait_s")
            b_wait = r.mean_phase("backward_gather_wait_s")
            red_wait = r.mean_phase("backward_reduce_wait_s") + r.mean_phase(
                "forward_reduce_wait_s")
            issue = sum(r.mean_phase(f"{ph}_{k}") for ph in ("forward", "backward")
                        for k in ("gather_issue_s", "reduce_issue_s"))
            f_issue = r.mean_phase("forward_gather_issue_s")
            fc = fwd - f_wait - f_issue
            bc = bwd - b_wait - red_wait - (issue - f_issue)
            cells = [_ms(fc), _ms(bc), _ms(f_wait + b_wait), _ms(red_wait), _ms(issue)]
        else:
            cells = [f"{_ms(fwd)} (with its communication)",
                     f"{_ms(bwd)} (with its communication)", "-", "-", "-"]
        lines.append(f"| {r.engine} | {_ms(step)} | " + " | ".join(cells) +
                     f" | {_ms(opt)} | {_ms(step - fwd - bwd - opt)} |")
    reference = engines[0]
    lines += ["", f"Largest relative difference of the losses from {reference.engine}'s "
                  f"(per rank; against the unsharded process, of the global batch's loss): " +
              ", ".join(f"{r.engine} {loss_difference(r, reference):.2e}"
                        for r in engines[1:])]
    return lines


def summary_lines(found: dict[tuple[str, str], EngineResult]) -> list[str]:
    sizes = [s for s in SIZES if any(k[0] == s for k in found)]
    lines: list[str] = []
    overview = ["| workload | Ψ | zerocore / FSDP2 | zerocore / DeepSpeed defaults | "
                "zerocore / DeepSpeed per layer | zerocore / unsharded (perfect 2-way = 0.50) | "
                "peak training RSS MiB, max over ranks: zerocore, FSDP2, DeepSpeed defaults, "
                "per layer, unsharded |",
                "|---|---:|---:|---:|---:|---:|---|"]
    for size in sizes:
        engines = [r for (s, _), r in found.items() if s == size]
        lines += _size_lines(size, engines) + [""]
        by = {r.engine: r for r in engines}
        z = by.get("zerocore")
        rss = ", ".join(_mib(by[n].peak_train_rss_kib and by[n].peak_train_rss_kib * 1024)
                        if n in by else "-"
                        for n in ("zerocore", "fsdp2", "deepspeed", "deepspeed-per-layer",
                                  "unsharded"))
        overview.append(f"| {size} | {num_params(size):,} | {_ratio(z, by.get('fsdp2'))} | "
                        f"{_ratio(z, by.get('deepspeed'))} | "
                        f"{_ratio(z, by.get('deepspeed-per-layer'))} | "
                        f"{_ratio(z, by.get('unsharded'))} | {rss} |")
    if {"zerocore-compiled", "fsdp2-compiled"} & {k[1] for k in found}:
        overview += ["", "| workload | zerocore ms | zerocore-compiled ms | fsdp2-compiled ms | "
                         "compiled / eager zerocore | zerocore-compiled / fsdp2-compiled |",
                     "|---|---:|---:|---:|---:|---:|"]
        for size in sizes:
            z, zc, fc = (found.get((size, n)) for n in ("zerocore", "zerocore-compiled",
                                                         "fsdp2-compiled"))
            cells = ["-" if r is None else _ms(r.median_s) for r in (z, zc, fc)]
            overview.append(f"| {size} | " + " | ".join(cells) +
                            f" | {_ratio(zc, z)} | {_ratio(zc, fc)} |")
    if "zerocore-before" in {k[1] for k in found}:
        overview += ["", "| workload | zerocore-before ms | zerocore ms | after / before |",
                     "|---|---:|---:|---:|"]
        for size in sizes:
            a, b = found.get((size, "zerocore")), found.get((size, "zerocore-before"))
            if a and b:
                overview.append(f"| {size} | {_ms(b.median_s)} | {_ms(a.median_s)} | "
                                f"{_ratio(a, b)} |")
    return lines + ["### All sizes: step time ratios (medians of the slower rank)", ""] + overview


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        sizes = metafunc.config.getoption("--sizes").split(",")
        engines = metafunc.config.getoption("--engines").split(",")
        for name in sizes:
            if name not in SIZES:
                raise pytest.UsageError(f"--sizes: unknown size {name!r}; known: {list(SIZES)}")
        for name in engines:
            if name not in ALL_ENGINES:
                raise pytest.UsageError(f"--engines: unknown engine {name!r}; known: "
                                        f"{ALL_ENGINES}")
        cases = [(s, e) for s in sizes for e in engines]
        metafunc.parametrize("case", cases, ids=[f"{s}-{e}" for s, e in cases])


def test_training_step(benchmark, results, request, case):
    size, engine = case
    if engine.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip(f"DeepSpeed is not installed; to include it: {DEEPSPEED_INSTALL}")
    zerocore_path = None
    if engine == "zerocore-before":
        zerocore_path = request.config.getoption("--zerocore-before")
        if not zerocore_path:
            pytest.skip("zerocore-before needs --zerocore-before PATH (a checkout whose "
                        "zerocore/ has its _C built)")
    benchmark.group = f"training step, {size}, 2 gloo ranks, CPU, fp32"
    benchmark.name = f"training step :: {size} :: {engine}"
    ranks = Ranks(engine, size, zerocore_path)
    try:
        benchmark.pedantic(ranks.step, rounds=STEPS, warmup_rounds=WARMUP, iterations=1)
        reports = ranks.report()
    finally:
        ranks.close()
    timed = range(len(ranks.step_times) - STEPS, len(ranks.step_times))
    slower = [max(range(len(ranks.step_times[i])), key=lambda r: ranks.step_times[i][r])
              for i in timed]
    stats = benchmark.stats
    result = EngineResult(engine, size, ranks.optimizer_kind,
                          [ranks.step_times[i][r] for i, r in zip(timed, slower)],
                          [statistics.fmean(ranks.step_cpu[i]) for i in timed],
                          ranks.losses + [[rep["loss"] for rep in reports]],
                          [ranks.phases[i][r] for i, r in zip(timed, slower)],
                          reports, stats.stats.median if stats is not None else None,
                          ranks.other_load)
    reference = next((r for (s, _), r in results.items() if s == size), None)
    results[(size, engine)] = result
    benchmark.extra_info.update(
        optimizer=result.optimizer_kind,
        in_rank_median_ms=round(1e3 * result.median_s, 2),
        cpu_per_step_median_ms=round(1e3 * result.median_cpu_s, 2),
        peak_rss_kib=[rep["maxrss_kib"] for rep in reports],
        training_peak_rss_kib=[rep["train_hwm_kib"] for rep in reports],
        other_load_cores=result.other_load)
    if reference is not None:
        diff = loss_difference(result, reference)
        assert diff <= LOSS_RTOL, (f"{engine} at {size} trained differently from "
                                   f"{reference.engine}: losses differ by {diff:.2e} (relative)")
