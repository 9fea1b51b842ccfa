"""``ShardParameter``: this rank's flat shard of one layer's trainable parameters.

It is what ``zerocore.shard`` exposes to optimizers (``model.parameters()``): a 1-D fp32 tensor
holding this rank's contiguous slice of the layer's padded flat trainable parameters (the master
weights), with ``.grad`` the matching fp32 slice of the reduce-scattered gradient. When the layer
computes in fp16/bf16, ``model_copy`` is the same slice in that dtype, on the master's device.

Keeping ``model_copy`` in step with the master:
- ``zerocore.optim`` writes it in the same pass as it updates the master weights and then calls
  ``mark_model_copy_synced``;
- any other in-place writer of the master (``torch.optim.AdamW``, ``copy_`` under no_grad) bumps
  the tensor's version counter, and ``refresh_model_copy`` (called by the engine before every
  all-gather) re-derives the copy.
``copy_generation`` increases whenever the copy changes, so a device-side mirror of it (CPU
offload) knows when to fetch it again.

What makes a parameter a shard is its attributes (``is_shard``), and what the engine and the
optimizer do with one are the functions below, not methods of the class: a plan's rehearsed step
(engine/rehearsal.py) shards on fake tensors, whose parameters are torch's own fake tensors with
these attributes, and runs the same code. ``ShardParameter`` is the class of a real shard.
"""

from __future__ import annotations

import torch

from zerocore.engine.optimizer_pass import settle_updates, wait_for_update

# The attribute that marks a shard: "master", or "offloaded" (the master and its model copy
# in CPU memory: engine/offload.py).
KIND = "zerocore_shard"


class ShardParameter(torch.nn.Parameter):
    """A 1-D fp32 master shard; ``model_copy`` is its low-precision twin, or None."""

    model_copy: torch.Tensor | None  # 1D, fp16/bf16, same numel and device; None in fp32
    copy_generation: int             # bumped each time the master (and its copy) change
    _synced_version: int             # the master's version when model_copy was last derived
    # The parameters of the layer's trainable group, by the name the model gives them, and the
    # part of each this shard holds: (name, start, end) in shard coordinates (a parameter may
    # straddle shards; alignment padding belongs to none). For per-parameter optimizer
    # settings (``zerocore.optim``'s ``param_overrides``). Set by the engine.
    names: tuple[str, ...]
    segments: tuple[tuple[str, int, int], ...]
    # Offloaded shards: recorded on the upload stream after the last copy of the gather source
    # to the device (None when none is in flight, or on the CPU), and the CPU threads the
    # optimizer steps it with (None: torch's own count). See engine/offload.py.
    upload_done: torch.cuda.Event | None
    host_threads: int | None
    # NVMe offload (``Offload(optimizer="nvme")``): where the master and its Adam moments live
    # in the sharding's scratch (an ``nvme_store.AdamRecord``); the tensor itself then holds no
    # values (``placeholder``), ``model_copy`` being what the layers compute with. None: the
    # tensor is the master.
    nvme: object | None
    # Whether the optimizer steps it on its host worker, overlapping the next forward
    # (``Offload(overlap="exact")``), and the optimizer's pass that does
    # (engine/optimizer_pass.py), which the engine's waits find here; None: none.
    overlapped: bool
    update_pass: object | None
    # ``Offload(overlap="delayed")``: what the gathers read instead of the model copy (1D,
    # param dtype, fp32 included, beside the master), refreshed from the settled state by each
    # ``optimizer.step()`` before it starts its pass (``publish``), so that the worker never
    # writes what a gather reads. None: the gathers read ``model_copy`` (or the master).
    published: torch.Tensor | None

    def __new__(cls, data: torch.Tensor, model_copy: torch.Tensor | None = None,
                requires_grad: bool = True, offloaded: bool = False) -> "ShardParameter":
        assert data.dim() == 1 and data.dtype == torch.float32
        p = super().__new__(cls, data, requires_grad)
        init_shard(p, model_copy, offloaded)
        return p

    def refresh_model_copy(self) -> None:
        refresh_model_copy(self)

    def mark_model_copy_synced(self) -> None:
        mark_model_copy_synced(self)

    def gather_source(self) -> torch.Tensor:
        return gather_source(self)


class OverlappedShard(ShardParameter):
    """A shard the optimizer steps on its host worker while the next forward runs
    (``Offload(overlap="exact")``, engine/optimizer_pass.py): the one kind whose every use
    must first wait for its update. A class of its own so that the others pay nothing: a
    Python ``__torch_function__`` on every shard cost about 3 us per op here, some 14 ops per
    layer and step, half of the engine's own host cost per layer (docs/decisions.md)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Any use of a shard (a user's read of the master, ``.data``) first waits for the
        optimizer's overlapped pass to have updated it, that shard alone
        (engine/optimizer_pass.py); then it is a plain Parameter's (no subclass results).
        Getting or setting ``.grad`` does not wait: the pass holds the gradients it reads, and
        what writes into one in place waits itself (backward's accumulation, for its shard;
        ``zero_grad(set_to_none=False)``, for the pass). Nor does reading what the pass never
        changes (its shape, dtype, device, version: ``_NO_WAIT``), which the engine does while
        a delayed pass runs beside the whole forward and backward."""
        if (getattr(func, "__self__", None) or func) not in _NO_WAIT:
            _wait_for_shards(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


# What reading a shard does not wait for: its ``.grad`` (see ``__torch_function__``), and its
# metadata, which no update changes (the fused kernel writes through ``.data``, so not even
# the version counter moves).
_NO_WAIT = frozenset([torch.Tensor.grad, torch.Tensor._version, torch.Tensor.device,
                      torch.Tensor.dtype, torch.Tensor.shape, torch.Tensor.requires_grad,
                      torch.Tensor.is_cuda, torch.Tensor.numel, torch.Tensor.dim,
                      torch.Tensor.size, torch.Tensor.element_size])


def _wait_for_shards(args: tuple, kwargs: dict | None) -> None:
    """Waits for the overlapped pass's update of each shard among an op's arguments (and in
    lists of them)."""
    for a in (*args, *(kwargs or {}).values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(t) is OverlappedShard:
                wait_for_update(t)


def new_shard(master: torch.Tensor, model_copy: torch.Tensor | None,
              offloaded: bool, overlapped: bool = False) -> torch.nn.Parameter:
    """The shard parameter of ``master`` (1-D fp32): a ``ShardParameter`` (an
    ``OverlappedShard`` when the optimizer's pass overlaps the forward), or for a fake
    master (a plan's rehearsal) torch's fake parameter with the same attributes."""
    if type(master) is torch.Tensor:
        cls = OverlappedShard if overlapped else ShardParameter
        p = cls(master, model_copy, offloaded=offloaded)
    else:
        p = torch.nn.Parameter(master)
        init_shard(p, model_copy, offloaded)
    p.overlapped = overlapped
    return p


def init_shard(p: torch.nn.Parameter, model_copy: torch.Tensor | None, offloaded: bool) -> None:
    setattr(p, KIND, "offloaded" if offloaded else "master")
    p.model_copy = model_copy
    p.copy_generation = 0
    p._synced_version = p._version
    p.names, p.segments = (), ()
    p.upload_done = None
    p.host_threads = None
    p.nvme = None
    p.overlapped = False
    p.update_pass = None
    p.published = None


def is_shard(p: torch.Tensor) -> bool:
    return getattr(p, KIND, None) is not None


def is_offloaded(p: torch.Tensor) -> bool:
    return getattr(p, KIND, None) == "offloaded"


def is_nvme(p: torch.Tensor) -> bool:
    """Whether the shard's master and moments live on NVMe, not in the tensor."""
    return getattr(p, "nvme", None) is not None


def placeholder(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What a shard on NVMe is as a tensor: ``numel`` zeros that take one element (expanded),
    so that the parameter keeps its shape (a trainable one's ``.grad`` is a real gradient
    shard) and its memory is not its values'; an in-place write to it (another optimizer, a
    ``copy_``) fails loudly instead of changing nothing."""
    return torch.zeros((), dtype=dtype).expand(numel)


def set_layout(p: torch.nn.Parameter, slots: list[tuple[str, int, int]], lo: int) -> None:
    """slots: (name, first element, numel) of each parameter in the unsharded flat group;
    lo: where this shard starts in it."""
    hi = lo + p.numel()
    p.names = tuple(name for name, _, _ in slots)
    p.segments = tuple((name, max(start, lo) - lo, min(start + n, hi) - lo)
                       for name, start, n in slots if start < hi and start + n > lo)


def prefix_names(p: torch.nn.Parameter, prefix: str) -> None:
    """Names relative to a container (``zerocore.shard``'s layer index)."""
    p.names = tuple(prefix + n for n in p.names)
    p.segments = tuple((prefix + n, a, b) for n, a, b in p.segments)


def mark_model_copy_synced(p: torch.nn.Parameter) -> None:
    """Called by a writer that updated the master and model_copy together."""
    p._synced_version = p._version
    p.copy_generation += 1


def shard_stamp(p: torch.nn.Parameter) -> tuple[int, int]:
    """What changes whenever the shard's values do: an in-place write through the parameter
    (a load, a user's ``copy_``) bumps its version; the optimizer's fused kernel writes through
    ``.data``, which does not, and bumps ``copy_generation`` instead. Gathered values (kept
    between the passes, hpZ's secondary shards) are stale once it moves. (A frozen shard has
    no optimizer: its version alone.)"""
    return p._version, getattr(p, "copy_generation", 0)


def wait_for_device(p: torch.nn.Parameter) -> None:
    """An offloaded shard: blocks the host until the last upload of its gather source has been
    read (that copy only; nothing else on the device). Host writers of the master or of the
    model copy (``zerocore.optim``, the engine's refresh of the copy) call it first."""
    if p.upload_done is not None:
        p.upload_done.synchronize()
        p.upload_done = None


def refresh_model_copy(p: torch.nn.Parameter) -> None:
    """Re-derives ``model_copy`` from the master if something else changed the master. (Called
    before every gather: the usual answer, nothing changed, costs one comparison.)"""
    if p._version == p._synced_version:
        return
    if is_offloaded(p):
        wait_for_device(p)  # the copy is about to be written: the device may read it
    if p.model_copy is not None:
        with torch.no_grad():
            p.model_copy.copy_(p.data)
    publish(p)  # (a load: the delayed gathers start from what it wrote)
    mark_model_copy_synced(p)


def publish(p: torch.nn.Parameter) -> None:
    """``Offload(overlap="delayed")``: the gathers' copy <- the shard's current values (its
    model copy, or the fp32 master). Called with no pass in flight: by ``optimizer.step()``
    once it has settled the last pass and before it starts its own, and by every write of the
    master outside the optimizer (a load). Nothing without a published copy."""
    if getattr(p, "published", None) is None:
        return
    wait_for_device(p)  # the device may still be reading the last published values
    with torch.no_grad():
        p.published.copy_(p.model_copy if p.model_copy is not None else p.data)
    p.copy_generation += 1  # what the gathers read changed: a device mirror fetches it again


def master_values(p: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 master's values: the tensor itself, or for an NVMe shard read from its scratch
    into a new tensor (one shard at a time: for exports and checks, not the hot path)."""
    settle_updates([p])
    if is_nvme(p):
        return p.nvme.read("master")
    return p.detach()


def set_master(p: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Writes the fp32 master (a load): into the tensor, or an NVMe shard's scratch, whose
    model copy is then derived at once (the tensor's version, which ``refresh_model_copy``
    watches, is not the master's there)."""
    settle_updates([p])
    with torch.no_grad():
        if not is_nvme(p):
            p.copy_(values)
            return
        if p.nvme.copy is not None:  # the model copy on NVMe too (Offload(params="nvme"))
            p.nvme.write("master", values)
            p.nvme.store.write_values(p.nvme.copy, values.to(p.nvme.copy.dtype))
        else:
            wait_for_device(p)  # the copy is about to be written: the device may read it
            p.model_copy.copy_(values)
            if not p.nvme.master_in_memory:  # (in fp32 the copy just written is the master)
                p.nvme.write("master", values)
            publish(p)
        mark_model_copy_synced(p)


def gather_source(p: torch.nn.Parameter) -> torch.Tensor:
    """The tensor whose values the layer computes with: the published copy (delayed), the
    model copy, or the fp32 master."""
    published = getattr(p, "published", None)
    if published is not None:
        return published
    return p.data if p.model_copy is None else p.model_copy
