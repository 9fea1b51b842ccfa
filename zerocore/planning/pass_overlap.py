"""The offloaded optimizer pass's expected overlap with the next forward (issue 44, item 3): a
small model, stated here, of how long the pass takes and how long the forward it can hide behind
takes, on this kind of machine and on a GPU, from bandwidths and FLOP rates.

The pass moves bytes. Adam reads each fp32 master, its two moments and its gradient (16 bytes a
parameter) and writes the master and the moments (12 bytes), plus the model copy it rounds to
(in the parameter dtype) where that copy is not the master itself. With ``optimizer="nvme"`` the
moments and the master (12 bytes a parameter; 8 in fp32 with the parameters in memory, where the
master is the model copy there) are also read from the scratch and written back; the
pool moves them while the kernel steps the chunk before, so the disk and the memory work overlap
and the pass takes about the slower of the two. On a GPU the updated copy is uploaded layer by
layer behind the pass, on the upload stream: again the slower stage sets the time.

The exact pass hides behind the next forward only (docs/decisions.md, "The overlapped optimizer
pass": the backward needs every layer updated, and the forward's gathers wait layer by layer),
so what it can hide is min(pass, forward), and nothing where it does not overlap
(``Offload.overlaps``: ``overlap="off"``, or parameters on NVMe, whose gathers share its pool).
The delayed pass (``overlap="delayed"``) waits for neither: it hides behind the forward and
the backward, min(pass, forward + backward), the backward taking twice the forward's FLOPs.
"""

from __future__ import annotations

import dataclasses
import math

from zerocore.planning.memory_plan import MemoryPlan
from zerocore.policies import Offload

GiB = 2**30

# Adam's bytes a parameter: reads master, moments and gradient (4 x 4), writes master and
# moments (3 x 4), all fp32; the model copy comes on top where it is a separate tensor.
ADAM_READ_BYTES = 16
ADAM_WRITE_BYTES = 12
# NVMe: the scratch holds the two moments and the master (3 x 4 bytes), read and written back;
# in fp32 with the parameters in memory, the moments alone (the master is the model copy).
NVME_BYTES = 12
NVME_MOMENT_BYTES = 8
# A backward's FLOPs over its forward's (two matmuls for each one of the forward): what the
# delayed pass hides behind is the forward and backward, (1 + 2) forwards.
BACKWARD_OVER_FORWARD = 2


@dataclasses.dataclass(frozen=True)
class Machine:
    """The rates the estimate divides by. ``flops``: the forward's achieved FLOP/s (a peak times
    an MFU); ``adam_bytes_per_s``: host memory bytes/s the CPU Adam moves; ``disk_bytes_per_s``:
    the scratch's bytes/s, read and written together; ``upload_bytes_per_s``: host to device
    (None: the CPU computes, nothing is uploaded)."""

    name: str
    flops: float
    adam_bytes_per_s: float
    disk_bytes_per_s: float
    upload_bytes_per_s: float | None = None


# This machine (2 cores, no GPU), from its own records:
# - the forward: a whole fp32 training step of pythia-70m (70,426,624 parameters) ran at about
#   160 tokens/s in memory (bench/records/2026-12-06-engines-overlapped-pass.md: 153-164; the
#   issue measured 161-213), at 6 FLOPs a parameter and token for forward and backward: an
#   achieved rate, so its MFU is already in it;
# - the Adam: 2^24 fp32 parameters stepped in 4.72 ms on 2 threads, at the memory limit
#   (bench/RESULTS.md, kernels-cpu-adam-quiet), counting 28 bytes a parameter;
# - the disk: the NVMe pass moved 9.1 GiB in 6.1 s, reads and writes together
#   (bench/records/2026-12-03-memory-nvme-offload.md; dd alone measured less).
THIS_CPU = Machine(name="this machine's CPU", flops=6 * 70_426_624 * 160.0,
                   adam_bytes_per_s=(ADAM_READ_BYTES + ADAM_WRITE_BYTES) * 2**24 / 4.72e-3,
                   disk_bytes_per_s=9.1 * GiB / 6.1)

# An H100 SXM node (not measured here: no session had a GPU), per GPU:
# - the forward: 989 TFLOP/s dense bf16 (NVIDIA's H100 SXM datasheet) at an assumed 40% MFU;
# - the Adam: two sockets of 8 DDR5-4800 channels (2 x 307 GB/s) shared by 8 GPUs' ranks, at
#   about 70% of the channels' peak: 54 GB/s a rank;
# - the disk: one PCIe 4.0 NVMe drive per rank, about 6 GB/s read and written together
#   (datasheets of that class: 7 GB/s sequential read, 5 write);
# - the upload: PCIe 5.0 x16, 64 GB/s a direction, about 80% achieved with pinned memory.
H100 = Machine(name="an H100 (from the bandwidths)", flops=989e12 * 0.40,
               adam_bytes_per_s=2 * 307e9 / 8 * 0.70, disk_bytes_per_s=6e9,
               upload_bytes_per_s=64e9 * 0.80)


