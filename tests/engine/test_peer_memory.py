"""PeerMemory's pipes alone (zerocore/comm/peer_memory.py ``_Pipes``), without rank processes: how
a wait reads the messages another rank wrote. The transport itself is tested with real ranks
wherever a test world runs on one host (peer reading is the default there)."""

from __future__ import annotations

import os
import select

import pytest

from zerocore.comm.peer_memory import _MESSAGE, _Pipes, _key, _ready


@pytest.fixture
def pipes():
    """A ``_Pipes`` whose rank 1 writes through a pipe that the test holds the write end of."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    p = _Pipes(timeout_s=5.0)
    p.inbound[1] = read
    yield p, write
    os.close(read)
    os.close(write)


def message(seq: int, value: int) -> bytes:
    return _MESSAGE.pack(_key(0, 0, seq), value)


def test_a_wait_takes_every_message_written_and_keeps_those_after_its_own(pipes):
    """Three messages written at once (as an identity rides with a ready message): the wait for
    the second reads them all in one read, hands the first to the watch (the lockstep) while it
    waits, and neither the third: that is heard by the next wait, from what was read, with the
    pipe empty; the first, not consumed by the watch, by a wait for it."""
    p, write = pipes
    watched = []
    p.watch = lambda rank, key, value, awaited: watched.append((key, value, awaited)) or False
    os.write(write, message(1, 10) + message(2, 20) + message(3, 30))
    assert p.hear(1, _key(0, 0, 2)) == 20
    assert watched == [(_key(0, 0, 1), 10, _key(0, 0, 2))]   # not the third: not yet waited past
    # One read took all three (_READ_MAX): nothing is left in the pipe.
    assert not _ready(p.inbound[1], select.POLLIN, 0.0)
    assert p.hear(1, _key(0, 0, 3)) == 30
    assert p.hear(1, _key(0, 0, 1)) == 10                      # kept as early
    assert watched == [(_key(0, 0, 1), 10, _key(0, 0, 2))]


def test_messages_kept_from_one_read_come_before_those_written_after(pipes):
    """Order is the pipe's: what a read kept is heard before anything written since, and a
    message split across reads is joined."""
    p, write = pipes
    os.write(write, message(1, 10) + message(2, 20))
    assert p.hear(1, _key(0, 0, 1)) == 10
    later = message(3, 30)
    os.write(write, later[:5])
    assert p.hear(1, _key(0, 0, 2)) == 20   # kept from the first read, before the half message
    os.write(write, later[5:])
    assert p.hear(1, _key(0, 0, 3)) == 30


def test_a_watch_that_waits_itself_loses_no_message(pipes):
    """The lockstep's watch may raise or wait on the same pipe while a wait is under way: the
    messages read but not looked at stay where a nested wait finds them, in order."""
    p, write = pipes
    heard = []

    def watch(rank, key, value, awaited):
        if key == _key(0, 0, 1):
            heard.append(p.hear(1, _key(0, 0, 2)))   # a wait inside the watch: the next message
            return True
        return False

    p.watch = watch
    os.write(write, message(1, 10) + message(2, 20) + message(3, 30))
    assert p.hear(1, _key(0, 0, 3)) == 30
    assert heard == [20]
    assert not p.early.get(1)   # the second was heard once, by the nested wait, not kept again
