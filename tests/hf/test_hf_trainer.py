"""``zerocore.hf_trainer.ShardedTrainer``: transformers' ``Trainer`` on a sharded model, on gloo
ranks at world sizes 1, 2 and 3, against the same ``Trainer`` run unsharded in this process.

Both train a tiny seeded GPT-NeoX (in full, or with PEFT LoRA) on the same rows: the global
batch is the same (6 rows: 6, 3 or 2 per rank), with gradient accumulation (2 micro-batches),
clipping that acts (``max_grad_norm`` below the gradients' norm), weight decay with
``Trainer``'s default groups (no decay on biases and norms), a linear learning-rate schedule, and
``Trainer``'s own data order. The logged losses and gradient norms, and the trained weights,
must agree (the norms' weights start at 1, so decaying them, as a rule other than Trainer's
would, moves them by lr·wd each step: 500 times the tolerance); so must a run resumed from a
``Trainer`` checkpoint at 2 → 3 processes with the uninterrupted run. The exports load with
PEFT / ``from_pretrained`` and hold the trained weights.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zerocore
from tests.support.environ import environment
from tests.support.quantized_base import FORMATS, dequantized

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORLD_SIZES = [1, 2, 3]
GLOBAL_ROWS = 6  # rows per micro-batch over all ranks: 6, 3 or 2 per rank
ROWS, SEQ, VOCAB = 48, 16, 64  # 48 rows: 4 steps of 2 micro-batches of 6 is one epoch
EVAL_ROWS = 12  # evaluated 2 per batch per rank: the same rows at every world size
LR = 1e-2
# The tolerances of tests/hf/test_shard_model.py, for its reasons (commented there): the same
# fp32 operations in another order (per-rank means averaged, the fused kernel's rounding).
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
PARAM_TOL = dict(rtol=1e-5, atol=2e-3 * LR)
# Adam's eps (see test_shard_model.py's EPS: 1e-8 turns a nearly cancelling gradient's rounding
# noise into full-lr moves, on either side).
EPS = 1e-6
# The clipping thresholds: below the gradients' norms (measured 0.6-1.1 in full training,
# 0.10-0.12 for LoRA, at these settings), so every step is clipped and a norm computed over one
# rank's shards only would show.
MAX_GRAD_NORM = {"full": 0.5, "lora": 0.05, "lora-mts": 0.5}


@dataclasses.dataclass(frozen=True)
class Spec:
    mode: str = "full"        # "full", "lora", or "lora-mts" (LoRA and modules_to_save)
    steps: int = 4
    save_steps: int = 0       # 0: no checkpoints
    resume: bool = False      # resume from the checkpoint at step save_steps in out/
    checkpointing: bool = False  # TrainingArguments(activation_checkpointing=True), both
    fp16: bool = False        # TrainingArguments(fp16=True): zerocore's fp16 and loss scaling
    overflow: tuple[int, int] | None = None  # (rank, step): an inf gradient there
    # shard_options' Offload(params=, optimizer=) (with optimizer "nvme": a scratch directory
    # beside the output)
    offload: tuple[bool | str, bool | str] | None = None
    overlap: str = "exact"    # the offloaded optimizer's pass (Offload.overlap)
    # HSDP 2x2 (4 ranks as 2 nodes of 2): "given", shard_options' mesh; "torchrun",
    # hybrid="hsdp" with the mesh of torchrun's environment (set by the run).
    mesh: str | None = None
    hybrid: str = "hsdp"      # the layout of mesh="torchrun" (ShardedTrainer's hybrid=)
    rows: int = GLOBAL_ROWS   # rows per micro-batch over all ranks
    clip: float | None = None  # max_grad_norm; None: MAX_GRAD_NORM[mode]
    # shard_options' FrozenWeights(dtype, placement=...) (quantized_base's block), the
    # reference's frozen weights quantized and dequantized alike
    frozen: tuple[str, str] | None = None


def _model(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=False)
    model = transformers.GPTNeoXForCausalLM(config)
    if mode in ("lora", "lora-mts"):
        # lora-mts: PEFT also trains (and saves) its own copy of the readout, lm_head.
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query_key_value", "dense"],
            modules_to_save=["lm_head"] if mode == "lora-mts" else None))
    return model


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out: str, world_size: int, spec: Spec) -> "transformers.TrainingArguments":
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=spec.rows // world_size,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=spec.steps, learning_rate=LR,
        weight_decay=0.1, adam_epsilon=EPS, max_grad_norm=spec.clip or MAX_GRAD_NORM[spec.mode],
        lr_scheduler_type="linear", warmup_steps=0, logging_steps=1,
        save_strategy="steps" if spec.save_steps else "no", save_steps=spec.save_steps or 500,
        activation_checkpointing=spec.checkpointing, fp16=spec.fp16,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)


def _history(trainer) -> tuple[list[float], list[float]]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [float(h["grad_norm"]) for h in logs]


def _trained(named: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    keep = {"lora": lambda n: "lora_" in n,
            "lora-mts": lambda n: "lora_" in n or ".modules_to_save." in n}.get(
                mode, lambda n: True)
    return {n: t.detach().float().clone() for n, t in named.items() if keep(n)}


def reference(out: str, spec: Spec) -> dict:
    """The plain Trainer, unsharded, in this process."""
    model = _model(spec.mode)
    if spec.frozen is not None:
        model = dequantized(model, spec.frozen[0], FORMATS[spec.frozen[0]])
    trainer = transformers.Trainer(model=model, args=_args(out, 1, spec), train_dataset=_data(),
                                   eval_dataset=_data()[:EVAL_ROWS],
                                   data_collator=transformers.default_data_collator)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    losses, norms = _history(trainer)
    return dict(losses=losses, norms=norms, evals=[before, trainer.evaluate()["eval_loss"]],
                params=_trained(dict(model.named_parameters()), spec.mode))


def sharded_run(rank: int, world_size: int, out: str, spec: Spec) -> dict:
    # What torchrun sets, for accelerate (the process group exists already: the harness's).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if spec.mesh == "torchrun":  # as two nodes of two (hsdp_run restores these)
        # (accelerate asks for MASTER_ADDR on several nodes, though the group exists.)
        os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                          GROUP_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1")
    from zerocore.hf_trainer import ShardedTrainer

    class Overflowing(ShardedTrainer):
        """Makes a gradient inf on one rank in one step, after its first micro-batch."""

        def training_step(self, *args, **kwargs):
            before = self.sharding.counter.replica_all_reduce_calls
            loss = super().training_step(*args, **kwargs)
            replica_calls.append((self.accelerator.sync_gradients,
                                  self.sharding.counter.replica_all_reduce_calls - before))
            if spec.overflow == (rank, self.state.global_step):
                self.sharding.trainable_shards()[0].grad[0] = float("inf")
            return loss

    model = _model(spec.mode)
    forwards = []  # the micro-batches this process trains on
    model.register_forward_pre_hook(lambda m, a: forwards.append(1) if m.training else None)
    options = None
    if spec.offload is not None:
        params, optimizer = spec.offload
        path = None
        if optimizer == "nvme":
            path = f"{out}-scratch"
            os.makedirs(path, exist_ok=True)
        options = dict(offload=zerocore.Offload(params=params, optimizer=optimizer, path=path,
                                                pool_bytes=1 << 20, overlap=spec.overlap))
    replica_calls: list[tuple[bool, int]] = []  # (sync_gradients, all-reduces) per micro-batch
    if spec.mesh == "given":
        options = dict(mesh=init_device_mesh("cpu", (2, world_size // 2),
                                             mesh_dim_names=("replicate", "shard")))
    if spec.frozen is not None:
        dtype, placement = spec.frozen
        options = dict(frozen_weights=zerocore.FrozenWeights(dtype, block=FORMATS[dtype],
                                                             placement=placement))
    trainer = Overflowing(model=model, args=_args(out, world_size, spec),
                          train_dataset=_data(), eval_dataset=_data()[:EVAL_ROWS],
                          data_collator=transformers.default_data_collator,
                          shard_options=options,
                          hybrid=spec.hybrid if spec.mesh == "torchrun" else None)
    skipped = []

    class Record(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            skipped.append(trainer.accelerator.optimizer_step_was_skipped)
    trainer.add_callback(Record())
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=(f"{out}/checkpoint-{spec.save_steps}"
                                          if spec.resume else None))
    after = trainer.evaluate()["eval_loss"]
    losses, norms = _history(trainer)
    full = trainer.sharding.full_state_dict(trainable_only=spec.mode != "full", to_rank=0)
    trainer.save_model(f"{out}/export")
    adam_steps = {int(st["step"]) for st in trainer.zerocore_optimizer.state.values()}
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    report = trainer.sharding.memory_report()
    return dict(losses=losses, norms=norms, forwards=len(forwards), evals=[before, after],
                replica_calls=replica_calls, replicas_agree=trainer.sharding.replicas_agree(),
                shards=[t.detach().clone() for t in trainer.sharding.trainable_shards()],
                place=trainer.sharding.rank, ways=trainer.sharding.ways.line(),
                trainable_units=sum(1 for u in trainer.sharding.layers
                                    if u.trainable is not None),
                host_arena=report.host_arena_bytes, on_device=report.device_shard_bytes,
                skipped=skipped, adam_steps=adam_steps, lrs=lrs,
                loss_scale=trainer.loss_scaler.loss_scale,
                published=[getattr(s, "published", None) is not None
                           for s in trainer.sharding.trainable_shards()],
                params=_trained(full, spec.mode) if rank == 0 else {})


def _assert_close_params(mine: dict, ref: dict) -> None:
    assert mine.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], **PARAM_TOL, msg=name)


def test_offload_through_shard_options_trains_bitwise_as_without(world, tmp_path):
    # Parameter offload (alone: the optimizer on the device; and with the optimizer) through
    # shard_options: the same bits as the run without offload, losses, norms, evaluations
    # and trained weights (the frozen base weights then live on the host).
    # With the optimizer on NVMe (and the parameters on the host): the same again.
    runs = {offload: world.run(sharded_run, str(tmp_path / str(offload)),
                               Spec(mode="lora", offload=offload), timeout=300)
            for offload in (None, (True, False), (True, True), (True, "nvme"))}
    for offload in ((True, False), (True, True), (True, "nvme")):
        for plain, got in zip(runs[None], runs[offload]):
            for key in ("losses", "norms", "evals", "skipped"):
                assert got[key] == plain[key], (offload, key)
            assert got["params"].keys() == plain["params"].keys()
            for n, t in plain["params"].items():
                assert torch.equal(got["params"][n], t), (offload, n)
            # The shards were on the host: with the optimizer there too none is left on the
            # device; alone, only the LoRA weights' fp32 masters (the optimizer's, computed
            # with in fp32).
            assert got["host_arena"] > 0 == plain["host_arena"]
            assert (got["on_device"] == 0) if offload[1] else (
                0 < got["on_device"] < plain["on_device"]), (offload, got["on_device"])


def test_a_delayed_pass_through_shard_options(world, tmp_path):
    # Offload(optimizer=True, overlap="delayed") through shard_options: every trainable shard
    # is gathered from its published copy; the first optimizer step's loss is the exact run's
    # (both on the initial weights), the second's is not (the delayed run still computes with
    # them, the exact one with the first update's), and the run trains. The delayed rule
    # itself is tests/engine/test_delayed_pass.py's.
    runs = {overlap: world.run(sharded_run, str(tmp_path / overlap),
                               Spec(offload=(False, True), overlap=overlap), timeout=300)
            for overlap in ("exact", "delayed")}
    for exact, delayed in zip(runs["exact"], runs["delayed"]):
        assert delayed["published"] and all(delayed["published"]), delayed["published"]
        assert not any(exact["published"])
        assert delayed["losses"][0] == exact["losses"][0]
        assert delayed["losses"][1] != exact["losses"][1]
        assert delayed["evals"][1] < delayed["evals"][0]


TRAINER_CASES = {"full": ("full", False, None), "lora": ("lora", False, None),
                 "lora-checkpointing": ("lora", True, None),
                 "lora-checkpointing-nf4-replicated": ("lora", True, ("nf4", "replicated")),
                 "lora-fp8-sharded": ("lora", False, ("fp8", "sharded"))}


# The base cases (full, lora) at 1, 2 and 3 ranks; checkpointing and the quantized bases at 3
# only (uneven shards: the stricter): their paths do not depend on the count, which the base
# cases cover at 1, 2 and 3 (CI time).
@pytest.mark.parametrize("size,mode,checkpointing,frozen", [
    pytest.param(size, *TRAINER_CASES[name], id=f"ws{size}-{name}")
    for size in WORLD_SIZES for name in TRAINER_CASES
    if size == 3 or name in ("full", "lora")])
def test_trainer_matches_unsharded_trainer(worlds, tmp_path, size, mode, checkpointing, frozen):
    # With a quantized base (shard_options' frozen_weights), the unsharded Trainer's model is
    # given the same dequantized frozen weights: the same tolerances, for the same reasons.
    spec = Spec(mode=mode, checkpointing=checkpointing, frozen=frozen)
    ref = reference(str(tmp_path / "ref"), spec)
    results = worlds(size).run(sharded_run, str(tmp_path / "sharded"), spec, timeout=300)
    assert len(ref["losses"]) == spec.steps
    for r in results:  # every rank logs the same (the losses are averaged over ranks)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   **LOSS_TOL)
    # The global norm, before clipping: a norm over one rank's shards would be ~1/sqrt(N) of it.
    norms = torch.tensor(ref["norms"])
    assert bool((norms > MAX_GRAD_NORM[mode]).all()), norms  # clipping acted on every step
    torch.testing.assert_close(torch.tensor(results[0]["norms"]), norms, rtol=1e-4, atol=0.0)
    _assert_close_params(results[0]["params"], ref["params"])
    for r in results:  # evaluate() before and after training, every rank the same
        torch.testing.assert_close(torch.tensor(r["evals"]), torch.tensor(ref["evals"]),
                                   **LOSS_TOL)
    # The export: what Trainer.save_model writes, loadable as users load it.
    export = tmp_path / "sharded" / "export"
    if mode == "lora":
        base = _model("full")  # the export holds the adapters alone, never a quantized base
        loaded = peft.PeftModel.from_pretrained(base, export)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    names = {n.replace(".default", ""): p for n, p in loaded.named_parameters()}
    for n, t in ref["params"].items():
        torch.testing.assert_close(names[n.replace(".default", "")].float(), t, **PARAM_TOL,
                                   msg=n)


def test_modules_to_save_reload_equal_through_save_model_and_checkpoints(worlds, tmp_path):
    """PEFT's modules_to_save (a trained copy of lm_head beside the LoRA adapters): the adapter
    save_model writes, and the one in checkpoint-N/, reload with PeftModel.from_pretrained and
    hold the trained copy, as plain Trainer's do (its checkpoint is reloaded the same way)."""
    spec = Spec(mode="lora-mts", save_steps=4)
    ref = reference(str(tmp_path / "ref"), spec)
    results = worlds(2).run(sharded_run, str(tmp_path / "sharded"), spec, timeout=300)
    assert "base_model.model.lm_head.modules_to_save.default.weight" in ref["params"]
    _assert_close_params(results[0]["params"], ref["params"])
    for adapter in (tmp_path / "ref" / "checkpoint-4", tmp_path / "sharded" / "checkpoint-4",
                    tmp_path / "sharded" / "export"):
        loaded = dict(peft.PeftModel.from_pretrained(_model("full"), adapter).named_parameters())
        for name, want in ref["params"].items():
            torch.testing.assert_close(loaded[name].float(), want, **PARAM_TOL,
                                       msg=f"{adapter.name}: {name}")


