"""The overlapped optimizer pass (``Offload(overlap="exact")``, engine/optimizer_pass.py): the
offloaded shards' Adam runs on the optimizer's host worker, layer by layer in forward order,
while the next forward runs; each gather waits for its layer's update alone, and whatever reads
the state whole waits for the pass. Training is bitwise what the synchronous pass
(``overlap="off"``) gives, on host-memory and NVMe homes, through both front doors, at world
sizes 1-3, in fp32 with accumulation and clipping, in bf16, and in fp16 with a dynamic loss
scale and an overflow on one rank.

A lagging worker (``pass_hook`` sleeping before each layer) keeps the pass in flight while the
forward gathers, and while a checkpoint is taken: the waits, not the timing, make the results
equal. Each test here fails when the wait it checks is removed (the layer's wait in
``FlatGroup.start_gather``, ``settle_updates`` in the checkpoint's ``prepare`` and in
``optimizer.step``).

On NVMe each pass's first chunks are read as the pass before it ends (engine/nvme_store.py):
training is bitwise the pass that reads its own, the last pass finds them read, and a read
ahead that fails (before the step that uses it) is that pass's failure, agreed at the next
step with nothing written. These fail with the read-ahead removed.
"""

from __future__ import annotations


import errno
import hashlib
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

import zerocore

from zerocore.engine.nvme_store import BUFFERS
from tests.support import hf_models
from tests.support.dist_utils import inject_overflow
from tests.support.offload_stack import DOORS, Case, pass_cases, pass_offload
from tests.support.offload_stack import build as build_stack
from tests.support.toy_stack import (LR, WEIGHT_DECAY, global_batch, loss_fn,
                                     model_input)

WORLD_SIZES = [1, 2, 3]
# How long the lagging worker sleeps before each layer's update: longer than a toy layer's
# forward on a loaded CPU, so that without the waits a forward reads a layer before its
# update (a stale weight changes the loss's bits).
LAG_S = 0.05
# fp16 with a dynamic loss scale: a moderate start keeps the scaled gradients of these toy
# models far from fp16's 65504, so the only overflow is the injected one.
FP16_SCALE = 2.0**10


CASES = pass_cases(steps=3)


def lagging(index: int) -> None:
    """``pass_hook``: a worker slower than the forward."""
    time.sleep(LAG_S)


def one_step(sharding, model, opt, scaler, case: Case, step: int, rank: int,
             world_size: int, h: "hashlib._Hash", set_to_none: bool = True) -> None:
    """Forward and backward of each micro-batch (their losses hashed, exactly), then the
    gradient shards hashed and the step through the scaler (its norm and skip hashed), then
    the gradients zeroed (dropped, or with ``set_to_none=False`` zeroed in place)."""
    spec = case.spec
    for m in range(spec.micro):
        x, y = global_batch(spec, step, m, world_size)
        xr, yr = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = loss_fn(spec, model(model_input(spec, xr)), yr) / spec.micro
        scaler.scale(loss).backward()
        h.update(struct.pack("<d", loss.item()))
    if step in case.overflow_steps and rank == world_size - 1:
        inject_overflow(sharding.layers[:1], sharding.rank)
    for shard in sharding.trainable_shards():
        h.update(shard.grad.numpy().tobytes())
    result = scaler.step(opt, max_norm=spec.max_norm)
    h.update(struct.pack("<d?", result.grad_norm, result.skipped))
    opt.zero_grad(set_to_none=set_to_none)


def state_digest(sharding, opt, h: "hashlib._Hash") -> None:
    """Every parameter gathered (trainable ones from the fp32 masters), then this rank's Adam
    moments and step counts (from the scratch on NVMe)."""
    for i, state in sharding.iter_full_states():
        for name, t in sorted(state.items()):
            h.update(f"{i}.{name}".encode())
            h.update(t.float().numpy().tobytes())
    for shard in sharding.trainable_shards():
        for key in ("exp_avg", "exp_avg_sq"):
            t = shard.nvme.read(key) if shard.nvme is not None else opt.state[shard][key]
            h.update(t.numpy().tobytes())
        h.update(struct.pack("<d", float(opt.state[shard]["step"])))


