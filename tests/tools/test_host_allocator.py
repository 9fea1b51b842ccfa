"""``zerocore.tools.keep_freed_memory``: a CPU rank's large tensors reuse freed memory instead of
fresh pages each time (zerocore/tools/host_allocator.py). Each case runs in a fresh interpreter:
the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.neox_testing import REPO

# Allocates and frees a 64 MiB tensor (the built-in run's logits) ten times, after two that may
# fault their pages in either way (the heap grows to hold the first; the second may not fit the
# first's hole exactly, as torch asks for aligned blocks); prints the minor page faults of the ten.
_PROGRAM = """
import json, resource, sys
import torch
from zerocore.tools import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step(i):
    x = torch.full((2048, 8192), float(i))
    return float(x[-1, -1])
step(0), step(0)
before = faults()
for i in range(10):
    total = step(i)
print(json.dumps({"kept": kept, "faults": faults() - before, "last": total}))
"""


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROGRAM, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_a_large_tensor_freed_is_reused_without_faulting_its_pages_in_again():
    pages = 2048 * 8192 * 4 // 4096   # one tensor's 4 KiB pages: 16,384
    plain, kept = _run("plain"), _run("kept")
    assert kept["kept"] is True
    assert plain["last"] == kept["last"] == 9.0
    # Without it, each of the ten faults its pages in afresh (glibc maps a block this large on
    # its own and unmaps it on free): at least 10 x 16,384. With it, the ten reuse the heap's
    # memory: 0 faults in most runs, and in about one run of eight the heap grows once more by
    # one tensor (16,384: an aligned block that did not fit the hole a freed one left), so the
    # bound is under two tensors' pages, five times below what ten fresh tensors fault.
    assert plain["faults"] >= 10 * pages * 0.9, plain
    assert kept["faults"] < 2 * pages, kept
