"""The NVMe store (zerocore/engine/nvme_store.py) and its scratch file (engine/scratch_file.py),
in one process: values round-trip through direct and buffered I/O; a pass over chunks steps each
chunk once, in order, while the next is read and the last written; a failed transfer stops the
pass once nothing is in flight; the file has no name and its space goes with it.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

import pytest
import torch
import torch.distributed as dist

from zerocore.engine.nvme_store import BUFFER_BYTES, BUFFERS, NvmeIOError, NvmeStore
from zerocore.engine.scratch_file import BLOCK, ScratchFile, ScratchSpaceError
from zerocore.policies import MIN_POOL_BYTES
from tests.support.scratch_disk import no_direct_io, private_disk, scratch_fds


def pool(nbytes: int) -> torch.Tensor:
    """Page-aligned host memory, as the host arena gives the store."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def store_in(path, *, direct: bool = True, file: ScratchFile | None = None) -> NvmeStore:
    return NvmeStore(file or ScratchFile(str(path), direct=direct), pool(MIN_POOL_BYTES),
                     group=dist.GroupMember.WORLD, device=torch.device("cpu"))


# Odd sizes: partial last chunks, arrays that end inside a block.
SIZES = [1, 1023, 1024, 5000, 3 * 1024 + 17]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_values_round_trip_and_a_pass_steps_every_chunk_once(tmp_path, direct):
    store = store_in(tmp_path, direct=direct)
    assert store.file.direct == direct  # /tmp's file systems allow O_DIRECT (ext4, tmpfs 6.6+)
    g = torch.Generator().manual_seed(0)
    records, want = [], []
    for n in SIZES:
        record = store.add_adam(n, "a test's arrays")
        values = [torch.randn(n, generator=g) for _ in range(3)]
        for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values):
            record.write(key, v)
        records.append(record)
        want.append(values)
    # Every array reads back as written (whole arrays, through the pool).
    for record, values in zip(records, want):
        for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values):
            assert torch.equal(record.read(key), v)
            assert torch.equal(record.mapped(key), v)
    # A pass: each chunk's arrays arrive as stored, are changed in place, and are stored back.
    seen = []

    def step(chunk, master, exp_avg, exp_avg_sq, copy):
        assert copy is None  # (no model copies in this store)
        i = records.index(chunk.record)
        for a, v in zip((master, exp_avg, exp_avg_sq), want[i]):
            assert torch.equal(a, v[chunk.lo:chunk.hi])
        master.mul_(2)
        exp_avg.add_(1)
        exp_avg_sq.zero_()
        seen.append((i, chunk.lo, chunk.hi))

    chunks = [c for r in records for c in store.chunks(r)]
    store.stream(chunks, step)
    assert seen == [(records.index(c.record), c.lo, c.hi) for c in chunks]
    assert len(chunks) > BUFFERS and store.chunk_numel == 1024  # several chunks in flight
    for record, (m, a, v) in zip(records, want):
        assert torch.equal(record.read("master"), m * 2)
        assert torch.equal(record.read("exp_avg"), a + 1)
        assert torch.equal(record.read("exp_avg_sq"), torch.zeros_like(v))


class GatedFile(ScratchFile):
    """A scratch file whose transfers of chunk k wait until the pass has begun stepping the
    chunk after k (reads of k, of the chunk before: k - 1) — possible only if the pass overlaps
    them with that step. A pass that read each chunk just before stepping it, or waited for
    each write before the next step, would wait forever: the gates time out instead."""

    def __init__(self, directory: str, starts: list[threading.Event], chunk_bytes: int):
        super().__init__(directory)
        self.starts, self.chunk_bytes = starts, chunk_bytes
        self.timed_out: list[str] = []
        self.gated = False       # set once the test's arrays are laid out
        self.region_bytes = 1    # the span of one array: chunk k of each is at k·chunk_bytes

    def _gate(self, offset: int, which: int, what: str) -> None:
        k = (offset % self.region_bytes) // self.chunk_bytes + which
        if 0 <= k < len(self.starts) and not self.starts[k].wait(timeout=20):
            self.timed_out.append(f"{what} of chunk {k - which}")

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        if self.gated:
            self._gate(offset, -1, "read")   # chunk k is read while chunk k - 1 is stepped
        super().read(offset, buffer)

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        if self.gated:
            self._gate(offset, +1, "write")  # chunk k is written while chunk k + 1 is stepped
        super().write(offset, buffer)


