"""``zerocore.tools.job``, the job bench/gpu_check.sh runs with two ranks on one GPU and on the GPU
against the CPU, checked on the CPU stand-in, and the GPU check's dry run.

On a GPU the ranks take the transport's device branch (a reduce-scatter into a buffer of its own,
the backend's all-gather: zerocore/comm/transport.py), gloo ranks on the CPU the gloo branch.
Here the CPU stands in for the GPU: the job's ranks are given the device branch and must train
to the same bits as on the gloo branch, at 1, 2 and 3 ranks, in fp32 and bf16, on the model
whose flat groups end without padding. So on a GPU whatever differs comes from the device's
arithmetic (and, from three ranks, the order in which NCCL's reduce-scatter sums: gloo's ways
sum in rank order, which the stand-in keeps), not from the way the values travel.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zerocore.comm import collectives, transport
from zerocore.tools import job
from tests.support.stand_in_streams import RankOrderAsOwned

REPO = Path(__file__).resolve().parents[2]


def train_on_rank(rank: int, world_size: int, dtype: str, device_branch: bool) -> dict:
    spec = job.Job("cpu", world_size, dtype)
    model = job.build(spec, torch.device("cpu"))
    if device_branch:
        # The ways NCCL and gloo over CUDA take (Route.gloo False), on these gloo CPU ranks.
        for layer in model.layers:
            for g in layer.groups:
                route = dataclasses.replace(g.gather.route, gloo=False)
                # From three ranks the gloo branch sums in rank order, which gloo's
                # reduce-scatter does not: the stand-in sums as the gloo branch does and
                # delivers as the device branch does (into a buffer of its own).
                g.gather = transport.Gather(route)
                g.reduce = (RankOrderAsOwned(route) if world_size > 2
                            else transport.Reduce(route))
    out = job.train(model, spec, rank, world_size)
    return dict(out, calls=model.counter.reduce_scatter_calls)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda n: f"ws{n}")
def test_the_device_branch_on_the_cpu_trains_the_same_bits(worlds, world_size, dtype):
    world = worlds(world_size)
    plain = world.run(train_on_rank, dtype, False)
    stand_in = world.run(train_on_rank, dtype, True)
    for a, b in zip(plain, stand_in):
        assert a["padded"] == [] and b["padded"] == []  # every group ends with a real value
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for name, t in a["params"].items():
            assert torch.equal(t.view(torch.int32), b["params"][name].view(torch.int32)), name
        # One reduce-scatter per trainable group per step on more than one rank; none on one.
        want = 0 if world_size == 1 else 3 * job.STEPS
        assert a["calls"] == b["calls"] == want, (a["calls"], b["calls"])


def refused_on_rank(rank: int, world_size: int) -> tuple[str | None, str | None]:
    """What the job's probe says on these CPU ranks, and with a reduce-scatter that c10d refuses
    as gloo refuses a device it was built without (the CPU has no such device to try)."""
    group, cpu = dist.group.WORLD, torch.device("cpu")
    fine = job.refused_collective(group, cpu)
    assert job.refused_collective(group, cpu, quantized=True) is None  # qgZ's all-to-all too
    real = collectives.reduce_scatter_sum

    def refusing(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo::_reduce_scatter_base: unsupported device type")

    collectives.reduce_scatter_sum = refusing  # this rank process, for this call only
    try:
        return fine, job.refused_collective(group, cpu)
    finally:
        collectives.reduce_scatter_sum = real


def test_a_collective_c10d_refuses_is_named(worlds):
    for fine, why in worlds(2).run(refused_on_rank):
        assert fine is None
        assert why == ("reduce-scatter on cpu over gloo: ProcessGroupGloo::_reduce_scatter_base: "
                       "unsupported device type"), why


def test_the_loss_bound_is_three_roundings_twice():
    assert job.LOSS_BOUND["bf16"] == 2 * 3 * 2.0 ** -8
    assert job.LOSS_BOUND["fp32"] == 2 * 3 * 2.0 ** -24
    assert job.loss_difference([1.0, 2.0], [1.0, 2.02]) == pytest.approx(0.02 / 2.02)


def test_usage_errors():
    assert job.main(["run", "--nproc", "5"]) == 2  # 24 rows do not split in 5
    assert job.main(["run", "--dtype", "bf16", "--reference"]) == 2
    if not torch.cuda.is_available():
        assert job.main(["compare", "--devices", "cpu,cuda"]) == 2
    assert job.main(["compare", "--devices", "cpu"]) == 2


# -- the GPU check's dry run ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """bench/gpu_check.sh without a GPU (a dry run), run once for the tests below: the process
    and its summary (empty if it wrote none)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(out), "TMPDIR": str(out),
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, text=True,
                          capture_output=True, timeout=1500, env=env)
    summary = out / "gpu_check_summary.md"
    return proc, summary.read_text() if summary.exists() else ""


@pytest.mark.e2e
def test_the_mesh_job_runs_a_1x1_mesh_bitwise_and_qgz_within_its_bound(dry_run):
    """``job mesh`` on the CPU, as the GPU check's dry run runs it (its step's output, from the
    run the dry-run test checks too): a 1x1 mesh trains bit for bit as flat sharding, and qgZ
    over two replicas within its bound of the exact run (not equal to it: the quantization is
    there)."""
    proc, out = dry_run
    assert re.search(r"^\| mesh and qgZ \| ok \|", out, re.M), proc.stdout[-4000:] + out
    assert "1x1 mesh against flat, 1 rank on cpu, fp32: bit for bit PASS" in out, out
    diff = float(re.search(r"^qgZ int8 against exact, .*: losses differ by (\S+) relative", out,
                           re.M).group(1))
    assert 0 < diff <= job.QGZ_LOSS_RTOL, out


def _plan(text: str) -> dict[str, tuple[int, str]]:
    """{step: (budget s, estimate)} from the plan table the check prints."""
    rows = re.findall(r"^\| ([^|]+?) \| (\d+) s \| (estimate [^|]+?) \| [^|]* \|$", text, re.M)
    return {name: (int(budget), estimate) for name, budget, estimate in rows}


def test_gpu_check_lists_every_step_with_its_budget():
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--list"], cwd=REPO, text=True,
                         capture_output=True, timeout=60, check=True).stdout
    plan = _plan(out)
    assert list(plan) == ["environment", "build", "selftest", "two ranks, one GPU",
                          "bf16: GPU against gloo CPU", "mesh and qgZ", "CUDA tests",
                          "CUDA benchmarks", "low-bit kernels",
                          "Trainer example", "layer cost", "offload"], out
    total = sum(budget for budget, _ in plan.values())
    assert total <= 480, total  # the whole check within 8 minutes of device time
    assert f"total {total} s" in out
    assert all("estimate" in estimate for _, estimate in plan.values()), plan


@pytest.mark.e2e
def test_gpu_check_dry_run_passes_and_lists_every_step(dry_run):
    """Without a GPU the check is a dry run: every step in its CPU form (the two-rank job on the
    CPU against the unsharded model, the bf16 comparison between two CPU runs, bit for bit),
    passing, and the summary lists every step with its budget."""
    proc, summary = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "DRY RUN" in summary and "All steps passed." in summary
    assert set(_plan(summary)) == set(_plan(subprocess.run(
        ["bash", "bench/gpu_check.sh", "--list"], cwd=REPO, text=True, capture_output=True,
        check=True).stdout))
    assert "losses differ by 0 relative at most (bound 0: bit for bit" in summary
    assert "within the selftest's tolerances; every group ends with a real value" in summary
    assert "1x1 mesh against flat, 1 rank on cpu, fp32: bit for bit PASS" in summary