def test_resume_at_another_number_of_processes(worlds, tmp_path):
    """Checkpoint at step 2 with 2 processes, resume with 3: the same losses and weights as
    the unsharded run through all 4 steps (no micro-batch seen twice or skipped)."""
    out = str(tmp_path / "run")
    spec = Spec(mode="full", save_steps=2)
    ref = reference(str(tmp_path / "ref"), Spec(mode="full"))
    first = worlds(2).run(sharded_run, out, spec, timeout=300)
    assert (tmp_path / "run" / "checkpoint-2" / "zerocore").is_dir()
    torch.testing.assert_close(torch.tensor(first[0]["losses"]), torch.tensor(ref["losses"]),
                               **LOSS_TOL)
    resumed = worlds(3).run(sharded_run, out, dataclasses.replace(spec, resume=True),
                            timeout=300)
    # It trained steps 3-4 only (2 micro-batches each); its history holds steps 1-2 from the
    # checkpoint's trainer_state.json, then its own.
    assert [r["forwards"] for r in first] == [8, 8]
    assert [r["forwards"] for r in resumed] == [4, 4, 4]
    for r in resumed:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   **LOSS_TOL)
    _assert_close_params(resumed[0]["params"], ref["params"])


def hsdp_run(rank: int, world_size: int, out: str, spec: Spec) -> dict:
    """``sharded_run`` of an HSDP spec, torchrun's variables restored after (these processes
    serve other tests, and zerocore.shard reads the nodes from them)."""
    with environment({}, also=("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")):
        return sharded_run(rank, world_size, out, spec)


