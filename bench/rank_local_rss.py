"""Host memory per rank when sharding one GPT-NeoX-20B block (453 M parameters, 906 MB in bf16)
read from a checkpoint, at world sizes 1, 2 and 3, in two formats: Hugging Face safetensors
(memory-mapped) and GPT-NeoX slim weights (two tensor-parallel partitions, merged on reading).
Three ways to build it:

- ``before``: the engine and readers before rank-local reading (a checkout of commit 054f02d,
  ``--before-repo``): every rank materialises the whole layer and packs all of it;
- ``whole layer``: today's engine given the materialised layer (``neox.weights.materialize``):
  it packs only this rank's part, so a memory-mapped layer is read only there, but a merged
  slim layer is built whole first;
- ``range reads``: ``neox.weights.meta_layer`` + ``zerocore.MetaLayer``, what ``neox.run.build``
  now does where the format allows: each rank reads only its shard's elements.

    python bench/rank_local_rss.py --before-repo /tmp/zc-before   # the table of RESULTS.md

(make the checkout with ``git worktree add /tmp/zc-before 054f02d`` and copy
``zerocore/_C*.so`` and ``zerocore/_C_build.json`` into it: the kernels did not change.)

For each case, fresh gloo ranks on the CPU each reset their peak resident set (Linux
``clear_refs``) after importing, build the sharded layer, and report the growth of the peak
(``VmHWM``): private memory and the checkpoint's mapped pages alike. The files are in the page
cache (written just before), so this measures memory, not the disk.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 2**20


def _status(field: str) -> int:
    return harness.status_kib(field) * 1024


def write_checkpoints(directory: Path) -> dict[str, Path]:
    """One 20B block (bf16) as a Hugging Face directory (with the small rest of a one-block
    model) and as slim partitions (block 0 of two tensor-parallel ranks)."""
    import dataclasses

    from neox.config import PRESETS
    from neox.weights import RandomInit, iter_layer_states, iter_layers, save_hf
    from neox.weights.slim import slim_file_name
    config = dataclasses.replace(PRESETS["gpt-neox-20b"], num_hidden_layers=1, vocab_size=128)
    hf = save_hf(directory / "hf", config,
                 iter_layer_states(iter_layers(RandomInit(config, seed=0),
                                               dtype=torch.bfloat16)), overwrite=True)
    slim = directory / "slim"
    slim.mkdir()
    block = RandomInit(config, seed=0).read("block", 0)
    cut = {"attention.query_key_value": 0, "mlp.dense_h_to_4h": 0, "attention.dense": 1,
           "mlp.dense_4h_to_h": 1}
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in block.items():
        t = t.to(torch.bfloat16)
        module, _, what = name.rpartition(".")
        if module in cut and (what == "weight" or cut[module] == 0):
            halves = t.chunk(2, dim=cut[module])       # column- / row-parallel
        elif module in cut:
            halves = (t / 2, t / 2)                     # row-parallel bias: summed on merging
        else:
            halves = (t, t)                             # layer norms: replicated
        for part, half in zip(parts, halves):
            part[name] = half.contiguous().clone()
    for rank, part in enumerate(parts):
        torch.save(part, slim / slim_file_name(2, rank))
    return {"safetensors": hf, "slim": slim}


def rank_main(rank: int, world_size: int, fmt: str, path: str, how: str, repo: str) -> dict:
    sys.path.insert(0, repo)  # "before" imports the older checkout
    import dataclasses

    import zerocore
    from neox.config import PRESETS
    from neox.model import layer_specs
    from neox.weights import materialize, open_weights
    from neox.weights.slim import SlimReader
    config = dataclasses.replace(PRESETS["gpt-neox-20b"], num_hidden_layers=1, vocab_size=128)
    if not harness.reset_peak_rss():
        raise SystemExit("this measurement needs /proc/self/clear_refs (Linux >= 4.0)")
    rss0 = _status("VmRSS")
    start = time.perf_counter()
    reader = open_weights(path) if fmt == "safetensors" else SlimReader(path, config=config)
    with reader:
        spec = layer_specs(config)[1]   # block 0
        if how == "range reads":
            from neox.weights import meta_layer
            layer = zerocore.MetaLayer(
                meta_layer(reader, spec).requires_grad_(False),
                lambda name, a, b: reader.read_range(spec.kind, spec.source, name, a, b))
        else:
            layer = materialize(reader, spec).requires_grad_(False)
        model = zerocore.shard([layer], mixed_precision=zerocore.MixedPrecision(torch.bfloat16))
        del layer
    seconds = time.perf_counter() - start
    dist.barrier()
    shard = sum(g.shard.numel() * g.shard.element_size() for l in model.layers for g in l.groups)
    return {"peak_growth": _status("VmHWM") - rss0, "shard": shard, "seconds": seconds}


def measure(world_size: int, fmt: str, path: Path, how: str, repo: Path) -> list[dict]:
    return harness.run_ranks(rank_main, world_size, fmt, str(path), how, str(repo),
                             timeout_s=900, group_timeout_s=600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--before-repo", type=Path, default=None,
                   help="a checkout of the code before rank-local reading (054f02d), for the "
                        "'before' rows (left out without it)")
    args = p.parse_args()
    hows = (["before"] if args.before_repo else []) + ["whole layer", "range reads"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="block20b-") as tmp:
        paths = write_checkpoints(Path(tmp))
        print(harness.header("one GPT-NeoX-20B block in bf16: 864 MiB", packages=("torch",)))
        # The table's head, then each row as it comes (a row takes minutes).
        print(harness.table(("format", "world size", "how", "peak RSS growth MiB per rank",
                             "shard kept MiB", "build s"), (), "lrllrr"))
        for fmt, path in paths.items():
            for ws in args.world_sizes:
                for how in hows:
                    repo = args.before_repo if how == "before" else REPO
                    rows = measure(ws, fmt, path, how, repo)
                    growth = " / ".join(f"{r['peak_growth'] / MiB:,.0f}" for r in rows)
                    print(f"| {fmt} | {ws} | {how} | {growth} | {rows[0]['shard'] / MiB:,.0f} "
                          f"| {max(r['seconds'] for r in rows):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
