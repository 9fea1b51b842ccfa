"""Training runs of the hybrid layouts (a 2-D CPU ``DeviceMesh`` (replicate, shard) over gloo
ranks: HSDP, hpZ), for tests/engine/test_hsdp.py and test_hpz.py: the small transformer of
toy_stack.py through either front door, with two micro-batches per step and gradient clipping,
and the unsharded model it must train as (one process, ``torch.optim.AdamW`` and
``clip_grad_norm_`` on the whole global batch).

``train_hybrid`` runs on a rank of a gloo World (tests/support/dist_utils.py); ``Case`` says
what one run does, and how far from the reference it may end.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from zerocore.comm.collectives import CommCounter
from zerocore.comm.quantized_reduce import all_reduce_int8, reduce_scatter_int8
from tests.support.quantized_base import FORMATS, dequantized
from tests.support.toy_stack import (LOCAL_BATCH, LR, SEQ, WEIGHT_DECAY, Spec, assert_trains_as,
                                     global_batch, loss_fn, make_layers)

STEPS = 3
MICRO = 2
# Small enough that every step clips (the transformer's gradient norm starts near 3 and stays
# above 1 over these steps: checked), so clipping's all-reduced norm is exercised.
MAX_NORM = 0.5
# The same with the biases alone trained (their norm is 0.11 to 0.13 over these steps).
BIASES_MAX_NORM = 0.05
DOORS = ("shard", "shard_model")


@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple[int, int]         # (replicas, shards)
    param_dtype: torch.dtype
    layout: str = "hsdp"           # zerocore.Hybrid's layout
    offload: bool = False          # Offload(optimizer=True): masters and gradients on the host
    offload_params: bool = False   # Offload(params=True): the shards gathered from on the host
    train: str = "all"             # toy_stack.Spec.train
    frozen_int8: bool = False      # FrozenWeights("int8")
    # FrozenWeights(dtype, placement=...) with quantized_base's block, and the reference given
    # the same dequantized frozen weights (so fp32's bounds hold); None: as frozen_int8 says.
    frozen: tuple[str, str] | None = None
    loss_scaling: bool = False     # fp16: LossScaler(dynamic=True)
    recompute: bool = False        # Recompute(): every layer (shard) or block (shard_model)
    keep_gathered: int = 0         # Prefetch.keep_gathered, bytes
    ways: tuple[str, str] = ("auto", "auto")  # Comm(gather=..., reduce=...)
    doors: tuple[str, ...] = DOORS
    # fp32 (losses, clipped norms: relative; weights: absolute): the sum over ranks runs in
    # another order than one process's backward (here in two stages, the shard group then the
    # replicas or the nodes), and zerocore's fused AdamW matches torch's to a few ulps a step.
    # Measured: at most 1.4e-7 on the losses, 9e-8 on the norms, 4.7e-6 on the weights (HSDP
    # 2x2; 2.6e-7 for the others), as test_shard.py's PARAM_TOL explains: an element whose
    # gradient nearly cancels turns rounding noise into a fraction of lr. 2e-5 (2e-3 lr,
    # test_shard's bound) is 4x that, while a missed micro-batch, a gradient divided by the
    # shards alone (2x) or a replica that skipped its update (lr) is far outside.
    # bf16 compute (2^-9 relative per operation) against the fp32 reference, as the
    # front-door table's bf16 row (bounds 1e-2 on losses and norms, 0.15 on the whole update
    # ||w - w_ref|| / ||w_ref - w_init||); measured here 2.1e-3, 1.2e-3 and 0.036.
    loss_rtol: float = 1e-5
    weight_atol: float = 2e-5
    update_rtol: float | None = None


FP32 = dict(param_dtype=torch.float32)
BF16 = dict(param_dtype=torch.bfloat16, loss_rtol=1e-2, update_rtol=0.15)


def spec_of(case: Case) -> Spec:
    return Spec(model="transformer", steps=STEPS, micro=MICRO, max_norm=max_norm_of(case),
                param_dtype=case.param_dtype, train=case.train)


def max_norm_of(case: Case) -> float:
    return BIASES_MAX_NORM if case.train == "biases" else MAX_NORM


def mesh_of(shape: tuple[int, int]):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def build(door: str, case: Case, mesh) -> tuple[nn.Module, zerocore.ShardedSequential]:
    """(the callable model, its sharding) through a front door: ``shard`` takes the four
    layers, ``shard_model`` an ``nn.Sequential`` of them with the blocks as units (the root
    holds the embedding and the readout)."""
    layers = make_layers(spec_of(case))
    policies = policies_of(case, mesh)
    if door == "shard":
        model = zerocore.shard(layers, **policies)
        return model, model
    model = nn.Sequential(*layers)
    return model, zerocore.shard_model(model, [model[1], model[2]], **policies)


def policies_of(case: Case, mesh=None) -> dict:
    """The front doors' keywords for ``case`` (``mesh``: its DeviceMesh)."""
    policies = dict(
        mesh=mesh, mixed_precision=zerocore.MixedPrecision(case.param_dtype),
        offload=zerocore.Offload(optimizer=case.offload, params=case.offload_params),
        frozen_weights=frozen_weights_of(case),
        recompute=zerocore.Recompute() if case.recompute else None,
        prefetch=zerocore.Prefetch(keep_gathered=case.keep_gathered),
        comm=zerocore.Comm(gather=case.ways[0], reduce=case.ways[1]))
    if case.layout != "hsdp":  # HSDP by default: a 2-D mesh alone
        policies["hybrid"] = zerocore.Hybrid(case.layout)
    return policies