def build(door: str, case: Case, label: str, path: str, overlap: str, lag: bool):
    model, sharding = build_stack(door, case.spec, {}, pass_offload(label, path, overlap))
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY,
                               pass_hook=lagging if lag else None)
    fp16 = case.spec.param_dtype == torch.float16
    scaler = zerocore.LossScaler(sharding.group, dynamic=fp16,
                                 policy=zerocore.LossScaling(init_scale=FP16_SCALE))
    return model, sharding, opt, scaler


def train(rank: int, world_size: int, door: str, name: str, label: str, path: str,
          overlap: str, lag: bool, set_to_none: bool = True) -> dict:
    case = CASES[name]
    model, sharding, opt, scaler = build(door, case, label, path, overlap, lag)
    h = hashlib.sha256()
    for step in range(case.spec.steps):
        one_step(sharding, model, opt, scaler, case, step, rank, world_size, h, set_to_none)
    state_digest(sharding, opt, h)
    overlapped = [s.update_pass is not None for s in sharding.trainable_shards()]
    return {"digest": h.hexdigest(), "overlapped": overlapped}


# The base case (fp32, its homes host memory with the parameters on the device and NVMe with
# them on the host: both optimizer homes, both parameter homes) through both doors at 1, 2 and
# 3 ranks; bf16 and fp16 (its overflow on the last rank, agreed) through both doors at 3 only:
# their paths do not depend on the count, which the base case covers at 1, 2 and 3 (CI time).
BASE = "mlp-fp32-micro2-clip"
PAIRS = [pytest.param(size, name, door, id=f"ws{size}-{name}-{door}")
         for name in sorted(CASES) for door in DOORS
         for size in (WORLD_SIZES if name == BASE else [3])]


def cpu_at_every_size() -> list:
    """(size, label) parameters: host memory at 1, 2 and 3 ranks, NVMe at 3."""
    return [pytest.param(size, label, id=f"ws{size}-{label}") for label in ("cpu", "nvme")
            for size in (WORLD_SIZES if label == "cpu" else [3])]


@pytest.mark.parametrize("size,name,door", PAIRS)
def test_overlapped_pass_trains_bitwise_as_the_synchronous_one(worlds, tmp_path, size, name,
                                                               door):
    """Losses, gradient shards, norms, skips, final weights and moments: the same bits with
    the pass overlapped as with it inside ``step()``, on every home; and the same again with a
    worker that lags behind the forward (each gather waited for its layer's update)."""
    world = worlds(size)
    labels = ["cpu", "nvme+params"] if name.startswith("mlp-fp32") else ["cpu", "cpu+params",
                                                                          "nvme"]
    for label in labels:
        runs = {}
        for overlap, lag in (("off", False), ("exact", False), ("exact", True)):
            scratch = tmp_path / f"{label}-{overlap}-{lag}"
            scratch.mkdir()
            got = world.run(train, door, name, label, str(scratch), overlap, lag)
            runs[overlap, lag] = [g["digest"] for g in got]
            # The pass did run on the worker (or, off, inside step): the test can tell them.
            assert all(all(o) == (overlap == "exact") and o for g in got
                       for o in [g["overlapped"]]), (label, overlap, got)
        assert runs["exact", False] == runs["off", False], (label, runs)
        assert runs["exact", True] == runs["off", False], (label, runs)


# Host memory at 1, 2 and 3 ranks; NVMe at 3 only: its pass, reads and writes are each rank's
# own scratch, a path that does not depend on the count, which host memory covers (CI time).
@pytest.mark.parametrize("size,label", cpu_at_every_size())
def test_zeroing_the_gradients_in_place_waits_for_the_pass(worlds, tmp_path, size, label):
    """``zero_grad(set_to_none=False)`` zeroes the gradients the pass reads: it waits for the
    pass first (a lagging worker would otherwise step on zeros)."""
    world = worlds(size)
    runs = {}
    for overlap, lag in (("off", False), ("exact", True)):
        scratch = tmp_path / overlap
        scratch.mkdir()
        got = world.run(train, "shard", "transformer-bf16-clip", label, str(scratch), overlap,
                        lag, False)
        runs[overlap] = [g["digest"] for g in got]
    assert runs["exact"] == runs["off"], runs


def rank_payload(path: Path, rank: int) -> dict:
    """A rank file's layers (master, moments, step of each), as saved."""
    payload = torch.load(path / f"rank-{rank:05d}.pt", weights_only=False)
    return payload["layers"]


