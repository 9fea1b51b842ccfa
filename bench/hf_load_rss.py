"""Peak host memory per rank and bytes read when loading a Hugging Face directory (random
Llama weights in bf16, written here) into a sharded model, two ways, on fresh gloo ranks:

- ``zerocore.hf_pretrained``: built on the meta device, each rank reads its shards' bytes;
- ``from_pretrained + shard_model``: transformers loads the whole model on every rank, then
  zerocore shards it (what the README advised before).

Each rank resets its peak resident set (``VmHWM``) after importing, loads, runs one forward and
backward, and reports the growth of the peak, its model state (its flat shards' bytes) and the
bytes it read. The frozen base is kept in bf16 (``FrozenWeights``' default: the dtype loaded).

    python bench/hf_load_rss.py --hidden 1024 --layers 8 --ranks 2 4
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


def write_model(path: Path, hidden: int, layers: int) -> int:
    """A random bf16 Llama saved in Hugging Face format (several files); its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         intermediate_size=hidden * 8 // 3 // 64 * 64, dtype=torch.bfloat16,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def rank(r: int, n: int, port: int, path: str, way: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=n)
    from transformers import AutoModelForCausalLM

    import zerocore
    from zerocore.hf_pretrained import pretrained_on_meta
    for p in AutoModelForCausalLM, zerocore:  # imported before the window
        del p
    harness.reset_peak_rss()
    base = harness.status_kib("VmHWM")
    start = time.perf_counter()
    bytes_read = None
    if way == "zerocore":
        pretrained = pretrained_on_meta(AutoModelForCausalLM, path)
        model = pretrained.model
        for p in model.parameters():
            p.requires_grad_(False)
        zerocore.shard_model(model, model.model.layers, read=pretrained.read)
        bytes_read = pretrained.files.bytes_read
        pretrained.close()
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        for p in model.parameters():
            p.requires_grad_(False)
        zerocore.shard_model(model, model.model.layers)
    loaded = time.perf_counter() - start
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, 32000, (1, 16))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    first = time.perf_counter() - start
    peak = harness.status_kib("VmHWM") - base
    out.put((r, peak / 1024, state / 2**20, bytes_read, loaded, first))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    print(harness.header("hf_load_rss"))
    with tempfile.TemporaryDirectory() as tmp:
        params = write_model(Path(tmp), args.hidden, args.layers)
        files = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        print(f"model: {params / 1e6:.0f} M parameters, safetensors files {files / 2**20:.0f} "
              f"MiB (bf16)\n")
        print("| ranks | way | peak RSS growth per rank (MiB) | model state per rank (MiB) | "
              "bytes read / file size (node) | load s | to first forward s |")
        print("|---:|---|---|---|---:|---:|---:|")
        ctx = mp.get_context("spawn")
        for n in args.ranks:
            for way in ("zerocore", "from_pretrained"):
                out = ctx.Queue()
                port = harness.free_port()
                procs = [ctx.Process(target=rank, args=(r, n, port, tmp, way, out))
                         for r in range(n)]
                for q in procs:
                    q.start()
                rows = sorted(out.get(timeout=1800) for _ in procs)
                for q in procs:
                    q.join()
                read = (f"{sum(x[3] for x in rows) / files:.3f}" if way == "zerocore"
                        else "(mmap, whole)")
                print(f"| {n} | {way} | {', '.join(f'{x[1]:.0f}' for x in rows)} | "
                      f"{', '.join(f'{x[2]:.0f}' for x in rows)} | {read} | "
                      f"{max(x[4] for x in rows):.1f} | {max(x[5] for x in rows):.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
