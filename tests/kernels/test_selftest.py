"""Tests of ``python -m zerocore.selftest`` on the CPU: it runs and passes here, it fails when an
op is wrong (a wrong kernel handed to the checking function, never a patched torch), its CUDA
branch parses, plans and refuses cleanly without a GPU, and it exits with the right status.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from zerocore.comm import transport
from zerocore.engine.flat_layout import FlatLayout
from zerocore.kernels import ops, reference
from zerocore.tools import selftest

CPU = torch.device("cpu")
SIZES = (1, 17, 4099)
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_quick_run_passes_and_prints_the_table(capsys):
    assert selftest.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "check" in out and "max error vs tolerance" in out
    for name in ("fused_adam vs reference", "fused_adam_multi = fused_adam per shard",
                 "grad_stats vs reference", "pack vs reference",
                 "unpack vs reference", "engine ws1 losses vs torch AdamW",
                 "engine ws1 params vs torch AdamW", "engine ws1 unpadded groups vs torch AdamW",
                 "offload vs no offload (bf16)", "copy bandwidth", "fused_adam bandwidth",
                 "nf4/fp8 dequantize vs reference", "frozen nf4: replicated = sharded",
                 "frozen nf4: losses vs torch AdamW", "frozen fp8: replicated = sharded",
                 "frozen fp8: losses vs torch AdamW"):
        assert name in out, name
    assert "FAIL" not in out
    assert "15 passed, 0 failed, 3 measured" in out


def test_the_frozen_check_fails_against_a_reference_not_round_tripped(monkeypatch):
    """check_frozen's reference computes with the round-tripped weights: given the weights as
    they were, the losses part (NF4 moves each weight by up to half a code step)."""
    round_tripped = selftest._frozen_mlp
    monkeypatch.setattr(selftest, "_frozen_mlp", lambda dtype: round_tripped(None))
    rows = {r.check: r for r in selftest.check_frozen(torch.device("cpu"), 4)}
    assert rows["frozen nf4: losses vs torch AdamW"].status == "FAIL", rows
    assert rows["frozen nf4: replicated = sharded"].status == "PASS", rows


@pytest.mark.e2e
def test_command_exits_zero_and_finishes():
    """The module as a program, in a fresh interpreter (the engine checks need a process without
    a process group; this one is the real entry point)."""
    proc = subprocess.run([sys.executable, "-m", "zerocore.selftest", "--quick",
                           "--device", "cpu"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout


# -- a wrong op is reported as a failure ----------------------------------------------------------


def _adam_with(**wrong):
    """The reference Adam step with some argument changed: a kernel with a wrong constant."""
    def kernel(p, g, m, v, model_copy=None, **kw):
        reference.fused_adam(p, g, m, v, model_copy, **{**kw, **wrong})
    return kernel


def _adam_without_copy(p, g, m, v, model_copy=None, **kw):
    ops.fused_adam(p, g, m, v, None, **kw)  # the model copy is left as it was


def _adam_truncating_copy(p, g, m, v, model_copy=None, **kw):
    ops.fused_adam(p, g, m, v, model_copy, **kw)
    if model_copy is not None and model_copy.dtype == torch.bfloat16:
        # bf16 by chopping the low 16 bits: rounds towards zero instead of to nearest even.
        model_copy.copy_((p.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16))


def _stats_ignoring_nonfinite(grad, stats):
    ops.grad_stats(grad.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), stats)
    return stats


def _stats_dropping_last(grad, stats):
    ops.grad_stats(grad[:-1], stats)
    return stats


def _pack_without_padding(tensors, offsets, flat):
    for t, off in zip(tensors, offsets):
        flat[off:off + t.numel()].copy_(t.reshape(-1))  # the gaps keep their old contents
    return flat


def _unpack_skipping_last(flat, offsets, tensors):
    ops.unpack(flat, offsets[:-1], tensors[:-1])


def _unpack_one_bit_off(flat, offsets, tensors):
    reference.unpack(flat, offsets, tensors)
    for t in tensors:  # one ulp off for any fp16/bf16 tensor with a non-zero element
        if t.dtype != torch.float32 and t.numel():
            t.view(torch.int16).reshape(-1)[0] ^= 1


def _multi_with_lrs_reversed(params, grads, exp_avgs, exp_avg_sqs, copies, *, lrs, **kw):
    ops.fused_adam_multi(params, grads, exp_avgs, exp_avg_sqs, copies, lrs=lrs[::-1], **kw)


def _multi_skipping_last(params, grads, exp_avgs, exp_avg_sqs, copies, **kw):
    kw = {k: v[:-1] if k in ("lrs", "weight_decays") else v for k, v in kw.items()}
    ops.fused_adam_multi(params[:-1], grads[:-1], exp_avgs[:-1], exp_avg_sqs[:-1], copies[:-1],
                         **kw)


BROKEN = {
    "adam-lr-0.1%-high": (selftest.check_fused_adam, _adam_with(lr=3.003e-3)),
    "adam-eps-1%-high": (selftest.check_fused_adam, _adam_with(eps=1.01e-6)),
    "adam-beta2-off": (selftest.check_fused_adam, _adam_with(beta2=0.981)),
    "adam-no-copy": (selftest.check_fused_adam, _adam_without_copy),
    "adam-copy-truncated": (selftest.check_fused_adam, _adam_truncating_copy),
    "multi-lrs-swapped": (selftest.check_fused_adam_multi, _multi_with_lrs_reversed),
    "multi-skips-last": (selftest.check_fused_adam_multi, _multi_skipping_last),
    "grad_stats-misses-nan": (selftest.check_grad_stats, _stats_ignoring_nonfinite),
    "grad_stats-drops-last": (selftest.check_grad_stats, _stats_dropping_last),
    "pack-no-padding": (selftest.check_pack, _pack_without_padding),
    "unpack-skips-last": (selftest.check_unpack, _unpack_skipping_last),
    "unpack-one-ulp": (selftest.check_unpack, _unpack_one_bit_off),
}


def _one_ulp_off(dequantize_):
    """``dequantize_`` with its last output one unit in the last place off."""
    def wrong(out, q, scales, block):
        dequantize_(out, q, scales, block)
        out.view(torch.int16 if out.element_size() == 2 else torch.int32)[-1] += 1
        return out
    return wrong


def _quantize_rounding_down(x, block):
    q, scales = ops.quantize_blockwise(x, block)
    return q.clamp(max=126), scales


@pytest.mark.parametrize("kwargs", [{"dequantize": _one_ulp_off(ops.dequantize_blockwise_)},
                                    {"quantize": _quantize_rounding_down}],
                         ids=["dequantize-one-ulp", "quantize-clamped"])
def test_wrong_int8_op_fails(kwargs):
    result = selftest.check_int8(CPU, SIZES, **kwargs)
    assert result.status == "FAIL", result


def _dequantize_nf4_swapping_nibbles(out, packed, scales, block):
    return ops.dequantize_nf4_(out, (packed >> 4) | (packed << 4), scales, block)


@pytest.mark.parametrize("kwargs", [{"dequantize_nf4": _dequantize_nf4_swapping_nibbles},
                                    {"dequantize_fp8": _one_ulp_off(ops.dequantize_fp8_)}],
                         ids=["nf4-nibbles-swapped", "fp8-one-ulp"])
def test_wrong_lowbit_op_fails(kwargs):
    result = selftest.check_lowbit(CPU, SIZES, **kwargs)
    assert result.status == "FAIL", result


@pytest.mark.parametrize("case", list(BROKEN))
def test_wrong_op_fails(case):
    check, kernel = BROKEN[case]
    result = check(CPU, SIZES, kernel=kernel)
    assert result.status == "FAIL", result
    assert selftest.table([result]).count("FAIL") == 1


@pytest.mark.parametrize("check", [selftest.check_fused_adam, selftest.check_fused_adam_multi,
                                   selftest.check_grad_stats,
                                   selftest.check_pack, selftest.check_unpack,
                                   selftest.check_int8, selftest.check_lowbit],
                         ids=lambda f: f.__name__)
def test_right_op_passes(check):
    result = check(CPU, SIZES)
    assert result.status == "PASS", result
    assert result.error <= result.tolerance


def test_wrong_op_fails_the_command(capsys):
    """Through main's own parameter: the table says FAIL, with the worst case, and the exit
    status is 1."""
    kernels = selftest.Kernels(fused_adam=_adam_with(lr=3.003e-3))
    assert selftest.main(["--device", "cpu", "--quick"], kernels=kernels) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fused_adam vs reference"))
    assert "FAIL" in row and "ulp" in row and "n=" in row
    assert "1 failed" in out


def test_crashing_op_is_a_failure_row():
    def crashing(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    step = selftest.Planned("fused_adam vs reference", CPU,
                            lambda: [selftest.check_fused_adam(CPU, SIZES, kernel=crashing)])
    (row,) = selftest.run_planned(step)
    assert row.status == "FAIL" and "kernel exploded" in row.detail


# -- the CUDA branch, without a GPU -------------------------------------------------------------


def _call_counting(kernel, perturb_calls):
    """kernel, except that the calls whose 0-based index modulo 4 is in perturb_calls also
    nudge param by one ulp: a 'second device' that differs from the first."""
    count = 0

    def wrapped(p, *args, **kwargs):
        nonlocal count
        kernel(p, *args, **kwargs)
        if count % 4 in perturb_calls and p.numel():
            p.view(torch.int32)[0] += 1
        count += 1
    return wrapped


def test_cuda_comparison_logic_on_two_cpu_runs():
    """check_cuda_matches_cpu runs the same steps on the CPU and on the given device; given the
    CPU twice it must pass, and fail when the second run's kernel differs by one ulp."""
    assert selftest.check_cuda_matches_cpu(CPU, SIZES).status == "PASS"
    # Per size the fused Adam kernel is called twice on each device (two steps): calls 2 and 3
    # of every 4 are the second device's.
    kernels = selftest.Kernels(fused_adam=_call_counting(ops.fused_adam, {2, 3}))
    result = selftest.check_cuda_matches_cpu(CPU, SIZES, kernels=kernels)
    assert result.status == "FAIL" and "param" in result.detail, result


