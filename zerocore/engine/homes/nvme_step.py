"""How the optimizer step reaches masters and moments on NVMe (homes/nvme.py's homes):
``NvmeLaunch`` steps the shards of one store in one pass over their chunks
(``NvmeStore.stream``), for ``zerocore.optim``.

Each chunk's runs of settings go to one ``fused_adam_multi`` call on the chunk's master and
moments in a pool buffer, the gradient and the model copy sliced alike. Adam is elementwise and
every kernel variant gives each element the same bits whatever its neighbours, so the chunks step
exactly as the whole shards would.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from zerocore.engine.nvme_store import AdamRecord, Chunk, NvmeStore
from zerocore.kernels import ops

# A run of a shard's elements with one setting: (start, end, lr, weight decay).
Run = tuple[int, int, float, float]


class Stepped(Protocol):
    """What the launch needs of the optimizer's bucket of one NVMe shard."""

    nvme: AdamRecord                  # where its master and moments live
    model_copy: torch.Tensor | None   # 1D, param dtype, in host memory; None: on NVMe
    layer_index: int                  # its layer (the pass hook's label)


class NvmeLaunch:
    """NVMe buckets of one store, stepped in one pass (the module's docstring)."""

    def __init__(self, store: NvmeStore, step: int, host_threads: int | None):
        self.store, self.step, self.host_threads = store, step, host_threads
        self.buckets: list[Stepped] = []
        # Each record's bucket, gradient and runs.
        self._work: dict[int, tuple[Stepped, torch.Tensor, list[Run]]] = {}

    def add(self, b: Stepped, grad_flat: torch.Tensor, runs: list[Run]) -> None:
        self.buckets.append(b)
        self._work[id(b.nvme)] = (b, grad_flat, runs)

    def run(self, hyper: dict[str, Any]) -> None:
        """The pass, its failure raised on every rank of the sharding (``NvmeStore.agreed``)."""
        store = self.store
        store.agreed(lambda: store.stream(self._chunks(), self._stepper(hyper)))

    def run_on_worker(self, hyper: dict[str, Any], begins: Callable[[Stepped], None],
                      stepped: Callable[[Stepped], None]) -> None:
        """The pass on the optimizer's host worker (engine/optimizer_pass.py), which holds its
        failure for the ranks to agree on later: ``begins(bucket)`` before each bucket's first
        chunk is stepped, ``stepped(bucket)`` once its last one is (its model copy, in host
        memory, is then written; the chunk's writes to the scratch trail)."""
        chunks = self._chunks()
        last = {id(c.record): c for c in chunks}
        step_chunk = self._stepper(hyper)

        def step_and_tell(chunk: Chunk, *arrays: torch.Tensor | None) -> None:
            if chunk.lo == 0:
                begins(self._work[id(chunk.record)][0])
            step_chunk(chunk, *arrays)
            if last[id(chunk.record)] is chunk:  # (the stream steps these very chunks)
                # Its gradient is let go of here (the optimizer's thread holds the last
                # reference, and frees it as the forward goes on).
                bucket = self._work.pop(id(chunk.record))[0]
                stepped(bucket)
        self.store.stream(chunks, step_and_tell)

    def _chunks(self) -> list[Chunk]:
        return [c for b in self.buckets for c in self.store.chunks(b.nvme)]

    def _stepper(self, hyper: dict[str, Any]) -> Callable[..., None]:
        def step_chunk(chunk: Chunk, master: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, disk_copy: torch.Tensor | None) -> None:
            b, grad, runs = self._work[id(chunk.record)]
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [])
            lrs, wds = [], []
            for lo, hi, lr, wd in runs:
                a, z = max(lo, chunk.lo), min(hi, chunk.hi)
                if a >= z:
                    continue
                i, j = a - chunk.lo, z - chunk.lo
                # The model copy: in host memory, or on NVMe (this chunk's, in the pool); none
                # apart from the master when the master is the host copy itself (fp32).
                copy = (None if chunk.record.master_in_memory
                        else b.model_copy[a:z] if b.model_copy is not None
                        else None if disk_copy is None else disk_copy[i:j])
                parts = (master[i:j], grad[a:z], exp_avg[i:j], exp_avg_sq[i:j], copy)
                for out, part in zip(lists, parts):
                    if part is not None:
                        out.append(part)
                lrs.append(lr)
                wds.append(wd)
            masters, grads, exp_avgs, exp_avg_sqs, copies = lists
            ops.fused_adam_multi(masters, grads, exp_avgs, exp_avg_sqs, copies or None,
                                 lrs=lrs, weight_decays=wds, beta1=hyper["beta1"],
                                 beta2=hyper["beta2"], eps=hyper["eps"], step=self.step,
                                 inv_grad_scale=hyper["inv_grad_scale"], adamw=hyper["adamw"])
        return step_chunk
