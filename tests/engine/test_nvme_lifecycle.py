"""NVMe offload's scratch with real rank processes (``zerocore.tools.rank_processes``, the
launcher neox's ranks run under): while a rank runs, its scratch is an open file with no name
in the directory given (nothing to see there); once the rank has ended, its space is given back,
whether it exited cleanly, was stopped by SIGTERM to the launcher, failed with an exception, or
was killed by SIGKILL (no handler runs then: nothing needs one).

Where the test may mount a tmpfs of its own (root), its used space says exactly whether the
blocks came back; elsewhere, that no process holds the file any more is what the kernel frees
an unnamed file on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import RUN_MARK, left_after
from tests.support.scratch_disk import private_disk, scratch_fds

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = """\
import json, sys
from zerocore.tools import hold_rendezvous, run_ranks
task = json.loads(sys.argv[1])
store = hold_rendezvous()  # (held by the launcher while its ranks live)
task["port"] = store.port
sys.exit(run_ranks("tests.support.nvme_rank:rank_main", task["world_size"], task,
                   marker="zerocore-nvme-test-rank"))
"""

# Each way of ending: the ranks (two where one raises, the launcher stopping the other), and the
# launcher's exit code.
ENDS = {"exit": (1, 0), "wait": (1, 128 + signal.SIGTERM), "raise": (2, 1),
        "kill": (1, 128 + signal.SIGKILL)}


@pytest.mark.distributed
@pytest.mark.parametrize("end", list(ENDS))
def test_the_scratch_is_gone_when_the_ranks_end(tmp_path, end):
    with private_disk(tmp_path / "disk", size="64m") as disk:
        ready = tmp_path / "ready"
        ready.mkdir()
        before = disk.used()
        world_size, code = ENDS[end]
        task = dict(path=str(disk.path), ready=str(ready), go=str(tmp_path / "go"), end=end,
                    world_size=world_size)
        mark = f"nvme-{end}-{os.getpid()}"
        env = dict(os.environ, PYTHONPATH=str(REPO), **{RUN_MARK: mark})
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(task)],
                                    env=env, cwd=REPO,
                                    stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 240
            while len(os.listdir(ready)) < world_size:
                assert launcher.poll() is None, launcher.communicate()[1]
                assert time.monotonic() < deadline, "the ranks did not get ready"
                time.sleep(0.1)
            pids = [int((ready / f"rank{r}").read_text()) for r in range(world_size)]
            # Each rank holds one unnamed file there, and the directory shows nothing.
            for pid in pids:
                held = scratch_fds(pid, disk.path)
                assert len(held) == 1 and held[0].endswith("(deleted)"), held
            assert os.listdir(disk.path) == []
            if disk.exact:
                assert disk.used() > before
            (tmp_path / "go").write_text("")
            if end == "wait":
                launcher.send_signal(signal.SIGTERM)
            _, err = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        assert launcher.returncode == code, err
        assert left_after(mark, 5.0) == []
        assert os.listdir(disk.path) == []
        if disk.exact:
            assert disk.used() == before
