"""Checkpoints of HSDP and hpZ models (a 2-D CPU ``DeviceMesh`` (replicate, shard) over gloo
ranks).

- Saving writes replica 0's rank files alone: a 2x2 model's checkpoint holds 2 rank files, the
  format of a flat checkpoint of 2 ranks, and its manifest says so.
- HSDP 2x2 -> HSDP 2x2: the state loaded is the state saved, the replicas hold the same bits, and
  the steps after the load are bitwise the uninterrupted run's.
- Across layouts: HSDP 2x2 -> flat 3 and flat 1, flat 3 -> HSDP 2x2 and 1x2 and 2x1: the state
  loaded (every fp32 master, Adam moment and step, gathered) is bitwise the state saved. The
  steps after it are bitwise the uninterrupted run's when the run goes back to its own layout
  through the other (HSDP -> flat 3 -> HSDP, flat 3 -> HSDP -> flat 3, with no training in
  between); in the other layout they match it within fp32 rounding (another summation order).
- hpZ 2x2: every rank writes its slice as the flat rank holding it (a flat checkpoint of 4
  ranks), resumes bitwise, and loads to and from HSDP 2x2 and flat 3 as above.

The MLP of tests/support/toy_stack.py, through both front doors, without dropout (the replicas'
random states come back as replica 0's: docs/decisions.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from tests.support.toy_stack import LR, WEIGHT_DECAY, Spec, global_batch, loss_fn, make_layers
from zerocore.checkpoint import list_checkpoints, read_manifest
from zerocore.checkpoint import sharded as sharded_checkpoint

SPEC = Spec(model="mlp")
# 12 rows each step, whatever the world: 12 divides by 4, 3, 2 and 1 ranks, so every layout
# trains on the same global batch (each rank's loss a mean over its equal share).
ROWS_AS = 3  # global_batch's LOCAL_BATCH (4) x 3 ranks
SAVE_AT, STEPS = 3, 6
# Another layout sums the ranks' gradients in another order (the shard group, then the
# replicas; or one reduce-scatter over 3), so the losses after a load into it agree with the
# uninterrupted run to fp32 rounding (tests/checkpoints/test_checkpoint.py measures <= 1.7e-7
# relative for its reshards; RESHARD_LOSS_TOL), far below what a shard restored at a wrong
# offset or a lost moment changes.
OTHER_LAYOUT_LOSS_TOL = dict(rtol=1e-5, atol=0.0)


@dataclasses.dataclass(frozen=True)
class Job:
    door: str                          # "shard" or "shard_model"
    shape: tuple[int, int] | None      # the mesh's (replicas, shards); None: flat over the world
    layout: str = "hsdp"               # with a mesh, zerocore.Hybrid's layout
    stop: int = STEPS                  # train until this global step
    load: str | None = None            # load this checkpoint first (its step is the start)
    save: str | None = None            # save under this root ...
    save_at: int = SAVE_AT             # ... at this step


def _build(job: Job):
    layers = make_layers(SPEC)
    mesh = (init_device_mesh("cpu", job.shape, mesh_dim_names=("replicate", "shard"))
            if job.shape is not None else None)
    hybrid = zerocore.Hybrid(job.layout) if mesh is not None else None
    if job.door == "shard":
        model = zerocore.shard(layers, mesh=mesh, hybrid=hybrid)
        return model, model
    model = nn.Sequential(*layers)
    return model, zerocore.shard_model(model, [model[0], model[1]], mesh=mesh, hybrid=hybrid)


def in_slice_order(chunks: list[torch.Tensor], sharding) -> list[torch.Tensor]:
    """Every rank's shard, gathered in the rank order of ``sharding.group``, in the order of
    the slices they hold: the same but for hpZ, where rank w of an R x S mesh (row w // S,
    column w % S) holds slice (w % S)·R + w // S."""
    if not sharding.mesh.hpz:
        return chunks
    replicas, shards = sharding.mesh.shape
    out = [None] * len(chunks)
    for w, chunk in enumerate(chunks):
        out[(w % shards) * replicas + w // shards] = chunk
    return out


def full_state(sharding, opt) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master and Adam moments (all-gathered over the shard
    group, cut along the slots) and its layer's step: what a checkpoint carries."""
    out = {}
    for layer in sharding.layers:
        g = layer.trainable
        if g is None:
            continue
        state = opt.state.get(g.shard, {})
        for key in ("master", "exp_avg", "exp_avg_sq"):
            t = g.shard if key == "master" else state.get(key, torch.zeros_like(g.shard))
            t = t.detach().contiguous()
            flat = torch.empty(t.numel() * sharding.world_size, dtype=t.dtype)
            dist.all_gather_into_tensor(flat, t, group=sharding.group)
            flat = torch.cat(in_slice_order(list(flat.chunk(sharding.world_size)), sharding))
            for s in g.layout.slots:
                out[f"{key}:{sharding.param_name(layer.index, s.name)}"] = \
                    flat[s.offset:s.offset + s.numel].view(s.shape).clone()
        out[f"step:{layer.index}"] = torch.tensor(float(state.get("step", 0.0)))
    return out


def save(model, sharding, opt, root: str, step: int) -> dict[str, Any]:
    """Saves, recording the names of the files this rank wrote."""
    written: list[str] = []
    write_file = sharded_checkpoint.write_file

    def counted(path: Path, fill) -> Any:
        written.append(Path(path).name)
        return write_file(path, fill)

    with mock.patch.object(sharded_checkpoint, "write_file", counted):
        path = zerocore.save_checkpoint(root, step, model, opt)
    return {"saved_path": str(path), "saved": full_state(sharding, opt), "written": written}


def run(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    model, sharding = _build(job)
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    out: dict[str, Any] = {"losses": {}}
    start = 0
    if job.load is not None:
        zerocore.load_checkpoint(job.load, model, opt)
        start = read_manifest(job.load)["step"]
        out["loaded"] = full_state(sharding, opt)
        out["shards"] = [s.detach().clone() for s in sharding.trainable_shards()]
    for step in range(start, job.stop):
        if job.save is not None and step == job.save_at:
            out.update(save(model, sharding, opt, job.save, step))
        x, y = global_batch(SPEC, step, 0, ROWS_AS)
        loss = loss_fn(SPEC, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().reshape(1).double()
        dist.all_reduce(mean)
        out["losses"][step] = mean.item() / world_size
    if job.save is not None and job.save_at == job.stop:
        out.update(save(model, sharding, opt, job.save, job.stop))
    out["final"] = full_state(sharding, opt)
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_replicas_equal(results: list[dict[str, Any]], shape: tuple[int, int]) -> None:
    """Each replica's rank holds its shard-group twin's bits (the mesh's rows: ranks
    r * shards + s)."""
    replicas, shards = shape
    for r in range(1, replicas):
        for s in range(shards):
            for a, b in zip(results[s]["shards"], results[r * shards + s]["shards"]):
                assert torch.equal(a, b), f"replica {r} shard {s} differs from replica 0's"


# A layout: (the mesh's shape, or None for flat; the flat world's size; Hybrid's layout).
Layout = tuple[tuple[int, int] | None, int, str]
HSDP_2X2: Layout = ((2, 2), 0, "hsdp")
HPZ_2X2: Layout = ((2, 2), 0, "hpz")


def _world(layout: Layout) -> int:
    shape, flat, _ = layout
    return shape[0] * shape[1] if shape is not None else flat


def _job(door: str, layout: Layout, **rest) -> Job:
    return Job(door, layout[0], layout[2], **rest)


def _check_replicas(results: list[dict[str, Any]], layout: Layout) -> None:
    shape, _, kind = layout
    if shape is not None and kind == "hsdp":
        assert_replicas_equal(results, shape)


def _uninterrupted(worlds, door: str, layout: Layout, root: Path) -> dict[str, Any]:
    """The uninterrupted run of a layout, saving at SAVE_AT on the way (rank 0's results)."""
    results = worlds(_world(layout)).run(run, _job(door, layout, save=str(root)))
    return results[0]


@pytest.mark.parametrize("door", ["shard", "shard_model"])
def test_hsdp_writes_one_replica_and_resumes_bitwise(worlds, tmp_path, door):
    results = worlds(4).run(run, Job(door, (2, 2), save=str(tmp_path)))
    ref = results[0]
    path = Path(ref["saved_path"])
    # Replica 0's shard group wrote its 2 rank files; replica 1 wrote nothing.
    assert sorted(p.name for p in path.iterdir()) == ["COMMIT", "manifest.json",
                                                      "rank-00000.pt", "rank-00001.pt"]
    assert read_manifest(path)["world_size"] == 2
    assert [r["written"] for r in results] == [["rank-00000.pt", "manifest.json", "COMMIT"],
                                               ["rank-00001.pt"], [], []]
    assert list(tmp_path.iterdir()) == [path]  # no temporary directory left behind
    resumed = worlds(4).run(run, Job(door, (2, 2), load=str(path)))
    assert_replicas_equal(resumed, (2, 2))
    for r in resumed:
        assert_bitwise(r["loaded"], ref["saved"], "state loaded")
        assert r["losses"] == {s: ref["losses"][s] for s in range(SAVE_AT, STEPS)}
        assert_bitwise(r["final"], ref["final"], "state after the resumed steps")


# (saved layout, loaded layout, the front door)
ACROSS = {
    "hsdp2x2-to-flat3": (HSDP_2X2, (None, 3, "hsdp"), "shard"),
    "hsdp2x2-to-flat1": (HSDP_2X2, (None, 1, "hsdp"), "shard_model"),
    "flat3-to-hsdp2x2": ((None, 3, "hsdp"), HSDP_2X2, "shard_model"),
    "flat3-to-hsdp1x2": ((None, 3, "hsdp"), ((1, 2), 0, "hsdp"), "shard"),
    "flat3-to-hsdp2x1": ((None, 3, "hsdp"), ((2, 1), 0, "hsdp"), "shard"),
    # hpZ: to HSDP and back, to flat 3 and back (each a load from the other's files).
    "hpz2x2-to-hsdp2x2": (HPZ_2X2, HSDP_2X2, "shard"),
    "hpz2x2-to-flat3": (HPZ_2X2, (None, 3, "hsdp"), "shard_model"),
}


@pytest.mark.parametrize("case", ACROSS)
def test_load_across_layouts(worlds, tmp_path, case):
    saved, loaded, door = ACROSS[case]
    ref = _uninterrupted(worlds, door, saved, tmp_path / "ref")
    path = ref["saved_path"]
    # Into the other layout: loaded bitwise, and the steps after it within fp32 rounding.
    other = worlds(_world(loaded)).run(run, _job(door, loaded, load=path))
    _check_replicas(other, loaded)
    for r in other:
        assert_bitwise(r["loaded"], ref["saved"], "state loaded into the other layout")
        for s in range(SAVE_AT, STEPS):
            torch.testing.assert_close(r["losses"][s], ref["losses"][s],
                                       **OTHER_LAYOUT_LOSS_TOL)
    # Through the other layout and back, with no step in between: bitwise the uninterrupted
    # run, whatever the world sizes the files were written by.
    through = worlds(_world(loaded)).run(
        run, _job(door, loaded, load=path, stop=SAVE_AT, save=str(tmp_path / "through")))
    back = worlds(_world(saved)).run(run, _job(door, saved, load=through[0]["saved_path"]))
    _check_replicas(back, saved)
    for r in back:
        assert_bitwise(r["loaded"], ref["saved"], "state loaded back")
        assert r["losses"] == {s: ref["losses"][s] for s in range(SAVE_AT, STEPS)}
        assert_bitwise(r["final"], ref["final"], "state after the resumed steps")


@pytest.mark.parametrize("door", ["shard", "shard_model"])
def test_hpz_writes_every_slice_and_resumes_bitwise(worlds, tmp_path, door):
    results = worlds(4).run(run, _job(door, HPZ_2X2, save=str(tmp_path)))
    ref = results[0]
    path = Path(ref["saved_path"])
    # The state is flat over the 4 ranks: each wrote the rank file of the slice it holds
    # (rank 1, row 0 column 1, holds slice 2), rank 0 (slice 0) the manifest and COMMIT too.
    assert sorted(p.name for p in path.iterdir()) == [
        "COMMIT", "manifest.json", "rank-00000.pt", "rank-00001.pt", "rank-00002.pt",
        "rank-00003.pt"]
    assert read_manifest(path)["world_size"] == 4
    assert [r["written"] for r in results] == [["rank-00000.pt", "manifest.json", "COMMIT"],
                                               ["rank-00002.pt"], ["rank-00001.pt"],
                                               ["rank-00003.pt"]]
    resumed = worlds(4).run(run, _job(door, HPZ_2X2, load=str(path)))
    for r in resumed:
        assert_bitwise(r["loaded"], ref["saved"], "state loaded")
        assert r["losses"] == {s: ref["losses"][s] for s in range(SAVE_AT, STEPS)}
        assert_bitwise(r["final"], ref["final"], "state after the resumed steps")


def save_asked_apart(rank: int, world_size: int, root: str) -> str:
    model, sharding = _build(Job("shard", (2, 2)))
    opt = zerocore.optim.AdamW(sharding.trainable_shards(), lr=LR)
    try:  # rank 3, of replica 1 (which writes nothing), is asked another step
        zerocore.save_checkpoint(root, 5 if rank == 3 else 4, model, opt)
    except ValueError as e:
        return str(e)
    return "saved"


def test_a_replica_that_writes_nothing_still_agrees(worlds, tmp_path):
    # Every rank of the mesh agrees on the save, not only replica 0's shard group.
    for message in worlds(4).run(save_asked_apart, str(tmp_path)):
        assert "rank 3 was asked to save step 5" in message and "rank 0 step 4" in message
    # Nothing committed (the leader's empty temporary directory, made before the refusal came
    # back, is a leftover the next save removes, as for a flat save).
    assert list_checkpoints(tmp_path) == []
    assert all(".tmp-" in p.name and not any(p.iterdir()) for p in tmp_path.iterdir())