@pytest.mark.parametrize("mode, mesh", [("full", "torchrun"), ("lora", "given")])
def test_hsdp_trains_as_the_unsharded_trainer_and_its_replicas_agree(worlds, tmp_path, mode,
                                                                     mesh):
    """HSDP 2x2: 4 ranks as 2 nodes of 2, the mesh from torchrun's environment (hybrid="hsdp")
    or given in shard_options. Trainer's losses, norms, evaluations and trained weights as the
    unsharded Trainer's, on the same global batches (8 rows: 2 per rank), to the flat tests'
    tolerances (the sums run in another order again: within the node, then across it); the
    replicas' shards bitwise equal; the replicas' all-reduce only with the backward of each
    step's last micro-batch, once per trainable unit."""
    # Clipping below every step's norm (full training's: 0.91, 0.50, 0.49 on these batches).
    spec = Spec(mode=mode, steps=3, rows=8, mesh=mesh, clip={"full": 0.4}.get(mode))
    ref = reference(str(tmp_path / "ref"), spec)
    got = worlds(4).run(hsdp_run, str(tmp_path / "hsdp"), spec, timeout=300)
    assert len(ref["losses"]) == spec.steps
    for r in got:
        assert "layout: HSDP 2x2" in r["ways"], r["ways"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   **LOSS_TOL)
        torch.testing.assert_close(torch.tensor(r["evals"]), torch.tensor(ref["evals"]),
                                   **LOSS_TOL)
        # Two micro-batches a step: (not the last, none), (the last, one per trainable unit).
        units = r["trainable_units"]
        assert units > 0 and r["replica_calls"] == [(False, 0), (True, units)] * spec.steps
        assert r["replicas_agree"]
    norms = torch.tensor(ref["norms"])
    assert bool((norms > (spec.clip or MAX_GRAD_NORM[mode])).all()), norms
    torch.testing.assert_close(torch.tensor(got[0]["norms"]), norms, rtol=1e-4, atol=0.0)
    _assert_close_params(got[0]["params"], ref["params"])
    for rank, r in enumerate(got):  # ranks at one place of the shard dim: the same bits
        assert r["place"] == rank % 2
        twin = got[rank % 2]["shards"]
        assert len(r["shards"]) == len(twin) > 0
        assert all(torch.equal(a, b) for a, b in zip(r["shards"], twin)), rank


