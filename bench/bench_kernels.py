"""Benchmarks of zerocore's kernels against what PyTorch users do without them.

Run (not part of the default test run):

    python -m pytest bench/bench_kernels.py --benchmark-only

Every group times zerocore, the torch baselines, and a plain copy of the same number of bytes (the
bandwidth ceiling) one after the other, and the end-of-run table (bench/conftest.py) gives GB/s,
the fraction of the copy bandwidth and the time ratios. Buffers are allocated and first touched
before timing; only the operation itself is timed, except where allocating is part of what the
baseline does (torch.cat returns a new tensor).
"""

from __future__ import annotations

import pytest
import torch

import zerocore
from zerocore import ops

# The shard size of the targets.
N = 1 << 24

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and zerocore.BUILD.has_cuda),
        reason="needs a GPU and zerocore built with CUDA kernels")),
]

ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


def _copy_ceiling(nbytes: int, device: str):
    """A plain copy that reads nbytes/2 and writes nbytes/2 bytes: the same traffic as an
    operation that must move nbytes."""
    src = torch.ones(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    return lambda: dst.copy_(src)


# --- fused Adam ---------------------------------------------------------------------------------

# Bytes per parameter of an AdamW step with an fp16 gradient and an fp16 model copy: read grad (2)
# and master, exp_avg, exp_avg_sq (12); write master and moments (12) and the model copy (2).
ADAM_BYTES_PER_PARAM = 28


def _adam_variant(variant: str, device: str):
    grad16 = (torch.randn(N, device=device) * 1e-2).half()
    model16 = torch.empty(N, dtype=torch.float16, device=device)
    if variant == "zerocore":
        param = torch.randn(N, device=device)
        exp_avg = torch.zeros_like(param)
        exp_avg_sq = torch.zeros_like(param)
        step = 0

        def fn():
            nonlocal step
            step += 1
            ops.fused_adam(param, grad16, exp_avg, exp_avg_sq, model16, lr=ADAM["lr"],
                           beta1=ADAM["betas"][0], beta2=ADAM["betas"][1], eps=ADAM["eps"],
                           weight_decay=ADAM["weight_decay"], step=step, adamw=True)
        return fn
    if variant == "copy (ceiling)":
        return _copy_ceiling(ADAM_BYTES_PER_PARAM * N, device)
    # torch's own mixed-precision pipeline: fp32 master parameter whose .grad receives the cast
    # fp16 gradient, the AdamW step, then the cast back to the fp16 model copy.
    kind = {"torch AdamW(fused=True)": "fused", "torch AdamW(foreach=True)": "foreach"}[variant]
    master = torch.nn.Parameter(torch.randn(N, device=device))
    master.grad = torch.zeros_like(master)
    opt = torch.optim.AdamW([master], **ADAM, **{kind: True})

    @torch.no_grad()
    def fn():
        master.grad.copy_(grad16)
        opt.step()
        model16.copy_(master)
    fn()  # allocates the optimizer state outside the timed region
    return fn


@pytest.mark.parametrize("variant", ["zerocore", "torch AdamW(fused=True)",
                                     "torch AdamW(foreach=True)", "copy (ceiling)"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam(kernel_bench, device, variant):
    torch.manual_seed(0)
    fn = _adam_variant(variant, device)
    kernel_bench(fn, group="adamw step, fp16 grad + fp16 model copy, 2^24 params",
                 variant=variant, nbytes=ADAM_BYTES_PER_PARAM * N, device=device)


# --- pack / unpack ------------------------------------------------------------------------------

# The parameters of four GPT-NeoX layers with hidden size 590 (16.74M elements, 48 tensors: 2-D
# weights and 1-D biases and norms of sizes that are not multiples of the vector width), placed at
# offsets aligned to 16 elements and padded to a 2^24-element flat buffer, as a sharded flat
# parameter pads to a multiple of the world size.
HIDDEN = 590
LAYERS = 4
ALIGN = 16


def layer_shapes(h: int = HIDDEN, layers: int = LAYERS) -> list[tuple[int, ...]]:
    one = [(h,), (h,),              # input_layernorm weight, bias
           (3 * h, h), (3 * h,),    # attention.query_key_value
           (h, h), (h,),            # attention.dense
           (h,), (h,),              # post_attention_layernorm
           (4 * h, h), (4 * h,),    # mlp.dense_h_to_4h
           (h, 4 * h), (h,)]        # mlp.dense_4h_to_h
    return one * layers


def flat_layout(shapes, flat_numel: int = N):
    """Offsets of each tensor, aligned to ALIGN elements, and the (start, length) padding gaps,
    the tail up to flat_numel included."""
    offsets, gaps, cursor = [], [], 0
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        start = -(-cursor // ALIGN) * ALIGN
        if start > cursor:
            gaps.append((cursor, start - cursor))
        offsets.append(start)
        cursor = start + numel
    assert cursor <= flat_numel, "the layer list must fit the flat buffer"
    if cursor < flat_numel:
        gaps.append((cursor, flat_numel - cursor))
    return offsets, gaps


def _pieces_in_order(tensors, offsets, gaps, make_gap):
    """The tensors and padding pieces in flat-buffer order (for torch.cat and torch.split)."""
    items = [(o, t) for o, t in zip(offsets, tensors)] + [(s, make_gap(s, n)) for s, n in gaps]
    return [t for _, t in sorted(items, key=lambda x: x[0])]


def _pack_variant(variant: str, src_dtype, dst_dtype, device: str):
    shapes = layer_shapes()
    offsets, gaps = flat_layout(shapes)
    tensors = [torch.randn(s, device=device).to(src_dtype) for s in shapes]
    flat = torch.full((N,), float("nan"), dtype=dst_dtype, device=device)
    views = [flat[o:o + t.numel()].view_as(t) for o, t in zip(offsets, tensors)]
    pad_views = [flat[s:s + n] for s, n in gaps]
    if variant == "zerocore":
        return lambda: ops.pack(tensors, offsets, flat)
    if variant == "torch.cat":
        # What DeepSpeed's _flatten_dense_tensors and FSDP's flat parameter do: a new tensor,
        # padding appended as zero tensors. When converting, each tensor is cast before cat
        # (casting the concatenated fp32 result instead was ~6x slower here: it writes and
        # re-reads a 64 MiB temporary).
        zeros = {n: torch.zeros(n, dtype=dst_dtype, device=device) for _, n in gaps}
        pieces = _pieces_in_order([t.reshape(-1) for t in tensors], offsets, gaps,
                                  lambda s, n: zeros[n])
        if src_dtype == dst_dtype:
            return lambda: torch.cat(pieces)
        return lambda: torch.cat([p.to(dst_dtype) for p in pieces])
    if variant == "torch.cat(out=flat)":
        zeros = {n: torch.zeros(n, dtype=src_dtype, device=device) for _, n in gaps}
        pieces = _pieces_in_order([t.reshape(-1) for t in tensors], offsets, gaps,
                                  lambda s, n: zeros[n])
        return lambda: torch.cat(pieces, out=flat)
    if variant == "slice-copy loop":
        def fn():
            for d, t in zip(views, tensors):
                d.copy_(t)
            for z in pad_views:
                z.zero_()
        return fn
    if variant == "torch._foreach_copy_":
        # What FSDP2 uses to copy parameters into its all-gather input.
        def fn():
            torch._foreach_copy_(views, tensors)
            torch._foreach_zero_(pad_views)
        return fn
    raise AssertionError(variant)


def _unpack_variant(variant: str, src_dtype, dst_dtype, device: str):
    shapes = layer_shapes()
    offsets, gaps = flat_layout(shapes)
    flat = torch.randn(N, device=device).to(src_dtype)
    outs = [torch.empty(s, dtype=dst_dtype, device=device) for s in shapes]
    for o in outs:
        o.fill_(float("nan"))  # first touch before timing
    if variant == "zerocore":
        return lambda: ops.unpack(flat, offsets, outs)
    if variant == "slice-copy loop":
        views = [flat[o:o + t.numel()].view_as(t) for o, t in zip(offsets, outs)]

        def fn():
            for t, v in zip(outs, views):
                t.copy_(v)
        return fn
    if variant == "torch.split + copy":
        marker = object()
        order = _pieces_in_order(outs, offsets, gaps, lambda s, n: (marker, n))
        sizes = [x[1] if isinstance(x, tuple) else x.numel() for x in order]
        keep = [i for i, x in enumerate(order) if not isinstance(x, tuple)]
        ordered_outs = [order[i] for i in keep]

        def fn():
            pieces = torch.split(flat, sizes)
            for t, i in zip(ordered_outs, keep):
                t.copy_(pieces[i].view_as(t))
        return fn
    if variant == "torch._foreach_copy_":
        views = [flat[o:o + t.numel()].view_as(t) for o, t in zip(offsets, outs)]
        return lambda: torch._foreach_copy_(outs, views)
    raise AssertionError(variant)


def _pack_bytes(src_dtype, dst_dtype) -> int:
    """Pack reads every tensor and writes the whole flat buffer, padding included."""
    numel = sum(torch.Size(s).numel() for s in layer_shapes())
    return numel * src_dtype.itemsize + N * dst_dtype.itemsize


def _unpack_bytes(src_dtype, dst_dtype) -> int:
    """Unpack reads the tensors' stretches of the flat buffer (not the padding) and writes
    every tensor."""
    numel = sum(torch.Size(s).numel() for s in layer_shapes())
    return numel * (src_dtype.itemsize + dst_dtype.itemsize)


CONVERSIONS = ["fp16->fp16", "fp32->fp32", "fp32->fp16"]


@pytest.mark.parametrize("variant", ["zerocore", "torch.cat", "torch.cat(out=flat)",
                                     "slice-copy loop", "torch._foreach_copy_",
                                     "copy (ceiling)"])
@pytest.mark.parametrize("conversion", CONVERSIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_pack(kernel_bench, device, conversion, variant):
    torch.manual_seed(0)
    src, dst = (DTYPES[x] for x in conversion.split("->"))
    nbytes = _pack_bytes(src, dst)
    if variant == "copy (ceiling)":
        fn = _copy_ceiling(nbytes, device)
    else:
        fn = _pack_variant(variant, src, dst, device)
    kernel_bench(fn, group=f"pack {conversion}, 48 tensors -> 2^24 flat", variant=variant,
                 nbytes=nbytes, device=device)


@pytest.mark.parametrize("variant", ["zerocore", "slice-copy loop", "torch.split + copy",
                                     "torch._foreach_copy_", "copy (ceiling)"])
@pytest.mark.parametrize("conversion", CONVERSIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_unpack(kernel_bench, device, conversion, variant):
    torch.manual_seed(0)
    src, dst = (DTYPES[x] for x in conversion.split("->"))
    nbytes = _unpack_bytes(src, dst)
    if variant == "copy (ceiling)":
        fn = _copy_ceiling(nbytes, device)
    else:
        fn = _unpack_variant(variant, src, dst, device)
    kernel_bench(fn, group=f"unpack {conversion}, 2^24 flat -> 48 tensors", variant=variant,
                 nbytes=nbytes, device=device)
