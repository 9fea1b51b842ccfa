"""``neox.plan --host-memory``: the least offload that fits the GPUs and the host, tried from the
least traffic to the most (neox/commands/plan.py, ``CANDIDATES``), for the three runs of issue 31:
GPT-NeoX-20B LoRA on one 24 GB GPU, GPT-NeoX-20B fully fine-tuned on a node of eight 24 GB GPUs
with 128 GB of host memory (its optimizer state goes to NVMe), and pythia-1.4b fully fine-tuned
on a CPU machine of 24 GB (this one). Each plan is the engine's step on fake tensors of the full
model: about 10-20 s on two cores, so these are in the e2e tier."""

from __future__ import annotations

import pytest

from neox.commands.plan import build_parser, recommend, request_of
from neox.run.planning import GiB

pytestmark = pytest.mark.e2e


def recommended(*flags: str) -> tuple[tuple[str | None, str] | None, list[str]]:
    args = build_parser().parse_args([str(f) for f in flags])
    return recommend(request_of(args), ranks_per_node=args.gpus,
                     gpu_memory=int(args.gpu_memory * GiB),
                     host_memory=int(args.host_memory * GiB))


def test_gpt_neox_20b_lora_on_one_24gb_gpu_offloads_the_parameters():
    best, lines = recommended("--model", "gpt-neox-20b", "--finetune", "lora", "--gpus", 1,
                              "--gpu-memory", 24, "--host-memory", 128, "--seq-len", 2048,
                              "--batch-size", 1, "--activation-checkpointing")
    # The frozen bf16 weights (38 GiB) do not fit the GPU; the LoRA optimizer is small, so
    # moving it changes nothing; the parameter shards on the host leave the windows.
    assert best == ("params", "cpu"), lines
    assert [line.endswith("does not fit") for line in lines] == [True, True, False], lines


def test_gpt_neox_20b_full_on_eight_24gb_gpus_and_128gb_puts_the_optimizer_on_nvme():
    best, lines = recommended("--model", "gpt-neox-20b", "--finetune", "full", "--gpus", 8,
                              "--gpu-memory", 24, "--host-memory", 128, "--seq-len", 2048,
                              "--batch-size", 1, "--activation-checkpointing")
    # In host memory the masters and moments (16 bytes a parameter with the gradients: 300+
    # GiB a node) do not fit; on NVMe they leave the host the gradients and the 16-bit copies.
    assert best == ("optimizer", "nvme"), lines
    assert "GiB on NVMe: fits" in lines[-1] and len(lines) == 5, lines
    nvme = float(lines[-1].split(", ")[-1].split(" GiB")[0])
    assert 200 < nvme < 260, lines   # 12 bytes a parameter, 20.6e9 of them, in GiB


def test_pythia_1_4b_full_on_a_24gb_cpu_machine_puts_the_optimizer_on_nvme():
    best, lines = recommended("--model", "pythia-1.4b", "--finetune", "full", "--device", "cpu",
                              "--gpus", 1, "--host-memory", 23.4, "--seq-len", 128,
                              "--batch-size", 1)
    # In fp32 the model state alone is 16 bytes a parameter (21 GiB): more than 90% of the
    # machine; on a CPU, "the host" is where the layers compute, so only NVMe helps.
    assert best == ("optimizer", "nvme"), lines
    assert all(line.endswith("does not fit") for line in lines[:-1]), lines