def test_hpz_trains_as_the_unsharded_trainer(worlds, tmp_path):
    """ShardedTrainer(hybrid="hpz") on 4 ranks as 2 nodes of 2 (the mesh from torchrun's
    environment): as the unsharded Trainer to the HSDP test's tolerances; every rank holds its
    own slice of the state (s·R + r: four places), and there is no replicas' all-reduce."""
    spec = Spec(mode="full", steps=3, rows=8, mesh="torchrun", hybrid="hpz", clip=0.4)
    ref = reference(str(tmp_path / "ref"), spec)
    got = worlds(4).run(hsdp_run, str(tmp_path / "hpz"), spec, timeout=300)
    for r in got:
        assert "layout: hpZ 2x2" in r["ways"], r["ways"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   **LOSS_TOL)
        torch.testing.assert_close(torch.tensor(r["evals"]), torch.tensor(ref["evals"]),
                                   **LOSS_TOL)
        assert all(calls == 0 for _, calls in r["replica_calls"]), r["replica_calls"]
    torch.testing.assert_close(torch.tensor(got[0]["norms"]), torch.tensor(ref["norms"]),
                               rtol=1e-4, atol=0.0)
    _assert_close_params(got[0]["params"], ref["params"])
    # Rank (r, s) = (rank // 2, rank % 2) holds slice s·2 + r.
    assert [r["place"] for r in got] == [0, 2, 1, 3]


