"""``NvmeStore``: one sharding's model state on NVMe (``Offload(optimizer="nvme")``,
ZeRO-Infinity): where each array lives in the rank's scratch file (engine/scratch_file.py), and
the pipeline that moves it through a bounded pool of host buffers.

Layout. Arrays are laid end to end in the scratch file, each starting on a 4 KiB block, in the
order the layers are built: for each trainable shard its fp32 master (unless the master is the
model copy in host memory: fp32, parameters not on NVMe), then its two Adam moments, then with
``Offload(params="nvme")`` its model copy in the param dtype (an ``AdamRecord``); for
each frozen shard with ``params="nvme"`` its values (int8 ones as their bytes), each contiguous.
A shard is stepped in chunks of ``chunk_numel`` elements (a whole number of blocks of fp32),
chunk k of a shard being elements ``[k·C, (k+1)·C)`` of each of its arrays.

The pool: host memory carved from the host arena (pinned with it on a GPU machine; page-aligned,
what direct I/O needs), used one way at a time:
- by the optimizer's step, as chunk buffers (``BUFFERS``, or one per ``BUFFER_BYTES`` of a
  larger pool), each holding one chunk of a record's arrays. ``stream`` runs a pass over
  chunks: the reader thread fills buffers ahead, the caller steps chunk k on the calling thread
  while chunks k+1, k+2 (and more, in more buffers) are read and chunk k-1 written by the
  writer thread; a buffer is read into again only once its write is done. One reader and
  one writer, each issuing one transfer per array of a chunk (megabytes each: the disk sees long
  sequential requests, and the two directions overlap).
  The next pass's first chunks are read ahead: as a pass ends, its writes all done, the first
  chunks of the pass that followed it the last time (at first: its own, the same shards in the
  same order every step, the first layer first) are read into the buffers the stream starts
  with, while the forward and backward run; that pass finds them read (``_read_next_pass``).
  Reading masters and moments needs no gradient, and nothing but a pass or a write of whole
  arrays (which forgets the reads ahead first) writes them in between, so the values read are
  those the pass would read itself.
- by the gathers of forward and backward (``params="nvme"``), as slots of the largest shard a
  gather reads: ``window_source`` reads a shard into a slot, from which the gather's window is
  copied (on a GPU, uploaded). Each read also starts, on the reader thread, the reads of the
  shards that followed it the last time (the gathers run in the same order every step: the
  forward's, then the backward's), as many as there are other slots, so a layer's shards are
  on their way while the layers before it compute: the read-ahead rides the prefetch schedule,
  a layer or two ahead of its gathers.
The host memory the offloaded state takes is the pool, whatever the model's size.

A failed read or write (a disk that fills, an I/O error) ends the pass once every transfer in
flight is done, raising ``NvmeIOError`` saying what failed and what to do: after a failed write
the state on the disk is part-stepped, so the run cannot go on; its checkpoints are ordinary
files elsewhere, untouched.

In a plan's rehearsal (engine/rehearsal.py) the store has no file: the pool is a fake tensor
and the transfers do nothing, so the planned step runs the same passes and holds the same host
memory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import warnings
import weakref
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from zerocore.comm.agree import run_agreed
from zerocore.comm.fake import is_fake
from zerocore.engine.scratch_file import BLOCK, ScratchFile, round_up

log = logging.getLogger(__name__)

# Chunk buffers in the pool, at least: one being read ahead, one stepped, one being written, and
# one more, so that a read of the chunk after next can start while a write is still in flight.
BUFFERS = 4
# A larger pool is split into more buffers of this size rather than into four larger ones: a
# chunk is of one shard, so a few large buffers hold a few layers' chunks at most, and what the
# next pass's first chunks read ahead (all buffers but one) is counted in chunks. 64 MiB a
# buffer is the default pool's (4 x 64 MiB), whose transfers are megabytes long already.
BUFFER_BYTES = 64 * 2**20
_FP32 = torch.float32
# The slots the gathers' reads need at least: one being copied into a window, one being read
# ahead.
MIN_SLOTS = 2


@dataclasses.dataclass(frozen=True)
class Region:
    """An array in the scratch file."""

    offset: int            # bytes from the file's start; a whole number of blocks
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def span(self) -> int:
        """Bytes it occupies in the file: whole blocks."""
        return round_up(self.nbytes)


# An AdamRecord's arrays, by the names checkpoints and optimizers give them.
ADAM_KEYS = ("master", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True, eq=False)
class AdamRecord:
    """One trainable shard's fp32 master and Adam moments in its store's scratch file (what an
    NVMe shard's ``.nvme`` is), and with ``params="nvme"`` its model copy (the gathers' input,
    which the step writes).

    In fp32 with the model copy in host memory the copy holds the master's very bits, so the
    master is not kept twice: ``master`` is then that host tensor (1-D fp32), stepped in
    place, and the scratch holds the two moments alone (8 bytes a parameter moved each way
    by a pass instead of 12)."""

    master: Region | torch.Tensor
    exp_avg: Region
    exp_avg_sq: Region
    store: "NvmeStore"
    copy: Region | None = None

    @property
    def numel(self) -> int:
        return self.exp_avg.numel

    @property
    def master_in_memory(self) -> bool:
        return isinstance(self.master, torch.Tensor)

    def regions(self) -> tuple[Region, ...]:
        """The arrays of the scratch a step reads."""
        if self.master_in_memory:
            return self.exp_avg, self.exp_avg_sq
        return self.master, self.exp_avg, self.exp_avg_sq

    def read(self, key: str) -> torch.Tensor:
        """The values of ``key`` (one of ``ADAM_KEYS``), in a new tensor."""
        if key == "master" and self.master_in_memory:
            return self.master.clone()
        return self.store.read_values(getattr(self, key))

    def write(self, key: str, values: torch.Tensor) -> None:
        if key == "master" and self.master_in_memory:
            with torch.no_grad():
                self.master.copy_(values.reshape(-1))
            return
        self.store.write_values(getattr(self, key), values)
        if key != "master":
            self.store.moments_written.add(id(self))

    def mapped(self, key: str) -> torch.Tensor:
        """``key``'s values on a read-only mapping of the file (``NvmeStore.mapped``); a
        master in host memory as it is (for a checkpoint, with no pass in flight: a buffer of
        the host arena has a storage of its own, its bytes alone, so it is not copied)."""
        if key == "master" and self.master_in_memory:
            return self.master
        return self.store.mapped(getattr(self, key))


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Elements ``[lo, hi)`` of a record's arrays."""

    record: AdamRecord
    lo: int
    hi: int


