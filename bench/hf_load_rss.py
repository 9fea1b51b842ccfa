"""Peak host memory per rank and bytes read when loading a Hugging Face directory (random
Llama weights in bf16, written here) into a sharded model, two ways, on fresh gloo ranks:

- ``zerocore.hf_pretrained``: built on the meta device, each rank reads its shards' bytes;
- ``from_pretrained + shard_model``: transformers loads the whole model on every rank, then
  zerocore shards it (what the README advised before).

Each rank resets its peak resident set (``VmHWM``) after importing and reports two windows'
growth of the peak: the loading alone (until the load returns; and of it, the peak before
sharding starts: the meta build, or transformers' whole model) and to the first step (the load
then one forward). The base is frozen (``freeze``), as a LoRA fine-tuning's; its shards are in
fp32 (``MixedPrecision``'s default) or with ``--bf16`` in bf16, the files' dtype. Beside them:
its model state (its flat shards' and buffers' bytes), the bytes it read (counted by the reader,
and by the kernel's ``rchar``: read system calls), and the plan's loading peak for the same
model and ranks (``MemoryPlan.loading``).

    python bench/hf_load_rss.py --hidden 1024 --layers 8 --ranks 2 4
    python bench/hf_load_rss.py --hidden 2048 --layers 18 --ranks 2 4 --dir /tmp/llama-1b

``--dir`` keeps the written model there (written if it holds no config.json), so that a second
run reads the same files.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from zerocore.hf_pretrained import SafetensorsFiles  # noqa: E402


def write_model(path: Path, hidden: int, layers: int) -> int:
    """A random bf16 Llama saved in Hugging Face format (several files); its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         intermediate_size=hidden * 8 // 3 // 64 * 64, dtype=torch.bfloat16,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the writer's memory
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def freeze(model: torch.nn.Module) -> None:
    """All but the final norm frozen: a fine-tuning's base (the norm stands for its adapters,
    which a plan needs to have a step to plan)."""
    for name, p in model.named_parameters():
        p.requires_grad_(name == "model.norm.weight")


def rchar() -> int:
    """Bytes this process has asked of read system calls (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def rank(r: int, n: int, port: int, path: str, way: str, bf16: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=n)
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import zerocore
    from zerocore.hf_pretrained import pretrained_on_meta
    for p in AutoModelForCausalLM, LlamaForCausalLM, zerocore:  # imported before the window
        del p
    harness.reset_peak_rss()
    base = harness.status_kib("VmHWM")
    read_before = rchar()
    start = time.perf_counter()
    bytes_read = None
    if way == "zerocore":
        pretrained = pretrained_on_meta(AutoModelForCausalLM, path)
        model = pretrained.model
        built = harness.status_kib("VmHWM") - base
        freeze(model)
        zerocore.shard_model(model, model.model.layers, read=pretrained.read,
                             mixed_precision=precision(bf16))
        bytes_read = pretrained.files.bytes_read
        pretrained.close()
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        built = harness.status_kib("VmHWM") - base
        freeze(model)
        zerocore.shard_model(model, model.model.layers, mixed_precision=precision(bf16))
    loaded = time.perf_counter() - start
    load_peak = harness.status_kib("VmHWM") - base
    syscalls = rchar() - read_before
    state = sum(t.numel() * t.element_size()
                for t in (*model.parameters(), *model.buffers()))
    ids = torch.randint(0, 32000, (1, 16))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    first = time.perf_counter() - start
    peak = harness.status_kib("VmHWM") - base
    out.put((r, load_peak / 1024, peak / 1024, state / 2**20, bytes_read, syscalls, loaded,
             first, built / 1024))
    dist.barrier()
    dist.destroy_process_group()


def precision(bf16: bool):
    import zerocore
    return zerocore.MixedPrecision(torch.bfloat16 if bf16 else torch.float32)


def planned_loading(path: str, n: int, bf16: bool):
    """The plan's loading of the same model, frozen as the ranks freeze it, on ``n`` ranks."""
    from transformers import AutoModelForCausalLM

    from zerocore.hf_pretrained import pretrained_on_meta
    from zerocore.plan import plan_model
    model = pretrained_on_meta(AutoModelForCausalLM, path).model
    freeze(model)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    return plan_model(model, model.model.layers, ids, world_size=n, device="cpu",
                      mixed_precision=precision(bf16),
                      loss=lambda out: out.logits.sum()).loading


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ways", nargs="+", default=["zerocore", "from_pretrained"],
                   choices=["zerocore", "from_pretrained"])
    p.add_argument("--bf16", action="store_true", help="shards in bf16 (default fp32)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the model is written (kept; reused if written already)")
    args = p.parse_args()
    print(harness.header("hf_load_rss"))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or Path(tmp)
        if not (path / "config.json").exists():
            write_model(path, args.hidden, args.layers)
        params = sum(e.numel for e in SafetensorsFiles(path).entries.values())
        files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"model: {params / 1e6:.0f} M parameters, safetensors files {files / 2**20:.0f} "
              f"MiB (bf16), {len(list(path.glob('*.safetensors')))} files\n")
        print("| ranks | way | loading peak RSS growth per rank (MiB) | of it, before sharding "
              "(MiB) | to first step (MiB) | "
              "model state per rank (MiB) | planned loading peak, staging (MiB) | "
              "bytes read / file size (node): counted, read calls | load s | to first step s |")
        print("|---:|---|---|---|---|---|---|---|---:|---:|")
        ctx = mp.get_context("spawn")
        for n in args.ranks:
            plan = planned_loading(str(path), n, args.bf16)
            for way in args.ways:
                out = ctx.Queue()
                port = harness.free_port()
                procs = [ctx.Process(target=rank,
                                     args=(r, n, port, str(path), way, args.bf16, out))
                         for r in range(n)]
                for q in procs:
                    q.start()
                rows = sorted(out.get(timeout=1800) for _ in procs)
                for q in procs:
                    q.join()
                calls = sum(x[5] for x in rows) / files
                read = (f"{sum(x[4] for x in rows) / files:.3f}, {calls:.3f}"
                        if way == "zerocore" else f"(mmap), {calls:.3f}")
                print(f"| {n} | {way} | {', '.join(f'{x[1]:.0f}' for x in rows)} | "
                      f"{', '.join(f'{x[8]:.0f}' for x in rows)} | "
                      f"{', '.join(f'{x[2]:.0f}' for x in rows)} | "
                      f"{', '.join(f'{x[3]:.0f}' for x in rows)} | "
                      f"{plan.peak / 2**20:.0f}, {plan.staging / 2**20:.0f} | {read} | "
                      f"{max(x[6] for x in rows):.1f} | {max(x[7] for x in rows):.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
