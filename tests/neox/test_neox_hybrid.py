"""neox.finetune across nodes: ``--hybrid hsdp`` (sharded within each node, replicated across
nodes) and ``--quantize-gradients int8`` (qgZ).

- Bad combinations: one line and exit 2 from the command itself, before any process starts or
  anything is allocated; under torchrun every rank runs the same checks on the same flags and
  environment, so each rank says the same line.
- End to end (marked e2e): the run under two torchrun agents on this machine (``--nnodes 2
  --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), as two nodes; its losses against a flat
  run of the same job; its checkpoint resumed flat, and that one resumed as HSDP again
  (``--nodes 2`` on neox's own launcher), each step's loss against the flat run's.
"""

from __future__ import annotations

import subprocess

import pytest

from neox.finetune import main as finetune_main
from tests.support.neox_testing import EXCERPT, call_main

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for var in TORCHRUN:
        monkeypatch.delenv(var, raising=False)


def refused(capsys, tmp_path, *flags) -> subprocess.CompletedProcess:
    return call_main(finetune_main, capsys, "--cpu", "--data", EXCERPT, "--output-dir",
                     tmp_path / "out", "--cache-dir", tmp_path / "cache", *flags)


REFUSALS = {
    "qgZ flat": (("--quantize-gradients", "int8"),
                 "error: --quantize-gradients int8 quantizes the gradients' all-reduce across "
                 "nodes, which only --hybrid has: add --hybrid hsdp, or leave it out"),
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
def test_under_torchrun_each_rank_refuses_alike(no_torchrun, monkeypatch, capsys, tmp_path,
                                                name, rank):
    environ, flags, line = TORCHRUN_REFUSALS[name]
    for var, value in dict(environ, RANK=rank).items():
        monkeypatch.setenv(var, value)
    proc = refused(capsys, tmp_path, *flags)
    assert proc.returncode == 2
    assert proc.stderr == line + "\n", proc.stderr
    assert not (tmp_path / "out").exists()