@dataclasses.dataclass
class PassTimes:
    """Where a pass's time went, and what it moved."""

    total_s: float = 0.0
    step_s: float = 0.0          # in the caller's step (the CPU Adam)
    read_wait_s: float = 0.0     # waiting for a chunk's read
    write_wait_s: float = 0.0    # waiting for a write to free a buffer, or for the last ones
    read_bytes: int = 0
    written_bytes: int = 0
    chunks_read_ahead: int = 0   # its first chunks found read ahead, before the pass began


@dataclasses.dataclass(frozen=True)
class _Span:
    """What reading a chunk needs, without its record (which holds the store): its record's
    arrays and its elements ``[lo, hi)``."""

    # master (unless in host memory), exp_avg, exp_avg_sq, and the model copy, if any: the
    # first ``reads`` of them are read (the copy is only written)
    regions: tuple[Region, ...]
    lo: int
    hi: int
    reads: int

    @staticmethod
    def of(chunk: Chunk) -> "_Span":
        record = chunk.record
        copy = () if record.copy is None else (record.copy,)
        read = record.regions()
        return _Span((*read, *copy), chunk.lo, chunk.hi, len(read))


class NvmeIOError(OSError):
    """A read or write of the scratch failed (see the module's docstring). Its text is the
    message alone (``errno`` is kept as an attribute)."""

    def __init__(self, code: int | None, message: str):
        super().__init__(message)
        self.errno = code

    def __reduce__(self):
        return type(self), (self.errno, str(self))


