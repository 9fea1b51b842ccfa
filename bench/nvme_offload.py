"""NVMe offload (issue 31, item 2) on this machine's disk: a model whose model state exceeds a RAM
budget, trained with its optimizer state (and parameters) in a scratch file, against the same
run in memory and against the plan.

    python bench/nvme_offload.py --path /work/nvme-scratch [--model pythia-410m] [--budget-gib 4]
        [--seq-len 64] [--batch-size 1] [--steps 4] [--pool 256MiB]

The disk first: ``dd`` with ``oflag=direct`` and ``iflag=direct`` (2 GiB, 64 MiB blocks) in the
scratch directory gives its write and read bandwidth, each alone. Then, each in a fresh process
(one gloo rank), neox's preset full-fine-tuned in fp32 on the CPU with zerocore's AdamW,
``--steps`` steps of ``--batch-size`` x ``--seq-len`` tokens:
- ``memory``: no offload: 16 bytes a parameter in RAM;
- ``nvme``: ``Offload(optimizer="nvme", params="cpu")``: the fp32 masters and Adam moments (12
  bytes a parameter) on the disk, the model copy and the gradients (8) in RAM;
- ``nvme-all``: ``Offload(optimizer="nvme", params="nvme")``: the model copy on the disk too,
  each layer's read ahead of its gather; the gradients (4) in RAM.
Reported per run: the peak RSS of the steps after the first (VmHWM, reset after the first step)
and of the whole process (build included), the RSS the process had before the model was built
(Python and torch), the plan's peak (``zerocore.plan``: tensors, the pool included) and the
measured peak less that baseline over the plan (target <= 1.10); the median step time; for the
optimizer's pass (``NvmeStore.last_pass``): its time, the bytes it read and wrote, the bound
those bytes set at the disk's measured bandwidths, two ways (the transfers one after the other,
each direction at its rate alone: read / read bandwidth + written / write bandwidth; and both
directions at once, at the rates dd gets reading one file while writing another: the slower
direction's time), the bound over the pass's time (target >= 0.70), and the CPU Adam's share
of the pass and of the step. Every run's
final weights are checked equal to the memory run's (bitwise: NVMe offload changes where values
are, not the values).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

import harness
import zerocore
from neox.config import PRESETS
from neox.model import build_layers
from neox.run.step import micro_batch_loss
from neox.setting import byte_budget

GiB, MiB = 2**30, 2**20
TARGET_PLAN = 1.10     # measured peak (less the baseline) over the plan
TARGET_BOUND = 0.70    # the disk's bound over the optimizer pass's time


def _dd_rate(out: str) -> float:
    return 32 * 64 * MiB / float(re.search(r"copied, ([\d.]+) s", out).group(1))


def disk_bandwidth(path: Path) -> tuple[float, float, float, float]:
    """Bytes per second of ``dd`` with direct I/O in ``path``, 2 GiB in 64 MiB blocks: (write,
    read) each alone, then (write, read) at the same time (one file written while another is
    read: what the optimizer's pass does)."""
    probe, other = path / "dd-probe", path / "dd-probe-2"
    write = ["dd", "bs=64M", "count=32", "if=/dev/zero", "oflag=direct"]
    read = ["dd", "bs=64M", "iflag=direct", "of=/dev/null"]
    try:
        alone_w = _dd_rate(subprocess.run([*write, f"of={probe}"], capture_output=True,
                                          text=True, check=True).stderr)
        alone_r = _dd_rate(subprocess.run([*read, f"if={probe}"], capture_output=True,
                                          text=True, check=True).stderr)
        writer = subprocess.Popen([*write, f"of={other}"], stderr=subprocess.PIPE, text=True)
        reader = subprocess.Popen([*read, f"if={probe}"], stderr=subprocess.PIPE, text=True)
        both_w, both_r = _dd_rate(writer.communicate()[1]), _dd_rate(reader.communicate()[1])
    finally:
        probe.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
    return alone_w, alone_r, both_w, both_r


def offload_of(label: str, path: str, pool: int) -> zerocore.Offload:
    return {"memory": zerocore.Offload(),
            "nvme": zerocore.Offload(optimizer="nvme", params="cpu", path=path, pool_bytes=pool),
            "nvme-all": zerocore.Offload(optimizer="nvme", params="nvme", path=path,
                                         pool_bytes=pool)}[label]


def planned(args: argparse.Namespace, label: str) -> int:
    config = PRESETS[args.model]
    layers = build_layers(config, device="meta")
    ids = torch.empty(args.batch_size, args.seq_len, dtype=torch.long, device="meta")

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return micro_batch_loss(logits, torch.zeros(args.batch_size, args.seq_len,
                                                    dtype=torch.long))[0]
    plan = zerocore.plan.plan(layers, ids, world_size=1, loss=loss, device="cpu",
                              offload=offload_of(label, "(planned)", args.pool))
    return plan.device_peak


def rank_main(rank: int, world: int, args: argparse.Namespace, label: str) -> dict:
    baseline = harness.status_kib("VmRSS") * 1024
    config = PRESETS[args.model]
    began = time.perf_counter()
    layers = build_layers(config, generator=torch.Generator().manual_seed(0))
    model = zerocore.shard(layers, offload=offload_of(label, str(args.path), args.pool))
    del layers
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-5)
    built_s = time.perf_counter() - began
    # The full layers the build made are freed, but glibc keeps the pages of its heap: given
    # back, so that the steps' peak is the steps' (as tests/neox/test_neox_memory.py does).
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    g = torch.Generator().manual_seed(1)
    steps, passes, adam = [], [], []
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1),
                            generator=g)
        if step == 1:
            harness.reset_peak_rss()  # the steps after the first, as the plan
        t0 = time.perf_counter()
        loss, _ = micro_batch_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step > 0:
            steps.append(t2 - t0)
            store = model.ctx.store
            if store is not None:
                p = store.last_pass
                passes.append(dict(total_s=p.total_s, step_s=p.step_s,
                                   read_wait_s=p.read_wait_s, write_wait_s=p.write_wait_s,
                                   read=p.read_bytes, written=p.written_bytes,
                                   forward_backward_s=t1 - t0))
            else:
                adam.append(t2 - t1)
    peak_steps = harness.status_kib("VmHWM") * 1024
    final = {f"{i}.{n}": t for i, st in model.iter_full_states() for n, t in st.items()}
    digest = _digest(final)
    store = model.ctx.store
    return dict(label=label, baseline=baseline, peak_steps=peak_steps, built_s=built_s,
                direct=store.file.direct if store is not None else None,
                steps=steps, passes=passes, adam=adam, digest=digest,
                nvme_bytes=model.ctx.store.size if model.ctx.store is not None else 0)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", type=Path, required=True, help="the scratch directory (a disk)")
    p.add_argument("--model", choices=sorted(PRESETS), default="pythia-410m")
    p.add_argument("--budget-gib", type=float, default=4.0,
                   help="the RAM budget the model state exceeds (GiB; default 4)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="steps per run, the first untimed")
    p.add_argument("--pool", type=byte_budget, default=256 * MiB)
    p.add_argument("--runs", nargs="+", default=["memory", "nvme", "nvme-all"])
    args = p.parse_args()
    config = PRESETS[args.model]
    n = config.num_parameters()
    print(harness.header(f"{args.model} ({n / 1e6:,.0f}M parameters), full fine-tuning, fp32, "
                         f"one rank on the CPU, {args.batch_size} x {args.seq_len} tokens, "
                         f"{args.steps} steps (the first untimed); pool {args.pool // MiB} MiB; "
                         f"scratch in {args.path}", packages=("torch",)))
    state = 16 * n
    print(f"model state in memory: {state / GiB:.2f} GiB, over the budget of "
          f"{args.budget_gib:g} GiB" + ("" if state > args.budget_gib * GiB else " (NOT over)"))
    write_bw, read_bw, both_w, both_r = disk_bandwidth(args.path)
    print(f"disk (dd, direct I/O, 2 GiB in 64 MiB blocks): write {write_bw / 1e9:.2f} GB/s, "
          f"read {read_bw / 1e9:.2f} GB/s, each alone; at the same time, write "
          f"{both_w / 1e9:.2f} GB/s and read {both_r / 1e9:.2f} GB/s")
    rows, results = [], {}
    for label in args.runs:
        plan = planned(args, label)
        r = harness.run_ranks(rank_main, 1, args, label)[0]
        r["plan"] = plan
        results[label] = r
        step_s = statistics.median(r["steps"])
        grown = r["peak_steps"] - r["baseline"]
        row = [label, f"{r['peak_steps'] / GiB:.2f}", f"{r['baseline'] / GiB:.2f}",
               f"{plan / GiB:.2f}", f"{grown / plan:.3f}", f"{step_s:.1f}"]
        if r["passes"]:
            ps = r["passes"]
            total = statistics.median(x["total_s"] for x in ps)
            read, written = ps[0]["read"], ps[0]["written"]
            # The transfers one after the other at the rates each has alone; and both
            # directions at once at the rates they have together.
            bound = read / read_bw + written / write_bw
            together = max(read / both_r, written / both_w)
            adam = statistics.median(x["step_s"] for x in ps)
            row += [f"{total:.1f}", f"{read / GiB:.2f} / {written / GiB:.2f}",
                    f"{bound:.1f} / {together:.1f}",
                    f"{bound / total:.2f} / {together / total:.2f}",
                    f"{adam / total:.2f} / {adam / step_s:.2f}"]
        else:
            adam = statistics.median(r["adam"])
            row += [f"{adam:.1f}", "-", "-", "-", f"- / {adam / step_s:.2f}"]
        rows.append(row)
        io = {None: "", True: ", direct I/O", False: ", buffered I/O"}[r["direct"]]
        print(f"  {label}: done ({r['built_s']:.0f} s to build; scratch "
              f"{r['nvme_bytes'] / GiB:.2f} GiB{io})", flush=True)
    print(harness.table(("run", "peak RSS GiB (steps)", "RSS before the model GiB",
                         "plan GiB", "(peak - before) / plan", "step s (median)",
                         "optimizer step s", "read / written GiB",
                         "disk bound s (in turn / at once)", "bound / pass",
                         "CPU Adam: of the pass / of the step"),
                        rows, "lrrrrrrrrrr"))
    same = {label: r["digest"] == results[args.runs[0]]["digest"] for label, r in
            results.items()}
    print(f"final weights bitwise equal to {args.runs[0]}'s: {same}")


if __name__ == "__main__":
    main()
