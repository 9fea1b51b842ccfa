"""The CPU fused Adam against the memory system's limit and against DeepSpeedCPUAdam.

    python bench/bench_cpu_adam.py [--threads 1 2] [--rounds 15] [--log2n 24] [--out FILE]

One AdamW step on a 2^24-element fp32 shard (master, exp_avg, exp_avg_sq) for every gradient
dtype (fp32, bf16, fp16) with and without a 16-bit model copy written in the same pass: what
``Offload(optimizer=True)`` steps on the host. Every variant is timed in the same process,
interleaved (each round calls every variant once, in a shuffled order), beside:

- **RMW**: ``b.add_(a)`` on 2^24 fp32 elements (read 8 bytes, write 4 per element), the
  read-modify-write bandwidth of the same threads. A variant's roofline is the bytes it must move
  (read param, exp_avg, exp_avg_sq and grad, write the first three and the copy) at that
  bandwidth; "% RMW" is its achieved GB/s over the RMW GB/s.
- **DeepSpeedCPUAdam** (fp32 gradient, no copy), and for every variant with a 16-bit gradient or
  copy, "DeepSpeed's step + casts": the gradient widened into DeepSpeed's fp32 gradient
  (``copy_``), the step, then the new parameters cast to the 16-bit copy (``copy_``), as ZeRO-
  Offload does around that optimizer. DeepSpeed is optional: without it these rows are skipped
  with the line that installs it (DeepSpeed is never a zerocore dependency).

Each thread count runs in its own subprocess with OMP_NUM_THREADS set before torch starts (so
DeepSpeed's OpenMP loop and torch's intra-op pool both use it) and pinned to that many cores
(the last ones). Figures are medians over rounds; ratios are the medians of per-round ratios,
with their min-max. The load average is printed with every table: on a shared machine read the
ratios, which are taken within one round, before the absolute times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

DS_INSTALL = "pip install deepspeed==0.19.8  (then DS_ACCELERATOR=cpu may be needed)"
GRADS = ["fp32", "bf16", "fp16"]
COPIES = ["none", "bf16", "fp16"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    return "%.2f %.2f %.2f" % os.getloadavg()


def _bytes_per_element(grad: str, copy: str) -> int:
    size = {"fp32": 4, "bf16": 2, "fp16": 2, "none": 0}
    return 3 * 4 * 2 + size[grad] + size[copy]


def child(args) -> dict:
    if args.cores:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    import torch

    torch.set_num_threads(args.threads)
    import zerocore  # noqa: F401
    from zerocore import ops

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    n = 1 << args.log2n
    gen = torch.Generator().manual_seed(0)
    # Shared by every zerocore variant (their values keep evolving, always finite): one set of
    # state keeps the run inside the machine's memory.
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    g32 = torch.randn(n, generator=gen) * 1e-2
    grads = {k: g32.to(d) for k, d in dtypes.items()}
    copies = {k: torch.zeros(n, dtype=dtypes[k]) for k in ("bf16", "fp16")}
    a, b = torch.ones(n), torch.ones(n)
    try:
        isa = ops._cpu_adam_isa()
        isas = ops._cpu_adam_isas()
    except AttributeError:  # a zerocore from before the ISA dispatch
        isa, isas = "at::vec", ["at::vec"]
    step = [0]

    def zc(grad, copy, which):
        def fn():
            if which != "at::vec":
                ops._cpu_adam_isa(which)
            step[0] += 1
            ops.fused_adam(p, grads[grad], m, v, None if copy == "none" else copies[copy],
                           step=step[0], adamw=True, **HYPER)
        return fn

    variants = {"RMW b.add_(a)": (lambda: b.add_(a), 12)}
    for grad in GRADS:
        for copy in COPIES:
            variants[f"zerocore {isa} {grad} grad, copy {copy}"] = (
                zc(grad, copy, isa), _bytes_per_element(grad, copy))
    for other in isas:
        if other not in (isa, "scalar"):
            variants[f"zerocore {other} fp32 grad, copy none"] = (
                zc("fp32", "none", other), _bytes_per_element("fp32", "none"))

    ds_note = None
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 (any failure to import means: no DeepSpeed rows)
        ds_note = f"DeepSpeed not importable ({type(e).__name__}: {e}); install: {DS_INSTALL}"
    if ds_note is None:
        ds_param = torch.nn.Parameter(torch.randn(n, generator=gen))
        ds_param.grad = g32.clone()
        ds_opt = DeepSpeedCPUAdam([ds_param], lr=HYPER["lr"], betas=(HYPER["beta1"],
                                  HYPER["beta2"]), eps=HYPER["eps"],
                                  weight_decay=HYPER["weight_decay"], adamw_mode=True)
        ds_opt.step()  # allocates its state outside the timed region

        def ds(grad, copy):
            def fn():
                if grad != "fp32":
                    ds_param.grad.copy_(grads[grad])
                ds_opt.step()
                if copy != "none":
                    copies[copy].copy_(ds_param.detach())
            return fn

        for grad in GRADS:
            for copy in COPIES:
                name = ("DeepSpeedCPUAdam fp32" if grad == "fp32" and copy == "none"
                        else f"DeepSpeed + casts {grad} grad, copy {copy}")
                variants[name] = (ds(grad, copy), _bytes_per_element(grad, copy))

    names = list(variants)
    for name in names:  # warm up: first touch, thread pools, DeepSpeed's JIT-built op
        for _ in range(2):
            variants[name][0]()
    times = {k: [] for k in names}
    load_before = _load()
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            variants[name][0]()
            times[name].append(time.perf_counter() - t0)
    return {"threads": args.threads, "n": n, "isa": isa, "isas": isas, "times": times,
            "bytes": {k: variants[k][1] for k in names}, "ds_note": ds_note,
            "ds_version": None if ds_note else deepspeed.__version__,
            "torch": torch.__version__, "load_before": load_before, "load_after": _load(),
            "affinity": sorted(os.sched_getaffinity(0))}


def _ratio_stats(num: list[float], den: list[float]) -> str:
    r = [x / y for x, y in zip(num, den)]
    return f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"


def report(res: dict) -> str:
    n, times, nbytes = res["n"], res["times"], res["bytes"]
    med = {k: statistics.median(v) for k, v in times.items()}
    rmw = "RMW b.add_(a)"
    rmw_gbs = 12 * n / med[rmw] / 1e9
    lines = [f"#### {res['threads']} thread(s), cores {res['affinity']}, 2^{n.bit_length() - 1} "
             f"elements, {len(times[rmw])} interleaved rounds; load average before "
             f"{res['load_before']}, after {res['load_after']}",
             "",
             "| variant | B/elem | median ms | IQR ms | GB/s | % RMW | vs DeepSpeed (+ casts), "
             "per-round time ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in times:
        t = sorted(times[name])
        q1, q3 = t[len(t) // 4], t[(3 * len(t)) // 4]
        gbs = nbytes[name] * n / med[name] / 1e9
        vs = ""
        if name.startswith("zerocore") and res["ds_note"] is None:
            parts = name.split()
            grad, copy = parts[2], parts[-1]
            if len(parts) == 6 and parts[1] == res["isa"]:
                ds = ("DeepSpeedCPUAdam fp32" if grad == "fp32" and copy == "none"
                      else f"DeepSpeed + casts {grad} grad, copy {copy}")
                vs = "DS/zerocore " + _ratio_stats(times[ds], times[name])
        lines.append(f"| {name} | {nbytes[name]} | {med[name] * 1e3:.3f} | "
                     f"{q1 * 1e3:.3f}-{q3 * 1e3:.3f} | {gbs:.1f} | {100 * gbs / rmw_gbs:.0f}% | "
                     f"{vs} |")
    if res["ds_note"]:
        lines += ["", res["ds_note"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--out", help="also append the tables to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cores", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = args.threads[0]
        print(json.dumps(child(args)))
        return
    header = (f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
              f"{_cpu_model()}, {os.cpu_count()} cores; python bench/bench_cpu_adam.py "
              f"{' '.join(sys.argv[1:])}")
    out = [header]
    print(header, flush=True)
    cores = sorted(os.sched_getaffinity(0))
    for t in args.threads:
        env = dict(os.environ, OMP_NUM_THREADS=str(t))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(t),
               "--rounds", str(args.rounds), "--log2n", str(args.log2n)]
        if hasattr(os, "sched_setaffinity") and t <= len(cores):
            cmd += ["--cores", ",".join(map(str, cores[-t:]))]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{t} thread(s) failed:\n{proc.stderr}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        if t == args.threads[0]:
            versions = (f"torch {res['torch']}, DeepSpeed {res['ds_version'] or 'absent'}, "
                        f"zerocore CPU Adam kernels: {res['isa']} (runnable: "
                        f"{', '.join(res['isas'])})")
            print(versions)
            out.append(versions)
        table = report(res)
        print("\n" + table, flush=True)
        out.append("\n" + table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
