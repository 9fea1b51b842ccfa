"""Tests of ``zerocore.ops.fused_adam_multi``: many flat shards stepped in one launch.

Its promise is that every shard's elements get exactly the bits ``fused_adam`` gives that shard
alone, so the main test is bitwise against ``fused_adam`` shard by shard (itself tested against
``zerocore.reference`` and an exact float32 replay in test_ops.py), and against
``reference.fused_adam_multi`` (plain PyTorch) within the ulps test_ops.py allows. Inputs are fresh
seeded random shards of odd sizes (empty ones, a single element, sizes just around a vector, and
shards that cross the CUDA kernel's chunks of 16,384 elements), each at its own misalignment, with
its own lr and weight decay, over several steps, for every gradient and model-copy dtype. Then:
the thread count does not change a bit, the streaming-store path (a call over 32 MiB) is the
same, malformed lists raise an error naming what is wrong before anything is written, and
``torch.library.opcheck`` and ``torch.compile`` pass. Every device-taking test runs on the CPU and,
when a GPU is present, on CUDA.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

import zerocore  # noqa: F401  (registers torch.ops.zerocore)
from zerocore.kernels import ops, reference
from tests.support.exact_adam import HYPER, assert_slack_untouched, placed, randn

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", None: "none"}
F32_EPS = torch.finfo(torch.float32).eps
# 0 and 1: no vector work; 15, 17: around one CPU vector block; 16385 and 40001: past one and two
# CUDA chunks (16,384 elements) with a tail; 3001: several CPU units (64 elements) with a tail.
SHARD_SIZES = [17, 0, 40001, 1, 15, 3001, 16385]
STEPS = 3  # the moments and bias correction build up over consecutive steps
# Same bounds as test_ops.py's, for the same reasons (the reference's torch ops round
# differently by about an ulp per operation; see PARAM_ULPS there).
PARAM_ULPS, EXP_AVG_SQ_ULPS = 5.0, 8.0


class Shards:
    """Shards of the given sizes, each placed at its own offset in a larger buffer (so no two
    share an alignment), with a model copy of ``copy_dtype`` or none, and per-shard settings."""

    def __init__(self, sizes, copy_dtype, device, seed, offsets=None):
        rng = random.Random(seed)
        self.sizes = sizes
        self.offsets = offsets or [rng.randrange(8) for _ in sizes]
        self.bufs, self.params, self.ms, self.vs, self.copies = [], [], [], [], []
        for i, (n, off) in enumerate(zip(sizes, self.offsets)):
            bp, p = placed(randn(n, seed + i, device), off)
            _, m = placed(torch.zeros(n, device=device), (off + 3) % 8)
            _, v = placed(torch.zeros(n, device=device), (off + 5) % 8)
            self.bufs.append((bp, off, n))
            self.params.append(p)
            self.ms.append(m)
            self.vs.append(v)
            if copy_dtype is not None:
                self.copies.append(placed(torch.zeros(n, dtype=copy_dtype, device=device),
                                          (off + 1) % 8)[1])
        # Each shard its own settings, as runs of parameters with their own lr scale and decay.
        self.lrs = [HYPER["lr"] * rng.choice([1.0, 0.5, 2.0]) for _ in sizes]
        self.wds = [rng.choice([0.0, 0.1, 0.01]) for _ in sizes]

    def clone(self) -> "Shards":
        other = object.__new__(Shards)
        other.sizes, other.offsets, other.lrs, other.wds = (self.sizes, self.offsets, self.lrs,
                                                            self.wds)
        other.bufs = []
        other.params = [p.clone() for p in self.params]
        other.ms = [m.clone() for m in self.ms]
        other.vs = [v.clone() for v in self.vs]
        other.copies = [c.clone() for c in self.copies]
        return other


def _grads(sizes, dtype, device, seed, loss_scale):
    rng = random.Random(seed)
    return [placed((randn(n, seed + 1000 + i, device) * loss_scale).to(dtype),
                   rng.randrange(8))[1] for i, n in enumerate(sizes)]


def _step_multi(s: Shards, grads, step, *, adamw, inv_grad_scale, impl=ops.fused_adam_multi):
    impl(s.params, grads, s.ms, s.vs, s.copies or None, lrs=s.lrs, weight_decays=s.wds,
         beta1=HYPER["beta1"], beta2=HYPER["beta2"], eps=HYPER["eps"], step=step,
         inv_grad_scale=inv_grad_scale, adamw=adamw)


def _step_one_by_one(s: Shards, grads, step, *, adamw, inv_grad_scale):
    for i, g in enumerate(grads):
        ops.fused_adam(s.params[i], g, s.ms[i], s.vs[i], s.copies[i] if s.copies else None,
                       lr=s.lrs[i], beta1=HYPER["beta1"], beta2=HYPER["beta2"],
                       eps=HYPER["eps"], weight_decay=s.wds[i], step=step,
                       inv_grad_scale=inv_grad_scale, adamw=adamw)


def _assert_bitwise(a: Shards, b: Shards) -> None:
    for name in ("params", "ms", "vs", "copies"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name), strict=True)):
            assert torch.equal(x, y), f"{name}[{i}] ({x.numel()} elements) differs"


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("copy_dtype", [None] + FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_multi_equals_each_shard_alone(device, grad_dtype, copy_dtype, adamw):
    seed = zlib.crc32(repr((grad_dtype, copy_dtype, adamw)).encode())
    loss_scale = 1024.0 if grad_dtype == torch.float16 else 1.0
    multi = Shards(SHARD_SIZES, copy_dtype, device, seed)
    alone, ref = multi.clone(), multi.clone()
    for step in range(1, STEPS + 1):
        grads = _grads(SHARD_SIZES, grad_dtype, device, seed + step, loss_scale)
        kw = dict(adamw=adamw, inv_grad_scale=1.0 / loss_scale)
        _step_multi(multi, grads, step, **kw)
        _step_one_by_one(alone, grads, step, **kw)
        _step_multi(ref, grads, step, impl=reference.fused_adam_multi, **kw)
    _assert_bitwise(multi, alone)
    for buf, off, n in multi.bufs:  # no shard's step writes outside its own view
        assert_slack_untouched(buf, off, n)
    for p, r, lr in zip(multi.params, ref.params, multi.lrs):
        err = (p.double() - r.double()).abs() / (F32_EPS * (r.abs().double() + lr / 0.15))
        assert (err.max().item() if err.numel() else 0.0) <= PARAM_ULPS
    for v, r in zip(multi.vs, ref.vs):
        err = (v.double() - r.double()).abs() / (F32_EPS * r.abs().double().clamp_min(1e-30))
        assert (err.max().item() if err.numel() else 0.0) <= EXP_AVG_SQ_ULPS
    for c, p in zip(multi.copies, multi.params):
        assert torch.equal(c, p.to(c.dtype))  # the rounding of the new master, nothing else


def test_multi_is_independent_of_the_thread_count():
    """Threads split the shards' units differently at 1 and 3 threads: the bits do not move."""
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            s = Shards([70001, 5, 129, 33333], torch.bfloat16, "cpu", seed=7)
            for step in (1, 2):
                _step_multi(s, _grads(s.sizes, torch.float32, "cpu", 7 + step, 1.0), step,
                            adamw=True, inv_grad_scale=1.0)
            results.append(s)
    finally:
        torch.set_num_threads(before)
    _assert_bitwise(results[0], results[1])


