"""The plan's estimate of the offloaded optimizer pass against the next forward
(zerocore/planning/pass_overlap.py, issue 44, item 3): its arithmetic on a known stack, by hand;
"off" and parameters on NVMe do not overlap; NVMe counts the scratch's bytes. No timings: the
estimate is arithmetic over stated rates."""

from __future__ import annotations

import pytest
import torch

import zerocore
from neox.plan import main as plan_main
from tests.support.neox_testing import call_main
from tests.support.offload_stack import BATCH, SEQ, layer_stack, stack_loss
from zerocore.planning.pass_overlap import (THIS_CPU, Machine, dense_forward_flops,
                                            pass_bytes, pass_overlap)

# tests/support/offload_stack.py's stack, counted by hand: an embedding 512 x 128 (65,536),
# four blocks of a LayerNorm (256) and two Linears (128 x 512 + 512, 512 x 128 + 128: 131,968 a
# block), a head 128 x 512 + 512 (66,048): 659,456 trainable parameters; over two ranks,
# 329,728 a rank.
PARAMS, WORLD = 659_456, 2
SHARD = PARAMS // WORLD
TOKENS = BATCH * SEQ
# Round rates, so the expected seconds are plain arithmetic.
ROUND = Machine(name="a round machine", flops=1e10, adam_bytes_per_s=1e9, disk_bytes_per_s=1e8)


def planned(offload: zerocore.Offload,
            param_dtype: torch.dtype = torch.bfloat16) -> zerocore.plan.MemoryPlan:
    return zerocore.plan.plan(layer_stack("meta"),
                              torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),
                              world_size=WORLD, loss=stack_loss, device="cpu", offload=offload,
                              mixed_precision=zerocore.MixedPrecision(param_dtype))


def estimate(offload: zerocore.Offload, machine: Machine = ROUND):
    plan = planned(offload)
    assert plan.state.trainable_numel == PARAMS
    return plan, pass_overlap(plan, offload, forward_flops=dense_forward_flops(PARAMS, TOKENS),
                              machine=machine)


def test_host_pass_against_the_forward_by_hand():
    plan, est = estimate(zerocore.Offload(optimizer="cpu"))
    # Adam reads master, moments, gradient (16 bytes), writes master and moments (12), and
    # writes the bf16 model copy (2): 30 bytes an element; no disk.
    assert pass_bytes(plan) == (SHARD * 30, 0)
    assert est.pass_s == pytest.approx(SHARD * 30 / 1e9)           # 9.9 ms
    assert est.forward_s == pytest.approx(2 * PARAMS * TOKENS / 1e10)  # 33.8 ms
    assert est.overlaps and est.hidden_s == est.pass_s            # the whole pass hides
    assert est.line() == ("on a round machine: optimizer pass ~9.9 ms, forward ~34 ms: "
                          "overlap hides ~9.9 ms (exact)")


def test_nvme_counts_the_scratch_bytes(tmp_path):
    plan, est = estimate(zerocore.Offload(optimizer="nvme", path=str(tmp_path)))
    # The masters and moments (12 bytes an element) are read from the scratch and written back.
    assert pass_bytes(plan) == (SHARD * 30, SHARD * 24)
    assert est.pass_s == pytest.approx(SHARD * 24 / 1e8)            # the disk, 79 ms, is slower
    assert est.overlaps and est.hidden_s == est.forward_s         # the forward hides part
    # In fp32 with the parameters in memory the master is the model copy there: the scratch
    # holds the moments alone (8 bytes an element each way), and no copy is written apart
    # (28 bytes an element in memory).
    fp32 = planned(zerocore.Offload(optimizer="nvme", path=str(tmp_path)), torch.float32)
    assert not fp32.state.nvme_masters
    assert pass_bytes(fp32) == (SHARD * 28, SHARD * 16)


def test_the_delayed_pass_hides_behind_forward_and_backward_and_counts_its_copy(tmp_path):
    """``overlap="delayed"``: the published copy the gathers read is a second bf16 copy of the
    trainable shard (2 bytes an element more in the plan), which the pass does not move; what
    it hides behind is the forward and the backward (three forwards' FLOPs)."""
    exact, _ = estimate(zerocore.Offload(optimizer="nvme", path=str(tmp_path)))
    plan, est = estimate(zerocore.Offload(optimizer="nvme", path=str(tmp_path),
                                          overlap="delayed"))
    assert plan.state.trainable_params == exact.state.trainable_params + SHARD * 2
    assert pass_bytes(plan, delayed=True) == (SHARD * 30, SHARD * 24)
    assert est.pass_s == pytest.approx(SHARD * 24 / 1e8)            # the disk's 79 ms
    assert est.hidden_s == est.pass_s                             # < 3 x 33.8 ms: all of it
    assert est.line() == ("on a round machine: optimizer pass ~79 ms, forward ~34 ms: "
                          "overlap hides ~79 ms (delayed, behind forward and backward)")


def test_the_upload_of_the_mirrors_is_a_stage_on_a_gpu():
    gpu = Machine(name="a round GPU", flops=1e10, adam_bytes_per_s=1e9, disk_bytes_per_s=1e8,
                  upload_bytes_per_s=1e7)
    plan, est = estimate(zerocore.Offload(optimizer="cpu"), gpu)
    # The bf16 copies go back into their device mirrors: 2 bytes an element, at 10 MB/s.
    assert plan.state.mirrors == SHARD * 2
    assert est.pass_s == pytest.approx(SHARD * 2 / 1e7)


@pytest.mark.parametrize("why", ["off", "params on NVMe"])
def test_off_and_params_on_nvme_do_not_overlap(why, tmp_path):
    offload = (zerocore.Offload(optimizer="cpu", overlap="off") if why == "off" else
               zerocore.Offload(optimizer="nvme", params="nvme", path=str(tmp_path)))
    _, est = estimate(offload)
    assert not est.overlaps and est.hidden_s == 0 and est.pass_s > 0
    assert est.line().endswith(f"does not overlap ({why})")


def test_no_offloaded_optimizer_no_estimate():
    plan = planned(zerocore.Offload(params="cpu"))
    assert pass_overlap(plan, zerocore.Offload(params="cpu"), forward_flops=1.0,
                        machine=THIS_CPU) is None


@pytest.mark.e2e
@pytest.mark.parametrize("overlap, said", [("exact", "overlap hides ~"),
                                           ("off", "does not overlap (off)")])
def test_neox_plan_prints_the_estimate_on_both_machines(capsys, overlap, said):
    proc = call_main(plan_main, capsys, "--model", "tiny", "--device", "cpu", "--gpus", "1",
                     "--offload", "optimizer", "--offload-overlap", overlap)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "optimizer pass ~" in line]
    assert [line.split(":")[0].strip() for line in lines] == [
        "on this machine's CPU", "on an H100 (from the bandwidths)"], proc.stdout
    assert all(said in line for line in lines), lines
