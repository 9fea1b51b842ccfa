"""Device handling of ``zerocore.shard``: the default device from the process group's backend, and
the one agreement before anything is allocated (each rank can compute on its device: a CUDA build
of torch, a visible GPU, zerocore's CUDA kernels; no two ranks on one GPU), reported on every rank
with the fix.

All of it runs on the CPU: the checks compare device *descriptions*, which a test can make up by
passing a ``zerocore.Platform`` that says what a GPU machine would (``device=cuda:0`` is then
only a name exchanged between the ranks; nothing is allocated on it).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore.comm import device as zdevice
from zerocore.comm.objects import all_gather_objects, broadcast_objects
from zerocore.engine.offload import cpu_threads
from zerocore.engine.sharded_param import ShardParameter

WORLD_SIZES = [1, 2, 3]


# A GPU machine as the checks see it: a CUDA build of torch, 8 GPUs, zerocore's CUDA kernels.
GPU_HOST = zerocore.Platform(host="gpu-host", torch_cuda="12.4", cuda_device_count=8,
                             kernels_cuda=True, device_uuid=None, usable_cores=64)


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.Linear(8, 8)]


# -- the default device, from the backend ---------------------------------------------------------

@pytest.mark.parametrize("config, want", [
    # What torch 2.13's get_backend_config reports:
    ("cuda:nccl", "cuda:3"),            # init_process_group("nccl"), or no backend on a GPU host
    ("cpu:gloo,cuda:nccl", "cuda:3"),   # the explicit mixed backend
    ("cpu:gloo,cuda:gloo", "cpu"),      # init_process_group("gloo")
    ("cpu:gloo", "cpu"),                # no backend on a CPU host
    ("nccl", "cuda:3"),                 # older torch reports the bare name
    ("gloo", "cpu"),
])
def test_default_device_follows_nccl(config, want):
    backends = zdevice.parse_backend_config(config)
    assert zdevice.default_device(backends, None, lambda: 3) == torch.device(want)


def test_default_device_prefers_the_bound_device():
    """init_process_group(device_id=...) binds the group to a device: that one, whatever the
    current device is."""
    bound = torch.device("cuda", 5)
    assert zdevice.default_device({"cuda": "nccl"}, bound, lambda: 0) == bound


def test_side_channel_only_without_a_cpu_backend():
    assert zdevice.uses_side_channel(zdevice.parse_backend_config("cuda:nccl"))
    assert not zdevice.uses_side_channel(zdevice.parse_backend_config("cpu:gloo,cuda:nccl"))
    assert not zdevice.uses_side_channel(zdevice.parse_backend_config("cpu:gloo,cuda:gloo"))


def default_device_of_world(rank: int, world_size: int) -> dict:
    model = zerocore.shard(layers())
    return {"device": str(model.device), "backends": zdevice.backend_map(dist.group.WORLD)}


def test_gloo_world_computes_on_the_cpu(world):
    for r in world.run(default_device_of_world):
        assert r["device"] == "cpu"
        assert r["backends"].get("cpu") == "gloo"


# -- what one rank can do -------------------------------------------------------------------------

def test_device_problems():
    cuda0 = torch.device("cuda", 0)
    assert zdevice.device_problem(torch.device("cpu"), GPU_HOST) is None
    assert zdevice.device_problem(cuda0, GPU_HOST) is None
    cpu_torch = dataclasses.replace(GPU_HOST, torch_cuda=None, cuda_device_count=0)
    assert "is a CPU build" in zdevice.device_problem(cuda0, cpu_torch)
    hidden = dataclasses.replace(GPU_HOST, cuda_device_count=0)
    assert "sees no CUDA device" in zdevice.device_problem(cuda0, hidden)
    one = dataclasses.replace(GPU_HOST, cuda_device_count=1)
    msg = zdevice.device_problem(torch.device("cuda", 1), one)
    assert "sees 1 CUDA device" in msg and "torch.cuda.set_device(local_rank" in msg
    no_kernels = dataclasses.replace(GPU_HOST, kernels_cuda=False)
    msg = zdevice.device_problem(cuda0, no_kernels)
    assert "built without CUDA kernels" in msg and "pip install --no-build-isolation -e ." in msg
    assert "12.4" in msg  # the toolkit to install: torch's CUDA
    assert "CPU or CUDA" in zdevice.device_problem(torch.device("meta"), GPU_HOST)


def describe(rank, host, device, uuid=None, problem=None):
    return zdevice.RankDevice(rank, host, device, uuid, problem)


def test_placement_problems():
    ok = zdevice.placement_problem
    # One GPU per process, on one host or several; CPU ranks never "share".
    assert ok([describe(0, "a", "cuda:0"), describe(1, "a", "cuda:1")]) is None
    assert ok([describe(0, "a", "cuda:0"), describe(1, "b", "cuda:0")]) is None
    assert ok([describe(0, "a", "cpu"), describe(1, "a", "cpu")]) is None
    # A launcher that sets CUDA_VISIBLE_DEVICES per process: every rank sees its GPU as cuda:0;
    # the UUIDs tell them apart.
    assert ok([describe(0, "a", "cuda:0", "GPU-1"), describe(1, "a", "cuda:0", "GPU-2")]) is None
    # Two ranks on one GPU, by index on one host, or by UUID whatever the indices say.
    msg = ok([describe(0, "a", "cuda:0"), describe(1, "a", "cuda:1"), describe(2, "a", "cuda:0")])
    assert "ranks 0, 2 on host a all compute on the same GPU, cuda:0" in msg
    assert "torch.cuda.set_device(local_rank % torch.cuda.device_count())" in msg
    assert "LOCAL_RANK" in msg
    msg = ok([describe(0, "a", "cuda:0", "GPU-7"), describe(1, "a", "cuda:1", "GPU-7")])
    assert "same GPU, cuda:0 (GPU-7)" in msg
    # A rank that cannot use its device is named first, with the others that cannot either.
    msg = ok([describe(0, "a", "cuda:0"), describe(1, "a", "cuda:1", problem="P1"),
              describe(2, "a", "cuda:2", problem="P2")])
    assert msg == "rank 1: P1 (ranks 1, 2 cannot use their devices)"
    msg = ok([describe(0, "a", "cpu"), describe(1, "a", "cuda:0")])
    assert "different kinds of device (rank 0: cpu, rank 1: cuda:0)" in msg


# -- what the ranks agree on, over gloo -----------------------------------------------------------

def shard_on_described_gpus(rank: int, world_size: int, how: str) -> str | None:
    """zerocore.shard with made-up GPU descriptions; the ValueError's message, or None."""
    platform, device = GPU_HOST, torch.device("cuda", rank)
    if how == "cpu-only-kernels":
        platform = dataclasses.replace(GPU_HOST, kernels_cuda=False)
    elif how == "last-rank-cpu-only-kernels" and rank == world_size - 1:
        platform = dataclasses.replace(GPU_HOST, kernels_cuda=False)
    try:
        zerocore.shard(layers(), device=device, platform=platform)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_on_one_gpu_fail_on_every_rank(world):
    """Every rank on cuda:0 where NCCL moves the CUDA tensors: found from the descriptions,
    before anything touches the device, and raised on every rank with the fix. (This world is
    gloo, whose ranks may share a GPU: NCCL's rule is asked for.)"""
    if world.world_size == 1:
        pytest.skip("one rank cannot share its GPU with another")
    ranks = ", ".join(str(r) for r in range(world.world_size))
    for msg in world.run(agree, False, "all-on-cuda0", True):
        assert msg is not None
        assert f"ranks {ranks} on host gpu-host all compute on the same GPU, cuda:0" in msg
        assert "torch.cuda.set_device(local_rank % torch.cuda.device_count())" in msg
        # set_device is the one advice: device_id= and device= are named as not enough.
        assert "LOCAL_RANK" in msg
        assert "device_id=...) and zerocore.shard(device=...) alone do not set the current" in msg


