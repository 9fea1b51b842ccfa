"""``neox.plan`` of NVMe offload says whether its pool was chosen from the host's memory
(``--offload-pool auto``, the default) or given, in its table's "NVMe pool" row (as a run's
``memory_report`` does) and in its JSON (``nvme_pool_chosen``)."""

from __future__ import annotations

import json

from neox.plan import main as plan_main
from tests.support.neox_testing import call_main

# The tiny preset, LoRA, bf16 on GPUs, its optimizer on NVMe: each plan runs the engine's step
# on fake tensors (a few seconds).
NVME = ("--model", "tiny", "--finetune", "lora", "--offload", "optimizer", "--offload-device",
        "nvme")


def pool_row(capsys, *flags: str) -> str:
    proc = call_main(plan_main, capsys, *NVME, *flags)
    assert proc.returncode == 0, proc.stderr
    row, = [line for line in proc.stdout.splitlines() if "NVMe pool" in line]
    return row


def test_the_plan_says_when_the_pool_was_chosen(capsys):
    assert pool_row(capsys).split()[:4] == ["NVMe", "pool,", "auto", "(host)"]
    assert pool_row(capsys, "--offload-pool", "64MiB").split() == [
        "NVMe", "pool", "(host)", "0.06", "GiB"]
    for flags, chosen in [((), True), (("--offload-pool", "64MiB"), False)]:
        proc = call_main(plan_main, capsys, *NVME, *flags, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["plan"]["nvme_pool_chosen"] is chosen
