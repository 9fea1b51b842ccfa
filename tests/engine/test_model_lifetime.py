"""A sharded model the user drops is freed, whole (issue 40, item 1): after ``del`` and
``gc.collect()``, once its threads have ended by themselves (after any work in flight), no
engine object of it (the model, its sharding, runtime and optimizer, an NVMe
store), no thread of it and no scratch file of it remain, through both front doors, with every
offload home, after training (forward, backward, optimizer step) and after HF ``generate``; and
``ShardedTrainer`` after training.

The trap it guards against: autograd's nodes are objects Python's collector cannot see into. A
unit's module keeps its installed views between steps, each view its autograd node, and a node
that held the runtime (or a unit, which holds the module) closed a cycle no collection can
break: the model lived until the process ended, and with NVMe offload its scratch file and two
``zerocore-nvme`` threads with it.

Each case runs in a rank of a gloo World (one rank; one home again at two, where the model has
peers), which shards, trains or generates, drops everything and reports what is left.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from tests.support.hf_models import batch, build, decoder_layers
from tests.support.neox_testing import cli_env
from zerocore.policies import MIN_POOL_BYTES

# Where each home keeps what it offloads; "nvme-params": parameter shards on NVMe, the optimizer
# on the device; "nvme-all": both on NVMe. A pool of 256 KiB holds two of the largest shard a
# gather reads from NVMe (the tiny GPT-NeoX's embedding, 12 KiB in fp32) at least.
POOL = 256 * 1024
HOMES = {
    "none": {},
    "cpu-optimizer": dict(optimizer="cpu"),
    "cpu-params": dict(params="cpu"),
    "nvme-optimizer": dict(optimizer="nvme", pool_bytes=MIN_POOL_BYTES),
    "nvme-params": dict(params="nvme", pool_bytes=POOL),
    "nvme-all": dict(optimizer="nvme", params="nvme", pool_bytes=POOL),
}


def _offload(home: str, path: str) -> zerocore.Offload:
    options = HOMES[home]
    nvme = "nvme" in options.values()
    return zerocore.Offload(**options, **({"path": path} if nvme else {}))


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zerocore")}


def _open_under(path: str) -> list[str]:
    """What this process holds open under ``path`` (an unnamed scratch shows as
    "<path>/... (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory's own descriptor, closed since
        if target.startswith(path):
            out.append(target)
    return out


def _shard_door(offload: zerocore.Offload, after: str, workdir: str) -> dict[str, object]:
    """after: "training"; "forward", a forward that built a graph no backward used (an
    evaluation without no_grad); "kept-loss", training with the loss tensor, and so its graph,
    still held when the model is dropped (a notebook's variable); "in-flight", training
    dropped while an offloaded optimizer's overlapped pass still runs (its worker lagging)."""
    torch.manual_seed(0)
    model = zerocore.shard([nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Linear(16, 2)],
                           offload=offload)
    lag = (lambda index: time.sleep(0.2)) if after == "in-flight" else None
    opt = zerocore.optim.AdamW(model.parameters(), lr=1e-3, pass_hook=lag)
    loss = model(torch.randn(3, 8)).square().mean()
    if after != "forward":
        loss.backward()
        opt.step()
        if after == "in-flight":
            assert opt.pass_in_flight
        else:
            opt.settle()  # (the store's threads have run: they are looked for)
    return dict(model=model, sharding=model, runtime=model.runtime, optimizer=opt,
                store=model.ctx.store, kept=loss if after == "kept-loss" else None)


def _shard_model_door(offload: zerocore.Offload, after: str,
                      workdir: str) -> dict[str, object]:
    model = build("neox", seed=0)
    sharded = zerocore.shard_model(model, decoder_layers(model), offload=offload)
    opt = zerocore.optim.AdamW(sharded.parameters(), lr=1e-3)
    tokens = batch(0, 2)
    if after == "training":
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.settle()  # (the store's threads have run: they are looked for)
    else:
        model.eval()
        model.generate(input_ids=tokens[:, :4], max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    return dict(model=model, sharding=sharded, runtime=sharded.runtime, optimizer=opt,
                store=sharded.ctx.store, kept=None)


def _trainer_door(offload: zerocore.Offload, after: str, workdir: str) -> dict[str, object]:
    """``ShardedTrainer`` (shard_model's door under transformers' Trainer): two steps, its
    output directory in ``workdir``."""
    import transformers  # (as tests/hf do: the ranks import it only here)

    from zerocore.hf_trainer import ShardedTrainer
    # What torchrun sets, for accelerate (the process group exists already: the World's).
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()),
                      LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    model = build("neox", seed=0)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(workdir, "trainer"), per_device_train_batch_size=2,
        max_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0)
    rows = [{"input_ids": r, "labels": r} for r in batch(0, 8)]
    trainer = ShardedTrainer(model=model, args=args, train_dataset=rows,
                             data_collator=transformers.default_data_collator,
                             shard_options=dict(offload=offload))
    trainer.train()
    return dict(model=model, sharding=trainer.sharding, runtime=trainer.sharding.runtime,
                optimizer=trainer.optimizer, store=trainer.sharding.ctx.store, trainer=trainer,
                kept=None)