@dataclasses.dataclass(frozen=True)
class PassOverlap:
    """The estimate for one rank: seconds of the pass and of the forward it may hide behind."""

    machine: str
    pass_s: float
    forward_s: float
    overlaps: bool
    why_not: str            # "" when it overlaps; else "off" or "params on NVMe"
    delayed: bool = False   # one step delayed: behind the forward and the backward

    @property
    def hidden_s(self) -> float:
        """The pass's seconds the next step hides: exact, behind the forward only, not the
        backward; delayed, behind both."""
        if not self.overlaps:
            return 0.0
        behind = self.forward_s * (1 + BACKWARD_OVER_FORWARD if self.delayed else 1)
        return min(self.pass_s, behind)

    def line(self) -> str:
        head = (f"on {self.machine}: optimizer pass ~{_ms(self.pass_s)}, forward "
                f"~{_ms(self.forward_s)}")
        if not self.overlaps:
            return f"{head}: does not overlap ({self.why_not})"
        kind = "delayed, behind forward and backward" if self.delayed else "exact"
        return f"{head}: overlap hides ~{_ms(self.hidden_s)} ({kind})"


def _ms(seconds: float) -> str:
    """Two significant digits below 10 ms (a small model's pass), whole milliseconds above."""
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"


def dense_forward_flops(numel: int, tokens: int) -> float:
    """A dense model's forward FLOPs: a multiply and an add per parameter and token."""
    return 2.0 * numel * tokens


def pass_bytes(plan: MemoryPlan, *, delayed: bool = False) -> tuple[int, int]:
    """(host memory bytes, disk bytes) one rank's pass moves, from the plan's model state.
    ``delayed``: the plan's trainable parameters count the published copy twice over (the
    pass writes one of the two)."""
    state = plan.state
    # The trainable elements of one rank's shard (padding excluded): the state is sharded over
    # the world, or over a 2-D mesh's shard group.
    numel = math.ceil(state.trainable_numel / (plan.mesh[1] if plan.mesh else plan.world_size))
    # The model copy is a tensor of its own beside fp32 masters (16-bit compute), or on NVMe
    # where the masters live in the scratch; in fp32 in memory it is the master itself (NVMe
    # included, with the parameters in memory).
    copy = (state.trainable_params if state.masters or (state.nvme and state.nvme_masters)
            else 0)
    if delayed:
        copy //= 2
    host = numel * (ADAM_READ_BYTES + ADAM_WRITE_BYTES) + copy
    per_param = NVME_BYTES if state.nvme_masters else NVME_MOMENT_BYTES
    return host, numel * per_param * 2 if state.nvme else 0


def pass_overlap(plan: MemoryPlan, offload: Offload, *, forward_flops: float,
                 machine: Machine) -> PassOverlap | None:
    """The offloaded pass against the forward of one micro-batch (``forward_flops``) on
    ``machine``; None where the optimizer is not offloaded (no pass on the host)."""
    if not offload.optimizer:
        return None
    host, disk = pass_bytes(plan, delayed=offload.delayed)
    stages = [host / machine.adam_bytes_per_s, disk / machine.disk_bytes_per_s]
    if machine.upload_bytes_per_s is not None:
        # The updated copies go back into their device mirrors (none with parameters offloaded
        # too: their windows are uploaded by the gathers instead).
        stages.append(plan.state.mirrors / machine.upload_bytes_per_s)
    why_not = ("" if offload.overlaps else
               "params on NVMe" if offload.params == "nvme" else "off")
    return PassOverlap(machine=machine.name, pass_s=max(stages),
                       forward_s=forward_flops / machine.flops, overlaps=offload.overlaps,
                       why_not=why_not, delayed=offload.delayed)


def overlap_lines(plan: MemoryPlan, offload: Offload, *, tokens: int) -> list[str]:
    """The plan's report of the pass: one line for this machine and one for an H100, the
    forward being one micro-batch of ``tokens`` tokens a rank through the whole model (the
    frozen weights too); none where the optimizer is not offloaded."""
    flops = dense_forward_flops(plan.state.trainable_numel + plan.state.frozen_numel, tokens)
    estimates = [pass_overlap(plan, offload, forward_flops=flops, machine=machine)
                 for machine in (THIS_CPU, H100)]
    return [e.line() for e in estimates if e is not None]
