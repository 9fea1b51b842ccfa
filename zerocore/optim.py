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
the gradients of a bucket into one flat buffer (one multi-tensor copy) and runs
one fused kernel over the whole bucket. Parameters whose ``.grad`` is None are skipped, as
``torch.optim`` skips them; then that bucket is stepped parameter by parameter.

Caveat shared with every optimizer that keeps master weights: after changing a low-precision
parameter outside the optimizer, call ``sync_master_from_params()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from zerocore import ops
from zerocore.offload import OffloadedShard
from zerocore.sharded_param import ShardParameter

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class _Bucket:
    """Parameters of one param group on one device with one dtype, stepped by one kernel call."""

    params: list[torch.nn.Parameter]
    offsets: list[int]               # start of each parameter in the flat buffers
    master: torch.Tensor             # 1D, fp32: the weights Adam updates
    exp_avg: torch.Tensor            # 1D, fp32
    exp_avg_sq: torch.Tensor         # 1D, fp32
    model_copy: torch.Tensor | None  # 1D, fp16/bf16: what the model computes with; None if fp32
    grad_flat: torch.Tensor | None   # 1D, gradient dtype; None for a shard (its grad is flat)


def _flat_views(flat: torch.Tensor, params: list[torch.nn.Parameter],
                offsets: list[int]) -> list[torch.Tensor]:
    return [flat[o:o + p.numel()].view(p.shape) for p, o in zip(params, offsets)]


class Adam(torch.optim.Optimizer):
    """Adam with L2 weight decay (``adamw=False``, like ``torch.optim.Adam``) or with decoupled
    weight decay (``adamw=True``, like ``torch.optim.AdamW``), stepped by ``zerocore.ops.fused_adam``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, adamw: bool = False, amsgrad: bool = False,
                 maximize: bool = False):
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
        self._buckets: list[list[_Bucket]] = []  # per param group
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    # -- construction --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            # Frozen parameters are never stepped, whatever they hold (zerocore's int8 frozen
            # shards, FrozenWeights, are bytes).
            if p.requires_grad and p.dtype not in (torch.float32, *_LOW_PRECISION):
                raise ValueError(f"zerocore.optim: parameter of dtype {p.dtype} is not supported; "
                                 f"parameters must be float32, float16 or bfloat16")
        self._buckets.append(self._make_buckets(group["params"]))

    def _make_buckets(self, params: list[torch.nn.Parameter]) -> list[_Bucket]:
        buckets = []
        plain: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            if not p.requires_grad:
                # Frozen (e.g. zerocore's frozen shards, which model.parameters() yields):
                # never stepped, so no state, as torch.optim never creates state for them.
                continue
            if isinstance(p, ShardParameter):
                buckets.append(self._shard_bucket(p))
            else:
                plain.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), ps in plain.items():
            buckets.append(self._flat_bucket(ps, device, dtype))
        return buckets

    def _shard_bucket(self, p: ShardParameter) -> _Bucket:
        if p.dtype != torch.float32 or p.dim() != 1:
            raise ValueError("zerocore.optim: a ShardParameter must be a 1-D float32 master shard")
        bucket = _Bucket([p], [0], p.data, torch.zeros_like(p.data), torch.zeros_like(p.data),
                         p.model_copy, None)
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
        ``torch.optim.Optimizer.state_dict`` sees exactly what the kernel updates."""
        views = zip(b.params, _flat_views(b.exp_avg, b.params, b.offsets),
                    _flat_views(b.exp_avg_sq, b.params, b.offsets),
                    _flat_views(b.master, b.params, b.offsets))
        for p, m, v, master in views:
            state = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
            if b.model_copy is not None and not isinstance(p, ShardParameter):
                state["master_param"] = master
            self.state[p] = state

    # -- stepping ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,
             inv_grad_scale: float = 1.0) -> Any:
        """One step. ``inv_grad_scale`` multiplies every gradient inside the kernel: pass
        ``clip_coef / loss_scale`` to unscale and clip without another pass over the gradients
        (``zerocore.LossScaler.step`` does)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, buckets in zip(self.param_groups, self._buckets):
            for b in buckets:
                self._step_bucket(group, b, inv_grad_scale)
        return loss

    def _hyper(self, group: dict[str, Any], inv_grad_scale: float) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw=self._adamw,
                    inv_grad_scale=inv_grad_scale)

    def _step_bucket(self, group: dict[str, Any], b: _Bucket, inv_grad_scale: float) -> None:
        for p in b.params:
            if isinstance(p, OffloadedShard):
                # The device may still be reading the master or model copy this step rewrites
                # (an upload): wait for that copy, and nothing else.
                p.wait_for_device()
        grads = [p.grad for p in b.params]
        steps = [self.state[p]["step"] for p in b.params]
        hyper = self._hyper(group, inv_grad_scale)
        if all(g is not None for g in grads) and all(s == steps[0] for s in steps):
            for s in steps:
                s += 1
            step = int(steps[0].item())
            if b.grad_flat is None:
                grad_flat = grads[0]
            else:
                grad_flat = ops.pack(grads, b.offsets, b.grad_flat)
            ops.fused_adam(b.master, grad_flat, b.exp_avg, b.exp_avg_sq, b.model_copy,
                           step=step, **hyper)
            stepped = b.params
        else:
            # Some parameters have no gradient (or were skipped before): step the others one by
            # one on their slices of the flat buffers, exactly as torch.optim would.
            stepped = []
            for p, g, s, off in zip(b.params, grads, steps, b.offsets):
                if g is None:
                    continue
                stepped.append(p)
                if g.is_sparse:
                    raise ValueError("zerocore.optim.Adam does not support sparse gradients")
                s += 1
                n = p.numel()
                copy = None if b.model_copy is None else b.model_copy[off:off + n]
                ops.fused_adam(b.master[off:off + n], g.contiguous().view(-1),
                               b.exp_avg[off:off + n], b.exp_avg_sq[off:off + n], copy,
                               step=int(s.item()), **hyper)
        # Only a shard the kernel just wrote has a fresh model copy: a skipped one keeps whatever
        # outside write made it stale, for refresh_model_copy() to see.
        for p in stepped:
            if isinstance(p, ShardParameter):
                p.mark_model_copy_synced()

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        """Copies low-precision parameters into the fp32 master weights, after the model was
        changed outside the optimizer (for instance by ``model.load_state_dict``)."""
        for buckets in self._buckets:
            for b in buckets:
                if b.model_copy is not None and b.grad_flat is not None:
                    b.master.copy_(b.model_copy)

    # -- checkpoints ---------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``torch.optim.Adam``/``AdamW`` (same layout).
        Values are copied into the flat buffers, so the parameters' storage is unchanged. The
        whole state dict is checked before anything is written, so a mismatched one raises
        ValueError and leaves the optimizer as it was."""
        groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups but the optimizer has "
                             f"{len(self.param_groups)}")
        for mine, saved in zip(self.param_groups, groups):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(f"a param group of the state dict has {len(saved['params'])} "
                                 f"parameters but the optimizer's has {len(mine['params'])}")
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
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, adamw=True, amsgrad=amsgrad,
                         maximize=maximize)
