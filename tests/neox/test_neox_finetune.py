"""GPT-NeoX fine-tuning: the sharded training of each mode against unsharded training, and
``python -m neox.finetune`` end to end (results, export, errors).

Three parts:
- Parity (in process, 2 gloo ranks kept alive by ``dist_utils.World``): the same small random
  model is prepared for a mode (``neox.finetune_modes.prepare_layer``) and trained 10 steps both
  sharded (``zerocore.shard`` + ``zerocore.optim.AdamW``, each rank on its half of the global
  batch) and unsharded (``nn.Sequential`` + ``torch.optim.AdamW`` on the whole batch). Losses
  agree, and the gathered full state shows that exactly the mode's parameters changed.
- The CLI (subprocesses, tiny preset, a small text file written here): one run on 1 rank with
  bias fine-tuning, one on 2 ranks with LoRA on a ``--filter-layers`` subset for a whole epoch.
  Each run is shared by several tests (module fixtures), because starting one costs seconds.
  The Hugging Face export is reloaded in ``transformers`` and compared with our loader and with
  the trained model rebuilt from the base weights plus ``trainable.safetensors``.
- Bad inputs: each a one-line message on stderr, a non-zero exit and no traceback.

The sampler's coverage (each training window once per epoch across ranks) is unit-tested in
test_neox_data.py (``test_one_epoch_covers_each_kept_sample_once_across_ranks``); here a real
run checks the resulting step count and epoch roll-over.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import neox
import zerocore
from tests.support.dist_utils import free_port, global_mean
from tests.support.scratch_disk import private_disk
from tests.support.neox_testing import (CLI_TIMEOUT_S, EXCERPT, assert_clean_error, call_main,
                                        run_module)
from neox.run.loop import _plus  # the loop's sum of the steps' traffic
from neox import data as nd
from neox.weights import RandomInit, iter_layer_states, iter_layers
from neox.config import PRESETS, NeoXConfig
from neox.commands.finetune import build_parser
from neox.finetune import main as finetune_main
from neox.finetune_modes import BIAS_NAMES, FinetuneMode, prepare_layer
from zerocore.consolidate import iter_full_layers

WORLD_SIZES = [2]  # the parity tests' ranks (tests/conftest.py's `world`)
REPO = Path(__file__).resolve().parents[2]

# -- parity: sharded vs unsharded training -------------------------------------------------------

# Odd sizes (vocab 67, hidden 24, head size 8 with 2 rotary dims, MLP 40) so that every flat
# group of the 2-rank layout is padded.
PARITY_CONFIG = NeoXConfig(vocab_size=67, hidden_size=24, num_hidden_layers=2,
                           num_attention_heads=3, intermediate_size=40,
                           max_position_embeddings=32)
SEQ_LEN = 12
LOCAL_BATCH = 3   # sequences per rank; the unsharded reference trains on WORLD * LOCAL_BATCH
STEPS = 10
LR = 1e-2
WEIGHT_DECAY = 0.1  # every trained tensor then changes, even rows without gradient
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets=("query_key_value", "attention.dense"))

# fp32 throughout. Sharded and unsharded run the same float32 operations in a different order:
# the gradient of the global mean is an average of two per-rank means where the reference takes
# one mean, matmuls over fewer rows accumulate differently, and the fused Adam kernel rounds its
# moments differently from torch's. Losses then differ by a few ulps (measured here: <= 2e-7
# relative over 10 steps); 1e-5 relative is ample, while a real bug (a gradient not averaged
# over ranks, a layer left out, a wrong parameter trained) moves the loss far more.
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
# Parameters, in units of the learning rate: Adam's step is ~lr whatever the gradient's size,
# so ulps of gradient noise on an element whose gradient nearly cancels become a visible
# fraction of lr. Measured: <= 4e-5·lr (a full-mode qkv weight); 1e-3·lr leaves a 25x margin,
# while a missing update (~lr), a missing decay (lr·wd·|p| = 2e-2·lr per step on a weight of
# 0.2) or a wrong learning rate is caught.
PARAM_TOL = dict(rtol=0.0, atol=1e-3 * LR)
# One exception: the key part of the qkv bias outside the rotary dimensions. Adding a constant
# to every key shifts all scores of a query equally, which softmax ignores, so its gradient is
# exactly zero in exact arithmetic and ~1e-10 rounding noise in floats; Adam (eps 1e-8) turns
# that noise into steps of up to ~lr in directions set by the noise, which the two runs do not
# share (measured: 1.2·lr apart after 10 steps). Those elements cannot change the model's
# output; they are compared through the logits below instead of by value.
# Logits of the trained models on a batch neither trained on: measured <= 8.4e-7 on logits of
# magnitude ~3.5 (fp32 ulps accumulated over 10 steps); 1e-5 is ~10x that, and any
# parameter trained wrongly by an update of ~lr = 1e-2 moves them by far more.
LOGITS_TOL = dict(atol=1e-5, rtol=1e-5)


def key_bias_gauge(config: NeoXConfig) -> torch.Tensor:
    """Mask of the qkv-bias elements that are keys outside the rotary dimensions. The fused
    projection is laid out per head as [q | k | v], each head_dim wide."""
    hs, rd = config.head_dim, config.rotary_dim
    mask = torch.zeros(3 * config.hidden_size, dtype=torch.bool)
    for h in range(config.num_attention_heads):
        mask[h * 3 * hs + hs + rd: h * 3 * hs + 2 * hs] = True
    return mask


def _global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, PARITY_CONFIG.vocab_size, (world_size * LOCAL_BATCH, SEQ_LEN + 1),
                        generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _parity_run(rank: int, world_size: int, mode_name: str) -> dict | None:
    """On every rank: train the sharded model; on rank 0 also the unsharded reference."""
    mode = FinetuneMode(mode_name, seed=7, **LORA)
    # Weights N(0, 0.2) rather than the default 0.02, so logits and gradients are not tiny.
    base = list(iter_layers(RandomInit(PARITY_CONFIG, seed=11, std=0.2)))

    def prepared() -> list[nn.Module]:
        return [prepare_layer(copy.deepcopy(layer), i, mode) for i, layer in enumerate(base)]

    model = zerocore.shard(prepared(), device="cpu")
    optimizer = zerocore.optim.AdamW(model.trainable_shards(), lr=LR, weight_decay=WEIGHT_DECAY)
    sharded_initial = [layer.full_state() for layer in model.layers]  # collective
    if rank == 0:
        ref = nn.Sequential(*prepared())
        initial = [{n: p.detach().clone() for n, p in layer.named_parameters()} for layer in ref]
        trainable = [sorted(n for n, p in layer.named_parameters() if p.requires_grad)
                     for layer in ref]
        ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad],
                                          lr=LR, weight_decay=WEIGHT_DECAY)
        with torch.no_grad():
            base_loss = _loss(nn.Sequential(*base), *_global_batch(0, world_size)).item()
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = _global_batch(step, world_size)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = _loss(model, x[mine], y[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_mean(loss))
        if rank == 0:
            ref_loss = _loss(ref, x, y)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad(set_to_none=True)
            ref_losses.append(ref_loss.item())
    final = [layer.full_state() for layer in model.layers]  # collective
    x, _ = _global_batch(STEPS, world_size)  # not trained on
    with torch.no_grad():
        logits = model(x)  # collective
    if rank != 0:
        return None
    with torch.no_grad():
        ref_logits = ref(x)
    return dict(losses=losses, ref_losses=ref_losses, base_loss=base_loss, initial=initial,
                sharded_initial=sharded_initial, trainable=trainable, final=final,
                logits=logits, ref_logits=ref_logits,
                ref_final=[{n: p.detach().clone() for n, p in layer.named_parameters()}
                           for layer in ref])


def _expected_trainable(mode: str, layer_index: int) -> list[str]:
    """What each mode trains in the parity model: embed (0), blocks 1..n, final norm, readout."""
    is_block = 1 <= layer_index <= PARITY_CONFIG.num_hidden_layers
    if mode == "biases":
        return sorted(BIAS_NAMES) if is_block else []
    if mode == "lora":
        return sorted(f"attention.{t}.lora_{ab}" for t in ("query_key_value", "dense")
                      for ab in "AB") if is_block else []
    kind = neox.layer_specs(PARITY_CONFIG)[layer_index].kind
    return sorted(n for n, _ in neox.build_layer(kind, PARITY_CONFIG,
                                                 device="meta").named_parameters())


@pytest.mark.parametrize("mode", ["biases", "lora", "full"])
def test_sharded_finetuning_matches_unsharded(world, mode):
    r = world.run(_parity_run, mode)[0]
    torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                               torch.tensor(r["ref_losses"], dtype=torch.float64), **LOSS_TOL)
    assert r["losses"][-1] < r["losses"][0], "training did not lower the loss"
    torch.testing.assert_close(r["logits"], r["ref_logits"], **LOGITS_TOL)
    gauge = key_bias_gauge(PARITY_CONFIG)
    for i, (initial, sharded0, final, ref_final, trainable) in enumerate(zip(
            r["initial"], r["sharded_initial"], r["final"], r["ref_final"], r["trainable"])):
        assert trainable == _expected_trainable(mode, i), f"layer {i}"
        assert sorted(final) == sorted(initial), f"layer {i}: gathered names differ"
        for name, before in initial.items():
            # Sharding and gathering move bytes: the sharded model starts bit-identical.
            assert torch.equal(sharded0[name], before), f"layer {i} {name}: changed by sharding"
            if name in trainable:
                assert not torch.equal(final[name], before), f"layer {i} {name}: not trained"
                got, want = final[name], ref_final[name]
                if name == "attention.query_key_value.bias":
                    got, want = got[~gauge], want[~gauge]
                torch.testing.assert_close(got, want, **PARAM_TOL,
                                           msg=lambda m: f"layer {i} {name}: {m}")
            else:
                assert torch.equal(final[name], before), f"layer {i} {name}: frozen but changed"
    if mode == "lora":
        # B starts at zero, so the adapters add exactly zero: the first loss is the base
        # model's, bit for bit in the unsharded model (same inputs, same operations, plus 0).
        for i, initial in enumerate(r["initial"]):
            for name, t in initial.items():
                if name.endswith("lora_B"):
                    assert not t.any(), f"layer {i} {name} does not start at zero"
        assert r["ref_losses"][0] == r["base_loss"]
        torch.testing.assert_close(r["losses"][0], r["base_loss"], **LOSS_TOL)


# -- the CLI --------------------------------------------------------------------------------------

# Seconds one CLI run may take. A run takes seconds on an idle 2-core machine; this only bounds
# a hang (a deadlocked collective) on a heavily loaded one.
SEED = 5
CLI_SEQ_LEN, CLI_BATCH = 32, 8


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    """A small text file, and a cache shared by every run (the BPE is trained once)."""
    root = tmp_path_factory.mktemp("cli")
    return dict(root=root, data=EXCERPT, cache=root / "cache")


def run_cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return run_module("neox.finetune", *args, **kwargs)


# The LoRA run in bf16 without a sample that the offload tests train, offloaded or not.
LORA_BF16 = ("--finetune", "lora", "--dtype", "bf16", "--sample-tokens", 0)


def common_args(dirs: dict, out: Path) -> list:
    # --cpu: these are the gloo runs, also on a machine with GPUs.
    return ["--cpu", "--data", dirs["data"], "--cache-dir", dirs["cache"], "--output-dir", out,
            "--seq-len", CLI_SEQ_LEN, "--batch-size", CLI_BATCH, "--seed", SEED]


def _check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def run_biases(cli_dirs):
    """1 rank, bias fine-tuning of the whole tiny model, 4 steps, with an HF export."""
    out = cli_dirs["root"] / "biases"
    proc = run_cli("--nproc", 1, "--finetune", "biases", "--max-steps", 4, "--export-hf",
                   "--lr", 1e-2, *common_args(cli_dirs, out))
    _check_ok(proc)
    return proc, out


@pytest.fixture(scope="module")
def run_lora(cli_dirs):
    """2 ranks, LoRA on blocks 1 and 3 of the tiny model, one whole epoch, with an HF export."""
    out = cli_dirs["root"] / "lora"
    proc = run_cli("--nproc", 2, "--finetune", "lora", "--lora-rank", 4, "--filter-layers",
                   "1,3", "--epochs", 1, "--export-hf", "--lr", 1e-2,
                   *common_args(cli_dirs, out))
    _check_ok(proc)
    return proc, out


@pytest.fixture(scope="module")
def run_lora_bf16(cli_dirs):
    """2 ranks, LoRA in bf16, 2 steps, no sample, no offload: the run the offload tests
    compare theirs with."""
    out = cli_dirs["root"] / "lora-bf16"
    proc = run_cli("--nproc", 2, *common_args(cli_dirs, out), *LORA_BF16, "--max-steps", 2)
    _check_ok(proc)
    return proc, out


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return steps, [r for r in records if "loss" not in r]


def comm_table(stdout: str) -> dict[str, tuple[str, str]]:
    """The run's "communication this run" table: collective -> (measured, expected) MiB."""
    lines = stdout[stdout.index("communication this run:"):].splitlines()[2:5]
    return {name: (got, want) for name, got, want in (line.split() for line in lines)}