@pytest.mark.parametrize("how", ["cpu-only-kernels", "last-rank-cpu-only-kernels"])
def test_cpu_only_kernels_fail_at_shard_on_every_rank(world, how):
    """A CPU-only build of zerocore._C on a GPU machine fails in shard(), not inside backward,
    with how to rebuild; also when only one rank's build lacks the kernels (its peers learn of
    it instead of waiting in a collective)."""
    bad = 0 if how == "cpu-only-kernels" else world.world_size - 1
    for msg in world.run(shard_on_described_gpus, how):
        assert msg is not None and msg.startswith(f"zerocore.shard: rank {bad}: "), msg
        assert "built without CUDA kernels" in msg
        assert "pip install --no-build-isolation -e ." in msg


def shard_on_cuda_here(rank: int, world_size: int) -> str | None:
    try:
        zerocore.shard(layers(), device="cuda")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch here is a CUDA build")
def test_cuda_with_cpu_torch_fails_at_shard(world):
    """Nothing made up: this machine's own platform, a CPU build of torch."""
    for msg in world.run(shard_on_cuda_here):
        assert msg is not None and "is a CPU build" in msg, msg


def agree(rank: int, world_size: int, side_channel: bool, how: str,
          one_gpu_each: bool | None = None) -> object:
    device = torch.device("cuda", 0 if how == "all-on-cuda0" else rank)
    platform = GPU_HOST
    if how == "per-process-visible-devices":
        # Each process sees only its own GPU, as cuda:0: told apart by UUID.
        device, platform = torch.device("cuda", 0), dataclasses.replace(
            GPU_HOST, device_uuid=f"GPU-{rank}")
    try:
        return zdevice.agree_on_devices(dist.group.WORLD, device, platform,
                                        side_channel=side_channel, one_gpu_each=one_gpu_each)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("side_channel", [False, True], ids=["group", "gloo-side-group"])
