"""``--frozen-weights nf4|fp8`` and ``--frozen-placement`` in neox.finetune and neox.plan
(issue 41, item 5): a run with a replicated NF4 base trains, and resumes in the other placement
exactly (checkpoints hold the unquantized base, and both placements dequantize the same bits),
while a resume that changes the format is refused in one line; the plan shows the placement."""

from __future__ import annotations

import pytest

from neox.finetune import main as finetune_main
from neox.plan import main as plan_main
from neox.run.run_dir import CHECKPOINTS
from tests.support.neox_testing import (BPE512, EXCERPT, call_main, gathered_mib, run_losses,
                                        run_module)

LORA = ("--cpu", "--data", EXCERPT, "--tokenizer", BPE512, "--seq-len", 32, "--batch-size", 4,
        "--sample-tokens", 0, "--nproc", 2, "--finetune", "lora")
RUN = LORA + ("--max-steps", 4, "--save-every", 2)


@pytest.mark.e2e
def test_a_replicated_nf4_run_resumes_in_the_other_placement_not_another_format(tmp_path,
                                                                                 capsys):
    out = tmp_path / "run"
    proc = run_module("neox.finetune", *RUN, "--cache-dir", tmp_path / "cache", "--output-dir",
                      out, "--frozen-weights", "nf4", "--frozen-placement", "replicated")
    assert proc.returncode == 0, proc.stderr
    assert "frozen weights held in nf4, replicated on every rank" in proc.stdout, proc.stdout
    straight = run_losses(out)
    assert len(straight) == 4
    replicated = gathered_mib(proc.stdout) / 4  # per step
    # Steps 3 and 4 again, from step 2's checkpoint, sharded: the same losses, bitwise (the
    # checkpoint's unquantized base is quantized again at the load, by the same blocks).
    proc = run_module("neox.finetune", "--resume", out / CHECKPOINTS / "step-00000002",
                      "--output-dir", out, "--frozen-placement", "sharded")
    assert proc.returncode == 0, proc.stderr
    assert "resume: --frozen-placement sharded overrides the checkpoint's replicated" in \
        proc.stdout, proc.stdout
    assert "frozen weights held and gathered in nf4" in proc.stdout
    assert run_losses(out) == straight
    # Replicated, only the LoRA adapters (fp32) are gathered; sharded, the NF4 base as well:
    # here about 0.09 against 0.42 MiB a step (the steps' measured collectives). Half is far
    # from both: a run that gathered its frozen base would measure the same as sharded.
    sharded = gathered_mib(proc.stdout) / 2
    assert replicated < 0.5 * sharded, (replicated, sharded)
    # Another format changes the numbers: refused in one line, before anything starts.
    refused = call_main(finetune_main, capsys, "--resume", out / CHECKPOINTS, "--output-dir",
                        out, "--frozen-weights", "fp8")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: --frozen-weights fp8 differs from the checkpoint's nf4; a resumed run continues "
        "the same model and data: drop the flag, or start a new run (without --resume)"], \
        refused.stderr


@pytest.mark.e2e
def test_a_replicated_base_with_the_parameters_offloaded_trains_the_same(tmp_path):
    # --offload params: the replicated NF4 base in host memory, each layer's bytes uploaded for
    # each use: the same bytes dequantized by the same kernel as on the device, so the same
    # losses bitwise, and nothing frozen gathered either way (the same bytes all-gathered).
    runs = {}
    for name, flags in (("device", ()), ("host", ("--offload", "params"))):
        out = tmp_path / name
        proc = run_module("neox.finetune", *LORA, "--max-steps", 2, "--cache-dir",
                          tmp_path / "cache", "--output-dir", out, "--frozen-weights", "nf4",
                          "--frozen-placement", "replicated", *flags)
        assert proc.returncode == 0, proc.stderr
        runs[name] = (run_losses(out), gathered_mib(proc.stdout))
    assert len(runs["host"][0]) == 2
    assert runs["host"] == runs["device"], runs


NVME = ("--frozen-weights", "nf4", "--offload", "all", "--offload-device", "nvme")


@pytest.mark.parametrize("commands, flags, line", [
    ("finetune plan", (),
     "--frozen-placement replicated holds the whole quantized frozen base on every rank: "
     "add --frozen-weights nf4, fp8 or int8, or leave it sharded"),
    # (--offload-device cpu is a home of its own, tests/engine/test_frozen_quantized.py, and
    # the plan plans it: test_plan_shows_the_placement)
    ("finetune plan", NVME,
     "--frozen-placement replicated keeps the whole quantized frozen base in each rank's "
     "memory (with --offload all, the host's), and --offload-device nvme puts the parameter "
     "shards on NVMe: give --offload-device cpu, or leave the base sharded"),
], ids=["no format", "params on nvme"])
def test_replicated_where_it_cannot_be_is_refused_in_one_line(capsys, tmp_path, commands,
                                                               flags, line):
    mains = {"finetune": (finetune_main, ("--cpu", "--output-dir", tmp_path / "out",
                                          "--offload-path", tmp_path)),
             "plan": (plan_main, ("--model", "pythia-70m"))}
    for name in commands.split():
        main, where = mains[name]
        proc = call_main(main, capsys, *where, "--frozen-placement", "replicated", *flags)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [f"error: {line}"], proc.stderr
    assert not (tmp_path / "out").exists()


def test_plan_shows_the_placement(capsys):
    def planned(placement, *flags):
        proc = call_main(plan_main, capsys, "--model", "pythia-70m", "--finetune", "lora",
                         "--gpus", "8", "--frozen-weights", "fp8", "--frozen-placement",
                         placement, *flags)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    sharded, replicated = planned("sharded"), planned("replicated")
    on_host = planned("replicated", "--offload", "params")
    assert "frozen weights in fp8, sharded" in sharded
    assert "parameter shards, frozen (fp8, sharded)" in sharded
    assert "frozen weights in fp8, replicated" in replicated
    assert "frozen base fp8, replicated" in replicated and "none of it all-gathered" in replicated
    # With the parameters offloaded, the replicated base is planned in host memory.
    assert "frozen base, whole (fp8, replicated) (host)" in on_host
    assert "none of it all-gathered" in on_host