def test_cuda_plan_lists_without_touching_cuda(capsys):
    assert selftest.main(["--device", "cuda", "--list"]) == 0
    out = capsys.readouterr().out
    assert "cuda" in out and "cuda kernels = cpu kernels" in out and "engine ws1" in out
    plan = selftest.plan([torch.device("cuda", 0)], selftest.Sizes.quick())
    assert {p.device.type for p in plan} == {"cuda"}
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


def test_default_list_is_the_cpu_and_any_visible_gpu(capsys):
    assert selftest.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    devices = {line.split(":")[0] for line in lines}
    assert "cpu" in devices
    assert any(d.startswith("cuda") for d in devices) == torch.cuda.is_available()


@NO_GPU
def test_cuda_without_gpu_is_a_usage_error(capsys):
    assert selftest.main(["--device", "cuda", "--quick"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        selftest.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--device {auto,cpu,cuda}" in out and "--quick" in out and "--list" in out
    with pytest.raises(SystemExit) as e:
        selftest.main(["--device", "tpu"])
    assert e.value.code == 2


def test_the_unpadded_model_has_no_padding_at_1_2_3_and_6_ranks():
    for world_size in (1, 2, 3, 6):
        for layer in selftest.mlp(selftest.UNPADDED):
            shapes = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
            layout = FlatLayout.build(shapes, world_size)
            assert layout.padded_numel == layout.numel, (world_size, shapes)
        padded = [FlatLayout.build([(n, tuple(p.shape)) for n, p in layer.named_parameters()], 1)
                  for layer in selftest.mlp(selftest.PADDED)]
        assert all(lay.padded_numel - lay.numel >= 8 for lay in padded)


def test_an_unwritten_reduction_tail_fails_the_unpadded_check_only(monkeypatch):
    """NCCL 2.27's one-rank AVG left the last elements of a reduction unwritten, stale memory
    in their place (issue 32). Here every gradient reduction ends the same way: its last 8
    elements hold a stale 7.0. The padded model's groups end in 9-11 elements of padding, so its
    checks cannot see it; the unpadded model's groups end with a bias, so its check fails."""
    start = transport.Reduce.start

    def stale_tail(self, packed, lo, hi):
        reduction = start(self, packed, lo, hi)

        def finish():
            out = reduction.finish()
            out[-8:] = 7.0
            return out
        return transport.Reduction(finish)

    monkeypatch.setattr(transport.Reduce, "start", stale_tail)
    rows = {r.check: r for r in selftest.check_engine(CPU, 4)}
    assert rows["engine ws1 unpadded groups vs torch AdamW"].status == "FAIL", rows
    for check in ("engine ws1 losses vs torch AdamW", "engine ws1 params vs torch AdamW",
                  "offload vs no offload (bf16)"):
        assert rows[check].status == "PASS", rows[check]


def test_engine_check_refuses_an_existing_process_group():
    """Inside a program that already has a process group the engine checks cannot make their
    own: one FAIL row saying so, and the caller's group is left alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        step = selftest.Planned("engine", CPU, lambda: selftest.check_engine(CPU, 2))
        (row,) = selftest.run_planned(step)
        assert row.status == "FAIL" and "already initialised" in row.detail
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_table_formats_every_kind_of_row():
    rows = [selftest.Result("a", "cpu", "PASS", 1.5, 5.0, "ulp", 0.25, "worst here"),
            selftest.Result("b", "cuda", "FAIL", math.inf, 0.0, "elements differ", 1.0),
            selftest.Result("copy bandwidth", "cpu", "INFO", 31.4, None, "GB/s", 0.5),
            selftest.Result("crashed", "cpu", "FAIL", None, None, "", 0.0, "raised X")]
    lines = selftest.table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert "1.5 vs 5 ulp" in lines[2] and "worst here" in lines[2]
    assert "inf vs 0 elements differ" in lines[3]
    assert "31.4 GB/s" in lines[4]
    assert " - " in lines[5] and "raised X" in lines[5]
