"""``ScratchFile``: one rank's NVMe-offload scratch (``Offload(optimizer="nvme")``,
``params="nvme"``): a file with no name in the user's directory, read and written at offsets.

Why a file with no name (``O_TMPFILE``; where the file system lacks it, created and unlinked at
once): its blocks belong to the open descriptor alone, so the kernel frees them when the rank's
process ends, however it ends: a clean exit, an exception, SIGTERM, and also SIGKILL (the
out-of-memory killer, a launcher's kill) and a power cut, where no handler or finalizer runs and
named swap files stay behind. Nothing is left to clean, by anyone. ``df`` shows the space while
the rank runs, ``ls`` nothing; ``/proc/<pid>/fd`` names the file "(deleted)".

Direct I/O (``O_DIRECT``) where the file system allows it: reads and writes go between the
disk and the caller's buffers (page-aligned, whole 4 KiB blocks), bypassing the page cache,
which would otherwise grow by what is moved (the whole optimizer state each step) and take the
memory the offload is there to save. Where the file system refuses it (tmpfs before Linux 6.6,
ramfs, some network file systems) the file is opened for buffered I/O and rank 0 says so in one
line; each range read or written is then dropped from the page cache after use.

Space is reserved as it is needed (``reserve``: ``posix_fallocate``), so a full disk is found
while the layers are built, before training starts, and later writes never need a new block.
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid
import weakref

import torch

# Every offset and length given to ``read``/``write``, and every buffer's address, is a multiple
# of this: the block size O_DIRECT requires on any disk (4 KiB sectors included) and the page.
BLOCK = 4096


def round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole blocks."""
    return -(-nbytes // BLOCK) * BLOCK


def size_text(nbytes: int) -> str:
    """``nbytes`` in words: "12.0 KiB", "3.4 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes} bytes"


class ScratchSpaceError(OSError):
    """The scratch directory is missing, not a directory, not writable, or too small. Its text
    is the message alone (``errno`` is kept as an attribute)."""

    def __init__(self, code: int | None, message: str):
        super().__init__(message)
        self.errno = code

    def __reduce__(self):
        return type(self), (self.errno, str(self))


def check_directory(path: str) -> None:
    """ScratchSpaceError, saying what to do, when ``path`` is not an existing, writable
    directory. (Whether it has room is known only as the scratch is reserved: ``reserve``.)"""
    where = f"Offload(path={path!r})"
    if not os.path.exists(path):
        raise ScratchSpaceError(errno.ENOENT, f"{where}: no such directory; create it (on a "
                                              f"local disk with room for the scratch) or give "
                                              f"another path")
    if not os.path.isdir(path):
        raise ScratchSpaceError(errno.ENOTDIR, f"{where} is not a directory; give the "
                                               f"directory to keep the scratch in")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ScratchSpaceError(errno.EACCES, f"{where}: this process may not write there; "
                                              f"give a directory it may write to")


class ScratchFile:
    """An unnamed file in ``directory`` (see the module's docstring). ``direct`` is whether
    direct I/O is in use; ``size`` the bytes reserved so far."""

    def __init__(self, directory: str, *, direct: bool = True):
        """direct: try O_DIRECT first (False: buffered from the start; what a file system that
        refuses it gets anyway)."""
        check_directory(directory)
        self.directory = directory
        self.size = 0
        self.fd = -1
        self.direct = False
        for flag in ((os.O_DIRECT, 0) if direct else (0,)):
            fd = self._open(flag)
            if fd is None:
                continue   # this file system refuses O_DIRECT: buffered, below
            self.fd, self.direct = fd, bool(flag)
            break
        if self.fd < 0:
            raise ScratchSpaceError(errno.EIO, f"Offload(path={directory!r}): could not "
                                               f"create a scratch file there")
        # Closed with this object's end, by whoever let go of it last: its store, or a read
        # of it still running when the store went (nvme_store.py's ``_close`` waits for none).
        self._closing = weakref.finalize(self, os.close, self.fd)

    def _open(self, flag: int) -> int | None:
        """The unnamed file's descriptor opened with ``flag`` (O_DIRECT or 0); None when the
        file system refuses that flag; OSError (named) for anything else."""
        where = f"Offload(path={self.directory!r})"
        mode = os.O_RDWR | os.O_CLOEXEC | flag
        try:
            try:
                fd = os.open(self.directory, mode | os.O_TMPFILE, 0o600)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.ENOENT):
                    raise
                # No O_TMPFILE on this file system: a name of our own, unlinked at once.
                name = os.path.join(self.directory, f".zerocore-scratch-{uuid.uuid4().hex}")
                fd = os.open(name, mode | os.O_CREAT | os.O_EXCL, 0o600)
                os.unlink(name)
        except OSError as e:
            if e.errno == errno.EINVAL and flag:
                return None
            raise ScratchSpaceError(e.errno, f"{where}: could not create a scratch file there: "
                                             f"{e.strerror}") from None
        if flag and not self._direct_works(fd):
            os.close(fd)
            return None
        return fd

    @staticmethod
    def _direct_works(fd: int) -> bool:
        """Whether an aligned direct write and read of one block succeed (some file systems
        accept the flag and refuse the transfers)."""
        block = mmap.mmap(-1, BLOCK)
        try:
            os.ftruncate(fd, BLOCK)
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
            return True
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.ftruncate(fd, 0)
            block.close()

    def reserve(self, nbytes: int, what: str) -> int:
        """Reserves ``nbytes`` more (whole blocks) at the end of the file and returns where
        they start. ScratchSpaceError saying how much is missing when the disk has no room.
        ``what``: what the bytes are for, for that message."""
        assert nbytes % BLOCK == 0
        start = self.size
        try:
            os.posix_fallocate(self.fd, start, nbytes)
        except OSError as e:
            free = self.free_bytes()
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise ScratchSpaceError(e.errno, (
                    f"Offload(path={self.directory!r}): no room for the scratch: {what} "
                    f"need {size_text(nbytes)} more (this rank has reserved "
                    f"{size_text(start)} so far) and the file system says {e.strerror!r} "
                    f"with {size_text(free)} free; free space there, or give a path on a "
                    f"larger disk"))
            raise ScratchSpaceError(e.errno, f"Offload(path={self.directory!r}): reserving "
                                             f"the scratch failed: {e.strerror}") from None
        self.size = start + nbytes
        return start

    def free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        """Fills ``buffer`` (a contiguous CPU tensor, its address and size whole blocks) from
        the file at ``offset``."""
        view = _bytes_of(buffer)
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"the scratch file ended at {offset + done} bytes")
            done += n
        self._forget(offset, len(view))

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        """Writes ``buffer`` (as ``read`` takes it) to the file at ``offset``."""
        view = _bytes_of(buffer)
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        self._forget(offset, len(view))

    def _forget(self, offset: int, nbytes: int) -> None:
        """Buffered I/O: the range leaves the page cache (written ones once on the disk, which
        this starts), so that the cache does not hold the scratch."""
        if not self.direct:
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def mapped(self, offset: int, nbytes: int) -> mmap.mmap:
        """The range ``[offset, offset + nbytes)`` mapped read-only: what a checkpoint reads
        the state through (the pages come from the disk as they are read, and are the page
        cache's, not the process's, to drop). ``offset`` whole blocks."""
        return mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset)

    def close(self) -> None:
        """Closes the file: the kernel frees its blocks (no name to remove)."""
        if self.fd >= 0:
            self._closing()
            self.fd = -1


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (what ``preadv`` fills)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.view(torch.uint8).numpy()).cast("B")