def check_comm_table(stdout: str) -> None:
    """The steps moved what ZeRO-3 expects of them, to the byte as printed."""
    table = comm_table(stdout)
    assert table["all-gather"][0] == table["all-gather"][1], table
    assert table["reduce-scatter"][0] == table["reduce-scatter"][1], table


def check_run_outputs(proc: subprocess.CompletedProcess, out: Path, *, n_steps: int,
                      world_size: int, trainable_names: set[str]) -> None:
    steps, finals = read_metrics(out)
    assert [r["step"] for r in steps] == list(range(1, n_steps + 1))
    for r in steps:
        for key in ("loss", "acc", "lr", "loss_scale", "tokens_per_s"):
            assert isinstance(r[key], (int, float)) and r[key] == r[key], (key, r)
        assert 0.0 <= r["acc"] <= 1.0 and r["tokens_per_s"] > 0 and r["loss_scale"] == 1.0
    # One line per step: the end of the run's validation is in the last step's line.
    assert finals == [] and {"val_loss", "val_acc"} <= set(steps[-1]), (steps[-1], finals)
    # The memory table, one per rank, and where the results went.
    assert "memory per rank" in proc.stdout
    for rank in range(world_size):
        assert f"rank {rank}/{world_size}:" in proc.stdout
    assert proc.stdout.count("measured / predicted") == world_size
    check_comm_table(proc.stdout)
    ckpt = out / "checkpoints" / f"step-{n_steps:08d}"
    for line in (f"saved: checkpoint {ckpt}",
                 f"saved: trained parameters only {out / 'trainable.safetensors'}",
                 f"saved: Hugging Face export {out / 'hf'}"):
        assert line in proc.stdout
    assert (ckpt / "manifest.json").is_file()
    trained = load_file(str(out / "trainable.safetensors"))
    assert set(trained) == trainable_names
    assert all(t.dtype == torch.float32 for t in trained.values())
    # The trainable-only file holds what the sharded checkpoint holds (fp32 masters, gathered).
    from_ckpt = {f"layers.{i}.{n}": t for i, layer in iter_full_layers(ckpt, trainable_only=True)
                 for n, t in layer.items()}
    assert set(from_ckpt) == set(trained)
    for name, t in trained.items():
        assert torch.equal(from_ckpt[name], t), name