def two_lagging_steps(rank: int, world_size: int, door: str, label: str, path: str):
    """Two steps with a lagging worker: the model, its sharding and optimizer, and whether the
    second step's pass was still in flight when the step returned."""
    case = CASES["transformer-bf16-clip"]
    model, sharding, opt, scaler = build(door, case, label, path, "exact", lag=True)
    h = hashlib.sha256()
    for step in range(2):
        one_step(sharding, model, opt, scaler, case, step, rank, world_size, h)
    return model, sharding, opt, opt.pass_in_flight


def save_in_flight(rank: int, world_size: int, door: str, label: str, path: str,
                   ckpt: str) -> dict:
    """Two steps with a lagging worker; a checkpoint saved at once after the second step,
    while its pass is in flight, and another once the pass is over."""
    model, sharding, opt, in_flight = two_lagging_steps(rank, world_size, door, label, path)
    during = zerocore.save_checkpoint(Path(ckpt) / "during", 2, model, opt)
    opt.settle()
    after = zerocore.save_checkpoint(Path(ckpt) / "after", 2, model, opt)
    return {"in_flight": in_flight, "during": str(during), "after": str(after)}


def read_in_flight(rank: int, world_size: int, door: str, label: str, path: str) -> dict:
    """Two steps with a lagging worker; each master shard read by the user (``detach``) at
    once after the second step, while its pass is in flight, and again once it is over."""
    model, sharding, opt, in_flight = two_lagging_steps(rank, world_size, door, label, path)
    during = [s.detach().clone() for s in sharding.trainable_shards()]
    opt.settle()
    after = [s.detach().clone() for s in sharding.trainable_shards()]
    return {"in_flight": in_flight,
            "equal": all(torch.equal(a, b) for a, b in zip(during, after))}


@pytest.mark.parametrize("door", DOORS)
def test_a_master_read_while_the_pass_is_in_flight_is_the_updated_one(world, tmp_path, door):
    """Any use of a shard (``OverlappedShard.__torch_function__``) waits for its update."""
    got = world.run(read_in_flight, door, "cpu", str(tmp_path))
    assert all(g["in_flight"] for g in got), got  # (else this tests nothing)
    assert all(g["equal"] for g in got), got


def shard_classes(rank: int, world_size: int, path: str) -> dict:
    """The classes of the trainable shards and whether an op on each goes through Python,
    resident, offloaded with the pass inside the step, and overlapped (exact or delayed)."""
    got = {}
    for name, offload in (("resident", zerocore.Offload()),
                          ("off", pass_offload("cpu", path, "off")),
                          ("exact", pass_offload("cpu", path, "exact")),
                          ("delayed", pass_offload("cpu", path, "delayed"))):
        _, sharding = build_stack("shard", CASES["transformer-bf16-clip"].spec, {}, offload)
        plain = torch.nn.Parameter.__torch_function__
        got[name] = sorted({(type(s).__name__, type(s).__torch_function__ is not plain)
                            for s in sharding.trainable_shards()})
    return got


def test_only_an_overlapped_shard_waits_on_its_uses(world, tmp_path):
    """Only the overlapped pass's shards need every use to wait (a Python
    ``__torch_function__``, about 3 us an op); the others are plain Parameters to torch."""
    got = world.run(shard_classes, str(tmp_path))
    for g in got:
        assert g == {"resident": [("ShardParameter", False)], "off": [("ShardParameter", False)],
                     "exact": [("OverlappedShard", True)],
                     "delayed": [("OverlappedShard", True)]}, g


# Host memory at 1, 2 and 3 ranks; NVMe at 3 only: its pass, reads and writes are each rank's
# own scratch, a path that does not depend on the count, which host memory covers (CI time).
@pytest.mark.parametrize("size,label", cpu_at_every_size())
def test_a_checkpoint_taken_while_the_pass_is_in_flight_equals_one_after(worlds, tmp_path,
                                                                         size, label):
    world = worlds(size)
    got = world.run(save_in_flight, "shard", label, str(tmp_path), str(tmp_path / "ckpt"))
    assert all(g["in_flight"] for g in got), got  # (else this tests nothing)
    for rank in range(len(got)):
        during = rank_payload(Path(got[rank]["during"]), rank)
        after = rank_payload(Path(got[rank]["after"]), rank)
        assert during.keys() == after.keys()
        for index, entry in during.items():
            assert entry.keys() == after[index].keys()
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, after[index][key]), (rank, index, key)
                else:
                    assert value == after[index][key], (rank, index, key)