class NvmeStore:
    """Where one sharding's NVMe-offloaded arrays live, and the pool they move through. Owned by
    the sharding (its group context); its file and threads go with it."""

    def __init__(self, file: ScratchFile | None, pool: torch.Tensor, *,
                 group: dist.ProcessGroup, device: torch.device, copies: bool = False,
                 masters: bool = True, pool_chosen: bool = False):
        """file: the rank's scratch (None in a plan's rehearsal: nothing is moved). pool: 1-D
        uint8 host memory, page-aligned, split into chunk buffers (``BUFFERS``, or one per
        ``BUFFER_BYTES`` of a larger pool). group, device:
        where a pass's failure is agreed (every rank of the sharding steps together). copies:
        the records hold model copies too (``params="nvme"``): a fourth array per chunk.
        masters: the records hold their masters (False: in fp32 the masters are the model
        copies in host memory, ``AdamRecord``; two arrays per chunk, the moments). pool_chosen:
        the pool's size was chosen from the hosts' memory (``Offload(pool_bytes=None)``), for
        the reports."""
        self.file = file
        self.pool_chosen = pool_chosen
        self.path = file.directory if file is not None else None
        self.pool = pool
        self.masters = masters
        self.buffers = max(BUFFERS, pool.numel() // BUFFER_BYTES)
        per_buffer = pool.numel() // self.buffers // BLOCK * BLOCK
        self._arrays_per_chunk = 2 + masters + copies
        # Elements of each of a chunk's arrays (spans of fp32: a whole number of blocks each).
        self.chunk_numel = (per_buffer // self._arrays_per_chunk // BLOCK * BLOCK
                            // _FP32.itemsize)
        assert self.chunk_numel > 0, "the pool is smaller than Offload's minimum"
        self._buffers = [pool[i * per_buffer:(i + 1) * per_buffer]
                         for i in range(self.buffers)]
        # The gathers' reads (``params="nvme"``): slots of ``slot_bytes`` each (``use_slots``),
        # what each region read was followed by the last time, and the reads ahead in flight.
        self.slot_bytes = 0
        self._slots: list[torch.Tensor] = []
        self._slot_busy: list[object | None] = []   # a slot's last upload (a CUDA event)
        # What the gathers read after each two reads the last time (by the regions' offsets:
        # two, as a layer read in forward and again in backward is followed by different
        # ones), and the last two reads.
        self._next: dict[tuple[int, int], Region] = {}
        self._last: tuple[int, int] = (-1, -1)
        # offset -> (slot, its read), in the order they were started
        self._ahead: dict[int, tuple[int, concurrent.futures.Future]] = {}
        # The gathers' reads so far: found read ahead, or read when asked for.
        self.reads_ahead = self.reads_waited = 0
        # The next pass's first chunks, read ahead as the last pass ended (``_read_next_pass``):
        # (its span, its buffer, its read), in that pass's order. What the first chunks of the
        # pass after each pass were the last time (by the first chunk's span; a step may make
        # several passes over one store), and the first chunk of the last pass.
        self._chunks_ahead: list[tuple[_Span, int, concurrent.futures.Future]] = []
        self._pass_after: dict[_Span, list[_Span]] = {}
        self._last_pass_head: _Span | None = None
        # Chunks read ahead of a pass so far (each counted as its read starts). Whether passes
        # are read ahead at all (off: each pass reads its own first chunks, as before; for
        # benchmarks, which compare the two in one process).
        self.chunks_read_ahead = 0
        self.read_ahead_passes = True
        # The last pass: its seconds in all, stepping (the caller's ``step``), and waiting for
        # reads and for writes; and the bytes it read and wrote (for benchmarks).
        self.last_pass = PassTimes()
        self.size = 0          # bytes of the file's arrays (the planned size in a rehearsal)
        # The records (by id) whose moments were written (stepped, or loaded): no longer the
        # zeros a new optimizer starts from (``fresh_moments``).
        self.moments_written: set[int] = set()
        self.group, self.device = group, device
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        if file is not None:
            self._reader = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="zerocore-nvme-read")
            self._writer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="zerocore-nvme-write")
            # The threads go with the store; the file (and its blocks) with the last of the
            # store and the reads still running, which hold it (``ScratchFile``).
            weakref.finalize(self, _close, self._reader, self._writer)

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel()

    # -- the file's layout --------------------------------------------------------------------

    def add_region(self, numel: int, dtype: torch.dtype, what: str) -> Region:
        """A new array's place at the end of the file, reserved on the disk (a full disk is
        ``ScratchSpaceError`` here, naming ``what``)."""
        span = round_up(numel * dtype.itemsize)
        if self.file is not None:
            offset = self.file.reserve(span, what)
        else:
            offset = self.size
        self.size = offset + span
        return Region(offset, numel, dtype)

    def add_adam(self, numel: int, what: str, copy_dtype: torch.dtype | None = None,
                 master: torch.Tensor | None = None) -> AdamRecord:
        """A trainable shard's master and moments (the moments read as zeros: reserved blocks
        never written are zeros), and its model copy in ``copy_dtype`` if given. ``master``:
        the master in host memory (1-D fp32, what a store without ``masters`` takes), not in
        the scratch."""
        assert (master is None) == self.masters, "the store's masters are all in one place"
        if master is None:
            master = self.add_region(numel, _FP32, what)
        moments = [self.add_region(numel, _FP32, what) for _ in range(2)]
        copy = self.add_region(numel, copy_dtype, what) if copy_dtype is not None else None
        return AdamRecord(master, *moments, store=self, copy=copy)

    # -- whole arrays, outside a step ----------------------------------------------------------

    def write_values(self, region: Region, values: torch.Tensor) -> None:
        """``region`` <- ``values`` (its numel, any float dtype: converted), through the first
        buffer of the pool, one buffer's bytes at a time."""
        assert values.numel() == region.numel
        if self.file is None:
            return
        self._drop_reads_ahead()  # (they use the pool, and may be of this region)
        buffer = self._buffers[0]
        step = buffer.numel() // region.dtype.itemsize
        flat = values.reshape(-1)
        for lo in range(0, region.numel, step):
            hi = min(lo + step, region.numel)
            part = buffer[:round_up((hi - lo) * region.dtype.itemsize)]
            part.view(region.dtype)[:hi - lo].copy_(flat[lo:hi])
            self._io("writing", self.file.write, region.offset + lo * region.dtype.itemsize,
                     part)

    def read_values(self, region: Region, out: torch.Tensor | None = None) -> torch.Tensor:
        """``region``'s values, into ``out`` (its numel, any dtype) or a new tensor."""
        if out is None:
            out = torch.empty(region.numel, dtype=region.dtype)
        if self.file is None:
            return out
        self._drop_reads_ahead()
        buffer = self._buffers[0]
        step = buffer.numel() // region.dtype.itemsize
        for lo in range(0, region.numel, step):
            hi = min(lo + step, region.numel)
            part = buffer[:round_up((hi - lo) * region.dtype.itemsize)]
            self._io("reading", self.file.read, region.offset + lo * region.dtype.itemsize, part)
            out[lo:hi].copy_(part.view(region.dtype)[:hi - lo])
        return out

    def mapped(self, region: Region) -> torch.Tensor:
        """``region`` as a tensor on a read-only mapping of the file: for a checkpoint, which
        writes it out without the process holding it (the pages are the page cache's)."""
        assert self.file is not None
        if region.numel == 0:
            return torch.empty(0, dtype=region.dtype)
        mapping = self.file.mapped(region.offset, region.span)
        # frombuffer keeps the mapping alive; it is read-only, which torch warns of once.
        with _quiet_read_only():
            return torch.frombuffer(mapping, dtype=region.dtype, count=region.numel)

    def zero(self, region: Region) -> None:
        """``region`` <- zeros."""
        if self.file is None:
            return
        self._drop_reads_ahead()
        buffer = self._buffers[0]
        buffer.zero_()
        for lo in range(0, region.span, buffer.numel()):
            part = buffer[:min(buffer.numel(), region.span - lo)]
            self._io("writing", self.file.write, region.offset + lo, part)

    def fresh_moments(self, record: AdamRecord) -> None:
        """Makes ``record``'s moments zeros, as an optimizer built on its shard starts from
        (they are, unless an earlier optimizer stepped them or a checkpoint was loaded)."""
        if id(record) in self.moments_written:
            self.zero(record.exp_avg)
            self.zero(record.exp_avg_sq)
            self.moments_written.discard(id(record))

    # -- a pass over chunks --------------------------------------------------------------------

    def chunks(self, record: AdamRecord) -> list[Chunk]:
        n, c = record.numel, self.chunk_numel
        return [Chunk(record, lo, min(lo + c, n)) for lo in range(0, n, c)]

    def stream(self, chunks: Iterable[Chunk],
               step: Callable[[Chunk, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor | None], None]) -> None:
        """``step(chunk, master, exp_avg, exp_avg_sq, copy)`` for each chunk in order, on this
        thread, each array a 1-D view of the chunk's values in a pool buffer (a master in host
        memory: of its own; fp32; ``copy``,
        the model copy's chunk in the param dtype, unread, for ``step`` to write, or None when
        the record has none), which ``step`` updates in place; each chunk is written back after
        its step. Reads run ahead on the reader thread and writes behind on the writer thread
        (the module's docstring). NvmeIOError when a transfer fails, once none is in flight."""
        chunks = list(chunks)
        self.moments_written.update(id(c.record) for c in chunks)
        times = self.last_pass = PassTimes()
        began = time.perf_counter()
        reads: collections.deque = collections.deque()    # (chunk, buffer, future), in order
        writes: collections.deque = collections.deque()   # (buffer, future), in order
        # The chunks read ahead of this pass that are its first ones are its first reads; the
        # others are forgotten (the pool is the chunks' now; copies are rewritten).
        found = self._take_chunks_ahead(chunks)
        reads.extend((chunk, buffer, done) for chunk, (_, buffer, done) in zip(chunks, found))
        times.chunks_read_ahead = len(found)
        self._drop_reads_ahead()
        self._learn_pass_order(chunks)
        for c in chunks:
            parts = self._parts(c, 0)
            times.read_bytes += sum(p.numel() for _, p in parts[:len(c.record.regions())])
            times.written_bytes += sum(p.numel() for _, p in parts)
        free = [b for b in range(self.buffers) if b not in {buffer for _, buffer, _ in found}]
        ahead = iter(chunks[len(found):])
        failure: BaseException | None = None

        def read_next() -> None:
            chunk = next(ahead, None)
            if chunk is None:
                return
            if not free:  # every buffer is stepped or being written: the oldest write frees one
                buffer, done = writes.popleft()
                t0 = time.perf_counter()
                done.result()
                times.write_wait_s += time.perf_counter() - t0
                free.append(buffer)
            buffer = free.pop(0)
            reads.append((chunk, buffer, self._submit(self._reader, self._read, chunk, buffer)))

        try:
            for _ in range(self.buffers - 1 - len(found)):   # one left for the first write
                read_next()
            while reads:
                chunk, buffer, done = reads.popleft()
                t0 = time.perf_counter()
                done.result()
                t1 = time.perf_counter()
                step(chunk, *self._arrays(chunk, buffer))
                times.read_wait_s += t1 - t0
                times.step_s += time.perf_counter() - t1
                writes.append((buffer, self._submit(self._writer, self._write, chunk, buffer)))
                read_next()
            t0 = time.perf_counter()
            while writes:
                buffer, done = writes.popleft()
                done.result()
            times.write_wait_s += time.perf_counter() - t0
            times.total_s = time.perf_counter() - began
            self._new_step(chunks)
        except BaseException as e:
            failure = e
        finally:
            # No transfer may touch a buffer after the pass: every one in flight ends first.
            for _, _, done in reads:
                _settle(done)
            for _, done in writes:
                _settle(done)
        if failure is not None:
            raise failure

    # -- the gathers' reads (params="nvme") ----------------------------------------------------

    def use_slots(self, largest: int) -> None:
        """Splits the pool into slots of ``largest`` bytes (the largest shard a gather reads,
        whole blocks), for ``window_source``. ValueError, saying how large the pool must be,
        when fewer than ``MIN_SLOTS`` fit."""
        if largest == 0:
            return  # nothing read by the gathers (no frozen shard, nothing trainable here)
        slot = round_up(largest)
        count = self.pool.numel() // slot
        if count < MIN_SLOTS:
            raise ValueError(
                f"Offload(pool_bytes={self.pool.numel()}): with params='nvme' the pool holds "
                f"at least {MIN_SLOTS} of the largest shard a gather reads ({slot:,} bytes "
                f"each here: one copied for its gather while the next is read); give "
                f"pool_bytes >= {MIN_SLOTS * slot}")
        self.slot_bytes = slot
        self._slots = [self.pool[i * slot:(i + 1) * slot] for i in range(count)]
        self._slot_busy = [None] * count

    def window_source(self, region: Region) -> tuple[torch.Tensor, int]:
        """``region``'s values (a view of a pool slot) for a gather's window, and the slot.
        Read ahead already when it followed the last two reads the same way before (then only
        waited for), else read now; either way the regions that followed it (and the read
        before it) last time are then started, into the other slots. Call ``window_copied``
        once the window is made."""
        if self._last[1] >= 0:
            self._next[self._last] = region
        self._last = (self._last[1], region.offset)
        ahead = self._ahead.pop(region.offset, None)
        if ahead is None:
            slot = self._free_slot()
            self._fill(region, slot)
            self.reads_waited += 1
        else:
            slot, done = ahead
            done.result()
            self.reads_ahead += 1
        self._read_ahead(slot)
        return self._slot_view(region, slot), slot

    def window_copied(self, slot: int, upload: object | None) -> None:
        """The window was made from ``slot`` (on a GPU: by an upload still running, whose event
        ``upload`` is; the slot is read into again only once it has completed)."""
        self._slot_busy[slot] = upload

    def _slot_view(self, region: Region, slot: int) -> torch.Tensor:
        return self._slots[slot][:region.nbytes].view(region.dtype)

    def _free_slot(self, taken: set[int] = frozenset()) -> int:
        """A slot no read ahead holds (and not in ``taken``); dropping the oldest read ahead
        when all do."""
        held = {s for s, _ in self._ahead.values()} | set(taken)
        free = [s for s in range(len(self._slots)) if s not in held]
        if free:
            return free[0]
        oldest = next(iter(self._ahead))
        slot, done = self._ahead.pop(oldest)
        _settle(done)
        return slot

    def _fill(self, region: Region, slot: int) -> None:
        """Reads ``region`` into ``slot`` on this thread."""
        self._wait_upload(slot)
        if self.file is not None:
            self._io("reading", self.file.read, region.offset,
                     self._slots[slot][:region.span])

    def _read_ahead(self, current: int | None) -> None:
        """Starts the reads of the regions that followed the last two reads last time (and
        those after them, each once), in that order, into the slots other than ``current``
        (None: any), as many as there are."""
        last, seen = self._last, set()
        taken = set() if current is None else {current}
        nxt = self._next.get(last)
        while nxt is not None and nxt.offset not in seen and len(taken) < len(self._slots):
            seen.add(nxt.offset)
            if nxt.offset not in self._ahead:
                slot = self._free_slot(taken)
                # (the read holds the file, the slot and its upload's event, not the store: a
                # model dropped with a window read ahead in flight goes at once, the file
                # closing after the read; with the store held, a dropped model's store
                # outlived gc.collect() until the read ended)
                busy, self._slot_busy[slot] = self._slot_busy[slot], None
                self._ahead[nxt.offset] = (slot, self._submit(
                    self._reader, _fill_slot, busy, self.file, self.path, nxt.offset,
                    self._slots[slot][:nxt.span]))
            taken.add(self._ahead[nxt.offset][0])
            last = (last[1], nxt.offset)
            nxt = self._next.get(last)

    def _new_step(self, chunks: list[Chunk]) -> None:
        """The optimizer's pass over ``chunks`` is over, every write of it done: the next
        step's first reads are started at once (after it: the copies they read are the
        pass's; the masters and moments, its writes)."""
        if self._slots:
            self._read_ahead(None)
        elif chunks and self.file is not None and self.read_ahead_passes:
            self._read_next_pass(_Span.of(chunks[0]), chunks[:self.buffers - 1])

    # -- the next pass's first chunks, read ahead ----------------------------------------------
    # Triggered as a pass ends rather than by the next backward: its writes are all done
    # there (the values read are final), nothing else uses the chunk buffers until the next
    # pass (the gathers' slots, which would, turn this off), and it is as early as the pool
    # allows; a hook in the backward would start the same reads later, on another thread.

    def _read_next_pass(self, head: _Span, own: list[Chunk]) -> None:
        """Starts reading the first chunks of the pass that followed the one with first
        chunk ``head`` the last time (not known yet: ``own``, that pass's own first chunks),
        first chunk first, into the buffers ``stream`` starts with: as many as it reads
        before its first write."""
        spans = self._pass_after.get(head) or [_Span.of(c) for c in own]
        for buffer, span in enumerate(spans[:self.buffers - 1]):
            # (the read holds the file and the buffer, not the store: a model dropped with
            # reads ahead in flight goes at once, the file closing after them)
            done = self._reader.submit(_read_all, self.file, self.path,
                                       self._reads(span, buffer))
            self._chunks_ahead.append((span, buffer, done))
            self.chunks_read_ahead += 1

    def _take_chunks_ahead(self, chunks: list[Chunk]
                           ) -> list[tuple[_Span, int, concurrent.futures.Future]]:
        """The chunks read ahead that are the first of ``chunks``, in order, taken; the
        others are left for ``_drop_reads_ahead``."""
        found = []
        for (span, buffer, done), chunk in zip(self._chunks_ahead, chunks):
            if span != _Span.of(chunk):
                break
            found.append((span, buffer, done))
        self._chunks_ahead = self._chunks_ahead[len(found):]
        return found

    def _learn_pass_order(self, chunks: list[Chunk]) -> None:
        """Remembers that this pass (its first chunks) followed the last one."""
        if not chunks:
            return
        if self._last_pass_head is not None:
            self._pass_after[self._last_pass_head] = [_Span.of(c)
                                                      for c in chunks[:self.buffers - 1]]
        self._last_pass_head = _Span.of(chunks[0])

    def _wait_upload(self, slot: int) -> None:
        busy, self._slot_busy[slot] = self._slot_busy[slot], None
        if busy is not None:
            busy.synchronize()

    def _drop_reads_ahead(self) -> None:
        """Waits for the reads ahead in flight (the gathers' and the next pass's) and forgets
        them: the pool is about to be used another way, or the regions written. A read ahead
        that failed is forgotten with them (what it read is not used; the next read of those
        bytes, if it fails again, is the one raised)."""
        ahead, self._ahead = self._ahead, {}
        for _, done in ahead.values():
            _settle(done)
        chunks, self._chunks_ahead = self._chunks_ahead, []
        for _, _, done in chunks:
            _settle(done)
        for slot in range(len(self._slots)):
            self._wait_upload(slot)

    def agreed(self, fn: Callable[[], None]) -> None:
        """``fn()`` (a pass), its failure raised on every rank of the sharding: the lowest rank
        with it raises it, the others ``PeerError`` (comm/agree.py). Ranks step together, so
        one rank's full disk stops them all at once instead of leaving them to wait for it in
        the next gather."""
        if self.file is None or is_fake(self.group):
            fn()
            return
        run_agreed(fn, group=self.group, device=self.device)

    # -- internals -----------------------------------------------------------------------------

    def _parts(self, chunk: Chunk | _Span, buffer: int) -> list[tuple[Region, torch.Tensor]]:
        """Each of the chunk's arrays (the model copy last, if any) and its bytes in pool
        buffer ``buffer`` (whole blocks: what is transferred)."""
        span = chunk if isinstance(chunk, _Span) else _Span.of(chunk)
        n = span.hi - span.lo
        size = round_up(n * _FP32.itemsize)
        base = self._buffers[buffer]
        return [(region, base[i * size:i * size + round_up(n * region.dtype.itemsize)])
                for i, region in enumerate(span.regions)]

    def _arrays(self, chunk: Chunk, buffer: int) -> tuple[torch.Tensor | None, ...]:
        """The chunk's master, moments and model copy (None: none) in pool buffer ``buffer``
        (a master in host memory: its slice there)."""
        n, record = chunk.hi - chunk.lo, chunk.record
        views = [part[:n * region.dtype.itemsize].view(region.dtype)
                 for region, part in self._parts(chunk, buffer)]
        if record.master_in_memory:
            views.insert(0, record.master[chunk.lo:chunk.hi])
        return (*views, None) if len(views) == 3 else tuple(views)

    def _reads(self, span: _Span, buffer: int) -> list[tuple[int, torch.Tensor]]:
        """The transfers that read a chunk into pool buffer ``buffer``: (file offset, bytes)
        of each array a step reads (a copy is written, not read)."""
        return [(region.offset + span.lo * region.dtype.itemsize, part)
                for region, part in self._parts(span, buffer)[:span.reads]]

    def _read(self, chunk: Chunk, buffer: int) -> None:
        _read_all(self.file, self.path, self._reads(_Span.of(chunk), buffer))

    def _write(self, chunk: Chunk, buffer: int) -> None:
        for region, part in self._parts(chunk, buffer):
            self._io("writing", self.file.write,
                     region.offset + chunk.lo * region.dtype.itemsize, part)

    def _submit(self, pool, fn, *args) -> concurrent.futures.Future:
        if pool is None:  # a rehearsal: nothing moves
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        return pool.submit(fn, *args)

    def _io(self, doing: str, fn: Callable[[int, torch.Tensor], None], offset: int,
            part: torch.Tensor) -> None:
        _io(doing, fn, offset, part, self.path)


