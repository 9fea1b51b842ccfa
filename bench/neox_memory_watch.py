"""A neox.finetune run watched from outside: every 0.2 s, the memory of each of its processes
(the launcher and its ranks), summed. Issue 31 asks whether pythia-1.4b's full fine-tune runs
within this 24 GB machine's memory with its optimizer state on NVMe:

    python bench/neox_memory_watch.py -- --cpu --nproc 1 --model pythia-1.4b --finetune full \\
        --offload optimizer --offload-device nvme --offload-path /work/nvme-scratch \\
        --seq-len 64 --batch-size 1 --max-steps 3 --sample-tokens 0 --measure-memory ...

Reported: the peak over the run of the processes' anonymous memory (``RssAnon``: what they hold
of their own: tensors, the host arena, Python) and of their resident file pages (``RssFile``:
mapped files; a checkpoint's save maps the NVMe scratch and reads it through the page cache,
pages the kernel may take back at any time), each summed over the processes at one moment, and
of their sum; then the run's own lines (the engine's memory report, --measure-memory's peak of
the steps, the steps' times). The processes are found by an environment variable every one of
them inherits (``RUN_MARK``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import harness

RUN_MARK = "NEOX_MEMORY_WATCH"
GiB = 2**30


def _marked(mark: str) -> list[int]:
    found, needle = [], f"{RUN_MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _memory(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) of ``pid`` in bytes; zeros once it is gone."""
    anon = file = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("finetune", nargs=argparse.REMAINDER,
                   help="neox.finetune's arguments, after --")
    args = p.parse_args()
    flags = [a for a in args.finetune if a != "--"]
    mark = uuid.uuid4().hex
    print(harness.header("neox.finetune " + " ".join(flags), packages=("torch",)), flush=True)
    peak = {"anon": 0, "file": 0, "sum": 0, "at": 0.0}
    done = threading.Event()
    began = time.monotonic()

    def watch() -> None:
        while not done.is_set():
            pids = _marked(mark)
            sizes = [_memory(pid) for pid in pids]
            anon, file = sum(a for a, _ in sizes), sum(f for _, f in sizes)
            if anon > peak["anon"]:
                peak["anon"], peak["at"] = anon, time.monotonic() - began
            peak["file"] = max(peak["file"], file)
            peak["sum"] = max(peak["sum"], anon + file)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proc = subprocess.run([sys.executable, "-m", "neox.finetune", *flags], text=True,
                          capture_output=True, env=harness.child_env(**{RUN_MARK: mark}))
    done.set()
    watcher.join()
    wall = time.monotonic() - began
    keep = ("model:", "built in", "training", "[", "validation", "rank 0", "measured",
            "planned", "peak", "saved", "NVMe", "error")
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        if line.strip().startswith(keep) or "GiB" in line or "MiB" in line:
            print("  | " + line)
    print(f"exit {proc.returncode} after {wall:.0f} s")
    print(f"peak over the run, summed over its processes: anonymous memory (RssAnon) "
          f"{peak['anon'] / GiB:.2f} GiB (at {peak['at']:.0f} s), resident file pages "
          f"(RssFile) {peak['file'] / GiB:.2f} GiB, both at once {peak['sum'] / GiB:.2f} GiB")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