class InjectedFailure(OSError):
    """The worker's failure in these tests (an I/O error's kind)."""


def failing_on(rank_to_fail: int, rank: int, at: int):
    """``pass_hook`` that fails the pass before layer ``at`` on ``rank_to_fail`` only, from
    the time it is armed (``armed[0]``)."""
    armed = [False]

    def hook(index: int) -> None:
        if armed[0] and rank == rank_to_fail and index == at:
            raise InjectedFailure(5, "zerocore test: the disk went away during the pass")
    return hook, armed


def save_and_step_after_failure(sharding, model, opt, scaler, case, rank: int,
                                world_size: int, h, ckpt: str) -> dict:
    """A checkpoint and a step after a failed pass: what each raised (type, message)."""
    raised = {}
    for what, call in (("save", lambda: zerocore.save_checkpoint(ckpt, 2, model, opt)),
                       ("step", lambda: one_step(sharding, model, opt, scaler, case, 2, rank,
                                                 world_size, h))):
        try:
            call()
            raised[what] = ("", "")
        except Exception as e:  # noqa: BLE001  (what every rank raised is the result)
            raised[what] = (type(e).__name__, str(e))
    return raised


def fail_mid_pass(rank: int, world_size: int, label: str, path: str, ckpt: str) -> dict:
    """A step and a checkpoint; then the last rank's worker fails in the second step's pass.
    The next forward and backward run (on values the run will never keep); the checkpoint
    and the step after raise, each on every rank."""
    case = CASES["transformer-bf16-clip"]
    model, sharding = build_stack("shard", case.spec, {}, pass_offload(label, path, "exact"))
    hook, armed = failing_on(world_size - 1, rank, at=1)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY,
                               pass_hook=hook)
    scaler = zerocore.LossScaler(sharding.group, dynamic=False)
    h = hashlib.sha256()
    one_step(sharding, model, opt, scaler, case, 0, rank, world_size, h)
    saved = zerocore.save_checkpoint(ckpt, 1, model, opt)
    armed[0] = True
    one_step(sharding, model, opt, scaler, case, 1, rank, world_size, h)  # (the pass fails)
    raised = save_and_step_after_failure(sharding, model, opt, scaler, case, rank, world_size,
                                         h, ckpt)
    return {"raised": raised, "saved": str(saved)}


@pytest.mark.parametrize("label", ["cpu", "nvme"])
def test_a_failure_of_the_pass_is_one_agreed_line_and_keeps_the_checkpoint(world, tmp_path,
                                                                           label):
    got = world.run(fail_mid_pass, label, str(tmp_path), str(tmp_path / "ckpt"))
    last = len(got) - 1
    words = "the disk went away during the pass"
    # The failing rank raises its own error; the others PeerError, naming it.
    for what in ("save", "step"):
        kind, message = got[last]["raised"][what]
        assert kind == "InjectedFailure" and words in message, (what, got)
        assert "\n" not in message
        for rank in range(last):
            kind, message = got[rank]["raised"][what]
            assert kind == "PeerError" and f"rank(s) {last}" in message and words in message, (
                what, rank, got)
    # Nothing of step 2 was written; the checkpoint before the failure is complete and
    # verifies.
    assert zerocore.latest_checkpoint(tmp_path / "ckpt") == Path(got[0]["saved"])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [Path(got[0]["saved"]).name]
    zerocore.verify_files(got[0]["saved"], zerocore.read_manifest(got[0]["saved"]))


def stores_of(sharding) -> list:
    """The NVMe stores the sharding's trainable shards live in."""
    stores = {id(s.nvme.store): s.nvme.store for s in sharding.trainable_shards()}
    return list(stores.values())