def hybrid_refused(rank: int, world_size: int, out: str) -> str:
    """ShardedTrainer(hybrid="hsdp") with torchrun's environment of one node (the harness's)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    from zerocore.hf_trainer import ShardedTrainer
    with environment(dict(GROUP_RANK="0")):
        try:
            ShardedTrainer(model=_model("full"), args=_args(out, world_size, Spec()),
                           train_dataset=_data(), hybrid="hsdp")
        except ValueError as e:
            return str(e)
    return "built"


def test_hybrid_on_one_node_is_refused_on_every_rank(worlds, tmp_path):
    for m in worlds(2).run(hybrid_refused, str(tmp_path)):
        assert m == ("ShardedTrainer(hybrid='hsdp'): hybrid sharding replicates across nodes, "
                     "and torchrun started one node (2 ranks): run with --nnodes 2 or more, or "
                     "shard flat"), m


def differing_setup(rank: int, world_size: int, out: str, what: str) -> str:
    """Rank 1 alone given another learning rate, or another prefetch in shard_options."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    from zerocore.hf_trainer import ShardedTrainer
    args, options = _args(out, world_size, Spec()), {}
    if rank == 1 and what == "learning_rate":
        args.learning_rate = 2 * LR
    if rank == 1 and what == "shard_options":
        options = dict(prefetch=zerocore.Prefetch(keep_gathered="all"))
    try:
        ShardedTrainer(model=_model("full"), args=args, train_dataset=_data(),
                       shard_options=options)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "built"