@pytest.mark.parametrize("how", ["one-gpu-each", "per-process-visible-devices"])
def test_agreement_counts_ranks_per_host(world, side_channel, how):
    """Every rank returns the same placement; ranks_on_host (the share of the host's cores a GPU
    rank takes for the CPU optimizer) counts the ranks on this host. Over the group itself, and
    over the gloo side group used when the group has no CPU backend (NCCL alone)."""
    results = world.run(agree, side_channel, how)
    for placement in results:
        assert isinstance(placement, zdevice.Placement), placement
        assert placement == results[0]
        assert placement.ranks_on_host == world.world_size
        assert [r.rank for r in placement.ranks] == list(range(world.world_size))


def agree_again_and_again(rank: int, world_size: int, times: int) -> list[object]:
    return [agree(rank, world_size, True, "one-gpu-each") for _ in range(times)]


def test_the_side_group_serves_call_after_call(world):
    """shard() twice on one NCCL-only group: each call's gloo side group gets a name of its own.
    Destroying one after use let torch give the next the same name and store prefix, whose
    rendezvous read the dead group's addresses (a hang, or "Connection refused" on a rank)."""
    for placements in world.run(agree_again_and_again, 6):
        assert all(isinstance(p, zdevice.Placement) for p in placements), placements
        assert all(p == placements[0] for p in placements)


def test_gloo_ranks_may_share_a_gpu(world):
    """gloo over CUDA tensors has no one-GPU-per-process rule (bench/gpu_check.sh runs two
    ranks on one GPU so): the group's own backend decides."""
    for placement in world.run(agree, False, "all-on-cuda0"):
        assert isinstance(placement, zdevice.Placement), placement
        assert [r.device for r in placement.ranks] == ["cuda:0"] * world.world_size


def test_agreement_over_the_side_group_refuses_a_shared_gpu(world):
    if world.world_size == 1:
        pytest.skip("one rank cannot share its GPU with another")
    for msg in world.run(agree, True, "all-on-cuda0"):
        assert isinstance(msg, str) and "same GPU" in msg


# -- the current device, and where small values travel ------------------------------------------

def test_a_rank_on_another_device_than_its_current_one_gets_one_line():
    cuda3 = torch.device("cuda", 3)
    here = dataclasses.replace(GPU_HOST, current_cuda_index=0)
    line = zdevice.current_device_mismatch(2, cuda3, here, bound=None)
    assert line == ("zerocore.shard: rank 2 computes on cuda:3 (device=) but its current CUDA "
                    "device is cuda:0, where torch and your own code allocate; call "
                    "torch.cuda.set_device(3) before init_process_group")
    assert "(the group's device_id)" in zdevice.current_device_mismatch(2, cuda3, here,
                                                                        bound=cuda3)
    set_ = dataclasses.replace(GPU_HOST, current_cuda_index=3)
    assert zdevice.current_device_mismatch(2, cuda3, set_, bound=cuda3) is None
    assert zdevice.current_device_mismatch(2, torch.device("cpu"), here, bound=None) is None
    assert zdevice.current_device_mismatch(2, cuda3, GPU_HOST, bound=None) is None  # unknown