def test_a_pass_reads_ahead_and_writes_behind_while_it_steps(tmp_path):
    chunks_n = 8
    starts = [threading.Event() for _ in range(chunks_n)]
    file = GatedFile(str(tmp_path), starts, chunk_bytes=1024 * 4)
    store = store_in(tmp_path, file=file)
    record = store.add_adam(chunks_n * store.chunk_numel, "a test's arrays")
    file.region_bytes = record.master.span
    file.gated = True

    def step(chunk, master, exp_avg, exp_avg_sq, copy):
        starts[chunk.lo // store.chunk_numel].set()

    store.stream(store.chunks(record), step)
    assert file.timed_out == []


class FailingFile(ScratchFile):
    """Its seventh write fails as a full disk does; it counts the transfers under way."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.writes = self.active = 0
        self.lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self.lock:
            self.active += n

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        self._count(1)
        try:
            super().read(offset, buffer)
        finally:
            self._count(-1)

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        self._count(1)
        try:
            self.writes += 1
            if self.writes == 7:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            super().write(offset, buffer)
        finally:
            self._count(-1)


def test_a_failed_write_ends_the_pass_with_nothing_in_flight(tmp_path):
    file = FailingFile(str(tmp_path))
    store = store_in(tmp_path, file=file)
    record = store.add_adam(8 * store.chunk_numel, "a test's arrays")
    stepped = []
    with pytest.raises(NvmeIOError, match="writing the scratch in .* failed: No space left on "
                                          "device; the state there is now part-stepped") as e:
        store.stream(store.chunks(record), lambda c, *a: stepped.append(c.lo))
    assert e.value.errno == errno.ENOSPC
    # The third chunk's write failed (three arrays each): the pass stopped there, having
    # stepped at most the chunks read ahead, and no transfer was under way when it raised.
    assert 3 <= len(stepped) < 8 and file.active == 0, (stepped, file.active)


def test_a_step_writes_the_model_copies_it_is_given(tmp_path):
    """With params="nvme" a record holds its model copy too: a pass hands ``step`` the
    chunk's copy (not read: the step writes all of it) and writes it back with the rest."""
    store = NvmeStore(ScratchFile(str(tmp_path)), pool(4 * MIN_POOL_BYTES // 3),
                      group=dist.GroupMember.WORLD, device=torch.device("cpu"), copies=True)
    record = store.add_adam(2500, "a test's arrays", copy_dtype=torch.bfloat16)
    record.write("master", torch.linspace(-1, 1, 2500))

    def step(chunk, master, exp_avg, exp_avg_sq, copy):
        assert copy.dtype == torch.bfloat16 and copy.numel() == master.numel()
        copy.copy_(master * 3)
    store.stream(store.chunks(record), step)
    assert len(store.chunks(record)) > 1
    assert torch.equal(store.read_values(record.copy),
                       (torch.linspace(-1, 1, 2500) * 3).to(torch.bfloat16))


def test_the_gathers_reads_are_read_ahead_in_the_order_they_came_last_time(tmp_path):
    """``window_source``: each region's values, read when asked the first time round; from
    the second, the regions that followed the last two reads are on their way before they
    are asked for (a forward's order, then a backward's, where a layer read twice is
    followed by another each time)."""
    store = store_in(tmp_path)
    regions = []
    for i in range(4):
        region = store.add_region(1000 + i, torch.bfloat16, "a test's shard")
        store.write_values(region, torch.full((1000 + i,), float(i)))
        regions.append(region)
    store.use_slots(max(r.span for r in regions))
    order = [0, 1, 2, 3, 2, 1]   # forward 0..3, backward 2, 1 (3 kept, 0 has none)
    for step in range(4):
        for i in order:
            values, slot = store.window_source(regions[i])
            assert torch.equal(values, torch.full((1000 + i,), float(i), dtype=torch.bfloat16))
            store.window_copied(slot, None)
        if step == 0:
            assert (store.reads_ahead, store.reads_waited) == (0, len(order))
    # The first step read everything when asked, the second learnt what follows its end (its
    # first two reads), every later one found everything read ahead.
    assert store.reads_waited == len(order) + 2, (store.reads_ahead, store.reads_waited)
    assert store.reads_ahead == 4 * len(order) - store.reads_waited
    with pytest.raises(ValueError, match=r"\(28,672 bytes each here.*give pool_bytes >= 57344"):
        store.use_slots(24 * 1024 + 1)


def test_the_file_has_no_name_and_its_space_goes_with_it(tmp_path):
    with private_disk(tmp_path / "disk", size="8m") as disk:
        before = disk.used()
        store = store_in(disk.path)
        store.add_adam(256 * 1024, "a test's arrays")   # 3 MiB reserved
        assert os.listdir(disk.path) == []
        held = scratch_fds(os.getpid(), disk.path)
        assert len(held) == 1 and held[0].endswith("(deleted)"), held
        if disk.exact:
            assert disk.used() - before >= 3 * 2**20
        store.file.close()
        assert scratch_fds(os.getpid(), disk.path) == []
        if disk.exact:
            assert disk.used() == before


def test_a_disk_without_room_is_one_line_saying_how_much(tmp_path):
    with private_disk(tmp_path / "disk", size="1m") as disk:
        if not disk.exact:
            pytest.skip("no file system of the test's own (not root): the file-size limit "
                        "stands in for it in tests/engine/test_nvme_offload.py")
        store = store_in(disk.path)
        with pytest.raises(ScratchSpaceError, match=r"no room for the scratch: a test's arrays "
                                                    r"need 4.0 MiB more .* 'No space left on "
                                                    r"device' with 1.0 MiB free") as e:
            store.add_adam(1 << 20, "a test's arrays")
        assert e.value.errno == errno.ENOSPC and "\n" not in str(e.value)


def test_a_file_system_that_refuses_direct_io_gets_buffered_io(tmp_path):
    with no_direct_io(tmp_path / "ramfs") as where:
        if where is None:
            pytest.skip("no ramfs of the test's own (not root); the buffered path itself runs "
                        "in test_values_round_trip_and_a_pass_steps_every_chunk_once")
        store = store_in(where)
        assert not store.file.direct
        record = store.add_adam(3000, "a test's arrays")
        record.write("master", torch.arange(3000.0))
        assert torch.equal(record.read("master"), torch.arange(3000.0))
        assert os.listdir(where) == []


def test_a_missing_path_is_refused_saying_what_to_do(tmp_path):
    with pytest.raises(ScratchSpaceError, match="no such directory; create it"):
        ScratchFile(str(tmp_path / "missing"))
    assert BLOCK == 4096


class RecordingFile(ScratchFile):
    """Records the offset of each read, and fails the reads while ``failing`` is set (as an
    I/O error), saying so on ``failed``; ``arrived(n)`` waits until ``n`` reads are
    recorded (False when they do not come)."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self.reads: list[int] = []
        self.writes = 0
        self.failing = False
        self.failed = threading.Event()
        self.changed = threading.Condition()

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        with self.changed:
            self.reads.append(offset)
            self.changed.notify_all()
            if self.failing:
                self.failed.set()
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().read(offset, buffer)

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        self.writes += 1
        super().write(offset, buffer)

    def arrived(self, n: int) -> bool:
        with self.changed:
            # (a bound on a hang, not on a time: the reads start as the pass returns)
            return self.changed.wait_for(lambda: len(self.reads) >= n, timeout=30)


def chunk_offsets(store: NvmeStore, chunks) -> list[int]:
    """Where each of ``chunks``'s reads begins in the file (three arrays each)."""
    return [region.offset + c.lo * 4 for c in chunks for region in c.record.regions()]


def a_record(store: NvmeStore, chunks_n: int, seed: int = 0):
    """A record of ``chunks_n`` chunks, and the values written there (master, moments)."""
    g = torch.Generator().manual_seed(seed)
    record = store.add_adam(chunks_n * store.chunk_numel - 5, "a test's arrays")
    values = [torch.randn(record.numel, generator=g) for _ in range(3)]
    for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values):
        record.write(key, v)
    return record, values


def checking(values: list[torch.Tensor], last=None):
    """A pass's ``step``: each chunk's arrays must be ``values``'s (then each is changed, and
    ``values`` with it: what the next pass must read); ``last(chunk)`` runs on the last
    chunk's step, once every read of the pass has arrived."""
    stepped = []

    def step(chunk, *arrays):
        for a, v in zip(arrays, values):
            assert torch.equal(a, v[chunk.lo:chunk.hi]), chunk
            a.add_(1)
            v[chunk.lo:chunk.hi].add_(1)
        stepped.append(chunk.lo)
        if last is not None and chunk.hi == chunk.record.numel:
            last(chunk)
    return step, stepped


def test_the_next_pass_s_first_chunks_are_read_as_a_pass_ends(tmp_path):
    """As a pass ends (its writes done), the first chunks of the next one are read, into the
    buffers it starts with, before it is called: it steps them (the values its own reads
    would give) without reading them again, and reads the rest itself."""
    file = RecordingFile(str(tmp_path))
    store = store_in(tmp_path, file=file)
    record, values = a_record(store, 8)
    chunks = store.chunks(record)
    ahead = chunks[:BUFFERS - 1]
    step, _ = checking(values, last=lambda c: file.reads.clear())
    store.stream(chunks, step)
    assert store.last_pass.chunks_read_ahead == 0  # (the first pass: nothing before it)
    assert store.chunks_read_ahead == BUFFERS - 1
    # Before the next pass is called, its first chunks are read (first chunk first).
    assert file.arrived(3 * len(ahead)), file.reads
    assert file.reads == chunk_offsets(store, ahead)
    file.reads.clear()
    step, stepped = checking(values)
    store.stream(chunks, step)
    assert stepped == [c.lo for c in chunks] and store.last_pass.chunks_read_ahead == 3
    assert file.reads[:3 * (len(chunks) - 3)] == chunk_offsets(store, chunks[3:])
    for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values):
        assert torch.equal(record.read(key), v)