DIFFERING = {
    "learning_rate": ("TrainingArguments.learning_rate", str(LR), str(2 * LR)),
    "shard_options": ("shard_options['prefetch']", "(not given)",
                      repr(zerocore.Prefetch(keep_gathered="all"))),
}


@pytest.mark.parametrize("what", sorted(DIFFERING))
def test_arguments_differing_between_ranks_are_refused_on_every_rank(worlds, tmp_path, what):
    """Each rank builds its own arguments: one rank's that differ are refused on every rank
    before anything is sharded, naming that field alone, with each rank's value."""
    name, mine, theirs = DIFFERING[what]
    for n in (2, 3):
        others = "rank 0" if n == 2 else "ranks 0, 2"
        assert worlds(n).run(differing_setup, str(tmp_path), what) == [
            f"ValuesDiffer: ShardedTrainer: {name} differs across ranks: {others}: {mine}; "
            f"rank 1: {theirs}; every rank must be given the same TrainingArguments, "
            f"shard_options and hybrid"] * n


REFUSED = {  # TrainingArguments / Trainer arguments ShardedTrainer refuses, and the message's key
    "optimizers": ({}, {"optimizers": "sgd"}, "optimizers="),
    "scheduler only": ({}, {"optimizers": "scheduler"}, "create_scheduler"),
    "model_init": ({}, {"model_init": lambda: None}, "model_init"),
    "optim": ({"optim": "adafactor"}, {}, "optim=adafactor"),
    "full eval": ({"bf16_full_eval": True}, {}, "bf16_full_eval"),
    "save_on_each_node": ({"save_on_each_node": True}, {}, "save_on_each_node"),
    "best without state": ({"save_only_model": True, "load_best_model_at_end": True,
                            "eval_strategy": "steps", "save_strategy": "steps"}, {},
                           "save_only_model"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals(tmp_path, case):
    """Each in one line, before anything is sharded (so in this process, with no group)."""
    from zerocore.hf_trainer import ShardedTrainer
    arg_kw, trainer_kw, key = REFUSED[case]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          **arg_kw)
    model = _model("full")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    given = {"sgd": (opt, None),
             "scheduler": (None, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))}
    trainer_kw = {k: given.get(v, v) if isinstance(v, str) else v for k, v in trainer_kw.items()}
    with pytest.raises(ValueError, match=key) as e:
        ShardedTrainer(model=model, args=args, **trainer_kw)
    assert str(e.value).startswith("ShardedTrainer: ") and "\n" not in str(e.value)


