"""Per-parameter optimizer settings on flat shards (issue 21, item 1): ``zerocore.optim.AdamW(...,
param_overrides=rule)``, a rule by the model's own parameter names giving a parameter its own
``weight_decay`` and an ``lr_scale`` (of the group's lr, so schedulers keep working).

- Ordinary parameters: the rule gives what the same torch-style param groups give, bit for bit
  (the same kernel on the same elements), and ``torch.optim.AdamW`` with those groups to
  rounding.
- Both front doors at world sizes 1-3 (``shard`` here, ``shard_model`` in test_shard_model.py):
  the sharded model trains as the unsharded one with ``torch.optim.AdamW`` and the same groups,
  each shard stepped in runs of equal settings (a parameter straddling two ranks' shards is
  split between them).
- The settings travel with state dicts and checkpoints, and loading under other settings is
  refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from tests.support.dist_utils import all_gather_flat, global_mean
from zerocore.optim import no_decay_on_biases_and_norms

LR, WD = 1e-2, 0.1
STEPS = 4
# As tests/engine/test_shard.py (which says why): the sharded model computes the same fp32
# operations in another order, so losses agree to a few ulps and parameters within 2e-3·lr. A
# missing or spurious decay moves a parameter by lr·wd·|p| = 1e-3·|p| per step, far above.
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
PARAM_TOL = dict(rtol=1e-5, atol=2e-3 * LR)
# zerocore's kernel against torch's AdamW on the same values: the same formula in another
# order of operations, a few ulps of the update per step (test_optim.py's PARAM_TOL).
TORCH_TOL = dict(rtol=1e-5, atol=1e-5)


def layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(13, 40), nn.GELU()),
            nn.Sequential(nn.LayerNorm(40), nn.Linear(40, 40), nn.GELU()),
            nn.Linear(40, 3)]


def rule(stack: list[nn.Module]):
    """No decay on biases and norms, and half the learning rate for the first layer's weight
    (to exercise lr_scale)."""
    base = no_decay_on_biases_and_norms(stack)

    def overrides(name: str):
        if name == "0.0.weight":
            return {"lr_scale": 0.5}
        return base(name)
    return overrides


def torch_groups(model: nn.Module, overrides) -> list[dict]:
    """The same settings as torch-style param groups."""
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        ov = overrides(name) or {}
        key = (ov.get("weight_decay", WD), LR * ov.get("lr_scale", 1.0))
        groups.setdefault(key, []).append(p)
    return [{"params": ps, "weight_decay": wd, "lr": lr} for (wd, lr), ps in groups.items()]


def batches(n: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 13, generator=g), torch.randn(rows, 3, generator=g))
            for _ in range(n)]


def train(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- ordinary parameters --------------------------------------------------------------------------

def test_overrides_are_the_torch_style_groups():
    stack = layers()
    models = [nn.Sequential(*copy.deepcopy(stack)) for _ in range(3)]
    overrides = rule(models[0])
    by_rule = zerocore.optim.AdamW(models[0].named_parameters(), lr=LR, weight_decay=WD,
                                   param_overrides=overrides)
    by_groups = zerocore.optim.AdamW(torch_groups(models[1], overrides))
    torch_opt = torch.optim.AdamW(torch_groups(models[2], overrides))
    data = batches(STEPS, 8)
    losses = [train(m, o, data) for m, o in zip(models, (by_rule, by_groups, torch_opt))]
    assert losses[0] == losses[1]
    for (name, a), b, c in zip(models[0].named_parameters(), models[1].parameters(),
                               models[2].parameters()):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, c, **TORCH_TOL, msg=lambda m: f"{name}: {m}")
    assert by_rule.param_groups[0]["param_overrides"] == {
        "0.0.weight": {"lr_scale": 0.5}, "0.0.bias": {"weight_decay": 0.0},
        "1.0.weight": {"weight_decay": 0.0}, "1.0.bias": {"weight_decay": 0.0},
        "1.1.bias": {"weight_decay": 0.0}, "2.bias": {"weight_decay": 0.0}}


def test_a_rule_that_gives_other_settings_is_refused():
    model = nn.Linear(2, 2)
    for bad, phrase in (({"betas": (0.5, 0.5)}, "only 'weight_decay' and 'lr_scale'"),
                        ({"weight_decay": -1.0}, "must be a number >= 0")):
        with pytest.raises(ValueError, match=phrase):
            zerocore.optim.AdamW(model.named_parameters(), param_overrides=lambda n: bad)


def test_state_dicts_keep_the_settings_and_refuse_others():
    model = nn.Sequential(*layers())
    overrides = rule(model)
    opt = zerocore.optim.AdamW(model.named_parameters(), lr=LR, param_overrides=overrides)
    train(model, opt, batches(2, 8))
    saved = opt.state_dict()
    again = zerocore.optim.AdamW(model.named_parameters(), lr=LR, param_overrides=overrides)
    again.load_state_dict(saved)
    plain = zerocore.optim.AdamW(model.named_parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"other per-parameter settings \(param_overrides\) "
                                         r"for 6 parameter\(s\), e.g. 0.0.bias"):
        plain.load_state_dict(saved)


# -- zerocore.shard at world sizes 1-3 ------------------------------------------------------------

def shard_run(rank: int, world_size: int, use_rule: bool) -> dict:
    stack = layers()
    ref = nn.Sequential(*copy.deepcopy(stack))
    overrides = rule(stack)
    model = zerocore.shard(stack)
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD,
                               param_overrides=overrides if use_rule else None)
    ref_opt = torch.optim.AdamW(torch_groups(ref, overrides))
    losses, ref_losses = [], []
    for x, y in batches(STEPS, 2 * world_size):
        loss = nn.functional.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = [all_gather_flat(s) for s in model.trainable_shards()]
    params = {}
    for layer, flat in zip(model.layers, full):
        for slot in layer.trainable.layout.slots:
            params[f"{layer.index}.{slot.name}"] = flat[slot.offset:slot.offset + slot.numel
                                                        ].view(slot.shape)
    segments = [s.segments for s in model.trainable_shards()]
    dist.barrier()
    return {"losses": losses, "ref_losses": ref_losses, "params": params,
            "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
            "segments": segments}


@pytest.mark.parametrize("use_rule", [True, False], ids=["rule", "no-rule"])
def test_shard_trains_as_torch_with_the_same_groups(world, use_rule):
    r0 = world.run(shard_run, use_rule)[0]
    if not use_rule:
        # The comparison can fail: without the rule every parameter decays and the first
        # layer's weight moves at the full lr, unlike the reference.
        assert any(not torch.allclose(r0["params"][n], want, **PARAM_TOL)
                   for n, want in r0["ref_params"].items())
        return
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(r0["ref_losses"]),
                               **LOSS_TOL)
    assert r0["params"].keys() == r0["ref_params"].keys()
    for name, want in r0["ref_params"].items():
        torch.testing.assert_close(r0["params"][name], want, **PARAM_TOL,
                                   msg=lambda m: f"{name}: {m}")


def checkpoint_run(rank: int, world_size: int, root: str) -> dict:
    stack = layers()
    model = zerocore.shard(stack)
    opt = zerocore.optim.AdamW(model.parameters(), lr=LR, param_overrides=rule(stack))
    train(model, opt, batches(1, 2))
    zerocore.save_checkpoint(root, 1, model, opt)
    again = zerocore.optim.AdamW(model.parameters(), lr=LR, param_overrides=rule(stack))
    zerocore.load_checkpoint(zerocore.latest_checkpoint(root), model, again)
    plain = zerocore.optim.AdamW(model.parameters(), lr=LR)
    try:
        zerocore.load_checkpoint(zerocore.latest_checkpoint(root), model, plain)
        refused = None
    except zerocore.CheckpointError as e:
        refused = str(e)
    return {"refused": refused}


def test_checkpoints_keep_the_settings(worlds, tmp_path):
    for res in worlds(2).run(checkpoint_run, str(tmp_path / "ckpt")):
        assert res["refused"] is not None and "param_overrides" in res["refused"]
        assert "\n" not in res["refused"]