def test_a_larger_pool_is_more_buffers_and_reads_more_chunks_ahead(tmp_path):
    """A pool of five ``BUFFER_BYTES`` is five chunk buffers, not four larger ones (a chunk is
    of one record: larger buffers would hold no more of these small records): the next pass's
    first four chunks are read ahead, and it steps them with the values its own reads give."""
    store = NvmeStore(ScratchFile(str(tmp_path)), pool(5 * BUFFER_BYTES),
                      group=dist.GroupMember.WORLD, device=torch.device("cpu"))
    assert store.buffers == 5
    g = torch.Generator().manual_seed(0)
    records = [store.add_adam(1000 + i, "a test's arrays") for i in range(6)]
    values = {}
    for record in records:
        values[id(record)] = [torch.randn(record.numel, generator=g) for _ in range(3)]
        for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values[id(record)]):
            record.write(key, v)
    chunks = [c for record in records for c in store.chunks(record)]
    assert len(chunks) == 6   # one each

    def step(chunk, *arrays):
        for a, v in zip(arrays, values[id(chunk.record)]):
            assert torch.equal(a, v[chunk.lo:chunk.hi]), chunk
            a.add_(1)
            v[chunk.lo:chunk.hi].add_(1)

    store.stream(chunks, step)
    assert store.chunks_read_ahead == 4
    store.stream(chunks, step)
    assert store.last_pass.chunks_read_ahead == 4
    for record in records:
        for key, v in zip(("master", "exp_avg", "exp_avg_sq"), values[id(record)]):
            assert torch.equal(record.read(key), v)