def base_config(hf_dir: Path) -> NeoXConfig:
    """The tiny preset with the vocabulary the run chose (the export's)."""
    exported = json.loads((hf_dir / "config.json").read_text())
    return dataclasses.replace(PRESETS["tiny"], vocab_size=exported["vocab_size"])


@pytest.mark.e2e
def test_cli_one_rank_bias_finetuning(run_biases):
    proc, out = run_biases
    blocks = PRESETS["tiny"].num_hidden_layers
    check_run_outputs(proc, out, n_steps=4, world_size=1,
                      trainable_names={f"layers.{i}.{n}" for i in range(1, blocks + 1)
                                       for n in BIAS_NAMES})
    assert "world size 1" in proc.stdout and f"keeping {blocks}" in proc.stdout


@pytest.mark.e2e
def test_cli_two_ranks_lora_filter_layers_one_epoch(run_lora):
    proc, out = run_lora
    m = re.search(r"([\d,]+) train, [\d,]+ validation", proc.stdout)
    assert m, proc.stdout
    n_train = int(m.group(1).replace(",", ""))
    # One epoch: every rank takes CLI_BATCH windows per step from one shared permutation, the
    # remainder that does not fill a step is dropped (see the module docstring for coverage).
    n_steps = n_train // (2 * CLI_BATCH)
    assert n_steps >= 5  # the corpus is long enough for the run to mean something
    check_run_outputs(proc, out, n_steps=n_steps, world_size=2,
                      trainable_names={f"layers.{i}.attention.{t}.lora_{ab}" for i in (1, 2)
                                       for t in ("query_key_value", "dense") for ab in "AB"})
    steps, _ = read_metrics(out)
    # The sampler rolls over to epoch 1 exactly when the last step of epoch 0 is drawn.
    assert [r["epoch"] for r in steps] == [0] * (n_steps - 1) + [1]
    assert "world size 2" in proc.stdout and "keeping 2" in proc.stdout
    assert "checkpoint block 1" in proc.stdout and "checkpoint block 3" in proc.stdout
    assert "checkpoint block 0" not in proc.stdout and "checkpoint block 2" not in proc.stdout


