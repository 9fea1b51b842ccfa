"""Peak memory and time of reading a DeepSpeed ZeRO-3 checkpoint: ``python -m
zerocore.from_deepspeed`` against DeepSpeed's own ``zero_to_fp32.py``, on the same checkpoint.

    python bench/from_deepspeed_mem.py --deepspeed-python VENV/bin/python [--work DIR]

1. With DeepSpeed's Python (this file runs itself there with ``--make``; DeepSpeed is never
   imported by zerocore): a GPT-NeoX of about 134M parameters (hidden 768, 8 blocks, Pythia's
   vocabulary of 50304: 537 MB in fp32) is set up with ZeRO stage 3 over 2 gloo ranks on the
   CPU, trained one optimizer step (so Adam's moments exist) and saved, twice: full
   fine-tuning (every parameter trained: 1.6 GB of fp32 masters and moments) and PEFT LoRA
   (r 8 on query_key_value; the base frozen, so its 537 MB sit in the model-state files).
2. Each converter runs alone under ``/usr/bin/time`` (its peak resident set, "%M"), its wall
   time measured around it; the load average is read before and after (other people's work on
   the machine shows there). Not the rusage of a child of this process: Linux keeps a
   process's RSS high-water mark across exec, so a child forked from a large parent reports
   the parent's size; ``time`` is small. The converters:
   - full checkpoint: ``zerocore.from_deepspeed CKPT OUT`` against ``zero_to_fp32.py CKPT OUT
     --safe_serialization`` (both write every parameter in fp32 as safetensors);
   - LoRA checkpoint: ``zerocore.from_deepspeed --trainable-only`` against ``zero_to_fp32.py``
     with and without ``--exclude_frozen_parameters``.
   ``python -c "import torch"`` is measured too: the floor both converters start from.
   The outputs of the full export are compared, tensor for tensor, before they are deleted.

The checkpoints (about 2.7 GB) are made in a temporary directory and deleted at the end; give
``--work`` to keep them (and reuse them on the next run). Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

REPO = Path(__file__).resolve().parent.parent
MODEL = dict(vocab_size=50304, hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
             intermediate_size=3072, max_position_embeddings=64, tie_word_embeddings=False,
             hidden_dropout=0.0, attention_dropout=0.0)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query_key_value"])
WORLD = 2
KINDS = ("full", "lora")


# -- 1. the checkpoints, made by DeepSpeed (run with DeepSpeed's Python) --------------------------

def _rank(rank: int, world: int, kind: str, out: str) -> None:
    """One rank (harness.run_ranks has joined it to the group, with DeepSpeed's variables)."""
    import logging

    import torch
    import torch.distributed as dist

    import deepspeed
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**MODEL))
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}, "torch_adam": True},
              "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    ids = torch.randint(0, MODEL["vocab_size"], (1, 16), generator=torch.Generator()
                        .manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
    engine.step()
    engine.save_checkpoint(out)
    dist.barrier()


def make(kind: str, out: Path) -> None:
    harness.run_ranks(_rank, WORLD, kind, str(out), env=dict(DS_ACCELERATOR="cpu"))


# -- 2. the measurements --------------------------------------------------------------------------

def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Runs ``cmd`` alone under ``/usr/bin/time``; its peak RSS (MiB), wall time (s), the load
    average before and after."""
    load_before = os.getloadavg()[0]
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        start = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%M", *cmd], cwd=REPO,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        kib = int(report.read().split()[-1])  # %M: the maximum resident set, KiB
    return {"rss_mib": kib / 1024, "wall_s": wall, "load": (load_before, os.getloadavg()[0])}


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed-python", required=True,
                   help="a Python that has DeepSpeed (and transformers, peft)")
    p.add_argument("--work", type=Path, default=None,
                   help="keep the checkpoints here (default: a temporary directory, deleted)")
    p.add_argument("--make", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--compare", type=Path, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        make(args.make, args.out)
        return
    if args.compare:
        sys.exit(0 if same_tensors(*args.compare) else 1)
    work = args.work or Path(tempfile.mkdtemp(prefix="from-ds-bench-"))
    ds_py = args.deepspeed_python
    env = harness.child_env()
    rows = []
    try:
        for kind in KINDS:
            ckpt = work / f"ckpt-{kind}"
            if not (ckpt / "latest").is_file():
                t = time.perf_counter()
                subprocess.run([ds_py, __file__, "--deepspeed-python", ds_py, "--make", kind,
                                "--out", str(ckpt)], check=True, cwd=REPO)
                print(f"made {ckpt} ({size_mb(ckpt):,.0f} MB) in {time.perf_counter() - t:.0f} s",
                      file=sys.stderr)
            z2f = str(ckpt / "zero_to_fp32.py")  # DeepSpeed copies it into every checkpoint
            ours = [sys.executable, "-m", "zerocore.from_deepspeed", str(ckpt)]
            cases = ([("zerocore.from_deepspeed", ours + [str(work / "zc")]),
                      ("zero_to_fp32.py --safe_serialization",
                       [ds_py, z2f, str(ckpt), str(work / "ds"), "--safe_serialization"])]
                     if kind == "full" else
                     [("zerocore.from_deepspeed --trainable-only",
                       ours + [str(work / "zc"), "--trainable-only"]),
                      ("zero_to_fp32.py --safe_serialization",
                       [ds_py, z2f, str(ckpt), str(work / "ds"), "--safe_serialization"]),
                      ("zero_to_fp32.py --safe_serialization --exclude_frozen_parameters",
                       [ds_py, z2f, str(ckpt), str(work / "ds"), "--safe_serialization",
                        "--exclude_frozen_parameters"])])
            for name, cmd in cases:
                out = work / ("zc" if name.startswith("zerocore") else "ds")
                shutil.rmtree(out, ignore_errors=True)  # (the full export's zc is kept)
                m = measure(cmd, env)
                m.update(kind=kind, tool=name, out_mb=size_mb(out),
                         ckpt_mb=size_mb(ckpt / (ckpt / "latest").read_text().strip()))
                rows.append(m)
                print(json.dumps(m), file=sys.stderr, flush=True)
            if kind == "full":  # in a child: this process stays small (see measure)
                rows[-1]["same"] = subprocess.run(
                    [sys.executable, __file__, "--deepspeed-python", ds_py, "--compare",
                     str(work / "zc" / "model.safetensors"),
                     str(work / "ds" / "model.safetensors")],
                    cwd=REPO, env=env).returncode == 0
            for d in ("zc", "ds"):
                shutil.rmtree(work / d, ignore_errors=True)
        floor = measure([sys.executable, "-c", "import torch"], env)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + harness.header(f"`python -c 'import torch'`: peak RSS {floor['rss_mib']:,.0f} "
                                f"MiB; DeepSpeed's Python: {ds_py}") + "\n")
    print(harness.table(
        ("checkpoint", "tool", "peak RSS MiB", "wall s", "output MB", "load avg before → after"),
        [(f"{r['kind']} ({r['ckpt_mb']:,.0f} MB)", f"`{r['tool']}`", f"{r['rss_mib']:,.0f}",
          f"{r['wall_s']:.1f}", f"{r['out_mb']:,.1f}", f"{r['load'][0]:.2f} → {r['load'][1]:.2f}")
         for r in rows], "llrrrl"))
    same = [r["same"] for r in rows if "same" in r]
    if same:
        print(f"\nfull export: zerocore's model.safetensors equals zero_to_fp32's tensor for "
              f"tensor: {same[0]}")


if __name__ == "__main__":
    main()
