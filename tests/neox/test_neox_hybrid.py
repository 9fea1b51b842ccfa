"""neox.finetune across nodes: ``--hybrid hsdp`` (sharded within each node, replicated across
nodes) and ``--quantize-gradients int8`` (qgZ).

- Bad combinations: one line and exit 2 from the command itself, before any process starts or
  anything is allocated; under torchrun every rank runs the same checks on the same flags (the
  ranks agreed them: test_neox_same_recipe.py) and environment, so each rank finds the same line.
- ``neox.plan`` on several nodes: the layouts compared (memory per GPU, bytes within and
  across the nodes per step), against the plans they must agree with.
- End to end (marked e2e): the run under two torchrun agents on this machine (``--nnodes 2
  --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), as two nodes; its losses against a flat
  run of the same job; its checkpoint resumed flat, and that one resumed as HSDP again
  (``--nodes 2`` on neox's own launcher), each step's loss against the flat run's.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import zerocore
from neox.commands.finetune import build_parser, run_request
from neox.commands.flags import explicit_flags
from neox.finetune import main as finetune_main
from neox.plan import main as plan_main
from neox.run.planning import plan_run
from neox.setting import UsageError
from tests.support.neox_testing import EXCERPT, call_main, run_module
from tests.support.two_nodes import LAUNCHER_VARIABLES, run_two_nodes


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in LAUNCHER_VARIABLES:
        monkeypatch.delenv(var, raising=False)


def refused(capsys, tmp_path, *flags) -> subprocess.CompletedProcess:
    return call_main(finetune_main, capsys, "--cpu", "--data", EXCERPT, "--output-dir",
                     tmp_path / "out", "--cache-dir", tmp_path / "cache", *flags)


REFUSALS = {
    "qgZ flat": (("--quantize-gradients", "int8"),
                 "error: --quantize-gradients int8 quantizes the gradients' all-reduce across "
                 "nodes, which only --hybrid has: add --hybrid hsdp or hpz, or leave it out"),
    "one machine": (("--hybrid", "hsdp"),
                    "error: --hybrid hsdp shards within each node and replicates across nodes, "
                    "and this machine is one node: run under torchrun --nnodes N (N >= 2), or "
                    "simulate N nodes here with --nodes N, or give --hybrid none"),
    "nodes flat": (("--nodes", "2"),
                   "error: --nodes applies to --hybrid (the nodes hybrid sharding replicates "
                   "across); without it the layout is flat: give --hybrid hsdp, or leave --nodes "
                   "out"),
    "nodes do not divide": (("--hybrid", "hsdp", "--nodes", "3", "--nproc", "4",
                             "--oversubscribe"),
                            "error: --nodes 3 does not divide the 4 ranks: every node runs as "
                            "many ranks; give --nproc a multiple of --nodes"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_layout_the_machine_cannot_run_is_refused_in_one_line(no_torchrun, capsys, tmp_path,
                                                                 name):
    flags, line = REFUSALS[name]
    proc = refused(capsys, tmp_path, *flags)
    assert proc.returncode == 2
    assert proc.stderr == line + "\n", proc.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


TORCHRUN_REFUSALS = {
    # torchrun --nnodes 1 --nproc-per-node 2
    "one node": (dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0"), ("--hybrid", "hsdp"),
                 "error: --hybrid hsdp shards within each node and replicates across nodes, and "
                 "torchrun started one node: run under torchrun --nnodes N (N >= 2), or give "
                 "--hybrid none"),
    "qgZ flat": (dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1"),
                 ("--quantize-gradients", "int8"), REFUSALS["qgZ flat"][1]),
    "nodes": (dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="0"),
              ("--hybrid", "hsdp", "--nodes", "2"),
              "error: --nodes: under torchrun the nodes are torchrun's (--nnodes); leave --nodes "
              "out"),
    # An agent that does not say the nodes (a launcher setting RANK and WORLD_SIZE alone).
    "no nodes": (dict(WORLD_SIZE="4"), ("--hybrid", "hsdp"),
                 "error: --hybrid hsdp shards within each node and replicates across nodes, and "
                 "torchrun's environment does not say the nodes (LOCAL_WORLD_SIZE, GROUP_RANK): "
                 "run under torchrun --nnodes N (N >= 2), or give --hybrid none"),
}


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("name", sorted(TORCHRUN_REFUSALS))
def test_under_torchrun_each_rank_refuses_alike(no_torchrun, monkeypatch, tmp_path, name, rank):
    # Under torchrun the ranks run these checks once the group exists and they agree the flags
    # (run_agreed: the lowest rank says the line); the checks themselves, each rank's, here.
    environ, flags, line = TORCHRUN_REFUSALS[name]
    for var, value in dict(environ, RANK=rank).items():
        monkeypatch.setenv(var, value)
    argv = ["--cpu", "--data", str(EXCERPT), "--output-dir", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), *flags]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit = explicit_flags(parser, argv)
    with pytest.raises(UsageError) as refusal:
        run_request(args, False, print, torchrun=True, nodes=zerocore.nodes_of(os.environ))
    assert f"error: {refusal.value}" == line
    assert not (tmp_path / "out").exists()


# -- neox.plan: the layouts compared --------------------------------------------------------------

def planned(capsys, *flags, plan=None) -> subprocess.CompletedProcess:
    # The tiny preset, LoRA, bf16 on GPUs: each plan runs the engine's step on fake tensors
    # (``plan``: a cache of plan_run the commands share, each request planned once).
    return call_main(functools.partial(plan_main, plan=plan), capsys, "--model", "tiny",
                     "--finetune", "lora", "--grad-accum", 2, *flags)


def test_plan_compares_the_layouts_on_several_nodes(capsys):
    plan = functools.lru_cache(maxsize=None)(plan_run)
    proc = planned(capsys, "--nodes", 2, "--gpus", 4, "--hybrid", "hsdp", "--json", plan=plan)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = out["layouts"]
    assert list(rows) == ["flat", "HSDP", "HSDP + qgZ int8", "hpZ", "hpZ + qgZ int8"]
    flat, hsdp, qgz = rows["flat"], rows["HSDP"], rows["HSDP + qgZ int8"]
    hpz, hpz_qgz = rows["hpZ"], rows["hpZ + qgZ int8"]
    # The layout asked for is the plan printed above the table, not planned twice apart.
    chosen = out["plan"]
    assert hsdp["within_nodes"] == chosen["all_gather_bytes"] + chosen["reduce_scatter_bytes"]
    # HSDP holds the model state of one node's 4 ranks: a flat plan over 4 GPUs' (one node).
    one_node = planned(capsys, "--nodes", 1, "--gpus", 4, "--json", plan=plan)
    assert sum(json.loads(one_node.stdout)["plan"]["state"].values()) == hsdp["model_state"]
    assert flat["model_state"] < hsdp["model_state"] == qgz["model_state"]
    # Flat over 8 ranks on 2 nodes sends everything across them; HSDP only the gradient
    # shards' all-reduce, and qgZ that in int8 (a byte and a 128th of a scale per element,
    # against the fp32 reduction's 4).
    assert flat["within_nodes"] == 0 < flat["across_nodes"]
    assert 0 < hsdp["across_nodes"] < 0.01 * flat["across_nodes"]
    assert 0.25 * hsdp["across_nodes"] < qgz["across_nodes"] < 0.27 * hsdp["across_nodes"]
    assert hsdp["within_nodes"] == qgz["within_nodes"]
    # hpZ: flat's model state (over all 8 ranks) plus the secondary shards it holds; its
    # forward gathers and gradient reduce-scatters cross the nodes, backward's gathers do
    # not; qgZ shrinks the reduce-scatters.
    assert hpz["model_state"] == hpz_qgz["model_state"] == flat["model_state"]
    assert hpz["secondary"] > 0 == flat["secondary"] == hsdp["secondary"]
    assert hsdp["across_nodes"] < hpz_qgz["across_nodes"] < hpz["across_nodes"] \
        < flat["across_nodes"]
    text = planned(capsys, "--nodes", 2, "--gpus", 4, plan=plan).stdout
    table = text[text.index("layouts on 2 nodes x 4 GPUs"):].splitlines()
    assert [line.split()[0] for line in table[2:]] == ["flat", "HSDP", "HSDP", "hpZ", "hpZ"], \
        table


@pytest.mark.parametrize("flags, line", [
    (("--quantize-gradients", "int8", "--nodes", 2), REFUSALS["qgZ flat"][1]),
    (("--hybrid", "hsdp"), "error: --hybrid hsdp replicates across nodes: plan it with --nodes 2 "
                           "or more"),
])
def test_plan_refuses_a_layout_without_nodes_in_one_line(capsys, flags, line):
    proc = planned(capsys, *flags)
    assert proc.returncode == 2 and proc.stderr == line + "\n", proc.stderr


# -- end to end -----------------------------------------------------------------------------------

# The tiny preset from scratch (full training), on 32 sequences of 32 tokens a micro-batch over
# all ranks, 2 micro-batches a step: every run below trains on the same global batches, whatever
# its ranks (the sampler hands each step's next 32 windows to the ranks), so each step's loss is
# comparable. No sample at the end (it costs a forward per token).
GLOBAL_BATCH, STEPS = 32, 4
JOB = ("--cpu", "--data", EXCERPT, "--seq-len", 32, "--seed", 5, "--grad-accum", 2,
       "--sample-tokens", 0)
# fp32, as the HSDP tests' (tests/engine/test_hsdp.py): the gradient is summed in another order
# (within each node, then across the replicas; or over the ranks of another flat world), and
# zerocore's fused AdamW matches torch's to a few ulps a step; the loss of a step, a mean over
# 2048 tokens, then differs by a few ulps relative. 1e-5 is far above that, while a micro-batch
# missed by the replicas' all-reduce (half the gradient), a gradient divided by the shards alone
# (twice it) or a replica that skipped its update changes the next step's loss by ~1e-3.
LOSS_RTOL = 1e-5
# Two agents each start two ranks that import torch and neox: on 2 loaded cores, minutes.
TIMEOUT_S = 600


def job(out: Path, ranks: int, *flags) -> list:
    return [*JOB, "--output-dir", out, "--batch-size", GLOBAL_BATCH // ranks, *flags]


def losses(out: Path) -> dict[int, float]:
    """Step -> loss, from the run's metrics (a resumed run appends its steps)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def flat(tmp_path_factory) -> dict[int, float]:
    """The job flat on one rank: the losses every layout's run is held to."""
    out = tmp_path_factory.mktemp("flat")
    proc = run_module("neox.finetune", "--nproc", 1, "--max-steps", STEPS, *job(out, 1),
                      "--cache-dir", out.parent / "cache")
    check_ok(proc)
    return losses(out)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory, flat) -> tuple[Path, str]:
    """The job's first 2 steps with --hybrid hsdp under two torchrun agents of 2 ranks (HSDP
    2x2); its output directory and what the agents printed."""
    out = tmp_path_factory.mktemp("hsdp")
    agents = run_two_nodes(["-m", "neox.finetune", "--hybrid", "hsdp", "--max-steps", 2,
                            *job(out, 4), "--cache-dir", out.parent / "cache"],
                           timeout=TIMEOUT_S)
    assert agents.codes == [0, 0], agents.output[-8000:]
    assert "Traceback" not in agents.output, agents.output[-8000:]
    return out, agents.output