def frozen_weights_of(case: Case) -> zerocore.FrozenWeights:
    if case.frozen is not None:
        dtype, placement = case.frozen
        return zerocore.FrozenWeights(dtype, block=FORMATS[dtype], placement=placement)
    return zerocore.FrozenWeights("int8" if case.frozen_int8 else None)


def train_hybrid(rank: int, world_size: int, door: str, case: Case) -> dict:
    """STEPS steps of MICRO micro-batches (the first with ``set_requires_all_reduce(False)``)
    and clipping; what the checks read: losses, norms, the trained weights, this rank's shards,
    the collectives' counts (the replicas' all-reduces of the early micro-batches, the
    replicate group's gathers in each forward and backward) and ``comm_report``."""
    spec = spec_of(case)
    model, sharding = build(door, case, mesh_of(case.shape))
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = zerocore.LossScaler(sharding.group, dynamic=case.loss_scaling,
                                 policy=zerocore.LossScaling(init_scale=2.0**10))
    sharding.comm_report(reset=True)
    counter = sharding.counter
    losses, norms, early_calls, forward_across, backward_across = [], [], [], [], []
    for step in range(STEPS):
        for m in range(MICRO):
            last = m == MICRO - 1
            sharding.set_requires_all_reduce(last)
            before = counter.replica_all_reduce_calls
            x, y = global_batch(spec, step, m, world_size)  # every rank's rows; this one's
            gathers = counter.replicate_all_gather_calls
            loss = loss_fn(spec, model(x.chunk(world_size)[rank]),
                           y.chunk(world_size)[rank]) / MICRO
            forward_across.append(counter.replicate_all_gather_calls - gathers)
            if step == m == 0:
                memory = sharding.memory_report(opt)  # between the passes
            gathers = counter.replicate_all_gather_calls
            scaler.scale(loss).backward()
            backward_across.append(counter.replicate_all_gather_calls - gathers)
            if not last:
                early_calls.append(counter.replica_all_reduce_calls - before)
            losses.append(loss.item())
        result = scaler.step(opt, max_norm=max_norm_of(case))
        assert not result.skipped
        norms.append(result.grad_norm)
        opt.zero_grad()
    report = sharding.comm_report()
    weights = {sharding.param_name(i, n): t
               for i, state in sharding.iter_full_states(trainable_only=True)
               for n, t in state.items()}
    exported = {sharding.param_name(i, n): t  # gathered to rank 0 of ``sharding.group`` alone
                for i, state in sharding.iter_full_states(trainable_only=True, to_rank=0)
                for n, t in state.items()}
    shards = [(s.detach().clone(), None if s.model_copy is None else s.model_copy.clone())
              for s in sharding.trainable_shards()]
    trainable = [l.trainable.layout for l in sharding.layers if l.trainable is not None]
    return dict(losses=losses, norms=norms, weights=weights, exported=exported, shards=shards,
                early_calls=early_calls, report=report, memory=memory,
                replica_calls=counter.replica_all_reduce_calls,
                forward_across=forward_across, backward_across=backward_across,
                group=(sharding.rank, sharding.world_size),
                padded=[lay.padded_numel for lay in trainable],
                ways=sharding.ways.line())


def plan_of(door: str, case: Case) -> zerocore.plan.MemoryPlan:
    """``zerocore.plan`` (``plan_model`` for ``shard_model``) of ``build``'s model on the
    case's mesh, with its policies, for one rank's micro-batch."""
    with torch.device("meta"):
        layers = make_layers(spec_of(case))
    example = torch.zeros(LOCAL_BATCH, SEQ, dtype=torch.int64, device="meta")
    policies = policies_of(case)
    del policies["mesh"]
    policies.update(world_size=case.shape[0] * case.shape[1], mesh=case.shape, device="cpu",
                    micro_batches=MICRO)
    if door == "shard":
        return zerocore.plan.plan(layers, example, **policies)
    model = nn.Sequential(*layers)
    return zerocore.plan.plan_model(model, [model[1], model[2]], example, **policies)


def train_unsharded(case: Case, world_size: int) -> dict:
    """The same model, one process, fp32, torch.optim.AdamW and clip_grad_norm_, on the whole
    global batch of each micro-batch (each rank's rows a slice of it: the mean of the ranks'
    losses is its loss, and the averaged gradients its gradient)."""
    spec = dataclasses.replace(spec_of(case), param_dtype=torch.float32)
    model = nn.Sequential(*make_layers(spec))
    if case.frozen is not None:
        model = dequantized(model, case.frozen[0], FORMATS[case.frozen[0]])
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(STEPS):
        for m in range(MICRO):
            x, y = global_batch(spec, step, m, world_size)
            with torch.no_grad():
                losses.append([loss_fn(spec, model(xr), yr).item() / MICRO
                               for xr, yr in zip(x.chunk(world_size), y.chunk(world_size))])
            (loss_fn(spec, model(x), y) / MICRO).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], max_norm_of(case)).item())
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return dict(losses=losses, norms=norms, weights=weights, init=init)