# fp16 against the fp32 reference: the fp16 parameters and activations round each product to
# 11 bits, the loss a little; measured at most 2.0e-5 relative over the 4 steps at ws1-3. 2e-4
# holds with margin, while one step lost or taken at the wrong scale changes the next losses by
# the step's effect, 1e-3 to 6e-3 relative here.
FP16_LOSS_TOL = dict(rtol=2e-4, atol=0.0)


def test_fp16_with_loss_scaling(world, tmp_path):
    """fp16=True: zerocore's fp16 with dynamic loss scaling trains as the fp32 reference does,
    within fp16's precision; an inf gradient on the last rank in step 2 skips that step on every
    rank (Adam stepped 3 times, not 4; the scheduler held its learning rate)."""
    ref = reference(str(tmp_path / "ref"), Spec())
    clean = world.run(sharded_run, str(tmp_path / "clean"), Spec(fp16=True), timeout=300)
    for r in clean:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   **FP16_LOSS_TOL)
        assert r["skipped"] == [False] * 4 and r["adam_steps"] == {4}
    spec = Spec(fp16=True, overflow=(world.world_size - 1, 1))
    hit = world.run(sharded_run, str(tmp_path / "hit"), spec, timeout=300)
    for r in hit:
        assert r["skipped"] == [False, True, False, False], r["skipped"]
        assert r["adam_steps"] == {3}
        assert r["lrs"][1] == r["lrs"][2] == clean[0]["lrs"][1]  # the schedule did not move
        assert r["loss_scale"] == clean[0]["loss_scale"]  # one overflow: hysteresis, no halving
    # Up to the injected step the runs are the same, bit for bit.
    torch.testing.assert_close(torch.tensor(hit[0]["losses"][:2]),
                               torch.tensor(clean[0]["losses"][:2]), rtol=0.0, atol=0.0)