# The export, read back by transformers and by neox.from_pretrained. fp32; the only difference
# between the two computations is attention (our SDPA call vs transformers' own), which changes
# the accumulation order: differences are ~1e-6 on logits of magnitude ~1 (see
# test_neox_model.py, which uses the same bound); any wrong or missing weight moves them by
# more than 1e-3.
LOGIT_TOL = dict(atol=2e-5, rtol=1e-5)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(3))


def _export_logits(hf_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPTNeoXForCausalLM.from_pretrained(hf_dir).eval()
    ours = neox.from_pretrained(hf_dir)
    with torch.no_grad():
        return hf(ids, use_cache=False).logits, ours(ids)


@pytest.mark.e2e
def test_export_of_bias_finetuning_matches_the_trained_model(run_biases):
    _, out = run_biases
    hf_dir = out / "hf"
    config = base_config(hf_dir)
    ids = _ids(config.vocab_size)
    hf_logits, our_logits = _export_logits(hf_dir, ids)
    torch.testing.assert_close(our_logits, hf_logits, **LOGIT_TOL)
    # The trained model rebuilt from what the run started from (the preset's random weights,
    # same seed) plus the trained biases: the sharded model's function, computed unsharded.
    trained = load_file(str(out / "trainable.safetensors"))
    layers = list(iter_layers(RandomInit(config, seed=SEED)))
    exported = neox.from_pretrained(hf_dir)
    for i, (layer, exp) in enumerate(zip(layers, exported)):
        got = exp.state_dict()
        for name, p in layer.named_parameters():
            key = f"layers.{i}.{name}"
            if key in trained:
                p.data.copy_(trained[key])
            # Frozen weights are exported bit for bit, trained ones as trained (fp32).
            assert torch.equal(got[name], p.detach()), key
    rebuilt = neox.NeoXModel(config, layers)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids), hf_logits, **LOGIT_TOL)
    assert (hf_dir / "tokenizer.json").is_file()


