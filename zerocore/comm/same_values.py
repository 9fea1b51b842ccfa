"""``agree_values``: check that every rank was given the same settings, and name those it was not.

Every rank of a job parses its own command line and builds its own objects; two nodes started
with other flags train with other learning rates, or run other collectives, while each believes
it runs the job. The ranks compare what they were given before building anything:

- each rank hashes its names and values' texts (``repr``) into 8 bytes, and the ranks all-gather
  them with each rank's node (one all-gather of 16 bytes a rank, whatever the values);
- all equal: nothing more is exchanged, every rank returns;
- some differ: the ranks all-gather their texts (a second, object all-gather, on this path
  only), and every rank raises the same ``ValuesDiffer``, one line naming each value that
  differs (a name one rank lacks included) and what each node (or rank) has, e.g. "--lr differs
  across ranks: node 0 (ranks 0-1): 0.001; node 1 (ranks 2-3): 0.002".

A collective: every rank calls it, in the same order as its other collectives. A rank that never
comes (stopped, exited, or running other code: a torchrun node that failed before it) leaves the
others waiting in the first all-gather; they wait at most ``timeout_s`` (``Comm``'s default
timeout unless given), then raise ``PeerLost`` saying that not every rank came, instead of
waiting for whatever the process group's own timeout is. After that the group holds an
unfinished collective: the process is expected to end (the error is final).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from zerocore.comm.collectives import all_gather_async, wait_for
from zerocore.comm.device import comm_device
from zerocore.comm.objects import all_gather_objects
from zerocore.comm.peer_memory import PeerLost
from zerocore.policies import DEFAULT_TIMEOUT_S

__all__ = ["ValuesDiffer", "agree_values", "describe_differences"]


class ValuesDiffer(ValueError):
    """Ranks were given different values; raised alike on every rank.

    names: the values that differ, in the order they were given.
    """

    def __init__(self, message: str, names: Sequence[str]):
        super().__init__(message)
        self.names = tuple(names)

    def __reduce__(self):
        return ValuesDiffer, (str(self), self.names)


def _span(ranks: Sequence[int]) -> str:
    """Consecutive ranks as "ranks 0-1", one as "rank 2", others as "ranks 0, 2"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def describe_differences(texts: Mapping[str, Sequence[str]],
                         nodes: Sequence[int | None]) -> str:
    """One line naming each value of ``texts`` (name -> its text on each rank) and what each
    node has ("node 0 (ranks 0-1): 0.001; node 1 (ranks 2-3): 0.002"); ``nodes``: each rank's
    node, or None where ranks have no nodes (then "ranks 0-1: ...")."""
    parts = []
    for name, values in texts.items():
        groups: dict[tuple[int | None, str], list[int]] = {}
        for rank, (node, value) in enumerate(zip(nodes, values)):
            groups.setdefault((node, value), []).append(rank)
        where = [(f"node {node} ({_span(ranks)})" if node is not None else _span(ranks), value)
                 for (node, value), ranks in groups.items()]
        parts.append(f"{name} differs across ranks: "
                     + "; ".join(f"{who}: {value}" for who, value in where))
    return ". ".join(parts)


def agree_values(values: Mapping[str, Any], *, what: str, advice: str,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 node: int | None = None, text: Callable[[Any], str] = repr,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Collective: raises ``ValuesDiffer`` on every rank of ``group`` (default: the world) when
    the ranks' ``values`` (name -> value) differ, naming only those that do, with each node's
    (or rank's) ``text(value)`` ("(not given)" where a rank lacks the name); see the module
    docstring. ``what`` begins the message ("neox.finetune"), ``advice`` ends it (what to do).
    ``node``: this rank's node (torchrun's GROUP_RANK), for the message; None on every rank
    when there are none. ``device``: where the bytes travel on a group without a CPU backend
    (as ``run_agreed``). ``timeout_s``: how long to wait for every rank to come (then
    ``PeerLost``; see the module docstring)."""
    group = group if group is not None else dist.group.WORLD
    channel = comm_device(group, torch.device("cpu"), device)
    world = dist.get_world_size(group)
    texts = {name: text(value) for name, value in values.items()}
    # (node (-1: none), a hash of every name and value): a fixed size whatever the values.
    digest = hashlib.sha1("\0".join(f"{n}={t}" for n, t in texts.items()).encode()).digest()
    mine = torch.tensor([-1 if node is None else node,
                         int.from_bytes(digest[:8], "little") >> 1], dtype=torch.int64,
                        device=channel)
    every = torch.empty(2 * world, dtype=torch.int64, device=channel)
    work = all_gather_async(every, mine, group)
    try:
        came = wait_for(work, timeout_s)
    except RuntimeError as e:  # (the backend's: a rank gone)
        raise PeerLost(_not_every_rank(what, timeout_s, e),
                       silent="timed out" in str(e).lower()) from e
    if not came:
        raise PeerLost(_not_every_rank(what, timeout_s, "timed out"), silent=True)
    rows = every.view(world, 2).cpu()
    if bool((rows[:, 1] == rows[0, 1]).all()):
        return
    # They differ: each rank's texts (only now, and only these few strings) name what.
    theirs = all_gather_objects(texts, group, channel)
    names = list(dict.fromkeys(name for t in theirs for name in t))
    per_rank = {name: [t.get(name, "(not given)") for t in theirs] for name in names}
    differing = {name: seen for name, seen in per_rank.items() if len(set(seen)) > 1}
    nodes = [None if n < 0 else n for n in rows[:, 0].tolist()]
    raise ValuesDiffer(f"{what}: {describe_differences(differing, nodes)}; {advice}",
                       list(differing))


def _not_every_rank(what: str, timeout_s: float, cause: object) -> str:
    return (f"{what}: not every rank came to agree on the settings within {timeout_s:g} s "
            f"({cause}): a rank stopped, exited, or runs other code (every rank must reach "
            f"this point: look for the first error of the others)")
