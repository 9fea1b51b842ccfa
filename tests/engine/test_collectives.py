"""comm/collectives.py's ``wait_for``: a timed wait on a collective that tells done, still
running and failed apart, including a timed wait that expires just as its collective completes
(it raises, and the collective is done by the time anyone looks: the CI hang of 2026-12-06,
docs/decisions.md); and ``broadcast_from``, the broadcast that small units' gathers and the
lockstep's rows issue on gloo."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from zerocore.comm.collectives import wait_for


class _Work:
    """A collective's handle whose timed wait behaves as told: ``late`` (it expires, and the
    collective completes as it does), ``running`` (it expires; still running), ``failed`` (the
    backend's error), ``done``."""

    def __init__(self, how: str):
        self.how, self.completed, self.waits = how, how in ("failed", "done"), []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.how == "failed":
            raise RuntimeError("Connection closed by peer")
        if timeout is not None and self.how in ("late", "running"):
            self.completed = self.how == "late"  # (completes as the wait gives up)
            raise RuntimeError("Operation timed out!")
        assert self.completed, "an untimed wait on a collective that never completes: a hang"
        return True

    def is_completed(self) -> bool:
        return self.completed


def test_a_timed_wait_that_expires_as_the_collective_completes_is_done():
    work = _Work("late")
    assert wait_for(work, 0.5) is True
    assert work.waits == [datetime.timedelta(seconds=0.5), None]  # (waited again: done)


def test_a_collective_still_running_is_not_done_and_not_waited_for_again():
    work = _Work("running")
    assert wait_for(work, 0.5) is False
    assert work.waits == [datetime.timedelta(seconds=0.5)]


def test_a_failed_collective_raises_the_backends_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_for(_Work("failed"), 0.5)


def test_a_gloo_collective_that_completes_is_done(tmp_path):
    # The real handle, on a world of one (the stubs above stand for the races a real world
    # cannot be made to hit on demand).
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        t = torch.ones(3)
        assert wait_for(dist.all_reduce(t, async_op=True), 5.0) is True
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


# -- broadcast_from: the process group's own broadcast, rooted by the group's numbering -------

WORLD_SIZES = (2, 3)
DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "complex64", "int64", "uint8")


def broadcast_each_way(rank: int, world_size: int) -> dict[str, bool]:
    """Every rank's tensor of each dtype, broadcast from each root in turn, over the whole
    world and over a subgroup of the last two ranks (whose rank 0 is not global rank 0): what
    arrives is bitwise what the root holds."""
    from zerocore.comm.collectives import broadcast_from

    def made(dtype: torch.dtype, by: int) -> torch.Tensor:  # odd size, the root's own values
        g = torch.Generator().manual_seed(by)
        return (torch.randn(37, generator=g) * 100).to(dtype)

    tail = dist.new_group(ranks=[world_size - 2, world_size - 1])  # (every rank calls it)
    groups = {"world": (dist.group.WORLD, list(range(world_size)))}
    if rank >= world_size - 2:
        groups["tail"] = (tail, [world_size - 2, world_size - 1])
    agreed = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        for where, (group, ranks) in groups.items():
            for root, global_root in enumerate(ranks):
                t = made(dtype, rank)
                broadcast_from(t, root, group).wait()
                want = made(dtype, global_root)
                agreed[f"{name} {where} from {root}"] = bool(
                    t.view(torch.uint8).equal(want.view(torch.uint8)))
    return agreed


def test_broadcast_from_delivers_the_roots_bytes_in_the_groups_numbering(world):
    for rank, agreed in enumerate(world.run(broadcast_each_way)):
        assert agreed and all(agreed.values()), (rank, agreed)
