"""NVMe offload (``zerocore.Offload(optimizer="nvme", path=...)``, ZeRO-Infinity): the fp32 masters
and Adam moments live in each rank's scratch file and are stepped chunk by chunk through a small
pool of host buffers; training is bitwise what it is in memory.

The pool here is ``MIN_POOL_BYTES`` (chunks of 1,024 elements), so that every shard of these
small models is stepped in several chunks, the pipeline's reads running ahead and its writes
behind (tests/engine/test_nvme_store.py drives the store itself).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

import zerocore
from zerocore.engine.nvme_store import NvmeIOError
from zerocore.engine.scratch_file import ScratchSpaceError
from zerocore.policies import MIN_POOL_BYTES
from zerocore.plan import MASTERS, NVME_POOL, OPTIMIZER
from tests.support.scratch_disk import read_only_dir
from tests.support.small_disk import file_size_limit
from tests.support.stand_in_streams import StreamLog, stand_in_cuda, use_stand_in_streams
from tests.support.offload_stack import (BATCH, DOORS, SEQ, layer_stack, measured_peaks,
                                         stack_loss)
from tests.support.offload_stack import build as build_stack
from tests.support.toy_stack import LR, WEIGHT_DECAY, Spec, accumulate_step, train_digest

WORLD_SIZES = [1, 2, 3]


# With params="nvme" the pool holds two of the largest shard a gather reads at least (a block
# of the toy transformer in fp32 at one rank: 50 kB); 256 KiB gives four slots there, and
# chunks of 4,096 elements for the optimizer, so its shards are still stepped in several.
PARAMS_POOL = 256 * 1024


def offload_of(label: str, path: str) -> zerocore.Offload:
    """The offloads compared: "none" (the reference); the optimizer on NVMe with the
    parameters on the device, in host memory ("+params") or on NVMe too ("all"); the
    parameters alone on NVMe, the optimizer on the device ("params")."""
    return {"none": zerocore.Offload(),
            "nvme": zerocore.Offload(optimizer="nvme", path=path, pool_bytes=MIN_POOL_BYTES),
            "nvme+params": zerocore.Offload(optimizer="nvme", params="cpu", path=path,
                                            pool_bytes=MIN_POOL_BYTES),
            "all": zerocore.Offload(optimizer="nvme", params="nvme", path=path,
                                    pool_bytes=PARAMS_POOL),
            "params": zerocore.Offload(params="nvme", path=path,
                                       pool_bytes=PARAMS_POOL)}[label]


@dataclasses.dataclass(frozen=True)
class Case:
    spec: Spec
    doors: tuple[str, ...] = tuple(DOORS)
    policies: dict = dataclasses.field(default_factory=dict)
    labels: tuple[str, ...] = ("nvme", "nvme+params", "all", "params")


# fp32 with accumulation and clipping (the model copy the kernel writes is fp32 here, the
# gather input); bf16 with a frozen embedding; bf16 recomputation; int8 frozen weights (a
# biases-only run: many small shards, one chunk each); a keep-gathered budget (40 kB keeps some
# of the transformer's layers: tests/engine/test_front_doors.py).
CASES = {
    "mlp-fp32-micro2-clip": Case(Spec(model="mlp", steps=3, micro=2, max_norm=0.05),
                                 labels=("nvme", "nvme+params", "all")),
    "transformer-bf16-frozen-embedding": Case(Spec(model="transformer", steps=3,
                                                   train="no_embedding",
                                                   param_dtype=torch.bfloat16)),
    "transformer-bf16-recompute": Case(Spec(model="transformer", steps=2,
                                            param_dtype=torch.bfloat16), ("shard",),
                                       {"recompute": zerocore.Recompute()}, ("nvme", "all")),
    "transformer-int8-biases": Case(Spec(model="transformer", steps=2, train="biases",
                                         param_dtype=torch.bfloat16), ("shard_model",),
                                    {"frozen_weights": zerocore.FrozenWeights("int8")},
                                    ("nvme", "params")),
    "transformer-nf4-biases": Case(Spec(model="transformer", steps=2, train="biases",
                                        param_dtype=torch.bfloat16), ("shard",),
                                   {"frozen_weights": zerocore.FrozenWeights("nf4")},
                                   ("params",)),
    "transformer-keep-gathered-budget": Case(Spec(model="transformer", steps=2,
                                                  max_norm=0.05),
                                             ("shard",),
                                             {"prefetch": zerocore.Prefetch(
                                                 keep_gathered=40_000)}, ("nvme+params", "all")),
}
PAIRS = [(name, door) for name, case in sorted(CASES.items()) for door in case.doors]


def build(door: str, case: Case, offload: zerocore.Offload):
    """(the callable model, its sharding) (tests/support/offload_stack.py)."""
    return build_stack(door, case.spec, case.policies, offload)


def full_states(sharding) -> dict[str, torch.Tensor]:
    """Every parameter, trainable ones from the fp32 masters (read from the scratch)."""
    return {f"{i}.{n}": t for i, state in sharding.iter_full_states() for n, t in state.items()}


def train(rank: int, world_size: int, door: str, name: str, label: str, path: str) -> dict:
    case = CASES[name]
    offload = offload_of(label, path)
    model, sharding = build(door, case, offload)
    out = train_digest(model, case.spec, rank, world_size, final=full_states, sharding=sharding)
    store = sharding.ctx.store
    if store is not None:
        report = sharding.memory_report()
        groups = [g for layer in sharding.layers for g in layer.groups]
        # What the scratch holds: each trainable shard's moments (fp32) when the optimizer is
        # there, and its master but in fp32 with the parameters in memory (there the model
        # copy in host memory is the master: none in the scratch); its model copy (param
        # dtype) with the parameters; each frozen shard's bytes with the parameters.
        p_bytes = case.spec.param_dtype.itemsize
        master = offload.params == "nvme" or case.spec.param_dtype != torch.float32
        arrays = [(g.layout.shard_numel * 4, 2 + master if offload.optimizer == "nvme" else 0)
                  for g in groups if g.trainable]
        if offload.params == "nvme":
            arrays += [(g.layout.shard_numel * p_bytes, 1) for g in groups
                       if g.trainable and offload.optimizer]
            arrays += [(g.shard.numel() * g.shard.element_size(), 1) for g in groups
                       if not g.trainable]
        # The frozen shards, and the copies with the optimizer, are in none of the memories.
        in_memory = sum(g.memory_shard_bytes for g in groups
                        if not g.trainable or offload.optimizer)
        out.update(entries=os.listdir(path), master_bytes=report.master_bytes,
                   nvme_bytes=report.nvme_bytes, store_size=store.size,
                   arrays=sum(n * k for n, k in arrays), count=sum(k for _, k in arrays),
                   in_memory=in_memory, after_step=report.device_shard_bytes,
                   staying=sum(g.layout.shard_numel * 4 for g in groups if g.trainable
                               and not offload.optimizer
                               and case.spec.param_dtype == torch.float32),
                   reads=(store.reads_ahead, store.reads_waited))
    return out


@pytest.mark.parametrize("name,door", PAIRS)
def test_nvme_trains_bitwise_as_in_memory(world, tmp_path, name, door):
    """Losses, gradient shards before every step, gradient norms, and the final weights read
    back from the scratch: the same bits as training in memory."""
    case = CASES[name]
    plain = world.run(train, door, name, "none", str(tmp_path))
    for label in case.labels:
        for r, p in zip(world.run(train, door, name, label, str(tmp_path)), plain):
            assert r["digest"] == p["digest"], (label, r["digest"], p["digest"])
            # The masters and moments are on the disk, none in memory, and with params="nvme"
            # the shards the gathers read; the scratch is unnamed (nothing to see in its
            # directory, nothing to leave behind).
            assert (r["master_bytes"] == 0) == (label != "params"), r
            assert r["nvme_bytes"] == r["store_size"], r
            # Each array in whole 4 KiB blocks: less than a block more per array.
            assert r["arrays"] <= r["nvme_bytes"] <= r["arrays"] + 4095 * r["count"], r
            assert r["entries"] == [], r["entries"]
            if label in ("all", "params"):
                assert r["in_memory"] == 0, r
                # After a step nothing of a shard is on the (stand-in) device, but the fp32
                # masters the optimizer on the device computes with (params="nvme" alone).
                assert r["after_step"] == r["staying"], r
            if label == "all":
                # Past the first step (and the first two reads of each next, which learn what
                # follows the last backward), the gathers find their shards read ahead.
                ahead, waited = r["reads"]
                steps = case.spec.steps
                assert waited <= (ahead + waited) // steps + 2 * (steps - 1), r["reads"]
    assert os.listdir(tmp_path) == []


def chunked_somewhere(rank: int, world_size: int, path: str) -> bool:
    _, sharding = build("shard", CASES["transformer-bf16-frozen-embedding"],
                        offload_of("nvme", path))
    store = sharding.ctx.store
    return max(s.numel() for s in sharding.trainable_shards()) > 2 * store.chunk_numel


def test_the_shards_are_stepped_in_several_chunks(world, tmp_path):
    """What the parity above exercises: shards of several chunks (so reads ahead and writes
    behind), at every world size."""
    assert all(world.run(chunked_somewhere, str(tmp_path)))


def a_second_optimizer(rank: int, world_size: int, path: str) -> dict:
    """A step with one optimizer, then a second optimizer built on the same model and a step
    with it: an optimizer starts from zero moments (zeros_like's, in memory), so the second
    must not find the first's in the scratch. What the moments are, and the weights after."""
    spec = CASES["transformer-bf16-frozen-embedding"].spec
    out = {}
    for label in ("none", "nvme"):
        _, model = build("shard", CASES["transformer-bf16-frozen-embedding"],
                         offload_of(label, path))
        for step in range(2):
            opt = zerocore.optim.AdamW(model.trainable_shards(), lr=LR,
                                       weight_decay=WEIGHT_DECAY)
            if label == "nvme":
                moments = [float(s.nvme.read(k).abs().sum()) for s in model.trainable_shards()
                           for k in ("exp_avg", "exp_avg_sq")]
                out.setdefault("moments", []).append(moments)
            accumulate_step(model, spec, step, rank, world_size)
            opt.step()
            opt.zero_grad()
        try:
            opt.state_dict()
            out[f"{label}-state_dict"] = "given"
        except ValueError as e:
            out[f"{label}-state_dict"] = str(e)
        out[label] = full_states(model)
    return out


def test_a_new_optimizer_starts_from_zero_moments_and_state_dicts_are_refused(worlds,
                                                                             tmp_path):
    for r in worlds(2).run(a_second_optimizer, str(tmp_path)):
        first, second = r["moments"]
        assert set(first) == {0.0} and set(second) == {0.0}, r["moments"]
        assert r["none"].keys() == r["nvme"].keys()
        for name, t in r["none"].items():
            assert torch.equal(r["nvme"][name], t), name
        assert r["none-state_dict"] == "given"
        assert "live on NVMe" in r["nvme-state_dict"] and "zerocore.save_checkpoint" in \
            r["nvme-state_dict"]


# -- the CUDA branch, on stand-in streams ------------------------------------------------------

def train_on_stand_in_streams(rank: int, world_size: int, path: str) -> dict:
    """The optimizer and parameters on NVMe, down the CUDA branches (stand-in streams: the
    copies synchronous, the waits and records logged)."""
    case = CASES["transformer-bf16-frozen-embedding"]
    _, sharding = build("shard", case, offload_of("all", path))
    log = StreamLog()
    use_stand_in_streams(sharding, log)
    with stand_in_cuda(log):
        out = train_digest(sharding, case.spec, rank, world_size, final=full_states)
    store = sharding.ctx.store
    uploads = log.events.get("upload", [])
    return dict(out, uploads=len(uploads), synchronized=sum(e.synchronized for e in uploads),
                waits=log.calls.count(("wait_event", "gather", "upload")),
                windows=log.gathers_on.count("gather"), slots=len(store._slots),
                reads=store.reads_ahead + store.reads_waited)


def test_the_cuda_branch_uploads_each_window_from_its_slot(world, tmp_path):
    """On a GPU a window is uploaded from its pool slot on the upload stream, the gather waits
    for that upload, and the slot is read into again only once the upload is done: bitwise the
    run in memory; every window of every gather uploaded; every upload but those of the last
    reads (as many as there are slots) waited for before its slot was reused."""
    plain = world.run(train, "shard", "transformer-bf16-frozen-embedding", "none",
                      str(tmp_path))
    for r, p in zip(world.run(train_on_stand_in_streams, str(tmp_path)), plain):
        assert r["digest"] == p["digest"]
        assert r["uploads"] == r["windows"] == r["waits"] == r["reads"] > 0, r
        assert r["uploads"] - r["slots"] <= r["synchronized"] <= r["uploads"], r


# -- the path checks: one line, every rank --------------------------------------------------------

def build_at(rank: int, world_size: int, paths: list[str]) -> tuple[str, str]:
    """Shards with each rank's own path; (the exception's type, its message)."""
    try:
        build("shard", CASES["mlp-fp32-micro2-clip"], offload_of("nvme", paths[rank]))
    except Exception as e:  # noqa: BLE001  (what every rank raised is the result)
        return type(e).__name__, str(e)
    return "", ""


def test_a_bad_path_is_one_line_on_every_rank(worlds, tmp_path):
    """A missing directory, a file, a directory this process may not write to: refused before
    anything is built, on every rank, saying what to do; the rank whose path it is raises it,
    the others PeerError naming it."""
    world = worlds(2)
    good = tmp_path / "good"
    good.mkdir()
    (tmp_path / "file").write_text("")
    with read_only_dir(tmp_path / "ro") as ro:
        cases = {"missing": (str(tmp_path / "missing"), "no such directory; create it"),
                 "file": (str(tmp_path / "file"), "is not a directory"),
                 "read-only": (str(ro), "may not write there")}
        for label, (bad, words) in cases.items():
            got = world.run(build_at, [str(good), bad])
            assert got[1][0] == "ScratchSpaceError" and words in got[1][1], (label, got)
            assert got[0][0] == "PeerError" and words in got[0][1], (label, got)
            assert "\n" not in got[1][1]
    assert os.listdir(good) == []


def build_with_file_size_limit(rank: int, world_size: int, path: str, limit: int) -> tuple:
    """Shards with writes past ``limit`` bytes of any file refused on rank 1 (a disk too small
    for its scratch: tests/support/small_disk.py's stand-in)."""
    with file_size_limit(limit if rank == 1 else None):
        return build_at(rank, world_size, [path] * world_size)


def test_a_disk_too_small_is_found_while_building(worlds, tmp_path):
    """The scratch is reserved layer by layer as the layers are built: a disk without room for
    it is one line on every rank (BuildError, naming the rank and the layer), before
    training."""
    got = worlds(2).run(build_with_file_size_limit, str(tmp_path), 4 * 4096)
    for kind, message in got:
        assert kind == "BuildError" and "rank 1" in message, got
        assert "no room for the scratch" in message and "give a path on a larger" in message
        assert "\n" not in message


# A layer of the stack below: 64 x 64 + 64 elements, 2,080 a rank at two ranks, each of its two
# fp32 arrays in the scratch (the moments: in fp32 the master is the model copy, in memory)
# three 4 KiB blocks of it.
AGREED_LAYER_SCRATCH = 2 * 3 * 4096


def build_drawing_agreed_layers(rank: int, world_size: int, path: str) -> tuple[str, str]:
    """Shards layers drawn from a generator that agrees on each with every rank (a collective
    per layer, as neox's ``stream_layers`` reads each), rank 1's disk having room for the first
    layer's scratch (and the block the direct-I/O probe writes) and not the second's."""
    def layers():
        for _ in range(3):
            yield zerocore.run_agreed(lambda: torch.nn.Linear(64, 64))

    with file_size_limit(AGREED_LAYER_SCRATCH + 4096 if rank == 1 else None):
        try:
            zerocore.shard(layers(), offload=zerocore.Offload(
                optimizer="nvme", path=path, pool_bytes=MIN_POOL_BYTES))
        except Exception as e:  # noqa: BLE001  (what every rank raised is the result)
            return type(e).__name__, str(e)
    return "", ""


def test_a_disk_too_small_by_one_layer_is_one_line_when_the_layers_agree(worlds, tmp_path):
    """Issue 40, item 3: rank 1 fails to reserve the second layer's scratch while rank 0 goes
    on to draw the third layer, whose drawing is itself a collective. The rank that failed
    draws it too (else the ranks met in different collectives and gloo aborted the process):
    one line on every rank, naming rank 1 and its layer."""
    got = worlds(2).run(build_drawing_agreed_layers, str(tmp_path))
    for kind, message in got:
        assert kind == "BuildError", got
        assert "rank 1 could not build layer 1" in message, got
        assert "no room for the scratch" in message and "\n" not in message
    assert os.listdir(tmp_path) == []


# -- a disk that fills mid-step -----------------------------------------------------------------

def fill_mid_step(rank: int, world_size: int, path: str, ckpt: str) -> dict:
    """Two steps and a checkpoint; then rank 1's disk refuses writes during the third step's
    optimizer pass. What every rank raised, and the checkpoint's state after it. The pass runs
    on the optimizer's worker, overlapping the next forward (the default): its failure is
    raised by the step after it, once the next forward and backward have run."""
    spec = Spec(model="transformer", steps=3, param_dtype=torch.bfloat16)
    case = Case(spec)
    _, model = build("shard", case, offload_of("nvme", path))
    opt = zerocore.optim.AdamW(model.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(2):
        accumulate_step(model, spec, step, rank, world_size)
        opt.step()
        opt.zero_grad()
    saved = zerocore.save_checkpoint(ckpt, 2, model, opt)
    accumulate_step(model, spec, 2, rank, world_size)
    # On rank 1 the scratch's first array stays writable: the pass fails part-way.
    with file_size_limit(model.ctx.store.size // 2 if rank == 1 else None):
        try:
            opt.step()
            opt.zero_grad()
            accumulate_step(model, spec, 3, rank, world_size)
            opt.step()
            raised = ("", "")
        except Exception as e:  # noqa: BLE001  (what every rank raised is the result)
            raised = (type(e).__name__, str(e))
    return dict(raised=raised, saved=str(saved))


def test_a_disk_that_fills_mid_step_is_one_line_and_keeps_the_checkpoints(worlds, tmp_path):
    world = worlds(2)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    got = world.run(fill_mid_step, str(scratch), str(tmp_path / "ckpt"))
    kind, message = got[1]["raised"]
    assert kind == "NvmeIOError" and "writing the scratch" in message, got
    assert "File too large" in message and "resume from its last checkpoint" in message
    assert "\n" not in message
    assert got[0]["raised"][0] == "PeerError" and "writing the scratch" in got[0]["raised"][1]
    # The checkpoint saved before is complete and verifies (its files are elsewhere).
    assert zerocore.latest_checkpoint(tmp_path / "ckpt") == Path(got[0]["saved"])
    zerocore.verify_files(got[0]["saved"], zerocore.read_manifest(got[0]["saved"]))
    assert issubclass(NvmeIOError, OSError) and issubclass(ScratchSpaceError, OSError)


# -- the plan -------------------------------------------------------------------------------------

POOL = 1 << 20


def stack_offload(label: str, path: str) -> zerocore.Offload:
    return {"cpu": zerocore.Offload(optimizer=True),
            "nvme": zerocore.Offload(optimizer="nvme", path=path, pool_bytes=POOL),
            "all": zerocore.Offload(optimizer="nvme", params="nvme", path=path,
                                    pool_bytes=POOL)}[label]


def measure_stack(rank: int, world_size: int, label: str, path: str) -> dict:
    """The step's peak (tests/support/offload_stack.py: the smallest of three), and the
    scratch's size."""
    peaks, nvme = measured_peaks(
        lambda: zerocore.shard(layer_stack(), offload=stack_offload(label, path),
                               mixed_precision=zerocore.MixedPrecision(torch.bfloat16)),
        lambda model: model.ctx.store.size if model.ctx.store is not None else 0)
    return dict(peak=min(peaks), nvme=nvme)


def planned(label: str, world_size: int, device: str, path: str):
    return zerocore.plan.plan(layer_stack("meta"),
                              torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=world_size, loss=stack_loss, device=device,
                              offload=stack_offload(label, path),
                              mixed_precision=zerocore.MixedPrecision(torch.bfloat16))


# The plan is the engine's own step on fake tensors, the pool included (it is a host buffer the
# step holds); 2%: tests/engine/test_plan.py's bound for a stack.
PLAN_TOL = 0.02


def test_the_plan_shows_the_pool_and_the_scratch_and_matches_the_measured_peak(worlds,
                                                                               tmp_path):
    labels = ("cpu", "nvme", "all")
    plans = {label: planned(label, 2, "cpu", str(tmp_path)) for label in labels}
    measured = {label: worlds(2).run(measure_stack, label, str(tmp_path)) for label in labels}
    for label, plan in plans.items():
        got = min(r["peak"] for r in measured[label])
        assert abs(plan.device_peak / got - 1) < PLAN_TOL, (label, plan.device_peak, got,
                                                             plan.table())
    nvme = plans["nvme"]
    assert nvme.state.nvme == measured["nvme"][0]["nvme"] > 0
    assert nvme.state.pool == POOL and nvme.peak[NVME_POOL] == POOL
    assert nvme.state.masters == nvme.state.optimizer == 0
    assert nvme.peak[MASTERS] == nvme.peak[OPTIMIZER] == 0
    table = nvme.table()
    assert "NVMe pool" in table and "on NVMe (masters, moments; scratch)" in table
    # The masters and moments (12 bytes per trainable element, in bf16) leave memory; the pool
    # comes in.
    cpu = plans["cpu"]
    assert cpu.device_peak - nvme.device_peak == pytest.approx(
        cpu.state.masters + cpu.state.optimizer - POOL, rel=0.01)
    # On a GPU machine they leave the host: its peak falls by as much.
    gpu = {label: planned(label, 2, "cuda", str(tmp_path)) for label in labels}
    assert gpu["cpu"].host_peak - gpu["nvme"].host_peak == pytest.approx(
        cpu.state.masters + cpu.state.optimizer - POOL, rel=0.01)
    # With the parameters there too, the model copies leave it as well (none are frozen here).
    every = plans["all"]
    assert every.state.trainable_params == 0 and every.state.nvme == measured["all"][0]["nvme"]
    # (each copy's region rounded up to whole 4 KiB blocks: at most a block more per layer)
    copies = every.state.nvme - nvme.state.nvme
    assert 0 <= copies - nvme.state.trainable_params < 4096 * len(layer_stack("meta")), copies
    assert gpu["nvme"].host_peak - gpu["all"].host_peak == pytest.approx(
        nvme.state.trainable_params, rel=0.01)
    assert os.listdir(tmp_path) == []


def build_with_a_pool(rank: int, world_size: int, path: str, pool: int) -> tuple[str, str]:
    """The plan's stack (its embedding's shard: 64 kB in bf16 at two ranks) with a pool of
    ``pool`` bytes; what was raised."""
    try:
        zerocore.shard(layer_stack(), mixed_precision=zerocore.MixedPrecision(torch.bfloat16),
                       offload=zerocore.Offload(optimizer="nvme", params="nvme", path=path,
                                                pool_bytes=pool))
    except ValueError as e:
        return type(e).__name__, str(e)
    return "", ""


def test_a_pool_too_small_for_two_shards_is_refused_saying_how_large(worlds, tmp_path):
    """With params="nvme" the pool holds two of the largest shard a gather reads at least:
    a smaller one is refused, the same on every rank (the shards and the pool are), naming
    the size it needs."""
    least = zerocore.Offload(optimizer="nvme", params="nvme", path=str(tmp_path)).min_pool_bytes
    got = worlds(2).run(build_with_a_pool, str(tmp_path), least)
    assert got[0] == got[1] and got[0][0] == "ValueError", got
    assert "with params='nvme' the pool holds at least 2 of the largest shard" in got[0][1]
    needed = int(got[0][1].rsplit(">= ", 1)[1])
    assert worlds(2).run(build_with_a_pool, str(tmp_path), needed) == [("", ""), ("", "")]


def build_with_a_pool_beyond_the_machine(rank: int, world_size: int, path: str) -> tuple:
    """The stack with a pool of 1 PiB, more than any machine here: what was raised."""
    try:
        zerocore.shard(layer_stack(), offload=zerocore.Offload(optimizer="nvme", path=path,
                                                               pool_bytes=2**50))
    except Exception as e:  # noqa: BLE001  (what every rank raised is the result)
        return type(e).__name__, str(e)
    return "", ""


def test_a_pool_beyond_the_machines_memory_is_one_line_on_every_rank(worlds, tmp_path):
    """Issue 40, item 5 (``--offload-pool 1e30``, ``1TiB``): refused before any of it is
    taken, on every rank, saying what to give (it was a MemoryError traceback on each)."""
    got = worlds(2).run(build_with_a_pool_beyond_the_machine, str(tmp_path))
    assert got[0][0] == "ValueError" and got[1][0] == "PeerError", got
    for _, message in got:
        assert "is more than this machine's" in message and "give a pool of" in message, got
        assert "\n" not in message
    assert os.listdir(tmp_path) == []
