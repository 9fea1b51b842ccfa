"""The NVMe pool chosen from the host's memory (issue 44): ``Offload(pool_bytes=None)``, the
default, takes the largest power of two from 256 MiB to 1 GiB whose copies on the model's ranks
of a host take at most 1/20 of its physical memory (``zerocore.auto_pool_bytes``); every rank
takes the smallest any host allows (``agreed_pool_bytes``), and the plan chooses the same from
its host memory and ranks per node. An explicit ``pool_bytes`` is kept as given."""

from __future__ import annotations

import collections
import logging
import socket

import pytest
import torch

import zerocore
from zerocore.engine.host_arena import host_memory_bytes
from zerocore.engine.scratch_file import size_text
from zerocore.policies import (AUTO_POOL_HOST_SHARE, DEFAULT_POOL_BYTES, MAX_AUTO_POOL_BYTES,
                               MIN_POOL_BYTES, agreed_pool_bytes, auto_pool_bytes)
from tests.support.offload_stack import BATCH, SEQ, layer_stack, stack_loss

WORLD_SIZES = [1, 2, 3]

GiB, MiB, GB = 2**30, 2**20, 10**9


# -- the host's memory: the machine's, or its container's limit -----------------------------------

def _cgroups(tmp_path, files: dict[str, str], proc: str) -> tuple[str, str]:
    """A cgroup mount under ``tmp_path`` holding ``files`` (path: text), and a
    /proc/self/cgroup saying ``proc``: (root, proc file)."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(root), str(tmp_path / "proc_cgroup")


@pytest.mark.parametrize("files, proc, limit", [
    ({"memory.max": str(8 * GiB)}, "0::/\n", 8 * GiB),                        # v2, namespaced
    ({"job/memory.max": str(6 * GiB)}, "0::/job\n", 6 * GiB),                  # v2, its own
    ({"memory/job/memory.limit_in_bytes": str(4 * GiB)},
     "4:memory:/job\n0::/\n", 4 * GiB),                                        # v1
    ({"memory/memory.limit_in_bytes": str(3 * GiB)}, "4:cpu,memory:/\n", 3 * GiB),  # v1 root
    ({"memory.max": "max"}, "0::/\n", None),                                    # no limit
    ({"memory/memory.limit_in_bytes": str(2**63 - 4096)}, "4:memory:/\n", None),  # v1's none
    ({}, "garbled\n", None),                                                    # nothing read
])
def test_the_hosts_memory_is_the_containers_limit_when_lower(tmp_path, files, proc, limit):
    physical = host_memory_bytes(str(tmp_path / "none"), str(tmp_path / "none"))
    root, proc_file = _cgroups(tmp_path, files, proc)
    assert host_memory_bytes(root, proc_file) == min(physical, limit or physical)


def test_a_container_of_eight_ranks_in_16_gb_keeps_the_floor(tmp_path):
    # One rank of eight in a 16 GB container on a machine of any size: 16 GB / 20 / 8 = 100 MB,
    # so the floor, where the machine's own memory would have given more.
    root, proc_file = _cgroups(tmp_path, {"memory.max": str(16 * GB)}, "0::/\n")
    assert auto_pool_bytes(host_memory_bytes(root, proc_file), 8) == DEFAULT_POOL_BYTES


# -- the rule, on hosts of given sizes ----------------------------------------------------------

@pytest.mark.parametrize("memory, ranks, pool", [
    (24 * GB, 1, GiB),             # a workstation of one GPU: the ceiling (1.12 GiB allowed)
    (24683772 * 1024, 1, GiB),     # this project's machine (its MemTotal)
    (128 * GiB, 8, 512 * MiB),     # issue 31's node of eight 24 GB GPUs (0.8 GiB allowed)
    (128 * GB, 8, 512 * MiB),      # the same node counted in decimal gigabytes
    (128 * GiB, 16, 256 * MiB),    # sixteen ranks there: 0.4 GiB allowed
    (2 * 10**12, 8, GiB),          # a large node of 2 TB: the ceiling
    (4 * GiB, 1, 256 * MiB),       # a small host: the floor (205 MiB allowed)
    (1 * GiB, 4, 256 * MiB),       # a tiny one: the floor still (what every run got before)
    (20 * 512 * MiB * 3, 3, 512 * MiB),   # exactly 512 MiB allowed: taken
    (20 * 512 * MiB * 3 - 1, 3, 256 * MiB),   # a byte less: the power of two below
])
def test_the_pool_is_the_largest_power_of_two_the_hosts_share_allows(memory, ranks, pool):
    assert auto_pool_bytes(memory, ranks) == pool
    assert pool & (pool - 1) == 0 and DEFAULT_POOL_BYTES <= pool <= MAX_AUTO_POOL_BYTES
    # The pools of the host's ranks fit its share, unless at the floor.
    assert pool * ranks <= memory // AUTO_POOL_HOST_SHARE or pool == DEFAULT_POOL_BYTES


def test_the_rule_refuses_no_ranks():
    with pytest.raises(ValueError, match="0 ranks on a host"):
        auto_pool_bytes(GiB, 0)


def test_the_ranks_agree_on_the_smallest_any_host_allows():
    # Eight ranks on a node of 128 GiB (512 MiB each) and one on a host of 24 GB (1 GiB): the
    # node's, whichever order the ranks are listed in.
    node, desk = [("node", 128 * GiB)] * 8, [("desk", 24 * GB)]
    assert agreed_pool_bytes(node + desk) == agreed_pool_bytes(desk + node) == 512 * MiB
    assert agreed_pool_bytes(desk) == GiB
    # The ranks are counted per host: two ranks of 24 GB hosts, one each, keep 1 GiB; on one
    # host of 24 GB, 512 MiB each.
    assert agreed_pool_bytes([("a", 24 * GB), ("b", 24 * GB)]) == GiB
    assert agreed_pool_bytes([("a", 24 * GB), ("a", 24 * GB)]) == 512 * MiB


def test_an_explicit_pool_is_kept_and_none_is_the_default():
    assert zerocore.Offload().pool_bytes is None
    given = zerocore.Offload(optimizer="nvme", path=".", pool_bytes=MIN_POOL_BYTES)
    assert given.with_pool(128 * GiB, 1) is given
    auto = zerocore.Offload(optimizer="nvme", path=".")
    assert auto.with_pool(128 * GiB, 8).pool_bytes == 512 * MiB
    with pytest.raises(ValueError, match="must be None .chosen from the host's memory. or an "
                                         "int >= 49152"):
        zerocore.Offload(optimizer="nvme", path=".", pool_bytes=MIN_POOL_BYTES - 1)


# -- the engine: every rank the same pool --------------------------------------------------------

class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def made_up_platform(host: str, memory: int | None) -> zerocore.Platform:
    """This CPU process as a host named ``host`` that gives it ``memory`` bytes."""
    return zerocore.Platform(host=host, torch_cuda=torch.version.cuda, cuda_device_count=0,
                             kernels_cuda=False, device_uuid=None, usable_cores=1,
                             host_memory=memory)


def build_and_read_the_pool(rank: int, world_size: int, path: str, pool: int | None,
                            hosts: list[tuple[str, int | None]] | None = None) -> dict:
    """The stack offloaded to NVMe with ``pool_bytes=pool``: this rank's pool, whether it was
    chosen, the report's row, and (rank 0) the start-up line that names it. ``hosts``: each
    rank's made-up host and memory (``shard(platform=)``); None: this machine's."""
    lines = _Lines()
    logger = logging.getLogger("zerocore.engine.sharding")
    logger.addHandler(lines)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    platform = made_up_platform(*hosts[rank]) if hosts is not None else None
    try:
        model = zerocore.shard(layer_stack(), offload=zerocore.Offload(
            optimizer="nvme", path=path, pool_bytes=pool), platform=platform)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    store = model.ctx.store
    report = model.memory_report()
    return dict(pool=store.pool_bytes, chosen=store.pool_chosen,
                report=(report.nvme_pool_bytes, report.nvme_pool_chosen),
                table=report.table(), host=(socket.gethostname(), host_memory_bytes()),
                line=[line for line in lines.lines if "NVMe offload:" in line])


def test_every_rank_chooses_the_same_pool_from_the_hosts_memory(world, tmp_path):
    got = world.run(build_and_read_the_pool, str(tmp_path), None)
    # What each rank's host is, as the ranks exchanged it: the same rule on the same list.
    expected = agreed_pool_bytes([r["host"] for r in got])
    assert [r["pool"] for r in got] == [expected] * world.world_size, got
    assert all(r["chosen"] and r["report"] == (expected, True) for r in got), got
    assert all("of which NVMe pool, auto" in r["table"] for r in got)
    line, = got[0]["line"]
    assert f"a pool of {expected / MiB:.1f} MiB (chosen from the host's memory" in line, line
    assert f"{world.world_size} rank(s) of this model on a host" in line, line
    assert all(r["line"] == [] for r in got[1:])


# Each rank's made-up host and memory, for a world of n ranks (rank r the r-th), and the pool
# every rank must take: the smallest any host allows.
MADE_UP_HOSTS = {
    # A small host beside a large one: the small one's 4 GiB / 20 leaves the floor to all.
    "a small host beside a large one": (
        lambda n: [("a", 4 * GiB)] + [("b", 128 * GiB)] * (n - 1), DEFAULT_POOL_BYTES),
    # A host per rank, the smallest 16 GiB: 0.8 GiB allowed, 512 MiB to all.
    "a host per rank": (lambda n: [(f"host-{r}", 16 * GiB * (r + 1)) for r in range(n)],
                        512 * MiB),
}


@pytest.mark.parametrize("case", MADE_UP_HOSTS)
def test_every_rank_chooses_the_pool_from_the_hosts_its_platform_names(world, tmp_path, case):
    # The hosts come from each rank's Platform (shard(platform=)), as the ranks agreed on them,
    # not from this machine: ranks of one machine told they are on other hosts of other sizes
    # all take the pool those hosts allow. The two cases want pools of two sizes: a rank that
    # read this machine's name and memory instead would take one size in both, and its line
    # would name this machine's memory and world_size ranks on one host.
    hosts_of, pool = MADE_UP_HOSTS[case]
    hosts = hosts_of(world.world_size)
    assert agreed_pool_bytes(hosts) == pool
    got = world.run(build_and_read_the_pool, str(tmp_path), None, hosts)
    assert [r["pool"] for r in got] == [pool] * world.world_size, got
    assert all(r["chosen"] and r["report"] == (pool, True) for r in got), got
    assert all("of which NVMe pool, auto" in r["table"] for r in got)
    line, = got[0]["line"]
    most = max(collections.Counter(host for host, _ in hosts).values())
    smallest = min(memory for _, memory in hosts)
    assert (f"a pool of {pool / MiB:.1f} MiB (chosen from the host's memory, "
            f"Offload.pool_bytes=None: {most} rank(s) of this model on a host, "
            f"{size_text(smallest)} the smallest host") in line, line


def refused_without_host_memory(rank: int, world_size: int, path: str,
                                pool: int | None) -> str | None:
    """The stack offloaded to NVMe on a platform that does not say its host's memory (rank
    0's): the refusal, or None when it builds."""
    try:
        build_and_read_the_pool(rank, world_size, path, pool,
                                [("a", None)] + [("b", 128 * GiB)] * (world_size - 1))
    except ValueError as e:
        return str(e)
    return None