@pytest.mark.e2e
def test_export_of_lora_is_merged_and_matches_the_lora_model(run_lora):
    _, out = run_lora
    hf_dir = out / "hf"
    config = base_config(hf_dir)
    keys = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in keys if "lora" in k]
    exported_config = json.loads((hf_dir / "config.json").read_text())
    assert exported_config["num_hidden_layers"] == 2  # the --filter-layers subset
    ids = _ids(config.vocab_size)
    hf_logits, our_logits = _export_logits(hf_dir, ids)
    torch.testing.assert_close(our_logits, hf_logits, **LOGIT_TOL)
    # The LoRA model as trained, unmerged: base blocks 1 and 3, adapters from the run.
    mode = FinetuneMode("lora", lora_rank=4, lora_alpha=16.0, seed=SEED)
    trained = load_file(str(out / "trainable.safetensors"))
    layers = [prepare_layer(layer, i, mode) for i, layer in
              enumerate(iter_layers(RandomInit(config, seed=SEED), filter_layers=[1, 3]))]
    loaded = 0
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if f"layers.{i}.{name}" in trained:
                p.data.copy_(trained[f"layers.{i}.{name}"])
                loaded += 1
    assert loaded == len(trained)
    assert all(t.any() for n, t in trained.items() if n.endswith("lora_B")), "B never trained"
    lora_model = neox.NeoXModel(dataclasses.replace(config, num_hidden_layers=2), layers,
                                source_layers=[1, 3])
    with torch.no_grad():
        # Merging W + s·BA rounds once per weight where the adapter path adds s·(xA^T)B^T:
        # a different order of the same fp32 sums, so the same tolerance applies.
        torch.testing.assert_close(lora_model(ids), hf_logits, **LOGIT_TOL)


# -- --help and bad inputs ------------------------------------------------------------------------

def test_help_documents_every_flag(capsys):
    proc = run_main(capsys, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    for action in build_parser()._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        assert action.help, f"{action.option_strings} has no help text"
        for flag in action.option_strings:
            assert flag in text, f"{flag} missing from --help"


def run_main(capsys, *args) -> subprocess.CompletedProcess:
    return call_main(finetune_main, capsys, *args)


@pytest.mark.parametrize("value, phrase", [
    ("0,x", "expected indices like"),    # malformed: found before any process starts
    (",", "--filter-layers is empty"),
    ("5-2", "reversed range"),
    ("1,7", "out of range"),             # the tiny preset has blocks 0..3
    ("0-1000000000", "out of range"),    # not expanded before it is checked
])
def test_bad_filter_layers(cli_dirs, tmp_path, capsys, value, phrase):
    proc = run_main(capsys, "--nproc", 1, "--filter-layers", value,
                    *common_args(cli_dirs, tmp_path))
    assert_clean_error(proc, phrase)


def test_missing_checkpoint_directory(cli_dirs, tmp_path, capsys):
    proc = run_main(capsys, "--nproc", 1, "--checkpoint", tmp_path / "nowhere",
                    *common_args(cli_dirs, tmp_path))
    assert_clean_error(proc, "no such directory")


@pytest.mark.e2e
def test_unreadable_data_file_on_two_ranks(cli_dirs, tmp_path):
    # Rank 0 prepares the data alone while rank 1 waits: its error must reach rank 1 as a quiet
    # stop, not as a broken-connection traceback.
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 50)
    args = common_args(cli_dirs, tmp_path)
    args[args.index("--data") + 1] = bad
    proc = run_cli("--nproc", 2, *args)
    assert_clean_error(proc, "is not UTF-8 text")