def _sft(out: str, world_size: int, sharded: bool) -> list[float]:
    """TRL's SFTTrainer on pre-tokenized rows, plain or with ShardedTrainer mixed in first."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    # SFTTrainer wants a tokenizer even for token ids: a word-level one over the vocabulary.
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                    unk_token="t0")),
        pad_token="t0", eos_token="t1")
    if sharded:
        from zerocore.hf_trainer import ShardedTrainer

        class ShardedSFTTrainer(ShardedTrainer, trl.SFTTrainer):
            pass
        cls = ShardedSFTTrainer
    else:
        cls = trl.SFTTrainer
    rows = datasets.Dataset.from_list([{"input_ids": d["input_ids"].tolist()} for d in _data()])
    config = trl.SFTConfig(output_dir=out, per_device_train_batch_size=GLOBAL_ROWS // world_size,
                           gradient_accumulation_steps=2, max_steps=3, learning_rate=LR,
                           adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM["full"], seed=0,
                           logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True,
                           # SFTConfig's defaults would be bf16 (autocast unsharded, bf16
                           # parameters sharded: close, not equal); its gradient checkpointing
                           # (on by default) stays.
                           bf16=False)
    trainer = cls(model=_model("full"), args=config, train_dataset=rows,
                  processing_class=tokenizer)
    trainer.train()
    return _history(trainer)[0]


def sft_run(rank: int, world_size: int, out: str) -> list[float]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    return _sft(out, world_size, sharded=True)


def test_trl_sft_trainer(world, tmp_path):
    """TRL's SFTTrainer with ShardedTrainer mixed in (``class ShardedSFTTrainer(ShardedTrainer,
    SFTTrainer)``) trains as the plain SFTTrainer does unsharded (its own loss and data
    handling)."""
    ref = _sft(str(tmp_path / "ref"), 1, sharded=False)
    for losses in world.run(sft_run, str(tmp_path / "sharded"), timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), **LOSS_TOL)


def best_model_run(rank: int, world_size: int, out: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    from zerocore.hf_trainer import ShardedTrainer
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_ROWS // world_size,
        per_device_eval_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=0.05, adam_epsilon=EPS, eval_strategy="steps", eval_steps=1,
        save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        # The best by the highest eval loss: step 2's here, so that the best is not the last.
        metric_for_best_model="eval_loss", greater_is_better=True,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1)
    trainer = ShardedTrainer(model=_model("full"), args=args, train_dataset=_data(),
                             eval_dataset=_data()[:EVAL_ROWS],
                             data_collator=transformers.default_data_collator)
    trainer.train()
    full = trainer.sharding.full_state_dict(to_rank=0)
    return dict(best=trainer.state.best_model_checkpoint, params=_trained(full, "full"))


def test_load_best_model_at_end(worlds, tmp_path):
    """load_best_model_at_end=True ends with the best checkpoint's weights, every one of them
    (transformers 5.24's own Trainer leaves GPT-NeoX's lm_head at the last step's: its files
    name it embed_out), at 2 processes."""
    from safetensors.torch import load_file
    out = tmp_path / "run"
    result = worlds(2).run(best_model_run, str(out), timeout=300)[0]
    assert result["best"] == str(out / "checkpoint-2")

    def saved(step):  # what ShardedTrainer exported into the checkpoint, under model names
        return {n.replace("embed_out", "lm_head"): t
                for n, t in load_file(out / f"checkpoint-{step}" / "model.safetensors").items()}
    best, last = saved(2), saved(4)
    # The export is fp32 from the masters, as the weights are: equal but for the load's copy.
    for n, t in result["params"].items():
        torch.testing.assert_close(t, best[n], rtol=0.0, atol=0.0, msg=n)
    assert any(not torch.equal(t, last[n]) for n, t in result["params"].items())