def test_a_platform_without_its_hosts_memory_needs_a_pool(world, tmp_path):
    # A pool chosen from the hosts' memory is refused on every rank, naming the rank whose
    # memory is not known; a given pool needs none.
    for refusal in world.run(refused_without_host_memory, str(tmp_path), None):
        assert refusal is not None and "rank(s) [0] were given a Platform without " \
            "host_memory" in refusal, refusal
    assert world.run(refused_without_host_memory, str(tmp_path), MIN_POOL_BYTES) == \
        [None] * world.world_size


def test_an_explicit_pool_is_the_pool_on_every_rank(world, tmp_path):
    got = world.run(build_and_read_the_pool, str(tmp_path), MIN_POOL_BYTES)
    assert all(r["pool"] == MIN_POOL_BYTES and not r["chosen"]
               and r["report"] == (MIN_POOL_BYTES, False) for r in got), got
    assert "auto" not in got[0]["table"] and "chosen from" not in got[0]["line"][0]


# -- the plan: the same pool from its host memory and ranks per node ----------------------------

def planned(world_size: int, device: str = "cpu", pool: int | None = None,
            **kw) -> zerocore.plan.MemoryPlan:
    return zerocore.plan.plan(layer_stack("meta"),
                              torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=world_size, loss=stack_loss, device=device,
                              offload=zerocore.Offload(optimizer="nvme", path="(planned)",
                                                       pool_bytes=pool), **kw)