HF_CONFIG = NeoXConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, cli_dirs):
    """A tiny Hugging Face directory with its own tokenizer (a BPE with fewer ids than the
    vocabulary)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-neox"
    layers = neox.build_layers(HF_CONFIG, generator=torch.Generator().manual_seed(0))
    neox.save_hf(path, HF_CONFIG, iter_layer_states(layers))
    tokenizer = nd.train_bpe(cli_dirs["data"].read_text(), vocab_size=300)
    assert nd.tokenizer_rows(tokenizer) <= HF_CONFIG.vocab_size
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


@pytest.mark.e2e
def test_checkpoint_with_a_missing_layer_file(cli_dirs, hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path / "ckpt")
    # File 3 of 5: embed, block 0, block 1, final norm, readout.
    missing = ckpt / "model-00003-of-00005.safetensors"
    missing.unlink()
    # 2 ranks: both fail on the same layer while the engine is building the model, between its
    # collectives; the error is reported once.
    proc = run_cli("--nproc", 2, "--checkpoint", ckpt, *common_args(cli_dirs, tmp_path / "out"))
    assert_clean_error(proc, "missing file")
    assert missing.name in proc.stderr


@pytest.mark.e2e
def test_checkpoint_with_wrong_shapes(cli_dirs, hf_checkpoint, tmp_path):
    ckpt = _copy(hf_checkpoint, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 48  # the stored MLP weights are 64 wide
    (ckpt / "config.json").write_text(json.dumps(config))
    proc = run_cli("--nproc", 1, "--checkpoint", ckpt, *common_args(cli_dirs, tmp_path / "out"))
    assert_clean_error(proc, "does not match the configuration")
    assert "mlp.dense_h_to_4h" in proc.stderr


@pytest.mark.e2e
def test_tokenizer_larger_than_the_vocabulary(cli_dirs, hf_checkpoint, tmp_path):
    big = nd.train_bpe(cli_dirs["data"].read_text(), vocab_size=600)
    assert nd.tokenizer_rows(big) > HF_CONFIG.vocab_size
    big.save(str(tmp_path / "big.json"))
    proc = run_cli("--nproc", 1, "--checkpoint", hf_checkpoint, "--tokenizer",
                   tmp_path / "big.json", *common_args(cli_dirs, tmp_path / "out"))
    assert_clean_error(proc, "tokenizer larger than the vocabulary")


@pytest.mark.e2e
def test_the_built_in_run_learns_visibly(cli_dirs, tmp_path):
    """Without --checkpoint there is nothing pretrained to fine-tune: the built-in run trains
    the tiny preset from scratch, says so, and ends with a text sample. Measured on this
    excerpt over 30 steps: the training loss falls 7.62 -> 5.79 from scratch, and 7.62 -> 7.57
    with the biases alone (the old built-in run); a fall of 1 nat separates them with a wide
    margin either way."""
    out = tmp_path / "out"
    proc = run_cli("--cpu", "--data", cli_dirs["data"], "--cache-dir", cli_dirs["cache"],
                   "--output-dir", out, "--max-steps", 30, "--seq-len", 64, "--batch-size", 8)
    _check_ok(proc)
    assert "no --checkpoint: there are no pretrained weights to fine-tune" in proc.stdout
    losses = [r["loss"] for r in read_metrics(out)[0]]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0, losses
    sample = proc.stdout[proc.stdout.index("sample (48 tokens"):]
    assert len(sample.splitlines()) > 1  # the sample's text follows on its own lines


def test_the_steps_traffic_adds_every_count_of_bytes_moved():
    """What the loop adds up around each validation: every collective's bytes (HSDP's replica
    all-reduces too), the expectations per step as they are."""
    a = zerocore.CommReport(10, 20, 1, 100, 200, ways="w", replica_all_reduce_bytes=5,
                            expected_replica_all_reduce_bytes=7)
    b = dataclasses.replace(a, all_gather_bytes=30, replica_all_reduce_bytes=6)
    both = _plus(a, b)
    assert (both.all_gather_bytes, both.reduce_scatter_bytes, both.all_reduce_bytes,
            both.replica_all_reduce_bytes) == (40, 40, 2, 11)
    assert (both.expected_all_gather_bytes, both.expected_reduce_scatter_bytes,
            both.expected_replica_all_reduce_bytes, both.ways) == (100, 200, 7, "w")
    assert _plus(None, b) is b


@pytest.mark.e2e
def test_the_communication_table_is_of_the_steps_not_the_validation(cli_dirs, tmp_path):
    """Validated at steps 2 and 4 (--eval-every 2; the last step always is), the run's
    communication table still shows what its 4 steps moved, measured equal to the expectation:
    the validation's forwards gather every layer too (the built-in run's table showed 38 MiB
    more than expected once the last validation moved into the training loop). With two
    micro-batches per step: every pass gathers and reduces (the table once expected one pass
    per step)."""
    out = tmp_path / "out"
    proc = run_cli("--nproc", 2, *common_args(cli_dirs, out), "--max-steps", 4,
                   "--eval-every", 2, "--sample-tokens", 0, "--grad-accum", 2)
    _check_ok(proc)
    steps, _ = read_metrics(out)
    assert [("val_loss" in r) for r in steps] == [False, True, False, True]
    check_comm_table(proc.stdout)


@pytest.mark.e2e
@pytest.mark.parametrize("flag, reduced", [((), "float32"), (("--reduce-dtype", "bf16"),
                                                                "bfloat16")])
def test_gradients_are_summed_in_fp32_unless_asked(cli_dirs, tmp_path, flag, reduced):
    # Computing in bf16, the gradients are still reduce-scattered in fp32 by default: a bf16
    # sum over many ranks loses bits at every hop. --reduce-dtype bf16 trades them for traffic.
    out = tmp_path / "out"
    proc = run_cli(*common_args(cli_dirs, out), "--dtype", "bf16", "--max-steps", 1,
                   "--sample-tokens", 0, *flag)
    _check_ok(proc)
    manifest = json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())
    assert (manifest["param_dtype"], manifest["reduce_dtype"]) == ("bfloat16", reduced)
    assert f"gradients summed in {'fp32' if not flag else 'bf16'}" in proc.stdout


@pytest.mark.e2e
def test_compile_trains_as_eager(cli_dirs, tmp_path):
    # --compile: each layer's forward compiled under the engine; the same losses to rounding
    # (inductor fuses elementwise work: about 1e-7 relative per step in fp32, tests/engine/
    # test_compile.py; 1e-4 over two steps of Adam leaves room and nothing for a missed step).
    losses = {}
    for flag in ((), ("--compile",)):
        out = tmp_path / ("compiled" if flag else "eager")
        proc = run_cli("--nproc", 1, *common_args(cli_dirs, out), "--max-steps", 2,
                       "--sample-tokens", 0, *flag)
        _check_ok(proc)
        assert ("forward compiled (torch.compile)" in proc.stdout) == bool(flag)
        losses[bool(flag)] = [r["loss"] for r in read_metrics(out)[0]]
    assert len(losses[True]) == 2
    for e, c in zip(losses[False], losses[True]):
        assert abs(c - e) <= 1e-4 * abs(e), losses


@pytest.mark.e2e
def test_offload_trains_bitwise_as_without(cli_dirs, run_lora_bf16, tmp_path):
    # --offload params|optimizer|all (zerocore.Offload) and the older --offload-optimizer: a
    # LoRA run in bf16 on 2 ranks (frozen base weights and bf16 copies: every kind of shard
    # the parameter offload moves) gives the same losses, bit for bit, as without offload.
    losses, lines = {}, {}
    for flag in ((), ("--offload", "params"), ("--offload", "all"), ("--offload-optimizer",)):
        if flag:
            out = tmp_path / "-".join(flag).strip("-")
            proc = run_cli("--nproc", 2, *common_args(cli_dirs, out), *LORA_BF16,
                           "--max-steps", 2, *flag)
            _check_ok(proc)
        else:
            proc, out = run_lora_bf16
        losses[flag] = [r["loss"] for r in read_metrics(out)[0]]
        lines[flag] = next(line for line in proc.stdout.splitlines() if "fine-tuning" in line)
    assert len(losses[()]) == 2
    for flag, got in losses.items():
        assert got == losses[()], (flag, losses)
    assert "in CPU memory" not in lines[()]
    assert "; parameter shards in CPU memory" in lines[("--offload", "params")]
    assert ("; parameter shards and optimizer state in CPU memory"
            in lines[("--offload", "all")])
    assert "; optimizer state in CPU memory" in lines[("--offload-optimizer",)]
    # (the optimizer's pass overlapped by default, and said so: --offload-overlap exact)
    assert "the optimizer's pass overlaps the next forward (exact)" in \
        lines[("--offload-optimizer",)]
    assert "optimizer's pass" not in lines[("--offload", "params")]


@pytest.mark.e2e
def test_nvme_offload_from_the_flags_to_a_run_resumed_in_memory(cli_dirs, run_lora_bf16,
                                                               tmp_path):
    # --offload optimizer --offload-device nvme --offload-path DIR: the LoRA bf16 run above on
    # 2 ranks, its first step with the masters and moments on NVMe, saved, then resumed in host
    # memory (--offload-device cpu, given on --resume): the same losses, bit for bit, as the
    # run without offload; nothing left in the scratch directory.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    same = ("--nproc", 2, *LORA_BF16)
    _, plain = run_lora_bf16
    out = tmp_path / "nvme"
    proc = run_cli(*same, *common_args(cli_dirs, out), "--max-steps", 1, "--offload",
                   "optimizer", "--offload-device", "nvme", "--offload-path", scratch,
                   "--offload-pool", "1MiB")
    _check_ok(proc)
    assert f"; optimizer state on NVMe (fp32 masters and Adam moments in scratch files in " \
           f"{scratch.resolve()})" in proc.stdout
    resumed = run_cli("--resume", out / "checkpoints", "--output-dir", out, "--max-steps", 2,
                      "--offload-device", "cpu")
    _check_ok(resumed)
    assert "; optimizer state in CPU memory" in resumed.stdout
    got = [r["loss"] for r in read_metrics(out)[0]]
    assert len(got) == 2 and got == [r["loss"] for r in read_metrics(plain)[0]]
    assert list(scratch.iterdir()) == []
    missing = run_cli(*same, *common_args(cli_dirs, tmp_path / "refused"), "--offload",
                      "optimizer", "--offload-device", "nvme")
    assert missing.returncode == 2 and "needs --offload-path DIR" in missing.stderr


@pytest.mark.e2e
def test_a_scratch_disk_too_small_by_a_layer_is_one_line_and_keeps_the_checkpoint(cli_dirs,
                                                                                  tmp_path):
    # Issue 40, item 3: a run resumed with its optimizer on NVMe, on a 2 MiB disk both ranks
    # share: the embedding's scratch fits and a block's does not on one rank, while the other
    # goes on to read the next layer (a collective). It aborted with gloo's EnforceNotMet
    # (exit 134); now one line, exit 2, the checkpoint as it was, and no scratch left.
    with private_disk(tmp_path / "scratch", size="2m") as disk:
        if not disk.exact:
            pytest.skip("needs a tmpfs of its own (mount -t tmpfs): two ranks sharing a disk "
                        "that fills between them")
        out = tmp_path / "run"
        _check_ok(run_cli("--nproc", 2, *common_args(cli_dirs, out), "--finetune", "full",
                          "--max-steps", 1, "--sample-tokens", 0))
        saved = zerocore.latest_checkpoint(out / "checkpoints")
        proc = run_cli("--resume", out / "checkpoints", "--output-dir", out, "--max-steps", 2,
                       "--offload", "optimizer", "--offload-device", "nvme", "--offload-path",
                       disk.path, "--offload-pool", "1MiB")
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        assert_clean_error(proc, "no room for the scratch")
        assert zerocore.latest_checkpoint(out / "checkpoints") == saved
        zerocore.verify_files(saved, zerocore.read_manifest(saved))
        assert os.listdir(disk.path) == [] and disk.used() == 0


@pytest.mark.e2e
def test_torchrun_joins_its_group(cli_dirs, tmp_path):
    """Under torchrun (RANK/WORLD_SIZE set by the launcher) the CLI joins that group instead of
    spawning: the way it runs across machines."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "neox.finetune", "--max-steps", "2",
         *map(str, common_args(cli_dirs, tmp_path / "out"))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    _check_ok(proc)
    assert "world size 2, init env://" in proc.stdout
    assert proc.stdout.count("n_gpus:") == 1  # the banner once, not once per process
    steps, _ = read_metrics(tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2]
