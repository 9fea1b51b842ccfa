"""Tests of ``zerocore.optim.Adam``/``AdamW`` against ``torch.optim.Adam``/``AdamW``.

The optimizers take ordinary, unflattened parameters (a small model with an embedding, a
LayerNorm, biases and odd sizes), move them into flat buffers and step those with the fused kernel.
These tests train the same model under both implementations and compare losses, parameters and
optimizer state; check checkpoints in torch's layout (round trips, loading torch's own state
dicts); fp16/bf16 parameters with fp32 master weights; ``ShardParameter`` model copies; and the
argument checks. The kernel itself is tested op by op in test_ops.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore.optim as zo
from zerocore.engine.sharded_param import ShardParameter

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
]
LOW_PRECISION = [torch.float16, torch.bfloat16]

# fp32 parameters and losses, zerocore against torch.optim. The kernel performs the same float32
# operations in the same order as torch's single-tensor Adam, but torch's CPU lerp_/addcmul_ fuse a
# multiply-add (one rounding) where the kernel rounds twice, so exp_avg and exp_avg_sq differ in
# the last bit on some elements each step. Through m/sqrt(v) that moves an update of size ~lr by a
# few float32 ulps (lr * ~1e-7), and each parameter carries ~1 ulp of rounding of its own
# (|p| <= ~2, so ~2.4e-7); over 10-20 steps, with mild feedback through the loss, the measured
# worst case is ~3.6e-7. 1e-5 leaves a wide margin for other CPUs and CUDA's foreach path while
# staying far below what a wrong formula would give: a missing bias correction or a dropped
# weight decay changes a parameter by >= lr * weight_decay * |p| ~ 1e-4 in one step.
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
# Moments, as the largest difference over the tensor's largest entry: exp_avg averages gradients
# whose terms cancel, so an entry near zero carries an error of the size of the gradients, not of
# itself. The moments see the same last-bit differences plus the gradients' drift that follows the
# parameters'; measured worst case ~4e-7 of the largest entry, and 1e-5 leaves a 25x margin.
STATE_TOL = 1e-5


class Net(nn.Module):
    """Odd sizes throughout so that flat buffers hold parameters of awkward lengths and offsets.
    ``aux`` is a branch a caller uses only on some steps, so its parameters sometimes have no
    gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 19)
        self.fc1 = nn.Linear(19, 53)
        self.norm = nn.LayerNorm(53)
        self.fc2 = nn.Linear(53, 7)
        self.aux = nn.Linear(19, 7)

    def forward(self, idx: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = self.emb(idx).mean(1)                          # (B, 19)
        out = self.fc2(F.gelu(self.norm(self.fc1(h))))     # (B, 7)
        if use_aux:
            out = out + self.aux(h)
        return out


def make_model(seed: int, device: str, dtype: torch.dtype = torch.float32) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net().to(device=device, dtype=dtype)


def make_batches(n: int, device: str, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 37, (16, 5), generator=g).to(device),
             torch.randint(0, 7, (16,), generator=g).to(device)) for _ in range(n)]


def param_groups(model: Net) -> list[dict]:
    """Three groups with different learning rates and weight decays, as trainers use them."""
    return [
        dict(params=[model.fc1.weight, model.fc2.weight, model.aux.weight], lr=1e-2,
             weight_decay=0.1),
        dict(params=[model.fc1.bias, model.fc2.bias, model.aux.bias, model.norm.weight,
                     model.norm.bias], lr=5e-3, weight_decay=0.0),
        dict(params=[model.emb.weight], lr=3e-3, weight_decay=0.05),
    ]


def train(model: Net, opt: torch.optim.Optimizer, batches, *, sched=None,
          use_aux=lambda i: False, drop_grads=lambda i, model: None) -> torch.Tensor:
    """Plain training loop; returns the losses. ``drop_grads`` may set some grads to None."""
    losses = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = F.cross_entropy(model(x, use_aux(i)).float(), y)
        loss.backward()
        drop_grads(i, model)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def assert_models_close(ref: nn.Module, got: nn.Module, **tol) -> None:
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        torch.testing.assert_close(b, a, msg=lambda m: f"parameter {name}: {m}", **tol)