def planned_pool(world_size: int, **kw) -> int:
    return planned(world_size, **kw).state.pool


def _pool_row(plan: zerocore.plan.MemoryPlan) -> str:
    row, = [line for line in plan.table().splitlines() if "NVMe pool" in line]
    return row


@pytest.mark.parametrize("device, host", [("cpu", ""), ("cuda", " (host)")])
def test_the_plans_pool_row_says_when_the_pool_was_chosen(device, host):
    # As a run's memory_report says "NVMe pool, auto": the pool the plan chose from its host
    # memory (a node of 128 GiB, two ranks: 1 GiB), and not a given one of the same size.
    chosen = planned(2, device, host_memory=128 * GiB)
    given = planned(2, device, pool=GiB, host_memory=128 * GiB)
    assert chosen.state.pool == given.state.pool == GiB
    assert chosen.state.pool_chosen and not given.state.pool_chosen
    assert _pool_row(chosen).split() == f"NVMe pool, auto{host} 1.00 GiB".split()
    assert _pool_row(given).split() == f"NVMe pool{host} 1.00 GiB".split()
    # plan_model chooses it too, and says so.
    model = torch.nn.Sequential(*layer_stack("meta"))
    for_model = zerocore.plan.plan_model(
        model, list(model), torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
        world_size=2, loss=stack_loss, device=device, host_memory=128 * GiB,
        offload=zerocore.Offload(optimizer="nvme", path="(planned)"))
    assert for_model.state.pool_chosen and _pool_row(for_model) == _pool_row(chosen)


def test_the_plan_chooses_the_pool_the_built_store_holds(world, tmp_path):
    # Planned on this machine, for the ranks of one host: the pool the run built.
    built = world.run(build_and_read_the_pool, str(tmp_path), None)[0]["pool"]
    assert planned_pool(world.world_size) == built


def test_the_plan_chooses_the_pool_from_its_host_memory_and_ranks_per_node():
    # Issue 31's node: eight ranks on 128 GiB, 512 MiB each; the same ranks on two nodes, four
    # a node: 1 GiB; as HSDP's two replicas (a node each): 1 GiB; one rank on 4 GiB: the floor.
    assert planned_pool(8, host_memory=128 * GiB) == 512 * MiB
    assert planned_pool(8, host_memory=128 * GiB, nodes=2) == GiB
    assert planned_pool(8, host_memory=128 * GiB, mesh=(2, 4)) == GiB
    assert planned_pool(1, host_memory=4 * GiB) == DEFAULT_POOL_BYTES
    with pytest.raises(ValueError, match="host_memory must be a number of bytes above 0"):
        planned_pool(1, host_memory=0)
