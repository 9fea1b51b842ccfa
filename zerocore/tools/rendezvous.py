"""The rendezvous of one machine's ranks on a port their launcher holds.

Why: the usual way, binding port 0 to learn a free port, closing it and handing the number to
the ranks (``init_method="tcp://127.0.0.1:PORT"``, rank 0 then binds it as the store's server),
leaves the port free between the two binds. Any process of the machine may take it there: the
ephemeral port of one of the many TCP connections gloo's pairs open, or another run's store. Rank
0 then fails with EADDRINUSE ("The server socket has failed to listen on any local network
address"): seen in a test run of this suite, two runs starting at once.

Here the launcher starts the store's server itself, on port 0, and keeps it for the ranks'
lifetime: the port is never free while they need it. The ranks join it as clients
(``join_rendezvous``). The launcher runs no collective: the server only answers the ranks' keys.
It listens on this machine's loopback only (torch's server, given a port, would listen on every
interface: any host of the network could then write the ranks' keys).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

__all__ = ["RENDEZVOUS_HOST", "hold_rendezvous", "join_rendezvous"]

RENDEZVOUS_HOST = "127.0.0.1"


def hold_rendezvous(port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """The store's server on ``RENDEZVOUS_HOST``, for ranks started after it: on ``port``, or
    one the system picks (0); its port is ``.port``. Raises ``OSError`` when ``port`` is in use
    (or not a port). Keep it until the ranks have ended: letting it go closes the port."""
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.bind((RENDEZVOUS_HOST, port))
        listening.listen()
    except (OSError, OverflowError) as e:  # (OverflowError: a number past 65535)
        listening.close()
        raise OSError(f"cannot listen on {RENDEZVOUS_HOST}:{port}: {e}") from e
    # The store takes the socket over (and closes it when it goes).
    return dist.TCPStore(RENDEZVOUS_HOST, port, None, is_master=True, wait_for_workers=False,
                         master_listen_fd=listening.detach(),
                         timeout=datetime.timedelta(seconds=timeout_s))


def join_rendezvous(port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """In a rank: the default process group of ``world_size`` ranks through the store a
    launcher holds on ``port`` (``hold_rendezvous``); ``timeout_s`` bounds the group's
    collectives and the store's waits, as ``init_process_group``'s ``timeout``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(RENDEZVOUS_HOST, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
