"""The CUDA branches of offload run on the CPU: stand-in streams and events that log what the
engine does with them (tests/engine/test_offload.py, test_nvme_offload.py). The copies are
synchronous; the order of waits, records and gathers is what the tests read."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from zerocore.comm import collectives, transport


class StandInEvent:
    """An event that is complete (the copies here are synchronous) but answers its first
    ``query()`` with False, so that the deferred delivery of a gradient is exercised too."""

    def __init__(self, log: "StreamLog", stream: "StandInStream"):
        self.log, self.stream = log, stream
        self.queried = self.synchronized = False

    def query(self) -> bool:
        ready, self.queried = self.queried, True
        return ready

    def synchronize(self) -> None:
        self.synchronized = True


class StandInStream:
    def __init__(self, log: "StreamLog", name: str):
        self.log, self.name = log, name

    def wait_stream(self, other: "StandInStream") -> None:
        self.log.calls.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: StandInEvent) -> None:
        self.log.calls.append(("wait_event", self.name, event.stream.name))

    def record_event(self) -> StandInEvent:
        event = StandInEvent(self.log, self)
        self.log.events.setdefault(self.name, []).append(event)
        return event


class StreamLog:
    """What the engine did with streams: calls, events per stream, the current stream at each
    all-gather, and the tensors recorded on streams."""

    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []
        self.events: dict[str, list[StandInEvent]] = {}
        self.compute = StandInStream(self, "compute")
        self.current = self.compute
        self.gathers_on: list[str] = []
        self.recorded_on: list[str] = []

    def current_stream(self, device=None) -> StandInStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: StandInStream):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before


class StandInStreams:
    """OffloadStreams' three streams, for a CPU run."""

    def __init__(self, log: StreamLog):
        self.download = StandInStream(log, "download")
        self.upload = StandInStream(log, "upload")
        self.gather = StandInStream(log, "gather")


@contextlib.contextmanager
def stand_in_cuda(log: StreamLog):
    """The few torch.cuda entry points the offload pipeline calls, answered by ``log`` (a test
    may replace torch's functions; the library never does), and every all-gather logged with the
    stream it was issued from."""
    all_gather = collectives.all_gather

    def logged_all_gather(*args, **kwargs):
        log.gathers_on.append(log.current.name)
        return all_gather(*args, **kwargs)

    def record_stream(tensor, stream):
        log.recorded_on.append(stream.name)

    replaced = [(torch.cuda, "current_stream", log.current_stream),
                (torch.cuda, "stream", log.stream),
                (torch.Tensor, "record_stream", record_stream),
                (collectives, "all_gather", logged_all_gather)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in replaced]
    try:
        for obj, name, value in replaced:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


class RankOrderAsOwned(transport.Reduce):
    """Gloo's reduction at three ranks and more (``transport.Reduce``'s all-to-all, summed in
    rank order as every way on gloo sums there, which gloo's reduce-scatter does not
    reproduce), delivered as NCCL's way delivers: into a buffer of its own (``owned``), so that
    the CUDA branches run on the bits the CPU run computes."""

    def __init__(self, route: transport.Route):  # (a route with gloo False: NCCL's)
        super().__init__(route)
        self._gloo = transport.Reduce(dataclasses.replace(route, gloo=True))

    def start(self, packed: torch.Tensor, lo: int, hi: int) -> transport.Reduction:
        reduction = self._gloo.start(packed, lo, hi)
        out = torch.empty(hi - lo, dtype=packed.dtype, device=packed.device)
        return transport.Reduction(lambda: out.copy_(reduction.finish()), held=out)


def use_stand_in_streams(sharding, log: "StreamLog") -> int:
    """Gives every group of ``sharding`` stand-in streams and NCCL's ways of gathering and
    reducing (zerocore/comm/transport.py: gloo's own collectives, bitwise equal to the
    broadcasts and, at two ranks, the in-place all-reduce the engine otherwise uses on gloo, so
    reduced gradients are buffers of their own; from three ranks the sum in rank order that
    every way on gloo computes, ``RankOrderAsOwned``); the number of trainable groups."""
    trainable = 0
    for layer in sharding.layers:
        for g in layer.groups:
            # The streams belong to the homes (zerocore/engine/homes/), which the group and
            # its home share.
            where = dataclasses.replace(g.ctx.homes, streams=StandInStreams(log))
            g.ctx = dataclasses.replace(g.ctx, homes=where)
            g.home.where = where
            route = dataclasses.replace(g.gather.route, gloo=False)
            g.gather = transport.Gather(route)
            g.reduce = (RankOrderAsOwned(route) if route.world_size > 2
                        else transport.Reduce(route))
            trainable += g.trainable
    return trainable