DOORS = {"shard": _shard_door, "shard_model": _shard_model_door, "trainer": _trainer_door}


def dropped_run(rank: int, world_size: int, door: str, home: str, after: str,
                path: str) -> dict:
    """Builds, trains (or generates), drops and collects; what of the model is left."""
    scratch = os.path.join(path, f"rank{rank}")
    os.makedirs(scratch, exist_ok=True)
    before = _engine_threads()
    objects = DOORS[door](_offload(home, scratch), after, os.path.join(path, f"work{rank}"))
    kept = objects.pop("kept")  # (held until the end)
    refs = {name: weakref.ref(obj) for name, obj in objects.items() if obj is not None}
    during = _engine_threads() - before
    open_during = _open_under(scratch)
    del objects
    gc.collect()
    # Dropping waits for nothing (a finalizer never joins a thread: engine/optimizer_pass.py's
    # ``_shut_down``): each pool's thread ends by itself, after its work in flight (a pass, a
    # read ahead), and what that work held goes with it.
    # (Those started after ``during`` was taken too, even after the collection: a pass in
    # flight's reads.)
    deadline = time.monotonic() + 30.0
    while (alive := _engine_threads() - before) and time.monotonic() < deadline:
        for t in alive:
            try:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            except RuntimeError:
                # threading.enumerate() lists a thread from the moment another thread calls
                # its start(), before the thread has begun: join() refuses it then (a read
                # ahead started by a pass in flight, seen as it starts). Look again shortly.
                time.sleep(0.01)
    left = sorted(name for name, ref in refs.items() if ref() is not None)
    return dict(tracked=sorted(refs), left=left,
                threads_during=sorted(t.name for t in during),
                threads_left=sorted(t.name for t in _engine_threads() - before),
                open_during=len(open_during), open_left=_open_under(scratch),
                files_left=os.listdir(scratch), kept=kept is not None)


def _check(result: dict, home: str, after: str, peers: bool = False) -> None:
    assert result["left"] == [], f"still alive after del and gc.collect(): {result['left']}"
    assert result["threads_left"] == [], result["threads_left"]
    assert result["open_left"] == [] and result["files_left"] == [], result
    if "nvme" in home:
        # The things looked for existed: the store and its file, and the store's two threads
        # where the optimizer stepped through it (a pool starts its thread on first use).
        assert "store" in result["tracked"] and result["open_during"] == 1, result
    # Peer reading adds the thread that answers where this rank waits (comm/peer_memory.py),
    # which must end with the model too (it kept the peer memory alive once).
    answering = ["zerocore-whereabouts"] if peers else []
    # An offloaded optimizer's pass runs on its own worker (Offload(overlap="exact"), not with
    # the parameters on NVMe), which goes with the optimizer, a pass in flight ending first.
    overlaps = HOMES[home].get("optimizer") and HOMES[home].get("params") != "nvme"
    stepping = (["zerocore-optimizer-pass_0"] if overlaps
                and after in ("training", "in-flight") else [])
    if HOMES[home].get("optimizer") == "nvme" and after == "training":
        assert result["threads_during"] == sorted(["zerocore-nvme-read_0",
                                                   "zerocore-nvme-write_0"] + stepping
                                                  + answering), result
    elif stepping:
        assert result["threads_during"] == stepping + answering, result
    elif peers:
        assert answering[0] in result["threads_during"], result


@pytest.mark.parametrize("home", list(HOMES))
@pytest.mark.parametrize("door,after", [("shard", "training"), ("shard_model", "training"),
                                        ("shard_model", "generate")])
def test_a_dropped_model_is_freed(worlds, tmp_path, door, after, home):
    (result,) = worlds(1).run(dropped_run, door, home, after, str(tmp_path))
    _check(result, home, after)


@pytest.mark.parametrize("home", ["none", "nvme-optimizer"])
def test_a_dropped_sharded_trainer_is_freed(worlds, tmp_path, home):
    """Trainer-based loops (a sweep, an evaluation) create and drop models in one process."""
    (result,) = worlds(1).run(dropped_run, "trainer", home, "training", str(tmp_path))
    _check(result, home, "training")