def train_reading_ahead(rank: int, world_size: int, door: str, label: str, path: str,
                        overlap: str, ahead: bool, lag: bool) -> dict:
    """``train``'s run of mlp-fp32-micro2-clip (accumulation, clipping) on NVMe, each pass's
    first chunks read as the pass before it ends (``ahead``) or by the pass itself (the pass
    as it was before the read-ahead): its digest, the chunks its last pass found read ahead,
    and the chunks that pass could have found (those its buffers hold before its first
    write)."""
    case = CASES["mlp-fp32-micro2-clip"]
    model, sharding, opt, scaler = build(door, case, label, path, overlap, lag)
    stores = stores_of(sharding)
    for store in stores:
        store.read_ahead_passes = ahead
    h = hashlib.sha256()
    for step in range(case.spec.steps):
        one_step(sharding, model, opt, scaler, case, step, rank, world_size, h)
    opt.settle()
    found = sum(store.last_pass.chunks_read_ahead for store in stores)
    room = sum(min(BUFFERS - 1, sum(len(store.chunks(s.nvme))
                                    for s in sharding.trainable_shards()
                                    if s.nvme.store is store))
               for store in stores)
    state_digest(sharding, opt, h)
    return {"digest": h.hexdigest(), "found": found, "room": room}


# shard at 1, 2 and 3 ranks; shard_model at 3 only: the door changes which units there are,
# not how a rank's store reads ahead, which shard covers at every count (CI time).
@pytest.mark.parametrize("size,door", [pytest.param(size, door, id=f"ws{size}-{door}")
                                       for door in DOORS
                                       for size in (WORLD_SIZES if door == "shard" else [3])])
def test_each_pass_finds_its_first_chunks_read_ahead_and_trains_bitwise(worlds, tmp_path,
                                                                        size, door):
    """The next pass's first chunks are read as a pass ends (nvme_store.py): with the pass
    overlapped (also behind a lagging worker, which ends it during the backward) or inside
    ``step()``, training is bitwise the pass that reads its own chunks, and the last pass
    found as many chunks read ahead as its buffers hold."""
    world = worlds(size)
    for label in ("nvme", "nvme+params"):
        runs = {}
        for overlap, ahead, lag in (("exact", False, False), ("exact", True, False),
                                    ("exact", True, True), ("off", True, False)):
            scratch = tmp_path / f"{label}-{overlap}-{ahead}-{lag}"
            scratch.mkdir()
            runs[overlap, ahead, lag] = world.run(train_reading_ahead, door, label,
                                                  str(scratch), overlap, ahead, lag)
        before = runs.pop(("exact", False, False))
        assert all(g["found"] == 0 for g in before), before
        for key, got in runs.items():
            assert [g["digest"] for g in got] == [g["digest"] for g in before], (label, key)
            assert all(g["found"] == g["room"] > 0 for g in got), (label, key, got)


class FailingRead:
    """A store's scratch file whose ``nth`` read at ``offset`` fails as an I/O error does,
    saying so on ``failed``; the rest is the file's."""

    def __init__(self, file, offset: int, nth: int):
        self.file, self.offset, self.nth = file, offset, nth
        self.seen = 0
        self.failed = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        if offset == self.offset:
            self.seen += 1
            if self.seen == self.nth:
                self.failed.set()
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.file.read(offset, buffer)


def fail_reading_ahead(rank: int, world_size: int, path: str, ckpt: str) -> dict:
    """On the last rank, the read ahead of the next pass's first chunk fails (that chunk's
    second read: the first pass reads it itself): it is read before the next ``step()`` is
    called. A checkpoint; then the pass that uses the read fails. The checkpoint and the step
    after raise, each on every rank, and the failing rank's disk holds what the checkpoint
    saved."""
    case = CASES["transformer-bf16-clip"]
    model, sharding = build_stack("shard", case.spec, {}, pass_offload("nvme", path, "exact"))
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = zerocore.LossScaler(sharding.group, dynamic=False)
    [store] = stores_of(sharding)
    first = min(sharding.trainable_shards(), key=lambda s: s.layer_index).nvme
    failing = rank == world_size - 1
    if failing:
        store.file = FailingRead(store.file, first.master.offset, nth=2)
    h = hashlib.sha256()
    one_step(sharding, model, opt, scaler, case, 0, rank, world_size, h)
    # (a bound on a hang: the read ahead starts as the pass ends, and fails)
    read_before_step = not failing or store.file.failed.wait(timeout=60)
    saved = zerocore.save_checkpoint(ckpt, 1, model, opt)
    one_step(sharding, model, opt, scaler, case, 1, rank, world_size, h)  # (its pass fails)
    raised = save_and_step_after_failure(sharding, model, opt, scaler, case, rank, world_size,
                                         h, ckpt)
    intact = True
    if failing:  # nothing of the failed pass was written: the disk holds step 1's state
        saved_layers = rank_payload(Path(saved), rank)
        for layer in sharding.layers:
            if layer.trainable is not None:
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    intact &= torch.equal(layer.trainable.shard.nvme.read(key),
                                          saved_layers[layer.index][key])
    return {"raised": raised, "read_before_step": read_before_step, "intact": intact,
            "saved": str(saved)}