def test_a_write_between_two_passes_forgets_what_was_read_ahead(tmp_path):
    """A write of whole arrays (a checkpoint loaded, ``set_master``) after the read-ahead:
    the next pass reads the new values itself; the pass after it finds its chunks read ahead
    again."""
    store = store_in(tmp_path)
    record, values = a_record(store, 6)
    chunks = store.chunks(record)
    store.stream(chunks, checking(values)[0])
    assert store.chunks_read_ahead == BUFFERS - 1
    values[0] = torch.arange(float(record.numel))
    record.write("master", values[0])
    store.stream(chunks, checking(values)[0])
    assert store.last_pass.chunks_read_ahead == 0
    store.stream(chunks, checking(values)[0])
    assert store.last_pass.chunks_read_ahead == BUFFERS - 1


def test_a_step_of_several_passes_reads_ahead_the_one_that_follows(tmp_path):
    """Two passes over one store a step (two param groups): each pass's end reads the first
    chunks of the pass that followed it the last time, learnt from the first step."""
    store = store_in(tmp_path)
    first, first_values = a_record(store, 5, seed=1)
    second, second_values = a_record(store, 5, seed=2)
    found = []
    for _ in range(3):
        for record, values in ((first, first_values), (second, second_values)):
            store.stream(store.chunks(record), checking(values)[0])
            found.append(store.last_pass.chunks_read_ahead)
    # Step 1: nothing known (the first pass's end reads its own chunks: the second pass
    # forgets them); from step 2, each pass finds its first chunks.
    assert found == [0, 0, 0, 3, 3, 3], found


def test_a_failed_read_ahead_fails_the_pass_that_uses_it_with_nothing_written(tmp_path):
    """A read ahead that fails is the next pass's failure (NvmeIOError, raised once nothing
    is in flight), before it steps or writes anything; what is on the disk is the last
    pass's, and a pass after that reads it and steps."""
    file = RecordingFile(str(tmp_path))
    store = store_in(tmp_path, file=file)
    record, values = a_record(store, 6)
    chunks = store.chunks(record)

    def fail_from_now(chunk):
        file.failing = True
    store.stream(chunks, checking(values, last=fail_from_now)[0])
    assert file.failed.wait(timeout=30)   # (a bound on a hang: the read ahead failed)
    file.failing = False
    writes = file.writes
    step, stepped = checking(values)
    with pytest.raises(NvmeIOError, match="reading the scratch in .* failed: Input/output "
                                          "error; nothing was changed by this transfer"):
        store.stream(chunks, step)
    assert stepped == [] and file.writes == writes
    step, stepped = checking(values)
    store.stream(chunks, step)
    assert stepped == [c.lo for c in chunks]