def assert_state_close(ref_opt: torch.optim.Optimizer, ref: nn.Module, opt: torch.optim.Optimizer,
                       got: nn.Module) -> None:
    """Moments and step counts of every parameter. torch creates state lazily, on a parameter's
    first gradient; zerocore has state for every parameter, which must then be still untouched."""
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        mine = opt.state[b]
        if a not in ref_opt.state:
            assert float(mine["step"]) == 0, name
            assert not mine["exp_avg"].any() and not mine["exp_avg_sq"].any(), name
            continue
        theirs = ref_opt.state[a]
        assert float(mine["step"]) == float(theirs["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            # Scaled by the tensor's largest entry: see STATE_TOL.
            err = float((mine[key] - theirs[key]).abs().max() / theirs[key].abs().max())
            assert err <= STATE_TOL, f"{key} of {name}: error {err:.2e} of its largest entry"


# -- fp32 parity with torch.optim --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_matches_torch_single_group(kind, device):
    torch_cls, zo_cls = ((torch.optim.AdamW, zo.AdamW) if kind == "adamw"
                         else (torch.optim.Adam, zo.Adam))
    ref, got = make_model(0, device), make_model(0, device)
    # weight_decay > 0: AdamW's decoupled decay, or Adam's L2 term added to the gradient.
    hyper = dict(lr=1e-2, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.1)
    ref_opt, opt = torch_cls(ref.parameters(), **hyper), zo_cls(got.parameters(), **hyper)
    batches = make_batches(12, device)
    ref_losses = train(ref, ref_opt, batches)
    losses = train(got, opt, batches)
    torch.testing.assert_close(losses, ref_losses, **PARAM_TOL)
    assert_models_close(ref, got, **PARAM_TOL)
    assert_state_close(ref_opt, ref, opt, got)


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A linear warm-up over 4 steps, then halving every 3 steps."""
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_matches_torch_param_groups_and_scheduler(kind, device):
    torch_cls, zo_cls = ((torch.optim.AdamW, zo.AdamW) if kind == "adamw"
                         else (torch.optim.Adam, zo.Adam))
    ref, got = make_model(1, device), make_model(1, device)
    ref_opt, opt = torch_cls(param_groups(ref)), zo_cls(param_groups(got))
    ref_sched, sched = make_scheduler(ref_opt), make_scheduler(opt)
    batches = make_batches(14, device)
    ref_lrs, lrs = [], []
    # Record the learning rates each step actually used, to show the scheduler drove both.
    ref_opt.register_step_pre_hook(lambda o, *_: ref_lrs.append([g["lr"] for g in o.param_groups]))
    opt.register_step_pre_hook(lambda o, *_: lrs.append([g["lr"] for g in o.param_groups]))
    ref_losses = train(ref, ref_opt, batches, sched=ref_sched)
    losses = train(got, opt, batches, sched=sched)
    assert lrs == ref_lrs
    assert len({tuple(x) for x in lrs}) >= 5, "the schedule should have changed the lr"
    torch.testing.assert_close(losses, ref_losses, **PARAM_TOL)
    assert_models_close(ref, got, **PARAM_TOL)
    assert_state_close(ref_opt, ref, opt, got)


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_without_gradients_are_skipped(device):
    ref, got = make_model(2, device), make_model(2, device)
    # A parameter that never gets a gradient: torch keeps no state for it and never decays it.
    unused = torch.randn(11, generator=torch.Generator().manual_seed(3)).to(device)
    for m in (ref, got):
        m.unused = nn.Parameter(unused.clone())
    initial_unused = got.unused.detach().clone()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = zo.AdamW(got.parameters(), lr=1e-2, weight_decay=0.1)

    def use_aux(i):  # the branch first runs on step 1, then every third step
        return i % 3 == 1

    def drop_grads(i, model):  # and on some steps a trainer drops gradients itself
        if 4 <= i < 7:
            model.fc1.bias.grad = None
            model.norm.weight.grad = None

    batches = make_batches(12, device)
    ref_losses = train(ref, ref_opt, batches, use_aux=use_aux, drop_grads=drop_grads)
    losses = train(got, opt, batches, use_aux=use_aux, drop_grads=drop_grads)
    torch.testing.assert_close(losses, ref_losses, **PARAM_TOL)
    assert_models_close(ref, got, **PARAM_TOL)
    assert_state_close(ref_opt, ref, opt, got)
    assert torch.equal(got.unused, initial_unused)
    assert float(opt.state[got.aux.weight]["step"]) == 4
    assert float(opt.state[got.fc1.bias]["step"]) == 9


# -- fp16 / bf16 parameters with fp32 master weights -------------------------------------------


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable fp16/bf16 values apart a and b are, elementwise."""
    assert a.dtype == b.dtype and a.dtype in LOW_PRECISION

    def ordered(t):  # sign-magnitude bits to a monotonic integer line, with +0 == -0
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def assert_low_precision_matches(p: torch.Tensor, master: torch.Tensor, ref_master: torch.Tensor,
                                 what: str) -> None:
    # The kernel writes the low-precision parameter from the very float it stores in the master,
    # so the two agree exactly.
    assert torch.equal(p, master.to(p.dtype)), f"{what}: parameter is not its master, cast"
    # The master is a few float32 ulps from torch's (see PARAM_TOL). Casting rounds both to the
    # same fp16/bf16 value unless they straddle a rounding boundary, where they land on the two
    # neighbours: at most 1 ulp of the low-precision dtype apart.
    dist = ulp_distance(p, ref_master.to(p.dtype))
    assert int(dist.max()) <= 1, f"{what}: {int(dist.max())} ulps from torch's master, cast"
    torch.testing.assert_close(master, ref_master, **PARAM_TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_model_keeps_fp32_masters(dtype, device):
    model = make_model(3, device, dtype)
    opt = zo.AdamW(param_groups(model))
    # The reference: torch.optim.AdamW stepping an fp32 master copy of every parameter, with the
    # model's gradients cast to fp32. It is fed the gradients of the zerocore-trained model, so the
    # comparison isolates the optimizer from the low-precision forward and backward.
    masters = {p: p.detach().float().clone().requires_grad_() for p in model.parameters()}
    ref_opt = torch.optim.AdamW([dict(g, params=[masters[p] for p in g["params"]])
                                 for g in param_groups(model)])
    for i, (x, y) in enumerate(make_batches(10, device)):
        opt.zero_grad()
        F.cross_entropy(model(x, use_aux=i % 2 == 0).float(), y).backward()
        for p, master in masters.items():
            master.grad = None if p.grad is None else p.grad.float()
        ref_opt.step()
        opt.step()
        for name, p in model.named_parameters():
            assert p.dtype == dtype
            assert_low_precision_matches(p.detach(), opt.state[p]["master_param"],
                                         masters[p].detach(), f"step {i}, {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_group(device):
    """fp32, fp16 and bf16 parameters in one group: one bucket per dtype, stepped alike."""
    gen = torch.Generator().manual_seed(5)
    shapes_dtypes = [((5, 3), torch.float32), ((7,), torch.bfloat16), ((11, 2), torch.float16),
                     ((1,), torch.float32), ((3, 3, 3), torch.bfloat16)]
    params = [nn.Parameter(torch.randn(s, generator=gen).to(device, d)) for s, d in shapes_dtypes]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = zo.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for step in range(10):
        for p, master in zip(params, masters):
            p.grad = torch.randn(p.shape, generator=gen).to(device, p.dtype)
            master.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for i, (p, master) in enumerate(zip(params, masters)):
            what = f"step {step}, param {i} ({p.dtype})"
            if p.dtype == torch.float32:
                torch.testing.assert_close(p, master, **PARAM_TOL, msg=lambda m: f"{what}: {m}")
                assert "master_param" not in opt.state[p]  # an fp32 parameter is its own master
            else:
                assert_low_precision_matches(p.detach(), opt.state[p]["master_param"],
                                             master.detach(), what)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_sync_master_from_params(dtype):
    """After the model is loaded outside the optimizer, sync_master_from_params() makes the
    masters follow: the next step then starts from the loaded weights."""
    model = make_model(4, "cpu", dtype)
    opt = zo.AdamW(model.parameters(), lr=1e-2)
    other = make_model(5, "cpu", dtype)
    model.load_state_dict(other.state_dict())
    opt.sync_master_from_params()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(opt.state[p]["master_param"], q.detach().float())


# -- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_construction_keeps_values_and_outputs(dtype, device):
    model = make_model(6, device, dtype)
    x, _ = make_batches(1, device)[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out_before = model(x, use_aux=True)
    opt = zo.AdamW(param_groups(model))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.is_leaf and p.requires_grad and p.dtype == dtype, n
    assert torch.equal(model(x, use_aux=True), out_before)
    # The parameters were re-pointed into the flat buffers: one storage per param group.
    for group in opt.param_groups:
        storages = {p.untyped_storage().data_ptr() for p in group["params"]}
        assert len(storages) == 1
    # And still train: gradients reach them and a step moves every one of them.
    F.cross_entropy(model(x, use_aux=True).float(), torch.zeros_like(x[:, 0])).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n


# -- state dicts -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_has_torch_layout(dtype):
    ref, got = make_model(7, "cpu"), make_model(7, "cpu", dtype)
    ref_opt, opt = torch.optim.AdamW(param_groups(ref)), zo.AdamW(param_groups(got))
    batches = make_batches(2, "cpu")
    train(ref, ref_opt, batches, use_aux=lambda i: True)
    train(got, opt, batches, use_aux=lambda i: True)
    ref_sd, sd = ref_opt.state_dict(), opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert set(sd["state"]) == set(ref_sd["state"]) == set(range(len(list(got.parameters()))))
    assert ([g["params"] for g in sd["param_groups"]]
            == [g["params"] for g in ref_sd["param_groups"]])
    for mine, theirs in zip(sd["param_groups"], ref_sd["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert mine[key] == theirs[key], key
    # State is keyed by position in the param groups, in order.
    in_order = [p for g in opt.param_groups for p in g["params"]]
    for (idx, theirs), p in zip(sorted(ref_sd["state"].items()), in_order):
        mine = sd["state"][idx]
        extra = {"master_param"} if dtype != torch.float32 else set()
        assert set(mine) == set(theirs) | extra
        assert mine["step"].shape == () and mine["step"].dtype == theirs["step"].dtype
        assert float(mine["step"]) == float(theirs["step"]) == 2
        for key in ("exp_avg", "exp_avg_sq", *extra):
            assert mine[key].shape == p.shape and mine[key].dtype == torch.float32, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_is_bitwise(dtype):
    """5 steps, save, rebuild everything, load, 5 more == 10 uninterrupted steps, bit for bit:
    the CPU kernel and the model's CPU forward/backward are deterministic, and a checkpoint must
    restore everything a step depends on (moments, step counts, masters, learning rates)."""
    batches = make_batches(10, "cpu")

    def build(seed):
        model = make_model(seed, "cpu", dtype)
        opt = zo.AdamW(param_groups(model))
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    ref, ref_opt, ref_sched = build(8)
    ref_losses = train(ref, ref_opt, batches, sched=ref_sched)

    model, opt, sched = build(8)
    first = train(model, opt, batches[:5], sched=sched)
    saved = copy.deepcopy(dict(model=model.state_dict(), opt=opt.state_dict(),
                               sched=sched.state_dict()))
    del model, opt, sched
    # A differently initialised model, so every value has to come from the checkpoint.
    model, opt, sched = build(9)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    second = train(model, opt, batches[5:], sched=sched)

    assert torch.equal(torch.cat([first, second]), ref_losses)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
        for key, value in ref_opt.state[a].items():
            assert torch.equal(opt.state[b][key], value), f"{key} of {name}"


def test_load_torch_state_dict_and_back():
    """A torch.optim.AdamW checkpoint continues under zerocore as it would under torch, and a
    zerocore checkpoint continues under torch."""
    batches = make_batches(10, "cpu")
    ref = make_model(10, "cpu")
    ref_opt = torch.optim.AdamW(param_groups(ref))
    train(ref, ref_opt, batches[:5], use_aux=lambda i: i == 3)  # aux: state at a lower step
    saved = copy.deepcopy(dict(model=ref.state_dict(), opt=ref_opt.state_dict()))
    ref_losses = train(ref, ref_opt, batches[5:])

    got = make_model(11, "cpu")
    # hyper-parameters come from the load
    opt = zo.AdamW(param_groups(got), lr=0.5, weight_decay=0.0)
    got.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    losses = train(got, opt, batches[5:])
    torch.testing.assert_close(losses, ref_losses, **PARAM_TOL)
    assert_models_close(ref, got, **PARAM_TOL)
    assert_state_close(ref_opt, ref, opt, got)

    # And back: zerocore's state dict (after these 10 steps) into torch.optim.AdamW.
    back = make_model(12, "cpu")
    back_opt = torch.optim.AdamW(param_groups(back))
    back.load_state_dict(copy.deepcopy(got.state_dict()))
    back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    more = make_batches(3, "cpu", seed=99)
    torch.testing.assert_close(train(back, back_opt, more), train(got, opt, more), **PARAM_TOL)
    assert_models_close(back, got, **PARAM_TOL)


def test_load_torch_state_dict_into_low_precision():
    """A torch state dict has no master weights: the low-precision parameters become them."""
    ref = make_model(13, "cpu", torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters())
    train(ref, ref_opt, make_batches(2, "cpu"))
    got = make_model(14, "cpu", torch.bfloat16)
    opt = zo.AdamW(got.parameters())
    got.load_state_dict(ref.state_dict())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for p in got.parameters():
        assert torch.equal(opt.state[p]["master_param"], p.detach().float())


def test_load_mismatched_state_dict_raises_and_changes_nothing():
    model = make_model(15, "cpu")
    opt = zo.AdamW(param_groups(model))
    train(model, opt, make_batches(2, "cpu"))
    good = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())

    def variant(edit):
        sd = copy.deepcopy(good)
        sd["param_groups"][0]["lr"] = 123.0  # would show if anything were written before failing
        edit(sd)
        return sd

    def drop_group(sd):
        sd["param_groups"].pop()

    def drop_param(sd):
        sd["param_groups"][1]["params"].pop()

    def wrong_shape(sd):
        last = sd["param_groups"][-1]["params"][0]  # the embedding, (37, 19)
        sd["state"][last]["exp_avg"] = torch.zeros(19, 37)

    def not_adam(sd):
        del sd["state"][2]["exp_avg_sq"]

    def amsgrad(sd):
        sd["param_groups"][2]["amsgrad"] = True

    cases = [(drop_group, "2 param groups but the optimizer has 3"),
             (drop_param, "has 4 parameters but the optimizer's has 5"),
             (wrong_shape, r"exp_avg of parameter 8 has shape \(19, 37\), expected \(37, 19\)"),
             (not_adam, "has no exp_avg_sq"),
             (amsgrad, "amsgrad=True")]
    for edit, message in cases:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(variant(edit))
        after = opt.state_dict()
        assert ([g["lr"] for g in after["param_groups"]]
                == [g["lr"] for g in before["param_groups"]])
        for idx, st in before["state"].items():
            for key, value in st.items():
                assert torch.equal(after["state"][idx][key], value), (edit.__name__, idx, key)


# -- ShardParameter ----------------------------------------------------------------------------


def make_shard(n: int = 1001, seed: int = 16) -> ShardParameter:
    master = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return ShardParameter(master, model_copy=master.to(torch.bfloat16))


def test_shard_model_copy_written_by_step():
    p = make_shard()
    ref = p.detach().clone().requires_grad_()
    opt = zo.AdamW([p], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    storage = p.data_ptr()
    gen = torch.Generator().manual_seed(17)
    for _ in range(5):
        p.grad = torch.randn(p.shape, generator=gen)
        ref.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        # The copy is written from the very floats stored in the master, in the same pass.
        assert torch.equal(p.model_copy, p.detach().to(torch.bfloat16))
        torch.testing.assert_close(p, ref, **PARAM_TOL)
    assert p.data_ptr() == storage  # the shard is its own master: stepped in place
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}  # no separate master


def test_shard_refresh_model_copy():
    p = make_shard()
    opt = zo.AdamW([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    # After our own step the copy is known to be fresh: refresh_model_copy() must not copy. A
    # sentinel written into the copy (which does not touch the master's version) shows whether it
    # did.
    p.model_copy.fill_(7.0)
    p.refresh_model_copy()
    assert (p.model_copy == 7.0).all()

    # An outside in-place write to the master bumps its version; refresh then re-derives the copy.
    p.refresh_model_copy()  # (nothing to do)
    with torch.no_grad():
        p.mul_(2)
    p.refresh_model_copy()
    assert torch.equal(p.model_copy, p.detach().to(torch.bfloat16))

    # An outside write followed by a step that skips the shard (no gradient) leaves the copy
    # stale, and refresh must still see it.
    with torch.no_grad():
        p.add_(1)
    p.grad = None
    opt.step()
    p.refresh_model_copy()
    assert torch.equal(p.model_copy, p.detach().to(torch.bfloat16))

    # An outside write followed by our step: the step reads the new master and writes the copy.
    with torch.no_grad():
        p.mul_(0.5)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(p.model_copy, p.detach().to(torch.bfloat16))


# -- arguments ---------------------------------------------------------------------------------


def one_param() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("make, message", [
    (lambda: zo.AdamW(one_param(), amsgrad=True), "amsgrad"),
    (lambda: zo.Adam(one_param(), amsgrad=True), "amsgrad"),
    (lambda: zo.AdamW(one_param(), maximize=True), "maximize"),
    (lambda: zo.AdamW(one_param(), lr=-1e-3), "learning rate"),
    (lambda: zo.AdamW(one_param(), betas=(1.0, 0.999)), "betas"),
    (lambda: zo.AdamW(one_param(), betas=(0.9, 1.0)), "betas"),
    (lambda: zo.Adam(one_param(), betas=(-0.1, 0.999)), "betas"),
    (lambda: zo.AdamW(one_param(), eps=-1e-8), "eps"),
    (lambda: zo.AdamW(one_param(), weight_decay=-0.1), "weight_decay"),
    (lambda: zo.AdamW([nn.Parameter(torch.zeros(3, dtype=torch.float64))]), "torch.float64"),
])
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_frozen_parameters_of_any_dtype_are_skipped():
    """Frozen parameters are never stepped, whatever they hold (zerocore's int8 frozen shards,
    FrozenWeights("int8"), are bytes): accepted and left alone."""
    frozen = nn.Parameter(torch.arange(3, dtype=torch.uint8), requires_grad=False)
    trained = one_param()
    opt = zo.AdamW([frozen, *trained], lr=0.1)
    for p in trained:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(frozen, torch.arange(3, dtype=torch.uint8))
    assert frozen not in opt.state