def test_a_failed_read_ahead_is_the_next_pass_s_agreed_failure(world, tmp_path):
    got = world.run(fail_reading_ahead, str(tmp_path), str(tmp_path / "ckpt"))
    last = len(got) - 1
    assert got[last]["read_before_step"], got  # (read ahead, before the step that uses it)
    words = "reading the scratch in Offload(path="
    for what in ("save", "step"):
        kind, message = got[last]["raised"][what]
        assert kind == "NvmeIOError" and words in message, (what, got)
        assert "Input/output error; nothing was changed by this transfer" in message
        assert "\n" not in message
        for rank in range(last):
            kind, message = got[rank]["raised"][what]
            assert kind == "PeerError" and f"rank(s) {last}" in message and words in message, (
                what, rank, got)
    # Nothing of the failed pass was written, there or in a checkpoint.
    assert got[last]["intact"], got
    saved = Path(got[0]["saved"])
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [saved.name]
    zerocore.verify_files(saved, zerocore.read_manifest(saved))


def train_hf(rank: int, world_size: int, label: str, path: str, overlap: str,
             lag: bool) -> str:
    """A tiny Hugging Face GPT-NeoX, fully trained through ``shard_model`` (its decoder
    layers the units, the embedding and head the root) in bf16 with clipping: a digest of its
    losses, norms and final parameters."""
    model = hf_models.prepare(hf_models.build("neox"), "full")
    sharded = zerocore.shard_model(model, hf_models.decoder_layers(model),
                                   offload=pass_offload(label, path, overlap),
                                   mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                               pass_hook=lagging if lag else None)
    scaler = zerocore.LossScaler(sharded.group, dynamic=False)
    h = hashlib.sha256()
    for step in range(3):
        ids = hf_models.batch(step, 2 * world_size).chunk(world_size)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        h.update(struct.pack("<d", loss.item()))
        h.update(struct.pack("<d", scaler.step(opt, max_norm=0.5).grad_norm))
        opt.zero_grad()
    for name, t in sorted(sharded.full_state_dict(to_rank=None).items()):
        h.update(name.encode())
        h.update(t.float().numpy().tobytes())
    return h.hexdigest()


# Host memory at 1, 2 and 3 ranks; NVMe at 3 only: its pass, reads and writes are each rank's
# own scratch, a path that does not depend on the count, which host memory covers (CI time).
@pytest.mark.parametrize("size,label", cpu_at_every_size())
def test_a_hugging_face_model_trains_bitwise_with_the_pass_overlapped(worlds, tmp_path, size,
                                                                      label):
    """The other front door on a real model class: ``shard_model``'s root unit (embedding and
    head) and its decoder layers, each gather waiting for its own update."""
    world = worlds(size)
    runs = {}
    for overlap, lag in (("off", False), ("exact", True)):
        scratch = tmp_path / f"{overlap}"
        scratch.mkdir()
        runs[overlap] = world.run(train_hf, label, str(scratch), overlap, lag)
    assert runs["exact"] == runs["off"], runs


def test_overlap_is_checked():
    with pytest.raises(ValueError,
                       match="Offload.overlap must be one of 'exact', 'delayed', 'off'"):
        zerocore.Offload(optimizer="cpu", overlap="later")
    assert zerocore.Offload(optimizer="cpu").overlaps
    assert not zerocore.Offload(optimizer="cpu", overlap="off").overlaps
    assert not zerocore.Offload(params="cpu").overlaps      # nothing of the optimizer's
    assert not zerocore.Offload(optimizer="nvme", params="nvme", path=".").overlaps