class Lines(logging.Handler):
    """The messages logged under the ``zerocore`` logger while it is attached."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def shard_with_current_device_0(rank: int, world_size: int) -> dict:
    """Every rank asks for cuda:<rank> (device=) on a machine whose current device is cuda:0
    on every rank (no set_device); kernels without CUDA stop shard() at the agreement, after
    the line, before anything is allocated."""
    platform = dataclasses.replace(GPU_HOST, current_cuda_index=0, kernels_cuda=False)
    lines, error = Lines(), None
    logger = logging.getLogger("zerocore")
    logger.addHandler(lines)
    try:
        zerocore.shard(layers(), device=torch.device("cuda", rank), platform=platform)
    except ValueError as e:
        error = str(e)
    finally:
        logger.removeHandler(lines)
    return dict(lines=lines.lines, error=error)


def test_shard_says_when_the_current_device_differs(world):
    for rank, r in enumerate(world.run(shard_with_current_device_0)):
        want = [] if rank == 0 else [
            f"zerocore.shard: rank {rank} computes on cuda:{rank} (device=) but its current "
            f"CUDA device is cuda:0, where torch and your own code allocate; call "
            f"torch.cuda.set_device({rank}) before init_process_group"]
        assert r["lines"] == want, r
        assert "built without CUDA kernels" in r["error"]


def test_small_values_travel_on_the_device_given():
    """The device of an object collective or of offloaded gradients' statistics: the CPU on a
    group with a CPU backend, else the device the caller passes, else the bound one; the
    current device only when nothing else is known."""
    cpu, cuda3, cuda5 = torch.device("cpu"), torch.device("cuda", 3), torch.device("cuda", 5)
    nccl, mixed = {"cuda": "nccl"}, zdevice.parse_backend_config("cpu:gloo,cuda:nccl")
    gloo = zdevice.parse_backend_config("gloo")

    def never() -> int:
        raise AssertionError("the current device was read")

    choose = zdevice.choose_comm_device
    assert choose(nccl, cpu, cuda3, None, never) == cuda3
    assert choose(nccl, cpu, cuda3, cuda5, never) == cuda3     # the caller's device first
    assert choose(nccl, cpu, None, cuda5, never) == cuda5
    assert choose(nccl, cpu, None, None, lambda: 7) == torch.device("cuda", 7)  # last resort
    assert choose(nccl, cuda3, None, None, never) == cuda3     # tensors already on a GPU
    assert choose(mixed, cpu, cuda3, None, never) == cpu
    assert choose(gloo, cpu, cuda3, None, never) == cpu


def gather_objects(rank: int, world_size: int) -> dict:
    mine = {"rank": rank, "text": "x" * (10 * rank + 1)}  # of different sizes
    every = all_gather_objects(mine, dist.group.WORLD, torch.device("cpu"))
    told = ["from 0" if rank == 0 else None]
    broadcast_objects(told, 0, dist.group.WORLD, torch.device("cpu"))
    # A CUDA device given on a gloo group: the agreement stays on the CPU (there is no GPU).
    agreed = zerocore.run_agreed(lambda: rank, device=torch.device("cuda", rank))
    return dict(every=every, told=told, agreed=agreed)


def test_object_collectives(world):
    n = world.world_size
    for rank, r in enumerate(world.run(gather_objects)):
        assert r["every"] == [{"rank": q, "text": "x" * (10 * q + 1)} for q in range(n)]
        assert r["told"] == ["from 0"] and r["agreed"] == rank


# -- CPU threads of GPU ranks with offload --------------------------------------------------------

def test_offload_cpu_threads():
    # 8 GPU ranks on a 64-core host that torch would give 32 threads each: 8 each.
    assert cpu_threads(None, usable_cores=64, ranks_on_host=8, current=32) == 8
    # Never more than torch (or the user) chose already, never fewer than one.
    assert cpu_threads(None, usable_cores=64, ranks_on_host=2, current=4) == 4
    assert cpu_threads(None, usable_cores=4, ranks_on_host=8, current=4) == 1
    # An explicit number is taken as it is.
    assert cpu_threads(12, usable_cores=64, ranks_on_host=8, current=32) == 12
    with pytest.raises(ValueError, match="cpu_threads"):
        zerocore.Offload(optimizer=True, cpu_threads=0)


def test_offloaded_step_uses_its_threads_only_while_it_runs(monkeypatch):
    # A GPU rank's offloaded shards are stepped with the sharding's thread count; the process's
    # own count (the caller's) is what it was before and after the step: shard() and the
    # optimizer change nothing of the process for longer than the step.
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    shard = ShardParameter(torch.randn(37), offloaded=True)
    shard.host_threads = wanted
    shard.grad = torch.randn(37)
    seen = []
    real = zerocore.ops.fused_adam_multi  # the launch every whole bucket joins
    monkeypatch.setattr(zerocore.ops, "fused_adam_multi",
                        lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k)))
    zerocore.optim.AdamW([shard], lr=1e-3).step()
    assert seen == [wanted] and torch.get_num_threads() == before
    plain = torch.nn.Parameter(torch.randn(5))  # not offloaded: torch's own count
    plain.grad = torch.randn(5)
    seen.clear()
    zerocore.optim.AdamW([plain], lr=1e-3).step()
    assert seen == [before]