@pytest.mark.parametrize("home", ["cpu-optimizer", "nvme-optimizer"])
def test_a_model_dropped_while_its_optimizer_pass_runs_is_freed(worlds, tmp_path, home):
    """The pass in flight holds no shard: the optimizer's worker goes with the model, once
    the pass has ended (dropping does not wait for it), and the store with it."""
    (result,) = worlds(1).run(dropped_run, "shard", home, "in-flight", str(tmp_path))
    assert result["left"] == [], result
    assert result["threads_left"] == [] and result["open_left"] == [], result
    assert "zerocore-optimizer-pass_0" in result["threads_during"], result


@pytest.mark.parametrize("after", ["forward", "kept-loss"])
def test_a_model_whose_graph_outlives_it_is_freed(worlds, tmp_path, after):
    (result,) = worlds(1).run(dropped_run, "shard", "none", after, str(tmp_path))
    assert result["kept"] == (after == "kept-loss")
    _check(result, "none", after)


@pytest.mark.parametrize("door", ["shard", "shard_model"])
def test_a_dropped_model_is_freed_with_peers(worlds, tmp_path, door):
    for result in worlds(2).run(dropped_run, door, "nvme-optimizer", "training",
                                str(tmp_path)):
        _check(result, "nvme-optimizer", "training", peers=True)


def dropped_on_collectives(rank: int, world_size: int) -> dict:
    """A model on gloo's collectives (no peer reading), trained one step, dropped: the thread
    that answers where this rank waits, through the group's own store
    (comm/store_questions.py), and the model itself go with it."""
    before = _engine_threads()
    model = zerocore.shard([nn.Linear(16, 16) for _ in range(3)],
                           comm=zerocore.Comm(peer_read="off"))
    opt = zerocore.optim.AdamW(model.trainable_shards(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    ref = weakref.ref(model)
    during = _engine_threads() - before
    del model, opt
    gc.collect()
    for t in during:
        t.join(timeout=30.0)
    dist.barrier()  # (every rank's model is gone before the next test's)
    return dict(alive=ref() is not None, during=sorted(t.name for t in during),
                left=sorted(t.name for t in _engine_threads() - before))


def test_a_dropped_model_on_collectives_ends_its_store_thread(worlds):
    for result in worlds(2).run(dropped_on_collectives):
        assert result["during"] == ["zerocore-whereabouts-store"], result
        assert not result["alive"] and result["left"] == [], result


# A model dropped where the collector may run inside ``threading``'s own bookkeeping: CPython
# 3.11's ``Thread.start`` collects while it holds the lock that a thread's end takes (its
# ``_shutdown_locks_lock``), so a finalizer that joins a thread there never returns. That hung
# the test suite once in a while (a new pool thread's start collected an old NVMe store; the
# optimizer's pass, which had asked for the thread, waited for ever). Here the collection runs
# under that lock on purpose, in a process of its own (a hang would wedge it).
DROP_UNDER_THREADINGS_LOCK = """
import gc, os, sys, tempfile, threading
import torch
from torch import nn
import zerocore
from zerocore.tools import hold_rendezvous, join_rendezvous

store = hold_rendezvous(timeout_s=60)
join_rendezvous(store.port, 0, 1, "gloo", 60)
where = {"path": tempfile.mkdtemp()} if sys.argv[1] == "nvme" else {}
model = zerocore.shard([nn.Linear(8, 8), nn.Linear(8, 2)],
                       offload=zerocore.Offload(optimizer=sys.argv[1], **where))
opt = zerocore.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(3, 8)).square().mean().backward()
opt.step()
opt.settle()  # the pass's worker and the store's threads have run
del model, opt

def collect():
    with threading._shutdown_locks_lock:
        gc.collect()

t = threading.Thread(target=collect, daemon=True)
t.start()
t.join(20)
print("hung" if t.is_alive() else "collected", flush=True)
os._exit(0)  # (a hung collection holds the lock that the interpreter's exit takes)
"""


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"),
                    reason="this Python's threading has no such lock (CPython 3.12 and earlier "
                           "have it)")
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_a_model_collected_inside_threadings_bookkeeping_does_not_hang(optimizer):
    """No finalizer of the engine waits for a thread (the pass's worker; with NVMe the store's
    readers and writers too): each fails this test when it joins its threads."""
    proc = subprocess.run([sys.executable, "-c", DROP_UNDER_THREADINGS_LOCK, optimizer],
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "collected", proc.stdout + proc.stderr[-3000:]
