"""``StoreQuestions``: asking the other ranks of a group where they wait (``waits_elsewhere``)
when they may be on other hosts, through a ``torch.distributed.TCPStore`` of the group's own.

Over gloo's collectives a rank that runs a forward alone waits in the lockstep's all-reduce
while the others wait in a collective of their own; neither can go on, and gloo waits out its
timeout. The peer-reading transport asks through its pipes (one host); this is the same
question across hosts. Rank 0 of the group serves a store on a free port of its host, named by
its host name (as gloo's own default device binds to it, so the ranks reach it as they reach
each other), and every rank learns the address once, when the model is built. Each rank's
answering thread blocks in ``store.wait`` for its own question key, answers from its main
thread's stack, and ends when the model goes (its own key set to ``_STOP``). A rank asks only
when an exchange has waited a while (comm/lockstep.py); otherwise the store is idle.

Each thread has its own client: a TCPStore client holds a lock for the whole of a ``wait``.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import weakref

import torch
import torch.distributed as dist

from zerocore.comm.objects import broadcast_objects
from zerocore.comm.whereabouts import waits_elsewhere

__all__ = ["StoreQuestions"]

logger = logging.getLogger(__name__)

_STOP = b"stop"
# How long a client waits to reach the store (when the model is built) or for one operation
# (the answering thread's wait is its own, unbounded: it ends when the model goes).
_CLIENT_TIMEOUT = datetime.timedelta(seconds=10)
# The answering thread's wait, renewed when it ends (a TCPStore wait needs a bound).
_ANSWER_WAIT = datetime.timedelta(days=1)
# How long rank 0 waits for each rank's thread to stop before closing the store (a rank whose
# process is gone never says so).
_STOPPING = datetime.timedelta(seconds=2)
# How long an asker waits for the answers (an answer takes ``whereabouts._STILL_S``; a rank
# that does not answer in time is asked again at the next slice).
_ANSWERS_S = 1.0


class StoreQuestions:
    """Collective (every rank of ``group``, over ``exchange``: a group with a CPU backend):
    starts this rank's answering thread, about the calling thread. ``ranks``: the group's
    global ranks."""

    def __init__(self, group: dist.ProcessGroup, exchange: dist.ProcessGroup,
                 ranks: tuple[int, ...]):
        self._ranks = ranks
        self._me = ranks[group.rank()]
        server = None
        address = [None]
        if group.rank() == 0:
            server = dist.TCPStore(socket.gethostname(), 0, None, True,
                                   timeout=_CLIENT_TIMEOUT, wait_for_workers=False)
            address = [(socket.gethostname(), server.port)]
        broadcast_objects(address, 0, exchange, torch.device("cpu"))  # (a CPU backend)
        host, port = address[0]
        self._asking = server
        try:
            self._asking = server or dist.TCPStore(host, port, None, False,
                                                   timeout=_CLIENT_TIMEOUT)
            answering = dist.TCPStore(host, port, None, False, timeout=_CLIENT_TIMEOUT)
        except RuntimeError as e:  # (not reachable by that name: another interface, a firewall)
            logger.warning("zerocore: rank %d cannot reach the store at %s:%d (%s); a forward "
                           "on one rank alone while others wait in a collective of their own "
                           "is not found on it", self._me, host, port, e)
            self._asking = None
            return
        thread = threading.Thread(target=_answer, args=(answering, self._me,
                                                         threading.get_ident()),
                                  daemon=True, name="zerocore-whereabouts-store")
        thread.start()
        # Ends the thread when the model goes, or at exit, before the stores close (a thread
        # left in a client's wait must not outlive the interpreter's state it returns to).
        # Rank 0's store goes with its model: it ends every rank's thread first (a client
        # whose store closes under its wait prints the network error as a warning).
        stopped = ranks if server is not None else (self._me,)
        self._finalizer = weakref.finalize(self, _stop, self._asking, stopped, thread)

    def ask(self) -> dict[int, str]:
        """Asks every other rank where it waits: {global rank: where} for each rank that
        answered that it waits in a collective of its own that this rank belongs to."""
        others = [r for r in self._ranks if r != self._me]
        store = self._asking
        if store is None:
            return {}
        try:
            for r in others:
                store.delete_key(_answer_key(r, self._me))
                store.set(_question_key(r), str(self._me))
        except RuntimeError:
            return {}  # the store went with rank 0's model: nobody answers
        found = {}
        for r in others:
            key = _answer_key(r, self._me)
            try:
                store.wait([key], datetime.timedelta(seconds=_ANSWERS_S))
            except RuntimeError:
                continue  # (busy, or gone: asked again at the next slice)
            where = store.get(key).decode(errors="replace")
            if where:
                found[r] = where
        return found


def _question_key(rank: int) -> str:
    return f"ask/{rank}"


def _answer_key(rank: int, asker: int) -> str:
    return f"answer/{rank}/{asker}"


def _stopped_key(rank: int) -> str:
    return f"stopped/{rank}"


def _answer(store: dist.TCPStore, me: int, main: int) -> None:
    """The answering thread: one question at a time (a second asker's question that
    overwrites the first is answered; the first asks again)."""
    key = _question_key(me)
    while True:
        try:
            store.wait([key], _ANSWER_WAIT)
        except dist.DistStoreError as e:
            if "timeout" in str(e):
                continue
            return  # the store is gone: its rank 0's model went
        except RuntimeError:
            return
        try:
            asker = store.get(key)
            store.delete_key(key)
            if asker == _STOP:
                store.set(_stopped_key(me), _STOP)  # (rank 0 closes the store after this)
                return
            where = waits_elsewhere(main, int(asker))
            store.set(_answer_key(me, int(asker)), where)
        except Exception:  # noqa: BLE001  (a question must never end the answers)
            continue


def _stop(store: dist.TCPStore, ranks: tuple[int, ...], thread: threading.Thread) -> None:
    """Ends the answering threads of ``ranks``: this rank's own (unless rank 0 ended it), or
    on rank 0 every rank's, waiting until each has stopped using the store (it closes next)."""
    if not thread.is_alive() and len(ranks) == 1:
        return
    try:
        for rank in ranks:
            store.set(_question_key(rank), _STOP)
        for rank in ranks:
            store.wait([_stopped_key(rank)], _STOPPING)
    except RuntimeError:
        pass  # the store is gone, and with it the thread's wait; or a rank that is gone
    thread.join(_STOPPING.total_seconds())
