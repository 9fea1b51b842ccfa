"""``agree_values``: check that every rank was given the same settings, and name those it was not.

Every rank of a job parses its own command line and builds its own objects; two nodes started
with other flags train with other learning rates, or run other collectives, while each believes
it runs the job. The ranks compare what they were given before building anything:

- each rank hashes each value's ``repr`` (8 bytes a value) and the ranks all-gather the hashes,
  with each rank's node (one small tensor all-gather; the same on every rank);
- all equal: nothing more is exchanged, every rank returns;
- some differ: the ranks all-gather the texts of only the values that differ (a second,
  object all-gather), and every rank raises the same ``ValuesDiffer``, one line naming each
  value that differs and what each node (or rank) has, e.g. "--lr differs across ranks: node 0
  (ranks 0-1): 0.001; node 1 (ranks 2-3): 0.002".

A collective: every rank calls it with the same names in the same order (the names are hashed
with the values, so that a rank given other names is seen to differ, not paired with another
value).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from zerocore.comm.collectives import all_gather_sync
from zerocore.comm.device import comm_device
from zerocore.comm.objects import all_gather_objects

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


def _hash(name: str, text: str) -> int:
    # 63 bits: the tensor is int64, and a non-negative value keeps the comparison plain.
    return int.from_bytes(hashlib.sha1(f"{name}={text}".encode()).digest()[:8], "little") >> 1


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
                 node: int | None = None, text: Callable[[Any], str] = repr) -> None:
    """Collective: raises ``ValuesDiffer`` on every rank of ``group`` (default: the world) when
    the ranks' ``values`` (name -> value) differ, naming only those that do, with each node's
    (or rank's) ``text(value)``; see the module docstring. ``what`` begins the message
    ("neox.finetune"), ``advice`` ends it (what to do). ``node``: this rank's node (torchrun's
    GROUP_RANK), for the message; None on every rank when there are none. ``device``: where the
    bytes travel on a group without a CPU backend (as ``run_agreed``)."""
    group = group if group is not None else dist.group.WORLD
    channel = comm_device(group, torch.device("cpu"), device)
    world = dist.get_world_size(group)
    texts = {name: text(value) for name, value in values.items()}
    # Column 0: the node (-1: none); then one hash a value, and one of the names themselves.
    row = [-1 if node is None else node, _hash("", ",".join(texts))]
    row += [_hash(name, t) for name, t in texts.items()]
    mine = torch.tensor(row, dtype=torch.int64, device=channel)
    every = torch.empty(world * len(row), dtype=torch.int64, device=channel)
    all_gather_sync(every, mine, group)
    rows = every.view(world, len(row)).cpu()
    if bool((rows[:, 1:] == rows[0, 1:]).all()):
        return
    if bool((rows[:, 1] != rows[0, 1]).any()):  # other names: compare them as one value
        texts = {"the settings' names": ", ".join(texts)}
        differing = list(texts)
    else:
        differing = [name for i, name in enumerate(texts)
                     if bool((rows[:, 2 + i] != rows[0, 2 + i]).any())]
    theirs = all_gather_objects({name: texts[name] for name in differing}, group, channel)
    nodes = [None if n < 0 else n for n in rows[:, 0].tolist()]
    per_rank = {name: [t[name] for t in theirs] for name in differing}
    raise ValuesDiffer(f"{what}: {describe_differences(per_rank, nodes)}; {advice}", differing)
