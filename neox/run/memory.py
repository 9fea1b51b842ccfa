"""``--measure-memory``: each rank's peak over the training steps after the first, reported
beside the plan of the same run (``neox.run.planning``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

import zerocore
from neox.run.recipe import Recipe
from neox.run.progress import Log
from neox.run.build import TrainState
from neox.run.planning import plan_run, request_from_recipe


@dataclasses.dataclass
class MeasuredPeak:
    """This rank's memory over the training steps after the first (``--measure-memory``)."""

    steps: int                   # steps measured
    state_bytes: int             # model state when the window opened (tensors)
    peak_bytes: int              # the most bytes of tensors at once beyond that
    rss_peak: int | None         # peak resident set over those steps
    rss_run_peak: int | None     # over the whole process (the build too)

    @property
    def total(self) -> int:
        return self.state_bytes + self.peak_bytes


class MemoryProbe:
    """``--measure-memory``: counts every tensor from before the model is built (so buffers the
    engine keeps count too); the window opens after the first step (nothing is created lazily
    any more) and closes with the last one."""

    def __init__(self, device: torch.device):
        self.peak = zerocore.PeakMemory(device)
        self.peak.__enter__()
        self.first_step: int | None = None
        self.state_bytes = 0
        self.rss_run_peak: int | None = None

    def after_step(self, state: TrainState) -> None:
        if self.first_step is None:
            self.first_step = state.step
            self.state_bytes = state.model.memory_report(state.optimizer).model_state_bytes
            self.rss_run_peak = zerocore.peak_rss()
            zerocore.reset_peak_rss()
            self.peak.mark()

    def finish(self, step: int) -> MeasuredPeak | None:
        self.peak.__exit__(None, None, None)
        if self.first_step is None:
            return None
        rss = zerocore.peak_rss()
        return MeasuredPeak(step - self.first_step, self.state_bytes,
                            self.peak.peak_bytes - self.state_bytes, rss,
                            max(rss or 0, self.rss_run_peak or 0) or None)


def report_measured(state: TrainState, recipe: Recipe, measured: MeasuredPeak | None, *,
                    device: torch.device, world_size: int, log: Log) -> None:
    """Each rank's measured peak beside the plan of this run (neox.plan). Collective."""
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, measured)
    if every[0] is None:
        log("memory: not measured (the run had a single step; the first is not measured)")
        return
    plan = plan_run(request_from_recipe(recipe, state.config, world_size=world_size,
                                        device=device.type, dtype=state.dtype,
                                        nodes=state.nodes))
    planned = plan.device_peak
    mib = 2**20
    log(f"memory per rank over steps {state.step - every[0].steps + 1}-{state.step} (tensors, "
        f"{'torch.profiler allocation events' if device.type == 'cpu' else 'the CUDA allocator'}"
        f"; planned by neox.plan: {planned / mib:,.1f} MiB, peak at {plan.peak_phase}):")
    for rank, m in enumerate(every):
        rss = "" if m.rss_peak is None else (f"; peak RSS {m.rss_peak / mib:,.0f} MiB in these "
                                             f"steps, {m.rss_run_peak / mib:,.0f} MiB in the run")
        log(f"  rank {rank}: measured {m.total / mib:,.1f} MiB ({m.state_bytes / mib:,.1f} model "
            f"state + {m.peak_bytes / mib:,.1f} at the peak), planned / measured "
            f"{planned / m.total:.3f}{rss}")