def assert_losses_match(got: dict[int, float], flat: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - flat[step]) <= LOSS_RTOL * flat[step], (step, got, flat)


@pytest.mark.e2e
def test_hsdp_under_two_torchrun_agents_trains_as_the_flat_job(hsdp, flat):
    out, printed = hsdp
    # The start-up line names the layout, said once (by global rank 0).
    said = [line for line in printed.splitlines() if line.startswith("layout:")]
    assert len(said) == 1 and said[0].startswith(
        "layout: HSDP 2x2: sharded within each group of 2 (a node), gathered there; gradient "
        "shards all-reduced across the 2 replicas; gather: "), said
    assert "replicas: the 2 replicas' trainable shards are bitwise equal" in printed
    assert_losses_match(losses(out), flat, (1, 2))
    # Across the nodes: each rank's gradient shard once per step, as expected to the byte.
    table = printed[printed.index("communication this run:"):].splitlines()
    across = next(line.split() for line in table if line.strip().startswith("across replicas"))
    assert across[2] == across[3] and float(across[2]) > 0, table
    assert (out / "checkpoints" / "step-00000002" / "COMMIT").is_file()


@pytest.mark.e2e
def test_an_hsdp_run_resumes_flat_and_back(hsdp, flat, tmp_path):
    """The HSDP run's checkpoint (written by replica 0: a flat checkpoint of 2 ranks) resumed
    flat on one rank (--hybrid none) for step 3, and that one's as HSDP again on this machine
    (--nodes 2, a 2x1 mesh) for step 4: every step's loss as the uninterrupted flat job's."""
    out = tmp_path / "run"
    shutil.copytree(hsdp[0], out)
    cache = hsdp[0].parent / "cache"
    proc = run_module("neox.finetune", "--resume", out / "checkpoints", "--output-dir", out,
                      "--hybrid", "none", "--nproc", 1, "--batch-size", GLOBAL_BATCH,
                      "--max-steps", 3, "--cache-dir", cache)
    check_ok(proc)
    assert "resumed from " + str(out / "checkpoints" / "step-00000002") in proc.stdout
    assert "layout:" not in proc.stdout  # flat on one node: nothing to say
    proc = run_module("neox.finetune", "--resume", out / "checkpoints", "--output-dir", out,
                      "--hybrid", "hsdp", "--nodes", 2, "--nproc", 2, "--batch-size",
                      GLOBAL_BATCH // 2, "--max-steps", STEPS, "--cache-dir", cache)
    check_ok(proc)
    assert "resumed from " + str(out / "checkpoints" / "step-00000003") in proc.stdout
    assert "layout: HSDP 2x1" in proc.stdout
    assert "replicas: the 2 replicas' trainable shards are bitwise equal" in proc.stdout
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_losses_match(got, flat, range(1, STEPS + 1))


@pytest.mark.e2e
def test_an_hsdp_run_resumes_as_hpz(hsdp, flat, tmp_path):
    """The HSDP run's checkpoint resumed with --hybrid hpz on this machine (--nodes 2: hpZ
    2x1, the state over both ranks, each forward gathering across the "nodes"): steps 3-4's
    losses as the flat job's, the layout said, and no replicas to compare (hpZ has none)."""
    out = tmp_path / "run"
    shutil.copytree(hsdp[0], out)
    proc = run_module("neox.finetune", "--resume", out / "checkpoints", "--output-dir", out,
                      "--hybrid", "hpz", "--nodes", 2, "--nproc", 2, "--batch-size",
                      GLOBAL_BATCH // 2, "--max-steps", STEPS,
                      "--cache-dir", hsdp[0].parent / "cache")
    check_ok(proc)
    assert "layout: hpZ 2x1" in proc.stdout, proc.stdout
    assert "replicas:" not in proc.stdout
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_losses_match(got, flat, range(1, STEPS + 1))