def check_against_reference(case: Case, got: list[dict], want: dict) -> None:
    for rank, out in enumerate(got):
        for i, loss in enumerate(out["losses"]):
            ref = want["losses"][i][rank]
            assert abs(loss - ref) <= case.loss_rtol * abs(ref), (rank, i, loss, ref)
        for n_got, n_ref in zip(out["norms"], want["norms"]):
            assert n_ref > max_norm_of(case)  # every step clipped
            assert abs(n_got - n_ref) <= case.loss_rtol * n_ref, (n_got, n_ref)
        assert_trains_as(out["weights"], want["weights"], want["init"],
                         atol=case.weight_atol, update_rtol=case.update_rtol)


QGZ_STEPS = 20


def train_qgz(rank: int, world_size: int, quantize: bool, dtype: torch.dtype,
              layout: str) -> dict:
    """The 2x2 model (``Hybrid(layout)``) for QGZ_STEPS steps of two micro-batches, exact or
    with the cross-node gradient reduction through int8 (``Comm(quantize_gradients=...)``):
    the mean loss over the ranks each step, this rank's shards, the communication report and
    the trainable groups' layouts."""
    spec = Spec(model="transformer", steps=QGZ_STEPS, micro=MICRO, param_dtype=dtype)
    comm = zerocore.Comm(quantize_gradients="int8" if quantize else None)
    model = zerocore.shard(make_layers(spec), mesh=mesh_of((2, 2)), comm=comm,
                           mixed_precision=zerocore.MixedPrecision(dtype),
                           hybrid=zerocore.Hybrid(layout))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model.comm_report(reset=True)
    losses = mean_losses(model, opt, spec, rank, world_size)
    report = model.comm_report()
    layouts = [l.trainable.layout for l in model.layers if l.trainable is not None]
    return dict(losses=losses, shards=[s.detach().clone() for s in model.trainable_shards()],
                report=report, replica_bytes=report.replica_all_reduce_bytes,
                expected=report.expected_replica_all_reduce_bytes,
                numels=[lay.shard_numel for lay in layouts],
                padded=[lay.padded_numel for lay in layouts])


def run_qgz(world, dtype: torch.dtype, layout: str, loss_rtol: float
            ) -> tuple[list[dict], list[dict]]:
    """``train_qgz`` on ``world`` (4 ranks), exact then quantized; checks that the quantized
    run's mean loss stays within ``loss_rtol`` (relative) of the exact one's at every step,
    that it trained, and that the int8 path ran. Both runs' results, for the callers' checks."""
    exact = world.run(train_qgz, False, dtype, layout, timeout=600)
    quantized = world.run(train_qgz, True, dtype, layout, timeout=600)
    for e, q in zip(exact, quantized):
        rel = [abs(a - b) / a for a, b in zip(e["losses"], q["losses"])]
        assert max(rel) <= loss_rtol, rel
        assert q["losses"][-1] < 0.1 * q["losses"][0]  # it trained
        assert q["losses"] != e["losses"]  # and the int8 path ran
    return exact, quantized


QUANTIZE_BLOCK = 128


def quantized_collective(rank: int, world_size: int, kind: str, numel: int,
                         poison: bool = False) -> dict:
    """qgZ's collective over every rank as the nodes (``kind``: "all_reduce", HSDP's
    ``all_reduce_int8``; "reduce_scatter", hpZ's ``reduce_scatter_int8``), of values whose
    size varies over four decades along the slice (so blocks have different scales);
    ``poison``: rank 1 holds an inf. The values, the result, and what the counter counted."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)
    if poison and rank == 1:
        x[7] = float("inf")
    counter = CommCounter()
    if kind == "all_reduce":
        y = all_reduce_int8(x, dist.group.WORLD, counter, QUANTIZE_BLOCK)
        counted = counter.replica_all_reduce_bytes, counter.replica_all_reduce_calls
    else:
        y = reduce_scatter_int8(x, dist.group.WORLD, counter, QUANTIZE_BLOCK)
        counted = counter.replicate_reduce_scatter_bytes, counter.replicate_reduce_scatter_calls
    return dict(x=x, y=y, nbytes=counted[0], calls=counted[1])


def mean_losses(model, opt, spec: Spec, rank: int, world_size: int) -> list[float]:
    """Trains ``spec.steps`` steps of ``MICRO`` micro-batches (the replicas' all-reduce on the
    last one only); the loss at each step, averaged over the micro-batches and the ranks."""
    losses = []
    for step in range(spec.steps):
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(MICRO):
            model.set_requires_all_reduce(m == MICRO - 1)
            x, y = global_batch(spec, step, m, world_size)
            loss = loss_fn(spec, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses
