"""Adam and AdamW that step flat buffers with zerocore's fused kernel.

Drop-in for ``torch.optim.Adam``/``AdamW``: same hyper-parameters, same results (up to float
rounding), ``param_groups`` that ``torch.optim.lr_scheduler`` drives, and ``state_dict()`` in
PyTorch's own layout (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, plus ``master_param``
for low-precision parameters), so a state dict moves between the two.

How it works. At construction the parameters of each param group are bucketed by (device, dtype)
and each bucket is laid out in one flat fp32 master buffer with flat fp32 moments:
- fp32 parameters become views into the master buffer, so the kernel updates them in place;
- fp16/bf16 parameters become views into a flat buffer of their dtype, which the kernel writes in
  the same pass as it updates the fp32 master (the optimizer keeps the master weights);
- a ``zerocore`` shard parameter (``ShardParameter``, already flat, owned by ``zerocore.shard``) is
  its own bucket: it is the fp32 master, and its low-precision ``model_copy`` is written in the
  same pass.
Parameters with ``requires_grad=False`` at construction are kept in ``param_groups`` but get no
state and are never stepped (build the optimizer again after unfreezing one). Each step packs
the gradients of a bucket into one flat buffer (one multi-tensor copy) and runs one fused kernel
launch over all the buckets of a param group that share a device, dtypes and step count (on a
sharded model: every layer's shard in one launch). Parameters whose ``.grad`` is None are
skipped, as ``torch.optim`` skips them; then that bucket is stepped parameter by parameter.

Offloaded shards whose sharding overlaps the pass (``Offload(overlap="exact")``, the default)
are stepped after ``step()`` returns, on the optimizer's host worker, layer by layer in forward
order while the next forward runs (engine/optimizer_pass.py); ``settle()`` waits for it.

Caveat shared with every optimizer that keeps master weights: after changing a low-precision
parameter outside the optimizer, call ``sync_master_from_params()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Callable, Iterable, Iterator

import torch

from zerocore.comm.lockstep import STEP, ZERO_GRAD, lockstep_of
from zerocore.engine.homes.nvme_step import NvmeLaunch, Run
from zerocore.engine.nvme_store import AdamRecord
from zerocore.engine.optimizer_pass import (Begins, Done, Job, OptimizerPass, PassHook,
                                            settle_updates)
from zerocore.engine.sharded_param import (ShardParameter, is_nvme, is_offloaded, is_shard,
                                           mark_model_copy_synced, publish, wait_for_device)
from zerocore.engine.tracing import traced
from zerocore.kernels import ops

__all__ = ["Adam", "AdamW", "no_decay_on_biases_and_norms"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class _Bucket:
    """Parameters of one param group on one device with one dtype, stepped by one kernel call."""

    params: list[torch.nn.Parameter]
    offsets: list[int]               # start of each parameter in the flat buffers
    master: torch.Tensor | None      # 1D, fp32: the weights Adam updates (None: on NVMe)
    exp_avg: torch.Tensor | None     # 1D, fp32 (None: on NVMe)
    exp_avg_sq: torch.Tensor | None  # 1D, fp32 (None: on NVMe)
    model_copy: torch.Tensor | None  # 1D, fp16/bf16: what the model computes with; None if fp32
    grad_flat: torch.Tensor | None   # 1D, gradient dtype; None for a shard (its grad is flat)
    # Per-parameter settings (param_overrides) where they differ within the bucket: (start,
    # end, weight_decay or None for the group's, lr scale), covering the flat buffers; one
    # kernel call per run. None: the group's settings for everything, one call.
    runs: list[tuple[int, int, float | None, float]] | None = None
    # CPU threads to step with (an offloaded shard of a GPU rank: its sharding's share of the
    # host); None: torch's own count.
    host_threads: int | None = None
    # The layer of a shard's bucket, for its label in a profiler trace; -1 for other buckets.
    layer_index: int = -1
    # NVMe offload: where the shard's master and moments live (its ``.nvme``); the bucket is
    # stepped chunk by chunk through its store's pool (homes/nvme_step.py). None: in memory.
    nvme: AdamRecord | None = None
    # Stepped on the optimizer's host worker while the next forward runs
    # (``Offload(overlap="exact")``, engine/optimizer_pass.py), not inside ``step()``.
    overlapped: bool = False

    @property
    def numel(self) -> int:
        return self.nvme.numel if self.nvme is not None else self.master.numel()


class _Launch:
    """Buckets stepped by one ``fused_adam_multi`` call: one device, gradient dtype, model-copy
    dtype and step count. Each bucket is one shard of the call, or one per run of parameters
    with their own settings (the same kernel on slices: every element read and written once)."""

    def __init__(self, step: int, host_threads: int | None):
        self.step, self.host_threads = step, host_threads
        self.buckets: list[_Bucket] = []
        self._lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [])
        self._lrs: list[float] = []
        self._wds: list[float] = []

    def add(self, b: _Bucket | _Unit, grad_flat: torch.Tensor, runs: list[Run]) -> None:
        self.buckets.append(b)
        for lo, hi, lr, wd in runs:
            arrays = (b.master, grad_flat, b.exp_avg, b.exp_avg_sq, b.model_copy)
            for out, a in zip(self._lists, arrays):
                if a is not None:
                    out.append(a if (lo, hi) == (0, a.numel()) else a[lo:hi])
            self._lrs.append(lr)
            self._wds.append(wd)

    def clear(self) -> None:
        """Lets go of the arrays (run: the launch is spent)."""
        self._lists = ([], [], [], [], [])

    def run(self, hyper: dict[str, Any]) -> None:
        masters, grads, exp_avgs, exp_avg_sqs, copies = self._lists
        ops.fused_adam_multi(masters, grads, exp_avgs, exp_avg_sqs, copies or None,
                             lrs=self._lrs, weight_decays=self._wds, beta1=hyper["beta1"],
                             beta2=hyper["beta2"], eps=hyper["eps"], step=self.step,
                             inv_grad_scale=hyper["inv_grad_scale"], adamw=hyper["adamw"])


# param_overrides: a parameter's name (the model's own; "<layer index>.<name>" for
# zerocore.shard, as nn.Sequential(*layers) names it) -> the settings that differ for it:
# {"weight_decay": absolute, "lr_scale": multiplies the group's lr}, or None.
Overrides = Callable[[str], "dict[str, float] | None"]


@contextlib.contextmanager
def _host_threads(n: int | None) -> Iterator[None]:
    """Offloaded shards of a GPU rank are stepped with the CPU threads their sharding chose (the
    rank's share of its host, ``Offload.cpu_threads``), for the step's duration only: torch's
    own count, which the caller owns, is given back afterwards."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _settled(b: _Bucket, hyper: dict[str, Any]) -> list[Run]:
    """The bucket's runs of settings (the whole bucket: one), each with its lr and weight
    decay resolved."""
    out = []
    for lo, hi, wd, scale in b.runs or [(0, b.numel, None, 1.0)]:
        settings = _with(hyper, wd, scale)
        out.append((lo, hi, settings["lr"], settings["weight_decay"]))
    return out


@dataclasses.dataclass(frozen=True)
class _Unit:
    """What the worker's job needs of one overlapped bucket: its arrays and labels, never the
    shard parameter itself (a pass in flight then holds no model: one dropped mid-pass is
    freed once the pass ends, its worker first)."""

    key: int                          # id of the shard: the pass's name for the unit
    layer_index: int
    master: torch.Tensor | None       # (views of the bucket's flat buffers, as _Bucket's)
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    model_copy: torch.Tensor | None
    nvme: AdamRecord | None


def _jobs(overlapped: list[tuple[_Bucket, int, torch.Tensor, dict[str, Any]]]) -> list[Job]:
    """The host worker's jobs for the overlapped buckets (bucket, step count, flat gradient,
    settings), in forward order: one per in-memory shard (the kernel on it alone: the same
    bits as in one launch with the others, each element being stepped alone), one per run of
    consecutive NVMe shards of one store and one kind (one pass over their chunks, each layer
    done once its last chunk is stepped: its masters' and moments' writes trail)."""
    jobs: list[Job] = []
    launch: NvmeLaunch | None = None
    kind = None
    for b, step, grad_flat, hyper in sorted(overlapped, key=lambda o: o[0].layer_index):
        runs = _settled(b, hyper)
        unit = _Unit(id(b.params[0]), b.layer_index, b.master, b.exp_avg, b.exp_avg_sq,
                     b.model_copy, b.nvme)
        if b.nvme is None:
            one = _Launch(step, None)
            one.add(unit, grad_flat, runs)
            jobs.append(Job([unit.key], _memory_job(one, unit, hyper)))
            launch = None
            continue
        key = (id(b.nvme.store), grad_flat.dtype, step, id(hyper))
        if launch is None or key != kind:
            launch, kind = NvmeLaunch(b.nvme.store, step, None), key
            jobs.append(Job([], _nvme_job(launch, hyper)))
        launch.add(unit, grad_flat, runs)
        jobs[-1].keys.append(unit.key)
    return jobs


def _memory_job(launch: _Launch, unit: _Unit, hyper: dict[str, Any]):
    def run(begins: Begins, done: Done) -> None:
        begins(unit.layer_index)
        with traced("adam", unit.layer_index):
            launch.run(hyper)
        launch.clear()  # (its gradient: the calling thread lets go of it, ``start``'s held)
        done(unit.key)
    return run


def _nvme_job(launch: NvmeLaunch, hyper: dict[str, Any]):
    def run(begins: Begins, done: Done) -> None:
        with traced("adam", -1):
            launch.run_on_worker(hyper, lambda u: begins(u.layer_index),
                                 lambda u: done(u.key))
    return run


def _with(hyper: dict[str, Any], weight_decay: float | None, lr_scale: float) -> dict[str, Any]:
    """The kernel's settings for a run with its own weight decay (None: the group's) and lr
    scale."""
    out = dict(hyper)
    if weight_decay is not None:
        out["weight_decay"] = weight_decay
    if lr_scale != 1.0:
        out["lr"] = hyper["lr"] * lr_scale
    return out


def no_decay_on_biases_and_norms(model: torch.nn.Module | Iterable[torch.nn.Module]
                                 ) -> Overrides:
    """The usual per-parameter setting, as ``param_overrides``: no weight decay for biases and
    for every parameter of a normalization module (a class whose name ends in "Norm":
    LayerNorm, RMSNorm, LlamaRMSNorm, GroupNorm, ...), the parameters transformers' ``Trainer``
    leaves undecayed. ``model``: the model given to ``shard_model`` (before or after it), or
    the layers given to ``shard``. Decided from the module tree, so it holds after sharding,
    when the modules no longer own their parameters."""
    if isinstance(model, torch.nn.Module):
        named = list(model.named_modules())
    else:
        named = [(f"{i}" + (f".{n}" if n else ""), m)
                 for i, layer in enumerate(model) for n, m in layer.named_modules()]
    norms = {name for name, m in named if type(m).__name__.endswith("Norm")}

    def overrides(name: str) -> dict[str, float] | None:
        owner = name.rpartition(".")[0]
        # A PEFT-wrapped model names a layer's parameters base_layer.weight etc.: the owner is
        # the module path either way.
        if name.endswith("bias") or owner in norms:
            return {"weight_decay": 0.0}
        return None
    return overrides


def overrides_mismatch(mine: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """Why a saved param group's per-parameter settings are not this optimizer's group's (None
    when they agree): stepping on with other settings than the run's is refused, not guessed."""
    have, had = mine.get("param_overrides") or {}, saved.get("param_overrides") or {}
    if have == had:
        return None
    differ = sorted(n for n in set(have) | set(had) if have.get(n) != had.get(n))
    return (f"the state was saved with other per-parameter settings (param_overrides) for "
            f"{len(differ)} parameter(s), e.g. {differ[0]}: saved {had.get(differ[0], {})}, "
            f"now {have.get(differ[0], {})}; build the optimizer with the run's param_overrides")


def _torch_optimizer(name: str) -> Callable[..., Any]:
    """``torch.optim.Optimizer``'s method ``name``, to call as ``super()`` would. Some of them
    (``add_param_group``, ``zero_grad``, ``state_dict``) are wrapped by ``torch._disable_dynamo``,
    whose first call imports ``torch._dynamo``: about 1 s of CPU in every process, as much as
    ``import torch`` itself (measured 2026-12-06, torch 2.13), paid by every neox rank and rank
    process of the tests for nothing when nothing is compiled. Until ``torch._dynamo`` is
    imported nothing can be compiling, so the wrapper has nothing to do and the wrapped function
    (``__wrapped__``, which ``functools.wraps`` keeps) is called directly; once it is imported,
    the method as torch wraps it."""
    method = getattr(torch.optim.Optimizer, name)
    if "torch._dynamo" in sys.modules:
        return method
    return getattr(method, "__wrapped__", method)


def _flat_views(flat: torch.Tensor, params: list[torch.nn.Parameter],
                offsets: list[int]) -> list[torch.Tensor]:
    return [flat[o:o + p.numel()].view(p.shape) for p, o in zip(params, offsets)]


class Adam(torch.optim.Optimizer):
    """Adam with L2 weight decay (``adamw=False``, like ``torch.optim.Adam``) or with decoupled
    weight decay (``adamw=True``, like ``torch.optim.AdamW``), stepped by
    ``zerocore.ops.fused_adam``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, adamw: bool = False, amsgrad: bool = False,
                 maximize: bool = False, param_overrides: Overrides | None = None,
                 pass_hook: PassHook | None = None):
        """pass_hook: for tests, called on the host worker before each layer's overlapped
        update (engine/optimizer_pass.py's ``PassHook``)."""
        if amsgrad or maximize:
            raise ValueError("zerocore.optim.Adam does not implement amsgrad or maximize; use "
                             "torch.optim.Adam for those")
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
        self._adamw = adamw
        self._overrides = param_overrides
        self._buckets: list[list[_Bucket]] = []  # per param group
        # The host worker that steps overlapped shards (made with the first of them).
        self._pass_hook = pass_hook
        self._pass: OptimizerPass | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    # -- construction --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _torch_optimizer("add_param_group")(self, param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            # Frozen parameters are never stepped, whatever they hold (zerocore's int8 frozen
            # shards, FrozenWeights, are bytes).
            if p.requires_grad and p.dtype not in (torch.float32, *_LOW_PRECISION):
                raise ValueError(f"zerocore.optim: parameter of dtype {p.dtype} is not supported; "
                                 f"parameters must be float32, float16 or bfloat16")
        names = group.get("param_names", [None] * len(group["params"]))
        if self._overrides is not None:
            # What each named parameter's settings are, recorded with the group: state dicts
            # and checkpoints carry it, and loading checks it (the rule itself is code).
            found = {}
            for p, name in zip(group["params"], names):
                for n in (p.names if is_shard(p) else [name]):
                    ov = self._override(n) if p.requires_grad and n is not None else {}
                    if ov:
                        found[n] = ov
            group["param_overrides"] = found
        self._buckets.append(self._make_buckets(group["params"], names))

    def _override(self, name: str) -> dict[str, float]:
        """The settings ``param_overrides`` gives the parameter ``name``, checked."""
        assert self._overrides is not None
        ov = dict(self._overrides(name) or {})
        unknown = set(ov) - {"weight_decay", "lr_scale"}
        if unknown:
            raise ValueError(f"zerocore.optim: param_overrides({name!r}) gave {sorted(unknown)}; "
                             f"only 'weight_decay' and 'lr_scale' can differ per parameter")
        for key, value in ov.items():
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"zerocore.optim: param_overrides({name!r}) gave {key}="
                                 f"{value!r}; it must be a number >= 0")
        return {k: float(v) for k, v in ov.items()}

    def _make_buckets(self, params: list[torch.nn.Parameter],
                      names: list[str | None]) -> list[_Bucket]:
        buckets = []
        plain: dict[tuple, list[torch.nn.Parameter]] = {}
        for p, name in zip(params, names):
            if not p.requires_grad:
                # Frozen (e.g. zerocore's frozen shards, which model.parameters() yields):
                # never stepped, so no state, as torch.optim never creates state for them.
                continue
            if is_shard(p):
                buckets.append(self._shard_bucket(p))
            else:
                ov = self._override(name) if self._overrides and name is not None else {}
                key = (p.device, p.dtype, ov.get("weight_decay"), ov.get("lr_scale", 1.0))
                plain.setdefault(key, []).append(p)
        for (device, dtype, wd, scale), ps in plain.items():
            bucket = self._flat_bucket(ps, device, dtype)
            if wd is not None or scale != 1.0:
                bucket.runs = [(0, bucket.master.numel(), wd, scale)]
            buckets.append(bucket)
        return buckets

    def _shard_runs(self, p: ShardParameter) -> list[tuple[int, int, float | None, float]] | None:
        """A shard's runs of equal settings: each parameter's segment, extended over the
        padding after it (zeros, whatever step they get), equal neighbours merged."""
        if self._overrides is None or not p.segments:
            return None
        runs: list[tuple[int, int, float | None, float]] = []
        for i, (name, start, _) in enumerate(p.segments):
            end = p.segments[i + 1][1] if i + 1 < len(p.segments) else p.numel()
            ov = self._override(name)
            setting = (ov.get("weight_decay"), ov.get("lr_scale", 1.0))
            if not runs:
                start = 0  # padding before the first segment: with it
            if runs and runs[-1][2:] == setting:
                runs[-1] = (runs[-1][0], end, *setting)
            else:
                runs.append((start, end, *setting))
        if len(runs) == 1 and runs[0][2:] == (None, 1.0):
            return None
        return runs

    def _shard_bucket(self, p: ShardParameter) -> _Bucket:
        if p.dtype != torch.float32 or p.dim() != 1:
            raise ValueError("zerocore.optim: a ShardParameter must be a 1-D float32 master shard")
        # An earlier optimizer's pass may still be stepping it: its state is this one's start.
        settle_updates([p])
        overlapped = bool(getattr(p, "overlapped", False))
        if overlapped:
            if self._pass is None:
                self._pass = OptimizerPass(self._pass_hook)
            p.update_pass = self._pass
        if is_nvme(p):
            # The master and moments are in the scratch (the moments start from zeros, as
            # zeros_like's: the store zeroes them if an earlier optimizer wrote them).
            p.nvme.store.fresh_moments(p.nvme)
            bucket = _Bucket([p], [0], None, None, None, p.model_copy, None,
                             self._shard_runs(p), p.host_threads,
                             getattr(p, "layer_index", -1), nvme=p.nvme,
                             overlapped=overlapped)
            self._bind_state(bucket)
            return bucket
        bucket = _Bucket([p], [0], p.data, torch.zeros_like(p.data), torch.zeros_like(p.data),
                         p.model_copy, None, self._shard_runs(p),
                         p.host_threads if is_offloaded(p) else None,
                         getattr(p, "layer_index", -1), overlapped=overlapped)
        self._bind_state(bucket)
        return bucket

    def _flat_bucket(self, ps: list[torch.nn.Parameter], device: torch.device,
                     dtype: torch.dtype) -> _Bucket:
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += p.numel()
        master = torch.empty(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            ops.pack([p.detach() for p in ps], offsets, master)
        model_copy = None
        if dtype in _LOW_PRECISION:
            model_copy = torch.empty(total, dtype=dtype, device=device)
            ops.pack([p.detach() for p in ps], offsets, model_copy)
        # The parameters now live in the flat buffers: the kernel's writes are the parameters.
        for p, view in zip(ps, _flat_views(master if model_copy is None else model_copy, ps,
                                           offsets)):
            p.data = view
        bucket = _Bucket(ps, offsets, master, torch.zeros_like(master), torch.zeros_like(master),
                         model_copy, torch.empty(total, dtype=dtype, device=device))
        self._bind_state(bucket)
        return bucket

    def _bind_state(self, b: _Bucket) -> None:
        """Makes ``self.state[p]`` hold views into the bucket's flat buffers, so the standard
        ``torch.optim.Optimizer.state_dict`` sees exactly what the kernel updates. An NVMe
        bucket's state here is its step count alone: its moments are in the scratch."""
        if b.nvme is not None:
            self.state[b.params[0]] = {"step": torch.tensor(0.0)}
            return
        views = zip(b.params, _flat_views(b.exp_avg, b.params, b.offsets),
                    _flat_views(b.exp_avg_sq, b.params, b.offsets),
                    _flat_views(b.master, b.params, b.offsets))
        for p, m, v, master in views:
            state = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
            if b.model_copy is not None and not is_shard(p):
                state["master_param"] = master
            self.state[p] = state

    # -- stepping ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             inv_grad_scale: float = 1.0) -> Any:
        """One step. ``inv_grad_scale`` multiplies every gradient inside the kernel: pass
        ``clip_coef / loss_scale`` to unscale and clip without another pass over the gradients
        (``zerocore.LossScaler.step`` does).

        Every bucket whose parameters all have gradients and one step count joins one kernel
        launch per (device, gradient dtype, model-copy dtype, step count) of its param group:
        on a sharded model, one launch for all the layers' shards, as one pass over memory.

        Overlapped shards (``Offload(overlap="exact")``) are stepped on the host worker
        instead, layer by layer in forward order, after this returns
        (engine/optimizer_pass.py); the previous step's pass is settled first, a failure of it
        raised here on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        # Every rank of each sharded model steps after as many micro-batches as the others,
        # or every rank is told which did not, before any steps (comm/lockstep.py).
        for lockstep in lockstep_of(params):
            lockstep.before_step(STEP)
        settle_updates(params, together=True)
        # A delayed pass (``Offload(overlap="delayed")``): the next forward's gathers read the
        # state as it is now, the last pass settled and this step's not started.
        for p in params:
            if is_shard(p):
                publish(p)
        overlapped: list[tuple[_Bucket, int, torch.Tensor, dict[str, Any]]] = []
        for group, buckets in zip(self.param_groups, self._buckets):
            hyper = self._hyper(group, inv_grad_scale)
            launches: dict[tuple, _Launch | NvmeLaunch] = {}
            for b in buckets:
                for p in b.params:
                    if is_offloaded(p):
                        # The device may still be reading the master or model copy this step
                        # rewrites (an upload): wait for that copy, and nothing else.
                        wait_for_device(p)
                parts = self._whole_bucket_parts(b)
                if parts is None:
                    if b.nvme is None:  # (an NVMe shard without a gradient: nothing to step)
                        with _host_threads(b.host_threads), traced("adam", b.layer_index):
                            self._step_one_by_one(b, hyper)
                    continue
                step, grad_flat = parts
                if b.overlapped:
                    overlapped.append((b, step, grad_flat, hyper))
                    # (the worker writes the copy; every reader of it waits for that first)
                    self._mark_stepped(b.params)
                    continue
                copy_dtype = None if b.model_copy is None else b.model_copy.dtype
                if b.nvme is not None:
                    key = (id(b.nvme.store), grad_flat.dtype, copy_dtype, step, b.host_threads)
                    launch = launches.setdefault(key, NvmeLaunch(b.nvme.store, step,
                                                                 b.host_threads))
                else:
                    key = (b.master.device, grad_flat.dtype, copy_dtype, step, b.host_threads)
                    launch = launches.setdefault(key, _Launch(step, b.host_threads))
                launch.add(b, grad_flat, _settled(b, hyper))
            for launch in launches.values():
                with _host_threads(launch.host_threads), traced("adam", -1):
                    launch.run(hyper)
                for b in launch.buckets:
                    self._mark_stepped(b.params)
        if overlapped:
            held = {id(b.params[0]): grad_flat for b, _, grad_flat, _ in overlapped}
            self._pass.start(_jobs(overlapped), held)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. Dropping the gradients does not wait for an
        overlapped pass (it holds the ones it reads); zeroing them in place does."""
        if not set_to_none:
            settle_updates([p for g in self.param_groups for p in g["params"]], together=True,
                           kind=ZERO_GRAD)
        _torch_optimizer("zero_grad")(self, set_to_none=set_to_none)

    @property
    def pass_in_flight(self) -> bool:
        """Whether an overlapped pass is still running on the host worker."""
        return self._pass is not None and self._pass.in_flight

    def settle(self) -> None:
        """Waits for the overlapped pass in flight (if any) and raises its failure: this rank
        alone (``settle_updates``)."""
        settle_updates([p for g in self.param_groups for p in g["params"]])

    def _hyper(self, group: dict[str, Any], inv_grad_scale: float) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw=self._adamw,
                    inv_grad_scale=inv_grad_scale)

    def _whole_bucket_parts(self, b: _Bucket) -> tuple[int, torch.Tensor] | None:
        """For a bucket whose parameters all have gradients and one step count: counts the
        step and returns (the step count, the bucket's flat gradient), the bucket to be stepped
        whole. None otherwise (nothing changed)."""
        grads = [p.grad for p in b.params]
        steps = [self.state[p]["step"] for p in b.params]
        if not (all(g is not None for g in grads) and all(s == steps[0] for s in steps)):
            return None
        for s in steps:
            s += 1
        step = int(steps[0].item())
        grad_flat = grads[0] if b.grad_flat is None else ops.pack(grads, b.offsets, b.grad_flat)
        return step, grad_flat

    def _step_one_by_one(self, b: _Bucket, hyper: dict[str, Any]) -> None:
        """Some parameters have no gradient (or were skipped before): steps the others one by
        one on their slices of the flat buffers, exactly as torch.optim would."""
        stepped = []
        for p, off in zip(b.params, b.offsets):
            g, s = p.grad, self.state[p]["step"]
            if g is None:
                continue
            stepped.append(p)
            if g.is_sparse:
                raise ValueError("zerocore.optim.Adam does not support sparse gradients")
            s += 1
            n = p.numel()
            copy = None if b.model_copy is None else b.model_copy[off:off + n]
            run = b.runs[0] if b.runs else (0, 0, None, 1.0)  # plain buckets: one run
            ops.fused_adam(b.master[off:off + n], g.contiguous().view(-1),
                           b.exp_avg[off:off + n], b.exp_avg_sq[off:off + n], copy,
                           step=int(s.item()), **_with(hyper, run[2], run[3]))
        self._mark_stepped(stepped)

    @staticmethod
    def _mark_stepped(params: list[torch.nn.Parameter]) -> None:
        # Only a shard the kernel just wrote has a fresh model copy: a skipped one keeps whatever
        # outside write made it stale, for refresh_model_copy() to see.
        for p in params:
            if is_shard(p):
                mark_model_copy_synced(p)

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Copies low-precision parameters into the fp32 master weights, after the model was
        changed outside the optimizer (for instance by ``model.load_state_dict``)."""
        self.settle()
        for buckets in self._buckets:
            for b in buckets:
                if b.model_copy is not None and b.grad_flat is not None:
                    b.master.copy_(b.model_copy)

    # -- checkpoints ---------------------------------------------------------------------------

    def _refuse_nvme(self, what: str) -> None:
        if any(b.nvme is not None for buckets in self._buckets for b in buckets):
            raise ValueError(f"zerocore.optim: {what}: this optimizer steps shards whose "
                             f"masters and moments live on NVMe (Offload(optimizer='nvme')), "
                             f"which a state dict in memory cannot hold; use "
                             f"zerocore.save_checkpoint / load_checkpoint (they read and write "
                             f"the scratch layer by layer)")

    def state_dict(self) -> dict[str, Any]:
        self._refuse_nvme("state_dict()")
        self.settle()
        return _torch_optimizer("state_dict")(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.Adam``/``AdamW`` (same layout).
        Values are copied into the flat buffers, so the parameters' storage is unchanged. The
        whole state dict is checked before anything is written, so a mismatched one raises
        ValueError and leaves the optimizer as it was."""
        self._refuse_nvme("load_state_dict()")
        self.settle()
        groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups but the optimizer has "
                             f"{len(self.param_groups)}")
        for mine, saved in zip(self.param_groups, groups):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(f"a param group of the state dict has {len(saved['params'])} "
                                 f"parameters but the optimizer's has {len(mine['params'])}")
            problem = overrides_mismatch(mine, saved)
            if problem:
                raise ValueError(f"zerocore.optim: {problem}")
            for flag in ("amsgrad", "maximize"):
                if saved.get(flag, False):
                    raise ValueError(f"state dict was saved with {flag}=True, which "
                                     f"zerocore.optim.Adam does not implement")
            for p, pid in zip(mine["params"], saved["params"]):
                st = saved_state.get(pid)
                if st is None:
                    continue
                missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in st]
                if missing:
                    raise ValueError(f"state of parameter {pid} has no {', '.join(missing)}: "
                                     f"not a state dict of Adam or AdamW")
                for key in ("exp_avg", "exp_avg_sq", "master_param"):
                    if key in st and st[key].shape != p.shape:
                        raise ValueError(f"state {key} of parameter {pid} has shape "
                                         f"{tuple(st[key].shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            for mine, saved in zip(self.param_groups, groups):
                for key, value in saved.items():
                    if key != "params":
                        mine[key] = value
                for p, pid in zip(mine["params"], saved["params"]):
                    if p not in self.state:
                        continue  # frozen at construction: never stepped, no state
                    target = self.state[p]
                    st = saved_state.get(pid)
                    if st is None:
                        # torch.optim has no state for a parameter that never had a gradient
                        # and restarts it from scratch: do the same.
                        zero = torch.zeros(())
                        st = {"step": 0.0, "exp_avg": zero, "exp_avg_sq": zero}
                    target["exp_avg"].copy_(st["exp_avg"])
                    target["exp_avg_sq"].copy_(st["exp_avg_sq"])
                    target["step"].fill_(float(st["step"]))
                    if "master_param" in target:
                        # A torch.optim state dict has no master weights: take the parameter's.
                        target["master_param"].copy_(st.get("master_param", p))


class AdamW(Adam):
    """``zerocore.optim.Adam`` with decoupled weight decay, the counterpart of
    ``torch.optim.AdamW`` (default weight_decay 0.01, as there)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 param_overrides: Overrides | None = None, pass_hook: PassHook | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, adamw=True, amsgrad=amsgrad,
                         maximize=maximize, param_overrides=param_overrides,
                         pass_hook=pass_hook)
