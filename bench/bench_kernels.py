"""Benchmarks of zerocore's kernels against what PyTorch users do without them.

Run (not part of the default test run):

    python -m pytest bench/bench_kernels.py --benchmark-only

Every operation is one test that times zerocore, the torch baselines a user would pick (the
fused and foreach optimizers, torch.cat, copy loops, ``torch._foreach_copy_``, int8
dequantization by repeat_interleave or broadcasting, NF4 and fp8 dequantization by a table
lookup or torch's fp8 conversion and a broadcast, and the same operation written by hand and
compiled with ``torch.compile``) and a plain copy of the same number of bytes (the bandwidth
ceiling), interleaved: every round calls each variant once, in a shuffled order
(bench/conftest.py). The end-of-run tables give zerocore against the fastest
baseline of the run, with the spread of the per-round ratios, and every variant's median, IQR,
GB/s and fraction of the copy bandwidth. Buffers are allocated and first touched before timing,
and compiled variants compiled (and checked against zerocore's result) before it; only the
operation itself is timed, except where allocating is part of what the baseline does
(torch.cat returns a new tensor).
"""

from __future__ import annotations

import pytest
import torch

import zerocore
from conftest import OUTPUT_COPY_VARIANT, RMW_VARIANT, ZEROCORE_VARIANT
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


ADAM_VARIANTS = ["zerocore", "torch AdamW(fused=True)", "torch AdamW(foreach=True)",
                 "torch.compile (hand-fused)", "copy (ceiling)"]


def _adamw_by_hand(param, grad16, exp_avg, exp_avg_sq, model16, step, *, lr, beta1, beta2, eps,
                   weight_decay):
    """The whole pipeline as one function for torch.compile to fuse into a single pass: widen
    the fp16 gradient, AdamW (zerocore.reference.fused_adam's formula), write the fp16 copy.
    step: a 0-d fp32 tensor, so that a new step does not recompile."""
    g = grad16.float()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)  # 0-d tensors: addcdiv_'s value= takes only numbers
    denom = (exp_avg_sq.sqrt() / torch.sqrt(1 - beta2**step)).add_(eps)
    param.sub_(exp_avg / denom * step_size)
    model16.copy_(param)


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
    if variant == "torch.compile (hand-fused)":
        param = torch.randn(N, device=device)
        exp_avg = torch.zeros_like(param)
        exp_avg_sq = torch.zeros_like(param)
        step_t = torch.zeros((), device=device)
        compiled = torch.compile(_adamw_by_hand, fullgraph=True, dynamic=False)
        hyper = dict(lr=ADAM["lr"], beta1=ADAM["betas"][0], beta2=ADAM["betas"][1],
                     eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])
        _check_compiled_adam(compiled, hyper, device)

        @torch.no_grad()
        def fn():
            step_t.add_(1)
            compiled(param, grad16, exp_avg, exp_avg_sq, model16, step_t, **hyper)
        fn()  # compiles for these buffers outside the timed region
        return fn
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