def _io(doing: str, fn: Callable[[int, torch.Tensor], None], offset: int, part: torch.Tensor,
        path: str | None) -> None:
    """``fn(offset, part)``, a transfer of the scratch in ``path``; its OSError as
    NvmeIOError saying what to do."""
    try:
        fn(offset, part)
    except OSError as e:
        after = ("the state there is now part-stepped, so this run cannot go on: resume "
                 "from its last checkpoint" if doing == "writing" else
                 "nothing was changed by this transfer; the run cannot go on without it")
        raise NvmeIOError(e.errno, f"zerocore: NVMe offload: {doing} the scratch in "
                                   f"Offload(path={path!r}) failed: {e.strerror or e}; "
                                   f"{after} (free space there, or give another path)"
                          ) from None


def _read_all(file: ScratchFile, path: str | None,
              reads: list[tuple[int, torch.Tensor]]) -> None:
    """``reads`` (``NvmeStore._reads``) from ``file``, in order."""
    for offset, part in reads:
        _io("reading", file.read, offset, part, path)


def _fill_slot(busy: object | None, file: ScratchFile | None, path: str | None, offset: int,
               part: torch.Tensor) -> None:
    """A window read ahead into a slot (``part``), once the slot's last upload (``busy``, a
    device event, or None) is done with it."""
    if busy is not None:
        busy.synchronize()
    if file is not None:
        _io("reading", file.read, offset, part, path)


def _settle(done: concurrent.futures.Future) -> None:
    """Waits for a transfer, whatever its outcome (a pass that failed is being unwound)."""
    try:
        done.result()
    except BaseException:  # noqa: BLE001  (the pass's first failure is the one raised)
        pass


def _close(reader: concurrent.futures.ThreadPoolExecutor,
           writer: concurrent.futures.ThreadPoolExecutor) -> None:
    """The store's end: its threads end by themselves, a read ahead still running first (it
    holds the file, which closes after it); reads not started are dropped. Every write was
    waited for by its pass. Nothing is waited for here: a finalizer may run inside
    ``threading``'s own bookkeeping, where joining a thread never returns
    (``optimizer_pass._shut_down``)."""
    for pool in (reader, writer):
        pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def _quiet_read_only() -> Iterator[None]:
    """Silences torch's warning that a buffer is not writable (a checkpoint only reads it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        yield