@pytest.mark.parametrize("copy_dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_multi_past_the_streaming_threshold(device, copy_dtype):
    """Eight shards of 160,003 elements with an fp32 gradient: 41 MB touched in one call, past
    the 32 MiB from which the CPU kernels stream the model copy (kStreamingMinBytes), though no
    shard alone is: still each shard's bits."""
    sizes = [160003] * 8
    multi = Shards(sizes, copy_dtype, device, seed=11)
    alone = multi.clone()
    grads = _grads(sizes, torch.float32, device, 12, 1.0)
    _step_multi(multi, grads, 1, adamw=True, inv_grad_scale=1.0)
    _step_one_by_one(alone, grads, 1, adamw=True, inv_grad_scale=1.0)
    _assert_bitwise(multi, alone)


def test_multi_of_no_shards_does_nothing():
    ops.fused_adam_multi([], [], [], [], None, lrs=[], weight_decays=[], step=1)


def _valid(device, n_shards=3, n=40):
    return dict(params=[torch.zeros(n, device=device) for _ in range(n_shards)],
                grads=[torch.ones(n, device=device) for _ in range(n_shards)],
                exp_avgs=[torch.zeros(n, device=device) for _ in range(n_shards)],
                exp_avg_sqs=[torch.zeros(n, device=device) for _ in range(n_shards)],
                model_copies=[torch.zeros(n, dtype=torch.bfloat16, device=device)
                              for _ in range(n_shards)],
                lrs=[1e-3] * n_shards, weight_decays=[0.0] * n_shards)


def _set(key, index, make):
    def change(a, device):
        a[key][index] = make(device)
    return change


def _drop(key):
    def change(a, device):
        a[key] = a[key][:-1]
    return change


MULTI_ERRORS = {
    # case: (regex the message must match after "zerocore.", change to the valid arguments)
    "grads-count": (r"fused_adam_multi: .*one entry per shard \(3 params, 2 grads",
                    _drop("grads")),
    "lrs-count": (r"fused_adam_multi: .*2 lrs", _drop("lrs")),
    "copies-count": (r"fused_adam_multi: model_copies must be empty or have one entry per shard, "
                     r"got 2 for 3", _drop("model_copies")),
    "mixed-grad-dtypes": (r"fused_adam_multi: every grad must have one dtype; grad 2 is Half",
                          _set("grads", 2, lambda d: torch.ones(40, dtype=torch.float16,
                                                                device=d))),
    "mixed-copy-dtypes": (r"fused_adam_multi: every model copy must have one dtype; copy 1",
                          _set("model_copies", 1, lambda d: torch.zeros(40, device=d))),
    # A shard's own arguments are checked as fused_adam checks them, naming the argument.
    "param-fp16": (r"fused_adam: param \(the master weights\) must be float32",
                   _set("params", 2, lambda d: torch.zeros(40, dtype=torch.float16, device=d))),
    "exp_avg-numel": (r"fused_adam: exp_avg\b", _set("exp_avgs", 1,
                                                      lambda d: torch.zeros(41, device=d))),
    "lr-negative": (r"fused_adam: lr must be >= 0", lambda a, d: a["lrs"].__setitem__(2, -1.0)),
    "weight_decay-negative": (r"fused_adam: weight_decay must be >= 0",
                              lambda a, d: a["weight_decays"].__setitem__(1, -0.5)),
}


@pytest.mark.parametrize("case", list(MULTI_ERRORS))
def test_multi_rejects(device, case):
    pattern, change = MULTI_ERRORS[case]
    a = _valid(device)
    change(a, device)
    before = [p.clone() for p in a["params"]]
    with pytest.raises(RuntimeError, match=rf"zerocore\.{pattern}"):
        ops.fused_adam_multi(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"],
                             a["model_copies"], lrs=a["lrs"], weight_decays=a["weight_decays"],
                             step=1)
    # Every shard is checked before any is stepped: even the valid first shard is untouched.
    for p, b in zip(a["params"], before):
        assert torch.equal(p, b)


def test_multi_rejects_shards_on_two_devices():
    """The CPU kernel called directly with a meta shard among CPU ones reaches the shared check
    (a real CPU/CUDA mix needs a GPU)."""
    a = _valid("cpu")
    for key in ("params", "grads", "exp_avgs", "exp_avg_sqs", "model_copies"):
        a[key][1] = a[key][1].to("meta")
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    with pytest.raises(RuntimeError, match=r"every shard must be on one device; shard 1 is on "
                                           r"meta"):
        torch.ops.zerocore.fused_adam_multi.default.redispatch(
            keyset, a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["model_copies"],
            a["lrs"], a["weight_decays"], 0.9, 0.999, 1e-8, 1, 1.0, True)


def test_multi_opcheck(device):
    sizes = [1001, 17, 300]
    s = Shards(sizes, torch.bfloat16, device, seed=3)
    grads = _grads(sizes, torch.float16, device, 4, 1.0)
    # All default sub-tests (schema, autograd registration, fake tensor, aot_dispatch_dynamic).
    torch.library.opcheck(torch.ops.zerocore.fused_adam_multi.default,
                          (s.params, grads, s.ms, s.vs, s.copies, s.lrs, s.wds, 0.9, 0.999, 1e-8,
                           2, 0.5, True))


def test_multi_under_torch_compile(device):
    sizes = [257, 31]
    eager = Shards(sizes, torch.float16, device, seed=5)
    compiled = eager.clone()
    grads = _grads(sizes, torch.float32, device, 6, 1.0)

    def step(s):
        _step_multi(s, grads, 1, adamw=True, inv_grad_scale=1.0)

    step(eager)
    torch.compile(step, backend="aot_eager", fullgraph=True)(compiled)
    _assert_bitwise(eager, compiled)