def _check_compiled_adam(compiled, hyper, device: str) -> None:
    """The compiled baseline must do zerocore's work: three steps on a small odd-sized shard
    agree with the fused kernel."""
    torch.manual_seed(1)
    n = 100_003
    state = [torch.randn(n, device=device), torch.zeros(n, device=device),
             torch.zeros(n, device=device)]
    theirs = [t.clone() for t in state]
    m_ours = torch.empty(n, dtype=torch.float16, device=device)
    m_theirs = torch.empty_like(m_ours)
    step_t = torch.zeros((), device=device)
    for step in range(1, 4):
        g = (torch.randn(n, device=device) * 1e-2).half()
        ops.fused_adam(*state[:1], g, *state[1:], m_ours, lr=hyper["lr"], beta1=hyper["beta1"],
                       beta2=hyper["beta2"], eps=hyper["eps"],
                       weight_decay=hyper["weight_decay"], step=step, adamw=True)
        step_t.add_(1)
        with torch.no_grad():
            compiled(theirs[0], g, theirs[1], theirs[2], m_theirs, step_t, **hyper)
    # Different roundings (fused multiply-adds, division order) of the same formula: after 3
    # steps of size lr=1e-3 the parameters agree to a few fp32 ulps of values ~1.
    torch.testing.assert_close(theirs[0], state[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m_theirs, m_ours, rtol=1e-3, atol=1e-3)  # one fp16 ulp


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adam(interleaved_bench, device):
    torch.manual_seed(0)
    variants = {v: _adam_variant(v, device) for v in ADAM_VARIANTS}
    interleaved_bench(variants, group="adamw step, fp16 grad + fp16 model copy, 2^24 params",
                      nbytes=ADAM_BYTES_PER_PARAM * N, device=device)


# --- the CPU Adam: against the memory system and DeepSpeedCPUAdam --------------------------------

# One AdamW step on a 2^24-element shard with fp32 master weights and moments, for every gradient
# dtype, with and without the 16-bit model copy written in the same pass: what the host steps
# under Offload(optimizer=True) and what zerocore.optim.AdamW steps on CPU ranks. Each group (one
# variant at one thread count) interleaves zerocore with the RMW ceiling and, when DeepSpeed is
# installed, DeepSpeedCPUAdam's step with the casts its users need around it.
CPU_ADAM_GRADS = ["fp32", "bf16", "fp16"]
CPU_ADAM_COPIES = ["none", "bf16", "fp16"]
CPU_ADAM_THREADS = [1, 2]
CPU_ADAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DS_VARIANT = "DeepSpeedCPUAdam (+ casts)"
DS_INSTALL = ("pip install deepspeed==0.19.8 (in a venv of its own: it is never a zerocore "
              "dependency)")


def _deepspeed_cpu_adam():
    """DeepSpeedCPUAdam, or None when DeepSpeed (or its CPU Adam op) cannot be loaded here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001  (any failure to import: no DeepSpeed rows)
        return None
    return DeepSpeedCPUAdam


def cpu_adam_bytes(grad: str, copy: str) -> int:
    """Bytes per element the step must move: read and write master, exp_avg and exp_avg_sq (24),
    read the gradient, write the copy."""
    size = {"fp32": 4, "bf16": 2, "fp16": 2, "none": 0}
    return 24 + size[grad] + size[copy]


def _cpu_adam_variants(grad: str, copy: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    g32 = torch.randn(N, generator=gen) * 1e-2
    g = g32.to(CPU_ADAM_DTYPES[grad])
    copy_t = None if copy == "none" else torch.zeros(N, dtype=CPU_ADAM_DTYPES[copy])
    param = torch.randn(N, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(N), torch.zeros(N)
    hyper = dict(lr=ADAM["lr"], beta1=ADAM["betas"][0], beta2=ADAM["betas"][1], eps=ADAM["eps"],
                 weight_decay=ADAM["weight_decay"], adamw=True)
    step = 0
    # _cpu_adam_isa sets a process-wide choice: each zerocore variant sets its own before its
    # call (a few microseconds, against milliseconds of step).
    best = ops._cpu_adam_isas()[-1]

    def zerocore_step(isa):
        def fn():
            nonlocal step
            step += 1
            ops._cpu_adam_isa(isa)
            ops.fused_adam(param, g, exp_avg, exp_avg_sq, copy_t, step=step, **hyper)
        return fn

    # The same work on a shard that stays in cache, as many elements in all: what the arithmetic
    # alone allows (the compute roof beside the memory one). 2^16 elements (1.8 MB of state):
    # two kGrain pieces, so two threads each get one.
    small = 1 << 16
    cached = [param[:small].clone(), g[:small].clone(), exp_avg[:small].clone(),
              exp_avg_sq[:small].clone(), None if copy_t is None else copy_t[:small].clone()]

    def in_cache():
        nonlocal step
        step += 1
        ops._cpu_adam_isa(best)
        for _ in range(N // small):
            ops.fused_adam(*cached, step=step, **hyper)

    a, b = torch.ones(N), torch.ones(N)
    variants = {ZEROCORE_VARIANT: zerocore_step(best), RMW_VARIANT: lambda: b.add_(a),
                f"{ZEROCORE_VARIANT}, in cache (2^16 elements x {N // small})": in_cache}
    if grad == "fp32" and copy == "none" and "avx2" in ops._cpu_adam_isas() and best != "avx2":
        variants[f"{ZEROCORE_VARIANT} avx2"] = zerocore_step("avx2")
    DeepSpeedCPUAdam = _deepspeed_cpu_adam()
    if DeepSpeedCPUAdam is not None:
        ds_param = torch.nn.Parameter(torch.randn(N, generator=gen))
        ds_param.grad = g32.clone()
        ds_opt = DeepSpeedCPUAdam([ds_param], lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                                  weight_decay=ADAM["weight_decay"], adamw_mode=True)
        ds_opt.step()  # allocates its state (and builds its op) outside the timed region

        @torch.no_grad()
        def ds():
            # DeepSpeed's step takes an fp32 gradient and writes no 16-bit copy (0.19.8): ZeRO-
            # Offload widens the gradient into it and casts the new parameters back.
            if grad != "fp32":
                ds_param.grad.copy_(g)
            ds_opt.step()
            if copy_t is not None:
                copy_t.copy_(ds_param)
        variants[DS_VARIANT] = ds
    return variants


@pytest.mark.parametrize("copy", CPU_ADAM_COPIES, ids=lambda c: f"copy_{c}")
@pytest.mark.parametrize("grad", CPU_ADAM_GRADS, ids=lambda g: f"grad_{g}")
@pytest.mark.parametrize("threads", CPU_ADAM_THREADS, ids=lambda t: f"{t}thread")
def test_cpu_adam(interleaved_bench, bench_note, threads, grad, copy):
    variants = _cpu_adam_variants(grad, copy)
    if DS_VARIANT not in variants:
        bench_note(f"DeepSpeed is not importable here: the CPU Adam groups ran without "
                   f"{DS_VARIANT}; install: {DS_INSTALL}")
    interleaved_bench(variants, group=f"cpu adamw, {grad} grad, copy {copy}, 2^24 params, "
                                      f"{threads} thread(s)",
                      nbytes=cpu_adam_bytes(grad, copy) * N, device="cpu",
                      variant_bytes={RMW_VARIANT: 12 * N}, threads=threads)


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
    if variant == "torch.compile (cat)":
        # Casts and concatenation compiled into one kernel that writes a new flat tensor. (The
        # in-place form, slices of a preallocated buffer copied into, compiles to a chain of
        # slice_scatter copies of the whole buffer: 20-40x slower here, not a fair baseline.)
        zeros_at = {s: n for s, n in gaps}
        order = sorted([(o, i) for i, o in enumerate(offsets)] + [(s, -1) for s, _ in gaps])

        def cat_by_hand(ts):
            return torch.cat([ts[i].reshape(-1).to(dst_dtype) if i >= 0 else
                              torch.zeros(zeros_at[o], dtype=dst_dtype, device=device)
                              for o, i in order])
        compiled = torch.compile(cat_by_hand, fullgraph=True, dynamic=False)
        expected = torch.empty_like(flat)
        ops.pack(tensors, offsets, expected)
        assert torch.equal(compiled(tensors), expected), "compiled pack differs from zerocore's"
        return lambda: compiled(tensors)
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
    if variant == "torch.compile (copy loop)":
        def unpack_by_hand(flat, outs):
            for o, t in zip(offsets, outs):
                t.copy_(flat[o:o + t.numel()].view(t.shape))
        compiled = torch.compile(unpack_by_hand, fullgraph=True, dynamic=False)
        compiled(flat, outs)
        expected = [torch.empty_like(t) for t in outs]
        ops.unpack(flat, offsets, expected)
        assert all(torch.equal(a, b) for a, b in zip(outs, expected)), \
            "compiled unpack differs from zerocore's"
        return lambda: compiled(flat, outs)
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


PACK_VARIANTS = ["zerocore", "torch.cat", "torch.cat(out=flat)", "slice-copy loop",
                 "torch._foreach_copy_", "torch.compile (cat)", "copy (ceiling)"]
UNPACK_VARIANTS = ["zerocore", "slice-copy loop", "torch.split + copy", "torch._foreach_copy_",
                   "torch.compile (copy loop)", "copy (ceiling)"]


def _flat_copy(interleaved_bench, kind: str, device: str, conversion: str) -> None:
    """Pack (tensors -> flat) or unpack (flat -> tensors), every variant and the copy ceiling."""
    torch.manual_seed(0)
    src, dst = (DTYPES[x] for x in conversion.split("->"))
    nbytes, names, make, group = (
        (_pack_bytes(src, dst), PACK_VARIANTS, _pack_variant, "48 tensors -> 2^24 flat")
        if kind == "pack" else
        (_unpack_bytes(src, dst), UNPACK_VARIANTS, _unpack_variant, "2^24 flat -> 48 tensors"))
    variants = {v: (_copy_ceiling(nbytes, device) if v == "copy (ceiling)"
                    else make(v, src, dst, device)) for v in names}
    interleaved_bench(variants, group=f"{kind} {conversion}, {group}", nbytes=nbytes,
                      device=device)


@pytest.mark.parametrize("conversion", CONVERSIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_pack(interleaved_bench, device, conversion):
    _flat_copy(interleaved_bench, "pack", device, conversion)


@pytest.mark.parametrize("conversion", CONVERSIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_unpack(interleaved_bench, device, conversion):
    _flat_copy(interleaved_bench, "unpack", device, conversion)


# --- blockwise int8 dequantization --------------------------------------------------------------

# Frozen weights gathered as int8 with one fp32 scale per QUANT_BLOCK elements, widened into the
# compute dtype in the gathered flat buffer.
QUANT_BLOCK = 128
DEQUANT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEQUANT_VARIANTS = ["zerocore", "torch repeat_interleave", "torch view-broadcast",
                    "torch.compile (view-broadcast)", "copy (ceiling)"]


def _dequant_by_hand(q, scales, out):
    """The view-based baseline written into out, for torch.compile to fuse into one pass."""
    out.view(-1, QUANT_BLOCK).copy_((q.view(-1, QUANT_BLOCK).float() * scales[:, None])
                                    .to(out.dtype))


def _dequant_bytes(dtype) -> int:
    """Read q and the scales, write the output once."""
    return N * (1 + dtype.itemsize) + (N // QUANT_BLOCK) * 4


def _dequant_variant(variant: str, dtype, device: str):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (N,), generator=g, dtype=torch.int8).to(device)
    scales = (torch.rand(N // QUANT_BLOCK, generator=g) * 1e-2).to(device)
    flat = torch.full((N,), float("nan"), dtype=dtype, device=device)  # first touch
    if variant == "zerocore":
        return lambda: ops.dequantize_blockwise_(flat, q, scales, QUANT_BLOCK)
    if variant == "torch repeat_interleave":
        return lambda: flat.copy_((q.float() * scales.repeat_interleave(QUANT_BLOCK)).to(dtype))
    if variant == "torch view-broadcast":
        rows = flat.view(-1, QUANT_BLOCK)
        return lambda: rows.copy_((q.view(-1, QUANT_BLOCK).float() * scales[:, None]).to(dtype))
    if variant == "torch.compile (view-broadcast)":
        compiled = torch.compile(_dequant_by_hand, fullgraph=True, dynamic=False)
        compiled(q, scales, flat)
        expected = torch.empty_like(flat)
        ops.dequantize_blockwise_(expected, q, scales, QUANT_BLOCK)
        assert torch.equal(flat, expected), "compiled dequantization differs from zerocore's"
        return lambda: compiled(q, scales, flat)
    raise AssertionError(variant)


@pytest.mark.parametrize("dtype", list(DEQUANT_DTYPES))
@pytest.mark.parametrize("device", DEVICES)
def test_dequant(interleaved_bench, device, dtype):
    nbytes = _dequant_bytes(DEQUANT_DTYPES[dtype])
    variants = {v: (_copy_ceiling(nbytes, device) if v == "copy (ceiling)"
                    else _dequant_variant(v, DEQUANT_DTYPES[dtype], device))
                for v in DEQUANT_VARIANTS}
    interleaved_bench(variants, group=f"dequantize int8 -> {dtype}, block {QUANT_BLOCK}, "
                                      f"2^24 elements", nbytes=nbytes, device=device)


# --- NF4 and fp8 dequantization -----------------------------------------------------------------

# Frozen weights held in a low-bit format (zerocore.kernels.formats) and widened into the compute
# dtype before use, at each format's own block size.
LOWBIT_FORMATS = {"nf4": ops.NF4_BLOCK, "fp8": ops.FP8_BLOCK}
LOWBIT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _lowbit_bytes(fmt: str, dtype) -> int:
    """Read the codes (half a byte an element for NF4, a byte for fp8) and the scales, write the
    output once."""
    code_bytes = N // 2 if fmt == "nf4" else N
    return code_bytes + (N // LOWBIT_FORMATS[fmt]) * 4 + N * dtype.itemsize


def _lowbit_variants(fmt: str, dtype, device: str) -> dict:
    """zerocore's kernel (on the CPU each instruction set, forced per call: the choice is a
    pointer swap), the plain PyTorch a user would write (a table lookup or torch's own fp8
    conversion, then the scales broadcast per block), and copies for the bandwidth ratio."""
    block = LOWBIT_FORMATS[fmt]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=g)
    q, scales = (ops.quantize_nf4 if fmt == "nf4" else ops.quantize_fp8)(x, block)
    q, scales = q.to(device), scales.to(device)
    flat = torch.full((N,), float("nan"), dtype=dtype, device=device)  # first touch
    dequantize_ = ops.dequantize_nf4_ if fmt == "nf4" else ops.dequantize_fp8_
    variants = {}
    isas = ops._cpu_lowbit_isas() if device == "cpu" else []
    variants[ZEROCORE_VARIANT] = lambda: dequantize_(flat, q, scales, block)
    for isa in isas[:-1]:  # the widest is the default, "zerocore" itself
        def forced(isa=isa):
            old = ops._cpu_lowbit_isa()
            ops._cpu_lowbit_isa(isa)
            dequantize_(flat, q, scales, block)
            ops._cpu_lowbit_isa(old)
        variants[f"zerocore ({isa})"] = forced
    rows = flat.view(-1, block)
    if fmt == "nf4":
        table = zerocore.reference.NF4_CODE.to(device)

        def plain():
            codes = torch.stack([q & 0xF, q >> 4], dim=1).view(-1).long()
            rows.copy_(table[codes].view(-1, block) * scales[:, None])
    else:
        def plain():
            rows.copy_(q.view(torch.float8_e4m3fn).float().view(-1, block) * scales[:, None])
    variants["torch (table / fp8 cast, broadcast)"] = plain
    variants["copy (ceiling)"] = _copy_ceiling(_lowbit_bytes(fmt, dtype), device)
    src = torch.ones_like(flat)
    variants[OUTPUT_COPY_VARIANT] = lambda: flat.copy_(src)
    return variants


@pytest.mark.parametrize("dtype", list(LOWBIT_DTYPES))
@pytest.mark.parametrize("fmt", list(LOWBIT_FORMATS))
@pytest.mark.parametrize("device", DEVICES)
def test_dequant_lowbit(interleaved_bench, device, fmt, dtype):
    out_dtype = LOWBIT_DTYPES[dtype]
    variants = _lowbit_variants(fmt, out_dtype, device)
    interleaved_bench(variants, group=f"dequantize {fmt} -> {dtype}, block {LOWBIT_FORMATS[fmt]}, "
                                      f"2^24 elements", nbytes=_lowbit_bytes(fmt, out_dtype),
                      device=device,
                      variant_bytes={OUTPUT_COPY_VARIANT: 2 * N * out_dtype.itemsize})
